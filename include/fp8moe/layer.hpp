// Fp8MoeLayer: the whole system from one object. It plans one FP8 MoE layer the way vLLM's
// Fp8MoEMethod does (block resolution, backend selection, quant config), prepares the weights in
// the format the chosen kernel reads (convert_to_fp8_moe_kernel_format), and runs
// forward(x, router_logits) -> out on the device where its weights live, on the caller's stream.
//
//   checkpoint layer / caller tensors
//        │  plan_fp8_moe_layer        resolve_fp8_moe_weight_block_shape (keep | refine | pad),
//        │                            select_fp8_moe_backend, make_fp8_moe_quant_config, MoeScheme,
//        │                            the fp8moe implementation and vLLM's per-M dispatch rule
//        │  load (checkpoints)        one rank's TP shard / EP experts (checkpoint.hpp)
//        │  prepare                   process_weights_after_loading +
//        convert_to_fp8_moe_kernel_format ▼                            (a layout tag on the result:
//        pitfall 27)
//   forward(x (M, H), router_logits (M, E)) -> out (M, H)
//
// Tensor conventions (every shape below is checked; nothing is converted silently):
//   x               (M, H)            bf16 or f32, contiguous, on the layer's device
//   router_logits   (M, E_global)     f32 or bf16, contiguous, on the layer's device
//   topk_ids        (M, topk)         i32 global expert ids (-1: padded slot)   [forward_routed]
//   topk_weights    (M, topk)         f32                                        [forward_routed]
//   out             (M, H)            same dtype as x, contiguous, on the layer's device
// Under TP each rank's out is its partial sum over its intermediate shard (the caller all-reduces,
// as vLLM does after the experts); under EP, out holds only the local experts' contributions.
//
// The weights (one rank's experts, vLLM's canonical layout, fused_moe.hpp):
//   w13        (E_local, 2*W, H)  float8_e4m3fn (e4m3fnuz on MI300)  rows [0, W) gate, [W, 2W) up
//   w2         (E_local, H, W)    same fp8 dtype
//   w13_scale  block:   (E_local, 2*ceil(W/bn), ceil(H/bk)) f32, [bn, bk] = the planned blocks
//              tensor:  (E_local, 2) f32 before preparation (gate, up), (E_local) after it
//              channel: (E_local, 2*W) f32
//   w2_scale   block: (E_local, ceil(H/bn), ceil(W/bk)) f32; tensor: (E_local); channel: (E_local,
//   H) w13_input_scale, w2_input_scale  (E_local) f32, static activation schemes only (the layer
//              reduces them to one (1) scale each, the max over experts, as vLLM does)
//   w13_bias (E_local, 2*W), w2_bias (E_local, H)  f32/bf16, optional
//   expert_map (E_global) i32 global -> local expert (-1: another EP rank's), EP only
// W is the per-rank intermediate size: I / TP, or the padded W = round_up(I / TP, bn) when the
// plan pads (ranks past the end of I hold zero rows with scale 1).
//
// Errors: bad shapes, dtypes and devices throw ValueError naming the tensor, its shape and the
// expectation; a plan that cannot run here throws NotImplementedError (with the plan's reason);
// checkpoint problems throw FormatError. The library never exits.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "fp8moe/backend.hpp"
#include "fp8moe/checkpoint.hpp"
#include "fp8moe/config.hpp"
#include "fp8moe/ep_moe.hpp"
#include "fp8moe/experts.hpp"
#include "fp8moe/fused_moe.hpp"
#include "fp8moe/oracle.hpp"
#include "fp8moe/oracle_env.hpp"
#include "fp8moe/platform.hpp"
#include "fp8moe/quant_config.hpp"
#include "fp8moe/tensor.hpp"

