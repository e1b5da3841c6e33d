// MoE activations (spec/numerics.md §5, oracle.md §3.6/§3.8) with vLLM's rounding points.
// Templated on the arithmetic type: the reference uses double, kernels' scalar paths float.
//
// Gated activations read gate and up from the GEMM1 output row y (already rounded to the compute
// dtype) and write I values, each rounded to the compute dtype (bf16 for bf16 inputs, f32 for f32
// inputs) at the points vLLM's kernels round:
//   silu              h = R(R(silu(g)) * u)          CUDA silu_and_mul: silu rounded, then the
//                                                    product rounded again (same for gelu*)
//   silu + clamp L>0  h = R(silu(min(g, L)) * clamp(u, -L, L))  swiglu_limit_func's pad-aware
//                                                    kernel: fp32, one rounding; alpha/beta unused
//   gelu / gelu_tanh  h = R(R(gelu(g)) * u)           gelu: exact erf; gelu_tanh: tanh form
//   swigluoai         gate = y[2i], up = y[2i+1] (interleaved); g' = min(g, 7), u' = clamp(u, +-7),
//                     h = R((u' + 1) * g' * sigmoid(1.702 g')). vLLM oddity: swigluoai_and_mul is
//                     called with its defaults alpha = 1.702, limit = 7.0 whatever is configured.
//   swigluoai_uninterleave  packed; needs clamp_limit L: h = R(g' sigmoid(alpha g') (u' + beta))
//   situ              needs situ_beta b: h = R(b tanh(g / b) sigmoid(g) * u'), u' = lb tanh(u / lb)
//                     when situ_linear_beta lb > 0, else u (Kimi's SituAndMul, fp32, one rounding)
//   swiglustep        h = R(min(silu(g), 7) * clamp(u, -7, 7)) (Triton kernel; limit fixed at 7)
//   *_no_mul          h = R(act(y)) on the full width; relu2_no_mul: R(relu(y)^2)
//   relu2 (gated)     not computed by vLLM's apply_moe_activation: ValueError, as vLLM raises.
// The snapshot's fused SiLU+quant fast path keeps h = g * sigmoid(g) * u unrounded in fp32 and
// ignores any clamp limit (a vLLM oddity; see spec §5): silu_mul_fp32 below.
#pragma once

#include <cmath>
#include <cstdint>
#include <string>

#include "fp8moe/config.hpp"
#include "fp8moe/error.hpp"
#include "fp8moe/fused_moe.hpp"
#include "fp8moe/numerics.hpp"

