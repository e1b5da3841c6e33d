// Pieces the layer room's files share: small tensor helpers and the fp16 rounding vLLM's per-tensor
// requantisation goes through.
#pragma once

#include <fmt/format.h>

#include <bit>
#include <cstdint>
#include <string>
#include <vector>

#include "fp8moe/checkpoint.hpp"
#include "fp8moe/oracle.hpp"
#include "fp8moe/tensor.hpp"

namespace fp8moe::layer_detail {

inline int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// "(8, 1280, 256)"
inline std::string shape_str(const std::vector<int64_t>& s) {
  std::string r = "(";
  for (std::size_t i = 0; i < s.size(); ++i) r += fmt::format("{}{}", i ? ", " : "", s[i]);
  if (s.size() == 1) r += ",";
  return r + ")";
}

// float -> IEEE binary16, round to nearest even, overflow to inf, subnormals kept (torch's
// .to(torch.float16)). NaN stays NaN.
inline uint16_t float_to_f16(float f) {
  const uint32_t u = std::bit_cast<uint32_t>(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return sign | 0x7E00u;
  if (a >= 0x47800000u) {  // >= 65536: rounds to inf (65520 and above round up)
    return sign | 0x7C00u;
  }
  const int e = static_cast<int>(a >> 23) - 127;
  uint32_t m = (a & 0x7FFFFFu) | 0x800000u;
  if (a == 0) return sign;
  int shift;  // bits to drop from the 24-bit significand
  uint32_t exp_field;
  if (e < -14) {  // subnormal in fp16: units of 2^-24
    shift = 13 + (-14 - e);
    exp_field = 0;
    if (shift > 24) return sign;  // below half the smallest subnormal
  } else {
    shift = 13;
    exp_field = static_cast<uint32_t>(e + 15);
  }
  const uint32_t q = m >> shift;
  const uint32_t rem = m & ((1u << shift) - 1);
  const uint32_t half = 1u << (shift - 1);
  uint32_t r = q + ((rem > half || (rem == half && (q & 1))) ? 1u : 0u);
  uint32_t bits;
  if (exp_field == 0) {
    bits = r;  // may round up into the smallest normal: the encoding carries over naturally
  } else {
    bits = (exp_field << 10) + (r - 0x400u);  // r includes the implicit bit
    if (r == 0x800u) bits = ((exp_field + 1) << 10);
  }
  if (bits >= 0x7C00u) return sign | 0x7C00u;
  return sign | static_cast<uint16_t>(bits);
}

// A contiguous host copy of a tensor (the same tensor when it already is on the host).
inline Tensor on_host(const Tensor& t) {
  if (!t.defined() || t.device().is_cpu()) return t;
  return t.to(Device::cpu());
}

// make_fp8_moe_quant_config as Fp8MoEMethod.get_fused_moe_quant_config calls it for a layer:
// the backend's branch, the checkpoint's flags, the planned block shape, the given scale tensors.
MoeQuantConfig make_layer_quant_config(Fp8MoeBackend backend, const CheckpointQuant& q,
                                       const MoeConfig& cfg,
                                       const std::optional<std::vector<int64_t>>& block_shape,
                                       KeyDType fp8_key, const Tensor& w1_scale,
                                       const Tensor& w2_scale, const Tensor& a1_scale,
                                       const Tensor& a2_scale, const Tensor& w1_bias,
                                       const Tensor& w2_bias);

}  // namespace fp8moe::layer_detail
