// select_fp8_moe_backend: every branch (explicit backend, batched mapping, the vLLM-CUTLASS gate,
// the DeepGEMM and AITER env overrides, the auto scan, NotImplementedError vs NONE), the four
// reorder rules, map_fp8_backend's text, logging, and out-of-tree registration.
#include <gtest/gtest.h>

#include <algorithm>

#include "fp8moe/error.hpp"
#include "fp8moe/log.hpp"
#include "fp8moe/oracle.hpp"
#include "unit/oracle_test_util.hpp"

namespace fp8moe {
namespace {

using testing::Deploy;
using testing::env_of;
using testing::msg_of;
using testing::plat;

const QuantKey& W128 = kFp8Static128BlockSym;
const QuantKey& A128 = kFp8Dynamic128Sym;

struct Result {
  std::string backend;
  std::string kernel;
  std::vector<std::string> candidates;
  std::string error;
  Selection sel;
};

Result run(const Deploy& d, const Platform& p, const OracleEnv& env = {},
           OptQuantKey w = kFp8Static128BlockSym, OptQuantKey a = kFp8Dynamic128Sym,
           bool allow_cutlass = false) {
  Result r;
  const MoeConfig c = d.build();
  w = with_fp8_dtype(w, p.fp8_dtype());
  a = with_fp8_dtype(a, p.fp8_dtype());
  Selection progress;
  try {
    r.sel = select_fp8_moe_backend(c, w, a, allow_cutlass, p, env, &progress);
    r.backend = backend_value(r.sel.backend);
    r.kernel = r.sel.kernel ? r.sel.kernel->name : "";
    r.candidates = r.sel.candidates;
  } catch (const Error& e) {
    r.error = std::string(e.kind()) + ": " + e.what();
    r.sel = progress;
    r.candidates = progress.candidates;
  }
  return r;
}

bool contains(const std::vector<std::string>& v, const std::string& x) {
  return std::find(v.begin(), v.end(), x) != v.end();
}

const std::vector<std::string> kBase = {"AITER",
                                        "FLASHINFER_TRTLLM",
                                        "FLASHINFER_CUTLASS",
                                        "DEEPGEMM",
                                        "VLLM_CUTLASS",
                                        "TRITON",
                                        "MARLIN",
                                        "HUMMING",
                                        "BATCHED_DEEPGEMM",
                                        "BATCHED_VLLM_CUTLASS",
                                        "BATCHED_TRITON",
                                        "XPU",
                                        "CPU_W8A8",
                                        "CPU",
                                        "HPC"};

std::vector<std::string> priority(const Deploy& d, const Platform& p, OptQuantKey w = W128,
                                  OptQuantKey a = A128) {
  std::vector<std::string> r;
  for (Fp8MoeBackend b : get_priority_backends(d.build(), with_fp8_dtype(w, p.fp8_dtype()),
                                               with_fp8_dtype(a, p.fp8_dtype()), p))
    r.push_back(backend_value(b));
  return r;
}

std::vector<std::string> front(std::vector<std::string> order,
                               std::initializer_list<const char*> firsts) {
  for (auto it = std::rbegin(firsts); it != std::rend(firsts); ++it) {
    order.erase(std::find(order.begin(), order.end(), *it));
    order.insert(order.begin(), *it);
  }
  return order;
}

// ---- enum, map_fp8_backend, backend_to_kernel_cls ---------------------------------------------

TEST(Backend, ValuesInSeedOrder) {
  std::vector<std::string> values;
  for (Fp8MoeBackend b : builtin_fp8_moe_backends()) values.push_back(backend_value(b));
  EXPECT_EQ(values,
            (std::vector<std::string>{"NONE", "FLASHINFER_TRTLLM", "FLASHINFER_CUTLASS", "DEEPGEMM",
                                      "BATCHED_DEEPGEMM", "MARLIN", "HUMMING", "TRITON",
                                      "BATCHED_TRITON", "AITER", "VLLM_CUTLASS",
                                      "BATCHED_VLLM_CUTLASS", "XPU", "CPU_W8A8", "CPU", "HPC"}));
  EXPECT_EQ(parse_backend_value("triton"), Fp8MoeBackend::kTriton);
  EXPECT_EQ(parse_backend_value("cpu_w8a8"), Fp8MoeBackend::kCpuW8A8);
  EXPECT_EQ(parse_backend_value("deep_gemm"), Fp8MoeBackend::kDeepGemm);
  EXPECT_THROW(parse_backend_value("nope"), ValueError);
}

TEST(Backend, MapFp8Backend) {
  const std::pair<const char*, Fp8MoeBackend> ok[] = {
      {"triton", Fp8MoeBackend::kTriton},
      {"deep_gemm", Fp8MoeBackend::kDeepGemm},
      {"cutlass", Fp8MoeBackend::kVllmCutlass},
      {"flashinfer_trtllm", Fp8MoeBackend::kFlashinferTrtllm},
      {"flashinfer_cutlass", Fp8MoeBackend::kFlashinferCutlass},
      {"marlin", Fp8MoeBackend::kMarlin},
      {"humming", Fp8MoeBackend::kHumming},
      {"aiter", Fp8MoeBackend::kAiter},
      {"hpc", Fp8MoeBackend::kHpc}};
  for (const auto& [name, b] : ok) EXPECT_EQ(map_fp8_backend(name), b) << name;
  // Valid MoEBackend literals that the FP8 oracle does not map, and junk.
  for (const char* bad :
       {"x", "batched_triton", "emulation", "flydsl", "deep_gemm_mega_moe", "flashinfer_cutedsl",
        "b12x", "triton_unfused", "auto", "Triton", "cpu"}) {
    EXPECT_EQ(msg_of([&] { map_fp8_backend(bad); }),
              std::string("ValueError: moe_backend='") + bad +
                  "' is not supported for FP8 MoE. Expected one of ['triton', 'deep_gemm', "
                  "'cutlass', 'flashinfer_trtllm', 'flashinfer_cutlass', 'marlin', 'humming', "
                  "'aiter', 'hpc'].");
  }
}

TEST(Backend, KernelClassesPerBackend) {
  const std::pair<Fp8MoeBackend, std::vector<std::string>> table[] = {
      {Fp8MoeBackend::kFlashinferTrtllm, {"TrtLlmFp8ExpertsMonolithic", "TrtLlmFp8ExpertsModular"}},
      {Fp8MoeBackend::kFlashinferCutlass, {"FlashInferExperts"}},
      {Fp8MoeBackend::kDeepGemm, {"TritonOrDeepGemmExperts"}},
      {Fp8MoeBackend::kBatchedDeepGemm, {"BatchedDeepGemmExperts"}},
      {Fp8MoeBackend::kHumming,
       {"BatchedHummingGroupedExperts", "HummingGroupedExperts", "HummingIndexedExperts"}},
      {Fp8MoeBackend::kMarlin, {"MarlinExperts"}},
      {Fp8MoeBackend::kTriton, {"TritonExperts"}},
      {Fp8MoeBackend::kBatchedTriton, {"BatchedTritonExperts"}},
      {Fp8MoeBackend::kAiter, {"AiterExperts"}},
      {Fp8MoeBackend::kVllmCutlass, {"TritonOrCutlassExperts"}},
      {Fp8MoeBackend::kBatchedVllmCutlass, {"CutlassBatchedExpertsFp8"}},
      {Fp8MoeBackend::kXpu, {"XPUExpertsFp8", "XPUExpertsMxFp8", "XPUExpertsBlockFp8"}},
      {Fp8MoeBackend::kCpuW8A8, {"CPUExpertsFp8W8A8"}},
      {Fp8MoeBackend::kCpu, {"CPUExpertsFp8"}},
      {Fp8MoeBackend::kHpc, {"HPCExperts"}},
  };
  for (const auto& [b, names] : table) {
    std::vector<std::string> got;
    for (const ExpertsKernel* k : backend_to_kernel_cls(b)) got.push_back(k->name);
    EXPECT_EQ(got, names) << backend_value(b);
  }
  EXPECT_EQ(msg_of([] { backend_to_kernel_cls(Fp8MoeBackend::kNone); }),
            "ValueError: Unknown FP8 MoE backend: NONE");
}

// ---- the reorder rules -------------------------------------------------------------------------

TEST(Priority, BaseOrderAndTheFourRules) {  // pitfall 28
  Deploy tp;
  Deploy ep8;
  ep8.tp = 8;
  ep8.ep = true;
  Deploy v2;  // DeepEP v2: dp > 1 with EP and the deepep_v2 all2all
  v2.dp = 2;
  v2.ep = true;
  v2.a2a = "deepep_v2";
  Deploy v2_no_dp = v2;  // EP without DP: no all2all kernels, so no DeepEP v2
  v2_no_dp.dp = 1;
  v2_no_dp.tp = 2;
  const QuantKey W64 = create_fp8_quant_key(true, GroupShape(64, 64));

  struct Case {
    const char* label;
    Deploy d;
    const char* platform;
    OptQuantKey w, a;
    std::vector<std::string> expect;
  };
  const Case cases[] = {
      {"cuda:100 no rule", tp, "cuda:100", W128, A128, kBase},
      {"rule 1: sm100 + deepep v2 + block", v2, "cuda:100", W128, A128,
       front(kBase, {"FLASHINFER_TRTLLM"})},
      {"rule 1: sm103 too (family)", v2, "cuda:103", W128, A128,
       front(kBase, {"FLASHINFER_TRTLLM"})},
      {"rule 1 needs dp > 1", v2_no_dp, "cuda:100", W128, A128, kBase},
      {"rule 1 needs the block keys", v2, "cuda:100", kFp8StaticTensorSym, kFp8StaticTensorSym,
       kBase},
      {"rule 1 not on sm120", v2, "cuda:120", W128, A128, kBase},
      {"rule 2: sm90 TP -> TRITON", tp, "cuda:90", W128, A128, front(kBase, {"TRITON"})},
      {"rule 2: sm90 EP -> FLASHINFER_CUTLASS", ep8, "cuda:90", W128, A128,
       front(kBase, {"FLASHINFER_CUTLASS"})},
      {"rule 2 and 1 on sm90 with deepep v2 (ep 2)", v2, "cuda:90", W128, A128,
       front(kBase, {"FLASHINFER_CUTLASS"})},
      {"rule 2 not for refined keys", tp, "cuda:90", W64, A128, kBase},
      {"rule 2 not for per-tensor", tp, "cuda:90", kFp8StaticTensorSym, kFp8StaticTensorSym, kBase},
      {"rule 2 not on sm89", tp, "cuda:89", W128, A128, kBase},
      {"rule 3: xpu", tp, "xpu", W128, A128, front(kBase, {"XPU"})},
      {"rule 4: cpu -> CPU_W8A8, CPU", tp, "cpu", W128, A128, front(kBase, {"CPU_W8A8", "CPU"})},
      {"rule 4 on arm too", tp, "cpu:arm", kFp8StaticTensorSym, std::nullopt,
       front(kBase, {"CPU_W8A8", "CPU"})},
      {"rocm: no rule", tp, "rocm:gfx942", W128, A128, kBase},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.label);
    EXPECT_EQ(priority(c.d, plat(c.platform), c.w, c.a), c.expect);
  }
  std::vector<std::string> notes;
  get_priority_backends(tp.build(), W128, A128, plat("cuda:90"), &notes);
  EXPECT_EQ(notes,
            (std::vector<std::string>{
                "rule 2: SM90 with block FP8 keys and ep_size 1 moves TRITON to the front"}));
}

// ---- the auto scan -----------------------------------------------------------------------------

TEST(Select, AutoScanOutcomes) {  // pitfall 28
  Deploy tp4;
  tp4.tp = 4;
  Deploy ep8;
  ep8.tp = 8;
  ep8.ep = true;
  Deploy v2;
  v2.dp = 2;
  v2.ep = true;
  v2.a2a = "deepep_v2";
  Deploy ll;  // batched format
  ll.dp = 2;
  ll.ep = true;
  ll.a2a = "deepep_low_latency";
  Deploy e4096;
  e4096.E = 4096;
  Deploy e1024;
  e1024.E = 1024;
  Deploy dflt;
  dflt.routing = RoutingMethodType::kDefault;
  Deploy bias;
  bias.bias = true;
  Deploy relu2;
  relu2.act = MoeActivation::kRelu2;
  Deploy lora;
  lora.lora = true;

  struct Case {
    const char* label;
    Deploy d;
    const char* platform;
    const char* installed;
    OptQuantKey w, a;
    const char* backend;
    const char* kernel;
  };
  const OptQuantKey TT = kFp8StaticTensorSym;
  const Case cases[] = {
      {"H200 TP block -> Triton", tp4, "cuda:90", "all", W128, A128, "TRITON", "TritonExperts"},
      {"H200 EP block -> FlashInfer CUTLASS", ep8, "cuda:90", "all", W128, A128,
       "FLASHINFER_CUTLASS", "FlashInferExperts"},
      {"H200 EP without FlashInfer -> Triton", ep8, "cuda:90", "none", W128, A128, "TRITON",
       "TritonExperts"},
      {"B200 block -> TRT-LLM monolithic", tp4, "cuda:100", "all", W128, A128, "FLASHINFER_TRTLLM",
       "TrtLlmFp8ExpertsMonolithic"},
      {"B200 routing Default -> TRT-LLM modular", dflt, "cuda:100", "all", W128, A128,
       "FLASHINFER_TRTLLM", "TrtLlmFp8ExpertsModular"},
      {"B200 deepep v2 -> TRT-LLM modular (rule 1)", v2, "cuda:100", "all", W128, A128,
       "FLASHINFER_TRTLLM", "TrtLlmFp8ExpertsModular"},
      {"B200 4096 experts -> DeepGEMM (no padded-experts check)", e4096, "cuda:100", "all", W128,
       A128, "DEEPGEMM", "TritonOrDeepGemmExperts"},
      {"B200 nothing installed -> Triton", tp4, "cuda:100", "none", W128, A128, "TRITON",
       "TritonExperts"},
      {"B200 1024 experts, nothing installed -> Marlin", e1024, "cuda:100", "none", W128, A128,
       "MARLIN", "MarlinExperts"},
      {"A100 block FP8 -> Marlin W8A16", tp4, "cuda:80", "all", W128, A128, "MARLIN",
       "MarlinExperts"},
      {"H200 per-tensor -> FlashInfer CUTLASS", tp4, "cuda:90", "all", TT, TT, "FLASHINFER_CUTLASS",
       "FlashInferExperts"},
      {"H200 LoRA -> Triton (LoRA-capable)", lora, "cuda:90", "all", W128, A128, "TRITON",
       "TritonExperts"},
      {"batched format -> BATCHED_DEEPGEMM", ll, "cuda:90", "all", W128, A128, "BATCHED_DEEPGEMM",
       "BatchedDeepGemmExperts"},
      {"batched format, no DeepGEMM -> BATCHED_TRITON", ll, "cuda:90", "none", W128, A128,
       "BATCHED_TRITON", "BatchedTritonExperts"},
      {"MI300 block -> Triton", tp4, "rocm:gfx942", "all", W128, A128, "TRITON", "TritonExperts"},
      {"xpu block -> XPUExpertsBlockFp8", tp4, "xpu", "all", W128, A128, "XPU",
       "XPUExpertsBlockFp8"},
      {"cpu -> CPU_W8A8", tp4, "cpu", "all", W128, A128, "CPU_W8A8", "CPUExpertsFp8W8A8"},
      {"cpu with bias -> CPU (W8A8 falls through)", bias, "cpu", "all", W128, A128, "CPU",
       "CPUExpertsFp8"},
      {"cpu without AMX-FP8 -> CPU", tp4, "cpu", "amx_tile", W128, A128, "CPU", "CPUExpertsFp8"},
      {"cpu with nothing -> NONE", tp4, "cpu", "none", W128, A128, "NONE", ""},
      {"arm cpu -> NONE", tp4, "cpu:arm", "all", W128, A128, "NONE", ""},
      {"xpu with gated relu2 -> NONE", relu2, "xpu", "all", W128, A128, "NONE", ""},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.label);
    const Result r = run(c.d, plat(c.platform, c.installed), {}, c.w, c.a);
    EXPECT_EQ(r.error, "");
    EXPECT_EQ(r.backend, c.backend);
    EXPECT_EQ(r.kernel, c.kernel);
    EXPECT_EQ(r.sel.path, std::string(c.backend) == "NONE" ? "none" : "auto");
    // The trace ends with the chosen class; every earlier entry is a rejection with a reason.
    ASSERT_FALSE(r.sel.trace.empty());
    for (std::size_t i = 0; i + 1 < r.sel.trace.size(); ++i) {
      EXPECT_FALSE(r.sel.trace[i].supported);
      EXPECT_FALSE(r.sel.trace[i].reason.empty());
    }
    if (r.sel.kernel) {
      EXPECT_TRUE(r.sel.trace.back().supported);
      EXPECT_EQ(r.sel.trace.back().kernel, c.kernel);
    }
    // vLL-CUTLASS is removed from the auto scan when not allowed.
    EXPECT_FALSE(contains(r.candidates, "VLLM_CUTLASS"));
    EXPECT_FALSE(contains(r.candidates, "BATCHED_VLLM_CUTLASS"));
  }
}

