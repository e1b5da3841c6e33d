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
//           6-row microkernels over all R rows against it.
#include <immintrin.h>

#include <bit>
#include <cmath>
#include <cstring>

#include "fp8moe/numerics.hpp"
#include "kernels/cpu/cpu_kernels.hpp"
#include "numerics/quant.hpp"

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

constexpr int kPanelRows = 64;                // weight rows per decoded panel
constexpr int kPanelMr = 6;                   // activation rows per panel microkernel
constexpr int kInlineMaxRows = 4;             // up to this many activation rows: stream
constexpr int64_t kPrefetchDistance = 16384;  // bytes ahead on each streamed weight row
constexpr int64_t kPrefetchBlockMax = 16384;  // up to this block size, prefetch one block ahead
constexpr int64_t kPanelPrefetch = 512;       // panel path: bytes ahead on each weight row

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

// ---- panel path (R > kInlineMaxRows) --------------------------------------------------------
// Per 64-row subtile and K-block: the rows are decoded once into a panel of row quads (L1), then
// every block of 6 activation rows runs against all of it. The quad accumulators are folded
// unreduced, with their block scale, into running totals in lane layout (per activation row and
// group: 4 zmm); the 4:1 lane reduction happens once per subtile, not once per K-block.

// Panel microkernel: MR (<= 6) activation rows x one decoded 16-row group (8 zmm per 16 k), then
// the fold of the quad accumulators into the lane totals tot[m] (4 zmm each, row stride
// `tot_ld` floats): tot = (first ? 0 : tot) + acc * scale, the scale per row (`s`, scalar) times
// per lane (`sq` quad vectors) or 1. Written so that GCC keeps the 24 accumulators in registers
// (no branches in the fold, fully unrolled row/quad loops): a spilling variant ran at half speed.
template <int MR>
FP8MOE_BF16_TARGET inline void microkernel_panel(const uint16_t* const* a, const __m512i* panel,
                                                 int64_t kl, float* tot, int64_t tot_ld,
                                                 const float* s, const float (*sq)[16],
                                                 bool first) {
  __m512 acc[MR][4];
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m) {
#pragma GCC unroll 4
    for (int q = 0; q < 4; ++q) acc[m][q] = _mm512_setzero_ps();
  }
  const uint16_t* ap[MR];
  for (int m = 0; m < MR; ++m) ap[m] = a[m];
  for (int64_t k = 0; k < kl; k += 16) {
    const __m512i* p = panel + (k / 16) * 8;
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      __m512i b[4];
#pragma GCC unroll 4
      for (int q = 0; q < 4; ++q) b[q] = _mm512_load_si512(p + 2 * q + h);
#pragma GCC unroll 8
      for (int m = 0; m < MR; ++m) {
        const __m512i av = bcst_a(ap[m] + k + 8 * h);
#pragma GCC unroll 4
        for (int q = 0; q < 4; ++q) acc[m][q] = dp(acc[m][q], av, b[q]);
      }
    }
  }
  // Scale vectors: per row (s) times per lane (sq) or 1.
  __m512 sv[4];
  for (int q = 0; q < 4; ++q) sv[q] = sq ? _mm512_load_ps(sq[q]) : _mm512_set1_ps(1.0f);
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m) {
    float* tp = tot + m * tot_ld;
    const __m512 sm = _mm512_set1_ps(s ? s[m] : 1.0f);
#pragma GCC unroll 4
    for (int q = 0; q < 4; ++q) {
      const __m512 sc = _mm512_mul_ps(sv[q], sm);
      const __m512 prev = first ? _mm512_setzero_ps() : _mm512_load_ps(tp + 16 * q);
      _mm512_store_ps(tp + 16 * q, _mm512_fmadd_ps(acc[m][q], sc, prev));
    }
  }
}

