// FusedMoEParallelConfig (make() flattening, derived properties, repr) and FusedMoEConfig
// (post_init, derived fields, errors), as the oracle sees them.
#include <gtest/gtest.h>

#include "fp8moe/error.hpp"
#include "fp8moe/oracle.hpp"
#include "unit/oracle_test_util.hpp"

namespace fp8moe {
namespace {

using testing::Deploy;

TEST(ParallelConfig, MakeFlattensDpAndPcpIntoTpOrEp) {
  // tp=4: pure TP.
  auto p = MoeParallelConfig::make(4, 1, 1, 1, false, "allgather_reducescatter", false);
  EXPECT_EQ(p.tp_size, 4);
  EXPECT_EQ(p.ep_size, 1);
  EXPECT_FALSE(p.use_ep);
  // tp=8 with --enable-expert-parallel: ep_size 8, tp_size 1.
  p = MoeParallelConfig::make(8, 1, 1, 1, true, "allgather_reducescatter", false);
  EXPECT_EQ(p.tp_size, 1);
  EXPECT_EQ(p.ep_size, 8);
  EXPECT_TRUE(p.use_ep);
  // dp=2, pcp=2, tp=2 without EP: TP 8; with EP: EP 8, ranks flattened.
  p = MoeParallelConfig::make(2, 2, 2, 1, false, "allgather_reducescatter", false, 1, 1, 1);
  EXPECT_EQ(p.tp_size, 8);
  EXPECT_EQ(p.tp_rank, 1 * 2 * 2 + 1 * 2 + 1);
  p = MoeParallelConfig::make(2, 2, 2, 1, true, "allgather_reducescatter", false, 1, 1, 1);
  EXPECT_EQ(p.ep_size, 8);
  EXPECT_EQ(p.ep_rank, 7);
  EXPECT_EQ(p.tp_size, 1);
  // A single rank never uses EP.
  p = MoeParallelConfig::make(1, 1, 1, 1, true, "allgather_reducescatter", false);
  EXPECT_FALSE(p.use_ep);
  EXPECT_THROW(MoeParallelConfig::make(0, 1, 1, 1, false, "allgather_reducescatter", false),
               ValueError);
}

TEST(ParallelConfig, DerivedProperties) {
  struct Case {
    int tp, dp, sp;
    bool ep;
    const char* a2a;
    bool all2all, ll, ht, v2, fi1, fi2, agrs, mori, nixl, batched;
  };
  const Case cases[] = {
      // tp only: no all2all whatever the backend name.
      {4, 1, 1, false, "deepep_low_latency", false, false, false, false, false, false, false, false,
       false, false},
      // EP without DP: use_ep but not all2all.
      {4, 1, 1, true, "deepep_low_latency", false, false, false, false, false, false, false, false,
       false, false},
      {1, 2, 1, true, "deepep_low_latency", true, true, false, false, false, false, false, false,
       false, true},
      {1, 2, 1, true, "deepep_high_throughput", true, false, true, false, false, false, false,
       false, false, false},
      {1, 2, 1, true, "deepep_v2", true, false, false, true, false, false, false, false, false,
       false},
      {1, 2, 1, true, "flashinfer_nvlink_one_sided", true, false, false, false, true, false, false,
       false, false, false},
      {1, 2, 1, true, "flashinfer_all2allv", true, false, false, false, false, true, false, false,
       false, false},
      {1, 2, 1, true, "flashinfer_nvlink_two_sided", true, false, false, false, false, true, false,
       false, false, false},
      {1, 2, 1, true, "allgather_reducescatter", true, false, false, false, false, false, true,
       false, false, false},
      {1, 2, 1, true, "mori_low_latency", true, false, false, false, false, false, false, true,
       false, false},
      {1, 2, 1, true, "nixl_ep", true, false, false, false, false, false, false, false, true, true},
      // Sequence parallelism alone makes EP use all2all kernels.
      {2, 1, 2, true, "deepep_low_latency", true, true, false, false, false, false, false, false,
       false, true},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(::testing::Message()
                 << c.tp << "/" << c.dp << "/" << c.sp << "/" << c.ep << "/" << c.a2a);
    const auto p = MoeParallelConfig::make(c.tp, 1, c.dp, c.sp, c.ep, c.a2a, false);
    EXPECT_EQ(p.use_all2all_kernels(), c.all2all);
    EXPECT_EQ(p.use_deepep_ll_kernels(), c.ll);
    EXPECT_EQ(p.use_deepep_ht_kernels(), c.ht);
    EXPECT_EQ(p.use_deepep_v2_kernels(), c.v2);
    EXPECT_EQ(p.use_fi_nvl_one_sided_kernels(), c.fi1);
    EXPECT_EQ(p.use_fi_nvl_two_sided_kernels(), c.fi2);
    EXPECT_EQ(p.use_ag_rs_all2all_kernels(), c.agrs);
    EXPECT_EQ(p.use_mori_kernels(), c.mori);
    EXPECT_EQ(p.use_nixl_ep_kernels(), c.nixl);
    EXPECT_EQ(p.use_batched_activation_format(), c.batched);
    EXPECT_EQ(p.needs_round_robin_routing_tables(), c.batched);
  }
}

TEST(ParallelConfig, ReprIsThePythonDataclassRepr) {
  EXPECT_EQ(MoeParallelConfig::make(8, 1, 1, 1, true, "allgather_reducescatter", true).repr(),
            "FusedMoEParallelConfig(tp_size=1, pcp_size=1, dp_size=1, ep_size=8, tp_rank=0, "
            "pcp_rank=0, dp_rank=0, ep_rank=0, sp_size=1, use_ep=True, "
            "all2all_backend='allgather_reducescatter', enable_eplb=True)");
}

TEST(MoeConfig, PostInitDerivedFields) {
  Deploy d;
  d.tp = 4;
  const MoeConfig c = d.build();
  EXPECT_EQ(c.intermediate_size_per_partition, 192);
  EXPECT_EQ(c.intermediate_size_per_partition_unpadded, 192);
  EXPECT_EQ(c.router_logits_dtype, DType::kBF16);
  EXPECT_EQ(c.hidden_dim_unpadded, 2048);
  EXPECT_FALSE(c.tp_shard_with_padding);
  EXPECT_TRUE(c.is_act_and_mul());
  EXPECT_EQ(c.w13_num_shards(), 2);
  d.act = MoeActivation::kRelu2NoMul;
  EXPECT_FALSE(d.build().is_act_and_mul());
  EXPECT_EQ(d.build().w13_num_shards(), 1);
  Deploy e;
  e.tp = 8;
  e.ep = true;
  EXPECT_EQ(e.build().intermediate_size_per_partition, 768);  // EP does not shard I
  EXPECT_EQ(e.build().num_local_experts, 16);
}

TEST(MoeConfig, BadSizesAreOneLineValueErrors) {
  const auto err = [](Deploy d) { return testing::msg_of([&] { d.build(); }); };
  Deploy d;
  d.E = 0;
  EXPECT_EQ(err(d), "ValueError: num_experts must be a positive integer, got 0");
  d = Deploy{};
  d.H = -5;
  EXPECT_EQ(err(d), "ValueError: hidden_dim must be a positive integer, got -5");
  d = Deploy{};
  d.E = 8;
  d.topk = 9;
  EXPECT_EQ(err(d), "ValueError: experts_per_token (topk) = 9 exceeds num_experts = 8");
  d = Deploy{};
  d.I = 700;
  d.tp = 8;
  EXPECT_EQ(err(d), "ValueError: intermediate_size 700 is not divisible by tp_size 8");
}

TEST(MoeConfig, NonGatedNeedsCudaAlikeOrXpu) {  // pitfall 18
  Deploy d;
  d.act = MoeActivation::kSiluNoMul;
  const MoeConfig c = d.build();
  EXPECT_EQ(testing::msg_of([&] { check_moe_config_for_platform(c, Platform::parse("cpu")); }),
            "NotImplementedError: is_act_and_mul=False is supported only for CUDA, ROCm and XPU "
            "for now");
  EXPECT_NO_THROW(check_moe_config_for_platform(c, Platform::parse("cuda:90")));
  EXPECT_NO_THROW(check_moe_config_for_platform(c, Platform::parse("rocm:gfx942")));
  EXPECT_NO_THROW(check_moe_config_for_platform(c, Platform::parse("xpu")));
  EXPECT_NO_THROW(check_moe_config_for_platform(Deploy{}.build(), Platform::parse("cpu")));
}

TEST(MoeConfig, PostInitForPlatformSetsTheAiterFlag) {
  MoeConfig c = Deploy{}.build();
  const OracleEnv on = testing::env_of({{"VLLM_ROCM_USE_AITER", "1"}});
  post_init_for_platform(c, testing::plat("rocm:gfx942"), on);
  EXPECT_TRUE(c.rocm_aiter_fmoe_enabled);
  post_init_for_platform(c, testing::plat("rocm:gfx942"), OracleEnv());
  EXPECT_FALSE(c.rocm_aiter_fmoe_enabled);
  post_init_for_platform(c, testing::plat("rocm:gfx942", "none"), on);
  EXPECT_FALSE(c.rocm_aiter_fmoe_enabled);
  post_init_for_platform(c, testing::plat("cuda:90"), on);
  EXPECT_FALSE(c.rocm_aiter_fmoe_enabled);
  Deploy ng;
  ng.act = MoeActivation::kRelu2NoMul;
  MoeConfig n = ng.build();
  post_init_for_platform(n, testing::plat("rocm:gfx942"), on);
  EXPECT_FALSE(n.rocm_aiter_fmoe_enabled);  // only when is_act_and_mul
  EXPECT_THROW(post_init_for_platform(n, testing::plat("cpu"), on), NotImplementedError);
}

TEST(MoeConfig, RoutingMethodTypes) {
  using R = RoutingMethodType;
  EXPECT_EQ(get_routing_method_type("softmax", 8, true, std::nullopt, false), R::kRenormalizeNaive);
  EXPECT_EQ(get_routing_method_type("softmax", 8, false, std::nullopt, false), R::kDefault);
  EXPECT_EQ(get_routing_method_type("sigmoid", 8, true, 8, true), R::kDeepSeekV3);
  EXPECT_EQ(get_routing_method_type("sigmoid", 8, true, 0, true, 1.0), R::kMiniMax2);
  EXPECT_EQ(get_routing_method_type("sigmoid", 8, true, 0, true, std::nullopt), R::kMiniMax2);
  EXPECT_EQ(get_routing_method_type("sigmoid", 8, true, 0, true, 2.5), R::kUnspecified);
  EXPECT_EQ(get_routing_method_type("sigmoid", 8, false, 8, true), R::kUnspecified);
  EXPECT_EQ(get_routing_method_type("softmax", 8, true, 8, true), R::kUnspecified);
  EXPECT_EQ(get_routing_method_type("sigmoid", 8, true, std::nullopt, false), R::kSigmoidRenorm);
  EXPECT_EQ(get_routing_method_type("sigmoid", 8, false, std::nullopt, false), R::kSigmoid);
  EXPECT_EQ(get_routing_method_type("sqrtsoftplus", 8, true, std::nullopt, true), R::kDeepseekV4);
  EXPECT_EQ(get_routing_method_type("sqrtsoftplus", 8, false, std::nullopt, false),
            R::kUnspecified);
  EXPECT_EQ(get_routing_method_type("tanh", 8, true, std::nullopt, false), R::kUnspecified);
  EXPECT_EQ(parse_routing_method("deepseekv3"), R::kDeepSeekV3);
  EXPECT_EQ(parse_routing_method("2"), R::kDeepSeekV3);
  EXPECT_THROW(parse_routing_method("foo"), ValueError);
  EXPECT_EQ(activation_from_str("gelu_pytorch_tanh"), MoeActivation::kGeluTanh);
  EXPECT_EQ(activation_repr(MoeActivation::kSwigluOaiUninterleave),
            "MoEActivation.SWIGLUOAI_UNINTERLEAVE");
  EXPECT_THROW(activation_from_str("swish"), ValueError);
}

}  // namespace
}  // namespace fp8moe
