// Shared fused-MoE test helpers: problem and routing generators, output checks, comparisons.
// See moe_testing.hpp for the exact-mode construction.
#include "common/moe_testing.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <numeric>
#include <random>
#include <stdexcept>

#include "fp8moe/error.hpp"
#include "fp8moe/numerics.hpp"
#include "kernels/ref/ref.hpp"
#include "numerics/quant.hpp"

namespace fp8moe::testing {

namespace num = fp8moe::numerics;

namespace {

// ---- small utilities ---------------------------------------------------------------------------

std::mt19937_64 make_rng(uint64_t seed, uint64_t stream) {
  std::seed_seq seq{static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32),
                    static_cast<uint32_t>(stream), 0x5EEDu};
  return std::mt19937_64(seq);
}

int64_t uniform_int(std::mt19937_64& rng, int64_t lo, int64_t hi) {  // inclusive
  return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
}

Tensor host_copy(const TensorView& v) {
  if (!v.defined()) return {};
  if (v.device.is_cpu()) {
    const auto shape = v.sizes();
    Tensor t = Tensor::empty(std::span<const int64_t>(shape), v.dtype);
    std::memcpy(t.data(), v.data, v.nbytes());
    return t;
  }
  const auto& a = device_allocator();
  if (!a.copy) throw RuntimeError("device tensor given but this build has no CUDA support");
  const auto shape = v.sizes();
  Tensor t = Tensor::empty(std::span<const int64_t>(shape), v.dtype);
  a.copy(t.data(), v.data, v.nbytes(), 1);
  return t;
}

void store_float(const Tensor& t, int64_t i, float v) {
  switch (t.dtype()) {
    case DType::kF32:
      t.ptr<float>()[i] = v;
      break;
    case DType::kBF16:
      t.ptr<uint16_t>()[i] = num::float_to_bf16(v);
      break;
    default:
      throw ValueError(fmt::format("store_float: unsupported dtype {}", dtype_name(t.dtype())));
  }
}

bool needs_correction_bias(RoutingMethodType m) {
  return m == RoutingMethodType::kDeepSeekV3 || m == RoutingMethodType::kMiniMax2;
}

int64_t n1_rows(const MoeTestSpec& s) {
  return activation_is_gated(s.act.activation) ? 2 * s.I : s.I;
}

// Row of w13 that feeds gate(i) / up(i) of the intermediate index i.
int64_t gate_row(const MoeTestSpec& s, int64_t i) {
  return s.act.activation == MoeActivation::kSwigluOai ? 2 * i : i;
}
int64_t up_row(const MoeTestSpec& s, int64_t i) {
  return s.act.activation == MoeActivation::kSwigluOai ? 2 * i + 1 : s.I + i;
}

bool act_saturates(MoeActivation a) {
  switch (a) {
    case MoeActivation::kSilu:
    case MoeActivation::kGelu:
    case MoeActivation::kGeluTanh:
    case MoeActivation::kSwigluOai:
    case MoeActivation::kSwigluOaiUninterleave:
    case MoeActivation::kSitu:
    case MoeActivation::kSwigluStep:
    case MoeActivation::kSiluNoMul:
    case MoeActivation::kGeluNoMul:
    case MoeActivation::kGeluTanhNoMul:
      return true;
    default:
      return false;
  }
}

// Whether the second quantisation's scale is a power of two whatever h's amax is.
bool a2_scale_pow2_by_construction(const MoeScheme& s) {
  return s.act == ActQuantKind::kNone || s.act == ActQuantKind::kPerTensorStatic ||
         s.act == ActQuantKind::kMxfp8 ||
         (s.act == ActQuantKind::kPerGroupDynamic && s.ue8m0_scales);
}

bool is_pow2_times(double v, double base) {
  if (!(v > 0)) return false;
  int e = 0;
  const double m = std::frexp(v / base, &e);
  return m == 0.5;
}

void check_exact_supported(const MoeTestSpec& s) {
  const auto fail = [&](const std::string& why) {
    throw NotImplementedError(fmt::format("exact mode cannot build {}: {}", s.name(), why));
  };
  const MoeActivation a = s.act.activation;
  if (!act_saturates(a) && a != MoeActivation::kRelu2NoMul) {
    fail(fmt::format("activation {} has no exactly computable form", activation_value(a)));
  }
  const bool pow2_a2 = a2_scale_pow2_by_construction(s.scheme);
  if ((a == MoeActivation::kSwigluStep || a == MoeActivation::kRelu2NoMul) && !pow2_a2) {
    fail(fmt::format(
        "{} needs a second quantisation whose scale is a power of two by construction (static "
        "per-tensor, MXFP8, UE8M0 or none)",
        activation_value(a)));
  }
  if (a == MoeActivation::kSilu && s.act.clamp_limit && *s.act.clamp_limit > 0) {
    const double L = *s.act.clamp_limit;
    if (!(L >= 8192 && is_pow2_times(L, num::quant_fp8_max(s.scheme.fp8)))) {
      fail(fmt::format("the SiLU clamp limit must be fp8_max * 2^j >= 8192 (e.g. {}), got {}",
                       num::quant_fp8_max(s.scheme.fp8) * 32, L));
    }
  }
  if (a == MoeActivation::kSwigluOaiUninterleave &&
      !(s.act.clamp_limit && *s.act.clamp_limit == 7.0 && s.act.alpha == 1.702 &&
        s.act.beta == 1.0)) {
    fail("swigluoai_uninterleave needs clamp_limit 7, alpha 1.702, beta 1 (gpt-oss)");
  }
  if (a == MoeActivation::kSitu) {
    if (!s.act.situ_beta || !is_pow2_times(*s.act.situ_beta, 1.0) || *s.act.situ_beta > 4 ||
        (s.act.situ_linear_beta && *s.act.situ_linear_beta > 0)) {
      fail("situ needs a power-of-two situ_beta <= 4 and no situ_linear_beta");
    }
  }
  if (s.routing == RoutingPattern::kLogits && (s.topk > 2 || s.apply_router_weight_on_input)) {
    fail(
        "router-logit routing gives arbitrary fp32 weights: exact only for topk <= 2 and without "
        "apply_router_weight_on_input");
  }
  if (s.H > 1024 || s.I > 1024) fail("exact problems are limited to H, I <= 1024");
  if (s.H % 32 != 0 || s.I % 32 != 0) fail("exact mode needs H and I to be multiples of 32");
}

// ---- exact-mode data ---------------------------------------------------------------------------

struct ExactPlan {
  std::vector<int> a;  // per-token exponent
  int64_t p0 = 0;      // positive segment-0 anchor of x
  int64_t psrc = 0;    // gate source position in segment 0
};

// Exponent of the weight scale for (row, col) of matrix `which` (0 = w13, 1 = w2) of expert e, in
// {-1, 0, 1}; gate rows of w13 at the gate source use the per-expert b_g.
struct ScaleExps {
  std::vector<int> bg;  // per local expert
  uint64_t seed = 0;
  int exp_for(int which, int64_t e, int64_t a, int64_t b) const {
    // A deterministic hash of the scale cell, so every layout sees consistent exponents.
    uint64_t h = seed ^ (0x9E3779B97F4A7C15ull * static_cast<uint64_t>(which + 1));
    h ^= static_cast<uint64_t>(e) * 0xBF58476D1CE4E5B9ull;
    h ^= static_cast<uint64_t>(a) * 0x94D049BB133111EBull;
    h ^= static_cast<uint64_t>(b) * 0xD6E8FEB86659FD93ull;
    h ^= h >> 31;
    h *= 0x9E3779B97F4A7C15ull;
    h ^= h >> 29;
    return static_cast<int>(h % 3) - 1;
  }
};

}  // namespace

