// Benchmark of the Hopper FP8 grouped GEMM (DEEPGEMM contract, src/kernels/cuda/sm90_fp8_grouped_*)
// with the card's ceilings measured in the same run:
//   * HBM read bandwidth (a streaming read kernel over 4 GiB),
//   * cuBLASLt FP8 per-tensor GEMM at 8192^3 (TFLOP/s), and block-scaled (A 128x128 blocks,
//     B 1x128 vectors) at 8192^3 and on each shape's per-expert problem, when this cuBLAS supports
//     it on sm_90 (says so otherwise).
// For each shape (models.md per-GPU shapes) and rows per expert (16, 64, 256, 512, 2048): GEMM1
// (N = 2I, K = H) and GEMM2 (N = H, K = I) alone, contiguous and masked layouts (TFLOP/s on the
// useful rows, weight-read TB/s), an uneven variant (counts 0.7-1.3x the mean), and the full
// layer ("cuda_grouped" vs "cuda_fused", routing precomputed, uniform top-k) where it fits.
// GEMM2 of the contiguous layouts carries the layer's row metadata (sorted ids with padding
// sentinels in a shuffled token order, router weights), as the layer's GEMM2 does; --gemm2-meta 0
// drops it (the rows of grouped runs 1-8, whose GEMM2 had none).
// Times: CUDA-graph replay medians. Output: a table on stdout and a CSV (--csv FILE).
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "bench_cuda_common.cuh"
#include "fp8moe/fused_moe.hpp"
#include "fp8moe/tensor.hpp"
#include "kernels/cuda/fused_moe_cuda.hpp"
#include "kernels/cuda/grouped_moe_cuda.hpp"
#include "kernels/cuda/sm90_fp8_grouped_gemm.hpp"

using namespace fp8moe;

namespace {

int g_mcast = -1;                  // --mcast 0|1 (default: the library's default)
std::vector<int> g_group_m = {0};  // --group-m 8,16 (0: the library's default)
int g_gemm2_meta = 1;              // --gemm2-meta 0|1: GEMM2 with the layer's sorted ids / weights

std::vector<int> parse_ints(const std::string& v) {
  std::vector<int> out;
  for (size_t pos = 0; pos < v.size();) {
    const size_t c = v.find(',', pos);
    out.push_back(std::atoi(v.substr(pos, c - pos).c_str()));
    if (c == std::string::npos) break;
    pos = c + 1;
  }
  return out;
}
bool listed(const std::string& list, const std::string& name) {
  if (list.empty()) return true;
  return ("," + list + ",").find("," + name + ",") != std::string::npos;
}

__global__ void fill_codes(uint8_t* p, int64_t n, uint32_t seed) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    uint32_t h = uint32_t(i) * 2654435761u ^ seed;
    h ^= h >> 13;
    h *= 0x5bd1e995u;
    h ^= h >> 15;
    p[i] = static_cast<uint8_t>((h & 0x3F) | ((h >> 8) & 0x80));  // |v| < 2, never NaN
  }
}
__global__ void fill_f32(float* p, int64_t n, float v) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    p[i] = v * (1.0f + 0.25f * float(i % 7));
}
__global__ void fill_bf16(uint16_t* p, int64_t n, uint32_t seed) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    uint32_t h = uint32_t(i) * 2654435761u ^ seed;
    h ^= h >> 15;
    const float v = (float(h & 0xFFFF) / 65536.0f - 0.5f) * 0.2f;
    p[i] = static_cast<uint16_t>(__float_as_uint(v) >> 16);
  }
}

void* dalloc(size_t bytes) {
  void* p = nullptr;
  CK(cudaMalloc(&p, std::max<size_t>(bytes, 256)));
  return p;
}
void codes(void* p, int64_t n, uint32_t seed, cudaStream_t st) {
  fill_codes<<<2048, 256, 0, st>>>(static_cast<uint8_t*>(p), n, seed);
  CK(cudaGetLastError());
}
void f32s(void* p, int64_t n, float v, cudaStream_t st) {
  fill_f32<<<2048, 256, 0, st>>>(static_cast<float*>(p), n, v);
  CK(cudaGetLastError());
}

