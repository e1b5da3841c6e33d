// Element types fp8moe handles, with the names torch prints (torch.float8_e4m3fn) and the short
// abbreviations torch.fx uses inside vLLM's QuantKey strings (f8e4m3fn).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace fp8moe {

enum class DType : uint8_t {
  kF64,
  kF32,
  kF16,
  kBF16,
  kF8E4M3FN,    // OCP E4M3 (NVIDIA), max 448, no inf
  kF8E4M3FNUZ,  // AMD MI300 E4M3, bias 8, max 240, single NaN 0x80
  kF8E5M2,
  kF8E8M0FNU,  // MX scale: power of two, stored as one byte
  kU8,
  kI8,
  kI32,
  kI64,
  kBool,
};

// Bytes per element.
constexpr std::size_t dtype_size(DType t) {
  switch (t) {
    case DType::kF64:
    case DType::kI64:
      return 8;
    case DType::kF32:
    case DType::kI32:
      return 4;
    case DType::kF16:
    case DType::kBF16:
      return 2;
    default:
      return 1;
  }
}

constexpr bool dtype_is_fp8(DType t) {
  return t == DType::kF8E4M3FN || t == DType::kF8E4M3FNUZ || t == DType::kF8E5M2;
}

// torch.fx dtype_abbrs: "f8e4m3fn", "f32", "u8", "bf16", ...
std::string_view dtype_abbr(DType t);
// str(torch.dtype): "torch.float8_e4m3fn", "torch.bfloat16", ...
std::string_view dtype_torch_name(DType t);
// Short user-facing name used by the CLI: "fp8_e4m3fn", "bf16", "f32", ...
std::string_view dtype_name(DType t);
// Parses a CLI/user dtype name ("bf16", "bfloat16", "torch.bfloat16", "f32", "float32", "fp16",
// ...). Throws ValueError naming the value and the accepted names.
DType parse_dtype(std::string_view name);

}  // namespace fp8moe
