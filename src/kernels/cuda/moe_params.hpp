// Plain structs shared by the host code (g++) and the kernels (nvcc) of the CUDA fused MoE: the
// problem pieces as the kernels see them. No CUDA headers, no logic.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define FP8MOE_HD __host__ __device__
#else
#define FP8MOE_HD
#endif

namespace fp8moe::cuda {

constexpr float kFp8Max = 448.0f;  // e4m3fn

FP8MOE_HD constexpr int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
FP8MOE_HD constexpr int64_t round_up(int64_t a, int64_t b) { return ceil_div(a, b) * b; }

// How the weight scales of one GEMM are indexed (mirrors WeightScaleKind).
enum class WScale : int32_t { kBlock = 0, kTensor = 1, kTensorPerShard = 2, kChannel = 3 };
// How the activation scales entering one GEMM are indexed.
enum class AScale : int32_t { kGroup = 0, kToken = 1, kTensor = 2 };
// The activation quantiser (mirrors ActQuantKind for the fp8 schemes).
enum class AQuant : int32_t {
  kGroupDynamic = 0,   // per_token_group_quant_fp8
  kTokenDynamic = 1,   // s_r = max(amax_r / 448, 1/(448*512))
  kTensorStatic = 2,   // scale from the checkpoint
  kTensorDynamic = 3,  // s = amax / 448 over the whole tensor
};
// Activations (mirrors MoeActivation; only the ones this implementation computes).
enum class Act : int32_t {
  kSilu = 0,
  kGelu = 1,
  kGeluTanh = 2,
  kSwigluOai = 3,              // interleaved gate/up, op defaults alpha 1.702, limit 7
  kSwigluOaiUninterleave = 4,  // packed, alpha/beta/limit from the config
  kSiluNoMul = 5,
  kGeluNoMul = 6,
  kGeluTanhNoMul = 7,
  kRelu2NoMul = 8,
  kSitu = 9,         // needs situ_beta; optional situ_linear_beta
  kSwigluStep = 10,  // limit fixed at 7
};
constexpr bool act_is_gated(Act a) {
  return static_cast<int32_t>(a) <= 4 || a == Act::kSitu || a == Act::kSwigluStep;
}

// Routing as the kernel computes it: every RoutingMethodType reduces to these choices (the host
// maps them exactly as numerics/routing.cpp's route_row does).
enum class RouteScore : int32_t { kSoftmax = 0, kSigmoid = 1, kSqrtSoftplus = 2, kLogits = 3 };
enum class RouteWeight : int32_t {
  kScore = 0,            // w = s[id] (unbiased score)
  kSoftmaxSelected = 1,  // Renormalize: softmax over the k selected logits
  kLogit = 2,            // TopK: the logit itself (0 when not finite)
  kSigmoidLogit = 3,     // Llama4: sigmoid of the selected logit
};
enum class RouteRenorm : int32_t { kNone = 0, kSumPlusEps = 1, kMaxSumEps = 2 };

struct RoutingParams {
  const void* logits = nullptr;  // (M, E_global) f32 or bf16
  int32_t logits_bf16 = 0;
  int32_t score = 0;   // RouteScore: selection key = score (+ bias), or the raw logit
  int32_t weight = 0;  // RouteWeight
  int32_t grouped = 0;
  int32_t num_expert_group = 0;
  int32_t topk_group = 0;
  int32_t renorm = 0;  // RouteRenorm: w / (sum + eps) or w / max(sum, eps); 1 when not > 0
  float eps = 0.0f;
  int32_t apply_rsf = 0;
  float routed_scaling_factor = 1.0f;
  const void* bias = nullptr;  // (E_global) e_score_correction_bias, f32 or bf16
  int32_t bias_bf16 = 0;
};

// One GEMM's weight side.
struct WeightSide {
  const uint8_t* w = nullptr;  // (E_local, N, K) fp8
  const float* scale = nullptr;
  int32_t scale_kind = 0;  // WScale
  int32_t bn = 128, bk = 128;
  int64_t scale_e_stride = 0;  // floats per expert
  int64_t scale_n_stride = 0;  // floats per scale row (block: ceil(K/bk); channel: 1)
  const void* bias = nullptr;  // (E_local, N) f32 or bf16, optional
  int32_t bias_bf16 = 0;
};

// Tile of the generic mma.sync GEMM (moe_align pads every expert to a multiple of kGemmBM).
constexpr int kGemmBM = 64;
constexpr int kGemmBN = 64;

// Rounding and activation parameters.
struct ActParams {
  int32_t act = 0;  // Act
  int32_t has_limit = 0;
  float limit = 0.0f;
  float alpha = 1.0f;
  float beta = 0.0f;
  int32_t fp32_silu = 0;  // fused SiLU+quant semantics: h = g * sigmoid(g) * u in fp32, no rounding
  int32_t f32 = 0;        // f32 activations: every intermediate stays f32 (no bf16 rounding)
  float situ_beta = 1.0f;
  float situ_linear_beta = 0.0f;  // > 0: u' = lb * tanh(u / lb)
};

// Which rows of a (rows, cols) matrix a kernel visits (row_valid() in smxx_fp8_quant.cuh).
struct RowSet {
  const int32_t* sorted_ids = nullptr;  // sorted layout: row p valid iff sorted_ids[p] < num_valid
  const int32_t* num_rows_ptr = nullptr;  // device row count (padded rows) when sorted
  int32_t num_rows = 0;                   // host upper bound on rows
  int32_t num_valid = 0;
  int32_t gather_div = 0;  // > 0: source row of p is sorted_ids[p] / gather_div (gathered input)
};

// Optional per-row multiplier applied before quantisation (apply_router_weight_on_input).
struct RowScale {
  const float* w = nullptr;
};

// Rows of the grouped GEMMs (the sorted, padded layout of moe_align).
struct GemmRows {
  const int32_t* sorted_ids = nullptr;
  const int32_t* expert_blk = nullptr;
  const int32_t* num_rows_ptr = nullptr;  // padded row count
  int32_t num_valid = 0;                  // sentinel
  int32_t topk = 1;                       // GEMM1 gathers A row sorted_id / topk
};

struct GemmArgs {
  GemmRows rows;
  int32_t a_gather = 0;  // 1: A row = sorted_ids[p] / topk; 0: A row = p
  const uint8_t* a = nullptr;
  int64_t a_stride = 0;  // bytes per A row
  const float* a_scale = nullptr;
  int32_t a_scale_kind = 0;  // AScale
  int64_t a_scale_stride = 0;
  int32_t gk = 128;
  WeightSide w;
  int32_t N = 0, K = 0;
  void* out = nullptr;  // bf16, or f32 when out_f32 (f32 activations: vLLM computes in f32)
  int32_t out_f32 = 0;
  int64_t out_stride = 0;         // elements
  int32_t out_scatter = 0;        // 1: out row = sorted_ids[p]; 0: out row = p
  const float* topk_w = nullptr;  // GEMM2: y *= w[flat row]
  int32_t promote_block = 0;      // promote every K tile with its scales (block/group schemes)
};

// Arguments of the wgmma grouped GEMMs (sm90_fp8_moe_gemm_wgmma.cuh).
struct WgArgs {
  GemmRows rows;
  const uint8_t* a = nullptr;  // GEMM1: q_x (tokens, K); GEMM2: q_h (sorted rows, K)
  int64_t a_stride = 0;
  const float* a_scale = nullptr;
  int32_t a_scale_kind = 0;  // AScale
  int64_t a_scale_stride = 0;
  WeightSide w;
  int32_t N = 0, K = 0;  // GEMM1: N = 2I (packed gate/up), K = H; GEMM2: N = H, K = I
  int32_t I = 0;
  int64_t rows_total = 0;   // E * N: rows of the weight tensor (for its TMA descriptor)
  int64_t a_rows = 0;       // rows of the A tensor (the sorted layout's capacity)
  int32_t block = 0;        // block weights x group activations: promote with scales per k-block
  int32_t promote_k32 = 0;  // promote after every k32 wgmma (more fp32 precision, slower)
  int32_t gk = 128;
  // GEMM1 outputs: the quantised intermediate
  uint8_t* qh = nullptr;
  float* sh = nullptr;
  int64_t sh_stride = 0;
  int32_t aq2 = 0;  // AQuant of the intermediate: group or static tensor
  const float* a2_scale = nullptr;
  float min_scale2 = 0.0f;
  int32_t ue8m0 = 0;
  ActParams ap;
  // GEMM2 outputs
  uint16_t* y2 = nullptr;  // (M * topk, H) bf16
  const float* topk_w = nullptr;
};

struct AlignOut {
  int32_t* sorted_ids = nullptr;
  int32_t* expert_blk = nullptr;
  int32_t* meta = nullptr;  // [0] = padded rows
  int32_t* expert_count = nullptr;
  int32_t* expert_off = nullptr;
  // optional (sorted layout only): pair i -> its sorted position, -1 for a dropped slot
  int32_t* pair_pos = nullptr;
  // optional scratch of align_scratch_bytes(num_valid, E_local): with it, large pair counts are
  // aligned by many blocks (sorted layout only)
  int32_t* scratch = nullptr;
};

struct QuantOut {
  uint8_t* q = nullptr;
  int64_t q_stride = 0;  // bytes per row
  float* s = nullptr;
  int64_t s_stride = 0;  // floats per row (group scales)
};
struct QuantSpec {
  AQuant kind = AQuant::kGroupDynamic;
  int gk = 128;
  bool ue8m0 = false;
  float min_scale = 0.0f;  // > 0: the fused SiLU+quant scale floor
  const float* static_scale = nullptr;
  unsigned int* amax_ws = nullptr;  // one word of scratch for dynamic per-tensor
};

}  // namespace fp8moe::cuda
