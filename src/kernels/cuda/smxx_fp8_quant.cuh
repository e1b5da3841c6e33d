// Activation quantisers and the gated activations (spec/numerics.md §3 and §5), as standalone
// kernels for the generic path, plus the device routines the fused kernels reuse.
//
//   per-token-group:  amax = max(1e-10, max|x|) over gk columns, s = amax / 448 (optionally
//                     2^ceil(log2 s)), q = e4m3(clamp(x / s)); with min_scale > 0 (the fused
//                     SiLU+quant path) s = max(amax / 448, min_scale) instead of the eps floor.
//   per-token:        s_r = max(amax_r / 448, 1 / (448 * 512))
//   per-tensor:       static s from the checkpoint, or s = amax / 448 over the tensor
// Rows can be a plain range or the valid positions of the sorted (padded) layout.
#pragma once

#include "cuda_common.cuh"
#include "moe_params.hpp"

namespace fp8moe::cuda {

__device__ __forceinline__ bool row_valid(const RowSet& r, int p) {
  if (p >= r.num_rows) return false;
  if (!r.sorted_ids) return true;
  return p < *r.num_rows_ptr && r.sorted_ids[p] < r.num_valid;
}

// The source row of output row p: p itself, or the token of sorted position p (gathered input).
__device__ __forceinline__ int src_row(const RowSet& r, int p) {
  return r.gather_div ? r.sorted_ids[p] / r.gather_div : p;
}

// x <- x * w with w cast to x's dtype first, as torch does for bf16 tensors.
__device__ __forceinline__ float row_scale_apply(const RowScale& rs, float x, int row,
                                                 bool bf16_src) {
  if (!rs.w) return x;
  if (bf16_src) return bf16_round(x * bf16_round(rs.w[row]));
  return x * rs.w[row];
}

__device__ __forceinline__ float ceil_pow2(float f) {
  const uint32_t u = __float_as_uint(f);
  const uint32_t exp_field = (u >> 23) & 0xFFu;
  const uint32_t mant = u & 0x7FFFFFu;
  return __uint_as_float((exp_field + (mant != 0 ? 1u : 0u)) << 23);
}

// Scale of one group from its amax (see the file comment).
__device__ __forceinline__ float group_scale(float amax, bool ue8m0, float min_scale) {
  float s = fmaxf(amax, 1e-10f) / kFp8Max;
  if (ue8m0) s = ceil_pow2(fmaxf(fabsf(s), 1e-10f));
  return fmaxf(s, min_scale);
}

// Eight e4m3 codes (low byte first) of the scaled values f(0) .. f(7), packed for one 8-byte
// store: the one place the quantisers pack their codes. f returns the value already divided by
// the scale (v / s: group and per-token scales, spec/numerics.md §3) or multiplied by its inverse
// (the per-tensor kernels: vLLM's scaled_fp8_conversion multiplies by the inverse scale).
template <class F>
__device__ __forceinline__ uint2 pack8_e4m3(F f) {
  uint32_t w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) w[i] = float2_to_e4m3x2(f(2 * i), f(2 * i + 1));
  return make_uint2(w[0] | (w[1] << 16), w[2] | (w[3] << 16));
}
__device__ __forceinline__ uint2 quant8(const float (&v)[8], float s) {
  return pack8_e4m3([&](int i) { return v[i] / s; });
}

