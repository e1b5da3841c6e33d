// CPU experts benchmark (Google Benchmark): one block-FP8 MoE layer per model shape of
// spec/models.md (real hidden, intermediate and top-k; fewer experts where memory demands) for
// M in {1, 4, 16, 64, 256, 1024}, both CPU kernels (cpu_w8a16, cpu_w8a8), and in the same run the
// machine's ceilings measured by this program: a STREAM-like read bandwidth, a peak f32 FMA loop
// and a peak BF16 dot-product loop (vdpbf16ps), with all threads. At the end it prints a markdown
// table (docs/PERFORMANCE.md) with time per layer, the weight bytes of the touched experts
// streamed per second, FLOP/s, and their fractions of the measured ceilings, and the speed-up
// over the float64 reference on small shapes.
//
//   build/bench/bench_cpu_moe                      # everything (a few minutes on 2 cores)
//   build/bench/bench_cpu_moe --benchmark_filter=Qwen3   # one shape
// Environment: OMP_NUM_THREADS (default: all cores), FP8MOE_BENCH_SECONDS (time per case, 1.0).
#include <benchmark/benchmark.h>
#include <fmt/format.h>
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "fp8moe/fused_moe.hpp"
#include "fp8moe/numerics.hpp"
#include "kernels/cpu/cpu_experts.hpp"
#include "kernels/cpu/cpu_kernels.hpp"
#include "kernels/ref/ref.hpp"

