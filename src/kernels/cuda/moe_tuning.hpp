// Tuned configurations of the CUDA fused MoE (the role of vLLM's E=..,N=..,device_name=...json
// files): a JSON table, written by `bench_cuda_moe --tune`, that maps (device name, E, N = I,
// K = hidden, top-k, scheme string, M bucket) to an execution path and its parameters. The library
// reads the file named by FP8MOE_CUDA_TUNING (docs/ENV.md) once; without a matching entry the
// heuristic decides.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace fp8moe::cuda {

struct TunedConfig {
  std::string path;  // "generic", "wgmma", "stream", "grouped", "single"
  // "grouped" only: 128-row n-blocks per tile of the swapped grouped kernels (1, 2 or 4;
  // GroupedGemmParams::swap_nb, applied where K and N allow it); 0 = the kernels' rule.
  int swap_nb = 0;
};

struct TuningKey {
  std::string device;
  int64_t E = 0, N = 0, K = 0;
  int64_t topk = 0;
  std::string scheme;
};

// The M buckets entries are stored for; a batch uses the nearest bucket (ties to the smaller).
const std::vector<int64_t>& tuning_m_buckets();
int64_t tuning_bucket(int64_t M);

// Looks up the table loaded from FP8MOE_CUDA_TUNING (nullopt: no file, no entry).
std::optional<TunedConfig> tuned_config(const TuningKey& key, int64_t M);

// Table I/O (the tuning command writes, the library reads). Throws FormatError on a bad file
// (naming the file, the entry and what was expected): not JSON, another format, a missing key, an
// M bucket that is not one of tuning_m_buckets(), an unknown path, a swap_nb other than 1 / 2 / 4
// or on a path other than "grouped".
struct TuningEntry {
  TuningKey key;
  std::vector<std::pair<int64_t, TunedConfig>> by_bucket;
};
std::vector<TuningEntry> read_tuning_file(const std::string& file);
void write_tuning_file(const std::string& file, const std::vector<TuningEntry>& entries);
// Replaces the loaded table (tests, the tuning command); an empty vector disables it.
void set_tuning_table(std::vector<TuningEntry> entries);

}  // namespace fp8moe::cuda
