// GPU benchmark of the CUDA fused FP8 MoE ("cuda_fused") over the models.md shapes and batch sizes,
// with the card's ceilings measured in the same run:
//   * device-to-device copy bandwidth (bytes read + written per second), a 4 GiB cudaMemcpyAsync;
//   * cuBLASLt FP8 GEMM rate (e4m3 x e4m3 -> bf16, fp32 accumulation) at 8192^3 on random data.
// Each configuration is timed by CUDA-graph replay of L back-to-back layers (each layer its own
// weights and router logits, so nothing stays in L2 between layers, as in a real model), median
// over replays, divided by L. Reported per (shape, M): full-layer time, GEMM-only time (generic and
// wgmma paths: the two GEMM kernels alone; stream path: GEMM1 + GEMM2 with its top-k sum),
// unique expert bytes touched, TB/s on them, TFLOP/s (6 M topk N K), and the fractions of the
// measured ceilings. Output: a table on stdout and a CSV (--csv FILE).
//
//   bench_cuda_moe [--quick] [--csv FILE] [--shape NAME[,NAME...]] [--m LIST] [--path
//   auto|generic|wgmma|stream|grouped|single[,...]] [--ncu] [--tune FILE] [--batch-invariant]
// --quick: M = 1, 32, 2048 (replaces --m). --path: a list measures each path that takes the
// problem; without --path, FP8MOE_CUDA_PATH chooses when set. --ncu: one direct run per
// configuration for a profiler to attach to (no table, no CSV). --tune FILE: first times every
// path, and the grouped path's n-blocks per swapped tile, on each shape and M, and writes the
// fastest per M bucket to FILE (the table FP8MOE_CUDA_TUNING reads). --batch-invariant: every call
// with FusedMoeArgs::batch_invariant (VLLM_BATCH_INVARIANT: one configuration at every M).
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <set>
#include <string>
#include <vector>

#include "bench_cuda_common.cuh"
#include "fp8moe/fused_moe.hpp"
#include "kernels/cuda/fused_moe_cuda.hpp"
#include "kernels/cuda/moe_tuning.hpp"
#include "numerics/routing.hpp"

namespace {

using namespace fp8moe;

__device__ __forceinline__ uint32_t hash32(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ull;
  x ^= x >> 33;
  return static_cast<uint32_t>(x);
}
// fp8 e4m3 codes of moderate magnitude (no NaN), random sign
__global__ void fill_fp8(uint8_t* p, int64_t n, uint64_t seed) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const uint32_t h = hash32(seed * 0x9E3779B97F4A7C15ull + i);
    p[i] = static_cast<uint8_t>((h & 0x80u) | (0x20u + (h >> 8) % 0x38u));
  }
}
__global__ void fill_f32(float* p, int64_t n, uint64_t seed, float lo, float hi) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const uint32_t h = hash32(seed * 0x9E3779B97F4A7C15ull + i);
    p[i] = lo + (hi - lo) * (h >> 8) * (1.0f / 16777216.0f);
  }
}
__global__ void fill_bf16(uint16_t* p, int64_t n, uint64_t seed, float scale) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const uint32_t h = hash32(seed * 0x9E3779B97F4A7C15ull + i);
    const float f = scale * ((h >> 8) * (2.0f / 16777216.0f) - 1.0f);
    uint32_t u;
    memcpy(&u, &f, 4);
    p[i] = static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
  }
}

// Streaming copy and read kernels (16-byte accesses, grid-stride): what SM-driven code can reach.
__global__ void copy_kernel(const uint4* __restrict__ a, uint4* __restrict__ b, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    b[i] = a[i];
}

void* dalloc(size_t bytes) {
  void* p = nullptr;
  CK(cudaMalloc(&p, std::max<size_t>(bytes, 256)));
  return p;
}

struct Shape {
  const char* name;
  int64_t E, K, N;  // experts, hidden, intermediate per rank
  int topk;
  bool per_tensor;
  RoutingMethodType method;
  int groups, topk_group;
  double rsf;
};

