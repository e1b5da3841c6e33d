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

}  // namespace fp8moe::cuda
