// The bench presets: the models of spec/models.md with the MoE fields and quantization_config of
// their released config.json files (examples/configs holds the full files), at the deployments
// models.md lists; and random weights at a rank's real shapes.
#include <fmt/format.h>

#include <algorithm>
#include <cstring>

#include "fp8moe/error.hpp"
#include "layer/bench.hpp"
#include "layer/layer_internal.hpp"

namespace fp8moe::bench {

using layer_detail::cdiv;

namespace {

constexpr const char* kFp8Block =
    R"("quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]})";
// compressed-tensors FP8: per-channel weights, dynamic per-token activations (GLM-4.5-FP8,
// Llama-4-Maverick-17B-128E-Instruct-FP8).
constexpr const char* kCtChannelToken =
    R"("quantization_config": {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "dynamic": false, "symmetric": true}, "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": true, "symmetric": true}}}})";

std::string deepseek(int experts, double rsf, int n_group, int topk_group, const char* type) {
  return fmt::format(
      R"({{"model_type": "{}", "architectures": ["DeepseekV3ForCausalLM"], "hidden_size": 7168, "moe_intermediate_size": 2048, "n_routed_experts": {}, "num_experts_per_tok": 8, "n_shared_experts": 1, "num_hidden_layers": 61, "first_k_dense_replace": 3, "scoring_func": "sigmoid", "topk_method": "noaux_tc", "n_group": {}, "topk_group": {}, "routed_scaling_factor": {}, "norm_topk_prob": true, "hidden_act": "silu", "torch_dtype": "bfloat16", {}}})",
      type, experts, n_group, topk_group, rsf, kFp8Block);
}

std::string qwen3(const char* type, int hidden, int inter, int experts, int topk, int layers) {
  return fmt::format(
      R"({{"model_type": "{}", "hidden_size": {}, "moe_intermediate_size": {}, "num_experts": {}, "num_experts_per_tok": {}, "num_hidden_layers": {}, "norm_topk_prob": true, "hidden_act": "silu", "torch_dtype": "bfloat16", {}}})",
      type, hidden, inter, experts, topk, layers, kFp8Block);
}

}  // namespace

