// DEEPGEMM: TritonOrDeepGemmExperts = FallbackExperts(DeepGemmExperts, TritonExperts)
// (vLLM fused_moe/experts/triton_deep_gemm_moe.py, deep_gemm_moe.py, fallback.py).
// FallbackExperts ANDs device, no_act_and_mul, quant scheme, activation and parallel config of the
// two classes; everything else (routing, logits, shape, batch invariance, LoRA) keeps the base
// defaults, so LoRA is unsupported although TritonExperts supports it, and Triton's
// 1024-padded-experts check is not applied. fp8moe implementation: "cuda_grouped" (DeepGEMM side)
// with "cuda_fused" (the Triton fallback, used per call for small N).
#include "experts/experts_common.hpp"

namespace fp8moe::experts {
namespace {

// is_deep_gemm_supported() = envs.VLLM_USE_DEEP_GEMM and has_deep_gemm() and support_deep_gemm().
// The env var is evaluated first: a non-integer value raises ValueError here, as in vLLM.
bool dg_device(const ExpertsContext& c) {
  return c.env.use_deep_gemm() && c.platform.has(Feature::kDeepGemm) &&
         c.platform.support_deep_gemm();
}
bool dg_no_act(const ExpertsContext&) { return false; }
bool dg_activation(MoeActivation a, const ExpertsContext&) {
  return in_acts(
      a, {MoeActivation::kSilu, MoeActivation::kSwigluStep, MoeActivation::kSwigluOaiUninterleave});
}
bool dg_quant(const OptQuantKey& w, const OptQuantKey& a, const ExpertsContext& c) {
  const auto& k = keys(c);
  if (in_pairs(w, a, {b128(k)})) return true;
  return c.platform.is_device_capability_family(100) && in_pairs(w, a, {mx(k)});
}

bool and_device(const ExpertsContext& c) {
  return dg_device(c) && kTritonExperts.supports_current_device(c);
}
bool and_no_act(const ExpertsContext& c) {
  return dg_no_act(c) && kTritonExperts.supports_no_act_and_mul(c);
}
bool and_activation(MoeActivation a, const ExpertsContext& c) {
  return dg_activation(a, c) && kTritonExperts.supports_activation(a, c);
}
bool and_quant(const OptQuantKey& w, const OptQuantKey& a, const ExpertsContext& c) {
  return dg_quant(w, a, c) && triton_supports_quant_scheme(w, a, c);
}
bool and_parallel(const MoeParallelConfig& p, const ExpertsContext& c) {
  return not_fi_nvl(p, c) && kTritonExperts.supports_parallel_config(p, c);
}

}  // namespace

const ExpertsKernel kDeepGemmExperts = {
    .name = "DeepGemmExperts",
    .module = "fused_moe/experts/deep_gemm_moe.py",
    .format = ActivationFormat::kStandard,
    .supports_current_device = dg_device,
    .supports_no_act_and_mul = dg_no_act,
    .supports_activation = dg_activation,
    .supports_quant_scheme = dg_quant,
    .supports_parallel_config = not_fi_nvl,
    .summary =
        "DeepGEMM contiguous grouped GEMM (component of TritonOrDeepGemmExperts; not tried "
        "by the FP8 oracle on its own)",
};

const ExpertsKernel kTritonOrDeepGemmExperts = {
    .name = "TritonOrDeepGemmExperts",
    .module = "fused_moe/experts/triton_deep_gemm_moe.py",
    .format = ActivationFormat::kStandard,
    .supports_current_device = and_device,
    .supports_no_act_and_mul = and_no_act,
    .supports_activation = and_activation,
    .supports_quant_scheme = and_quant,
    .supports_parallel_config = and_parallel,
    .impl_name = "cuda_grouped",
    .fallback_impl_name = "cuda_fused",
    .summary = "DeepGEMM grouped GEMM, falling back to Triton per call (N <= 512 or unaligned)",
};

}  // namespace fp8moe::experts
