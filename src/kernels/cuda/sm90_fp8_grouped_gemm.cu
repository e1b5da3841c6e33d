// Host side of the Hopper FP8 grouped GEMM (sm90_fp8_grouped_gemm.cuh): TMA descriptors, the
// persistent launch, and the masked-rows helper.
#include <algorithm>
#include <cstdlib>
#include <mutex>
#include <string>

#include "fp8moe/error.hpp"

#include "sm90_fp8_grouped_gemm.cuh"
#include "sm90_tma.hpp"

namespace fp8moe::cuda {

namespace {
int sm_count() {
  static const int n = [] {
    int dev = 0, v = 0;
    FP8MOE_CUDA_CHECK(cudaGetDevice(&dev));
    FP8MOE_CUDA_CHECK(cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, dev));
    return v;
  }();
  return n;
}
}  // namespace

int grouped_gemm_smem_bytes() { return kGSmemBytes; }

namespace {
// CTAs of the persistent grid for `tiles` tiles: one per SM, or p.max_ctas.
int64_t grid_ctas(const GroupedGemmParams& p, int64_t tiles) {
  const int64_t cap = p.max_ctas > 0 ? std::min<int64_t>(p.max_ctas, sm_count()) : sm_count();
  return std::max<int64_t>(1, std::min<int64_t>(tiles, cap));
}
}  // namespace

namespace {
using GroupedKernel = void (*)(GroupedGemmParams, CUtensorMap, CUtensorMap);

// Launch configuration of `grid` CTAs in two-CTA clusters (cluster dimension 2 along x); `attr`
// holds the cluster attribute cfg points to.
cudaLaunchConfig_t cluster2_config(int64_t grid, int smem, cudaStream_t stream,
                                   cudaLaunchAttribute* attr) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(static_cast<unsigned>(grid));
  cfg.blockDim = dim3(kGThreads);
  cfg.dynamicSmemBytes = static_cast<size_t>(smem);
  cfg.stream = stream;
  attr->id = cudaLaunchAttributeClusterDimension;
  attr->val.clusterDim.x = 2;
  attr->val.clusterDim.y = 1;
  attr->val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return cfg;
}

// A persistent grid of two-CTA clusters for about `ctas` CTAs.
void launch_cluster2(GroupedKernel kernel, int64_t ctas, int smem, cudaStream_t stream,
                     const GroupedGemmParams& p, const CUtensorMap& tm_a, const CUtensorMap& tm_b) {
  cudaLaunchAttribute attr;
  const cudaLaunchConfig_t cfg =
      cluster2_config(2 * std::max<int64_t>(1, ctas / 2), smem, stream, &attr);
  FP8MOE_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, p, tm_a, tm_b));
}

bool mcast_wanted(const GroupedGemmParams& p) {
  static const bool env = [] {
    const char* v = std::getenv("FP8MOE_GROUPED_MCAST");
    return v && v[0] == '1';
  }();
  return p.mcast < 0 ? env : p.mcast > 0;
}
}  // namespace

int grouped_tile_n(const GroupedGemmParams& p) {
  static const int env = [] {
    const char* v = std::getenv("FP8MOE_GROUPED_TILE_N");
    if (!v || !*v) return 0;
    const int t = std::atoi(v);
    if (t != 128 && t != 256)
      throw ValueError(std::string("FP8MOE_GROUPED_TILE_N='") + v + "' is not 128 or 256");
    return t;
  }();
  if (p.tile_n != 0 && p.tile_n != 128 && p.tile_n != 256)
    throw ValueError("grouped GEMM: tile_n must be 0, 128 or 256");
  const int want = p.tile_n ? p.tile_n : (env ? env : kG2BN);
  return (want == kG2BN && p.N % kG2BN == 0) ? kG2BN : kGBN;
}

int grouped_cluster_ctas(const GroupedGemmParams& p) {
  if (p.tile_m != 128 || p.fuse_act || !mcast_wanted(p)) return 1;
  return (p.N / grouped_tile_n(p)) % 2 == 0 ? 2 : 1;  // the n-blocks pair up
}

