// A checkpoint's quantization_config as vLLM's config classes read it, and what the MoE method of
// each makes of it (spec/oracle.md §5.1): the two quant keys handed to select_fp8_moe_backend,
// allow_vllm_cutlass, and the block_shape handed to make_fp8_moe_quant_config. The oddities of each
// caller are reproduced and named where they occur.
#include <fmt/format.h>

#include <nlohmann/json.hpp>
#include <regex>

#include "checkpoint/checkpoint_internal.hpp"
#include "fp8moe/checkpoint.hpp"
#include "fp8moe/error.hpp"

namespace fp8moe {

using nlohmann::json;

std::string_view quant_method_name(QuantMethod m) {
  switch (m) {
    case QuantMethod::kNone:
      return "none";
    case QuantMethod::kFp8:
      return "fp8";
    case QuantMethod::kCompressedTensors:
      return "compressed-tensors";
    case QuantMethod::kModelOpt:
      return "modelopt";
    case QuantMethod::kFbgemmFp8:
      return "fbgemm_fp8";
    case QuantMethod::kMxfp4:
      return "mxfp4";
    case QuantMethod::kOther:
      return "other";
  }
  return "?";
}

std::string_view checkpoint_scale_kind_name(CheckpointScaleKind k) {
  switch (k) {
    case CheckpointScaleKind::kNone:
      return "none";
    case CheckpointScaleKind::kBlock:
      return "block";
    case CheckpointScaleKind::kPerTensor:
      return "per-tensor";
    case CheckpointScaleKind::kPerChannel:
      return "per-channel";
    case CheckpointScaleKind::kMx:
      return "mx";
  }
  return "?";
}

namespace {

// vLLM QuantizationConfig.get_from_keys: the first key present, else ValueError with its text.
const json& get_from_keys(const json& cfg, std::initializer_list<const char*> keys) {
  for (const char* k : keys) {
    auto it = cfg.find(k);
    if (it != cfg.end()) return *it;
  }
  std::string list;
  for (const char* k : keys) list += fmt::format("{}'{}'", list.empty() ? "" : ", ", k);
  throw ValueError(
      fmt::format("Cannot find any of [{}] in the model's quantization config.", list));
}

const json* get_opt(const json& cfg, const char* key) {
  auto it = cfg.find(key);
  if (it == cfg.end() || it->is_null()) return nullptr;
  return &*it;
}

std::string get_string(const json& v, const std::string& what) {
  if (!v.is_string()) {
    throw FormatError(
        fmt::format("quantization_config: {} must be a string, got {}", what, v.dump()));
  }
  return v.get<std::string>();
}

std::vector<std::string> get_string_list(const json* v, const std::string& what) {
  std::vector<std::string> out;
  if (!v) return out;
  if (!v->is_array()) {
    throw FormatError(fmt::format("quantization_config: {} must be a list of strings", what));
  }
  for (const json& e : *v) out.push_back(get_string(e, what + " entry"));
  return out;
}

std::array<int64_t, 2> get_block(const json& v, const std::string& what) {
  if (!v.is_array()) {
    throw FormatError(fmt::format(
        "quantization_config: {} must be a list [block_n, block_k], got {}", what, v.dump()));
  }
  if (v.size() != 2) {
    // Fp8Config's own message for the length check.
    throw ValueError(fmt::format(
        "The quantization block size of weight must have 2 dimensions, but got {} dimensions",
        v.size()));
  }
  std::array<int64_t, 2> b{};
  for (int i = 0; i < 2; ++i) {
    if (!v[i].is_number_integer() || v[i].get<int64_t>() <= 0 || v[i].get<int64_t>() > (1 << 20)) {
      throw FormatError(fmt::format(
          "quantization_config: {} must hold two positive integers, got {}", what, v.dump()));
    }
    b[i] = v[i].get<int64_t>();
  }
  return b;
}

// ---- quant_method "fp8": Fp8Config + Fp8MoEMethod
// -----------------------------------------------------
void parse_fp8(const json& cfg, CheckpointQuant& q) {
  q.method = QuantMethod::kFp8;
  // Fp8Config.from_config: is_checkpoint_fp8_serialized = "fp8" in quant_method.
  q.is_checkpoint_fp8_serialized = q.method_name.find("fp8") != std::string::npos;
  q.activation_scheme = get_string(get_from_keys(cfg, {"activation_scheme"}), "activation_scheme");
  // ignored_layers, falling back to modules_to_not_convert when absent or empty.
  q.ignored_layers = get_string_list(get_opt(cfg, "ignored_layers"), "ignored_layers");
  if (q.ignored_layers.empty()) {
    q.ignored_layers =
        get_string_list(get_opt(cfg, "modules_to_not_convert"), "modules_to_not_convert");
  }
  if (const json* f = get_opt(cfg, "fmt")) q.fmt = get_string(*f, "fmt");
  if (const json* s = get_opt(cfg, "scale_fmt")) {
    const std::string sf = get_string(*s, "scale_fmt");
    if (sf != "ue8m0") {
      throw ValueError(
          fmt::format("quantization_config: scale_fmt '{}' is not supported (only "
                      "\"ue8m0\" is known)",
                      sf));
    }
    q.scale_fmt_ue8m0 = true;
  }
  if (q.activation_scheme != "static" && q.activation_scheme != "dynamic") {
    throw ValueError(fmt::format("Unsupported activation scheme {}", q.activation_scheme));
  }
  if (const json* wbs = get_opt(cfg, "weight_block_size")) {
    if (!q.is_checkpoint_fp8_serialized) {
      throw ValueError(
          "The block-wise quantization only supports fp8-serialized checkpoint for now.");
    }
    q.weight_block_size = get_block(*wbs, "weight_block_size");
    if (q.activation_scheme != "dynamic") {
      throw ValueError(fmt::format(
          "The block-wise quantization only supports dynamic activation scheme for now, but got "
          "{} activation scheme.",
          q.activation_scheme));
    }
  }
  if (const json* st = get_opt(cfg, "store_dtype")) {
    const std::string sd = get_string(*st, "store_dtype");
    if (sd == "mxfp4") {
      // Fp8Config.get_quant_method: store_dtype == "mxfp4" -> Mxfp4MoEMethod.
      q.moe_method = "Mxfp4MoEMethod";
      q.not_fp8_reason =
          "quantization_config.store_dtype is \"mxfp4\": vLLM serves these experts with "
          "Mxfp4MoEMethod (MXFP4 weights), not the FP8 MoE oracle";
      return;
    }
  }
  q.moe_method = q.is_checkpoint_fp8_serialized ? "Fp8MoEMethod" : "Fp8PerTensorOnlineMoEMethod";
  q.moe_fp8 = true;
  q.allow_vllm_cutlass = false;  // Fp8MoEMethod passes False.
  if (q.weight_block_size) {
    // The checkpoint's block key. The newest vLLM resolves the TP block shape first and builds
    // create_fp8_quant_key(static=True, group_shape=GroupShape(*moe_block_shape)); the plan does
    // that. (The snapshot passed kFp8Static128BlockSym unconditionally, even for non-128 blocks.)
    const auto [bn, bk] = *q.weight_block_size;
    q.weight_key = create_fp8_quant_key(true, GroupShape(bn, bk));
    q.activation_key = kFp8Dynamic128Sym;
    q.block_shape = std::vector<int64_t>{bn, bk};
    q.block_resolvable = true;
    q.scale_kind = CheckpointScaleKind::kBlock;
    q.weight_scale_suffix = "weight_scale_inv";
  } else {
    q.weight_key = kFp8StaticTensorSym;
    q.activation_key = q.activation_scheme == "static" ? kFp8StaticTensorSym : kFp8DynamicTensorSym;
    q.scale_kind = CheckpointScaleKind::kPerTensor;
    q.weight_scale_suffix = "weight_scale";
    q.static_input_scales = q.activation_scheme == "static";
  }
}

// ---- compressed-tensors: CompressedTensorsW8A8Fp8MoEMethod
// ------------------------------------------
struct CtArgs {
  bool present = false;
  int num_bits = 0;
  std::string type;      // "float" | "int"
  std::string strategy;  // "tensor" | "channel" | "block" | "token" | "group"
  bool dynamic = false;
  bool symmetric = true;
  int64_t group_size = 0;
  std::optional<std::array<int64_t, 2>> block_structure;
};

CtArgs parse_ct_args(const json* v, const std::string& what) {
  CtArgs a;
  if (!v) return a;
  if (!v->is_object())
    throw FormatError(fmt::format("quantization_config: {} must be an object", what));
  a.present = true;
  if (const json* nb = get_opt(*v, "num_bits")) {
    if (!nb->is_number_integer()) {
      throw FormatError(fmt::format("quantization_config: {}.num_bits must be an integer", what));
    }
    a.num_bits = nb->get<int>();
  }
  if (const json* t = get_opt(*v, "type")) a.type = get_string(*t, what + ".type");
  if (const json* s = get_opt(*v, "strategy")) a.strategy = get_string(*s, what + ".strategy");
  if (const json* d = get_opt(*v, "dynamic")) {
    // compressed-tensors also allows the string "local" (dynamic, locally computed scales).
    a.dynamic =
        d->is_boolean() ? d->get<bool>() : (d->is_string() && d->get<std::string>() == "local");
  }
  if (const json* s = get_opt(*v, "symmetric"))
    a.symmetric = s->is_boolean() ? s->get<bool>() : true;
  if (const json* g = get_opt(*v, "group_size")) {
    if (g->is_number_integer()) a.group_size = g->get<int64_t>();
  }
  if (const json* b = get_opt(*v, "block_structure")) {
    if (b->is_string()) {  // older "128x128" spelling
      const std::string s = b->get<std::string>();
      const auto x = s.find('x');
      try {
        if (x == std::string::npos) throw std::invalid_argument("no x");
        a.block_structure =
            std::array<int64_t, 2>{std::stoll(s.substr(0, x)), std::stoll(s.substr(x + 1))};
      } catch (const std::exception&) {
        throw FormatError(
            fmt::format("quantization_config: {}.block_structure '{}' is not NxK", what, s));
      }
    } else {
      a.block_structure = get_block(*b, what + ".block_structure");
    }
  }
  return a;
}

bool ct_target_matches(const std::string& target, const std::string& module) {
  if (target.rfind("re:", 0) == 0) {
    try {
      return std::regex_search(module, std::regex(target.substr(3)));
    } catch (const std::regex_error&) {
      return false;
    }
  }
  return target == "Linear" || module == target;
}

void parse_compressed_tensors(const json& cfg, CheckpointQuant& q) {
  q.method = QuantMethod::kCompressedTensors;
  q.ignored_layers = get_string_list(get_opt(cfg, "ignore"), "ignore");
  const json* groups = get_opt(cfg, "config_groups");
  if (!groups || !groups->is_object() || groups->empty()) {
    throw FormatError(
        "quantization_config: compressed-tensors needs a non-empty \"config_groups\"");
  }
  // The scheme that applies to the routed experts' Linear modules: a group targeting "Linear" or a
  // regex matching an expert projection (the family's exact names are checked against the ignore
  // list later).
  const std::string probe = "model.layers.1.mlp.experts.1.gate_proj";
  const json* chosen = nullptr;
  for (auto it = groups->begin(); it != groups->end() && !chosen; ++it) {
    if (!it.value().is_object()) {
      throw FormatError(
          fmt::format("quantization_config: config_groups['{}'] must be an object", it.key()));
    }
    for (const std::string& t : get_string_list(get_opt(it.value(), "targets"), "targets")) {
      if (ct_target_matches(t, probe)) {
        chosen = &it.value();
        break;
      }
    }
  }
  if (!chosen) chosen = &groups->begin().value();
  const CtArgs w = parse_ct_args(get_opt(*chosen, "weights"), "weights");
  const CtArgs in = parse_ct_args(get_opt(*chosen, "input_activations"), "input_activations");
  q.ct_weight_strategy = w.strategy;
  q.ct_input_strategy = in.strategy;
  q.ct_input_dynamic = in.dynamic;
  if (!w.present) throw FormatError("quantization_config: the expert scheme has no \"weights\"");

  const bool w_fp8 = w.type == "float" && w.num_bits == 8;
  const bool in_fp8 = in.present && in.type == "float" && in.num_bits == 8;
  if (w_fp8 && w.strategy == "group" && w.group_size == 32) {
    q.moe_method = "CompressedTensorsW8A8Mxfp8MoEMethod";
    q.uses_mxfp8_oracle = true;
    q.weight_key = kMxfp8Static;
    q.activation_key = kMxfp8Dynamic;
    q.block_shape = std::vector<int64_t>{1, 32};
    q.scale_kind = CheckpointScaleKind::kMx;
    q.weight_scale_suffix = "weight_scale";
    q.scale_dtype = DType::kF8E8M0FNU;
    q.not_fp8_reason =
        "MXFP8 experts are selected by vLLM's oracle/mxfp8.py (select_mxfp8_moe_backend), which "
        "always evaluates (kMxfp8Static, kMxfp8Dynamic)";
    return;
  }
  if (!w_fp8) {
    q.moe_method = w.type == "int" ? "CompressedTensorsWNA16MoEMethod" : "";
    q.not_fp8_reason =
        fmt::format("compressed-tensors expert weights are {}{}-bit ({} strategy), not FP8",
                    w.type.empty() ? "untyped " : w.type + " ", w.num_bits, w.strategy);
    return;
  }
  if (!in_fp8) {
    q.moe_method = "CompressedTensorsW8A16Fp8MoEMethod";
    q.not_fp8_reason =
        "compressed-tensors FP8 weight-only (W8A16) experts run on vLLM's Marlin W8A16 path, not "
        "the FP8 W8A8 MoE oracle";
    return;
  }
  q.moe_method = "CompressedTensorsW8A8Fp8MoEMethod";
  q.moe_fp8 = true;
  q.is_checkpoint_fp8_serialized = true;
  q.activation_scheme = in.dynamic ? "dynamic" : "static";
  const bool per_tensor = w.strategy == "tensor" && in.strategy == "tensor";
  const bool per_channel = w.strategy == "channel" && in.strategy == "token";
  if (!per_tensor && !per_channel && w.strategy != "block") {
    // vLLM asserts here (AssertionError); fp8moe says which combination it was.
    throw ValueError(
        fmt::format("compressed-tensors FP8 MoE supports weight/input strategies tensor/tensor, "
                    "channel/token or block weights; got weights '{}' with input activations '{}'",
                    w.strategy, in.strategy));
  }
  if (!in.dynamic && per_channel) {
    throw ValueError(
        "For FP8 Fused MoE layer, we require either per tensor or channelwise, dynamic per token "
        "quantization.");
  }
  q.allow_vllm_cutlass = true;  // compressed-tensors W8A8-FP8 passes True.
  q.weight_scale_suffix = "weight_scale";
  q.static_input_scales = !in.dynamic;
  if (w.strategy == "block") {
    if (!w.block_structure) {
      throw FormatError("quantization_config: block weights need \"block_structure\" [n, k]");
    }
    q.weight_block_size = w.block_structure;
    // Oddity reproduced: the weight key is kFp8Static128BlockSym whatever block_structure says,
    // and the activation key is kFp8Dynamic128Sym whatever input_activations says.
    q.weight_key = kFp8Static128BlockSym;
    q.activation_key = kFp8Dynamic128Sym;
    q.block_shape = std::vector<int64_t>{(*w.block_structure)[0], (*w.block_structure)[1]};
    q.scale_kind = CheckpointScaleKind::kBlock;
    // create_weights only validates (no refine/pad for compressed-tensors).
    q.block_resolvable = false;
  } else {
    q.weight_key = w.strategy == "channel" ? kFp8StaticChannelSym : kFp8StaticTensorSym;
    if (in.strategy == "token") {
      q.activation_key = kFp8DynamicTokenSym;
    } else {
      // Oddity reproduced (sic): dynamic per-tensor input maps to the 1x128 group key, which leaves
      // only Marlin and Humming as candidates.
      q.activation_key = !in.dynamic ? kFp8StaticTensorSym : kFp8Dynamic128Sym;
    }
    q.scale_kind = w.strategy == "channel" ? CheckpointScaleKind::kPerChannel
                                           : CheckpointScaleKind::kPerTensor;
    q.per_act_token_quant = q.per_out_ch_quant = in.strategy == "token";
  }
}

// ---- modelopt: ModelOptFp8MoEMethod / ModelOptMxFp8FusedMoE
// ---------------------------------------
void parse_modelopt(const json& cfg, CheckpointQuant& q) {
  q.method = QuantMethod::kModelOpt;
  // Two spellings: quant_algo at the top of quantization_config, or nested under "quantization"
  // (hf_quant_config.json).
  const json* src = &cfg;
  if (const json* nested = get_opt(cfg, "quantization")) {
    if (!nested->is_object())
      throw FormatError("quantization_config: \"quantization\" must be an object");
    src = nested;
  }
  q.modelopt_algo = get_string(get_from_keys(*src, {"quant_algo"}), "quant_algo");
  q.ignored_layers = get_string_list(get_opt(*src, "exclude_modules"), "exclude_modules");
  std::string algo = q.modelopt_algo;
  for (char& c : algo) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  if (algo == "FP8") {
    q.moe_method = "ModelOptFp8MoEMethod";
    q.moe_fp8 = true;
    q.is_checkpoint_fp8_serialized = true;
    q.activation_scheme = "static";
    q.weight_key = kFp8StaticTensorSym;  // (TT) always
    q.activation_key = kFp8StaticTensorSym;
    q.allow_vllm_cutlass = false;
    q.scale_kind = CheckpointScaleKind::kPerTensor;
    q.weight_scale_suffix = "weight_scale";
    q.static_input_scales = true;
  } else if (algo == "MXFP8") {
    q.moe_method = "ModelOptMxFp8FusedMoE";
    q.uses_mxfp8_oracle = true;
    q.is_checkpoint_fp8_serialized = true;
    q.activation_scheme = "dynamic";
    q.weight_key = kMxfp8Static;
    q.activation_key = kMxfp8Dynamic;
    q.block_shape = std::vector<int64_t>{1, 32};
    q.scale_kind = CheckpointScaleKind::kMx;
    q.weight_scale_suffix = "weight_scale";
    q.scale_dtype = DType::kF8E8M0FNU;
    q.not_fp8_reason =
        "MXFP8 experts are selected by vLLM's oracle/mxfp8.py (select_mxfp8_moe_backend), which "
        "always evaluates (kMxfp8Static, kMxfp8Dynamic)";
  } else {
    q.not_fp8_reason = fmt::format(
        "modelopt quant_algo '{}' is not an FP8 MoE scheme (FP8 and MXFP8 are)", q.modelopt_algo);
  }
}

// ---- fbgemm_fp8: FBGEMMFp8Config
// --------------------------------------------------------------------
void parse_fbgemm(const json& cfg, CheckpointQuant& q) {
  q.method = QuantMethod::kFbgemmFp8;
  q.ignored_layers =
      get_string_list(&get_from_keys(cfg, {"modules_to_not_convert"}), "modules_to_not_convert");
  const json& ub = get_from_keys(cfg, {"activation_scale_ub"});
  if (!ub.is_number())
    throw FormatError("quantization_config: activation_scale_ub must be a number");
  q.activation_scheme = "dynamic";
  // Oddity reproduced: FBGEMMFp8Config.get_quant_method returns a method for LinearBase only, and
  // None for FusedMoE, so the experts are built unquantised; the FP8 MoE oracle is never consulted.
  // (Its Linear layers use per-channel weights with dynamic per-token activations.)
  q.moe_method = "UnquantizedFusedMoEMethod";
  q.not_fp8_reason =
      "vLLM's FBGEMMFp8Config quantises Linear layers only (per-channel weights, dynamic "
      "per-token activations) and returns no quant method for FusedMoE, so the experts run "
      "unquantised and the FP8 MoE oracle is not consulted";
}

}  // namespace

CheckpointQuant parse_quantization_config(std::string_view json_text) {
  json cfg;
  try {
    cfg = json::parse(json_text);
  } catch (const json::exception& e) {
    throw FormatError(fmt::format("quantization_config is not valid JSON: {}", e.what()));
  }
  CheckpointQuant q;
  if (cfg.is_null()) {
    q.not_fp8_reason = "the checkpoint has no quantization_config: its experts are not FP8";
    return q;
  }
  if (!cfg.is_object()) throw FormatError("quantization_config must be a JSON object");
  q.method_name = get_string(get_from_keys(cfg, {"quant_method"}), "quant_method");
  std::string m = q.method_name;
  for (char& c : m) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (m == "fp8") {
    parse_fp8(cfg, q);
  } else if (m == "compressed-tensors" || m == "compressed_tensors") {
    parse_compressed_tensors(cfg, q);
  } else if (m == "modelopt" || m == "modelopt_fp8") {
    parse_modelopt(cfg, q);
  } else if (m == "fbgemm_fp8") {
    parse_fbgemm(cfg, q);
  } else if (m == "mxfp4") {
    q.method = QuantMethod::kMxfp4;
    q.moe_method = "Mxfp4MoEMethod";
    q.ignored_layers =
        get_string_list(get_opt(cfg, "modules_to_not_convert"), "modules_to_not_convert");
    q.not_fp8_reason =
        "MXFP4 experts (quant_method \"mxfp4\") are served by vLLM's Mxfp4MoEMethod with its own "
        "backend selection, not the FP8 MoE oracle";
  } else {
    q.method = QuantMethod::kOther;
    q.not_fp8_reason = fmt::format(
        "quant_method '{}' is not an FP8 scheme fp8moe knows (fp8, "
        "compressed-tensors, modelopt, fbgemm_fp8)",
        q.method_name);
  }
  return q;
}

std::string CheckpointQuant::describe() const {
  if (method == QuantMethod::kNone) return "unquantised";
  std::string s = method_name;
  switch (scale_kind) {
    case CheckpointScaleKind::kBlock:
      s += fmt::format(" block [{}, {}]", (*weight_block_size)[0], (*weight_block_size)[1]);
      break;
    case CheckpointScaleKind::kPerTensor:
      s += " per-tensor weights";
      break;
    case CheckpointScaleKind::kPerChannel:
      s += " per-channel weights";
      break;
    case CheckpointScaleKind::kMx:
      s += " MXFP8 (1x32 e8m0)";
      break;
    case CheckpointScaleKind::kNone:
      if (!modelopt_algo.empty()) s += " " + modelopt_algo;
      break;
  }
  if (!ct_input_strategy.empty()) {
    s += fmt::format(", {} {} activations", ct_input_dynamic ? "dynamic" : "static",
                     ct_input_strategy);
  } else if (!activation_scheme.empty()) {
    s += fmt::format(", {} activations", activation_scheme);
  }
  if (scale_fmt_ue8m0) s += ", ue8m0 scales";
  return s;
}

}  // namespace fp8moe
