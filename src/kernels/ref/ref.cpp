// The float64 reference fused MoE; see ref.hpp for what it computes and where it rounds.
#include "kernels/ref/ref.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "fp8moe/error.hpp"
#include "fp8moe/numerics.hpp"
#include "numerics/activation.hpp"
#include "numerics/quant.hpp"

namespace fp8moe::ref {

namespace num = fp8moe::numerics;

namespace {

// A row-major matrix of T.
template <class T>
struct Mat {
  int64_t rows = 0, cols = 0;
  std::vector<T> v;
  Mat() = default;
  Mat(int64_t r, int64_t c) : rows(r), cols(c), v(static_cast<std::size_t>(r * c), T(0)) {}
  T* row(int64_t r) { return v.data() + r * cols; }
  const T* row(int64_t r) const { return v.data() + r * cols; }
};

void require_cpu(const char* name, const TensorView& t) {
  if (t.defined() && !t.device.is_cpu()) {
    throw ValueError(
        fmt::format("ref::fused_moe runs on the CPU; {} is on {}", name, t.device.str()));
  }
}

// Routing: given ids/weights, or the reference routing of the logits.
struct Routes {
  int64_t M = 0;
  int topk = 0;
  std::vector<int32_t> ids;  // global ids, -1 = padded
  std::vector<float> w;
};

Routes get_routes(const TensorView& topk_ids, const TensorView& topk_weights,
                  const TensorView& logits, const RoutingConfig& routing, int64_t M) {
  Routes r;
  r.M = M;
  if (topk_ids.defined()) {
    r.topk = static_cast<int>(topk_ids.size(1));
    r.ids.assign(topk_ids.ptr<const int32_t>(), topk_ids.ptr<const int32_t>() + M * r.topk);
    r.w.assign(topk_weights.ptr<const float>(), topk_weights.ptr<const float>() + M * r.topk);
  } else {
    const RoutingResult rr = num::route(logits, routing);
    r.topk = routing.topk;
    r.ids.assign(rr.topk_ids.ptr<int32_t>(), rr.topk_ids.ptr<int32_t>() + M * r.topk);
    r.w.assign(rr.topk_weights.ptr<float>(), rr.topk_weights.ptr<float>() + M * r.topk);
  }
  return r;
}

// Local expert of a global id, or -1 (padded slot or another rank's expert).
int32_t local_expert(int32_t id, const TensorView& expert_map) {
  if (id < 0) return -1;
  if (!expert_map.defined()) return id;
  return expert_map.ptr<const int32_t>()[id];
}

// x as floats, with the router weight applied on the input when asked (vLLM:
// a1.mul_(topk_weights.to(a1.dtype)), i.e. in the activation dtype).
std::vector<float> load_x(const TensorView& x, const Routes& r, bool weight_on_input) {
  const int64_t n = x.numel(), H = x.size(1);
  const bool bf16 = x.dtype == DType::kBF16;
  std::vector<float> xs(static_cast<std::size_t>(n));
  for (int64_t i = 0; i < n; ++i) xs[i] = num::load_float(x, i);
  if (weight_on_input) {
    for (int64_t t = 0; t < x.size(0); ++t) {
      const float w = bf16 ? num::bf16_round(r.w[t * r.topk]) : r.w[t * r.topk];
      for (int64_t k = 0; k < H; ++k) {
        const float p = xs[t * H + k] * w;
        xs[t * H + k] = bf16 ? num::bf16_round(p) : p;
      }
    }
  }
  return xs;
}

// Quantises rows of `src` (rows x cols floats) with the scheme's activation quantisation and
// returns the dequantised values decode(q) * scale in T. `static_scale` for per-tensor static;
// `fused_floor` > 0 for the fused SiLU+quant kernel's scale floor.
template <class T>
Mat<T> quantize_rows(const std::vector<float>& src, int64_t rows, int64_t cols, const MoeScheme& sc,
                     float static_scale, float fused_floor, std::vector<float>* scales_out) {
  Mat<T> out(rows, cols);
  const DType fp8 = sc.fp8;
  std::vector<uint8_t> q(static_cast<std::size_t>(cols));
  const auto dequant = [&](int64_t r, int64_t c0, int64_t n, float s) {
    for (int64_t c = c0; c < c0 + n; ++c) {
      out.row(r)[c] = static_cast<T>(num::fp8_to_float(fp8, q[c])) * static_cast<T>(s);
    }
  };
  switch (sc.act) {
    case ActQuantKind::kNone:
      for (int64_t i = 0; i < rows * cols; ++i) out.v[i] = static_cast<T>(src[i]);
      return out;
    case ActQuantKind::kPerTensorStatic:
    case ActQuantKind::kPerTensorDynamic: {
      float s = static_scale;
      if (sc.act == ActQuantKind::kPerTensorDynamic) {
        s = num::per_tensor_dynamic_scale(num::absmax(src.data(), rows * cols), fp8);
        if (scales_out) scales_out->push_back(s);
      }
      for (int64_t r = 0; r < rows; ++r) {
        num::quantize_per_tensor_fp8(src.data() + r * cols, cols, s, q.data(), fp8);
        dequant(r, 0, cols, s);
      }
      return out;
    }
    case ActQuantKind::kPerTokenDynamic:
      for (int64_t r = 0; r < rows; ++r) {
        const float s = num::quantize_row_per_token_fp8(src.data() + r * cols, cols, q.data(), fp8);
        if (scales_out) scales_out->push_back(s);
        dequant(r, 0, cols, s);
      }
      return out;
    case ActQuantKind::kPerGroupDynamic: {
      const int64_t g = sc.group_k;
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t c0 = 0; c0 < cols; c0 += g) {
          const float s = num::quantize_group_fp8(src.data() + r * cols + c0, g, q.data() + c0, fp8,
                                                  sc.ue8m0_scales, fused_floor);
          if (scales_out) scales_out->push_back(s);
          dequant(r, c0, g, s);
        }
      }
      return out;
    }
    case ActQuantKind::kMxfp8:
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t c0 = 0; c0 < cols; c0 += num::kMxGroupSize) {
          const uint8_t code =
              num::quantize_mx_group(src.data() + r * cols + c0, num::kMxGroupSize, q.data() + c0);
          const float s = num::e8m0_to_float(code);
          if (scales_out) scales_out->push_back(s);
          dequant(r, c0, num::kMxGroupSize, s);
        }
      }
      return out;
  }
  return out;
}

