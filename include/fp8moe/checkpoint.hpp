// Checkpoints: the safetensors reader and writer, a model's config.json (MoE shape, routing, the
// quantisation scheme and the quant keys vLLM derives from it), the expert tensor names of each
// model family, and TP/EP sharding of block-quantised expert weights exactly as the oracle decided
// (keep, refine = scale upsampling, pad = padded-stride layout).
//
// Everything here reads files but never the machine's state. The planner (plan_model, at the end)
// works from config.json and the safetensors headers alone, without touching a weight byte, and
// asks the oracle (oracle.hpp) what vLLM would decide.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "fp8moe/config.hpp"
#include "fp8moe/dtype.hpp"
#include "fp8moe/fused_moe.hpp"
#include "fp8moe/oracle.hpp"
#include "fp8moe/oracle_env.hpp"
#include "fp8moe/platform.hpp"
#include "fp8moe/quant_key.hpp"
#include "fp8moe/roofline.hpp"
#include "fp8moe/tensor.hpp"

namespace fp8moe {

// =====================================================================================================
// safetensors
// =====================================================================================================
//
// Format: an 8-byte little-endian header length N, N bytes of UTF-8 JSON (an object mapping tensor
// names to {"dtype", "shape", "data_offsets": [begin, end)} plus an optional "__metadata__" string
// map), then the data region. Offsets are relative to the data region, which the tensors must cover
// exactly (no overlaps, no holes, no trailing bytes), as the reference implementation requires.

// The largest header fp8moe accepts (the reference implementation's limit).
inline constexpr uint64_t kSafetensorsMaxHeaderBytes = 100'000'000;

// Element size in bits of a safetensors dtype name ("F8_E4M3" -> 8, "F4" -> 4), or 0 if unknown.
int safetensors_dtype_bits(std::string_view name);
// The fp8moe dtype of a safetensors dtype name; nullopt for names fp8moe does not compute with
// (U16, U32, U64, I16, C64, F4, F6_*). F8_E4M3 is e4m3fn; F8_E8M0 is e8m0fnu.
std::optional<DType> safetensors_to_dtype(std::string_view name);
// The safetensors dtype name of an fp8moe dtype ("F8_E4M3"). Throws ValueError for dtypes the
// format has no name for (float8_e4m3fnuz).
std::string_view dtype_to_safetensors(DType t);

struct SafetensorsTensor {
  std::string name;
  std::string dtype_name;       // as written in the header: "F8_E4M3", "BF16", ...
  std::optional<DType> dtype;   // nullopt: a valid safetensors dtype fp8moe does not compute with
  std::vector<int64_t> shape;   // may be empty (a scalar)
  uint64_t begin = 0, end = 0;  // data_offsets, relative to the data region
  uint64_t nbytes() const { return end - begin; }
  int64_t numel() const;
  std::string shape_str() const;  // "[128, 2048]"
};

// One .safetensors file. open() reads and validates the header only; tensor bytes are memory-mapped
// read-only on first access. Copies share the mapping. Every validation failure throws FormatError
// naming the file, the tensor and what was expected.
class SafetensorsFile {
 public:
  SafetensorsFile() = default;
  static SafetensorsFile open(const std::string& path);
  // Validates a complete in-memory file (tests, fuzzing). The bytes are copied.
  static SafetensorsFile parse(std::span<const uint8_t> bytes, const std::string& name);

  const std::string& path() const;
  uint64_t file_size() const;
  uint64_t header_size() const;  // N
  uint64_t data_offset() const { return 8 + header_size(); }
  const std::vector<SafetensorsTensor>& tensors() const;  // in header order
  const std::map<std::string, std::string>& metadata() const;
  const SafetensorsTensor* find(std::string_view name) const;
  const SafetensorsTensor& at(std::string_view name) const;  // throws FormatError naming the file
  // The tensor's bytes (maps the file on first use).
  std::span<const uint8_t> data(const SafetensorsTensor& t) const;
  std::span<const uint8_t> data(std::string_view name) const { return data(at(name)); }
  // Whether any tensor byte was mapped (plan checks it stays false).
  bool data_mapped() const;

