// Run-time choice of the CPU kernels' instruction-set level (cpu_kernels.hpp): the best level this
// build has and this machine runs, or a level forced by tests and benchmarks.
#include <fmt/format.h>
#include <hwy/targets.h>

#include <algorithm>
#include <atomic>

#include "fp8moe/error.hpp"
#include "kernels/cpu/cpu_kernels.hpp"

namespace fp8moe::cpu {
namespace {

// -1: automatic; otherwise the forced Isa value.
std::atomic<int> g_override{-1};

bool cpu_has_avx512bf16() {
#if defined(__GNUC__) && (defined(__x86_64__) || defined(_M_X64))
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
         __builtin_cpu_supports("avx512vbmi") && __builtin_cpu_supports("avx512bf16");
#else
  return false;
#endif
}

int64_t hwy_target_of(Isa isa) {
  switch (isa) {
    case Isa::kAvx512:
      return HWY_AVX3;
    case Isa::kAvx2:
      return HWY_AVX2;
    default:
      return HWY_SCALAR;
  }
}

}  // namespace

std::string_view isa_name(Isa isa) {
  switch (isa) {
    case Isa::kScalar:
      return "scalar";
    case Isa::kAvx2:
      return "avx2";
    case Isa::kAvx512:
      return "avx512";
    case Isa::kAvx512Bf16:
      return "avx512_bf16";
  }
  return "?";
}

bool isa_supported(Isa isa) {
  if (isa == Isa::kAvx512Bf16) {
    static const bool ok = avx512bf16_kernel_table() != nullptr && cpu_has_avx512bf16();
    return ok;
  }
  if (hwy_kernel_table(isa) == nullptr) return false;
  if (isa == Isa::kScalar) return true;
  return (hwy::SupportedTargets() & hwy_target_of(isa)) != 0;
}

std::vector<Isa> supported_isas() {
  std::vector<Isa> out;
  for (Isa isa : {Isa::kAvx512Bf16, Isa::kAvx512, Isa::kAvx2, Isa::kScalar}) {
    if (isa_supported(isa)) out.push_back(isa);
  }
  return out;
}

Isa active_isa() {
  const int forced = g_override.load(std::memory_order_relaxed);
  if (forced >= 0) return static_cast<Isa>(forced);
  static const Isa best = supported_isas().front();
  return best;
}

void set_isa_override(std::optional<Isa> isa) {
  if (isa && !isa_supported(*isa)) {
    throw ValueError(fmt::format("CPU kernel level '{}' is not available on this machine/build",
                                 isa_name(*isa)));
  }
  g_override.store(isa ? static_cast<int>(*isa) : -1, std::memory_order_relaxed);
}

ScopedIsa::ScopedIsa(Isa isa) {
  const int prev = g_override.load(std::memory_order_relaxed);
  if (prev >= 0) previous_ = static_cast<Isa>(prev);
  set_isa_override(isa);
}

ScopedIsa::~ScopedIsa() { set_isa_override(previous_); }

const KernelTable& kernel_table(Isa isa) {
  const KernelTable* t =
      isa == Isa::kAvx512Bf16 ? avx512bf16_kernel_table() : hwy_kernel_table(isa);
  if (t == nullptr) {
    throw ValueError(fmt::format("CPU kernel level '{}' is not compiled in", isa_name(isa)));
  }
  return *t;
}

const KernelTable& elementwise_table() {
  const Isa isa = active_isa() == Isa::kAvx512Bf16 ? Isa::kAvx512 : active_isa();
  for (Isa other : supported_isas()) {
    if (static_cast<int>(other) > static_cast<int>(isa) || other == Isa::kAvx512Bf16) continue;
    const KernelTable* t = hwy_kernel_table(other);
    if (t && t->row_epilogue) return *t;
  }
  return *hwy_kernel_table(Isa::kScalar);
}

std::size_t gemm_scratch_bytes(int64_t K) {
  // AVX-512 BF16: the decoded panel (64 weight rows x one K-block of bf16) and its lane-layout
  // totals (rows x 64 weight rows x 4 lanes f32), or the permuted activation rows of the streaming
  // path (8 rows x K rounded up to 64, bf16). Portable levels: a decoded f32 panel (16 rows x one
  // K-block) and the lane-layout running totals (rows x 16 x up to 16 lanes).
  const int64_t panel = 64 * kMaxKBlock * 2 + int64_t{kMaxTileRows} * 64 * 4 * 4;
  const int64_t rows = 8 * ((K + 63) / 64 * 64) * 2;
  const int64_t portable = (16 * kMaxKBlock + int64_t{kMaxTileRows} * 16 * 16) * 4;
  return static_cast<std::size_t>(std::max({panel, rows, portable}));
}

}  // namespace fp8moe::cpu