// Dequantised weights of one expert: (rows, cols) in T, value = decode(q) * scale.
template <class T>
Mat<T> dequant_weight(const TensorView& w, const TensorView& scale, const MoeScheme& sc, int64_t e,
                      bool is_w13, bool interleaved) {
  const int64_t R = w.size(1), C = w.size(2);
  Mat<T> out(R, C);
  const uint8_t* q = w.ptr<const uint8_t>() + e * R * C;
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t c = 0; c < C; ++c) {
      float s = 1.0f;
      switch (sc.weight) {
        case WeightScaleKind::kBlock: {
          const int64_t nb = scale.size(1), kb = scale.size(2);
          s = scale.ptr<const float>()[(e * nb + r / sc.block_n) * kb + c / sc.block_k];
          break;
        }
        case WeightScaleKind::kPerTensor:
          if (is_w13 && scale.ndim == 2) {
            const int64_t shard = interleaved ? (r % 2) : (r >= R / 2 ? 1 : 0);
            s = scale.ptr<const float>()[e * 2 + shard];
          } else {
            s = scale.ptr<const float>()[e];
          }
          break;
        case WeightScaleKind::kPerChannel:
          s = scale.ptr<const float>()[e * R + r];
          break;
        case WeightScaleKind::kMx:
          s = num::e8m0_to_float(scale.ptr<const uint8_t>()[(e * R + r) * (C / 32) + c / 32]);
          break;
      }
      out.row(r)[c] = static_cast<T>(num::fp8_to_float(sc.fp8, q[r * C + c])) * static_cast<T>(s);
    }
  }
  return out;
}

// dot(a, b) over n values, forward or backward.
template <class T>
T dot(const T* a, const T* b, int64_t n, bool reverse) {
  T acc = T(0);
  if (reverse) {
    for (int64_t k = n - 1; k >= 0; --k) acc += a[k] * b[k];
  } else {
    for (int64_t k = 0; k < n; ++k) acc += a[k] * b[k];
  }
  return acc;
}

float bias_at(const TensorView& b, int64_t i) { return b.defined() ? num::load_float(b, i) : 0.0f; }

