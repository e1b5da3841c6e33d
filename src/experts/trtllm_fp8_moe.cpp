// FLASHINFER_TRTLLM: TrtLlmFp8ExpertsMonolithic (tried first) and TrtLlmFp8ExpertsModular
// (vLLM fused_moe/experts/trtllm_fp8_moe.py; oracle.md §2.3). fp8moe has no implementation.
#include <fmt/format.h>

#include "experts/experts_common.hpp"
#include "fp8moe/error.hpp"

namespace fp8moe::experts {
namespace {

bool device(const ExpertsContext& c) {
  const Platform& p = c.platform;
  return p.is_cuda() && p.is_device_capability_family(100) && p.has(Feature::kFlashinferTrtllm);
}
// The docstring says "Does not support non-gated MoE" but the method returns True (sic).
bool no_act_and_mul(const ExpertsContext&) { return true; }
bool activation(MoeActivation a, const ExpertsContext&) {
  return in_acts(
      a, {MoeActivation::kSilu, MoeActivation::kSwigluOaiUninterleave, MoeActivation::kRelu2NoMul});
}
bool mono_quant(const OptQuantKey& w, const OptQuantKey& a, const ExpertsContext& c) {
  const auto& k = keys(c);
  return in_pairs(w, a, {b128(k), tt(k), mx(k)});
}
bool modular_quant(const OptQuantKey& w, const OptQuantKey& a, const ExpertsContext& c) {
  const auto& k = keys(c);
  return in_pairs(w, a, {b128(k), mx(k)});
}
// Monolithic kernel, so only naive DP/EP and TP.
bool mono_parallel(const MoeParallelConfig& p, const ExpertsContext&) {
  return (!p.use_all2all_kernels() || p.use_ag_rs_all2all_kernels()) &&
         !(p.enable_eplb || p.is_sequence_parallel());
}
bool modular_parallel(const MoeParallelConfig& p, const ExpertsContext&) {
  return (!p.use_all2all_kernels() || p.use_ag_rs_all2all_kernels() || p.use_deepep_v2_kernels() ||
          p.use_fi_nvl_one_sided_kernels() || p.use_fi_nvl_two_sided_kernels()) &&
         !p.enable_eplb;
}
bool mono_routing(RoutingMethodType r, const OptQuantKey& w, const OptQuantKey& a,
                  const ExpertsContext& c) {
  using R = RoutingMethodType;
  const auto& k = keys(c);
  const bool block_or_mx = in_pairs(w, a, {b128(k), mx(k)});
  const bool per_tensor = in_pairs(w, a, {tt(k)});
  if (!block_or_mx && !per_tensor) {
    // Unreachable after the quant-scheme check (check 4), as in vLLM.
    throw ValueError("Unsupported quantization scheme.");
  }
  const bool common = r == R::kDeepSeekV3 || r == R::kRenormalize || r == R::kRenormalizeNaive ||
                      r == R::kSigmoidRenorm || r == R::kSigmoid || r == R::kMiniMax2 ||
                      r == R::kSimulated;
  return common || (per_tensor && r == R::kLlama4);
}
bool mono_logits(std::optional<DType> d, RoutingMethodType, const ExpertsContext&) {
  return d && (*d == DType::kBF16 || *d == DType::kF32);
}
// Class override: at most 2048 experts. This reason has no "kernel does not support" prefix.
Support at_most_2048(const ExpertsKernel&, const MoeConfig& config, const OptQuantKey&,
                     const OptQuantKey&, Support base, const ExpertsContext&) {
  if (!base) return base;
  if (config.num_experts > 2048) {
    return Support::no(fmt::format(
        "FlashInfer TRTLLM routing supports at most 2048 experts, but got {}", config.num_experts));
  }
  return base;
}

}  // namespace

const ExpertsKernel kTrtLlmFp8ExpertsMonolithic = {
    .name = "TrtLlmFp8ExpertsMonolithic",
    .module = "fused_moe/experts/trtllm_fp8_moe.py",
    .format = ActivationFormat::kStandard,
    .supports_current_device = device,
    .supports_no_act_and_mul = no_act_and_mul,
    .supports_activation = activation,
    .supports_quant_scheme = mono_quant,
    .supports_parallel_config = mono_parallel,
    .supports_routing_method = mono_routing,
    .supports_router_logits_dtype = mono_logits,
    .extra = at_most_2048,
    .summary = "FlashInfer TRT-LLM-gen fused MoE with its own routing (SM10x)",
};

const ExpertsKernel kTrtLlmFp8ExpertsModular = {
    .name = "TrtLlmFp8ExpertsModular",
    .module = "fused_moe/experts/trtllm_fp8_moe.py",
    .format = ActivationFormat::kStandard,
    .supports_current_device = device,
    .supports_no_act_and_mul = no_act_and_mul,
    .supports_activation = activation,
    .supports_quant_scheme = modular_quant,
    .supports_parallel_config = modular_parallel,
    .extra = at_most_2048,
    .summary = "FlashInfer TRT-LLM-gen routed MoE (precomputed top-k; SM10x)",
};

}  // namespace fp8moe::experts
