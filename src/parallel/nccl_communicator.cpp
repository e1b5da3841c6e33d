// The NCCL communicator (CUDA builds): grouped ncclSend/ncclRecv for all-to-all-v, ncclAllReduce
// for sums. libnccl.so.2 is opened with dlopen so that nothing links against it.
#include <fmt/format.h>

#include <cstdlib>
#include <mutex>
#include <string>
#include <vector>

#include "fp8moe/error.hpp"
#include "fp8moe/parallel.hpp"

#ifdef FP8MOE_WITH_CUDA
#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <nccl.h>
#endif

namespace fp8moe {

std::string NcclUniqueId::hex() const {
  static const char* digits = "0123456789abcdef";
  std::string s;
  s.reserve(bytes.size() * 2);
  for (char c : bytes) {
    const auto u = static_cast<unsigned char>(c);
    s.push_back(digits[u >> 4]);
    s.push_back(digits[u & 15]);
  }
  return s;
}

NcclUniqueId NcclUniqueId::from_hex(std::string_view hex) {
  NcclUniqueId id;
  const auto nibble = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  if (hex.size() != id.bytes.size() * 2) {
    throw ValueError(fmt::format("NCCL unique id must be {} hex digits, got {} characters",
                                 id.bytes.size() * 2, hex.size()));
  }
  for (std::size_t i = 0; i < id.bytes.size(); ++i) {
    const int hi = nibble(hex[2 * i]), lo = nibble(hex[2 * i + 1]);
    if (hi < 0 || lo < 0) {
      throw ValueError(fmt::format("NCCL unique id has a non-hex character at position {}", 2 * i));
    }
    id.bytes[i] = static_cast<char>(hi << 4 | lo);
  }
  return id;
}

#ifndef FP8MOE_WITH_CUDA

bool nccl_available(std::string* why) {
  if (why) *why = "this fp8moe build has no CUDA support";
  return false;
}
int cuda_device_count(std::string* why) {
  if (why) *why = "this fp8moe build has no CUDA support";
  return 0;
}
NcclUniqueId nccl_get_unique_id() {
  throw RuntimeError("NCCL needs an fp8moe build with CUDA support");
}
std::unique_ptr<Communicator> make_nccl_communicator(const NcclUniqueId&, int, int, int) {
  throw RuntimeError("NCCL needs an fp8moe build with CUDA support");
}

#else

namespace {

struct NcclApi {
  ncclResult_t (*GetUniqueId)(ncclUniqueId*) = nullptr;
  ncclResult_t (*CommInitRank)(ncclComm_t*, int, ncclUniqueId, int) = nullptr;
  ncclResult_t (*CommDestroy)(ncclComm_t) = nullptr;
  ncclResult_t (*GroupStart)() = nullptr;
  ncclResult_t (*GroupEnd)() = nullptr;
  ncclResult_t (*Send)(const void*, size_t, ncclDataType_t, int, ncclComm_t,
                       cudaStream_t) = nullptr;
  ncclResult_t (*Recv)(void*, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t) = nullptr;
  ncclResult_t (*AllReduce)(const void*, void*, size_t, ncclDataType_t, ncclRedOp_t, ncclComm_t,
                            cudaStream_t) = nullptr;
  const char* (*GetErrorString)(ncclResult_t) = nullptr;
  std::string error;
};

const NcclApi& api() {
  static const NcclApi a = [] {
    NcclApi r;
    void* h = dlopen("libnccl.so.2", RTLD_NOW | RTLD_LOCAL);
    if (!h) h = dlopen("libnccl.so", RTLD_NOW | RTLD_LOCAL);
    if (!h) {
      const char* e = dlerror();
      r.error = fmt::format("cannot load libnccl.so.2 ({})", e ? e : "not found");
      return r;
    }
    const auto sym = [&](auto& fn, const char* name) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)> >(dlsym(h, name));
      if (!fn && r.error.empty()) r.error = fmt::format("libnccl.so.2 has no symbol {}", name);
    };
    sym(r.GetUniqueId, "ncclGetUniqueId");
    sym(r.CommInitRank, "ncclCommInitRank");
    sym(r.CommDestroy, "ncclCommDestroy");
    sym(r.GroupStart, "ncclGroupStart");
    sym(r.GroupEnd, "ncclGroupEnd");
    sym(r.Send, "ncclSend");
    sym(r.Recv, "ncclRecv");
    sym(r.AllReduce, "ncclAllReduce");
    sym(r.GetErrorString, "ncclGetErrorString");
    return r;
  }();
  return a;
}

const NcclApi& require_api() {
  const NcclApi& a = api();
  if (!a.error.empty()) throw RuntimeError("NCCL: " + a.error);
  return a;
}

void check(ncclResult_t r, const char* what) {
  if (r != ncclSuccess) {
    throw RuntimeError(fmt::format("NCCL {} failed: {}", what, require_api().GetErrorString(r)));
  }
}