// Per-token-group quantisation; one thread per 8 elements, kGroup/8 threads per group.
template <typename T, int kGroup>
__global__ void __launch_bounds__(256)
    quant_group_kernel(const T* __restrict__ src, int64_t src_stride, RowSet rows, RowScale rs,
                       int cols, uint8_t* __restrict__ q, int64_t q_stride,
                       float* __restrict__ s_out, int64_t s_stride, int ue8m0, float min_scale) {
  constexpr int kTpg = kGroup / 8;
  const int c8_per_row = cols / 8;
  const int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int row = static_cast<int>(idx / c8_per_row);
  const int c8 = static_cast<int>(idx % c8_per_row);
  // all threads of a group share the row, so validity is uniform per group
  const bool ok = row < rows.num_rows && row_valid(rows, row);
  float v[8];
  float amax = 0.0f;
  if (ok) {
    const int sr = src_row(rows, row);
    load8<T>(src + int64_t(sr) * src_stride + c8 * 8, v);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      v[i] = row_scale_apply(rs, v[i], sr, sizeof(T) == 2);
      amax = fmaxf(amax, fabsf(v[i]));
    }
  }
  amax = group_max<kTpg>(amax);
  if (!ok) return;
  const float s = group_scale(amax, ue8m0 != 0, min_scale);
  *reinterpret_cast<uint2*>(q + int64_t(row) * q_stride + c8 * 8) = quant8(v, s);
  if ((c8 % kTpg) == 0) s_out[int64_t(row) * s_stride + c8 / kTpg] = s;
}

// The same quantisation of token rows straight into the sorted layout: token t's groups are
// quantised once and written to the sorted position of each of its topk pairs (pair_pos from the
// alignment; -1: the slot is dropped). Bitwise what quant_group_kernel writes for the valid sorted
// rows with gather_div = topk (same source row, same operations); padding rows are not written by
// either. One thread per 8 columns of the M token rows instead of the whole padded capacity.
template <typename T, int kGroup>
__global__ void __launch_bounds__(256)
    quant_group_scatter_kernel(const T* __restrict__ src, int64_t src_stride, int M, int topk,
                               const int32_t* __restrict__ pair_pos, RowScale rs, int cols,
                               uint8_t* __restrict__ q, int64_t q_stride, float* __restrict__ s_out,
                               int64_t s_stride, int ue8m0, float min_scale) {
  constexpr int kTpg = kGroup / 8;
  const int c8_per_row = cols / 8;
  const int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int t = static_cast<int>(idx / c8_per_row);
  const int c8 = static_cast<int>(idx % c8_per_row);
  const bool ok = t < M;  // uniform per group (cols is a multiple of the group)
  float v[8];
  float amax = 0.0f;
  if (ok) {
    load8<T>(src + int64_t(t) * src_stride + c8 * 8, v);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      v[i] = row_scale_apply(rs, v[i], t, sizeof(T) == 2);
      amax = fmaxf(amax, fabsf(v[i]));
    }
  }
  amax = group_max<kTpg>(amax);
  if (!ok) return;
  const float s = group_scale(amax, ue8m0 != 0, min_scale);
  const uint2 qv = quant8(v, s);
  for (int k = 0; k < topk; ++k) {
    const int pos = pair_pos[int64_t(t) * topk + k];
    if (pos < 0) continue;
    *reinterpret_cast<uint2*>(q + int64_t(pos) * q_stride + c8 * 8) = qv;
    if ((c8 % kTpg) == 0) s_out[int64_t(pos) * s_stride + c8 / kTpg] = s;
  }
}

// Per-token dynamic quantisation: one block per row.
template <typename T>
__global__ void __launch_bounds__(256)
    quant_token_kernel(const T* __restrict__ src, int64_t src_stride, RowSet rows, RowScale rs,
                       int cols, uint8_t* __restrict__ q, int64_t q_stride,
                       float* __restrict__ s_out) {
  const int row = blockIdx.x;
  if (!row_valid(rows, row)) return;
  __shared__ float red[8];
  const int sr = src_row(rows, row);
  const T* x = src + int64_t(sr) * src_stride;
  float amax = 0.0f;
  for (int c = threadIdx.x; c < cols; c += blockDim.x) {
    amax = fmaxf(amax, fabsf(row_scale_apply(rs, load_as_float<T>(x, c), sr, sizeof(T) == 2)));
  }
  amax = warp_max(amax);
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = amax;
  __syncthreads();
  amax = 0.0f;
  for (int i = 0; i < static_cast<int>(blockDim.x >> 5); ++i) amax = fmaxf(amax, red[i]);
  const float s = fmaxf(amax / kFp8Max, 1.0f / (kFp8Max * 512.0f));
  for (int c = threadIdx.x; c < cols; c += blockDim.x) {
    q[int64_t(row) * q_stride + c] =
        float_to_e4m3(row_scale_apply(rs, load_as_float<T>(x, c), sr, sizeof(T) == 2) / s);
  }
  if (threadIdx.x == 0) s_out[row] = s;
}

