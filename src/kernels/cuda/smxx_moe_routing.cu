// Launcher of the routing kernel (smxx_moe_routing.cuh).
#include "moe_launchers.hpp"
#include "smxx_moe_routing.cuh"

namespace fp8moe::cuda {

void launch_route(const RoutingParams& rp, int M, int E, int topk, int32_t* ids, float* w,
                  cudaStream_t stream) {
  if (M == 0) return;
  constexpr int kWarps = 4;
  const int smem = kWarps * (E + 32) * static_cast<int>(sizeof(float));
  const dim3 grid(static_cast<unsigned>(ceil_div(M, kWarps)));
  auto go = [&](auto kernel) {
    kernel<<<grid, kWarps * 32, smem, stream>>>(rp, M, E, topk, ids, w);
  };
  if (E <= 32)
    go(moe_route_kernel<kWarps, 1>);
  else if (E <= 64)
    go(moe_route_kernel<kWarps, 2>);
  else if (E <= 128)
    go(moe_route_kernel<kWarps, 4>);
  else if (E <= 256)
    go(moe_route_kernel<kWarps, 8>);
  else if (E <= 512)
    go(moe_route_kernel<kWarps, 16>);
  else
    go(moe_route_kernel<kWarps, 32>);
  FP8MOE_CUDA_CHECK_LAUNCH();
}

}  // namespace fp8moe::cuda