// Decodes 16 rows (row 0 at `w`, K bytes apart), kl k, into panel quads (8 zmm per 16 k).
FP8MOE_BF16_TARGET void build_panel_group(const uint8_t* w, int64_t K, int64_t kl, const Luts& L,
                                          __m512i* panel) {
  const int64_t K4 = 4 * K;
  // The panel path walks 64 rows a K-block at a time: fetch each row a few blocks ahead (L2).
  for (int i = 0; i < 16; ++i) {
    for (int64_t k = 0; k < kl; k += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(w + i * K + k + kPanelPrefetch), _MM_HINT_T1);
    }
  }
  int64_t k = 0;
  // 64 k at a time: one 64-byte load per row and a 4x4 transpose of 128-bit blocks give the four
  // quads of rows {q, q+4, q+8, q+12} for k .. k+63 (8 shuffles instead of 12 inserts).
  for (; k + 64 <= kl; k += 64) {
    __m512i* p = panel + (k / 16) * 8;
    for (int q = 0; q < 4; ++q) {
      const uint8_t* r = w + q * K + k;
      const __m512i r0 = _mm512_loadu_si512(r), r1 = _mm512_loadu_si512(r + K4),
                    r2 = _mm512_loadu_si512(r + 2 * K4), r3 = _mm512_loadu_si512(r + 3 * K4);
      const __m512i t0 = _mm512_shuffle_i64x2(r0, r1, 0x44),
                    t1 = _mm512_shuffle_i64x2(r0, r1, 0xEE);
      const __m512i t2 = _mm512_shuffle_i64x2(r2, r3, 0x44),
                    t3 = _mm512_shuffle_i64x2(r2, r3, 0xEE);
      const __m512i v[4] = {_mm512_shuffle_i64x2(t0, t2, 0x88), _mm512_shuffle_i64x2(t0, t2, 0xDD),
                            _mm512_shuffle_i64x2(t1, t3, 0x88), _mm512_shuffle_i64x2(t1, t3, 0xDD)};
      for (int c = 0; c < 4; ++c) {  // c: the 16-k step within the 64
        __m512i x0, x1;
        decode64(v[c], L, x0, x1);
        _mm512_store_si512(p + c * 8 + 2 * q, x0);
        _mm512_store_si512(p + c * 8 + 2 * q + 1, x1);
      }
    }
  }
  for (; k < kl; k += 16) {  // 32-long K-blocks: 16 k at a time
    __m512i* p = panel + (k / 16) * 8;
    for (int q = 0; q < 4; ++q) {
      const uint8_t* r = w + q * K + k;
      __m512i x0, x1;
      decode_quad(r, r + K4, r + 2 * K4, r + 3 * K4, L, x0, x1);
      _mm512_store_si512(p + 2 * q, x0);
      _mm512_store_si512(p + 2 * q + 1, x1);
    }
  }
}

// The block scales of one 16-row group for one K-block, as the quad lanes see them: quad q lane
// (block l, sub-lane s) belongs to row q + 4l. `uniform`: all 16 rows share one scale (the usual
// case: the group lies inside one bn-row block).
struct GroupScale {
  bool uniform = true;
  float s = 1.0f;
  alignas(64) float quad[4][16];
};

// The scale rows of the 16 rows of group g (row i's block-scale row; divisions once per tile).
struct GroupRows {
  const float* row[16];
  bool uniform;
};
inline void group_scale_rows(const GemmTile& t, int g, GroupRows& gr) {
  const int64_t row0 = t.w_groups[g];
  for (int i = 0; i < 16; ++i) {
    gr.row[i] = t.w_scale ? t.w_scale + ((row0 + i) / t.bn) * t.w_scale_ld : nullptr;
  }
  gr.uniform = gr.row[0] == gr.row[15];
}

inline void load_group_scale(const GroupRows& gr, int64_t kb, GroupScale& gs) {
  gs.uniform = gr.uniform;
  if (gr.row[0] == nullptr) {
    gs.uniform = true;
    gs.s = 1.0f;
    return;
  }
  if (gs.uniform) {
    gs.s = gr.row[0][kb];
    return;
  }
  for (int q = 0; q < 4; ++q) {
    for (int l = 0; l < 4; ++l) {
      const float v = gr.row[q + 4 * l][kb];
      for (int sl = 0; sl < 4; ++sl) gs.quad[q][4 * l + sl] = v;
    }
  }
}

