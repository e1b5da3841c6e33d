// Host side of the wgmma grouped GEMMs (sm90_fp8_moe_gemm_wgmma.cuh): the path's limits, the TMA
// descriptors and the launches.
#include <algorithm>
#include <mutex>
#include <string>

#include "moe_launchers.hpp"
#include "moe_paths.hpp"
#include "sm90_fp8_moe_gemm_wgmma.cuh"
#include "sm90_tma.hpp"

namespace fp8moe::cuda {

namespace {
int num_sms() {
  static const int n = [] {
    int dev = 0, v = 0;
    FP8MOE_CUDA_CHECK(cudaGetDevice(&dev));
    FP8MOE_CUDA_CHECK(cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, dev));
    return v;
  }();
  return n;
}

template <bool kGemm2, bool kK32>
void configure_once() {
  static std::once_flag once;
  std::call_once(once, [] {
    FP8MOE_CUDA_CHECK(cudaFuncSetAttribute(moe_gemm_wgmma_kernel<kGemm2, kK32>,
                                           cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           kWgSmemBytes));
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
  const CUtensorMap tma = make_tma_2d_u8(a.a, a.K, a.a_rows, 128, kWgBM);
  const int n_tiles_n = static_cast<int>(gemm2 ? ceil_div(a.N, 256) : a.I / 128);
  const int n_mblk = capacity / kWgBM;
  const int64_t tiles = int64_t(n_tiles_n) * n_mblk;
  // persistent: one CTA per SM (the ring takes ~200 KB of shared memory)
  const unsigned grid = static_cast<unsigned>(std::min<int64_t>(tiles, num_sms()));
#define FP8MOE_WG(G2, K32)                                                           \
  do {                                                                               \
    configure_once<G2, K32>();                                                       \
    moe_gemm_wgmma_kernel<G2, K32>                                                   \
        <<<grid, kWgThreads, kWgSmemBytes, stream>>>(a, tm, tma, n_mblk, n_tiles_n); \
  } while (0)
  if (a.promote_k32) {
    if (gemm2)
      FP8MOE_WG(true, true);
    else
      FP8MOE_WG(false, true);
  } else {
    if (gemm2)
      FP8MOE_WG(true, false);
    else
      FP8MOE_WG(false, false);
  }
#undef FP8MOE_WG
  FP8MOE_CUDA_CHECK_LAUNCH();
}

}  // namespace fp8moe::cuda
