// The CPU experts driver (cpu_experts.hpp): support queries, the workspace plan, and the forward
// pass that feeds the SIMD GEMM tiles (cpu_kernels.hpp) and applies the reference's epilogues.
#include "kernels/cpu/cpu_experts.hpp"

#include <fmt/format.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cstring>
#include <exception>
#include <numeric>

#include "fp8moe/error.hpp"
#include "fp8moe/numerics.hpp"
#include "kernels/cpu/cpu_kernels.hpp"
#include "kernels/cpu/cpu_moe_align.hpp"
#include "numerics/activation.hpp"
#include "numerics/quant.hpp"
#include "numerics/routing.hpp"

namespace fp8moe::cpu {

namespace num = fp8moe::numerics;

namespace {

constexpr int64_t kRowBlock = 128;  // activation rows per work item
constexpr int64_t kTile2 = 128;     // w2 rows (hidden columns) per GEMM2 work item
constexpr int64_t kMaxHTile = 128;  // h columns per GEMM1 work item (2x that many w13 rows)
constexpr std::size_t kAlign = 64;

int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }
std::size_t align_up(std::size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

// ---- support ----------------------------------------------------------------------------------

std::string key_text(const std::optional<QuantKey>& k) { return key_str(k); }

// Weight keys both kernels read: e4m3fn codes with f32 scales per block / tensor / channel.
Support weight_key_ok(const char* who, const std::optional<QuantKey>& wk, int64_t* block_k) {
  *block_k = 0;
  if (!wk) return Support::no(fmt::format("{} needs fp8 weights (weight key None)", who));
  const auto fail = [&](const char* why) {
    return Support::no(
        fmt::format("{} does not compute weight key {}: {}", who, key_text(wk), why));
  };
  if (wk->dtype != KeyDType::kF8E4M3FN) {
    return fail("only float8_e4m3fn weights (e4m3fnuz exists only on ROCm gfx94x)");
  }
  if (wk->scale.dtype != KeyDType::kF32 || wk->scale2) {
    return fail("only f32 weight scales (MXFP8 e8m0 scales are not implemented)");
  }
  const GroupShape g = wk->scale.group_shape;
  if (g.is_per_tensor() || g.is_per_channel() || g.is_per_token()) return Support::yes();
  if (g.row > 0 && g.col > 0) {
    if (g.col % kKAlign != 0 || g.col > kMaxKBlock) {
      return fail("block_k must be a multiple of 32 and at most 512");
    }
    *block_k = g.col;
    return Support::yes();
  }
  return fail("unsupported scale group shape");
}

Support config_ok(const char* who, const MoeConfig& c) {
  if (c.in_dtype != DType::kBF16 && c.in_dtype != DType::kF32) {
    return Support::no(
        fmt::format("{} takes bf16 or f32 activations, not {}", who, dtype_torch_name(c.in_dtype)));
  }
  if (c.hidden_dim % kKAlign != 0) {
    return Support::no(fmt::format("{} needs hidden_dim to be a multiple of {}, got {}", who,
                                   kKAlign, c.hidden_dim));
  }
  const int64_t I = c.intermediate_size_per_partition > 0
                        ? c.intermediate_size_per_partition
                        : (c.tp_size() > 0 ? c.intermediate_size / c.tp_size() : 0);
  if (I % kKAlign != 0) {
    return Support::no(
        fmt::format("{} needs the per-partition intermediate size to be a multiple of {}, got {}",
                    who, kKAlign, I));
  }
  if (c.activation == MoeActivation::kRelu2) {
    return Support::no(fmt::format(
        "{} does not compute the gated relu2 activation (vLLM has no kernel for it)", who));
  }
  if (c.routing_method == RoutingMethodType::kCustom ||
      c.routing_method == RoutingMethodType::kSimulated) {
    return Support::no(
        fmt::format("{} routes every RoutingMethodType except Custom and Simulated", who));
  }
  return Support::yes();
}

// ---- the plan: sizes, tiles and workspace layout ----------------------------------------------

enum class AScale : uint8_t { kNone, kPerKBlock, kPerRow, kPerTensor };

struct Plan {
  bool w8a8 = false;
  int64_t M = 0, H = 0, I = 0, E = 0, E_global = 0, topk = 0, N1 = 0, slots = 0;
  bool gated = false, interleaved = false, bf16 = true, route_inside = false;
  bool x_direct = false;  // GEMM1 reads x itself (W8A16, no weighting on the input)
  bool a_bf16 = true;     // GEMM operands A are bf16 (else f32)
  int64_t HT = 0, nht = 0, nt2 = 0;
  int64_t gk = 0;  // per-K-block activation group (W8A8 per-group), else 0
  int64_t kblock1 = 0, kblock2 = 0;
  AScale ascale = AScale::kNone;
  bool wscale_kb = false;  // block weights: scale per K-block inside the GEMM
  int64_t sa1_ld = 0, sa2_ld = 0;
  int threads = 1;
  int64_t max_items1 = 0, max_items2 = 0, ntmax = 0;
  // Workspace offsets (bytes).
  std::size_t o_ids = 0, o_w = 0, o_bias = 0, o_counts = 0, o_offsets = 0, o_sorted = 0, o_pos = 0,
              o_items1 = 0, o_items2 = 0, o_a1 = 0, o_sa1 = 0, o_hval = 0, o_a2 = 0, o_sa2 = 0,
              o_y2 = 0, o_amax = 0, o_thread = 0, thread_bytes = 0, total = 0;
  // Per-thread sub-offsets.
  std::size_t t_c = 0, t_scratch = 0, t_rows = 0, t_groups = 0, t_y = 0, t_h = 0, t_q = 0, t_f = 0,
              t_cs = 0, t_bias = 0, t_ptrs = 0;
};

struct Item {
  int32_t e, tile, rb, pad;
};

int max_threads_cap() {
  static const int cap = std::max(1, omp_get_num_procs());
  return cap;
}

int64_t choose_h_tile(int64_t I, int64_t unit) {
  int64_t ht = unit;
  while (ht * 2 <= kMaxHTile && I % (ht * 2) == 0) ht *= 2;
  return ht;
}

Plan make_plan(const FusedMoeArgs& a, bool w8a8) {
  Plan p;
  p.w8a8 = w8a8;
  const MoeScheme& sc = a.scheme;
  p.M = a.x.size(0);
  p.H = a.x.size(1);
  p.E = a.weights.w13.size(0);
  p.I = a.weights.w2.size(2);
  p.gated = activation_is_gated(a.act.activation);
  p.interleaved = a.act.activation == MoeActivation::kSwigluOai;
  p.N1 = p.gated ? 2 * p.I : p.I;
  p.bf16 = a.x.dtype == DType::kBF16;
  p.route_inside = !a.topk_ids.defined();
  p.topk = p.route_inside ? a.routing.topk : a.topk_ids.size(1);
  p.E_global = p.route_inside ? a.router_logits.size(1)
                              : (a.expert_map.defined() ? a.expert_map.size(0) : p.E);
  p.slots = p.M * p.topk;
  p.a_bf16 = w8a8 || p.bf16;
  p.x_direct = !w8a8 && !a.apply_router_weight_on_input;
  p.wscale_kb = sc.weight == WeightScaleKind::kBlock;
  if (w8a8) {
    switch (sc.act) {
      case ActQuantKind::kPerGroupDynamic:
        p.ascale = AScale::kPerKBlock;
        p.gk = sc.group_k;
        break;
      case ActQuantKind::kPerTokenDynamic:
        p.ascale = AScale::kPerRow;
        break;
      default:
        p.ascale = AScale::kPerTensor;
        break;
    }
  }
  const int64_t kb = p.wscale_kb ? sc.block_k : (p.gk ? p.gk : kChunkNoScale);
  p.kblock1 = p.kblock2 = kb;
  p.sa1_ld = p.ascale == AScale::kPerKBlock ? p.H / p.gk : 1;
  p.sa2_ld = p.ascale == AScale::kPerKBlock ? p.I / p.gk : 1;
  const int64_t unit = p.gk ? std::lcm<int64_t>(kKAlign, p.gk) : kKAlign;
  p.HT = choose_h_tile(p.I, unit);
  p.nht = p.I / p.HT;
  p.nt2 = cdiv(p.H, kTile2);
  p.ntmax = std::max<int64_t>(p.gated ? 2 * p.HT : p.HT, kTile2);
  p.threads = max_threads_cap();
  const int64_t rb_bound = cdiv(p.slots, kRowBlock) + std::min(p.E, p.slots);
  p.max_items1 = rb_bound * p.nht;
  p.max_items2 = rb_bound * p.nt2;

  const std::size_t abytes = p.a_bf16 ? 2 : 4;
  const std::size_t cbytes = p.bf16 ? 2 : 4;
  std::size_t o = 0;
  const auto take = [&](std::size_t bytes) {
    const std::size_t at = o;
    o += align_up(bytes);
    return at;
  };
  const auto S = [](int64_t n) { return static_cast<std::size_t>(std::max<int64_t>(n, 0)); };
  if (p.route_inside) {
    p.o_ids = take(S(p.slots) * 4);
    p.o_w = take(S(p.slots) * 4);
    p.o_bias = take(S(p.E_global) * 4);
  }
  p.o_counts = take(S(p.E) * 4);
  p.o_offsets = take(S(p.E + 1) * 8);
  p.o_sorted = take(S(p.slots) * 4);
  p.o_pos = take(S(p.slots) * 4);
  p.o_items1 = take(S(p.max_items1) * sizeof(Item));
  p.o_items2 = take(S(p.max_items2) * sizeof(Item));
  if (!p.x_direct) p.o_a1 = take(S(p.M * p.H) * abytes);
  p.o_sa1 = take(S(std::max<int64_t>(p.M * p.sa1_ld, 1)) * 4);
  if (w8a8 && p.ascale != AScale::kPerKBlock) p.o_hval = take(S(p.slots * p.I) * 4);
  p.o_a2 = take(S(p.slots * p.I) * abytes);
  p.o_sa2 = take(S(std::max<int64_t>(p.slots * p.sa2_ld, 1)) * 4);
  p.o_y2 = take(S(p.slots * p.H) * cbytes);
  p.o_amax = take(S(p.threads) * 64);
  p.o_thread = o;
  // Per-thread scratch.
  std::size_t t = 0;
  const auto ttake = [&](std::size_t bytes) {
    const std::size_t at = t;
    t += align_up(bytes);
    return at;
  };
  p.t_c = ttake(S(kRowBlock * p.ntmax) * 4);
  p.t_scratch = ttake(gemm_scratch_bytes(std::max(p.H, p.I)));
  p.t_rows = ttake(S(kRowBlock) * 4);
  p.t_groups = ttake(S(p.ntmax / 16 + 1) * 4);
  p.t_y = ttake(S(2 * p.HT) * 4);
  p.t_h = ttake(S(p.HT) * 4);
  p.t_q = ttake(S(std::max({p.H, p.I, p.HT})));
  p.t_f = ttake(S(std::max({p.H, p.I, p.E_global})) * 4);
  p.t_cs = ttake(S(p.ntmax) * 4);
  p.t_bias = ttake(S(p.ntmax) * 4);
  p.t_ptrs = ttake(S(p.topk) * sizeof(void*));
  p.thread_bytes = t;
  p.total = p.o_thread + p.thread_bytes * S(p.threads) + kAlign;  // + alignment slack
  return p;
}

// ---- helpers ------------------------------------------------------------------------------------

// bf16 bits of every e4m3fn code (exact), for writing quantised activations as bf16 operands.
struct CodeToBf16 {
  uint16_t t[256];
  CodeToBf16() {
    for (int c = 0; c < 256; ++c) {
      t[c] = static_cast<uint16_t>(
          std::bit_cast<uint32_t>(num::e4m3fn_to_float(static_cast<uint8_t>(c))) >> 16);
    }
  }
};
const CodeToBf16& code_to_bf16() {
  static const CodeToBf16 table;
  return table;
}

inline float load_bias(const TensorView& b, int64_t i) {
  if (!b.defined()) return 0.0f;
  return b.dtype == DType::kBF16 ? num::bf16_to_float(b.ptr<const uint16_t>()[i])
                                 : b.ptr<const float>()[i];
}

inline float round_c(float v, bool bf16) { return bf16 ? num::bf16_round(v) : v; }

// Per-tensor / per-channel weight scale of w13 row `row` of expert e (1 for block scales).
inline float w13_row_scale(const FusedMoeArgs& a, const Plan& p, int64_t e, int64_t row) {
  const TensorView& s = a.weights.w13_scale;
  switch (a.scheme.weight) {
    case WeightScaleKind::kPerTensor:
      if (s.ndim == 2) {
        const int64_t shard = p.interleaved ? (row % 2) : (row >= p.I ? 1 : 0);
        return s.ptr<const float>()[e * 2 + shard];
      }
      return s.ptr<const float>()[e];
    case WeightScaleKind::kPerChannel:
      return s.ptr<const float>()[e * p.N1 + row];
    default:
      return 1.0f;
  }
}
inline float w2_row_scale(const FusedMoeArgs& a, const Plan& p, int64_t e, int64_t row) {
  const TensorView& s = a.weights.w2_scale;
  switch (a.scheme.weight) {
    case WeightScaleKind::kPerTensor:
      return s.ptr<const float>()[e];
    case WeightScaleKind::kPerChannel:
      return s.ptr<const float>()[e * p.H + row];
    default:
      return 1.0f;
  }
}

// Writes quantised codes as bf16 operands.
inline void codes_to_operand(const uint8_t* q, int64_t n, uint16_t* out) {
  const uint16_t* t = code_to_bf16().t;
  for (int64_t i = 0; i < n; ++i) out[i] = t[q[i]];
}

// The shared state of one forward call.
struct Run {
  const FusedMoeArgs& a;
  const Plan& p;
  char* ws;
  GemmTileFn gemm = nullptr;
  const KernelTable* ew = nullptr;  // element-wise epilogue and top-k sum kernels
  // SIMD per-group quantiser of the active level (bit-exact with numerics), or nullptr.
  float (*quant_group)(const float*, int64_t, uint16_t*, bool, float) = nullptr;
  int32_t* ids = nullptr;  // (slots) global expert ids: the caller's, or routed into the workspace
  float* wts = nullptr;
  int32_t* counts = nullptr;
  int64_t* offsets = nullptr;
  int32_t* sorted = nullptr;
  int32_t* pos = nullptr;
  Item* items1 = nullptr;
  Item* items2 = nullptr;
  int64_t n_items1 = 0, n_items2 = 0;
  void* a1 = nullptr;
  float* sa1 = nullptr;
  float* hval = nullptr;
  void* a2 = nullptr;
  float* sa2 = nullptr;
  void* y2 = nullptr;
  float* amax = nullptr;

  char* thread_base(int tid) const { return ws + p.o_thread + p.thread_bytes * tid; }
};

// ---- phases ---------------------------------------------------------------------------------

// Routes token t into the workspace ids/weights (router logits present).
void route_token(Run& r, int64_t t, float* logits_f, const float* bias) {
  const FusedMoeArgs& a = r.a;
  const int64_t Eg = r.p.E_global;
  if (a.router_logits.dtype == DType::kBF16) {
    const uint16_t* l = a.router_logits.ptr<const uint16_t>() + t * Eg;
    for (int64_t e = 0; e < Eg; ++e) logits_f[e] = num::bf16_to_float(l[e]);
  } else {
    std::memcpy(logits_f, a.router_logits.ptr<const float>() + t * Eg, Eg * sizeof(float));
  }
  num::route_row(logits_f, Eg, a.routing, bias, r.ids + t * r.p.topk, r.wts + t * r.p.topk);
}

// Token t's input row as floats, weighted on the input when asked (the reference's load_x:
// w rounded to the activation dtype, the product rounded again).
void load_x_row(const Run& r, int64_t t, float* out) {
  const FusedMoeArgs& a = r.a;
  const int64_t H = r.p.H;
  if (r.p.bf16) {
    const uint16_t* x = a.x.ptr<const uint16_t>() + t * H;
    for (int64_t k = 0; k < H; ++k) out[k] = num::bf16_to_float(x[k]);
  } else {
    std::memcpy(out, a.x.ptr<const float>() + t * H, H * sizeof(float));
  }
  if (a.apply_router_weight_on_input) {
    const float w0 = r.wts[t * r.p.topk];
    const float w = r.p.bf16 ? num::bf16_round(w0) : w0;
    for (int64_t k = 0; k < H; ++k) out[k] = round_c(out[k] * w, r.p.bf16);
  }
}

// GEMM1 operand row of token t (and its activation scales): W8A16 copies the weighted row, W8A8
// quantises it. `tensor_scale`: the per-tensor scale (static, or the dynamic one from amax).
void prepare_a1_row(Run& r, int64_t t, float* xf, uint8_t* q, float tensor_scale) {
  const Plan& p = r.p;
  const MoeScheme& sc = r.a.scheme;
  load_x_row(r, t, xf);
  if (!p.w8a8) {
    if (p.bf16) {
      uint16_t* out = static_cast<uint16_t*>(r.a1) + t * p.H;
      for (int64_t k = 0; k < p.H; ++k) out[k] = num::float_to_bf16(xf[k]);
    } else {
      std::memcpy(static_cast<float*>(r.a1) + t * p.H, xf, p.H * sizeof(float));
    }
    return;
  }
  uint16_t* out = static_cast<uint16_t*>(r.a1) + t * p.H;
  switch (p.ascale) {
    case AScale::kPerKBlock:
      if (r.quant_group) {  // straight to bf16 operands
        for (int64_t g = 0; g < p.H / p.gk; ++g) {
          r.sa1[t * p.sa1_ld + g] =
              r.quant_group(xf + g * p.gk, p.gk, out + g * p.gk, sc.ue8m0_scales, 0.0f);
        }
        return;
      }
      for (int64_t g = 0; g < p.H / p.gk; ++g) {
        r.sa1[t * p.sa1_ld + g] =
            num::quantize_group_fp8(xf + g * p.gk, p.gk, q + g * p.gk, sc.fp8, sc.ue8m0_scales);
      }
      break;
    case AScale::kPerRow:
      r.sa1[t] = num::quantize_row_per_token_fp8(xf, p.H, q, sc.fp8);
      break;
    default:
      num::quantize_per_tensor_fp8(xf, p.H, tensor_scale, q, sc.fp8);
      break;
  }
  codes_to_operand(q, p.H, out);
}

// Fills the 16-row weight groups of GEMM1 tile `ht` (h columns [ht*HT, (ht+1)*HT)).
int fill_groups1(const Plan& p, int64_t ht, int32_t* groups) {
  const int64_t c0 = ht * p.HT;
  int n = 0;
  if (!p.gated) {
    for (int64_t j = 0; j < p.HT; j += 16) groups[n++] = static_cast<int32_t>(c0 + j);
  } else if (p.interleaved) {
    for (int64_t j = 0; j < 2 * p.HT; j += 16) groups[n++] = static_cast<int32_t>(2 * c0 + j);
  } else {
    for (int64_t j = 0; j < p.HT; j += 16) groups[n++] = static_cast<int32_t>(c0 + j);
    for (int64_t j = 0; j < p.HT; j += 16) groups[n++] = static_cast<int32_t>(p.I + c0 + j);
  }
  return n * 16;
}

// w13 row of tile column i (the order fill_groups1 lays out).
inline int64_t w13_row_of(const Plan& p, int64_t ht, int64_t i) {
  const int64_t c0 = ht * p.HT;
  if (!p.gated) return c0 + i;
  if (p.interleaved) return 2 * c0 + i;
  return i < p.HT ? c0 + i : p.I + c0 + (i - p.HT);
}

// One thread's scratch buffers (Plan's t_* offsets into its slice of the workspace).
struct ThreadScratch {
  float* c;
  int32_t* rows;
  int32_t* groups;
  float* y;
  float* h;
  uint8_t* q;
  float* cs;
  float* bias;
  char* gemm;
};
ThreadScratch thread_scratch(Run& r, int tid) {
  const Plan& p = r.p;
  char* tb = r.thread_base(tid);
  return {reinterpret_cast<float*>(tb + p.t_c),
          reinterpret_cast<int32_t*>(tb + p.t_rows),
          reinterpret_cast<int32_t*>(tb + p.t_groups),
          reinterpret_cast<float*>(tb + p.t_y),
          reinterpret_cast<float*>(tb + p.t_h),
          reinterpret_cast<uint8_t*>(tb + p.t_q),
          reinterpret_cast<float*>(tb + p.t_cs),
          reinterpret_cast<float*>(tb + p.t_bias),
          tb + p.t_scratch};
}

// The GEMM of one work item: R activation rows (`rows` into `act`, K wide, with their per-k-block
// scales when the scheme has them) against the NT weight rows `groups` of expert e of `w` (E, N,
// K) and its block scales.
GemmTile item_gemm(const Run& r, const ThreadScratch& ts, const void* act, const float* act_scale,
                   int64_t act_scale_ld, const TensorView& w, const TensorView& w_scale, int64_t e,
                   int64_t N, int64_t K, int kblock, int R, int NT) {
  const Plan& p = r.p;
  GemmTile g;
  g.a = act;
  g.a_bf16 = p.a_bf16;
  g.lda = K;
  g.a_rows = ts.rows;
  g.R = R;
  g.a_scale = p.ascale == AScale::kPerKBlock ? act_scale : nullptr;
  g.a_scale_ld = act_scale_ld;
  g.w = w.ptr<const uint8_t>() + e * N * K;
  g.K = K;
  g.w_groups = ts.groups;
  g.NT = NT;
  if (p.wscale_kb) {
    g.w_scale = w_scale.ptr<const float>() + e * w_scale.size(1) * w_scale.size(2);
    g.bn = r.a.scheme.block_n;
    g.w_scale_ld = w_scale.size(2);
  }
  g.kblock = kblock;
  g.c = ts.c;
  g.ldc = NT;
  g.scratch = ts.gemm;
  return g;
}

// The row epilogue's common part: scales not applied per K-block (per row, and per column for
// per-tensor / per-channel weights: `col_scale(n)`), the bias `bias_at(n)`, the output dtype.
template <typename ColScale, typename BiasAt>
RowEpilogue item_epilogue(const Plan& p, const ThreadScratch& ts, const TensorView& b, int NT,
                          ColScale col_scale, BiasAt bias_at) {
  const bool row_scales =
      !p.wscale_kb || p.ascale == AScale::kPerRow || p.ascale == AScale::kPerTensor;
  const bool has_cs = row_scales && !p.wscale_kb;  // per-tensor / per-channel weight scales
  const bool has_bias = b.defined();
  for (int n = 0; n < NT; ++n) {
    if (has_cs) ts.cs[n] = col_scale(n);
    if (has_bias) ts.bias[n] = load_bias(b, bias_at(n));
  }
  RowEpilogue ep;
  ep.n = NT;
  ep.apply_scales = row_scales;
  ep.col_scale = has_cs ? ts.cs : nullptr;
  ep.bias = has_bias ? ts.bias : nullptr;
  ep.bf16 = p.bf16;
  return ep;
}

void gemm1_item(Run& r, const Item& it, int tid) {
  const Plan& p = r.p;
  const FusedMoeArgs& a = r.a;
  const MoeScheme& sc = a.scheme;
  const ThreadScratch ts = thread_scratch(r, tid);
  int32_t* rows = ts.rows;
  float* y = ts.y;
  float* h = ts.h;
  uint8_t* q = ts.q;

  const int64_t e = it.e, ht = it.tile;
  const int64_t p0 = r.offsets[e] + it.rb * kRowBlock;
  const int R = static_cast<int>(std::min<int64_t>(kRowBlock, r.offsets[e + 1] - p0));
  for (int i = 0; i < R; ++i) rows[i] = r.sorted[p0 + i] / static_cast<int32_t>(p.topk);
  const int NT = fill_groups1(p, ht, ts.groups);

  r.gemm(item_gemm(r, ts, p.x_direct ? a.x.data : r.a1, r.sa1, p.sa1_ld, a.weights.w13,
                   a.weights.w13_scale, e, p.N1, p.H, p.kblock1, R, NT));

  // Epilogue per row: scales not applied per K-block, + bias, round, activation, [quantise].
  RowEpilogue ep = item_epilogue(
      p, ts, a.weights.w13_bias, NT,
      [&](int n) { return w13_row_scale(a, p, e, w13_row_of(p, ht, n)); },
      [&](int n) { return e * p.N1 + w13_row_of(p, ht, n); });
  ep.out_f32 = y;
  const float* C = ts.c;
  for (int i = 0; i < R; ++i) {
    const int64_t pos = p0 + i;
    const int64_t t = rows[i];
    ep.row_scale = p.ascale == AScale::kPerRow      ? r.sa1[t]
                   : p.ascale == AScale::kPerTensor ? r.sa1[0]
                                                    : 1.0f;
    ep.c = C + i * NT;
    r.ew->row_epilogue(ep);  // y = round((c * sa) * sw + bias)
    if (sc.fuse_silu_quant) {
      num::silu_mul_fp32_row<float>(y, p.HT, h);
    } else {
      num::apply_activation_row<float>(a.act, y, p.HT, p.bf16, h);
    }
    const int64_t c0 = ht * p.HT;
    if (!p.w8a8) {
      if (p.bf16) {
        uint16_t* out = static_cast<uint16_t*>(r.a2) + pos * p.I + c0;
        for (int64_t c = 0; c < p.HT; ++c) out[c] = num::float_to_bf16(h[c]);
      } else {
        std::memcpy(static_cast<float*>(r.a2) + pos * p.I + c0, h, p.HT * sizeof(float));
      }
    } else if (p.ascale == AScale::kPerKBlock) {
      const float floor = sc.fuse_silu_quant ? num::min_scaling_factor(sc.fp8) : 0.0f;
      uint16_t* out = static_cast<uint16_t*>(r.a2) + pos * p.I + c0;
      if (r.quant_group) {
        for (int64_t g0 = 0; g0 < p.HT; g0 += p.gk) {
          r.sa2[pos * p.sa2_ld + (c0 + g0) / p.gk] =
              r.quant_group(h + g0, p.gk, out + g0, sc.ue8m0_scales, floor);
        }
      } else {
        for (int64_t g0 = 0; g0 < p.HT; g0 += p.gk) {
          r.sa2[pos * p.sa2_ld + (c0 + g0) / p.gk] =
              num::quantize_group_fp8(h + g0, p.gk, q + g0, sc.fp8, sc.ue8m0_scales, floor);
        }
        codes_to_operand(q, p.HT, out);
      }
    } else {
      std::memcpy(r.hval + pos * p.I + c0, h, p.HT * sizeof(float));
    }
  }
}

void gemm2_item(Run& r, const Item& it, int tid) {
  const Plan& p = r.p;
  const FusedMoeArgs& a = r.a;
  const ThreadScratch ts = thread_scratch(r, tid);

  const int64_t e = it.e;
  const int64_t n0 = it.tile * kTile2;
  const int NT = static_cast<int>(std::min<int64_t>(kTile2, p.H - n0));
  const int64_t p0 = r.offsets[e] + it.rb * kRowBlock;
  const int R = static_cast<int>(std::min<int64_t>(kRowBlock, r.offsets[e + 1] - p0));
  for (int i = 0; i < R; ++i) ts.rows[i] = static_cast<int32_t>(p0 + i);
  for (int j = 0; j < NT / 16; ++j) ts.groups[j] = static_cast<int32_t>(n0 + 16 * j);

  r.gemm(item_gemm(r, ts, r.a2, r.sa2, p.sa2_ld, a.weights.w2, a.weights.w2_scale, e, p.H, p.I,
                   p.kblock2, R, NT));

  RowEpilogue ep = item_epilogue(
      p, ts, a.weights.w2_bias, NT, [&](int n) { return w2_row_scale(a, p, e, n0 + n); },
      [&](int n) { return e * p.H + n0 + n; });
  ep.mul_weight = !a.apply_router_weight_on_input;  // the router weight, in f32, before the cast
  const float* C = ts.c;
  for (int i = 0; i < R; ++i) {
    const int64_t pos = p0 + i;
    const int64_t s = r.sorted[pos];
    ep.row_scale = p.ascale == AScale::kPerRow      ? r.sa2[pos]
                   : p.ascale == AScale::kPerTensor ? r.sa2[0]
                                                    : 1.0f;
    ep.weight = r.wts[s];
    ep.c = C + i * NT;
    if (p.bf16) {
      ep.out_bf16 = static_cast<uint16_t*>(r.y2) + s * p.H + n0;
    } else {
      ep.out_f32 = static_cast<float*>(r.y2) + s * p.H + n0;
    }
    r.ew->row_epilogue(ep);
  }
}

// out[t] = round(sum over valid slots j, in slot order, of y2[t, j]) in f32.
void reduce_token(Run& r, int64_t t, const void** ptrs) {
  const Plan& p = r.p;
  const std::size_t esz = p.bf16 ? 2 : 4;
  int n = 0;
  for (int64_t j = 0; j < p.topk; ++j) {
    const int64_t s = t * p.topk + j;
    if (r.pos[s] >= 0) ptrs[n++] = static_cast<const char*>(r.y2) + s * p.H * esz;
  }
  r.ew->sum_rows(ptrs, n, p.H, p.bf16, static_cast<char*>(r.a.out.data) + t * p.H * esz);
}

// Captures the first exception thrown inside a parallel region; rethrown after it.
struct ErrorSlot {
  std::atomic<bool> set{false};
  std::exception_ptr error;
  void capture() {
    bool expected = false;
    if (set.compare_exchange_strong(expected, true)) error = std::current_exception();
  }
  void rethrow() {
    if (error) std::rethrow_exception(error);
  }
};

GemmTileFn pick_gemm(bool a_bf16) {
  const Isa isa = active_isa();
  const KernelTable& k = kernel_table(isa);
  if (a_bf16 && k.gemm_a_bf16) return k.gemm_a_bf16;
  if (!a_bf16 && k.gemm_a_f32) return k.gemm_a_f32;
  // The level lacks this operand type (AVX-512 BF16 takes bf16 only): the best level that has it.
  for (Isa other : supported_isas()) {
    const KernelTable& o = kernel_table(other);
    if (static_cast<int>(other) > static_cast<int>(isa)) continue;
    if (a_bf16 ? o.gemm_a_bf16 != nullptr : o.gemm_a_f32 != nullptr) {
      return a_bf16 ? o.gemm_a_bf16 : o.gemm_a_f32;
    }
  }
  return nullptr;
}

void run_impl(const FusedMoeArgs& a, void* workspace, bool w8a8) {
  validate_fused_moe_args(a);
  if (!a.x.device.is_cpu()) {
    throw ValueError(fmt::format("{}: x is on {}; the CPU experts take host tensors",
                                 w8a8 ? "cpu_w8a8" : "cpu_w8a16", a.x.device.str()));
  }
  const Support s = cpu_supports_args(a, w8a8);
  if (!s) throw NotImplementedError(s.reason);
  num::check_activation_config(a.act);
  if (!a.topk_ids.defined()) num::check_routing_config(a.routing, a.router_logits.size(1));
  const Plan p = make_plan(a, w8a8);
  if (p.M == 0) return;
  if (workspace == nullptr) {
    throw ValueError(fmt::format("{}: workspace is null; workspace_size() asks for {} bytes",
                                 w8a8 ? "cpu_w8a8" : "cpu_w8a16", p.total));
  }
  char* ws = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(workspace) + kAlign - 1) /
                                     kAlign * kAlign);

