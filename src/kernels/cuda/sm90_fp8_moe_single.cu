// Host side of the single-kernel decode path (sm90_fp8_moe_single.cuh): what it takes, its
// workspace, its shared-memory plan and the cooperative launch.
#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

#include "moe_paths.hpp"
#include "sm90_fp8_moe_single.cuh"
#include "sm90_tma.hpp"

namespace fp8moe::cuda {

namespace {

constexpr int kSgMaxSmem = 232448;  // sm_90: 227 KB of dynamic shared memory per block (opt-in)
constexpr int kSgMinStages = 3;

struct SgDevice {
  int sms = 0, coop = 0, cap = 0;
};
const SgDevice& sg_device() {
  static const SgDevice d = [] {
    SgDevice r;
    int dev = 0, major = 0, minor = 0;
    if (cudaGetDevice(&dev) != cudaSuccess) return r;
    cudaDeviceGetAttribute(&r.sms, cudaDevAttrMultiProcessorCount, dev);
    cudaDeviceGetAttribute(&r.coop, cudaDevAttrCooperativeLaunch, dev);
    cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
    cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev);
    r.cap = 10 * major + minor;
    return r;
  }();
  return d;
}

int64_t act_bytes(const MoeProblem& p) {
  const int64_t P = p.M * p.topk;
  // x: M x H in the wgmma B layout plus the 128 bytes the last K chunk's unused B rows read, its
  // scales at M (H + 16)
  const int64_t x = p.M * (p.H + 16) + 128 + p.M * (p.H / 128) * 4;
  const int64_t h = P * (p.I + 16) + P * (p.I / 128) * 4;
  return round_up(std::max(x, h), 16);
}

// The ring: stages of kSgStageBytes (GEMM1 32 rows x kc1 = 1024 bytes as K-block slabs of 4 KB;
// GEMM2 the experts' rows), 1024-aligned (the 128-byte swizzle's alignment), as many as fit after
// the prefix (barriers, tables, reductions, y2 rows, each slot's scale windows, the guard) and
// before the token region. kc1 = 1024: 8 K blocks per stage, 2 per warpgroup (the mma.sync GEMM1
// of run 12 chose 1-4 KB per shape; run 13's wgmma GEMM1 beat it with 1 KB on all 24 decode
// points).
int kc1(const MoeProblem&) { return 1024; }
int nkb2(const MoeProblem& p) { return static_cast<int>(p.I / 128); }
int red_floats(const MoeProblem& p) { return sg_red_floats(kSgWarps, nkb2(p)); }
int win_slot(const MoeProblem& p) { return sg_win_slot(kSgWarps, nkb2(p)); }
int pairs(const MoeProblem& p) { return static_cast<int>(p.M * p.topk); }
int stages(const MoeProblem& p) {
  if (nkb2(p) < 1 || nkb2(p) > kSgWarps) return 0;
  // + 1024: the ring starts at the first 1024-byte boundary after the prefix
  const int64_t left = kSgMaxSmem - 1024 - act_bytes(p) -
                       int64_t(sg_prefix_bytes(pairs(p), red_floats(p), win_slot(p), 0));
  return static_cast<int>(
      std::min<int64_t>(kSgMaxStages, std::max<int64_t>(left, 0) / (kSgStageBytes + win_slot(p))));
}

int smem_bytes(const MoeProblem& p) {
  return static_cast<int>(
      1024 + int64_t(sg_prefix_bytes(pairs(p), red_floats(p), win_slot(p), stages(p))) +
      stages(p) * int64_t(kSgStageBytes) + act_bytes(p));
}

bool aligned16(const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15) == 0; }

struct SgLayout {
  std::size_t ids = 0, tw = 0, sync = 0, hbuf = 0, total = 0;
};
SgLayout layout(const MoeProblem& p) {
  SgLayout L;
  const int64_t P = p.M * p.topk;
  WorkspaceCarver c{0, 1};
  L.ids = c.take(P * 4);
  L.tw = c.take(P * 4);
  L.sync = c.take(16);
  L.hbuf = c.take(P * p.I * 4);
  L.total = c.off;
  return L;
}