// amax over the valid rows (for dynamic per-tensor scales): atomicMax on the float bits, which
// order like integers for non-negative values. *amax_bits must start at 0.
template <typename T>
__global__ void __launch_bounds__(256)
    amax_kernel(const T* __restrict__ src, int64_t src_stride, RowSet rows, RowScale rs, int cols,
                unsigned int* __restrict__ amax_bits) {
  const int row = blockIdx.x;  // rows on x: the sorted layout can exceed gridDim.y's limit
  if (!row_valid(rows, row)) return;
  const int sr = src_row(rows, row);
  float amax = 0.0f;
  for (int c = blockIdx.y * blockDim.x + threadIdx.x; c < cols; c += gridDim.y * blockDim.x) {
    amax =
        fmaxf(amax, fabsf(row_scale_apply(rs, load_as_float<T>(src + int64_t(sr) * src_stride, c),
                                          sr, sizeof(T) == 2)));
  }
  amax = warp_max(amax);
  if ((threadIdx.x & 31) == 0) atomicMax(amax_bits, __float_as_uint(amax));
}

// Per-tensor quantisation with a scale in device memory: static (checkpoint) or the dynamic scale
// derived from amax_bits (s = amax / 448, written to s_out once).
template <typename T>
__global__ void __launch_bounds__(256)
    quant_tensor_kernel(const T* __restrict__ src, int64_t src_stride, RowSet rows, RowScale rs,
                        int cols, uint8_t* __restrict__ q, int64_t q_stride,
                        const float* __restrict__ static_scale,
                        const unsigned int* __restrict__ amax_bits, float* __restrict__ s_out) {
  const int row = blockIdx.x;
  const float s = static_scale ? static_scale[0] : __uint_as_float(*amax_bits) / kFp8Max;
  const float inv = 1.0f / s;  // scaled_fp8_conversion multiplies by the inverse scale
  if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) s_out[0] = s;
  if (!row_valid(rows, row)) return;
  const int sr = src_row(rows, row);
  for (int c = blockIdx.y * blockDim.x + threadIdx.x; c < cols; c += gridDim.y * blockDim.x) {
    q[int64_t(row) * q_stride + c] =
        float_to_e4m3(row_scale_apply(rs, load_as_float<T>(src + int64_t(sr) * src_stride, c), sr,
                                      sizeof(T) == 2) *
                      inv);
  }
}

// The per-token and per-tensor quantisers above, eight columns per thread (16-byte loads, 8-byte
// stores) where the row layout allows it (vec8_ok): the same operations on every element, so the
// same bits. The scalar kernels touch one element per thread and were measured at 0.2-0.5 TB/s on
// the H200 (docs/PERFORMANCE.md, run 18).
template <typename T>
__device__ __forceinline__ float row_max8(const T* x, RowScale rs, int sr, int c8_per_row) {
  float amax = 0.0f;
  for (int c8 = threadIdx.x; c8 < c8_per_row; c8 += blockDim.x) {
    float v[8];
    load8<T>(x + c8 * 8, v);
#pragma unroll
    for (int i = 0; i < 8; ++i)
      amax = fmaxf(amax, fabsf(row_scale_apply(rs, v[i], sr, sizeof(T) == 2)));
  }
  return amax;
}

// Block-wide max of one value per thread (blockDim.x a multiple of 32, at most 1024).
__device__ __forceinline__ float block_max(float v) {
  __shared__ float red[32];
  v = warp_max(v);
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
  __syncthreads();
  v = 0.0f;
  for (int i = 0; i < static_cast<int>(blockDim.x >> 5); ++i) v = fmaxf(v, red[i]);
  return v;
}

