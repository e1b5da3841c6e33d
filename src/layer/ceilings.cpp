// The CPU ceilings `fp8moe bench` divides by, measured in the same run: a STREAM-like read
// bandwidth (every OpenMP thread sums its slice of a 128 MiB array with the widest vectors) and a
// peak f32 FMA rate (independent FMA chains in registers). Highway compiles both for each SIMD
// target and picks the best one this CPU runs, as the CPU kernels do.
#ifndef HWY_DISABLED_TARGETS
#define HWY_DISABLED_TARGETS (HWY_SSSE3 | HWY_SSE4)
#endif
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "layer/ceilings.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>

#include <cstddef>
#include <cstdint>

HWY_BEFORE_NAMESPACE();
namespace fp8moe::bench {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// 10 independent chains of `iters` FMAs on full vectors; returns a value that depends on all of
// them (so nothing is optimised away). FLOPs = 2 * 10 * iters * Lanes.
float FmaChains(int64_t iters) {
  const hn::ScalableTag<float> d;
  const auto m = hn::Set(d, 0.999999f);
  const auto c = hn::Set(d, 1e-7f);
  auto a0 = hn::Set(d, 1.0f), a1 = hn::Set(d, 1.1f), a2 = hn::Set(d, 1.2f), a3 = hn::Set(d, 1.3f);
  auto a4 = hn::Set(d, 1.4f), a5 = hn::Set(d, 1.5f), a6 = hn::Set(d, 1.6f), a7 = hn::Set(d, 1.7f);
  auto a8 = hn::Set(d, 1.8f), a9 = hn::Set(d, 1.9f);
  for (int64_t i = 0; i < iters; ++i) {
    a0 = hn::MulAdd(a0, m, c);
    a1 = hn::MulAdd(a1, m, c);
    a2 = hn::MulAdd(a2, m, c);
    a3 = hn::MulAdd(a3, m, c);
    a4 = hn::MulAdd(a4, m, c);
    a5 = hn::MulAdd(a5, m, c);
    a6 = hn::MulAdd(a6, m, c);
    a7 = hn::MulAdd(a7, m, c);
    a8 = hn::MulAdd(a8, m, c);
    a9 = hn::MulAdd(a9, m, c);
  }
  const auto s = hn::Add(hn::Add(hn::Add(a0, a1), hn::Add(a2, a3)),
                         hn::Add(hn::Add(hn::Add(a4, a5), hn::Add(a6, a7)), hn::Add(a8, a9)));
  return hn::GetLane(hn::SumOfLanes(d, s));
}

size_t FloatLanes() { return hn::Lanes(hn::ScalableTag<float>()); }
const char* TargetNameHere() { return hwy::TargetName(HWY_TARGET); }

// Sum of n floats (n a multiple of 4 * Lanes), four accumulators.
float ReadSum(const float* p, int64_t n) {
  const hn::ScalableTag<float> d;
  const int64_t L = static_cast<int64_t>(hn::Lanes(d));
  auto s0 = hn::Zero(d), s1 = hn::Zero(d), s2 = hn::Zero(d), s3 = hn::Zero(d);
  for (int64_t i = 0; i + 4 * L <= n; i += 4 * L) {
    s0 = hn::Add(s0, hn::LoadU(d, p + i));
    s1 = hn::Add(s1, hn::LoadU(d, p + i + L));
    s2 = hn::Add(s2, hn::LoadU(d, p + i + 2 * L));
    s3 = hn::Add(s3, hn::LoadU(d, p + i + 3 * L));
  }
  return hn::GetLane(hn::SumOfLanes(d, hn::Add(hn::Add(s0, s1), hn::Add(s2, s3))));
}

}  // namespace HWY_NAMESPACE
}  // namespace fp8moe::bench
HWY_AFTER_NAMESPACE();

#if HWY_ONCE

#include <fmt/format.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <vector>

#include "layer/bench.hpp"

namespace fp8moe::bench {

HWY_EXPORT(FmaChains);
HWY_EXPORT(FloatLanes);
HWY_EXPORT(TargetNameHere);
HWY_EXPORT(ReadSum);

namespace {
double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
volatile float g_sink = 0;  // keeps the probes' results alive
}  // namespace

Ceilings measure_cpu_ceilings(double seconds) {
  Ceilings c;
  c.threads = omp_get_max_threads();
  c.simd_target = HWY_DYNAMIC_DISPATCH(TargetNameHere)();
  const int64_t lanes = static_cast<int64_t>(HWY_DYNAMIC_DISPATCH(FloatLanes)());

  // FMA: each thread runs chains of `iters`; repeat until `seconds`, keep the best pass.
  const int64_t iters = 1 << 20;
  double best_fma = 0;
  const double t_end = now_s() + seconds;
  do {
    const double t0 = now_s();
    float total = 0;
    int team = 0;
#pragma omp parallel reduction(+ : total, team)
    {
      total += HWY_DYNAMIC_DISPATCH(FmaChains)(iters);
      team += 1;
    }
    g_sink = total;
    const double dt = now_s() - t0;
    best_fma = std::max(best_fma, 2.0 * 10 * iters * lanes * team / dt);
  } while (now_s() < t_end);
  c.fma_flops_per_s = best_fma;

  // Read bandwidth: a 128 MiB array (past every last-level cache of the machines this runs on),
  // first touched by the threads that read it.
  const int64_t n = (int64_t{128} << 20) / 4;
  std::vector<float> buf(static_cast<std::size_t>(n));
#pragma omp parallel
  {
    const int t = omp_get_thread_num(), T = omp_get_num_threads();
    const int64_t b = n * t / T, e = n * (t + 1) / T;
    std::fill(buf.data() + b, buf.data() + e, 1.0f);
  }
  double best_bw = 0;
  const double t_end2 = now_s() + seconds;
  do {
    const double t0 = now_s();
    float total = 0;
#pragma omp parallel reduction(+ : total)
    {
      const int t = omp_get_thread_num(), T = omp_get_num_threads();
      const int64_t unit = 4 * lanes;
      const int64_t b = n * t / T / unit * unit, e = n * (t + 1) / T / unit * unit;
      total += HWY_DYNAMIC_DISPATCH(ReadSum)(buf.data() + b, e - b);
    }
    g_sink = total;
    const double dt = now_s() - t0;
    best_bw = std::max(best_bw, static_cast<double>(n) * 4 / dt);
  } while (now_s() < t_end2);
  c.read_bytes_per_s = best_bw;
  c.measured = true;
  c.note = fmt::format(
      "measured now: {} OpenMP threads, {} vectors; read = sum of a 128 MiB f32 array, FMA = 10 "
      "independent f32 FMA chains per thread (best of repeated passes)",
      c.threads, c.simd_target);
  return c;
}

}  // namespace fp8moe::bench

#endif  // HWY_ONCE