TEST(Select, NoBackendRaisesOnCudaAndRocm) {  // pitfall 26
  Deploy relu2;
  relu2.act = MoeActivation::kRelu2;
  for (const char* p : {"cuda:90", "cuda:70", "rocm:gfx942", "rocm:gfx1201"}) {
    SCOPED_TRACE(p);
    const Result r = run(relu2, plat(p));
    EXPECT_EQ(r.error,
              "NotImplementedError: No FP8 MoE backend supports the deployment configuration.");
    // The trace explains every candidate.
    std::size_t classes = 0;
    for (const auto& b : r.candidates)
      classes += backend_to_kernel_cls(parse_backend_value(b)).size();
    EXPECT_EQ(r.sel.trace.size(), classes);
  }
  // Block FP8 on a Volta: nothing fits either.
  EXPECT_EQ(run(Deploy{}, plat("cuda:70")).error,
            "NotImplementedError: No FP8 MoE backend supports the deployment configuration.");
}

TEST(Select, CutlassGate) {
  Deploy d;
  const OptQuantKey TT = kFp8StaticTensorSym;
  // auto: VLLM_CUTLASS stays a candidate only with allow_vllm_cutlass.
  Result r = run(d, plat("cuda:90", "cutlass_group_gemm"), {}, TT, TT, true);
  EXPECT_EQ(r.backend, "VLLM_CUTLASS");
  EXPECT_EQ(r.kernel, "TritonOrCutlassExperts");
  EXPECT_TRUE(contains(r.candidates, "BATCHED_VLLM_CUTLASS"));
  r = run(d, plat("cuda:90", "cutlass_group_gemm"), {}, TT, TT, false);
  EXPECT_EQ(r.backend, "TRITON");
  // explicit cutlass
  d.backend = "cutlass";
  EXPECT_EQ(run(d, plat("cuda:90"), {}, TT, TT, false).error,
            "ValueError: vLLM CUTLASS FP8 MoE backend is disabled for this configuration.");
  r = run(d, plat("cuda:90"), {}, TT, TT, true);
  EXPECT_EQ(r.backend, "VLLM_CUTLASS");
  EXPECT_EQ(r.sel.path, "moe_backend");
  // Batched mapping happens before the gate: BATCHED_VLLM_CUTLASS is refused too.
  Deploy ll = d;
  ll.dp = 2;
  ll.ep = true;
  ll.a2a = "deepep_low_latency";
  EXPECT_EQ(run(ll, plat("cuda:90"), {}, TT, TT, false).error,
            "ValueError: vLLM CUTLASS FP8 MoE backend is disabled for this configuration.");
  r = run(ll, plat("cuda:90"), {}, TT, TT, true);
  EXPECT_EQ(r.backend, "BATCHED_VLLM_CUTLASS");
  EXPECT_EQ(r.kernel, "CutlassBatchedExpertsFp8");
}

