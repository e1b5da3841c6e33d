// Expert parallelism on the CPU: EP ranks simulated by threads over the in-process communicator,
// the reference kernel as each rank's local experts. Exact-mode problems must equal the single-rank
// reference bit for bit (standard and batched formats, uneven expert counts, zero-token ranks,
// padded -1 ids); statistical problems agree within the FP8 tolerance.
#include <gtest/gtest.h>

#include <cstring>
#include <thread>
#include <vector>

#include "common/moe_testing.hpp"
#include "fp8moe/ep_moe.hpp"
#include "fp8moe/error.hpp"
#include "kernels/ref/ref.hpp"

namespace fp8moe {
namespace {

using testing::MoeTestMode;
using testing::MoeTestProblem;
using testing::MoeTestSpec;

// Experts [start, start + n) of a (E, ...) tensor (contiguous, linear placement).
TensorView slice_experts(const TensorView& t, int64_t start, int64_t n) {
  if (!t.defined()) return t;
  TensorView v = t;
  v.data =
      static_cast<char*>(t.data) + start * t.strides[0] * static_cast<int64_t>(dtype_size(t.dtype));
  v.shape[0] = n;
  return v;
}

// Rows [start, start + n) of a (M, ...) tensor, copied.
Tensor slice_rows(const TensorView& t, int64_t start, int64_t n) {
  std::vector<int64_t> shape = t.sizes();
  shape[0] = n;
  Tensor r = Tensor::empty(std::span<const int64_t>(shape), t.dtype);
  const std::size_t row = t.nbytes() / static_cast<std::size_t>(std::max<int64_t>(t.size(0), 1));
  if (n) std::memcpy(r.data(), static_cast<const char*>(t.data) + start * row, n * row);
  return r;
}

struct EpCase {
  int ep;
  std::vector<int64_t> tokens_per_rank;  // sums to M
  EpExpertsFormat format;
};

// Runs the problem split over ranks and returns the concatenated output.
Tensor run_ep(const MoeTestProblem& p, const EpCase& c) {
  const EpLayout layout = EpLayout::linear(static_cast<int>(p.spec.E), c.ep);
  auto group = make_in_process_group(c.ep);
  const int64_t M = p.x.size(0), H = p.x.size(1);
  Tensor out = Tensor::empty({M, H}, p.x.dtype());
  std::vector<Tensor> outs(c.ep);
  std::vector<std::string> errors(c.ep);
  std::vector<std::thread> threads;
  for (int r = 0; r < c.ep; ++r) {
    threads.emplace_back([&, r] {
      try {
        int64_t t0 = 0;
        for (int q = 0; q < r; ++q) t0 += c.tokens_per_rank[q];
        const int64_t n = c.tokens_per_rank[r];
        int64_t e0 = 0;
        for (int q = 0; q < r; ++q) e0 += layout.num_local(q);
        const int64_t ne = layout.num_local(r);
        Tensor x = slice_rows(p.x, t0, n), ids = slice_rows(p.topk_ids, t0, n),
               w = slice_rows(p.topk_weights, t0, n);
        outs[r] = Tensor::empty({n, H}, p.x.dtype());
        EpMoeArgs a;
        a.x = x;
        a.topk_ids = ids;
        a.topk_weights = w;
        a.scheme = p.spec.scheme;
        a.act = p.spec.act;
        a.weights.w13 = slice_experts(p.w13, e0, ne);
        a.weights.w2 = slice_experts(p.w2, e0, ne);
        a.weights.w13_scale = slice_experts(p.w13_scale, e0, ne);
        a.weights.w2_scale = slice_experts(p.w2_scale, e0, ne);
        a.weights.w13_bias = slice_experts(p.w13_bias, e0, ne);
        a.weights.w2_bias = slice_experts(p.w2_bias, e0, ne);
        a.weights.a13_scale = p.a13_scale;
        a.weights.a2_scale = p.a2_scale;
        a.out = outs[r];
        ep_moe_forward(*group[r], ref::ref_experts_impl(), c.format, layout, a);
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < c.ep; ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
  int64_t row = 0;
  const std::size_t rb = static_cast<std::size_t>(H) * dtype_size(p.x.dtype());
  for (int r = 0; r < c.ep; ++r) {
    if (outs[r].defined() && outs[r].size(0)) {
      std::memcpy(static_cast<char*>(out.data()) + row * rb, outs[r].data(), outs[r].nbytes());
    }
    row += c.tokens_per_rank[r];
  }
  return out;
}

MoeTestSpec base_spec(MoeTestMode mode) {
  MoeTestSpec s;
  s.M = 13;
  s.E = 8;
  s.H = 256;
  s.I = 128;
  s.topk = 3;
  s.mode = mode;
  s.seed = 7;
  return s;
}

TEST(ExpertParallel, ExactModeEqualsSingleRankBitForBit) {  // pitfalls 23, 24
  const std::vector<EpCase> cases = {
      {1, {13}, EpExpertsFormat::kStandard},
      {2, {7, 6}, EpExpertsFormat::kStandard},
      {3, {13, 0, 0}, EpExpertsFormat::kStandard},  // 8 experts over 3 ranks: 3, 3, 2; idle ranks
      {4, {0, 5, 0, 8}, EpExpertsFormat::kStandard},
      {8, {2, 2, 2, 2, 2, 1, 1, 1}, EpExpertsFormat::kStandard},
      {2, {7, 6}, EpExpertsFormat::kBatched},
      {3, {4, 0, 9}, EpExpertsFormat::kBatched},
      {8, {0, 0, 0, 13, 0, 0, 0, 0}, EpExpertsFormat::kBatched},
  };
  for (const bool bias : {false, true}) {
    for (const int64_t padded : {int64_t{0}, int64_t{5}}) {
      MoeTestSpec spec = base_spec(MoeTestMode::kExact);
      spec.bias = bias;
      spec.padded_slots = padded;
      const MoeTestProblem p = testing::make_problem(spec);
      const Tensor expected = testing::reference_output(p);
      for (const auto& c : cases) {
        const Tensor got = run_ep(p, c);
        const auto rep = testing::compare_bitwise(got, expected);
        EXPECT_TRUE(rep.ok) << spec.name() << " ep=" << c.ep << " format "
                            << (c.format == EpExpertsFormat::kBatched ? "batched" : "standard")
                            << ": " << rep.str();
      }
    }
  }
}

TEST(ExpertParallel, StatisticalModeWithinTolerance) {
  MoeTestSpec spec = base_spec(MoeTestMode::kStatistical);
  spec.M = 40;
  spec.topk = 4;
  const MoeTestProblem p = testing::make_problem(spec);
  const Tensor expected = testing::reference_output(p);
  for (const auto& c : std::vector<EpCase>{{4, {10, 10, 10, 10}, EpExpertsFormat::kStandard},
                                           {3, {40, 0, 0}, EpExpertsFormat::kBatched}}) {
    const Tensor got = run_ep(p, c);
    const auto rep = testing::compare_close(got, expected, 0.035, 0.035);
    EXPECT_TRUE(rep.ok) << rep.str();
    // Partial outputs are rounded to bf16 once more than on one rank: a small, nonzero difference.
    EXPECT_LT(rep.mean_rel_abs_err, 0.01) << rep.str();
  }
}

TEST(ExpertParallel, EmptyBatchOnEveryRank) {  // pitfall 21
  MoeTestSpec spec = base_spec(MoeTestMode::kExact);
  spec.M = 0;
  const MoeTestProblem p = testing::make_problem(spec);
  for (const auto fmt : {EpExpertsFormat::kStandard, EpExpertsFormat::kBatched}) {
    const Tensor got = run_ep(p, {4, {0, 0, 0, 0}, fmt});
    EXPECT_EQ(got.size(0), 0);
  }
}

TEST(ExpertParallel, OneBadRankFailsEveryRankWithoutHanging) {
  const MoeTestProblem p = testing::make_problem(base_spec(MoeTestMode::kExact));
  const EpLayout layout = EpLayout::linear(8, 2);
  auto group = make_in_process_group(2);
  std::vector<std::string> errors(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      Tensor out = Tensor::empty({p.x.size(0), p.x.size(1)}, p.x.dtype());
      EpMoeArgs a;
      a.x = p.x;
      a.topk_ids = p.topk_ids;
      a.topk_weights = p.topk_weights;
      a.scheme = p.spec.scheme;
      a.weights.w13 = slice_experts(p.w13, 4 * r, 4);
      a.weights.w2 = slice_experts(p.w2, 4 * r, 4);
      a.weights.w13_scale = slice_experts(p.w13_scale, 4 * r, 4);
      // Rank 1 forgets its w2 scales: its local kernel rejects the arguments.
      a.weights.w2_scale = r == 1 ? TensorView{} : slice_experts(p.w2_scale, 4 * r, 4);
      a.out = out;
      try {
        ep_moe_forward(*group[r], ref::ref_experts_impl(), EpExpertsFormat::kStandard, layout, a);
      } catch (const ValueError& e) {
        errors[r] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_NE(errors[1].find("w2_scale"), std::string::npos) << errors[1];
  EXPECT_NE(errors[0].find("failed on rank 1"), std::string::npos) << errors[0];
}

TEST(ExpertParallel, LayoutIsBalancedAndMapsAreConsistent) {  // pitfall 22
  const EpLayout l = EpLayout::linear(128, 6);
  std::vector<int> counts;
  for (int r = 0; r < 6; ++r) counts.push_back(l.num_local(r));
  EXPECT_EQ(counts, (std::vector<int>{22, 22, 21, 21, 21, 21}));
  for (int r = 0; r < 6; ++r) {
    const auto map = l.expert_map(r);
    for (int e = 0; e < 128; ++e) EXPECT_EQ(map[e] >= 0, l.owner[e] == r);
  }
  const EpLayout rr = EpLayout::round_robin(10, 4);
  EXPECT_EQ(rr.owner[5], 1);
  EXPECT_EQ(rr.local_index[5], 1);
}

}  // namespace
}  // namespace fp8moe
