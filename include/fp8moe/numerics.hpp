// Bit-exact codecs for the element formats of FP8 MoE: float8_e4m3fn, float8_e4m3fnuz,
// float8_e5m2, e8m0 (MX scales) and bfloat16 (spec/numerics.md "FP8 and scale formats").
//
// Header-only and cheap enough to call per element: decoding is a 256-entry table built at compile
// time, encoding is integer arithmetic on the float's bits (round to nearest, ties to even).
//
// Two encoder families per fp8 format:
//   float_to_<fmt>(f)         vLLM's quantiser semantics: clamp to +-max first, then round (so no
//                             finite or infinite input becomes NaN); NaN stays NaN.
//   float_to_<fmt>_nonsat(f)  a plain dtype cast as torch / ml_dtypes / cuda_fp8.h (__NV_NOSAT)
//                             perform it: values that round past max become NaN (fn, fnuz) or
//                             inf (e5m2).
// NaN codes: e4m3fn 0x7F|sign, e4m3fnuz 0x80 (its only NaN; it has no negative zero either: a
// negative value that rounds to zero encodes as 0x00), e5m2 0x7E|sign. These are the codes
// ml_dtypes produces.
#pragma once

#include <array>
#include <bit>
#include <cstdint>

#include "fp8moe/dtype.hpp"

