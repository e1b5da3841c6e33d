// The MoE layer description the oracle decides on: vLLM's MoEActivation, RoutingMethodType,
// FusedMoEParallelConfig and FusedMoEConfig (fused_moe/config.py), field for field.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "fp8moe/dtype.hpp"

namespace fp8moe {

// ---- MoEActivation
// ----------------------------------------------------------------------------------
enum class MoeActivation : uint8_t {
  kSilu,
  kGelu,
  kGeluTanh,
  kRelu2,
  kSwigluOai,  // gpt-oss, interleaved gate/up columns
  kSitu,
  kSwigluOaiUninterleave,  // packed [gates; ups]
  kSwigluStep,
  kSiluNoMul,
  kGeluNoMul,
  kGeluTanhNoMul,
  kRelu2NoMul,
};
// .value: "silu", "swigluoai_uninterleave", "relu2_no_mul", ...
std::string_view activation_value(MoeActivation a);
// str(MoEActivation.SILU): "MoEActivation.SILU"
std::string activation_repr(MoeActivation a);
// MoEActivation.from_str: accepts the values and the alias "gelu_pytorch_tanh" -> gelu_tanh.
// Throws ValueError naming the value and the accepted names.
MoeActivation activation_from_str(std::string_view s);
// is_gated: the value does not end with "_no_mul".
bool activation_is_gated(MoeActivation a);

// ---- RoutingMethodType (IntEnum)
// --------------------------------------------------------------------
enum class RoutingMethodType : int {
  kDefault = 0,           // softmax -> topk
  kRenormalize = 1,       // topk -> softmax
  kDeepSeekV3 = 2,        // sigmoid + bias, grouped
  kLlama4 = 3,            // top1 -> sigmoid
  kRenormalizeNaive = 4,  // softmax -> topk -> renorm
  kTopK = 5,
  kSigmoidRenorm = 6,
  kMiniMax2 = 7,  // sigmoid + bias -> topk -> scaled sum-normalise
  kSigmoid = 8,
  kUnspecified = 9,
  kDeepseekV4 = 100,
  kCustom = 101,
  kSimulated = 102,
};
std::string_view routing_method_name(RoutingMethodType r);  // "DeepSeekV3"
// Parses a name ("DeepSeekV3", case-insensitive) or an integer value. Throws ValueError.
RoutingMethodType parse_routing_method(std::string_view s);
// vLLM get_routing_method_type(scoring_func, top_k, renormalize, num_expert_group,
// has_e_score_bias, routed_scaling_factor).
RoutingMethodType get_routing_method_type(std::string_view scoring_func, int top_k,
                                          bool renormalize, std::optional<int> num_expert_group,
                                          bool has_e_score_bias,
                                          std::optional<double> routed_scaling_factor = 1.0);

// ---- FusedMoEParallelConfig
// -------------------------------------------------------------------------
struct MoeParallelConfig {
  int tp_size = 1;
  int pcp_size = 1;
  int dp_size = 1;
  int ep_size = 1;
  int tp_rank = 0;
  int pcp_rank = 0;
  int dp_rank = 0;
  int ep_rank = 0;
  int sp_size = 1;
  bool use_ep = false;
  std::string all2all_backend = "allgather_reducescatter";
  bool enable_eplb = false;

  bool is_sequence_parallel() const { return sp_size > 1; }
  bool use_all2all_kernels() const {
    return use_ep && (dp_size > 1 || pcp_size > 1 || is_sequence_parallel());
  }
  bool use_deepep_ht_kernels() const;
  bool use_deepep_ll_kernels() const;
  bool use_fi_nvl_two_sided_kernels() const;
  bool use_fi_nvl_one_sided_kernels() const;
  bool use_ag_rs_all2all_kernels() const;
  bool use_mori_kernels() const;
  bool use_nixl_ep_kernels() const;
  bool use_deepep_v2_kernels() const;
  bool use_batched_activation_format() const;
  bool needs_round_robin_routing_tables() const { return use_batched_activation_format(); }

  // Python dataclass repr: "FusedMoEParallelConfig(tp_size=1, pcp_size=1, ..., enable_eplb=False)".
  std::string repr() const;

