// Hopper FP8 grouped GEMM (sm_90a), warp-specialised: the kernel of sm90_fp8_grouped_gemm.hpp.
//
// One persistent CTA per SM walks 128 x 128 output tiles (expert, m-block, n-block) in a grouped
// order (8 m-blocks per group, n-blocks inside a group) so that the CTAs running together share A
// and B tiles in L2. Three warpgroups:
//   WG0  producer (registers lowered to 40): one thread issues, per 128-wide K block, a TMA load of
//        the 128 A rows (128 x 128 B) and of the expert's 128 weight rows (128 x 128 B), both with
//        the 128-byte swizzle, into a kGStages-deep shared-memory ring (full/empty mbarriers). The
//        ring runs on across tiles, so the next tile streams in during an epilogue.
//   WG1, WG2  consumers (registers raised to 232): rows 0-63 and 64-127 of the tile. Per K block:
//        4 x wgmma m64n128k32 e4m3 into a fresh fp32 partial, then promotion in registers:
//        acc += partial * (a_scale[row, kb] * b_scale[e, nb, kb]) (Hopper's FP8 wgmma adds with
//        reduced precision inside the tensor core; promoting every 128 of K bounds that error,
//        the DeepSeek-V3 recipe). The two warpgroups alternate on the tensor core while the other
//        promotes.
// Epilogue per warpgroup: bias, row weight, rounding to bf16, staged through padded shared memory
// (conflict-free), 16-byte stores to the destination rows (sorted position, (token, slot) row or
// masked slab row).
// Variants: grouped_gemm_n256_kernel (128 x 256 tiles, two 128-row B halves per stage; the default
// where N % 256 == 0), with an optional GEMM1 epilogue that fuses the gated activation and the 1 x
// 128 quantisation of h (paired gate/up halves); grouped_gemm_swap_kernel (<= 64 rows per expert).
#pragma once

#include "cuda_common.cuh"
#include "sm90_fp8_grouped_gemm.hpp"
#include "smxx_fp8_quant.cuh"

namespace fp8moe::cuda {

constexpr int kGBM = 128, kGBN = 128, kGBK = 128;
constexpr int kGStages = 5;
constexpr int kGThreads = 384;
constexpr int kGAStage = kGBM * kGBK;  // 16 KB
constexpr int kGBStage = kGBN * kGBK;  // 16 KB
constexpr int kGStageBytes = kGAStage + kGBStage;
constexpr int kGEpiPitch = kGBN + 8;                 // bf16 per staged row (272 B: no conflicts)
constexpr int kGEpiBytes = 2 * 64 * kGEpiPitch * 2;  // both consumer warpgroups
constexpr int kGGroupM =
    8;  // m-blocks per scheduling group (default of GroupedGemmParams::group_m)
constexpr int kGSmemBytes = 1024 + kGStages * kGStageBytes + kGEpiBytes + 2 * kGStages * 8 +
                            (kGroupedMaxExperts + 1) * 4 + 64;

// K-major operand, 128-byte swizzle: rows of 128 bytes, 8-row groups 1024 bytes apart.
__device__ __forceinline__ uint64_t gg_desc(const void* smem) {
  const uint64_t addr = smem_u32(smem);
  uint64_t d = 0;
  d |= (addr & 0x3FFFFull) >> 4;   // start address (16-byte units)
  d |= uint64_t(1) << 16;          // leading byte offset (ignored with swizzle)
  d |= uint64_t(1024 >> 4) << 32;  // stride byte offset: next 8-row group
  d |= uint64_t(1) << 62;          // 128-byte swizzle
  return d;
}

__device__ __forceinline__ void gg_fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void gg_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void gg_wait0() {
  asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
}
template <int kN>
__device__ __forceinline__ void gg_reg_fence(float (&d)[kN]) {
#pragma unroll
  for (int i = 0; i < kN; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
__device__ __forceinline__ void gg_bar(int id, int count) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}
template <int kRegs>
__device__ __forceinline__ void gg_setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}
template <int kRegs>
__device__ __forceinline__ void gg_setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}

// acc[kOff + i] += part[i] * (s0 for columns of row lo, s1 for row hi): the promotion of one
// 64 x 128 wgmma partial (quads: row lo's two columns, then row hi's).
template <int kOff, int kN>
__device__ __forceinline__ void gg_promote(float (&acc)[kN], const float (&part)[64], float s0,
                                           float s1) {
  static_assert(kOff + 64 <= kN, "promotion: accumulator range");
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    acc[kOff + 4 * j + 0] = fmaf(part[4 * j + 0], s0, acc[kOff + 4 * j + 0]);
    acc[kOff + 4 * j + 1] = fmaf(part[4 * j + 1], s0, acc[kOff + 4 * j + 1]);
    acc[kOff + 4 * j + 2] = fmaf(part[4 * j + 2], s1, acc[kOff + 4 * j + 2]);
    acc[kOff + 4 * j + 3] = fmaf(part[4 * j + 3], s1, acc[kOff + 4 * j + 3]);
  }
}

// D(64 x 128 f32) (+)= A(64 x 32 e4m3, smem) * B(128 x 32 e4m3, smem)^T; scale_d = 0 overwrites.
__device__ __forceinline__ void gg_wgmma_n128(float (&d)[64], uint64_t da, uint64_t db,
                                              int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, "
      "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, "
      "%38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, "
      "%56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
        "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
        "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]),
        "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]),
        "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),
        "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]),
        "+f"(d[63])
      : "l"(da), "l"(db), "r"(scale_d));
}

// D(64 x 16 f32) (+)= A(64 x 32 e4m3, smem) * B(16 x 32 e4m3, smem)^T.
__device__ __forceinline__ void gg_wgmma_n16(float (&d)[8], uint64_t da, uint64_t db, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %10, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n16k32.f32.e4m3.e4m3 "
      "{%0, %1, %2, %3, %4, %5, %6, %7}, %8, %9, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7])
      : "l"(da), "l"(db), "r"(scale_d));
}

// D(64 x 32 f32) (+)= A(64 x 32 e4m3, smem) * B(32 x 32 e4m3, smem)^T.
__device__ __forceinline__ void gg_wgmma_n32(float (&d)[16], uint64_t da, uint64_t db,
                                             int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k32.f32.e4m3.e4m3 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, %16, %17, p, 1, "
      "1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15])
      : "l"(da), "l"(db), "r"(scale_d));
}

// D(64 x 64 f32) (+)= A(64 x 32 e4m3, smem) * B(64 x 32 e4m3, smem)^T.
__device__ __forceinline__ void gg_wgmma_n64(float (&d)[32], uint64_t da, uint64_t db,
                                             int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, "
      "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
        "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
        "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "l"(da), "l"(db), "r"(scale_d));
}

// ---- clusters (TMA multicast) ----------------------------------------------------------------
__device__ __forceinline__ uint32_t gg_cluster_rank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
  return r;
}
__device__ __forceinline__ void gg_cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::
                   : "memory");
}
// Arrive on the mbarrier at the same shared-memory offset in CTA `rank` of the cluster. The
// default semantics (release at CTA scope), as CUTLASS's ClusterBarrier::arrive(cta_id): the
// arrive only says that this warp's wgmma reads of the stage are complete (wgmma.wait_group
// before it), and the peer's producer then overwrites the stage by TMA. With
// `.release.cluster` ptxas put MEMBAR.ALL.CTA + MEMBAR.ALL.GPU + ERRBAR + CGAERRBAR before every
// arrive (two per consumer warp and K block; cuobjdump, sm_90a): the likely cause of the
// cluster kernel's 16.8 cycles per issued instruction (PERFORMANCE.md, grouped run 7).
__device__ __forceinline__ void gg_arrive_cluster(uint64_t* bar, uint32_t rank) {
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n"
               : "=r"(remote)
               : "r"(smem_u32(bar)), "r"(rank));
  asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];\n" ::"r"(remote) : "memory");
}
// 2D TMA load multicast to the CTAs of `mask` (same shared-memory offset, same mbarrier offset).
__device__ __forceinline__ void gg_tma_load_mc(void* smem, const CUtensorMap* map, uint64_t* bar,
                                               int c0, int c1, uint16_t mask) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.multicast::"
      "cluster [%0], [%1, {%3, %4}], [%2], %5;\n" ::"r"(smem_u32(smem)),
      "l"(map), "r"(smem_u32(bar)), "r"(c0), "r"(c1), "h"(mask)
      : "memory");
}

// One output tile: expert, first A row, rows that exist (masked; 128 when contiguous), n-block.
struct GTile {
  int e, row0, rows, nt;
};

