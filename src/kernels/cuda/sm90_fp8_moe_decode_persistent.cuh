// The whole fused MoE forward for small batches (decode) in ONE persistent kernel (sm_90a):
// routing, expert alignment, activation quantisation, GEMM1 + activation + quantisation of the
// intermediate, GEMM2 * router weight and the top-k sum. Small batches are bound by reading the
// touched experts' weights once, so the kernel is built around one continuous weight stream per SM:
//
//   * Every CTA routes all M tokens itself (M <= 64) and builds the same expert tables in shared
//     memory, so no launch or grid barrier separates routing from the GEMMs.
//   * Work items are handed out in a fixed order by one global ticket counter:
//       [quantise x: one item per token] [GEMM1: (expert, pass, 16 h-columns)]
//       [GEMM2: (expert, pass, 64*rb2 output rows)]
//     An item only ever waits for items with smaller tickets, which running CTAs already hold, so
//     the scheme cannot deadlock whatever the residency.
//   * A producer warp streams the item's weight rows with TMA (128-byte swizzle, L2 evict-first)
//     into a 4-stage ring and gathers the quantised activation rows of the item's tokens with
//     cp.async; it fetches the next ticket and keeps streaming while the 8 consumer warps finish
//     the previous item, and issues weights before waiting for an item's input to be ready.
//   * Consumers run mma.sync m16n8k32 e4m3 with the weights as the 16-row A operand and up to 32
//     tokens as four 8-column B operands, promoting every k-block with its scales.
//   * Dependencies are counters in global memory (release/acquire): x quantised; all GEMM1 items
//     of a quantisation group done (the last one quantises the group: "last arriver"); all groups
//     of an expert ready; all slots of a token done for a 64-column block (the last one sums the
//     top-k slots in slot order, so the result is deterministic).
#pragma once

#include "cuda_common.cuh"
#include "moe_params.hpp"
#include "smxx_fp8_quant.cuh"
#include "smxx_moe_align.cuh"
#include "smxx_moe_routing.cuh"

namespace fp8moe::cuda {

constexpr int kDecMaxTokens = 64;
constexpr int kDecMaxPairs = 640;
constexpr int kDecTokPass = 32;  // tokens per pass (4 mma n-groups of 8)
constexpr int kDecConsumerWarps = 8;
constexpr int kDecConsumers = kDecConsumerWarps * 32;
constexpr int kDecThreads = kDecConsumers + 32;
constexpr int kDecStages = 4;
constexpr int kDecWBytes = 16384;              // weights per stage
constexpr int kDecABytes = kDecTokPass * 512;  // activations per stage (<= 512 K bytes)
constexpr int kDecStageBytes = kDecWBytes + kDecABytes;
constexpr int kDecBox = 2048;  // one TMA box: 16 rows x 128 bytes
constexpr int kDecR2 = 64;     // w2 rows per GEMM2 row block
constexpr int kDecQueue = 4;
constexpr int kDecScratchBytes = 16384;  // [KB][rows][32] f32 partial sums

enum DecItemType : int { kDecDone = 0, kDecQuant = 1, kDecGemm1 = 2, kDecGemm2 = 3 };

struct DecodeParams {
  int M, H, I, E, E_global, topk, gated, x_f32, route_in_kernel, router_on_input;
  RoutingParams rp;
  const void* x;
  const int32_t* topk_ids;
  const float* topk_w;
  const int32_t* expert_map;
  WeightSide w1, w2;
  int aq1, aq2, gk, ue8m0, h_f32;
  float min_scale2;
  const float* a13_scale;
  const float* a2_scale;
  ActParams ap;
  int rb2;  // 64-row blocks per GEMM2 item
  // workspace
  int* counters;  // see DecCounters
  int n_act_max;
  uint8_t* qx;
  float* sx;
  void* h;  // (P, I) bf16 or f32
  uint8_t* qh;
  float* sh;
  void* y2;  // (P, H) bf16 or f32
  void* out;
};

// Counter block layout (zeroed before the launch).
struct DecCounters {
  int* ticket;
  int* qx_done;
  int* grp_cnt;  // [n_act_max][I / gk]
  int* h_ready;  // [n_act_max]
  int* out_cnt;  // [M][H / 64]
  __device__ DecCounters(const DecodeParams& p) {
    ticket = p.counters;
    qx_done = p.counters + 1;
    grp_cnt = p.counters + 32;
    const int ngr = p.aq2 == static_cast<int>(AQuant::kGroupDynamic) ? p.I / p.gk : 1;
    h_ready = grp_cnt + p.n_act_max * ngr;
    out_cnt = h_ready + p.n_act_max;
  }
};

struct DecItem {
  int type, a, pass, idx;
};

// Shared-memory tables built by every CTA from the routing.
struct DecTables {
  int32_t pair_exp[kDecMaxPairs];  // local expert of each flat pair, -1 when not computed here
  float pair_w[kDecMaxPairs];
  int32_t pair_list[kDecMaxPairs];  // pairs grouped by active expert
  int32_t act_exp[kDecMaxPairs];    // active local experts, ascending
  int32_t act_off[kDecMaxPairs + 1];
  int32_t pass_off[kDecMaxPairs + 1];  // prefix of passes (ceil(count / 32)) per active expert
  int32_t tok_valid[kDecMaxTokens];    // local slots per token
  int32_t cnt[1024];                   // per local expert; reused as the scatter cursor
  int32_t map_act[1024];               // local expert -> active index
  int32_t n_act;
  int32_t n_pass;
  DecItem queue[kDecQueue];
  int32_t flag;
  int32_t marked[kDecTokPass];
  int32_t n_marked;
};

__device__ __forceinline__ void consumer_sync() {
  asm volatile("bar.sync 1, %0;\n" ::"n"(kDecConsumers) : "memory");
}

__device__ __forceinline__ void cp_async_mbar_arrive_noinc(uint64_t* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(smem_u32(bar))
               : "memory");
}

