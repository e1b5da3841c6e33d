// Routing on the device (spec/numerics.md §1), one warp per token, with the semantics of
// numerics/routing.cpp (the reference): scores in fp32 (softmax, sigmoid or sqrt(softplus); scores
// that are not finite become 0), selection on score + correction bias or on the raw logits, one
// expert at a time with ties to the lower index (NaN keys rank lowest), optional grouped top-k
// (DeepSeek-V2/V3: groups ranked by the sum of their two best keys, or their best score), then the
// weights, an optional renormalisation summed in slot order, and the routed scaling factor.
// Works for E_global <= 1024.
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

// Warp-wide argmax of (key, index) over the lanes' candidates.
__device__ __forceinline__ void route_warp_best(float& v, int& i, float& payload) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, v, o);
    const int oi = __shfl_xor_sync(0xffffffffu, i, o);
    const float op = __shfl_xor_sync(0xffffffffu, payload, o);
    if (oi != 0x7fffffff && route_better(ov, oi, v, i)) {
      v = ov;
      i = oi;
      payload = op;
    }
  }
}

__device__ __forceinline__ float route_load(const void* p, bool bf16, int64_t i) {
  return bf16 ? bf16_bits_to_float(static_cast<const uint16_t*>(p)[i])
              : static_cast<const float*>(p)[i];
}

// Device routine: the calling warp routes token `t`; lane l owns experts l + 32 i, i < kPerLane
// (E <= 32 kPerLane). `sbuf` is per-warp shared scratch of at least E + 32 floats (grouped top-k
// only). Lane j < topk writes slot j to out_ids[j], out_w[j].
template <int kPerLane>
__device__ inline void route_token_warp_t(const RoutingParams& rp, int t, int E, int topk,
                                          float* sbuf, int32_t* out_ids, float* out_w) {
  const int lane = threadIdx.x & 31;
  const RouteScore sk = static_cast<RouteScore>(rp.score);
  float logit[kPerLane];
  float score[kPerLane];  // unbiased scores (the logits for kLogits)
  float key[kPerLane];    // selection key
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int e = lane + 32 * i;
    logit[i] = e < E ? route_load(rp.logits, rp.logits_bf16, int64_t(t) * E + e) : 0.0f;
  }
  if (sk == RouteScore::kSoftmax) {
    float mx = -INFINITY;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i)
      if (lane + 32 * i < E) mx = fmaxf(mx, logit[i]);
    mx = warp_max(mx);
    float sum = 0.0f;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const float v = lane + 32 * i < E ? expf(logit[i] - mx) : 0.0f;
      score[i] = v;
      sum += v;
    }
    sum = warp_sum(sum);
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) score[i] = score[i] / sum;
  } else if (sk == RouteScore::kSigmoid) {
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) score[i] = 1.0f / (1.0f + expf(-logit[i]));
  } else if (sk == RouteScore::kSqrtSoftplus) {
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const float l = logit[i];
      score[i] = sqrtf(l > 20.0f ? l : log1pf(expf(l)));
    }
  } else {
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) score[i] = logit[i];
  }
  if (sk != RouteScore::kLogits) {
#pragma unroll
    for (int i = 0; i < kPerLane; ++i)
      if (!isfinite(score[i])) score[i] = 0.0f;
  }
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int e = lane + 32 * i;
    key[i] = score[i];
    if (rp.bias && e < E) key[i] = score[i] + route_load(rp.bias, rp.bias_bf16, e);
  }
  uint32_t taken = 0;  // bit i: expert lane + 32 i is not selectable

  // grouped top-k: keep the topk_group best groups
  if (rp.grouped) {
    const int G = rp.num_expert_group;
    const int per = E / G;
    float* s_key = sbuf;        // E floats
    float* s_group = sbuf + E;  // G floats (G <= 32 in practice; guarded below)
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const int e = lane + 32 * i;
      if (e < E) s_key[e] = key[i];
    }
    __syncwarp();
    for (int g = lane; g < G; g += 32) {
      const float* kg = s_key + g * per;
      float gs;
      if (rp.bias) {  // sum of the two best keys (ties: lower index first)
        int b0 = 0x7fffffff, b1 = 0x7fffffff;
        float v0 = 0.0f, v1 = 0.0f;
        for (int i = 0; i < per; ++i) {
          const float v = kg[i];
          if (route_better(v, i, v0, b0)) {
            v1 = v0;
            b1 = b0;
            v0 = v;
            b0 = i;
          } else if (route_better(v, i, v1, b1)) {
            v1 = v;
            b1 = i;
          }
        }
        gs = v0 + v1;
      } else {
        gs = -INFINITY;
        for (int i = 0; i < per; ++i) gs = fmaxf(gs, kg[i]);
      }
      s_group[g] = gs;
    }
    __syncwarp();
    // choose topk_group groups; chosen groups are marked in `chosen` (G <= 32 per lane bit, else
    // the group array)
    uint32_t chosen_lo = 0;  // groups 0..31 (bitmask, same in every lane)
    for (int r = 0; r < rp.topk_group; ++r) {
      float bv = 0.0f;
      int bi = 0x7fffffff;
      float dummy = 0.0f;
      for (int g = lane; g < G; g += 32) {
        const bool used = g < 32 ? ((chosen_lo >> g) & 1u) : s_group[g] != s_group[g];
        if (!used && route_better(s_group[g], g, bv, bi)) {
          bv = s_group[g];
          bi = g;
        }
      }
      route_warp_best(bv, bi, dummy);
      if (bi < 32) chosen_lo |= 1u << bi;
    }
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const int e = lane + 32 * i;
      const int g = e / per;
      if (e < E && !(g < 32 && ((chosen_lo >> g) & 1u))) taken |= 1u << i;
    }
    __syncwarp();
  }

  // top-k, one expert at a time
  float my_w = 0.0f;
  int32_t my_id = -1;
  float my_logit = 0.0f;
  for (int j = 0; j < topk; ++j) {
    float bv = 0.0f;
    int bi = 0x7fffffff;
    float bpay = 0.0f;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const int e = lane + 32 * i;
      if (e < E && !((taken >> i) & 1u) && route_better(key[i], e, bv, bi)) {
        bv = key[i];
        bi = e;
        bpay = static_cast<float>(i);
      }
    }
    route_warp_best(bv, bi, bpay);
    if (bi == 0x7fffffff) bi = 0;  // cannot happen: topk <= selectable experts (host checks)
    const int owner = bi & 31, slot = bi >> 5;
    // fetch the score and logit of the winner from its owner lane
    float s_w = 0.0f, s_l = 0.0f;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      if (i == slot) {
        s_w = score[i];
        s_l = logit[i];
      }
    }
    s_w = __shfl_sync(0xffffffffu, s_w, owner);
    s_l = __shfl_sync(0xffffffffu, s_l, owner);
    if (lane == owner) taken |= 1u << slot;
    if (lane == j) {
      my_id = bi;
      my_w = s_w;
      my_logit = s_l;
    }
  }

  // weights
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
    float denom =
        rp.renorm == static_cast<int>(RouteRenorm::kMaxSumEps) ? fmaxf(sum, rp.eps) : sum + rp.eps;
    if (!(denom > 0.0f)) denom = 1.0f;
    my_w = my_w / denom;
  }
  if (rp.apply_rsf && rp.routed_scaling_factor != 1.0f) my_w *= rp.routed_scaling_factor;
  if (lane < topk) {
    out_ids[lane] = my_id;
    out_w[lane] = my_w;
  }
}

