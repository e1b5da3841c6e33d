// Communicators for expert and tensor parallelism. One Communicator per rank: an in-process group
// (ranks are threads of one process; used by the CPU tests and CPU runs) and, in CUDA builds, NCCL
// (one process per GPU, ncclCommInitRank from a unique id the launcher passes). The EP
// dispatch/combine in ep_moe.hpp is written once against this interface.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
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
// For ranks simulated as threads of one process: the calling thread's OpenMP teams get
// max(1, omp_get_max_threads() / ranks) threads from now on, so that the ranks share the cores
// (as ranks on separate devices would each have their own) instead of each taking all of them.
// Returns the thread count set (1 in builds without OpenMP).
int share_cpu_threads_among_ranks(int ranks);

// all_to_all_v on host buffers with any communicator: a device communicator (NCCL) gets the data
// staged through device memory on comm.device() (synchronous copies, the legacy default stream).
// Simple rather than fast: the EP forward's host-side dispatch uses it on GPUs too.
void all_to_all_v_host(Communicator& comm, const void* send, std::span<const int64_t> send_counts,
                       void* recv, std::span<const int64_t> recv_counts, std::size_t elem_bytes);

}  // namespace fp8moe

namespace fp8moe {

// ---- NCCL (CUDA builds)
// ------------------------------------------------------------------------------ One process per
// GPU. Rank 0 creates the unique id and the launcher hands it to every rank (as hex). libnccl.so.2
// is loaded at run time (dlopen), so fp8moe binaries start on machines without NCCL and fail only
// when a NCCL communicator is asked for. NVLink multicast (NVLS) is switched off
// (NCCL_NVLS_ENABLE=0) unless the caller set that variable: on shared multi-GPU hosts it can take
// the GPUs out of service.
struct NcclUniqueId {
  std::array<char, 128> bytes{};
  std::string hex() const;
  // Throws ValueError naming the text unless it is 256 hex digits.
  static NcclUniqueId from_hex(std::string_view hex);
};
// Whether this build has CUDA and libnccl.so.2 can be loaded; `why` gets the reason when not.
bool nccl_available(std::string* why = nullptr);
// CUDA devices this process can use (0 in builds without CUDA or without a driver; `why` says
// which when it is 0).
int cuda_device_count(std::string* why = nullptr);
NcclUniqueId nccl_get_unique_id();
// Joins the group (blocks until every rank has joined). Buffers passed to the collectives live on
// `cuda_device`; `stream` arguments are cudaStream_t (nullptr: the legacy default stream).
// all_to_all_counts goes through device memory and synchronises. all_reduce_sum supports f32 only
// (NCCL's bf16 sum rounds every step; EP/TP reductions use f32 partials).
std::unique_ptr<Communicator> make_nccl_communicator(const NcclUniqueId& id, int rank, int size,
                                                     int cuda_device);

}  // namespace fp8moe
