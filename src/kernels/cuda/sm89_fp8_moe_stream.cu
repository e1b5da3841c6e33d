// Host side of the stream path (sm89_fp8_moe_stream.cuh): limits, tiling, workspace and the
// launches (routing when needed, prep, GEMM1, GEMM2), chained with programmatic dependent launch.
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <string>

#include "moe_launchers.hpp"
#include "moe_paths.hpp"
#include "sm89_fp8_moe_stream.cuh"

namespace fp8moe::cuda {

namespace {

constexpr int64_t kStreamMaxTokens = 1024;

int num_sms_stream() {
  static const int n = [] {
    int dev = 0, v = 0;
    FP8MOE_CUDA_CHECK(cudaGetDevice(&dev));
    FP8MOE_CUDA_CHECK(cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, dev));
    return v;
  }();
  return n;
}

// FP8MOE_STREAM_PDL=0 launches the kernels without programmatic dependent launch.
bool pdl_enabled() {
  static const bool on = [] {
    const char* v = std::getenv("FP8MOE_STREAM_PDL");
    return !(v && std::strcmp(v, "0") == 0);
  }();
  return on;
}

bool a_group(AQuant q) { return q == AQuant::kGroupDynamic; }

// Promotion step along K: every step lies in one weight block and one activation group.
int stream_kb(const MoeProblem& p) {
  int kb = 128;
  if (p.w1.scale_kind == static_cast<int>(WScale::kBlock)) kb = std::gcd(kb, p.w1.bk);
  if (p.w2.scale_kind == static_cast<int>(WScale::kBlock)) kb = std::gcd(kb, p.w2.bk);
  if (a_group(p.aq1) || a_group(p.aq2)) kb = std::gcd(kb, p.gk);
  return kb;
}

struct Tiling {
  int kb = 128, rg1 = 1, ct1 = 1, rg2 = 1, ct2 = 1, gw1 = 0, ngr1 = 0, ngmax = 1;
  int64_t n_act_max = 0;
};

// Row groups per CTA: the 8 warps split K into 8 / rg slices of <= ~8 steps each, then fewer row
// groups while the grid would not cover the SMs twice; `unit` columns per row group, a CTA's
// columns must divide `ncols` and stay within `max_cols`.
int pick_rg(int64_t K, int kb, int unit, int64_t ncols, int64_t max_cols, int64_t n_act) {
  const int64_t steps = K / kb;
  int ks = 1;
  while (ks < 8 && (steps + ks - 1) / ks > 8) ks *= 2;
  int rg = 8 / ks;
  while (rg > 1 && (int64_t(rg) * unit > max_cols || ncols % (int64_t(rg) * unit) != 0)) rg /= 2;
  while (rg > 1 && n_act * (ncols / (int64_t(rg) * unit)) < 2 * num_sms_stream()) rg /= 2;
  return rg;
}

Tiling tiling(const MoeProblem& p) {
  Tiling t;
  t.kb = stream_kb(p);
  t.n_act_max = std::min<int64_t>(p.E, p.M * p.topk);
  const int unit1 = p.gated ? 8 : 16;
  if (p.aq2 == AQuant::kGroupDynamic)
    t.gw1 = p.gk;
  else if (p.aq2 == AQuant::kTokenDynamic)
    t.gw1 = static_cast<int>(p.I);
  t.rg1 = pick_rg(p.H, t.kb, unit1, p.I, t.gw1 > 0 ? t.gw1 : p.I, t.n_act_max);
  t.ct1 = static_cast<int>(p.I / (unit1 * t.rg1));
  t.ngr1 = t.gw1 > 0 ? static_cast<int>(p.I / t.gw1) : 0;
  t.rg2 = pick_rg(p.I, t.kb, 16, p.H, p.H, t.n_act_max);
  t.ct2 = static_cast<int>(p.H / (16 * t.rg2));
  t.ngmax = p.M <= 8 ? 1 : (p.M <= 16 ? 2 : 4);
  return t;
}

struct StreamLayout {
  std::size_t ids = 0, tw = 0, meta = 0, act = 0, eoff = 0, plist = 0, tokv = 0, c1 = 0, c2 = 0,
              qx = 0, sx = 0, hbuf = 0, qh = 0, sh = 0, y2 = 0, total = 0;
};

StreamLayout layout(const MoeProblem& p, const Tiling& t) {
  StreamLayout L;
  const int64_t P = p.M * p.topk;
  WorkspaceCarver c{0, 1};
  L.ids = c.take(P * 4);
  L.tw = c.take(P * 4);
  L.meta = c.take(16);
  L.act = c.take(t.n_act_max * 4);
  L.eoff = c.take((t.n_act_max + 1) * 4);
  L.plist = c.take(P * 4);
  L.tokv = c.take(p.M * 4);
  L.c1 = c.take(t.n_act_max * t.ngr1 * 4);
  L.c2 = c.take(p.M * t.ct2 * 4);
  L.qx = c.take(p.M * p.H);
  L.sx = c.take(p.M * (a_group(p.aq1) ? p.H / p.gk : 1) * 4);
  L.hbuf = c.take(t.gw1 > 0 ? P * p.I * 4 : 0);
  L.qh = c.take(P * p.I);
  L.sh = c.take(P * (a_group(p.aq2) ? p.I / p.gk : 1) * 4);
  L.y2 = c.take(P * p.H * (p.x_f32 ? 4 : 2));
  L.total = c.off;
  return L;
}

template <typename... KArgs, typename... Args>
void launch(void (*kernel)(KArgs...), dim3 grid, cudaStream_t st, Args&&... args) {
  launch_pdl(pdl_enabled(), kernel, grid, dim3(kStreamThreads), 0, st, std::forward<Args>(args)...);
}

template <int KB, bool kBlock>
void launch_gemm(const StreamParams& sp, int ngmax, int stage, dim3 grid, cudaStream_t st) {
  if (ngmax == 1)
    launch(moe_stream_gemm_kernel<KB, 1, kBlock>, grid, st, sp, stage);
  else if (ngmax == 2)
    launch(moe_stream_gemm_kernel<KB, 2, kBlock>, grid, st, sp, stage);
  else
    launch(moe_stream_gemm_kernel<KB, 4, kBlock>, grid, st, sp, stage);
}

// Block weights x group activations, or neither (see stream_path_limit).
bool block_scheme(const MoeProblem& p) {
  return p.w1.scale_kind == static_cast<int>(WScale::kBlock);
}

}  // namespace

