// The shared test helpers themselves: generated problems have the documented shapes and
// properties, routing patterns do what they say, and the checks catch what they must.
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <set>

#include "common/moe_testing.hpp"
#include "fp8moe/error.hpp"
#include "fp8moe/numerics.hpp"
#include "numerics/quant.hpp"

namespace fp8moe::testing {
namespace {

namespace num = fp8moe::numerics;

TEST(TestingHelpers, StatisticalProblemShapesPerScheme) {
  struct Case {
    WeightScaleKind w;
    ActQuantKind a;
    std::vector<int64_t> s13, s2;
  };
  const Case cases[] = {
      {WeightScaleKind::kBlock, ActQuantKind::kPerGroupDynamic, {3, 2, 2}, {3, 2, 1}},
      {WeightScaleKind::kPerTensor, ActQuantKind::kPerTensorStatic, {3}, {3}},
      {WeightScaleKind::kPerChannel, ActQuantKind::kPerTokenDynamic, {3, 256}, {3, 192}},
      {WeightScaleKind::kMx, ActQuantKind::kMxfp8, {3, 256, 6}, {3, 192, 4}},
  };
  for (const Case& c : cases) {
    MoeTestSpec s;
    s.M = 5;
    s.E = 3;
    s.H = 192;
    s.I = 128;
    s.topk = 2;
    s.scheme.weight = c.w;
    s.scheme.act = c.a;
    s.bias = true;
    const MoeTestProblem p = make_problem(s);
    EXPECT_EQ(p.x.sizes(), (std::vector<int64_t>{5, 192})) << s.name();
    EXPECT_EQ(p.w13.sizes(), (std::vector<int64_t>{3, 256, 192}));
    EXPECT_EQ(p.w2.sizes(), (std::vector<int64_t>{3, 192, 128}));
    EXPECT_EQ(p.w13_scale.sizes(), c.s13) << s.name();
    EXPECT_EQ(p.w2_scale.sizes(), c.s2) << s.name();
    EXPECT_EQ(p.w13_bias.sizes(), (std::vector<int64_t>{3, 256}));
    EXPECT_EQ(p.topk_ids.sizes(), (std::vector<int64_t>{5, 2}));
    EXPECT_EQ(count_nan(p.out), 5 * 192) << "out starts poisoned";
    const FusedMoeArgs a = p.args();
    EXPECT_EQ(a.num_tokens(), 5);
    EXPECT_EQ(a.intermediate(), 128);
    EXPECT_EQ(a.weights.w13.data, p.w13.data());
    // Never zero activations in statistical mode.
    for (int64_t i = 0; i < p.x.numel(); ++i) EXPECT_NE(num::load_float(p.x.view(), i), 0.0f);
  }
}

TEST(TestingHelpers, ExactActivationsHavePowerOfTwoGroupScales) {
  MoeTestSpec s;
  s.M = 7;
  s.E = 4;
  s.H = 256;
  s.I = 128;
  s.mode = MoeTestMode::kExact;
  const MoeTestProblem p = make_problem(s);
  for (int64_t t = 0; t < s.M; ++t) {
    for (int64_t g = 0; g < s.H / 32; ++g) {
      float amax = 0;
      for (int64_t k = g * 32; k < g * 32 + 32; ++k) {
        amax = std::max(amax, std::fabs(num::load_float(p.x.view(), t * s.H + k)));
      }
      int e = 0;
      EXPECT_EQ(std::frexp(amax / 448.0f, &e), 0.5f) << "token " << t << " segment " << g;
    }
  }
  // Weights are exact fp8 codes times power-of-two scales; w13_real holds their values.
  for (int64_t i = 0; i < p.w13_scale.numel(); ++i) {
    int e = 0;
    EXPECT_EQ(std::frexp(p.w13_scale.ptr<float>()[i], &e), 0.5f);
  }
  // Routing weights are powers of two.
  for (int64_t i = 0; i < p.topk_weights.numel(); ++i) {
    int e = 0;
    EXPECT_EQ(std::frexp(p.topk_weights.ptr<float>()[i], &e), 0.5f);
  }
}

TEST(TestingHelpers, ExactModeRejectsWhatItCannotBuild) {
  MoeTestSpec s;
  s.H = s.I = 128;
  s.mode = MoeTestMode::kExact;
  s.act.activation = MoeActivation::kSwigluStep;  // needs a power-of-two second scale
  EXPECT_THROW(make_problem(s), NotImplementedError);
  s.scheme.ue8m0_scales = true;
  EXPECT_NO_THROW(make_problem(s));
  s.act.activation = MoeActivation::kSilu;
  s.scheme.ue8m0_scales = false;
  s.act.clamp_limit = 7.0;
  EXPECT_THROW(make_problem(s), NotImplementedError);
  s.act.clamp_limit = 448.0 * 32;
  EXPECT_NO_THROW(make_problem(s));
}

TEST(TestingHelpers, RoutingPatterns) {
  const int64_t M = 16, E = 8;
  const auto ids_of = [](const RoutingDraw& d) {
    std::vector<int32_t> v(d.topk_ids.ptr<int32_t>(),
                           d.topk_ids.ptr<int32_t>() + d.topk_ids.numel());
    return v;
  };
  // Distinct experts per token, weights summing to 1 (statistical).
  const RoutingDraw u =
      make_routing(M, E, 3, RoutingPattern::kUniform, MoeTestMode::kStatistical, 1);
  for (int64_t t = 0; t < M; ++t) {
    std::set<int32_t> s;
    double sum = 0;
    for (int j = 0; j < 3; ++j) {
      s.insert(u.topk_ids.ptr<int32_t>()[t * 3 + j]);
      sum += u.topk_weights.ptr<float>()[t * 3 + j];
    }
    EXPECT_EQ(s.size(), 3u);
    EXPECT_NEAR(sum, 1.0, 1e-6);
  }
  const auto hit =
      ids_of(make_routing(M, E, 1, RoutingPattern::kEveryExpertHit, MoeTestMode::kExact, 2));
  EXPECT_EQ(std::set<int32_t>(hit.begin(), hit.end()).size(), static_cast<std::size_t>(E));
  const auto hot =
      ids_of(make_routing(M, E, 2, RoutingPattern::kOneHotExpert, MoeTestMode::kExact, 3));
  std::map<int32_t, int> counts;
  for (int32_t id : hot) counts[id]++;
  int maxc = 0;
  for (auto& [id, c] : counts) maxc = std::max(maxc, c);
  EXPECT_EQ(maxc, M) << "one expert is in every token";
  const auto some =
      ids_of(make_routing(M, E, 2, RoutingPattern::kSomeExpertsEmpty, MoeTestMode::kExact, 4));
  EXPECT_LE(std::set<int32_t>(some.begin(), some.end()).size(), static_cast<std::size_t>(E / 2));
  EXPECT_THROW(make_routing(2, E, 1, RoutingPattern::kEveryExpertHit, MoeTestMode::kExact, 0),
               ValueError);
  EXPECT_THROW(make_routing(2, E, 9, RoutingPattern::kUniform, MoeTestMode::kExact, 0), ValueError);
}

TEST(TestingHelpers, EpPaddedSlotsAndEmptyBatch) {
  MoeTestSpec s;
  s.M = 6;
  s.E = 8;
  s.ep_size = 4;
  s.ep_rank = 2;
  s.padded_slots = 3;
  const MoeTestProblem p = make_problem(s);
  EXPECT_EQ(p.w13.size(0), 2);
  for (int g = 0; g < 8; ++g) {
    EXPECT_EQ(p.expert_map.ptr<int32_t>()[g], (g == 4 || g == 5) ? g - 4 : -1);
  }
  int pads = 0;
  for (int64_t i = 0; i < p.topk_ids.numel(); ++i) pads += p.topk_ids.ptr<int32_t>()[i] == -1;
  EXPECT_EQ(pads, 3);
  s.M = 0;
  s.padded_slots = 0;
  const MoeTestProblem z = make_problem(s);
  EXPECT_EQ(z.x.size(0), 0);
  EXPECT_EQ(z.out.numel(), 0);
  EXPECT_TRUE(expect_all_written(z.out));
}

TEST(TestingHelpers, PoisonAndCoverage) {
  Tensor t = Tensor::zeros({3, 4}, DType::kBF16);
  EXPECT_TRUE(expect_all_written(t));
  poison(t);
  EXPECT_EQ(count_nan(t), 12);
  for (int i = 0; i < 12; ++i) {
    if (i != 6) t.ptr<uint16_t>()[i] = num::float_to_bf16(1.0f);
  }
  const WriteCheck w = expect_all_written(t);
  EXPECT_FALSE(w.ok);
  EXPECT_EQ(w.unwritten, 1);
  EXPECT_EQ(w.first_index, 6);
  EXPECT_NE(w.message.find("row 1, col 2"), std::string::npos) << w.message;
}

TEST(TestingHelpers, GuardedTensorCatchesOverruns) {
  GuardedTensor g({4, 8}, DType::kF32);
  EXPECT_TRUE(g.canaries_intact());
  g.view().ptr<float>()[31] = 1.0f;  // last element: fine
  EXPECT_TRUE(g.canaries_intact());
  g.view().ptr<float>()[32] = 1.0f;  // one past the end lands in the canary
  EXPECT_FALSE(g.canaries_intact());
}

TEST(TestingHelpers, Comparisons) {
  Tensor a = Tensor::empty({2, 3}, DType::kF32), b = Tensor::empty({2, 3}, DType::kF32);
  for (int i = 0; i < 6; ++i) a.ptr<float>()[i] = b.ptr<float>()[i] = static_cast<float>(i + 1);
  EXPECT_TRUE(compare_bitwise(a, b).ok);
  b.ptr<float>()[4] = std::nextafter(5.0f, 6.0f);
  const CompareReport bw = compare_bitwise(a, b);
  EXPECT_FALSE(bw.ok);
  EXPECT_EQ(bw.mismatches, 1);
  EXPECT_EQ(bw.first_mismatch, 4);
  EXPECT_TRUE(compare_close(a, b, 1e-6, 1e-6).ok);
  b.ptr<float>()[1] = 2.2f;  // |err| 0.2 > 0.035 + 0.035 * 2.2
  const CompareReport cl = compare_close(a, b, 0.035, 0.035);
  EXPECT_FALSE(cl.ok);
  EXPECT_EQ(cl.first_mismatch, 1);
  EXPECT_EQ(cl.max_abs_index, 1);
  EXPECT_NEAR(cl.max_abs_err, 0.2, 1e-6);
  EXPECT_GT(cl.mean_rel_abs_err, 0.0);
  b.ptr<float>()[0] = NAN;
  EXPECT_TRUE(compare_close(a, b, 1, 1).nan_mismatch);
  Tensor c = Tensor::empty({3, 2}, DType::kF32);
  EXPECT_THROW(compare_bitwise(a, c), ValueError);
}

}  // namespace
}  // namespace fp8moe::testing