TEST(Select, ExplicitBackend) {  // pitfall 25
  const auto explicit_run = [](const char* backend, Deploy d, const Platform& p,
                               OptQuantKey w = W128, OptQuantKey a = A128,
                               const OracleEnv& env = {}) {
    d.backend = backend;
    return run(d, p, env, w, a);
  };
  Result r = explicit_run("triton", Deploy{}, plat("cuda:100"));
  EXPECT_EQ(r.backend, "TRITON");
  EXPECT_EQ(r.sel.path, "moe_backend");
  ASSERT_EQ(r.sel.trace.size(), 1u);
  EXPECT_TRUE(r.sel.trace[0].supported);
  // The candidates are the priority list (no removals on the explicit path).
  EXPECT_EQ(r.candidates, kBase);

  r = explicit_run("marlin", Deploy{}, plat("cuda:90"));
  EXPECT_EQ(r.backend, "MARLIN");

  // An explicit backend wins over the env overrides (which are not even parsed).
  r = explicit_run("triton", Deploy{}, plat("cuda:90"), W128, A128,
                   env_of({{"VLLM_USE_DEEP_GEMM", "abc"}, {"VLLM_ROCM_USE_AITER", "1"}}));
  EXPECT_EQ(r.backend, "TRITON");

  // Unsupported: the reason of the LAST class tried.
  r = explicit_run("flashinfer_trtllm", Deploy{}, plat("cuda:90"));
  EXPECT_EQ(r.error,
            "ValueError: FP8 MoE backend FLASHINFER_TRTLLM does not support the deployment "
            "configuration since kernel does not support current device cuda.");
  ASSERT_EQ(r.sel.trace.size(), 2u);
  Deploy dflt;
  dflt.routing = RoutingMethodType::kDefault;
  r = explicit_run("flashinfer_trtllm", dflt, plat("cuda:100"), kFp8StaticTensorSym,
                   kFp8StaticTensorSym);
  ASSERT_EQ(r.sel.trace.size(), 2u);
  EXPECT_EQ(r.sel.trace[0].reason, "kernel does not support routing method 0");
  EXPECT_EQ(r.error,
            "ValueError: FP8 MoE backend FLASHINFER_TRTLLM does not support the deployment "
            "configuration since kernel does not support quantization scheme "
            "QuantKey(f8e4m3fn,scale(f32,static,per_tensor),symmetric)xQuantKey(f8e4m3fn,scale("
            "f32,static,per_tensor),symmetric).");
  Deploy e3000;
  e3000.E = 3000;
  r = explicit_run("flashinfer_trtllm", e3000, plat("cuda:100"));
  EXPECT_EQ(r.error,
            "ValueError: FP8 MoE backend FLASHINFER_TRTLLM does not support the deployment "
            "configuration since FlashInfer TRTLLM routing supports at most 2048 experts, but got "
            "3000.");
  Deploy h2000;
  h2000.H = 2000;
  r = explicit_run("hpc", h2000, plat("cuda:90"));
  EXPECT_EQ(r.error,
            "ValueError: FP8 MoE backend HPC does not support the deployment configuration since "
            "kernel does not support 2000 hidden dim is not supported.");
  r = explicit_run("humming", Deploy{}, plat("cuda:90"));
  EXPECT_EQ(r.backend, "HUMMING");
  EXPECT_EQ(r.kernel, "HummingIndexedExperts");
  EXPECT_EQ(r.sel.trace.size(), 3u);
  r = explicit_run("deep_gemm", Deploy{}, plat("cuda:90"), kFp8StaticTensorSym,
                   kFp8StaticTensorSym);
  EXPECT_EQ(r.error,
            "ValueError: FP8 MoE backend DEEPGEMM does not support the deployment configuration "
            "since kernel does not support quantization scheme "
            "QuantKey(f8e4m3fn,scale(f32,static,per_tensor),symmetric)xQuantKey(f8e4m3fn,scale("
            "f32,static,per_tensor),symmetric).");
  r = explicit_run("bogus", Deploy{}, plat("cuda:90"));
  EXPECT_EQ(r.error.rfind("ValueError: moe_backend='bogus' is not supported for FP8 MoE.", 0), 0u);

  // Batched format maps TRITON / DEEPGEMM to their batched variants; others are kept.
  Deploy ll;
  ll.dp = 2;
  ll.ep = true;
  ll.a2a = "nixl_ep";
  r = explicit_run("triton", ll, plat("cuda:90"));
  EXPECT_EQ(r.backend, "BATCHED_TRITON");
  EXPECT_EQ(r.sel.activation_format, ActivationFormat::kBatchedExperts);
  r = explicit_run("deep_gemm", ll, plat("cuda:90"));
  EXPECT_EQ(r.backend, "BATCHED_DEEPGEMM");
  r = explicit_run("marlin", ll, plat("cuda:90"));
  EXPECT_EQ(r.error,
            "ValueError: FP8 MoE backend MARLIN does not support the deployment configuration "
            "since kernel does not support ('batched_experts',) activation format.");
}

