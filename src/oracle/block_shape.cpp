// TP sharding of block-quantised FP8 MoE weights: refine_fp8_moe_block_shape,
// pad_tp_shard_to_weight_blocks and resolve_fp8_moe_weight_block_shape, exactly as the seed's
// source (which errors, which mutations, which logs).
#include <fmt/format.h>

#include <numeric>

#include "fp8moe/error.hpp"
#include "fp8moe/log.hpp"
#include "fp8moe/oracle.hpp"

namespace fp8moe {

namespace {

void check_block(BlockShape b) {
  if (b[0] <= 0 || b[1] <= 0) {
    // Python would raise ZeroDivisionError on `ispp % block_n`; fp8moe names the value instead.
    throw ValueError(fmt::format(
        "weight_block_size must be two positive integers [block_n, block_k], got [{}, {}]", b[0],
        b[1]));
  }
}

std::string list_str(BlockShape b) { return fmt::format("[{}, {}]", b[0], b[1]); }

}  // namespace

std::optional<BlockShape> refine_fp8_moe_block_shape(const MoeConfig& config,
                                                     BlockShape weight_block_size) {
  check_block(weight_block_size);
  const auto [block_n, block_k] = weight_block_size;
  const int ispp = config.intermediate_size_per_partition;
  if (ispp % block_n == 0 && (config.tp_size() == 1 || ispp % block_k == 0)) return std::nullopt;
  const int refine = std::gcd(std::gcd(block_n, block_k), std::gcd(ispp, config.hidden_dim));
  if (refine < 32) return std::nullopt;
  return BlockShape{refine, refine};
}

bool pad_tp_shard_to_weight_blocks(MoeConfig& config, BlockShape weight_block_size) {
  check_block(weight_block_size);
  const auto [block_n, block_k] = weight_block_size;
  if (block_n != block_k || config.tp_size() == 1 ||
      config.intermediate_size_per_partition % block_n == 0) {
    return false;
  }
  if (config.intermediate_size % block_n != 0 || config.hidden_dim % block_n != 0 ||
      config.ep_size() != 1 || config.is_lora_enabled || config.has_bias) {
    throw ValueError(fmt::format(
        "Block-aligned FP8 TP sharding requires {}-aligned global expert dimensions, pure TP, and "
        "no LoRA or expert bias.",
        block_n));
  }
  config.tp_shard_with_padding = true;
  config.intermediate_size_per_partition =
      (config.intermediate_size_per_partition + block_n - 1) / block_n * block_n;
  return true;
}

BlockShapeResolution resolve_fp8_moe_weight_block_shape(MoeConfig& config,
                                                        BlockShape weight_block_size,
                                                        const OptQuantKey& activation_key,
                                                        bool is_checkpoint_fp8_serialized,
                                                        const Platform& platform) {
  const std::optional<BlockShape> refined_shape =
      refine_fp8_moe_block_shape(config, weight_block_size);
  if (is_checkpoint_fp8_serialized && config.moe_backend != "auto") {
    const std::vector<const ExpertsKernel*> kernel_classes =
        backend_to_kernel_cls(map_fp8_backend(config.moe_backend));
    bool can_refine = false;
    if (refined_shape) {
      const OptQuantKey refined_key =
          create_fp8_quant_key(true, GroupShape((*refined_shape)[0], (*refined_shape)[1]), true,
                               KeyDType::kF32, platform.fp8_dtype());
      const OracleEnv env;  // quant-scheme predicates read no environment variable
      const ExpertsContext ctx{platform, env};
      for (const ExpertsKernel* k : kernel_classes) {
        if (k->supports_quant_scheme(refined_key, activation_key, ctx)) {
          can_refine = true;
          break;
        }
      }
    }
    if (!can_refine && pad_tp_shard_to_weight_blocks(config, weight_block_size)) {
      info_once(fmt::format(
          "FP8 {} TP loading uses complete checkpoint blocks: local allocation {}, without weight "
          "requantization.",
          config.moe_backend, config.intermediate_size_per_partition));
      return {weight_block_size, std::nullopt, true};
    }
  }
  if (!refined_shape) return {weight_block_size, std::nullopt, false};
  info_once(fmt::format(
      "FP8 MoE block scales refined from {} to {} to fit the TP-sharded intermediate size {}.",
      list_str(weight_block_size), list_str(*refined_shape),
      config.intermediate_size_per_partition));
  return {*refined_shape,
          std::array<int, 2>{weight_block_size[0] / (*refined_shape)[0],
                             weight_block_size[1] / (*refined_shape)[1]},
          false};
}

}  // namespace fp8moe
