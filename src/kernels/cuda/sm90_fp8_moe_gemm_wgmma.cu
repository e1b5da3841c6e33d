// Host side of the wgmma grouped GEMMs (sm90_fp8_moe_gemm_wgmma.cuh): the path's limits, the TMA
// descriptors and the launches.
#include <mutex>
#include <string>

#include "moe_launchers.hpp"
#include "moe_paths.hpp"
#include "sm90_fp8_moe_gemm_wgmma.cuh"
#include "sm90_tma.hpp"

namespace fp8moe::cuda {

namespace {
template <bool kGemm2>
void configure_once() {
  static std::once_flag once;
  std::call_once(once, [] {
    FP8MOE_CUDA_CHECK(cudaFuncSetAttribute(
        moe_gemm_wgmma_kernel<kGemm2>, cudaFuncAttributeMaxDynamicSharedMemorySize, kWgSmemBytes));
  });
}
}  // namespace

std::string wgmma_path_limit(const MoeProblem& p) {
  if (p.x_f32) return "f32 activations";
  if (!p.gated) return "non-gated activations";
  const Act act = static_cast<Act>(p.ap.act);
  if (act == Act::kSwigluOai) return "interleaved gate/up columns";
  if (p.H % 128 != 0 || p.I % 128 != 0) return "hidden and intermediate must be multiples of 128";
  const bool w_block = p.w1.scale_kind == static_cast<int>(WScale::kBlock);
  if (w_block) {
    if (p.w1.bn != 128 || p.w1.bk != 128) return "weight blocks other than 128x128";
    if (p.aq1 != AQuant::kGroupDynamic || p.aq2 != AQuant::kGroupDynamic || p.gk != 128)
      return "block weights need 1x128 activation groups";
  } else {
    if (p.aq1 != AQuant::kTensorStatic && p.aq1 != AQuant::kTokenDynamic)
      return "per-tensor/per-channel weights need static per-tensor or per-token inputs";
    if (p.aq2 != AQuant::kTensorStatic) return "the intermediate needs a static scale";
  }
  for (const WeightSide* w : {&p.w1, &p.w2})
    if ((reinterpret_cast<uintptr_t>(w->w) & 15) != 0) return "weights must be 16-byte aligned";
  return {};
}

void launch_gemm_wgmma(const WgArgs& a, bool gemm2, int capacity, cudaStream_t stream) {
  if (capacity == 0) return;
  // weight tensor map: rows of the (E, N, K) tensor, boxes of 128 rows x 128 bytes
  const CUtensorMap tm = make_tma_2d_u8(a.w.w, a.K, a.rows_total, 128, 128);
  const dim3 grid(static_cast<unsigned>(gemm2 ? ceil_div(a.N, 256) : a.I / 128),
                  static_cast<unsigned>(capacity / kWgBM));
  if (gemm2) {
    configure_once<true>();
    moe_gemm_wgmma_kernel<true><<<grid, kWgThreads, kWgSmemBytes, stream>>>(a, tm);
  } else {
    configure_once<false>();
    moe_gemm_wgmma_kernel<false><<<grid, kWgThreads, kWgSmemBytes, stream>>>(a, tm);
  }
  FP8MOE_CUDA_CHECK_LAUNCH();
}

}  // namespace fp8moe::cuda