template <class F>
float time_graph(cudaStream_t st, F body, int reps) {
  cudaGraph_t g;
  cudaGraphExec_t ge;
  CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
  body();
  CK(cudaStreamEndCapture(st, &g));
  CK(cudaGraphInstantiate(&ge, g, 0));
  for (int i = 0; i < 2; ++i) CK(cudaGraphLaunch(ge, st));
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
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

double measure_read_bw(cudaStream_t st) {
  const size_t bytes = size_t(4) << 30;
  void* a = dalloc(bytes);
  uint32_t* sink = static_cast<uint32_t*>(dalloc(4));
  codes(a, bytes, 1, st);
  int sms = 0, dev = 0;
  CK(cudaGetDevice(&dev));
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  const float ms = time_graph(
      st,
      [&] { read_kernel<<<sms * 8, 512, 0, st>>>(static_cast<const uint4*>(a), bytes / 16, sink); },
      10);
  CK(cudaFree(a));
  CK(cudaFree(sink));
  return bytes / (ms * 1e-3) / 1e12;
}

// cuBLASLt FP8 D(bf16) = A^T B with A (K x M) and B (K x N) K-major. block: A scales 128x128
// blocks, B scales 1x128 vectors (cuBLAS 12.9+ on sm_90); returns 0 when no algorithm exists.
double cublaslt_fp8(cudaStream_t st, int64_t M, int64_t N, int64_t K, bool block) {
  cublasLtHandle_t h;
  CKB(cublasLtCreate(&h));
  uint8_t* A = static_cast<uint8_t*>(dalloc(M * K));
  uint8_t* B = static_cast<uint8_t*>(dalloc(N * K));
  void* D = dalloc(M * N * 2);
  float* sa = static_cast<float*>(dalloc(((M + 127) / 128) * ((K + 127) / 128) * 4 + 256));
  float* sb = static_cast<float*>(dalloc(N * ((K + 127) / 128) * 4 + 256));
  const size_t ws_bytes = size_t(64) << 20;
  void* ws = dalloc(ws_bytes);
  codes(A, M * K, 2, st);
  codes(B, N * K, 3, st);
  f32s(sa, ((M + 127) / 128) * ((K + 127) / 128), 0.01f, st);
  f32s(sb, N * ((K + 127) / 128), 0.01f, st);
  cublasLtMatmulDesc_t op;
  CKB(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
  CKB(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
  CKB(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
  if (block) {
    const int32_t ma = CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
    const int32_t mb = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
    CKB(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &ma, sizeof(ma)));
    CKB(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &mb, sizeof(mb)));
    CKB(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &sa, sizeof(sa)));
    CKB(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &sb, sizeof(sb)));
  }
  cublasLtMatrixLayout_t la, lb, lc;
  CKB(cublasLtMatrixLayoutCreate(&la, CUDA_R_8F_E4M3, K, M, K));
  CKB(cublasLtMatrixLayoutCreate(&lb, CUDA_R_8F_E4M3, K, N, K));
  CKB(cublasLtMatrixLayoutCreate(&lc, CUDA_R_16BF, M, N, M));
  cublasLtMatmulPreference_t pref;
  CKB(cublasLtMatmulPreferenceCreate(&pref));
  CKB(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                           &ws_bytes, sizeof(ws_bytes)));
  cublasLtMatmulHeuristicResult_t res[8];
  int nres = 0;
  const cublasStatus_t hs =
      cublasLtMatmulAlgoGetHeuristic(h, op, la, lb, lc, lc, pref, 8, res, &nres);
  double best = 0;
  if (hs == CUBLAS_STATUS_SUCCESS && nres > 0) {
    const float alpha = 1.0f, beta = 0.0f;
    for (int r = 0; r < std::min(nres, 4); ++r) {
      const float ms = time_graph(
          st,
          [&] {
            CKB(cublasLtMatmul(h, op, &alpha, A, la, B, lb, &beta, D, lc, D, lc, &res[r].algo, ws,
                               ws_bytes, st));
          },
          7);
      best = std::max(best, 2.0 * M * N * K / (ms * 1e-3) / 1e12);
    }
  }
  cublasLtMatmulPreferenceDestroy(pref);
  cublasLtMatrixLayoutDestroy(la);
  cublasLtMatrixLayoutDestroy(lb);
  cublasLtMatrixLayoutDestroy(lc);
  cublasLtMatmulDescDestroy(op);
  cublasLtDestroy(h);
  for (void* p : {(void*)A, (void*)B, D, (void*)sa, (void*)sb, ws}) CK(cudaFree(p));
  return best;
}

