// VLLM_CUTLASS: TritonOrCutlassExperts = FallbackExperts(CutlassExpertsFp8, TritonExperts), and
// BATCHED_VLLM_CUTLASS: CutlassBatchedExpertsFp8 (vLLM fused_moe/experts/triton_cutlass_moe.py,
// cutlass_moe.py). Reachable only with allow_vllm_cutlass. fp8moe has no implementation.
#include "experts/experts_common.hpp"

namespace fp8moe::experts {
namespace {

// cutlass_group_gemm_supported(): CUDA, 90 <= capability < 110, and vLLM's op built for it.
bool device(const ExpertsContext& c) {
  const Platform& p = c.platform;
  return p.is_cuda() && p.capability() >= 90 && p.capability() < 110 &&
         p.has(Feature::kCutlassGroupGemm);
}
bool no_act(const ExpertsContext&) { return false; }
bool quant(const OptQuantKey& w, const OptQuantKey& a, const ExpertsContext& c) {
  const auto& k = keys(c);
  return in_pairs(w, a, {ctok(k), td(k), tt(k)});
}
bool activation(MoeActivation a, const ExpertsContext&) {
  return activation_is_gated(a) && apply_moe_activation_supported(a);
}
bool parallel(const MoeParallelConfig& p, const ExpertsContext&) {
  return !(p.use_fi_nvl_two_sided_kernels() || p.use_deepep_ht_kernels() ||
           p.use_fi_nvl_one_sided_kernels());
}

bool and_device(const ExpertsContext& c) {
  return device(c) && kTritonExperts.supports_current_device(c);
}
bool and_no_act(const ExpertsContext& c) {
  return no_act(c) && kTritonExperts.supports_no_act_and_mul(c);
}
bool and_activation(MoeActivation a, const ExpertsContext& c) {
  return activation(a, c) && kTritonExperts.supports_activation(a, c);
}
bool and_quant(const OptQuantKey& w, const OptQuantKey& a, const ExpertsContext& c) {
  return quant(w, a, c) && triton_supports_quant_scheme(w, a, c);
}
bool and_parallel(const MoeParallelConfig& p, const ExpertsContext& c) {
  return parallel(p, c) && kTritonExperts.supports_parallel_config(p, c);
}

}  // namespace

const ExpertsKernel kCutlassExpertsFp8 = {
    .name = "CutlassExpertsFp8",
    .module = "fused_moe/experts/cutlass_moe.py",
    .format = ActivationFormat::kStandard,
    .supports_current_device = device,
    .supports_no_act_and_mul = no_act,
    .supports_activation = activation,
    .supports_quant_scheme = quant,
    .supports_parallel_config = parallel,
    .summary =
        "vLLM CUTLASS grouped GEMM, per-tensor / per-channel FP8 (component of "
        "TritonOrCutlassExperts; not tried by the FP8 oracle on its own)",
};

const ExpertsKernel kTritonOrCutlassExperts = {
    .name = "TritonOrCutlassExperts",
    .module = "fused_moe/experts/triton_cutlass_moe.py",
    .format = ActivationFormat::kStandard,
    .supports_current_device = and_device,
    .supports_no_act_and_mul = and_no_act,
    .supports_activation = and_activation,
    .supports_quant_scheme = and_quant,
    .supports_parallel_config = and_parallel,
    .summary = "vLLM CUTLASS grouped GEMM with a Triton fallback (SM100 with M <= 8)",
};

const ExpertsKernel kCutlassBatchedExpertsFp8 = {
    .name = "CutlassBatchedExpertsFp8",
    .module = "fused_moe/experts/cutlass_moe.py",
    .format = ActivationFormat::kBatchedExperts,
    .supports_current_device = device,
    .supports_no_act_and_mul = no_act,
    .supports_activation = activation,
    .supports_quant_scheme = quant,
    .supports_parallel_config = any_parallel,
    .summary = "vLLM CUTLASS grouped GEMM on the batched format",
};

}  // namespace fp8moe::experts
