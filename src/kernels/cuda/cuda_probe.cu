// Whether this binary holds machine code for the current device: the library is built for sm_90a
// only (no PTX), so on any other GPU the kernels cannot load and this answers false.
#include "cuda_common.cuh"
#include "fused_moe_cuda.hpp"

namespace fp8moe::cuda {

namespace {
__global__ void probe_kernel() {}
}  // namespace

bool kernels_available() {
  static const bool ok = [] {
    if (device_capability() == 0) return false;
    cudaFuncAttributes attr{};
    if (cudaFuncGetAttributes(&attr, probe_kernel) != cudaSuccess) {
      cudaGetLastError();
      return false;
    }
    return true;
  }();
  return ok;
}

}  // namespace fp8moe::cuda
