// FP8 quantisers: round trips, scale rules, and the documented results for the edge cases
// (all-zero groups, huge values, NaN and inf inputs, bad arguments).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "common/python_ref.hpp"
#include "fp8moe/error.hpp"
#include "fp8moe/numerics.hpp"
#include "numerics/quant.hpp"

namespace fp8moe::numerics {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();
const float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr DType kFn = DType::kF8E4M3FN;
constexpr DType kFnuz = DType::kF8E4M3FNUZ;

std::vector<float> randn(std::size_t n, float sigma, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, sigma);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

// |decode(q) * s - x| must be at most half an e4m3 ulp of the scaled value (or half the subnormal
// quantum), i.e. the quantiser rounded to the nearest grid point.
void expect_nearest(float x, uint8_t q, float s, DType fp8 = kFn) {
  const double scaled = static_cast<double>(x) / s;
  const double got = fp8_to_float(fp8, q);
  const double min_normal = fp8 == kFnuz ? 0x1p-7 : 0x1p-6;
  const double ulp =
      std::fabs(scaled) < min_normal ? min_normal / 8 : std::ldexp(1.0, std::ilogb(scaled) - 3);
  EXPECT_LE(std::fabs(got - scaled), ulp / 2 + 1e-12) << "x=" << x << " s=" << s;
}

TEST(NumericsQuant, GroupScaleIsAmaxOver448) {
  for (int64_t group : {32, 64, 128}) {
    const auto x = randn(static_cast<std::size_t>(group), 0.1f, static_cast<uint32_t>(group));
    std::vector<uint8_t> q(x.size());
    const float s = quantize_group_fp8(x.data(), group, q.data(), kFn);
    float amax = 0.0f;
    for (float v : x) amax = std::max(amax, std::fabs(v));
    EXPECT_EQ(s, amax / 448.0f);
    bool has_max = false;
    for (std::size_t i = 0; i < x.size(); ++i) {
      expect_nearest(x[i], q[i], s);
      has_max |= (q[i] & 0x7F) == 0x7E;
    }
    EXPECT_TRUE(has_max) << "the largest element maps to +-448";
  }
}

TEST(NumericsQuant, GroupUe8m0ScaleIsPowerOfTwoRoundedUp) {  // pitfall 12
  const auto x = randn(128, 3.0f, 7);
  std::vector<uint8_t> q(x.size());
  const float s = quantize_group_fp8(x.data(), 128, q.data(), kFn, /*ue8m0=*/true);
  float amax = 0.0f;
  for (float v : x) amax = std::max(amax, std::fabs(v));
  int e = 0;
  EXPECT_EQ(std::frexp(s, &e), 0.5f) << "power of two";
  EXPECT_GE(s, amax / 448.0f);
  EXPECT_LT(s / 2, amax / 448.0f);
  for (std::size_t i = 0; i < x.size(); ++i) expect_nearest(x[i], q[i], s);
}

TEST(NumericsQuant, GroupEdgeCases) {
  std::vector<uint8_t> q(4);
  // All zero: amax is floored at eps = 1e-10, codes are zero.
  const std::vector<float> zero(4, 0.0f);
  EXPECT_EQ(quantize_group_fp8(zero.data(), 4, q.data(), kFn), 1e-10f / 448.0f);
  for (uint8_t c : q) EXPECT_EQ(c, 0x00);
  // UE8M0 of an all-zero group: the kernel floors the scale at 1e-10 before rounding up: 2^-33.
  EXPECT_EQ(quantize_group_fp8(zero.data(), 4, q.data(), kFn, true), 0x1p-33f);
  // Huge values: the scale follows, the extremes hit +-448.
  const std::vector<float> huge = {1e30f, -1e30f, 5e29f, 0.0f};
  const float s = quantize_group_fp8(huge.data(), 4, q.data(), kFn);
  EXPECT_EQ(s, 1e30f / 448.0f);
  EXPECT_EQ(q[0], 0x7E);
  EXPECT_EQ(q[1], 0xFE);
  EXPECT_EQ(q[3], 0x00);
  // NaN: ignored by the amax (fmaxf), quantised to -448 (fminf(fmaxf(NaN, -448), 448)).
  const std::vector<float> with_nan = {1.0f, kNaN, -2.0f, 0.5f};
  EXPECT_EQ(quantize_group_fp8(with_nan.data(), 4, q.data(), kFn), 2.0f / 448.0f);
  EXPECT_EQ(q[1], 0xFE);
  EXPECT_EQ(q[2], 0xFE);
  EXPECT_EQ(e4m3fn_to_float(q[0]), 224.0f);
  // inf: the scale becomes inf, finite values quantise to 0 and the inf itself (inf/inf = NaN)
  // to -448.
  const std::vector<float> with_inf = {1.0f, kInf, -2.0f, 0.5f};
  EXPECT_EQ(quantize_group_fp8(with_inf.data(), 4, q.data(), kFn), kInf);
  EXPECT_EQ(q[0], 0x00);
  EXPECT_EQ(q[1], 0xFE);
  EXPECT_EQ(q[2], 0x80);
}

TEST(NumericsQuant, FusedSiluQuantScaleFloor) {
  // The snapshot's silu_and_mul_per_block_quant floors the scale at 1/(448*512).
  const std::vector<float> tiny = {1e-9f, -1e-9f};
  std::vector<uint8_t> q(2);
  const float s = quantize_group_fp8(tiny.data(), 2, q.data(), kFn, false, min_scaling_factor(kFn));
  EXPECT_EQ(s, 1.0f / (448.0f * 512.0f));
  EXPECT_EQ(q[0], float_to_e4m3fn(1e-9f / s));
}

TEST(NumericsQuant, PerTokenFloorAndNaN) {
  std::vector<uint8_t> q(3);
  const std::vector<float> zero(3, 0.0f);
  EXPECT_EQ(quantize_row_per_token_fp8(zero.data(), 3, q.data(), kFn), 1.0f / (448.0f * 512.0f));
  for (uint8_t c : q) EXPECT_EQ(c, 0x00);
  const std::vector<float> row = {3.0f, kNaN, -1.5f};
  const float s = quantize_row_per_token_fp8(row.data(), 3, q.data(), kFn);
  EXPECT_EQ(s, 3.0f / 448.0f);
  EXPECT_EQ(q[0], 0x7E);
  EXPECT_EQ(q[1], 0x7E) << "scaled_fp8_conversion clamps NaN to +448";
  EXPECT_EQ(e4m3fn_to_float(q[2]), -224.0f);
  const auto x = randn(300, 0.05f, 11);
  std::vector<uint8_t> qx(x.size());
  const float sx = quantize_row_per_token_fp8(x.data(), 300, qx.data(), kFn);
  for (std::size_t i = 0; i < x.size(); ++i) expect_nearest(x[i], qx[i], sx);
}

TEST(NumericsQuant, PerTensorUsesTheReciprocal) {
  // q = fp8(x * (1/s)): with s = 3, 1/s rounds in fp32, which can differ from x / s.
  const float s = 3.0f;
  std::vector<float> x(1000);
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(i) * 0.37f - 180.0f;
  std::vector<uint8_t> q(x.size());
  quantize_per_tensor_fp8(x.data(), static_cast<int64_t>(x.size()), s, q.data(), kFn);
  for (std::size_t i = 0; i < x.size(); ++i) {
    EXPECT_EQ(q[i], float_to_e4m3fn(x[i] * (1.0f / s))) << i;
  }
  // An all-zero dynamic tensor: scale 0, 0 * inf = NaN clamps to +448; the values dequantise to 0.
  const Tensor z = Tensor::zeros({2, 4}, DType::kF32);
  const QuantizedTensor qt = per_tensor_quant_fp8(z, kFn);
  EXPECT_EQ(qt.scale.ptr<float>()[0], 0.0f);
  EXPECT_EQ(qt.q.ptr<uint8_t>()[0], 0x7E);
  const Tensor deq = dequantize_rows(qt.q, qt.scale);
  for (int64_t i = 0; i < deq.numel(); ++i) EXPECT_EQ(deq.ptr<double>()[i], 0.0);
  EXPECT_THROW(per_tensor_quant_fp8(z, kFn, -1.0f), ValueError);
  EXPECT_THROW(per_tensor_quant_fp8(z, kFn, kNaN), ValueError);
}

TEST(NumericsQuant, MxScaleRoundsUp) {
  std::vector<float> x(32, 0.0f);
  std::vector<uint8_t> q(32);
  x[3] = 448.0f;
  EXPECT_EQ(quantize_mx_group(x.data(), 32, q.data()), 127);  // scale 1, nothing saturates
  EXPECT_EQ(q[3], 0x7E);
  x[3] = 449.0f;
  EXPECT_EQ(quantize_mx_group(x.data(), 32, q.data()), 128);  // scale 2
  EXPECT_EQ(e4m3fn_to_float(q[3]), 224.0f);                   // 224.5 rounds to 224
  x[3] = 1.0f;
  EXPECT_EQ(quantize_mx_group(x.data(), 32, q.data()), 127 - 8);  // 1/448 -> 2^-8
  EXPECT_EQ(e4m3fn_to_float(q[3]), 256.0f);
  std::fill(x.begin(), x.end(), 0.0f);
  EXPECT_EQ(quantize_mx_group(x.data(), 32, q.data()), 0);  // 2^-127
  for (uint8_t c : q) EXPECT_EQ(c, 0x00);
  x[0] = 1e38f;
  EXPECT_EQ(quantize_mx_group(x.data(), 32, q.data()), 127 + 118);  // 1e38/448 ~ 2^117.4
  // Random data: every element at the nearest grid point of its group's scale.
  const auto r = randn(32 * 8, 2.0f, 5);
  for (int g = 0; g < 8; ++g) {
    const uint8_t code = quantize_mx_group(r.data() + g * 32, 32, q.data());
    for (int i = 0; i < 32; ++i) expect_nearest(r[g * 32 + i], q[i], e8m0_to_float(code));
  }
}

TEST(NumericsQuant, PerBlockCastToFp8) {
  // (E, R, C) = (2, 130, 200) with 128x128 blocks: partial blocks are zero padded.
  const auto v = randn(2 * 130 * 200, 1.0f / 15, 3);
  Tensor w = Tensor::empty({2, 130, 200}, DType::kF32);
  std::copy(v.begin(), v.end(), w.ptr<float>());
  const QuantizedTensor qt = per_block_cast_to_fp8(w, 128, 128);
  ASSERT_EQ(qt.scale.sizes(), (std::vector<int64_t>{2, 2, 2}));
  for (int64_t e = 0; e < 2; ++e) {
    for (int64_t bi = 0; bi < 2; ++bi) {
      for (int64_t bj = 0; bj < 2; ++bj) {
        float amax = 0.0f;
        for (int64_t r = bi * 128; r < std::min<int64_t>(130, bi * 128 + 128); ++r) {
          for (int64_t c = bj * 128; c < std::min<int64_t>(200, bj * 128 + 128); ++c) {
            amax = std::max(amax, std::fabs(v[(e * 130 + r) * 200 + c]));
          }
        }
        EXPECT_EQ(qt.scale.ptr<float>()[(e * 2 + bi) * 2 + bj], amax / 448.0f);
      }
    }
  }
  const Tensor deq = dequantize_block(qt.q, qt.scale, 128, 128);
  for (std::size_t i = 0; i < v.size(); ++i) {
    EXPECT_NEAR(deq.ptr<double>()[i], v[i], std::fabs(v[i]) / 16 + 1e-6);
  }
  // An all-zero block: amax floored at 1e-4.
  const Tensor z = Tensor::zeros({4, 4}, DType::kF32);
  const QuantizedTensor qz = per_block_cast_to_fp8(z, 128, 128);
  EXPECT_EQ(qz.scale.ptr<float>()[0], 1e-4f / 448.0f);
  EXPECT_EQ(qz.q.ptr<uint8_t>()[0], 0);
  // UE8M0 weight scales are powers of two rounded up.
  const QuantizedTensor qu = per_block_cast_to_fp8(w, 64, 64, kFn, true);
  for (int64_t i = 0; i < qu.scale.numel(); ++i) {
    int ex = 0;
    EXPECT_EQ(std::frexp(qu.scale.ptr<float>()[i], &ex), 0.5f);
  }
  EXPECT_THROW(per_block_cast_to_fp8(w, 0, 128), ValueError);
}

TEST(NumericsQuant, PerTensorAndPerChannelWeights) {
  const auto v = randn(3 * 8 * 16, 0.1f, 9);
  Tensor w = Tensor::empty({3, 8, 16}, DType::kF32);
  std::copy(v.begin(), v.end(), w.ptr<float>());
  const QuantizedTensor pt = per_tensor_cast_to_fp8(w);
  ASSERT_EQ(pt.scale.sizes(), (std::vector<int64_t>{3}));
  const QuantizedTensor pc = per_channel_cast_to_fp8(w);
  ASSERT_EQ(pc.scale.sizes(), (std::vector<int64_t>{3, 8}));
  const Tensor dt = dequantize_rows(pt.q, pt.scale);
  const Tensor dc = dequantize_rows(pc.q, pc.scale);
  for (std::size_t i = 0; i < v.size(); ++i) {
    EXPECT_NEAR(dt.ptr<double>()[i], v[i], pt.scale.ptr<float>()[i / 128] * 16);
    expect_nearest(v[i], pc.q.ptr<uint8_t>()[i], pc.scale.ptr<float>()[i / 16]);
  }
}

TEST(NumericsQuant, TensorLevelActivationQuantisers) {
  const auto v = randn(4 * 256, 1.0f, 1);
  Tensor x = Tensor::empty({4, 256}, DType::kF32);
  std::copy(v.begin(), v.end(), x.ptr<float>());
  for (int64_t g : {32, 64, 128}) {
    const QuantizedTensor qt = per_token_group_quant_fp8(x, g, kFn);
    ASSERT_EQ(qt.scale.sizes(), (std::vector<int64_t>{4, 256 / g}));
    for (std::size_t i = 0; i < v.size(); ++i) {
      expect_nearest(v[i], qt.q.ptr<uint8_t>()[i], qt.scale.ptr<float>()[i / g]);
    }
  }
  try {
    per_token_group_quant_fp8(x, 96, kFn);
    FAIL() << "group 96 does not divide 256";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("(4, 256)"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("96"), std::string::npos) << e.what();
  }
  const QuantizedTensor mx = mx_cast_to_fp8(x);
  ASSERT_EQ(mx.scale.sizes(), (std::vector<int64_t>{4, 8}));
  EXPECT_EQ(mx.scale.dtype(), DType::kU8);
  Tensor odd = Tensor::zeros({2, 48}, DType::kF32);
  EXPECT_THROW(mx_cast_to_fp8(odd), ValueError);
  const QuantizedTensor pt = per_token_quant_fp8(x, kFn);
  ASSERT_EQ(pt.scale.sizes(), (std::vector<int64_t>{4}));
}

TEST(NumericsQuant, FnuzUses224AndNormalisationKeepsValues) {  // pitfall 14
  EXPECT_EQ(quant_fp8_max(kFnuz), 224.0f);
  const auto x = randn(64, 1.0f, 2);
  std::vector<uint8_t> q(64);
  const float s = quantize_group_fp8(x.data(), 64, q.data(), kFnuz);
  float amax = 0.0f;
  for (float v : x) amax = std::max(amax, std::fabs(v));
  EXPECT_EQ(s, amax / 224.0f);
  for (int i = 0; i < 64; ++i) expect_nearest(x[i], q[i], s, kFnuz);

  Tensor w = Tensor::empty({8, 32}, DType::kF32);
  const auto wv = randn(8 * 32, 0.1f, 4);
  std::copy(wv.begin(), wv.end(), w.ptr<float>());
  w.ptr<float>()[5] = -0.0f;  // encodes as 0x80 in e4m3fn
  const QuantizedTensor fn = per_block_cast_to_fp8(w, 128, 128);
  EXPECT_EQ(fn.q.ptr<uint8_t>()[5], 0x80);
  const QuantizedTensor uz = normalize_e4m3fn_to_e4m3fnuz(fn);
  EXPECT_EQ(uz.q.ptr<uint8_t>()[5], 0x00);
  const Tensor a = dequantize_block(fn.q, fn.scale, 128, 128);
  const Tensor b = dequantize_block(uz.q, uz.scale, 128, 128);
  for (int64_t i = 0; i < a.numel(); ++i) EXPECT_EQ(a.ptr<double>()[i], b.ptr<double>()[i]);
}

TEST(NumericsQuant, Bf16InputsAreRead) {
  Tensor x = Tensor::empty({1, 32}, DType::kBF16);
  for (int i = 0; i < 32; ++i) x.ptr<uint16_t>()[i] = float_to_bf16(static_cast<float>(i) - 16.0f);
  const QuantizedTensor qt = per_token_group_quant_fp8(x, 32, kFn);
  EXPECT_EQ(qt.scale.ptr<float>()[0], 16.0f / 448.0f);
  EXPECT_EQ(qt.q.ptr<uint8_t>()[0], 0xFE);
}

// Every quantiser against an independent numpy + ml_dtypes implementation of vLLM's formulas
// (tests/py/quant_reference.py), bit for bit, on rows spanning many magnitudes and the edge cases
// (all-zero rows and groups, amax exactly 448 * 2^k and one float ulp above it, huge, tiny).
TEST(NumericsQuant, AgreesWithNumpyAndMlDtypes) {
  const int64_t R = 24, C = 256;
  std::mt19937 rng(77);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::uniform_int_distribution<int> ex(-20, 20);
  Tensor x = Tensor::empty({R, C}, DType::kF32);
  float* v = x.ptr<float>();
  for (int64_t r = 0; r < R; ++r) {
    const float scale = std::ldexp(1.0f, ex(rng));
    for (int64_t c = 0; c < C; ++c) v[r * C + c] = nd(rng) * scale;
  }
  std::fill(v + 3 * C, v + 4 * C, 0.0f);            // an all-zero row
  std::fill(v + 4 * C + 32, v + 4 * C + 96, 0.0f);  // zero groups in a row
  for (int64_t c = 0; c < C; c += 32) {
    v[5 * C + c] = 448.0f * 0x1p-3f;                        // amax 448 * 2^k
    v[6 * C + c] = std::nextafter(448.0f * 0x1p-3f, 1e9f);  // one ulp above
    v[7 * C + c] = -1e30f;                                  // huge
  }
  for (int64_t c = 0; c < C; ++c) v[8 * C + c] = 1e-30f * static_cast<float>(c % 7 - 3);  // tiny
  // Rows of e4m3 midpoints times a non-power-of-two scale: x / s lands on (or within an ulp of) a
  // tie, where x / s and x * (1/s) and the tie-breaking rule all matter.
  for (int64_t r = 9; r < 16; ++r) {
    const float sc = 1.0f + 0.1f * static_cast<float>(r - 8);
    for (int64_t c = 0; c < C; ++c) {
      const uint8_t code = static_cast<uint8_t>((c * 37 + r) % 0x7E);
      const float lo = e4m3fn_to_float(code), hi = e4m3fn_to_float(static_cast<uint8_t>(code + 1));
      v[r * C + c] = (c % 32 == 0) ? 448.0f * sc : 0.5f * (lo + hi) * sc;
    }
  }
  testing::ScratchDir dir("quant_vs_numpy");
  ASSERT_TRUE(testing::write_raw(dir.path() / "x.f32", std::vector<float>(v, v + R * C)));
  std::string log;
  std::string args = "'";
  args += dir.path().string();
  args += "' 24 256";
  ASSERT_EQ(testing::run_python("tests/py/quant_reference.py", args, &log), 0) << log;

  const auto check = [&](const std::string& name, const QuantizedTensor& qt) {
    const auto want_q = testing::read_raw<uint8_t>(dir.path() / (name + ".q"));
    const auto want_s = testing::read_raw<uint8_t>(dir.path() / (name + ".s"));
    ASSERT_EQ(want_q.size(), static_cast<std::size_t>(qt.q.nbytes())) << name;
    ASSERT_EQ(want_s.size(), static_cast<std::size_t>(qt.scale.nbytes())) << name;
    int bad = 0;
    for (std::size_t i = 0; i < want_q.size() && bad < 5; ++i) {
      if (qt.q.ptr<uint8_t>()[i] != want_q[i]) {
        ++bad;
        ADD_FAILURE() << name << ": code " << i << " (x = " << v[i] << ") is 0x" << std::hex
                      << int(qt.q.ptr<uint8_t>()[i]) << ", numpy 0x" << int(want_q[i]);
      }
    }
    EXPECT_EQ(std::memcmp(qt.scale.data(), want_s.data(), want_s.size()), 0) << name << " scales";
  };
  for (int64_t g : {32, 64, 128}) {
    check("group" + std::to_string(g), per_token_group_quant_fp8(x, g, kFn));
    check("group" + std::to_string(g) + "_ue8m0", per_token_group_quant_fp8(x, g, kFn, true));
  }
  check("token", per_token_quant_fp8(x, kFn));
  check("tensor", per_tensor_quant_fp8(x, kFn));
  check("mx", mx_cast_to_fp8(x));
  check("block64", per_block_cast_to_fp8(x, 64, 64));
  check("fnuz_group128", per_token_group_quant_fp8(x, 128, kFnuz));
}

}  // namespace
}  // namespace fp8moe::numerics