namespace fp8moe {

// =====================================================================================================
// Kernel weight formats (vLLM convert_to_fp8_moe_kernel_format, spec/oracle.md §1.7)
// =====================================================================================================

// The layout of prepared expert weights. Prepared weights carry it as a tag, and running them with
// a kernel that reads another layout is rejected (pitfall 27).
enum class WeightLayout : uint8_t {
  kCanonical,       // vLLM's canonical layout above: w13 rows [gate; up], row-major f32 scales
  kW31,             // FlashInfer: w13 rows [up; gate], block scales swapped too
  kW31BlockMajorK,  // FlashInfer TRT-LLM DeepSeek-FP8: w31 shuffled into BlockMajorK
  kDeepGemm,        // DeepGEMM: scales in DeepGEMM's TMA-aligned (packed UE8M0) layout
  kMarlin,          // Marlin's repacked fp8 weights and permuted scales
  kHumming,         // Humming's converted weights
  kAiterShuffled,   // AITER's shuffled weights (is_shuffled)
  kXpu,             // prepare_fp8_moe_layer_for_xpu
  kCpuPacked,       // prepare_fp8_moe_layer_for_cpu (vLLM's AMX packing)
};
std::string_view weight_layout_name(WeightLayout l);  // "canonical", "w31", ...

// What vLLM's convert_to_fp8_moe_kernel_format does for one backend, as data.
struct KernelFormatPlan {
  Fp8MoeBackend backend = Fp8MoeBackend::kNone;
  std::string vllm_function;            // "prepare_fp8_moe_layer_for_fi(..., is_trtllm=False)"
  std::vector<std::string> vllm_steps;  // what it does to the tensors, in order ("unchanged")
  WeightLayout vllm_layout = WeightLayout::kCanonical;  // the layout vLLM's kernel then reads
  // Value changes fp8moe reproduces whatever layout the running kernel reads:
  bool requantize_ue8m0 = false;    // DeepGEMM with E8M0: block weights requantised to UE8M0
                                    // (power-of-two) scales: dequantise, per_block_cast_to_fp8
  bool clamp_block_scales = false;  // FlashInfer block FP8: scales clamped to >= 1e-10
  // Whether fp8moe can produce vllm_layout itself (kCanonical and kW31 for block FP8).
  bool fp8moe_can_apply_layout = false;
};

// Inputs of the conversion that change what it does.
struct KernelFormatContext {
  WeightScaleKind weight = WeightScaleKind::kBlock;
  std::array<int64_t, 2> block{128, 128};  // the planned [bn, bk] (kBlock)
  bool gated = true;
  bool deep_gemm_e8m0 = false;  // vLLM is_deep_gemm_e8m0_used()
};

// The table of spec/oracle.md §1.7 for every backend. NONE (and anything unknown) raises
// ValueError("Unsupported FP8 MoE backend: NONE") as vLLM does. CPU_W8A8 (the seed's backend,
// absent from the snapshot's table) is treated as CPU: same kernel family, same packing.
KernelFormatPlan convert_to_fp8_moe_kernel_format(Fp8MoeBackend backend,
                                                  const KernelFormatContext& ctx);

// vLLM is_deep_gemm_e8m0_used(): VLLM_USE_DEEP_GEMM_E8M0 and DeepGEMM supported
// (VLLM_USE_DEEP_GEMM, deep_gemm installed, a DeepGEMM-capable device).
bool is_deep_gemm_e8m0_used(const Platform& platform, const OracleEnv& env);

// The layout an fp8moe implementation reads: kCanonical for every built-in one (the reference, the
// CPU kernels and the CUDA kernels all take fused_moe.hpp's canonical layout).
WeightLayout implementation_weight_layout(const ExpertsImpl& impl);

// One rank's expert weights as loaded (canonical layout, see the file comment).
struct Fp8MoeWeights {
  Tensor w13, w2;
  Tensor w13_scale, w2_scale;
  Tensor w13_bias, w2_bias;
  Tensor w13_input_scale, w2_input_scale;  // (E_local) f32, static activation schemes
  Tensor expert_map;                       // (E_global) i32, EP only
};

// Weights ready for a kernel, with the tag saying how they were prepared.
struct PreparedMoeWeights {
  WeightLayout layout = WeightLayout::kCanonical;
  Fp8MoeBackend prepared_for = Fp8MoeBackend::kNone;  // whose conversion was applied
  bool ue8m0_requantized = false;
  std::vector<std::string> applied;  // what fp8moe did to the loaded tensors, in order
  Tensor w13, w2, w13_scale, w2_scale;
  Tensor w13_bias, w2_bias;
  Tensor a13_scale, a2_scale;   // (1) f32, static per-tensor activation schemes
  Tensor expert_map;            // (E_global) i32, EP only
  ExpertWeights views() const;  // for FusedMoeArgs
};

// vLLM's process_weights_after_loading steps (spec/oracle.md §5.2), then the conversion:
//   1. e4m3fn -> e4m3fnuz on platforms whose fp8 is fnuz (codes reinterpreted, scales x2);
//   2. static input scales: the max over experts (one (1) scale per GEMM);
//   3. per-tensor weights: w13's gate/up halves requantised to the max of their two scales,
//      w13_scale (E_local, 2) -> (E_local);
//   4. `format`: the value changes (UE8M0 requantisation, scale clamp), then the layout change when
//      `layout` is format.vllm_layout (kCanonical keeps the canonical layout).
// Tensors that need no change keep the caller's storage. Throws NotImplementedError for a layout
// fp8moe cannot produce, ValueError for inconsistent tensors.
PreparedMoeWeights prepare_fp8_moe_weights(const Fp8MoeWeights& loaded,
                                           const KernelFormatPlan& format, WeightLayout layout,
                                           WeightScaleKind weight_kind,
                                           std::array<int64_t, 2> block, DType platform_fp8);

// Runs `impl` on prepared weights: args.weights is filled from `w`. Rejects (ValueError) weights
// whose layout tag is not the one `impl` reads, naming both.
void run_prepared_experts(const ExpertsImpl& impl, const PreparedMoeWeights& w, FusedMoeArgs args,
                          void* workspace);

// =====================================================================================================
// The plan
// =====================================================================================================

// Which implementation runs a call of M tokens, and why (vLLM's per-call FallbackExperts rules).
struct KernelChoice {
  const ExpertsImpl* impl = nullptr;  // fp8moe's implementation (nullptr: none here)
  std::string impl_name;              // "ref", "cpu_w8a16", "cuda_fused", ...
  std::string kernel_class;           // the vLLM class that runs: "TritonExperts", ...
  std::string why;                    // "M = 4 < 128 (DeepGEMM's M alignment): Triton fallback"
};

// How a layer's routing and expert MLP are described when it is built from caller tensors.
struct Fp8MoeLayerSpec {
  MoeConfig config;       // global shape, parallel layout, moe_backend, in_dtype (post_init()
                          // is applied by the layer); routing_method and activation as the model's
  CheckpointQuant quant;  // how the weights are quantised (parse_quantization_config, or
                          // fp8_block_checkpoint_quant below)
  RoutingConfig routing;  // topk must be config.experts_per_token, method config.routing_method;
                          // routing.e_score_correction_bias is ignored: give the tensor below
  Tensor e_score_correction_bias;             // (E_global) f32/bf16, for methods that use one
  bool apply_router_weight_on_input = false;  // Llama 4 (topk 1)
  std::string name = "caller tensors";
};

// The quantisation of a native fp8 block checkpoint ({"quant_method": "fp8", "activation_scheme":
// "dynamic", "weight_block_size": [bn, bk]}, with "scale_fmt": "ue8m0" when `ue8m0`).
CheckpointQuant fp8_block_checkpoint_quant(int64_t block_n = 128, int64_t block_k = 128,
                                           bool ue8m0 = false);

struct Fp8MoeLayerOptions {
  std::optional<Platform> platform;  // default: Platform::detect() (the layer runs on this machine)
  OracleEnv env{};                   // the vLLM variables the oracle reads (default: none set)
  // fp8moe's kernel override (not vLLM's --moe-backend): "" = the oracle's choice; "ref" = the
  // float64 reference; or an implementation name of the registry ("cpu_w8a16", "cuda_fused", ...).
  // With "ref" the plan, quant config and weight preparation stay the oracle's (the reference
  // computes the selected backend's scheme; with the oracle's choice NONE, the generic fp8_w8a8
  // branch of make_fp8_moe_quant_config). With an implementation name the quant config follows
  // that kernel's own backend (cpu_w8a16 on a W8A8 plan runs fp8_w8a16), and the oracle's
  // selection errors become plan notes: the override wins.
  std::string kernel;
  // Where the weights live and forward runs; unset: where the chosen implementation runs (cuda:0
  // for a CUDA kernel, the host otherwise).
  std::optional<Device> device;
  int64_t max_num_tokens = 1024;  // the owned workspace is sized for this; longer calls run in
                                  // chunks of this many tokens (never an allocation per call)
};

struct Fp8MoeLayerPlan {
  std::string source;            // "examples/qwen3-moe-tiny layer 0" / "caller tensors"
  std::string platform;          // Platform::describe()
  std::string checkpoint_quant;  // CheckpointQuant::describe()
  MoeConfig config;  // after block resolution (intermediate_size_per_partition, padding)
  int64_t hidden = 0, intermediate = 0, local_intermediate = 0;  // H, I, W
  int num_experts = 0, num_local_experts = 0, topk = 0;

