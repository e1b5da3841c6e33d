// The device routing kernels (smxx_moe_routing.cuh: one block per token, rank counting; one warp
// per token, E <= 512) against the reference routing (numerics/routing.cpp) for every method the
// forward routes on the GPU: the same experts in the same slots, weights within a few float ulps
// (the device's expf and its softmax summation order differ from the host's), on random logits and
// on rows built to test the rules (exact ties go to the lower index, NaN / inf logits, all-equal
// rows, bf16 inputs). The warp routine's results are also the block routine's bit for bit.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "cuda/cuda_testing.hpp"
#include "fp8moe/error.hpp"
#include "fp8moe/fused_moe.hpp"
#include "fp8moe/tensor.hpp"
#include "kernels/cuda/fused_moe_cuda.hpp"
#include "numerics/routing.hpp"

namespace fp8moe {
namespace {

struct RouteCase {
  std::string name;
  int E = 0, topk = 1;
  RoutingMethodType method = RoutingMethodType::kRenormalize;
  int groups = 0, topk_group = 0;
  bool bias = false;
  std::string scoring = "softmax";
  bool renormalize = true;
  double rsf = 1.0;
};

std::vector<RouteCase> cases() {
  using R = RoutingMethodType;
  return {
      {"mixtral_renormalize", 8, 2, R::kRenormalize},
      {"default_softmax_e60", 60, 4, R::kDefault},
      {"qwen3_naive_e128", 128, 8, R::kRenormalizeNaive},
      {"qwen3next_naive_e512", 512, 10, R::kRenormalizeNaive},
      {"sigmoid_e96", 96, 6, R::kSigmoid},
      {"sigmoid_renorm_e256", 256, 8, R::kSigmoidRenorm},
      {"topk_logits_e40", 40, 3, R::kTopK},
      {"llama4_e16", 16, 1, R::kLlama4},
      {"minimax2_e256", 256, 8, R::kMiniMax2, 0, 0, true, "sigmoid", true, 1.0},
      {"deepseekv3_e256", 256, 8, R::kDeepSeekV3, 8, 4, true, "sigmoid", true, 2.5},
      {"deepseekv3_e64_g32", 64, 4, R::kDeepSeekV3, 32, 3, true, "sigmoid", true, 1.5},
      {"deepseekv4_e384", 384, 6, R::kDeepseekV4, 0, 0, true, "sqrtsoftplus", true, 1.5},
      {"grouped_softmax_nobias_e160", 160, 6, R::kUnspecified, 8, 3, false, "softmax", true, 1.0},
      // groups of 48: a group's experts over parts of two or three rows of 32
      {"deepseekv3_e384_g8", 384, 8, R::kDeepSeekV3, 8, 3, true, "sigmoid", true, 2.5},
      {"grouped_softmax_nobias_e480_g10", 480, 8, R::kUnspecified, 10, 4, false, "softmax", true,
       1.0},
      {"bias_softmax_e1024", 1024, 8, R::kUnspecified, 0, 0, true, "softmax", false, 1.0},
  };
}

// Rows: random normal logits, then the rule rows (exact ties, a NaN, +inf, -inf, all equal).
std::vector<float> make_logits(int M, int E, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.5f);
  std::uniform_int_distribution<int> small(-2, 2);
  std::vector<float> l(static_cast<size_t>(M) * E);
  for (auto& v : l) v = nd(rng);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  auto row = [&](int r) { return l.data() + static_cast<size_t>(r) * E; };
  for (int e = 0; e < E; ++e) row(0)[e] = static_cast<float>(small(rng));  // many exact ties
  for (int e = 0; e < E; ++e) row(1)[e] = 0.5f;                            // all equal
  row(2)[E / 3] = nan;
  row(3)[E - 1] = inf;
  row(4)[0] = -inf;
  row(4)[E / 2] = -inf;
  for (int e = 0; e < E; ++e) row(5)[e] = e % 2 ? -0.0f : 0.0f;  // signed zeros tie
  return l;
}

uint16_t to_bf16_bits(float f) {  // round to nearest even (finite inputs here)
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
float from_bf16_bits(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

struct DeviceRoute {
  std::vector<int32_t> ids;
  std::vector<float> w;
};

// Routes the case's rows on the device (one block per token, or one warp per token) and checks
// them against the reference; returns the device's ids and weights.
DeviceRoute run_case(const RouteCase& c, bool bf16, bool one_warp_per_token) {
  const int M = 70;
  const int E = c.E;
  std::vector<float> logits = make_logits(M, E, 1234u + static_cast<uint32_t>(E));
  std::vector<float> bias(static_cast<size_t>(E));
  {
    std::mt19937 rng(99u + static_cast<uint32_t>(E));
    std::uniform_real_distribution<float> ud(-0.3f, 0.3f);
    for (auto& v : bias) v = ud(rng);
    bias[3] = bias[5];  // a tie through the bias as well
  }
  // host and device copies (bf16: the host reference sees the same rounded values)
  Tensor lh = Tensor::empty({M, E}, bf16 ? DType::kBF16 : DType::kF32);
  Tensor bh = Tensor::empty({E}, bf16 ? DType::kBF16 : DType::kF32);
  for (size_t i = 0; i < logits.size(); ++i) {
    if (bf16) {
      const bool nan = std::isnan(logits[i]);
      static_cast<uint16_t*>(lh.data())[i] = nan ? uint16_t(0x7fc0) : to_bf16_bits(logits[i]);
      if (!nan) logits[i] = from_bf16_bits(to_bf16_bits(logits[i]));
    } else {
      static_cast<float*>(lh.data())[i] = logits[i];
    }
  }
  for (int e = 0; e < E; ++e) {
    if (bf16)
      static_cast<uint16_t*>(bh.data())[e] = to_bf16_bits(bias[e]);
    else
      static_cast<float*>(bh.data())[e] = bias[e];
  }
  RoutingConfig cfg;
  cfg.method = c.method;
  cfg.topk = c.topk;
  cfg.num_expert_group = c.groups;
  cfg.topk_group = c.topk_group;
  cfg.scoring_func = c.scoring;
  cfg.renormalize = c.renormalize;
  cfg.routed_scaling_factor = c.rsf;
  if (c.bias) cfg.e_score_correction_bias = bh.view();
  const numerics::RoutingResult ref = numerics::route(lh.view(), cfg);

  Tensor ld = lh.to(Device::cuda());
  Tensor bd = bh.to(Device::cuda());
  Tensor ids_d = Tensor::empty({M, c.topk}, DType::kI32, Device::cuda());
  Tensor w_d = Tensor::empty({M, c.topk}, DType::kF32, Device::cuda());
  // poisoned: a routine that skips a token must not inherit an earlier run's ids from a reused
  // allocation
  EXPECT_EQ(cudaMemset(ids_d.data(), 0xFF, ids_d.nbytes()), cudaSuccess);
  EXPECT_EQ(cudaMemset(w_d.data(), 0xFF, w_d.nbytes()), cudaSuccess);
  RoutingConfig dcfg = cfg;
  if (c.bias) dcfg.e_score_correction_bias = bd.view();
  cuda::device_route(ld.view(), dcfg, static_cast<int32_t*>(ids_d.data()),
                     static_cast<float*>(w_d.data()), one_warp_per_token);
  const Tensor ids = ids_d.to(Device::cpu());
  const Tensor w = w_d.to(Device::cpu());
  const auto* ri = static_cast<const int32_t*>(ref.topk_ids.data());
  const auto* rw = static_cast<const float*>(ref.topk_weights.data());
  const auto* di = static_cast<const int32_t*>(ids.data());
  const auto* dw = static_cast<const float*>(w.data());
  const std::string what =
      c.name + (bf16 ? " bf16" : " f32") + (one_warp_per_token ? " (one warp per token)" : "");
  int bad_ids = 0, bad_w = 0;
  for (int t = 0; t < M; ++t) {
    for (int j = 0; j < c.topk; ++j) {
      const size_t i = static_cast<size_t>(t) * c.topk + j;
      if (ri[i] != di[i] && ++bad_ids <= 5)
        ADD_FAILURE() << what << " token " << t << " slot " << j << ": device expert " << di[i]
                      << ", reference " << ri[i];
      const float tol = 1e-5f * std::max(1.0f, std::fabs(rw[i]));
      if (!(std::fabs(rw[i] - dw[i]) <= tol) && ++bad_w <= 5)
        ADD_FAILURE() << what << " token " << t << " slot " << j << ": device weight " << dw[i]
                      << ", reference " << rw[i];
    }
  }
  EXPECT_EQ(bad_ids, 0) << what;
  EXPECT_EQ(bad_w, 0) << what;
  const size_t n = static_cast<size_t>(M) * c.topk;
  return {std::vector<int32_t>(di, di + n), std::vector<float>(dw, dw + n)};
}

uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

TEST(CudaRouting, MatchesTheReferenceForEveryMethod) {
  SKIP_WITHOUT_GPU();
  for (const RouteCase& c : cases()) {
    SCOPED_TRACE(c.name);
    run_case(c, false, false);
    run_case(c, true, false);
  }
}

// route_token_warp (the single-kernel path's routine) against the reference, and bit for bit
// against route_token_block: the same ids and the same float weights.
TEST(CudaRouting, OneWarpPerTokenMatchesTheReference) {
  SKIP_WITHOUT_GPU();
  int ran = 0;
  for (const RouteCase& c : cases()) {
    if (c.E > 512) continue;  // kRouteWarpMaxExperts
    SCOPED_TRACE(c.name);
    for (const bool bf16 : {false, true}) {
      const DeviceRoute warp = run_case(c, bf16, true);
      const DeviceRoute block = run_case(c, bf16, false);
      ASSERT_EQ(warp.ids.size(), block.ids.size());
      int bad = 0;
      for (size_t i = 0; i < warp.ids.size(); ++i) {
        if ((warp.ids[i] != block.ids[i] || float_bits(warp.w[i]) != float_bits(block.w[i])) &&
            ++bad <= 5)
          ADD_FAILURE() << c.name << (bf16 ? " bf16" : " f32") << " token " << i / c.topk
                        << " slot " << i % c.topk << ": warp (" << warp.ids[i] << ", " << warp.w[i]
                        << " = 0x" << std::hex << float_bits(warp.w[i]) << std::dec << "), block ("
                        << block.ids[i] << ", " << block.w[i] << " = 0x" << std::hex
                        << float_bits(block.w[i]) << std::dec << ")";
      }
      EXPECT_EQ(bad, 0) << c.name << (bf16 ? " bf16" : " f32");
      ++ran;
    }
  }
  EXPECT_GT(ran, 0);
}

TEST(CudaRouting, RejectsWhatTheForwardRejects) {
  SKIP_WITHOUT_GPU();
  Tensor l = Tensor::zeros({2, 2048}, DType::kF32, Device::cuda());
  Tensor ids = Tensor::empty({2, 8}, DType::kI32, Device::cuda());
  Tensor w = Tensor::empty({2, 8}, DType::kF32, Device::cuda());
  RoutingConfig cfg;
  cfg.topk = 8;
  EXPECT_THROW(cuda::device_route(l.view(), cfg, static_cast<int32_t*>(ids.data()),
                                  static_cast<float*>(w.data())),
               NotImplementedError);
  Tensor l2 = Tensor::zeros({2, 16}, DType::kF32, Device::cuda());
  cfg.topk = 17;
  EXPECT_THROW(cuda::device_route(l2.view(), cfg, static_cast<int32_t*>(ids.data()),
                                  static_cast<float*>(w.data())),
               ValueError);
  // one warp per token: at most 512 experts (the block routine takes 640)
  Tensor l3 = Tensor::zeros({2, 640}, DType::kF32, Device::cuda());
  cfg.topk = 8;
  try {
    cuda::device_route(l3.view(), cfg, static_cast<int32_t*>(ids.data()),
                       static_cast<float*>(w.data()), true);
    ADD_FAILURE() << "one warp per token took E = 640";
  } catch (const NotImplementedError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("640"), std::string::npos) << msg;
    EXPECT_NE(msg.find("512"), std::string::npos) << msg;
  }
  EXPECT_NO_THROW(cuda::device_route(l3.view(), cfg, static_cast<int32_t*>(ids.data()),
                                     static_cast<float*>(w.data())));
}

}  // namespace
}  // namespace fp8moe
