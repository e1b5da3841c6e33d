// The layer plan: vLLM's Fp8MoEMethod.__init__ / create_weights / get_fused_moe_quant_config in
// order (spec/oracle.md §5.1-5.3), then the weight format of the chosen kernel (§1.7), then which
// fp8moe implementation runs it and vLLM's per-call FallbackExperts rules (§2.3). Pure: the
// platform and the environment arrive as values.
#include <fmt/format.h>

#include <algorithm>

#include "fp8moe/error.hpp"
#include "fp8moe/layer.hpp"
#include "kernels/ref/ref.hpp"
#include "kernels/registry.hpp"
#include "layer/layer_internal.hpp"

namespace fp8moe {

using layer_detail::cdiv;
using nlohmann::ordered_json;

namespace {

void record_error(Fp8MoeLayerPlan& p, const std::string& step, std::string_view kind,
                  const std::string& message) {
  p.ok = false;
  p.failed_step = step;
  p.error_kind = std::string(kind);
  p.error_message = message;
}
void record_error(Fp8MoeLayerPlan& p, const std::string& step, const Error& e) {
  record_error(p, step, e.kind(), e.what());
}

// The implementation by name: "ref" is the reference (not in the registry: it is the truth every
// registered kernel is checked against).
const ExpertsImpl* lookup_impl(std::string_view name) {
  if (name.empty()) return nullptr;
  if (name == "ref") return &ref::ref_experts_impl();
  return find_experts_impl(name);
}

std::string known_impls() {
  std::string s = "ref";
  for (const ExpertsImpl* i : experts_impls()) {
    if (std::string_view(i->name) != "ref") s += fmt::format(", {}", i->name);
  }
  return s;
}

// The backend an implementation belongs to (its class's backend; the primary role first, so
// cuda_fused is TRITON's, not DEEPGEMM's fallback).
std::optional<Fp8MoeBackend> natural_backend(std::string_view impl) {
  for (int pass = 0; pass < 2; ++pass) {
    for (Fp8MoeBackend b : all_fp8_moe_backends()) {
      if (b == Fp8MoeBackend::kNone) continue;
      for (const ExpertsKernel* k : backend_to_kernel_cls(b)) {
        const char* n = pass == 0 ? k->impl_name : k->fallback_impl_name;
        if (n && impl == n) return b;
      }
    }
  }
  return std::nullopt;
}

bool device_matches(const ExpertsImpl& impl, const Device& d) { return impl.device == d.kind; }

std::string device_kind_name(DeviceKind k) { return k == DeviceKind::kCpu ? "cpu" : "cuda"; }

}  // namespace

namespace layer_detail {

MoeQuantConfig make_layer_quant_config(Fp8MoeBackend backend, const CheckpointQuant& q,
                                       const MoeConfig& cfg,
                                       const std::optional<std::vector<int64_t>>& block_shape,
                                       KeyDType fp8_key, const Tensor& w1_scale,
                                       const Tensor& w2_scale, const Tensor& a1_scale,
                                       const Tensor& a2_scale, const Tensor& w1_bias,
                                       const Tensor& w2_bias) {
  Fp8QuantConfigInputs in;
  Fp8MoeLayerState state;
  if (q.weight_block_size) {
    state.weight_block_size =
        std::vector<int64_t>{(*q.weight_block_size)[0], (*q.weight_block_size)[1]};
  }
  state.has_w13_weight_scale_inv = q.weight_scale_suffix == "weight_scale_inv";
  state.humming_quantizes_inputs = true;
  in.w1_scale = w1_scale;
  in.w2_scale = w2_scale;
  in.a1_scale = a1_scale;
  in.a2_scale = a2_scale;
  in.w1_bias = w1_bias;
  in.w2_bias = w2_bias;
  in.block_shape = block_shape;
  in.per_act_token_quant = q.per_act_token_quant;
  in.per_out_ch_quant = q.per_out_ch_quant;
  // Fp8MoEMethod passes the layer's swiglu_limit / swiglu_alpha / swiglu_beta.
  in.swiglu_limit = cfg.swiglu_limit;
  in.gemm1_alpha = cfg.swiglu_alpha;
  in.gemm1_beta = cfg.swiglu_beta;
  in.layer = &state;
  in.fp8_dtype =
      fp8_key == KeyDType::kF8E4M3FNUZ ? QuantDType::kFp8E4M3FNUZ : QuantDType::kFp8E4M3FN;
  return make_fp8_moe_quant_config(backend, in);
}

}  // namespace layer_detail

CheckpointQuant fp8_block_checkpoint_quant(int64_t block_n, int64_t block_k, bool ue8m0) {
  return parse_quantization_config(fmt::format(
      R"({{"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [{}, {}]{}}})",
      block_n, block_k, ue8m0 ? R"(, "scale_fmt": "ue8m0")" : ""));
}