// Tile t of total_m x n_tiles_n in the grouped order. pref: masked prefix of m-blocks per expert.
template <int kBM = kGBM>
__device__ __forceinline__ GTile gg_tile(const GroupedGemmParams& p, const int* pref, int total_m,
                                         int n_tiles_n, int t) {
  const int group_m = p.group_m > 0 ? p.group_m : kGGroupM;
  const int per_group = group_m * n_tiles_n;
  const int grp = t / per_group, rem = t % per_group;
  const int m_first = grp * group_m;
  const int gm = min(group_m, total_m - m_first);
  const int mb = m_first + rem % gm;
  GTile g;
  g.nt = rem / gm;
  if (p.masked) {
    int lo = 0, hi = p.E - 1;  // last e with pref[e] <= mb (then pref[e + 1] > mb)
    while (lo < hi) {
      const int mid = (lo + hi + 1) >> 1;
      if (pref[mid] <= mb)
        lo = mid;
      else
        hi = mid - 1;
    }
    const int local = mb - pref[lo];
    const int c = min(max(p.counts[lo], 0), p.max_m);
    g.e = lo;
    g.row0 = lo * p.max_m + local * kBM;
    g.rows = min(kBM, c - local * kBM);
  } else {
    g.e = p.expert_blk[mb];
    g.row0 = mb * kBM;
    g.rows = kBM;
  }
  return g;
}

// Masked layout: exclusive prefix of kBM-row blocks per expert into pref[0..E], by one warp (tid <
// 32).
template <int kBM>
__device__ __forceinline__ void gg_masked_prefix(const GroupedGemmParams& p, int* pref, int tid) {
  int carry = 0;
  if (tid == 0) pref[0] = 0;
  for (int base = 0; base < p.E; base += 32) {
    const int e = base + tid;
    const int c = e < p.E ? min(max(p.counts[e], 0), p.max_m) : 0;
    int incl = (c + kBM - 1) / kBM;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int n = __shfl_up_sync(0xffffffffu, incl, o);
      if (tid >= o) incl += n;
    }
    if (e < p.E) pref[e + 1] = carry + incl;
    carry += __shfl_sync(0xffffffffu, incl, 31);
  }
}

// Epilogue of accumulator quad a = acc[4 j .. 4 j + 3] (columns col, col + 1 of the thread's rows
// lo and hi): + bias[e, n0 + col], times the row weight, rounded to bf16, stored as two packed
// words at staged column sc of the rows' staging (lo, hi).
__device__ __forceinline__ void gg_epi_pair(const GroupedGemmParams& p, int e, int n0, int col,
                                            const float* a, float w_lo, float w_hi, int sc,
                                            uint16_t* lo, uint16_t* hi) {
  float b0 = 0.0f, b1 = 0.0f;
  if (p.bias) {
    const int64_t bi = int64_t(e) * p.N + n0 + col;
    if (p.bias_bf16) {
      b0 = bf16_bits_to_float(static_cast<const uint16_t*>(p.bias)[bi]);
      b1 = bf16_bits_to_float(static_cast<const uint16_t*>(p.bias)[bi + 1]);
    } else {
      b0 = static_cast<const float*>(p.bias)[bi];
      b1 = static_cast<const float*>(p.bias)[bi + 1];
    }
  }
  const float v00 = (a[0] + b0) * w_lo, v01 = (a[1] + b1) * w_lo;
  const float v10 = (a[2] + b0) * w_hi, v11 = (a[3] + b1) * w_hi;
  *reinterpret_cast<uint32_t*>(lo + sc) =
      uint32_t(float_to_bf16_bits(v00)) | (uint32_t(float_to_bf16_bits(v01)) << 16);
  *reinterpret_cast<uint32_t*>(hi + sc) =
      uint32_t(float_to_bf16_bits(v10)) | (uint32_t(float_to_bf16_bits(v11)) << 16);
}

// Destination of tile row r (-1: not stored) and its row weight.
__device__ __forceinline__ void gg_row_dest(const GroupedGemmParams& p, const GTile& g, int r,
                                            int& dst, float& w) {
  dst = -1;
  w = 1.0f;
  if (p.masked) {
    if (r < g.rows) dst = g.row0 + r;
  } else {
    const int pos = g.row0 + r;
    const int id = p.sorted_ids ? p.sorted_ids[pos] : pos;
    if (!p.sorted_ids || id < p.num_valid) {
      dst = p.out_scatter ? id : pos;
      if (p.row_weight) w = p.row_weight[id];
    }
  }
}

// The same in two steps (the swapped kernels), so that neither L2 round trip sits at the
// epilogue's start: the sorted id of the row (issued at the tile's start), then its destination
// and row weight (issued under the K loop, after block 0's wgmma); first read in the epilogue.
__device__ __forceinline__ int gg_row_id(const GroupedGemmParams& p, const GTile& g, int r) {
  const int pos = g.row0 + r;
  return (!p.masked && p.sorted_ids) ? __ldg(p.sorted_ids + pos) : pos;
}
__device__ __forceinline__ void gg_row_finish(const GroupedGemmParams& p, const GTile& g, int r,
                                              int id, int& dst, float& w) {
  dst = -1;
  w = 1.0f;
  if (p.masked) {
    if (r < g.rows) dst = g.row0 + r;
  } else if (!p.sorted_ids || id < p.num_valid) {
    dst = p.out_scatter ? id : g.row0 + r;
    if (p.row_weight) w = __ldg(p.row_weight + id);
  }
}

// The swapped kernels copy the tile's scales to shared memory in chunks of SwapCfg::kScaleKb K
// blocks, so that no global load sits on the K loop's path to the promotion (with per-block __ldg
// of the next block's scales, the register copies at the loop's top waited an L2 round trip per
// 16 KB of weights). Measured 4-12% faster at 16-64 rows per expert (PERFORMANCE.md, grouped run
// 6). The same copy in the 256 tile measured no faster (its loads hide under the first half's
// wgmma), so that kernel keeps its per-block loads.

