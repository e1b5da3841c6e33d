// BATCHED_DEEPGEMM: BatchedDeepGemmExperts (vLLM fused_moe/experts/batched_deep_gemm_moe.py).
// fp8moe implementation: "cuda_grouped_masked".
#include "experts/experts_common.hpp"

namespace fp8moe::experts {
namespace {

bool device(const ExpertsContext& c) {
  return c.env.use_deep_gemm() && c.platform.has(Feature::kDeepGemm) &&
         c.platform.support_deep_gemm();
}
bool activation(MoeActivation a, const ExpertsContext&) { return a == MoeActivation::kSilu; }
bool quant(const OptQuantKey& w, const OptQuantKey& a, const ExpertsContext& c) {
  return in_pairs(w, a, {b128(keys(c))});
}

}  // namespace

const ExpertsKernel kBatchedDeepGemmExperts = {
    .name = "BatchedDeepGemmExperts",
    .module = "fused_moe/experts/batched_deep_gemm_moe.py",
    .format = ActivationFormat::kBatchedExperts,
    .supports_current_device = device,
    .supports_no_act_and_mul = never,
    .supports_activation = activation,
    .supports_quant_scheme = quant,
    .supports_parallel_config = any_parallel,
    .impl_name = "cuda_grouped_masked",
    .summary = "DeepGEMM masked grouped GEMM on the batched (E, max_tokens, H) format",
};

}  // namespace fp8moe::experts
