// Launchers of the activation quantisers and the activation kernel (smxx_fp8_quant.cuh).
#include "moe_launchers.hpp"
#include "smxx_fp8_quant.cuh"

#include <string>

namespace fp8moe::cuda {

namespace {

// Whether the eight-columns-per-thread kernels can run: 16-byte aligned source rows of a multiple
// of 8 columns, 8-byte aligned code rows.
template <typename T>
bool vec8_ok(const T* src, int64_t src_stride, int cols, const uint8_t* q, int64_t q_stride) {
  return cols % 8 == 0 && (src_stride * int64_t(sizeof(T))) % 16 == 0 &&
         (reinterpret_cast<uintptr_t>(src) & 15) == 0 && q_stride % 8 == 0 &&
         (reinterpret_cast<uintptr_t>(q) & 7) == 0;
}

// Blocks of a grid-stride kernel over n threads' work: enough to fill the card several times.
unsigned stride_blocks(int64_t n) {
  return static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(ceil_div(n, 256), 132 * 16)));
}

template <typename T>
void quant_typed(const QuantSpec& spec, const T* src, int64_t src_stride, const RowSet& rows,
                 const RowScale& rs, int cols, const QuantOut& out, cudaStream_t stream) {
  if (rows.num_rows == 0 || cols == 0) return;
  switch (spec.kind) {
    case AQuant::kGroupDynamic: {
      const int64_t threads = int64_t(rows.num_rows) * (cols / 8);
      const unsigned blocks = static_cast<unsigned>(ceil_div(threads, 256));
#define FP8MOE_QG(G)                                                                           \
  quant_group_kernel<T, G><<<blocks, 256, 0, stream>>>(src, src_stride, rows, rs, cols, out.q, \
                                                       out.q_stride, out.s, out.s_stride,      \
                                                       spec.ue8m0 ? 1 : 0, spec.min_scale)
      if (spec.gk == 128)
        FP8MOE_QG(128);
      else if (spec.gk == 64)
        FP8MOE_QG(64);
      else if (spec.gk == 32)
        FP8MOE_QG(32);
      else
        throw NotImplementedError("cuda_fused: activation group size must be 32, 64 or 128");
#undef FP8MOE_QG
      break;
    }
    case AQuant::kTokenDynamic:
      if (vec8_ok(src, src_stride, cols, out.q, out.q_stride))
        quant_token8_kernel<T><<<rows.num_rows, 256, 0, stream>>>(src, src_stride, rows, rs, cols,
                                                                  out.q, out.q_stride, out.s);
      else
        quant_token_kernel<T><<<rows.num_rows, 256, 0, stream>>>(src, src_stride, rows, rs, cols,
                                                                 out.q, out.q_stride, out.s);
      break;
    case AQuant::kTensorStatic:
    case AQuant::kTensorDynamic: {
      if (vec8_ok(src, src_stride, cols, out.q, out.q_stride)) {
        const unsigned blocks = stride_blocks(int64_t(rows.num_rows) * (cols / 8));
        if (spec.kind == AQuant::kTensorDynamic) {
          FP8MOE_CUDA_CHECK(cudaMemsetAsync(spec.amax_ws, 0, sizeof(unsigned int), stream));
          amax8_kernel<T>
              <<<blocks, 256, 0, stream>>>(src, src_stride, rows, rs, cols, spec.amax_ws);
          FP8MOE_CUDA_CHECK_LAUNCH();
        }
        const float* st = spec.kind == AQuant::kTensorStatic ? spec.static_scale : nullptr;
        if (cols % 16 == 0)
          quant_tensor8_kernel<T, 2>
              <<<stride_blocks(int64_t(rows.num_rows) * (cols / 16)), 256, 0, stream>>>(
                  src, src_stride, rows, rs, cols, out.q, out.q_stride, st, spec.amax_ws, out.s);
        else
          quant_tensor8_kernel<T, 1><<<blocks, 256, 0, stream>>>(
              src, src_stride, rows, rs, cols, out.q, out.q_stride, st, spec.amax_ws, out.s);
        break;
      }
      const dim3 grid(rows.num_rows,
                      static_cast<unsigned>(std::min<int64_t>(ceil_div(cols, 256), 64)));
      if (spec.kind == AQuant::kTensorDynamic) {
        FP8MOE_CUDA_CHECK(cudaMemsetAsync(spec.amax_ws, 0, sizeof(unsigned int), stream));
        amax_kernel<T><<<grid, 256, 0, stream>>>(src, src_stride, rows, rs, cols, spec.amax_ws);
        FP8MOE_CUDA_CHECK_LAUNCH();
      }
      quant_tensor_kernel<T><<<grid, 256, 0, stream>>>(
          src, src_stride, rows, rs, cols, out.q, out.q_stride,
          spec.kind == AQuant::kTensorStatic ? spec.static_scale : nullptr, spec.amax_ws, out.s);
      break;
    }
  }
  FP8MOE_CUDA_CHECK_LAUNCH();
}

}  // namespace

