// Pitfalls of spec/pitfalls.md that no other unit test covered and that run on the CPU (see
// docs/PITFALLS.md for the whole matrix). Each test is named after its pitfall number. The kernels
// are fp8moe's CPU experts ("cpu_w8a16", "cpu_w8a8") and the float64 reference; the layer tests
// build small Fp8MoeLayers from caller tensors with a simulated GPU platform (so that the oracle's
// scheme is W8A8 or W8A16 as wanted) and a --kernel override that runs on this machine.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "common/moe_testing.hpp"
#include "fp8moe/ep_moe.hpp"
#include "fp8moe/error.hpp"
#include "fp8moe/layer.hpp"
#include "fp8moe/log.hpp"
#include "fp8moe/numerics.hpp"
#include "fp8moe/oracle.hpp"
#include "fp8moe/parallel.hpp"
#include "fp8moe/quant_key.hpp"
#include "kernels/cpu/cpu_experts.hpp"
#include "kernels/ref/ref.hpp"
#include "numerics/quant.hpp"
#include "unit/test_checkpoint_util.hpp"

namespace fp8moe {
namespace {

using test::throws_with;
using testing::MoeTestMode;
using testing::MoeTestProblem;
using testing::MoeTestSpec;
using testing::RoutingPattern;

const ExpertsImpl& w8a16() { return cpu::cpu_w8a16_experts_impl(); }
const ExpertsImpl& w8a8() { return cpu::cpu_w8a8_experts_impl(); }

// Runs `impl` on `args` into a fresh poisoned tensor shaped like args.out; checks every element
// was written.
Tensor run_impl(const ExpertsImpl& impl, FusedMoeArgs args) {
  const std::vector<int64_t> shape = args.out.sizes();
  Tensor out = Tensor::empty(std::span<const int64_t>(shape), args.out.dtype);
  testing::poison(out);
  args.out = out.view();
  std::vector<uint8_t> ws(impl.workspace_size ? impl.workspace_size(args) : 0);
  impl.run(args, ws.empty() ? nullptr : ws.data());
  EXPECT_TRUE(testing::expect_all_written(out)) << impl.name;
  return out;
}

// The float64 reference on `args`, into a fresh tensor.
Tensor run_ref(FusedMoeArgs args) {
  const std::vector<int64_t> shape = args.out.sizes();
  Tensor out = Tensor::empty(std::span<const int64_t>(shape), args.out.dtype);
  args.out = out.view();
  ref::fused_moe(args);
  return out;
}

// The reference in float32 with reversed summation orders: on exact data it equals the float64
// run bit for bit (how a modified exact problem proves it is still exact).
Tensor run_ref_f32_reversed(FusedMoeArgs args) {
  const std::vector<int64_t> shape = args.out.sizes();
  Tensor out = Tensor::empty(std::span<const int64_t>(shape), args.out.dtype);
  args.out = out.view();
  ref::detail::Options o;
  o.float32 = true;
  o.reverse = true;
  ref::detail::fused_moe_with(args, o, nullptr);
  return out;
}

MoeScheme block_scheme(bool quantised_acts, bool ue8m0 = false) {
  MoeScheme s;
  s.weight = WeightScaleKind::kBlock;
  s.block_n = s.block_k = 128;
  s.act = quantised_acts ? ActQuantKind::kPerGroupDynamic : ActQuantKind::kNone;
  s.group_k = 128;
  s.ue8m0_scales = ue8m0;
  return s;
}

MoeTestSpec small_exact(const MoeScheme& sc, uint64_t seed) {
  MoeTestSpec s;
  s.M = 8;
  s.E = 4;
  s.H = 128;
  s.I = 128;
  s.topk = 2;
  s.scheme = sc;
  s.mode = MoeTestMode::kExact;
  s.seed = seed;
  return s;
}

bool is_pow2(float v) {
  int e = 0;
  return v > 0 && std::isfinite(v) && std::frexp(v, &e) == 0.5f;
}

// ---- layers from caller tensors ----------------------------------------------------------------

struct CallerLayer {
  Fp8MoeLayerSpec spec;
  Fp8MoeWeights w;
};

// A block-FP8 (128x128, dynamic activations) layer of E experts, quantised here from randn/15
// weights; `ue8m0`: the checkpoint declares scale_fmt ue8m0 (power-of-two weight scales).
CallerLayer make_caller_layer(int64_t E, int64_t H, int64_t I, int topk, bool ue8m0 = false) {
  CallerLayer c;
  MoeConfig& cfg = c.spec.config;
  cfg.num_experts = cfg.num_local_experts = cfg.num_logical_experts = static_cast<int>(E);
  cfg.experts_per_token = topk;
  cfg.hidden_dim = static_cast<int>(H);
  cfg.intermediate_size = static_cast<int>(I);
  cfg.routing_method = RoutingMethodType::kRenormalize;
  c.spec.quant = fp8_block_checkpoint_quant(128, 128, ue8m0);
  c.spec.routing.method = RoutingMethodType::kRenormalize;
  c.spec.routing.topk = topk;
  std::mt19937_64 rng(1234 + E + H + I);
  std::normal_distribution<float> n(0.0f, 1.0f / 15.0f);
  Tensor r13 = Tensor::empty({E, 2 * I, H}, DType::kF32);
  Tensor r2 = Tensor::empty({E, H, I}, DType::kF32);
  for (int64_t i = 0; i < r13.numel(); ++i) r13.ptr<float>()[i] = n(rng);
  for (int64_t i = 0; i < r2.numel(); ++i) r2.ptr<float>()[i] = n(rng);
  const auto q13 = numerics::per_block_cast_to_fp8(r13, 128, 128, DType::kF8E4M3FN, ue8m0);
  const auto q2 = numerics::per_block_cast_to_fp8(r2, 128, 128, DType::kF8E4M3FN, ue8m0);
  c.w.w13 = q13.q;
  c.w.w13_scale = q13.scale;
  c.w.w2 = q2.q;
  c.w.w2_scale = q2.scale;
  return c;
}

// Options that make the oracle's scheme W8A8 (a simulated H200: TRITON, per-group activations) or
// W8A16 (a simulated A100: MARLIN), with `kernel` running it on this machine's CPU.
Fp8MoeLayerOptions layer_options(const std::string& kernel, bool w8a8_scheme,
                                 int64_t max_num_tokens = 1024) {
  Fp8MoeLayerOptions o;
  o.platform = Platform::parse(w8a8_scheme ? "cuda:90" : "cuda:80");
  o.kernel = kernel;
  o.device = Device::cpu();
  o.max_num_tokens = max_num_tokens;
  return o;
}

// A (M, cols) view of the first M rows of a contiguous 2-D tensor.
TensorView first_rows(const Tensor& t, int64_t M) {
  TensorView v = t.view();
  v.shape[0] = M;
  return v;
}

// Bitwise equality of row `ra` of a and row `rb` of b (2-D bf16 tensors of equal width).
bool rows_equal(const Tensor& a, int64_t ra, const Tensor& b, int64_t rb) {
  const int64_t H = a.size(1);
  return std::memcmp(a.ptr<uint16_t>() + ra * H, b.ptr<uint16_t>() + rb * H, H * 2) == 0;
}

// =================================================================================================
// Pitfall 9: per-tensor weight scales as 1-D [E] with per-token (and per-tensor) activations: each
// expert uses its own scale.
// =================================================================================================

TEST(Pitfalls, P09_PerTensorWeightScalesArePerExpert) {
  struct Case {
    const ExpertsImpl* impl;
    ActQuantKind act;
  };
  const Case cases[] = {{&w8a16(), ActQuantKind::kNone},
                        {&w8a8(), ActQuantKind::kPerTokenDynamic},
                        {&w8a8(), ActQuantKind::kPerTensorDynamic},
                        {&w8a8(), ActQuantKind::kPerTensorStatic}};
  uint64_t seed = 900;
  for (const Case& c : cases) {
    MoeScheme sc;
    sc.weight = WeightScaleKind::kPerTensor;
    sc.act = c.act;
    MoeTestSpec s = small_exact(sc, ++seed);
    s.routing = RoutingPattern::kEveryExpertHit;
    MoeTestProblem p = testing::make_problem(s);
    SCOPED_TRACE(std::string(c.impl->name) + " " + s.name());
    ASSERT_EQ(p.w13_scale.sizes(), (std::vector<int64_t>{s.E}));  // 1-D [E]
    ASSERT_EQ(p.w2_scale.sizes(), (std::vector<int64_t>{s.E}));
    // Distinct scales per expert: w2 gets 2^(e-1) (0.5, 1, 2, 4), w13 its own scale times 2^e
    // (powers of two keep the problem exact; the f32 reversed reference proves it below).
    for (int64_t e = 0; e < s.E; ++e) {
      p.w2_scale.ptr<float>()[e] = std::ldexp(1.0f, static_cast<int>(e) - 1);
      p.w13_scale.ptr<float>()[e] *= std::ldexp(1.0f, static_cast<int>(e));
    }
    const FusedMoeArgs args = p.args();
    const Tensor expected = run_ref(args);
    ASSERT_TRUE(testing::compare_bitwise(run_ref_f32_reversed(args), expected).ok)
        << "the modified problem is no longer exact";
    const Tensor got = run_impl(*c.impl, args);
    const auto rep = testing::compare_bitwise(got, expected);
    EXPECT_TRUE(rep.ok) << rep.str();
    // The data discriminates: every expert using expert 0's scales is a different answer.
    MoeTestProblem q = p;
    q.w13_scale = p.w13_scale.clone();
    q.w2_scale = p.w2_scale.clone();
    for (int64_t e = 1; e < s.E; ++e) {
      q.w13_scale.ptr<float>()[e] = q.w13_scale.ptr<float>()[0];
      q.w2_scale.ptr<float>()[e] = q.w2_scale.ptr<float>()[0];
    }
    EXPECT_FALSE(testing::compare_bitwise(run_ref(q.args()), expected).ok);
  }
}

// =================================================================================================
// Pitfall 10: per-expert static input scales that differ are max-reduced with a warning (vLLM's
// process_fp8_input_tensor_strategy_moe), never "use expert 0".
// =================================================================================================

TEST(Pitfalls, P10_DifferentStaticInputScalesAreMaxReducedWithAWarning) {
  const int64_t E = 4, W = 64, H = 128;
  Fp8MoeWeights w;
  w.w13 = Tensor::empty({E, 2 * W, H}, DType::kF8E4M3FN);
  w.w2 = Tensor::empty({E, H, W}, DType::kF8E4M3FN);
  std::memset(w.w13.data(), 0x38, w.w13.nbytes());
  std::memset(w.w2.data(), 0x30, w.w2.nbytes());
  w.w13_scale = Tensor::empty({E}, DType::kF32);
  w.w2_scale = Tensor::empty({E}, DType::kF32);
  w.w13_input_scale = Tensor::empty({E}, DType::kF32);
  w.w2_input_scale = Tensor::empty({E}, DType::kF32);
  // Expert 0 holds neither maximum.
  const float a13[E] = {0.25f, 0.5f, 3.0f, 1.0f};
  const float a2[E] = {0.125f, 0.75f, 0.5f, 0.0625f};
  for (int64_t e = 0; e < E; ++e) {
    w.w13_scale.ptr<float>()[e] = w.w2_scale.ptr<float>()[e] = 1e-2f;
    w.w13_input_scale.ptr<float>()[e] = a13[e];
    w.w2_input_scale.ptr<float>()[e] = a2[e];
  }
  std::vector<std::string> warnings;
  set_log_sink([&](LogLevel level, std::string_view m) {
    if (level == LogLevel::kWarning) warnings.emplace_back(m);
  });
  reset_log_once();
  KernelFormatContext ctx;
  ctx.weight = WeightScaleKind::kPerTensor;
  const auto f = convert_to_fp8_moe_kernel_format(Fp8MoeBackend::kTriton, ctx);
  const PreparedMoeWeights p = prepare_fp8_moe_weights(
      w, f, WeightLayout::kCanonical, WeightScaleKind::kPerTensor, {0, 0}, DType::kF8E4M3FN);
  set_log_sink(nullptr);
  ASSERT_EQ(p.a13_scale.numel(), 1);
  ASSERT_EQ(p.a2_scale.numel(), 1);
  EXPECT_EQ(p.a13_scale.ptr<float>()[0], 3.0f);
  EXPECT_EQ(p.a2_scale.ptr<float>()[0], 0.75f);
  bool warned = false;
  for (const auto& m : warnings) {
    warned |= m.find("input_scales that are not equal") != std::string::npos;
  }
  EXPECT_TRUE(warned) << "no warning for differing input scales";
}

// =================================================================================================
// Pitfall 11: expert parallelism with dynamic per-tensor activation scales: fp8moe quantises after
// the dispatch, so one scale covers every row a rank's experts receive (the max over those rows),
// consistently for all of them. Exact data: every rank's partial output equals the reference run
// on exactly the rows that rank received, and their sum is the EP output bit for bit.
// =================================================================================================

// Rows `rows` of a 2-D host tensor, copied.
Tensor gather_rows(const Tensor& t, const std::vector<int64_t>& rows) {
  const int64_t C = t.size(1);
  const std::size_t rb = static_cast<std::size_t>(C) * dtype_size(t.dtype());
  Tensor r = Tensor::empty({static_cast<int64_t>(rows.size()), C}, t.dtype());
  for (std::size_t i = 0; i < rows.size(); ++i) {
    std::memcpy(static_cast<char*>(r.data()) + i * rb,
                static_cast<const char*>(t.data()) + rows[i] * rb, rb);
  }
  return r;
}

// Experts [start, start + n) of an (E, ...) tensor.
TensorView expert_slice(const TensorView& t, int64_t start, int64_t n) {
  TensorView v = t;
  v.data = static_cast<char*>(t.data) + start * t.strides[0] * dtype_size(t.dtype);
  v.shape[0] = n;
  return v;
}

TEST(Pitfalls, P11_ExpertParallelPerTensorDynamicScalesAreConsistentPerRank) {
  MoeScheme sc;
  sc.weight = WeightScaleKind::kPerTensor;
  sc.act = ActQuantKind::kPerTensorDynamic;
  MoeTestSpec s = small_exact(sc, 1100);
  s.M = 13;
  s.E = 8;
  s.topk = 2;
  const MoeTestProblem p = testing::make_problem(s);
  const int ep = 2;
  const EpLayout layout = EpLayout::linear(8, ep);
  const int64_t M = s.M, H = s.H, split = 7;  // rank 0 holds tokens [0, 7), rank 1 [7, 13)
  // The EP run: every rank dispatches its tokens, runs its 4 local experts (cpu_w8a8), combines.
  auto group = make_in_process_group(ep);
  std::vector<Tensor> outs(ep);
  std::vector<std::string> errors(ep);
  std::vector<std::thread> threads;
  for (int r = 0; r < ep; ++r) {
    threads.emplace_back([&, r] {
      try {
        std::vector<int64_t> mine;
        for (int64_t t = r == 0 ? 0 : split; t < (r == 0 ? split : M); ++t) mine.push_back(t);
        const Tensor x = gather_rows(p.x, mine), ids = gather_rows(p.topk_ids, mine),
                     w = gather_rows(p.topk_weights, mine);
        outs[r] = Tensor::empty({static_cast<int64_t>(mine.size()), H}, DType::kBF16);
        EpMoeArgs a;
        a.x = x;
        a.topk_ids = ids;
        a.topk_weights = w;
        a.scheme = s.scheme;
        a.weights.w13 = expert_slice(p.w13, 4 * r, 4);
        a.weights.w2 = expert_slice(p.w2, 4 * r, 4);
        a.weights.w13_scale = expert_slice(p.w13_scale, 4 * r, 4);
        a.weights.w2_scale = expert_slice(p.w2_scale, 4 * r, 4);
        a.out = outs[r];
        ep_moe_forward(*group[r], w8a8(), EpExpertsFormat::kStandard, layout, a);
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < ep; ++r) ASSERT_EQ(errors[r], "") << "rank " << r;
  // The expected output: per expert-owning rank q, the reference on the rows q receives (tokens
  // with at least one expert on q) with q's experts, as f32 partials; summed over q.
  std::vector<float> total(M * H, 0.0f);
  for (int q = 0; q < ep; ++q) {
    const std::vector<int32_t> map = layout.expert_map(q);
    std::vector<int64_t> rows;
    for (int64_t t = 0; t < M; ++t) {
      bool any = false;
      for (int j = 0; j < s.topk; ++j) any |= map[p.topk_ids.ptr<int32_t>()[t * s.topk + j]] >= 0;
      if (any) rows.push_back(t);
    }
    ASSERT_FALSE(rows.empty());
    const Tensor x = gather_rows(p.x, rows), ids = gather_rows(p.topk_ids, rows),
                 w = gather_rows(p.topk_weights, rows);
    Tensor emap = Tensor::empty({8}, DType::kI32);
    std::memcpy(emap.data(), map.data(), 8 * sizeof(int32_t));
    Tensor part = Tensor::empty({static_cast<int64_t>(rows.size()), H}, DType::kF32);
    FusedMoeArgs a;
    a.x = x;
    a.topk_ids = ids;
    a.topk_weights = w;
    a.scheme = s.scheme;
    a.weights.w13 = expert_slice(p.w13, 4 * q, 4);
    a.weights.w2 = expert_slice(p.w2, 4 * q, 4);
    a.weights.w13_scale = expert_slice(p.w13_scale, 4 * q, 4);
    a.weights.w2_scale = expert_slice(p.w2_scale, 4 * q, 4);
    a.expert_map = emap;
    a.out = part;
    ref::fused_moe(a);
    for (std::size_t i = 0; i < rows.size(); ++i) {
      for (int64_t h = 0; h < H; ++h) total[rows[i] * H + h] += part.ptr<float>()[i * H + h];
    }
  }
  const Tensor single_rank = testing::reference_output(p);
  bool differs_from_single_rank = false;
  for (int64_t t = 0; t < M; ++t) {
    const Tensor& o = outs[t < split ? 0 : 1];
    const int64_t row = t < split ? t : t - split;
    for (int64_t h = 0; h < H; ++h) {
      const uint16_t want = numerics::float_to_bf16(total[t * H + h]);
      ASSERT_EQ(o.ptr<uint16_t>()[row * H + h], want) << "token " << t << " column " << h;
      differs_from_single_rank |= want != single_rank.ptr<uint16_t>()[t * H + h];
    }
  }
  // The data discriminates: the per-rank scales differ from the single-rank (global) one, so the
  // equality above depends on which rows set each scale. (The EP output differs from one rank's:
  // the known difference documented in ep_moe.hpp and docs/PITFALLS.md.)
  EXPECT_TRUE(differs_from_single_rank);
}

// =================================================================================================
// Pitfalls 12 and 13: a checkpoint declaring scale_fmt ue8m0 quantises the activations of FC1 and
// FC2 with power-of-two scales in every path that quantises them; a UE8M0 (DeepGEMM E8M0) kernel
// gets power-of-two weight scales too.
// =================================================================================================

TEST(Pitfalls, P12_P13_Ue8m0ActivationScalesInEveryPath) {
  CallerLayer c = make_caller_layer(4, 256, 256, 2, /*ue8m0=*/true);
  // Every simulated path whose scheme quantises activations per group: UE8M0 scales.
  struct Path {
    const char* platform;
    std::vector<std::string> env;
    std::string moe_backend;
  };
  const Path paths[] = {
      {"cuda:90", {"VLLM_USE_DEEP_GEMM_E8M0=0"}, "auto"},  // TRITON, scale_fmt alone
      {"cuda:90", {"VLLM_USE_DEEP_GEMM=0"}, "auto"},       // TRITON without DeepGEMM at all
      {"cuda:90", {}, "auto"},                             // TRITON with E8M0 in use
      {"cuda:90", {"VLLM_USE_DEEP_GEMM=1"}, "auto"},       // DEEPGEMM, E8M0
      {"cuda:90", {}, "deep_gemm"},                        // explicit DEEPGEMM
      {"cuda:100", {}, "auto"},                            // Blackwell's choice
  };
  int quantising_paths = 0;
  for (const Path& path : paths) {
    Fp8MoeLayerSpec spec = c.spec;
    spec.config.moe_backend = path.moe_backend;
    Fp8MoeLayerOptions o;
    o.platform = Platform::parse(path.platform);
    o.env = OracleEnv::from_pairs(path.env);
    const Fp8MoeLayerPlan p = plan_fp8_moe_layer(spec, o);
    SCOPED_TRACE(std::string(path.platform) + " " + path.moe_backend);
    ASSERT_TRUE(p.ok) << p.error_message;
    if (p.scheme.act != ActQuantKind::kPerGroupDynamic) continue;
    ++quantising_paths;
    EXPECT_TRUE(p.scheme.ue8m0_scales) << backend_value(p.selection.backend);
    // A kernel that reads UE8M0 weight scales gets them requantised: never UE8M0 activations x
    // f32 weights on DeepGEMM's E8M0 path.
    if (p.deep_gemm_e8m0 && p.selection.backend == Fp8MoeBackend::kDeepGemm) {
      ASSERT_TRUE(p.kernel_format.has_value());
      EXPECT_TRUE(p.kernel_format->requantize_ue8m0);
    }
  }
  EXPECT_GE(quantising_paths, 4);
  // Run it: the W8A8 CPU kernel and the reference, every a1 / a2 scale a power of two, and the
  // kernel within vLLM's tolerance of the reference.
  for (const char* kernel : {"ref", "cpu_w8a8"}) {
    SCOPED_TRACE(kernel);
    // E8M0 off, so that the power-of-two scales come from scale_fmt alone.
    Fp8MoeLayerOptions o = layer_options(kernel, true);
    o.env = OracleEnv::from_pairs({"VLLM_USE_DEEP_GEMM_E8M0=0"});
    Fp8MoeLayer layer = Fp8MoeLayer::from_tensors(c.spec, c.w, o);
    ASSERT_TRUE(layer.plan().scheme.ue8m0_scales);
    const Tensor x = testing::randn(9, 256, DType::kBF16, 0.1f, 1301);
    const Tensor logits = testing::randn(9, 4, DType::kF32, 1.0f, 1302);
    const Tensor out = layer.forward(x, logits);
    ref::detail::Trace trace;
    Tensor scratch = Tensor::empty({9, 256}, DType::kBF16);
    ref::detail::fused_moe_with(layer.make_args(x, logits, scratch), {}, &trace);
    ASSERT_FALSE(trace.a1_scales.empty());
    ASSERT_FALSE(trace.a2_scales.empty());
    for (float s : trace.a1_scales) ASSERT_TRUE(is_pow2(s)) << "a1 scale " << s;
    for (float s : trace.a2_scales) ASSERT_TRUE(is_pow2(s)) << "a2 scale " << s;
    const ForwardCheck chk = check_forward(layer, x, logits, out);
    EXPECT_TRUE(chk.vs_reference.allclose) << chk.vs_reference.max_abs_err;
  }
  // The same layer without scale_fmt: the scales are not all powers of two (the check above can
  // fail).
  CallerLayer plain = make_caller_layer(4, 256, 256, 2, false);
  Fp8MoeLayerOptions o = layer_options("ref", true);
  o.env = OracleEnv::from_pairs({"VLLM_USE_DEEP_GEMM_E8M0=0"});
  Fp8MoeLayer layer = Fp8MoeLayer::from_tensors(plain.spec, plain.w, o);
  EXPECT_FALSE(layer.plan().scheme.ue8m0_scales);
  const Tensor x = testing::randn(9, 256, DType::kBF16, 0.1f, 1301);
  const Tensor logits = testing::randn(9, 4, DType::kF32, 1.0f, 1302);
  ref::detail::Trace trace;
  Tensor scratch = Tensor::empty({9, 256}, DType::kBF16);
  ref::detail::fused_moe_with(layer.make_args(x, logits, scratch), {}, &trace);
  bool any_not_pow2 = false;
  for (float s : trace.a1_scales) any_not_pow2 |= !is_pow2(s);
  EXPECT_TRUE(any_not_pow2);
}

// =================================================================================================
// Pitfall 15: column-major (TMA-aligned style) scale tensors, M >= 2, stride != 1: never read as
// if they were row-major. fp8moe's kernels take row-major scales and refuse any other strides by
// name (a transposed copy of the same values is accepted and gives the same answer).
// =================================================================================================

TEST(Pitfalls, P15_ColumnMajorScaleTensorsAreRefusedNotMisread) {
  uint64_t seed = 1500;
  for (bool quantised : {false, true}) {
    MoeTestSpec s = small_exact(block_scheme(quantised), ++seed);
    s.H = 256;  // two K blocks: w13_scale (E, 1, 2) per expert is really 2-D
    s.I = 256;  // w13_scale (E, 4, 2), w2_scale (E, 2, 2)
    MoeTestProblem p = testing::make_problem(s);
    const Tensor expected = testing::reference_output(p);
    const ExpertsImpl& impl = quantised ? w8a8() : w8a16();
    for (int which = 0; which < 2; ++which) {
      const Tensor& sc = which == 0 ? p.w13_scale : p.w2_scale;
      const int64_t E = sc.size(0), A = sc.size(1), B = sc.size(2);
      ASSERT_GE(A, 2);
      ASSERT_GE(B, 2);
      // The same values stored column-major per expert: element (e, a, b) at e*A*B + b*A + a.
      Tensor cm = Tensor::empty({E, B, A}, DType::kF32);
      for (int64_t e = 0; e < E; ++e) {
        for (int64_t a = 0; a < A; ++a) {
          for (int64_t b = 0; b < B; ++b) {
            cm.ptr<float>()[e * A * B + b * A + a] = sc.ptr<float>()[e * A * B + a * B + b];
          }
        }
      }
      TensorView v = cm.view();
      v.shape[1] = A;
      v.shape[2] = B;
      v.strides[1] = 1;
      v.strides[2] = A;
      FusedMoeArgs args = p.args();
      (which == 0 ? args.weights.w13_scale : args.weights.w2_scale) = v;
      const char* name = which == 0 ? "w13_scale" : "w2_scale";
      EXPECT_TRUE(throws_with<ValueError>([&] { run_ref(args); }, {name, "contiguous"}));
      EXPECT_TRUE(throws_with<ValueError>([&] { run_impl(impl, args); }, {name, "contiguous"}))
          << impl.name;
    }
    // Control: the row-major scales give the reference's answer.
    EXPECT_TRUE(testing::compare_bitwise(run_impl(impl, p.args()), expected).ok);
  }
}

// =================================================================================================
// Pitfall 17: swiglu_limit has one meaning in every kernel, different limits give different
// outputs, and a kernel that cannot honour the limit is rejected at selection.
// =================================================================================================

TEST(Pitfalls, P17_SwigluLimitSameSemanticsEverywhereAndOutputsDiffer) {
  for (bool quantised : {false, true}) {
    const ExpertsImpl& impl = quantised ? w8a8() : w8a16();
    MoeTestSpec s;
    s.M = 16;
    s.E = 4;
    s.H = 256;
    s.I = 128;
    s.topk = 2;
    s.scheme = block_scheme(quantised);
    s.mode = MoeTestMode::kStatistical;
    s.seed = 1700 + quantised;
    MoeTestProblem p = testing::make_problem(s);
    // x * 32 so that gate and up values reach well past 1.0 (randn/10 inputs mostly stay below).
    for (int64_t i = 0; i < p.x.numel(); ++i) {
      uint16_t& v = p.x.ptr<uint16_t>()[i];
      v = numerics::float_to_bf16(numerics::bf16_to_float(v) * 32.0f);
    }
    std::vector<Tensor> refs, gots;
    for (double limit : {1.0, 100.0}) {
      FusedMoeArgs args = p.args();
      args.act.clamp_limit = limit;
      refs.push_back(run_ref(args));
      gots.push_back(run_impl(impl, args));
      const auto rep = testing::compare_close(gots.back(), refs.back(), 0.035, 0.035);
      EXPECT_TRUE(rep.ok) << impl.name << " limit " << limit << ": " << rep.str();
    }
    EXPECT_FALSE(testing::compare_bitwise(refs[0], refs[1]).ok) << "limits 1 and 100 agree (ref)";
    EXPECT_FALSE(testing::compare_bitwise(gots[0], gots[1]).ok) << impl.name << ": limits agree";
  }
  // Selection: CPU_W8A8's quant config carries no SwiGLU parameters, so a limit (or alpha / beta)
  // rejects it and the scan goes on to CPU, which honours it.
  MoeConfig c;
  c.num_experts = c.num_local_experts = c.num_logical_experts = 8;
  c.experts_per_token = 2;
  c.hidden_dim = 256;
  c.intermediate_size = 256;
  c.device = "cpu";
  c.post_init();
  const Platform cpu = Platform::parse("cpu");
  const Selection plain =
      select_fp8_moe_backend(c, kFp8Static128BlockSym, kFp8Dynamic128Sym, false, cpu, OracleEnv());
  ASSERT_EQ(plain.backend, Fp8MoeBackend::kCpuW8A8) << "the control case picks CPU_W8A8";
  for (int which = 0; which < 3; ++which) {
    MoeConfig l = c;
    if (which == 0) l.swiglu_limit = 7.0;
    if (which == 1) l.swiglu_alpha = 1.702;
    if (which == 2) l.swiglu_beta = 1.0;
    const Selection sel = select_fp8_moe_backend(l, kFp8Static128BlockSym, kFp8Dynamic128Sym, false,
                                                 cpu, OracleEnv());
    EXPECT_EQ(sel.backend, Fp8MoeBackend::kCpu) << which;
    bool rejected = false;
    for (const TraceEntry& e : sel.trace) {
      if (e.backend == Fp8MoeBackend::kCpuW8A8) {
        rejected = !e.supported && e.reason.find("SwiGLU") != std::string::npos;
      }
    }
    EXPECT_TRUE(rejected) << which;
  }
}

// =================================================================================================
// Pitfall 18: non-gated activations (w13 a single shard): the kernels agree with the reference bit
// for bit; off a CUDA-alike platform the layer is refused at init, never at the first forward.
// =================================================================================================

TEST(Pitfalls, P18_NonGatedActivationsAgreeAcrossKernels) {
  uint64_t seed = 1800;
  for (MoeActivation act :
       {MoeActivation::kRelu2NoMul, MoeActivation::kSiluNoMul, MoeActivation::kGeluTanhNoMul}) {
    for (bool quantised : {false, true}) {
      // W8A8 exact mode needs a power-of-two second quantisation for relu2: UE8M0 group scales.
      MoeTestSpec s = small_exact(block_scheme(quantised, quantised), ++seed);
      s.act.activation = act;
      s.E = 8;
      MoeTestProblem p = testing::make_problem(s);
      ASSERT_EQ(p.w13.size(1), s.I) << "non-gated w13 holds one shard";
      const Tensor expected = testing::reference_output(p);
      const Tensor got = run_impl(quantised ? w8a8() : w8a16(), p.args());
      const auto rep = testing::compare_bitwise(got, expected);
      EXPECT_TRUE(rep.ok) << s.name() << ": " << rep.str();
    }
  }
  // Through the layer: w13 holds one shard (the gate rows of a gated layer's weights here).
  CallerLayer c = make_caller_layer(4, 256, 128, 2);
  c.spec.config.activation = MoeActivation::kRelu2NoMul;
  Tensor w13 = Tensor::empty({4, 128, 256}, DType::kF8E4M3FN);
  Tensor s13 = Tensor::empty({4, 1, 2}, DType::kF32);
  for (int64_t e = 0; e < 4; ++e) {
    std::memcpy(w13.ptr<uint8_t>() + e * 128 * 256, c.w.w13.ptr<uint8_t>() + e * 256 * 256,
                128 * 256);
    std::memcpy(s13.ptr<float>() + e * 2, c.w.w13_scale.ptr<float>() + e * 4, 2 * sizeof(float));
  }
  c.w.w13 = w13;
  c.w.w13_scale = s13;
  // The oracle's choice off a CUDA-alike platform: refused when the layer is built (vLLM's
  // layer-level check), never at the first forward.
  Fp8MoeLayerOptions o;
  o.platform = Platform::parse("cpu");
  EXPECT_TRUE(throws_with<NotImplementedError>([&] { Fp8MoeLayer::from_tensors(c.spec, c.w, o); },
                                               {"is_act_and_mul=False"}));
  // On a simulated H200 with fp8moe's CPU kernels as the override: supported, and in agreement
  // with the reference.
  const Tensor x = testing::randn(7, 256, DType::kBF16, 0.1f, 1801);
  const Tensor logits = testing::randn(7, 4, DType::kF32, 1.0f, 1802);
  for (const auto& [kernel, w8a8_scheme] :
       std::vector<std::pair<std::string, bool>>{{"cpu_w8a16", false}, {"cpu_w8a8", true}}) {
    Fp8MoeLayer layer = Fp8MoeLayer::from_tensors(c.spec, c.w, layer_options(kernel, w8a8_scheme));
    EXPECT_EQ(layer.plan().activation.activation, MoeActivation::kRelu2NoMul);
    const Tensor out = layer.forward(x, logits);
    const ForwardCheck chk = check_forward(layer, x, logits, out);
    EXPECT_TRUE(chk.vs_reference.allclose) << kernel << ": " << chk.vs_reference.max_abs_err;
  }
}

// =================================================================================================
// Pitfall 19: a fused shared expert as an extra expert id >= E_routed: included in the grouping,
// gate / up order preserved (the kernels equal the reference bit for bit).
// =================================================================================================

TEST(Pitfalls, P19_SharedExpertAsAnExtraExpertId) {
  uint64_t seed = 1900;
  for (bool quantised : {false, true}) {
    MoeTestSpec s = small_exact(block_scheme(quantised), ++seed);
    s.M = 7;
    s.E = 5;  // 4 routed experts + the shared one (id 4)
    s.topk = 3;
    MoeTestProblem p = testing::make_problem(s);
    const int32_t shared = 4;
    for (int64_t t = 0; t < s.M; ++t) {
      int32_t* ids = p.topk_ids.ptr<int32_t>() + t * 3;
      float* w = p.topk_weights.ptr<float>() + t * 3;
      // Two distinct routed experts in [0, 4), the shared expert last with weight 1.
      ids[0] = static_cast<int32_t>(t % 4);
      ids[1] = static_cast<int32_t>((t + 1 + t / 4) % 4);
      ids[2] = shared;
      w[2] = 1.0f;
    }
    const FusedMoeArgs args = p.args();
    const Tensor expected = run_ref(args);
    ASSERT_TRUE(testing::compare_bitwise(run_ref_f32_reversed(args), expected).ok);
    const auto rep =
        testing::compare_bitwise(run_impl(quantised ? w8a8() : w8a16(), args), expected);
    EXPECT_TRUE(rep.ok) << rep.str();
    // The shared expert really contributes: dropping it (-1) changes every token.
    MoeTestProblem q = p;
    q.topk_ids = p.topk_ids.clone();
    for (int64_t t = 0; t < s.M; ++t) q.topk_ids.ptr<int32_t>()[t * 3 + 2] = -1;
    const Tensor without = run_ref(q.args());
    for (int64_t t = 0; t < s.M; ++t) EXPECT_FALSE(rows_equal(without, t, expected, t)) << t;
  }
}

// =================================================================================================
// Pitfall 20: padded rows full of NaN (torch.empty garbage): the valid rows are bit-identical to a
// clean run, on the CPU kernels too (RefScheme.GarbageInUnroutedRowsDoesNotLeak is the reference).
// =================================================================================================

TEST(Pitfalls, P20_NanInPaddedRowsDoesNotLeakOnCpuKernels) {
  struct Case {
    const ExpertsImpl* impl;
    WeightScaleKind weight;
    ActQuantKind act;
  };
  const Case cases[] = {
      {&w8a16(), WeightScaleKind::kBlock, ActQuantKind::kNone},
      {&w8a8(), WeightScaleKind::kBlock, ActQuantKind::kPerGroupDynamic},
      {&w8a8(), WeightScaleKind::kPerTensor, ActQuantKind::kPerTensorDynamic},
      {&w8a8(), WeightScaleKind::kPerChannel, ActQuantKind::kPerTokenDynamic},
  };
  uint64_t seed = 2000;
  for (const Case& c : cases) {
    MoeScheme sc;
    sc.weight = c.weight;
    sc.act = c.act;
    MoeTestSpec s = small_exact(sc, ++seed);
    s.M = 6;
    MoeTestProblem p = testing::make_problem(s);
    const Tensor clean = run_impl(*c.impl, p.args());
    MoeTestProblem q = p;
    q.x = p.x.clone();
    q.topk_ids = p.topk_ids.clone();
    for (int64_t t : {1, 4}) {
      for (int64_t k = 0; k < s.H; ++k) q.x.ptr<uint16_t>()[t * s.H + k] = 0x7FC0;
      for (int j = 0; j < s.topk; ++j) q.topk_ids.ptr<int32_t>()[t * s.topk + j] = -1;
    }
    const Tensor dirty = run_impl(*c.impl, q.args());
    for (int64_t t : {0, 2, 3, 5}) {
      EXPECT_TRUE(rows_equal(dirty, t, clean, t))
          << c.impl->name << " " << s.name() << " row " << t;
    }
  }
}

// =================================================================================================
// Pitfall 21: zero tokens through the layer (batch [0, H]) on every CPU implementation.
// =================================================================================================

TEST(Pitfalls, P21_ZeroTokensThroughTheLayer) {
  CallerLayer c = make_caller_layer(4, 256, 128, 2);
  for (const auto& [kernel, w8a8_scheme] : std::vector<std::pair<std::string, bool>>{
           {"ref", true}, {"cpu_w8a8", true}, {"cpu_w8a16", false}}) {
    SCOPED_TRACE(kernel);
    Fp8MoeLayer layer = Fp8MoeLayer::from_tensors(c.spec, c.w, layer_options(kernel, w8a8_scheme));
    const Tensor x = Tensor::empty({0, 256}, DType::kBF16);
    const Tensor logits = Tensor::empty({0, 4}, DType::kF32);
    const Tensor out = layer.forward(x, logits);
    EXPECT_EQ(out.sizes(), (std::vector<int64_t>{0, 256}));
    const Tensor ids = Tensor::empty({0, 2}, DType::kI32);
    const Tensor w = Tensor::empty({0, 2}, DType::kF32);
    Tensor out2 = Tensor::empty({0, 256}, DType::kBF16);
    EXPECT_NO_THROW(layer.forward_routed(x, ids, w, out2));
  }
}

// =================================================================================================
// Pitfall 24: expert id -1 from a dispatcher is ignored (never an index); other out-of-range ids
// are a clear error.
// =================================================================================================

TEST(Pitfalls, P24_MinusOneExpertIdsAreIgnoredThroughTheLayer) {
  CallerLayer c = make_caller_layer(4, 256, 128, 2);
  const int64_t M = 6;
  const Tensor x = testing::randn(M, 256, DType::kBF16, 0.1f, 2401);
  for (const auto& [kernel, w8a8_scheme] : std::vector<std::pair<std::string, bool>>{
           {"ref", true}, {"cpu_w8a8", true}, {"cpu_w8a16", false}}) {
    SCOPED_TRACE(kernel);
    Fp8MoeLayer layer = Fp8MoeLayer::from_tensors(c.spec, c.w, layer_options(kernel, w8a8_scheme));
    Tensor ids = Tensor::empty({M, 2}, DType::kI32);
    Tensor w = Tensor::empty({M, 2}, DType::kF32);
    for (int64_t t = 0; t < M; ++t) {
      ids.ptr<int32_t>()[2 * t] = static_cast<int32_t>(t % 4);
      ids.ptr<int32_t>()[2 * t + 1] = t % 2 ? -1 : static_cast<int32_t>((t + 1) % 4);
      w.ptr<float>()[2 * t] = 0.75f;
      w.ptr<float>()[2 * t + 1] = 0.25f;
    }
    Tensor padded = Tensor::empty({M, 256}, DType::kBF16);
    testing::poison(padded);
    layer.forward_routed(x, ids, w, padded);
    ASSERT_TRUE(testing::expect_all_written(padded));
    // The same call with the padded slots pointing at expert 3 with weight 0: identical output.
    Tensor ids0 = ids.clone(), w0 = w.clone();
    for (int64_t i = 0; i < ids0.numel(); ++i) {
      if (ids0.ptr<int32_t>()[i] == -1) {
        ids0.ptr<int32_t>()[i] = 3;
        w0.ptr<float>()[i] = 0.0f;
      }
    }
    Tensor zero_weight = Tensor::empty({M, 256}, DType::kBF16);
    layer.forward_routed(x, ids0, w0, zero_weight);
    const auto rep = testing::compare_bitwise(padded, zero_weight);
    EXPECT_TRUE(rep.ok) << rep.str();
    // Anything else outside [-1, E) is named, never read.
    for (int32_t bad : {-2, 4}) {
      Tensor idsb = ids.clone();
      idsb.ptr<int32_t>()[3] = bad;
      EXPECT_THROW(layer.forward_routed(x, idsb, w, padded), ValueError) << bad;
    }
  }
}

// =================================================================================================
// Pitfall 28: on SM80 no FP8-compute kernel is chosen: the W8A16 path (MARLIN) is, and the choice
// is logged; the layer plan computes fp8_w8a16 (activations unquantised).
// =================================================================================================

TEST(Pitfalls, P28_Sm80ChoosesW8A16AndLogsIt) {
  CallerLayer c = make_caller_layer(4, 256, 128, 2);
  std::vector<std::string> infos;
  const LogLevel saved = log_level();
  set_log_level(LogLevel::kInfo);
  set_log_sink([&](LogLevel level, std::string_view m) {
    if (level == LogLevel::kInfo) infos.emplace_back(m);
  });
  reset_log_once();
  Fp8MoeLayerOptions o;
  o.platform = Platform::parse("cuda:80");
  const Fp8MoeLayerPlan p = plan_fp8_moe_layer(c.spec, o);
  set_log_sink(nullptr);
  set_log_level(saved);
  ASSERT_TRUE(p.ok) << p.error_message;
  EXPECT_EQ(p.selection.backend, Fp8MoeBackend::kMarlin);
  EXPECT_EQ(p.quant_config_name, "fp8_w8a16");
  EXPECT_EQ(p.scheme.act, ActQuantKind::kNone);
  // Every class tried before MARLIN (the FP8-compute ones) was rejected, with a reason.
  for (const TraceEntry& e : p.selection.trace) {
    if (e.backend == Fp8MoeBackend::kMarlin) break;
    EXPECT_FALSE(e.supported) << backend_value(e.backend);
    EXPECT_FALSE(e.reason.empty()) << backend_value(e.backend);
  }
  bool logged = false;
  for (const auto& m : infos) logged |= m.find("Using MARLIN Fp8 MoE backend") != std::string::npos;
  EXPECT_TRUE(logged) << "the W8A16 choice is not logged";
}

// =================================================================================================
// Pitfalls 25 and 30: an explicit backend or kernel that cannot run the layer fails when the layer
// is built, naming it and why; a kernel override is honoured for every M or refused.
// =================================================================================================

TEST(Pitfalls, P25_ExplicitBackendThatCannotSupportFailsAtInit) {
  CallerLayer c = make_caller_layer(4, 256, 128, 2);
  // FLASHINFER_TRTLLM on an H200 does not run block FP8 (SM100 only).
  c.spec.config.moe_backend = "flashinfer_trtllm";
  Fp8MoeLayerOptions o;  // the oracle's choice (no --kernel override)
  o.platform = Platform::parse("cuda:90");
  const Fp8MoeLayerPlan p = plan_fp8_moe_layer(c.spec, o);
  EXPECT_FALSE(p.ok);
  EXPECT_EQ(p.failed_step, "select");
  EXPECT_NE(p.error_message.find("FLASHINFER_TRTLLM"), std::string::npos) << p.error_message;
  EXPECT_NE(p.error_message.find("since"), std::string::npos)
      << "the error gives the reason: " << p.error_message;
  EXPECT_TRUE(throws_with<ValueError>([&] { Fp8MoeLayer::from_tensors(c.spec, c.w, o); },
                                      {"FLASHINFER_TRTLLM"}));
}

TEST(Pitfalls, P30_KernelOverrideIsHonouredOrRefused) {
  CallerLayer c = make_caller_layer(4, 256, 128, 2);
  const Tensor x = testing::randn(6, 256, DType::kBF16, 0.1f, 3001);
  const Tensor logits = testing::randn(6, 4, DType::kF32, 1.0f, 3002);
  // Honoured for every M, also where the oracle's own per-M rule would switch classes
  // (TritonOrDeepGemm at M >= 128) and whatever scheme the oracle's backend computes: the override
  // computes its own backend's quant config ("force W8A16" on a W8A8 plan runs W8A16).
  for (const auto& [kernel, act] : std::vector<std::pair<std::string, ActQuantKind>>{
           {"cpu_w8a16", ActQuantKind::kNone}, {"cpu_w8a8", ActQuantKind::kPerGroupDynamic}}) {
    for (bool w8a8_scheme : {true, false}) {
      SCOPED_TRACE(kernel + (w8a8_scheme ? " on a W8A8 plan" : " on a W8A16 plan"));
      Fp8MoeLayerOptions o = layer_options(kernel, w8a8_scheme);
      o.env = OracleEnv::from_pairs({"VLLM_USE_DEEP_GEMM=1", "VLLM_USE_DEEP_GEMM_E8M0=0"});
      Fp8MoeLayer layer = Fp8MoeLayer::from_tensors(c.spec, c.w, o);
      EXPECT_EQ(layer.plan().implementation, kernel);
      EXPECT_EQ(layer.plan().scheme.act, act);
      for (int64_t M : {1, 8, 9, 127, 128, 4096}) EXPECT_EQ(layer.kernel_for(M).impl_name, kernel);
      const Tensor out = layer.forward(x, logits);
      const ForwardCheck chk = check_forward(layer, x, logits, out);
      EXPECT_FALSE(chk.reference_is_kernel);
      EXPECT_TRUE(chk.vs_reference.allclose) << chk.vs_reference.max_abs_err;
    }
  }
  // Refused when the kernel cannot compute the layer (hidden 144 is off the CPU kernels' 32 grid),
  // and an unknown name is refused: never silently replaced by another kernel.
  CallerLayer odd = make_caller_layer(4, 144, 128, 2);
  for (const char* kernel : {"cpu_w8a16", "cpu_w8a8"}) {
    EXPECT_TRUE(throws_with<NotImplementedError>(
        [&] { Fp8MoeLayer::from_tensors(odd.spec, odd.w, layer_options(kernel, true)); },
        {kernel, "hidden_dim"}));
  }
  Fp8MoeLayer ref_odd = Fp8MoeLayer::from_tensors(odd.spec, odd.w, layer_options("ref", true));
  EXPECT_EQ(ref_odd.plan().implementation, "ref");
  EXPECT_TRUE(throws_with<ValueError>(
      [&] { Fp8MoeLayer::from_tensors(c.spec, c.w, layer_options("w8a16", false)); },
      {"unknown --kernel 'w8a16'"}));
}

// =================================================================================================
// Pitfall 31: M thresholds (31/32/33, 63/64/65, 127/128/129, 255/256/257) with every token on one
// expert (the CPU kernels' row blocks and panel path), bit for bit against the reference.
// =================================================================================================

TEST(Pitfalls, P31_MThresholdsOnCpuKernelsMatchTheReference) {
  uint64_t seed = 3100;
  for (int64_t M : {31, 32, 33, 63, 64, 65, 127, 128, 129, 255, 256, 257}) {
    for (bool quantised : {false, true}) {
      MoeTestSpec s = small_exact(block_scheme(quantised), ++seed);
      s.M = M;
      s.E = 2;
      s.topk = 1;
      s.routing = RoutingPattern::kOneHotExpert;
      MoeTestProblem p = testing::make_problem(s);
      const Tensor expected = testing::reference_output(p);
      const auto rep =
          testing::compare_bitwise(run_impl(quantised ? w8a8() : w8a16(), p.args()), expected);
      ASSERT_TRUE(rep.ok) << s.name() << ": " << rep.str();
    }
  }
}

// =================================================================================================
// Pitfall 32: more tokens than the workspace holds: chunked execution with the workspace sized at
// construction (no allocation that grows with M), the same result as one call; a caller workspace
// that is too small is a clear error.
// =================================================================================================

TEST(Pitfalls, P32_TokensBeyondTheWorkspaceRunInChunks) {
  CallerLayer c = make_caller_layer(4, 256, 128, 2);
  for (const auto& [kernel, w8a8_scheme] :
       std::vector<std::pair<std::string, bool>>{{"cpu_w8a8", true}, {"cpu_w8a16", false}}) {
    SCOPED_TRACE(kernel);
    Fp8MoeLayer small =
        Fp8MoeLayer::from_tensors(c.spec, c.w, layer_options(kernel, w8a8_scheme, 16));
    Fp8MoeLayer big = Fp8MoeLayer::from_tensors(c.spec, c.w, layer_options(kernel, w8a8_scheme));
    const std::size_t owned = small.owned_workspace_bytes();
    ASSERT_GT(small.workspace_size(16), 0u);
    EXPECT_EQ(owned, small.workspace_size(16));
    EXPECT_GT(small.workspace_size(100), owned) << "100 tokens need more than 16 do";
    const Tensor x = testing::randn(100, 256, DType::kBF16, 0.1f, 3201);
    const Tensor logits = testing::randn(100, 4, DType::kF32, 1.0f, 3202);
    const Tensor chunked = small.forward(x, logits);
    EXPECT_EQ(small.owned_workspace_bytes(), owned) << "the workspace grew with M";
    const auto rep = testing::compare_bitwise(chunked, big.forward(x, logits));
    EXPECT_TRUE(rep.ok) << rep.str();
    std::vector<uint8_t> tiny(64);
    Tensor out = Tensor::empty({100, 256}, DType::kBF16);
    EXPECT_TRUE(throws_with<ValueError>(
        [&] { small.forward(x, logits, out, nullptr, tiny.data(), tiny.size()); }, {"workspace"}));
  }
}

// =================================================================================================
// Pitfall 35: a token's output is bitwise identical whatever the batch size (1, 4, 16, 64, 257) and
// its position in the batch, on the CPU kernels with per-token / per-group activation scales and
// W8A16. (Per-tensor dynamic activation scales depend on the whole batch by definition: see
// docs/PITFALLS.md.)
// =================================================================================================

TEST(Pitfalls, P35_BatchInvarianceOnCpuKernels) {
  CallerLayer c = make_caller_layer(8, 256, 128, 2);
  const int64_t M = 257;
  const Tensor x = testing::randn(M, 256, DType::kBF16, 0.1f, 3501);
  const Tensor logits = testing::randn(M, 8, DType::kF32, 1.0f, 3502);
  // The batch in reverse order.
  Tensor xr = Tensor::empty({M, 256}, DType::kBF16);
  Tensor lr = Tensor::empty({M, 8}, DType::kF32);
  for (int64_t t = 0; t < M; ++t) {
    std::memcpy(xr.ptr<uint16_t>() + t * 256, x.ptr<uint16_t>() + (M - 1 - t) * 256, 512);
    std::memcpy(lr.ptr<float>() + t * 8, logits.ptr<float>() + (M - 1 - t) * 8, 32);
  }
  for (const auto& [kernel, w8a8_scheme] :
       std::vector<std::pair<std::string, bool>>{{"cpu_w8a8", true}, {"cpu_w8a16", false}}) {
    SCOPED_TRACE(kernel);
    Fp8MoeLayer layer = Fp8MoeLayer::from_tensors(c.spec, c.w, layer_options(kernel, w8a8_scheme));
    const Tensor full = layer.forward(x, logits);
    for (int64_t n : {1, 4, 16, 64}) {
      Tensor out = Tensor::empty({n, 256}, DType::kBF16);
      layer.forward(first_rows(x, n), first_rows(logits, n), out);
      for (int64_t t = 0; t < n; ++t) {
        ASSERT_TRUE(rows_equal(out, t, full, t)) << "token " << t << " in a batch of " << n;
      }
    }
    const Tensor reversed = layer.forward(xr, lr);
    for (int64_t t = 0; t < M; ++t) {
      ASSERT_TRUE(rows_equal(reversed, M - 1 - t, full, t)) << "token " << t << " moved";
    }
  }
}

// Deterministic mode reaches the kernels: VLLM_BATCH_INVARIANT=1 on a simulated H200 selects
// TritonExperts (the only block-FP8 class that declares batch invariance; the DeepGEMM classes are
// rejected with "batch invariance"), and every call the layer makes carries the flag, so
// cuda_fused runs one configuration at every M (its GPU test: CudaBatchInvariance). Without the
// variable the flag stays off.
TEST(Pitfalls, P35_BatchInvariantModeReachesTheKernelArguments) {
  CallerLayer c = make_caller_layer(8, 256, 128, 2);
  const Tensor x = testing::randn(3, 256, DType::kBF16, 0.1f, 3503);
  const Tensor logits = testing::randn(3, 8, DType::kF32, 1.0f, 3504);
  Tensor out = Tensor::empty({3, 256}, DType::kBF16);
  for (const bool on : {false, true}) {
    SCOPED_TRACE(on ? "VLLM_BATCH_INVARIANT=1" : "unset");
    Fp8MoeLayerOptions o = layer_options("cpu_w8a8", true);
    if (on) o.env = OracleEnv::from_pairs({"VLLM_BATCH_INVARIANT=1"});
    const Fp8MoeLayerPlan plan = plan_fp8_moe_layer(c.spec, [&] {
      Fp8MoeLayerOptions q = o;
      q.kernel = "";  // the oracle's own choice
      return q;
    }());
    ASSERT_TRUE(plan.selected && plan.selection.kernel) << plan.error_message;
    EXPECT_EQ(std::string(plan.selection.kernel->name), "TritonExperts");
    EXPECT_EQ(plan.batch_invariant, on);
    const Fp8MoeLayer layer = Fp8MoeLayer::from_tensors(c.spec, c.w, o);
    EXPECT_EQ(layer.plan().batch_invariant, on);
    EXPECT_EQ(layer.make_args(x.view(), logits.view(), out.view()).batch_invariant, on);
    bool noted = false;
    for (const std::string& n : layer.plan().notes) noted |= n.find("VLLM_BATCH_INVARIANT") == 0;
    EXPECT_EQ(noted, on);
  }
  // A value vLLM cannot parse: the oracle raises (a plan note under the kernel override); the
  // layer runs without invariance and says so, never silently.
  Fp8MoeLayerOptions o = layer_options("cpu_w8a8", true);
  o.env = OracleEnv::from_pairs({"VLLM_BATCH_INVARIANT=x"});
  const Fp8MoeLayer layer = Fp8MoeLayer::from_tensors(c.spec, c.w, o);
  EXPECT_FALSE(layer.plan().batch_invariant);
  bool noted = false;
  for (const std::string& n : layer.plan().notes)
    noted |= n.find("VLLM_BATCH_INVARIANT is not an integer") == 0;
  EXPECT_TRUE(noted);
}

}  // namespace
}  // namespace fp8moe
