// Fixes found by the differential test against the independent Python model of vLLM's oracle
// (tests/py/oracle_model.py, tests/py/test_oracle_differential.py), pinned at the library level.
#include <gtest/gtest.h>

#include <algorithm>

#include "oracle_test_util.hpp"

namespace fp8moe {
namespace {

using testing::Deploy;
using testing::plat;

// The auto scan drops VLLM_CUTLASS and BATCHED_VLLM_CUTLASS unless allow_vllm_cutlass; the
// decision trace now says so (the candidates list alone did not explain the absence).
TEST(OracleDiffFixes, CutlassRemovalIsExplained) {
  const MoeConfig c = Deploy{}.build();
  const OptQuantKey W = kFp8Static128BlockSym, A = kFp8Dynamic128Sym;
  const std::string note =
      "VLLM_CUTLASS and BATCHED_VLLM_CUTLASS removed: allow_vllm_cutlass is False (only "
      "compressed-tensors W8A8-FP8 allows them)";
  Selection s = select_fp8_moe_backend(c, W, A, false, plat("cuda:100"), OracleEnv());
  EXPECT_NE(std::find(s.notes.begin(), s.notes.end(), note), s.notes.end());
  s = select_fp8_moe_backend(c, W, A, true, plat("cuda:100"), OracleEnv());
  EXPECT_EQ(std::find(s.notes.begin(), s.notes.end(), note), s.notes.end());
}

// FusedMoEConfig.__post_init__ refuses non-gated activations off CUDA/ROCm/XPU: every entry point
// that builds a configuration (select, support, resolve-block) goes through this check.
TEST(OracleDiffFixes, NonGatedOffGpuRefusedEverywhere) {  // pitfall 18
  Deploy d;
  d.act = MoeActivation::kRelu2NoMul;
  d.tp = 4;
  const MoeConfig c = d.build();
  EXPECT_EQ(testing::msg_of([&] { check_moe_config_for_platform(c, plat("cpu")); }),
            "NotImplementedError: is_act_and_mul=False is supported only for CUDA, ROCm and XPU "
            "for now");
  EXPECT_NO_THROW(check_moe_config_for_platform(c, plat("xpu")));
  // resolve_fp8_moe_weight_block_shape itself stays pure: the check belongs to the config.
  MoeConfig r = c;
  const BlockShapeResolution res =
      resolve_fp8_moe_weight_block_shape(r, {128, 128}, kFp8Dynamic128Sym, true, plat("xpu"));
  EXPECT_EQ(res.block_shape, (BlockShape{64, 64}));
}

}  // namespace
}  // namespace fp8moe
