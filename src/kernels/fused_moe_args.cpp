// The fused-MoE contract's checks (validate_fused_moe_args) and MoeScheme's derivation from a
// MoeQuantConfig and its printable name. Every kernel calls validate_fused_moe_args first, so the
// messages name the tensor, its shape and the shape that was expected.
#include <fmt/format.h>

#include <cmath>
#include <string>
#include <vector>

#include "fp8moe/error.hpp"
#include "fp8moe/fused_moe.hpp"
#include "fp8moe/numerics.hpp"
#include "fp8moe/quant_config.hpp"

namespace fp8moe {

namespace {

std::string shape_str(const std::vector<int64_t>& s) {
  std::string r = "(";
  for (std::size_t i = 0; i < s.size(); ++i) r += fmt::format("{}{}", i ? ", " : "", s[i]);
  if (s.size() == 1) r += ",";
  return r + ")";
}

int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Context for the checks of one call.
struct Checker {
  Device device{};
  bool device_set = false;

  [[noreturn]] static void fail(const std::string& msg) { throw ValueError(msg); }

  void same_device(const char* name, const TensorView& t) {
    if (!device_set) {
      device = t.device;
      device_set = true;
    } else if (!(t.device == device)) {
      fail(
          fmt::format("fused_moe: {} is on {} but x is on {}", name, t.device.str(), device.str()));
    }
  }

  // A required tensor with an exact shape and one of the allowed dtypes.
  void tensor(const char* name, const TensorView& t, const std::vector<int64_t>& shape,
              std::initializer_list<DType> dtypes, const std::string& what) {
    std::string dts;
    for (DType d : dtypes) dts += fmt::format("{}{}", dts.empty() ? "" : "/", dtype_name(d));
    if (!t.defined()) {
      fail(fmt::format("fused_moe: {} is missing: expected {} {} ({})", name, shape_str(shape), dts,
                       what));
    }
    bool dtype_ok = false;
    for (DType d : dtypes) dtype_ok |= t.dtype == d;
    if (t.sizes() != shape || !dtype_ok) {
      fail(fmt::format("fused_moe: {} has shape {} {}, expected {} {} ({})", name,
                       shape_str(t.sizes()), dtype_name(t.dtype), shape_str(shape), dts, what));
    }
    if (!t.is_contiguous()) {
      fail(fmt::format("fused_moe: {} {} must be contiguous", name, t.describe()));
    }
    if (t.numel() > 0 && t.data == nullptr) {
      fail(fmt::format("fused_moe: {} {} has no data", name, t.describe()));
    }
    same_device(name, t);
  }

  // Positive finite f32 scales (host tensors only: device memory is not read here).
  void positive_scales(const char* name, const TensorView& t) {
    if (!t.device.is_cpu() || t.dtype != DType::kF32) return;
    for (int64_t i = 0; i < t.numel(); ++i) {
      const float v = t.ptr<const float>()[i];
      if (!(v > 0.0f) || !std::isfinite(v)) {
        fail(
            fmt::format("fused_moe: {} {} holds {} at flat index {}; scales must be positive and "
                        "finite",
                        name, t.describe(), v, i));
      }
    }
  }

