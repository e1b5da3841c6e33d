// Routing for every RoutingMethodType against hand-computed cases: selection, ties, grouped
// selection, bias, scaling, NaN/Inf logits and bad configurations.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "fp8moe/error.hpp"
#include "fp8moe/numerics.hpp"
#include "numerics/routing.hpp"

namespace fp8moe::numerics {
namespace {

const float kNaN = std::numeric_limits<float>::quiet_NaN();
const float kInf = std::numeric_limits<float>::infinity();

struct Routed {
  std::vector<int32_t> ids;
  std::vector<float> w;
};

Routed run(const std::vector<float>& logits, RoutingMethodType m, int k,
           const std::vector<float>& bias = {}, int groups = 0, int topk_group = 0,
           double rsf = 1.0, const std::string& scoring = "softmax", bool renorm = true) {
  const int64_t E = static_cast<int64_t>(logits.size());
  Tensor l = Tensor::empty({1, E}, DType::kF32);
  std::copy(logits.begin(), logits.end(), l.ptr<float>());
  Tensor b;
  RoutingConfig c;
  c.method = m;
  c.topk = k;
  c.num_expert_group = groups;
  c.topk_group = topk_group;
  c.routed_scaling_factor = rsf;
  c.scoring_func = scoring;
  c.renormalize = renorm;
  if (!bias.empty()) {
    b = Tensor::empty({E}, DType::kF32);
    std::copy(bias.begin(), bias.end(), b.ptr<float>());
    c.e_score_correction_bias = b;
  }
  const RoutingResult r = route(l, c);
  Routed o;
  o.ids.assign(r.topk_ids.ptr<int32_t>(), r.topk_ids.ptr<int32_t>() + k);
  o.w.assign(r.topk_weights.ptr<float>(), r.topk_weights.ptr<float>() + k);
  return o;
}

double sig(double x) { return 1.0 / (1.0 + std::exp(-x)); }

TEST(NumericsRouting, DefaultIsSoftmaxThenTopk) {
  const Routed r = run({1, 2, 3, 0}, RoutingMethodType::kDefault, 2);
  EXPECT_EQ(r.ids, (std::vector<int32_t>{2, 1}));
  const double z = std::exp(1) + std::exp(2) + std::exp(3) + 1;
  EXPECT_NEAR(r.w[0], std::exp(3) / z, 1e-7);
  EXPECT_NEAR(r.w[1], std::exp(2) / z, 1e-7);
}

TEST(NumericsRouting, TiesGoToTheLowerExpertIndex) {
  EXPECT_EQ(run({1, 3, 3, 0, 3}, RoutingMethodType::kDefault, 2).ids, (std::vector<int32_t>{1, 2}));
  EXPECT_EQ(run({1, 3, 3, 0, 3}, RoutingMethodType::kRenormalize, 3).ids,
            (std::vector<int32_t>{1, 2, 4}));
  EXPECT_EQ(run({0, 0, 0, 0}, RoutingMethodType::kSigmoid, 4).ids,
            (std::vector<int32_t>{0, 1, 2, 3}));
}

TEST(NumericsRouting, RenormalizeVariants) {
  // RenormalizeNaive: w_i = p_i / (p_i + p_j) = 1 / (1 + e^(l_j - l_i)).
  const Routed n = run({0.5f, -1, 2, 1}, RoutingMethodType::kRenormalizeNaive, 2);
  EXPECT_EQ(n.ids, (std::vector<int32_t>{2, 3}));
  EXPECT_NEAR(n.w[0], 1 / (1 + std::exp(-1.0)), 1e-6);
  EXPECT_NEAR(n.w[1], 1 / (1 + std::exp(1.0)), 1e-6);
  const Routed r = run({0.5f, -1, 2, 1}, RoutingMethodType::kRenormalize, 2);
  EXPECT_EQ(r.ids, n.ids);
  EXPECT_NEAR(r.w[0], n.w[0], 1e-6);
  // Renormalize selects on the logits, RenormalizeNaive on probabilities: when the probabilities
  // underflow to equal zeros the naive form falls back to the lower index.
  const Routed a = run({-1001, -1000, 0}, RoutingMethodType::kRenormalize, 2);
  const Routed b = run({-1001, -1000, 0}, RoutingMethodType::kRenormalizeNaive, 2);
  EXPECT_EQ(a.ids, (std::vector<int32_t>{2, 1}));
  EXPECT_EQ(b.ids, (std::vector<int32_t>{2, 0}));
  EXPECT_EQ(a.w[0], 1.0f);
  EXPECT_EQ(a.w[1], 0.0f);
}

TEST(NumericsRouting, SigmoidTopKAndLlama4) {
  const Routed s = run({-1, 2, 0.5f}, RoutingMethodType::kSigmoid, 2);
  EXPECT_EQ(s.ids, (std::vector<int32_t>{1, 2}));
  EXPECT_NEAR(s.w[0], sig(2), 1e-7);
  EXPECT_NEAR(s.w[1], sig(0.5), 1e-7);
  const Routed sr = run({-1, 2, 0.5f}, RoutingMethodType::kSigmoidRenorm, 2);
  EXPECT_NEAR(sr.w[0], sig(2) / (sig(2) + sig(0.5)), 1e-6);
  const Routed t = run({-1, 2, 0.5f}, RoutingMethodType::kTopK, 2);
  EXPECT_EQ(t.w, (std::vector<float>{2.0f, 0.5f}));
  const Routed l4 = run({-1, 2, 0.5f, 1.5f}, RoutingMethodType::kLlama4, 1);
  EXPECT_EQ(l4.ids, (std::vector<int32_t>{1}));
  EXPECT_NEAR(l4.w[0], sig(2), 1e-7);
}

TEST(NumericsRouting, MiniMax2UsesBiasForSelectionOnly) {
  // Without the bias expert 0 would win; the bias promotes expert 2.
  const Routed r = run({2, 0, 1, -1}, RoutingMethodType::kMiniMax2, 2, {0, 0, 0.5f, 0}, 0, 0, 1.0);
  EXPECT_EQ(r.ids, (std::vector<int32_t>{2, 0}));
  const double s2 = sig(1), s0 = sig(2);
  EXPECT_NEAR(r.w[0], s2 / (s2 + s0 + 1e-20), 1e-6);
  EXPECT_NEAR(r.w[1], s0 / (s2 + s0 + 1e-20), 1e-6);
  EXPECT_THROW(run({2, 0, 1, -1}, RoutingMethodType::kMiniMax2, 2), ValueError);
}

TEST(NumericsRouting, DeepSeekV3GroupedSelectionAndScaling) {
  // 8 experts in 4 groups of 2; keep 2 groups; top-2 experts from them.
  // Biased scores s' = sigmoid(l) + bias; group score = sum of its 2 biased scores.
  const std::vector<float> l = {3.0f,  -3.0f,   // g0: one strong expert, weak partner
                                1.0f,  1.0f,    // g1
                                0.5f,  0.8f,    // g2
                                -2.0f, -2.0f};  // g3
  const std::vector<float> bias = {0, 0, 0, 0, 0, 0, 0, 0};
  const Routed r = run(l, RoutingMethodType::kDeepSeekV3, 2, bias, 4, 2, 2.5);
  // Group sums: g0 = .9526 + .0474 = 1.0; g1 = 2 * .7311 = 1.462; g2 = .6225 + .6900 = 1.3125.
  // Groups g1 and g2 win, so expert 0 (the single best score) is excluded.
  EXPECT_EQ(r.ids, (std::vector<int32_t>{2, 3}));
  const double s = sig(1);
  EXPECT_NEAR(r.w[0], s / (2 * s + 1e-20) * 2.5, 1e-6);
  EXPECT_NEAR(r.w[1], 1.25, 1e-6);
  // Without the group limit (one group holding all experts is not a valid grouping: E <= groups
  // would fall back), topk_group = 4 keeps every group: expert 0 wins.
  EXPECT_EQ(run(l, RoutingMethodType::kDeepSeekV3, 2, bias, 4, 4, 1.0).ids,
            (std::vector<int32_t>{0, 2}));
  // The bias moves a group: +1.5 on expert 6 lifts g3 (1.74) above g1 and g2.
  std::vector<float> b2 = bias;
  b2[6] = 1.5f;
  const Routed r2 = run(l, RoutingMethodType::kDeepSeekV3, 2, b2, 4, 2, 1.0);
  EXPECT_EQ(r2.ids, (std::vector<int32_t>{6, 2}));
  EXPECT_NEAR(r2.w[0], sig(-2) / (sig(-2) + sig(1)), 1e-6) << "weights use unbiased scores";
}

TEST(NumericsRouting, GroupTiesGoToTheLowerGroup) {
  // Groups 1 and 2 tie exactly; one group is kept: group 1.
  const std::vector<float> l = {-5, -5, 1, 2, 2, 1, -5, -5};
  const Routed r = run(l, RoutingMethodType::kDeepSeekV3, 2, std::vector<float>(8, 0.0f), 4, 1);
  EXPECT_EQ(r.ids, (std::vector<int32_t>{3, 2}));
}

TEST(NumericsRouting, GroupedFallsBackWhenGroupsDoNotDivide) {
  // E = 6 with 4 groups: vLLM falls back to fused_topk_bias (no grouping).
  const std::vector<float> l = {3, -3, 1, 1, 0.5f, 0.8f};
  const Routed r =
      run(l, RoutingMethodType::kDeepSeekV3, 2, std::vector<float>(6, 0.0f), 4, 1, 2.0);
  EXPECT_EQ(r.ids, (std::vector<int32_t>{0, 2}));
  EXPECT_NEAR(r.w[0], sig(3) / (sig(3) + sig(1)) * 2.0, 1e-6);
}

TEST(NumericsRouting, UnspecifiedFollowsTheFields) {
  // Softmax without renormalisation, no bias: fused_topk.
  const Routed a =
      run({1, 2, 3, 0}, RoutingMethodType::kUnspecified, 2, {}, 0, 0, 3.0, "softmax", false);
  const Routed d = run({1, 2, 3, 0}, RoutingMethodType::kDefault, 2);
  EXPECT_EQ(a.ids, d.ids);
  EXPECT_EQ(a.w, d.w) << "fused_topk ignores routed_scaling_factor";
  // Sigmoid with a bias and renormalisation: fused_topk_bias * rsf.
  const Routed b =
      run({0, 1, 2}, RoutingMethodType::kUnspecified, 1, {2, 0, 0}, 0, 0, 3.0, "sigmoid", true);
  EXPECT_EQ(b.ids, (std::vector<int32_t>{0}));
  EXPECT_NEAR(b.w[0], 3.0, 1e-6);
}

TEST(NumericsRouting, DeepseekV4SqrtSoftplus) {
  const Routed r = run({0, 1, -1}, RoutingMethodType::kDeepseekV4, 2, {0, 0, 0}, 0, 0, 1.5);
  EXPECT_EQ(r.ids, (std::vector<int32_t>{1, 0}));
  const double s1 = std::sqrt(std::log1p(std::exp(1.0))), s0 = std::sqrt(std::log(2.0));
  EXPECT_NEAR(r.w[0], s1 / (s1 + s0) * 1.5, 1e-6);
}

TEST(NumericsRouting, NanAndInfLogitsGiveDistinctIdsAndZeroWeights) {
  for (RoutingMethodType m :
       {RoutingMethodType::kDefault, RoutingMethodType::kRenormalizeNaive,
        RoutingMethodType::kSigmoid, RoutingMethodType::kSigmoidRenorm,
        RoutingMethodType::kRenormalize, RoutingMethodType::kLlama4, RoutingMethodType::kTopK}) {
    for (float bad : {kNaN, kInf}) {
      const Routed r = run(std::vector<float>(6, bad), m, 3);
      EXPECT_EQ(r.ids, (std::vector<int32_t>{0, 1, 2})) << routing_method_name(m);
      if (!(m == RoutingMethodType::kSigmoid || m == RoutingMethodType::kSigmoidRenorm ||
            m == RoutingMethodType::kLlama4) ||
          std::isnan(bad)) {
        for (float w : r.w) EXPECT_EQ(w, 0.0f) << routing_method_name(m) << " " << bad;
      }
      for (float w : r.w) EXPECT_TRUE(std::isfinite(w));
    }
  }
  // One NaN logit poisons a softmax row entirely (fmaxf drops it, exp(NaN) poisons the sum).
  const Routed s = run({1, kNaN, 2, 0}, RoutingMethodType::kDefault, 2);
  EXPECT_EQ(s.ids, (std::vector<int32_t>{0, 1}));
  EXPECT_EQ(s.w, (std::vector<float>{0, 0}));
  // Sigmoid scores are per expert: only the NaN expert drops to 0.
  const Routed g = run({1, kNaN, 2, 0}, RoutingMethodType::kSigmoid, 2);
  EXPECT_EQ(g.ids, (std::vector<int32_t>{2, 0}));
  // -inf logits are just impossible experts.
  const Routed ni = run({-kInf, 1, -kInf, 0}, RoutingMethodType::kRenormalizeNaive, 2);
  EXPECT_EQ(ni.ids, (std::vector<int32_t>{1, 3}));
}

TEST(NumericsRouting, BadConfigurationsRaise) {
  EXPECT_THROW(run({1, 2, 3}, RoutingMethodType::kDefault, 4), ValueError);
  EXPECT_THROW(run({1, 2, 3}, RoutingMethodType::kDefault, 0), ValueError);
  EXPECT_THROW(run({1, 2, 3}, RoutingMethodType::kDefault, 1, {0, 0, 0}), ValueError);
  EXPECT_THROW(run(std::vector<float>(8, 0), RoutingMethodType::kDeepSeekV3, 2,
                   std::vector<float>(8, 0), 4, 5),
               ValueError);
  EXPECT_THROW(run(std::vector<float>(8, 0), RoutingMethodType::kDeepSeekV3, 5,
                   std::vector<float>(8, 0), 4, 2),
               ValueError);
  EXPECT_THROW(run({1, 2}, RoutingMethodType::kCustom, 1), NotImplementedError);
  EXPECT_THROW(run({1, 2}, RoutingMethodType::kUnspecified, 1, {}, 0, 0, 1, "relu"), ValueError);
  Tensor l3 = Tensor::zeros({2, 3, 4}, DType::kF32);
  RoutingConfig c;
  EXPECT_THROW(route(l3, c), ValueError);
}

TEST(NumericsRouting, Bf16LogitsAndManyRows) {
  Tensor l = Tensor::empty({3, 4}, DType::kBF16);
  const float v[12] = {1, 2, 3, 0, 0, 0, 5, 0, -1, -2, -3, -4};
  for (int i = 0; i < 12; ++i) l.ptr<uint16_t>()[i] = float_to_bf16(v[i]);
  RoutingConfig c;
  c.method = RoutingMethodType::kRenormalizeNaive;
  c.topk = 1;
  const RoutingResult r = route(l, c);
  EXPECT_EQ(r.topk_ids.ptr<int32_t>()[0], 2);
  EXPECT_EQ(r.topk_ids.ptr<int32_t>()[1], 2);
  EXPECT_EQ(r.topk_ids.ptr<int32_t>()[2], 0);
  for (int t = 0; t < 3; ++t) EXPECT_EQ(r.topk_weights.ptr<float>()[t], 1.0f);
}

}  // namespace
}  // namespace fp8moe::numerics
