// make_fp8_moe_quant_config: every branch of the seed (CPU_W8A8, MARLIN/CPU W8A16, HUMMING,
// FLASHINFER_CUTLASS/HPC per-tensor alphas shared with the layer, MXFP8, the default), the
// MoeQuantConfig properties of oracle.md §3.7, and _humming_fp8_weight_schema.
#include <gtest/gtest.h>

#include "fp8moe/error.hpp"
#include "fp8moe/oracle.hpp"
#include "unit/oracle_test_util.hpp"

namespace fp8moe {
namespace {

using testing::msg_of;

Tensor filled(std::initializer_list<int64_t> shape, std::initializer_list<float> values) {
  Tensor t = Tensor::empty(shape, DType::kF32);
  float* p = t.ptr<float>();
  std::size_t i = 0;
  for (float v : values) p[i++] = v;
  EXPECT_EQ(static_cast<int64_t>(i), t.numel());
  return t;
}

Fp8QuantConfigInputs block_inputs() {
  Fp8QuantConfigInputs in;
  in.w1_scale = Tensor::zeros({2, 12, 16}, DType::kF32);
  in.w2_scale = Tensor::zeros({2, 16, 6}, DType::kF32);
  in.w1_bias = Tensor::zeros({2, 1536}, DType::kF32);
  in.w2_bias = Tensor::zeros({2, 2048}, DType::kF32);
  in.block_shape = std::vector<int64_t>{128, 128};
  in.swiglu_limit = 7.0;
  in.gemm1_alpha = 1.702;
  in.gemm1_beta = 1.0;
  return in;
}

TEST(QuantConfig, CpuW8A8CarriesNoBiasesNorSwiglu) {  // pitfall 17
  Fp8QuantConfigInputs in = block_inputs();
  in.a1_scale = Tensor::scalar_f32(0.5f);
  in.a2_scale = Tensor::scalar_f32(0.25f);
  const MoeQuantConfig qc = make_fp8_moe_quant_config(Fp8MoeBackend::kCpuW8A8, in);
  EXPECT_EQ(qc.quant_dtype(), QuantDType::kFp8E4M3FN);
  EXPECT_EQ(qc.block_shape(), (std::vector<int64_t>{128, 128}));
  EXPECT_TRUE(qc.use_fp8_w8a8());
  EXPECT_EQ(qc.a1_scale().data(), in.a1_scale.data());
  EXPECT_FALSE(qc.a2_scale().defined());
  EXPECT_FALSE(qc.w1_bias().defined());
  EXPECT_FALSE(qc.w2_bias().defined());
  EXPECT_EQ(qc.gemm1_alpha, std::nullopt);
  EXPECT_EQ(qc.gemm1_beta, std::nullopt);
  EXPECT_EQ(qc.gemm1_clamp_limit, std::nullopt);
  EXPECT_EQ(qc.config_name(DType::kBF16), "fp8_w8a8");
}

TEST(QuantConfig, MarlinAndCpuAreW8A16) {
  for (Fp8MoeBackend b : {Fp8MoeBackend::kMarlin, Fp8MoeBackend::kCpu}) {
    SCOPED_TRACE(backend_value(b));
    const Fp8QuantConfigInputs in = block_inputs();
    const MoeQuantConfig qc = make_fp8_moe_quant_config(b, in);
    EXPECT_EQ(qc.quant_dtype(), std::nullopt);
    EXPECT_EQ(qc.weight_quant_dtype(), QuantDType::kFp8E4M3FN);
    EXPECT_EQ(qc.w1.shape, GroupShape(128, 128));
    EXPECT_EQ(qc.block_shape(), std::nullopt);  // derived from the (unquantised) activations
    EXPECT_TRUE(qc.use_fp8_w8a16());
    EXPECT_FALSE(qc.use_fp8_w8a8());
    EXPECT_EQ(qc.config_name(DType::kBF16), "fp8_w8a16");
    EXPECT_EQ(qc.w1_bias().data(), in.w1_bias.data());
    EXPECT_EQ(qc.gemm1_clamp_limit, 7.0);
    EXPECT_EQ(qc.gemm1_alpha, 1.702);
    EXPECT_EQ(qc.gemm1_beta, 1.0);
  }
  Fp8QuantConfigInputs per_tensor = block_inputs();
  per_tensor.block_shape = std::nullopt;
  EXPECT_EQ(make_fp8_moe_quant_config(Fp8MoeBackend::kMarlin, per_tensor).w1.shape, std::nullopt);
}

TEST(QuantConfig, FlashinferCutlassAndHpcPerTensorAlphas) {
  for (Fp8MoeBackend b : {Fp8MoeBackend::kFlashinferCutlass, Fp8MoeBackend::kHpc}) {
    SCOPED_TRACE(backend_value(b));
    Fp8QuantConfigInputs in;
    in.w1_scale = filled({3}, {1.0f, 2.0f, 4.0f});
    in.w2_scale = filled({3}, {0.5f, 0.25f, 8.0f});
    in.a1_scale = Tensor::scalar_f32(0.5f);
    in.a2_scale = Tensor::scalar_f32(4.0f);
    in.swiglu_limit = 10.0;
    in.gemm1_alpha = 1.702;
    in.gemm1_beta = 1.0;
    Fp8MoeLayerState layer;
    in.layer = &layer;
    const MoeQuantConfig qc = make_fp8_moe_quant_config(b, in);
    ASSERT_TRUE(qc.g1_alphas().defined());
    const float* g1 = qc.g1_alphas().ptr<float>();
    const float* g2 = qc.g2_alphas().ptr<float>();
    EXPECT_EQ(qc.g1_alphas().sizes(), (std::vector<int64_t>{3}));
    EXPECT_FLOAT_EQ(g1[0], 0.5f);
    EXPECT_FLOAT_EQ(g1[1], 1.0f);
    EXPECT_FLOAT_EQ(g1[2], 2.0f);
    EXPECT_FLOAT_EQ(g2[0], 2.0f);
    EXPECT_FLOAT_EQ(g2[1], 1.0f);
    EXPECT_FLOAT_EQ(g2[2], 32.0f);
    EXPECT_FLOAT_EQ(qc.a1_gscale().ptr<float>()[0], 2.0f);
    EXPECT_FLOAT_EQ(qc.a2_gscale().ptr<float>()[0], 0.25f);
    // The layer's parameters and the config's alphas are the same storage (EPLB sees updates).
    EXPECT_EQ(layer.g1_alphas.data(), qc.g1_alphas().data());
    EXPECT_EQ(layer.g2_alphas.data(), qc.g2_alphas().data());
    layer.g1_alphas.ptr<float>()[0] = 9.0f;
    EXPECT_FLOAT_EQ(qc.g1_alphas().ptr<float>()[0], 9.0f);
    // gemm1_alpha / gemm1_beta are dropped in this branch; the clamp is kept.
    EXPECT_EQ(qc.gemm1_alpha, std::nullopt);
    EXPECT_EQ(qc.gemm1_beta, std::nullopt);
    EXPECT_EQ(qc.gemm1_clamp_limit, 10.0);
    EXPECT_TRUE(qc.is_per_tensor());
    EXPECT_TRUE(qc.use_fp8_w8a8());
    EXPECT_EQ(qc.w1.shape, std::nullopt);
    // Without a layer the config owns its alphas.
    in.layer = nullptr;
    EXPECT_TRUE(make_fp8_moe_quant_config(b, in).g1_alphas().defined());
    // Static activation scales are required.
    in.a2_scale = Tensor();
    EXPECT_EQ(msg_of([&] { make_fp8_moe_quant_config(b, in); }),
              "ValueError: " + backend_value(b) +
                  " per-tensor FP8 needs static activation scales: a1_scale and a2_scale must be "
                  "given");
  }
  // Per-expert input scales multiply element-wise; mismatched shapes are an error.
  Fp8QuantConfigInputs in;
  in.w1_scale = filled({2}, {1.0f, 2.0f});
  in.w2_scale = filled({2}, {1.0f, 2.0f});
  in.a1_scale = filled({2}, {3.0f, 5.0f});
  in.a2_scale = filled({3}, {1.0f, 1.0f, 1.0f});
  EXPECT_EQ(msg_of([&] { make_fp8_moe_quant_config(Fp8MoeBackend::kFlashinferCutlass, in); }),
            "ValueError: cannot broadcast w2_scale (2,) f32 cpu with a2_scale (3,) f32 cpu");
  // With a block shape FLASHINFER_CUTLASS takes the default branch.
  const MoeQuantConfig blk =
      make_fp8_moe_quant_config(Fp8MoeBackend::kFlashinferCutlass, block_inputs());
  EXPECT_FALSE(blk.g1_alphas().defined());
  EXPECT_EQ(blk.block_shape(), (std::vector<int64_t>{128, 128}));
  EXPECT_EQ(blk.gemm1_alpha, 1.702);
}

TEST(QuantConfig, Mxfp8) {
  Fp8QuantConfigInputs in;
  in.w1_scale = Tensor::zeros({2, 64, 4}, DType::kU8);
  in.w2_scale = Tensor::zeros({2, 128, 1}, DType::kU8);
  in.block_shape = std::vector<int64_t>{1, 32};
  in.gemm1_alpha = 1.5;
  in.swiglu_limit = 7.0;
  for (Fp8MoeBackend b : {Fp8MoeBackend::kTriton, Fp8MoeBackend::kFlashinferTrtllm,
                          Fp8MoeBackend::kFlashinferCutlass, Fp8MoeBackend::kDeepGemm}) {
    SCOPED_TRACE(backend_value(b));
    const MoeQuantConfig qc = make_fp8_moe_quant_config(b, in);
    EXPECT_EQ(qc.quant_dtype(), QuantDType::kMxfp8);
    EXPECT_EQ(qc.weight_quant_dtype(), QuantDType::kMxfp8);
    EXPECT_EQ(qc.block_shape(), (std::vector<int64_t>{1, 32}));
    EXPECT_FALSE(qc.is_scale_swizzled);
    EXPECT_TRUE(qc.use_mxfp8());
    EXPECT_FALSE(qc.use_fp8_w8a8());
    EXPECT_EQ(qc.config_name(DType::kBF16), "");  // OCP MX: None
    EXPECT_EQ(qc.gemm1_alpha, 1.5);
    EXPECT_EQ(qc.gemm1_clamp_limit, 7.0);
  }
}

TEST(QuantConfig, DefaultBranch) {
  const MoeQuantConfig blk = make_fp8_moe_quant_config(Fp8MoeBackend::kTriton, block_inputs());
  EXPECT_EQ(blk.a1.shape, GroupShape(128, 128));
  EXPECT_EQ(blk.w1.shape, GroupShape(128, 128));
  EXPECT_EQ(blk.block_shape(), (std::vector<int64_t>{128, 128}));
  EXPECT_TRUE(blk.is_scale_swizzled);
  EXPECT_EQ(blk.gemm1_beta, 1.0);
  EXPECT_EQ(blk.config_name(DType::kBF16), "fp8_w8a8");

  Fp8QuantConfigInputs ptpc;
  ptpc.w1_scale = Tensor::zeros({2, 1536}, DType::kF32);
  ptpc.w2_scale = Tensor::zeros({2, 2048}, DType::kF32);
  ptpc.per_act_token_quant = true;
  ptpc.per_out_ch_quant = true;
  const MoeQuantConfig t = make_fp8_moe_quant_config(Fp8MoeBackend::kTriton, ptpc);
  EXPECT_TRUE(t.per_act_token_quant());
  EXPECT_TRUE(t.per_out_ch_quant());
  EXPECT_EQ(t.w1.shape, kPerToken);  // per-output-channel encoded as (1, -1)
  EXPECT_EQ(t.block_shape(), std::nullopt);
  EXPECT_FALSE(t.is_per_tensor());

  Fp8QuantConfigInputs pt;
  pt.w1_scale = Tensor::zeros({2}, DType::kF32);
  pt.w2_scale = Tensor::zeros({2}, DType::kF32);
  pt.a1_scale = Tensor::scalar_f32(1.0f);
  pt.a2_scale = Tensor::scalar_f32(1.0f);
  const MoeQuantConfig tt = make_fp8_moe_quant_config(Fp8MoeBackend::kTriton, pt);
  EXPECT_TRUE(tt.is_per_tensor());
  EXPECT_EQ(tt.w1.shape, std::nullopt);
  EXPECT_FALSE(tt.g1_alphas().defined());

  Fp8QuantConfigInputs both = block_inputs();
  both.per_act_token_quant = true;
  EXPECT_EQ(msg_of([&] { make_fp8_moe_quant_config(Fp8MoeBackend::kTriton, both); }),
            "ValueError: block_shape cannot be combined with per_act_token_quant or "
            "per_out_ch_quant");
  Fp8QuantConfigInputs fnuz = block_inputs();
  fnuz.fp8_dtype = QuantDType::kFp8E4M3FNUZ;
  const MoeQuantConfig f = make_fp8_moe_quant_config(Fp8MoeBackend::kTriton, fnuz);
  EXPECT_EQ(f.quant_dtype(), QuantDType::kFp8E4M3FNUZ);
  EXPECT_TRUE(f.use_fp8_w8a8(QuantDType::kFp8E4M3FNUZ));
  EXPECT_EQ(f.config_name(DType::kBF16), "fp8_w8a8");
}

TEST(QuantConfig, Humming) {
  Fp8QuantConfigInputs in = block_inputs();
  EXPECT_EQ(msg_of([&] { make_fp8_moe_quant_config(Fp8MoeBackend::kHumming, in); }),
            "ValueError: make_fp8_moe_quant_config(HUMMING) needs the layer: the Humming quant "
            "config is built from the layer's Humming schemas");
  Fp8MoeLayerState layer;
  layer.weight_block_size = std::vector<int64_t>{128, 128};
  in.layer = &layer;
  MoeQuantConfig qc = make_fp8_moe_quant_config(Fp8MoeBackend::kHumming, in);
  EXPECT_EQ(qc.quant_dtype(), std::nullopt);
  EXPECT_EQ(qc.w1.shape, GroupShape(128, 128));
  EXPECT_EQ(qc.gemm1_clamp_limit, 7.0);
  EXPECT_EQ(qc.gemm1_alpha, 1.702);
  layer.humming_quantizes_inputs = true;
  qc = make_fp8_moe_quant_config(Fp8MoeBackend::kHumming, in);
  EXPECT_EQ(qc.quant_dtype(), QuantDType::kFp8E4M3FN);
  EXPECT_TRUE(qc.per_act_token_quant());
}

TEST(QuantConfig, DescribeAndNames) {
  EXPECT_EQ(quant_dtype_name(QuantDType::kFp8E4M3FN), "torch.float8_e4m3fn");
  EXPECT_EQ(quant_dtype_name(QuantDType::kMxfp8), "mxfp8");
  const MoeQuantConfig qc = make_fp8_moe_quant_config(Fp8MoeBackend::kTriton, block_inputs());
  const std::string d = qc.describe();
  EXPECT_NE(d.find("quant_dtype=torch.float8_e4m3fn"), std::string::npos) << d;
  EXPECT_NE(d.find("block_shape=[128, 128]"), std::string::npos) << d;
  EXPECT_NE(d.find("shape=GroupShape(row=128, col=128), scale=(2, 12, 16) f32 cpu"),
            std::string::npos)
      << d;
  MoeQuantConfig unq;
  EXPECT_EQ(unq.config_name(DType::kF32), "float32");
  EXPECT_EQ(unq.config_name(DType::kBF16), "");
}

TEST(QuantConfig, ScaleShapeAndDtypeFlags) {
  const MoeQuantConfig blk = make_fp8_moe_quant_config(Fp8MoeBackend::kTriton, block_inputs());
  EXPECT_EQ(blk.scale_shape(33, 2050), (std::array<int64_t, 2>{33, 17}));
  EXPECT_TRUE(blk.is_block_quantized());
  Fp8QuantConfigInputs tok;
  tok.w1_scale = Tensor::zeros({2, 1536}, DType::kF32);
  tok.w2_scale = Tensor::zeros({2, 2048}, DType::kF32);
  tok.per_act_token_quant = true;
  EXPECT_EQ(make_fp8_moe_quant_config(Fp8MoeBackend::kTriton, tok).scale_shape(33, 2048),
            (std::array<int64_t, 2>{33, 1}));
  tok.per_act_token_quant = false;
  EXPECT_EQ(make_fp8_moe_quant_config(Fp8MoeBackend::kTriton, tok).scale_shape(33, 2048),
            (std::array<int64_t, 2>{1, 1}));
  const MoeQuantConfig w8a16 = make_fp8_moe_quant_config(Fp8MoeBackend::kCpu, block_inputs());
  EXPECT_EQ(w8a16.scale_shape(33, 2048), std::nullopt);
  EXPECT_FALSE(w8a16.is_quantized());
  MoeQuantConfigArgs i8;
  i8.quant_dtype = QuantDType::kInt8;
  EXPECT_TRUE(make_moe_quant_config(i8).use_int8_w8a8());
  MoeQuantConfigArgs w4;
  w4.weight_dtype = QuantDType::kInt4;
  const MoeQuantConfig w4a16 = make_moe_quant_config(w4);
  EXPECT_TRUE(w4a16.use_int4_w4a16());
  EXPECT_EQ(w4a16.config_name(DType::kBF16), "int4_w4a16");
  MoeQuantConfigArgs mx4;
  mx4.quant_dtype = QuantDType::kMxfp4;
  EXPECT_TRUE(make_moe_quant_config(mx4).use_mxfp4_w4a4());
  EXPECT_EQ(make_moe_quant_config(mx4).config_name(DType::kF32), "");  // OCP MX wins over f32
}

TEST(HummingSchema, AllThreeForms) {
  Fp8MoeLayerState layer;
  const Tensor w = Tensor::zeros({4, 256, 128}, DType::kF8E4M3FN);
  const Tensor mx_scale = Tensor::zeros({4, 256, 4}, DType::kU8);
  EXPECT_EQ(humming_fp8_weight_schema(layer, w, mx_scale).dump(),
            R"({"quant_method":"modelopt","quant_algo":"mxfp8"})");
  layer.has_w13_weight_scale_inv = true;
  const Tensor block_scale = Tensor::zeros({4, 2, 1}, DType::kF32);
  EXPECT_THROW(humming_fp8_weight_schema(layer, w, block_scale), ValueError);
  layer.weight_block_size = std::vector<int64_t>{128, 128};
  EXPECT_EQ(humming_fp8_weight_schema(layer, w, block_scale).dump(),
            R"({"quant_method":"fp8","weight_block_size":[128,128]})");
  layer.has_w13_weight_scale_inv = false;
  EXPECT_EQ(humming_fp8_weight_schema(layer, w, block_scale).dump(),
            R"({"quant_method":"compressed-tensors","format":"float-quantized","type":"float",)"
            R"("num_bits":8,"symmetric":true,"strategy":"block","block_structure":[128,128]})");
  layer.weight_block_size = std::nullopt;
  EXPECT_EQ(humming_fp8_weight_schema(layer, w, Tensor::zeros({4, 256}, DType::kF32))["strategy"],
            "channel");
  EXPECT_EQ(humming_fp8_weight_schema(layer, w, Tensor::zeros({4}, DType::kF32))["strategy"],
            "tensor");
}

}  // namespace
}  // namespace fp8moe
