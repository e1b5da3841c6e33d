// FP8 quantisers with vLLM's semantics (spec/numerics.md §3): activations per tensor (static and
// dynamic), per token, per token-group (32/64/128, optional UE8M0 scales) and MXFP8 (1x32, e8m0);
// weights per [bn, bk] block (per_block_cast_to_fp8), per tensor, per output channel and MXFP8;
// the e4m3fn -> e4m3fnuz normalisation. Scales are float32 multipliers: real = decode(q) * scale.
//
// The row functions work on float32 values (what vLLM's kernels load) and are cheap enough for the
// CPU kernels' scalar paths. Each mirrors one vLLM kernel down to its NaN behaviour, which differs
// between kernels because of how fmaxf/fminf drop NaN:
//   * per_token_group_quant_fp8 clamps with fminf(fmaxf(v, -max), max): NaN -> -max;
//   * scaled_fp8_conversion (per-tensor, per-token) clamps with fmaxf(-max, fminf(v, max)):
//     NaN -> +max;
//   * their amax reductions use fmaxf too, so NaN elements do not raise the scale; an inf element
//     makes the scale inf, and then every finite element quantises to 0 and the inf itself (inf/inf
//     = NaN) to the NaN result above.
// These are the documented results for NaN/inf inputs; tests pin them.
#pragma once

#include <cmath>
#include <cstdint>
#include <optional>

#include "fp8moe/dtype.hpp"
#include "fp8moe/numerics.hpp"
#include "fp8moe/tensor.hpp"

