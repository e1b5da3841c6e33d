// wgmma grouped GEMMs of the fused MoE for large batches (sm_90a). One CTA computes a 64-row tile
// of one expert over the sorted, padded row layout of moe_align, with three warpgroups:
//   WG0  producer: TMA (128-byte swizzle) for the expert's weight rows, cp.async for the 64
//        activation rows (gathered by token for GEMM1) written in the same swizzle, a 4-stage ring
//        of mbarriers;
//   WG1, WG2  math: wgmma m64n128k32 e4m3 from shared memory, each on its own 128 weight rows
//   (GEMM1:
//        the gate rows and the matching up rows of 128 h-columns; GEMM2: 256 output columns), every
//        128-wide k-block promoted into fp32 with its scales (block schemes) or summed (per-tensor
//        and per-channel, scaled at the end).
// GEMM1's epilogue is the whole middle of the layer: bias, rounding to bf16, the activation
// (gate from WG1, up from WG2 through shared memory), and the quantisation of h (per 1 x gk group,
// or with a static scale) straight into GEMM2's input layout. GEMM2's epilogue applies the bias and
// the router weight, rounds to bf16 and scatters rows to the (token, slot) layout through a
// shared-memory staging tile, with 16-byte stores.
#pragma once

#include "cuda_common.cuh"
#include "moe_params.hpp"
#include "smxx_fp8_quant.cuh"

