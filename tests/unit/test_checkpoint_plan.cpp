// The deployment planner on the real models' configs (examples/configs) and on the example
// checkpoint: the pinned answers of issue 4 (Qwen3-30B-A3B-FP8 at TP4 refines to 64x64 with auto
// and pads with flashinfer_trtllm; DeepSeek-V3 at TP8 keeps 128x128), pitfalls 1-3, memory and
// FLOPs, the header cross-check, and that planning never reads a weight byte.
#include <gtest/gtest.h>

#include <string>

#include "fp8moe/checkpoint.hpp"
#include "fp8moe/error.hpp"
#include "test_checkpoint_util.hpp"

namespace fp8moe {
namespace {

using test::TempDir;
using test::throws_with;

ModelConfig real(const std::string& name) {
  return load_model_config(std::string(FP8MOE_SOURCE_DIR) + "/examples/configs/" + name);
}

ModelPlan plan(const ModelConfig& m, const std::string& platform, int tp,
               std::string backend = "auto", int ep = 0,
               const SafetensorsCheckpoint* ck = nullptr) {
  PlanOptions o;
  o.parallel.tp = tp;
  o.parallel.ep = ep;
  o.parallel.tp_given = !(ep > 0 && tp == 1);  // "--ep 8" alone means 8 EP ranks
  o.moe_backend = std::move(backend);
  return plan_model(m, ck, o, Platform::parse(platform), OracleEnv());
}

// One example checkpoint shared by the tests that need real safetensors.
class PlanExample : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new TempDir();
    write_example_checkpoint(dir_->path());
  }
  static void TearDownTestSuite() {
    delete dir_;
    dir_ = nullptr;
  }
  static const std::string& path() { return dir_->path(); }
  static TempDir* dir_;
};
TempDir* PlanExample::dir_ = nullptr;

const ShapePlan& only(const ModelPlan& p) {
  static const ShapePlan none;
  EXPECT_EQ(p.shapes.size(), 1u) << p.error;
  return p.shapes.empty() ? none : p.shapes.front();
}

TEST(Plan, Qwen3_30B_Tp4AutoRefinesTo64) {  // pinned case, pitfall 1
  const ModelPlan p = plan(real("Qwen3-30B-A3B-FP8"), "cuda:90", 4);
  ASSERT_TRUE(p.ok()) << only(p).error_message;
  const ShapePlan& s = only(p);
  EXPECT_EQ(s.resolution, "refine");
  EXPECT_EQ(s.block, (std::array<int64_t, 2>{64, 64}));
  EXPECT_EQ(s.refine, (std::array<int64_t, 2>{2, 2}));
  EXPECT_FALSE(s.padded);
  EXPECT_EQ(s.weight_key, create_fp8_quant_key(true, GroupShape(64, 64)));
  EXPECT_EQ(s.activation_key, kFp8Dynamic128Sym);
  EXPECT_EQ(s.selection.backend, Fp8MoeBackend::kTriton);
  ASSERT_NE(s.selection.kernel, nullptr);
  EXPECT_STREQ(s.selection.kernel->name, "TritonExperts");
  EXPECT_EQ(s.moe_config.intermediate_size_per_partition, 192);
  EXPECT_EQ(s.padding_overhead(), 0.0);
  EXPECT_NE(s.quant_config.find("block_shape=[64, 64]"), std::string::npos) << s.quant_config;
  // Per GPU: 128 experts x (2*192*2048 + 2048*192) fp8 + (2*3*32 + 32*3) f32 scales, 48 layers.
  const uint64_t per_layer = 128ull * (3ull * 192 * 2048) + 128ull * 4 * (2 * 3 * 32 + 32 * 3);
  EXPECT_EQ(s.max_rank_bytes_per_layer, per_layer);
  EXPECT_EQ(p.max_rank_bytes(), 48 * per_layer);
  EXPECT_EQ(s.ranks.size(), 4u);
}

