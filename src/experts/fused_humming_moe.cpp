// HUMMING: BatchedHummingGroupedExperts, HummingGroupedExperts, HummingIndexedExperts (vLLM
// fused_moe/experts/fused_humming_moe.py). fp8moe has no implementation.
#include <fmt/format.h>

#include <cctype>

#include "experts/experts_common.hpp"
#include "fp8moe/log.hpp"

namespace fp8moe::experts {
namespace {

bool device(const ExpertsContext& c) {
  const Platform& p = c.platform;
  return p.has(Feature::kHumming) && p.is_cuda() && p.has_device_capability(75);
}
bool no_act_and_mul(const ExpertsContext&) { return true; }
// vLLM's fused_humming_moe.py spells the activations out instead of calling
// apply_moe_activation_supported (spec/oracle.md §2.3 summarises it that way): the explicit list
// has no SITU. fp8moe follows the source; tests/py/oracle_model.py (HummingExpertsBase) records the
// same reading, so the differential test does not decide it: this is a deliberate choice.
bool activation(MoeActivation a, const ExpertsContext&) {
  return in_acts(a,
                 {MoeActivation::kSilu, MoeActivation::kGelu, MoeActivation::kGeluTanh,
                  MoeActivation::kSwigluOai, MoeActivation::kSwigluOaiUninterleave,
                  MoeActivation::kSwigluStep, MoeActivation::kSiluNoMul, MoeActivation::kGeluNoMul,
                  MoeActivation::kGeluTanhNoMul, MoeActivation::kRelu2NoMul});
}
// Humming quantises inputs itself; the list is the checkpoint-driven (W, A) pairs vLLM passes.
bool quant(const OptQuantKey& w, const OptQuantKey& a, const ExpertsContext& c) {
  const auto& k = keys(c);
  const OptQuantKey none;
  return in_pairs(w, a,
                  {{k.mxfp4_static, none},
                   {k.mxfp4_static, k.mxfp4_dynamic},
                   {k.mxfp4_static, k.mxfp8_dynamic},
                   {k.mxfp4_static, k.fp8_dynamic_token},
                   {k.nvfp4_static, none},
                   {k.nvfp4_static, k.fp8_dynamic_token},
                   {k.mxfp8_static, none},
                   {k.mxfp8_static, k.fp8_dynamic_token},
                   {k.fp8_static_channel, none},
                   {k.fp8_static_channel, k.fp8_dynamic_token},
                   {k.fp8_static_128_block, none},
                   {k.fp8_static_128_block, k.fp8_dynamic_token},
                   {k.int4_static, none},
                   {k.int4_static, k.fp8_dynamic_token},
                   {k.int8_static, none},
                   {k.int8_static, k.fp8_dynamic_token},
                   {k.fp8_static_channel, k.fp8_static_tensor},
                   {k.fp8_static_channel, k.fp8_dynamic_128},
                   {k.fp8_static_tensor, none},
                   {k.fp8_static_tensor, k.fp8_dynamic_token},
                   {k.fp8_static_tensor, k.fp8_static_tensor},
                   {k.fp8_static_tensor, k.fp8_dynamic_128},
                   {k.fp8_static_128_block, k.fp8_dynamic_128},
                   {k.int8_static_channel, none},
                   {k.int8_static_channel, k.int8_dynamic_token},
                   {k.nvfp4_static, k.nvfp4_dynamic},
                   {k.mxfp8_static, k.mxfp8_dynamic}});
}

// get_humming_moe_gemm_type(): VLLM_HUMMING_MOE_GEMM_TYPE lower-cased; "indexed" -> indexed,
// "grouped" or "grouped_contiguous" -> grouped_contiguous, unset or anything else -> indexed.
std::string preferred_gemm_type(const ExpertsContext& c) {
  std::string gemm_type = "indexed";
  if (auto v = c.env.humming_moe_gemm_type()) {
    std::string s = *v;
    for (auto& ch : s) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
    if (s == "grouped_contiguous" || s == "grouped") gemm_type = "grouped_contiguous";
  }
  info_once(fmt::format("Using {} gemm for humming moe", gemm_type));
  return gemm_type;
}

template <const char* kGemmType>
Support gemm_type_check(const ExpertsKernel&, const MoeConfig&, const OptQuantKey&,
                        const OptQuantKey&, Support base, const ExpertsContext& c) {
  if (!base) return base;
  const std::string preferred = preferred_gemm_type(c);
  if (preferred != kGemmType) {
    return Support::no(
        fmt::format("preferred gemm type {} != supported gemm type {}", preferred, kGemmType));
  }
  return base;
}

constexpr char kGroupedMasked[] = "grouped_masked";
constexpr char kGroupedContiguous[] = "grouped_contiguous";
constexpr char kIndexed[] = "indexed";

}  // namespace

const ExpertsKernel kBatchedHummingGroupedExperts = {
    .name = "BatchedHummingGroupedExperts",
    .module = "fused_moe/experts/fused_humming_moe.py",
    .format = ActivationFormat::kBatchedExperts,
    .supports_current_device = device,
    .supports_no_act_and_mul = no_act_and_mul,
    .supports_activation = activation,
    .supports_quant_scheme = quant,
    .supports_parallel_config = any_parallel,
    .supports_batch_invariance = true,
    .extra = gemm_type_check<kGroupedMasked>,
    .summary = "Humming grouped-masked GEMM on the batched format (gemm type grouped_masked)",
};

const ExpertsKernel kHummingGroupedExperts = {
    .name = "HummingGroupedExperts",
    .module = "fused_moe/experts/fused_humming_moe.py",
    .format = ActivationFormat::kStandard,
    .supports_current_device = device,
    .supports_no_act_and_mul = no_act_and_mul,
    .supports_activation = activation,
    .supports_quant_scheme = quant,
    .supports_parallel_config = any_parallel,
    .supports_batch_invariance = true,
    .extra = gemm_type_check<kGroupedContiguous>,
    .summary = "Humming grouped-contiguous GEMM (gemm type grouped_contiguous)",
};

const ExpertsKernel kHummingIndexedExperts = {
    .name = "HummingIndexedExperts",
    .module = "fused_moe/experts/fused_humming_moe.py",
    .format = ActivationFormat::kStandard,
    .supports_current_device = device,
    .supports_no_act_and_mul = no_act_and_mul,
    .supports_activation = activation,
    .supports_quant_scheme = quant,
    .supports_parallel_config = any_parallel,
    .supports_batch_invariance = true,
    .extra = gemm_type_check<kIndexed>,
    .summary = "Humming indexed GEMM (gemm type indexed, the default)",
};

}  // namespace fp8moe::experts
