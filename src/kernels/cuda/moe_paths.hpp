// The fast paths of the CUDA fused MoE, as the dispatcher (fused_moe_cuda.cu) sees them: a limit
// check ("" = can run), a preference (the tuned table / heuristic), the workspace, the run.
#pragma once

#include <cstddef>
#include <string>

#include "moe_problem.hpp"

namespace fp8moe::cuda {

// wgmma + TMA grouped GEMMs for large batches (sm90_fp8_moe_gemm_wgmma.cu).
std::string wgmma_path_limit(const MoeProblem& p);
bool wgmma_path_preferred(const MoeProblem& p);
std::size_t wgmma_workspace(const MoeProblem& p);
void run_wgmma(const MoeProblem& p, void* workspace);

// Weight streaming into registers + mma.sync for small batches (sm89_fp8_moe_stream.cu).
// gemm_only: launch only GEMM1 and GEMM2 over a workspace a previous run filled (benchmark hook).
std::string stream_path_limit(const MoeProblem& p);
bool stream_path_preferred(const MoeProblem& p);
std::size_t stream_workspace(const MoeProblem& p);
void run_stream(const MoeProblem& p, void* workspace, bool gemm_only);

// The whole layer of a decode batch (M <= 8, block FP8) in one persistent cooperative kernel:
// bulk-copy weight ring, grid-wide waits only for the routing and for GEMM1
// (sm90_fp8_moe_single.cu).
std::string single_path_limit(const MoeProblem& p);
// The same without the device checks (sm_90, cooperative launch): host code on any machine.
std::string single_problem_limit(const MoeProblem& p);
std::size_t single_workspace(const MoeProblem& p);
void run_single(const MoeProblem& p, void* workspace);

}  // namespace fp8moe::cuda
