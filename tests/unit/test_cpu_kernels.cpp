// CPU SIMD kernels (src/kernels/cpu/cpu_kernels.hpp), on every instruction-set level this build
// has and this machine runs: the e4m3 decoders against the shared scalar codec on all 256 codes,
// and the GEMM tile against a float64 loop (exact mode bit for bit, statistical mode within a
// tight relative bound), with and without per-K-block scales, for 1..9 activation rows.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "fp8moe/numerics.hpp"
#include "kernels/cpu/cpu_kernels.hpp"
#include "numerics/quant.hpp"

namespace fp8moe::cpu {
namespace {

std::vector<Isa> levels() { return supported_isas(); }

std::string level_name(const testing::TestParamInfo<Isa>& info) {
  return std::string(isa_name(info.param));
}

class CpuKernels : public testing::TestWithParam<Isa> {};

TEST(CpuIsa, ScalarAndTheBestLevelAreAvailable) {
  const auto all = supported_isas();
  ASSERT_FALSE(all.empty());
  EXPECT_EQ(all.back(), Isa::kScalar);
  EXPECT_EQ(active_isa(), all.front());
  {
    ScopedIsa forced(Isa::kScalar);
    EXPECT_EQ(active_isa(), Isa::kScalar);
  }
  EXPECT_EQ(active_isa(), all.front());
}

TEST_P(CpuKernels, DecodeAll256CodesToF32MatchesTheScalarCodec) {
  const KernelTable& k = kernel_table(GetParam());
  ASSERT_NE(k.decode_e4m3_to_f32, nullptr);
  // All codes, then a ragged length to cover the tails.
  for (int64_t n : {256, 77}) {
    std::vector<uint8_t> in(n);
    for (int64_t i = 0; i < n; ++i) in[i] = static_cast<uint8_t>((i * 37 + 11) % 256);
    if (n == 256) {
      for (int i = 0; i < 256; ++i) in[i] = static_cast<uint8_t>(i);
    }
    std::vector<float> out(n, -1.0f);
    k.decode_e4m3_to_f32(in.data(), out.data(), n);
    for (int64_t i = 0; i < n; ++i) {
      EXPECT_EQ(std::bit_cast<uint32_t>(out[i]),
                std::bit_cast<uint32_t>(numerics::e4m3fn_to_float(in[i])))
          << "code 0x" << std::hex << int(in[i]);
    }
  }
}

// The levels that decode to bf16 (AVX-512 BF16): every code, through the kernel's own decode.
TEST(CpuKernelsBf16, DecodeAll256CodesToBf16MatchesTheScalarCodec) {
  for (Isa isa : supported_isas()) {
    const KernelTable& k = kernel_table(isa);
    if (k.decode_e4m3_to_bf16 == nullptr) continue;  // decodes to f32 (tested above)
    std::vector<uint8_t> in(256);
    for (int i = 0; i < 256; ++i) in[i] = static_cast<uint8_t>(i);
    std::vector<uint16_t> out(256, 0xDEAD);
    k.decode_e4m3_to_bf16(in.data(), out.data(), 256);
    for (int i = 0; i < 256; ++i) {
      const uint32_t f =
          std::bit_cast<uint32_t>(numerics::e4m3fn_to_float(static_cast<uint8_t>(i)));
      EXPECT_EQ(f & 0xFFFFu, 0u);  // every e4m3 value is exact in bf16
      EXPECT_EQ(out[i], static_cast<uint16_t>(f >> 16))
          << isa_name(isa) << " code 0x" << std::hex << i;
    }
  }
}

// The SIMD per-group activation quantiser (levels that have one) against the shared scalar
// numerics::quantize_group_fp8 + the e4m3 decode: scales and operands bit for bit, on random
// groups and on the edge cases (NaN, +-inf, +-0, float subnormals, e4m3 subnormals, rounding
// midpoints, saturation), with and without UE8M0 and the fused path's scale floor.
TEST(CpuKernelsQuant, GroupQuantiserMatchesTheScalarQuantiserBitForBit) {
  std::mt19937 rng(7);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::uniform_int_distribution<int> pick(0, 9);
  const float specials[] = {std::nanf(""), -std::nanf(""), INFINITY, -INFINITY, 0.0f,    -0.0f,
                            1e-41f,        -1e-41f,        0x1p-9f,  0x1.8p-9f, 0x1p-7f, 0x1.1p-6f};
  int checked = 0;
  for (Isa isa : supported_isas()) {
    const KernelTable& k = kernel_table(isa);
    if (k.quantize_group_bf16 == nullptr) continue;
    for (int trial = 0; trial < 400; ++trial) {
      const int64_t n = 32 << (trial % 3);  // 32, 64, 128
      std::vector<float> x(n);
      const float mag = std::ldexp(1.0f, (trial % 41) - 20);
      for (auto& v : x) {
        const int c = pick(rng);
        if (c == 0 && trial % 4 == 0) {
          v = specials[rng() % (sizeof(specials) / sizeof(specials[0]))];
        } else if (c == 1) {
          // A value on an e4m3 rounding midpoint once scaled (half a step above a code).
          v = mag * (1.0f + 1.0f / 16.0f) * static_cast<float>(1 + rng() % 7);
        } else {
          v = nd(rng) * mag;
        }
      }
      const bool ue8m0 = trial % 5 == 1;
      const float floor = trial % 7 == 3 ? numerics::min_scaling_factor(DType::kF8E4M3FN) : 0.0f;
      std::vector<uint8_t> q(n);
      const float want_s =
          numerics::quantize_group_fp8(x.data(), n, q.data(), DType::kF8E4M3FN, ue8m0, floor);
      std::vector<uint16_t> got(n, 0xDEAD);
      const float got_s = k.quantize_group_bf16(x.data(), n, got.data(), ue8m0, floor);
      ASSERT_EQ(std::bit_cast<uint32_t>(got_s), std::bit_cast<uint32_t>(want_s))
          << isa_name(isa) << " trial " << trial;
      for (int64_t i = 0; i < n; ++i) {
        const uint16_t want =
            static_cast<uint16_t>(std::bit_cast<uint32_t>(numerics::e4m3fn_to_float(q[i])) >> 16);
        ASSERT_EQ(got[i], want) << isa_name(isa) << " trial " << trial << " x=" << x[i] << " scale "
                                << want_s << " code 0x" << std::hex << int(q[i]);
      }
      ++checked;
    }
  }
  if (checked == 0) GTEST_SKIP() << "no level with a SIMD quantiser on this machine";
}

// A random GEMM tile problem and its float64 answer.
struct TileProblem {
  int64_t K, N, kblock, bn;
  int R, NT;
  bool a_bf16, a_scales, w_scales, exact;
  std::vector<uint16_t> a16;
  std::vector<float> a32;
  std::vector<int32_t> a_rows, w_groups;

