// The "stream" path of the CUDA fused MoE: small batches, where the layer is bound by reading the
// touched experts' weights once. Three kernels (plus the routing kernel when routing from logits),
// all graph-capturable and chained with programmatic dependent launch:
//
//   prep   CTA 0: moe_align for the stream layout (the active local experts in ascending order,
//          their pair lists, offsets); CTA 1 + t: token t's quantisation (1xgk groups, per token,
//          or static per tensor), its count of local slots, its reduction counters, zeros for a
//          token without local slots.
//   GEMM1  grid (column tile, active expert): 8 warps stream the expert's w13 rows with 16-byte
//          loads straight into registers (two steps in flight, no shared-memory ring) and feed
//          them as the A operand of mma.sync m16n8k32 e4m3; the expert's tokens (<= 32 per pass)
//          are the B columns, read from the quantised x (L1/L2-resident). Each step covers KB of
//          K (KB = gcd(128, block_k, group_k)), so every step lies in one weight block and one
//          activation group and is promoted with its scales like the reference. The warps of a CTA
//          split K; their partial sums are added in a fixed order. A 16-row fragment holds 8 gate
//          and the 8 matching up rows, so the activation is computed in registers; the
//          intermediate is rounded like the reference, quantised directly (static scale) or by the
//          last CTA of its quantisation group ("last arriver", counters zeroed by prep).
//   GEMM2  same loop over w2 rows, * router weight, y2 rounded; the last CTA to finish a
//          (token, row tile) sums the token's local slots in slot order (the reference's moe_sum
//          order), so the output is deterministic without float atomics.
//
// The k order inside one mma is a relabelling: lane (g, t4) loads KB/4 contiguous bytes of weight
// rows g and g + 8 and the same bytes of token g, and both operands use the same positions, so
// each mma still forms sums over its own KB-block only.
#pragma once

#include "cuda_common.cuh"
#include "moe_params.hpp"
#include "sm89_fp8_moe_gemm_gathered.cuh"
#include "smxx_fp8_quant.cuh"
#include "smxx_moe_align.cuh"
#include "smxx_moe_routing.cuh"

namespace fp8moe::cuda {

constexpr int kStreamThreads = 256;
constexpr int kStreamWarps = kStreamThreads / 32;

struct StreamParams {
  int M, H, I, N1, E, E_global, topk, P;
  int gated, interleaved, x_f32, h_f32, router_on_input;
  int route_fused;  // prep routes from the logits itself (CTA 0: all tokens, CTA 1 + t: token t)
  RoutingParams rp;
  int32_t* ids_ws;  // routing output (when routed on the device)
  float* tw_ws;
  const void* x;
  const int32_t* ids;  // (M, topk): the caller's or the routing kernel's
  const float* tw;
  const int32_t* expert_map;
  WeightSide w1, w2;
  int aq1, aq2, gk, ue8m0;
  float min_scale2;
  const float* a13_scale;
  const float* a2_scale;
  ActParams ap;
  // tiling (host-chosen): row groups of 16 weight rows per CTA (the 8 warps split K in 8 / rg)
  int rg1, ct1;  // GEMM1: column tiles per expert
  int rg2, ct2;  // GEMM2: row tiles of H per expert
  int gw1;       // columns of one intermediate quantisation group (gk, or I per token)
  int ngr1;      // groups per expert (0: static scale, no counters)
  int n_act_max;
  // workspace
  int32_t* meta;   // [0] active experts
  int32_t* act;    // (n_act_max) local expert of each active index
  int32_t* eoff;   // (n_act_max + 1) first pair position of each active expert
  int32_t* plist;  // (P) flat pair index at each position
  int32_t* tokv;   // (M) local slots per token
  int32_t* c1;     // (n_act_max, ngr1) GEMM1 group counters
  int32_t* c2;     // (M, ct2) GEMM2 reduction counters
  uint8_t* qx;     // (M, H)
  float* sx;       // (M, H / gk) or (M)
  float* hbuf;     // (P, I) intermediate before its quantisation (group / token scales)
  uint8_t* qh;     // (P, I)
  float* sh;       // (P, I / gk) or (P)
  void* y2;        // (P, H) bf16 or f32, row = flat pair index
  void* out;       // (M, H)
};

// ---- loads -------------------------------------------------------------------------------------
// Weights: read once, keep them out of L1, let L2 fetch 256 bytes.
__device__ __forceinline__ uint4 ld_stream16(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}
__device__ __forceinline__ uint2 ld_stream8(const void* p) {
  uint2 v;
  asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0,%1}, [%2];\n"
               : "=r"(v.x), "=r"(v.y)
               : "l"(p));
  return v;
}
// Activations: small and re-read by every CTA of an expert: cached.
__device__ __forceinline__ uint4 ld_act16(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.v4.u32 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}
__device__ __forceinline__ uint2 ld_act8(const void* p) {
  uint2 v;
  asm volatile("ld.global.nc.v2.u32 {%0,%1}, [%2];\n" : "=r"(v.x), "=r"(v.y) : "l"(p));
  return v;
}
__device__ __forceinline__ float ld_f32(const float* p) {
  float v;
  asm volatile("ld.global.nc.f32 %0, [%1];\n" : "=f"(v) : "l"(p));
  return v;
}

