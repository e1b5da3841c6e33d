// refine_fp8_moe_block_shape, pad_tp_shard_to_weight_blocks, resolve_fp8_moe_weight_block_shape:
// the seed's source, including which errors are raised and what is mutated.
#include <gtest/gtest.h>

#include "fp8moe/error.hpp"
#include "fp8moe/log.hpp"
#include "fp8moe/oracle.hpp"
#include "unit/oracle_test_util.hpp"

namespace fp8moe {
namespace {

using testing::Deploy;
using testing::msg_of;
using testing::plat;

Deploy model(int H, int I, int tp, const char* backend = "auto") {
  Deploy d;
  d.H = H;
  d.I = I;
  d.tp = tp;
  d.backend = backend;
  return d;
}

TEST(Refine, Table) {
  struct Case {
    int H, I, tp;
    BlockShape block;
    std::optional<BlockShape> expect;
  };
  const Case cases[] = {
      {2048, 768, 1, {128, 128}, std::nullopt},        // Qwen3-30B-A3B TP1: 768 = 6 blocks
      {2048, 768, 2, {128, 128}, std::nullopt},        // 384 = 3 blocks
      {2048, 768, 4, {128, 128}, BlockShape{64, 64}},  // 192
      {2048, 768, 8, {128, 128}, BlockShape{32, 32}},  // 96: gcd 32
      {7168, 2048, 8, {128, 128}, std::nullopt},       // DeepSeek-V3 TP8: 256
      {7168, 18432, 8, {128, 128}, std::nullopt},
      {2048, 640, 4, {128, 128}, BlockShape{32, 32}},  // 160: gcd 32
      {2048, 640, 8, {128, 128}, std::nullopt},        // 80: gcd 16 < 32
      {2048, 512, 8, {128, 128}, BlockShape{64, 64}},  // 64
      {2048, 700, 1, {128, 128}, std::nullopt},        // tp 1, gcd 4
      {1000, 768, 4, {128, 128}, std::nullopt},        // gcd(128, 192, 1000) = 8
      {2048, 768, 4, {64, 128}, BlockShape{64, 64}},   // 192 % 64 == 0 but 192 % 128 != 0
      {2048, 768, 1, {64, 128}, std::nullopt},         // tp 1: only block_n matters
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(::testing::Message() << "H=" << c.H << " I=" << c.I << " tp=" << c.tp
                                      << " block=" << c.block[0] << "x" << c.block[1]);
    EXPECT_EQ(refine_fp8_moe_block_shape(model(c.H, c.I, c.tp).build(), c.block), c.expect);
  }
  EXPECT_EQ(msg_of([] {
              refine_fp8_moe_block_shape(model(2048, 768, 4).build(), {0, 128});
            }),
            "ValueError: weight_block_size must be two positive integers [block_n, block_k], got "
            "[0, 128]");
}

TEST(Pad, ReturnsFalseWithoutTouchingTheConfig) {
  struct Case {
    const char* label;
    Deploy d;
    BlockShape block;
  };
  const Case cases[] = {
      {"non-square block", model(2048, 768, 4), {64, 128}},
      {"tp 1", model(2048, 700, 1), {128, 128}},
      {"whole blocks", model(7168, 2048, 8), {128, 128}},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.label);
    MoeConfig config = c.d.build();
    const int before = config.intermediate_size_per_partition;
    EXPECT_FALSE(pad_tp_shard_to_weight_blocks(config, c.block));
    EXPECT_EQ(config.intermediate_size_per_partition, before);
    EXPECT_FALSE(config.tp_shard_with_padding);
  }
}

TEST(Pad, PadsToWholeBlocks) {
  MoeConfig config = model(2048, 768, 4).build();
  EXPECT_TRUE(pad_tp_shard_to_weight_blocks(config, {128, 128}));
  EXPECT_TRUE(config.tp_shard_with_padding);
  EXPECT_EQ(config.intermediate_size_per_partition, 256);
  EXPECT_EQ(config.intermediate_size_per_partition_unpadded, 192);  // left as post_init set it
  config = model(2048, 640, 8).build();
  EXPECT_TRUE(pad_tp_shard_to_weight_blocks(config, {128, 128}));
  EXPECT_EQ(config.intermediate_size_per_partition, 128);
}

TEST(Pad, ErrorsNameTheBlock) {
  const std::string msg128 =
      "ValueError: Block-aligned FP8 TP sharding requires 128-aligned global expert dimensions, "
      "pure TP, and no LoRA or expert bias.";
  struct Case {
    const char* label;
    Deploy d;
  };
  Deploy lora = model(2048, 640, 8);
  lora.lora = true;
  Deploy bias = model(2048, 640, 8);
  bias.bias = true;
  Deploy ep = model(2048, 640, 8);
  ep.ep = true;
  const Case cases[] = {
      {"I not block-aligned", model(2048, 600, 8)},  // 75 per rank
      {"H not block-aligned", model(2000, 640, 8)},
      {"LoRA", lora},
      {"bias", bias},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.label);
    MoeConfig config = c.d.build();
    EXPECT_EQ(msg_of([&] { pad_tp_shard_to_weight_blocks(config, {128, 128}); }), msg128);
    EXPECT_FALSE(config.tp_shard_with_padding);
  }
  // With EP the experts are not TP-sharded (tp_size 1): nothing to pad.
  MoeConfig e = ep.build();
  EXPECT_FALSE(pad_tp_shard_to_weight_blocks(e, {128, 128}));
  // ep_size != 1 with tp > 1 needs dp*pcp*tp flattened into EP, which leaves tp 1; the ep check is
  // reached through a hand-built parallel config.
  MoeConfig hand = model(2048, 640, 8).build();
  hand.moe_parallel_config.ep_size = 2;
  EXPECT_EQ(msg_of([&] { pad_tp_shard_to_weight_blocks(hand, {128, 128}); }), msg128);
  MoeConfig b64 = model(2048, 96 * 8 + 32, 8).build();  // 100 per rank
  EXPECT_EQ(msg_of([&] {
              pad_tp_shard_to_weight_blocks(b64, {64, 64});
            }),
            "ValueError: Block-aligned FP8 TP sharding requires 64-aligned global expert "
            "dimensions, pure TP, and no LoRA or expert bias.");
}

