// Weight preparation: vLLM's process_weights_after_loading steps for FP8 MoE (fnuz normalisation,
// static input scales, per-tensor max requantisation) and convert_to_fp8_moe_kernel_format
// (spec/oracle.md §1.7) as a table, with the parts fp8moe applies, and the layout tag that keeps
// weights prepared for one kernel from running on another (pitfall 27).
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "fp8moe/error.hpp"
#include "fp8moe/layer.hpp"
#include "fp8moe/log.hpp"
#include "fp8moe/numerics.hpp"
#include "layer/layer_internal.hpp"
#include "numerics/quant.hpp"

namespace fp8moe {

using layer_detail::shape_str;

std::string_view weight_layout_name(WeightLayout l) {
  switch (l) {
    case WeightLayout::kCanonical:
      return "canonical";
    case WeightLayout::kW31:
      return "w31";
    case WeightLayout::kW31BlockMajorK:
      return "w31-block-major-k";
    case WeightLayout::kDeepGemm:
      return "deep-gemm";
    case WeightLayout::kMarlin:
      return "marlin";
    case WeightLayout::kHumming:
      return "humming";
    case WeightLayout::kAiterShuffled:
      return "aiter-shuffled";
    case WeightLayout::kXpu:
      return "xpu";
    case WeightLayout::kCpuPacked:
      return "cpu-packed";
  }
  return "?";
}

bool is_deep_gemm_e8m0_used(const Platform& platform, const OracleEnv& env) {
  // vLLM: envs.VLLM_USE_DEEP_GEMM_E8M0 and is_deep_gemm_supported() (VLLM_USE_DEEP_GEMM, deep_gemm
  // installed, support_deep_gemm()) and the E8M0 GEMM symbol (part of "installed" here).
  return env.use_deep_gemm_e8m0() && env.use_deep_gemm() && platform.has(Feature::kDeepGemm) &&
         platform.support_deep_gemm();
}

WeightLayout implementation_weight_layout(const ExpertsImpl& impl) {
  // Every implementation fp8moe has (ref, cpu_w8a16, cpu_w8a8, cuda_*) takes FusedMoeArgs in the
  // canonical layout of fused_moe.hpp; an out-of-tree implementation joins through the same
  // contract. A kernel that reads another layout would be listed here.
  (void)impl;
  return WeightLayout::kCanonical;
}

KernelFormatPlan convert_to_fp8_moe_kernel_format(Fp8MoeBackend backend,
                                                  const KernelFormatContext& ctx) {
  KernelFormatPlan p;
  p.backend = backend;
  const bool block = ctx.weight == WeightScaleKind::kBlock;
  const bool mx = ctx.weight == WeightScaleKind::kMx;
  const bool per_tensor = ctx.weight == WeightScaleKind::kPerTensor;
  const auto unchanged = [&] {
    p.vllm_function = "(none)";
    p.vllm_steps = {"unchanged: the kernel reads vLLM's canonical layout"};
    p.vllm_layout = WeightLayout::kCanonical;
    p.fp8moe_can_apply_layout = true;
  };
  switch (backend) {
    case Fp8MoeBackend::kDeepGemm:
    case Fp8MoeBackend::kBatchedDeepGemm:
      p.vllm_function = fmt::format(
          "prepare_fp8_moe_layer_for_deepgemm(w13, w2, w13_scale, w2_scale, "
          "tuple(layer.weight_block_size) = ({}, {}))",
          ctx.block[0], ctx.block[1]);
      if (ctx.deep_gemm_e8m0) {
        p.vllm_steps = {
            "is_deep_gemm_e8m0_used(): w13 and w2 requantised in place to UE8M0 block scales "
            "(dequantised with the fp32 scales, then per_block_cast_to_fp8(use_ue8m0=True))",
            "scales converted to DeepGEMM's TMA-aligned layout "
            "(transform_sf_into_required_layout)"};
        p.vllm_layout = WeightLayout::kDeepGemm;
        p.requantize_ue8m0 = block;
        p.fp8moe_can_apply_layout = false;
      } else {
        p.vllm_steps = {"E8M0 not used: weights and fp32 block scales keep the canonical layout"};
        p.vllm_layout = WeightLayout::kCanonical;
        p.fp8moe_can_apply_layout = true;
      }
      break;
    case Fp8MoeBackend::kAiter:
      p.vllm_function = "rocm_aiter_ops.shuffle_weights(w13, w2)";
      p.vllm_steps = {"w13 and w2 shuffled for AITER's CK kernels (is_shuffled = True)"};
      p.vllm_layout = WeightLayout::kAiterShuffled;
      break;
    case Fp8MoeBackend::kHumming:
      p.vllm_function =
          "convert_to_humming_moe_kernel_format(layer, "
          "quant_config=_humming_fp8_weight_schema(layer, w13, w13_scale))";
      p.vllm_steps = {
          "weights converted to Humming's format; layer.w13_weight / w2_weight / *_weight_scale "
          "read back"};
      p.vllm_layout = WeightLayout::kHumming;
      break;
    case Fp8MoeBackend::kMarlin:
      p.vllm_function =
          mx ? "prepare_mxfp8_moe_layer_for_marlin(...)" : "prepare_fp8_moe_layer_for_marlin(...)";
      p.vllm_steps = {"fp8 weights repacked into Marlin's tile layout, scales permuted"};
      p.vllm_layout = WeightLayout::kMarlin;
      break;
    case Fp8MoeBackend::kFlashinferCutlass:
    case Fp8MoeBackend::kFlashinferTrtllm: {
      const bool trtllm = backend == Fp8MoeBackend::kFlashinferTrtllm;
      p.vllm_function =
          fmt::format("prepare_fp8_moe_layer_for_fi(..., is_trtllm={})", trtllm ? "True" : "False");
      p.vllm_steps.push_back(
          "w13 swapped to w31 order: up rows first, then gate rows (block scales too)");
      if (block) {
        p.vllm_steps.push_back("block scales clamped to min=1e-10");
        p.clamp_block_scales = true;
      }
      if (trtllm && block) {
        p.vllm_steps.push_back("DeepSeek-FP8: w31 shuffled into BlockMajorK");
      }
      if (per_tensor) {
        p.vllm_steps.push_back(
            fmt::format("per-tensor: intermediate padded to a multiple of {} (updates "
                        "moe_config.intermediate_size_per_partition)",
                        ctx.gated ? 16 : 128));
        if (trtllm) p.vllm_steps.push_back("per-tensor TRT-LLM: weights rotated");
      }
      if (mx && trtllm) p.vllm_steps.push_back("MXFP8: swapped and shuffled");
      p.vllm_layout = trtllm ? WeightLayout::kW31BlockMajorK : WeightLayout::kW31;
      // fp8moe produces the plain w31 layout of block FP8 (FlashInfer CUTLASS); padding, rotation
      // and BlockMajorK shuffles are not implemented.
      p.fp8moe_can_apply_layout = !trtllm && block;
      break;
    }
    case Fp8MoeBackend::kXpu:
      p.vllm_function = "prepare_fp8_moe_layer_for_xpu(w13, w13_scale, w2, w2_scale)";
      p.vllm_steps = {"weights and scales converted for the XPU kernels"};
      p.vllm_layout = WeightLayout::kXpu;
      break;
    case Fp8MoeBackend::kCpu:
    case Fp8MoeBackend::kCpuW8A8:
      // CPU_W8A8 is the seed's backend and absent from the snapshot's table: it shares the CPU
      // kernel family, so fp8moe gives it the CPU row.
      p.vllm_function = "prepare_fp8_moe_layer_for_cpu(w13, w2)";
      p.vllm_steps = {"weights packed for vLLM's CPU (AMX) kernel"};
      p.vllm_layout = WeightLayout::kCpuPacked;
      break;
    case Fp8MoeBackend::kTriton:
    case Fp8MoeBackend::kBatchedTriton:
    case Fp8MoeBackend::kVllmCutlass:
    case Fp8MoeBackend::kBatchedVllmCutlass:
    case Fp8MoeBackend::kHpc:
      unchanged();
      break;
    case Fp8MoeBackend::kNone:
    case Fp8MoeBackend::kFirstRegistered:
    default:
      if (find_registered_backend(backend)) {
        // An out-of-tree backend registers kernels only; fp8moe's registration carries no weight
        // conversion, so its kernels read the canonical layout (the fused_moe.hpp contract).
        unchanged();
        p.vllm_function = "(registered backend: no conversion)";
        break;
      }
      throw ValueError(fmt::format("Unsupported FP8 MoE backend: {}", backend_value(backend)));
  }
  return p;
}

ExpertWeights PreparedMoeWeights::views() const {
  ExpertWeights w;
  w.w13 = w13.view();
  w.w2 = w2.view();
  w.w13_scale = w13_scale.view();
  w.w2_scale = w2_scale.view();
  if (w13_bias.defined()) w.w13_bias = w13_bias.view();
  if (w2_bias.defined()) w.w2_bias = w2_bias.view();
  if (a13_scale.defined()) w.a13_scale = a13_scale.view();
  if (a2_scale.defined()) w.a2_scale = a2_scale.view();
  return w;
}

namespace {

using layer_detail::on_host;

void require_host(const Tensor& t, const char* name, const char* step) {
  if (t.defined() && !t.device().is_cpu()) {
    throw ValueError(fmt::format(
        "prepare_fp8_moe_weights: {} is on {}; {} runs on the host: load the weights on the "
        "host (the layer moves prepared weights to its device)",
        name, t.device().str(), step));
  }
}

float max_of(const Tensor& t) {
  float m = -INFINITY;
  for (int64_t i = 0; i < t.numel(); ++i) m = std::max(m, t.ptr<const float>()[i]);
  return m;
}

// vLLM process_fp8_input_tensor_strategy_moe: one input scale per GEMM, the max over experts.
Tensor max_input_scale(const Tensor& s, const char* name) {
  require_host(s, name, "the static input scale reduction");
  if (s.dtype() != DType::kF32 || s.numel() < 1) {
    throw ValueError(fmt::format("prepare_fp8_moe_weights: {} {} must be f32 per-expert scales",
                                 name, s.view().describe()));
  }
  const float m = max_of(s);
  bool all_equal = true;
  for (int64_t i = 0; i < s.numel(); ++i) all_equal &= s.ptr<const float>()[i] == m;
  if (!all_equal) {
    // vLLM's warning_once text.
    warning_once(
        "Found input_scales that are not equal for fp8 MoE layer. Using the maximum across "
        "experts for each layer.");
  }
  return Tensor::scalar_f32(m);
}

// vLLM process_fp8_weight_tensor_strategy_moe: each expert's w13 halves, dequantised in float16
// (per_tensor_dequantize: q.to(float16) * scale, computed in float16, so the scale is rounded to
// float16 too) and requantised with the max of the two shard scales (scaled_fp8_quant: x * (1 /
// max)). Both halves go through the round trip, also the one whose scale is the max (vLLM's loop
// does not skip it).
void requantize_per_tensor_w13(const Tensor& w13, const Tensor& scale_e2, Tensor& w13_out,
                               Tensor& scale_out, DType fp8) {
  const int64_t E = w13.size(0), rows = w13.size(1), H = w13.size(2);
  const int64_t half = rows / 2;
  auto shape = w13.sizes();
  w13_out = Tensor::empty(std::span<const int64_t>(shape), w13.dtype());
  scale_out = Tensor::empty({E}, DType::kF32);
  std::vector<float> row(static_cast<std::size_t>(half * H));
  for (int64_t e = 0; e < E; ++e) {
    const float s0 = scale_e2.ptr<const float>()[e * 2],
                s1 = scale_e2.ptr<const float>()[e * 2 + 1];
    const float m = std::max(s0, s1);
    scale_out.ptr<float>()[e] = m;
    for (int j = 0; j < 2; ++j) {
      const float s = j == 0 ? s0 : s1;
      const float s16 = numerics::f16_to_float(layer_detail::float_to_f16(s));
      const uint8_t* src = w13.ptr<const uint8_t>() + (e * rows + j * half) * H;
      uint8_t* dst = w13_out.ptr<uint8_t>() + (e * rows + j * half) * H;
      for (int64_t i = 0; i < half * H; ++i) {
        const float q = numerics::fp8_to_float(w13.dtype(), src[i]);
        row[i] = numerics::f16_to_float(layer_detail::float_to_f16(q * s16));
      }
      numerics::quantize_per_tensor_fp8(row.data(), half * H, m, dst, fp8);
    }
  }
}

}  // namespace

PreparedMoeWeights prepare_fp8_moe_weights(const Fp8MoeWeights& in, const KernelFormatPlan& format,
                                           WeightLayout layout, WeightScaleKind weight_kind,
                                           std::array<int64_t, 2> block, DType platform_fp8) {
  if (!in.w13.defined() || !in.w2.defined() || in.w13.ndim() != 3 || in.w2.ndim() != 3) {
    throw ValueError(fmt::format(
        "prepare_fp8_moe_weights: w13 and w2 must be 3-D (experts, rows, cols), got {} and {}",
        in.w13.view().describe(), in.w2.view().describe()));
  }
  if (layout != WeightLayout::kCanonical && layout != format.vllm_layout) {
    throw ValueError(fmt::format(
        "prepare_fp8_moe_weights: layout {} is neither canonical nor the {} backend's ({})",
        weight_layout_name(layout), backend_value(format.backend),
        weight_layout_name(format.vllm_layout)));
  }
  if (layout != WeightLayout::kCanonical && !format.fp8moe_can_apply_layout) {
    throw NotImplementedError(fmt::format(
        "fp8moe cannot prepare weights in the {} layout of backend {} ({}): fp8moe has no kernel "
        "that reads it",
        weight_layout_name(layout), backend_value(format.backend), format.vllm_function));
  }
  PreparedMoeWeights out;
  out.prepared_for = format.backend;
  out.w13 = in.w13;
  out.w2 = in.w2;
  out.w13_scale = in.w13_scale;
  out.w2_scale = in.w2_scale;
  out.w13_bias = in.w13_bias;
  out.w2_bias = in.w2_bias;
  out.expert_map = in.expert_map;

  // 1. e4m3fn -> e4m3fnuz (MI300-style platforms).
  if (platform_fp8 == DType::kF8E4M3FNUZ && in.w13.dtype() == DType::kF8E4M3FN) {
    require_host(in.w13, "w13", "the fnuz normalisation");
    require_host(in.w2, "w2", "the fnuz normalisation");
    const auto n13 = numerics::normalize_e4m3fn_to_e4m3fnuz({out.w13, on_host(out.w13_scale)});
    const auto n2 = numerics::normalize_e4m3fn_to_e4m3fnuz({out.w2, on_host(out.w2_scale)});
    out.w13 = n13.q;
    out.w13_scale = n13.scale;
    out.w2 = n2.q;
    out.w2_scale = n2.scale;
    out.applied.push_back(
        "normalize_e4m3fn_to_e4m3fnuz: codes reinterpreted as e4m3fnuz, weight scales x2");
  }
  Tensor in13 = in.w13_input_scale, in2 = in.w2_input_scale;
  if (platform_fp8 == DType::kF8E4M3FNUZ && (in13.defined() || in2.defined())) {
    for (Tensor* t : {&in13, &in2}) {
      if (!t->defined()) continue;
      Tensor c = on_host(*t).clone();
      for (int64_t i = 0; i < c.numel(); ++i) c.ptr<float>()[i] *= 2.0f;
      *t = c;
    }
    out.applied.push_back("normalize_e4m3fn_to_e4m3fnuz: input scales x2");
  }

  // 2. Static input scales: the max over experts.
  if (in13.defined() != in2.defined()) {
    throw ValueError(
        "prepare_fp8_moe_weights: give both w13_input_scale and w2_input_scale (static "
        "activation schemes) or neither");
  }
  if (in13.defined()) {
    out.a13_scale = max_input_scale(in13, "w13_input_scale");
    out.a2_scale = max_input_scale(in2, "w2_input_scale");
    out.applied.push_back(fmt::format(
        "process_fp8_input_tensor_strategy_moe: static input scales reduced to their max over "
        "experts (a13 {}, a2 {})",
        out.a13_scale.ptr<float>()[0], out.a2_scale.ptr<float>()[0]));
  }

  // 3. Per-tensor weights: one w13 scale per expert.
  if (weight_kind == WeightScaleKind::kPerTensor && out.w13_scale.defined() &&
      out.w13_scale.ndim() == 2) {
    require_host(out.w13, "w13", "the per-tensor requantisation");
    const Tensor s = on_host(out.w13_scale);
    if (s.size(1) != 2 || s.size(0) != out.w13.size(0) || s.dtype() != DType::kF32) {
      throw ValueError(fmt::format(
          "prepare_fp8_moe_weights: per-tensor w13_scale {} must be ({}, 2) f32 (gate, up)",
          s.view().describe(), out.w13.size(0)));
    }
    Tensor w, sc;
    requantize_per_tensor_w13(out.w13, s, w, sc, out.w13.dtype());
    out.w13 = w;
    out.w13_scale = sc;
    out.applied.push_back(
        "process_fp8_weight_tensor_strategy_moe: w13 gate/up halves requantised to the max of "
        "their two scales (float16 dequantisation, as vLLM), w13_scale (E, 2) -> (E)");
  }

  // 4. convert_to_fp8_moe_kernel_format: value changes.
  if (format.requantize_ue8m0) {
    if (weight_kind != WeightScaleKind::kBlock) {
      throw ValueError("prepare_fp8_moe_weights: the UE8M0 requantisation needs block scales");
    }
    require_host(out.w13, "w13", "the UE8M0 requantisation");
    require_host(out.w2, "w2", "the UE8M0 requantisation");
    for (Tensor* w : {&out.w13, &out.w2}) {
      Tensor* s = w == &out.w13 ? &out.w13_scale : &out.w2_scale;
      const Tensor dq = numerics::dequantize_block(*w, on_host(*s), block[0], block[1]);
      auto shape = dq.sizes();
      Tensor f = Tensor::empty(std::span<const int64_t>(shape), DType::kF32);
      for (int64_t i = 0; i < dq.numel(); ++i) {
        f.ptr<float>()[i] = static_cast<float>(dq.ptr<const double>()[i]);
      }
      const auto q = numerics::per_block_cast_to_fp8(f, block[0], block[1], w->dtype(), true);
      *w = q.q;
      *s = q.scale;
    }
    out.ue8m0_requantized = true;
    out.applied.push_back(
        fmt::format("{}: w13 and w2 requantised to UE8M0 (power-of-two) block scales "
                    "(dequantise, per_block_cast_to_fp8(use_ue8m0=True))",
                    backend_value(format.backend)));
  }
  if (format.clamp_block_scales) {
    for (Tensor* s : {&out.w13_scale, &out.w2_scale}) {
      require_host(*s, "weight scale", "the FlashInfer scale clamp");
      bool any = false;
      for (int64_t i = 0; i < s->numel(); ++i) any |= s->ptr<const float>()[i] < 1e-10f;
      if (!any) continue;
      Tensor c = s->clone();
      for (int64_t i = 0; i < c.numel(); ++i)
        c.ptr<float>()[i] = std::max(c.ptr<float>()[i], 1e-10f);
      *s = c;
    }
    out.applied.push_back(
        fmt::format("{}: block scales clamped to min=1e-10", backend_value(format.backend)));
  }

  // 4b. Layout changes: only when the running kernel reads that layout.
  if (layout == WeightLayout::kW31) {
    require_host(out.w13, "w13", "the w31 swap");
    const int64_t E = out.w13.size(0), rows = out.w13.size(1), H = out.w13.size(2);
    const int64_t half = rows / 2;
    Tensor w = Tensor::empty({E, rows, H}, out.w13.dtype());
    for (int64_t e = 0; e < E; ++e) {
      const uint8_t* src = out.w13.ptr<const uint8_t>() + e * rows * H;
      uint8_t* dst = w.ptr<uint8_t>() + e * rows * H;
      std::memcpy(dst, src + half * H, half * H);
      std::memcpy(dst + half * H, src, half * H);
    }
    const Tensor s = on_host(out.w13_scale);
    const int64_t sr = s.size(1), sc = s.size(2);
    if (sr % 2 != 0 || (half % block[0]) != 0) {
      throw ValueError(fmt::format(
          "prepare_fp8_moe_weights: the w31 swap needs whole scale blocks per half; w13_scale {} "
          "with block_n {}",
          s.view().describe(), block[0]));
    }
    Tensor ns = Tensor::empty({E, sr, sc}, DType::kF32);
    for (int64_t e = 0; e < E; ++e) {
      const float* src = s.ptr<const float>() + e * sr * sc;
      float* dst = ns.ptr<float>() + e * sr * sc;
      std::memcpy(dst, src + (sr / 2) * sc, (sr / 2) * sc * 4);
      std::memcpy(dst + (sr / 2) * sc, src, (sr / 2) * sc * 4);
    }
    out.w13 = w;
    out.w13_scale = ns;
    out.applied.push_back("w13 swapped to w31 order (up rows, then gate rows; scales too)");
  }
  out.layout = layout;
  return out;
}

void run_prepared_experts(const ExpertsImpl& impl, const PreparedMoeWeights& w, FusedMoeArgs args,
                          void* workspace) {
  const WeightLayout want = implementation_weight_layout(impl);
  if (w.layout != want) {
    throw ValueError(fmt::format(
        "weights prepared in the {} layout (for backend {}) cannot run on fp8moe's {} kernel, "
        "which reads the {} layout: prepare them for that kernel (pitfall 27: a layout mismatch "
        "would compute garbage)",
        weight_layout_name(w.layout), backend_value(w.prepared_for), impl.name,
        weight_layout_name(want)));
  }
  args.weights = w.views();
  if (w.expert_map.defined()) args.expert_map = w.expert_map.view();
  impl.run(args, workspace);
}

}  // namespace fp8moe
