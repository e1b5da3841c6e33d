// TP sharding of block-quantised expert weights (spec/oracle.md §5.3) and EP expert placement.
//
//   keep:   rank r takes rows (w13) / columns (w2) [r*I/T, (r+1)*I/T) and the matching scale
//   blocks. refine: the FULL checkpoint scale grid is upsampled with repeat_interleave (r0 along
//   dim -2, r1
//           along dim -1), then the rank's rows/columns of the refined grid are taken. Weights are
//           sharded as in keep. Lossless: every refined block lies inside one checkpoint block.
//   pad:    rank r owns global rows [r*W, min((r+1)*W, I)) with W = round_up(I/T, bn); the rest of
//           its allocation is padding: weight 0, scale 1, written before copying.
#include <fmt/format.h>

#include <algorithm>
#include <cstring>

#include "checkpoint/checkpoint_internal.hpp"
#include "fp8moe/checkpoint.hpp"
#include "fp8moe/error.hpp"

namespace fp8moe {

namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

std::string view_shape(const TensorView& v) {
  std::vector<int64_t> s = v.sizes();
  return shape_to_string(s);
}

// A 2-D view with a unit inner stride; `what` names it in errors.
void require_2d(const TensorView& v, int64_t rows, int64_t cols, const std::string& what,
                bool is_source) {
  if (!v.defined() || v.ndim != 2 || v.shape[0] != rows || v.shape[1] != cols) {
    const std::string msg = fmt::format("{}: shape {}, expected [{}, {}]", what,
                                        v.defined() ? view_shape(v) : "None", rows, cols);
    if (is_source) throw FormatError(msg);
    throw ValueError(msg);
  }
  if (v.strides[1] != 1 || v.strides[0] < cols) {
    throw ValueError(fmt::format("{}: the inner dimension must be contiguous", what));
  }
  if (!v.device.is_cpu()) throw ValueError(fmt::format("{}: must be a host tensor", what));
}

void require_fp8_weight(const TensorView& v, const std::string& what) {
  if (v.dtype != DType::kF8E4M3FN) {
    throw FormatError(fmt::format("{}: dtype {}, expected float8_e4m3fn (safetensors F8_E4M3)",
                                  what, dtype_name(v.dtype)));
  }
}

// Scale grids arrive as f32, or as e8m0 bytes (F8_E8M0 / U8) that are widened to f32 the way vLLM
// does it for DeepGEMM: the byte becomes the f32 exponent field (bits << 23). This maps e=0 to 0.0
// rather than 2^-127 and e=255 to +inf; both mirror vLLM.
float scale_at(const TensorView& s, int64_t i, int64_t j) {
  const char* base = static_cast<const char*>(s.data);
  const int64_t off = i * s.strides[0] + j * s.strides[1];
  if (s.dtype == DType::kF32) {
    float v;
    std::memcpy(&v, base + off * 4, 4);
    return v;
  }
  const uint32_t bits = static_cast<uint32_t>(static_cast<const uint8_t*>(s.data)[off]) << 23;
  float v;
  std::memcpy(&v, &bits, 4);
  return v;
}

void require_scale_dtype(const TensorView& v, const std::string& what) {
  if (v.dtype != DType::kF32 && v.dtype != DType::kF8E8M0FNU && v.dtype != DType::kU8) {
    throw FormatError(
        fmt::format("{}: dtype {}, expected float32 (or e8m0 bytes)", what, dtype_name(v.dtype)));
  }
}

uint8_t* row_ptr(const TensorView& v, int64_t r) {
  return static_cast<uint8_t*>(v.data) +
         r * v.strides[0] * static_cast<int64_t>(dtype_size(v.dtype));
}

float* frow(const TensorView& v, int64_t r) { return reinterpret_cast<float*>(row_ptr(v, r)); }

// dst_scale[dst_r0 + i, j] = src[src_r0 + i, src_c0 + j] for i < rows, j < cols.
void copy_scale_block(const TensorView& src, int64_t src_r0, int64_t src_c0, const TensorView& dst,
                      int64_t dst_r0, int64_t dst_c0, int64_t rows, int64_t cols) {
  for (int64_t i = 0; i < rows; ++i) {
    float* d = frow(dst, dst_r0 + i) + dst_c0;
    for (int64_t j = 0; j < cols; ++j) d[j] = scale_at(src, src_r0 + i, src_c0 + j);
  }
}

}  // namespace