namespace {

using namespace fp8moe;
using Clock = std::chrono::steady_clock;

double seconds_per_case() {
  const char* s = std::getenv("FP8MOE_BENCH_SECONDS");
  return s ? std::max(0.05, std::atof(s)) : 1.0;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// ---- ceilings --------------------------------------------------------------------------------

struct Ceilings {
  double read_gbs = 0;        // all threads
  double read_gbs_1t = 0;     // one thread
  double fma_gflops = 0;      // f32 FMA, widest vectors the machine has
  double bf16dot_gflops = 0;  // vdpbf16ps zmm (0 when absent)
};
Ceilings g_ceil;

#if defined(__x86_64__)
#define FP8MOE_AVX512 __attribute__((target("avx512f,avx512bw")))
#define FP8MOE_AVX2 __attribute__((target("avx2,fma")))
#define FP8MOE_BF16 __attribute__((target("avx512f,avx512bw,avx512bf16")))

FP8MOE_AVX512 uint64_t read_avx512(const uint8_t* p, std::size_t n) {
  __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
  for (std::size_t i = 0; i < n; i += 256) {
    a0 = _mm512_xor_si512(a0, _mm512_load_si512(p + i));
    a1 = _mm512_xor_si512(a1, _mm512_load_si512(p + i + 64));
    a2 = _mm512_xor_si512(a2, _mm512_load_si512(p + i + 128));
    a3 = _mm512_xor_si512(a3, _mm512_load_si512(p + i + 192));
  }
  a0 = _mm512_xor_si512(_mm512_xor_si512(a0, a1), _mm512_xor_si512(a2, a3));
  return static_cast<uint64_t>(_mm512_reduce_add_epi64(a0));
}
FP8MOE_AVX2 uint64_t read_avx2(const uint8_t* p, std::size_t n) {
  __m256i a0 = _mm256_setzero_si256(), a1 = a0;
  for (std::size_t i = 0; i < n; i += 64) {
    a0 = _mm256_xor_si256(a0, _mm256_load_si256(reinterpret_cast<const __m256i*>(p + i)));
    a1 = _mm256_xor_si256(a1, _mm256_load_si256(reinterpret_cast<const __m256i*>(p + i + 32)));
  }
  a0 = _mm256_xor_si256(a0, a1);
  return static_cast<uint64_t>(_mm256_extract_epi64(a0, 0) ^ _mm256_extract_epi64(a0, 3));
}

// 12 independent accumulators: enough to cover the FMA latency on current cores.
FP8MOE_AVX512 float fma_avx512(int64_t iters) {
  __m512 acc[12];
  __m512 x = _mm512_set1_ps(1.0000001f), y = _mm512_set1_ps(0.9999999f);
  for (auto& a : acc) a = _mm512_setzero_ps();
  for (int64_t i = 0; i < iters; ++i) {
    for (auto& a : acc) a = _mm512_fmadd_ps(x, y, a);
    asm volatile("" : "+v"(x));
  }
  __m512 s = acc[0];
  for (int i = 1; i < 12; ++i) s = _mm512_add_ps(s, acc[i]);
  return _mm512_reduce_add_ps(s);
}
FP8MOE_AVX2 float fma_avx2(int64_t iters) {
  __m256 acc[12];
  __m256 x = _mm256_set1_ps(1.0000001f), y = _mm256_set1_ps(0.9999999f);
  for (auto& a : acc) a = _mm256_setzero_ps();
  for (int64_t i = 0; i < iters; ++i) {
    for (auto& a : acc) a = _mm256_fmadd_ps(x, y, a);
    asm volatile("" : "+v"(x));
  }
  __m256 s = acc[0];
  for (int i = 1; i < 12; ++i) s = _mm256_add_ps(s, acc[i]);
  float o[8];
  _mm256_storeu_ps(o, s);
  return o[0];
}
FP8MOE_BF16 float bf16dot(int64_t iters) {
  __m512 acc[12];
  __m512i x = _mm512_set1_epi32(0x3F803F80), y = x;
  for (auto& a : acc) a = _mm512_setzero_ps();
  for (int64_t i = 0; i < iters; ++i) {
    for (auto& a : acc) {
      a = _mm512_dpbf16_ps(a, reinterpret_cast<__m512bh>(x), reinterpret_cast<__m512bh>(y));
    }
    asm volatile("" : "+v"(x));
  }
  __m512 s = acc[0];
  for (int i = 1; i < 12; ++i) s = _mm512_add_ps(s, acc[i]);
  return _mm512_reduce_add_ps(s);
}
bool has_avx512() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
}
bool has_bf16() { return has_avx512() && __builtin_cpu_supports("avx512bf16"); }
#endif

volatile uint64_t g_sink = 0;
volatile float g_fsink = 0;

// Reads a 512 MiB buffer with `threads` threads (each its own contiguous part); GB/s.
void BM_ReadBandwidth(benchmark::State& state) {
  const int threads = static_cast<int>(state.range(0));
  const std::size_t n = std::size_t{512} << 20;
  std::unique_ptr<uint8_t, decltype(&std::free)> buf(
      static_cast<uint8_t*>(std::aligned_alloc(4096, n)), &std::free);
#pragma omp parallel for num_threads(threads)
  for (std::size_t i = 0; i < n; i += 4096)
    std::memset(buf.get() + i, static_cast<int>(i >> 12), 4096);
  std::vector<double> gbs;
  for (auto _ : state) {
    const auto t0 = Clock::now();
    uint64_t acc = 0;
#pragma omp parallel num_threads(threads) reduction(^ : acc)
    {
      const std::size_t chunk = n / omp_get_num_threads();
      const uint8_t* p = buf.get() + chunk * omp_get_thread_num();
      acc ^= has_avx512() ? read_avx512(p, chunk) : read_avx2(p, chunk);
    }
    const double dt = std::chrono::duration<double>(Clock::now() - t0).count();
    g_sink = g_sink ^ acc;
    state.SetIterationTime(dt);
    gbs.push_back(n / dt / 1e9);
  }
  const double m = median(gbs);
  state.counters["GB/s"] = m;
  if (threads == 1) {
    g_ceil.read_gbs_1t = m;
  } else {
    g_ceil.read_gbs = m;
  }
}

void BM_PeakFma(benchmark::State& state) {
  const int threads = omp_get_max_threads();
  const int64_t iters = 20'000'000;
  const bool z = has_avx512();
  std::vector<double> gf;
  for (auto _ : state) {
    const auto t0 = Clock::now();
#pragma omp parallel num_threads(threads)
    g_fsink = z ? fma_avx512(iters) : fma_avx2(iters);
    const double dt = std::chrono::duration<double>(Clock::now() - t0).count();
    state.SetIterationTime(dt);
    gf.push_back(threads * iters * 12.0 * (z ? 32 : 16) / dt / 1e9);
  }
  g_ceil.fma_gflops = median(gf);
  state.counters["GFLOP/s"] = g_ceil.fma_gflops;
  state.SetLabel(z ? "zmm f32 FMA" : "ymm f32 FMA");
}

void BM_PeakBf16Dot(benchmark::State& state) {
  if (!has_bf16()) {
    state.SkipWithError("no AVX512_BF16");
    for (auto _ : state) {
    }
    return;
  }
  const int threads = omp_get_max_threads();
  const int64_t iters = 20'000'000;
  std::vector<double> gf;
  for (auto _ : state) {
    const auto t0 = Clock::now();
#pragma omp parallel num_threads(threads)
    g_fsink = bf16dot(iters);
    const double dt = std::chrono::duration<double>(Clock::now() - t0).count();
    state.SetIterationTime(dt);
    gf.push_back(threads * iters * 12.0 * 64 / dt / 1e9);
  }
  g_ceil.bf16dot_gflops = median(gf);
  state.counters["GFLOP/s"] = g_ceil.bf16dot_gflops;
  state.SetLabel("zmm vdpbf16ps");
}

// ---- the MoE layer ----------------------------------------------------------------------------

struct Shape {
  const char* name;
  int64_t E_real, E, H, I, topk;
};
// models.md shapes; E reduced where the real expert count does not fit this machine's memory.
const Shape kShapes[] = {
    {"DeepSeek-V3", 256, 32, 7168, 2048, 8},
    {"Qwen3-30B-A3B", 128, 128, 2048, 768, 8},
    {"Mixtral-8x7B", 8, 8, 4096, 14336, 2},
    {"Qwen3-Next-80B", 512, 128, 2048, 512, 10},
};
const int64_t kMs[] = {1, 4, 16, 64, 256, 1024};

// One shape's weights (block 128x128 scales), generated once and shared by both kernels.
struct Layer {
  const Shape* shape = nullptr;
  Tensor w13, w2, s13, s2;
};
std::unique_ptr<Layer> g_layer;

const Layer& layer_for(const Shape& s) {
  if (g_layer && g_layer->shape == &s) return *g_layer;
  g_layer.reset();  // free the previous shape first
  auto L = std::make_unique<Layer>();
  L->shape = &s;
  const int64_t N1 = 2 * s.I;
  L->w13 = Tensor::empty({s.E, N1, s.H}, DType::kF8E4M3FN);
  L->w2 = Tensor::empty({s.E, s.H, s.I}, DType::kF8E4M3FN);
  L->s13 = Tensor::empty({s.E, N1 / 128, s.H / 128}, DType::kF32);
  L->s2 = Tensor::empty({s.E, s.H / 128, s.I / 128}, DType::kF32);
  // Codes of randn-like magnitude (never NaN), scales ~1e-3.
  const auto fill_codes = [](const Tensor& t, uint64_t seed) {
    uint8_t* p = t.ptr<uint8_t>();
    const int64_t n = t.numel();
#pragma omp parallel
    {
      std::mt19937_64 rng(seed + 7919 * omp_get_thread_num());
#pragma omp for schedule(static)
      for (int64_t i = 0; i < n; i += 8) {
        uint64_t r = rng();
        for (int64_t j = 0; j < 8 && i + j < n; ++j, r >>= 8) {
          const uint8_t c = static_cast<uint8_t>(r);
          p[i + j] = static_cast<uint8_t>((c & 0x80) | (0x20 + (c & 0x3F)));  // |v| in [2^-3, 2^5)
        }
      }
    }
  };
  fill_codes(L->w13, 1);
  fill_codes(L->w2, 2);
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> u(0.5e-3f, 2e-3f);
  for (int64_t i = 0; i < L->s13.numel(); ++i) L->s13.ptr<float>()[i] = u(rng);
  for (int64_t i = 0; i < L->s2.numel(); ++i) L->s2.ptr<float>()[i] = u(rng);
  g_layer = std::move(L);
  return *g_layer;
}

struct Problem {
  Tensor x, ids, wts, out;
  int64_t touched = 0;  // distinct experts hit
};

Problem make_problem(const Shape& s, int64_t M, uint64_t seed) {
  Problem p;
  p.x = Tensor::empty({M, s.H}, DType::kBF16);
  p.out = Tensor::empty({M, s.H}, DType::kBF16);
  p.ids = Tensor::empty({M, s.topk}, DType::kI32);
  p.wts = Tensor::empty({M, s.topk}, DType::kF32);
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.0f, 0.1f);
  for (int64_t i = 0; i < M * s.H; ++i) p.x.ptr<uint16_t>()[i] = numerics::float_to_bf16(nd(rng));
  std::vector<char> hit(s.E, 0);
  std::vector<int32_t> perm(s.E);
  for (int64_t t = 0; t < M; ++t) {
    std::iota(perm.begin(), perm.end(), 0);
    for (int64_t j = 0; j < s.topk; ++j) {  // uniform distinct experts
      std::uniform_int_distribution<int64_t> pick(j, s.E - 1);
      std::swap(perm[j], perm[pick(rng)]);
      p.ids.ptr<int32_t>()[t * s.topk + j] = perm[j];
      p.wts.ptr<float>()[t * s.topk + j] = 1.0f / s.topk;
      hit[perm[j]] = 1;
    }
  }
  p.touched = std::count(hit.begin(), hit.end(), 1);
  return p;
}