template <class T>
void run(const FusedMoeArgs& a, bool reverse, detail::Trace* trace) {
  validate_fused_moe_args(a);
  for (const auto& [name, t] : {std::pair<const char*, const TensorView*>{"x", &a.x},
                                {"out", &a.out},
                                {"w13", &a.weights.w13},
                                {"router_logits", &a.router_logits},
                                {"topk_ids", &a.topk_ids},
                                {"expert_map", &a.expert_map}}) {
    require_cpu(name, *t);
  }
  const MoeScheme& sc = a.scheme;
  const int64_t M = a.x.size(0), H = a.x.size(1);
  const int64_t E = a.weights.w13.size(0), I = a.weights.w2.size(2);
  const bool gated = activation_is_gated(a.act.activation);
  const bool interleaved = a.act.activation == MoeActivation::kSwigluOai;
  const int64_t N1 = gated ? 2 * I : I;
  const bool bf16 = a.x.dtype == DType::kBF16;
  num::check_activation_config(a.act);
  if (M == 0) return;

  const Routes rt = get_routes(a.topk_ids, a.topk_weights, a.router_logits, a.routing, M);
  const int K = rt.topk;
  const bool mul_weight = !a.apply_router_weight_on_input;

  // 1. The input, optionally weighted, quantised once for all M tokens.
  const std::vector<float> xs = load_x(a.x, rt, a.apply_router_weight_on_input);
  if (trace) trace->x_amax = num::absmax(xs.data(), M * H);
  const float s13 =
      sc.act == ActQuantKind::kPerTensorStatic ? num::load_float(a.weights.a13_scale, 0) : 0.0f;
  const Mat<T> A1 = quantize_rows<T>(xs, M, H, sc, s13, 0.0f, trace ? &trace->a1_scales : nullptr);

  // Dequantised weights of the experts that receive tokens.
  std::vector<Mat<T>> W13(static_cast<std::size_t>(E)), W2(static_cast<std::size_t>(E));
  std::vector<char> used(static_cast<std::size_t>(E), 0);
  for (int32_t id : rt.ids) {
    const int32_t e = local_expert(id, a.expert_map);
    if (e >= 0) used[e] = 1;
  }
  for (int64_t e = 0; e < E; ++e) {
    if (!used[e]) continue;
    W13[e] = dequant_weight<T>(a.weights.w13, a.weights.w13_scale, sc, e, true, interleaved);
    W2[e] = dequant_weight<T>(a.weights.w2, a.weights.w2_scale, sc, e, false, interleaved);
  }

  // 2. GEMM1 + bias, rounded to the compute dtype, then the activation, for every valid slot.
  const int64_t slots = M * K;
  std::vector<int32_t> slot_expert(static_cast<std::size_t>(slots));
  std::vector<int64_t> valid;  // slot indices with a local expert
  for (int64_t s = 0; s < slots; ++s) {
    slot_expert[s] = local_expert(rt.ids[s], a.expert_map);
    if (slot_expert[s] >= 0) valid.push_back(s);
  }
  const int64_t V = static_cast<int64_t>(valid.size());
  std::vector<float> hs(static_cast<std::size_t>(V * I));
  std::vector<float> y1(static_cast<std::size_t>(N1));
  for (int64_t v = 0; v < V; ++v) {
    const int64_t s = valid[v], t = s / K;
    const int32_t e = slot_expert[s];
    for (int64_t n = 0; n < N1; ++n) {
      T acc = dot<T>(A1.row(t), W13[e].row(n), H, reverse);
      acc += static_cast<T>(bias_at(a.weights.w13_bias, e * N1 + n));
      y1[n] = num::round_to<T>(acc, bf16);
    }
    float* h = hs.data() + v * I;
    if (sc.fuse_silu_quant) {
      // Snapshot fast path: silu(g) * u kept in fp32, no rounding, clamp ignored (vLLM oddity).
      num::silu_mul_fp32_row<T>(y1.data(), I, h);
    } else {
      num::apply_activation_row<T>(a.act, y1.data(), I, bf16, h);
    }
  }
  if (trace) trace->h_amax = num::absmax(hs.data(), V * I);

  // 3. Quantise h (the fused path floors the group scale at 1/(fp8_max*512)).
  const float s2 =
      sc.act == ActQuantKind::kPerTensorStatic ? num::load_float(a.weights.a2_scale, 0) : 0.0f;
  const float floor2 = sc.fuse_silu_quant ? num::min_scaling_factor(sc.fp8) : 0.0f;
  const Mat<T> A2 = quantize_rows<T>(hs, V, I, sc, s2, floor2, trace ? &trace->a2_scales : nullptr);

  // 4. GEMM2 + bias, times the router weight, rounded; 5. the sum over slots, rounded.
  std::vector<float> y2(static_cast<std::size_t>(slots * H), 0.0f);
  for (int64_t v = 0; v < V; ++v) {
    const int64_t s = valid[v];
    const int32_t e = slot_expert[s];
    const T w = static_cast<T>(rt.w[s]);
    for (int64_t m = 0; m < H; ++m) {
      T acc = dot<T>(A2.row(v), W2[e].row(m), I, reverse);
      acc += static_cast<T>(bias_at(a.weights.w2_bias, e * H + m));
      if (mul_weight) acc *= w;
      y2[s * H + m] = num::round_to<T>(acc, bf16);
    }
  }
  for (int64_t t = 0; t < M; ++t) {
    for (int64_t m = 0; m < H; ++m) {
      T acc = T(0);
      for (int j = 0; j < K; ++j) {
        const int jj = reverse ? K - 1 - j : j;
        acc += static_cast<T>(y2[(t * K + jj) * H + m]);
      }
      // f32 out with bf16 x: a partial output for an EP/TP reduction; the top-k sum is kept in
      // f32 (rounded once from T) and the caller rounds the reduced value once.
      const bool out_bf16 = a.out.dtype == DType::kBF16;
      const float o = num::round_to<T>(acc, out_bf16);
      if (out_bf16) {
        a.out.ptr<uint16_t>()[t * H + m] = num::float_to_bf16(o);
      } else {
        a.out.ptr<float>()[t * H + m] = o;
      }
    }
  }
}