std::string_view tp_shard_mode_name(TpShardMode m) {
  switch (m) {
    case TpShardMode::kKeep:
      return "keep";
    case TpShardMode::kRefine:
      return "refine";
    case TpShardMode::kPad:
      return "pad";
  }
  return "?";
}

int64_t TpShard::valid_size() const {
  if (mode != TpShardMode::kPad) return local_size;
  return std::max<int64_t>(0, std::min<int64_t>(local_size, intermediate_size - global_begin()));
}

std::array<int64_t, 2> TpShard::w13_scale_shape(int shards) const {
  return {shards * ceil_div(local_size, block[0]), ceil_div(hidden_size, block[1])};
}

std::array<int64_t, 2> TpShard::w2_scale_shape() const {
  return {ceil_div(hidden_size, block[0]), ceil_div(local_size, block[1])};
}

std::string TpShard::describe() const {
  switch (mode) {
    case TpShardMode::kKeep:
      return fmt::format("keep [{}, {}] blocks: rank {} of {} holds intermediate rows [{}, {})",
                         block[0], block[1], tp_rank, tp_size, global_begin(),
                         global_begin() + local_size);
    case TpShardMode::kRefine:
      return fmt::format(
          "refine [{}, {}] -> [{}, {}] (scales x{} rows, x{} columns): rank {} of {} holds rows "
          "[{}, {})",
          checkpoint_block[0], checkpoint_block[1], block[0], block[1], refine[0], refine[1],
          tp_rank, tp_size, global_begin(), global_begin() + local_size);
    case TpShardMode::kPad:
      return fmt::format(
          "pad to {} rows per rank ({} real, {} padding): rank {} of {} holds rows [{}, {})",
          local_size, valid_size(), local_size - valid_size(), tp_rank, tp_size, global_begin(),
          global_begin() + valid_size());
  }
  return "?";
}

void validate_fp8_block_shape_moe(int64_t ispp, std::array<int64_t, 2> block_size, int tp_size) {
  const auto [block_n, block_k] = block_size;
  // The messages of vLLM's create_weights checks, plus the expert-parallel hint newer vLLM appends
  // (its exact wording is not in the spec; it names --enable-expert-parallel as vLLM's does).
  const std::string hint =
      " Use a tensor-parallel size that keeps whole blocks per rank, or --enable-expert-parallel "
      "(experts are then split across ranks instead of their intermediate dimension).";
  if (ispp % block_n != 0) {
    throw ValueError(fmt::format(
        "The output_size of gate's and up's weight = {} is not divisible by weight quantization "
        "block_n = {}.{}",
        ispp, block_n, hint));
  }
  if (tp_size > 1 && ispp % block_k != 0) {
    throw ValueError(fmt::format(
        "The input_size of down's weight = {} is not divisible by weight quantization block_k = "
        "{}.{}",
        ispp, block_k, hint));
  }
}

