// What `fp8moe bench` measures with: the model presets of spec/models.md (random weights at the
// real per-rank shapes), the traffic model behind "unique expert bytes touched" and FLOPs, the
// machine ceilings measured in the same run, and the timing loop.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "fp8moe/checkpoint.hpp"
#include "fp8moe/layer.hpp"

namespace fp8moe::bench {

// ---- presets ------------------------------------------------------------------------------------

struct BenchPreset {
  std::string name;         // "deepseek-v3-tp8"
  std::string description;  // "DeepSeek-V3/R1, TP 8: E 256, K 7168, N 256, top-8, block FP8"
  std::string config_json;  // a config.json with the MoE fields and the quantization_config
  int tp_size = 1;
  bool enable_ep = false;  // the tp_size ranks are EP ranks (rank 0's local experts are timed)
};
// The models of spec/models.md at their common deployments.
const std::vector<BenchPreset>& bench_presets();
// By name; ValueError listing the names otherwise.
const BenchPreset& find_bench_preset(std::string_view name);
ModelConfig preset_model(const BenchPreset& p);

// One rank of a layer with random weights at the planned shapes (fp8 codes drawn without NaN,
// scales 0.03, so values look like real weights; contents do not matter for timing). The expert
// count is scaled down (to a multiple of the routing groups and >= top-k) when one rank's expert
// weights would exceed max_weight_bytes; `scaled_from` then holds the real count.
struct RandomLayer {
  ModelConfig model;  // with num_experts possibly scaled down
  Fp8MoeLayerSpec spec;
  Fp8MoeWeights weights;
  int scaled_from = 0;
  uint64_t weight_bytes = 0;  // fp8 weights of the rank
};
RandomLayer make_random_layer(ModelConfig model, const CheckpointLayerRequest& req,
                              const Fp8MoeLayerOptions& options, uint64_t seed,
                              uint64_t max_weight_bytes);

// ---- traffic ------------------------------------------------------------------------------------

// spec/models.md's model for one layer call under uniform random routing:
//   distinct experts (this rank) = E_local * (1 - (1 - k/E)^M); each touched expert's fp8 w13+w2
//   (3 * N * K bytes, gated) read once; activations 4 * M * K (bf16 x in, bf16 out) plus
//   6 bytes per routed (token, slot, n) for the intermediates (2N bf16 GEMM1 outputs, N bf16
//   activation outputs), routed slots = M * k * E_local / E; FLOPs = 6 * M * k * N * K * E_local/E.
// It reproduces the H200 roofline floors of models.md (max(bytes / 4.8e12, flops / 1.979e15)).
struct Traffic {
  double distinct_experts = 0;
  double weight_bytes = 0;
  double activation_bytes = 0;
  double bytes = 0;
  double flops = 0;
};
Traffic moe_traffic(int64_t M, int64_t E, int64_t E_local, int64_t topk, int64_t N, int64_t K,
                    bool gated = true);
// max(bytes / bandwidth, flops / peak) in seconds.
double roofline_seconds(const Traffic& t, double bytes_per_s, double flops_per_s);

// ---- ceilings -----------------------------------------------------------------------------------

struct Ceilings {
  bool measured = false;
  double read_bytes_per_s = 0;  // STREAM-like: every thread sums its part of a 128 MiB array
  double fma_flops_per_s = 0;   // f32 FMA chains in the widest SIMD target, every thread
  int threads = 0;
  std::string simd_target;  // Highway's target name ("AVX3_ZEN4", "AVX2", ...)
  std::string note;
};
// The CPU's ceilings, measured now (about 2 x `seconds`). OpenMP threads as the kernels use them.
Ceilings measure_cpu_ceilings(double seconds = 0.25);

// ---- timing -------------------------------------------------------------------------------------

struct Timing {
  int reps = 0;
  double median_s = 0, min_s = 0, max_s = 0;
};
// Runs layer.forward(x, logits, out) once to warm up, then until `min_seconds` have passed and at
// least `min_reps` runs were timed (at most `max_reps`); wall clock per call. The CPU kernels are
// synchronous; on a CUDA layer each call runs on the default stream and is followed by a 2-byte
// device-to-host copy of `out`, which waits for it.
Timing time_forward(const Fp8MoeLayer& layer, const TensorView& x, const TensorView& logits,
                    const TensorView& out, double min_seconds, int min_reps, int max_reps);

}  // namespace fp8moe::bench
