// The portable levels of the CPU GEMM tile (cpu_kernels.hpp), compiled by Highway for its AVX3
// (AVX-512), AVX2 and SCALAR targets and chosen at run time by cpu_isa.cpp.
//
// Layout: K in lanes. A vector holds consecutive k of one weight row, decoded from e4m3fn to f32
// by bit arithmetic (exact for all 256 codes, independent of the FTZ/DAZ flags), and the matching
// activations (bf16 widened, or f32). Each (activation row, weight row) pair owns an accumulator;
// at the end of a K-block its lanes are summed (fixed order) and folded into C with the block
// scales. Products of e4m3 and bf16/e4m3 values are exact in f32.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/cpu/cpu_kernels_hwy.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>

#include <algorithm>

#include "kernels/cpu/cpu_kernels.hpp"

HWY_BEFORE_NAMESPACE();
namespace fp8moe::cpu {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

#if HWY_TARGET == HWY_AVX3
constexpr int kMr = 4;  // 32 vector registers
#else
constexpr int kMr = 2;  // 16 (AVX2) or scalar registers
#endif
constexpr int kNr = 4;

using DF = hn::ScalableTag<float>;
using DU = hn::RebindToUnsigned<DF>;
using DI = hn::RebindToSigned<DF>;

// Lanes(DF) e4m3fn codes -> f32. Normal codes: exponent rebias (+120) by integer add; subnormal
// codes (exponent field 0): m * 2^-9 from an exact int -> float conversion; 0x7F/0xFF: NaN with
// the code's sign, as the scalar codec.
HWY_INLINE hn::Vec<DF> decode_f32(DF df, const uint8_t* p) {
  const DU du;
  const DI di;
  const hn::Rebind<uint8_t, DU> d8;
  const auto u = hn::PromoteTo(du, hn::LoadU(d8, p));
  const auto mag = hn::And(u, hn::Set(du, 0x7Fu));
  const auto sign = hn::ShiftLeft<24>(hn::And(u, hn::Set(du, 0x80u)));
  const auto normal = hn::Add(hn::ShiftLeft<20>(mag), hn::Set(du, 120u << 23));
  const auto sub =
      hn::BitCast(du, hn::Mul(hn::ConvertTo(df, hn::BitCast(di, mag)), hn::Set(df, 1.0f / 512.0f)));
  auto bits = hn::IfThenElse(hn::Lt(mag, hn::Set(du, 8u)), sub, normal);
  bits = hn::IfThenElse(hn::Eq(mag, hn::Set(du, 0x7Fu)), hn::Set(du, 0x7FC00000u), bits);
  return hn::BitCast(df, hn::Or(bits, sign));
}

template <bool kBf16>
HWY_INLINE hn::Vec<DF> load_a(DF df, const void* base, int64_t off) {
  if constexpr (kBf16) {
    const DU du;
    const hn::Rebind<uint16_t, DU> d16;
    const auto u = hn::PromoteTo(du, hn::LoadU(d16, static_cast<const uint16_t*>(base) + off));
    return hn::BitCast(df, hn::ShiftLeft<16>(u));
  } else {
    return hn::LoadU(df, static_cast<const float*>(base) + off);
  }
}

// Decodes 16 weight rows (row 0 at w, K bytes apart), kl codes each, into panel[16][kl] f32.
HWY_NOINLINE void decode_panel(const uint8_t* w, int64_t K, int64_t kl, float* panel) {
  const DF df;
  const int64_t L = static_cast<int64_t>(hn::Lanes(df));
  for (int i = 0; i < 16; ++i) {
    for (int64_t k = 0; k < kl; k += L)
      hn::Store(decode_f32(df, w + i * K + k), df, panel + i * kl + k);
  }
}

// MR activation rows x kNr weight rows over one K-block (kl values), K in lanes; folds the lane
// vectors into the running totals `tot` (lane layout, (MR, kNr, L) floats) with their scale.
// The weights come from the decoded panel (rows kl apart), or, kInline, are decoded from the
// codes `w` (rows K apart) — when there are too few activation rows to amortise a panel.
template <int MR, bool kBf16, bool kInline>
HWY_NOINLINE void block_kernel(const GemmTile& t, const int64_t* aoff, const float* panel,
                               const uint8_t* w, int64_t kl, const float* scale, float* tot,
                               int64_t tot_ld, bool first) {
  const DF df;
  const int64_t L = static_cast<int64_t>(hn::Lanes(df));
  hn::Vec<DF> acc[MR][kNr];
  for (int m = 0; m < MR; ++m) {
    for (int n = 0; n < kNr; ++n) acc[m][n] = hn::Zero(df);
  }
  for (int64_t k = 0; k < kl; k += L) {
    hn::Vec<DF> b[kNr];
    for (int n = 0; n < kNr; ++n) {
      b[n] = kInline ? decode_f32(df, w + n * t.K + k) : hn::Load(df, panel + n * kl + k);
    }
    for (int m = 0; m < MR; ++m) {
      const auto a = load_a<kBf16>(df, t.a, aoff[m] + k);
      for (int n = 0; n < kNr; ++n) acc[m][n] = hn::MulAdd(a, b[n], acc[m][n]);
    }
  }
  for (int m = 0; m < MR; ++m) {
    for (int n = 0; n < kNr; ++n) {
      float* tp = tot + m * tot_ld + n * L;
      const auto s = hn::Set(df, scale ? scale[m * kNr + n] : 1.0f);
      hn::Store(first ? hn::Mul(acc[m][n], s) : hn::MulAdd(acc[m][n], s, hn::Load(df, tp)), df, tp);
    }
  }
}

// One 16-row weight group against all activation rows: for each K-block, decode the group into a
// panel once, run every row block against it, fold with the block scales; finally sum the lanes.
template <bool kBf16>
void gemm_group(const GemmTile& t, int g, int64_t kchunk, int64_t nkb, bool scaled, float* panel,
                float* tot) {
  const DF df;
  const int64_t L = static_cast<int64_t>(hn::Lanes(df));
  const int64_t row0 = t.w_groups[g];
  const uint8_t* w = t.w + row0 * t.K;
  const float* sw[16];
  for (int i = 0; i < 16; ++i) {
    sw[i] = t.w_scale ? t.w_scale + ((row0 + i) / t.bn) * t.w_scale_ld : nullptr;
  }
  const int64_t tot_ld = 16 * L;  // per activation row: 16 weight rows x L lanes
  for (int64_t kb = 0; kb < nkb; ++kb) {
    const int64_t k0 = kb * kchunk;
    const int64_t kl = std::min(kchunk, t.K - k0);
    // One row block: decode while multiplying; several: decode the group's K-block once.
    const bool inline_decode = t.R <= kMr;
    if (!inline_decode) decode_panel(w + k0, t.K, kl, panel);
    for (int m0 = 0; m0 < t.R; m0 += kMr) {
      const int mr = std::min(kMr, t.R - m0);
      int64_t aoff[kMr];
      float sa[kMr];
      for (int m = 0; m < mr; ++m) {
        const int64_t r = t.a_rows[m0 + m];
        aoff[m] = r * t.lda + k0;
        sa[m] = (scaled && t.a_scale) ? t.a_scale[r * t.a_scale_ld + kb] : 1.0f;
      }
      for (int n0 = 0; n0 < 16; n0 += kNr) {
        float scale[kMr * kNr];
        for (int m = 0; m < mr; ++m) {
          for (int n = 0; n < kNr; ++n) {
            scale[m * kNr + n] = sa[m] * ((scaled && sw[n0 + n]) ? sw[n0 + n][kb] : 1.0f);
          }
        }
        float* tp = tot + m0 * tot_ld + n0 * L;
        const float* pp = panel + n0 * kl;
        const uint8_t* wp = w + n0 * t.K + k0;
        const float* sc = scaled ? scale : nullptr;
        const bool first = kb == 0;
        if (inline_decode) {
          switch (mr) {
#if HWY_TARGET == HWY_AVX3
            case 4:
              block_kernel<4, kBf16, true>(t, aoff, pp, wp, kl, sc, tp, tot_ld, first);
              break;
            case 3:
              block_kernel<3, kBf16, true>(t, aoff, pp, wp, kl, sc, tp, tot_ld, first);
              break;
#endif
            case 2:
              block_kernel<2, kBf16, true>(t, aoff, pp, wp, kl, sc, tp, tot_ld, first);
              break;
            default:
              block_kernel<1, kBf16, true>(t, aoff, pp, wp, kl, sc, tp, tot_ld, first);
              break;
          }
          continue;
        }
        switch (mr) {
#if HWY_TARGET == HWY_AVX3
          case 4:
            block_kernel<4, kBf16, false>(t, aoff, pp, wp, kl, sc, tp, tot_ld, first);
            break;
          case 3:
            block_kernel<3, kBf16, false>(t, aoff, pp, wp, kl, sc, tp, tot_ld, first);
            break;
#endif
          case 2:
            block_kernel<2, kBf16, false>(t, aoff, pp, wp, kl, sc, tp, tot_ld, first);
            break;
          default:
            block_kernel<1, kBf16, false>(t, aoff, pp, wp, kl, sc, tp, tot_ld, first);
            break;
        }
      }
    }
  }
  for (int m = 0; m < t.R; ++m) {
    for (int i = 0; i < 16; ++i) {
      t.c[m * t.ldc + g * 16 + i] =
          hn::GetLane(hn::SumOfLanes(df, hn::Load(df, tot + m * tot_ld + i * L)));
    }
  }
}

template <bool kBf16>
void gemm_tile(const GemmTile& t) {
  const bool scaled = t.w_scale != nullptr || t.a_scale != nullptr;
  const int64_t kchunk = scaled ? t.kblock : kChunkNoScale;
  const int64_t nkb = (t.K + kchunk - 1) / kchunk;
  // Scratch: the decoded panel (16 x kMaxKBlock f32), then the running totals (R x 16 x L f32).
  float* panel = static_cast<float*>(t.scratch);
  float* tot = panel + 16 * kMaxKBlock;
  for (int g = 0; g < t.NT / 16; ++g) gemm_group<kBf16>(t, g, kchunk, nkb, scaled, panel, tot);
}

// f32 -> bf16 bits as numerics::float_to_bf16: RNE; NaN keeps its sign and becomes quiet.
HWY_INLINE hn::Vec<DU> bf16_bits(DF df, hn::Vec<DF> v) {
  const DU du;
  const auto u = hn::BitCast(du, v);
  const auto lsb = hn::And(hn::ShiftRight<16>(u), hn::Set(du, 1u));
  const auto rounded = hn::ShiftRight<16>(hn::Add(u, hn::Add(hn::Set(du, 0x7FFFu), lsb)));
  const auto nan = hn::Or(hn::ShiftRight<16>(u), hn::Set(du, 0x40u));
  return hn::IfThenElse(hn::RebindMask(du, hn::IsNaN(v)), nan, rounded);
}

void row_epilogue(const RowEpilogue& e) {
  const DF df;
  const hn::Rebind<uint16_t, DU> d16;
  const int64_t L = static_cast<int64_t>(hn::Lanes(df));
  const auto rs = hn::Set(df, e.row_scale);
  const auto w = hn::Set(df, e.weight);
  for (int64_t i = 0; i < e.n; i += L) {
    auto v = hn::LoadU(df, e.c + i);
    if (e.apply_scales) {
      v = hn::Mul(hn::Mul(v, rs), e.col_scale ? hn::LoadU(df, e.col_scale + i) : hn::Set(df, 1.0f));
    }
    v = hn::Add(v, e.bias ? hn::LoadU(df, e.bias + i) : hn::Zero(df));
    if (e.mul_weight) v = hn::Mul(v, w);
    if (e.bf16) {
      const auto b = bf16_bits(df, v);
      if (e.out_bf16) hn::StoreU(hn::TruncateTo(d16, b), d16, e.out_bf16 + i);
      if (e.out_f32) hn::StoreU(hn::BitCast(df, hn::ShiftLeft<16>(b)), df, e.out_f32 + i);
    } else {
      hn::StoreU(v, df, e.out_f32 + i);
    }
  }
}

void sum_rows(const void* const* rows, int nrows, int64_t n, bool bf16, void* out) {
  const DF df;
  const DU du;
  const hn::Rebind<uint16_t, DU> d16;
  const int64_t L = static_cast<int64_t>(hn::Lanes(df));
  for (int64_t i = 0; i < n; i += L) {
    auto acc = hn::Zero(df);
    for (int r = 0; r < nrows; ++r) {
      if (bf16) {
        const auto u = hn::PromoteTo(du, hn::LoadU(d16, static_cast<const uint16_t*>(rows[r]) + i));
        acc = hn::Add(acc, hn::BitCast(df, hn::ShiftLeft<16>(u)));
      } else {
        acc = hn::Add(acc, hn::LoadU(df, static_cast<const float*>(rows[r]) + i));
      }
    }
    if (bf16) {
      hn::StoreU(hn::TruncateTo(d16, bf16_bits(df, acc)), d16, static_cast<uint16_t*>(out) + i);
    } else {
      hn::StoreU(acc, df, static_cast<float*>(out) + i);
    }
  }
}

void gemm_a_bf16(const GemmTile& t) { gemm_tile<true>(t); }
void gemm_a_f32(const GemmTile& t) { gemm_tile<false>(t); }

void decode_e4m3_to_f32(const uint8_t* in, float* out, int64_t n) {
  const DF df;
  const int64_t L = static_cast<int64_t>(hn::Lanes(df));
  int64_t i = 0;
  for (; i + L <= n; i += L) hn::StoreU(decode_f32(df, in + i), df, out + i);
  if (i < n) {
    alignas(64) uint8_t tail_in[64] = {};
    alignas(64) float tail_out[64];
    std::copy(in + i, in + n, tail_in);
    for (int64_t j = 0; j < n - i; j += L)
      hn::StoreU(decode_f32(df, tail_in + j), df, tail_out + j);
    std::copy(tail_out, tail_out + (n - i), out + i);
  }
}

const KernelTable* table() {
  static const KernelTable t{gemm_a_bf16, gemm_a_f32,   nullptr, decode_e4m3_to_f32,
                             nullptr,     row_epilogue, sum_rows};
  return &t;
}

}  // namespace HWY_NAMESPACE
}  // namespace fp8moe::cpu
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace fp8moe::cpu {

const KernelTable* hwy_kernel_table(Isa isa) {
  switch (isa) {
#if HWY_TARGETS & HWY_AVX3
    case Isa::kAvx512:
      return N_AVX3::table();
#endif
#if HWY_TARGETS & HWY_AVX2
    case Isa::kAvx2:
      return N_AVX2::table();
#endif
#if HWY_TARGETS & HWY_SCALAR
    case Isa::kScalar:
      return N_SCALAR::table();
#endif
    default:
      return nullptr;
  }
}

}  // namespace fp8moe::cpu
#endif  // HWY_ONCE
