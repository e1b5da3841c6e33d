// Launcher of the generic mma.sync grouped GEMM (sm89_fp8_moe_gemm_gathered.cuh) and its
// instances: BK in {128, 64, 32} (the refined block sizes), 16-byte aligned rows or not.
#include <algorithm>

#include "moe_launchers.hpp"
#include "sm89_fp8_moe_gemm_gathered.cuh"

namespace fp8moe::cuda {

int gemm_mma_bk(const GemmArgs& a) {
  int bk = 128;
  if (a.promote_block) {
    if (a.w.scale_kind == static_cast<int>(WScale::kBlock))
      bk = std::min(bk, static_cast<int>(a.w.bk));
    if (a.a_scale_kind == static_cast<int>(AScale::kGroup))
      bk = std::min(bk, static_cast<int>(a.gk));
  }
  return bk;
}

namespace {
template <int BK, bool kAligned>
void launch_typed(const GemmArgs& a, int capacity, cudaStream_t stream) {
  constexpr int smem = gemm_smem_bytes<BK>();
  static const bool configured = [] {
    FP8MOE_CUDA_CHECK(cudaFuncSetAttribute(moe_gemm_mma_kernel<BK, kAligned>,
                                           cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    return true;
  }();
  (void)configured;
  const dim3 grid(static_cast<unsigned>(ceil_div(a.N, kGemmBN)),
                  static_cast<unsigned>(capacity / kGemmBM));
  moe_gemm_mma_kernel<BK, kAligned><<<grid, kGemmThreads, smem, stream>>>(a);
  FP8MOE_CUDA_CHECK_LAUNCH();
}
}  // namespace

void launch_gemm_mma(const GemmArgs& a, int capacity, cudaStream_t stream) {
  if (capacity == 0 || a.N == 0) return;
  const bool aligned = a.K % 16 == 0 && a.a_stride % 16 == 0 &&
                       (reinterpret_cast<uintptr_t>(a.a) & 15) == 0 &&
                       (reinterpret_cast<uintptr_t>(a.w.w) & 15) == 0;
  const int bk = gemm_mma_bk(a);
  if (bk % 32 != 0) throw NotImplementedError("cuda_fused: GEMM tile K must be a multiple of 32");
  if (bk >= 128) {
    aligned ? launch_typed<128, true>(a, capacity, stream)
            : launch_typed<128, false>(a, capacity, stream);
  } else if (bk >= 64) {
    aligned ? launch_typed<64, true>(a, capacity, stream)
            : launch_typed<64, false>(a, capacity, stream);
  } else {
    aligned ? launch_typed<32, true>(a, capacity, stream)
            : launch_typed<32, false>(a, capacity, stream);
  }
}

}  // namespace fp8moe::cuda
