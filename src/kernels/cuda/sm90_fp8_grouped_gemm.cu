// Host side of the Hopper FP8 grouped GEMM (sm90_fp8_grouped_gemm.cuh): TMA descriptors, the
// persistent launch, and the masked-rows helper.
#include <algorithm>
#include <mutex>

#include "sm90_fp8_grouped_gemm.cuh"
#include "sm90_tma.hpp"

namespace fp8moe::cuda {

namespace {
int sm_count() {
  static const int n = [] {
    int dev = 0, v = 0;
    FP8MOE_CUDA_CHECK(cudaGetDevice(&dev));
    FP8MOE_CUDA_CHECK(cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, dev));
    return v;
  }();
  return n;
}
}  // namespace

int grouped_gemm_smem_bytes() { return kGSmemBytes; }

void launch_grouped_gemm(const GroupedGemmParams& p, const uint8_t* a, const uint8_t* b,
                         int64_t b_rows, int64_t max_m_blocks, cudaStream_t stream) {
  if (max_m_blocks <= 0 || p.N <= 0 || p.K <= 0 || p.a_rows <= 0) return;
  static std::once_flag once;
  std::call_once(once, [] {
    FP8MOE_CUDA_CHECK(cudaFuncSetAttribute(
        grouped_gemm_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kGSmemBytes));
  });
  const CUtensorMap tm_a = make_tma_2d_u8(a, p.K, p.a_rows, kGBK, kGBM);
  const CUtensorMap tm_b = make_tma_2d_u8(b, p.K, b_rows, kGBK, kGBN);
  const int64_t tiles = max_m_blocks * (p.N / kGBN);
  const unsigned grid = static_cast<unsigned>(std::min<int64_t>(tiles, sm_count()));
  grouped_gemm_kernel<<<grid, kGThreads, kGSmemBytes, stream>>>(p, tm_a, tm_b);
  FP8MOE_CUDA_CHECK_LAUNCH();
}

void launch_masked_rows(const int32_t* counts, int E, int max_m, int32_t* ids, int32_t* meta,
                        cudaStream_t stream) {
  const int64_t n = int64_t(E) * max_m;
  const unsigned blocks =
      static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(ceil_div(n, 256), 4096)));
  masked_rows_kernel<<<blocks, 256, 0, stream>>>(counts, E, max_m, ids, meta);
  FP8MOE_CUDA_CHECK_LAUNCH();
}

}  // namespace fp8moe::cuda