  void e8m0_scales(const char* name, const TensorView& t) {
    if (!t.device.is_cpu()) return;
    for (int64_t i = 0; i < t.numel(); ++i) {
      if (t.ptr<const uint8_t>()[i] == 0xFF) {
        fail(fmt::format("fused_moe: {} {} holds the e8m0 NaN code 0xFF at flat index {}", name,
                         t.describe(), i));
      }
    }
  }
};

std::string act_kind_str(const MoeScheme& s) {
  switch (s.act) {
    case ActQuantKind::kNone:
      return "none";
    case ActQuantKind::kPerTensorStatic:
      return "tensor-static";
    case ActQuantKind::kPerTensorDynamic:
      return "tensor-dynamic";
    case ActQuantKind::kPerTokenDynamic:
      return "token";
    case ActQuantKind::kPerGroupDynamic:
      return fmt::format("group{}{}", s.group_k, s.ue8m0_scales ? "-ue8m0" : "");
    case ActQuantKind::kMxfp8:
      return "mxfp8";
  }
  return "?";
}

}  // namespace

std::string MoeScheme::str() const {
  std::string w;
  switch (weight) {
    case WeightScaleKind::kBlock:
      w = fmt::format("block{}x{}", block_n, block_k);
      break;
    case WeightScaleKind::kPerTensor:
      w = "tensor";
      break;
    case WeightScaleKind::kPerChannel:
      w = "channel";
      break;
    case WeightScaleKind::kMx:
      w = "mx";
      break;
  }
  std::string s = fmt::format("w:{} a:{}", w, act_kind_str(*this));
  if (fuse_silu_quant) s += " fused-silu-quant";
  if (fp8 != DType::kF8E4M3FN) s += fmt::format(" {}", dtype_name(fp8));
  return s;
}

MoeScheme MoeScheme::from_quant_config(const MoeQuantConfig& qc) {
  MoeScheme s;
  s.ue8m0_scales = false;  // not recorded in the quant config: the caller sets it for E8M0 kernels
  s.fuse_silu_quant = false;
  const auto& wd = qc.w1.dtype;
  if (!wd) {
    throw ValueError(
        "MoeScheme: the quant config has no weight dtype (unquantised weights); the "
        "fp8 experts need fp8 or mxfp8 weights");
  }
  if (*wd == QuantDType::kMxfp8) {
    s.weight = WeightScaleKind::kMx;
    s.fp8 = DType::kF8E4M3FN;
  } else if (*wd == QuantDType::kFp8E4M3FN || *wd == QuantDType::kFp8E4M3FNUZ) {
    s.fp8 = *wd == QuantDType::kFp8E4M3FN ? DType::kF8E4M3FN : DType::kF8E4M3FNUZ;
    const auto& ws = qc.w1.shape;
    if (!ws || ws->is_per_tensor()) {
      s.weight = WeightScaleKind::kPerTensor;
    } else if (ws->is_per_token()) {
      s.weight = WeightScaleKind::kPerChannel;  // per-output-channel weights use the (1, -1) shape
    } else if (ws->row > 0 && ws->col > 0) {
      s.weight = WeightScaleKind::kBlock;
      s.block_n = ws->row;
      s.block_k = ws->col;
    } else {
      throw ValueError(fmt::format("MoeScheme: unsupported weight group shape {}", ws->str()));
    }
  } else {
    throw ValueError(
        fmt::format("MoeScheme: weight dtype {} is not an fp8 format; no fp8 experts "
                    "kernel computes it",
                    quant_dtype_name(*wd)));
  }
  const auto& ad = qc.a1.dtype;
  if (!ad) {
    s.act = ActQuantKind::kNone;  // W8A16
  } else if (*ad == QuantDType::kMxfp8) {
    if (s.weight != WeightScaleKind::kMx) {
      throw ValueError("MoeScheme: mxfp8 activations need mxfp8 weights");
    }
    s.act = ActQuantKind::kMxfp8;
  } else if (*ad == QuantDType::kFp8E4M3FN || *ad == QuantDType::kFp8E4M3FNUZ) {
    if (s.weight == WeightScaleKind::kMx) {
      throw ValueError("MoeScheme: mxfp8 weights need mxfp8 activations or none (W8A16)");
    }
    const auto& as = qc.a1.shape;
    if (!as || as->is_per_tensor()) {
      s.act =
          qc.a1.scale.defined() ? ActQuantKind::kPerTensorStatic : ActQuantKind::kPerTensorDynamic;
    } else if (as->is_per_token()) {
      s.act = ActQuantKind::kPerTokenDynamic;
    } else if (as->col > 0) {
      // fp8 block configs carry the weight block as the activation shape: the activations are
      // quantised per 1 x block_k group (per_token_group_quant_fp8(x, block_k)).
      s.act = ActQuantKind::kPerGroupDynamic;
      s.group_k = as->col;
    } else {
      throw ValueError(fmt::format("MoeScheme: unsupported activation group shape {}", as->str()));
    }
  } else {
    throw ValueError(fmt::format(
        "MoeScheme: activation dtype {} is not an fp8 format; no fp8 experts kernel computes it",
        quant_dtype_name(*ad)));
  }
  return s;
}

void validate_fused_moe_args(const FusedMoeArgs& a) {
  Checker c;
  const MoeScheme& sc = a.scheme;
  // x and out.
  const bool batched = a.batched();
  if (batched) {
    if (!a.x.defined() || a.x.ndim != 3) {
      Checker::fail(fmt::format(
          "fused_moe: batched format: x must be 3-D (local experts, max_tokens, hidden), got {}",
          a.x.describe()));
    }
  } else if (!a.x.defined() || a.x.ndim != 2) {
    Checker::fail(fmt::format("fused_moe: x must be a 2-D (num_tokens, hidden) tensor, got {}",
                              a.x.describe()));
  }
  const int64_t M = batched ? a.x.size(1) : a.x.size(0), H = a.x.size(-1);
  if (batched) {
    const int64_t EB = a.x.size(0);
    c.tensor("x", a.x, {EB, M, H}, {DType::kBF16, DType::kF32},
             "local experts, max_tokens, hidden");
    c.tensor("out", a.out, {EB, M, H}, {a.x.dtype, DType::kF32},
             "same shape as x, dtype of x or f32 (partial output)");
  } else {
    c.tensor("x", a.x, {M, H}, {DType::kBF16, DType::kF32}, "num_tokens, hidden");
    c.tensor("out", a.out, {M, H}, {a.x.dtype, DType::kF32},
             "same shape as x, dtype of x or f32 (partial output)");
  }
  // Weights.
  if (!a.weights.w13.defined() || a.weights.w13.ndim != 3 || !a.weights.w2.defined() ||
      a.weights.w2.ndim != 3) {
    Checker::fail(
        fmt::format("fused_moe: w13 and w2 must be 3-D (experts, rows, cols) tensors, "
                    "got w13 {} and w2 {}",
                    a.weights.w13.describe(), a.weights.w2.describe()));
  }
  const bool gated = activation_is_gated(a.act.activation);
  const int64_t E = a.weights.w13.size(0), I = a.weights.w2.size(2);
  const int64_t N1 = gated ? 2 * I : I;
  const DType fp8 = sc.fp8;
  if (fp8 != DType::kF8E4M3FN && fp8 != DType::kF8E4M3FNUZ) {
    Checker::fail(fmt::format("fused_moe: scheme.fp8 must be fp8_e4m3fn or fp8_e4m3fnuz, got {}",
                              dtype_name(fp8)));
  }
  if (sc.weight == WeightScaleKind::kMx && fp8 != DType::kF8E4M3FN) {
    Checker::fail("fused_moe: MXFP8 weights are fp8_e4m3fn");
  }
  c.tensor("w13", a.weights.w13, {E, N1, H}, {fp8},
           gated ? "experts, 2*intermediate (gate rows then up rows), hidden"
                 : "experts, intermediate, hidden (non-gated activation)");
  c.tensor("w2", a.weights.w2, {E, H, I}, {fp8}, "experts, hidden, intermediate");
  if (E < 1 || I < 1) Checker::fail("fused_moe: w13/w2 need at least one expert and row");
  // Weight scales.
  const auto& ws = a.weights;
  switch (sc.weight) {
    case WeightScaleKind::kBlock: {
      const int64_t bn = sc.block_n, bk = sc.block_k;
      if (bn <= 0 || bk <= 0) {
        Checker::fail(fmt::format("fused_moe: block shape [{}, {}] must be positive", bn, bk));
      }
      if (gated && I % bn != 0) {
        Checker::fail(fmt::format(
            "fused_moe: block_n {} must divide the intermediate size {}: the up half of w13 must "
            "start on a scale row (refine or pad the blocks)",
            bn, I));
      }
      const std::string what = fmt::format("block [{}, {}] scales", bn, bk);
      c.tensor("w13_scale", ws.w13_scale, {E, cdiv(N1, bn), cdiv(H, bk)}, {DType::kF32}, what);
      c.tensor("w2_scale", ws.w2_scale, {E, cdiv(H, bn), cdiv(I, bk)}, {DType::kF32}, what);
      break;
    }
    case WeightScaleKind::kPerTensor: {
      const bool shards = ws.w13_scale.defined() && ws.w13_scale.ndim == 2;
      if (shards && !gated) {
        Checker::fail(
            "fused_moe: w13_scale (experts, 2) holds one scale per gate/up shard but the "
            "activation is not gated");
      }
      if (shards) {
        c.tensor("w13_scale", ws.w13_scale, {E, 2}, {DType::kF32}, "one scale per expert shard");
      } else {
        c.tensor("w13_scale", ws.w13_scale, {E}, {DType::kF32}, "one scale per expert");
      }
      c.tensor("w2_scale", ws.w2_scale, {E}, {DType::kF32}, "one scale per expert");
      break;
    }
    case WeightScaleKind::kPerChannel:
      c.tensor("w13_scale", ws.w13_scale, {E, N1}, {DType::kF32}, "one scale per output row");
      c.tensor("w2_scale", ws.w2_scale, {E, H}, {DType::kF32}, "one scale per output row");
      break;
    case WeightScaleKind::kMx:
      if (H % 32 != 0 || I % 32 != 0) {
        Checker::fail(fmt::format(
            "fused_moe: MXFP8 needs hidden ({}) and intermediate ({}) to be multiples of 32", H,
            I));
      }
      c.tensor("w13_scale", ws.w13_scale, {E, N1, H / 32}, {DType::kU8, DType::kF8E8M0FNU},
               "e8m0 scale per 1x32 group");
      c.tensor("w2_scale", ws.w2_scale, {E, H, I / 32}, {DType::kU8, DType::kF8E8M0FNU},
               "e8m0 scale per 1x32 group");
      break;
  }
  if (sc.weight == WeightScaleKind::kMx) {
    c.e8m0_scales("w13_scale", ws.w13_scale);
    c.e8m0_scales("w2_scale", ws.w2_scale);
  } else {
    c.positive_scales("w13_scale", ws.w13_scale);
    c.positive_scales("w2_scale", ws.w2_scale);
  }
  // Activation quantisation.
  switch (sc.act) {
    case ActQuantKind::kPerGroupDynamic:
      if (sc.group_k <= 0 || H % sc.group_k != 0 || I % sc.group_k != 0) {
        Checker::fail(fmt::format(
            "fused_moe: activation group size {} must divide hidden ({}) and intermediate ({})",
            sc.group_k, H, I));
      }
      break;
    case ActQuantKind::kMxfp8:
      if (H % 32 != 0 || I % 32 != 0) {
        Checker::fail(fmt::format(
            "fused_moe: MXFP8 activations need hidden ({}) and intermediate ({}) to be multiples "
            "of 32",
            H, I));
      }
      if (fp8 != DType::kF8E4M3FN) Checker::fail("fused_moe: MXFP8 activations are fp8_e4m3fn");
      break;
    case ActQuantKind::kPerTensorStatic:
      c.tensor("a13_scale", ws.a13_scale, {1}, {DType::kF32}, "static input scale of GEMM1");
      c.tensor("a2_scale", ws.a2_scale, {1}, {DType::kF32}, "static input scale of GEMM2");
      c.positive_scales("a13_scale", ws.a13_scale);
      c.positive_scales("a2_scale", ws.a2_scale);
      break;
    default:
      break;
  }
  if (sc.ue8m0_scales && sc.act != ActQuantKind::kPerGroupDynamic) {
    Checker::fail(
        fmt::format("fused_moe: UE8M0 scales apply to per-group activations, not {}", sc.str()));
  }
  if (sc.fuse_silu_quant &&
      (a.act.activation != MoeActivation::kSilu || sc.act != ActQuantKind::kPerGroupDynamic)) {
    Checker::fail(
        fmt::format("fused_moe: the fused SiLU+quant path needs the silu activation and "
                    "per-group activations, got {} with {}",
                    activation_value(a.act.activation), sc.str()));
  }
  // Biases.
  if (ws.w13_bias.defined()) {
    c.tensor("w13_bias", ws.w13_bias, {E, N1}, {DType::kF32, DType::kBF16}, "bias of GEMM1");
  }
  if (ws.w2_bias.defined()) {
    c.tensor("w2_bias", ws.w2_bias, {E, H}, {DType::kF32, DType::kBF16}, "bias of GEMM2");
  }
  if (batched) {
    // Batched (masked) format: one slab per local expert, rows already dispatched.
    c.tensor("expert_num_tokens", a.expert_num_tokens, {E}, {DType::kI32},
             "one row count per local expert (x.size(0) must equal w13.size(0))");
    if (a.x.size(0) != E) {
      Checker::fail(
          fmt::format("fused_moe: batched format: x has {} expert slabs but w13 has {} "
                      "local experts",
                      a.x.size(0), E));
    }
    if (a.expert_num_tokens.device.is_cpu()) {
      for (int64_t e = 0; e < E; ++e) {
        const int32_t n = a.expert_num_tokens.ptr<const int32_t>()[e];
        if (n < 0 || n > M) {
          Checker::fail(
              fmt::format("fused_moe: expert_num_tokens[{}] = {} is outside [0, {}] "
                          "(max_tokens of x)",
                          e, n, M));
        }
      }
    }
    if (a.topk_ids.defined() || a.router_logits.defined() || a.expert_map.defined()) {
      Checker::fail(
          "fused_moe: batched format takes no router_logits, topk_ids or expert_map (the rows "
          "are already dispatched to their local expert)");
    }
    if (a.apply_router_weight_on_input) {
      Checker::fail(
          "fused_moe: batched format: apply the router weight on the input before dispatch");
    }
    return;
  }
  // Routing.
  int64_t E_global = E;
  int topk = 0;
  if (a.topk_ids.defined()) {
    if (a.topk_ids.ndim != 2) {
      Checker::fail(fmt::format("fused_moe: topk_ids must be (num_tokens, topk), got {}",
                                a.topk_ids.describe()));
    }
    topk = static_cast<int>(a.topk_ids.size(1));
    c.tensor("topk_ids", a.topk_ids, {M, topk}, {DType::kI32}, "num_tokens, topk");
    c.tensor("topk_weights", a.topk_weights, {M, topk}, {DType::kF32}, "num_tokens, topk");
    if (topk < 1) Checker::fail("fused_moe: topk_ids has no slots");
  } else {
    if (!a.router_logits.defined() || a.router_logits.ndim != 2) {
      Checker::fail(fmt::format(
          "fused_moe: give topk_ids/topk_weights or 2-D router_logits (num_tokens, experts), got "
          "router_logits {}",
          a.router_logits.describe()));
    }
    E_global = a.router_logits.size(1);
    c.tensor("router_logits", a.router_logits, {M, E_global}, {DType::kF32, DType::kBF16},
             "num_tokens, global experts");
    topk = a.routing.topk;
    if (topk < 1 || topk > E_global) {
      Checker::fail(
          fmt::format("fused_moe: routing.topk {} must be in [1, experts = {}]", topk, E_global));
    }
  }
  if (a.expert_map.defined()) {
    if (a.expert_map.ndim != 1) {
      Checker::fail(fmt::format("fused_moe: expert_map must be 1-D (global experts), got {}",
                                a.expert_map.describe()));
    }
    if (a.router_logits.defined() && !a.topk_ids.defined() && a.expert_map.size(0) != E_global) {
      Checker::fail(
          fmt::format("fused_moe: expert_map {} must have one entry per global expert "
                      "({} router logits columns)",
                      a.expert_map.describe(), E_global));
    }
    E_global = a.expert_map.size(0);
    c.tensor("expert_map", a.expert_map, {E_global}, {DType::kI32}, "global expert -> local");
    if (a.expert_map.device.is_cpu()) {
      for (int64_t g = 0; g < E_global; ++g) {
        const int32_t l = a.expert_map.ptr<const int32_t>()[g];
        if (l < -1 || l >= E) {
          Checker::fail(fmt::format("fused_moe: expert_map[{}] = {} is outside [-1, {})", g, l, E));
        }
      }
    }
  }
  if (!a.topk_ids.defined() && !a.expert_map.defined() && E_global != E) {
    Checker::fail(
        fmt::format("fused_moe: router_logits has {} experts but w13 has {} local experts; "
                    "give an expert_map (global -> local) for expert parallelism",
                    E_global, E));
  }
  if (a.topk_ids.defined() && a.topk_ids.device.is_cpu()) {
    for (int64_t i = 0; i < a.topk_ids.numel(); ++i) {
      const int32_t id = a.topk_ids.ptr<const int32_t>()[i];
      if (id < -1 || id >= E_global) {
        Checker::fail(fmt::format(
            "fused_moe: topk_ids[{}, {}] = {} is outside [-1, {}) ({})", i / topk, i % topk, id,
            E_global,
            a.expert_map.defined() ? "global experts of expert_map" : "local experts of w13"));
      }
    }
  }
  if (a.apply_router_weight_on_input && topk != 1) {
    Checker::fail(
        fmt::format("fused_moe: apply_router_weight_on_input needs topk == 1, got {}", topk));
  }
}

}  // namespace fp8moe
