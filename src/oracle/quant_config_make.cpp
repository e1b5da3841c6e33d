// make_fp8_moe_quant_config and the FusedMoEQuantConfig builders it calls (make, fp8_w8a8,
// fp8_w8a16), the FlashInfer-CUTLASS / HPC per-tensor alphas, and _humming_fp8_weight_schema.
#include <fmt/format.h>

#include "fp8moe/error.hpp"
#include "fp8moe/oracle.hpp"

namespace fp8moe {

namespace {

std::string shape_str(const Tensor& t) { return t.view().describe(); }

Tensor host_f32(const Tensor& t, const char* what) {
  if (t.dtype() != DType::kF32) {
    throw ValueError(fmt::format("{} must be a float32 tensor, got {}", what, shape_str(t)));
  }
  return t.device().is_cpu() ? t : t.to(Device::cpu());
}

// a * b with torch broadcasting restricted to what the scales use: equal shapes, or one operand
// with a single element. Computed on the host in f32; the result lives on a's device.
Tensor mul_scales(const Tensor& a, const Tensor& b, const char* a_name, const char* b_name) {
  const Tensor ha = host_f32(a, a_name), hb = host_f32(b, b_name);
  const bool same = ha.sizes() == hb.sizes();
  if (!same && ha.numel() != 1 && hb.numel() != 1) {
    throw ValueError(fmt::format("cannot broadcast {} {} with {} {}", a_name, shape_str(a), b_name,
                                 shape_str(b)));
  }
  const Tensor& big = (same || hb.numel() == 1) ? ha : hb;
  const std::vector<int64_t> shape = big.sizes();
  Tensor out = Tensor::empty(std::span<const int64_t>(shape), DType::kF32);
  const float* pa = ha.ptr<float>();
  const float* pb = hb.ptr<float>();
  float* po = out.ptr<float>();
  const int64_t n = out.numel();
  for (int64_t i = 0; i < n; ++i) po[i] = pa[ha.numel() == 1 ? 0 : i] * pb[hb.numel() == 1 ? 0 : i];
  return a.device().is_cpu() ? out : out.to(a.device());
}

Tensor reciprocal(const Tensor& a, const char* name) {
  const Tensor ha = host_f32(a, name);
  const std::vector<int64_t> shape = ha.sizes();
  Tensor out = Tensor::empty(std::span<const int64_t>(shape), DType::kF32);
  for (int64_t i = 0; i < out.numel(); ++i) out.ptr<float>()[i] = 1.0f / ha.ptr<float>()[i];
  return a.device().is_cpu() ? out : out.to(a.device());
}

}  // namespace

MoeQuantConfig make_moe_quant_config(const MoeQuantConfigArgs& args) {
  std::optional<GroupShape> a_shape, w_shape;
  if (args.block_shape) {
    if (args.block_shape->size() != 2) {
      throw ValueError(fmt::format("block_shape must have two entries [block_n, block_k], got {}",
                                   args.block_shape->size()));
    }
    if (args.per_act_token_quant || args.per_out_ch_quant) {
      throw ValueError(
          "block_shape cannot be combined with per_act_token_quant or per_out_ch_quant");
    }
    // Both descriptors take the block shape; block_shape is read back from the activation one.
    a_shape = w_shape = GroupShape((*args.block_shape)[0], (*args.block_shape)[1]);
  } else {
    if (args.quant_dtype) a_shape = kPerTensor;
    if (args.per_act_token_quant) a_shape = kPerToken;
    if (args.per_out_ch_quant) w_shape = kPerToken;  // per-output-channel is encoded as (1, -1)
  }
  const std::optional<QuantDType> weight_dtype =
      args.weight_dtype ? args.weight_dtype : args.quant_dtype;
  MoeQuantConfig qc;
  qc.a1 = MoeQuantDesc{args.quant_dtype, a_shape, args.a1_scale, args.a1_gscale, {}, {}};
  qc.a2 = MoeQuantDesc{args.quant_dtype, a_shape, args.a2_scale, args.a2_gscale, {}, {}};
  qc.w1 =
      MoeQuantDesc{weight_dtype, w_shape, args.w1_scale, args.g1_alphas, args.w1_zp, args.w1_bias};
  qc.w2 =
      MoeQuantDesc{weight_dtype, w_shape, args.w2_scale, args.g2_alphas, args.w2_zp, args.w2_bias};
  qc.is_scale_swizzled = args.is_scale_swizzled;
  qc.gemm1_alpha = args.gemm1_alpha;
  qc.gemm1_beta = args.gemm1_beta;
  qc.gemm1_clamp_limit = args.gemm1_clamp_limit;
  // __post_init__: not per_act_token_quant or block_shape is None.
  if (qc.per_act_token_quant() && qc.block_shape()) {
    throw ValueError("per_act_token_quant and block_shape are mutually exclusive");
  }
  return qc;
}

MoeQuantConfig fp8_w8a8_moe_quant_config(MoeQuantConfigArgs args, QuantDType fp8_dtype) {
  args.quant_dtype = fp8_dtype;
  args.weight_dtype = std::nullopt;
  return make_moe_quant_config(args);
}

MoeQuantConfig fp8_w8a16_moe_quant_config(const Tensor& w1_scale, const Tensor& w2_scale,
                                          const Tensor& w1_bias, const Tensor& w2_bias,
                                          const std::optional<std::vector<int64_t>>& block_shape,
                                          std::optional<double> gemm1_alpha,
                                          std::optional<double> gemm1_beta,
                                          std::optional<double> gemm1_clamp_limit,
                                          QuantDType fp8_dtype) {
  std::optional<GroupShape> w_shape;
  if (block_shape) {
    if (block_shape->size() != 2) {
      throw ValueError(fmt::format("block_shape must have two entries [block_n, block_k], got {}",
                                   block_shape->size()));
    }
    w_shape = GroupShape((*block_shape)[0], (*block_shape)[1]);
  }
  MoeQuantConfig qc;
  qc.a1 = MoeQuantDesc{};
  qc.a2 = MoeQuantDesc{};
  qc.w1 = MoeQuantDesc{fp8_dtype, w_shape, w1_scale, {}, {}, w1_bias};
  qc.w2 = MoeQuantDesc{fp8_dtype, w_shape, w2_scale, {}, {}, w2_bias};
  qc.gemm1_alpha = gemm1_alpha;
  qc.gemm1_beta = gemm1_beta;
  qc.gemm1_clamp_limit = gemm1_clamp_limit;
  return qc;
}

MoeQuantConfig make_fp8_moe_quant_config(Fp8MoeBackend backend, const Fp8QuantConfigInputs& in) {
  if (backend == Fp8MoeBackend::kCpuW8A8) {
    // The seed's CPU_W8A8 config: no biases, no a2_scale, no SwiGLU parameters.
    MoeQuantConfigArgs a;
    a.w1_scale = in.w1_scale;
    a.w2_scale = in.w2_scale;
    a.a1_scale = in.a1_scale;
    a.block_shape = in.block_shape;
    return fp8_w8a8_moe_quant_config(a, in.fp8_dtype);
  }

  // MARLIN and CPU (W8A16) are mixed precision W8A16 configs.
  if (backend == Fp8MoeBackend::kMarlin || backend == Fp8MoeBackend::kCpu) {
    return fp8_w8a16_moe_quant_config(in.w1_scale, in.w2_scale, in.w1_bias, in.w2_bias,
                                      in.block_shape, in.gemm1_alpha, in.gemm1_beta,
                                      in.swiglu_limit, in.fp8_dtype);
  }
  if (backend == Fp8MoeBackend::kHumming) {
    // vLLM asserts isinstance(layer, RoutedExperts) and reads the layer's Humming schemas.
    if (!in.layer) {
      throw ValueError(
          "make_fp8_moe_quant_config(HUMMING) needs the layer: the Humming quant config is built "
          "from the layer's Humming schemas");
    }
    // get_humming_moe_quant_config: 16-bit inputs -> unquantised activations, else per-token.
    // Weight group shape (fp8moe's reading of Humming's schema): block [bn, bk] -> (bk, bn),
    // MXFP8 (u8 / e8m0 scales) -> (32, 1), channel or tensor -> (-1, 1).
    const bool mx = in.w1_scale.defined() &&
                    (in.w1_scale.dtype() == DType::kU8 || in.w1_scale.dtype() == DType::kF8E8M0FNU);
    std::optional<GroupShape> w_shape;
    if (mx) {
      w_shape = GroupShape(32, 1);
    } else if (in.layer->weight_block_size && in.layer->weight_block_size->size() == 2) {
      w_shape = GroupShape((*in.layer->weight_block_size)[1], (*in.layer->weight_block_size)[0]);
    } else {
      w_shape = GroupShape(-1, 1);
    }
    MoeQuantConfig qc;
    if (in.layer->humming_quantizes_inputs) {
      qc.a1 = MoeQuantDesc{in.fp8_dtype, kPerToken, {}, {}, {}, {}};
      qc.a2 = qc.a1;
    }
    const QuantDType wd = mx ? QuantDType::kMxfp8 : in.fp8_dtype;
    qc.w1 = MoeQuantDesc{wd, w_shape, in.w1_scale, {}, {}, in.w1_bias};
    qc.w2 = MoeQuantDesc{wd, w_shape, in.w2_scale, {}, {}, in.w2_bias};
    qc.gemm1_alpha = in.gemm1_alpha;
    qc.gemm1_beta = in.gemm1_beta;
    qc.gemm1_clamp_limit = in.swiglu_limit;
    return qc;
  }

  // Flashinfer CUTLASS or HPC per-tensor uses single dq scale (alpha = w_scale * a_scale) and
  // inverse a2 scale. gemm1_alpha / gemm1_beta are not passed on in this branch (as in vLLM).
  if ((backend == Fp8MoeBackend::kFlashinferCutlass || backend == Fp8MoeBackend::kHpc) &&
      !in.block_shape) {
    if (!in.a1_scale.defined() || !in.a2_scale.defined()) {
      throw ValueError(fmt::format(
          "{} per-tensor FP8 needs static activation scales: a1_scale and a2_scale must be given",
          backend_value(backend)));
    }
    Tensor g1_alphas = mul_scales(in.w1_scale, in.a1_scale, "w1_scale", "a1_scale");
    Tensor g2_alphas = mul_scales(in.w2_scale, in.a2_scale, "w2_scale", "a2_scale");
    if (in.layer) {
      // layer.register_parameter("g1_alphas", ...): the config aliases the layer's tensors.
      in.layer->g1_alphas = g1_alphas;
      in.layer->g2_alphas = g2_alphas;
      g1_alphas = in.layer->g1_alphas;
      g2_alphas = in.layer->g2_alphas;
    }
    MoeQuantConfigArgs a;
    a.w1_scale = in.w1_scale;
    a.w2_scale = in.w2_scale;
    a.w1_bias = in.w1_bias;
    a.w2_bias = in.w2_bias;
    a.a1_scale = in.a1_scale;
    a.a2_scale = in.a2_scale;
    a.a1_gscale = reciprocal(in.a1_scale, "a1_scale");
    a.a2_gscale = reciprocal(in.a2_scale, "a2_scale");
    a.g1_alphas = g1_alphas;
    a.g2_alphas = g2_alphas;
    a.gemm1_clamp_limit = in.swiglu_limit;
    return fp8_w8a8_moe_quant_config(a, in.fp8_dtype);
  }

  // MXFP8 (block [1, 32]) dispatches to the mxfp8 activation quant with the non-swizzled
  // (num_tokens, hidden_dim // 32) uint8 UE8M0 scale layout for all backends.
  if (in.block_shape && *in.block_shape == std::vector<int64_t>{1, 32}) {
    MoeQuantConfigArgs a;
    a.quant_dtype = QuantDType::kMxfp8;
    a.w1_scale = in.w1_scale;
    a.w2_scale = in.w2_scale;
    a.w1_bias = in.w1_bias;
    a.w2_bias = in.w2_bias;
    a.a1_scale = in.a1_scale;
    a.a2_scale = in.a2_scale;
    a.block_shape = in.block_shape;
    a.is_scale_swizzled = false;
    a.gemm1_alpha = in.gemm1_alpha;
    a.gemm1_beta = in.gemm1_beta;
    a.gemm1_clamp_limit = in.swiglu_limit;
    return make_moe_quant_config(a);
  }

  // All other backends use the normal config.
  MoeQuantConfigArgs a;
  a.w1_scale = in.w1_scale;
  a.w2_scale = in.w2_scale;
  a.w1_bias = in.w1_bias;
  a.w2_bias = in.w2_bias;
  a.a1_scale = in.a1_scale;
  a.a2_scale = in.a2_scale;
  a.block_shape = in.block_shape;
  a.per_act_token_quant = in.per_act_token_quant;
  a.per_out_ch_quant = in.per_out_ch_quant;
  a.gemm1_alpha = in.gemm1_alpha;
  a.gemm1_beta = in.gemm1_beta;
  a.gemm1_clamp_limit = in.swiglu_limit;
  return fp8_w8a8_moe_quant_config(a, in.fp8_dtype);
}

nlohmann::ordered_json humming_fp8_weight_schema(const Fp8MoeLayerState& layer,
                                                 const TensorView& weight,
                                                 const TensorView& weight_scale) {
  // mxfp8: e8m0 group-32 scales (uint8 bytes or e8m0). Humming has no compressed-tensors mxfp8
  // loader; its modelopt schema fits both sources.
  if (weight_scale.dtype == DType::kU8 || weight_scale.dtype == DType::kF8E8M0FNU) {
    return {{"quant_method", "modelopt"}, {"quant_algo", "mxfp8"}};
  }
  if (layer.has_w13_weight_scale_inv) {
    if (!layer.weight_block_size) {
      // vLLM: assert hasattr(layer, "weight_block_size")
      throw ValueError("a layer with w13_weight_scale_inv must have a weight_block_size");
    }
    return {{"quant_method", "fp8"}, {"weight_block_size", *layer.weight_block_size}};
  }
  // fp8 (e4m3): recover the strategy from the scale layout.
  nlohmann::ordered_json config = {{"quant_method", "compressed-tensors"},
                                   {"format", "float-quantized"},
                                   {"type", "float"},
                                   {"num_bits", 8},
                                   {"symmetric", true}};
  if (weight.ndim < 2) {
    throw ValueError(fmt::format("the expert weight must be (E, N, K), got {}", weight.describe()));
  }
  const int64_t num_experts = weight.size(0), num_output = weight.size(-2);
  if (layer.weight_block_size) {
    config["strategy"] = "block";
    config["block_structure"] = *layer.weight_block_size;
  } else if (weight_scale.numel() >= num_experts * num_output) {
    config["strategy"] = "channel";
  } else {
    config["strategy"] = "tensor";
  }
  return config;
}

}  // namespace fp8moe
