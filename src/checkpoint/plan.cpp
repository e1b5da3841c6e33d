// The deployment planner: config.json (+ the safetensors headers) -> for each distinct MoE layer
// shape, what vLLM's FP8 MoE method would do on a given platform and parallel layout, in its order:
//
//   Fp8MoEMethod.__init__   resolve_fp8_moe_weight_block_shape (refine | pad | keep), then
//                           select_fp8_moe_backend with the resolved block key
//   create_weights          validate_fp8_block_shape_moe when nothing was refined
//   get_fused_moe_quant_config  make_fp8_moe_quant_config(backend, ..., block_shape)
//
// compressed-tensors, ModelOpt and per-tensor fp8 skip the resolution step (their callers do), as
// spec/oracle.md §5.1 describes. No weight byte is read.
#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <numeric>

#include "checkpoint/checkpoint_internal.hpp"
#include "fp8moe/checkpoint.hpp"
#include "fp8moe/error.hpp"
#include "fp8moe/experts.hpp"

namespace fp8moe {

using nlohmann::ordered_json;

namespace {

int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

std::string block_str(const std::array<int64_t, 2>& b) {
  return fmt::format("[{}, {}]", b[0], b[1]);
}

void apply_resolution_text(ShapePlan& s, BlockResolutionText t) {
  s.resolution = std::move(t.resolution);
  s.resolution_why = std::move(t.why);
  for (std::string& n : t.notes) s.notes.push_back(std::move(n));
}

// Bytes of one rank's experts for one layer.
RankMemory rank_memory(const ModelConfig& m, const ShapePlan& s, int rank, int num_local, int64_t W,
                       int64_t valid) {
  RankMemory r;
  r.rank = rank;
  r.num_local_experts = num_local;
  r.local_intermediate = W;
  r.valid_intermediate = valid;
  const int64_t H = s.hidden;
  const uint64_t E = static_cast<uint64_t>(num_local);
  r.weight_bytes = E * static_cast<uint64_t>(2 * W * H + H * W);
  uint64_t scales = 0;
  switch (m.quant.scale_kind) {
    case CheckpointScaleKind::kBlock: {
      const auto& b = *s.block;
      scales = 4 * static_cast<uint64_t>(2 * cdiv(W, b[0]) * cdiv(H, b[1]) +
                                         cdiv(H, b[0]) * cdiv(W, b[1]));
      break;
    }
    case CheckpointScaleKind::kPerTensor:
      scales = 4 * 3;
      break;
    case CheckpointScaleKind::kPerChannel:
      scales = 4 * static_cast<uint64_t>(2 * W + H);
      break;
    case CheckpointScaleKind::kMx:
      scales = static_cast<uint64_t>(2 * W * H / 32 + H * W / 32);
      break;
    case CheckpointScaleKind::kNone:
      // Unquantised experts: the weights are in the model dtype.
      r.weight_bytes *= dtype_size(m.dtype);
      break;
  }
  if (m.quant.static_input_scales) scales += 4 * 2;
  r.scale_bytes = E * scales;
  return r;
}

// The roofline of a planned shape on its busiest rank (the one with the most expert bytes).
ShapeRoofline shape_roofline(const ModelConfig& m, const MoeParallelConfig& par, const ShapePlan& s,
                             const GpuCard& card, const std::vector<int64_t>& tokens) {
  const RankMemory& r = *std::max_element(s.ranks.begin(), s.ranks.end(), [](auto& a, auto& b) {
    return a.weight_bytes + a.scale_bytes < b.weight_bytes + b.scale_bytes;
  });
  const int tp = par.use_ep ? 1 : par.tp_size;
  ShapeRoofline R;
  RooflineLayer& L = R.layer;
  L.num_experts = s.num_experts;
  L.num_local_experts = r.num_local_experts;
  L.topk = s.topk;
  L.hidden = s.hidden;
  L.intermediate = r.local_intermediate;
  L.useful_intermediate = static_cast<double>(s.intermediate) / tp;
  L.token_factor = par.dp_size;
  L.expert_weight_bytes = static_cast<double>(r.weight_bytes) / r.num_local_experts;
  L.expert_scale_bytes = static_cast<double>(r.scale_bytes) / r.num_local_experts;
  L.activation_bytes = static_cast<double>(dtype_size(s.moe_config.in_dtype));
  // Weight-only (W8A16) kernels and unquantised experts multiply in BF16.
  const bool weight_only = s.selected && (s.selection.backend == Fp8MoeBackend::kMarlin ||
                                          s.selection.backend == Fp8MoeBackend::kCpu);
  L.fp8_compute = !s.ignored && m.quant.scale_kind != CheckpointScaleKind::kNone && !weight_only;
  R.num_layers = static_cast<int>(s.layers.size());
  const std::string tokens_text =
      par.dp_size > 1 ? fmt::format(
                            "the {} DP groups' tokens are all-gathered (vLLM's default "
                            "allgather_reducescatter): each GPU's MoE sees T = {} x M tokens",
                            par.dp_size, par.dp_size)
                      : std::string("every GPU's MoE sees the same T = M tokens");
  if (par.use_ep) {
    R.layout = fmt::format(
        "EP{}: the busiest GPU holds {} of {} experts with all {} rows; {}, and computes the ~T x "
        "top-{} x {}/{} pairs routed to its experts",
        par.ep_size, r.num_local_experts, s.num_experts, r.local_intermediate, tokens_text, s.topk,
        r.num_local_experts, s.num_experts);
    if (par.all2all_backend != "allgather_reducescatter") {
      R.layout += fmt::format(
          " (all2all backend {}: the same per-GPU expert bytes and FLOPs; dispatch traffic is not "
          "counted)",
          par.all2all_backend);
    }
  } else {
    R.layout = fmt::format(
        "TP{}: every GPU holds all {} experts with {} of their {} rows{}; {}", par.tp_size,
        s.num_experts, r.local_intermediate, s.intermediate,
        s.padded ? fmt::format(" (padded from {:.4g})", L.useful_intermediate) : "", tokens_text);
  }
  for (int64_t t : tokens) R.points.push_back(roofline_point(L, card, t));
  return R;
}

// Header cross-check of one layer: every routed expert's weight (and scale) exists with the dtype
// and shape the config implies. Returns a description of what was checked.
std::size_t check_layer_headers(const SafetensorsCheckpoint& ck, const ModelConfig& m, int layer,
                                bool ignored, std::string& layout_note) {
  const ExpertNaming naming = expert_naming(m);
  const std::string probe = expert_weight_name(m, layer, 0, ExpertProj::kGate);
  if (naming.layout != ExpertLayout::kPerExpert || !ck.find(probe)) {
    std::string prefix = probe.substr(0, probe.rfind(".experts.") + 9);
    for (const std::string fused : {"gate_up_proj", "gate_up_proj_blocks"}) {
      if (ck.find(prefix + fused)) {
        layout_note = fmt::format(
            "fused expert tensors ('{}'): planned from config.json; fp8moe loads per-expert "
            "checkpoints only",
            prefix + fused);
        return 0;
      }
    }
    throw FormatError(fmt::format("{}: layer {} has no routed expert tensors (expected '{}')",
                                  ck.root(), layer, probe));
  }
  const CheckpointQuant& q = m.quant;
  const bool fp8 = q.scale_kind != CheckpointScaleKind::kNone && !ignored;
  const int64_t H = m.hidden_size, I = m.moe_intermediate_size;
  std::size_t checked = 0;
  for (int e = 0; e < m.num_experts; ++e) {
    for (ExpertProj p : {ExpertProj::kGate, ExpertProj::kUp, ExpertProj::kDown}) {
      const bool down = p == ExpertProj::kDown;
      const int64_t rows = down ? H : I, cols = down ? I : H;
      const std::string wn = expert_weight_name(m, layer, e, p);
      const SafetensorsTensor* w = ck.find(wn);
      auto where = [&](const std::string& n) {
        return fmt::format("{}: '{}'", ck.shard_of(n).path(), n);
      };
      if (!w) throw FormatError(fmt::format("{}: missing expert tensor '{}'", ck.root(), wn));
      if (w->shape != std::vector<int64_t>{rows, cols}) {
        throw FormatError(fmt::format("{} has shape {}, but config.json implies [{}, {}]",
                                      where(wn), w->shape_str(), rows, cols));
      }
      if (fp8 && w->dtype_name != "F8_E4M3") {
        throw FormatError(fmt::format("{} has dtype {}, expected F8_E4M3 for a {} checkpoint",
                                      where(wn), w->dtype_name, q.method_name));
      }
      ++checked;
      if (!fp8) continue;
      const std::string sn = expert_scale_name(m, layer, e, p);
      const SafetensorsTensor* s = ck.find(sn);
      if (!s) throw FormatError(fmt::format("{}: missing weight scale '{}'", ck.root(), sn));
      std::string expected;
      bool good = false;
      switch (q.scale_kind) {
        case CheckpointScaleKind::kBlock: {
          const auto [bn, bk] = *q.weight_block_size;
          const std::vector<int64_t> shape{cdiv(rows, bn), cdiv(cols, bk)};
          expected = fmt::format("{} F32 (or F8_E8M0/U8)", shape_to_string(shape));
          good = s->shape == shape &&
                 (s->dtype_name == "F32" || s->dtype_name == "F8_E8M0" || s->dtype_name == "U8");
          break;
        }
        case CheckpointScaleKind::kPerTensor:
          expected = "one F32 value";
          good = s->numel() == 1 && s->dtype_name == "F32";
          break;
        case CheckpointScaleKind::kPerChannel:
          expected = fmt::format("[{}] or [{}, 1] F32", rows, rows);
          good = s->dtype_name == "F32" && (s->shape == std::vector<int64_t>{rows} ||
                                            s->shape == std::vector<int64_t>{rows, 1});
          break;
        case CheckpointScaleKind::kMx:
          expected = fmt::format("[{}, {}] F8_E8M0 or U8", rows, cols / 32);
          good = s->shape == std::vector<int64_t>{rows, cols / 32} &&
                 (s->dtype_name == "F8_E8M0" || s->dtype_name == "U8");
          break;
        case CheckpointScaleKind::kNone:
          good = true;
          break;
      }
      if (!good) {
        throw FormatError(fmt::format("{} is {} {}, expected {}", where(sn), s->shape_str(),
                                      s->dtype_name, expected));
      }
      ++checked;
      if (q.static_input_scales) {
        const std::string in = expert_input_scale_name(m, layer, e, p);
        const SafetensorsTensor* t = ck.find(in);
        if (!t) {
          throw FormatError(
              fmt::format("{}: missing static input scale '{}' (activation_scheme is "
                          "static)",
                          ck.root(), in));
        }
        if (t->numel() != 1 || t->dtype_name != "F32") {
          throw FormatError(fmt::format("{} is {} {}, expected one F32 value", where(in),
                                        t->shape_str(), t->dtype_name));
        }
        ++checked;
      }
    }
  }
  return checked;
}

void record_error(ShapePlan& s, const std::string& step, const Error& e) {
  s.ok = false;
  s.failed_step = step;
  s.error_kind = std::string(e.kind());
  s.error_message = e.what();
}

// One shape, in vLLM's order. Fills `s`; decision failures are recorded, not thrown.
void plan_shape(const ModelConfig& m, const MoeParallelConfig& par, const PlanOptions& opt,
                const Platform& platform, const OracleEnv& env, ShapePlan& s) {
  const CheckpointQuant& q = m.quant;
  const DType act = opt.act_dtype.value_or(m.dtype);
  MoeConfig cfg;
  try {
    cfg = m.moe_config(par, opt.moe_backend, act);
    cfg.is_lora_enabled = opt.lora;
  } catch (const Error& e) {
    record_error(s, "parallel", e);
    return;
  }
  s.moe_config = cfg;
  if (s.ignored || !q.moe_fp8) {
    const std::string why =
        s.ignored ? fmt::format(
                        "the quantisation config's ignore list names these experts, so "
                        "vLLM builds them with UnquantizedFusedMoEMethod (bf16), not the "
                        "FP8 MoE oracle")
        : q.uses_mxfp8_oracle
            ? q.not_fp8_reason + "; fp8moe implements oracle/fp8.py only, so this plan stops here"
            : q.not_fp8_reason;
    s.ok = false;
    s.failed_step = "fp8";
    s.error_kind = "NotImplementedError";
    s.error_message = why;
    return;
  }
  const KeyDType fp8 = platform.fp8_dtype();
  s.activation_key = with_fp8_dtype(q.activation_key, fp8);
  s.weight_key = with_fp8_dtype(q.weight_key, fp8);
  s.allow_vllm_cutlass = q.allow_vllm_cutlass;
  std::optional<std::vector<int64_t>> block_shape = q.block_shape;
  const int tp = cfg.tp_size();

  if (q.weight_block_size) {
    const auto wbs = *q.weight_block_size;
    s.checkpoint_block = wbs;
    s.block = wbs;
    const int64_t ispp = cfg.intermediate_size_per_partition;
    if (q.block_resolvable) {
      BlockShapeResolution res;
      try {
        res = resolve_fp8_moe_weight_block_shape(
            cfg, {static_cast<int>(wbs[0]), static_cast<int>(wbs[1])}, s.activation_key,
            q.is_checkpoint_fp8_serialized, platform);
      } catch (const Error& e) {
        record_error(s, "resolve", e);
        if (s.error_message.find("Block-aligned FP8 TP sharding") == std::string::npos) return;
        s.resolution = "pad";
        s.resolution_why = fmt::format(
            "per-rank intermediate {} is not whole {}-row blocks and the requested backend "
            "cannot take refined blocks, so vLLM tried to pad the shard",
            ispp, wbs[0]);
        return;
      }
      s.moe_config = cfg;
      s.block = std::array<int64_t, 2>{res.block_shape[0], res.block_shape[1]};
      s.padded = res.padded;
      if (res.refine) s.refine = std::array<int64_t, 2>{(*res.refine)[0], (*res.refine)[1]};
      block_shape = std::vector<int64_t>{(*s.block)[0], (*s.block)[1]};
      // [N]: the weight key carries the resolved block shape.
      s.weight_key =
          with_fp8_dtype(create_fp8_quant_key(true, GroupShape((*s.block)[0], (*s.block)[1])), fp8);
      apply_resolution_text(s, explain_block_resolution(res, wbs, ispp, cfg));
    } else {
      apply_resolution_text(s, explain_unresolved_blocks(q.method_name));
    }
  }

  // select_fp8_moe_backend (Fp8MoEMethod.__init__ / the compressed-tensors constructor).
  Selection progress;
  try {
    check_moe_config_for_platform(s.moe_config, platform);
    s.selection = select_fp8_moe_backend(s.moe_config, s.weight_key, s.activation_key,
                                         s.allow_vllm_cutlass, platform, env, &progress);
    s.selected = true;
  } catch (const Error& e) {
    s.selection = progress;
    record_error(s, "select", e);
    return;
  }

  // create_weights: the block check when nothing was refined (compressed-tensors always checks).
  if (q.weight_block_size && !s.refine) {
    try {
      validate_fp8_block_shape_moe(s.moe_config.intermediate_size_per_partition,
                                   *q.weight_block_size, tp);
    } catch (const Error& e) {
      record_error(s, "validate", e);
      return;
    }
  }

  // make_fp8_moe_quant_config with placeholder scale tensors of the loaded shapes.
  try {
    const int64_t E = s.moe_config.num_local_experts, H = s.hidden;
    const int64_t W = s.moe_config.intermediate_size_per_partition;
    Fp8QuantConfigInputs in;
    Fp8MoeLayerState layer;
    layer.weight_block_size = q.weight_block_size
                                  ? std::optional<std::vector<int64_t>>(std::vector<int64_t>{
                                        (*q.weight_block_size)[0], (*q.weight_block_size)[1]})
                                  : std::nullopt;
    layer.has_w13_weight_scale_inv = q.weight_scale_suffix == "weight_scale_inv";
    layer.humming_quantizes_inputs = true;
    switch (q.scale_kind) {
      case CheckpointScaleKind::kBlock:
        in.w1_scale =
            Tensor::zeros({E, 2 * cdiv(W, (*s.block)[0]), cdiv(H, (*s.block)[1])}, DType::kF32);
        in.w2_scale =
            Tensor::zeros({E, cdiv(H, (*s.block)[0]), cdiv(W, (*s.block)[1])}, DType::kF32);
        break;
      case CheckpointScaleKind::kPerTensor:
        in.w1_scale = Tensor::zeros({E}, DType::kF32);  // after vLLM's max-requant of (w1, w3)
        in.w2_scale = Tensor::zeros({E}, DType::kF32);
        break;
      case CheckpointScaleKind::kPerChannel:
        in.w1_scale = Tensor::zeros({E, 2 * W, 1}, DType::kF32);
        in.w2_scale = Tensor::zeros({E, H, 1}, DType::kF32);
        break;
      case CheckpointScaleKind::kMx:
        in.w1_scale = Tensor::zeros({E, 2 * W, H / 32}, DType::kU8);
        in.w2_scale = Tensor::zeros({E, H, W / 32}, DType::kU8);
        break;
      case CheckpointScaleKind::kNone:
        break;
    }
    if (q.static_input_scales) {
      in.a1_scale = Tensor::scalar_f32(1.0f);  // 0-d after process_fp8_input_tensor_strategy_moe
      in.a2_scale = Tensor::scalar_f32(1.0f);
    }
    in.block_shape = block_shape;
    in.per_act_token_quant = q.per_act_token_quant;
    in.per_out_ch_quant = q.per_out_ch_quant;
    in.swiglu_limit = s.moe_config.swiglu_limit;
    in.layer = &layer;
    in.fp8_dtype = fp8 == KeyDType::kF8E4M3FNUZ ? QuantDType::kFp8E4M3FNUZ : QuantDType::kFp8E4M3FN;
    const MoeQuantConfig qc = make_fp8_moe_quant_config(s.selection.backend, in);
    s.quant_config = qc.describe();
    s.quant_config_name = qc.config_name(act);
  } catch (const Error& e) {
    record_error(s, "quant_config", e);
    return;
  }
  if (q.scale_fmt_ue8m0) {
    s.notes.push_back(
        "the checkpoint declares scale_fmt ue8m0: its weight scales are powers of two, and "
        "activation quantisation must use power-of-two (UE8M0) scales too (pitfall 13)");
  }
  s.ok = true;
}

}  // namespace

BlockResolutionText explain_block_resolution(const BlockShapeResolution& res,
                                             std::array<int64_t, 2> wbs, int64_t ispp,
                                             const MoeConfig& cfg) {
  BlockResolutionText t;
  const std::array<int64_t, 2> block{res.block_shape[0], res.block_shape[1]};
  if (res.padded) {
    t.resolution = "pad";
    t.why = fmt::format(
        "per-rank intermediate {} = {}/{} is not whole {}-row blocks; moe_backend={} cannot "
        "take refined blocks, so each rank allocates W = {} rows (whole checkpoint blocks) and "
        "keeps its scales rank-local: rank r owns rows [r*{}, min((r+1)*{}, {})), the rest is "
        "weight 0 / scale 1",
        ispp, cfg.intermediate_size, cfg.tp_size(), wbs[0], cfg.moe_backend,
        cfg.intermediate_size_per_partition, cfg.intermediate_size_per_partition,
        cfg.intermediate_size_per_partition, cfg.intermediate_size);
  } else if (res.refine) {
    t.resolution = "refine";
    t.why = fmt::format(
        "per-rank intermediate {} is not whole {} blocks; gcd({}, {}, {}, hidden {}) = {} >= "
        "32, so the checkpoint scales are upsampled x{} (rows) x{} (columns) to {} blocks at "
        "load (lossless); only Triton-based kernels take refined blocks",
        ispp, block_str(wbs), wbs[0], wbs[1], ispp, cfg.hidden_dim, block[0], (*res.refine)[0],
        (*res.refine)[1], block_str(block));
    t.notes.push_back(fmt::format(
        "refined blocks quantise activations per 1x{} group (not 1x{}) and skip Triton's fused "
        "SiLU+quant: results differ slightly from TP=1",
        block[1], wbs[1]));
  } else {
    const bool fits = ispp % wbs[0] == 0 && (cfg.tp_size() == 1 || ispp % wbs[1] == 0);
    t.resolution = "keep";
    t.why = fits ? fmt::format("per-rank intermediate {} is whole {} blocks", ispp, block_str(wbs))
                 : fmt::format(
                       "per-rank intermediate {} is not whole {} blocks and gcd({}, {}, {}, "
                       "hidden {}) < 32 leaves no refinement",
                       ispp, block_str(wbs), wbs[0], wbs[1], ispp, cfg.hidden_dim);
  }
  return t;
}

BlockResolutionText explain_unresolved_blocks(std::string_view method_name) {
  return {.resolution = "keep",
          .why = fmt::format(
              "{} block checkpoints are not refined or padded by vLLM (only Fp8MoEMethod resolves "
              "blocks); the weight key is kFp8Static128BlockSym whatever the block is",
              method_name),
          .notes = {}};
}

MoeParallelConfig PlanParallel::make() const {
  if (tp < 1 || dp < 1 || pcp < 1 || ep < 0) {
    throw ValueError(fmt::format("parallel sizes must be positive: tp {}, dp {}, pcp {}, ep {}", tp,
                                 dp, pcp, ep));
  }
  int t = tp;
  bool use_ep = enable_ep;
  if (ep > 0) {
    if (!tp_given && ep % (dp * pcp) == 0) t = ep / (dp * pcp);
    if (ep != dp * pcp * t) {
      throw ValueError(fmt::format(
          "--ep {} does not match dp*pcp*tp = {}*{}*{} = {}: vLLM's expert-parallel size is the "
          "flattened dp*pcp*tp",
          ep, dp, pcp, t, dp * pcp * t));
    }
    use_ep = use_ep || ep > 1;
  }
  const auto& known = known_all2all_backends();
  if (std::find(known.begin(), known.end(), all2all_backend) == known.end()) {
    std::string names;
    for (const auto& k : known) names += fmt::format("{}{}", names.empty() ? "" : ", ", k);
    throw ValueError(
        fmt::format("unknown all2all backend '{}': expected one of {}", all2all_backend, names));
  }
  return MoeParallelConfig::make(t, pcp, dp, 1, use_ep, all2all_backend, false);
}

bool ModelPlan::moe_step_s(std::size_t i, double& seconds) const {
  seconds = 0;
  for (const auto& s : shapes) {
    if (!s.roofline || i >= s.roofline->points.size()) return false;
    seconds += s.roofline->num_layers * s.roofline->points[i].floor_s;
  }
  return !shapes.empty();
}

bool ModelPlan::ok() const {
  if (!error.empty() || shapes.empty()) return false;
  return std::all_of(shapes.begin(), shapes.end(), [](const ShapePlan& s) { return s.ok; });
}

uint64_t ModelPlan::max_rank_bytes() const {
  // Ranks are the same set for every shape (same parallel layout): sum per rank over shapes.
  std::map<int, uint64_t> per_rank;
  for (const auto& s : shapes) {
    for (const auto& r : s.ranks) {
      per_rank[r.rank] += (r.weight_bytes + r.scale_bytes) * s.layers.size();
    }
  }
  uint64_t m = 0;
  for (const auto& [rank, b] : per_rank) m = std::max(m, b);
  return m;
}

ModelPlan plan_model(const ModelConfig& model, const SafetensorsCheckpoint* ckpt,
                     const PlanOptions& options, const Platform& platform, const OracleEnv& env) {
  ModelPlan plan;
  plan.model = model;
  plan.platform = platform.describe();
  plan.moe_backend = options.moe_backend;

  // Group the MoE layers into distinct shapes: here (H, I, E, top-k) come from config.json and are
  // the same for every layer; what splits them is the ignore list (unquantised experts).
  std::map<bool, std::vector<int>> groups;
  for (int l : model.moe_layers) groups[moe_layer_ignored(model, l)].push_back(l);

  std::map<bool, std::string> header_notes;
  if (ckpt) {
    plan.headers_read = true;
    plan.checkpoint_shards = ckpt->shards().size();
    plan.checkpoint_tensors = ckpt->num_tensors();
    plan.checkpoint_bytes = ckpt->total_data_bytes();
    for (const auto& [ignored, layers] : groups) {
      std::size_t checked = 0;
      std::string layout_note;
      for (int l : layers) checked += check_layer_headers(*ckpt, model, l, ignored, layout_note);
      header_notes[ignored] =
          layout_note.empty()
              ? fmt::format(
                    "{} expert tensors of {} layer(s) match config.json (names, dtypes, "
                    "shapes)",
                    checked, layers.size())
              : layout_note;
    }
    plan.weight_bytes_read = ckpt->any_data_mapped();
  }

  MoeParallelConfig par;
  try {
    par = options.parallel.make();
  } catch (const Error& e) {
    plan.error = e.what();
    return plan;
  }
  plan.parallel = par.repr();
  plan.card = options.card;
  plan.card_note = options.card_note;
  plan.tokens_factor = par.dp_size;
  plan.world_size = par.use_ep ? par.ep_size : par.tp_size;

  for (const auto& [ignored, layers] : groups) {
    ShapePlan s;
    s.layers = layers;
    s.hidden = model.hidden_size;
    s.intermediate = model.moe_intermediate_size;
    s.num_experts = model.num_experts;
    s.topk = model.num_experts_per_tok;
    s.ignored = ignored;
    s.checkpoint = header_notes.count(ignored) ? header_notes[ignored] : "";
    plan_shape(model, par, options, platform, env, s);

    // Memory and FLOPs (also for failed plans once the layout is known, to show the cost).
    if (s.failed_step != "parallel") {
      const MoeConfig& c = s.moe_config;
      const int64_t W = c.intermediate_size_per_partition;
      const bool block = model.quant.scale_kind == CheckpointScaleKind::kBlock && s.block;
      if (par.use_ep) {
        for (int r = 0; r < par.ep_size; ++r) {
          s.ranks.push_back(rank_memory(
              model, s, r, place_experts(model.num_experts, par.ep_size, r).num_local(), W, W));
        }
      } else {
        for (int r = 0; r < par.tp_size; ++r) {
          const int64_t valid =
              c.tp_shard_with_padding
                  ? std::max<int64_t>(0, std::min<int64_t>(W, s.intermediate - r * W))
                  : W;
          s.ranks.push_back(rank_memory(model, s, r, model.num_experts, W, valid));
        }
      }
      if (!block && model.quant.scale_kind == CheckpointScaleKind::kBlock) s.ranks.clear();
      for (const auto& r : s.ranks) {
        s.max_rank_bytes_per_layer =
            std::max(s.max_rank_bytes_per_layer, r.weight_bytes + r.scale_bytes);
      }
      s.max_rank_bytes = s.max_rank_bytes_per_layer * s.layers.size();
      const int tp = par.use_ep ? 1 : par.tp_size;
      const double shards = activation_is_gated(model.activation) ? 2.0 : 1.0;
      s.useful_flops = 2.0 * static_cast<double>(s.hidden) * (shards + 1.0) *
                       static_cast<double>(s.intermediate);
      s.executed_flops =
          2.0 * static_cast<double>(s.hidden) * (shards + 1.0) * static_cast<double>(W) * tp;
      if (s.padded && s.executed_flops > s.useful_flops) {
        s.notes.push_back(
            fmt::format("padding costs {:.1f}% extra expert FLOPs: {} rank(s) x {} rows execute "
                        "for {} real rows",
                        100.0 * s.padding_overhead(), tp, W, s.intermediate));
      }
      // Experts outside the FP8 MoE oracle (MXFP4, ...) have other byte and FLOP counts: none.
      if (options.card && !s.ranks.empty() && W > 0 && s.failed_step != "fp8") {
        s.roofline = shape_roofline(model, par, s, *options.card, options.roofline_tokens);
      }
    }
    plan.shapes.push_back(std::move(s));
  }
  if (ckpt) plan.weight_bytes_read = ckpt->any_data_mapped();
  return plan;
}

TpShard plan_tp_shard(const ShapePlan& s, int tp_rank) {
  const MoeConfig& c = s.moe_config;
  if (s.checkpoint_block && s.block) {
    return make_tp_shard(s.intermediate, s.hidden, c.tp_size(), tp_rank, *s.checkpoint_block,
                         *s.block, s.refine, s.padded, c.intermediate_size_per_partition);
  }
  return make_plain_tp_shard(s.intermediate, s.hidden, c.tp_size(), tp_rank);
}

namespace {

ordered_json card_json(const GpuCard& c) {
  return {{"name", c.name},
          {"hbm_bytes_per_s", c.hbm_bytes_per_s},
          {"fp8_dense_flops", c.fp8_flops},
          {"bf16_dense_flops", c.bf16_flops},
          {"source", c.source},
          {"custom", c.custom}};
}

ordered_json roofline_json(const ModelPlan& p, const ShapePlan& s) {
  if (!s.roofline) return nullptr;
  const ShapeRoofline& R = *s.roofline;
  const RooflineLayer& L = R.layer;
  ordered_json pts = ordered_json::array();
  for (std::size_t i = 0; i < R.points.size(); ++i) {
    const RooflinePoint& q = R.points[i];
    double step = 0;
    const bool complete = p.moe_step_s(i, step);
    pts.push_back(
        {{"tokens", q.tokens},
         {"moe_tokens", q.moe_tokens},
         {"experts_touched", q.experts_touched},
         {"routed_pairs", q.routed_pairs},
         {"bytes",
          {{"weights", q.weight_bytes},
           {"scales", q.scale_bytes},
           {"activations", q.activation_bytes},
           {"intermediates", q.intermediate_bytes},
           {"total", q.bytes},
           {"padding", q.padding_bytes}}},
         {"flops", q.flops},
         {"padding_flops", q.padding_flops},
         {"memory_us", q.memory_s * 1e6},
         {"compute_us", q.compute_s * 1e6},
         {"floor_us", q.floor_s * 1e6},
         {"bound", q.compute_bound ? "compute" : "memory"},
         {"layers_us", q.floor_s * R.num_layers * 1e6},
         {"model_moe_step_us", complete ? ordered_json(step * 1e6) : ordered_json(nullptr)},
         {"tokens_per_s", complete && step > 0
                              ? ordered_json(static_cast<double>(q.moe_tokens) / step)
                              : ordered_json(nullptr)}});
  }
  return {{"lower_bound", true},
          {"what",
           "per-GPU floor of one MoE layer: max(bytes / HBM bandwidth, FLOPs / dense peak), "
           "uniform random routing (expected values), each touched expert's weights and scales "
           "read once, bf16 activations in/out and bf16 intermediates; no kernel is faster than "
           "this; measured kernels: fp8moe bench, docs/PERFORMANCE.md"},
          {"card", card_json(*p.card)},
          {"layout", R.layout},
          {"layers", R.num_layers},
          {"compute", L.fp8_compute ? "fp8" : "bf16"},
          {"local_experts", L.num_local_experts},
          {"rows_per_gpu", L.intermediate},
          {"useful_rows_per_gpu", L.useful_intermediate},
          {"token_factor", L.token_factor},
          {"expert_weight_bytes", L.expert_weight_bytes},
          {"expert_scale_bytes", L.expert_scale_bytes},
          {"points", pts}};
}

}  // namespace

ordered_json plan_to_json(const ModelPlan& p) {
  ordered_json j;
  const ModelConfig& m = p.model;
  j["model"] = {{"source", m.source},
                {"model_type", m.model_type},
                {"hidden_size", m.hidden_size},
                {"moe_intermediate_size", m.moe_intermediate_size},
                {"num_experts", m.num_experts},
                {"num_experts_per_tok", m.num_experts_per_tok},
                {"moe_layers", m.moe_layers.size()},
                {"routing_method", std::string(routing_method_name(m.routing_method))},
                {"activation", std::string(activation_value(m.activation))},
                {"dtype", std::string(dtype_name(m.dtype))}};
  const CheckpointQuant& q = m.quant;
  j["quantization"] = {
      {"quant_method", q.method_name.empty() ? ordered_json(nullptr) : ordered_json(q.method_name)},
      {"description", q.describe()},
      {"moe_method", q.moe_method},
      {"fp8_moe_oracle", q.moe_fp8},
      {"weight_key", quant_key_name(q.weight_key)},
      {"activation_key", quant_key_name(q.activation_key)},
      {"allow_vllm_cutlass", q.allow_vllm_cutlass},
      {"block_shape", q.block_shape ? ordered_json(*q.block_shape) : ordered_json(nullptr)},
      {"scale_fmt_ue8m0", q.scale_fmt_ue8m0},
      {"weight_scale", q.weight_scale_suffix},
      {"static_input_scales", q.static_input_scales}};
  j["checkpoint"] = p.headers_read ? ordered_json{{"shards", p.checkpoint_shards},
                                                  {"tensors", p.checkpoint_tensors},
                                                  {"data_bytes", p.checkpoint_bytes},
                                                  {"weight_bytes_read", p.weight_bytes_read}}
                                   : ordered_json(nullptr);
  j["platform"] = p.platform;
  j["parallel"] = p.parallel;
  j["world_size"] = p.world_size;
  j["moe_backend"] = p.moe_backend;
  j["ok"] = p.ok();
  if (!p.error.empty()) j["error"] = p.error;
  j["max_rank_expert_bytes"] = p.max_rank_bytes();
  j["card"] = p.card ? card_json(*p.card) : ordered_json(nullptr);
  if (!p.card_note.empty()) j["card_note"] = p.card_note;
  ordered_json shapes = ordered_json::array();
  for (const ShapePlan& s : p.shapes) {
    ordered_json o;
    o["layers"] = s.layers;
    o["shape"] = {{"num_experts", s.num_experts},
                  {"topk", s.topk},
                  {"hidden", s.hidden},
                  {"intermediate", s.intermediate},
                  {"intermediate_per_partition", s.moe_config.intermediate_size_per_partition},
                  {"num_local_experts", s.moe_config.num_local_experts}};
    o["unquantised_by_ignore_list"] = s.ignored;
    if (!s.checkpoint.empty()) o["checkpoint"] = s.checkpoint;
    o["ok"] = s.ok;
    if (!s.ok) {
      o["failed_step"] = s.failed_step;
      o["error"] = {{"kind", s.error_kind}, {"message", s.error_message}};
    }
    auto arr = [](const std::optional<std::array<int64_t, 2>>& a) {
      return a ? ordered_json({(*a)[0], (*a)[1]}) : ordered_json(nullptr);
    };
    o["block_resolution"] = {{"mode", s.resolution},
                             {"why", s.resolution_why},
                             {"checkpoint_block", arr(s.checkpoint_block)},
                             {"block", arr(s.block)},
                             {"refine", arr(s.refine)},
                             {"padded", s.padded}};
    o["weight_key"] = quant_key_name(s.weight_key);
    o["activation_key"] = quant_key_name(s.activation_key);
    o["allow_vllm_cutlass"] = s.allow_vllm_cutlass;
    ordered_json trace = ordered_json::array();
    for (const auto& t : s.selection.trace) {
      trace.push_back({{"backend", backend_value(t.backend)},
                       {"kernel", t.kernel},
                       {"supported", t.supported},
                       {"reason", t.supported ? ordered_json(nullptr) : ordered_json(t.reason)}});
    }
    o["selection"] = {
        {"backend",
         s.selected ? ordered_json(backend_value(s.selection.backend)) : ordered_json(nullptr)},
        {"kernel", s.selected && s.selection.kernel ? ordered_json(s.selection.kernel->name)
                                                    : ordered_json(nullptr)},
        {"implementation", s.selected && s.selection.kernel && s.selection.kernel->impl_name
                               ? ordered_json(s.selection.kernel->impl_name)
                               : ordered_json(nullptr)},
        {"path", s.selection.path},
        {"candidates", s.selection.candidates},
        {"notes", s.selection.notes},
        {"trace", trace}};
    o["quant_config"] =
        s.quant_config.empty() ? ordered_json(nullptr) : ordered_json(s.quant_config);
    o["quant_config_name"] = s.quant_config_name;
    ordered_json ranks = ordered_json::array();
    for (const auto& r : s.ranks) {
      ranks.push_back({{"rank", r.rank},
                       {"local_experts", r.num_local_experts},
                       {"local_intermediate", r.local_intermediate},
                       {"valid_intermediate", r.valid_intermediate},
                       {"weight_bytes_per_layer", r.weight_bytes},
                       {"scale_bytes_per_layer", r.scale_bytes}});
    }
    o["ranks"] = ranks;
    o["max_rank_bytes_per_layer"] = s.max_rank_bytes_per_layer;
    o["max_rank_bytes"] = s.max_rank_bytes;
    o["flops_per_routed_token_per_layer"] = {{"useful", s.useful_flops},
                                             {"executed", s.executed_flops},
                                             {"padding_overhead", s.padding_overhead()}};
    o["notes"] = s.notes;
    o["roofline"] = roofline_json(p, s);
    shapes.push_back(o);
  }
  j["shapes"] = shapes;
  return j;
}

}  // namespace fp8moe
