// Routing on the device (spec/numerics.md §1), one thread block per token (route_token_block) or
// one warp per token (route_token_warp, E <= 512, the same results bit for bit), with the semantics
// of numerics/routing.cpp (the reference): scores in fp32 (softmax, sigmoid or sqrt(softplus);
// scores that are not finite become 0), selection on score + correction bias or on the raw logits,
// best key first with ties to the lower index (NaN keys rank lowest), optional grouped top-k
// (DeepSeek-V2/V3: groups ranked by the sum of their two best keys, or their best score), then the
// weights, an optional renormalisation summed in slot order, and the routed scaling factor.
// Works for E_global <= 1024, topk <= 32, num_expert_group <= 32.
//
// Why a block per token and ranks instead of a warp picking one expert at a time: one warp routing
// a 256-expert token executed ~5,300 dependent instructions at ~10 cycles each (ncu, DeepSeek-V3
// TP8: 28 us per routing kernel, 36 us for the stream path's prep; docs/PERFORMANCE.md run 9).
// Here every thread owns experts and turns each key into one 64-bit integer whose order is exactly
// the selection order (key bits made monotonic, NaN lowest, -0 == +0, then the inverted index). An
// expert's slot is the number of keys above its own; it wins when that is below topk. To keep the
// work near E * topk instead of E^2, each expert first counts inside its chunk of 32, and only
// the topk best of every chunk (the candidates) count among the candidates (step 3 says why that
// is exact).
//
// Why a warp routine as well: the single-kernel decode path (sm90_fp8_moe_single.cuh) routed with
// the whole block of one CTA per token while the other CTAs waited for it (measured on the H200:
// 6-8 us for one token with the block routine inside the single kernel; since run 14 every CTA
// routes a one-token call itself with the block routine, ~5-6 us). With route_token_warp every CTA
// can route the token(s) it needs in one warp, in parallel with the x quantisation, and needs no
// block barrier and only a small per-warp scratch (RouteWarpScratch). Its lane l keeps the keys of
// experts l, l + 32, ... in registers; groups take their best two orders with redux.sync and
// shared-memory atomicMax, and top-k is topk rounds of a warp-wide maximum (redux.sync), each
// taking the next largest order. It does the block routine's float operations in the same order
// (the shared route_score and route_finish, the softmax denominator summed the same way), so the
// ids and weights are the same bits; the selection is on the same 64-bit orders. Measured (run 13,
// inside the single kernel, every CTA routing its token in one warp): 14-20 us for one token of
// DeepSeek-V3 / Qwen3-Next, slower than the block routine's 6-8 us in one CTA, so no forward path
// uses it; it stays behind device_route(..., one_warp_per_token) with its bit-for-bit test as the
// starting point of a faster one (its top-k rounds and the 16-row loops run whatever E is).
#pragma once

#include "cuda_common.cuh"
#include "moe_params.hpp"