// quant_token_kernel, eight columns per thread: one block per row.
template <typename T>
__global__ void __launch_bounds__(256)
    quant_token8_kernel(const T* __restrict__ src, int64_t src_stride, RowSet rows, RowScale rs,
                        int cols, uint8_t* __restrict__ q, int64_t q_stride,
                        float* __restrict__ s_out) {
  const int row = blockIdx.x;
  if (!row_valid(rows, row)) return;  // uniform per block
  const int sr = src_row(rows, row);
  const T* x = src + int64_t(sr) * src_stride;
  const int c8_per_row = cols / 8;
  const float amax = block_max(row_max8<T>(x, rs, sr, c8_per_row));
  const float s = fmaxf(amax / kFp8Max, 1.0f / (kFp8Max * 512.0f));
  for (int c8 = threadIdx.x; c8 < c8_per_row; c8 += blockDim.x) {
    float v[8];
    load8<T>(x + c8 * 8, v);
    *reinterpret_cast<uint2*>(q + int64_t(row) * q_stride + c8 * 8) =
        pack8_e4m3([&](int i) { return row_scale_apply(rs, v[i], sr, sizeof(T) == 2) / s; });
  }
  if (threadIdx.x == 0) s_out[row] = s;
}

// quant_tensor_kernel, 8 x kC columns per thread over the flattened (row, column / (8 kC)) range
// (kC = 2 where the columns allow it: two 16-byte loads in flight per thread).
template <typename T, int kC>
__global__ void __launch_bounds__(256)
    quant_tensor8_kernel(const T* __restrict__ src, int64_t src_stride, RowSet rows, RowScale rs,
                         int cols, uint8_t* __restrict__ q, int64_t q_stride,
                         const float* __restrict__ static_scale,
                         const unsigned int* __restrict__ amax_bits, float* __restrict__ s_out) {
  const float s = static_scale ? static_scale[0] : __uint_as_float(*amax_bits) / kFp8Max;
  const float inv = 1.0f / s;  // scaled_fp8_conversion multiplies by the inverse scale
  if (blockIdx.x == 0 && threadIdx.x == 0) s_out[0] = s;
  const int units = cols / (8 * kC);
  const int64_t n = int64_t(rows.num_rows) * units;
  for (int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; idx < n;
       idx += int64_t(gridDim.x) * blockDim.x) {
    const int row = static_cast<int>(idx / units);
    const int c8 = static_cast<int>(idx % units) * kC;
    if (!row_valid(rows, row)) continue;
    const int sr = src_row(rows, row);
    float v[kC][8];
#pragma unroll
    for (int k = 0; k < kC; ++k) load8<T>(src + int64_t(sr) * src_stride + (c8 + k) * 8, v[k]);
#pragma unroll
    for (int k = 0; k < kC; ++k) {
      *reinterpret_cast<uint2*>(q + int64_t(row) * q_stride + (c8 + k) * 8) =
          pack8_e4m3([&](int i) { return row_scale_apply(rs, v[k][i], sr, sizeof(T) == 2) * inv; });
    }
  }
}

// amax_kernel over the flattened (row, column / 8) range.
template <typename T>
__global__ void __launch_bounds__(256)
    amax8_kernel(const T* __restrict__ src, int64_t src_stride, RowSet rows, RowScale rs, int cols,
                 unsigned int* __restrict__ amax_bits) {
  const int c8_per_row = cols / 8;
  const int64_t n = int64_t(rows.num_rows) * c8_per_row;
  float amax = 0.0f;
  for (int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; idx < n;
       idx += int64_t(gridDim.x) * blockDim.x) {
    const int row = static_cast<int>(idx / c8_per_row);
    const int c8 = static_cast<int>(idx % c8_per_row);
    if (!row_valid(rows, row)) continue;
    const int sr = src_row(rows, row);
    float v[8];
    load8<T>(src + int64_t(sr) * src_stride + c8 * 8, v);
#pragma unroll
    for (int i = 0; i < 8; ++i)
      amax = fmaxf(amax, fabsf(row_scale_apply(rs, v[i], sr, sizeof(T) == 2)));
  }
  amax = warp_max(amax);
  if ((threadIdx.x & 31) == 0) atomicMax(amax_bits, __float_as_uint(amax));
}

