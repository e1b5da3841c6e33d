// moe_align_block_size on the device (spec/numerics.md §2), in one thread block (many blocks for
// large pair counts: moe_align_count / scan / place_kernel below): count the
// (token, slot) pairs per local expert, pad every expert's list to a multiple of the GEMM's M tile,
// and scatter the flat indices (token * topk + slot) into sorted order. Slots whose expert is -1
// or not on this rank (expert_map) are dropped here: their contribution is zero, which is what
// vLLM's "-1 blocks write zeros" produces after the top-k sum.
//
// Outputs (workspace):
//   sorted_ids   (capacity)           i32  flat index, or the sentinel num_valid for padding
//   expert_blk   (capacity / bm)      i32  local expert of each M tile, -1 past the end
//   meta[0]                           i32  number of padded rows (num_tokens_post_padded)
//   expert_count (E_local)            i32  pairs per local expert
//   expert_off   (E_local + 1)        i32  first padded row of each expert
//   pair_pos     (num_valid)          i32  optional: sorted position of pair i, -1 if dropped
//
// With fixed_stride > 0 the layout is the batched one of BatchedTritonExperts instead: expert e
// owns rows [e * fixed_stride, (e + 1) * fixed_stride), filled from the front; tiles past an
// expert's count get expert_blk = -1.
#pragma once

#include "cuda_common.cuh"

namespace fp8moe::cuda {

constexpr int kAlignThreads = 1024;

// Local expert of a global id: -1 for padded slots (-1), out-of-range ids and experts of other
// ranks.
__device__ __forceinline__ int local_expert(int32_t gid, const int32_t* expert_map, int E_global,
                                            int E_local) {
  if (gid < 0 || gid >= E_global) return -1;
  const int e = expert_map ? expert_map[gid] : gid;
  return (e >= 0 && e < E_local) ? e : -1;
}

// The tables of one alignment from the per-expert counts cnt[E_local] (shared memory, complete):
// the exclusive scan of the padded counts into off[E_local + 1] (shared), meta, expert_count,
// expert_off, expert_blk, and the sentinel num_valid in sorted_ids[0, total). Called by all
// kAlignThreads threads of one block; ends with a __syncthreads (off is complete after it).
__device__ __forceinline__ void align_tables(const int32_t* cnt, int32_t* off, int num_valid,
                                             int E_local, int bm, int capacity, int fixed_stride,
                                             int32_t* __restrict__ sorted_ids,
                                             int32_t* __restrict__ expert_blk,
                                             int32_t* __restrict__ meta,
                                             int32_t* __restrict__ expert_count,
                                             int32_t* __restrict__ expert_off) {
  __shared__ int32_t warp_tot[kAlignThreads / 32];
  const int tid = threadIdx.x;
  // exclusive scan of padded counts; E_local <= 1024 = one value per thread
  const int lane = tid & 31, warp = tid >> 5;
  int v = 0;
  if (tid < E_local) v = fixed_stride > 0 ? fixed_stride : (cnt[tid] + bm - 1) / bm * bm;
  int incl = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int n = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += n;
  }
  if (lane == 31) warp_tot[warp] = incl;
  __syncthreads();
  if (warp == 0) {
    int w = warp_tot[lane];
    int wincl = w;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int n = __shfl_up_sync(0xffffffffu, wincl, o);
      if (lane >= o) wincl += n;
    }
    warp_tot[lane] = wincl - w;  // exclusive prefix of warps
  }
  __syncthreads();
  const int excl = warp_tot[warp] + incl - v;
  if (tid < E_local) off[tid] = excl;
  if (tid == E_local - 1) off[E_local] = excl + v;
  __syncthreads();
  const int total = off[E_local];
  if (tid == 0) meta[0] = total;
  for (int e = tid; e < E_local; e += blockDim.x) {
    expert_count[e] = cnt[e];
    expert_off[e] = off[e];
  }
  if (tid == 0) expert_off[E_local] = total;
  const int nblk = capacity / bm;
  for (int b = tid; b < nblk; b += blockDim.x) {
    int e = -1;
    const int row = b * bm;
    if (row < total) {
      int lo = 0, hi = E_local - 1;  // last e with off[e] <= row
      while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (off[mid] <= row)
          lo = mid;
        else
          hi = mid - 1;
      }
      e = lo;
      if (fixed_stride > 0 && row - off[e] >= cnt[e]) e = -1;
    }
    expert_blk[b] = e;
  }
  for (int p = tid; p < total; p += blockDim.x) sorted_ids[p] = num_valid;
  __syncthreads();
}