struct PanelCtx {
  const GemmTile& t;
  const uint16_t* a;
  bool scaled;
  const __m512i* panel;
  int64_t group_zmm;  // zmm per 16-row group in the panel
  const GroupScale* gscale;
  float* tot;  // lane-layout totals: [row][group j][quad q][16]
  int ng;
};

// MR activation rows [m0, m0 + MR) against every group of the subtile over K-block kb; folds the
// quad accumulators into the lane-layout totals with their scales.
template <int MR>
FP8MOE_BF16_TARGET __attribute__((noinline)) void run_panel_rows(const PanelCtx& x, int m0,
                                                                 int64_t k0, int64_t kl,
                                                                 int64_t kb) {
  const GemmTile& t = x.t;
  const uint16_t* arow[MR];
  float sa[MR];
  for (int m = 0; m < MR; ++m) {
    const int64_t r = t.a_rows[m0 + m];
    arow[m] = x.a + r * t.lda + k0;
    sa[m] = (x.scaled && t.a_scale) ? t.a_scale[r * t.a_scale_ld + kb] : 1.0f;
  }
  const bool first = kb == 0;
  for (int j = 0; j < x.ng; ++j) {
    const GroupScale& gs = x.gscale[j];
    float s[MR];
    for (int m = 0; m < MR; ++m) s[m] = gs.uniform ? gs.s * sa[m] : sa[m];
    microkernel_panel<MR>(arow, x.panel + j * x.group_zmm, kl, x.tot + (m0 * x.ng + j) * 64,
                          x.ng * 64, x.scaled ? s : nullptr,
                          (x.scaled && !gs.uniform) ? gs.quad : nullptr, first);
  }
}

FP8MOE_BF16_TARGET void run_panel_rows_any(const PanelCtx& x, int m0, int mr, int64_t k0,
                                           int64_t kl, int64_t kb) {
  switch (mr) {
    case 1:
      return run_panel_rows<1>(x, m0, k0, kl, kb);
    case 2:
      return run_panel_rows<2>(x, m0, k0, kl, kb);
    case 3:
      return run_panel_rows<3>(x, m0, k0, kl, kb);
    case 4:
      return run_panel_rows<4>(x, m0, k0, kl, kb);
    case 5:
      return run_panel_rows<5>(x, m0, k0, kl, kb);
    default:
      return run_panel_rows<6>(x, m0, k0, kl, kb);
  }
}

FP8MOE_BF16_TARGET void panel_tile(const GemmTile& t, bool scaled, int64_t kchunk, const Luts& L) {
  const int64_t nkb = (t.K + kchunk - 1) / kchunk;
  const int ngroups = t.NT / 16;
  // Scratch: the panel (64 rows x kMaxKBlock bf16), then the lane totals (R x 4 groups x 64 f32).
  __m512i* panel = static_cast<__m512i*>(t.scratch);
  float* tot =
      reinterpret_cast<float*>(static_cast<char*>(t.scratch) + kPanelRows * kMaxKBlock * 2);
  GroupScale gscale[kPanelRows / 16];
  GroupRows grows[kPanelRows / 16];
  for (int g0 = 0; g0 < ngroups; g0 += kPanelRows / 16) {
    const int ng = std::min(kPanelRows / 16, ngroups - g0);
    if (scaled) {
      for (int j = 0; j < ng; ++j) group_scale_rows(t, g0 + j, grows[j]);
    }
    for (int64_t kb = 0; kb < nkb; ++kb) {
      const int64_t k0 = kb * kchunk;
      const int64_t kl = std::min(kchunk, t.K - k0);
      const int64_t group_zmm = kl / 16 * 8;
      for (int j = 0; j < ng; ++j) {
        build_panel_group(t.w + t.w_groups[g0 + j] * t.K + k0, t.K, kl, L, panel + j * group_zmm);
        if (scaled) load_group_scale(grows[j], kb, gscale[j]);
      }
      const PanelCtx x{t, static_cast<const uint16_t*>(t.a), scaled, panel, group_zmm, gscale, tot,
                       ng};
      for (int m0 = 0; m0 < t.R; m0 += kPanelMr) {
        run_panel_rows_any(x, m0, std::min(kPanelMr, t.R - m0), k0, kl, kb);
      }
    }
    // Lane totals -> C (natural row order within each group).
    for (int m = 0; m < t.R; ++m) {
      for (int j = 0; j < ng; ++j) {
        const float* tp = tot + (m * ng + j) * 64;
        _mm512_storeu_ps(t.c + m * t.ldc + (g0 + j) * 16,
                         reduce_quads(_mm512_load_ps(tp), _mm512_load_ps(tp + 16),
                                      _mm512_load_ps(tp + 32), _mm512_load_ps(tp + 48)));
      }
    }
  }
}