TpShard make_tp_shard(int64_t I, int64_t H, int tp_size, int tp_rank,
                      std::array<int64_t, 2> checkpoint_block,
                      std::array<int64_t, 2> moe_block_shape,
                      std::optional<std::array<int64_t, 2>> refine, bool padded,
                      int64_t local_size) {
  if (tp_size < 1 || tp_rank < 0 || tp_rank >= tp_size) {
    throw ValueError(fmt::format("TP rank {} is outside a TP group of size {}", tp_rank, tp_size));
  }
  if (I <= 0 || H <= 0 || local_size <= 0) {
    throw ValueError(fmt::format("invalid expert shape: intermediate {}, hidden {}, per-rank {}", I,
                                 H, local_size));
  }
  for (int64_t b :
       {checkpoint_block[0], checkpoint_block[1], moe_block_shape[0], moe_block_shape[1]}) {
    if (b <= 0) throw ValueError(fmt::format("invalid block size {}", b));
  }
  TpShard s;
  s.tp_size = tp_size;
  s.tp_rank = tp_rank;
  s.intermediate_size = I;
  s.hidden_size = H;
  s.local_size = local_size;
  s.checkpoint_block = checkpoint_block;
  s.block = moe_block_shape;
  if (padded) {
    s.mode = TpShardMode::kPad;
    if (refine || moe_block_shape != checkpoint_block) {
      throw ValueError("a padded TP shard keeps the checkpoint blocks (no refine factor)");
    }
    if (local_size % checkpoint_block[0] != 0 || local_size * tp_size < I ||
        I % checkpoint_block[0] != 0 || H % checkpoint_block[0] != 0) {
      throw ValueError(fmt::format(
          "inconsistent padded TP shard: {} rows per rank x {} ranks for intermediate {} with "
          "{}-row blocks",
          local_size, tp_size, I, checkpoint_block[0]));
    }
    return s;
  }
  if (I % tp_size != 0 || local_size != I / tp_size) {
    throw ValueError(fmt::format("intermediate size {} split over {} ranks gives {}, not {}", I,
                                 tp_size, I / tp_size, local_size));
  }
  if (refine) {
    s.mode = TpShardMode::kRefine;
    s.refine = *refine;
    if ((*refine)[0] < 1 || (*refine)[1] < 1 ||
        moe_block_shape[0] * (*refine)[0] != checkpoint_block[0] ||
        moe_block_shape[1] * (*refine)[1] != checkpoint_block[1]) {
      throw ValueError(
          fmt::format("refine factor ({}, {}) does not turn [{}, {}] blocks into [{}, {}]",
                      (*refine)[0], (*refine)[1], checkpoint_block[0], checkpoint_block[1],
                      moe_block_shape[0], moe_block_shape[1]));
    }
    // The refined grid must tile every rank's share and the hidden size exactly.
    if (local_size % moe_block_shape[0] != 0 || local_size % moe_block_shape[1] != 0 ||
        H % moe_block_shape[0] != 0 || H % moe_block_shape[1] != 0) {
      throw ValueError(fmt::format(
          "refined [{}, {}] blocks do not tile the per-rank intermediate {} and hidden {}",
          moe_block_shape[0], moe_block_shape[1], local_size, H));
    }
    return s;
  }
  s.mode = TpShardMode::kKeep;
  if (moe_block_shape != checkpoint_block) {
    throw ValueError(fmt::format(
        "block shape [{}, {}] differs from the checkpoint's [{}, {}] but no "
        "refine factor was given",
        moe_block_shape[0], moe_block_shape[1], checkpoint_block[0], checkpoint_block[1]));
  }
  validate_fp8_block_shape_moe(local_size, checkpoint_block, tp_size);
  return s;
}

Tensor upsample_block_scales(const TensorView& scale, int64_t r0, int64_t r1) {
  if (scale.ndim != 2)
    throw ValueError(fmt::format("expected a 2-D scale grid, got {}", scale.describe()));
  if (r0 < 1 || r1 < 1) throw ValueError(fmt::format("invalid refine factor ({}, {})", r0, r1));
  require_scale_dtype(scale, "scale");
  const int64_t R = scale.shape[0], C = scale.shape[1];
  Tensor out = Tensor::empty({R * r0, C * r1}, DType::kF32);
  float* o = out.ptr<float>();
  for (int64_t i = 0; i < R * r0; ++i) {
    for (int64_t j = 0; j < C * r1; ++j) o[i * C * r1 + j] = scale_at(scale, i / r0, j / r1);
  }
  return out;
}

