// MoeQuantConfig names: quant_dtype_name, config_name (vLLM's tuned-config key) and a Python-like
// describe() for the CLI and traces.
#include "fp8moe/quant_config.hpp"

#include <fmt/format.h>

namespace fp8moe {

std::string_view quant_dtype_name(QuantDType t) {
  switch (t) {
    case QuantDType::kFp8E4M3FN:
      return "torch.float8_e4m3fn";
    case QuantDType::kFp8E4M3FNUZ:
      return "torch.float8_e4m3fnuz";
    case QuantDType::kInt8:
      return "torch.int8";
    case QuantDType::kMxfp8:
      return "mxfp8";
    case QuantDType::kMxfp4:
      return "mxfp4";
    case QuantDType::kNvfp4:
      return "nvfp4";
    case QuantDType::kMxfp6E3M2:
      return "mxfp6_e3m2";
    case QuantDType::kMxfp6E2M3:
      return "mxfp6_e2m3";
    case QuantDType::kInt4:
      return "int4";
  }
  return "?";
}

namespace {
bool is_fp8(std::optional<QuantDType> d) {
  return d == QuantDType::kFp8E4M3FN || d == QuantDType::kFp8E4M3FNUZ;
}
bool is_ocp_mx(std::optional<QuantDType> d) {
  return d == QuantDType::kMxfp4 || d == QuantDType::kMxfp8 || d == QuantDType::kMxfp6E3M2 ||
         d == QuantDType::kMxfp6E2M3;
}
std::string opt_dtype(std::optional<QuantDType> d) {
  return d ? std::string(quant_dtype_name(*d)) : std::string("None");
}
std::string opt_shape(const std::optional<GroupShape>& s) { return s ? s->str() : "None"; }
// Python's repr of a float: shortest round-trip digits, ".0" for integral values.
std::string opt_float(std::optional<double> v) {
  if (!v) return "None";
  std::string s = fmt::format("{}", *v);
  if (s.find_first_of(".eEn") == std::string::npos) s += ".0";
  return s;
}
std::string desc_str(const MoeQuantDesc& d) {
  return fmt::format(
      "FusedMoEQuantDesc(dtype={}, shape={}, scale={}, alpha_or_gscale={}, zp={}, bias={})",
      opt_dtype(d.dtype), opt_shape(d.shape), d.scale.view().describe(),
      d.alpha_or_gscale.view().describe(), d.zp.view().describe(), d.bias.view().describe());
}
}  // namespace

std::string MoeQuantConfig::config_name(DType act_dtype) const {
  if (is_fp8(a1.dtype)) return "fp8_w8a8";
  if (!a1.dtype && is_fp8(w1.dtype)) return "fp8_w8a16";
  if (!a1.dtype && w1.dtype == QuantDType::kInt8) return "int8_w8a16";
  if (!a1.dtype && w1.dtype == QuantDType::kInt4) return "int4_w4a16";
  if (is_ocp_mx(a1.dtype) || is_ocp_mx(w1.dtype)) return "";  // ocp_mx_scheme -> None
  if (act_dtype == DType::kF32) return "float32";
  return "";
}

std::string MoeQuantConfig::describe() const {
  std::string bs = "None";
  if (auto b = block_shape()) bs = fmt::format("[{}, {}]", (*b)[0], (*b)[1]);
  return fmt::format(
      "FusedMoEQuantConfig(quant_dtype={}, weight_quant_dtype={}, block_shape={}, "
      "per_act_token_quant={}, per_out_ch_quant={}, is_per_tensor={}, is_scale_swizzled={}, "
      "gemm1_alpha={}, gemm1_beta={}, gemm1_clamp_limit={}, mx_alignment={}, _a1={}, _a2={}, "
      "_w1={}, _w2={})",
      opt_dtype(quant_dtype()), opt_dtype(weight_quant_dtype()), bs,
      per_act_token_quant() ? "True" : "False", per_out_ch_quant() ? "True" : "False",
      is_per_tensor() ? "True" : "False", is_scale_swizzled ? "True" : "False",
      opt_float(gemm1_alpha), opt_float(gemm1_beta), opt_float(gemm1_clamp_limit), mx_alignment,
      desc_str(a1), desc_str(a2), desc_str(w1), desc_str(w2));
}

}  // namespace fp8moe