  // 1. block resolution (Fp8MoEMethod.__init__, [N])
  std::string resolution = "none";  // "keep" | "refine" | "pad" | "none" (no block quantisation)
  std::string resolution_why;
  std::optional<std::array<int64_t, 2>> checkpoint_block;  // the checkpoint's [bn, bk]
  std::optional<std::array<int64_t, 2>> block;             // the blocks the weights are loaded in
  std::optional<std::array<int64_t, 2>> refine;            // scale upsampling factor
  bool padded = false;

  // 2. select_fp8_moe_backend
  OptQuantKey weight_key, activation_key;  // as passed to the oracle
  bool allow_vllm_cutlass = false;
  bool selected = false;  // select_fp8_moe_backend returned (NONE included)
  Selection selection;    // complete when selected; the progress so far when it raised

  // 3. quant config, the kernel scheme and the activation parameters
  Fp8MoeBackend quant_backend = Fp8MoeBackend::kNone;     // whose make_fp8_moe_quant_config branch
  std::optional<std::vector<int64_t>> quant_block_shape;  // the block_shape it was given
  std::string quant_config;                               // MoeQuantConfig::describe()
  std::string quant_config_name;                          // "fp8_w8a8", "fp8_w8a16", ...
  MoeScheme scheme;
  std::vector<std::string> scheme_notes;  // why UE8M0, why not the fused SiLU+quant path, ...
  ActivationConfig activation;

