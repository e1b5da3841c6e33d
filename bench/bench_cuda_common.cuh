// Shared by the CUDA benchmarks: error checks and the plain 16-byte read kernel (the card's
// SM-driven read ceiling, measured in the same run as the kernels it is compared with).
#pragma once

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>

#define CK(x)                                                                                \
  do {                                                                                       \
    cudaError_t e_ = (x);                                                                    \
    if (e_ != cudaSuccess) {                                                                 \
      std::fprintf(stderr, "CUDA error %s at %s:%d: %s\n", cudaGetErrorString(e_), __FILE__, \
                   __LINE__, #x);                                                            \
      std::exit(2);                                                                          \
    }                                                                                        \
  } while (0)
#define CKB(x)                                                                                   \
  do {                                                                                           \
    cublasStatus_t s_ = (x);                                                                     \
    if (s_ != CUBLAS_STATUS_SUCCESS) {                                                           \
      std::fprintf(stderr, "cuBLASLt error %d at %s:%d: %s\n", int(s_), __FILE__, __LINE__, #x); \
      std::exit(2);                                                                              \
    }                                                                                            \
  } while (0)

namespace {

// Reads n 16-byte words once (grid-stride, streaming loads), folding them into a checksum that
// is practically never stored, so the loads stay.
__global__ void read_kernel(const uint4* __restrict__ a, int64_t n, uint32_t* sink) {
  uint32_t acc = 0;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const uint4 v = __ldcs(a + i);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x12345678u) *sink = acc;
}

}  // namespace