namespace fp8moe::numerics {

template <class T>
T sigmoid(T x) {
  return T(1) / (T(1) + std::exp(-x));
}
template <class T>
T silu(T x) {
  return x / (T(1) + std::exp(-x));
}
template <class T>
T gelu_erf(T x) {
  return x * T(0.5) * (T(1) + std::erf(x * T(0.70710678118654752440)));
}
template <class T>
T gelu_tanh(T x) {
  const T beta = T(0.79788456080286535588);  // sqrt(2 / pi)
  const T kappa = T(0.044715);
  return T(0.5) * x * (T(1) + std::tanh(beta * (x + kappa * x * x * x)));
}
template <class T>
T relu2(T x) {
  const T r = x > T(0) ? x : T(0);
  return r * r;
}
// min(x, hi) and clamp(x, lo, hi) that keep NaN (torch.clamp semantics).
template <class T>
T clamp_max(T x, T hi) {
  return x > hi ? hi : x;
}
template <class T>
T clamp_both(T x, T lo, T hi) {
  return x > hi ? hi : (x < lo ? lo : x);
}

// Rounds to the compute dtype: bf16 (through float, as a fp32 kernel rounds) or f32.
template <class T>
float round_to(T v, bool bf16) {
  const float f = static_cast<float>(v);
  return bf16 ? bf16_round(f) : f;
}

// Throws the errors vLLM raises for an activation configuration it cannot apply.
inline void check_activation_config(const ActivationConfig& c) {
  switch (c.activation) {
    case MoeActivation::kRelu2:
      // vLLM's apply_moe_activation has no gated relu2 kernel and raises this ValueError.
      throw ValueError("Unsupported FusedMoe activation: MoEActivation.RELU2");
    case MoeActivation::kSwigluOaiUninterleave:
      if (!c.clamp_limit) throw ValueError("SWIGLUOAI_UNINTERLEAVE requires clamp_limit");
      break;
    case MoeActivation::kSitu:
      if (!c.situ_beta) throw ValueError("SITU requires activation_situ_beta from FusedMoEConfig");
      if (!(*c.situ_beta != 0.0)) throw ValueError("SITU requires a non-zero activation_situ_beta");
      break;
    default:
      break;
  }
}

// Applies the activation to one GEMM1 output row `y` (2*I values when gated, I otherwise) and
// writes I values rounded to the compute dtype (`bf16` true: bfloat16, else float32).
template <class T>
void apply_activation_row(const ActivationConfig& c, const float* y, int64_t I, bool bf16,
                          float* h) {
  check_activation_config(c);
  const auto R = [bf16](T v) { return round_to<T>(v, bf16); };
  switch (c.activation) {
    case MoeActivation::kSilu:
      if (c.clamp_limit && *c.clamp_limit > 0) {
        const T L = static_cast<T>(*c.clamp_limit);
        for (int64_t i = 0; i < I; ++i) {
          h[i] = R(silu<T>(clamp_max<T>(y[i], L)) * clamp_both<T>(y[I + i], -L, L));
        }
      } else {
        for (int64_t i = 0; i < I; ++i) h[i] = R(T(R(silu<T>(y[i]))) * T(y[I + i]));
      }
      return;
    case MoeActivation::kGelu:
      for (int64_t i = 0; i < I; ++i) h[i] = R(T(R(gelu_erf<T>(y[i]))) * T(y[I + i]));
      return;
    case MoeActivation::kGeluTanh:
      for (int64_t i = 0; i < I; ++i) h[i] = R(T(R(gelu_tanh<T>(y[i]))) * T(y[I + i]));
      return;
    case MoeActivation::kSwigluOai: {
      const T alpha = T(1.702), L = T(7.0);  // vLLM oddity: the config's values are not used
      for (int64_t i = 0; i < I; ++i) {
        const T g = clamp_max<T>(y[2 * i], L), u = clamp_both<T>(y[2 * i + 1], -L, L);
        h[i] = R((u + T(1)) * g * sigmoid<T>(alpha * g));
      }
      return;
    }
    case MoeActivation::kSwigluOaiUninterleave: {
      const T L = static_cast<T>(*c.clamp_limit), alpha = static_cast<T>(c.alpha),
              beta = static_cast<T>(c.beta);
      for (int64_t i = 0; i < I; ++i) {
        const T g = clamp_max<T>(y[i], L), u = clamp_both<T>(y[I + i], -L, L);
        h[i] = R(g * sigmoid<T>(alpha * g) * (u + beta));
      }
      return;
    }
    case MoeActivation::kSitu: {
      const T b = static_cast<T>(*c.situ_beta);
      const bool lin = c.situ_linear_beta && *c.situ_linear_beta > 0;
      const T lb = lin ? static_cast<T>(*c.situ_linear_beta) : T(1);
      for (int64_t i = 0; i < I; ++i) {
        const T g = y[i];
        const T u = lin ? lb * std::tanh(T(y[I + i]) / lb) : T(y[I + i]);
        h[i] = R(b * std::tanh(g / b) * sigmoid<T>(g) * u);
      }
      return;
    }
    case MoeActivation::kSwigluStep: {
      const T L = T(7.0);
      for (int64_t i = 0; i < I; ++i) {
        h[i] = R(clamp_max<T>(silu<T>(y[i]), L) * clamp_both<T>(y[I + i], -L, L));
      }
      return;
    }
    case MoeActivation::kSiluNoMul:
      for (int64_t i = 0; i < I; ++i) h[i] = R(silu<T>(y[i]));
      return;
    case MoeActivation::kGeluNoMul:
      for (int64_t i = 0; i < I; ++i) h[i] = R(gelu_erf<T>(y[i]));
      return;
    case MoeActivation::kGeluTanhNoMul:
      for (int64_t i = 0; i < I; ++i) h[i] = R(gelu_tanh<T>(y[i]));
      return;
    case MoeActivation::kRelu2NoMul:
      for (int64_t i = 0; i < I; ++i) h[i] = R(relu2<T>(y[i]));
      return;
    case MoeActivation::kRelu2:
      break;  // rejected by check_activation_config above
  }
}

// The snapshot's fused SiLU+quant path: h = g * sigmoid(g) * u in fp32, no rounding, no clamp.
template <class T>
void silu_mul_fp32_row(const float* y, int64_t I, float* h) {
  for (int64_t i = 0; i < I; ++i) {
    const T g = y[i];
    h[i] = static_cast<float>(g * sigmoid<T>(g) * T(y[I + i]));
  }
}

}  // namespace fp8moe::numerics