// ---- streaming path (R <= kInlineMaxRows) ----------------------------------------------------
// K in lanes: a zmm holds 64 consecutive codes of one weight row, decoded into x0 (k 16l+0..7 of
// each 128-bit block l) and x1 (k 16l+8..15). No inserts or transposes, so the decode costs five
// byte-shuffle-class instructions per 64 weights, the bound of this regime. The activation rows
// are permuted once per tile into the same order (scratch), so the products use plain loads.
// Each (activation row, weight row) pair accumulates 16 lanes; a K-block's sum is folded into a
// running total with its scale, and the 16 lanes are reduced once at the end.

// Permutes one activation row (K bf16, K % 32 == 0) into x0/x1 order per 64 k: for each 64-k
// chunk, out = [k 0-7, 16-23, 32-39, 48-55 | k 8-15, 24-31, 40-47, 56-63]; a 32-k tail becomes
// [k 0-7, 16-23, 0.., | k 8-15, 24-31, 0..] (64 values, zero-padded).
FP8MOE_BF16_TARGET void permute_a_row(const uint16_t* a, int64_t K, uint16_t* out) {
  int64_t k = 0;
  for (; k + 64 <= K; k += 64) {
    const __m512i lo = _mm512_loadu_si512(a + k);
    const __m512i hi = _mm512_loadu_si512(a + k + 32);
    _mm512_store_si512(out + k, _mm512_shuffle_i32x4(lo, hi, 0x88));
    _mm512_store_si512(out + k + 32, _mm512_shuffle_i32x4(lo, hi, 0xDD));
  }
  if (k < K) {                                     // 32-k tail
    const __m512i lo = _mm512_loadu_si512(a + k);  // 32 bf16
    const __m512i z = _mm512_setzero_si512();
    _mm512_store_si512(out + k, _mm512_shuffle_i32x4(lo, z, 0x88));
    _mm512_store_si512(out + k + 32, _mm512_shuffle_i32x4(lo, z, 0xDD));
  }
}

// Padded length of a permuted row: K rounded up to 64.
inline int64_t permuted_len(int64_t K) { return (K + 63) / 64 * 64; }

// One 64-k chunk of RG rows (full) into the accumulators.
template <int MR, int RG>
FP8MOE_BF16_TARGET inline void stream_full(const uint8_t* w, int64_t K, int64_t k, int64_t prefetch,
                                           const uint16_t* const* ap, const Luts& L,
                                           __m512 (&acc)[MR][RG]) {
#pragma GCC unroll 8
  for (int i = 0; i < RG; ++i) {
    const uint8_t* p = w + i * K + k;
    _mm_prefetch(reinterpret_cast<const char*>(p + prefetch), _MM_HINT_T1);
    __m512i x0, x1;
    decode64(_mm512_loadu_si512(p), L, x0, x1);
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) {
      acc[m][i] = dp(acc[m][i], _mm512_load_si512(ap[m] + k), x0);
      acc[m][i] = dp(acc[m][i], _mm512_load_si512(ap[m] + k + 32), x1);
    }
  }
}

