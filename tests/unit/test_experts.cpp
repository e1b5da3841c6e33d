// Every expert class's every predicate, with vLLM's exact reason strings (oracle.md §2), in the
// base check order, plus the class extras and the FallbackExperts AND rule.
#include <gtest/gtest.h>

#include <functional>
#include <set>

#include "fp8moe/error.hpp"
#include "fp8moe/oracle.hpp"
#include "kernels/registry.hpp"
#include "unit/oracle_test_util.hpp"

namespace fp8moe {
namespace {

using testing::Deploy;

constexpr const char* kPrefix = "kernel does not support ";
const std::string kAiterHint =
    ". AITER MoE is not enabled \xE2\x80\x94 set VLLM_ROCM_USE_AITER=1 and "
    "VLLM_ROCM_USE_AITER_MOE=1 to enable it";

// Key shorthands (e4m3fn; the harness converts them to the platform's flavour).
const OptQuantKey kNone{};
const OptQuantKey W128 = kFp8Static128BlockSym, A128 = kFp8Dynamic128Sym, WT = kFp8StaticTensorSym,
                  AT = kFp8StaticTensorSym, AD = kFp8DynamicTensorSym, ATok = kFp8DynamicTokenSym,
                  WC = kFp8StaticChannelSym, WMX = kMxfp8Static, AMX = kMxfp8Dynamic;
const OptQuantKey W64 = create_fp8_quant_key(true, GroupShape(64, 64));

std::string quant_reason(const OptQuantKey& w, const OptQuantKey& a, KeyDType fp8) {
  return std::string(kPrefix) + "quantization scheme " + key_str(with_fp8_dtype(w, fp8)) + "x" +
         key_str(with_fp8_dtype(a, fp8));
}

struct Case {
  const char* label;
  const char* kernel;
  const char* platform;
  const char* installed;
  std::function<void(Deploy&)> mutate;
  OptQuantKey w, a;
  ActivationFormat format;
  std::vector<std::pair<std::string, std::string>> env;
  // "" = supported; a string starting with '+' is appended to "kernel does not support "; "QUANT"
  // is the quantization-scheme reason for (w, a); "PAR" the parallel-config reason for the config.
  std::string expect;
};

const auto none = [](Deploy&) {};
const auto std_fmt = ActivationFormat::kStandard;
const auto bat_fmt = ActivationFormat::kBatchedExperts;

// Deployment tweaks.
const auto act = [](MoeActivation a) { return [a](Deploy& d) { d.act = a; }; };
const auto eplb = [](Deploy& d) { d.eplb = true; };
const auto sp2 = [](Deploy& d) {
  d.sp = 2;
  d.tp = 2;
  d.ep = true;
};
const auto a2a = [](const char* backend) {
  return [backend](Deploy& d) {
    d.dp = 2;
    d.ep = true;
    d.a2a = backend;
  };
};
const auto routing = [](RoutingMethodType r) { return [r](Deploy& d) { d.routing = r; }; };
const auto logits = [](DType t) { return [t](Deploy& d) { d.logits = t; }; };
const auto lora = [](Deploy& d) { d.lora = true; };
const auto bias = [](Deploy& d) { d.bias = true; };
const auto experts = [](int e) { return [e](Deploy& d) { d.E = e; }; };
const auto hidden = [](int h) { return [h](Deploy& d) { d.H = h; }; };

std::vector<Case> cases() {
  using A = MoeActivation;
  using R = RoutingMethodType;
  const std::vector<std::pair<std::string, std::string>> bi = {{"VLLM_BATCH_INVARIANT", "1"}};
  const std::vector<std::pair<std::string, std::string>> aiter = {{"VLLM_ROCM_USE_AITER", "1"}};
  // clang-format off
  return {
      // ---- TrtLlmFp8ExpertsMonolithic ---------------------------------------------------------
      {"ok", "TrtLlmFp8ExpertsMonolithic", "cuda:100", "all", none, W128, A128, std_fmt, {}, ""},
      {"sm103", "TrtLlmFp8ExpertsMonolithic", "cuda:103", "all", none, W128, A128, std_fmt, {}, ""},
      {"per-tensor", "TrtLlmFp8ExpertsMonolithic", "cuda:100", "all", none, WT, AT, std_fmt, {},
       ""},
      {"mxfp8", "TrtLlmFp8ExpertsMonolithic", "cuda:100", "all", none, WMX, AMX, std_fmt, {}, ""},
      {"sm90", "TrtLlmFp8ExpertsMonolithic", "cuda:90", "all", none, W128, A128, std_fmt, {},
       "+current device cuda"},
      {"sm120", "TrtLlmFp8ExpertsMonolithic", "cuda:120", "all", none, W128, A128, std_fmt, {},
       "+current device cuda"},
      {"not installed", "TrtLlmFp8ExpertsMonolithic", "cuda:100", "flashinfer_cutlass", none, W128,
       A128, std_fmt, {}, "+current device cuda"},
      {"cpu", "TrtLlmFp8ExpertsMonolithic", "cpu", "all", none, W128, A128, std_fmt, {},
       "+current device cpu"},
      {"relu2_no_mul ok", "TrtLlmFp8ExpertsMonolithic", "cuda:100", "all", act(A::kRelu2NoMul),
       W128, A128, std_fmt, {}, ""},
      {"silu_no_mul", "TrtLlmFp8ExpertsMonolithic", "cuda:100", "all", act(A::kSiluNoMul), W128,
       A128, std_fmt, {}, "+MoEActivation.SILU_NO_MUL activation"},
      {"gelu", "TrtLlmFp8ExpertsMonolithic", "cuda:100", "all", act(A::kGelu), W128, A128, std_fmt,
       {}, "+MoEActivation.GELU activation"},
      {"TD", "TrtLlmFp8ExpertsMonolithic", "cuda:100", "all", none, WT, AD, std_fmt, {}, "QUANT"},
      {"eplb", "TrtLlmFp8ExpertsMonolithic", "cuda:100", "all", eplb, W128, A128, std_fmt, {},
       "+parallel config FusedMoEParallelConfig(tp_size=1, pcp_size=1, dp_size=1, ep_size=1, "
       "tp_rank=0, pcp_rank=0, dp_rank=0, ep_rank=0, sp_size=1, use_ep=False, "
       "all2all_backend='allgather_reducescatter', enable_eplb=True)"},
      {"sequence parallel", "TrtLlmFp8ExpertsMonolithic", "cuda:100", "all", sp2, W128, A128,
       std_fmt, {}, "PAR"},
      {"deepep ht", "TrtLlmFp8ExpertsMonolithic", "cuda:100", "all", a2a("deepep_high_throughput"),
       W128, A128, std_fmt, {}, "PAR"},
      {"ag/rs all2all ok", "TrtLlmFp8ExpertsMonolithic", "cuda:100", "all",
       a2a("allgather_reducescatter"), W128, A128, std_fmt, {}, ""},
      {"routing Default", "TrtLlmFp8ExpertsMonolithic", "cuda:100", "all", routing(R::kDefault),
       W128, A128, std_fmt, {}, "+routing method 0"},
      {"routing Llama4 block", "TrtLlmFp8ExpertsMonolithic", "cuda:100", "all", routing(R::kLlama4),
       W128, A128, std_fmt, {}, "+routing method 3"},
      {"routing Llama4 per-tensor", "TrtLlmFp8ExpertsMonolithic", "cuda:100", "all",
       routing(R::kLlama4), WT, AT, std_fmt, {}, ""},
      {"routing DeepSeekV3", "TrtLlmFp8ExpertsMonolithic", "cuda:100", "all",
       routing(R::kDeepSeekV3), W128, A128, std_fmt, {}, ""},
      {"routing TopK", "TrtLlmFp8ExpertsMonolithic", "cuda:100", "all", routing(R::kTopK), WMX, AMX,
       std_fmt, {}, "+routing method 5"},
      {"logits f16", "TrtLlmFp8ExpertsMonolithic", "cuda:100", "all", logits(DType::kF16), W128,
       A128, std_fmt, {}, "+router logits dtype torch.float16"},
      {"logits f32", "TrtLlmFp8ExpertsMonolithic", "cuda:100", "all", logits(DType::kF32), W128,
       A128, std_fmt, {}, ""},
      {"batched format", "TrtLlmFp8ExpertsMonolithic", "cuda:100", "all", none, W128, A128, bat_fmt,
       {}, "+('batched_experts',) activation format"},
      {"batch invariance", "TrtLlmFp8ExpertsMonolithic", "cuda:100", "all", none, W128, A128,
       std_fmt, bi, "+batch invariance"},
      {"lora", "TrtLlmFp8ExpertsMonolithic", "cuda:100", "all", lora, W128, A128, std_fmt, {},
       "+LoRA"},
      {"2048 experts ok", "TrtLlmFp8ExpertsMonolithic", "cuda:100", "all", experts(2048), W128,
       A128, std_fmt, {}, ""},
      {"2049 experts", "TrtLlmFp8ExpertsMonolithic", "cuda:100", "all", experts(2049), W128, A128,
       std_fmt, {}, "FlashInfer TRTLLM routing supports at most 2048 experts, but got 2049"},
      {"base reason wins over 2049", "TrtLlmFp8ExpertsMonolithic", "cuda:90", "all", experts(4096),
       W128, A128, std_fmt, {}, "+current device cuda"},
      // ---- TrtLlmFp8ExpertsModular -------------------------------------------------------------
      {"ok", "TrtLlmFp8ExpertsModular", "cuda:100", "all", none, W128, A128, std_fmt, {}, ""},
      {"per-tensor", "TrtLlmFp8ExpertsModular", "cuda:100", "all", none, WT, AT, std_fmt, {},
       "QUANT"},
      {"routing Default ok", "TrtLlmFp8ExpertsModular", "cuda:100", "all", routing(R::kDefault),
       W128, A128, std_fmt, {}, ""},
      {"logits f16 ok", "TrtLlmFp8ExpertsModular", "cuda:100", "all", logits(DType::kF16), W128,
       A128, std_fmt, {}, ""},
      {"sequence parallel ok", "TrtLlmFp8ExpertsModular", "cuda:100", "all", sp2, W128, A128,
       std_fmt, {}, ""},
      {"deepep v2 ok", "TrtLlmFp8ExpertsModular", "cuda:100", "all", a2a("deepep_v2"), W128, A128,
       std_fmt, {}, ""},
      {"fi one-sided ok", "TrtLlmFp8ExpertsModular", "cuda:100", "all",
       a2a("flashinfer_nvlink_one_sided"), W128, A128, std_fmt, {}, ""},
      {"fi two-sided ok", "TrtLlmFp8ExpertsModular", "cuda:100", "all", a2a("flashinfer_all2allv"),
       W128, A128, std_fmt, {}, ""},
      {"deepep ht", "TrtLlmFp8ExpertsModular", "cuda:100", "all", a2a("deepep_high_throughput"),
       W128, A128, std_fmt, {}, "PAR"},
      {"eplb", "TrtLlmFp8ExpertsModular", "cuda:100", "all", eplb, W128, A128, std_fmt, {}, "PAR"},
      {"2049 experts", "TrtLlmFp8ExpertsModular", "cuda:100", "all", experts(2049), W128, A128,
       std_fmt, {}, "FlashInfer TRTLLM routing supports at most 2048 experts, but got 2049"},
      // ---- FlashInferExperts -------------------------------------------------------------------
      {"ok sm90 block", "FlashInferExperts", "cuda:90", "all", none, W128, A128, std_fmt, {}, ""},
      {"sm100 block", "FlashInferExperts", "cuda:100", "all", none, W128, A128, std_fmt, {},
       "QUANT"},
      {"sm100 per-tensor", "FlashInferExperts", "cuda:100", "all", none, WT, AT, std_fmt, {}, ""},
      {"sm120 unquantised", "FlashInferExperts", "cuda:120", "all", none, kNone, kNone, std_fmt, {},
       ""},
      {"sm100 nvfp4", "FlashInferExperts", "cuda:100", "all", none, kNvfp4Static, kNvfp4Dynamic,
       std_fmt, {}, ""},
      {"sm90 nvfp4", "FlashInferExperts", "cuda:90", "all", none, kNvfp4Static, kNvfp4Dynamic,
       std_fmt, {}, "QUANT"},
      {"sm110", "FlashInferExperts", "cuda:110", "all", none, WT, AT, std_fmt, {},
       "+current device cuda"},
      {"sm89", "FlashInferExperts", "cuda:89", "all", none, WT, AT, std_fmt, {},
       "+current device cuda"},
      {"not installed", "FlashInferExperts", "cuda:90", "none", none, W128, A128, std_fmt, {},
       "+current device cuda"},
      {"gelu", "FlashInferExperts", "cuda:90", "all", act(A::kGelu), W128, A128, std_fmt, {},
       "+MoEActivation.GELU activation"},
      {"relu2_no_mul ok", "FlashInferExperts", "cuda:90", "all", act(A::kRelu2NoMul), W128, A128,
       std_fmt, {}, ""},
      {"TD", "FlashInferExperts", "cuda:90", "all", none, WT, AD, std_fmt, {}, "QUANT"},
      {"any parallel", "FlashInferExperts", "cuda:90", "all", a2a("deepep_high_throughput"), W128,
       A128, std_fmt, {}, ""},
      {"batched", "FlashInferExperts", "cuda:90", "all", none, W128, A128, bat_fmt, {},
       "+('batched_experts',) activation format"},
      {"lora", "FlashInferExperts", "cuda:90", "all", lora, W128, A128, std_fmt, {}, "+LoRA"},
      // ---- TritonOrDeepGemmExperts (AND of DeepGemmExperts and TritonExperts) -------------------
      {"ok", "TritonOrDeepGemmExperts", "cuda:90", "all", none, W128, A128, std_fmt, {}, ""},
      {"sm120 ok", "TritonOrDeepGemmExperts", "cuda:120", "all", none, W128, A128, std_fmt, {}, ""},
      {"sm89", "TritonOrDeepGemmExperts", "cuda:89", "all", none, W128, A128, std_fmt, {},
       "+current device cuda"},
      {"not installed", "TritonOrDeepGemmExperts", "cuda:90", "flashinfer_cutlass", none, W128,
       A128, std_fmt, {}, "+current device cuda"},
      {"VLLM_USE_DEEP_GEMM=0", "TritonOrDeepGemmExperts", "cuda:90", "all", none, W128, A128,
       std_fmt, {{"VLLM_USE_DEEP_GEMM", "0"}}, "+current device cuda"},
      {"VLLM_MOE_USE_DEEP_GEMM=0 is not a device predicate", "TritonOrDeepGemmExperts", "cuda:90",
       "all", none, W128, A128, std_fmt, {{"VLLM_MOE_USE_DEEP_GEMM", "0"}}, ""},
      {"rocm", "TritonOrDeepGemmExperts", "rocm:gfx942", "all", none, W128, A128, std_fmt, {},
       "+current device rocm"},
      {"silu_no_mul", "TritonOrDeepGemmExperts", "cuda:90", "all", act(A::kSiluNoMul), W128, A128,
       std_fmt, {}, "+no act_and_mul MLP layer"},
      {"gelu", "TritonOrDeepGemmExperts", "cuda:90", "all", act(A::kGelu), W128, A128, std_fmt, {},
       "+MoEActivation.GELU activation"},
      {"swiglustep ok", "TritonOrDeepGemmExperts", "cuda:90", "all", act(A::kSwigluStep), W128,
       A128, std_fmt, {}, ""},
      {"per-tensor", "TritonOrDeepGemmExperts", "cuda:90", "all", none, WT, AT, std_fmt, {},
       "QUANT"},
      {"mxfp8 on sm100 (Triton rejects it)", "TritonOrDeepGemmExperts", "cuda:100", "all", none,
       WMX, AMX, std_fmt, {}, "QUANT"},
      {"refined block", "TritonOrDeepGemmExperts", "cuda:90", "all", none, W64, A128, std_fmt, {},
       "QUANT"},
      {"fi one-sided", "TritonOrDeepGemmExperts", "cuda:90", "all",
       a2a("flashinfer_nvlink_one_sided"), W128, A128, std_fmt, {}, "PAR"},
      {"routing and logits are base defaults", "TritonOrDeepGemmExperts", "cuda:90", "all",
       [](Deploy& d) { d.routing = RoutingMethodType::kCustom; d.logits = DType::kF16; }, W128,
       A128, std_fmt, {}, ""},
      {"no 1024-padded-experts check", "TritonOrDeepGemmExperts", "cuda:90", "all", experts(4096),
       W128, A128, std_fmt, {}, ""},
      {"lora (FallbackExperts keeps the base default)", "TritonOrDeepGemmExperts", "cuda:90", "all",
       lora, W128, A128, std_fmt, {}, "+LoRA"},
      {"batch invariance", "TritonOrDeepGemmExperts", "cuda:90", "all", none, W128, A128, std_fmt,
       bi, "+batch invariance"},
      {"batched", "TritonOrDeepGemmExperts", "cuda:90", "all", none, W128, A128, bat_fmt, {},
       "+('batched_experts',) activation format"},
      {"DeepGemmExperts mxfp8 on sm100", "DeepGemmExperts", "cuda:100", "all", none, WMX, AMX,
       std_fmt, {}, ""},
      {"DeepGemmExperts mxfp8 on sm90", "DeepGemmExperts", "cuda:90", "all", none, WMX, AMX,
       std_fmt, {}, "QUANT"},
      // ---- BatchedDeepGemmExperts --------------------------------------------------------------
      {"ok", "BatchedDeepGemmExperts", "cuda:90", "all", none, W128, A128, bat_fmt, {}, ""},
      {"standard format", "BatchedDeepGemmExperts", "cuda:90", "all", none, W128, A128, std_fmt, {},
       "+('standard',) activation format"},
      {"not installed", "BatchedDeepGemmExperts", "cuda:90", "none", none, W128, A128, bat_fmt, {},
       "+current device cuda"},
      {"gelu", "BatchedDeepGemmExperts", "cuda:90", "all", act(A::kGelu), W128, A128, bat_fmt, {},
       "+MoEActivation.GELU activation"},
      {"silu_no_mul", "BatchedDeepGemmExperts", "cuda:90", "all", act(A::kSiluNoMul), W128, A128,
       bat_fmt, {}, "+no act_and_mul MLP layer"},
      {"per-tensor", "BatchedDeepGemmExperts", "cuda:90", "all", none, WT, AT, bat_fmt, {},
       "QUANT"},
      {"any parallel", "BatchedDeepGemmExperts", "cuda:90", "all",
       a2a("flashinfer_nvlink_one_sided"), W128, A128, bat_fmt, {}, ""},
      // ---- Humming -----------------------------------------------------------------------------
      {"indexed by default", "HummingIndexedExperts", "cuda:90", "all", none, W128, A128, std_fmt,
       {}, ""},
      {"grouped not preferred", "HummingGroupedExperts", "cuda:90", "all", none, W128, A128,
       std_fmt, {}, "preferred gemm type indexed != supported gemm type grouped_contiguous"},
      {"grouped preferred", "HummingGroupedExperts", "cuda:90", "all", none, W128, A128, std_fmt,
       {{"VLLM_HUMMING_MOE_GEMM_TYPE", "grouped"}}, ""},
      {"GROUPED_CONTIGUOUS lower-cased", "HummingGroupedExperts", "cuda:90", "all", none, W128,
       A128, std_fmt, {{"VLLM_HUMMING_MOE_GEMM_TYPE", "GROUPED_CONTIGUOUS"}}, ""},
      {"indexed not preferred", "HummingIndexedExperts", "cuda:90", "all", none, W128, A128,
       std_fmt, {{"VLLM_HUMMING_MOE_GEMM_TYPE", "grouped"}},
       "preferred gemm type grouped_contiguous != supported gemm type indexed"},
      {"unknown value means indexed", "HummingIndexedExperts", "cuda:90", "all", none, W128, A128,
       std_fmt, {{"VLLM_HUMMING_MOE_GEMM_TYPE", "grouped_masked"}}, ""},
      {"batched never preferred", "BatchedHummingGroupedExperts", "cuda:90", "all", none, W128,
       A128, bat_fmt, {{"VLLM_HUMMING_MOE_GEMM_TYPE", "grouped_masked"}},
       "preferred gemm type indexed != supported gemm type grouped_masked"},
      {"batched on standard format", "BatchedHummingGroupedExperts", "cuda:90", "all", none, W128,
       A128, std_fmt, {}, "+('standard',) activation format"},
      {"sm70", "HummingIndexedExperts", "cuda:70", "all", none, W128, A128, std_fmt, {},
       "+current device cuda"},
      {"not installed", "HummingIndexedExperts", "cuda:90", "deep_gemm", none, W128, A128, std_fmt,
       {}, "+current device cuda"},
      {"relu2", "HummingIndexedExperts", "cuda:90", "all", act(A::kRelu2), W128, A128, std_fmt, {},
       "+MoEActivation.RELU2 activation"},
      {"silu_no_mul ok", "HummingIndexedExperts", "cuda:90", "all", act(A::kSiluNoMul), W128, A128,
       std_fmt, {}, ""},
      {"block W16A16", "HummingIndexedExperts", "cuda:90", "all", none, W128, kNone, std_fmt, {},
       ""},
      {"TD", "HummingIndexedExperts", "cuda:90", "all", none, WT, AD, std_fmt, {}, "QUANT"},
      {"refined block", "HummingIndexedExperts", "cuda:90", "all", none, W64, A128, std_fmt, {},
       "QUANT"},
      {"batch invariance ok", "HummingIndexedExperts", "cuda:90", "all", none, W128, A128, std_fmt,
       bi, ""},
      {"lora", "HummingIndexedExperts", "cuda:90", "all", lora, W128, A128, std_fmt, {}, "+LoRA"},
      // ---- MarlinExperts -----------------------------------------------------------------------
      {"ok", "MarlinExperts", "cuda:90", "all", none, W128, A128, std_fmt, {}, ""},
      {"sm75 ok", "MarlinExperts", "cuda:75", "none", none, W128, A128, std_fmt, {}, ""},
      {"sm70", "MarlinExperts", "cuda:70", "all", none, W128, A128, std_fmt, {},
       "+current device cuda"},
      {"rocm", "MarlinExperts", "rocm:gfx942", "all", none, W128, A128, std_fmt, {},
       "+current device rocm"},
      {"weight key only", "MarlinExperts", "cuda:90", "all", none, WC, AD, std_fmt, {}, ""},
      {"refined block", "MarlinExperts", "cuda:90", "all", none, W64, A128, std_fmt, {}, "QUANT"},
      {"unquantised", "MarlinExperts", "cuda:90", "all", none, kNone, kNone, std_fmt, {}, "QUANT"},
      {"relu2", "MarlinExperts", "cuda:90", "all", act(A::kRelu2), W128, A128, std_fmt, {},
       "+MoEActivation.RELU2 activation"},
      {"fi two-sided", "MarlinExperts", "cuda:90", "all", a2a("flashinfer_all2allv"), W128, A128,
       std_fmt, {}, "PAR"},
      {"fi one-sided ok", "MarlinExperts", "cuda:90", "all", a2a("flashinfer_nvlink_one_sided"),
       W128, A128, std_fmt, {}, ""},
      {"lora ok", "MarlinExperts", "cuda:90", "all", lora, W128, A128, std_fmt, {}, ""},
      {"batch invariance", "MarlinExperts", "cuda:90", "all", none, W128, A128, std_fmt, bi,
       "+batch invariance"},
      // ---- TritonExperts -----------------------------------------------------------------------
      {"ok", "TritonExperts", "cuda:90", "none", none, W128, A128, std_fmt, {}, ""},
      {"refined 64x64", "TritonExperts", "cuda:90", "none", none, W64, A128, std_fmt, {}, ""},
      {"refined 32x32", "TritonExperts", "cuda:100", "none", none, create_fp8_quant_key(true,
       GroupShape(32, 32)), A128, std_fmt, {}, ""},
      {"refined with token activations", "TritonExperts", "cuda:90", "none", none, W64, ATok,
       std_fmt, {}, "QUANT"},
      {"refined dynamic weight", "TritonExperts", "cuda:90", "none", none,
       create_fp8_quant_key(false, GroupShape(64, 64)), A128, std_fmt, {}, "QUANT"},
      {"per-channel tokens", "TritonExperts", "cuda:90", "none", none, WC, ATok, std_fmt, {}, ""},
      {"TD", "TritonExperts", "cuda:90", "none", none, WT, AD, std_fmt, {}, ""},
      {"int8", "TritonExperts", "cuda:90", "none", none, kInt8StaticChannelSym,
       kInt8DynamicTokenSym, std_fmt, {}, ""},
      {"mxfp8", "TritonExperts", "cuda:100", "none", none, WMX, AMX, std_fmt, {}, "QUANT"},
      {"block on sm80", "TritonExperts", "cuda:80", "none", none, W128, A128, std_fmt, {}, "QUANT"},
      {"unquantised on sm80", "TritonExperts", "cuda:80", "none", none, kNone, kNone, std_fmt, {},
       ""},
      {"rocm fnuz block", "TritonExperts", "rocm:gfx942", "none", none, W128, A128, std_fmt, {},
       ""},
      {"rdna4 block", "TritonExperts", "rocm:gfx1201", "none", none, W128, A128, std_fmt, {}, ""},
      {"xpu", "TritonExperts", "xpu", "none", none, W128, A128, std_fmt, {}, ""},
      {"cpu", "TritonExperts", "cpu", "all", none, W128, A128, std_fmt, {}, "+current device cpu"},
      {"relu2", "TritonExperts", "cuda:90", "none", act(A::kRelu2), W128, A128, std_fmt, {},
       "+MoEActivation.RELU2 activation"},
      {"relu2_no_mul ok", "TritonExperts", "cuda:90", "none", act(A::kRelu2NoMul), W128, A128,
       std_fmt, {}, ""},
      {"fi two-sided", "TritonExperts", "cuda:90", "none", a2a("flashinfer_nvlink_two_sided"), W128,
       A128, std_fmt, {}, "PAR"},
      {"992 experts ok", "TritonExperts", "cuda:90", "none", experts(992), W128, A128, std_fmt, {},
       ""},
      {"993 experts pad to 1024", "TritonExperts", "cuda:90", "none", experts(993), W128, A128,
       std_fmt, {}, "kernel's moe_align_block_size requires fewer than 1024 padded experts"},
      {"1024 experts on xpu ok", "TritonExperts", "xpu", "none", experts(1024), W128, A128, std_fmt,
       {}, ""},
      {"base reason before padded experts", "TritonExperts", "cuda:90", "none",
       [](Deploy& d) { d.E = 2048; d.act = MoeActivation::kRelu2; }, W128, A128, std_fmt, {},
       "+MoEActivation.RELU2 activation"},
      {"batched", "TritonExperts", "cuda:90", "none", none, W128, A128, bat_fmt, {},
       "+('batched_experts',) activation format"},
      {"batch invariance ok", "TritonExperts", "cuda:90", "none", none, W128, A128, std_fmt, bi,
       ""},
      {"lora ok", "TritonExperts", "cuda:90", "none", lora, W128, A128, std_fmt, {}, ""},
      {"routing any", "TritonExperts", "cuda:90", "none", routing(RoutingMethodType::kCustom), W128,
       A128, std_fmt, {}, ""},
      // ---- BatchedTritonExperts ----------------------------------------------------------------
      {"ok", "BatchedTritonExperts", "cuda:90", "none", none, W128, A128, bat_fmt, {}, ""},
      {"standard", "BatchedTritonExperts", "cuda:90", "none", none, W128, A128, std_fmt, {},
       "+('standard',) activation format"},
      {"situ", "BatchedTritonExperts", "cuda:90", "none", act(A::kSitu), W128, A128, bat_fmt, {},
       "+MoEActivation.SITU activation"},
      {"block on sm80", "BatchedTritonExperts", "cuda:80", "none", none, W128, A128, bat_fmt, {},
       "QUANT"},
      {"unquantised on sm80", "BatchedTritonExperts", "cuda:80", "none", none, kNone, kNone,
       bat_fmt, {}, ""},
      {"gfx942", "BatchedTritonExperts", "rocm:gfx942", "none", none, W128, A128, bat_fmt, {}, ""},
      {"gfx1201", "BatchedTritonExperts", "rocm:gfx1201", "none", none, W128, A128, bat_fmt, {},
       ""},
      {"xpu has no fp8 here", "BatchedTritonExperts", "xpu", "none", none, W128, A128, bat_fmt, {},
       "QUANT"},
      {"refined block", "BatchedTritonExperts", "cuda:90", "none", none, W64, A128, bat_fmt, {},
       "QUANT"},
      {"lora", "BatchedTritonExperts", "cuda:90", "none", lora, W128, A128, bat_fmt, {}, "+LoRA"},
      // ---- AiterExperts ------------------------------------------------------------------------
      {"ok", "AiterExperts", "rocm:gfx942", "all", none, W128, A128, std_fmt, aiter, ""},
      {"env unset", "AiterExperts", "rocm:gfx942", "all", none, W128, A128, std_fmt, {},
       "+current device rocm" + kAiterHint},
      {"moe switch off", "AiterExperts", "rocm:gfx942", "all", none, W128, A128, std_fmt,
       {{"VLLM_ROCM_USE_AITER", "1"}, {"VLLM_ROCM_USE_AITER_MOE", "0"}},
       "+current device rocm" + kAiterHint},
      {"not installed", "AiterExperts", "rocm:gfx942", "none", none, W128, A128, std_fmt, aiter,
       "+current device rocm" + kAiterHint},
      {"rdna4", "AiterExperts", "rocm:gfx1201", "all", none, W128, A128, std_fmt, aiter,
       "+current device rocm" + kAiterHint},
      {"cuda", "AiterExperts", "cuda:90", "all", none, W128, A128, std_fmt, aiter,
       "+current device cuda" + kAiterHint},
      {"gelu_tanh (enabled: no hint)", "AiterExperts", "rocm:gfx942", "all", act(A::kGeluTanh),
       W128, A128, std_fmt, aiter, "+MoEActivation.GELU_TANH activation"},
      {"silu_no_mul", "AiterExperts", "rocm:gfx950", "all", act(A::kSiluNoMul), W128, A128, std_fmt,
       aiter, "+no act_and_mul MLP layer"},
      {"mxfp4 on gfx950", "AiterExperts", "rocm:gfx950", "all", none, kMxfp4Static, kNone, std_fmt,
       aiter, ""},
      {"mxfp4 on gfx942", "AiterExperts", "rocm:gfx942", "all", none, kMxfp4Static, kNone, std_fmt,
       aiter, "QUANT"},
      {"per-tensor tokens", "AiterExperts", "rocm:gfx942", "all", none, WT, ATok, std_fmt, aiter,
       "QUANT"},
      {"fi one-sided", "AiterExperts", "rocm:gfx942", "all", a2a("flashinfer_nvlink_one_sided"),
       W128, A128, std_fmt, aiter, "PAR"},
      {"lora", "AiterExperts", "rocm:gfx942", "all", lora, W128, A128, std_fmt, aiter, "+LoRA"},
      // ---- TritonOrCutlassExperts / CutlassBatchedExpertsFp8 ------------------------------------
      {"ok TT", "TritonOrCutlassExperts", "cuda:90", "all", none, WT, AT, std_fmt, {}, ""},
      {"ok CTok", "TritonOrCutlassExperts", "cuda:100", "all", none, WC, ATok, std_fmt, {}, ""},
      {"block", "TritonOrCutlassExperts", "cuda:90", "all", none, W128, A128, std_fmt, {}, "QUANT"},
      {"TTok", "TritonOrCutlassExperts", "cuda:90", "all", none, WT, ATok, std_fmt, {}, "QUANT"},
      {"sm110", "TritonOrCutlassExperts", "cuda:110", "all", none, WT, AT, std_fmt, {},
       "+current device cuda"},
      {"sm89", "TritonOrCutlassExperts", "cuda:89", "all", none, WT, AT, std_fmt, {},
       "+current device cuda"},
      {"not built", "TritonOrCutlassExperts", "cuda:90", "deep_gemm", none, WT, AT, std_fmt, {},
       "+current device cuda"},
      {"silu_no_mul", "TritonOrCutlassExperts", "cuda:90", "all", act(A::kSiluNoMul), WT, AT,
       std_fmt, {}, "+no act_and_mul MLP layer"},
      {"relu2", "TritonOrCutlassExperts", "cuda:90", "all", act(A::kRelu2), WT, AT, std_fmt, {},
       "+MoEActivation.RELU2 activation"},
      {"deepep ht", "TritonOrCutlassExperts", "cuda:90", "all", a2a("deepep_high_throughput"), WT,
       AT, std_fmt, {}, "PAR"},
      {"lora", "TritonOrCutlassExperts", "cuda:90", "all", lora, WT, AT, std_fmt, {}, "+LoRA"},
      {"ok", "CutlassBatchedExpertsFp8", "cuda:90", "all", none, WT, AD, bat_fmt, {}, ""},
      {"deepep ht ok", "CutlassBatchedExpertsFp8", "cuda:90", "all", a2a("deepep_high_throughput"),
       WT, AD, bat_fmt, {}, ""},
      {"standard", "CutlassBatchedExpertsFp8", "cuda:90", "all", none, WT, AD, std_fmt, {},
       "+('standard',) activation format"},
      {"block", "CutlassBatchedExpertsFp8", "cuda:90", "all", none, W128, A128, bat_fmt, {},
       "QUANT"},
      // ---- XPU ---------------------------------------------------------------------------------
      {"fp8 W-only", "XPUExpertsFp8", "xpu", "none", none, WT, kNone, std_fmt, {}, ""},
      {"fp8 TD", "XPUExpertsFp8", "xpu", "none", none, WT, AD, std_fmt, {}, ""},
      {"fp8 block", "XPUExpertsFp8", "xpu", "none", none, W128, A128, std_fmt, {}, "QUANT"},
      {"mxfp8", "XPUExpertsMxFp8", "xpu", "none", none, WMX, AMX, std_fmt, {}, ""},
      {"mxfp8 W-only", "XPUExpertsMxFp8", "xpu", "none", none, WMX, kNone, std_fmt, {}, ""},
      {"block", "XPUExpertsBlockFp8", "xpu", "none", none, W128, A128, std_fmt, {}, ""},
      {"block on cuda", "XPUExpertsBlockFp8", "cuda:90", "all", none, W128, A128, std_fmt, {},
       "+current device cuda"},
      {"situ", "XPUExpertsBlockFp8", "xpu", "none", act(A::kSitu), W128, A128, std_fmt, {},
       "+MoEActivation.SITU activation"},
      {"silu_no_mul", "XPUExpertsBlockFp8", "xpu", "none", act(A::kSiluNoMul), W128, A128, std_fmt,
       {}, "+MoEActivation.SILU_NO_MUL activation"},
      {"relu2_no_mul ok", "XPUExpertsBlockFp8", "xpu", "none", act(A::kRelu2NoMul), W128, A128,
       std_fmt, {}, ""},
      // ---- CPUExpertsFp8 -----------------------------------------------------------------------
      {"ok", "CPUExpertsFp8", "cpu", "all", none, W128, A128, std_fmt, {}, ""},
      {"only amx_tile needed", "CPUExpertsFp8", "cpu", "amx_tile", none, W128, A128, std_fmt, {},
       ""},
      {"no amx_tile", "CPUExpertsFp8", "cpu", "amx_fp8", none, W128, A128, std_fmt, {},
       "+current device cpu"},
      {"arm", "CPUExpertsFp8", "cpu:arm", "all", none, W128, A128, std_fmt, {},
       "+current device cpu"},
      {"cuda", "CPUExpertsFp8", "cuda:90", "all", none, W128, A128, std_fmt, {},
       "+current device cuda"},
      {"silu_no_mul", "CPUExpertsFp8", "cpu", "all", act(A::kSiluNoMul), W128, A128, std_fmt, {},
       "+no act_and_mul MLP layer"},
      {"gelu", "CPUExpertsFp8", "cpu", "all", act(A::kGelu), W128, A128, std_fmt, {},
       "+MoEActivation.GELU activation"},
      {"per-tensor", "CPUExpertsFp8", "cpu", "all", none, WT, AT, std_fmt, {}, "QUANT"},
      {"refined", "CPUExpertsFp8", "cpu", "all", none, W64, A128, std_fmt, {}, "QUANT"},
      {"routing DeepSeekV3", "CPUExpertsFp8", "cpu", "all", routing(R::kDeepSeekV3), W128, A128,
       std_fmt, {}, "+routing method 2"},
      {"routing Default ok", "CPUExpertsFp8", "cpu", "all", routing(R::kDefault), W128, A128,
       std_fmt, {}, ""},
      {"routing RenormalizeNaive ok", "CPUExpertsFp8", "cpu", "all", routing(R::kRenormalizeNaive),
       W128, A128, std_fmt, {}, ""},
      {"logits f16 ok", "CPUExpertsFp8", "cpu", "all", logits(DType::kF16), W128, A128, std_fmt, {},
       ""},
      {"bias ok", "CPUExpertsFp8", "cpu", "all", bias, W128, A128, std_fmt, {}, ""},
      {"batched", "CPUExpertsFp8", "cpu", "all", none, W128, A128, bat_fmt, {},
       "+('batched_experts',) activation format"},
      {"lora", "CPUExpertsFp8", "cpu", "all", lora, W128, A128, std_fmt, {}, "+LoRA"},
      {"batch invariance", "CPUExpertsFp8", "cpu", "all", none, W128, A128, std_fmt, bi,
       "+batch invariance"},
      // ---- CPUExpertsFp8W8A8 (fp8moe's class for the seed's CPU_W8A8) ---------------------------
      {"ok", "CPUExpertsFp8W8A8", "cpu", "all", none, W128, A128, std_fmt, {}, ""},
      {"only amx_fp8 needed", "CPUExpertsFp8W8A8", "cpu", "amx_fp8", none, W128, A128, std_fmt, {},
       ""},
      {"no amx_fp8", "CPUExpertsFp8W8A8", "cpu", "amx_tile", none, W128, A128, std_fmt, {},
       "+current device cpu"},
      {"arm", "CPUExpertsFp8W8A8", "cpu:arm", "all", none, W128, A128, std_fmt, {},
       "+current device cpu"},
      {"routing Sigmoid", "CPUExpertsFp8W8A8", "cpu", "all", routing(R::kSigmoid), W128, A128,
       std_fmt, {}, "+routing method 8"},
      {"per-tensor", "CPUExpertsFp8W8A8", "cpu", "all", none, WT, AT, std_fmt, {}, "QUANT"},
      {"bias", "CPUExpertsFp8W8A8", "cpu", "all", bias, W128, A128, std_fmt, {},
       "kernel does not support expert bias (the CPU_W8A8 quant config carries no biases)"},
      {"swiglu limit", "CPUExpertsFp8W8A8", "cpu", "all", [](Deploy& d) { d.limit = 7.0; }, W128,
       A128, std_fmt, {},
       "kernel does not support SwiGLU limit/alpha/beta (the CPU_W8A8 quant config carries no "
       "SwiGLU parameters)"},
      {"swiglu alpha", "CPUExpertsFp8W8A8", "cpu", "all", [](Deploy& d) { d.alpha = 1.702; }, W128,
       A128, std_fmt, {},
       "kernel does not support SwiGLU limit/alpha/beta (the CPU_W8A8 quant config carries no "
       "SwiGLU parameters)"},
      {"swiglu beta", "CPUExpertsFp8W8A8", "cpu", "all", [](Deploy& d) { d.beta = 1.0; }, W128,
       A128, std_fmt, {},
       "kernel does not support SwiGLU limit/alpha/beta (the CPU_W8A8 quant config carries no "
       "SwiGLU parameters)"},
      {"gelu before bias", "CPUExpertsFp8W8A8", "cpu", "all",
       [](Deploy& d) { d.bias = true; d.act = MoeActivation::kGelu; }, W128, A128, std_fmt, {},
       "+MoEActivation.GELU activation"},
      // ---- HPCExperts --------------------------------------------------------------------------
      {"ok", "HPCExperts", "cuda:90", "all", none, W128, A128, std_fmt, {}, ""},
      {"per-tensor ok", "HPCExperts", "cuda:90", "all", none, WT, AT, std_fmt, {}, ""},
      {"sm100", "HPCExperts", "cuda:100", "all", none, W128, A128, std_fmt, {},
       "+current device cuda"},
      {"not installed", "HPCExperts", "cuda:90", "deep_gemm", none, W128, A128, std_fmt, {},
       "+current device cuda"},
      {"gelu", "HPCExperts", "cuda:90", "all", act(A::kGelu), W128, A128, std_fmt, {},
       "+MoEActivation.GELU activation"},
      {"TD", "HPCExperts", "cuda:90", "all", none, WT, AD, std_fmt, {}, "QUANT"},
      {"hidden 2000", "HPCExperts", "cuda:90", "all", hidden(2000), W128, A128, std_fmt, {},
       "kernel does not support 2000 hidden dim is not supported"},
      {"hidden 7168 ok", "HPCExperts", "cuda:90", "all", hidden(7168), W128, A128, std_fmt, {}, ""},
  };
  // clang-format on
}

TEST(Experts, EveryPredicateWithVllmReasons) {  // pitfall 28
  int n = 0;
  for (const Case& c : cases()) {
    SCOPED_TRACE(::testing::Message() << c.kernel << ": " << c.label << " on " << c.platform);
    const ExpertsKernel* k = find_experts_kernel(c.kernel);
    ASSERT_NE(k, nullptr);
    const Platform p = testing::plat(c.platform, c.installed);
    const OracleEnv env = testing::env_of(c.env);
    Deploy d;
    c.mutate(d);
    const MoeConfig config = d.build();
    const OptQuantKey w = with_fp8_dtype(c.w, p.fp8_dtype());
    const OptQuantKey a = with_fp8_dtype(c.a, p.fp8_dtype());
    std::string expect = c.expect;
    if (expect == "QUANT") {
      expect = quant_reason(c.w, c.a, p.fp8_dtype());
    } else if (expect == "PAR") {
      expect = std::string(kPrefix) + "parallel config " + config.moe_parallel_config.repr();
    } else if (!expect.empty() && expect[0] == '+') {
      expect = std::string(kPrefix) + expect.substr(1);
    }
    const Support s = is_supported_config(*k, config, w, a, c.format, ExpertsContext{p, env});
    EXPECT_EQ(s.ok, expect.empty()) << s.reason;
    EXPECT_EQ(s.reason, expect);
    ++n;
  }
  EXPECT_GT(n, 200);
}

TEST(Experts, QuantReasonText) {
  // One literal check of the QuantKey x QuantKey rendering.
  const Platform p = testing::plat("cuda:90");
  const Support s =
      is_supported_config(*find_experts_kernel("TrtLlmFp8ExpertsModular"), Deploy{}.build(),
                          kFp8StaticTensorSym, kFp8DynamicTensorSym, ActivationFormat::kStandard,
                          ExpertsContext{testing::plat("cuda:100"), OracleEnv()});
  EXPECT_EQ(s.reason,
            "kernel does not support quantization scheme "
            "QuantKey(f8e4m3fn,scale(f32,static,per_tensor),symmetric)xQuantKey(f8e4m3fn,scale("
            "f32,dynamic,per_tensor),symmetric)");
  const Support none = is_supported_config(*find_experts_kernel("CPUExpertsFp8"), Deploy{}.build(),
                                           std::nullopt, std::nullopt, ActivationFormat::kStandard,
                                           ExpertsContext{testing::plat("cpu"), OracleEnv()});
  EXPECT_EQ(none.reason, "kernel does not support quantization scheme NonexNone");
  (void)p;
}

TEST(Experts, NonIntegerEnvRaisesWhereVllmReadsIt) {
  const Platform p = testing::plat("cuda:90");
  const OracleEnv dg = testing::env_of({{"VLLM_USE_DEEP_GEMM", "abc"}});
  const MoeConfig c = Deploy{}.build();
  // is_deep_gemm_supported() reads VLLM_USE_DEEP_GEMM first.
  EXPECT_EQ(testing::msg_of([&] {
              is_supported_config(*find_experts_kernel("TritonOrDeepGemmExperts"), c,
                                  kFp8Static128BlockSym, kFp8Dynamic128Sym,
                                  ActivationFormat::kStandard, ExpertsContext{p, dg});
            }),
            "ValueError: invalid literal for int() with base 10: 'abc'");
  // TritonExperts never reads it.
  EXPECT_TRUE(is_supported_config(*find_experts_kernel("TritonExperts"), c, kFp8Static128BlockSym,
                                  kFp8Dynamic128Sym, ActivationFormat::kStandard,
                                  ExpertsContext{p, dg}));
  // VLLM_BATCH_INVARIANT is read at check 10 only: an earlier failure hides a bad value.
  const OracleEnv bi = testing::env_of({{"VLLM_BATCH_INVARIANT", "yes"}});
  EXPECT_THROW(
      is_supported_config(*find_experts_kernel("TritonExperts"), c, kFp8Static128BlockSym,
                          kFp8Dynamic128Sym, ActivationFormat::kStandard, ExpertsContext{p, bi}),
      ValueError);
  EXPECT_FALSE(is_supported_config(*find_experts_kernel("TritonExperts"), c, kFp8Static128BlockSym,
                                   kFp8Dynamic128Sym, ActivationFormat::kStandard,
                                   ExpertsContext{testing::plat("cpu"), bi}));
}

TEST(Experts, EveryDescriptorIsComplete) {
  for (const ExpertsKernel* k : builtin_experts_kernels()) {
    SCOPED_TRACE(k->name);
    EXPECT_NE(k->supports_current_device, nullptr);
    EXPECT_NE(k->supports_no_act_and_mul, nullptr);
    EXPECT_NE(k->supports_activation, nullptr);
    EXPECT_NE(k->supports_quant_scheme, nullptr);
    EXPECT_NE(k->supports_parallel_config, nullptr);
    EXPECT_STRNE(k->summary, "");
    EXPECT_EQ(find_experts_kernel(k->name), k);
  }
  EXPECT_EQ(find_experts_kernel("NoSuchExperts"), nullptr);
  // The implementation links fixed by fused_moe.hpp.
  EXPECT_STREQ(find_experts_kernel("CPUExpertsFp8")->impl_name, "cpu_w8a16");
  EXPECT_STREQ(find_experts_kernel("CPUExpertsFp8W8A8")->impl_name, "cpu_w8a8");
  EXPECT_STREQ(find_experts_kernel("TritonExperts")->impl_name, "cuda_fused");
  EXPECT_STREQ(find_experts_kernel("BatchedTritonExperts")->impl_name, "cuda_fused_batched");
  EXPECT_STREQ(find_experts_kernel("TritonOrDeepGemmExperts")->impl_name, "cuda_grouped");
  EXPECT_STREQ(find_experts_kernel("TritonOrDeepGemmExperts")->fallback_impl_name, "cuda_fused");
  EXPECT_STREQ(find_experts_kernel("BatchedDeepGemmExperts")->impl_name, "cuda_grouped_masked");
  EXPECT_EQ(find_experts_kernel("MarlinExperts")->impl_name, nullptr);
}

bool yes(const ExpertsContext&) { return true; }
bool yes_act(MoeActivation, const ExpertsContext&) { return true; }
bool yes_quant(const OptQuantKey&, const OptQuantKey&, const ExpertsContext&) { return true; }
bool yes_par(const MoeParallelConfig&, const ExpertsContext&) { return true; }

TEST(Experts, Fp8moeImplementationCheckOnDetectedPlatformsOnly) {
  ExpertsKernel k{.name = "ImaginaryExperts",
                  .supports_current_device = yes,
                  .supports_no_act_and_mul = yes,
                  .supports_activation = yes_act,
                  .supports_quant_scheme = yes_quant,
                  .supports_parallel_config = yes_par,
                  .impl_name = "no_such_impl"};
  const MoeConfig c = Deploy{}.build();
  const Platform detected = Platform::detect();
  const OracleEnv env;
  EXPECT_TRUE(
      check_fp8moe_implementation(k, c, std::nullopt, std::nullopt, testing::plat("cuda:90")));
  Support s = experts_supported(k, c, std::nullopt, std::nullopt, ActivationFormat::kStandard,
                                ExpertsContext{detected, env});
  EXPECT_FALSE(s);
  EXPECT_EQ(s.reason, "fp8moe has no implementation of ImaginaryExperts on this machine");
  k.impl_name = nullptr;
  EXPECT_EQ(check_fp8moe_implementation(k, c, std::nullopt, std::nullopt, detected).reason,
            "fp8moe has no implementation of ImaginaryExperts on this machine");
  // The seed's reason comes first.
  const Platform cpu_detected = Platform::detect();
  const Support marlin = experts_supported(
      *find_experts_kernel("MarlinExperts"), c, kFp8Static128BlockSym, kFp8Dynamic128Sym,
      ActivationFormat::kStandard, ExpertsContext{cpu_detected, env});
  if (cpu_detected.is_cpu()) {
    EXPECT_EQ(marlin.reason, "kernel does not support current device cpu");
  }
}

}  // namespace
}  // namespace fp8moe

namespace fp8moe {
namespace {

TEST(KernelRegistry, NamesAreUniqueAndFindable) {
  std::set<std::string> names;
  for (const ExpertsImpl* impl : experts_impls()) {
    ASSERT_NE(impl, nullptr);
    ASSERT_NE(impl->name, nullptr);
    EXPECT_TRUE(names.insert(impl->name).second) << "duplicate " << impl->name;
    EXPECT_EQ(find_experts_impl(impl->name), impl);
  }
  EXPECT_NE(find_experts_impl("ref"), nullptr);
  EXPECT_EQ(find_experts_impl("no_such_impl"), nullptr);
  EXPECT_FALSE(experts_impl_available("no_such_impl"));
}

}  // namespace
}  // namespace fp8moe
