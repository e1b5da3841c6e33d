// DType names: torch's, torch.fx's abbreviations, and the CLI parser.
#include "fp8moe/dtype.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <string>

#include "fp8moe/error.hpp"

namespace fp8moe {

std::string_view dtype_abbr(DType t) {
  switch (t) {
    case DType::kF64:
      return "f64";
    case DType::kF32:
      return "f32";
    case DType::kF16:
      return "f16";
    case DType::kBF16:
      return "bf16";
    case DType::kF8E4M3FN:
      return "f8e4m3fn";
    case DType::kF8E4M3FNUZ:
      return "f8e4m3fnuz";
    case DType::kF8E5M2:
      return "f8e5m2";
    case DType::kF8E8M0FNU:
      return "f8e8m0fnu";
    case DType::kU8:
      return "u8";
    case DType::kI8:
      return "i8";
    case DType::kI32:
      return "i32";
    case DType::kI64:
      return "i64";
    case DType::kBool:
      return "b8";
  }
  return "?";
}

std::string_view dtype_torch_name(DType t) {
  switch (t) {
    case DType::kF64:
      return "torch.float64";
    case DType::kF32:
      return "torch.float32";
    case DType::kF16:
      return "torch.float16";
    case DType::kBF16:
      return "torch.bfloat16";
    case DType::kF8E4M3FN:
      return "torch.float8_e4m3fn";
    case DType::kF8E4M3FNUZ:
      return "torch.float8_e4m3fnuz";
    case DType::kF8E5M2:
      return "torch.float8_e5m2";
    case DType::kF8E8M0FNU:
      return "torch.float8_e8m0fnu";
    case DType::kU8:
      return "torch.uint8";
    case DType::kI8:
      return "torch.int8";
    case DType::kI32:
      return "torch.int32";
    case DType::kI64:
      return "torch.int64";
    case DType::kBool:
      return "torch.bool";
  }
  return "?";
}

std::string_view dtype_name(DType t) {
  switch (t) {
    case DType::kF64:
      return "f64";
    case DType::kF32:
      return "f32";
    case DType::kF16:
      return "f16";
    case DType::kBF16:
      return "bf16";
    case DType::kF8E4M3FN:
      return "fp8_e4m3fn";
    case DType::kF8E4M3FNUZ:
      return "fp8_e4m3fnuz";
    case DType::kF8E5M2:
      return "fp8_e5m2";
    case DType::kF8E8M0FNU:
      return "e8m0";
    case DType::kU8:
      return "u8";
    case DType::kI8:
      return "i8";
    case DType::kI32:
      return "i32";
    case DType::kI64:
      return "i64";
    case DType::kBool:
      return "bool";
  }
  return "?";
}

DType parse_dtype(std::string_view name) {
  std::string s(name);
  std::transform(s.begin(), s.end(), s.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  if (s.rfind("torch.", 0) == 0) s = s.substr(6);
  if (s == "bf16" || s == "bfloat16") return DType::kBF16;
  if (s == "f32" || s == "fp32" || s == "float32" || s == "float") return DType::kF32;
  if (s == "f16" || s == "fp16" || s == "float16" || s == "half") return DType::kF16;
  if (s == "f64" || s == "fp64" || s == "float64" || s == "double") return DType::kF64;
  if (s == "fp8_e4m3fn" || s == "float8_e4m3fn" || s == "f8e4m3fn" || s == "e4m3")
    return DType::kF8E4M3FN;
  if (s == "fp8_e4m3fnuz" || s == "float8_e4m3fnuz" || s == "f8e4m3fnuz") return DType::kF8E4M3FNUZ;
  if (s == "fp8_e5m2" || s == "float8_e5m2" || s == "f8e5m2") return DType::kF8E5M2;
  if (s == "e8m0" || s == "float8_e8m0fnu" || s == "f8e8m0fnu") return DType::kF8E8M0FNU;
  if (s == "u8" || s == "uint8") return DType::kU8;
  if (s == "i8" || s == "int8") return DType::kI8;
  if (s == "i32" || s == "int32") return DType::kI32;
  if (s == "i64" || s == "int64") return DType::kI64;
  throw ValueError(
      fmt::format("unknown dtype '{}': expected one of bf16, f16, f32, f64, fp8_e4m3fn, "
                  "fp8_e4m3fnuz, fp8_e5m2, "
                  "e8m0, u8, i8, i32, i64 (torch names such as torch.bfloat16 are accepted too)",
                  name));
}

}  // namespace fp8moe