const Shape kShapes[] = {
    {"deepseek_v3_tp8", 256, 7168, 256, 8, false, RoutingMethodType::kDeepSeekV3, 8, 4, 2.5},
    {"deepseek_v3_tp2", 256, 7168, 1024, 8, false, RoutingMethodType::kDeepSeekV3, 8, 4, 2.5},
    {"qwen3_30b_a3b_tp1", 128, 2048, 768, 8, false, RoutingMethodType::kRenormalizeNaive, 0, 0,
     1.0},
    {"qwen3_235b_tp4", 128, 4096, 384, 8, false, RoutingMethodType::kRenormalizeNaive, 0, 0, 1.0},
    {"qwen3_next_tp2", 512, 2048, 256, 10, false, RoutingMethodType::kRenormalizeNaive, 0, 0, 1.0},
    {"minimax_m2_tp4", 256, 3072, 384, 8, false, RoutingMethodType::kMiniMax2, 0, 0, 1.0},
    {"mixtral_8x7b_tp2_pt", 8, 4096, 7168, 2, true, RoutingMethodType::kRenormalize, 0, 0, 1.0},
};

struct Layer {
  uint8_t *w13, *w2;
  float *s13, *s2;
  float* logits;  // (M, E)
  int32_t* ids;   // (M, topk) precomputed (for GEMM-only runs)
  float* tw;
  float* bias;  // e_score_correction_bias
  int64_t touched = 0;
};

float median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0f : v[v.size() / 2];
}

// Times `body` (which enqueues L layers on `st`) by graph replay; returns median ms per replay.
template <class F>
float time_graph(cudaStream_t st, F body, int reps) {
  cudaGraph_t g;
  cudaGraphExec_t ge;
  CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
  body();
  CK(cudaStreamEndCapture(st, &g));
  CK(cudaGraphInstantiate(&ge, g, 0));
  for (int i = 0; i < 3; ++i) CK(cudaGraphLaunch(ge, st));
  CK(cudaStreamSynchronize(st));
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  std::vector<float> t;
  for (int i = 0; i < reps; ++i) {
    CK(cudaEventRecord(a, st));
    CK(cudaGraphLaunch(ge, st));
    CK(cudaEventRecord(b, st));
    CK(cudaEventSynchronize(b));
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, a, b));
    t.push_back(ms);
  }
  CK(cudaGraphExecDestroy(ge));
  CK(cudaGraphDestroy(g));
  CK(cudaEventDestroy(a));
  CK(cudaEventDestroy(b));
  return median(t);
}

struct BwCeilings {
  double memcpy_tbs = 0, copy_tbs = 0, read_tbs = 0;
};
BwCeilings measure_bw(cudaStream_t st) {
  const size_t bytes = size_t(4) << 30;
  void* a = dalloc(bytes);
  void* b = dalloc(bytes);
  uint32_t* sink = static_cast<uint32_t*>(dalloc(4));
  fill_fp8<<<1024, 256, 0, st>>>(static_cast<uint8_t*>(a), bytes, 1);
  CK(cudaGetLastError());
  int sms = 0, dev = 0;
  CK(cudaGetDevice(&dev));
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  const int64_t n16 = static_cast<int64_t>(bytes / 16);
  BwCeilings c;
  float ms = time_graph(
      st, [&] { CK(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, st)); }, 10);
  c.memcpy_tbs = 2.0 * bytes / (ms * 1e-3) / 1e12;
  ms = time_graph(
      st,
      [&] {
        copy_kernel<<<sms * 8, 512, 0, st>>>(static_cast<const uint4*>(a), static_cast<uint4*>(b),
                                             n16);
      },
      10);
  c.copy_tbs = 2.0 * bytes / (ms * 1e-3) / 1e12;
  ms = time_graph(
      st, [&] { read_kernel<<<sms * 8, 512, 0, st>>>(static_cast<const uint4*>(a), n16, sink); },
      10);
  c.read_tbs = 1.0 * bytes / (ms * 1e-3) / 1e12;
  CK(cudaFree(a));
  CK(cudaFree(b));
  CK(cudaFree(sink));
  return c;
}