void check_unquantized(const UnquantizedMoeArgs& a) {
  const auto fail = [](const std::string& m) { throw ValueError("fused_moe_unquantized: " + m); };
  if (!a.x.defined() || a.x.ndim != 2 || (a.x.dtype != DType::kBF16 && a.x.dtype != DType::kF32)) {
    fail(fmt::format("x must be (num_tokens, hidden) bf16/f32, got {}", a.x.describe()));
  }
  const int64_t M = a.x.size(0), H = a.x.size(1);
  if (!a.out.defined() || a.out.sizes() != a.x.sizes() || a.out.dtype != a.x.dtype) {
    fail(fmt::format("out must match x {}, got {}", a.x.describe(), a.out.describe()));
  }
  const auto real = [](const TensorView& t) {
    return t.defined() && t.ndim == 3 && (t.dtype == DType::kF32 || t.dtype == DType::kBF16) &&
           t.is_contiguous();
  };
  if (!real(a.w13) || !real(a.w2)) {
    fail(fmt::format("w13 and w2 must be 3-D f32/bf16 real weights, got {} and {}",
                     a.w13.describe(), a.w2.describe()));
  }
  const int64_t E = a.w13.size(0), I = a.w2.size(2);
  const int64_t N1 = activation_is_gated(a.act.activation) ? 2 * I : I;
  if (a.w13.sizes() != std::vector<int64_t>{E, N1, H} ||
      a.w2.sizes() != std::vector<int64_t>{E, H, I}) {
    fail(fmt::format("w13 {} must be ({}, {}, {}) and w2 {} must be ({}, {}, {})", a.w13.describe(),
                     E, N1, H, a.w2.describe(), E, H, I));
  }
  if (a.w13_bias.defined() && a.w13_bias.sizes() != std::vector<int64_t>{E, N1}) {
    fail(fmt::format("w13_bias {} must be ({}, {})", a.w13_bias.describe(), E, N1));
  }
  if (a.w2_bias.defined() && a.w2_bias.sizes() != std::vector<int64_t>{E, H}) {
    fail(fmt::format("w2_bias {} must be ({}, {})", a.w2_bias.describe(), E, H));
  }
  if (a.topk_ids.defined()) {
    if (a.topk_ids.ndim != 2 || a.topk_ids.size(0) != M || a.topk_ids.dtype != DType::kI32 ||
        a.topk_weights.sizes() != a.topk_ids.sizes() || a.topk_weights.dtype != DType::kF32) {
      fail(fmt::format("topk_ids {} / topk_weights {} must be (num_tokens, topk) i32 / f32",
                       a.topk_ids.describe(), a.topk_weights.describe()));
    }
    const int64_t eg = a.expert_map.defined() ? a.expert_map.size(0) : E;
    for (int64_t i = 0; i < a.topk_ids.numel(); ++i) {
      const int32_t id = a.topk_ids.ptr<const int32_t>()[i];
      if (id < -1 || id >= eg) fail(fmt::format("topk id {} is outside [-1, {})", id, eg));
    }
  }
  if (a.expert_map.defined()) {
    for (int64_t g = 0; g < a.expert_map.numel(); ++g) {
      const int32_t l = a.expert_map.ptr<const int32_t>()[g];
      if (l < -1 || l >= E) fail(fmt::format("expert_map[{}] = {} is outside [-1, {})", g, l, E));
    }
  }
  if (!a.topk_ids.defined()) {
    const int64_t eg = a.expert_map.defined() ? a.expert_map.size(0) : E;
    if (!a.router_logits.defined() || a.router_logits.ndim != 2 || a.router_logits.size(0) != M ||
        a.router_logits.size(1) != eg) {
      fail(fmt::format("router_logits {} must be ({}, {}) when topk_ids is absent",
                       a.router_logits.describe(), M, eg));
    }
  }
  if (a.apply_router_weight_on_input &&
      (a.topk_ids.defined() ? a.topk_ids.size(1) : a.routing.topk) != 1) {
    fail("apply_router_weight_on_input needs topk == 1");
  }
}

}  // namespace

