// The float64 reference fused MoE: hand-computed cases, exact-mode agreement across every scheme
// and activation, layer semantics (EP, padded slots, router weight on the input, fused SiLU+quant,
// refined blocks), the FP8 error against the unquantised layer, and bad input.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "common/moe_testing.hpp"
#include "fp8moe/error.hpp"
#include "fp8moe/numerics.hpp"
#include "kernels/ref/ref.hpp"
#include "numerics/quant.hpp"

namespace fp8moe::ref {
namespace {

namespace num = fp8moe::numerics;
using testing::compare_bitwise;
using testing::compare_close;
using testing::make_problem;
using testing::MoeTestMode;
using testing::MoeTestProblem;
using testing::MoeTestSpec;
using testing::reference_output;
using testing::RoutingPattern;

float out_at(const Tensor& t, int64_t i) { return num::load_float(t.view(), i); }

// ---- a case computed by hand
// ------------------------------------------------------------------------

// One token, H = I = 32, one expert, block [32, 32], per-group-32 activations.
//   x = [448, 2, 0, ...]                      -> group amax 448: scale 1, codes = x
//   gate row i: code 16 at k = 1              -> g = 32, silu(32) = 32 in bf16
//   up row i:   code c_i at k = 0             -> u_i = 448 c_i
//   h_i = bf16(32 * 448 c_i) = 14336 c_i      -> amax 14336: scale 32, codes 448 c_i
//   w2 = identity with block scale 2^-10      -> y2_m = 14336 c_m / 1024 = 14 c_m
//   out_m = 14 c_m * weight (+ bias_m)
struct HandCase {
  Tensor x, ids, w, w13, w2, s13, s2, b2, out;
  std::vector<int> c;
};
HandCase hand_case(float weight, bool bias) {
  HandCase h;
  const int64_t H = 32, I = 32;
  h.x = Tensor::zeros({1, H}, DType::kBF16);
  h.x.ptr<uint16_t>()[0] = num::float_to_bf16(448.0f);
  h.x.ptr<uint16_t>()[1] = num::float_to_bf16(2.0f);
  h.ids = Tensor::zeros({1, 1}, DType::kI32);
  h.w = Tensor::empty({1, 1}, DType::kF32);
  h.w.ptr<float>()[0] = weight;
  h.w13 = Tensor::zeros({1, 2 * I, H}, DType::kF8E4M3FN);
  for (int64_t i = 0; i < I; ++i) {
    h.c.push_back(static_cast<int>(i % 5) - 2);  // -2..2
    h.w13.ptr<uint8_t>()[i * H + 1] = num::float_to_e4m3fn(16.0f);
    h.w13.ptr<uint8_t>()[(I + i) * H + 0] = num::float_to_e4m3fn(static_cast<float>(h.c.back()));
  }
  h.w2 = Tensor::zeros({1, H, I}, DType::kF8E4M3FN);
  for (int64_t m = 0; m < H; ++m) h.w2.ptr<uint8_t>()[m * I + m] = num::float_to_e4m3fn(1.0f);
  h.s13 = Tensor::empty({1, 2, 1}, DType::kF32);
  h.s13.ptr<float>()[0] = h.s13.ptr<float>()[1] = 1.0f;
  h.s2 = Tensor::empty({1, 1, 1}, DType::kF32);
  h.s2.ptr<float>()[0] = 1.0f / 1024.0f;
  if (bias) {
    h.b2 = Tensor::empty({1, H}, DType::kF32);
    for (int64_t m = 0; m < H; ++m) h.b2.ptr<float>()[m] = static_cast<float>(m % 3);
  }
  h.out = Tensor::empty({1, H}, DType::kBF16);
  return h;
}
FusedMoeArgs hand_args(const HandCase& h) {
  FusedMoeArgs a;
  a.x = h.x;
  a.topk_ids = h.ids;
  a.topk_weights = h.w;
  a.weights.w13 = h.w13;
  a.weights.w2 = h.w2;
  a.weights.w13_scale = h.s13;
  a.weights.w2_scale = h.s2;
  a.weights.w2_bias = h.b2.view();
  a.scheme.weight = WeightScaleKind::kBlock;
  a.scheme.block_n = a.scheme.block_k = 32;
  a.scheme.act = ActQuantKind::kPerGroupDynamic;
  a.scheme.group_k = 32;
  a.out = h.out;
  return a;
}

TEST(RefFusedMoe, HandComputedBlockCase) {
  for (float weight : {1.0f, 0.5f}) {
    for (bool bias : {false, true}) {
      const HandCase h = hand_case(weight, bias);
      fused_moe(hand_args(h));
      for (int64_t m = 0; m < 32; ++m) {
        const float b = bias ? static_cast<float>(m % 3) : 0.0f;
        EXPECT_EQ(out_at(h.out, m), (14.0f * h.c[m] + b) * weight)
            << "m=" << m << " weight=" << weight << " bias=" << bias;
      }
    }
  }
}

TEST(RefFusedMoe, HandComputedPerTensorStaticAndW8A16) {
  HandCase h = hand_case(1.0f, false);
  FusedMoeArgs a = hand_args(h);
  // Per-tensor weights with scales 1 and 2^-10 and static activation scales 1 and 64 (h's amax is
  // 14336 * 2 = 448 * 64) give the same numbers as the block case above.
  Tensor s13 = Tensor::scalar_f32(1.0f), s2 = Tensor::scalar_f32(1.0f / 1024.0f);
  Tensor a13 = Tensor::scalar_f32(1.0f), a2 = Tensor::scalar_f32(64.0f);
  a.scheme.weight = WeightScaleKind::kPerTensor;
  a.scheme.act = ActQuantKind::kPerTensorStatic;
  a.weights.w13_scale = s13;
  a.weights.w2_scale = s2;
  a.weights.a13_scale = a13;
  a.weights.a2_scale = a2;
  fused_moe(a);
  for (int64_t m = 0; m < 32; ++m) EXPECT_EQ(out_at(h.out, m), 14.0f * h.c[m]) << m;
  // A static scale that is too small saturates: with 32, h = +-28672 clamps to 448 * 32.
  Tensor a2_small = Tensor::scalar_f32(32.0f);
  a.weights.a2_scale = a2_small;
  fused_moe(a);
  for (int64_t m = 0; m < 32; ++m) {
    EXPECT_EQ(out_at(h.out, m), 14.0f * std::clamp(h.c[m], -1, 1)) << m;
  }
  // W8A16: no activation quantisation; h = 14336 c stays bf16, y2 = 14 c again.
  a.scheme.act = ActQuantKind::kNone;
  testing::poison(h.out);
  fused_moe(a);
  for (int64_t m = 0; m < 32; ++m) EXPECT_EQ(out_at(h.out, m), 14.0f * h.c[m]) << m;
  // Per-tensor dynamic: the same scales come out of the data.
  a.scheme.act = ActQuantKind::kPerTensorDynamic;
  fused_moe(a);
  for (int64_t m = 0; m < 32; ++m) EXPECT_EQ(out_at(h.out, m), 14.0f * h.c[m]) << m;
}

// ---- exact mode over the scheme x activation matrix
// ----------------------------------------------------

struct SchemeCase {
  const char* name;
  MoeScheme scheme;
};
std::vector<SchemeCase> all_schemes() {
  std::vector<SchemeCase> v;
  const auto add = [&](const char* n, WeightScaleKind w, ActQuantKind a, int64_t b = 128,
                       int64_t g = 128, bool ue8m0 = false, DType fp8 = DType::kF8E4M3FN) {
    MoeScheme s;
    s.weight = w;
    s.act = a;
    s.block_n = s.block_k = b;
    s.group_k = g;
    s.ue8m0_scales = ue8m0;
    s.fp8 = fp8;
    v.push_back({n, s});
  };
  add("block128_group128", WeightScaleKind::kBlock, ActQuantKind::kPerGroupDynamic);
  add("block64_group64", WeightScaleKind::kBlock, ActQuantKind::kPerGroupDynamic, 64, 64);
  add("block32_group32", WeightScaleKind::kBlock, ActQuantKind::kPerGroupDynamic, 32, 32);
  add("block128_group128_ue8m0", WeightScaleKind::kBlock, ActQuantKind::kPerGroupDynamic, 128, 128,
      true);
  add("block128_fnuz", WeightScaleKind::kBlock, ActQuantKind::kPerGroupDynamic, 128, 128, false,
      DType::kF8E4M3FNUZ);
  add("tensor_static", WeightScaleKind::kPerTensor, ActQuantKind::kPerTensorStatic);
  add("tensor_dynamic", WeightScaleKind::kPerTensor, ActQuantKind::kPerTensorDynamic);
  add("channel_token", WeightScaleKind::kPerChannel, ActQuantKind::kPerTokenDynamic);
  add("mx_mxfp8", WeightScaleKind::kMx, ActQuantKind::kMxfp8);
  add("block_w8a16", WeightScaleKind::kBlock, ActQuantKind::kNone);
  add("mx_w8a16", WeightScaleKind::kMx, ActQuantKind::kNone);
  return v;
}

MoeTestSpec exact_spec(const MoeScheme& sc, MoeActivation act, uint64_t seed) {
  MoeTestSpec s;
  s.M = 6;
  s.E = 4;
  s.H = 128;
  s.I = 128;
  s.topk = 2;
  s.scheme = sc;
  s.act.activation = act;
  s.mode = MoeTestMode::kExact;
  s.seed = seed;
  s.bias = (seed % 2) == 1;
  return s;
}

TEST(RefFusedMoeExact, EverySchemeWithSilu) {
  uint64_t seed = 0;  // odd seeds add biases
  for (const SchemeCase& c : all_schemes()) {
    const MoeTestSpec s = exact_spec(c.scheme, MoeActivation::kSilu, ++seed);
    MoeTestProblem p;
    ASSERT_NO_THROW(p = make_problem(s)) << c.name;  // verifies float64 == float32 both orders
    const Tensor out = reference_output(p);
    EXPECT_TRUE(testing::expect_all_written(out)) << c.name;
    // Non-trivial: the outputs are not all zero.
    int64_t nonzero = 0;
    for (int64_t i = 0; i < out.numel(); ++i) nonzero += out_at(out, i) != 0.0f;
    EXPECT_GT(nonzero, out.numel() / 4) << c.name;
  }
}

TEST(RefFusedMoeExact, EveryExactActivation) {  // pitfall 18
  MoeScheme group;                              // block 128, group 128
  MoeScheme ue8m0 = group;
  ue8m0.ue8m0_scales = true;
  struct A {
    MoeActivation a;
    MoeScheme sc;
    ActivationConfig cfg;
  };
  std::vector<A> acts;
  for (MoeActivation a : {MoeActivation::kSilu, MoeActivation::kGelu, MoeActivation::kGeluTanh,
                          MoeActivation::kSwigluOai, MoeActivation::kSiluNoMul,
                          MoeActivation::kGeluNoMul, MoeActivation::kGeluTanhNoMul}) {
    ActivationConfig c;
    c.activation = a;
    acts.push_back({a, group, c});
  }
  ActivationConfig un;
  un.activation = MoeActivation::kSwigluOaiUninterleave;
  un.clamp_limit = 7.0;
  un.alpha = 1.702;
  un.beta = 1.0;
  acts.push_back({un.activation, group, un});
  ActivationConfig situ;
  situ.activation = MoeActivation::kSitu;
  situ.situ_beta = 2.0;
  acts.push_back({situ.activation, group, situ});
  ActivationConfig clamp;
  clamp.activation = MoeActivation::kSilu;
  clamp.clamp_limit = 448.0 * 32;
  acts.push_back({clamp.activation, group, clamp});
  ActivationConfig step;
  step.activation = MoeActivation::kSwigluStep;
  acts.push_back({step.activation, ue8m0, step});
  ActivationConfig relu2;
  relu2.activation = MoeActivation::kRelu2NoMul;
  acts.push_back({relu2.activation, ue8m0, relu2});
  for (const A& a : acts) {
    MoeTestSpec s = exact_spec(a.sc, a.a, 3);
    s.act = a.cfg;
    MoeTestProblem p;
    ASSERT_NO_THROW(p = make_problem(s)) << activation_value(a.a);
    const Tensor out = reference_output(p);
    int64_t nonzero = 0;
    for (int64_t i = 0; i < out.numel(); ++i) nonzero += out_at(out, i) != 0.0f;
    EXPECT_GT(nonzero, out.numel() / 4) << activation_value(a.a);
  }
}

TEST(RefFusedMoeExact, RoutingPatternsEpPaddingAndDtypes) {
  MoeScheme sc;
  for (RoutingPattern rp : {RoutingPattern::kUniform, RoutingPattern::kEveryExpertHit,
                            RoutingPattern::kOneHotExpert, RoutingPattern::kSomeExpertsEmpty}) {
    for (DType xd : {DType::kBF16, DType::kF32}) {
      MoeTestSpec s = exact_spec(sc, MoeActivation::kSilu, 4);
      s.E = 8;
      s.topk = 3;
      s.routing = rp;
      s.x_dtype = xd;
      s.padded_slots = 4;
      s.ep_size = 2;
      s.ep_rank = 1;
      ASSERT_NO_THROW(make_problem(s)) << s.name();
    }
  }
  MoeTestSpec s = exact_spec(sc, MoeActivation::kSilu, 5);
  s.routing = RoutingPattern::kLogits;
  s.routing_config.method = RoutingMethodType::kRenormalizeNaive;
  ASSERT_NO_THROW(make_problem(s)) << s.name();
}

// ---- semantics
// ------------------------------------------------------------------------------------------

// Sum of the outputs of all EP ranks equals the unsharded output (f32 x, exact data: exact sums).
TEST(RefFusedMoe, ExpertParallelRanksSumToTheWhole) {
  MoeTestSpec s = exact_spec(MoeScheme{}, MoeActivation::kSilu, 6);
  s.E = 4;
  s.topk = 2;
  s.x_dtype = DType::kF32;
  const MoeTestProblem full = make_problem(s);
  const Tensor whole = reference_output(full);
  std::vector<double> sum(static_cast<std::size_t>(whole.numel()), 0.0);
  for (int rank = 0; rank < 2; ++rank) {
    MoeTestProblem p = full;  // same data; keep only this rank's experts
    const int64_t el = 2;
    p.expert_map = Tensor::empty({4}, DType::kI32);
    for (int g = 0; g < 4; ++g) {
      p.expert_map.ptr<int32_t>()[g] = (g / el == rank) ? g % el : -1;
    }
    p.spec.ep_size = 2;
    p.spec.ep_rank = rank;
    for (Tensor* t : {&p.w13, &p.w2, &p.w13_scale, &p.w2_scale}) {
      auto shape = t->sizes();
      const int64_t per = t->numel() / 4 * static_cast<int64_t>(dtype_size(t->dtype()));
      shape[0] = el;
      Tensor part = Tensor::empty(std::span<const int64_t>(shape), t->dtype());
      std::memcpy(part.data(), static_cast<const char*>(t->data()) + rank * el * per,
                  static_cast<std::size_t>(el * per));
      *t = part;
    }
    const Tensor o = reference_output(p);
    for (int64_t i = 0; i < o.numel(); ++i) sum[i] += out_at(o, i);
  }
  for (int64_t i = 0; i < whole.numel(); ++i) EXPECT_EQ(sum[i], out_at(whole, i)) << i;
}

TEST(RefFusedMoe, PaddedSlotsContributeNothing) {  // pitfall 24
  MoeTestSpec s = exact_spec(MoeScheme{}, MoeActivation::kSilu, 7);
  s.padded_slots = 5;
  const MoeTestProblem p = make_problem(s);
  const Tensor with_pad = reference_output(p);
  // Replacing each padded slot by expert 0 with weight 0 gives the same output.
  MoeTestProblem q = p;
  q.topk_ids = p.topk_ids.clone();
  q.topk_weights = p.topk_weights.clone();
  for (int64_t i = 0; i < q.topk_ids.numel(); ++i) {
    if (q.topk_ids.ptr<int32_t>()[i] == -1) {
      q.topk_ids.ptr<int32_t>()[i] = 0;
      q.topk_weights.ptr<float>()[i] = 0.0f;
    }
  }
  EXPECT_TRUE(compare_bitwise(reference_output(q), with_pad).ok);
  // All slots padded: zero output.
  for (int64_t i = 0; i < q.topk_ids.numel(); ++i) q.topk_ids.ptr<int32_t>()[i] = -1;
  const Tensor z = reference_output(q);
  for (int64_t i = 0; i < z.numel(); ++i) EXPECT_EQ(out_at(z, i), 0.0f);
}

TEST(RefFusedMoe, EmptyBatchAndUnusedExperts) {  // pitfall 21
  MoeTestSpec s;
  s.M = 0;
  MoeTestProblem p = make_problem(s);
  EXPECT_NO_THROW(fused_moe(p.args()));
  s.M = 3;
  s.E = 16;
  s.H = s.I = 128;
  s.topk = 1;
  p = make_problem(s);  // most experts get no token
  EXPECT_NO_THROW(fused_moe(p.args()));
  EXPECT_TRUE(testing::expect_all_written(p.out));
}

TEST(RefFusedMoe, RouterWeightOnInput) {
  MoeTestSpec s = exact_spec(MoeScheme{}, MoeActivation::kSilu, 8);
  s.topk = 1;
  s.apply_router_weight_on_input = true;
  const MoeTestProblem p = make_problem(s);
  const Tensor on_input = reference_output(p);
  // Equivalent: x pre-multiplied by the (power-of-two) weight, then weight 1.
  MoeTestProblem q = p;
  q.spec.apply_router_weight_on_input = false;
  q.x = p.x.clone();
  q.topk_weights = p.topk_weights.clone();
  for (int64_t t = 0; t < s.M; ++t) {
    const float w = q.topk_weights.ptr<float>()[t];
    for (int64_t k = 0; k < s.H; ++k) {
      q.x.ptr<uint16_t>()[t * s.H + k] =
          num::float_to_bf16(num::bf16_to_float(q.x.ptr<uint16_t>()[t * s.H + k]) * w);
    }
    q.topk_weights.ptr<float>()[t] = 1.0f;
  }
  EXPECT_TRUE(compare_bitwise(reference_output(q), on_input).ok);
  // With the weight applied on the output instead, the result differs (h is not linear in x).
  MoeTestProblem r = p;
  r.spec.apply_router_weight_on_input = false;
  EXPECT_FALSE(compare_bitwise(reference_output(r), on_input).ok);
}

TEST(RefFusedMoe, LogitRoutingEqualsPrecomputedRouting) {
  MoeTestSpec s;
  s.M = 12;
  s.E = 8;
  s.H = s.I = 128;
  s.topk = 2;
  s.routing = RoutingPattern::kLogits;
  s.routing_config.method = RoutingMethodType::kDeepSeekV3;
  s.routing_config.num_expert_group = 4;
  s.routing_config.topk_group = 2;
  s.routing_config.routed_scaling_factor = 2.5;
  const MoeTestProblem p = make_problem(s);
  const Tensor via_logits = reference_output(p);
  RoutingConfig rc = p.args().routing;
  const RoutingResult r = route(p.router_logits, rc);
  MoeTestProblem q = p;
  q.topk_ids = r.topk_ids;
  q.topk_weights = r.topk_weights;
  EXPECT_TRUE(compare_bitwise(reference_output(q), via_logits).ok);
}

TEST(RefFusedMoe, FusedSiluQuantKeepsFp32AndDropsTheClamp) {
  MoeTestSpec s;
  s.M = 8;
  s.H = s.I = 128;
  s.seed = 3;
  MoeTestProblem p = make_problem(s);
  const Tensor unfused = reference_output(p);
  p.spec.scheme.fuse_silu_quant = true;
  const Tensor fused = reference_output(p);
  // No bf16 rounding of h and a scale floor: different bits, same values within FP8 noise
  // (observed mean relative difference ~0.016).
  EXPECT_FALSE(compare_bitwise(fused, unfused).ok);
  EXPECT_LT(compare_close(fused, unfused, 0, 0).mean_rel_abs_err, 0.03);
  // vLLM oddity: the fast path does not look at the clamp limit.
  p.spec.act.clamp_limit = 0.01;
  EXPECT_TRUE(compare_bitwise(reference_output(p), fused).ok);
  p.spec.scheme.fuse_silu_quant = false;
  EXPECT_GT(compare_close(reference_output(p), fused, 0, 0).mean_rel_abs_err, 0.5);
}

TEST(RefFusedMoe, RefinedBlockScalesAreLossless) {  // pitfall 6
  // Refining 128x128 weight scales to 64x64 (repeat_interleave) changes nothing while the
  // activations keep their 1x128 groups; moving activations to 1x64 groups changes a little.
  MoeTestSpec s;
  s.M = 6;
  s.H = 256;
  s.I = 256;
  s.seed = 11;
  const MoeTestProblem p = make_problem(s);
  const Tensor base = reference_output(p);
  MoeTestProblem q = p;
  q.spec.scheme.block_n = q.spec.scheme.block_k = 64;
  for (Tensor* t : {&q.w13_scale, &q.w2_scale}) {
    const int64_t E = t->size(0), nb = t->size(1), kb = t->size(2);
    Tensor r = Tensor::empty({E, 2 * nb, 2 * kb}, DType::kF32);
    for (int64_t e = 0; e < E; ++e) {
      for (int64_t i = 0; i < 2 * nb; ++i) {
        for (int64_t j = 0; j < 2 * kb; ++j) {
          r.ptr<float>()[(e * 2 * nb + i) * 2 * kb + j] =
              t->ptr<float>()[(e * nb + i / 2) * kb + j / 2];
        }
      }
    }
    *t = r;
  }
  EXPECT_TRUE(compare_bitwise(reference_output(q), base).ok);
  q.spec.scheme.group_k = 64;
  const Tensor g64 = reference_output(q);
  EXPECT_FALSE(compare_bitwise(g64, base).ok);
  EXPECT_LT(compare_close(g64, base, 0.035, 0.035).mean_rel_abs_err, 0.1);
}

TEST(RefFusedMoe, PerShardWeightScalesAreHonoured) {
  MoeTestSpec s;
  s.scheme.weight = WeightScaleKind::kPerTensor;
  s.scheme.act = ActQuantKind::kPerTensorDynamic;
  s.w13_shard_scales = true;
  MoeTestProblem p = make_problem(s);
  // Make the up shard's scale 4x the gate shard's (and the real weights with it).
  const int64_t I = s.I, H = s.H;
  for (int64_t e = 0; e < s.E; ++e) {
    p.w13_scale.ptr<float>()[e * 2 + 1] *= 4.0f;
    for (int64_t i = I * H; i < 2 * I * H; ++i) p.w13_real.ptr<float>()[e * 2 * I * H + i] *= 4.0f;
  }
  UnquantizedMoeArgs u;
  u.x = p.x;
  u.topk_ids = p.topk_ids;
  u.topk_weights = p.topk_weights;
  u.w13 = p.w13_real;
  u.w2 = p.w2_real;
  u.act = p.spec.act;
  Tensor uo = Tensor::empty({s.M, s.H}, s.x_dtype);
  u.out = uo;
  fused_moe_unquantized(u);
  EXPECT_LT(compare_close(reference_output(p), uo, 0, 0).mean_rel_abs_err, 0.08);
  // One scale per expert (the gate shard's) for both halves is a different, wrong layer.
  MoeTestProblem q = p;
  q.w13_scale = Tensor::empty({s.E}, DType::kF32);
  for (int64_t e = 0; e < s.E; ++e) q.w13_scale.ptr<float>()[e] = p.w13_scale.ptr<float>()[e * 2];
  EXPECT_GT(compare_close(reference_output(q), uo, 0, 0).mean_rel_abs_err, 0.3);
}

// ---- against the unquantised layer (the cost of FP8)
// -------------------------------------------------

TEST(RefFusedMoe, Fp8ErrorAgainstTheUnquantisedLayer) {
  for (const SchemeCase& c : all_schemes()) {
    MoeTestSpec s;
    s.M = 8;
    s.E = 4;
    s.H = 128;
    s.I = 128;
    s.topk = 2;
    s.scheme = c.scheme;
    s.bias = true;
    s.seed = 21;
    const MoeTestProblem p = make_problem(s);
    const Tensor q = reference_output(p);
    UnquantizedMoeArgs u;
    u.x = p.x;
    u.topk_ids = p.topk_ids;
    u.topk_weights = p.topk_weights;
    u.w13 = p.w13_real;
    u.w2 = p.w2_real;
    u.w13_bias = p.w13_bias;
    u.w2_bias = p.w2_bias;
    u.act = p.spec.act;
    Tensor uo = Tensor::empty({s.M, s.H}, s.x_dtype);
    u.out = uo;
    fused_moe_unquantized(u);
    const testing::CompareReport r = compare_close(q, uo, 0.035, 0.035);
    // FP8 (e4m3, 3 mantissa bits) costs a few percent; W8A16 costs only the weight rounding.
    const double limit = c.scheme.act == ActQuantKind::kNone ? 0.05 : 0.08;
    EXPECT_LT(r.mean_rel_abs_err, limit) << c.name << ": " << r.str();
    EXPECT_GT(r.mean_rel_abs_err, 1e-4) << c.name << ": suspiciously exact";
  }
}

// vLLM's own test (test_block_fp8.py) compares its kernel with a torch reference that quantises
// the same way; an implementation written differently from the reference (whole-tensor
// quantisers, dequantised matrices, bf16 weighted sum as in torch_w8a8_block_fp8_moe) must land
// within atol = rtol = 0.035.
TEST(RefFusedMoe, AgreesWithVllmStyleTorchReference) {  // pitfall 36
  MoeTestSpec s;
  s.M = 33;
  s.E = 8;
  s.H = 256;
  s.I = 128;
  s.topk = 2;
  s.seed = 5;
  const MoeTestProblem p = make_problem(s);
  const Tensor ours = reference_output(p);
  const int64_t M = s.M, H = s.H, I = s.I, K = s.topk;
  const auto a_q = num::per_token_group_quant_fp8(p.x, 128, DType::kF8E4M3FN);
  const Tensor w2 = num::dequantize_block(p.w2, p.w2_scale, 128, 128);
  Tensor torch_out = Tensor::empty({M, H}, DType::kBF16);
  for (int64_t t = 0; t < M; ++t) {
    std::vector<float> acc_out(static_cast<std::size_t>(H), 0.0f);
    for (int64_t j = 0; j < K; ++j) {
      const int e = p.topk_ids.ptr<int32_t>()[t * K + j];
      // native_w8a8_block_matmul: per-k-block fp32 partial products times the two scales.
      std::vector<float> y1(static_cast<std::size_t>(2 * I));
      for (int64_t n = 0; n < 2 * I; ++n) {
        float c = 0;
        for (int64_t kb = 0; kb < H / 128; ++kb) {
          float part = 0;
          for (int64_t k = kb * 128; k < kb * 128 + 128; ++k) {
            part += num::e4m3fn_to_float(a_q.q.ptr<uint8_t>()[t * H + k]) *
                    num::e4m3fn_to_float(p.w13.ptr<uint8_t>()[(e * 2 * I + n) * H + k]);
          }
          c += part * a_q.scale.ptr<float>()[t * (H / 128) + kb] *
               p.w13_scale.ptr<float>()[(e * (2 * I / 128) + n / 128) * (H / 128) + kb];
        }
        y1[n] = num::bf16_round(c);
      }
      // SiluAndMul.forward_native in bf16.
      Tensor h = Tensor::empty({1, I}, DType::kBF16);
      for (int64_t i = 0; i < I; ++i) {
        const float g = y1[i];
        h.ptr<uint16_t>()[i] =
            num::float_to_bf16(num::bf16_round(g / (1.0f + std::exp(-g))) * y1[I + i]);
      }
      const auto h_q = num::per_token_group_quant_fp8(h, 128, DType::kF8E4M3FN);
      for (int64_t m = 0; m < H; ++m) {
        float c = 0;
        for (int64_t i = 0; i < I; ++i) {
          c += num::e4m3fn_to_float(h_q.q.ptr<uint8_t>()[i]) * h_q.scale.ptr<float>()[i / 128] *
               static_cast<float>(w2.ptr<double>()[(e * H + m) * I + i]);
        }
        // (out * topk_weight.to(bf16)).sum in bf16
        const float y = num::bf16_round(c);
        const float w = num::bf16_round(p.topk_weights.ptr<float>()[t * K + j]);
        acc_out[m] = num::bf16_round(acc_out[m] + num::bf16_round(y * w));
      }
    }
    for (int64_t m = 0; m < H; ++m)
      torch_out.ptr<uint16_t>()[t * H + m] = num::float_to_bf16(acc_out[m]);
  }
  const testing::CompareReport r = compare_close(ours, torch_out, 0.035, 0.035);
  EXPECT_TRUE(r.ok) << r.str();
  // The outputs here are small (|out| ~ 0.02), so atol alone would pass nearly anything: the
  // relative metric must be small too (observed ~0.002: bf16 weighting and summation order).
  EXPECT_LT(r.mean_rel_abs_err, 0.01) << r.str();
  EXPECT_GT(r.max_abs_err, 0.0)
      << "the two computations round differently; identical is suspicious";
}

// ---- bad input
// --------------------------------------------------------------------------------------------

std::string error_of(const FusedMoeArgs& a) {
  try {
    fused_moe(a);
  } catch (const ValueError& e) {
    return e.what();
  }
  return "";
}

TEST(RefFusedMoe, BadInputRaisesClearErrors) {
  MoeTestSpec s;
  s.M = 4;
  s.E = 4;
  s.H = 256;
  s.I = 128;
  const MoeTestProblem p = make_problem(s);
  {
    FusedMoeArgs a = p.args();
    Tensor w = Tensor::zeros({4, 255, 256}, DType::kF8E4M3FN);
    a.weights.w13 = w;
    const std::string e = error_of(a);
    EXPECT_NE(e.find("w13"), std::string::npos) << e;
    EXPECT_NE(e.find("(4, 256, 256)"), std::string::npos) << e;
  }
  {
    FusedMoeArgs a = p.args();
    Tensor sc = Tensor::zeros({4, 1, 2}, DType::kF32);
    a.weights.w13_scale = sc;
    const std::string e = error_of(a);
    EXPECT_NE(e.find("w13_scale"), std::string::npos) << e;
    EXPECT_NE(e.find("(4, 2, 2)"), std::string::npos) << e;
  }
  {
    FusedMoeArgs a = p.args();
    a.scheme.group_k = 96;
    EXPECT_NE(error_of(a).find("group size 96"), std::string::npos) << error_of(a);
  }
  {
    FusedMoeArgs a = p.args();
    Tensor sc = p.w2_scale.clone();
    sc.ptr<float>()[3] = -1.0f;
    a.weights.w2_scale = sc;
    EXPECT_NE(error_of(a).find("w2_scale"), std::string::npos);
    sc.ptr<float>()[3] = NAN;
    EXPECT_NE(error_of(a).find("positive"), std::string::npos) << error_of(a);
  }
  {
    FusedMoeArgs a = p.args();
    Tensor ids = p.topk_ids.clone();
    ids.ptr<int32_t>()[5] = 4;  // only experts 0..3 exist
    a.topk_ids = ids;
    EXPECT_NE(error_of(a).find("topk_ids[2, 1] = 4"), std::string::npos) << error_of(a);
  }
  {
    FusedMoeArgs a = p.args();
    a.topk_ids = TensorView();
    Tensor logits = Tensor::zeros({4, 4}, DType::kF32);
    a.router_logits = logits;
    a.routing.topk = 5;
    EXPECT_NE(error_of(a).find("topk 5"), std::string::npos) << error_of(a);
  }
  {
    FusedMoeArgs a = p.args();
    a.apply_router_weight_on_input = true;  // topk is 2
    EXPECT_NE(error_of(a).find("apply_router_weight_on_input"), std::string::npos);
  }
  {
    FusedMoeArgs a = p.args();
    a.scheme.act = ActQuantKind::kPerTensorStatic;  // no a13_scale given
    EXPECT_NE(error_of(a).find("a13_scale is missing"), std::string::npos) << error_of(a);
  }
  {
    FusedMoeArgs a = p.args();
    Tensor out = Tensor::empty({4, 255}, DType::kBF16);
    a.out = out;
    EXPECT_NE(error_of(a).find("out has shape (4, 255)"), std::string::npos) << error_of(a);
  }
  {
    FusedMoeArgs a = p.args();
    Tensor map = Tensor::empty({4}, DType::kI32);
    for (int g = 0; g < 4; ++g) map.ptr<int32_t>()[g] = g == 2 ? 9 : g;
    a.expert_map = map;
    EXPECT_NE(error_of(a).find("expert_map[2] = 9"), std::string::npos) << error_of(a);
  }
  {
    FusedMoeArgs a = p.args();
    a.act.activation = MoeActivation::kSiluNoMul;  // w13 holds 2I rows: not a non-gated layout
    EXPECT_NE(error_of(a).find("w13"), std::string::npos);
  }
  {
    FusedMoeArgs a = p.args();
    a.scheme.block_n = 96;  // does not divide I = 128
    EXPECT_NE(error_of(a).find("block_n 96"), std::string::npos) << error_of(a);
  }
}

TEST(RefFusedMoe, ExpertsImplDescriptor) {
  const ExpertsImpl& impl = ref_experts_impl();
  EXPECT_STREQ(impl.name, "ref");
  EXPECT_EQ(impl.device, DeviceKind::kCpu);
  ASSERT_NE(impl.available, nullptr);
  EXPECT_TRUE(impl.available());
  MoeTestSpec s;
  s.H = s.I = 128;
  s.mode = MoeTestMode::kExact;
  const MoeTestProblem p = make_problem(s);
  EXPECT_EQ(impl.workspace_size(p.args()), 0u);
  impl.run(p.args(), nullptr);
  EXPECT_TRUE(compare_bitwise(p.out, reference_output(p)).ok);
}

}  // namespace
}  // namespace fp8moe::ref
