// Skips shared by the GPU tests: they run only where this binary's kernels can (tests/cuda/ must
// skip cleanly on machines without a GPU, e.g. CI).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>

#include "common/moe_testing.hpp"

#include "kernels/cuda/fused_moe_cuda.hpp"
#include "kernels/cuda/grouped_moe_cuda.hpp"
#include "kernels/cuda/moe_params.hpp"

// A GPU with the compiled architecture (sm_90a).
#define SKIP_WITHOUT_GPU()                                                                \
  do {                                                                                    \
    ::fp8moe::cuda::install_hooks();                                                      \
    if (!::fp8moe::cuda::kernels_available())                                             \
      GTEST_SKIP() << "no GPU with the compiled architecture (sm_90a) is available here"; \
  } while (0)

// An sm_90 GPU for the grouped (wgmma + TMA) kernels.
#define SKIP_WITHOUT_SM90()                                                               \
  do {                                                                                    \
    ::fp8moe::cuda::install_hooks();                                                      \
    if (!::fp8moe::cuda::grouped_impl().available())                                      \
      GTEST_SKIP() << "no sm_90 GPU with this binary's sm_90a kernels is available here"; \
  } while (0)

namespace fp8moe::testing {

// The activation parameters of the kernel-level activation tests: `act` with, when `limit`, a clamp
// limit of 7; the un-interleaved SwiGLU-OAI with its op defaults (limit 7, alpha 1.702, beta 1);
// fp32_silu: the fused SiLU+quant semantics (h kept in f32).
inline cuda::ActParams act_params_for_test(cuda::Act act, bool limit, bool fp32_silu) {
  cuda::ActParams ap;
  ap.act = static_cast<int32_t>(act);
  if (limit) {
    ap.has_limit = 1;
    ap.limit = 7.0f;
  }
  if (act == cuda::Act::kSwigluOaiUninterleave) {
    ap.limit = 7.0f;
    ap.alpha = 1.702f;
    ap.beta = 1.0f;
  }
  ap.fp32_silu = fp32_silu ? 1 : 0;
  return ap;
}

// Keeps the first non-zero code of every 128-wide K block of every w2 row. With the exact-mode
// generator, GEMM2's 128-deep partial sums of the thinned w2 have one term each, so they are exact
// even with Hopper's reduced-precision FP8 accumulation inside wgmma: the sm_90 paths (grouped,
// wgmma) must then equal the float64 reference bit for bit (with the dense w2 they can differ by
// an ulp; see test_cuda_grouped.cpp's file comment).
inline void thin_w2(MoeTestProblem& p) {
  uint8_t* w = p.w2.ptr<uint8_t>();
  const int64_t rows = p.w2.size(0) * p.w2.size(1), K = p.w2.size(2);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t kb = 0; kb < K; kb += 128) {
      bool seen = false;
      for (int64_t k = kb; k < std::min(K, kb + 128); ++k) {
        uint8_t& c = w[r * K + k];
        if ((c & 0x7F) == 0) continue;
        if (seen) c = 0;
        seen = true;
      }
    }
}

}  // namespace fp8moe::testing