// ---- names
// ------------------------------------------------------------------------------------------

std::string_view routing_pattern_name(RoutingPattern p) {
  switch (p) {
    case RoutingPattern::kUniform:
      return "uniform";
    case RoutingPattern::kEveryExpertHit:
      return "every_expert_hit";
    case RoutingPattern::kOneHotExpert:
      return "one_hot_expert";
    case RoutingPattern::kSomeExpertsEmpty:
      return "some_experts_empty";
    case RoutingPattern::kLogits:
      return "logits";
  }
  return "?";
}

std::string MoeTestSpec::name() const {
  std::string n =
      fmt::format("M{}_E{}_H{}_I{}_k{}_{}_{}_{}_{}_{}", M, E, H, I, topk, scheme.str(),
                  activation_value(act.activation), dtype_name(x_dtype),
                  mode == MoeTestMode::kExact ? "exact" : "stat", routing_pattern_name(routing));
  if (routing == RoutingPattern::kLogits) {
    n += fmt::format("_{}", routing_method_name(routing_config.method));
  }
  if (bias) n += "_bias";
  if (ep_size > 1) n += fmt::format("_ep{}of{}", ep_rank, ep_size);
  if (apply_router_weight_on_input) n += "_wi";
  if (padded_slots) n += fmt::format("_pad{}", padded_slots);
  if (seed) n += fmt::format("_s{}", seed);
  for (char& c : n) {
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '_') c = '_';
  }
  return n;
}

// ---- routing
// ----------------------------------------------------------------------------------------

RoutingDraw make_routing(int64_t M, int64_t E, int topk, RoutingPattern pattern, MoeTestMode mode,
                         uint64_t seed) {
  if (topk < 1 || topk > E) {
    throw ValueError(fmt::format("make_routing: topk {} must be in [1, E={}]", topk, E));
  }
  if (pattern == RoutingPattern::kLogits) {
    throw ValueError("make_routing: use make_router_logits for RoutingPattern::kLogits");
  }
  if (pattern == RoutingPattern::kEveryExpertHit && M * topk < E) {
    throw ValueError(fmt::format(
        "make_routing: every_expert_hit needs M * topk >= E, got M={} topk={} E={}", M, topk, E));
  }
  auto rng = make_rng(seed, 1);
  RoutingDraw d;
  d.topk_ids = Tensor::empty({M, topk}, DType::kI32);
  d.topk_weights = Tensor::empty({M, topk}, DType::kF32);
  std::vector<int32_t> pool(static_cast<std::size_t>(E));
  std::iota(pool.begin(), pool.end(), 0);
  if (pattern == RoutingPattern::kSomeExpertsEmpty) {
    std::shuffle(pool.begin(), pool.end(), rng);
    pool.resize(static_cast<std::size_t>(std::max<int64_t>(topk, E / 2)));
  }
  const int32_t hot = static_cast<int32_t>(uniform_int(rng, 0, E - 1));
  int64_t next_forced = 0;  // for every_expert_hit: experts 0..E-1 dealt round-robin first
  std::vector<int32_t> perm(static_cast<std::size_t>(E));
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  for (int64_t t = 0; t < M; ++t) {
    std::vector<int32_t> chosen;
    if (pattern == RoutingPattern::kOneHotExpert) chosen.push_back(hot);
    if (pattern == RoutingPattern::kEveryExpertHit) {
      while (static_cast<int>(chosen.size()) < topk && next_forced < E) {
        chosen.push_back(perm[static_cast<std::size_t>(next_forced++)]);
      }
    }
    std::vector<int32_t> rest;
    for (int32_t e : pool) {
      if (std::find(chosen.begin(), chosen.end(), e) == chosen.end()) rest.push_back(e);
    }
    std::shuffle(rest.begin(), rest.end(), rng);
    for (std::size_t i = 0; static_cast<int>(chosen.size()) < topk; ++i) chosen.push_back(rest[i]);
    std::shuffle(chosen.begin(), chosen.end(), rng);
    double sum = 0;
    std::vector<double> w(static_cast<std::size_t>(topk));
    for (int j = 0; j < topk; ++j) {
      if (mode == MoeTestMode::kExact) {
        w[j] = std::ldexp(1.0, -static_cast<int>(uniform_int(rng, 0, 2)));
      } else {
        w[j] = std::uniform_real_distribution<double>(0.05, 1.0)(rng);
        sum += w[j];
      }
    }
    for (int j = 0; j < topk; ++j) {
      d.topk_ids.ptr<int32_t>()[t * topk + j] = chosen[static_cast<std::size_t>(j)];
      d.topk_weights.ptr<float>()[t * topk + j] =
          static_cast<float>(mode == MoeTestMode::kExact ? w[j] : w[j] / sum);
    }
  }
  return d;
}