  int64_t w_row(int i) const { return w_groups[i / 16] + i % 16; }
  std::vector<float> sa, sw;
  std::vector<uint8_t> w;
  int64_t num_a_rows, nkb;

  double a_at(int64_t row, int64_t k) const {
    return a_bf16 ? numerics::bf16_to_float(a16[row * K + k]) : a32[row * K + k];
  }

  void make(uint32_t seed) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    std::uniform_int_distribution<int> small(-4, 4);
    std::uniform_int_distribution<int> small_exp(-2, 2);  // keeps every f32 sum exact
    num_a_rows = R + 3;
    nkb = (K + kblock - 1) / kblock;
    a16.assign(num_a_rows * K, 0);
    a32.assign(num_a_rows * K, 0);
    for (int64_t i = 0; i < num_a_rows * K; ++i) {
      const float v = exact ? static_cast<float>(small(rng)) : nd(rng);
      a16[i] = numerics::float_to_bf16(v);
      a32[i] = v;
    }
    // Activation rows in a scrambled order (the driver gathers token rows through indices).
    a_rows.resize(R);
    for (int r = 0; r < R; ++r) a_rows[r] = static_cast<int32_t>((r * 5 + 2) % num_a_rows);
    w.resize(N * K);
    for (auto& b : w) {
      if (exact) {
        b = numerics::float_to_e4m3fn(static_cast<float>(small(rng)));
      } else {
        do {
          b = static_cast<uint8_t>(rng() & 0xFF);
        } while ((b & 0x7F) == 0x7F);  // no NaN codes in the GEMM tests
      }
    }
    // Groups of 16 consecutive weight rows, in a scrambled order.
    w_groups.resize(NT / 16);
    for (int g = 0; g < NT / 16; ++g) {
      w_groups[g] = static_cast<int32_t>(((g * 7 + 3) * 16 + g) % (N - 15));
    }
    sa.resize(num_a_rows * nkb);
    sw.resize(((N + bn - 1) / bn) * nkb);
    for (auto& s : sa) s = exact ? std::ldexp(1.0f, small_exp(rng)) : std::exp(nd(rng));
    for (auto& s : sw) s = exact ? std::ldexp(1.0f, small_exp(rng)) : std::exp(nd(rng)) * 1e-2f;
  }