// A 32-k half chunk (K % 64 == 32, or 32-long K-blocks) at k: the upper codes are zero and the
// activations' matching half is moved to blocks 0-1 with zeros above (kSecond: k % 64 == 32).
template <int MR, int RG, bool kSecond>
FP8MOE_BF16_TARGET inline void stream_half(const uint8_t* w, int64_t K, int64_t k,
                                           const uint16_t* const* ap, const Luts& L,
                                           __m512 (&acc)[MR][RG]) {
  constexpr int kImm = kSecond ? 0x0E : 0x04;
  const __m512i z = _mm512_setzero_si512();
  for (int i = 0; i < RG; ++i) {
    const __m512i v =
        _mm512_zextsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + i * K + k)));
    __m512i x0, x1;
    decode64(v, L, x0, x1);
    for (int m = 0; m < MR; ++m) {
      const uint16_t* a = ap[m] + (k / 64) * 64;
      const __m512i a0 = _mm512_shuffle_i32x4(_mm512_load_si512(a), z, kImm);
      const __m512i a1 = _mm512_shuffle_i32x4(_mm512_load_si512(a + 32), z, kImm);
      acc[m][i] = dp(acc[m][i], a0, x0);
      acc[m][i] = dp(acc[m][i], a1, x1);
    }
  }
}

// MR activation rows (permuted, `ap[m]`) x RG consecutive weight rows starting at `w` (K bytes
// apart) over all of K; writes the MR x RG sums to c[m * ldc + i].
template <int MR, int RG>
FP8MOE_BF16_TARGET __attribute__((noinline)) void stream_rows(
    const GemmTile& t, const uint16_t* const* ap, const float* const* sa, const uint8_t* w,
    int64_t row0, int64_t kchunk, bool scaled, const Luts& L, float* c) {
  __m512 tot[MR][RG];
  for (int m = 0; m < MR; ++m) {
    for (int i = 0; i < RG; ++i) tot[m][i] = _mm512_setzero_ps();
  }
  const float* sw[RG];  // each row's block-scale row (no division in the K loop)
  for (int i = 0; i < RG; ++i) {
    sw[i] = (scaled && t.w_scale) ? t.w_scale + ((row0 + i) / t.bn) * t.w_scale_ld : nullptr;
  }
  bool uniform = true;  // all RG rows in one scale block (the usual case)
  for (int i = 1; i < RG; ++i) uniform = uniform && sw[i] == sw[0];
  const int64_t nkb = (t.K + kchunk - 1) / kchunk;
  // Software prefetch distance. The RG rows are consecutive, so this call reads one contiguous
  // block of RG * K bytes, row-interleaved. Short rows (a small block): fetch the same position
  // of the next block, i.e. exactly one call ahead; long rows: a fixed distance along the row.
  const int64_t block = RG * t.K;
  const int64_t prefetch = block <= kPrefetchBlockMax ? block : kPrefetchDistance;
  for (int64_t kb = 0; kb < nkb; ++kb) {
    const int64_t k0 = kb * kchunk;
    const int64_t k1 = std::min(t.K, k0 + kchunk);
    __m512 acc[MR][RG];
    for (int m = 0; m < MR; ++m) {
      for (int i = 0; i < RG; ++i) acc[m][i] = _mm512_setzero_ps();
    }
    int64_t k = k0;
    if (k % 64 != 0) {  // a block starting mid-chunk (32-long blocks)
      stream_half<MR, RG, true>(w, t.K, k, ap, L, acc);
      k += 32;
    }
    for (; k + 64 <= k1; k += 64) stream_full<MR, RG>(w, t.K, k, prefetch, ap, L, acc);
    if (k < k1) stream_half<MR, RG, false>(w, t.K, k, ap, L, acc);
    // Fold with the block scale (1 without scales: an exact add).
    for (int m = 0; m < MR; ++m) {
      const float sam = (scaled && t.a_scale) ? sa[m][kb] : 1.0f;
      if (uniform) {
        const __m512 s = _mm512_set1_ps(sw[0] ? sam * sw[0][kb] : sam);
        for (int i = 0; i < RG; ++i) tot[m][i] = _mm512_fmadd_ps(acc[m][i], s, tot[m][i]);
      } else {
        for (int i = 0; i < RG; ++i) {
          const float s = sw[i] ? sam * sw[i][kb] : sam;
          tot[m][i] = _mm512_fmadd_ps(acc[m][i], _mm512_set1_ps(s), tot[m][i]);
        }
      }
    }
  }
  // Lane sums: four accumulators at a time through the quad reduction (fixed order).
  for (int m = 0; m < MR; ++m) {
    if constexpr (RG % 4 == 0) {
      for (int i = 0; i < RG; i += 4) {
        __m512 v = reduce_quads(tot[m][i], tot[m][i + 1], tot[m][i + 2], tot[m][i + 3]);
        v = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, 0x4E));
        v = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, 0xB1));
        _mm_storeu_ps(c + m * t.ldc + i, _mm512_castps512_ps128(v));
      }
    } else {
      for (int i = 0; i < RG; ++i) c[m * t.ldc + i] = _mm512_reduce_add_ps(tot[m][i]);
    }
  }
}

