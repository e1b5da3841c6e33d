// Top-k routing for every RoutingMethodType; see routing.hpp for the rules and their sources.
#include "numerics/routing.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "fp8moe/error.hpp"
#include "numerics/quant.hpp"

namespace fp8moe::numerics {

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

enum class Scoring { kSoftmax, kSigmoid, kSqrtSoftplus };

Scoring parse_scoring(const std::string& f) {
  if (f == "softmax") return Scoring::kSoftmax;
  if (f == "sigmoid") return Scoring::kSigmoid;
  if (f == "sqrtsoftplus") return Scoring::kSqrtSoftplus;
  throw ValueError(fmt::format("Unsupported scoring function: {}", f));
}

// Scores in float32; non-finite scores become 0 (vLLM #39391).
void score(const float* l, int64_t E, Scoring sc, float* s) {
  switch (sc) {
    case Scoring::kSoftmax: {
      float mx = kNegInf;
      for (int64_t e = 0; e < E; ++e) mx = std::fmax(mx, l[e]);  // fmaxf: NaN dropped
      float sum = 0.0f;
      for (int64_t e = 0; e < E; ++e) {
        s[e] = std::exp(l[e] - mx);
        sum += s[e];
      }
      for (int64_t e = 0; e < E; ++e) s[e] = s[e] / sum;
      break;
    }
    case Scoring::kSigmoid:
      for (int64_t e = 0; e < E; ++e) s[e] = 1.0f / (1.0f + std::exp(-l[e]));
      break;
    case Scoring::kSqrtSoftplus:
      // torch.nn.functional.softplus (beta 1, threshold 20), then sqrt.
      for (int64_t e = 0; e < E; ++e) {
        const float sp = l[e] > 20.0f ? l[e] : std::log1p(std::exp(l[e]));
        s[e] = std::sqrt(sp);
      }
      break;
  }
  for (int64_t e = 0; e < E; ++e) {
    if (!std::isfinite(s[e])) s[e] = 0.0f;
  }
}

// k largest of key[e] over e with allowed[e]; ties to the lower index; NaN keys rank lowest.
void select_topk(const float* key, int64_t E, int k, const std::vector<char>* allowed,
                 int32_t* ids) {
  std::vector<char> taken(static_cast<std::size_t>(E), 0);
  for (int j = 0; j < k; ++j) {
    int64_t best = -1;
    for (int64_t e = 0; e < E; ++e) {
      if (taken[e] || (allowed && !(*allowed)[e])) continue;
      if (best < 0) {
        best = e;
        continue;
      }
      const float a = key[e], b = key[best];
      // Strictly greater wins, so equal keys keep the lower index; a NaN never wins over a number.
      if (a > b || (std::isnan(b) && !std::isnan(a))) best = e;
    }
    if (best < 0) {  // fewer allowed experts than k: cannot happen after check_routing_config
      throw ValueError(fmt::format("routing: only {} experts are selectable for topk {}", j, k));
    }
    taken[best] = 1;
    ids[j] = static_cast<int32_t>(best);
  }
}

void renormalize(float* w, int k, float eps, bool clamp_min) {
  float sum = 0.0f;
  for (int j = 0; j < k; ++j) sum += w[j];
  float denom;
  if (clamp_min) {
    denom = std::fmax(sum, eps);  // .clamp(min=1e-20)
  } else {
    denom = sum + eps;
  }
  if (!(denom > 0.0f)) denom = 1.0f;  // weights stay 0 (or whatever they were)
  for (int j = 0; j < k; ++j) w[j] = w[j] / denom;
}

void scale(float* w, int k, double rsf) {
  if (rsf == 1.0) return;
  const float f = static_cast<float>(rsf);
  for (int j = 0; j < k; ++j) w[j] *= f;
}

// fused_topk / fused_topk_bias: scores, selection on score (+ bias), weights = unbiased scores.
void topk_scored(const float* l, int64_t E, int k, Scoring sc, const float* bias, bool renorm,
                 double rsf, bool apply_rsf, int32_t* ids, float* w) {
  std::vector<float> s(static_cast<std::size_t>(E)), key(static_cast<std::size_t>(E));
  score(l, E, sc, s.data());
  for (int64_t e = 0; e < E; ++e) key[e] = bias ? s[e] + bias[e] : s[e];
  select_topk(key.data(), E, k, nullptr, ids);
  for (int j = 0; j < k; ++j) w[j] = s[ids[j]];
  if (sc == Scoring::kSqrtSoftplus) {
    if (renorm) renormalize(w, k, 1e-20f, /*clamp_min=*/true);
  } else if (renorm) {
    renormalize(w, k, 0.0f, false);
  }
  if (apply_rsf) scale(w, k, rsf);
}

bool grouping_valid(int64_t E, int n_group) {
  return n_group > 0 && E > n_group && E % n_group == 0;
}

void grouped_topk(const float* l, int64_t E, const RoutingConfig& cfg, Scoring sc,
                  const float* bias, int32_t* ids, float* w) {
  const int k = cfg.topk;
  const int G = cfg.num_expert_group;
  const int64_t per = E / G;
  std::vector<float> s(static_cast<std::size_t>(E)), key(static_cast<std::size_t>(E));
  score(l, E, sc, s.data());
  for (int64_t e = 0; e < E; ++e) key[e] = bias ? s[e] + bias[e] : s[e];
  // Group scores: sum of the two largest biased scores, or the max score without a bias.
  std::vector<float> gs(static_cast<std::size_t>(G));
  for (int g = 0; g < G; ++g) {
    const float* kg = key.data() + g * per;
    if (bias) {
      int32_t top2[2];
      select_topk(kg, per, 2, nullptr, top2);
      gs[g] = kg[top2[0]] + kg[top2[1]];
    } else {
      float m = kNegInf;
      for (int64_t i = 0; i < per; ++i) m = std::fmax(m, kg[i]);
      gs[g] = m;
    }
  }
  std::vector<int32_t> gsel(static_cast<std::size_t>(cfg.topk_group));
  select_topk(gs.data(), G, cfg.topk_group, nullptr, gsel.data());
  std::vector<char> allowed(static_cast<std::size_t>(E), 0);
  for (int32_t g : gsel) {
    for (int64_t i = 0; i < per; ++i) allowed[g * per + i] = 1;
  }
  select_topk(key.data(), E, k, &allowed, ids);
  for (int j = 0; j < k; ++j) w[j] = s[ids[j]];
  if (cfg.renormalize) {
    const bool fused_kernel = bias && G <= 32 && k <= 32;
    renormalize(w, k, fused_kernel ? 1e-20f : 0.0f, false);
  }
  scale(w, k, cfg.routed_scaling_factor);
}

}  // namespace