void check_cuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    throw RuntimeError(fmt::format("CUDA {} failed: {}", what, cudaGetErrorString(e)));
  }
}

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(const NcclUniqueId& id, int rank, int size, int device)
      : rank_(rank), size_(size), device_(device) {
    if (size < 1 || rank < 0 || rank >= size) {
      throw ValueError(fmt::format("NCCL rank {} of {} is not a valid rank", rank, size));
    }
    const NcclApi& a = require_api();
    // NVLink multicast off unless the caller decided otherwise (see parallel.hpp).
    setenv("NCCL_NVLS_ENABLE", "0", /*overwrite=*/0);
    check_cuda(cudaSetDevice(device), "cudaSetDevice");
    ncclUniqueId uid;
    static_assert(sizeof(uid.internal) == sizeof(id.bytes));
    std::copy(id.bytes.begin(), id.bytes.end(), uid.internal);
    check(a.CommInitRank(&comm_, size, uid, rank), "ncclCommInitRank");
    check_cuda(cudaMalloc(&scratch_, 2 * sizeof(int64_t) * static_cast<std::size_t>(size)),
               "cudaMalloc");
  }
  ~NcclCommunicator() override {
    if (scratch_) cudaFree(scratch_);
    if (comm_) api().CommDestroy(comm_);
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  Device device() const override { return Device::cuda(device_); }
  std::string backend() const override { return "nccl"; }

  void all_to_all_v(const void* send, std::span<const int64_t> send_counts, void* recv,
                    std::span<const int64_t> recv_counts, std::size_t elem_bytes,
                    void* stream) override {
    check_counts(send_counts.size());
    check_counts(recv_counts.size());
    const NcclApi& a = require_api();
    auto s = static_cast<cudaStream_t>(stream);
    std::size_t send_off = 0, recv_off = 0;
    check(a.GroupStart(), "ncclGroupStart");
    for (int peer = 0; peer < size_; ++peer) {
      const std::size_t sb = static_cast<std::size_t>(send_counts[peer]) * elem_bytes;
      const std::size_t rb = static_cast<std::size_t>(recv_counts[peer]) * elem_bytes;
      if (sb) {
        check(a.Send(static_cast<const char*>(send) + send_off, sb, ncclUint8, peer, comm_, s),
              "ncclSend");
      }
      if (rb) {
        check(a.Recv(static_cast<char*>(recv) + recv_off, rb, ncclUint8, peer, comm_, s),
              "ncclRecv");
      }
      send_off += sb;
      recv_off += rb;
    }
    check(a.GroupEnd(), "ncclGroupEnd");
  }

  void all_to_all_counts(std::span<const int64_t> send, std::span<int64_t> recv) override {
    check_counts(send.size());
    check_counts(recv.size());
    auto* dsend = static_cast<int64_t*>(scratch_);
    int64_t* drecv = dsend + size_;
    check_cuda(cudaMemcpy(dsend, send.data(), send.size_bytes(), cudaMemcpyHostToDevice),
               "cudaMemcpy");
    std::vector<int64_t> ones(static_cast<std::size_t>(size_), 1);
    all_to_all_v(dsend, ones, drecv, ones, sizeof(int64_t), nullptr);
    check_cuda(cudaMemcpy(recv.data(), drecv, recv.size_bytes(), cudaMemcpyDeviceToHost),
               "cudaMemcpy");
  }

  void all_reduce_sum(const TensorView& t, void* stream) override {
    if (t.dtype != DType::kF32) {
      throw ValueError(fmt::format(
          "NCCL all_reduce_sum takes f32 tensors (partial outputs), got {}", t.describe()));
    }
    if (!t.is_contiguous()) throw ValueError("all_reduce_sum needs a contiguous tensor");
    check(require_api().AllReduce(t.data, t.data, static_cast<std::size_t>(t.numel()), ncclFloat32,
                                  ncclSum, comm_, static_cast<cudaStream_t>(stream)),
          "ncclAllReduce");
  }

  void barrier() override {
    std::vector<int64_t> zeros(static_cast<std::size_t>(size_), 0), got(zeros.size());
    all_to_all_counts(zeros, got);
  }

 private:
  void check_counts(std::size_t n) const {
    if (n != static_cast<std::size_t>(size_)) {
      throw ValueError(fmt::format("{} counts given, expected one per rank ({})", n, size_));
    }
  }
  int rank_, size_, device_;
  ncclComm_t comm_ = nullptr;
  void* scratch_ = nullptr;
};

}  // namespace

bool nccl_available(std::string* why) {
  const NcclApi& a = api();
  if (why) *why = a.error;
  return a.error.empty();
}

int cuda_device_count(std::string* why) {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    cudaGetLastError();
    if (why) *why = fmt::format("cudaGetDeviceCount: {}", cudaGetErrorString(e));
    return 0;
  }
  if (why) *why = n == 0 ? "no CUDA device is visible" : "";
  return n;
}

NcclUniqueId nccl_get_unique_id() {
  ncclUniqueId uid;
  check(require_api().GetUniqueId(&uid), "ncclGetUniqueId");
  NcclUniqueId id;
  std::copy(uid.internal, uid.internal + sizeof(uid.internal), id.bytes.begin());
  return id;
}

std::unique_ptr<Communicator> make_nccl_communicator(const NcclUniqueId& id, int rank, int size,
                                                     int cuda_device) {
  return std::make_unique<NcclCommunicator>(id, rank, size, cuda_device);
}

#endif  // FP8MOE_WITH_CUDA

}  // namespace fp8moe
