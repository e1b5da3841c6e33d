// fp8moe run --check: a layer's output against the float64 reference on the same quantised weights
// (bitwise and vLLM's assert_close tolerance) and against the unquantised layer (what FP8 costs),
// with the metrics vLLM's tests use.
#include <fmt/format.h>

#include <cmath>
#include <cstring>

#include "fp8moe/error.hpp"
#include "fp8moe/layer.hpp"
#include "fp8moe/numerics.hpp"
#include "kernels/ref/ref.hpp"
#include "layer/layer_internal.hpp"
#include "numerics/quant.hpp"

namespace fp8moe {

using layer_detail::on_host;

namespace {

double element(const TensorView& t, int64_t i) {
  switch (t.dtype) {
    case DType::kF64:
      return t.ptr<const double>()[i];
    case DType::kF32:
      return t.ptr<const float>()[i];
    case DType::kBF16:
      return numerics::bf16_to_float(t.ptr<const uint16_t>()[i]);
    case DType::kF16:
      return numerics::f16_to_float(t.ptr<const uint16_t>()[i]);
    default:
      throw ValueError(fmt::format("compare_outputs: {} is not a floating tensor", t.describe()));
  }
}

Tensor host_copy(const TensorView& v) {
  if (v.device.is_cpu()) {
    auto shape = v.sizes();
    Tensor t = Tensor::empty(std::span<const int64_t>(shape), v.dtype);
    if (v.nbytes()) std::memcpy(t.data(), v.data, v.nbytes());
    return t;
  }
  // A device view: wrap without ownership and copy through the tensor hooks.
  auto shape = v.sizes();
  Tensor dst = Tensor::empty(std::span<const int64_t>(shape), v.dtype);
  const auto& a = device_allocator();
  if (!a.copy)
    throw RuntimeError("device copy requested but this fp8moe build has no CUDA support");
  if (v.nbytes()) a.copy(dst.data(), v.data, v.nbytes(), 1);
  return dst;
}

// f64 dequantised weights -> f32 (the product of an fp8 value and an f32 scale, rounded once).
Tensor to_f32(const Tensor& d) {
  auto shape = d.sizes();
  Tensor f = Tensor::empty(std::span<const int64_t>(shape), DType::kF32);
  for (int64_t i = 0; i < d.numel(); ++i)
    f.ptr<float>()[i] = static_cast<float>(d.ptr<double>()[i]);
  return f;
}

Tensor dequantize(const Tensor& q, const Tensor& scale, const MoeScheme& s) {
  switch (s.weight) {
    case WeightScaleKind::kBlock:
      return to_f32(numerics::dequantize_block(q, scale, s.block_n, s.block_k));
    case WeightScaleKind::kPerTensor:
    case WeightScaleKind::kPerChannel:
      return to_f32(numerics::dequantize_rows(q, scale));
    case WeightScaleKind::kMx:
      break;
  }
  throw NotImplementedError("check_forward: MXFP8 weights are not dequantised here");
}

}  // namespace

OutputComparison compare_outputs(const TensorView& actual, const TensorView& expected, double atol,
                                 double rtol) {
  if (actual.sizes() != expected.sizes() || actual.dtype != expected.dtype) {
    throw ValueError(fmt::format("compare_outputs: {} and {} differ in shape or dtype",
                                 actual.describe(), expected.describe()));
  }
  if (!actual.device.is_cpu() || !expected.device.is_cpu()) {
    throw ValueError("compare_outputs: host tensors only");
  }
  OutputComparison c;
  c.atol = atol;
  c.rtol = rtol;
  c.count = actual.numel();
  const std::size_t es = dtype_size(actual.dtype);
  double sum_abs_err = 0, sum_abs_ref = 0;
  for (int64_t i = 0; i < c.count; ++i) {
    const double a = element(actual, i), e = element(expected, i);
    if (std::memcmp(static_cast<const uint8_t*>(actual.data) + i * es,
                    static_cast<const uint8_t*>(expected.data) + i * es, es) != 0) {
      ++c.bitwise_mismatches;
    }
    if (std::isnan(a) || std::isnan(e)) {
      if (std::isnan(a) != std::isnan(e)) {
        ++c.nan_mismatches;
        ++c.over_tolerance;
      }
      continue;
    }
    const double err = std::fabs(a - e);
    c.max_abs_err = std::max(c.max_abs_err, err);
    if (e != 0) c.max_rel_err = std::max(c.max_rel_err, err / std::fabs(e));
    if (err > atol + rtol * std::fabs(e)) ++c.over_tolerance;
    sum_abs_err += err;
    sum_abs_ref += std::fabs(e);
  }
  c.bitwise_equal = c.bitwise_mismatches == 0;
  c.allclose = c.over_tolerance == 0;
  c.mean_rel_abs_err =
      sum_abs_ref > 0 ? sum_abs_err / sum_abs_ref : (sum_abs_err > 0 ? INFINITY : 0);
  return c;
}

ForwardCheck check_forward(const Fp8MoeLayer& layer, const TensorView& x,
                           const TensorView& router_logits, const TensorView& out,
                           const TensorView& real_w13, const TensorView& real_w2) {
  const Fp8MoeLayerPlan& plan = layer.plan();
  if (layer.weights().layout != WeightLayout::kCanonical) {
    throw NotImplementedError(fmt::format(
        "check_forward: the layer's weights are in the {} layout; the reference reads the "
        "canonical one",
        weight_layout_name(layer.weights().layout)));
  }
  ForwardCheck r;
  r.reference_is_kernel = plan.implementation == "ref";
  const Tensor xh = host_copy(x), lh = host_copy(router_logits), oh = host_copy(out);
  // Host copies of the prepared weights (the same tensors when the layer is on the host).
  const PreparedMoeWeights& w = layer.weights();
  PreparedMoeWeights hw = w;
  for (Tensor* t : {&hw.w13, &hw.w2, &hw.w13_scale, &hw.w2_scale, &hw.w13_bias, &hw.w2_bias,
                    &hw.a13_scale, &hw.a2_scale, &hw.expert_map}) {
    *t = on_host(*t);
  }
  Tensor bias_h;
  FusedMoeArgs a = layer.make_args(xh, lh, {});
  if (a.routing.e_score_correction_bias.defined()) {
    bias_h = host_copy(a.routing.e_score_correction_bias);
    a.routing.e_score_correction_bias = bias_h.view();
  }
  a.weights = hw.views();
  if (hw.expert_map.defined()) a.expert_map = hw.expert_map.view();
  a.stream = nullptr;
  r.reference_out = Tensor::empty({xh.size(0), xh.size(1)}, xh.dtype());
  a.out = r.reference_out.view();
  ref::fused_moe(a);
  r.vs_reference = compare_outputs(oh, r.reference_out);

  // The unquantised layer.
  ref::UnquantizedMoeArgs u;
  u.x = xh.view();
  u.router_logits = lh.view();
  u.routing = a.routing;
  Tensor rw13, rw2;
  if (real_w13.defined() && real_w2.defined()) {
    rw13 = host_copy(real_w13);
    rw2 = host_copy(real_w2);
    r.unquantized_weights = "the original real-valued weights";
  } else {
    rw13 = dequantize(hw.w13, hw.w13_scale, plan.scheme);
    rw2 = dequantize(hw.w2, hw.w2_scale, plan.scheme);
    r.unquantized_weights =
        "the dequantised fp8 weights (no real-valued weights given: this measures activation "
        "quantisation and rounding only)";
  }
  u.w13 = rw13.view();
  u.w2 = rw2.view();
  if (hw.w13_bias.defined()) u.w13_bias = hw.w13_bias.view();
  if (hw.w2_bias.defined()) u.w2_bias = hw.w2_bias.view();
  u.act = a.act;
  u.expert_map = a.expert_map;
  u.apply_router_weight_on_input = a.apply_router_weight_on_input;
  r.unquantized_out = Tensor::empty({xh.size(0), xh.size(1)}, xh.dtype());
  u.out = r.unquantized_out.view();
  ref::fused_moe_unquantized(u);
  r.vs_unquantized = compare_outputs(oh, r.unquantized_out);
  return r;
}

}  // namespace fp8moe