// ---- activations -------------------------------------------------------------------------------
// Rounding to the activation dtype.
__device__ __forceinline__ float round_act(const ActParams& ap, float v) {
  return ap.f32 ? v : bf16_round(v);
}

__device__ __forceinline__ float silu_f32(float g) { return g / (1.0f + expf(-g)); }
__device__ __forceinline__ float gelu_f32(float g) {
  return g * 0.5f * (1.0f + erff(g * 0.70710678118654752440f));
}
__device__ __forceinline__ float gelu_tanh_f32(float g) {
  const float kBeta = 0.79788456080286535588f;  // sqrt(2) * 2/sqrt(pi) * 0.5
  const float kKappa = 0.044715f;
  const float inner = kBeta * (g + kKappa * g * g * g);
  return 0.5f * g * (1.0f + tanhf(inner));
}

__device__ __forceinline__ float sigmoid_f32(float x) { return 1.0f / (1.0f + expf(-x)); }

// Gated: h from (gate, up), both already rounded to the activation dtype. Returns h before its
// final rounding (the caller rounds to bf16, or keeps fp32 for the fused SiLU+quant path). The
// rounding points and operation orders are those of numerics/activation.hpp (vLLM's kernels).
__device__ __forceinline__ float act_gated(const ActParams& ap, float g, float u) {
  switch (static_cast<Act>(ap.act)) {
    case Act::kSilu:
      // snapshot fused SiLU+quant: g * sigmoid(g) * u in fp32, clamp ignored (vLLM oddity)
      if (ap.fp32_silu) return g * sigmoid_f32(g) * u;
      if (ap.has_limit && ap.limit > 0.0f) {
        // swiglu_limit_func: one rounding; alpha/beta unused
        const float gc = g > ap.limit ? ap.limit : g;
        const float uc = u > ap.limit ? ap.limit : (u < -ap.limit ? -ap.limit : u);
        return silu_f32(gc) * uc;
      }
      return round_act(ap, silu_f32(g)) * u;
    case Act::kGelu:
      return round_act(ap, gelu_f32(g)) * u;
    case Act::kGeluTanh:
      return round_act(ap, gelu_tanh_f32(g)) * u;
    case Act::kSwigluOai: {
      const float kAlpha = 1.702f, kLimit = 7.0f;  // the op defaults (config values not forwarded)
      const float gc = g > kLimit ? kLimit : g;
      const float uc = u > kLimit ? kLimit : (u < -kLimit ? -kLimit : u);
      return (uc + 1.0f) * gc * sigmoid_f32(kAlpha * gc);
    }
    case Act::kSwigluOaiUninterleave: {
      const float gc = g > ap.limit ? ap.limit : g;
      const float uc = u > ap.limit ? ap.limit : (u < -ap.limit ? -ap.limit : u);
      return gc * sigmoid_f32(ap.alpha * gc) * (uc + ap.beta);
    }
    case Act::kSitu: {
      const float b = ap.situ_beta, lb = ap.situ_linear_beta;
      const float uu = lb > 0.0f ? lb * tanhf(u / lb) : u;
      return b * tanhf(g / b) * sigmoid_f32(g) * uu;
    }
    case Act::kSwigluStep: {
      const float s = silu_f32(g);
      const float uc = u > 7.0f ? 7.0f : (u < -7.0f ? -7.0f : u);
      return (s > 7.0f ? 7.0f : s) * uc;
    }
    default:
      return 0.0f;
  }
}
__device__ __forceinline__ float act_plain(const ActParams& ap, float y) {
  switch (static_cast<Act>(ap.act)) {
    case Act::kSiluNoMul:
      return silu_f32(y);
    case Act::kGeluNoMul:
      return gelu_f32(y);
    case Act::kGeluTanhNoMul:
      return gelu_tanh_f32(y);
    case Act::kRelu2NoMul:
      return y > 0.0f ? y * y : 0.0f;
    default:
      return 0.0f;
  }
}