static __global__ void __launch_bounds__(kAlignThreads)
    moe_align_kernel(const int32_t* __restrict__ topk_ids, int num_valid,
                     const int32_t* __restrict__ expert_map, int E_global, int E_local, int bm,
                     int capacity, int fixed_stride, int32_t* __restrict__ sorted_ids,
                     int32_t* __restrict__ expert_blk, int32_t* __restrict__ meta,
                     int32_t* __restrict__ expert_count, int32_t* __restrict__ expert_off,
                     int32_t* __restrict__ pair_pos) {
  extern __shared__ int32_t align_smem[];
  int32_t* cnt = align_smem;            // E_local
  int32_t* off = align_smem + E_local;  // E_local + 1
  int32_t* cur = off + E_local + 1;     // E_local
  const int tid = threadIdx.x;
  for (int e = tid; e < E_local; e += blockDim.x) {
    cnt[e] = 0;
    cur[e] = 0;
  }
  __syncthreads();
  for (int i = tid; i < num_valid; i += blockDim.x) {
    const int e = local_expert(topk_ids[i], expert_map, E_global, E_local);
    if (e >= 0) atomicAdd(&cnt[e], 1);
  }
  __syncthreads();
  align_tables(cnt, off, num_valid, E_local, bm, capacity, fixed_stride, sorted_ids, expert_blk,
               meta, expert_count, expert_off);
  for (int i = tid; i < num_valid; i += blockDim.x) {
    const int e = local_expert(topk_ids[i], expert_map, E_global, E_local);
    int pos = -1;
    if (e >= 0) {
      pos = off[e] + atomicAdd(&cur[e], 1);
      sorted_ids[pos] = i;
    }
    if (pair_pos) pair_pos[i] = pos;
  }
}

// The same alignment over many blocks, for large pair counts (the one-block kernel is bound by one
// SM's memory latency: 102 us for 65,536 pairs on the H200, run 18). Three kernels:
//   1. each block counts its chunk of pairs per expert into part[b][e];
//   2. one block sums the parts (part[b][e] becomes the chunk's first slot within expert e) and
//      builds the tables with align_tables;
//   3. each block places its chunk's pairs from expert_off[e] + part[b][e] on.
// Within an expert the pairs' order is whatever the atomics give, as in the one-block kernel (the
// sorted order within an expert does not change any output).
constexpr int kAlignSplitThreads = 256;

static __global__ void __launch_bounds__(kAlignSplitThreads)
    moe_align_count_kernel(const int32_t* __restrict__ topk_ids, int num_valid, int chunk,
                           const int32_t* __restrict__ expert_map, int E_global, int E_local,
                           int32_t* __restrict__ part) {
  extern __shared__ int32_t align_smem[];
  int32_t* cnt = align_smem;  // E_local
  for (int e = threadIdx.x; e < E_local; e += blockDim.x) cnt[e] = 0;
  __syncthreads();
  const int i0 = blockIdx.x * chunk, i1 = min(num_valid, i0 + chunk);
  for (int i = i0 + threadIdx.x; i < i1; i += blockDim.x) {
    const int e = local_expert(topk_ids[i], expert_map, E_global, E_local);
    if (e >= 0) atomicAdd(&cnt[e], 1);
  }
  __syncthreads();
  for (int e = threadIdx.x; e < E_local; e += blockDim.x)
    part[int64_t(blockIdx.x) * E_local + e] = cnt[e];
}