bool grouped_epi_async(const GroupedGemmParams& p) {
  static const int env = [] {
    const char* v = std::getenv("FP8MOE_GROUPED_EPI");
    if (!v || !*v) return -1;
    const std::string s(v);
    if (s == "async") return 1;
    if (s == "sync") return 0;
    throw ValueError("FP8MOE_GROUPED_EPI='" + s + "' is not async or sync");
  }();
  if (p.epi_async < -1 || p.epi_async > 1)
    throw ValueError("grouped GEMM: epi_async must be -1, 0 or 1");
  if (p.tile_m != 128 || p.fuse_act || grouped_tile_n(p) != kG2BN) return false;
  if ((reinterpret_cast<uintptr_t>(p.out) & 15) != 0 || p.out_stride % 8 != 0) return false;
  int want = p.epi_async >= 0 ? p.epi_async : env;
  // The rule: async for short K only (<= 4 K blocks: the GEMM2 of the TP-sharded shapes), where
  // the per-tile epilogue weighs most and 3 stages cover the K loop. Measured on the H200
  // (docs/PERFORMANCE.md, grouped run 7): DeepSeek TP8 GEMM2 (K = 256) in the M = 8192 layer 649
  // -> ~605 us; with long K the lost fourth stage costs up to 4% (GEMM1, GEMM-only). Rows per
  // expert are not part of the rule: GEMM-only at 2048 rows per expert the async GEMM2 read 5-7%
  // slower in one call (not checked in a layer at such M).
  if (want < 0) want = p.K <= 512 ? 1 : 0;
  return want != 0;
}

int grouped_sum_cols(const GroupedGemmParams& p) {
  if (p.tile_m != 128) return kGBN * grouped_swap_nb(p);
  return grouped_tile_n(p);
}

int grouped_tile_m(double rows_per_expert) {
  if (rows_per_expert <= 16) return 16;
  if (rows_per_expert <= 32) return 32;
  if (rows_per_expert <= 64) return 64;
  return 128;
}

int grouped_swap_nb(const GroupedGemmParams& p) {
  static const int env = [] {
    const char* v = std::getenv("FP8MOE_GROUPED_SWAP_NB");
    if (!v || !*v) return 0;
    const std::string s(v);
    if (s != "1" && s != "2" && s != "4")
      throw ValueError("FP8MOE_GROUPED_SWAP_NB='" + s + "' is not 1, 2 or 4");
    return std::atoi(v);
  }();
  if (p.swap_nb != 0 && p.swap_nb != 1 && p.swap_nb != 2 && p.swap_nb != 4)
    throw ValueError("grouped GEMM: swap_nb must be 0, 1, 2 or 4");
  if (p.tile_m != 16 && p.tile_m != 32 && p.tile_m != 64) return 1;
  int want = p.swap_nb ? p.swap_nb : env;
  // The rule: the shorter K, the more a tile's fixed work weighs: 4 n-blocks at <= 2 K blocks, 2 at
  // <= 4 (32- and 64-token tiles: 2). Measured on the H200 (docs/PERFORMANCE.md, grouped run 10,
  // call 8, against one n-block with the same kernel code): GEMM-only GEMM2 of DeepSeek TP8 (K =
  // 256) 0.87 / 0.96 at 64 rows per expert (contiguous / masked), 1.00 / 0.93 at 16; the layer at
  // M = 2048 0.94 (DeepSeek TP8) and 0.96 (Qwen3-Next), at M = 32 0.97 / 1.01. (Its calls 3-5
  // compared against a slower scale copy, since fixed, and overstate the gain.)
  if (want == 0) want = p.K <= 2 * kGBK ? 4 : (p.K <= 4 * kGBK ? 2 : 1);
  if (p.tile_m >= 32 && want > 2) want = 2;
  // one scale chunk (SwapCfg<kTN, kNB>::kScaleKb K blocks) and whole tiles of n-blocks
  while (want > 1 && (p.K / kGBK > SwapCfg<16, 2>::kScaleKb || p.N % (kGBN * want) != 0)) want /= 2;
  return want;
}

