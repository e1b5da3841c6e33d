// The alignment (smxx_moe_align.cuh) and the 1 x 128 quantisation of x into the sorted rows
// (quant_group_scatter_kernel, smxx_fp8_quant.cuh) in one kernel, for the small batches: one
// launch instead of two on the small-M chain, where each kernel of the chain costs a few
// microseconds of launch, ramp and drain (docs/PERFORMANCE.md, grouped run 10: five small kernels
// take 16-22 us of DeepSeek TP8's 240 us layer at M = 32).
//
// Every block aligns all pairs itself (the pair counts here are small: at most
// kAlignQuantMaxPairs), so no block waits for another; block 0 alone writes the tables. For the
// blocks to agree on every pair's sorted position without talking, the position within an expert
// is deterministic: pairs of one expert in the order of their index (a warp walks the pairs 32 at
// a time, __match_any_sync groups the lanes of one expert, each takes its rank among them). The
// one-block alignment orders them by its atomics instead; no output depends on that order (each
// row of the GEMMs is computed alone), and the tables (counts, offsets, expert per m-block, padded
// rows) are the same. Then each block quantises its tokens (t = block, block + grid, ...) with the
// same operations as quant_group_scatter_kernel (so the same codes and scales) and writes them to
// the sorted rows of the token's pairs; the loads and the arithmetic of its first tokens are issued
// before the alignment, so they overlap it. Launched with programmatic stream serialization right
// after the routing kernel (which triggers at its top), the blocks start while the routing runs:
// x is final then (the routing kernel itself launched plainly, after everything before it), and
// pdl_wait() holds the alignment until the routing's topk_ids are written.
#include <algorithm>
#include <string>

#include "cuda_check.hpp"
#include "fp8moe/error.hpp"
#include "moe_launchers.hpp"
#include "smxx_fp8_quant.cuh"
#include "smxx_moe_align.cuh"

