// fp8moe {plan, make-example, inspect, shard}: checkpoints on the command line.
//
//   plan MODEL        will this checkpoint run with this layout, with which kernel, how much memory
//                     per GPU, how fast at best (the roofline floor on a spec-sheet card)? From
//                     config.json and the safetensors headers only. Exit status 0
//                     when every MoE layer works, 1 when one does not (the plan says why), 2 on
//                     errors.
//   make-example DIR  the small example checkpoint (Qwen3-MoE-shaped, real formats).
//   inspect PATH      the tensors of a .safetensors file or a model folder, validated.
//   shard MODEL       one rank's experts of one layer, sharded exactly as planned, as a safetensors
//                     file (for checking, and for engines that want pre-sharded weights).
#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <iostream>
#include <string>
#include <vector>

#include "checkpoint/checkpoint_internal.hpp"
#include "cli_common.hpp"
#include "fp8moe/checkpoint.hpp"
#include "fp8moe/error.hpp"
#include "fp8moe/oracle.hpp"
#include "fp8moe/roofline.hpp"
#if FP8MOE_WITH_CUDA
#include "kernels/cuda/fused_moe_cuda.hpp"
#endif

namespace fp8moe::cli {
namespace {

using nlohmann::ordered_json;

void print_ordered(const ordered_json& j) { std::cout << j.dump(2) << "\n"; }

int parse_int(const std::string& opt, const std::string& text, int min_value) {
  std::size_t pos = 0;
  long long v = 0;
  bool ok = !text.empty();
  try {
    v = std::stoll(text, &pos);
  } catch (const std::exception&) {
    ok = false;
  }
  if (!ok || pos != text.size() || v < min_value || v > 1'000'000'000LL) {
    throw ValueError(fmt::format("{} expects an integer >= {}, got '{}'", opt, min_value, text));
  }
  return static_cast<int>(v);
}

std::vector<int> parse_int_list(const std::string& opt, const std::string& text) {
  std::vector<int> out;
  std::size_t start = 0;
  while (start <= text.size()) {
    const std::size_t end = std::min(text.find(',', start), text.size());
    out.push_back(parse_int(opt, text.substr(start, end - start), 1));
    start = end + 1;
  }
  return out;
}

std::string human_bytes(uint64_t b) {
  const double x = static_cast<double>(b);
  if (b >= (1ull << 30)) return fmt::format("{:.2f} GiB", x / (1ull << 30));
  if (b >= (1ull << 20)) return fmt::format("{:.1f} MiB", x / (1ull << 20));
  if (b >= (1ull << 10)) return fmt::format("{:.1f} KiB", x / (1ull << 10));
  return fmt::format("{} B", b);
}

// "3-60" / "1,3,5,...,47 (every 2nd)" / "0,4,7"
std::string layer_ranges(const std::vector<int>& v) {
  if (v.empty()) return "none";
  bool contiguous = true, stepped = v.size() > 2;
  for (std::size_t i = 1; i < v.size(); ++i) {
    contiguous = contiguous && v[i] == v[i - 1] + 1;
    stepped = stepped && v[i] - v[i - 1] == v[1] - v[0];
  }
  if (v.size() == 1) return std::to_string(v[0]);
  if (contiguous) return fmt::format("{}-{}", v.front(), v.back());
  if (stepped) return fmt::format("{}-{} every {}", v.front(), v.back(), v[1] - v[0]);
  std::string s;
  for (int x : v) s += fmt::format("{}{}", s.empty() ? "" : ",", x);
  return s;
}

std::string block_text(const std::optional<std::array<int64_t, 2>>& b) {
  return b ? fmt::format("{}x{}", (*b)[0], (*b)[1]) : "-";
}

// ---- options shared by plan and shard
// -------------------------------------------------------------

struct DeployOptions {
  std::string model;
  std::string tp = "1", dp = "1", pcp = "1", ep;
  bool enable_ep = false;
  bool tp_given = false;
  std::string all2all_backend = "allgather_reducescatter";
  std::string platform, installed;
  std::string moe_backend = "auto";
  std::string dtype;
  bool lora = false;
  std::vector<std::string> env;
  bool ignore_environment = false;
  bool config_only = false;
  bool json = false;
};

void add_deploy_options(CLI::App* sub, DeployOptions& o) {
  sub->add_option("MODEL", o.model,
                  "model folder (config.json, plus safetensors headers when present) or a bare "
                  "config.json")
      ->required();
  sub->add_option("--tp", o.tp, "tensor_parallel_size (default 1)");
  sub->add_option("--dp", o.dp, "data_parallel_size (default 1)");
  sub->add_option("--pcp", o.pcp, "prefill context parallel size (default 1)");
  sub->add_option("--ep", o.ep,
                  "expert-parallel size: implies --enable-ep and must equal dp*pcp*tp (without "
                  "--tp it sets tp = ep/(dp*pcp))");
  sub->add_flag("--enable-ep", o.enable_ep,
                "enable_expert_parallel (dp*pcp*tp ranks become EP ranks)");
  sub->add_option("--all2all-backend", o.all2all_backend,
                  "all2all backend (default allgather_reducescatter)");
  sub->add_option(
      "--platform", o.platform,
      "simulated vLLM platform: cuda:90 (H100/H200), cuda:100 (B200), cpu, rocm:gfx942, "
      "... (default: this machine)");
  sub->add_option("--installed", o.installed,
                  "kernel families installed on the simulated platform: all (default), none, or a "
                  "comma list (deep_gemm, flashinfer_trtllm, flashinfer_cutlass, humming, ...)");
  sub->add_option(
      "--moe-backend", o.moe_backend,
      "vLLM --moe-backend: auto (default), triton, deep_gemm, cutlass, flashinfer_trtllm, "
      "flashinfer_cutlass, marlin, humming, aiter, hpc");
  sub->add_option("--dtype", o.dtype, "activation dtype (default: the model's torch_dtype)");
  sub->add_flag("--lora", o.lora, "LoRA enabled");
  sub->add_option("--env", o.env, "NAME=VALUE for a vLLM variable the oracle reads (repeatable)");
  sub->add_flag("--ignore-environment", o.ignore_environment,
                "ignore the vLLM variables of the process environment");
  sub->add_flag("--config-only", o.config_only, "do not read the safetensors headers");
  sub->add_flag("--json", o.json, "machine-readable output");
}

Platform make_platform(const DeployOptions& o) {
  if (o.platform.empty()) {
    if (!o.installed.empty()) {
      throw ValueError(fmt::format(
          "--installed '{}' applies to a simulated platform: give --platform too", o.installed));
    }
    return Platform::detect();
  }
  Platform p = Platform::parse(o.platform);
  if (!o.installed.empty()) p.set_installed(o.installed);
  return p;
}

OracleEnv make_env(const DeployOptions& o) {
  OracleEnv env = o.ignore_environment ? OracleEnv() : OracleEnv::from_environment();
  for (const auto& pair : OracleEnv::from_pairs(o.env).pairs()) {
    const auto eq = pair.find('=');
    env.set(pair.substr(0, eq), pair.substr(eq + 1));
  }
  return env;
}

PlanOptions make_plan_options(const DeployOptions& o, const std::string& tp_text) {
  PlanOptions p;
  p.parallel.tp = parse_int("--tp", tp_text, 1);
  p.parallel.dp = parse_int("--dp", o.dp, 1);
  p.parallel.pcp = parse_int("--pcp", o.pcp, 1);
  p.parallel.ep = o.ep.empty() ? 0 : parse_int("--ep", o.ep, 1);
  p.parallel.tp_given = o.tp_given;
  p.parallel.enable_ep = o.enable_ep;
  p.parallel.all2all_backend = o.all2all_backend;
  p.moe_backend = o.moe_backend;
  for (auto& c : p.moe_backend) {
    // KernelConfig.moe_backend's validator: value.lower().replace("-", "_").
    c = c == '-' ? '_' : static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  }
  if (!o.dtype.empty()) p.act_dtype = parse_dtype(o.dtype);
  p.lora = o.lora;
  return p;
}

struct LoadedModel {
  ModelConfig config;
  std::optional<SafetensorsCheckpoint> ckpt;
  std::string weights_note;
};

LoadedModel load_model(const DeployOptions& o) {
  LoadedModel lm;
  lm.config = load_model_config(o.model);
  if (path_is_dir(o.model) && !o.config_only) {
    const bool has_weights = path_is_file(path_join(o.model, "model.safetensors.index.json")) ||
                             path_is_file(path_join(o.model, "model.safetensors"));
    if (has_weights) {
      lm.ckpt = SafetensorsCheckpoint::open(o.model);
    } else {
      lm.weights_note = "no safetensors in the folder: planned from config.json alone";
    }
  } else {
    lm.weights_note = o.config_only ? "--config-only: planned from config.json alone"
                                    : "a bare config.json: planned from it alone";
  }
  return lm;
}

// ---- plan
// ---------------------------------------------------------------------------------------------

// "12,345"
std::string thousands(double v) {
  std::string d = fmt::format("{:.0f}", v), out;
  for (std::size_t i = 0; i < d.size(); ++i) {
    if (i > 0 && (d.size() - i) % 3 == 0) out += ',';
    out += d[i];
  }
  return out;
}

// 0.1 us resolution (as spec/models.md's table) from 10 us up, 3 digits below.
std::string us_text(double us) {
  if (us >= 10) return fmt::format("{:.1f}", us);
  if (us >= 0.1) return fmt::format("{:.2f}", us);
  return fmt::format("{:.3g}", us);
}

std::string human_us(double s) {
  if (s >= 1e-3) return fmt::format("{:.2f} ms", s * 1e3);
  return fmt::format("{:.4g} us", s * 1e6);
}

void print_roofline_human(const ModelPlan& p, const ShapePlan& s) {
  if (!s.roofline) {
    std::cout << fmt::format(
        "  speed (roofline) {}\n",
        p.card ? "not estimated: the per-GPU layout is unknown" : "no card: " + p.card_note);
    return;
  }
  const ShapeRoofline& R = *s.roofline;
  const RooflineLayer& L = R.layer;
  std::cout << fmt::format(
      "  speed (roofline) LOWER BOUND per GPU{} on {}: no kernel is faster than this; fp8moe's "
      "measured kernels: see `fp8moe bench` / docs/PERFORMANCE.md\n",
      s.ok ? "" : " (if it ran)", p.card->describe());
  std::cout << fmt::format("    layout      {}\n", R.layout);
  std::cout << fmt::format(
      "    model       per layer max(bytes / {:.3g} TB/s, FLOPs / {:.0f} TFLOP/s dense {}); "
      "uniform "
      "random routing (expected experts touched); each touched expert's w13 + w2 + scales read "
      "once ({:.2f} MiB); bf16 activations in/out and bf16 intermediates (gate/up + activated "
      "rows)\n",
      p.card->hbm_bytes_per_s / 1e12,
      (L.fp8_compute ? p.card->fp8_flops : p.card->bf16_flops) / 1e12,
      L.fp8_compute ? "FP8" : "BF16", (L.expert_weight_bytes + L.expert_scale_bytes) / (1 << 20));
  if (L.useful_intermediate < static_cast<double>(L.intermediate)) {
    std::cout << fmt::format(
        "    padding     {:.1f}% of the weight bytes and FLOPs go to padded rows: {} rows per GPU "
        "for "
        "{:.4g} real ones (+{:.1f}% of both)\n",
        100 * (1 - L.useful_intermediate / static_cast<double>(L.intermediate)), L.intermediate,
        L.useful_intermediate,
        100 * (static_cast<double>(L.intermediate) / L.useful_intermediate - 1));
  }
  std::cout << fmt::format("    {:>7}  {:>8}  {:>10}  {:>11}  {:>9}  {:<7}  {:>12}  {:>12}\n", "M",
                           "experts", "MB/layer", "GFLOP/layer", "us/layer", "bound",
                           fmt::format("{} layers", R.num_layers), "tok/s (<=)");
  for (std::size_t i = 0; i < R.points.size(); ++i) {
    const RooflinePoint& q = R.points[i];
    double step = 0;
    const bool complete = p.moe_step_s(i, step);
    std::cout << fmt::format(
        "    {:>7}  {:>8.1f}  {:>10.4g}  {:>11.4g}  {:>9}  {:<7}  {:>12}  {:>12}\n", q.tokens,
        q.experts_touched, q.bytes / 1e6, q.flops / 1e9, us_text(q.floor_s * 1e6),
        q.compute_bound ? "compute" : "memory", human_us(q.floor_s * R.num_layers),
        complete && step > 0 ? thousands(static_cast<double>(q.moe_tokens) / step) : "-");
  }
  std::cout << fmt::format(
      "    M: tokens per forward of one DP group; tok/s: (M x {} DP group(s)) / the MoE layers' "
      "floor{} (attention, dense layers and communication not counted)\n",
      L.token_factor, p.shapes.size() > 1 ? " of every MoE shape" : "");
}

void print_plan_human(const ModelPlan& p, const LoadedModel& lm) {
  const ModelConfig& m = p.model;
  std::cout << fmt::format("{} ({})\n", m.source, m.model_type);
  std::cout << fmt::format(
      "  model         {} MoE layers ({}) x {} experts, top-{}, hidden {}, expert intermediate {}, "
      "{} routing, {}\n",
      m.moe_layers.size(), layer_ranges(m.moe_layers), m.num_experts, m.num_experts_per_tok,
      m.hidden_size, m.moe_intermediate_size, routing_method_name(m.routing_method),
      activation_value(m.activation));
  std::cout << fmt::format("  quantisation  {}{}\n", m.quant.describe(),
                           m.quant.moe_method.empty() ? "" : " -> " + m.quant.moe_method);
  if (p.headers_read) {
    std::cout << fmt::format(
        "  checkpoint    {} shard(s), {} tensors, {} of data; headers only (weight bytes read: "
        "{})\n",
        p.checkpoint_shards, p.checkpoint_tensors, human_bytes(p.checkpoint_bytes),
        p.weight_bytes_read ? "YES" : "none");
  } else {
    std::cout << fmt::format("  checkpoint    {}\n", lm.weights_note);
  }
  std::cout << fmt::format("  platform      {}\n", p.platform);
  if (!p.error.empty()) {
    std::cout << fmt::format("  parallel      invalid: {}\n", p.error);
    return;
  }
  std::cout << fmt::format("  parallel      {} GPU(s): {}\n", p.world_size, p.parallel);
  for (const ShapePlan& s : p.shapes) {
    const MoeConfig& c = s.moe_config;
    std::cout << fmt::format("\nMoE layers {} ({} layer(s)): E={} top-{} H={} I={}",
                             layer_ranges(s.layers), s.layers.size(), s.num_experts, s.topk,
                             s.hidden, s.intermediate);
    if (s.failed_step != "parallel") {
      std::cout << fmt::format(" -> per rank: {} experts, I={}", c.num_local_experts,
                               c.intermediate_size_per_partition);
    }
    std::cout << "\n";
    if (!s.checkpoint.empty()) std::cout << fmt::format("  checkpoint    {}\n", s.checkpoint);
    if (s.failed_step == "parallel") {
      std::cout << fmt::format("  result        invalid layout: {}: {}\n", s.error_kind,
                               s.error_message);
      continue;
    }
    if (s.failed_step == "fp8") {
      std::cout << fmt::format("  result        does not run through the FP8 MoE oracle: {}: {}\n",
                               s.error_kind, s.error_message);
      continue;
    }
    if (s.resolution != "none") {
      std::cout << fmt::format("  blocks        {} ({} -> {}): {}\n", s.resolution,
                               block_text(s.checkpoint_block), block_text(s.block),
                               s.resolution_why);
    }
    std::cout << fmt::format("  keys          W {}  A {}  allow_vllm_cutlass={}\n",
                             quant_key_name(s.weight_key), quant_key_name(s.activation_key),
                             s.allow_vllm_cutlass ? "True" : "False");
    if (s.selected) {
      const ExpertsKernel* k = s.selection.kernel;
      std::cout << fmt::format("  backend       {} / {} ({}){}\n",
                               backend_value(s.selection.backend), k ? k->name : "no experts class",
                               s.selection.path,
                               k && k->impl_name ? fmt::format("; fp8moe kernel '{}'", k->impl_name)
                                                 : (k ? "; no fp8moe implementation" : ""));
    }
    if (!s.selection.candidates.empty()) {
      std::cout << "  candidates    " << python_list_repr(s.selection.candidates) << "\n";
    }
    for (const auto& n : s.selection.notes) std::cout << "  oracle note   " << n << "\n";
    bool header = false;
    for (const auto& t : s.selection.trace) {
      if (t.supported) continue;
      if (!header) std::cout << "  rejected\n";
      header = true;
      std::cout << fmt::format("    {:<20} {:<28} {}\n", backend_value(t.backend), t.kernel,
                               t.reason);
    }
    if (!s.quant_config.empty()) {
      std::cout << fmt::format("  quant config  {}{}\n", s.quant_config,
                               s.quant_config_name.empty() ? "" : " [" + s.quant_config_name + "]");
    }
    if (!s.ranks.empty()) {
      const RankMemory& r0 =
          *std::max_element(s.ranks.begin(), s.ranks.end(), [](auto& a, auto& b) {
            return a.weight_bytes + a.scale_bytes < b.weight_bytes + b.scale_bytes;
          });
      std::cout << fmt::format(
          "  memory        {} of expert weights per GPU ({} layer(s) x {}: {} experts x [w13 {}x{} "
          "+ w2 "
          "{}x{}] = {} weights + {} scales)\n",
          human_bytes(s.max_rank_bytes), s.layers.size(), human_bytes(s.max_rank_bytes_per_layer),
          r0.num_local_experts, 2 * r0.local_intermediate, s.hidden, s.hidden,
          r0.local_intermediate, human_bytes(r0.weight_bytes), human_bytes(r0.scale_bytes));
      bool uneven = false;
      for (const auto& r : s.ranks) {
        uneven = uneven || r.num_local_experts != r0.num_local_experts ||
                 r.valid_intermediate != r.local_intermediate;
      }
      if (uneven) {
        std::cout << "  ranks        ";
        for (const auto& r : s.ranks) {
          std::cout << fmt::format(" {}:{}e/{}rows", r.rank, r.num_local_experts,
                                   r.valid_intermediate);
        }
        std::cout << "  (real rows per rank; padding fills the rest)\n";
      }
    }
    std::cout << fmt::format(
        "  padding FLOPs {}\n",
        s.padded ? fmt::format("+{:.1f}% per routed token ({:.3g} executed vs "
                               "{:.3g} useful FLOPs per token-expert per layer)",
                               100 * s.padding_overhead(), s.executed_flops, s.useful_flops)
                 : std::string("none"));
    for (const auto& n : s.notes) std::cout << "  note          " << n << "\n";
    print_roofline_human(p, s);
    if (!s.ok) {
      std::cout << fmt::format("  result        FAILS at {}: {}: {}\n", s.failed_step, s.error_kind,
                               s.error_message);
    }
  }
  std::cout << "\n";
  if (p.ok()) {
    const ShapePlan& s = p.shapes.front();
    std::cout << fmt::format(
        "Verdict: runs on {} GPU(s) with {} ({}); {} of routed-expert weights per GPU.\n",
        p.world_size, backend_value(s.selection.backend),
        s.selection.kernel ? s.selection.kernel->name : "-", human_bytes(p.max_rank_bytes()));
  } else {
    std::cout << "Verdict: does NOT run as configured (see the failing step above).\n";
  }
}

struct PlanCommand {
  DeployOptions o;
  std::string sweep;
  std::string card, card_bw, card_fp8, tokens;
};

double parse_positive(const std::string& opt, const std::string& text, const char* unit) {
  std::size_t pos = 0;
  double v = 0;
  bool ok = !text.empty();
  try {
    v = std::stod(text, &pos);
  } catch (const std::exception&) {
    ok = false;
  }
  if (!ok || pos != text.size() || !std::isfinite(v) || v <= 0) {
    throw ValueError(
        fmt::format("{} expects a positive, finite number of {}, got '{}'", opt, unit, text));
  }
  return v;
}

// The card of the roofline: --card-bw/--card-fp8, --card, the detected GPU, or the simulated
// platform's usual card (H200 for cuda:90, B200 for cuda:100). None: card_note says which flag
// gives one.
void resolve_card(const PlanCommand& c, const Platform& platform, PlanOptions& po) {
  const std::string flags = fmt::format(
      "give --card NAME ({}) or --card-bw TB/s --card-fp8 TFLOP/s", known_gpu_card_names());
  if (!c.card_bw.empty() || !c.card_fp8.empty()) {
    if (!c.card.empty()) {
      throw ValueError("--card and --card-bw/--card-fp8 exclude each other: give one card");
    }
    if (c.card_bw.empty() || c.card_fp8.empty()) {
      throw ValueError("a custom card needs both --card-bw TB/s and --card-fp8 TFLOP/s");
    }
    po.card = custom_gpu_card(parse_positive("--card-bw", c.card_bw, "TB/s"),
                              parse_positive("--card-fp8", c.card_fp8, "TFLOP/s"));
    return;
  }
  if (!c.card.empty()) {
    po.card = gpu_card(c.card);
    return;
  }
  if (platform.detected()) {
    std::string device;
#if FP8MOE_WITH_CUDA
    if (platform.is_cuda()) device = cuda::device_name();
#endif
    if (device.empty()) {
      po.card_note = fmt::format("no GPU card for this machine ({}): {}", platform.str(), flags);
    } else if (const GpuCard* k = gpu_card_for_device(device)) {
      po.card = *k;
    } else {
      po.card_note =
          fmt::format("the detected GPU '{}' is not in the card table: {}", device, flags);
    }
    return;
  }
  if (const GpuCard* k = default_gpu_card(platform)) {
    po.card = *k;
    return;
  }
  po.card_note = fmt::format("no default card for {}: {}", platform.str(), flags);
}

std::vector<int64_t> parse_tokens(const std::string& text) {
  if (text.empty()) return default_roofline_tokens();
  std::vector<int64_t> out;
  for (int t : parse_int_list("--tokens", text)) out.push_back(t);
  return out;
}

ordered_json sweep_row_json(int tp, const ModelPlan& p) {
  ordered_json row;
  row["tp"] = tp;
  row["ok"] = p.ok();
  if (!p.error.empty()) row["error"] = p.error;
  if (!p.shapes.empty()) {
    const ShapePlan& s = p.shapes.front();
    row["resolution"] = s.resolution;
    row["block"] = s.block ? ordered_json({(*s.block)[0], (*s.block)[1]}) : ordered_json(nullptr);
    row["backend"] =
        s.selected ? ordered_json(backend_value(s.selection.backend)) : ordered_json(nullptr);
    row["kernel"] = s.selected && s.selection.kernel ? ordered_json(s.selection.kernel->name)
                                                     : ordered_json(nullptr);
    row["intermediate_per_partition"] = s.moe_config.intermediate_size_per_partition;
    row["padding_overhead"] = s.padding_overhead();
    if (!s.ok)
      row["failure"] = {
          {"step", s.failed_step}, {"kind", s.error_kind}, {"message", s.error_message}};
  }
  row["max_rank_expert_bytes"] = p.max_rank_bytes();
  return row;
}

void run_plan(PlanCommand& c) {
  json_output() = c.o.json;
  const Platform platform = make_platform(c.o);
  const OracleEnv env = make_env(c.o);
  const LoadedModel lm = load_model(c.o);
  const SafetensorsCheckpoint* ck = lm.ckpt ? &*lm.ckpt : nullptr;
  if (c.sweep.empty()) {
    PlanOptions po = make_plan_options(c.o, c.o.tp);
    po.roofline_tokens = parse_tokens(c.tokens);
    resolve_card(c, platform, po);
    const ModelPlan p = plan_model(lm.config, ck, po, platform, env);
    if (c.o.json) {
      ordered_json j = plan_to_json(p);
      if (!lm.weights_note.empty()) j["checkpoint_note"] = lm.weights_note;
      print_ordered(j);
    } else {
      print_plan_human(p, lm);
    }
    exit_status() = p.ok() ? 0 : 1;
    return;
  }
  // --sweep-tp: one row per TP size (no roofline: one plan gives it).
  if (!c.card.empty() || !c.card_bw.empty() || !c.card_fp8.empty() || !c.tokens.empty()) {
    throw ValueError(
        "--card, --card-bw, --card-fp8 and --tokens set the roofline of one plan; --sweep-tp "
        "has none: drop one or the other");
  }
  const std::vector<int> tps = parse_int_list("--sweep-tp", c.sweep);
  ordered_json rows = ordered_json::array();
  bool any = false;
  // With --ep / --enable-ep each swept size is the flattened dp*pcp*tp group, all of it EP ranks.
  const bool ep_sweep = !c.o.ep.empty() || c.o.enable_ep;
  if (!c.o.json) {
    std::cout << fmt::format("{} ({}) on {}{}\n", lm.config.source, lm.config.model_type,
                             platform.describe(),
                             c.o.moe_backend == "auto" ? "" : ", --moe-backend " + c.o.moe_backend);
    if (ep_sweep) std::cout << "  (expert parallel: each size is the number of EP ranks)\n";
    std::cout << fmt::format("  {:>4}  {:<5}  {:>6}  {:<16}  {:<18}  {:<28}  {:>12}  {}\n",
                             ep_sweep ? "EP" : "TP", "works", "I/rank", "blocks", "backend",
                             "kernel", "experts/GPU", "why not / notes");
  }
  for (int tp : tps) {
    DeployOptions o = c.o;
    o.tp_given = true;
    if (ep_sweep) {
      o.ep.clear();
      o.enable_ep = true;
    }
    const ModelPlan p =
        plan_model(lm.config, ck, make_plan_options(o, std::to_string(tp)), platform, env);
    any = any || p.ok();
    if (c.o.json) {
      rows.push_back(sweep_row_json(tp, p));
      continue;
    }
    if (!p.error.empty() || p.shapes.empty()) {
      std::cout << fmt::format("  {:>4}  {:<5}  {}\n", tp, "no", p.error);
      continue;
    }
    const ShapePlan& s = p.shapes.front();
    std::string why;
    if (!s.ok) {
      why = fmt::format("{} at {}: {}", s.error_kind, s.failed_step, s.error_message);
    } else if (s.padded) {
      why = fmt::format("padding +{:.0f}% FLOPs", 100 * s.padding_overhead());
    }
    std::string blocks = s.resolution == "none" ? "-" : s.resolution;
    if (s.block && s.resolution != "none") blocks += " " + block_text(s.block);
    const int64_t ipp = s.moe_config.intermediate_size_per_partition;
    std::cout << fmt::format("  {:>4}  {:<5}  {:>6}  {:<16}  {:<18}  {:<28}  {:>12}  {}\n", tp,
                             p.ok() ? "yes" : "no", ipp > 0 ? std::to_string(ipp) : "-", blocks,
                             s.selected ? backend_value(s.selection.backend) : "-",
                             s.selected && s.selection.kernel ? s.selection.kernel->name : "-",
                             s.ranks.empty() ? "-" : human_bytes(p.max_rank_bytes()), why);
  }
  if (c.o.json) {
    ordered_json j;
    j["model"] = lm.config.source;
    j["platform"] = platform.describe();
    j["moe_backend"] = c.o.moe_backend;
    j["sweep"] = rows;
    print_ordered(j);
  }
  exit_status() = any ? 0 : 1;
}

// ---- make-example
// -------------------------------------------------------------------------------------

struct ExampleCommand {
  std::string dir;
  std::string seed = "0", hidden = "256", intermediate = "640", experts = "8", topk = "2",
              layers = "2", block = "128";
  bool ue8m0 = false;
  bool json = false;
};

void run_make_example(const ExampleCommand& c) {
  json_output() = c.json;
  ExampleCheckpointSpec spec;
  spec.seed = static_cast<uint64_t>(parse_int("--seed", c.seed, 0));
  spec.hidden = parse_int("--hidden", c.hidden, 1);
  spec.intermediate = parse_int("--intermediate", c.intermediate, 1);
  spec.experts = parse_int("--experts", c.experts, 1);
  spec.topk = parse_int("--topk", c.topk, 1);
  spec.layers = parse_int("--layers", c.layers, 1);
  spec.block = parse_int("--block", c.block, 1);
  spec.ue8m0 = c.ue8m0;
  const std::vector<std::string> files = write_example_checkpoint(c.dir, spec);
  if (c.json) {
    print_ordered({{"dir", c.dir}, {"files", files}, {"seed", spec.seed}});
    return;
  }
  std::cout << fmt::format(
      "Wrote a Qwen3-MoE-shaped FP8 checkpoint to {}: {} layers x {} experts (top-{}), hidden {}, "
      "expert intermediate {}, {}x{} blocks{}, seed {}\n",
      c.dir, spec.layers, spec.experts, spec.topk, spec.hidden, spec.intermediate, spec.block,
      spec.block, spec.ue8m0 ? " (ue8m0 scales)" : "", spec.seed);
  for (const auto& f : files) std::cout << "  " << f << "\n";
  std::cout << fmt::format("Next: fp8moe plan {} --tp 4 --platform cuda:90\n", c.dir);
}

// ---- inspect
// ------------------------------------------------------------------------------------------

struct InspectCommand {
  std::string path;
  std::string filter;
  bool hash = false;
  bool json = false;
};

uint64_t fnv1a64(std::span<const uint8_t> bytes) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (uint8_t b : bytes) h = (h ^ b) * 0x100000001b3ull;
  return h;
}

void run_inspect(const InspectCommand& c) {
  json_output() = c.json;
  const SafetensorsCheckpoint ck = SafetensorsCheckpoint::open(c.path);
  ordered_json shards = ordered_json::array();
  for (const auto& s : ck.shards()) {
    ordered_json md = ordered_json::object();
    for (const auto& [k, v] : s.metadata()) md[k] = v;
    shards.push_back({{"path", s.path()},
                      {"file_bytes", s.file_size()},
                      {"header_bytes", s.header_size()},
                      {"tensors", s.tensors().size()},
                      {"metadata", md}});
  }
  ordered_json tensors = ordered_json::array();
  for (const std::string& name : ck.tensor_names()) {
    if (!c.filter.empty() && name.find(c.filter) == std::string::npos) continue;
    const SafetensorsTensor& t = ck.at(name);
    ordered_json o = {{"name", name},
                      {"dtype", t.dtype_name},
                      {"shape", t.shape},
                      {"data_offsets", {t.begin, t.end}},
                      {"shard", ck.shard_of(name).path()}};
    if (c.hash) o["fnv1a64"] = fmt::format("{:016x}", fnv1a64(ck.data(name)));
    tensors.push_back(o);
  }
  if (c.json) {
    print_ordered({{"root", ck.root()},
                   {"sharded", ck.sharded()},
                   {"data_bytes", ck.total_data_bytes()},
                   {"shards", shards},
                   {"tensors", tensors}});
    return;
  }
  std::cout << fmt::format("{}: {} tensor(s) in {} shard(s), {} of data, every header valid\n",
                           c.path, ck.num_tensors(), ck.shards().size(),
                           human_bytes(ck.total_data_bytes()));
  for (const auto& t : tensors) {
    std::cout << fmt::format("  {:<64} {:<8} {:<16}{}\n", t["name"].get<std::string>(),
                             t["dtype"].get<std::string>(), t["shape"].dump(),
                             t.contains("fnv1a64") ? "  " + t["fnv1a64"].get<std::string>() : "");
  }
}

// ---- shard
// --------------------------------------------------------------------------------------------

struct ShardCommand {
  DeployOptions o;
  std::string layer, rank = "0", out;
};

[[noreturn]] void rethrow_recorded(const ShapePlan& s) {
  const std::string msg =
      fmt::format("the plan for this layer fails at {}: {}", s.failed_step, s.error_message);
  if (s.error_kind == "NotImplementedError") throw NotImplementedError(msg);
  if (s.error_kind == "FormatError") throw FormatError(msg);
  throw ValueError(msg);
}

void run_shard(ShardCommand& c) {
  json_output() = c.o.json;
  const Platform platform = make_platform(c.o);
  const OracleEnv env = make_env(c.o);
  c.o.config_only = false;
  const LoadedModel lm = load_model(c.o);
  if (!lm.ckpt) throw ValueError(fmt::format("{}: shard needs the model's safetensors", c.o.model));
  const int layer = parse_int("--layer", c.layer, 0);
  const int rank = parse_int("--rank", c.rank, 0);
  const ModelPlan p =
      plan_model(lm.config, &*lm.ckpt, make_plan_options(c.o, c.o.tp), platform, env);
  if (!p.error.empty()) throw ValueError(p.error);
  const ShapePlan* shape = nullptr;
  for (const auto& s : p.shapes) {
    if (std::find(s.layers.begin(), s.layers.end(), layer) != s.layers.end()) shape = &s;
  }
  if (!shape) {
    throw ValueError(fmt::format("layer {} has no routed experts (MoE layers: {})", layer,
                                 layer_ranges(lm.config.moe_layers)));
  }
  if (!shape->ok) rethrow_recorded(*shape);
  const MoeParallelConfig& par = shape->moe_config.moe_parallel_config;
  const int world = par.use_ep ? par.ep_size : par.tp_size;
  if (rank >= world)
    throw ValueError(
        fmt::format("--rank {} is outside the {} rank(s) of this layout", rank, world));
  const TpShard tp = plan_tp_shard(*shape, par.use_ep ? 0 : rank);
  const ExpertPlacement ep =
      place_experts(lm.config.num_experts, par.use_ep ? par.ep_size : 1, par.use_ep ? rank : 0);
  const LoadedMoeLayer L = load_moe_layer(*lm.ckpt, lm.config, layer, tp, ep);

  SafetensorsWriter w;
  const std::string sfx = lm.config.quant.scale_kind == CheckpointScaleKind::kBlock
                              ? "weight_scale_inv"
                              : "weight_scale";
  w.add("w13_weight", L.w13);
  w.add("w2_weight", L.w2);
  w.add("w13_" + sfx, L.w13_scale);
  w.add("w2_" + sfx, L.w2_scale);
  if (L.w13_input_scale.defined()) {
    w.add("w13_input_scale", L.w13_input_scale);
    w.add("w2_input_scale", L.w2_input_scale);
  }
  w.add("expert_map", L.expert_map);
  std::vector<int32_t> local(ep.local_to_global.begin(), ep.local_to_global.end());
  w.add("local_experts", DType::kI32, {static_cast<int64_t>(local.size())},
        std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(local.data()), local.size() * 4));
  w.set_metadata("format", "fp8moe-shard");
  w.set_metadata("model", lm.config.source);
  w.set_metadata("layer", std::to_string(layer));
  w.set_metadata("mode", std::string(tp_shard_mode_name(tp.mode)));
  w.set_metadata("tp_size", std::to_string(tp.tp_size));
  w.set_metadata("tp_rank", std::to_string(tp.tp_rank));
  w.set_metadata("ep_size", std::to_string(ep.ep_size));
  w.set_metadata("ep_rank", std::to_string(ep.ep_rank));
  w.set_metadata("local_size", std::to_string(tp.local_size));
  w.set_metadata("valid_size", std::to_string(tp.valid_size()));
  w.set_metadata("block", fmt::format("{}x{}", tp.block[0], tp.block[1]));
  w.set_metadata("checkpoint_block",
                 fmt::format("{}x{}", tp.checkpoint_block[0], tp.checkpoint_block[1]));
  w.set_metadata("refine", fmt::format("{}x{}", tp.refine[0], tp.refine[1]));
  w.set_metadata("backend", backend_value(shape->selection.backend));
  w.write(c.out);
  if (c.o.json) {
    print_ordered({{"out", c.out},
                   {"layer", layer},
                   {"mode", std::string(tp_shard_mode_name(tp.mode))},
                   {"tp", {{"size", tp.tp_size}, {"rank", tp.tp_rank}}},
                   {"ep", {{"size", ep.ep_size}, {"rank", ep.ep_rank}}},
                   {"local_experts", local},
                   {"local_size", tp.local_size},
                   {"valid_size", tp.valid_size()},
                   {"block", {tp.block[0], tp.block[1]}},
                   {"tensors_read", L.tensors_read},
                   {"checkpoint_bytes_read", L.checkpoint_bytes_read}});
    return;
  }
  std::cout << fmt::format("Wrote {}: layer {}, {} rank {}/{} EP rank {}/{} ({} experts), {}\n",
                           c.out, layer, tp_shard_mode_name(tp.mode), tp.tp_rank, tp.tp_size,
                           ep.ep_rank, ep.ep_size, ep.num_local(), tp.describe());
}

}  // namespace

