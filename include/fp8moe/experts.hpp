// Experts kernel descriptors: one per vLLM expert class (TritonExperts, TritonOrDeepGemmExperts,
// CPUExpertsFp8, ...), carrying vLLM's support contract (FusedMoEExperts.is_supported_config and
// the class's _supports_* predicates, same order, same reason strings) and the link to fp8moe's
// implementation (an ExpertsImpl of fused_moe.hpp, found by name in the kernel registry).
//
// Base check order (oracle.md §2.1); the first failure returns "kernel does not support " + X:
//   1 device            "current device cuda"
//   2 act_and_mul       "no act_and_mul MLP layer"
//   3 activation        "MoEActivation.SILU activation"
//   4 quant scheme      "quantization scheme QuantKey(...)xQuantKey(...)"
//   5 parallel config   "parallel config FusedMoEParallelConfig(...)"
//   6 routing method    "routing method 2"
//   7 router logits     "router logits dtype torch.float16"
//   8 shape             "7000 hidden dim is not supported"
//   9 format            "('standard',) activation format"
//  10 batch invariance  "batch invariance"      (only when VLLM_BATCH_INVARIANT is truthy)
//  11 LoRA              "LoRA"                  (only when LoRA is enabled)
// then the class's own override (`extra`): TRT-LLM's 2048-expert limit, Triton's 1024 padded
// experts, Humming's gemm type, AITER's hint. On a detected platform (Platform::detect()) fp8moe
// then checks that it has an available implementation and that it can honour the configuration.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "fp8moe/config.hpp"
#include "fp8moe/fused_moe.hpp"
#include "fp8moe/oracle_env.hpp"
#include "fp8moe/platform.hpp"
#include "fp8moe/quant_key.hpp"

namespace fp8moe {

// mk.FusedMoEActivationFormat; its .value is a 1-tuple in vLLM.
enum class ActivationFormat : uint8_t { kStandard, kBatchedExperts };
// "('standard',)" / "('batched_experts',)"
std::string_view activation_format_value(ActivationFormat f);
// "standard" / "batched_experts"
std::string_view activation_format_name(ActivationFormat f);

// What a predicate may look at besides its arguments: vLLM's current_platform and envs.
struct ExpertsContext {
  const Platform& platform;
  const OracleEnv& env;
};

struct ExpertsKernel;

// Class override after the base check. `base` is the base verdict; return it unchanged to accept
// it.
using ExpertsExtraCheck = Support (*)(const ExpertsKernel& self, const MoeConfig& config,
                                      const OptQuantKey& weight_key,
                                      const OptQuantKey& activation_key, Support base,
                                      const ExpertsContext& ctx);

struct ExpertsKernel {
  const char* name = "";    // vLLM class name: "TritonExperts"
  const char* module = "";  // vLLM module: "fused_moe/experts/triton_moe.py"
  ActivationFormat format = ActivationFormat::kStandard;
  bool (*supports_current_device)(const ExpertsContext&) = nullptr;
  bool (*supports_no_act_and_mul)(const ExpertsContext&) = nullptr;
  bool (*supports_activation)(MoeActivation, const ExpertsContext&) = nullptr;
  bool (*supports_quant_scheme)(const OptQuantKey& weight_key, const OptQuantKey& activation_key,
                                const ExpertsContext&) = nullptr;
  bool (*supports_parallel_config)(const MoeParallelConfig&, const ExpertsContext&) = nullptr;
  // nullptr: True (the modular default).
  bool (*supports_routing_method)(RoutingMethodType, const OptQuantKey& weight_key,
                                  const OptQuantKey& activation_key,
                                  const ExpertsContext&) = nullptr;
  // nullptr: True.
  bool (*supports_router_logits_dtype)(std::optional<DType>, RoutingMethodType,
                                       const ExpertsContext&) = nullptr;
  // nullptr: True.
  bool (*supports_shape)(int hidden_dim) = nullptr;
  bool supports_batch_invariance = false;
  bool supports_lora = false;
  ExpertsExtraCheck extra = nullptr;
  // fp8moe's implementation (registry name, fused_moe.hpp), or nullptr when fp8moe has none.
  const char* impl_name = nullptr;
  // FallbackExperts (TritonOrDeepGemmExperts): the fallback's implementation, which must be there
  // too.
  const char* fallback_impl_name = nullptr;
  // One line for people: what the class is.
  const char* summary = "";
};

// FusedMoEExperts.is_supported_config(cls, ...) followed by the class override. Never throws except
// where vLLM raises inside a predicate (a non-integer VLLM_USE_DEEP_GEMM / VLLM_BATCH_INVARIANT is
// a ValueError, as in vLLM).
Support is_supported_config(const ExpertsKernel& k, const MoeConfig& config,
                            const OptQuantKey& weight_key, const OptQuantKey& activation_key,
                            ActivationFormat activation_format, const ExpertsContext& ctx);

// fp8moe's own check on a detected platform: an implementation of the class exists in this build,
// is available on this machine, and can honour the configuration (ExpertsImpl::supports_config).
// Support::yes() on a parsed (simulated) platform.
Support check_fp8moe_implementation(const ExpertsKernel& k, const MoeConfig& config,
                                    const OptQuantKey& weight_key,
                                    const OptQuantKey& activation_key, const Platform& platform);

// is_supported_config, then (detected platform only) check_fp8moe_implementation.
Support experts_supported(const ExpertsKernel& k, const MoeConfig& config,
                          const OptQuantKey& weight_key, const OptQuantKey& activation_key,
                          ActivationFormat activation_format, const ExpertsContext& ctx);

// Every built-in descriptor, in backend order (as backend_to_kernel_cls lists them), plus the two
// component classes of the FallbackExperts (DeepGemmExperts, CutlassExpertsFp8) at the end.
const std::vector<const ExpertsKernel*>& builtin_experts_kernels();
// By vLLM class name; nullptr if unknown (registered out-of-tree classes included).
const ExpertsKernel* find_experts_kernel(std::string_view class_name);

// vLLM apply_moe_activation_supported(a): every activation but gated RELU2.
bool apply_moe_activation_supported(MoeActivation a);

// The named keys in the platform's FP8 flavour (e4m3fnuz on gfx94x): vLLM builds them with
// FP8_DTYPE = current_platform.fp8_dtype().
QuantKey with_fp8_dtype(const QuantKey& key, KeyDType fp8);
OptQuantKey with_fp8_dtype(const OptQuantKey& key, KeyDType fp8);

}  // namespace fp8moe