template <int MR, int RG>
FP8MOE_BF16_TARGET void stream_groups(const GemmTile& t, const uint16_t* const* ap,
                                      const float* const* sa, int64_t kchunk, bool scaled,
                                      const Luts& L) {
  for (int g = 0; g < t.NT / 16; ++g) {
    for (int i0 = 0; i0 < 16; i0 += RG) {
      const int64_t row0 = t.w_groups[g] + i0;
      stream_rows<MR, RG>(t, ap, sa, t.w + row0 * t.K, row0, kchunk, scaled, L, t.c + g * 16 + i0);
    }
  }
}

FP8MOE_BF16_TARGET void stream_tile(const GemmTile& t, bool scaled, int64_t kchunk, const Luts& L) {
  const int64_t plen = permuted_len(t.K);
  uint16_t* buf = static_cast<uint16_t*>(t.scratch);
  const uint16_t* ap[kInlineMaxRows];
  const float* sa[kInlineMaxRows];
  for (int m = 0; m < t.R; ++m) {
    const int64_t r = t.a_rows[m];
    permute_a_row(static_cast<const uint16_t*>(t.a) + r * t.lda, t.K, buf + m * plen);
    ap[m] = buf + m * plen;
    sa[m] = t.a_scale ? t.a_scale + r * t.a_scale_ld : nullptr;
  }
  switch (t.R) {
    case 1:
      return stream_groups<1, 8>(t, ap, sa, kchunk, scaled, L);
    case 2:
      return stream_groups<2, 4>(t, ap, sa, kchunk, scaled, L);
    case 3:
      return stream_groups<3, 2>(t, ap, sa, kchunk, scaled, L);
    case 4:
      return stream_groups<4, 2>(t, ap, sa, kchunk, scaled, L);
    case 5:
      return stream_groups<5, 1>(t, ap, sa, kchunk, scaled, L);
    case 6:
      return stream_groups<6, 1>(t, ap, sa, kchunk, scaled, L);
    case 7:
      return stream_groups<7, 1>(t, ap, sa, kchunk, scaled, L);
    default:
      return stream_groups<8, 1>(t, ap, sa, kchunk, scaled, L);
  }
}

FP8MOE_BF16_TARGET void gemm_a_bf16(const GemmTile& t) {
  const Luts L = load_luts();
  const bool scaled = t.w_scale != nullptr || t.a_scale != nullptr;
  const int64_t kchunk = scaled ? t.kblock : kChunkNoScale;
  if (t.R <= kInlineMaxRows) {
    stream_tile(t, scaled, kchunk, L);
  } else {
    panel_tile(t, scaled, kchunk, L);
  }
}