  // 4. convert_to_fp8_moe_kernel_format for quant_backend, and what fp8moe applies
  std::optional<KernelFormatPlan> kernel_format;
  WeightLayout layout = WeightLayout::kCanonical;  // the layout the implementation reads

  // 5. fp8moe's implementation
  std::string kernel_request;           // Fp8MoeLayerOptions::kernel ("" = the oracle's)
  std::string implementation;           // primary implementation name ("" when none)
  std::string fallback_implementation;  // FallbackExperts: the per-call fallback ("" when none)
  std::string kernel_class;             // the vLLM class (selection.kernel) or "fp8moe reference"
  std::string fallback_class;           // "TritonExperts" for the FallbackExperts
  bool runnable = false;                // an implementation runs this layer here
  std::string not_runnable_reason;
  Device device{};  // where the layer's weights live and forward runs

  // The first step that failed (the plan stops there).
  bool ok = false;
  std::string failed_step;  // "config" | "resolve" | "select" | "validate" | "quant_config" |
                            // "implementation"
  std::string error_kind, error_message;
  std::vector<std::string> notes;

  // vLLM's per-call choice for M tokens (host-known M, no device synchronisation): the DEEPGEMM
  // backend's TritonOrDeepGemmExperts runs DeepGEMM when E8M0 is used or _valid_deep_gemm holds
  // (M >= 128, N % 128 == 0, K % 128 == 0, N > 512, e4m3fn weights; N = W, K = H), else Triton;
  // VLLM_CUTLASS's TritonOrCutlassExperts runs Triton for M <= 8 on SM100+, else CUTLASS. With a
  // --kernel override the override runs every M (the vLLM class is still reported).
  KernelChoice dispatch(int64_t num_tokens) const;
  // Set by plan_fp8_moe_layer; used by dispatch().
  bool deep_gemm_e8m0 = false;
  bool deep_gemm_installed = false;
  bool batch_invariant = false;  // VLLM_BATCH_INVARIANT: passed to every call (FusedMoeArgs)
  bool sm100_or_newer = false;
};

// Plans a layer (no weights needed): the steps above in vLLM's order. Decision failures (no
// backend, misaligned blocks, an unknown --kernel) are recorded in the plan, not thrown.
Fp8MoeLayerPlan plan_fp8_moe_layer(const Fp8MoeLayerSpec& spec, const Fp8MoeLayerOptions& options);

// A plan as JSON (the CLI's --json) and as indented text lines (the CLI's human output).
nlohmann::ordered_json layer_plan_to_json(const Fp8MoeLayerPlan& plan);
std::vector<std::string> layer_plan_to_text(const Fp8MoeLayerPlan& plan);

// =====================================================================================================
// Checkpoint layers
// =====================================================================================================

// Which layer and rank of a checkpoint to build.
struct CheckpointLayerRequest {
  int layer = -1;          // decoder layer; -1: the first MoE layer
  int tp_size = 1;         // vLLM --tensor-parallel-size
  int rank = 0;            // this rank (TP rank; EP rank with enable_ep)
  bool enable_ep = false;  // vLLM --enable-expert-parallel: the tp_size ranks become EP ranks
  std::string moe_backend = "auto";  // vLLM --moe-backend
  std::optional<DType> act_dtype;    // default: the model's torch_dtype
};

// The layer spec of a checkpoint's MoE layer (config.json only; no weight byte is read).
Fp8MoeLayerSpec checkpoint_layer_spec(const ModelConfig& model, const CheckpointLayerRequest& req);

// =====================================================================================================
// The layer
// =====================================================================================================

class Fp8MoeLayer {
 public:
  // One rank of a checkpoint's MoE layer: plan, load the rank's shard (refined or padded as the
  // plan says), e_score_correction_bias when the routing uses one, prepare. Throws the plan's error
  // (NotImplementedError / ValueError) when it cannot run here.
  static Fp8MoeLayer from_checkpoint(const std::string& model_dir,
                                     const CheckpointLayerRequest& request,
                                     const Fp8MoeLayerOptions& options = {});
  // From one rank's tensors (canonical layout, host or the options' device). The tensors must have
  // the planned shapes (refined scales, padded W); ValueError naming the tensor otherwise.
  static Fp8MoeLayer from_tensors(const Fp8MoeLayerSpec& spec, const Fp8MoeWeights& weights,
                                  const Fp8MoeLayerOptions& options = {});