const std::vector<BenchPreset>& bench_presets() {
  static const std::vector<BenchPreset> v = [] {
    std::vector<BenchPreset> p;
    p.push_back({"deepseek-v3-tp8",
                 "DeepSeek-V3/R1 TP 8: E 256, K 7168, N 256, top-8 grouped sigmoid, block FP8",
                 deepseek(256, 2.5, 8, 4, "deepseek_v3"), 8, false});
    p.push_back({"deepseek-v3-tp2",
                 "DeepSeek-V3/R1 TP 2: E 256, K 7168, N 1024, top-8 grouped sigmoid, block FP8",
                 deepseek(256, 2.5, 8, 4, "deepseek_v3"), 2, false});
    p.push_back({"deepseek-v3-ep8",
                 "DeepSeek-V3/R1 EP 8, rank 0: 32 local of 256 experts, K 7168, N 2048, block FP8",
                 deepseek(256, 2.5, 8, 4, "deepseek_v3"), 8, true});
    p.push_back({"qwen3-30b-a3b-tp1", "Qwen3-30B-A3B-FP8 TP 1: E 128, K 2048, N 768, top-8",
                 qwen3("qwen3_moe", 2048, 768, 128, 8, 48), 1, false});
    p.push_back({"qwen3-235b-a22b-tp4", "Qwen3-235B-A22B-FP8 TP 4: E 128, K 4096, N 384, top-8",
                 qwen3("qwen3_moe", 4096, 1536, 128, 8, 94), 4, false});
    p.push_back({"qwen3-coder-480b-tp4",
                 "Qwen3-Coder-480B-A35B-FP8 TP 4: E 160, K 6144, N 640, top-8",
                 qwen3("qwen3_moe", 6144, 2560, 160, 8, 62), 4, false});
    p.push_back({"qwen3-next-80b-tp2", "Qwen3-Next-80B-A3B-FP8 TP 2: E 512, K 2048, N 256, top-10",
                 qwen3("qwen3_next", 2048, 512, 512, 10, 48), 2, false});
    p.push_back(
        {"minimax-m2-tp4", "MiniMax-M2 TP 4: E 256, K 3072, N 384, top-8 sigmoid + bias, block FP8",
         fmt::format(
             R"({{"model_type": "minimax_m2", "hidden_size": 3072, "intermediate_size": 1536, "num_local_experts": 256, "num_experts_per_tok": 8, "num_hidden_layers": 62, "scoring_func": "sigmoid", "use_routing_bias": true, "hidden_act": "silu", "torch_dtype": "bfloat16", {}}})",
             kFp8Block),
         4, false});
    p.push_back(
        {"mixtral-8x7b-tp2",
         "Mixtral-8x7B-FP8 TP 2: E 8, K 4096, N 7168, top-2, per-tensor FP8 (static activations)",
         R"({"model_type": "mixtral", "hidden_size": 4096, "intermediate_size": 14336, "num_local_experts": 8, "num_experts_per_tok": 2, "num_hidden_layers": 32, "hidden_act": "silu", "torch_dtype": "bfloat16", "quantization_config": {"activation_scheme": "static", "ignored_layers": ["lm_head"], "quant_method": "fp8"}})",
         2, false});
    p.push_back({"kimi-k2-tp8",
                 "Kimi-K2-Instruct TP 8: E 384, K 7168, N 256, top-8 sigmoid + bias, block FP8",
                 deepseek(384, 2.827, 1, 1, "kimi_k2"), 8, false});
    p.push_back(
        {"glm-4.5-tp8",
         "GLM-4.5-FP8 TP 8: E 160, K 5120, N 192, top-8, per-channel FP8 (compressed-tensors)",
         fmt::format(
             R"({{"model_type": "glm4_moe", "hidden_size": 5120, "moe_intermediate_size": 1536, "n_routed_experts": 160, "num_experts_per_tok": 8, "n_shared_experts": 1, "num_hidden_layers": 92, "first_k_dense_replace": 3, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 2.5, "norm_topk_prob": true, "hidden_act": "silu", "torch_dtype": "bfloat16", {}}})",
             kCtChannelToken),
         8, false});
    p.push_back(
        {"llama4-maverick-tp8",
         "Llama-4-Maverick-17B-128E-FP8 TP 8: E 128, K 5120, N 1024, top-1 (router weight on the "
         "input), per-channel FP8",
         fmt::format(
             R"({{"model_type": "llama4", "text_config": {{"model_type": "llama4_text", "hidden_size": 5120, "intermediate_size": 8192, "num_local_experts": 128, "num_experts_per_tok": 1, "num_hidden_layers": 48, "interleave_moe_layer_step": 2, "hidden_act": "silu", "torch_dtype": "bfloat16"}}, {}}})",
             kCtChannelToken),
         8, false});
    return p;
  }();
  return v;
}

const BenchPreset& find_bench_preset(std::string_view name) {
  for (const auto& p : bench_presets())
    if (p.name == name) return p;
  std::string names;
  for (const auto& p : bench_presets())
    names += fmt::format("{}{}", names.empty() ? "" : ", ", p.name);
  throw ValueError(fmt::format("unknown preset '{}': expected one of {}", name, names));
}

ModelConfig preset_model(const BenchPreset& p) {
  return parse_model_config(p.config_json, fmt::format("preset {}", p.name));
}