void load_w13_block_shard(const TpShard& s, int half, const TensorView& src,
                          const TensorView& src_scale, const TensorView& dst,
                          const TensorView& dst_scale, const std::string& what) {
  const int64_t I = s.intermediate_size, H = s.hidden_size, W = s.local_size;
  const auto [bn, bk] = s.checkpoint_block;
  if (half < 0 || dst.ndim != 2 || dst.shape[0] % W != 0 || half >= dst.shape[0] / W) {
    throw ValueError(
        fmt::format("{}: w13 half {} does not fit destination {}", what, half, dst.describe()));
  }
  const int shards = static_cast<int>(dst.shape[0] / W);
  if (s.mode == TpShardMode::kPad && src.defined() && src.ndim == 2 && src.shape[0] != I) {
    throw ValueError(fmt::format(
        "{}: Block-aligned FP8 TP loading expects an unsharded checkpoint projection of size {}, "
        "got {}.",
        what, I, src.shape[0]));
  }
  require_2d(src, I, H, what, true);
  require_fp8_weight(src, what);
  require_2d(src_scale, ceil_div(I, bn), ceil_div(H, bk), what + " scale", true);
  require_scale_dtype(src_scale, what + " scale");
  require_2d(dst, shards * W, H, what + " destination", false);
  const auto sshape = s.w13_scale_shape(shards);
  require_2d(dst_scale, sshape[0], sshape[1], what + " destination scale", false);
  if (dst_scale.dtype != DType::kF32)
    throw ValueError(what + ": destination scale must be float32");
  if (dtype_size(dst.dtype) != 1) throw ValueError(what + ": destination must be a 1-byte dtype");

  const int64_t rows_per_half_scale = sshape[0] / shards;  // ceil(W / block_n)
  const int64_t dst_row0 = static_cast<int64_t>(half) * W;
  const int64_t dst_srow0 = static_cast<int64_t>(half) * rows_per_half_scale;
  const int64_t valid = s.valid_size();
  const int64_t g0 = s.global_begin();

  if (s.mode == TpShardMode::kPad) {
    // Fill first: weights 0, scales 1 (clears stale data on reload too).
    for (int64_t i = 0; i < W; ++i) std::memset(row_ptr(dst, dst_row0 + i), 0, H);
    for (int64_t i = 0; i < rows_per_half_scale; ++i) {
      std::fill_n(frow(dst_scale, dst_srow0 + i), sshape[1], 1.0f);
    }
  }
  for (int64_t i = 0; i < valid; ++i)
    std::memcpy(row_ptr(dst, dst_row0 + i), row_ptr(src, g0 + i), H);

  switch (s.mode) {
    case TpShardMode::kKeep:
    case TpShardMode::kPad: {
      // Whole checkpoint blocks: the rank's first global row is a multiple of block_n (or the
      // rank is the only one).
      const int64_t src_r0 = g0 / bn;
      const int64_t rows = ceil_div(valid, bn);
      copy_scale_block(src_scale, src_r0, 0, dst_scale, dst_srow0, 0, rows, sshape[1]);
      break;
    }
    case TpShardMode::kRefine: {
      // Upsample the full grid, then take the rank's rows. (vLLM narrows at
      // upsampled_rows // tp_size * rank, which equals g0 / b when block_n divides I; fp8moe uses
      // the rank's true first row, so an I that is not a multiple of block_n stays correct.)
      Tensor up = upsample_block_scales(src_scale, s.refine[0], s.refine[1]);
      const int64_t b0 = s.block[0];
      copy_scale_block(up.view(), g0 / b0, 0, dst_scale, dst_srow0, 0, rows_per_half_scale,
                       sshape[1]);
      break;
    }
  }
}