__device__ __forceinline__ uint64_t evict_first_policy() {
  uint64_t pol;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(pol));
  return pol;
}

__device__ __forceinline__ int spin_until_at_least(const int* p, int target) {
  int v = ld_acquire(p);
  while (v < target) {
    __nanosleep(64);
    v = ld_acquire(p);
  }
  return v;
}

// Active-expert index whose prefix range [off[a], off[a+1]) holds x (off ascending, n entries).
__device__ __forceinline__ int find_range(const int32_t* off, int n, int x) {
  int lo = 0, hi = n - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (off[mid] <= x)
      lo = mid;
    else
      hi = mid - 1;
  }
  return lo;
}

// Scale of weight row n (of N) of expert e for the k-block starting at element k.
__device__ __forceinline__ float dec_weight_scale(const WeightSide& w, int e, int n, int N, int k) {
  const float* s = w.scale + int64_t(e) * w.scale_e_stride;
  switch (static_cast<WScale>(w.scale_kind)) {
    case WScale::kBlock:
      return __ldg(s + int64_t(n / w.bn) * w.scale_n_stride + k / w.bk);
    case WScale::kTensor:
      return __ldg(s);
    case WScale::kTensorPerShard:
      return __ldg(s + (n < N / 2 ? 0 : 1));
    default:
      return __ldg(s + n);
  }
}

__device__ __forceinline__ float dec_bias(const WeightSide& w, int e, int n, int N) {
  if (!w.bias) return 0.0f;
  const int64_t i = int64_t(e) * N + n;
  return w.bias_bf16 ? bf16_bits_to_float(static_cast<const uint16_t*>(w.bias)[i])
                     : static_cast<const float*>(w.bias)[i];
}

// ---- item geometry -----------------------------------------------------------------------------
struct DecGeom {
  int ng1;   // GEMM1 items per pass (h-column chunks)
  int hc;    // h columns per GEMM1 item (16 gated, 32 not)
  int nc2;   // GEMM2 items per pass
  int kst1;  // stages of a GEMM1 item (512 K-bytes each)
  int kst2;  // stages of one 64-row block of a GEMM2 item (256 K-bytes each)
  __device__ DecGeom(const DecodeParams& p) {
    hc = p.gated ? 16 : 32;
    ng1 = p.I / hc;
    nc2 = p.H / (kDecR2 * p.rb2);
    kst1 = (p.H + 511) / 512;
    kst2 = (p.I + 255) / 256;
  }
};

