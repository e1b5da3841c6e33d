// TMA descriptors (cuTensorMapEncodeTiled through the runtime's driver entry point).
#pragma once

#include <cstdint>

#include "cuda_check.hpp"

namespace fp8moe::cuda {

// A 2D byte tensor (outer rows of `inner` bytes, row stride = inner) read in boxes of
// box_outer rows x box_inner bytes with the 128-byte swizzle (box_inner must be <= 128).
inline CUtensorMap make_tma_2d_u8(const void* base, int64_t inner, int64_t outer, int box_inner,
                                  int box_outer, bool swizzle128 = true) {
  CUtensorMap m{};
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(inner), static_cast<cuuint64_t>(outer)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(inner)};
  const cuuint32_t box[2] = {static_cast<cuuint32_t>(box_inner),
                             static_cast<cuuint32_t>(box_outer)};
  const cuuint32_t elem[2] = {1, 1};
  FP8MOE_CU_CHECK(
      tensor_map_encoder()(&m, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, const_cast<void*>(base), dims,
                           strides, box, elem, CU_TENSOR_MAP_INTERLEAVE_NONE,
                           swizzle128 ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_NONE,
                           CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE));
  return m;
}

// A row-major byte matrix (rows of `row_bytes`, a multiple of 128) viewed as 3D: 128-byte pieces
// of K, the K blocks of a row (stride 128), rows (stride row_bytes). A box of `box_rows` rows x
// `box_kb` K blocks lands in shared memory as box_rows rows of box_kb * 128 bytes (no swizzle): one
// request fetches what would take box_rows separate row copies.
inline CUtensorMap make_tma_rows_kblocks_u8(const void* base, int64_t row_bytes, int64_t rows,
                                            int box_kb, int box_rows) {
  CUtensorMap m{};
  const cuuint64_t dims[3] = {128, static_cast<cuuint64_t>(row_bytes / 128),
                              static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[2] = {128, static_cast<cuuint64_t>(row_bytes)};
  const cuuint32_t box[3] = {128, static_cast<cuuint32_t>(box_kb),
                             static_cast<cuuint32_t>(box_rows)};
  const cuuint32_t elem[3] = {1, 1, 1};
  FP8MOE_CU_CHECK(tensor_map_encoder()(
      &m, CU_TENSOR_MAP_DATA_TYPE_UINT8, 3, const_cast<void*>(base), dims, strides, box, elem,
      CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
      CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE));
  return m;
}

// w13 (E experts x [I gate rows; I up rows] x row_bytes, row-major) viewed as 4D for the single
// path's wgmma GEMM1: 128-byte pieces of K (128-byte swizzle), rows (stride row_bytes), gate / up
// (stride I rows), K blocks (stride 128). A box of 16 rows x 2 x box_kb K blocks at gate row r
// lands in shared memory as box_kb slabs of 4 KB, each [16 gate rows; the 16 matching up rows] x
// 128 bytes: the canonical K-major, 128-byte-swizzled A tile of 32 rows per K block. Coordinates
// past the last K block are zero-filled (and counted).
inline CUtensorMap make_tma_w13_pairs_sw128(const void* base, int64_t row_bytes, int64_t rows,
                                            int64_t I, int box_kb) {
  CUtensorMap m{};
  const cuuint64_t dims[4] = {128, static_cast<cuuint64_t>(rows), 2,
                              static_cast<cuuint64_t>(row_bytes / 128)};
  const cuuint64_t strides[3] = {static_cast<cuuint64_t>(row_bytes),
                                 static_cast<cuuint64_t>(I * row_bytes), 128};
  const cuuint32_t box[4] = {128, 16, 2, static_cast<cuuint32_t>(box_kb)};
  const cuuint32_t elem[4] = {1, 1, 1, 1};
  FP8MOE_CU_CHECK(tensor_map_encoder()(
      &m, CU_TENSOR_MAP_DATA_TYPE_UINT8, 4, const_cast<void*>(base), dims, strides, box, elem,
      CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
      CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE));
  return m;
}

}  // namespace fp8moe::cuda