Fp8MoeLayerSpec checkpoint_layer_spec(const ModelConfig& model, const CheckpointLayerRequest& req) {
  if (model.moe_layers.empty()) {
    throw ValueError(fmt::format("{} has no MoE layer", model.source));
  }
  const int layer = req.layer < 0 ? model.moe_layers.front() : req.layer;
  if (std::find(model.moe_layers.begin(), model.moe_layers.end(), layer) ==
      model.moe_layers.end()) {
    throw ValueError(fmt::format(
        "layer {} of {} has no routed experts (MoE layers: {} to {}, {} in all)", layer,
        model.source, model.moe_layers.front(), model.moe_layers.back(), model.moe_layers.size()));
  }
  if (req.tp_size < 1 || req.rank < 0 || req.rank >= req.tp_size) {
    throw ValueError(fmt::format("rank {} is outside a group of {} ranks (--tp {})", req.rank,
                                 req.tp_size, req.tp_size));
  }
  Fp8MoeLayerSpec s;
  const MoeParallelConfig par = MoeParallelConfig::make(req.tp_size, 1, 1, 1, req.enable_ep,
                                                        "allgather_reducescatter", false, req.rank);
  s.config = model.moe_config(par, req.moe_backend, req.act_dtype.value_or(model.dtype));
  s.quant = model.quant;
  if (moe_layer_ignored(model, layer)) {
    s.quant.moe_fp8 = false;
    s.quant.not_fp8_reason = fmt::format(
        "the quantisation config's ignore list names layer {}'s experts, so vLLM builds them with "
        "UnquantizedFusedMoEMethod (bf16), not the FP8 MoE oracle",
        layer);
  }
  s.routing.method = model.routing_method;
  s.routing.topk = model.num_experts_per_tok;
  s.routing.renormalize = model.renormalize;
  s.routing.scoring_func = model.scoring_func;
  s.routing.num_expert_group = model.num_expert_group;
  s.routing.topk_group = model.topk_group;
  s.routing.routed_scaling_factor = model.routed_scaling_factor;
  s.apply_router_weight_on_input = model.apply_router_weight_on_input;
  s.name = fmt::format("{} layer {}", model.source, layer);
  return s;
}