LogitsDraw make_router_logits(int64_t M, int64_t E, RoutingMethodType method, uint64_t seed,
                              bool with_ties) {
  auto rng = make_rng(seed, 2);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  LogitsDraw d;
  d.logits = Tensor::empty({M, E}, DType::kF32);
  for (int64_t i = 0; i < M * E; ++i) {
    float v = nd(rng);
    if (with_ties) v = std::round(v * 2.0f) / 2.0f;  // few distinct values: many exact ties
    d.logits.ptr<float>()[i] = v;
  }
  if (needs_correction_bias(method)) {
    d.e_score_correction_bias = Tensor::empty({E}, DType::kF32);
    for (int64_t e = 0; e < E; ++e) {
      float v = 0.1f * nd(rng);
      if (with_ties) v = std::round(v * 8.0f) / 8.0f;
      d.e_score_correction_bias.ptr<float>()[e] = v;
    }
  }
  return d;
}

// ---- the generator
// ------------------------------------------------------------------------------------

namespace {

void validate_spec(const MoeTestSpec& s) {
  const auto bad = [&](const std::string& why) {
    throw ValueError(fmt::format("make_problem({}): {}", s.name(), why));
  };
  if (s.M < 0 || s.E < 1 || s.H < 1 || s.I < 1) bad("sizes must be positive (M >= 0)");
  if (s.topk < 1 || s.topk > s.E) bad(fmt::format("topk {} must be in [1, E={}]", s.topk, s.E));
  if (s.ep_size < 1 || s.E % s.ep_size != 0 || s.ep_rank < 0 || s.ep_rank >= s.ep_size) {
    bad(fmt::format("ep_size {} must divide E {} and 0 <= ep_rank {} < ep_size", s.ep_size, s.E,
                    s.ep_rank));
  }
  if (s.x_dtype != DType::kBF16 && s.x_dtype != DType::kF32) bad("x_dtype must be bf16 or f32");
  if (s.apply_router_weight_on_input && s.topk != 1) {
    bad("apply_router_weight_on_input needs topk == 1");
  }
  if (s.padded_slots < 0 || s.padded_slots > s.M * s.topk) bad("padded_slots out of range");
  if (s.scheme.weight == WeightScaleKind::kMx || s.scheme.act == ActQuantKind::kMxfp8) {
    if (s.H % 32 != 0 || s.I % 32 != 0) bad("MXFP8 needs H and I to be multiples of 32");
  }
}

// Quantises a real (E, R, C) f32 weight with the scheme's weight quantiser.
num::QuantizedTensor quantize_weight(const Tensor& w, const MoeScheme& sc, bool shard_scales,
                                     bool is_w13) {
  switch (sc.weight) {
    case WeightScaleKind::kBlock:
      return num::per_block_cast_to_fp8(w, sc.block_n, sc.block_k, sc.fp8, sc.ue8m0_scales);
    case WeightScaleKind::kPerChannel:
      return num::per_channel_cast_to_fp8(w, sc.fp8);
    case WeightScaleKind::kMx:
      return num::mx_cast_to_fp8(w);
    case WeightScaleKind::kPerTensor:
      break;
  }
  if (!(is_w13 && shard_scales)) return num::per_tensor_cast_to_fp8(w, sc.fp8);
  // One scale per (expert, shard): quantise the gate and up halves separately.
  const int64_t E = w.size(0), R = w.size(1), C = w.size(2), half = R / 2;
  num::QuantizedTensor out;
  out.q = Tensor::empty({E, R, C}, sc.fp8);
  out.scale = Tensor::empty({E, 2}, DType::kF32);
  for (int64_t e = 0; e < E; ++e) {
    for (int64_t s = 0; s < 2; ++s) {
      Tensor part = Tensor::empty({1, half, C}, DType::kF32);
      std::memcpy(part.data(), w.ptr<float>() + (e * R + s * half) * C,
                  static_cast<std::size_t>(half * C) * sizeof(float));
      const auto q = num::per_tensor_cast_to_fp8(part, sc.fp8);
      std::memcpy(out.q.ptr<uint8_t>() + (e * R + s * half) * C, q.q.data(),
                  static_cast<std::size_t>(half * C));
      out.scale.ptr<float>()[e * 2 + s] = q.scale.ptr<float>()[0];
    }
  }
  return out;
}

// The scale cell (a, b) of element (r, c) for the layouts above.
std::pair<int64_t, int64_t> scale_cell(const MoeScheme& sc, int64_t R, int64_t r, int64_t c,
                                       bool is_w13, bool shard_scales) {
  switch (sc.weight) {
    case WeightScaleKind::kBlock:
      return {r / sc.block_n, c / sc.block_k};
    case WeightScaleKind::kPerTensor:
      return {(is_w13 && shard_scales) ? (r >= R / 2 ? 1 : 0) : 0, 0};
    case WeightScaleKind::kPerChannel:
      return {r, 0};
    case WeightScaleKind::kMx:
      return {r, c / 32};
  }
  return {0, 0};
}

// Builds the exact-mode weights of one matrix: codes via `code(e, r, c)` (real values), scales
// 2^exp from `exps` (gate-source cells forced to b_g).
void fill_exact_weight(const MoeTestSpec& s, bool is_w13, int64_t E, int64_t R, int64_t C,
                       const ScaleExps& exps,
                       const std::function<float(int64_t, int64_t, int64_t)>& code,
                       const std::function<bool(int64_t, int64_t)>& is_gate_source_cell, Tensor& q,
                       Tensor& scale, Tensor& real) {
  const MoeScheme& sc = s.scheme;
  q = Tensor::empty({E, R, C}, sc.fp8);
  real = Tensor::empty({E, R, C}, DType::kF32);
  const auto sshape = weight_scale_shape(sc, E, R, C, is_w13, s.w13_shard_scales);
  const bool mx = sc.weight == WeightScaleKind::kMx;
  scale = Tensor::empty(std::span<const int64_t>(sshape), mx ? DType::kU8 : DType::kF32);
  const int64_t per_e = scale.numel() / E;
  // Fill scales cell by cell.
  const int64_t ncols = sshape.size() == 3 ? sshape[2] : (sshape.size() == 2 ? sshape[1] : 1);
  for (int64_t e = 0; e < E; ++e) {
    for (int64_t i = 0; i < per_e; ++i) {
      const int64_t a = sshape.size() >= 2 ? i / ncols : 0;
      const int64_t b = sshape.size() >= 2 ? i % ncols : i;
      const int ex = exps.exp_for(is_w13 ? 0 : 1, e, a, sshape.size() == 1 ? 0 : b);
      if (mx) {
        scale.ptr<uint8_t>()[e * per_e + i] = static_cast<uint8_t>(127 + ex);
      } else {
        scale.ptr<float>()[e * per_e + i] = std::ldexp(1.0f, ex);
      }
    }
  }
  // Gate-source cells take b_g (all gate rows of an expert must share one gate value).
  for (int64_t e = 0; e < E; ++e) {
    for (int64_t r = 0; r < R; ++r) {
      for (int64_t c = 0; c < C; ++c) {
        if (!is_gate_source_cell(r, c)) continue;
        const auto [a, b] = scale_cell(sc, R, r, c, is_w13, s.w13_shard_scales);
        const int64_t idx = sshape.size() == 1 ? 0 : (sshape.size() == 2 ? a : a * ncols + b);
        const int64_t flat = e * per_e + (sshape.size() == 1 ? 0 : idx);
        const int ex = exps.bg[static_cast<std::size_t>(e)];
        if (mx) {
          scale.ptr<uint8_t>()[flat] = static_cast<uint8_t>(127 + ex);
        } else {
          scale.ptr<float>()[flat] = std::ldexp(1.0f, ex);
        }
      }
    }
  }
  for (int64_t e = 0; e < E; ++e) {
    for (int64_t r = 0; r < R; ++r) {
      for (int64_t c = 0; c < C; ++c) {
        const float v = code(e, r, c);
        const uint8_t qc = num::float_to_fp8(sc.fp8, v);
        if (num::fp8_to_float(sc.fp8, qc) != v) {
          throw std::logic_error(fmt::format("exact weight value {} is not on the fp8 grid", v));
        }
        const int64_t i = (e * R + r) * C + c;
        q.ptr<uint8_t>()[i] = qc;
        const auto [a, b] = scale_cell(sc, R, r, c, is_w13, s.w13_shard_scales);
        const int64_t idx = sshape.size() == 1 ? 0 : (sshape.size() == 2 ? a : a * ncols + b);
        const float sv = mx ? num::e8m0_to_float(scale.ptr<uint8_t>()[e * per_e + idx])
                            : scale.ptr<float>()[e * per_e + idx];
        real.ptr<float>()[i] = v * sv;
      }
    }
  }
}

void build_exact(const MoeTestSpec& s, MoeTestProblem& p, std::mt19937_64& rng) {
  check_exact_supported(s);
  const int64_t E = s.num_local_experts(), H = s.H, I = s.I, N1 = n1_rows(s);
  const float F = num::quant_fp8_max(s.scheme.fp8);
  const bool fnuz = s.scheme.fp8 == DType::kF8E4M3FNUZ;
  const float big = fnuz ? 128.0f : 256.0f;  // power-of-two weight code for anchors and gates
  const bool gated = activation_is_gated(s.act.activation);
  ExactPlan plan;
  plan.p0 = uniform_int(rng, 0, 31);
  plan.psrc = (plan.p0 + uniform_int(rng, 1, 31)) % 32;
  plan.a.resize(static_cast<std::size_t>(s.M));
  for (auto& a : plan.a) a = static_cast<int>(uniform_int(rng, -2, 0));
  // x: anchors per 32-segment, the gate source, small integers elsewhere.
  const int64_t nseg = H / 32;
  std::vector<int64_t> anchor_pos(static_cast<std::size_t>(nseg));
  std::vector<int> seg_d(static_cast<std::size_t>(nseg));
  for (int64_t sg = 0; sg < nseg; ++sg) {
    anchor_pos[sg] = sg == 0 ? plan.p0 : sg * 32 + uniform_int(rng, 0, 31);
    seg_d[sg] = sg == 0 ? 0 : -static_cast<int>(uniform_int(rng, 0, 1));
  }
  p.x = Tensor::empty({s.M, H}, s.x_dtype);
  for (int64_t t = 0; t < s.M; ++t) {
    const int a = plan.a[static_cast<std::size_t>(t)];
    for (int64_t k = 0; k < H; ++k) {
      const int64_t sg = k / 32;
      float v;
      if (k == anchor_pos[sg]) {
        const float sign = (sg == 0 || uniform_int(rng, 0, 1)) ? 1.0f : -1.0f;
        v = sign * F * std::ldexp(1.0f, a + seg_d[sg]);
      } else if (k == plan.psrc) {
        v = 16.0f * std::ldexp(1.0f, a);
      } else {
        v = static_cast<float>(uniform_int(rng, -4, 4)) * std::ldexp(1.0f, a);
      }
      store_float(p.x, t * H + k, v);
    }
  }
  // w13: gate rows (source only), anchor up rows (p0 only), dense {-1,0,1} elsewhere.
  std::vector<char> is_anchor_i(static_cast<std::size_t>(I), 0),
      gate_zero(static_cast<std::size_t>(I), 0);
  for (int64_t g = 0; g < I / 32; ++g) is_anchor_i[g * 32 + uniform_int(rng, 0, 31)] = 1;
  for (int64_t i = 0; i < I; ++i) gate_zero[i] = !is_anchor_i[i] && uniform_int(rng, 0, 3) == 0;
  const bool dense_nongated = s.act.activation == MoeActivation::kRelu2NoMul;
  // Row kinds of w13: 0 dense, 1 gate source, 2 anchor (p0), 3 zero.
  std::vector<int> kind(static_cast<std::size_t>(N1), 0);
  for (int64_t i = 0; i < I; ++i) {
    if (gated) {
      kind[gate_row(s, i)] = gate_zero[i] ? 3 : 1;
      kind[up_row(s, i)] = is_anchor_i[i] ? 2 : 0;
    } else if (!dense_nongated) {
      kind[i] = is_anchor_i[i] ? 2 : (gate_zero[i] ? 3 : 1);
    }
  }
  const uint64_t wseed = rng();
  auto w13_code = [&](int64_t e, int64_t r, int64_t c) -> float {
    switch (kind[r]) {
      case 1:
        return c == plan.psrc ? big : 0.0f;
      case 2:
        return c == plan.p0 ? big : 0.0f;
      case 3:
        return 0.0f;
      default: {
        uint64_t h = wseed ^ (static_cast<uint64_t>(e) << 40) ^ (static_cast<uint64_t>(r) << 20) ^
                     static_cast<uint64_t>(c);
        h *= 0x9E3779B97F4A7C15ull;
        h ^= h >> 33;
        return static_cast<float>(static_cast<int>(h % 3) - 1);
      }
    }
  };
  ScaleExps exps;
  exps.seed = rng();
  exps.bg.resize(static_cast<std::size_t>(E));
  for (auto& b : exps.bg) b = static_cast<int>(uniform_int(rng, -1, 1));
  // The gate source cells: every gate-source row at column psrc. Per-tensor scales are one cell,
  // so the whole expert (or the gate shard) takes b_g.
  auto gate_cell = [&](int64_t r, int64_t c) { return kind[r] == 1 && c == plan.psrc; };
  fill_exact_weight(s, true, E, N1, H, exps, w13_code, gate_cell, p.w13, p.w13_scale, p.w13_real);
  const uint64_t w2seed = rng();
  auto w2_code = [&](int64_t e, int64_t r, int64_t c) -> float {
    uint64_t h = w2seed ^ (static_cast<uint64_t>(e) << 40) ^ (static_cast<uint64_t>(r) << 20) ^
                 static_cast<uint64_t>(c);
    h *= 0xBF58476D1CE4E5B9ull;
    h ^= h >> 31;
    return static_cast<float>(static_cast<int>(h % 3) - 1);
  };
  auto no_cell = [](int64_t, int64_t) { return false; };
  fill_exact_weight(s, false, E, H, I, exps, w2_code, no_cell, p.w2, p.w2_scale, p.w2_real);
  if (s.bias) {
    p.w13_bias = Tensor::zeros({E, N1}, DType::kF32);
    p.w2_bias = Tensor::empty({E, H}, DType::kF32);
    for (int64_t e = 0; e < E; ++e) {
      for (int64_t r = 0; r < N1; ++r) {
        if (kind[r] == 0)
          p.w13_bias.ptr<float>()[e * N1 + r] = static_cast<float>(uniform_int(rng, -2, 2));
      }
      for (int64_t m = 0; m < H; ++m) {
        p.w2_bias.ptr<float>()[e * H + m] = static_cast<float>(uniform_int(rng, -2, 2));
      }
    }
  }
  if (s.scheme.act == ActQuantKind::kPerTensorStatic) {
    const int amax_a = s.M ? *std::max_element(plan.a.begin(), plan.a.end()) : 0;
    p.a13_scale = Tensor::scalar_f32(std::ldexp(1.0f, amax_a));
  }
}

void build_statistical(const MoeTestSpec& s, MoeTestProblem& p, std::mt19937_64& rng) {
  const int64_t E = s.num_local_experts(), H = s.H, I = s.I, N1 = n1_rows(s);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  p.x = Tensor::empty({s.M, H}, s.x_dtype);
  for (int64_t i = 0; i < s.M * H; ++i) {
    store_float(p.x, i, num::bf16_round(nd(rng) / 10.0f));
  }
  // Real weights: randn/15 rounded to bf16 (vLLM's w_16), then the scheme's quantiser.
  p.w13_real = Tensor::empty({E, N1, H}, DType::kF32);
  for (int64_t i = 0; i < p.w13_real.numel(); ++i) {
    p.w13_real.ptr<float>()[i] = num::bf16_round(nd(rng) / 15.0f);
  }
  p.w2_real = Tensor::empty({E, H, I}, DType::kF32);
  for (int64_t i = 0; i < p.w2_real.numel(); ++i) {
    p.w2_real.ptr<float>()[i] = num::bf16_round(nd(rng) / 15.0f);
  }
  auto q13 = quantize_weight(p.w13_real, s.scheme, s.w13_shard_scales, true);
  auto q2 = quantize_weight(p.w2_real, s.scheme, false, false);
  p.w13 = q13.q;
  p.w13_scale = q13.scale;
  p.w2 = q2.q;
  p.w2_scale = q2.scale;
  if (s.bias) {
    p.w13_bias = Tensor::empty({E, N1}, DType::kF32);
    p.w2_bias = Tensor::empty({E, H}, DType::kF32);
    for (int64_t i = 0; i < E * N1; ++i) p.w13_bias.ptr<float>()[i] = nd(rng) / 10.0f;
    for (int64_t i = 0; i < E * H; ++i) p.w2_bias.ptr<float>()[i] = nd(rng) / 10.0f;
  }
  if (s.scheme.act == ActQuantKind::kPerTensorStatic) {
    float amax = 0.0f;
    for (int64_t i = 0; i < s.M * H; ++i) {
      amax = std::max(amax, std::fabs(num::load_float(p.x.view(), i)));
    }
    p.a13_scale = Tensor::scalar_f32(amax > 0 ? amax / num::quant_fp8_max(s.scheme.fp8) : 1.0f);
  }
}

// Static second-quantisation scale from a calibration run of the reference with dynamic
// per-tensor activations: amax(h) / fp8_max (rounded up to a power of two in exact mode).
void calibrate_a2(MoeTestProblem& p) {
  if (p.spec.scheme.act != ActQuantKind::kPerTensorStatic) return;
  MoeTestProblem c = p;
  c.spec.scheme.act = ActQuantKind::kPerTensorDynamic;
  c.out = Tensor::empty({p.spec.M, p.spec.H}, p.spec.x_dtype);
  ref::detail::Trace trace;
  ref::detail::fused_moe_with(c.args(), {}, &trace);
  const float F = num::quant_fp8_max(p.spec.scheme.fp8);
  float s = trace.h_amax > 0 ? trace.h_amax / F : 1.0f;
  if (p.spec.mode == MoeTestMode::kExact) s = num::ceil_pow2(s);
  p.a2_scale = Tensor::scalar_f32(s);
}

bool pow2(float v) {
  int e = 0;
  return v > 0 && std::frexp(v, &e) == 0.5f;
}

// Empty string when the problem is exact: every dynamic scale a power of two, and the reference in
// float64 and in float32 with both summation orders agreeing bit for bit.
std::string exactness_problem(const MoeTestProblem& p) {
  if (p.spec.M == 0) return {};
  std::vector<Tensor> outs;
  for (const ref::detail::Options o :
       {ref::detail::Options{false, false}, ref::detail::Options{false, true},
        ref::detail::Options{true, false}, ref::detail::Options{true, true}}) {
    MoeTestProblem c = p;
    c.out = Tensor::empty({p.spec.M, p.spec.H}, p.spec.x_dtype);
    ref::detail::Trace trace;
    ref::detail::fused_moe_with(c.args(), o, &trace);
    for (float s : trace.a1_scales) {
      if (!pow2(s)) return fmt::format("a first-quantisation scale {} is not a power of two", s);
    }
    for (float s : trace.a2_scales) {
      if (!pow2(s)) return fmt::format("a second-quantisation scale {} is not a power of two", s);
    }
    outs.push_back(c.out);
  }
  for (std::size_t i = 1; i < outs.size(); ++i) {
    const CompareReport r = compare_bitwise(outs[i], outs[0]);
    if (!r.ok) {
      return fmt::format("variant {} (float32={}, reverse={}) differs from float64: {}", i, i >= 2,
                         i % 2 == 1, r.str());
    }
  }
  return {};
}

}  // namespace

