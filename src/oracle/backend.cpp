// Fp8MoeBackend values, map_fp8_backend (vLLM's text), out-of-tree registration.
#include "fp8moe/backend.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <deque>
#include <mutex>

#include "fp8moe/error.hpp"
#include "fp8moe/experts.hpp"

namespace fp8moe {

std::string python_list_repr(const std::vector<std::string>& items);

namespace {

struct BackendName {
  Fp8MoeBackend b;
  std::string_view value;
};
constexpr std::array<BackendName, 16> kBackendNames{{
    {Fp8MoeBackend::kNone, "NONE"},
    {Fp8MoeBackend::kFlashinferTrtllm, "FLASHINFER_TRTLLM"},
    {Fp8MoeBackend::kFlashinferCutlass, "FLASHINFER_CUTLASS"},
    {Fp8MoeBackend::kDeepGemm, "DEEPGEMM"},
    {Fp8MoeBackend::kBatchedDeepGemm, "BATCHED_DEEPGEMM"},
    {Fp8MoeBackend::kMarlin, "MARLIN"},
    {Fp8MoeBackend::kHumming, "HUMMING"},
    {Fp8MoeBackend::kTriton, "TRITON"},
    {Fp8MoeBackend::kBatchedTriton, "BATCHED_TRITON"},
    {Fp8MoeBackend::kAiter, "AITER"},
    {Fp8MoeBackend::kVllmCutlass, "VLLM_CUTLASS"},
    {Fp8MoeBackend::kBatchedVllmCutlass, "BATCHED_VLLM_CUTLASS"},
    {Fp8MoeBackend::kXpu, "XPU"},
    {Fp8MoeBackend::kCpuW8A8, "CPU_W8A8"},
    {Fp8MoeBackend::kCpu, "CPU"},
    {Fp8MoeBackend::kHpc, "HPC"},
}};

// vLLM's mapping dict, in its insertion order (the error text lists its keys).
constexpr std::array<std::pair<std::string_view, Fp8MoeBackend>, 9> kMapping{{
    {"triton", Fp8MoeBackend::kTriton},
    {"deep_gemm", Fp8MoeBackend::kDeepGemm},
    {"cutlass", Fp8MoeBackend::kVllmCutlass},
    {"flashinfer_trtllm", Fp8MoeBackend::kFlashinferTrtllm},
    {"flashinfer_cutlass", Fp8MoeBackend::kFlashinferCutlass},
    {"marlin", Fp8MoeBackend::kMarlin},
    {"humming", Fp8MoeBackend::kHumming},
    {"aiter", Fp8MoeBackend::kAiter},
    {"hpc", Fp8MoeBackend::kHpc},
}};

// vLLM's MoEBackend literal (config/kernel.py): names a registration may not take.
constexpr std::array<std::string_view, 18> kBuiltinMoeBackends{{
    "auto",
    "triton",
    "batched_triton",
    "deep_gemm",
    "deep_gemm_mega_moe",
    "cutlass",
    "flashinfer_trtllm",
    "flashinfer_cutlass",
    "flashinfer_cutedsl",
    "flashinfer_b12x",
    "b12x",
    "marlin",
    "humming",
    "triton_unfused",
    "aiter",
    "flydsl",
    "hpc",
    "emulation",
}};

struct Registry {
  std::mutex mu;
  std::deque<RegisteredBackendInfo> backends;  // stable addresses for find_registered_backend
};
Registry& registry() {
  static Registry r;
  return r;
}

std::string normalize_name(std::string_view name) {
  std::string s(name);
  for (auto& c : s) {
    c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    if (c == '-') c = '_';
  }
  if (s.empty()) throw ValueError("FP8 MoE backend name must not be empty.");
  return s;
}

}  // namespace

const std::vector<Fp8MoeBackend>& builtin_fp8_moe_backends() {
  static const std::vector<Fp8MoeBackend> v = [] {
    std::vector<Fp8MoeBackend> r;
    for (const auto& n : kBackendNames) r.push_back(n.b);
    return r;
  }();
  return v;
}

std::vector<Fp8MoeBackend> all_fp8_moe_backends() {
  std::vector<Fp8MoeBackend> r = builtin_fp8_moe_backends();
  for (const auto& reg : registered_fp8_moe_backends()) r.push_back(reg.backend);
  return r;
}

std::string backend_value(Fp8MoeBackend b) {
  for (const auto& n : kBackendNames)
    if (n.b == b) return std::string(n.value);
  if (const RegisteredBackendInfo* r = find_registered_backend(b)) return r->value;
  return fmt::format("<unknown backend {}>", static_cast<int>(b));
}

Fp8MoeBackend parse_backend_value(std::string_view text) {
  std::string up(text);
  for (auto& c : up) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  for (const auto& n : kBackendNames)
    if (n.value == up) return n.b;
  for (const auto& r : registered_fp8_moe_backends())
    if (r.value == up) return r.backend;
  try {
    return map_fp8_backend(text);
  } catch (const ValueError&) {
  }
  std::vector<std::string> values;
  for (const auto& b : all_fp8_moe_backends()) values.push_back(backend_value(b));
  throw ValueError(fmt::format(
      "unknown FP8 MoE backend '{}': expected a backend value ({}) or a moe_backend name ({})",
      std::string(text), fmt::join(values, ", "), fmt::join(fp8_moe_backend_names(), ", ")));
}

Fp8MoeBackend map_fp8_backend(std::string_view runner_backend) {
  for (const auto& [name, b] : kMapping)
    if (name == runner_backend) return b;
  const std::vector<std::string> registered = registered_fp8_moe_backend_names();
  for (const auto& r : registered_fp8_moe_backends())
    if (r.name == runner_backend) return r.backend;
  std::vector<std::string> keys;
  for (const auto& [name, b] : kMapping) keys.emplace_back(name);
  std::string msg =
      fmt::format("moe_backend='{}' is not supported for FP8 MoE. Expected one of {}.",
                  std::string(runner_backend), python_list_repr(keys));
  // The registry variant (oracle.md §1.3, [N]) appends the registered names; without any
  // registration the built-in text stays verbatim.
  if (!registered.empty())
    msg += fmt::format(" Registered backends: {}.", python_list_repr(registered));
  throw ValueError(msg);
}

std::vector<std::string> fp8_moe_backend_names() {
  std::vector<std::string> r;
  for (const auto& [name, b] : kMapping) r.emplace_back(name);
  for (const auto& n : registered_fp8_moe_backend_names()) r.push_back(n);
  return r;
}

Fp8MoeBackend register_fp8_moe_backend(std::string_view name,
                                       std::vector<const ExpertsKernel*> kernels,
                                       Fp8MoeBackendRegistration options) {
  const std::string normalized = normalize_name(name);
  if (std::find(kBuiltinMoeBackends.begin(), kBuiltinMoeBackends.end(), normalized) !=
      kBuiltinMoeBackends.end()) {
    throw ValueError(fmt::format(
        "Cannot register FP8 MoE backend '{}': the name is reserved by a built-in MoE backend.",
        normalized));
  }
  std::string value = normalized;
  for (auto& c : value) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  for (const auto& n : kBackendNames) {
    if (n.value == value) {
      throw ValueError(fmt::format(
          "Cannot register FP8 MoE backend '{}': its value {} is a built-in Fp8MoeBackend.",
          normalized, value));
    }
  }
  if (kernels.empty() || std::any_of(kernels.begin(), kernels.end(), [](const ExpertsKernel* k) {
        return k == nullptr || k->name == nullptr || k->supports_current_device == nullptr ||
               k->supports_no_act_and_mul == nullptr || k->supports_activation == nullptr ||
               k->supports_quant_scheme == nullptr || k->supports_parallel_config == nullptr;
      })) {
    throw ValueError(
        "At least one expert class is required, each with a name and the five mandatory "
        "predicates (device, no_act_and_mul, activation, quant scheme, parallel config).");
  }
  if (options.insert_before && (*options.insert_before == Fp8MoeBackend::kNone ||
                                static_cast<uint16_t>(*options.insert_before) >=
                                    static_cast<uint16_t>(Fp8MoeBackend::kFirstRegistered))) {
    throw ValueError(
        fmt::format("insert_before must name a built-in FP8 MoE backend other than NONE, got {}",
                    backend_value(*options.insert_before)));
  }
  auto& reg = registry();
  std::lock_guard lock(reg.mu);
  for (const auto& r : reg.backends) {
    if (r.name != normalized) continue;
    const bool same = r.kernels == kernels && r.options.auto_select == options.auto_select &&
                      r.options.insert_before == options.insert_before;
    if (!same) {
      throw ValueError(
          fmt::format("FP8 MoE backend '{}' is already registered with a different configuration.",
                      normalized));
    }
    return r.backend;
  }
  RegisteredBackendInfo info;
  info.backend = static_cast<Fp8MoeBackend>(static_cast<uint16_t>(Fp8MoeBackend::kFirstRegistered) +
                                            reg.backends.size());
  info.name = normalized;
  info.value = value;
  info.kernels = std::move(kernels);
  info.options = options;
  reg.backends.push_back(info);
  return info.backend;
}

void clear_registered_fp8_moe_backends() {
  auto& reg = registry();
  std::lock_guard lock(reg.mu);
  reg.backends.clear();
}

std::vector<std::string> registered_fp8_moe_backend_names() {
  std::vector<std::string> r;
  for (const auto& b : registered_fp8_moe_backends()) r.push_back(b.name);
  return r;
}

std::vector<RegisteredBackendInfo> registered_fp8_moe_backends() {
  auto& reg = registry();
  std::lock_guard lock(reg.mu);
  return {reg.backends.begin(), reg.backends.end()};
}

const RegisteredBackendInfo* find_registered_backend(Fp8MoeBackend b) {
  auto& reg = registry();
  std::lock_guard lock(reg.mu);
  for (const auto& r : reg.backends)
    if (r.backend == b) return &r;
  return nullptr;
}

}  // namespace fp8moe