FusedMoeArgs args_for(const Layer& L, const Problem& p, bool w8a8) {
  FusedMoeArgs a;
  a.x = p.x;
  a.topk_ids = p.ids;
  a.topk_weights = p.wts;
  a.weights.w13 = L.w13;
  a.weights.w2 = L.w2;
  a.weights.w13_scale = L.s13;
  a.weights.w2_scale = L.s2;
  a.scheme.weight = WeightScaleKind::kBlock;
  a.scheme.block_n = a.scheme.block_k = 128;
  a.scheme.act = w8a8 ? ActQuantKind::kPerGroupDynamic : ActQuantKind::kNone;
  a.scheme.group_k = 128;
  a.act.activation = MoeActivation::kSilu;
  a.out = p.out;
  return a;
}

struct Result {
  std::string shape, kernel, isa;
  int64_t M = 0, E = 0, touched = 0;
  double seconds = 0, bytes = 0, flops = 0;
  double probe_read_gbs = 0, probe_peak_gflops = 0;  // medians of the interleaved probes
  double bw_ratio = 0, peak_ratio = 0;               // medians of the per-call ratios
};

// Short ceiling probes interleaved with the timed calls, so that every ratio compares numbers
// taken under the same load (the machine is shared): before each call, one read of a 128 MiB
// buffer with all threads (which also evicts the weights from the caches, so every call streams
// them from memory) and ~3 ms of the peak loop of the level in use (BF16 dot or f32 FMA).
struct Probe {
  std::unique_ptr<uint8_t, decltype(&std::free)> buf{nullptr, &std::free};
  std::size_t n = std::size_t{128} << 20;
};
Probe g_probe;

