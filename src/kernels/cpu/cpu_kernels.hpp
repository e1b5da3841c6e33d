// Internal interface between the CPU experts driver (cpu_experts.cpp) and its SIMD kernels: the
// instruction-set levels, the GEMM tile every level computes, and the per-level kernel tables.
//
// Levels (run-time dispatch, best first):
//   kAvx512Bf16  AVX-512 + VBMI + AVX512_BF16: e4m3 decoded to bf16 with two-table byte lookups
//                (vpermi2b), products by vdpbf16ps (exact for e4m3 x bf16 and e4m3 x e4m3),
//                hand-written intrinsics in cpu_kernels_avx512bf16.cpp (Highway 1.0.3 has no BF16
//                dot product and no target for it).
//   kAvx512      Highway AVX3 target: e4m3 decoded to f32 by bit arithmetic, f32 FMA.
//   kAvx2        Highway AVX2 target, same code.
//   kScalar      Highway SCALAR target, same code, one lane.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>
#include <vector>

namespace fp8moe::cpu {

enum class Isa : uint8_t { kScalar, kAvx2, kAvx512, kAvx512Bf16 };

std::string_view isa_name(Isa isa);  // "scalar", "avx2", "avx512", "avx512_bf16"
// Whether this build has the level and this machine can run it.
bool isa_supported(Isa isa);
// Every supported level, best first.
std::vector<Isa> supported_isas();
// The level the kernels use now: the override if set, else the best supported one.
Isa active_isa();
// Forces a level (tests, benchmarks); nullopt restores automatic selection. Throws ValueError for
// a level this machine or build cannot run. Not thread-safe against a concurrent forward call.
void set_isa_override(std::optional<Isa> isa);

// RAII form of set_isa_override for tests.
class ScopedIsa {
 public:
  explicit ScopedIsa(Isa isa);
  ~ScopedIsa();
  ScopedIsa(const ScopedIsa&) = delete;
  ScopedIsa& operator=(const ScopedIsa&) = delete;

 private:
  std::optional<Isa> previous_;
};

// One GEMM tile of one expert:
//
//   c[r][i] = sum_kb  sa[r, kb] * sw[i, kb] * sum_{k in kb} A[a_rows[r]][k] *
//   decode(W[w_rows[i]][k])
//
// in f32, for r < R and i < NT. K-blocks are `kblock` long (the last may be shorter). `sa` and `sw`
// are the per-K-block scales of the block-quantised scheme; either may be absent (1), and when both
// are absent the kernel is free to chunk K as it likes (per-tensor, per-channel and per-token
// scales are applied by the caller's epilogue). The partial sums inside a K-block are exact
// products accumulated in f32 in an order fixed by the level, so results are deterministic.
struct GemmTile {
  // A: activations, row r at a + a_rows[r] * lda elements; bf16 bits (uint16) or f32.
  const void* a = nullptr;
  bool a_bf16 = true;
  int64_t lda = 0;
  const int32_t* a_rows = nullptr;
  int R = 0;                       // 1 .. kMaxTileRows
  const float* a_scale = nullptr;  // (rows of A, a_scale_ld): sa[a_rows[r] * a_scale_ld + kb]
  int64_t a_scale_ld = 0;
  // W: one expert's e4m3fn weights, (N, K) row-major. The NT tile rows come in groups of 16
  // consecutive weight rows: tile row i is weight row w_groups[i / 16] + i % 16.
  const uint8_t* w = nullptr;
  int64_t K = 0;
  const int32_t* w_groups = nullptr;
  int NT = 0;
  // Block scales: sw = w_scale[(row / bn) * w_scale_ld + kb] for weight row `row`.
  const float* w_scale = nullptr;
  int64_t bn = 1;
  int64_t w_scale_ld = 0;
  int64_t kblock = 0;  // K-block length of the scales (a multiple of 32)
  // C: (R, NT) f32, overwritten.
  float* c = nullptr;
  int64_t ldc = 0;
  // Per-thread scratch of at least gemm_scratch_bytes(K) bytes, 64-byte aligned.
  void* scratch = nullptr;
};

// Shape limits every level honours (checked by the driver before it calls a kernel).
inline constexpr int64_t kKAlign = 32;         // K (H and I) must be a multiple of this
inline constexpr int64_t kNAlign = 16;         // NT and the weight-row groups: 16 rows
inline constexpr int64_t kMaxKBlock = 512;     // scale K-blocks up to this length
inline constexpr int64_t kChunkNoScale = 128;  // K chunk when no per-K-block scale applies
inline constexpr int kMaxTileRows = 128;       // activation rows per tile (GemmTile::R)

// Scratch bytes a GEMM tile with reduction length up to K needs per thread (any level).
std::size_t gemm_scratch_bytes(int64_t K);

using GemmTileFn = void (*)(const GemmTile& t);

// The element-wise epilogue of a GEMM tile row, as the reference orders it:
//   v = c[i];  if (apply_scales) v = (v * row_scale) * (col_scale ? col_scale[i] : 1);
//   v += bias ? bias[i] : 0;  if (mul_weight) v *= weight;
//   bf16: round to bf16 (RNE, NaN kept) -> out_bf16 bits and/or out_f32 (the rounded value);
//   else: out_f32 = v.   (n a multiple of 16)
struct RowEpilogue {
  const float* c = nullptr;
  int64_t n = 0;
  bool apply_scales = false;
  float row_scale = 1.0f;
  const float* col_scale = nullptr;
  const float* bias = nullptr;
  bool mul_weight = false;
  float weight = 1.0f;
  bool bf16 = true;
  float* out_f32 = nullptr;
  uint16_t* out_bf16 = nullptr;
};

// The kernels of one level. nullptr: the level does not implement that case.
struct KernelTable {
  GemmTileFn gemm_a_bf16 = nullptr;  // A in bf16
  GemmTileFn gemm_a_f32 = nullptr;   // A in f32
  // e4m3fn codes -> bf16 bits (n a multiple of 64; any n on the portable levels), for tests.
  void (*decode_e4m3_to_bf16)(const uint8_t* in, uint16_t* out, int64_t n) = nullptr;
  // e4m3fn codes -> f32 (n any), for tests.
  void (*decode_e4m3_to_f32)(const uint8_t* in, float* out, int64_t n) = nullptr;
  // numerics::quantize_group_fp8 (e4m3fn) on n values (a multiple of 16), bit for bit, writing
  // the quantised values as bf16 operands (decode(q), without the scale); returns the scale.
  // nullptr: the driver uses the scalar quantiser.
  float (*quantize_group_bf16)(const float* x, int64_t n, uint16_t* out, bool ue8m0,
                               float min_scale) = nullptr;
  void (*row_epilogue)(const RowEpilogue& e) = nullptr;
  // out = round(sum over the `nrows` rows, in order, of the values), n values; rows and out are
  // bf16 bits (bf16 true) or f32. The per-token sum over the top-k slots.
  void (*sum_rows)(const void* const* rows, int nrows, int64_t n, bool bf16, void* out) = nullptr;
};

// The epilogue/sum kernels of the best portable level at or below the active one (the AVX-512
// BF16 level shares the AVX-512 ones).
const KernelTable& elementwise_table();

// Kernel table of one level (only valid when isa_supported(isa)).
const KernelTable& kernel_table(Isa isa);

// Per-level tables, defined by the SIMD translation units.
const KernelTable* avx512bf16_kernel_table();  // nullptr when the build lacks it
const KernelTable* hwy_kernel_table(Isa isa);  // kAvx512, kAvx2, kScalar; nullptr if not compiled

}  // namespace fp8moe::cpu
