// Fp8MoeLayer: plan -> (load) -> prepare -> forward. Every call is checked against the planned
// shapes, dtypes and device before a kernel sees it; the per-M kernel choice is made on the host
// from M alone; the workspace is allocated once, at construction.
#include <fmt/format.h>

#include <algorithm>
#include <cstring>

#include "fp8moe/error.hpp"
#include "fp8moe/layer.hpp"
#include "fp8moe/log.hpp"
#include "kernels/ref/ref.hpp"
#include "kernels/registry.hpp"
#include "layer/layer_internal.hpp"
#include "numerics/routing.hpp"

namespace fp8moe {

using layer_detail::cdiv;
using layer_detail::shape_str;

struct Fp8MoeLayer::State {
  Fp8MoeLayerPlan plan;
  MoeQuantConfig qc;
  PreparedMoeWeights w;
  RoutingConfig routing;
  Tensor e_score_bias;
  bool weight_on_input = false;
  Device device{};
  int64_t max_tokens = 1024;
  Tensor workspace;
  std::size_t ws_bytes = 0;
};

namespace {

[[noreturn]] void throw_kind(std::string_view kind, const std::string& message) {
  if (kind == "NotImplementedError") throw NotImplementedError(message);
  if (kind == "FormatError") throw FormatError(message);
  if (kind == "RuntimeError") throw RuntimeError(message);
  throw ValueError(message);
}

void throw_if_not_runnable(const Fp8MoeLayerPlan& p) {
  if (!p.ok) {
    throw_kind(p.error_kind, fmt::format("{} (planning {} failed at the '{}' step)",
                                         p.error_message, p.source, p.failed_step));
  }
  if (!p.runnable) {
    throw NotImplementedError(fmt::format("{}: {}", p.source, p.not_runnable_reason));
  }
}

// One weight tensor against the plan: exact shape, one of the dtypes, on `device` or the host.
void expect_tensor(const char* name, const Tensor& t, const std::vector<int64_t>& shape,
                   std::initializer_list<DType> dtypes, const std::string& what,
                   const Device& device) {
  std::string dts;
  for (DType d : dtypes) dts += fmt::format("{}{}", dts.empty() ? "" : "/", dtype_name(d));
  if (!t.defined()) {
    throw ValueError(fmt::format("Fp8MoeLayer: {} is missing: expected {} {} ({})", name,
                                 shape_str(shape), dts, what));
  }
  bool dtype_ok = false;
  for (DType d : dtypes) dtype_ok |= t.dtype() == d;
  if (t.sizes() != shape || !dtype_ok) {
    throw ValueError(fmt::format("Fp8MoeLayer: {} has shape {} {}, expected {} {} ({})", name,
                                 shape_str(t.sizes()), dtype_name(t.dtype()), shape_str(shape), dts,
                                 what));
  }
  if (!t.view().is_contiguous()) {
    throw ValueError(
        fmt::format("Fp8MoeLayer: {} {} must be contiguous", name, t.view().describe()));
  }
  if (!t.device().is_cpu() && !(t.device() == device)) {
    throw ValueError(fmt::format("Fp8MoeLayer: {} is on {}, but the layer's device is {}", name,
                                 t.device().str(), device.str()));
  }
}

// The loaded (pre-preparation) weights must have the planned shapes.
void check_weights(const Fp8MoeLayerPlan& p, const Fp8MoeWeights& w, const Device& device) {
  const int64_t E = p.num_local_experts, H = p.hidden, W = p.local_intermediate;
  const bool gated = activation_is_gated(p.config.activation);
  const int64_t N1 = gated ? 2 * W : W;
  const std::string why_w = p.resolution == "pad"
                                ? fmt::format("W = {}: the padded per-rank intermediate", W)
                                : fmt::format("W = {}: intermediate {} over TP {}", W,
                                              p.intermediate, p.config.tp_size());
  const auto fp8s = {DType::kF8E4M3FN, p.scheme.fp8};
  expect_tensor(
      "w13", w.w13, {E, N1, H}, fp8s,
      fmt::format("local experts, {}gate/up rows, hidden; {}", gated ? "2*W " : "W ", why_w),
      device);
  expect_tensor("w2", w.w2, {E, H, W}, fp8s, "local experts, hidden, W", device);
  switch (p.scheme.weight) {
    case WeightScaleKind::kBlock: {
      const auto b = *p.block;
      const std::string what =
          p.refine
              ? fmt::format(
                    "[{}, {}] scales: the plan refines the checkpoint's {} blocks "
                    "(upsample_block_scales)",
                    b[0], b[1],
                    fmt::format("[{}, {}]", (*p.checkpoint_block)[0], (*p.checkpoint_block)[1]))
              : fmt::format("[{}, {}] block scales", b[0], b[1]);
      expect_tensor("w13_scale", w.w13_scale, {E, cdiv(N1, b[0]), cdiv(H, b[1])}, {DType::kF32},
                    what, device);
      expect_tensor("w2_scale", w.w2_scale, {E, cdiv(H, b[0]), cdiv(W, b[1])}, {DType::kF32}, what,
                    device);
      break;
    }
    case WeightScaleKind::kPerTensor:
      if (w.w13_scale.defined() && w.w13_scale.ndim() == 2) {
        expect_tensor("w13_scale", w.w13_scale, {E, 2}, {DType::kF32},
                      "one scale per gate/up shard", device);
      } else {
        expect_tensor("w13_scale", w.w13_scale, {E}, {DType::kF32}, "one scale per expert", device);
      }
      expect_tensor("w2_scale", w.w2_scale, {E}, {DType::kF32}, "one scale per expert", device);
      break;
    case WeightScaleKind::kPerChannel:
      expect_tensor("w13_scale", w.w13_scale, {E, N1}, {DType::kF32}, "one scale per output row",
                    device);
      expect_tensor("w2_scale", w.w2_scale, {E, H}, {DType::kF32}, "one scale per output row",
                    device);
      break;
    case WeightScaleKind::kMx:
      throw NotImplementedError(
          "Fp8MoeLayer: MXFP8 experts go through vLLM's mxfp8 oracle, which fp8moe does not "
          "implement");
  }
  if (p.scheme.act == ActQuantKind::kPerTensorStatic) {
    expect_tensor("w13_input_scale", w.w13_input_scale, {E}, {DType::kF32},
                  "static input scale per expert (activation_scheme static)", device);
    expect_tensor("w2_input_scale", w.w2_input_scale, {E}, {DType::kF32},
                  "static input scale per expert (activation_scheme static)", device);
  } else if (w.w13_input_scale.defined() || w.w2_input_scale.defined()) {
    throw ValueError(fmt::format(
        "Fp8MoeLayer: static input scales were given, but the plan's activations are {} (scheme "
        "{})",
        p.scheme.act == ActQuantKind::kNone ? "not quantised" : "quantised dynamically",
        p.scheme.str()));
  }
  if (p.config.has_bias) {
    expect_tensor("w13_bias", w.w13_bias, {E, N1}, {DType::kF32, DType::kBF16}, "bias of GEMM1",
                  device);
    expect_tensor("w2_bias", w.w2_bias, {E, H}, {DType::kF32, DType::kBF16}, "bias of GEMM2",
                  device);
  } else if (w.w13_bias.defined() || w.w2_bias.defined()) {
    throw ValueError("Fp8MoeLayer: biases were given, but the config says has_bias = false");
  }
  if (p.config.use_ep()) {
    expect_tensor("expert_map", w.expert_map, {p.num_experts}, {DType::kI32},
                  fmt::format("global -> local expert map of EP rank {}", p.config.ep_rank()),
                  device);
  } else if (w.expert_map.defined()) {
    throw ValueError("Fp8MoeLayer: an expert_map was given without expert parallelism");
  }
}

Tensor to_device(const Tensor& t, const Device& d) {
  if (!t.defined() || t.device() == d) return t;
  return t.to(d);
}

// x / router_logits / out against the layer (forward's checks).
void check_io(const char* name, const TensorView& t, int64_t rows, int64_t cols,
              std::initializer_list<DType> dtypes, const char* what, const Device& device,
              const char* fn = "Fp8MoeLayer.forward") {
  std::string dts;
  for (DType d : dtypes) dts += fmt::format("{}{}", dts.empty() ? "" : " or ", dtype_name(d));
  bool dtype_ok = false;
  for (DType d : dtypes) dtype_ok |= t.dtype == d;
  const std::string expected = fmt::format(
      "({}, {}) {} ({})", rows < 0 ? std::string("M") : std::to_string(rows), cols, dts, what);
  if (!t.defined() || t.ndim != 2 || (rows >= 0 && t.size(0) != rows) || t.size(1) != cols ||
      !dtype_ok) {
    throw ValueError(fmt::format("{}: {} is {}, expected {}", fn, name,
                                 t.defined() ? t.describe() : std::string("missing"), expected));
  }
  if (!t.is_contiguous()) {
    throw ValueError(fmt::format("{}: {} {} must be contiguous", fn, name, t.describe()));
  }
  if (!(t.device == device)) {
    throw ValueError(fmt::format(
        "{}: {} is on {}, but the layer's weights are on {}; fp8moe does not copy inputs between "
        "devices",
        fn, name, t.device.str(), device.str()));
  }
  if (t.numel() > 0 && !t.data) {
    throw ValueError(fmt::format("{}: {} {} has no data", fn, name, t.describe()));
  }
}

// Rows [r0, r0 + n) of a contiguous 2-D view.
TensorView rows_of(const TensorView& t, int64_t r0, int64_t n) {
  TensorView v = t;
  v.shape[0] = n;
  v.data = static_cast<uint8_t*>(t.data) + r0 * t.strides[0] * dtype_size(t.dtype);
  return v;
}

}  // namespace

Fp8MoeLayer::Fp8MoeLayer(std::unique_ptr<State> s) : s_(std::move(s)) {}
Fp8MoeLayer::Fp8MoeLayer(Fp8MoeLayer&&) noexcept = default;
Fp8MoeLayer& Fp8MoeLayer::operator=(Fp8MoeLayer&&) noexcept = default;
Fp8MoeLayer::~Fp8MoeLayer() = default;

Fp8MoeLayer Fp8MoeLayer::build(const Fp8MoeLayerSpec& spec, Fp8MoeLayerPlan plan,
                               const Fp8MoeWeights& weights, const Fp8MoeLayerOptions& opt) {
  throw_if_not_runnable(plan);
  if (opt.max_num_tokens < 1) {
    throw ValueError(
        fmt::format("Fp8MoeLayer: max_num_tokens must be positive, got {}", opt.max_num_tokens));
  }
  const Device device = plan.device;
  check_weights(plan, weights, device);
  auto st = std::make_unique<State>();
  st->device = device;
  st->max_tokens = opt.max_num_tokens;
  st->weight_on_input = spec.apply_router_weight_on_input;
  const std::array<int64_t, 2> block = plan.block.value_or(std::array<int64_t, 2>{0, 0});
  PreparedMoeWeights w = prepare_fp8_moe_weights(weights, *plan.kernel_format, plan.layout,
                                                 plan.scheme.weight, block, plan.scheme.fp8);
  for (Tensor* t : {&w.w13, &w.w2, &w.w13_scale, &w.w2_scale, &w.w13_bias, &w.w2_bias, &w.a13_scale,
                    &w.a2_scale, &w.expert_map}) {
    *t = to_device(*t, device);
  }
  st->w = std::move(w);
  // The quant config with the loaded scale tensors (what the kernel would be built with in vLLM).
  st->qc = layer_detail::make_layer_quant_config(
      plan.quant_backend, spec.quant, plan.config, plan.quant_block_shape,
      plan.scheme.fp8 == DType::kF8E4M3FNUZ ? KeyDType::kF8E4M3FNUZ : KeyDType::kF8E4M3FN,
      st->w.w13_scale, st->w.w2_scale, st->w.a13_scale, st->w.a2_scale, st->w.w13_bias,
      st->w.w2_bias);
  // Routing, with the layer's own copy of the correction bias on its device.
  st->routing = spec.routing;
  st->routing.e_score_correction_bias = {};
  if (spec.e_score_correction_bias.defined()) {
    const Tensor& b = spec.e_score_correction_bias;
    if (b.ndim() != 1 || b.size(0) != plan.num_experts ||
        (b.dtype() != DType::kF32 && b.dtype() != DType::kBF16)) {
      throw ValueError(fmt::format(
          "Fp8MoeLayer: e_score_correction_bias {} must be ({},) f32 or bf16 (one per global "
          "expert)",
          b.view().describe(), plan.num_experts));
    }
    st->e_score_bias = to_device(b, device);
    st->routing.e_score_correction_bias = st->e_score_bias.view();
  }
  numerics::check_routing_config(st->routing, plan.num_experts);
  if (st->weight_on_input && plan.topk != 1) {
    throw ValueError(fmt::format(
        "Fp8MoeLayer: apply_router_weight_on_input needs top-1 routing, the layer has top-{}",
        plan.topk));
  }
  st->plan = std::move(plan);
  Fp8MoeLayer layer(std::move(st));
  layer.init_workspace();
  return layer;
}

Fp8MoeLayer Fp8MoeLayer::from_tensors(const Fp8MoeLayerSpec& spec, const Fp8MoeWeights& weights,
                                      const Fp8MoeLayerOptions& options) {
  return build(spec, plan_fp8_moe_layer(spec, options), weights, options);
}

Fp8MoeLayer Fp8MoeLayer::from_checkpoint(const std::string& model_dir,
                                         const CheckpointLayerRequest& request,
                                         const Fp8MoeLayerOptions& options) {
  const ModelConfig model = load_model_config(model_dir);
  Fp8MoeLayerSpec spec = checkpoint_layer_spec(model, request);
  const int layer_index = request.layer < 0 ? model.moe_layers.front() : request.layer;
  Fp8MoeLayerPlan plan = plan_fp8_moe_layer(spec, options);
  throw_if_not_runnable(plan);
  const SafetensorsCheckpoint ck = SafetensorsCheckpoint::open(model_dir);
  const MoeConfig& cfg = plan.config;
  TpShard tp;
  if (plan.block && model.quant.scale_kind == CheckpointScaleKind::kBlock) {
    tp = make_tp_shard(plan.intermediate, plan.hidden, cfg.tp_size(), cfg.tp_rank(),
                       *plan.checkpoint_block, *plan.block, plan.refine, plan.padded,
                       plan.local_intermediate);
  } else {
    tp = make_plain_tp_shard(plan.intermediate, plan.hidden, cfg.tp_size(), cfg.tp_rank());
  }
  const ExpertPlacement ep = place_experts(plan.num_experts, cfg.use_ep() ? cfg.ep_size() : 1,
                                           cfg.use_ep() ? cfg.ep_rank() : 0);
  LoadedMoeLayer loaded = load_moe_layer(ck, model, layer_index, tp, ep);
  Fp8MoeWeights w;
  w.w13 = loaded.w13;
  w.w2 = loaded.w2;
  w.w13_scale = loaded.w13_scale;
  w.w2_scale = loaded.w2_scale;
  w.w13_input_scale = loaded.w13_input_scale;
  w.w2_input_scale = loaded.w2_input_scale;
  if (cfg.use_ep()) w.expert_map = loaded.expert_map;
  // The routing correction bias (DeepSeek-V3 / Kimi / GLM / MiniMax style routers).
  if (model.has_e_score_bias) {
    std::string experts = expert_module_name(model, layer_index, 0, ExpertProj::kGate);
    for (int i = 0; i < 3; ++i) experts = experts.substr(0, experts.rfind('.'));
    // experts = "model.layers.L.mlp" (the MoE block)
    const std::vector<std::string> names = {experts + ".gate.e_score_correction_bias",
                                            experts + ".e_score_correction_bias"};
    const SafetensorsTensor* found = nullptr;
    std::string found_name;
    for (const auto& n : names) {
      if ((found = ck.find(n))) {
        found_name = n;
        break;
      }
    }
    if (!found) {
      throw FormatError(fmt::format(
          "{}: the router uses an e_score_correction_bias, but neither '{}' nor '{}' is in the "
          "checkpoint",
          ck.root(), names[0], names[1]));
    }
    if (!found->dtype || (*found->dtype != DType::kF32 && *found->dtype != DType::kBF16) ||
        found->numel() != model.num_experts) {
      throw FormatError(fmt::format("{}: '{}' is {} {}, expected [{}] F32 or BF16", ck.root(),
                                    found_name, found->dtype_name, found->shape_str(),
                                    model.num_experts));
    }
    Tensor b = Tensor::empty({model.num_experts}, *found->dtype);
    const auto bytes = ck.data(found_name);
    std::memcpy(b.data(), bytes.data(), b.nbytes());
    spec.e_score_correction_bias = b;
  }
  return build(spec, std::move(plan), w, options);
}

void Fp8MoeLayer::init_workspace() {
  State& st = *s_;
  // The largest workspace any call of <= max_tokens tokens asks for, for either implementation
  // the dispatch can pick and either input dtype, computed on real (uninitialised) buffers.
  const int64_t Mx = st.max_tokens, H = st.plan.hidden, E = st.plan.num_experts;
  std::size_t bytes = 0;
  for (DType xd : {DType::kBF16, DType::kF32}) {
    Tensor x = Tensor::empty({Mx, H}, xd, st.device);
    Tensor logits = Tensor::empty({Mx, E}, DType::kF32, st.device);
    Tensor out = Tensor::empty({Mx, H}, xd, st.device);
    std::vector<int64_t> ms;
    for (int64_t m = 1; m < Mx; m *= 2) ms.push_back(m);
    ms.push_back(Mx);
    for (int64_t m : {int64_t{8}, int64_t{9}, int64_t{127}, int64_t{128}}) {
      if (m < Mx) ms.push_back(m);  // the dispatch thresholds
    }
    for (int64_t m : ms) {
      const KernelChoice c = kernel_for(m);
      if (!c.impl || !c.impl->workspace_size) continue;
      const FusedMoeArgs a = make_args(rows_of(x.view(), 0, m), rows_of(logits.view(), 0, m),
                                       rows_of(out.view(), 0, m));
      // An implementation that cannot take this call (cuda_grouped: bf16 activations only)
      // needs no workspace for it: the same call's forward raises its error.
      try {
        bytes = std::max(bytes, c.impl->workspace_size(a));
      } catch (const Error&) {
        continue;
      }
    }
  }
  st.ws_bytes = bytes;
  if (bytes > 0) st.workspace = Tensor::empty({static_cast<int64_t>(bytes)}, DType::kU8, st.device);
}

const Fp8MoeLayerPlan& Fp8MoeLayer::plan() const { return s_->plan; }
const MoeQuantConfig& Fp8MoeLayer::quant_config() const { return s_->qc; }
const PreparedMoeWeights& Fp8MoeLayer::weights() const { return s_->w; }
const RoutingConfig& Fp8MoeLayer::routing() const { return s_->routing; }
bool Fp8MoeLayer::apply_router_weight_on_input() const { return s_->weight_on_input; }
Device Fp8MoeLayer::device() const { return s_->device; }
int64_t Fp8MoeLayer::hidden_size() const { return s_->plan.hidden; }
int Fp8MoeLayer::num_experts() const { return s_->plan.num_experts; }
int Fp8MoeLayer::num_local_experts() const { return s_->plan.num_local_experts; }
int64_t Fp8MoeLayer::local_intermediate() const { return s_->plan.local_intermediate; }
int64_t Fp8MoeLayer::max_num_tokens() const { return s_->max_tokens; }
std::size_t Fp8MoeLayer::owned_workspace_bytes() const { return s_->ws_bytes; }

KernelChoice Fp8MoeLayer::kernel_for(int64_t num_tokens) const {
  return s_->plan.dispatch(num_tokens);
}

FusedMoeArgs Fp8MoeLayer::make_args(const TensorView& x, const TensorView& router_logits,
                                    const TensorView& out, void* stream) const {
  const State& st = *s_;
  FusedMoeArgs a;
  a.x = x;
  a.router_logits = router_logits;
  a.routing = st.routing;
  a.weights = st.w.views();
  a.scheme = st.plan.scheme;
  a.act = st.plan.activation;
  if (st.w.expert_map.defined()) a.expert_map = st.w.expert_map.view();
  a.apply_router_weight_on_input = st.weight_on_input;
  a.batch_invariant = st.plan.batch_invariant;
  a.out = out;
  a.stream = stream;
  return a;
}

std::size_t Fp8MoeLayer::workspace_size(int64_t num_tokens) const {
  if (num_tokens < 0) throw ValueError("Fp8MoeLayer.workspace_size: num_tokens must be >= 0");
  if (num_tokens == 0) return 0;
  const State& st = *s_;
  const KernelChoice c = kernel_for(num_tokens);
  if (!c.impl || !c.impl->workspace_size) return 0;
  std::size_t bytes = 0;
  for (DType xd : {DType::kBF16, DType::kF32}) {
    Tensor x = Tensor::empty({num_tokens, st.plan.hidden}, xd, st.device);
    Tensor logits = Tensor::empty({num_tokens, st.plan.num_experts}, DType::kF32, st.device);
    Tensor out = Tensor::empty({num_tokens, st.plan.hidden}, xd, st.device);
    try {  // as in init_workspace: a call shape the implementation rejects needs no workspace
      bytes = std::max(bytes, c.impl->workspace_size(make_args(x, logits, out)));
    } catch (const Error&) {
      continue;
    }
  }
  return bytes;
}

std::string Fp8MoeLayer::describe_call(const TensorView& x, const TensorView& router_logits,
                                       const TensorView& out) const {
  const State& st = *s_;
  constexpr const char* fn = "Fp8MoeLayer.describe_call";
  check_io("x", x, -1, st.plan.hidden, {DType::kBF16, DType::kF32}, "num_tokens, hidden", st.device,
           fn);
  check_io("router_logits", router_logits, x.size(0), st.plan.num_experts,
           {DType::kF32, DType::kBF16}, "num_tokens, global experts", st.device, fn);
  check_io("out", out, x.size(0), st.plan.hidden, {x.dtype}, "num_tokens, hidden; the dtype of x",
           st.device, fn);
  const int64_t M = std::min(x.size(0), st.max_tokens);
  if (M == 0) return {};
  const KernelChoice c = kernel_for(M);
  if (!c.impl || !c.impl->describe_call) return {};
  return c.impl->describe_call(
      make_args(rows_of(x, 0, M), rows_of(router_logits, 0, M), rows_of(out, 0, M)));
}

void Fp8MoeLayer::forward(const TensorView& x, const TensorView& router_logits,
                          const TensorView& out, void* stream, void* workspace,
                          std::size_t workspace_bytes) const {
  const State& st = *s_;
  check_io("x", x, -1, st.plan.hidden, {DType::kBF16, DType::kF32}, "num_tokens, hidden",
           st.device);
  const int64_t M = x.size(0);
  check_io("router_logits", router_logits, M, st.plan.num_experts, {DType::kF32, DType::kBF16},
           "num_tokens, global experts", st.device);
  check_io("out", out, M, st.plan.hidden, {x.dtype}, "num_tokens, hidden; the dtype of x",
           st.device);
  run_chunks(x, router_logits, {}, {}, out, stream, workspace, workspace_bytes);
}

Tensor Fp8MoeLayer::forward(const TensorView& x, const TensorView& router_logits,
                            void* stream) const {
  if (!x.defined() || x.ndim != 2) {
    throw ValueError(fmt::format("Fp8MoeLayer.forward: x is {}, expected (M, {}) bf16 or f32",
                                 x.defined() ? x.describe() : std::string("missing"),
                                 s_->plan.hidden));
  }
  Tensor out = Tensor::empty({x.size(0), x.size(1)}, x.dtype, s_->device);
  forward(x, router_logits, out.view(), stream);
  return out;
}

void Fp8MoeLayer::forward_routed(const TensorView& x, const TensorView& topk_ids,
                                 const TensorView& topk_weights, const TensorView& out,
                                 void* stream, void* workspace, std::size_t workspace_bytes) const {
  const State& st = *s_;
  check_io("x", x, -1, st.plan.hidden, {DType::kBF16, DType::kF32}, "num_tokens, hidden",
           st.device);
  const int64_t M = x.size(0);
  check_io("topk_ids", topk_ids, M, st.plan.topk, {DType::kI32}, "num_tokens, topk", st.device);
  check_io("topk_weights", topk_weights, M, st.plan.topk, {DType::kF32}, "num_tokens, topk",
           st.device);
  check_io("out", out, M, st.plan.hidden, {x.dtype}, "num_tokens, hidden; the dtype of x",
           st.device);
  run_chunks(x, {}, topk_ids, topk_weights, out, stream, workspace, workspace_bytes);
}

void Fp8MoeLayer::run_chunks(const TensorView& x, const TensorView& logits, const TensorView& ids,
                             const TensorView& tw, const TensorView& out, void* stream,
                             void* workspace, std::size_t workspace_bytes) const {
  const State& st = *s_;
  const int64_t M = x.size(0);
  if (M == 0) return;
  auto call = [&](int64_t r0, int64_t n, void* ws, std::size_t ws_bytes) {
    const KernelChoice c = kernel_for(n);
    if (!c.impl) {
      throw NotImplementedError(
          fmt::format("Fp8MoeLayer: no implementation runs M = {}: {}", n, c.why));
    }
    FusedMoeArgs a =
        make_args(rows_of(x, r0, n), logits.defined() ? rows_of(logits, r0, n) : logits,
                  rows_of(out, r0, n), stream);
    if (ids.defined()) {
      a.topk_ids = rows_of(ids, r0, n);
      a.topk_weights = rows_of(tw, r0, n);
    }
    const std::size_t need = c.impl->workspace_size ? c.impl->workspace_size(a) : 0;
    if (need > ws_bytes) {
      throw ValueError(fmt::format(
          "Fp8MoeLayer.forward: the {} kernel needs {} bytes of workspace for M = {}, the "
          "workspace holds {} (see workspace_size())",
          c.impl->name, need, n, ws_bytes));
    }
    run_prepared_experts(*c.impl, st.w, a, ws);
  };
  if (workspace) {
    call(0, M, workspace, workspace_bytes);
    return;
  }
  for (int64_t r0 = 0; r0 < M; r0 += st.max_tokens) {
    call(r0, std::min(st.max_tokens, M - r0), st.workspace.data(), st.ws_bytes);
  }
}

}  // namespace fp8moe
