// Launcher of moe_align (smxx_moe_align.cuh).
#include "moe_launchers.hpp"
#include "smxx_moe_align.cuh"

#include <algorithm>
#include <cstdlib>
#include <string>

#include "fp8moe/error.hpp"

namespace fp8moe::cuda {

namespace {

constexpr int64_t kAlignChunkPairs = 1024;  // pairs per block of the many-block alignment
constexpr int64_t kAlignMaxParts = 256;

int64_t align_parts(int64_t num_valid) {
  return std::max<int64_t>(1, std::min(ceil_div(num_valid, kAlignChunkPairs), kAlignMaxParts));
}

// From this many pairs on, the many-block alignment (with scratch). FP8MOE_ALIGN_SPLIT_MIN
// overrides it (measurement only).
int64_t align_split_min() {
  static const int64_t v = [] {
    const char* e = std::getenv("FP8MOE_ALIGN_SPLIT_MIN");
    if (!e || !*e) return int64_t{8192};
    char* end = nullptr;
    const long long n = std::strtoll(e, &end, 10);
    if (!end || *end || n < 0)
      throw ValueError(std::string("FP8MOE_ALIGN_SPLIT_MIN='") + e + "' is not a pair count");
    return static_cast<int64_t>(n);
  }();
  return v;
}

}  // namespace

std::size_t align_scratch_bytes(int64_t num_valid, int64_t E_local) {
  return static_cast<std::size_t>(align_parts(num_valid) * E_local) * sizeof(int32_t);
}

void launch_align(const int32_t* topk_ids, int num_valid, const int32_t* expert_map, int E_global,
                  int E_local, int bm, int capacity, int fixed_stride, const AlignOut& out,
                  cudaStream_t stream, int64_t split_min) {
  if (split_min < 0) split_min = align_split_min();
  if (fixed_stride == 0 && out.scratch && num_valid > 0 && num_valid >= split_min) {
    const int64_t parts0 = align_parts(num_valid);
    const int chunk = static_cast<int>(ceil_div(int64_t(num_valid), parts0));
    const int parts = static_cast<int>(ceil_div(int64_t(num_valid), int64_t(chunk)));
    const int e_bytes = E_local * static_cast<int>(sizeof(int32_t));
    moe_align_count_kernel<<<parts, kAlignSplitThreads, e_bytes, stream>>>(
        topk_ids, num_valid, chunk, expert_map, E_global, E_local, out.scratch);
    FP8MOE_CUDA_CHECK_LAUNCH();
    moe_align_scan_kernel<<<1, kAlignThreads, (2 * E_local + 1) * sizeof(int32_t), stream>>>(
        num_valid, parts, E_local, bm, capacity, out.scratch, out.sorted_ids, out.expert_blk,
        out.meta, out.expert_count, out.expert_off);
    FP8MOE_CUDA_CHECK_LAUNCH();
    moe_align_place_kernel<<<parts, kAlignSplitThreads, e_bytes, stream>>>(
        topk_ids, num_valid, chunk, expert_map, E_global, E_local, out.scratch, out.expert_off,
        out.sorted_ids, out.pair_pos);
    FP8MOE_CUDA_CHECK_LAUNCH();
    return;
  }
  const int smem = (3 * E_local + 1) * static_cast<int>(sizeof(int32_t));
  moe_align_kernel<<<1, kAlignThreads, smem, stream>>>(
      topk_ids, num_valid, expert_map, E_global, E_local, bm, capacity, fixed_stride,
      out.sorted_ids, out.expert_blk, out.meta, out.expert_count, out.expert_off, out.pair_pos);
  FP8MOE_CUDA_CHECK_LAUNCH();
}

void launch_batched_rows(const int32_t* counts, int E_local, int T, int T_pad, int bm,
                         const AlignOut& out, cudaStream_t stream) {
  const int64_t n = int64_t(E_local) * T_pad;
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>(ceil_div(n, 256), 4096));
  batched_rows_kernel<<<blocks, 256, 0, stream>>>(counts, E_local, T, T_pad, bm, out.sorted_ids,
                                                  out.expert_blk, out.meta);
  FP8MOE_CUDA_CHECK_LAUNCH();
}

}  // namespace fp8moe::cuda
