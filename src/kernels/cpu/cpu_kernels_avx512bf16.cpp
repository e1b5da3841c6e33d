// The AVX-512 BF16 level of the CPU GEMM tile (cpu_kernels.hpp): e4m3fn weights are decoded to
// bf16 in registers with two-table byte lookups (vpermi2b, AVX512_VBMI) and multiplied with bf16
// activations by vdpbf16ps (AVX512_BF16). Every e4m3 value is exact in bf16 and the product of two
// bf16 values is exact in f32, so the only roundings are the f32 accumulations, whose order is
// fixed by the code below (deterministic for any thread count).
//
// Register layout ("row quads"): a zmm of bf16 weights holds 4 weight rows, one per 128-bit block,
// each block 8 consecutive k of its row (4 k-pairs). A 16-row group uses 4 quads; quad q holds rows
// {q, q+4, q+8, q+12}, so that the 4:1 lane reduction at the end of a K-block lands the 16 row sums
// in natural order. Activations are broadcast per 128-bit block (8 k of one row). No transposition
// is needed: weights are read in their canonical (N, K) layout.
//
// Two ways to feed the quads:
//   inline  (R <= 4 activation rows): decode straight from the weight rows; each weight is decoded
//           once, the decode-bound regime of token generation.
//   panel   (R > 4): decode a (64 rows x K-block) panel once into per-thread scratch (L1), then run
//           4-row microkernels over all R rows against it.
#include <immintrin.h>

#include <bit>
#include <cstring>

#include "fp8moe/numerics.hpp"
#include "kernels/cpu/cpu_kernels.hpp"

#if defined(__GNUC__) && (defined(__x86_64__) || defined(_M_X64))
#define FP8MOE_HAVE_AVX512BF16_KERNELS 1
#else
#define FP8MOE_HAVE_AVX512BF16_KERNELS 0
#endif

#if FP8MOE_HAVE_AVX512BF16_KERNELS

// GCC 12 reports its own _mm512_undefined_* helpers (used inside the cast/insert intrinsics) as
// "may be used uninitialized"; a known false positive of the compiler's headers.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#define FP8MOE_BF16_TARGET                                                        \
  __attribute__((                                                                 \
      target("avx512f,avx512bw,avx512dq,avx512vl,avx512vbmi,avx512bf16,avx2,fma," \
             "bmi2,f16c")))

namespace fp8moe::cpu {
namespace {

constexpr int kPanelRows = 64;  // weight rows per decoded panel
constexpr int kMr = 4;          // activation rows per microkernel

// bf16 bits of the 128 e4m3fn magnitudes (0x00..0x7F), split into low and high bytes. Built from
// the shared scalar codec; every value is exact in bf16 (4 significant bits), 0x7F is NaN.
struct Bf16Lut {
  alignas(64) uint8_t lo[128];
  alignas(64) uint8_t hi[128];
  Bf16Lut() {
    for (int c = 0; c < 128; ++c) {
      const uint32_t bits =
          std::bit_cast<uint32_t>(numerics::e4m3fn_to_float(static_cast<uint8_t>(c)));
      const uint16_t b = static_cast<uint16_t>(bits >> 16);
      lo[c] = static_cast<uint8_t>(b & 0xFF);
      hi[c] = static_cast<uint8_t>(b >> 8);
    }
  }
};
const Bf16Lut& bf16_lut() {
  static const Bf16Lut lut;
  return lut;
}

struct Luts {
  __m512i lo0, lo1, hi0, hi1, sign;
};

FP8MOE_BF16_TARGET inline Luts load_luts() {
  const Bf16Lut& t = bf16_lut();
  return {_mm512_load_si512(t.lo), _mm512_load_si512(t.lo + 64), _mm512_load_si512(t.hi),
          _mm512_load_si512(t.hi + 64), _mm512_set1_epi8(static_cast<char>(0x80))};
}

// 64 e4m3 codes -> 64 bf16 in two zmm: x0 block l = codes 16l..16l+7, x1 block l = 16l+8..16l+15.
FP8MOE_BF16_TARGET inline void decode64(__m512i v, const Luts& L, __m512i& x0, __m512i& x1) {
  const __m512i lo = _mm512_permutex2var_epi8(L.lo0, v, L.lo1);  // index bits 0..6; bit 7 ignored
  __m512i hi = _mm512_permutex2var_epi8(L.hi0, v, L.hi1);
  hi = _mm512_ternarylogic_epi32(hi, v, L.sign, 0xF8);  // hi | (v & 0x80): the sign bit
  x0 = _mm512_unpacklo_epi8(lo, hi);
  x1 = _mm512_unpackhi_epi8(lo, hi);
}

// One quad: 16 codes from each of 4 rows (k..k+15) -> x0 (k..k+7 of each row), x1 (k+8..k+15).
FP8MOE_BF16_TARGET inline void decode_quad(const uint8_t* r0, const uint8_t* r1, const uint8_t* r2,
                                           const uint8_t* r3, const Luts& L, __m512i& x0,
                                           __m512i& x1) {
  __m512i v = _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(r0)));
  v = _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(r1)), 1);
  v = _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(r2)), 2);
  v = _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(r3)), 3);
  decode64(v, L, x0, x1);
}

