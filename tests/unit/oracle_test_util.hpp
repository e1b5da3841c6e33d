// Helpers shared by the oracle tests: a compact deployment description that builds a MoeConfig the
// way vLLM does (MoeParallelConfig::make, post_init), platforms, environments.
#pragma once

#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "fp8moe/error.hpp"
#include "fp8moe/oracle.hpp"

namespace fp8moe::testing {

struct Deploy {
  int E = 128, topk = 8, H = 2048, I = 768;
  int tp = 1, dp = 1, pcp = 1, sp = 1;
  bool ep = false;
  std::string a2a = "allgather_reducescatter";
  bool eplb = false;
  MoeActivation act = MoeActivation::kSilu;
  RoutingMethodType routing = RoutingMethodType::kRenormalize;
  DType dtype = DType::kBF16;
  std::optional<DType> logits{};
  std::string backend = "auto";
  bool lora = false, bias = false;
  std::optional<double> limit{}, alpha{}, beta{};

  MoeConfig build() const {
    MoeConfig c;
    c.num_experts = E;
    c.experts_per_token = topk;
    c.hidden_dim = H;
    c.intermediate_size = I;
    c.moe_parallel_config = MoeParallelConfig::make(tp, pcp, dp, sp, ep, a2a, eplb);
    c.activation = act;
    c.routing_method = routing;
    c.in_dtype = dtype;
    c.router_logits_dtype = logits;
    c.moe_backend = backend;
    c.is_lora_enabled = lora;
    c.has_bias = bias;
    c.swiglu_limit = limit;
    c.swiglu_alpha = alpha;
    c.swiglu_beta = beta;
    c.post_init();
    return c;
  }
};

inline Platform plat(const std::string& text, const std::string& installed = "all") {
  Platform p = Platform::parse(text);
  p.set_installed(installed);
  return p;
}

inline OracleEnv env_of(const std::vector<std::pair<std::string, std::string>>& kv) {
  OracleEnv e;
  for (const auto& [k, v] : kv) e.set(k, v);
  return e;
}

// The named keys in the platform's flavour.
inline OptQuantKey K(const QuantKey& k, const Platform& p) {
  return with_fp8_dtype(k, p.fp8_dtype());
}

inline std::string msg_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return std::string(e.kind()) + ": " + e.what();
  }
  return "<no error>";
}

inline std::string pc_repr(int tp, int pcp, int dp, int ep, int tp_rank, int ep_rank, int sp,
                           bool use_ep, const std::string& a2a, bool eplb) {
  return "FusedMoEParallelConfig(tp_size=" + std::to_string(tp) +
         ", pcp_size=" + std::to_string(pcp) + ", dp_size=" + std::to_string(dp) +
         ", ep_size=" + std::to_string(ep) + ", tp_rank=" + std::to_string(tp_rank) +
         ", pcp_rank=0, dp_rank=0, ep_rank=" + std::to_string(ep_rank) +
         ", sp_size=" + std::to_string(sp) + ", use_ep=" + (use_ep ? "True" : "False") +
         ", all2all_backend='" + a2a + "', enable_eplb=" + (eplb ? "True" : "False") + ")";
}

}  // namespace fp8moe::testing