// ---- the DeepGEMM env override: every combination of unset / 0 / 1 / garbage -------------------

TEST(Select, DeepGemmEnvCombinations) {
  enum Outcome { kAuto, kRemoved, kForced, kError };
  const char* kUnset = nullptr;
  struct Case {
    const char* use;
    const char* moe;
    Outcome out;
  };
  const Case cases[] = {
      {kUnset, kUnset, kAuto}, {kUnset, "0", kRemoved}, {kUnset, "1", kForced},
      {kUnset, "x", kError},   {"0", kUnset, kRemoved}, {"0", "0", kRemoved},
      {"0", "1", kRemoved},    {"0", "x", kRemoved},  // `not A or ...` short-circuits
      {"1", kUnset, kForced},  {"1", "0", kRemoved},    {"1", "1", kForced},
      {"1", "x", kError},      {"x", kUnset, kError},   {"x", "0", kError},
      {"x", "1", kError},      {"x", "x", kError},      {" 1 ", "+1", kForced},
      {"1_0", "-0", kRemoved}, {"", kUnset, kError},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(::testing::Message() << "VLLM_USE_DEEP_GEMM=" << (c.use ? c.use : "<unset>")
                                      << " VLLM_MOE_USE_DEEP_GEMM=" << (c.moe ? c.moe : "<unset>"));
    OracleEnv env;
    if (c.use) env.set("VLLM_USE_DEEP_GEMM", c.use);
    if (c.moe) env.set("VLLM_MOE_USE_DEEP_GEMM", c.moe);
    const Result r = run(Deploy{}, plat("cuda:90"), env);
    switch (c.out) {
      case kAuto:
        EXPECT_EQ(r.backend, "TRITON");
        EXPECT_TRUE(contains(r.candidates, "DEEPGEMM"));
        EXPECT_EQ(r.sel.path, "auto");
        break;
      case kRemoved:
        EXPECT_EQ(r.backend, "TRITON");
        EXPECT_FALSE(contains(r.candidates, "DEEPGEMM"));
        EXPECT_FALSE(contains(r.candidates, "BATCHED_DEEPGEMM"));
        EXPECT_EQ(r.sel.path, "auto");
        break;
      case kForced:
        EXPECT_EQ(r.backend, "DEEPGEMM");
        EXPECT_EQ(r.kernel, "TritonOrDeepGemmExperts");
        EXPECT_EQ(r.sel.path, "VLLM_USE_DEEP_GEMM");
        break;
      case kError: {
        const char* bad = (c.use && std::string(c.use) != "1") ? c.use : c.moe;
        EXPECT_EQ(r.error,
                  std::string("ValueError: invalid literal for int() with base 10: '") + bad + "'");
        break;
      }
    }
  }
}

