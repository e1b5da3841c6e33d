// FusedMoeArgs -> MoeProblem: shape and scheme checks specific to the CUDA implementation, and the
// workspace layout of one token chunk.
#include <fmt/format.h>

#include <algorithm>

#include "fp8moe/error.hpp"
#include "moe_problem.hpp"

#include "moe_launchers.hpp"

namespace fp8moe::cuda {

namespace {

bool is_act(DType t) { return t == DType::kBF16 || t == DType::kF32; }

[[noreturn]] void bad(const std::string& what) { throw ValueError("cuda_fused: " + what); }
[[noreturn]] void unsupported(const std::string& what) {
  throw NotImplementedError("cuda_fused: " + what);
}

void need_cuda(const TensorView& t, const char* name) {
  if (t.defined() && !t.device.is_cuda())
    bad(fmt::format("{} must be on a CUDA device, got {}", name, t.describe()));
  if (t.defined() && !t.is_contiguous()) bad(fmt::format("{} must be contiguous", name));
}

Act map_activation(const ActivationConfig& a) {
  switch (a.activation) {
    case MoeActivation::kSilu:
      return Act::kSilu;
    case MoeActivation::kGelu:
      return Act::kGelu;
    case MoeActivation::kGeluTanh:
      return Act::kGeluTanh;
    case MoeActivation::kSwigluOai:
      return Act::kSwigluOai;
    case MoeActivation::kSwigluOaiUninterleave:
      return Act::kSwigluOaiUninterleave;
    case MoeActivation::kSiluNoMul:
      return Act::kSiluNoMul;
    case MoeActivation::kGeluNoMul:
      return Act::kGeluNoMul;
    case MoeActivation::kGeluTanhNoMul:
      return Act::kGeluTanhNoMul;
    case MoeActivation::kRelu2NoMul:
      return Act::kRelu2NoMul;
    case MoeActivation::kSitu:
      return Act::kSitu;
    case MoeActivation::kSwigluStep:
      return Act::kSwigluStep;
    default:
      unsupported(fmt::format("activation {} is not implemented", activation_repr(a.activation)));
  }
}

WeightSide weight_side(const MoeScheme& sc, const TensorView& w, const TensorView& s,
                       const TensorView& bias, const char* wname, int64_t E, int64_t N, int64_t K,
                       bool per_shard_ok) {
  WeightSide ws;
  ws.w = static_cast<const uint8_t*>(w.data);
  if (!s.defined()) bad(fmt::format("{}_scale is required", wname));
  if (s.dtype != DType::kF32) bad(fmt::format("{}_scale must be f32, got {}", wname, s.describe()));
  ws.scale = static_cast<const float*>(s.data);
  switch (sc.weight) {
    case WeightScaleKind::kBlock: {
      ws.scale_kind = static_cast<int32_t>(WScale::kBlock);
      ws.bn = static_cast<int32_t>(sc.block_n);
      ws.bk = static_cast<int32_t>(sc.block_k);
      const int64_t rows = ceil_div(N, sc.block_n), cols = ceil_div(K, sc.block_k);
      if (s.numel() != E * rows * cols)
        bad(fmt::format("{}_scale {} does not match blocks ({}, {}, {}) of [{}, {}]", wname,
                        s.describe(), E, rows, cols, sc.block_n, sc.block_k));
      ws.scale_e_stride = rows * cols;
      ws.scale_n_stride = cols;
      break;
    }
    case WeightScaleKind::kPerTensor:
      if (s.numel() == E) {
        ws.scale_kind = static_cast<int32_t>(WScale::kTensor);
        ws.scale_e_stride = 1;
      } else if (per_shard_ok && s.numel() == 2 * E) {
        ws.scale_kind = static_cast<int32_t>(WScale::kTensorPerShard);
        ws.scale_e_stride = 2;
      } else {
        bad(fmt::format("{}_scale {} must hold one scale per expert{}", wname, s.describe(),
                        per_shard_ok ? " (or per shard)" : ""));
      }
      break;
    case WeightScaleKind::kPerChannel:
      if (s.numel() != E * N)
        bad(fmt::format("{}_scale {} must hold one scale per output row ({} x {})", wname,
                        s.describe(), E, N));
      ws.scale_kind = static_cast<int32_t>(WScale::kChannel);
      ws.scale_e_stride = N;
      break;
    case WeightScaleKind::kMx:
      unsupported("MXFP8 weights are not part of the TRITON contract");
  }
  if (bias.defined()) {
    need_cuda(bias, "bias");
    if (bias.numel() != E * N || (bias.dtype != DType::kF32 && bias.dtype != DType::kBF16))
      bad(fmt::format("{}_bias {} must be ({}, {}) f32 or bf16", wname, bias.describe(), E, N));
    ws.bias = bias.data;
    ws.bias_bf16 = bias.dtype == DType::kBF16;
  }
  return ws;
}

AQuant map_quant(ActQuantKind k) {
  switch (k) {
    case ActQuantKind::kPerGroupDynamic:
      return AQuant::kGroupDynamic;
    case ActQuantKind::kPerTokenDynamic:
      return AQuant::kTokenDynamic;
    case ActQuantKind::kPerTensorStatic:
      return AQuant::kTensorStatic;
    case ActQuantKind::kPerTensorDynamic:
      return AQuant::kTensorDynamic;
    case ActQuantKind::kNone:
      unsupported("W8A16 (unquantised activations) is not part of the TRITON FP8 contract");
    case ActQuantKind::kMxfp8:
      unsupported("MXFP8 activations are not part of the TRITON contract");
  }
  unsupported("unknown activation quantisation");
}

RouteScore parse_scoring(const std::string& f) {
  if (f == "softmax") return RouteScore::kSoftmax;
  if (f == "sigmoid") return RouteScore::kSigmoid;
  if (f == "sqrtsoftplus") return RouteScore::kSqrtSoftplus;
  bad(fmt::format("Unsupported scoring function: {}", f));
}

// RoutingConfig -> the kernel's routing choices, method by method as numerics::route_row.
void set_routing(const RoutingConfig& r, int64_t E, RoutingParams& rp) {
  const auto m = r.method;
  const int k = r.topk;
  const bool has_bias = r.e_score_correction_bias.defined();
  if (has_bias) {
    const TensorView& b = r.e_score_correction_bias;
    if (b.numel() != E || (b.dtype != DType::kF32 && b.dtype != DType::kBF16))
      bad(fmt::format("e_score_correction_bias {} must be ({}) f32 or bf16", b.describe(), E));
    rp.bias = b.data;
    rp.bias_bf16 = b.dtype == DType::kBF16;
  }
  const bool takes_bias =
      m == RoutingMethodType::kDeepSeekV3 || m == RoutingMethodType::kMiniMax2 ||
      m == RoutingMethodType::kDeepseekV4 || m == RoutingMethodType::kUnspecified;
  if (has_bias && !takes_bias)
    bad(fmt::format("routing method {} takes no e_score_correction_bias", routing_method_name(m)));
  auto set = [&](RouteScore sc, RouteWeight w, RouteRenorm rn, float eps, bool rsf) {
    rp.score = static_cast<int32_t>(sc);
    rp.weight = static_cast<int32_t>(w);
    rp.renorm = static_cast<int32_t>(rn);
    rp.eps = eps;
    rp.apply_rsf = rsf;
    rp.routed_scaling_factor = static_cast<float>(r.routed_scaling_factor);
  };
  const auto none = RouteRenorm::kNone, sum = RouteRenorm::kSumPlusEps;
  switch (m) {
    case RoutingMethodType::kDefault:
      set(RouteScore::kSoftmax, RouteWeight::kScore, none, 0, false);
      break;
    case RoutingMethodType::kRenormalizeNaive:
      set(RouteScore::kSoftmax, RouteWeight::kScore, sum, 0, false);
      break;
    case RoutingMethodType::kSigmoid:
      set(RouteScore::kSigmoid, RouteWeight::kScore, none, 0, false);
      break;
    case RoutingMethodType::kSigmoidRenorm:
      set(RouteScore::kSigmoid, RouteWeight::kScore, sum, 0, false);
      break;
    case RoutingMethodType::kRenormalize:
      set(RouteScore::kLogits, RouteWeight::kSoftmaxSelected, none, 0, false);
      break;
    case RoutingMethodType::kTopK:
      set(RouteScore::kLogits, RouteWeight::kLogit, none, 0, false);
      break;
    case RoutingMethodType::kLlama4:
      set(RouteScore::kLogits, RouteWeight::kSigmoidLogit, none, 0, false);
      break;
    case RoutingMethodType::kMiniMax2:
      if (!has_bias) bad("routing method MiniMax2 needs an e_score_correction_bias");
      set(RouteScore::kSigmoid, RouteWeight::kScore, sum, 1e-20f, true);
      break;
    case RoutingMethodType::kDeepseekV4:
      set(RouteScore::kSqrtSoftplus, RouteWeight::kScore, RouteRenorm::kMaxSumEps, 1e-20f, true);
      break;
    case RoutingMethodType::kDeepSeekV3:
    case RoutingMethodType::kUnspecified: {
      const bool v3 = m == RoutingMethodType::kDeepSeekV3;
      const RouteScore sc = v3 ? RouteScore::kSigmoid : parse_scoring(r.scoring_func);
      const bool renorm = v3 ? true : r.renormalize;
      const int G = r.num_expert_group;
      const bool grouping_valid = G > 0 && E > G && E % G == 0;
      if ((v3 || G > 0) && grouping_valid) {
        if (G > 32) unsupported("grouped top-k with more than 32 groups");
        if (r.topk_group < 1 || r.topk_group > G)
          bad(fmt::format("routing: topk_group ({}) must be in [1, num_expert_group = {}]",
                          r.topk_group, G));
        if (k > r.topk_group * (E / G))
          bad(fmt::format("routing: topk ({}) exceeds the experts of the selected groups", k));
        const bool fused_kernel = has_bias && G <= 32 && k <= 32;
        set(sc, RouteWeight::kScore, renorm ? sum : none, fused_kernel ? 1e-20f : 0.0f, true);
        rp.grouped = 1;
        rp.num_expert_group = G;
        rp.topk_group = r.topk_group;
      } else if (has_bias) {
        const bool ssp = sc == RouteScore::kSqrtSoftplus;
        set(sc, RouteWeight::kScore, renorm ? (ssp ? RouteRenorm::kMaxSumEps : sum) : none,
            ssp ? 1e-20f : 0.0f, true);
      } else {
        const bool ssp = sc == RouteScore::kSqrtSoftplus;
        set(sc, RouteWeight::kScore, renorm ? (ssp ? RouteRenorm::kMaxSumEps : sum) : none,
            ssp ? 1e-20f : 0.0f, false);
      }
      break;
    }
    default:
      unsupported(
          fmt::format("routing method {} needs a custom routing function", routing_method_name(m)));
  }
}

}  // namespace

RoutingParams routing_params(const TensorView& logits, const RoutingConfig& r) {
  if (!logits.defined() || logits.ndim != 2)
    bad(fmt::format("router_logits {} must be (M, E)", logits.describe()));
  if (logits.dtype != DType::kF32 && logits.dtype != DType::kBF16)
    bad(fmt::format("router_logits {} must be f32 or bf16", logits.describe()));
  const int64_t E = logits.size(1);
  if (E > 1024) unsupported("routing over more than 1024 experts");
  if (r.topk < 1 || r.topk > E || r.topk > 32)
    bad(fmt::format("topk {} must be in [1, min(32, E={})]", r.topk, E));
  RoutingParams rp;
  rp.logits = logits.data;
  rp.logits_bf16 = logits.dtype == DType::kBF16;
  set_routing(r, E, rp);
  return rp;
}

MoeProblem make_problem(const FusedMoeArgs& a) {
  MoeProblem p;
  const auto& w = a.weights;
  if (!a.x.defined() || a.x.ndim != 2) bad("x must be (M, H)");
  if (!is_act(a.x.dtype)) bad(fmt::format("x must be bf16 or f32, got {}", a.x.describe()));
  need_cuda(a.x, "x");
  need_cuda(a.out, "out");
  need_cuda(w.w13, "w13");
  need_cuda(w.w2, "w2");
  need_cuda(w.w13_scale, "w13_scale");
  need_cuda(w.w2_scale, "w2_scale");
  need_cuda(a.router_logits, "router_logits");
  need_cuda(a.topk_ids, "topk_ids");
  need_cuda(a.topk_weights, "topk_weights");
  need_cuda(a.expert_map, "expert_map");
  need_cuda(w.a13_scale, "a13_scale");
  need_cuda(w.a2_scale, "a2_scale");
  need_cuda(a.routing.e_score_correction_bias, "e_score_correction_bias");
  if (a.scheme.fp8 != DType::kF8E4M3FN) unsupported("only float8_e4m3fn weights run on CUDA");
  p.M = a.x.size(0);
  p.H = a.x.size(1);
  if (!w.w13.defined() || w.w13.ndim != 3 || !w.w2.defined() || w.w2.ndim != 3)
    bad("w13 must be (E, N1, H) and w2 (E, H, I)");
  if (w.w13.dtype != DType::kF8E4M3FN || w.w2.dtype != DType::kF8E4M3FN)
    bad(fmt::format("w13/w2 must be float8_e4m3fn, got {} / {}", w.w13.describe(),
                    w.w2.describe()));
  p.E = w.w13.size(0);
  p.N1 = w.w13.size(1);
  p.I = w.w2.size(2);
  p.gated = activation_is_gated(a.act.activation);
  if (w.w13.size(2) != p.H || w.w2.size(0) != p.E || w.w2.size(1) != p.H ||
      p.N1 != (p.gated ? 2 * p.I : p.I))
    bad(fmt::format("inconsistent shapes: x {}, w13 {}, w2 {}", a.x.describe(), w.w13.describe(),
                    w.w2.describe()));
  if (!a.out.defined() || a.out.dtype != a.x.dtype || a.out.ndim != 2 || a.out.size(0) != p.M ||
      a.out.size(1) != p.H)
    bad(fmt::format("out {} must be ({}, {}) {}", a.out.describe(), p.M, p.H,
                    dtype_name(a.x.dtype)));
  p.x_f32 = a.x.dtype == DType::kF32;
  p.x = a.x.data;
  p.out = a.out.data;
  if (p.E > 1024) unsupported("more than 1024 local experts");

  // routing
  if (a.expert_map.defined()) {
    if (a.expert_map.dtype != DType::kI32 || a.expert_map.ndim != 1)
      bad(fmt::format("expert_map {} must be (E_global) i32", a.expert_map.describe()));
    p.expert_map = static_cast<const int32_t*>(a.expert_map.data);
  }
  if (a.topk_ids.defined()) {
    if (a.topk_ids.dtype != DType::kI32 || a.topk_ids.ndim != 2 || a.topk_ids.size(0) != p.M)
      bad(fmt::format("topk_ids {} must be ({}, topk) i32", a.topk_ids.describe(), p.M));
    p.topk = a.topk_ids.size(1);
    if (!a.topk_weights.defined() || a.topk_weights.dtype != DType::kF32 ||
        a.topk_weights.numel() != p.M * p.topk)
      bad(fmt::format("topk_weights {} must be ({}, {}) f32", a.topk_weights.describe(), p.M,
                      p.topk));
    p.topk_ids = static_cast<const int32_t*>(a.topk_ids.data);
    p.topk_w = static_cast<const float*>(a.topk_weights.data);
    p.E_global = a.expert_map.defined() ? a.expert_map.size(0) : p.E;
  } else {
    if (!a.router_logits.defined() || a.router_logits.ndim != 2 || a.router_logits.size(0) != p.M)
      bad("router_logits (M, E) or topk_ids/topk_weights are required");
    if (a.router_logits.dtype != DType::kF32 && a.router_logits.dtype != DType::kBF16)
      bad(fmt::format("router_logits {} must be f32 or bf16", a.router_logits.describe()));
    p.route_in_kernel = true;
    p.E_global = a.router_logits.size(1);
    if (a.expert_map.defined() && a.expert_map.size(0) != p.E_global)
      bad(fmt::format("expert_map {} must have one entry per router logit ({})",
                      a.expert_map.describe(), p.E_global));
    if (!a.expert_map.defined() && p.E_global != p.E)
      bad(fmt::format("router_logits has {} experts but w13 has {} and there is no expert_map",
                      p.E_global, p.E));
    p.rp = routing_params(a.router_logits, a.routing);
    p.topk = a.routing.topk;
  }
  p.router_on_input = a.apply_router_weight_on_input;
  p.batch_invariant = a.batch_invariant;
  if (p.router_on_input && p.topk != 1) bad("apply_router_weight_on_input needs topk == 1");

  // scheme
  const MoeScheme& sc = a.scheme;
  p.w1 = weight_side(sc, w.w13, w.w13_scale, w.w13_bias, "w13", p.E, p.N1, p.H, true);
  p.w2 = weight_side(sc, w.w2, w.w2_scale, w.w2_bias, "w2", p.E, p.H, p.I, false);
  p.aq1 = map_quant(sc.act);
  p.aq2 = p.aq1;
  p.gk = static_cast<int>(sc.group_k);
  p.ue8m0 = sc.ue8m0_scales;
  if (p.aq1 == AQuant::kGroupDynamic) {
    if (p.gk != 32 && p.gk != 64 && p.gk != 128)
      unsupported(fmt::format("activation group size {} (32, 64 or 128 run on CUDA)", p.gk));
    if (p.H % p.gk != 0 || p.I % p.gk != 0)
      bad(fmt::format("hidden {} and intermediate {} must be multiples of the group size {}", p.H,
                      p.I, p.gk));
  }
  if (sc.weight == WeightScaleKind::kBlock) {
    if (sc.block_k % 32 != 0 || sc.block_n < 1)
      unsupported(fmt::format("weight block [{}, {}] (block_k must be a multiple of 32)",
                              sc.block_n, sc.block_k));
    if (p.aq1 == AQuant::kGroupDynamic && sc.block_k % p.gk != 0 && p.gk % sc.block_k != 0)
      unsupported(
          fmt::format("weight block_k {} and activation group {} do not nest", sc.block_k, p.gk));
  }
  if (p.aq1 == AQuant::kTensorStatic) {
    if (!w.a13_scale.defined() || w.a13_scale.dtype != DType::kF32 || w.a13_scale.numel() < 1)
      bad("static per-tensor activations need a13_scale (1) f32");
    p.a13_scale = static_cast<const float*>(w.a13_scale.data);
    if (w.a2_scale.defined()) {
      if (w.a2_scale.dtype != DType::kF32 || w.a2_scale.numel() < 1)
        bad("a2_scale must be (1) f32");
      p.a2_scale = static_cast<const float*>(w.a2_scale.data);
    } else {
      p.aq2 = AQuant::kTensorDynamic;  // moe_kernel_quantize_input without a scale
    }
  }
  p.fused_silu_quant = sc.fuse_silu_quant;

  // activation
  p.ap.act = static_cast<int32_t>(map_activation(a.act));
  p.ap.alpha = static_cast<float>(a.act.alpha);
  p.ap.beta = static_cast<float>(a.act.beta);
  p.ap.f32 = p.x_f32;
  if (a.act.clamp_limit) {
    p.ap.has_limit = 1;
    p.ap.limit = static_cast<float>(*a.act.clamp_limit);
  }
  const Act act = static_cast<Act>(p.ap.act);
  if (act == Act::kSwigluOaiUninterleave && !a.act.clamp_limit)
    bad("SWIGLUOAI_UNINTERLEAVE requires clamp_limit");
  if (act == Act::kSitu) {
    if (!a.act.situ_beta || *a.act.situ_beta == 0.0)
      bad("SITU requires a non-zero activation_situ_beta");
    p.ap.situ_beta = static_cast<float>(*a.act.situ_beta);
    if (a.act.situ_linear_beta && *a.act.situ_linear_beta > 0)
      p.ap.situ_linear_beta = static_cast<float>(*a.act.situ_linear_beta);
  }
  // A clamp limit only changes SILU (swiglu_limit_func) and SWIGLUOAI_UNINTERLEAVE; the other
  // activations ignore it, as vLLM's TritonExperts and the reference do.
  if (p.fused_silu_quant) {
    if (act != Act::kSilu || p.aq1 != AQuant::kGroupDynamic || p.x_f32)
      bad("fuse_silu_quant needs SiLU, per-group activations and bf16 inputs");
    // vLLM's fused SiLU+quant fast path ignores the clamp limit; so does this one.
    p.ap.fp32_silu = 1;
    p.ap.has_limit = 0;
  }
  p.stream = static_cast<cudaStream_t>(a.stream);
  p.scheme = sc.str();
  return p;
}

std::string problem_unsupported(const FusedMoeArgs& args) {
  try {
    make_problem(args);
  } catch (const Error& e) {
    return e.what();
  }
  return {};
}

Workspace workspace_layout(const MoeProblem& p, int64_t m, int64_t bm, bool batched, bool sorted_x,
                           bool keep_h) {
  Workspace w;
  w.m = m;
  w.bm = bm;
  const int64_t pairs = m * p.topk;
  if (batched) {
    // every expert can receive every token of the chunk (one slot per token and expert)
    w.fixed_stride = static_cast<int>(round_up(m, bm));
    w.capacity = p.E * w.fixed_stride;
  } else {
    w.capacity = round_up(pairs + std::min<int64_t>(p.E, pairs) * (bm - 1), bm);
  }
  const std::size_t act_bytes = p.x_f32 ? 4 : 2;
  const bool h_f32 = p.x_f32 || p.fused_silu_quant;
  WorkspaceCarver c{0, 0};
  w.ids = c.take(pairs * 4);
  w.tw = c.take(pairs * 4);
  w.sorted = c.take(w.capacity * 4);
  w.blk = c.take(w.capacity / bm * 4);
  w.meta = c.take(16);
  w.cnt = c.take(p.E * 4);
  w.eoff = c.take((p.E + 1) * 4);
  // the sorted-x chains (wgmma, grouped) quantise x straight into the sorted rows (qxs / sxs) and
  // never write h (their GEMM1 epilogue or one activation+quantisation kernel makes qh): no qx,
  // sx or h for them
  w.qx = c.take(sorted_x ? 0 : m * p.H);
  w.sx = c.take(sorted_x ? 0 : std::max<int64_t>(1, m * p.a_scale_cols(p.H, p.aq1)) * 4);
  w.y1 = c.take(w.capacity * p.N1 * act_bytes);
  w.h = c.take(sorted_x && !keep_h ? 0 : w.capacity * p.I * (h_f32 ? 4 : 2));
  w.qh = c.take(w.capacity * p.I);
  w.sh = c.take(std::max<int64_t>(1, w.capacity * p.a_scale_cols(p.I, p.aq2)) * 4);
  w.y2 = c.take(pairs * p.H * act_bytes);
  w.amax = c.take(16);
  w.ppos = c.take(pairs * 4);
  w.align = c.take(batched ? 0 : align_scratch_bytes(pairs, p.E));
  if (sorted_x) {
    w.sumc = c.take(m * (p.H / 128) * 4);
    w.qxs = c.take(w.capacity * p.H);
    w.sxs = c.take(std::max<int64_t>(1, w.capacity * p.a_scale_cols(p.H, p.aq1)) * 4);
  }
  w.total = c.off;
  return w;
}

}  // namespace fp8moe::cuda
