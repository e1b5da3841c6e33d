// A small tensor vocabulary: TensorView (non-owning: data, dtype, shape, strides, device) and
// Tensor (owning, reference-counted storage on the host or on a CUDA device). Strides are in
// elements.
#pragma once

#include <array>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "fp8moe/dtype.hpp"

namespace fp8moe {

enum class DeviceKind : uint8_t { kCpu, kCuda };

struct Device {
  DeviceKind kind = DeviceKind::kCpu;
  int index = 0;
  static Device cpu() { return {}; }
  static Device cuda(int i = 0) { return {DeviceKind::kCuda, i}; }
  bool is_cpu() const { return kind == DeviceKind::kCpu; }
  bool is_cuda() const { return kind == DeviceKind::kCuda; }
  bool operator==(const Device&) const = default;
  std::string str() const;  // "cpu", "cuda:0"
};

inline constexpr int kMaxDims = 4;

// Non-owning view. An empty view (data == nullptr, ndim == 0, numel()==0 allowed) means "absent".
struct TensorView {
  void* data = nullptr;
  DType dtype = DType::kF32;
  int ndim = 0;
  std::array<int64_t, kMaxDims> shape{};
  std::array<int64_t, kMaxDims> strides{};  // in elements
  Device device{};

  TensorView() = default;
  // Contiguous row-major view.
  TensorView(void* data, DType dtype, std::initializer_list<int64_t> shape, Device device = {});
  TensorView(void* data, DType dtype, std::span<const int64_t> shape, Device device = {});

  bool defined() const { return ndim > 0 || data != nullptr; }
  int64_t size(int dim) const { return shape[dim < 0 ? dim + ndim : dim]; }
  int64_t stride(int dim) const { return strides[dim < 0 ? dim + ndim : dim]; }
  int64_t numel() const;
  std::size_t nbytes() const { return static_cast<std::size_t>(numel()) * dtype_size(dtype); }
  bool is_contiguous() const;
  std::vector<int64_t> sizes() const { return {shape.begin(), shape.begin() + ndim}; }
  // "(8, 512, 256) float8_e4m3fn cpu"
  std::string describe() const;

  template <class T>
  T* ptr() const {
    return static_cast<T*>(data);
  }
  // Sub-view of index i along dim 0 (drops that dim).
  TensorView select0(int64_t i) const;
};

// Owning tensor. Copies share the storage (like torch). Host storage is 64-byte aligned.
class Tensor {
 public:
  Tensor() = default;
  static Tensor empty(std::span<const int64_t> shape, DType dtype, Device device = {});
  static Tensor empty(std::initializer_list<int64_t> shape, DType dtype, Device device = {});
  static Tensor zeros(std::initializer_list<int64_t> shape, DType dtype, Device device = {});
  static Tensor zeros(std::span<const int64_t> shape, DType dtype, Device device = {});
  // A 0-d-like scalar stored as shape (1).
  static Tensor scalar_f32(float v);

  const TensorView& view() const { return view_; }
  operator const TensorView&() const { return view_; }
  bool defined() const { return view_.defined(); }
  void* data() const { return view_.data; }
  template <class T>
  T* ptr() const {
    return view_.ptr<T>();
  }
  DType dtype() const { return view_.dtype; }
  int ndim() const { return view_.ndim; }
  int64_t size(int d) const { return view_.size(d); }
  int64_t numel() const { return view_.numel(); }
  std::size_t nbytes() const { return view_.nbytes(); }
  Device device() const { return view_.device; }
  std::vector<int64_t> sizes() const { return view_.sizes(); }
  // Deep copy to another device (host<->cuda needs the CUDA build).
  Tensor to(Device device) const;
  Tensor clone() const { return to(view_.device); }

 private:
  std::shared_ptr<void> storage_;
  TensorView view_;
};

// Device memory hooks, installed by the CUDA module when it is built (nullptr otherwise).
struct DeviceAllocator {
  void* (*alloc)(std::size_t bytes, int device) = nullptr;
  void (*free)(void* p, int device) = nullptr;
  // kind: 0 = host->device, 1 = device->host, 2 = device->device
  void (*copy)(void* dst, const void* src, std::size_t bytes, int kind) = nullptr;
};
void set_device_allocator(const DeviceAllocator& a);
const DeviceAllocator& device_allocator();

}  // namespace fp8moe
