// The DEEPGEMM-contract experts on Hopper as fp8moe ExpertsImpls (plain C++, no CUDA headers):
//   "cuda_grouped"         TritonOrDeepGemmExperts' DeepGEMM side (standard format): route (when
//                          logits are given), permute the (token, slot) pairs into per-expert
//                          chunks aligned to 128 rows, quantise x (1 x 128) into that order,
//                          grouped GEMM1, activation, quantise (1 x 128), grouped GEMM2 with the
//                          router weight and the scatter back to (token, slot) rows, top-k sum.
//   "cuda_grouped_masked"  BatchedDeepGemmExperts (batched format: x (E, max_m, H) with
//                          expert_num_tokens on the device): the same chain over the masked slabs;
//                          rows past each expert's count are neither computed nor written.
// Both take the B128 scheme only (128 x 128 weight blocks, 1 x 128 dynamic activation groups, bf16
// activations, gated activation with packed gate/up) with H and I multiples of 128, and run on
// sm_90 only (wgmma + TMA, sm90_fp8_grouped_gemm.cuh). No host synchronisation, no allocation:
// graph-capturable.
#pragma once

#include <cstddef>
#include <string>

#include "fp8moe/fused_moe.hpp"

namespace fp8moe::cuda {

struct MoeProblem;  // moe_problem.hpp

// Tokens per chunk of the grouped path: larger batches run chunk by chunk (bounds the workspace).
constexpr int64_t kGroupedChunkTokens = 16384;

const ExpertsImpl& grouped_impl();
const ExpertsImpl& grouped_masked_impl();

// Why the grouped kernels cannot compute args ("" when they can); never throws.
std::string grouped_limit(const FusedMoeArgs& args);

// The same for a standard-format problem already checked by make_problem (cuda_fused's grouped
// path, which builds the problem once per call), its workspace, and its run (what grouped_impl()'s
// workspace_size / run do after make_problem and the contract check). Beyond the B128 contract,
// this path also takes one weight scale per expert (per-tensor) with per-token or per-tensor
// (static or dynamic) activation scales: the same kernels with zero scale strides.
std::string grouped_problem_limit(const MoeProblem& p);
// How the grouped path would run p, in one line for describe_call (the m-block and kernel, each
// GEMM's tile, which small kernels run or are fused, per the rules and the opt-in variables now).
// Reads no tensor data; does not check the limits (grouped_problem_limit).
std::string grouped_problem_plan(const MoeProblem& p);
// The top-k sum fused into GEMM2 (GroupedGemmParams::sum_out; opt-in FP8MOE_GROUPED_FUSED_SUM=1:
// bitwise the sum kernel on the card, but measured 1.2-5.1x slower with a fence in every thread
// after every tile, docs/PERFORMANCE.md grouped run 13; the acq_rel counting since then not yet
// measured; to be deleted unless it wins): GEMM2 on the swapped kernels, or on 128-row m-blocks
// with the 128 x 256 tile (H % 256 == 0), with bf16 y2 and out: no launch_moe_sum and no y2 round
// trip through HBM. set_grouped_fused_sum_override(0 / 1) wins over the variable (tests), -1 clears
// it.
bool grouped_fused_sum_wanted(const MoeProblem& p, int64_t bm);
void set_grouped_fused_sum_override(int v);
std::size_t grouped_problem_workspace(const MoeProblem& p);
void run_grouped_problem(const MoeProblem& p, void* workspace);

// vLLM's _valid_deep_gemm shape rule of TritonOrDeepGemmExperts (spec/oracle.md): DeepGEMM runs
// when align <= M, N % align == 0, K % align == 0 and N > 512 (align = 128; M = tokens, K = H,
// N = I); otherwise the call falls back to the Triton kernel ("cuda_fused").
bool deep_gemm_shape_ok(int64_t M, int64_t N, int64_t K);

}  // namespace fp8moe::cuda