 private:
  struct Impl;
  std::shared_ptr<Impl> impl_;
};

// Builds a safetensors file in memory and writes it (to a temporary name, then renamed). Tensors
// are written in insertion order; the header is padded with spaces to a multiple of 8 bytes, as the
// reference writer does.
class SafetensorsWriter {
 public:
  // Copies `bytes`, which must hold exactly numel(shape) x dtype size bytes (ValueError otherwise).
  void add(const std::string& name, DType dtype, std::span<const int64_t> shape,
           std::span<const uint8_t> bytes);
  void add(const std::string& name, DType dtype, std::initializer_list<int64_t> shape,
           std::span<const uint8_t> bytes) {
    std::vector<int64_t> s(shape);
    add(name, dtype, s, bytes);
  }
  // A tensor from a contiguous host TensorView.
  void add(const std::string& name, const TensorView& t);
  void set_metadata(const std::string& key, const std::string& value);
  std::size_t num_tensors() const { return entries_.size(); }
  uint64_t data_bytes() const;
  std::vector<uint8_t> serialize() const;
  void write(const std::string& path) const;

 private:
  struct Entry {
    std::string name;
    std::string dtype_name;
    std::vector<int64_t> shape;
    std::vector<uint8_t> bytes;
  };
  std::vector<Entry> entries_;
  std::map<std::string, std::string> metadata_;
};

// model.safetensors.index.json parsed and validated without touching the file system: the
// (tensor, shard file) pairs of "weight_map" in file order. FormatError (naming `index_path`) for
// invalid JSON, a missing/empty/non-object weight_map, a non-string entry, or a shard name that is
// not a relative file name inside the model folder ("/abs", "../x", "a//b", ""), and a
// "metadata" that is not an object or whose total_size is not a number.
std::vector<std::pair<std::string, std::string>> parse_safetensors_index(
    std::string_view text, const std::string& index_path);

// A model's weights: one model.safetensors, or shards listed by model.safetensors.index.json
// ({"metadata": {...}, "weight_map": {tensor: shard file}}). open() validates every shard header,
// that every shard the index names exists and holds the tensors the index assigns to it, and that
// no tensor appears in two shards. Only headers are read.
class SafetensorsCheckpoint {
 public:
  SafetensorsCheckpoint() = default;
  // `path` is a model directory or a single .safetensors file.
  static SafetensorsCheckpoint open(const std::string& path);

  const std::string& root() const { return root_; }
  bool sharded() const { return sharded_; }
  const std::vector<SafetensorsFile>& shards() const { return shards_; }
  std::size_t num_tensors() const { return where_.size(); }
  const SafetensorsTensor* find(std::string_view name) const;
  const SafetensorsTensor& at(std::string_view name) const;  // FormatError naming the tensor
  const SafetensorsFile& shard_of(std::string_view name) const;
  std::span<const uint8_t> data(std::string_view name) const;
  uint64_t total_data_bytes() const;
  bool any_data_mapped() const;
  std::vector<std::string> tensor_names() const;  // sorted

