// Expert-parallel dispatch / compute / combine over a Communicator (see ep_moe.hpp). Host tensors.
#include "fp8moe/ep_moe.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <string>
#include <vector>

#include "fp8moe/checkpoint.hpp"
#include "fp8moe/error.hpp"
#include "fp8moe/numerics.hpp"
#include "numerics/routing.hpp"

namespace fp8moe {

int EpLayout::num_local(int rank) const {
  return static_cast<int>(std::count(owner.begin(), owner.end(), rank));
}

std::vector<int32_t> EpLayout::expert_map(int rank) const {
  std::vector<int32_t> map(owner.size(), -1);
  for (std::size_t e = 0; e < owner.size(); ++e)
    if (owner[e] == rank) map[e] = local_index[e];
  return map;
}

namespace {
EpLayout layout_from_placement(int num_experts, int ep_size, ExpertPlacementStrategy strategy) {
  EpLayout l;
  l.ep_size = ep_size;
  l.owner.assign(static_cast<std::size_t>(num_experts), -1);
  l.local_index.assign(static_cast<std::size_t>(num_experts), -1);
  for (int r = 0; r < ep_size; ++r) {
    const ExpertPlacement p = place_experts(num_experts, ep_size, r, strategy);
    for (int i = 0; i < p.num_local(); ++i) {
      l.owner[p.local_to_global[i]] = r;
      l.local_index[p.local_to_global[i]] = i;
    }
  }
  return l;
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

float load(const TensorView& t, int64_t i) {
  return t.dtype == DType::kF32 ? t.ptr<const float>()[i]
                                : numerics::bf16_to_float(t.ptr<const uint16_t>()[i]);
}

std::string check_args(const Communicator& comm, const EpLayout& layout, const EpMoeArgs& a) {
  if (layout.ep_size != comm.size()) {
    return fmt::format("EP layout is for {} ranks but the communicator has {}", layout.ep_size,
                       comm.size());
  }
  if (!a.x.defined() || a.x.ndim != 2)
    return fmt::format("x must be (M, H), got {}", a.x.describe());
  if (!a.x.device.is_cpu()) return "ep_moe_forward takes host tensors (in-process communicator)";
  if (a.x.dtype != DType::kBF16 && a.x.dtype != DType::kF32) {
    return fmt::format("x must be bf16 or f32, got {}", a.x.describe());
  }
  if (!a.out.defined() || a.out.ndim != 2 || a.out.size(0) != a.x.size(0) ||
      a.out.size(1) != a.x.size(1) || a.out.dtype != a.x.dtype) {
    return fmt::format("out must have x's shape and dtype {}, got {}", a.x.describe(),
                       a.out.describe());
  }
  if (!a.x.is_contiguous() || !a.out.is_contiguous()) return "x and out must be contiguous";
  const int64_t M = a.x.size(0);
  if (a.topk_ids.defined()) {
    if (a.topk_ids.ndim != 2 || a.topk_ids.size(0) != M || a.topk_ids.dtype != DType::kI32 ||
        !a.topk_weights.defined() || a.topk_weights.ndim != 2 || a.topk_weights.size(0) != M ||
        a.topk_weights.size(1) != a.topk_ids.size(1) || a.topk_weights.dtype != DType::kF32) {
      return fmt::format(
          "topk_ids (M, k) i32 and topk_weights (M, k) f32 expected for M = {}, got "
          "{} and {}",
          M, a.topk_ids.describe(), a.topk_weights.describe());
    }
  } else if (!a.router_logits.defined() || a.router_logits.ndim != 2 ||
             a.router_logits.size(0) != M || a.router_logits.size(1) != layout.num_experts()) {
    return fmt::format("router_logits must be (M = {}, E = {}), got {}", M, layout.num_experts(),
                       a.router_logits.describe());
  }
  return {};
}
}  // namespace

EpLayout EpLayout::linear(int num_experts, int ep_size) {
  return layout_from_placement(num_experts, ep_size, ExpertPlacementStrategy::kLinear);
}
EpLayout EpLayout::round_robin(int num_experts, int ep_size) {
  return layout_from_placement(num_experts, ep_size, ExpertPlacementStrategy::kRoundRobin);
}

EpMoeStats ep_moe_forward(Communicator& comm, const ExpertsImpl& local_experts,
                          EpExpertsFormat format, const EpLayout& layout, const EpMoeArgs& a) {
  EpMoeStats stats;
  const int nranks = comm.size();
  const int me = comm.rank();
  auto t0 = std::chrono::steady_clock::now();
  // A rank with bad arguments still takes part in every collective (with nothing to send), and
  // throws at the end, so its peers never hang.
  std::string error = check_args(comm, layout, a);
  const bool ok = error.empty();
  const int64_t M = ok ? a.x.size(0) : 0;
  const int64_t H = ok ? a.x.size(1) : 0;
  const DType xdt = ok ? a.x.dtype : DType::kBF16;
  const std::size_t row_bytes = static_cast<std::size_t>(H) * dtype_size(xdt);

  // ---- routing
  Tensor ids_t, w_t;
  TensorView ids = a.topk_ids, weights = a.topk_weights;
  if (ok && !a.topk_ids.defined()) {
    try {
      auto r = numerics::route(a.router_logits, a.routing);
      ids_t = r.topk_ids;
      w_t = r.topk_weights;
      ids = ids_t;
      weights = w_t;
    } catch (const Error& e) {
      error = e.what();
    }
  }
  const bool routed = error.empty();
  const int64_t k = routed ? ids.size(1) : 0;
  // H and k must agree across ranks: exchange them with the counts below.

  // ---- dispatch plan: token t goes to rank d if d owns any of its experts
  std::vector<std::vector<int64_t>> to_rank(nranks);  // token indices per destination, in order
  if (routed) {
    const int32_t* id = ids.ptr<const int32_t>();
    for (int64_t t = 0; t < M; ++t) {
      uint64_t seen = 0;  // small rank sets; fall back to a vector for larger groups
      std::vector<char> seen_big(nranks > 64 ? nranks : 0, 0);
      for (int64_t j = 0; j < k; ++j) {
        const int32_t e = id[t * k + j];
        if (e < 0) continue;  // padded slot
        if (e >= layout.num_experts()) {
          error = fmt::format("topk_ids[{}, {}] = {} is not an expert id (E = {})", t, j, e,
                              layout.num_experts());
          break;
        }
        const int d = layout.owner[e];
        bool first;
        if (nranks <= 64) {
          first = !(seen >> d & 1u);
          seen |= uint64_t{1} << d;
        } else {
          first = !seen_big[d];
          seen_big[d] = 1;
        }
        if (first) to_rank[d].push_back(t);
      }
      if (!error.empty()) break;
    }
    if (!error.empty())
      for (auto& v : to_rank) v.clear();
  }
  // Rows per destination, plus (H, k) so that every rank can check its peers agree.
  std::vector<int64_t> send_counts(nranks), recv_counts(nranks);
  for (int d = 0; d < nranks; ++d) send_counts[d] = static_cast<int64_t>(to_rank[d].size());
  comm.all_to_all_counts(send_counts, recv_counts);
  std::vector<int64_t> shape_send(nranks, error.empty() ? (H << 8 | k) : -1), shape_recv(nranks);
  comm.all_to_all_counts(shape_send, shape_recv);
  for (int r = 0; r < nranks && error.empty(); ++r) {
    if (shape_recv[r] != -1 && recv_counts[r] > 0 && shape_recv[r] != (H << 8 | k)) {
      error = fmt::format("rank {} dispatches rows of hidden {} with topk {}, rank {} has {} / {}",
                          r, shape_recv[r] >> 8, shape_recv[r] & 0xFF, me, H, k);
    }
  }
  int64_t R = 0;
  for (int64_t c : recv_counts) R += c;
  int64_t S = 0;
  for (int64_t c : send_counts) S += c;
  stats.rows_sent = S;
  stats.rows_received = R;

  // ---- pack and exchange rows, masked ids (only the destination's experts) and weights
  std::vector<char> send_x(static_cast<std::size_t>(S) * row_bytes);
  std::vector<int32_t> send_ids(static_cast<std::size_t>(S * k), -1);
  std::vector<float> send_w(static_cast<std::size_t>(S * k), 0.0f);
  {
    int64_t row = 0;
    for (int d = 0; d < nranks; ++d) {
      for (int64_t t : to_rank[d]) {
        std::memcpy(send_x.data() + row * row_bytes,
                    static_cast<const char*>(a.x.data) + t * row_bytes, row_bytes);
        for (int64_t j = 0; j < k; ++j) {
          const int32_t e = ids.ptr<const int32_t>()[t * k + j];
          if (e >= 0 && layout.owner[e] == d) {
            send_ids[row * k + j] = e;
            send_w[row * k + j] = weights.ptr<const float>()[t * k + j];
          }
        }
        ++row;
      }
    }
  }
  const int64_t kk = std::max<int64_t>(k, 1);
  Tensor recv_x = Tensor::empty({R, H}, xdt);
  Tensor recv_ids = Tensor::empty({R, kk}, DType::kI32);
  Tensor recv_w = Tensor::empty({R, kk}, DType::kF32);
  all_to_all_v_host(comm, send_x.data(), send_counts, recv_x.data(), recv_counts, row_bytes);
  all_to_all_v_host(comm, send_ids.data(), send_counts, recv_ids.data(), recv_counts,
                    static_cast<std::size_t>(k) * sizeof(int32_t));
  all_to_all_v_host(comm, send_w.data(), send_counts, recv_w.data(), recv_counts,
                    static_cast<std::size_t>(k) * sizeof(float));
  stats.dispatch_s = seconds_since(t0);

  // ---- local experts
  t0 = std::chrono::steady_clock::now();
  // Partial outputs in f32 when the kernel can produce them (one rounding, at the end of the
  // combine: exact-mode results equal the single-rank ones bit for bit), else in x's dtype.
  const DType pdt = local_experts.f32_partial_out ? DType::kF32 : xdt;
  const std::size_t prow_bytes = static_cast<std::size_t>(H) * dtype_size(pdt);
  Tensor partial = Tensor::zeros({R, H}, pdt);
  if (error.empty() && R > 0) {
    try {
      // A device kernel (weights on a GPU) gets its inputs staged to the weights' device and its
      // output copied back; the dispatch and combine stay on the host.
      const Device kdev = a.weights.w13.device;
      const auto on_kdev = [&](const Tensor& t) { return kdev.is_cpu() ? t : t.to(kdev); };
      if (!kdev.is_cpu() && local_experts.device == DeviceKind::kCpu) {
        throw ValueError(fmt::format("the weights are on {}, but {} runs on the host", kdev.str(),
                                     local_experts.name));
      }
      // f's x / topk_ids / topk_weights / expert_map / expert_num_tokens / out are set from these
      // host tensors (undefined ones stay absent).
      const auto run_local = [&](FusedMoeArgs f, const Tensor& x, const Tensor& tids,
                                 const Tensor& tw, const Tensor& map, const Tensor& counts,
                                 const Tensor& host_out) {
        const Tensor dx = on_kdev(x), dout = on_kdev(host_out);
        const Tensor dids = tids.defined() ? on_kdev(tids) : Tensor();
        const Tensor dw = tw.defined() ? on_kdev(tw) : Tensor();
        const Tensor dmap = map.defined() ? on_kdev(map) : Tensor();
        const Tensor dcounts = counts.defined() ? on_kdev(counts) : Tensor();
        f.x = dx;
        f.out = dout;
        f.topk_ids = dids;
        f.topk_weights = dw;
        f.expert_map = dmap;
        f.expert_num_tokens = dcounts;
        const std::size_t wsb = local_experts.workspace_size ? local_experts.workspace_size(f) : 0;
        const Tensor ws =
            wsb ? Tensor::empty({static_cast<int64_t>(wsb)}, DType::kU8, kdev) : Tensor();
        local_experts.run(f, ws.data());
        if (!kdev.is_cpu()) {
          const Tensor back_h = dout.to(Device::cpu());
          std::memcpy(host_out.data(), back_h.data(), host_out.nbytes());
        }
      };
      const std::vector<int32_t> emap = layout.expert_map(me);
      Tensor emap_t = Tensor::empty({static_cast<int64_t>(emap.size())}, DType::kI32);
      std::copy(emap.begin(), emap.end(), emap_t.ptr<int32_t>());
      if (format == EpExpertsFormat::kStandard) {
        FusedMoeArgs f;
        f.routing = a.routing;
        f.routing.topk = static_cast<int>(k);
        // Routed already (the ids are given): the host-side correction bias stays out of a device
        // kernel's arguments, which must all be device tensors.
        f.routing.e_score_correction_bias = {};
        f.weights = a.weights;
        f.scheme = a.scheme;
        f.act = a.act;
        f.apply_router_weight_on_input = a.apply_router_weight_on_input;
        f.batch_invariant = a.batch_invariant;
        run_local(f, recv_x, recv_ids, recv_w, emap_t, Tensor(), partial);
      } else {
        // One slab per local expert holding the (row, slot) pairs routed to it, in row order.
        const int E_local = layout.num_local(me);
        std::vector<std::vector<std::pair<int64_t, int64_t>>> per(E_local);
        const int32_t* rid = recv_ids.ptr<const int32_t>();
        for (int64_t i = 0; i < R; ++i)
          for (int64_t j = 0; j < k; ++j)
            if (rid[i * k + j] >= 0) per[emap[rid[i * k + j]]].emplace_back(i, j);
        int64_t max_m = 0;
        for (const auto& v : per) max_m = std::max<int64_t>(max_m, static_cast<int64_t>(v.size()));
        Tensor xb = Tensor::zeros({E_local, std::max<int64_t>(max_m, 1), H}, xdt);
        Tensor yb = Tensor::zeros({E_local, std::max<int64_t>(max_m, 1), H}, pdt);
        Tensor counts = Tensor::empty({E_local}, DType::kI32);
        for (int e = 0; e < E_local; ++e) {
          counts.ptr<int32_t>()[e] = static_cast<int32_t>(per[e].size());
          for (std::size_t m = 0; m < per[e].size(); ++m) {
            std::memcpy(static_cast<char*>(xb.data()) + (e * xb.size(1) + m) * row_bytes,
                        static_cast<const char*>(recv_x.data()) + per[e][m].first * row_bytes,
                        row_bytes);
          }
        }
        FusedMoeArgs f;
        f.weights = a.weights;
        f.scheme = a.scheme;
        f.act = a.act;
        f.batch_invariant = a.batch_invariant;
        run_local(f, xb, Tensor(), Tensor(), Tensor(), counts, yb);
        // Weighted sum of the slab rows back into each received row, in (row, slot) order.
        std::vector<float> acc(static_cast<std::size_t>(R * H), 0.0f);
        std::vector<std::pair<int64_t, int64_t>> where(static_cast<std::size_t>(R * k), {-1, -1});
        for (int e = 0; e < E_local; ++e)
          for (std::size_t m = 0; m < per[e].size(); ++m)
            where[per[e][m].first * k + per[e][m].second] = {e, static_cast<int64_t>(m)};
        const float* w = recv_w.ptr<const float>();
        for (int64_t i = 0; i < R; ++i) {
          for (int64_t j = 0; j < k; ++j) {
            const auto [e, m] = where[i * k + j];
            if (e < 0) continue;
            const TensorView row(static_cast<char*>(yb.data()) + (e * yb.size(1) + m) * prow_bytes,
                                 pdt, {H});
            for (int64_t h = 0; h < H; ++h) acc[i * H + h] += w[i * k + j] * load(row, h);
          }
        }
        for (int64_t n = 0; n < R * H; ++n) {
          if (pdt == DType::kF32) {
            partial.ptr<float>()[n] = acc[n];
          } else {
            partial.ptr<uint16_t>()[n] = numerics::float_to_bf16(acc[n]);
          }
        }
      }
    } catch (const Error& e) {
      error = fmt::format("rank {} local experts ({}): {}", me, local_experts.name, e.what());
      std::memset(partial.data(), 0, partial.nbytes());
    }
  }
  stats.compute_s = seconds_since(t0);

  // ---- combine: partial rows go back to their source; sum in rank order, round once
  t0 = std::chrono::steady_clock::now();
  std::vector<char> back(static_cast<std::size_t>(S) * prow_bytes);
  all_to_all_v_host(comm, partial.data(), recv_counts, back.data(), send_counts, prow_bytes);
  // Every rank learns whether any peer failed: a failed rank returned zeros, so its peers' outputs
  // would be silently wrong.
  std::vector<int64_t> failed_send(nranks, error.empty() ? 0 : 1), failed_recv(nranks);
  comm.all_to_all_counts(failed_send, failed_recv);
  for (int r = 0; r < nranks && error.empty(); ++r) {
    if (failed_recv[r]) error = fmt::format("EP forward failed on rank {} (see its error)", r);
  }
  if (error.empty()) {
    std::vector<float> acc(static_cast<std::size_t>(M * H), 0.0f);
    int64_t row = 0;
    for (int d = 0; d < nranks; ++d) {
      for (int64_t t : to_rank[d]) {
        const TensorView src(back.data() + row * prow_bytes, pdt, {H});
        for (int64_t h = 0; h < H; ++h) acc[t * H + h] += load(src, h);
        ++row;
      }
    }
    for (int64_t n = 0; n < M * H; ++n) {
      if (xdt == DType::kF32) {
        a.out.ptr<float>()[n] = acc[n];
      } else {
        a.out.ptr<uint16_t>()[n] = numerics::float_to_bf16(acc[n]);
      }
    }
  }
  stats.combine_s = seconds_since(t0);
  if (!error.empty()) throw ValueError(error);
  return stats;
}

}  // namespace fp8moe
