// The "single" path of the CUDA fused MoE: the whole layer for a decode batch (M <= 8 tokens,
// block-FP8 weights, 1x128 activation groups) in ONE persistent kernel, one CTA per SM, all CTAs
// resident at once (cooperative launch).
//
// Why: at M = 1 the layer is a weight read (DeepSeek-V3 TP8: 44 MB, ~10 us at the card's read
// bandwidth) but the multi-kernel paths pay a chain of dependent steps per kernel and per CTA
// (routing -> alignment -> quantisation -> GEMM1 -> group quantisation -> GEMM2 -> reduction;
// docs/PERFORMANCE.md runs 5-9: the stream path's GEMMs read at 16-32% of the bandwidth at M = 1).
// Here every SM keeps its share of the weights in flight through a deep shared-memory ring filled
// by bulk copies (cp.async.bulk, completing on mbarriers), and the only grid-wide waits are the
// routing result and "every CTA has finished GEMM1" -- while a CTA waits for the latter its ring
// already holds its first GEMM2 weights.
//
// Per CTA (kW = 16 consumer warps + 1 producer warp):
//   0. When routing in the kernel: one token, every CTA routes it for itself (no grid-wide wait);
//      more, CTA b < M routes token b and publishes it (sync[0]). Every CTA waits for the
//      published routing if any and builds the pair tables (active local experts ascending, each
//      expert's pairs in pair order: the stream path's layout) in shared memory. Then the producer
//      starts loading while the consumers quantise the M token rows of x into shared memory
//      (1x128 groups), under the first loads' latency.
//   1. GEMM1 units (wgmma, the default): (active expert, 16 output columns) = 16 gate rows + the
//      16 matching up rows of w13, K = H in stages of 1024 bytes per row, one 4D TMA box per stage
//      (128-byte swizzle). Warpgroup wg takes K blocks wg and wg + 4 of each stage: wgmma
//      m64n8k32 e4m3 with the unit's 32 rows as tile rows 32-63 and every token as the 8 B
//      columns, promotes it with the activation group scale and the weight block scale (both from
//      shared memory: the producer copies the stage's scale words next to it), and the four
//      warpgroups' sums are added in order at the end of the unit, where the activation (rounded
//      like the reference) is applied and h written to global memory. (Run 13: faster than the
//      mma.sync GEMM1 it replaced, 8 + 8 rows per unit, on every decode point.)
//   2. Grid barrier (sync[1]); every CTA quantises all of h (1x128 groups) into shared memory.
//   3. GEMM2 units: 16 rows of w2 for every active expert (a stage holds kW / (I / 128) experts),
//      each warp one (expert, 128-wide K block); the K blocks of an expert are added in order (the
//      expert's warps meet at their own named barrier), times the router weight, rounded to bf16
//      (y2), and the unit's output rows are the sums of each token's local slots in slot order
//      (the reference's top-k sum; one CTA-wide barrier per unit). No atomics on data, so the
//      output is deterministic.
// The producer warp walks the same unit/stage sequence: wait for a free slot, expect the stage's
// bytes on its full barrier, issue the GEMM1 box (one 4D box of 16 + 16 rows x 8 K blocks) or
// one bulk copy per expert's 16 rows (GEMM2), and one
// bulk copy per scale window; weights with an L2 evict-first hint. (Run 12: with 16 row copies per
// stage GEMM1 streamed at 2-2.7 TB/s; boxes made it ~10% faster and left the consumers as the
// bound; run 13: the ring feed alone carries ~4.1 TB/s.)
#pragma once

#include "cuda_common.cuh"
#include "moe_params.hpp"
#include "smxx_fp8_quant.cuh"
#include "smxx_moe_align.cuh"
#include "smxx_moe_routing.cuh"