static __global__ void __launch_bounds__(kAlignThreads)
    moe_align_scan_kernel(int num_valid, int nparts, int E_local, int bm, int capacity,
                          int32_t* __restrict__ part, int32_t* __restrict__ sorted_ids,
                          int32_t* __restrict__ expert_blk, int32_t* __restrict__ meta,
                          int32_t* __restrict__ expert_count, int32_t* __restrict__ expert_off) {
  extern __shared__ int32_t align_smem[];
  int32_t* cnt = align_smem;            // E_local
  int32_t* off = align_smem + E_local;  // E_local + 1
  constexpr int kBatch = 16;  // parts loaded before they are rewritten: one latency per batch
  for (int e = threadIdx.x; e < E_local; e += blockDim.x) {
    int run = 0;
    for (int b0 = 0; b0 < nparts; b0 += kBatch) {
      int c[kBatch];
#pragma unroll
      for (int k = 0; k < kBatch; ++k)
        c[k] = b0 + k < nparts ? part[int64_t(b0 + k) * E_local + e] : 0;
#pragma unroll
      for (int k = 0; k < kBatch; ++k) {
        if (b0 + k < nparts) part[int64_t(b0 + k) * E_local + e] = run;
        run += c[k];
      }
    }
    cnt[e] = run;
  }
  __syncthreads();
  align_tables(cnt, off, num_valid, E_local, bm, capacity, 0, sorted_ids, expert_blk, meta,
               expert_count, expert_off);
}

static __global__ void __launch_bounds__(kAlignSplitThreads)
    moe_align_place_kernel(const int32_t* __restrict__ topk_ids, int num_valid, int chunk,
                           const int32_t* __restrict__ expert_map, int E_global, int E_local,
                           const int32_t* __restrict__ part, const int32_t* __restrict__ expert_off,
                           int32_t* __restrict__ sorted_ids, int32_t* __restrict__ pair_pos) {
  extern __shared__ int32_t align_smem[];
  int32_t* cur = align_smem;  // E_local
  for (int e = threadIdx.x; e < E_local; e += blockDim.x)
    cur[e] = expert_off[e] + part[int64_t(blockIdx.x) * E_local + e];
  __syncthreads();
  const int i0 = blockIdx.x * chunk, i1 = min(num_valid, i0 + chunk);
  for (int i = i0 + threadIdx.x; i < i1; i += blockDim.x) {
    const int e = local_expert(topk_ids[i], expert_map, E_global, E_local);
    int pos = -1;
    if (e >= 0) {
      pos = atomicAdd(&cur[e], 1);
      sorted_ids[pos] = i;
    }
    if (pair_pos) pair_pos[i] = pos;
  }
}

// Rows of an externally batched input (E_local, T, H) with counts per expert, mapped onto the
// internal layout of T_pad = round_up(T, bm) rows per expert: sorted_ids[e * T_pad + i] is the
// external row e * T + i for i < count[e] and the sentinel E_local * T otherwise.
static __global__ void __launch_bounds__(256)
    batched_rows_kernel(const int32_t* __restrict__ counts, int E_local, int T, int T_pad, int bm,
                        int32_t* __restrict__ sorted_ids, int32_t* __restrict__ expert_blk,
                        int32_t* __restrict__ meta) {
  const int64_t n = int64_t(E_local) * T_pad;
  const int sentinel = E_local * T;
  for (int64_t p = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; p < n;
       p += int64_t(gridDim.x) * blockDim.x) {
    const int e = static_cast<int>(p / T_pad), i = static_cast<int>(p % T_pad);
    const int c = min(max(counts[e], 0), T);
    sorted_ids[p] = i < c ? e * T + i : sentinel;
    if (i % bm == 0) expert_blk[p / bm] = i < c ? e : -1;
  }
  if (blockIdx.x == 0 && threadIdx.x == 0) meta[0] = static_cast<int32_t>(n);
}

}  // namespace fp8moe::cuda