// SW/4 bytes of one row for one lane (SW: K covered by one step of the loop).
template <int SW>
struct Frag {
  uint32_t r[SW / 16];
};
template <int SW, bool kWeight>
__device__ __forceinline__ void ld_frag(Frag<SW>& f, const uint8_t* p) {
  if constexpr (SW == 128) {
    const uint4 a = kWeight ? ld_stream16(p) : ld_act16(p);
    const uint4 b = kWeight ? ld_stream16(p + 16) : ld_act16(p + 16);
    f.r[0] = a.x, f.r[1] = a.y, f.r[2] = a.z, f.r[3] = a.w;
    f.r[4] = b.x, f.r[5] = b.y, f.r[6] = b.z, f.r[7] = b.w;
  } else if constexpr (SW == 64) {
    const uint4 a = kWeight ? ld_stream16(p) : ld_act16(p);
    f.r[0] = a.x, f.r[1] = a.y, f.r[2] = a.z, f.r[3] = a.w;
  } else {
    const uint2 a = kWeight ? ld_stream8(p) : ld_act8(p);
    f.r[0] = a.x, f.r[1] = a.y;
  }
}

// What one warp's K loop needs (one pass of up to 8 * NG tokens).
template <int NG>
struct LoopArgs {
  const uint8_t* w_lo;  // weight row of fragment row g (start of the row)
  const uint8_t* w_hi;  // row g + 8
  const uint8_t* a;     // activation rows
  const float* s;       // their group scales
  int b[NG];            // byte offset of the row of column ng * 8 + g in a, -1 past the tokens
  int sa[NG][2];        // offset of the scale row of column ng * 8 + 2 t4 + c in s, -1: none
  int gk;
  const float* sw_lo;  // block weights: scale row of w_lo (index k / bk)
  const float* sw_hi;
  int bk;
  int ks, KS, nsteps;  // this warp's K slice, the slice count, steps of SW over K
};

// One step's registers.
template <int SW, int NG, bool kBlock>
struct StepBuf {
  Frag<SW> lo, hi;
  Frag<SW> b[NG];
  float sw_lo, sw_hi;
  float sa[NG][2];
};