  Run r{a, p, ws};
  r.gemm = pick_gemm(p.a_bf16);
  r.quant_group = kernel_table(active_isa()).quantize_group_bf16;
  r.ew = &elementwise_table();
  if (r.gemm == nullptr) throw RuntimeError("no CPU GEMM kernel for this operand type");
  if (p.route_inside) {
    r.ids = reinterpret_cast<int32_t*>(ws + p.o_ids);
    r.wts = reinterpret_cast<float*>(ws + p.o_w);
  } else {
    // Read only: the caller's routing.
    r.ids = const_cast<int32_t*>(a.topk_ids.ptr<const int32_t>());
    r.wts = const_cast<float*>(a.topk_weights.ptr<const float>());
  }
  r.counts = reinterpret_cast<int32_t*>(ws + p.o_counts);
  r.offsets = reinterpret_cast<int64_t*>(ws + p.o_offsets);
  r.sorted = reinterpret_cast<int32_t*>(ws + p.o_sorted);
  r.pos = reinterpret_cast<int32_t*>(ws + p.o_pos);
  r.items1 = reinterpret_cast<Item*>(ws + p.o_items1);
  r.items2 = reinterpret_cast<Item*>(ws + p.o_items2);
  r.a1 = p.x_direct ? nullptr : ws + p.o_a1;
  r.sa1 = reinterpret_cast<float*>(ws + p.o_sa1);
  r.hval = p.o_hval ? reinterpret_cast<float*>(ws + p.o_hval) : nullptr;
  r.a2 = ws + p.o_a2;
  r.sa2 = reinterpret_cast<float*>(ws + p.o_sa2);
  r.y2 = ws + p.o_y2;
  r.amax = reinterpret_cast<float*>(ws + p.o_amax);
  float* bias_f = p.route_inside ? reinterpret_cast<float*>(ws + p.o_bias) : nullptr;
  const float* bias = nullptr;
  if (p.route_inside && a.routing.e_score_correction_bias.defined()) {
    const TensorView& b = a.routing.e_score_correction_bias;
    for (int64_t e = 0; e < p.E_global; ++e) bias_f[e] = num::load_float(b, e);
    bias = bias_f;
  }
  const int nthreads = std::max(1, std::min(omp_get_max_threads(), p.threads));
  const MoeScheme& sc = a.scheme;
  ErrorSlot err;
  int64_t V = 0;
  float tensor_scale1 = 0.0f, tensor_scale2 = 0.0f;
  if (p.w8a8 && sc.act == ActQuantKind::kPerTensorStatic) {
    tensor_scale1 = num::load_float(a.weights.a13_scale, 0);
    tensor_scale2 = num::load_float(a.weights.a2_scale, 0);
  }
  const bool x_tensor_amax = p.w8a8 && sc.act == ActQuantKind::kPerTensorDynamic;
  const bool h_phase = p.w8a8 && p.ascale != AScale::kPerKBlock;

