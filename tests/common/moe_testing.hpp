// Shared helpers for testing fused-MoE kernels (the CPU and CUDA kernel tests and the reference's
// own tests): a seeded problem generator, routing generators, output poisoning and coverage checks,
// canary-guarded buffers, and comparisons that report what went wrong. Host-side only, no CUDA
// headers; MoeTestProblem::to(device) moves a problem to a GPU through the tensor hooks.
//
// Typical use:
//   MoeTestSpec spec;  spec.M = 33; spec.E = 8; spec.H = 256; spec.I = 128; spec.topk = 2;
//   spec.mode = MoeTestMode::kExact;
//   MoeTestProblem p = make_problem(spec);
//   Tensor expected = reference_output(p);               // ref::fused_moe on the same inputs
//   poison(p.out);  my_kernel.run(p.args(), ws);
//   EXPECT_TRUE(expect_all_written(p.out));
//   EXPECT_TRUE(compare_bitwise(p.out, expected).ok);    // exact mode
//   // statistical mode: compare_close(p.out, expected, 0.035, 0.035)
//
// ---- Exact mode (MoeTestMode::kExact)
// ------------------------------------------------------------- Every value the layer produces lies
// on its fp8/bf16/fp32 grid and every sum is exact in fp32, so a faithful kernel matches the
// float64 reference bit for bit whatever its summation order or tiling. make_problem verifies this
// for each exact problem by running the reference in float64 and twice in float32 with opposite
// summation orders (ref::detail); all three must agree bitwise. Construction (exponents a_t in
// {-2,-1,0} per token, weight block scale exponents in {-1,0,1}):
//   x[t, :]   every 32-wide segment s holds one anchor of magnitude 448 * 2^(a_t + d_s), d_s in
//             {0, -1} (d_0 = 0, the segment-0 anchor p_0 is positive), so every activation scale
//             (per token, per 1xg group for g in 32/64/128, per tensor, MX, UE8M0) is a power of
//             two; a "gate source" at p_src in segment 0 holds +16 * 2^a_t; every other element is
//             an integer in [-4, 4] times 2^a_t (zeros included).
//   w13 gate  row i is zero except code 256 at p_src (or entirely zero for ~1/4 of the rows whose
//   up
//             row is not an anchor), so gate = G_t = 2^12 * 2^(a_t + b) >= 32: every gated
//             activation is in its saturated, exactly computable regime (silu(G) = G, gelu(G) = G,
//             SwiGLU-OAI's min(G, 7) = 7 with sigmoid(11.9) rounding away).
//   w13 up    in each 32-wide group of the intermediate dim one "anchor" row is zero except code
//   256
//             at p_0 (u = 448 * 2^(a_t + 8 + b)); the other rows hold codes in {-1, 0, 1}, so they
//             stay below the anchor; h's group amax is then G * u_anchor = 448 * 2^k and the
//             dynamic scales of the second quantisation are powers of two as well.
//   w2        codes in {-1, 0, 1}; biases: small integers (zero on gate and anchor rows of w13).
//   routing   precomputed ids with weights in {1, 1/2, 1/4} (logits routing: topk <= 2 only).
// Exact mode supports the activations whose saturated form is exact: silu (clamp: L = 448*2^j >= G
// so the up clamp is active), gelu, gelu_tanh, swigluoai, swigluoai_uninterleave (L=7, alpha=1.702,
// beta=1), situ (power-of-two beta, no linear beta), silu_no_mul, gelu_no_mul, gelu_tanh_no_mul;
// swiglustep and relu2_no_mul only with a second quantisation whose scale is a power of two by
// construction (static per-tensor, MXFP8, UE8M0, or none). Anything else throws
// NotImplementedError naming the combination. Exact problems are meant to be small (H, I <= 1024).
//
// ---- Statistical mode (MoeTestMode::kStatistical)
// ------------------------------------------------- vLLM's block-FP8 test recipe: x = randn/10
// (bf16), router logits randn, real weights randn/15 rounded to bf16, quantised by the scheme's own
// quantiser (per_block_cast_to_fp8 [bn, bk], per-tensor, per-channel, MXFP8); biases randn/10;
// static activation scales calibrated on the data. Compare with compare_close(out, ref, 0.035,
// 0.035) (vLLM's tolerance; 0.039 for M >= 8192).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "fp8moe/fused_moe.hpp"
#include "fp8moe/tensor.hpp"