// The weight half of a step (rows and block scales): depends on nothing but the expert.
template <int SW, int NG, bool kBlock>
__device__ __forceinline__ void step_load_w(StepBuf<SW, NG, kBlock>& b, const LoopArgs<NG>& L,
                                            int s, int t4) {
  const int k0 = s * SW;
  const int off = k0 + t4 * (SW / 4);
  ld_frag<SW, true>(b.lo, L.w_lo + off);
  ld_frag<SW, true>(b.hi, L.w_hi + off);
  if constexpr (kBlock) {
    const int kb = k0 / L.bk;
    b.sw_lo = ld_f32(L.sw_lo + kb);
    b.sw_hi = ld_f32(L.sw_hi + kb);
  }
}
// The activation half (token rows and group scales).
template <int SW, int NG, bool kBlock>
__device__ __forceinline__ void step_load_x(StepBuf<SW, NG, kBlock>& b, const LoopArgs<NG>& L,
                                            int s, int t4) {
  const int k0 = s * SW;
  const int off = k0 + t4 * (SW / 4);
#pragma unroll
  for (int ng = 0; ng < NG; ++ng) {
    if (L.b[ng] >= 0) {
      ld_frag<SW, false>(b.b[ng], L.a + L.b[ng] + off);
    } else {
#pragma unroll
      for (int i = 0; i < SW / 16; ++i) b.b[ng].r[i] = 0u;
    }
  }
  if constexpr (kBlock) {
    const int si = k0 / L.gk;
#pragma unroll
    for (int ng = 0; ng < NG; ++ng)
#pragma unroll
      for (int c = 0; c < 2; ++c)
        b.sa[ng][c] = L.sa[ng][c] >= 0 ? ld_f32(L.s + L.sa[ng][c] + si) : 0.0f;
  }
}

template <int SW, int NG, bool kBlock>
__device__ __forceinline__ void step_compute(const StepBuf<SW, NG, kBlock>& b,
                                             float (&total)[NG][4]) {
  float part[NG][4];
#pragma unroll
  for (int ng = 0; ng < NG; ++ng)
#pragma unroll
    for (int r = 0; r < 4; ++r) part[ng][r] = 0.0f;
#pragma unroll
  for (int j = 0; j < SW / 32; ++j) {
    const uint32_t a[4] = {b.lo.r[2 * j], b.hi.r[2 * j], b.lo.r[2 * j + 1], b.hi.r[2 * j + 1]};
#pragma unroll
    for (int ng = 0; ng < NG; ++ng) {
      const uint32_t bb[2] = {b.b[ng].r[2 * j], b.b[ng].r[2 * j + 1]};
      mma_e4m3_16832(part[ng], a, bb);
    }
  }
  if constexpr (kBlock) {
    // promotion like the reference: (partial * s_a) * s_w per weight block / activation group
#pragma unroll
    for (int ng = 0; ng < NG; ++ng) {
      total[ng][0] += part[ng][0] * b.sa[ng][0] * b.sw_lo;
      total[ng][1] += part[ng][1] * b.sa[ng][1] * b.sw_lo;
      total[ng][2] += part[ng][2] * b.sa[ng][0] * b.sw_hi;
      total[ng][3] += part[ng][3] * b.sa[ng][1] * b.sw_hi;
    }
  } else {
#pragma unroll
    for (int ng = 0; ng < NG; ++ng)
#pragma unroll
      for (int r = 0; r < 4; ++r) total[ng][r] += part[ng][r];
  }
}

// The warp's K loop: steps ks, ks + KS, ... with D steps of loads in flight. The first D steps'
// weights are requested before `fill` resolves the tokens (fill sets L.b / L.sa; it may hold a
// barrier and the wait for the previous kernel), so the weight stream starts at once.
template <int SW, int NG, int D, bool kBlock, typename Fill>
__device__ __forceinline__ void stream_loop(LoopArgs<NG>& L, float (&total)[NG][4], Fill&& fill) {
  const int t4 = threadIdx.x & 3;
  StepBuf<SW, NG, kBlock> buf[D];
  const int my = L.ks < L.nsteps ? (L.nsteps - L.ks + L.KS - 1) / L.KS : 0;
#pragma unroll
  for (int d = 0; d < D; ++d)
    if (d < my) step_load_w(buf[d], L, L.ks + d * L.KS, t4);
  fill(L);
#pragma unroll
  for (int d = 0; d < D; ++d)
    if (d < my) step_load_x(buf[d], L, L.ks + d * L.KS, t4);
  for (int i0 = 0; i0 < my; i0 += D) {
#pragma unroll
    for (int d = 0; d < D; ++d) {
      if (i0 + d < my) {
        step_compute(buf[d], total);
        if (i0 + d + D < my) {
          step_load_w(buf[d], L, L.ks + (i0 + d + D) * L.KS, t4);
          step_load_x(buf[d], L, L.ks + (i0 + d + D) * L.KS, t4);
        }
      }
    }
  }
}