TEST(Select, DeepGemmForcedPaths) {  // pitfall 30
  const OracleEnv on = env_of({{"VLLM_USE_DEEP_GEMM", "1"}});
  // Forced onto a configuration DeepGEMM cannot run: ValueError, no fallback.
  EXPECT_EQ(run(Deploy{}, plat("cuda:90"), on, kFp8StaticTensorSym, kFp8StaticTensorSym).error,
            "ValueError: FP8 MoE backend DEEPGEMM does not support the deployment configuration "
            "since kernel does not support quantization scheme "
            "QuantKey(f8e4m3fn,scale(f32,static,per_tensor),symmetric)xQuantKey(f8e4m3fn,scale("
            "f32,static,per_tensor),symmetric).");
  EXPECT_EQ(run(Deploy{}, plat("cuda:90", "none"), on).error,
            "ValueError: FP8 MoE backend DEEPGEMM does not support the deployment configuration "
            "since kernel does not support current device cuda.");
  // Batched format forces BATCHED_DEEPGEMM.
  Deploy ll;
  ll.dp = 2;
  ll.ep = true;
  ll.a2a = "deepep_low_latency";
  const Result r = run(ll, plat("cuda:90"), env_of({{"VLLM_MOE_USE_DEEP_GEMM", "1"}}));
  EXPECT_EQ(r.backend, "BATCHED_DEEPGEMM");
  // Removal also applies on the batched format.
  const Result rm = run(ll, plat("cuda:90"), env_of({{"VLLM_MOE_USE_DEEP_GEMM", "0"}}));
  EXPECT_EQ(rm.backend, "BATCHED_TRITON");
}