std::vector<int64_t> weight_scale_shape(const MoeScheme& sc, int64_t E, int64_t R, int64_t C,
                                        bool is_w13, bool shard_scales) {
  switch (sc.weight) {
    case WeightScaleKind::kBlock:
      return {E, (R + sc.block_n - 1) / sc.block_n, (C + sc.block_k - 1) / sc.block_k};
    case WeightScaleKind::kPerTensor:
      return (is_w13 && shard_scales) ? std::vector<int64_t>{E, 2} : std::vector<int64_t>{E};
    case WeightScaleKind::kPerChannel:
      return {E, R};
    case WeightScaleKind::kMx:
      return {E, R, C / 32};
  }
  return {};
}

MoeTestProblem make_problem(const MoeTestSpec& spec_in) {
  MoeTestSpec s = spec_in;
  validate_spec(s);
  s.routing_config.topk = s.topk;
  MoeTestProblem p;
  p.spec = s;
  auto rng = make_rng(s.seed, 0);
  if (s.mode == MoeTestMode::kExact) {
    build_exact(s, p, rng);
  } else {
    build_statistical(s, p, rng);
  }
  // Routing.
  if (s.routing == RoutingPattern::kLogits) {
    LogitsDraw d = make_router_logits(s.M, s.E, s.routing_config.method, s.seed);
    p.router_logits = d.logits;
    p.e_score_correction_bias = d.e_score_correction_bias;
  } else {
    RoutingDraw d = make_routing(s.M, s.E, s.topk, s.routing, s.mode, s.seed);
    p.topk_ids = d.topk_ids;
    p.topk_weights = d.topk_weights;
    // Padded slots: -1 ids at random (token, slot) positions.
    auto prng = make_rng(s.seed, 3);
    std::vector<int64_t> slots(static_cast<std::size_t>(s.M * s.topk));
    std::iota(slots.begin(), slots.end(), 0);
    std::shuffle(slots.begin(), slots.end(), prng);
    for (int64_t i = 0; i < s.padded_slots; ++i) p.topk_ids.ptr<int32_t>()[slots[i]] = -1;
  }
  if (s.ep_size > 1) {
    const int64_t el = s.num_local_experts(), start = s.ep_rank * el;
    p.expert_map = Tensor::empty({s.E}, DType::kI32);
    for (int64_t g = 0; g < s.E; ++g) {
      p.expert_map.ptr<int32_t>()[g] =
          (g >= start && g < start + el) ? static_cast<int32_t>(g - start) : -1;
    }
  }
  p.out = Tensor::empty({s.M, s.H}, s.x_dtype);
  calibrate_a2(p);
  if (s.mode == MoeTestMode::kExact) {
    const std::string why = exactness_problem(p);
    if (!why.empty()) {
      throw std::logic_error(fmt::format(
          "make_problem({}): the exact-mode construction is not exact: {} (a generator bug, or "
          "sizes beyond what exact mode supports)",
          s.name(), why));
    }
  }
  poison(p.out);
  return p;
}