// kMc = 2: clusters of two CTAs on the same m-block and adjacent n-blocks; each CTA loads half of
// the A tile and multicasts it to both (L2 -> SM traffic per K block 24 KB instead of 32 KB).
// Every consumer warp releases a stage in both CTAs (empty barriers count 16 arrivals).
template <int kMc>
__global__ void __launch_bounds__(kGThreads, 1)
    grouped_gemm_kernel(const __grid_constant__ GroupedGemmParams p,
                        const __grid_constant__ CUtensorMap tm_a,
                        const __grid_constant__ CUtensorMap tm_b) {
  extern __shared__ uint8_t gg_smem_raw[];
  // the first 1024-byte boundary by indexing (not an integer cast): derived pointers stay shared
  uint8_t* smem = gg_smem_raw + ((1024u - (smem_u32(gg_smem_raw) & 1023u)) & 1023u);
  uint16_t* epi = reinterpret_cast<uint16_t*>(smem + kGStages * kGStageBytes);
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + kGStages * kGStageBytes + kGEpiBytes);
  uint64_t* empty = full + kGStages;
  int* pref = reinterpret_cast<int*>(empty + kGStages);
  __shared__ int s_dst[2][64];
  __shared__ float s_w[2][64];

  const int tid = threadIdx.x;
  const int wg = tid / 128, wtid = tid % 128;
  const int warp = wtid / 32, lane = tid % 32;
  if (tid == 0) {
    for (int i = 0; i < kGStages; ++i) {
      mbar_init(&full[i], 1);
      mbar_init(&empty[i], 8 * kMc);  // one arrive per consumer warp (of each CTA of the cluster)
    }
    fence_barrier_init();
  }
  const uint32_t crank = kMc > 1 ? gg_cluster_rank() : 0;
  int total_m = 0;
  if (p.masked) {
    // exclusive prefix of 128-row blocks per expert, by warp 0
    if (tid < 32) {
      int carry = 0;
      if (tid == 0) pref[0] = 0;
      for (int base = 0; base < p.E; base += 32) {
        const int e = base + tid;
        const int c = e < p.E ? min(max(p.counts[e], 0), p.max_m) : 0;
        int incl = (c + kGBM - 1) / kGBM;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
          const int n = __shfl_up_sync(0xffffffffu, incl, o);
          if (tid >= o) incl += n;
        }
        if (e < p.E) pref[e + 1] = carry + incl;
        carry += __shfl_sync(0xffffffffu, incl, 31);
      }
    }
    __syncthreads();
    total_m = pref[p.E];
  } else {
    __syncthreads();
    total_m = *p.num_rows_ptr / kGBM;
  }
  if constexpr (kMc > 1) gg_cluster_sync();  // the peer's barriers are initialised
  // tiles of the cluster: n-blocks in groups of kMc, CTA crank takes n-block kMc * np + crank
  const int n_tiles_n = p.N / kGBN / kMc;
  const int n_tiles = total_m * n_tiles_n;
  const int num_kb = p.K / kGBK;
  const int cid = blockIdx.x / kMc, ncl = gridDim.x / kMc;

  if (wg == 0) {
    // =============================== producer ===============================================
    gg_setmaxnreg_dec<40>();
    if (wtid == 0) {
      tma_prefetch_desc(&tm_a);
      tma_prefetch_desc(&tm_b);
      int it = 0;
      for (int t = cid; t < n_tiles; t += ncl) {
        const GTile g = gg_tile(p, pref, total_m, n_tiles_n, t);
        const int nt = g.nt * kMc + static_cast<int>(crank);
        const int brow = g.e * p.N + nt * kGBN;
        for (int kb = 0; kb < num_kb; ++kb, ++it) {
          const int s = it % kGStages;
          const uint32_t ph = (it / kGStages) & 1;
          mbar_wait(&empty[s], ph ^ 1);
          uint8_t* a_dst = smem + s * kGStageBytes;
          mbar_arrive_expect_tx(&full[s], kGStageBytes);
          if constexpr (kMc > 1) {
            constexpr int kRows = kGBM / kMc;
            gg_tma_load_mc(a_dst + crank * (kRows * kGBK), &tm_a, &full[s], kb * kGBK,
                           g.row0 + static_cast<int>(crank) * kRows, uint16_t((1u << kMc) - 1));
          } else {
            tma_load_2d(a_dst, &tm_a, &full[s], kb * kGBK, g.row0);
          }
          tma_load_2d(a_dst + kGAStage, &tm_b, &full[s], kb * kGBK, brow);
        }
      }
    }
    if constexpr (kMc > 1) gg_cluster_sync();
    return;
  }

  // ================================= consumers ==============================================
  gg_setmaxnreg_inc<232>();
  const int cw = wg - 1;  // rows [64 cw, 64 cw + 64) of the tile
  const int r_lo = cw * 64 + warp * 16 + (lane >> 2), r_hi = r_lo + 8;
  const int q = lane & 3;
  int it = 0;
  for (int t = cid; t < n_tiles; t += ncl) {
    GTile g = gg_tile(p, pref, total_m, n_tiles_n, t);
    g.nt = g.nt * kMc + static_cast<int>(crank);
    const int64_t ar0 = int64_t(g.row0) + r_lo, ar1 = int64_t(g.row0) + r_hi;
    // rows past A's end (masked tail) read scale 0: their outputs are never stored
    const float* as0 = ar0 < p.a_rows ? p.a_scale + ar0 * p.a_scale_stride : nullptr;
    const float* as1 = ar1 < p.a_rows ? p.a_scale + ar1 * p.a_scale_stride : nullptr;
    const float* bs =
        p.b_scale + int64_t(g.e) * p.b_scale_e_stride + int64_t(g.nt) * p.b_scale_n_stride;
    float acc[64], part[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) acc[i] = 0.0f;
    float sa0 = as0 ? __ldg(as0) : 0.0f, sa1 = as1 ? __ldg(as1) : 0.0f, sb = __ldg(bs);
    for (int kb = 0; kb < num_kb; ++kb, ++it) {
      const int s = it % kGStages;
      const uint32_t ph = (it / kGStages) & 1;
      mbar_wait(&full[s], ph);
      const uint8_t* a_s = smem + s * kGStageBytes + cw * (64 * kGBK);
      const uint8_t* b_s = smem + s * kGStageBytes + kGAStage;
      const uint64_t da = gg_desc(a_s), db = gg_desc(b_s);
      gg_reg_fence(part);
      gg_fence();
#pragma unroll
      for (int ks = 0; ks < 4; ++ks) gg_wgmma_n128(part, da + 2 * ks, db + 2 * ks, ks > 0);
      gg_commit();
      float na0 = 0.0f, na1 = 0.0f, nb = 0.0f;
      if (kb + 1 < num_kb) {
        na0 = as0 ? __ldg(as0 + (kb + 1) * p.a_scale_kb) : 0.0f;
        na1 = as1 ? __ldg(as1 + (kb + 1) * p.a_scale_kb) : 0.0f;
        nb = __ldg(bs + (kb + 1) * p.b_scale_kb);
      }
      gg_wait0();
      gg_reg_fence(part);
      if (lane == 0) {
        if constexpr (kMc > 1) {
#pragma unroll
          for (int r = 0; r < kMc; ++r) gg_arrive_cluster(&empty[s], r);
        } else {
          mbar_arrive(&empty[s]);
        }
      }
      const float s0 = sa0 * sb, s1 = sa1 * sb;
      gg_promote<0>(acc, part, s0, s1);
      sa0 = na0;
      sa1 = na1;
      sb = nb;
    }

    // ---- epilogue ----
    uint16_t* stage = epi + cw * (64 * kGEpiPitch);
    gg_bar(1 + cw, 128);  // the previous tile's readers of stage / s_dst are done
    if (wtid < 64) {
      const int r = cw * 64 + wtid;
      int dst = -1;
      float w = 1.0f;
      if (p.masked) {
        if (r < g.rows) dst = g.row0 + r;
      } else {
        const int pos = g.row0 + r;
        const int id = p.sorted_ids ? p.sorted_ids[pos] : pos;
        if (!p.sorted_ids || id < p.num_valid) {
          dst = p.out_scatter ? id : pos;
          if (p.row_weight) w = p.row_weight[id];
        }
      }
      s_dst[cw][wtid] = dst;
      s_w[cw][wtid] = w;
    }
    gg_bar(1 + cw, 128);
    const float w_lo = s_w[cw][r_lo - cw * 64], w_hi = s_w[cw][r_hi - cw * 64];
    const int n0 = g.nt * kGBN;
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      const int col = 8 * j + 2 * q;
      gg_epi_pair(p, g.e, n0, col, acc + 4 * j, w_lo, w_hi, col,
                  stage + (r_lo - cw * 64) * kGEpiPitch, stage + (r_hi - cw * 64) * kGEpiPitch);
    }
    gg_bar(1 + cw, 128);
    // 64 rows x 256 bytes: 16 lanes per row
#pragma unroll 4
    for (int i = wtid; i < 64 * 16; i += 128) {
      const int r = i >> 4, c = i & 15;
      const int dst = s_dst[cw][r];
      if (dst < 0) continue;
      *reinterpret_cast<uint4*>(p.out + int64_t(dst) * p.out_stride + n0 + c * 8) =
          *reinterpret_cast<const uint4*>(stage + r * kGEpiPitch + c * 8);
    }
  }
  if constexpr (kMc > 1) gg_cluster_sync();  // no multicast or remote arrive into a finished CTA
}

// ---- 128 x 256 tiles (BN = 256)
// ------------------------------------------------------------------ Same warp specialisation,
// promotion and epilogue semantics as grouped_gemm_kernel, on a 128-row x 256-column output tile:
// 48 KB of L2 -> SM traffic per 128-wide K block for 8.4 MFLOP instead of 32 KB per 4.2 MFLOP
// (0.75x the bytes per FLOP). A stage holds the 128 A rows (16 KB) and two 128-row B halves (16 KB
// each), each its own TMA box: half 0 from weight rows n0, half 1 from rows n1 of the expert (the
// plain layout has n1 = n0 + 128; a fused gate/up epilogue can pair gate block j with up block j
// instead). Per K block each consumer warpgroup runs 4 x wgmma m64n128k32 for half 0 into one fresh
// partial, promotes it into acc[0..63] with b_scale of 128-row block 2 nt, then the same for half 1
// into acc[64..127] with block 2 nt + 1: the partials are the 128-wide tile's, so the output is
// bitwise the same as with grouped_gemm_kernel. 4 stages (192 KB); the epilogue stages 64-column
// quarters through 9 KB per warpgroup.
constexpr int kG2BN = 256;
constexpr int kG2Stages = 4;
constexpr int kG2StageBytes = kGAStage + 2 * kGBStage;  // 48 KB
constexpr int kG2EpiCols = 64;
constexpr int kG2EpiPitch = kG2EpiCols + 8;  // 144 B per staged row: conflict-free both ways
constexpr int kG2EpiBytes = 2 * 64 * kG2EpiPitch * 2;
constexpr int kG2SmemBytes = 1024 + kG2Stages * kG2StageBytes + kG2EpiBytes + 2 * kG2Stages * 8 +
                             (kGroupedMaxExperts + 1) * 4 + 64;
static_assert(kG2SmemBytes + 2 * 64 * 8 <= 227 * 1024, "n256 tile: shared memory");
static_assert(64 * kG2EpiPitch * 2 >= 64 * 144, "fused epilogue: q staging (64 rows x 144 B)");

// Asynchronous epilogue (kAsync = 1; GroupedGemmParams::epi_async): each consumer warpgroup stages
// its whole 64 x 256 bf16 output in shared memory (rows of 528 B: 16-byte aligned, conflict-free
// for the accumulator layout) and one thread per row hands it to a bulk copy (cp.async.bulk
// shared -> global, 512 B per row), then goes on to the next tile's K blocks while the copies
// drain; the staging is rewritten only after the issuing threads' copies have read it. The tile's
// row metadata (sorted id, destination, row weight) is loaded under the K loop. The 66 KB of
// staging leave room for 3 stages (sync: 4). Same values as the sync epilogue, bitwise. Measured
// (PERFORMANCE.md, grouped run 7): DeepSeek TP8's GEMM2 (K = 256, 2 K blocks per tile) at M = 8192
// 649 -> ~605 us; the lost stage costs long-K GEMMs up to 4%, hence the rule (K <= 512). What is
// left of a short-K tile's epilogue is its own instructions, during which no wgmma is in flight.
constexpr int kG2aStages = 3;
constexpr int kG2aEpiPitch = kG2BN + 8;  // bf16 per staged row (528 B)
constexpr int kG2aEpiBytes = 2 * 64 * kG2aEpiPitch * 2;
constexpr int kG2aSmemBytes = 1024 + kG2aStages * kG2StageBytes + kG2aEpiBytes +
                              2 * kG2aStages * 8 + (kGroupedMaxExperts + 1) * 4 + 64;
