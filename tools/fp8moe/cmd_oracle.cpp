// fp8moe oracle {select, resolve-block, quant-config, support}: the FP8 MoE oracle on the command
// line. Every subcommand takes --json (machine output; errors become {"error", "message"}, exit 2).
// Without --json the output is for people: the choice, then why, then what was rejected and why.
//
// Values are taken as strings and parsed here, so that bad input (unknown names, zero or negative
// sizes, malformed NAME=VALUE) is one ValueError line naming the value and what was expected.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <iostream>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "cli_common.hpp"
#include "fp8moe/error.hpp"
#include "fp8moe/oracle.hpp"
#include "kernels/registry.hpp"

namespace fp8moe::cli {
namespace {

using nlohmann::ordered_json;

// Keys in the order they are set (cli_common's print_json takes a sorted nlohmann::json).
void print_ordered(const ordered_json& j) { std::cout << j.dump(2) << "\n"; }

// ---- value parsing
// --------------------------------------------------------------------------------

int parse_int_option(const std::string& opt, const std::string& text, int min_value) {
  std::size_t i = 0;
  while (i < text.size() && std::isspace(static_cast<unsigned char>(text[i]))) ++i;
  bool neg = false;
  if (i < text.size() && (text[i] == '+' || text[i] == '-')) neg = text[i++] == '-';
  long long v = 0;
  bool digits = false;
  for (; i < text.size() && std::isdigit(static_cast<unsigned char>(text[i])); ++i) {
    digits = true;
    if (v <= 1'000'000'000LL) v = v * 10 + (text[i] - '0');  // saturates past the limit
  }
  while (i < text.size() && std::isspace(static_cast<unsigned char>(text[i]))) ++i;
  const char* what = min_value > 0 ? "a positive integer" : "a non-negative integer";
  if (!digits || i != text.size()) {
    throw ValueError(fmt::format("{} expects {}, got '{}'", opt, what, text));
  }
  if (v > 1'000'000'000LL) {
    throw ValueError(
        fmt::format("{} expects {} no larger than 1000000000, got '{}'", opt, what, text));
  }
  if (neg) v = -v;
  if (v < min_value) throw ValueError(fmt::format("{} expects {}, got '{}'", opt, what, text));
  return static_cast<int>(v);
}

std::optional<double> parse_float_option(const std::string& opt, const std::string& text) {
  if (text.empty()) return std::nullopt;
  try {
    std::size_t pos = 0;
    const double v = std::stod(text, &pos);
    if (pos == text.size() && std::isfinite(v)) return v;
  } catch (const std::exception&) {
  }
  throw ValueError(fmt::format("{} expects a finite number, got '{}'", opt, text));
}

BlockShape parse_block(const std::string& opt, const std::string& text) {
  const auto x = text.find_first_of("xX,");
  if (x == std::string::npos) {
    throw ValueError(fmt::format(
        "{} expects BLOCK_NxBLOCK_K with positive integers (e.g. 128x128), got '{}'", opt, text));
  }
  try {
    return {parse_int_option(opt, text.substr(0, x), 1),
            parse_int_option(opt, text.substr(x + 1), 1)};
  } catch (const ValueError&) {
    throw ValueError(fmt::format(
        "{} expects BLOCK_NxBLOCK_K with positive integers (e.g. 128x128), got '{}'", opt, text));
  }
}

// A key on the platform: named constants and the generic "fp8:" form take the platform's FP8 dtype
// (vLLM builds the constants with FP8_DTYPE = current_platform.fp8_dtype()); an explicit
// fp8_e4m3fn: / fp8_e4m3fnuz: dtype is kept as written.
OptQuantKey parse_key(const std::string& text, const Platform& platform) {
  if (text.empty()) {
    // An empty value is a scripting slip, not vLLM's None: that one is spelled 'none'.
    throw ValueError(
        "empty quant key: expected a vLLM constant name (e.g. kFp8Static128BlockSym), 'none', or "
        "fp8:static|dynamic:RxC|tensor|token|channel");
  }
  OptQuantKey k = parse_quant_key(text);
  const bool explicit_dtype = text.rfind("fp8_e4m3", 0) == 0;
  return explicit_dtype ? k : with_fp8_dtype(k, platform.fp8_dtype());
}

// The constant name of a key in the platform's flavour ("kFp8Static128BlockSym [e4m3fnuz]").
std::string key_display(const OptQuantKey& k) {
  if (!k) return "none";
  const bool fnuz = k->dtype == KeyDType::kF8E4M3FNUZ;
  const std::string name = quant_key_name(with_fp8_dtype(k, KeyDType::kF8E4M3FN));
  if (name.rfind("QuantKey(", 0) == 0) return quant_key_name(k);
  return fnuz ? name + " [e4m3fnuz]" : name;
}

void check_no_extras(CLI::App* sub) {
  const auto extras = sub->remaining();
  if (!extras.empty()) {
    throw ValueError(fmt::format("unexpected argument '{}' for 'fp8moe oracle {}' (see --help)",
                                 extras.front(), sub->get_name()));
  }
}

// ---- the deployment options shared by select and support
// ------------------------------------------

struct DeploymentOptions {
  std::string platform, installed;
  std::string weight_key = "kFp8Static128BlockSym";
  std::string activation_key = "kFp8Dynamic128Sym";
  std::string moe_backend = "auto";
  bool allow_vllm_cutlass = false;
  std::string num_experts = "128", topk = "8", hidden = "2048", intermediate = "768";
  std::string tp = "1", dp = "1", ep, pcp = "1", sp = "1";
  bool enable_ep = false;
  std::string all2all_backend = "allgather_reducescatter";
  bool enable_eplb = false;
  std::string activation = "silu", routing_method = "Renormalize", router_logits_dtype,
              dtype = "bf16";
  bool lora = false, bias = false;
  std::string swiglu_limit, swiglu_alpha, swiglu_beta;
  std::vector<std::string> env;
  bool ignore_environment = false;
  bool json = false;
  bool tp_given = false;         // --tp appeared on the command line
  bool installed_given = false;  // --installed appeared (possibly with an empty value)
};

void add_platform_options(CLI::App* sub, DeploymentOptions& o) {
  sub->add_option("--platform", o.platform,
                  "Simulated vLLM platform: cpu, cpu:arm, cuda:90, cuda:100, cuda:120, "
                  "rocm:gfx942, rocm:gfx950, rocm:gfx1201, xpu (default: this machine)");
  sub->add_option("--installed", o.installed,
                  "Kernel families installed on the simulated platform: all (default), none, or a "
                  "comma list of deep_gemm, flashinfer_trtllm, flashinfer_cutlass, humming, hpc, "
                  "aiter, cutlass_group_gemm, amx_tile, amx_fp8")
      ->each([&o](const std::string&) { o.installed_given = true; });
}

void add_parallel_options(CLI::App* sub, DeploymentOptions& o) {
  sub->add_option("--tp", o.tp, "vLLM tensor_parallel_size (default 1)");
  sub->add_option("--dp", o.dp, "data_parallel_size (default 1)");
  sub->add_option("--pcp", o.pcp, "prefill context parallel size (default 1)");
  sub->add_option("--ep", o.ep,
                  "expert-parallel size: implies --enable-ep and must equal dp*pcp*tp (when --tp "
                  "is not given it becomes ep/(dp*pcp))");
  sub->add_flag("--enable-ep", o.enable_ep,
                "enable_expert_parallel: the flattened dp*pcp*tp ranks become EP ranks");
}

void add_deployment_options(CLI::App* sub, DeploymentOptions& o) {
  add_platform_options(sub, o);
  sub->add_option("--weight-key", o.weight_key,
                  "Weight QuantKey: a vLLM constant (kFp8Static128BlockSym, default), none, or "
                  "fp8:static:64x64 / fp8:static:tensor / fp8:static:channel");
  sub->add_option("--activation-key", o.activation_key,
                  "Activation QuantKey: kFp8Dynamic128Sym (default), kFp8DynamicTokenSym, none, "
                  "fp8:dynamic:1x128 ...");
  sub->add_option("--moe-backend", o.moe_backend,
                  "vLLM --moe-backend: auto (default), triton, deep_gemm, cutlass, "
                  "flashinfer_trtllm, flashinfer_cutlass, marlin, humming, aiter, hpc");
  sub->add_flag("--allow-vllm-cutlass", o.allow_vllm_cutlass,
                "allow_vllm_cutlass=True (compressed-tensors W8A8-FP8 passes it)");
  sub->add_option("--num-experts", o.num_experts, "global experts (default 128)");
  sub->add_option("--topk", o.topk, "experts per token (default 8)");
  sub->add_option("--hidden", o.hidden, "hidden size H (default 2048)");
  sub->add_option("--intermediate", o.intermediate,
                  "global per-expert intermediate size I (default 768)");
  add_parallel_options(sub, o);
  sub->add_option("--sp", o.sp, "sequence-parallel size (default 1)");
  sub->add_option("--all2all-backend", o.all2all_backend,
                  "all2all backend (default allgather_reducescatter; deepep_low_latency and "
                  "nixl_ep select the batched activation format)");
  sub->add_flag("--enable-eplb", o.enable_eplb, "expert-parallel load balancing");
  sub->add_option("--activation", o.activation, "MoEActivation value (default silu)");
  sub->add_option("--routing-method", o.routing_method,
                  "RoutingMethodType name or value (default Renormalize)");
  sub->add_option("--router-logits-dtype", o.router_logits_dtype,
                  "router logits dtype (default: the activation dtype)");
  sub->add_option("--dtype", o.dtype, "activation dtype (default bf16)");
  sub->add_flag("--lora", o.lora, "LoRA enabled");
  sub->add_flag("--bias", o.bias, "expert biases (has_bias)");
  sub->add_option("--swiglu-limit", o.swiglu_limit, "SwiGLU clamp limit");
  sub->add_option("--swiglu-alpha", o.swiglu_alpha, "SwiGLU alpha");
  sub->add_option("--swiglu-beta", o.swiglu_beta, "SwiGLU beta");
  sub->add_option("--env", o.env,
                  "NAME=VALUE for a vLLM variable (repeatable; overrides the process "
                  "environment)");
  sub->add_flag("--ignore-environment", o.ignore_environment,
                "ignore the vLLM variables of the process environment");
  sub->add_flag("--json", o.json, "machine-readable output");
}

Platform make_platform(const DeploymentOptions& o) {
  if (o.installed_given && o.installed.find_first_not_of(" \t") == std::string::npos) {
    throw ValueError(
        "--installed '' is empty: expected all, none, or a comma list of deep_gemm, "
        "flashinfer_trtllm, flashinfer_cutlass, humming, hpc, aiter, cutlass_group_gemm, "
        "amx_tile, amx_fp8");
  }
  if (o.platform.empty()) {
    if (!o.installed.empty()) {
      throw ValueError(fmt::format(
          "--installed '{}' applies to a simulated platform: give --platform too (the detected "
          "platform reports what this build really has)",
          o.installed));
    }
    return Platform::detect();
  }
  Platform p = Platform::parse(o.platform);
  if (!o.installed.empty()) p.set_installed(o.installed);
  return p;
}

OracleEnv make_env(const DeploymentOptions& o) {
  OracleEnv env = o.ignore_environment ? OracleEnv() : OracleEnv::from_environment();
  const OracleEnv given = OracleEnv::from_pairs(o.env);
  for (const auto& pair : given.pairs()) {
    const auto eq = pair.find('=');
    env.set(pair.substr(0, eq), pair.substr(eq + 1));
  }
  return env;
}

MoeParallelConfig make_parallel(const DeploymentOptions& o, const std::string& all2all, int sp_size,
                                bool enable_eplb) {
  const int dp = parse_int_option("--dp", o.dp, 1);
  const int pcp = parse_int_option("--pcp", o.pcp, 1);
  int tp = parse_int_option("--tp", o.tp, 1);
  bool enable_ep = o.enable_ep;
  if (!o.ep.empty()) {
    const int ep = parse_int_option("--ep", o.ep, 1);
    if (!o.tp_given && ep % (dp * pcp) == 0) tp = ep / (dp * pcp);
    if (ep != dp * pcp * tp) {
      throw ValueError(fmt::format(
          "--ep {} does not match dp*pcp*tp = {}*{}*{} = {}: vLLM's expert-parallel size is the "
          "flattened dp*pcp*tp",
          ep, dp, pcp, tp, dp * pcp * tp));
    }
    enable_ep = enable_ep || ep > 1;
  }
  const auto& known = known_all2all_backends();
  if (std::find(known.begin(), known.end(), all2all) == known.end()) {
    throw ValueError(fmt::format("unknown --all2all-backend '{}': expected one of {}", all2all,
                                 fmt::join(known, ", ")));
  }
  return MoeParallelConfig::make(tp, pcp, dp, sp_size, enable_ep, all2all, enable_eplb);
}

// Accepts vLLM's printed forms too: "MoEActivation.SILU", "RoutingMethodType.DeepSeekV3".
std::string strip_prefix(const std::string& s, std::string_view prefix) {
  return s.rfind(prefix, 0) == 0 ? s.substr(prefix.size()) : s;
}

MoeConfig make_config(const DeploymentOptions& o) {
  MoeConfig c;
  c.num_experts = parse_int_option("--num-experts", o.num_experts, 1);
  c.experts_per_token = parse_int_option("--topk", o.topk, 1);
  c.hidden_dim = parse_int_option("--hidden", o.hidden, 1);
  c.intermediate_size = parse_int_option("--intermediate", o.intermediate, 1);
  c.moe_parallel_config =
      make_parallel(o, o.all2all_backend, parse_int_option("--sp", o.sp, 1), o.enable_eplb);
  c.activation = activation_from_str(strip_prefix(o.activation, "MoEActivation."));
  c.routing_method = parse_routing_method(strip_prefix(o.routing_method, "RoutingMethodType."));
  c.in_dtype = parse_dtype(o.dtype);
  if (!o.router_logits_dtype.empty()) c.router_logits_dtype = parse_dtype(o.router_logits_dtype);
  c.moe_backend = o.moe_backend;
  for (auto& ch : c.moe_backend) {
    // KernelConfig.moe_backend's validator: value.lower().replace("-", "_").
    ch = ch == '-' ? '_' : static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  }
  c.is_lora_enabled = o.lora;
  c.has_bias = o.bias;
  c.swiglu_limit = parse_float_option("--swiglu-limit", o.swiglu_limit);
  c.swiglu_alpha = parse_float_option("--swiglu-alpha", o.swiglu_alpha);
  c.swiglu_beta = parse_float_option("--swiglu-beta", o.swiglu_beta);
  c.device = "cuda";
  c.post_init();
  return c;
}

// ---- JSON helpers
// ---------------------------------------------------------------------------------

ordered_json trace_json(const std::vector<TraceEntry>& trace) {
  ordered_json t = ordered_json::array();
  for (const auto& e : trace) {
    t.push_back({{"backend", backend_value(e.backend)},
                 {"kernel", e.kernel},
                 {"supported", e.supported},
                 {"reason", e.supported ? ordered_json(nullptr) : ordered_json(e.reason)}});
  }
  return t;
}

std::string implementation_line(const ExpertsKernel* k, const Platform& platform) {
  if (!k) return "no experts kernel";
  if (!k->impl_name) {
    return fmt::format("fp8moe has no implementation of {}{}", k->name,
                       platform.detected() ? "" : " (the choice is a simulation of vLLM)");
  }
  const ExpertsImpl* impl = find_experts_impl(k->impl_name);
  if (!impl) {
    return fmt::format("runs as fp8moe's '{}' kernel, which is not in this build", k->impl_name);
  }
  const bool avail = !impl->available || impl->available();
  return fmt::format("runs as fp8moe's '{}' kernel ({})", k->impl_name,
                     avail ? "available here" : "built, but cannot run on this machine");
}

std::string config_line(const MoeConfig& c) {
  const auto& p = c.moe_parallel_config;
  return fmt::format(
      "E={} topk={} H={} I={} (per partition {}) tp={} ep={} dp={} pcp={} sp={} all2all={} "
      "activation={} routing={}({}) dtype={}{}{}",
      c.num_experts, c.experts_per_token, c.hidden_dim, c.intermediate_size,
      c.intermediate_size_per_partition, p.tp_size, p.ep_size, p.dp_size, p.pcp_size, p.sp_size,
      p.all2all_backend, activation_value(c.activation), routing_method_name(c.routing_method),
      static_cast<int>(c.routing_method), dtype_name(c.in_dtype), c.is_lora_enabled ? " lora" : "",
      c.has_bias ? " bias" : "");
}

void print_trace_human(const std::vector<TraceEntry>& trace, bool only_rejected) {
  for (const auto& e : trace) {
    if (only_rejected && e.supported) continue;
    std::cout << fmt::format("  {:<22} {:<30} {}\n", backend_value(e.backend), e.kernel,
                             e.supported ? "supported" : e.reason);
  }
}

// ---- select
// ---------------------------------------------------------------------------------------

void run_select(const DeploymentOptions& o) {
  const Platform platform = make_platform(o);
  const OracleEnv env = make_env(o);
  MoeConfig config = make_config(o);
  const OptQuantKey wk = parse_key(o.weight_key, platform);
  const OptQuantKey ak = parse_key(o.activation_key, platform);
  post_init_for_platform(config, platform, env);

  Selection progress;
  Selection sel;
  try {
    sel = select_fp8_moe_backend(config, wk, ak, o.allow_vllm_cutlass, platform, env, &progress);
  } catch (const Error&) {
    if (!o.json) {
      std::cout << fmt::format("No FP8 MoE backend selected for {}\n", platform.describe());
      std::cout << fmt::format("  keys       W {}  A {}\n", key_display(wk), key_display(ak));
      std::cout << fmt::format("  config     {}\n", config_line(config));
      for (const auto& n : progress.notes) std::cout << "  note       " << n << "\n";
      if (!progress.candidates.empty())
        std::cout << "Candidates (priority order): " << python_list_repr(progress.candidates)
                  << "\n";
      if (!progress.trace.empty()) {
        std::cout << "Tried:\n";
        print_trace_human(progress.trace, false);
      }
      std::cout.flush();
    }
    throw;
  }

  if (o.json) {
    ordered_json j;
    j["backend"] = backend_value(sel.backend);
    j["kernel"] = sel.kernel ? ordered_json(sel.kernel->name) : ordered_json(nullptr);
    j["candidates"] = sel.candidates;
    j["trace"] = trace_json(sel.trace);
    j["path"] = sel.path;
    j["activation_format"] = std::string(activation_format_name(sel.activation_format));
    j["notes"] = sel.notes;
    j["platform"] = platform.str();
    j["detected"] = platform.detected();
    j["installed"] = platform.installed_str();
    j["implementation"] = sel.kernel && sel.kernel->impl_name ? ordered_json(sel.kernel->impl_name)
                                                              : ordered_json(nullptr);
    j["weight_key"] = key_str(wk);
    j["activation_key"] = key_str(ak);
    print_ordered(j);
    return;
  }

  if (sel.kernel) {
    std::cout << fmt::format("FP8 MoE backend: {} (experts class {})\n", backend_value(sel.backend),
                             sel.kernel->name);
  } else {
    std::cout << "FP8 MoE backend: NONE (no experts class)\n";
  }
  std::cout << fmt::format("  platform   {}\n", platform.describe());
  std::cout << fmt::format("  keys       W {}  A {}\n", key_display(wk), key_display(ak));
  std::cout << fmt::format("  config     {}\n", config_line(config));
  if (sel.kernel) {
    std::cout << fmt::format("  kernel     {}: {}\n", sel.kernel->name, sel.kernel->summary);
    std::cout << fmt::format("  fp8moe     {}\n", implementation_line(sel.kernel, platform));
  }
  std::cout << "Why:\n";
  for (const auto& n : sel.notes) std::cout << "  - " << n << "\n";
  if (sel.path == "moe_backend") {
    std::cout << fmt::format("  - moe_backend='{}' was given explicitly: only {} was tried\n",
                             config.moe_backend, backend_value(sel.backend));
  } else if (sel.path == "VLLM_USE_DEEP_GEMM") {
    std::cout << "  - the DeepGEMM env override skipped the priority scan\n";
  } else if (sel.path == "VLLM_ROCM_USE_AITER") {
    std::cout << "  - the AITER env override skipped the priority scan\n";
  } else if (sel.path == "auto") {
    std::cout << fmt::format(
        "  - auto scan in priority order: {} / {} is the first class that supports the "
        "configuration\n",
        backend_value(sel.backend), sel.kernel->name);
  } else {
    std::cout << fmt::format(
        "  - no backend supports the configuration and the platform is {} (not CUDA or ROCm), so "
        "vLLM returns NONE instead of raising\n",
        platform.device_name());
  }
  std::cout << "Candidates (priority order): " << python_list_repr(sel.candidates) << "\n";
  bool any_rejected = false;
  for (const auto& e : sel.trace) any_rejected = any_rejected || !e.supported;
  if (any_rejected) {
    std::cout << "Rejected:\n";
    print_trace_human(sel.trace, true);
  }
}

// ---- support
// --------------------------------------------------------------------------------------

void run_support(const DeploymentOptions& o) {
  const Platform platform = make_platform(o);
  const OracleEnv env = make_env(o);
  MoeConfig config = make_config(o);
  const OptQuantKey wk = parse_key(o.weight_key, platform);
  const OptQuantKey ak = parse_key(o.activation_key, platform);
  // As in select: vLLM's FusedMoEConfig.__post_init__ refuses non-gated activations off
  // CUDA/ROCm/XPU, so no support table exists for such a configuration.
  post_init_for_platform(config, platform, env);
  const ExpertsContext ctx{platform, env};
  const ActivationFormat fmt_ = config.moe_parallel_config.use_batched_activation_format()
                                    ? ActivationFormat::kBatchedExperts
                                    : ActivationFormat::kStandard;
  const std::vector<Fp8MoeBackend> priority = get_priority_backends(config, wk, ak, platform);
  std::vector<std::string> priority_values;
  for (Fp8MoeBackend b : priority) priority_values.push_back(backend_value(b));

  struct Row {
    Fp8MoeBackend backend;
    const ExpertsKernel* kernel;
    Support verdict;
  };
  std::vector<Row> rows;
  // Priority order first, then the backends the auto scan never tries (registered without
  // auto_select).
  std::vector<Fp8MoeBackend> order = priority;
  for (Fp8MoeBackend b : all_fp8_moe_backends())
    if (b != Fp8MoeBackend::kNone && std::find(order.begin(), order.end(), b) == order.end())
      order.push_back(b);
  for (Fp8MoeBackend b : order) {
    for (const ExpertsKernel* k : backend_to_kernel_cls(b))
      rows.push_back({b, k, experts_supported(*k, config, wk, ak, fmt_, ctx)});
  }

  if (o.json) {
    ordered_json j;
    j["platform"] = platform.str();
    j["detected"] = platform.detected();
    j["installed"] = platform.installed_str();
    j["weight_key"] = key_str(wk);
    j["activation_key"] = key_str(ak);
    j["activation_format"] = std::string(activation_format_name(fmt_));
    j["priority"] = priority_values;
    ordered_json v = ordered_json::array();
    for (const auto& r : rows) {
      v.push_back(
          {{"backend", backend_value(r.backend)},
           {"kernel", r.kernel->name},
           {"supported", r.verdict.ok},
           {"reason", r.verdict.ok ? ordered_json(nullptr) : ordered_json(r.verdict.reason)},
           {"implementation",
            r.kernel->impl_name ? ordered_json(r.kernel->impl_name) : ordered_json(nullptr)}});
    }
    j["verdicts"] = v;
    print_ordered(j);
    return;
  }
  std::cout << fmt::format("FP8 MoE support on {}\n", platform.describe());
  std::cout << fmt::format("  keys       W {}  A {}\n", key_display(wk), key_display(ak));
  std::cout << fmt::format("  config     {}\n", config_line(config));
  std::cout << fmt::format("  format     {}\n", activation_format_name(fmt_));
  std::cout << "  priority   " << python_list_repr(priority_values) << "\n";
  std::cout << "  #: position in the auto scan's priority order\n\n";
  const auto line = [](std::string s) {
    while (!s.empty() && s.back() == ' ') s.pop_back();
    std::cout << s << "\n";
  };
  line(
      fmt::format("{:>2} {:<22} {:<30} {:<4} {}", "#", "BACKEND", "EXPERTS CLASS", "OK", "REASON"));
  for (const auto& r : rows) {
    const auto pos = std::find(priority.begin(), priority.end(), r.backend);
    const std::string rank =
        pos == priority.end() ? "-" : std::to_string(pos - priority.begin() + 1);
    line(fmt::format("{:>2} {:<22} {:<30} {:<4} {}", rank, backend_value(r.backend), r.kernel->name,
                     r.verdict.ok ? "yes" : "no", r.verdict.ok ? "" : r.verdict.reason));
  }
}

// ---- resolve-block
// --------------------------------------------------------------------------------

struct ResolveOptions {
  DeploymentOptions d;
  std::string block = "128x128";
  bool not_serialized = false;
};

void run_resolve(ResolveOptions& r) {
  DeploymentOptions& o = r.d;
  const Platform platform = make_platform(o);
  MoeConfig config;
  config.num_experts = parse_int_option("--num-experts", o.num_experts, 1);
  config.experts_per_token = parse_int_option("--topk", o.topk, 1);
  config.hidden_dim = parse_int_option("--hidden", o.hidden, 1);
  config.intermediate_size = parse_int_option("--intermediate", o.intermediate, 1);
  config.moe_parallel_config = make_parallel(o, "allgather_reducescatter", 1, false);
  config.activation = activation_from_str(strip_prefix(o.activation, "MoEActivation."));
  config.moe_backend = o.moe_backend;
  for (auto& ch : config.moe_backend)
    ch = ch == '-' ? '_' : static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  config.is_lora_enabled = o.lora;
  config.has_bias = o.bias;
  config.post_init();
  const BlockShape block = parse_block("--block", r.block);
  const OptQuantKey ak = parse_key(o.activation_key, platform);
  // The FusedMoEConfig that resolve_fp8_moe_weight_block_shape receives has passed __post_init__,
  // which refuses non-gated activations off CUDA/ROCm/XPU.
  check_moe_config_for_platform(config, platform);
  const int ispp_before = config.intermediate_size_per_partition;

  const BlockShapeResolution res =
      resolve_fp8_moe_weight_block_shape(config, block, ak, !r.not_serialized, platform);

  if (o.json) {
    ordered_json j;
    j["block_shape"] = {res.block_shape[0], res.block_shape[1]};
    j["refine"] =
        res.refine ? ordered_json({(*res.refine)[0], (*res.refine)[1]}) : ordered_json(nullptr);
    j["intermediate_size_per_partition"] = config.intermediate_size_per_partition;
    j["tp_shard_with_padding"] = config.tp_shard_with_padding;
    print_ordered(j);
    return;
  }
  std::cout << fmt::format("Block shape: [{}, {}]\n", res.block_shape[0], res.block_shape[1]);
  std::cout << fmt::format("  checkpoint blocks   [{}, {}]\n", block[0], block[1]);
  std::cout << fmt::format("  moe_backend         {}\n", config.moe_backend);
  std::cout << fmt::format("  shard               I={} / tp={} = {} per rank, H={}\n",
                           config.intermediate_size, config.tp_size(), ispp_before,
                           config.hidden_dim);
  std::cout << "Why:\n";
  if (res.padded) {
    std::cout << fmt::format(
        "  - {} cannot consume a refined block, so the TP shard is padded to whole {}-blocks: "
        "intermediate_size_per_partition {} -> {} (tp_shard_with_padding)\n",
        config.moe_backend, block[0], ispp_before, config.intermediate_size_per_partition);
  } else if (res.refine) {
    std::cout << fmt::format(
        "  - {} per rank is not a whole number of [{}, {}] blocks; gcd with H gives {}, so the "
        "scales are refined to [{}, {}] (upsampling factor ({}, {}))\n",
        ispp_before, block[0], block[1], res.block_shape[0], res.block_shape[0], res.block_shape[1],
        (*res.refine)[0], (*res.refine)[1]);
    if (config.moe_backend == "auto")
      std::cout << "  - with moe_backend auto only kernels that accept the refined key (Triton) "
                   "will be selected\n";
  } else {
    std::cout << "  - the checkpoint blocks are kept (the TP shard is whole blocks, or no block "
                 ">= 32 divides it and the pad path does not apply)\n";
  }
}

// ---- quant-config
// ---------------------------------------------------------------------------------

struct QuantConfigOptions {
  std::string backend;
  std::string block = "none";
  bool per_act_token = false, per_out_ch = false, bias = false, humming_input_quant = false;
  std::string a_scales = "auto";
  std::string swiglu_limit, gemm1_alpha, gemm1_beta;
  std::string num_experts = "8", hidden = "2048", intermediate = "768";
  std::string platform;
  bool json = false;
};

Tensor ones(std::vector<int64_t> shape, DType dt = DType::kF32) {
  Tensor t = Tensor::zeros(std::span<const int64_t>(shape), dt);
  if (dt == DType::kF32)
    for (int64_t i = 0; i < t.numel(); ++i) t.ptr<float>()[i] = 1.0f;
  if (dt == DType::kU8)
    for (int64_t i = 0; i < t.numel(); ++i) t.ptr<uint8_t>()[i] = 127;  // e8m0 of 1.0
  return t;
}

ordered_json tensor_json(const Tensor& t) {
  if (!t.defined()) return nullptr;
  return {{"shape", t.sizes()}, {"dtype", std::string(dtype_name(t.dtype()))}};
}

ordered_json desc_json(const MoeQuantDesc& d, bool weight) {
  ordered_json j;
  j["dtype"] =
      d.dtype ? ordered_json(std::string(quant_dtype_name(*d.dtype))) : ordered_json(nullptr);
  j["shape"] = d.shape ? ordered_json({d.shape->row, d.shape->col}) : ordered_json(nullptr);
  j["scale"] = tensor_json(d.scale);
  j[weight ? "alphas" : "gscale"] = tensor_json(d.alpha_or_gscale);
  if (weight) {
    j["zp"] = tensor_json(d.zp);
    j["bias"] = tensor_json(d.bias);
  }
  return j;
}

void run_quant_config(const QuantConfigOptions& q) {
  if (q.backend.empty()) {
    throw ValueError(
        "--backend is required: a backend value (TRITON, FLASHINFER_CUTLASS, CPU, ...) or a "
        "moe_backend name (triton, ...)");
  }
  const Fp8MoeBackend backend = parse_backend_value(q.backend);
  const Platform platform = q.platform.empty() ? Platform::detect() : Platform::parse(q.platform);
  const int64_t E = parse_int_option("--num-experts", q.num_experts, 1);
  const int64_t H = parse_int_option("--hidden", q.hidden, 1);
  const int64_t I = parse_int_option("--intermediate", q.intermediate, 1);
  std::optional<std::vector<int64_t>> block;
  if (q.block != "none" && q.block != "None" && !q.block.empty()) {
    const BlockShape b = parse_block("--block", q.block);
    block = std::vector<int64_t>{b[0], b[1]};
  }
  const bool mx = block && *block == std::vector<int64_t>{1, 32};
  const auto cdiv = [](int64_t a, int64_t b) { return (a + b - 1) / b; };
  Fp8QuantConfigInputs in;
  in.fp8_dtype = platform.fp8_dtype() == KeyDType::kF8E4M3FNUZ ? QuantDType::kFp8E4M3FNUZ
                                                               : QuantDType::kFp8E4M3FN;
  if (mx) {
    in.w1_scale = ones({E, 2 * I, cdiv(H, 32)}, DType::kU8);
    in.w2_scale = ones({E, H, cdiv(I, 32)}, DType::kU8);
  } else if (block) {
    in.w1_scale = ones({E, cdiv(2 * I, (*block)[0]), cdiv(H, (*block)[1])});
    in.w2_scale = ones({E, cdiv(H, (*block)[0]), cdiv(I, (*block)[1])});
  } else if (q.per_out_ch) {
    in.w1_scale = ones({E, 2 * I});
    in.w2_scale = ones({E, H});
  } else {
    in.w1_scale = ones({E});
    in.w2_scale = ones({E});
  }
  bool static_a = false;
  if (q.a_scales == "static") {
    static_a = true;
  } else if (q.a_scales == "auto") {
    static_a = !block && !q.per_act_token;
  } else if (q.a_scales != "none") {
    throw ValueError(fmt::format("--a-scales expects static, none or auto, got '{}'", q.a_scales));
  }
  if (static_a) {
    in.a1_scale = Tensor::scalar_f32(1.0f);
    in.a2_scale = Tensor::scalar_f32(1.0f);
  }
  if (q.bias) {
    in.w1_bias = ones({E, 2 * I});
    in.w2_bias = ones({E, H});
  }
  in.block_shape = block;
  in.per_act_token_quant = q.per_act_token;
  in.per_out_ch_quant = q.per_out_ch;
  in.swiglu_limit = parse_float_option("--swiglu-limit", q.swiglu_limit);
  in.gemm1_alpha = parse_float_option("--gemm1-alpha", q.gemm1_alpha);
  in.gemm1_beta = parse_float_option("--gemm1-beta", q.gemm1_beta);
  Fp8MoeLayerState layer;
  if (block && !mx) layer.weight_block_size = block;
  layer.humming_quantizes_inputs = q.humming_input_quant;
  in.layer = &layer;

  const MoeQuantConfig qc = make_fp8_moe_quant_config(backend, in);
  const std::string cname = qc.config_name(DType::kBF16);
  const QuantDType pf8 = in.fp8_dtype;
  if (q.json) {
    ordered_json j;
    j["backend"] = backend_value(backend);
    j["quant_dtype"] = qc.quant_dtype()
                           ? ordered_json(std::string(quant_dtype_name(*qc.quant_dtype())))
                           : ordered_json(nullptr);
    j["weight_quant_dtype"] =
        qc.weight_quant_dtype()
            ? ordered_json(std::string(quant_dtype_name(*qc.weight_quant_dtype())))
            : ordered_json(nullptr);
    const auto bs = qc.block_shape();
    j["block_shape"] = bs ? ordered_json(*bs) : ordered_json(nullptr);
    j["per_act_token_quant"] = qc.per_act_token_quant();
    j["per_out_ch_quant"] = qc.per_out_ch_quant();
    j["is_per_tensor"] = qc.is_per_tensor();
    j["use_fp8_w8a8"] = qc.use_fp8_w8a8(pf8);
    j["use_fp8_w8a16"] = qc.use_fp8_w8a16(pf8);
    j["use_mxfp8"] = qc.use_mxfp8();
    j["config_name"] = cname.empty() ? ordered_json(nullptr) : ordered_json(cname);
    j["is_scale_swizzled"] = qc.is_scale_swizzled;
    const auto optf = [](std::optional<double> v) {
      return v ? ordered_json(*v) : ordered_json(nullptr);
    };
    j["gemm1_alpha"] = optf(qc.gemm1_alpha);
    j["gemm1_beta"] = optf(qc.gemm1_beta);
    j["gemm1_clamp_limit"] = optf(qc.gemm1_clamp_limit);
    j["a1"] = desc_json(qc.a1, false);
    j["a2"] = desc_json(qc.a2, false);
    j["w1"] = desc_json(qc.w1, true);
    j["w2"] = desc_json(qc.w2, true);
    j["layer_g1_alphas_shared"] =
        layer.g1_alphas.defined() && layer.g1_alphas.data() == qc.g1_alphas().data();
    print_ordered(j);
    return;
  }
  std::cout << fmt::format("Quant config for {}\n", backend_value(backend));
  const auto bs = qc.block_shape();
  std::cout << fmt::format(
      "  quant_dtype {}  weight {}  block_shape {}  config_name {}\n",
      qc.quant_dtype() ? quant_dtype_name(*qc.quant_dtype()) : "None",
      qc.weight_quant_dtype() ? quant_dtype_name(*qc.weight_quant_dtype()) : "None",
      bs ? fmt::format("[{}, {}]", (*bs)[0], (*bs)[1]) : std::string("None"),
      cname.empty() ? "None" : cname);
  std::cout << fmt::format(
      "  use_fp8_w8a8 {}  use_fp8_w8a16 {}  use_mxfp8 {}  per_act_token {}  "
      "per_out_ch {}\n",
      qc.use_fp8_w8a8(pf8), qc.use_fp8_w8a16(pf8), qc.use_mxfp8(), qc.per_act_token_quant(),
      qc.per_out_ch_quant());
  std::cout << "  " << qc.describe() << "\n";
}

}  // namespace

void add_oracle_commands(CLI::App& app) {
  CLI::App* oracle =
      app.add_subcommand("oracle", "Which FP8 MoE kernel vLLM would run, and why (the oracle)");
  oracle->require_subcommand(1);

  static DeploymentOptions select_opts;
  CLI::App* select = oracle->add_subcommand(
      "select", "select_fp8_moe_backend: the backend, the experts class and the decision trace");
  add_deployment_options(select, select_opts);
  select->allow_extras();
  select->callback([select]() {
    json_output() = select_opts.json;
    select_opts.tp_given = select->count("--tp") > 0;
    check_no_extras(select);
    run_select(select_opts);
  });

  static DeploymentOptions support_opts;
  CLI::App* support = oracle->add_subcommand(
      "support", "Every backend x experts class verdict for one configuration");
  add_deployment_options(support, support_opts);
  support->allow_extras();
  support->callback([support]() {
    json_output() = support_opts.json;
    support_opts.tp_given = support->count("--tp") > 0;
    check_no_extras(support);
    run_support(support_opts);
  });

  static ResolveOptions resolve_opts;
  CLI::App* resolve = oracle->add_subcommand(
      "resolve-block",
      "resolve_fp8_moe_weight_block_shape: refine, pad or keep the checkpoint's weight blocks");
  DeploymentOptions& r = resolve_opts.d;
  add_platform_options(resolve, r);
  resolve->add_option("--hidden", r.hidden, "hidden size H (default 2048)");
  resolve->add_option("--intermediate", r.intermediate, "global intermediate size I (default 768)");
  add_parallel_options(resolve, r);
  resolve->add_option("--block", resolve_opts.block,
                      "checkpoint weight_block_size (default 128x128)");
  resolve->add_option("--moe-backend", r.moe_backend, "vLLM --moe-backend (default auto)");
  resolve->add_option("--activation-key", r.activation_key,
                      "activation key the kernels are asked about (default kFp8Dynamic128Sym)");
  resolve->add_option("--num-experts", r.num_experts, "global experts (default 128)");
  resolve->add_option("--topk", r.topk, "experts per token (default 8)");
  resolve->add_option("--activation", r.activation, "MoEActivation value (default silu)");
  resolve->add_flag("--lora", r.lora, "LoRA enabled");
  resolve->add_flag("--bias", r.bias, "expert biases");
  resolve->add_flag("--not-serialized", resolve_opts.not_serialized,
                    "the checkpoint is not FP8-serialized (online quantisation): no pad path");
  resolve->add_flag("--json", r.json, "machine-readable output");
  resolve->allow_extras();
  resolve->callback([resolve]() {
    json_output() = resolve_opts.d.json;
    resolve_opts.d.tp_given = resolve->count("--tp") > 0;
    check_no_extras(resolve);
    run_resolve(resolve_opts);
  });

  static QuantConfigOptions qc_opts;
  CLI::App* qc = oracle->add_subcommand(
      "quant-config", "make_fp8_moe_quant_config: the MoeQuantConfig a backend runs with");
  qc->add_option("--backend", qc_opts.backend,
                 "Fp8MoeBackend value (TRITON, FLASHINFER_CUTLASS, CPU, CPU_W8A8, ...) or "
                 "moe_backend name");
  qc->add_option("--block", qc_opts.block, "block_shape: BNxBK, 1x32 (MXFP8) or none (default)");
  qc->add_flag("--per-act-token", qc_opts.per_act_token, "per_act_token_quant");
  qc->add_flag("--per-out-ch", qc_opts.per_out_ch, "per_out_ch_quant");
  qc->add_option("--a-scales", qc_opts.a_scales,
                 "static activation scales: static, none, auto (default: static for per-tensor)");
  qc->add_flag("--bias", qc_opts.bias, "expert biases");
  qc->add_option("--swiglu-limit", qc_opts.swiglu_limit, "swiglu_limit (gemm1_clamp_limit)");
  qc->add_option("--gemm1-alpha", qc_opts.gemm1_alpha, "gemm1_alpha");
  qc->add_option("--gemm1-beta", qc_opts.gemm1_beta, "gemm1_beta");
  qc->add_flag("--humming-input-quant", qc_opts.humming_input_quant,
               "HUMMING: the layer quantises its inputs to 8 bits");
  qc->add_option("--num-experts", qc_opts.num_experts,
                 "experts for the example scales (default 8)");
  qc->add_option("--hidden", qc_opts.hidden, "H for the example scales (default 2048)");
  qc->add_option("--intermediate", qc_opts.intermediate, "I for the example scales (default 768)");
  qc->add_option("--platform", qc_opts.platform, "platform (its FP8 dtype; default this machine)");
  qc->add_flag("--json", qc_opts.json, "machine-readable output");
  qc->allow_extras();
  qc->callback([qc]() {
    json_output() = qc_opts.json;
    check_no_extras(qc);
    run_quant_config(qc_opts);
  });
}

}  // namespace fp8moe::cli
