// The generic grouped FP8 GEMM of the fused MoE (spec/numerics.md §4 and §6), on mma.sync
// m16n8k32 e4m3 (sm_89+). One CTA computes a 64x64 tile of one expert over the sorted, padded row
// layout of moe_align: A rows are gathered (GEMM1: token = sorted_id / topk) or contiguous (GEMM2:
// the sorted intermediate), B rows are the expert's weight rows (n) with K contiguous.
//
// Scales: with block weights and group activations every BK tile is promoted into the fp32
// accumulator as (partial * s_a[row, kb]) * s_w[n, kb], like the Triton kernel; otherwise the
// partials are summed unscaled (promoted every BK only to keep the fp32 accumulation exact) and the
// result is multiplied by s_a and then s_w at the end.
//
// Epilogue: + bias[e, n], * router weight (GEMM2), rounded once to bf16, stored at the sorted row
// (GEMM1) or scattered to the flat (token, slot) row (GEMM2).
#pragma once

#include "cuda_common.cuh"
#include "moe_params.hpp"

namespace fp8moe::cuda {

constexpr int kGemmThreads = 128;
constexpr int kGemmStages = 3;

template <int BK>
constexpr int gemm_smem_bytes() {
  return kGemmStages * (kGemmBM + kGemmBN) * (BK + 16) + kGemmBM * 8 + kGemmBM * 4;
}

// Scale of weight row n of expert e for k-block kb.
__device__ __forceinline__ float weight_scale(const WeightSide& w, int e, int n, int N, int k) {
  const float* s = w.scale + int64_t(e) * w.scale_e_stride;
  switch (static_cast<WScale>(w.scale_kind)) {
    case WScale::kBlock:
      return s[int64_t(n / w.bn) * w.scale_n_stride + k / w.bk];
    case WScale::kTensor:
      return s[0];
    case WScale::kTensorPerShard:
      return s[n < N / 2 ? 0 : 1];
    default:
      return s[n];
  }
}

template <int BK, bool kAligned>
__global__ void __launch_bounds__(kGemmThreads)
    moe_gemm_mma_kernel(const __grid_constant__ GemmArgs p) {
  constexpr int BM = kGemmBM, BN = kGemmBN;
  constexpr int kRow = BK + 16;  // padded smem row (bytes): conflict-free ldmatrix
  constexpr int kChunks = BK / 16;
  extern __shared__ __align__(128) uint8_t smem[];
  uint8_t* sA = smem;
  uint8_t* sB = smem + kGemmStages * BM * kRow;
  int64_t* a_off = reinterpret_cast<int64_t*>(sB + kGemmStages * BN * kRow);
  int32_t* out_row = reinterpret_cast<int32_t*>(a_off + BM);

  const int m_blk = blockIdx.y;
  const int n0 = blockIdx.x * BN;
  if (m_blk * BM >= *p.rows.num_rows_ptr) return;
  const int e = p.rows.expert_blk[m_blk];
  if (e < 0) return;
  const int tid = threadIdx.x;
  for (int r = tid; r < BM; r += kGemmThreads) {
    const int pos = m_blk * BM + r;
    const int id = p.rows.sorted_ids[pos];
    const bool valid = id < p.rows.num_valid;
    const int64_t arow = p.a_gather ? id / p.rows.topk : pos;
    a_off[r] = valid ? arow * p.a_stride : -1;
    out_row[r] = valid ? (p.out_scatter ? id : pos) : -1;
  }
  __syncthreads();

  const uint8_t* wbase = p.w.w + int64_t(e) * p.N * p.K;
  const int num_k_tiles = static_cast<int>(ceil_div(p.K, BK));

  auto load_tile = [&](int stage, int kt) {
    const int k0 = kt * BK;
    uint8_t* a_dst = sA + stage * BM * kRow;
    uint8_t* b_dst = sB + stage * BN * kRow;
    for (int c = tid; c < BM * kChunks; c += kGemmThreads) {
      const int r = c / kChunks, cc = c % kChunks;
      const int k = k0 + cc * 16;
      const int64_t off = a_off[r];
      if constexpr (kAligned) {
        const int bytes = (off < 0 || k >= p.K) ? 0 : min(16, p.K - k);
        cp_async_16(a_dst + r * kRow + cc * 16, p.a + (bytes ? off + k : 0), bytes);
      } else {
        for (int i = 0; i < 16; ++i)
          a_dst[r * kRow + cc * 16 + i] = (off >= 0 && k + i < p.K) ? p.a[off + k + i] : 0;
      }
    }
    for (int c = tid; c < BN * kChunks; c += kGemmThreads) {
      const int r = c / kChunks, cc = c % kChunks;
      const int k = k0 + cc * 16;
      const int n = n0 + r;
      if constexpr (kAligned) {
        const int bytes = (n >= p.N || k >= p.K) ? 0 : min(16, p.K - k);
        cp_async_16(b_dst + r * kRow + cc * 16, wbase + (bytes ? int64_t(n) * p.K + k : 0), bytes);
      } else {
        for (int i = 0; i < 16; ++i)
          b_dst[r * kRow + cc * 16 + i] =
              (n < p.N && k + i < p.K) ? wbase[int64_t(n) * p.K + k + i] : 0;
      }
    }
  };

  const int warp = tid >> 5, lane = tid & 31;
  const int wm = warp >> 1, wn = warp & 1;  // 2x2 warps, 32x32 each
  float total[2][4][4] = {};
  float part[2][4][4];

  // rows / cols owned by this thread (for scales and the epilogue)
  int my_rows[2][2];
  int my_cols[4][2];
#pragma unroll
  for (int mi = 0; mi < 2; ++mi) {
    my_rows[mi][0] = wm * 32 + mi * 16 + (lane >> 2);
    my_rows[mi][1] = my_rows[mi][0] + 8;
  }
#pragma unroll
  for (int ni = 0; ni < 4; ++ni) {
    my_cols[ni][0] = n0 + wn * 32 + ni * 8 + (lane & 3) * 2;
    my_cols[ni][1] = my_cols[ni][0] + 1;
  }
  // A-scale row index (the quantised activation row)
  int64_t a_srow[2][2];
#pragma unroll
  for (int mi = 0; mi < 2; ++mi)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t off = a_off[my_rows[mi][h]];
      a_srow[mi][h] = off < 0 ? -1 : off / p.a_stride;
    }

#pragma unroll
  for (int s = 0; s < kGemmStages - 1; ++s) {
    if (s < num_k_tiles) load_tile(s, s);
    cp_async_commit();
  }