Fp8MoeLayerPlan plan_fp8_moe_layer(const Fp8MoeLayerSpec& spec, const Fp8MoeLayerOptions& opt) {
  Fp8MoeLayerPlan p;
  const Platform platform = opt.platform ? *opt.platform : Platform::detect();
  const OracleEnv& env = opt.env;
  const CheckpointQuant& q = spec.quant;
  p.source = spec.name;
  p.platform = platform.describe();
  p.checkpoint_quant = q.describe();
  p.kernel_request = opt.kernel;
  p.ok = true;

  // ---- 0. the layer config -------------------------------------------------------------------
  MoeConfig cfg = spec.config;
  cfg.device = opt.device ? std::string(device_kind_name(opt.device->kind))
                          : std::string(platform.is_cpu() ? "cpu" : "cuda");
  try {
    cfg.post_init();
  } catch (const Error& e) {
    record_error(p, "config", e);
    return p;
  }
  p.config = cfg;
  p.hidden = cfg.hidden_dim;
  p.intermediate = cfg.intermediate_size;
  p.local_intermediate = cfg.intermediate_size_per_partition;
  p.num_experts = cfg.num_experts;
  p.num_local_experts = cfg.num_local_experts;
  p.topk = cfg.experts_per_token;
  if (spec.routing.topk != cfg.experts_per_token) {
    record_error(p, "config", "ValueError",
                 fmt::format("routing.topk {} differs from the config's experts_per_token {}",
                             spec.routing.topk, cfg.experts_per_token));
    return p;
  }
  if (spec.routing.method != cfg.routing_method) {
    record_error(p, "config", "ValueError",
                 fmt::format("routing.method {} differs from the config's routing_method {}",
                             routing_method_name(spec.routing.method),
                             routing_method_name(cfg.routing_method)));
    return p;
  }
  if (!q.moe_fp8) {
    record_error(p, "fp8", "NotImplementedError",
                 q.uses_mxfp8_oracle ? q.not_fp8_reason +
                                           "; fp8moe implements oracle/fp8.py only, so this plan "
                                           "stops here"
                                     : q.not_fp8_reason);
    return p;
  }

  // ---- 1. keys and block resolution (Fp8MoEMethod.__init__ [N]) --------------------------------
  const KeyDType fp8_key = platform.fp8_dtype();
  p.weight_key = with_fp8_dtype(q.weight_key, fp8_key);
  p.activation_key = with_fp8_dtype(q.activation_key, fp8_key);
  p.allow_vllm_cutlass = q.allow_vllm_cutlass;
  std::optional<std::vector<int64_t>> block_shape = q.block_shape;
  const int tp = cfg.tp_size();
  if (q.weight_block_size) {
    const auto wbs = *q.weight_block_size;
    p.checkpoint_block = wbs;
    p.block = wbs;
    const int64_t ispp = cfg.intermediate_size_per_partition;
    if (q.block_resolvable) {
      BlockShapeResolution res;
      try {
        res = resolve_fp8_moe_weight_block_shape(
            cfg, {static_cast<int>(wbs[0]), static_cast<int>(wbs[1])}, p.activation_key,
            q.is_checkpoint_fp8_serialized, platform);
      } catch (const Error& e) {
        record_error(p, "resolve", e);
        p.resolution_why = fmt::format(
            "per-rank intermediate {} is not whole {}-row blocks, moe_backend={} cannot take "
            "refined blocks, and padding does not apply",
            ispp, wbs[0], cfg.moe_backend);
        return p;
      }
      p.config = cfg;  // the pad mutates intermediate_size_per_partition
      p.local_intermediate = cfg.intermediate_size_per_partition;
      p.block = std::array<int64_t, 2>{res.block_shape[0], res.block_shape[1]};
      p.padded = res.padded;
      if (res.refine) p.refine = std::array<int64_t, 2>{(*res.refine)[0], (*res.refine)[1]};
      block_shape = std::vector<int64_t>{(*p.block)[0], (*p.block)[1]};
      // [N]: the weight key carries the resolved block shape.
      p.weight_key = with_fp8_dtype(
          create_fp8_quant_key(true, GroupShape((*p.block)[0], (*p.block)[1])), fp8_key);
      BlockResolutionText t = explain_block_resolution(res, wbs, ispp, cfg);
      p.resolution = std::move(t.resolution);
      p.resolution_why = std::move(t.why);
      for (std::string& n : t.notes) p.notes.push_back(std::move(n));
    } else {
      BlockResolutionText t = explain_unresolved_blocks(q.method_name);
      p.resolution = std::move(t.resolution);
      p.resolution_why = std::move(t.why);
    }
  }

  // ---- 2. select_fp8_moe_backend ---------------------------------------------------------------
  const bool overridden = !opt.kernel.empty();
  Selection progress;
  try {
    check_moe_config_for_platform(cfg, platform);
    p.selection = select_fp8_moe_backend(cfg, p.weight_key, p.activation_key, p.allow_vllm_cutlass,
                                         platform, env, &progress);
    p.selected = true;
  } catch (const Error& e) {
    p.selection = progress;
    if (!overridden) {
      record_error(p, "select", e);
      return p;
    }
    p.notes.push_back(
        fmt::format("the oracle raised {}: {} (running the --kernel {} override instead)", e.kind(),
                    e.what(), opt.kernel));
  }

  // ---- 3. create_weights' block check (when nothing was refined) -------------------------------
  if (q.weight_block_size && !p.refine) {
    try {
      validate_fp8_block_shape_moe(cfg.intermediate_size_per_partition, *q.weight_block_size, tp);
    } catch (const Error& e) {
      record_error(p, "validate", e);
      return p;
    }
  }

  // ---- 4. which backend's quant config and weight format ---------------------------------------
  const bool oracle_has_backend = p.selected && p.selection.backend != Fp8MoeBackend::kNone;
  Fp8MoeBackend qb = oracle_has_backend ? p.selection.backend : Fp8MoeBackend::kTriton;
  if (overridden && opt.kernel != "ref") {
    const auto nb = natural_backend(opt.kernel);
    bool oracle_class_runs_it = false;
    if (oracle_has_backend && p.selection.kernel) {
      const ExpertsKernel* k = p.selection.kernel;
      oracle_class_runs_it = (k->impl_name && opt.kernel == k->impl_name) ||
                             (k->fallback_impl_name && opt.kernel == k->fallback_impl_name);
    }
    if (!oracle_class_runs_it && nb) qb = *nb;
  }
  if (!oracle_has_backend && overridden && qb == Fp8MoeBackend::kTriton) {
    p.notes.push_back(fmt::format(
        "the oracle chose no backend: --kernel {} computes the generic fp8_w8a8 quant config "
        "(make_fp8_moe_quant_config's last branch, as for TRITON)",
        opt.kernel));
  }
  p.quant_backend = qb;
  p.quant_block_shape = block_shape;
  MoeQuantConfig qc;
  try {
    const int64_t E = cfg.num_local_experts, H = cfg.hidden_dim;
    const int64_t W = cfg.intermediate_size_per_partition;
    Tensor w1s, w2s, a1, a2;
    switch (q.scale_kind) {
      case CheckpointScaleKind::kBlock:
        w1s = Tensor::zeros({E, 2 * cdiv(W, (*p.block)[0]), cdiv(H, (*p.block)[1])}, DType::kF32);
        w2s = Tensor::zeros({E, cdiv(H, (*p.block)[0]), cdiv(W, (*p.block)[1])}, DType::kF32);
        break;
      case CheckpointScaleKind::kPerTensor:
        w1s = Tensor::zeros({E}, DType::kF32);  // after the max requantisation
        w2s = Tensor::zeros({E}, DType::kF32);
        break;
      case CheckpointScaleKind::kPerChannel:
        w1s = Tensor::zeros({E, 2 * W}, DType::kF32);
        w2s = Tensor::zeros({E, H}, DType::kF32);
        break;
      case CheckpointScaleKind::kMx:
        w1s = Tensor::zeros({E, 2 * W, H / 32}, DType::kU8);
        w2s = Tensor::zeros({E, H, W / 32}, DType::kU8);
        break;
      case CheckpointScaleKind::kNone:
        break;
    }
    if (q.static_input_scales) {
      a1 = Tensor::scalar_f32(1.0f);
      a2 = Tensor::scalar_f32(1.0f);
    }
    qc = layer_detail::make_layer_quant_config(qb, q, cfg, block_shape, fp8_key, w1s, w2s, a1, a2,
                                               {}, {});
    p.quant_config = qc.describe();
    p.quant_config_name = qc.config_name(cfg.in_dtype);
    p.scheme = MoeScheme::from_quant_config(qc);
  } catch (const Error& e) {
    record_error(p, "quant_config", e);
    return p;
  }
  // UE8M0 activation scales (pitfalls 12 and 13) and the fused SiLU+quant path.
  p.deep_gemm_e8m0 = is_deep_gemm_e8m0_used(platform, env);
  // VLLM_BATCH_INVARIANT reaches the kernel (FusedMoeArgs::batch_invariant). The oracle has
  // evaluated it already where it mattered (base check #10): a value it cannot parse raised there
  // (only a kernel override gets this far then, with the oracle's error as a note) and means off
  // here, with a note of its own.
  try {
    p.batch_invariant = env.batch_invariant();
  } catch (const Error& e) {
    p.batch_invariant = false;
    p.notes.push_back(fmt::format(
        "VLLM_BATCH_INVARIANT is not an integer ({}): the kernels run without batch invariance",
        e.what()));
  }
  if (p.batch_invariant)
    p.notes.push_back(
        "VLLM_BATCH_INVARIANT: a token's output does not depend on the batch around it (the "
        "kernels run one configuration at every M)");
  p.deep_gemm_installed = platform.has(Feature::kDeepGemm);
  p.sm100_or_newer = platform.has_device_capability(100);
  if (p.scheme.act == ActQuantKind::kPerGroupDynamic) {
    if (q.scale_fmt_ue8m0) {
      p.scheme.ue8m0_scales = true;
      p.scheme_notes.push_back(
          "the checkpoint declares scale_fmt ue8m0: activations are quantised with power-of-two "
          "(UE8M0) scales in every backend (pitfall 13)");
    } else if (p.deep_gemm_e8m0) {
      // vLLM's per_token_group_quant_fp8 rounds scales up to powers of two whenever E8M0 is in
      // use; it is the activation quantiser of the Triton and DeepGEMM paths. FlashInfer, TRT-LLM,
      // AITER and Humming quantise inside their own kernels.
      const bool vllm_group_quant =
          qb == Fp8MoeBackend::kTriton || qb == Fp8MoeBackend::kBatchedTriton ||
          qb == Fp8MoeBackend::kDeepGemm || qb == Fp8MoeBackend::kBatchedDeepGemm;
      if (vllm_group_quant) {
        p.scheme.ue8m0_scales = true;
        p.scheme_notes.push_back(
            "is_deep_gemm_e8m0_used(): per_token_group_quant_fp8 rounds activation scales up to "
            "powers of two in every path, Triton included");
      } else {
        p.scheme_notes.push_back(fmt::format(
            "is_deep_gemm_e8m0_used() holds, but {} quantises activations inside its own kernel "
            "(not per_token_group_quant_fp8); the reference models that with fp32 scales",
            backend_value(qb)));
      }
    }
  } else if (q.scale_fmt_ue8m0) {
    p.scheme_notes.push_back(fmt::format(
        "scale_fmt ue8m0: the weight scales are powers of two; activations are {} here",
        p.scheme.act == ActQuantKind::kNone ? "not quantised (W8A16)" : "not per-group"));
  }
  p.scheme.fuse_silu_quant = false;
  if (p.scheme.act == ActQuantKind::kPerGroupDynamic && cfg.activation == MoeActivation::kSilu &&
      (qb == Fp8MoeBackend::kTriton || qb == Fp8MoeBackend::kDeepGemm)) {
    p.scheme_notes.push_back(
        "SiLU*up is rounded to bf16 before the second quantisation (the seed's triton_moe.py has "
        "no fused silu_and_mul_per_block_quant path)");
  }
  // ApplyMoEActivationConfig.from_configs: the quant config first, then the layer config.
  p.activation.activation = cfg.activation;
  p.activation.clamp_limit = qc.gemm1_clamp_limit ? qc.gemm1_clamp_limit : cfg.swiglu_limit;
  p.activation.alpha = qc.gemm1_alpha.value_or(cfg.swiglu_alpha.value_or(1.0));
  p.activation.beta = qc.gemm1_beta.value_or(cfg.swiglu_beta.value_or(0.0));
  p.activation.situ_beta = cfg.activation_situ_beta;
  p.activation.situ_linear_beta = cfg.activation_situ_linear_beta;

  // ---- 5. convert_to_fp8_moe_kernel_format -----------------------------------------------------
  try {
    KernelFormatContext kc;
    kc.weight = p.scheme.weight;
    if (p.block) kc.block = *p.block;
    kc.gated = activation_is_gated(cfg.activation);
    kc.deep_gemm_e8m0 = p.deep_gemm_e8m0;
    p.kernel_format = convert_to_fp8_moe_kernel_format(qb, kc);
  } catch (const Error& e) {
    record_error(p, "kernel_format", e);
    return p;
  }

  // ---- 6. fp8moe's implementation --------------------------------------------------------------
  auto not_runnable = [&](const std::string& why) {
    p.runnable = false;
    p.not_runnable_reason = why;
  };
  if (p.selection.kernel) {
    p.kernel_class = p.selection.kernel->name;
    if (p.selection.kernel->fallback_impl_name) p.fallback_class = "TritonExperts";
  }
  const ExpertsImpl* primary = nullptr;
  const ExpertsImpl* fallback = nullptr;
  if (!overridden) {
    if (!oracle_has_backend) {
      not_runnable(
          p.selected
              ? fmt::format(
                    "the oracle found no FP8 MoE backend for this layer on {} (NONE){}; "
                    "--kernel ref runs the float64 reference instead",
                    platform.str(),
                    p.selection.trace.empty()
                        ? ""
                        : fmt::format(": {} classes tried, all rejected", p.selection.trace.size()))
              : "the oracle raised an error (see the trace)");
    } else {
      const ExpertsKernel* k = p.selection.kernel;
      if (k->impl_name) p.implementation = k->impl_name;
      if (k->fallback_impl_name) p.fallback_implementation = k->fallback_impl_name;
      primary = k->impl_name ? lookup_impl(k->impl_name) : nullptr;
      fallback = k->fallback_impl_name ? lookup_impl(k->fallback_impl_name) : nullptr;
      if (!primary || (k->fallback_impl_name && !fallback)) {
        not_runnable(fmt::format(
            "the oracle chose {} ({}), and fp8moe has no implementation of it in this build{}",
            backend_value(p.selection.backend), k->name,
            platform.detected() ? "" : " (the platform is simulated)"));
      }
    }
  } else {
    primary = lookup_impl(opt.kernel);
    if (!primary) {
      record_error(
          p, "implementation", "ValueError",
          fmt::format("unknown --kernel '{}': this build has {}", opt.kernel, known_impls()));
      return p;
    }
    if (primary->supports_config) {
      // The activation key the kernel is asked to compute is the quant config's, not the
      // checkpoint's: make_fp8_moe_quant_config builds fp8_w8a16 for MARLIN and CPU, so
      // `--kernel cpu_w8a16` on a W8A8 checkpoint runs activations unquantised, as vLLM's CPU
      // backend does.
      const std::optional<QuantKey> ak =
          p.scheme.act == ActQuantKind::kNone ? std::nullopt : p.activation_key;
      const Support s = primary->supports_config(cfg, p.weight_key, ak);
      if (!s) {
        record_error(p, "implementation", "NotImplementedError",
                     fmt::format("fp8moe's {} kernel does not support this layer: {}", opt.kernel,
                                 s.reason));
        return p;
      }
    }
  }
  if (primary) {
    p.implementation = primary->name;
    if (fallback) p.fallback_implementation = fallback->name;
    p.device =
        opt.device.value_or(primary->device == DeviceKind::kCuda ? Device::cuda(0) : Device::cpu());
    for (const ExpertsImpl* impl : {primary, fallback}) {
      if (!impl) continue;
      if (impl->available && !impl->available()) {
        not_runnable(
            fmt::format("fp8moe's {} kernel is built but cannot run on this machine", impl->name));
      } else if (!device_matches(*impl, p.device)) {
        not_runnable(fmt::format("fp8moe's {} kernel runs on {}, but the layer's device is {}",
                                 impl->name, device_kind_name(impl->device), p.device.str()));
      }
    }
    if (p.not_runnable_reason.empty()) p.runnable = true;
    p.layout = implementation_weight_layout(*primary);
  }
  if (!p.runnable && overridden) {
    record_error(p, "implementation", "NotImplementedError", p.not_runnable_reason);
  }
  return p;
}