namespace {
// The batched (masked) format on top of the standard one: the valid rows of every slab become one
// batch of tokens with top-1 routing to their slab's expert and weight 1 (exact), so quantisation
// (per-tensor dynamic scales included) sees the same rows as the standard format would; each
// result row goes back to its slab position. Rows past expert_num_tokens[e] are untouched.
template <class T>
void run_batched(const FusedMoeArgs& a, bool reverse, detail::Trace* trace) {
  validate_fused_moe_args(a);
  require_cpu("x", a.x);
  require_cpu("out", a.out);
  require_cpu("expert_num_tokens", a.expert_num_tokens);
  const int64_t E = a.x.size(0), max_m = a.x.size(1), H = a.x.size(2);
  const std::size_t row_bytes = static_cast<std::size_t>(H) * dtype_size(a.x.dtype);
  const int32_t* counts = a.expert_num_tokens.ptr<const int32_t>();
  int64_t rows = 0;
  for (int64_t e = 0; e < E; ++e) rows += counts[e];
  Tensor x = Tensor::empty({rows, H}, a.x.dtype);
  Tensor out = Tensor::empty({rows, H}, a.out.dtype);
  const std::size_t out_row_bytes = static_cast<std::size_t>(H) * dtype_size(a.out.dtype);
  Tensor ids = Tensor::empty({rows, 1}, DType::kI32);
  Tensor w = Tensor::empty({rows, 1}, DType::kF32);
  int64_t r = 0;
  for (int64_t e = 0; e < E; ++e) {
    for (int64_t m = 0; m < counts[e]; ++m, ++r) {
      std::memcpy(static_cast<char*>(x.data()) + r * row_bytes,
                  static_cast<const char*>(a.x.data) + (e * max_m + m) * row_bytes, row_bytes);
      ids.ptr<int32_t>()[r] = static_cast<int32_t>(e);
      w.ptr<float>()[r] = 1.0f;
    }
  }
  FusedMoeArgs s = a;
  s.expert_num_tokens = {};
  s.x = x;
  s.out = out;
  s.topk_ids = ids;
  s.topk_weights = w;
  s.routing.topk = 1;
  run<T>(s, reverse, trace);
  r = 0;
  for (int64_t e = 0; e < E; ++e) {
    for (int64_t m = 0; m < counts[e]; ++m, ++r) {
      std::memcpy(static_cast<char*>(a.out.data) + (e * max_m + m) * out_row_bytes,
                  static_cast<const char*>(out.data()) + r * out_row_bytes, out_row_bytes);
    }
  }
}
}  // namespace

void fused_moe(const FusedMoeArgs& args) {
  if (args.batched()) {
    run_batched<double>(args, false, nullptr);
  } else {
    run<double>(args, false, nullptr);
  }
}

namespace detail {
void fused_moe_with(const FusedMoeArgs& args, const Options& o, Trace* trace) {
  if (args.batched()) {
    if (o.float32) {
      run_batched<float>(args, o.reverse, trace);
    } else {
      run_batched<double>(args, o.reverse, trace);
    }
  } else if (o.float32) {
    run<float>(args, o.reverse, trace);
  } else {
    run<double>(args, o.reverse, trace);
  }
}
}  // namespace detail