  for (int kt = 0; kt < num_k_tiles; ++kt) {
    cp_async_wait<kGemmStages - 2>();
    __syncthreads();
    {
      const int nk = kt + kGemmStages - 1;
      if (nk < num_k_tiles) load_tile(nk % kGemmStages, nk);
      cp_async_commit();
    }
    const int stage = kt % kGemmStages;
    const uint8_t* a_s = sA + stage * BM * kRow;
    const uint8_t* b_s = sB + stage * BN * kRow;
#pragma unroll
    for (int mi = 0; mi < 2; ++mi)
#pragma unroll
      for (int ni = 0; ni < 4; ++ni)
#pragma unroll
        for (int r = 0; r < 4; ++r) part[mi][ni][r] = 0.0f;
#pragma unroll
    for (int ks = 0; ks < BK / 32; ++ks) {
      uint32_t af[2][4];
#pragma unroll
      for (int mi = 0; mi < 2; ++mi) {
        const int row = wm * 32 + mi * 16 + (lane & 15);
        const int col = ks * 32 + (lane >> 4) * 16;
        ldmatrix_x4(af[mi], smem_u32(a_s + row * kRow + col));
      }
      uint32_t bf[4][2];
#pragma unroll
      for (int nj = 0; nj < 2; ++nj) {
        // matrices: (n 0-7, k 0-15), (n 0-7, k 16-31), (n 8-15, k 0-15), (n 8-15, k 16-31)
        const int nrow = wn * 32 + nj * 16 + (lane & 7) + ((lane >> 4) << 3);
        const int col = ks * 32 + ((lane >> 3) & 1) * 16;
        uint32_t r4[4];
        ldmatrix_x4(r4, smem_u32(b_s + nrow * kRow + col));
        bf[nj * 2][0] = r4[0];
        bf[nj * 2][1] = r4[1];
        bf[nj * 2 + 1][0] = r4[2];
        bf[nj * 2 + 1][1] = r4[3];
      }
#pragma unroll
      for (int mi = 0; mi < 2; ++mi)
#pragma unroll
        for (int ni = 0; ni < 4; ++ni) mma_e4m3_16832(part[mi][ni], af[mi], bf[ni]);
    }
    // promote
    if (p.promote_block) {
      const int k0 = kt * BK;
      float sa[2][2], sw[4][2];
#pragma unroll
      for (int mi = 0; mi < 2; ++mi)
#pragma unroll
        for (int h = 0; h < 2; ++h)
          sa[mi][h] =
              a_srow[mi][h] < 0 ? 0.0f : p.a_scale[a_srow[mi][h] * p.a_scale_stride + k0 / p.gk];
#pragma unroll
      for (int ni = 0; ni < 4; ++ni)
#pragma unroll
        for (int h = 0; h < 2; ++h)
          sw[ni][h] = my_cols[ni][h] < p.N ? weight_scale(p.w, e, my_cols[ni][h], p.N, k0) : 0.0f;
#pragma unroll
      for (int mi = 0; mi < 2; ++mi)
#pragma unroll
        for (int ni = 0; ni < 4; ++ni) {
          total[mi][ni][0] += part[mi][ni][0] * sa[mi][0] * sw[ni][0];
          total[mi][ni][1] += part[mi][ni][1] * sa[mi][0] * sw[ni][1];
          total[mi][ni][2] += part[mi][ni][2] * sa[mi][1] * sw[ni][0];
          total[mi][ni][3] += part[mi][ni][3] * sa[mi][1] * sw[ni][1];
        }
    } else {
#pragma unroll
      for (int mi = 0; mi < 2; ++mi)
#pragma unroll
        for (int ni = 0; ni < 4; ++ni)
#pragma unroll
          for (int r = 0; r < 4; ++r) total[mi][ni][r] += part[mi][ni][r];
    }
  }
  cp_async_wait<0>();

