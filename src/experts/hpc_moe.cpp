// HPC: HPCExperts (vLLM fused_moe/hpc_moe.py). fp8moe has no implementation.
#include "experts/experts_common.hpp"

namespace fp8moe::experts {
namespace {

bool device(const ExpertsContext& c) {
  return c.platform.is_cuda() && c.platform.is_device_capability(90) &&
         c.platform.has(Feature::kHpc);
}
bool silu(MoeActivation a, const ExpertsContext&) { return a == MoeActivation::kSilu; }
bool quant(const OptQuantKey& w, const OptQuantKey& a, const ExpertsContext& c) {
  const auto& k = keys(c);
  return in_pairs(w, a, {tt(k), b128(k)});
}
bool shape(int hidden_dim) { return hidden_dim % 128 == 0; }

}  // namespace

const ExpertsKernel kHPCExperts = {
    .name = "HPCExperts",
    .module = "fused_moe/hpc_moe.py",
    .format = ActivationFormat::kStandard,
    .supports_current_device = device,
    .supports_no_act_and_mul = never,
    .supports_activation = silu,
    .supports_quant_scheme = quant,
    .supports_parallel_config = any_parallel,
    .supports_shape = shape,
    .summary = "HPC fused MoE (SM90; hidden_dim % 128 == 0)",
};

}  // namespace fp8moe::experts