// ---- the AITER env override --------------------------------------------------------------------

TEST(Select, AiterEnvCombinations) {
  enum Outcome { kAuto, kRemoved, kForced };
  const char* kUnset = nullptr;
  struct Case {
    const char* platform;
    const char* installed;
    const char* aiter;
    const char* moe;
    Outcome out;
  };
  const Case cases[] = {
      {"rocm:gfx942", "all", kUnset, kUnset, kAuto},
      {"rocm:gfx942", "all", "1", kUnset, kForced},
      {"rocm:gfx942", "all", "true", kUnset, kForced},
      {"rocm:gfx942", "all", "TRUE", "True", kForced},
      {"rocm:gfx942", "all", "1", "1", kForced},
      {"rocm:gfx942", "all", "1", "0", kRemoved},
      {"rocm:gfx942", "all", "1", "false", kRemoved},
      {"rocm:gfx942", "all", "1", "other", kRemoved},
      {"rocm:gfx942", "all", "0", kUnset, kRemoved},
      {"rocm:gfx942", "all", "false", "1", kRemoved},
      {"rocm:gfx942", "all", "yes", kUnset, kRemoved},
      {"rocm:gfx942", "all", "2", kUnset, kRemoved},
      {"rocm:gfx942", "all", kUnset, "1", kRemoved},  // VLLM_ROCM_USE_AITER defaults to False
      {"rocm:gfx942", "all", kUnset, "0", kRemoved},
      {"rocm:gfx950", "all", "1", kUnset, kForced},
      // RDNA4 with aiter importable: is_rdna_aiter_enabled() removes AITER despite the env.
      {"rocm:gfx1201", "all", "1", "1", kRemoved},
      {"rocm:gfx1201", "all", "0", "1", kRemoved},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(::testing::Message() << c.platform << " AITER=" << (c.aiter ? c.aiter : "<unset>")
                                      << " AITER_MOE=" << (c.moe ? c.moe : "<unset>"));
    OracleEnv env;
    if (c.aiter) env.set("VLLM_ROCM_USE_AITER", c.aiter);
    if (c.moe) env.set("VLLM_ROCM_USE_AITER_MOE", c.moe);
    const Result r = run(Deploy{}, plat(c.platform, c.installed), env);
    EXPECT_EQ(r.error, "");
    switch (c.out) {
      case kAuto:
        EXPECT_EQ(r.backend, "TRITON");
        EXPECT_TRUE(contains(r.candidates, "AITER"));
        ASSERT_FALSE(r.sel.trace.empty());
        EXPECT_EQ(r.sel.trace[0].kernel, "AiterExperts");  // tried first, rejected
        break;
      case kRemoved:
        EXPECT_EQ(r.backend, "TRITON");
        EXPECT_FALSE(contains(r.candidates, "AITER"));
        break;
      case kForced:
        EXPECT_EQ(r.backend, "AITER");
        EXPECT_EQ(r.sel.path, "VLLM_ROCM_USE_AITER");
        break;
    }
  }
  // Forced where AITER cannot run: the reason carries AITER's hint.
  const std::string hint =
      ". AITER MoE is not enabled \xE2\x80\x94 set VLLM_ROCM_USE_AITER=1 and "
      "VLLM_ROCM_USE_AITER_MOE=1 to enable it.";
  EXPECT_EQ(run(Deploy{}, plat("cuda:90"), env_of({{"VLLM_ROCM_USE_AITER", "1"}})).error,
            "ValueError: FP8 MoE backend AITER does not support the deployment configuration "
            "since kernel does not support current device cuda" +
                hint);
  // RDNA4 without aiter: is_rdna_aiter_enabled() is False, so AITER is forced, and fails.
  EXPECT_EQ(
      run(Deploy{}, plat("rocm:gfx1201", "none"), env_of({{"VLLM_ROCM_USE_AITER", "1"}})).error,
      "ValueError: FP8 MoE backend AITER does not support the deployment configuration "
      "since kernel does not support current device rocm" +
          hint);
  // The DeepGEMM override runs first.
  const Result both = run(Deploy{}, plat("cuda:90"),
                          env_of({{"VLLM_USE_DEEP_GEMM", "1"}, {"VLLM_ROCM_USE_AITER", "1"}}));
  EXPECT_EQ(both.backend, "DEEPGEMM");
}