namespace fp8moe::cuda {

constexpr int kRouteMaxExperts = 1024;

// a (index ia) ranks above b (index ib): larger key, ties to the lower index, NaN lowest; ib ==
// INT_MAX means "no candidate yet".
__device__ __forceinline__ bool route_better(float a, int ia, float b, int ib) {
  if (ib == 0x7fffffff) return true;
  const bool na = isnan(a), nb = isnan(b);
  if (na || nb) return na && nb ? ia < ib : nb;
  return a > b || (a == b && ia < ib);
}

__device__ __forceinline__ float route_load(const void* p, bool bf16, int64_t i) {
  return bf16 ? bf16_bits_to_float(static_cast<const uint16_t*>(p)[i])
              : static_cast<const float*>(p)[i];
}

// Bytes of shared scratch route_token_block needs for E experts (16-byte aligned).
__host__ __device__ constexpr int route_smem_bytes(int E) {
  return 12 * ((E + 31) / 32 * 32) + 1024;
}

// The selection order of (key, expert) as one integer, larger = selected first: the key's bits
// made monotonic (-0 ranks as +0, NaN below every number), then the inverted index (ties to the
// lower index). Never 0 for E <= 1024, so 0 can mark "not selectable".
__device__ __forceinline__ uint64_t route_order(float key, int e) {
  uint32_t u = 0;
  if (!isnan(key)) {
    const uint32_t b = __float_as_uint(key == 0.0f ? 0.0f : key);
    u = (b & 0x80000000u) ? ~b : (b | 0x80000000u);
  }
  return (uint64_t(u) << 32) | (0xffffffffu - static_cast<uint32_t>(e));
}

// How many of keys[0, n) are above `mine`; stops once the count reaches `stop` (checked every 32
// keys). kVec: keys is 16-byte aligned (pairs of keys per shared-memory load).
template <bool kVec>
__device__ __forceinline__ int route_count_above(const uint64_t* keys, int n, uint64_t mine,
                                                 int stop) {
  int c = 0, j = 0;
  for (; j + 32 <= n; j += 32) {
    if constexpr (kVec) {
#pragma unroll 4
      for (int q = 0; q < 32; q += 2) {
        const ulonglong2 v = *reinterpret_cast<const ulonglong2*>(keys + j + q);
        c += (v.x > mine) + (v.y > mine);
      }
    } else {
#pragma unroll 8
      for (int q = 0; q < 32; ++q) c += keys[j + q] > mine;
    }
    if (c >= stop) return c;
  }
  for (; j < n; ++j) c += keys[j] > mine;
  return c;
}

// An expert's score: softmax from v = expf(logit - max) and denom (the sum of those), the others
// from v = the logit. Not finite -> 0, except for the raw logits.
__device__ __forceinline__ float route_score(RouteScore sk, float v, float denom) {
  float s;
  if (sk == RouteScore::kSoftmax) {
    s = v / denom;
  } else if (sk == RouteScore::kSigmoid) {
    s = 1.0f / (1.0f + expf(-v));
  } else if (sk == RouteScore::kSqrtSoftplus) {
    s = sqrtf(v > 20.0f ? v : log1pf(expf(v)));
  } else {
    s = v;
  }
  if (sk != RouteScore::kLogits && !isfinite(s)) s = 0.0f;
  return s;
}

// The key of a selection order (route_order) as a float again: == the key it came from (-0 comes
// back as +0), NaN for a NaN key. Only ==, > and isnan of it (and of sums of two) are used, so the
// lost zero sign (and NaN payload) change nothing.
__device__ __forceinline__ float route_order_key(uint64_t o) {
  const uint32_t u = static_cast<uint32_t>(o >> 32);
  return __uint_as_float((u & 0x80000000u) ? (u & 0x7fffffffu) : ~u);  // u == 0: 0xffffffff, NaN
}

// Step 4 of both routines, called by all 32 lanes of one warp. Lane j < topk holds slot j: the
// expert my_id, its score my_s and its logit my_logit (lanes >= topk: anything, unused). The
// weight (the score, the softmax over the selected logits, the logit or its sigmoid), the optional
// renormalisation (summed in slot order) and the routed scaling factor; lane j < topk writes
// out_ids[j] and out_w[j].
__device__ inline void route_finish(const RoutingParams& rp, int topk, int lane, int32_t my_id,
                                    float my_s, float my_logit, int32_t* out_ids, float* out_w) {
  float my_w = my_s;
  const RouteWeight wk = static_cast<RouteWeight>(rp.weight);
  if (wk == RouteWeight::kSoftmaxSelected) {
    float mx = -INFINITY;
    for (int j = 0; j < topk; ++j) mx = fmaxf(mx, __shfl_sync(0xffffffffu, my_logit, j));
    const float ex = expf(my_logit - mx);
    float sum = 0.0f;
    for (int j = 0; j < topk; ++j) sum += __shfl_sync(0xffffffffu, ex, j);
    my_w = ex / sum;
    if (!isfinite(my_w)) my_w = 0.0f;
  } else if (wk == RouteWeight::kLogit) {
    my_w = isfinite(my_logit) ? my_logit : 0.0f;
  } else if (wk == RouteWeight::kSigmoidLogit) {
    my_w = 1.0f / (1.0f + expf(-my_logit));
    if (!isfinite(my_w)) my_w = 0.0f;
  }
  if (rp.renorm != static_cast<int>(RouteRenorm::kNone)) {
    float sum = 0.0f;
    for (int j = 0; j < topk; ++j) sum += __shfl_sync(0xffffffffu, my_w, j);
    float d =
        rp.renorm == static_cast<int>(RouteRenorm::kMaxSumEps) ? fmaxf(sum, rp.eps) : sum + rp.eps;
    if (!(d > 0.0f)) d = 1.0f;
    my_w = my_w / d;
  }
  if (rp.apply_rsf && rp.routed_scaling_factor != 1.0f) my_w *= rp.routed_scaling_factor;
  if (lane < topk) {
    out_ids[lane] = my_id;
    out_w[lane] = my_w;
  }
}

// The calling block (blockDim.x a multiple of 32, at least E / kOwn threads; every thread calls)
// routes token t.
// `smem`: route_smem_bytes(E) bytes, 16-byte aligned. Lane j < topk of warp 0 writes slot j to
// out_ids[j], out_w[j]. Ends with __syncthreads(), so the caller may reuse the scratch. Each thread
// reads its experts' logits and biases from global memory once, into registers (run 14: the single
// decode path routes on the critical path of the layer).
// Diagnostics: with `steps` (global memory) thread 0 writes the clock64 cycles since the call
// started after each step's block barrier: [0] scores and keys (with the logit loads), [1] grouped
// top-k, [2] chunk counts, [3] candidates, [4] slots, [5] weights.
template <int kOwn>
__device__ inline void route_token_block(const RoutingParams& rp, int t, int E, int topk,
                                         unsigned char* smem, int32_t* out_ids, float* out_w,
                                         unsigned long long* steps = nullptr) {
  const int tid = threadIdx.x, nt = blockDim.x, lane = tid & 31, warp = tid >> 5;
  const long long t_start = steps ? clock64() : 0;
  auto step = [&](int i) {
    if (steps && tid == 0) steps[i] = static_cast<unsigned long long>(clock64() - t_start);
  };
  const int Ep = (E + 31) / 32 * 32;                               // chunks of 32 experts
  uint64_t* s_key = reinterpret_cast<uint64_t*>(smem);             // Ep selection orders (0: none)
  float* s_score = reinterpret_cast<float*>(smem + 8 * Ep);        // E scores
  float* s_misc = s_score + E;                                     // 256 floats:
  float* s_red = s_misc;                                           //   per-warp maxima (softmax)
  float* s_g0 = s_misc + 32;                                       //   best key of each group
  float* s_g1 = s_misc + 64;                                       //   second key of each group
  float* s_sel_s = s_misc + 96;                                    //   slot -> score
  float* s_sel_l = s_misc + 128;                                   //   slot -> logit
  int32_t* s_sel_id = reinterpret_cast<int32_t*>(s_misc + 160);    // slot -> expert
  float* s_sum = s_misc + 192;                                     //   softmax denominator
  unsigned* s_chosen = reinterpret_cast<unsigned*>(s_misc + 193);  // chosen groups
  const RouteScore sk = static_cast<RouteScore>(rp.score);
  const int64_t row = int64_t(t) * E;
  // expert tid + i nt: its logit and bias (0 when there is none), loaded once
  float lg[kOwn], bs[kOwn];
#pragma unroll
  for (int i = 0; i < kOwn; ++i) {
    const int e = tid + i * nt;
    lg[i] = e < E ? route_load(rp.logits, rp.logits_bf16, row + e) : 0.0f;
    bs[i] = e < E && rp.bias ? route_load(rp.bias, rp.bias_bf16, e) : 0.0f;
  }

  // 1. scores and selection keys
  float denom = 1.0f;
  if (sk == RouteScore::kSoftmax) {
    float mx = -INFINITY;
#pragma unroll
    for (int i = 0; i < kOwn; ++i)
      if (tid + i * nt < E) mx = fmaxf(mx, lg[i]);
    mx = warp_max(mx);
    if (lane == 0) s_red[warp] = mx;
    __syncthreads();
    mx = s_red[0];
    for (int w = 1; w < (nt >> 5); ++w) mx = fmaxf(mx, s_red[w]);
#pragma unroll
    for (int i = 0; i < kOwn; ++i)
      if (tid + i * nt < E) s_score[tid + i * nt] = expf(lg[i] - mx);
    __syncthreads();
    if (warp == 0) {  // lane l sums experts l, l + 32, ... in order, then across the warp
      float sum = 0.0f;
      for (int e = lane; e < E; e += 32) sum += s_score[e];
      sum = warp_sum(sum);
      if (lane == 0) *s_sum = sum;
    }
    __syncthreads();
    denom = *s_sum;
  }
#pragma unroll
  for (int i = 0; i < kOwn; ++i) {
    const int e = tid + i * nt;
    if (e >= E) break;
    const float s = route_score(sk, sk == RouteScore::kSoftmax ? s_score[e] : lg[i], denom);
    s_score[e] = s;
    s_key[e] = route_order(rp.bias ? s + bs[i] : s, e);
  }
  for (int e = E + tid; e < Ep; e += nt) s_key[e] = 0;  // the last chunk's padding
  if (tid < 32) {
    s_g1[tid] = 0.0f;  // a one-expert group's "second best"
    s_sel_id[tid] = 0;
    s_sel_s[tid] = 0.0f;
    s_sel_l[tid] = 0.0f;
  }
  if (tid == 0) *s_chosen = 0u;
  __syncthreads();
  step(0);

  // 2. grouped top-k: keep the topk_group best groups (group score: the sum of the two best keys
  // with a bias, else the best key, fmaxf-style: -inf when every key is NaN)
  if (rp.grouped) {
    const int G = rp.num_expert_group, per = E / G;
#pragma unroll
    for (int i = 0; i < kOwn; ++i) {
      const int e = tid + i * nt;
      if (e >= G * per) break;
      const int g = e / per;
      const int c = route_count_above<false>(s_key + g * per, per, s_key[e], 2);
      const float k = rp.bias ? s_score[e] + bs[i] : s_score[e];  // the selection key
      if (rp.bias) {
        if (c == 0)
          s_g0[g] = k;
        else if (c == 1)
          s_g1[g] = k;
      } else if (c == 0) {
        s_g0[g] = isnan(k) ? -INFINITY : k;
      }
    }
    __syncthreads();
    if (tid < G) {
      const float mine = rp.bias ? s_g0[tid] + s_g1[tid] : s_g0[tid];
      int c = 0;
      for (int h = 0; h < G; ++h) {
        const float o = rp.bias ? s_g0[h] + s_g1[h] : s_g0[h];
        c += h != tid && route_better(o, h, mine, tid);
      }
      if (c < rp.topk_group) atomicOr(s_chosen, 1u << tid);
    }
    __syncthreads();
    const unsigned chosen = *s_chosen;
    for (int e = tid; e < E; e += nt) {
      const int g = e / per;
      if (g >= G || !((chosen >> g) & 1u)) s_key[e] = 0;  // not selectable
    }
    __syncthreads();
  }
  step(1);

  // 3. top-k. An expert's slot is the number of selectable keys above its own. Counting over all
  // E keys for every expert is E^2 work (measured 364 us for 8192 tokens of E = 512), so first
  // each expert counts inside its chunk of 32: only the topk best of a chunk can win (if topk keys
  // of its chunk are above it, it has lost), and any key above a winner is itself among the
  // topk best of its chunk. So the winners and their slots follow from counting over those
  // candidates only: (Ep / 32) * topk keys, written over the key array.
  uint64_t mine[kOwn];
  int local[kOwn];
#pragma unroll
  for (int i = 0; i < kOwn; ++i) {
    const int e = tid + i * nt;
    mine[i] = 0;
    local[i] = 32;
    if (e < Ep) {
      mine[i] = s_key[e];
      local[i] = route_count_above<true>(s_key + (e & ~31), 32, mine[i], 32);
    }
  }
  __syncthreads();  // every key read: the candidates go over them
  step(2);
  uint64_t* s_cand = s_key;
  const int C = (Ep / 32) * topk;
#pragma unroll
  for (int i = 0; i < kOwn; ++i) {
    const int e = tid + i * nt;  // the warp's lanes share e's chunk
    if (e - lane < Ep) {
      const int chunk = e >> 5;
      const int nz = __popc(__ballot_sync(0xffffffffu, mine[i] != 0));
      if (mine[i] != 0 && local[i] < topk) s_cand[chunk * topk + local[i]] = mine[i];
      if (lane >= nz && lane < topk) s_cand[chunk * topk + lane] = 0;  // slots left empty
    }
  }
  __syncthreads();
  step(3);
#pragma unroll
  for (int i = 0; i < kOwn; ++i) {
    const int e = tid + i * nt;
    if (e >= E || mine[i] == 0 || local[i] >= topk) continue;
    const int c = route_count_above<true>(s_cand, C, mine[i], topk);
    if (c < topk) {
      s_sel_id[c] = e;
      s_sel_s[c] = s_score[e];
      s_sel_l[c] = lg[i];
    }
  }
  __syncthreads();
  step(4);

  // 4. weights (warp 0, lane j = slot j)
  if (warp == 0) {
    int32_t my_id = -1;
    float my_s = 0.0f, my_logit = 0.0f;
    if (lane < topk) {
      my_id = s_sel_id[lane];
      my_s = s_sel_s[lane];
      my_logit = s_sel_l[lane];
    }
    route_finish(rp, topk, lane, my_id, my_s, my_logit, out_ids, out_w);
  }
  __syncthreads();
  step(5);
}

constexpr int kRouteWarpMaxExperts = 512;

// route_token_warp's scratch in shared memory, one per routing warp: per group, the best and the
// second best selection order (route_order; 0: none).
struct RouteWarpScratch {
  unsigned long long best[32];
  unsigned long long second[32];
};

// The largest of 16 values (a tree of depth 4 instead of a chain of 15).
__device__ __forceinline__ uint64_t route_max16(const uint64_t (&k)[16]) {
  uint64_t m[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) m[i] = k[i] > k[i + 8] ? k[i] : k[i + 8];
#pragma unroll
  for (int i = 0; i < 4; ++i) m[i] = m[i] > m[i + 4] ? m[i] : m[i + 4];
#pragma unroll
  for (int i = 0; i < 2; ++i) m[i] = m[i] > m[i + 2] ? m[i] : m[i + 2];
  return m[0] > m[1] ? m[0] : m[1];
}

// The largest of v over the lanes of `mask` (every lane of it calls; sm_80+): the high halves
// first, then the low halves of the lanes holding the largest high half.
__device__ __forceinline__ uint64_t route_warp_max(unsigned mask, uint64_t v) {
  const uint32_t h = static_cast<uint32_t>(v >> 32);
  const uint32_t bh = __reduce_max_sync(mask, h);
  const uint32_t bl = __reduce_max_sync(mask, h == bh ? static_cast<uint32_t>(v) : 0u);
  return (uint64_t(bh) << 32) | bl;
}

// The calling warp (all 32 lanes, lane = threadIdx.x % 32; no block barrier) routes token t, with
// route_token_block's results bit for bit. E <= kRouteWarpMaxExperts, topk <= 32,
// num_expert_group <= 32. Lane l owns experts l, l + 32, ... (their keys stay in registers); `s`:
// this warp's own scratch, free again when the call returns. Lane j < topk writes slot j to
// out_ids[j], out_w[j].
__device__ inline void route_token_warp(const RoutingParams& rp, int t, int E, int topk,
                                        RouteWarpScratch* s, int32_t* out_ids, float* out_w) {
  constexpr int kRows = kRouteWarpMaxExperts / 32;  // row i: experts 32 i .. 32 i + 31
  constexpr unsigned kAll = 0xffffffffu;
  const int lane = threadIdx.x & 31;
  const RouteScore sk = static_cast<RouteScore>(rp.score);
  const bool softmax = sk == RouteScore::kSoftmax;
  const int64_t row = int64_t(t) * E;

  // 1. scores and selection keys. Softmax: the maximum (fmaxf: its order and the sign of a zero
  // maximum change no expf(logit - max)), then the denominator summed as route_token_block does
  // (lane l: experts l, l + 32, ... in order, then warp_sum, lane 0's sum).
  float v[kRows];
#pragma unroll
  for (int i = 0; i < kRows; ++i) {
    const int e = lane + 32 * i;
    v[i] = e < E ? route_load(rp.logits, rp.logits_bf16, row + e) : 0.0f;
  }
  float mx = -INFINITY, denom = 1.0f;
  if (softmax) {
#pragma unroll
    for (int i = 0; i < kRows; ++i)
      if (lane + 32 * i < E) mx = fmaxf(mx, v[i]);
    mx = warp_max(mx);
    float sum = 0.0f;
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
      if (lane + 32 * i < E) {
        v[i] = expf(v[i] - mx);
        sum += v[i];
      }
    }
    denom = __shfl_sync(kAll, warp_sum(sum), 0);
  }
  uint64_t key[kRows];  // selection orders, 0: not selectable
#pragma unroll
  for (int i = 0; i < kRows; ++i) {
    const int e = lane + 32 * i;
    key[i] = 0;
    if (e < E) {
      const float sc = route_score(sk, v[i], denom);
      key[i] = route_order(rp.bias ? sc + route_load(rp.bias, rp.bias_bf16, e) : sc, e);
    }
  }