KernelChoice Fp8MoeLayerPlan::dispatch(int64_t M) const {
  KernelChoice c;
  // vLLM's class for this M.
  std::string cls = kernel_class;
  std::string why;
  bool use_fallback = false;
  if (kernel_class == "TritonOrDeepGemmExperts") {
    constexpr int64_t align = 128;  // get_mk_alignment_for_contiguous_layout()[0]
    const int64_t N = local_intermediate, K = hidden;
    std::string fail;
    if (!deep_gemm_installed)
      fail = "deep_gemm is not installed";
    else if (M < align)
      fail = fmt::format("M = {} < {} (DeepGEMM's M alignment)", M, align);
    else if (N % align != 0)
      fail = fmt::format("N = {} is not a multiple of {}", N, align);
    else if (K % align != 0)
      fail = fmt::format("K = {} is not a multiple of {}", K, align);
    else if (N <= 512)
      fail = fmt::format("N = {} <= 512", N);
    else if (scheme.fp8 != DType::kF8E4M3FN)
      fail = "the weights are not float8_e4m3fn";
    if (deep_gemm_e8m0) {
      cls = "DeepGemmExperts";
      why = "is_deep_gemm_e8m0_used(): DeepGEMM for every M";
    } else if (fail.empty()) {
      cls = "DeepGemmExperts";
      why = fmt::format("_valid_deep_gemm: M = {} >= 128, N = {} > 512, N and K multiples of 128",
                        M, N);
    } else {
      cls = "TritonExperts";
      use_fallback = true;
      why = fail + ": the TritonExperts fallback";
    }
  } else if (kernel_class == "TritonOrCutlassExperts") {
    if (sm100_or_newer && M <= 8) {
      cls = "TritonExperts";
      use_fallback = true;
      why = fmt::format("SM100+ and M = {} <= 8: the TritonExperts fallback", M);
    } else {
      cls = "CutlassExpertsFp8";
      why = sm100_or_newer ? fmt::format("M = {} > 8: CUTLASS", M) : "below SM100: CUTLASS";
    }
  } else if (!kernel_class.empty()) {
    why = "one class for every M";
  }
  c.kernel_class = cls;
  if (!kernel_request.empty()) {
    c.impl_name = kernel_request;
    c.impl = runnable ? lookup_impl(kernel_request) : nullptr;
    c.why = cls.empty()
                ? fmt::format("--kernel {}", kernel_request)
                : fmt::format("--kernel {} (vLLM would run {}: {})", kernel_request, cls, why);
    return c;
  }
  c.impl_name = use_fallback ? fallback_implementation : implementation;
  c.impl = runnable ? lookup_impl(c.impl_name) : nullptr;
  c.why = why;
  return c;
}

