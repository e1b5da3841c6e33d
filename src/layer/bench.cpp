// The traffic model and the timing loop of `fp8moe bench` (bench.hpp).
#include "layer/bench.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>

#include "fp8moe/error.hpp"

namespace fp8moe::bench {

Traffic moe_traffic(int64_t M, int64_t E, int64_t E_local, int64_t topk, int64_t N, int64_t K,
                    bool gated) {
  if (M < 0 || E < 1 || E_local < 1 || E_local > E || topk < 1 || topk > E || N < 1 || K < 1) {
    throw ValueError("moe_traffic: sizes out of range");
  }
  Traffic t;
  const double local_share = static_cast<double>(E_local) / static_cast<double>(E);
  // Expected distinct experts hit by M tokens choosing topk of E uniformly: E (1 - (1 - k/E)^M);
  // this rank's share of them.
  const double p_miss = std::pow(1.0 - static_cast<double>(topk) / E, static_cast<double>(M));
  t.distinct_experts = E_local * (1.0 - p_miss);
  const double rows1 = gated ? 2.0 * N : 1.0 * N;
  t.weight_bytes = t.distinct_experts * (rows1 + N) * static_cast<double>(K);  // fp8: 1 byte each
  const double slots = static_cast<double>(M) * topk * local_share;
  t.activation_bytes = 4.0 * M * K + 2.0 * (rows1 + N) * slots;
  t.bytes = t.weight_bytes + t.activation_bytes;
  t.flops = 2.0 * (rows1 + N) * static_cast<double>(K) * slots;
  return t;
}

double roofline_seconds(const Traffic& t, double bytes_per_s, double flops_per_s) {
  double s = 0;
  if (bytes_per_s > 0) s = std::max(s, t.bytes / bytes_per_s);
  if (flops_per_s > 0) s = std::max(s, t.flops / flops_per_s);
  return s;
}

namespace {
double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
}  // namespace

Timing time_forward(const Fp8MoeLayer& layer, const TensorView& x, const TensorView& logits,
                    const TensorView& out, double min_seconds, int min_reps, int max_reps) {
  const bool device = !layer.device().is_cpu();
  uint16_t sink[1];
  auto once = [&] {
    layer.forward(x, logits, out);
    if (device) {
      // A 2-byte device-to-host copy on the default stream waits for the call.
      const auto& a = device_allocator();
      if (!a.copy) throw RuntimeError("time_forward: no device copy hook");
      a.copy(sink, out.data, 2, 1);
    }
  };
  once();  // warm-up (first-touch of the workspace, caches)
  std::vector<double> ts;
  const double start = now_s();
  while (static_cast<int>(ts.size()) < max_reps &&
         (static_cast<int>(ts.size()) < min_reps || now_s() - start < min_seconds)) {
    const double t0 = now_s();
    once();
    ts.push_back(now_s() - t0);
  }
  Timing t;
  t.reps = static_cast<int>(ts.size());
  if (ts.empty()) return t;
  std::sort(ts.begin(), ts.end());
  t.min_s = ts.front();
  t.max_s = ts.back();
  const std::size_t n = ts.size();
  t.median_s = n % 2 ? ts[n / 2] : 0.5 * (ts[n / 2 - 1] + ts[n / 2]);
  return t;
}

}  // namespace fp8moe::bench
