// MoeScheme from a MoeQuantConfig (vLLM's FusedMoEQuantConfig shapes), its printable name, and
// the reference's robustness to garbage in rows nobody reads (pitfall 20).
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "common/moe_testing.hpp"
#include "fp8moe/error.hpp"
#include "fp8moe/fused_moe.hpp"
#include "fp8moe/numerics.hpp"

namespace fp8moe {
namespace {

MoeQuantConfig fp8_config(std::optional<GroupShape> a, std::optional<GroupShape> w,
                          bool static_a = false) {
  MoeQuantConfig qc;
  qc.a1.dtype = qc.a2.dtype = QuantDType::kFp8E4M3FN;
  qc.a1.shape = qc.a2.shape = a;
  qc.w1.dtype = qc.w2.dtype = QuantDType::kFp8E4M3FN;
  qc.w1.shape = qc.w2.shape = w;
  if (static_a) qc.a1.scale = Tensor::scalar_f32(0.5f);
  return qc;
}

TEST(RefScheme, FromQuantConfig) {
  // Block: make(block_shape=[128,128]) sets both a and w shapes to the block.
  MoeScheme s =
      MoeScheme::from_quant_config(fp8_config(GroupShape(128, 128), GroupShape(128, 128)));
  EXPECT_EQ(s.weight, WeightScaleKind::kBlock);
  EXPECT_EQ(s.block_n, 128);
  EXPECT_EQ(s.act, ActQuantKind::kPerGroupDynamic);
  EXPECT_EQ(s.group_k, 128);
  EXPECT_EQ(s.str(), "w:block128x128 a:group128");
  // Refined blocks.
  s = MoeScheme::from_quant_config(fp8_config(GroupShape(64, 64), GroupShape(64, 64)));
  EXPECT_EQ(s.str(), "w:block64x64 a:group64");
  // Per-tensor, static or dynamic activations.
  s = MoeScheme::from_quant_config(fp8_config(kPerTensor, std::nullopt, true));
  EXPECT_EQ(s.str(), "w:tensor a:tensor-static");
  s = MoeScheme::from_quant_config(fp8_config(kPerTensor, std::nullopt));
  EXPECT_EQ(s.act, ActQuantKind::kPerTensorDynamic);
  // Per-channel weights are encoded with the (1, -1) shape, with per-token activations.
  s = MoeScheme::from_quant_config(fp8_config(kPerToken, kPerToken));
  EXPECT_EQ(s.str(), "w:channel a:token");
  // W8A16 (fp8_w8a16_moe_quant_config): no activation dtype, the weight keeps its block.
  MoeQuantConfig w16;
  w16.w1.dtype = QuantDType::kFp8E4M3FN;
  w16.w1.shape = GroupShape(128, 128);
  s = MoeScheme::from_quant_config(w16);
  EXPECT_EQ(s.str(), "w:block128x128 a:none");
  // MXFP8: make("mxfp8", block_shape=[1,32]).
  MoeQuantConfig mx;
  mx.a1.dtype = mx.w1.dtype = QuantDType::kMxfp8;
  mx.a1.shape = mx.w1.shape = GroupShape(1, 32);
  s = MoeScheme::from_quant_config(mx);
  EXPECT_EQ(s.str(), "w:mx a:mxfp8");
  // fnuz.
  MoeQuantConfig uz = fp8_config(GroupShape(128, 128), GroupShape(128, 128));
  uz.a1.dtype = uz.w1.dtype = QuantDType::kFp8E4M3FNUZ;
  s = MoeScheme::from_quant_config(uz);
  EXPECT_EQ(s.fp8, DType::kF8E4M3FNUZ);
  EXPECT_EQ(s.str(), "w:block128x128 a:group128 fp8_e4m3fnuz");
  // Not fp8.
  MoeQuantConfig bad;
  bad.w1.dtype = QuantDType::kNvfp4;
  EXPECT_THROW(MoeScheme::from_quant_config(bad), ValueError);
  EXPECT_THROW(MoeScheme::from_quant_config(MoeQuantConfig{}), ValueError);
  MoeQuantConfig mixed = fp8_config(GroupShape(128, 128), GroupShape(128, 128));
  mixed.a1.dtype = QuantDType::kMxfp8;
  EXPECT_THROW(MoeScheme::from_quant_config(mixed), ValueError);
}

TEST(RefScheme, GarbageInUnroutedRowsDoesNotLeak) {  // pitfall 20
  // Tokens whose every slot is padded may hold NaN (torch.empty garbage); the other rows must be
  // bit-identical to a clean run, for per-group and for per-tensor dynamic activations (whose
  // fmaxf amax drops NaN).
  for (ActQuantKind act : {ActQuantKind::kPerGroupDynamic, ActQuantKind::kPerTensorDynamic}) {
    testing::MoeTestSpec s;
    s.M = 6;
    s.H = s.I = 128;
    s.scheme.act = act;
    s.scheme.weight = act == ActQuantKind::kPerGroupDynamic ? WeightScaleKind::kBlock
                                                            : WeightScaleKind::kPerTensor;
    s.mode = testing::MoeTestMode::kExact;
    const testing::MoeTestProblem p = testing::make_problem(s);
    const Tensor clean = testing::reference_output(p);
    testing::MoeTestProblem q = p;
    q.x = p.x.clone();
    q.topk_ids = p.topk_ids.clone();
    for (int64_t k = 0; k < s.H; ++k) q.x.ptr<uint16_t>()[2 * s.H + k] = 0x7FC0;  // NaN row 2
    for (int j = 0; j < s.topk; ++j) q.topk_ids.ptr<int32_t>()[2 * s.topk + j] = -1;
    const Tensor dirty = testing::reference_output(q);
    for (int64_t t = 0; t < s.M; ++t) {
      for (int64_t m = 0; m < s.H; ++m) {
        const int64_t i = t * s.H + m;
        if (t == 2) {
          EXPECT_EQ(dirty.ptr<uint16_t>()[i], 0) << "an unrouted token's output is zero";
        } else {
          ASSERT_EQ(dirty.ptr<uint16_t>()[i], clean.ptr<uint16_t>()[i]) << "token " << t;
        }
      }
    }
  }
}

}  // namespace
}  // namespace fp8moe
