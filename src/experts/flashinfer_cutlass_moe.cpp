// FLASHINFER_CUTLASS: FlashInferExperts (vLLM fused_moe/experts/flashinfer_cutlass_moe.py).
// fp8moe has no implementation.
#include "experts/experts_common.hpp"

namespace fp8moe::experts {
namespace {

// SM90, SM10x or SM12x (SM110 excluded).
bool device(const ExpertsContext& c) {
  const Platform& p = c.platform;
  return p.is_cuda() &&
         (p.is_device_capability(90) || p.is_device_capability_family(100) ||
          p.is_device_capability_family(120)) &&
         p.has(Feature::kFlashinferCutlass);
}
bool no_act_and_mul(const ExpertsContext&) { return true; }
bool activation(MoeActivation a, const ExpertsContext&) {
  return in_acts(a, {MoeActivation::kSilu, MoeActivation::kGeluTanh, MoeActivation::kRelu2NoMul,
                     MoeActivation::kSwigluOai, MoeActivation::kSwigluOaiUninterleave});
}
// Block FP8 only on exactly SM90; per-tensor from SM90; FP4 from SM100.
bool quant(const OptQuantKey& w, const OptQuantKey& a, const ExpertsContext& c) {
  const Platform& p = c.platform;
  const auto& k = keys(c);
  if (p.has_device_capability(90) && in_pairs(w, a, {{std::nullopt, std::nullopt}, tt(k)}))
    return true;
  if (p.is_device_capability(90) && in_pairs(w, a, {b128(k), {k.mxfp4_static, std::nullopt}}))
    return true;
  if (p.has_device_capability(100) &&
      in_pairs(w, a, {{k.mxfp4_static, k.mxfp8_dynamic}, {k.nvfp4_static, k.nvfp4_dynamic}}))
    return true;
  return false;
}

}  // namespace

const ExpertsKernel kFlashInferExperts = {
    .name = "FlashInferExperts",
    .module = "fused_moe/experts/flashinfer_cutlass_moe.py",
    .format = ActivationFormat::kStandard,
    .supports_current_device = device,
    .supports_no_act_and_mul = no_act_and_mul,
    .supports_activation = activation,
    .supports_quant_scheme = quant,
    .supports_parallel_config = any_parallel,
    .summary = "FlashInfer CUTLASS fused MoE (block FP8 on SM90 only; per-tensor from SM90)",
};

}  // namespace fp8moe::experts
