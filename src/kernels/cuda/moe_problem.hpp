// The fused MoE call as the CUDA paths see it: FusedMoeArgs checked and flattened into sizes,
// kernel-side scale/activation descriptors and raw pointers (MoeProblem), and the workspace layout
// of one token chunk (Workspace). Shared by every path's host code.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include <cuda_runtime_api.h>

#include "fp8moe/fused_moe.hpp"
#include "moe_params.hpp"

namespace fp8moe::cuda {

// Tokens per chunk: larger batches run chunk by chunk, so the workspace stays bounded (vLLM's
// VLLM_FUSED_MOE_CHUNK_SIZE plays the same role).
constexpr int64_t kTokenChunk = 8192;

struct MoeProblem {
  int64_t M = 0, H = 0, I = 0, N1 = 0, E = 0, E_global = 0, topk = 0;
  bool x_f32 = false;  // f32 activations: intermediates are f32 too
  bool gated = true;
  bool router_on_input = false;
  bool route_in_kernel = false;
  // FusedMoeArgs::batch_invariant: a token's bits do not depend on M (the grouped path, or the
  // generic one, at every M; no tuned table)
  bool batch_invariant = false;
  const void* x = nullptr;
  void* out = nullptr;
  const int32_t* topk_ids = nullptr;  // when routing is given
  const float* topk_w = nullptr;
  const int32_t* expert_map = nullptr;
  RoutingParams rp{};
  WeightSide w1{}, w2{};
  AQuant aq1 = AQuant::kGroupDynamic;  // GEMM1 input
  AQuant aq2 = AQuant::kGroupDynamic;  // GEMM2 input (the intermediate)
  int gk = 128;
  bool ue8m0 = false;
  bool fused_silu_quant = false;
  const float* a13_scale = nullptr;
  const float* a2_scale = nullptr;
  ActParams ap{};
  cudaStream_t stream = nullptr;
  std::string scheme;  // MoeScheme::str(), the tuning table's key
  // The grouped path's swapped kernels: n-blocks per tile from the tuning table (0 = the kernels'
  // rule; GroupedGemmParams::swap_nb).
  int swap_nb = 0;

  // scale columns per activation row (group: cols / gk; token: 1; tensor: 0)
  int64_t a_scale_cols(int64_t cols, AQuant q) const {
    return q == AQuant::kGroupDynamic ? cols / gk : (q == AQuant::kTokenDynamic ? 1 : 0);
  }
  // The quantiser of GEMM1's input (second = false: x) or GEMM2's (second = true: h), as every
  // path applies it: the scheme's kind and group size, UE8M0 scales, the fused SiLU+quant scale
  // floor (h only), the checkpoint's static scale, and amax scratch for dynamic per-tensor.
  QuantSpec act_quant(bool second, unsigned* amax) const {
    QuantSpec q;
    q.kind = second ? aq2 : aq1;
    q.gk = gk;
    q.ue8m0 = ue8m0;
    q.min_scale = second && fused_silu_quant ? 1.0f / (kFp8Max * 512.0f) : 0.0f;
    q.static_scale = second ? a2_scale : a13_scale;
    q.amax_ws = amax;
    return q;
  }
};

// The routing kernel's parameters for `logits` (M, E) f32/bf16 with `r` (make_problem's checks
// and method mapping: E <= 1024, 1 <= topk <= min(32, E), the method's bias and groups).
RoutingParams routing_params(const TensorView& logits, const RoutingConfig& r);

// Checks args (beyond validate_fused_moe_args: what this implementation computes) and flattens
// them. Throws ValueError / NotImplementedError naming the problem.
MoeProblem make_problem(const FusedMoeArgs& args);
// Why this implementation cannot compute args ("" when it can); never throws.
std::string problem_unsupported(const FusedMoeArgs& args);

// Carves a workspace into consecutive 256-byte aligned regions; take(n) returns the offset of the
// next region of n bytes (at least min_bytes, so that with min_bytes = 1 every region is distinct).
struct WorkspaceCarver {
  std::size_t off = 0;
  std::size_t min_bytes = 0;
  std::size_t take(std::size_t bytes) {
    const std::size_t at = off;
    off += ((bytes > min_bytes ? bytes : min_bytes) + 255) / 256 * 256;
    return at;
  }
};

// Workspace of one chunk of `m` tokens with M tiles of `bm` rows (generic and wgmma paths).
struct Workspace {
  int64_t m = 0, bm = 64, capacity = 0;
  int fixed_stride = 0;  // > 0: batched layout (rows per expert)
  std::size_t ids = 0, tw = 0, sorted = 0, blk = 0, meta = 0, cnt = 0, eoff = 0, qx = 0, sx = 0,
              y1 = 0, h = 0, qh = 0, sh = 0, y2 = 0, amax = 0, total = 0;
  std::size_t qxs = 0, sxs = 0;  // x quantised in the sorted layout (wgmma, grouped; then qx, sx
                                 // and h are empty, unless keep_h)
  std::size_t ppos = 0;          // sorted position of each pair (AlignOut::pair_pos)
  std::size_t align = 0;         // the many-block alignment's scratch (AlignOut::scratch)
  std::size_t sumc = 0;          // the fused top-k sum's counters (grouped: m x H / 128)
};
// keep_h: an h buffer even with sorted_x (the grouped path with per-token / per-tensor h scales).
Workspace workspace_layout(const MoeProblem& p, int64_t m, int64_t bm, bool batched = false,
                           bool sorted_x = false, bool keep_h = false);

}  // namespace fp8moe::cuda