TEST(Plan, Qwen3_30B_Tp4FlashinferTrtllmPads) {  // pinned case, pitfall 1
  const ModelPlan p = plan(real("Qwen3-30B-A3B-FP8"), "cuda:100", 4, "flashinfer_trtllm");
  ASSERT_TRUE(p.ok()) << only(p).error_message;
  const ShapePlan& s = only(p);
  EXPECT_EQ(s.resolution, "pad");
  EXPECT_TRUE(s.padded);
  EXPECT_EQ(s.block, (std::array<int64_t, 2>{128, 128}));
  EXPECT_EQ(s.weight_key, kFp8Static128BlockSym);
  EXPECT_EQ(s.moe_config.intermediate_size_per_partition, 256);
  EXPECT_TRUE(s.moe_config.tp_shard_with_padding);
  EXPECT_EQ(s.selection.backend, Fp8MoeBackend::kFlashinferTrtllm);
  // 768 rows over 4 ranks of 256: the last rank holds only padding.
  ASSERT_EQ(s.ranks.size(), 4u);
  EXPECT_EQ(s.ranks[0].valid_intermediate, 256);
  EXPECT_EQ(s.ranks[2].valid_intermediate, 256);
  EXPECT_EQ(s.ranks[3].valid_intermediate, 0);
  EXPECT_NEAR(s.padding_overhead(), 1.0 / 3.0, 1e-12);
  // The loader's shard for a rank follows the plan.
  const TpShard sh = plan_tp_shard(s, 3);
  EXPECT_EQ(sh.mode, TpShardMode::kPad);
  EXPECT_EQ(sh.valid_size(), 0);
}

TEST(Plan, PadThenSelectionFailsOnHopperForTrtllm) {
  const ModelPlan p = plan(real("Qwen3-30B-A3B-FP8"), "cuda:90", 4, "flashinfer_trtllm");
  EXPECT_FALSE(p.ok());
  const ShapePlan& s = only(p);
  EXPECT_EQ(s.resolution, "pad");
  EXPECT_EQ(s.failed_step, "select");
  EXPECT_EQ(s.error_kind, "ValueError");
  EXPECT_NE(s.error_message.find("FLASHINFER_TRTLLM does not support the deployment configuration"),
            std::string::npos)
      << s.error_message;
  EXPECT_FALSE(s.selection.trace.empty());  // the progress explains the failure
}

TEST(Plan, DeepSeekV3Tp8Keeps128) {  // pinned case
  const ModelPlan p = plan(real("DeepSeek-V3"), "cuda:90", 8);
  ASSERT_TRUE(p.ok()) << only(p).error_message;
  const ShapePlan& s = only(p);
  EXPECT_EQ(s.resolution, "keep");
  EXPECT_EQ(s.block, (std::array<int64_t, 2>{128, 128}));
  EXPECT_FALSE(s.refine.has_value());
  EXPECT_EQ(s.weight_key, kFp8Static128BlockSym);
  EXPECT_EQ(s.selection.backend, Fp8MoeBackend::kTriton);  // SM90 + block keys, no EP: Triton first
  EXPECT_EQ(s.layers.size(), 58u);
  const uint64_t per_layer = 256ull * 3 * 256 * 7168 + 256ull * 4 * (2 * 2 * 56 + 56 * 2);
  EXPECT_EQ(s.max_rank_bytes_per_layer, per_layer);
  EXPECT_EQ(p.max_rank_bytes(), 58 * per_layer);
}

TEST(Plan, DeepSeekV3Ep8PrefersFlashinferCutlassOnHopper) {
  const ModelPlan p = plan(real("DeepSeek-V3"), "cuda:90", 1, "auto", 8);
  ASSERT_TRUE(p.ok()) << only(p).error_message;
  const ShapePlan& s = only(p);
  EXPECT_TRUE(s.moe_config.use_ep());
  EXPECT_EQ(s.moe_config.num_local_experts, 32);
  EXPECT_EQ(s.moe_config.intermediate_size_per_partition, 2048);
  EXPECT_EQ(s.selection.backend, Fp8MoeBackend::kFlashinferCutlass);
  EXPECT_EQ(p.world_size, 8);
  EXPECT_EQ(s.ranks.size(), 8u);
  for (const auto& r : s.ranks) EXPECT_EQ(r.num_local_experts, 32);
}

TEST(Plan, UnevenEpPlacementShowsPerRankExperts) {  // pitfall 22
  const ModelPlan p = plan(real("Qwen3-30B-A3B-FP8"), "cuda:90", 1, "auto", 6);
  const ShapePlan& s = only(p);
  ASSERT_EQ(s.ranks.size(), 6u);
  const std::vector<int> expect = {22, 22, 21, 21, 21, 21};
  for (int r = 0; r < 6; ++r) EXPECT_EQ(s.ranks[r].num_local_experts, expect[r]);
  EXPECT_EQ(s.max_rank_bytes_per_layer, s.ranks[0].weight_bytes + s.ranks[0].scale_bytes);
}

