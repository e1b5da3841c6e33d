// XPU: XPUExpertsFp8, XPUExpertsMxFp8, XPUExpertsBlockFp8 (vLLM fused_moe/experts/xpu_moe.py).
// fp8moe has no implementation.
#include "experts/experts_common.hpp"

namespace fp8moe::experts {
namespace {

bool device(const ExpertsContext& c) { return c.platform.is_xpu(); }
bool activation(MoeActivation a, const ExpertsContext&) {
  return in_acts(a, {MoeActivation::kSilu, MoeActivation::kGelu, MoeActivation::kGeluTanh,
                     MoeActivation::kSwigluOai, MoeActivation::kRelu2NoMul});
}
bool fp8_quant(const OptQuantKey& w, const OptQuantKey& a, const ExpertsContext& c) {
  const auto& k = keys(c);
  return in_pairs(w, a, {{k.fp8_static_tensor, std::nullopt}, td(k)});
}
bool mxfp8_quant(const OptQuantKey& w, const OptQuantKey& a, const ExpertsContext& c) {
  const auto& k = keys(c);
  return in_pairs(w, a, {{k.mxfp8_static, std::nullopt}, mx(k)});
}
bool block_quant(const OptQuantKey& w, const OptQuantKey& a, const ExpertsContext& c) {
  return in_pairs(w, a, {b128(keys(c))});
}

}  // namespace

const ExpertsKernel kXPUExpertsFp8 = {
    .name = "XPUExpertsFp8",
    .module = "fused_moe/experts/xpu_moe.py",
    .format = ActivationFormat::kStandard,
    .supports_current_device = device,
    .supports_no_act_and_mul = always,
    .supports_activation = activation,
    .supports_quant_scheme = fp8_quant,
    .supports_parallel_config = any_parallel,
    .summary = "Intel XPU per-tensor FP8 MoE (Xe2/Xe3)",
};

const ExpertsKernel kXPUExpertsMxFp8 = {
    .name = "XPUExpertsMxFp8",
    .module = "fused_moe/experts/xpu_moe.py",
    .format = ActivationFormat::kStandard,
    .supports_current_device = device,
    .supports_no_act_and_mul = always,
    .supports_activation = activation,
    .supports_quant_scheme = mxfp8_quant,
    .supports_parallel_config = any_parallel,
    .summary = "Intel XPU MXFP8 MoE (Xe2/Xe3)",
};

const ExpertsKernel kXPUExpertsBlockFp8 = {
    .name = "XPUExpertsBlockFp8",
    .module = "fused_moe/experts/xpu_moe.py",
    .format = ActivationFormat::kStandard,
    .supports_current_device = device,
    .supports_no_act_and_mul = always,
    .supports_activation = activation,
    .supports_quant_scheme = block_quant,
    .supports_parallel_config = any_parallel,
    .summary = "Intel XPU block FP8 MoE (Xe2/Xe3)",
};

}  // namespace fp8moe::experts