namespace fp8moe::cuda {

// kW consumer warps; warp kW is the producer. 16 (docs/PERFORMANCE.md run 12: faster than 8 on 27
// of 29 decode points; 24 lost on 16 of 19).
constexpr int kSgWarps = 16;
constexpr int sg_threads(int kW) { return (kW + 1) * 32; }
constexpr int kSgMaxM = 8;
constexpr int kSgMaxPairs = 64;  // M * topk
constexpr int kSgMaxStages = 12;
// A stage (32 KB): GEMM1 16 gate + 16 up rows x kc1 = 1024 bytes as K-block slabs of 4 KB (one TMA
// box); GEMM2 16 rows x I of <= kW / (I / 128) experts (one contiguous copy each, pitch I). Each
// ring slot's scale windows (GEMM1: gate, up; GEMM2: one per expert) sit in a separate array.
// (Run 14 and before: a 4 KB header in every stage held the windows and gave the first slab's wgmma
// its 32 ignored tile rows; without it the ring has a stage more: 6 instead of 5 at M = 1.)
// One scale window: <= 8 floats (a 1024-byte K stage, or I <= 1024), a 16-byte aligned copy.
constexpr int kSgWinBytes = 48;
constexpr int kSgStageBytes = 32768;
constexpr int sg_data2_bytes(int kW) { return kW * 2048; }  // (kW / nkb) * 16 * 128 nkb
// Before the ring, never written: the first slot's first slab's wgmma reads it as its 32 ignored
// tile rows (every other slab's are the slab before it).
constexpr int kSgGuardBytes = 4096;
// Floats of one reduction buffer: GEMM1 the unit-end sums of 8 warps; GEMM2 the K blocks >= 1 of
// the epx experts of a stage (nkb2 = I / 128, epx = kW / nkb2).
__host__ __device__ constexpr int sg_red_floats(int kW, int nkb2) {
  return (8 > (kW / nkb2) * (nkb2 - 1) ? 8 : (kW / nkb2) * (nkb2 - 1)) * 32 * 4;
}
// Bytes of one ring slot's scale windows: GEMM1 two, GEMM2 one per expert of a stage.
__host__ __device__ constexpr int sg_win_slot(int kW, int nkb2) {
  return (2 > kW / nkb2 ? 2 : kW / nkb2) * kSgWinBytes;
}
// Bytes before the ring's alignment: barriers, tables, reductions, y2 rows, windows, guard.
__host__ __device__ constexpr uint32_t sg_prefix_bytes(int P, int red_floats, int win_slot,
                                                       int nstages) {
  return 16u * kSgMaxStages + 4096u + 4u * (2u * red_floats + 2u * 16u * P) +
         static_cast<uint32_t>(nstages * win_slot) + kSgGuardBytes;
}

struct SingleParams {
  int M, H, I, E, E_global, topk;
  int route;  // route from rp.logits (else ids_in / tw_in)
  RoutingParams rp;
  const uint16_t* x;  // (M, H) bf16
  const int32_t* ids_in;
  const float* tw_in;
  int32_t* ids_ws;  // (M, topk) the kernel's routing
  float* tw_ws;
  const int32_t* expert_map;
  WeightSide w1, w2;
  const float* w1_scale_end;  // one past the last scale word (scale windows stay inside)
  const float* w2_scale_end;
  int ue8m0;
  float min_scale2;  // fused SiLU+quant scale floor of h, else 0
  int h_f32;         // h is not rounded to bf16 (fused SiLU+quant semantics)
  ActParams ap;
  int nstages;
  int kc1;          // GEMM1 bytes per row and stage (1024)
  int stage_bytes;  // kSgStageBytes
  int act_bytes;    // shared bytes of the token region (qx + sx, or qh + sh)
  int red_floats;   // floats of one reduction buffer (sg_red_floats)
  int win_slot;     // bytes of one ring slot's scale windows (sg_win_slot)
  float* hbuf;      // (M * topk, I) h at each pair's sorted position
  unsigned* sync;   // [0] routed tokens, [1] CTAs past GEMM1; zero before the launch
  uint16_t* out;    // (M, H) bf16
  // diagnostics (FP8MOE_SINGLE_TRACE): per CTA, kSgTracePoints slots (SgTrace)
  unsigned long long* trace;
};
// Trace slots: global-timer stamps (ns) of the phases, then clock64 sums (cycles) of the waits.
enum SgTrace {
  kTrStart,
  kTrOwnRouting,  // this CTA's routing done (CTAs >= M: at once)
  kTrXQuant,
  kTrRouted,  // every token's routing visible
  kTrTables,
  kTrFirstData1,  // consumer warp 0: first GEMM1 stage full
  kTrGemm1,
  kTrBarrier,
  kTrHQuant,
  kTrFirstData2,
  kTrGemm2,
  kTrProducerDone,  // producer: last copy issued
  kTrWaitFull1,     // cycles consumer warp 0 waited on full barriers in GEMM1
  kTrWaitFull2,
  kTrWaitEmpty,  // cycles the producer waited on empty slots
  // cycles consumer thread 0 spent in: GEMM1 wgmma (fence to wait), releasing slots, unit ends
  // (reduction, activation, h store); GEMM2 block mma, releasing slots, its expert's K-block
  // reduction and y2 rows, unit ends (CTA barrier, output rows)
  kTrMma1,
  kTrRel1,
  kTrEnd1,
  kTrMma2,
  kTrRel2,
  kTrGrp2,
  kTrEnd2,
  // cycles since the CTA's own routing started, after each of its steps (route_token_block's
  // `steps`): keys, groups, chunk counts, candidates, slots, weights
  kTrRoute0,
  kSgTracePoints = kTrRoute0 + 6
};

// ---- small PTX helpers -------------------------------------------------------------------------
__device__ __forceinline__ unsigned long long sg_now() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ void sg_stamp(const SingleParams& p, int point) {
  if (p.trace && threadIdx.x == 0)  // consumer warp 0, lane 0
    p.trace[blockIdx.x * kSgTracePoints + point] = sg_now();
}
// mbar_wait, with the cycles waited added to *acc when tracing
__device__ __forceinline__ void sg_wait(const SingleParams& p, uint64_t* bar, uint32_t ph,
                                        long long* acc) {
  if (!p.trace) return mbar_wait(bar, ph);
  const long long t = clock64();
  mbar_wait(bar, ph);
  *acc += clock64() - t;
}
// clock64 when tracing (else 0) and the cycles since t0 added to *acc
__device__ __forceinline__ long long sg_clk(const SingleParams& p) {
  return p.trace ? clock64() : 0;
}
__device__ __forceinline__ void sg_acc(const SingleParams& p, long long* acc, long long t0) {
  if (p.trace) *acc += clock64() - t0;
}
// The kW consumer warps only (the producer warp never joins).
template <int kW>
__device__ __forceinline__ void sg_consumer_sync() {
  asm volatile("bar.sync 1, %0;\n" ::"n"(kW * 32) : "memory");
}
// The `warps` consumer warps of one GEMM2 expert slot q of a stage (q < 8 when warps >= 2: named
// barriers 2..9).
__device__ __forceinline__ void sg_group_sync(int q, int warps) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(2 + q), "r"(warps * 32) : "memory");
}

