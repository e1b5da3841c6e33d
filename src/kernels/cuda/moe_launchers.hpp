// Host launchers of the generic-path kernels (one .cu each, same stem as the kernel's .cuh). All
// are asynchronous on `stream`, allocate nothing and check the launch. Plain C++ (no device code).
#pragma once

#include <cuda_runtime_api.h>

#include "moe_params.hpp"

namespace fp8moe::cuda {

void launch_route(const RoutingParams& rp, int M, int E, int topk, int32_t* ids, float* w,
                  cudaStream_t stream);

// Scratch of the many-block alignment (AlignOut::scratch) for num_valid pairs and E_local experts.
std::size_t align_scratch_bytes(int64_t num_valid, int64_t E_local);
// With out.scratch, from split_min pairs on (< 0: the default, FP8MOE_ALIGN_SPLIT_MIN or 8192) the
// alignment runs on many blocks (three kernels) instead of one; the tables are the same and every
// expert holds the same pairs (their order within an expert follows the atomics in both).
void launch_align(const int32_t* topk_ids, int num_valid, const int32_t* expert_map, int E_global,
                  int E_local, int bm, int capacity, int fixed_stride, const AlignOut& out,
                  cudaStream_t stream, int64_t split_min = -1);

void launch_batched_rows(const int32_t* counts, int E_local, int T, int T_pad, int bm,
                         const AlignOut& out, cudaStream_t stream);

// Whether launch_quant's per-token / per-tensor kernels for these rows take 8 or 16 columns per
// thread (16-byte aligned source rows, 8-byte aligned code rows, cols % 8 == 0) or one.
bool quant_rows_vectorised(const void* src, bool src_f32, int64_t src_stride, int cols,
                           const uint8_t* q, int64_t q_stride);
void launch_quant(const QuantSpec& spec, const void* src, bool src_f32, int64_t src_stride,
                  const RowSet& rows, const RowScale& rs, int cols, const QuantOut& out,
                  cudaStream_t stream);
// Dynamic 1 x gk group quantisation of the M token rows of src into the sorted layout: token t's
// q and scales go to the rows pair_pos[t * topk + k] (>= 0) of out (AlignOut::pair_pos).
void launch_quant_scatter(const QuantSpec& spec, const void* src, bool src_f32, int64_t src_stride,
                          int M, int topk, const int32_t* pair_pos, const RowScale& rs, int cols,
                          const QuantOut& out, cudaStream_t stream);

void launch_activation(const void* y1, bool y1_f32, int64_t y1_stride, const RowSet& rows, int I,
                       const ActParams& ap, void* h, bool h_f32, int64_t h_stride,
                       cudaStream_t stream);
// launch_activation (bf16 y1, gated with gate | up halves; h bf16, or f32 when h_f32) followed by
// launch_quant of h with `spec`, in one kernel that never writes h: dynamic 1 x 128 groups,
// per-token dynamic or static per-tensor scales (act_quant_fusable says which).
bool act_quant_fusable(const QuantSpec& spec, int I, const ActParams& ap);
void launch_act_quant(const uint16_t* y1, int64_t y1_stride, const RowSet& rows, int I,
                      const ActParams& ap, bool h_f32, const QuantSpec& spec, const QuantOut& out,
                      cudaStream_t stream);

// Tile size along K of the generic GEMM for a scheme (min(128, bk, gk) for block schemes).
int gemm_mma_bk(const GemmArgs& a);
void launch_gemm_mma(const GemmArgs& a, int capacity, cudaStream_t stream);

// wgmma grouped GEMM (sm_90a): GEMM1 with the fused activation + quantisation epilogue, or GEMM2
// with bias, router weight and the scatter to (token, slot) rows. `tm_w` is the weight tensor map
// (make_weight_tma_wgmma).
void launch_gemm_wgmma(const WgArgs& a, bool gemm2, int capacity, cudaStream_t stream);

// Before a grouped GEMM2 with the fused top-k sum (GroupedGemmParams::sum_out): zeroes the
// (M, n_tiles) counters and writes zeros to the bf16 out rows of tokens without a local slot.
void launch_fused_sum_prep(const int32_t* topk_ids, const int32_t* expert_map, int E_global,
                           int E_local, int M, int topk, int H, int n_tiles, int32_t* cnt,
                           uint16_t* out, cudaStream_t stream);
// Whether launch_moe_sum takes the 16-byte kernel (H % 8 == 0, topk <= 32, aligned y2 and out).
bool moe_sum_vectorised(const void* y2, const void* out, int H, int topk);
void launch_moe_sum(const void* y2, bool y2_f32, const int32_t* topk_ids, const int32_t* expert_map,
                    int E_global, int E_local, int M, int topk, int H, void* out, bool out_f32,
                    cudaStream_t stream);

}  // namespace fp8moe::cuda