void check_routing_config(const RoutingConfig& cfg, int64_t E) {
  const auto m = cfg.method;
  if (cfg.topk < 1 || cfg.topk > E) {
    throw ValueError(
        fmt::format("routing: topk ({}) must be in [1, number of experts = {}]", cfg.topk, E));
  }
  if (m == RoutingMethodType::kCustom || m == RoutingMethodType::kSimulated) {
    throw NotImplementedError(
        fmt::format("routing method {} needs a custom routing function", routing_method_name(m)));
  }
  const bool bias = cfg.e_score_correction_bias.defined();
  const bool takes_bias =
      m == RoutingMethodType::kDeepSeekV3 || m == RoutingMethodType::kMiniMax2 ||
      m == RoutingMethodType::kDeepseekV4 || m == RoutingMethodType::kUnspecified;
  if (bias && !takes_bias) {
    throw ValueError(
        fmt::format("routing method {} takes no e_score_correction_bias", routing_method_name(m)));
  }
  if (m == RoutingMethodType::kMiniMax2 && !bias) {
    throw ValueError("routing method MiniMax2 needs an e_score_correction_bias");
  }
  if (bias) {
    const TensorView& b = cfg.e_score_correction_bias;
    if (b.ndim != 1 || b.size(0) != E || (b.dtype != DType::kF32 && b.dtype != DType::kBF16) ||
        !b.device.is_cpu()) {
      throw ValueError(
          fmt::format("routing: e_score_correction_bias has shape {}, expected ({},) f32/bf16 cpu",
                      b.describe(), E));
    }
  }
  if (m == RoutingMethodType::kUnspecified || m == RoutingMethodType::kDeepseekV4) {
    parse_scoring(m == RoutingMethodType::kDeepseekV4 ? "sqrtsoftplus" : cfg.scoring_func);
  }
  const bool grouped = (m == RoutingMethodType::kDeepSeekV3 ||
                        (m == RoutingMethodType::kUnspecified && cfg.num_expert_group > 0)) &&
                       grouping_valid(E, cfg.num_expert_group);
  if (grouped) {
    const int64_t per = E / cfg.num_expert_group;
    if (cfg.topk_group < 1 || cfg.topk_group > cfg.num_expert_group) {
      throw ValueError(fmt::format("routing: topk_group ({}) must be in [1, num_expert_group = {}]",
                                   cfg.topk_group, cfg.num_expert_group));
    }
    if (cfg.topk > cfg.topk_group * per) {
      throw ValueError(fmt::format(
          "routing: topk ({}) exceeds the {} experts of the topk_group = {} selected groups",
          cfg.topk, cfg.topk_group * per, cfg.topk_group));
    }
    if (bias && per < 2) {
      throw ValueError("routing: grouped top-k with a bias needs at least 2 experts per group");
    }
  }
}

