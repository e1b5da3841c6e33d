// FusedMoEExperts.is_supported_config (the base check, in vLLM's order and with its reason
// strings), the shared key sets, fp8moe's implementation check, and the list of descriptors.
#include <fmt/format.h>

#include <mutex>

#include "experts/experts_common.hpp"
#include "fp8moe/backend.hpp"
#include "kernels/registry.hpp"

namespace fp8moe {

std::string_view activation_format_value(ActivationFormat f) {
  return f == ActivationFormat::kStandard ? "('standard',)" : "('batched_experts',)";
}
std::string_view activation_format_name(ActivationFormat f) {
  return f == ActivationFormat::kStandard ? "standard" : "batched_experts";
}

bool apply_moe_activation_supported(MoeActivation a) { return a != MoeActivation::kRelu2; }

QuantKey with_fp8_dtype(const QuantKey& key, KeyDType fp8) {
  QuantKey k = key;
  const auto swap = [&](KeyDType& d) {
    if (d == KeyDType::kF8E4M3FN || d == KeyDType::kF8E4M3FNUZ) d = fp8;
  };
  swap(k.dtype);
  swap(k.scale.dtype);
  if (k.scale2) swap(k.scale2->dtype);
  return k;
}
OptQuantKey with_fp8_dtype(const OptQuantKey& key, KeyDType fp8) {
  if (!key) return key;
  return with_fp8_dtype(*key, fp8);
}

namespace experts {

const PlatformKeys& keys_for(KeyDType fp8) {
  const auto make = [](KeyDType f) {
    const auto k = [f](const QuantKey& q) { return with_fp8_dtype(q, f); };
    return PlatformKeys{k(kFp8StaticTensorSym),   k(kFp8DynamicTensorSym), k(kFp8StaticTokenSym),
                        k(kFp8StaticChannelSym),  k(kFp8DynamicTokenSym),  k(kFp8Dynamic128Sym),
                        k(kFp8Static128BlockSym), k(kFp8Dynamic64Sym),     k(kMxfp8Static),
                        k(kMxfp8Dynamic),         k(kMxfp4Static),         k(kMxfp4Dynamic),
                        k(kNvfp4Static),          k(kNvfp4Dynamic),        k(kInt8StaticChannelSym),
                        k(kInt8DynamicTokenSym),  k(kInt8StaticTensorSym), k(kInt8DynamicTensorSym),
                        k(kInt4Static),           k(kInt8Static),          k(kInt4Static32),
                        k(kInt4StaticAsym),       k(kInt4Static32Asym)};
  };
  static const PlatformKeys fn = make(KeyDType::kF8E4M3FN);
  static const PlatformKeys fnuz = make(KeyDType::kF8E4M3FNUZ);
  return fp8 == KeyDType::kF8E4M3FNUZ ? fnuz : fn;
}

bool in_pairs(const OptQuantKey& w, const OptQuantKey& a, std::initializer_list<KeyPair> pairs) {
  for (const auto& p : pairs)
    if (p.first == w && p.second == a) return true;
  return false;
}
bool in_acts(MoeActivation a, std::initializer_list<MoeActivation> acts) {
  for (MoeActivation x : acts)
    if (x == a) return true;
  return false;
}

KeyPair b128(const PlatformKeys& k) { return {k.fp8_static_128_block, k.fp8_dynamic_128}; }
KeyPair tt(const PlatformKeys& k) { return {k.fp8_static_tensor, k.fp8_static_tensor}; }
KeyPair td(const PlatformKeys& k) { return {k.fp8_static_tensor, k.fp8_dynamic_tensor}; }
KeyPair ttok(const PlatformKeys& k) { return {k.fp8_static_tensor, k.fp8_dynamic_token}; }
KeyPair ctok(const PlatformKeys& k) { return {k.fp8_static_channel, k.fp8_dynamic_token}; }
KeyPair mx(const PlatformKeys& k) { return {k.mxfp8_static, k.mxfp8_dynamic}; }

bool always(const ExpertsContext&) { return true; }
bool never(const ExpertsContext&) { return false; }
bool any_activation_supported(MoeActivation a, const ExpertsContext&) {
  return apply_moe_activation_supported(a);
}
bool any_parallel(const MoeParallelConfig&, const ExpertsContext&) { return true; }
bool not_fi_nvl(const MoeParallelConfig& p, const ExpertsContext&) {
  return !(p.use_fi_nvl_two_sided_kernels() || p.use_fi_nvl_one_sided_kernels());
}
bool any_logits_dtype(std::optional<DType>, RoutingMethodType, const ExpertsContext&) {
  return true;
}

}  // namespace experts

// ---- the base check
// ---------------------------------------------------------------------------------

Support is_supported_config(const ExpertsKernel& k, const MoeConfig& config,
                            const OptQuantKey& weight_key, const OptQuantKey& activation_key,
                            ActivationFormat activation_format, const ExpertsContext& ctx) {
  const auto reason = [](std::string x) { return Support::no("kernel does not support " + x); };
  Support base = Support::yes();
  if (!k.supports_current_device(ctx)) {
    base = reason(fmt::format("current device {}", ctx.platform.device_name()));
  } else if (!(config.is_act_and_mul() || k.supports_no_act_and_mul(ctx))) {
    base = reason("no act_and_mul MLP layer");
  } else if (!k.supports_activation(config.activation, ctx)) {
    base = reason(fmt::format("{} activation", activation_repr(config.activation)));
  } else if (!k.supports_quant_scheme(weight_key, activation_key, ctx)) {
    base = reason(
        fmt::format("quantization scheme {}x{}", key_str(weight_key), key_str(activation_key)));
  } else if (!k.supports_parallel_config(config.moe_parallel_config, ctx)) {
    base = reason(fmt::format("parallel config {}", config.moe_parallel_config.repr()));
  } else if (k.supports_routing_method &&
             !k.supports_routing_method(config.routing_method, weight_key, activation_key, ctx)) {
    // An IntEnum formats as its integer in an f-string (Python >= 3.11).
    base = reason(fmt::format("routing method {}", static_cast<int>(config.routing_method)));
  } else if (k.supports_router_logits_dtype &&
             !k.supports_router_logits_dtype(config.router_logits_dtype, config.routing_method,
                                             ctx)) {
    base = reason(fmt::format("router logits dtype {}",
                              config.router_logits_dtype
                                  ? std::string(dtype_torch_name(*config.router_logits_dtype))
                                  : std::string("None")));
  } else if (k.supports_shape && !k.supports_shape(config.hidden_dim)) {
    // vLLM's text reads "kernel does not support 7000 hidden dim is not supported" (sic).
    base = reason(fmt::format("{} hidden dim is not supported", config.hidden_dim));
  } else if (activation_format != k.format) {
    base = reason(fmt::format("{} activation format", activation_format_value(activation_format)));
  } else if (ctx.env.batch_invariant() && !k.supports_batch_invariance) {
    // envs.VLLM_BATCH_INVARIANT is evaluated here (and only here), so a non-integer value raises
    // ValueError at this point, as in vLLM.
    base = reason("batch invariance");
  } else if (config.is_lora_enabled && !k.supports_lora) {
    base = reason("LoRA");
  }
  if (k.extra) return k.extra(k, config, weight_key, activation_key, std::move(base), ctx);
  return base;
}

Support check_fp8moe_implementation(const ExpertsKernel& k, const MoeConfig& config,
                                    const OptQuantKey& weight_key,
                                    const OptQuantKey& activation_key, const Platform& platform) {
  if (!platform.detected()) return Support::yes();
  const auto missing = [&]() {
    return Support::no(fmt::format("fp8moe has no implementation of {} on this machine", k.name));
  };
  if (!k.impl_name) return missing();
  for (const char* name : {k.impl_name, k.fallback_impl_name}) {
    if (!name) continue;  // no fallback
    const ExpertsImpl* impl = find_experts_impl(name);
    if (!impl) return missing();
    if (impl->available && !impl->available()) {
      return Support::no(fmt::format(
          "fp8moe's {} kernel ({}) is built but cannot run on this machine", name, k.name));
    }
    if (impl->supports_config) {
      Support s = impl->supports_config(config, weight_key, activation_key);
      if (!s) {
        return Support::no(fmt::format("fp8moe's {} kernel ({}) does not support {}", name, k.name,
                                       s.reason.empty() ? "this configuration" : s.reason));
      }
    }
  }
  return Support::yes();
}

Support experts_supported(const ExpertsKernel& k, const MoeConfig& config,
                          const OptQuantKey& weight_key, const OptQuantKey& activation_key,
                          ActivationFormat activation_format, const ExpertsContext& ctx) {
  Support s = is_supported_config(k, config, weight_key, activation_key, activation_format, ctx);
  if (!s) return s;
  return check_fp8moe_implementation(k, config, weight_key, activation_key, ctx.platform);
}

const std::vector<const ExpertsKernel*>& builtin_experts_kernels() {
  using namespace experts;
  static const std::vector<const ExpertsKernel*> v = {
      &kTrtLlmFp8ExpertsMonolithic,
      &kTrtLlmFp8ExpertsModular,
      &kFlashInferExperts,
      &kTritonOrDeepGemmExperts,
      &kBatchedDeepGemmExperts,
      &kMarlinExperts,
      &kBatchedHummingGroupedExperts,
      &kHummingGroupedExperts,
      &kHummingIndexedExperts,
      &kTritonExperts,
      &kBatchedTritonExperts,
      &kAiterExperts,
      &kTritonOrCutlassExperts,
      &kCutlassBatchedExpertsFp8,
      &kXPUExpertsFp8,
      &kXPUExpertsMxFp8,
      &kXPUExpertsBlockFp8,
      &kCPUExpertsFp8W8A8,
      &kCPUExpertsFp8,
      &kHPCExperts,
      &kDeepGemmExperts,
      &kCutlassExpertsFp8,
  };
  return v;
}

const ExpertsKernel* find_experts_kernel(std::string_view class_name) {
  for (const ExpertsKernel* k : builtin_experts_kernels())
    if (class_name == k->name) return k;
  for (const auto& r : registered_fp8_moe_backends())
    for (const ExpertsKernel* k : r.kernels)
      if (k && class_name == k->name) return k;
  return nullptr;
}

}  // namespace fp8moe