// ---- phase 0: routing and tables (all threads) -----------------------------------------------
__device__ void dec_build_tables(const DecodeParams& p, DecTables& t, float* route_scratch) {
  const int tid = threadIdx.x;
  const int nthreads = blockDim.x;
  const int warp = tid >> 5, lane = tid & 31;
  const int P = p.M * p.topk;
  int32_t* ids_s = t.pair_list;  // temporary: global ids
  if (p.route_in_kernel) {
    for (int tok = warp; tok < p.M; tok += nthreads / 32) {
      route_token_warp(p.rp, tok, p.E_global, p.topk, route_scratch + warp * (p.E_global + 32),
                       ids_s + tok * p.topk, t.pair_w + tok * p.topk);
    }
  } else {
    for (int i = tid; i < P; i += nthreads) {
      ids_s[i] = p.topk_ids[i];
      t.pair_w[i] = p.topk_w[i];
    }
  }
  for (int e = tid; e < p.E; e += nthreads) t.cnt[e] = 0;
  for (int tk = tid; tk < p.M; tk += nthreads) t.tok_valid[tk] = 0;
  __syncthreads();
  for (int i = tid; i < P; i += nthreads) {
    const int e = local_expert(ids_s[i], p.expert_map, p.E_global, p.E);
    t.pair_exp[i] = e;
    if (e >= 0) {
      atomicAdd(&t.cnt[e], 1);
      atomicAdd(&t.tok_valid[i / p.topk], 1);
    }
  }
  __syncthreads();
  // compact the active experts (ascending): warp 0 walks E in chunks of 32 with ballots and
  // warp scans of the counts and passes
  if (warp == 0) {
    int n = 0, off = 0, poff = 0;
    for (int e0 = 0; e0 < p.E; e0 += 32) {
      const int e = e0 + lane;
      const int c = e < p.E ? t.cnt[e] : 0;
      const int ps = (c + kDecTokPass - 1) / kDecTokPass;
      const unsigned act = __ballot_sync(0xffffffffu, c > 0);
      int ic = c, ip = ps;
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const int a1 = __shfl_up_sync(0xffffffffu, ic, o);
        const int a2 = __shfl_up_sync(0xffffffffu, ip, o);
        if (lane >= o) {
          ic += a1;
          ip += a2;
        }
      }
      if (c > 0) {
        const int slot = n + __popc(act & ((1u << lane) - 1u));
        t.act_exp[slot] = e;
        t.act_off[slot] = off + ic - c;
        t.pass_off[slot] = poff + ip - ps;
        t.map_act[e] = slot;
      }
      n += __popc(act);
      off += __shfl_sync(0xffffffffu, ic, 31);
      poff += __shfl_sync(0xffffffffu, ip, 31);
    }
    if (lane == 0) {
      t.act_off[n] = off;
      t.pass_off[n] = poff;
      t.n_act = n;
      t.n_pass = poff;
    }
  }
  __syncthreads();
  for (int a = tid; a < t.n_act; a += nthreads) t.cnt[t.act_exp[a]] = 0;  // cursors
  __syncthreads();
  for (int i = tid; i < P; i += nthreads) {
    const int e = t.pair_exp[i];
    if (e >= 0) {
      const int a = t.map_act[e];
      t.pair_list[t.act_off[a] + atomicAdd(&t.cnt[e], 1)] = i;
    }
  }
  __syncthreads();
}

// ---- consumer: quantise a chunk of one token of x ---------------------------------------------
// Group and static scales: chunks of 2048 columns, 8 per thread (16-byte loads), the group max over
// gk/8 consecutive lanes. Per-token scales need the whole row: one chunk per token.
constexpr int kDecQChunk = 2048;

template <typename T>
__device__ void dec_quant_chunk(const DecodeParams& p, const DecTables& t, int tok, int chunk,
                                float* red) {
  const int tid = threadIdx.x;
  const T* x = static_cast<const T*>(p.x) + int64_t(tok) * p.H;
  const float rw = p.router_on_input ? t.pair_w[tok * p.topk] : 1.0f;
  uint8_t* q = p.qx + int64_t(tok) * p.H;
  auto load8_scaled = [&](int c, float(&v)[8]) {
    load8<T>(x + c, v);
    if (p.router_on_input) {
#pragma unroll
      for (int i = 0; i < 8; ++i)
        v[i] = sizeof(T) == 2 ? bf16_round(v[i] * bf16_round(rw)) : v[i] * rw;
    }
  };
  if (p.aq1 == static_cast<int>(AQuant::kTokenDynamic)) {
    float amax = 0.0f;
    for (int c = tid * 8; c < p.H; c += kDecConsumers * 8) {
      float v[8];
      load8_scaled(c, v);
#pragma unroll
      for (int i = 0; i < 8; ++i) amax = fmaxf(amax, fabsf(v[i]));
    }
    amax = warp_max(amax);
    if ((tid & 31) == 0) red[tid >> 5] = amax;
    consumer_sync();
    amax = 0.0f;
    for (int w = 0; w < kDecConsumerWarps; ++w) amax = fmaxf(amax, red[w]);
    const float sc = fmaxf(amax / kFp8Max, 1.0f / (kFp8Max * 512.0f));
    if (tid == 0) p.sx[tok] = sc;
    for (int c = tid * 8; c < p.H; c += kDecConsumers * 8) {
      float v[8];
      load8_scaled(c, v);
#pragma unroll
      for (int i = 0; i < 8; ++i) v[i] = v[i] / sc;
      *reinterpret_cast<uint2*>(q + c) = quant8(v, 1.0f);
    }
    return;
  }
  const int c = chunk * kDecQChunk + tid * 8;
  const bool ok = c < p.H;
  float v[8] = {};
  if (ok) load8_scaled(c, v);
  if (p.aq1 == static_cast<int>(AQuant::kGroupDynamic)) {
    float amax = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; ++i) amax = fmaxf(amax, fabsf(v[i]));
    const int width = p.gk / 8;  // lanes per group (4, 8 or 16)
    for (int o = width / 2; o > 0; o >>= 1)
      amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    if (!ok) return;
    const float sc = group_scale(amax, p.ue8m0 != 0, 0.0f);
    *reinterpret_cast<uint2*>(q + c) = quant8(v, sc);
    if ((tid % width) == 0) p.sx[int64_t(tok) * (p.H / p.gk) + c / p.gk] = sc;
  } else {
    if (!ok) return;
    // static per-tensor: scaled_fp8_conversion multiplies by the inverse scale
    const float inv = 1.0f / p.a13_scale[0];
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = v[i] * inv;
    *reinterpret_cast<uint2*>(q + c) = quant8(v, 1.0f);
    if (tid == 0 && tok == 0 && chunk == 0) p.sx[0] = p.a13_scale[0];
  }
}

