// Expert-parallel MoE forward: dispatch each token to the ranks that own its experts, compute with
// the local experts kernel, return the partial outputs and reduce them in the original token order.
//
//   rank r: route (or take topk ids) -> for each token, the ranks owning any of its top-k experts
//        -> all-to-all of (x row, topk ids masked to that rank's experts, topk weights)
//        -> local experts kernel on the received rows (standard format with the rank's expert map,
//           or the batched/masked format: one slab of rows per local expert)
//        -> all-to-all of the partial output rows back -> out[t] = sum over ranks, in rank order
//
// A token is sent once to each rank that owns at least one of its experts (not once per slot), as
// DeepEP does. Partial outputs come back in f32 when the local kernel can produce them
// (ExpertsImpl::f32_partial_out) and are rounded once after the sum over ranks, so exact-mode
// problems equal the single-rank result bit for bit; otherwise they travel in x's dtype (one more
// bf16 rounding, as DeepEP's bf16 combine; statistical agreement). Ranks with zero tokens, uneven
// expert counts per rank and -1 (padded) expert ids are all handled; every rank must call the
// collective. Known limit: per-tensor *dynamic* activation scales are computed over the rows each
// rank receives, not over the global batch (pitfalls.md 11); per-token and per-group schemes are
// unaffected.
#pragma once

#include <cstdint>
#include <vector>

#include "fp8moe/fused_moe.hpp"
#include "fp8moe/parallel.hpp"

namespace fp8moe {

// Where every global expert lives: owner rank and index among that rank's local experts.
struct EpLayout {
  int ep_size = 1;
  std::vector<int32_t> owner;        // (E) rank that holds expert e
  std::vector<int32_t> local_index;  // (E) index of e on its owner
  int num_experts() const { return static_cast<int>(owner.size()); }
  int num_local(int rank) const;
  // (E) i32 global -> local index on `rank`, -1 for experts of other ranks.
  std::vector<int32_t> expert_map(int rank) const;
  // Contiguous balanced placement (vLLM's linear strategy): the first E % ep ranks hold one more.
  static EpLayout linear(int num_experts, int ep_size);
  // Expert e on rank e % ep (vLLM's round-robin strategy).
  static EpLayout round_robin(int num_experts, int ep_size);
};

enum class EpExpertsFormat : uint8_t {
  kStandard,  // (R, H) rows + topk ids/weights + expert map (TRITON, DEEPGEMM, CPU, ...)
  kBatched,   // (E_local, max_m, H) slabs + expert_num_tokens (BATCHED_TRITON, BATCHED_DEEPGEMM)
};

struct EpMoeArgs {
  TensorView x;              // (M_r, H) bf16/f32: this rank's tokens (M_r may be 0)
  TensorView router_logits;  // (M_r, E) when topk_ids is absent
  TensorView topk_ids;       // (M_r, topk) i32 global ids, -1 = padded slot
  TensorView topk_weights;   // (M_r, topk) f32
  RoutingConfig routing{};
  ExpertWeights weights{};  // this rank's local experts
  MoeScheme scheme{};
  ActivationConfig act{};
  bool apply_router_weight_on_input = false;
  bool batch_invariant = false;  // FusedMoeArgs::batch_invariant for the local experts
  TensorView out;                // (M_r, H), dtype of x
};

// Timings of the last call, for `fp8moe bench --ep` (host wall clock, seconds).
struct EpMoeStats {
  double dispatch_s = 0;  // routing, packing and the dispatch all-to-alls
  double compute_s = 0;   // local experts kernel
  double combine_s = 0;   // the return all-to-all and the reduction
  int64_t rows_sent = 0;  // token rows this rank dispatched (to itself included)
  int64_t rows_received = 0;
};

// Runs one EP forward on this rank. x, router_logits / topk ids and weights, and out are host
// tensors with any communicator: routing, packing and the reduction run on the host, the
// collectives go through all_to_all_v_host (staged through device memory for NCCL), and a device
// kernel (weights on a GPU) gets its rows staged to the weights' device. Throws ValueError for
// inconsistent arguments (after taking part in the collectives, so no peer hangs).
EpMoeStats ep_moe_forward(Communicator& comm, const ExpertsImpl& local_experts,
                          EpExpertsFormat format, const EpLayout& layout, const EpMoeArgs& args);

}  // namespace fp8moe
