// Communicators for expert and tensor parallelism. One Communicator per rank: an in-process group
// (ranks are threads of one process; used by the CPU tests and CPU runs) and, in CUDA builds, NCCL
// (one process per GPU, ncclCommInitRank from a unique id the launcher passes). The EP
// dispatch/combine in ep_moe.hpp is written once against this interface.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "fp8moe/tensor.hpp"

namespace fp8moe {

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // Where this rank's buffers live (cpu for the in-process group, cuda:N for NCCL).
  virtual Device device() const = 0;
  virtual std::string backend() const = 0;  // "inprocess", "nccl"

  // Every rank sends send_counts[r] values of `elem_bytes` bytes to rank r, taken contiguously from
  // `send` in rank order, and receives recv_counts[r] values from rank r into `recv` in rank order.
  // The counts must agree pairwise (what r sends to s is what s expects from r); exchange them
  // first with all_to_all_counts. `stream` is a cudaStream_t for device communicators.
  virtual void all_to_all_v(const void* send, std::span<const int64_t> send_counts, void* recv,
                            std::span<const int64_t> recv_counts, std::size_t elem_bytes,
                            void* stream = nullptr) = 0;
  // Host-side exchange of one int64 per peer: recv[r] = what rank r passed in send[this rank].
  virtual void all_to_all_counts(std::span<const int64_t> send, std::span<int64_t> recv) = 0;
  // In-place sum over ranks of a f32 or bf16 tensor (bf16 summed in f32, rounded once per element).
  virtual void all_reduce_sum(const TensorView& t, void* stream = nullptr) = 0;
  virtual void barrier() = 0;
};

// A group of `size` in-process communicators sharing memory; rank i must be used by one thread.
std::vector<std::unique_ptr<Communicator>> make_in_process_group(int size);

}  // namespace fp8moe