void add_checkpoint_commands(CLI::App& app) {
  {
    auto c = std::make_shared<PlanCommand>();
    CLI::App* sub = app.add_subcommand(
        "plan",
        "Will this checkpoint run with this layout, with which kernel, how much memory per GPU, "
        "how fast at best (roofline)? (config.json + safetensors headers; no weight is read)");
    add_deploy_options(sub, c->o);
    sub->add_option("--sweep-tp", c->sweep, "plan each TP size of a comma list (e.g. 1,2,4,8,16)");
    sub->add_option("--card", c->card,
                    "GPU card of the roofline (spec-sheet peaks): " + known_gpu_card_names() +
                        " (default: the detected GPU; H200 for --platform cuda:90, B200 for "
                        "cuda:100)");
    sub->add_option("--card-bw", c->card_bw,
                    "custom card: HBM bandwidth in TB/s (with --card-fp8)");
    sub->add_option("--card-fp8", c->card_fp8,
                    "custom card: dense FP8 tensor peak in TFLOP/s (with --card-bw)");
    sub->add_option("--tokens", c->tokens,
                    "roofline batch sizes, tokens per forward of one DP group (default "
                    "1,8,32,128,512,2048,8192)");
    sub->callback([c, sub] {
      c->o.tp_given = sub->count("--tp") > 0;
      run_plan(*c);
    });
  }
  {
    auto c = std::make_shared<ExampleCommand>();
    CLI::App* sub = app.add_subcommand(
        "make-example",
        "Write the small example checkpoint (Qwen3-MoE-shaped FP8, sharded safetensors)");
    sub->add_option("DIR", c->dir, "output folder (created if missing)")->required();
    sub->add_option("--seed", c->seed, "random seed (default 0)");
    sub->add_option("--hidden", c->hidden, "hidden size (default 256)");
    sub->add_option("--intermediate", c->intermediate, "expert intermediate size (default 640)");
    sub->add_option("--experts", c->experts, "routed experts (default 8)");
    sub->add_option("--topk", c->topk, "experts per token (default 2)");
    sub->add_option("--layers", c->layers, "MoE layers (default 2)");
    sub->add_option("--block", c->block, "weight block size (default 128)");
    sub->add_flag("--ue8m0", c->ue8m0, "power-of-two scales and scale_fmt ue8m0");
    sub->add_flag("--json", c->json, "machine-readable output");
    sub->callback([c] { run_make_example(*c); });
  }
  {
    auto c = std::make_shared<InspectCommand>();
    CLI::App* sub = app.add_subcommand(
        "inspect", "Validate and list the tensors of a .safetensors file or a model folder");
    sub->add_option("PATH", c->path, "a .safetensors file or a model folder")->required();
    sub->add_option("--filter", c->filter, "only tensors whose name contains this");
    sub->add_flag("--hash", c->hash, "FNV-1a 64 of each tensor's bytes (reads the data)");
    sub->add_flag("--json", c->json, "machine-readable output");
    sub->callback([c] { run_inspect(*c); });
  }
  {
    auto c = std::make_shared<ShardCommand>();
    CLI::App* sub = app.add_subcommand(
        "shard", "Write one rank's experts of one MoE layer, sharded exactly as planned");
    add_deploy_options(sub, c->o);
    sub->add_option("--layer", c->layer, "decoder layer index")->required();
    sub->add_option("--rank", c->rank, "TP rank (EP rank with expert parallelism); default 0");
    sub->add_option("-o,--out", c->out, "output .safetensors file")->required();
    sub->callback([c, sub] {
      c->o.tp_given = sub->count("--tp") > 0;
      run_shard(*c);
    });
  }
}

}  // namespace fp8moe::cli
