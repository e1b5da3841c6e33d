// Routing on the device (spec/numerics.md §1): one warp per token computes the scores (softmax or
// sigmoid over the logits, in fp32), the optional group selection (grouped top-k) and the k
// experts, ties going to the lower expert index, then the weights (unbiased scores, optional
// renormalisation, routed scaling factor). Works for E_global <= 1024.
#pragma once

#include "cuda_common.cuh"
#include "moe_params.hpp"

namespace fp8moe::cuda {

constexpr int kRouteMaxExperts = 1024;
constexpr int kRoutePerLane = kRouteMaxExperts / 32;

// Device routine: the calling warp routes token `t`. `sbuf` is per-warp shared scratch of at least
// 2 * E floats. Writes ids/weights for slot j at out_ids[j], out_w[j] (lane j < topk).
__device__ inline void route_token_warp(const RoutingParams& rp, int t, int E, int topk,
                                        float* sbuf, int32_t* out_ids, float* out_w) {
  const int lane = threadIdx.x & 31;
  float score[kRoutePerLane];  // unbiased scores (softmax or sigmoid)
  float sel[kRoutePerLane];    // selection key (score + bias), -inf when masked / absent
  // 1. logits -> scores
  float mx = -INFINITY;
#pragma unroll
  for (int i = 0; i < kRoutePerLane; ++i) {
    const int e = lane + 32 * i;
    float l = -INFINITY;
    if (e < E) {
      l = rp.logits_bf16
              ? bf16_bits_to_float(static_cast<const uint16_t*>(rp.logits)[int64_t(t) * E + e])
              : static_cast<const float*>(rp.logits)[int64_t(t) * E + e];
    }
    score[i] = l;
    mx = fmaxf(mx, l);
  }
  if (rp.sigmoid) {
#pragma unroll
    for (int i = 0; i < kRoutePerLane; ++i) {
      const int e = lane + 32 * i;
      score[i] = e < E ? 1.0f / (1.0f + expf(-score[i])) : 0.0f;
    }
  } else {
    mx = warp_max(mx);
    float sum = 0.0f;
#pragma unroll
    for (int i = 0; i < kRoutePerLane; ++i) {
      const int e = lane + 32 * i;
      const float v = e < E ? expf(score[i] - mx) : 0.0f;
      score[i] = v;
      sum += v;
    }
    sum = warp_sum(sum);
    const float inv = 1.0f / sum;
#pragma unroll
    for (int i = 0; i < kRoutePerLane; ++i) {
      float p = score[i] * inv;
      if (!isfinite(p)) p = 0.0f;  // NaN or Inf scores become 0
      score[i] = p;
    }
  }
#pragma unroll
  for (int i = 0; i < kRoutePerLane; ++i) {
    const int e = lane + 32 * i;
    sel[i] = e < E ? score[i] + (rp.bias ? rp.bias[e] : 0.0f) : -INFINITY;
  }

  // 2. grouped top-k: keep the topk_group best groups, mask the rest.
  if (rp.kind == static_cast<int>(RouteKind::kGrouped)) {
    const int G = rp.num_expert_group;
    const int gsize = E / G;
    float* s_sel = sbuf;        // E floats
    float* s_group = sbuf + E;  // G floats
#pragma unroll
    for (int i = 0; i < kRoutePerLane; ++i) {
      const int e = lane + 32 * i;
      if (e < E) s_sel[e] = sel[i];
    }
    __syncwarp();
    for (int g = lane; g < G; g += 32) {
      float best = -INFINITY, second = -INFINITY;
      for (int j = 0; j < gsize; ++j) {
        const float v = s_sel[g * gsize + j];
        if (v > best) {
          second = best;
          best = v;
        } else if (v > second) {
          second = v;
        }
      }
      s_group[g] = rp.bias ? best + second : best;
    }
    __syncwarp();
    // select topk_group groups (lowest index on ties); mark chosen groups with +inf in s_group
    for (int r = 0; r < rp.topk_group; ++r) {
      float bv = -INFINITY;
      int bi = 0x7fffffff;
      for (int g = lane; g < G; g += 32) {
        const float v = s_group[g];
        if (v != INFINITY && (v > bv || (v == bv && g < bi))) {
          bv = v;
          bi = g;
        }
      }
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
        const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
        if (ov > bv || (ov == bv && oi < bi)) {
          bv = ov;
          bi = oi;
        }
      }
      if (lane == 0 && bi < G) s_group[bi] = INFINITY;
      __syncwarp();
    }
#pragma unroll
    for (int i = 0; i < kRoutePerLane; ++i) {
      const int e = lane + 32 * i;
      if (e < E && s_group[e / gsize] != INFINITY) sel[i] = -INFINITY;
    }
    __syncwarp();
  }

  // 3. top-k selection, one expert at a time (ties to the lower index; when only -inf keys are
  //    left the lowest unused index is taken, so k distinct experts always come out).
  float wsum = 0.0f;
  float my_w = 0.0f;
  int32_t my_id = -1;
  uint32_t taken = 0;
  for (int j = 0; j < topk; ++j) {
    float bv = -INFINITY;
    int bi = 0x7fffffff;
    float bscore = 0.0f;
#pragma unroll
    for (int i = 0; i < kRoutePerLane; ++i) {
      const int e = lane + 32 * i;
      const bool free = e < E && !((taken >> i) & 1u);
      if (free && (sel[i] > bv || (sel[i] == bv && e < bi))) {
        bv = sel[i];
        bi = e;
        bscore = score[i];
      }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
      const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
      const float os = __shfl_xor_sync(0xffffffffu, bscore, o);
      if (ov > bv || (ov == bv && oi < bi)) {
        bv = ov;
        bi = oi;
        bscore = os;
      }
    }
    if ((bi & 31) == lane) taken |= 1u << (bi >> 5);
    wsum += bscore;
    if (lane == j) {
      my_w = bscore;
      my_id = bi;
    }
  }
  if (lane < topk) {
    float w = my_w;
    if (rp.renormalize) {
      if (rp.kind == static_cast<int>(RouteKind::kGrouped) && rp.bias) {
        w = w / (wsum + 1e-20f);
      } else {
        w = w / (wsum > 0.0f ? wsum : 1.0f);
      }
    }
    if (rp.routed_scaling_factor != 1.0f) w = w * rp.routed_scaling_factor;
    out_ids[lane] = my_id;
    out_w[lane] = w;
  }
}

template <int kWarps>
__global__ void __launch_bounds__(kWarps * 32)
    moe_route_kernel(RoutingParams rp, int M, int E, int topk, int32_t* topk_ids, float* topk_w) {
  extern __shared__ float route_smem[];
  const int warp = threadIdx.x >> 5;
  const int t = blockIdx.x * kWarps + warp;
  if (t >= M) return;
  route_token_warp(rp, t, E, topk, route_smem + warp * (2 * E), topk_ids + int64_t(t) * topk,
                   topk_w + int64_t(t) * topk);
}

}  // namespace fp8moe::cuda