// Shared state of one GEMM CTA.
struct StreamSmem {
  float red[kStreamWarps][32][16];  // partial sums of the K-slice warps
  int32_t row[32];                  // B row of each column of the pass (token or position)
  int32_t pair[32];                 // flat pair index of each column
  int32_t last[32];                 // GEMM2: tokens whose reduction this CTA performs
  int32_t n_last;
  int32_t flag;
};

__device__ __forceinline__ void store_act(void* base, bool f32, int64_t i, float v) {
  if (f32)
    static_cast<float*>(base)[i] = v;
  else
    static_cast<uint16_t*>(base)[i] = float_to_bf16_bits(v);
}

// One pass of up to 8 * NG tokens of active expert j through the K loop, the cross-warp sum and
// the stage's epilogue.
template <int KB, int NG, bool kBlock>
__device__ __forceinline__ void stream_pass(const StreamParams& p, bool g2, int e, int pos0,
                                            int base, int tp, StreamSmem& sm, bool wait_first) {
  const WeightSide& W = g2 ? p.w2 : p.w1;
  const int N = g2 ? p.H : p.N1, K = g2 ? p.I : p.H;
  const int RG = g2 ? p.rg2 : p.rg1, KS = kStreamWarps / RG;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
  const int rg = warp % RG, ks = warp / RG;
  const int tile = blockIdx.x;
  int n_lo, n_hi, col_lo = 0;  // weight rows of fragment rows g, g + 8; GEMM1: output column
  if (g2 || !p.gated) {
    n_lo = tile * 16 * RG + rg * 16 + g;
    n_hi = n_lo + 8;
  } else {
    col_lo = tile * 8 * RG + rg * 8 + g;
    n_lo = p.interleaved ? 2 * col_lo : col_lo;
    n_hi = p.interleaved ? 2 * col_lo + 1 : p.I + col_lo;
  }
  const int aq = g2 ? p.aq2 : p.aq1;
  const uint8_t* a_base = g2 ? p.qh : p.qx;
  const float* s_base = g2 ? p.sh : p.sx;
  const float* s_tensor = g2 ? p.a2_scale : p.a13_scale;
  const int64_t s_stride = kBlock ? K / p.gk : 1;
  // step width: narrower steps for more token groups keep the loads in flight in registers
  constexpr int SW = NG == 1 ? KB : (NG == 2 ? (KB < 64 ? KB : 64) : 32);
  constexpr int D = 2;

  LoopArgs<NG> L;
  const uint8_t* wexp = W.w + int64_t(e) * N * K;
  L.w_lo = wexp + int64_t(n_lo) * K;
  L.w_hi = wexp + int64_t(n_hi) * K;
  L.gk = p.gk;
  const float* ws = W.scale + int64_t(e) * W.scale_e_stride;
  L.bk = W.bk;
  L.sw_lo = kBlock ? ws + int64_t(n_lo / W.bn) * W.scale_n_stride : nullptr;
  L.sw_hi = kBlock ? ws + int64_t(n_hi / W.bn) * W.scale_n_stride : nullptr;
  L.ks = ks;
  L.KS = KS;
  L.nsteps = K / SW;

  float total[NG][4];
#pragma unroll
  for (int ng = 0; ng < NG; ++ng)
#pragma unroll
    for (int r = 0; r < 4; ++r) total[ng][r] = 0.0f;
  auto fill = [&](LoopArgs<NG>& A) {
    if (wait_first) pdl_wait();  // GEMM2: the intermediate comes from GEMM1
    __syncthreads();             // the previous pass is done with the tables
    if (threadIdx.x < tp) {
      const int pos = pos0 + base + threadIdx.x;
      const int pair = __ldcg(p.plist + pos);
      sm.pair[threadIdx.x] = pair;
      sm.row[threadIdx.x] = g2 ? pos : pair / p.topk;
    }
    if (threadIdx.x == 0) sm.n_last = 0;
    __syncthreads();
    A.a = a_base;
    A.s = s_base;
#pragma unroll
    for (int ng = 0; ng < NG; ++ng) {
      const int col = ng * 8 + g;
      A.b[ng] = col < tp ? sm.row[col] * K : -1;
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int cc = ng * 8 + 2 * t4 + c;
        A.sa[ng][c] = kBlock && cc < tp ? sm.row[cc] * static_cast<int>(s_stride) : -1;
      }
    }
  };
  stream_loop<SW, NG, D, kBlock>(L, total, fill);

  // K-slice warps -> the warp with ks == 0, in slice order
  if (KS > 1) {
#pragma unroll
    for (int ng = 0; ng < NG; ++ng)
#pragma unroll
      for (int r = 0; r < 4; ++r) sm.red[warp][lane][ng * 4 + r] = total[ng][r];
    __syncthreads();
    if (ks == 0) {
      for (int s = 1; s < KS; ++s)
#pragma unroll
        for (int ng = 0; ng < NG; ++ng)
#pragma unroll
          for (int r = 0; r < 4; ++r) total[ng][r] += sm.red[rg + s * RG][lane][ng * 4 + r];
    }
  }
  if (ks != 0) return;

  // epilogue (warps of slice 0)
  const void* bias = W.bias;
