// The Hopper FP8 grouped GEMM of the DEEPGEMM contract (sm90_fp8_grouped_gemm.cuh), as the host
// sees it: plain structs and the launcher. No CUDA device code here.
//
//   out[row, n] = bf16( (sum_kb a_scale[row, kb] * b_scale[e, n / 128, kb] * (A[row, kb] . B[e, n,
//   kb]) + bias[e, n]) * row_weight )
//
// A: fp8 e4m3 rows (a_rows, K), row-major; B: fp8 e4m3 (E * N, K) (K-major weights); 1 x 128
// activation scales (a_rows, K / 128) f32; 128 x 128 weight scales (E, N / 128, K / 128) f32.
// Per-token (a_rows) or per-tensor (1) activation scales and per-expert weight scales (E) run
// through the same promotion with zero strides (a_scale_kb, b_scale_kb, ...): the partial sum of
// each 128-wide K block times the same scale product (the cuda_fused grouped path for per-tensor
// schemes; the DEEPGEMM contract itself stays 1 x 128 / 128 x 128).
// Two layouts of A's rows:
//   contiguous  rows of each expert form a chunk aligned to 128 rows (moe_align with bm = 128):
//               expert_blk[mb] is the expert of rows [128 mb, 128 mb + 128), *num_rows_ptr the
//               padded row count (on the device); padding rows have sorted_ids[row] >= num_valid
//               and are neither computed into the output nor stored.
//   masked      expert e owns rows [e * max_m, e * max_m + counts[e]) (counts on the device);
//               rows past the count are not stored.
// Everything stays on the device (no host synchronisation): graph-capturable.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "moe_params.hpp"