struct Resolved {
  BlockShape block;
  std::optional<std::array<int, 2>> refine;
  int ispp;
  bool padded;
  std::string error;
};

Resolved resolve(Deploy d, BlockShape block, const Platform& p, bool serialized = true) {
  Resolved r{};
  MoeConfig config = d.build();
  try {
    const BlockShapeResolution res = resolve_fp8_moe_weight_block_shape(
        config, block, with_fp8_dtype(OptQuantKey(kFp8Dynamic128Sym), p.fp8_dtype()), serialized,
        p);
    r.block = res.block_shape;
    r.refine = res.refine;
    EXPECT_EQ(res.padded, config.tp_shard_with_padding);
  } catch (const Error& e) {
    r.error = std::string(e.kind()) + ": " + e.what();
  }
  r.ispp = config.intermediate_size_per_partition;
  r.padded = config.tp_shard_with_padding;
  return r;
}

TEST(Resolve, Table) {
  using F = std::array<int, 2>;
  struct Case {
    const char* label;
    Deploy d;
    const char* platform;
    bool serialized;
    BlockShape block;
    std::optional<F> refine;
    int ispp;
    bool padded;
  };
  const Case cases[] = {
      {"Qwen3-30B TP4 auto: refine",
       model(2048, 768, 4),
       "cuda:90",
       true,
       {64, 64},
       F{2, 2},
       192,
       false},
      {"Qwen3-30B TP4 flashinfer_trtllm: pad",
       model(2048, 768, 4, "flashinfer_trtllm"),
       "cuda:100",
       true,
       {128, 128},
       std::nullopt,
       256,
       true},
      {"Qwen3-30B TP4 triton on H200: refine (Triton takes 64x64)",
       model(2048, 768, 4, "triton"),
       "cuda:90",
       true,
       {64, 64},
       F{2, 2},
       192,
       false},
      {"Qwen3-30B TP4 triton on a CPU platform: pad (no FP8 Triton there)",
       model(2048, 768, 4, "triton"),
       "cpu",
       true,
       {128, 128},
       std::nullopt,
       256,
       true},
      {"Qwen3-30B TP4 deep_gemm: pad",
       model(2048, 768, 4, "deep_gemm"),
       "cuda:90",
       true,
       {128, 128},
       std::nullopt,
       256,
       true},
      {"Qwen3-30B TP4 marlin: pad",
       model(2048, 768, 4, "marlin"),
       "cuda:90",
       true,
       {128, 128},
       std::nullopt,
       256,
       true},
      {"Qwen3-30B TP4 not serialized: refine",
       model(2048, 768, 4, "flashinfer_trtllm"),
       "cuda:100",
       false,
       {64, 64},
       F{2, 2},
       192,
       false},
      {"Qwen3-30B TP8 auto: 32x32",
       model(2048, 768, 8),
       "cuda:90",
       true,
       {32, 32},
       F{4, 4},
       96,
       false},
      {"DeepSeek-V3 TP8: keep",
       model(7168, 2048, 8),
       "cuda:90",
       true,
       {128, 128},
       std::nullopt,
       256,
       false},
      {"DeepSeek-V3 TP8 flashinfer_trtllm: keep",
       model(7168, 2048, 8, "flashinfer_trtllm"),
       "cuda:100",
       true,
       {128, 128},
       std::nullopt,
       256,
       false},
      {"I=640 TP4: 32x32", model(2048, 640, 4), "cuda:90", true, {32, 32}, F{4, 4}, 160, false},
      {"I=640 TP8 auto: keep (gcd 16), shard is not whole blocks",
       model(2048, 640, 8),
       "cuda:90",
       true,
       {128, 128},
       std::nullopt,
       80,
       false},
      {"I=640 TP8 triton: pad to 128",
       model(2048, 640, 8, "triton"),
       "cuda:90",
       true,
       {128, 128},
       std::nullopt,
       128,
       true},
      {"I=640 TP8 triton not serialized: keep",
       model(2048, 640, 8, "triton"),
       "cuda:90",
       false,
       {128, 128},
       std::nullopt,
       80,
       false},
      {"I=512 TP8: 64x64", model(2048, 512, 8), "cuda:90", true, {64, 64}, F{2, 2}, 64, false},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.label);
    const Resolved r = resolve(c.d, {128, 128}, plat(c.platform), c.serialized);
    EXPECT_EQ(r.error, "");
    EXPECT_EQ(r.block, c.block);
    EXPECT_EQ(r.refine, c.refine);
    EXPECT_EQ(r.ispp, c.ispp);
    EXPECT_EQ(r.padded, c.padded);
  }
}