static_assert(kG2aSmemBytes + 2 * 64 * 8 <= 227 * 1024, "n256 tile, async epilogue: shared memory");
static_assert((kG2aEpiPitch * 2) % 16 == 0, "bulk copies read 16-byte aligned rows");

// GEMM1's fused epilogue (kFuse): acc[0..63] holds the gate columns and acc[64..127] the up
// columns of h-columns [128 nt, 128 nt + 128) of this warpgroup's 64 rows (thread: rows lr and
// lr + 8 of the warpgroup, h-columns 8 j + 2 q + c). Same operations and rounding points as the
// unfused chain (GEMM1 with bf16 output, activation_kernel, quant_group_kernel<T, 128>); the
// 128-column group of a row lies in the 4 lanes of a quad. q is staged in shared memory (64 rows
// x 144 B) for 16-byte row stores.
__device__ __forceinline__ void gg_fused_act_quant_epilogue(const GroupedGemmParams& p,
                                                            const GTile& g, const float (&acc)[128],
                                                            uint8_t* stage, const int* dst_rows,
                                                            int cw, int lr, int q) {
  const int I = p.N / 2;
  const int hc0 = g.nt * kGBN;  // first h-column of the tile
#pragma unroll
  for (int h = 0; h < 2; ++h) {  // rows lr, lr + 8
    float hv[32];
    float amax = 0.0f;
#pragma unroll
    for (int j = 0; j < 16; ++j)
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int col = 8 * j + 2 * q + c;
        float bg = 0.0f, bu = 0.0f;
        if (p.bias) {
          const int64_t bi = int64_t(g.e) * p.N + hc0 + col;
          if (p.bias_bf16) {
            bg = bf16_bits_to_float(static_cast<const uint16_t*>(p.bias)[bi]);
            bu = bf16_bits_to_float(static_cast<const uint16_t*>(p.bias)[bi + I]);
          } else {
            bg = static_cast<const float*>(p.bias)[bi];
            bu = static_cast<const float*>(p.bias)[bi + I];
          }
        }
        // y1 = bf16(acc + bias) (the unfused GEMM1 stores bf16 with row weight 1)
        const float gv = bf16_round(acc[4 * j + 2 * h + c] + bg);
        const float uv = bf16_round(acc[64 + 4 * j + 2 * h + c] + bu);
        float v = act_gated(p.act, gv, uv);
        if (!p.act_h_f32) v = bf16_round(v);
        hv[2 * j + c] = v;
        amax = fmaxf(amax, fabsf(v));
      }
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
    const float s = group_scale(amax, p.q_ue8m0 != 0, p.q_min_scale);
    const int r = lr + 8 * h;
    const int dst = dst_rows[r];
    if (q == 0 && dst >= 0) p.q_scale[int64_t(dst) * p.q_scale_stride + g.nt] = s;
#pragma unroll
    for (int j = 0; j < 16; ++j)
      *reinterpret_cast<uint16_t*>(stage + r * 144 + 8 * j + 2 * q) =
          float2_to_e4m3x2(hv[2 * j] / s, hv[2 * j + 1] / s);
  }
  gg_bar(1 + cw, 128);
  // 64 rows x 128 bytes: 8 lanes of 16 bytes per row
  const int wtid = threadIdx.x % 128;
#pragma unroll
  for (int i = wtid; i < 64 * 8; i += 128) {
    const int r = i >> 3, c = i & 7;
    const int dst = dst_rows[r];
    if (dst < 0) continue;
    *reinterpret_cast<uint4*>(p.q_out + int64_t(dst) * p.q_stride + hc0 + c * 16) =
        *reinterpret_cast<const uint4*>(stage + r * 144 + c * 16);
  }
}

// One 128-wide K block of a warpgroup's 64 x 256 output (the 128 x 256 tile's half): 4 x wgmma
// m64n128k32 for B half 0 into the fresh partial, promoted into acc[0..63] with scale sa * sb0,
// then the same for half 1 into acc[64..127] with sb1; the next K block's scales are loaded under
// half 0's wgmma. after_issue() runs right after half 0 is issued, release() once both halves'
// wgmma have read the stage.
template <class AfterIssue, class Release>
__device__ __forceinline__ void gg_kblock_64x256(const GroupedGemmParams& p, float (&acc)[128],
                                                 float (&part)[64], uint64_t da, uint64_t db0,
                                                 uint64_t db1, int kb, int num_kb, const float* as0,
                                                 const float* as1, const float* bs0,
                                                 const float* bs1, float& sa0, float& sa1,
                                                 float& sb0, float& sb1, AfterIssue after_issue,
                                                 Release release) {
  // half 0
  gg_reg_fence(part);
  gg_fence();
#pragma unroll
  for (int ks = 0; ks < 4; ++ks) gg_wgmma_n128(part, da + 2 * ks, db0 + 2 * ks, ks > 0);
  gg_commit();
  after_issue();
  float na0 = 0.0f, na1 = 0.0f, nb0 = 0.0f, nb1 = 0.0f;
  if (kb + 1 < num_kb) {
    na0 = as0 ? __ldg(as0 + (kb + 1) * p.a_scale_kb) : 0.0f;
    na1 = as1 ? __ldg(as1 + (kb + 1) * p.a_scale_kb) : 0.0f;
    nb0 = __ldg(bs0 + (kb + 1) * p.b_scale_kb);
    nb1 = __ldg(bs1 + (kb + 1) * p.b_scale_kb);
  }
  gg_wait0();
  gg_reg_fence(part);
  {
    const float s0 = sa0 * sb0, s1 = sa1 * sb0;
    gg_promote<0>(acc, part, s0, s1);
  }
  // half 1
  gg_reg_fence(part);
  gg_fence();
#pragma unroll
  for (int ks = 0; ks < 4; ++ks) gg_wgmma_n128(part, da + 2 * ks, db1 + 2 * ks, ks > 0);
  gg_commit();
  gg_wait0();
  gg_reg_fence(part);
  release();
  {
    const float s0 = sa0 * sb1, s1 = sa1 * sb1;
    gg_promote<64>(acc, part, s0, s1);
  }
  sa0 = na0;
  sa1 = na1;
  sb0 = nb0;
  sb1 = nb1;
}