 private:
  std::string root_;
  bool sharded_ = false;
  std::vector<SafetensorsFile> shards_;
  std::map<std::string, std::pair<std::size_t, std::size_t>, std::less<>> where_;  // shard, index
};

// Writes `tensors` as shards of at most `max_shard_bytes` data bytes each, named
// "model-0000i-of-0000n.safetensors", plus model.safetensors.index.json (one file named
// model.safetensors and no index when everything fits in one shard and `force_index` is false).
struct ShardedTensor {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;
};
void write_sharded_checkpoint(const std::string& dir, const std::vector<ShardedTensor>& tensors,
                              uint64_t max_shard_bytes, bool force_index = true);

// =====================================================================================================
// config.json
// =====================================================================================================

enum class ModelFamily : uint8_t {
  kDeepseekV3,  // deepseek_v3 (also DeepSeek-R1 / V3.1 / V3.2)
  kKimiK2,      // kimi_k2 (DeepseekV3ForCausalLM architecture)
  kQwen2Moe,    // qwen2_moe
  kQwen3Moe,    // qwen3_moe
  kQwen3Next,   // qwen3_next
  kMiniMaxM2,   // minimax_m2
  kGlm4Moe,     // glm4_moe
  kMixtral,     // mixtral
  kLlama4,      // llama4 (text_config nested)
  kGptOss,      // gpt_oss
};
std::string_view model_family_name(ModelFamily f);  // the HF model_type, "deepseek_v3"

// Which vLLM quantisation config class reads the checkpoint's quantization_config.
enum class QuantMethod : uint8_t {
  kNone,               // no quantization_config: bf16 experts
  kFp8,                // "fp8" (Fp8Config, native block/per-tensor FP8)
  kCompressedTensors,  // "compressed-tensors"
  kModelOpt,           // "modelopt" (FP8 or MXFP8)
  kFbgemmFp8,          // "fbgemm_fp8"
  kMxfp4,              // "mxfp4" (gpt-oss)
  kOther,              // anything else: reported, not planned
};
std::string_view quant_method_name(QuantMethod m);

// How the expert weight scales are stored in the checkpoint.
enum class CheckpointScaleKind : uint8_t {
  kNone,        // unquantised
  kBlock,       // [ceil(N/bn), ceil(K/bk)] per projection
  kPerTensor,   // one scalar per projection
  kPerChannel,  // [N] or [N, 1] per projection
  kMx,          // [N, K/32] e8m0 per projection
};
std::string_view checkpoint_scale_kind_name(CheckpointScaleKind k);

// The checkpoint's quantisation and what vLLM's MoE method makes of it (spec/oracle.md §5.1): the
// keys passed to select_fp8_moe_backend, allow_vllm_cutlass, and the block_shape passed to
// make_fp8_moe_quant_config. For native fp8 block checkpoints the keys here are the checkpoint's
// (before TP block resolution); the plan replaces the weight key with the resolved block shape.
struct CheckpointQuant {
  QuantMethod method = QuantMethod::kNone;
  std::string method_name;         // raw quant_method ("fp8", "compressed-tensors", ...)
  std::string moe_method;          // vLLM MoE method class ("Fp8MoEMethod", ...), "" if none
  bool moe_fp8 = false;            // the experts go through the FP8 MoE oracle (oracle/fp8.py)
  bool uses_mxfp8_oracle = false;  // the experts go through oracle/mxfp8.py instead
  std::string not_fp8_reason;      // why moe_fp8 is false
  bool is_checkpoint_fp8_serialized = false;
  std::string activation_scheme;  // "static" | "dynamic" ("" when not applicable)
  std::optional<std::array<int64_t, 2>> weight_block_size;  // checkpoint [block_n, block_k]
  // Fp8MoEMethod resolves TP-misaligned blocks (refine/pad); compressed-tensors only validates.
  bool block_resolvable = false;
  bool scale_fmt_ue8m0 = false;  // "scale_fmt": "ue8m0" (power-of-two scales, DeepSeek V3.1+)
  std::string fmt;               // "fmt" as written ("e4m3", "float8_e4m3fn"), informational
  std::vector<std::string> ignored_layers;  // ignored_layers / modules_to_not_convert / ignore
  // compressed-tensors details ("" when not compressed-tensors)
  std::string ct_weight_strategy;  // "tensor" | "channel" | "block"
  std::string ct_input_strategy;   // "tensor" | "token" | "group" | ""
  bool ct_input_dynamic = false;
  std::string modelopt_algo;  // "FP8" | "MXFP8"

  OptQuantKey weight_key;  // as passed to select_fp8_moe_backend
  OptQuantKey activation_key;
  bool allow_vllm_cutlass = false;
  std::optional<std::vector<int64_t>> block_shape;  // for make_fp8_moe_quant_config
  bool per_act_token_quant = false;
  bool per_out_ch_quant = false;

  CheckpointScaleKind scale_kind = CheckpointScaleKind::kNone;
  std::string weight_scale_suffix;   // "weight_scale_inv" | "weight_scale" | ""
  bool static_input_scales = false;  // "input_scale" tensors are present and used
  DType scale_dtype = DType::kF32;   // e8m0 (u8) for MX