Tensor reference_output(const MoeTestProblem& p_in) {
  const MoeTestProblem p = p_in.x.device().is_cpu() ? p_in : p_in.to(Device::cpu());
  Tensor out = Tensor::empty({p.spec.M, p.spec.H}, p.spec.x_dtype);
  FusedMoeArgs a = p.args();
  a.out = out;
  ref::fused_moe(a);
  return out;
}

FusedMoeArgs MoeTestProblem::args() const {
  FusedMoeArgs a;
  a.x = x;
  if (topk_ids.defined()) {
    a.topk_ids = topk_ids;
    a.topk_weights = topk_weights;
  } else {
    a.router_logits = router_logits;
  }
  a.routing = spec.routing_config;
  a.routing.topk = spec.topk;
  a.routing.e_score_correction_bias = e_score_correction_bias.view();
  a.weights.w13 = w13;
  a.weights.w2 = w2;
  a.weights.w13_scale = w13_scale;
  a.weights.w2_scale = w2_scale;
  a.weights.w13_bias = w13_bias.view();
  a.weights.w2_bias = w2_bias.view();
  a.weights.a13_scale = a13_scale.view();
  a.weights.a2_scale = a2_scale.view();
  a.scheme = spec.scheme;
  a.act = spec.act;
  a.expert_map = expert_map.view();
  a.apply_router_weight_on_input = spec.apply_router_weight_on_input;
  a.out = out;
  return a;
}

