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
constexpr int kMr = 2;
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

// MR activation rows x kNr weight rows over one K-block; folds into C.
template <int MR, bool kBf16>
HWY_NOINLINE void block_kernel(const GemmTile& t, int m0, int n0, int64_t k0, int64_t kl,
                               int64_t kb, bool scaled, bool first) {
  const DF df;
  const int64_t L = static_cast<int64_t>(hn::Lanes(df));
  const uint8_t* w[kNr];
  int64_t aoff[MR];
  for (int n = 0; n < kNr; ++n) w[n] = t.w + (t.w_groups[n0 / 16] + n0 % 16 + n) * t.K + k0;
  for (int m = 0; m < MR; ++m) aoff[m] = t.a_rows[m0 + m] * t.lda + k0;
  hn::Vec<DF> acc[MR][kNr];
  for (int m = 0; m < MR; ++m) {
    for (int n = 0; n < kNr; ++n) acc[m][n] = hn::Zero(df);
  }
  for (int64_t k = 0; k < kl; k += L) {
    hn::Vec<DF> b[kNr];
    for (int n = 0; n < kNr; ++n) b[n] = decode_f32(df, w[n] + k);
    for (int m = 0; m < MR; ++m) {
      const auto a = load_a<kBf16>(df, t.a, aoff[m] + k);
      for (int n = 0; n < kNr; ++n) acc[m][n] = hn::MulAdd(a, b[n], acc[m][n]);
    }
  }
  for (int m = 0; m < MR; ++m) {
    const int64_t r = t.a_rows[m0 + m];
    const float sa = (scaled && t.a_scale) ? t.a_scale[r * t.a_scale_ld + kb] : 1.0f;
    float* c = t.c + (m0 + m) * t.ldc + n0;
    for (int n = 0; n < kNr; ++n) {
      const float s = hn::GetLane(hn::SumOfLanes(df, acc[m][n]));
      float scale = sa;
      if (scaled && t.w_scale) {
        const int64_t row = t.w_groups[n0 / 16] + n0 % 16 + n;
        scale = t.w_scale[(row / t.bn) * t.w_scale_ld + kb] * sa;
      }
      const float v = (scaled ? s * scale : s);
      c[n] = first ? v : c[n] + v;
    }
  }
}

template <bool kBf16>
void gemm_tile(const GemmTile& t) {
  const bool scaled = t.w_scale != nullptr || t.a_scale != nullptr;
  const int64_t kchunk = scaled ? t.kblock : kChunkNoScale;
  const int64_t nkb = (t.K + kchunk - 1) / kchunk;
  for (int m0 = 0; m0 < t.R; m0 += kMr) {
    const int mr = std::min(kMr, t.R - m0);
    for (int n0 = 0; n0 < t.NT; n0 += kNr) {
      for (int64_t kb = 0; kb < nkb; ++kb) {
        const int64_t k0 = kb * kchunk;
        const int64_t kl = std::min(kchunk, t.K - k0);
        switch (mr) {
#if HWY_TARGET == HWY_AVX3
          case 4:
            block_kernel<4, kBf16>(t, m0, n0, k0, kl, kb, scaled, kb == 0);
            break;
          case 3:
            block_kernel<3, kBf16>(t, m0, n0, k0, kl, kb, scaled, kb == 0);
            break;
#endif
          case 2:
            block_kernel<2, kBf16>(t, m0, n0, k0, kl, kb, scaled, kb == 0);
            break;
          default:
            block_kernel<1, kBf16>(t, m0, n0, k0, kl, kb, scaled, kb == 0);
            break;
        }
      }
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
  static const KernelTable t{gemm_a_bf16, gemm_a_f32, nullptr, decode_e4m3_to_f32};
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