// Sums the four k-pair lanes of each 128-bit block of four quad accumulators: block l of the
// result holds rows (4l + 0..3), i.e. the 16 rows of the group in natural order.
FP8MOE_BF16_TARGET inline __m512 reduce_quads(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
  const __m512 p01 = _mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));
  const __m512 p23 = _mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3));
  const __m512d q0 = _mm512_unpacklo_pd(_mm512_castps_pd(p01), _mm512_castps_pd(p23));
  const __m512d q1 = _mm512_unpackhi_pd(_mm512_castps_pd(p01), _mm512_castps_pd(p23));
  return _mm512_add_ps(_mm512_castpd_ps(q0), _mm512_castpd_ps(q1));
}

FP8MOE_BF16_TARGET inline __m512i bcst_a(const uint16_t* p) {
  return _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

FP8MOE_BF16_TARGET inline __m512 dp(__m512 acc, __m512i a, __m512i b) {
  return _mm512_dpbf16_ps(acc, reinterpret_cast<__m512bh>(a), reinterpret_cast<__m512bh>(b));
}

// Microkernel: MR activation rows x one 16-row weight group over kl k (a multiple of 16).
// kPanel: quads come from a decoded panel (8 zmm per 16 k); else decoded from the rows `w`
// (16 row pointers already offset to the block start). out[m]: the 16 row sums of row m.
template <int MR, bool kPanel>
FP8MOE_BF16_TARGET inline void microkernel(const uint16_t* const* a, const uint8_t* const* w,
                                           const __m512i* panel, int64_t kl, const Luts& L,
                                           __m512* out) {
  // Two accumulator sets (k..k+7 and k+8..k+15) halve the dependency chains.
  __m512 acc0[MR][4], acc1[MR][4];
  for (int m = 0; m < MR; ++m) {
    for (int q = 0; q < 4; ++q) {
      acc0[m][q] = _mm512_setzero_ps();
      acc1[m][q] = _mm512_setzero_ps();
    }
  }
  for (int64_t k = 0; k < kl; k += 16) {
    __m512i x0[4], x1[4];
    if constexpr (kPanel) {
      const __m512i* p = panel + (k / 16) * 8;
      for (int q = 0; q < 4; ++q) {
        x0[q] = _mm512_load_si512(p + 2 * q);
        x1[q] = _mm512_load_si512(p + 2 * q + 1);
      }
    } else {
      for (int q = 0; q < 4; ++q) {
        decode_quad(w[q] + k, w[q + 4] + k, w[q + 8] + k, w[q + 12] + k, L, x0[q], x1[q]);
      }
    }
    for (int m = 0; m < MR; ++m) {
      const __m512i a0 = bcst_a(a[m] + k);
      const __m512i a1 = bcst_a(a[m] + k + 8);
      for (int q = 0; q < 4; ++q) {
        acc0[m][q] = dp(acc0[m][q], a0, x0[q]);
        acc1[m][q] = dp(acc1[m][q], a1, x1[q]);
      }
    }
  }
  for (int m = 0; m < MR; ++m) {
    out[m] =
        reduce_quads(_mm512_add_ps(acc0[m][0], acc1[m][0]), _mm512_add_ps(acc0[m][1], acc1[m][1]),
                     _mm512_add_ps(acc0[m][2], acc1[m][2]), _mm512_add_ps(acc0[m][3], acc1[m][3]));
  }
}

// Decodes rows w[0..16) (offset to the block start), kl k, into panel quads (8 zmm per 16 k).
FP8MOE_BF16_TARGET void build_panel_group(const uint8_t* const* w, int64_t kl, const Luts& L,
                                          __m512i* panel) {
  for (int64_t k = 0; k < kl; k += 16) {
    __m512i* p = panel + (k / 16) * 8;
    for (int q = 0; q < 4; ++q) {
      __m512i x0, x1;
      decode_quad(w[q] + k, w[q + 4] + k, w[q + 8] + k, w[q + 12] + k, L, x0, x1);
      _mm512_store_si512(p + 2 * q, x0);
      _mm512_store_si512(p + 2 * q + 1, x1);
    }
  }
}

// Folds one K-block's row sums into C: c = (first ? 0 : c) + sums * scale. `sw` holds the 16
// weight scales of the group (nullptr: 1), `sa` the activation scale of the row (0: none).
FP8MOE_BF16_TARGET inline void fold(float* c, __m512 sums, const float* sw, const float* sa,
                                    bool first) {
  __m512 v = sums;
  if (sw) {
    __m512 s = _mm512_loadu_ps(sw);
    if (sa) s = _mm512_mul_ps(s, _mm512_set1_ps(*sa));
    if (first) {
      _mm512_storeu_ps(c, _mm512_mul_ps(v, s));
    } else {
      _mm512_storeu_ps(c, _mm512_fmadd_ps(v, s, _mm512_loadu_ps(c)));
    }
    return;
  }
  if (sa) v = _mm512_mul_ps(v, _mm512_set1_ps(*sa));
  _mm512_storeu_ps(c, first ? v : _mm512_add_ps(v, _mm512_loadu_ps(c)));
}

struct TileCtx {
  const GemmTile& t;
  const uint16_t* a;
  int64_t kchunk;
  int64_t nkb;
  bool scaled;  // per-K-block scales apply
};

// Weight scales of tile rows [n0, n0 + n) for K-block kb.
inline void load_w_scales(const GemmTile& t, int n0, int n, int64_t kb, float* out) {
  for (int i = 0; i < n; ++i) {
    out[i] = t.w_scale[(t.w_rows[n0 + i] / t.bn) * t.w_scale_ld + kb];
  }
}

template <int MR, bool kPanel>
FP8MOE_BF16_TARGET void run_rows(const TileCtx& x, int m0, const uint8_t* const* w,
                                 const __m512i* panel, int64_t k0, int64_t kl, int64_t kb, int col,
                                 const float* sw, const Luts& L) {
  const GemmTile& t = x.t;
  const uint16_t* arow[MR];
  float sa[MR];
  for (int m = 0; m < MR; ++m) {
    const int64_t r = t.a_rows[m0 + m];
    arow[m] = x.a + r * t.lda + k0;
    if (t.a_scale) sa[m] = t.a_scale[r * t.a_scale_ld + kb];
  }
  __m512 out[MR];
  microkernel<MR, kPanel>(arow, w, panel, kl, L, out);
  for (int m = 0; m < MR; ++m) {
    fold(t.c + (m0 + m) * t.ldc + col, out[m], x.scaled ? sw : nullptr,
         (x.scaled && t.a_scale) ? &sa[m] : nullptr, kb == 0);
  }
}

template <bool kPanel>
FP8MOE_BF16_TARGET void run_rows_any(const TileCtx& x, int m0, int mr, const uint8_t* const* w,
                                     const __m512i* panel, int64_t k0, int64_t kl, int64_t kb,
                                     int col, const float* sw, const Luts& L) {
  switch (mr) {
    case 1:
      return run_rows<1, kPanel>(x, m0, w, panel, k0, kl, kb, col, sw, L);
    case 2:
      return run_rows<2, kPanel>(x, m0, w, panel, k0, kl, kb, col, sw, L);
    case 3:
      return run_rows<3, kPanel>(x, m0, w, panel, k0, kl, kb, col, sw, L);
    default:
      return run_rows<4, kPanel>(x, m0, w, panel, k0, kl, kb, col, sw, L);
  }
}

FP8MOE_BF16_TARGET void gemm_a_bf16(const GemmTile& t) {
  const Luts L = load_luts();
  const bool scaled = t.w_scale != nullptr || t.a_scale != nullptr;
  const int64_t kchunk = scaled ? t.kblock : kChunkNoScale;
  const int64_t nkb = (t.K + kchunk - 1) / kchunk;
  const TileCtx x{t, static_cast<const uint16_t*>(t.a), kchunk, nkb, scaled};
  alignas(64) float sw[kPanelRows];
  const uint8_t* wrow[kPanelRows];

  if (t.R <= kMr) {
    // Inline decode: 16 weight rows at a time, streaming through K.
    for (int n0 = 0; n0 < t.NT; n0 += 16) {
      for (int i = 0; i < 16; ++i) wrow[i] = t.w + t.w_rows[n0 + i] * t.K;
      for (int64_t kb = 0; kb < nkb; ++kb) {
        const int64_t k0 = kb * kchunk;
        const int64_t kl = std::min(kchunk, t.K - k0);
        if (t.w_scale && scaled) load_w_scales(t, n0, 16, kb, sw);
        const uint8_t* w[16];
        for (int i = 0; i < 16; ++i) w[i] = wrow[i] + k0;
        run_rows_any<false>(x, 0, t.R, w, nullptr, k0, kl, kb, n0, t.w_scale ? sw : nullptr, L);
      }
    }
    return;
  }

  // Panel: decode 64 rows x one K-block once, reuse it for every activation row.
  __m512i* panel = static_cast<__m512i*>(t.scratch);
  for (int n0 = 0; n0 < t.NT; n0 += kPanelRows) {
    const int nsub = std::min(kPanelRows, t.NT - n0);
    for (int i = 0; i < nsub; ++i) wrow[i] = t.w + t.w_rows[n0 + i] * t.K;
    for (int64_t kb = 0; kb < nkb; ++kb) {
      const int64_t k0 = kb * kchunk;
      const int64_t kl = std::min(kchunk, t.K - k0);
      const int64_t group_zmm = kl / 16 * 8;  // zmm per 16-row group
      if (t.w_scale && scaled) load_w_scales(t, n0, nsub, kb, sw);
      for (int g = 0; g < nsub / 16; ++g) {
        const uint8_t* w[16];
        for (int i = 0; i < 16; ++i) w[i] = wrow[g * 16 + i] + k0;
        build_panel_group(w, kl, L, panel + g * group_zmm);
      }
      for (int m0 = 0; m0 < t.R; m0 += kMr) {
        const int mr = std::min(kMr, t.R - m0);
        for (int g = 0; g < nsub / 16; ++g) {
          run_rows_any<true>(x, m0, mr, nullptr, panel + g * group_zmm, k0, kl, kb, n0 + g * 16,
                             t.w_scale ? sw + g * 16 : nullptr, L);
        }
      }
    }
  }
}

// Test hook: decodes through decode_quad exactly as the inline kernel does.
FP8MOE_BF16_TARGET void decode_e4m3_to_bf16(const uint8_t* in, uint16_t* out, int64_t n) {
  const Luts L = load_luts();
  for (int64_t i = 0; i + 64 <= n; i += 64) {
    __m512i x0, x1;
    decode_quad(in + i, in + i + 16, in + i + 32, in + i + 48, L, x0, x1);
    alignas(64) uint16_t b0[32], b1[32];
    _mm512_store_si512(b0, x0);
    _mm512_store_si512(b1, x1);
    for (int l = 0; l < 4; ++l) {
      std::memcpy(out + i + 16 * l, b0 + 8 * l, 16);
      std::memcpy(out + i + 16 * l + 8, b1 + 8 * l, 16);
    }
  }
}

FP8MOE_BF16_TARGET void decode_e4m3_to_f32(const uint8_t* in, float* out, int64_t n) {
  alignas(64) uint16_t b[64];
  int64_t i = 0;
  for (; i + 64 <= n; i += 64) {
    decode_e4m3_to_bf16(in + i, b, 64);
    for (int j = 0; j < 64; ++j) out[i + j] = numerics::bf16_to_float(b[j]);
  }
  for (; i < n; ++i) out[i] = numerics::e4m3fn_to_float(in[i]);
}

}  // namespace

const KernelTable* avx512bf16_kernel_table() {
  static const KernelTable table{gemm_a_bf16, nullptr, decode_e4m3_to_bf16, decode_e4m3_to_f32};
  return &table;
}

}  // namespace fp8moe::cpu

#else

namespace fp8moe::cpu {
const KernelTable* avx512bf16_kernel_table() { return nullptr; }
}  // namespace fp8moe::cpu

#endif