TEST_F(PlanExample, I640Tp8NeedsPaddingOrExpertParallel) {  // pitfall 3
  const ModelConfig m = load_model_config(path());
  ModelPlan p = plan(m, "cuda:90", 4);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(only(p).resolution, "refine");
  EXPECT_EQ(only(p).block, (std::array<int64_t, 2>{32, 32}));
  p = plan(m, "cuda:90", 8);
  EXPECT_FALSE(p.ok());
  EXPECT_EQ(only(p).failed_step, "validate");
  EXPECT_NE(only(p).error_message.find("--enable-expert-parallel"), std::string::npos);
  EXPECT_NE(
      only(p).error_message.find("= 80 is not divisible by weight quantization block_n = 128"),
      std::string::npos);
  p = plan(m, "cuda:100", 8, "flashinfer_trtllm");
  ASSERT_TRUE(p.ok()) << only(p).error_message;
  EXPECT_EQ(only(p).resolution, "pad");
  EXPECT_NEAR(only(p).padding_overhead(), 1024.0 / 640.0 - 1.0, 1e-12);
  p = plan(m, "cuda:90", 1, "auto", 8);
  EXPECT_TRUE(p.ok());
  EXPECT_EQ(only(p).resolution, "keep");
}

TEST(Plan, LargerQwenModelsRefineAtTp8) {
  for (const char* name : {"Qwen3-235B-A22B-FP8", "Qwen3-Coder-480B-A35B-Instruct-FP8"}) {
    SCOPED_TRACE(name);
    const ModelPlan p = plan(real(name), "cuda:90", 8);
    ASSERT_TRUE(p.ok()) << only(p).error_message;
    EXPECT_EQ(only(p).resolution, "refine");
    EXPECT_EQ(only(p).block, (std::array<int64_t, 2>{64, 64}));
  }
  const ModelPlan p = plan(real("Qwen3-235B-A22B-FP8"), "cuda:90", 4);
  EXPECT_EQ(only(p).resolution, "keep");
}

TEST(Plan, CompressedTensorsAndPerTensorCallers) {
  ModelPlan p = plan(real("GLM-4.5-FP8"), "cuda:90", 8);
  ASSERT_TRUE(p.ok()) << only(p).error_message;
  EXPECT_EQ(only(p).resolution, "none");
  EXPECT_EQ(only(p).weight_key, kFp8StaticChannelSym);
  EXPECT_EQ(only(p).activation_key, kFp8DynamicTokenSym);
  EXPECT_TRUE(only(p).allow_vllm_cutlass);
  EXPECT_EQ(only(p).selection.backend, Fp8MoeBackend::kVllmCutlass);
  p = plan(real("Mixtral-8x7B-Instruct-v0.1-FP8"), "cuda:90", 2);
  ASSERT_TRUE(p.ok()) << only(p).error_message;
  EXPECT_EQ(only(p).weight_key, kFp8StaticTensorSym);
  EXPECT_EQ(only(p).activation_key, kFp8StaticTensorSym);
  EXPECT_EQ(only(p).selection.backend, Fp8MoeBackend::kFlashinferCutlass);
  p = plan(real("Llama-4-Maverick-17B-128E-Instruct-FP8"), "cuda:90", 8);
  EXPECT_EQ(only(p).layers.size(), 24u);
  EXPECT_EQ(only(p).moe_config.routing_method, RoutingMethodType::kLlama4);
}

TEST(Plan, NotFp8CheckpointsSayWhy) {
  const ModelPlan p = plan(real("gpt-oss-120b"), "cuda:90", 2);
  EXPECT_FALSE(p.ok());
  EXPECT_EQ(only(p).failed_step, "fp8");
  EXPECT_NE(only(p).error_message.find("Mxfp4MoEMethod"), std::string::npos);
  EXPECT_GT(only(p).max_rank_bytes_per_layer, 0u);
}

TEST(Plan, Ue8m0CheckpointsGetANote) {
  const ModelPlan p = plan(real("DeepSeek-V3.1"), "cuda:90", 8);
  ASSERT_TRUE(p.ok());
  bool found = false;
  for (const auto& n : only(p).notes) found = found || n.find("UE8M0") != std::string::npos;
  EXPECT_TRUE(found);
}