// y1 (rows, N1) -> h (rows, I). TIn: bf16 bits or f32 (f32 activations). TOut: bf16 bits, or f32
// for the fused SiLU+quant semantics and f32 activations.
template <typename TIn, typename TOut>
__global__ void __launch_bounds__(256)
    activation_kernel(const TIn* __restrict__ y1, int64_t y1_stride, RowSet rows, int I,
                      ActParams ap, TOut* __restrict__ h, int64_t h_stride) {
  const int row = blockIdx.x;
  if (!row_valid(rows, row)) return;
  const TIn* y = y1 + int64_t(row) * y1_stride;
  const bool gated = act_is_gated(static_cast<Act>(ap.act));
  const bool interleaved = static_cast<Act>(ap.act) == Act::kSwigluOai;
  for (int i = blockIdx.y * blockDim.x + threadIdx.x; i < I; i += gridDim.y * blockDim.x) {
    float r;
    if (gated) {
      const float g = load_as_float<TIn>(y, interleaved ? 2 * i : i);
      const float u = load_as_float<TIn>(y, interleaved ? 2 * i + 1 : I + i);
      r = act_gated(ap, g, u);
    } else {
      r = act_plain(ap, load_as_float<TIn>(y, i));
    }
    if constexpr (sizeof(TOut) == 2) {
      h[int64_t(row) * h_stride + i] = float_to_bf16_bits(r);
    } else {
      h[int64_t(row) * h_stride + i] = r;
    }
  }
}

// Gated activation and the dynamic 1 x 128 quantisation of h in one kernel: y1 (rows, 2 I) bf16
// with gate | up halves -> q (rows, I) and scales (rows, I / 128), for the valid rows of `rows`.
// The same values as activation_kernel (h rounded to bf16, or kept f32 when kHF32: the fused
// SiLU+quant semantics) followed by quant_group_kernel on h, without writing h: one thread per 8
// columns of h, 16 threads per group.
template <bool kHF32>
__global__ void __launch_bounds__(256)
    act_quant_group_kernel(const uint16_t* __restrict__ y1, int64_t y1_stride, RowSet rows, int I,
                           ActParams ap, uint8_t* __restrict__ q, int64_t q_stride,
                           float* __restrict__ s_out, int64_t s_stride, int ue8m0,
                           float min_scale) {
  constexpr int kTpg = 128 / 8;
  const int c8_per_row = I / 8;
  const int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int row = static_cast<int>(idx / c8_per_row);
  const int c8 = static_cast<int>(idx % c8_per_row);
  const bool ok = row < rows.num_rows && row_valid(rows, row);  // uniform per group
  float v[8];
  float amax = 0.0f;
  if (ok) {
    float g[8], u[8];
    load8<uint16_t>(y1 + int64_t(row) * y1_stride + c8 * 8, g);
    load8<uint16_t>(y1 + int64_t(row) * y1_stride + I + c8 * 8, u);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const float r = act_gated(ap, g[i], u[i]);
      v[i] = kHF32 ? r : bf16_round(r);
      amax = fmaxf(amax, fabsf(v[i]));
    }
  }
  amax = group_max<kTpg>(amax);
  if (!ok) return;
  const float s = group_scale(amax, ue8m0 != 0, min_scale);
  *reinterpret_cast<uint2*>(q + int64_t(row) * q_stride + c8 * 8) = quant8(v, s);
  if ((c8 % kTpg) == 0) s_out[int64_t(row) * s_stride + c8 / kTpg] = s;
}

