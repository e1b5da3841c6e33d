// vLLM's FusedMoEQuantDesc / FusedMoEQuantConfig (fused_moe/config.py): how the activations and
// weights of both GEMMs are quantised, with the runtime scale tensors, and the SwiGLU parameters of
// GEMM1's activation. make_fp8_moe_quant_config (oracle.hpp) builds one per backend.
#pragma once

#include <array>
#include <optional>
#include <string>
#include <vector>

#include "fp8moe/quant_key.hpp"
#include "fp8moe/tensor.hpp"

namespace fp8moe {

// The quantisation dtype of a descriptor: a torch dtype or one of vLLM's string dtypes.
enum class QuantDType : uint8_t {
  kFp8E4M3FN,
  kFp8E4M3FNUZ,
  kInt8,
  kMxfp8,  // "mxfp8"
  kMxfp4,  // "mxfp4"
  kNvfp4,  // "nvfp4"
  kMxfp6E3M2,
  kMxfp6E2M3,
  kInt4,  // "int4" (weight_dtype only)
};
std::string_view quant_dtype_name(QuantDType t);  // "torch.float8_e4m3fn", "mxfp8", ...

struct MoeQuantDesc {
  std::optional<QuantDType> dtype{};  // None: not quantised (W8A16 activations)
  std::optional<GroupShape> shape{};  // None / PER_TENSOR / PER_TOKEN / (bn, bk) block
  Tensor scale{};                     // runtime scale tensor (weights: block/tensor/channel scales)
  Tensor alpha_or_gscale{};           // g*_alphas for weights, a*_gscale for activations
  Tensor zp{};
  Tensor bias{};
};

struct MoeQuantConfig {
  MoeQuantDesc a1{}, a2{}, w1{}, w2{};
  bool is_scale_swizzled = true;
  std::optional<double> gemm1_alpha{};
  std::optional<double> gemm1_beta{};
  std::optional<double> gemm1_clamp_limit{};
  int mx_alignment = 0;

  std::optional<QuantDType> quant_dtype() const { return a1.dtype; }
  std::optional<QuantDType> weight_quant_dtype() const { return w1.dtype; }
  bool per_act_token_quant() const { return a1.shape && a1.shape->is_per_token(); }
  // Per-output-channel weights are encoded with the (1, -1) shape, as in vLLM.
  bool per_out_ch_quant() const { return w1.shape && w1.shape->is_per_token(); }
  bool is_per_tensor() const { return a1.shape && a1.shape->is_per_tensor(); }
  // Derived from the activation descriptor: None for per-tensor/per-token and for W8A16.
  std::optional<std::vector<int64_t>> block_shape() const {
    if (!a1.shape || a1.shape->is_per_tensor() || a1.shape->is_per_token()) return std::nullopt;
    return std::vector<int64_t>{a1.shape->row, a1.shape->col};
  }
  const Tensor& a1_scale() const { return a1.scale; }
  const Tensor& a2_scale() const { return a2.scale; }
  const Tensor& w1_scale() const { return w1.scale; }
  const Tensor& w2_scale() const { return w2.scale; }
  const Tensor& a1_gscale() const { return a1.alpha_or_gscale; }
  const Tensor& a2_gscale() const { return a2.alpha_or_gscale; }
  const Tensor& g1_alphas() const { return w1.alpha_or_gscale; }
  const Tensor& g2_alphas() const { return w2.alpha_or_gscale; }
  const Tensor& w1_bias() const { return w1.bias; }
  const Tensor& w2_bias() const { return w2.bias; }
  bool use_fp8_w8a8(QuantDType platform_fp8 = QuantDType::kFp8E4M3FN) const {
    return a1.dtype == platform_fp8;
  }
  bool use_fp8_w8a16(QuantDType platform_fp8 = QuantDType::kFp8E4M3FN) const {
    return !a1.dtype && w1.dtype == platform_fp8;
  }
  bool use_mxfp8() const { return a1.dtype == QuantDType::kMxfp8; }
  bool use_int8_w8a8() const { return a1.dtype == QuantDType::kInt8; }
  bool use_int8_w8a16() const { return !a1.dtype && w1.dtype == QuantDType::kInt8; }
  bool use_int4_w4a16() const { return !a1.dtype && w1.dtype == QuantDType::kInt4; }
  bool use_nvfp4_w4a4() const { return a1.dtype == QuantDType::kNvfp4; }
  bool use_mxfp4_w4a4() const {
    return a1.dtype == QuantDType::kMxfp4 && w1.dtype == QuantDType::kMxfp4;
  }
  bool use_mxfp4_w4a16() const { return !a1.dtype && w1.dtype == QuantDType::kMxfp4; }
  const Tensor& w1_zp() const { return w1.zp; }
  const Tensor& w2_zp() const { return w2.zp; }
  bool is_quantized() const { return a1.dtype.has_value(); }
  bool is_block_quantized() const { return block_shape().has_value(); }
  // Activation-scale shape for max_tokens rows of hidden_dim: block (T, ceil(hidden / block_k)),
  // per-token (T, 1), otherwise (1, 1); None when the activations are not quantised.
  std::optional<std::array<int64_t, 2>> scale_shape(int64_t max_tokens, int64_t hidden_dim) const {
    if (!is_quantized()) return std::nullopt;
    if (auto b = block_shape())
      return std::array<int64_t, 2>{max_tokens, (hidden_dim + (*b)[1] - 1) / (*b)[1]};
    if (per_act_token_quant()) return std::array<int64_t, 2>{max_tokens, 1};
    return std::array<int64_t, 2>{1, 1};
  }
  // "fp8_w8a8", "fp8_w8a16", ... or "" (None) as vLLM's config_name(dtype).
  std::string config_name(DType act_dtype) const;
  // Python-like repr for the CLI and traces (tensors printed as shape/dtype).
  std::string describe() const;
};

}  // namespace fp8moe
