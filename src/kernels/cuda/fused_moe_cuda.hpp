// The CUDA fused FP8 MoE (vLLM's TRITON and BATCHED_TRITON contracts) as fp8moe ExpertsImpls, and
// the CUDA hooks of the library. Plain C++: no CUDA headers, so the registry, the tests and the
// tool can include it. Only built when FP8MOE_WITH_CUDA.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "fp8moe/fused_moe.hpp"

namespace fp8moe::cuda {

// "cuda_fused": the TritonExperts contract (standard activation format).
const ExpertsImpl& fused_impl();
// "cuda_fused_batched": the BatchedTritonExperts contract (batched activation format inside).
const ExpertsImpl& fused_batched_impl();

// 10*major+minor of the current device, 0 without a usable GPU (never throws).
int device_capability();
// cudaDeviceProp::name of the current device ("NVIDIA H200"), "none" without a GPU.
std::string device_name();
// Whether this binary holds machine code for the current device (sm_90a only: capability 9.0).
bool kernels_available();
// Installs the DeviceAllocator (and the capability hook) once. Idempotent.
void install_hooks();

// Which execution path run() takes. kAuto: the tuned table / heuristic.
enum class Path : int {
  kAuto = 0,
  kGeneric = 1,  // route, align, quantise, mma.sync GEMM1, activation, quantise, GEMM2, sum
  // 2 was the persistent decode path (removed: slower than kStream at every measured M)
  kWgmma = 3,   // wgmma + TMA GEMMs for large batches
  kStream = 4,  // small batches: prep, then two weight-streaming mma.sync GEMMs (fused epilogues)
  // sm_90, B128 scheme: the warp-specialised grouped GEMMs of the DEEPGEMM contract
  // (grouped_moe_cuda.cpp) over the same routing, quantisation and activation kernels
  kGrouped = 5,
  // sm_90, decode batches (M <= 8) of the block-FP8 scheme: the whole layer in one persistent
  // cooperative kernel (sm90_fp8_moe_single.cu)
  kSingle = 6,
};
const char* path_name(Path p);
// Forces a path for the following calls in this process (tests, benchmarks); kAuto forces the
// automatic choice (FP8MOE_CUDA_PATH then does not apply). A forced path that cannot run a problem
// throws NotImplementedError from run(). clear_path_override() drops the override: the default,
// where FP8MOE_CUDA_PATH (if set) chooses the path.
void set_path_override(Path p);
void clear_path_override();
Path path_override();
// The path kAuto takes for this problem (after checking each fast path's limits).
Path choose_path(const FusedMoeArgs& args);
// Why a fast path cannot take this problem ("" when it can).
std::string path_limit(Path p, const FusedMoeArgs& args);

// Benchmark hook: while on, run() of the generic and wgmma paths launches only GEMM1 and GEMM2
// over the workspace a previous run() with the same arguments filled (routing, alignment,
// quantisation, activation and the top-k sum are skipped; the stream path skips routing and its
// prep kernel, its GEMM2 still sums the top-k slots). Not for production use.
void set_bench_gemm_only(bool on);

// The batched (masked) activation format of BatchedTritonExperts, for callers that dispatch into
// it themselves (DeepEP low-latency style):
//   x        (E_local, max_tokens, H) bf16/f32     expert_num_tokens (E_local) i32 on the device
//   out      (E_local, max_tokens, H) same dtype   rows >= expert_num_tokens[e] are left untouched
// Computes, per expert e and row r < count[e]: GEMM1 -> activation -> GEMM2 (no router weight;
// the caller's finalize applies it). Scheme, weights and activation come from `args` (its x, out,
// routing and topk fields are ignored). `workspace` holds batched_workspace_size() bytes.
struct BatchedExpertsArgs {
  TensorView x;
  TensorView expert_num_tokens;
  TensorView out;
};
std::size_t batched_workspace_size(const FusedMoeArgs& args, const BatchedExpertsArgs& b);
void run_batched_experts(const FusedMoeArgs& args, const BatchedExpertsArgs& b, void* workspace);

// Test hook: routes every row of `logits` (M, E) f32/bf16 on the GPU with `cfg` (its
// e_score_correction_bias on the GPU too) by the forward's routing kernel (one block per token),
// or with one_warp_per_token by route_token_warp (one warp per token, E <= 512, NotImplementedError
// above; no forward path uses it: run 13 measured it slower than the block routine); `ids` (i32)
// and `weights` (f32) are GPU buffers of M x cfg.topk. Throws ValueError / NotImplementedError for
// what the forward rejects. Synchronous.
void device_route(const TensorView& logits, const RoutingConfig& cfg, int32_t* ids, float* weights,
                  bool one_warp_per_token = false);

// Test hook: on the device, decodes all 256 e4m3fn codes with cuda_fp8.h (decoded256), and for
// each of the n inputs encodes to e4m3fn (saturating) with cuda_fp8.h and with the kernels' own
// conversion, and rounds to bf16 with cuda_bf16.h and with the kernels' conversion. Synchronous;
// allocates (never used by the forward).
void device_codec_check(const float* in_host, int n, float* decoded256, uint8_t* enc_cudafp8,
                        uint8_t* enc_kernel, uint16_t* bf16_cudafp8, uint16_t* bf16_kernel);

}  // namespace fp8moe::cuda
