// Core vocabulary: dtypes, tensor views, owning tensors, the logger.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "fp8moe/dtype.hpp"
#include "fp8moe/error.hpp"
#include "fp8moe/log.hpp"
#include "fp8moe/tensor.hpp"

namespace fp8moe {
namespace {

TEST(DType, NamesAndSizes) {
  EXPECT_EQ(dtype_abbr(DType::kF8E4M3FN), "f8e4m3fn");
  EXPECT_EQ(dtype_torch_name(DType::kBF16), "torch.bfloat16");
  EXPECT_EQ(dtype_size(DType::kBF16), 2u);
  EXPECT_EQ(parse_dtype("torch.float32"), DType::kF32);
  EXPECT_EQ(parse_dtype("BF16"), DType::kBF16);
  EXPECT_THROW(parse_dtype("bf17"), ValueError);
}

TEST(Tensor, ContiguousViewAndSelect) {
  Tensor t = Tensor::zeros({2, 3, 4}, DType::kF32);
  EXPECT_EQ(t.numel(), 24);
  EXPECT_TRUE(t.view().is_contiguous());
  TensorView s = t.view().select0(1);
  EXPECT_EQ(s.ndim, 2);
  EXPECT_EQ(s.ptr<float>() - t.ptr<float>(), 12);
  EXPECT_THROW(t.view().select0(2), ValueError);
  EXPECT_EQ(t.view().describe(), "(2, 3, 4) f32 cpu");
  Tensor c = t.clone();
  EXPECT_NE(c.data(), t.data());
}

TEST(Tensor, DeviceWithoutCudaHooksIsAClearError) {
  if (device_allocator().alloc) GTEST_SKIP() << "CUDA hooks installed";
  EXPECT_THROW(Tensor::empty({4}, DType::kF32, Device::cuda(0)), RuntimeError);
}

TEST(Log, OnceMessagesPrintOnce) {
  std::vector<std::string> got;
  set_log_sink([&](LogLevel, std::string_view m) { got.emplace_back(m); });
  const LogLevel old = log_level();
  set_log_level(LogLevel::kDebug);
  reset_log_once();
  info_once("a");
  info_once("a");
  debug_once("b");
  set_log_level(LogLevel::kWarning);
  info_once("c");
  set_log_level(old);
  set_log_sink(nullptr);
  EXPECT_EQ(got, (std::vector<std::string>{"a", "b"}));
}

}  // namespace
}  // namespace fp8moe
