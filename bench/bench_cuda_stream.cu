// What a shared-memory ring fed by bulk copies or TMA boxes streams per SM, without the GEMM: the
// feed of the single decode path (src/kernels/cuda/sm90_fp8_moe_single.cuh) in isolation. One
// persistent CTA per SM, one producer warp and C consumer warps; a row-major byte matrix of
// R rows x H bytes (like w13, 16-row units dealt round robin to the CTAs, each unit streamed in
// stages of 16 rows x kc bytes) read once per run, far larger than L2. Feeds:
//   rows  -- 16 one-dimensional bulk copies of kc bytes per stage (the single path before run 12);
//   box8  -- two 3D TMA boxes of 8 rows x kc bytes (the single path since run 12);
//   box16 -- one 3D TMA box of 16 rows x kc bytes.
// Consumers wait for the stage, each reads its 1/C of it from shared memory (16-byte loads folded
// into a checksum, so the reads are kept) in the rows with touch = 1 (every configuration runs
// with touch 0 and 1), and frees the slot. Prints TB/s (bytes of
// the matrix / median time of 5 runs) per (feed, kc, stages, consumers, touch), next to the plain
// 16-byte load kernel over the same bytes.
//
//   bench_cuda_stream [--rows R] [--h H]
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "bench_cuda_common.cuh"
#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/sm90_tma.hpp"