struct Shape {
  const char* name;
  int64_t E, H, I;
  int topk;
};
const Shape kShapes[] = {
    {"deepseek_v3_tp1", 256, 7168, 2048, 8}, {"deepseek_v3_tp2", 256, 7168, 1024, 8},
    {"deepseek_v3_tp8", 256, 7168, 256, 8},  {"deepseek_v3_ep8", 32, 7168, 2048, 8},
    {"qwen3_235b_tp4", 128, 4096, 384, 8},   {"qwen3_coder_480b_tp4", 160, 6144, 640, 8},
};

struct Csv {
  FILE* f = nullptr;
  void row(const std::string& s) {
    if (f) std::fprintf(f, "%s\n", s.c_str());
  }
};

// GEMM-only run of one GEMM (N, K) over E experts with the given per-expert row counts.
struct GemmResult {
  float us = 0;
  double tflops = 0, wtbs = 0;
};
GemmResult bench_gemm(cudaStream_t st, bool masked, int64_t E, int64_t N, int64_t K,
                      const std::vector<int>& counts, const uint8_t* w, const float* ws_scale,
                      int reps, int tm = 128, int tn = 0, int group_m = 0, bool meta = false) {
  int64_t rows = 0, useful = 0, active = 0, max_m = 0;
  std::vector<int32_t> blk;
  for (int64_t e = 0; e < E; ++e) {
    useful += counts[e];
    active += counts[e] > 0;
    max_m = std::max<int64_t>(max_m, counts[e]);
  }
  if (masked) {
    rows = E * max_m;
  } else {
    for (int64_t e = 0; e < E; ++e) {
      const int64_t pad = (counts[e] + tm - 1) / tm * tm;
      for (int64_t b = 0; b < pad / tm; ++b) blk.push_back(static_cast<int32_t>(e));
      rows += pad;
    }
  }
  uint8_t* a = static_cast<uint8_t*>(dalloc(rows * K));
  float* as = static_cast<float*>(dalloc(rows * (K / 128) * 4));
  uint16_t* out = static_cast<uint16_t*>(dalloc(rows * N * 2));
  codes(a, rows * K, 7, st);
  f32s(as, rows * (K / 128), 0.02f, st);
  int32_t* dblk = static_cast<int32_t*>(dalloc((blk.size() + 1) * 4));
  int32_t* dmeta = static_cast<int32_t*>(dalloc(16));
  int32_t* dcnt = static_cast<int32_t*>(dalloc(E * 4));
  std::vector<int32_t> cnt32(counts.begin(), counts.end());
  CK(cudaMemcpy(dcnt, cnt32.data(), E * 4, cudaMemcpyHostToDevice));
  if (!blk.empty()) CK(cudaMemcpy(dblk, blk.data(), blk.size() * 4, cudaMemcpyHostToDevice));
  const int32_t nrows = static_cast<int32_t>(rows);
  CK(cudaMemcpy(dmeta, &nrows, 4, cudaMemcpyHostToDevice));
  // the layer's GEMM2 metadata (contiguous only): row p of expert e's chunk holds pair id
  // perm[j] (a shuffled order of the useful rows) or the sentinel `useful` in the padding
  int32_t* dsorted = nullptr;
  float* dweight = nullptr;
  if (meta && !masked) {
    std::vector<int32_t> perm(useful), sorted;
    for (int64_t j = 0; j < useful; ++j) perm[j] = static_cast<int32_t>(j);
    std::shuffle(perm.begin(), perm.end(), std::mt19937(7));
    int64_t j = 0;
    for (int64_t e = 0; e < E; ++e) {
      const int64_t pad = (counts[e] + tm - 1) / tm * tm;
      for (int64_t r = 0; r < pad; ++r)
        sorted.push_back(r < counts[e] ? perm[j++] : static_cast<int32_t>(useful));
    }
    dsorted = static_cast<int32_t*>(dalloc(sorted.size() * 4));
    CK(cudaMemcpy(dsorted, sorted.data(), sorted.size() * 4, cudaMemcpyHostToDevice));
    dweight = static_cast<float*>(dalloc(useful * 4));
    f32s(dweight, useful, 0.1f, st);
  }
  cuda::GroupedGemmParams p;
  p.tile_m = tm;
  p.tile_n = tn;
  p.group_m = group_m;
  p.mcast = g_mcast;
  p.masked = masked;
  p.N = static_cast<int32_t>(N);
  p.K = static_cast<int32_t>(K);
  p.a_rows = rows;
  p.expert_blk = dblk;
  p.num_rows_ptr = dmeta;
  p.counts = dcnt;
  p.E = static_cast<int32_t>(E);
  p.max_m = static_cast<int32_t>(max_m);
  p.a_scale = as;
  p.a_scale_stride = K / 128;
  p.b_scale = ws_scale;
  p.b_scale_e_stride = (N / 128) * (K / 128);
  p.b_scale_n_stride = K / 128;
  p.out = out;
  p.out_stride = N;
  p.sorted_ids = dsorted;
  p.num_valid = static_cast<int32_t>(useful);
  p.row_weight = dweight;
  const int64_t max_mblk = masked ? E * ((max_m + tm - 1) / tm) : rows / tm;
  const float ms = time_graph(
      st, [&] { cuda::launch_grouped_gemm(p, a, w, E * N, max_mblk, st); }, reps);
  GemmResult r;
  r.us = ms * 1e3f;
  r.tflops = 2.0 * useful * N * K / (ms * 1e-3) / 1e12;
  r.wtbs = double(active) * N * K / (ms * 1e-3) / 1e12;
  for (void* q : {(void*)a, (void*)as, (void*)out, (void*)dblk, (void*)dmeta, (void*)dcnt})
    CK(cudaFree(q));
  if (dsorted) CK(cudaFree(dsorted));
  if (dweight) CK(cudaFree(dweight));
  return r;
}