  // 1. Routing (when the call carries logits): one parallel loop over tokens.
  if (p.route_inside) {
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t t = 0; t < p.M; ++t) {
      try {
        route_token(r, t, reinterpret_cast<float*>(r.thread_base(omp_get_thread_num()) + p.t_f),
                    bias);
      } catch (...) {
        err.capture();
      }
    }
    err.rethrow();
  }

  // 2. Group the pairs by local expert and list the work items: O(M * topk + E * tiles), on the
  // calling thread (no barrier for the workers to wait at).
  V = moe_align_cpu(r.ids, p.slots,
                    a.expert_map.defined() ? a.expert_map.ptr<const int32_t>() : nullptr,
                    p.E_global, p.E, r.counts, r.offsets, r.sorted, r.pos);
  for (int64_t e = 0; e < p.E; ++e) {
    const int64_t nrb = cdiv(r.offsets[e + 1] - r.offsets[e], kRowBlock);
    for (int64_t ht = 0; ht < p.nht; ++ht) {
      for (int64_t rb = 0; rb < nrb; ++rb) {
        r.items1[r.n_items1++] =
            Item{static_cast<int32_t>(e), static_cast<int32_t>(ht), static_cast<int32_t>(rb), 0};
      }
    }
    for (int64_t nt = 0; nt < p.nt2; ++nt) {
      for (int64_t rb = 0; rb < nrb; ++rb) {
        r.items2[r.n_items2++] =
            Item{static_cast<int32_t>(e), static_cast<int32_t>(nt), static_cast<int32_t>(rb), 0};
      }
    }
  }

  // One parallel region for the rest; the phases are separated by the implicit barriers of the
  // worksharing constructs (only where a phase needs the previous one's results). Nothing inside
  // may throw out of the region: each phase captures its first error, and later phases skip
  // their work once one is set.
