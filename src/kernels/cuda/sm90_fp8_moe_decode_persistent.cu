// Host side of the persistent decode kernel (sm90_fp8_moe_decode_persistent.cuh): limits,
// workspace, TMA descriptors and the launch (one counter memset + one kernel).
#include <mutex>
#include <string>

#include "moe_paths.hpp"
#include "sm90_fp8_moe_decode_persistent.cuh"
#include "sm90_tma.hpp"

namespace fp8moe::cuda {

namespace {

int64_t n_act_max(const MoeProblem& p) { return std::min<int64_t>(p.E, p.M * p.topk); }
int64_t group_cols(const MoeProblem& p, int64_t cols, AQuant q) {
  return q == AQuant::kGroupDynamic ? cols / p.gk : 1;
}

struct DecodeLayout {
  std::size_t counters = 0, counter_bytes = 0, qx = 0, sx = 0, h = 0, qh = 0, sh = 0, y2 = 0,
              total = 0;
};

DecodeLayout decode_layout(const MoeProblem& p) {
  DecodeLayout L;
  const int64_t P = p.M * p.topk;
  const int64_t na = n_act_max(p);
  std::size_t off = 0;
  auto take = [&](std::size_t bytes) {
    const std::size_t at = off;
    off += (bytes + 255) / 256 * 256;
    return at;
  };
  const int64_t ngr = p.aq2 == AQuant::kGroupDynamic ? p.I / p.gk : 1;
  L.counter_bytes = (32 + na * ngr + na + p.M * (p.H / kDecR2)) * sizeof(int);
  L.counters = take(L.counter_bytes);
  L.qx = take(p.M * p.H);
  L.sx = take(p.M * group_cols(p, p.H, p.aq1) * 4);
  L.h = take(P * p.I * 4);
  L.qh = take(P * p.I);
  L.sh = take(P * group_cols(p, p.I, p.aq2) * 4);
  L.y2 = take(P * p.H * (p.x_f32 ? 4 : 2));
  L.total = off;
  return L;
}

constexpr std::size_t decode_smem_bytes() {
  return 1024 + kDecStages * kDecStageBytes + kDecScratchBytes + sizeof(DecTables) + 8 +
         (2 * kDecStages + 2 * kDecQueue) * sizeof(uint64_t);
}

int num_sms() {
  static const int n = [] {
    int dev = 0, v = 0;
    FP8MOE_CUDA_CHECK(cudaGetDevice(&dev));
    FP8MOE_CUDA_CHECK(cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, dev));
    return v;
  }();
  return n;
}

template <typename TX>
void configure_once() {
  static std::once_flag once;
  std::call_once(once, [] {
    FP8MOE_CUDA_CHECK(cudaFuncSetAttribute(moe_decode_kernel<TX>,
                                           cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           static_cast<int>(decode_smem_bytes())));
  });
}

}  // namespace

std::string decode_path_limit(const MoeProblem& p) {
  if (p.M > kDecMaxTokens) return "more than " + std::to_string(kDecMaxTokens) + " tokens";
  if (p.M * p.topk > kDecMaxPairs) return "more than " + std::to_string(kDecMaxPairs) + " pairs";
  if (p.topk > 32) return "topk above 32";
  if (p.H % 128 != 0 || p.I % 128 != 0) return "hidden and intermediate must be multiples of 128";
  if (p.aq1 == AQuant::kTensorDynamic) return "dynamic per-tensor input scales need a grid pass";
  if (p.aq2 != AQuant::kGroupDynamic && p.aq2 != AQuant::kTensorStatic)
    return "the intermediate must be quantised per group or with a static scale";
  if (p.aq2 == AQuant::kGroupDynamic && p.gk < 32) return "group size below 32";
  for (const WeightSide* w : {&p.w1, &p.w2}) {
    if (w->scale_kind == static_cast<int>(WScale::kBlock) && w->bk % 32 != 0)
      return "weight block_k must be a multiple of 32";
    if ((reinterpret_cast<uintptr_t>(w->w) & 15) != 0) return "weights must be 16-byte aligned";
  }
  if (sizeof(DecTables) > 48 * 1024) return "tables too large";
  return {};
}