namespace fp8moe::cuda {

constexpr int kWgBM = 64;
constexpr int kWgBNw = 128;  // columns per math warpgroup
constexpr int kWgStages = 4;
constexpr int kWgThreads = 384;
constexpr int kWgAStage = kWgBM * 128;       // 8 KB
constexpr int kWgBStage = 2 * kWgBNw * 128;  // 32 KB
constexpr int kWgStageBytes = kWgAStage + kWgBStage;
constexpr int kWgEpiBytes = kWgBM * kWgBNw * 4;  // 32 KB
constexpr int kWgSmemBytes = 1024 + kWgStages * kWgStageBytes + kWgEpiBytes + 256;

// K-major operand with the 128-byte swizzle: 8-row groups 1024 bytes apart.
__device__ __forceinline__ uint64_t wg_desc(const void* smem) {
  const uint64_t addr = smem_u32(smem);
  uint64_t d = 0;
  d |= (addr & 0x3FFFFull) >> 4;   // start address
  d |= uint64_t(1) << 16;          // leading byte offset (unused with swizzle)
  d |= uint64_t(1024 >> 4) << 32;  // stride byte offset
  d |= uint64_t(1) << 62;          // 128-byte swizzle
  return d;
}

__device__ __forceinline__ void wg_fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wg_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wg_wait0() {
  asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
}
__device__ __forceinline__ void wg_reg_fence(float (&d)[64]) {
#pragma unroll
  for (int i = 0; i < 64; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
__device__ __forceinline__ void named_sync(int id, int count) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}

// D(64x128 f32, per warpgroup) (+)= A(64x32 e4m3, smem desc) * B(128x32 e4m3, smem desc)^T.
// scale_d = 0 overwrites D (first k-step of a k-block), 1 accumulates.
__device__ __forceinline__ void wgmma_m64n128k32_e4m3(float (&d)[64], uint64_t desc_a,
                                                      uint64_t desc_b, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, "
      "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, "
      "%38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, "
      "%56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
        "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
        "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]),
        "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]),
        "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),
        "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]),
        "+f"(d[63])
      : "l"(desc_a), "l"(desc_b), "r"(scale_d));
}

__device__ __forceinline__ float wg_weight_scale(const WeightSide& w, int e, int n, int N, int k) {
  const float* s = w.scale + int64_t(e) * w.scale_e_stride;
  switch (static_cast<WScale>(w.scale_kind)) {
    case WScale::kBlock:
      return __ldg(s + int64_t(n / w.bn) * w.scale_n_stride + k / w.bk);
    case WScale::kTensor:
      return __ldg(s);
    case WScale::kTensorPerShard:
      return __ldg(s + (n < N / 2 ? 0 : 1));
    default:
      return __ldg(s + n);
  }
}

// Tile t of a launch: m_blk fastest, so the CTAs running together share the n-tile (the expert's
// weight slice stays in L2 while several 64-row blocks of that expert use it).
struct WgTile {
  int m_blk, nt, e;
  bool valid;
};
__device__ __forceinline__ WgTile wg_tile(const WgArgs& p, int t, int n_mblk) {
  WgTile w;
  w.m_blk = t % n_mblk;
  w.nt = t / n_mblk;
  w.e = -1;
  w.valid = w.m_blk * kWgBM < *p.rows.num_rows_ptr;
  if (w.valid) {
    w.e = p.rows.expert_blk[w.m_blk];
    w.valid = w.e >= 0;
  }
  return w;
}

// Persistent: each CTA walks tiles blockIdx.x, blockIdx.x + gridDim.x, ...; the shared-memory ring
// (and its phases) runs on across tiles, so the producer streams the next tile while the math
// warpgroups finish the previous one.
// kK32: promote after every k32 wgmma instead of every 128-wide k-block. Hopper's FP8 wgmma adds
// inside the tensor core with less than fp32 precision (DeepSeek-V3 report: ~14 bits), so a
// 128-deep partial can round; promoting every 32 keeps more bits, at the cost of four times the
// promotion FMAs.
template <bool kGemm2, bool kK32>
__global__ void __launch_bounds__(kWgThreads, 1)
    moe_gemm_wgmma_kernel(const __grid_constant__ WgArgs p,
                          const __grid_constant__ CUtensorMap tm_w,
                          const __grid_constant__ CUtensorMap tm_a, int n_mblk, int n_tiles_n) {
  extern __shared__ uint8_t wg_smem_raw[];
  // the first 1024-byte boundary by indexing (not an integer cast): derived pointers stay shared
  uint8_t* smem = wg_smem_raw + ((1024u - (smem_u32(wg_smem_raw) & 1023u)) & 1023u);
  float* epi = reinterpret_cast<float*>(smem + kWgStages * kWgStageBytes);
  uint64_t* full = reinterpret_cast<uint64_t*>(reinterpret_cast<uint8_t*>(epi) + kWgEpiBytes);
  uint64_t* empty = full + kWgStages;
  __shared__ int32_t s_row[2][kWgBM];  // per math warpgroup: output row of each tile row

  const int tid = threadIdx.x;
  const int wg = tid / 128, wtid = tid % 128;
  if (tid == 0) {
    for (int i = 0; i < kWgStages; ++i) {
      mbar_init(&full[i], 1);
      mbar_init(&empty[i], 2);
    }
    fence_barrier_init();
  }
  __syncthreads();
  const int num_kb = p.K / 128;
  const int n_tiles = n_mblk * n_tiles_n;
  auto brows = [&](const WgTile& w, int(&br)[2]) {
    if (kGemm2) {
      br[0] = w.e * p.N + w.nt * 256;
      br[1] = br[0] + 128;
    } else {
      br[0] = w.e * p.N + w.nt * 128;
      br[1] = w.e * p.N + p.I + w.nt * 128;
    }
  };
  // A rows are the sorted positions for both GEMMs (GEMM1's input was gathered into sorted order
  // when it was quantised); -1 for padding rows.
  auto a_offset = [&](const WgTile& w, int r) -> int64_t {
    const int pos = w.m_blk * kWgBM + r;
    const int id = p.rows.sorted_ids[pos];
    if (id >= p.rows.num_valid) return -1;
    return int64_t(pos) * p.a_stride;
  };

  if (wg == 0) {
    // ================================ producer: one thread, three TMA loads per k-block =========
    if (wtid != 0) return;
    int it = 0;  // k-blocks issued so far (ring position)
    for (int t = blockIdx.x; t < n_tiles; t += gridDim.x) {
      const WgTile w = wg_tile(p, t, n_mblk);
      if (!w.valid) continue;
      int br[2];
      brows(w, br);
      for (int kb = 0; kb < num_kb; ++kb, ++it) {
        const int s = it % kWgStages;
        const uint32_t ph = (it / kWgStages) & 1;
        mbar_wait(&empty[s], ph ^ 1);
        uint8_t* a_dst = smem + s * kWgStageBytes;
        uint8_t* b_dst = a_dst + kWgAStage;
        mbar_arrive_expect_tx(&full[s], kWgAStage + kWgBStage);
        tma_load_2d(a_dst, &tm_a, &full[s], kb * 128, w.m_blk * kWgBM);
        tma_load_2d(b_dst, &tm_w, &full[s], kb * 128, br[0]);
        tma_load_2d(b_dst + kWgBStage / 2, &tm_w, &full[s], kb * 128, br[1]);
      }
    }
    return;
  }

  // ================================== math warpgroups =========================================
  const int mw = wg - 1;  // 0: gate / first 128 columns, 1: up / next 128 columns
  const int warp = wtid / 32, lane = wtid % 32;
  const int r0 = warp * 16 + (lane >> 2);  // my rows: r0, r0 + 8
  int it = 0;
  for (int t = blockIdx.x; t < n_tiles; t += gridDim.x) {
    const WgTile w = wg_tile(p, t, n_mblk);
    if (!w.valid) continue;
    const int e = w.e, nt = w.nt;
    float total[64], part[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) total[i] = 0.0f;
    int64_t srow[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t off = a_offset(w, r0 + h * 8);
      srow[h] = off < 0 ? -1 : off / p.a_stride;
    }
    const int n_base = kGemm2 ? nt * 256 + mw * 128 : (mw == 0 ? nt * 128 : p.I + nt * 128);
    // scales of k-block kb (block schemes), fetched one k-block ahead
    auto load_scales = [&](int kb, float& a0, float& a1, float& ww) {
      a0 = srow[0] < 0 ? 0.0f : __ldg(p.a_scale + srow[0] * p.a_scale_stride + kb * 128 / p.gk);
      a1 = srow[1] < 0 ? 0.0f : __ldg(p.a_scale + srow[1] * p.a_scale_stride + kb * 128 / p.gk);
      ww = wg_weight_scale(p.w, e, n_base, p.N, kb * 128);
    };
    float sa0 = 1.0f, sa1 = 1.0f, sw = 1.0f;
    if (p.block) load_scales(0, sa0, sa1, sw);
    for (int kb = 0; kb < num_kb; ++kb, ++it) {
      const int s = it % kWgStages;
      const uint32_t ph = (it / kWgStages) & 1;
      mbar_wait(&full[s], ph);
      const uint8_t* a_s = smem + s * kWgStageBytes;
      const uint8_t* b_s = a_s + kWgAStage + mw * (kWgBStage / 2);
      const uint64_t da = wg_desc(a_s), db = wg_desc(b_s);
      wg_reg_fence(part);
      wg_fence();
      float na0 = 1.0f, na1 = 1.0f, nw = 1.0f;
      if constexpr (kK32) {
        if (p.block && kb + 1 < num_kb) load_scales(kb + 1, na0, na1, nw);
#pragma unroll
        for (int ks = 0; ks < 4; ++ks) {
          wg_reg_fence(part);
          wg_fence();
          wgmma_m64n128k32_e4m3(part, da + 2 * ks, db + 2 * ks, 0);
          wg_commit();
          wg_wait0();
          wg_reg_fence(part);
          if (p.block) {
#pragma unroll
            for (int j = 0; j < 16; ++j) {
              total[4 * j + 0] += part[4 * j + 0] * sa0 * sw;
              total[4 * j + 1] += part[4 * j + 1] * sa0 * sw;
              total[4 * j + 2] += part[4 * j + 2] * sa1 * sw;
              total[4 * j + 3] += part[4 * j + 3] * sa1 * sw;
            }
          } else {
#pragma unroll
            for (int i = 0; i < 64; ++i) total[i] += part[i];
          }
        }
        if (wtid == 0) mbar_arrive(&empty[s]);
        sa0 = na0;
        sa1 = na1;
        sw = nw;
      } else {
#pragma unroll
        for (int ks = 0; ks < 4; ++ks)
          wgmma_m64n128k32_e4m3(part, da + 2 * ks, db + 2 * ks, ks > 0);
        wg_commit();
        if (p.block && kb + 1 < num_kb) load_scales(kb + 1, na0, na1, nw);
        wg_wait0();
        wg_reg_fence(part);
        if (wtid == 0) mbar_arrive(&empty[s]);
        if (p.block) {
#pragma unroll
          for (int j = 0; j < 16; ++j) {
            total[4 * j + 0] += part[4 * j + 0] * sa0 * sw;
            total[4 * j + 1] += part[4 * j + 1] * sa0 * sw;
            total[4 * j + 2] += part[4 * j + 2] * sa1 * sw;
            total[4 * j + 3] += part[4 * j + 3] * sa1 * sw;
          }
          sa0 = na0;
          sa1 = na1;
          sw = nw;
        } else {
#pragma unroll
          for (int i = 0; i < 64; ++i) total[i] += part[i];
        }
      }
    }
    // per-tensor / per-channel: scale at the end, (acc * s_a) * s_w
    float sa_end[2] = {1.0f, 1.0f};
    if (!p.block) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        if (srow[h] < 0) {
          sa_end[h] = 0.0f;
        } else {
          sa_end[h] = p.a_scale_kind == static_cast<int>(AScale::kTensor)
                          ? __ldg(p.a_scale)
                          : __ldg(p.a_scale + srow[h]);
        }
      }
    }
    auto value = [&](int j, int h, int c) {
      const int n = n_base + 8 * j + 2 * (lane & 3) + c;
      if (n >= p.N) return 0.0f;  // GEMM2 tile past H (H % 256 == 128)
      float v = total[4 * j + 2 * h + c];
      if (!p.block) v = v * sa_end[h] * wg_weight_scale(p.w, e, n, p.N, 0);
      if (p.w.bias) {
        const int64_t bi = int64_t(e) * p.N + n;
        v += p.w.bias_bf16 ? bf16_bits_to_float(static_cast<const uint16_t*>(p.w.bias)[bi])
                           : static_cast<const float*>(p.w.bias)[bi];
      }
      return v;
    };