#pragma omp parallel num_threads(nthreads)
  {
    const int tid = omp_get_thread_num();
    char* tb = r.thread_base(tid);
    float* tf = reinterpret_cast<float*>(tb + p.t_f);
    uint8_t* tq = reinterpret_cast<uint8_t*>(tb + p.t_q);
    const auto guarded = [&](auto&& fn) {
      if (err.set.load(std::memory_order_relaxed)) return;
      try {
        fn();
      } catch (...) {
        err.capture();
      }
    };

    // 3. The GEMM1 operand: quantise (W8A8) or weight (W8A16) x once per token. A dynamic
    // per-tensor scale needs max|x| first (a max: exact in any order).
    if (x_tensor_amax) {
      float m = 0.0f;
#pragma omp for schedule(static)
      for (int64_t t = 0; t < p.M; ++t) {
        guarded([&] {
          load_x_row(r, t, tf);
          m = num::absmax(tf, p.H, m);
        });
      }
      r.amax[tid * 16] = m;
#pragma omp barrier
#pragma omp single
      {
        float mm = 0.0f;
        for (int i = 0; i < nthreads; ++i) mm = std::fmax(mm, r.amax[i * 16]);
        tensor_scale1 = num::per_tensor_dynamic_scale(mm, sc.fp8);
      }
    }
    if (p.w8a8 && p.ascale == AScale::kPerTensor) {
#pragma omp single
      r.sa1[0] = tensor_scale1;
    }
    if (!p.x_direct) {
#pragma omp for schedule(static)
      for (int64_t t = 0; t < p.M; ++t) {
        guarded([&] { prepare_a1_row(r, t, tf, tq, tensor_scale1); });
      }
    }

    // 4. GEMM1 + activation (+ per-group quantisation of h).
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < r.n_items1; ++i) guarded([&] { gemm1_item(r, r.items1[i], tid); });

    // 5. Per-token / per-tensor quantisation of h (needs whole rows / the whole tensor).
    if (h_phase) {
      if (sc.act == ActQuantKind::kPerTensorDynamic) {
        float m = 0.0f;
#pragma omp for schedule(static)
        for (int64_t v = 0; v < V; ++v) m = num::absmax(r.hval + v * p.I, p.I, m);
        r.amax[tid * 16] = m;
#pragma omp barrier
#pragma omp single
        {
          float mm = 0.0f;
          for (int i = 0; i < nthreads; ++i) mm = std::fmax(mm, r.amax[i * 16]);
          tensor_scale2 = num::per_tensor_dynamic_scale(mm, sc.fp8);
        }
      }
      if (p.ascale == AScale::kPerTensor) {
#pragma omp single
        r.sa2[0] = tensor_scale2;
      }
#pragma omp for schedule(static)
      for (int64_t v = 0; v < V; ++v) {
        guarded([&] {
          const float* hv = r.hval + v * p.I;
          if (p.ascale == AScale::kPerRow) {
            r.sa2[v] = num::quantize_row_per_token_fp8(hv, p.I, tq, sc.fp8);
          } else {
            num::quantize_per_tensor_fp8(hv, p.I, tensor_scale2, tq, sc.fp8);
          }
          codes_to_operand(tq, p.I, static_cast<uint16_t*>(r.a2) + v * p.I);
        });
      }
    }

    // 6. GEMM2 (+ bias, router weight, rounding) into per-slot rows.
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < r.n_items2; ++i) guarded([&] { gemm2_item(r, r.items2[i], tid); });

    // 7. The sum over the top-k slots (the end of the region is the barrier).
    const void** ptrs = reinterpret_cast<const void**>(tb + p.t_ptrs);
