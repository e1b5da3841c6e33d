// QuantKey strings and the named keys, as vLLM prints and defines them (quant_utils.py).
#include "fp8moe/quant_key.hpp"

#include <fmt/format.h>

#include <array>
#include <cctype>
#include <string>
#include <utility>

#include "fp8moe/error.hpp"

namespace fp8moe {

std::string GroupShape::str() const { return fmt::format("GroupShape(row={}, col={})", row, col); }

std::string key_dtype_abbr(KeyDType t) {
  switch (t) {
    case KeyDType::kF8E4M3FN:
      return "f8e4m3fn";
    case KeyDType::kF8E4M3FNUZ:
      return "f8e4m3fnuz";
    case KeyDType::kF32:
      return "f32";
    case KeyDType::kU8:
      return "u8";
    case KeyDType::kI8:
      return "i8";
    case KeyDType::kF8E8M0FNU:
      return "f8e8m0fnu";
    case KeyDType::kUInt4B8:
      return "uint4b8";
    case KeyDType::kUInt4:
      return "uint4";
  }
  return "?";
}

std::string ScaleDesc::str() const {
  std::string g;
  if (group_shape == kPerTensor) {
    g = "per_tensor";
  } else if (group_shape == kPerToken) {
    g = "per_token";
  } else if (group_shape == kPerChannel) {
    g = "per_channel";
  } else {
    g = group_shape.str();
  }
  return fmt::format("{},{},{}", key_dtype_abbr(dtype), is_static ? "static" : "dynamic", g);
}

std::string QuantKey::str() const {
  return fmt::format("QuantKey({},scale({}),{}{}symmetric)", key_dtype_abbr(dtype), scale.str(),
                     scale2 ? fmt::format("scale2({}),", scale2->str()) : std::string(),
                     symmetric ? "" : "a");
}

std::string key_str(const OptQuantKey& k) { return k ? k->str() : "None"; }

QuantKey create_fp8_quant_key(bool is_static, GroupShape group_shape, bool symmetric,
                              KeyDType scale_dtype, KeyDType fp8_dtype) {
  return QuantKey{fp8_dtype, ScaleDesc{scale_dtype, is_static, group_shape}, std::nullopt,
                  symmetric};
}

namespace {
constexpr KeyDType kFp8 = KeyDType::kF8E4M3FN;
constexpr QuantKey key(KeyDType dt, KeyDType sdt, bool st, GroupShape g, bool sym = true) {
  return QuantKey{dt, ScaleDesc{sdt, st, g}, std::nullopt, sym};
}
constexpr ScaleDesc kStaticTensorScale{KeyDType::kF32, true, kPerTensor};
}  // namespace

// Constant-initialised (constinit): other translation units may copy these during their own static
// initialisation.
constinit const QuantKey kFp8StaticTensorSym = key(kFp8, KeyDType::kF32, true, kPerTensor);
constinit const QuantKey kFp8DynamicTensorSym = key(kFp8, KeyDType::kF32, false, kPerTensor);
constinit const QuantKey kFp8StaticTokenSym = key(kFp8, KeyDType::kF32, true, kPerToken);
constinit const QuantKey kFp8StaticChannelSym = key(kFp8, KeyDType::kF32, true, kPerChannel);
constinit const QuantKey kFp8DynamicTokenSym = key(kFp8, KeyDType::kF32, false, kPerToken);
constinit const QuantKey kFp8Dynamic128Sym = key(kFp8, KeyDType::kF32, false, GroupShape(1, 128));
constinit const QuantKey kFp8Static128BlockSym =
    key(kFp8, KeyDType::kF32, true, GroupShape(128, 128));
constinit const QuantKey kFp8Dynamic64Sym = key(kFp8, KeyDType::kF32, false, GroupShape(1, 64));
constinit const QuantKey kMxfp8Static = key(kFp8, KeyDType::kU8, true, GroupShape(1, 32));
constinit const QuantKey kMxfp8Dynamic = key(kFp8, KeyDType::kU8, false, GroupShape(1, 32));
constinit const QuantKey kMxfp4Static = key(KeyDType::kU8, KeyDType::kU8, true, GroupShape(1, 32));
constinit const QuantKey kMxfp4Dynamic =
    key(KeyDType::kU8, KeyDType::kU8, false, GroupShape(1, 32));
constinit const QuantKey kNvfp4Static{KeyDType::kU8, ScaleDesc{kFp8, true, GroupShape(1, 16)},
                                      kStaticTensorScale, true};
constinit const QuantKey kNvfp4Dynamic{KeyDType::kU8, ScaleDesc{kFp8, false, GroupShape(1, 16)},
                                       kStaticTensorScale, true};
constinit const QuantKey kInt8StaticChannelSym =
    key(KeyDType::kI8, KeyDType::kF32, true, kPerChannel);
constinit const QuantKey kInt8DynamicTokenSym =
    key(KeyDType::kI8, KeyDType::kF32, false, kPerToken);
constinit const QuantKey kInt8StaticTensorSym =
    key(KeyDType::kI8, KeyDType::kF32, true, kPerTensor);
constinit const QuantKey kInt8DynamicTensorSym =
    key(KeyDType::kI8, KeyDType::kF32, false, kPerTensor);
// WNA16 weight keys (Marlin/Humming); only their identity matters to the FP8 oracle.
constinit const QuantKey kInt4Static =
    key(KeyDType::kUInt4B8, KeyDType::kF32, true, GroupShape(1, 128));
constinit const QuantKey kInt8Static = key(KeyDType::kI8, KeyDType::kF32, true, GroupShape(1, 128));
constinit const QuantKey kInt4Static32 =
    key(KeyDType::kUInt4B8, KeyDType::kF32, true, GroupShape(1, 32));
constinit const QuantKey kInt4StaticAsym =
    key(KeyDType::kUInt4, KeyDType::kF32, true, GroupShape(1, 128), false);
constinit const QuantKey kInt4Static32Asym =
    key(KeyDType::kUInt4, KeyDType::kF32, true, GroupShape(1, 32), false);

namespace {
const std::array<std::pair<std::string_view, const QuantKey*>, 23>& named_keys() {
  static const std::array<std::pair<std::string_view, const QuantKey*>, 23> k{{
      {"kFp8StaticTensorSym", &kFp8StaticTensorSym},
      {"kFp8DynamicTensorSym", &kFp8DynamicTensorSym},
      {"kFp8StaticTokenSym", &kFp8StaticTokenSym},
      {"kFp8StaticChannelSym", &kFp8StaticChannelSym},
      {"kFp8DynamicTokenSym", &kFp8DynamicTokenSym},
      {"kFp8Dynamic128Sym", &kFp8Dynamic128Sym},
      {"kFp8Static128BlockSym", &kFp8Static128BlockSym},
      {"kFp8Dynamic64Sym", &kFp8Dynamic64Sym},
      {"kMxfp8Static", &kMxfp8Static},
      {"kMxfp8Dynamic", &kMxfp8Dynamic},
      {"kMxfp4Static", &kMxfp4Static},
      {"kMxfp4Dynamic", &kMxfp4Dynamic},
      {"kNvfp4Static", &kNvfp4Static},
      {"kNvfp4Dynamic", &kNvfp4Dynamic},
      {"kInt8StaticChannelSym", &kInt8StaticChannelSym},
      {"kInt8DynamicTokenSym", &kInt8DynamicTokenSym},
      {"kInt8StaticTensorSym", &kInt8StaticTensorSym},
      {"kInt8DynamicTensorSym", &kInt8DynamicTensorSym},
      {"kInt4Static", &kInt4Static},
      {"kInt8Static", &kInt8Static},
      {"kInt4Static32", &kInt4Static32},
      {"kInt4StaticAsym", &kInt4StaticAsym},
      {"kInt4Static32Asym", &kInt4Static32Asym},
  }};
  return k;
}

bool parse_int(std::string_view s, int64_t& out) {
  if (s.empty() || s.size() > 9) return false;
  int64_t v = 0;
  for (char c : s) {
    if (c < '0' || c > '9') return false;
    v = v * 10 + (c - '0');
  }
  out = v;
  return true;
}
}  // namespace

OptQuantKey parse_quant_key(const std::string& text) {
  if (text == "none" || text == "None" || text.empty()) return std::nullopt;
  for (const auto& [name, k] : named_keys())
    if (name == text) return *k;
  // Generic form fp8:static|dynamic:RxC|tensor|token|channel
  const auto bad = [&]() {
    return ValueError(fmt::format(
        "unknown quant key '{}': expected a vLLM constant name (e.g. kFp8Static128BlockSym, "
        "kFp8Dynamic128Sym, kFp8StaticTensorSym), 'none', or fp8:static|dynamic:RxC|tensor|token|"
        "channel (e.g. fp8:static:64x64)",
        text));
  };
  const auto c1 = text.find(':');
  const auto c2 = c1 == std::string::npos ? std::string::npos : text.find(':', c1 + 1);
  if (c2 == std::string::npos) throw bad();
  const std::string_view dt(text.data(), c1);
  const std::string_view st(text.data() + c1 + 1, c2 - c1 - 1);
  const std::string_view gs(text.data() + c2 + 1, text.size() - c2 - 1);
  KeyDType kd;
  if (dt == "fp8" || dt == "fp8_e4m3fn") {
    kd = KeyDType::kF8E4M3FN;
  } else if (dt == "fp8_e4m3fnuz") {
    kd = KeyDType::kF8E4M3FNUZ;
  } else {
    throw bad();
  }
  bool is_static;
  if (st == "static") {
    is_static = true;
  } else if (st == "dynamic") {
    is_static = false;
  } else {
    throw bad();
  }
  GroupShape g;
  if (gs == "tensor") {
    g = kPerTensor;
  } else if (gs == "token") {
    g = kPerToken;
  } else if (gs == "channel") {
    g = kPerChannel;
  } else {
    const auto x = gs.find('x');
    int64_t r, c;
    if (x == std::string_view::npos || !parse_int(gs.substr(0, x), r) ||
        !parse_int(gs.substr(x + 1), c) || r < 1 || c < 1) {
      throw bad();
    }
    g = GroupShape(r, c);
  }
  return create_fp8_quant_key(is_static, g, true, KeyDType::kF32, kd);
}

std::string quant_key_name(const OptQuantKey& k) {
  if (!k) return "none";
  for (const auto& [name, key] : named_keys())
    if (*key == *k) return std::string(name);
  return k->str();
}

}  // namespace fp8moe
