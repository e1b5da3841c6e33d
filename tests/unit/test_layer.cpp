// Fp8MoeLayer end to end on the example checkpoint's shape (written into a temporary directory):
// TP 1, a refined TP split (TP 4: 640 / 4 = 160 -> 32x32 blocks), the pad path (TP 8 with an
// explicit backend), EP; forward() against the float64 reference computed independently from the
// checkpoint; the TP ranks' summed outputs against TP 1; chunking, workspaces, bad input.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>

#include "common/moe_testing.hpp"
#include "fp8moe/checkpoint.hpp"
#include "fp8moe/error.hpp"
#include "fp8moe/layer.hpp"
#include "fp8moe/numerics.hpp"
#include "kernels/cpu/cpu_kernels.hpp"
#include "kernels/ref/ref.hpp"
#include "kernels/registry.hpp"
#include "numerics/quant.hpp"
#include "unit/test_checkpoint_util.hpp"

namespace fp8moe {
namespace {

using test::TempDir;
using test::throws_with;

// One example checkpoint per test process (H 256, I 640, E 8, top-2, 2 layers, 128x128 blocks).
const std::string& example_dir() {
  static TempDir dir;
  static const bool written = [] {
    write_example_checkpoint(dir.path());
    return true;
  }();
  (void)written;
  return dir.path();
}

Fp8MoeLayerOptions ref_options() {
  Fp8MoeLayerOptions o;
  o.kernel = "ref";
  return o;
}

// The reference computed without the layer: the checkpoint loader, the shard the test derives by
// hand, the routing from config.json, ref::fused_moe with the default block-128 scheme.
Tensor independent_reference(const TensorView& x, const TensorView& logits, int tp, int rank,
                             std::array<int64_t, 2> block,
                             std::optional<std::array<int64_t, 2>> refine, bool padded,
                             int64_t local) {
  const ModelConfig model = load_model_config(example_dir());
  const SafetensorsCheckpoint ck = SafetensorsCheckpoint::open(example_dir());
  const TpShard shard = make_tp_shard(640, 256, tp, rank, {128, 128}, block, refine, padded, local);
  const LoadedMoeLayer l = load_moe_layer(ck, model, 0, shard, place_experts(8, 1, 0));
  FusedMoeArgs a;
  a.x = x;
  a.router_logits = logits;
  a.routing.method = model.routing_method;
  a.routing.topk = 2;
  a.routing.renormalize = model.renormalize;
  a.routing.scoring_func = model.scoring_func;
  a.weights = l.weights();
  a.scheme.weight = WeightScaleKind::kBlock;
  a.scheme.block_n = block[0];
  a.scheme.block_k = block[1];
  a.scheme.act = ActQuantKind::kPerGroupDynamic;
  a.scheme.group_k = block[1];
  Tensor out = Tensor::empty({x.size(0), x.size(1)}, x.dtype);
  a.out = out.view();
  ref::fused_moe(a);
  return out;
}

TEST(Layer, PlanTp1OnThisMachine) {
  CheckpointLayerRequest req;
  const ModelConfig model = load_model_config(example_dir());
  const Fp8MoeLayerPlan p = plan_fp8_moe_layer(checkpoint_layer_spec(model, req), {});
  ASSERT_TRUE(p.ok) << p.error_message;
  EXPECT_EQ(p.resolution, "keep");
  EXPECT_EQ(p.local_intermediate, 640);
  EXPECT_EQ(*p.block, (std::array<int64_t, 2>{128, 128}));
  EXPECT_EQ(quant_key_name(p.weight_key), "kFp8Static128BlockSym");
  EXPECT_EQ(quant_key_name(p.activation_key), "kFp8Dynamic128Sym");
  EXPECT_TRUE(p.selected);
  // On the detected CPU the oracle returns NONE until a CPU kernel is registered, and then one of
  // the CPU backends; either way the plan says which, and never pretends.
  if (p.selection.backend == Fp8MoeBackend::kNone) {
    EXPECT_FALSE(p.runnable);
    EXPECT_NE(p.not_runnable_reason.find("NONE"), std::string::npos) << p.not_runnable_reason;
    EXPECT_TRUE(throws_with<NotImplementedError>(
        [] { Fp8MoeLayer::from_checkpoint(example_dir(), {}); }, {"NONE", "--kernel ref"}));
  } else {
    EXPECT_TRUE(p.selection.backend == Fp8MoeBackend::kCpu ||
                p.selection.backend == Fp8MoeBackend::kCpuW8A8)
        << backend_value(p.selection.backend);
    EXPECT_TRUE(p.runnable) << p.not_runnable_reason;
  }
  const auto text = layer_plan_to_text(p);
  ASSERT_FALSE(text.empty());
  const auto j = layer_plan_to_json(p);
  EXPECT_EQ(j["resolution"]["mode"], "keep");
}

TEST(Layer, Tp1ForwardMatchesTheIndependentReferenceBitwise) {
  Fp8MoeLayer layer = Fp8MoeLayer::from_checkpoint(example_dir(), {}, ref_options());
  EXPECT_EQ(layer.plan().implementation, "ref");
  EXPECT_EQ(layer.hidden_size(), 256);
  EXPECT_EQ(layer.num_experts(), 8);
  EXPECT_EQ(layer.local_intermediate(), 640);
  const Tensor x = testing::randn(13, 256, DType::kBF16, 0.1f, 1);
  const Tensor logits = testing::randn(13, 8, DType::kF32, 1.0f, 2);
  Tensor out = Tensor::empty({13, 256}, DType::kBF16);
  testing::poison(out);
  layer.forward(x, logits, out);
  EXPECT_TRUE(testing::expect_all_written(out));
  const Tensor expected =
      independent_reference(x, logits, 1, 0, {128, 128}, std::nullopt, false, 640);
  const auto c = testing::compare_bitwise(out, expected);
  EXPECT_TRUE(c.ok) << c.str();
  // check_forward: the reference is the kernel, and FP8 costs little against the dequantised layer.
  const ForwardCheck chk = check_forward(layer, x, logits, out);
  EXPECT_TRUE(chk.reference_is_kernel);
  EXPECT_TRUE(chk.vs_reference.bitwise_equal);
  EXPECT_TRUE(chk.vs_unquantized.allclose) << chk.vs_unquantized.max_abs_err;
  EXPECT_GT(chk.vs_unquantized.mean_rel_abs_err, 0.0);  // activation quantisation is not free
  EXPECT_LT(chk.vs_unquantized.mean_rel_abs_err, 0.05);
  EXPECT_NE(chk.unquantized_weights.find("dequantised"), std::string::npos);
}

// The oracle's own choice (a CPU kernel once one is registered) against the reference.
TEST(Layer, OracleChoiceAgreesWithTheReference) {
  const ModelConfig model = load_model_config(example_dir());
  const Fp8MoeLayerPlan p = plan_fp8_moe_layer(checkpoint_layer_spec(model, {}), {});
  if (!p.runnable)
    GTEST_SKIP() << "no implementation of the oracle's choice here: " << p.not_runnable_reason;
  Fp8MoeLayer layer = Fp8MoeLayer::from_checkpoint(example_dir(), {});
  const Tensor x = testing::randn(37, 256, DType::kBF16, 0.1f, 3);
  const Tensor logits = testing::randn(37, 8, DType::kF32, 1.0f, 4);
  const Tensor out = layer.forward(x, logits);
  const ForwardCheck chk = check_forward(layer, x, logits, out);
  EXPECT_TRUE(chk.vs_reference.allclose)
      << layer.plan().implementation << ": max abs " << chk.vs_reference.max_abs_err;
}

TEST(Layer, RefinedTp4RanksSumToTp1) {  // pitfall 3 (I=640, TP 4 refines)
  const Tensor x = testing::randn(9, 256, DType::kBF16, 0.1f, 5);
  const Tensor logits = testing::randn(9, 8, DType::kF32, 1.0f, 6);
  Fp8MoeLayer whole = Fp8MoeLayer::from_checkpoint(example_dir(), {}, ref_options());
  const Tensor full = whole.forward(x, logits);
  std::vector<float> sum(9 * 256, 0.0f);
  for (int r = 0; r < 4; ++r) {
    CheckpointLayerRequest req;
    req.tp_size = 4;
    req.rank = r;
    Fp8MoeLayer layer = Fp8MoeLayer::from_checkpoint(example_dir(), req, ref_options());
    const Fp8MoeLayerPlan& p = layer.plan();
    ASSERT_EQ(p.resolution, "refine") << p.resolution_why;
    EXPECT_EQ(*p.block, (std::array<int64_t, 2>{32, 32}));
    EXPECT_EQ(*p.refine, (std::array<int64_t, 2>{4, 4}));
    EXPECT_EQ(p.local_intermediate, 160);
    EXPECT_EQ(p.scheme.group_k, 32);  // refined blocks quantise activations per 1x32 group
    EXPECT_EQ(quant_key_name(p.weight_key), create_fp8_quant_key(true, {32, 32}).str());
    const Tensor out = layer.forward(x, logits);
    // Each rank equals the reference on the hand-derived refined shard, bit for bit.
    const Tensor expected =
        independent_reference(x, logits, 4, r, {32, 32}, std::array<int64_t, 2>{4, 4}, false, 160);
    const auto c = testing::compare_bitwise(out, expected);
    EXPECT_TRUE(c.ok) << "rank " << r << ": " << c.str();
    for (int64_t i = 0; i < out.numel(); ++i) {
      sum[i] += numerics::bf16_to_float(out.ptr<uint16_t>()[i]);
    }
  }
  Tensor summed = Tensor::empty({9, 256}, DType::kBF16);
  for (int64_t i = 0; i < summed.numel(); ++i) {
    summed.ptr<uint16_t>()[i] = numerics::float_to_bf16(sum[i]);
  }
  // Refined blocks change the activation quantisation (1x32 groups), so not bitwise.
  const auto c = testing::compare_close(summed, full, 0.035, 0.035);
  EXPECT_TRUE(c.ok) << c.str();
  EXPECT_FALSE(testing::compare_bitwise(summed, full).ok);
}

TEST(Layer, PaddedTp8RanksSumToTp1) {  // pitfalls 3 and 8
  const Tensor x = testing::randn(6, 256, DType::kBF16, 0.1f, 7);
  const Tensor logits = testing::randn(6, 8, DType::kF32, 1.0f, 8);
  Fp8MoeLayer whole = Fp8MoeLayer::from_checkpoint(example_dir(), {}, ref_options());
  const Tensor full = whole.forward(x, logits);
  std::vector<float> sum(6 * 256, 0.0f);
  for (int r = 0; r < 8; ++r) {
    CheckpointLayerRequest req;
    req.tp_size = 8;
    req.rank = r;
    req.moe_backend = "triton";  // an explicit backend: 80 rows per rank cannot refine -> pad
    Fp8MoeLayer layer = Fp8MoeLayer::from_checkpoint(example_dir(), req, ref_options());
    const Fp8MoeLayerPlan& p = layer.plan();
    ASSERT_EQ(p.resolution, "pad") << p.resolution_why;
    EXPECT_TRUE(p.padded);
    EXPECT_EQ(p.local_intermediate, 128);
    const Tensor out = layer.forward(x, logits);
    const Tensor expected =
        independent_reference(x, logits, 8, r, {128, 128}, std::nullopt, true, 128);
    EXPECT_TRUE(testing::compare_bitwise(out, expected).ok) << "rank " << r;
    for (int64_t i = 0; i < out.numel(); ++i) {
      const float v = numerics::bf16_to_float(out.ptr<uint16_t>()[i]);
      if (r >= 5) {
        ASSERT_EQ(v, 0.0f) << "rank " << r << " holds only padding";
      }
      sum[i] += v;
    }
  }
  Tensor summed = Tensor::empty({6, 256}, DType::kBF16);
  for (int64_t i = 0; i < summed.numel(); ++i) {
    summed.ptr<uint16_t>()[i] = numerics::float_to_bf16(sum[i]);
  }
  const auto c = testing::compare_close(summed, full, 0.035, 0.035);
  EXPECT_TRUE(c.ok) << c.str();
}

TEST(Layer, Tp8WithoutAnExplicitBackendIsRejectedWithTheHint) {  // pitfall 3
  CheckpointLayerRequest req;
  req.tp_size = 8;
  EXPECT_TRUE(throws_with<ValueError>(
      [&] { Fp8MoeLayer::from_checkpoint(example_dir(), req, ref_options()); },
      {"not divisible by weight quantization block_n = 128", "--enable-expert-parallel",
       "'validate'"}));
}

TEST(Layer, ExpertParallelRanksSumToTp1) {
  const Tensor x = testing::randn(11, 256, DType::kBF16, 0.1f, 9);
  const Tensor logits = testing::randn(11, 8, DType::kF32, 1.0f, 10);
  Fp8MoeLayer whole = Fp8MoeLayer::from_checkpoint(example_dir(), {}, ref_options());
  const Tensor full = whole.forward(x, logits);
  std::vector<float> sum(11 * 256, 0.0f);
  for (int r = 0; r < 2; ++r) {
    CheckpointLayerRequest req;
    req.tp_size = 2;
    req.rank = r;
    req.enable_ep = true;
    Fp8MoeLayer layer = Fp8MoeLayer::from_checkpoint(example_dir(), req, ref_options());
    EXPECT_EQ(layer.num_local_experts(), 4);
    EXPECT_EQ(layer.local_intermediate(), 640);
    EXPECT_TRUE(layer.weights().expert_map.defined());
    const Tensor out = layer.forward(x, logits);
    for (int64_t i = 0; i < out.numel(); ++i)
      sum[i] += numerics::bf16_to_float(out.ptr<uint16_t>()[i]);
  }
  Tensor summed = Tensor::empty({11, 256}, DType::kBF16);
  for (int64_t i = 0; i < summed.numel(); ++i) {
    summed.ptr<uint16_t>()[i] = numerics::float_to_bf16(sum[i]);
  }
  EXPECT_TRUE(testing::compare_close(summed, full, 0.035, 0.035).ok);
}

TEST(Layer, ChunkedForwardEqualsOneCall) {  // pitfall 32
  Fp8MoeLayerOptions o = ref_options();
  o.max_num_tokens = 8;
  Fp8MoeLayer chunked = Fp8MoeLayer::from_checkpoint(example_dir(), {}, o);
  Fp8MoeLayer whole = Fp8MoeLayer::from_checkpoint(example_dir(), {}, ref_options());
  const Tensor x = testing::randn(21, 256, DType::kBF16, 0.1f, 11);
  const Tensor logits = testing::randn(21, 8, DType::kF32, 1.0f, 12);
  const Tensor a = chunked.forward(x, logits);
  const Tensor b = whole.forward(x, logits);
  EXPECT_TRUE(testing::compare_bitwise(a, b).ok);
  // f32 activations, routed by the caller.
  Tensor xf = testing::randn(5, 256, DType::kF32, 0.1f, 13);
  Tensor ids = Tensor::empty({5, 2}, DType::kI32);
  Tensor w = Tensor::empty({5, 2}, DType::kF32);
  for (int t = 0; t < 5; ++t) {
    ids.ptr<int32_t>()[2 * t] = t % 8;
    ids.ptr<int32_t>()[2 * t + 1] = (t + 3) % 8;
    w.ptr<float>()[2 * t] = 0.75f;
    w.ptr<float>()[2 * t + 1] = 0.25f;
  }
  Tensor out = Tensor::empty({5, 256}, DType::kF32);
  testing::poison(out);
  whole.forward_routed(xf, ids, w, out);
  EXPECT_TRUE(testing::expect_all_written(out));
}

TEST(Layer, WorkspaceQueryAndCallerWorkspace) {
  Fp8MoeLayer layer = Fp8MoeLayer::from_checkpoint(example_dir(), {}, ref_options());
  EXPECT_EQ(layer.workspace_size(0), 0u);
  const std::size_t need = layer.workspace_size(16);
  EXPECT_GE(layer.owned_workspace_bytes(), need);
  std::vector<uint8_t> ws(need + 1);
  const Tensor x = testing::randn(16, 256, DType::kBF16, 0.1f, 14);
  const Tensor logits = testing::randn(16, 8, DType::kF32, 1.0f, 15);
  Tensor out = Tensor::empty({16, 256}, DType::kBF16);
  layer.forward(x, logits, out, nullptr, ws.data(), ws.size());
  EXPECT_TRUE(testing::compare_bitwise(out, layer.forward(x, logits)).ok);
  EXPECT_EQ(layer.kernel_for(16).impl_name, "ref");
}

// describe_call: the CPU kernels name their instruction set and threads; the reference, which
// has no describe_call, and an empty call give ""; a wrong x is a named error.
TEST(Layer, DescribeCallSaysHowTheKernelRuns) {
  const Tensor x = testing::randn(12, 256, DType::kBF16, 0.1f, 40);
  const Tensor logits = testing::randn(12, 8, DType::kF32, 1.0f, 41);
  Tensor out = Tensor::empty({12, 256}, DType::kBF16);
  for (const char* kernel : {"cpu_w8a8", "cpu_w8a16"}) {
    Fp8MoeLayerOptions opts;
    opts.kernel = kernel;
    const ExpertsImpl* impl = find_experts_impl(kernel);
    if (!impl || !impl->available || !impl->available()) continue;
    Fp8MoeLayer layer = Fp8MoeLayer::from_checkpoint(example_dir(), {}, opts);
    const std::string how = layer.describe_call(x, logits, out);
    EXPECT_NE(how.find(std::string(cpu::isa_name(cpu::active_isa())) + " kernels"),
              std::string::npos)
        << kernel << ": " << how;
    EXPECT_NE(how.find("OpenMP threads"), std::string::npos) << kernel << ": " << how;
    EXPECT_EQ(layer.describe_call(testing::rows_of(x, 0, 0), testing::rows_of(logits, 0, 0),
                                  testing::rows_of(out, 0, 0)),
              "");
    const Tensor x_bad = testing::randn(12, 128, DType::kBF16, 0.1f, 42);
    EXPECT_THROW(layer.describe_call(x_bad, logits, out), ValueError);
    EXPECT_THROW(layer.describe_call(x, TensorView{}, out), ValueError);
  }
  Fp8MoeLayer ref = Fp8MoeLayer::from_checkpoint(example_dir(), {}, ref_options());
  EXPECT_EQ(ref.describe_call(x, logits, out), "");
}

TEST(Layer, BadInputsAreNamed) {
  Fp8MoeLayer layer = Fp8MoeLayer::from_checkpoint(example_dir(), {}, ref_options());
  const Tensor x = testing::randn(4, 256, DType::kBF16, 0.1f, 16);
  const Tensor logits = testing::randn(4, 8, DType::kF32, 1.0f, 17);
  Tensor out = Tensor::empty({4, 256}, DType::kBF16);
  const Tensor x_bad_h = testing::randn(4, 512, DType::kBF16, 0.1f, 18);
  EXPECT_TRUE(throws_with<ValueError>([&] { layer.forward(x_bad_h, logits, out); },
                                      {"x is (4, 512) bf16", "expected (M, 256)"}));
  Tensor x_f16 = Tensor::empty({4, 256}, DType::kF16);
  EXPECT_TRUE(
      throws_with<ValueError>([&] { layer.forward(x_f16, logits, out); }, {"x is", "bf16 or f32"}));
  const Tensor logits_bad = testing::randn(4, 16, DType::kF32, 1.0f, 19);
  EXPECT_TRUE(throws_with<ValueError>([&] { layer.forward(x, logits_bad, out); },
                                      {"router_logits", "expected (4, 8)"}));
  Tensor out_f32 = Tensor::empty({4, 256}, DType::kF32);
  EXPECT_TRUE(throws_with<ValueError>([&] { layer.forward(x, logits, out_f32); },
                                      {"out", "the dtype of x"}));
  TensorView strided = x.view();
  strided.shape[0] = 2;
  strided.strides[0] = 512;  // every other row
  Tensor out2 = Tensor::empty({2, 256}, DType::kBF16);
  const Tensor logits2 = testing::randn(2, 8, DType::kF32, 1.0f, 20);
  EXPECT_TRUE(
      throws_with<ValueError>([&] { layer.forward(strided, logits2, out2); }, {"x", "contiguous"}));
  TensorView on_gpu = x.view();
  on_gpu.device = Device::cuda(0);
  EXPECT_TRUE(throws_with<ValueError>([&] { layer.forward(on_gpu, logits, out); },
                                      {"x is on cuda:0", "weights are on cpu"}));
  std::vector<uint8_t> tiny(1);
  Fp8MoeLayerOptions o = ref_options();
  // A caller workspace that is too small (the reference needs none, so ask a kernel that does:
  // only checked when the chosen implementation has a workspace).
  if (layer.workspace_size(4) > 0) {
    EXPECT_TRUE(throws_with<ValueError>(
        [&] { layer.forward(x, logits, out, nullptr, tiny.data(), 0); }, {"workspace"}));
  }
  o.kernel = "no_such_kernel";
  EXPECT_TRUE(throws_with<ValueError>([&] { Fp8MoeLayer::from_checkpoint(example_dir(), {}, o); },
                                      {"unknown --kernel 'no_such_kernel'", "ref"}));
  CheckpointLayerRequest req;
  req.layer = 7;
  EXPECT_TRUE(throws_with<ValueError>(
      [&] { Fp8MoeLayer::from_checkpoint(example_dir(), req, ref_options()); },
      {"layer 7", "has no routed experts"}));
  req.layer = 0;
  req.tp_size = 2;
  req.rank = 2;
  EXPECT_TRUE(throws_with<ValueError>(
      [&] { Fp8MoeLayer::from_checkpoint(example_dir(), req, ref_options()); }, {"rank 2"}));
}

TEST(Layer, Mi300PlanNormalisesTheWeightsToFnuz) {  // pitfall 14
  Fp8MoeLayerOptions o = ref_options();
  o.platform = Platform::parse("rocm:gfx942");
  Fp8MoeLayer layer = Fp8MoeLayer::from_checkpoint(example_dir(), {}, o);
  EXPECT_EQ(layer.device(), Device::cpu());  // the reference runs on the host
  EXPECT_EQ(layer.plan().scheme.fp8, DType::kF8E4M3FNUZ);
  EXPECT_EQ(layer.weights().w13.dtype(), DType::kF8E4M3FNUZ);
  ASSERT_FALSE(layer.weights().applied.empty());
  EXPECT_NE(layer.weights().applied.front().find("e4m3fnuz"), std::string::npos);
  // Same codes (0x80 aside), scales doubled: every dequantised weight is unchanged.
  Fp8MoeLayer fn = Fp8MoeLayer::from_checkpoint(example_dir(), {}, ref_options());
  const Tensor& a = fn.weights().w13_scale;
  const Tensor& b = layer.weights().w13_scale;
  ASSERT_EQ(a.numel(), b.numel());
  for (int64_t i = 0; i < a.numel(); ++i) ASSERT_EQ(b.ptr<float>()[i], 2 * a.ptr<float>()[i]);
  // And the layer computes the same function: fnuz with max 224 is e4m3fn halved.
  const Tensor x = testing::randn(5, 256, DType::kBF16, 0.1f, 31);
  const Tensor logits = testing::randn(5, 8, DType::kF32, 1.0f, 32);
  EXPECT_TRUE(testing::compare_bitwise(layer.forward(x, logits), fn.forward(x, logits)).ok);
}

// ---- caller tensors ---------------------------------------------------------------------------

struct CallerLayer {
  Fp8MoeLayerSpec spec;
  Fp8MoeWeights w;
  Tensor real13, real2;
};

// A block-FP8 layer from real-valued weights quantised here (the caller's side of from_tensors).
CallerLayer make_caller_layer(int64_t E, int64_t H, int64_t I, int topk, int tp, int rank,
                              std::array<int64_t, 2> block, bool with_weights = true) {
  CallerLayer c;
  c.spec.config.num_experts = static_cast<int>(E);
  c.spec.config.experts_per_token = topk;
  c.spec.config.hidden_dim = static_cast<int>(H);
  c.spec.config.intermediate_size = static_cast<int>(I);
  c.spec.config.num_local_experts = static_cast<int>(E);
  c.spec.config.num_logical_experts = static_cast<int>(E);
  c.spec.config.moe_parallel_config =
      MoeParallelConfig::make(tp, 1, 1, 1, false, "allgather_reducescatter", false, rank);
  c.spec.config.routing_method = RoutingMethodType::kRenormalize;
  c.spec.quant = fp8_block_checkpoint_quant(128, 128);
  c.spec.routing.method = RoutingMethodType::kRenormalize;
  c.spec.routing.topk = topk;
  const int64_t W = I / tp;
  if (!with_weights) return c;  // plans need no weights
  std::mt19937_64 rng(99);
  std::normal_distribution<float> n(0.0f, 1.0f / 15.0f);
  c.real13 = Tensor::empty({E, 2 * W, H}, DType::kF32);
  c.real2 = Tensor::empty({E, H, W}, DType::kF32);
  for (int64_t i = 0; i < c.real13.numel(); ++i) c.real13.ptr<float>()[i] = n(rng);
  for (int64_t i = 0; i < c.real2.numel(); ++i) c.real2.ptr<float>()[i] = n(rng);
  const auto q13 = numerics::per_block_cast_to_fp8(c.real13, block[0], block[1]);
  const auto q2 = numerics::per_block_cast_to_fp8(c.real2, block[0], block[1]);
  c.w.w13 = q13.q;
  c.w.w13_scale = q13.scale;
  c.w.w2 = q2.q;
  c.w.w2_scale = q2.scale;
  return c;
}

TEST(LayerFromTensors, RealWeightsCheck) {
  CallerLayer c = make_caller_layer(4, 256, 256, 2, 1, 0, {128, 128});
  Fp8MoeLayer layer = Fp8MoeLayer::from_tensors(c.spec, c.w, ref_options());
  EXPECT_EQ(layer.plan().source, "caller tensors");
  // No conversion needed: the layer shares the caller's storage.
  EXPECT_EQ(layer.weights().w13.data(), c.w.w13.data());
  const Tensor x = testing::randn(24, 256, DType::kBF16, 0.1f, 21);
  const Tensor logits = testing::randn(24, 4, DType::kF32, 1.0f, 22);
  const Tensor out = layer.forward(x, logits);
  const ForwardCheck chk = check_forward(layer, x, logits, out, c.real13, c.real2);
  EXPECT_TRUE(chk.vs_reference.bitwise_equal);
  EXPECT_EQ(chk.unquantized_weights, "the original real-valued weights");
  EXPECT_TRUE(chk.vs_unquantized.allclose) << chk.vs_unquantized.max_abs_err;
  EXPECT_LT(chk.vs_unquantized.mean_rel_abs_err, 0.1);
  EXPECT_GT(chk.vs_unquantized.mean_rel_abs_err, 0.0);
}

TEST(LayerFromTensors, UnrefinedScalesForARefinedPlanAreRejected) {
  // TP 4 of I = 640 refines 128x128 to 32x32: 128-block scales of the shard are the wrong shape.
  CallerLayer c = make_caller_layer(2, 256, 640, 1, 4, 0, {128, 128});
  EXPECT_TRUE(
      throws_with<ValueError>([&] { Fp8MoeLayer::from_tensors(c.spec, c.w, ref_options()); },
                              {"w13_scale has shape (2, 3, 2)", "expected (2, 10, 8)", "refines"}));
  // With scales at the refined granularity it builds.
  CallerLayer r = make_caller_layer(2, 256, 640, 1, 4, 0, {32, 32});
  Fp8MoeLayer layer = Fp8MoeLayer::from_tensors(r.spec, r.w, ref_options());
  EXPECT_EQ(layer.plan().resolution, "refine");
}

TEST(LayerFromTensors, InconsistentSpecIsRejected) {
  CallerLayer c = make_caller_layer(4, 256, 256, 2, 1, 0, {128, 128});
  c.spec.routing.topk = 3;
  EXPECT_TRUE(
      throws_with<ValueError>([&] { Fp8MoeLayer::from_tensors(c.spec, c.w, ref_options()); },
                              {"routing.topk 3", "experts_per_token 2"}));
  c = make_caller_layer(4, 256, 256, 2, 1, 0, {128, 128});
  c.w.w2 = Tensor::empty({4, 256, 128}, DType::kF8E4M3FN);
  EXPECT_TRUE(
      throws_with<ValueError>([&] { Fp8MoeLayer::from_tensors(c.spec, c.w, ref_options()); },
                              {"w2 has shape (4, 256, 128)", "expected (4, 256, 256)"}));
  c = make_caller_layer(4, 256, 256, 2, 1, 0, {128, 128});
  c.w.w13 = Tensor::empty({4, 512, 256}, DType::kBF16);
  EXPECT_TRUE(
      throws_with<ValueError>([&] { Fp8MoeLayer::from_tensors(c.spec, c.w, ref_options()); },
                              {"w13", "bf16", "fp8_e4m3fn"}));
}

// ---- weight preparation ------------------------------------------------------------------------

TEST(KernelFormat, TheTable) {
  KernelFormatContext ctx;
  EXPECT_TRUE(
      throws_with<ValueError>([&] { convert_to_fp8_moe_kernel_format(Fp8MoeBackend::kNone, ctx); },
                              {"Unsupported FP8 MoE backend: NONE"}));
  const auto tri = convert_to_fp8_moe_kernel_format(Fp8MoeBackend::kTriton, ctx);
  EXPECT_EQ(tri.vllm_layout, WeightLayout::kCanonical);
  EXPECT_TRUE(tri.fp8moe_can_apply_layout);
  const auto cpu = convert_to_fp8_moe_kernel_format(Fp8MoeBackend::kCpuW8A8, ctx);
  EXPECT_EQ(cpu.vllm_layout, WeightLayout::kCpuPacked);
  EXPECT_EQ(cpu.vllm_function, "prepare_fp8_moe_layer_for_cpu(w13, w2)");
  const auto fi = convert_to_fp8_moe_kernel_format(Fp8MoeBackend::kFlashinferCutlass, ctx);
  EXPECT_EQ(fi.vllm_layout, WeightLayout::kW31);
  EXPECT_TRUE(fi.clamp_block_scales);
  EXPECT_TRUE(fi.fp8moe_can_apply_layout);
  const auto trt = convert_to_fp8_moe_kernel_format(Fp8MoeBackend::kFlashinferTrtllm, ctx);
  EXPECT_EQ(trt.vllm_layout, WeightLayout::kW31BlockMajorK);
  EXPECT_FALSE(trt.fp8moe_can_apply_layout);
  ctx.deep_gemm_e8m0 = true;
  const auto dg = convert_to_fp8_moe_kernel_format(Fp8MoeBackend::kDeepGemm, ctx);
  EXPECT_TRUE(dg.requantize_ue8m0);
  EXPECT_EQ(dg.vllm_layout, WeightLayout::kDeepGemm);
  ctx.deep_gemm_e8m0 = false;
  EXPECT_FALSE(convert_to_fp8_moe_kernel_format(Fp8MoeBackend::kDeepGemm, ctx).requantize_ue8m0);
  for (Fp8MoeBackend b : builtin_fp8_moe_backends()) {
    if (b == Fp8MoeBackend::kNone) continue;
    EXPECT_FALSE(convert_to_fp8_moe_kernel_format(b, ctx).vllm_function.empty())
        << backend_value(b);
  }
}

TEST(KernelFormat, W31WeightsAreRejectedByACanonicalKernel) {  // pitfall 27
  CallerLayer c = make_caller_layer(2, 256, 256, 1, 1, 0, {128, 128});
  KernelFormatContext ctx;
  const auto fi = convert_to_fp8_moe_kernel_format(Fp8MoeBackend::kFlashinferCutlass, ctx);
  const PreparedMoeWeights w31 = prepare_fp8_moe_weights(
      c.w, fi, WeightLayout::kW31, WeightScaleKind::kBlock, {128, 128}, DType::kF8E4M3FN);
  EXPECT_EQ(w31.layout, WeightLayout::kW31);
  // Up rows first, then gate rows; the scale rows too.
  const int64_t rows = 512, H = 256;
  EXPECT_EQ(std::memcmp(w31.w13.ptr<uint8_t>(), c.w.w13.ptr<uint8_t>() + 256 * H, 256 * H), 0);
  EXPECT_EQ(std::memcmp(w31.w13.ptr<uint8_t>() + rows * H + 256 * H,
                        c.w.w13.ptr<uint8_t>() + rows * H, 256 * H),
            0);
  EXPECT_EQ(w31.w13_scale.ptr<float>()[0], c.w.w13_scale.ptr<float>()[2 * 2]);
  FusedMoeArgs a;
  const Tensor x = testing::randn(2, 256, DType::kBF16, 0.1f, 23);
  const Tensor logits = testing::randn(2, 2, DType::kF32, 1.0f, 24);
  Tensor out = Tensor::empty({2, 256}, DType::kBF16);
  a.x = x;
  a.router_logits = logits;
  a.routing.topk = 1;
  a.out = out;
  EXPECT_TRUE(throws_with<ValueError>(
      [&] { run_prepared_experts(ref::ref_experts_impl(), w31, a, nullptr); },
      {"w31 layout", "FLASHINFER_CUTLASS", "ref kernel", "canonical", "pitfall 27"}));
  // The canonical preparation for the same backend keeps the layout and runs.
  const PreparedMoeWeights canon = prepare_fp8_moe_weights(
      c.w, fi, WeightLayout::kCanonical, WeightScaleKind::kBlock, {128, 128}, DType::kF8E4M3FN);
  EXPECT_NO_THROW(run_prepared_experts(ref::ref_experts_impl(), canon, a, nullptr));
  // A layout fp8moe cannot produce is refused, not faked.
  const auto trt = convert_to_fp8_moe_kernel_format(Fp8MoeBackend::kFlashinferTrtllm, ctx);
  EXPECT_TRUE(throws_with<NotImplementedError>(
      [&] {
        prepare_fp8_moe_weights(c.w, trt, WeightLayout::kW31BlockMajorK, WeightScaleKind::kBlock,
                                {128, 128}, DType::kF8E4M3FN);
      },
      {"w31-block-major-k"}));
}

TEST(KernelFormat, PerTensorShardScalesAreRequantisedToTheirMax) {  // pitfall 10
  // Two experts, gate and up with different per-tensor scales.
  const int64_t E = 2, W = 64, H = 128;
  std::mt19937_64 rng(5);
  std::uniform_int_distribution<int> code(0, 0x7E);
  Fp8MoeWeights w;
  w.w13 = Tensor::empty({E, 2 * W, H}, DType::kF8E4M3FN);
  w.w2 = Tensor::empty({E, H, W}, DType::kF8E4M3FN);
  for (int64_t i = 0; i < w.w13.numel(); ++i) {
    w.w13.ptr<uint8_t>()[i] = static_cast<uint8_t>(code(rng) | (i % 3 == 0 ? 0x80 : 0));
  }
  std::memset(w.w2.data(), 0x38, w.w2.nbytes());
  w.w13_scale = Tensor::empty({E, 2}, DType::kF32);
  const float s[4] = {1e-3f, 3e-3f, 5e-3f, 2e-3f};
  std::memcpy(w.w13_scale.data(), s, sizeof(s));
  w.w2_scale = Tensor::empty({E}, DType::kF32);
  w.w2_scale.ptr<float>()[0] = w.w2_scale.ptr<float>()[1] = 1e-3f;
  w.w13_input_scale = Tensor::empty({E}, DType::kF32);
  w.w2_input_scale = Tensor::empty({E}, DType::kF32);
  w.w13_input_scale.ptr<float>()[0] = 0.5f;
  w.w13_input_scale.ptr<float>()[1] = 0.25f;
  w.w2_input_scale.ptr<float>()[0] = w.w2_input_scale.ptr<float>()[1] = 0.125f;
  KernelFormatContext ctx;
  ctx.weight = WeightScaleKind::kPerTensor;
  const auto f = convert_to_fp8_moe_kernel_format(Fp8MoeBackend::kTriton, ctx);
  const PreparedMoeWeights p = prepare_fp8_moe_weights(
      w, f, WeightLayout::kCanonical, WeightScaleKind::kPerTensor, {0, 0}, DType::kF8E4M3FN);
  ASSERT_EQ(p.w13_scale.sizes(), (std::vector<int64_t>{E}));
  EXPECT_EQ(p.w13_scale.ptr<float>()[0], 3e-3f);
  EXPECT_EQ(p.w13_scale.ptr<float>()[1], 5e-3f);
  EXPECT_EQ(p.a13_scale.ptr<float>()[0], 0.5f);  // the max over experts
  EXPECT_EQ(p.a2_scale.ptr<float>()[0], 0.125f);
  // Every requantised value is within half an fp8 step (plus the float16 detour) of the original.
  for (int64_t e = 0; e < E; ++e) {
    for (int j = 0; j < 2; ++j) {
      const float so = s[e * 2 + j], sm = p.w13_scale.ptr<float>()[e];
      for (int64_t i = 0; i < W * H; ++i) {
        const int64_t k = (e * 2 * W + j * W) * H + i;
        const float orig = numerics::e4m3fn_to_float(w.w13.ptr<uint8_t>()[k]) * so;
        const float got = numerics::e4m3fn_to_float(p.w13.ptr<uint8_t>()[k]) * sm;
        const float tol = std::max(std::fabs(orig) * 0.0626f, sm * std::ldexp(1.0f, -9)) +
                          std::fabs(orig) * 1e-3f;
        ASSERT_LE(std::fabs(got - orig), tol) << "expert " << e << " half " << j << " index " << i;
      }
    }
  }
}

TEST(KernelFormat, DeepGemmE8m0RequantisesToPowerOfTwoScales) {  // pitfall 12
  CallerLayer c = make_caller_layer(2, 256, 256, 1, 1, 0, {128, 128});
  KernelFormatContext ctx;
  ctx.deep_gemm_e8m0 = true;
  const auto dg = convert_to_fp8_moe_kernel_format(Fp8MoeBackend::kDeepGemm, ctx);
  const PreparedMoeWeights p = prepare_fp8_moe_weights(
      c.w, dg, WeightLayout::kCanonical, WeightScaleKind::kBlock, {128, 128}, DType::kF8E4M3FN);
  EXPECT_TRUE(p.ue8m0_requantized);
  for (const Tensor* s : {&p.w13_scale, &p.w2_scale}) {
    for (int64_t i = 0; i < s->numel(); ++i) {
      int exp = 0;
      const float m = std::frexp(s->ptr<float>()[i], &exp);
      ASSERT_EQ(m, 0.5f) << "scale " << s->ptr<float>()[i] << " is not a power of two";
    }
  }
}

// ---- per-M dispatch (simulated platforms: plans only)
// --------------------------------------------

TEST(LayerDispatch, TritonOrDeepGemmByM) {  // pitfalls 12, 31
  CallerLayer c = make_caller_layer(8, 1024, 1024, 2, 1, 0, {128, 128}, false);
  Fp8MoeLayerOptions o;
  o.platform = Platform::parse("cuda:90");
  o.env = OracleEnv::from_pairs({"VLLM_USE_DEEP_GEMM=1", "VLLM_USE_DEEP_GEMM_E8M0=0"});
  const Fp8MoeLayerPlan p = plan_fp8_moe_layer(c.spec, o);
  ASSERT_TRUE(p.ok) << p.error_message;
  ASSERT_EQ(p.selection.backend, Fp8MoeBackend::kDeepGemm);
  EXPECT_EQ(p.kernel_class, "TritonOrDeepGemmExperts");
  EXPECT_FALSE(p.runnable);  // a simulated H200: fp8moe's kernels are not here
  EXPECT_EQ(p.dispatch(64).kernel_class, "TritonExperts");
  EXPECT_NE(p.dispatch(64).why.find("M = 64 < 128"), std::string::npos) << p.dispatch(64).why;
  EXPECT_EQ(p.dispatch(127).kernel_class, "TritonExperts");
  EXPECT_EQ(p.dispatch(128).kernel_class, "DeepGemmExperts");
  EXPECT_EQ(p.dispatch(4096).kernel_class, "DeepGemmExperts");
  EXPECT_EQ(p.dispatch(4096).impl_name, "cuda_grouped");
  EXPECT_EQ(p.dispatch(64).impl_name, "cuda_fused");
  // N = 512 is not > 512: Triton for every M.
  CallerLayer small = make_caller_layer(8, 1024, 512, 2, 1, 0, {128, 128}, false);
  const Fp8MoeLayerPlan ps = plan_fp8_moe_layer(small.spec, o);
  EXPECT_EQ(ps.dispatch(4096).kernel_class, "TritonExperts");
  // With E8M0 in use: DeepGEMM for every M, activation scales UE8M0, weights requantised.
  o.env = OracleEnv::from_pairs({"VLLM_USE_DEEP_GEMM=1"});
  const Fp8MoeLayerPlan pe = plan_fp8_moe_layer(c.spec, o);
  EXPECT_EQ(pe.dispatch(1).kernel_class, "DeepGemmExperts");
  EXPECT_TRUE(pe.scheme.ue8m0_scales);
  EXPECT_TRUE(pe.kernel_format->requantize_ue8m0);
}

TEST(LayerDispatch, CutlassSmallMFallbackOnSm100) {
  CallerLayer c = make_caller_layer(8, 1024, 1024, 2, 1, 0, {128, 128}, false);
  c.spec.quant = parse_quantization_config(R"({"quant_method": "compressed-tensors",
      "format": "float-quantized", "config_groups": {"group_0": {"targets": ["Linear"],
      "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "dynamic": false,
      "symmetric": true}, "input_activations": {"num_bits": 8, "type": "float",
      "strategy": "token", "dynamic": true, "symmetric": true}}}})");
  c.spec.config.moe_backend = "cutlass";
  Fp8MoeLayerOptions o;
  o.platform = Platform::parse("cuda:100");
  const Fp8MoeLayerPlan p = plan_fp8_moe_layer(c.spec, o);
  ASSERT_TRUE(p.ok) << p.error_message;
  ASSERT_EQ(p.selection.backend, Fp8MoeBackend::kVllmCutlass);
  EXPECT_EQ(p.dispatch(8).kernel_class, "TritonExperts");
  EXPECT_EQ(p.dispatch(9).kernel_class, "CutlassExpertsFp8");
  o.platform = Platform::parse("cuda:90");
  const Fp8MoeLayerPlan p90 = plan_fp8_moe_layer(c.spec, o);
  EXPECT_EQ(p90.dispatch(1).kernel_class, "CutlassExpertsFp8");
}

