// config.json and quantization_config: the real models' configs (examples/configs), the key
// derivation of each vLLM MoE method (spec/oracle.md §5.1) with its oddities, and malformed
// configs.
#include <gtest/gtest.h>

#include <string>

#include "fp8moe/checkpoint.hpp"
#include "fp8moe/error.hpp"
#include "test_checkpoint_util.hpp"

namespace fp8moe {
namespace {

using test::throws_with;

ModelConfig real(const std::string& name) {
  return load_model_config(std::string(FP8MOE_SOURCE_DIR) + "/examples/configs/" + name);
}

TEST(ModelConfig, DeepSeekV3) {
  const ModelConfig m = real("DeepSeek-V3");
  EXPECT_EQ(m.family, ModelFamily::kDeepseekV3);
  EXPECT_EQ(m.hidden_size, 7168);
  EXPECT_EQ(m.moe_intermediate_size, 2048);
  EXPECT_EQ(m.num_experts, 256);
  EXPECT_EQ(m.num_experts_per_tok, 8);
  ASSERT_EQ(m.moe_layers.size(), 58u);  // first_k_dense_replace = 3 of 61
  EXPECT_EQ(m.moe_layers.front(), 3);
  EXPECT_EQ(m.moe_layers.back(), 60);
  EXPECT_EQ(m.num_expert_group, 8);
  EXPECT_EQ(m.topk_group, 4);
  EXPECT_TRUE(m.has_e_score_bias);
  EXPECT_EQ(m.routed_scaling_factor, 2.5);
  EXPECT_EQ(m.routing_method, RoutingMethodType::kDeepSeekV3);
  EXPECT_EQ(m.num_shared_experts, 1);
  EXPECT_EQ(m.num_nextn_predict_layers, 1);
  const CheckpointQuant& q = m.quant;
  EXPECT_EQ(q.method, QuantMethod::kFp8);
  EXPECT_EQ(q.moe_method, "Fp8MoEMethod");
  EXPECT_TRUE(q.moe_fp8);
  EXPECT_TRUE(q.is_checkpoint_fp8_serialized);
  EXPECT_TRUE(q.block_resolvable);
  EXPECT_EQ(q.weight_key, kFp8Static128BlockSym);
  EXPECT_EQ(q.activation_key, kFp8Dynamic128Sym);
  EXPECT_FALSE(q.allow_vllm_cutlass);
  EXPECT_EQ(q.block_shape, (std::vector<int64_t>{128, 128}));
  EXPECT_EQ(q.weight_scale_suffix, "weight_scale_inv");
  EXPECT_FALSE(q.scale_fmt_ue8m0);
  EXPECT_EQ(expert_weight_name(m, 3, 7, ExpertProj::kUp),
            "model.layers.3.mlp.experts.7.up_proj.weight");
  EXPECT_EQ(expert_scale_name(m, 3, 7, ExpertProj::kDown),
            "model.layers.3.mlp.experts.7.down_proj.weight_scale_inv");
}

TEST(ModelConfig, DeepSeekV31DeclaresUe8m0Scales) {
  const ModelConfig m = real("DeepSeek-V3.1");
  EXPECT_TRUE(m.quant.scale_fmt_ue8m0);
  EXPECT_NE(m.quant.describe().find("ue8m0"), std::string::npos);
}

TEST(ModelConfig, KimiK2UsesOneExpertGroup) {
  const ModelConfig m = real("Kimi-K2-Instruct");
  EXPECT_EQ(m.family, ModelFamily::kKimiK2);
  EXPECT_EQ(m.num_experts, 384);
  EXPECT_EQ(m.moe_layers.size(), 60u);
  EXPECT_EQ(m.num_expert_group, 1);
  EXPECT_EQ(m.routing_method, RoutingMethodType::kDeepSeekV3);
  EXPECT_DOUBLE_EQ(m.routed_scaling_factor, 2.827);
}

TEST(ModelConfig, Qwen3Family) {
  const ModelConfig m = real("Qwen3-30B-A3B-FP8");
  EXPECT_EQ(m.family, ModelFamily::kQwen3Moe);
  EXPECT_EQ(m.hidden_size, 2048);
  EXPECT_EQ(m.moe_intermediate_size, 768);
  EXPECT_EQ(m.num_experts, 128);
  EXPECT_EQ(m.moe_layers.size(), 48u);
  EXPECT_TRUE(m.renormalize);
  EXPECT_EQ(m.routing_method, RoutingMethodType::kRenormalizeNaive);
  EXPECT_EQ(m.quant.ignored_layers.size(), 1u + 3 * 48);
  for (int l : m.moe_layers) EXPECT_FALSE(moe_layer_ignored(m, l)) << l;
  EXPECT_EQ(real("Qwen3-235B-A22B-FP8").moe_intermediate_size, 1536);
  const ModelConfig coder = real("Qwen3-Coder-480B-A35B-Instruct-FP8");
  EXPECT_EQ(coder.num_experts, 160);
  EXPECT_EQ(coder.moe_layers.size(), 62u);
  EXPECT_EQ(coder.quant.weight_block_size, (std::array<int64_t, 2>{128, 128}));
  const ModelConfig next = real("Qwen3-Next-80B-A3B-Instruct-FP8");
  EXPECT_EQ(next.family, ModelFamily::kQwen3Next);
  EXPECT_EQ(next.num_experts, 512);
  EXPECT_EQ(next.num_experts_per_tok, 10);
  EXPECT_EQ(next.shared_expert_intermediate_size, 512);
}

TEST(ModelConfig, Glm45IsCompressedTensorsPerChannel) {
  const ModelConfig m = real("GLM-4.5-FP8");
  EXPECT_EQ(m.family, ModelFamily::kGlm4Moe);
  EXPECT_EQ(m.moe_layers.size(), 89u);
  EXPECT_EQ(m.routing_method, RoutingMethodType::kDeepSeekV3);
  const CheckpointQuant& q = m.quant;
  EXPECT_EQ(q.method, QuantMethod::kCompressedTensors);
  EXPECT_EQ(q.moe_method, "CompressedTensorsW8A8Fp8MoEMethod");
  EXPECT_EQ(q.weight_key, kFp8StaticChannelSym);
  EXPECT_EQ(q.activation_key, kFp8DynamicTokenSym);
  EXPECT_TRUE(q.allow_vllm_cutlass);
  EXPECT_TRUE(q.per_act_token_quant);
  EXPECT_TRUE(q.per_out_ch_quant);
  EXPECT_FALSE(q.block_shape.has_value());
  EXPECT_EQ(q.scale_kind, CheckpointScaleKind::kPerChannel);
  EXPECT_EQ(q.weight_scale_suffix, "weight_scale");
}

TEST(ModelConfig, MiniMaxM2) {
  const ModelConfig m = real("MiniMax-M2");
  EXPECT_EQ(m.family, ModelFamily::kMiniMaxM2);
  EXPECT_EQ(m.moe_intermediate_size, 1536);
  EXPECT_EQ(m.num_experts, 256);
  EXPECT_EQ(m.moe_layers.size(), 62u);
  EXPECT_EQ(m.routing_method, RoutingMethodType::kMiniMax2);
  EXPECT_EQ(expert_weight_name(m, 0, 5, ExpertProj::kGate),
            "model.layers.0.block_sparse_moe.experts.5.w1.weight");
  EXPECT_EQ(expert_weight_name(m, 0, 5, ExpertProj::kUp),
            "model.layers.0.block_sparse_moe.experts.5.w3.weight");
  EXPECT_EQ(expert_weight_name(m, 0, 5, ExpertProj::kDown),
            "model.layers.0.block_sparse_moe.experts.5.w2.weight");
  const MoeConfig c = m.moe_config(MoeParallelConfig::make_no_parallel());
  EXPECT_EQ(c.router_logits_dtype, DType::kF32);
}

TEST(ModelConfig, MixtralPerTensorStatic) {
  const ModelConfig m = real("Mixtral-8x7B-Instruct-v0.1-FP8");
  EXPECT_EQ(m.num_experts, 8);
  EXPECT_EQ(m.num_experts_per_tok, 2);
  EXPECT_EQ(m.moe_intermediate_size, 14336);
  const CheckpointQuant& q = m.quant;
  EXPECT_EQ(q.weight_key, kFp8StaticTensorSym);
  EXPECT_EQ(q.activation_key, kFp8StaticTensorSym);
  EXPECT_TRUE(q.static_input_scales);
  EXPECT_EQ(q.scale_kind, CheckpointScaleKind::kPerTensor);
  EXPECT_EQ(expert_input_scale_name(m, 2, 1, ExpertProj::kDown),
            "model.layers.2.block_sparse_moe.experts.1.w2.input_scale");
}

TEST(ModelConfig, Llama4MaverickNestedTextConfig) {
  const ModelConfig m = real("Llama-4-Maverick-17B-128E-Instruct-FP8");
  EXPECT_EQ(m.family, ModelFamily::kLlama4);
  EXPECT_EQ(m.hidden_size, 5120);
  EXPECT_EQ(m.moe_intermediate_size, 8192);
  EXPECT_EQ(m.num_experts_per_tok, 1);
  ASSERT_EQ(m.moe_layers.size(), 24u);  // every second layer
  EXPECT_EQ(m.moe_layers.front(), 1);
  EXPECT_TRUE(m.apply_router_weight_on_input);
  EXPECT_EQ(m.routing_method, RoutingMethodType::kLlama4);
  EXPECT_EQ(m.quant.weight_key, kFp8StaticChannelSym);
  EXPECT_EQ(expert_weight_name(m, 1, 0, ExpertProj::kGate),
            "language_model.model.layers.1.feed_forward.experts.0.gate_proj.weight");
  for (int l : m.moe_layers) EXPECT_FALSE(moe_layer_ignored(m, l));
}

TEST(ModelConfig, GptOssIsNotAnFp8Checkpoint) {
  const ModelConfig m = real("gpt-oss-120b");
  EXPECT_EQ(m.family, ModelFamily::kGptOss);
  EXPECT_EQ(m.activation, MoeActivation::kSwigluOai);
  EXPECT_TRUE(m.has_bias);
  EXPECT_EQ(m.swiglu_limit, 7.0);
  EXPECT_EQ(m.quant.method, QuantMethod::kMxfp4);
  EXPECT_FALSE(m.quant.moe_fp8);
  EXPECT_NE(m.quant.not_fp8_reason.find("Mxfp4MoEMethod"), std::string::npos);
  EXPECT_EQ(expert_naming(m).layout, ExpertLayout::kFusedGptOss);
}

TEST(ModelConfig, MoeConfigForAParallelLayout) {
  const ModelConfig m = real("Qwen3-30B-A3B-FP8");
  const MoeConfig tp4 =
      m.moe_config(MoeParallelConfig::make(4, 1, 1, 1, false, "allgather_reducescatter", false));
  EXPECT_EQ(tp4.intermediate_size_per_partition, 192);
  EXPECT_EQ(tp4.num_local_experts, 128);
  const MoeConfig ep6 =
      m.moe_config(MoeParallelConfig::make(6, 1, 1, 1, true, "allgather_reducescatter", false, 5));
  EXPECT_EQ(ep6.ep_size(), 6);
  EXPECT_EQ(ep6.num_local_experts, 21);  // 128 = 22,22,21,21,21,21
  EXPECT_THROW(
      m.moe_config(MoeParallelConfig::make(5, 1, 1, 1, false, "allgather_reducescatter", false)),
      ValueError);  // 768 % 5
}

// ---- quantization_config key derivation
// -------------------------------------------------------------

TEST(QuantConfig, Fp8PerTensorKeys) {
  CheckpointQuant q =
      parse_quantization_config(R"({"quant_method":"fp8","activation_scheme":"dynamic"})");
  EXPECT_EQ(q.weight_key, kFp8StaticTensorSym);
  EXPECT_EQ(q.activation_key, kFp8DynamicTensorSym);
  EXPECT_EQ(q.weight_scale_suffix, "weight_scale");
  EXPECT_FALSE(q.static_input_scales);
  q = parse_quantization_config(R"({"quant_method":"fp8","activation_scheme":"static"})");
  EXPECT_EQ(q.activation_key, kFp8StaticTensorSym);
  EXPECT_TRUE(q.static_input_scales);
}

TEST(QuantConfig, Fp8NonStandardBlockKeepsItsShape) {
  // [N]: the key encodes the block (before TP resolution); the snapshot would have used B128.
  const CheckpointQuant q = parse_quantization_config(
      R"({"quant_method":"fp8","activation_scheme":"dynamic","weight_block_size":[64,64]})");
  EXPECT_EQ(q.weight_key, create_fp8_quant_key(true, GroupShape(64, 64)));
  EXPECT_NE(q.weight_key, kFp8Static128BlockSym);
  EXPECT_EQ(q.block_shape, (std::vector<int64_t>{64, 64}));
}

TEST(QuantConfig, Fp8ConfigErrorsUseVllmText) {
  EXPECT_TRUE(throws_with<ValueError>(
      [] { parse_quantization_config(R"({"quant_method":"fp8"})"); },
      {"Cannot find any of ['activation_scheme'] in the model's quantization config."}));
  EXPECT_TRUE(throws_with<ValueError>(
      [] { parse_quantization_config(R"({"quant_method":"fp8","activation_scheme":"lazy"})"); },
      {"Unsupported activation scheme lazy"}));
  EXPECT_TRUE(throws_with<ValueError>(
      [] {
        parse_quantization_config(
            R"({"quant_method":"fp8","activation_scheme":"static","weight_block_size":[128,128]})");
      },
      {"The block-wise quantization only supports dynamic activation scheme for now, but got "
       "static activation scheme."}));
  EXPECT_TRUE(throws_with<ValueError>(
      [] {
        parse_quantization_config(
            R"({"quant_method":"fp8","activation_scheme":"dynamic","weight_block_size":[128]})");
      },
      {"must have 2 dimensions, but got 1 dimensions"}));
  EXPECT_TRUE(throws_with<ValueError>(
      [] { parse_quantization_config(R"({"activation_scheme":"dynamic"})"); },
      {"['quant_method']"}));
}

TEST(QuantConfig, IgnoredLayersFallBackToModulesToNotConvert) {
  const CheckpointQuant q = parse_quantization_config(
      R"({"quant_method":"fp8","activation_scheme":"dynamic","ignored_layers":[],)"
      R"("modules_to_not_convert":["lm_head"]})");
  EXPECT_EQ(q.ignored_layers, (std::vector<std::string>{"lm_head"}));
}

std::string ct(const std::string& weights, const std::string& input) {
  return R"({"quant_method":"compressed-tensors","format":"float-quantized","config_groups":{"g":)"
         R"({"targets":["Linear"],"weights":)" +
         weights + R"(,"input_activations":)" + input + "}}}";
}

TEST(QuantConfig, CompressedTensorsOddities) {
  const std::string w_tensor =
      R"({"num_bits":8,"type":"float","strategy":"tensor","dynamic":false})";
  const std::string w_channel =
      R"({"num_bits":8,"type":"float","strategy":"channel","dynamic":false})";
  const std::string w_block =
      R"({"num_bits":8,"type":"float","strategy":"block","block_structure":[64,64],"dynamic":false})";
  const std::string a_tensor_dyn =
      R"({"num_bits":8,"type":"float","strategy":"tensor","dynamic":true})";
  const std::string a_tensor_static =
      R"({"num_bits":8,"type":"float","strategy":"tensor","dynamic":false})";
  const std::string a_token_static =
      R"({"num_bits":8,"type":"float","strategy":"token","dynamic":false})";
  const std::string a_token_dyn =
      R"({"num_bits":8,"type":"float","strategy":"token","dynamic":true})";
  const std::string a_group =
      R"({"num_bits":8,"type":"float","strategy":"group","group_size":128,"dynamic":true})";

  // Dynamic per-tensor input maps to the 1x128 key (sic).
  CheckpointQuant q = parse_quantization_config(ct(w_tensor, a_tensor_dyn));
  EXPECT_EQ(q.weight_key, kFp8StaticTensorSym);
  EXPECT_EQ(q.activation_key, kFp8Dynamic128Sym);
  EXPECT_TRUE(q.allow_vllm_cutlass);
  q = parse_quantization_config(ct(w_tensor, a_tensor_static));
  EXPECT_EQ(q.activation_key, kFp8StaticTensorSym);
  EXPECT_TRUE(q.static_input_scales);
  // Block: B128 whatever block_structure says; block_shape keeps the real one; no refine/pad.
  q = parse_quantization_config(ct(w_block, a_group));
  EXPECT_EQ(q.weight_key, kFp8Static128BlockSym);
  EXPECT_EQ(q.activation_key, kFp8Dynamic128Sym);
  EXPECT_EQ(q.block_shape, (std::vector<int64_t>{64, 64}));
  EXPECT_FALSE(q.block_resolvable);
  q = parse_quantization_config(ct(w_channel, a_token_dyn));
  EXPECT_EQ(q.weight_key, kFp8StaticChannelSym);
  EXPECT_EQ(q.activation_key, kFp8DynamicTokenSym);
  EXPECT_TRUE(throws_with<ValueError>(
      [&] { parse_quantization_config(ct(w_channel, a_token_static)); },
      {"For FP8 Fused MoE layer, we require either per tensor or channelwise, dynamic per token "
       "quantization."}));
  EXPECT_TRUE(throws_with<ValueError>([&] { parse_quantization_config(ct(w_tensor, a_token_dyn)); },
                                      {"'tensor'", "'token'"}));
  // Not FP8 W8A8: reported, not planned.
  q = parse_quantization_config(
      ct(R"({"num_bits":4,"type":"int","strategy":"group","group_size":32})", "null"));
  EXPECT_FALSE(q.moe_fp8);
  EXPECT_NE(q.not_fp8_reason.find("int 4-bit"), std::string::npos);
  q = parse_quantization_config(ct(w_channel, "null"));
  EXPECT_FALSE(q.moe_fp8);
  EXPECT_NE(q.not_fp8_reason.find("W8A16"), std::string::npos);
  q = parse_quantization_config(
      ct(R"({"num_bits":8,"type":"float","strategy":"group","group_size":32})", a_group));
  EXPECT_TRUE(q.uses_mxfp8_oracle);
  EXPECT_EQ(q.weight_key, kMxfp8Static);
}

TEST(QuantConfig, ModelOpt) {
  CheckpointQuant q =
      parse_quantization_config(R"({"quant_method":"modelopt","quant_algo":"FP8"})");
  EXPECT_EQ(q.moe_method, "ModelOptFp8MoEMethod");
  EXPECT_EQ(q.weight_key, kFp8StaticTensorSym);
  EXPECT_EQ(q.activation_key, kFp8StaticTensorSym);
  EXPECT_FALSE(q.allow_vllm_cutlass);
  EXPECT_FALSE(q.block_shape.has_value());
  q = parse_quantization_config(
      R"({"quant_method":"modelopt","quantization":{"quant_algo":"MXFP8","exclude_modules":["lm_head"]}})");
  EXPECT_TRUE(q.uses_mxfp8_oracle);
  EXPECT_FALSE(q.moe_fp8);
  EXPECT_EQ(q.weight_key, kMxfp8Static);
  EXPECT_EQ(q.activation_key, kMxfp8Dynamic);
  EXPECT_EQ(q.block_shape, (std::vector<int64_t>{1, 32}));
  EXPECT_EQ(q.ignored_layers, (std::vector<std::string>{"lm_head"}));
  q = parse_quantization_config(R"({"quant_method":"modelopt","quant_algo":"NVFP4"})");
  EXPECT_FALSE(q.moe_fp8);
}

TEST(QuantConfig, FbgemmLeavesExpertsUnquantised) {
  const CheckpointQuant q = parse_quantization_config(
      R"({"quant_method":"fbgemm_fp8","activation_scale_ub":1200.0,"modules_to_not_convert":["lm_head"]})");
  EXPECT_EQ(q.method, QuantMethod::kFbgemmFp8);
  EXPECT_FALSE(q.moe_fp8);
  EXPECT_EQ(q.moe_method, "UnquantizedFusedMoEMethod");
  EXPECT_NE(q.not_fp8_reason.find("FusedMoE"), std::string::npos);
  EXPECT_TRUE(throws_with<ValueError>(
      [] {
        parse_quantization_config(R"({"quant_method":"fbgemm_fp8","modules_to_not_convert":[]})");
      },
      {"['activation_scale_ub']"}));
}

// ---- malformed configs
// ---------------------------------------------------------------------------------

TEST(ModelConfig, MalformedConfigsAreClearErrors) {
  const std::string qwen =
      R"("model_type":"qwen3_moe","hidden_size":256,"moe_intermediate_size":640,"num_experts":8,)"
      R"("num_experts_per_tok":2,"num_hidden_layers":2)";
  EXPECT_NO_THROW(parse_model_config("{" + qwen + "}", "c.json"));
  EXPECT_TRUE(throws_with<FormatError>([] { parse_model_config("{", "c.json"); },
                                       {"c.json", "not valid JSON"}));
  EXPECT_TRUE(
      throws_with<FormatError>([] { parse_model_config("[]", "c.json"); }, {"JSON object"}));
  EXPECT_TRUE(throws_with<FormatError>([] { parse_model_config("{}", "c.json"); }, {"model_type"}));
  EXPECT_TRUE(throws_with<NotImplementedError>(
      [] { parse_model_config(R"({"model_type":"llama"})", "c.json"); }, {"'llama'", "qwen3_moe"}));
  EXPECT_TRUE(throws_with<FormatError>(
      [] { parse_model_config(R"({"model_type":"qwen3_moe","num_hidden_layers":2})", "c.json"); },
      {"missing \"hidden_size\""}));
  EXPECT_TRUE(throws_with<FormatError>(
      [&] { parse_model_config("{" + qwen + R"(,"hidden_size":"256"})", "c.json"); },
      {"\"hidden_size\" must be an integer"}));
  EXPECT_TRUE(throws_with<FormatError>(
      [] {
        parse_model_config(
            R"({"model_type":"qwen3_moe","hidden_size":-4,"moe_intermediate_size":640,)"
            R"("num_experts":8,"num_experts_per_tok":2,"num_hidden_layers":2})",
            "c.json");
      },
      {"\"hidden_size\" = -4"}));
  EXPECT_TRUE(throws_with<FormatError>(
      [] {
        parse_model_config(
            R"({"model_type":"qwen3_moe","hidden_size":256,"moe_intermediate_size":640,)"
            R"("num_experts":8,"num_experts_per_tok":9,"num_hidden_layers":2})",
            "c.json");
      },
      {"num_experts_per_tok = 9"}));
  EXPECT_TRUE(throws_with<FormatError>(
      [&] { parse_model_config("{" + qwen + R"(,"mlp_only_layers":[0,1]})", "c.json"); },
      {"no decoder layer has routed experts"}));
  EXPECT_TRUE(throws_with<FormatError>(
      [&] { parse_model_config("{" + qwen + R"(,"hidden_act":"swoosh"})", "c.json"); },
      {"hidden_act", "swoosh"}));
  EXPECT_TRUE(throws_with<ValueError>(
      [&] {
        parse_model_config("{" + qwen + R"(,"quantization_config":{"quant_method":"fp8"}})",
                           "c.json");
      },
      {"c.json", "activation_scheme"}));
  EXPECT_TRUE(
      throws_with<ValueError>([] { load_model_config("/nonexistent/dir"); }, {"/nonexistent"}));
}

TEST(ModelConfig, IgnoredExpertsAreDetected) {
  const std::string base =
      R"({"model_type":"qwen3_moe","hidden_size":256,"moe_intermediate_size":640,"num_experts":8,)"
      R"("num_experts_per_tok":2,"num_hidden_layers":3,"quantization_config":{"quant_method":"fp8",)"
      R"("activation_scheme":"dynamic","weight_block_size":[128,128],"ignored_layers":)";
  ModelConfig m =
      parse_model_config(base + R"(["model.layers.1.mlp.experts","model.layers.2.mlp.gate"]}})");
  EXPECT_FALSE(moe_layer_ignored(m, 0));
  EXPECT_TRUE(moe_layer_ignored(m, 1));
  EXPECT_FALSE(moe_layer_ignored(m, 2));
  m = parse_model_config(base + R"(["model.layers.2.mlp.experts.0.gate_proj"]}})");
  EXPECT_TRUE(moe_layer_ignored(m, 2));
  m = parse_model_config(base + R"(["re:model\\.layers\\.0\\..*"]}})");
  EXPECT_TRUE(moe_layer_ignored(m, 0));
  EXPECT_FALSE(moe_layer_ignored(m, 1));
}

}  // namespace
}  // namespace fp8moe