  // 2. grouped top-k, as route_token_block's step 2. Group g = experts [g * per, (g + 1) * per),
  // per any size. In each row of 32 experts, the lanes of one group take the largest order among
  // them (two redux.sync: the key bits, then the index bits among the lanes holding the largest
  // key bits) and, with a bias, the second largest (the same without the largest). The group's
  // first lane in the row folds them into the scratch: atomicMax(best[g], largest) returns the old
  // best, and whichever of the two lost (the old best or the row's largest) goes with the row's
  // second into atomicMax(second[g], ...). So every order of the group but the final best reaches
  // second[g] or is below one that does: best[g] and second[g] are route_token_block's c == 0 and
  // c == 1 experts, and route_order_key turns them back into their keys (score + bias).
  if (rp.grouped) {
    const int G = rp.num_expert_group, per = E / G, GE = G * per;
    // e / per as (e * mul) >> 20, mul = ceil(2^20 / per): exact for e < 1024, per <= 1024, since
    // e * (mul * per - 2^20) < 1024 * per <= 2^20
    const uint32_t mul =
        ((1u << 20) + static_cast<uint32_t>(per) - 1u) / static_cast<uint32_t>(per);
    const bool second = rp.bias != nullptr;  // without a bias only the best counts
    s->best[lane] = 0;
    s->second[lane] = 0;
    __syncwarp();
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
      if (32 * i >= GE) continue;  // warp-uniform
      const int e = lane + 32 * i;
      const int g = static_cast<int>((static_cast<uint32_t>(e) * mul) >> 20);
      if (g >= G) continue;  // past G * per (in no group)
      const int lo = max(g * per - 32 * i, 0), hi = min((g + 1) * per - 32 * i, 32);
      const unsigned mask = (hi == 32 ? kAll : (1u << hi) - 1u) & ~((1u << lo) - 1u);
      const uint64_t b = route_warp_max(mask, key[i]);
      const uint64_t b2 = second ? route_warp_max(mask, key[i] == b ? 0 : key[i]) : 0;
      if (lane == lo) {
        const uint64_t old = atomicMax(&s->best[g], static_cast<unsigned long long>(b));
        if (second) {
          const uint64_t lost = old > b ? b : (old > b2 ? old : b2);
          atomicMax(&s->second[g], static_cast<unsigned long long>(lost));
        }
      }
    }
    __syncwarp();
    // lane g < G: the group's score (fmaxf-style without a bias: -inf when its best key is NaN),
    // then its rank among the groups with route_better, as route_token_block does
    float mine = 0.0f;
    if (lane < G) {
      const float g0 = route_order_key(s->best[lane]);
      if (rp.bias) {
        const uint64_t o1 = s->second[lane];
        mine = g0 + (o1 != 0 ? route_order_key(o1) : 0.0f);
      } else {
        mine = isnan(g0) ? -INFINITY : g0;
      }
    }
    __syncwarp();  // the scratch's last reads
    int c = 0;
    for (int h = 0; h < G; ++h) {
      const float o = __shfl_sync(kAll, mine, h);
      c += h != lane && route_better(o, h, mine, lane);
    }
    const unsigned chosen = __ballot_sync(kAll, lane < G && c < rp.topk_group);
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
      const int g = static_cast<int>((static_cast<uint32_t>(lane + 32 * i) * mul) >> 20);
      if (g >= G || !((chosen >> g) & 1u)) key[i] = 0;  // not selectable
    }
  }

  // 3. top-k: round c takes the largest selectable order of the warp into slot c (= the number of
  // selectable orders above it, route_token_block's slot); its lane drops it and takes its next
  // best. Slots left without one (fewer selectable experts than topk) keep expert 0, score 0,
  // logit 0, as route_token_block's do.
  uint64_t lane_best = route_max16(key);
  int32_t my_id = lane < topk ? 0 : -1;
  bool won = false;
  for (int c = 0; c < topk; ++c) {
    const uint64_t w = route_warp_max(kAll, lane_best);
    if (w == 0) break;  // warp-uniform
    if (lane == c) {
      my_id = static_cast<int32_t>(0xffffffffu - static_cast<uint32_t>(w));
      won = true;
    }
    if (lane_best == w) {
#pragma unroll
      for (int i = 0; i < kRows; ++i)
        if (key[i] == w) key[i] = 0;
      lane_best = route_max16(key);
    }
  }

  // 4. weights: the winner's score again from its logit (the same operations as in step 1)
  float my_s = 0.0f, my_logit = 0.0f;
  if (won) {
    my_logit = route_load(rp.logits, rp.logits_bf16, row + my_id);
    my_s = route_score(sk, softmax ? expf(my_logit - mx) : my_logit, denom);
  }
  route_finish(rp, topk, lane, my_id, my_s, my_logit, out_ids, out_w);
}

}  // namespace fp8moe::cuda
