// CPU: CPUExpertsFp8 (vLLM fused_moe/experts/cpu_moe.py), W8A16, fp8moe implementation "cpu_w8a16";
// and CPU_W8A8: CPUExpertsFp8W8A8, fp8moe implementation "cpu_w8a8".
//
// CPUExpertsFp8W8A8 is fp8moe's definition: the seed names the CPU_W8A8 backend and says only
// "W8A8 first: it falls through to the W8A16 backend whenever the hardware (AMX-FP8) or the config
// isn't supported", and its quant config (make_fp8_moe_quant_config's CPU_W8A8 branch) carries
// w1/w2 scales, a1_scale and the block shape but no biases and no SwiGLU parameters. So the class
// is x86-only behind its own feature (amx_fp8: the CPU W8A8 kernel can run here), block FP8 (B128)
// only, SiLU only, routing as CPUExpertsFp8, and it rejects expert biases and swiglu_limit / alpha
// / beta so that such configurations fall through to CPUExpertsFp8.
#include "experts/experts_common.hpp"

namespace fp8moe::experts {
namespace {

// x86 and torch.cpu._is_amx_tile_supported(); in fp8moe amx_tile means "the CPU W8A16 kernel can
// run here" (it needs AVX2, not AMX), so a CPU machine picks the CPU backends.
bool w8a16_device(const ExpertsContext& c) {
  const Platform& p = c.platform;
  return p.is_cpu() && p.cpu_arch() == CpuArch::kX86 && p.has(Feature::kAmxTile);
}
bool w8a8_device(const ExpertsContext& c) {
  const Platform& p = c.platform;
  return p.is_cpu() && p.cpu_arch() == CpuArch::kX86 && p.has(Feature::kAmxFp8);
}
bool silu(MoeActivation a, const ExpertsContext&) { return a == MoeActivation::kSilu; }
bool quant(const OptQuantKey& w, const OptQuantKey& a, const ExpertsContext& c) {
  return in_pairs(w, a, {b128(keys(c))});
}
bool routing(RoutingMethodType r, const OptQuantKey&, const OptQuantKey&, const ExpertsContext&) {
  return r == RoutingMethodType::kDefault || r == RoutingMethodType::kRenormalize ||
         r == RoutingMethodType::kRenormalizeNaive;
}
Support w8a8_config(const ExpertsKernel&, const MoeConfig& config, const OptQuantKey&,
                    const OptQuantKey&, Support base, const ExpertsContext&) {
  if (!base) return base;
  if (config.has_bias)
    return Support::no(
        "kernel does not support expert bias (the CPU_W8A8 quant config carries no biases)");
  if (config.swiglu_limit || config.swiglu_alpha || config.swiglu_beta)
    return Support::no(
        "kernel does not support SwiGLU limit/alpha/beta (the CPU_W8A8 quant config carries no "
        "SwiGLU parameters)");
  return base;
}

}  // namespace

const ExpertsKernel kCPUExpertsFp8 = {
    .name = "CPUExpertsFp8",
    .module = "fused_moe/experts/cpu_moe.py",
    .format = ActivationFormat::kStandard,
    .supports_current_device = w8a16_device,
    .supports_no_act_and_mul = never,
    .supports_activation = silu,
    .supports_quant_scheme = quant,
    .supports_parallel_config = any_parallel,
    .supports_routing_method = routing,
    .supports_router_logits_dtype = any_logits_dtype,
    .impl_name = "cpu_w8a16",
    .summary = "CPU block-FP8 W8A16 monolithic MoE (x86; bf16 activations, fp8 weights)",
};

const ExpertsKernel kCPUExpertsFp8W8A8 = {
    .name = "CPUExpertsFp8W8A8",
    .module = "fp8moe (the seed's CPU_W8A8 backend)",
    .format = ActivationFormat::kStandard,
    .supports_current_device = w8a8_device,
    .supports_no_act_and_mul = never,
    .supports_activation = silu,
    .supports_quant_scheme = quant,
    .supports_parallel_config = any_parallel,
    .supports_routing_method = routing,
    .supports_router_logits_dtype = any_logits_dtype,
    .extra = w8a8_config,
    .impl_name = "cpu_w8a8",
    .summary = "CPU block-FP8 W8A8 monolithic MoE (x86; no biases, no SwiGLU parameters)",
};

}  // namespace fp8moe::experts