  // epilogue
#pragma unroll
  for (int mi = 0; mi < 2; ++mi)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = my_rows[mi][h];
      const int orow = out_row[r];
      if (orow < 0) continue;
      float sa = 1.0f;
      if (!p.promote_block) {
        const int64_t ar = a_srow[mi][h];
        sa = p.a_scale_kind == static_cast<int>(AScale::kTensor) ? p.a_scale[0] : p.a_scale[ar];
      }
      const float rw = p.topk_w ? p.topk_w[orow] : 1.0f;
#pragma unroll
      for (int ni = 0; ni < 4; ++ni) {
        float v[2];
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const int n = my_cols[ni][c];
          float acc = total[mi][ni][h * 2 + c];
          if (!p.promote_block && n < p.N) acc = acc * sa * weight_scale(p.w, e, n, p.N, 0);
          if (p.w.bias && n < p.N) {
            const int64_t bi = int64_t(e) * p.N + n;
            acc += p.w.bias_bf16 ? bf16_bits_to_float(static_cast<const uint16_t*>(p.w.bias)[bi])
                                 : static_cast<const float*>(p.w.bias)[bi];
          }
          if (p.topk_w) acc *= rw;
          v[c] = acc;
        }
        const int n = my_cols[ni][0];
        if (p.out_f32) {
          float* of = static_cast<float*>(p.out) + int64_t(orow) * p.out_stride + n;
          if (n < p.N) of[0] = v[0];
          if (n + 1 < p.N) of[1] = v[1];
          continue;
        }
        uint16_t* o = static_cast<uint16_t*>(p.out) + int64_t(orow) * p.out_stride + n;
        if (n + 1 < p.N && ((reinterpret_cast<uintptr_t>(o) & 3) == 0)) {
          *reinterpret_cast<uint32_t*>(o) =
              uint32_t(float_to_bf16_bits(v[0])) | (uint32_t(float_to_bf16_bits(v[1])) << 16);
        } else {
          if (n < p.N) o[0] = float_to_bf16_bits(v[0]);
          if (n + 1 < p.N) o[1] = float_to_bf16_bits(v[1]);
        }
      }
    }
}

}  // namespace fp8moe::cuda