void load_w2_block_shard(const TpShard& s, const TensorView& src, const TensorView& src_scale,
                         const TensorView& dst, const TensorView& dst_scale,
                         const std::string& what) {
  const int64_t I = s.intermediate_size, H = s.hidden_size, W = s.local_size;
  const auto [bn, bk] = s.checkpoint_block;
  if (s.mode == TpShardMode::kPad && src.defined() && src.ndim == 2 && src.shape[1] != I) {
    throw ValueError(fmt::format(
        "{}: Block-aligned FP8 TP loading expects an unsharded checkpoint projection of size {}, "
        "got {}.",
        what, I, src.shape[1]));
  }
  require_2d(src, H, I, what, true);
  require_fp8_weight(src, what);
  require_2d(src_scale, ceil_div(H, bn), ceil_div(I, bk), what + " scale", true);
  require_scale_dtype(src_scale, what + " scale");
  require_2d(dst, H, W, what + " destination", false);
  const auto sshape = s.w2_scale_shape();
  require_2d(dst_scale, sshape[0], sshape[1], what + " destination scale", false);
  if (dst_scale.dtype != DType::kF32)
    throw ValueError(what + ": destination scale must be float32");
  if (dtype_size(dst.dtype) != 1) throw ValueError(what + ": destination must be a 1-byte dtype");

  const int64_t valid = s.valid_size();
  const int64_t g0 = s.global_begin();
  if (s.mode == TpShardMode::kPad) {
    for (int64_t i = 0; i < H; ++i) std::memset(row_ptr(dst, i), 0, W);
    for (int64_t i = 0; i < sshape[0]; ++i) std::fill_n(frow(dst_scale, i), sshape[1], 1.0f);
  }
  for (int64_t i = 0; i < H; ++i) {
    if (valid > 0) std::memcpy(row_ptr(dst, i), row_ptr(src, i) + g0, valid);
  }
  switch (s.mode) {
    case TpShardMode::kKeep:
    case TpShardMode::kPad:
      copy_scale_block(src_scale, 0, g0 / bk, dst_scale, 0, 0, sshape[0], ceil_div(valid, bk));
      break;
    case TpShardMode::kRefine: {
      Tensor up = upsample_block_scales(src_scale, s.refine[0], s.refine[1]);
      copy_scale_block(up.view(), 0, g0 / s.block[1], dst_scale, 0, 0, sshape[0], sshape[1]);
      break;
    }
  }
}

// ---- EP placement
// -------------------------------------------------------------------------------------

ExpertPlacement place_experts(int num_experts, int ep_size, int ep_rank,
                              ExpertPlacementStrategy strategy) {
  if (num_experts < 1)
    throw ValueError(fmt::format("num_experts must be positive, got {}", num_experts));
  if (ep_size < 1 || ep_rank < 0 || ep_rank >= ep_size) {
    throw ValueError(fmt::format("EP rank {} is outside an EP group of size {}", ep_rank, ep_size));
  }
  if (ep_size > num_experts) {
    throw ValueError(
        fmt::format("EP size {} exceeds the {} experts: some ranks would hold no expert", ep_size,
                    num_experts));
  }
  ExpertPlacement p;
  p.num_experts = num_experts;
  p.ep_size = ep_size;
  p.ep_rank = ep_rank;
  p.expert_map.assign(num_experts, -1);
  if (strategy == ExpertPlacementStrategy::kLinear) {
    // vLLM determine_expert_map ("linear"): the first E % ep ranks take one extra expert.
    const int base = num_experts / ep_size;
    const int rem = num_experts % ep_size;
    const int count = base + (ep_rank < rem ? 1 : 0);
    const int start = ep_rank * base + std::min(ep_rank, rem);
    for (int i = 0; i < count; ++i) p.local_to_global.push_back(start + i);
  } else {
    for (int e = ep_rank; e < num_experts; e += ep_size) p.local_to_global.push_back(e);
  }
  for (int i = 0; i < p.num_local(); ++i) p.expert_map[p.local_to_global[i]] = i;
  return p;
}

}  // namespace fp8moe
