// The FP8 MoE oracle: vLLM's fused_moe/oracle/fp8.py in C++, with the same decisions, the same
// messages and the same edge cases, plus a decision trace.
//
//   resolve_fp8_moe_weight_block_shape   refine | pad | keep the checkpoint's weight blocks for TP
//   select_fp8_moe_backend               backend + experts kernel + candidates + trace
//   make_fp8_moe_quant_config            the MoeQuantConfig the chosen backend runs with
//
// Pure: everything arrives as values (MoeConfig, the two QuantKeys, a Platform, an OracleEnv).
// Nothing here reads the environment or queries a device. Errors mirror vLLM's exception kinds and
// texts (fp8moe::ValueError / NotImplementedError).
#pragma once

#include <array>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "fp8moe/backend.hpp"
#include "fp8moe/config.hpp"
#include "fp8moe/experts.hpp"
#include "fp8moe/oracle_env.hpp"
#include "fp8moe/platform.hpp"
#include "fp8moe/quant_config.hpp"
#include "fp8moe/quant_key.hpp"

namespace fp8moe {

// ---- Backend lists
// --------------------------------------------------------------------------------

// vLLM backend_to_kernel_cls(backend): the expert classes tried, in order (oracle.md §1.2; CPU_W8A8
// -> [CPUExpertsFp8W8A8], fp8moe's class for the seed's backend). Registered backends return their
// kernels. NONE or an unknown value raises ValueError("Unknown FP8 MoE backend: NONE").
std::vector<const ExpertsKernel*> backend_to_kernel_cls(Fp8MoeBackend backend);

// vLLM _get_priority_backends(moe_config, weight_key, activation_key): the base order with the four
// reorder rules applied in sequence (1: SM10x + DeepEP v2 + block keys -> FLASHINFER_TRTLLM first;
// 2: SM90 + block keys -> FLASHINFER_CUTLASS first with EP, TRITON first without; 3: XPU first on
// XPU; 4: CPU then CPU_W8A8 to the front on CPU). Registered auto-select backends are placed before
// the rules run. `applied` (optional) receives one line per rule that fired.
std::vector<Fp8MoeBackend> get_priority_backends(const MoeConfig& config,
                                                 const OptQuantKey& weight_key,
                                                 const OptQuantKey& activation_key,
                                                 const Platform& platform,
                                                 std::vector<std::string>* applied = nullptr);

// ---- Selection
// ------------------------------------------------------------------------------------

struct TraceEntry {
  Fp8MoeBackend backend = Fp8MoeBackend::kNone;
  std::string kernel;  // vLLM class name
  bool supported = false;
  std::string reason;  // vLLM's reason when not supported ("" when supported)
};

struct Selection {
  Fp8MoeBackend backend = Fp8MoeBackend::kNone;
  const ExpertsKernel* kernel = nullptr;  // nullptr for NONE
  // The AVAILABLE_BACKENDS values as vLLM's info log prints them (after any removal).
  std::vector<std::string> candidates;
  std::vector<TraceEntry> trace;  // every class tried, in order
  // How the choice was made: "moe_backend" (explicit), "VLLM_USE_DEEP_GEMM" (env-forced DeepGEMM),
  // "VLLM_ROCM_USE_AITER" (env-forced AITER), "auto", "none".
  std::string path;
  ActivationFormat activation_format = ActivationFormat::kStandard;
  // Why the list looks as it does: reorder rules that fired, env removals, the batched mapping.
  std::vector<std::string> notes;
};

// vLLM select_fp8_moe_backend(config, weight_key, activation_key, allow_vllm_cutlass), every
// branch: explicit moe_backend (batched mapping, the vLLM-CUTLASS gate, _return_or_raise), the
// DeepGEMM and AITER env overrides (is_set semantics), the vLLM-CUTLASS removal, the auto scan,
// and NotImplementedError("No FP8 MoE backend supports the deployment configuration.") on CUDA/ROCm
// versus NONE elsewhere. Logs info_once("Using X Fp8 MoE backend out of potential backends:
// [...].") and debug_once for each rejection in the scan, as vLLM does. When `progress` is given it
// holds the candidates, trace and notes gathered so far, also when this throws (so a caller can
// explain a failure).
Selection select_fp8_moe_backend(const MoeConfig& config, const OptQuantKey& weight_key,
                                 const OptQuantKey& activation_key, bool allow_vllm_cutlass,
                                 const Platform& platform, const OracleEnv& env,
                                 Selection* progress = nullptr);

// vLLM's _make_log_unsupported(backend, reason): with a reason
//   "FP8 MoE backend TRITON does not support the deployment configuration since <reason>."
// without one
//   "FP8 MoE backend 'TRITON' does not support the deployment configuration."
std::string make_log_unsupported(Fp8MoeBackend backend, const std::string& reason);
// vLLM's _make_log_backend: "Using TRITON Fp8 MoE backend out of potential backends: ['TRITON',
// ...]."
std::string make_log_backend(Fp8MoeBackend backend, const std::vector<std::string>& candidates);
// Python list repr of strings: "['TRITON', 'AITER']".
std::string python_list_repr(const std::vector<std::string>& items);

// The layer-level check vLLM makes before the oracle runs: a non-gated activation (is_act_and_mul
// False) is supported only on CUDA-alike platforms and XPU (oracle.md §3.2). NotImplementedError.
void check_moe_config_for_platform(const MoeConfig& config, const Platform& platform);
// The platform-dependent part of FusedMoEConfig.__post_init__, for a config whose post_init() ran:
// check_moe_config_for_platform, then rocm_aiter_fmoe_enabled = is_act_and_mul and AITER's fused
// MoE is enabled (ROCm CDNA3+, aiter installed, VLLM_ROCM_USE_AITER and VLLM_ROCM_USE_AITER_MOE).
void post_init_for_platform(MoeConfig& config, const Platform& platform, const OracleEnv& env);

// ---- Block shape (TP sharding of block-quantised weights)
// ----------------------------------------

using BlockShape = std::array<int, 2>;  // [block_n, block_k]

// vLLM refine_fp8_moe_block_shape: None when the TP shard is whole blocks
// (ispp % bn == 0 and (tp == 1 or ispp % bk == 0)) or when gcd(bn, bk, ispp, hidden) < 32; else
// [g, g]. Throws ValueError for non-positive block dims (Python would divide by zero).
std::optional<BlockShape> refine_fp8_moe_block_shape(const MoeConfig& config,
                                                     BlockShape weight_block_size);

// vLLM pad_tp_shard_to_weight_blocks: returns False (no change) when bn != bk, tp == 1 or the shard
// is whole blocks; raises ValueError("Block-aligned FP8 TP sharding requires {bn}-aligned global
// expert dimensions, pure TP, and no LoRA or expert bias.") when I % bn, H % bn, ep != 1, LoRA or
// bias forbid it; otherwise sets config.tp_shard_with_padding = true and rounds
// config.intermediate_size_per_partition up to a multiple of bn, and returns True.
bool pad_tp_shard_to_weight_blocks(MoeConfig& config, BlockShape weight_block_size);

struct BlockShapeResolution {
  BlockShape block_shape{};                    // the moe_block_shape the weights are stored in
  std::optional<std::array<int, 2>> refine{};  // (bn / rn, bk / rk) scale upsampling factor
  bool padded = false;                         // pad_tp_shard_to_weight_blocks fired
};

// vLLM resolve_fp8_moe_weight_block_shape: padding is considered only when
// is_checkpoint_fp8_serialized and config.moe_backend != "auto": then the explicit backend's
// classes (map_fp8_backend, which may raise) are asked whether any supports the refined key
// create_fp8_quant_key(static, GroupShape(*refined)) with `activation_key`; if none can and the pad
// applies, the checkpoint blocks are kept with padding (config is mutated). Otherwise the refined
// shape (if any) is returned with its factor. `platform` answers the classes' quant-scheme
// predicates (vLLM's current_platform). Logs vLLM's info_once messages.
BlockShapeResolution resolve_fp8_moe_weight_block_shape(MoeConfig& config,
                                                        BlockShape weight_block_size,
                                                        const OptQuantKey& activation_key,
                                                        bool is_checkpoint_fp8_serialized,
                                                        const Platform& platform);

// ---- Quant config
// ---------------------------------------------------------------------------------

// vLLM FusedMoEQuantConfig.make(...) (oracle.md §3.7): named arguments.
struct MoeQuantConfigArgs {
  std::optional<QuantDType> quant_dtype{};
  bool per_act_token_quant = false;
  bool per_out_ch_quant = false;
  std::optional<std::vector<int64_t>> block_shape{};
  Tensor w1_scale{}, w2_scale{}, a1_scale{}, a2_scale{};
  Tensor g1_alphas{}, g2_alphas{}, a1_gscale{}, a2_gscale{};
  Tensor w1_bias{}, w2_bias{}, w1_zp{}, w2_zp{};
  std::optional<QuantDType> weight_dtype{};  // defaults to quant_dtype
  bool is_scale_swizzled = true;
  std::optional<double> gemm1_alpha{}, gemm1_beta{}, gemm1_clamp_limit{};
};
// Throws ValueError where vLLM asserts (block_shape with per-token / per-channel flags,
// block_shape not of length 2).
MoeQuantConfig make_moe_quant_config(const MoeQuantConfigArgs& args);

// vLLM fp8_w8a8_moe_quant_config: make(fp8_dtype, ...).
MoeQuantConfig fp8_w8a8_moe_quant_config(MoeQuantConfigArgs args,
                                         QuantDType fp8_dtype = QuantDType::kFp8E4M3FN);
// vLLM fp8_w8a16_moe_quant_config: unquantised activations, fp8 weights with the block group shape
// (block_shape then reads None from the config: it is derived from the activation descriptor).
MoeQuantConfig fp8_w8a16_moe_quant_config(const Tensor& w1_scale, const Tensor& w2_scale,
                                          const Tensor& w1_bias, const Tensor& w2_bias,
                                          const std::optional<std::vector<int64_t>>& block_shape,
                                          std::optional<double> gemm1_alpha,
                                          std::optional<double> gemm1_beta,
                                          std::optional<double> gemm1_clamp_limit,
                                          QuantDType fp8_dtype = QuantDType::kFp8E4M3FN);

// What make_fp8_moe_quant_config and _humming_fp8_weight_schema read from / write to vLLM's layer.
struct Fp8MoeLayerState {
  // layer.weight_block_size (None for tensor / channel checkpoints).
  std::optional<std::vector<int64_t>> weight_block_size{};
  // hasattr(layer, "w13_weight_scale_inv"): an HF "fp8" block checkpoint.
  bool has_w13_weight_scale_inv = false;
  // Humming's input schema: whether it quantises activations to 8 bits (a_dtype.num_bits == 8)
  // or runs them in 16 bits (W8A16).
  bool humming_quantizes_inputs = false;
  // Written by the FLASHINFER_CUTLASS / HPC per-tensor branch (layer.register_parameter): the
  // config shares these tensors (same storage), so an EPLB permutation of the layer's alphas is
  // seen by the kernel.
  Tensor g1_alphas{}, g2_alphas{};
};

struct Fp8QuantConfigInputs {
  Tensor w1_scale{}, w2_scale{};
  Tensor a1_scale{}, a2_scale{};  // undefined: None
  Tensor w1_bias{}, w2_bias{};
  std::optional<std::vector<int64_t>> block_shape{};
  bool per_act_token_quant = false;
  bool per_out_ch_quant = false;
  std::optional<double> swiglu_limit{}, gemm1_alpha{}, gemm1_beta{};
  Fp8MoeLayerState* layer = nullptr;
  QuantDType fp8_dtype = QuantDType::kFp8E4M3FN;  // current_platform.fp8_dtype()
};

// vLLM make_fp8_moe_quant_config(fp8_backend, ...), every branch in the seed's order:
//   CPU_W8A8        fp8_w8a8(w1_scale, w2_scale, a1_scale, block_shape): no biases, no SwiGLU
//   params MARLIN, CPU     fp8_w8a16(..., gemm1_clamp_limit = swiglu_limit) HUMMING         from
//   the layer's Humming schema (ValueError without a layer, as vLLM asserts) FLASHINFER_CUTLASS /
//   HPC with block_shape None: g1_alphas = w1_scale * a1_scale,
//                   g2_alphas = w2_scale * a2_scale, a1_gscale = 1 / a1_scale, a2_gscale = 1 /
//                   a2_scale (registered on the layer when given); gemm1_alpha / gemm1_beta are
//                   dropped
//   block [1, 32]   make("mxfp8", ..., is_scale_swizzled = False)
//   otherwise       fp8_w8a8(..., block_shape, per_act_token_quant, per_out_ch_quant, ...)
MoeQuantConfig make_fp8_moe_quant_config(Fp8MoeBackend backend, const Fp8QuantConfigInputs& in);

// vLLM _humming_fp8_weight_schema(layer, weight, weight_scale): the Humming schema as a dict.
//   u8 / e8m0 scales -> {"quant_method": "modelopt", "quant_algo": "mxfp8"}
//   w13_weight_scale_inv -> {"quant_method": "fp8", "weight_block_size": [...]}
//   else compressed-tensors float-quantized with strategy block | channel | tensor.
nlohmann::ordered_json humming_fp8_weight_schema(const Fp8MoeLayerState& layer,
                                                 const TensorView& weight,
                                                 const TensorView& weight_scale);

}  // namespace fp8moe
