// The vLLM environment variables the FP8 MoE oracle consults, held as raw strings and parsed the
// way vLLM's envs.py parses them, lazily, at the point vLLM reads them (so a garbage value raises
// only where vLLM would raise). The oracle itself reads nothing from the machine: an OracleEnv is
// built from the process environment (from_environment) or from explicit NAME=VALUE pairs.
//
//   VLLM_USE_DEEP_GEMM, VLLM_MOE_USE_DEEP_GEMM, VLLM_USE_DEEP_GEMM_E8M0,
//   VLLM_BATCH_INVARIANT, VLLM_USE_FUSED_MOE_GROUPED_TOPK:
//       bool(int(os.getenv(NAME, default))); a value int() rejects raises ValueError with Python's
//       text, e.g. "invalid literal for int() with base 10: 'abc'".
//   VLLM_ROCM_USE_AITER, VLLM_ROCM_USE_AITER_MOE:
//       os.getenv(NAME, default).lower() in ("true", "1"); never raises.
//   VLLM_HUMMING_MOE_GEMM_TYPE: the string or None.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace fp8moe {

enum class EnvParse : uint8_t { kIntBool, kTrueOr1, kString };

struct EnvVarInfo {
  std::string_view name;
  std::string_view default_value;  // what vLLM uses when unset ("" for None)
  bool default_is_none;
  EnvParse parse;
  std::string_view doc;
};

class OracleEnv {
 public:
  // Every variable unset (vLLM's defaults apply).
  OracleEnv() = default;
  // The known variables that are set in this process's environment.
  static OracleEnv from_environment();
  // "NAME=VALUE" pairs. Throws ValueError for a pair without '=' or an unknown NAME.
  static OracleEnv from_pairs(const std::vector<std::string>& pairs);
  // The variables fp8moe knows, in documentation order.
  static const std::vector<EnvVarInfo>& variables();

  // Throws ValueError for an unknown name (vLLM raises AttributeError for unregistered names; a
  // name the oracle never reads is almost always a typo).
  OracleEnv& set(std::string_view name, std::string value);
  OracleEnv& unset(std::string_view name);

  // envs.is_set(name): explicitly set, whatever the value. Unknown name: ValueError.
  bool is_set(std::string_view name) const;
  std::optional<std::string> raw(std::string_view name) const;
  // NAME=VALUE for every set variable, sorted by name.
  std::vector<std::string> pairs() const;

  // Typed accessors with vLLM's parsing (ValueError for non-integers where vLLM uses int()).
  bool use_deep_gemm() const;               // VLLM_USE_DEEP_GEMM, default "1"
  bool moe_use_deep_gemm() const;           // VLLM_MOE_USE_DEEP_GEMM, default "1"
  bool use_deep_gemm_e8m0() const;          // VLLM_USE_DEEP_GEMM_E8M0, default "1"
  bool rocm_use_aiter() const;              // VLLM_ROCM_USE_AITER, default "False"
  bool rocm_use_aiter_moe() const;          // VLLM_ROCM_USE_AITER_MOE, default "True"
  bool batch_invariant() const;             // VLLM_BATCH_INVARIANT, default "0"
  bool use_fused_moe_grouped_topk() const;  // VLLM_USE_FUSED_MOE_GROUPED_TOPK, default "1"
  std::optional<std::string> humming_moe_gemm_type() const;  // VLLM_HUMMING_MOE_GEMM_TYPE

 private:
  std::map<std::string, std::string, std::less<>> values_;
};

// Python's int(s) (base 10) as a truth value: bool(int(s)). Accepts what int() accepts (surrounding
// whitespace, a sign, '_' between digits, leading zeros). Otherwise throws ValueError with Python's
// message: "invalid literal for int() with base 10: 'abc'" (repr of s, cut to 200 characters).
bool python_int_truthy(std::string_view s);
// Python's repr() of a str (quotes chosen as Python does, escapes for \\, \n, \t, \r and other
// control characters).
std::string python_str_repr(std::string_view s);

}  // namespace fp8moe