// ---- output
// ----------------------------------------------------------------------------------------

namespace {

ordered_json opt_block(const std::optional<std::array<int64_t, 2>>& b) {
  if (!b) return nullptr;
  return ordered_json::array({(*b)[0], (*b)[1]});
}

}  // namespace

ordered_json layer_plan_to_json(const Fp8MoeLayerPlan& p) {
  ordered_json j;
  j["source"] = p.source;
  j["platform"] = p.platform;
  j["checkpoint_quant"] = p.checkpoint_quant;
  j["ok"] = p.ok;
  if (!p.ok) {
    j["failed_step"] = p.failed_step;
    j["error"] = {{"kind", p.error_kind}, {"message", p.error_message}};
  }
  j["shape"] = {{"hidden", p.hidden},
                {"intermediate", p.intermediate},
                {"local_intermediate", p.local_intermediate},
                {"num_experts", p.num_experts},
                {"num_local_experts", p.num_local_experts},
                {"topk", p.topk}};
  j["parallel"] = p.config.moe_parallel_config.repr();
  j["moe_backend"] = p.config.moe_backend;
  j["resolution"] = {{"mode", p.resolution},
                     {"why", p.resolution_why},
                     {"checkpoint_block", opt_block(p.checkpoint_block)},
                     {"block", opt_block(p.block)},
                     {"refine", opt_block(p.refine)},
                     {"padded", p.padded}};
  j["weight_key"] = key_str(p.weight_key);
  j["activation_key"] = key_str(p.activation_key);
  j["allow_vllm_cutlass"] = p.allow_vllm_cutlass;
  ordered_json sel;
  sel["selected"] = p.selected;
  sel["backend"] = backend_value(p.selection.backend);
  sel["kernel"] = p.selection.kernel ? ordered_json(p.selection.kernel->name) : nullptr;
  sel["path"] = p.selection.path;
  sel["candidates"] = p.selection.candidates;
  ordered_json trace = ordered_json::array();
  for (const auto& t : p.selection.trace) {
    trace.push_back({{"backend", backend_value(t.backend)},
                     {"kernel", t.kernel},
                     {"supported", t.supported},
                     {"reason", t.reason}});
  }
  sel["trace"] = trace;
  sel["notes"] = p.selection.notes;
  j["selection"] = sel;
  j["quant_backend"] = backend_value(p.quant_backend);
  j["quant_config"] = p.quant_config;
  j["quant_config_name"] = p.quant_config_name;
  j["scheme"] = p.scheme.str();
  j["scheme_notes"] = p.scheme_notes;
  if (p.kernel_format) {
    const auto& k = *p.kernel_format;
    j["kernel_format"] = {{"backend", backend_value(k.backend)},
                          {"vllm_function", k.vllm_function},
                          {"vllm_steps", k.vllm_steps},
                          {"vllm_layout", std::string(weight_layout_name(k.vllm_layout))},
                          {"requantize_ue8m0", k.requantize_ue8m0},
                          {"clamp_block_scales", k.clamp_block_scales},
                          {"fp8moe_layout", std::string(weight_layout_name(p.layout))}};
  }
  j["implementation"] = {{"device", p.device.str()},
                         {"kernel_request", p.kernel_request},
                         {"implementation", p.implementation},
                         {"fallback_implementation", p.fallback_implementation},
                         {"kernel_class", p.kernel_class},
                         {"fallback_class", p.fallback_class},
                         {"runnable", p.runnable},
                         {"not_runnable_reason", p.not_runnable_reason}};
  j["notes"] = p.notes;
  return j;
}