MoeTestProblem MoeTestProblem::to(Device device) const {
  MoeTestProblem p = *this;
  for (Tensor* t :
       {&p.x, &p.router_logits, &p.e_score_correction_bias, &p.topk_ids, &p.topk_weights, &p.w13,
        &p.w2, &p.w13_scale, &p.w2_scale, &p.w13_bias, &p.w2_bias, &p.a13_scale, &p.a2_scale,
        &p.expert_map, &p.w13_real, &p.w2_real, &p.out}) {
    if (t->defined()) *t = t->to(device);
  }
  return p;
}

// ---- output checks
// ----------------------------------------------------------------------------------

namespace {
void fill_nan_host(const Tensor& t) {
  const int64_t n = t.numel();
  switch (t.dtype()) {
    case DType::kF32:
      std::fill_n(t.ptr<float>(), n, std::numeric_limits<float>::quiet_NaN());
      break;
    case DType::kF64:
      std::fill_n(t.ptr<double>(), n, std::numeric_limits<double>::quiet_NaN());
      break;
    case DType::kBF16:
    case DType::kF16:
      std::fill_n(t.ptr<uint16_t>(), n, t.dtype() == DType::kBF16 ? 0x7FC0 : 0x7E00);
      break;
    default:
      std::memset(t.data(), 0xFF, t.nbytes());
  }
}
bool is_nan_at(const TensorView& t, int64_t i) {
  switch (t.dtype) {
    case DType::kF32:
      return std::isnan(t.ptr<const float>()[i]);
    case DType::kF64:
      return std::isnan(t.ptr<const double>()[i]);
    case DType::kBF16:
      return std::isnan(num::bf16_to_float(t.ptr<const uint16_t>()[i]));
    case DType::kF16:
      return std::isnan(num::f16_to_float(t.ptr<const uint16_t>()[i]));
    default: {  // integer and byte tensors: element i is all 0xFF bytes (fill_nan_host)
      const int64_t w = static_cast<int64_t>(dtype_size(t.dtype));
      const uint8_t* e = t.ptr<const uint8_t>() + i * w;
      for (int64_t k = 0; k < w; ++k)
        if (e[k] != 0xFF) return false;
      return true;
    }
  }
}
}  // namespace