// kFuse = 1: GEMM1 with the fused activation + quantisation epilogue (GroupedGemmParams::fuse_act).
// kAsync = 1: the asynchronous epilogue (bulk copies; not with kFuse).
// kMc = 2: clusters of two CTAs on the same m-block and adjacent 256-wide n-blocks (CTA rank r
// takes n-block 2 np + r); each CTA loads 64 of the 128 A rows and multicasts them to both, so a
// K block moves 40 KB from L2 to each SM instead of 48 (GEMM1 of the 256 tile is bound by L2
// throughput: PERFORMANCE.md, grouped run 7). Every consumer warp releases a stage in both CTAs
// (the peer's producer multicasts into it), so the empty barriers count 16 arrivals. Not with
// kFuse (its two B halves pair gate and up blocks of one n-block).
// The fused top-k sum (GroupedGemmParams::sum_out) of one consumer warpgroup's 64 tile rows after
// its sync epilogue stored them (y2 = p.out, row = pair t * topk + slot; dst[r] < 0: not stored).
// Every thread fences its stores and the warpgroup meets; the thread of each stored row counts the
// row's token done for this n-tile, and the last of the token's local slots to arrive marks the
// token (toks[r]); then one warp per marked token sums its local slots' 256 columns in slot order
// (8 columns a lane, four slots' loads in flight, from L2: ld.global.cg), rounds once, stores to
// sum_out, and discards the y2 lines it read (they are never read again: no write-back). The float
// operations per element are moe_sum8_kernel's, so the bits are the same.
__device__ __forceinline__ uint32_t gg_sum_valid(const GroupedGemmParams& p, int t) {
  uint32_t valid = 0;  // bit j: slot j is a local expert (local_expert of smxx_moe_align.cuh)
  for (int j = 0; j < p.sum_topk; ++j) {
    const int gid = __ldg(p.sum_ids + int64_t(t) * p.sum_topk + j);
    if (gid < 0 || gid >= p.sum_E_global) continue;
    const int e = p.sum_map ? __ldg(p.sum_map + gid) : gid;
    if (e >= 0 && e < p.sum_E_local) valid |= 1u << j;
  }
  return valid;
}
template <int kRows, int kCols>
__device__ __noinline__ void gg_fused_sum(const GroupedGemmParams& p, int nt, const int* dst,
                                          int* toks, int bar_id, int wtid) {
  static_assert(kRows <= 128 && kCols % 64 == 0, "fused sum: tile shape");
  // the warpgroup's y2 stores, then each row's count as a release at gpu scope (cumulative over
  // the stores the barrier ordered before it; run 13 call 2: a __threadfence (fence.sc) in every
  // thread after every tile made the layer 1.2-5x slower); the count that completes a token
  // acquires the other tiles' rows
  gg_bar(bar_id, 128);
  if (wtid < kRows) {
    int tok = -1;
    const int d = dst[wtid];
    if (d >= 0) {
      const int t = d / p.sum_topk;
      const int need = __popc(gg_sum_valid(p, t));
      int old;
      asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], 1;\n"
                   : "=r"(old)
                   : "l"(p.sum_cnt + int64_t(t) * (p.N / kCols) + nt)
                   : "memory");
      if (old + 1 == need) tok = t;
    }
    toks[wtid] = tok;
  }
  gg_bar(bar_id, 128);
  const int warp = wtid >> 5, lane = wtid & 31;
  const int n0 = nt * kCols;
  for (int r = warp; r < kRows; r += 4) {
    const int t = toks[r];
    if (t < 0) continue;
    const uint32_t valid = gg_sum_valid(p, t);
    for (int c8 = lane; c8 < kCols / 8; c8 += 32) {
      const int c0 = n0 + c8 * 8;
      const uint16_t* y = p.out + int64_t(t) * p.sum_topk * p.out_stride + c0;
      float acc[8] = {};
      for (int j0 = 0; j0 < p.sum_topk; j0 += 4) {
        uint4 u[4];
#pragma unroll
        for (int d = 0; d < 4; ++d)
          if (j0 + d < p.sum_topk && ((valid >> (j0 + d)) & 1u))
            u[d] = __ldcg(reinterpret_cast<const uint4*>(y + int64_t(j0 + d) * p.out_stride));
#pragma unroll
        for (int d = 0; d < 4; ++d)
          if (j0 + d < p.sum_topk && ((valid >> (j0 + d)) & 1u)) {
            const uint32_t w[4] = {u[d].x, u[d].y, u[d].z, u[d].w};
#pragma unroll
            for (int i = 0; i < 4; ++i) {
              acc[2 * i] += __uint_as_float(w[i] << 16);
              acc[2 * i + 1] += __uint_as_float(w[i] & 0xFFFF0000u);
            }
          }
      }
      uint32_t o[4];
#pragma unroll
      for (int i = 0; i < 4; ++i)
        o[i] = uint32_t(float_to_bf16_bits(acc[2 * i])) |
               (uint32_t(float_to_bf16_bits(acc[2 * i + 1])) << 16);
      *reinterpret_cast<uint4*>(p.sum_out + int64_t(t) * p.N + c0) =
          make_uint4(o[0], o[1], o[2], o[3]);
    }
    __syncwarp();  // every lane's loads are done before the lines go
    // the kCols / 64 lines (128 B) of each local slot's columns
    constexpr int kLines = kCols / 64;
    for (int i = lane; i < kLines * p.sum_topk; i += 32) {
      const int j = i / kLines;
      if ((valid >> j) & 1u) {
        const uint16_t* line =
            p.out + (int64_t(t) * p.sum_topk + j) * p.out_stride + n0 + (i % kLines) * 64;
        asm volatile("discard.global.L2 [%0], 128;\n" ::"l"(line) : "memory");
      }
    }
  }
}