namespace {
template <int kTN, int kNB, int kSum>
void launch_swap_k(const GroupedGemmParams& p, const uint8_t* a, const uint8_t* b, int64_t b_rows,
                   int64_t max_m_blocks, cudaStream_t stream) {
  using C = SwapCfg<kTN, kNB>;
  static_assert(C::kSmemBytes + 2 * 2 * kTN * 8 + (kSum ? 2 * kTN * 4 : 0) <= 227 * 1024,
                "swapped tile: shared memory");
  static std::once_flag once;
  std::call_once(once, [] {
    FP8MOE_CUDA_CHECK(cudaFuncSetAttribute(grouped_gemm_swap_kernel<kTN, kNB, kSum>,
                                           cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           C::kSmemBytes));
  });
  const CUtensorMap tm_a = make_tma_2d_u8(a, p.K, p.a_rows, kGBK, kTN);
  const CUtensorMap tm_b = make_tma_2d_u8(b, p.K, b_rows, kGBK, kGBN);
  const int64_t tiles = max_m_blocks * (p.N / C::kCols);
  const unsigned grid = static_cast<unsigned>(grid_ctas(p, tiles));
  grouped_gemm_swap_kernel<kTN, kNB, kSum>
      <<<grid, kGThreads, C::kSmemBytes, stream>>>(p, tm_a, tm_b);
  FP8MOE_CUDA_CHECK_LAUNCH();
}
// With the fused top-k sum (p.sum_out) its own instantiation.
template <int kTN, int kNB>
void launch_swap(const GroupedGemmParams& p, const uint8_t* a, const uint8_t* b, int64_t b_rows,
                 int64_t max_m_blocks, cudaStream_t stream) {
  if (p.sum_out)
    launch_swap_k<kTN, kNB, 1>(p, a, b, b_rows, max_m_blocks, stream);
  else
    launch_swap_k<kTN, kNB, 0>(p, a, b, b_rows, max_m_blocks, stream);
}
}  // namespace

