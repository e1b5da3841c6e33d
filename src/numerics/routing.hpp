// Top-k routing for every RoutingMethodType (spec/numerics.md §1), computed in float32 like
// vLLM's kernels. Shared by the reference and the CPU kernels.
//
// What each method computes (scores s from the logits l cast to float):
//   Default           s = softmax(l); top-k of s; w = s[ids]                      (fused_topk)
//   Renormalize       top-k of l; w = softmax over the k selected logits        (TopK -> Softmax)
//   RenormalizeNaive  s = softmax(l); top-k of s; w = s[ids] / sum              (Qwen3)
//   Sigmoid           s = sigmoid(l); top-k; w = s[ids]
//   SigmoidRenorm     s = sigmoid(l); top-k; w = s[ids] / sum
//   TopK              top-k of l; w = l[ids] (no softmax; TRT-LLM's "TopK only")
//   Llama4            top-k of l; w = sigmoid(l[ids])                           (top1 -> sigmoid)
//   MiniMax2          s = sigmoid(l); top-k of s + bias; w = s[ids] / (sum + 1e-20) * rsf
//   DeepSeekV3        grouped_topk with sigmoid scores (below)
//   DeepseekV4        s = sqrt(softplus(l)); top-k of s + bias; w = s[ids] / max(sum, 1e-20) * rsf
//   Unspecified       vLLM's router choice from the fields: num_expert_group > 0 -> grouped_topk;
//                     an e_score_correction_bias -> fused_topk_bias(scoring_func, renormalize)
//                     * rsf; otherwise fused_topk(scoring_func, renormalize) (no scaling)
//   Custom, Simulated NotImplementedError (they need a user function / a simulator)
// grouped_topk (DeepSeek-V2/V3; GroupedTopKRouter): s' = s + bias (if any); group score = sum of
// the two largest s' in each contiguous group of E / num_expert_group experts (max of s without a
// bias); keep the topk_group best groups; top-k of s' inside them; w = s[ids] (unbiased with a
// bias); renormalise by (sum + 1e-20) when vLLM's fused CUDA kernel would run (bias present,
// num_expert_group <= 32, topk <= 32; VLLM_USE_FUSED_MOE_GROUPED_TOPK's default), else by sum;
// times routed_scaling_factor. With E <= num_expert_group or E % num_expert_group != 0 vLLM falls
// back to fused_topk_bias / fused_topk, and so does fp8moe.
//
// Conventions fp8moe fixes where vLLM's implementations may differ:
//   * ties go to the lower expert index (and, between groups, to the lower group index), as the
//     CUDA topk kernels break them; torch.topk does not promise an order on ties;
//   * scores that are not finite become 0 before selection (vLLM #39391 in topk_softmax /
//     topk_sigmoid: all-NaN rows then pick experts 0..k-1 with weight 0, never duplicates).
//     Softmax takes its max with fmaxf, so one NaN logit makes the whole row NaN -> all zero, and
//     a +inf logit does the same (inf - inf); -inf logits just get probability 0. fp8moe applies
//     the same rule to every method (the grouped kernel's NaN behaviour is unspecified in vLLM);
//   * a renormalisation whose sum is <= 0 divides by 1 (the weights stay 0);
//   * routed_scaling_factor applies only where vLLM applies it (DeepSeekV3/grouped, MiniMax2,
//     DeepseekV4, bias routing); the plain fused_topk methods ignore it.
#pragma once

#include <cstdint>

#include "fp8moe/fused_moe.hpp"
#include "fp8moe/tensor.hpp"

namespace fp8moe::numerics {

struct RoutingResult {
  Tensor topk_ids;      // (M, topk) i32, global expert ids
  Tensor topk_weights;  // (M, topk) f32
};

// Routes every row of `logits` (M, E) f32/bf16 with `cfg` (cfg.e_score_correction_bias: (E) f32
// or bf16, for the methods that use one). Throws ValueError on bad shapes or parameters
// (topk > E, groups that do not fit, a bias where the method takes none).
RoutingResult route(const TensorView& logits, const RoutingConfig& cfg);

// One row: `logits` E floats, `bias` E floats or nullptr; writes topk ids and weights.
// Call check_routing_config once before routing rows with it.
void route_row(const float* logits, int64_t E, const RoutingConfig& cfg, const float* bias,
               int32_t* ids, float* weights);
void check_routing_config(const RoutingConfig& cfg, int64_t E);

}  // namespace fp8moe::numerics
