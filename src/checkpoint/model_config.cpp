// config.json of the supported MoE families -> ModelConfig (MoE shape, which layers are MoE,
// routing, activation, quantisation), and the expert tensor names of each family.
#include <fmt/format.h>

#include <algorithm>
#include <nlohmann/json.hpp>
#include <set>

#include "checkpoint/checkpoint_internal.hpp"
#include "fp8moe/checkpoint.hpp"
#include "fp8moe/error.hpp"

namespace fp8moe {

using nlohmann::json;

namespace {

struct FamilyName {
  ModelFamily family;
  std::string_view model_type;
};
constexpr FamilyName kFamilies[] = {
    {ModelFamily::kDeepseekV3, "deepseek_v3"}, {ModelFamily::kKimiK2, "kimi_k2"},
    {ModelFamily::kQwen2Moe, "qwen2_moe"},     {ModelFamily::kQwen3Moe, "qwen3_moe"},
    {ModelFamily::kQwen3Next, "qwen3_next"},   {ModelFamily::kMiniMaxM2, "minimax_m2"},
    {ModelFamily::kGlm4Moe, "glm4_moe"},       {ModelFamily::kMixtral, "mixtral"},
    {ModelFamily::kLlama4, "llama4"},          {ModelFamily::kGptOss, "gpt_oss"},
};

// Bounds that keep absurd configs (and the fuzzer) from allocating the machine away.
constexpr int64_t kMaxDim = int64_t{1} << 24;
constexpr int64_t kMaxExperts = int64_t{1} << 16;
constexpr int64_t kMaxLayers = 100000;

class Fields {
 public:
  Fields(const json& j, const std::string& file, std::string_view family)
      : j_(j), file_(file), family_(family) {}

  const json* get(const char* key) const {
    auto it = j_.find(key);
    if (it == j_.end() || it->is_null()) return nullptr;
    return &*it;
  }
  bool has(const char* key) const { return get(key) != nullptr; }

  int64_t req_int(const char* key, int64_t lo, int64_t hi) const {
    const json* v = get(key);
    if (!v) {
      throw FormatError(
          fmt::format("{}: missing \"{}\" (a {} config needs it)", file_, key, family_));
    }
    return check_int(key, *v, lo, hi);
  }
  int64_t opt_int(const char* key, int64_t def, int64_t lo, int64_t hi) const {
    const json* v = get(key);
    return v ? check_int(key, *v, lo, hi) : def;
  }
  double opt_double(const char* key, double def) const {
    const json* v = get(key);
    if (!v) return def;
    if (!v->is_number()) {
      throw FormatError(
          fmt::format("{}: \"{}\" must be a number, got {}", file_, key, short_dump(*v)));
    }
    return v->get<double>();
  }
  bool opt_bool(const char* key, bool def) const {
    const json* v = get(key);
    if (!v) return def;
    if (!v->is_boolean()) {
      throw FormatError(
          fmt::format("{}: \"{}\" must be true or false, got {}", file_, key, short_dump(*v)));
    }
    return v->get<bool>();
  }
  std::string opt_string(const char* key, const std::string& def) const {
    const json* v = get(key);
    if (!v) return def;
    if (!v->is_string()) {
      throw FormatError(
          fmt::format("{}: \"{}\" must be a string, got {}", file_, key, short_dump(*v)));
    }
    return v->get<std::string>();
  }
  std::vector<int64_t> opt_int_list(const char* key, int64_t lo, int64_t hi) const {
    std::vector<int64_t> out;
    const json* v = get(key);
    if (!v) return out;
    if (!v->is_array()) {
      throw FormatError(fmt::format("{}: \"{}\" must be a list of integers", file_, key));
    }
    if (v->size() > static_cast<std::size_t>(kMaxLayers)) {
      throw FormatError(fmt::format("{}: \"{}\" is too long", file_, key));
    }
    for (const json& e : *v) out.push_back(check_int(key, e, lo, hi));
    return out;
  }

  static std::string short_dump(const json& v) {
    std::string s = v.dump(-1, ' ', true, json::error_handler_t::replace);
    return s.size() > 60 ? s.substr(0, 57) + "..." : s;
  }