double probe_read_gbs() {
  if (!g_probe.buf) {
    g_probe.buf.reset(static_cast<uint8_t*>(std::aligned_alloc(4096, g_probe.n)));
#pragma omp parallel for
    for (std::size_t i = 0; i < g_probe.n; i += 4096) {
      std::memset(g_probe.buf.get() + i, static_cast<int>(i >> 12), 4096);
    }
  }
  double best = 0;
  for (int rep = 0; rep < 1; ++rep) {
    const auto t0 = Clock::now();
    uint64_t acc = 0;
#pragma omp parallel reduction(^ : acc)
    {
      const std::size_t chunk = g_probe.n / omp_get_num_threads();
      const uint8_t* p = g_probe.buf.get() + chunk * omp_get_thread_num();
      acc ^= has_avx512() ? read_avx512(p, chunk) : read_avx2(p, chunk);
    }
    const double dt = std::chrono::duration<double>(Clock::now() - t0).count();
    g_sink = g_sink ^ acc;
    best = std::max(best, g_probe.n / dt / 1e9);
  }
  return best;
}

double probe_peak_gflops(bool bf16) {
  const int threads = omp_get_max_threads();
  const int64_t iters = 1'000'000;
  double best = 0;
  for (int rep = 0; rep < 1; ++rep) {
    const auto t0 = Clock::now();
    if (bf16) {
#pragma omp parallel num_threads(threads)
      g_fsink = bf16dot(iters);
    } else {
#pragma omp parallel num_threads(threads)
      g_fsink = has_avx512() ? fma_avx512(iters) : fma_avx2(iters);
    }
    const double dt = std::chrono::duration<double>(Clock::now() - t0).count();
    const double per = bf16 ? 64 : (has_avx512() ? 32 : 16);
    best = std::max(best, threads * iters * 12.0 * per / dt / 1e9);
  }
  return best;
}
std::vector<Result> g_results;
std::map<std::string, double> g_ref_seconds;  // "shape/M" -> reference time

