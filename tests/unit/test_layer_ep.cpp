// forward_expert_parallel: EP ranks of an Fp8MoeLayer (each loading its own experts of the example
// checkpoint) as threads over the in-process communicator, against the single-rank layer. With
// top-2 routing the EP output equals the single-rank output bit for bit (a token's two slot outputs
// are either computed on one rank as on a single rank, or summed in f32 from two bf16 partials as
// the single-rank kernel sums them). A rank whose layer does not fit the group makes every rank
// throw, and none hangs.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "common/moe_testing.hpp"
#include "fp8moe/checkpoint.hpp"
#include "fp8moe/error.hpp"
#include "fp8moe/layer.hpp"
#include "fp8moe/numerics.hpp"
#include "unit/test_checkpoint_util.hpp"

namespace fp8moe {
namespace {

using test::TempDir;

const std::string& ep_example_dir() {
  static TempDir dir;
  static const bool written = [] {
    ExampleCheckpointSpec spec;
    spec.layers = 1;
    write_example_checkpoint(dir.path(), spec);
    return true;
  }();
  (void)written;
  return dir.path();
}

Fp8MoeLayer rank_layer(int ep, int rank, const std::string& kernel) {
  CheckpointLayerRequest req;
  req.tp_size = ep;
  req.rank = rank;
  req.enable_ep = true;
  Fp8MoeLayerOptions opts;
  opts.kernel = kernel;
  return Fp8MoeLayer::from_checkpoint(ep_example_dir(), req, opts);
}

// Runs `layers[r]` on rank r with tokens_per_rank[r] tokens; returns the output in token order
// and every rank's error ("" when none).
Tensor run_group(const std::vector<const Fp8MoeLayer*>& layers, int group_size,
                 const std::vector<int64_t>& tokens_per_rank, const Tensor& x, const Tensor& logits,
                 std::vector<std::string>* errors, EpForwardOptions eo = {}) {
  auto group = make_in_process_group(group_size);
  errors->assign(static_cast<std::size_t>(group_size), "");
  std::vector<Tensor> outs(static_cast<std::size_t>(group_size));
  std::vector<std::thread> threads;
  int64_t first = 0;
  for (int r = 0; r < group_size; ++r) {
    const int64_t n = tokens_per_rank[r];
    outs[r] = Tensor::empty({n, x.size(1)}, x.dtype());
    threads.emplace_back([&, r, first, n] {
      try {
        const Tensor xr = testing::rows_of(x, first, n), lr = testing::rows_of(logits, first, n);
        forward_expert_parallel(*layers[r], *group[r], xr, lr, outs[r], eo);
      } catch (const Error& e) {
        (*errors)[r] = e.what();
      }
    });
    first += n;
  }
  for (auto& t : threads) t.join();
  Tensor out = Tensor::empty({x.size(0), x.size(1)}, x.dtype());
  std::size_t off = 0;
  for (const Tensor& o : outs) {
    if (o.nbytes()) std::memcpy(static_cast<char*>(out.data()) + off, o.data(), o.nbytes());
    off += o.nbytes();
  }
  return out;
}

int64_t bit_mismatches(const Tensor& a, const Tensor& b) {
  EXPECT_EQ(a.nbytes(), b.nbytes());
  int64_t n = 0;
  const auto* pa = a.ptr<const uint16_t>();
  const auto* pb = b.ptr<const uint16_t>();
  for (int64_t i = 0; i < a.numel(); ++i) n += pa[i] != pb[i];
  return n;
}

TEST(LayerExpertParallel, EqualsSingleRankBitForBit) {
  const int64_t M = 23, H = 256, E = 8;
  const Tensor x = testing::randn(M, H, DType::kBF16, 0.1f, 3);
  const Tensor logits = testing::randn(M, E, DType::kF32, 1.0f, 4);
  for (const std::string kernel : {"", "ref"}) {
    const Fp8MoeLayer single = rank_layer(1, 0, kernel);
    const Tensor want = single.forward(x, logits);
    struct Case {
      int ep;
      std::vector<int64_t> tokens;
    };
    for (const Case& c : {Case{1, {23}}, Case{2, {12, 11}}, Case{3, {0, 23, 0}},
                          Case{4, {6, 6, 6, 5}}, Case{8, {3, 3, 3, 3, 3, 3, 3, 2}}}) {
      std::vector<Fp8MoeLayer> layers;
      for (int r = 0; r < c.ep; ++r) layers.push_back(rank_layer(c.ep, r, kernel));
      std::vector<const Fp8MoeLayer*> ptrs;
      for (const auto& l : layers) ptrs.push_back(&l);
      std::vector<std::string> errors;
      const Tensor got = run_group(ptrs, c.ep, c.tokens, x, logits, &errors);
      for (int r = 0; r < c.ep; ++r) EXPECT_EQ(errors[r], "") << "ep " << c.ep << " rank " << r;
      EXPECT_EQ(bit_mismatches(got, want), 0) << "kernel '" << kernel << "' ep " << c.ep << " ("
                                              << layers[0].kernel_for(M).impl_name << ")";
    }
  }
}

TEST(LayerExpertParallel, BatchedFormatWithTheReference) {  // pitfall 23
  const int64_t M = 9, H = 256, E = 8;
  const Tensor x = testing::randn(M, H, DType::kBF16, 0.1f, 5);
  const Tensor logits = testing::randn(M, E, DType::kF32, 1.0f, 6);
  const Tensor want = rank_layer(1, 0, "ref").forward(x, logits);
  std::vector<Fp8MoeLayer> layers;
  for (int r = 0; r < 3; ++r) layers.push_back(rank_layer(3, r, "ref"));
  std::vector<const Fp8MoeLayer*> ptrs = {&layers[0], &layers[1], &layers[2]};
  std::vector<std::string> errors;
  EpForwardOptions eo;
  eo.format = EpExpertsFormat::kBatched;
  const Tensor got = run_group(ptrs, 3, {4, 0, 5}, x, logits, &errors, eo);
  for (const auto& e : errors) EXPECT_EQ(e, "");
  // The batched experts return unweighted slab rows (the combine applies the router weight):
  // another rounding order than the standard format, within vLLM's block-FP8 tolerance.
  const OutputComparison c = compare_outputs(got, want);
  EXPECT_TRUE(c.allclose) << c.max_abs_err;
  EXPECT_LT(c.mean_rel_abs_err, 0.01);
}

TEST(LayerExpertParallel, MismatchedGroupFailsEveryRankWithoutHanging) {
  const Tensor x = testing::randn(4, 256, DType::kBF16, 0.1f, 7);
  const Tensor logits = testing::randn(4, 8, DType::kF32, 1.0f, 8);
  std::vector<std::string> errors;
  // Layers of EP 2 in a group of 3.
  {
    const Fp8MoeLayer a = rank_layer(2, 0, ""), b = rank_layer(2, 1, "");
    run_group({&a, &b, &a}, 3, {2, 1, 1}, x, logits, &errors);
    for (const auto& e : errors) EXPECT_FALSE(e.empty());
    EXPECT_NE(errors[0].find("EP rank 0 of 2, the communicator is rank 0 of 3"), std::string::npos)
        << errors[0];
  }
  // Rank 1's layer on rank 0 and the other way round.
  {
    const Fp8MoeLayer a = rank_layer(2, 0, ""), b = rank_layer(2, 1, "");
    run_group({&b, &a}, 2, {2, 2}, x, logits, &errors);
    for (const auto& e : errors) EXPECT_FALSE(e.empty());
  }
  // A whole (non-EP) layer in a group of 2.
  {
    const Fp8MoeLayer whole = rank_layer(1, 0, ""), b = rank_layer(2, 1, "");
    run_group({&whole, &b}, 2, {2, 2}, x, logits, &errors);
    EXPECT_NE(errors[0].find("holds every expert"), std::string::npos) << errors[0];
    EXPECT_NE(errors[1].find("EP rank 0 cannot take part"), std::string::npos) << errors[1];
  }
  // Wrong logits width on one rank.
  {
    const Fp8MoeLayer a = rank_layer(2, 0, ""), b = rank_layer(2, 1, "");
    const Tensor bad_logits = testing::randn(4, 7, DType::kF32, 1.0f, 9);
    auto group = make_in_process_group(2);
    std::vector<std::string> errs(2);
    Tensor o0 = Tensor::empty({4, 256}, DType::kBF16), o1 = Tensor::empty({4, 256}, DType::kBF16);
    std::thread t0([&] {
      try {
        forward_expert_parallel(a, *group[0], x, logits, o0);
      } catch (const Error& e) {
        errs[0] = e.what();
      }
    });
    std::thread t1([&] {
      try {
        forward_expert_parallel(b, *group[1], x, bad_logits, o1);
      } catch (const Error& e) {
        errs[1] = e.what();
      }
    });
    t0.join();
    t1.join();
    EXPECT_NE(errs[1].find("router_logits must be a host (4, 8)"), std::string::npos) << errs[1];
    EXPECT_NE(errs[0].find("EP rank 1 cannot take part"), std::string::npos) << errs[0];
  }
}

TEST(LayerExpertParallel, SimulatedRanksShareTheCpuThreads) {
  // Each call is made on a fresh thread (the setting is per thread).
  int all = 0, quarter = 0, many = 0;
  std::thread([&] { all = share_cpu_threads_among_ranks(1); }).join();
  std::thread([&] { quarter = share_cpu_threads_among_ranks(4); }).join();
  std::thread([&] { many = share_cpu_threads_among_ranks(100000); }).join();
  EXPECT_GE(all, 1);
  EXPECT_EQ(quarter, std::max(1, all / 4));
  EXPECT_EQ(many, 1);
}

}  // namespace
}  // namespace fp8moe