namespace fp8moe::testing {

enum class MoeTestMode : uint8_t { kExact, kStatistical };

// How (token, slot) -> expert assignments are drawn.
enum class RoutingPattern : uint8_t {
  kUniform,           // topk distinct experts per token, uniformly at random
  kEveryExpertHit,    // like uniform, but every global expert gets at least one token (needs
                      // M * topk >= E)
  kOneHotExpert,      // every token routes to the same hot expert (plus random others)
  kSomeExpertsEmpty,  // only half of the experts receive tokens; the rest get none
  kLogits,            // router logits for spec.routing_config (method, groups, bias, scaling);
                      // the kernel routes (args.topk_ids stays empty)
};
std::string_view routing_pattern_name(RoutingPattern p);

struct MoeTestSpec {
  int64_t M = 4;    // tokens (0 allowed)
  int64_t E = 4;    // global experts
  int64_t H = 256;  // hidden
  int64_t I = 256;  // intermediate per expert (per rank)
  int topk = 2;
  MoeScheme scheme{};      // weight scales and activation quantisation (default: block 128x128,
                           // per-group-128 activations)
  ActivationConfig act{};  // activation and its parameters
  bool bias = false;       // w13_bias and w2_bias
  DType x_dtype = DType::kBF16;   // x and out: bf16 or f32
  bool w13_shard_scales = false;  // per-tensor weights: w13_scale (E, 2), one per gate/up shard
  MoeTestMode mode = MoeTestMode::kStatistical;
  RoutingPattern routing = RoutingPattern::kUniform;
  RoutingConfig routing_config{};  // for kLogits; routing_config.topk is set to topk
  int ep_size = 1;                 // > 1: expert parallelism, E/ep_size local experts
  int ep_rank = 0;                 // local experts [ep_rank*E_local, (ep_rank+1)*E_local)
  bool apply_router_weight_on_input = false;  // needs topk == 1
  int64_t padded_slots = 0;                   // this many (token, slot) pairs get id -1
  uint64_t seed = 0;

  int64_t num_local_experts() const { return E / ep_size; }
  // "M33_E8_H256_I128_k2_w:block128x128_a:group128_silu_bf16_exact_uniform"
  std::string name() const;
};

// A generated problem. Owns every tensor (host memory); args() gives views of them.
struct MoeTestProblem {
  MoeTestSpec spec{};
  Tensor x;                        // (M, H) x_dtype
  Tensor router_logits;            // (M, E) f32 (kLogits only)
  Tensor e_score_correction_bias;  // (E) f32, for methods that use one
  Tensor topk_ids;                 // (M, topk) i32 global ids, -1 = padded slot
  Tensor topk_weights;             // (M, topk) f32
  Tensor w13, w2;                  // fp8 codes, vLLM layout (see fused_moe.hpp)
  Tensor w13_scale, w2_scale;      // layout of spec.scheme.weight
  Tensor w13_bias, w2_bias;        // (E_local, N1) / (E_local, H) f32, optional
  Tensor a13_scale, a2_scale;      // (1) f32, static per-tensor schemes only
  Tensor expert_map;               // (E) i32 global -> local or -1 (EP only)
  Tensor w13_real, w2_real;        // f32 real-valued weights before quantisation
  Tensor out;                      // (M, H) x_dtype, poisoned with NaN