std::string stream_path_limit(const MoeProblem& p) {
  if (p.M > kStreamMaxTokens) return "more than " + std::to_string(kStreamMaxTokens) + " tokens";
  if (p.topk > 32) return "topk above 32";
  if (p.H % 128 != 0 || p.I % 128 != 0) return "hidden and intermediate must be multiples of 128";
  if (p.aq1 == AQuant::kTensorDynamic || p.aq2 == AQuant::kTensorDynamic)
    return "dynamic per-tensor activation scales need a pass over the whole tensor";
  const bool wb = p.w1.scale_kind == static_cast<int>(WScale::kBlock);
  if (wb != a_group(p.aq1) || wb != a_group(p.aq2))
    return "block weights need group activations and per-tensor/per-channel weights need "
           "per-token or static activations";
  const int kb = stream_kb(p);
  if (kb != 32 && kb != 64 && kb != 128)
    return "weight block_k and activation group must share a step of 32, 64 or 128";
  for (const WeightSide* w : {&p.w1, &p.w2})
    if ((reinterpret_cast<uintptr_t>(w->w) & 15) != 0) return "weights must be 16-byte aligned";
  return {};
}

// Measured (docs/PERFORMANCE.md, run 5): the stream path beats wgmma (and the deleted decode
// path) at every M <= 32
// and wherever the experts average up to ~12 tokens (DeepSeek/Qwen3-30B at M = 128, Qwen3-Next at
// M = 512); wgmma wins from ~16 tokens per expert on (Mixtral M = 128, DeepSeek M = 512).
bool stream_path_preferred(const MoeProblem& p) { return p.M <= 32 || p.M * p.topk <= 12 * p.E; }

std::size_t stream_workspace(const MoeProblem& p) {
  if (p.M == 0 || !stream_path_limit(p).empty()) return 0;
  return layout(p, tiling(p)).total;
}