TEST(Select, CandidatesReflectRemovalsInTheLog) {
  std::vector<std::string> infos, debugs;
  set_log_sink([&](LogLevel l, std::string_view m) {
    (l == LogLevel::kInfo ? infos : debugs).emplace_back(m);
  });
  const LogLevel old = log_level();
  set_log_level(LogLevel::kDebug);
  reset_log_once();
  const Result r = run(Deploy{}, plat("cuda:100", "none"), env_of({{"VLLM_USE_DEEP_GEMM", "0"}}));
  set_log_level(old);
  set_log_sink(nullptr);
  EXPECT_EQ(r.backend, "TRITON");
  EXPECT_EQ(r.candidates,
            (std::vector<std::string>{"AITER", "FLASHINFER_TRTLLM", "FLASHINFER_CUTLASS", "TRITON",
                                      "MARLIN", "HUMMING", "BATCHED_TRITON", "XPU", "CPU_W8A8",
                                      "CPU", "HPC"}));
  ASSERT_EQ(infos.size(), 1u);
  EXPECT_EQ(infos[0],
            "Using TRITON Fp8 MoE backend out of potential backends: ['AITER', "
            "'FLASHINFER_TRTLLM', 'FLASHINFER_CUTLASS', 'TRITON', 'MARLIN', 'HUMMING', "
            "'BATCHED_TRITON', 'XPU', 'CPU_W8A8', 'CPU', 'HPC'].");
  // One debug line per rejected class (FLASHINFER_TRTLLM's two classes give the same line, which
  // debug_once prints once).
  ASSERT_EQ(debugs.size(), 3u);
  EXPECT_EQ(debugs[1],
            "FP8 MoE backend FLASHINFER_TRTLLM does not support the deployment configuration since "
            "kernel does not support current device cuda.");
  EXPECT_EQ(r.sel.trace.size(), 5u);
}

TEST(Select, LogUnsupportedForms) {
  EXPECT_EQ(make_log_unsupported(Fp8MoeBackend::kTriton, "kernel does not support LoRA"),
            "FP8 MoE backend TRITON does not support the deployment configuration since kernel "
            "does not support LoRA.");
  EXPECT_EQ(make_log_unsupported(Fp8MoeBackend::kTriton, ""),
            "FP8 MoE backend 'TRITON' does not support the deployment configuration.");
  EXPECT_EQ(make_log_backend(Fp8MoeBackend::kCpu, {"CPU_W8A8", "CPU"}),
            "Using CPU Fp8 MoE backend out of potential backends: ['CPU_W8A8', 'CPU'].");
  EXPECT_EQ(python_list_repr({}), "[]");
}

TEST(Select, ProgressHoldsTheTraceOnError) {  // pitfall 26
  Deploy relu2;
  relu2.act = MoeActivation::kRelu2;
  Selection progress;
  EXPECT_THROW(select_fp8_moe_backend(relu2.build(), W128, A128, false, plat("cuda:90"),
                                      OracleEnv(), &progress),
               NotImplementedError);
  EXPECT_FALSE(progress.trace.empty());
  EXPECT_EQ(progress.candidates.front(), "TRITON");
}

// ---- out-of-tree registration ------------------------------------------------------------------

