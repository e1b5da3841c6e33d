// MoEActivation, RoutingMethodType, FusedMoEParallelConfig and FusedMoEConfig: names, derived
// properties and vLLM's make()/__post_init__ logic.
#include "fp8moe/config.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <string>
#include <vector>

#include "fp8moe/error.hpp"

namespace fp8moe {

namespace {
struct ActivationName {
  MoeActivation a;
  std::string_view value;
  std::string_view member;
};
constexpr std::array<ActivationName, 12> kActivations{{
    {MoeActivation::kSilu, "silu", "SILU"},
    {MoeActivation::kGelu, "gelu", "GELU"},
    {MoeActivation::kGeluTanh, "gelu_tanh", "GELU_TANH"},
    {MoeActivation::kRelu2, "relu2", "RELU2"},
    {MoeActivation::kSwigluOai, "swigluoai", "SWIGLUOAI"},
    {MoeActivation::kSitu, "situ", "SITU"},
    {MoeActivation::kSwigluOaiUninterleave, "swigluoai_uninterleave", "SWIGLUOAI_UNINTERLEAVE"},
    {MoeActivation::kSwigluStep, "swiglustep", "SWIGLUSTEP"},
    {MoeActivation::kSiluNoMul, "silu_no_mul", "SILU_NO_MUL"},
    {MoeActivation::kGeluNoMul, "gelu_no_mul", "GELU_NO_MUL"},
    {MoeActivation::kGeluTanhNoMul, "gelu_tanh_no_mul", "GELU_TANH_NO_MUL"},
    {MoeActivation::kRelu2NoMul, "relu2_no_mul", "RELU2_NO_MUL"},
}};

std::string lower(std::string_view s) {
  std::string r(s);
  std::transform(r.begin(), r.end(), r.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return r;
}
}  // namespace

std::string_view activation_value(MoeActivation a) {
  for (const auto& n : kActivations)
    if (n.a == a) return n.value;
  return "?";
}

std::string activation_repr(MoeActivation a) {
  for (const auto& n : kActivations)
    if (n.a == a) return fmt::format("MoEActivation.{}", n.member);
  return "MoEActivation.?";
}

MoeActivation activation_from_str(std::string_view s) {
  const std::string v = lower(s);
  if (v == "gelu_pytorch_tanh") return MoeActivation::kGeluTanh;
  for (const auto& n : kActivations)
    if (n.value == v) return n.a;
  std::string names;
  for (const auto& n : kActivations)
    names += fmt::format("{}{}", names.empty() ? "" : ", ", n.value);
  throw ValueError(
      fmt::format("unknown activation '{}': expected one of {} (or gelu_pytorch_tanh)", s, names));
}

bool activation_is_gated(MoeActivation a) {
  const std::string_view v = activation_value(a);
  return !(v.size() >= 7 && v.substr(v.size() - 7) == "_no_mul");
}

namespace {
struct RoutingName {
  RoutingMethodType r;
  std::string_view name;
};
constexpr std::array<RoutingName, 13> kRoutingNames{{
    {RoutingMethodType::kDefault, "Default"},
    {RoutingMethodType::kRenormalize, "Renormalize"},
    {RoutingMethodType::kDeepSeekV3, "DeepSeekV3"},
    {RoutingMethodType::kLlama4, "Llama4"},
    {RoutingMethodType::kRenormalizeNaive, "RenormalizeNaive"},
    {RoutingMethodType::kTopK, "TopK"},
    {RoutingMethodType::kSigmoidRenorm, "SigmoidRenorm"},
    {RoutingMethodType::kMiniMax2, "MiniMax2"},
    {RoutingMethodType::kSigmoid, "Sigmoid"},
    {RoutingMethodType::kUnspecified, "Unspecified"},
    {RoutingMethodType::kDeepseekV4, "DeepseekV4"},
    {RoutingMethodType::kCustom, "Custom"},
    {RoutingMethodType::kSimulated, "Simulated"},
}};
}  // namespace

std::string_view routing_method_name(RoutingMethodType r) {
  for (const auto& n : kRoutingNames)
    if (n.r == r) return n.name;
  return "?";
}

RoutingMethodType parse_routing_method(std::string_view s) {
  const std::string v = lower(s);
  for (const auto& n : kRoutingNames)
    if (lower(n.name) == v || std::to_string(static_cast<int>(n.r)) == v) return n.r;
  std::string names;
  for (const auto& n : kRoutingNames)
    names += fmt::format("{}{}", names.empty() ? "" : ", ", n.name);
  throw ValueError(fmt::format(
      "unknown routing method '{}': expected one of {} or its integer value", s, names));
}

RoutingMethodType get_routing_method_type(std::string_view scoring_func, int top_k,
                                          bool renormalize, std::optional<int> num_expert_group,
                                          bool has_e_score_bias,
                                          std::optional<double> routed_scaling_factor) {
  (void)top_k;
  if (scoring_func == "sqrtsoftplus") {
    return renormalize ? RoutingMethodType::kDeepseekV4 : RoutingMethodType::kUnspecified;
  }
  if (has_e_score_bias) {
    if (scoring_func == "sigmoid") {
      if (!renormalize) return RoutingMethodType::kUnspecified;
      if (num_expert_group.value_or(0) > 0) return RoutingMethodType::kDeepSeekV3;
      if (!routed_scaling_factor || *routed_scaling_factor == 1.0)
        return RoutingMethodType::kMiniMax2;
      return RoutingMethodType::kUnspecified;
    }
    return RoutingMethodType::kUnspecified;
  }
  if (scoring_func == "sigmoid") {
    return renormalize ? RoutingMethodType::kSigmoidRenorm : RoutingMethodType::kSigmoid;
  }
  if (scoring_func == "softmax") {
    return renormalize ? RoutingMethodType::kRenormalizeNaive : RoutingMethodType::kDefault;
  }
  return RoutingMethodType::kUnspecified;
}

// ---- MoeParallelConfig
// --------------------------------------------------------------------------------
const std::vector<std::string>& known_all2all_backends() {
  static const std::vector<std::string> v = {"allgather_reducescatter",
                                             "naive",
                                             "pplx",
                                             "deepep_high_throughput",
                                             "deepep_low_latency",
                                             "deepep_v2",
                                             "flashinfer_all2allv",
                                             "flashinfer_nvlink_one_sided",
                                             "flashinfer_nvlink_two_sided",
                                             "mori_high_throughput",
                                             "mori_low_latency",
                                             "nixl_ep"};
  return v;
}

bool MoeParallelConfig::use_deepep_ht_kernels() const {
  return use_all2all_kernels() && all2all_backend == "deepep_high_throughput";
}
bool MoeParallelConfig::use_deepep_ll_kernels() const {
  return use_all2all_kernels() && all2all_backend == "deepep_low_latency";
}
bool MoeParallelConfig::use_fi_nvl_two_sided_kernels() const {
  return use_all2all_kernels() && (all2all_backend == "flashinfer_all2allv" ||
                                   all2all_backend == "flashinfer_nvlink_two_sided");
}
bool MoeParallelConfig::use_fi_nvl_one_sided_kernels() const {
  return use_all2all_kernels() && all2all_backend == "flashinfer_nvlink_one_sided";
}
bool MoeParallelConfig::use_ag_rs_all2all_kernels() const {
  return use_all2all_kernels() && all2all_backend == "allgather_reducescatter";
}
bool MoeParallelConfig::use_mori_kernels() const {
  return use_all2all_kernels() &&
         (all2all_backend == "mori_high_throughput" || all2all_backend == "mori_low_latency");
}
bool MoeParallelConfig::use_nixl_ep_kernels() const {
  return use_all2all_kernels() && all2all_backend == "nixl_ep";
}
bool MoeParallelConfig::use_deepep_v2_kernels() const {
  return use_all2all_kernels() && all2all_backend == "deepep_v2";
}
bool MoeParallelConfig::use_batched_activation_format() const {
  return use_deepep_ll_kernels() || use_nixl_ep_kernels();
}

std::string MoeParallelConfig::repr() const {
  return fmt::format(
      "FusedMoEParallelConfig(tp_size={}, pcp_size={}, dp_size={}, ep_size={}, tp_rank={}, "
      "pcp_rank={}, dp_rank={}, ep_rank={}, sp_size={}, use_ep={}, all2all_backend='{}', "
      "enable_eplb={})",
      tp_size, pcp_size, dp_size, ep_size, tp_rank, pcp_rank, dp_rank, ep_rank, sp_size,
      use_ep ? "True" : "False", all2all_backend, enable_eplb ? "True" : "False");
}

MoeParallelConfig MoeParallelConfig::make(int tp_size_, int pcp_size_, int dp_size_, int sp_size_,
                                          bool enable_expert_parallel,
                                          const std::string& all2all_backend_, bool enable_eplb_,
                                          int tp_rank_, int pcp_rank_, int dp_rank_) {
  auto positive = [](const char* what, int v) {
    if (v < 1) throw ValueError(fmt::format("{} must be a positive integer, got {}", what, v));
  };
  positive("tp_size", tp_size_);
  positive("pcp_size", pcp_size_);
  positive("dp_size", dp_size_);
  positive("sp_size", sp_size_);
  MoeParallelConfig c;
  c.pcp_size = pcp_size_;
  c.dp_size = dp_size_;
  c.sp_size = sp_size_;
  c.pcp_rank = pcp_rank_;
  c.dp_rank = dp_rank_;
  c.all2all_backend = all2all_backend_;
  c.enable_eplb = enable_eplb_;
  const int flat_tp = dp_size_ * pcp_size_ * tp_size_;
  const int flat_rank = dp_rank_ * pcp_size_ * tp_size_ + pcp_rank_ * tp_size_ + tp_rank_;
  c.use_ep = flat_tp > 1 && enable_expert_parallel;
  if (!c.use_ep) {
    c.tp_size = flat_tp;
    c.tp_rank = flat_rank;
    c.ep_size = 1;
    c.ep_rank = 0;
  } else {
    c.tp_size = 1;
    c.tp_rank = 0;
    c.ep_size = flat_tp;
    c.ep_rank = flat_rank;
  }
  return c;
}

// ---- MoeConfig
// ----------------------------------------------------------------------------------------
void MoeConfig::post_init() {
  auto positive = [](const char* what, int v) {
    if (v < 1) throw ValueError(fmt::format("{} must be a positive integer, got {}", what, v));
  };
  positive("num_experts", num_experts);
  positive("experts_per_token (topk)", experts_per_token);
  positive("hidden_dim", hidden_dim);
  positive("intermediate_size", intermediate_size);
  if (experts_per_token > num_experts) {
    throw ValueError(fmt::format("experts_per_token (topk) = {} exceeds num_experts = {}",
                                 experts_per_token, num_experts));
  }
  const int tp = moe_parallel_config.tp_size;
  positive("tp_size", tp);
  if (num_local_experts <= 0)
    num_local_experts = num_experts / std::max(1, moe_parallel_config.ep_size);
  if (num_logical_experts <= 0) num_logical_experts = num_experts;
  if (!router_logits_dtype) router_logits_dtype = in_dtype;
  if (!hidden_dim_unpadded) hidden_dim_unpadded = hidden_dim;
  if (intermediate_size_per_partition < 0) {
    // vLLM asserts divisibility here; we raise a ValueError with the numbers instead.
    if (intermediate_size % tp != 0) {
      throw ValueError(fmt::format("intermediate_size {} is not divisible by tp_size {}",
                                   intermediate_size, tp));
    }
    intermediate_size_per_partition = intermediate_size / tp;
  }
  if (!intermediate_size_per_partition_unpadded) {
    intermediate_size_per_partition_unpadded = intermediate_size_per_partition;
  }
}

}  // namespace fp8moe