    if (!kGemm2) {
      // ---- GEMM1 epilogue: y1 rounded to bf16; up -> shared memory; the gate warpgroup computes
      //      h and quantises it straight into GEMM2's input ----
      named_sync(1, 256);  // the previous tile's readers of `epi` are done
      if (mw == 1) {
#pragma unroll
        for (int j = 0; j < 16; ++j)
#pragma unroll
          for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int c = 0; c < 2; ++c)
              epi[(r0 + 8 * h) * kWgBNw + 8 * j + 2 * (lane & 3) + c] =
                  round_act(p.ap, value(j, h, c));
      }
      named_sync(1, 256);
      if (mw == 1) continue;
      float hv[64];
#pragma unroll
      for (int j = 0; j < 16; ++j)
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
          for (int c = 0; c < 2; ++c) {
            const float g = round_act(p.ap, value(j, h, c));
            const float u = epi[(r0 + 8 * h) * kWgBNw + 8 * j + 2 * (lane & 3) + c];
            float v = act_gated(p.ap, g, u);
            if (!p.ap.fp32_silu) v = round_act(p.ap, v);
            hv[4 * j + 2 * h + c] = v;
          }
      const int hcol0 = nt * 128;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int pos = w.m_blk * kWgBM + r0 + 8 * h;
        const int row = srow[h] < 0 ? -1 : pos;  // sorted position
        float sc[4] = {1.0f, 1.0f, 1.0f, 1.0f};  // up to 4 groups of 32 columns
        if (p.aq2 == static_cast<int>(AQuant::kGroupDynamic)) {
          const int jpg = p.gk / 8;  // j-chunks (8 columns) per group
          for (int g = 0; g < 128 / p.gk; ++g) {
            float amax = 0.0f;
#pragma unroll
            for (int j = 0; j < 16; ++j)
              if (j / jpg == g)
                amax = fmaxf(amax, fmaxf(fabsf(hv[4 * j + 2 * h]), fabsf(hv[4 * j + 2 * h + 1])));
            amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
            amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
            sc[g] = group_scale(amax, p.ue8m0 != 0, p.min_scale2);
          }
          if (row >= 0 && (lane & 3) == 0)
            for (int g = 0; g < 128 / p.gk; ++g)
              p.sh[int64_t(row) * p.sh_stride + hcol0 / p.gk + g] = sc[g];
        }
        if (row < 0) continue;
        uint8_t* qrow = p.qh + int64_t(row) * p.I + hcol0;
        const float inv2 =
            p.aq2 == static_cast<int>(AQuant::kGroupDynamic) ? 1.0f : 1.0f / p.a2_scale[0];
#pragma unroll
        for (int j = 0; j < 16; ++j) {
          const float a = hv[4 * j + 2 * h], b = hv[4 * j + 2 * h + 1];
          uint16_t q2;
          if (p.aq2 == static_cast<int>(AQuant::kGroupDynamic)) {
            const float s = sc[(8 * j) / p.gk];
            q2 = float2_to_e4m3x2(a / s, b / s);
          } else {
            q2 = float2_to_e4m3x2(a * inv2, b * inv2);
          }
          *reinterpret_cast<uint16_t*>(qrow + 8 * j + 2 * (lane & 3)) = q2;
        }
      }
    } else {
      // ---- GEMM2 epilogue: bias, router weight, bf16, staged in shared memory, 16-byte stores
      // ----
      uint16_t* stage = reinterpret_cast<uint16_t*>(epi) + mw * (kWgBM * kWgBNw);
      named_sync(2 + mw, 128);  // the previous tile's stores from `stage` are done
      if (wtid < kWgBM) {
        const int pos = w.m_blk * kWgBM + wtid;
        const int id = p.rows.sorted_ids[pos];
        s_row[mw][wtid] = id < p.rows.num_valid ? id : -1;
      }
      float rw[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int pos = w.m_blk * kWgBM + r0 + 8 * h;
        const int id = p.rows.sorted_ids[pos];
        rw[h] = (p.topk_w && id < p.rows.num_valid) ? p.topk_w[id] : 1.0f;
      }
#pragma unroll
      for (int j = 0; j < 16; ++j)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const float a = value(j, h, 0) * rw[h], b = value(j, h, 1) * rw[h];
          *reinterpret_cast<uint32_t*>(stage + (r0 + 8 * h) * kWgBNw + 8 * j + 2 * (lane & 3)) =
              uint32_t(float_to_bf16_bits(a)) | (uint32_t(float_to_bf16_bits(b)) << 16);
        }
      named_sync(2 + mw, 128);
      // 64 rows x 256 bytes: 16 lanes per row, 2 rows per warp-iteration
      const int col0 = nt * 256 + mw * 128;
      for (int i = wtid; i < kWgBM * 16; i += 128) {
        const int r = i / 16, c = i % 16;
        const int row = s_row[mw][r];
        if (row < 0 || col0 + c * 8 >= p.N) continue;
        *reinterpret_cast<uint4*>(p.y2 + int64_t(row) * p.N + col0 + c * 8) =
            *reinterpret_cast<const uint4*>(stage + r * kWgBNw + c * 8);
      }
    }
  }
}

}  // namespace fp8moe::cuda
