// fp8 / e8m0 / bf16 codecs: every code, rounding boundaries, saturation, and agreement with an
// independent implementation (ml_dtypes) on every code and on ~4 million floats.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "common/python_ref.hpp"
#include "fp8moe/numerics.hpp"

namespace fp8moe::numerics {
namespace {

float f32(uint32_t bits) { return std::bit_cast<float>(bits); }
uint32_t bits(float f) { return std::bit_cast<uint32_t>(f); }
constexpr float kInf = std::numeric_limits<float>::infinity();
const float kNaN = std::numeric_limits<float>::quiet_NaN();

// Independent decoder from the format definition (slow, double arithmetic).
double decode_by_definition(uint8_t c, int e_bits, int m_bits, int bias) {
  const int sign = c >> 7;
  const int e = (c >> m_bits) & ((1 << e_bits) - 1);
  const int m = c & ((1 << m_bits) - 1);
  const double frac = static_cast<double>(m) / (1 << m_bits);
  const double v = e == 0 ? std::ldexp(frac, 1 - bias) : std::ldexp(1.0 + frac, e - bias);
  return sign ? -v : v;
}

TEST(NumericsCodecs, E4M3FnDecodesEveryCode) {
  for (int c = 0; c < 256; ++c) {
    const float v = e4m3fn_to_float(static_cast<uint8_t>(c));
    if ((c & 0x7F) == 0x7F) {
      EXPECT_TRUE(std::isnan(v)) << c;
      continue;
    }
    EXPECT_EQ(static_cast<double>(v), decode_by_definition(static_cast<uint8_t>(c), 4, 3, 7)) << c;
    EXPECT_EQ(std::signbit(v), (c & 0x80) != 0) << c;
  }
  EXPECT_EQ(e4m3fn_to_float(0x7E), 448.0f);
  EXPECT_EQ(e4m3fn_to_float(0xFE), -448.0f);
  EXPECT_EQ(e4m3fn_to_float(0x01), 0x1p-9f);  // smallest subnormal
  EXPECT_EQ(e4m3fn_to_float(0x08), 0x1p-6f);  // smallest normal
  EXPECT_EQ(e4m3fn_to_float(0x38), 1.0f);
}

TEST(NumericsCodecs, E4M3FnuzDecodesEveryCode) {
  for (int c = 0; c < 256; ++c) {
    const float v = e4m3fnuz_to_float(static_cast<uint8_t>(c));
    if (c == 0x80) {
      EXPECT_TRUE(std::isnan(v));
      continue;
    }
    EXPECT_EQ(static_cast<double>(v), decode_by_definition(static_cast<uint8_t>(c), 4, 3, 8)) << c;
  }
  EXPECT_EQ(e4m3fnuz_to_float(0x7F), 240.0f);
  EXPECT_EQ(e4m3fnuz_to_float(0x01), 0x1p-10f);
  // The same bits are worth half as much as in e4m3fn: the reason scales double for fnuz.
  for (int c = 1; c < 0x7F; ++c) {
    EXPECT_EQ(e4m3fnuz_to_float(static_cast<uint8_t>(c)) * 2,
              e4m3fn_to_float(static_cast<uint8_t>(c)));
  }
}

TEST(NumericsCodecs, E5M2DecodesEveryCode) {
  for (int c = 0; c < 256; ++c) {
    const float v = e5m2_to_float(static_cast<uint8_t>(c));
    const int low = c & 0x7F;
    if (low == 0x7C) {
      EXPECT_EQ(v, (c & 0x80) ? -kInf : kInf);
    } else if (low > 0x7C) {
      EXPECT_TRUE(std::isnan(v)) << c;
    } else {
      EXPECT_EQ(static_cast<double>(v), decode_by_definition(static_cast<uint8_t>(c), 5, 2, 15))
          << c;
    }
  }
  EXPECT_EQ(e5m2_to_float(0x7B), 57344.0f);
  EXPECT_EQ(e5m2_to_float(0x01), 0x1p-16f);
}

TEST(NumericsCodecs, E8M0DecodesEveryCode) {
  for (int c = 0; c < 255; ++c) {
    EXPECT_EQ(static_cast<double>(e8m0_to_float(static_cast<uint8_t>(c))), std::ldexp(1.0, c - 127))
        << c;
  }
  EXPECT_TRUE(std::isnan(e8m0_to_float(0xFF)));
  EXPECT_EQ(e8m0_to_float(127), 1.0f);
}

TEST(NumericsCodecs, EveryFiniteCodeRoundTrips) {
  for (int c = 0; c < 256; ++c) {
    const auto u = static_cast<uint8_t>(c);
    if ((c & 0x7F) != 0x7F) {
      EXPECT_EQ(float_to_e4m3fn(e4m3fn_to_float(u)), u) << c;
      EXPECT_EQ(float_to_e4m3fn_nonsat(e4m3fn_to_float(u)), u) << c;
    }
    if (c != 0x80) {
      EXPECT_EQ(float_to_e4m3fnuz(e4m3fnuz_to_float(u)), u) << c;
    }
    if ((c & 0x7F) < 0x7C) {
      EXPECT_EQ(float_to_e5m2(e5m2_to_float(u)), u) << c;
      EXPECT_EQ(float_to_e5m2_nonsat(e5m2_to_float(u)), u) << c;
    }
    if (c != 0xFF) {
      EXPECT_EQ(float_to_e8m0(e8m0_to_float(u)), u) << c;
      EXPECT_EQ(e8m0_ceil(e8m0_to_float(u)), u) << c;
    }
  }
}

TEST(NumericsCodecs, E4M3FnRoundsToNearestEven) {
  // Between 1.0 (0x38) and 1.125 (0x39) the midpoint 1.0625 ties to the even code 0x38; between
  // 1.125 and 1.25 (0x3A) the midpoint 1.1875 ties to 0x3A.
  EXPECT_EQ(float_to_e4m3fn(1.0625f), 0x38);
  EXPECT_EQ(float_to_e4m3fn(std::nextafter(1.0625f, 2.0f)), 0x39);
  EXPECT_EQ(float_to_e4m3fn(1.1875f), 0x3A);
  EXPECT_EQ(float_to_e4m3fn(std::nextafter(1.1875f, 0.0f)), 0x39);
  EXPECT_EQ(float_to_e4m3fn(-1.0625f), 0xB8);
  // Subnormals: the quantum is 2^-9; 1.5 quanta tie to 2 quanta, 0.5 quantum ties to zero.
  EXPECT_EQ(float_to_e4m3fn(1.5f * 0x1p-9f), 0x02);
  EXPECT_EQ(float_to_e4m3fn(0.5f * 0x1p-9f), 0x00);
  EXPECT_EQ(float_to_e4m3fn(std::nextafter(0.5f * 0x1p-9f, 1.0f)), 0x01);
  EXPECT_EQ(float_to_e4m3fn(-0.25f * 0x1p-9f), 0x80);  // negative zero keeps its sign
  // The largest subnormal (7 * 2^-9) plus half a quantum rounds up into the smallest normal.
  EXPECT_EQ(float_to_e4m3fn(7.5f * 0x1p-9f), 0x08);
  // The top binade: 416 (0x7D), 448 (0x7E); 432 ties to the even 0x7E... 432 = midpoint.
  EXPECT_EQ(float_to_e4m3fn(432.0f), 0x7E);
  EXPECT_EQ(float_to_e4m3fn(std::nextafter(432.0f, 0.0f)), 0x7D);
  EXPECT_EQ(float_to_e4m3fn(240.0f), 0x77);
  EXPECT_EQ(float_to_e4m3fn(1e-30f), 0x00);
  EXPECT_EQ(float_to_e4m3fn(f32(0x00000001)), 0x00);  // float32 subnormal
}

TEST(NumericsCodecs, E4M3FnSaturatesButKeepsNaN) {
  EXPECT_EQ(float_to_e4m3fn(448.0f), 0x7E);
  EXPECT_EQ(float_to_e4m3fn(460.0f), 0x7E);
  EXPECT_EQ(float_to_e4m3fn(464.0f), 0x7E);
  EXPECT_EQ(float_to_e4m3fn(1e30f), 0x7E);
  EXPECT_EQ(float_to_e4m3fn(kInf), 0x7E);
  EXPECT_EQ(float_to_e4m3fn(-kInf), 0xFE);
  EXPECT_EQ(float_to_e4m3fn(kNaN), 0x7F);
  EXPECT_EQ(float_to_e4m3fn(-kNaN), 0xFF);
  // The plain cast: up to the 448/480 midpoint (a tie, which goes to the even code 0x7E) rounds
  // to 448; anything above it would need the NaN code 0x7F.
  EXPECT_EQ(float_to_e4m3fn_nonsat(460.0f), 0x7E);
  EXPECT_EQ(float_to_e4m3fn_nonsat(464.0f), 0x7E);
  EXPECT_EQ(float_to_e4m3fn_nonsat(std::nextafter(464.0f, 1e9f)), 0x7F);
  EXPECT_EQ(float_to_e4m3fn_nonsat(-1e9f), 0xFF);
  EXPECT_EQ(float_to_e4m3fn_nonsat(kInf), 0x7F);
}

TEST(NumericsCodecs, E4M3FnuzHasNoNegativeZeroAndOneNaN) {
  EXPECT_EQ(float_to_e4m3fnuz(-0.0f), 0x00);
  EXPECT_EQ(float_to_e4m3fnuz(-1e-30f), 0x00);
  EXPECT_EQ(float_to_e4m3fnuz(kNaN), 0x80);
  EXPECT_EQ(float_to_e4m3fnuz(-kNaN), 0x80);
  EXPECT_EQ(float_to_e4m3fnuz(1e9f), 0x7F);
  EXPECT_EQ(float_to_e4m3fnuz(-kInf), 0xFF);
  EXPECT_EQ(float_to_e4m3fnuz(-240.0f), 0xFF);
  EXPECT_EQ(float_to_e4m3fnuz_nonsat(248.0f), 0x80);
  EXPECT_EQ(float_to_e4m3fnuz_nonsat(-kInf), 0x80);
  EXPECT_EQ(float_to_e4m3fnuz(1.0f), 0x40);
}

TEST(NumericsCodecs, E5M2SaturatesOrOverflowsToInf) {
  EXPECT_EQ(float_to_e5m2(kInf), 0x7B);
  EXPECT_EQ(float_to_e5m2(-1e9f), 0xFB);
  EXPECT_EQ(float_to_e5m2_nonsat(kInf), 0x7C);
  EXPECT_EQ(float_to_e5m2_nonsat(61440.0f), 0x7C);  // midpoint 57344/65536 ties up to "even" inf
  EXPECT_EQ(float_to_e5m2_nonsat(std::nextafter(61440.0f, 0.0f)), 0x7B);
  EXPECT_EQ(float_to_e5m2(kNaN), 0x7E);
  EXPECT_EQ(float_to_e5m2(1.0f), 0x3C);
}

TEST(NumericsCodecs, E8M0CeilAndPow2) {
  EXPECT_EQ(e8m0_ceil(1.0f), 127);
  EXPECT_EQ(e8m0_ceil(std::nextafter(1.0f, 2.0f)), 128);
  EXPECT_EQ(e8m0_ceil(0.75f), 127);
  EXPECT_EQ(e8m0_ceil(0.5f), 126);
  EXPECT_EQ(e8m0_ceil(1e-45f), 0);
  EXPECT_EQ(e8m0_ceil(3e38f), 254);
  EXPECT_EQ(e8m0_ceil(0.0f), 0xFF);
  EXPECT_EQ(e8m0_ceil(-1.0f), 0xFF);
  EXPECT_EQ(e8m0_ceil(kNaN), 0xFF);
  EXPECT_EQ(ceil_pow2(1.0f), 1.0f);
  EXPECT_EQ(ceil_pow2(1.0000001f), 2.0f);
  EXPECT_EQ(ceil_pow2(3.0f / 448.0f), 1.0f / 128.0f);
  EXPECT_EQ(ceil_pow2(1e-10f), 0x1p-33f);
  for (int e = -126; e < 127; ++e) {
    const float p = std::ldexp(1.0f, e);
    EXPECT_EQ(ceil_pow2(p), p);
    EXPECT_EQ(ceil_pow2(std::nextafter(p, kInf)), 2 * p);
    EXPECT_EQ(ceil_pow2(std::nextafter(p, 0.0f)), p);
  }
}

TEST(NumericsCodecs, Bf16RoundsToNearestEven) {
  EXPECT_EQ(float_to_bf16(1.0f), 0x3F80);
  EXPECT_EQ(float_to_bf16(f32(0x3F808000)), 0x3F80);  // tie to even (down)
  EXPECT_EQ(float_to_bf16(f32(0x3F818000)), 0x3F82);  // tie to even (up)
  EXPECT_EQ(float_to_bf16(f32(0x3F808001)), 0x3F81);
  EXPECT_EQ(float_to_bf16(f32(0x7F7FFFFF)), 0x7F80);  // rounds to inf
  EXPECT_EQ(float_to_bf16(-kInf), 0xFF80);
  EXPECT_TRUE(std::isnan(bf16_round(kNaN)));
  EXPECT_TRUE(std::isnan(bf16_round(f32(0x7F800001))));  // a NaN whose payload sits in low bits
  EXPECT_EQ(bf16_round(3.14159265358979), 3.140625f);
  EXPECT_EQ(bits(bf16_round(-0.0f)), 0x80000000u);
}

// ---- agreement with ml_dtypes
// -----------------------------------------------------------------------

struct MlRef {
  fp8moe::testing::ScratchDir scratch{"ml_dtypes_codecs"};
  std::filesystem::path dir = scratch.path();
  std::vector<float> x;
};

// Generated once per process by tests/py/ml_dtypes_reference.py.
const MlRef& ml_reference() {
  static MlRef ref;
  static const bool ready = [] {
    std::string log;
    std::string args = "'";
    args += ref.dir.string();
    args += "'";
    const int rc = fp8moe::testing::run_python("tests/py/ml_dtypes_reference.py", args, &log);
    EXPECT_EQ(rc, 0) << "the ml_dtypes reference script failed:\n" << log;
    ref.x = fp8moe::testing::read_raw<float>(ref.dir / "inputs.f32");
    return true;
  }();
  (void)ready;
  return ref;
}

template <class Encode>
void expect_codes_match(const std::string& file, Encode encode) {
  const MlRef& ref = ml_reference();
  ASSERT_GT(ref.x.size(), 4000000u) << "no reference inputs";
  const auto want = fp8moe::testing::read_raw<uint8_t>(ref.dir / file);
  ASSERT_EQ(want.size(), ref.x.size()) << file;
  std::size_t mismatches = 0;
  for (std::size_t i = 0; i < ref.x.size(); ++i) {
    const uint8_t got = encode(ref.x[i]);
    if (got != want[i]) {
      if (++mismatches <= 5) {
        ADD_FAILURE() << file << ": input " << ref.x[i] << " (bits 0x" << std::hex << bits(ref.x[i])
                      << ") gives 0x" << int(got) << ", ml_dtypes 0x" << int(want[i]) << std::dec;
      }
    }
  }
  EXPECT_EQ(mismatches, 0u) << file << " over " << ref.x.size() << " inputs";
}

// One test, so the ~4 million reference values are generated once per process.
TEST(NumericsCodecsVsMlDtypes, EveryFormatOnMillionsOfFloats) {
  {
    SCOPED_TRACE("e4m3fn");
    expect_codes_match("e4m3fn.nonsat.u8", float_to_e4m3fn_nonsat);
    expect_codes_match("e4m3fn.sat.u8", [](float f) { return float_to_e4m3fn(f); });
  }
  {
    SCOPED_TRACE("e4m3fnuz");
    expect_codes_match("e4m3fnuz.nonsat.u8", float_to_e4m3fnuz_nonsat);
    expect_codes_match("e4m3fnuz.sat.u8", float_to_e4m3fnuz);
  }
  {
    SCOPED_TRACE("e5m2");
    expect_codes_match("e5m2.nonsat.u8", float_to_e5m2_nonsat);
    expect_codes_match("e5m2.sat.u8", float_to_e5m2);
  }
  {
    SCOPED_TRACE("e8m0");
    expect_codes_match("e8m0.u8", float_to_e8m0);
  }
  SCOPED_TRACE("bf16");
  const MlRef& ref = ml_reference();
  const auto want = fp8moe::testing::read_raw<uint16_t>(ref.dir / "bf16.u16");
  ASSERT_EQ(want.size(), ref.x.size());
  std::size_t mismatches = 0;
  for (std::size_t i = 0; i < ref.x.size(); ++i) {
    const uint16_t got = float_to_bf16(ref.x[i]);
    // NaN payloads are not part of the contract: a NaN must stay a NaN.
    const bool ok = std::isnan(ref.x[i])
                        ? std::isnan(bf16_to_float(got)) && std::isnan(bf16_to_float(want[i]))
                        : got == want[i];
    if (!ok && ++mismatches <= 5) {
      ADD_FAILURE() << "bf16: input bits 0x" << std::hex << bits(ref.x[i]) << " gives 0x" << got
                    << ", ml_dtypes 0x" << want[i] << std::dec;
    }
  }
  EXPECT_EQ(mismatches, 0u);
  SCOPED_TRACE("decode tables");
  const struct {
    const char* file;
    float (*decode)(uint8_t);
  } formats[] = {{"decode.e4m3fn.f32", e4m3fn_to_float},
                 {"decode.e4m3fnuz.f32", e4m3fnuz_to_float},
                 {"decode.e5m2.f32", e5m2_to_float},
                 {"decode.e8m0.f32", e8m0_to_float}};
  for (const auto& f : formats) {
    const auto table = fp8moe::testing::read_raw<float>(ref.dir / f.file);
    ASSERT_EQ(table.size(), 256u) << f.file;
    for (int c = 0; c < 256; ++c) {
      const float got = f.decode(static_cast<uint8_t>(c));
      if (std::isnan(table[c])) {
        EXPECT_TRUE(std::isnan(got)) << f.file << " code " << c;
      } else {
        EXPECT_EQ(bits(got), bits(table[c])) << f.file << " code " << c;
      }
    }
  }
}

}  // namespace
}  // namespace fp8moe::numerics
