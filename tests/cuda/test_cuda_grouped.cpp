// The Hopper FP8 grouped GEMM (DEEPGEMM contract): "cuda_grouped" (contiguous, standard format) and
// "cuda_grouped_masked" (batched format), and the grouped GEMM kernel on its own.
//   * kernel, exact: A and B codes in {-2..2}, power-of-two scales, so every 128-deep partial sum
//     stays below 2^10 and is exact even with Hopper's reduced-precision FP8 accumulation: the
//     bf16 output must equal a float64 host GEMM bit for bit (contiguous with padding rows, scatter
//     and row weights; masked with empty, partial and full experts; rows not stored stay poisoned).
//   * layer, exact: the shared exact-mode generator with w2 thinned to one non-zero per 128-wide
//     K block of each row (its GEMM2 partial sums would otherwise need more bits than the tensor
//     core keeps): bitwise against the float64 reference. With the generator's dense w2: within a
//     couple of bf16 ulps (the same bound as cuda_fused's wgmma path).
//   * layer, statistical: vLLM's block-FP8 tolerance (atol = rtol = 0.035) on test_block_fp8.py's
//     DeepGEMM shapes and models.md shapes; uneven and empty experts, EP expert maps, logits
//     routing; graph capture; run-to-run determinism.
// Every test skips cleanly without an sm_90 GPU.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "common/moe_testing.hpp"
#include "cuda/cuda_testing.hpp"
#include "fp8moe/error.hpp"
#include "fp8moe/numerics.hpp"
#include "fp8moe/platform.hpp"
#include "kernels/cuda/fused_moe_cuda.hpp"
#include "kernels/cuda/grouped_moe_cuda.hpp"
#include "kernels/cuda/moe_launchers.hpp"
#include "kernels/cuda/moe_problem.hpp"
#include "kernels/cuda/sm90_fp8_grouped_gemm.hpp"
#include "kernels/registry.hpp"