// ---- wgmma (GEMM1) -------------------------------------------------------------------------
// A: K-major, 128-byte swizzle, 8-row groups 1024 bytes apart (the TMA box's layout).
__device__ __forceinline__ uint64_t sg_desc_sw128(const void* smem) {
  const uint64_t addr = smem_u32(smem);
  return ((addr & 0x3FFFFull) >> 4) | (uint64_t(1) << 16) | (uint64_t(1024 >> 4) << 32) |
         (uint64_t(1) << 62);
}
// B: K-major without swizzle: core matrices of 8 rows x 16 bytes (row r at +16 r), the next 16
// bytes of K `lbo` bytes further (lbo = 16 M: the token rows >= M of a core matrix read the next
// one's bytes, results nobody reads).
__device__ __forceinline__ uint64_t sg_desc_interleave(const void* smem, int lbo) {
  const uint64_t addr = smem_u32(smem);
  return ((addr & 0x3FFFFull) >> 4) | (uint64_t(lbo >> 4) << 16) | (uint64_t(128 >> 4) << 32);
}
// D(64 x 8 f32, per warpgroup) (+)= A(64 x 32 e4m3) * B(8 x 32 e4m3)^T; scale_d = 0 overwrites.
__device__ __forceinline__ void sg_wgmma_n8(float (&d)[4], uint64_t da, uint64_t db, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %6, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n8k32.f32.e4m3.e4m3 {%0, %1, %2, %3}, %4, %5, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "l"(da), "l"(db), "r"(scale_d));
}
__device__ __forceinline__ void sg_wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void sg_wgmma_commit_wait() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
  asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
}
// K blocks per warpgroup and stage at most (kc1 = 1024: 8 K blocks over 4 warpgroups)
constexpr int kSgWgKb = 2;

// A 16-byte aligned window of <= kSgWinBytes holding the n (<= 8) floats at p, kept inside the
// tensor [.., end) (end 16-byte aligned): bulk copies need 16-byte addresses and sizes. Returns the
// window start; *len its bytes, *off the index of p in it.
__device__ __forceinline__ const float* sg_window(const float* p, int n, const float* end,
                                                  uint32_t* len, int* off) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  uintptr_t s = a & ~uintptr_t(15);
  const uint32_t l = static_cast<uint32_t>((a + 4u * n - s + 15) & ~uintptr_t(15));
  const uintptr_t e = reinterpret_cast<uintptr_t>(end);
  if (s + l > e) s = e - l;
  *len = l;
  *off = static_cast<int>((a - s) / 4);
  return reinterpret_cast<const float*>(s);
}

// Position in the ring: slot and phase parity, advanced without a division per stage.
struct SgRing {
  int slot = 0;
  uint32_t phase = 0;
  __device__ __forceinline__ void advance(int nstages) {
    if (++slot == nstages) {
      slot = 0;
      phase ^= 1u;
    }
  }
};

// The shared tables of one call (thread-block copies, built after the routing).
struct SgTables {
  int32_t pe[kSgMaxPairs];   // local expert of pair i, -1: not on this rank / padded
  int32_t pos[kSgMaxPairs];  // sorted position of pair i, -1 when dropped
  int32_t first[kSgMaxPairs];
  int32_t plist[kSgMaxPairs];  // pair at sorted position
  int32_t act[kSgMaxPairs];    // local expert of active index j
  int32_t eoff[kSgMaxPairs + 1];
  float tw[kSgMaxPairs];
  // the scale-window offsets of each ring slot, written by the producer before it arms the slot
  // (the arrive releases them): GEMM1 [0] gate, [1] up; GEMM2 [q] expert q of the stage
  int32_t woff[kSgMaxStages][16];
  int32_t n_act, n_valid;
  // the routing of a one-token call (every CTA routes it: no grid-wide publication)
  int32_t rid[32];
  float rtw[32];
};

// The sequence of stages both roles walk. GEMM1: units u = b, b + G, ... < n_act * I / 8, each
// ceil(H / kc1) stages. GEMM2: units (the GEMM2 start rotated so CTAs with one GEMM1 unit less
// take the extra GEMM2 unit first) u2 < H / 16, each ceil(n_act / epx) stages.
struct SgPlan {
  int u1_first, u1_count, ns1;
  int u2_first, u2_count, ns2;
  int epx, nkb2;
};
template <int kW>
__device__ __forceinline__ SgPlan sg_plan(const SingleParams& p, int n_act) {
  SgPlan q;
  const int G = gridDim.x, b = blockIdx.x;
  const int U1 = n_act * (p.I / 16);
  q.u1_first = b;
  q.u1_count = b < U1 ? (U1 - b + G - 1) / G : 0;
  q.ns1 = (p.H + p.kc1 - 1) / p.kc1;
  const int r1 = U1 % G;
  const int b2 = (b - r1 + G) % G;
  const int U2 = p.H / 16;
  q.u2_first = b2;
  q.u2_count = b2 < U2 ? (U2 - b2 + G - 1) / G : 0;
  q.nkb2 = p.I / 128;
  q.epx = kW / q.nkb2;
  q.ns2 = (n_act + q.epx - 1) / q.epx;
  return q;
}