bool decode_path_preferred(const MoeProblem& p) { return p.M <= 32; }

std::size_t decode_workspace(const MoeProblem& p) {
  if (p.M == 0 || !decode_path_limit(p).empty()) return 0;
  return decode_layout(p).total;
}

void run_decode(const MoeProblem& p, void* workspace) {
  const DecodeLayout L = decode_layout(p);
  uint8_t* ws = static_cast<uint8_t*>(workspace);
  DecodeParams d{};
  d.M = static_cast<int>(p.M);
  d.H = static_cast<int>(p.H);
  d.I = static_cast<int>(p.I);
  d.E = static_cast<int>(p.E);
  d.E_global = static_cast<int>(p.E_global);
  d.topk = static_cast<int>(p.topk);
  d.gated = p.gated;
  d.x_f32 = p.x_f32;
  d.route_in_kernel = p.route_in_kernel;
  d.router_on_input = p.router_on_input;
  d.rp = p.rp;
  d.x = p.x;
  d.topk_ids = p.topk_ids;
  d.topk_w = p.topk_w;
  d.expert_map = p.expert_map;
  d.w1 = p.w1;
  d.w2 = p.w2;
  d.aq1 = static_cast<int>(p.aq1);
  d.aq2 = static_cast<int>(p.aq2);
  d.gk = p.gk;
  d.ue8m0 = p.ue8m0;
  d.h_f32 = p.x_f32 || p.fused_silu_quant;
  d.min_scale2 = p.fused_silu_quant ? 1.0f / (kFp8Max * 512.0f) : 0.0f;
  d.a13_scale = p.a13_scale;
  d.a2_scale = p.a2_scale;
  d.ap = p.ap;
  // GEMM2 item: rb2 blocks of 64 rows, so that one item streams ~64 KB or more of w2
  int rb2 = 1;
  while (rb2 < 4 && p.H % (kDecR2 * rb2 * 2) == 0 && int64_t(kDecR2) * rb2 * p.I < 64 * 1024)
    rb2 *= 2;
  if (p.decode_rb2 > 0 && p.H % (int64_t(kDecR2) * p.decode_rb2) == 0) rb2 = p.decode_rb2;
  d.rb2 = rb2;
  d.counters = reinterpret_cast<int*>(ws + L.counters);
  d.n_act_max = static_cast<int>(n_act_max(p));
  d.qx = ws + L.qx;
  d.sx = reinterpret_cast<float*>(ws + L.sx);
  d.h = ws + L.h;
  d.qh = ws + L.qh;
  d.sh = reinterpret_cast<float*>(ws + L.sh);
  d.y2 = ws + L.y2;
  d.out = p.out;
  if (d.aq2 != static_cast<int>(AQuant::kGroupDynamic)) d.gk = d.gk > 0 ? d.gk : 128;

  const CUtensorMap tm13 = make_tma_2d_u8(p.w1.w, p.H, p.E * p.N1, 128, 16);
  const CUtensorMap tm2 = make_tma_2d_u8(p.w2.w, p.I, p.E * p.H, 128, 16);
  FP8MOE_CUDA_CHECK(cudaMemsetAsync(d.counters, 0, L.counter_bytes, p.stream));
  const int grid = num_sms();
  const std::size_t smem = decode_smem_bytes();
  if (p.x_f32) {
    configure_once<float>();
    moe_decode_kernel<float><<<grid, kDecThreads, smem, p.stream>>>(d, tm13, tm2);
  } else {
    configure_once<uint16_t>();
    moe_decode_kernel<uint16_t><<<grid, kDecThreads, smem, p.stream>>>(d, tm13, tm2);
  }
  FP8MOE_CUDA_CHECK_LAUNCH();
}

}  // namespace fp8moe::cuda