TEST(LayerPlan, ScaleFmtUe8m0GivesPowerOfTwoActivationScales) {  // pitfall 13
  CallerLayer c = make_caller_layer(4, 256, 256, 2, 1, 0, {128, 128}, false);
  c.spec.quant = fp8_block_checkpoint_quant(128, 128, true);
  const Fp8MoeLayerPlan p = plan_fp8_moe_layer(c.spec, ref_options());
  ASSERT_TRUE(p.ok) << p.error_message;
  EXPECT_TRUE(p.scheme.ue8m0_scales);
  EXPECT_FALSE(p.scheme_notes.empty());
}

TEST(LayerPlan, SimulatedH200PicksTritonAndSaysItCannotRunHere) {
  const ModelConfig model = load_model_config(example_dir());
  CheckpointLayerRequest req;
  req.tp_size = 4;
  Fp8MoeLayerOptions o;
  o.platform = Platform::parse("cuda:90");
  const Fp8MoeLayerPlan p = plan_fp8_moe_layer(checkpoint_layer_spec(model, req), o);
  ASSERT_TRUE(p.ok) << p.error_message;
  EXPECT_EQ(p.resolution, "refine");
  EXPECT_EQ(p.selection.backend, Fp8MoeBackend::kTriton);
  EXPECT_FALSE(p.runnable) << "a simulated H200 plan on a CPU layer cannot run";
  EXPECT_EQ(p.implementation, "cuda_fused");
}

}  // namespace
}  // namespace fp8moe
