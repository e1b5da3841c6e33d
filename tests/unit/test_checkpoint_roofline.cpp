// The roofline estimator (fp8moe/roofline.hpp): spec/models.md's H200 table reproduced row by row
// (the estimator alone, then through the planner on the real configs), padding, expert parallelism
// with and without DP, the card table and bad cards.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "fp8moe/checkpoint.hpp"
#include "fp8moe/error.hpp"
#include "fp8moe/roofline.hpp"
#include "test_checkpoint_util.hpp"

namespace fp8moe {
namespace {

using test::throws_with;

// spec/models.md, "Roofline floors for one MoE layer on H200" (us, one decimal; 'c' marks the
// compute-bound cells). The table counts fp8 weights, bf16 activations in/out and bf16
// intermediates (checked below: its numbers need them) but no scales.
struct TableRow {
  const char* name;
  int E;
  int64_t K, N;
  int topk;
  double us[7];
  bool compute[7];
};
const int64_t kTableTokens[7] = {1, 8, 32, 128, 512, 2048, 8192};
const TableRow kTable[] = {
    {"DeepSeek-V3 TP8",
     256,
     7168,
     256,
     8,
     {9.2, 65.9, 187.6, 289.6, 298.0, 311.1, 364.6},
     {0, 0, 0, 0, 0, 0, 1}},
    {"DeepSeek-V3 TP4",
     256,
     7168,
     512,
     8,
     {18.4, 131.8, 375.0, 578.5, 592.9, 609.9, 729.2},
     {0, 0, 0, 0, 0, 0, 1}},
    {"DeepSeek-V3 TP2",
     256,
     7168,
     1024,
     8,
     {36.7, 263.5, 749.7, 1156.3, 1182.7, 1207.6, 1458.4},
     {0, 0, 0, 0, 0, 0, 1}},
    {"Kimi-K2 TP8",
     384,
     7168,
     256,
     8,
     {9.2, 68.3, 216.2, 411.7, 444.8, 457.9, 510.3},
     {0, 0, 0, 0, 0, 0, 0}},
    {"Qwen3-30B-A3B TP1",
     128,
     2048,
     768,
     8,
     {7.9, 50.8, 110.2, 127.0, 130.6, 145.1, 312.5},
     {0, 0, 0, 0, 0, 0, 1}},
    {"Qwen3-235B-A22B TP4",
     128,
     4096,
     384,
     8,
     {7.9, 50.8, 110.1, 126.7, 129.5, 140.7, 312.5},
     {0, 0, 0, 0, 0, 0, 1}},
    {"Qwen3-Coder-480B TP4",
     160,
     6144,
     640,
     8,
     {19.7, 132.4, 317.4, 394.1, 399.1, 416.8, 781.3},
     {0, 0, 0, 0, 0, 0, 1}},
    {"Qwen3-Next-80B TP2",
     512,
     2048,
     256,
     10,
     {3.3, 24.5, 78.7, 155.0, 170.3, 177.8, 208.0},
     {0, 0, 0, 0, 0, 0, 0}},
    {"GLM-4.5 TP8",
     160,
     5120,
     192,
     8,
     {4.9, 33.1, 79.5, 99.0, 101.5, 111.0, 195.3},
     {0, 0, 0, 0, 0, 0, 1}},
    {"MiniMax-M2 TP4",
     256,
     3072,
     384,
     8,
     {5.9, 42.4, 120.6, 186.3, 192.0, 201.9, 241.2},
     {0, 0, 0, 0, 0, 0, 0}},
    {"Mixtral-8x7B TP1",
     8,
     4096,
     14336,
     2,
     {73.4, 264.5, 294.8, 298.6, 313.7, 729.2, 2916.8},
     {0, 0, 0, 0, 0, 1, 1}},
    {"Mixtral-8x22B TP2",
     8,
     6144,
     8192,
     2,
     {62.9, 226.7, 252.5, 254.9, 264.8, 625.0, 2500.2},
     {0, 0, 0, 0, 0, 1, 1}},
    {"Llama-4-Maverick TP8",
     128,
     5120,
     1024,
     1,
     {3.3, 25.6, 93.3, 266.4, 414.7, 430.8, 464.9},
     {0, 0, 0, 0, 0, 0, 0}},
};

RooflineLayer table_layer(const TableRow& r) {
  RooflineLayer L;
  L.num_experts = r.E;
  L.num_local_experts = r.E;
  L.topk = r.topk;
  L.hidden = r.K;
  L.intermediate = r.N;
  L.useful_intermediate = static_cast<double>(r.N);
  L.expert_weight_bytes = 3.0 * static_cast<double>(r.N * r.K);  // fp8 w13 (2N x K) + w2 (K x N)
  L.expert_scale_bytes = 0;
  L.count_scales = false;  // the table's model
  return L;
}

// The table rounds to 0.1 us.
void expect_table_cell(double us, double table, const std::string& where) {
  EXPECT_LE(std::fabs(us - table), 0.05 + 1e-9) << where << ": " << us << " vs " << table;
}

TEST(Roofline, ReproducesModelsMdTable) {
  const GpuCard& h200 = gpu_card("H200");
  EXPECT_DOUBLE_EQ(h200.hbm_bytes_per_s, 4.8e12);
  EXPECT_DOUBLE_EQ(h200.fp8_flops, 1.979e15);
  for (const TableRow& r : kTable) {
    for (int i = 0; i < 7; ++i) {
      const RooflinePoint p = roofline_point(table_layer(r), h200, kTableTokens[i]);
      const std::string where = fmt::format("{} M={}", r.name, kTableTokens[i]);
      expect_table_cell(p.floor_s * 1e6, r.us[i], where);
      EXPECT_EQ(p.compute_bound, r.compute[i]) << where;
      EXPECT_DOUBLE_EQ(p.flops, 6.0 * kTableTokens[i] * r.topk * r.N * r.K) << where;
    }
  }
}

TEST(Roofline, TableNeedsActivationsAndIntermediates) {
  // Guards the reading of the table above: weights alone miss it by more than its rounding.
  const TableRow& mix = kTable[10];
  ASSERT_STREQ(mix.name, "Mixtral-8x7B TP1");
  RooflineLayer L = table_layer(mix);
  L.count_intermediate = false;
  const RooflinePoint p = roofline_point(L, gpu_card("H200"), 512);
  EXPECT_GT(std::fabs(p.floor_s * 1e6 - 313.7), 1.0);
  // Weights: all 8 experts x 3 x 14336 x 4096 bytes; activations: 512 x 2 x 4096 x 2 bytes.
  EXPECT_NEAR(p.experts_touched, 8.0, 1e-9);
  EXPECT_DOUBLE_EQ(p.weight_bytes, 8.0 * 3 * 14336 * 4096);
  EXPECT_DOUBLE_EQ(p.activation_bytes, 512.0 * 2 * 4096 * 2);
  EXPECT_EQ(p.intermediate_bytes, 0);
}

ModelConfig real(const std::string& name) {
  return load_model_config(std::string(FP8MOE_SOURCE_DIR) + "/examples/configs/" + name);
}

ModelPlan plan(const ModelConfig& m, const std::string& platform, int tp, int ep = 0, int dp = 1,
               std::string backend = "auto", std::optional<GpuCard> card = gpu_card("H200")) {
  PlanOptions o;
  o.parallel.tp = tp;
  o.parallel.dp = dp;
  o.parallel.ep = ep;
  o.parallel.tp_given = !(ep > 0 && tp == 1);
  o.moe_backend = std::move(backend);
  o.card = std::move(card);
  o.roofline_tokens.assign(std::begin(kTableTokens), std::end(kTableTokens));
  return plan_model(m, nullptr, o, Platform::parse(platform), OracleEnv());
}

const ShapeRoofline& roofline_of(const ModelPlan& p) {
  EXPECT_EQ(p.shapes.size(), 1u) << p.error;
  EXPECT_TRUE(p.shapes.at(0).roofline.has_value());
  return *p.shapes.at(0).roofline;
}

// The planner's numbers for the real configs: with scales not counted they are the table's; with
// them (the plan's default) they are at most 0.03% above it (128x128 fp32 block scales, per-tensor
// scales).
void expect_plan_matches_table(const ModelPlan& p, const TableRow& r) {
  ASSERT_TRUE(p.ok()) << r.name;
  const ShapeRoofline& R = roofline_of(p);
  ASSERT_EQ(R.points.size(), 7u);
  EXPECT_EQ(R.layer.intermediate, r.N) << r.name;
  EXPECT_EQ(R.layer.num_local_experts, r.E) << r.name;
  EXPECT_DOUBLE_EQ(R.layer.expert_weight_bytes, 3.0 * static_cast<double>(r.N * r.K)) << r.name;
  EXPECT_GT(R.layer.expert_scale_bytes, 0) << r.name;
  EXPECT_LT(R.layer.expert_scale_bytes, 3e-4 * R.layer.expert_weight_bytes) << r.name;
  RooflineLayer no_scales = R.layer;
  no_scales.count_scales = false;
  for (int i = 0; i < 7; ++i) {
    const std::string where = fmt::format("{} (plan) M={}", r.name, kTableTokens[i]);
    const RooflinePoint& q = R.points[i];
    EXPECT_EQ(q.tokens, kTableTokens[i]);
    EXPECT_EQ(q.compute_bound, r.compute[i]) << where;
    expect_table_cell(roofline_point(no_scales, *p.card, kTableTokens[i]).floor_s * 1e6, r.us[i],
                      where);
    EXPECT_GE(q.floor_s * 1e6, r.us[i] - 0.05) << where;
    EXPECT_LE(q.floor_s * 1e6, r.us[i] * 1.0003 + 0.05) << where;
  }
  // Whole-model MoE step = layers x floor; decode tokens/s = M / step.
  double step = 0;
  ASSERT_TRUE(p.moe_step_s(0, step));
  EXPECT_DOUBLE_EQ(step, R.num_layers * R.points[0].floor_s);
}

TEST(Roofline, PlanDeepSeekV3Tp8MatchesTable) {
  const ModelPlan p = plan(real("DeepSeek-V3"), "cuda:90", 8);
  expect_plan_matches_table(p, kTable[0]);
  EXPECT_EQ(roofline_of(p).num_layers, 58);
  EXPECT_NE(roofline_of(p).layout.find("TP8: every GPU holds all 256 experts"), std::string::npos);
}

TEST(Roofline, PlanQwen3_30B_Tp1MatchesTable) {
  expect_plan_matches_table(plan(real("Qwen3-30B-A3B-FP8"), "cuda:90", 1), kTable[4]);
}

TEST(Roofline, PlanMixtralTp1MatchesTable) {  // per-tensor scales
  expect_plan_matches_table(plan(real("Mixtral-8x7B-Instruct-v0.1-FP8"), "cuda:90", 1), kTable[10]);
}

TEST(Roofline, PlanDeepSeekV3Tp4MatchesTable) {
  expect_plan_matches_table(plan(real("DeepSeek-V3"), "cuda:90", 4), kTable[1]);
}

TEST(Roofline, PaddingCostsBytesAndFlops) {
  // Qwen3-30B at TP4 with flashinfer_trtllm on cuda:100 pads 192 rows per rank to W = 256.
  const ModelPlan p =
      plan(real("Qwen3-30B-A3B-FP8"), "cuda:100", 4, 0, 1, "flashinfer_trtllm", gpu_card("B200"));
  ASSERT_TRUE(p.ok());
  ASSERT_TRUE(p.shapes[0].padded);
  const ShapeRoofline& R = roofline_of(p);
  EXPECT_EQ(R.layer.intermediate, 256);
  EXPECT_DOUBLE_EQ(R.layer.useful_intermediate, 192.0);
  for (const RooflinePoint& q : R.points) {
    // FLOPs and weights at W = 256 rows, a quarter of them padding.
    EXPECT_DOUBLE_EQ(q.flops, 6.0 * q.tokens * 8 * 256 * 2048);
    EXPECT_DOUBLE_EQ(q.padding_flops, 0.25 * q.flops);
    EXPECT_DOUBLE_EQ(q.weight_bytes, q.experts_touched * 3 * 256 * 2048);
    EXPECT_DOUBLE_EQ(q.padding_bytes, 0.25 * (q.weight_bytes + q.intermediate_bytes));
  }
  // The same shape unpadded (the auto backend refines instead): a lower floor at every M.
  const ModelPlan r =
      plan(real("Qwen3-30B-A3B-FP8"), "cuda:100", 4, 0, 1, "auto", gpu_card("B200"));
  ASSERT_TRUE(r.ok());
  ASSERT_FALSE(r.shapes[0].padded);
  const ShapeRoofline& U = roofline_of(r);
  EXPECT_EQ(U.layer.intermediate, 192);
  for (std::size_t i = 0; i < U.points.size(); ++i) {
    EXPECT_EQ(U.points[i].padding_flops, 0);
    EXPECT_LT(U.points[i].floor_s, R.points[i].floor_s);
  }
}

TEST(Roofline, ExpertParallelHoldsAShareOfTheExperts) {
  // DeepSeek-V3 --ep 8: 32 experts of 2048 rows per GPU; every GPU sees the same M tokens and
  // computes the ~M x 8 x 32/256 = M pairs routed to its experts.
  const ModelPlan p = plan(real("DeepSeek-V3"), "cuda:90", 1, 8);
  ASSERT_TRUE(p.ok()) << p.error;
  const ShapeRoofline& R = roofline_of(p);
  EXPECT_EQ(R.layer.num_local_experts, 32);
  EXPECT_EQ(R.layer.intermediate, 2048);
  EXPECT_EQ(R.layer.token_factor, 1);
  EXPECT_NE(R.layout.find("EP8"), std::string::npos) << R.layout;
  for (const RooflinePoint& q : R.points) {
    EXPECT_EQ(q.moe_tokens, q.tokens);
    EXPECT_DOUBLE_EQ(q.routed_pairs, static_cast<double>(q.tokens));
    EXPECT_NEAR(q.experts_touched, 32 * (1 - std::pow(1 - 8.0 / 256, q.tokens)), 1e-9);
    EXPECT_DOUBLE_EQ(q.flops, 6.0 * q.tokens * 2048 * 7168);
  }
  // Same FLOPs per GPU as TP8 (the same work split differently); at M=1 one expert of 8x the rows.
  const ModelPlan tp = plan(real("DeepSeek-V3"), "cuda:90", 8);
  EXPECT_DOUBLE_EQ(R.points[0].flops, roofline_of(tp).points[0].flops);
  EXPECT_NEAR(R.points[0].weight_bytes, roofline_of(tp).points[0].weight_bytes, 1e-3);
}

TEST(Roofline, DataParallelTokensAreAllGathered) {
  // dp 4 x tp 2 with EP: 8 EP ranks, each MoE sees the 4 DP groups' tokens.
  const ModelPlan p = plan(real("DeepSeek-V3"), "cuda:90", 2, 8, 4);
  ASSERT_TRUE(p.ok()) << p.error;
  const ShapeRoofline& R = roofline_of(p);
  EXPECT_EQ(R.layer.token_factor, 4);
  EXPECT_NE(R.layout.find("T = 4 x M"), std::string::npos) << R.layout;
  for (const RooflinePoint& q : R.points) {
    EXPECT_EQ(q.moe_tokens, 4 * q.tokens);
    EXPECT_DOUBLE_EQ(q.routed_pairs, 4.0 * q.tokens);
  }
}

TEST(Roofline, UnevenExpertParallelUsesTheBusiestRank) {
  // 8 experts over 3 EP ranks: 3, 3, 2 (vLLM's linear placement): the floor is the 3-expert rank's.
  const ModelPlan p = plan(real("Mixtral-8x7B-Instruct-v0.1-FP8"), "cuda:90", 1, 3);
  ASSERT_FALSE(p.shapes.empty()) << p.error;
  ASSERT_TRUE(p.shapes[0].roofline.has_value());
  EXPECT_EQ(p.shapes[0].roofline->layer.num_local_experts, 3);
}

TEST(Roofline, NoCardNoRoofline) {
  const ModelPlan p = plan(real("DeepSeek-V3"), "cuda:90", 8, 0, 1, "auto", std::nullopt);
  ASSERT_TRUE(p.ok());
  EXPECT_FALSE(p.shapes[0].roofline.has_value());
  double step = 1;
  EXPECT_FALSE(p.moe_step_s(0, step));
  const auto j = plan_to_json(p);
  EXPECT_TRUE(j["card"].is_null());
  EXPECT_TRUE(j["shapes"][0]["roofline"].is_null());
}

TEST(Roofline, JsonCarriesThePoints) {
  const ModelPlan p = plan(real("DeepSeek-V3"), "cuda:90", 8);
  const auto j = plan_to_json(p);
  EXPECT_EQ(j["card"]["name"], "H200");
  const auto& r = j["shapes"][0]["roofline"];
  ASSERT_TRUE(r.is_object());
  EXPECT_EQ(r["lower_bound"], true);
  EXPECT_EQ(r["layers"], 58);
  ASSERT_EQ(r["points"].size(), 7u);
  EXPECT_EQ(r["points"][6]["bound"], "compute");
  EXPECT_EQ(r["points"][0]["bound"], "memory");
  EXPECT_NEAR(r["points"][0]["floor_us"].get<double>(), 9.2, 0.05);
  EXPECT_NEAR(r["points"][0]["tokens_per_s"].get<double>(),
              1.0 / (58 * r["points"][0]["floor_us"].get<double>() * 1e-6), 1e-6);
}

TEST(Roofline, CardTable) {
  for (const char* n : {"H100", "H100-PCIe", "H800", "H200", "H20", "B200", "MI300X"}) {
    const GpuCard& c = gpu_card(n);
    EXPECT_EQ(c.name, n);
    EXPECT_GT(c.hbm_bytes_per_s, 0);
    EXPECT_GT(c.fp8_flops, c.bf16_flops);
    EXPECT_FALSE(c.custom);
    EXPECT_FALSE(c.source.empty());
  }
  EXPECT_EQ(gpu_card("h200").name, "H200");
  EXPECT_EQ(gpu_card("H100-SXM").name, "H100");
  EXPECT_DOUBLE_EQ(gpu_card("H100").hbm_bytes_per_s, 3.35e12);
  EXPECT_DOUBLE_EQ(gpu_card("B200").hbm_bytes_per_s, 8e12);
  EXPECT_DOUBLE_EQ(gpu_card("B200").fp8_flops, 4.5e15);
  EXPECT_DOUBLE_EQ(gpu_card("MI300X").hbm_bytes_per_s, 5.3e12);
  EXPECT_NEAR(gpu_card("MI300X").fp8_flops, 2.615e15, 1e12);
  EXPECT_EQ(gpu_card("H200").describe(), "H200 (spec sheet: 4.8 TB/s HBM, 1979 TFLOP/s dense FP8)");
}

TEST(Roofline, CardOfADeviceName) {
  auto name = [](const char* device) {
    const GpuCard* c = gpu_card_for_device(device);
    return c ? c->name : std::string("none");
  };
  EXPECT_EQ(name("NVIDIA H200"), "H200");
  EXPECT_EQ(name("NVIDIA H100 80GB HBM3"), "H100");
  EXPECT_EQ(name("NVIDIA H100 PCIe"), "H100-PCIe");
  EXPECT_EQ(name("NVIDIA H800"), "H800");
  EXPECT_EQ(name("NVIDIA H20"), "H20");
  EXPECT_EQ(name("NVIDIA B200"), "B200");
  EXPECT_EQ(name("AMD Instinct MI300X"), "MI300X");
  // Other peaks than the card of the same family: not guessed.
  EXPECT_EQ(name("NVIDIA H200 NVL"), "none");
  EXPECT_EQ(name("NVIDIA H100 NVL"), "none");
  EXPECT_EQ(name("NVIDIA GH200 480GB"), "none");
  EXPECT_EQ(name("NVIDIA GeForce RTX 4090"), "none");
}

TEST(Roofline, DefaultCardOfASimulatedPlatform) {
  EXPECT_EQ(default_gpu_card(Platform::parse("cuda:90"))->name, "H200");
  EXPECT_EQ(default_gpu_card(Platform::parse("cuda:100"))->name, "B200");
  EXPECT_EQ(default_gpu_card(Platform::parse("cuda:89")), nullptr);
  EXPECT_EQ(default_gpu_card(Platform::parse("rocm:gfx942")), nullptr);
  EXPECT_EQ(default_gpu_card(Platform::parse("cpu")), nullptr);
}

TEST(Roofline, BadCards) {
  EXPECT_TRUE(throws_with<ValueError>([] { gpu_card("H300"); },
                                      {"unknown card 'H300': expected one of H100, H100-PCIe"}));
  EXPECT_TRUE(throws_with<ValueError>([] { gpu_card(""); }, {"MI300X"}));
  const double inf = std::numeric_limits<double>::infinity();
  const double nan = std::numeric_limits<double>::quiet_NaN();
  EXPECT_TRUE(throws_with<ValueError>([] { custom_gpu_card(0, 1000); }, {"--card-bw"}));
  EXPECT_TRUE(throws_with<ValueError>([] { custom_gpu_card(-1, 1000); }, {"--card-bw"}));
  EXPECT_TRUE(throws_with<ValueError>([&] { custom_gpu_card(inf, 1000); }, {"--card-bw"}));
  EXPECT_TRUE(throws_with<ValueError>([&] { custom_gpu_card(nan, 1000); }, {"--card-bw"}));
  EXPECT_TRUE(throws_with<ValueError>([] { custom_gpu_card(4.8, 0); }, {"--card-fp8"}));
  EXPECT_TRUE(throws_with<ValueError>([&] { custom_gpu_card(4.8, inf); }, {"--card-fp8"}));
  const GpuCard c = custom_gpu_card(4.8, 1979);
  EXPECT_TRUE(c.custom);
  EXPECT_DOUBLE_EQ(c.hbm_bytes_per_s, 4.8e12);
  EXPECT_DOUBLE_EQ(c.fp8_flops, 1.979e15);
  // A custom card with H200's peaks gives H200's floors.
  const RooflineLayer L = table_layer(kTable[0]);
  EXPECT_DOUBLE_EQ(roofline_point(L, c, 8).floor_s, roofline_point(L, gpu_card("H200"), 8).floor_s);
}

TEST(Roofline, BadLayers) {
  const GpuCard& h200 = gpu_card("H200");
  RooflineLayer L = table_layer(kTable[0]);
  EXPECT_TRUE(
      throws_with<ValueError>([&] { roofline_point(L, h200, 0); }, {"tokens must be >= 1"}));
  L.topk = 300;
  EXPECT_TRUE(throws_with<ValueError>([&] { roofline_point(L, h200, 1); }, {"topk"}));
  L = table_layer(kTable[0]);
  L.num_local_experts = 257;
  EXPECT_TRUE(throws_with<ValueError>([&] { roofline_point(L, h200, 1); }, {"num_local_experts"}));
  L = table_layer(kTable[0]);
  L.useful_intermediate = 300;  // more real rows than executed ones
  EXPECT_TRUE(
      throws_with<ValueError>([&] { roofline_point(L, h200, 1); }, {"useful_intermediate"}));
}

TEST(Roofline, WeightOnlyAndAllExpertsEdgeCases) {
  // top-k == E (every expert every token) and the BF16 peak for weight-only compute.
  RooflineLayer L = table_layer(kTable[10]);
  L.topk = 8;
  const RooflinePoint p = roofline_point(L, gpu_card("H200"), 1);
  EXPECT_DOUBLE_EQ(p.experts_touched, 8.0);
  L.topk = 2;
  L.fp8_compute = false;
  const RooflinePoint q = roofline_point(L, gpu_card("H200"), 8192);
  EXPECT_DOUBLE_EQ(q.compute_s, q.flops / 989e12);
}

}  // namespace
}  // namespace fp8moe