TEST(Resolve, Errors) {
  Deploy lora = model(2048, 640, 8, "triton");
  lora.lora = true;
  EXPECT_EQ(resolve(lora, {128, 128}, plat("cuda:90")).error,
            "ValueError: Block-aligned FP8 TP sharding requires 128-aligned global expert "
            "dimensions, pure TP, and no LoRA or expert bias.");
  // Auto never pads, so the same deployment passes (and keeps the unaligned shard).
  Deploy lora_auto = lora;
  lora_auto.backend = "auto";
  EXPECT_EQ(resolve(lora_auto, {128, 128}, plat("cuda:90")).error, "");
  // The explicit backend is mapped only on the serialized path.
  EXPECT_EQ(resolve(model(2048, 768, 4, "bogus"), {128, 128}, plat("cuda:90"))
                .error.rfind("ValueError: moe_backend='bogus' is not supported for FP8 MoE.", 0),
            0u);
  EXPECT_EQ(resolve(model(2048, 768, 4, "bogus"), {128, 128}, plat("cuda:90"), false).error, "");
}

TEST(Resolve, LogsAsVllm) {
  std::vector<std::string> infos;
  set_log_sink([&](LogLevel l, std::string_view m) {
    if (l == LogLevel::kInfo) infos.emplace_back(m);
  });
  const LogLevel old = log_level();
  set_log_level(LogLevel::kInfo);
  reset_log_once();
  resolve(model(2048, 768, 4), {128, 128}, plat("cuda:90"));
  resolve(model(2048, 768, 4, "flashinfer_trtllm"), {128, 128}, plat("cuda:100"));
  set_log_level(old);
  set_log_sink(nullptr);
  EXPECT_EQ(infos, (std::vector<std::string>{
                       "FP8 MoE block scales refined from [128, 128] to [64, 64] to fit the "
                       "TP-sharded intermediate size 192.",
                       "FP8 flashinfer_trtllm TP loading uses complete checkpoint blocks: local "
                       "allocation 256, without weight requantization."}));
}

}  // namespace
}  // namespace fp8moe