namespace fp8moe::numerics {

// ---- constants
// ------------------------------------------------------------------------------------
inline constexpr float kE4M3FnMax = 448.0f;
inline constexpr float kE4M3FnuzMax = 240.0f;  // format max; vLLM's quantisers use 224 (see quant)
inline constexpr float kE5M2Max = 57344.0f;
inline constexpr uint8_t kE4M3FnNaN = 0x7F;
inline constexpr uint8_t kE4M3FnuzNaN = 0x80;
inline constexpr uint8_t kE5M2NaN = 0x7E;
inline constexpr uint8_t kE8M0NaN = 0xFF;

namespace detail {

inline constexpr uint32_t kF32Nan = 0x7FC00000u;

// Float32 bits of a minifloat code with `e_bits` exponent and `m_bits` mantissa bits and the given
// exponent bias; the caller handles the NaN/inf codes. Exact: every minifloat value is a float.
constexpr uint32_t minifloat_bits(uint8_t code, int e_bits, int m_bits, int bias) {
  const uint32_t sign = static_cast<uint32_t>(code >> (e_bits + m_bits)) << 31;
  const int e = (code >> m_bits) & ((1 << e_bits) - 1);
  uint32_t m = code & ((1u << m_bits) - 1);
  if (e == 0) {
    if (m == 0) return sign;  // +-0
    // Subnormal: m * 2^(1 - bias - m_bits). Normalise into a float32 normal.
    int exp = 1 - bias;
    while ((m & (1u << m_bits)) == 0) {
      m <<= 1;
      --exp;
    }
    m &= (1u << m_bits) - 1;
    return sign | (static_cast<uint32_t>(exp + 127) << 23) | (m << (23 - m_bits));
  }
  return sign | (static_cast<uint32_t>(e - bias + 127) << 23) | (m << (23 - m_bits));
}

constexpr std::array<uint32_t, 256> make_e4m3fn_table() {
  std::array<uint32_t, 256> t{};
  for (int c = 0; c < 256; ++c) {
    const bool nan = (c & 0x7F) == 0x7F;
    t[c] = nan ? ((c & 0x80) ? 0xFFC00000u : kF32Nan)
               : minifloat_bits(static_cast<uint8_t>(c), 4, 3, 7);
  }
  return t;
}

constexpr std::array<uint32_t, 256> make_e4m3fnuz_table() {
  std::array<uint32_t, 256> t{};
  for (int c = 0; c < 256; ++c) {
    t[c] = c == 0x80 ? kF32Nan : minifloat_bits(static_cast<uint8_t>(c), 4, 3, 8);
  }
  return t;
}

constexpr std::array<uint32_t, 256> make_e5m2_table() {
  std::array<uint32_t, 256> t{};
  for (int c = 0; c < 256; ++c) {
    const uint32_t sign = (c & 0x80) ? 0x80000000u : 0u;
    if ((c & 0x7C) == 0x7C) {
      t[c] = (c & 0x03) ? (sign | kF32Nan) : (sign | 0x7F800000u);
    } else {
      t[c] = minifloat_bits(static_cast<uint8_t>(c), 5, 2, 15);
    }
  }
  return t;
}

constexpr std::array<uint32_t, 256> make_e8m0_table() {
  std::array<uint32_t, 256> t{};
  for (int c = 0; c < 256; ++c) {
    if (c == 0xFF) {
      t[c] = kF32Nan;
    } else if (c == 0) {
      t[c] = 0x00400000u;  // 2^-127: a float32 subnormal
    } else {
      t[c] = static_cast<uint32_t>(c) << 23;  // 2^(c - 127)
    }
  }
  return t;
}

inline constexpr std::array<uint32_t, 256> kE4M3FnBits = make_e4m3fn_table();
inline constexpr std::array<uint32_t, 256> kE4M3FnuzBits = make_e4m3fnuz_table();
inline constexpr std::array<uint32_t, 256> kE5M2Bits = make_e5m2_table();
inline constexpr std::array<uint32_t, 256> kE8M0Bits = make_e8m0_table();

// Round-to-nearest-even of `x >> shift` (shift in [0, 63]).
constexpr uint64_t rne_shift(uint64_t x, int shift) {
  if (shift <= 0) return x;
  if (shift >= 64) return 0;
  const uint64_t q = x >> shift;
  const uint64_t rem = x & ((uint64_t{1} << shift) - 1);
  const uint64_t half = uint64_t{1} << (shift - 1);
  return (rem > half || (rem == half && (q & 1))) ? q + 1 : q;
}

// Magnitude code (no sign bit) of |f| rounded to nearest-even on the grid of a minifloat with
// `m_bits` mantissa bits and exponent `bias`. The result may exceed the format's largest finite
// code (overflow); the caller decides what that means. `abs_bits` is a finite float's bits
// without the sign.
constexpr uint32_t round_magnitude(uint32_t abs_bits, int m_bits, int bias) {
  const int exp_field = static_cast<int>(abs_bits >> 23);
  const uint32_t mant = abs_bits & 0x7FFFFFu;
  if (exp_field == 0) return 0;  // float32 zero/subnormal: far below every fp8 subnormal
  const int e = exp_field - 127;
  const int emin = 1 - bias;  // exponent of the smallest normal
  if (e < emin) {
    // Subnormal in the target: count units of 2^(emin - m_bits). Rounding up to 2^m_bits lands
    // exactly on the code of the smallest normal, so no special case is needed.
    const uint64_t m24 = mant | 0x800000u;
    const int shift = 23 - m_bits + (emin - e);
    return static_cast<uint32_t>(rne_shift(m24, shift));
  }
  // Normal: the exponent carry of a mantissa that rounds up falls out of the addition.
  const uint32_t r = static_cast<uint32_t>(rne_shift(mant, 23 - m_bits));
  return (static_cast<uint32_t>(e + bias) << m_bits) + r;
}

constexpr float clamp_abs(float a, float max) { return a > max ? max : a; }

}  // namespace detail

// ---- decoding (exact for all 256 codes)
// -----------------------------------------------------------
inline float e4m3fn_to_float(uint8_t c) { return std::bit_cast<float>(detail::kE4M3FnBits[c]); }
inline float e4m3fnuz_to_float(uint8_t c) { return std::bit_cast<float>(detail::kE4M3FnuzBits[c]); }
inline float e5m2_to_float(uint8_t c) { return std::bit_cast<float>(detail::kE5M2Bits[c]); }
// e8m0 / ue8m0: 2^(c - 127); 0xFF is NaN.
inline float e8m0_to_float(uint8_t c) { return std::bit_cast<float>(detail::kE8M0Bits[c]); }

// ---- encoding to e4m3fn (bias 7, max 448 = 0x7E, NaN 0x7F/0xFF, no inf)
// ----------------------------- vLLM semantics: saturate to +-448 (also +-inf), then round to
// nearest even; NaN -> 0x7F|sign.
inline uint8_t float_to_e4m3fn(float f) {
  const uint32_t u = std::bit_cast<uint32_t>(f);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80);
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return sign | kE4M3FnNaN;
  if (a >= 0x43E00000u) return sign | 0x7E;  // |f| >= 448 (incl. inf)
  return sign | static_cast<uint8_t>(detail::round_magnitude(a, 3, 7));
}
// Plain cast (torch .to(float8_e4m3fn), ml_dtypes, __NV_NOSAT): overflow and inf become NaN.
inline uint8_t float_to_e4m3fn_nonsat(float f) {
  const uint32_t u = std::bit_cast<uint32_t>(f);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80);
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a >= 0x7F800000u) return sign | kE4M3FnNaN;
  const uint32_t m = detail::round_magnitude(a, 3, 7);
  return sign | static_cast<uint8_t>(m > 0x7E ? kE4M3FnNaN : m);
}

