// BATCHED_TRITON: BatchedTritonExperts (vLLM fused_moe/experts/fused_batched_moe.py).
// fp8moe implementation: "cuda_fused_batched".
#include "experts/experts_common.hpp"

namespace fp8moe::experts {
namespace {

bool device(const ExpertsContext& c) { return c.platform.is_cuda_alike() || c.platform.is_xpu(); }
bool no_act_and_mul(const ExpertsContext&) { return true; }
bool activation(MoeActivation a, const ExpertsContext&) {
  return in_acts(a,
                 {MoeActivation::kSilu, MoeActivation::kGelu, MoeActivation::kGeluTanh,
                  MoeActivation::kSwigluOai, MoeActivation::kSiluNoMul, MoeActivation::kGeluNoMul,
                  MoeActivation::kGeluTanhNoMul, MoeActivation::kRelu2NoMul});
}
bool quant(const OptQuantKey& w, const OptQuantKey& a, const ExpertsContext& c) {
  const Platform& p = c.platform;
  if (in_pairs(w, a, {{std::nullopt, std::nullopt}})) return true;
  const bool device_supports_fp8 = (p.is_rocm() && (p.cdna_version() > 2 || p.on_rdna4())) ||
                                   (p.is_cuda() && p.has_device_capability(89));
  const auto& k = keys(c);
  return device_supports_fp8 && in_pairs(w, a, {b128(k), ctok(k), ttok(k), tt(k), td(k)});
}

}  // namespace

const ExpertsKernel kBatchedTritonExperts = {
    .name = "BatchedTritonExperts",
    .module = "fused_moe/experts/fused_batched_moe.py",
    .format = ActivationFormat::kBatchedExperts,
    .supports_current_device = device,
    .supports_no_act_and_mul = no_act_and_mul,
    .supports_activation = activation,
    .supports_quant_scheme = quant,
    .supports_parallel_config = any_parallel,
    .impl_name = "cuda_fused_batched",
    .summary = "Triton GEMMs on the batched (E, max_tokens, H) format",
};

}  // namespace fp8moe::experts