// Full layer through an ExpertsImpl (routing precomputed: uniform distinct top-k per token).
float bench_layer(cudaStream_t st, const ExpertsImpl& impl, const Shape& s, int64_t M, uint8_t* w13,
                  uint8_t* w2, float* s13, float* s2, int reps) {
  const int64_t E = s.E, H = s.H, I = s.I, k = s.topk;
  uint16_t* x = static_cast<uint16_t*>(dalloc(M * H * 2));
  uint16_t* out = static_cast<uint16_t*>(dalloc(M * H * 2));
  fill_bf16<<<2048, 256, 0, st>>>(x, M * H, 5);
  CK(cudaGetLastError());
  std::vector<int32_t> ids(M * k);
  std::vector<float> tw(M * k, 1.0f / k);
  std::mt19937 rng(17);
  std::vector<int32_t> perm(E);
  for (int64_t e = 0; e < E; ++e) perm[e] = static_cast<int32_t>(e);
  for (int64_t t = 0; t < M; ++t) {
    for (int64_t j = 0; j < k; ++j) std::swap(perm[j], perm[j + rng() % (E - j)]);
    for (int64_t j = 0; j < k; ++j) ids[t * k + j] = perm[j];
  }
  int32_t* dids = static_cast<int32_t*>(dalloc(M * k * 4));
  float* dtw = static_cast<float*>(dalloc(M * k * 4));
  CK(cudaMemcpy(dids, ids.data(), M * k * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dtw, tw.data(), M * k * 4, cudaMemcpyHostToDevice));
  const Device dev = Device::cuda();
  FusedMoeArgs a;
  a.x = TensorView(x, DType::kBF16, {M, H}, dev);
  a.out = TensorView(out, DType::kBF16, {M, H}, dev);
  a.topk_ids = TensorView(dids, DType::kI32, {M, k}, dev);
  a.topk_weights = TensorView(dtw, DType::kF32, {M, k}, dev);
  a.routing.topk = static_cast<int>(k);
  a.weights.w13 = TensorView(w13, DType::kF8E4M3FN, {E, 2 * I, H}, dev);
  a.weights.w2 = TensorView(w2, DType::kF8E4M3FN, {E, H, I}, dev);
  a.weights.w13_scale = TensorView(s13, DType::kF32, {E, 2 * I / 128, H / 128}, dev);
  a.weights.w2_scale = TensorView(s2, DType::kF32, {E, H / 128, I / 128}, dev);
  a.stream = st;
  const size_t wsb = impl.workspace_size(a);
  void* ws = dalloc(wsb);
  impl.run(a, ws);  // warm-up (and lazy setup) outside the graph
  CK(cudaStreamSynchronize(st));
  const float ms = time_graph(
      st, [&] { impl.run(a, ws); }, reps);
  for (void* q : {(void*)x, (void*)out, (void*)dids, (void*)dtw, ws}) CK(cudaFree(q));
  return ms * 1e3f;
}

}  // namespace