void poison(const TensorView& t) {
  if (!t.defined() || t.numel() == 0) return;
  const auto shape = t.sizes();
  Tensor host = Tensor::empty(std::span<const int64_t>(shape), t.dtype);
  fill_nan_host(host);
  if (t.device.is_cpu()) {
    std::memcpy(t.data, host.data(), t.nbytes());
  } else {
    device_allocator().copy(t.data, host.data(), t.nbytes(), 0);
  }
}

int64_t count_nan(const TensorView& t) {
  if (!t.defined() || t.numel() == 0) return 0;
  const Tensor h = host_copy(t);
  int64_t n = 0;
  for (int64_t i = 0; i < h.numel(); ++i) n += is_nan_at(h, i);
  return n;
}

WriteCheck expect_all_written(const TensorView& out) {
  WriteCheck c;
  if (!out.defined() || out.numel() == 0) return c;
  const Tensor h = host_copy(out);
  for (int64_t i = 0; i < h.numel(); ++i) {
    if (is_nan_at(h, i)) {
      if (c.first_index < 0) c.first_index = i;
      ++c.unwritten;
    }
  }
  c.ok = c.unwritten == 0;
  if (!c.ok) {
    const int64_t cols = out.ndim >= 2 ? out.size(-1) : out.numel();
    c.message = fmt::format(
        "{} of {} elements of {} were not written (first: flat {} = row {}, "
        "col {})",
        c.unwritten, out.numel(), out.describe(), c.first_index, c.first_index / cols,
        c.first_index % cols);
  }
  return c;
}