  GemmTile tile(float* c, void* scratch) const {
    GemmTile t;
    t.a = a_bf16 ? static_cast<const void*>(a16.data()) : static_cast<const void*>(a32.data());
    t.a_bf16 = a_bf16;
    t.lda = K;
    t.a_rows = a_rows.data();
    t.R = R;
    t.a_scale = a_scales ? sa.data() : nullptr;
    t.a_scale_ld = nkb;
    t.w = w.data();
    t.K = K;
    t.w_groups = w_groups.data();
    t.NT = NT;
    t.w_scale = w_scales ? sw.data() : nullptr;
    t.bn = bn;
    t.w_scale_ld = nkb;
    t.kblock = kblock;
    t.c = c;
    t.ldc = NT;
    t.scratch = scratch;
    return t;
  }

  double expected(int r, int i) const {
    const bool scaled = a_scales || w_scales;
    double total = 0;
    for (int64_t kb = 0; kb < nkb; ++kb) {
      double part = 0;
      for (int64_t k = kb * kblock; k < std::min(K, (kb + 1) * kblock); ++k) {
        part += a_at(a_rows[r], k) * numerics::e4m3fn_to_float(w[w_row(i) * K + k]);
      }
      double s = 1;
      if (scaled && a_scales) s *= sa[a_rows[r] * nkb + kb];
      if (scaled && w_scales) s *= sw[(w_row(i) / bn) * nkb + kb];
      total += part * s;
    }
    return total;
  }
};

void check_tile(Isa isa, TileProblem p, uint32_t seed) {
  p.make(seed);
  const KernelTable& k = kernel_table(isa);
  const GemmTileFn fn = p.a_bf16 ? k.gemm_a_bf16 : k.gemm_a_f32;
  if (fn == nullptr) return;
  std::vector<float> c(static_cast<size_t>(p.R) * p.NT, std::nanf(""));
  std::vector<uint8_t> scratch_raw(gemm_scratch_bytes(p.K) + 64);
  void* scratch = reinterpret_cast<void*>((reinterpret_cast<uintptr_t>(scratch_raw.data()) + 63) &
                                          ~uintptr_t{63});
  fn(p.tile(c.data(), scratch));
  for (int r = 0; r < p.R; ++r) {
    for (int i = 0; i < p.NT; ++i) {
      const double want = p.expected(r, i);
      const float got = c[r * p.NT + i];
      if (p.exact) {
        ASSERT_EQ(got, static_cast<float>(want))
            << isa_name(isa) << " r=" << r << " i=" << i << " K=" << p.K << " R=" << p.R;
      } else {
        // f32 accumulation of exact products: relative error far below 1e-5 of the magnitude sum.
        double mag = 0;
        for (int64_t kk = 0; kk < p.K; ++kk) {
          mag += std::fabs(p.a_at(p.a_rows[r], kk) *
                           numerics::e4m3fn_to_float(p.w[p.w_row(i) * p.K + kk]));
        }
        double smax = 1;
        for (float s : p.sa) smax = std::max<double>(smax, s);
        double wmax = 1;
        for (float s : p.sw) wmax = std::max<double>(wmax, s);
        ASSERT_NEAR(got, want, 1e-5 * mag * smax * wmax + 1e-30)
            << isa_name(isa) << " r=" << r << " i=" << i;
      }
    }
  }
}

TEST_P(CpuKernels, GemmTileExactModeIsBitwise) {  // pitfall 6
  for (int R : {1, 2, 3, 4, 5, 6, 7, 8, 13}) {
    for (bool w_scales : {false, true}) {
      for (bool a_scales : {false, true}) {
        TileProblem p{};
        // A partial last K-block of 96 (K % 64 == 32: a half chunk on the streaming path).
        p.K = 256 + 96;
        p.N = 70;
        p.kblock = 128;
        p.bn = 32;
        p.R = R;
        p.NT = 48;
        p.a_bf16 = true;
        p.a_scales = a_scales;
        p.w_scales = w_scales;
        p.exact = true;
        check_tile(GetParam(), p, 1000 + R);
        p.a_bf16 = false;
        check_tile(GetParam(), p, 2000 + R);
      }
    }
  }
}

TEST_P(CpuKernels, GemmTileStatisticalMode) {
  for (int R : {1, 4, 6, 13}) {
    for (int64_t kblock : {32, 64, 128}) {
      TileProblem p{};
      p.K = 384;
      p.N = 130;
      p.kblock = kblock;
      p.bn = kblock;
      p.R = R;
      p.NT = 80;  // a partial 64-row panel
      p.a_bf16 = true;
      p.a_scales = true;
      p.w_scales = true;
      p.exact = false;
      check_tile(GetParam(), p, 3000 + R + static_cast<uint32_t>(kblock));
      p.a_scales = false;
      p.a_bf16 = false;
      check_tile(GetParam(), p, 4000 + R + static_cast<uint32_t>(kblock));
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Levels, CpuKernels, testing::ValuesIn(levels()), level_name);

}  // namespace
}  // namespace fp8moe::cpu