int main(int argc, char** argv) {
  Csv csv;
  std::vector<int> rpes = {16, 64, 256, 512, 2048};
  std::vector<int> tile_ns = {128, 256};
  std::string only, layouts, gemms;
  bool layer = true, ceilings = true;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--csv" && i + 1 < argc) {
      csv.f = std::fopen(argv[++i], "w");
    } else if (a == "--shape" && i + 1 < argc) {
      only = argv[++i];
    } else if (a == "--rpe" && i + 1 < argc) {
      rpes = parse_ints(argv[++i]);
    } else if (a == "--tile-n" && i + 1 < argc) {
      tile_ns = parse_ints(argv[++i]);
    } else if (a == "--layouts" && i + 1 < argc) {
      layouts = argv[++i];
    } else if (a == "--gemm" && i + 1 < argc) {
      gemms = argv[++i];
    } else if (a == "--group-m" && i + 1 < argc) {
      g_group_m = parse_ints(argv[++i]);
    } else if (a == "--no-ceilings") {
      ceilings = false;
    } else if (a == "--mcast" && i + 1 < argc) {
      g_mcast = std::atoi(argv[++i]);
    } else if (a == "--gemm2-meta" && i + 1 < argc) {
      g_gemm2_meta = std::atoi(argv[++i]);
    } else if (a == "--no-layer") {
      layer = false;
    } else {
      std::fprintf(
          stderr,
          "usage: %s [--csv FILE] [--shape NAME,...] [--rpe 16,64,...] [--tile-n 128,256]\n"
          "       [--layouts contig,masked,uneven,contig_s,masked_s,uneven_s] [--gemm "
          "gemm1,gemm2]\n"
          "       [--no-layer] [--no-ceilings] [--mcast 0|1] [--group-m 8,16] [--gemm2-meta 0|1]\n"
          "--tile-n: output tile widths of the 128-row kernel to time (each in the same run;\n"
          "256 falls back to 128 where N %% 256 != 0); --no-ceilings: skip the HBM and cuBLASLt\n"
          "ceilings (for profilers; percentages then read against 1)\n",
          argv[0]);
      return 2;
    }
  }
  cuda::install_hooks();
  if (!cuda::grouped_impl().available()) {
    std::printf("no sm_90 GPU: nothing to measure\n");
    return 0;
  }
  cudaStream_t st;
  CK(cudaStreamCreate(&st));
  const double bw = ceilings ? measure_read_bw(st) : 1.0;
  const double pt = ceilings ? cublaslt_fp8(st, 8192, 8192, 8192, false) : 1.0;
  const double bs = ceilings ? cublaslt_fp8(st, 8192, 8192, 8192, true) : 0.0;
  std::printf(
      "device: %s\nceilings (same run): HBM read %.3f TB/s; cuBLASLt FP8 per-tensor 8192^3 "
      "%.1f TFLOP/s; block-scaled (128x128 A, 1x128 B) 8192^3 %s\n",
      cuda::device_name().c_str(), bw, pt,
      bs > 0 ? (std::to_string(bs) + " TFLOP/s").c_str()
             : "not supported by this cuBLASLt on sm_90");
  if (g_mcast == 1)
    std::printf("two-CTA clusters resident at once: %d (128 tile), %d (256 tile); grid: %d\n",
                cuda::grouped_cluster_occupancy(128), cuda::grouped_cluster_occupancy(256), [] {
                  int v = 0;
                  CK(cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, 0));
                  return v / 2;
                }());
  std::fflush(stdout);
  csv.row("kind,shape,gemm,layout,rows_per_expert,us,tflops,frac_per_tensor,weight_tbs,frac_bw");
  csv.row("ceiling,,,,,,," + std::to_string(pt) + ",," + std::to_string(bw));
  std::printf("%-22s %-5s %-12s %5s %10s %9s %7s %8s %7s\n", "shape", "gemm", "layout", "rpe", "us",
              "TFLOP/s", "%cuBLAS", "w TB/s", "%BW");
  for (const Shape& s : kShapes) {
    if (!listed(only, s.name)) continue;
    const int64_t E = s.E, H = s.H, I = s.I;
    uint8_t* w13 = static_cast<uint8_t*>(dalloc(E * 2 * I * H));
    uint8_t* w2 = static_cast<uint8_t*>(dalloc(E * H * I));
    float* s13 = static_cast<float*>(dalloc(E * (2 * I / 128) * (H / 128) * 4));
    float* s2 = static_cast<float*>(dalloc(E * (H / 128) * (I / 128) * 4));
    codes(w13, E * 2 * I * H, 11, st);
    codes(w2, E * H * I, 12, st);
    f32s(s13, E * (2 * I / 128) * (H / 128), 0.003f, st);
    f32s(s2, E * (H / 128) * (I / 128), 0.003f, st);
    for (int rpe : rpes) {
      // bound the A / output buffers of the largest shapes (E * rpe rows)
      if (int64_t(rpe) * E * std::max<int64_t>(H, 2 * I) > (int64_t(12) << 30)) continue;
      std::vector<int> even(E, rpe), uneven(E);
      std::mt19937 rng(rpe);
      for (int64_t e = 0; e < E; ++e)
        uneven[e] = std::max(1, int(rpe * (0.7 + 0.6 * (rng() % 1000) / 1000.0)));
      struct G {
        const char* name;
        int64_t N, K;
        const uint8_t* w;
        const float* sc;
      };
      const G gs[2] = {{"gemm1", 2 * I, H, w13, s13}, {"gemm2", H, I, w2, s2}};
      for (const G& g : gs)
        for (int v = 0; v < 6; ++v) {
          if (!listed(gemms, g.name)) continue;
          // 0-2: 128-row m-blocks; 3-5: the auto m-block (swapped operands at <= 64 rows)
          const int tm = v < 3 ? 128 : cuda::grouped_tile_m(rpe);
          if (v >= 3 && tm == 128) continue;
          const bool masked = v % 3 == 1;
          const std::vector<int>& c = v % 3 == 2 ? uneven : even;
          static const char* names[6] = {"contig",   "masked",   "uneven",
                                         "contig_s", "masked_s", "uneven_s"};
          if (!listed(layouts, names[v])) continue;
          const int reps = rpe >= 512 ? 5 : 9;
          // uneven counts up to 1.3x the mean: the auto m-block of the largest
          const int tmu = v == 5 ? cuda::grouped_tile_m(rpe * 1.3) : tm;
          for (const int tn_req : tile_ns) {
            if (tmu != 128 && tn_req != tile_ns.front()) continue;  // swapped: no tile width
            cuda::GroupedGemmParams probe;
            probe.N = static_cast<int32_t>(g.N);
            probe.tile_n = tn_req;
            probe.mcast = g_mcast;
            const int tn = tmu == 128 ? cuda::grouped_tile_n(probe) : 0;
            if (tmu == 128 && tn != tn_req) continue;  // falls back: the 128 row says it
            for (const int gmb : g_group_m) {
              std::string lay = names[v];
              if (tn) lay += "_n" + std::to_string(tn);
              if (gmb) lay += "_g" + std::to_string(gmb);
              const GemmResult r =
                  bench_gemm(st, masked, E, g.N, g.K, c, g.w, g.sc, reps, tmu, tn, gmb,
                             g_gemm2_meta && std::strcmp(g.name, "gemm2") == 0);
              std::printf("%-22s %-5s %-12s %5d %10.1f %9.1f %6.1f%% %8.3f %6.1f%%\n", s.name,
                          g.name, lay.c_str(), rpe, r.us, r.tflops, 100.0 * r.tflops / pt, r.wtbs,
                          100.0 * r.wtbs / bw);
              char line[512];
              std::snprintf(line, sizeof line, "gemm,%s,%s,%s,%d,%.2f,%.2f,%.4f,%.4f,%.4f", s.name,
                            g.name, lay.c_str(), rpe, r.us, r.tflops, r.tflops / pt, r.wtbs,
                            r.wtbs / bw);
              csv.row(line);
              std::fflush(stdout);
            }
          }
        }
      if (bs > 0 && rpe >= 256) {
        const double b1 = cublaslt_fp8(st, 2 * I, rpe, H, true);
        const double b2 = cublaslt_fp8(st, H, rpe, I, true);
        std::printf(
            "%-22s cuBLASLt block-scaled per expert (M=%d): gemm1 %.1f, gemm2 %.1f TFLOP/s\n",
            s.name, rpe, b1, b2);
        char line[256];
        std::snprintf(line, sizeof line,
                      "cublas_block,%s,gemm1,,%d,,%.2f,,,\ncublas_block,%s,gemm2,,%d,,%.2f,,,",
                      s.name, rpe, b1, s.name, rpe, b2);
        csv.row(line);
      }
      if (layer) {
        const int64_t M = int64_t(rpe) * E / s.topk;
        if (M * s.H * 40 > (int64_t(24) << 30)) continue;
        const float tg = bench_layer(st, cuda::grouped_impl(), s, M, w13, w2, s13, s2, 5);
        const float tf = bench_layer(st, cuda::fused_impl(), s, M, w13, w2, s13, s2, 5);
        const double flops = 2.0 * M * s.topk * (2 * I * H + H * I);
        std::printf(
            "%-22s layer M=%-7lld cuda_grouped %10.1f us (%.1f TFLOP/s)  cuda_fused %10.1f us "
            "(%.1f TFLOP/s)  x%.2f\n",
            s.name, (long long)M, tg, flops / (tg * 1e-6) / 1e12, tf, flops / (tf * 1e-6) / 1e12,
            tf / tg);
        char line[256];
        std::snprintf(line, sizeof line,
                      "layer,%s,grouped,,%d,%.2f,%.2f,,,\nlayer,%s,fused,,%d,%.2f,%.2f,,,", s.name,
                      rpe, tg, flops / (tg * 1e-6) / 1e12, s.name, rpe, tf,
                      flops / (tf * 1e-6) / 1e12);
        csv.row(line);
      }
      std::fflush(stdout);
    }
    for (void* q : {(void*)w13, (void*)w2, (void*)s13, (void*)s2}) CK(cudaFree(q));
  }
  if (csv.f) std::fclose(csv.f);
  return 0;
}
