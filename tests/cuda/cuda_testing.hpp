// Skips shared by the GPU tests: they run only where this binary's kernels can (tests/cuda/ must
// skip cleanly on machines without a GPU, e.g. CI).
#pragma once

#include <gtest/gtest.h>

#include "kernels/cuda/fused_moe_cuda.hpp"
#include "kernels/cuda/grouped_moe_cuda.hpp"

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
