// OracleEnv: the vLLM environment variables the oracle consults, with envs.py's parsing.
#include "fp8moe/oracle_env.hpp"

#include <fmt/format.h>

#include <cstdlib>

#include "fp8moe/error.hpp"

namespace fp8moe {

namespace {

const std::vector<EnvVarInfo>& known() {
  static const std::vector<EnvVarInfo> v = {
      {"VLLM_USE_DEEP_GEMM", "1", false, EnvParse::kIntBool,
       "DeepGEMM allowed (also part of is_deep_gemm_supported()); set explicitly, 1 forces "
       "DEEPGEMM "
       "and 0 removes DEEPGEMM and BATCHED_DEEPGEMM from the auto scan"},
      {"VLLM_MOE_USE_DEEP_GEMM", "1", false, EnvParse::kIntBool,
       "MoE DeepGEMM switch (oracle step B only): set explicitly like VLLM_USE_DEEP_GEMM"},
      {"VLLM_USE_DEEP_GEMM_E8M0", "1", false, EnvParse::kIntBool,
       "UE8M0 (power-of-two) scales with DeepGEMM (is_deep_gemm_e8m0_used)"},
      {"VLLM_ROCM_USE_AITER", "False", false, EnvParse::kTrueOr1,
       "AITER master switch; set explicitly, true forces AITER (with VLLM_ROCM_USE_AITER_MOE) and "
       "false removes it"},
      {"VLLM_ROCM_USE_AITER_MOE", "True", false, EnvParse::kTrueOr1,
       "AITER fused-MoE switch (is_fused_moe_enabled)"},
      {"VLLM_BATCH_INVARIANT", "0", false, EnvParse::kIntBool,
       "batch-invariant kernels only (base check 10)"},
      {"VLLM_USE_FUSED_MOE_GROUPED_TOPK", "1", false, EnvParse::kIntBool,
       "grouped top-k through the fused kernel"},
      {"VLLM_HUMMING_MOE_GEMM_TYPE", "", true, EnvParse::kString,
       "Humming gemm type: indexed (default and any unknown value) or grouped / "
       "grouped_contiguous"},
  };
  return v;
}

const EnvVarInfo& info_or_throw(std::string_view name) {
  for (const auto& i : known())
    if (i.name == name) return i;
  std::string names;
  for (const auto& i : known()) names += fmt::format("{}{}", names.empty() ? "" : ", ", i.name);
  throw ValueError(
      fmt::format("unknown environment variable '{}': the FP8 MoE oracle reads only {}",
                  std::string(name), names));
}

// Python str.isspace for the characters an environment value realistically holds: ASCII whitespace
// (incl. \x1c-\x1f) and the UTF-8 encodings of U+0085, U+00A0, U+1680, U+2000-U+200A, U+2028,
// U+2029, U+202F, U+205F and U+3000. Returns the byte length of the whitespace at s[i], or 0.
std::size_t space_len(std::string_view s, std::size_t i) {
  const auto u = [&](std::size_t k) { return static_cast<unsigned char>(s[k]); };
  const unsigned char c = u(i);
  if (c == ' ' || (c >= 0x09 && c <= 0x0d) || (c >= 0x1c && c <= 0x1f)) return 1;
  if (c == 0xc2 && i + 1 < s.size() && (u(i + 1) == 0x85 || u(i + 1) == 0xa0)) return 2;
  if (i + 2 < s.size()) {
    if (c == 0xe1 && u(i + 1) == 0x9a && u(i + 2) == 0x80) return 3;  // U+1680
    if (c == 0xe2 && u(i + 1) == 0x80 &&
        (u(i + 2) <= 0x8a || u(i + 2) == 0xa8 || u(i + 2) == 0xa9 || u(i + 2) == 0xaf))
      return 3;  // U+2000-200A, 2028, 2029, 202F
    if (c == 0xe2 && u(i + 1) == 0x81 && u(i + 2) == 0x9f) return 3;  // U+205F
    if (c == 0xe3 && u(i + 1) == 0x80 && u(i + 2) == 0x80) return 3;  // U+3000
  }
  return 0;
}

}  // namespace

std::string python_str_repr(std::string_view s) {
  const bool has_single = s.find('\'') != std::string_view::npos;
  const bool has_double = s.find('"') != std::string_view::npos;
  const char q = has_single && !has_double ? '"' : '\'';
  std::string r(1, q);
  for (std::size_t i = 0; i < s.size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    if (c == '\\') {
      r += "\\\\";
    } else if (c == static_cast<unsigned char>(q)) {
      r += '\\';
      r += static_cast<char>(c);
    } else if (c == '\n') {
      r += "\\n";
    } else if (c == '\t') {
      r += "\\t";
    } else if (c == '\r') {
      r += "\\r";
    } else if (c < 0x20 || c == 0x7f) {
      r += fmt::format("\\x{:02x}", c);
    } else if (c == 0xc2 && i + 1 < s.size() && static_cast<unsigned char>(s[i + 1]) >= 0x80 &&
               static_cast<unsigned char>(s[i + 1]) <= 0xa0) {
      // U+0080..U+00A0 are not printable in Python: \x80 .. \xa0.
      r += fmt::format("\\x{:02x}", static_cast<unsigned char>(s[i + 1]));
      ++i;
    } else {
      r += static_cast<char>(c);
    }
  }
  r += q;
  return r;
}

bool python_int_truthy(std::string_view s) {
  const auto fail = [&]() {
    std::string rep = python_str_repr(s);
    // CPython formats the literal with %.200R: the repr cut to 200 characters (code points).
    std::size_t cps = 0, cut = rep.size();
    for (std::size_t i = 0; i < rep.size(); ++i) {
      if ((static_cast<unsigned char>(rep[i]) & 0xc0) != 0x80) {
        if (cps == 200) {
          cut = i;
          break;
        }
        ++cps;
      }
    }
    rep.resize(cut);
    return ValueError("invalid literal for int() with base 10: " + rep);
  };
  std::size_t b = 0, e = s.size();
  while (b < e) {
    const std::size_t n = space_len(s, b);
    if (!n) break;
    b += n;
  }
  // Trailing whitespace: scan forward for the last non-space position.
  {
    std::size_t i = b, last = b;
    while (i < e) {
      const std::size_t n = space_len(s, i);
      if (n) {
        i += n;
      } else {
        ++i;
        last = i;
      }
    }
    e = last;
  }
  if (b < e && (s[b] == '+' || s[b] == '-')) ++b;
  if (b >= e) throw fail();
  bool nonzero = false, prev_digit = false;
  for (std::size_t i = b; i < e; ++i) {
    const char c = s[i];
    if (c >= '0' && c <= '9') {
      nonzero = nonzero || c != '0';
      prev_digit = true;
    } else if (c == '_' && prev_digit && i + 1 < e && s[i + 1] >= '0' && s[i + 1] <= '9') {
      prev_digit = false;
    } else {
      throw fail();
    }
  }
  return nonzero;
}

OracleEnv OracleEnv::from_environment() {
  OracleEnv env;
  for (const auto& i : known()) {
    const std::string name(i.name);
    if (const char* v = std::getenv(name.c_str())) env.values_[name] = v;
  }
  return env;
}

OracleEnv OracleEnv::from_pairs(const std::vector<std::string>& pairs) {
  OracleEnv env;
  for (const auto& p : pairs) {
    const auto eq = p.find('=');
    if (eq == std::string::npos || eq == 0) {
      throw ValueError(fmt::format(
          "malformed environment pair '{}': expected NAME=VALUE (e.g. VLLM_USE_DEEP_GEMM=0)", p));
    }
    env.set(std::string_view(p).substr(0, eq), p.substr(eq + 1));
  }
  return env;
}

const std::vector<EnvVarInfo>& OracleEnv::variables() { return known(); }

OracleEnv& OracleEnv::set(std::string_view name, std::string value) {
  info_or_throw(name);
  values_[std::string(name)] = std::move(value);
  return *this;
}

OracleEnv& OracleEnv::unset(std::string_view name) {
  info_or_throw(name);
  values_.erase(std::string(name));
  return *this;
}

bool OracleEnv::is_set(std::string_view name) const {
  info_or_throw(name);
  return values_.find(name) != values_.end();
}

std::optional<std::string> OracleEnv::raw(std::string_view name) const {
  info_or_throw(name);
  const auto it = values_.find(name);
  if (it == values_.end()) return std::nullopt;
  return it->second;
}

std::vector<std::string> OracleEnv::pairs() const {
  std::vector<std::string> r;
  for (const auto& [k, v] : values_) r.push_back(k + "=" + v);
  return r;
}

namespace {
bool int_bool(const OracleEnv& env, std::string_view name, std::string_view dflt) {
  const auto v = env.raw(name);
  return python_int_truthy(v ? std::string_view(*v) : dflt);
}
bool true_or_1(const OracleEnv& env, std::string_view name, std::string_view dflt) {
  const auto v = env.raw(name);
  std::string s(v ? std::string_view(*v) : dflt);
  for (auto& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s == "true" || s == "1";
}
}  // namespace

bool OracleEnv::use_deep_gemm() const { return int_bool(*this, "VLLM_USE_DEEP_GEMM", "1"); }
bool OracleEnv::moe_use_deep_gemm() const { return int_bool(*this, "VLLM_MOE_USE_DEEP_GEMM", "1"); }
bool OracleEnv::use_deep_gemm_e8m0() const {
  return int_bool(*this, "VLLM_USE_DEEP_GEMM_E8M0", "1");
}
bool OracleEnv::rocm_use_aiter() const { return true_or_1(*this, "VLLM_ROCM_USE_AITER", "False"); }
bool OracleEnv::rocm_use_aiter_moe() const {
  return true_or_1(*this, "VLLM_ROCM_USE_AITER_MOE", "True");
}
bool OracleEnv::batch_invariant() const { return int_bool(*this, "VLLM_BATCH_INVARIANT", "0"); }
bool OracleEnv::use_fused_moe_grouped_topk() const {
  return int_bool(*this, "VLLM_USE_FUSED_MOE_GROUPED_TOPK", "1");
}
std::optional<std::string> OracleEnv::humming_moe_gemm_type() const {
  return raw("VLLM_HUMMING_MOE_GEMM_TYPE");
}

}  // namespace fp8moe