namespace {

// splitmix64: fast, fixed, platform independent.
struct Rng {
  uint64_t s;
  uint64_t next() {
    uint64_t z = (s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
};

// fp8 e4m3 codes with the top exponent bit clear: |v| < 2 and never NaN (NaN needs exponent 1111).
void fill_codes(const Tensor& t, Rng& rng) {
  uint8_t* p = t.ptr<uint8_t>();
  const std::size_t n = t.nbytes();
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const uint64_t v = rng.next() & 0xBFBFBFBFBFBFBFBFull;
    std::memcpy(p + i, &v, 8);
  }
  for (; i < n; ++i) p[i] = static_cast<uint8_t>(rng.next() & 0xBF);
}

Tensor filled_f32(std::initializer_list<int64_t> shape, float v) {
  Tensor t = Tensor::empty(shape, DType::kF32);
  std::fill_n(t.ptr<float>(), t.numel(), v);
  return t;
}

}  // namespace

RandomLayer make_random_layer(ModelConfig model, const CheckpointLayerRequest& req,
                              const Fp8MoeLayerOptions& options, uint64_t seed,
                              uint64_t max_weight_bytes) {
  RandomLayer r;
  const int ranks = req.enable_ep ? req.tp_size : 1;
  const int64_t H = model.hidden_size;
  const int64_t W0 =
      req.enable_ep ? model.moe_intermediate_size : cdiv(model.moe_intermediate_size, req.tp_size);
  const uint64_t per_expert = static_cast<uint64_t>(3 * W0 * H);
  // Scale E down (keeping the routing groups whole and top-k <= E) to fit the budget.
  const int64_t local = cdiv(model.num_experts, ranks);
  if (per_expert * static_cast<uint64_t>(local) > max_weight_bytes) {
    const int64_t unit = std::max<int64_t>(1, model.num_expert_group) * ranks;
    int64_t e = std::max<int64_t>(1, static_cast<int64_t>(max_weight_bytes / per_expert)) * ranks;
    e = std::max<int64_t>(unit, e / unit * unit);
    while (e < model.num_experts_per_tok) e += unit;
    if (e < model.num_experts) {
      r.scaled_from = model.num_experts;
      model.num_experts = static_cast<int>(e);
    }
  }
  r.spec = checkpoint_layer_spec(model, req);
  r.spec.name =
      fmt::format("{} (random weights{})", model.source,
                  r.scaled_from ? fmt::format(", E scaled {} -> {} to fit {} MiB", r.scaled_from,
                                              model.num_experts, max_weight_bytes >> 20)
                                : "");
  const Fp8MoeLayerPlan plan = plan_fp8_moe_layer(r.spec, options);
  if (!plan.ok) {
    // The caller builds the layer and reports the plan's failure; no weights are needed.
    r.model = model;
    return r;
  }
  const int64_t E = plan.num_local_experts, W = plan.local_intermediate;
  Rng rng{seed * 0x632BE59BD9B4E019ull + 1};
  Fp8MoeWeights& w = r.weights;
  w.w13 = Tensor::empty({E, 2 * W, H}, DType::kF8E4M3FN);
  w.w2 = Tensor::empty({E, H, W}, DType::kF8E4M3FN);
  fill_codes(w.w13, rng);
  fill_codes(w.w2, rng);
  r.weight_bytes = w.w13.nbytes() + w.w2.nbytes();
  switch (plan.scheme.weight) {
    case WeightScaleKind::kBlock: {
      const auto b = *plan.block;
      w.w13_scale = filled_f32({E, 2 * cdiv(W, b[0]), cdiv(H, b[1])}, 0.03f);
      w.w2_scale = filled_f32({E, cdiv(H, b[0]), cdiv(W, b[1])}, 0.03f);
      break;
    }
    case WeightScaleKind::kPerTensor:
      w.w13_scale = filled_f32({E}, 0.03f);  // one scale per expert, as after vLLM's requant
      w.w2_scale = filled_f32({E}, 0.03f);
      break;
    case WeightScaleKind::kPerChannel:
      w.w13_scale = filled_f32({E, 2 * W}, 0.03f);
      w.w2_scale = filled_f32({E, H}, 0.03f);
      break;
    case WeightScaleKind::kMx:
      throw NotImplementedError("random MXFP8 layers are not supported");
  }
  if (plan.scheme.act == ActQuantKind::kPerTensorStatic) {
    w.w13_input_scale = filled_f32({E}, 0.002f);
    w.w2_input_scale = filled_f32({E}, 0.002f);
  }
  if (plan.config.use_ep()) {
    const ExpertPlacement ep =
        place_experts(plan.num_experts, plan.config.ep_size(), plan.config.ep_rank());
    w.expert_map = Tensor::empty({plan.num_experts}, DType::kI32);
    std::copy(ep.expert_map.begin(), ep.expert_map.end(), w.expert_map.ptr<int32_t>());
  }
  if (model.has_e_score_bias) {
    Tensor b = Tensor::empty({model.num_experts}, DType::kF32);
    for (int64_t i = 0; i < b.numel(); ++i) {
      b.ptr<float>()[i] =
          static_cast<float>(static_cast<int64_t>(rng.next() % 2001) - 1000) * 1e-5f;
    }
    r.spec.e_score_correction_bias = b;
  }
  r.model = model;
  return r;
}

}  // namespace fp8moe::bench
