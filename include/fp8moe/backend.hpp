// vLLM's Fp8MoeBackend (fused_moe/oracle/fp8.py) as the seed lists it, plus NONE, map_fp8_backend()
// with vLLM's error text, and out-of-tree registration of extra backends.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace fp8moe {

struct ExpertsKernel;

// Declaration order of the vLLM enum (oracle.md §1.1) with the seed's CPU_W8A8 next to CPU.
// Out-of-tree backends registered at run time get values from kFirstRegistered upwards.
enum class Fp8MoeBackend : uint16_t {
  kNone,
  kFlashinferTrtllm,
  kFlashinferCutlass,
  kDeepGemm,
  kBatchedDeepGemm,
  kMarlin,
  kHumming,
  kTriton,
  kBatchedTriton,
  kAiter,
  kVllmCutlass,
  kBatchedVllmCutlass,
  kXpu,
  kCpuW8A8,
  kCpu,
  kHpc,
  kFirstRegistered = 1000,
};

// The built-in members in declaration order (NONE first).
const std::vector<Fp8MoeBackend>& builtin_fp8_moe_backends();
// Built-in and registered members (registration order after the built-ins).
std::vector<Fp8MoeBackend> all_fp8_moe_backends();
// backend.value: "TRITON", "CPU_W8A8", "NONE", or a registered backend's value.
std::string backend_value(Fp8MoeBackend b);
// Parses a backend value ("TRITON", case-insensitive) or, failing that, a moe_backend string
// ("triton") through map_fp8_backend. Throws ValueError naming the text and the accepted values.
Fp8MoeBackend parse_backend_value(std::string_view text);

// vLLM map_fp8_backend(runner_backend): "triton" -> TRITON, "deep_gemm" -> DEEPGEMM, "cutlass" ->
// VLLM_CUTLASS, "flashinfer_trtllm", "flashinfer_cutlass", "marlin", "humming", "aiter", "hpc";
// registered names map to their backend. Anything else raises ValueError:
//   moe_backend='x' is not supported for FP8 MoE. Expected one of ['triton', 'deep_gemm',
//   'cutlass', 'flashinfer_trtllm', 'flashinfer_cutlass', 'marlin', 'humming', 'aiter', 'hpc'].
// and, only when some backend is registered, " Registered backends: ['name', ...]." after it
// (the registry variant, oracle.md §1.3; the built-in text stays verbatim otherwise).
Fp8MoeBackend map_fp8_backend(std::string_view runner_backend);
// The moe_backend strings map_fp8_backend accepts, built-ins first.
std::vector<std::string> fp8_moe_backend_names();

// ---- Out-of-tree registration -----------------------------------------------------------------
// vLLM has a TODO for exactly this ("we need a way to register MoE backends by OOT plugins, rather
// than having an explicit list of AVAILABLE_BACKENDS"); its registry variant (fp8_registry.py) is
// the model here.
//
//   static const fp8moe::ExpertsKernel kMyExperts = {...};   // name, predicates, impl_name
//   fp8moe::register_fp8_moe_backend("my_kernels", {&kMyExperts}, {.auto_select = true});
//
// After that, moe_backend="my_kernels" selects it (map_fp8_backend accepts the name) and, with
// auto_select, the auto scan tries it: after every built-in backend by default, or just before
// `insert_before` when given (before the priority reorder rules run, so those still apply).
// The name is normalised as vLLM does (lower case, '-' -> '_') and must not be a built-in
// moe_backend literal; the backend's value is the upper-cased name. Registering the same name again
// with the same kernels and options is a no-op; with different ones it is a ValueError. The
// descriptors must outlive every later selection (static storage). Not thread-safe against
// concurrent selection: register at start-up.
struct Fp8MoeBackendRegistration {
  bool auto_select = false;
  std::optional<Fp8MoeBackend> insert_before{};
};
Fp8MoeBackend register_fp8_moe_backend(std::string_view name,
                                       std::vector<const ExpertsKernel*> kernels,
                                       Fp8MoeBackendRegistration options = {});
// Forgets every registered backend (tests).
void clear_registered_fp8_moe_backends();
// Registered names in registration order.
std::vector<std::string> registered_fp8_moe_backend_names();

struct RegisteredBackendInfo {
  Fp8MoeBackend backend;
  std::string name;   // normalised moe_backend string
  std::string value;  // upper-cased
  std::vector<const ExpertsKernel*> kernels;
  Fp8MoeBackendRegistration options;
};
const RegisteredBackendInfo* find_registered_backend(Fp8MoeBackend b);
std::vector<RegisteredBackendInfo> registered_fp8_moe_backends();

}  // namespace fp8moe