// ---- e4m3fnuz (bias 8, max 240 = 0x7F, only NaN 0x80, no -0, no inf)
// -------------------------------
inline uint8_t float_to_e4m3fnuz(float f) {
  const uint32_t u = std::bit_cast<uint32_t>(f);
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return kE4M3FnuzNaN;
  const uint32_t m = a >= 0x43700000u ? 0x7Fu : detail::round_magnitude(a, 3, 8);  // >= 240
  if (m == 0) return 0;  // no negative zero
  return static_cast<uint8_t>(((u >> 24) & 0x80) | m);
}
inline uint8_t float_to_e4m3fnuz_nonsat(float f) {
  const uint32_t u = std::bit_cast<uint32_t>(f);
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a >= 0x7F800000u) return kE4M3FnuzNaN;
  const uint32_t m = detail::round_magnitude(a, 3, 8);
  if (m > 0x7F) return kE4M3FnuzNaN;
  if (m == 0) return 0;
  return static_cast<uint8_t>(((u >> 24) & 0x80) | m);
}

// ---- e5m2 (bias 15, max 57344 = 0x7B, inf 0x7C, NaN 0x7D..0x7F)
// -------------------------------------
inline uint8_t float_to_e5m2(float f) {
  const uint32_t u = std::bit_cast<uint32_t>(f);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80);
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return sign | kE5M2NaN;
  if (a >= 0x47600000u) return sign | 0x7B;  // |f| >= 57344 (incl. inf)
  return sign | static_cast<uint8_t>(detail::round_magnitude(a, 2, 15));
}
inline uint8_t float_to_e5m2_nonsat(float f) {
  const uint32_t u = std::bit_cast<uint32_t>(f);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80);
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return sign | kE5M2NaN;
  if (a == 0x7F800000u) return sign | 0x7C;
  const uint32_t m = detail::round_magnitude(a, 2, 15);
  return sign | static_cast<uint8_t>(m >= 0x7C ? 0x7C : m);
}

