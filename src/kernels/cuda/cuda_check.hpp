// Error checking of CUDA runtime and driver calls, for host code (g++) and launchers (nvcc) alike.
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime_api.h>

#include "fp8moe/error.hpp"

namespace fp8moe::cuda {

[[noreturn]] void throw_cuda_error(cudaError_t e, const char* what, const char* file, int line);
[[noreturn]] void throw_cu_error(CUresult e, const char* what, const char* file, int line);
// cuTensorMapEncodeTiled through the runtime's driver entry point (throws without a driver).
PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder();

}  // namespace fp8moe::cuda

// Every CUDA runtime call goes through this; a failure becomes fp8moe::RuntimeError naming the
// call.
#define FP8MOE_CUDA_CHECK(expr)                                                 \
  do {                                                                          \
    const cudaError_t fp8moe_err_ = (expr);                                     \
    if (fp8moe_err_ != cudaSuccess)                                             \
      ::fp8moe::cuda::throw_cuda_error(fp8moe_err_, #expr, __FILE__, __LINE__); \
  } while (0)
// After each launch: a bad configuration shows up here, not at the next unrelated call.
#define FP8MOE_CUDA_CHECK_LAUNCH() FP8MOE_CUDA_CHECK(cudaGetLastError())
#define FP8MOE_CU_CHECK(expr)                                                 \
  do {                                                                        \
    const CUresult fp8moe_err_ = (expr);                                      \
    if (fp8moe_err_ != CUDA_SUCCESS)                                          \
      ::fp8moe::cuda::throw_cu_error(fp8moe_err_, #expr, __FILE__, __LINE__); \
  } while (0)
