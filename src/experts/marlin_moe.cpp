// MARLIN: MarlinExperts, W8A16 (vLLM fused_moe/experts/marlin_moe.py). fp8moe has no
// implementation.
#include "experts/experts_common.hpp"

namespace fp8moe::experts {
namespace {

bool device(const ExpertsContext& c) {
  return c.platform.is_cuda() && c.platform.has_device_capability(75);
}
bool no_act_and_mul(const ExpertsContext&) { return true; }
// The weight key only: the activation key is ignored (activations stay 16-bit).
bool quant(const OptQuantKey& w, const OptQuantKey&, const ExpertsContext& c) {
  if (!w) return false;
  const auto& k = keys(c);
  for (const QuantKey* x :
       {&k.fp8_static_128_block, &k.fp8_static_channel, &k.fp8_static_tensor, &k.mxfp4_static,
        &k.mxfp8_static, &k.nvfp4_static, &k.int4_static, &k.int8_static, &k.int4_static_32,
        &k.int4_static_asym, &k.int4_static_32_asym})
    if (*w == *x) return true;
  return false;
}
bool parallel(const MoeParallelConfig& p, const ExpertsContext&) {
  return !p.use_fi_nvl_two_sided_kernels();
}

}  // namespace

const ExpertsKernel kMarlinExperts = {
    .name = "MarlinExperts",
    .module = "fused_moe/experts/marlin_moe.py",
    .format = ActivationFormat::kStandard,
    .supports_current_device = device,
    .supports_no_act_and_mul = no_act_and_mul,
    .supports_activation = any_activation_supported,
    .supports_quant_scheme = quant,
    .supports_parallel_config = parallel,
    .supports_lora = true,
    .summary = "Marlin W8A16: 16-bit activations, weights dequantised in the kernel (SM75+)",
};

}  // namespace fp8moe::experts
