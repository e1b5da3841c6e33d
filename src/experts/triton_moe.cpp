// TRITON: TritonExperts (vLLM fused_moe/experts/triton_moe.py). fp8moe implementation:
// "cuda_fused".
#include "experts/experts_common.hpp"

namespace fp8moe::experts {
namespace {

bool device(const ExpertsContext& c) { return c.platform.is_cuda_alike() || c.platform.is_xpu(); }
bool no_act_and_mul(const ExpertsContext&) { return true; }
// Class override: moe_align_block_size needs fewer than 1024 padded experts (CUDA-alike only).
Support padded_experts(const ExpertsKernel&, const MoeConfig& config, const OptQuantKey&,
                       const OptQuantKey&, Support base, const ExpertsContext& c) {
  if (!base) return base;
  if (c.platform.is_cuda_alike()) {
    const int padded = (config.num_experts + 31) / 32 * 32;
    if (padded >= 1024)
      return Support::no("kernel's moe_align_block_size requires fewer than 1024 padded experts");
  }
  return base;
}

}  // namespace

bool triton_supports_quant_scheme(const OptQuantKey& w, const OptQuantKey& a,
                                  const ExpertsContext& c) {
  const Platform& p = c.platform;
  const auto& k = keys(c);
  if (in_pairs(w, a, {{std::nullopt, std::nullopt}})) return true;
  const bool int8 = (p.is_cuda() && p.has_device_capability(75)) || p.is_rocm() || p.is_xpu();
  if (int8 && in_pairs(w, a,
                       {{k.int8_static_channel, k.int8_dynamic_token},
                        {k.int8_static_tensor, k.int8_dynamic_tensor}}))
    return true;
  if (p.supports_fp8()) {
    if (in_pairs(w, a, {b128(k), ctok(k), ttok(k), tt(k), td(k)})) return true;
    // [N] Any static, symmetric, f32-scaled FP8 weight block (row > 1 and col > 1) with 1x128
    // dynamic activations: this is what admits the refined keys (64x64, 32x32) of
    // refine_fp8_moe_block_shape; Triton takes the block shape as a runtime argument.
    if (w && a == OptQuantKey(k.fp8_dynamic_128) && w->dtype == p.fp8_dtype() && w->symmetric &&
        w->scale.is_static && w->scale.dtype == KeyDType::kF32 && !w->scale2 &&
        w->scale.group_shape.row > 1 && w->scale.group_shape.col > 1)
      return true;
  }
  return false;
}

const ExpertsKernel kTritonExperts = {
    .name = "TritonExperts",
    .module = "fused_moe/experts/triton_moe.py",
    .format = ActivationFormat::kStandard,
    .supports_current_device = device,
    .supports_no_act_and_mul = no_act_and_mul,
    .supports_activation = any_activation_supported,
    .supports_quant_scheme = triton_supports_quant_scheme,
    .supports_parallel_config = not_fi_nvl,
    .supports_batch_invariance = true,
    .supports_lora = true,
    .extra = padded_experts,
    .impl_name = "cuda_fused",
    .summary = "fused MoE GEMMs with moe_align_block_size (any block shape; LoRA)",
};

}  // namespace fp8moe::experts
