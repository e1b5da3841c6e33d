// The layer's kernels around the GEMMs, each against a second implementation on the same device:
// - the many-block alignment against the one-block alignment (same tables, every expert holding
//   the same pairs, pair_pos consistent), at pair counts up to 300,000 with dropped slots and an
//   expert map;
// - the alignment + 1 x 128 quantisation kernel against the alignment followed by the scattering
//   quantisation (same tables and codes, pairs in index order within an expert, run to run equal);
// - the eight-columns-per-thread per-token / per-tensor quantisers against the scalar kernels
//   (chosen by an unaligned row stride), gathered sorted rows with a row scale, bf16 and f32;
// - the fused activation + per-token / static per-tensor quantisation against launch_activation
//   followed by the scalar quantiser;
// - the 16-byte top-k sum against the scalar kernel (chosen by an unaligned output) and both
//   against the sum computed on the host.
// All bitwise, on random (non-exact) data with saturating values.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <climits>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "cuda/cuda_testing.hpp"
#include "fp8moe/error.hpp"
#include "fp8moe/numerics.hpp"
#include "fp8moe/tensor.hpp"
#include "kernels/cuda/moe_launchers.hpp"

namespace fp8moe {
namespace {

template <typename T>
Tensor to_device(const std::vector<T>& v, DType dt) {
  Tensor h = Tensor::empty({static_cast<int64_t>(v.size())}, dt);
  std::memcpy(h.data(), v.data(), v.size() * sizeof(T));
  return h.to(Device::cuda());
}

template <typename T>
std::vector<T> to_host(const Tensor& d) {
  const Tensor h = d.to(Device::cpu());
  std::vector<T> v(static_cast<size_t>(h.nbytes() / sizeof(T)));
  std::memcpy(v.data(), h.data(), v.size() * sizeof(T));
  return v;
}

Tensor poisoned(int64_t bytes) {
  Tensor t = Tensor::empty({bytes}, DType::kU8, Device::cuda());
  EXPECT_EQ(cudaMemset(t.data(), 0xFF, static_cast<size_t>(bytes)), cudaSuccess);
  return t;
}

int32_t* i32(Tensor& t) { return static_cast<int32_t*>(t.data()); }

// ---- alignment ----------------------------------------------------------------------------------

struct AlignCase {
  int num_valid, E_global, E_local, bm;
  bool map;
};

struct AlignResult {
  std::vector<int32_t> sorted, blk, meta, cnt, off, ppos;
};

AlignResult run_align(const Tensor& ids, const Tensor* map, const AlignCase& c, int capacity,
                      int64_t split_min) {
  Tensor sorted = poisoned(int64_t(capacity) * 4), blk = poisoned(int64_t(capacity / c.bm) * 4),
         meta = poisoned(16), cnt = poisoned(int64_t(c.E_local) * 4),
         off = poisoned(int64_t(c.E_local + 1) * 4), ppos = poisoned(int64_t(c.num_valid) * 4),
         scratch =
             poisoned(static_cast<int64_t>(cuda::align_scratch_bytes(c.num_valid, c.E_local)));
  cuda::AlignOut out{i32(sorted), i32(blk), i32(meta), i32(cnt), i32(off), i32(ppos), i32(scratch)};
  cuda::launch_align(static_cast<const int32_t*>(ids.data()), c.num_valid,
                     map ? static_cast<const int32_t*>(map->data()) : nullptr, c.E_global,
                     c.E_local, c.bm, capacity, 0, out, nullptr, split_min);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  return {to_host<int32_t>(sorted), to_host<int32_t>(blk), to_host<int32_t>(meta),
          to_host<int32_t>(cnt),    to_host<int32_t>(off), to_host<int32_t>(ppos)};
}

// Random top-k ids for num_valid pairs (3% dropped: -1), optionally an expert map (every
// (E_global / E_local)-th expert local, the others on other ranks), their local experts, and the
// sorted capacity for m-block bm.
struct RandomIds {
  std::vector<int32_t> ids, map;
  bool mapped = false;
  int E_global = 0;
  int local(int32_t gid) const {
    if (gid < 0 || gid >= E_global) return -1;
    return mapped ? map[gid] : gid;
  }
};
RandomIds random_ids(int num_valid, int E_global, int E_local, bool mapped, std::mt19937& rng) {
  RandomIds r;
  r.mapped = mapped;
  r.E_global = E_global;
  std::uniform_int_distribution<int> pick(0, E_global - 1), drop(0, 99);
  r.ids.resize(num_valid);
  for (auto& v : r.ids) v = drop(rng) < 3 ? -1 : pick(rng);
  r.map.assign(E_global, -1);
  if (mapped)
    for (int g = 0, l = 0; g < E_global && l < E_local; g += E_global / E_local) r.map[g] = l++;
  return r;
}
int sorted_capacity(int num_valid, int E_local, int bm) {
  return (num_valid + std::min(E_local, num_valid) * (bm - 1) + bm - 1) / bm * bm;
}

// The tables of moe_align_block_size computed here (spec/numerics.md §2), not by the device's
// align_tables: pairs per local expert, the exclusive prefix of the counts padded to bm, the padded
// total, and the expert of each bm-row block (-1 past the total).
struct HostTables {
  std::vector<int32_t> cnt, off, blk;
  int32_t total = 0;
};
HostTables host_tables(const RandomIds& ri, int E_local, int bm, int capacity) {
  HostTables h;
  h.cnt.assign(E_local, 0);
  for (const int32_t gid : ri.ids)
    if (const int e = ri.local(gid); e >= 0) ++h.cnt[e];
  h.off.assign(E_local + 1, 0);
  for (int e = 0; e < E_local; ++e) h.off[e + 1] = h.off[e] + (h.cnt[e] + bm - 1) / bm * bm;
  h.total = h.off[E_local];
  h.blk.assign(capacity / bm, -1);
  for (int e = 0; e < E_local; ++e)
    for (int row = h.off[e]; row < h.off[e + 1]; row += bm) h.blk[row / bm] = e;
  return h;
}
void expect_tables(const AlignResult& r, const HostTables& h, const char* what) {
  SCOPED_TRACE(what);
  EXPECT_EQ(r.meta[0], h.total);
  EXPECT_EQ(r.cnt, h.cnt);
  EXPECT_EQ(r.off, h.off);
  EXPECT_EQ(r.blk, h.blk);
}

TEST(CudaAuxKernels, ManyBlockAlignmentMatchesOneBlock) {
  SKIP_WITHOUT_GPU();
  for (const AlignCase c :
       {AlignCase{4096, 256, 256, 16, false}, AlignCase{65541, 256, 256, 64, false},
        AlignCase{20000, 64, 16, 128, true}, AlignCase{300000, 1024, 1024, 32, false},
        AlignCase{1500, 8, 8, 128, true}}) {
    SCOPED_TRACE(::testing::Message() << "pairs " << c.num_valid << " E " << c.E_global << "/"
                                      << c.E_local << " bm " << c.bm);
    std::mt19937 rng(c.num_valid);
    const RandomIds ri = random_ids(c.num_valid, c.E_global, c.E_local, c.map, rng);
    const std::vector<int32_t>& ids = ri.ids;
    const auto local = [&](int32_t gid) { return ri.local(gid); };
    const Tensor dids = to_device(ids, DType::kI32), dmap = to_device(ri.map, DType::kI32);
    const int capacity = sorted_capacity(c.num_valid, c.E_local, c.bm);
    const AlignResult one = run_align(dids, c.map ? &dmap : nullptr, c, capacity, INT64_MAX);
    const AlignResult many = run_align(dids, c.map ? &dmap : nullptr, c, capacity, 0);
    const HostTables host = host_tables(ri, c.E_local, c.bm, capacity);
    expect_tables(one, host, "one block against the host");
    expect_tables(many, host, "many blocks against the host");
    EXPECT_EQ(many.meta[0], one.meta[0]);
    EXPECT_EQ(many.cnt, one.cnt);
    EXPECT_EQ(many.off, one.off);
    EXPECT_EQ(many.blk, one.blk);
    for (const AlignResult* r : {&one, &many}) {
      SCOPED_TRACE(r == &one ? "one block" : "many blocks");
      const int total = r->meta[0];
      std::vector<int> seen(c.num_valid, 0);
      int64_t bad = 0;
      for (int e = 0; e < c.E_local; ++e) {
        for (int p = r->off[e]; p < r->off[e + 1]; ++p) {
          const int32_t i = r->sorted[p];
          if (p < r->off[e] + r->cnt[e]) {
            const bool ok = i >= 0 && i < c.num_valid && local(ids[i]) == e && r->ppos[i] == p;
            if (!ok && bad++ < 5) ADD_FAILURE() << "expert " << e << " row " << p << " holds " << i;
            if (ok) ++seen[i];
          } else if (i != c.num_valid && bad++ < 5) {
            ADD_FAILURE() << "padding row " << p << " holds " << i;
          }
        }
      }
      for (int p = total; p < capacity; ++p)
        if (r->sorted[p] != -1 && bad++ < 5)
          ADD_FAILURE() << "row " << p << " past the end written";
      for (int i = 0; i < c.num_valid; ++i) {
        const int want = local(ids[i]) >= 0 ? 1 : 0;
        if ((seen[i] != want || (!want && r->ppos[i] != -1)) && bad++ < 5)
          ADD_FAILURE() << "pair " << i << " placed " << seen[i] << " times, pair_pos "
                        << r->ppos[i];
      }
      EXPECT_EQ(bad, 0);
    }
  }
}

// ---- quantisers ---------------------------------------------------------------------------------

// Sorted rows over `tokens` tokens with topk pairs each, aligned to 16 with padding rows, gathered
// (source row = sorted id / topk), a few pairs dropped.
struct SortedRows {
  std::vector<int32_t> sorted;
  int32_t num_valid = 0, rows = 0;
  Tensor dsorted, dmeta;
  cuda::RowSet set(bool gathered) const {
    return cuda::RowSet{static_cast<const int32_t*>(dsorted.data()),
                        static_cast<const int32_t*>(dmeta.data()), rows, num_valid,
                        gathered ? 2 : 0};
  }
};

SortedRows make_rows(int tokens, std::mt19937& rng) {
  SortedRows r;
  r.num_valid = tokens * 2;
  std::vector<int32_t> pairs(r.num_valid);
  for (int i = 0; i < r.num_valid; ++i) pairs[i] = i;
  std::shuffle(pairs.begin(), pairs.end(), rng);
  std::uniform_int_distribution<int> chunk(0, 40);
  for (size_t k = 0; k < pairs.size();) {
    const int n = std::min<int>(chunk(rng), static_cast<int>(pairs.size() - k));
    for (int j = 0; j < n; ++j) r.sorted.push_back(pairs[k + j]);
    k += n;
    while (r.sorted.size() % 16) r.sorted.push_back(r.num_valid);
  }
  const int used = static_cast<int>(r.sorted.size());
  r.sorted.resize(used + 32, r.num_valid);  // capacity above the used rows
  r.rows = static_cast<int32_t>(r.sorted.size());
  r.dsorted = to_device(r.sorted, DType::kI32);
  r.dmeta = to_device(std::vector<int32_t>{used, 0, 0, 0}, DType::kI32);
  return r;
}

// Random values with a spread wide enough that static scales saturate some of them.
std::vector<float> randn(size_t n, std::mt19937& rng, float sigma) {
  std::normal_distribution<float> nd(0.0f, sigma);
  std::vector<float> v(n);
  for (auto& x : v) x = nd(rng);
  return v;
}

// src (rows, cols) with row stride `stride` (>= cols), as bf16 or f32 on the device.
Tensor strided(const std::vector<float>& v, int rows, int cols, int stride, bool f32) {
  if (f32) {
    std::vector<float> s(size_t(rows) * stride, 0.0f);
    for (int r = 0; r < rows; ++r)
      for (int c = 0; c < cols; ++c) s[size_t(r) * stride + c] = v[size_t(r) * cols + c];
    return to_device(s, DType::kF32);
  }
  std::vector<uint16_t> s(size_t(rows) * stride, 0);
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < cols; ++c)
      s[size_t(r) * stride + c] = numerics::float_to_bf16(v[size_t(r) * cols + c]);
  return to_device(s, DType::kBF16);
}

TEST(CudaAuxKernels, VectorisedQuantisersMatchScalar) {
  SKIP_WITHOUT_GPU();
  const int tokens = 150;
  for (const int cols : {640, 648})  // 16 and 8 columns per thread
    for (const bool f32 : {false, true}) {
      for (const cuda::AQuant kind : {cuda::AQuant::kTokenDynamic, cuda::AQuant::kTensorStatic,
                                      cuda::AQuant::kTensorDynamic}) {
        SCOPED_TRACE(::testing::Message()
                     << (f32 ? "f32" : "bf16") << " kind " << int(kind) << " cols " << cols);
        std::mt19937 rng(11 + int(kind) + 10 * f32);
        SortedRows rows = make_rows(tokens, rng);
        const std::vector<float> x = randn(size_t(tokens) * cols, rng, 3.0f);
        const std::vector<float> w = randn(size_t(tokens), rng, 1.0f);  // router weight per token
        const Tensor dw = to_device(w, DType::kF32);
        const Tensor dscale = to_device(std::vector<float>{0.004f}, DType::kF32);
        Tensor amax = poisoned(16);
        std::vector<std::vector<uint8_t>> q;
        std::vector<std::vector<float>> s;
        for (const int stride : {cols, cols + 1}) {  // aligned: eight columns per thread; scalar
          const Tensor src = strided(x, tokens, cols, stride, f32);
          Tensor dq = poisoned(int64_t(rows.rows) * cols), ds = poisoned(int64_t(rows.rows) * 4);
          cuda::QuantSpec spec;
          spec.kind = kind;
          spec.static_scale = static_cast<const float*>(dscale.data());
          spec.amax_ws = static_cast<unsigned*>(amax.data());
          EXPECT_EQ(cuda::quant_rows_vectorised(src.data(), f32, stride, cols,
                                                static_cast<uint8_t*>(dq.data()), cols),
                    stride == cols);
          cuda::launch_quant(spec, src.data(), f32, stride, rows.set(true),
                             cuda::RowScale{static_cast<const float*>(dw.data())}, cols,
                             cuda::QuantOut{static_cast<uint8_t*>(dq.data()), cols,
                                            static_cast<float*>(ds.data()), 1},
                             nullptr);
          ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
          q.push_back(to_host<uint8_t>(dq));
          s.push_back(to_host<float>(ds));
        }
        EXPECT_EQ(q[0], q[1]) << "codes differ";
        EXPECT_EQ(std::memcmp(s[0].data(), s[1].data(), s[0].size() * 4), 0) << "scales differ";
        int64_t saturated = 0, written = 0;
        for (const uint8_t b : q[0]) {
          saturated += (b & 0x7F) == 0x7E;
          written += b != 0xFF;
        }
        EXPECT_GT(written, int64_t(tokens) * 2 * cols * 9 / 10);
        if (kind == cuda::AQuant::kTensorStatic) {
          EXPECT_GT(saturated, 0);
        }
      }
    }
}

TEST(CudaAuxKernels, FusedActivationQuantisationMatchesTwoKernels) {
  SKIP_WITHOUT_GPU();
  struct Act {
    cuda::Act act;
    bool limit, fp32_silu;
  };
  for (const Act a : {Act{cuda::Act::kSilu, false, false}, Act{cuda::Act::kSilu, true, false},
                      Act{cuda::Act::kSilu, false, true}, Act{cuda::Act::kGelu, false, false},
                      Act{cuda::Act::kSwigluOaiUninterleave, false, false}}) {
    for (const cuda::AQuant kind : {cuda::AQuant::kTokenDynamic, cuda::AQuant::kTensorStatic})
      for (const int I : {384, 392}) {  // 16 and 8 columns per thread (per-tensor)
        const int N = 2 * I;
        SCOPED_TRACE(::testing::Message()
                     << "act " << int(a.act) << " limit " << a.limit << " fp32_silu " << a.fp32_silu
                     << " kind " << int(kind) << " I " << I);
        std::mt19937 rng(5 + int(a.act));
        SortedRows rows = make_rows(100, rng);
        const Tensor y1 = strided(randn(size_t(rows.rows) * N, rng, 2.5f), rows.rows, N, N, false);
        const cuda::ActParams ap = testing::act_params_for_test(a.act, a.limit, a.fp32_silu);
        const bool h_f32 = a.fp32_silu;
        const Tensor dscale = to_device(std::vector<float>{0.01f}, DType::kF32);
        cuda::QuantSpec spec;
        spec.kind = kind;
        spec.static_scale = static_cast<const float*>(dscale.data());
        ASSERT_TRUE(cuda::act_quant_fusable(spec, I, ap));
        const cuda::RowSet rs = rows.set(false);
        // two kernels: h with an unaligned stride (the scalar quantiser reads it)
        const int hs = I + 1;
        Tensor h = poisoned(int64_t(rows.rows) * hs * (h_f32 ? 4 : 2));
        Tensor q0 = poisoned(int64_t(rows.rows) * I), s0 = poisoned(int64_t(rows.rows) * 4);
        Tensor q1 = poisoned(int64_t(rows.rows) * I), s1 = poisoned(int64_t(rows.rows) * 4);
        cuda::launch_activation(y1.data(), false, N, rs, I, ap, h.data(), h_f32, hs, nullptr);
        EXPECT_FALSE(cuda::quant_rows_vectorised(h.data(), h_f32, hs, I,
                                                 static_cast<uint8_t*>(q0.data()), I));
        cuda::launch_quant(
            spec, h.data(), h_f32, hs, rs, cuda::RowScale{}, I,
            cuda::QuantOut{static_cast<uint8_t*>(q0.data()), I, static_cast<float*>(s0.data()), 1},
            nullptr);
        cuda::launch_act_quant(
            static_cast<const uint16_t*>(y1.data()), N, rs, I, ap, h_f32, spec,
            cuda::QuantOut{static_cast<uint8_t*>(q1.data()), I, static_cast<float*>(s1.data()), 1},
            nullptr);
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        const auto hq0 = to_host<uint8_t>(q0), hq1 = to_host<uint8_t>(q1);
        const auto hs0 = to_host<float>(s0), hs1 = to_host<float>(s1);
        EXPECT_EQ(hq0, hq1) << "codes differ";
        EXPECT_EQ(std::memcmp(hs0.data(), hs1.data(), hs0.size() * 4), 0) << "scales differ";
        int64_t written = 0;
        for (const uint8_t b : hq1) written += b != 0xFF;
        EXPECT_GT(written, int64_t(rows.num_valid) * I * 9 / 10);
      }
  }
}

// ---- top-k sum ----------------------------------------------------------------------------------

TEST(CudaAuxKernels, VectorisedTopkSumMatchesScalar) {
  SKIP_WITHOUT_GPU();
  const int M = 77, topk = 6, H = 1032, E = 16;
  for (const bool y_f32 : {false, true}) {
    for (const bool o_f32 : {false, true}) {
      for (const bool map : {false, true}) {
        SCOPED_TRACE(::testing::Message()
                     << "y2 f32 " << y_f32 << " out f32 " << o_f32 << " map " << map);
        std::mt19937 rng(3 + 2 * y_f32 + o_f32 + 4 * map);
        std::uniform_int_distribution<int> pick(-1, E - 1);
        std::vector<int32_t> ids(size_t(M) * topk);
        for (auto& v : ids) v = pick(rng);
        std::vector<int32_t> emap(E);
        for (int e = 0; e < E; ++e) emap[e] = e % 3 == 0 ? -1 : e / 2;
        const Tensor dids = to_device(ids, DType::kI32), dmap = to_device(emap, DType::kI32);
        const std::vector<float> yv = randn(size_t(M) * topk * H, rng, 4.0f);
        const Tensor y2 = strided(yv, M * topk, H, H, y_f32);
        const int ob = o_f32 ? 4 : 2;
        std::vector<std::vector<uint8_t>> outs;
        for (const int shift : {0, 1}) {  // aligned: 16-byte kernel; shifted by one element: scalar
          Tensor out = poisoned((int64_t(M) * H + 8) * ob);
          uint8_t* o = static_cast<uint8_t*>(out.data()) + shift * ob;
          EXPECT_EQ(cuda::moe_sum_vectorised(y2.data(), o, H, topk), shift == 0);
          cuda::launch_moe_sum(y2.data(), y_f32, static_cast<const int32_t*>(dids.data()),
                               map ? static_cast<const int32_t*>(dmap.data()) : nullptr, E, E, M,
                               topk, H, o, o_f32, nullptr);
          ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
          std::vector<uint8_t> h = to_host<uint8_t>(out);
          outs.emplace_back(h.begin() + shift * ob, h.begin() + shift * ob + int64_t(M) * H * ob);
        }
        EXPECT_EQ(outs[0], outs[1]);
        // the sum computed here (spec/numerics.md §6): f32 over the computed slots in slot order,
        // one rounding
        std::vector<uint8_t> want(size_t(M) * H * ob);
        for (int t = 0; t < M; ++t)
          for (int c = 0; c < H; ++c) {
            float acc = 0.0f;
            for (int j = 0; j < topk; ++j) {
              const int32_t gid = ids[size_t(t) * topk + j];
              const int e = gid < 0 || gid >= E ? -1 : (map ? emap[gid] : gid);
              if (e < 0) continue;
              const float y = yv[(size_t(t) * topk + j) * H + c];
              acc += y_f32 ? y : numerics::bf16_round(y);
            }
            const size_t at = (size_t(t) * H + c) * ob;
            if (o_f32) {
              std::memcpy(&want[at], &acc, 4);
            } else {
              const uint16_t b = numerics::float_to_bf16(acc);
              std::memcpy(&want[at], &b, 2);
            }
          }
        EXPECT_TRUE(outs[0] == want) << "the device sum differs from the host's";
        int64_t nonzero = 0;
        for (const uint8_t b : outs[0]) nonzero += b != 0 && b != 0xFF;
        EXPECT_GT(nonzero, int64_t(M) * H * ob / 2);
      }
    }
  }
}

}  // namespace
}  // namespace fp8moe