namespace fp8moe {
namespace {

using testing::MoeTestMode;
using testing::MoeTestProblem;
using testing::MoeTestSpec;
using testing::RoutingPattern;

// ---- the kernel on its own
// -----------------------------------------------------------------------

struct HostGemm {
  int E, N, K;
  std::vector<uint8_t> b;      // (E*N, K) codes
  std::vector<float> b_scale;  // (E, N/128, K/128)
  std::vector<float> bias;     // (E, N) or empty
};

HostGemm make_weights(int E, int N, int K, bool bias, std::mt19937& rng) {
  HostGemm g{E, N, K, {}, {}, {}};
  std::uniform_int_distribution<int> v(-2, 2), ex(-2, 2), bi(-8, 8);
  g.b.resize(size_t(E) * N * K);
  for (auto& c : g.b) c = numerics::float_to_e4m3fn(static_cast<float>(v(rng)));
  g.b_scale.resize(size_t(E) * (N / 128) * (K / 128));
  for (auto& s : g.b_scale) s = std::ldexp(1.0f, ex(rng));
  if (bias) {
    g.bias.resize(size_t(E) * N);
    for (auto& x : g.bias) x = static_cast<float>(bi(rng)) * 0.25f;
  }
  return g;
}

// out[row, n] in float64, then rounded (double -> float -> bf16, exact here)
uint16_t host_value(const HostGemm& g, const std::vector<uint8_t>& a,
                    const std::vector<float>& a_scale, int64_t row, int e, int n, float w) {
  const int nkb = g.K / 128;
  double acc = 0.0;
  for (int kb = 0; kb < nkb; ++kb) {
    double part = 0.0;
    for (int k = kb * 128; k < kb * 128 + 128; ++k)
      part += double(numerics::e4m3fn_to_float(a[row * g.K + k])) *
              numerics::e4m3fn_to_float(g.b[(int64_t(e) * g.N + n) * g.K + k]);
    acc +=
        part * a_scale[row * nkb + kb] * g.b_scale[(int64_t(e) * (g.N / 128) + n / 128) * nkb + kb];
  }
  if (!g.bias.empty()) acc += g.bias[int64_t(e) * g.N + n];
  return numerics::float_to_bf16(static_cast<float>(acc * w));
}

template <class T>
Tensor to_device(const std::vector<T>& v, DType dt) {
  Tensor h = Tensor::empty({static_cast<int64_t>(v.size())}, dt);
  std::memcpy(h.data(), v.data(), v.size() * sizeof(T));
  return h.to(Device::cuda());
}

struct GemmRun {
  std::vector<uint16_t> out;
  bool canaries = true;
};

// compact_scales: the kernel gets one scale per A row (per-token) and one per expert (per-tensor)
// with zero K-block / n-block strides, taken from the first block of each; the caller makes the
// host scales constant over those blocks, so the host reference stays the same.
GemmRun run_gemm(cuda::GroupedGemmParams p, const HostGemm& g, const std::vector<uint8_t>& a,
                 const std::vector<float>& a_scale, int64_t out_rows, int64_t max_mblk,
                 bool compact_scales = false) {
  const int nkb = g.K / 128, nnb = g.N / 128;
  std::vector<float> as_c, bs_c;
  if (compact_scales) {
    for (size_t r = 0; r < a_scale.size() / nkb; ++r) as_c.push_back(a_scale[r * nkb]);
    for (int e = 0; e < g.E; ++e) bs_c.push_back(g.b_scale[size_t(e) * nnb * nkb]);
  }
  const Tensor da = to_device(a, DType::kU8);
  const Tensor das = to_device(compact_scales ? as_c : a_scale, DType::kF32);
  const Tensor db = to_device(g.b, DType::kU8);
  const Tensor dbs = to_device(compact_scales ? bs_c : g.b_scale, DType::kF32);
  Tensor dbias;
  if (!g.bias.empty()) dbias = to_device(g.bias, DType::kF32);
  testing::GuardedTensor out({out_rows, p.out_stride}, DType::kBF16, Device::cuda());
  testing::poison(out.view());
  p.K = g.K;
  p.N = g.N;
  p.a_scale = static_cast<const float*>(das.data());
  p.a_scale_stride = compact_scales ? 1 : nkb;
  p.a_scale_kb = compact_scales ? 0 : 1;
  p.b_scale = static_cast<const float*>(dbs.data());
  p.b_scale_e_stride = compact_scales ? 1 : int64_t(nnb) * nkb;
  p.b_scale_n_stride = compact_scales ? 0 : nkb;
  p.b_scale_kb = compact_scales ? 0 : 1;
  p.bias = dbias.defined() ? dbias.data() : nullptr;
  p.out = static_cast<uint16_t*>(out.view().data);
  if (p.epi_async >= 0 && p.tile_m == 128 && cuda::grouped_tile_n(p) == 256) {
    EXPECT_EQ(cuda::grouped_epi_async(p), p.epi_async == 1) << "the epilogue asked for";
  }
  cuda::launch_grouped_gemm(p, static_cast<const uint8_t*>(da.data()),
                            static_cast<const uint8_t*>(db.data()), int64_t(g.E) * g.N, max_mblk,
                            nullptr);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  GemmRun r;
  r.canaries = out.canaries_intact();
  r.out.resize(size_t(out_rows) * p.out_stride);
  device_allocator().copy(r.out.data(), out.view().data, r.out.size() * 2, 1);
  return r;
}

std::vector<uint8_t> random_a(int64_t rows, int K, std::mt19937& rng) {
  std::uniform_int_distribution<int> v(-2, 2);
  std::vector<uint8_t> a(size_t(rows) * K);
  for (auto& c : a) c = numerics::float_to_e4m3fn(static_cast<float>(v(rng)));
  return a;
}
std::vector<float> random_scales(int64_t rows, int K, std::mt19937& rng) {
  std::uniform_int_distribution<int> ex(-3, 1);
  std::vector<float> s(size_t(rows) * (K / 128));
  for (auto& x : s) x = std::ldexp(1.0f, ex(rng));
  return s;
}

constexpr uint16_t kPoisonBf16 = 0x7FC0;

// Kernel variant under test: the m-block (128 = tokens as wgmma's M operand; 16/32/64 = swapped
// operands) and, for the 128-row kernel, the output tile width (128 or 256; 256 falls back to 128
// when N % 256 != 0, which the N = 384 cases check); epi 1 / 0 = the 256 tile's asynchronous /
// sync epilogue (-1 = the library's choice, which is async at these short K); mc 1 = two-CTA
// clusters multicasting A where the tile width's n-blocks pair up (GroupedGemmParams::mcast); nb
// 2 / 4 = the swapped kernel's 128-row n-blocks per tile (GroupedGemmParams::swap_nb; 0 = the
// library's choice), where N and K allow it.
struct GemmTile {
  int tm, tn;
  int epi = -1;
  int mc = 0;
  int nb = 0;
};

std::string tile_name(const GemmTile& t) {
  return "tile_m" + std::to_string(t.tm) + (t.tn ? "_n" + std::to_string(t.tn) : "") +
         (t.epi == 1   ? "_async"
          : t.epi == 0 ? "_sync"
                       : "") +
         (t.mc ? "_mc" : "") + (t.nb ? "_nb" + std::to_string(t.nb) : "");
}

void set_tile(cuda::GroupedGemmParams& p, const GemmTile& t) {
  p.tile_m = t.tm;
  p.tile_n = t.tn;
  p.epi_async = t.epi;
  p.mcast = t.mc;
  p.swap_nb = t.nb;
}

void expect_tile_n(const cuda::GroupedGemmParams& p, const GemmTile& t) {
  if (t.tm != 128) {
    // n-blocks per swapped tile: as asked (nb 0: the rule, 4 for K <= 256, 2 for K <= 512, else
    // 1) where K fits one scale chunk (<= 8 K blocks) and N holds whole tiles, halved until it
    // does, else 1 (32- and 64-token tiles: at most 2)
    const int ask = t.nb ? t.nb : (p.K <= 256 ? 4 : (p.K <= 512 ? 2 : 1));
    int nb = p.K <= 1024 ? (t.tm >= 32 ? std::min(ask, 2) : ask) : 1;
    while (nb > 1 && p.N % (128 * nb) != 0) nb /= 2;
    if (t.nb > 0 || !std::getenv("FP8MOE_GROUPED_SWAP_NB")) {
      EXPECT_EQ(cuda::grouped_swap_nb(p), nb) << "N " << p.N << " K " << p.K;
    }
    return;
  }
  const int tn = t.tn == 256 && p.N % 256 == 0 ? 256 : 128;
  EXPECT_EQ(cuda::grouped_tile_n(p), tn) << "N " << p.N;
  EXPECT_EQ(cuda::grouped_cluster_ctas(p), t.mc && (p.N / tn) % 2 == 0 ? 2 : 1) << "N " << p.N;
  if (t.epi == 1) {
    EXPECT_EQ(cuda::grouped_epi_async(p), p.N % 256 == 0) << "N " << p.N;
  }
  if (t.epi == 0) {
    EXPECT_FALSE(cuda::grouped_epi_async(p));
  }
}

// Contiguous: per-expert chunks aligned to 128 rows, padding rows marked by the sentinel;
// GEMM1-style (output row = position) and GEMM2-style (scatter to a permuted row, row weight).
class CudaGroupedGemm : public ::testing::TestWithParam<GemmTile> {};

TEST_P(CudaGroupedGemm, ContiguousExactBitwise) {
  SKIP_WITHOUT_SM90();
  const GemmTile tile = GetParam();
  const int tm = tile.tm;
  std::mt19937 rng(1234 + tm + tile.tn);
  // N = 512: four 128-column n-blocks or two 256-column ones (with mc: one two-CTA cluster's
  // n-blocks); N = 384: three n-blocks (the 256 tile falls back to 128; no clusters)
  const int E = 5, K = 384;
  const int counts[E] = {130, 0, 1, 256, 77};
  // ctas 3: three persistent CTAs walk all the tiles (the rings and their phases wrap around)
  for (const int ctas : {0, 3})
    for (const int N : {512, 384})
      for (bool scatter : {false, true}) {
        SCOPED_TRACE(std::string(scatter ? "scatter + row weight" : "in place") + ", N " +
                     std::to_string(N) + ", CTAs " + (ctas ? std::to_string(ctas) : "all"));
        const HostGemm g = make_weights(E, N, K, scatter, rng);
        std::vector<int32_t> sorted, blk;
        int num_valid = 0;
        for (int e = 0; e < E; ++e) num_valid += counts[e];
        // a random permutation of the valid ids over the sorted positions
        std::vector<int32_t> perm(num_valid);
        for (int i = 0; i < num_valid; ++i) perm[i] = i;
        std::shuffle(perm.begin(), perm.end(), rng);
        int next = 0;
        std::vector<int> row_expert;
        for (int e = 0; e < E; ++e) {
          const int padded = (counts[e] + tm - 1) / tm * tm;
          for (int b = 0; b < padded / tm; ++b) blk.push_back(e);
          for (int r = 0; r < padded; ++r) {
            sorted.push_back(r < counts[e] ? perm[next++] : num_valid);
            row_expert.push_back(e);
          }
        }
        const int64_t rows = static_cast<int64_t>(sorted.size());
        const int64_t capacity = rows + 256;  // the layout's capacity exceeds the used rows
        sorted.resize(capacity, num_valid);
        blk.resize(capacity / tm, -1);
        const std::vector<uint8_t> a = random_a(capacity, K, rng);
        const std::vector<float> as = random_scales(capacity, K, rng);
        std::vector<float> rw(num_valid);
        for (auto& w : rw) w = (rng() % 3 == 0) ? 0.5f : (rng() % 2 ? 1.0f : 0.25f);
        // with three CTAs the sorted ids start 4 bytes into their buffer (no kernel may assume
        // 16-byte aligned ids)
        std::vector<int32_t> sorted_buf(sorted);
        if (ctas) sorted_buf.insert(sorted_buf.begin(), -7);
        const Tensor dsorted = to_device(sorted_buf, DType::kI32),
                     dblk = to_device(blk, DType::kI32);
        const Tensor dmeta =
            to_device(std::vector<int32_t>{static_cast<int32_t>(rows), 0, 0, 0}, DType::kI32);
        const Tensor drw = to_device(rw, DType::kF32);
        cuda::GroupedGemmParams p;
        set_tile(p, tile);
        p.max_ctas = ctas;
        // three CTAs also take a scheduling group of 3 m-blocks (groups and a partial last group
        // in the tile order; the default group of 8 holds every m-block of this problem)
        p.group_m = ctas ? 3 : 0;
        p.N = N;
        p.K = K;
        expect_tile_n(p, tile);
        p.a_rows = capacity;
        p.expert_blk = static_cast<const int32_t*>(dblk.data());
        p.num_rows_ptr = static_cast<const int32_t*>(dmeta.data());
        p.sorted_ids = static_cast<const int32_t*>(dsorted.data()) + (ctas ? 1 : 0);
        p.num_valid = num_valid;
        p.out_stride = N;
        p.out_scatter = scatter;
        p.row_weight = scatter ? static_cast<const float*>(drw.data()) : nullptr;
        const int64_t out_rows = scatter ? num_valid : capacity;
        const GemmRun r = run_gemm(p, g, a, as, out_rows, capacity / tm);
        EXPECT_TRUE(r.canaries);
        int64_t bad = 0, stray = 0;
        std::vector<char> written(out_rows, 0);
        for (int64_t pos = 0; pos < rows; ++pos) {
          const int id = sorted[pos];
          if (id >= num_valid) continue;
          const int64_t orow = scatter ? id : pos;
          written[orow] = 1;
          for (int n = 0; n < N; ++n) {
            const uint16_t want =
                host_value(g, a, as, pos, row_expert[pos], n, scatter ? rw[id] : 1.0f);
            if (r.out[orow * N + n] != want && bad++ < 5)
              ADD_FAILURE() << "pos " << pos << " n " << n << ": got 0x" << std::hex
                            << r.out[orow * N + n] << " want 0x" << want;
          }
        }
        for (int64_t orow = 0; orow < out_rows; ++orow)
          if (!written[orow])
            for (int n = 0; n < N; ++n) stray += r.out[orow * N + n] != kPoisonBf16;
        EXPECT_EQ(bad, 0);
        EXPECT_EQ(stray, 0) << "rows that are padding were written";
      }
}

// Masked: expert e owns rows [e * max_m, e * max_m + count[e]); max_m not a multiple of 128.
TEST_P(CudaGroupedGemm, MaskedExactBitwise) {
  SKIP_WITHOUT_SM90();
  const GemmTile tile = GetParam();
  const int tm = tile.tm;
  std::mt19937 rng(99 + tm + tile.tn);
  // N = 384: three n-blocks (no clusters; the 256 tile falls back); N = 768: three 256-wide tiles
  // (six 128-wide: clusters with mc); N = 1024: four 256-wide tiles (clusters with mc)
  const int E = 6, K = 512, max_m = 200;
  const std::vector<int32_t> counts = {0, 200, 1, 129, 128, 57};
  for (const int ctas : {0, 3})
    for (const int N : {384, 768, 1024}) {
      SCOPED_TRACE("N " + std::to_string(N) + ", CTAs " + (ctas ? std::to_string(ctas) : "all"));
      const HostGemm g = make_weights(E, N, K, true, rng);
      const int64_t rows = int64_t(E) * max_m;
      const std::vector<uint8_t> a = random_a(rows, K, rng);
      const std::vector<float> as = random_scales(rows, K, rng);
      const Tensor dcounts = to_device(counts, DType::kI32);
      cuda::GroupedGemmParams p;
      set_tile(p, tile);
      p.max_ctas = ctas;
      p.N = N;
      p.K = K;
      expect_tile_n(p, tile);
      p.masked = 1;
      p.a_rows = rows;
      p.counts = static_cast<const int32_t*>(dcounts.data());
      p.E = E;
      p.max_m = max_m;
      p.out_stride = N;
      const GemmRun r = run_gemm(p, g, a, as, rows, int64_t(E) * ((max_m + tm - 1) / tm));
      EXPECT_TRUE(r.canaries);
      int64_t bad = 0, stray = 0;
      for (int e = 0; e < E; ++e)
        for (int i = 0; i < max_m; ++i) {
          const int64_t row = int64_t(e) * max_m + i;
          for (int n = 0; n < N; ++n) {
            if (i < counts[e]) {
              const uint16_t want = host_value(g, a, as, row, e, n, 1.0f);
              if (r.out[row * N + n] != want && bad++ < 5)
                ADD_FAILURE() << "e " << e << " row " << i << " n " << n << ": got 0x" << std::hex
                              << r.out[row * N + n] << " want 0x" << want;
            } else {
              stray += r.out[row * N + n] != kPoisonBf16;
            }
          }
        }
      EXPECT_EQ(bad, 0);
      EXPECT_EQ(stray, 0) << "rows past the counts were written";
    }
}

INSTANTIATE_TEST_SUITE_P(TileM, CudaGroupedGemm,
                         ::testing::Values(GemmTile{128, 128}, GemmTile{128, 128, -1, 1},
                                           GemmTile{128, 256, 0}, GemmTile{128, 256, 1},
                                           GemmTile{128, 256, 0, 1}, GemmTile{128, 256, 1, 1},
                                           GemmTile{16, 0}, GemmTile{32, 0}, GemmTile{64, 0},
                                           GemmTile{16, 0, -1, 0, 1}, GemmTile{16, 0, -1, 0, 2},
                                           GemmTile{16, 0, -1, 0, 4}, GemmTile{32, 0, -1, 0, 1},
                                           GemmTile{32, 0, -1, 0, 2}, GemmTile{64, 0, -1, 0, 1},
                                           GemmTile{64, 0, -1, 0, 2}),
                         [](const auto& info) { return tile_name(info.param); });

// Batch invariance of the grouped GEMMs (VLLM_BATCH_INVARIANT, pitfall 35): the batch size picks
// the m-block (16 / 32 / 64 swapped operands, 128 rows with a 128- or 256-wide tile) and the
// n-blocks per swapped tile, so a token's row may run on any of those kernels. They issue the same
// K32 wgmma steps in the same K order (weights as A and tokens as B in the swapped kernels, the
// other way round in the 128-row ones) and promote each 128-deep partial with the same fmaf(part,
// sa * sb, acc); whether the tensor core's fp32 sum of one k32 step is the same bits with the
// operands swapped is not documented, so this checks it on data that is not exact: codes from a
// normal distribution, scales that are not powers of two, a bias, row weights, K from 1 to 56
// blocks (the DeepSeek GEMM1), uneven experts. Every variant must give every stored row the bits
// the 128 x 128 kernel gives it (and those must be within a bf16-level tolerance of a float64
// GEMM, so that the comparison is of real results). The batch-invariant layer relies on it.
TEST(CudaGroupedGemmTileInvariance, EveryTileGivesARowTheSameBits) {
  SKIP_WITHOUT_SM90();
  std::mt19937 rng(35035);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::uniform_real_distribution<float> ud(0.5f, 2.0f);
  const int E = 7;
  const int counts[E] = {1, 0, 17, 33, 70, 130, 5};
  int num_valid = 0;
  for (int e = 0; e < E; ++e) num_valid += counts[e];
  const std::vector<GemmTile> tiles = {GemmTile{128, 128},        GemmTile{128, 256, 0},
                                       GemmTile{128, 256, 1},     GemmTile{16, 0, -1, 0, 1},
                                       GemmTile{16, 0, -1, 0, 2}, GemmTile{16, 0, -1, 0, 4},
                                       GemmTile{32, 0, -1, 0, 1}, GemmTile{32, 0, -1, 0, 2},
                                       GemmTile{64, 0, -1, 0, 1}, GemmTile{64, 0, -1, 0, 2}};
  for (const auto& [N, K] : {std::pair{512, 128}, std::pair{512, 256}, std::pair{768, 384},
                             std::pair{1024, 512}, std::pair{512, 2048}, std::pair{512, 7168}}) {
    SCOPED_TRACE("N " + std::to_string(N) + ", K " + std::to_string(K));
    const int nkb = K / 128, nnb = N / 128;
    HostGemm g{E, N, K, {}, {}, {}};
    g.b.resize(size_t(E) * N * K);
    for (auto& c : g.b) c = numerics::float_to_e4m3fn(nd(rng) * 32.0f);
    g.b_scale.resize(size_t(E) * nnb * nkb);
    for (auto& s : g.b_scale) s = ud(rng) * 1e-3f;
    g.bias.resize(size_t(E) * N);
    for (auto& x : g.bias) x = nd(rng) * 0.1f;
    // the tokens' rows by valid id (each tile's layout places them at its own positions)
    std::vector<uint8_t> a_id(size_t(num_valid) * K);
    for (auto& c : a_id) c = numerics::float_to_e4m3fn(nd(rng) * 48.0f);
    std::vector<float> as_id(size_t(num_valid) * nkb);
    for (auto& s : as_id) s = ud(rng) * 1e-2f;
    std::vector<float> rw(num_valid);
    for (auto& w : rw) w = ud(rng) * 0.25f;
    std::vector<int> id_expert;
    for (int e = 0; e < E; ++e)
      for (int r = 0; r < counts[e]; ++r) id_expert.push_back(e);
    std::vector<uint16_t> first;
    for (const GemmTile& tile : tiles) {
      SCOPED_TRACE(tile_name(tile));
      const int tm = tile.tm;
      std::vector<int32_t> sorted, blk;
      int next = 0;
      for (int e = 0; e < E; ++e) {
        const int padded = (counts[e] + tm - 1) / tm * tm;
        for (int b = 0; b < padded / tm; ++b) blk.push_back(e);
        for (int r = 0; r < padded; ++r) sorted.push_back(r < counts[e] ? next++ : num_valid);
      }
      const int64_t rows = static_cast<int64_t>(sorted.size());
      std::vector<uint8_t> a(size_t(rows) * K, 0);
      std::vector<float> as(size_t(rows) * nkb, 1.0f);
      for (int64_t pos = 0; pos < rows; ++pos) {
        const int id = sorted[pos];
        if (id >= num_valid) continue;
        std::memcpy(&a[pos * K], &a_id[size_t(id) * K], K);
        std::memcpy(&as[pos * nkb], &as_id[size_t(id) * nkb], nkb * sizeof(float));
      }
      const Tensor dsorted = to_device(sorted, DType::kI32), dblk = to_device(blk, DType::kI32);
      const Tensor dmeta =
          to_device(std::vector<int32_t>{static_cast<int32_t>(rows), 0, 0, 0}, DType::kI32);
      const Tensor drw = to_device(rw, DType::kF32);
      cuda::GroupedGemmParams p;
      set_tile(p, tile);
      p.N = N;
      p.K = K;
      p.a_rows = rows;
      p.expert_blk = static_cast<const int32_t*>(dblk.data());
      p.num_rows_ptr = static_cast<const int32_t*>(dmeta.data());
      p.sorted_ids = static_cast<const int32_t*>(dsorted.data());
      p.num_valid = num_valid;
      p.out_stride = N;
      p.out_scatter = 1;
      p.row_weight = static_cast<const float*>(drw.data());
      const GemmRun r = run_gemm(p, g, a, as, num_valid, rows / tm);
      EXPECT_TRUE(r.canaries);
      if (first.empty()) {
        // the first variant against float64: a real result, not poison or zeros (error within
        // 1% of the value plus 0.5% of the outputs' rms: bf16 rounding is <= 0.4%, and the tensor
        // core's narrower accumulation shows where a sum cancels: the card gave 1.27e-3 for a
        // float64 1.46e-3 with 0.1% of the rms allowed, rms ~0.16 by the data's construction)
        std::vector<float> fa(a_id.size()), fb(g.b.size());
        for (size_t i = 0; i < fa.size(); ++i) fa[i] = numerics::e4m3fn_to_float(a_id[i]);
        for (size_t i = 0; i < fb.size(); ++i) fb[i] = numerics::e4m3fn_to_float(g.b[i]);
        std::vector<double> want(r.out.size());
        double ss = 0.0;
        for (int id = 0; id < num_valid; ++id)
          for (int n = 0; n < N; ++n) {
            const int e = id_expert[id];
            const float* ar = &fa[size_t(id) * K];
            const float* br = &fb[(size_t(e) * N + n) * K];
            double acc = 0.0;
            for (int kb = 0; kb < nkb; ++kb) {
              double part = 0.0;
              for (int k = kb * 128; k < kb * 128 + 128; ++k) part += double(ar[k]) * br[k];
              acc += part * as_id[size_t(id) * nkb + kb] *
                     g.b_scale[(size_t(e) * nnb + n / 128) * nkb + kb];
            }
            const double w = (acc + g.bias[size_t(e) * N + n]) * rw[id];
            want[size_t(id) * N + n] = w;
            ss += w * w;
          }
        const double rms = std::sqrt(ss / double(want.size()));
        int64_t off = 0, nonzero = 0;
        for (size_t i = 0; i < want.size(); ++i) {
          const double got = numerics::bf16_to_float(r.out[i]);
          nonzero += got != 0.0;
          if (!(std::abs(got - want[i]) <= 0.01 * std::abs(want[i]) + 5e-3 * rms) && off++ < 5)
            ADD_FAILURE() << "id " << i / N << " n " << i % N << ": " << got << " against float64 "
                          << want[i] << " (the 128 x 128 kernel; rms " << rms << ")";
        }
        EXPECT_EQ(off, 0);
        EXPECT_GT(rms, 0.01);
        EXPECT_GT(nonzero, int64_t(want.size()) * 9 / 10);
        first = r.out;
        continue;
      }
      int64_t bad = 0;
      for (size_t i = 0; i < first.size(); ++i)
        if (r.out[i] != first[i] && bad++ < 5)
          ADD_FAILURE() << "id " << i / N << " n " << i % N << ": 0x" << std::hex << r.out[i]
                        << " against the 128 x 128 kernel's 0x" << first[i];
      EXPECT_EQ(bad, 0) << "of " << first.size() << " outputs";
    }
  }
}

// Long and short K: the swapped kernels copy the tile's scales to shared memory in chunks of 64 K
// blocks (32 with 64-token tiles; 8 with several n-blocks per tile, which K = 1024 fills and longer
// K turns off; the first chunk of the next tile while the current one runs, in
// the other of two buffers), so 1 block, whole chunks (K = 16384: reloads inside the K loop) and
// 130 blocks (a partial last chunk) must all be exact; three CTAs make each consumer warpgroup run
// several tiles (the prefetch must not overwrite scales it still reads), with scatter and row
// weights (the epilogue's row metadata is loaded under the K loop). The 256 tile runs the same
// cases, with both epilogues (the asynchronous one loads the row metadata under the K loop too).
TEST(CudaGroupedGemmLongK, MoreThan128KBlocksExactBitwise) {
  SKIP_WITHOUT_SM90();
  std::mt19937 rng(4242);
  const int E = 2, N = 512;
  const int counts[E] = {20, 3};
  for (const int K : {128, 1024, 16384, 16640})
    for (const bool compact : {false, true}) {
      // compact: per-token A scales and per-expert B scales (zero strides, the cuda_fused grouped
      // path's per-tensor schemes): the host scales are made constant per row / per expert
      HostGemm g = make_weights(E, N, K, true, rng);
      if (compact)
        for (int e = 0; e < E; ++e)
          for (size_t i = 1; i < size_t(N / 128) * (K / 128); ++i)
            g.b_scale[size_t(e) * (N / 128) * (K / 128) + i] =
                g.b_scale[size_t(e) * (N / 128) * (K / 128)];
      for (const GemmTile tile :
           {GemmTile{128, 256, 0}, GemmTile{128, 256, 1}, GemmTile{128, 256, 0, 1},
            GemmTile{128, 256, 1, 1}, GemmTile{16, 0}, GemmTile{32, 0}, GemmTile{64, 0},
            GemmTile{16, 0, -1, 0, 1}, GemmTile{16, 0, -1, 0, 2}, GemmTile{16, 0, -1, 0, 4},
            GemmTile{32, 0, -1, 0, 2}, GemmTile{64, 0, -1, 0, 2}}) {
        const int tm = tile.tm;
        int num_valid = counts[0] + counts[1];
        std::vector<int32_t> perm(num_valid);
        for (int i = 0; i < num_valid; ++i) perm[i] = i;
        std::shuffle(perm.begin(), perm.end(), rng);
        std::vector<int32_t> sorted, blk;
        std::vector<int> row_expert;
        int next = 0;
        for (int e = 0; e < E; ++e) {
          const int padded = (counts[e] + tm - 1) / tm * tm;
          for (int b = 0; b < padded / tm; ++b) blk.push_back(e);
          for (int r = 0; r < padded; ++r) {
            sorted.push_back(r < counts[e] ? perm[next++] : num_valid);
            row_expert.push_back(e);
          }
        }
        const int64_t rows = static_cast<int64_t>(sorted.size());
        const std::vector<uint8_t> a = random_a(rows, K, rng);
        std::vector<float> as = random_scales(rows, K, rng);
        if (compact)
          for (int64_t r = 0; r < rows; ++r)
            for (int kb = 1; kb < K / 128; ++kb) as[r * (K / 128) + kb] = as[r * (K / 128)];
        std::vector<float> rw(num_valid);
        for (auto& w : rw) w = (rng() % 2) ? 0.5f : 1.0f;
        // expected output rows (scatter: row id, weighted)
        std::vector<uint16_t> want(size_t(num_valid) * N);
        for (int64_t pos = 0; pos < rows; ++pos) {
          const int id = sorted[pos];
          if (id >= num_valid) continue;
          for (int n = 0; n < N; ++n)
            want[size_t(id) * N + n] = host_value(g, a, as, pos, row_expert[pos], n, rw[id]);
        }
        const Tensor dsorted = to_device(sorted, DType::kI32), dblk = to_device(blk, DType::kI32);
        const Tensor dmeta =
            to_device(std::vector<int32_t>{static_cast<int32_t>(rows), 0, 0, 0}, DType::kI32);
        const Tensor drw = to_device(rw, DType::kF32);
        for (const int ctas : {0, 3}) {
          SCOPED_TRACE("K " + std::to_string(K) + ", " + tile_name(tile) + ", CTAs " +
                       (ctas ? std::to_string(ctas) : "all") + (compact ? ", compact scales" : ""));
          cuda::GroupedGemmParams p;
          set_tile(p, tile);
          p.max_ctas = ctas;
          p.N = N;
          p.K = K;
          expect_tile_n(p, tile);
          p.a_rows = rows;
          p.expert_blk = static_cast<const int32_t*>(dblk.data());
          p.num_rows_ptr = static_cast<const int32_t*>(dmeta.data());
          p.sorted_ids = static_cast<const int32_t*>(dsorted.data());
          p.num_valid = num_valid;
          p.out_stride = N;
          p.out_scatter = 1;
          p.row_weight = static_cast<const float*>(drw.data());
          const GemmRun r = run_gemm(p, g, a, as, num_valid, rows / tm, compact);
          EXPECT_TRUE(r.canaries);
          int64_t bad = 0;
          for (size_t i = 0; i < want.size(); ++i)
            if (r.out[i] != want[i] && bad++ < 5)
              ADD_FAILURE() << "row " << i / N << " n " << i % N << ": got 0x" << std::hex
                            << r.out[i] << " want 0x" << want[i];
          EXPECT_EQ(bad, 0);
        }
      }
    }
}

// GEMM1 with the fused activation + 1x128 quantisation epilogue (fuse_act: the 256 tile with
// paired gate/up halves; opt-in FP8MOE_GROUPED_FUSE_ACT), and launch_act_quant (the grouped chain's
// activation + quantisation in one kernel) on GEMM1's bf16 output, against the two-kernel chain on
// the same device (GEMM1 with bf16 output, launch_activation, launch_quant): q and the group scales
// must be bitwise equal, on random non-exact data, for several activations, the fused SiLU+quant
// semantics (h in f32, scale floor), UE8M0 scales and bias; contiguous with padding rows and masked
// with empty / partial experts.
struct FuseCase {
  std::string name;
  cuda::Act act;
  bool limit, fp32_silu, ue8m0, bias, masked;
  int K = 384;
  // times the weight and activation scales: 30 makes h large enough that the fused SiLU+quant
  // semantics take amax / 448 rather than their scale floor (1 / (448 * 512)) for most groups
  float scale = 1.0f;
};

class CudaGroupedFusedAct : public ::testing::TestWithParam<FuseCase> {};

TEST_P(CudaGroupedFusedAct, BitwiseEqualToTheUnfusedChain) {
  SKIP_WITHOUT_SM90();
  const FuseCase& fc = GetParam();
  std::mt19937 rng(77);
  const int E = 4, I = 256, N = 2 * I, K = fc.K, tm = 128;
  std::normal_distribution<float> nd(0.0f, 1.5f);
  std::uniform_real_distribution<float> ud(0.5f, 2.0f);
  HostGemm g{E, N, K, {}, {}, {}};
  g.b.resize(size_t(E) * N * K);
  for (auto& c : g.b) c = numerics::float_to_e4m3fn(nd(rng));
  g.b_scale.resize(size_t(E) * (N / 128) * (K / 128));
  for (auto& x : g.b_scale) x = 0.01f * fc.scale * ud(rng);
  if (fc.bias) {
    g.bias.resize(size_t(E) * N);
    for (auto& x : g.bias) x = 0.5f * nd(rng);
  }
  // rows: contiguous chunks aligned to the 128-row m-block with padding rows, or masked slabs
  std::vector<int32_t> sorted, blk, counts;
  int num_valid = 0;
  int64_t rows = 0, max_mblk = 0;
  const int max_m = 200;
  if (fc.masked) {
    counts = {0, 200, 57, 129};
    rows = int64_t(E) * max_m;
    max_mblk = int64_t(E) * ((max_m + tm - 1) / tm);
  } else {
    const int cnt[E] = {130, 0, 77, 256};
    for (int e = 0; e < E; ++e) num_valid += cnt[e];
    int next = 0;
    for (int e = 0; e < E; ++e) {
      const int padded = (cnt[e] + tm - 1) / tm * tm;
      for (int b = 0; b < padded / tm; ++b) blk.push_back(e);
      for (int r = 0; r < padded; ++r) sorted.push_back(r < cnt[e] ? next++ : num_valid);
    }
    rows = static_cast<int64_t>(sorted.size()) + tm;  // capacity above the used rows
    sorted.resize(rows, num_valid);
    blk.resize(rows / tm, -1);
    max_mblk = rows / tm;
  }
  std::vector<uint8_t> a(size_t(rows) * K);
  for (auto& c : a) c = numerics::float_to_e4m3fn(nd(rng));
  std::vector<float> as(size_t(rows) * (K / 128));
  for (auto& x : as) x = 0.02f * fc.scale * ud(rng);
  const Tensor da = to_device(a, DType::kU8), das = to_device(as, DType::kF32);
  const Tensor db = to_device(g.b, DType::kU8), dbs = to_device(g.b_scale, DType::kF32);
  Tensor dbias;
  if (fc.bias) dbias = to_device(g.bias, DType::kF32);
  Tensor dsorted, dblk, dmeta, dcounts, dids;
  cuda::GroupedGemmParams p;
  p.tile_m = tm;
  p.N = N;
  p.K = K;
  p.a_rows = rows;
  p.a_scale = static_cast<const float*>(das.data());
  p.a_scale_stride = K / 128;
  p.b_scale = static_cast<const float*>(dbs.data());
  p.b_scale_e_stride = (N / 128) * (K / 128);
  p.b_scale_n_stride = K / 128;
  p.bias = fc.bias ? dbias.data() : nullptr;
  cuda::RowSet rs;
  if (fc.masked) {
    dcounts = to_device(counts, DType::kI32);
    dids = Tensor::empty({rows}, DType::kI32, Device::cuda());
    dmeta = Tensor::empty({4}, DType::kI32, Device::cuda());
    cuda::launch_masked_rows(static_cast<const int32_t*>(dcounts.data()), E, max_m,
                             static_cast<int32_t*>(dids.data()),
                             static_cast<int32_t*>(dmeta.data()), nullptr);
    p.masked = 1;
    p.counts = static_cast<const int32_t*>(dcounts.data());
    p.E = E;
    p.max_m = max_m;
    rs = cuda::RowSet{static_cast<const int32_t*>(dids.data()),
                      static_cast<const int32_t*>(dmeta.data()), static_cast<int32_t>(rows),
                      static_cast<int32_t>(rows)};
  } else {
    dsorted = to_device(sorted, DType::kI32);
    dblk = to_device(blk, DType::kI32);
    dmeta = to_device(std::vector<int32_t>{static_cast<int32_t>(rows - tm), 0, 0, 0}, DType::kI32);
    p.expert_blk = static_cast<const int32_t*>(dblk.data());
    p.num_rows_ptr = static_cast<const int32_t*>(dmeta.data());
    p.sorted_ids = static_cast<const int32_t*>(dsorted.data());
    p.num_valid = num_valid;
    rs = cuda::RowSet{static_cast<const int32_t*>(dsorted.data()),
                      static_cast<const int32_t*>(dmeta.data()), static_cast<int32_t>(rows),
                      num_valid};
  }
  const cuda::ActParams ap = testing::act_params_for_test(fc.act, fc.limit, fc.fp32_silu);
  const bool h_f32 = fc.fp32_silu;
  const float min_scale = fc.fp32_silu ? 1.0f / (448.0f * 512.0f) : 0.0f;
  Tensor y1 = Tensor::empty({rows, N}, DType::kBF16, Device::cuda());
  Tensor h = Tensor::empty({rows, I}, h_f32 ? DType::kF32 : DType::kBF16, Device::cuda());
  Tensor q0 = Tensor::empty({rows, I}, DType::kU8, Device::cuda());
  Tensor q1 = Tensor::empty({rows, I}, DType::kU8, Device::cuda());
  Tensor s0 = Tensor::empty({rows, I / 128}, DType::kF32, Device::cuda());
  Tensor s1 = Tensor::empty({rows, I / 128}, DType::kF32, Device::cuda());
  Tensor q2 = Tensor::empty({rows, I}, DType::kU8, Device::cuda());
  Tensor s2 = Tensor::empty({rows, I / 128}, DType::kF32, Device::cuda());
  Tensor q3 = Tensor::empty({rows, I}, DType::kU8, Device::cuda());
  Tensor s3 = Tensor::empty({rows, I / 128}, DType::kF32, Device::cuda());
  for (Tensor* t : {&q0, &q1, &s0, &s1, &q2, &s2, &q3, &s3})
    ASSERT_EQ(cudaMemset(t->data(), 0xFF, t->nbytes()), cudaSuccess);
  // unfused
  {
    cuda::GroupedGemmParams u = p;
    u.tile_n = 256;
    u.out = static_cast<uint16_t*>(y1.data());
    u.out_stride = N;
    cuda::launch_grouped_gemm(u, static_cast<const uint8_t*>(da.data()),
                              static_cast<const uint8_t*>(db.data()), int64_t(E) * N, max_mblk,
                              nullptr);
    cuda::launch_activation(y1.data(), false, N, rs, I, ap, h.data(), h_f32, I, nullptr);
    cuda::QuantSpec qs;
    qs.kind = cuda::AQuant::kGroupDynamic;
    qs.gk = 128;
    qs.ue8m0 = fc.ue8m0;
    qs.min_scale = min_scale;
    cuda::launch_quant(qs, h.data(), h_f32, I, rs, cuda::RowScale{}, I,
                       cuda::QuantOut{static_cast<uint8_t*>(q0.data()), I,
                                      static_cast<float*>(s0.data()), I / 128},
                       nullptr);
    // the same activation + quantisation in one kernel (h never written)
    cuda::launch_act_quant(static_cast<const uint16_t*>(y1.data()), N, rs, I, ap, h_f32, qs,
                           cuda::QuantOut{static_cast<uint8_t*>(q2.data()), I,
                                          static_cast<float*>(s2.data()), I / 128},
                           nullptr);
  }
  // fused: one CTA per tile where the tiles fit the card (warpgroup 1 idle at this size), and three
  // CTAs with scheduling groups of 3 m-blocks (both warpgroups of a CTA run many tiles: the staging
  // buffer, the row metadata and the next tile's scale prefetch are reused)
  for (const int ctas : {0, 3}) {
    cuda::GroupedGemmParams f = p;
    f.max_ctas = ctas;
    f.group_m = ctas ? 3 : 0;
    Tensor& qo = ctas ? q3 : q1;
    Tensor& so = ctas ? s3 : s1;
    f.fuse_act = 1;
    f.act = ap;
    f.act_h_f32 = h_f32 ? 1 : 0;
    f.q_ue8m0 = fc.ue8m0 ? 1 : 0;
    f.q_min_scale = min_scale;
    f.q_out = static_cast<uint8_t*>(qo.data());
    f.q_stride = I;
    f.q_scale = static_cast<float*>(so.data());
    f.q_scale_stride = I / 128;
    cuda::launch_grouped_gemm(f, static_cast<const uint8_t*>(da.data()),
                              static_cast<const uint8_t*>(db.data()), int64_t(E) * N, max_mblk,
                              nullptr);
    if (ctas == 0) {  // the launcher's refusals: another m-block, scatter, interleaved columns
      cuda::GroupedGemmParams t16 = f;
      t16.tile_m = 16;
      EXPECT_THROW(cuda::launch_grouped_gemm(t16, nullptr, nullptr, int64_t(E) * N, 1, nullptr),
                   ValueError);
      cuda::GroupedGemmParams scat = f;
      scat.out_scatter = 1;
      EXPECT_THROW(cuda::launch_grouped_gemm(scat, nullptr, nullptr, int64_t(E) * N, 1, nullptr),
                   ValueError);
      cuda::GroupedGemmParams il = f;  // interleaved gate/up columns are not two halves
      il.act.act = static_cast<int32_t>(cuda::Act::kSwigluOai);
      EXPECT_THROW(cuda::launch_grouped_gemm(il, nullptr, nullptr, int64_t(E) * N, 1, nullptr),
                   ValueError);
    }
  }
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const Tensor hq0 = q0.to(Device::cpu()), hs0 = s0.to(Device::cpu());
  int64_t stored = 0, above_floor = 0;
  for (int64_t i = 0; i < rows * (I / 128); ++i) {
    uint32_t b0;
    std::memcpy(&b0, hs0.ptr<float>() + i, 4);
    stored += b0 != 0xFFFFFFFFu;
    above_floor += b0 != 0xFFFFFFFFu && hs0.ptr<float>()[i] > min_scale;
  }
  if (fc.scale > 1.0f) {
    EXPECT_GT(above_floor, stored / 2) << "the data do not reach the computed scales";
  }
  for (const auto& [what, q, s] :
       {std::tuple{"fused epilogue", &q1, &s1}, std::tuple{"fused epilogue, 3 CTAs", &q3, &s3},
        std::tuple{"launch_act_quant", &q2, &s2}}) {
    SCOPED_TRACE(what);
    const Tensor hq1 = q->to(Device::cpu()), hs1 = s->to(Device::cpu());
    int64_t bad_q = 0, bad_s = 0;
    for (int64_t r = 0; r < rows; ++r) {
      for (int c = 0; c < I / 128; ++c) {
        const float x0 = hs0.ptr<float>()[r * (I / 128) + c],
                    x1 = hs1.ptr<float>()[r * (I / 128) + c];
        uint32_t b0, b1;
        std::memcpy(&b0, &x0, 4);
        std::memcpy(&b1, &x1, 4);
        if (b0 != b1 && bad_s++ < 5)
          ADD_FAILURE() << "row " << r << " group " << c << ": scale " << x1 << " want " << x0;
      }
      for (int c = 0; c < I; ++c) {
        const uint8_t x0 = hq0.ptr<uint8_t>()[r * I + c], x1 = hq1.ptr<uint8_t>()[r * I + c];
        if (x0 != x1 && bad_q++ < 5)
          ADD_FAILURE() << "row " << r << " col " << c << ": q 0x" << std::hex << int(x1)
                        << " want 0x" << int(x0);
      }
    }
    EXPECT_EQ(bad_q, 0);
    EXPECT_EQ(bad_s, 0);
  }
  const int64_t want_stored =
      (fc.masked ? int64_t(0 + 200 + 57 + 129) : int64_t(num_valid)) * (I / 128);
  EXPECT_EQ(stored, want_stored) << "the unfused chain stores every valid row";
}

INSTANTIATE_TEST_SUITE_P(
    Cases, CudaGroupedFusedAct,
    ::testing::Values(
        FuseCase{"silu", cuda::Act::kSilu, false, false, false, false, false},
        FuseCase{"silu_masked_bias", cuda::Act::kSilu, false, false, false, true, true},
        FuseCase{"silu_limit", cuda::Act::kSilu, true, false, false, false, false},
        FuseCase{"fused_silu_quant", cuda::Act::kSilu, false, true, false, false, false},
        FuseCase{"fused_silu_quant_computed_scales", cuda::Act::kSilu, false, true, false, false,
                 false, 384, 30.0f},
        FuseCase{"silu_ue8m0", cuda::Act::kSilu, false, false, true, true, false},
        FuseCase{"gelu", cuda::Act::kGelu, false, false, false, false, true},
        FuseCase{"swigluoai_uninterleave", cuda::Act::kSwigluOaiUninterleave, false, false, false,
                 true, false}),
    [](const auto& info) { return info.param.name; });

// ---- the layer --------------------------------------------------------------------------------

struct RunResult {
  Tensor out_host;
  bool canaries_ok = true;
  bool all_written = true;
  std::string write_message;
};

RunResult run_on_device(const ExpertsImpl& impl, const MoeTestProblem& host_problem) {
  MoeTestProblem d = host_problem.to(Device::cuda());
  std::vector<int64_t> out_shape = d.out.sizes();
  testing::GuardedTensor out(out_shape, d.out.dtype(), Device::cuda());
  testing::poison(out.view());
  FusedMoeArgs args = d.args();
  args.out = out.view();
  const std::size_t ws_bytes = impl.workspace_size(args);
  testing::GuardedTensor ws({static_cast<int64_t>(std::max<std::size_t>(ws_bytes, 1))}, DType::kU8,
                            Device::cuda());
  testing::poison(ws.view());
  impl.run(args, ws_bytes ? ws.view().data : nullptr);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  RunResult r;
  r.canaries_ok = out.canaries_intact() && ws.canaries_intact();
  const auto wc = testing::expect_all_written(out.view());
  r.all_written = wc.ok;
  r.write_message = wc.message;
  Tensor host = Tensor::empty(std::span<const int64_t>(out_shape), out.view().dtype);
  if (host.nbytes() > 0) device_allocator().copy(host.data(), out.view().data, host.nbytes(), 1);
  r.out_host = host;
  return r;
}

MoeTestSpec spec_of(MoeTestMode mode, int64_t M, int64_t E, int64_t H, int64_t I, int topk,
                    uint64_t seed = 0) {
  MoeTestSpec s;
  s.M = M;
  s.E = E;
  s.H = H;
  s.I = I;
  s.topk = topk;
  s.mode = mode;
  s.seed = seed;
  return s;
}

struct ExactCase {
  std::string name;
  MoeTestSpec spec;
};

std::vector<ExactCase> exact_cases() {
  std::vector<ExactCase> v;
  auto add = [&](std::string n, MoeTestSpec s) { v.push_back({std::move(n), s}); };
  for (int64_t M : {1, 33, 200})
    add("M" + std::to_string(M), spec_of(MoeTestMode::kExact, M, 8, 256, 256, 2));
  // 150 rows per expert: the 128-row m-blocks (the cases above stay at <= 50 rows per expert, the
  // swapped kernels); GEMM1 (N 512) on the 256-wide tile, GEMM2 (N 384) on the 128-wide one
  add("M600_128_row_blocks", spec_of(MoeTestMode::kExact, 600, 8, 384, 256, 2));
  {
    auto s = spec_of(MoeTestMode::kExact, 150, 16, 384, 640, 4);
    s.routing = RoutingPattern::kSomeExpertsEmpty;
    add("some_experts_empty", s);
  }
  {
    auto s = spec_of(MoeTestMode::kExact, 90, 8, 256, 384, 2);
    s.routing = RoutingPattern::kOneHotExpert;
    add("one_hot_expert", s);
  }
  {
    auto s = spec_of(MoeTestMode::kExact, 64, 16, 256, 256, 4);
    s.ep_size = 4;
    s.ep_rank = 1;
    add("ep4_rank1", s);
  }
  {
    auto s = spec_of(MoeTestMode::kExact, 40, 8, 256, 256, 2);
    s.padded_slots = 9;
    add("padded_slots", s);
  }
  {
    auto s = spec_of(MoeTestMode::kExact, 30, 8, 256, 256, 2);
    s.bias = true;
    add("bias", s);
  }
  {
    auto s = spec_of(MoeTestMode::kExact, 20, 8, 256, 256, 1);
    s.apply_router_weight_on_input = true;
    add("router_weight_on_input", s);
  }
  {
    auto s = spec_of(MoeTestMode::kExact, 50, 8, 256, 256, 2);
    s.scheme.ue8m0_scales = true;
    add("ue8m0", s);
  }
  {
    auto s = spec_of(MoeTestMode::kExact, 50, 8, 256, 256, 2);
    s.act.activation = MoeActivation::kSwigluOaiUninterleave;
    s.act.clamp_limit = 7.0;
    s.act.alpha = 1.702;
    s.act.beta = 1.0;
    add("swigluoai_uninterleave", s);
  }
  return v;
}

class CudaGroupedExact : public ::testing::TestWithParam<ExactCase> {};

TEST_P(CudaGroupedExact, ThinnedW2BitwiseDenseW2WithinUlps) {
  SKIP_WITHOUT_SM90();
  const ExactCase& c = GetParam();
  MoeTestProblem p;
  try {
    p = testing::make_problem(c.spec);
  } catch (const NotImplementedError& e) {
    FAIL() << "exact mode cannot build this case: " << e.what();
  }
  {
    const Tensor expected = testing::reference_output(p);
    const RunResult r = run_on_device(cuda::grouped_impl(), p);
    EXPECT_TRUE(r.canaries_ok);
    EXPECT_TRUE(r.all_written) << r.write_message;
    double emax = 0;
    for (int64_t i = 0; i < expected.numel(); ++i)
      emax = std::max(emax, std::fabs(testing::element_as_double(expected.view(), i)));
    const auto cmp = testing::compare_close(r.out_host, expected, emax * 0x1p-6, 0x1p-7);
    EXPECT_TRUE(cmp.ok) << "dense w2: " << cmp.str();
  }
  testing::thin_w2(p);
  const Tensor expected = testing::reference_output(p);
  const RunResult r = run_on_device(cuda::grouped_impl(), p);
  EXPECT_TRUE(r.canaries_ok);
  EXPECT_TRUE(r.all_written) << r.write_message;
  const auto cmp = testing::compare_bitwise(r.out_host, expected);
  EXPECT_TRUE(cmp.ok) << "thinned w2: " << cmp.str();
}

INSTANTIATE_TEST_SUITE_P(Cases, CudaGroupedExact, ::testing::ValuesIn(exact_cases()),
                         [](const auto& info) { return info.param.name; });

// The masked format: a top-1 problem whose rows r belong to expert r / T, seen as (E, T, H) slabs
// with counts; checked against the reference's own batched format.
void masked_case(MoeTestMode mode, int64_t E, int64_t T, int64_t H, int64_t I,
                 const std::vector<int32_t>& counts, uint64_t seed) {
  MoeTestSpec s = spec_of(mode, E * T, E, H, I, 1, seed);
  MoeTestProblem p = testing::make_problem(s);
  if (mode == MoeTestMode::kExact) testing::thin_w2(p);
  Tensor cnt = Tensor::empty({E}, DType::kI32);
  for (int64_t e = 0; e < E; ++e) cnt.ptr<int32_t>()[e] = counts[e];
  // reference in the batched format (host)
  FusedMoeArgs ha = p.args();
  ha.x = TensorView(p.x.data(), p.x.dtype(), {E, T, H});
  Tensor ref_out = Tensor::empty({E, T, H}, p.x.dtype());
  testing::poison(ref_out.view());
  ha.out = ref_out.view();
  ha.topk_ids = {};
  ha.topk_weights = {};
  ha.router_logits = {};
  ha.expert_map = {};
  ha.expert_num_tokens = cnt.view();
  find_experts_impl("ref")->run(ha, nullptr);
  // device
  MoeTestProblem d = p.to(Device::cuda());
  const Tensor dcnt = cnt.to(Device::cuda());
  FusedMoeArgs da = d.args();
  da.x = TensorView(d.x.data(), d.x.dtype(), {E, T, H}, Device::cuda());
  testing::GuardedTensor out({E, T, H}, d.x.dtype(), Device::cuda());
  testing::poison(out.view());
  da.out = out.view();
  da.topk_ids = {};
  da.topk_weights = {};
  da.router_logits = {};
  da.expert_map = {};
  da.expert_num_tokens = dcnt.view();
  const ExpertsImpl& impl = cuda::grouped_masked_impl();
  const std::size_t bytes = impl.workspace_size(da);
  testing::GuardedTensor ws({static_cast<int64_t>(std::max<std::size_t>(bytes, 1))}, DType::kU8,
                            Device::cuda());
  testing::poison(ws.view());
  impl.run(da, ws.view().data);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_TRUE(out.canaries_intact() && ws.canaries_intact());
  Tensor host = Tensor::empty({E, T, H}, d.x.dtype());
  device_allocator().copy(host.data(), out.view().data, host.nbytes(), 1);
  int64_t bad = 0, untouched_bad = 0;
  double worst = 0;
  for (int64_t e = 0; e < E; ++e)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t h = 0; h < H; ++h) {
        const int64_t i = (e * T + t) * H + h;
        const double a = testing::element_as_double(host.view(), i);
        if (t < counts[e]) {
          const double x = testing::element_as_double(ref_out.view(), i);
          if (mode == MoeTestMode::kExact) {
            if (!(a == x)) ++bad;
          } else {
            const double err = std::fabs(a - x);
            worst = std::max(worst, err);
            if (!(err <= 0.035 + 0.035 * std::fabs(x))) ++bad;
          }
        } else if (!std::isnan(a)) {
          ++untouched_bad;
        }
      }
  EXPECT_EQ(bad, 0) << "worst abs err " << worst;
  EXPECT_EQ(untouched_bad, 0) << "rows past the counts were written";
}

TEST(CudaGroupedMasked, ExactBitwiseWithEmptyPartialAndFullExperts) {
  SKIP_WITHOUT_SM90();
  masked_case(MoeTestMode::kExact, 5, 150, 256, 256, {150, 0, 7, 129, 64}, 3);
}

// max_m <= 64: the swapped-operand kernel (tokens as wgmma's N operand)
TEST(CudaGroupedMasked, ExactBitwiseSmallSlabs) {
  SKIP_WITHOUT_SM90();
  masked_case(MoeTestMode::kExact, 6, 40, 256, 384, {40, 0, 3, 17, 33, 1}, 4);
}

TEST(CudaGroupedMasked, StatisticalDeepSeekLikeShape) {
  SKIP_WITHOUT_SM90();
  masked_case(MoeTestMode::kStatistical, 4, 96, 1024, 512, {96, 17, 0, 64}, 8);
}

struct StatCase {
  std::string name;
  MoeTestSpec spec;
};

std::vector<StatCase> stat_cases() {
  std::vector<StatCase> v;
  // tests/kernels/moe/test_block_fp8.py (M, N, K) shapes that the DeepGEMM test runs (N, K >= 128
  // multiples; the shape rule sends N <= 512 to Triton in vLLM, the kernel itself takes them).
  struct MNK {
    int64_t M, N, K;
  };
  const MNK mnk[] = {{83, 512, 512},    {128, 1024, 7168}, {128, 4608, 512},
                     {256, 1024, 2048}, {512, 640, 1024},  {2048, 1024, 1024}};
  for (const MNK& s : mnk) {
    StatCase c;
    const int64_t E = s.N * s.K > 4000000 ? 4 : 8;
    c.name =
        "vllm_M" + std::to_string(s.M) + "_N" + std::to_string(s.N) + "_K" + std::to_string(s.K);
    c.spec = spec_of(MoeTestMode::kStatistical, s.M, E, s.K, s.N, 2, 21);
    c.spec.routing = RoutingPattern::kLogits;
    c.spec.routing_config.method = RoutingMethodType::kDefault;
    v.push_back(c);
  }
  {  // DeepSeek-V3 routing (grouped top-k with bias), TP8-like I
    StatCase c;
    c.name = "deepseek_tp8_like";
    c.spec = spec_of(MoeTestMode::kStatistical, 64, 64, 1024, 256, 8, 7);
    c.spec.routing = RoutingPattern::kLogits;
    c.spec.routing_config.method = RoutingMethodType::kDeepSeekV3;
    c.spec.routing_config.scoring_func = "sigmoid";
    c.spec.routing_config.num_expert_group = 8;
    c.spec.routing_config.topk_group = 4;
    c.spec.routing_config.routed_scaling_factor = 2.5;
    v.push_back(c);
  }
  {
    StatCase c;
    c.name = "uneven_experts_ep2";
    c.spec = spec_of(MoeTestMode::kStatistical, 300, 16, 512, 384, 4, 5);
    c.spec.routing = RoutingPattern::kSomeExpertsEmpty;
    c.spec.ep_size = 2;
    c.spec.ep_rank = 1;
    v.push_back(c);
  }
  return v;
}

class CudaGroupedStatistical : public ::testing::TestWithParam<StatCase> {};

TEST_P(CudaGroupedStatistical, WithinVllmTolerance) {
  SKIP_WITHOUT_SM90();
  const StatCase& c = GetParam();
  const MoeTestProblem p = testing::make_problem(c.spec);
  const Tensor expected = testing::reference_output(p);
  const RunResult r = run_on_device(cuda::grouped_impl(), p);
  EXPECT_TRUE(r.canaries_ok);
  EXPECT_TRUE(r.all_written) << r.write_message;
  const auto cmp = testing::compare_close(r.out_host, expected, 0.035, 0.035);
  EXPECT_TRUE(cmp.ok) << cmp.str();
  // the tolerance alone passes an all-zero output where the outputs are small (CudaStatistical)
  EXPECT_LT(cmp.mean_rel_abs_err, 0.02) << cmp.str();
}

INSTANTIATE_TEST_SUITE_P(Cases, CudaGroupedStatistical, ::testing::ValuesIn(stat_cases()),
                         [](const auto& info) { return info.param.name; });

// Runs p directly twice (the same bits run to run), then captures one run in a CUDA graph and
// replays it `replays` times onto a poisoned output: every replay must give the direct run's bits.
void expect_graph_replays_match(const ExpertsImpl& impl, const MoeTestProblem& p, int replays) {
  MoeTestProblem d = p.to(Device::cuda());
  FusedMoeArgs args = d.args();
  cudaStream_t st;
  ASSERT_EQ(cudaStreamCreate(&st), cudaSuccess);
  args.stream = st;
  const std::size_t bytes = impl.workspace_size(args);
  Tensor ws = Tensor::empty({static_cast<int64_t>(bytes)}, DType::kU8, Device::cuda());
  impl.run(args, ws.data());
  ASSERT_EQ(cudaStreamSynchronize(st), cudaSuccess);
  const Tensor direct = d.out.to(Device::cpu());
  testing::poison(d.out.view());
  impl.run(args, ws.data());
  ASSERT_EQ(cudaStreamSynchronize(st), cudaSuccess);
  EXPECT_TRUE(testing::compare_bitwise(d.out.to(Device::cpu()), direct).ok) << "run to run";
  cudaGraph_t graph;
  ASSERT_EQ(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  impl.run(args, ws.data());
  ASSERT_EQ(cudaStreamEndCapture(st, &graph), cudaSuccess);
  cudaGraphExec_t exec;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  for (int rep = 0; rep < replays; ++rep) {
    testing::poison(d.out.view());
    ASSERT_EQ(cudaGraphLaunch(exec, st), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(st), cudaSuccess);
    const auto cmp = testing::compare_bitwise(d.out.to(Device::cpu()), direct);
    EXPECT_TRUE(cmp.ok) << "replay " << rep << ": " << cmp.str();
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(st);
}

TEST(CudaGrouped, GraphCaptureAndDeterminism) {
  SKIP_WITHOUT_SM90();
  MoeTestSpec s = spec_of(MoeTestMode::kStatistical, 300, 16, 1024, 512, 4, 11);
  s.routing = RoutingPattern::kLogits;
  s.routing_config.method = RoutingMethodType::kRenormalize;
  expect_graph_replays_match(cuda::grouped_impl(), testing::make_problem(s), 2);
}

// The top-k sum fused into GEMM2 (GroupedGemmParams::sum_out, opt-in FP8MOE_GROUPED_FUSED_SUM):
// the layer's output must be the bits of GEMM2 + launch_moe_sum (the same float operations in the
// same slot order) on cases with 128-row m-blocks and the 256-wide GEMM2 tile (uneven experts,
// several n-tiles, top-8, expert parallelism: tokens whose slots are all on other ranks get zeros,
// padded slots, a router weight on the input) and on the swapped kernels (16 / 32 / 64 tokens, 1 /
// 2 / 4 n-blocks per tile: 128 / 256 / 512 columns per n-tile, EP); graph replay and run to run
// with it on; a shape whose 128-row GEMM2 is not on the 256 tile (H = 384) keeps the sum kernel.
// The default rule is the caller's (the variable); the override pins it per run.
struct FusedSumGuard {
  ~FusedSumGuard() { cuda::set_grouped_fused_sum_override(-1); }
};

TEST(CudaGroupedFusedSum, BitwiseEqualToTheSumKernel) {
  SKIP_WITHOUT_SM90();
  FusedSumGuard guard;
  struct Case {
    const char* name;
    MoeTestSpec spec;
    bool fused;  // whether the rule takes it
  };
  std::vector<Case> cases;
  {
    MoeTestSpec s = spec_of(MoeTestMode::kStatistical, 600, 16, 512, 256, 4, 41);
    s.routing = RoutingPattern::kLogits;
    s.routing_config.method = RoutingMethodType::kRenormalize;
    cases.push_back({"E16_top4_150_rows", s, true});
  }
  {
    MoeTestSpec s = spec_of(MoeTestMode::kStatistical, 1100, 32, 1024, 256, 8, 42);
    s.routing = RoutingPattern::kLogits;
    s.routing_config.method = RoutingMethodType::kRenormalize;
    cases.push_back({"E32_top8_4_n_tiles", s, true});
  }
  {
    MoeTestSpec s = spec_of(MoeTestMode::kStatistical, 700, 16, 512, 256, 2, 43);
    s.ep_size = 4;
    s.ep_rank = 2;
    cases.push_back({"ep4_rank2", s, true});
  }
  {
    MoeTestSpec s = spec_of(MoeTestMode::kStatistical, 600, 8, 512, 256, 2, 44);
    s.padded_slots = 37;
    cases.push_back({"padded_slots", s, true});
  }
  {
    MoeTestSpec s = spec_of(MoeTestMode::kStatistical, 600, 8, 512, 256, 1, 45);
    s.apply_router_weight_on_input = true;
    cases.push_back({"router_weight_on_input", s, true});
  }
  {
    MoeTestSpec s = spec_of(MoeTestMode::kExact, 600, 8, 512, 256, 2, 46);
    cases.push_back({"exact", s, true});
  }
  {  // repeated expert ids within tokens (two pair rows of one token in one m-block)
    MoeTestSpec s = spec_of(MoeTestMode::kStatistical, 600, 8, 512, 256, 4, 53);
    cases.push_back({"repeated_ids", s, true});
  }
  cases.push_back({"H384_keeps_the_sum_kernel",
                   spec_of(MoeTestMode::kStatistical, 600, 8, 384, 256, 2, 47), false});
  // the swapped kernels: 16-token m-blocks with 4 n-blocks per tile (512 columns), 32 with 2, 64
  // with 2, 16 with 1 (K = 768: 128 columns, H = 384 too)
  cases.push_back(
      {"swapped_16_nb4", spec_of(MoeTestMode::kStatistical, 64, 16, 1024, 256, 4, 48), true});
  cases.push_back(
      {"swapped_32_nb2", spec_of(MoeTestMode::kStatistical, 100, 8, 512, 256, 2, 49), true});
  cases.push_back(
      {"swapped_64_nb2", spec_of(MoeTestMode::kStatistical, 200, 8, 512, 256, 2, 50), true});
  cases.push_back(
      {"swapped_16_nb1_H384", spec_of(MoeTestMode::kStatistical, 30, 8, 384, 768, 2, 51), true});
  {
    MoeTestSpec s = spec_of(MoeTestMode::kStatistical, 48, 16, 512, 256, 4, 52);
    s.ep_size = 2;
    s.ep_rank = 1;
    cases.push_back({"swapped_ep2_rank1", s, true});
  }
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    MoeTestProblem p = testing::make_problem(c.spec);
    if (std::string(c.name) == "repeated_ids")  // slot 1 = slot 0 for every third token
      for (int64_t t = 0; t < c.spec.M; t += 3)
        p.topk_ids.ptr<int32_t>()[t * c.spec.topk + 1] = p.topk_ids.ptr<int32_t>()[t * c.spec.topk];
    {
      MoeTestProblem d = p.to(Device::cuda());
      const cuda::MoeProblem mp = cuda::make_problem(d.args());
      cuda::set_grouped_fused_sum_override(1);
      const int bm = cuda::grouped_tile_m(double(mp.M * mp.topk) / double(mp.E));
      EXPECT_EQ(cuda::grouped_fused_sum_wanted(mp, bm), c.fused) << "m-block " << bm;
      const std::string plan = cuda::grouped_problem_plan(mp);
      EXPECT_EQ(plan.find("top-k sum in its epilogue") != std::string::npos, c.fused) << plan;
    }
    cuda::set_grouped_fused_sum_override(0);
    const RunResult base = run_on_device(cuda::grouped_impl(), p);
    ASSERT_TRUE(base.all_written) << base.write_message;
    cuda::set_grouped_fused_sum_override(1);
    for (int rep = 0; rep < 2; ++rep) {
      const RunResult f = run_on_device(cuda::grouped_impl(), p);
      EXPECT_TRUE(f.canaries_ok);
      EXPECT_TRUE(f.all_written) << f.write_message;
      const auto cmp = testing::compare_bitwise(f.out_host, base.out_host);
      EXPECT_TRUE(cmp.ok) << "run " << rep << ": " << cmp.str();
    }
    if (c.spec.ep_size > 1 && c.spec.topk <= 2) {  // some tokens have no local slot: zero rows
      const Tensor& o = base.out_host;
      int64_t zero_rows = 0;
      for (int64_t t = 0; t < o.size(0); ++t) {
        bool z = true;
        for (int64_t h = 0; h < o.size(1) && z; ++h) z = o.ptr<uint16_t>()[t * o.size(1) + h] == 0;
        zero_rows += z;
      }
      EXPECT_GT(zero_rows, 0) << "the EP case should have tokens without a local slot";
    }
  }
  // graph capture and replay with the fused sum (the counters are zeroed inside the chain)
  cuda::set_grouped_fused_sum_override(1);
  expect_graph_replays_match(cuda::grouped_impl(), testing::make_problem(cases[1].spec), 3);
  // the launcher refuses a sum it would not run (another tile, the async epilogue, no counters)
  cuda::GroupedGemmParams g;
  g.tile_m = 128;
  g.N = 512;
  g.K = 256;
  g.a_rows = 128;  // (0 returns before any check)
  g.out_scatter = 1;
  g.out_stride = 512;
  g.sum_out = reinterpret_cast<uint16_t*>(uintptr_t{256});
  g.sum_ids = reinterpret_cast<const int32_t*>(uintptr_t{256});
  g.sum_topk = 2;
  g.tile_n = 256;
  g.epi_async = 0;
  g.mcast = 0;
  EXPECT_THROW(cuda::launch_grouped_gemm(g, nullptr, nullptr, 1024, 1, nullptr), ValueError)
      << "no counters";
  g.sum_cnt = reinterpret_cast<int32_t*>(uintptr_t{256});
  for (const int what : {0, 1, 2, 3, 4, 5}) {
    cuda::GroupedGemmParams b = g;
    if (what == 0) b.tile_n = 128;
    if (what == 1) b.epi_async = 1;
    if (what == 2) b.masked = 1;
    if (what == 3) b.out_scatter = 0;
    if (what == 4) b.out = reinterpret_cast<uint16_t*>(uintptr_t{256 + 64});  // lines: 128 B
    if (what == 5) {  // a swapped kernel without counters
      b.tile_m = 16;
      b.sum_cnt = nullptr;
    }
    EXPECT_THROW(cuda::launch_grouped_gemm(b, nullptr, nullptr, 1024, 1, nullptr), ValueError)
        << what;
  }
}

TEST(CudaGrouped, ZeroTokensAndAllExpertsRemote) {
  SKIP_WITHOUT_SM90();
  {
    const MoeTestProblem p = testing::make_problem(spec_of(MoeTestMode::kExact, 0, 8, 256, 256, 2));
    const RunResult r = run_on_device(cuda::grouped_impl(), p);
    EXPECT_EQ(r.out_host.numel(), 0);
    EXPECT_TRUE(r.canaries_ok);
  }
  MoeTestSpec s = spec_of(MoeTestMode::kExact, 9, 8, 256, 256, 2);
  s.ep_size = 2;
  MoeTestProblem p = testing::make_problem(s);
  for (int64_t i = 0; i < p.topk_ids.numel(); ++i)
    p.topk_ids.ptr<int32_t>()[i] = 4 + static_cast<int32_t>(i % 4);
  const RunResult r = run_on_device(cuda::grouped_impl(), p);
  EXPECT_TRUE(r.all_written) << r.write_message;
  for (int64_t i = 0; i < r.out_host.numel(); ++i)
    ASSERT_EQ(testing::element_as_double(r.out_host.view(), i), 0.0);
}

// ---- selection, limits, platform (run anywhere) -------------------------------------------------

TEST(CudaGroupedSelection, RegistryLimitsAndShapeRule) {
  cuda::install_hooks();
  ASSERT_NE(find_experts_impl("cuda_grouped"), nullptr);
  ASSERT_NE(find_experts_impl("cuda_grouped_masked"), nullptr);
  // the feature is installed exactly where the kernels run (sm_90 with this binary's code)
  const bool runs = cuda::device_capability() == 90 && cuda::kernels_available();
  EXPECT_EQ(experts_impl_available("cuda_grouped"), runs);
  EXPECT_EQ(Platform::detect().has(Feature::kDeepGemm), runs);
  // vLLM _valid_deep_gemm: align <= M, N % 128 == 0, K % 128 == 0, N > 512
  EXPECT_TRUE(cuda::deep_gemm_shape_ok(128, 640, 7168));
  EXPECT_FALSE(cuda::deep_gemm_shape_ok(127, 1024, 7168));   // M below the alignment
  EXPECT_FALSE(cuda::deep_gemm_shape_ok(4096, 512, 7168));   // N <= 512
  EXPECT_FALSE(cuda::deep_gemm_shape_ok(4096, 1000, 7168));  // N unaligned
  EXPECT_FALSE(cuda::deep_gemm_shape_ok(4096, 1024, 7000));  // K unaligned
  // the 128-row kernel's tile width: 256 only where N % 256 == 0
  cuda::GroupedGemmParams gp;
  gp.N = 512;
  gp.tile_n = 256;
  EXPECT_EQ(cuda::grouped_tile_n(gp), 256);
  gp.N = 384;
  EXPECT_EQ(cuda::grouped_tile_n(gp), 128);
  gp.N = 512;
  gp.tile_n = 128;
  EXPECT_EQ(cuda::grouped_tile_n(gp), 128);
  gp.tile_n = 192;
  EXPECT_THROW(cuda::grouped_tile_n(gp), ValueError);
  // the 256 tile's asynchronous epilogue: asked for, or by the rule for K <= 512 only; never with
  // the fused activation, the other tiles or a destination bulk copies cannot write
  gp.tile_n = 256;
  gp.N = 512;
  gp.K = 7168;
  gp.out_stride = 512;
  gp.epi_async = 1;
  EXPECT_TRUE(cuda::grouped_epi_async(gp));
  gp.epi_async = 0;
  EXPECT_FALSE(cuda::grouped_epi_async(gp));
  if (std::getenv("FP8MOE_GROUPED_EPI") == nullptr) {
    gp.epi_async = -1;
    EXPECT_FALSE(cuda::grouped_epi_async(gp));  // long K: sync
    gp.K = 512;
    EXPECT_TRUE(cuda::grouped_epi_async(gp));  // short K: async
  }
  gp.epi_async = 1;
  gp.out_stride = 516;  // rows not 16-byte aligned
  EXPECT_FALSE(cuda::grouped_epi_async(gp));
  gp.out_stride = 512;
  gp.out = reinterpret_cast<uint16_t*>(uintptr_t{8});  // output not 16-byte aligned
  EXPECT_FALSE(cuda::grouped_epi_async(gp));
  gp.out = nullptr;
  gp.N = 384;  // the 128 tile
  EXPECT_FALSE(cuda::grouped_epi_async(gp));
  gp.N = 512;
  gp.tile_m = 64;  // swapped kernel
  EXPECT_FALSE(cuda::grouped_epi_async(gp));
  gp.tile_m = 128;
  gp.fuse_act = 1;
  EXPECT_FALSE(cuda::grouped_epi_async(gp));
  gp.fuse_act = 0;
  gp.epi_async = 2;
  EXPECT_THROW(cuda::grouped_epi_async(gp), ValueError);
  gp.epi_async = -1;
  // the swapped kernels' n-blocks per tile: the rule (4 for K <= 256, 2 for K <= 512, else 1; 32-
  // and 64-token tiles at most 2), halved until N holds whole tiles; 1 beyond one scale chunk (K >
  // 1024) and for the 128-row kernel; an unknown count is a clear error
  struct NbCase {
    int tile_m, N, K, ask, want;  // ask 0: the rule
  };
  const bool rule = std::getenv("FP8MOE_GROUPED_SWAP_NB") == nullptr;
  for (const NbCase c :
       {NbCase{16, 7168, 256, 0, 4}, NbCase{16, 7168, 384, 0, 2}, NbCase{16, 7168, 768, 0, 1},
        NbCase{16, 384, 256, 0, 1}, NbCase{16, 768, 256, 0, 2}, NbCase{64, 7168, 256, 0, 2},
        NbCase{128, 7168, 256, 0, 1}, NbCase{16, 7168, 1024, 4, 4}, NbCase{16, 7168, 1152, 4, 1},
        NbCase{32, 7168, 256, 4, 2}}) {
    if (c.ask == 0 && !rule) continue;
    cuda::GroupedGemmParams sp;
    sp.tile_m = c.tile_m;
    sp.N = c.N;
    sp.K = c.K;
    sp.swap_nb = c.ask;
    EXPECT_EQ(cuda::grouped_swap_nb(sp), c.want)
        << "tile_m " << c.tile_m << " N " << c.N << " K " << c.K << " asked " << c.ask;
  }
  cuda::GroupedGemmParams sp;
  sp.tile_m = 16;
  sp.swap_nb = 3;
  EXPECT_THROW(cuda::grouped_swap_nb(sp), ValueError);
  // supports_config: B128 FP8 only
  const ExpertsImpl& g = cuda::grouped_impl();
  MoeConfig cfg;
  cfg.num_experts = 8;
  QuantKey wk, ak;
  wk.dtype = KeyDType::kF8E4M3FN;
  wk.scale.dtype = KeyDType::kF32;
  wk.scale.group_shape = GroupShape(128, 128);
  ak.dtype = KeyDType::kF8E4M3FN;
  ak.scale.dtype = KeyDType::kF32;
  ak.scale.group_shape = GroupShape(1, 128);
  EXPECT_TRUE(g.supports_config(cfg, wk, ak).ok);
  QuantKey pt = wk;
  pt.scale.group_shape = kPerTensor;
  EXPECT_FALSE(g.supports_config(cfg, pt, ak).ok);
  EXPECT_FALSE(g.supports_config(cfg, std::nullopt, std::nullopt).ok);
}

// The fused top-k sum's rule and its n-tile width (runs anywhere: host code only).
TEST(CudaGroupedSelection, FusedSumRuleAndColumns) {
  FusedSumGuard guard;
  cuda::MoeProblem p;  // DeepSeek-V3 TP8-like
  p.H = 7168;
  p.I = 256;
  p.N1 = 512;
  p.E = p.E_global = 256;
  p.topk = 8;
  cuda::set_grouped_fused_sum_override(0);
  for (const int bm : {16, 32, 64, 128}) EXPECT_FALSE(cuda::grouped_fused_sum_wanted(p, bm)) << bm;
  cuda::set_grouped_fused_sum_override(1);
  for (const int bm : {16, 32, 64, 128}) EXPECT_TRUE(cuda::grouped_fused_sum_wanted(p, bm)) << bm;
  p.H = 384;  // the 128-row GEMM2 would run the 128-wide tile: no fused sum there
  EXPECT_TRUE(cuda::grouped_fused_sum_wanted(p, 16));
  EXPECT_FALSE(cuda::grouped_fused_sum_wanted(p, 128));
  p.H = 7168;
  p.x_f32 = true;  // f32 y2 and out
  EXPECT_FALSE(cuda::grouped_fused_sum_wanted(p, 16));
  p.x_f32 = false;
  p.topk = 33;  // more slots than the valid-slot mask holds
  EXPECT_FALSE(cuda::grouped_fused_sum_wanted(p, 16));
  // the counters' n-tile: the 128 x 256 tile, or 128 x the swapped tile's n-blocks
  cuda::GroupedGemmParams g;
  g.N = 7168;
  g.K = 256;
  g.tile_m = 128;
  g.tile_n = 256;
  EXPECT_EQ(cuda::grouped_sum_cols(g), 256);
  g.N = 384;
  EXPECT_EQ(cuda::grouped_sum_cols(g), 128);
  if (!std::getenv("FP8MOE_GROUPED_SWAP_NB")) {
    g.N = 7168;
    g.tile_m = 16;
    EXPECT_EQ(cuda::grouped_sum_cols(g), 512);  // K = 256: 4 n-blocks
    g.tile_m = 64;
    EXPECT_EQ(cuda::grouped_sum_cols(g), 256);  // at most 2 with 64-token tiles
    g.K = 7168;
    EXPECT_EQ(cuda::grouped_sum_cols(g), 128);  // long K: 1
  }
}

// The one-line plan describe_call gives for the grouped path (runs anywhere: no tensor data): the
// m-block and kernel from the rows per expert, each GEMM's tile by the rules, which small kernels
// run. The expectations hold for the defaults (no FP8MOE_GROUPED_* variable set).
TEST(CudaGroupedSelection, PlanNamesTheKernelsTheRulesChoose) {
  for (const char* v : {"FP8MOE_GROUPED_TILE_M", "FP8MOE_GROUPED_SWAP", "FP8MOE_GROUPED_SWAP_NB",
                        "FP8MOE_GROUPED_TILE_N", "FP8MOE_GROUPED_FUSE_ACT"})
    if (std::getenv(v)) GTEST_SKIP() << v << " is set";
  cuda::MoeProblem p;  // DeepSeek-V3 TP8
  p.H = 7168;
  p.I = 256;
  p.N1 = 512;
  p.E = p.E_global = 256;
  p.topk = 8;
  p.route_in_kernel = true;
  const auto has = [](const std::string& s, const char* part) {
    return s.find(part) != std::string::npos;
  };
  p.M = 32;  // 1 row per expert
  std::string s = cuda::grouped_problem_plan(p);
  EXPECT_TRUE(has(s, "1.0 rows per expert; 16-token m-blocks")) << s;
  EXPECT_TRUE(has(s, "routing kernel")) << s;
  EXPECT_TRUE(has(s, "alignment, then x quantised")) << s;
  EXPECT_TRUE(has(s, "GEMM1 (N 512, K 7168): 1 n-block of 128 rows per tile")) << s;
  EXPECT_TRUE(has(s, "activation and h's quantisation kernel")) << s;
  EXPECT_TRUE(has(s, "GEMM2 (N 7168, K 256): 4 n-blocks of 128 rows per tile")) << s;
  p.M = 8192;  // 256 rows per expert
  s = cuda::grouped_problem_plan(p);
  EXPECT_TRUE(has(s, "256.0 rows per expert; 128-row m-blocks")) << s;
  EXPECT_TRUE(has(s, "GEMM1 (N 512, K 7168): 128 x 256 tiles")) << s;
  p.M = 40000;  // chunks of 16,384 tokens
  s = cuda::grouped_problem_plan(p);
  EXPECT_TRUE(has(s, "(chunks of 16384 tokens)")) << s;
  p.M = 0;
  EXPECT_EQ(cuda::grouped_problem_plan(p), "no tokens: nothing runs");
  // the tuning table's n-blocks reach both GEMMs (GEMM1's K = 7168 holds one)
  p.M = 32;
  p.swap_nb = 2;
  s = cuda::grouped_problem_plan(p);
  EXPECT_TRUE(has(s, "GEMM2 (N 7168, K 256): 2 n-blocks")) << s;
  EXPECT_TRUE(has(s, "GEMM1 (N 512, K 7168): 1 n-block of")) << s;
}

TEST(CudaGrouped, LimitsAreClearErrors) {
  SKIP_WITHOUT_SM90();
  MoeTestSpec s = spec_of(MoeTestMode::kStatistical, 4, 4, 256, 256, 2);
  s.scheme.weight = WeightScaleKind::kPerTensor;
  s.scheme.act = ActQuantKind::kPerTokenDynamic;
  const MoeTestProblem p = testing::make_problem(s);
  MoeTestProblem d = p.to(Device::cuda());
  EXPECT_NE(cuda::grouped_limit(d.args()), "");
  EXPECT_THROW(cuda::grouped_impl().workspace_size(d.args()), NotImplementedError);
  MoeTestSpec s2 = spec_of(MoeTestMode::kStatistical, 4, 4, 256, 192, 2);
  s2.scheme.block_n = 64;
  s2.scheme.block_k = 64;
  s2.scheme.group_k = 64;
  MoeTestProblem d2 = testing::make_problem(s2).to(Device::cuda());
  EXPECT_NE(cuda::grouped_limit(d2.args()), "");
  // the kernel launcher itself: K and N in whole 128-blocks (a partial block would be dropped)
  cuda::GroupedGemmParams gp;
  gp.a_rows = 128;
  gp.N = 256;
  gp.K = 200;
  EXPECT_THROW(cuda::launch_grouped_gemm(gp, nullptr, nullptr, 256, 1, nullptr), ValueError);
  gp.K = 256;
  gp.N = 200;
  EXPECT_THROW(cuda::launch_grouped_gemm(gp, nullptr, nullptr, 200, 1, nullptr), ValueError);
  gp.N = 256;
  gp.group_m = -1;  // the scheduling group
  EXPECT_THROW(cuda::launch_grouped_gemm(gp, nullptr, nullptr, 256, 1, nullptr), ValueError);
}

}  // namespace
}  // namespace fp8moe
