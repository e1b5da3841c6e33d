// THE float64 reference of the FP8 fused MoE (spec/numerics.md §7), the one truth every backend
// (CPU and CUDA kernels) is checked against. Plain loops, no SIMD, no threads, no blocking; speed
// is not its job. CPU tensors only.
//
//   route (or take topk ids/weights) -> [x *= w if apply_router_weight_on_input] -> quantise x
//   (scheme.act) -> GEMM1 in float64 with dequantised fp8 weights (scheme.weight) -> + bias ->
//   round to the compute dtype (bf16 for bf16 x, f32 for f32 x) -> activation (its own rounding
//   points, numerics/activation.hpp) -> quantise h -> GEMM2 in float64 -> + bias -> * router
//   weight (unless applied on the input) -> round -> sum over the top-k slots in order -> round.
//
// Rounding: every value vLLM's kernels hold in fp32 and then cast is rounded here the same way
// (float64 -> float32 -> bf16), and the quantisers run in float32 exactly as vLLM's kernels
// (numerics/quant.hpp), so a faithful kernel lands within vLLM's own test tolerance of the
// reference, and on exact-mode data (tests/common/moe_testing.hpp) matches it bit for bit.
// Non-local experts (expert_map -1) and padded slots (topk id -1) contribute nothing; M = 0 and
// experts without tokens are fine.
#pragma once

#include <vector>

#include "fp8moe/fused_moe.hpp"
#include "fp8moe/tensor.hpp"
#include "numerics/routing.hpp"

namespace fp8moe::ref {

using numerics::RoutingResult;

// Computes args.out (validate_fused_moe_args first; ValueError on any mismatch).
void fused_moe(const FusedMoeArgs& args);

// The same layer on real-valued weights and activations, to measure what FP8 itself costs:
// float64 GEMMs, no quantisation, no bf16 rounding of intermediates (activations computed in
// float64 and held as float32); only `out` is rounded to its dtype.
struct UnquantizedMoeArgs {
  TensorView x;              // (M, H) bf16/f32
  TensorView router_logits;  // (M, E_global), used when topk_ids is absent
  TensorView topk_ids;       // (M, topk) i32
  TensorView topk_weights;   // (M, topk) f32
  RoutingConfig routing{};
  TensorView w13;  // (E_local, N1, H) f32/bf16 real weights
  TensorView w2;   // (E_local, H, I) f32/bf16
  TensorView w13_bias, w2_bias;
  ActivationConfig act{};
  TensorView expert_map{};
  bool apply_router_weight_on_input = false;
  TensorView out;  // (M, H), dtype of x
};
void fused_moe_unquantized(const UnquantizedMoeArgs& args);

// Routing as the reference does it (numerics::route).
RoutingResult route(const TensorView& logits, const RoutingConfig& cfg);

// The reference as an experts implementation: name "ref", device CPU, no workspace.
const ExpertsImpl& ref_experts_impl();

namespace detail {

// Options for the instrumented entry point used by the tests: float32 arithmetic instead of
// float64 and reversed summation orders (k descending, top-k slots descending). On exact-mode data
// all four variants must agree bit for bit; that is how the generator proves a problem is exact.
struct Options {
  bool float32 = false;
  bool reverse = false;
};
// What the run saw: every dynamic activation scale it computed (first and second quantisation)
// and the largest |x| and |h| (before quantisation) over valid slots.
struct Trace {
  std::vector<float> a1_scales, a2_scales;
  float x_amax = 0.0f;
  float h_amax = 0.0f;
};
void fused_moe_with(const FusedMoeArgs& args, const Options& options, Trace* trace);

}  // namespace detail

}  // namespace fp8moe::ref
