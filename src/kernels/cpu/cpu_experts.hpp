// fp8moe's CPU experts: the implementations behind vLLM's CPU backends.
//
//   cpu_w8a16  (backend CPU, CPUExpertsFp8, fp8_w8a16 quant config): activations stay bf16/f32;
//              fp8 weights are decoded in registers and their scales applied per K-block:
//                y[n] = sum_kb  s_w[n, kb] * sum_{k in kb} x[k] * q_w[n, k]      (f32)
//              per-tensor / per-channel weights: y[n] = s_w[n] * sum_k x[k] q_w[n, k].
//   cpu_w8a8   (backend CPU_W8A8, fp8_w8a8 quant config): activations quantised dynamically per
//              1 x group_k group (or per token / per tensor, static or dynamic), products of e4m3
//              values exact, block scales applied per K-block as the Triton kernel does:
//                y[n] = sum_kb (sum_{k in kb} q_a[k] q_w[n, k]) * s_a[kb] * s_w[n, kb]  (f32)
//
// Both then follow the reference (kernels/ref/ref.hpp) step for step: + bias, round to the compute
// dtype (bf16 for bf16 x, f32 for f32 x), the activation with its rounding points
// (numerics/activation.hpp), [quantise h], GEMM2, + bias, times the router weight in f32 before the
// rounding, and an f32 sum over the top-k slots in slot order with one final rounding. Routing
// (when the call carries router logits) is numerics::route_row, the reference's own.
//
// Execution: route -> group the (token, slot) pairs by expert (cpu_moe_align.hpp) -> quantise x
// once per token -> GEMM1 work items (expert, h-column tile, row block) with the activation and the
// second quantisation fused in their epilogue -> GEMM2 work items (expert, hidden tile, row block)
// -> per-token sum. OpenMP threads take work items dynamically; every item writes disjoint outputs
// computed in an order that does not depend on the thread, so results are bitwise identical run to
// run and for every thread count. All scratch memory comes from the caller's workspace
// (workspace_size); run() allocates nothing.
#pragma once

#include <cstddef>
#include <optional>

#include "fp8moe/config.hpp"
#include "fp8moe/fused_moe.hpp"
#include "fp8moe/quant_key.hpp"

namespace fp8moe::cpu {

const ExpertsImpl& cpu_w8a16_experts_impl();  // name "cpu_w8a16"
const ExpertsImpl& cpu_w8a8_experts_impl();   // name "cpu_w8a8"

// The support queries of the two implementations (also reachable through the ExpertsImpl).
Support cpu_w8a16_supports_config(const MoeConfig& config,
                                  const std::optional<QuantKey>& weight_key,
                                  const std::optional<QuantKey>& activation_key);
Support cpu_w8a8_supports_config(const MoeConfig& config, const std::optional<QuantKey>& weight_key,
                                 const std::optional<QuantKey>& activation_key);

// Whether a concrete call is within what the kernel computes (scheme, sizes, dtypes), with the
// reason when not. run() throws NotImplementedError with this reason; ValueError for malformed
// arguments (validate_fused_moe_args).
Support cpu_supports_args(const FusedMoeArgs& args, bool w8a8);

// The maximum number of OpenMP threads a run uses (the workspace holds per-thread scratch for this
// many): omp_get_num_procs() of the process. run() uses min(omp_get_max_threads(), this).
int cpu_max_threads();

}  // namespace fp8moe::cpu
