// MoE activations against closed forms, with vLLM's rounding points and oddities.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "fp8moe/error.hpp"
#include "fp8moe/numerics.hpp"
#include "numerics/activation.hpp"

namespace fp8moe::numerics {
namespace {

std::vector<float> act(const ActivationConfig& c, const std::vector<float>& y, int64_t I,
                       bool bf16 = true) {
  std::vector<float> h(static_cast<std::size_t>(I));
  apply_activation_row<double>(c, y.data(), I, bf16, h.data());
  return h;
}

ActivationConfig cfg(MoeActivation a) {
  ActivationConfig c;
  c.activation = a;
  return c;
}

float R(double v) { return bf16_round(static_cast<float>(v)); }

TEST(NumericsActivation, ScalarClosedForms) {
  EXPECT_NEAR(silu<double>(2.0), 1.7615941559557646, 1e-15);
  EXPECT_NEAR(gelu_erf<double>(1.0), 0.8413447460685429, 1e-15);
  EXPECT_NEAR(gelu_tanh<double>(1.0), 0.8411919906082768, 1e-15);
  EXPECT_EQ(relu2<double>(-3.0), 0.0);
  EXPECT_EQ(relu2<double>(3.0), 9.0);
  EXPECT_NEAR(sigmoid<double>(0.0), 0.5, 0);
  EXPECT_NEAR(silu<float>(2.0f), 1.7615942f, 1e-6f);
}

TEST(NumericsActivation, SiluRoundsTwice) {  // pitfall 36
  // h = bf16(bf16(silu(g)) * u); gate first half, up second half.
  const std::vector<float> y = {2.0f, -1.0f, 3.0f, 0.5f};
  const auto h = act(cfg(MoeActivation::kSilu), y, 2);
  EXPECT_EQ(h[0], R(R(1.7615941559557646) * 3.0));
  EXPECT_EQ(h[1], R(R(-1.0 / (1.0 + std::exp(1.0))) * 0.5));
  // There are (gate, up) pairs where the double rounding differs from one rounding; the
  // reference must take vLLM's two.
  int differ = 0;
  for (int gi = 1; gi < 400 && differ == 0; ++gi) {
    const float g = bf16_round(0.013f * static_cast<float>(gi));
    for (int ui = 1; ui < 200; ++ui) {
      const float u = bf16_round(1.0f + 0.0079f * static_cast<float>(ui));
      const float two = act(cfg(MoeActivation::kSilu), {g, u}, 1)[0];
      const float one = R(silu<double>(g) * u);
      if (two != one) {
        ++differ;
        EXPECT_EQ(two, R(R(silu<double>(g)) * u));
        break;
      }
    }
  }
  EXPECT_GT(differ, 0) << "no case distinguishes the rounding points";
  // f32 compute: no bf16 rounding at all.
  const auto f = act(cfg(MoeActivation::kSilu), {2.0f, 3.0f}, 1, /*bf16=*/false);
  EXPECT_EQ(f[0], static_cast<float>(static_cast<float>(1.7615941559557646) * 3.0));
}

TEST(NumericsActivation, SiluWithClampIgnoresAlphaBeta) {  // pitfall 17
  ActivationConfig c = cfg(MoeActivation::kSilu);
  c.clamp_limit = 1.5;
  c.alpha = 3.0;  // unused by swiglu_limit_func
  c.beta = 9.0;
  const auto h = act(c, {4.0f, -0.5f, 2.0f, -7.0f}, 2);
  EXPECT_EQ(h[0], R(silu<double>(1.5) * 1.5));    // gate and up clamped
  EXPECT_EQ(h[1], R(silu<double>(-0.5) * -1.5));  // up clamped from below
  c.clamp_limit = 0.0;                            // limit <= 0: no clamp, plain silu
  EXPECT_EQ(act(c, {4.0f, 2.0f}, 1)[0], act(cfg(MoeActivation::kSilu), {4.0f, 2.0f}, 1)[0]);
}

TEST(NumericsActivation, GeluForms) {
  const auto g = act(cfg(MoeActivation::kGelu), {1.0f, 2.0f}, 1);
  EXPECT_EQ(g[0], R(R(0.8413447460685429) * 2.0));
  const auto t = act(cfg(MoeActivation::kGeluTanh), {1.0f, 2.0f}, 1);
  EXPECT_EQ(t[0], R(R(0.8411919906082768) * 2.0));
  EXPECT_EQ(act(cfg(MoeActivation::kGeluNoMul), {1.0f}, 1)[0], R(0.8413447460685429));
  EXPECT_EQ(act(cfg(MoeActivation::kGeluTanhNoMul), {1.0f}, 1)[0], R(0.8411919906082768));
  EXPECT_EQ(act(cfg(MoeActivation::kSiluNoMul), {2.0f}, 1)[0], R(1.7615941559557646));
  EXPECT_EQ(act(cfg(MoeActivation::kRelu2NoMul), {-2.0f, 1.5f}, 2),
            (std::vector<float>{0.0f, 2.25f}));
}

TEST(NumericsActivation, SwigluOaiIsInterleavedAndIgnoresTheConfig) {
  ActivationConfig c = cfg(MoeActivation::kSwigluOai);
  c.alpha = 1.0;  // vLLM oddity: swigluoai_and_mul uses 1.702 and 7.0 whatever is configured
  c.clamp_limit = 3.0;
  // y = [g0, u0, g1, u1]
  const auto h = act(c, {8.0f, 10.0f, 1.0f, -0.5f}, 2);
  const auto oai = [](double g, double u) {
    g = std::min(g, 7.0);
    u = std::max(-7.0, std::min(u, 7.0));
    return (u + 1) * g / (1 + std::exp(-1.702 * g));
  };
  EXPECT_EQ(h[0], R(oai(8, 10)));
  EXPECT_EQ(h[1], R(oai(1, -0.5)));
}

TEST(NumericsActivation, SwigluOaiUninterleaveUsesTheConfig) {
  ActivationConfig c = cfg(MoeActivation::kSwigluOaiUninterleave);
  EXPECT_THROW(act(c, {1, 2}, 1), ValueError);  // needs clamp_limit
  c.clamp_limit = 7.0;
  c.alpha = 1.702;
  c.beta = 1.0;
  const auto h = act(c, {8.0f, 1.0f, 10.0f, -0.5f}, 2);  // packed: gates then ups
  EXPECT_EQ(h[0], R(7 / (1 + std::exp(-1.702 * 7)) * (7 + 1.0)));
  EXPECT_EQ(h[1], R(1 / (1 + std::exp(-1.702)) * (-0.5 + 1.0)));
}

TEST(NumericsActivation, SituAndSwigluStep) {
  ActivationConfig c = cfg(MoeActivation::kSitu);
  EXPECT_THROW(act(c, {1, 2}, 1), ValueError);
  c.situ_beta = 4.0;
  EXPECT_EQ(act(c, {1.0f, 3.0f}, 1)[0], R(4 * std::tanh(0.25) / (1 + std::exp(-1.0)) * 3.0));
  c.situ_linear_beta = 2.0;
  EXPECT_EQ(act(c, {1.0f, 3.0f}, 1)[0],
            R(4 * std::tanh(0.25) / (1 + std::exp(-1.0)) * 2 * std::tanh(1.5)));
  c.situ_linear_beta = -1.0;  // <= 0 means unset
  EXPECT_EQ(act(c, {1.0f, 3.0f}, 1)[0], R(4 * std::tanh(0.25) / (1 + std::exp(-1.0)) * 3.0));
  const auto s = act(cfg(MoeActivation::kSwigluStep), {20.0f, 1.0f, 9.0f, 2.0f}, 2);
  EXPECT_EQ(s[0], R(7.0 * 7.0));  // min(silu(20), 7) * clamp(9, +-7)
  EXPECT_EQ(s[1], R(silu<double>(1.0) * 2.0));
}

TEST(NumericsActivation, GatedRelu2IsRejectedAsInVllm) {
  try {
    act(cfg(MoeActivation::kRelu2), {1, 2}, 1);
    FAIL();
  } catch (const ValueError& e) {
    EXPECT_STREQ(e.what(), "Unsupported FusedMoe activation: MoEActivation.RELU2");
  }
}

TEST(NumericsActivation, FusedSiluQuantPathIsUnrounded) {
  std::vector<float> h(1);
  silu_mul_fp32_row<double>(std::vector<float>{2.0f, 3.0f}.data(), 1, h.data());
  EXPECT_EQ(h[0], static_cast<float>(1.7615941559557646 * 3.0));
  EXPECT_NE(h[0], R(R(1.7615941559557646) * 3.0));
}

}  // namespace
}  // namespace fp8moe::numerics