void route_row(const float* l, int64_t E, const RoutingConfig& cfg, const float* bias, int32_t* ids,
               float* w) {
  const int k = cfg.topk;
  switch (cfg.method) {
    case RoutingMethodType::kDefault:
      topk_scored(l, E, k, Scoring::kSoftmax, nullptr, false, 1.0, false, ids, w);
      return;
    case RoutingMethodType::kRenormalizeNaive:
      topk_scored(l, E, k, Scoring::kSoftmax, nullptr, true, 1.0, false, ids, w);
      return;
    case RoutingMethodType::kSigmoid:
      topk_scored(l, E, k, Scoring::kSigmoid, nullptr, false, 1.0, false, ids, w);
      return;
    case RoutingMethodType::kSigmoidRenorm:
      topk_scored(l, E, k, Scoring::kSigmoid, nullptr, true, 1.0, false, ids, w);
      return;
    case RoutingMethodType::kRenormalize: {
      // TopK on the logits, then softmax over the k selected logits (max first, fmaxf semantics).
      select_topk(l, E, k, nullptr, ids);
      float mx = kNegInf;
      for (int j = 0; j < k; ++j) mx = std::fmax(mx, l[ids[j]]);
      float sum = 0.0f;
      for (int j = 0; j < k; ++j) {
        w[j] = std::exp(l[ids[j]] - mx);
        sum += w[j];
      }
      for (int j = 0; j < k; ++j) {
        w[j] = w[j] / sum;
        if (!std::isfinite(w[j])) w[j] = 0.0f;
      }
      return;
    }
    case RoutingMethodType::kTopK:
      select_topk(l, E, k, nullptr, ids);
      for (int j = 0; j < k; ++j) w[j] = std::isfinite(l[ids[j]]) ? l[ids[j]] : 0.0f;
      return;
    case RoutingMethodType::kLlama4:
      select_topk(l, E, k, nullptr, ids);
      for (int j = 0; j < k; ++j) {
        w[j] = 1.0f / (1.0f + std::exp(-l[ids[j]]));
        if (!std::isfinite(w[j])) w[j] = 0.0f;
      }
      return;
    case RoutingMethodType::kMiniMax2: {
      std::vector<float> s(static_cast<std::size_t>(E)), key(static_cast<std::size_t>(E));
      score(l, E, Scoring::kSigmoid, s.data());
      for (int64_t e = 0; e < E; ++e) key[e] = s[e] + bias[e];
      select_topk(key.data(), E, k, nullptr, ids);
      for (int j = 0; j < k; ++j) w[j] = s[ids[j]];
      renormalize(w, k, 1e-20f, false);  // ScaledSumNormalize: routeScale / (sum + 1e-20)
      scale(w, k, cfg.routed_scaling_factor);
      return;
    }
    case RoutingMethodType::kDeepSeekV3:
    case RoutingMethodType::kUnspecified: {
      const Scoring sc = cfg.method == RoutingMethodType::kDeepSeekV3
                             ? Scoring::kSigmoid
                             : parse_scoring(cfg.scoring_func);
      const bool renorm = cfg.method == RoutingMethodType::kDeepSeekV3 ? true : cfg.renormalize;
      RoutingConfig c = cfg;
      c.renormalize = renorm;
      if ((cfg.method == RoutingMethodType::kDeepSeekV3 || cfg.num_expert_group > 0) &&
          grouping_valid(E, cfg.num_expert_group)) {
        grouped_topk(l, E, c, sc, bias, ids, w);
      } else if (bias) {
        topk_scored(l, E, k, sc, bias, renorm, cfg.routed_scaling_factor, true, ids, w);
      } else {
        topk_scored(l, E, k, sc, nullptr, renorm, 1.0, false, ids, w);
      }
      return;
    }
    case RoutingMethodType::kDeepseekV4:
      topk_scored(l, E, k, Scoring::kSqrtSoftplus, bias, true, cfg.routed_scaling_factor, true, ids,
                  w);
      return;
    case RoutingMethodType::kCustom:
    case RoutingMethodType::kSimulated:
      break;
  }
  throw NotImplementedError(
      fmt::format("routing method {} is not implemented", routing_method_name(cfg.method)));
}

RoutingResult route(const TensorView& logits, const RoutingConfig& cfg) {
  if (!logits.defined() || logits.ndim != 2 ||
      (logits.dtype != DType::kF32 && logits.dtype != DType::kBF16) || !logits.device.is_cpu() ||
      !logits.is_contiguous()) {
    throw ValueError(fmt::format(
        "routing: router_logits must be a contiguous (num_tokens, experts) f32/bf16 cpu tensor, "
        "got {}",
        logits.describe()));
  }
  const int64_t M = logits.size(0), E = logits.size(1);
  check_routing_config(cfg, E);
  std::vector<float> bias;
  if (cfg.e_score_correction_bias.defined()) {
    bias.resize(static_cast<std::size_t>(E));
    for (int64_t e = 0; e < E; ++e) bias[e] = load_float(cfg.e_score_correction_bias, e);
  }
  RoutingResult r;
  r.topk_ids = Tensor::empty({M, cfg.topk}, DType::kI32);
  r.topk_weights = Tensor::empty({M, cfg.topk}, DType::kF32);
  std::vector<float> row(static_cast<std::size_t>(E));
  for (int64_t t = 0; t < M; ++t) {
    for (int64_t e = 0; e < E; ++e) row[e] = load_float(logits, t * E + e);
    route_row(row.data(), E, cfg, bias.empty() ? nullptr : bias.data(),
              r.topk_ids.ptr<int32_t>() + t * cfg.topk, r.topk_weights.ptr<float>() + t * cfg.topk);
  }
  return r;
}

}  // namespace fp8moe::numerics
