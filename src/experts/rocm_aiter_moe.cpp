// AITER: AiterExperts (vLLM fused_moe/experts/rocm_aiter_moe.py). fp8moe has no implementation.
#include "experts/experts_common.hpp"

namespace fp8moe::experts {
namespace {

// rocm_aiter_ops.is_fused_moe_enabled(): @if_aiter_supported (ROCm, CDNA3+, aiter importable;
// otherwise None, which is falsy) and _AITER_ENABLED and _FMOE_ENABLED (the env vars).
bool fused_moe_enabled(const ExpertsContext& c) {
  const Platform& p = c.platform;
  if (!(p.is_rocm() && p.cdna_version() > 2 && p.has(Feature::kAiter))) return false;
  return c.env.rocm_use_aiter() && c.env.rocm_use_aiter_moe();
}
bool activation(MoeActivation a, const ExpertsContext&) {
  return in_acts(a, {MoeActivation::kSilu, MoeActivation::kGelu, MoeActivation::kSitu,
                     MoeActivation::kSwigluOai, MoeActivation::kSwigluOaiUninterleave});
}
bool quant(const OptQuantKey& w, const OptQuantKey& a, const ExpertsContext& c) {
  const auto& k = keys(c);
  if (in_pairs(w, a, {{std::nullopt, std::nullopt}, b128(k), tt(k), td(k), ctok(k)})) return true;
  const bool mxfp4 = c.platform.on_gfx950() && !c.platform.on_gfx1250();
  return mxfp4 &&
         in_pairs(w, a, {{k.mxfp4_static, std::nullopt}, {k.mxfp4_static, k.mxfp4_dynamic}});
}
// Class override: a rejection while AITER MoE is disabled says how to enable it.
Support hint(const ExpertsKernel&, const MoeConfig&, const OptQuantKey&, const OptQuantKey&,
             Support base, const ExpertsContext& c) {
  if (!base && !fused_moe_enabled(c)) {
    base.reason +=
        ". AITER MoE is not enabled \xE2\x80\x94 set VLLM_ROCM_USE_AITER=1 and "
        "VLLM_ROCM_USE_AITER_MOE=1 to enable it";
  }
  return base;
}

}  // namespace

const ExpertsKernel kAiterExperts = {
    .name = "AiterExperts",
    .module = "fused_moe/experts/rocm_aiter_moe.py",
    .format = ActivationFormat::kStandard,
    .supports_current_device = fused_moe_enabled,
    .supports_no_act_and_mul = never,
    .supports_activation = activation,
    .supports_quant_scheme = quant,
    .supports_parallel_config = not_fi_nvl,
    .extra = hint,
    .summary = "ROCm AITER CK fused MoE (CDNA3+, VLLM_ROCM_USE_AITER=1)",
};

}  // namespace fp8moe::experts