  Fp8MoeLayer(Fp8MoeLayer&&) noexcept;
  Fp8MoeLayer& operator=(Fp8MoeLayer&&) noexcept;
  Fp8MoeLayer(const Fp8MoeLayer&) = delete;
  Fp8MoeLayer& operator=(const Fp8MoeLayer&) = delete;
  ~Fp8MoeLayer();

  const Fp8MoeLayerPlan& plan() const;
  const MoeQuantConfig& quant_config() const;  // with the loaded scale tensors
  const PreparedMoeWeights& weights() const;
  const RoutingConfig& routing() const;  // its e_score_correction_bias points at the layer's copy
  bool apply_router_weight_on_input() const;
  Device device() const;
  int64_t hidden_size() const;         // H
  int num_experts() const;             // E_global (router_logits columns)
  int num_local_experts() const;       // E_local
  int64_t local_intermediate() const;  // W
  int64_t max_num_tokens() const;      // the owned workspace's chunk size

  // Which implementation a call of num_tokens tokens runs (plan().dispatch with the layer's
  // implementations); never synchronises a device.
  KernelChoice kernel_for(int64_t num_tokens) const;
  // Bytes of workspace a call of num_tokens tokens needs when the caller passes one (on device()).
  std::size_t workspace_size(int64_t num_tokens) const;
  // How the implementation kernel_for(M) would compute forward(x, router_logits, out) (the first
  // chunk of max_num_tokens() tokens when M is larger): its describe_call line ("grouped path
  // (auto: ...)", "avx512 kernels, 16 OpenMP threads"); "" when it has none or M = 0. Runs nothing.
  std::string describe_call(const TensorView& x, const TensorView& router_logits,
                            const TensorView& out) const;
  // Bytes of the workspace the layer owns (sized at construction for max_num_tokens).
  std::size_t owned_workspace_bytes() const;

  // out = the layer on x, routed by router_logits (shapes in the file comment). `stream` is a
  // cudaStream_t for CUDA layers (ignored on the CPU). `workspace` (optional, on device()) must
  // hold workspace_size(M) bytes; without it the layer's own workspace is used, in chunks of
  // max_num_tokens() tokens. Not thread-safe on the owned workspace: one call at a time per layer
  // unless each caller passes its own workspace.
  void forward(const TensorView& x, const TensorView& router_logits, const TensorView& out,
               void* stream = nullptr, void* workspace = nullptr,
               std::size_t workspace_bytes = 0) const;
  // Allocates out (M, H) like x.
  Tensor forward(const TensorView& x, const TensorView& router_logits,
                 void* stream = nullptr) const;
  // With routing done by the caller: topk_ids (M, topk) i32 global ids, topk_weights (M, topk)
  // f32 (the layer's routing config is not used).
  void forward_routed(const TensorView& x, const TensorView& topk_ids,
                      const TensorView& topk_weights, const TensorView& out, void* stream = nullptr,
                      void* workspace = nullptr, std::size_t workspace_bytes = 0) const;

