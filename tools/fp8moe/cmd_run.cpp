// fp8moe {run, bench}: the main job on the command line.
//
//   run MODEL_DIR    plan one MoE layer of a checkpoint for this machine, load one rank (or every
//                    rank with --rank all), run it on seeded random (or file) input, time it, and
//                    with --check compare against the float64 reference and the unquantised layer.
//   bench TARGET     time layers over a token sweep: a checkpoint or presets with random weights at
//                    the real shapes of spec/models.md; bytes/s, FLOP/s and their fraction of the
//                    ceilings measured in the same run, with the oracle's pick per row.
//
// Exit status: 0 done (and --check passed); 1 the answer is "no" (no implementation of the
// oracle's choice here, a failed plan, a failed check); 2 bad input (main() prints the error).
// Expert parallelism across processes (--ep) is wired by the parallel room; --enable-ep here runs
// one EP rank's local experts, as vLLM's --enable-expert-parallel makes the --tp ranks EP ranks.
#include <fmt/format.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <exception>
#include <fstream>
#include <optional>
#include <thread>

#include <cmath>
#include <cstring>
#include <iostream>
#include <memory>
#include <random>
#include <sstream>

#include "cli_common.hpp"
#include "fp8moe/checkpoint.hpp"
#include "fp8moe/error.hpp"
#include "fp8moe/layer.hpp"
#include "fp8moe/numerics.hpp"
#include "fp8moe/parallel.hpp"
#include "kernels/registry.hpp"
#include "layer/bench.hpp"

