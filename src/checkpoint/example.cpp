// `fp8moe make-example`: a small checkpoint in the real formats, shaped like a Qwen3-MoE FP8
// release (config.json with a native fp8 quantization_config, model-0000i-of-0000n.safetensors
// shards and model.safetensors.index.json). Weights are randn/15 from a fixed seed, block-quantised
// with the numerics room's per_block_cast_to_fp8 (weight_scale_inv = the f32 block scales);
// embeddings, norms and the router stay bf16 and are listed in modules_to_not_convert as Qwen's
// releases do.
#include <fmt/format.h>
#include <sys/stat.h>

#include <cmath>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>

#include "checkpoint/checkpoint_internal.hpp"
#include "fp8moe/checkpoint.hpp"
#include "fp8moe/error.hpp"
#include "fp8moe/numerics.hpp"
#include "numerics/quant.hpp"

namespace fp8moe {

namespace {

// splitmix64 -> uniform doubles -> Box-Muller normals: small, fixed, platform independent.
class Normal {
 public:
  explicit Normal(uint64_t seed) : state_(seed * 0x9E3779B97F4A7C15ull + 0x1234567ull) {}
  double uniform() {  // (0, 1)
    uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    return (static_cast<double>(z >> 11) + 0.5) * (1.0 / 9007199254740992.0);
  }
  float next() {
    if (have_spare_) {
      have_spare_ = false;
      return spare_;
    }
    const double u1 = uniform(), u2 = uniform();
    const double r = std::sqrt(-2.0 * std::log(u1));
    spare_ = static_cast<float>(r * std::sin(2.0 * M_PI * u2));
    have_spare_ = true;
    return static_cast<float>(r * std::cos(2.0 * M_PI * u2));
  }

 private:
  uint64_t state_;
  bool have_spare_ = false;
  float spare_ = 0;
};

std::vector<float> randn(Normal& rng, int64_t n, float scale) {
  std::vector<float> v(static_cast<std::size_t>(n));
  for (auto& x : v) x = rng.next() * scale;
  return v;
}

std::vector<uint8_t> to_bytes(const Tensor& t) {
  const auto* p = static_cast<const uint8_t*>(t.data());
  return {p, p + t.nbytes()};
}

std::vector<uint8_t> bf16_bytes(const std::vector<float>& v) {
  std::vector<uint8_t> out(v.size() * 2);
  for (std::size_t i = 0; i < v.size(); ++i) {
    const uint16_t b = numerics::float_to_bf16(v[i]);
    std::memcpy(out.data() + 2 * i, &b, 2);
  }
  return out;
}

}  // namespace

std::vector<std::string> write_example_checkpoint(const std::string& dir,
                                                  const ExampleCheckpointSpec& spec) {
  const int64_t H = spec.hidden, I = spec.intermediate, E = spec.experts, V = spec.vocab;
  const int64_t D = spec.head_dim, NQ = spec.heads, NKV = spec.kv_heads;
  if (H <= 0 || I <= 0 || E <= 0 || spec.topk <= 0 || spec.topk > E || spec.layers <= 0 ||
      spec.block <= 0 || V <= 0 || D <= 0 || NQ <= 0 || NKV <= 0 || NQ % NKV != 0) {
    throw ValueError(fmt::format(
        "invalid example shape: hidden {}, intermediate {}, experts {}, top-k {}, layers {}, "
        "block {}",
        H, I, E, spec.topk, spec.layers, spec.block));
  }
  if (H * I * E * spec.layers > (int64_t{1} << 32)) {
    throw ValueError(
        "the example is meant to be small: hidden x intermediate x experts x layers "
        "must stay below 2^32");
  }
  if (!path_is_dir(dir) && ::mkdir(dir.c_str(), 0755) != 0) {
    throw RuntimeError(
        fmt::format("{}: cannot create the directory: {}", dir, std::strerror(errno)));
  }

  Normal rng(spec.seed);
  std::vector<ShardedTensor> tensors;
  std::vector<std::string> not_converted = {"lm_head"};
  auto add_bf16 = [&](const std::string& name, std::vector<int64_t> shape, float scale) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    tensors.push_back({name, DType::kBF16, std::move(shape), bf16_bytes(randn(rng, n, scale))});
  };
  auto add_ones_bf16 = [&](const std::string& name, int64_t n) {
    tensors.push_back({name, DType::kBF16, {n}, bf16_bytes(std::vector<float>(n, 1.0f))});
  };
  // A linear layer stored the way the checkpoint format stores it: fp8 weight + block scales.
  auto add_fp8_linear = [&](const std::string& module, int64_t rows, int64_t cols) {
    const std::vector<float> w = randn(rng, rows * cols, 1.0f / 15.0f);
    const TensorView wv(const_cast<float*>(w.data()), DType::kF32, {rows, cols});
    const numerics::QuantizedTensor q =
        numerics::per_block_cast_to_fp8(wv, spec.block, spec.block, DType::kF8E4M3FN, spec.ue8m0);
    tensors.push_back({module + ".weight", DType::kF8E4M3FN, {rows, cols}, to_bytes(q.q)});
    tensors.push_back(
        {module + ".weight_scale_inv", DType::kF32, q.scale.sizes(), to_bytes(q.scale)});
  };