// kSum: the fused top-k sum after the sync epilogue (GroupedGemmParams::sum_out; its own
// instantiation, so that the other kernels keep their registers: ptxas spilled in the plain sync
// kernel with the sum behind a runtime branch).
template <int kFuse, int kAsync, int kMc = 1, int kSum = 0>
__global__ void __launch_bounds__(kGThreads, 1)
    grouped_gemm_n256_kernel(const __grid_constant__ GroupedGemmParams p,
                             const __grid_constant__ CUtensorMap tm_a,
                             const __grid_constant__ CUtensorMap tm_b) {
  static_assert(!(kFuse && kAsync), "the fused activation keeps the sync epilogue");
  static_assert(kMc == 1 || (kMc == 2 && !kFuse), "clusters: two CTAs, not with kFuse");
  static_assert(!kSum || (!kFuse && !kAsync && kMc == 1), "the fused sum: the plain sync kernel");
  constexpr int kSt = kAsync ? kG2aStages : kG2Stages;
  constexpr int kEpiB = kAsync ? kG2aEpiBytes : kG2EpiBytes;
  extern __shared__ uint8_t gg_smem_raw[];
  // the first 1024-byte boundary by indexing (not an integer cast): derived pointers stay shared
  uint8_t* smem = gg_smem_raw + ((1024u - (smem_u32(gg_smem_raw) & 1023u)) & 1023u);
  uint16_t* epi = reinterpret_cast<uint16_t*>(smem + kSt * kG2StageBytes);
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + kSt * kG2StageBytes + kEpiB);
  uint64_t* empty = full + kSt;
  int* pref = reinterpret_cast<int*>(empty + kSt);
  __shared__ int s_dst[2][64];
  __shared__ float s_w[2][64];
  __shared__ int s_tok[kSum ? 2 : 1][64];  // the fused top-k sum's tokens to sum

  const int tid = threadIdx.x;
  const int wg = tid / 128, wtid = tid % 128;
  const int warp = wtid / 32, lane = tid % 32;
  if (tid == 0) {
    for (int i = 0; i < kSt; ++i) {
      mbar_init(&full[i], 1);
      mbar_init(&empty[i], 8 * kMc);  // one arrive per consumer warp (of each CTA of the cluster)
    }
    fence_barrier_init();
  }
  const uint32_t crank = kMc > 1 ? gg_cluster_rank() : 0;
  int total_m = 0;
  if (p.masked) {
    if (tid < 32) gg_masked_prefix<kGBM>(p, pref, tid);
    __syncthreads();
    total_m = pref[p.E];
  } else {
    __syncthreads();
    total_m = *p.num_rows_ptr / kGBM;
  }
  if constexpr (kMc > 1) gg_cluster_sync();  // the peer's barriers are initialised
  // tiles of the cluster: n-blocks in groups of kMc (both CTAs walk the same tiles)
  const int n_tiles_n = p.N / kG2BN / kMc;
  const int n_tiles = total_m * n_tiles_n;
  const int num_kb = p.K / kGBK;
  const int cid = blockIdx.x / kMc, ncl = gridDim.x / kMc;

  if (wg == 0) {
    // =============================== producer ===============================================
    gg_setmaxnreg_dec<40>();
    if (wtid == 0) {
      tma_prefetch_desc(&tm_a);
      tma_prefetch_desc(&tm_b);
      int it = 0;
      for (int t = cid; t < n_tiles; t += ncl) {
        GTile g = gg_tile(p, pref, total_m, n_tiles_n, t);
        g.nt = g.nt * kMc + static_cast<int>(crank);
        // the two B halves: weight rows n0 and n1 of expert e (plain layout: n1 = n0 + 128; fused
        // activation: gate block nt and up block nt of the packed w13)
        const int brow0 = g.e * p.N + (kFuse ? g.nt * kGBN : g.nt * kG2BN);
        const int brow1 = kFuse ? g.e * p.N + p.N / 2 + g.nt * kGBN : brow0 + kGBN;
        for (int kb = 0; kb < num_kb; ++kb, ++it) {
          const int s = it % kSt;
          const uint32_t ph = (it / kSt) & 1;
          mbar_wait(&empty[s], ph ^ 1);
          uint8_t* dst = smem + s * kG2StageBytes;
          mbar_arrive_expect_tx(&full[s], kG2StageBytes);
          if constexpr (kMc > 1) {
            constexpr int kRows = kGBM / kMc;  // this CTA's share of A, multicast to both
            gg_tma_load_mc(dst + crank * (kRows * kGBK), &tm_a, &full[s], kb * kGBK,
                           g.row0 + static_cast<int>(crank) * kRows, uint16_t((1u << kMc) - 1));
          } else {
            tma_load_2d(dst, &tm_a, &full[s], kb * kGBK, g.row0);
          }
          tma_load_2d(dst + kGAStage, &tm_b, &full[s], kb * kGBK, brow0);
          tma_load_2d(dst + kGAStage + kGBStage, &tm_b, &full[s], kb * kGBK, brow1);
        }
      }
    }
    if constexpr (kMc > 1) gg_cluster_sync();
    return;
  }

  // ================================= consumers ==============================================
  gg_setmaxnreg_inc<232>();
  const int cw = wg - 1;  // rows [64 cw, 64 cw + 64) of the tile
  const int r_lo = cw * 64 + warp * 16 + (lane >> 2), r_hi = r_lo + 8;
  const int q = lane & 3;
  int it = 0;
  for (int t = cid; t < n_tiles; t += ncl) {
    GTile g = gg_tile(p, pref, total_m, n_tiles_n, t);
    g.nt = g.nt * kMc + static_cast<int>(crank);
    const int64_t ar0 = int64_t(g.row0) + r_lo, ar1 = int64_t(g.row0) + r_hi;
    // rows past A's end (masked tail) read scale 0: their outputs are never stored
    const float* as0 = ar0 < p.a_rows ? p.a_scale + ar0 * p.a_scale_stride : nullptr;
    const float* as1 = ar1 < p.a_rows ? p.a_scale + ar1 * p.a_scale_stride : nullptr;
    // b_scale of the halves' 128-row blocks: 2 nt and 2 nt + 1 (fused: nt and N / 256 + nt)
    const int nb0 = kFuse ? g.nt : 2 * g.nt, nb1 = kFuse ? p.N / kG2BN + g.nt : 2 * g.nt + 1;
    const float* bs0 =
        p.b_scale + int64_t(g.e) * p.b_scale_e_stride + int64_t(nb0) * p.b_scale_n_stride;
    const float* bs1 =
        p.b_scale + int64_t(g.e) * p.b_scale_e_stride + int64_t(nb1) * p.b_scale_n_stride;
    float acc[128], part[64];
#pragma unroll
    for (int i = 0; i < 128; ++i) acc[i] = 0.0f;
    // async epilogue: thread wtid < 64 owns tile row 64 cw + wtid (its metadata, its bulk copy)
    int row_id = 0, row_dst = -1;
    float row_w = 1.0f;
    if constexpr (kAsync) {
      if (wtid < 64) row_id = gg_row_id(p, g, cw * 64 + wtid);
    }
    float sa0 = as0 ? __ldg(as0) : 0.0f, sa1 = as1 ? __ldg(as1) : 0.0f;
    float sb0 = __ldg(bs0), sb1 = __ldg(bs1);
    for (int kb = 0; kb < num_kb; ++kb, ++it) {
      const int s = it % kSt;
      const uint32_t ph = (it / kSt) & 1;
      mbar_wait(&full[s], ph);
      const uint8_t* a_s = smem + s * kG2StageBytes + cw * (64 * kGBK);
      const uint8_t* b_s = smem + s * kG2StageBytes + kGAStage;
      const uint64_t da = gg_desc(a_s), db0 = gg_desc(b_s), db1 = gg_desc(b_s + kGBStage);
      gg_kblock_64x256(
          p, acc, part, da, db0, db1, kb, num_kb, as0, as1, bs0, bs1, sa0, sa1, sb0, sb1,
          [&] {
            if constexpr (kAsync) {
              if (kb == 0 && wtid < 64) gg_row_finish(p, g, cw * 64 + wtid, row_id, row_dst, row_w);
            }
          },
          [&] {
            if (lane == 0) {
              if constexpr (kMc > 1) {
#pragma unroll
                for (int r = 0; r < kMc; ++r) gg_arrive_cluster(&empty[s], r);
              } else {
                mbar_arrive(&empty[s]);
              }
            }
          });
    }

    if constexpr (kAsync) {
      // ---- asynchronous epilogue: the whole 64 x 256 output staged, one bulk copy per row ----
      uint16_t* stg = epi + cw * (64 * kG2aEpiPitch);
      if (wtid < 64) {
        bulk_wait_read0();  // this thread's copies of the previous tile have read the staging
        s_w[cw][wtid] = row_w;
      }
      gg_bar(1 + cw, 128);
      const float w_lo = s_w[cw][r_lo - cw * 64], w_hi = s_w[cw][r_hi - cw * 64];
      const int n0 = g.nt * kG2BN;
#pragma unroll
      for (int j = 0; j < 32; ++j) {  // acc[4 j ..] holds columns 8 j + 2 q, + 1 (rows lo, hi)
        const int col = 8 * j + 2 * q;
        gg_epi_pair(p, g.e, n0, col, acc + 4 * j, w_lo, w_hi, col,
                    stg + (r_lo - cw * 64) * kG2aEpiPitch, stg + (r_hi - cw * 64) * kG2aEpiPitch);
      }
      fence_proxy_async();  // the generic-proxy writes, before the bulk copies read them
      gg_bar(1 + cw, 128);
      if (wtid < 64) {
        if (row_dst >= 0)
          bulk_store_1d(p.out + int64_t(row_dst) * p.out_stride + n0, stg + wtid * kG2aEpiPitch,
                        kG2BN * 2);
        bulk_commit();
      }
      continue;
    }
    // ---- epilogue: four 64-column quarters through the warpgroup's staging buffer ----
    uint16_t* stage = epi + cw * (64 * kG2EpiPitch);
    gg_bar(1 + cw, 128);  // the previous tile's readers of stage / s_dst are done
    if (wtid < 64) {
      int dst;
      float w;
      gg_row_dest(p, g, cw * 64 + wtid, dst, w);
      s_dst[cw][wtid] = dst;
      s_w[cw][wtid] = w;
    }
    gg_bar(1 + cw, 128);
    if constexpr (kFuse) {
      gg_fused_act_quant_epilogue(p, g, acc, reinterpret_cast<uint8_t*>(stage), s_dst[cw], cw,
                                  r_lo - cw * 64, q);
      continue;
    }
    const float w_lo = s_w[cw][r_lo - cw * 64], w_hi = s_w[cw][r_hi - cw * 64];
    const int n0 = g.nt * kG2BN;
#pragma unroll
    for (int qt = 0; qt < 4; ++qt) {
      if (qt > 0) gg_bar(1 + cw, 128);  // the previous quarter's readers are done
#pragma unroll
      for (int jj = 0; jj < 8; ++jj) {
        const int j = 8 * qt + jj;  // acc[4 j ..] holds columns 8 j + 2 q, + 1 (rows lo, hi)
        const int col = 8 * j + 2 * q;
        gg_epi_pair(p, g.e, n0, col, acc + 4 * j, w_lo, w_hi, col - qt * kG2EpiCols,
                    stage + (r_lo - cw * 64) * kG2EpiPitch, stage + (r_hi - cw * 64) * kG2EpiPitch);
      }
      gg_bar(1 + cw, 128);
      // 64 rows x 128 bytes: 8 lanes per row
#pragma unroll
      for (int i = wtid; i < 64 * 8; i += 128) {
        const int r = i >> 3, c = i & 7;
        const int dst = s_dst[cw][r];
        if (dst < 0) continue;
        *reinterpret_cast<uint4*>(p.out + int64_t(dst) * p.out_stride + n0 + qt * kG2EpiCols +
                                  c * 8) =
            *reinterpret_cast<const uint4*>(stage + r * kG2EpiPitch + c * 8);
      }
    }
    if constexpr (kSum) gg_fused_sum<64, kG2BN>(p, g.nt, s_dst[cw], s_tok[cw], 1 + cw, wtid);
  }
  if constexpr (kAsync) {
    if (wtid < 64) bulk_wait0();  // the last tile's copies, before the CTA's shared memory goes
  }
  if constexpr (kMc > 1) gg_cluster_sync();  // no multicast or remote arrive into a finished CTA
}