#pragma omp for schedule(static) nowait
    for (int64_t t = 0; t < p.M; ++t) guarded([&] { reduce_token(r, t, ptrs); });
  }
  err.rethrow();
}

std::size_t workspace_impl(const FusedMoeArgs& a, bool w8a8) {
  validate_fused_moe_args(a);
  const Support s = cpu_supports_args(a, w8a8);
  if (!s) throw NotImplementedError(s.reason);
  if (a.x.size(0) == 0) return 0;  // nothing to compute
  return make_plan(a, w8a8).total;
}

bool cpu_available() { return true; }  // the scalar level runs anywhere
std::size_t w8a16_workspace(const FusedMoeArgs& a) { return workspace_impl(a, false); }
std::size_t w8a8_workspace(const FusedMoeArgs& a) { return workspace_impl(a, true); }
void w8a16_run(const FusedMoeArgs& a, void* ws) { run_impl(a, ws, false); }
void w8a8_run(const FusedMoeArgs& a, void* ws) { run_impl(a, ws, true); }

}  // namespace

int cpu_max_threads() { return max_threads_cap(); }

Support cpu_w8a16_supports_config(const MoeConfig& config, const std::optional<QuantKey>& wk,
                                  const std::optional<QuantKey>& ak) {
  const char* who = "cpu_w8a16";
  if (Support s = config_ok(who, config); !s) return s;
  int64_t bk = 0;
  if (Support s = weight_key_ok(who, wk, &bk); !s) return s;
  if (ak) {
    return Support::no(fmt::format(
        "cpu_w8a16 computes W8A16 (activations are not quantised); activation key {} needs "
        "cpu_w8a8",
        key_text(ak)));
  }
  return Support::yes();
}