  std::string describe() const;  // "fp8 block [128, 128], dynamic activations, ue8m0 scales"
};

// Parses a quantization_config object (JSON text) as vLLM's config classes do, with their error
// messages (ValueError) for invalid configs.
CheckpointQuant parse_quantization_config(std::string_view json_text);

// The neutral description of a model's MoE layers, from config.json.
struct ModelConfig {
  std::string source;  // the file it was read from
  std::string model_type;
  std::vector<std::string> architectures;
  ModelFamily family = ModelFamily::kQwen3Moe;
  int64_t hidden_size = 0;
  int64_t moe_intermediate_size = 0;  // per routed expert, un-sharded
  int num_experts = 0;                // routed experts
  int num_experts_per_tok = 0;
  int num_hidden_layers = 0;
  std::vector<int> moe_layers;       // decoder layers with routed experts, ascending
  int num_nextn_predict_layers = 0;  // MTP layers (not planned)
  int num_shared_experts = 0;
  int64_t shared_expert_intermediate_size = 0;
  // routing
  std::string scoring_func = "softmax";
  bool renormalize = true;
  int num_expert_group = 0;
  int topk_group = 0;
  double routed_scaling_factor = 1.0;
  bool has_e_score_bias = false;
  bool apply_router_weight_on_input = false;
  RoutingMethodType routing_method = RoutingMethodType::kRenormalize;
  // activation
  std::string hidden_act = "silu";
  MoeActivation activation = MoeActivation::kSilu;
  std::optional<double> swiglu_limit;
  bool has_bias = false;
  DType dtype = DType::kBF16;  // torch_dtype
  CheckpointQuant quant;

  // The layer config the oracle decides on, for a parallel layout (post_init() applied).
  MoeConfig moe_config(const MoeParallelConfig& parallel, const std::string& moe_backend = "auto",
                       DType in_dtype = DType::kBF16) const;
  std::string describe() const;  // one line: family, shape, routing
};

ModelConfig parse_model_config(std::string_view json_text,
                               const std::string& source = "config.json");
// `path` is a config.json file or a directory holding one.
ModelConfig load_model_config(const std::string& path);

// =====================================================================================================
// Expert tensor names
// =====================================================================================================

enum class ExpertProj : uint8_t { kGate, kUp, kDown };
std::string_view expert_proj_name(ExpertProj p);  // "gate" | "up" | "down"

// How a family stores its routed experts.
enum class ExpertLayout : uint8_t {
  kPerExpert,    // one tensor per expert and projection (DeepSeek, Qwen, GLM, MiniMax, Mixtral)
  kFusedLlama4,  // feed_forward.experts.gate_up_proj [E, H, 2I] / down_proj [E, I, H] (bf16)
  kFusedGptOss,  // mlp.experts.gate_up_proj_blocks ... (MXFP4)
};

struct ExpertNaming {
  ExpertLayout layout = ExpertLayout::kPerExpert;
  std::string layer_prefix;  // "model.layers.{L}." ({L} replaced)
  std::string experts;       // "mlp.experts" | "block_sparse_moe.experts" | "feed_forward.experts"
  std::array<std::string, 3> proj;  // gate, up, down: "gate_proj" / "w1", ...
};
ExpertNaming expert_naming(const ModelConfig& model);
// "model.layers.3.mlp.experts.7.gate_proj" (no ".weight" suffix).
std::string expert_module_name(const ModelConfig& model, int layer, int expert, ExpertProj proj);
std::string expert_weight_name(const ModelConfig& model, int layer, int expert, ExpertProj proj);
// The weight scale name for the model's scheme ("...weight_scale_inv" / "...weight_scale"), "" if
// the scheme has no weight scales.
std::string expert_scale_name(const ModelConfig& model, int layer, int expert, ExpertProj proj);
std::string expert_input_scale_name(const ModelConfig& model, int layer, int expert,
                                    ExpertProj proj);

// =====================================================================================================
// TP sharding of block-quantised experts (spec/oracle.md §5.3)
// =====================================================================================================

enum class TpShardMode : uint8_t {
  kKeep,    // checkpoint blocks fit the TP shard: narrow rows/columns and scale blocks
  kRefine,  // upsample the full checkpoint scales to [b, b] blocks, then narrow
  kPad,     // padded-stride layout: each rank owns W = round_up(I/T, bn) rows; weight 0, scale 1
};
std::string_view tp_shard_mode_name(TpShardMode m);  // "keep" | "refine" | "pad"

// One rank's share of an expert's intermediate dimension, as decided by
// resolve_fp8_moe_weight_block_shape (moe_block_shape, weight_scale_refine, tp_shard_with_padding).
struct TpShard {
  TpShardMode mode = TpShardMode::kKeep;
  int tp_size = 1;
  int tp_rank = 0;
  int64_t intermediate_size = 0;  // global I
  int64_t hidden_size = 0;        // H
  int64_t local_size = 0;         // per-rank allocation: I/T, or W (padded) for kPad
  std::array<int64_t, 2> checkpoint_block{128, 128};  // [bn, bk] of the checkpoint scales
  std::array<int64_t, 2> block{128, 128};             // [bn, bk] of the loaded scales
  std::array<int64_t, 2> refine{1, 1};                // (r0, r1): checkpoint block / loaded block

