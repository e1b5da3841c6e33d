// The tuning table of the CUDA fused MoE: JSON I/O and lookup.
#include "moe_tuning.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cstdlib>
#include <fstream>
#include <mutex>
#include <nlohmann/json.hpp>

#include "fp8moe/error.hpp"
#include "fp8moe/log.hpp"

namespace fp8moe::cuda {

namespace {

constexpr const char* kFormat = "fp8moe-cuda-tuning-1";

std::mutex g_mu;
bool g_loaded = false;
std::vector<TuningEntry> g_table;

void load_once() {
  if (g_loaded) return;
  g_loaded = true;
  const char* f = std::getenv("FP8MOE_CUDA_TUNING");
  if (!f || !*f) return;
  try {
    g_table = read_tuning_file(f);
    info_once(fmt::format("cuda_fused: {} tuned shapes from {}", g_table.size(), f));
  } catch (const Error& e) {
    warning_once(fmt::format("cuda_fused: ignoring tuning file {}: {}", f, e.what()));
  }
}

}  // namespace

const std::vector<int64_t>& tuning_m_buckets() {
  static const std::vector<int64_t> b = {1,  2,   4,   8,   16,   24,   32,   48,  64,
                                         96, 128, 256, 512, 1024, 2048, 4096, 8192};
  return b;
}

int64_t tuning_bucket(int64_t M) {
  const auto& b = tuning_m_buckets();
  int64_t best = b.front();
  for (int64_t v : b) {
    if (std::llabs(v - M) < std::llabs(best - M)) best = v;
  }
  return best;
}

std::optional<TunedConfig> tuned_config(const TuningKey& key, int64_t M) {
  std::lock_guard<std::mutex> lock(g_mu);
  load_once();
  const int64_t bucket = tuning_bucket(M);
  for (const TuningEntry& e : g_table) {
    const TuningKey& k = e.key;
    if (k.device != key.device || k.E != key.E || k.N != key.N || k.K != key.K ||
        k.topk != key.topk || k.scheme != key.scheme)
      continue;
    for (const auto& [b, cfg] : e.by_bucket)
      if (b == bucket) return cfg;
  }
  return std::nullopt;
}

void set_tuning_table(std::vector<TuningEntry> entries) {
  std::lock_guard<std::mutex> lock(g_mu);
  g_loaded = true;
  g_table = std::move(entries);
}

std::vector<TuningEntry> read_tuning_file(const std::string& file) {
  std::ifstream in(file);
  if (!in) throw FormatError(fmt::format("cannot open tuning file {}", file));
  nlohmann::json j;
  try {
    in >> j;
  } catch (const std::exception& e) {
    throw FormatError(fmt::format("tuning file {}: not JSON ({})", file, e.what()));
  }
  if (!j.is_object() || j.value("format", "") != kFormat || !j.contains("entries"))
    throw FormatError(fmt::format(
        "tuning file {}: expected {{\"format\": \"{}\", \"entries\": [...]}}", file, kFormat));
  std::vector<TuningEntry> out;
  size_t index = 0;
  try {
    for (const auto& je : j.at("entries")) {
      TuningEntry e;
      e.key.device = je.at("device").get<std::string>();
      e.key.E = je.at("E").get<int64_t>();
      e.key.N = je.at("N").get<int64_t>();
      e.key.K = je.at("K").get<int64_t>();
      e.key.topk = je.at("topk").get<int64_t>();
      e.key.scheme = je.at("scheme").get<std::string>();
      for (const auto& [m, jc] : je.at("configs").items()) {
        const auto& buckets = tuning_m_buckets();
        int64_t bucket = -1;
        for (int64_t b : buckets)
          if (m == std::to_string(b)) bucket = b;
        if (bucket < 0)
          throw FormatError(fmt::format("M bucket '{}' is not one of {}", m,
                                        fmt::join(buckets.begin(), buckets.end(), ", ")));
        TunedConfig c;
        c.path = jc.at("path").get<std::string>();
        if (c.path == "decode")  // the persistent decode path is gone (slower than stream)
          throw FormatError(
              "path 'decode' was removed; re-run bench_cuda_moe --tune to rewrite the table");
        if (c.path != "generic" && c.path != "wgmma" && c.path != "stream" && c.path != "grouped" &&
            c.path != "single")
          throw FormatError(
              fmt::format("M bucket {}: unknown path '{}' (expected generic, "
                          "wgmma, stream, grouped or single)",
                          m, c.path));
        if (jc.contains("swap_nb")) {
          c.swap_nb = jc.at("swap_nb").get<int>();
          if (c.path != "grouped")
            throw FormatError(fmt::format(
                "M bucket {}: swap_nb belongs to the grouped path, not '{}'", m, c.path));
          if (c.swap_nb != 1 && c.swap_nb != 2 && c.swap_nb != 4)
            throw FormatError(
                fmt::format("M bucket {}: swap_nb {} is not 1, 2 or 4", m, c.swap_nb));
        }
        e.by_bucket.emplace_back(bucket, c);
      }
      out.push_back(std::move(e));
      ++index;
    }
  } catch (const FormatError& e) {
    throw FormatError(fmt::format("tuning file {}, entry {}: {}", file, index, e.what()));
  } catch (const std::exception& e) {
    throw FormatError(fmt::format("tuning file {}, entry {}: {}", file, index, e.what()));
  }
  return out;
}

void write_tuning_file(const std::string& file, const std::vector<TuningEntry>& entries) {
  nlohmann::json j;
  j["format"] = kFormat;
  j["entries"] = nlohmann::json::array();
  for (const TuningEntry& e : entries) {
    nlohmann::json je;
    je["device"] = e.key.device;
    je["E"] = e.key.E;
    je["N"] = e.key.N;
    je["K"] = e.key.K;
    je["topk"] = e.key.topk;
    je["scheme"] = e.key.scheme;
    nlohmann::json jc = nlohmann::json::object();
    for (const auto& [b, c] : e.by_bucket) {
      nlohmann::json x;
      x["path"] = c.path;
      if (c.swap_nb != 0) x["swap_nb"] = c.swap_nb;
      jc[std::to_string(b)] = x;
    }
    je["configs"] = jc;
    j["entries"].push_back(je);
  }
  std::ofstream out(file);
  if (!out) throw FormatError(fmt::format("cannot write tuning file {}", file));
  out << j.dump(1) << "\n";
}

}  // namespace fp8moe::cuda
