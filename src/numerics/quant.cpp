// FP8 quantisers with vLLM's semantics; see quant.hpp for the rules and their sources.
#include "numerics/quant.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "fp8moe/error.hpp"

namespace fp8moe::numerics {

namespace {

bool is_float_dtype(DType t) {
  return t == DType::kF32 || t == DType::kBF16 || t == DType::kF16 || t == DType::kF64;
}

void require_fp8(DType fp8, const char* what) {
  if (fp8 != DType::kF8E4M3FN && fp8 != DType::kF8E4M3FNUZ && fp8 != DType::kF8E5M2) {
    throw ValueError(
        fmt::format("{}: expected an fp8 dtype (fp8_e4m3fn, fp8_e4m3fnuz, fp8_e5m2), "
                    "got {}",
                    what, dtype_name(fp8)));
  }
}

void require_input(const TensorView& t, const char* what, int min_ndim, int max_ndim) {
  if (!t.defined() || t.ndim < min_ndim || t.ndim > max_ndim) {
    throw ValueError(fmt::format("{}: expected a {}-D to {}-D tensor, got {}", what, min_ndim,
                                 max_ndim, t.describe()));
  }
  if (!is_float_dtype(t.dtype)) {
    throw ValueError(
        fmt::format("{}: expected an f32/bf16/f16 tensor, got {}", what, t.describe()));
  }
  if (!t.device.is_cpu()) {
    throw ValueError(fmt::format("{}: expected a cpu tensor, got {}", what, t.describe()));
  }
  if (!t.is_contiguous()) {
    throw ValueError(fmt::format("{}: expected a contiguous tensor, got {}", what, t.describe()));
  }
}

// All values of a floating tensor as float.
std::vector<float> to_floats(const TensorView& t) {
  std::vector<float> v(static_cast<std::size_t>(t.numel()));
  for (int64_t i = 0; i < t.numel(); ++i) v[static_cast<std::size_t>(i)] = load_float(t, i);
  return v;
}

// (E, R, C) view of a 2-D or 3-D shape.
struct Dims3 {
  int64_t e, r, c;
};
Dims3 dims3(const TensorView& t) {
  return t.ndim == 3 ? Dims3{t.size(0), t.size(1), t.size(2)} : Dims3{1, t.size(0), t.size(1)};
}

std::vector<int64_t> scale_shape(const TensorView& w, std::initializer_list<int64_t> tail) {
  std::vector<int64_t> s;
  if (w.ndim == 3) s.push_back(w.size(0));
  s.insert(s.end(), tail.begin(), tail.end());
  return s;
}

uint8_t encode_nonsat(DType fp8, float v) {
  switch (fp8) {
    case DType::kF8E4M3FNUZ:
      return float_to_e4m3fnuz_nonsat(v);
    case DType::kF8E5M2:
      return float_to_e5m2_nonsat(v);
    default:
      return float_to_e4m3fn_nonsat(v);
  }
}

}  // namespace

float load_float(const TensorView& t, int64_t i) {
  switch (t.dtype) {
    case DType::kF32:
      return t.ptr<const float>()[i];
    case DType::kBF16:
      return bf16_to_float(t.ptr<const uint16_t>()[i]);
    case DType::kF16:
      return f16_to_float(t.ptr<const uint16_t>()[i]);
    case DType::kF64:
      return static_cast<float>(t.ptr<const double>()[i]);
    default:
      throw ValueError(fmt::format("load_float: tensor {} is not floating", t.describe()));
  }
}

// ---- row functions ------------------------------------------------------------------------------

float quantize_group_fp8(const float* x, int64_t n, uint8_t* q, DType fp8, bool ue8m0,
                         float min_scale) {
  const float fmax = quant_fp8_max(fp8);
  float s = absmax(x, n, kGroupQuantEps) / fmax;
  if (ue8m0) s = ceil_pow2(std::fmax(std::fabs(s), kGroupQuantEps));
  s = std::fmax(s, min_scale);
  for (int64_t i = 0; i < n; ++i) q[i] = float_to_fp8(fp8, clamp_group_style(x[i] / s, fmax));
  return s;
}

float quantize_row_per_token_fp8(const float* x, int64_t n, uint8_t* q, DType fp8) {
  const float fmax = quant_fp8_max(fp8);
  const float s = std::fmax(absmax(x, n) / fmax, min_scaling_factor(fp8));
  for (int64_t i = 0; i < n; ++i) {
    q[i] = float_to_fp8(fp8, clamp_conversion_style(x[i] / s, fmax));
  }
  return s;
}

void quantize_per_tensor_fp8(const float* x, int64_t n, float scale, uint8_t* q, DType fp8) {
  const float fmax = quant_fp8_max(fp8);
  const float inv = 1.0f / scale;
  for (int64_t i = 0; i < n; ++i) {
    q[i] = float_to_fp8(fp8, clamp_conversion_style(x[i] * inv, fmax));
  }
}

uint8_t quantize_mx_group(const float* x, int64_t n, uint8_t* q) {
  // amax.clamp(min=finfo(float32).tiny), then the biased exponent of amax/448 rounded up.
  const float amax = std::fmax(absmax(x, n), 0x1p-126f);
  const uint8_t code = e8m0_ceil(amax / kE4M3FnMax);
  const float scale = e8m0_to_float(code);
  for (int64_t i = 0; i < n; ++i) q[i] = float_to_e4m3fn(x[i] / scale);
  return code;
}

// ---- weight tensors -----------------------------------------------------------------------------

QuantizedTensor per_block_cast_to_fp8(const TensorView& w, int64_t bn, int64_t bk, DType fp8,
                                      bool ue8m0) {
  require_input(w, "per_block_cast_to_fp8 input", 2, 3);
  require_fp8(fp8, "per_block_cast_to_fp8");
  if (bn <= 0 || bk <= 0) {
    throw ValueError(
        fmt::format("per_block_cast_to_fp8: block shape [{}, {}] must be positive", bn, bk));
  }
  const Dims3 d = dims3(w);
  const int64_t nb = (d.r + bn - 1) / bn, kb = (d.c + bk - 1) / bk;
  const auto xs = to_floats(w);
  QuantizedTensor out;
  const auto qshape = w.sizes();
  out.q = Tensor::empty(std::span<const int64_t>(qshape), fp8);
  const auto sshape = scale_shape(w, {nb, kb});
  out.scale = Tensor::empty(std::span<const int64_t>(sshape), DType::kF32);
  auto* q = out.q.ptr<uint8_t>();
  auto* sc = out.scale.ptr<float>();
  const float fmax = quant_fp8_max(fp8);
  for (int64_t e = 0; e < d.e; ++e) {
    for (int64_t bi = 0; bi < nb; ++bi) {
      for (int64_t bj = 0; bj < kb; ++bj) {
        // Zero padding never raises the amax, so the block amax over the real elements is it.
        float amax = 0.0f;
        for (int64_t r = bi * bn; r < std::min(d.r, (bi + 1) * bn); ++r) {
          for (int64_t c = bj * bk; c < std::min(d.c, (bj + 1) * bk); ++c) {
            amax =
                std::fmax(amax, std::fabs(xs[static_cast<std::size_t>((e * d.r + r) * d.c + c)]));
          }
        }
        amax = std::fmax(amax, kBlockCastAmaxFloor);
        float s = amax / fmax;
        if (ue8m0) s = ceil_pow2(s);
        const float inv = 1.0f / s;
        sc[(e * nb + bi) * kb + bj] = s;
        for (int64_t r = bi * bn; r < std::min(d.r, (bi + 1) * bn); ++r) {
          for (int64_t c = bj * bk; c < std::min(d.c, (bj + 1) * bk); ++c) {
            const int64_t i = (e * d.r + r) * d.c + c;
            // torch's .to(float8) is a plain (non-saturating) cast; x * (1/s) stays below the
            // first overflow midpoint for finite x, so this equals the saturating encode there.
            q[i] = encode_nonsat(fp8, xs[static_cast<std::size_t>(i)] * inv);
          }
        }
      }
    }
  }
  return out;
}

QuantizedTensor per_tensor_cast_to_fp8(const TensorView& w, DType fp8) {
  require_input(w, "per_tensor_cast_to_fp8 input", 2, 3);
  require_fp8(fp8, "per_tensor_cast_to_fp8");
  const Dims3 d = dims3(w);
  const auto xs = to_floats(w);
  QuantizedTensor out;
  const auto qshape = w.sizes();
  out.q = Tensor::empty(std::span<const int64_t>(qshape), fp8);
  out.scale = Tensor::empty({w.ndim == 3 ? d.e : 1}, DType::kF32);
  const int64_t per = d.r * d.c;
  for (int64_t e = 0; e < d.e; ++e) {
    const float* x = xs.data() + e * per;
    const float s = per_tensor_dynamic_scale(absmax(x, per), fp8);
    out.scale.ptr<float>()[e] = s;
    quantize_per_tensor_fp8(x, per, s, out.q.ptr<uint8_t>() + e * per, fp8);
  }
  return out;
}

QuantizedTensor per_channel_cast_to_fp8(const TensorView& w, DType fp8) {
  require_input(w, "per_channel_cast_to_fp8 input", 2, 3);
  require_fp8(fp8, "per_channel_cast_to_fp8");
  const Dims3 d = dims3(w);
  const auto xs = to_floats(w);
  QuantizedTensor out;
  const auto qshape = w.sizes();
  out.q = Tensor::empty(std::span<const int64_t>(qshape), fp8);
  const auto sshape = scale_shape(w, {d.r});
  out.scale = Tensor::empty(std::span<const int64_t>(sshape), DType::kF32);
  for (int64_t row = 0; row < d.e * d.r; ++row) {
    const float* x = xs.data() + row * d.c;
    const float s = per_tensor_dynamic_scale(absmax(x, d.c), fp8);
    out.scale.ptr<float>()[row] = s;
    quantize_per_tensor_fp8(x, d.c, s, out.q.ptr<uint8_t>() + row * d.c, fp8);
  }
  return out;
}

QuantizedTensor mx_cast_to_fp8(const TensorView& w) {
  require_input(w, "mx_cast_to_fp8 input", 1, 3);
  const int64_t c = w.size(-1);
  if (c % kMxGroupSize != 0) {
    throw ValueError(fmt::format(
        "mx_cast_to_fp8: the last dimension of {} must be a multiple of the MXFP8 group of 32",
        w.describe()));
  }
  const auto xs = to_floats(w);
  QuantizedTensor out;
  auto shape = w.sizes();
  out.q = Tensor::empty(std::span<const int64_t>(shape), DType::kF8E4M3FN);
  shape.back() = c / kMxGroupSize;
  out.scale = Tensor::empty(std::span<const int64_t>(shape), DType::kU8);
  const int64_t groups = w.numel() / kMxGroupSize;
  for (int64_t g = 0; g < groups; ++g) {
    out.scale.ptr<uint8_t>()[g] = quantize_mx_group(xs.data() + g * kMxGroupSize, kMxGroupSize,
                                                    out.q.ptr<uint8_t>() + g * kMxGroupSize);
  }
  return out;
}

// ---- activation tensors -------------------------------------------------------------------------

QuantizedTensor per_token_group_quant_fp8(const TensorView& x, int64_t group, DType fp8,
                                          bool ue8m0) {
  require_input(x, "per_token_group_quant_fp8 input", 2, 2);
  require_fp8(fp8, "per_token_group_quant_fp8");
  const int64_t r = x.size(0), c = x.size(1);
  if (group <= 0 || c % group != 0) {
    throw ValueError(fmt::format(
        "per_token_group_quant_fp8: the last dimension of {} ({}) must be divisible by group_size "
        "{}",
        x.describe(), c, group));
  }
  const auto xs = to_floats(x);
  QuantizedTensor out;
  out.q = Tensor::empty({r, c}, fp8);
  out.scale = Tensor::empty({r, c / group}, DType::kF32);
  for (int64_t g = 0; g < r * (c / group); ++g) {
    out.scale.ptr<float>()[g] = quantize_group_fp8(xs.data() + g * group, group,
                                                   out.q.ptr<uint8_t>() + g * group, fp8, ue8m0);
  }
  return out;
}

QuantizedTensor per_token_quant_fp8(const TensorView& x, DType fp8) {
  require_input(x, "per_token_quant_fp8 input", 2, 2);
  require_fp8(fp8, "per_token_quant_fp8");
  const int64_t r = x.size(0), c = x.size(1);
  const auto xs = to_floats(x);
  QuantizedTensor out;
  out.q = Tensor::empty({r, c}, fp8);
  out.scale = Tensor::empty({r}, DType::kF32);
  for (int64_t i = 0; i < r; ++i) {
    out.scale.ptr<float>()[i] =
        quantize_row_per_token_fp8(xs.data() + i * c, c, out.q.ptr<uint8_t>() + i * c, fp8);
  }
  return out;
}

QuantizedTensor per_tensor_quant_fp8(const TensorView& x, DType fp8,
                                     std::optional<float> static_scale) {
  require_input(x, "per_tensor_quant_fp8 input", 1, 3);
  require_fp8(fp8, "per_tensor_quant_fp8");
  if (static_scale && !(*static_scale > 0.0f && std::isfinite(*static_scale))) {
    throw ValueError(
        fmt::format("per_tensor_quant_fp8: the static scale must be positive and finite, got {}",
                    *static_scale));
  }
  const auto xs = to_floats(x);
  const int64_t n = x.numel();
  const float s =
      static_scale ? *static_scale : per_tensor_dynamic_scale(absmax(xs.data(), n), fp8);
  QuantizedTensor out;
  const auto shape = x.sizes();
  out.q = Tensor::empty(std::span<const int64_t>(shape), fp8);
  out.scale = Tensor::scalar_f32(s);
  quantize_per_tensor_fp8(xs.data(), n, s, out.q.ptr<uint8_t>(), fp8);
  return out;
}

QuantizedTensor normalize_e4m3fn_to_e4m3fnuz(const QuantizedTensor& fn) {
  if (fn.q.dtype() != DType::kF8E4M3FN || fn.scale.dtype() != DType::kF32) {
    throw ValueError(fmt::format(
        "normalize_e4m3fn_to_e4m3fnuz: expected fp8_e4m3fn codes with f32 scales, got {} and {}",
        fn.q.view().describe(), fn.scale.view().describe()));
  }
  QuantizedTensor out;
  const auto qshape = fn.q.sizes();
  out.q = Tensor::empty(std::span<const int64_t>(qshape), DType::kF8E4M3FNUZ);
  for (int64_t i = 0; i < fn.q.numel(); ++i) {
    const uint8_t c = fn.q.ptr<uint8_t>()[i];
    out.q.ptr<uint8_t>()[i] = c == 0x80 ? 0x00 : c;  // -0 in fn is the NaN code of fnuz
  }
  out.scale = fn.scale.clone();
  for (int64_t i = 0; i < out.scale.numel(); ++i) out.scale.ptr<float>()[i] *= 2.0f;
  return out;
}

// ---- dequantisation -----------------------------------------------------------------------------

Tensor dequantize_block(const TensorView& q, const TensorView& scale, int64_t bn, int64_t bk) {
  if (!dtype_is_fp8(q.dtype) || (q.ndim != 2 && q.ndim != 3)) {
    throw ValueError(
        fmt::format("dequantize_block: expected 2-D or 3-D fp8 codes, got {}", q.describe()));
  }
  const Dims3 d = dims3(q);
  const int64_t nb = (d.r + bn - 1) / bn, kb = (d.c + bk - 1) / bk;
  if (scale.dtype != DType::kF32 || scale.numel() != d.e * nb * kb) {
    throw ValueError(
        fmt::format("dequantize_block: scale {} does not match {} with blocks [{}, {}]",
                    scale.describe(), q.describe(), bn, bk));
  }
  const auto shape = q.sizes();
  Tensor out = Tensor::empty(std::span<const int64_t>(shape), DType::kF64);
  for (int64_t e = 0; e < d.e; ++e) {
    for (int64_t r = 0; r < d.r; ++r) {
      for (int64_t c = 0; c < d.c; ++c) {
        const int64_t i = (e * d.r + r) * d.c + c;
        out.ptr<double>()[i] =
            static_cast<double>(fp8_to_float(q.dtype, q.ptr<const uint8_t>()[i])) *
            scale.ptr<const float>()[(e * nb + r / bn) * kb + c / bk];
      }
    }
  }
  return out;
}

Tensor dequantize_rows(const TensorView& q, const TensorView& scale) {
  if (!dtype_is_fp8(q.dtype) || q.ndim < 1) {
    throw ValueError(fmt::format("dequantize_rows: expected fp8 codes, got {}", q.describe()));
  }
  const int64_t c = q.size(-1);
  const int64_t rows = q.numel() / std::max<int64_t>(c, 1);
  const int64_t ns = scale.numel();
  // One scale, one per row, or one per leading (expert) index.
  int64_t rows_per_scale = 0;
  if (ns == 1) {
    rows_per_scale = rows;
  } else if (ns == rows) {
    rows_per_scale = 1;
  } else if (q.ndim == 3 && ns == q.size(0)) {
    rows_per_scale = q.size(1);
  }
  if (rows_per_scale == 0 || scale.dtype != DType::kF32) {
    throw ValueError(
        fmt::format("dequantize_rows: scale {} fits neither per-tensor nor per-row "
                    "layouts of {}",
                    scale.describe(), q.describe()));
  }
  const auto shape = q.sizes();
  Tensor out = Tensor::empty(std::span<const int64_t>(shape), DType::kF64);
  for (int64_t r = 0; r < rows; ++r) {
    const double s = scale.ptr<const float>()[r / std::max<int64_t>(rows_per_scale, 1)];
    for (int64_t j = 0; j < c; ++j) {
      out.ptr<double>()[r * c + j] =
          static_cast<double>(fp8_to_float(q.dtype, q.ptr<const uint8_t>()[r * c + j])) * s;
    }
  }
  return out;
}

}  // namespace fp8moe::numerics