namespace {

using namespace fp8moe::cuda;

enum Feed { kRows = 0, kBox8 = 1, kBox16 = 2 };
constexpr int kMaxStages = 16;

struct StreamParams {
  const uint8_t* base;
  int rows, H, kc, nstages, stage_bytes, feed, touch;
  uint32_t* sink;
};

__global__ void __launch_bounds__(17 * 32, 1)
    ring_kernel(const __grid_constant__ StreamParams p, const __grid_constant__ CUtensorMap tm) {
  extern __shared__ __align__(128) unsigned char smem[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, cw = blockDim.x / 32 - 1;
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + p.nstages * p.stage_bytes);
  uint64_t* empty = full + kMaxStages;
  if (threadIdx.x == 0) {
    for (int i = 0; i < p.nstages; ++i) {
      mbar_init(&full[i], 1);
      mbar_init(&empty[i], cw);
    }
    fence_barrier_init();
  }
  __syncthreads();
  const int units = p.rows / 16, ns = (p.H + p.kc - 1) / p.kc;
  int slot = 0;
  uint32_t phase = 0;
  if (warp == cw) {  // producer
    const uint64_t pol = l2_policy_evict_first();
    for (int u = blockIdx.x; u < units; u += gridDim.x)
      for (int st = 0; st < ns; ++st) {
        const int k0 = st * p.kc, klen = min(p.kc, p.H - k0);
        if (lane == 0) {
          mbar_wait(&empty[slot], phase ^ 1);
          mbar_arrive_expect_tx(&full[slot], p.feed == kRows ? 16u * klen : 16u * p.kc);
        }
        __syncwarp();
        unsigned char* stage = smem + slot * p.stage_bytes;
        if (p.feed == kRows) {
          if (lane < 16)
            bulk_load_1d_hint(stage + lane * p.kc, p.base + (int64_t(u) * 16 + lane) * p.H + k0,
                              klen, &full[slot], pol);
        } else if (lane == 0) {
          tma_load_3d_hint(stage, &tm, &full[slot], 0, k0 / 128, u * 16, pol);
          if (p.feed == kBox8)
            tma_load_3d_hint(stage + 8 * p.kc, &tm, &full[slot], 0, k0 / 128, u * 16 + 8, pol);
        }
        if (++slot == p.nstages) {
          slot = 0;
          phase ^= 1u;
        }
      }
    return;
  }
  uint32_t acc = 0;
  for (int u = blockIdx.x; u < units; u += gridDim.x)
    for (int st = 0; st < ns; ++st) {
      mbar_wait(&full[slot], phase);
      if (p.touch) {
        const uint4* s4 = reinterpret_cast<const uint4*>(smem + slot * p.stage_bytes);
        const int n16 = 16 * p.kc / 16;
        for (int i = warp * 32 + lane; i < n16; i += cw * 32) {
          const uint4 v = s4[i];
          acc ^= v.x ^ v.y ^ v.z ^ v.w;
        }
      }
      __syncwarp();
      if (lane == 0) mbar_arrive(&empty[slot]);
      if (++slot == p.nstages) {
        slot = 0;
        phase ^= 1u;
      }
    }
  if (acc == 0x9e3779b9u) p.sink[0] = acc;  // practically never: keeps the loads
}

template <class F>
float median_ms(F&& f, int reps = 5) {
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  f();  // warm-up
  std::vector<float> t;
  for (int r = 0; r < reps; ++r) {
    CK(cudaEventRecord(a));
    f();
    CK(cudaEventRecord(b));
    CK(cudaEventSynchronize(b));
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, a, b));
    t.push_back(ms);
  }
  CK(cudaGetLastError());
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  int rows = 65536, H = 7168;
  for (int i = 1; i < argc; i += 2) {
    const std::string a = argv[i];
    if (a == "--rows" && i + 1 < argc)
      rows = std::atoi(argv[i + 1]);
    else if (a == "--h" && i + 1 < argc)
      H = std::atoi(argv[i + 1]);
    else {
      std::fprintf(stderr, "unknown argument %s (bench_cuda_stream [--rows R] [--h H])\n",
                   a.c_str());
      return 2;
    }
  }
  int dev = 0, major = 0, sms = 0;
  if (cudaGetDeviceCount(&dev) != cudaSuccess || dev == 0) {
    std::printf("bench_cuda_stream: no GPU; nothing to measure\n");
    return 0;
  }
  CK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0));
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  if (major != 9) {
    std::printf("bench_cuda_stream: needs sm_90 (bulk copies, TMA); nothing to measure\n");
    return 0;
  }
  if (rows % 16 != 0 || H % 128 != 0 || rows <= 0 || H <= 0) {
    std::fprintf(stderr, "bench_cuda_stream: --rows must be a multiple of 16, --h of 128\n");
    return 2;
  }
  const size_t bytes = size_t(rows) * H;
  uint8_t* base = nullptr;
  uint32_t* sink = nullptr;
  CK(cudaMalloc(&base, bytes));
  CK(cudaMalloc(&sink, 4));
  CK(cudaMemset(base, 0x3c, bytes));
  const float read_ms = median_ms([&] {
    read_kernel<<<sms * 8, 512>>>(reinterpret_cast<const uint4*>(base), int64_t(bytes / 16), sink);
  });
  std::printf("device sms=%d, matrix %d x %d bytes (%.0f MB); plain 16-byte loads %.3f TB/s\n", sms,
              rows, H, bytes / 1e6, bytes / (read_ms * 1e-3) / 1e12);
  std::printf("%-6s %5s %6s %9s %5s %8s\n", "feed", "kc", "stages", "consumers", "touch", "TB/s");
  const char* names[] = {"rows", "box8", "box16"};
  for (int feed : {kRows, kBox8, kBox16})
    for (int kc : {1024, 2048, 4096}) {
      const int stage_bytes = 16 * kc;
      const int nstages = std::min(kMaxStages, 200 * 1024 / stage_bytes);
      const int smem = nstages * stage_bytes + 2 * kMaxStages * 8;
      CK(cudaFuncSetAttribute(ring_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
      const CUtensorMap tm =
          make_tma_rows_kblocks_u8(base, H, rows, kc / 128, feed == kBox16 ? 16 : 8);
      for (int cw : {1, 4, 16})
        for (int touch : {0, 1}) {
          const StreamParams sp{base, rows, H, kc, nstages, stage_bytes, feed, touch, sink};
          const float ms = median_ms([&] { ring_kernel<<<sms, (cw + 1) * 32, smem>>>(sp, tm); });
          std::printf("%-6s %5d %6d %9d %5d %8.3f\n", names[feed], kc, nstages, cw, touch,
                      bytes / (ms * 1e-3) / 1e12);
        }
    }
  CK(cudaFree(base));
  CK(cudaFree(sink));
  return 0;
}
