// The fused MoE call: what every experts kernel (the float64 reference, the CPU kernels, the CUDA
// kernels) computes, described once. A kernel receives FusedMoeArgs and writes `out`.
//
//   route (or take topk ids/weights) -> quantise x -> GEMM1 (w13) -> activation -> quantise
//   -> GEMM2 (w2) -> multiply by the router weight -> sum over the top-k slots
//
// Layouts (vLLM's canonical layout, before any backend-specific conversion). Standard format:
//   x              (M, H) bf16 or f32
//   router_logits  (M, E_global) f32 or bf16
//   topk_ids       (M, topk) i32: global expert ids; -1 = padded slot (contributes nothing)
//   topk_weights   (M, topk) f32
//   w13            (E_local, 2I, H) fp8: rows [0, I) gate, [I, 2I) up;
//                  (E_local, I, H) when the activation is not gated
//   w2             (E_local, H, I) fp8
//   w13_scale      block:   (E_local, ceil(2I/bn), ceil(H/bk)) f32 (bn must divide I when gated)
//                  tensor:  (E_local) or (E_local, 2) f32 (one per gate/up shard)
//                  channel: (E_local, 2I) f32
//                  mx:      (E_local, 2I, H/32) u8/e8m0
//   w2_scale       block: (E_local, ceil(H/bn), ceil(I/bk)); tensor: (E_local);
//                  channel: (E_local, H); mx: (E_local, H, I/32)
//   w13_bias       (E_local, 2I) f32/bf16, optional; w2_bias (E_local, H), optional
//   a13_scale      static per-tensor input scale of GEMM1: (1) f32; a2_scale likewise for GEMM2
//   expert_map     (E_global) i32: global -> local index, -1 for experts on other ranks;
//                  absent = identity
//   out            (M, H): dtype of x; or f32 with bf16 x, a partial output for an EP/TP
//                  reduction (the compute still rounds to bf16 where vLLM does; only the final
//                  top-k sum stays f32). Kernels that cannot do this leave
//                  ExpertsImpl::f32_partial_out false and reject it.
//
// Batched (masked) format (BATCHED_TRITON / BATCHED_DEEPGEMM, expert parallel), when
// expert_num_tokens is defined:
//   x                  (E_local, max_m, H): rows [0, expert_num_tokens[e]) of slab e are tokens
//                      already dispatched to local expert e (no routing inside)
//   expert_num_tokens  (E_local) i32, each in [0, max_m]
//   out                (E_local, max_m, H): per row y2 = GEMM2(act(GEMM1(x))) + bias, rounded to
//                      out's dtype, WITHOUT the router weight (the combine step applies it);
//                      rows past expert_num_tokens[e] are left untouched
//   router_logits, topk_ids, topk_weights and expert_map are absent in this format.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>

#include "fp8moe/config.hpp"
#include "fp8moe/quant_config.hpp"
#include "fp8moe/tensor.hpp"

namespace fp8moe {

// How the weight scales are laid out.
enum class WeightScaleKind : uint8_t {
  kBlock,       // [bn, bk] blocks (128x128, or refined 64x64 / 32x32)
  kPerTensor,   // one scale per expert (per shard for w13)
  kPerChannel,  // one scale per output row
  kMx,          // MXFP8: e8m0 per 1x32 group along K
};

// How the activations entering each GEMM are quantised.
enum class ActQuantKind : uint8_t {
  kNone,              // W8A16: activations stay bf16/f32, weights are dequantised
  kPerTensorStatic,   // a13_scale / a2_scale from the checkpoint
  kPerTensorDynamic,  // s = max|x| / fp8_max over the whole tensor
  kPerTokenDynamic,   // s_r = max(max_c |x_rc| / fp8_max, 1/(fp8_max*512))
  kPerGroupDynamic,   // 1 x group_k groups (per_token_group_quant_fp8), optional UE8M0 scales
  kMxfp8,             // 1 x 32 groups with e8m0 scales
};

struct MoeScheme {
  WeightScaleKind weight = WeightScaleKind::kBlock;
  int64_t block_n = 128;  // kBlock only
  int64_t block_k = 128;  // kBlock only
  ActQuantKind act = ActQuantKind::kPerGroupDynamic;
  int64_t group_k = 128;         // kPerGroupDynamic only
  bool ue8m0_scales = false;     // power-of-two (rounded up) activation scales
  bool fuse_silu_quant = false;  // snapshot Triton fast path: SiLU*up kept in f32, no bf16 rounding
  DType fp8 = DType::kF8E4M3FN;  // kF8E4M3FNUZ on MI300-style platforms

