// Launcher of the top-k reduction (smxx_moe_reduce.cuh).
#include "moe_launchers.hpp"
#include "smxx_moe_reduce.cuh"

#include <algorithm>

#include "fp8moe/error.hpp"

namespace fp8moe::cuda {

bool moe_sum_vectorised(const void* y2, const void* out, int H, int topk) {
  return H % 8 == 0 && topk <= kSumMaxTopk && (reinterpret_cast<uintptr_t>(y2) & 15) == 0 &&
         (reinterpret_cast<uintptr_t>(out) & 15) == 0;
}

void launch_moe_sum(const void* y2, bool y2_f32, const int32_t* topk_ids, const int32_t* expert_map,
                    int E_global, int E_local, int M, int topk, int H, void* out, bool out_f32,
                    cudaStream_t stream) {
  if (M == 0) return;
  const bool vec = moe_sum_vectorised(y2, out, H, topk);
  const dim3 grid(M, static_cast<unsigned>(ceil_div(H, 256 * 8)));
  const unsigned blocks = static_cast<unsigned>(
      std::max<int64_t>(1, std::min<int64_t>(ceil_div(int64_t(M) * (H / 8), 256), 132 * 16)));
#define FP8MOE_SUM(TY, TO)                                                                        \
  do {                                                                                            \
    if (vec)                                                                                      \
      moe_sum8_kernel<TY, TO><<<blocks, 256, 0, stream>>>(static_cast<const TY*>(y2), topk_ids,   \
                                                          expert_map, E_global, E_local, M, topk, \
                                                          H, static_cast<TO*>(out));              \
    else                                                                                          \
      moe_sum_kernel<TY, TO><<<grid, 256, 0, stream>>>(static_cast<const TY*>(y2), topk_ids,      \
                                                       expert_map, E_global, E_local, M, topk, H, \
                                                       static_cast<TO*>(out));                    \
  } while (0)
  if (y2_f32) {
    if (out_f32)
      FP8MOE_SUM(float, float);
    else
      FP8MOE_SUM(float, uint16_t);
  } else {
    if (out_f32)
      FP8MOE_SUM(uint16_t, float);
    else
      FP8MOE_SUM(uint16_t, uint16_t);
  }
#undef FP8MOE_SUM
  FP8MOE_CUDA_CHECK_LAUNCH();
}

void launch_fused_sum_prep(const int32_t* topk_ids, const int32_t* expert_map, int E_global,
                           int E_local, int M, int topk, int H, int n_tiles, int32_t* cnt,
                           uint16_t* out, cudaStream_t stream) {
  if (M == 0) return;
  if (H % 8 != 0 || (reinterpret_cast<uintptr_t>(out) & 15) != 0)
    throw ValueError("launch_fused_sum_prep: H % 8 == 0 and a 16-byte aligned out are needed");
  fused_sum_prep_kernel<<<static_cast<unsigned>(M), 128, 0, stream>>>(
      topk_ids, expert_map, E_global, E_local, topk, H, n_tiles, cnt, out);
  FP8MOE_CUDA_CHECK_LAUNCH();
}

}  // namespace fp8moe::cuda
