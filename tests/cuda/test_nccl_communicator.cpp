// The NCCL communicator on one GPU (a one-rank group: NCCL does not allow two ranks on one device).
// Multi-GPU runs go through `fp8moe run --ep N` on a multi-GPU machine.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <vector>

#include "fp8moe/parallel.hpp"

namespace fp8moe {
namespace {

bool have_gpu() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

TEST(NcclCommunicatorGpu, OneRankAllToAllAndAllReduce) {
  if (!have_gpu()) GTEST_SKIP() << "no GPU";
  std::string why;
  if (!nccl_available(&why)) GTEST_SKIP() << why;
  auto comm = make_nccl_communicator(nccl_get_unique_id(), 0, 1, 0);
  std::vector<int64_t> counts{3}, got(1);
  comm->all_to_all_counts(counts, got);
  EXPECT_EQ(got[0], 3);
  std::vector<float> host{1.5f, -2.0f, 4.25f};
  float *send = nullptr, *recv = nullptr;
  ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&send), 3 * sizeof(float)), cudaSuccess);
  ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&recv), 3 * sizeof(float)), cudaSuccess);
  cudaMemcpy(send, host.data(), 3 * sizeof(float), cudaMemcpyHostToDevice);
  // recv poisoned, so the exchange must write it (a reused allocation could hold the values); on
  // one rank the sum returns its input, so this is a smoke test of the calls, not of the reduction
  ASSERT_EQ(cudaMemset(recv, 0xFF, 3 * sizeof(float)), cudaSuccess);
  comm->all_to_all_v(send, counts, recv, counts, sizeof(float));
  TensorView t(recv, DType::kF32, {3}, Device::cuda(0));
  comm->all_reduce_sum(t);
  std::vector<float> back(3);
  ASSERT_EQ(cudaMemcpy(back.data(), recv, 3 * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(back, host);
  cudaFree(send);
  cudaFree(recv);
}

}  // namespace
}  // namespace fp8moe