  // The FusedMoeArgs a call would run with (weights, scheme, routing, activation filled in;
  // x / router_logits / out as given). For the reference check and for tools.
  FusedMoeArgs make_args(const TensorView& x, const TensorView& router_logits,
                         const TensorView& out, void* stream = nullptr) const;

 private:
  struct State;
  explicit Fp8MoeLayer(std::unique_ptr<State> s);
  static Fp8MoeLayer build(const Fp8MoeLayerSpec& spec, Fp8MoeLayerPlan plan,
                           const Fp8MoeWeights& weights, const Fp8MoeLayerOptions& options);
  void init_workspace();
  void run_chunks(const TensorView& x, const TensorView& logits, const TensorView& ids,
                  const TensorView& topk_weights, const TensorView& out, void* stream,
                  void* workspace, std::size_t workspace_bytes) const;
  std::unique_ptr<State> s_;
};

// =====================================================================================================
// Expert parallelism (fp8moe run --ep, bench --ep)
// =====================================================================================================

struct EpForwardOptions {
  // The experts' activation format; default: the oracle's (Selection::activation_format, i.e.
  // MoeParallelConfig::use_batched_activation_format()). An override is fp8moe's, for testing the
  // batched path with a kernel that takes it (the reference).
  std::optional<EpExpertsFormat> format;
};

// One EP rank's forward of a layer built for that rank (CheckpointLayerRequest{tp_size = ep size,
// rank, enable_ep}, or a 1-rank layer with a 1-rank communicator): its tokens x (M_r, H) routed by
// router_logits (M_r, E) are dispatched to the ranks owning their experts (vLLM's linear
// placement, checked against the layer's expert_map), computed there with the kernel the plan
// dispatches for the *global* M (the sum of every rank's M_r, what vLLM's per-call choice sees),
// combined back into out (M_r, H) in token order. x, router_logits and out are host tensors (see
// ep_moe_forward). Every rank must call it; a rank whose layer or tensors do not fit the group
// makes every rank throw (ValueError), none hangs.
EpMoeStats forward_expert_parallel(const Fp8MoeLayer& layer, Communicator& comm,
                                   const TensorView& x, const TensorView& router_logits,
                                   const TensorView& out, const EpForwardOptions& options = {});

// =====================================================================================================
// Checking a forward (fp8moe run --check)
// =====================================================================================================

// Output differences with the metrics vLLM's tests use.
struct OutputComparison {
  int64_t count = 0;
  int64_t bitwise_mismatches = 0;  // elements whose bits differ
  bool bitwise_equal = false;
  double max_abs_err = 0, max_rel_err = 0;  // rel over |expected| > 0
  // torch.testing.assert_close(actual, expected, atol, rtol): |a - e| <= atol + rtol * |e|.
  double atol = 0.035, rtol = 0.035;  // vLLM's block-FP8 tolerance (test_block_fp8.py)
  int64_t over_tolerance = 0;
  bool allclose = false;
  // vLLM's per-tensor / per-channel FP8 metric: mean|a - e| / mean|e| (< 0.05 passes there).
  double mean_rel_abs_err = 0;
  int64_t nan_mismatches = 0;  // NaN in one where the other has a number
};
// Host tensors of the same shape and floating dtype (bf16/f32/f64).
OutputComparison compare_outputs(const TensorView& actual, const TensorView& expected,
                                 double atol = 0.035, double rtol = 0.035);

struct ForwardCheck {
  OutputComparison vs_reference;     // ref::fused_moe on the same prepared weights and inputs
  OutputComparison vs_unquantized;   // ref::fused_moe_unquantized (real-valued layer)
  bool reference_is_kernel = false;  // the implementation that ran is the reference itself
  // "original real-valued weights" or "the dequantised checkpoint weights (...)"
  std::string unquantized_weights;
  Tensor reference_out, unquantized_out;  // host tensors (M, H) like out
};

// Checks `out` (the layer's output for x / router_logits, host or device) against the float64
// reference on the same quantised weights, and against the unquantised layer: on `real_w13` /
// `real_w2` when given ((E_local, 2W, H) / (E_local, H, W) f32/bf16, the real-valued weights the
// fp8 ones were quantised from), else on the dequantised prepared weights. Host-side; copies device
// tensors to the host.
ForwardCheck check_forward(const Fp8MoeLayer& layer, const TensorView& x,
                           const TensorView& router_logits, const TensorView& out,
                           const TensorView& real_w13 = {}, const TensorView& real_w2 = {});

}  // namespace fp8moe