TEST(Plan, InvalidLayoutsAreRecorded) {
  ModelPlan p = plan(real("DeepSeek-V3"), "cuda:90", 4, "auto", 8);
  EXPECT_FALSE(p.ok());
  EXPECT_NE(p.error.find("--ep 8 does not match dp*pcp*tp"), std::string::npos);
  p = plan(real("DeepSeek-V3"), "cuda:90", 3);
  EXPECT_FALSE(p.ok());
  EXPECT_EQ(only(p).failed_step, "parallel");
  // An unknown --moe-backend fails where vLLM's map_fp8_backend raises, with its text.
  p = plan(real("Qwen3-30B-A3B-FP8"), "cuda:90", 4, "warp_drive");
  EXPECT_EQ(only(p).failed_step, "resolve");
  EXPECT_NE(only(p).error_message.find("moe_backend='warp_drive' is not supported for FP8 MoE"),
            std::string::npos);
  // Padding that vLLM refuses (EP with an explicit non-Triton backend is not pure TP) is recorded.
  PlanOptions lora;
  lora.parallel.tp = 4;
  lora.moe_backend = "flashinfer_trtllm";
  lora.lora = true;
  p = plan_model(real("Qwen3-30B-A3B-FP8"), nullptr, lora, Platform::parse("cuda:100"),
                 OracleEnv());
  EXPECT_EQ(only(p).failed_step, "resolve");
  EXPECT_EQ(only(p).resolution, "pad");
  EXPECT_NE(only(p).error_message.find("Block-aligned FP8 TP sharding requires 128-aligned global "
                                       "expert dimensions, pure TP, and no LoRA or expert bias."),
            std::string::npos)
      << only(p).error_message;
}

TEST_F(PlanExample, ReadsHeadersOnlyAndCrossChecksThem) {
  const ModelConfig m = load_model_config(path());
  const SafetensorsCheckpoint ck = SafetensorsCheckpoint::open(path());
  const ModelPlan p = plan(m, "cuda:90", 4, "auto", 0, &ck);
  ASSERT_TRUE(p.ok());
  EXPECT_TRUE(p.headers_read);
  EXPECT_FALSE(p.weight_bytes_read);
  EXPECT_FALSE(ck.any_data_mapped());
  EXPECT_NE(only(p).checkpoint.find("96 expert tensors of 2 layer(s)"), std::string::npos)
      << only(p).checkpoint;
  const auto j = plan_to_json(p);
  EXPECT_EQ(j["ok"], true);
  EXPECT_EQ(j["checkpoint"]["weight_bytes_read"], false);
  EXPECT_EQ(j["shapes"][0]["block_resolution"]["mode"], "refine");
  EXPECT_EQ(j["shapes"][0]["selection"]["backend"], "TRITON");
  EXPECT_EQ(j["shapes"][0]["selection"]["kernel"], "TritonExperts");
}

TEST_F(PlanExample, HeaderMismatchesAreNamed) {
  const ModelConfig base = load_model_config(path());
  const SafetensorsCheckpoint ck = SafetensorsCheckpoint::open(path());
  // A config that disagrees with the weights: the first mismatching tensor is named.
  ModelConfig wrong = base;
  wrong.moe_intermediate_size = 512;
  EXPECT_TRUE(throws_with<FormatError>(
      [&] { plan(wrong, "cuda:90", 1, "auto", 0, &ck); },
      {"model.layers.0.mlp.experts.0.gate_proj.weight", "[640, 256]", "[512, 256]"}));
  ModelConfig more = base;
  more.num_experts = 9;
  EXPECT_TRUE(throws_with<FormatError>([&] { plan(more, "cuda:90", 1, "auto", 0, &ck); },
                                       {"missing expert tensor", "experts.8.gate_proj.weight"}));
  ModelConfig blocks = base;
  blocks.quant.weight_block_size = std::array<int64_t, 2>{64, 64};
  EXPECT_TRUE(throws_with<FormatError>([&] { plan(blocks, "cuda:90", 1, "auto", 0, &ck); },
                                       {"weight_scale_inv", "expected [10, 4]"}));
}

}  // namespace
}  // namespace fp8moe
