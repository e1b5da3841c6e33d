// The in-process communicator: all-to-all-v with uneven and zero counts, count exchange,
// all-reduce, and mismatches reported as errors on every rank without hanging.
#include <gtest/gtest.h>

#include <thread>
#include <vector>

#include "fp8moe/error.hpp"
#include "fp8moe/numerics.hpp"
#include "fp8moe/parallel.hpp"

namespace fp8moe {
namespace {

// Runs fn(comm) on `n` threads, one per rank; rethrows nothing (fn records its own results).
template <class Fn>
void run_ranks(int n, Fn fn) {
  auto group = make_in_process_group(n);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) threads.emplace_back([&, r] { fn(*group[r]); });
  for (auto& t : threads) t.join();
}

TEST(InProcessCommunicator, AllToAllVWithUnevenAndZeroCounts) {
  for (int n : {1, 2, 3, 5, 8}) {
    std::vector<std::vector<int32_t>> received(n);
    run_ranks(n, [&](Communicator& c) {
      const int me = c.rank();
      // Rank s sends (s + d) % 3 values to rank d, each value encoding (s, d, index).
      std::vector<int64_t> send_counts(n), recv_counts(n);
      std::vector<int32_t> send;
      for (int d = 0; d < n; ++d) {
        send_counts[d] = (me + d) % 3;
        for (int i = 0; i < send_counts[d]; ++i) send.push_back(me * 10000 + d * 100 + i);
      }
      c.all_to_all_counts(send_counts, recv_counts);
      int64_t total = 0;
      for (int s = 0; s < n; ++s) {
        EXPECT_EQ(recv_counts[s], (s + me) % 3);
        total += recv_counts[s];
      }
      std::vector<int32_t> recv(total, -1);
      c.all_to_all_v(send.data(), send_counts, recv.data(), recv_counts, sizeof(int32_t));
      received[me] = recv;
    });
    for (int d = 0; d < n; ++d) {
      std::vector<int32_t> expect;
      for (int s = 0; s < n; ++s)
        for (int i = 0; i < (s + d) % 3; ++i) expect.push_back(s * 10000 + d * 100 + i);
      EXPECT_EQ(received[d], expect) << "n=" << n << " rank " << d;
    }
  }
}

TEST(InProcessCommunicator, AllReduceSumIsDeterministicAndRoundsBf16Once) {
  const int n = 4;
  std::vector<std::vector<float>> f32(n);
  std::vector<std::vector<uint16_t>> bf(n);
  run_ranks(n, [&](Communicator& c) {
    std::vector<float> v = {1.0f * (c.rank() + 1), 0.25f, -3.0f * c.rank(), 1e-3f};
    Tensor t = Tensor::empty({4}, DType::kF32);
    std::copy(v.begin(), v.end(), t.ptr<float>());
    c.all_reduce_sum(t);
    f32[c.rank()].assign(t.ptr<float>(), t.ptr<float>() + 4);
    // bf16: 1 + 2^-8 on every rank sums to 4 + 2^-6 exactly in f32 and rounds once to bf16 (4.0).
    Tensor b = Tensor::empty({1}, DType::kBF16);
    *b.ptr<uint16_t>() = numerics::float_to_bf16(1.0f + 1.0f / 256);
    c.all_reduce_sum(b);
    bf[c.rank()] = {*b.ptr<uint16_t>()};
  });
  for (int r = 0; r < n; ++r) {
    EXPECT_EQ(f32[r], (std::vector<float>{10.0f, 1.0f, -18.0f, ((1e-3f + 1e-3f) + 1e-3f) + 1e-3f}))
        << "rank " << r;
    EXPECT_EQ(numerics::bf16_to_float(bf[r][0]), numerics::bf16_round(4.0f + 4.0f / 256));
  }
}

TEST(InProcessCommunicator, MismatchedCountsThrowOnEveryRankWithoutHanging) {
  const int n = 3;
  std::vector<int> threw(n, 0);
  run_ranks(n, [&](Communicator& c) {
    std::vector<int64_t> send_counts(n, 1), recv_counts(n, 1);
    if (c.rank() == 1) recv_counts[0] = 2;  // rank 1 expects more than rank 0 sends
    std::vector<int32_t> send(n, 7), recv(4, 0);
    try {
      c.all_to_all_v(send.data(), send_counts, recv.data(), recv_counts, sizeof(int32_t));
    } catch (const ValueError& e) {
      threw[c.rank()] = 1;
      EXPECT_NE(std::string(e.what()).find("rank 0 sends 1 elements to rank 1, which expects 2"),
                std::string::npos)
          << e.what();
    }
    // The group is still usable afterwards.
    c.barrier();
  });
  EXPECT_EQ(threw, (std::vector<int>{0, 1, 0}));
}

TEST(InProcessCommunicator, BadArgumentsAreClearErrors) {
  EXPECT_THROW(make_in_process_group(0), ValueError);
  auto g = make_in_process_group(1);
  std::vector<int64_t> two(2, 0), one(1, 0);
  EXPECT_THROW(g[0]->all_to_all_counts(two, one), ValueError);
  Tensor i = Tensor::empty({2}, DType::kI32);
  EXPECT_THROW(g[0]->all_reduce_sum(i), ValueError);
}

}  // namespace
}  // namespace fp8moe