// One 16 x 128 block of A (stage rows `a`, pitch `pitch`, K offset k) against 8 B columns (row
// b_row of the token region, pitch bpitch; nullptr = zero column) -> 16 x 8 partial sums.
// K relabelling as in the stream path: lane (g, t4) holds bytes [32 t4, 32 t4 + 32) of rows g and
// g + 8 and the same bytes of its B column, so every mma sums over its own 128-block only.
__device__ __forceinline__ void sg_block_mma(const uint8_t* a, int pitch, const uint8_t* b_col,
                                             float (&part)[4]) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
  const uint4 l0 = *reinterpret_cast<const uint4*>(a + g * pitch + t4 * 32);
  const uint4 l1 = *reinterpret_cast<const uint4*>(a + g * pitch + t4 * 32 + 16);
  const uint4 h0 = *reinterpret_cast<const uint4*>(a + (g + 8) * pitch + t4 * 32);
  const uint4 h1 = *reinterpret_cast<const uint4*>(a + (g + 8) * pitch + t4 * 32 + 16);
  uint4 b0 = make_uint4(0, 0, 0, 0), b1 = make_uint4(0, 0, 0, 0);
  if (b_col) {
    b0 = *reinterpret_cast<const uint4*>(b_col + t4 * 32);
    b1 = *reinterpret_cast<const uint4*>(b_col + t4 * 32 + 16);
  }
  const uint32_t lo[8] = {l0.x, l0.y, l0.z, l0.w, l1.x, l1.y, l1.z, l1.w};
  const uint32_t hi[8] = {h0.x, h0.y, h0.z, h0.w, h1.x, h1.y, h1.z, h1.w};
  const uint32_t bb[8] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
  // two accumulator chains (j even / odd) so consecutive mma do not wait on each other's result
  float p2[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
  for (int r = 0; r < 4; ++r) part[r] = 0.0f;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const uint32_t av[4] = {lo[2 * j], hi[2 * j], lo[2 * j + 1], hi[2 * j + 1]};
    const uint32_t bv[2] = {bb[2 * j], bb[2 * j + 1]};
    mma_e4m3_16832(j % 2 == 0 ? part : p2, av, bv);
  }
#pragma unroll
  for (int r = 0; r < 4; ++r) part[r] += p2[r];
}

