// TP sharding (keep / refine / pad) and EP placement. The central check: for every rank, every
// element of its w13/w2 shard carries exactly the fp8 byte and the scale of the corresponding
// element of the unsharded checkpoint (so the dequantised shards concatenate to the dequantised
// unsharded weight bit for bit), every global element is owned by exactly one rank, and padding
// holds exactly weight 0 and scale 1. (tests/py/test_safetensors_interop.py repeats it with an
// independent fp8 decoder, ml_dtypes.) Pitfalls 1-5, 8, 22 and 37 of spec/pitfalls.md.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "fp8moe/checkpoint.hpp"
#include "fp8moe/error.hpp"
#include "numerics/quant.hpp"
#include "test_checkpoint_util.hpp"

namespace fp8moe {
namespace {

using test::throws_with;

int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// One checkpoint projection: fp8 bytes (rows, cols) and its f32 block scale grid.
struct Proj {
  int64_t rows = 0, cols = 0, bn = 128, bk = 128;
  std::vector<uint8_t> w;
  std::vector<float> s;
  TensorView wv() const {
    return TensorView(const_cast<uint8_t*>(w.data()), DType::kF8E4M3FN, {rows, cols});
  }
  TensorView sv() const {
    return TensorView(const_cast<float*>(s.data()), DType::kF32, {cdiv(rows, bn), cdiv(cols, bk)});
  }
  float scale_of(int64_t r, int64_t c) const { return s[(r / bn) * cdiv(cols, bk) + c / bk]; }
};

Proj make_proj(int64_t rows, int64_t cols, int64_t bn, int64_t bk, uint32_t seed) {
  Proj p;
  p.rows = rows;
  p.cols = cols;
  p.bn = bn;
  p.bk = bk;
  std::mt19937 rng(seed);
  p.w.resize(rows * cols);
  // Any byte except 0x00 (so padding is recognisable) and the two NaN codes.
  for (auto& b : p.w) {
    do b = static_cast<uint8_t>(rng());
    while (b == 0 || b == 0x7F || b == 0xFF);
  }
  p.s.resize(cdiv(rows, bn) * cdiv(cols, bk));
  for (std::size_t i = 0; i < p.s.size(); ++i) p.s[i] = 0.001f * static_cast<float>(i + 3) + seed;
  return p;
}

bool same_bits(float a, float b) { return std::memcmp(&a, &b, 4) == 0; }

struct RankOut {
  Tensor w13, s13, w2, s2;
};

RankOut load_rank(const TpShard& sh, const Proj& gate, const Proj& up, const Proj& down) {
  RankOut o;
  const int64_t W = sh.local_size, H = sh.hidden_size;
  o.w13 = Tensor::empty({2 * W, H}, DType::kF8E4M3FN);
  o.w2 = Tensor::empty({H, W}, DType::kF8E4M3FN);
  const auto a = sh.w13_scale_shape(2), b = sh.w2_scale_shape();
  o.s13 = Tensor::empty({a[0], a[1]}, DType::kF32);
  o.s2 = Tensor::empty({b[0], b[1]}, DType::kF32);
  // Poison everything: NaN bytes and NaN scales must all be overwritten.
  std::memset(o.w13.data(), 0x7F, o.w13.nbytes());
  std::memset(o.w2.data(), 0x7F, o.w2.nbytes());
  std::fill_n(o.s13.ptr<float>(), o.s13.numel(), std::nanf(""));
  std::fill_n(o.s2.ptr<float>(), o.s2.numel(), std::nanf(""));
  load_w13_block_shard(sh, 0, gate.wv(), gate.sv(), o.w13, o.s13, "gate");
  load_w13_block_shard(sh, 1, up.wv(), up.sv(), o.w13, o.s13, "up");
  load_w2_block_shard(sh, down.wv(), down.sv(), o.w2, o.s2, "down");
  return o;
}

struct Case {
  int64_t I, H;
  int T;
  TpShardMode mode;
  int64_t block;  // loaded block size (refined) for kRefine
};

std::vector<TpShard> shards_for(const Case& c) {
  std::vector<TpShard> out;
  for (int r = 0; r < c.T; ++r) {
    switch (c.mode) {
      case TpShardMode::kKeep:
        out.push_back(make_tp_shard(c.I, c.H, c.T, r, {128, 128}, {128, 128}, std::nullopt, false,
                                    c.I / c.T));
        break;
      case TpShardMode::kRefine:
        out.push_back(make_tp_shard(c.I, c.H, c.T, r, {128, 128}, {c.block, c.block},
                                    std::array<int64_t, 2>{128 / c.block, 128 / c.block}, false,
                                    c.I / c.T));
        break;
      case TpShardMode::kPad:
        out.push_back(make_tp_shard(c.I, c.H, c.T, r, {128, 128}, {128, 128}, std::nullopt, true,
                                    cdiv(c.I / c.T, 128) * 128));
        break;
    }
  }
  return out;
}

// Checks every element of every rank against the unsharded projections. Returns the number of
// padding elements seen (so callers can assert padding exists where expected).
void check_case_impl(const Case& c, int64_t& padding) {
  const Proj gate = make_proj(c.I, c.H, 128, 128, 1);
  const Proj up = make_proj(c.I, c.H, 128, 128, 2);
  const Proj down = make_proj(c.H, c.I, 128, 128, 3);
  const auto shards = shards_for(c);
  std::vector<int> owned13(c.I, 0), owned2(c.I, 0);
  for (const TpShard& sh : shards) {
    const RankOut o = load_rank(sh, gate, up, down);
    const int64_t W = sh.local_size, H = c.H, b0 = sh.block[0], b1 = sh.block[1];
    const auto a = sh.w13_scale_shape(2);
    const uint8_t* w13 = static_cast<const uint8_t*>(o.w13.data());
    const float* s13 = o.s13.ptr<float>();
    for (int half = 0; half < 2; ++half) {
      const Proj& src = half ? up : gate;
      for (int64_t lr = 0; lr < W; ++lr) {
        const int64_t g = sh.global_begin() + lr;
        const bool valid = lr < sh.valid_size();
        if (valid && half == 0) owned13[g]++;
        for (int64_t col = 0; col < H; ++col) {
          const uint8_t byte = w13[(half * W + lr) * H + col];
          const float scale = s13[(half * (a[0] / 2) + lr / b0) * a[1] + col / b1];
          if (valid) {
            ASSERT_EQ(byte, src.w[g * H + col])
                << "w13 half " << half << " rank " << sh.tp_rank << " row " << lr << " col " << col;
            ASSERT_TRUE(same_bits(scale, src.scale_of(g, col)))
                << "w13 scale, rank " << sh.tp_rank << " row " << lr << " col " << col;
          } else {
            ASSERT_EQ(byte, 0) << "padding weight";
            ASSERT_TRUE(same_bits(scale, 1.0f)) << "padding scale";
            ++padding;
          }
        }
      }
    }
    const uint8_t* w2 = static_cast<const uint8_t*>(o.w2.data());
    const float* s2 = o.s2.ptr<float>();
    const auto b = sh.w2_scale_shape();
    for (int64_t row = 0; row < H; ++row) {
      for (int64_t lc = 0; lc < W; ++lc) {
        const int64_t g = sh.global_begin() + lc;
        const bool valid = lc < sh.valid_size();
        if (valid && row == 0) owned2[g]++;
        const uint8_t byte = w2[row * W + lc];
        const float scale = s2[(row / b0) * b[1] + lc / b1];
        if (valid) {
          ASSERT_EQ(byte, down.w[row * c.I + g]) << "w2 rank " << sh.tp_rank;
          ASSERT_TRUE(same_bits(scale, down.scale_of(row, g))) << "w2 scale rank " << sh.tp_rank;
        } else {
          ASSERT_EQ(byte, 0);
          ASSERT_TRUE(same_bits(scale, 1.0f));
          ++padding;
        }
      }
    }
    // The same through the numerics room's dequantiser: decode(q) * scale of the shard equals that
    // of the unsharded weight bit for bit; padding dequantises to exactly 0.
    {
      const Tensor dq13 = numerics::dequantize_block(o.w13, o.s13, b0, b1);
      const Tensor dq2 = numerics::dequantize_block(o.w2, o.s2, b0, b1);
      const Tensor full_g = numerics::dequantize_block(gate.wv(), gate.sv(), 128, 128);
      const Tensor full_u = numerics::dequantize_block(up.wv(), up.sv(), 128, 128);
      const Tensor full_d = numerics::dequantize_block(down.wv(), down.sv(), 128, 128);
      ASSERT_EQ(dq13.dtype(), DType::kF64);
      const double* d13 = dq13.ptr<double>();
      const double* d2 = dq2.ptr<double>();
      for (int half = 0; half < 2; ++half) {
        const double* full = (half ? full_u : full_g).ptr<double>();
        for (int64_t lr = 0; lr < W; ++lr) {
          const int64_t g = sh.global_begin() + lr;
          const bool valid = lr < sh.valid_size();
          for (int64_t col = 0; col < H; ++col) {
            const double v = d13[(half * W + lr) * H + col];
            if (valid) {
              ASSERT_EQ(std::memcmp(&v, &full[g * H + col], 8), 0) << "dequantised w13";
            } else {
              ASSERT_EQ(v, 0.0);
            }
          }
        }
      }
      for (int64_t row = 0; row < H; ++row) {
        for (int64_t lc = 0; lc < W; ++lc) {
          const int64_t g = sh.global_begin() + lc;
          const double v = d2[row * W + lc];
          if (lc < sh.valid_size()) {
            ASSERT_EQ(std::memcmp(&v, &full_d.ptr<double>()[row * c.I + g], 8), 0)
                << "dequantised w2";
          } else {
            ASSERT_EQ(v, 0.0);
          }
        }
      }
    }
    // Nothing of the poison survived (scales included).
    for (int64_t i = 0; i < o.s13.numel(); ++i) ASSERT_FALSE(std::isnan(s13[i]));
    for (int64_t i = 0; i < o.s2.numel(); ++i) ASSERT_FALSE(std::isnan(s2[i]));
  }
  for (int64_t g = 0; g < c.I; ++g) {
    EXPECT_EQ(owned13[g], 1) << "global row " << g;
    EXPECT_EQ(owned2[g], 1) << "global column " << g;
  }
}

int64_t check_case(const Case& c) {
  int64_t padding = 0;
  check_case_impl(c, padding);
  return padding;
}

TEST(TpShard, Keep2048Over8) { EXPECT_EQ(check_case({2048, 256, 8, TpShardMode::kKeep, 128}), 0); }

TEST(TpShard, KeepSingleRankWithPartialBlocks) {
  // TP=1 keeps whatever the blocks are, including a hidden size with a partial last block.
  EXPECT_EQ(check_case({256, 320, 1, TpShardMode::kKeep, 128}), 0);
  EXPECT_EQ(check_case({256, 320, 2, TpShardMode::kKeep, 128}), 0);
}

TEST(TpShard, Qwen3_768Over4RefinesTo64) {  // pitfall 1
  EXPECT_EQ(check_case({768, 256, 4, TpShardMode::kRefine, 64}), 0);
}

TEST(TpShard, Qwen3_768Over8RefinesTo32) {  // pitfall 1
  EXPECT_EQ(check_case({768, 256, 8, TpShardMode::kRefine, 32}), 0);
}

TEST(TpShard, Qwen3_768PadsTo256And128) {  // pitfall 1, the flashinfer_trtllm path
  EXPECT_EQ(check_case({768, 256, 4, TpShardMode::kPad, 128}), 4 * (2 * 64 * 256 + 256 * 64));
  EXPECT_GT(check_case({768, 256, 8, TpShardMode::kPad, 128}), 0);
}

TEST(TpShard, I640Over4RefinesTo32) {  // pitfall 3
  EXPECT_EQ(check_case({640, 256, 4, TpShardMode::kRefine, 32}), 0);
}

TEST(TpShard, I640Over8Pads) {  // pitfall 3: ranks 0-4 real, 5-7 all padding
  const auto shards = shards_for({640, 256, 8, TpShardMode::kPad, 128});
  for (int r = 0; r < 8; ++r) EXPECT_EQ(shards[r].valid_size(), r < 5 ? 128 : 0) << r;
  EXPECT_EQ(check_case({640, 256, 8, TpShardMode::kPad, 128}), 3 * (2 * 128 * 256 + 256 * 128));
}

TEST(TpShard, UnevenPaddingLayoutFiveBlocksOverFourRanks) {  // pitfall 8: A|B, C|D, E|pad, pad|pad
  const auto shards = shards_for({640, 256, 4, TpShardMode::kPad, 128});
  const std::vector<int64_t> valid = {256, 256, 128, 0};
  for (int r = 0; r < 4; ++r) {
    EXPECT_EQ(shards[r].local_size, 256);
    EXPECT_EQ(shards[r].valid_size(), valid[r]);
    EXPECT_EQ(shards[r].global_begin(), 256 * r);
  }
  check_case({640, 256, 4, TpShardMode::kPad, 128});
}

TEST(TpShard, TwoRanksSharingAScaleBlockReadTheirOwnRow) {  // pitfall 2: I=512 at TP=8
  // 64 rows per rank, 128-row checkpoint blocks: refine to 64 and check that rank r's scale row is
  // the checkpoint's row floor(r * 64 / 128), never a neighbour's.
  check_case({512, 256, 8, TpShardMode::kRefine, 64});
  const Proj gate = make_proj(512, 256, 128, 128, 1);
  const Proj down = make_proj(256, 512, 128, 128, 3);
  for (const TpShard& sh : shards_for({512, 256, 8, TpShardMode::kRefine, 64})) {
    const RankOut o = load_rank(sh, gate, gate, down);
    const int64_t src_row = sh.tp_rank * 64 / 128;
    for (int64_t c = 0; c < 256 / 64; ++c) {
      EXPECT_TRUE(same_bits(o.s13.ptr<float>()[c], gate.s[src_row * 2 + c / 2]));
    }
  }
  // The pad alternative: ranks 0-3 hold everything, ranks 4-7 only padding.
  EXPECT_GT(check_case({512, 256, 8, TpShardMode::kPad, 128}), 0);
}

TEST(TpShard, RefineWhenBlockDoesNotDivideI) {
  // I = 192 (one and a half 128-blocks), TP=2 -> 96 per rank, refined to 32. The rank's first
  // refined scale row is its true first row (vLLM's narrow at rows//tp*rank would be off here).
  EXPECT_EQ(check_case({192, 256, 2, TpShardMode::kRefine, 32}), 0);
}

TEST(TpShard, UpsampleIsRepeatInterleave) {
  std::vector<float> s = {1, 2, 3, 4, 5, 6};  // 2 x 3
  Tensor up = upsample_block_scales(TensorView(s.data(), DType::kF32, {2, 3}), 2, 4);
  ASSERT_EQ(up.sizes(), (std::vector<int64_t>{4, 12}));
  for (int64_t i = 0; i < 4; ++i) {
    for (int64_t j = 0; j < 12; ++j) EXPECT_EQ(up.ptr<float>()[i * 12 + j], s[(i / 2) * 3 + j / 4]);
  }
  // e8m0 bytes widen as vLLM does (bits << 23): 127 -> 1.0, 130 -> 8.0.
  std::vector<uint8_t> e = {127, 130};
  Tensor ue = upsample_block_scales(TensorView(e.data(), DType::kF8E8M0FNU, {1, 2}), 1, 1);
  EXPECT_EQ(ue.ptr<float>()[0], 1.0f);
  EXPECT_EQ(ue.ptr<float>()[1], 8.0f);
}

TEST(TpShard, W13HalvesWriteDisjointScaleRows) {  // pitfall 4 (merged-column partitions)
  for (const Case c :
       {Case{768, 256, 4, TpShardMode::kRefine, 64}, Case{512, 256, 8, TpShardMode::kRefine, 64},
        Case{640, 256, 4, TpShardMode::kPad, 128}, Case{2048, 256, 8, TpShardMode::kKeep, 128}}) {
    const TpShard sh = shards_for(c)[0];
    const Proj gate = make_proj(c.I, c.H, 128, 128, 1);
    const auto a = sh.w13_scale_shape(2);
    // Rows = sum over the two partitions of ceil(partition / block).
    EXPECT_EQ(a[0], 2 * cdiv(sh.local_size, sh.block[0]));
    Tensor w13 = Tensor::empty({2 * sh.local_size, c.H}, DType::kF8E4M3FN);
    Tensor s13 = Tensor::empty({a[0], a[1]}, DType::kF32);
    std::fill_n(s13.ptr<float>(), s13.numel(), std::nanf(""));
    load_w13_block_shard(sh, 0, gate.wv(), gate.sv(), w13, s13, "gate");
    for (int64_t r = 0; r < a[0]; ++r) {
      for (int64_t k = 0; k < a[1]; ++k) {
        EXPECT_EQ(std::isnan(s13.ptr<float>()[r * a[1] + k]), r >= a[0] / 2) << r;
      }
    }
  }
}

TEST(TpShard, DownProjectionKErrorIsNotMaskedByN) {  // pitfall 5
  // N fits, K does not: the K message must come out.
  EXPECT_TRUE(throws_with<ValueError>(
      [] {
        validate_fp8_block_shape_moe(192, {64, 128}, 4);
      },
      {"input_size of down's weight = 192", "block_k = 128"}));
  EXPECT_TRUE(throws_with<ValueError>(
      [] {
        validate_fp8_block_shape_moe(192, {128, 128}, 4);
      },
      {"output_size of gate's and up's weight = 192", "block_n = 128",
       "--enable-expert-parallel"}));
  EXPECT_NO_THROW(validate_fp8_block_shape_moe(192, {64, 128}, 1));  // K unchecked at TP=1
  EXPECT_NO_THROW(validate_fp8_block_shape_moe(256, {128, 128}, 8));
  // K shards refine exactly like N (w2 columns): I=576 over 3 ranks is 192, refined to 64.
  EXPECT_EQ(check_case({576, 256, 3, TpShardMode::kRefine, 64}), 0);
}

TEST(TpShard, PreShardedInputIsRejectedUnderPad) {
  const TpShard sh = shards_for({640, 256, 4, TpShardMode::kPad, 128})[1];
  const Proj sharded = make_proj(160, 256, 128, 128, 1);  // what a pre-sharded TP4 file holds
  Tensor w13 = Tensor::empty({512, 256}, DType::kF8E4M3FN);
  Tensor s13 = Tensor::empty({4, 2}, DType::kF32);
  EXPECT_TRUE(throws_with<ValueError>(
      [&] { load_w13_block_shard(sh, 0, sharded.wv(), sharded.sv(), w13, s13, "w1"); },
      {"unsharded checkpoint", "of size 640, got 160"}));
  const Proj down_sharded = make_proj(256, 160, 128, 128, 1);
  Tensor w2 = Tensor::empty({256, 256}, DType::kF8E4M3FN);
  Tensor s2 = Tensor::empty({2, 2}, DType::kF32);
  EXPECT_TRUE(throws_with<ValueError>(
      [&] { load_w2_block_shard(sh, down_sharded.wv(), down_sharded.sv(), w2, s2, "w2"); },
      {"unsharded checkpoint"}));
}

TEST(TpShard, WrongSourceShapesAndDtypesAreFormatErrors) {
  const TpShard sh = shards_for({768, 256, 4, TpShardMode::kRefine, 64})[0];
  const Proj gate = make_proj(768, 256, 128, 128, 1);
  Tensor w13 = Tensor::empty({384, 256}, DType::kF8E4M3FN);
  Tensor s13 = Tensor::empty({6, 4}, DType::kF32);
  const Proj wrong = make_proj(768, 128, 128, 128, 1);
  EXPECT_TRUE(throws_with<FormatError>(
      [&] { load_w13_block_shard(sh, 0, wrong.wv(), wrong.sv(), w13, s13, "experts.0.gate_proj"); },
      {"experts.0.gate_proj", "[768, 128]", "expected [768, 256]"}));
  std::vector<float> bad_scale(5 * 2);
  EXPECT_TRUE(throws_with<FormatError>(
      [&] {
        load_w13_block_shard(sh, 0, gate.wv(), TensorView(bad_scale.data(), DType::kF32, {5, 2}),
                             w13, s13, "g");
      },
      {"g scale", "expected [6, 2]"}));
  TensorView bf16 = gate.wv();
  bf16.dtype = DType::kU8;
  EXPECT_TRUE(throws_with<FormatError>(
      [&] { load_w13_block_shard(sh, 0, bf16, gate.sv(), w13, s13, "g"); }, {"float8_e4m3fn"}));
}

TEST(TpShard, InconsistentDecisionsAreRejected) {
  EXPECT_THROW(make_tp_shard(768, 256, 4, 4, {128, 128}, {128, 128}, std::nullopt, false, 192),
               ValueError);  // rank outside the group
  EXPECT_TRUE(throws_with<ValueError>(
      [] {
        make_tp_shard(768, 256, 4, 0, {128, 128}, {128, 128}, std::nullopt, false, 192);
      },
      {"output_size of gate's and up's weight = 192"}));  // keep needs whole blocks
  EXPECT_THROW(
      make_tp_shard(768, 256, 4, 0, {128, 128}, {64, 64}, std::array<int64_t, 2>{4, 4}, false, 192),
      ValueError);  // 64 * 4 != 128
  EXPECT_THROW(make_tp_shard(768, 256, 4, 0, {128, 128}, {64, 64}, std::nullopt, false, 192),
               ValueError);  // block changed without a refine factor
  EXPECT_THROW(make_tp_shard(640, 256, 4, 0, {128, 128}, {128, 128}, std::nullopt, true, 160),
               ValueError);  // padded size not a block multiple
  const TpShard p = make_tp_shard(640, 256, 8, 6, {128, 128}, {128, 128}, std::nullopt, true, 128);
  EXPECT_NE(p.describe().find("pad"), std::string::npos);
}

// ---- EP placement (pitfall 22)
// -------------------------------------------------------------------------

TEST(ExpertPlacement, LinearIsContiguousAndBalanced) {  // pitfall 22
  const std::vector<int> expect = {22, 22, 21, 21, 21, 21};
  std::vector<int> owner(128, -1);
  int next = 0;
  for (int r = 0; r < 6; ++r) {
    const ExpertPlacement p = place_experts(128, 6, r);
    EXPECT_EQ(p.num_local(), expect[r]);
    for (int i = 0; i < p.num_local(); ++i) {
      EXPECT_EQ(p.local_to_global[i], next++);  // contiguous, in rank order
      EXPECT_EQ(p.expert_map[p.local_to_global[i]], i);
      owner[p.local_to_global[i]] = r;
    }
    int remote = 0;
    for (int e = 0; e < 128; ++e) remote += p.expert_map[e] == -1;
    EXPECT_EQ(remote, 128 - expect[r]);
  }
  EXPECT_EQ(next, 128);
  for (int e = 0; e < 128; ++e) EXPECT_NE(owner[e], -1);
}

TEST(ExpertPlacement, RoundRobinAndErrors) {
  const ExpertPlacement p = place_experts(10, 4, 1, ExpertPlacementStrategy::kRoundRobin);
  EXPECT_EQ(p.local_to_global, (std::vector<int>{1, 5, 9}));
  EXPECT_EQ(p.expert_map[5], 1);
  EXPECT_EQ(p.expert_map[0], -1);
  EXPECT_EQ(place_experts(4, 8, 3).num_local(), 1);
  EXPECT_EQ(place_experts(4, 8, 5).num_local(), 0);  // more ranks than experts: an empty rank
  EXPECT_EQ(place_experts(4, 8, 5).expert_map, (std::vector<int32_t>{-1, -1, -1, -1}));
  EXPECT_THROW(place_experts(8, 2, 2), ValueError);
  const ExpertPlacement one = place_experts(8, 1, 0);
  EXPECT_EQ(one.num_local(), 8);
}

}  // namespace
}  // namespace fp8moe