#pragma unroll
  for (int ng = 0; ng < NG; ++ng)
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const int col = ng * 8 + 2 * t4 + c;
      if (col >= tp) continue;
      float v_lo = total[ng][c], v_hi = total[ng][2 + c];
      if (!kBlock) {  // unscaled sums: * s_a, then * s_w (the reference's order)
        const float sa = aq == static_cast<int>(AQuant::kTensorStatic)
                             ? s_tensor[0]
                             : s_base[int64_t(sm.row[col]) * s_stride];
        v_lo = v_lo * sa * weight_scale(W, e, n_lo, N, 0);
        v_hi = v_hi * sa * weight_scale(W, e, n_hi, N, 0);
      }
      if (bias) {
        const int64_t b0 = int64_t(e) * N;
        v_lo += W.bias_bf16 ? bf16_bits_to_float(static_cast<const uint16_t*>(bias)[b0 + n_lo])
                            : static_cast<const float*>(bias)[b0 + n_lo];
        v_hi += W.bias_bf16 ? bf16_bits_to_float(static_cast<const uint16_t*>(bias)[b0 + n_hi])
                            : static_cast<const float*>(bias)[b0 + n_hi];
      }
      const int pos = pos0 + base + col;
      if (g2) {
        const int pair = sm.pair[col];
        if (!p.router_on_input) {
          const float rw = p.tw[pair];
          v_lo *= rw;
          v_hi *= rw;
        }
        store_act(p.y2, p.x_f32, int64_t(pair) * p.H + n_lo, v_lo);
        store_act(p.y2, p.x_f32, int64_t(pair) * p.H + n_hi, v_hi);
        continue;
      }
      // GEMM1: y1 rounded to the activation dtype, activation, h rounded, then stored for the
      // group quantisation or quantised with the static scale
      const float y_lo = round_act(p.ap, v_lo), y_hi = round_act(p.ap, v_hi);
      float h[2];
      int hc[2];
      int nh;
      if (p.gated) {
        h[0] = act_gated(p.ap, y_lo, y_hi);
        hc[0] = col_lo;
        nh = 1;
      } else {
        h[0] = act_plain(p.ap, y_lo);
        h[1] = act_plain(p.ap, y_hi);
        hc[0] = n_lo;
        hc[1] = n_hi;
        nh = 2;
      }
      for (int q = 0; q < nh; ++q) {
        const float hv = p.h_f32 ? h[q] : bf16_round(h[q]);
        const int64_t idx = int64_t(pos) * p.I + hc[q];
        if (p.aq2 == static_cast<int>(AQuant::kTensorStatic))
          p.qh[idx] = float_to_e4m3(hv * (1.0f / p.a2_scale[0]));
        else
          p.hbuf[idx] = hv;
      }
    }
}