// ---- scales ------------------------------------------------------------------------------------
// Activation scale of A row `row` (token for GEMM1, pair for GEMM2) at element k.
__device__ __forceinline__ float dec_a_scale(const DecodeParams& p, bool gemm2, int row, int k) {
  const int kind = gemm2 ? p.aq2 : p.aq1;
  const float* s = gemm2 ? p.sh : p.sx;
  const int cols = gemm2 ? p.I : p.H;
  // written by other CTAs in this launch: read through L2
  if (kind == static_cast<int>(AQuant::kGroupDynamic))
    return __ldcg(s + int64_t(row) * (cols / p.gk) + k / p.gk);
  if (kind == static_cast<int>(AQuant::kTokenDynamic)) return __ldcg(s + row);
  return gemm2 ? p.a2_scale[0] : p.a13_scale[0];
}

// k-steps (of 32) between promotions: the finest scale granularity along K of this GEMM.
__device__ __forceinline__ int dec_steps_per_scale(const DecodeParams& p, bool gemm2) {
  int g = 128;
  const WeightSide& w = gemm2 ? p.w2 : p.w1;
  if (w.scale_kind == static_cast<int>(WScale::kBlock)) g = min(g, w.bk);
  if ((gemm2 ? p.aq2 : p.aq1) == static_cast<int>(AQuant::kGroupDynamic)) g = min(g, p.gk);
  return g / 32;
}

__device__ __forceinline__ void store_act(void* base, int64_t i, float v, bool f32) {
  if (f32)
    static_cast<float*>(base)[i] = v;
  else
    static_cast<uint16_t*>(base)[i] = float_to_bf16_bits(v);
}
__device__ __forceinline__ float load_act_cg(const void* base, int64_t i, bool f32) {
  if (f32) return __ldcg(static_cast<const float*>(base) + i);
  return bf16_bits_to_float(__ldcg(static_cast<const unsigned short*>(base) + i));
}

