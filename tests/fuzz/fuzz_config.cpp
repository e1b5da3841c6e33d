// libFuzzer target: config.json and quantization_config parsing, and what the planner derives from
// a parsed config (expert names, the MoE layer config, the ignore-list check). Inputs must parse
// or raise fp8moe::Error.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "fp8moe/checkpoint.hpp"
#include "fp8moe/error.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace fp8moe;
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  try {
    (void)parse_quantization_config(text).describe();
  } catch (const Error&) {
  }
  try {
    const ModelConfig m = parse_model_config(text, "fuzz.json");
    (void)m.describe();
    (void)m.quant.describe();
    const int layer = m.moe_layers.front();
    (void)expert_weight_name(m, layer, m.num_experts - 1, ExpertProj::kDown);
    (void)expert_scale_name(m, layer, 0, ExpertProj::kUp);
    (void)moe_layer_ignored(m, layer);
    for (int tp : {1, 2, 8}) {
      try {
        (void)m.moe_config(
            MoeParallelConfig::make(tp, 1, 1, 1, false, "allgather_reducescatter", false));
      } catch (const Error&) {
      }
    }
  } catch (const Error&) {
  }
  return 0;
}