// Diagnostics, FP8MOE_SINGLE_TRACE=1 (not while a graph is captured): every call synchronises and
// prints, per phase of the kernel (sm90_fp8_moe_single.cuh, SgTrace), CTA 0's, the median and the
// slowest CTA's time since the first CTA started, and the median / largest time a CTA's consumer
// warp 0 waited for data (GEMM1, GEMM2) and its producer for free slots, and the time consumer
// thread 0 spent in each part of the GEMM loops (SgTrace kTrMma1..kTrEnd2), in us. The waits and
// parts are clock64 cycles converted at the rated clock (cudaDevAttrClockRate): where the SM runs
// slower they read low. Allocates its buffer once (debug only).
bool trace_wanted(cudaStream_t st) {
  static const bool env = [] {
    const char* v = std::getenv("FP8MOE_SINGLE_TRACE");
    return v && std::strcmp(v, "1") == 0;
  }();
  if (!env) return false;
  cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
  FP8MOE_CUDA_CHECK(cudaStreamIsCapturing(st, &cs));
  return cs == cudaStreamCaptureStatusNone;
}
unsigned long long* trace_buffer(unsigned ctas) {
  // one buffer for the process (concurrent traced calls share it: a debugging aid, not for threads)
  static std::mutex mu;
  const std::lock_guard<std::mutex> lock(mu);
  static unsigned long long* buf = nullptr;
  static unsigned cap = 0;
  if (ctas > cap) {
    if (buf) FP8MOE_CUDA_CHECK(cudaFree(buf));
    FP8MOE_CUDA_CHECK(cudaMalloc(&buf, sizeof(unsigned long long) * kSgTracePoints * ctas));
    cap = ctas;
  }
  return buf;
}
void print_trace(const MoeProblem& p, const unsigned long long* dev, int ctas) {
  std::vector<unsigned long long> t(static_cast<std::size_t>(ctas) * kSgTracePoints);
  FP8MOE_CUDA_CHECK(cudaStreamSynchronize(p.stream));
  FP8MOE_CUDA_CHECK(cudaMemcpy(t.data(), dev, t.size() * sizeof(t[0]), cudaMemcpyDeviceToHost));
  unsigned long long t0 = ~0ull;
  for (int b = 0; b < ctas; ++b) t0 = std::min(t0, t[std::size_t(b) * kSgTracePoints]);
  static const char* const names[kSgTracePoints] = {
      "start",      "own-route", "xquant",   "routed",   "tables",   "data1",      "gemm1",
      "barrier",    "hquant",    "data2",    "gemm2",    "prod-end", "wait-full1", "wait-full2",
      "wait-empty", "mma1",      "rel1",     "end1",     "mma2",     "rel2",       "grp2",
      "end2",       "r-keys",    "r-groups", "r-chunks", "r-cand",   "r-slots",    "r-weights"};
  int khz = 0;
  cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, 0);
  std::fprintf(stderr,
               "single trace M=%lld H=%lld I=%lld E=%lld topk=%lld kc1=%d stages=%d warps=%d "
               "(%d CTAs), us since the first start: CTA 0 / median / max (waits: median / "
               "max)\n ",
               static_cast<long long>(p.M), static_cast<long long>(p.H),
               static_cast<long long>(p.I), static_cast<long long>(p.E),
               static_cast<long long>(p.topk), kc1(p), stages(p), kSgWarps, ctas);
  for (int k = 0; k < kSgTracePoints; ++k) {
    const bool wait = k >= kTrWaitFull1;  // and the other cycle sums after it
    std::vector<double> us;
    for (int b = 0; b < ctas; ++b) {
      const unsigned long long v = t[std::size_t(b) * kSgTracePoints + k];
      if (wait)
        us.push_back(double(v) / std::max(khz, 1) * 1e3);
      else if (v)  // 0: not reached (e.g. no GEMM1 unit)
        us.push_back(double(v - t0) * 1e-3);
    }
    if (us.empty()) continue;
    const double cta0 = us.front();
    std::sort(us.begin(), us.end());
    if (wait)
      std::fprintf(stderr, " %s %.1f/%.1f", names[k], us[us.size() / 2], us.back());
    else
      std::fprintf(stderr, " %s %.1f/%.1f/%.1f", names[k], cta0, us[us.size() / 2], us.back());
  }
  std::fprintf(stderr, "\n");
}

}  // namespace

std::string single_path_limit(const MoeProblem& p) {
  const SgDevice& d = sg_device();
  if (d.cap != 90) return "the single-kernel path runs on sm_90 (bulk copies, mbarriers) only";
  if (!d.coop) return "the device cannot launch cooperative kernels";
  return single_problem_limit(p);
}

std::string single_problem_limit(const MoeProblem& p) {
  if (p.M > kSgMaxM) return "more than " + std::to_string(kSgMaxM) + " tokens";
  if (p.M * p.topk > kSgMaxPairs)
    return "more than " + std::to_string(kSgMaxPairs) + " token-expert pairs";
  if (p.x_f32) return "f32 activations";
  if (!p.gated) return "non-gated activations";
  if (static_cast<Act>(p.ap.act) == Act::kSwigluOai) return "interleaved gate/up rows";
  if (p.router_on_input) return "router weight on the input";
  if (p.w1.bias || p.w2.bias) return "biases";
  for (const WeightSide* w : {&p.w1, &p.w2})
    if (w->scale_kind != static_cast<int>(WScale::kBlock) || w->bn != 128 || w->bk != 128)
      return "weights must carry 128x128 block scales";
  if (p.aq1 != AQuant::kGroupDynamic || p.aq2 != AQuant::kGroupDynamic || p.gk != 128)
    return "activations must be quantised in dynamic 1x128 groups";
  if (p.H % 128 != 0 || p.I % 128 != 0) return "hidden and intermediate must be multiples of 128";
  if (p.I > 1024) return "intermediate above 1024 (one GEMM2 stage per expert row block)";
  if (!aligned16(p.x) || !aligned16(p.w1.w) || !aligned16(p.w2.w) || !aligned16(p.w1.scale) ||
      !aligned16(p.w2.scale))
    return "x, weights and weight scales must be 16-byte aligned";
  if ((p.E * p.w1.scale_e_stride) % 4 != 0 || (p.E * p.w2.scale_e_stride) % 4 != 0)
    return "weight scale tensors must be whole 16-byte words";
  if (stages(p) < kSgMinStages || stages(p) * int64_t(kSgStageBytes) < route_smem_bytes(1024))
    return "the tokens leave too little shared memory for the ring";
  return {};
}