// kBlock: block weights x group activations (promoted every step); otherwise per-tensor /
// per-channel weights x per-token / static activations (scaled once at the end).
template <int KB, int NGMAX, bool kBlock>
__global__ void __launch_bounds__(kStreamThreads, 2)
    moe_stream_gemm_kernel(const __grid_constant__ StreamParams p, int stage) {
  // GEMM1 waits for prep at once; GEMM2 reads prep's tables (complete: every GEMM1 CTA waited for
  // prep before it let GEMM2 launch) and starts its weight stream before waiting for GEMM1
  const bool g2 = stage == 2;
  if (!g2) pdl_wait();
  pdl_trigger();
  __shared__ StreamSmem sm;
  const int j = blockIdx.y;
  if (j >= __ldcg(p.meta)) return;
  const int e = __ldcg(p.act + j);
  const int pos0 = __ldcg(p.eoff + j), T = __ldcg(p.eoff + j + 1) - pos0;
  constexpr int kPass = 8 * NGMAX;
  const int tid = threadIdx.x;
  const int RG = g2 ? p.rg2 : p.rg1;
  for (int base = 0; base < T; base += kPass) {
    const int tp = min(kPass, T - base);
    const bool wait_first = g2 && base == 0;
    if (NGMAX == 1 || tp <= 8) {
      stream_pass<KB, 1, kBlock>(p, g2, e, pos0, base, tp, sm, wait_first);
    } else if (NGMAX == 2 || tp <= 16) {
      stream_pass<KB, (NGMAX >= 2 ? 2 : 1), kBlock>(p, g2, e, pos0, base, tp, sm, wait_first);
    } else {
      stream_pass<KB, NGMAX, kBlock>(p, g2, e, pos0, base, tp, sm, wait_first);
    }
    if (g2) {
      // the top-k reduction of every token whose last local slot this CTA just finished
      __threadfence();
      __syncthreads();
      if (tid < tp) {
        const int tok = sm.pair[tid] / p.topk;
        int* cnt = p.c2 + int64_t(tok) * p.ct2 + blockIdx.x;
        if (atomicAdd(cnt, 1) + 1 == p.tokv[tok]) {
          *cnt = 0;  // every other slot has arrived: ready for the next call
          sm.last[atomicAdd(&sm.n_last, 1)] = tok;
        }
      }
      __syncthreads();
      if (sm.n_last > 0) {
        __threadfence();
        const int rows = 16 * RG, n0 = blockIdx.x * rows;
        for (int i = tid; i < sm.n_last * rows; i += kStreamThreads) {
          const int tok = sm.last[i / rows], n = n0 + i % rows;
          float acc = 0.0f;
          for (int s = 0; s < p.topk; ++s) {
            const int pair = tok * p.topk + s;
            if (local_expert(p.ids[pair], p.expert_map, p.E_global, p.E) < 0) continue;
            const int64_t yi = int64_t(pair) * p.H + n;
            acc += p.x_f32
                       ? __ldcg(static_cast<const float*>(p.y2) + yi)
                       : bf16_bits_to_float(__ldcg(static_cast<const unsigned short*>(p.y2) + yi));
          }
          store_act(p.out, p.x_f32, int64_t(tok) * p.H + n, acc);
        }
      }
    }
  }
  if (g2 || p.ngr1 == 0) return;
  // GEMM1: the last CTA of this quantisation group quantises it for all of the expert's tokens
  __threadfence();
  __syncthreads();
  const int cols = (p.gated ? 8 : 16) * p.rg1;
  const int grp = blockIdx.x * cols / p.gw1;
  if (tid == 0) {
    int* cnt = p.c1 + int64_t(j) * p.ngr1 + grp;
    const int last = atomicAdd(cnt, 1) + 1 == p.gw1 / cols;
    if (last) *cnt = 0;
    sm.flag = last;
  }
  __syncthreads();
  if (!sm.flag) return;
  __threadfence();
  const int warp = tid >> 5, lane = tid & 31;
  const bool group = p.aq2 == static_cast<int>(AQuant::kGroupDynamic);
  const int c0 = grp * p.gw1;
  for (int r = warp; r < T; r += kStreamWarps) {
    const int64_t row = int64_t(pos0 + r) * p.I;
    float amax = 0.0f;
    for (int c = lane; c < p.gw1; c += 32) amax = fmaxf(amax, fabsf(__ldcg(p.hbuf + row + c0 + c)));
    amax = warp_max(amax);
    const float s = group ? group_scale(amax, p.ue8m0 != 0, p.min_scale2)
                          : fmaxf(amax / kFp8Max, 1.0f / (kFp8Max * 512.0f));
    for (int c = lane; c < p.gw1; c += 32)
      p.qh[row + c0 + c] = float_to_e4m3(__ldcg(p.hbuf + row + c0 + c) / s);
    if (lane == 0) {
      if (group)
        p.sh[int64_t(pos0 + r) * (p.I / p.gk) + grp] = s;
      else
        p.sh[pos0 + r] = s;
    }
  }
}