void run_stream(const MoeProblem& p, void* workspace, bool gemm_only) {
  const Tiling t = tiling(p);
  const StreamLayout L = layout(p, t);
  uint8_t* ws = static_cast<uint8_t*>(workspace);
  StreamParams sp{};
  sp.M = static_cast<int>(p.M);
  sp.H = static_cast<int>(p.H);
  sp.I = static_cast<int>(p.I);
  sp.N1 = static_cast<int>(p.N1);
  sp.E = static_cast<int>(p.E);
  sp.E_global = static_cast<int>(p.E_global);
  sp.topk = static_cast<int>(p.topk);
  sp.P = static_cast<int>(p.M * p.topk);
  sp.gated = p.gated;
  sp.interleaved = static_cast<Act>(p.ap.act) == Act::kSwigluOai;
  sp.x_f32 = p.x_f32;
  sp.h_f32 = p.x_f32 || p.fused_silu_quant;
  sp.router_on_input = p.router_on_input;
  sp.x = p.x;
  // routing inside prep for decode sizes (CTA 0 routes every token, one after the other; CTA 1 + t
  // routes token t again for its own quantisation)
  sp.route_fused = p.route_in_kernel && p.M <= kStreamWarps;
  sp.rp = p.rp;
  sp.ids_ws = reinterpret_cast<int32_t*>(ws + L.ids);
  sp.tw_ws = reinterpret_cast<float*>(ws + L.tw);
  if (p.route_in_kernel) {
    sp.ids = reinterpret_cast<int32_t*>(ws + L.ids);
    sp.tw = reinterpret_cast<float*>(ws + L.tw);
  } else {
    sp.ids = p.topk_ids;
    sp.tw = p.topk_w;
  }
  sp.expert_map = p.expert_map;
  sp.w1 = p.w1;
  sp.w2 = p.w2;
  sp.aq1 = static_cast<int>(p.aq1);
  sp.aq2 = static_cast<int>(p.aq2);
  sp.gk = p.gk;
  sp.ue8m0 = p.ue8m0;
  sp.min_scale2 = p.fused_silu_quant ? 1.0f / (kFp8Max * 512.0f) : 0.0f;
  sp.a13_scale = p.a13_scale;
  sp.a2_scale = p.a2_scale;
  sp.ap = p.ap;
  sp.rg1 = t.rg1;
  sp.ct1 = t.ct1;
  sp.rg2 = t.rg2;
  sp.ct2 = t.ct2;
  sp.gw1 = t.gw1;
  sp.ngr1 = t.ngr1;
  sp.n_act_max = static_cast<int>(t.n_act_max);
  sp.meta = reinterpret_cast<int32_t*>(ws + L.meta);
  sp.act = reinterpret_cast<int32_t*>(ws + L.act);
  sp.eoff = reinterpret_cast<int32_t*>(ws + L.eoff);
  sp.plist = reinterpret_cast<int32_t*>(ws + L.plist);
  sp.tokv = reinterpret_cast<int32_t*>(ws + L.tokv);
  sp.c1 = reinterpret_cast<int32_t*>(ws + L.c1);
  sp.c2 = reinterpret_cast<int32_t*>(ws + L.c2);
  sp.qx = ws + L.qx;
  sp.sx = reinterpret_cast<float*>(ws + L.sx);
  sp.hbuf = reinterpret_cast<float*>(ws + L.hbuf);
  sp.qh = ws + L.qh;
  sp.sh = reinterpret_cast<float*>(ws + L.sh);
  sp.y2 = ws + L.y2;
  sp.out = p.out;

  cudaStream_t st = p.stream;
  if (!gemm_only) {
    if (p.route_in_kernel && !sp.route_fused) {
      RoutingParams rp = p.rp;
      launch_route(rp, sp.M, sp.E_global, sp.topk, reinterpret_cast<int32_t*>(ws + L.ids),
                   reinterpret_cast<float*>(ws + L.tw), st);
    }
    const dim3 grid(static_cast<unsigned>(1 + p.M));
    if (p.x_f32)
      launch(sp.route_fused ? moe_stream_prep_kernel<float, true>
                            : moe_stream_prep_kernel<float, false>,
             grid, st, sp);
    else
      launch(sp.route_fused ? moe_stream_prep_kernel<uint16_t, true>
                            : moe_stream_prep_kernel<uint16_t, false>,
             grid, st, sp);
  }
  const dim3 g1(static_cast<unsigned>(t.ct1), static_cast<unsigned>(t.n_act_max));
  const dim3 g2(static_cast<unsigned>(t.ct2), static_cast<unsigned>(t.n_act_max));
  for (int stage = 1; stage <= 2; ++stage) {
    const dim3 g = stage == 1 ? g1 : g2;
    if (!block_scheme(p))
      launch_gemm<128, false>(sp, t.ngmax, stage, g, st);
    else if (t.kb == 128)
      launch_gemm<128, true>(sp, t.ngmax, stage, g, st);
    else if (t.kb == 64)
      launch_gemm<64, true>(sp, t.ngmax, stage, g, st);
    else
      launch_gemm<32, true>(sp, t.ngmax, stage, g, st);
  }
}

}  // namespace fp8moe::cuda