// ---- small rows per expert: swapped operands -------------------------------------------------
// The weights are wgmma's M operand (one 128-row n-block per tile: two m64 wgmmas) and the tokens
// its N operand (kTN = 16, 32 or 64 rows per m-block), so a tile computes 128 output columns for
// kTN tokens and no expert is padded to 128 rows: the kernel streams the weights with only kTN-row
// padding. Same promotion and scales as above; the accumulator is the transpose (thread: weight
// rows r, r + 8 of each 64-row half x kTN/8 pairs of tokens), staged transposed in shared memory
// for 16-byte row stores.
// Ping-pong: each consumer warpgroup runs its own tiles (of the CTA's tiles, warpgroup w takes
// every other one) from its own ring, fed by its own producer thread, so one warpgroup's per-tile
// latency (scales, metadata, epilogue) overlaps the other's K blocks: a short-K tile (DeepSeek
// TP8's GEMM2: 2 K blocks) was bound by that serial per-tile work with both warpgroups in lockstep
// on one tile (PERFORMANCE.md, grouped run 6). Separate rings, not one shared ring: with one ring
// a warpgroup running ahead could wait on a stage whose previous fill (for the other warpgroup)
// has not landed, and an mbarrier parity wait cannot tell those phases apart.
// kNB n-blocks per tile (1, 2 or 4; more than 1 for short K only, where a tile is a few K blocks
// and its fixed work (tile lookup, scale copy, row metadata, barriers, epilogue) weighs most: the
// tile streams its n-blocks one after the other through the same ring, stage by stage (weights of
// one n-block and K block, with that K block's token rows), into kNB accumulator pairs, and stores
// kTN rows x kNB * 128 columns in one epilogue.
template <int kTN, int kNB = 1>
struct SwapCfg {
  static constexpr int kStages = kTN == 64 ? 3 : 4;  // per warpgroup ring
  static constexpr int kWStage = kGBN * kGBK;        // 16 KB of weights
  static constexpr int kTStage = kTN * kGBK;         // tokens
  static constexpr int kStageBytes = kWStage + kTStage;
  static constexpr int kCols = kNB * kGBN;                   // output columns per tile
  static constexpr int kEpiPitch = kCols + 8;                // bf16 per staged row
  static constexpr int kEpiBytes = 2 * kTN * kEpiPitch * 2;  // one staging buffer per warpgroup
  static constexpr int kPrefBytes = (kGroupedMaxExperts + 1) * 4;
  static constexpr int kBarOff = 2 * kStages * kStageBytes + kEpiBytes;
  // per warpgroup two scale buffers (this tile's, the next tile's), each one chunk of kScaleKb K
  // blocks: tokens [kb][kTN], then weights [n-block][kb]. With kNB > 1 the whole K range must fit
  // one chunk (the launcher's rule: K <= kScaleKb * 128).
  static constexpr int kScaleKb = kNB > 1 ? 8 : (kTN == 64 ? 32 : 64);
  static constexpr int kScaleOff = (kBarOff + 2 * 2 * kStages * 8 + kPrefBytes + 15) / 16 * 16;
  static constexpr int kScaleFloats = kScaleKb * (kTN + kNB);
  static constexpr int kScaleBytes = 2 * 2 * kScaleFloats * 4;
  static constexpr int kSmemBytes = 1024 + kScaleOff + kScaleBytes + 64;
};
static_assert(SwapCfg<64>::kSmemBytes + 2 * 2 * 64 * 8 <= 227 * 1024,
              "swapped tile: shared memory");
static_assert(SwapCfg<32>::kSmemBytes + 2 * 2 * 32 * 8 <= 227 * 1024,
              "swapped tile: shared memory");
static_assert(SwapCfg<16>::kSmemBytes + 2 * 2 * 16 * 8 <= 227 * 1024,
              "swapped tile: shared memory");
static_assert(SwapCfg<32, 2>::kSmemBytes + 2 * 2 * 32 * 8 <= 227 * 1024,
              "swapped tile: shared memory");
static_assert(SwapCfg<64, 2>::kSmemBytes + 2 * 2 * 64 * 8 <= 227 * 1024,
              "swapped tile: shared memory");
static_assert(SwapCfg<16, 4>::kSmemBytes + 2 * 2 * 16 * 8 <= 227 * 1024,
              "swapped tile: shared memory");
static_assert(SwapCfg<16>::kStageBytes % 1024 == 0 && SwapCfg<32>::kStageBytes % 1024 == 0 &&
                  SwapCfg<64>::kStageBytes % 1024 == 0,
              "swapped tile: stages on 1024-byte boundaries (128-byte swizzle)");
static_assert(SwapCfg<16, 1>::kEpiPitch == kGEpiPitch, "one n-block: the 128 tile's staging pitch");

// 4-byte cp.async; src_bytes = 0 writes zero.
__device__ __forceinline__ void gg_cp_async_4(void* smem, const void* gmem, int src_bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_u32(smem)), "l"(gmem),
               "r"(src_bytes)
               : "memory");
}

template <int kTN>
__device__ __forceinline__ void gg_wgmma_tn(float (&d)[kTN / 2], uint64_t da, uint64_t db,
                                            int scale_d) {
  if constexpr (kTN == 16)
    gg_wgmma_n16(d, da, db, scale_d);
  else if constexpr (kTN == 32)
    gg_wgmma_n32(d, da, db, scale_d);
  else
    gg_wgmma_n64(d, da, db, scale_d);
}

