// The CPU experts (src/kernels/cpu/cpu_experts.hpp), "cpu_w8a16" and "cpu_w8a8", against the
// float64 reference on every instruction-set level this machine runs:
//   * exact mode, bit for bit: every scheme (block 128/64/32, per-tensor incl. shard scales,
//     per-channel; static/dynamic per-tensor, per-token and per-group activations, UE8M0, the
//     fused SiLU+quant path), activations, biases, bf16/f32, routing generators (uniform, every
//     expert hit, one hot expert, empty experts, router logits, padded slots, EP), M = 0;
//   * statistical mode within vLLM's block-FP8 tolerance (atol = rtol = 0.035), including row
//     counts that take the panel path and more than one row block;
//   * determinism: bitwise identical run to run and for 1 and 2 threads;
//   * the align/sort step, the support queries, the workspace (canaries) and the errors.
#include <gtest/gtest.h>
#include <omp.h>

#include <cstring>
#include <string>
#include <vector>

#include "common/moe_testing.hpp"
#include "fp8moe/error.hpp"
#include "fp8moe/quant_key.hpp"
#include "kernels/cpu/cpu_experts.hpp"
#include "kernels/cpu/cpu_kernels.hpp"
#include "kernels/cpu/cpu_moe_align.hpp"
#include "kernels/registry.hpp"