bool quant_rows_vectorised(const void* src, bool src_f32, int64_t src_stride, int cols,
                           const uint8_t* q, int64_t q_stride) {
  return src_f32 ? vec8_ok(static_cast<const float*>(src), src_stride, cols, q, q_stride)
                 : vec8_ok(static_cast<const uint16_t*>(src), src_stride, cols, q, q_stride);
}

void launch_quant(const QuantSpec& spec, const void* src, bool src_f32, int64_t src_stride,
                  const RowSet& rows, const RowScale& rs, int cols, const QuantOut& out,
                  cudaStream_t stream) {
  if (src_f32) {
    quant_typed<float>(spec, static_cast<const float*>(src), src_stride, rows, rs, cols, out,
                       stream);
  } else {
    quant_typed<uint16_t>(spec, static_cast<const uint16_t*>(src), src_stride, rows, rs, cols, out,
                          stream);
  }
}

void launch_quant_scatter(const QuantSpec& spec, const void* src, bool src_f32, int64_t src_stride,
                          int M, int topk, const int32_t* pair_pos, const RowScale& rs, int cols,
                          const QuantOut& out, cudaStream_t stream) {
  if (M == 0 || cols == 0) return;
  if (spec.kind != AQuant::kGroupDynamic || spec.gk != 128)
    throw NotImplementedError("cuda: the scattering quantisation runs 1 x 128 dynamic groups only");
  const unsigned blocks = static_cast<unsigned>(ceil_div(int64_t(M) * (cols / 8), 256));
  if (src_f32)
    quant_group_scatter_kernel<float, 128><<<blocks, 256, 0, stream>>>(
        static_cast<const float*>(src), src_stride, M, topk, pair_pos, rs, cols, out.q,
        out.q_stride, out.s, out.s_stride, spec.ue8m0 ? 1 : 0, spec.min_scale);
  else
    quant_group_scatter_kernel<uint16_t, 128><<<blocks, 256, 0, stream>>>(
        static_cast<const uint16_t*>(src), src_stride, M, topk, pair_pos, rs, cols, out.q,
        out.q_stride, out.s, out.s_stride, spec.ue8m0 ? 1 : 0, spec.min_scale);
  FP8MOE_CUDA_CHECK_LAUNCH();
}

bool act_quant_fusable(const QuantSpec& spec, int I, const ActParams& ap) {
  const Act act = static_cast<Act>(ap.act);
  if (!act_is_gated(act) || act == Act::kSwigluOai) return false;
  switch (spec.kind) {
    case AQuant::kGroupDynamic:
      return spec.gk == 128 && I % 128 == 0;
    case AQuant::kTokenDynamic:
      return I % 8 == 0;
    case AQuant::kTensorStatic:
      return I % 8 == 0 && spec.static_scale != nullptr;
    case AQuant::kTensorDynamic:
      return false;  // needs the amax of every row of h first
  }
  return false;
}