void run_layer(benchmark::State& state, const Shape& s, int64_t M, bool w8a8,
               std::optional<cpu::Isa> isa) {
  if (isa && !cpu::isa_supported(*isa)) {
    state.SkipWithError("level not available here");
    for (auto _ : state) {
    }
    return;
  }
  std::optional<cpu::ScopedIsa> forced;
  if (isa) forced.emplace(*isa);
  const Layer& L = layer_for(s);
  Problem p = make_problem(s, M, 1000 + M);
  const FusedMoeArgs a = args_for(L, p, w8a8);
  const ExpertsImpl& impl = w8a8 ? cpu::cpu_w8a8_experts_impl() : cpu::cpu_w8a16_experts_impl();
  std::unique_ptr<uint8_t, decltype(&std::free)> ws(
      static_cast<uint8_t*>(std::aligned_alloc(64, impl.workspace_size(a) / 64 * 64 + 64)),
      &std::free);
  impl.run(a, ws.get());  // warm-up (page faults of the workspace)
  const bool bf16_level = cpu::active_isa() == cpu::Isa::kAvx512Bf16;
  const int64_t N1 = 2 * s.I;
  const double bytes = static_cast<double>(p.touched) * (N1 * s.H + s.H * s.I);
  const double flops = 2.0 * M * s.topk * (N1 * s.H + s.H * s.I);
  std::vector<double> times, bws, peaks, bw_ratio, peak_ratio;
  for (auto _ : state) {
    const double bw = probe_read_gbs();
    const double peak = probe_peak_gflops(bf16_level);
    const auto t0 = Clock::now();
    impl.run(a, ws.get());
    const double dt = std::chrono::duration<double>(Clock::now() - t0).count();
    state.SetIterationTime(dt);
    times.push_back(dt);
    bws.push_back(bw);
    peaks.push_back(peak);
    bw_ratio.push_back(bytes / dt / 1e9 / bw);
    peak_ratio.push_back(flops / dt / 1e9 / peak);
  }
  const double t = median(times);
  const double probe_bw = median(bws), probe_peak = median(peaks);
  state.counters["ms"] = t * 1e3;
  state.counters["GB/s"] = bytes / t / 1e9;
  state.counters["GFLOP/s"] = flops / t / 1e9;
  state.counters["%BW"] = 100 * median(bw_ratio);
  state.counters["%peak"] = 100 * median(peak_ratio);
  state.SetLabel(fmt::format("{} experts touched", p.touched));
  g_results.push_back({s.name, impl.name, std::string(cpu::isa_name(cpu::active_isa())), M, s.E,
                       p.touched, t, bytes, flops, probe_bw, probe_peak, median(bw_ratio),
                       median(peak_ratio)});
}

// The float64 reference on the same problem (small M only: it dequantises every touched expert
// to float64).
void run_reference(benchmark::State& state, const Shape& s, int64_t M) {
  const Layer& L = layer_for(s);
  Problem p = make_problem(s, M, 1000 + M);
  const FusedMoeArgs a = args_for(L, p, /*w8a8=*/false);
  std::vector<double> times;
  for (auto _ : state) {
    const auto t0 = Clock::now();
    ref::fused_moe(a);
    const double dt = std::chrono::duration<double>(Clock::now() - t0).count();
    state.SetIterationTime(dt);
    times.push_back(dt);
  }
  g_ref_seconds[fmt::format("{}/{}", s.name, M)] = median(times);
  state.counters["ms"] = median(times) * 1e3;
}

int64_t iterations_for(const Shape& s, int64_t M) {
  // Estimated time per call from rough rates (30 GB/s, 150 GFLOP/s); aims at FP8MOE_BENCH_SECONDS.
  const double touched = std::min<double>(s.E, M * s.topk);
  const double bytes = touched * 3 * s.H * s.I;
  const double flops = 6.0 * M * s.topk * s.H * s.I;
  const double est = std::max(bytes / 30e9, flops / 150e9);
  return std::clamp<int64_t>(static_cast<int64_t>(seconds_per_case() / est), 3, 500);
}