// Gated activation and a per-tensor (static scale) or per-token (dynamic) quantisation of h in one
// kernel, h never written: the values of activation_kernel (h rounded to bf16, or kept f32 when
// kHF32) followed by quant_tensor_kernel / quant_token_kernel on h. y1 (rows, 2 I) bf16 with
// gate | up halves; I a multiple of 8.
template <bool kHF32>
__device__ __forceinline__ void act8(const ActParams& ap, const uint16_t* y, int I, int c8,
                                     float (&v)[8]) {
  float g[8], u[8];
  load8<uint16_t>(y + c8 * 8, g);
  load8<uint16_t>(y + I + c8 * 8, u);
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const float r = act_gated(ap, g[i], u[i]);
    v[i] = kHF32 ? r : bf16_round(r);
  }
}

// Per-tensor static scale: flattened (row, column / (8 kC)) range, 8 x kC columns per thread
// (kC = 2 where I allows it: four 16-byte loads in flight per thread).
template <bool kHF32, int kC>
__global__ void __launch_bounds__(256)
    act_quant_tensor_kernel(const uint16_t* __restrict__ y1, int64_t y1_stride, RowSet rows, int I,
                            ActParams ap, uint8_t* __restrict__ q, int64_t q_stride,
                            const float* __restrict__ static_scale, float* __restrict__ s_out) {
  const float s = static_scale[0];
  const float inv = 1.0f / s;
  if (blockIdx.x == 0 && threadIdx.x == 0) s_out[0] = s;
  const int units = I / (8 * kC);
  const int64_t n = int64_t(rows.num_rows) * units;
  for (int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; idx < n;
       idx += int64_t(gridDim.x) * blockDim.x) {
    const int row = static_cast<int>(idx / units);
    const int c8 = static_cast<int>(idx % units) * kC;
    if (!row_valid(rows, row)) continue;
    const uint16_t* y = y1 + int64_t(row) * y1_stride;
    float g[kC][8], u[kC][8];
#pragma unroll
    for (int k = 0; k < kC; ++k) {
      load8<uint16_t>(y + (c8 + k) * 8, g[k]);
      load8<uint16_t>(y + I + (c8 + k) * 8, u[k]);
    }
#pragma unroll
    for (int k = 0; k < kC; ++k) {
      float v[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const float r = act_gated(ap, g[k][i], u[k][i]);
        v[i] = kHF32 ? r : bf16_round(r);
      }
      *reinterpret_cast<uint2*>(q + int64_t(row) * q_stride + (c8 + k) * 8) =
          pack8_e4m3([&](int i) { return v[i] * inv; });
    }
  }
}

// Per-token dynamic scale: one block per row; h is computed twice (the row's amax, then the
// codes), the second pass reading y1 from cache.
template <bool kHF32>
__global__ void __launch_bounds__(256)
    act_quant_token_kernel(const uint16_t* __restrict__ y1, int64_t y1_stride, RowSet rows, int I,
                           ActParams ap, uint8_t* __restrict__ q, int64_t q_stride,
                           float* __restrict__ s_out) {
  const int row = blockIdx.x;
  if (!row_valid(rows, row)) return;  // uniform per block
  const uint16_t* y = y1 + int64_t(row) * y1_stride;
  const int c8_per_row = I / 8;
  float amax = 0.0f;
  for (int c8 = threadIdx.x; c8 < c8_per_row; c8 += blockDim.x) {
    float v[8];
    act8<kHF32>(ap, y, I, c8, v);
#pragma unroll
    for (int i = 0; i < 8; ++i) amax = fmaxf(amax, fabsf(v[i]));
  }
  amax = block_max(amax);
  const float s = fmaxf(amax / kFp8Max, 1.0f / (kFp8Max * 512.0f));
  for (int c8 = threadIdx.x; c8 < c8_per_row; c8 += blockDim.x) {
    float v[8];
    act8<kHF32>(ap, y, I, c8, v);
    *reinterpret_cast<uint2*>(q + int64_t(row) * q_stride + c8 * 8) = quant8(v, s);
  }
  if (threadIdx.x == 0) s_out[row] = s;
}

}  // namespace fp8moe::cuda