bool oot_device(const ExpertsContext& c) { return c.platform.is_cuda(); }
bool oot_yes(const ExpertsContext&) { return true; }
bool oot_act(MoeActivation a, const ExpertsContext&) { return a == MoeActivation::kSilu; }
bool oot_quant(const OptQuantKey& w, const OptQuantKey&, const ExpertsContext&) {
  return w.has_value();
}
bool oot_par(const MoeParallelConfig&, const ExpertsContext&) { return true; }

const ExpertsKernel kOotExperts = {
    .name = "OotExperts",
    .module = "my_plugin",
    .supports_current_device = oot_device,
    .supports_no_act_and_mul = oot_yes,
    .supports_activation = oot_act,
    .supports_quant_scheme = oot_quant,
    .supports_parallel_config = oot_par,
    .summary = "a test plugin",
};

class Registration : public ::testing::Test {
 protected:
  void SetUp() override { clear_registered_fp8_moe_backends(); }
  void TearDown() override { clear_registered_fp8_moe_backends(); }
};

TEST_F(Registration, ExplicitAndAuto) {
  const Fp8MoeBackend b = register_fp8_moe_backend("My-Kernels", {&kOotExperts});
  EXPECT_EQ(backend_value(b), "MY_KERNELS");
  EXPECT_EQ(map_fp8_backend("my_kernels"), b);
  EXPECT_EQ(registered_fp8_moe_backend_names(), std::vector<std::string>{"my_kernels"});
  EXPECT_EQ(find_experts_kernel("OotExperts"), &kOotExperts);
  // The error text now names the registered backends.
  EXPECT_EQ(msg_of([] { map_fp8_backend("x"); }),
            "ValueError: moe_backend='x' is not supported for FP8 MoE. Expected one of ['triton', "
            "'deep_gemm', 'cutlass', 'flashinfer_trtllm', 'flashinfer_cutlass', 'marlin', "
            "'humming', 'aiter', 'hpc']. Registered backends: ['my_kernels'].");
  Deploy d;
  d.backend = "my_kernels";
  Result r = run(d, plat("cuda:90"));
  EXPECT_EQ(r.backend, "MY_KERNELS");
  EXPECT_EQ(r.kernel, "OotExperts");
  // Without auto_select the auto scan does not see it.
  r = run(Deploy{}, plat("cuda:70"));
  EXPECT_EQ(r.error,
            "NotImplementedError: No FP8 MoE backend supports the deployment configuration.");
  // Idempotent with the same configuration; a different one is an error.
  EXPECT_EQ(register_fp8_moe_backend("my_kernels", {&kOotExperts}), b);
  EXPECT_EQ(
      msg_of([] { register_fp8_moe_backend("my_kernels", {&kOotExperts}, {.auto_select = true}); }),
      "ValueError: FP8 MoE backend 'my_kernels' is already registered with a different "
      "configuration.");
}

TEST_F(Registration, AutoSelectAppendedOrInserted) {
  const Fp8MoeBackend b = register_fp8_moe_backend("oot", {&kOotExperts}, {.auto_select = true});
  std::vector<std::string> order = priority(Deploy{}, plat("cuda:100"));
  EXPECT_EQ(order.back(), "OOT");
  // Appended after every built-in: on an SM70 nothing built-in fits, so the plugin is chosen.
  Result r = run(Deploy{}, plat("cuda:70"));
  EXPECT_EQ(r.backend, "OOT");
  EXPECT_EQ(r.sel.path, "auto");
  clear_registered_fp8_moe_backends();
  register_fp8_moe_backend("oot", {&kOotExperts},
                           {.auto_select = true, .insert_before = Fp8MoeBackend::kTriton});
  order = priority(Deploy{}, plat("cuda:100"));
  EXPECT_EQ(std::find(order.begin(), order.end(), "OOT") + 1,
            std::find(order.begin(), order.end(), "TRITON"));
  r = run(Deploy{}, plat("cuda:100", "none"));
  EXPECT_EQ(r.backend, "OOT");
  // The reorder rules still run after insertion: on SM90 TRITON moves ahead of it.
  r = run(Deploy{}, plat("cuda:90", "none"));
  EXPECT_EQ(r.backend, "TRITON");
  (void)b;
}

TEST_F(Registration, Errors) {
  EXPECT_EQ(msg_of([] { register_fp8_moe_backend("triton", {&kOotExperts}); }),
            "ValueError: Cannot register FP8 MoE backend 'triton': the name is reserved by a "
            "built-in MoE backend.");
  EXPECT_EQ(msg_of([] { register_fp8_moe_backend("Batched-Triton", {&kOotExperts}); }),
            "ValueError: Cannot register FP8 MoE backend 'batched_triton': the name is reserved "
            "by a built-in MoE backend.");
  EXPECT_EQ(msg_of([] { register_fp8_moe_backend("", {&kOotExperts}); }),
            "ValueError: FP8 MoE backend name must not be empty.");
  EXPECT_NE(msg_of([] { register_fp8_moe_backend("empty", {}); }).find("At least one expert class"),
            std::string::npos);
  EXPECT_NE(msg_of([] {
              register_fp8_moe_backend("cpu_w8a8", {&kOotExperts});
            }).find("is a built-in Fp8MoeBackend"),
            std::string::npos);
  EXPECT_NE(msg_of([] {
              register_fp8_moe_backend(
                  "x1", {&kOotExperts},
                  {.auto_select = true, .insert_before = Fp8MoeBackend::kNone});
            }).find("insert_before"),
            std::string::npos);
}

}  // namespace
}  // namespace fp8moe
