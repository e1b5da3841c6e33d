// The CUDA hooks the rest of the library uses: device memory for Tensor (DeviceAllocator), the
// device-capability query behind Platform::detect(), error formatting, and the driver entry point
// for TMA descriptors. The driver API is reached through cudaGetDriverEntryPoint so that binaries
// built with CUDA still start on machines without a driver (CI): every query then answers "no GPU".
#include <fmt/format.h>

#include <mutex>

#include "cuda_check.hpp"
#include "fp8moe/platform.hpp"
#include "fused_moe_cuda.hpp"

namespace fp8moe::cuda {

void throw_cuda_error(cudaError_t e, const char* what, const char* file, int line) {
  throw RuntimeError(fmt::format("CUDA error {} ({}) in {} at {}:{}", cudaGetErrorName(e),
                                 cudaGetErrorString(e), what, file, line));
}
void throw_cu_error(CUresult e, const char* what, const char* file, int line) {
  throw RuntimeError(
      fmt::format("CUDA driver error {} in {} at {}:{}", static_cast<int>(e), what, file, line));
}

namespace {

// Switches to `device` for the scope (the allocator may be asked for another GPU).
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    FP8MOE_CUDA_CHECK(cudaGetDevice(&prev_));
    if (prev_ != device) FP8MOE_CUDA_CHECK(cudaSetDevice(device));
    switched_ = prev_ != device;
  }
  ~DeviceGuard() {
    if (switched_) cudaSetDevice(prev_);
  }

 private:
  int prev_ = 0;
  bool switched_ = false;
};

void* device_alloc(std::size_t bytes, int device) {
  DeviceGuard g(device);
  void* p = nullptr;
  const cudaError_t e = cudaMalloc(&p, bytes);
  if (e != cudaSuccess) {
    cudaGetLastError();  // clear the sticky-free error state of a failed allocation
    throw RuntimeError(fmt::format("cudaMalloc of {} bytes on cuda:{} failed: {}", bytes, device,
                                   cudaGetErrorString(e)));
  }
  return p;
}
void device_free(void* p, int device) {
  if (!p) return;
  cudaFree(p);  // never throws from a deleter
}
void device_copy(void* dst, const void* src, std::size_t bytes, int kind) {
  const cudaMemcpyKind k = kind == 0   ? cudaMemcpyHostToDevice
                           : kind == 1 ? cudaMemcpyDeviceToHost
                                       : cudaMemcpyDeviceToDevice;
  FP8MOE_CUDA_CHECK(cudaMemcpy(dst, src, bytes, k));
}

}  // namespace

int device_capability() {
  static const int cap = [] {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
      cudaGetLastError();
      return 0;
    }
    int dev = 0, major = 0, minor = 0;
    if (cudaGetDevice(&dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) != cudaSuccess) {
      cudaGetLastError();
      return 0;
    }
    return major * 10 + minor;
  }();
  return cap;
}

std::string device_name() {
  if (device_capability() == 0) return "none";
  int dev = 0;
  cudaDeviceProp prop{};
  if (cudaGetDevice(&dev) != cudaSuccess || cudaGetDeviceProperties(&prop, dev) != cudaSuccess) {
    cudaGetLastError();
    return "unknown";
  }
  return prop.name;
}

void install_hooks() {
  static std::once_flag once;
  std::call_once(once, [] {
    DeviceAllocator a;
    a.alloc = device_alloc;
    a.free = device_free;
    a.copy = device_copy;
    set_device_allocator(a);
    set_cuda_capability_hook(&device_capability);
  });
}

PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault,
                                         &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess) {
      cudaGetLastError();
      return static_cast<PFN_cuTensorMapEncodeTiled_v12000>(nullptr);
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p);
  }();
  if (!fn) throw RuntimeError("the CUDA driver has no cuTensorMapEncodeTiled (driver too old?)");
  return fn;
}

}  // namespace fp8moe::cuda