void register_all() {
  benchmark::RegisterBenchmark("Ceiling/ReadBandwidth/threads:1", BM_ReadBandwidth)
      ->Arg(1)
      ->UseManualTime()
      ->Iterations(5)
      ->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("Ceiling/ReadBandwidth/threads:all", BM_ReadBandwidth)
      ->Arg(omp_get_max_threads())
      ->UseManualTime()
      ->Iterations(7)
      ->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("Ceiling/PeakFma", BM_PeakFma)
      ->UseManualTime()
      ->Iterations(5)
      ->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("Ceiling/PeakBf16Dot", BM_PeakBf16Dot)
      ->UseManualTime()
      ->Iterations(5)
      ->Unit(benchmark::kMillisecond);
  for (const Shape& s : kShapes) {
    for (int64_t M : kMs) {
      for (bool w8a8 : {false, true}) {
        benchmark::RegisterBenchmark(
            fmt::format("{}/{}/M:{}", s.name, w8a8 ? "cpu_w8a8" : "cpu_w8a16", M).c_str(),
            [&s, M, w8a8](benchmark::State& st) { run_layer(st, s, M, w8a8, std::nullopt); })
            ->UseManualTime()
            ->Iterations(iterations_for(s, M))
            ->Unit(benchmark::kMillisecond);
      }
    }
    if (std::string(s.name) == "Qwen3-30B-A3B") {
      // The reference on small M, for the speed-up column.
      for (int64_t M : {1, 4}) {
        benchmark::RegisterBenchmark(fmt::format("{}/ref/M:{}", s.name, M).c_str(),
                                     [&s, M](benchmark::State& st) { run_reference(st, s, M); })
            ->UseManualTime()
            ->Iterations(1)
            ->Unit(benchmark::kMillisecond);
      }
      // The portable levels on the same shape.
      for (cpu::Isa isa : {cpu::Isa::kAvx512, cpu::Isa::kAvx2}) {
        for (int64_t M : {1, 256}) {
          benchmark::RegisterBenchmark(
              fmt::format("{}/cpu_w8a16@{}/M:{}", s.name, cpu::isa_name(isa), M).c_str(),
              [&s, M, isa](benchmark::State& st) { run_layer(st, s, M, false, isa); })
              ->UseManualTime()
              ->Iterations(std::max<int64_t>(3, iterations_for(s, M) / 4))
              ->Unit(benchmark::kMillisecond);
        }
      }
    }
  }
}

void print_table() {
  const Ceilings& c = g_ceil;
  fmt::print("\n## Summary (medians; {} threads)\n\n", omp_get_max_threads());
  fmt::print(
      "Ceilings at the start of the run: read {:.1f} GB/s ({:.1f} GB/s one thread), f32 FMA {:.0f} "
      "GFLOP/s, BF16 dot {:.0f} GFLOP/s. Each call is preceded by a read-bandwidth probe (which "
      "also "
      "evicts the caches) and a peak-loop probe of the level in use; the % columns are medians of "
      "the per-call ratios, the probe columns the medians of the probes.\n\n",
      c.read_gbs, c.read_gbs_1t, c.fma_gflops, c.bf16dot_gflops);
  fmt::print(
      "| shape (E used/real, H, I, topk) | kernel | level | M | experts touched | ms/layer | GB/s "
      "| "
      "% read BW | GFLOP/s | % peak | vs ref | probe BW | probe peak |\n");
  fmt::print("|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  for (const Result& r : g_results) {
    const Shape* s = nullptr;
    for (const Shape& k : kShapes) {
      if (r.shape == k.name) s = &k;
    }
    const double gbs = r.bytes / r.seconds / 1e9;
    const double gf = r.flops / r.seconds / 1e9;
    std::string vs = "";
    const auto it = g_ref_seconds.find(fmt::format("{}/{}", r.shape, r.M));
    if (it != g_ref_seconds.end()) vs = fmt::format("{:.0f}x", it->second / r.seconds);
    fmt::print(
        "| {} ({}/{}, {}, {}, {}) | {} | {} | {} | {} | {:.3f} | {:.1f} | {:.0f}% | {:.1f} | "
        "{:.0f}% "
        "| {} | {:.1f} | {:.0f} |\n",
        r.shape, r.E, s ? s->E_real : 0, s ? s->H : 0, s ? s->I : 0, s ? s->topk : 0, r.kernel,
        r.isa, r.M, r.touched, r.seconds * 1e3, gbs, 100 * r.bw_ratio, gf, 100 * r.peak_ratio, vs,
        r.probe_read_gbs, r.probe_peak_gflops);
  }
}

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  register_all();
  benchmark::RunSpecifiedBenchmarks();
  print_table();
  benchmark::Shutdown();
  return 0;
}