GuardedTensor::GuardedTensor(std::vector<int64_t> shape, DType dtype, Device device) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  payload_bytes_ = n * static_cast<int64_t>(dtype_size(dtype));
  const int64_t total = payload_bytes_ + 2 * kGuardBytes;
  Tensor host = Tensor::empty({total}, DType::kU8);
  std::memset(host.data(), kCanary, static_cast<std::size_t>(total));
  storage_ = device.is_cpu() ? host : host.to(device);
  view_ = TensorView(static_cast<char*>(storage_.data()) + kGuardBytes, dtype,
                     std::span<const int64_t>(shape), device);
}

bool GuardedTensor::canaries_intact() const {
  const Tensor h = host_copy(storage_.view());
  const auto* b = h.ptr<const uint8_t>();
  const int64_t total = payload_bytes_ + 2 * kGuardBytes;
  for (int64_t i = 0; i < kGuardBytes; ++i) {
    if (b[i] != kCanary || b[total - 1 - i] != kCanary) return false;
  }
  return true;
}

// ---- comparisons
// --------------------------------------------------------------------------------------

double element_as_double(const TensorView& t, int64_t i) {
  switch (t.dtype) {
    case DType::kF64:
      return t.ptr<const double>()[i];
    case DType::kI32:
      return t.ptr<const int32_t>()[i];
    case DType::kU8:
      return t.ptr<const uint8_t>()[i];
    default:
      if (dtype_is_fp8(t.dtype)) return num::fp8_to_float(t.dtype, t.ptr<const uint8_t>()[i]);
      return num::load_float(t, i);
  }
}

std::string CompareReport::str() const {
  std::string s = fmt::format(
      "{}: {} of {} elements differ; max |err| {:.6g} at flat index {}; max rel err {:.6g}; "
      "mean|a-e|/mean|e| {:.6g}",
      ok ? "ok" : "MISMATCH", mismatches, count, max_abs_err, max_abs_index, max_rel_err,
      mean_rel_abs_err);
  if (first_mismatch >= 0) {
    s += fmt::format("; first at flat index {} (actual {:.9g}, expected {:.9g})", first_mismatch,
                     actual_at_first, expected_at_first);
  }
  if (nan_mismatch) s += "; NaN in one tensor only";
  return s;
}

namespace {
CompareReport compare_impl(const TensorView& actual_in, const TensorView& expected_in, bool bitwise,
                           double atol, double rtol) {
  CompareReport r;
  if (actual_in.sizes() != expected_in.sizes() || actual_in.dtype != expected_in.dtype) {
    throw ValueError(fmt::format("compare: shapes/dtypes differ: actual {} vs expected {}",
                                 actual_in.describe(), expected_in.describe()));
  }
  const Tensor a = host_copy(actual_in), e = host_copy(expected_in);
  const int64_t n = a.numel();
  r.count = n;
  double sum_err = 0, sum_ref = 0;
  const std::size_t esz = dtype_size(a.dtype());
  for (int64_t i = 0; i < n; ++i) {
    const double av = element_as_double(a, i), ev = element_as_double(e, i);
    bool bad;
    if (std::isnan(av) || std::isnan(ev)) {
      bad = std::isnan(av) != std::isnan(ev);
      if (bad) r.nan_mismatch = true;
    } else if (bitwise) {
      bad = std::memcmp(static_cast<const char*>(a.data()) + i * esz,
                        static_cast<const char*>(e.data()) + i * esz, esz) != 0;
    } else {
      bad = !(std::fabs(av - ev) <= atol + rtol * std::fabs(ev));
    }
    if (!std::isnan(av) && !std::isnan(ev)) {
      const double err = std::fabs(av - ev);
      if (err > r.max_abs_err || r.max_abs_index < 0) {
        r.max_abs_err = err;
        r.max_abs_index = i;
      }
      if (ev != 0) r.max_rel_err = std::max(r.max_rel_err, err / std::fabs(ev));
      sum_err += err;
      sum_ref += std::fabs(ev);
    }
    if (bad) {
      if (r.first_mismatch < 0) {
        r.first_mismatch = i;
        r.actual_at_first = av;
        r.expected_at_first = ev;
      }
      ++r.mismatches;
    }
  }
  r.mean_rel_abs_err = sum_ref > 0 ? sum_err / sum_ref : (sum_err > 0 ? INFINITY : 0.0);
  r.ok = r.mismatches == 0;
  return r;
}
}  // namespace

CompareReport compare_bitwise(const TensorView& actual, const TensorView& expected) {
  return compare_impl(actual, expected, true, 0, 0);
}

CompareReport compare_close(const TensorView& actual, const TensorView& expected, double atol,
                            double rtol) {
  return compare_impl(actual, expected, false, atol, rtol);
}

Tensor randn(int64_t rows, int64_t cols, DType dtype, float scale, uint64_t seed) {
  if (dtype != DType::kBF16 && dtype != DType::kF32)
    throw std::invalid_argument("testing::randn: bf16 or f32 only");
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> n(0.0f, 1.0f);
  Tensor t = Tensor::empty({rows, cols}, dtype);
  for (int64_t i = 0; i < t.numel(); ++i) {
    const float v = n(rng) * scale;
    if (dtype == DType::kBF16) {
      t.ptr<uint16_t>()[i] = num::float_to_bf16(v);
    } else {
      t.ptr<float>()[i] = v;
    }
  }
  return t;
}

Tensor rows_of(const Tensor& t, int64_t first, int64_t n) {
  Tensor r = Tensor::empty({n, t.size(1)}, t.dtype());
  const std::size_t row = static_cast<std::size_t>(t.size(1)) * dtype_size(t.dtype());
  if (n) std::memcpy(r.data(), static_cast<const char*>(t.data()) + first * row, n * row);
  return r;
}

}  // namespace fp8moe::testing