// Dispatch on the experts per lane (registers scale with it).
__device__ __forceinline__ void route_token_warp(const RoutingParams& rp, int t, int E, int topk,
                                                 float* sbuf, int32_t* out_ids, float* out_w) {
  if (E <= 32)
    route_token_warp_t<1>(rp, t, E, topk, sbuf, out_ids, out_w);
  else if (E <= 64)
    route_token_warp_t<2>(rp, t, E, topk, sbuf, out_ids, out_w);
  else if (E <= 128)
    route_token_warp_t<4>(rp, t, E, topk, sbuf, out_ids, out_w);
  else if (E <= 256)
    route_token_warp_t<8>(rp, t, E, topk, sbuf, out_ids, out_w);
  else if (E <= 512)
    route_token_warp_t<16>(rp, t, E, topk, sbuf, out_ids, out_w);
  else
    route_token_warp_t<32>(rp, t, E, topk, sbuf, out_ids, out_w);
}

template <int kWarps>
__global__ void __launch_bounds__(kWarps * 32)
    moe_route_kernel(RoutingParams rp, int M, int E, int topk, int32_t* topk_ids, float* topk_w) {
  extern __shared__ float route_smem[];
  const int warp = threadIdx.x >> 5;
  const int t = blockIdx.x * kWarps + warp;
  if (t >= M) return;
  route_token_warp(rp, t, E, topk, route_smem + warp * (E + 32), topk_ids + int64_t(t) * topk,
                   topk_w + int64_t(t) * topk);
}

}  // namespace fp8moe::cuda