Support cpu_w8a8_supports_config(const MoeConfig& config, const std::optional<QuantKey>& wk,
                                 const std::optional<QuantKey>& ak) {
  const char* who = "cpu_w8a8";
  if (Support s = config_ok(who, config); !s) return s;
  int64_t bk = 0;
  if (Support s = weight_key_ok(who, wk, &bk); !s) return s;
  if (!ak) {
    return Support::no(
        "cpu_w8a8 quantises the activations; activation key None is W8A16 (cpu_w8a16)");
  }
  const auto fail = [&](const char* why) {
    return Support::no(
        fmt::format("cpu_w8a8 does not compute activation key {}: {}", key_text(ak), why));
  };
  if (ak->dtype != KeyDType::kF8E4M3FN) return fail("only float8_e4m3fn activations");
  if (ak->scale.dtype != KeyDType::kF32 || ak->scale2) {
    return fail("only f32 activation scales (MXFP8 is not implemented)");
  }
  const GroupShape g = ak->scale.group_shape;
  if (g.is_per_tensor()) return Support::yes();
  if (g.is_per_token()) {
    if (ak->scale.is_static) return fail("static per-token scales are not a vLLM FP8 MoE scheme");
    return Support::yes();
  }
  if (g.row == 1 && g.col > 0) {
    if (ak->scale.is_static) return fail("per-group activation scales are dynamic");
    if (g.col % kKAlign != 0 || g.col > kMaxKBlock) {
      return fail("the group size must be a multiple of 32 and at most 512");
    }
    if (bk != 0 && bk != g.col) {
      return fail("the activation group must equal the weight block_k");
    }
    if (config.hidden_dim % g.col != 0) {
      return fail("the group size must divide hidden_dim");
    }
    return Support::yes();
  }
  return fail("unsupported scale group shape");
}