namespace fp8moe::numerics {

// The largest value vLLM's quantisers map to: 448 for e4m3fn; 224 for e4m3fnuz (ROCm's
// get_fp8_min_max() uses 224, not the format's 240, for numerical headroom); 57344 for e5m2.
constexpr float quant_fp8_max(DType fp8) {
  return fp8 == DType::kF8E4M3FNUZ ? 224.0f : fp8_format_max(fp8);
}
// vLLM's per-token floor on dynamic scales: 1 / (fp8_max * 512).
constexpr float min_scaling_factor(DType fp8) { return 1.0f / (quant_fp8_max(fp8) * 512.0f); }

inline constexpr float kGroupQuantEps = 1e-10f;      // per_token_group_quant_fp8 amax floor
inline constexpr float kBlockCastAmaxFloor = 1e-4f;  // per_block_cast_to_fp8 amax floor
inline constexpr int64_t kMxGroupSize = 32;          // MXFP8 block along K

// fminf(fmaxf(v, -m), m): per_token_group_quant_fp8's clamp (NaN -> -m).
inline float clamp_group_style(float v, float m) { return std::fmin(std::fmax(v, -m), m); }
// fmaxf(-m, fminf(v, m)): scaled_fp8_conversion's clamp (NaN -> +m).
inline float clamp_conversion_style(float v, float m) { return std::fmax(-m, std::fmin(v, m)); }
// max over |x| with fmaxf semantics (NaN ignored), starting from `init`.
inline float absmax(const float* x, int64_t n, float init = 0.0f) {
  float m = init;
  for (int64_t i = 0; i < n; ++i) m = std::fmax(m, std::fabs(x[i]));
  return m;
}

// ---- activations: one row / one group -----------------------------------------------------------

// per_token_group_quant_fp8 on one group of n values: scale = max(eps, amax) / fp8_max, rounded up
// to a power of two when `ue8m0`, floored at `min_scale` (0 normally; 1/(448*512) for the
// snapshot's fused SiLU+quant kernel); q = fp8(clamp(x / scale)). Returns the scale.
float quantize_group_fp8(const float* x, int64_t n, uint8_t* q, DType fp8, bool ue8m0 = false,
                         float min_scale = 0.0f);

// Dynamic per-token (scaled_fp8_quant with use_per_token_if_dynamic): scale = max(amax / fp8_max,
// 1/(fp8_max*512)); q = fp8(clamp(x / scale)). Returns the scale.
float quantize_row_per_token_fp8(const float* x, int64_t n, uint8_t* q, DType fp8);

// Dynamic per-tensor scale: max|x| / fp8_max over all values (0 for an all-zero tensor; vLLM
// applies no floor).
inline float per_tensor_dynamic_scale(float amax, DType fp8) { return amax / quant_fp8_max(fp8); }

// Per-tensor quantisation with a given scale (static, or the dynamic one above): q =
// fp8(clamp(x * (1/scale))). With scale 0 (an all-zero dynamic tensor) 1/0 = inf and 0 * inf =
// NaN clamps to +fp8_max, exactly as vLLM's kernel: the codes are 0x7E but dequantise to 0.
void quantize_per_tensor_fp8(const float* x, int64_t n, float scale, uint8_t* q, DType fp8);

// MXFP8 (OCP MX e4m3, 1 x 32) on one group of n values. fp8moe follows the rule of vLLM's current
// quantisers (FlashInfer's mxfp8_quantize on SM100, and the torch reference in vLLM's tests):
// scale = 2^ceil(log2(amax / 448)), i.e. the exponent is rounded UP so that nothing saturates,
// clamped to the e8m0 range [2^-127, 2^127] (biased exponent 0..254); amax is floored at the
// smallest normal float (2^-126), so an all-zero group gets 2^-127. This differs from the OCP
// spec's floor(log2(amax)) - 8 (which can saturate the largest element) and from an older vLLM
// torch fallback that used floor(log2(amax)) without the -8 (scaled values in [1, 2)).
// Returns the e8m0 code of the scale.
uint8_t quantize_mx_group(const float* x, int64_t n, uint8_t* q);

// ---- tensors ------------------------------------------------------------------------------------

struct QuantizedTensor {
  Tensor q;      // fp8 codes, same shape as the input
  Tensor scale;  // f32 scales (u8 e8m0 codes for MX)
};

// vLLM/DeepGEMM per_block_cast_to_fp8 on a (R, C) or (E, R, C) f32/bf16 tensor: zero-pad to
// whole [bn, bk] blocks, amax per block floored at 1e-4, scale = amax / fp8_max (rounded up to a
// power of two when ue8m0), q = fp8(x * (1/scale)). scale: (ceil(R/bn), ceil(C/bk)) per matrix.
QuantizedTensor per_block_cast_to_fp8(const TensorView& w, int64_t bn, int64_t bk,
                                      DType fp8 = DType::kF8E4M3FN, bool ue8m0 = false);
// One scale per matrix (scaled_fp8_quant, dynamic per-tensor): scale (E) or (1).
QuantizedTensor per_tensor_cast_to_fp8(const TensorView& w, DType fp8 = DType::kF8E4M3FN);
// One scale per output row (per-channel weights): scale (E, R) or (R).
QuantizedTensor per_channel_cast_to_fp8(const TensorView& w, DType fp8 = DType::kF8E4M3FN);
// MXFP8 along the last dim (must be a multiple of 32): scale (..., C/32) u8 e8m0.
QuantizedTensor mx_cast_to_fp8(const TensorView& w);

// Row-wise activation quantisers on a (R, C) f32/bf16 tensor (the tensor versions of the row
// functions above, for tests and tools). group: scale (R, C/group); token: (R); tensor: (1).
QuantizedTensor per_token_group_quant_fp8(const TensorView& x, int64_t group, DType fp8,
                                          bool ue8m0 = false);
QuantizedTensor per_token_quant_fp8(const TensorView& x, DType fp8);
QuantizedTensor per_tensor_quant_fp8(const TensorView& x, DType fp8,
                                     std::optional<float> static_scale = std::nullopt);

// vLLM normalize_e4m3fn_to_e4m3fnuz: reinterpret the e4m3fn codes as e4m3fnuz (same bits, half
// the value; 0x80, -0 in e4m3fn, is NaN in fnuz and becomes 0) and double the scales so that
// code * scale is unchanged.
QuantizedTensor normalize_e4m3fn_to_e4m3fnuz(const QuantizedTensor& fn);

// Dequantisation helpers: decode(q) * scale in double, for a (R, C) or (E, R, C) tensor with the
// scale layouts above. Block scales need bn, bk; MX scales are e8m0 codes.
Tensor dequantize_block(const TensorView& q, const TensorView& scale, int64_t bn, int64_t bk);
Tensor dequantize_rows(const TensorView& q, const TensorView& scale);  // per-tensor/channel/token

// Reads element i of a floating tensor (f32, bf16, f16, f64) as float. Throws on other dtypes.
float load_float(const TensorView& t, int64_t i);

}  // namespace fp8moe::numerics