// kSum: the fused top-k sum after the epilogue (GroupedGemmParams::sum_out), its own instantiation.
template <int kTN, int kNB = 1, int kSum = 0>
__global__ void __launch_bounds__(kGThreads, 1)
    grouped_gemm_swap_kernel(const __grid_constant__ GroupedGemmParams p,
                             const __grid_constant__ CUtensorMap tm_a,
                             const __grid_constant__ CUtensorMap tm_b) {
  using C = SwapCfg<kTN, kNB>;
  constexpr int kAcc = kTN / 2;
  constexpr int kS = C::kStages;
  extern __shared__ uint8_t gg_smem_raw[];
  // the first 1024-byte boundary by indexing (not an integer cast): derived pointers stay shared
  uint8_t* smem = gg_smem_raw + ((1024u - (smem_u32(gg_smem_raw) & 1023u)) & 1023u);
  uint16_t* stage_out = reinterpret_cast<uint16_t*>(smem + 2 * kS * C::kStageBytes);
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + C::kBarOff);  // [2][kS]
  uint64_t* empty = full + 2 * kS;                                  // [2][kS]
  int* pref = reinterpret_cast<int*>(empty + 2 * kS);
  float* s_sc = reinterpret_cast<float*>(smem + C::kScaleOff);  // [2 warpgroups][2 buffers]
  // destinations and row weights of each warpgroup's tile in its epilogue
  __shared__ int s_dst[2][kTN];
  __shared__ float s_w[2][kTN];
  __shared__ int s_tok[kSum ? 2 : 1][kTN];  // the fused top-k sum's tokens to sum

  const int tid = threadIdx.x;
  const int wg = tid / 128, wtid = tid % 128;
  const int warp = wtid / 32, lane = tid % 32;
  if (tid == 0) {
    for (int i = 0; i < 2 * kS; ++i) {
      mbar_init(&full[i], 1);
      mbar_init(&empty[i], 4);  // one arrive per warp of the ring's consumer warpgroup
    }
    fence_barrier_init();
  }
  int total_m = 0;
  if (p.masked) {
    if (tid < 32) gg_masked_prefix<kTN>(p, pref, tid);
    __syncthreads();
    total_m = pref[p.E];
  } else {
    __syncthreads();
    total_m = *p.num_rows_ptr / kTN;
  }
  const int n_tiles_n = p.N / C::kCols;
  const int n_tiles = total_m * n_tiles_n;
  const int num_kb = p.K / kGBK;
  // warpgroup pipeline w (producer thread w, ring w, consumer warpgroup w) takes the CTA's tiles
  // blockIdx.x + w * gridDim.x, stepping by 2 * gridDim.x
  const int grid = static_cast<int>(gridDim.x);

  if (wg == 0) {
    gg_setmaxnreg_dec<40>();
    if (warp < 2 && lane == 0) {
      const int w = warp;
      if (w == 0) {
        tma_prefetch_desc(&tm_a);
        tma_prefetch_desc(&tm_b);
      }
      uint64_t* rfull = full + w * kS;
      uint64_t* rempty = empty + w * kS;
      uint8_t* ring = smem + w * kS * C::kStageBytes;
      int it = 0;
      for (int t = static_cast<int>(blockIdx.x) + w * grid; t < n_tiles; t += 2 * grid) {
        const GTile g = gg_tile<kTN>(p, pref, total_m, n_tiles_n, t);
        for (int j = 0; j < kNB; ++j) {
          const int brow = g.e * p.N + (g.nt * kNB + j) * kGBN;
          for (int kb = 0; kb < num_kb; ++kb, ++it) {
            const int s = it % kS;
            const uint32_t ph = (it / kS) & 1;
            mbar_wait(&rempty[s], ph ^ 1);
            uint8_t* dst = ring + s * C::kStageBytes;
            mbar_arrive_expect_tx(&rfull[s], C::kStageBytes);
            tma_load_2d(dst, &tm_b, &rfull[s], kb * kGBK, brow);
            tma_load_2d(dst + C::kWStage, &tm_a, &rfull[s], kb * kGBK, g.row0);
          }
        }
      }
    }
    return;
  }

  gg_setmaxnreg_inc<232>();
  const int cw = wg - 1;
  const int wr = warp * 16 + (lane >> 2);  // weight rows wr, wr + 8 of each 64-row half
  const int q = lane & 3;
  const int bar_id = 1 + cw;
  uint64_t* rfull = full + cw * kS;
  uint64_t* rempty = empty + cw * kS;
  const uint8_t* ring = smem + cw * kS * C::kStageBytes;
  uint16_t* my_out = stage_out + cw * kTN * C::kEpiPitch;
  float* my_sc = s_sc + cw * 2 * C::kScaleFloats;
  // Scales of K blocks [kb, kb + n) of tile g into buffer buf (cp.async by this warpgroup, one
  // commit group; rows past A's end read 0: never stored). Element i is token row i % kTN of K
  // block i / kTN (kTN a power of two: no division; ceil(n kTN / 128) copies per thread).
  auto copy_scales = [&](const GTile& g, int kb, float* buf) {
    const int n = min(C::kScaleKb, num_kb - kb);
    for (int i = wtid; i < n * kTN; i += 128) {
      const int c = i / kTN, tr = i % kTN;
      const int64_t row = int64_t(g.row0) + tr;
      const bool ok = row < p.a_rows;
      gg_cp_async_4(
          buf + c * kTN + tr,
          ok ? p.a_scale + row * p.a_scale_stride + int64_t(kb + c) * p.a_scale_kb : p.a_scale,
          ok ? 4 : 0);
    }
#pragma unroll
    for (int j = 0; j < kNB; ++j) {
      const float* bs = p.b_scale + int64_t(g.e) * p.b_scale_e_stride +
                        int64_t(g.nt * kNB + j) * p.b_scale_n_stride + int64_t(kb) * p.b_scale_kb;
      for (int i = wtid; i < n; i += 128)
        gg_cp_async_4(buf + C::kScaleKb * kTN + j * C::kScaleKb + i, bs + int64_t(i) * p.b_scale_kb,
                      4);
    }
    cp_async_commit();
  };
  // The next tile's first scale chunk and sorted ids are fetched while this tile runs (two scale
  // buffers by tile parity): a short-K tile would otherwise wait an L2 round trip for them.
  const int t0 = static_cast<int>(blockIdx.x) + cw * grid;
  GTile g_next{};
  int next_row_id = 0;
  if (t0 < n_tiles) {
    g_next = gg_tile<kTN>(p, pref, total_m, n_tiles_n, t0);
    copy_scales(g_next, 0, my_sc);
    if (wtid < kTN) next_row_id = gg_row_id(p, g_next, wtid);
  }
  int it = 0, tp = 0;
  for (int t = t0; t < n_tiles; t += 2 * grid, tp ^= 1) {
    const GTile g = g_next;
    // this tile's scales: tokens [kb][kTN], weights [n-block][kb]
    float* sc = my_sc + tp * C::kScaleFloats;
    // the epilogue's metadata of token row wtid (wtid < kTN), loaded under the K loop
    const int row_id = next_row_id;
    int row_dst = -1;
    float row_w = 1.0f;
    // the next tile's prefetch: its buffer was last read in this warpgroup's previous tile, which
    // every thread of the warpgroup finished before that tile's epilogue barriers
    if (t + 2 * grid < n_tiles) {
      g_next = gg_tile<kTN>(p, pref, total_m, n_tiles_n, t + 2 * grid);
      copy_scales(g_next, 0, my_sc + (tp ^ 1) * C::kScaleFloats);
      if (wtid < kTN) next_row_id = gg_row_id(p, g_next, wtid);
    } else {
      cp_async_commit();  // an empty group: "all but the newest group" stays this tile's
    }
    float acc0[kNB][kAcc], acc1[kNB][kAcc], part0[kAcc], part1[kAcc];
#pragma unroll
    for (int j = 0; j < kNB; ++j)
#pragma unroll
      for (int i = 0; i < kAcc; ++i) acc0[j][i] = acc1[j][i] = 0.0f;
#pragma unroll
    for (int j = 0; j < kNB; ++j) {
      for (int kb = 0; kb < num_kb; ++kb, ++it) {
        const int kc = kb % C::kScaleKb;
        if (kNB == 1 && kc == 0 && kb > 0) {  // K > kScaleKb blocks: the next chunk, synchronously
          gg_bar(bar_id, 128);                // the previous chunk's readers are done
          copy_scales(g, kb, sc);
          cp_async_wait<0>();
          gg_bar(bar_id, 128);
        }
        const int s = it % kS;
        const uint32_t ph = (it / kS) & 1;
        mbar_wait(&rfull[s], ph);
        const uint8_t* w_s = ring + s * C::kStageBytes;
        const uint64_t da0 = gg_desc(w_s), da1 = gg_desc(w_s + 64 * kGBK);
        const uint64_t db = gg_desc(w_s + C::kWStage);
        gg_reg_fence(part0);
        gg_reg_fence(part1);
        gg_fence();
#pragma unroll
        for (int ks = 0; ks < 4; ++ks) gg_wgmma_tn<kTN>(part0, da0 + 2 * ks, db + 2 * ks, ks > 0);
#pragma unroll
        for (int ks = 0; ks < 4; ++ks) gg_wgmma_tn<kTN>(part1, da1 + 2 * ks, db + 2 * ks, ks > 0);
        gg_commit();
        if (j == 0 && kb == 0) {
          if (wtid < kTN) gg_row_finish(p, g, wtid, row_id, row_dst, row_w);
          cp_async_wait<1>();  // this tile's first chunk (the next tile's may be in flight)
          // the chunk is in shared memory; also: every thread of the warpgroup is past its
          // previous tile's epilogue (the readers of my_out / s_dst / s_w are done)
          gg_bar(bar_id, 128);
        }
        // this block's scales: my token columns 8 i + 2 q + c, the n-block's weight scale
        const float sb = sc[C::kScaleKb * kTN + j * C::kScaleKb + kc];
        float sa[kTN / 4];
#pragma unroll
        for (int i = 0; i < kTN / 8; ++i) {
          const float2 v = *reinterpret_cast<const float2*>(sc + kc * kTN + 8 * i + 2 * q);
          sa[2 * i] = v.x * sb;
          sa[2 * i + 1] = v.y * sb;
        }
        gg_wait0();
        gg_reg_fence(part0);
        gg_reg_fence(part1);
        if (lane == 0) mbar_arrive(&rempty[s]);
#pragma unroll
        for (int i = 0; i < kTN / 8; ++i)
#pragma unroll
          for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int c = 0; c < 2; ++c) {
              acc0[j][4 * i + 2 * h + c] =
                  fmaf(part0[4 * i + 2 * h + c], sa[2 * i + c], acc0[j][4 * i + 2 * h + c]);
              acc1[j][4 * i + 2 * h + c] =
                  fmaf(part1[4 * i + 2 * h + c], sa[2 * i + c], acc1[j][4 * i + 2 * h + c]);
            }
      }
    }

    // ---- epilogue (this warpgroup; block 0's barrier ordered it after its previous tile's) ----
    if (wtid < kTN) {
      s_dst[cw][wtid] = row_dst;
      s_w[cw][wtid] = row_w;
    }
    gg_bar(bar_id, 128);
#pragma unroll
    for (int j = 0; j < kNB; ++j) {
      const int n0 = (g.nt * kNB + j) * kGBN;
      float bias_v[4] = {0.0f, 0.0f, 0.0f, 0.0f};  // weight rows wr, wr + 8, 64 + wr, 72 + wr
      if (p.bias) {
#pragma unroll
        for (int h = 0; h < 4; ++h) {
          const int64_t bi = int64_t(g.e) * p.N + n0 + 64 * (h >> 1) + wr + 8 * (h & 1);
          bias_v[h] = p.bias_bf16 ? bf16_bits_to_float(static_cast<const uint16_t*>(p.bias)[bi])
                                  : static_cast<const float*>(p.bias)[bi];
        }
      }
#pragma unroll
      for (int i = 0; i < kTN / 8; ++i)
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const int tok = 8 * i + 2 * q + c;
          const float w = s_w[cw][tok];
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            my_out[tok * C::kEpiPitch + j * kGBN + wr + 8 * h] =
                float_to_bf16_bits((acc0[j][4 * i + 2 * h + c] + bias_v[h]) * w);
            my_out[tok * C::kEpiPitch + j * kGBN + 64 + wr + 8 * h] =
                float_to_bf16_bits((acc1[j][4 * i + 2 * h + c] + bias_v[2 + h]) * w);
          }
        }
    }
    gg_bar(bar_id, 128);
    // kTN rows x kNB * 256 bytes: 16 * kNB lanes per row
    const int n0 = g.nt * C::kCols;
    for (int i = wtid; i < kTN * 16 * kNB; i += 128) {
      const int r = i / (16 * kNB), c = i % (16 * kNB);
      const int dst = s_dst[cw][r];
      if (dst < 0) continue;
      *reinterpret_cast<uint4*>(p.out + int64_t(dst) * p.out_stride + n0 + c * 8) =
          *reinterpret_cast<const uint4*>(my_out + r * C::kEpiPitch + c * 8);
    }
    if constexpr (kSum) gg_fused_sum<kTN, C::kCols>(p, g.nt, s_dst[cw], s_tok[cw], bar_id, wtid);
  }
}

// ids / meta of the masked layout (see launch_masked_rows).
__global__ void __launch_bounds__(256)
    masked_rows_kernel(const int32_t* __restrict__ counts, int E, int max_m,
                       int32_t* __restrict__ ids, int32_t* __restrict__ meta) {
  const int64_t n = int64_t(E) * max_m;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int e = static_cast<int>(i / max_m), r = static_cast<int>(i % max_m);
    const int c = min(max(counts[e], 0), max_m);
    ids[i] = r < c ? static_cast<int32_t>(i) : static_cast<int32_t>(n);
  }
  if (blockIdx.x == 0 && threadIdx.x == 0) meta[0] = static_cast<int32_t>(n);
}

}  // namespace fp8moe::cuda