namespace fp8moe::cli {
namespace {

using nlohmann::ordered_json;

void print_ordered(const ordered_json& j) { std::cout << j.dump(2) << "\n"; }

std::vector<std::string> split_list(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) {
    const auto b = item.find_first_not_of(" \t"), e = item.find_last_not_of(" \t");
    if (b != std::string::npos) out.push_back(item.substr(b, e - b + 1));
  }
  return out;
}

int64_t parse_count(const std::string& s, const char* what, int64_t min_value) {
  std::size_t pos = 0;
  long long v = 0;
  try {
    v = std::stoll(s, &pos);
  } catch (const std::exception&) {
    pos = 0;
  }
  if (pos != s.size() || s.empty() || v < min_value) {
    throw ValueError(
        fmt::format("{} '{}' is not an integer >= {}", what, s, static_cast<long long>(min_value)));
  }
  return v;
}

std::string fmt_seconds(double s) {
  if (s >= 1) return fmt::format("{:.3f} s", s);
  if (s >= 1e-3) return fmt::format("{:.3f} ms", s * 1e3);
  return fmt::format("{:.1f} us", s * 1e6);
}

std::string fmt_rate(double v, const char* unit) {
  if (v >= 1e12) return fmt::format("{:.2f} T{}", v / 1e12, unit);
  if (v >= 1e9) return fmt::format("{:.2f} G{}", v / 1e9, unit);
  if (v >= 1e6) return fmt::format("{:.2f} M{}", v / 1e6, unit);
  return fmt::format("{:.0f} {}", v, unit);
}

OracleEnv make_env(const std::vector<std::string>& pairs, bool ignore_environment) {
  OracleEnv env = ignore_environment ? OracleEnv() : OracleEnv::from_environment();
  for (const auto& p : pairs) {
    const auto eq = p.find('=');
    if (eq == std::string::npos) {
      throw ValueError(fmt::format("--env '{}' is not NAME=VALUE", p));
    }
    env.set(p.substr(0, eq), p.substr(eq + 1));
  }
  return env;
}

// "cpu", "cuda", "cuda:N".
Device parse_device(const std::string& s) {
  if (s == "cpu") return Device::cpu();
  if (s == "cuda") return Device::cuda(0);
  if (s.rfind("cuda:", 0) == 0) {
    return Device::cuda(static_cast<int>(parse_count(s.substr(5), "--device cuda index", 0)));
  }
  throw ValueError(fmt::format("--device '{}': expected cpu, cuda or cuda:N", s));
}

DType parse_act_dtype(const std::string& s) {
  const DType d = parse_dtype(s);
  if (d != DType::kBF16 && d != DType::kF32) {
    throw ValueError(fmt::format("--dtype '{}': the layer takes bf16 or f32 activations", s));
  }
  return d;
}

// ---- inputs -----------------------------------------------------------------------------------

Tensor randn(int64_t rows, int64_t cols, DType dt, float scale, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> n(0.0f, 1.0f);
  Tensor t = Tensor::empty({rows, cols}, dt);
  for (int64_t i = 0; i < t.numel(); ++i) {
    const float v = n(rng) * scale;
    if (dt == DType::kBF16) {
      t.ptr<uint16_t>()[i] = numerics::float_to_bf16(v);
    } else {
      t.ptr<float>()[i] = v;
    }
  }
  return t;
}

float load(const TensorView& t, int64_t i) {
  switch (t.dtype) {
    case DType::kBF16:
      return numerics::bf16_to_float(t.ptr<const uint16_t>()[i]);
    case DType::kF32:
      return t.ptr<const float>()[i];
    case DType::kF16:
      return numerics::f16_to_float(t.ptr<const uint16_t>()[i]);
    default:
      throw ValueError(fmt::format("expected a bf16/f16/f32 tensor, got {}", t.describe()));
  }
}

// The router of a checkpoint's MoE layer: "<block>.gate.weight" (E, H), "<block>.router.weight"
// for Llama 4. Empty when the checkpoint has none fp8moe can read.
struct Router {
  std::string name;
  Tensor weight;
};
Router find_router(const std::string& dir, const ModelConfig& model, int layer) {
  Router r;
  SafetensorsCheckpoint ck;
  try {
    ck = SafetensorsCheckpoint::open(dir);
  } catch (const Error&) {
    return r;
  }
  std::string block = expert_module_name(model, layer, 0, ExpertProj::kGate);
  for (int i = 0; i < 3; ++i) block = block.substr(0, block.rfind('.'));
  for (const std::string& n : {block + ".gate.weight", block + ".router.weight"}) {
    const SafetensorsTensor* t = ck.find(n);
    if (!t || !t->dtype || t->shape != std::vector<int64_t>{model.num_experts, model.hidden_size})
      continue;
    if (*t->dtype != DType::kBF16 && *t->dtype != DType::kF32 && *t->dtype != DType::kF16) continue;
    r.name = n;
    r.weight = Tensor::empty({model.num_experts, model.hidden_size}, *t->dtype);
    const auto bytes = ck.data(n);
    std::memcpy(r.weight.data(), bytes.data(), r.weight.nbytes());
    return r;
  }
  return r;
}

// logits = x @ W^T in float64, stored as f32 (vLLM's router GEMM in bf16 differs slightly; the
// layer takes whatever logits it is given).
Tensor router_logits(const Tensor& x, const Tensor& w) {
  const int64_t M = x.size(0), H = x.size(1), E = w.size(0);
  Tensor out = Tensor::empty({M, E}, DType::kF32);
  std::vector<float> xr(static_cast<std::size_t>(H));
  for (int64_t t = 0; t < M; ++t) {
    for (int64_t k = 0; k < H; ++k) xr[k] = load(x, t * H + k);
    for (int64_t e = 0; e < E; ++e) {
      double s = 0;
      for (int64_t k = 0; k < H; ++k) s += static_cast<double>(xr[k]) * load(w, e * H + k);
      out.ptr<float>()[t * E + e] = static_cast<float>(s);
    }
  }
  return out;
}

struct Inputs {
  Tensor x, logits;
  std::string x_from, logits_from;
};

Inputs make_inputs(const std::string& dir, const ModelConfig& model, int layer, int64_t M, DType dt,
                   uint64_t seed, const std::string& input_file) {
  Inputs in;
  if (!input_file.empty()) {
    const SafetensorsFile f = SafetensorsFile::open(input_file);
    auto take = [&](const char* name, int64_t cols) -> Tensor {
      const SafetensorsTensor* t = f.find(name);
      if (!t) return {};
      if (!t->dtype || t->shape.size() != 2 || t->shape[1] != cols ||
          (*t->dtype != DType::kBF16 && *t->dtype != DType::kF32)) {
        throw FormatError(fmt::format("{}: '{}' is {} {}, expected (tokens, {}) bf16 or f32",
                                      input_file, name, t->dtype_name, t->shape_str(), cols));
      }
      Tensor v = Tensor::empty({t->shape[0], cols}, *t->dtype);
      const auto bytes = f.data(*t);
      std::memcpy(v.data(), bytes.data(), v.nbytes());
      return v;
    };
    in.x = take("x", model.hidden_size);
    if (!in.x.defined()) {
      throw FormatError(
          fmt::format("{}: no tensor 'x' (tokens, {})", input_file, model.hidden_size));
    }
    in.x_from = fmt::format("'x' from {}", input_file);
    in.logits = take("router_logits", model.num_experts);
    if (in.logits.defined()) {
      if (in.logits.size(0) != in.x.size(0)) {
        throw FormatError(fmt::format("{}: router_logits has {} rows, x has {}", input_file,
                                      in.logits.size(0), in.x.size(0)));
      }
      in.logits_from = fmt::format("'router_logits' from {}", input_file);
      return in;
    }
  } else {
    in.x = randn(M, model.hidden_size, dt, 0.1f, seed);
    in.x_from = fmt::format("randn/10 {} (seed {})", dtype_name(dt), seed);
  }
  const Router r = dir.empty() ? Router{} : find_router(dir, model, layer);
  if (r.weight.defined()) {
    in.logits = router_logits(in.x, r.weight);
    in.logits_from = fmt::format("x @ {}^T (f32)", r.name);
  } else {
    in.logits = randn(in.x.size(0), model.num_experts, DType::kF32, 1.0f, seed + 1);
    in.logits_from =
        fmt::format("randn f32 (seed {}; no router weight in the checkpoint)", seed + 1);
  }
  return in;
}

// ---- run --------------------------------------------------------------------------------------

struct RunOptions {
  std::string model;
  int layer = -1;
  int64_t tokens = 32;
  int tp = 1;
  std::string rank = "0";
  bool enable_ep = false;
  std::string moe_backend = "auto";
  std::string kernel;
  std::string dtype = "bf16";
  uint64_t seed = 0;
  std::string input, output;
  int reps = 5;
  int64_t max_tokens = 1024;
  bool check = false, plan_only = false, json = false, brief = false;
  std::string platform, installed, device;
  std::vector<std::string> env;
  bool ignore_environment = false;
  // --ep N: every EP rank (threads on the CPU, one process per GPU with --device cuda)
  int ep = 0;
  bool ep_given = false;
  std::string ep_format = "oracle";
  int ep_rank = -1;  // hidden: set by the GPU launcher for its children
  std::string ep_unique_id;
};

// One line of the plan for --brief.
std::string plan_brief(const Fp8MoeLayerPlan& p) {
  std::string blocks =
      p.block ? fmt::format("{} {}x{}", p.resolution, (*p.block)[0], (*p.block)[1]) : p.resolution;
  return fmt::format(
      "blocks {}; oracle {}{}; quant {} {}; kernel {}", blocks, backend_value(p.selection.backend),
      p.selection.kernel ? fmt::format(" / {}", p.selection.kernel->name) : "",
      p.quant_config_name.empty() ? "None" : p.quant_config_name, p.scheme.str(),
      p.runnable ? (p.kernel_request.empty()
                        ? p.implementation + " (the oracle's choice)"
                        : fmt::format("{} (--kernel {})", p.implementation, p.kernel_request))
                 : "none");
}

ordered_json comparison_json(const OutputComparison& c) {
  return {{"elements", c.count},
          {"bitwise_equal", c.bitwise_equal},
          {"bitwise_mismatches", c.bitwise_mismatches},
          {"max_abs_err", c.max_abs_err},
          {"max_rel_err", c.max_rel_err},
          {"mean_rel_abs_err", c.mean_rel_abs_err},
          {"atol", c.atol},
          {"rtol", c.rtol},
          {"over_tolerance", c.over_tolerance},
          {"allclose", c.allclose},
          {"nan_mismatches", c.nan_mismatches}};
}

std::string comparison_text(const OutputComparison& c) {
  std::string s = c.bitwise_equal ? fmt::format("bitwise equal ({} elements)", c.count)
                                  : fmt::format("{} of {} elements differ in bits",
                                                c.bitwise_mismatches, c.count);
  s += fmt::format("; max |err| {:.3g}; mean|err|/mean|ref| {:.3g}%; assert_close(atol=rtol={}) {}",
                   c.max_abs_err, 100 * c.mean_rel_abs_err, c.atol,
                   c.allclose ? "passes" : fmt::format("FAILS on {} elements", c.over_tolerance));
  return s;
}
// The reference check passes bitwise when the reference itself ran, else within vLLM's tolerance.
bool check_passes(const ForwardCheck& c) {
  return c.reference_is_kernel ? c.vs_reference.bitwise_equal : c.vs_reference.allclose;
}

void write_output(const std::string& path, const Inputs& in, const Tensor& out,
                  const Tensor& reference) {
  SafetensorsWriter w;
  w.add("x", in.x.view());
  w.add("router_logits", in.logits.view());
  w.add("out", out.view());
  if (reference.defined()) w.add("reference_out", reference.view());
  w.set_metadata("format", "fp8moe-run");
  w.write(path);
}

// --kernel / --backend items must name something fp8moe has (ValueError: exit status 2).
void check_kernel_name(const std::string& k) {
  if (k.empty() || k == "oracle" || k == "ref" || find_experts_impl(k)) return;
  std::string names = "oracle, ref";
  for (const ExpertsImpl* i : experts_impls()) {
    if (std::string_view(i->name) != "ref") names += fmt::format(", {}", i->name);
  }
  throw ValueError(fmt::format("unknown --kernel '{}': this build has {}", k, names));
}

// ---- run --ep: expert parallelism ---------------------------------------------------------------
//
// `run MODEL --ep N` runs every EP rank: on the CPU as N threads over the in-process communicator,
// on GPUs as N processes (this binary again, with the hidden --ep-rank R --ep-unique-id HEX) over
// NCCL. Each rank loads its own experts (CheckpointLayerRequest{tp_size = N, rank, enable_ep},
// vLLM's linear placement) and runs the same rank routine below; rank 0 gathers the outputs and
// the timings through the communicator and reports.

// Tokens [first, first + count) of rank r: a balanced contiguous split (the first M % N ranks take
// one more), as DP ranks each hold their own batch.
std::pair<int64_t, int64_t> ep_token_slice(int64_t M, int n, int r) {
  const int64_t base = M / n, extra = M % n;
  return {r * base + std::min<int64_t>(r, extra), base + (r < extra ? 1 : 0)};
}

Tensor copy_rows(const Tensor& t, int64_t first, int64_t count) {
  Tensor r = Tensor::empty({count, t.size(1)}, t.dtype());
  const std::size_t row = static_cast<std::size_t>(t.size(1)) * dtype_size(t.dtype());
  if (count) std::memcpy(r.data(), static_cast<const char*>(t.data()) + first * row, count * row);
  return r;
}

// Every rank throws when one failed: the failing rank its own error, the others a pointer to it.
void ep_agree(Communicator& comm, std::exception_ptr own) {
  const auto n = static_cast<std::size_t>(comm.size());
  std::vector<int64_t> send(n, own ? 1 : 0), recv(n);
  comm.all_to_all_counts(send, recv);
  if (own) std::rethrow_exception(own);
  for (std::size_t r = 0; r < n; ++r) {
    if (recv[r]) throw ValueError(fmt::format("EP rank {} failed (see its error)", r));
  }
}

// Rank 0 receives counts[r] elements from every rank r (counts known to every rank).
std::vector<char> ep_gather(Communicator& comm, const void* data, std::size_t elem_bytes,
                            const std::vector<int64_t>& counts) {
  const auto n = static_cast<std::size_t>(comm.size());
  std::vector<int64_t> send(n, 0), recv(n, 0);
  send[0] = counts[comm.rank()];
  int64_t total = 0;
  if (comm.rank() == 0) {
    recv = counts;
    for (int64_t c : counts) total += c;
  }
  std::vector<char> out(static_cast<std::size_t>(total) * elem_bytes);
  all_to_all_v_host(comm, data, send, out.data(), recv, elem_bytes);
  return out;
}

double median_of(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// One rank's timed EP forwards: a warm-up, then `reps` calls, each after a barrier.
struct EpRankTiming {
  std::vector<double> total, dispatch, compute, combine;
  EpMoeStats last;
};
EpRankTiming time_ep_forward(const Fp8MoeLayer& layer, Communicator& comm, const Tensor& x,
                             const Tensor& logits, const Tensor& out, int reps,
                             const EpForwardOptions& eo) {
  EpRankTiming t;
  forward_expert_parallel(layer, comm, x, logits, out, eo);
  for (int i = 0; i < reps; ++i) {
    comm.barrier();
    const auto t0 = std::chrono::steady_clock::now();
    t.last = forward_expert_parallel(layer, comm, x, logits, out, eo);
    t.total.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    t.dispatch.push_back(t.last.dispatch_s);
    t.compute.push_back(t.last.compute_s);
    t.combine.push_back(t.last.combine_s);
  }
  return t;
}

struct EpLaunch {
  int n = 1;
  bool gpu = false;
  std::optional<EpExpertsFormat> format;  // --ep-format (unset: the oracle's)
  std::string format_name;                // "standard" / "batched"
  std::string format_why;
};

// The rank routine, identical under threads and processes. Rank 0 prints.
void ep_rank_main(const RunOptions& o, const ModelConfig& model, int layer_index,
                  Fp8MoeLayerOptions opts, Communicator& comm, const EpLaunch& L) {
  const int n = comm.size(), me = comm.rank();
  const bool root = me == 0;
  const DType dt = parse_act_dtype(o.dtype);
  CheckpointLayerRequest req;
  req.layer = o.layer;
  req.tp_size = n;
  req.rank = me;
  req.enable_ep = true;  // with N = 1 vLLM's use_ep is false: the one rank holds every expert
  req.moe_backend = o.moe_backend;
  if (L.gpu) opts.device = Device::cuda(me);

  std::unique_ptr<Fp8MoeLayer> layer;
  Inputs in;
  std::exception_ptr failed;
  try {
    layer = std::make_unique<Fp8MoeLayer>(Fp8MoeLayer::from_checkpoint(o.model, req, opts));
    in = make_inputs(o.model, model, layer_index, o.tokens, dt, o.seed, o.input);
  } catch (...) {
    failed = std::current_exception();
  }
  ep_agree(comm, failed);
  const int64_t M = in.x.size(0), H = model.hidden_size;
  const auto [first, count] = ep_token_slice(M, n, me);
  const Tensor x = copy_rows(in.x, first, count), logits = copy_rows(in.logits, first, count);
  const Tensor out = Tensor::empty({count, H}, in.x.dtype());
  EpForwardOptions eo;
  eo.format = L.format;
  const EpRankTiming t = time_ep_forward(*layer, comm, x, logits, out, std::max(o.reps, 1), eo);

  // Rank 0 gathers the outputs and (rows sent, rows received, median total/dispatch/compute/
  // combine in ns).
  std::vector<int64_t> rows(static_cast<std::size_t>(n));
  for (int r = 0; r < n; ++r) rows[r] = ep_token_slice(M, n, r).second;
  const std::vector<char> all_out =
      ep_gather(comm, out.data(), static_cast<std::size_t>(H) * dtype_size(out.dtype()), rows);
  constexpr int kStats = 6;
  const auto ns = [](double s) { return static_cast<int64_t>(std::llround(s * 1e9)); };
  const std::vector<int64_t> mine = {t.last.rows_sent,         t.last.rows_received,
                                     ns(median_of(t.total)),   ns(median_of(t.dispatch)),
                                     ns(median_of(t.compute)), ns(median_of(t.combine))};
  const std::vector<char> all_stats =
      ep_gather(comm, mine.data(), kStats * sizeof(int64_t), std::vector<int64_t>(n, 1));
  if (!root) return;

  // ---- rank 0: the report
  const Fp8MoeLayerPlan& plan = layer->plan();
  const EpLayout layout = EpLayout::linear(model.num_experts, n);
  const KernelChoice kc = layer->kernel_for(std::max<int64_t>(M, 1));
  Tensor ep_out = Tensor::empty({M, H}, in.x.dtype());
  if (!all_out.empty()) std::memcpy(ep_out.data(), all_out.data(), ep_out.nbytes());
  const auto* st = reinterpret_cast<const int64_t*>(all_stats.data());
  const std::string backend = comm.backend();
  const std::string how =
      L.gpu ? fmt::format("{} processes, one per GPU, NCCL", n)
            : fmt::format("{} simulated rank{} (threads, in-process communicator)", n,
                          n > 1 ? "s" : "");
  ordered_json j;
  j["command"] = "run";
  j["model"] = o.model;
  j["layer"] = layer_index;
  j["plan"] = layer_plan_to_json(plan);
  j["input"] = {{"tokens", M},
                {"dtype", std::string(dtype_name(in.x.dtype()))},
                {"x", in.x_from},
                {"router_logits", in.logits_from}};
  double layer_s = 0, comm_s = 0, rank_s = 0;
  ordered_json jr = ordered_json::array();
  std::vector<std::string> rank_lines;
  for (int r = 0; r < n; ++r) {
    const int64_t* s = st + r * kStats;
    const double tot = s[2] * 1e-9, dis = s[3] * 1e-9, cmp = s[4] * 1e-9, cmb = s[5] * 1e-9;
    layer_s = std::max(layer_s, tot);
    comm_s += dis + cmb;
    rank_s += dis + cmp + cmb;
    std::vector<int> experts;
    for (int e = 0; e < model.num_experts; ++e)
      if (layout.owner[e] == r) experts.push_back(e);
    const auto [f, c] = ep_token_slice(M, n, r);
    jr.push_back({{"rank", r},
                  {"experts", experts},
                  {"tokens", c},
                  {"first_token", f},
                  {"rows_sent", s[0]},
                  {"rows_received", s[1]},
                  {"median_s", tot},
                  {"dispatch_s", dis},
                  {"compute_s", cmp},
                  {"combine_s", cmb}});
    rank_lines.push_back(fmt::format(
        "rank {:<3} experts {}-{} ({}), {} tokens, rows sent {} / received {}; {} median "
        "(dispatch {}, compute {}, combine {})",
        r, experts.front(), experts.back(), experts.size(), c, s[0], s[1], fmt_seconds(tot),
        fmt_seconds(dis), fmt_seconds(cmp), fmt_seconds(cmb)));
  }
  const double comm_frac = rank_s > 0 ? comm_s / rank_s : 0;
  j["ep"] = {{"size", n},
             {"communicator", backend},
             {"launch", how},
             {"placement", "linear"},
             {"format", L.format_name},
             {"format_why", L.format_why},
             {"kernel",
              {{"implementation", kc.impl_name}, {"vllm_class", kc.kernel_class}, {"why", kc.why}}},
             {"reps", std::max(o.reps, 1)},
             {"layer_median_s", layer_s},
             {"communication_fraction", comm_frac},
             {"ranks", jr}};
  if (!o.json) {
    std::cout << fmt::format("fp8moe run {} (layer {}, EP {}: {}, {} tokens)\n", o.model,
                             layer_index, n, how,
                             o.input.empty() ? std::to_string(o.tokens) : "file");
    if (o.brief) {
      std::cout << "plan    rank 0: " << plan_brief(plan) << "\n";
    } else {
      std::cout << "plan    (rank 0)\n";
      for (const auto& l : layer_plan_to_text(plan)) std::cout << "  " << l << "\n";
    }
    std::cout << fmt::format("input   x ({}, {}) = {}\n        router logits = {}\n", M, H,
                             in.x_from, in.logits_from);
    std::cout << fmt::format(
        "ep      {} ranks over {}; vLLM's linear expert placement; {} format ({})\n", n, backend,
        L.format_name, L.format_why);
    std::cout << fmt::format("kernel  {} for the global M = {}{}\n", kc.impl_name, M,
                             kc.why.empty() ? "" : fmt::format(" ({})", kc.why));
    for (const auto& l : rank_lines) std::cout << "        " << l << "\n";
    std::cout << fmt::format(
        "time    layer {} median of {} runs (slowest rank); dispatch + combine {:.1f}% of the "
        "ranks' time (waiting for peers included){}\n",
        fmt_seconds(layer_s), std::max(o.reps, 1), 100 * comm_frac,
        L.gpu ? "" : "; simulated ranks share this machine's cores: overhead, not scaling");
  }

  bool ok = true;
  std::string summary = fmt::format("EP {} ({}) for M = {}, layer {} median", n, kc.impl_name, M,
                                    fmt_seconds(layer_s));
  Tensor reference;
  if (o.check) {
    // The same kernel on one rank holding every expert, and the float64 reference on one rank.
    CheckpointLayerRequest one = req;
    one.tp_size = 1;
    one.rank = 0;
    one.enable_ep = false;
    Fp8MoeLayerOptions one_opts = opts;
    if (L.gpu) one_opts.device = Device::cuda(0);
    const Fp8MoeLayer single = Fp8MoeLayer::from_checkpoint(o.model, one, one_opts);
    const Device dev = single.device();
    Tensor single_out = single.forward(dev.is_cpu() ? in.x : in.x.to(dev),
                                       dev.is_cpu() ? in.logits : in.logits.to(dev));
    if (!dev.is_cpu()) single_out = single_out.to(Device::cpu());
    const OutputComparison vs_single = compare_outputs(ep_out, single_out);
    Fp8MoeLayerOptions ref_opts = opts;
    ref_opts.kernel = "ref";
    ref_opts.device = Device::cpu();
    const Fp8MoeLayer ref_layer = Fp8MoeLayer::from_checkpoint(o.model, one, ref_opts);
    reference = ref_layer.forward(in.x, in.logits);
    const OutputComparison vs_ref = compare_outputs(ep_out, reference);
    ok = vs_single.allclose && vs_ref.allclose;
    j["check"] = {{"single_rank_kernel", single.kernel_for(std::max<int64_t>(M, 1)).impl_name},
                  {"vs_single_rank", comparison_json(vs_single)},
                  {"vs_reference", comparison_json(vs_ref)},
                  {"pass", ok}};
    if (!o.json) {
      std::cout << fmt::format(
          "check   vs the same layer on one rank ({}, every expert, all {} tokens):\n"
          "          {}\n"
          "        vs the float64 reference on one rank:\n          {}\n",
          single.kernel_for(std::max<int64_t>(M, 1)).impl_name, M, comparison_text(vs_single),
          comparison_text(vs_ref));
    }
    summary += fmt::format("; vs one rank {}; vs reference {}",
                           vs_single.bitwise_equal ? "bitwise equal"
                           : vs_single.allclose    ? "within atol=rtol=0.035"
                                                   : "OUTSIDE atol=rtol=0.035",
                           vs_ref.bitwise_equal ? "bitwise equal"
                           : vs_ref.allclose    ? "within atol=rtol=0.035"
                                                : "OUTSIDE atol=rtol=0.035");
  }
  if (!o.output.empty()) write_output(o.output, in, ep_out, reference);
  if (!ok) exit_status() = 1;
  j["ok"] = ok;
  if (o.json) {
    print_ordered(j);
  } else {
    std::cout << "result  " << (o.check ? (ok ? "PASS" : "FAIL") : "done (no --check)") << ": "
              << summary << "\n";
  }
}

// This binary's argv (Linux: /proc/self/cmdline).
std::vector<std::string> own_argv() {
  std::ifstream f("/proc/self/cmdline", std::ios::binary);
  std::vector<std::string> args;
  std::string a;
  while (std::getline(f, a, '\0')) args.push_back(a);
  return args;
}

// ValueError / RuntimeError unless this machine has n GPUs and NCCL.
void check_ep_gpus(int n) {
  std::string why;
  const int gpus = cuda_device_count(&why);
  if (gpus < n) {
    throw ValueError(fmt::format(
        "--ep {} on CUDA runs one process per GPU and needs {} GPUs; this machine has {}{}", n, n,
        gpus, why.empty() ? "" : fmt::format(" ({})", why)));
  }
  if (!nccl_available(&why)) {
    throw RuntimeError(fmt::format("--ep {} on CUDA needs NCCL: {}", n, why));
  }
}

// GPUs: one process per GPU, this binary with --ep-rank R --ep-unique-id HEX; returns the exit
// status (the first failing rank's; the others are then stopped so none waits on a dead peer).
int launch_ep_processes(int n) {
  check_ep_gpus(n);
  const std::string id = nccl_get_unique_id().hex();
  const std::vector<std::string> args = own_argv();
  if (args.empty()) throw RuntimeError("cannot read this process's arguments (/proc/self/cmdline)");
  // NVLink multicast off for the children: on shared multi-GPU hosts it can take GPUs out of
  // service (issue 9).
  setenv("NCCL_NVLS_ENABLE", "0", 1);
  std::cout << std::flush;
  std::vector<pid_t> pids;
  for (int r = 0; r < n; ++r) {
    std::vector<std::string> a = args;
    a.insert(a.end(), {"--ep-rank", std::to_string(r), "--ep-unique-id", id});
    std::vector<char*> argv;
    for (auto& s : a) argv.push_back(s.data());
    argv.push_back(nullptr);
    const pid_t pid = fork();
    if (pid < 0) {
      for (pid_t p : pids) kill(p, SIGTERM);
      throw RuntimeError(fmt::format("fork failed: {}", std::strerror(errno)));
    }
    if (pid == 0) {
      execv("/proc/self/exe", argv.data());
      std::fprintf(stderr, "fp8moe: exec of EP rank %d failed: %s\n", r, std::strerror(errno));
      _exit(2);
    }
    pids.push_back(pid);
  }
  int status_out = 0;
  std::size_t running = pids.size();
  while (running > 0) {
    int st = 0;
    const pid_t p = waitpid(-1, &st, 0);
    if (p < 0) {
      if (errno == EINTR) continue;
      break;
    }
    auto it = std::find(pids.begin(), pids.end(), p);
    if (it == pids.end()) continue;
    *it = -1;
    --running;
    const int code = WIFEXITED(st) ? WEXITSTATUS(st) : 3;
    if (code != 0 && status_out == 0) {
      status_out = code;
      for (pid_t q : pids)
        if (q > 0) kill(q, SIGTERM);
    }
  }
  return status_out;
}

void run_ep(const RunOptions& o) {
  json_output() = o.json;
  check_kernel_name(o.kernel);
  const bool child = o.ep_rank >= 0;
  if (o.ep < 1) throw ValueError(fmt::format("--ep {} must be >= 1", o.ep));
  if (o.tp != 1) {
    throw ValueError(fmt::format(
        "--ep {} with --tp {}: fp8moe's EP ranks hold whole experts (vLLM's EP size is TP x DP "
        "with --enable-expert-parallel); give --ep N alone",
        o.ep, o.tp));
  }
  if (o.rank != "0") throw ValueError("--rank picks one rank; --ep N runs all N ranks");
  if (o.enable_ep) {
    throw ValueError("--enable-ep runs one rank's experts with --tp; --ep N runs all N EP ranks");
  }
  if (!o.platform.empty() || !o.installed.empty()) {
    throw ValueError("--ep runs on this machine; --platform / --installed simulate another one");
  }
  const ModelConfig model = load_model_config(o.model);
  if (o.ep > model.num_experts) {
    throw ValueError(
        fmt::format("--ep {}: the model has {} routed experts; every EP rank needs at least one",
                    o.ep, model.num_experts));
  }
  if (o.tokens < 0) throw ValueError("--tokens must be >= 0");
  if (o.reps < 1) throw ValueError(fmt::format("--reps {} must be >= 1", o.reps));
  const int layer_index =
      o.layer < 0 ? (model.moe_layers.empty() ? 0 : model.moe_layers.front()) : o.layer;
  Fp8MoeLayerOptions opts;
  opts.env = make_env(o.env, o.ignore_environment);
  opts.kernel = o.kernel == "oracle" ? "" : o.kernel;
  opts.max_num_tokens = o.max_tokens;
  parse_act_dtype(o.dtype);

  EpLaunch L;
  L.n = o.ep;
  if (o.ep_format == "standard") {
    L.format = EpExpertsFormat::kStandard;
  } else if (o.ep_format == "batched") {
    L.format = EpExpertsFormat::kBatched;
  } else if (o.ep_format != "oracle") {
    throw ValueError(
        fmt::format("--ep-format '{}': expected oracle, standard or batched", o.ep_format));
  }
  if (!o.device.empty()) {
    if (o.device == "cuda") {
      L.gpu = true;
    } else if (o.device != "cpu") {
      throw ValueError(fmt::format(
          "--ep takes --device cpu or cuda (rank r runs on GPU r), got '{}'", o.device));
    }
  }
  // Rank 0's plan: where the oracle's kernel runs decides threads or processes when --device is
  // not given, and the activation format.
  CheckpointLayerRequest req;
  req.layer = o.layer;
  req.tp_size = o.ep;
  req.rank = 0;
  req.enable_ep = true;
  req.moe_backend = o.moe_backend;
  Fp8MoeLayerOptions plan_opts = opts;
  if (!o.device.empty()) plan_opts.device = L.gpu ? Device::cuda(0) : Device::cpu();
  const Fp8MoeLayerPlan plan = plan_fp8_moe_layer(checkpoint_layer_spec(model, req), plan_opts);
  if (o.device.empty() && plan.ok && plan.runnable && !plan.device.is_cpu()) L.gpu = true;
  const bool batched = plan.selection.activation_format == ActivationFormat::kBatchedExperts;
  if (L.format) {
    L.format_name = *L.format == EpExpertsFormat::kBatched ? "batched" : "standard";
    L.format_why = fmt::format("--ep-format; the oracle's is {}", batched ? "batched" : "standard");
  } else {
    L.format_name = batched ? "batched" : "standard";
    L.format_why =
        fmt::format("the oracle's: use_batched_activation_format {}", batched ? "True" : "False");
  }
  if (L.gpu && !child) check_ep_gpus(o.ep);
  const bool plannable = plan.ok && plan.runnable;
  if (o.plan_only || !plannable) {
    // As run without --ep: the plan, and why it cannot run.
    if (!plannable) exit_status() = 1;
    if (o.json) {
      ordered_json j;
      j["command"] = "run";
      j["model"] = o.model;
      j["layer"] = layer_index;
      j["plan"] = layer_plan_to_json(plan);
      j["ok"] = plannable;
      print_ordered(j);
      return;
    }
    std::cout << fmt::format("fp8moe run {} (layer {}, EP {} rank 0 plan)\n", o.model, layer_index,
                             o.ep);
    for (const auto& l : layer_plan_to_text(plan)) std::cout << "  " << l << "\n";
    if (!plannable) {
      std::cout << (plan.ok ? "result  cannot run here: " + plan.not_runnable_reason
                            : fmt::format("result  the plan failed at '{}': {}: {}",
                                          plan.failed_step, plan.error_kind, plan.error_message))
                << "\n";
    }
    return;
  }
  if (L.gpu && !child) {
    exit_status() = launch_ep_processes(o.ep);
    return;
  }
  if (child) {
    if (o.ep_rank >= o.ep) {
      throw ValueError(fmt::format("--ep-rank {} is outside --ep {}", o.ep_rank, o.ep));
    }
    const auto comm =
        make_nccl_communicator(NcclUniqueId::from_hex(o.ep_unique_id), o.ep_rank, o.ep, o.ep_rank);
    ep_rank_main(o, model, layer_index, opts, *comm, L);
    return;
  }
  // The CPU: N threads over the in-process communicator. The first error that is a rank's own
  // (not "rank r failed") is the one reported.
  auto group = make_in_process_group(o.ep);
  std::vector<std::exception_ptr> errors(static_cast<std::size_t>(o.ep));
  std::vector<std::string> messages(static_cast<std::size_t>(o.ep));
  std::vector<std::thread> threads;
  for (int r = 0; r < o.ep; ++r) {
    threads.emplace_back([&, r] {
      try {
        share_cpu_threads_among_ranks(o.ep);
        ep_rank_main(o, model, layer_index, opts, *group[r], L);
      } catch (const std::exception& e) {
        errors[r] = std::current_exception();
        messages[r] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  std::exception_ptr first;
  for (int r = 0; r < o.ep && !first; ++r) {
    if (errors[r] && messages[r].find("(see its error)") == std::string::npos) first = errors[r];
  }
  for (int r = 0; r < o.ep && !first; ++r) first = errors[r];
  if (first) std::rethrow_exception(first);
}

void run_run(const RunOptions& o) {
  if (o.ep > 0 || o.ep_rank >= 0 || o.ep_given) {
    run_ep(o);
    return;
  }
  json_output() = o.json;
  check_kernel_name(o.kernel);
  const ModelConfig model = load_model_config(o.model);
  const int layer_index =
      o.layer < 0 ? (model.moe_layers.empty() ? 0 : model.moe_layers.front()) : o.layer;
  if (o.tp < 1) throw ValueError(fmt::format("--tp {} must be >= 1", o.tp));
  std::vector<int> ranks;
  if (o.rank == "all") {
    for (int r = 0; r < o.tp; ++r) ranks.push_back(r);
  } else {
    ranks.push_back(static_cast<int>(parse_count(o.rank, "--rank", 0)));
  }
  if (o.tokens < 0) throw ValueError("--tokens must be >= 0");
  Fp8MoeLayerOptions opts;
  opts.env = make_env(o.env, o.ignore_environment);
  opts.kernel = o.kernel == "oracle" ? "" : o.kernel;
  opts.max_num_tokens = o.max_tokens;
  if (!o.platform.empty()) {
    // A simulated deployment: the plan is vLLM's decision there; only the reference can run it
    // here (it computes what that deployment's scheme computes).
    opts.platform = Platform::parse(o.platform);
    if (!o.installed.empty()) opts.platform->set_installed(o.installed);
  } else if (!o.installed.empty()) {
    throw ValueError("--installed needs --platform (this machine's kernels are what they are)");
  }
  const bool simulated = opts.platform.has_value();
  if (!o.device.empty()) opts.device = parse_device(o.device);
  const DType dt = parse_act_dtype(o.dtype);

  CheckpointLayerRequest req;
  req.layer = o.layer;
  req.tp_size = o.tp;
  req.rank = ranks.front();
  req.enable_ep = o.enable_ep;
  req.moe_backend = o.moe_backend;
  const Fp8MoeLayerPlan plan = plan_fp8_moe_layer(checkpoint_layer_spec(model, req), opts);
  const std::string title = fmt::format(
      "fp8moe run {} (layer {}, {} {} rank {}, {} tokens)", o.model, layer_index,
      o.enable_ep ? "EP" : "TP", o.tp, o.rank, o.input.empty() ? std::to_string(o.tokens) : "file");

  ordered_json j;
  j["command"] = "run";
  j["model"] = o.model;
  j["layer"] = layer_index;
  j["plan"] = layer_plan_to_json(plan);
  if (!o.json) {
    std::cout << title << "\n";
    if (o.brief) {
      std::cout << "plan    " << plan_brief(plan) << "\n";
    } else {
      std::cout << "plan\n";
      for (const auto& l : layer_plan_to_text(plan)) std::cout << "  " << l << "\n";
    }
  }
  // A plan answers "yes" when it runs here, or, for a simulated platform with --plan-only, when
  // vLLM's decision there succeeded.
  const bool plannable = plan.ok && (plan.runnable || (simulated && o.plan_only));
  if (o.plan_only || !plannable) {
    if (!plannable) exit_status() = 1;
    j["ok"] = plannable;
    if (!plannable) {
      j["error"] =
          plan.ok
              ? ordered_json{{"kind", "NotImplementedError"}, {"message", plan.not_runnable_reason}}
              : ordered_json{{"kind", plan.error_kind}, {"message", plan.error_message}};
    }
    if (o.json) {
      print_ordered(j);
    } else if (!plannable) {
      std::cout << (plan.ok ? "result  cannot run here: " + plan.not_runnable_reason
                            : fmt::format("result  the plan failed at '{}': {}: {}",
                                          plan.failed_step, plan.error_kind, plan.error_message))
                << "\n";
    } else if (simulated && !plan.runnable) {
      std::cout << fmt::format(
          "result  planned for {} (simulated): {} there; here only --kernel ref can run it\n",
          opts.platform->str(),
          plan.selection.kernel ? fmt::format("{} / {}", backend_value(plan.selection.backend),
                                              plan.selection.kernel->name)
                                : backend_value(plan.selection.backend));
    }
    return;
  }

  const Inputs in = make_inputs(o.model, model, layer_index, o.tokens, dt, o.seed, o.input);
  const int64_t M = in.x.size(0);
  j["input"] = {{"tokens", M},
                {"dtype", std::string(dtype_name(in.x.dtype()))},
                {"x", in.x_from},
                {"router_logits", in.logits_from}};
  if (!o.json) {
    std::cout << fmt::format("input   x ({}, {}) = {}\n        router logits = {}\n", M,
                             model.hidden_size, in.x_from, in.logits_from);
  }

  bool ok = true;
  std::string summary;  // the result line
  ordered_json jr = ordered_json::array();
  std::vector<float> sum;
  Tensor last_out, last_ref;
  for (int r : ranks) {
    req.rank = r;
    Fp8MoeLayer layer = Fp8MoeLayer::from_checkpoint(o.model, req, opts);
    const KernelChoice kc = layer.kernel_for(M);
    // Inputs on the layer's device (a CUDA kernel's layer lives on the GPU).
    const Device dev = layer.device();
    const Tensor x = dev.is_cpu() ? in.x : in.x.to(dev);
    const Tensor logits = dev.is_cpu() ? in.logits : in.logits.to(dev);
    Tensor out = Tensor::empty({M, model.hidden_size}, in.x.dtype(), dev);
    const std::string how = layer.describe_call(x, logits, out);
    layer.forward(x, logits, out);
    const bench::Timing t = bench::time_forward(layer, x, logits, out, 0.0, o.reps, o.reps);
    ordered_json jj;
    jj["rank"] = r;
    jj["kernel"] = {{"implementation", kc.impl_name},
                    {"vllm_class", kc.kernel_class},
                    {"why", kc.why},
                    {"how", how}};
    jj["workspace_bytes"] = layer.owned_workspace_bytes();
    jj["time"] = {
        {"reps", t.reps}, {"median_s", t.median_s}, {"min_s", t.min_s}, {"max_s", t.max_s}};
    const std::string who = ranks.size() > 1 ? fmt::format("rank {}: ", r) : "";
    if (!o.json && o.brief && !o.check) {
      std::cout << fmt::format("run     {}{} for M = {}, {} median of {} runs\n", who, kc.impl_name,
                               M, fmt_seconds(t.median_s), t.reps);
    }
    const auto& applied = layer.weights().applied;
    jj["prepared"] = {{"layout", std::string(weight_layout_name(layer.weights().layout))},
                      {"applied", applied},
                      {"device", dev.str()}};
    if (!o.json && !o.brief && r == ranks.front()) {
      std::cout << fmt::format(
          "weights {}\n",
          applied.empty() ? std::string("used as loaded (canonical layout)") : applied.front());
      for (std::size_t i = 1; i < applied.size(); ++i)
        std::cout << "        " << applied[i] << "\n";
    }
    if (!o.json && !o.brief) {
      std::cout << fmt::format("kernel  {}{} for M = {}{}\n", who, kc.impl_name, M,
                               kc.why.empty() ? "" : fmt::format(" ({})", kc.why));
      if (!how.empty()) std::cout << fmt::format("        {}: {}\n", kc.impl_name, how);
      std::cout << fmt::format("time    {}{} median of {} runs (min {}, max {}) on {}\n", who,
                               fmt_seconds(t.median_s), t.reps, fmt_seconds(t.min_s),
                               fmt_seconds(t.max_s), layer.device().str());
    }
    if (o.check) {
      const ForwardCheck c = check_forward(layer, x, logits, out);
      const bool pass = check_passes(c);
      ok = ok && pass;
      jj["check"] = {{"reference_is_kernel", c.reference_is_kernel},
                     {"vs_reference", comparison_json(c.vs_reference)},
                     {"unquantized_weights", c.unquantized_weights},
                     {"vs_unquantized", comparison_json(c.vs_unquantized)},
                     {"pass", pass}};
      if (!o.json && o.brief) {
        std::cout << fmt::format(
            "run     {}{} for M = {}, {} median; vs reference {}; vs unquantised {:.3g}% mean "
            "relative error\n",
            who, kc.impl_name, M, fmt_seconds(t.median_s),
            c.vs_reference.bitwise_equal ? "bitwise equal"
            : c.vs_reference.allclose    ? "within atol=rtol=0.035"
                                         : "OUTSIDE atol=rtol=0.035",
            100 * c.vs_unquantized.mean_rel_abs_err);
      } else if (!o.json) {
        std::cout << fmt::format(
            "check   vs the float64 reference on the same fp8 weights{}:\n"
            "          {}\n",
            c.reference_is_kernel ? " (the kernel is the reference itself)" : "",
            comparison_text(c.vs_reference));
        std::cout << fmt::format(
            "        vs the unquantised layer on {}:\n          {} (vLLM's per-tensor FP8 test "
            "accepts a mean relative error < 5%)\n",
            c.unquantized_weights, comparison_text(c.vs_unquantized));
      }
      if (summary.empty()) {
        summary = fmt::format(
            "{} for M = {}, {} median; vs reference {}; vs unquantised {:.3g}% mean "
            "relative error",
            kc.impl_name, M, fmt_seconds(t.median_s),
            c.vs_reference.bitwise_equal ? "bitwise equal"
            : c.vs_reference.allclose    ? "within atol=rtol=0.035"
                                         : "OUTSIDE atol=rtol=0.035",
            100 * c.vs_unquantized.mean_rel_abs_err);
      }
      last_ref = c.reference_out;
    }
    if (ranks.size() > 1) {
      if (sum.empty()) sum.assign(static_cast<std::size_t>(out.numel()), 0.0f);
      const Tensor oh = dev.is_cpu() ? out : out.to(Device::cpu());
      for (int64_t i = 0; i < oh.numel(); ++i) sum[i] += load(oh, i);
    }
    last_out = dev.is_cpu() ? out : out.to(Device::cpu());
    jr.push_back(jj);
  }
  j["ranks"] = jr;

  if (ranks.size() > 1) {
    // The all-reduce of the ranks' partial sums (f32 accumulation, one rounding), against the
    // unsharded layer's float64 reference (TP 1, the reference kernel).
    Tensor summed = Tensor::empty({M, model.hidden_size}, in.x.dtype());
    for (int64_t i = 0; i < summed.numel(); ++i) {
      if (summed.dtype() == DType::kBF16) {
        summed.ptr<uint16_t>()[i] = numerics::float_to_bf16(sum[i]);
      } else {
        summed.ptr<float>()[i] = sum[i];
      }
    }
    last_out = summed;
    if (o.check) {
      CheckpointLayerRequest whole = req;
      whole.tp_size = 1;
      whole.rank = 0;
      whole.enable_ep = false;
      Fp8MoeLayerOptions ropts = opts;
      ropts.kernel = "ref";
      Fp8MoeLayer full = Fp8MoeLayer::from_checkpoint(o.model, whole, ropts);
      const Tensor expected = full.forward(in.x, in.logits);
      const OutputComparison c = compare_outputs(summed, expected);
      ok = ok && c.allclose;
      j["ranks_summed"] = {{"vs_tp1_reference", comparison_json(c)}, {"pass", c.allclose}};
      last_ref = expected;
      if (!o.json) {
        std::cout << fmt::format(
            "ranks   {} ranks summed vs the unsharded layer's reference:\n          {}\n",
            ranks.size(), comparison_text(c));
      }
      summary = fmt::format(
          "{} ranks ({}) summed vs the unsharded layer's reference: max |err| {:.3g}, {}",
          ranks.size(), opts.kernel.empty() ? "the oracle's kernel" : opts.kernel, c.max_abs_err,
          c.allclose ? "within atol=rtol=0.035" : "OUTSIDE atol=rtol=0.035");
    }
  }
  if (!o.output.empty()) write_output(o.output, in, last_out, last_ref);
  if (!ok) exit_status() = 1;
  j["ok"] = ok;
  if (o.json) {
    print_ordered(j);
  } else {
    std::cout << "result  " << (o.check ? (ok ? "PASS" : "FAIL") : "done (no --check)")
              << (summary.empty() ? "" : ": " + summary) << "\n";
  }
}

// ---- bench ------------------------------------------------------------------------------------

struct BenchOptions {
  std::string model;
  std::string presets;
  std::string tokens = "1,8,64";
  std::string backends = "oracle";
  int layer = -1;
  int tp = 1;
  int rank = 0;
  bool enable_ep = false;
  std::string moe_backend = "auto";
  std::string dtype = "bf16";
  double min_time = 0.5;
  int min_reps = 3, max_reps = 50;
  int64_t max_weight_mib = 1024;
  uint64_t seed = 0;
  bool json = false, csv = false, no_ceilings = false, list = false;
  std::vector<std::string> env;
  bool ignore_environment = false;
  int ep = 0;  // --ep N: every EP rank, simulated by threads (0: not given)
  bool ep_given = false;
};

struct Target {
  std::string name;
  ModelConfig model;
  CheckpointLayerRequest req;
  bool preset = false;
  std::string description;
};

struct Row {
  std::string target;
  std::string backend_item;
  int64_t M = 0;
  int E = 0, E_local = 0, topk = 0;
  int64_t K = 0, N = 0;
  std::string impl, vllm_class, oracle, status = "ok", note;
  bench::Timing t;
  bench::Traffic traffic;
  double bytes_per_s = 0, flops_per_s = 0, bw_frac = 0, fma_frac = 0, roofline_frac = 0;
  // --ep: rank-mean medians of the EP forward's phases, and dispatch + combine over their sum
  int ep = 0;
  double dispatch_s = 0, compute_s = 0, combine_s = 0, comm_frac = 0;
};

// bench --ep: the N ranks' layers timed as simulated ranks (threads over the in-process
// communicator). A warm-up and one calibration call fix the repetitions; the layer time of a
// repetition is its slowest rank's.
struct EpBenchTiming {
  bench::Timing t;
  double dispatch_s = 0, compute_s = 0, combine_s = 0;
};
EpBenchTiming time_ep_layers(const std::vector<const Fp8MoeLayer*>& layers, const Tensor& x,
                             const Tensor& logits, double min_time, int min_reps, int max_reps) {
  const int n = static_cast<int>(layers.size());
  const int64_t M = x.size(0);
  auto group = make_in_process_group(n);
  std::vector<Tensor> xs(n), ls(n), outs(n);
  for (int r = 0; r < n; ++r) {
    const auto [first, count] = ep_token_slice(M, n, r);
    xs[r] = copy_rows(x, first, count);
    ls[r] = copy_rows(logits, first, count);
    outs[r] = Tensor::empty({count, x.size(1)}, x.dtype());
  }
  std::vector<EpRankTiming> per(static_cast<std::size_t>(n));
  const auto run = [&](int reps) {
    std::vector<std::exception_ptr> errors(static_cast<std::size_t>(n));
    std::vector<std::string> messages(static_cast<std::size_t>(n));
    std::vector<std::thread> threads;
    for (int r = 0; r < n; ++r) {
      threads.emplace_back([&, r] {
        try {
          share_cpu_threads_among_ranks(n);
          per[r] = time_ep_forward(*layers[r], *group[r], xs[r], ls[r], outs[r], reps, {});
        } catch (const std::exception& e) {
          errors[r] = std::current_exception();
          messages[r] = e.what();
        }
      });
    }
    for (auto& t : threads) t.join();
    for (int r = 0; r < n; ++r)
      if (errors[r] && messages[r].find("(see its error)") == std::string::npos)
        std::rethrow_exception(errors[r]);
    for (int r = 0; r < n; ++r)
      if (errors[r]) std::rethrow_exception(errors[r]);
  };
  run(1);
  double t1 = 0;
  for (const auto& p : per) t1 = std::max(t1, p.total.front());
  const int reps = std::clamp(static_cast<int>(std::ceil(min_time / std::max(t1, 1e-9))),
                              std::max(min_reps, 1), std::max(max_reps, std::max(min_reps, 1)));
  run(reps);
  std::vector<double> layer_t(static_cast<std::size_t>(reps), 0.0);
  EpBenchTiming out;
  for (const auto& p : per) {
    for (int i = 0; i < reps; ++i) layer_t[i] = std::max(layer_t[i], p.total[i]);
    out.dispatch_s += median_of(p.dispatch) / n;
    out.compute_s += median_of(p.compute) / n;
    out.combine_s += median_of(p.combine) / n;
  }
  out.t.reps = reps;
  out.t.median_s = median_of(layer_t);
  out.t.min_s = *std::min_element(layer_t.begin(), layer_t.end());
  out.t.max_s = *std::max_element(layer_t.begin(), layer_t.end());
  return out;
}

const char* kCsvColumns =
    "target,backend,M,E,E_local,topk,K,N,implementation,vllm_class,oracle,status,reps,median_s,"
    "min_s,distinct_experts,unique_expert_bytes,bytes,flops,bytes_per_s,flops_per_s,bw_fraction,"
    "fma_fraction,roofline_fraction,note";
// Appended with --ep.
const char* kCsvEpColumns = ",ep,dispatch_s,compute_s,combine_s,communication_fraction";

std::string csv_field(const std::string& s) {
  if (s.find_first_of(",\"\n") == std::string::npos) return s;
  std::string r = "\"";
  for (char c : s) r += c == '"' ? std::string("\"\"") : std::string(1, c);
  return r + "\"";
}

ordered_json row_json(const Row& r) {
  return {{"target", r.target},
          {"backend", r.backend_item},
          {"M", r.M},
          {"E", r.E},
          {"E_local", r.E_local},
          {"topk", r.topk},
          {"K", r.K},
          {"N", r.N},
          {"implementation", r.impl},
          {"vllm_class", r.vllm_class},
          {"oracle", r.oracle},
          {"status", r.status},
          {"reps", r.t.reps},
          {"median_s", r.t.median_s},
          {"min_s", r.t.min_s},
          {"distinct_experts", r.traffic.distinct_experts},
          {"unique_expert_bytes", r.traffic.weight_bytes},
          {"bytes", r.traffic.bytes},
          {"flops", r.traffic.flops},
          {"bytes_per_s", r.bytes_per_s},
          {"flops_per_s", r.flops_per_s},
          {"bw_fraction", r.bw_frac},
          {"fma_fraction", r.fma_frac},
          {"roofline_fraction", r.roofline_frac},
          {"note", r.note}};
}
ordered_json row_json_ep(const Row& r) {
  ordered_json j = row_json(r);
  j["ep"] = r.ep;
  j["dispatch_s"] = r.dispatch_s;
  j["compute_s"] = r.compute_s;
  j["combine_s"] = r.combine_s;
  j["communication_fraction"] = r.comm_frac;
  return j;
}

void progress(const std::string& line, bool final) {
  static const bool tty = isatty(2);
  if (tty) {
    std::cerr << "\r\033[K" << line << (final ? "\n" : "") << std::flush;
  } else if (!final) {
    std::cerr << line << "\n";
  }
}

void run_bench(const BenchOptions& o) {
  json_output() = o.json;
  if (o.list) {
    if (o.json) {
      ordered_json a = ordered_json::array();
      for (const auto& p : bench::bench_presets()) {
        a.push_back({{"name", p.name}, {"description", p.description}});
      }
      print_ordered(a);
    } else {
      for (const auto& p : bench::bench_presets()) {
        std::cout << fmt::format("{:<22} {}\n", p.name, p.description);
      }
    }
    return;
  }
  if (o.json && o.csv) throw ValueError("give --json or --csv, not both");
  const bool ep_mode = o.ep_given || o.ep != 0;
  if (ep_mode) {
    if (o.ep < 1) throw ValueError(fmt::format("--ep {} must be >= 1", o.ep));
    if (o.tp != 1 || o.rank != 0 || o.enable_ep) {
      throw ValueError(
          "--ep N times all N EP ranks; --tp, --rank and --enable-ep are for one rank (give --ep "
          "alone)");
    }
  }
  std::vector<Target> targets;
  if (!o.model.empty()) {
    Target t;
    t.model = load_model_config(o.model);
    t.name = o.model;
    t.req.layer = o.layer;
    t.req.tp_size = o.tp;
    t.req.rank = o.rank;
    t.req.enable_ep = o.enable_ep;
    t.req.moe_backend = o.moe_backend;
    t.description = t.model.describe();
    targets.push_back(t);
  }
  if (!o.presets.empty()) {
    std::vector<std::string> names = split_list(o.presets);
    if (names.size() == 1 && names[0] == "all") {
      names.clear();
      for (const auto& p : bench::bench_presets()) names.push_back(p.name);
    }
    for (const auto& n : names) {
      const bench::BenchPreset& p = bench::find_bench_preset(n);
      Target t;
      t.name = p.name;
      t.model = bench::preset_model(p);
      t.req.tp_size = p.tp_size;
      t.req.rank = 0;
      t.req.enable_ep = p.enable_ep;
      t.req.moe_backend = o.moe_backend;
      t.preset = true;
      t.description = p.description;
      targets.push_back(t);
    }
  }
  if (targets.empty()) {
    throw ValueError("bench needs a MODEL_DIR or --preset NAME (see --list-presets)");
  }
  if (ep_mode) {
    for (Target& t : targets) {
      if (o.ep > t.model.num_experts) {
        throw ValueError(
            fmt::format("--ep {}: {} has {} routed experts; every EP rank needs at least one", o.ep,
                        t.name, t.model.num_experts));
      }
      t.req.tp_size = o.ep;
      t.req.rank = 0;
      t.req.enable_ep = true;
    }
  }
  std::vector<int64_t> Ms;
  for (const auto& s : split_list(o.tokens)) Ms.push_back(parse_count(s, "--tokens", 1));
  if (Ms.empty()) throw ValueError("--tokens is empty");
  const std::vector<std::string> items = split_list(o.backends);
  if (items.empty()) throw ValueError("--backend is empty");
  for (const auto& item : items) {
    const auto names = fp8_moe_backend_names();
    if (std::find(names.begin(), names.end(), item) == names.end()) check_kernel_name(item);
  }
  const DType dt = parse_act_dtype(o.dtype);
  const OracleEnv env = make_env(o.env, o.ignore_environment);
  const uint64_t budget = static_cast<uint64_t>(o.max_weight_mib) << 20;

  bench::Ceilings ceil;
  if (!o.no_ceilings) {
    progress("bench: measuring the CPU ceilings (read bandwidth, FMA peak)...", false);
    ceil = bench::measure_cpu_ceilings(0.25);
  }
  std::vector<Row> rows;
  const std::size_t total = targets.size() * items.size() * Ms.size();
  std::size_t done = 0;
  for (const Target& tg : targets) {
    // The oracle's own plan (the "pick" column), whatever backend the row runs.
    Fp8MoeLayerOptions oracle_opts;
    oracle_opts.env = env;
    for (const std::string& item : items) {
      Fp8MoeLayerOptions opts;
      opts.env = env;
      opts.max_num_tokens = std::max<int64_t>(1024, *std::max_element(Ms.begin(), Ms.end()));
      CheckpointLayerRequest req = tg.req;
      // An item is "oracle", "ref", an fp8moe implementation name, or a vLLM moe_backend name.
      std::vector<std::string> moe_names = fp8_moe_backend_names();
      const bool vllm_backend =
          std::find(moe_names.begin(), moe_names.end(), item) != moe_names.end();
      if (vllm_backend) {
        req.moe_backend = item;
      } else if (item != "oracle") {
        opts.kernel = item;
      }
      std::string build_error;
      std::unique_ptr<Fp8MoeLayer> layer;
      std::vector<std::unique_ptr<Fp8MoeLayer>> peers;  // --ep: ranks 1..N-1 (layer is rank 0)
      bench::RandomLayer rl;
      Fp8MoeLayerPlan oracle_plan;
      // --ep: the weight budget is for all ranks together.
      const uint64_t rank_budget = ep_mode ? budget / static_cast<uint64_t>(o.ep) : budget;
      try {
        if (tg.preset) {
          rl = bench::make_random_layer(tg.model, req, opts, o.seed, rank_budget);
          layer =
              std::make_unique<Fp8MoeLayer>(Fp8MoeLayer::from_tensors(rl.spec, rl.weights, opts));
        } else {
          layer = std::make_unique<Fp8MoeLayer>(Fp8MoeLayer::from_checkpoint(o.model, req, opts));
        }
        for (int rank = 1; ep_mode && rank < o.ep; ++rank) {
          CheckpointLayerRequest rreq = req;
          rreq.rank = rank;
          if (tg.preset) {
            bench::RandomLayer rr =
                bench::make_random_layer(tg.model, rreq, opts, o.seed, rank_budget);
            // Every rank routes with rank 0's correction bias (the random draw depends on E_local).
            rr.spec.e_score_correction_bias = rl.spec.e_score_correction_bias;
            peers.push_back(std::make_unique<Fp8MoeLayer>(
                Fp8MoeLayer::from_tensors(rr.spec, rr.weights, opts)));
          } else {
            peers.push_back(
                std::make_unique<Fp8MoeLayer>(Fp8MoeLayer::from_checkpoint(o.model, rreq, opts)));
          }
        }
      } catch (const Error& e) {
        layer.reset();
        build_error = fmt::format("{}: {}", e.kind(), e.what());
      }
      const ModelConfig& model = tg.preset ? rl.model : tg.model;
      CheckpointLayerRequest oreq = tg.req;
      oracle_plan = plan_fp8_moe_layer(checkpoint_layer_spec(model, oreq), oracle_opts);
      for (int64_t M : Ms) {
        ++done;
        Row r;
        r.target = tg.name;
        r.backend_item = item;
        r.M = M;
        r.E = model.num_experts;
        r.topk = model.num_experts_per_tok;
        r.K = model.hidden_size;
        const KernelChoice oc = oracle_plan.dispatch(M);
        r.oracle = oracle_plan.ok
                       ? fmt::format("{} / {}", backend_value(oracle_plan.selection.backend),
                                     oc.kernel_class.empty() ? "-" : oc.kernel_class)
                       : fmt::format("({} failed)", oracle_plan.failed_step);
        if (tg.preset && rl.scaled_from) {
          r.note = fmt::format("E scaled {} -> {} to fit {} MiB", rl.scaled_from, model.num_experts,
                               o.max_weight_mib);
        }
        if (!layer) {
          r.status = "not run";
          r.note = build_error;
          r.E_local = oracle_plan.num_local_experts;
          r.N = oracle_plan.local_intermediate;
          rows.push_back(r);
          continue;
        }
        r.E_local = layer->num_local_experts();
        r.N = layer->local_intermediate();
        const KernelChoice kc = layer->kernel_for(M);
        r.impl = kc.impl_name;
        r.vllm_class = kc.kernel_class;
        progress(
            fmt::format("bench [{}/{}] {} M={} {} ({})...", done, total, tg.name, M, item, r.impl),
            false);
        const Device dev = layer->device();
        Tensor x = randn(M, r.K, dt, 0.1f, o.seed + static_cast<uint64_t>(M));
        Tensor logits = randn(M, r.E, DType::kF32, 1.0f, o.seed + 7 * static_cast<uint64_t>(M));
        if (!dev.is_cpu()) {
          x = x.to(dev);
          logits = logits.to(dev);
        }
        Tensor out = Tensor::empty({M, r.K}, dt, dev);
        try {
          if (ep_mode) {
            if (!dev.is_cpu()) {
              throw NotImplementedError(
                  "bench --ep simulates the ranks as threads on the host; on GPUs use run --ep N "
                  "--device cuda");
            }
            std::vector<const Fp8MoeLayer*> ranks = {layer.get()};
            for (const auto& p : peers) ranks.push_back(p.get());
            const EpBenchTiming et =
                time_ep_layers(ranks, x, logits, o.min_time, o.min_reps, o.max_reps);
            r.t = et.t;
            r.ep = o.ep;
            r.dispatch_s = et.dispatch_s;
            r.compute_s = et.compute_s;
            r.combine_s = et.combine_s;
            const double sum = et.dispatch_s + et.compute_s + et.combine_s;
            r.comm_frac = sum > 0 ? (et.dispatch_s + et.combine_s) / sum : 0;
          } else {
            r.t = bench::time_forward(*layer, x, logits, out, o.min_time, o.min_reps, o.max_reps);
          }
        } catch (const Error& e) {
          r.status = "error";
          r.note = fmt::format("{}: {}", e.kind(), e.what());
          rows.push_back(r);
          continue;
        }
        // --ep: the whole layer's traffic (every rank's experts).
        r.traffic = bench::moe_traffic(M, r.E, ep_mode ? r.E : r.E_local, r.topk, r.N, r.K,
                                       activation_is_gated(model.activation));
        r.bytes_per_s = r.traffic.bytes / r.t.median_s;
        r.flops_per_s = r.traffic.flops / r.t.median_s;
        if (ceil.measured && layer->device().is_cpu()) {
          r.bw_frac = r.bytes_per_s / ceil.read_bytes_per_s;
          r.fma_frac = r.flops_per_s / ceil.fma_flops_per_s;
          r.roofline_frac =
              bench::roofline_seconds(r.traffic, ceil.read_bytes_per_s, ceil.fma_flops_per_s) /
              r.t.median_s;
        }
        rows.push_back(r);
      }
    }
  }
  if (total > 1) progress(fmt::format("bench: {} rows done", rows.size()), true);
  bool all_ran = true;
  for (const auto& r : rows) all_ran = all_ran && r.status == "ok";
  if (!all_ran) exit_status() = 1;

  if (o.json) {
    ordered_json j;
    j["command"] = "bench";
    j["ceilings"] = {{"measured", ceil.measured},
                     {"read_bytes_per_s", ceil.read_bytes_per_s},
                     {"fma_flops_per_s", ceil.fma_flops_per_s},
                     {"threads", ceil.threads},
                     {"simd_target", ceil.simd_target},
                     {"note", ceil.note}};
    ordered_json ts = ordered_json::array();
    for (const auto& t : targets) ts.push_back({{"name", t.name}, {"description", t.description}});
    j["targets"] = ts;
    ordered_json a = ordered_json::array();
    for (const auto& r : rows) a.push_back(ep_mode ? row_json_ep(r) : row_json(r));
    j["rows"] = a;
    print_ordered(j);
    return;
  }
  if (o.csv) {
    std::cout << kCsvColumns << (ep_mode ? kCsvEpColumns : "") << "\n";
    for (const auto& r : rows) {
      std::cout << fmt::format(
          "{},{},{},{},{},{},{},{},{},{},{},{},{},{:.9g},{:.9g},{:.6g},{:.9g},{:.9g},{:.9g},{:.6g},"
          "{:.6g},{:.4g},{:.4g},{:.4g},{}",
          csv_field(r.target), csv_field(r.backend_item), r.M, r.E, r.E_local, r.topk, r.K, r.N,
          csv_field(r.impl), csv_field(r.vllm_class), csv_field(r.oracle), r.status, r.t.reps,
          r.t.median_s, r.t.min_s, r.traffic.distinct_experts, r.traffic.weight_bytes,
          r.traffic.bytes, r.traffic.flops, r.bytes_per_s, r.flops_per_s, r.bw_frac, r.fma_frac,
          r.roofline_frac, csv_field(r.note));
      if (ep_mode) {
        std::cout << fmt::format(",{},{:.9g},{:.9g},{:.9g},{:.6g}", r.ep, r.dispatch_s, r.compute_s,
                                 r.combine_s, r.comm_frac);
      }
      std::cout << "\n";
    }
    return;
  }
  // The table.
  if (ceil.measured) {
    std::cout << fmt::format(
        "ceilings  read {}/s, f32 FMA {}/s ({} threads, {}; measured in this run)\n",
        fmt_rate(ceil.read_bytes_per_s, "B"), fmt_rate(ceil.fma_flops_per_s, "FLOP"), ceil.threads,
        ceil.simd_target);
  }
  for (const auto& t : targets)
    std::cout << fmt::format("target    {}: {}\n", t.name, t.description);
  std::cout << "bytes     unique expert bytes touched under uniform routing (spec/models.md) + "
               "bf16 activations; FLOPs 6*M*topk*N*K\n";
  if (ep_mode) {
    std::cout << fmt::format(
        "ep        {} simulated EP ranks (threads, in-process communicator) sharing this machine's "
        "cores: overhead, not scaling. median = the slowest rank's per layer call; bytes/FLOPs of "
        "the whole layer; dispatch/compute/combine = rank means; comm% = (dispatch + combine) / "
        "their sum (waiting for peers included)\n",
        o.ep);
  }
  std::cout << "\n";
  const auto ep_cols = [&](const std::string& d, const std::string& c, const std::string& b,
                           const std::string& f) {
    return ep_mode ? fmt::format(" {:>10} {:>10} {:>10} {:>6}", d, c, b, f) : std::string();
  };
  std::cout << fmt::format(
      "{:<22} {:>5} {:<10} {:<12} {:<34} {:>11} {:>11} {:>6} {:>12} {:>6} {:>6}{}\n", "target", "M",
      "backend", "kernel", "oracle pick (vLLM class for M)", "median", "bytes/s", "%BW", "FLOP/s",
      "%FMA", "%roof", ep_cols("dispatch", "compute", "combine", "comm%"));
  std::string last_error;
  for (const auto& r : rows) {
    if (r.status != "ok") {
      // The reason once per (target, backend); "(as above)" after it.
      const std::string key = r.target + "\n" + r.backend_item + "\n" + r.note;
      std::cout << fmt::format("{:<22} {:>5} {:<10} {:<12} {:<34} {}\n", r.target, r.M,
                               r.backend_item, r.impl.empty() ? "-" : r.impl, r.oracle,
                               r.status + (key == last_error ? " (as above)" : ": " + r.note));
      last_error = key;
      continue;
    }
    std::cout << fmt::format(
        "{:<22} {:>5} {:<10} {:<12} {:<34} {:>11} {:>11} {:>6} {:>12} {:>6} {:>6}{}{}\n", r.target,
        r.M, r.backend_item, r.impl, r.oracle, fmt_seconds(r.t.median_s),
        fmt_rate(r.bytes_per_s, "B"), ceil.measured ? fmt::format("{:.1f}", 100 * r.bw_frac) : "-",
        fmt_rate(r.flops_per_s, "FLOP"),
        ceil.measured ? fmt::format("{:.1f}", 100 * r.fma_frac) : "-",
        ceil.measured ? fmt::format("{:.1f}", 100 * r.roofline_frac) : "-",
        ep_cols(fmt_seconds(r.dispatch_s), fmt_seconds(r.compute_s), fmt_seconds(r.combine_s),
                fmt::format("{:.1f}", 100 * r.comm_frac)),
        r.note.empty() ? "" : "  (" + r.note + ")");
  }
}

}  // namespace

void add_run_commands(CLI::App& app) {
  {
    auto o = std::make_shared<RunOptions>();
    CLI::App* sub = app.add_subcommand(
        "run",
        "Plan, load, run and time one MoE layer of a checkpoint on this machine (--check: "
        "against the float64 reference and the unquantised layer)");
    sub->add_option("MODEL_DIR", o->model, "checkpoint folder (config.json + safetensors)")
        ->required();
    sub->add_option("--layer", o->layer, "decoder layer (default: the first MoE layer)");
    sub->add_option("--tokens", o->tokens, "tokens of random input (default 32)");
    sub->add_option("--tp", o->tp, "tensor-parallel size (default 1)");
    sub->add_option("--rank", o->rank,
                    "this rank, or 'all' to run every rank and sum their outputs (default 0)");
    sub->add_flag("--enable-ep", o->enable_ep,
                  "vLLM --enable-expert-parallel: the --tp ranks become EP ranks");
    sub->add_option("--moe-backend", o->moe_backend, "vLLM --moe-backend (default auto)");
    sub->add_option("--kernel", o->kernel,
                    "fp8moe's kernel override: oracle (default), ref (the float64 reference) or "
                    "an implementation name (cpu_w8a16, cpu_w8a8, cuda_fused, ...)");
    sub->add_option("--dtype", o->dtype, "activation dtype: bf16 (default) or f32");
    sub->add_option("--seed", o->seed, "seed of the random input (default 0)");
    sub->add_option("--input", o->input,
                    "a .safetensors file with 'x' (tokens, hidden) and optionally 'router_logits'");
    sub->add_option("--output", o->output,
                    "write x, router_logits, out (and reference_out with --check) to this "
                    ".safetensors file");
    sub->add_option("--reps", o->reps, "timed runs after one warm-up (default 5)");
    sub->add_option("--max-tokens", o->max_tokens,
                    "tokens per call the layer's workspace is sized for (default 1024)");
    sub->add_flag("--check", o->check, "compare against the reference and the unquantised layer");
    sub->add_flag("--plan-only", o->plan_only, "print the plan and stop");
    sub->add_flag("--brief", o->brief, "one line for the plan and one per rank");
    sub->add_option("--device", o->device,
                    "where the weights live and the layer runs: cpu, cuda[:N] (default: where "
                    "the chosen kernel runs)");
    sub->add_option("--platform", o->platform,
                    "plan for a simulated deployment (cuda:90, cuda:100, rocm:gfx942, ...); with "
                    "it only --plan-only or --kernel ref run");
    sub->add_option("--installed", o->installed,
                    "kernel families installed on the simulated platform (default all)");
    sub->add_option("--env", o->env,
                    "NAME=VALUE for a vLLM variable the oracle reads (repeatable)");
    sub->add_flag("--ignore-environment", o->ignore_environment,
                  "do not read the vLLM variables from this process's environment");
    sub->add_option("--ep", o->ep,
                    "expert parallelism: run all N EP ranks (CPU: N threads over the in-process "
                    "communicator; --device cuda: one process per GPU over NCCL)")
        ->each([o](const std::string&) { o->ep_given = true; });
    sub->add_option("--ep-format", o->ep_format,
                    "the EP experts' activation format: oracle (default), standard or batched");
    sub->add_option("--ep-rank", o->ep_rank, "(internal: the GPU launcher's child rank)")
        ->group("");
    sub->add_option("--ep-unique-id", o->ep_unique_id, "(internal: the NCCL unique id, hex)")
        ->group("");
    sub->add_flag("--json", o->json, "machine-readable output");
    sub->callback([o] { run_run(*o); });
  }
  {
    auto o = std::make_shared<BenchOptions>();
    CLI::App* sub = app.add_subcommand(
        "bench",
        "Time MoE layers over a token sweep: a checkpoint, or presets with random weights at the "
        "real shapes; bytes/s and FLOP/s against the ceilings measured in the same run");
    sub->add_option("MODEL_DIR", o->model, "checkpoint folder (or use --preset)");
    sub->add_option("--preset", o->presets, "comma list of presets, or 'all' (see --list-presets)");
    sub->add_flag("--list-presets", o->list, "list the presets and exit");
    sub->add_option("--tokens", o->tokens, "comma list of token counts (default 1,8,64)");
    sub->add_option("--backend", o->backends,
                    "comma list: oracle (default), ref, an fp8moe implementation name, or a vLLM "
                    "--moe-backend name (the plan then uses that backend)");
    sub->add_option("--layer", o->layer, "decoder layer of MODEL_DIR (default: the first MoE one)");
    sub->add_option("--tp", o->tp, "tensor-parallel size for MODEL_DIR (default 1)");
    sub->add_option("--rank", o->rank, "rank for MODEL_DIR (default 0)");
    sub->add_flag("--enable-ep", o->enable_ep, "the --tp ranks are EP ranks (MODEL_DIR)");
    sub->add_option("--ep", o->ep,
                    "time all N EP ranks as simulated ranks (threads over the in-process "
                    "communicator): the slowest rank per layer call and the dispatch/combine "
                    "share; presets: --max-weight-mib is for all ranks together")
        ->each([o](const std::string&) { o->ep_given = true; });
    sub->add_option("--moe-backend", o->moe_backend, "vLLM --moe-backend (default auto)");
    sub->add_option("--dtype", o->dtype, "activation dtype: bf16 (default) or f32");
    sub->add_option("--min-time", o->min_time, "seconds of timed runs per row (default 0.5)");
    sub->add_option("--min-reps", o->min_reps, "at least this many timed runs (default 3)");
    sub->add_option("--max-reps", o->max_reps, "at most this many timed runs (default 50)");
    sub->add_option("--max-weight-mib", o->max_weight_mib,
                    "presets: scale the expert count down so one rank's fp8 weights fit (default "
                    "1024)");
    sub->add_option("--seed", o->seed, "seed of the random inputs and weights (default 0)");
    sub->add_flag("--no-ceilings", o->no_ceilings, "skip measuring the CPU ceilings");
    sub->add_option("--env", o->env,
                    "NAME=VALUE for a vLLM variable the oracle reads (repeatable)");
    sub->add_flag("--ignore-environment", o->ignore_environment,
                  "do not read the vLLM variables from this process's environment");
    sub->add_flag("--json", o->json, "machine-readable output");
    sub->add_flag("--csv", o->csv, "CSV output (one header line, one line per row)");
    sub->callback([o] { run_bench(*o); });
  }
}

}  // namespace fp8moe::cli