// ---- e8m0
// ------------------------------------------------------------------------------------------ Cast
// as ml_dtypes' float8_e8m0fnu does it: round to the nearest power of two with ties upwards
// (mantissa >= 0.5 rounds up); NaN, inf, zero, negative values and results above 2^127 give NaN
// (0xFF); float32 subnormals give 2^-127 (0x00) up to 2^-127 itself and 2^-126 above it.
inline uint8_t float_to_e8m0(float f) {
  const uint32_t u = std::bit_cast<uint32_t>(f);
  if ((u & 0x80000000u) || u == 0 || u >= 0x7F800000u) return kE8M0NaN;
  const uint32_t exp_field = u >> 23;
  const uint32_t mant = u & 0x7FFFFFu;
  if (exp_field == 0) return mant > 0x400000u ? 0x01 : 0x00;
  const uint32_t c = exp_field + (mant >= 0x400000u ? 1u : 0u);
  return c > 0xFE ? kE8M0NaN : static_cast<uint8_t>(c);
}
// UE8M0 rounding upwards: the e8m0 code of the smallest power of two >= f (f > 0, finite), as
// vLLM/DeepGEMM/FlashInfer compute scales "so that nothing saturates": bump the exponent when the
// mantissa is non-zero. Clamped to the e8m0 range [2^-127, 2^127]; NaN and f <= 0 give NaN.
inline uint8_t e8m0_ceil(float f) {
  const uint32_t u = std::bit_cast<uint32_t>(f);
  if (std::bit_cast<float>(u) != f || !(f > 0.0f)) return kE8M0NaN;
  if (u >= 0x7F800000u) return 0xFE;
  const uint32_t exp_field = u >> 23;
  const uint32_t mant = u & 0x7FFFFFu;
  if (exp_field == 0) return mant > 0x400000u ? 0x01 : 0x00;
  const uint32_t c = exp_field + (mant != 0 ? 1u : 0u);
  return static_cast<uint8_t>(c > 0xFE ? 0xFE : c);
}
// 2^ceil(log2(f)) computed on the bits, bit-exact with vLLM's per-token-group kernel
// (exp2f(ceilf(log2f(f))) rewritten as "bump the exponent when the mantissa is non-zero, clear the
// mantissa"). f must be a positive normal float; the caller applies vLLM's 1e-10 floor first.
inline float ceil_pow2(float f) {
  const uint32_t u = std::bit_cast<uint32_t>(f);
  const uint32_t exp_field = (u >> 23) & 0xFFu;
  const uint32_t mant = u & 0x7FFFFFu;
  return std::bit_cast<float>((exp_field + (mant != 0 ? 1u : 0u)) << 23);
}

// ---- bfloat16
// --------------------------------------------------------------------------------------
inline float bf16_to_float(uint16_t b) {
  return std::bit_cast<float>(static_cast<uint32_t>(b) << 16);
}
// Round to nearest even; NaN stays NaN (quietened, sign kept); overflow rounds to +-inf.
inline uint16_t float_to_bf16(float f) {
  const uint32_t u = std::bit_cast<uint32_t>(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
// f rounded to the nearest bf16 value, as a float.
inline float bf16_round(float f) { return bf16_to_float(float_to_bf16(f)); }
// A double rounded first to float (RNE) then to bf16. Use it where vLLM rounds an fp32 result to
// bf16 and the reference holds the value in double: the two-step rounding is what the kernel does.
inline float bf16_round(double d) { return bf16_round(static_cast<float>(d)); }

// ---- float16 (decode only; inputs may arrive as f16)
// -------------------------------------------------
inline float f16_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t e = (h >> 10) & 0x1Fu;
  uint32_t m = h & 0x3FFu;
  if (e == 0x1F) return std::bit_cast<float>(sign | 0x7F800000u | (m << 13));
  if (e == 0) {
    if (m == 0) return std::bit_cast<float>(sign);
    int exp = -14;
    while ((m & 0x400u) == 0) {
      m <<= 1;
      --exp;
    }
    m &= 0x3FFu;
    return std::bit_cast<float>(sign | (static_cast<uint32_t>(exp + 127) << 23) | (m << 13));
  }
  return std::bit_cast<float>(sign | ((e - 15 + 127) << 23) | (m << 13));
}

// ---- generic dispatch over fp8 dtypes
// --------------------------------------------------------------- The format's largest finite value
// (448, 240, 57344).
constexpr float fp8_format_max(DType t) {
  return t == DType::kF8E4M3FNUZ ? kE4M3FnuzMax : (t == DType::kF8E5M2 ? kE5M2Max : kE4M3FnMax);
}
inline float fp8_to_float(DType t, uint8_t c) {
  switch (t) {
    case DType::kF8E4M3FNUZ:
      return e4m3fnuz_to_float(c);
    case DType::kF8E5M2:
      return e5m2_to_float(c);
    case DType::kF8E8M0FNU:
      return e8m0_to_float(c);
    default:
      return e4m3fn_to_float(c);
  }
}
// Saturating encode (vLLM quantiser semantics) for an fp8 dtype.
inline uint8_t float_to_fp8(DType t, float f) {
  switch (t) {
    case DType::kF8E4M3FNUZ:
      return float_to_e4m3fnuz(f);
    case DType::kF8E5M2:
      return float_to_e5m2(f);
    default:
      return float_to_e4m3fn(f);
  }
}

}  // namespace fp8moe::numerics
