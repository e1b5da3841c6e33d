// The CUDA fused FP8 MoE: the ExpertsImpl entries "cuda_fused" (TritonExperts contract) and
// "cuda_fused_batched" (BatchedTritonExperts contract), path selection and the generic path.
//
// Generic path, per chunk of <= kTokenChunk tokens, all on args.stream, no host synchronisation and
// no allocation (graph-capturable):
//   route (when no topk ids are given) -> moe_align -> quantise x -> GEMM1 (+bias) -> activation
//   -> quantise h -> GEMM2 (+bias, * router weight) -> top-k sum
// The single path (sm90_fp8_moe_single.cu, one token: the whole layer in one cooperative kernel),
// the stream path (sm89_fp8_moe_stream.cu, small batches), the wgmma path
// (sm90_fp8_moe_gemm_wgmma.cu) and the grouped path (the DEEPGEMM-contract grouped GEMMs of
// grouped_moe_cuda.cpp, sm_90 with the B128 scheme, large batches) compute the same function with
// fewer launches / faster GEMMs.
#include <fmt/format.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <optional>

#include "fp8moe/error.hpp"
#include "fp8moe/log.hpp"
#include "fused_moe_cuda.hpp"
#include "grouped_moe_cuda.hpp"
#include "moe_launchers.hpp"
#include "moe_paths.hpp"
#include "moe_problem.hpp"
#include "moe_tuning.hpp"