void launch_act_quant(const uint16_t* y1, int64_t y1_stride, const RowSet& rows, int I,
                      const ActParams& ap, bool h_f32, const QuantSpec& spec, const QuantOut& out,
                      cudaStream_t stream) {
  if (rows.num_rows == 0 || I == 0) return;
  if (!act_quant_fusable(spec, I, ap))
    throw NotImplementedError(
        "cuda: the fused activation + quantisation takes gated activations with gate | up halves "
        "(activation " +
        std::to_string(ap.act) +
        ") and dynamic 1 x 128 groups (I % 128 == 0), "
        "per-token dynamic or static per-tensor scales with a scale (I % 8 == 0); got scale kind " +
        std::to_string(static_cast<int>(spec.kind)) + ", group " + std::to_string(spec.gk) +
        ", I = " + std::to_string(I) + (spec.static_scale ? "" : ", no static scale"));
  if ((y1_stride % 8) != 0 || (reinterpret_cast<uintptr_t>(y1) & 15) != 0 ||
      out.q_stride % 8 != 0 || (reinterpret_cast<uintptr_t>(out.q) & 7) != 0)
    throw ValueError(
        "cuda: the fused activation + quantisation needs 16-byte aligned y1 rows (stride % 8 == 0) "
        "and 8-byte aligned code rows; got y1 stride " +
        std::to_string(y1_stride) +
        (reinterpret_cast<uintptr_t>(y1) & 15 ? " (y1 unaligned)" : "") + ", q stride " +
        std::to_string(out.q_stride) +
        (reinterpret_cast<uintptr_t>(out.q) & 7 ? " (q unaligned)" : ""));
  if (spec.kind == AQuant::kTokenDynamic) {
    if (h_f32)
      act_quant_token_kernel<true><<<rows.num_rows, 256, 0, stream>>>(y1, y1_stride, rows, I, ap,
                                                                      out.q, out.q_stride, out.s);
    else
      act_quant_token_kernel<false><<<rows.num_rows, 256, 0, stream>>>(y1, y1_stride, rows, I, ap,
                                                                       out.q, out.q_stride, out.s);
    FP8MOE_CUDA_CHECK_LAUNCH();
    return;
  }
  if (spec.kind == AQuant::kTensorStatic) {
    const bool two = I % 16 == 0;
    const unsigned blocks = stride_blocks(int64_t(rows.num_rows) * (I / (two ? 16 : 8)));
#define FP8MOE_AQT(F, C)                                     \
  act_quant_tensor_kernel<F, C><<<blocks, 256, 0, stream>>>( \
      y1, y1_stride, rows, I, ap, out.q, out.q_stride, spec.static_scale, out.s)
    if (h_f32) {
      if (two)
        FP8MOE_AQT(true, 2);
      else
        FP8MOE_AQT(true, 1);
    } else {
      if (two)
        FP8MOE_AQT(false, 2);
      else
        FP8MOE_AQT(false, 1);
    }
#undef FP8MOE_AQT
    FP8MOE_CUDA_CHECK_LAUNCH();
    return;
  }
  const unsigned blocks = static_cast<unsigned>(ceil_div(int64_t(rows.num_rows) * (I / 8), 256));
  if (h_f32)
    act_quant_group_kernel<true><<<blocks, 256, 0, stream>>>(y1, y1_stride, rows, I, ap, out.q,
                                                             out.q_stride, out.s, out.s_stride,
                                                             spec.ue8m0 ? 1 : 0, spec.min_scale);
  else
    act_quant_group_kernel<false><<<blocks, 256, 0, stream>>>(y1, y1_stride, rows, I, ap, out.q,
                                                              out.q_stride, out.s, out.s_stride,
                                                              spec.ue8m0 ? 1 : 0, spec.min_scale);
  FP8MOE_CUDA_CHECK_LAUNCH();
}

void launch_activation(const void* y1, bool y1_f32, int64_t y1_stride, const RowSet& rows, int I,
                       const ActParams& ap, void* h, bool h_f32, int64_t h_stride,
                       cudaStream_t stream) {
  if (rows.num_rows == 0) return;
  const dim3 grid(rows.num_rows, static_cast<unsigned>(std::min<int64_t>(ceil_div(I, 256), 32)));
#define FP8MOE_ACT(TI, TO)                                                                         \
  activation_kernel<TI, TO><<<grid, 256, 0, stream>>>(static_cast<const TI*>(y1), y1_stride, rows, \
                                                      I, ap, static_cast<TO*>(h), h_stride)
  if (y1_f32) {
    if (h_f32)
      FP8MOE_ACT(float, float);
    else
      FP8MOE_ACT(float, uint16_t);
  } else {
    if (h_f32)
      FP8MOE_ACT(uint16_t, float);
    else
      FP8MOE_ACT(uint16_t, uint16_t);
  }
#undef FP8MOE_ACT
  FP8MOE_CUDA_CHECK_LAUNCH();
}

}  // namespace fp8moe::cuda