// ---- the kernel --------------------------------------------------------------------------------
template <typename TX>
__global__ void __launch_bounds__(kDecThreads, 1)
    moe_decode_kernel(const __grid_constant__ DecodeParams p,
                      const __grid_constant__ CUtensorMap tm_w13,
                      const __grid_constant__ CUtensorMap tm_w2) {
  extern __shared__ uint8_t dec_smem_raw[];
  uint8_t* ring = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(dec_smem_raw) + 1023) &
                                             ~uintptr_t(1023));
  float* scratch = reinterpret_cast<float*>(ring + kDecStages * kDecStageBytes);
  DecTables& t =
      *reinterpret_cast<DecTables*>(reinterpret_cast<uint8_t*>(scratch) + kDecScratchBytes);
  uint64_t* bars =
      reinterpret_cast<uint64_t*>((reinterpret_cast<uintptr_t>(&t + 1) + 7) & ~uintptr_t(7));
  uint64_t* full = bars;
  uint64_t* empty = bars + kDecStages;
  uint64_t* qfull = bars + 2 * kDecStages;
  uint64_t* qempty = qfull + kDecQueue;

  const int tid = threadIdx.x;
  const int warp = tid >> 5, lane = tid & 31;
  if (tid == 0) {
    for (int i = 0; i < kDecStages; ++i) {
      mbar_init(&full[i], 2);  // the weights' arrive.expect_tx, then the activations'
      mbar_init(&empty[i], kDecConsumerWarps);
    }
    for (int i = 0; i < kDecQueue; ++i) {
      mbar_init(&qfull[i], 1);
      mbar_init(&qempty[i], kDecConsumerWarps);
    }
    fence_barrier_init();
  }
  // phase 0: every CTA routes all tokens and builds the expert tables (ring memory as scratch)
  dec_build_tables(p, t, reinterpret_cast<float*>(ring));
  // tokens without any local slot produce zeros (their rows are split across CTAs)
  for (int tok = blockIdx.x; tok < p.M; tok += gridDim.x) {
    if (t.tok_valid[tok] != 0) continue;
    for (int c = tid; c < p.H; c += blockDim.x)
      store_act(p.out, int64_t(tok) * p.H + c, 0.0f, p.x_f32);
  }
  if (tid == 0) t.n_marked = 0;
  __syncthreads();

  const DecGeom geo(p);
  const DecCounters ctr(p);
  const int qchunks =
      p.aq1 == static_cast<int>(AQuant::kTokenDynamic) ? 1 : (p.H + kDecQChunk - 1) / kDecQChunk;
  const int nq = p.M * qchunks;
  const int n1 = t.n_pass * geo.ng1;
  const int n2 = t.n_pass * geo.nc2;
  const int N1 = p.gated ? 2 * p.I : p.I;

  auto decode_ticket = [&](int tk) {
    DecItem it{kDecDone, 0, 0, 0};
    if (tk < nq) {
      it.type = kDecQuant;
      it.idx = tk;
    } else if (tk < nq + n1) {
      const int i = tk - nq;
      const int pg = i / geo.ng1;
      it.type = kDecGemm1;
      it.a = find_range(t.pass_off, t.n_act, pg);
      it.pass = pg - t.pass_off[it.a];
      it.idx = i % geo.ng1;
    } else if (tk < nq + n1 + n2) {
      const int i = tk - nq - n1;
      const int pg = i / geo.nc2;
      it.type = kDecGemm2;
      it.a = find_range(t.pass_off, t.n_act, pg);
      it.pass = pg - t.pass_off[it.a];
      it.idx = i % geo.nc2;
    }
    return it;
  };
  auto passes_of = [&](int a) { return t.pass_off[a + 1] - t.pass_off[a]; };
  // First w13 row of row tile rt (16 rows) of GEMM1 item idx: packed [gate; up] halves give a
  // gate tile and the matching up tile; interleaved (SwiGLU-OAI) and non-gated layouts give 32
  // consecutive rows.
  const bool interleaved = p.ap.act == static_cast<int>(Act::kSwigluOai);
  auto gemm1_row = [&](int idx, int rt) {
    if (p.gated && !interleaved) return rt == 0 ? idx * 16 : p.I + idx * 16;
    return idx * 32 + rt * 16;
  };

  if (warp == kDecConsumerWarps) {
    // ================================ producer warp ==========================================
    const uint64_t pol = evict_first_policy();
    int stage = 0;
    uint32_t sphase = 0;
    int qslot = 0;
    uint32_t qphase = 0;
    bool qx_ready = false;
    int next = 0;
    if (lane == 0) next = atomicAdd(ctr.ticket, 1);
    next = __shfl_sync(0xffffffffu, next, 0);
    // activations of stages issued before their input was ready
    int pend_stage[kDecStages], pend_k0[kDecStages], pend_nkb[kDecStages];
    int npend = 0;
    while (true) {
      const DecItem it = decode_ticket(next);
      if (it.type != kDecDone) {
        if (lane == 0) next = atomicAdd(ctr.ticket, 1);
        next = __shfl_sync(0xffffffffu, next, 0);
      }
      if (lane == 0) {
        mbar_wait(&qempty[qslot], qphase ^ 1);
        t.queue[qslot] = it;
        mbar_arrive(&qfull[qslot]);
      }
      if (++qslot == kDecQueue) {
        qslot = 0;
        qphase ^= 1;
      }
      __syncwarp();
      if (it.type == kDecDone) break;
      if (it.type == kDecQuant) continue;

      const bool g2 = it.type == kDecGemm2;
      const int e = t.act_exp[it.a];
      const int p0 = t.act_off[it.a] + it.pass * kDecTokPass;
      const int T = min(kDecTokPass, t.act_off[it.a + 1] - p0);
      const CUtensorMap* tm = g2 ? &tm_w2 : &tm_w13;
      const int K = g2 ? p.I : p.H;
      const int RT = g2 ? 4 : 2;
      const int kb_per_stage = g2 ? 2 : 4;
      const int kstages = g2 ? geo.kst2 : geo.kst1;
      const int nblocks = g2 ? p.rb2 : 1;
      const uint8_t* asrc = g2 ? p.qh : p.qx;
      // the item's dependency
      const int* dep = g2 ? ctr.h_ready + it.a : ctr.qx_done;
      const int need =
          g2 ? (p.aq2 == static_cast<int>(AQuant::kGroupDynamic) ? p.I / p.gk
                                                                 : passes_of(it.a) * geo.ng1)
             : p.M;
      bool ready = g2 ? false : qx_ready;
      auto issue_acts = [&](int st, int k0, int nkb) {
        // one 1D bulk copy per token row (unswizzled rows of 512 bytes in shared memory)
        uint8_t* adst = ring + st * kDecStageBytes + kDecWBytes;
        const uint32_t bytes = static_cast<uint32_t>(nkb * 128);
        if (lane == 0) mbar_arrive_expect_tx(&full[st], bytes * T);
        __syncwarp();
        if (lane < T) {
          const int pair = t.pair_list[p0 + lane];
          const int64_t arow = g2 ? pair : pair / p.topk;
          bulk_copy_g2s(adst + lane * 512, asrc + arow * K + k0, bytes, &full[st]);
        }
        __syncwarp();
      };
      auto check_ready = [&]() {
        if (ready) return true;
        int v = 0;
        if (lane == 0) v = ld_acquire(dep);
        v = __shfl_sync(0xffffffffu, v, 0);
        ready = v >= need;
        return ready;
      };
      auto wait_ready_and_flush = [&]() {
        if (npend == 0) return;
        if (!check_ready()) {
          if (lane == 0) spin_until_at_least(dep, need);
          __syncwarp();
          ready = true;
        }
        for (int i = 0; i < npend; ++i) issue_acts(pend_stage[i], pend_k0[i], pend_nkb[i]);
        npend = 0;
      };
      for (int blk = 0; blk < nblocks; ++blk) {
        for (int j = 0; j < kstages; ++j) {
          const int k0 = j * (kb_per_stage * 128);
          const int nkb = min(kb_per_stage, (K - k0) / 128);
          mbar_wait(&empty[stage], sphase ^ 1);
          if (lane == 0) {
            mbar_arrive_expect_tx(&full[stage], nkb * RT * kDecBox);
            uint8_t* wdst = ring + stage * kDecStageBytes;
            for (int rt = 0; rt < RT; ++rt) {
              int row;
              if (g2) {
                row = e * p.H + (it.idx * p.rb2 + blk) * kDecR2 + rt * 16;
              } else {
                row = e * N1 + gemm1_row(it.idx, rt);
              }
              for (int kb = 0; kb < nkb; ++kb)
                tma_load_2d_hint(wdst + (kb * RT + rt) * kDecBox, tm, &full[stage], k0 + kb * 128,
                                 row, pol);
            }
          }
          __syncwarp();
          if (check_ready() && npend == 0) {
            issue_acts(stage, k0, nkb);
          } else {
            pend_stage[npend] = stage;
            pend_k0[npend] = k0;
            pend_nkb[npend] = nkb;
            ++npend;
          }
          if (++stage == kDecStages) {
            stage = 0;
            sphase ^= 1;
          }
          if (npend == kDecStages) wait_ready_and_flush();
        }
      }
      wait_ready_and_flush();
      if (!g2) qx_ready = true;
    }
    return;
  }

  // ================================== consumer warps ============================================
  const int cw = warp;
  int stage = 0;
  uint32_t sphase = 0;
  int qslot = 0;
  uint32_t qphase = 0;
  while (true) {
    mbar_wait(&qfull[qslot], qphase);
    const DecItem it = t.queue[qslot];
    __syncwarp();
    if (lane == 0) mbar_arrive(&qempty[qslot]);
    if (++qslot == kDecQueue) {
      qslot = 0;
      qphase ^= 1;
    }
    if (it.type == kDecDone) break;
    if (it.type == kDecQuant) {
      dec_quant_chunk<TX>(p, t, it.idx / qchunks, it.idx % qchunks, scratch);
      __threadfence();
      consumer_sync();
      if (tid == 0) atomicAdd(ctr.qx_done, 1);
      continue;
    }
    const bool g2 = it.type == kDecGemm2;
    const int e = t.act_exp[it.a];
    const int p0 = t.act_off[it.a] + it.pass * kDecTokPass;
    const int T = min(kDecTokPass, t.act_off[it.a + 1] - p0);
    const int G = (T + 7) / 8;
    const int RT = g2 ? 4 : 2;
    const int KBS = g2 ? 2 : 4;
    const int rt = cw % RT, kbw = cw / RT;
    const int K = g2 ? p.I : p.H;
    const int kstages = g2 ? geo.kst2 : geo.kst1;
    const int nblocks = g2 ? p.rb2 : 1;
    const int sps = dec_steps_per_scale(p, g2);
    const WeightSide& ws = g2 ? p.w2 : p.w1;
    const int NW = g2 ? p.H : N1;
    // A-scale rows of my two token columns per group
    int arow[4][2];
#pragma unroll
    for (int g = 0; g < 4; ++g)
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int tk = g * 8 + (lane & 3) * 2 + c;
        const int pair = tk < T ? t.pair_list[p0 + tk] : -1;
        arow[g][c] = pair < 0 ? -1 : (g2 ? pair : pair / p.topk);
      }
    for (int blk = 0; blk < nblocks; ++blk) {
      // weight rows of my row tile (for the scales)
      int wrow[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = (lane >> 2) + h * 8;
        if (g2) {
          wrow[h] = (it.idx * p.rb2 + blk) * kDecR2 + rt * 16 + r;
        } else {
          wrow[h] = gemm1_row(it.idx, rt) + r;
        }
      }
      float total[4][4];
#pragma unroll
      for (int g = 0; g < 4; ++g)
#pragma unroll
        for (int r = 0; r < 4; ++r) total[g][r] = 0.0f;
      // Scales of one stage for this warp. With one promotion per k-block (sps == 4) they are
      // loaded one stage ahead, so their latency hides behind the previous stage's MMAs.
      struct StageScales {
        float sw0, sw1, sa[4][2];
      };
      auto load_scales = [&](int j, StageScales& S) {
        const int kg = j * KBS * 128 + kbw * 128;
        if (kg >= K) return;  // no k-block of this warp in stage j
        S.sw0 = dec_weight_scale(ws, e, wrow[0], NW, kg);
        S.sw1 = dec_weight_scale(ws, e, wrow[1], NW, kg);
#pragma unroll
        for (int g = 0; g < 4; ++g)
#pragma unroll
          for (int c = 0; c < 2; ++c)
            S.sa[g][c] = (g < G && arow[g][c] >= 0) ? dec_a_scale(p, g2, arow[g][c], kg) : 0.0f;
      };
      const bool ahead = sps == 4;
      StageScales cur{}, nxt{};
      for (int j = 0; j < kstages; ++j) {
        const int k0 = j * KBS * 128;
        const int nkb = min(KBS, (K - k0) / 128);
        mbar_wait(&full[stage], sphase);
        // The activation scales are written by other CTAs; the first full stage of an item proves
        // the producer saw them ready, so they are read only from then on.
        if (ahead && j == 0) load_scales(0, cur);
        if (ahead && j + 1 < kstages) load_scales(j + 1, nxt);
        if (kbw < nkb) {
          const uint8_t* wbox = ring + stage * kDecStageBytes + (kbw * RT + rt) * kDecBox;
          const uint8_t* abase = ring + stage * kDecStageBytes + kDecWBytes;
          float part[4][4];
#pragma unroll
          for (int g = 0; g < 4; ++g)
#pragma unroll
            for (int r = 0; r < 4; ++r) part[g][r] = 0.0f;
#pragma unroll
          for (int ks = 0; ks < 4; ++ks) {
            uint32_t af[4];
            {
              const int r = lane & 15;
              const int c = ks * 2 + (lane >> 4);
              ldmatrix_x4(af, smem_u32(wbox + r * 128 + ((c ^ (r & 7)) << 4)));
            }
#pragma unroll
            for (int g = 0; g < 4; ++g) {
              if (g < G) {
                uint32_t bfr[2];
                const int r = g * 8 + (lane & 7);
                const int c = kbw * 8 + ks * 2 + ((lane >> 3) & 1);
                ldmatrix_x2(bfr, smem_u32(abase + r * 512 + (c << 4)));
                mma_e4m3_16832(part[g], af, bfr);
              }
            }
            if ((ks + 1) % sps == 0) {
              float sw0, sw1;
              float sa[4][2];
              if (ahead) {
                sw0 = cur.sw0;
                sw1 = cur.sw1;
#pragma unroll
                for (int g = 0; g < 4; ++g) sa[g][0] = cur.sa[g][0], sa[g][1] = cur.sa[g][1];
              } else {
                const int ksub = k0 + kbw * 128 + (ks + 1 - sps) * 32;
                sw0 = dec_weight_scale(ws, e, wrow[0], NW, ksub);
                sw1 = dec_weight_scale(ws, e, wrow[1], NW, ksub);
#pragma unroll
                for (int g = 0; g < 4; ++g)
#pragma unroll
                  for (int c = 0; c < 2; ++c)
                    sa[g][c] =
                        (g < G && arow[g][c] >= 0) ? dec_a_scale(p, g2, arow[g][c], ksub) : 0.0f;
              }
#pragma unroll
              for (int g = 0; g < 4; ++g) {
                if (g < G) {
                  total[g][0] += part[g][0] * sa[g][0] * sw0;
                  total[g][1] += part[g][1] * sa[g][1] * sw0;
                  total[g][2] += part[g][2] * sa[g][0] * sw1;
                  total[g][3] += part[g][3] * sa[g][1] * sw1;
#pragma unroll
                  for (int r = 0; r < 4; ++r) part[g][r] = 0.0f;
                }
              }
            }
          }
        }
        __syncwarp();
        if (lane == 0) mbar_arrive(&empty[stage]);
        if (++stage == kDecStages) {
          stage = 0;
          sphase ^= 1;
        }
        if (ahead) cur = nxt;
      }
      // partial sums of the k-block warps -> scratch[kb][row][token]
      const int rows_all = RT * 16;
#pragma unroll
      for (int g = 0; g < 4; ++g) {
        if (g < G) {
          const int r0 = rt * 16 + (lane >> 2);
          const int t0 = g * 8 + (lane & 3) * 2;
          scratch[(kbw * rows_all + r0) * 32 + t0] = total[g][0];
          scratch[(kbw * rows_all + r0) * 32 + t0 + 1] = total[g][1];
          scratch[(kbw * rows_all + r0 + 8) * 32 + t0] = total[g][2];
          scratch[(kbw * rows_all + r0 + 8) * 32 + t0 + 1] = total[g][3];
        }
      }
      consumer_sync();
      auto row_sum = [&](int r, int tk) {
        float v = 0.0f;
        for (int kb = 0; kb < KBS; ++kb) v += scratch[(kb * rows_all + r) * 32 + tk];
        return v;
      };
      if (!g2) {
        // ---- GEMM1 epilogue: bias, rounding, activation, (static) quantisation ----
        const int hc = geo.hc;
        for (int i = tid; i < T * hc; i += kDecConsumers) {
          const int tk = i / hc, c = i % hc;
          const int pair = t.pair_list[p0 + tk];
          float hv;
          int col;
          if (p.gated) {
            col = it.idx * 16 + c;
            const int rg = interleaved ? 2 * c : c, ru = interleaved ? 2 * c + 1 : 16 + c;
            const int ng = interleaved ? 2 * col : col, nu = interleaved ? 2 * col + 1 : p.I + col;
            const float yg = round_act(p.ap, row_sum(rg, tk) + dec_bias(p.w1, e, ng, N1));
            const float yu = round_act(p.ap, row_sum(ru, tk) + dec_bias(p.w1, e, nu, N1));
            hv = act_gated(p.ap, yg, yu);
          } else {
            col = it.idx * 32 + c;
            hv = act_plain(p.ap, round_act(p.ap, row_sum(c, tk) + dec_bias(p.w1, e, col, N1)));
          }
          if (!p.ap.fp32_silu) hv = round_act(p.ap, hv);
          if (p.aq2 == static_cast<int>(AQuant::kTensorStatic)) {
            p.qh[int64_t(pair) * p.I + col] = float_to_e4m3(hv * (1.0f / p.a2_scale[0]));
          } else {
            store_act(p.h, int64_t(pair) * p.I + col, hv, p.h_f32);
          }
        }
        __threadfence();
        consumer_sync();
        if (tid == 0) {
          int last = 0;
          if (p.aq2 == static_cast<int>(AQuant::kGroupDynamic)) {
            const int ngr = p.I / p.gk;
            const int grp = (it.idx * hc) / p.gk;
            const int ipg = passes_of(it.a) * (p.gk / hc);
            last = atomicAdd(&ctr.grp_cnt[it.a * ngr + grp], 1) == ipg - 1 ? 1 : 0;
          } else {
            atomicAdd(&ctr.h_ready[it.a], 1);
          }
          t.flag = last;
        }
        consumer_sync();
        if (t.flag) {
          // last GEMM1 item of this quantisation group: quantise the group for every pair of the
          // expert (all passes), one warp per pair
          __threadfence();
          const int ngr = p.I / p.gk;
          const int grp = (it.idx * hc) / p.gk;
          const int a0 = t.act_off[it.a], a1 = t.act_off[it.a + 1];
          for (int pi = a0 + cw; pi < a1; pi += kDecConsumerWarps) {
            const int pair = t.pair_list[pi];
            const int64_t base = int64_t(pair) * p.I + grp * p.gk;
            float v[4];
            float amax = 0.0f;
            const int per = p.gk / 32;
            for (int i = 0; i < per; ++i) {
              v[i] = load_act_cg(p.h, base + i * 32 + lane, p.h_f32);
              amax = fmaxf(amax, fabsf(v[i]));
            }
            amax = warp_max(amax);
            const float sc = group_scale(amax, p.ue8m0 != 0, p.min_scale2);
            for (int i = 0; i < per; ++i) p.qh[base + i * 32 + lane] = float_to_e4m3(v[i] / sc);
            if (lane == 0) p.sh[int64_t(pair) * ngr + grp] = sc;
          }
          __threadfence();
          consumer_sync();
          if (tid == 0) atomicAdd(&ctr.h_ready[it.a], 1);
        }
      } else {
        // ---- GEMM2 epilogue: bias, router weight, rounding, then the top-k sum ----
        const int m0 = (it.idx * p.rb2 + blk) * kDecR2;
        for (int i = tid; i < T * kDecR2; i += kDecConsumers) {
          const int tk = i / kDecR2, r = i % kDecR2;
          const int pair = t.pair_list[p0 + tk];
          float y = row_sum(r, tk) + dec_bias(p.w2, e, m0 + r, p.H);
          if (!p.router_on_input) y *= t.pair_w[pair];
          store_act(p.y2, int64_t(pair) * p.H + m0 + r, y, p.x_f32);
        }
        __threadfence();
        consumer_sync();
        if (tid < T) {
          const int pair = t.pair_list[p0 + tid];
          const int tok = pair / p.topk;
          const int old = atomicAdd(&ctr.out_cnt[tok * (p.H / kDecR2) + m0 / kDecR2], 1);
          if (old == t.tok_valid[tok] - 1) t.marked[atomicAdd(&t.n_marked, 1)] = tok;
        }
        consumer_sync();
        const int nm = t.n_marked;
        if (nm > 0) {
          __threadfence();
          for (int i = tid; i < nm * kDecR2; i += kDecConsumers) {
            const int tok = t.marked[i / kDecR2], r = i % kDecR2;
            float acc = 0.0f;
            for (int j = 0; j < p.topk; ++j) {
              const int pair = tok * p.topk + j;
              if (t.pair_exp[pair] < 0) continue;
              acc += load_act_cg(p.y2, int64_t(pair) * p.H + m0 + r, p.x_f32);
            }
            store_act(p.out, int64_t(tok) * p.H + m0 + r, acc, p.x_f32);
          }
        }
        consumer_sync();
        if (tid == 0) t.n_marked = 0;
      }
      consumer_sync();
    }
  }
}

}  // namespace fp8moe::cuda