// ---- prep: alignment (CTA 0) and per-token quantisation (CTA 1 + t) ---------------------------
template <typename TX, bool kRoute>
__global__ void __launch_bounds__(kStreamThreads)
    moe_stream_prep_kernel(const __grid_constant__ StreamParams p) {
  pdl_wait();
  pdl_trigger();
  const int tid = threadIdx.x;
  // alignment tables, or the routing scratch before them (route_smem_bytes(1024) fits)
  __shared__ __align__(16) int32_t s_tab[4 * 1024];
  static_assert(route_smem_bytes(kRouteMaxExperts) <= int(sizeof(s_tab)));
  if (blockIdx.x == 0) {
    int32_t* s_cnt = s_tab;
    int32_t* s_aidx = s_tab + 1024;
    int32_t* s_cur = s_tab + 2048;
    int32_t* s_off = s_tab + 3072;
    __shared__ int32_t s_wa[kStreamWarps], s_wc[kStreamWarps];
    if constexpr (kRoute) {  // the block routes the tokens one after the other (M <= 8)
      for (int t = 0; t < p.M; ++t)
        route_token_block<kRouteMaxExperts / kStreamThreads>(
            p.rp, t, p.E_global, p.topk, reinterpret_cast<unsigned char*>(s_tab),
            p.ids_ws + t * p.topk, p.tw_ws + t * p.topk);
    }
    const int E = p.E;
    for (int e = tid; e < E; e += kStreamThreads) {
      s_cnt[e] = 0;
      s_cur[e] = 0;
    }
    __syncthreads();
    for (int i = tid; i < p.P; i += kStreamThreads) {
      const int e = local_expert(p.ids[i], p.expert_map, p.E_global, E);
      if (e >= 0) atomicAdd(&s_cnt[e], 1);
    }
    __syncthreads();
    // experts 4 tid .. 4 tid + 3 (E <= 1024): exclusive scans of (active, count)
    int na = 0, nc = 0;
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const int e = tid * 4 + q;
      if (e < E && s_cnt[e] > 0) {
        ++na;
        nc += s_cnt[e];
      }
    }
    const int lane = tid & 31, warp = tid >> 5;
    int ia = na, ic = nc;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int xa = __shfl_up_sync(0xffffffffu, ia, o), xc = __shfl_up_sync(0xffffffffu, ic, o);
      if (lane >= o) {
        ia += xa;
        ic += xc;
      }
    }
    if (lane == 31) {
      s_wa[warp] = ia;
      s_wc[warp] = ic;
    }
    __syncthreads();
    int ba = ia - na, bc = ic - nc, ta = 0, tc = 0;
    for (int w = 0; w < kStreamWarps; ++w) {
      if (w < warp) {
        ba += s_wa[w];
        bc += s_wc[w];
      }
      ta += s_wa[w];
      tc += s_wc[w];
    }
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const int e = tid * 4 + q;
      if (e < E && s_cnt[e] > 0) {
        s_aidx[e] = ba;
        s_off[ba] = bc;
        p.act[ba] = e;
        p.eoff[ba] = bc;
        ++ba;
        bc += s_cnt[e];
      }
    }
    if (tid == 0) {
      p.meta[0] = ta;
      p.eoff[ta] = tc;
    }
    __syncthreads();
    for (int i = tid; i < p.P; i += kStreamThreads) {
      const int e = local_expert(p.ids[i], p.expert_map, p.E_global, E);
      if (e >= 0) p.plist[s_off[s_aidx[e]] + atomicAdd(&s_cur[e], 1)] = i;
    }
    for (int i = tid; i < p.n_act_max * p.ngr1; i += kStreamThreads) p.c1[i] = 0;
    return;
  }
  // token t
  const int t = blockIdx.x - 1;
  const int32_t* tids = p.ids + t * p.topk;
  const float* ttw = p.tw + t * p.topk;
  if constexpr (kRoute) {  // the same routing as CTA 0's, for this token only
    __shared__ int32_t s_ids[32];
    __shared__ float s_tw[32];
    route_token_block<kRouteMaxExperts / kStreamThreads>(
        p.rp, t, p.E_global, p.topk, reinterpret_cast<unsigned char*>(s_tab), s_ids, s_tw);
    tids = s_ids;
    ttw = s_tw;
  }
  int nloc = 0;
  for (int s = 0; s < p.topk; ++s)
    nloc += local_expert(tids[s], p.expert_map, p.E_global, p.E) >= 0;
  if (tid == 0) p.tokv[t] = nloc;
  for (int i = tid; i < p.ct2; i += kStreamThreads) p.c2[int64_t(t) * p.ct2 + i] = 0;
  if (nloc == 0) {  // no local slot: the reduction never visits this token
    for (int c = tid; c < p.H; c += kStreamThreads)
      store_act(p.out, p.x_f32, int64_t(t) * p.H + c, 0.0f);
    return;
  }
  const TX* x = static_cast<const TX*>(p.x) + int64_t(t) * p.H;
  RowScale rs;
  if (p.router_on_input) rs.w = ttw;  // this token's one slot (topk == 1): row 0
  constexpr bool kBf16 = sizeof(TX) == 2;
  uint8_t* q = p.qx + int64_t(t) * p.H;
  const int c8n = p.H / 8;
  if (p.aq1 == static_cast<int>(AQuant::kGroupDynamic)) {
    const int tpg = p.gk / 8;
    float* so = p.sx + int64_t(t) * (p.H / p.gk);
    for (int b = 0; b < c8n; b += kStreamThreads) {
      const int c8 = b + tid;
      const bool ok = c8 < c8n;
      float v[8];
      float amax = 0.0f;
      if (ok) {
        load8<TX>(x + c8 * 8, v);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          v[i] = row_scale_apply(rs, v[i], 0, kBf16);
          amax = fmaxf(amax, fabsf(v[i]));
        }
      }
      amax = tpg == 4 ? group_max<4>(amax) : tpg == 8 ? group_max<8>(amax) : group_max<16>(amax);
      if (!ok) continue;
      const float s = group_scale(amax, p.ue8m0 != 0, 0.0f);
      *reinterpret_cast<uint2*>(q + c8 * 8) = quant8(v, s);
      if (c8 % tpg == 0) so[c8 / tpg] = s;
    }
  } else if (p.aq1 == static_cast<int>(AQuant::kTokenDynamic)) {
    __shared__ float red[kStreamWarps];
    float amax = 0.0f;
    for (int c = tid; c < p.H; c += kStreamThreads)
      amax = fmaxf(amax, fabsf(row_scale_apply(rs, load_as_float<TX>(x, c), 0, kBf16)));
    amax = warp_max(amax);
    if ((tid & 31) == 0) red[tid >> 5] = amax;
    __syncthreads();
    amax = 0.0f;
    for (int i = 0; i < kStreamWarps; ++i) amax = fmaxf(amax, red[i]);
    const float s = fmaxf(amax / kFp8Max, 1.0f / (kFp8Max * 512.0f));
    for (int c = tid; c < p.H; c += kStreamThreads)
      q[c] = float_to_e4m3(row_scale_apply(rs, load_as_float<TX>(x, c), 0, kBf16) / s);
    if (tid == 0) p.sx[t] = s;
  } else {  // static per-tensor
    const float inv = 1.0f / p.a13_scale[0];
    for (int c = tid; c < p.H; c += kStreamThreads)
      q[c] = float_to_e4m3(row_scale_apply(rs, load_as_float<TX>(x, c), 0, kBf16) * inv);
  }
}

}  // namespace fp8moe::cuda