namespace fp8moe::cpu {
namespace {

using testing::MoeTestMode;
using testing::MoeTestProblem;
using testing::MoeTestSpec;
using testing::RoutingPattern;

// Workspace with canary bytes on both sides.
struct Workspace {
  static constexpr std::size_t kGuard = 256;
  static constexpr uint8_t kCanary = 0x5A;
  std::vector<uint8_t> bytes;
  std::size_t size = 0;
  explicit Workspace(std::size_t n) : bytes(n + 2 * kGuard, kCanary), size(n) {
    // Poison the payload so that nothing depends on zeroed scratch.
    std::memset(bytes.data() + kGuard, 0xC3, n);
  }
  void* data() { return size ? bytes.data() + kGuard : nullptr; }
  bool intact() const {
    for (std::size_t i = 0; i < kGuard; ++i) {
      if (bytes[i] != kCanary || bytes[kGuard + size + i] != kCanary) return false;
    }
    return true;
  }
};

const ExpertsImpl& impl_of(bool w8a8) {
  return w8a8 ? cpu_w8a8_experts_impl() : cpu_w8a16_experts_impl();
}

// Runs `impl` on the problem's args into p.out (poisoned first); returns a copy of the output.
Tensor run_impl(const ExpertsImpl& impl, MoeTestProblem& p, int threads) {
  const FusedMoeArgs args = p.args();
  const std::size_t n = impl.workspace_size(args);
  Workspace ws(n);
  testing::poison(p.out);
  const int saved = omp_get_max_threads();
  omp_set_num_threads(threads);
  impl.run(args, ws.data());
  omp_set_num_threads(saved);
  EXPECT_TRUE(ws.intact()) << impl.name << ": workspace canaries overwritten";
  return p.out.clone();
}

std::string where(const ExpertsImpl& impl, Isa isa, const MoeTestSpec& s, int threads) {
  return std::string(impl.name) + " on " + std::string(isa_name(isa)) + " with " +
         std::to_string(threads) + " threads: " + s.name();
}

// Thread counts to run a level with: 1 everywhere, and 2 on the best level (the levels share the
// driver, so one multi-threaded level covers the work distribution; keeps the suite fast).
std::vector<int> thread_counts(Isa isa) {
  if (isa == supported_isas().front()) return {1, 2};
  return {1};
}

// Exact mode: every level, bit for bit against the reference (on problem p, built from spec).
void expect_exact(MoeTestProblem p, const MoeTestSpec& spec, bool w8a8) {
  const Tensor expected = testing::reference_output(p);
  const ExpertsImpl& impl = impl_of(w8a8);
  for (Isa isa : supported_isas()) {
    ScopedIsa forced(isa);
    for (int threads : thread_counts(isa)) {
      const Tensor got = run_impl(impl, p, threads);
      const auto written = testing::expect_all_written(got);
      ASSERT_TRUE(written.ok) << where(impl, isa, spec, threads) << ": " << written.message;
      const auto rep = testing::compare_bitwise(got, expected);
      ASSERT_TRUE(rep.ok) << where(impl, isa, spec, threads) << ": " << rep.str();
    }
  }
}
void expect_exact(const MoeTestSpec& spec, bool w8a8) {
  expect_exact(testing::make_problem(spec), spec, w8a8);
}

// Statistical mode: within atol = rtol = 0.035 on every level; on the best level also identical
// for 1 and 2 threads and run to run.
void expect_close(const MoeTestSpec& spec, bool w8a8) {
  MoeTestProblem p = testing::make_problem(spec);
  const Tensor expected = testing::reference_output(p);
  const ExpertsImpl& impl = impl_of(w8a8);
  for (Isa isa : supported_isas()) {
    ScopedIsa forced(isa);
    const Tensor one = run_impl(impl, p, 1);
    const auto rep = testing::compare_close(one, expected, 0.035, 0.035);
    ASSERT_TRUE(rep.ok) << where(impl, isa, spec, 1) << ": " << rep.str();
    if (thread_counts(isa).size() < 2) continue;
    const Tensor two = run_impl(impl, p, 2);
    const Tensor again = run_impl(impl, p, 2);
    ASSERT_TRUE(testing::compare_bitwise(two, one).ok)
        << where(impl, isa, spec, 2) << ": differs from the 1-thread result";
    ASSERT_TRUE(testing::compare_bitwise(again, two).ok)
        << where(impl, isa, spec, 2) << ": differs run to run";
  }
}

MoeScheme block_scheme(int64_t b, bool w8a8, bool ue8m0 = false) {
  MoeScheme s;
  s.weight = WeightScaleKind::kBlock;
  s.block_n = s.block_k = b;
  s.act = w8a8 ? ActQuantKind::kPerGroupDynamic : ActQuantKind::kNone;
  s.group_k = b;
  s.ue8m0_scales = ue8m0;
  return s;
}

MoeScheme scheme(WeightScaleKind w, ActQuantKind act) {
  MoeScheme s;
  s.weight = w;
  s.act = act;
  return s;
}

MoeTestSpec small_spec(const MoeScheme& sc, uint64_t seed) {
  MoeTestSpec s;
  s.M = 5;
  s.E = 4;
  s.H = 256;
  s.I = 128;
  s.topk = 2;
  s.scheme = sc;
  s.mode = MoeTestMode::kExact;
  s.seed = seed;
  return s;
}

// ---- align/sort --------------------------------------------------------------------------------

TEST(CpuMoeAlign, GroupsSlotsByLocalExpertInSlotOrder) {
  // 4 tokens x 3 slots; global experts 0..5, local = global / 2 for even ids, odd ids on another
  // rank; -1 padded.
  const std::vector<int32_t> ids = {4, 0, 2, 1, 4, -1, 2, 2, 0, 5, 4, 0};
  const std::vector<int32_t> map = {0, -1, 1, -1, 2, -1};
  std::vector<int32_t> counts(3), sorted(ids.size()), pos(ids.size());
  std::vector<int64_t> offsets(4);
  const int64_t v = moe_align_cpu(ids.data(), 12, map.data(), 6, 3, counts.data(), offsets.data(),
                                  sorted.data(), pos.data());
  EXPECT_EQ(v, 9);
  EXPECT_EQ(counts, (std::vector<int32_t>{3, 3, 3}));
  EXPECT_EQ(offsets, (std::vector<int64_t>{0, 3, 6, 9}));
  EXPECT_EQ(std::vector<int32_t>(sorted.begin(), sorted.begin() + 9),
            (std::vector<int32_t>{1, 8, 11, 2, 6, 7, 0, 4, 10}));
  EXPECT_EQ(pos, (std::vector<int32_t>{6, 0, 3, -1, 7, -1, 4, 5, 1, -1, 8, 2}));
  // Identity map, an expert with no tokens, and no slots at all.
  const std::vector<int32_t> ids2 = {2, 0, 2};
  std::vector<int32_t> c2(3), s2(3), p2(3);
  std::vector<int64_t> o2(4);
  EXPECT_EQ(
      moe_align_cpu(ids2.data(), 3, nullptr, 3, 3, c2.data(), o2.data(), s2.data(), p2.data()), 3);
  EXPECT_EQ(c2, (std::vector<int32_t>{1, 0, 2}));
  EXPECT_EQ(s2, (std::vector<int32_t>{1, 0, 2}));
  EXPECT_EQ(
      moe_align_cpu(ids2.data(), 0, nullptr, 3, 3, c2.data(), o2.data(), s2.data(), p2.data()), 0);
  EXPECT_EQ(o2, (std::vector<int64_t>{0, 0, 0, 0}));
}

// ---- registry and support queries --------------------------------------------------------------

TEST(CpuExperts, RegisteredAndAvailable) {
  EXPECT_EQ(find_experts_impl("cpu_w8a16"), &cpu_w8a16_experts_impl());
  EXPECT_EQ(find_experts_impl("cpu_w8a8"), &cpu_w8a8_experts_impl());
  EXPECT_TRUE(experts_impl_available("cpu_w8a16"));
  EXPECT_TRUE(experts_impl_available("cpu_w8a8"));
  EXPECT_GE(cpu_max_threads(), 1);
}

MoeConfig cpu_config(int H = 7168, int I = 2048) {
  MoeConfig c;
  c.num_experts = 256;
  c.experts_per_token = 8;
  c.hidden_dim = H;
  c.intermediate_size = I;
  c.num_local_experts = 256;
  c.num_logical_experts = 256;
  c.device = "cpu";
  c.post_init();
  return c;
}

TEST(CpuExperts, SupportQueriesSayWhatEachKernelComputes) {
  const MoeConfig c = cpu_config();
  const QuantKey b64 = create_fp8_quant_key(true, GroupShape(64, 64));
  const QuantKey a64 = create_fp8_quant_key(false, GroupShape(1, 64));
  // W8A16: block (128 and refined), per-tensor, per-channel weights; no activation key.
  EXPECT_TRUE(cpu_w8a16_supports_config(c, kFp8Static128BlockSym, std::nullopt));
  EXPECT_TRUE(cpu_w8a16_supports_config(c, b64, std::nullopt));
  EXPECT_TRUE(cpu_w8a16_supports_config(c, kFp8StaticTensorSym, std::nullopt));
  EXPECT_TRUE(cpu_w8a16_supports_config(c, kFp8StaticChannelSym, std::nullopt));
  const Support w16_act = cpu_w8a16_supports_config(c, kFp8Static128BlockSym, kFp8Dynamic128Sym);
  EXPECT_FALSE(w16_act);
  EXPECT_NE(w16_act.reason.find("cpu_w8a8"), std::string::npos) << w16_act.reason;
  // W8A8: B128, refined, TT, TD, CTok.
  EXPECT_TRUE(cpu_w8a8_supports_config(c, kFp8Static128BlockSym, kFp8Dynamic128Sym));
  EXPECT_TRUE(cpu_w8a8_supports_config(c, b64, a64));
  EXPECT_TRUE(cpu_w8a8_supports_config(c, kFp8StaticTensorSym, kFp8StaticTensorSym));
  EXPECT_TRUE(cpu_w8a8_supports_config(c, kFp8StaticTensorSym, kFp8DynamicTensorSym));
  EXPECT_TRUE(cpu_w8a8_supports_config(c, kFp8StaticChannelSym, kFp8DynamicTokenSym));
  EXPECT_FALSE(cpu_w8a8_supports_config(c, kFp8Static128BlockSym, std::nullopt));
  EXPECT_FALSE(cpu_w8a8_supports_config(c, b64, kFp8Dynamic128Sym));  // group != block_k
  // Neither: MXFP8, e4m3fnuz, sizes off the 32 grid, gated relu2, custom routing.
  EXPECT_FALSE(cpu_w8a16_supports_config(c, kMxfp8Static, std::nullopt));
  EXPECT_FALSE(cpu_w8a8_supports_config(c, kMxfp8Static, kMxfp8Dynamic));
  const QuantKey fnuz =
      create_fp8_quant_key(true, GroupShape(128, 128), true, KeyDType::kF32, KeyDType::kF8E4M3FNUZ);
  EXPECT_FALSE(cpu_w8a16_supports_config(c, fnuz, std::nullopt));
  EXPECT_FALSE(
      cpu_w8a16_supports_config(cpu_config(7168 + 16), kFp8Static128BlockSym, std::nullopt));
  MoeConfig relu2 = c;
  relu2.activation = MoeActivation::kRelu2;
  EXPECT_FALSE(cpu_w8a16_supports_config(relu2, kFp8Static128BlockSym, std::nullopt));
  MoeConfig custom = c;
  custom.routing_method = RoutingMethodType::kCustom;
  EXPECT_FALSE(cpu_w8a8_supports_config(custom, kFp8Static128BlockSym, kFp8Dynamic128Sym));
  // Every refusal says who refused and why.
  const Support s = cpu_w8a16_supports_config(c, kMxfp8Static, std::nullopt);
  EXPECT_NE(s.reason.find("cpu_w8a16"), std::string::npos) << s.reason;
  EXPECT_NE(s.reason.find("MXFP8"), std::string::npos) << s.reason;
}

// ---- exact mode
// ----------------------------------------------------------------------------------

TEST(CpuExpertsExact, BlockSchemes) {  // pitfalls 6, 12, 36
  for (bool w8a8 : {false, true}) {
    for (int64_t b : {128, 64, 32}) {
      expect_exact(small_spec(block_scheme(b, w8a8), 10 + b), w8a8);
    }
  }
  expect_exact(small_spec(block_scheme(128, true, /*ue8m0=*/true), 11), true);
}

TEST(CpuExpertsExact, PerTensorAndPerChannelSchemes) {  // pitfall 9
  // W8A16 over per-tensor (one scale, and one per gate/up shard) and per-channel weights.
  expect_exact(small_spec(scheme(WeightScaleKind::kPerTensor, ActQuantKind::kNone), 20), false);
  MoeTestSpec shard = small_spec(scheme(WeightScaleKind::kPerTensor, ActQuantKind::kNone), 21);
  shard.w13_shard_scales = true;
  expect_exact(shard, false);
  expect_exact(small_spec(scheme(WeightScaleKind::kPerChannel, ActQuantKind::kNone), 22), false);
  // W8A8: TT, TD, CTok, and per-group activations over per-tensor weights.
  expect_exact(small_spec(scheme(WeightScaleKind::kPerTensor, ActQuantKind::kPerTensorStatic), 23),
               true);
  MoeTestSpec td =
      small_spec(scheme(WeightScaleKind::kPerTensor, ActQuantKind::kPerTensorDynamic), 24);
  td.w13_shard_scales = true;
  expect_exact(td, true);
  expect_exact(small_spec(scheme(WeightScaleKind::kPerChannel, ActQuantKind::kPerTokenDynamic), 25),
               true);
  MoeScheme grp = scheme(WeightScaleKind::kPerTensor, ActQuantKind::kPerGroupDynamic);
  grp.group_k = 64;
  expect_exact(small_spec(grp, 26), true);
}

TEST(CpuExpertsExact, Activations) {  // pitfalls 17, 18
  struct Case {
    MoeActivation act;
    std::optional<double> clamp;
    double alpha, beta;
  };
  const Case cases[] = {
      {MoeActivation::kSilu, std::nullopt, 1.0, 0.0},
      {MoeActivation::kGelu, std::nullopt, 1.0, 0.0},
      {MoeActivation::kGeluTanh, std::nullopt, 1.0, 0.0},
      {MoeActivation::kSwigluOai, std::nullopt, 1.0, 0.0},
      {MoeActivation::kSwigluOaiUninterleave, 7.0, 1.702, 1.0},
      {MoeActivation::kSiluNoMul, std::nullopt, 1.0, 0.0},
      {MoeActivation::kGeluTanhNoMul, std::nullopt, 1.0, 0.0},
  };
  uint64_t seed = 30;
  for (const Case& c : cases) {
    // W8A16 for every activation; W8A8 (same epilogue code, plus the h quantisation) for the
    // packed, interleaved and non-gated layouts.
    for (bool w8a8 : {false, true}) {
      if (w8a8 && c.act != MoeActivation::kSilu && c.act != MoeActivation::kSwigluOai &&
          c.act != MoeActivation::kSiluNoMul) {
        continue;
      }
      MoeTestSpec s = small_spec(block_scheme(128, w8a8), ++seed);
      s.act.activation = c.act;
      s.act.clamp_limit = c.clamp;
      s.act.alpha = c.alpha;
      s.act.beta = c.beta;
      expect_exact(s, w8a8);
    }
  }
  // SiLU with a clamp limit (448 * 2^j >= G: the up clamp is active on the anchors).
  MoeTestSpec clamp = small_spec(block_scheme(128, false), 40);
  clamp.act.clamp_limit = 448.0 * 32;
  expect_exact(clamp, false);
  // The snapshot's fused SiLU+quant path (W8A8, per-group).
  MoeScheme fused = block_scheme(128, true);
  fused.fuse_silu_quant = true;
  expect_exact(small_spec(fused, 41), true);
}

TEST(CpuExpertsExact, DtypesBiasesAndRouterWeightOnInput) {
  for (bool w8a8 : {false, true}) {
    MoeTestSpec f32 = small_spec(block_scheme(128, w8a8), 50 + w8a8);
    f32.x_dtype = DType::kF32;
    f32.bias = true;
    expect_exact(f32, w8a8);
    MoeTestSpec on_input = small_spec(block_scheme(128, w8a8), 52 + w8a8);
    on_input.topk = 1;
    on_input.apply_router_weight_on_input = true;
    on_input.bias = true;
    expect_exact(on_input, w8a8);
  }
}

TEST(CpuExpertsExact, RoutingGeneratorsAndEdgeCases) {  // pitfalls 21, 24
  // The routing generators and edge cases, shared out between the two kernels (the grouping and
  // the reduction are common code; uniform routing runs in every other test).
  uint64_t seed = 60;
  const auto spec = [&](bool w8a8) { return small_spec(block_scheme(128, w8a8), ++seed); };
  MoeTestSpec hit = spec(false);
  hit.routing = RoutingPattern::kEveryExpertHit;
  expect_exact(hit, false);
  MoeTestSpec empty_experts = spec(true);
  empty_experts.routing = RoutingPattern::kSomeExpertsEmpty;
  expect_exact(empty_experts, true);
  MoeTestSpec hot = spec(false);
  hot.routing = RoutingPattern::kOneHotExpert;
  expect_exact(hot, false);
  for (bool w8a8 : {false, true}) {
    MoeTestSpec logits = spec(w8a8);  // the kernel routes the logits itself
    logits.routing = RoutingPattern::kLogits;
    expect_exact(logits, w8a8);
  }
  MoeTestSpec padded = spec(true);
  padded.padded_slots = 5;
  expect_exact(padded, true);
  MoeTestSpec ep = spec(false);  // expert parallelism: half the experts live on another rank
  ep.E = 8;
  ep.ep_size = 2;
  ep.ep_rank = 1;
  expect_exact(ep, false);
  MoeTestSpec one = spec(true);
  one.M = 1;
  expect_exact(one, true);
  for (bool w8a8 : {false, true}) {
    MoeTestSpec none = spec(w8a8);
    none.M = 0;
    expect_exact(none, w8a8);
  }
}

// Caller-supplied ids may name one expert in several slots of a token (vLLM's kernels take each
// (token, slot) pair on its own): the expert then holds more pairs than there are tokens, and
// the reference sums the pairs as given.
TEST(CpuExpertsExact, RepeatedExpertIdsInATokenAreSeparatePairs) {
  for (bool w8a8 : {false, true}) {
    MoeTestSpec s = small_spec(block_scheme(128, w8a8), 90 + w8a8);
    s.M = 3;
    s.topk = 4;
    MoeTestProblem p = testing::make_problem(s);
    const Tensor as_generated = testing::reference_output(p);
    // token 0: expert 3 in all four slots; token 1: 3, 3, 1, 1; token 2: four different experts
    const int32_t ids[12] = {3, 3, 3, 3, 3, 3, 1, 1, 0, 1, 2, 3};
    ASSERT_EQ(p.topk_ids.numel(), 12);
    for (int i = 0; i < 12; ++i) p.topk_ids.ptr<int32_t>()[i] = ids[i];
    // the ids are what the reference computes from (else this test could not fail)
    ASSERT_FALSE(testing::compare_bitwise(testing::reference_output(p), as_generated).ok);
    expect_exact(p, s, w8a8);
  }
}

// ---- statistical mode -------------------------------------------------------------------------

TEST(CpuExpertsStatistical, BlockAndTensorSchemesWithinVllmTolerance) {
  uint64_t seed = 80;
  for (bool w8a8 : {false, true}) {
    MoeTestSpec s;
    s.M = 9;
    s.E = 4;
    s.H = 384;  // three K-blocks, a 64-wide remainder for the 128-wide K chunks
    s.I = 128;
    s.topk = 3;
    s.mode = MoeTestMode::kStatistical;
    s.seed = ++seed;
    s.scheme = block_scheme(64, w8a8);
    s.bias = true;
    expect_close(s, w8a8);
    s.scheme = w8a8 ? scheme(WeightScaleKind::kPerChannel, ActQuantKind::kPerTokenDynamic)
                    : scheme(WeightScaleKind::kPerTensor, ActQuantKind::kNone);
    s.bias = false;
    s.seed = ++seed;
    expect_close(s, w8a8);
  }
}

TEST(CpuExpertsStatistical, ManyRowsPerExpertPanelPathAndRowBlocks) {
  // One hot expert gets every token: 130 rows, i.e. the panel path and two 128-row blocks.
  for (bool w8a8 : {false, true}) {
    MoeTestSpec s;
    s.M = 130;
    s.E = 2;
    s.H = 128;
    s.I = 128;
    s.topk = 1;
    s.mode = MoeTestMode::kStatistical;
    s.routing = RoutingPattern::kOneHotExpert;
    s.scheme = block_scheme(128, w8a8);
    s.seed = 90 + w8a8;
    expect_close(s, w8a8);
  }
}

// ---- errors -------------------------------------------------------------------------------------

TEST(CpuExperts, ErrorsAreClear) {
  MoeTestSpec s = small_spec(block_scheme(128, true), 100);
  MoeTestProblem p = testing::make_problem(s);
  FusedMoeArgs args = p.args();
  // The W8A16 kernel refuses a quantised-activation scheme at run time too.
  EXPECT_THROW(cpu_w8a16_experts_impl().workspace_size(args), NotImplementedError);
  EXPECT_THROW(cpu_w8a16_experts_impl().run(args, nullptr), NotImplementedError);
  // Null workspace.
  EXPECT_GT(cpu_w8a8_experts_impl().workspace_size(args), 0u);
  EXPECT_THROW(cpu_w8a8_experts_impl().run(args, nullptr), ValueError);
  // MXFP8 and fnuz schemes are refused, never computed wrongly.
  FusedMoeArgs mx = args;
  mx.scheme.weight = WeightScaleKind::kMx;
  EXPECT_FALSE(cpu_supports_args(mx, true));
  FusedMoeArgs fnuz = args;
  fnuz.scheme.fp8 = DType::kF8E4M3FNUZ;
  EXPECT_FALSE(cpu_supports_args(fnuz, true));
  // Malformed arguments are ValueErrors from the shared validation.
  FusedMoeArgs bad = args;
  bad.out = TensorView();
  EXPECT_THROW(cpu_w8a8_experts_impl().workspace_size(bad), ValueError);
}

}  // namespace
}  // namespace fp8moe::cpu
