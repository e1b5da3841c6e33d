// Loading one MoE layer's experts for one rank: per-expert checkpoint tensors -> the stacked w13 /
// w2 layout (gate then up), sharded for TP as decided and restricted to the rank's EP experts.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <regex>

#include "checkpoint/checkpoint_internal.hpp"
#include "fp8moe/checkpoint.hpp"
#include "fp8moe/error.hpp"

namespace fp8moe {

namespace {

TensorView checkpoint_view(const SafetensorsCheckpoint& ck, const std::string& name) {
  const SafetensorsTensor& t = ck.at(name);
  if (!t.dtype) {
    throw FormatError(fmt::format("{}: tensor '{}' has dtype {}, which fp8moe cannot load",
                                  ck.shard_of(name).path(), name, t.dtype_name));
  }
  if (t.shape.size() > static_cast<std::size_t>(kMaxDims)) {
    throw FormatError(fmt::format("{}: tensor '{}' has {} dimensions (at most {} supported)",
                                  ck.shard_of(name).path(), name, t.shape.size(), kMaxDims));
  }
  std::span<const uint8_t> bytes = ck.data(name);
  // TensorView is non-owning and mutable by type; the mapping is read-only and never written.
  return TensorView(const_cast<uint8_t*>(bytes.data()), *t.dtype, t.shape);
}

// A scalar scale: shape [] or [1] (or any shape with one element).
float scalar_scale(const TensorView& v, const std::string& what) {
  if (v.numel() != 1 || v.dtype != DType::kF32) {
    throw FormatError(fmt::format("{}: expected one float32 value, got {}", what, v.describe()));
  }
  float x;
  std::memcpy(&x, v.data, 4);
  return x;
}

bool module_ignored(const std::vector<std::string>& ignored, const std::string& prefix) {
  for (const std::string& e : ignored) {
    if (e == prefix || e.rfind(prefix + ".", 0) == 0) return true;
    if (e.rfind("re:", 0) == 0) {
      try {
        if (std::regex_match(prefix, std::regex(e.substr(3)))) return true;
      } catch (const std::regex_error&) {
      }
    }
  }
  return false;
}

// Row-narrowing copy of a 2-D host tensor: dst[i, :] = src[r0 + i, c0 : c0 + dst.cols].
void copy_rows(const TensorView& src, int64_t r0, int64_t c0, uint8_t* dst, int64_t rows,
               int64_t cols) {
  const std::size_t es = dtype_size(src.dtype);
  for (int64_t i = 0; i < rows; ++i) {
    const uint8_t* s =
        static_cast<const uint8_t*>(src.data) + ((r0 + i) * src.strides[0] + c0) * es;
    std::memcpy(dst + i * cols * es, s, cols * es);
  }
}

}  // namespace

TpShard make_plain_tp_shard(int64_t I, int64_t H, int tp_size, int tp_rank) {
  if (tp_size < 1 || tp_rank < 0 || tp_rank >= tp_size) {
    throw ValueError(fmt::format("TP rank {} is outside a TP group of size {}", tp_rank, tp_size));
  }
  if (I <= 0 || H <= 0 || I % tp_size != 0) {
    throw ValueError(
        fmt::format("intermediate size {} cannot be split evenly over {} ranks", I, tp_size));
  }
  TpShard s;
  s.mode = TpShardMode::kKeep;
  s.tp_size = tp_size;
  s.tp_rank = tp_rank;
  s.intermediate_size = I;
  s.hidden_size = H;
  s.local_size = I / tp_size;
  s.checkpoint_block = s.block = {1, 1};
  return s;
}

bool moe_layer_ignored(const ModelConfig& model, int layer) {
  // The FusedMoE module's prefix: "model.layers.<L>.mlp.experts" (strip ".<e>.<proj>").
  std::string experts = expert_module_name(model, layer, 0, ExpertProj::kGate);
  for (int i = 0; i < 2; ++i) experts = experts.substr(0, experts.rfind('.'));
  return module_ignored(model.quant.ignored_layers, experts);
}

ExpertWeights LoadedMoeLayer::weights() const {
  ExpertWeights w;
  w.w13 = w13.view();
  w.w2 = w2.view();
  w.w13_scale = w13_scale.view();
  w.w2_scale = w2_scale.view();
  if (w13_input_scale.defined()) w.a13_scale = w13_input_scale.view();
  if (w2_input_scale.defined()) w.a2_scale = w2_input_scale.view();
  return w;
}

LoadedMoeLayer load_moe_layer(const SafetensorsCheckpoint& ck, const ModelConfig& model, int layer,
                              const TpShard& tp, const ExpertPlacement& ep) {
  const CheckpointQuant& q = model.quant;
  if (std::find(model.moe_layers.begin(), model.moe_layers.end(), layer) ==
      model.moe_layers.end()) {
    throw ValueError(fmt::format("layer {} of {} has no routed experts", layer, model.source));
  }
  if (!activation_is_gated(model.activation)) {
    throw NotImplementedError("loading non-gated (single-shard w13) experts is not supported");
  }
  if (q.scale_kind == CheckpointScaleKind::kNone) {
    throw NotImplementedError(
        fmt::format("{}: the experts are not FP8 ({}); fp8moe loads FP8 experts only", model.source,
                    q.not_fp8_reason));
  }
  if (moe_layer_ignored(model, layer)) {
    throw NotImplementedError(fmt::format(
        "layer {}: the quantisation config's ignore list names these experts, so vLLM keeps them "
        "unquantised; fp8moe loads FP8 experts only",
        layer));
  }
  const ExpertNaming naming = expert_naming(model);
  if (naming.layout != ExpertLayout::kPerExpert) {
    throw NotImplementedError(fmt::format(
        "{}: {} stores its experts as fused tensors; fp8moe loads per-expert checkpoints only",
        model.source, model.model_type));
  }
  if (ep.num_experts != model.num_experts) {
    throw ValueError(fmt::format("expert placement covers {} experts, the model has {}",
                                 ep.num_experts, model.num_experts));
  }
  if (tp.intermediate_size != model.moe_intermediate_size || tp.hidden_size != model.hidden_size) {
    throw ValueError(fmt::format(
        "TP shard is for intermediate {} / hidden {}, the model has {} / {}", tp.intermediate_size,
        tp.hidden_size, model.moe_intermediate_size, model.hidden_size));
  }
  {
    const std::string probe =
        expert_weight_name(model, layer, ep.local_to_global.front(), ExpertProj::kGate);
    if (!ck.find(probe)) {
      std::string fused = probe.substr(0, probe.rfind(".experts.") + 9) + "gate_up_proj";
      if (ck.find(fused)) {
        throw NotImplementedError(fmt::format(
            "{}: layer {} stores fused expert tensors ('{}'); fp8moe loads per-expert checkpoints "
            "only",
            ck.root(), layer, fused));
      }
    }
  }

  const int64_t H = model.hidden_size;
  const int64_t W = tp.local_size;
  const int64_t E = ep.num_local();
  LoadedMoeLayer out;
  out.layer = layer;
  out.scale_kind = q.scale_kind;
  out.tp = tp;
  out.ep = ep;
  out.w13 = Tensor::empty({E, 2 * W, H}, DType::kF8E4M3FN);
  out.w2 = Tensor::empty({E, H, W}, DType::kF8E4M3FN);
  // Poison: 0x7F is NaN in e4m3fn, and NaN scales; nothing of it may survive loading.
  std::memset(out.w13.data(), 0x7F, out.w13.nbytes());
  std::memset(out.w2.data(), 0x7F, out.w2.nbytes());
  switch (q.scale_kind) {
    case CheckpointScaleKind::kBlock: {
      const auto s13 = tp.w13_scale_shape(2);
      const auto s2 = tp.w2_scale_shape();
      out.w13_scale = Tensor::empty({E, s13[0], s13[1]}, DType::kF32);
      out.w2_scale = Tensor::empty({E, s2[0], s2[1]}, DType::kF32);
      break;
    }
    case CheckpointScaleKind::kPerTensor:
      out.w13_scale = Tensor::empty({E, 2}, DType::kF32);
      out.w2_scale = Tensor::empty({E}, DType::kF32);
      break;
    case CheckpointScaleKind::kPerChannel:
      out.w13_scale = Tensor::empty({E, 2 * W}, DType::kF32);
      out.w2_scale = Tensor::empty({E, H}, DType::kF32);
      break;
    case CheckpointScaleKind::kMx:
      if (H % 32 != 0 || W % 32 != 0) {
        throw ValueError(
            fmt::format("MXFP8 needs hidden {} and per-rank intermediate {} to be "
                        "multiples of 32",
                        H, W));
      }
      out.w13_scale = Tensor::empty({E, 2 * W, H / 32}, DType::kF8E8M0FNU);
      out.w2_scale = Tensor::empty({E, H, W / 32}, DType::kF8E8M0FNU);
      break;
    case CheckpointScaleKind::kNone:
      break;
  }
  if (out.w13_scale.dtype() == DType::kF32) {
    std::fill_n(out.w13_scale.ptr<float>(), out.w13_scale.numel(), std::nanf(""));
    std::fill_n(out.w2_scale.ptr<float>(), out.w2_scale.numel(), std::nanf(""));
  } else {
    std::memset(out.w13_scale.data(), 0xFF, out.w13_scale.nbytes());  // e8m0 NaN
    std::memset(out.w2_scale.data(), 0xFF, out.w2_scale.nbytes());
  }
  if (q.static_input_scales) {
    out.w13_input_scale = Tensor::empty({E}, DType::kF32);
    out.w2_input_scale = Tensor::empty({E}, DType::kF32);
  }
  out.expert_map = Tensor::empty({static_cast<int64_t>(ep.expert_map.size())}, DType::kI32);
  std::copy(ep.expert_map.begin(), ep.expert_map.end(), out.expert_map.ptr<int32_t>());

  // Coverage: every (expert, projection) weight and scale is written exactly once.
  std::vector<uint8_t> written(static_cast<std::size_t>(E) * 3, 0);
  auto read = [&](const std::string& name) {
    TensorView v = checkpoint_view(ck, name);
    out.tensors_read++;
    out.checkpoint_bytes_read += v.nbytes();
    return v;
  };

  for (int64_t le = 0; le < E; ++le) {
    const int ge = ep.local_to_global[le];
    const TensorView w13e = out.w13.view().select0(le);
    const TensorView w2e = out.w2.view().select0(le);
    for (ExpertProj p : {ExpertProj::kGate, ExpertProj::kUp, ExpertProj::kDown}) {
      const std::string wname = expert_weight_name(model, layer, ge, p);
      const std::string sname = expert_scale_name(model, layer, ge, p);
      const TensorView w = read(wname);
      const TensorView s = read(sname);
      const int half = p == ExpertProj::kUp ? 1 : 0;
      switch (q.scale_kind) {
        case CheckpointScaleKind::kBlock: {
          if (p == ExpertProj::kDown) {
            load_w2_block_shard(tp, w, s, w2e, out.w2_scale.view().select0(le), wname);
          } else {
            load_w13_block_shard(tp, half, w, s, w13e, out.w13_scale.view().select0(le), wname);
          }
          break;
        }
        case CheckpointScaleKind::kPerTensor:
        case CheckpointScaleKind::kPerChannel:
        case CheckpointScaleKind::kMx: {
          const int64_t I = tp.intermediate_size;
          const int64_t g0 = tp.global_begin();
          const bool down = p == ExpertProj::kDown;
          const int64_t rows = down ? H : I, cols = down ? I : H;
          if (w.ndim != 2 || w.shape[0] != rows || w.shape[1] != cols) {
            throw FormatError(
                fmt::format("{}: shape {}, expected [{}, {}]", wname, w.describe(), rows, cols));
          }
          if (w.dtype != DType::kF8E4M3FN) {
            throw FormatError(
                fmt::format("{}: dtype {}, expected float8_e4m3fn", wname, dtype_name(w.dtype)));
          }
          if (down) {
            for (int64_t i = 0; i < H; ++i) {
              copy_rows(w, i, g0, static_cast<uint8_t*>(w2e.data) + i * W, 1, W);
            }
          } else {
            copy_rows(w, g0, 0, static_cast<uint8_t*>(w13e.data) + half * W * H, W, H);
          }
          if (q.scale_kind == CheckpointScaleKind::kPerTensor) {
            const float x = scalar_scale(s, sname);
            if (down) {
              out.w2_scale.ptr<float>()[le] = x;
            } else {
              out.w13_scale.ptr<float>()[le * 2 + half] = x;
            }
          } else if (q.scale_kind == CheckpointScaleKind::kPerChannel) {
            // [N] or [N, 1] float32, one per output row; w2's rows (H) are not sharded.
            const int64_t n = down ? H : I;
            if (s.numel() != n || s.dtype != DType::kF32 || (s.ndim == 2 && s.shape[1] != 1) ||
                s.ndim > 2) {
              throw FormatError(fmt::format("{}: {}, expected [{}] or [{}, 1] float32", sname,
                                            s.describe(), n, n));
            }
            const float* src = static_cast<const float*>(s.data);
            if (down) {
              std::copy_n(src, H, out.w2_scale.ptr<float>() + le * H);
            } else {
              std::copy_n(src + g0, W, out.w13_scale.ptr<float>() + le * 2 * W + half * W);
            }
          } else {  // kMx: [N, K/32] e8m0 bytes
            const int64_t n = down ? H : I, k = (down ? I : H) / 32;
            if (s.ndim != 2 || s.shape[0] != n || s.shape[1] != k || dtype_size(s.dtype) != 1 ||
                (s.dtype != DType::kU8 && s.dtype != DType::kF8E8M0FNU)) {
              throw FormatError(fmt::format("{}: {}, expected [{}, {}] e8m0 (F8_E8M0 or U8)", sname,
                                            s.describe(), n, k));
            }
            if (down) {
              for (int64_t i = 0; i < H; ++i) {
                copy_rows(
                    s, i, g0 / 32,
                    static_cast<uint8_t*>(out.w2_scale.view().select0(le).data) + i * (W / 32), 1,
                    W / 32);
              }
            } else {
              copy_rows(s, g0, 0,
                        static_cast<uint8_t*>(out.w13_scale.view().select0(le).data) +
                            half * W * (H / 32),
                        W, H / 32);
            }
          }
          break;
        }
        case CheckpointScaleKind::kNone:
          break;
      }
      if (q.static_input_scales && p != ExpertProj::kUp) {
        const std::string iname = expert_input_scale_name(model, layer, ge, p);
        const float x = scalar_scale(read(iname), iname);
        (p == ExpertProj::kDown ? out.w2_input_scale : out.w13_input_scale).ptr<float>()[le] = x;
      } else if (q.static_input_scales) {
        // vLLM loads w1's and w3's input scales into the same slot and requires them to agree.
        const std::string iname = expert_input_scale_name(model, layer, ge, p);
        const float x = scalar_scale(read(iname), iname);
        const float prev = out.w13_input_scale.ptr<float>()[le];
        if (std::fabs(prev - x) > 1e-5f) {
          throw ValueError(fmt::format(
              "input_scales of w1 and w3 of a layer must be equal. But got {} vs. {}", prev, x));
        }
      }
      written[le * 3 + static_cast<int>(p)]++;
    }
  }
  for (int64_t le = 0; le < E; ++le) {
    for (int p = 0; p < 3; ++p) {
      if (written[le * 3 + p] != 1) {
        throw RuntimeError(
            fmt::format("internal: expert {} {} of layer {} was written {} times (expected once)",
                        ep.local_to_global[le], expert_proj_name(static_cast<ExpertProj>(p)), layer,
                        written[le * 3 + p]));
      }
    }
  }
  return out;
}

}  // namespace fp8moe