std::vector<std::string> layer_plan_to_text(const Fp8MoeLayerPlan& p) {
  std::vector<std::string> out;
  auto line = [&](std::string s) { out.push_back(std::move(s)); };
  line(fmt::format("layer      {}", p.source));
  line(fmt::format("platform   {}", p.platform));
  if (p.hidden > 0) {
    line(fmt::format(
        "shape      E={} (local {}), top-{}, hidden {}, intermediate {} (per rank {}), {}",
        p.num_experts, p.num_local_experts, p.topk, p.hidden, p.intermediate, p.local_intermediate,
        p.config.moe_parallel_config.use_ep
            ? fmt::format("EP {} rank {}", p.config.ep_size(), p.config.ep_rank())
            : fmt::format("TP {} rank {}", p.config.tp_size(), p.config.tp_rank())));
  }
  line(fmt::format("checkpoint {}", p.checkpoint_quant));
  if (p.resolution != "none" || !p.resolution_why.empty()) {
    line(fmt::format("blocks     {}: {}", p.resolution, p.resolution_why));
  }
  if (p.weight_key || p.activation_key) {
    line(fmt::format("keys       weight {} x activation {}", quant_key_name(p.weight_key),
                     quant_key_name(p.activation_key)));
  }
  if (p.selected || !p.selection.trace.empty()) {
    std::string how = p.selection.path;
    if (!p.selected) {
      how = "the oracle raised";
    } else if (how == "auto") {
      how = "auto scan";
    } else if (how == "moe_backend") {
      how = "explicit --moe-backend";
    } else if (how == "none") {
      how = "no class fits";
    } else {
      how += " forced";
    }
    line(fmt::format("oracle     {}{} ({}; moe_backend={})", backend_value(p.selection.backend),
                     p.selection.kernel ? fmt::format(" / {}", p.selection.kernel->name) : "", how,
                     p.config.moe_backend));
    if (!p.selection.candidates.empty()) {
      line(fmt::format("           candidates {}", python_list_repr(p.selection.candidates)));
    }
    // Rejections grouped by reason (the detected CPU rejects most classes for the same one).
    std::vector<std::pair<std::string, std::vector<std::string>>> groups;
    for (const auto& t : p.selection.trace) {
      if (t.supported) continue;
      auto it = std::find_if(groups.begin(), groups.end(),
                             [&](const auto& g) { return g.first == t.reason; });
      if (it == groups.end()) {
        groups.push_back({t.reason, {t.kernel}});
      } else {
        it->second.push_back(t.kernel);
      }
    }
    for (const auto& [reason, kernels] : groups) {
      std::string names;
      for (const auto& k : kernels) names += fmt::format("{}{}", names.empty() ? "" : ", ", k);
      line(fmt::format("           - {}: {}", names, reason));
    }
    for (const auto& t : p.selection.trace) {
      if (t.supported) line(fmt::format("           + {}: supported", t.kernel));
    }
  }
  if (!p.quant_config_name.empty() || !p.quant_config.empty()) {
    line(fmt::format("quant      {} ({} branch), scheme {}",
                     p.quant_config_name.empty() ? "None" : p.quant_config_name,
                     backend_value(p.quant_backend), p.scheme.str()));
    for (const auto& n : p.scheme_notes) line(fmt::format("           {}", n));
  }
  if (p.kernel_format) {
    const auto& k = *p.kernel_format;
    if (k.vllm_layout == WeightLayout::kCanonical && !k.requantize_ue8m0 && !k.clamp_block_scales) {
      line(
          fmt::format("weights    {}: convert_to_fp8_moe_kernel_format leaves them unchanged "
                      "(canonical layout)",
                      backend_value(k.backend)));
    } else {
      line(fmt::format("weights    {}: vLLM calls {} ({} layout)", backend_value(k.backend),
                       k.vllm_function, weight_layout_name(k.vllm_layout)));
      for (const auto& s : k.vllm_steps) line(fmt::format("           - {}", s));
    }
    if (p.runnable) {
      line(fmt::format("           fp8moe's {} reads the {} layout{}", p.implementation,
                       weight_layout_name(p.layout),
                       k.requantize_ue8m0 || k.clamp_block_scales
                           ? "; the value changes above are applied"
                           : ""));
    }
  }
  if (p.runnable) {
    std::string impl = p.implementation;
    if (!p.fallback_implementation.empty()) {
      impl += fmt::format(" (fallback {} per call)", p.fallback_implementation);
    }
    line(fmt::format("kernel     {} ({})", impl,
                     p.kernel_request.empty() ? "the oracle's choice"
                                              : fmt::format("--kernel {}", p.kernel_request)));
  } else if (p.ok) {
    line(fmt::format("kernel     none: {}", p.not_runnable_reason));
  }
  for (const auto& n : p.notes) line(fmt::format("note       {}", n));
  if (!p.ok) {
    line(fmt::format("FAILED     at {}: {}: {}", p.failed_step, p.error_kind, p.error_message));
  }
  return out;
}

}  // namespace fp8moe