double measure_cublaslt_fp8(cudaStream_t st) {
  const int64_t n = 8192;
  cublasLtHandle_t h;
  CKB(cublasLtCreate(&h));
  uint8_t* A = static_cast<uint8_t*>(dalloc(n * n));
  uint8_t* B = static_cast<uint8_t*>(dalloc(n * n));
  void* D = dalloc(n * n * 2);
  const size_t ws_bytes = size_t(64) << 20;
  void* ws = dalloc(ws_bytes);
  fill_fp8<<<1024, 256, 0, st>>>(A, n * n, 2);
  fill_fp8<<<1024, 256, 0, st>>>(B, n * n, 3);
  CK(cudaGetLastError());
  cublasLtMatmulDesc_t op;
  CKB(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
  CKB(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
  CKB(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
  cublasLtMatrixLayout_t la, lb, lc;
  CKB(cublasLtMatrixLayoutCreate(&la, CUDA_R_8F_E4M3, n, n, n));
  CKB(cublasLtMatrixLayoutCreate(&lb, CUDA_R_8F_E4M3, n, n, n));
  CKB(cublasLtMatrixLayoutCreate(&lc, CUDA_R_16BF, n, n, n));
  cublasLtMatmulPreference_t pref;
  CKB(cublasLtMatmulPreferenceCreate(&pref));
  CKB(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                           &ws_bytes, sizeof(ws_bytes)));
  cublasLtMatmulHeuristicResult_t res[8];
  int nres = 0;
  CKB(cublasLtMatmulAlgoGetHeuristic(h, op, la, lb, lc, lc, pref, 8, res, &nres));
  if (nres == 0) {
    std::fprintf(stderr, "cuBLASLt: no FP8 algorithm\n");
    return 0;
  }
  const float alpha = 1.0f, beta = 0.0f;
  double best = 0;
  for (int r = 0; r < std::min(nres, 4); ++r) {
    const float ms = time_graph(
        st,
        [&] {
          CKB(cublasLtMatmul(h, op, &alpha, A, la, B, lb, &beta, D, lc, D, lc, &res[r].algo, ws,
                             ws_bytes, st));
        },
        10);
    best = std::max(best, 2.0 * n * n * n / (ms * 1e-3) / 1e12);
  }
  cublasLtMatmulPreferenceDestroy(pref);
  cublasLtMatrixLayoutDestroy(la);
  cublasLtMatrixLayoutDestroy(lb);
  cublasLtMatrixLayoutDestroy(lc);
  cublasLtMatmulDescDestroy(op);
  cublasLtDestroy(h);
  CK(cudaFree(A));
  CK(cudaFree(B));
  CK(cudaFree(D));
  CK(cudaFree(ws));
  return best;  // TFLOP/s
}

struct Row {
  std::string shape, path;
  int64_t M = 0;
  float full_us = 0, gemm_us = 0;
  int64_t touched = 0;
  double bytes = 0, tbs = 0, tflops = 0, bw_frac = 0, mma_frac = 0, floor_us = 0;
};

}  // namespace

int main(int argc, char** argv) {
  bool quick = false, ncu = false, batch_invariant = false;
  std::string csv, only_shape, path_arg = "auto", tune_file;
  bool path_given = false;  // without --path, FP8MOE_CUDA_PATH (if set) chooses, as in production
  std::vector<int64_t> Ms = {1, 8, 32, 128, 512, 2048, 8192};
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--quick")
      quick = true;
    else if (a == "--ncu")
      ncu = true;
    else if (a == "--batch-invariant")
      batch_invariant = true;
    else if (a == "--csv" && i + 1 < argc)
      csv = argv[++i];
    else if (a == "--shape" && i + 1 < argc)
      only_shape = argv[++i];
    else if (a == "--path" && i + 1 < argc) {
      path_arg = argv[++i];
      path_given = true;
    } else if (a == "--tune" && i + 1 < argc)
      tune_file = argv[++i];
    else if (a == "--m" && i + 1 < argc) {
      Ms.clear();
      std::string s = argv[++i];
      for (size_t p = 0; p < s.size();) {
        const size_t q = s.find(',', p);
        Ms.push_back(std::stoll(s.substr(p, q - p)));
        p = q == std::string::npos ? s.size() : q + 1;
      }
    } else {
      std::fprintf(stderr, "unknown argument %s\n", a.c_str());
      return 2;
    }
  }
  if (quick) Ms = {1, 32, 2048};
  cuda::install_hooks();
  if (!cuda::kernels_available()) {
    std::printf("bench_cuda_moe: no GPU with the compiled architecture; nothing to measure\n");
    return 0;
  }
  std::vector<cuda::Path> paths;
  for (size_t p = 0; p < path_arg.size();) {
    const size_t q = path_arg.find(',', p);
    const std::string n = path_arg.substr(p, q == std::string::npos ? std::string::npos : q - p);
    p = q == std::string::npos ? path_arg.size() : q + 1;
    if (n == "generic")
      paths.push_back(cuda::Path::kGeneric);
    else if (n == "wgmma")
      paths.push_back(cuda::Path::kWgmma);
    else if (n == "stream")
      paths.push_back(cuda::Path::kStream);
    else if (n == "grouped")
      paths.push_back(cuda::Path::kGrouped);
    else if (n == "single")
      paths.push_back(cuda::Path::kSingle);
    else if (n == "auto")
      paths.push_back(cuda::Path::kAuto);
    else {
      std::fprintf(stderr, "unknown path %s\n", n.c_str());
      return 2;
    }
  }
  if (paths.empty()) paths.push_back(cuda::Path::kAuto);
  const cuda::Path forced = paths[0];
  // --path forces its paths; without it the override stays unset so that FP8MOE_CUDA_PATH applies
  // (until session 27 the benchmark always forced auto, and the variable never took effect here)
  const auto apply_path = [&](cuda::Path p) {
    if (path_given)
      cuda::set_path_override(p);
    else
      cuda::clear_path_override();
  };
  cudaStream_t st;
  CK(cudaStreamCreate(&st));
  const std::string dev = cuda::device_name();
  const BwCeilings bwc = measure_bw(st);
  // the ceiling for weight streaming: the better of the SM copy kernel (read + write counted) and
  // the read-only kernel
  const double bw = std::max(bwc.copy_tbs, bwc.read_tbs);
  const double mma = measure_cublaslt_fp8(st);
  std::printf(
      "device: %s\nceilings (same run): cudaMemcpy D2D %.3f TB/s, copy kernel %.3f TB/s "
      "(read+write), read kernel %.3f TB/s; used %.3f TB/s; cuBLASLt FP8 8192^3 %.1f TFLOP/s\n",
      dev.c_str(), bwc.memcpy_tbs, bwc.copy_tbs, bwc.read_tbs, bw, mma);
  std::fflush(stdout);

  const ExpertsImpl& impl = cuda::fused_impl();
  std::vector<Row> rows;
  std::vector<cuda::TuningEntry> tuned;
  for (const Shape& sh : kShapes) {
    if (!only_shape.empty() &&
        ("," + only_shape + ",").find("," + std::string(sh.name) + ",") == std::string::npos)
      continue;
    const int64_t E = sh.E, H = sh.K, I = sh.N, N1 = 2 * I, k = sh.topk;
    const int64_t layer_bytes = E * (N1 * H + H * I);
    const int L = static_cast<int>(std::clamp<int64_t>((int64_t(40) << 30) / layer_bytes, 2, 8));
    const int64_t Mmax = *std::max_element(Ms.begin(), Ms.end());
    // weights and scales per layer
    std::vector<Layer> layers(L);
    const int64_t s13n = sh.per_tensor ? E : E * (N1 / 128) * (H / 128);
    const int64_t s2n = sh.per_tensor ? E : E * (H / 128) * (I / 128);
    for (int l = 0; l < L; ++l) {
      Layer& ly = layers[l];
      ly.w13 = static_cast<uint8_t*>(dalloc(E * N1 * H));
      ly.w2 = static_cast<uint8_t*>(dalloc(E * H * I));
      ly.s13 = static_cast<float*>(dalloc(s13n * 4));
      ly.s2 = static_cast<float*>(dalloc(s2n * 4));
      ly.logits = static_cast<float*>(dalloc(Mmax * E * 4));
      ly.ids = static_cast<int32_t*>(dalloc(Mmax * k * 4));
      ly.tw = static_cast<float*>(dalloc(Mmax * k * 4));
      ly.bias = static_cast<float*>(dalloc(E * 4));
      fill_fp8<<<2048, 256, 0, st>>>(ly.w13, E * N1 * H, 100 + l);
      fill_fp8<<<2048, 256, 0, st>>>(ly.w2, E * H * I, 200 + l);
      fill_f32<<<256, 256, 0, st>>>(ly.s13, s13n, 300 + l, 1e-3f, 2e-3f);
      fill_f32<<<256, 256, 0, st>>>(ly.s2, s2n, 400 + l, 1e-3f, 2e-3f);
      fill_f32<<<256, 256, 0, st>>>(ly.bias, E, 500 + l, -0.01f, 0.01f);
      CK(cudaGetLastError());
    }
    uint16_t* x = static_cast<uint16_t*>(dalloc(Mmax * H * 2));
    uint16_t* out = static_cast<uint16_t*>(dalloc(Mmax * H * 2));
    float* a13 = static_cast<float*>(dalloc(4));
    float* a2 = static_cast<float*>(dalloc(4));
    fill_bf16<<<2048, 256, 0, st>>>(x, Mmax * H, 7, 1.0f);
    fill_f32<<<1, 32, 0, st>>>(a13, 1, 8, 0.004f, 0.004f);
    fill_f32<<<1, 32, 0, st>>>(a2, 1, 9, 0.01f, 0.01f);
    CK(cudaGetLastError());
    std::vector<void*> ws(L, nullptr);  // one workspace per layer (GEMM-only reruns need theirs)
    size_t ws_bytes = 0;
    for (int64_t M : Ms) {
      // routing on the host (numerics::route, the reference's routing) for the touched-expert
      // count and the precomputed ids of the GEMM-only runs
      RoutingConfig rc;
      rc.method = sh.method;
      rc.topk = static_cast<int>(k);
      rc.renormalize = true;
      rc.num_expert_group = sh.groups;
      rc.topk_group = sh.topk_group;
      rc.routed_scaling_factor = sh.rsf;
      rc.scoring_func =
          (sh.method == RoutingMethodType::kDeepSeekV3 || sh.method == RoutingMethodType::kMiniMax2)
              ? "sigmoid"
              : "softmax";
      const bool has_bias =
          sh.method == RoutingMethodType::kDeepSeekV3 || sh.method == RoutingMethodType::kMiniMax2;
      std::vector<float> hl(M * E), hb(E);
      for (int l = 0; l < L; ++l) {
        fill_f32<<<512, 256, 0, st>>>(layers[l].logits, M * E, 1000 + 37 * l + M, -3.0f, 3.0f);
        CK(cudaGetLastError());
        CK(cudaMemcpyAsync(hl.data(), layers[l].logits, M * E * 4, cudaMemcpyDeviceToHost, st));
        CK(cudaMemcpyAsync(hb.data(), layers[l].bias, E * 4, cudaMemcpyDeviceToHost, st));
        CK(cudaStreamSynchronize(st));
        RoutingConfig r2 = rc;
        Tensor hbias = Tensor::empty({E}, DType::kF32);
        std::memcpy(hbias.data(), hb.data(), E * 4);
        if (has_bias) r2.e_score_correction_bias = hbias.view();
        const TensorView lv(hl.data(), DType::kF32, {M, E});
        const auto rr = numerics::route(lv, r2);
        std::set<int32_t> used(rr.topk_ids.ptr<int32_t>(), rr.topk_ids.ptr<int32_t>() + M * k);
        layers[l].touched = static_cast<int64_t>(used.size());
        CK(cudaMemcpyAsync(layers[l].ids, rr.topk_ids.data(), M * k * 4, cudaMemcpyHostToDevice,
                           st));
        CK(cudaMemcpyAsync(layers[l].tw, rr.topk_weights.data(), M * k * 4, cudaMemcpyHostToDevice,
                           st));
        CK(cudaStreamSynchronize(st));
      }
      auto make_args = [&](int l, bool precomputed) {
        FusedMoeArgs a;
        a.batch_invariant = batch_invariant;
        a.x = TensorView(x, DType::kBF16, {M, H}, Device::cuda());
        if (precomputed) {
          a.topk_ids = TensorView(layers[l].ids, DType::kI32, {M, k}, Device::cuda());
          a.topk_weights = TensorView(layers[l].tw, DType::kF32, {M, k}, Device::cuda());
        } else {
          a.router_logits = TensorView(layers[l].logits, DType::kF32, {M, E}, Device::cuda());
        }
        a.routing = rc;
        if (has_bias)
          a.routing.e_score_correction_bias =
              TensorView(layers[l].bias, DType::kF32, {E}, Device::cuda());
        a.weights.w13 = TensorView(layers[l].w13, DType::kF8E4M3FN, {E, N1, H}, Device::cuda());
        a.weights.w2 = TensorView(layers[l].w2, DType::kF8E4M3FN, {E, H, I}, Device::cuda());
        if (sh.per_tensor) {
          a.weights.w13_scale = TensorView(layers[l].s13, DType::kF32, {E}, Device::cuda());
          a.weights.w2_scale = TensorView(layers[l].s2, DType::kF32, {E}, Device::cuda());
          a.weights.a13_scale = TensorView(a13, DType::kF32, {1}, Device::cuda());
          a.weights.a2_scale = TensorView(a2, DType::kF32, {1}, Device::cuda());
          a.scheme.weight = WeightScaleKind::kPerTensor;
          a.scheme.act = ActQuantKind::kPerTensorStatic;
        } else {
          a.weights.w13_scale =
              TensorView(layers[l].s13, DType::kF32, {E, N1 / 128, H / 128}, Device::cuda());
          a.weights.w2_scale =
              TensorView(layers[l].s2, DType::kF32, {E, H / 128, I / 128}, Device::cuda());
        }
        a.out = TensorView(out, DType::kBF16, {M, H}, Device::cuda());
        a.stream = st;
        return a;
      };
      if (!tune_file.empty()) {
        // candidates, timed on the full layer (a few replays each)
        // (the grouped path also with 1, 2 and 4 n-blocks per swapped tile where its GEMM2 has
        // K = I <= 1024, beside the kernels' rule: GroupedGemmParams::swap_nb)
        struct Cand {
          cuda::Path path;
          const char* name;
          int swap_nb = 0;
        };
        std::vector<Cand> cands = {{cuda::Path::kGeneric, "generic"},
                                   {cuda::Path::kWgmma, "wgmma"},
                                   {cuda::Path::kStream, "stream"},
                                   {cuda::Path::kGrouped, "grouped"},
                                   {cuda::Path::kSingle, "single"}};
        if (I <= 1024)
          for (const int nb : {1, 2, 4}) cands.push_back({cuda::Path::kGrouped, "grouped", nb});
        float best_us = 1e30f;
        cuda::TunedConfig best;
        for (const Cand& c : cands) {
          FusedMoeArgs a0 = make_args(0, false);
          if (!cuda::path_limit(c.path, a0).empty()) continue;
          // the choice reaches the library through the table, as in production
          cuda::TuningEntry te;
          te.key = {dev, E, I, H, k, a0.scheme.str()};
          te.by_bucket.push_back({cuda::tuning_bucket(M), cuda::TunedConfig{c.name, c.swap_nb}});
          cuda::set_tuning_table({te});
          cuda::set_path_override(cuda::Path::kAuto);
          size_t need = impl.workspace_size(a0);
          if (need > ws_bytes) {
            for (void*& w : ws) {
              if (w) CK(cudaFree(w));
              w = dalloc(need);
            }
            ws_bytes = need;
          }
          float us = 0;
          try {
            us = 1000.0f *
                 time_graph(
                     st,
                     [&] {
                       for (int l = 0; l < L; ++l) impl.run(make_args(l, false), ws[0]);
                     },
                     7) /
                 L;
          } catch (const std::exception& e) {
            std::printf("tune %s M=%lld %s nb %d: %s\n", sh.name, (long long)M, c.name, c.swap_nb,
                        e.what());
            continue;
          }
          std::printf("tune %-20s M=%-5lld %-8s nb %d %9.1f us\n", sh.name, (long long)M, c.name,
                      c.swap_nb, us);
          if (us < best_us) {
            best_us = us;
            best = cuda::TunedConfig{c.name, c.swap_nb};
          }
        }
        cuda::set_tuning_table({});
        if (best_us < 1e30f) {
          FusedMoeArgs a0 = make_args(0, false);
          const cuda::TuningKey key{dev, E, I, H, k, a0.scheme.str()};
          bool found = false;
          for (auto& te : tuned)
            if (te.key.device == key.device && te.key.E == key.E && te.key.N == key.N &&
                te.key.K == key.K && te.key.topk == key.topk && te.key.scheme == key.scheme) {
              te.by_bucket.push_back({cuda::tuning_bucket(M), best});
              found = true;
            }
          if (!found) tuned.push_back({key, {{cuda::tuning_bucket(M), best}}});
          cuda::write_tuning_file(tune_file, tuned);
          cuda::set_tuning_table(tuned);
        }
      }
      apply_path(forced);
      if (ncu) {  // one direct run per configuration for a profiler to attach to
        FusedMoeArgs a0 = make_args(0, false);
        const size_t need = impl.workspace_size(a0);
        if (need > ws_bytes) {
          for (void*& w : ws) {
            if (w) CK(cudaFree(w));
            w = dalloc(need);
          }
          ws_bytes = need;
        }
        for (int rep = 0; rep < 2; ++rep) impl.run(a0, ws[0]);
        CK(cudaStreamSynchronize(st));
        std::printf("ncu run %s M=%lld path %s\n", sh.name, (long long)M,
                    cuda::path_name(cuda::choose_path(a0)));
        continue;
      }
      for (const cuda::Path pth : paths) {
        apply_path(pth);
        if (pth != cuda::Path::kAuto && !cuda::path_limit(pth, make_args(0, false)).empty())
          continue;
        Row r;
        r.shape = sh.name;
        r.M = M;
        try {
          FusedMoeArgs a0 = make_args(0, false);
          r.path = cuda::path_name(cuda::choose_path(a0));
          size_t need = 0;
          for (int l = 0; l < L; ++l)
            need = std::max({need, impl.workspace_size(make_args(l, false)),
                             impl.workspace_size(make_args(l, true))});
          if (need > ws_bytes) {
            for (void*& w : ws) {
              if (w) CK(cudaFree(w));
              w = dalloc(need);
            }
            ws_bytes = need;
          }
          // full layer: routing from logits, one shared workspace (as vLLM shares its workspace)
          r.full_us = 1000.0f *
                      time_graph(
                          st,
                          [&] {
                            for (int l = 0; l < L; ++l) impl.run(make_args(l, false), ws[0]);
                          },
                          20) /
                      L;
          // GEMM-only: precomputed routing; generic/wgmma paths launch only the two GEMM kernels
          // over each layer's workspace, filled by an untimed run first. The grouped path has no
          // GEMM-only mode here (bench_cuda_grouped times its GEMMs), the single path is one
          // kernel: gemm_us stays 0.
          if (r.path != std::string("grouped") && r.path != std::string("single")) {
            for (int l = 0; l < L; ++l) impl.run(make_args(l, true), ws[l]);
            CK(cudaStreamSynchronize(st));
            cuda::set_bench_gemm_only(true);  // stream: GEMM1 + GEMM2 (+ top-k sum)
            r.gemm_us = 1000.0f *
                        time_graph(
                            st,
                            [&] {
                              for (int l = 0; l < L; ++l) impl.run(make_args(l, true), ws[l]);
                            },
                            20) /
                        L;
            cuda::set_bench_gemm_only(false);
          }
        } catch (const std::exception& e) {
          std::printf("%s M=%lld: %s\n", sh.name, (long long)M, e.what());
          cuda::set_bench_gemm_only(false);
          continue;
        }
        int64_t touched = 0;
        for (const Layer& ly : layers) touched += ly.touched;
        r.touched = touched / L;
        r.bytes = double(r.touched) * (N1 * H + H * I);
        r.tbs = r.bytes / (r.full_us * 1e-6) / 1e12;
        r.bw_frac = r.tbs / bw;
        r.floor_us = r.bytes / (bw * 1e12) * 1e6;
        r.tflops = 6.0 * M * k * I * H / (r.full_us * 1e-6) / 1e12;
        r.mma_frac = mma > 0 ? r.tflops / mma : 0;
        rows.push_back(r);
        std::printf(
            "%-20s M=%-5lld %-8s full %9.1f us  gemm %9.1f us  experts %4lld  %6.3f TB/s (%5.1f%% "
            "bw)  %7.1f TFLOP/s (%5.1f%% cublasLt)  floor %8.1f us  x%.2f\n",
            r.shape.c_str(), (long long)M, r.path.c_str(), r.full_us, r.gemm_us,
            (long long)r.touched, r.tbs, 100 * r.bw_frac, r.tflops, 100 * r.mma_frac, r.floor_us,
            r.full_us / r.floor_us);
        std::fflush(stdout);
      }
    }
    cuda::clear_path_override();
    for (Layer& ly : layers) {
      for (void* p : {(void*)ly.w13, (void*)ly.w2, (void*)ly.s13, (void*)ly.s2, (void*)ly.logits,
                      (void*)ly.ids, (void*)ly.tw, (void*)ly.bias})
        CK(cudaFree(p));
    }
    CK(cudaFree(x));
    CK(cudaFree(out));
    CK(cudaFree(a13));
    CK(cudaFree(a2));
    for (void* w : ws)
      if (w) CK(cudaFree(w));
  }
  // summary
  std::printf("\n== summary (%s; copy %.3f TB/s, cuBLASLt FP8 %.1f TFLOP/s) ==\n", dev.c_str(), bw,
              mma);
  std::printf("%-20s %6s %-8s %10s %10s %8s %8s %8s\n", "shape", "M", "path", "full_us", "gemm_us",
              "%bw", "%mma", "xfloor");
  for (const Row& r : rows)
    std::printf("%-20s %6lld %-8s %10.1f %10.1f %7.1f%% %7.1f%% %8.2f\n", r.shape.c_str(),
                (long long)r.M, r.path.c_str(), r.full_us, r.gemm_us, 100 * r.bw_frac,
                100 * r.mma_frac, r.full_us / r.floor_us);
  if (ncu) return 0;
  if (!csv.empty()) {
    FILE* f = std::fopen(csv.c_str(), "w");
    if (f) {
      std::fprintf(f,
                   "device,copy_tbs,cublaslt_tflops,shape,M,path,full_us,gemm_us,touched_experts,"
                   "bytes,tbs,bw_frac,tflops,mma_frac,floor_us\n");
      for (const Row& r : rows)
        std::fprintf(f, "%s,%.4f,%.2f,%s,%lld,%s,%.2f,%.2f,%lld,%.0f,%.4f,%.4f,%.2f,%.4f,%.2f\n",
                     dev.c_str(), bw, mma, r.shape.c_str(), (long long)r.M, r.path.c_str(),
                     r.full_us, r.gemm_us, (long long)r.touched, r.bytes, r.tbs, r.bw_frac,
                     r.tflops, r.mma_frac, r.floor_us);
      std::fclose(f);
    }
  }
  return 0;
}
