// "cuda_grouped" and "cuda_grouped_masked" (grouped_moe_cuda.hpp): the host chain around the
// Hopper FP8 grouped GEMM. Routing, alignment, quantisation, activation and the top-k sum are the
// shared kernels of the CUDA fused MoE (moe_launchers.hpp; x quantised once per token into its
// pairs' sorted rows, the activation and the quantisation of h in one kernel), so the numerics
// around the GEMMs are the reference's (spec/numerics.md §3-§6) exactly as in cuda_fused.
#include "grouped_moe_cuda.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>

#include "fp8moe/error.hpp"
#include "fused_moe_cuda.hpp"
#include "moe_launchers.hpp"
#include "moe_problem.hpp"
#include "sm90_fp8_grouped_gemm.hpp"

namespace fp8moe::cuda {

namespace {

constexpr int64_t kBM = 128;  // the grouped GEMM's M tile = DeepGEMM's M alignment

// The m-block of the grouped GEMMs for this many rows per expert: the swapped-operand kernel
// (16/32/64) at <= 64 rows (80-93% of HBM read bandwidth at 16 rows per expert on the H200, against
// 57-72% with 128-row padding; docs/PERFORMANCE.md), else 128. FP8MOE_GROUPED_TILE_M = 16, 32, 64
// or 128 forces one; FP8MOE_GROUPED_SWAP=0 turns the swapped kernel off. The batch-invariant mode
// (FusedMoeArgs::batch_invariant, VLLM_BATCH_INVARIANT) uses the same rule: every m-block and tile
// width gives a row the same bits (the same k32 wgmma steps in the same K order, the same fmaf
// promotion per 128-deep block; test CudaGroupedGemmTileInvariance on the card, PERFORMANCE.md
// grouped run 13), so the m-block may follow M. Until session 29 it pinned 128 rows, which cost
// 1.3-2.7x at M = 1-32 (grouped run 12).
int64_t tile_m_for(double rows_per_expert) {
  static const int forced = [] {
    const char* v = std::getenv("FP8MOE_GROUPED_TILE_M");
    if (!v || !*v) return 0;
    const int t = std::atoi(v);
    if (t != 16 && t != 32 && t != 64 && t != 128)
      throw ValueError(fmt::format("FP8MOE_GROUPED_TILE_M='{}' is not one of 16, 32, 64, 128", v));
    return t;
  }();
  static const bool swap = [] {
    const char* v = std::getenv("FP8MOE_GROUPED_SWAP");
    return !(v && v[0] == '0');
  }();
  if (forced) return forced;
  return swap ? grouped_tile_m(rows_per_expert) : 128;
}

// GEMM1 with the activation and the 1x128 quantisation of h fused into its epilogue
// (GroupedGemmParams::fuse_act; gate and up n-blocks paired in one 128 x 256 tile, 128-row
// m-blocks): opt-in FP8MOE_GROUPED_FUSE_ACT=1, measured 39-52% slower in the layer
// (docs/PERFORMANCE.md, grouped run 5). (The same epilogue on the 16-token swapped kernel,
// FP8MOE_GROUPED_SWAP_FUSE, was 5-11% slower at M = 8 and 32: grouped run 12; deleted in session
// 29, commit 5919d39 has it.)
QuantSpec group_quant(const MoeProblem& p, bool second, unsigned* amax);

bool fuse_act_wanted(const MoeProblem& p, int64_t bm) {
  static const bool env128 = [] {
    const char* v = std::getenv("FP8MOE_GROUPED_FUSE_ACT");
    return v && v[0] == '1';
  }();
  return p.aq2 == AQuant::kGroupDynamic && bm == 128 && env128;
}

std::atomic<int> g_fused_sum_override{-1};

// Between the GEMMs (unless GEMM1's epilogue fused it): the activation of y1 (rows, 2 I) and the
// 1 x 128 quantisation of h into qh / sh in one kernel (launch_act_quant: h is never written;
// bitwise what launch_activation + launch_quant give, h rounded to bf16 or kept f32 for the fused
// SiLU+quant semantics). Measured faster than the two kernels on the H200 (docs/PERFORMANCE.md).
// Per-token dynamic and static per-tensor scales of h (the cuda_fused grouped path) are fused the
// same way (run 18: Mixtral TP2 per-tensor at M = 8192, activation 607 + quantisation 483 us as
// two scalar kernels). Dynamic per-tensor scales (not taken by the grouped path today) would go
// through launch_activation into h (workspace, keeps_h) and launch_quant, as the generic path does.
bool act_fused(const MoeProblem& p) {
  return act_quant_fusable(p.act_quant(true, nullptr), static_cast<int>(p.I), p.ap);
}
void act_then_quant(const MoeProblem& p, const void* y1, const RowSet& rows, unsigned* amax,
                    uint8_t* qh, float* sh, uint8_t* h, cudaStream_t st) {
  if (p.aq2 == AQuant::kGroupDynamic) {
    launch_act_quant(static_cast<const uint16_t*>(y1), p.N1, rows, static_cast<int>(p.I), p.ap,
                     p.fused_silu_quant, group_quant(p, true, amax),
                     QuantOut{qh, p.I, sh, p.I / 128}, st);
    return;
  }
  if (act_fused(p)) {
    launch_act_quant(static_cast<const uint16_t*>(y1), p.N1, rows, static_cast<int>(p.I), p.ap,
                     p.fused_silu_quant, p.act_quant(true, amax),
                     QuantOut{qh, p.I, sh, p.a_scale_cols(p.I, p.aq2)}, st);
    return;
  }
  if (!h) throw ValueError("cuda_grouped: no h buffer for per-token / per-tensor scales");
  const bool h_f32 = p.fused_silu_quant;
  launch_activation(y1, false, p.N1, rows, static_cast<int>(p.I), p.ap, h, h_f32, p.I, st);
  launch_quant(p.act_quant(true, amax), h, h_f32, p.I, rows, RowScale{}, static_cast<int>(p.I),
               QuantOut{qh, p.I, sh, p.a_scale_cols(p.I, p.aq2)}, st);
}

// The grouped path keeps an h buffer in its workspace only for per-token / per-tensor h scales.
bool keeps_h(const MoeProblem& p) { return p.aq2 != AQuant::kGroupDynamic && !act_fused(p); }

// GEMM1's fused epilogue: the same activation and quantisation as launch_activation + launch_quant
// with group_quant(p, true, .) would apply (h kept f32 for the fused SiLU+quant semantics).
void set_fused_act(GroupedGemmParams& g, const MoeProblem& p, uint8_t* qh, float* sh) {
  g.fuse_act = 1;
  g.act = p.ap;
  g.act_h_f32 = p.fused_silu_quant ? 1 : 0;
  const QuantSpec q = group_quant(p, true, nullptr);
  g.q_ue8m0 = q.ue8m0 ? 1 : 0;
  g.q_min_scale = q.min_scale;
  g.q_out = qh;
  g.q_stride = p.I;
  g.q_scale = sh;
  g.q_scale_stride = p.I / 128;
}

// contract: the DEEPGEMM contract (cuda_grouped, cuda_grouped_masked: 128 x 128 weight blocks and
// dynamic 1 x 128 activation groups only). Otherwise the cuda_fused grouped path, which also runs
// per-expert (per-tensor) weight scales and per-token / per-tensor activation scales through the
// same kernels (zero scale strides: GroupedGemmParams).
std::string limit_of(const MoeProblem& p, bool contract) {
  if (p.x_f32) return "f32 activations (the DeepGEMM contract takes bf16)";
  if (!p.gated) return "non-gated activations";
  if (static_cast<Act>(p.ap.act) == Act::kSwigluOai) return "interleaved gate/up columns";
  for (const WeightSide* w : {&p.w1, &p.w2}) {
    const bool block128 =
        w->scale_kind == static_cast<int>(WScale::kBlock) && w->bn == 128 && w->bk == 128;
    const bool tensor = w->scale_kind == static_cast<int>(WScale::kTensor);
    if (contract ? !block128 : !(block128 || tensor))
      return contract ? "weights need 128x128 block scales"
                      : "weights need 128x128 block scales or one scale per expert";
  }
  if (contract) {
    if (p.aq1 != AQuant::kGroupDynamic || p.aq2 != AQuant::kGroupDynamic || p.gk != 128)
      return "activations need dynamic 1x128 group scales";
  } else if ((p.aq1 == AQuant::kGroupDynamic || p.aq2 == AQuant::kGroupDynamic) && p.gk != 128) {
    return "activation groups must be 1x128";
  } else if (p.aq1 == AQuant::kTensorDynamic) {
    // x is quantised into the sorted rows, so an amax over them would miss the tokens with no
    // local slot (expert parallelism, padded slots); the reference takes all M tokens (the wgmma
    // and stream paths decline this scheme too)
    return "dynamic per-tensor activation scales";
  }
  if (p.H % 128 != 0 || p.I % 128 != 0)
    return fmt::format("hidden ({}) and intermediate ({}) must be multiples of 128", p.H, p.I);
  if (p.E > kGroupedMaxExperts)
    return fmt::format("more than {} local experts", kGroupedMaxExperts);
  for (const WeightSide* w : {&p.w1, &p.w2})
    if ((reinterpret_cast<uintptr_t>(w->w) & 15) != 0) return "weights must be 16-byte aligned";
  return {};
}

void require(const MoeProblem& p, const char* name, bool contract) {
  const std::string why = limit_of(p, contract);
  if (!why.empty()) throw NotImplementedError(fmt::format("{}: {}", name, why));
}

GroupedGemmParams gemm_params(const MoeProblem& p, const WeightSide& w, int64_t N, int64_t K,
                              int64_t a_rows, const float* a_scale, AQuant aq) {
  GroupedGemmParams g;
  g.N = static_cast<int32_t>(N);
  g.K = static_cast<int32_t>(K);
  g.a_rows = a_rows;
  g.a_scale = a_scale;
  g.a_scale_stride = p.a_scale_cols(K, aq);  // K / 128 groups, 1 per token, 0 per tensor
  g.a_scale_kb = aq == AQuant::kGroupDynamic ? 1 : 0;
  g.b_scale = w.scale;
  g.b_scale_e_stride = w.scale_e_stride;
  const bool block = w.scale_kind == static_cast<int>(WScale::kBlock);
  g.b_scale_n_stride = block ? w.scale_n_stride : 0;  // per-tensor: one scale per expert
  g.b_scale_kb = block ? 1 : 0;
  g.bias = w.bias;
  g.bias_bf16 = w.bias_bf16;
  g.swap_nb = p.swap_nb;
  return g;
}

QuantSpec group_quant(const MoeProblem& p, bool second, unsigned* amax) {
  QuantSpec q;
  q.kind = AQuant::kGroupDynamic;
  q.gk = 128;
  q.ue8m0 = p.ue8m0;
  q.min_scale = second && p.fused_silu_quant ? 1.0f / (kFp8Max * 512.0f) : 0.0f;
  q.amax_ws = amax;
  return q;
}

// ---- contiguous ("cuda_grouped") ---------------------------------------------------------------

int64_t chunk_of(const MoeProblem& p) { return std::min<int64_t>(p.M, kGroupedChunkTokens); }

std::size_t contiguous_workspace(const FusedMoeArgs& args) {
  const MoeProblem p = make_problem(args);
  require(p, "cuda_grouped", true);
  return grouped_problem_workspace(p);
}

void run_contiguous_chunk(const MoeProblem& p, const void* x, void* out, const void* logits,
                          const int32_t* topk_ids, const float* topk_w, int64_t m,
                          const Workspace& L, uint8_t* ws) {
  const int64_t bm = L.bm;  // the grouped GEMMs' m-block (expert chunks are aligned to it)
  cudaStream_t st = p.stream;
  const int pairs = static_cast<int>(m * p.topk);
  const int32_t* ids = topk_ids;
  const float* tw = topk_w;
  if (p.route_in_kernel) {
    int32_t* rid = reinterpret_cast<int32_t*>(ws + L.ids);
    float* rw = reinterpret_cast<float*>(ws + L.tw);
    RoutingParams rp = p.rp;
    rp.logits = logits;
    launch_route(rp, static_cast<int>(m), static_cast<int>(p.E_global), static_cast<int>(p.topk),
                 rid, rw, st);
    ids = rid;
    tw = rw;
  }
  // permute: per-expert chunks aligned to bm rows; the alignment also writes each pair's sorted
  // position (pair_pos) for the quantisation of x below
  const AlignOut al{
      reinterpret_cast<int32_t*>(ws + L.sorted), reinterpret_cast<int32_t*>(ws + L.blk),
      reinterpret_cast<int32_t*>(ws + L.meta),   reinterpret_cast<int32_t*>(ws + L.cnt),
      reinterpret_cast<int32_t*>(ws + L.eoff),   reinterpret_cast<int32_t*>(ws + L.ppos),
      reinterpret_cast<int32_t*>(ws + L.align)};
  unsigned* amax = reinterpret_cast<unsigned*>(ws + L.amax);
  uint8_t* qx = ws + L.qxs;
  float* sx = reinterpret_cast<float*>(ws + L.sxs);
  launch_align(ids, pairs, p.expert_map, static_cast<int>(p.E_global), static_cast<int>(p.E),
               static_cast<int>(bm), static_cast<int>(L.capacity), 0, al, st);
  // x quantised straight into the permuted order (row p = token sorted_ids[p] / topk). 1 x 128
  // groups: each token once, written to the sorted rows of its pairs (launch_quant_scatter;
  // bitwise what quantising every valid sorted row would give; measured faster on the H200:
  // docs/PERFORMANCE.md; require() has checked p.gk == 128). Per-token / per-tensor scales (the
  // cuda_fused path only): launch_quant over the sorted rows, gathered from their tokens. Padding
  // rows stay unwritten: the GEMMs never store their outputs.
  RowScale rs;
  if (p.router_on_input) rs.w = tw;
  if (p.aq1 == AQuant::kGroupDynamic) {
    launch_quant_scatter(group_quant(p, false, amax), x, false, p.H, static_cast<int>(m),
                         static_cast<int>(p.topk), al.pair_pos, rs, static_cast<int>(p.H),
                         QuantOut{qx, p.H, sx, p.H / 128}, st);
  } else {
    // per-token / per-tensor scales (the cuda_fused grouped path): quantise the sorted rows
    // from their tokens (gathered, as the wgmma path does); a per-tensor scale lands in sx[0]
    const QuantSpec q = p.act_quant(false, amax);
    const RowSet rows{al.sorted_ids, al.meta, static_cast<int32_t>(L.capacity), pairs,
                      static_cast<int32_t>(p.topk)};
    launch_quant(q, x, false, p.H, rows, rs, static_cast<int>(p.H),
                 QuantOut{qx, p.H, sx, p.a_scale_cols(p.H, p.aq1)}, st);
  }
  const int64_t max_mblk = L.capacity / bm;
  void* y1 = ws + L.y1;
  uint8_t* qh = ws + L.qh;
  float* sh = reinterpret_cast<float*>(ws + L.sh);
  const bool fuse = fuse_act_wanted(p, bm);
  {
    GroupedGemmParams g = gemm_params(p, p.w1, p.N1, p.H, L.capacity, sx, p.aq1);
    g.tile_m = static_cast<int32_t>(bm);
    g.expert_blk = al.expert_blk;
    g.num_rows_ptr = al.meta;
    g.sorted_ids = al.sorted_ids;
    g.num_valid = pairs;
    g.out = static_cast<uint16_t*>(y1);
    g.out_stride = p.N1;
    if (fuse) set_fused_act(g, p, qh, sh);
    launch_grouped_gemm(g, qx, p.w1.w, p.E * p.N1, max_mblk, st);
  }
  if (!fuse)
    act_then_quant(p, y1, RowSet{al.sorted_ids, al.meta, static_cast<int32_t>(L.capacity), pairs},
                   amax, qh, sh, ws + L.h, st);
  void* y2 = ws + L.y2;
  // (and buffers the kernel can take: y2 rows on 128-byte lines, which it discards after the sum,
  // a 16-byte aligned out; else the sum kernel, which takes any)
  const bool fsum = grouped_fused_sum_wanted(p, bm) &&
                    (reinterpret_cast<uintptr_t>(y2) & 127) == 0 && p.H % 64 == 0 &&
                    (reinterpret_cast<uintptr_t>(out) & 15) == 0;
  {
    GroupedGemmParams g = gemm_params(p, p.w2, p.H, p.I, L.capacity, sh, p.aq2);
    g.tile_m = static_cast<int32_t>(bm);
    g.expert_blk = al.expert_blk;
    g.num_rows_ptr = al.meta;
    g.sorted_ids = al.sorted_ids;
    g.num_valid = pairs;
    g.out = static_cast<uint16_t*>(y2);
    g.out_stride = p.H;
    g.out_scatter = 1;  // unpermute: row = (token, slot)
    g.row_weight = p.router_on_input ? nullptr : tw;
    if (fsum) {  // the top-k sum in GEMM2's epilogue, tiles n-tile-major
                 // (sm90_fp8_grouped_gemm.hpp)
      int32_t* cnt = reinterpret_cast<int32_t*>(ws + L.sumc);
      if (bm == 128) {
        g.tile_n = 256;
        g.epi_async = 0;
        g.mcast = 0;
      }
      launch_fused_sum_prep(ids, p.expert_map, static_cast<int>(p.E_global), static_cast<int>(p.E),
                            static_cast<int>(m), static_cast<int>(p.topk), static_cast<int>(p.H),
                            static_cast<int>(p.H / grouped_sum_cols(g)), cnt,
                            static_cast<uint16_t*>(out), st);
      g.group_m = static_cast<int32_t>(std::max<int64_t>(max_mblk, 1));
      g.sum_out = static_cast<uint16_t*>(out);
      g.sum_cnt = cnt;
      g.sum_ids = ids;
      g.sum_map = p.expert_map;
      g.sum_E_global = static_cast<int32_t>(p.E_global);
      g.sum_E_local = static_cast<int32_t>(p.E);
      g.sum_topk = static_cast<int32_t>(p.topk);
    }
    launch_grouped_gemm(g, qh, p.w2.w, p.E * p.H, max_mblk, st);
  }
  // reduce over the top-k slots (fp32 sum, one rounding), unless GEMM2 did
  if (!fsum)
    launch_moe_sum(y2, false, ids, p.expert_map, static_cast<int>(p.E_global),
                   static_cast<int>(p.E), static_cast<int>(m), static_cast<int>(p.topk),
                   static_cast<int>(p.H), out, false, st);
}

void run_contiguous(const FusedMoeArgs& args, void* workspace) {
  install_hooks();
  const MoeProblem p = make_problem(args);
  require(p, "cuda_grouped", true);
  run_grouped_problem(p, workspace);
}

}  // namespace

std::size_t grouped_problem_workspace(const MoeProblem& p) {
  require(p, "cuda_grouped", false);
  if (p.M == 0) return 0;
  return workspace_layout(p, chunk_of(p), kBM, false, true, keeps_h(p)).total;
}

std::string grouped_problem_limit(const MoeProblem& p) { return limit_of(p, false); }

namespace {
// One GEMM of the plan: the kernel, its tile and what its epilogue does.
std::string gemm_plan(const char* name, const MoeProblem& p, int64_t bm, int64_t N, int64_t K,
                      bool fuse) {
  GroupedGemmParams g;
  g.tile_m = static_cast<int32_t>(bm);
  g.N = static_cast<int32_t>(N);
  g.K = static_cast<int32_t>(K);
  g.swap_nb = p.swap_nb;
  g.fuse_act = fuse ? 1 : 0;
  std::string s;
  if (bm < 128) {
    const int nb = fuse ? 2 : grouped_swap_nb(g);
    s = fmt::format("{} (N {}, K {}): {}", name, N, K,
                    fuse ? "a gate and an up n-block of 128 rows per tile"
                         : fmt::format("{} n-block{} of 128 rows per tile", nb, nb > 1 ? "s" : ""));
  } else {
    s = fmt::format("{} (N {}, K {}): 128 x {} tiles", name, N, K,
                    fuse ? 256 : grouped_tile_n(g));  // the fused epilogue: the 256 tile
  }
  return s;
}
}  // namespace

void set_grouped_fused_sum_override(int v) { g_fused_sum_override.store(v); }

bool grouped_fused_sum_wanted(const MoeProblem& p, int64_t bm) {
  static const bool env = [] {
    const char* v = std::getenv("FP8MOE_GROUPED_FUSED_SUM");
    if (!v || !*v) return false;
    const std::string s(v);
    if (s != "0" && s != "1")
      throw ValueError("FP8MOE_GROUPED_FUSED_SUM='" + s + "' is not 0 or 1");
    return s == "1";
  }();
  const int o = g_fused_sum_override.load();
  const bool on = o >= 0 ? o == 1 : env;
  // the swapped kernels or the 128 x 256 tile of GEMM2 (N = H), bf16 y2 and out, topk <= 32
  return on && (bm < 128 || p.H % 256 == 0) && !p.x_f32 && p.topk <= 32;
}

std::string grouped_problem_plan(const MoeProblem& p) {
  if (p.M == 0) return "no tokens: nothing runs";
  const int64_t m = chunk_of(p);
  const double rpe = double(m * p.topk) / double(p.E);
  const int64_t bm = tile_m_for(rpe);
  const bool fuse = fuse_act_wanted(p, bm);
  std::string s = fmt::format("{:.1f} rows per expert{}; ", rpe,
                              m < p.M ? fmt::format(" (chunks of {} tokens)", m) : std::string());
  s += bm < 128 ? fmt::format("{}-token m-blocks (swapped operands: no 128-row padding)", bm)
                : std::string("128-row m-blocks");
  s += p.route_in_kernel ? "; routing kernel" : "; routing given";
  s += "; alignment, then x quantised into the sorted rows";
  s += "; " + gemm_plan("GEMM1", p, bm, p.N1, p.H, fuse);
  s += fuse ? " with the activation and h's 1x128 quantisation in its epilogue"
            : "; activation and h's quantisation kernel";
  s += "; " + gemm_plan("GEMM2", p, bm, p.H, p.I, false);
  s += grouped_fused_sum_wanted(p, bm)
           ? " scattered to (token, slot) rows with the router weight, n-tile-major, with the "
             "top-k sum in its epilogue (FP8MOE_GROUPED_FUSED_SUM)"
           : " scattered to (token, slot) rows with the router weight; top-k sum";
  return s;
}

void run_grouped_problem(const MoeProblem& p, void* workspace) {
  require(p, "cuda_grouped", false);
  if (p.M == 0) return;
  if (!workspace) throw ValueError("cuda_grouped: workspace is null (see workspace_size)");
  const int64_t C = chunk_of(p);
  const size_t logit_bytes = p.rp.logits_bf16 ? 2 : 4;
  for (int64_t c0 = 0; c0 < p.M; c0 += C) {
    const int64_t m = std::min(C, p.M - c0);
    const int64_t bm = tile_m_for(double(m * p.topk) / double(p.E));
    const Workspace L = workspace_layout(p, m, bm, false, true, keeps_h(p));
    run_contiguous_chunk(
        p, static_cast<const uint8_t*>(p.x) + c0 * p.H * 2,
        static_cast<uint8_t*>(p.out) + c0 * p.H * 2,
        p.route_in_kernel ? static_cast<const uint8_t*>(p.rp.logits) + c0 * p.E_global * logit_bytes
                          : nullptr,
        p.topk_ids ? p.topk_ids + c0 * p.topk : nullptr,
        p.topk_w ? p.topk_w + c0 * p.topk : nullptr, m, L, static_cast<uint8_t*>(workspace));
  }
}

namespace {

// ---- masked ("cuda_grouped_masked") ------------------------------------------------------------

struct MaskedProblem {
  MoeProblem p;
  int64_t E = 0, max_m = 0;
  const int32_t* counts = nullptr;
};

// The batched args seen as a standard problem over the E * max_m slab rows (for the shared checks
// and descriptors); routing is absent in this format, so a placeholder top-1 routing of the right
// shape stands in (never read).
MaskedProblem masked_problem(const FusedMoeArgs& a) {
  if (!a.batched())
    throw ValueError("cuda_grouped_masked: expert_num_tokens is required (batched format)");
  validate_fused_moe_args(a);
  const TensorView& x = a.x;
  if (x.ndim != 3)
    throw ValueError(fmt::format("cuda_grouped_masked: x {} must be (E, max_m, H)", x.describe()));
  MaskedProblem mp;
  mp.E = x.size(0);
  mp.max_m = x.size(1);
  const int64_t H = x.size(2), rows = mp.E * mp.max_m;
  if (!a.expert_num_tokens.device.is_cuda() || a.expert_num_tokens.dtype != DType::kI32)
    throw ValueError(fmt::format("cuda_grouped_masked: expert_num_tokens {} must be i32 on the GPU",
                                 a.expert_num_tokens.describe()));
  if (!a.out.defined() || a.out.sizes() != x.sizes() || a.out.dtype != x.dtype)
    throw ValueError(
        fmt::format("cuda_grouped_masked: out {} must match x {}", a.out.describe(), x.describe()));
  if (rows > INT32_MAX / 2) throw ValueError("cuda_grouped_masked: E * max_m is too large");
  FusedMoeArgs s = a;
  s.expert_num_tokens = {};
  s.x = TensorView(x.data, x.dtype, {rows, H}, x.device);
  s.out = TensorView(a.out.data, a.out.dtype, {rows, H}, a.out.device);
  void* placeholder = a.expert_num_tokens.data;
  s.topk_ids = TensorView(placeholder, DType::kI32, {rows, 1}, x.device);
  s.topk_weights = TensorView(placeholder, DType::kF32, {rows, 1}, x.device);
  s.router_logits = {};
  s.expert_map = {};
  s.apply_router_weight_on_input = false;
  mp.p = make_problem(s);
  mp.counts = static_cast<const int32_t*>(a.expert_num_tokens.data);
  return mp;
}

struct MaskedLayout {
  std::size_t ids = 0, meta = 0, qx = 0, sx = 0, y1 = 0, qh = 0, sh = 0, amax = 0, total = 0;
};
MaskedLayout masked_layout(const MoeProblem& p, int64_t rows) {
  MaskedLayout L;
  WorkspaceCarver c{0, 0};
  L.ids = c.take(rows * 4);
  L.meta = c.take(16);
  L.qx = c.take(rows * p.H);
  L.sx = c.take(std::max<int64_t>(1, rows * (p.H / 128)) * 4);
  L.y1 = c.take(rows * p.N1 * 2);
  L.qh = c.take(rows * p.I);
  L.sh = c.take(std::max<int64_t>(1, rows * (p.I / 128)) * 4);
  L.amax = c.take(16);
  L.total = c.off;
  return L;
}

std::size_t masked_workspace(const FusedMoeArgs& args) {
  const MaskedProblem mp = masked_problem(args);
  require(mp.p, "cuda_grouped_masked", true);
  const int64_t rows = mp.E * mp.max_m;
  if (rows == 0) return 0;
  return masked_layout(mp.p, rows).total;
}

void run_masked(const FusedMoeArgs& args, void* workspace) {
  install_hooks();
  const MaskedProblem mp = masked_problem(args);
  const MoeProblem& p = mp.p;
  require(p, "cuda_grouped_masked", true);
  const int64_t rows = mp.E * mp.max_m;
  if (rows == 0) return;
  if (!workspace) throw ValueError("cuda_grouped_masked: workspace is null (see workspace_size)");
  cudaStream_t st = p.stream;
  uint8_t* ws = static_cast<uint8_t*>(workspace);
  const MaskedLayout L = masked_layout(p, rows);
  int32_t* ids = reinterpret_cast<int32_t*>(ws + L.ids);
  int32_t* meta = reinterpret_cast<int32_t*>(ws + L.meta);
  launch_masked_rows(mp.counts, static_cast<int>(mp.E), static_cast<int>(mp.max_m), ids, meta, st);
  const RowSet vrows{ids, meta, static_cast<int32_t>(rows), static_cast<int32_t>(rows)};
  unsigned* amax = reinterpret_cast<unsigned*>(ws + L.amax);
  uint8_t* qx = ws + L.qx;
  float* sx = reinterpret_cast<float*>(ws + L.sx);
  launch_quant(group_quant(p, false, amax), p.x, false, p.H, vrows, RowScale{},
               static_cast<int>(p.H), QuantOut{qx, p.H, sx, p.H / 128}, st);
  // m-block from the slab height (the counts stay on the device); host bound of the blocks
  const int64_t bm = tile_m_for(double(mp.max_m));
  const int64_t max_mblk = mp.E * ceil_div(mp.max_m, bm);
  void* y1 = ws + L.y1;
  uint8_t* qh = ws + L.qh;
  float* sh = reinterpret_cast<float*>(ws + L.sh);
  const bool fuse = fuse_act_wanted(p, bm);
  {
    GroupedGemmParams g = gemm_params(p, p.w1, p.N1, p.H, rows, sx, p.aq1);
    g.tile_m = static_cast<int32_t>(bm);
    g.masked = 1;
    g.counts = mp.counts;
    g.E = static_cast<int32_t>(mp.E);
    g.max_m = static_cast<int32_t>(mp.max_m);
    g.out = static_cast<uint16_t*>(y1);
    g.out_stride = p.N1;
    if (fuse) set_fused_act(g, p, qh, sh);
    launch_grouped_gemm(g, qx, p.w1.w, p.E * p.N1, max_mblk, st);
  }
  if (!fuse) act_then_quant(p, y1, vrows, amax, qh, sh, nullptr, st);
  {
    GroupedGemmParams g = gemm_params(p, p.w2, p.H, p.I, rows, sh, p.aq2);
    g.tile_m = static_cast<int32_t>(bm);
    g.masked = 1;
    g.counts = mp.counts;
    g.E = static_cast<int32_t>(mp.E);
    g.max_m = static_cast<int32_t>(mp.max_m);
    g.out = static_cast<uint16_t*>(p.out);
    g.out_stride = p.H;
    launch_grouped_gemm(g, qh, p.w2.w, p.E * p.H, max_mblk, st);
  }
}

// ---- ExpertsImpl entries -----------------------------------------------------------------------

Support supports_config(const MoeConfig& config, const std::optional<QuantKey>& wk,
                        const std::optional<QuantKey>& ak) {
  if (!activation_is_gated(config.activation) || config.activation == MoeActivation::kSwigluOai)
    return Support::no(
        fmt::format("cuda_grouped runs gated activations with packed gate/up only, not {}",
                    activation_repr(config.activation)));
  if (config.activation == MoeActivation::kRelu2)
    return Support::no("cuda_grouped does not implement relu2");
  if (!wk || !ak)
    return Support::no("cuda_grouped runs FP8 weights with FP8 activations only (no W16A16)");
  if (wk->dtype != KeyDType::kF8E4M3FN || ak->dtype != KeyDType::kF8E4M3FN)
    return Support::no("cuda_grouped runs float8_e4m3fn weights and activations only");
  if (wk->scale.dtype != KeyDType::kF32 || ak->scale.dtype != KeyDType::kF32)
    return Support::no("cuda_grouped takes f32 scales only");
  if (wk->scale.group_shape != GroupShape(128, 128))
    return Support::no("cuda_grouped needs 128x128 weight blocks");
  if (ak->scale.group_shape != GroupShape(1, 128))
    return Support::no("cuda_grouped needs 1x128 dynamic activation groups");
  if (config.in_dtype != DType::kBF16) return Support::no("cuda_grouped takes bf16 activations");
  if (config.num_experts > 4096) return Support::no("cuda_grouped routes at most 4096 experts");
  return Support::yes();
}

bool available() { return device_capability() == 90 && kernels_available(); }

}  // namespace

std::string grouped_limit(const FusedMoeArgs& args) {
  try {
    if (args.batched()) return limit_of(masked_problem(args).p, true);
    return limit_of(make_problem(args), true);
  } catch (const Error& e) {
    return e.what();
  }
}

bool deep_gemm_shape_ok(int64_t M, int64_t N, int64_t K) {
  constexpr int64_t align = 128;
  return align <= M && N % align == 0 && K % align == 0 && N > 512;
}

const ExpertsImpl& grouped_impl() {
  static const ExpertsImpl impl = [] {
    ExpertsImpl i;
    i.name = "cuda_grouped";
    i.device = DeviceKind::kCuda;
    i.supports_config = supports_config;
    i.available = available;
    i.workspace_size = contiguous_workspace;
    i.run = run_contiguous;
    i.describe_call = [](const FusedMoeArgs& args) {
      return "grouped GEMMs (DEEPGEMM contract): " + grouped_problem_plan(make_problem(args));
    };
    return i;
  }();
  return impl;
}

const ExpertsImpl& grouped_masked_impl() {
  static const ExpertsImpl impl = [] {
    ExpertsImpl i;
    i.name = "cuda_grouped_masked";
    i.device = DeviceKind::kCuda;
    i.supports_config = supports_config;
    i.available = available;
    i.workspace_size = masked_workspace;
    i.run = run_masked;
    i.describe_call = [](const FusedMoeArgs& args) {
      const MaskedProblem mp = masked_problem(args);
      const MoeProblem& p = mp.p;
      const int64_t bm = tile_m_for(double(mp.max_m));
      const bool fuse = fuse_act_wanted(p, bm);
      return fmt::format(
          "grouped GEMMs, masked layout (BATCHED_DEEPGEMM contract): {} experts x {} rows; {}; "
          "x quantised per slab row; {}{}; {} into the output slabs",
          mp.E, mp.max_m,
          bm < 128 ? fmt::format("{}-token m-blocks (swapped operands)", bm)
                   : std::string("128-row m-blocks"),
          gemm_plan("GEMM1", p, bm, p.N1, p.H, fuse),
          fuse ? " with the activation and h's 1x128 quantisation in its epilogue"
               : "; activation and h's quantisation kernel",
          gemm_plan("GEMM2", p, bm, p.H, p.I, false));
    };
    return i;
  }();
  return impl;
}

}  // namespace fp8moe::cuda