  // vLLM make(): DP and PCP are flattened into TP; with expert parallelism the flattened TP becomes
  // EP.
  static MoeParallelConfig make(int tp_size, int pcp_size, int dp_size, int sp_size,
                                bool enable_expert_parallel, const std::string& all2all_backend,
                                bool enable_eplb, int tp_rank = 0, int pcp_rank = 0,
                                int dp_rank = 0);
  static MoeParallelConfig make_no_parallel() { return {}; }
};

// The all2all_backend names vLLM's parallel config accepts (the predicates above test them).
const std::vector<std::string>& known_all2all_backends();

// ---- FusedMoEConfig
// ---------------------------------------------------------------------------------
struct MoeConfig {
  int num_experts = 0;          // global physical experts
  int experts_per_token = 0;    // top-k
  int hidden_dim = 0;           // H
  int intermediate_size = 0;    // global I per expert (un-sharded)
  int num_local_experts = 0;    // experts on this EP rank
  int num_logical_experts = 0;  // non-redundant experts
  MoeActivation activation = MoeActivation::kSilu;
  std::string device = "cuda";
  RoutingMethodType routing_method = RoutingMethodType::kRenormalize;
  MoeParallelConfig moe_parallel_config{};
  DType in_dtype = DType::kBF16;
  std::optional<DType> router_logits_dtype{};  // None -> in_dtype after post_init()
  std::optional<int> hidden_dim_unpadded{};
  std::optional<int> intermediate_size_per_partition_unpadded{};
  std::optional<int> intermediate_pad{};
  std::string moe_backend = "auto";
  int max_num_tokens = 256;
  bool has_bias = false;
  bool is_lora_enabled = false;
  bool skip_final_all_reduce = false;
  bool defer_moe_finalize = false;
  int defer_moe_finalize_max_num_tokens = -1;
  std::optional<double> swiglu_limit{};
  std::optional<double> swiglu_alpha{};
  std::optional<double> swiglu_beta{};
  std::optional<double> activation_situ_beta{};
  std::optional<double> activation_situ_linear_beta{};
  int max_capture_size = 0;
  // Set by post_init_for_platform (oracle.hpp) when is_act_and_mul: AITER's fused MoE is enabled
  // (rocm_aiter_ops.is_fused_moe_enabled()); the shared-experts fusion is never enabled in fp8moe.
  bool rocm_aiter_fmoe_enabled = false;
  bool aiter_fmoe_shared_expert_enabled = false;
  int intermediate_size_per_partition = -1;  // set by post_init(): intermediate_size / tp_size
  bool tp_shard_with_padding = false;        // set by pad_tp_shard_to_weight_blocks()

  // vLLM __post_init__: fills the derived fields. Throws ValueError on sizes that cannot be
  // (non-positive sizes, topk > experts, I not divisible by tp_size).
  void post_init();

  bool is_act_and_mul() const { return activation_is_gated(activation); }
  int w13_num_shards() const { return is_act_and_mul() ? 2 : 1; }
  int tp_size() const { return moe_parallel_config.tp_size; }
  int dp_size() const { return moe_parallel_config.dp_size; }
  int pcp_size() const { return moe_parallel_config.pcp_size; }
  int ep_size() const { return moe_parallel_config.ep_size; }
  int sp_size() const { return moe_parallel_config.sp_size; }
  int tp_rank() const { return moe_parallel_config.tp_rank; }
  int ep_rank() const { return moe_parallel_config.ep_rank; }
  int dp_rank() const { return moe_parallel_config.dp_rank; }
  int pcp_rank() const { return moe_parallel_config.pcp_rank; }
  bool is_sequence_parallel() const { return moe_parallel_config.is_sequence_parallel(); }
  bool use_all2all_kernels() const { return moe_parallel_config.use_all2all_kernels(); }
  bool use_deepep_ht_kernels() const { return moe_parallel_config.use_deepep_ht_kernels(); }
  bool use_deepep_ll_kernels() const { return moe_parallel_config.use_deepep_ll_kernels(); }
  bool use_fi_nvl_two_sided_kernels() const {
    return moe_parallel_config.use_fi_nvl_two_sided_kernels();
  }
  bool use_fi_nvl_one_sided_kernels() const {
    return moe_parallel_config.use_fi_nvl_one_sided_kernels();
  }
  bool use_mori_kernels() const { return moe_parallel_config.use_mori_kernels(); }
  bool use_nixl_ep_kernels() const { return moe_parallel_config.use_nixl_ep_kernels(); }
  bool use_deepep_v2_kernels() const { return moe_parallel_config.use_deepep_v2_kernels(); }
  bool use_ep() const { return moe_parallel_config.use_ep; }
  DType logits_dtype() const { return router_logits_dtype.value_or(in_dtype); }
};

}  // namespace fp8moe