void fused_moe_unquantized(const UnquantizedMoeArgs& a) {
  check_unquantized(a);
  const int64_t M = a.x.size(0), H = a.x.size(1);
  if (M == 0) return;
  const int64_t I = a.w2.size(2);
  const bool gated = activation_is_gated(a.act.activation);
  const int64_t N1 = gated ? 2 * I : I;
  num::check_activation_config(a.act);
  const Routes rt = get_routes(a.topk_ids, a.topk_weights, a.router_logits, a.routing, M);
  const int K = rt.topk;
  std::vector<double> xs(static_cast<std::size_t>(M * H));
  for (int64_t t = 0; t < M; ++t) {
    const double w = a.apply_router_weight_on_input ? rt.w[t * K] : 1.0;
    for (int64_t k = 0; k < H; ++k) xs[t * H + k] = num::load_float(a.x, t * H + k) * w;
  }
  // Real weights of the experts that receive tokens, as doubles.
  const int64_t E = a.w13.size(0);
  std::vector<std::vector<double>> W13(static_cast<std::size_t>(E)),
      W2(static_cast<std::size_t>(E));
  for (int32_t id : rt.ids) {
    const int32_t e = local_expert(id, a.expert_map);
    if (e < 0 || !W13[e].empty()) continue;
    W13[e].resize(static_cast<std::size_t>(N1 * H));
    for (int64_t i = 0; i < N1 * H; ++i) W13[e][i] = num::load_float(a.w13, e * N1 * H + i);
    W2[e].resize(static_cast<std::size_t>(H * I));
    for (int64_t i = 0; i < H * I; ++i) W2[e][i] = num::load_float(a.w2, e * H * I + i);
  }
  std::vector<float> y1(static_cast<std::size_t>(N1)), h(static_cast<std::size_t>(I));
  std::vector<double> hd(static_cast<std::size_t>(I));
  std::vector<double> acc_out(static_cast<std::size_t>(H));
  for (int64_t t = 0; t < M; ++t) {
    std::fill(acc_out.begin(), acc_out.end(), 0.0);
    for (int j = 0; j < K; ++j) {
      const int32_t e = local_expert(rt.ids[t * K + j], a.expert_map);
      if (e < 0) continue;
      for (int64_t n = 0; n < N1; ++n) {
        const double acc = dot<double>(xs.data() + t * H, W13[e].data() + n * H, H, false);
        y1[n] = static_cast<float>(acc + bias_at(a.w13_bias, e * N1 + n));
      }
      num::apply_activation_row<double>(a.act, y1.data(), I, /*bf16=*/false, h.data());
      for (int64_t i = 0; i < I; ++i) hd[i] = h[i];
      const double w = a.apply_router_weight_on_input ? 1.0 : rt.w[t * K + j];
      for (int64_t m = 0; m < H; ++m) {
        const double acc = dot<double>(hd.data(), W2[e].data() + m * I, I, false);
        acc_out[m] += (acc + bias_at(a.w2_bias, e * H + m)) * w;
      }
    }
    for (int64_t m = 0; m < H; ++m) {
      const float o = static_cast<float>(acc_out[m]);
      if (a.out.dtype == DType::kBF16) {
        a.out.ptr<uint16_t>()[t * H + m] = num::float_to_bf16(o);
      } else {
        a.out.ptr<float>()[t * H + m] = o;
      }
    }
  }
}

RoutingResult route(const TensorView& logits, const RoutingConfig& cfg) {
  return num::route(logits, cfg);
}

namespace {
bool ref_available() { return true; }
std::size_t ref_workspace(const FusedMoeArgs&) { return 0; }
void ref_run(const FusedMoeArgs& args, void*) { fused_moe(args); }
}  // namespace

const ExpertsImpl& ref_experts_impl() {
  static const ExpertsImpl impl = [] {
    ExpertsImpl i;
    i.name = "ref";
    i.device = DeviceKind::kCpu;
    i.f32_partial_out = true;
    i.supports_config = nullptr;  // everything the contract allows
    i.available = &ref_available;
    i.workspace_size = &ref_workspace;
    i.run = &ref_run;
    return i;
  }();
  return impl;
}

}  // namespace fp8moe::ref