namespace fp8moe::cuda {

// ---- paths -------------------------------------------------------------------------------------
const char* path_name(Path p) {
  switch (p) {
    case Path::kAuto:
      return "auto";
    case Path::kGeneric:
      return "generic";
    case Path::kWgmma:
      return "wgmma";
    case Path::kStream:
      return "stream";
    case Path::kGrouped:
      return "grouped";
    case Path::kSingle:
      return "single";
  }
  return "?";
}

namespace {
std::atomic<int> g_override{-1};

Path env_path() {
  static const Path p = [] {
    const char* v = std::getenv("FP8MOE_CUDA_PATH");
    if (!v || !*v || std::strcmp(v, "auto") == 0) return Path::kAuto;
    if (std::strcmp(v, "generic") == 0) return Path::kGeneric;
    if (std::strcmp(v, "wgmma") == 0) return Path::kWgmma;
    if (std::strcmp(v, "stream") == 0) return Path::kStream;
    if (std::strcmp(v, "grouped") == 0) return Path::kGrouped;
    if (std::strcmp(v, "single") == 0) return Path::kSingle;
    throw ValueError(fmt::format(
        "FP8MOE_CUDA_PATH='{}' is not one of auto, generic, wgmma, stream, grouped, single", v));
  }();
  return p;
}
}  // namespace

void set_path_override(Path p) { g_override.store(static_cast<int>(p)); }
void clear_path_override() { g_override.store(-1); }
Path path_override() {
  const int o = g_override.load();
  return o >= 0 ? static_cast<Path>(o) : env_path();
}

namespace {
// The single path for one token (any intermediate it takes) and for up to four tokens while
// M * I <= 1536 (docs/PERFORMANCE.md run 13, GEMM1 on wgmma: ahead of the grouped path at M = 1 on
// every shape, DeepSeek-V3 TP2 70.9 vs 72.0 us; at M = 2-4 with I = 256 / 384 by 3-17%; Qwen3-30B
// (I = 768) at M = 2 by 4%, tied at M = 3, behind at M = 4; DeepSeek-V3 TP2 (I = 1024) behind from
// M = 2 by 5-11%).
constexpr int64_t kSingleMaxM = 4;
constexpr int64_t kSingleMaxMI = 1536;
bool single_path_preferred(const MoeProblem& p) {
  return p.M == 1 || (p.M <= kSingleMaxM && p.M * p.I <= kSingleMaxMI);
}
// The grouped path: the cuda_grouped implementation's own limits (B128 scheme, bf16, gated, H and
// I multiples of 128) and its device (capability 9.0 with this binary's sm_90a code).
std::string grouped_path_limit(const MoeProblem& p) {
  if (!grouped_impl().available()) return "the grouped GEMMs run on sm_90 (wgmma + TMA) only";
  return grouped_problem_limit(p);
}
// Measured on the H200 (docs/PERFORMANCE.md, runs 8, 12 and 13): the grouped path beats the stream
// path at M >= 8 on every models.md shape it takes (equal to 2.45x) and the wgmma path at every
// M >= 128 (1.8-4.9x); since the block routing (run 9) it also wins at M = 2-6 on every block-FP8
// shape the single path does not take (above), and for one token with a large intermediate (run
// 12: DeepSeek-V3 TP2 72 vs 90 us on the stream path; where the single path declines, e.g. I >
// 1024).
// Per-tensor / per-token scales (the block-FP8 rule above was measured on block schemes): the
// grouped path at every M it takes. Measured on the H200 (PERFORMANCE.md run 17, Mixtral-8x7B TP2
// per-tensor, the three paths forced in one call): grouped 185.8 / 199.1 / 250.0 / 444.6 / 1196.4 /
// 4227.3 us at M = 8 / 32 / 128 / 512 / 2048 / 8192 against stream 253.9 / 343.7 at M = 8 / 32 and
// wgmma 946.3 - 15761.2 us from M = 128; run 18 (session 22, call 1): grouped 69.3 / 105.3 / 153.8
// us at M = 1 / 2 / 4 against stream 78.5 / 126.5 / 194.8. Schemes the grouped path declines
// (dynamic per-tensor activation scales, shard scales) stay on the stream / wgmma paths.
bool block_scheme(const MoeProblem& p) {
  return p.w1.scale_kind == static_cast<int>(WScale::kBlock) && p.aq1 == AQuant::kGroupDynamic;
}
bool grouped_path_preferred(const MoeProblem& p) {
  if (!block_scheme(p)) return true;
  return p.M >= 2 || p.I > 512;
}
}  // namespace

std::string path_limit(Path p, const FusedMoeArgs& args) {
  const std::string why = problem_unsupported(args);
  if (!why.empty()) return why;
  const MoeProblem prob = make_problem(args);
  switch (p) {
    case Path::kAuto:
    case Path::kGeneric:
      return {};
    case Path::kWgmma:
      return wgmma_path_limit(prob);
    case Path::kStream:
      return stream_path_limit(prob);
    case Path::kGrouped:
      return grouped_path_limit(prob);
    case Path::kSingle:
      return single_path_limit(prob);
  }
  return "unknown path";
}

namespace {
std::optional<TunedConfig> lookup(const MoeProblem& p) {
  TuningKey k;
  k.device = device_name();
  k.E = p.E;
  k.N = p.I;
  k.K = p.H;
  k.topk = p.topk;
  k.scheme = p.scheme;
  return tuned_config(k, p.M);
}

// The path run() takes; with `why`, also the reason in words (formatted only then: run() calls
// this on every forward); with `swap_nb`, the tuned table's n-blocks per swapped grouped tile (0
// when the table gives none or another path).
Path choose(const MoeProblem& p, std::string* why = nullptr, int* swap_nb = nullptr) {
  if (swap_nb) *swap_nb = 0;
  const Path forced = path_override();
  if (forced != Path::kAuto) {
    if (why) *why = g_override.load() >= 0 ? "forced by the caller" : "FP8MOE_CUDA_PATH";
    if (why && p.batch_invariant && forced != Path::kGrouped && forced != Path::kGeneric)
      *why +=
          "; batch invariance is the caller's to keep: only the grouped and generic paths run "
          "one configuration at every M";
    return forced;
  }
  // VLLM_BATCH_INVARIANT: a token's bits must not depend on the batch (vLLM's Triton runs its
  // default config then, no tuned one). The single, stream and wgmma paths add a token's partial
  // sums in another order than the grouped GEMMs, so a token's bits would change with the batch
  // size that picks the path: the grouped path runs at every M (its m-blocks and tile widths give
  // a row the same bits, so they may follow M: grouped_moe_cuda.cpp tile_m_for), and where it
  // declines, the generic path, whose tiles never depend on M.
  if (p.batch_invariant) {
    const std::string gw = grouped_path_limit(p);
    if (why)
      *why = gw.empty() ? std::string(
                              "batch invariant (VLLM_BATCH_INVARIANT): the grouped path at "
                              "every M (its m-blocks give a row the same bits)")
                        : "batch invariant (VLLM_BATCH_INVARIANT): the generic path at every M "
                          "(grouped: " +
                              gw + ")";
    return gw.empty() ? Path::kGrouped : Path::kGeneric;
  }
  if (const auto cfg = lookup(p)) {
    const Path t = cfg->path == "wgmma"     ? Path::kWgmma
                   : cfg->path == "stream"  ? Path::kStream
                   : cfg->path == "grouped" ? Path::kGrouped
                   : cfg->path == "single"  ? Path::kSingle
                                            : Path::kGeneric;
    if (t == Path::kGeneric || (t == Path::kWgmma && wgmma_path_limit(p).empty()) ||
        (t == Path::kStream && stream_path_limit(p).empty()) ||
        (t == Path::kGrouped && grouped_path_limit(p).empty()) ||
        (t == Path::kSingle && single_path_limit(p).empty())) {
      if (t == Path::kGrouped && swap_nb) *swap_nb = cfg->swap_nb;
      if (why)
        *why = fmt::format("tuned table (FP8MOE_CUDA_TUNING): {} E={} N={} K={} M bucket {}{}",
                           device_name(), p.E, p.I, p.H, tuning_bucket(p.M),
                           t == Path::kGrouped && cfg->swap_nb
                               ? fmt::format(", {} n-blocks per swapped tile", cfg->swap_nb)
                               : std::string());
      return t;
    }
  }
  // Measured on the H200 (docs/PERFORMANCE.md, runs 11-13): the single-kernel path for one token
  // and for small batches with a small intermediate; from 2 tokens otherwise the grouped path.
  if (single_path_preferred(p) && single_path_limit(p).empty()) {
    if (why)
      *why = p.M == 1 ? std::string("auto: one token and the single-kernel path takes it")
                      : fmt::format(
                            "auto: M = {} <= 4, M * I = {} <= 1536 and the single-kernel "
                            "path takes it",
                            p.M, p.M * p.I);
    return Path::kSingle;
  }
  const std::string grouped_why = grouped_path_limit(p);
  if (grouped_path_preferred(p) && grouped_why.empty()) {
    if (why)
      *why = !block_scheme(p)
                 ? fmt::format(
                       "auto: M = {} (per-tensor / per-token scales) and the grouped GEMMs "
                       "take it",
                       p.M)
             : p.M >= 2 ? fmt::format("auto: M = {} >= 2 and the grouped GEMMs take it", p.M)
                        : "auto: one token, intermediate > 512 and the grouped GEMMs take it";
    return Path::kGrouped;
  }
  auto not_grouped = [&] {
    return grouped_why.empty() ? "one token, intermediate <= 512" : "grouped: " + grouped_why;
  };
  const std::string stream_why = stream_path_limit(p);
  if (stream_why.empty() && stream_path_preferred(p)) {
    if (why) *why = fmt::format("auto: a small batch ({})", not_grouped());
    return Path::kStream;
  }
  const std::string wgmma_why = wgmma_path_limit(p);
  if (wgmma_why.empty() && wgmma_path_preferred(p)) {
    if (why) *why = fmt::format("auto: M = {} > 32 ({})", p.M, not_grouped());
    return Path::kWgmma;
  }
  if (why)
    *why = fmt::format("auto: no fast path takes it ({}; stream: {}; wgmma: {})", not_grouped(),
                       stream_why.empty() ? "not preferred" : stream_why,
                       wgmma_why.empty() ? "not preferred" : wgmma_why);
  return Path::kGeneric;
}
}  // namespace

Path choose_path(const FusedMoeArgs& args) { return choose(make_problem(args)); }

// ---- generic path ------------------------------------------------------------------------------
namespace {

// Benchmark hook: launch only the two GEMMs over a workspace a previous run() filled.
std::atomic<bool> g_gemm_only{false};

// The expert computation over an aligned row layout: quantise x (x_rows rows), GEMM1, activation,
// quantise h, GEMM2 into y2_out (row = sorted_ids[p]), * router weight when topk_w is given.
struct ExpertRows {
  AlignOut al;
  int32_t num_valid;   // sentinel of sorted_ids
  int32_t gather_div;  // GEMM1's A row = sorted_ids[p] / gather_div
  int64_t capacity;
};

void run_experts(const MoeProblem& p, const void* x, int64_t x_rows, const RowScale& rs,
                 const ExpertRows& r, const Workspace& L, uint8_t* ws, void* y2_out,
                 const float* topk_w) {
  cudaStream_t st = p.stream;
  const bool gemm_only = g_gemm_only.load();
  uint8_t* qx = ws + L.qx;
  float* sx = reinterpret_cast<float*>(ws + L.sx);
  unsigned* amax = reinterpret_cast<unsigned*>(ws + L.amax);
  if (!gemm_only) {
    RowSet rows;
    rows.num_rows = static_cast<int32_t>(x_rows);
    launch_quant(p.act_quant(false, amax), x, p.x_f32, p.H, rows, rs, static_cast<int>(p.H),
                 QuantOut{qx, p.H, sx, p.a_scale_cols(p.H, p.aq1)}, st);
  }
  const GemmRows gr{r.al.sorted_ids, r.al.expert_blk, r.al.meta, r.num_valid, r.gather_div};
  auto scale_kind = [](AQuant q) {
    return static_cast<int32_t>(q == AQuant::kGroupDynamic   ? AScale::kGroup
                                : q == AQuant::kTokenDynamic ? AScale::kToken
                                                             : AScale::kTensor);
  };
  // GEMM1 (gathered token rows, K = H) and GEMM2 (sorted rows, K = I) differ only in these
  auto gemm_args = [&](const uint8_t* a, const float* a_scale, AQuant aq, int64_t K,
                       const WeightSide& w, int64_t N, void* out) {
    GemmArgs g;
    g.rows = gr;
    g.a = a;
    g.a_stride = K;
    g.a_scale = a_scale;
    g.a_scale_kind = scale_kind(aq);
    g.a_scale_stride = p.a_scale_cols(K, aq);
    g.gk = p.gk;
    g.w = w;
    g.N = static_cast<int32_t>(N);
    g.K = static_cast<int32_t>(K);
    g.out = out;
    g.out_f32 = p.x_f32;
    g.out_stride = N;
    g.promote_block =
        w.scale_kind == static_cast<int>(WScale::kBlock) || aq == AQuant::kGroupDynamic;
    return g;
  };
  void* y1 = ws + L.y1;
  {
    GemmArgs g = gemm_args(qx, sx, p.aq1, p.H, p.w1, p.N1, y1);
    g.a_gather = 1;
    launch_gemm_mma(g, static_cast<int>(r.capacity), st);
  }
  const bool h_f32 = p.x_f32 || p.fused_silu_quant;
  void* h = ws + L.h;
  const RowSet srows{r.al.sorted_ids, r.al.meta, static_cast<int32_t>(r.capacity), r.num_valid};
  if (!gemm_only)
    launch_activation(y1, p.x_f32, p.N1, srows, static_cast<int>(p.I), p.ap, h, h_f32, p.I, st);
  uint8_t* qh = ws + L.qh;
  float* sh = reinterpret_cast<float*>(ws + L.sh);
  if (!gemm_only) {
    launch_quant(p.act_quant(true, amax), h, h_f32, p.I, srows, RowScale{}, static_cast<int>(p.I),
                 QuantOut{qh, p.I, sh, p.a_scale_cols(p.I, p.aq2)}, st);
  }
  {
    GemmArgs g = gemm_args(qh, sh, p.aq2, p.I, p.w2, p.H, y2_out);
    g.a_gather = 0;
    g.out_scatter = 1;
    g.topk_w = topk_w;
    launch_gemm_mma(g, static_cast<int>(r.capacity), st);
  }
}

struct ChunkPtrs {
  const void* x;
  void* out;
  const void* logits;
  const int32_t* topk_ids;
  const float* topk_w;
};

// Routing (when needed) and alignment of one chunk; returns the ids/weights in use.
ExpertRows route_and_align(const MoeProblem& p, const ChunkPtrs& c, int64_t m, const Workspace& L,
                           uint8_t* ws, const int32_t** ids_out, const float** tw_out) {
  cudaStream_t st = p.stream;
  const int pairs = static_cast<int>(m * p.topk);
  const int32_t* ids = c.topk_ids;
  const float* tw = c.topk_w;
  if (p.route_in_kernel) {
    int32_t* rid = reinterpret_cast<int32_t*>(ws + L.ids);
    float* rw = reinterpret_cast<float*>(ws + L.tw);
    RoutingParams rp = p.rp;
    rp.logits = c.logits;
    launch_route(rp, static_cast<int>(m), static_cast<int>(p.E_global), static_cast<int>(p.topk),
                 rid, rw, st);
    ids = rid;
    tw = rw;
  }
  ExpertRows r;
  r.al = AlignOut{reinterpret_cast<int32_t*>(ws + L.sorted), reinterpret_cast<int32_t*>(ws + L.blk),
                  reinterpret_cast<int32_t*>(ws + L.meta), reinterpret_cast<int32_t*>(ws + L.cnt),
                  reinterpret_cast<int32_t*>(ws + L.eoff)};
  if (L.fixed_stride == 0) r.al.scratch = reinterpret_cast<int32_t*>(ws + L.align);
  r.num_valid = pairs;
  r.gather_div = static_cast<int32_t>(p.topk);
  r.capacity = L.capacity;
  launch_align(ids, pairs, p.expert_map, static_cast<int>(p.E_global), static_cast<int>(p.E),
               static_cast<int>(L.bm), static_cast<int>(L.capacity), L.fixed_stride, r.al, st);
  *ids_out = ids;
  *tw_out = tw;
  return r;
}

void run_generic_chunk(const MoeProblem& p, const ChunkPtrs& c, int64_t m, const Workspace& L,
                       uint8_t* ws) {
  const int32_t* ids = nullptr;
  const float* tw = nullptr;
  const bool gemm_only = g_gemm_only.load();
  ExpertRows r;
  if (gemm_only) {  // the rows a previous run() aligned
    r.al =
        AlignOut{reinterpret_cast<int32_t*>(ws + L.sorted), reinterpret_cast<int32_t*>(ws + L.blk),
                 reinterpret_cast<int32_t*>(ws + L.meta), reinterpret_cast<int32_t*>(ws + L.cnt),
                 reinterpret_cast<int32_t*>(ws + L.eoff)};
    r.num_valid = static_cast<int32_t>(m * p.topk);
    r.gather_div = static_cast<int32_t>(p.topk);
    r.capacity = L.capacity;
    tw = p.route_in_kernel ? reinterpret_cast<const float*>(ws + L.tw) : c.topk_w;
  } else {
    r = route_and_align(p, c, m, L, ws, &ids, &tw);
  }
  RowScale rs;
  if (p.router_on_input) rs.w = tw;
  void* y2 = ws + L.y2;
  run_experts(p, c.x, m, rs, r, L, ws, y2, p.router_on_input ? nullptr : tw);
  if (gemm_only) return;
  launch_moe_sum(y2, p.x_f32, ids, p.expert_map, static_cast<int>(p.E_global),
                 static_cast<int>(p.E), static_cast<int>(m), static_cast<int>(p.topk),
                 static_cast<int>(p.H), c.out, p.x_f32, p.stream);
}

// Tokens per chunk of the standard and the batched layouts.
constexpr int64_t kBatchedChunk = 256;
int64_t chunk_tokens(const MoeProblem& p, bool batched) {
  return std::min<int64_t>(p.M, batched ? kBatchedChunk : kTokenChunk);
}

std::size_t generic_workspace(const MoeProblem& p, bool batched) {
  if (p.M == 0) return 0;
  return workspace_layout(p, chunk_tokens(p, batched), kGemmBM, batched).total;
}

void run_generic(const MoeProblem& p, void* workspace, bool batched) {
  const int64_t C = chunk_tokens(p, batched);
  const size_t act = p.x_f32 ? 4 : 2;
  const size_t logit_bytes = p.rp.logits_bf16 ? 2 : 4;
  for (int64_t c0 = 0; c0 < p.M; c0 += C) {
    const int64_t m = std::min(C, p.M - c0);
    const Workspace L = workspace_layout(p, m, kGemmBM, batched);
    ChunkPtrs c;
    c.x = static_cast<const uint8_t*>(p.x) + c0 * p.H * act;
    c.out = static_cast<uint8_t*>(p.out) + c0 * p.H * act;
    c.logits = p.route_in_kernel
                   ? static_cast<const uint8_t*>(p.rp.logits) + c0 * p.E_global * logit_bytes
                   : nullptr;
    c.topk_ids = p.topk_ids ? p.topk_ids + c0 * p.topk : nullptr;
    c.topk_w = p.topk_w ? p.topk_w + c0 * p.topk : nullptr;
    run_generic_chunk(p, c, m, L, static_cast<uint8_t*>(workspace));
  }
}

}  // namespace

// ---- wgmma path
// ----------------------------------------------------------------------------------
namespace {

// FP8MOE_WGMMA_PROMOTE=32: promote the wgmma partial sums every 32 of K instead of every 128.
bool wgmma_promote_k32() {
  static const bool on = [] {
    const char* v = std::getenv("FP8MOE_WGMMA_PROMOTE");
    return v && std::strcmp(v, "32") == 0;
  }();
  return on;
}

void run_wgmma_chunk(const MoeProblem& p, const ChunkPtrs& c, int64_t m, const Workspace& L,
                     uint8_t* ws) {
  cudaStream_t st = p.stream;
  const bool gemm_only = g_gemm_only.load();
  const int32_t* ids = nullptr;
  const float* tw = nullptr;
  ExpertRows r;
  if (gemm_only) {
    r.al =
        AlignOut{reinterpret_cast<int32_t*>(ws + L.sorted), reinterpret_cast<int32_t*>(ws + L.blk),
                 reinterpret_cast<int32_t*>(ws + L.meta), reinterpret_cast<int32_t*>(ws + L.cnt),
                 reinterpret_cast<int32_t*>(ws + L.eoff)};
    r.num_valid = static_cast<int32_t>(m * p.topk);
    r.gather_div = static_cast<int32_t>(p.topk);
    r.capacity = L.capacity;
    tw = p.route_in_kernel ? reinterpret_cast<const float*>(ws + L.tw) : c.topk_w;
  } else {
    r = route_and_align(p, c, m, L, ws, &ids, &tw);
  }
  // x quantised straight into the sorted layout (row p = token sorted_ids[p] / topk), so GEMM1's
  // A operand is contiguous and loads with TMA
  uint8_t* qx = ws + L.qxs;
  float* sx = reinterpret_cast<float*>(ws + L.sxs);
  if (!gemm_only) {
    const QuantSpec q = p.act_quant(false, reinterpret_cast<unsigned*>(ws + L.amax));
    RowSet rows{r.al.sorted_ids, r.al.meta, static_cast<int32_t>(r.capacity), r.num_valid,
                static_cast<int32_t>(p.topk)};
    RowScale rs;
    if (p.router_on_input) rs.w = tw;
    launch_quant(q, c.x, p.x_f32, p.H, rows, rs, static_cast<int>(p.H),
                 QuantOut{qx, p.H, sx, p.a_scale_cols(p.H, p.aq1)}, st);
  }
  const GemmRows gr{r.al.sorted_ids, r.al.expert_blk, r.al.meta, r.num_valid, r.gather_div};
  const bool block = p.w1.scale_kind == static_cast<int>(WScale::kBlock);
  auto scale_kind = [](AQuant q) {
    return static_cast<int32_t>(q == AQuant::kGroupDynamic   ? AScale::kGroup
                                : q == AQuant::kTokenDynamic ? AScale::kToken
                                                             : AScale::kTensor);
  };
  uint8_t* qh = ws + L.qh;
  float* sh = reinterpret_cast<float*>(ws + L.sh);
  {
    WgArgs g;
    g.rows = gr;
    g.a = qx;
    g.a_stride = p.H;
    g.a_scale = sx;
    g.a_scale_kind = scale_kind(p.aq1);
    g.a_scale_stride = p.a_scale_cols(p.H, p.aq1);
    g.w = p.w1;
    g.N = static_cast<int32_t>(p.N1);
    g.K = static_cast<int32_t>(p.H);
    g.I = static_cast<int32_t>(p.I);
    g.rows_total = p.E * p.N1;
    g.a_rows = r.capacity;
    g.block = block;
    g.promote_k32 = wgmma_promote_k32();
    g.gk = p.gk;
    g.qh = qh;
    g.sh = sh;
    g.sh_stride = p.a_scale_cols(p.I, p.aq2);
    g.aq2 = static_cast<int32_t>(p.aq2);
    g.a2_scale = p.a2_scale;
    g.min_scale2 = p.fused_silu_quant ? 1.0f / (kFp8Max * 512.0f) : 0.0f;
    g.ue8m0 = p.ue8m0;
    g.ap = p.ap;
    launch_gemm_wgmma(g, false, static_cast<int>(r.capacity), st);
  }
  void* y2 = ws + L.y2;
  {
    WgArgs g;
    g.rows = gr;
    g.a = qh;
    g.a_stride = p.I;
    g.a_scale = p.aq2 == AQuant::kGroupDynamic ? sh : p.a2_scale;
    g.a_scale_kind = scale_kind(p.aq2);
    g.a_scale_stride = p.a_scale_cols(p.I, p.aq2);
    g.w = p.w2;
    g.N = static_cast<int32_t>(p.H);
    g.K = static_cast<int32_t>(p.I);
    g.I = static_cast<int32_t>(p.I);
    g.rows_total = p.E * p.H;
    g.a_rows = r.capacity;
    g.block = block;
    g.promote_k32 = wgmma_promote_k32();
    g.gk = p.gk;
    g.y2 = static_cast<uint16_t*>(y2);
    g.topk_w = p.router_on_input ? nullptr : tw;
    launch_gemm_wgmma(g, true, static_cast<int>(r.capacity), st);
  }
  if (gemm_only) return;
  launch_moe_sum(y2, false, ids, p.expert_map, static_cast<int>(p.E_global), static_cast<int>(p.E),
                 static_cast<int>(m), static_cast<int>(p.topk), static_cast<int>(p.H), c.out, false,
                 st);
}

}  // namespace

bool wgmma_path_preferred(const MoeProblem& p) { return p.M > 32; }

std::size_t wgmma_workspace(const MoeProblem& p) {
  if (p.M == 0 || !wgmma_path_limit(p).empty()) return 0;
  return workspace_layout(p, chunk_tokens(p, false), kGemmBM, false, true).total;
}

void run_wgmma(const MoeProblem& p, void* workspace) {
  const int64_t C = chunk_tokens(p, false);
  const size_t logit_bytes = p.rp.logits_bf16 ? 2 : 4;
  for (int64_t c0 = 0; c0 < p.M; c0 += C) {
    const int64_t m = std::min(C, p.M - c0);
    const Workspace L = workspace_layout(p, m, kGemmBM, false, true);
    ChunkPtrs c;
    c.x = static_cast<const uint8_t*>(p.x) + c0 * p.H * 2;
    c.out = static_cast<uint8_t*>(p.out) + c0 * p.H * 2;
    c.logits = p.route_in_kernel
                   ? static_cast<const uint8_t*>(p.rp.logits) + c0 * p.E_global * logit_bytes
                   : nullptr;
    c.topk_ids = p.topk_ids ? p.topk_ids + c0 * p.topk : nullptr;
    c.topk_w = p.topk_w ? p.topk_w + c0 * p.topk : nullptr;
    run_wgmma_chunk(p, c, m, L, static_cast<uint8_t*>(workspace));
  }
}

// ---- ExpertsImpl entries -----------------------------------------------------------------------
namespace {

Support supports_config(const MoeConfig& config, const std::optional<QuantKey>& wk,
                        const std::optional<QuantKey>& ak) {
  switch (config.activation) {
    case MoeActivation::kRelu2:
      return Support::no(fmt::format("cuda_fused does not implement the {} activation",
                                     activation_repr(config.activation)));
    default:
      break;
  }
  if (!wk || !ak)
    return Support::no("cuda_fused runs FP8 weights with FP8 activations only (no W16A16)");
  if (wk->dtype != KeyDType::kF8E4M3FN || ak->dtype != KeyDType::kF8E4M3FN)
    return Support::no("cuda_fused runs float8_e4m3fn weights and activations only");
  if (wk->scale.dtype != KeyDType::kF32 || ak->scale.dtype != KeyDType::kF32)
    return Support::no("cuda_fused takes f32 scales only (no MXFP8 e8m0 scales)");
  const GroupShape ag = ak->scale.group_shape;
  if (ag.is_per_group() && ag.col != 32 && ag.col != 64 && ag.col != 128)
    return Support::no(
        fmt::format("cuda_fused quantises activations in groups of 32, 64 or 128, not {}", ag.col));
  const GroupShape wg = wk->scale.group_shape;
  if (wg.row > 1 && wg.col > 1 && wg.col % 32 != 0)
    return Support::no(
        fmt::format("cuda_fused needs weight block_k a multiple of 32, not {}", wg.col));
  if (config.num_experts > 1024) return Support::no("cuda_fused routes at most 1024 experts");
  return Support::yes();
}

bool available() { return device_capability() >= 89 && kernels_available(); }

std::size_t workspace_size(const FusedMoeArgs& args) {
  const MoeProblem p = make_problem(args);
  std::size_t n = generic_workspace(p, false);
  n = std::max(n, wgmma_workspace(p));
  n = std::max(n, stream_workspace(p));
  if (p.M > 0 && grouped_path_limit(p).empty()) n = std::max(n, grouped_problem_workspace(p));
  n = std::max(n, single_workspace(p));
  return n;
}

void run(const FusedMoeArgs& args, void* workspace) {
  install_hooks();
  const MoeProblem p = make_problem(args);
  if (p.M == 0) return;
  if (!workspace) throw ValueError("cuda_fused: workspace is null (see workspace_size)");
  int swap_nb = 0;
  const Path path = choose(p, nullptr, &swap_nb);
  switch (path) {
    case Path::kWgmma: {
      const std::string why = wgmma_path_limit(p);
      if (!why.empty()) throw NotImplementedError("cuda_fused wgmma path: " + why);
      run_wgmma(p, workspace);
      return;
    }
    case Path::kStream: {
      const std::string why = stream_path_limit(p);
      if (!why.empty()) throw NotImplementedError("cuda_fused stream path: " + why);
      run_stream(p, workspace, g_gemm_only.load());
      return;
    }
    case Path::kGrouped: {
      const std::string why = grouped_path_limit(p);
      if (!why.empty()) throw NotImplementedError("cuda_fused grouped path: " + why);
      if (g_gemm_only.load())
        throw NotImplementedError("cuda_fused grouped path: no GEMM-only benchmark mode");
      if (swap_nb) {
        MoeProblem q = p;
        q.swap_nb = swap_nb;
        run_grouped_problem(q, workspace);
      } else {
        run_grouped_problem(p, workspace);
      }
      return;
    }
    case Path::kSingle: {
      const std::string why = single_path_limit(p);
      if (!why.empty()) throw NotImplementedError("cuda_fused single path: " + why);
      if (g_gemm_only.load())
        throw NotImplementedError("cuda_fused single path: no GEMM-only benchmark mode");
      run_single(p, workspace);
      return;
    }
    default:
      run_generic(p, workspace, false);
  }
}

std::size_t batched_workspace(const FusedMoeArgs& args) {
  return generic_workspace(make_problem(args), true);
}

// BatchedTritonExperts: the tokens of each expert go to that expert's own block of rows (the
// batched activation format), then the same kernels run. Same function as the standard layout.
void run_batched(const FusedMoeArgs& args, void* workspace) {
  install_hooks();
  const MoeProblem p = make_problem(args);
  if (p.M == 0) return;
  if (!workspace) throw ValueError("cuda_fused_batched: workspace is null (see workspace_size)");
  run_generic(p, workspace, true);
}

}  // namespace

namespace {
// Workspace of run_batched_experts: the external (E, T, H) rows map onto E * round_up(T, bm)
// internal rows.
Workspace external_batched_layout(const MoeProblem& p, int64_t T) {
  Workspace L;
  L.bm = kGemmBM;
  L.m = p.E * T;
  L.capacity = p.E * round_up(T, kGemmBM);
  const bool h_f32 = p.x_f32 || p.fused_silu_quant;
  WorkspaceCarver c{0, 0};
  L.qx = c.take(L.m * p.H);
  L.sx = c.take(std::max<int64_t>(1, L.m * p.a_scale_cols(p.H, p.aq1)) * 4);
  L.sorted = c.take(L.capacity * 4);
  L.blk = c.take(L.capacity / kGemmBM * 4);
  L.meta = c.take(16);
  L.y1 = c.take(L.capacity * p.N1 * (p.x_f32 ? 4 : 2));
  L.h = c.take(L.capacity * p.I * (h_f32 ? 4 : 2));
  L.qh = c.take(L.capacity * p.I);
  L.sh = c.take(std::max<int64_t>(1, L.capacity * p.a_scale_cols(p.I, p.aq2)) * 4);
  L.amax = c.take(16);
  L.total = c.off;
  return L;
}

MoeProblem external_batched_problem(const FusedMoeArgs& args, const BatchedExpertsArgs& b) {
  MoeProblem p = make_problem(args);
  if (!b.x.defined() || b.x.ndim != 3 || b.x.size(0) != p.E || b.x.size(2) != p.H ||
      b.x.dtype != args.x.dtype || !b.x.device.is_cuda())
    throw ValueError(fmt::format("batched x {} must be ({}, T, {}) {} on the GPU", b.x.describe(),
                                 p.E, p.H, dtype_name(args.x.dtype)));
  if (!b.out.defined() || b.out.sizes() != b.x.sizes() || b.out.dtype != b.x.dtype ||
      !b.out.device.is_cuda())
    throw ValueError(
        fmt::format("batched out {} must match x {}", b.out.describe(), b.x.describe()));
  if (!b.expert_num_tokens.defined() || b.expert_num_tokens.dtype != DType::kI32 ||
      b.expert_num_tokens.numel() != p.E || !b.expert_num_tokens.device.is_cuda())
    throw ValueError(fmt::format("expert_num_tokens {} must be ({}) i32 on the GPU",
                                 b.expert_num_tokens.describe(), p.E));
  p.topk = 1;
  p.M = p.E * b.x.size(1);
  p.router_on_input = false;
  return p;
}
}  // namespace

std::size_t batched_workspace_size(const FusedMoeArgs& args, const BatchedExpertsArgs& b) {
  const MoeProblem p = external_batched_problem(args, b);
  return external_batched_layout(p, b.x.size(1)).total;
}

void run_batched_experts(const FusedMoeArgs& args, const BatchedExpertsArgs& b, void* workspace) {
  install_hooks();
  const MoeProblem p = external_batched_problem(args, b);
  const int64_t T = b.x.size(1);
  if (T == 0 || p.E == 0) return;
  if (!workspace) throw ValueError("run_batched_experts: workspace is null");
  const Workspace L = external_batched_layout(p, T);
  uint8_t* ws = static_cast<uint8_t*>(workspace);
  ExpertRows r;
  r.al = AlignOut{reinterpret_cast<int32_t*>(ws + L.sorted), reinterpret_cast<int32_t*>(ws + L.blk),
                  reinterpret_cast<int32_t*>(ws + L.meta), nullptr, nullptr};
  r.num_valid = static_cast<int32_t>(p.E * T);
  r.gather_div = 1;
  r.capacity = L.capacity;
  launch_batched_rows(static_cast<const int32_t*>(b.expert_num_tokens.data), static_cast<int>(p.E),
                      static_cast<int>(T), static_cast<int>(round_up(T, kGemmBM)), kGemmBM, r.al,
                      p.stream);
  run_experts(p, b.x.data, p.M, RowScale{}, r, L, ws, b.out.data, nullptr);
}

void set_bench_gemm_only(bool on) { g_gemm_only.store(on); }

static std::string describe_call(const FusedMoeArgs& args) {
  std::string why;
  const MoeProblem p = make_problem(args);
  int swap_nb = 0;
  const Path path = choose(p, &why, &swap_nb);
  std::string s = fmt::format("{} path ({})", path_name(path), why);
  if (path == Path::kGrouped) {
    MoeProblem q = p;
    q.swap_nb = swap_nb;  // the tuned table's n-blocks, as run() passes them
    s += ": " + grouped_problem_plan(q);
  }
  return s;
}

const ExpertsImpl& fused_impl() {
  static const ExpertsImpl impl = [] {
    ExpertsImpl i;
    i.name = "cuda_fused";
    i.device = DeviceKind::kCuda;
    i.supports_config = supports_config;
    i.available = available;
    i.workspace_size = workspace_size;
    i.run = run;
    i.describe_call = describe_call;
    return i;
  }();
  return impl;
}

const ExpertsImpl& fused_batched_impl() {
  static const ExpertsImpl impl = [] {
    ExpertsImpl i;
    i.name = "cuda_fused_batched";
    i.device = DeviceKind::kCuda;
    i.supports_config = supports_config;
    i.available = available;
    i.workspace_size = batched_workspace;
    i.run = run_batched;
    return i;
  }();
  return impl;
}

}  // namespace fp8moe::cuda