 private:
  int64_t check_int(const char* key, const json& v, int64_t lo, int64_t hi) const {
    // Accept integral floats (2048.0) as Python's json would keep them ints only when written so;
    // HF configs always write ints, so anything else is an error.
    if (!v.is_number_integer()) {
      throw FormatError(
          fmt::format("{}: \"{}\" must be an integer, got {}", file_, key, short_dump(v)));
    }
    const int64_t x = v.is_number_unsigned()
                          ? static_cast<int64_t>(std::min<uint64_t>(v.get<uint64_t>(), INT64_MAX))
                          : v.get<int64_t>();
    if (x < lo || x > hi) {
      throw FormatError(fmt::format("{}: \"{}\" = {} is outside [{}, {}]", file_, key, x, lo, hi));
    }
    return x;
  }

  const json& j_;
  const std::string& file_;
  std::string_view family_;
};

}  // namespace

std::string_view model_family_name(ModelFamily f) {
  for (const auto& n : kFamilies) {
    if (n.family == f) return n.model_type;
  }
  return "?";
}

ModelConfig parse_model_config(std::string_view json_text, const std::string& source) {
  json root;
  try {
    root = json::parse(json_text);
  } catch (const json::exception& e) {
    throw FormatError(fmt::format("{}: not valid JSON: {}", source, e.what()));
  }
  if (!root.is_object()) throw FormatError(fmt::format("{}: must be a JSON object", source));

  ModelConfig m;
  m.source = source;
  {
    auto it = root.find("model_type");
    if (it == root.end() || !it->is_string()) {
      throw FormatError(
          fmt::format("{}: missing \"model_type\" (a string such as \"qwen3_moe\")", source));
    }
    m.model_type = it->get<std::string>();
  }
  if (auto a = root.find("architectures"); a != root.end() && a->is_array()) {
    for (const json& e : *a) {
      if (e.is_string()) m.architectures.push_back(e.get<std::string>());
    }
  }
  bool known = false;
  for (const auto& n : kFamilies) {
    if (n.model_type == m.model_type) {
      m.family = n.family;
      known = true;
    }
  }
  if (!known) {
    std::string names;
    for (const auto& n : kFamilies)
      names += fmt::format("{}{}", names.empty() ? "" : ", ", n.model_type);
    throw NotImplementedError(
        fmt::format("{}: model_type '{}' is not an MoE family fp8moe knows (supported: {})", source,
                    m.model_type, names));
  }

  // Llama 4 keeps the language model's fields under text_config; quantization_config stays on top.
  const json* body = &root;
  if (m.family == ModelFamily::kLlama4) {
    auto tc = root.find("text_config");
    if (tc == root.end() || !tc->is_object()) {
      throw FormatError(fmt::format("{}: a llama4 config needs a \"text_config\" object", source));
    }
    body = &*tc;
  }
  const Fields f(*body, source, m.model_type);

  m.hidden_size = f.req_int("hidden_size", 1, kMaxDim);
  m.num_hidden_layers = static_cast<int>(f.req_int("num_hidden_layers", 1, kMaxLayers));
  m.hidden_act = f.opt_string("hidden_act", "silu");
  {
    // torch_dtype (or "dtype" in newer transformers), in text_config first for Llama 4.
    const json* d = nullptr;
    for (const json* src : std::initializer_list<const json*>{body, &root}) {
      for (const char* key : {"torch_dtype", "dtype"}) {
        auto it = src->find(key);
        if (!d && it != src->end() && it->is_string()) d = &*it;
      }
    }
    if (d) {
      try {
        m.dtype = parse_dtype(d->get<std::string>());
      } catch (const ValueError&) {
        throw FormatError(fmt::format("{}: torch_dtype {} is not a dtype fp8moe knows", source,
                                      Fields::short_dump(*d)));
      }
    }
  }

  std::optional<int> group;  // num_expert_group passed to the router (grouped top-k only)
  const int64_t L = m.num_hidden_layers;
  auto all_layers = [&] {
    m.moe_layers.clear();
    for (int i = 0; i < L; ++i) m.moe_layers.push_back(i);
  };

  switch (m.family) {
    case ModelFamily::kDeepseekV3:
    case ModelFamily::kKimiK2:
    case ModelFamily::kGlm4Moe: {
      m.moe_intermediate_size = f.req_int("moe_intermediate_size", 1, kMaxDim);
      m.num_experts = static_cast<int>(f.req_int("n_routed_experts", 1, kMaxExperts));
      m.num_experts_per_tok = static_cast<int>(f.req_int("num_experts_per_tok", 1, kMaxExperts));
      m.num_shared_experts = static_cast<int>(f.opt_int("n_shared_experts", 0, 0, 1024));
      m.shared_expert_intermediate_size = m.moe_intermediate_size * m.num_shared_experts;
      const int64_t first_dense = f.opt_int("first_k_dense_replace", 0, 0, kMaxLayers);
      const int64_t freq = f.opt_int("moe_layer_freq", 1, 1, kMaxLayers);
      for (int i = 0; i < L; ++i) {
        if (i >= first_dense && i % freq == 0) m.moe_layers.push_back(i);
      }
      m.num_nextn_predict_layers =
          static_cast<int>(f.opt_int("num_nextn_predict_layers", 0, 0, 64));
      m.renormalize = f.opt_bool("norm_topk_prob", false);
      m.routed_scaling_factor = f.opt_double("routed_scaling_factor", 1.0);
      m.num_expert_group = static_cast<int>(f.opt_int("n_group", 1, 0, kMaxExperts));
      m.topk_group = static_cast<int>(f.opt_int("topk_group", 1, 0, kMaxExperts));
      if (m.family == ModelFamily::kGlm4Moe) {
        // Glm4MoE: sigmoid scores with e_score_correction_bias, grouped top-k.
        m.scoring_func = "sigmoid";
        m.has_e_score_bias = true;
      } else {
        // DeepseekV2MoE: the bias exists for topk_method "noaux_tc".
        m.scoring_func = f.opt_string("scoring_func", "softmax");
        m.has_e_score_bias = f.opt_string("topk_method", "") == "noaux_tc";
      }
      group = m.num_expert_group;
      break;
    }
    case ModelFamily::kQwen2Moe:
    case ModelFamily::kQwen3Moe:
    case ModelFamily::kQwen3Next: {
      m.moe_intermediate_size = f.req_int("moe_intermediate_size", 1, kMaxDim);
      m.num_experts = static_cast<int>(f.req_int("num_experts", 1, kMaxExperts));
      m.num_experts_per_tok = static_cast<int>(f.req_int("num_experts_per_tok", 1, kMaxExperts));
      m.shared_expert_intermediate_size =
          f.opt_int("shared_expert_intermediate_size", 0, 0, kMaxDim);
      m.num_shared_experts = m.shared_expert_intermediate_size > 0 ? 1 : 0;
      const int64_t step = f.opt_int("decoder_sparse_step", 1, 1, kMaxLayers);
      const auto mlp_only = f.opt_int_list("mlp_only_layers", 0, kMaxLayers);
      const std::set<int64_t> dense(mlp_only.begin(), mlp_only.end());
      for (int i = 0; i < L; ++i) {
        if (!dense.count(i) && (i + 1) % step == 0) m.moe_layers.push_back(i);
      }
      m.scoring_func = "softmax";
      // The HF config classes default norm_topk_prob to False; the released checkpoints set it.
      m.renormalize = f.opt_bool("norm_topk_prob", false);
      break;
    }
    case ModelFamily::kMiniMaxM2: {
      // MiniMax-M2 names the per-expert size intermediate_size and the expert count
      // num_local_experts.
      m.moe_intermediate_size = f.req_int("intermediate_size", 1, kMaxDim);
      m.num_experts = static_cast<int>(f.req_int("num_local_experts", 1, kMaxExperts));
      m.num_experts_per_tok = static_cast<int>(f.req_int("num_experts_per_tok", 1, kMaxExperts));
      m.shared_expert_intermediate_size = f.opt_int("shared_intermediate_size", 0, 0, kMaxDim);
      m.num_shared_experts = m.shared_expert_intermediate_size > 0 ? 1 : 0;
      all_layers();
      // MiniMaxM2MoE: FusedMoE(scoring_func=config.scoring_func, renormalize=True,
      // e_score_correction_bias if use_routing_bias, router_logits_dtype=float32), no grouping.
      m.scoring_func = f.opt_string("scoring_func", "sigmoid");
      m.renormalize = true;
      m.has_e_score_bias = f.opt_bool("use_routing_bias", false);
      break;
    }
    case ModelFamily::kMixtral: {
      m.moe_intermediate_size = f.req_int("intermediate_size", 1, kMaxDim);
      m.num_experts = static_cast<int>(f.req_int("num_local_experts", 1, kMaxExperts));
      m.num_experts_per_tok = static_cast<int>(f.req_int("num_experts_per_tok", 1, kMaxExperts));
      all_layers();
      m.scoring_func = "softmax";
      m.renormalize = true;
      break;
    }
    case ModelFamily::kLlama4: {
      m.moe_intermediate_size = f.req_int("intermediate_size", 1, kMaxDim);
      m.num_experts = static_cast<int>(f.req_int("num_local_experts", 1, kMaxExperts));
      m.num_experts_per_tok = static_cast<int>(f.req_int("num_experts_per_tok", 1, kMaxExperts));
      m.num_shared_experts = 1;
      m.shared_expert_intermediate_size = m.moe_intermediate_size;
      // Llama4TextConfig: moe_layers, else every interleave_moe_layer_step-th layer.
      const auto listed = f.opt_int_list("moe_layers", 0, L - 1);
      if (!listed.empty()) {
        std::set<int64_t> s(listed.begin(), listed.end());
        for (int64_t i : s) m.moe_layers.push_back(static_cast<int>(i));
      } else {
        const int64_t step = f.opt_int("interleave_moe_layer_step", 1, 1, kMaxLayers);
        for (int64_t i = step - 1; i < L; i += step) m.moe_layers.push_back(static_cast<int>(i));
      }
      // Llama4MoE: top-1, sigmoid of the selected logit, router weight applied to the input.
      m.scoring_func = "sigmoid";
      m.renormalize = false;
      m.apply_router_weight_on_input = true;
      break;
    }
    case ModelFamily::kGptOss: {
      m.moe_intermediate_size = f.req_int("intermediate_size", 1, kMaxDim);
      m.num_experts = static_cast<int>(f.req_int("num_local_experts", 1, kMaxExperts));
      m.num_experts_per_tok = static_cast<int>(
          f.has("num_experts_per_tok") ? f.req_int("num_experts_per_tok", 1, kMaxExperts)
                                       : f.req_int("experts_per_token", 1, kMaxExperts));
      all_layers();
      m.scoring_func = "softmax";
      m.renormalize = true;
      m.has_bias = true;
      m.hidden_act = "swigluoai";
      m.swiglu_limit = f.opt_double("swiglu_limit", 7.0);
      break;
    }
  }
  if (m.num_experts_per_tok > m.num_experts) {
    throw FormatError(fmt::format("{}: num_experts_per_tok = {} exceeds the {} routed experts",
                                  source, m.num_experts_per_tok, m.num_experts));
  }
  if (m.num_expert_group > 0 && group) {
    if (m.topk_group > m.num_expert_group) {
      throw FormatError(fmt::format("{}: topk_group = {} exceeds n_group = {}", source,
                                    m.topk_group, m.num_expert_group));
    }
  }
  if (m.moe_layers.empty()) {
    throw FormatError(fmt::format("{}: no decoder layer has routed experts", source));
  }
  if (m.family == ModelFamily::kLlama4) {
    m.routing_method = RoutingMethodType::kLlama4;
  } else {
    m.routing_method = get_routing_method_type(m.scoring_func, m.num_experts_per_tok, m.renormalize,
                                               group, m.has_e_score_bias, m.routed_scaling_factor);
  }
  try {
    m.activation = activation_from_str(m.hidden_act);
  } catch (const ValueError& e) {
    throw FormatError(fmt::format("{}: hidden_act: {}", source, e.what()));
  }

  if (auto q = root.find("quantization_config"); q != root.end() && !q->is_null()) {
    try {
      m.quant = parse_quantization_config(q->dump());
    } catch (const FormatError& e) {
      throw FormatError(fmt::format("{}: {}", source, e.what()));
    } catch (const ValueError& e) {
      throw ValueError(fmt::format("{}: quantization_config: {}", source, e.what()));
    }
  } else {
    m.quant = parse_quantization_config("null");
  }
  return m;
}

ModelConfig load_model_config(const std::string& path) {
  std::string file = path;
  if (path_is_dir(path)) file = path_join(path, "config.json");
  if (!path_is_file(file)) {
    throw ValueError(fmt::format("{}: no config.json there", path_is_dir(path) ? path : file));
  }
  return parse_model_config(read_text_file(file, 16u << 20), file);
}

MoeConfig ModelConfig::moe_config(const MoeParallelConfig& parallel, const std::string& moe_backend,
                                  DType in_dtype) const {
  MoeConfig c;
  c.num_experts = num_experts;
  c.experts_per_token = num_experts_per_tok;
  c.hidden_dim = static_cast<int>(hidden_size);
  c.intermediate_size = static_cast<int>(moe_intermediate_size);
  c.num_logical_experts = num_experts;
  c.num_local_experts =
      parallel.use_ep ? place_experts(num_experts, parallel.ep_size, parallel.ep_rank).num_local()
                      : num_experts;
  c.activation = activation;
  c.routing_method = routing_method;
  c.moe_parallel_config = parallel;
  c.in_dtype = in_dtype;
  if (family == ModelFamily::kMiniMaxM2) c.router_logits_dtype = DType::kF32;
  c.moe_backend = moe_backend;
  c.has_bias = has_bias;
  c.swiglu_limit = swiglu_limit;
  c.post_init();
  return c;
}

std::string ModelConfig::describe() const {
  return fmt::format(
      "{} ({}): {} MoE layers of {} routed experts (top-{}), hidden {}, expert intermediate {}, "
      "{} routing{}{}",
      model_type, source, moe_layers.size(), num_experts, num_experts_per_tok, hidden_size,
      moe_intermediate_size, routing_method_name(routing_method),
      num_shared_experts ? fmt::format(", {} shared expert(s)", num_shared_experts) : "",
      apply_router_weight_on_input ? ", router weight on input" : "");
}

// ---- expert tensor names
// ------------------------------------------------------------------------------

std::string_view expert_proj_name(ExpertProj p) {
  switch (p) {
    case ExpertProj::kGate:
      return "gate";
    case ExpertProj::kUp:
      return "up";
    case ExpertProj::kDown:
      return "down";
  }
  return "?";
}

ExpertNaming expert_naming(const ModelConfig& model) {
  ExpertNaming n;
  n.layer_prefix = "model.layers.{L}.";
  n.experts = "mlp.experts";
  n.proj = {"gate_proj", "up_proj", "down_proj"};
  switch (model.family) {
    case ModelFamily::kMiniMaxM2:
    case ModelFamily::kMixtral:
      n.experts = "block_sparse_moe.experts";
      n.proj = {"w1", "w3", "w2"};  // w1 gate, w3 up, w2 down
      break;
    case ModelFamily::kLlama4:
      // The FP8 release stores per-expert projections; the bf16 release fuses them (detected by
      // the loader, which then says so).
      n.layer_prefix = "language_model.model.layers.{L}.";
      n.experts = "feed_forward.experts";
      break;
    case ModelFamily::kGptOss:
      n.layout = ExpertLayout::kFusedGptOss;
      break;
    default:
      break;
  }
  return n;
}

std::string expert_module_name(const ModelConfig& model, int layer, int expert, ExpertProj proj) {
  const ExpertNaming n = expert_naming(model);
  std::string prefix = n.layer_prefix;
  prefix.replace(prefix.find("{L}"), 3, std::to_string(layer));
  return fmt::format("{}{}.{}.{}", prefix, n.experts, expert, n.proj[static_cast<int>(proj)]);
}

std::string expert_weight_name(const ModelConfig& model, int layer, int expert, ExpertProj proj) {
  return expert_module_name(model, layer, expert, proj) + ".weight";
}

std::string expert_scale_name(const ModelConfig& model, int layer, int expert, ExpertProj proj) {
  if (model.quant.weight_scale_suffix.empty()) return "";
  return expert_module_name(model, layer, expert, proj) + "." + model.quant.weight_scale_suffix;
}

std::string expert_input_scale_name(const ModelConfig& model, int layer, int expert,
                                    ExpertProj proj) {
  return expert_module_name(model, layer, expert, proj) + ".input_scale";
}

}  // namespace fp8moe