  // Views of the tensors above (router_logits when topk_ids is empty, else topk ids/weights).
  FusedMoeArgs args() const;
  // The same problem with every tensor copied to `device` (CUDA needs the CUDA build).
  MoeTestProblem to(Device device) const;
};

MoeTestProblem make_problem(const MoeTestSpec& spec);
// The scale tensor's shape for a weight (E, R, C) in the scheme's layout (block grid, one per
// expert or two with shard scales, per channel, MX groups of 32), as make_problem builds it.
std::vector<int64_t> weight_scale_shape(const MoeScheme& sc, int64_t E, int64_t R, int64_t C,
                                        bool is_w13, bool shard_scales);

// Routing on its own: (M, topk) ids (i32, global) and weights (f32) for a pattern (not kLogits).
// Exact weights are powers of two in {1, 1/2, 1/4}; statistical weights are positive and sum to 1.
struct RoutingDraw {
  Tensor topk_ids, topk_weights;
};
RoutingDraw make_routing(int64_t M, int64_t E, int topk, RoutingPattern pattern, MoeTestMode mode,
                         uint64_t seed);
// Router logits (M, E) f32 for a routing method (randn, with exact ties when `with_ties`), and
// the e_score_correction_bias (E) the method needs (DeepSeekV3, MiniMax2), else an empty tensor.
struct LogitsDraw {
  Tensor logits, e_score_correction_bias;
};
LogitsDraw make_router_logits(int64_t M, int64_t E, RoutingMethodType method, uint64_t seed,
                              bool with_ties = false);

// ---- output checks
// ----------------------------------------------------------------------------------

// Fills a host or device tensor with NaN (bf16 0x7FC0, f32 quiet NaN, f64 NaN, 0xFF for 1-byte).
void poison(const TensorView& t);
// Number of elements that are still NaN (i.e. were never written); host or device tensors.
int64_t count_nan(const TensorView& t);
// gtest-friendly: ok when no element is NaN; the message names the first unwritten index.
struct WriteCheck {
  bool ok = true;
  int64_t unwritten = 0;
  int64_t first_index = -1;
  std::string message;
  explicit operator bool() const { return ok; }
};
WriteCheck expect_all_written(const TensorView& out);

// A buffer with canary words before and after the payload, to catch out-of-bounds writes.
// Works on the host and (through the tensor hooks) on a GPU.
class GuardedTensor {
 public:
  GuardedTensor(std::vector<int64_t> shape, DType dtype, Device device = {});
  const TensorView& view() const { return view_; }
  operator const TensorView&() const { return view_; }
  // True when both canary regions still hold the pattern.
  bool canaries_intact() const;
  static constexpr int64_t kGuardBytes = 256;
  static constexpr uint8_t kCanary = 0xA5;

 private:
  Tensor storage_;
  TensorView view_;
  int64_t payload_bytes_ = 0;
};

// ---- comparisons
// --------------------------------------------------------------------------------------

struct CompareReport {
  bool ok = true;
  int64_t count = 0;       // elements compared
  int64_t mismatches = 0;  // bitwise: differing elements; close: elements over tolerance
  double max_abs_err = 0.0;
  int64_t max_abs_index = -1;   // flat index of the largest absolute error
  double max_rel_err = 0.0;     // max |a-e| / |e| over elements with e != 0
  int64_t first_mismatch = -1;  // flat index of the first failing element
  double actual_at_first = 0.0, expected_at_first = 0.0;
  // vLLM's per-tensor/per-channel FP8 metric: mean|a - e| / mean|e|.
  double mean_rel_abs_err = 0.0;
  bool nan_mismatch = false;  // a NaN in one tensor where the other has a number
  std::string str() const;    // one line for failure messages
};
// Bit-for-bit equality (NaNs equal only if both NaN). Shapes and dtypes must match.
CompareReport compare_bitwise(const TensorView& actual, const TensorView& expected);
// torch.testing.assert_close semantics: |a - e| <= atol + rtol * |e| elementwise.
CompareReport compare_close(const TensorView& actual, const TensorView& expected, double atol,
                            double rtol);

// The float64 reference's output for a problem (ref::fused_moe on its args, into a new tensor).
Tensor reference_output(const MoeTestProblem& p);

// Reads element i of a floating tensor on the host as double.
double element_as_double(const TensorView& t, int64_t i);

// A host (rows, cols) tensor of N(0, 1) * scale draws (seeded mt19937_64), bf16 (rounded) or f32.
Tensor randn(int64_t rows, int64_t cols, DType dtype, float scale, uint64_t seed);
// A host copy of rows [first, first + n) of a 2-D host tensor.
Tensor rows_of(const Tensor& t, int64_t first, int64_t n);

}  // namespace fp8moe::testing
