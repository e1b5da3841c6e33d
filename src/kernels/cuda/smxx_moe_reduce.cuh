// The top-k reduction (ops.moe_sum, spec/numerics.md §6): out[t] = round(sum_j y2[t, j]) with the
// sum in fp32 over the slots in order j = 0..k-1, skipping slots that were never computed (expert
// -1 or on another rank: their contribution is zero). A token with no local slot gets zeros.
#pragma once

#include "cuda_common.cuh"
#include "smxx_moe_align.cuh"

namespace fp8moe::cuda {

// TY: y2 element (bf16 bits or f32); TO: out element (bf16 bits or f32). 8 columns per thread.
template <typename TY, typename TO>
__global__ void __launch_bounds__(256)
    moe_sum_kernel(const TY* __restrict__ y2, const int32_t* __restrict__ topk_ids,
                   const int32_t* __restrict__ expert_map, int E_global, int E_local, int M,
                   int topk, int H, TO* __restrict__ out) {
  const int t = blockIdx.x;
  const int c0 = (blockIdx.y * blockDim.x + threadIdx.x) * 8;
  if (t >= M || c0 >= H) return;
  float acc[8] = {};
  for (int j = 0; j < topk; ++j) {
    if (local_expert(topk_ids[int64_t(t) * topk + j], expert_map, E_global, E_local) < 0) continue;
    const TY* y = y2 + (int64_t(t) * topk + j) * H;
#pragma unroll
    for (int i = 0; i < 8; ++i)
      if (c0 + i < H) acc[i] += load_as_float<TY>(y, c0 + i);
  }
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    if (c0 + i >= H) break;
    if constexpr (sizeof(TO) == 2) {
      out[int64_t(t) * H + c0 + i] = float_to_bf16_bits(acc[i]);
    } else {
      out[int64_t(t) * H + c0 + i] = acc[i];
    }
  }
}

// moe_sum_kernel with 16-byte loads: one thread per 8 columns of one token over the flattened
// (token, column / 8) range, every valid slot's load issued before the in-order sum. The same
// operations in the same order per element, so the same bits. Needs H % 8 == 0 and 16-byte aligned
// y2 and out. Measured 2.4-2.8 TB/s for the scalar kernel on the H200 (run 18).
constexpr int kSumMaxTopk = 32;

template <typename TY, typename TO>
__global__ void __launch_bounds__(256)
    moe_sum8_kernel(const TY* __restrict__ y2, const int32_t* __restrict__ topk_ids,
                    const int32_t* __restrict__ expert_map, int E_global, int E_local, int M,
                    int topk, int H, TO* __restrict__ out) {
  const int c8_per_row = H / 8;
  const int64_t n = int64_t(M) * c8_per_row;
  for (int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; idx < n;
       idx += int64_t(gridDim.x) * blockDim.x) {
    const int t = static_cast<int>(idx / c8_per_row);
    const int c0 = static_cast<int>(idx % c8_per_row) * 8;
    uint32_t valid = 0;  // bit j: slot j was computed (topk <= 32)
    for (int j = 0; j < topk; ++j)
      if (local_expert(topk_ids[int64_t(t) * topk + j], expert_map, E_global, E_local) >= 0)
        valid |= 1u << j;
    float acc[8] = {};
    const TY* y = y2 + int64_t(t) * topk * H + c0;
    // four slots' loads in flight at a time, summed in slot order
    for (int j0 = 0; j0 < topk; j0 += 4) {
      float v[4][8];
#pragma unroll
      for (int d = 0; d < 4; ++d)
        if (j0 + d < topk && ((valid >> (j0 + d)) & 1u)) load8<TY>(y + (j0 + d) * H, v[d]);
#pragma unroll
      for (int d = 0; d < 4; ++d)
        if (j0 + d < topk && ((valid >> (j0 + d)) & 1u)) {
#pragma unroll
          for (int i = 0; i < 8; ++i) acc[i] += v[d][i];
        }
    }
    if constexpr (sizeof(TO) == 2) {
      uint32_t w[4];
#pragma unroll
      for (int i = 0; i < 4; ++i)
        w[i] = uint32_t(float_to_bf16_bits(acc[2 * i])) |
               (uint32_t(float_to_bf16_bits(acc[2 * i + 1])) << 16);
      *reinterpret_cast<uint4*>(out + int64_t(t) * H + c0) = make_uint4(w[0], w[1], w[2], w[3]);
    } else {
      float4* o = reinterpret_cast<float4*>(out + int64_t(t) * H + c0);
      o[0] = make_float4(acc[0], acc[1], acc[2], acc[3]);
      o[1] = make_float4(acc[4], acc[5], acc[6], acc[7]);
    }
  }
}

// Before a GEMM2 with the fused top-k sum (GroupedGemmParams::sum_out): zeroes token t's n-tile
// counters, and writes zeros to the out row of a token without a local slot (moe_sum's rule; no
// tile ever completes such a token). One block per token.
__global__ void __launch_bounds__(128)
    fused_sum_prep_kernel(const int32_t* __restrict__ topk_ids,
                          const int32_t* __restrict__ expert_map, int E_global, int E_local,
                          int topk, int H, int n_tiles, int32_t* __restrict__ cnt,
                          uint16_t* __restrict__ out) {
  const int t = blockIdx.x;
  for (int i = threadIdx.x; i < n_tiles; i += blockDim.x) cnt[int64_t(t) * n_tiles + i] = 0;
  bool any = false;
  for (int j = 0; j < topk; ++j)
    any |= local_expert(topk_ids[int64_t(t) * topk + j], expert_map, E_global, E_local) >= 0;
  if (any) return;
  for (int c = threadIdx.x * 8; c < H; c += blockDim.x * 8)
    *reinterpret_cast<uint4*>(out + int64_t(t) * H + c) = make_uint4(0u, 0u, 0u, 0u);
}

}  // namespace fp8moe::cuda