  // First global row (w13) / column (w2) this rank owns, and how many of its local_size are real.
  int64_t global_begin() const { return static_cast<int64_t>(tp_rank) * local_size; }
  int64_t valid_size() const;
  // Loaded scale grids of one expert: w13 (2*ceil(local/bn), ceil(H/bk)), w2 (ceil(H/bn),
  // ceil(local/bk)). `shards` = 2 for gated activations.
  std::array<int64_t, 2> w13_scale_shape(int shards = 2) const;
  std::array<int64_t, 2> w2_scale_shape() const;
  std::string describe() const;
};

// Builds a rank's shard. `moe_block_shape` and `refine` are resolve_fp8_moe_weight_block_shape's
// results; `padded` is MoeConfig::tp_shard_with_padding and `local_size` its
// intermediate_size_per_partition. Throws ValueError for inconsistent decisions.
TpShard make_tp_shard(int64_t intermediate_size, int64_t hidden_size, int tp_size, int tp_rank,
                      std::array<int64_t, 2> checkpoint_block,
                      std::array<int64_t, 2> moe_block_shape,
                      std::optional<std::array<int64_t, 2>> refine, bool padded,
                      int64_t local_size);

// Why resolve_fp8_moe_weight_block_shape kept, refined or padded a checkpoint's blocks: the text
// plan_checkpoint and the layer's plan both show. `ispp` is the per-rank intermediate before the
// resolution, `resolved` the MoeConfig after it (padding changes its per-partition size).
struct BlockResolutionText {
  std::string resolution;  // "keep" | "refine" | "pad"
  std::string why;
  std::vector<std::string> notes;
};
BlockResolutionText explain_block_resolution(const BlockShapeResolution& res,
                                             std::array<int64_t, 2> checkpoint_block, int64_t ispp,
                                             const MoeConfig& resolved);
// Block checkpoints of other methods (compressed-tensors, ...) are kept as they are.
BlockResolutionText explain_unresolved_blocks(std::string_view method_name);

// vLLM's validate_fp8_block_shape_moe (Fp8MoEMethod.create_weights when no refine factor): throws
// ValueError when the per-rank intermediate size does not fit whole checkpoint blocks.
void validate_fp8_block_shape_moe(int64_t intermediate_size_per_partition,
                                  std::array<int64_t, 2> block_size, int tp_size);

// Loads one projection of one expert into a rank's buffers. Sources are the full, un-sharded
// checkpoint tensors; destinations are the expert's slice of the stacked layer tensors.
//   gate/up: src (I, H) fp8, src_scale (ceil(I/bn), ceil(H/bk)) f32
//            -> dst w13 (shards*local, H) rows [half*local, (half+1)*local),
//               dst_scale w13_scale_shape() rows of that half
//   down:    src (H, I) fp8, src_scale (ceil(H/bn), ceil(I/bk)) f32
//            -> dst w2 (H, local), dst_scale w2_scale_shape()
// kPad pre-fills the rank's destination with weight 0 and scale 1 before copying. A source of the
// wrong shape throws FormatError naming `what`; a pre-sharded source under kPad throws ValueError
// ("... expects an unsharded checkpoint projection ...").
void load_w13_block_shard(const TpShard& shard, int half, const TensorView& src,
                          const TensorView& src_scale, const TensorView& dst,
                          const TensorView& dst_scale, const std::string& what);
void load_w2_block_shard(const TpShard& shard, const TensorView& src, const TensorView& src_scale,
                         const TensorView& dst, const TensorView& dst_scale,
                         const std::string& what);

// repeat_interleave(r0, dim=-2).repeat_interleave(r1, dim=-1) of a 2-D f32 scale grid.
Tensor upsample_block_scales(const TensorView& scale, int64_t r0, int64_t r1);

// A plain TP split (per-tensor, per-channel and MX schemes): I/T rows per rank; throws ValueError
// when T does not divide I.
TpShard make_plain_tp_shard(int64_t intermediate_size, int64_t hidden_size, int tp_size,
                            int tp_rank);

// =====================================================================================================
// EP placement (vLLM determine_expert_map)
// =====================================================================================================

enum class ExpertPlacementStrategy : uint8_t { kLinear, kRoundRobin };

struct ExpertPlacement {
  int num_experts = 0;
  int ep_size = 1;
  int ep_rank = 0;
  std::vector<int> local_to_global;  // the rank's experts, in local order
  std::vector<int32_t> expert_map;   // (E) global -> local index, -1 for remote experts
  int num_local() const { return static_cast<int>(local_to_global.size()); }
};
// Linear: contiguous ranges; the first E % ep ranks get one extra expert (E=128, EP=6 ->
// 22,22,21,21,21,21). Round robin: expert e lives on rank e % ep. With more ranks than experts the
// extra ranks hold none. Throws ValueError for E < 1 or a rank outside the group.
ExpertPlacement place_experts(int num_experts, int ep_size, int ep_rank,
                              ExpertPlacementStrategy strategy = ExpertPlacementStrategy::kLinear);

// =====================================================================================================
// The example checkpoint (fp8moe make-example)
// =====================================================================================================

// A small model in the real formats, shaped like a Qwen3-MoE FP8 release: config.json (qwen3_moe,
// native fp8 block quantisation, dynamic activations), sharded safetensors and the index.
struct ExampleCheckpointSpec {
  int64_t hidden = 256;
  int64_t intermediate = 640;  // 640 = 5 blocks: TP4 refines to 32, TP8 has to pad (or use EP)
  int64_t experts = 8;
  int topk = 2;
  int layers = 2;
  int64_t block = 128;
  int64_t vocab = 512;
  int64_t heads = 4;
  int64_t kv_heads = 2;
  int64_t head_dim = 64;
  bool ue8m0 = false;  // power-of-two scales and "scale_fmt": "ue8m0"
  uint64_t seed = 0;
};
// Writes the example into `dir` (created if missing). Returns the files written. Deterministic:
// the same spec gives the same bytes.
std::vector<std::string> write_example_checkpoint(const std::string& dir,
                                                  const ExampleCheckpointSpec& spec = {});

// =====================================================================================================
// Loading one MoE layer for one rank
// =====================================================================================================

// Whether vLLM leaves this layer's experts unquantised because the quantisation config's ignore
// list names them (is_layer_skipped on the experts' module prefix).
bool moe_layer_ignored(const ModelConfig& model, int layer);

// One rank's experts of one MoE layer, stacked in vLLM's canonical layout (fused_moe.hpp):
//   w13        (E_local, 2*W, H) float8_e4m3fn   rows [0, W) gate, [W, 2W) up
//   w2         (E_local, H, W)   float8_e4m3fn
//   w13_scale  block:   (E_local, 2*ceil(W/bn), ceil(H/bk)) f32    (bn, bk: the loaded blocks)
//              tensor:  (E_local, 2) f32 (gate, up: one per shard, before vLLM's max-requant)
//              channel: (E_local, 2*W) f32
//              mx:      (E_local, 2*W, H/32) e8m0
//   w2_scale   block: (E_local, ceil(H/bn), ceil(W/bk)); tensor: (E_local); channel: (E_local, H);
//              mx: (E_local, H, W/32)
//   w13_input_scale, w2_input_scale  (E_local) f32, static activation schemes only
//   expert_map (E) i32: global -> local, -1 for experts on other EP ranks
// W is the per-rank intermediate size (padded under kPad).
struct LoadedMoeLayer {
  int layer = 0;
  CheckpointScaleKind scale_kind = CheckpointScaleKind::kBlock;
  TpShard tp;
  ExpertPlacement ep;
  Tensor w13, w2, w13_scale, w2_scale;
  Tensor w13_input_scale, w2_input_scale;
  Tensor expert_map;
  std::size_t tensors_read = 0;        // checkpoint tensors copied from
  uint64_t checkpoint_bytes_read = 0;  // their bytes
  ExpertWeights weights() const;       // views for FusedMoeArgs
};

// Loads `layer` for the rank described by `tp` (make_tp_shard / make_plain_tp_shard) and `ep`
// (place_experts). Every local expert's gate/up/down weight and scale must be present with the
// right shape and dtype (FormatError naming the tensor otherwise); every destination element is
// written (checked). Reads only the tensors of the rank's experts.
LoadedMoeLayer load_moe_layer(const SafetensorsCheckpoint& ckpt, const ModelConfig& model,
                              int layer, const TpShard& tp, const ExpertPlacement& ep);

// =====================================================================================================
// The deployment planner (fp8moe plan)
// =====================================================================================================

// The parallel layout as vLLM takes it: --tensor-parallel-size, --data-parallel-size, prefill
// context parallel, --enable-expert-parallel. With EP the flattened dp*pcp*tp ranks become EP ranks
// and the MoE layer's TP is 1 (FusedMoEParallelConfig.make).
struct PlanParallel {
  int tp = 1;
  int dp = 1;
  int pcp = 1;
  int ep = 0;            // 0: not given; otherwise must equal dp*pcp*tp (sets enable_ep when > 1)
  bool tp_given = true;  // false: an --ep without --tp sets tp = ep / (dp*pcp)
  bool enable_ep = false;
  std::string all2all_backend = "allgather_reducescatter";
  // Throws ValueError for sizes < 1, an --ep that is not dp*pcp*tp, an unknown all2all backend.
  MoeParallelConfig make() const;
};

struct PlanOptions {
  PlanParallel parallel;
  std::string moe_backend = "auto";  // vLLM --moe-backend (normalised: lower case, '-' -> '_')
  std::optional<DType> act_dtype;    // activation dtype; default: the model's torch_dtype
  bool lora = false;
  // The roofline ("how fast, at best?"): a card gives every planned shape a ShapeRoofline at these
  // batch sizes (tokens per forward of one DP group). No card: no roofline; card_note says why.
  std::optional<GpuCard> card;
  std::string card_note;
  std::vector<int64_t> roofline_tokens = default_roofline_tokens();
};

// The roofline of one planned shape on the busiest rank (roofline.hpp has the model).
struct ShapeRoofline {
  RooflineLayer layer;  // what was estimated
  std::string layout;   // the parallel assumption in words (who holds which experts, which tokens)
  int num_layers = 0;   // MoE layers of this shape
  std::vector<RooflinePoint> points;
};

// Expert memory of one rank for one layer, in the checkpoint layout the loader produces.
struct RankMemory {
  int rank = 0;  // TP rank (pure TP) or EP rank (expert parallel)
  int num_local_experts = 0;
  int64_t local_intermediate = 0;  // W: per-rank allocation (padded under kPad)
  int64_t valid_intermediate = 0;  // rows of real weights (< W on padded ranks)
  uint64_t weight_bytes = 0;       // fp8 w13 + w2
  uint64_t scale_bytes = 0;        // weight scales (+ static input scales)
};

// The plan for one distinct MoE layer shape (most models have one).
struct ShapePlan {
  std::vector<int> layers;  // decoder layers with this shape
  int64_t hidden = 0, intermediate = 0;
  int num_experts = 0, topk = 0;
  bool ignored = false;    // the ignore list leaves these experts unquantised
  std::string checkpoint;  // what the safetensors headers showed ("" when planning config.json)

