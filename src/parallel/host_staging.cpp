// all_to_all_v_host: host buffers through any communicator (see parallel.hpp).
#include <algorithm>
#include <cstring>

#include "fp8moe/parallel.hpp"

namespace fp8moe {

void all_to_all_v_host(Communicator& comm, const void* send, std::span<const int64_t> send_counts,
                       void* recv, std::span<const int64_t> recv_counts, std::size_t elem_bytes) {
  const Device dev = comm.device();
  if (dev.is_cpu()) {
    comm.all_to_all_v(send, send_counts, recv, recv_counts, elem_bytes);
    return;
  }
  int64_t S = 0, R = 0;
  for (int64_t c : send_counts) S += c;
  for (int64_t c : recv_counts) R += c;
  const auto sb = static_cast<int64_t>(static_cast<std::size_t>(S) * elem_bytes);
  const auto rb = static_cast<int64_t>(static_cast<std::size_t>(R) * elem_bytes);
  // One byte at least: a rank with nothing to send or receive still takes part.
  Tensor hs = Tensor::empty({std::max<int64_t>(sb, 1)}, DType::kU8);
  if (sb) std::memcpy(hs.data(), send, static_cast<std::size_t>(sb));
  const Tensor ds = hs.to(dev);
  const Tensor dr = Tensor::empty({std::max<int64_t>(rb, 1)}, DType::kU8, dev);
  comm.all_to_all_v(ds.data(), send_counts, dr.data(), recv_counts, elem_bytes);
  // The copy back runs on the legacy default stream, after the collective.
  const Tensor hr = dr.to(Device::cpu());
  if (rb) std::memcpy(recv, hr.data(), static_cast<std::size_t>(rb));
}

}  // namespace fp8moe
