// select_fp8_moe_backend and what it needs: backend_to_kernel_cls, _get_priority_backends with its
// four reorder rules, the log messages. Mirrors the seed (vllm fused_moe/oracle/fp8.py) line by
// line.
#include <fmt/format.h>

#include <algorithm>

#include "experts/experts_common.hpp"
#include "fp8moe/error.hpp"
#include "fp8moe/log.hpp"
#include "fp8moe/oracle.hpp"

namespace fp8moe {

namespace {

// The seed's _AVAILABLE_BACKENDS, index 0 first.
constexpr std::array<Fp8MoeBackend, 15> kBaseOrder{{
    Fp8MoeBackend::kAiter,
    Fp8MoeBackend::kFlashinferTrtllm,
    Fp8MoeBackend::kFlashinferCutlass,
    Fp8MoeBackend::kDeepGemm,
    Fp8MoeBackend::kVllmCutlass,
    Fp8MoeBackend::kTriton,
    Fp8MoeBackend::kMarlin,
    Fp8MoeBackend::kHumming,
    Fp8MoeBackend::kBatchedDeepGemm,
    Fp8MoeBackend::kBatchedVllmCutlass,
    Fp8MoeBackend::kBatchedTriton,
    Fp8MoeBackend::kXpu,
    Fp8MoeBackend::kCpuW8A8,
    Fp8MoeBackend::kCpu,
    Fp8MoeBackend::kHpc,
}};

// _move_to_front: backends.insert(0, backends.pop(backends.index(backend))).
void move_to_front(std::vector<Fp8MoeBackend>& v, Fp8MoeBackend b) {
  auto it = std::find(v.begin(), v.end(), b);
  if (it == v.end()) {
    // list.index raises ValueError in Python; unreachable for the built-in list.
    throw ValueError(fmt::format("{} is not in list", backend_value(b)));
  }
  v.erase(it);
  v.insert(v.begin(), b);
}

// list.remove(x): raises ValueError("list.remove(x): x not in list") when absent. Unreachable in
// the seed (nothing removes DEEPGEMM or VLLM_CUTLASS earlier), mirrored anyway.
void list_remove(std::vector<Fp8MoeBackend>& v, Fp8MoeBackend b) {
  auto it = std::find(v.begin(), v.end(), b);
  if (it == v.end()) throw ValueError("list.remove(x): x not in list");
  v.erase(it);
}

std::vector<std::string> values_of(const std::vector<Fp8MoeBackend>& v) {
  std::vector<std::string> r;
  r.reserve(v.size());
  for (Fp8MoeBackend b : v) r.push_back(backend_value(b));
  return r;
}

// rocm_aiter_ops.is_rdna_aiter_enabled(): False unless ROCm with aiter importable; then
// on_rdna4() and _AITER_ENABLED.
bool is_rdna_aiter_enabled(const Platform& p, const OracleEnv& env) {
  if (!(p.is_rocm() && p.has(Feature::kAiter))) return false;
  return p.on_rdna4() && env.rocm_use_aiter();
}

}  // namespace

std::string python_list_repr(const std::vector<std::string>& items) {
  std::string r = "[";
  for (std::size_t i = 0; i < items.size(); ++i) {
    if (i) r += ", ";
    r += python_str_repr(items[i]);
  }
  return r + "]";
}

std::string make_log_unsupported(Fp8MoeBackend backend, const std::string& reason) {
  if (!reason.empty()) {
    return fmt::format("FP8 MoE backend {} does not support the deployment configuration since {}.",
                       backend_value(backend), reason);
  }
  return fmt::format("FP8 MoE backend '{}' does not support the deployment configuration.",
                     backend_value(backend));
}

std::string make_log_backend(Fp8MoeBackend backend, const std::vector<std::string>& candidates) {
  return fmt::format("Using {} Fp8 MoE backend out of potential backends: {}.",
                     backend_value(backend), python_list_repr(candidates));
}

std::vector<const ExpertsKernel*> backend_to_kernel_cls(Fp8MoeBackend backend) {
  using namespace experts;
  switch (backend) {
    case Fp8MoeBackend::kFlashinferTrtllm:
      return {&kTrtLlmFp8ExpertsMonolithic, &kTrtLlmFp8ExpertsModular};
    case Fp8MoeBackend::kFlashinferCutlass:
      return {&kFlashInferExperts};
    case Fp8MoeBackend::kDeepGemm:
      return {&kTritonOrDeepGemmExperts};
    case Fp8MoeBackend::kBatchedDeepGemm:
      return {&kBatchedDeepGemmExperts};
    case Fp8MoeBackend::kHumming:
      return {&kBatchedHummingGroupedExperts, &kHummingGroupedExperts, &kHummingIndexedExperts};
    case Fp8MoeBackend::kMarlin:
      return {&kMarlinExperts};
    case Fp8MoeBackend::kTriton:
      return {&kTritonExperts};
    case Fp8MoeBackend::kBatchedTriton:
      return {&kBatchedTritonExperts};
    case Fp8MoeBackend::kAiter:
      return {&kAiterExperts};
    case Fp8MoeBackend::kVllmCutlass:
      return {&kTritonOrCutlassExperts};
    case Fp8MoeBackend::kBatchedVllmCutlass:
      return {&kCutlassBatchedExpertsFp8};
    case Fp8MoeBackend::kXpu:
      return {&kXPUExpertsFp8, &kXPUExpertsMxFp8, &kXPUExpertsBlockFp8};
    case Fp8MoeBackend::kCpuW8A8:
      return {&kCPUExpertsFp8W8A8};
    case Fp8MoeBackend::kCpu:
      return {&kCPUExpertsFp8};
    case Fp8MoeBackend::kHpc:
      return {&kHPCExperts};
    default:
      break;
  }
  if (const RegisteredBackendInfo* r = find_registered_backend(backend)) return r->kernels;
  throw ValueError(fmt::format("Unknown FP8 MoE backend: {}", backend_value(backend)));
}

std::vector<Fp8MoeBackend> get_priority_backends(const MoeConfig& config,
                                                 const OptQuantKey& weight_key,
                                                 const OptQuantKey& activation_key,
                                                 const Platform& platform,
                                                 std::vector<std::string>* applied) {
  std::vector<Fp8MoeBackend> v(kBaseOrder.begin(), kBaseOrder.end());
  // Out-of-tree backends that opted into the auto scan.
  for (const auto& r : registered_fp8_moe_backends()) {
    if (!r.options.auto_select) continue;
    auto pos = v.end();
    if (r.options.insert_before) pos = std::find(v.begin(), v.end(), *r.options.insert_before);
    v.insert(pos, r.backend);
  }
  const auto note = [&](std::string s) {
    if (applied) applied->push_back(std::move(s));
  };
  const auto& k = experts::keys_for(platform.fp8_dtype());
  const bool block_keys = activation_key == OptQuantKey(k.fp8_dynamic_128) &&
                          weight_key == OptQuantKey(k.fp8_static_128_block);
  const MoeParallelConfig& pc = config.moe_parallel_config;

  // Rule 1: with DeepEP v2 (worst-case padded contiguous layout), TRT-LLM skips padding tiles.
  if (platform.is_cuda() && platform.is_device_capability_family(100) &&
      pc.use_deepep_v2_kernels() && block_keys) {
    move_to_front(v, Fp8MoeBackend::kFlashinferTrtllm);
    note("rule 1: SM10x with DeepEP v2 and block FP8 keys moves FLASHINFER_TRTLLM to the front");
  }
  // Rule 2: on Hopper for block FP8, prefer Triton for TP and FlashInfer CUTLASS for EP.
  if (platform.is_cuda() && platform.is_device_capability(90) && block_keys) {
    if (pc.ep_size > 1) {
      move_to_front(v, Fp8MoeBackend::kFlashinferCutlass);
      note(fmt::format(
          "rule 2: SM90 with block FP8 keys and ep_size {} > 1 moves FLASHINFER_CUTLASS to the "
          "front",
          pc.ep_size));
    } else {
      move_to_front(v, Fp8MoeBackend::kTriton);
      note("rule 2: SM90 with block FP8 keys and ep_size 1 moves TRITON to the front");
    }
  }
  // Rule 3: XPU supports TritonExperts and XPUExpertsFp8; XPU goes first.
  if (platform.is_xpu()) {
    move_to_front(v, Fp8MoeBackend::kXpu);
    note("rule 3: XPU moves XPU to the front");
  }
  // Rule 4: W8A8 first; it falls through to the W8A16 backend whenever the hardware (AMX-FP8) or
  // the config isn't supported.
  if (platform.is_cpu()) {
    move_to_front(v, Fp8MoeBackend::kCpu);
    move_to_front(v, Fp8MoeBackend::kCpuW8A8);
    note("rule 4: CPU moves CPU, then CPU_W8A8, to the front");
  }
  return v;
}

void check_moe_config_for_platform(const MoeConfig& config, const Platform& platform) {
  if (!config.is_act_and_mul() && !(platform.is_cuda_alike() || platform.is_xpu())) {
    throw NotImplementedError(
        "is_act_and_mul=False is supported only for CUDA, ROCm and XPU for now");
  }
}

void post_init_for_platform(MoeConfig& config, const Platform& platform, const OracleEnv& env) {
  check_moe_config_for_platform(config, platform);
  const bool aiter_moe = platform.is_rocm() && platform.cdna_version() > 2 &&
                         platform.has(Feature::kAiter) && env.rocm_use_aiter() &&
                         env.rocm_use_aiter_moe();
  config.rocm_aiter_fmoe_enabled = config.is_act_and_mul() && aiter_moe;
  config.aiter_fmoe_shared_expert_enabled = false;
}

Selection select_fp8_moe_backend(const MoeConfig& config, const OptQuantKey& weight_key,
                                 const OptQuantKey& activation_key, bool allow_vllm_cutlass,
                                 const Platform& platform, const OracleEnv& env,
                                 Selection* progress) {
  Selection local;
  Selection& sel = progress ? *progress : local;
  sel = Selection{};
  const ExpertsContext ctx{platform, env};

  // NOTE: the kernels are selected in the following order.
  std::vector<Fp8MoeBackend> available =
      get_priority_backends(config, weight_key, activation_key, platform, &sel.notes);
  sel.candidates = values_of(available);

  // We peek into the P/F selection to know whether the experts use the batched format.
  const ActivationFormat activation_format =
      config.moe_parallel_config.use_batched_activation_format() ? ActivationFormat::kBatchedExperts
                                                                 : ActivationFormat::kStandard;
  sel.activation_format = activation_format;

  const auto try_class = [&](Fp8MoeBackend backend, const ExpertsKernel* k) {
    Support s = experts_supported(*k, config, weight_key, activation_key, activation_format, ctx);
    sel.trace.push_back({backend, k->name, s.ok, s.ok ? std::string() : s.reason});
    return s;
  };

  const auto return_or_raise = [&](Fp8MoeBackend backend) -> Selection {
    std::string reason;
    for (const ExpertsKernel* k : backend_to_kernel_cls(backend)) {
      Support s = try_class(backend, k);
      if (s) {
        info_once(make_log_backend(backend, values_of(available)));
        sel.backend = backend;
        sel.kernel = k;
        sel.candidates = values_of(available);
        return sel;
      }
      reason = s.reason;  // vLLM raises with the reason of the LAST class tried
    }
    throw ValueError(make_log_unsupported(backend, reason));
  };

  // Handle explicit moe_backend from user.
  const std::string& runner_backend = config.moe_backend;
  if (runner_backend != "auto") {
    sel.path = "moe_backend";
    Fp8MoeBackend requested = map_fp8_backend(runner_backend);
    // For batched activation format, use batched variants if available.
    if (activation_format == ActivationFormat::kBatchedExperts) {
      const Fp8MoeBackend before = requested;
      if (requested == Fp8MoeBackend::kDeepGemm) {
        requested = Fp8MoeBackend::kBatchedDeepGemm;
      } else if (requested == Fp8MoeBackend::kTriton) {
        requested = Fp8MoeBackend::kBatchedTriton;
      } else if (requested == Fp8MoeBackend::kVllmCutlass) {
        requested = Fp8MoeBackend::kBatchedVllmCutlass;
      }
      if (requested != before) {
        sel.notes.push_back(
            fmt::format("moe_backend='{}' maps to {}; the batched activation format ({}) uses {}",
                        runner_backend, backend_value(before),
                        config.moe_parallel_config.all2all_backend, backend_value(requested)));
      }
    }
    if ((requested == Fp8MoeBackend::kVllmCutlass ||
         requested == Fp8MoeBackend::kBatchedVllmCutlass) &&
        !allow_vllm_cutlass) {
      throw ValueError("vLLM CUTLASS FP8 MoE backend is disabled for this configuration.");
    }
    return return_or_raise(requested);
  }

  // Handle explicit DeepGEMM FP8 configuration.
  if (env.is_set("VLLM_USE_DEEP_GEMM") || env.is_set("VLLM_MOE_USE_DEEP_GEMM")) {
    // Python's `not a or not b`: VLLM_MOE_USE_DEEP_GEMM is parsed only when VLLM_USE_DEEP_GEMM is
    // truthy, so a garbage value raises only then.
    if (!env.use_deep_gemm() || !env.moe_use_deep_gemm()) {
      list_remove(available, Fp8MoeBackend::kDeepGemm);
      list_remove(available, Fp8MoeBackend::kBatchedDeepGemm);
      sel.candidates = values_of(available);
      sel.notes.push_back(
          "DEEPGEMM and BATCHED_DEEPGEMM removed: VLLM_USE_DEEP_GEMM / VLLM_MOE_USE_DEEP_GEMM "
          "set to false");
    } else {
      sel.path = "VLLM_USE_DEEP_GEMM";
      sel.notes.push_back(
          "VLLM_USE_DEEP_GEMM / VLLM_MOE_USE_DEEP_GEMM set to true: DeepGEMM is forced");
      return return_or_raise(activation_format == ActivationFormat::kStandard
                                 ? Fp8MoeBackend::kDeepGemm
                                 : Fp8MoeBackend::kBatchedDeepGemm);
    }
  }

  // Handle explicit AITER FP8 configuration.
  if (env.is_set("VLLM_ROCM_USE_AITER") || env.is_set("VLLM_ROCM_USE_AITER_MOE")) {
    const bool skip_aiter_moe =
        !env.rocm_use_aiter() || !env.rocm_use_aiter_moe() || is_rdna_aiter_enabled(platform, env);
    if (skip_aiter_moe) {
      auto it = std::find(available.begin(), available.end(), Fp8MoeBackend::kAiter);
      if (it != available.end()) {
        available.erase(it);
        sel.candidates = values_of(available);
        sel.notes.push_back(
            is_rdna_aiter_enabled(platform, env)
                ? std::string("AITER removed: RDNA4 has no AITER fused MoE")
                : std::string(
                      "AITER removed: VLLM_ROCM_USE_AITER / VLLM_ROCM_USE_AITER_MOE set to false"));
      }
    } else {
      sel.path = "VLLM_ROCM_USE_AITER";
      sel.notes.push_back(
          "VLLM_ROCM_USE_AITER and VLLM_ROCM_USE_AITER_MOE set to true: AITER is forced");
      return return_or_raise(Fp8MoeBackend::kAiter);
    }
  }

  if (!allow_vllm_cutlass) {
    list_remove(available, Fp8MoeBackend::kVllmCutlass);
    list_remove(available, Fp8MoeBackend::kBatchedVllmCutlass);
    sel.candidates = values_of(available);
  }

  // Select kernels in order of backend.
  sel.path = "auto";
  for (Fp8MoeBackend backend : available) {
    for (const ExpertsKernel* k : backend_to_kernel_cls(backend)) {
      Support s = try_class(backend, k);
      if (s) {
        info_once(make_log_backend(backend, values_of(available)));
        sel.backend = backend;
        sel.kernel = k;
        return sel;
      }
      debug_once(make_log_unsupported(backend, s.reason));
    }
  }

  // vLLM's TODO: OOT plugins need a way to register MoE backends; returning NONE is a temporary
  // measure until then (register_fp8_moe_backend is fp8moe's answer).
  if (platform.is_cuda() || platform.is_rocm()) {
    throw NotImplementedError("No FP8 MoE backend supports the deployment configuration.");
  }
  sel.path = "none";
  sel.backend = Fp8MoeBackend::kNone;
  sel.kernel = nullptr;
  return sel;
}

}  // namespace fp8moe