template <int kW>
__global__ void __launch_bounds__(sg_threads(kW), 1)
    moe_single_kernel(const __grid_constant__ SingleParams p,
                      const __grid_constant__ CUtensorMap tm_w1) {
  extern __shared__ __align__(128) unsigned char sg_smem[];
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
  const int M = p.M, H = p.H, I = p.I, topk = p.topk, P = M * topk;
  // shared layout (sg_prefix_bytes): barriers | tables | reductions (two buffers) | y2 rows (two
  // buffers: GEMM2 units alternate) | scale windows of each slot | guard | ring (1024-aligned) |
  // token region. Every pointer is reached by indexing the shared array (not through an integer
  // cast) so that the compiler keeps it in the shared window: ld/st.shared, not generic accesses.
  uint64_t* full = reinterpret_cast<uint64_t*>(sg_smem);
  uint64_t* empty = full + kSgMaxStages;
  SgTables& T = *reinterpret_cast<SgTables*>(sg_smem + 16 * kSgMaxStages);
  float* red = reinterpret_cast<float*>(sg_smem + 16 * kSgMaxStages + 4096);
  float* ybuf = red + 2 * p.red_floats;
  unsigned char* wins = reinterpret_cast<unsigned char*>(ybuf + 2 * P * 16);
  static_assert(sizeof(SgTables) <= 4096);
  const uint32_t sbase = smem_u32(sg_smem);
  const uint32_t pre = sg_prefix_bytes(P, p.red_floats, p.win_slot, p.nstages);
  unsigned char* ring = sg_smem + (((sbase + pre + 1023u) & ~1023u) - sbase);
  unsigned char* treg = ring + p.nstages * p.stage_bytes;
  // token region: GEMM1 qx (M rows, pitch H + 16) + sx (M x H / 128); GEMM2 qh (P rows, pitch
  // I + 16) + sh (P x I / 128)
  const int xpitch = H + 16, hpitch = I + 16;
  uint8_t* qx = treg;
  float* sx = reinterpret_cast<float*>(treg + M * xpitch);
  uint8_t* qh = treg;
  float* sh = reinterpret_cast<float*>(treg + P * hpitch);

  sg_stamp(p, kTrStart);
  if (tid == 0) {
    for (int i = 0; i < p.nstages; ++i) {
      mbar_init(&full[i], 1);
      // every consumer thread arrives: mbarrier.arrive releases the arriving thread's own
      // accesses, so each thread's reads of the slot are ordered before the producer's rewrite
      // without relying on __syncwarp + one elected arrive (which compute-sanitizer racecheck
      // reports as a race once the ring wraps, run 13)
      // (run 15: one elected lane per warp after __syncwarp, or one thread per warpgroup after a
      // named barrier: faster on none of the 18 decode points; the arrivals are not the cost)
      mbar_init(&empty[i], kW * 32);
    }
    fence_barrier_init();
  }
  if (warp == kW && lane == 0) tma_prefetch_desc(&tm_w1);  // long before its first use

  // ---- 0. routing, x quantisation, tables --------------------------------------------------
  // One token: every CTA routes it for itself (no grid-wide publication and wait: run 14); more:
  // CTA b < M routes token b and publishes it in sync[0].
  const bool local_route = p.route && M == 1;
  const int32_t* ids = p.ids_in;
  const float* tw = p.tw_in;
  if (p.route && !local_route) {
    ids = p.ids_ws;
    tw = p.tw_ws;
  }
  // every warp routes (scratch: the ring, not yet in use), then every warp quantises x. (Run 14:
  // 8 warps routing on a named barrier while the other 9 quantise x measured no faster in graph
  // replay, and racecheck reported hazards on the tables after it with 640 experts.)
  if (local_route || (p.route && static_cast<int>(blockIdx.x) < M)) {
    // experts per thread: the fewest that cover kRouteMaxExperts (less unrolled code to fetch)
    constexpr int kOwn = (kRouteMaxExperts + sg_threads(kW) - 1) / sg_threads(kW);
    const int t = local_route ? 0 : static_cast<int>(blockIdx.x);
    route_token_block<kOwn>(p.rp, t, p.E_global, topk, ring,
                            local_route ? T.rid : p.ids_ws + t * topk,
                            local_route ? T.rtw : p.tw_ws + t * topk,
                            p.trace ? p.trace + blockIdx.x * kSgTracePoints + kTrRoute0 : nullptr);
    // published: route_token_block ends with a block barrier after warp 0 wrote the ids, so one
    // fence by thread 0 publishes them
    if (!local_route && tid == 0) {
      __threadfence();
      atomicAdd(&p.sync[0], 1u);
    }
  }
  sg_stamp(p, kTrOwnRouting);
  if (p.route && !local_route) {
    if (tid == 0)
      while (ld_acquire_gpu(&p.sync[0]) < static_cast<unsigned>(M)) {
      }
    __syncthreads();
  }
  sg_stamp(p, kTrRouted);
  if (tid < P) {
    const int e =
        local_expert(local_route ? T.rid[tid] : __ldcg(ids + tid), p.expert_map, p.E_global, p.E);
    T.pe[tid] = e;
    T.tw[tid] = local_route ? T.rtw[tid] : __ldcg(tw + tid);
  }
  __syncthreads();
  if (tid < P) {
    const int e = T.pe[tid];
    int pos = -1, first = 0;
    if (e >= 0) {
      pos = 0;
      first = 1;
      for (int k = 0; k < P; ++k) {
        const int ek = T.pe[k];
        if (ek < 0) continue;
        pos += ek < e || (ek == e && k < tid);
        if (ek == e && k < tid) first = 0;
      }
    }
    T.pos[tid] = pos;
    T.first[tid] = first;
  }
  __syncthreads();
  if (tid < P && T.pe[tid] >= 0) {
    const int e = T.pe[tid];
    T.plist[T.pos[tid]] = tid;
    if (T.first[tid]) {
      int j = 0;
      for (int k = 0; k < P; ++k) j += T.first[k] && T.pe[k] < e;
      T.act[j] = e;
      T.eoff[j] = T.pos[tid];
    }
  }
  if (tid == 0) {
    int na = 0, nv = 0;
    for (int k = 0; k < P; ++k) {
      na += T.first[k];
      nv += T.pe[k] >= 0;
    }
    T.n_act = na;
    T.n_valid = nv;
    T.eoff[na] = nv;
  }
  fence_proxy_async();  // the routing scratch in the ring is rewritten by bulk copies next
  __syncthreads();
  sg_stamp(p, kTrTables);
  const int n_act = T.n_act;
  const SgPlan plan = sg_plan<kW>(p, n_act);
  const int units1 = I / 16;

  // ---- producer warp ---------------------------------------------------------------------
  if (warp == kW) {
    SgRing ring_pos;
    long long waited = 0;
    // weights are read once per call: evict-first keeps L2 for the code, activations and scales
    // (run 12: 2-5% faster on every decode point)
    const uint64_t pol = l2_policy_evict_first();
    // next_slot waits until the slot is free (the consumers no longer read its data nor its
    // window offsets); arm_slot, after the offsets are written, announces the bytes
    auto next_slot = [&]() {
      const int s = ring_pos.slot;
      const uint32_t ph = ring_pos.phase;
      if (lane == 0) sg_wait(p, &empty[s], ph ^ 1, &waited);
      __syncwarp();
      ring_pos.advance(p.nstages);
      return s;
    };
    auto arm_slot = [&](int s, uint32_t bytes) {
      __syncwarp();
      if (lane == 0) mbar_arrive_expect_tx(&full[s], bytes);
      __syncwarp();
    };
    for (int k = 0; k < plan.u1_count; ++k) {
      const int u = plan.u1_first + k * gridDim.x;
      const int j = u / units1, c0 = (u % units1) * 16, e = T.act[j];
      const int row0 = e * 2 * I + c0;  // gate rows row0.., up rows row0 + I.. of w13
      const float* sexp = p.w1.scale + int64_t(e) * p.w1.scale_e_stride;
      const float* sg = sexp + int64_t(c0 / 128) * p.w1.scale_n_stride;
      const float* su = sexp + int64_t((I + c0) / 128) * p.w1.scale_n_stride;
      for (int st = 0; st < plan.ns1; ++st) {
        const int k0 = st * p.kc1, klen = min(p.kc1, H - k0), nkb = klen / 128;
        uint32_t lg, lu;
        int og, ou;
        const float* wg = sg_window(sg + k0 / 128, nkb, p.w1_scale_end, &lg, &og);
        const float* wu = sg_window(su + k0 / 128, nkb, p.w1_scale_end, &lu, &ou);
        const int s = next_slot();
        if (lane == 0) {
          T.woff[s][0] = og;
          T.woff[s][1] = ou;
        }
        unsigned char* stage = ring + s * p.stage_bytes;
        // the windows into the slot's window array, one box: 16 + 16 rows x kc1 (past H zero-filled
        // and still counted)
        arm_slot(s, 32u * p.kc1 + lg + lu);
        if (lane == 0)
          tma_load_4d_hint(stage, &tm_w1, &full[s], 0, row0, 0, k0 / 128, pol);
        else if (lane == 16)
          bulk_load_1d(wins + s * p.win_slot, wg, lg, &full[s]);
        else if (lane == 17)
          bulk_load_1d(wins + s * p.win_slot + kSgWinBytes, wu, lu, &full[s]);
      }
    }
    for (int k = 0; k < plan.u2_count; ++k) {
      const int n0 = (plan.u2_first + k * gridDim.x) * 16;
      for (int st = 0; st < plan.ns2; ++st) {
        const int j0 = st * plan.epx, nq = min(plan.epx, n_act - j0);
        // window of each expert (lanes < nq compute theirs; lane 0 needs the total)
        // lane q < nq cuts expert q's window; the bytes of the stage are their sum
        uint32_t l = 0;
        int o = 0;
        const float* wsrc = nullptr;
        if (lane < nq) {
          const float* sr = p.w2.scale + int64_t(T.act[j0 + lane]) * p.w2.scale_e_stride +
                            int64_t(n0 / 128) * p.w2.scale_n_stride;
          wsrc = sg_window(sr, plan.nkb2, p.w2_scale_end, &l, &o);
        }
        uint32_t total = l;
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) total += __shfl_xor_sync(0xffffffffu, total, off);
        total += 16u * I * nq;
        const int s = next_slot();
        for (int qq = 0; qq < nq; ++qq) {  // lane 0 writes them: its arrive releases them
          const int oq = __shfl_sync(0xffffffffu, o, qq);
          if (lane == 0) T.woff[s][qq] = oq;
        }
        arm_slot(s, total);
        unsigned char* stage = ring + s * p.stage_bytes;
        if (lane < nq) {  // the expert's 16 rows are contiguous: one copy
          bulk_load_1d_hint(stage + lane * 16 * I,
                            p.w2.w + (int64_t(T.act[j0 + lane]) * H + n0) * I, 16u * I, &full[s],
                            pol);
          bulk_load_1d(wins + s * p.win_slot + lane * kSgWinBytes, wsrc, l, &full[s]);
        }
      }
    }
    if (p.trace && lane == 0) {
      p.trace[blockIdx.x * kSgTracePoints + kTrProducerDone] = sg_now();
      p.trace[blockIdx.x * kSgTracePoints + kTrWaitEmpty] = static_cast<unsigned long long>(waited);
    }
    return;
  }

  // ---- consumers: x rows -> fp8 in 1x128 groups (16 threads of 8 columns per group), while
  // the producer's first stages are already in flight: the weight loads start right after the
  // tables, the x quantisation hides under their latency
  {
    const int c8n = H / 8, total = M * c8n;
    for (int b0 = 0; b0 < total; b0 += kW * 32) {
      const int i = b0 + tid;
      const bool ok = i < total;
      const int t = ok ? i / c8n : 0, c8 = ok ? i % c8n : 0;
      float v[8];
      float amax = 0.0f;
      if (ok) {
        load8<uint16_t>(p.x + int64_t(t) * H + c8 * 8, v);
#pragma unroll
        for (int k = 0; k < 8; ++k) amax = fmaxf(amax, fabsf(v[k]));
      }
      amax = group_max<16>(amax);
      if (!ok) continue;
      const float s = group_scale(amax, p.ue8m0 != 0, 0.0f);
      // the wgmma B layout: 16-byte chunk c of every token, then chunk c + 1
      uint8_t* dst = qx + (c8 >> 1) * 16 * M + t * 16 + (c8 & 1) * 8;
      *reinterpret_cast<uint2*>(dst) = quant8(v, s);
      if (c8 % 16 == 0) sx[t * (H / 128) + c8 / 16] = s;
    }
  }
  // GEMM1's wgmma reads qx through the async proxy: each writer orders its generic stores before
  // it, then the barrier (the PTX memory model's rule; GEMM2's mma.sync reads qh generically)
  fence_proxy_async();
  sg_consumer_sync<kW>();
  sg_stamp(p, kTrXQuant);

  // ---- consumers: GEMM1 ------------------------------------------------------------------
  SgRing rc;
  int red_buf = 0;
  long long wait1 = 0, wait2 = 0;
  long long c_mma1 = 0, c_rel1 = 0, c_end1 = 0, c_mma2 = 0, c_rel2 = 0, c_grp2 = 0, c_end2 = 0;
  {
    // Unit (expert, 16 columns): tile rows 32-63 of each K block are its 16 gate and 16 up rows
    // (the box's slab; rows 0-31 read the 4 KB before it -- the previous slab, the previous slot's
    // last slab, or for slot 0 the guard --
    // and nobody reads their results), so warps 2 and 3 of a warpgroup hold the gate and the up
    // sums. B: every token (N = 8, columns >= M unused). Warpgroup wg takes K blocks wg, wg + 4 of
    // each stage; its sums are promoted per K block and the four warpgroups' added in order at the
    // unit's end.
    const int wg = warp >> 2, wq = warp & 3;
    const int tA = 2 * t4, tB = 2 * t4 + 1;
    for (int k = 0; k < plan.u1_count; ++k) {
      const int u = plan.u1_first + k * gridDim.x;
      const int j = u / units1, c0 = (u % units1) * 16;
      const int e0 = T.eoff[j], nt = T.eoff[j + 1] - e0;
      float total[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      for (int st = 0; st < plan.ns1; ++st) {
        const int s = rc.slot;
        const uint32_t ph = rc.phase;
        rc.advance(p.nstages);
        const int k0 = st * p.kc1, nkb = min(p.kc1, H - k0) / 128;
        sg_wait(p, &full[s], ph, &wait1);
        if (k == 0 && st == 0) sg_stamp(p, kTrFirstData1);
        const unsigned char* stage = ring + s * p.stage_bytes;
        float acc[kSgWgKb][4];
#pragma unroll
        for (int i = 0; i < kSgWgKb; ++i)
#pragma unroll
          for (int r = 0; r < 4; ++r) acc[i][r] = 0.0f;
        // the weight block scales of this warpgroup's K blocks (warps 2 and 3: gate, up) read
        // before the wgmma, so the slot is released as soon as the wgmma have read it
        float sw[kSgWgKb];
        if (wq >= 2) {
          const float* win = reinterpret_cast<const float*>(wins + s * p.win_slot);
          const int wo = wq == 2 ? T.woff[s][0] : kSgWinBytes / 4 + T.woff[s][1];
#pragma unroll
          for (int i = 0; i < kSgWgKb; ++i) sw[i] = wg + 4 * i < nkb ? win[wo + wg + 4 * i] : 0.0f;
        }
        long long t0 = sg_clk(p);
        sg_wgmma_fence();
        // every warpgroup issues all its wgmma whatever nkb (a K block past H multiplies the box's
        // zero fill by token block 0 and is never promoted): wgmma behind a branch that ptxas
        // cannot prove uniform gets serialised (C7520)
#pragma unroll
        for (int i = 0; i < kSgWgKb; ++i) {
          const int b = wg + 4 * i;
          const uint64_t da = sg_desc_sw128(stage + (b - 1) * 4096);
          const uint64_t db =
              sg_desc_interleave(qx + (b < nkb ? k0 / 128 + b : 0) * 128 * M, 16 * M);
#pragma unroll
          for (int ks = 0; ks < 4; ++ks)
            sg_wgmma_n8(acc[i], da + 2 * ks, db + uint64_t(2 * ks * M), ks > 0);
        }
        sg_wgmma_commit_wait();
        sg_acc(p, &c_mma1, t0);
        t0 = sg_clk(p);
        mbar_arrive(&empty[s]);
        sg_acc(p, &c_rel1, t0);
        if (wq >= 2) {
#pragma unroll
          for (int i = 0; i < kSgWgKb; ++i) {
            const int b = wg + 4 * i;
            if (b >= nkb) break;
            const int kb = k0 / 128 + b;
            const float sa0 = tA < M ? sx[tA * (H / 128) + kb] : 0.0f;
            const float sa1 = tB < M ? sx[tB * (H / 128) + kb] : 0.0f;
            total[0] += acc[i][0] * sa0 * sw[i];
            total[1] += acc[i][1] * sa1 * sw[i];
            total[2] += acc[i][2] * sa0 * sw[i];
            total[3] += acc[i][3] * sa1 * sw[i];
          }
        }
      }
      // the four warpgroups' sums in order; thread (pair idx, column i) finishes h
      const long long te = sg_clk(p);
      float* rb = red + red_buf * p.red_floats;
      red_buf ^= 1;
      if (wq >= 2) {
#pragma unroll
        for (int r = 0; r < 4; ++r) rb[((wg * 2 + wq - 2) * 32 + lane) * 4 + r] = total[r];
      }
      sg_consumer_sync<kW>();
      if (tid < 16 * nt) {
        const int i = tid & 15, idx = tid >> 4;
        const int tok = T.plist[e0 + idx] / topk;
        // accumulator element of (row i, column tok): lane (i % 8) * 4 + tok / 2, register
        // 2 (i / 8) + tok % 2
        const int ln = (i & 7) * 4 + (tok >> 1), rr = (i >> 3) * 2 + (tok & 1);
        float gsum = 0.0f, usum = 0.0f;
        for (int w = 0; w < 4; ++w) {
          gsum += rb[((w * 2) * 32 + ln) * 4 + rr];
          usum += rb[((w * 2 + 1) * 32 + ln) * 4 + rr];
        }
        const float y_g = round_act(p.ap, gsum), y_u = round_act(p.ap, usum);
        const float h = act_gated(p.ap, y_g, y_u);
        p.hbuf[int64_t(e0 + idx) * I + c0 + i] = p.h_f32 ? h : bf16_round(h);
      }
      sg_acc(p, &c_end1, te);
    }
  }

  // ---- grid barrier: every CTA's h is written ---------------------------------------------
  // The CTA barrier orders every consumer's h stores before thread 0's fence, which (cumulative)
  // publishes them all before its arrival: one fence per CTA, the cooperative-groups grid-sync
  // pattern, instead of one in each of the 512 consumer threads (run 14 profile: 176 membar stall
  // samples in this barrier).
  sg_consumer_sync<kW>();
  sg_stamp(p, kTrGemm1);
  if (tid == 0) {
    __threadfence();
    atomicAdd(&p.sync[1], 1u);
    while (ld_acquire_gpu(&p.sync[1]) < gridDim.x) {
    }
  }
  sg_consumer_sync<kW>();
  sg_stamp(p, kTrBarrier);

  // ---- h -> fp8 in 1x128 groups (every CTA, all pairs; qx is no longer read) --------------
  {
    // four groups per warp in flight: their L2 reads first, then the four quantisations (run 13:
    // one group at a time took ~3 us of L2 round trips at DeepSeek-V3 TP2)
    constexpr int kHq = 4;
    const int nkb2 = I / 128, items = T.n_valid * nkb2;
    for (int i0 = warp; i0 < items; i0 += kHq * kW) {
      float4 vv[kHq];
#pragma unroll
      for (int u = 0; u < kHq; ++u) {
        const int i = i0 + u * kW;
        if (i < items)
          vv[u] = __ldcg(
              reinterpret_cast<const float4*>(p.hbuf + int64_t(i / nkb2) * I + (i % nkb2) * 128) +
              lane);
      }
#pragma unroll
      for (int u = 0; u < kHq; ++u) {
        const int i = i0 + u * kW;
        if (i >= items) break;
        const int pos = i / nkb2, grp = i % nkb2;
        const float4 v = vv[u];
        float amax = fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w)));
        amax = warp_max(amax);
        const float s = group_scale(amax, p.ue8m0 != 0, p.min_scale2);
        const uint32_t lo = float2_to_e4m3x2(v.x / s, v.y / s),
                       hi = float2_to_e4m3x2(v.z / s, v.w / s);
        *reinterpret_cast<uint32_t*>(qh + pos * hpitch + grp * 128 + lane * 4) = lo | (hi << 16);
        if (lane == 0) sh[pos * nkb2 + grp] = s;
      }
    }
  }
  sg_consumer_sync<kW>();
  sg_stamp(p, kTrHQuant);

  // ---- consumers: GEMM2 ------------------------------------------------------------------
  // Warp (q, kb) takes K block kb of the stage's expert q. The nkb2 warps of an expert meet at
  // their own named barrier (not the whole CTA) and the kb = 0 one adds their sums in K order;
  // the unit's y2 rows alternate between two buffers, so one CTA-wide barrier per unit is enough
  // (run 13: three CTA-wide barriers per stage took ~2 us per stage with the data already in
  // shared memory).
  const int nkb2 = plan.nkb2;
  const int q = warp / nkb2, kb = warp % nkb2;
  int ybuf_i = 0;
  for (int k = 0; k < plan.u2_count; ++k) {
    const int n0 = (plan.u2_first + k * gridDim.x) * 16;
    float* yb = ybuf + ybuf_i * (P * 16);
    ybuf_i ^= 1;
    for (int st = 0; st < plan.ns2; ++st) {
      const int s = rc.slot;
      const uint32_t ph = rc.phase;
      rc.advance(p.nstages);
      const int j0 = st * plan.epx, nq = min(plan.epx, n_act - j0);
      const bool mine = q < nq;
      float res[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      int e0 = 0, nt = 0;
      sg_wait(p, &full[s], ph, &wait2);
      if (k == 0 && st == 0) sg_stamp(p, kTrFirstData2);
      long long t0 = sg_clk(p);
      if (mine) {
        const int j = j0 + q;
        e0 = T.eoff[j];
        nt = T.eoff[j + 1] - e0;
        const unsigned char* stage = ring + s * p.stage_bytes;
        const uint8_t* bcol = g < nt ? qh + (e0 + g) * hpitch + kb * 128 : nullptr;
        float part[4];
        sg_block_mma(stage + q * 16 * I + kb * 128, I, bcol, part);
        const float sw = reinterpret_cast<const float*>(wins + s * p.win_slot +
                                                        q * kSgWinBytes)[T.woff[s][q] + kb];
        const float sa0 = 2 * t4 < nt ? sh[(e0 + 2 * t4) * nkb2 + kb] : 0.0f;
        const float sa1 = 2 * t4 + 1 < nt ? sh[(e0 + 2 * t4 + 1) * nkb2 + kb] : 0.0f;
        res[0] = part[0] * sa0 * sw;
        res[1] = part[1] * sa1 * sw;
        res[2] = part[2] * sa0 * sw;
        res[3] = part[3] * sa1 * sw;
      }
      sg_acc(p, &c_mma2, t0);
      t0 = sg_clk(p);
      mbar_arrive(&empty[s]);
      sg_acc(p, &c_rel2, t0);
      if (!mine) continue;
      t0 = sg_clk(p);
      float v[4] = {res[0], res[1], res[2], res[3]};
      if (nkb2 > 1) {
        float* rb = red + red_buf * p.red_floats;
        red_buf ^= 1;
        // K block kb >= 1 of expert q at row q (nkb2 - 1) + kb - 1 of the buffer (sg_red_floats)
        float* rq = rb + q * (nkb2 - 1) * 128;
        if (kb != 0) {
#pragma unroll
          for (int r = 0; r < 4; ++r) rq[((kb - 1) * 32 + lane) * 4 + r] = res[r];
        }
        sg_group_sync(q, nkb2);
        if (kb != 0) continue;
        // the expert's K blocks in order
        for (int b = 1; b < nkb2; ++b)
#pragma unroll
          for (int r = 0; r < 4; ++r) v[r] += rq[((b - 1) * 32 + lane) * 4 + r];
      }
#pragma unroll
      for (int c = 0; c < 2; ++c) {  // * router weight, rounded (y2)
        const int col = 2 * t4 + c;
        if (col >= nt) continue;
        const int pair = T.plist[e0 + col];
        const float rw = T.tw[pair];
        yb[pair * 16 + g] = bf16_round(v[c] * rw);
        yb[pair * 16 + g + 8] = bf16_round(v[2 + c] * rw);
      }
      sg_acc(p, &c_grp2, t0);
    }
    const long long te = sg_clk(p);
    sg_consumer_sync<kW>();
    // the unit's 16 output rows of every token: its local slots in slot order
    for (int i = tid; i < M * 16; i += kW * 32) {
      const int t = i / 16, r = i % 16;
      float acc = 0.0f;
      for (int sl = 0; sl < topk; ++sl) {
        const int pair = t * topk + sl;
        if (T.pe[pair] < 0) continue;
        acc += yb[pair * 16 + r];
      }
      p.out[int64_t(t) * H + n0 + r] = float_to_bf16_bits(acc);
    }
    sg_acc(p, &c_end2, te);
  }
  sg_stamp(p, kTrGemm2);
  if (p.trace && tid == 0) {
    p.trace[blockIdx.x * kSgTracePoints + kTrWaitFull1] = static_cast<unsigned long long>(wait1);
    p.trace[blockIdx.x * kSgTracePoints + kTrWaitFull2] = static_cast<unsigned long long>(wait2);
    const long long cyc[7] = {c_mma1, c_rel1, c_end1, c_mma2, c_rel2, c_grp2, c_end2};
    for (int i = 0; i < 7; ++i)
      p.trace[blockIdx.x * kSgTracePoints + kTrMma1 + i] = static_cast<unsigned long long>(cyc[i]);
  }
}

}  // namespace fp8moe::cuda
