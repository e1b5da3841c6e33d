// The routing kernels (one block per token over smxx_moe_routing.cuh's route_token_block; one warp
// per token over route_token_warp), the launcher of the first and the test hook of both.
#include <algorithm>
#include <cstdlib>
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
  pdl_trigger();  // as moe_route_kernel: the stream path's prep kernel may launch early
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

// From this many tokens on, for 256 to kRouteWarpMaxExperts experts, one warp per token: a token's
// routing is a longer dependent chain in one warp (14-20 us against 6-8 us for one block, run 13),
// but a block per token occupies the card for M / (blocks per SM x SMs) waves of that latency.
// Measured (run 18, ncu, each kernel alone):
//   DeepSeek-V3 (256 experts, grouped top-k): block 7.2 / 9.4 / 14.3 / 24.4 / 78.7 us, warp 18.8 /
//     18.6 / 19.2 / 21.5 / 46.4 us at M = 256 / 512 / 1024 / 2048 / 8192;
//   MiniMax-M2 (256, sigmoid + bias): block 17.5 / 56.7, warp 14.5 / 32.8 at M = 2048 / 8192;
//   Qwen3-Next (512, softmax): block 10.1 / 16.3 / 28.0 / 51.3 / 189.0, warp 10.9 / 10.7 / 11.0 /
//     14.2 / 38.5 at M = 256 / 512 / 1024 / 2048 / 8192;
//   128 experts (Qwen3-235B) and 8 (Mixtral): the block kernel as fast or faster at 2048 and 8192
//     (10.0 / 27.8 vs 11.5 / 29.4 us; 6.0 / 12.3 vs 7.7 / 14.1 us).
// FP8MOE_ROUTE_WARP_MIN overrides the token count (measurement only).
int route_warp_min(int E) {
  static const int env = [] {
    const char* e = std::getenv("FP8MOE_ROUTE_WARP_MIN");
    if (!e || !*e) return -1;
    char* end = nullptr;
    const long n = std::strtol(e, &end, 10);
    if (!end || *end || n < 0)
      throw ValueError(std::string("FP8MOE_ROUTE_WARP_MIN='") + e + "' is not a token count");
    return static_cast<int>(std::min<long>(n, 1L << 30));
  }();
  if (env >= 0) return env;
  return E > 256 ? 512 : 2048;
}

void launch_route_block(const RoutingParams& rp, int M, int E, int topk, int32_t* ids, float* w,
                        cudaStream_t stream) {
  if (M == 0) return;
  moe_route_kernel<<<static_cast<unsigned>(M), route_threads(E), route_smem_bytes(E), stream>>>(
      rp, E, topk, ids, w);
  FP8MOE_CUDA_CHECK_LAUNCH();
}

}  // namespace

void launch_route(const RoutingParams& rp, int M, int E, int topk, int32_t* ids, float* w,
                  cudaStream_t stream) {
  if (E >= 256 && E <= kRouteWarpMaxExperts && M >= route_warp_min(E))
    launch_route_warp(rp, M, E, topk, ids, w, stream);
  else
    launch_route_block(rp, M, E, topk, ids, w, stream);
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
    launch_route_block(rp, M, E, cfg.topk, ids, w, nullptr);  // the block kernel, whatever M
  }
  FP8MOE_CUDA_CHECK(cudaDeviceSynchronize());
}

}  // namespace fp8moe::cuda
