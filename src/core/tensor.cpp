// TensorView helpers and the owning Tensor (aligned host storage; device storage through the hooks
// the CUDA module installs).
#include "fp8moe/tensor.hpp"

#include <fmt/format.h>

#include <cstdlib>
#include <cstring>
#include <new>

#include "fp8moe/error.hpp"

namespace fp8moe {

std::string Device::str() const { return is_cpu() ? "cpu" : fmt::format("cuda:{}", index); }

namespace {
void set_contiguous(TensorView& v, std::span<const int64_t> shape) {
  if (shape.size() > static_cast<std::size_t>(kMaxDims)) {
    throw ValueError(
        fmt::format("tensor rank {} exceeds the maximum of {}", shape.size(), kMaxDims));
  }
  v.ndim = static_cast<int>(shape.size());
  int64_t stride = 1;
  for (int d = v.ndim - 1; d >= 0; --d) {
    if (shape[d] < 0) throw ValueError(fmt::format("negative tensor dimension {}", shape[d]));
    v.shape[d] = shape[d];
    v.strides[d] = stride;
    stride *= shape[d];
  }
}
}  // namespace

TensorView::TensorView(void* data_, DType dtype_, std::initializer_list<int64_t> shape_, Device dev)
    : TensorView(data_, dtype_, std::span<const int64_t>(shape_.begin(), shape_.size()), dev) {}

TensorView::TensorView(void* data_, DType dtype_, std::span<const int64_t> shape_, Device dev)
    : data(data_), dtype(dtype_), device(dev) {
  set_contiguous(*this, shape_);
}

int64_t TensorView::numel() const {
  if (ndim == 0) return data ? 1 : 0;
  int64_t n = 1;
  for (int d = 0; d < ndim; ++d) n *= shape[d];
  return n;
}

bool TensorView::is_contiguous() const {
  int64_t stride = 1;
  for (int d = ndim - 1; d >= 0; --d) {
    if (shape[d] != 1 && strides[d] != stride) return false;
    stride *= shape[d];
  }
  return true;
}

std::string TensorView::describe() const {
  if (!defined()) return "None";
  std::string s = "(";
  for (int d = 0; d < ndim; ++d) s += fmt::format("{}{}", d ? ", " : "", shape[d]);
  if (ndim == 1) s += ",";
  s += fmt::format(") {} {}", dtype_name(dtype), device.str());
  return s;
}

TensorView TensorView::select0(int64_t i) const {
  if (ndim < 1 || i < 0 || i >= shape[0]) {
    throw ValueError(fmt::format("select0({}) out of range for tensor {}", i, describe()));
  }
  TensorView v = *this;
  v.data = static_cast<char*>(data) + i * strides[0] * static_cast<int64_t>(dtype_size(dtype));
  for (int d = 1; d < ndim; ++d) {
    v.shape[d - 1] = shape[d];
    v.strides[d - 1] = strides[d];
  }
  v.ndim = ndim - 1;
  return v;
}

namespace {
DeviceAllocator g_device_allocator;
}
void set_device_allocator(const DeviceAllocator& a) { g_device_allocator = a; }
const DeviceAllocator& device_allocator() { return g_device_allocator; }

Tensor Tensor::empty(std::span<const int64_t> shape, DType dtype, Device device) {
  Tensor t;
  t.view_ = TensorView(nullptr, dtype, shape, device);
  const std::size_t bytes = std::max<std::size_t>(t.view_.nbytes(), 1);
  if (device.is_cpu()) {
    const std::size_t rounded = (bytes + 63) / 64 * 64;
    void* p = std::aligned_alloc(64, rounded);
    if (!p) throw RuntimeError(fmt::format("host allocation of {} bytes failed", rounded));
    t.storage_ = std::shared_ptr<void>(p, [](void* q) { std::free(q); });
  } else {
    const auto& a = device_allocator();
    if (!a.alloc) {
      throw RuntimeError(fmt::format(
          "cannot allocate a tensor on {}: this fp8moe build has no CUDA support", device.str()));
    }
    void* p = a.alloc(bytes, device.index);
    const int idx = device.index;
    t.storage_ = std::shared_ptr<void>(p, [idx](void* q) { device_allocator().free(q, idx); });
  }
  t.view_.data = t.storage_.get();
  return t;
}

Tensor Tensor::empty(std::initializer_list<int64_t> shape, DType dtype, Device device) {
  return empty(std::span<const int64_t>(shape.begin(), shape.size()), dtype, device);
}

Tensor Tensor::zeros(std::span<const int64_t> shape, DType dtype, Device device) {
  Tensor t = empty(shape, dtype, device);
  if (device.is_cpu()) {
    std::memset(t.data(), 0, t.nbytes());
  } else {
    Tensor host = zeros(shape, dtype);
    device_allocator().copy(t.data(), host.data(), t.nbytes(), 0);
  }
  return t;
}

Tensor Tensor::zeros(std::initializer_list<int64_t> shape, DType dtype, Device device) {
  return zeros(std::span<const int64_t>(shape.begin(), shape.size()), dtype, device);
}

Tensor Tensor::scalar_f32(float v) {
  Tensor t = empty({1}, DType::kF32);
  *t.ptr<float>() = v;
  return t;
}

Tensor Tensor::to(Device device) const {
  if (!defined()) return {};
  if (!view_.is_contiguous()) throw ValueError("Tensor::to needs a contiguous tensor");
  auto shape = sizes();
  Tensor out = empty(std::span<const int64_t>(shape), view_.dtype, device);
  const std::size_t n = nbytes();
  if (n == 0) return out;
  if (view_.device.is_cpu() && device.is_cpu()) {
    std::memcpy(out.data(), data(), n);
    return out;
  }
  const auto& a = device_allocator();
  if (!a.copy)
    throw RuntimeError("device copy requested but this fp8moe build has no CUDA support");
  const int kind = view_.device.is_cpu() ? 0 : (device.is_cpu() ? 1 : 2);
  a.copy(out.data(), data(), n, kind);
  return out;
}

}  // namespace fp8moe
