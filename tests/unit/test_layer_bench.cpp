// The measurement side of `fp8moe bench`: the traffic model against spec/models.md's H200 roofline
// table, the presets (every one parses and plans; random layers run), the ceiling probes, the
// timing loop.
#include <gtest/gtest.h>

#include <array>
#include <cmath>

#include "fp8moe/error.hpp"
#include "fp8moe/layer.hpp"
#include "layer/bench.hpp"

namespace fp8moe {
namespace {

// spec/models.md "Roofline floors for one MoE layer on H200 (us)": (E, K, N, topk) and the floors
// for M = 1, 8, 32, 128, 512, 2048, 8192.
struct FloorRow {
  int64_t E, K, N, topk;
  std::array<double, 7> us;
};
const FloorRow kFloors[] = {
    {256, 7168, 256, 8, {9.2, 65.9, 187.6, 289.6, 298.0, 311.1, 364.6}},
    {256, 7168, 512, 8, {18.4, 131.8, 375.0, 578.5, 592.9, 609.9, 729.2}},
    {256, 7168, 1024, 8, {36.7, 263.5, 749.7, 1156.3, 1182.7, 1207.6, 1458.4}},
    {384, 7168, 256, 8, {9.2, 68.3, 216.2, 411.7, 444.8, 457.9, 510.3}},
    {128, 2048, 768, 8, {7.9, 50.8, 110.2, 127.0, 130.6, 145.1, 312.5}},
    {128, 4096, 384, 8, {7.9, 50.8, 110.1, 126.7, 129.5, 140.7, 312.5}},
    {160, 6144, 640, 8, {19.7, 132.4, 317.4, 394.1, 399.1, 416.8, 781.3}},
    {512, 2048, 256, 10, {3.3, 24.5, 78.7, 155.0, 170.3, 177.8, 208.0}},
    {160, 5120, 192, 8, {4.9, 33.1, 79.5, 99.0, 101.5, 111.0, 195.3}},
    {256, 3072, 384, 8, {5.9, 42.4, 120.6, 186.3, 192.0, 201.9, 241.2}},
    {8, 4096, 14336, 2, {73.4, 264.5, 294.8, 298.6, 313.7, 729.2, 2916.8}},
    {8, 6144, 8192, 2, {62.9, 226.7, 252.5, 254.9, 264.8, 625.0, 2500.2}},
    {128, 5120, 1024, 1, {3.3, 25.6, 93.3, 266.4, 414.7, 430.8, 464.9}},
};

TEST(BenchTraffic, ReproducesTheModelsMdRooflineTable) {
  const int64_t Ms[7] = {1, 8, 32, 128, 512, 2048, 8192};
  for (const auto& r : kFloors) {
    for (int i = 0; i < 7; ++i) {
      const bench::Traffic t = bench::moe_traffic(Ms[i], r.E, r.E, r.topk, r.N, r.K);
      const double us = bench::roofline_seconds(t, 4.8e12, 1.979e15) * 1e6;
      EXPECT_NEAR(us, r.us[i], 0.051)
          << "E " << r.E << " K " << r.K << " N " << r.N << " M " << Ms[i];
    }
  }
}

TEST(BenchTraffic, ExpertParallelShare) {
  // One EP rank of 8 sees 1/8 of the distinct experts, slots and FLOPs; the same x in and out.
  const bench::Traffic all = bench::moe_traffic(64, 256, 256, 8, 2048, 7168);
  const bench::Traffic one = bench::moe_traffic(64, 256, 32, 8, 2048, 7168);
  EXPECT_NEAR(one.distinct_experts * 8, all.distinct_experts, 1e-9);
  EXPECT_NEAR(one.flops * 8, all.flops, 1e-3);
  EXPECT_NEAR(one.weight_bytes * 8, all.weight_bytes, 1e-3);
  // FLOPs = 6 * M * topk * N * K for a gated layer.
  EXPECT_DOUBLE_EQ(all.flops, 6.0 * 64 * 8 * 2048 * 7168);
  // M = 0 touches nothing but still nothing negative.
  const bench::Traffic zero = bench::moe_traffic(0, 8, 8, 2, 16, 16);
  EXPECT_EQ(zero.bytes, 0.0);
}

TEST(BenchPresets, EveryPresetParsesAndPlansForAnH200) {
  ASSERT_GE(bench::bench_presets().size(), 12u);
  Fp8MoeLayerOptions o;
  o.platform = Platform::parse("cuda:90");
  for (const auto& p : bench::bench_presets()) {
    const ModelConfig m = bench::preset_model(p);
    CheckpointLayerRequest req;
    req.tp_size = p.tp_size;
    req.enable_ep = p.enable_ep;
    const Fp8MoeLayerPlan plan = plan_fp8_moe_layer(checkpoint_layer_spec(m, req), o);
    EXPECT_TRUE(plan.ok) << p.name << ": " << plan.failed_step << ": " << plan.error_message;
    EXPECT_NE(plan.selection.backend, Fp8MoeBackend::kNone) << p.name;
    EXPECT_EQ(plan.resolution == "refine" || plan.resolution == "pad", false)
        << p.name << " is a whole-block deployment in models.md";
  }
  // The shapes models.md lists per GPU: (E, N) for a few.
  auto shape = [&](const char* name) {
    const auto& p = bench::find_bench_preset(name);
    CheckpointLayerRequest req;
    req.tp_size = p.tp_size;
    req.enable_ep = p.enable_ep;
    const Fp8MoeLayerPlan plan =
        plan_fp8_moe_layer(checkpoint_layer_spec(bench::preset_model(p), req), o);
    return std::make_pair(plan.num_local_experts, plan.local_intermediate);
  };
  EXPECT_EQ(shape("deepseek-v3-tp8"), std::make_pair(256, int64_t{256}));
  EXPECT_EQ(shape("deepseek-v3-ep8"), std::make_pair(32, int64_t{2048}));
  EXPECT_EQ(shape("qwen3-coder-480b-tp4"), std::make_pair(160, int64_t{640}));
  EXPECT_EQ(shape("glm-4.5-tp8"), std::make_pair(160, int64_t{192}));
  EXPECT_EQ(shape("llama4-maverick-tp8"), std::make_pair(128, int64_t{1024}));
  EXPECT_EQ(shape("mixtral-8x7b-tp2"), std::make_pair(8, int64_t{7168}));
  EXPECT_THROW(bench::find_bench_preset("no-such-model"), ValueError);
}

TEST(BenchPresets, RandomLayerRunsScaledToTheBudget) {
  const auto& p = bench::find_bench_preset("qwen3-next-80b-tp2");
  CheckpointLayerRequest req;
  req.tp_size = p.tp_size;
  Fp8MoeLayerOptions o;
  o.kernel = "ref";
  const bench::RandomLayer r =
      bench::make_random_layer(bench::preset_model(p), req, o, 1, uint64_t{16} << 20);
  EXPECT_EQ(r.scaled_from, 512);
  EXPECT_GE(r.model.num_experts, r.model.num_experts_per_tok);
  EXPECT_LE(r.weight_bytes, uint64_t{16} << 20);
  Fp8MoeLayer layer = Fp8MoeLayer::from_tensors(r.spec, r.weights, o);
  EXPECT_EQ(layer.local_intermediate(), 256);
  Tensor x = Tensor::zeros({1, 2048}, DType::kBF16);
  Tensor logits = Tensor::zeros({1, r.model.num_experts}, DType::kF32);
  Tensor out = Tensor::empty({1, 2048}, DType::kBF16);
  const bench::Timing t = bench::time_forward(layer, x, logits, out, 0.0, 1, 1);
  EXPECT_EQ(t.reps, 1);
  EXPECT_GT(t.median_s, 0.0);
  EXPECT_LE(t.min_s, t.median_s);
}

TEST(BenchCeilings, MeasuredAndPositive) {
  const bench::Ceilings c = bench::measure_cpu_ceilings(0.02);
  EXPECT_TRUE(c.measured);
  EXPECT_GT(c.read_bytes_per_s, 1e8);
  EXPECT_GT(c.fma_flops_per_s, 1e8);
  EXPECT_GE(c.threads, 1);
  EXPECT_FALSE(c.simd_target.empty());
}

}  // namespace
}  // namespace fp8moe
