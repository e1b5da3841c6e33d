// The in-process communicator: ranks are threads of one process. Each collective publishes the
// rank's buffer pointers, waits on a barrier, copies what it needs from its peers, and waits again
// so that no buffer is reused before every peer has read it. A rank that finds a mismatch still
// takes part in every barrier of the collective and throws only at its end, so one bad rank never
// hangs the others.
#include <fmt/format.h>

#include <algorithm>
#include <barrier>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "fp8moe/error.hpp"
#include "fp8moe/numerics.hpp"
#include "fp8moe/parallel.hpp"

#ifdef _OPENMP
#include <omp.h>
#endif

namespace fp8moe {
namespace {

struct Shared {
  explicit Shared(int n) : size(n), sync(n), slots(static_cast<std::size_t>(n)) {}
  struct Slot {
    const void* send = nullptr;
    std::span<const int64_t> send_counts;
    std::size_t elem_bytes = 0;
    const int64_t* counts = nullptr;
    const TensorView* tensor = nullptr;
  };
  int size;
  std::barrier<> sync;
  std::vector<Slot> slots;
  std::vector<float> reduce_scratch;
  std::string reduce_error;
};

float load_f32(const void* p, DType t, int64_t i) {
  return t == DType::kF32 ? static_cast<const float*>(p)[i]
                          : numerics::bf16_to_float(static_cast<const uint16_t*>(p)[i]);
}

class InProcessCommunicator final : public Communicator {
 public:
  InProcessCommunicator(std::shared_ptr<Shared> shared, int rank)
      : shared_(std::move(shared)), rank_(rank) {}
  int rank() const override { return rank_; }
  int size() const override { return shared_->size; }
  Device device() const override { return Device::cpu(); }
  std::string backend() const override { return "inprocess"; }

  void all_to_all_v(const void* send, std::span<const int64_t> send_counts, void* recv,
                    std::span<const int64_t> recv_counts, std::size_t elem_bytes,
                    void* /*stream*/) override {
    std::string error = count_error("send_counts", send_counts.size());
    if (error.empty()) error = count_error("recv_counts", recv_counts.size());
    auto& me = shared_->slots[rank_];
    me.send = send;
    me.send_counts = error.empty() ? send_counts : std::span<const int64_t>();
    me.elem_bytes = elem_bytes;
    shared_->sync.arrive_and_wait();
    char* dst = static_cast<char*>(recv);
    for (int src = 0; src < size() && error.empty(); ++src) {
      const auto& peer = shared_->slots[src];
      if (peer.send_counts.size() != static_cast<std::size_t>(size())) {
        error = fmt::format("all_to_all_v: rank {} passed malformed send counts", src);
        break;
      }
      if (peer.elem_bytes != elem_bytes) {
        error = fmt::format("all_to_all_v: rank {} sends {}-byte elements, rank {} expects {}", src,
                            peer.elem_bytes, rank_, elem_bytes);
        break;
      }
      if (peer.send_counts[rank_] != recv_counts[src]) {
        error = fmt::format("all_to_all_v: rank {} sends {} elements to rank {}, which expects {}",
                            src, peer.send_counts[rank_], rank_, recv_counts[src]);
        break;
      }
      int64_t offset = 0;
      for (int r = 0; r < rank_; ++r) offset += peer.send_counts[r];
      const std::size_t bytes = static_cast<std::size_t>(recv_counts[src]) * elem_bytes;
      if (bytes) {
        std::memcpy(dst, static_cast<const char*>(peer.send) + offset * elem_bytes, bytes);
      }
      dst += bytes;
    }
    shared_->sync.arrive_and_wait();
    if (!error.empty()) throw ValueError(error);
  }

  void all_to_all_counts(std::span<const int64_t> send, std::span<int64_t> recv) override {
    std::string error = count_error("send", send.size());
    if (error.empty()) error = count_error("recv", recv.size());
    shared_->slots[rank_].counts = error.empty() ? send.data() : nullptr;
    shared_->sync.arrive_and_wait();
    for (int r = 0; r < size() && error.empty(); ++r) {
      const int64_t* peer = shared_->slots[r].counts;
      if (!peer) {
        error = fmt::format("all_to_all_counts: rank {} passed malformed counts", r);
      } else {
        recv[r] = peer[rank_];
      }
    }
    shared_->sync.arrive_and_wait();
    if (!error.empty()) throw ValueError(error);
  }

  void all_reduce_sum(const TensorView& t, void* /*stream*/) override {
    std::string error;
    if (t.dtype != DType::kF32 && t.dtype != DType::kBF16) {
      error = fmt::format("all_reduce_sum supports f32 and bf16 tensors, got {}", t.describe());
    } else if (!t.is_contiguous()) {
      error = fmt::format("all_reduce_sum needs a contiguous tensor, got {}", t.describe());
    }
    shared_->slots[rank_].tensor = error.empty() ? &t : nullptr;
    shared_->sync.arrive_and_wait();
    // Rank 0 reduces in rank order (deterministic); everyone copies the result back.
    const int64_t n = t.numel();
    if (rank_ == 0) {
      auto& acc = shared_->reduce_scratch;
      shared_->reduce_error.clear();
      acc.assign(static_cast<std::size_t>(n), 0.0f);
      for (int r = 0; r < size() && shared_->reduce_error.empty(); ++r) {
        const TensorView* p = shared_->slots[r].tensor;
        if (!p || p->numel() != n || p->dtype != t.dtype) {
          shared_->reduce_error =
              fmt::format("all_reduce_sum: rank {} passed {}, rank 0 passed {}", r,
                          p ? p->describe() : std::string("an unsupported tensor"), t.describe());
          break;
        }
        for (int64_t i = 0; i < n; ++i) acc[i] += load_f32(p->data, p->dtype, i);
      }
    }
    shared_->sync.arrive_and_wait();
    if (error.empty()) error = shared_->reduce_error;
    if (error.empty()) {
      const float* acc = shared_->reduce_scratch.data();
      if (t.dtype == DType::kF32) {
        std::memcpy(t.data, acc, static_cast<std::size_t>(n) * sizeof(float));
      } else {
        auto* out = static_cast<uint16_t*>(t.data);
        for (int64_t i = 0; i < n; ++i) out[i] = numerics::float_to_bf16(acc[i]);
      }
    }
    shared_->sync.arrive_and_wait();
    if (!error.empty()) throw ValueError(error);
  }

  void barrier() override { shared_->sync.arrive_and_wait(); }

 private:
  std::string count_error(const char* what, std::size_t n) const {
    if (n == static_cast<std::size_t>(size())) return {};
    return fmt::format("{} has {} entries, expected one per rank ({})", what, n, size());
  }
  std::shared_ptr<Shared> shared_;
  int rank_;
};

}  // namespace

std::vector<std::unique_ptr<Communicator>> make_in_process_group(int size) {
  if (size < 1) throw ValueError(fmt::format("communicator group size must be >= 1, got {}", size));
  auto shared = std::make_shared<Shared>(size);
  std::vector<std::unique_ptr<Communicator>> group;
  for (int r = 0; r < size; ++r)
    group.push_back(std::make_unique<InProcessCommunicator>(shared, r));
  return group;
}

int share_cpu_threads_among_ranks(int ranks) {
#ifdef _OPENMP
  // A thread that has not set its own count starts from the process's initial one.
  const int n = std::max(1, omp_get_max_threads() / std::max(1, ranks));
  omp_set_num_threads(n);
  return n;
#else
  (void)ranks;
  return 1;
#endif
}

}  // namespace fp8moe
