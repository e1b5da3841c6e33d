// The routing kernels (one block per token over smxx_moe_routing.cuh's route_token_block; one warp
// per token over route_token_warp), the launcher of the first and the test hook of both.
#include <string>

#include "cuda_check.hpp"
#include "fp8moe/error.hpp"
#include "fused_moe_cuda.hpp"
#include "moe_launchers.hpp"
#include "moe_problem.hpp"
#include "smxx_moe_routing.cuh"

namespace fp8moe::cuda {

namespace {

// Threads of the routing kernel's block for E experts (one expert per thread; E <= 1024).
__host__ __device__ constexpr int route_threads(int E) {
  return E <= 32 ? 32 : (E >= 1024 ? 1024 : (E + 31) / 32 * 32);
}

// One block per token.
__global__ void __launch_bounds__(1024)
    moe_route_kernel(RoutingParams rp, int E, int topk, int32_t* topk_ids, float* topk_w) {
  // The stream path launches its prep kernel right after this one with programmatic dependent
  // launch (it waits for this grid in pdl_wait): let it launch early. No effect on the chains,
  // whose next kernel launches plainly.
  pdl_trigger();
  extern __shared__ __align__(16) unsigned char route_smem[];
  const int t = blockIdx.x;
  route_token_block<1>(rp, t, E, topk, route_smem, topk_ids + int64_t(t) * topk,
                       topk_w + int64_t(t) * topk);
}

// One warp per token (E <= kRouteWarpMaxExperts), kRouteWarpTokens tokens per block.
constexpr int kRouteWarpTokens = 4;

__global__ void __launch_bounds__(kRouteWarpTokens * 32)
    moe_route_warp_kernel(RoutingParams rp, int M, int E, int topk, int32_t* topk_ids,
                          float* topk_w) {
  __shared__ RouteWarpScratch scratch[kRouteWarpTokens];
  const int warp = static_cast<int>(threadIdx.x >> 5);
  const int t = static_cast<int>(blockIdx.x) * kRouteWarpTokens + warp;
  if (t >= M) return;  // the whole warp
  route_token_warp(rp, t, E, topk, &scratch[warp], topk_ids + int64_t(t) * topk,
                   topk_w + int64_t(t) * topk);
}

void launch_route_warp(const RoutingParams& rp, int M, int E, int topk, int32_t* ids, float* w,
                       cudaStream_t stream) {
  if (M == 0) return;
  const unsigned blocks = static_cast<unsigned>((M + kRouteWarpTokens - 1) / kRouteWarpTokens);
  moe_route_warp_kernel<<<blocks, kRouteWarpTokens * 32, 0, stream>>>(rp, M, E, topk, ids, w);
  FP8MOE_CUDA_CHECK_LAUNCH();
}

}  // namespace

void launch_route(const RoutingParams& rp, int M, int E, int topk, int32_t* ids, float* w,
                  cudaStream_t stream) {
  if (M == 0) return;
  moe_route_kernel<<<static_cast<unsigned>(M), route_threads(E), route_smem_bytes(E), stream>>>(
      rp, E, topk, ids, w);
  FP8MOE_CUDA_CHECK_LAUNCH();
}

void device_route(const TensorView& logits, const RoutingConfig& cfg, int32_t* ids, float* w,
                  bool one_warp_per_token) {
  const RoutingParams rp = routing_params(logits, cfg);
  if (!logits.device.is_cuda()) throw ValueError("device_route: logits must be on the GPU");
  const int M = static_cast<int>(logits.size(0)), E = static_cast<int>(logits.size(1));
  if (one_warp_per_token) {
    if (E > kRouteWarpMaxExperts)
      throw NotImplementedError("device_route: one warp per token routes at most " +
                                std::to_string(kRouteWarpMaxExperts) +
                                " experts, got E = " + std::to_string(E));
    launch_route_warp(rp, M, E, cfg.topk, ids, w, nullptr);
  } else {
    launch_route(rp, M, E, cfg.topk, ids, w, nullptr);
  }
  FP8MOE_CUDA_CHECK(cudaDeviceSynchronize());
}

}  // namespace fp8moe::cuda