// ---- activation quantisation ------------------------------------------------------------------
// per_token_group_quant_fp8 on one group (numerics::quantize_group_fp8 with e4m3fn), bit for bit,
// writing the dequantised codes as bf16 operands (decode(q) exactly, without the scale) instead of
// the codes: amax (NaN ignored, floor 1e-10) / 448 [ceil to a power of two] [floor min_scale];
// q = e4m3fn_RNE(clamp(x / s, +-448)) with clamp(NaN) = -448 as fminf(fmaxf(v, -448), 448).
// Rounding on the bits: normal range |v| >= 2^-6: round the mantissa to 3 bits, ties to even
// (the carry may step the exponent); below: v * 512 rounded to the nearest even integer, times
// 2^-9. The value is exact in bf16 (4 significant bits), the sign is kept (-0 stays -0).
FP8MOE_BF16_TARGET float quantize_group_bf16(const float* x, int64_t n, uint16_t* out, bool ue8m0,
                                             float min_scale) {
  const __m512 sign_mask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FFFFFFF));
  __m512 m = _mm512_set1_ps(numerics::kGroupQuantEps);
  for (int64_t i = 0; i < n; i += 16) {
    // max(|x|, m) with m second: a NaN element leaves m unchanged (fmaxf semantics).
    m = _mm512_max_ps(_mm512_and_ps(_mm512_loadu_ps(x + i), sign_mask), m);
  }
  float s = _mm512_reduce_max_ps(m) / numerics::kE4M3FnMax;
  if (ue8m0) s = numerics::ceil_pow2(std::fmax(std::fabs(s), numerics::kGroupQuantEps));
  s = std::fmax(s, min_scale);
  const __m512 vs = _mm512_set1_ps(s);
  const __m512 lo = _mm512_set1_ps(-numerics::kE4M3FnMax),
               hi = _mm512_set1_ps(numerics::kE4M3FnMax);
  const __m512i one = _mm512_set1_epi32(1), bias = _mm512_set1_epi32(0x7FFFF);
  const __m512i keep = _mm512_set1_epi32(static_cast<int>(0xFFF00000u));
  const __m512 min_normal = _mm512_set1_ps(0x1p-6f), k512 = _mm512_set1_ps(512.0f),
               inv512 = _mm512_set1_ps(0x1p-9f);
  for (int64_t i = 0; i < n; i += 16) {
    __m512 v = _mm512_div_ps(_mm512_loadu_ps(x + i), vs);
    v = _mm512_min_ps(_mm512_max_ps(v, lo), hi);  // NaN -> lo (second operand), as fmaxf
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i sign = _mm512_andnot_si512(_mm512_castps_si512(sign_mask), bits);
    const __m512 a = _mm512_and_ps(v, sign_mask);
    // Normal: RNE to 3 mantissa bits.
    const __m512i ab = _mm512_castps_si512(a);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(ab, 20), one);
    const __m512i rn = _mm512_and_si512(_mm512_add_epi32(ab, _mm512_add_epi32(bias, lsb)), keep);
    // Subnormal: round(a * 512) to even, * 2^-9.
    const __m512 rs = _mm512_mul_ps(
        _mm512_roundscale_ps(_mm512_mul_ps(a, k512), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
        inv512);
    const __mmask16 small = _mm512_cmp_ps_mask(a, min_normal, _CMP_LT_OQ);
    const __m512i mag = _mm512_mask_mov_epi32(rn, small, _mm512_castps_si512(rs));
    const __m512i q = _mm512_or_si512(mag, sign);
    // bf16 = the high half of each (exact) f32.
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i),
                        _mm512_cvtepi32_epi16(_mm512_srli_epi32(q, 16)));
  }
  return s;
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
  static const KernelTable table{gemm_a_bf16, nullptr, decode_e4m3_to_bf16, decode_e4m3_to_f32,
                                 quantize_group_bf16};
  return &table;
}

}  // namespace fp8moe::cpu

#else

namespace fp8moe::cpu {
const KernelTable* avx512bf16_kernel_table() { return nullptr; }
}  // namespace fp8moe::cpu

#endif