Support cpu_supports_args(const FusedMoeArgs& a, bool w8a8) {
  const char* who = w8a8 ? "cpu_w8a8" : "cpu_w8a16";
  const MoeScheme& sc = a.scheme;
  if (a.batched()) {
    return Support::no(fmt::format("{} takes the standard activation format, not batched", who));
  }
  if (sc.fp8 != DType::kF8E4M3FN) {
    return Support::no(
        fmt::format("{} computes float8_e4m3fn weights, not {}", who, dtype_torch_name(sc.fp8)));
  }
  if (sc.weight == WeightScaleKind::kMx) {
    return Support::no(fmt::format("{} does not compute MXFP8 (e8m0-scaled) weights", who));
  }
  if (sc.weight == WeightScaleKind::kBlock &&
      (sc.block_k % kKAlign != 0 || sc.block_k > kMaxKBlock || sc.block_n < 1)) {
    return Support::no(
        fmt::format("{} needs block_k to be a multiple of {} and at most {}, got block [{}, {}]",
                    who, kKAlign, kMaxKBlock, sc.block_n, sc.block_k));
  }
  if (!w8a8 && sc.act != ActQuantKind::kNone) {
    return Support::no(fmt::format("cpu_w8a16 does not quantise activations; scheme {}", sc.str()));
  }
  if (w8a8) {
    switch (sc.act) {
      case ActQuantKind::kNone:
        return Support::no(
            fmt::format("cpu_w8a8 needs quantised activations; scheme {}", sc.str()));
      case ActQuantKind::kMxfp8:
        return Support::no("cpu_w8a8 does not compute MXFP8 activations");
      case ActQuantKind::kPerGroupDynamic:
        if (sc.group_k % kKAlign != 0 || sc.group_k > kMaxKBlock) {
          return Support::no(fmt::format(
              "cpu_w8a8 needs the activation group to be a multiple of {} and at most {}, got {}",
              kKAlign, kMaxKBlock, sc.group_k));
        }
        if (sc.weight == WeightScaleKind::kBlock && sc.block_k != sc.group_k) {
          return Support::no(fmt::format(
              "cpu_w8a8 needs the activation group ({}) to equal the weight block_k ({})",
              sc.group_k, sc.block_k));
        }
        break;
      default:
        break;
    }
  }
  const int64_t H = a.x.defined() && a.x.ndim == 2 ? a.x.size(1) : 0;
  const int64_t I = a.weights.w2.defined() && a.weights.w2.ndim == 3 ? a.weights.w2.size(2) : 0;
  if (H % kKAlign != 0 || I % kKAlign != 0) {
    return Support::no(
        fmt::format("{} needs hidden ({}) and intermediate ({}) sizes that are multiples of {}",
                    who, H, I, kKAlign));
  }
  if (a.act.activation == MoeActivation::kRelu2) {
    return Support::no(fmt::format("{} does not compute the gated relu2 activation", who));
  }
  return Support::yes();
}

static std::string cpu_describe_call(const FusedMoeArgs&) {
  return fmt::format("{} kernels, {} OpenMP threads", isa_name(active_isa()),
                     std::max(1, std::min(omp_get_max_threads(), max_threads_cap())));
}

const ExpertsImpl& cpu_w8a16_experts_impl() {
  static const ExpertsImpl impl = [] {
    ExpertsImpl i;
    i.name = "cpu_w8a16";
    i.device = DeviceKind::kCpu;
    i.supports_config = &cpu_w8a16_supports_config;
    i.available = &cpu_available;
    i.workspace_size = &w8a16_workspace;
    i.run = &w8a16_run;
    i.describe_call = &cpu_describe_call;
    return i;
  }();
  return impl;
}

const ExpertsImpl& cpu_w8a8_experts_impl() {
  static const ExpertsImpl impl = [] {
    ExpertsImpl i;
    i.name = "cpu_w8a8";
    i.device = DeviceKind::kCpu;
    i.supports_config = &cpu_w8a8_supports_config;
    i.available = &cpu_available;
    i.workspace_size = &w8a8_workspace;
    i.run = &w8a8_run;
    i.describe_call = &cpu_describe_call;
    return i;
  }();
  return impl;
}

}  // namespace fp8moe::cpu
