// Launcher of the routing kernel (smxx_moe_routing.cuh).
#include "moe_launchers.hpp"
#include "smxx_moe_routing.cuh"

namespace fp8moe::cuda {

void launch_route(const RoutingParams& rp, int M, int E, int topk, int32_t* ids, float* w,
                  cudaStream_t stream) {
  if (M == 0) return;
  constexpr int kWarps = 4;
  const int smem = kWarps * (E + 32) * static_cast<int>(sizeof(float));
  moe_route_kernel<kWarps>
      <<<static_cast<unsigned>(ceil_div(M, kWarps)), kWarps * 32, smem, stream>>>(rp, M, E, topk,
                                                                                  ids, w);
  FP8MOE_CUDA_CHECK_LAUNCH();
}

}  // namespace fp8moe::cuda