  add_bf16("model.embed_tokens.weight", {V, H}, 0.02f);
  for (int l = 0; l < spec.layers; ++l) {
    const std::string p = fmt::format("model.layers.{}.", l);
    add_ones_bf16(p + "input_layernorm.weight", H);
    add_ones_bf16(p + "post_attention_layernorm.weight", H);
    add_fp8_linear(p + "self_attn.q_proj", NQ * D, H);
    add_fp8_linear(p + "self_attn.k_proj", NKV * D, H);
    add_fp8_linear(p + "self_attn.v_proj", NKV * D, H);
    add_fp8_linear(p + "self_attn.o_proj", H, NQ * D);
    add_ones_bf16(p + "self_attn.q_norm.weight", D);
    add_ones_bf16(p + "self_attn.k_norm.weight", D);
    add_bf16(p + "mlp.gate.weight", {E, H}, 0.1f);  // the router, kept in bf16
    for (int64_t e = 0; e < E; ++e) {
      const std::string ep = fmt::format("{}mlp.experts.{}.", p, e);
      add_fp8_linear(ep + "gate_proj", I, H);
      add_fp8_linear(ep + "up_proj", I, H);
      add_fp8_linear(ep + "down_proj", H, I);
    }
    not_converted.push_back(p + "input_layernorm");
    not_converted.push_back(p + "mlp.gate");
    not_converted.push_back(p + "post_attention_layernorm");
  }
  add_ones_bf16("model.norm.weight", H);
  add_bf16("lm_head.weight", {V, H}, 0.02f);

  uint64_t total = 0;
  for (const auto& t : tensors) total += t.bytes.size();
  write_sharded_checkpoint(dir, tensors, std::max<uint64_t>(total / 3 + 1, 1 << 16), true);

  nlohmann::ordered_json quant;
  quant["activation_scheme"] = "dynamic";
  quant["fmt"] = "e4m3";
  quant["modules_to_not_convert"] = not_converted;
  quant["quant_method"] = "fp8";
  if (spec.ue8m0) quant["scale_fmt"] = "ue8m0";
  quant["weight_block_size"] = {spec.block, spec.block};
  nlohmann::ordered_json cfg;
  cfg["architectures"] = {"Qwen3MoeForCausalLM"};
  cfg["attention_bias"] = false;
  cfg["decoder_sparse_step"] = 1;
  cfg["head_dim"] = D;
  cfg["hidden_act"] = "silu";
  cfg["hidden_size"] = H;
  cfg["intermediate_size"] = 3 * H;
  cfg["max_position_embeddings"] = 4096;
  cfg["mlp_only_layers"] = nlohmann::ordered_json::array();
  cfg["model_type"] = "qwen3_moe";
  cfg["moe_intermediate_size"] = I;
  cfg["norm_topk_prob"] = true;
  cfg["num_attention_heads"] = NQ;
  cfg["num_experts"] = E;
  cfg["num_experts_per_tok"] = spec.topk;
  cfg["num_hidden_layers"] = spec.layers;
  cfg["num_key_value_heads"] = NKV;
  cfg["quantization_config"] = quant;
  cfg["rms_norm_eps"] = 1e-06;
  cfg["rope_theta"] = 1000000.0;
  cfg["tie_word_embeddings"] = false;
  cfg["torch_dtype"] = "bfloat16";
  cfg["vocab_size"] = V;
  cfg["fp8moe_example"] = {{"generator", "fp8moe make-example"},
                           {"seed", spec.seed},
                           {"weights", "randn / 15, per_block_cast_to_fp8"}};
  const std::string config_path = path_join(dir, "config.json");
  {
    std::ofstream out(config_path, std::ios::trunc);
    out << cfg.dump(2) << "\n";
    if (!out) throw RuntimeError(fmt::format("{}: write failed", config_path));
  }
  std::vector<std::string> files = {config_path, path_join(dir, "model.safetensors.index.json")};
  SafetensorsCheckpoint ck = SafetensorsCheckpoint::open(dir);
  for (const auto& s : ck.shards()) files.push_back(s.path());
  return files;
}

}  // namespace fp8moe