namespace fp8moe::cuda {

namespace {

template <typename T>
__global__ void __launch_bounds__(kAlignThreads)
    moe_align_quant_kernel(const int32_t* __restrict__ topk_ids, int num_valid,
                           const int32_t* __restrict__ expert_map, int E_global, int E_local,
                           int bm, int capacity, int32_t* __restrict__ sorted_ids,
                           int32_t* __restrict__ expert_blk, int32_t* __restrict__ meta,
                           int32_t* __restrict__ expert_count, int32_t* __restrict__ expert_off,
                           int32_t* __restrict__ pair_pos, const T* __restrict__ x,
                           int64_t x_stride, int M, int topk, RowScale rs, int cols,
                           uint8_t* __restrict__ q, int64_t q_stride, float* __restrict__ s_out,
                           int64_t s_stride, int ue8m0, float min_scale) {
  extern __shared__ int32_t aq_smem[];
  int32_t* cnt = aq_smem;            // E_local
  int32_t* off = cnt + E_local;      // E_local + 1
  int32_t* run = off + E_local + 1;  // E_local: pairs placed so far per expert
  int32_t* pos = run + E_local;      // num_valid: local expert, then sorted position
  constexpr int kTpg = 128 / 8;      // threads per 1 x 128 group
  const int tid = threadIdx.x;
  const int c8_per_row = cols / 8;
  // this block's tokens t = blockIdx.x + j * gridDim.x, flattened with their 8-column chunks
  const int my_tokens = (M - static_cast<int>(blockIdx.x) + static_cast<int>(gridDim.x) - 1) /
                        static_cast<int>(gridDim.x);
  const int my_chunks = my_tokens * c8_per_row;
  // one pass: blockDim.x chunks (every thread of a group in the same pass: c8_per_row and
  // blockDim.x are multiples of kTpg)
  auto quantise = [&](int idx, float(&v)[8], float& s, int& t, int& c8) {
    const bool ok = idx < my_chunks;  // uniform per group
    t = static_cast<int>(blockIdx.x) + (idx / c8_per_row) * static_cast<int>(gridDim.x);
    c8 = idx % c8_per_row;
    const float amax = group_max<kTpg>(token_load8<T>(x, x_stride, rs, t, c8, ok, v));
    s = group_scale(amax, ue8m0 != 0, min_scale);
    return ok;
  };
  auto store = [&](const float(&v)[8], float s, int t, int c8) {
    scatter8<kTpg>(
        v, s, topk, [&](int k) { return pos[t * topk + k]; }, c8, q, q_stride, s_out, s_stride);
  };
  // the first pass's loads and scales, before the alignment (and before the routing has finished,
  // unless a row scale is applied: the router weights come from the routing kernel)
  if (rs.w) pdl_wait();
  float v0[8];
  float s0 = 0.0f;
  int t0 = 0, c80 = 0;
  const bool ok0 = quantise(tid, v0, s0, t0, c80);

  // ---- the alignment (every block) ----
  pdl_wait();  // topk_ids of a routing kernel launched just before (a no-op without the attribute)
  for (int e = tid; e < E_local; e += blockDim.x) {
    cnt[e] = 0;
    run[e] = 0;
  }
  __syncthreads();
  for (int i = tid; i < num_valid; i += blockDim.x) {
    const int e = local_expert(topk_ids[i], expert_map, E_global, E_local);
    pos[i] = e;
    if (e >= 0) atomicAdd(&cnt[e], 1);
  }
  __syncthreads();
  const bool writer = blockIdx.x == 0;
  align_tables(cnt, off, num_valid, E_local, bm, capacity, 0, sorted_ids, expert_blk, meta,
               expert_count, expert_off, writer);
  if (tid < 32) {  // ranks within each expert, in pair order
    const int lane = tid;
    for (int base = 0; base < num_valid; base += 32) {
      const int i = base + lane;
      const int e = i < num_valid ? pos[i] : -2;
      const unsigned peers = __match_any_sync(0xffffffffu, e);
      const int rank = __popc(peers & ((1u << lane) - 1u));
      const int before = e >= 0 ? run[e] : 0;
      __syncwarp();
      if (e >= 0) {
        if (lane == 31 - __clz(peers)) run[e] = before + __popc(peers);  // the last of its expert
        pos[i] = off[e] + before + rank;
      } else if (e == -1) {
        pos[i] = -1;
      }
      __syncwarp();
    }
  }
  __syncthreads();
  if (writer) {
    for (int i = tid; i < num_valid; i += blockDim.x) {
      const int p = pos[i];
      if (p >= 0) sorted_ids[p] = i;  // after align_tables' sentinel fill (its last barrier)
      if (pair_pos) pair_pos[i] = p;
    }
  }

  // ---- the quantised rows, to the sorted rows of each token's pairs ----
  if (ok0) store(v0, s0, t0, c80);
  for (int idx0 = static_cast<int>(blockDim.x); idx0 < my_chunks; idx0 += blockDim.x) {
    float v[8];
    float s;
    int t, c8;
    if (quantise(idx0 + tid, v, s, t, c8)) store(v, s, t, c8);
  }
}

}  // namespace

void launch_align_quant(const int32_t* topk_ids, int num_valid, const int32_t* expert_map,
                        int E_global, int E_local, int bm, int capacity, const AlignOut& out,
                        const QuantSpec& spec, const void* x, bool x_f32, int64_t x_stride, int M,
                        int topk, const RowScale& rs, int cols, const QuantOut& qout,
                        cudaStream_t stream, bool after_route) {
  if (spec.kind != AQuant::kGroupDynamic || spec.gk != 128 || cols <= 0 || cols % 128 != 0)
    throw NotImplementedError("cuda: the alignment + quantisation kernel runs 1 x 128 groups only");
  if (num_valid > kAlignQuantMaxPairs || E_local > kAlignThreads || num_valid != M * topk)
    throw ValueError(
        "cuda: launch_align_quant takes M * topk <= " + std::to_string(kAlignQuantMaxPairs) +
        " pairs and <= " + std::to_string(kAlignThreads) + " local experts");
  if (M == 0) {  // no tokens: the tables of no pairs (meta[0] = 0), as launch_align writes them
    launch_align(topk_ids, 0, expert_map, E_global, E_local, bm, capacity, 0, out, stream);
    return;
  }
  const int grid = std::min(M, kAlignQuantMaxBlocks);
  const int smem = (3 * E_local + 1 + num_valid) * static_cast<int>(sizeof(int32_t));
  const int ue8m0 = spec.ue8m0 ? 1 : 0;
  if (x_f32)
    launch_pdl(after_route, moe_align_quant_kernel<float>, dim3(grid), dim3(kAlignThreads),
               static_cast<size_t>(smem), stream, topk_ids, num_valid, expert_map, E_global,
               E_local, bm, capacity, out.sorted_ids, out.expert_blk, out.meta, out.expert_count,
               out.expert_off, out.pair_pos, static_cast<const float*>(x), x_stride, M, topk, rs,
               cols, qout.q, qout.q_stride, qout.s, qout.s_stride, ue8m0, spec.min_scale);
  else
    launch_pdl(after_route, moe_align_quant_kernel<uint16_t>, dim3(grid), dim3(kAlignThreads),
               static_cast<size_t>(smem), stream, topk_ids, num_valid, expert_map, E_global,
               E_local, bm, capacity, out.sorted_ids, out.expert_blk, out.meta, out.expert_count,
               out.expert_off, out.pair_pos, static_cast<const uint16_t*>(x), x_stride, M, topk, rs,
               cols, qout.q, qout.q_stride, qout.s, qout.s_stride, ue8m0, spec.min_scale);
}

}  // namespace fp8moe::cuda
