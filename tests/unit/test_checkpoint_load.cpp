// The example checkpoint and load_moe_layer: determinism, loading every rank of several TP/EP
// layouts and checking the dequantised shards against the dequantised checkpoint bit for bit, the
// coverage check (pitfall 37: a missing or malformed expert tensor is an error naming it, never a
// silently uninitialised weight), and the unsupported layouts.
#include <gtest/gtest.h>

#include <cstring>
#include <fstream>
#include <sstream>

#include "fp8moe/checkpoint.hpp"
#include "fp8moe/error.hpp"
#include "numerics/quant.hpp"
#include "test_checkpoint_util.hpp"

namespace fp8moe {
namespace {

using test::TempDir;
using test::throws_with;

class ExampleCheckpoint : public ::testing::Test {
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
TempDir* ExampleCheckpoint::dir_ = nullptr;

std::string slurp(const std::string& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

TEST_F(ExampleCheckpoint, IsARealShardedQwen3MoeCheckpoint) {
  const ModelConfig m = load_model_config(path());
  EXPECT_EQ(m.family, ModelFamily::kQwen3Moe);
  EXPECT_EQ(m.hidden_size, 256);
  EXPECT_EQ(m.moe_intermediate_size, 640);
  EXPECT_EQ(m.num_experts, 8);
  EXPECT_EQ(m.num_experts_per_tok, 2);
  EXPECT_EQ(m.moe_layers, (std::vector<int>{0, 1}));
  EXPECT_EQ(m.quant.weight_key, kFp8Static128BlockSym);
  EXPECT_EQ(m.quant.activation_key, kFp8Dynamic128Sym);
  const SafetensorsCheckpoint ck = SafetensorsCheckpoint::open(path());
  EXPECT_TRUE(ck.sharded());
  EXPECT_GE(ck.shards().size(), 3u);
  const SafetensorsTensor& s = ck.at("model.layers.1.mlp.experts.7.down_proj.weight_scale_inv");
  EXPECT_EQ(s.dtype_name, "F32");
  EXPECT_EQ(s.shape, (std::vector<int64_t>{2, 5}));
  EXPECT_EQ(ck.at("model.layers.0.mlp.gate.weight").dtype_name, "BF16");
}

TEST(ExampleCheckpointGenerator, IsDeterministic) {
  // A smaller example than the suite's, written twice (and once with another seed).
  ExampleCheckpointSpec spec;
  spec.hidden = 128;
  spec.intermediate = 256;
  spec.experts = 2;
  spec.layers = 1;
  spec.vocab = 64;
  TempDir a, b, other;
  const auto files = write_example_checkpoint(a.path(), spec);
  write_example_checkpoint(b.path(), spec);
  ASSERT_GE(files.size(), 4u);
  for (const std::string& f : files) {
    const std::string name = f.substr(f.rfind('/'));
    EXPECT_EQ(slurp(f), slurp(b.path() + name)) << name;
  }
  spec.seed = 1;
  write_example_checkpoint(other.path(), spec);
  const std::string shard = files.back().substr(files.back().rfind('/'));
  ASSERT_FALSE(slurp(a.path() + shard).empty());
  EXPECT_NE(slurp(other.path() + shard), slurp(a.path() + shard));
}

// The dequantised full projection of one expert straight from the checkpoint.
Tensor full_dequant(const SafetensorsCheckpoint& ck, const ModelConfig& m, int layer, int e,
                    ExpertProj p) {
  auto view = [&](const std::string& name) {
    const SafetensorsTensor& t = ck.at(name);
    return TensorView(const_cast<uint8_t*>(ck.data(name).data()), *t.dtype, t.shape);
  };
  return numerics::dequantize_block(view(expert_weight_name(m, layer, e, p)),
                                    view(expert_scale_name(m, layer, e, p)), 128, 128);
}

// Loads every rank and checks each against the checkpoint: rank r's local rows/columns are global
// [r*W, r*W + valid); padding dequantises to 0; every global row is covered once.
void check_layout(const std::string& dir, int layer, int tp, int ep, TpShardMode mode,
                  int64_t block) {
  const ModelConfig m = load_model_config(dir);
  const SafetensorsCheckpoint ck = SafetensorsCheckpoint::open(dir);
  const int64_t I = m.moe_intermediate_size, H = m.hidden_size;
  std::vector<int> expert_seen(m.num_experts, 0);
  for (int er = 0; er < ep; ++er) {
    const ExpertPlacement place = place_experts(m.num_experts, ep, er);
    std::vector<int> row_seen(I, 0);
    for (int r = 0; r < tp; ++r) {
      TpShard sh;
      if (mode == TpShardMode::kPad) {
        sh = make_tp_shard(I, H, tp, r, {128, 128}, {128, 128}, std::nullopt, true,
                           (I / tp + 127) / 128 * 128);
      } else if (mode == TpShardMode::kRefine) {
        sh = make_tp_shard(I, H, tp, r, {128, 128}, {block, block},
                           std::array<int64_t, 2>{128 / block, 128 / block}, false, I / tp);
      } else {
        sh = make_tp_shard(I, H, tp, r, {128, 128}, {128, 128}, std::nullopt, false, I / tp);
      }
      const LoadedMoeLayer L = load_moe_layer(ck, m, layer, sh, place);
      const int64_t W = sh.local_size;
      ASSERT_EQ(L.w13.sizes(), (std::vector<int64_t>{place.num_local(), 2 * W, H}));
      ASSERT_EQ(L.w2.sizes(), (std::vector<int64_t>{place.num_local(), H, W}));
      EXPECT_EQ(L.tensors_read, static_cast<std::size_t>(place.num_local()) * 6);
      // expert_map
      for (int g = 0; g < m.num_experts; ++g) {
        EXPECT_EQ(L.expert_map.ptr<int32_t>()[g], place.expert_map[g]);
      }
      const Tensor d13 = numerics::dequantize_block(L.w13, L.w13_scale, sh.block[0], sh.block[1]);
      const Tensor d2 = numerics::dequantize_block(L.w2, L.w2_scale, sh.block[0], sh.block[1]);
      for (int le = 0; le < place.num_local(); ++le) {
        const int ge = place.local_to_global[le];
        if (r == 0) expert_seen[ge]++;
        const Tensor g = full_dequant(ck, m, layer, ge, ExpertProj::kGate);
        const Tensor u = full_dequant(ck, m, layer, ge, ExpertProj::kUp);
        const Tensor dn = full_dequant(ck, m, layer, ge, ExpertProj::kDown);
        const double* a = d13.ptr<double>() + le * 2 * W * H;
        const double* b = d2.ptr<double>() + le * H * W;
        for (int64_t lr = 0; lr < W; ++lr) {
          const bool valid = lr < sh.valid_size();
          const int64_t gr = sh.global_begin() + lr;
          if (valid && le == 0) row_seen[gr]++;
          for (int64_t c = 0; c < H; ++c) {
            const double x = a[lr * H + c], y = a[(W + lr) * H + c], z = b[c * W + lr];
            if (valid) {
              ASSERT_EQ(std::memcmp(&x, g.ptr<double>() + gr * H + c, 8), 0);
              ASSERT_EQ(std::memcmp(&y, u.ptr<double>() + gr * H + c, 8), 0);
              ASSERT_EQ(std::memcmp(&z, dn.ptr<double>() + c * I + gr, 8), 0);
            } else {
              ASSERT_EQ(x, 0.0);
              ASSERT_EQ(y, 0.0);
              ASSERT_EQ(z, 0.0);
            }
          }
        }
      }
      // No poison (NaN codes, NaN scales) survived.
      const auto* q = static_cast<const uint8_t*>(L.w13.data());
      for (std::size_t i = 0; i < L.w13.nbytes(); ++i) ASSERT_NE(q[i] & 0x7F, 0x7F);
      for (int64_t i = 0; i < L.w13_scale.numel(); ++i)
        ASSERT_FALSE(std::isnan(L.w13_scale.ptr<float>()[i]));
      for (int64_t i = 0; i < L.w2_scale.numel(); ++i)
        ASSERT_FALSE(std::isnan(L.w2_scale.ptr<float>()[i]));
    }
    for (int64_t gr = 0; gr < I; ++gr) ASSERT_EQ(row_seen[gr], 1) << gr;
  }
  for (int g = 0; g < m.num_experts; ++g) EXPECT_EQ(expert_seen[g], 1) << g;
}

TEST_F(ExampleCheckpoint, LoadsTp1) { check_layout(path(), 0, 1, 1, TpShardMode::kKeep, 128); }
TEST_F(ExampleCheckpoint, LoadsTp4Refined32) {
  check_layout(path(), 1, 4, 1, TpShardMode::kRefine, 32);
}
TEST_F(ExampleCheckpoint, LoadsTp8Padded) { check_layout(path(), 0, 8, 1, TpShardMode::kPad, 128); }
TEST_F(ExampleCheckpoint, LoadsTp4Padded) { check_layout(path(), 1, 4, 1, TpShardMode::kPad, 128); }
TEST_F(ExampleCheckpoint, LoadsEp3Uneven) {
  check_layout(path(), 1, 1, 3, TpShardMode::kKeep, 128);
}

// ---- coverage and malformed experts (pitfall 37)
// --------------------------------------------------------

// Copies the example into `dst`, dropping or replacing one tensor.
void rewrite_example(const std::string& src, const std::string& dst, const std::string& victim,
                     const ShardedTensor* replacement) {
  const SafetensorsCheckpoint ck = SafetensorsCheckpoint::open(src);
  std::vector<ShardedTensor> ts;
  for (const std::string& name : ck.tensor_names()) {
    if (name == victim) {
      if (replacement) ts.push_back(*replacement);
      continue;
    }
    const SafetensorsTensor& t = ck.at(name);
    const auto d = ck.data(name);
    ts.push_back({name, *t.dtype, t.shape, std::vector<uint8_t>(d.begin(), d.end())});
  }
  write_sharded_checkpoint(dst, ts, 1 << 20);
  std::ofstream(dst + "/config.json") << slurp(src + "/config.json");
}

TEST_F(ExampleCheckpoint, MissingExpertScaleIsNamed) {  // pitfall 37
  TempDir d;
  const std::string victim = "model.layers.1.mlp.experts.5.down_proj.weight_scale_inv";
  rewrite_example(path(), d.path(), victim, nullptr);
  const ModelConfig m = load_model_config(d.path());
  const SafetensorsCheckpoint ck = SafetensorsCheckpoint::open(d.path());
  const TpShard sh =
      make_tp_shard(640, 256, 1, 0, {128, 128}, {128, 128}, std::nullopt, false, 640);
  EXPECT_TRUE(throws_with<FormatError>(
      [&] { load_moe_layer(ck, m, 1, sh, place_experts(8, 1, 0)); }, {victim}));
  // Layer 0 and the EP ranks without expert 5 are unaffected.
  EXPECT_NO_THROW(load_moe_layer(ck, m, 0, sh, place_experts(8, 1, 0)));
  EXPECT_NO_THROW(load_moe_layer(ck, m, 1, sh, place_experts(8, 2, 0)));
}

TEST_F(ExampleCheckpoint, MalformedExpertTensorsAreNamed) {  // pitfall 37
  TempDir d;
  const std::string victim = "model.layers.0.mlp.experts.2.up_proj.weight";
  const ShardedTensor wrong{
      victim, DType::kF8E4M3FN, {640, 128}, std::vector<uint8_t>(640 * 128, 1)};
  rewrite_example(path(), d.path(), victim, &wrong);
  const ModelConfig m = load_model_config(d.path());
  const SafetensorsCheckpoint ck = SafetensorsCheckpoint::open(d.path());
  const TpShard sh =
      make_tp_shard(640, 256, 4, 1, {128, 128}, {32, 32}, std::array<int64_t, 2>{4, 4}, false, 160);
  EXPECT_TRUE(
      throws_with<FormatError>([&] { load_moe_layer(ck, m, 0, sh, place_experts(8, 1, 0)); },
                               {victim, "[640, 128]", "expected [640, 256]"}));
  TempDir d2;
  const ShardedTensor bf16{
      victim, DType::kBF16, {640, 256}, std::vector<uint8_t>(640 * 256 * 2, 1)};
  rewrite_example(path(), d2.path(), victim, &bf16);
  const SafetensorsCheckpoint ck2 = SafetensorsCheckpoint::open(d2.path());
  EXPECT_TRUE(throws_with<FormatError>(
      [&] { load_moe_layer(ck2, load_model_config(d2.path()), 0, sh, place_experts(8, 1, 0)); },
      {victim, "float8_e4m3fn"}));
}

TEST_F(ExampleCheckpoint, MismatchedShardOrPlacementIsRejected) {
  const ModelConfig m = load_model_config(path());
  const SafetensorsCheckpoint ck = SafetensorsCheckpoint::open(path());
  const TpShard wrong =
      make_tp_shard(512, 256, 1, 0, {128, 128}, {128, 128}, std::nullopt, false, 512);
  EXPECT_THROW(load_moe_layer(ck, m, 0, wrong, place_experts(8, 1, 0)), ValueError);
  const TpShard ok =
      make_tp_shard(640, 256, 1, 0, {128, 128}, {128, 128}, std::nullopt, false, 640);
  EXPECT_THROW(load_moe_layer(ck, m, 0, ok, place_experts(16, 1, 0)), ValueError);
  EXPECT_THROW(load_moe_layer(ck, m, 2, ok, place_experts(8, 1, 0)), ValueError);  // no layer 2
}

TEST(LoadMoeLayer, UnsupportedLayoutsSayWhy) {
  const ModelConfig gpt =
      load_model_config(std::string(FP8MOE_SOURCE_DIR) + "/examples/configs/gpt-oss-120b");
  SafetensorsCheckpoint empty;
  const TpShard sh = make_plain_tp_shard(2880, 2880, 1, 0);
  EXPECT_TRUE(throws_with<NotImplementedError>(
      [&] { load_moe_layer(empty, gpt, 0, sh, place_experts(128, 1, 0)); },
      {"not FP8", "Mxfp4MoEMethod"}));
}

}  // namespace
}  // namespace fp8moe
