// Launcher of moe_align (smxx_moe_align.cuh).
#include "moe_launchers.hpp"
#include "smxx_moe_align.cuh"

namespace fp8moe::cuda {

void launch_align(const int32_t* topk_ids, int num_valid, const int32_t* expert_map, int E_global,
                  int E_local, int bm, int capacity, int fixed_stride, const AlignOut& out,
                  cudaStream_t stream) {
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