  // Derives the scheme from a quant config (weight shape, activation dtype/shape). Throws
  // ValueError for combinations no kernel computes.
  static MoeScheme from_quant_config(const MoeQuantConfig& qc);
  std::string str() const;  // "w:block128x128 a:group128" ...
};

// Routing parameters for every RoutingMethodType (numerics.md §1).
struct RoutingConfig {
  RoutingMethodType method = RoutingMethodType::kRenormalize;
  int topk = 1;
  bool renormalize = true;
  std::string scoring_func = "softmax";  // "softmax" | "sigmoid"
  int num_expert_group = 0;              // > 0: grouped top-k
  int topk_group = 0;
  double routed_scaling_factor = 1.0;
  TensorView e_score_correction_bias{};  // (E) f32, optional
};

// vLLM ApplyMoEActivationConfig: activation plus its parameters (clamp L, alpha, beta, SITU betas).
struct ActivationConfig {
  MoeActivation activation = MoeActivation::kSilu;
  std::optional<double> clamp_limit{};
  double alpha = 1.0;
  double beta = 0.0;
  std::optional<double> situ_beta{};
  std::optional<double> situ_linear_beta{};
};

struct ExpertWeights {
  TensorView w13, w2;
  TensorView w13_scale, w2_scale;
  TensorView w13_bias, w2_bias;
  TensorView a13_scale, a2_scale;
};

struct FusedMoeArgs {
  TensorView x;
  TensorView router_logits;  // used when topk_ids is absent
  TensorView topk_ids;       // precomputed routing (optional)
  TensorView topk_weights;
  RoutingConfig routing{};
  ExpertWeights weights{};
  MoeScheme scheme{};
  ActivationConfig act{};
  TensorView expert_map{};
  TensorView expert_num_tokens{};  // defined => batched (masked) format, see the layout comment
  bool apply_router_weight_on_input = false;  // topk must be 1: x *= w before quantisation
  // VLLM_BATCH_INVARIANT (TritonExperts declares support, and vLLM's Triton then runs its default
  // config at every M): a token's output must not depend on the batch around it (its size, the
  // token's position). cuda_fused then runs one configuration at every M instead of choosing by M
  // (the grouped path with 128-row m-blocks, else the generic path: choose() in
  // src/kernels/cuda/fused_moe_cuda.cpp); the CPU kernels and the reference are batch-invariant
  // anyway.
  // Per-tensor dynamic activation scales depend on the whole batch by definition.
  bool batch_invariant = false;
  TensorView out;
  void* stream = nullptr;  // cudaStream_t for CUDA kernels; ignored on the CPU

  bool batched() const { return expert_num_tokens.defined(); }
  int64_t num_tokens() const { return x.defined() && !batched() ? x.size(0) : 0; }
  int64_t hidden() const { return x.size(batched() ? 2 : 1); }
  int64_t num_local_experts() const { return weights.w13.size(0); }
  bool gated() const { return activation_is_gated(act.activation); }
  int64_t intermediate() const { return weights.w2.size(2); }
};

// Checks every tensor of `args` against the layouts above (dtypes, shapes, scale grids, devices)
// and throws ValueError naming the tensor, its shape and the expected shape. Kernels call it first.
void validate_fused_moe_args(const FusedMoeArgs& args);

// A support verdict: ok, or not with vLLM's reason text. Support queries never throw.
struct Support {
  bool ok = true;
  std::string reason{};
  static Support yes() { return {}; }
  static Support no(std::string why) { return {false, std::move(why)}; }
  explicit operator bool() const { return ok; }
};

// One implementation of the fused MoE call. Experts descriptors (experts.hpp) point at these by
// name:
//   "ref" (float64 reference), "cpu_w8a16" (backend CPU), "cpu_w8a8" (backend CPU_W8A8),
//   "cuda_fused" (TRITON), "cuda_fused_batched" (BATCHED_TRITON), "cuda_grouped" (DEEPGEMM),
//   "cuda_grouped_masked" (BATCHED_DEEPGEMM).
struct ExpertsImpl {
  const char* name = "";  // "ref", "cpu_w8a16", "cpu_w8a8", "cuda_fused", ...
  DeviceKind device = DeviceKind::kCpu;
  // Accepts f32 `out` with bf16 `x` (partial outputs for EP/TP reductions, see the layout comment).
  bool f32_partial_out = false;
  // What this implementation can honour beyond the vLLM contract (activation, clamp/alpha/beta,
  // bias, schemes, sizes). Checked at selection on a detected platform so that a kernel that cannot
  // honour a requested feature is rejected there, never silently wrong. nullptr: everything the
  // contract allows.
  Support (*supports_config)(const MoeConfig& config, const std::optional<QuantKey>& weight_key,
                             const std::optional<QuantKey>& activation_key) = nullptr;
  // Whether it can run on this machine now (CPU features, a GPU of the compiled arch).
  bool (*available)() = nullptr;
  // Bytes of scratch memory run() needs for this problem (on `device`).
  std::size_t (*workspace_size)(const FusedMoeArgs& args) = nullptr;
  // Computes args.out. `workspace` holds at least workspace_size(args) bytes.
  void (*run)(const FusedMoeArgs& args, void* workspace) = nullptr;
  // Optional: one line on how run() would compute this call (the execution path it takes and
  // why, the instruction set and threads), for the tools' explanations. Reads no tensor data.
  std::string (*describe_call)(const FusedMoeArgs& args) = nullptr;
};

}  // namespace fp8moe