void launch_grouped_gemm(const GroupedGemmParams& p, const uint8_t* a, const uint8_t* b,
                         int64_t b_rows, int64_t max_m_blocks, cudaStream_t stream) {
  if (max_m_blocks <= 0 || p.N <= 0 || p.K <= 0 || p.a_rows <= 0) return;
  // FP8MOE_GROUPED_GROUP_M: the scheduling group of p.group_m = 0 (for measurement in the layer)
  static const int env_group_m = [] {
    const char* v = std::getenv("FP8MOE_GROUPED_GROUP_M");
    if (!v || !*v) return 0;
    char* end = nullptr;
    const long g = std::strtol(v, &end, 10);
    if (*end != '\0' || g < 1 || g > 1024)
      throw ValueError(std::string("FP8MOE_GROUPED_GROUP_M='") + v +
                       "' is not an integer in [1, 1024]");
    return static_cast<int>(g);
  }();
  if (p.group_m < 0) throw ValueError("grouped GEMM: group_m must be >= 0");
  if (p.group_m == 0 && env_group_m > 0) {
    GroupedGemmParams q = p;
    q.group_m = env_group_m;
    return launch_grouped_gemm(q, a, b, b_rows, max_m_blocks, stream);
  }
  if (p.K % kGBK != 0 || p.N % kGBN != 0)
    throw ValueError("grouped GEMM: K (" + std::to_string(p.K) + ") and N (" + std::to_string(p.N) +
                     ") must be multiples of 128");
  if (p.fuse_act && p.tile_m != 128)
    throw ValueError("grouped GEMM: the fused activation runs on the 128-row kernel only");
  // the fused top-k sum runs in the swapped kernels' epilogue and in the 128 x 256 tile's sync
  // one (not the 128-wide tile, the async epilogue or clusters): anything else would leave
  // sum_out unwritten
  if (p.sum_out && (p.masked || p.fuse_act || !p.out_scatter ||
                    (p.tile_m == 128 && (grouped_tile_n(p) != kG2BN || grouped_epi_async(p) ||
                                         grouped_cluster_ctas(p) != 1)) ||
                    !p.sum_cnt || !p.sum_ids || p.sum_topk <= 0 || p.sum_topk > 32 ||
                    p.out_stride % 64 != 0 || (reinterpret_cast<uintptr_t>(p.out) & 127) != 0 ||
                    (reinterpret_cast<uintptr_t>(p.sum_out) & 15) != 0))
    throw ValueError(
        "grouped GEMM: the fused top-k sum needs the contiguous layout (swapped kernels, or the "
        "128 x 256 tile with the sync epilogue and no clusters), scatter to pair rows, counters "
        "and ids, 1 <= topk <= 32, 128-byte aligned y2 rows (its lines are discarded) and a "
        "16-byte aligned sum_out");
  if (p.fuse_act && static_cast<Act>(p.act.act) == Act::kSwigluOai)
    throw ValueError(
        "grouped GEMM: the fused activation pairs gate and up halves; interleaved gate/up columns "
        "(swigluoai) are not halves");
  switch (p.tile_m) {
    case 16: {
      const int nb = grouped_swap_nb(p);
      if (nb == 4) return launch_swap<16, 4>(p, a, b, b_rows, max_m_blocks, stream);
      if (nb == 2) return launch_swap<16, 2>(p, a, b, b_rows, max_m_blocks, stream);
      return launch_swap<16, 1>(p, a, b, b_rows, max_m_blocks, stream);
    }
    case 32:
      if (grouped_swap_nb(p) == 2) return launch_swap<32, 2>(p, a, b, b_rows, max_m_blocks, stream);
      return launch_swap<32, 1>(p, a, b, b_rows, max_m_blocks, stream);
    case 64:
      if (grouped_swap_nb(p) == 2) return launch_swap<64, 2>(p, a, b, b_rows, max_m_blocks, stream);
      return launch_swap<64, 1>(p, a, b, b_rows, max_m_blocks, stream);
    case 128:
      break;
    default:
      throw ValueError("grouped GEMM: tile_m must be 16, 32, 64 or 128");
  }
  static std::once_flag once;
  std::call_once(once, [] {
    FP8MOE_CUDA_CHECK(cudaFuncSetAttribute(
        grouped_gemm_kernel<1>, cudaFuncAttributeMaxDynamicSharedMemorySize, kGSmemBytes));
    FP8MOE_CUDA_CHECK(cudaFuncSetAttribute(
        grouped_gemm_kernel<2>, cudaFuncAttributeMaxDynamicSharedMemorySize, kGSmemBytes));
    FP8MOE_CUDA_CHECK(cudaFuncSetAttribute(
        grouped_gemm_n256_kernel<0, 0>, cudaFuncAttributeMaxDynamicSharedMemorySize, kG2SmemBytes));
    FP8MOE_CUDA_CHECK(cudaFuncSetAttribute(
        grouped_gemm_n256_kernel<1, 0>, cudaFuncAttributeMaxDynamicSharedMemorySize, kG2SmemBytes));
    FP8MOE_CUDA_CHECK(cudaFuncSetAttribute(grouped_gemm_n256_kernel<0, 1>,
                                           cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           kG2aSmemBytes));
    FP8MOE_CUDA_CHECK(cudaFuncSetAttribute(grouped_gemm_n256_kernel<0, 0, 2>,
                                           cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           kG2SmemBytes));
    FP8MOE_CUDA_CHECK(cudaFuncSetAttribute(grouped_gemm_n256_kernel<0, 1, 2>,
                                           cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           kG2aSmemBytes));
    FP8MOE_CUDA_CHECK(cudaFuncSetAttribute(grouped_gemm_n256_kernel<0, 0, 1, 1>,
                                           cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           kG2SmemBytes));
  });
  if (p.fuse_act && (p.N % kG2BN != 0 || p.out_scatter || p.row_weight || !p.q_out || !p.q_scale))
    throw ValueError(
        "grouped GEMM: the fused activation needs N % 256 == 0, no scatter, no row weight and "
        "q_out / q_scale");
  const int mc = grouped_cluster_ctas(p);
  if (p.fuse_act || grouped_tile_n(p) == kG2BN) {  // 128 x 256 tiles (two 128-row B halves)
    const CUtensorMap tm_b = make_tma_2d_u8(b, p.K, b_rows, kGBK, kGBN);  // one 128-row half
    const int64_t tiles = max_m_blocks * (p.N / kG2BN);
    const CUtensorMap tm_a = make_tma_2d_u8(a, p.K, p.a_rows, kGBK, kGBM / mc);
    if (mc == 2) {  // opt-in two-CTA clusters sharing A (FP8MOE_GROUPED_MCAST=1 / p.mcast = 1)
      const bool async = grouped_epi_async(p);
      launch_cluster2(async ? grouped_gemm_n256_kernel<0, 1, 2> : grouped_gemm_n256_kernel<0, 0, 2>,
                      grid_ctas(p, tiles), async ? kG2aSmemBytes : kG2SmemBytes, stream, p, tm_a,
                      tm_b);
      return;
    }
    const unsigned grid = static_cast<unsigned>(grid_ctas(p, tiles));
    if (p.sum_out)  // (checked above: the sync epilogue, no clusters)
      grouped_gemm_n256_kernel<0, 0, 1, 1>
          <<<grid, kGThreads, kG2SmemBytes, stream>>>(p, tm_a, tm_b);
    else if (p.fuse_act)
      grouped_gemm_n256_kernel<1, 0><<<grid, kGThreads, kG2SmemBytes, stream>>>(p, tm_a, tm_b);
    else if (grouped_epi_async(p))
      grouped_gemm_n256_kernel<0, 1><<<grid, kGThreads, kG2aSmemBytes, stream>>>(p, tm_a, tm_b);
    else
      grouped_gemm_n256_kernel<0, 0><<<grid, kGThreads, kG2SmemBytes, stream>>>(p, tm_a, tm_b);
    FP8MOE_CUDA_CHECK_LAUNCH();
    return;
  }
  // two-CTA clusters sharing the A tile when the n-blocks pair up: opt-in (FP8MOE_GROUPED_MCAST=1
  // or p.mcast = 1). Measured 2.1x slower than without clusters until the stage release stopped
  // fencing (grouped run 7); with the fix, GEMM-only within +-3% of the plain 128 tile (geometric
  // mean 1.010, grouped run 8).
  const CUtensorMap tm_a = make_tma_2d_u8(a, p.K, p.a_rows, kGBK, kGBM / mc);
  const CUtensorMap tm_b = make_tma_2d_u8(b, p.K, b_rows, kGBK, kGBN);
  const int64_t tiles = max_m_blocks * (p.N / kGBN);
  if (mc == 1) {
    const unsigned grid = static_cast<unsigned>(grid_ctas(p, tiles));
    grouped_gemm_kernel<1><<<grid, kGThreads, kGSmemBytes, stream>>>(p, tm_a, tm_b);
    FP8MOE_CUDA_CHECK_LAUNCH();
    return;
  }
  launch_cluster2(grouped_gemm_kernel<2>, grid_ctas(p, tiles), kGSmemBytes, stream, p, tm_a, tm_b);
}

int grouped_cluster_occupancy(int tile_n) {
  // the attributes are those launch_grouped_gemm sets (once) before its first launch
  const GroupedKernel k =
      tile_n == kG2BN ? grouped_gemm_n256_kernel<0, 0, 2> : grouped_gemm_kernel<2>;
  const int smem = tile_n == kG2BN ? kG2SmemBytes : kGSmemBytes;
  FP8MOE_CUDA_CHECK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  cudaLaunchAttribute attr;
  const cudaLaunchConfig_t cfg = cluster2_config(2 * sm_count(), smem, nullptr, &attr);
  int n = 0;
  FP8MOE_CUDA_CHECK(cudaOccupancyMaxActiveClusters(&n, k, &cfg));
  return n;
}

void launch_masked_rows(const int32_t* counts, int E, int max_m, int32_t* ids, int32_t* meta,
                        cudaStream_t stream) {
  const int64_t n = int64_t(E) * max_m;
  const unsigned blocks =
      static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(ceil_div(n, 256), 4096)));
  masked_rows_kernel<<<blocks, 256, 0, stream>>>(counts, E, max_m, ids, meta);
  FP8MOE_CUDA_CHECK_LAUNCH();
}

}  // namespace fp8moe::cuda
