// forward_expert_parallel: one EP rank of an Fp8MoeLayer over a Communicator (see layer.hpp). The
// layer supplies the local experts, the plan's scheme and kernel; ep_moe_forward does the
// dispatch / compute / combine.
#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "fp8moe/error.hpp"
#include "fp8moe/layer.hpp"

namespace fp8moe {

namespace {

// A host copy of a (possibly device) view's bytes.
Tensor host_copy(const TensorView& v) {
  Tensor h = Tensor::empty(std::span<const int64_t>(v.shape.data(), v.ndim), v.dtype);
  if (v.nbytes() == 0) return h;
  if (v.device.is_cpu()) {
    std::memcpy(h.data(), v.data, v.nbytes());
  } else {
    const DeviceAllocator& a = device_allocator();
    if (!a.copy) throw RuntimeError("no device copy hook (a build without CUDA?)");
    a.copy(h.data(), v.data, v.nbytes(), 1);
  }
  return h;
}

bool host_2d(const TensorView& t) { return t.defined() && t.ndim == 2 && t.device.is_cpu(); }

// Why this rank cannot take part ("" when it can).
std::string rank_error(const Fp8MoeLayer& layer, const Communicator& comm, const EpLayout& layout,
                       const TensorView& x, const TensorView& logits, const TensorView& out) {
  const Fp8MoeLayerPlan& p = layer.plan();
  const MoeConfig& cfg = p.config;
  if (cfg.use_ep()) {
    if (cfg.ep_size() != comm.size() || cfg.ep_rank() != comm.rank()) {
      return fmt::format("the layer is EP rank {} of {}, the communicator is rank {} of {}",
                         cfg.ep_rank(), cfg.ep_size(), comm.rank(), comm.size());
    }
  } else if (comm.size() != 1) {
    return fmt::format(
        "the layer holds every expert (no expert parallelism), the communicator has {} ranks",
        comm.size());
  }
  if (cfg.tp_size() != 1) {
    return fmt::format("the layer is also TP-sharded (tp_size {}); EP here takes whole experts",
                       cfg.tp_size());
  }
  const int64_t H = layer.hidden_size();
  if (!host_2d(x) || x.size(1) != H || (x.dtype != DType::kBF16 && x.dtype != DType::kF32)) {
    return fmt::format("x must be a host (M, {}) bf16/f32 tensor, got {}", H,
                       x.defined() ? x.describe() : std::string("nothing"));
  }
  const int64_t M = x.size(0);
  if (!host_2d(logits) || logits.size(0) != M || logits.size(1) != layer.num_experts() ||
      (logits.dtype != DType::kF32 && logits.dtype != DType::kBF16)) {
    return fmt::format("router_logits must be a host ({}, {}) f32/bf16 tensor, got {}", M,
                       layer.num_experts(),
                       logits.defined() ? logits.describe() : std::string("nothing"));
  }
  if (!host_2d(out) || out.size(0) != M || out.size(1) != H || out.dtype != x.dtype) {
    return fmt::format("out must be a host ({}, {}) {} tensor, got {}", M, H, dtype_name(x.dtype),
                       out.defined() ? out.describe() : std::string("nothing"));
  }
  // The layer's experts must be the ones the layout says this rank holds.
  const std::vector<int32_t> want = layout.expert_map(comm.rank());
  if (cfg.use_ep()) {
    const TensorView em = layer.weights().expert_map.view();
    if (!em.defined() || em.numel() != static_cast<int64_t>(want.size())) {
      return "the layer has no expert_map of E entries";
    }
    const Tensor h = host_copy(em);
    if (!std::equal(want.begin(), want.end(), h.ptr<const int32_t>())) {
      return fmt::format(
          "the layer's experts are not those of vLLM's linear placement for rank {} of {}",
          comm.rank(), comm.size());
    }
  }
  return {};
}

}  // namespace

EpMoeStats forward_expert_parallel(const Fp8MoeLayer& layer, Communicator& comm,
                                   const TensorView& x, const TensorView& router_logits,
                                   const TensorView& out, const EpForwardOptions& options) {
  const int n = comm.size();
  const EpLayout layout = EpLayout::linear(layer.num_experts(), n);
  std::string error;
  try {
    error = rank_error(layer, comm, layout, x, router_logits, out);
  } catch (const Error& e) {
    error = e.what();
  }
  // Every rank learns every rank's M (the global batch the kernel choice sees) or that one of
  // them cannot take part: then all throw, before any dispatch.
  const int64_t M = error.empty() ? x.size(0) : -1;
  std::vector<int64_t> send(static_cast<std::size_t>(n), M), recv(static_cast<std::size_t>(n));
  comm.all_to_all_counts(send, recv);
  int64_t global_m = 0;
  for (int r = 0; r < n; ++r) {
    if (recv[r] < 0 && error.empty()) {
      error = fmt::format("EP rank {} cannot take part (see its error)", r);
    }
    global_m += recv[r];
  }
  if (!error.empty()) throw ValueError(fmt::format("EP rank {}: {}", comm.rank(), error));

  // The same on every rank: the plans differ only in the rank.
  const KernelChoice kc = layer.kernel_for(std::max<int64_t>(global_m, 1));
  if (!kc.impl) {
    throw NotImplementedError(
        fmt::format("Fp8MoeLayer: no implementation runs M = {}: {}", global_m, kc.why));
  }
  if (implementation_weight_layout(*kc.impl) != layer.weights().layout) {
    throw ValueError(fmt::format("{} reads {} weights, the layer's are prepared as {}",
                                 kc.impl->name,
                                 weight_layout_name(implementation_weight_layout(*kc.impl)),
                                 weight_layout_name(layer.weights().layout)));
  }
  const EpExpertsFormat format = options.format.value_or(layer.plan().selection.activation_format ==
                                                                 ActivationFormat::kBatchedExperts
                                                             ? EpExpertsFormat::kBatched
                                                             : EpExpertsFormat::kStandard);

  EpMoeArgs a;
  a.x = x;
  a.router_logits = router_logits;
  a.routing = layer.routing();
  // Routing runs on the host: a device layer's correction bias is copied.
  Tensor bias;
  if (a.routing.e_score_correction_bias.defined() &&
      !a.routing.e_score_correction_bias.device.is_cpu()) {
    bias = host_copy(a.routing.e_score_correction_bias);
    a.routing.e_score_correction_bias = bias;
  }
  a.weights = layer.weights().views();
  a.scheme = layer.plan().scheme;
  a.act = layer.plan().activation;
  a.apply_router_weight_on_input = layer.apply_router_weight_on_input();
  a.batch_invariant = layer.plan().batch_invariant;
  a.out = out;
  return ep_moe_forward(comm, *kc.impl, format, layout, a);
}

}  // namespace fp8moe