  bool ok = false;
  std::string
      failed_step;  // "parallel" | "fp8" | "resolve" | "select" | "validate" | "quant_config"
  std::string error_kind;  // "ValueError", "NotImplementedError", ...
  std::string error_message;

  MoeConfig moe_config;  // after block resolution (tp_shard_with_padding, per-partition size)
  std::string resolution = "none";  // "keep" | "refine" | "pad" | "none" (no block quantisation)
  std::string resolution_why;
  std::optional<std::array<int64_t, 2>> checkpoint_block;
  std::optional<std::array<int64_t, 2>> block;   // the blocks the weights are loaded with
  std::optional<std::array<int64_t, 2>> refine;  // scale upsampling factor
  bool padded = false;
  OptQuantKey weight_key, activation_key;  // as passed to select_fp8_moe_backend
  bool allow_vllm_cutlass = false;
  Selection selection;  // complete when ok; the progress so far when selection failed
  bool selected = false;
  std::string quant_config;       // MoeQuantConfig::describe()
  std::string quant_config_name;  // "fp8_w8a8" ...
  std::vector<std::string> notes;

  std::vector<RankMemory> ranks;  // every rank, per layer
  uint64_t max_rank_bytes_per_layer = 0;
  uint64_t max_rank_bytes = 0;  // over all the layers of this shape
  // FLOPs of one routed (token, expert) pair in one layer, summed over the TP ranks: useful =
  // 2*H*(2I) + 2*H*I (gated), executed counts the padded rows too.
  double useful_flops = 0, executed_flops = 0;
  double padding_overhead() const {
    return useful_flops > 0 ? executed_flops / useful_flops - 1 : 0;
  }
  // Set when PlanOptions::card is, the per-rank layout is known and the experts go through the FP8
  // MoE oracle (also for plans failing later: the floor if it ran).
  std::optional<ShapeRoofline> roofline;
};

struct ModelPlan {
  ModelConfig model;
  std::string platform;  // Platform::describe()
  std::string parallel;  // MoeParallelConfig::repr()
  int world_size = 1;    // GPUs the MoE layer spans
  std::string moe_backend = "auto";
  bool headers_read = false;
  std::size_t checkpoint_shards = 0, checkpoint_tensors = 0;
  uint64_t checkpoint_bytes = 0;
  bool weight_bytes_read = false;  // must stay false: planning reads headers only
  std::vector<ShapePlan> shapes;
  std::string error;            // set when the layout itself is invalid (e.g. --ep mismatch)
  std::optional<GpuCard> card;  // PlanOptions::card
  std::string card_note;        // PlanOptions::card_note
  int tokens_factor = 1;        // MoE tokens per DP-group token (dp)
  bool ok() const;
  // One forward step's MoE floor (every shape's layers x floor) at roofline point i; false when a
  // shape has no roofline (the sum would be incomplete).
  bool moe_step_s(std::size_t i, double& seconds) const;
  uint64_t max_rank_bytes() const;  // all MoE layers, the fullest rank
};

// Plans every MoE layer of `model` for a deployment: the checkpoint's keys (§5.1), the TP block
// resolution (keep / refine / pad and why), the oracle's selection with its trace, the quant
// config, per-rank expert bytes and padding's extra FLOPs. `ckpt` (optional) is cross-checked
// against the config: every routed expert tensor must exist with the expected dtype and shape
// (FormatError naming the tensor otherwise). Never reads a weight byte. Decision failures (no
// backend, misaligned blocks) are recorded in the ShapePlan, not thrown.
ModelPlan plan_model(const ModelConfig& model, const SafetensorsCheckpoint* ckpt,
                     const PlanOptions& options, const Platform& platform, const OracleEnv& env);
nlohmann::ordered_json plan_to_json(const ModelPlan& plan);

// The TP shard a rank loads for a planned shape (kPlain for non-block schemes).
TpShard plan_tp_shard(const ShapePlan& shape, int tp_rank);

}  // namespace fp8moe
