// vLLM's quantisation keys (quantization/utils/quant_utils.py): GroupShape, ScaleDesc, QuantKey and
// the named constants the FP8 MoE oracle compares against. Equality is field-wise and str() prints
// exactly what vLLM prints, e.g. "QuantKey(f8e4m3fn,scale(f32,static,GroupShape(row=128,
// col=128)),symmetric)".
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "fp8moe/dtype.hpp"

namespace fp8moe {

// A NamedTuple in vLLM; -1 means "full extent".
struct GroupShape {
  int64_t row = 0;
  int64_t col = 0;
  constexpr GroupShape() = default;
  constexpr GroupShape(int64_t r, int64_t c) : row(r), col(c) {}
  constexpr bool operator==(const GroupShape&) const = default;
  constexpr bool is_per_tensor() const { return row == -1 && col == -1; }
  constexpr bool is_per_token() const { return row == 1 && col == -1; }
  constexpr bool is_per_channel() const { return row == -1 && col == 1; }
  constexpr bool is_per_group() const { return row == 1 && col >= 1; }
  // "GroupShape(row=128, col=128)"
  std::string str() const;
};
inline constexpr GroupShape kPerTensor{-1, -1};
inline constexpr GroupShape kPerToken{1, -1};
inline constexpr GroupShape kPerChannel{-1, 1};

// Key element types. Most are torch dtypes; the int4 weight keys use vLLM ScalarTypes.
enum class KeyDType : uint8_t {
  kF8E4M3FN,
  kF8E4M3FNUZ,
  kF32,
  kU8,  // packed FP4, or MX e8m0 scale bytes
  kI8,
  kF8E8M0FNU,
  kUInt4B8,  // scalar_types.uint4b8 (symmetric int4)
  kUInt4,    // scalar_types.uint4 (asymmetric int4)
};
// "f8e4m3fn", "f32", "u8", "i8", "f8e8m0fnu", "uint4b8", "uint4"
std::string key_dtype_abbr(KeyDType t);

struct ScaleDesc {
  KeyDType dtype = KeyDType::kF32;
  bool is_static = true;
  GroupShape group_shape{};
  constexpr bool operator==(const ScaleDesc&) const = default;
  // "f32,static,per_tensor" / "f32,dynamic,GroupShape(row=1, col=128)"
  std::string str() const;
};

struct QuantKey {
  KeyDType dtype = KeyDType::kF8E4M3FN;
  ScaleDesc scale{};
  std::optional<ScaleDesc> scale2{};
  bool symmetric = true;
  bool operator==(const QuantKey&) const = default;
  std::string str() const;
};

// Optional key as the oracle passes it (None in vLLM). str() of an absent key is "None".
using OptQuantKey = std::optional<QuantKey>;
std::string key_str(const OptQuantKey& k);

// The platform's FP8 dtype: e4m3fn everywhere except MI300/MI325 (gfx94x), where it is e4m3fnuz.
// Named keys below are built for e4m3fn; with_fp8_dtype(key, platform.fp8_dtype()) (experts.hpp)
// gives the platform's flavour, as vLLM builds them with FP8_DTYPE = current_platform.fp8_dtype().
QuantKey create_fp8_quant_key(bool is_static, GroupShape group_shape, bool symmetric = true,
                              KeyDType scale_dtype = KeyDType::kF32,
                              KeyDType fp8_dtype = KeyDType::kF8E4M3FN);

// Named keys (vLLM constants), e4m3fn flavour. Constant-initialised, so safe to copy during static
// initialisation of other translation units.
extern const QuantKey kFp8StaticTensorSym;
extern const QuantKey kFp8DynamicTensorSym;
extern const QuantKey kFp8StaticTokenSym;
extern const QuantKey kFp8StaticChannelSym;
extern const QuantKey kFp8DynamicTokenSym;
extern const QuantKey kFp8Dynamic128Sym;
extern const QuantKey kFp8Static128BlockSym;
extern const QuantKey kFp8Dynamic64Sym;
extern const QuantKey kMxfp8Static;
extern const QuantKey kMxfp8Dynamic;
extern const QuantKey kMxfp4Static;
extern const QuantKey kMxfp4Dynamic;
extern const QuantKey kNvfp4Static;
extern const QuantKey kNvfp4Dynamic;
extern const QuantKey kInt8StaticChannelSym;
extern const QuantKey kInt8DynamicTokenSym;
extern const QuantKey kInt8StaticTensorSym;
extern const QuantKey kInt8DynamicTensorSym;
extern const QuantKey kInt4Static;
extern const QuantKey kInt8Static;
extern const QuantKey kInt4Static32;
extern const QuantKey kInt4StaticAsym;
extern const QuantKey kInt4Static32Asym;

// Parses a user key: a vLLM constant name ("kFp8Static128BlockSym"), "none", or the generic
// "fp8:static:64x64" / "fp8:dynamic:1x128" / "fp8:static:tensor" / "fp8:dynamic:token" /
// "fp8:static:channel" forms. Throws ValueError naming the value and the accepted forms.
OptQuantKey parse_quant_key(const std::string& text);
// The constant name for a key if it is a named one ("kFp8Static128BlockSym"), else its str().
std::string quant_key_name(const OptQuantKey& k);

}  // namespace fp8moe