std::size_t single_workspace(const MoeProblem& p) {
  if (p.M == 0 || !single_path_limit(p).empty()) return 0;
  return layout(p).total;
}

void run_single(const MoeProblem& p, void* workspace) {
  const SgLayout L = layout(p);
  uint8_t* ws = static_cast<uint8_t*>(workspace);
  SingleParams sp{};
  sp.M = static_cast<int>(p.M);
  sp.H = static_cast<int>(p.H);
  sp.I = static_cast<int>(p.I);
  sp.E = static_cast<int>(p.E);
  sp.E_global = static_cast<int>(p.E_global);
  sp.topk = static_cast<int>(p.topk);
  sp.route = p.route_in_kernel;
  sp.rp = p.rp;
  sp.x = static_cast<const uint16_t*>(p.x);
  sp.ids_in = p.topk_ids;
  sp.tw_in = p.topk_w;
  sp.ids_ws = reinterpret_cast<int32_t*>(ws + L.ids);
  sp.tw_ws = reinterpret_cast<float*>(ws + L.tw);
  sp.expert_map = p.expert_map;
  sp.w1 = p.w1;
  sp.w2 = p.w2;
  sp.w1_scale_end = p.w1.scale + p.E * p.w1.scale_e_stride;
  sp.w2_scale_end = p.w2.scale + p.E * p.w2.scale_e_stride;
  sp.ue8m0 = p.ue8m0;
  sp.min_scale2 = p.fused_silu_quant ? 1.0f / (kFp8Max * 512.0f) : 0.0f;
  sp.h_f32 = p.fused_silu_quant;
  sp.ap = p.ap;
  sp.nstages = stages(p);
  sp.kc1 = kc1(p);
  sp.stage_bytes = kSgStageBytes;
  sp.act_bytes = static_cast<int>(act_bytes(p));
  sp.red_floats = red_floats(p);
  sp.win_slot = win_slot(p);
  sp.hbuf = reinterpret_cast<float*>(ws + L.hbuf);
  sp.sync = reinterpret_cast<unsigned*>(ws + L.sync);
  sp.out = static_cast<uint16_t*>(p.out);

  // GEMM1 weights: boxes of 16 gate + 16 up rows x kc1 bytes of w13 (E * 2I rows of H bytes),
  // 128-byte swizzle
  const CUtensorMap tm_w1 = make_tma_w13_pairs_sw128(p.w1.w, p.H, p.E * 2 * p.I, p.I, sp.kc1 / 128);

  const int smem = smem_bytes(p);
  void (*kernel)(SingleParams, CUtensorMap) = moe_single_kernel<kSgWarps>;
  // The kernel's dynamic shared memory limit only grows, under a lock: the layer may be called from
  // several threads at once (EP ranks simulated by threads on one GPU), and an unlocked
  // check-then-set let a thread needing less lower the limit after one needing more had raised it,
  // whose launch then failed.
  static std::atomic<int> conf{0};
  if (smem > conf.load()) {
    static std::mutex mu;
    const std::lock_guard<std::mutex> lock(mu);
    if (smem > conf.load()) {
      FP8MOE_CUDA_CHECK(
          cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
      conf.store(smem);
    }
  }
  FP8MOE_CUDA_CHECK(cudaMemsetAsync(sp.sync, 0, 16, p.stream));
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(static_cast<unsigned>(sg_device().sms));
  cfg.blockDim = dim3(static_cast<unsigned>(sg_threads(kSgWarps)));
  cfg.dynamicSmemBytes = static_cast<size_t>(smem);
  cfg.stream = p.stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeCooperative;  // every CTA resident: the grid waits on itself
  attr[0].val.cooperative = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  const bool trace = trace_wanted(p.stream);
  if (trace) {
    sp.trace = trace_buffer(cfg.gridDim.x);
    FP8MOE_CUDA_CHECK(cudaMemsetAsync(
        sp.trace, 0, sizeof(unsigned long long) * kSgTracePoints * cfg.gridDim.x, p.stream));
  }
  FP8MOE_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, sp, tm_w1));
  if (trace) print_trace(p, sp.trace, static_cast<int>(cfg.gridDim.x));
}

}  // namespace fp8moe::cuda