namespace fp8moe::cuda {

struct GroupedGemmParams {
  int32_t masked = 0;
  // Rows per m-block: 128 (two consumer warpgroups x 64 rows, tokens as wgmma's M operand) or
  // 16 / 32 / 64 (swapped operands for few rows per expert: weights as M, tokens as N). The
  // contiguous layout's expert chunks must be aligned to it.
  int32_t tile_m = 128;
  // 128-row kernel only: -1 = FP8MOE_GROUPED_MCAST (default off), 0 = no clusters, 1 = two-CTA
  // clusters multicasting the A tile to adjacent n-blocks (when the tile width's n-block count is
  // even; not with fuse_act): grouped_cluster_ctas.
  int32_t mcast = -1;
  // 128-row kernel only: output tile width. 0 = FP8MOE_GROUPED_TILE_N (128 or 256) when set, else
  // 256; 128 or 256 forces it. 256 needs N % 256 == 0 and falls back to 128 otherwise.
  int32_t tile_n = 0;
  // Most CTAs of the persistent grid (0 = one per SM). Tests set a few so that every CTA walks many
  // tiles (the shared-memory rings and their phases wrap around).
  int32_t max_ctas = 0;
  // m-blocks per scheduling group of the tile order (n-blocks inside a group); 0 = 8.
  int32_t group_m = 0;
  // Swapped kernels (tile_m 16 / 32 / 64): 128-row n-blocks per tile. 0 = FP8MOE_GROUPED_SWAP_NB
  // when set, else the rule of grouped_swap_nb; 1, 2 or 4 ask for that many where it applies.
  int32_t swap_nb = 0;
  int32_t N = 0, K = 0;  // multiples of 128
  int64_t a_rows = 0;    // rows of A (and of a_scale)
  // contiguous layout
  const int32_t* expert_blk = nullptr;
  const int32_t* num_rows_ptr = nullptr;
  const int32_t* sorted_ids = nullptr;  // optional (all rows valid when null)
  int32_t num_valid = 0;
  // masked layout
  const int32_t* counts = nullptr;
  int32_t E = 0;
  int32_t max_m = 0;
  // scales, bias
  const float* a_scale = nullptr;
  int64_t a_scale_stride = 0;  // floats per A row (K / 128; 1 per-token, 0 per-tensor)
  int32_t a_scale_kb = 1;      // floats per 128-wide K block (1; 0 per-token / per-tensor)
  const float* b_scale = nullptr;
  int64_t b_scale_e_stride = 0;  // floats per expert
  int64_t b_scale_n_stride = 0;  // floats per 128-row block of N (0 per-tensor)
  int32_t b_scale_kb = 1;        // floats per 128-wide K block (1; 0 per-tensor)
  const void* bias = nullptr;    // (E, N) f32 or bf16, optional
  int32_t bias_bf16 = 0;
  // output (bf16)
  uint16_t* out = nullptr;
  int64_t out_stride = 0;   // elements per output row
  int32_t out_scatter = 0;  // contiguous only: output row = sorted_ids[row] instead of row
  const float* row_weight = nullptr;  // contiguous only: times row_weight[sorted_ids[row]]
  // GEMM1 with the gated activation and the 1 x 128 quantisation of h fused into the epilogue
  // (128-row kernel with the 256 tile; no scatter, no row weight): tile nt's two B halves are the
  // gate rows [128 nt, 128 nt + 128) and the up rows [N/2 + 128 nt, ...) of the expert's packed
  // w13 (N = 2 I); y1 = bf16(acc + bias), h = act(gate, up) (rounded to bf16 unless act_h_f32),
  // then per row and 128 h-columns s = group_scale(amax), q = e4m3(h / s): the same operations as
  // the unfused GEMM1 -> launch_activation -> launch_quant chain. Writes q_out (rows, I) and
  // q_scale (rows, I / 128) of the stored rows instead of `out`.
  int32_t fuse_act = 0;
  ActParams act;
  int32_t act_h_f32 = 0;
  int32_t q_ue8m0 = 0;
  float q_min_scale = 0.0f;
  uint8_t* q_out = nullptr;
  int64_t q_stride = 0;  // bytes per row
  float* q_scale = nullptr;
  int64_t q_scale_stride = 0;  // floats per row
  // 128 x 256 tile only: the asynchronous epilogue (the output staged in shared memory, one bulk
  // copy per row, drained under the next tile's K blocks; 3 stages instead of 4). -1 =
  // FP8MOE_GROUPED_EPI ("async" / "sync") when set, else async for K <= 512 only; 0 / 1
  // force it. Not with fuse_act; needs a 16-byte aligned out and out_stride % 8 == 0 (else sync).
  // (Last member: the kernels that do not read it keep their parameter offsets.)
  int32_t epi_async = -1;
  // The top-k sum fused into GEMM2 (opt-in FP8MOE_GROUPED_FUSED_SUM; the swapped kernels or the
  // 128 x 256 tile with the sync epilogue, contiguous layout, scatter to pair rows t * topk +
  // slot, bf16 out): after a tile has stored its rows of `out` (y2), each row's token counts its
  // n-tile done (sum_cnt[t * N / c + nt], c = grouped_sum_cols, zeroed before the launch:
  // launch_fused_sum_prep); the tile that completes a token's local slots sums them in slot order
  // in fp32 from L2, rounds once to bf16 into sum_out (t, the n-tile's c columns; the operations
  // of launch_moe_sum, so the same bits) and discards the y2 lines it read. The host orders the
  // tiles n-tile-major (group_m >= the m-blocks) so that one n-tile's y2 rows are in L2 when their
  // tokens complete. (After epi_async: the kernels that do not read these keep their parameter
  // offsets.)
  uint16_t* sum_out = nullptr;  // (tokens, N) bf16; null: no fused sum
  int32_t* sum_cnt = nullptr;
  const int32_t* sum_ids = nullptr;  // (tokens, topk) expert ids of the routing
  const int32_t* sum_map = nullptr;  // expert map (EP) or null
  int32_t sum_E_global = 0, sum_E_local = 0, sum_topk = 0;
  // (A ping-pong 64 x 256 kernel, each consumer warpgroup on its own tiles, ran 7% faster GEMM-only
  // on K = 256 but no faster in the layer: removed after grouped run 9; commit 8230222 has it.)
};

// Most experts the masked scheduler handles (its prefix table lives in shared memory).
constexpr int kGroupedMaxExperts = 1024;

// Launches the persistent kernel. `a` (a_rows, K) and `b` (b_rows, K) fp8; `max_m_blocks` a host
// upper bound of the 128-row blocks (sizes the grid; tiles are counted on the device).
void launch_grouped_gemm(const GroupedGemmParams& p, const uint8_t* a, const uint8_t* b,
                         int64_t b_rows, int64_t max_m_blocks, cudaStream_t stream);

// Masked layout helper: ids[p] = p for rows p = e * max_m + i with i < counts[e], else E * max_m
// (the sentinel of RowSet), and meta[0] = E * max_m. Lets the shared quantisation and activation
// kernels visit only the valid rows.
void launch_masked_rows(const int32_t* counts, int E, int max_m, int32_t* ids, int32_t* meta,
                        cudaStream_t stream);

// How many two-CTA clusters of the opt-in cluster kernels (FP8MOE_GROUPED_MCAST) of the 128 x
// tile_n tile the device holds at once (cudaOccupancyMaxActiveClusters); the persistent grid asks
// for sm_count / 2.
int grouped_cluster_occupancy(int tile_n);

// CTAs per cluster the 128-row kernel runs p with: 2 (the A tile multicast to two CTAs on adjacent
// n-blocks) when asked for (p.mcast = 1, or -1 with FP8MOE_GROUPED_MCAST=1), the n-blocks of the
// tile width pair up and the fused activation is off; else 1.
int grouped_cluster_ctas(const GroupedGemmParams& p);

// The output tile width the 128-row kernel runs p with (128 or 256; see GroupedGemmParams::tile_n).
int grouped_tile_n(const GroupedGemmParams& p);

// Whether the 128 x 256 tile runs p with the asynchronous epilogue (see
// GroupedGemmParams::epi_async); false for the other kernels.
bool grouped_epi_async(const GroupedGemmParams& p);

// The n-blocks per tile the swapped kernel runs p with (1, 2 or 4; see
// GroupedGemmParams::swap_nb). More than 1 needs short K (K <= 1024: one scale chunk), N a multiple
// of 128 times it, and tile_m 16 (2 or 4) or 32 / 64 (2); else 1. The rule (swap_nb 0, no
// environment): 4 for K <= 256, 2 for K <= 512, else 1 (then reduced as above).
int grouped_swap_nb(const GroupedGemmParams& p);

// The m-block of the swapped-operand kernel for `rows_per_expert` rows per expert on average
// (16, 32, 64; 128 above 64 rows).
int grouped_tile_m(double rows_per_expert);

// Output columns per tile of the kernel p runs, the fused top-k sum's n-tile (GroupedGemmParams::
// sum_cnt holds N / this counters per token): 256 (the 128 x 256 tile), 128 x the n-blocks per
// swapped tile, else 128.
int grouped_sum_cols(const GroupedGemmParams& p);

// Shared-memory bytes and threads of the kernel (for reports).
int grouped_gemm_smem_bytes();

}  // namespace fp8moe::cuda
