// The roofline floor of one MoE layer (include/fp8moe/roofline.hpp) and the card table.
#include "fp8moe/roofline.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <cmath>

#include "fp8moe/error.hpp"

namespace fp8moe {
namespace {

constexpr double kTB = 1e12;  // decimal units, as the datasheets use them

std::string upper(std::string_view s) {
  std::string r(s);
  for (auto& c : r) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return r;
}

bool contains(const std::string& hay, std::string_view needle) {
  return hay.find(needle) != std::string::npos;
}

}  // namespace

std::string GpuCard::describe() const {
  return fmt::format("{} ({}: {:.3g} TB/s HBM, {:.0f} TFLOP/s dense FP8)", name,
                     custom ? "custom" : "spec sheet", hbm_bytes_per_s / kTB, fp8_flops / kTB);
}

// SPEC-SHEET peaks only (dense tensor throughput = the datasheet's "with sparsity" figure / 2).
// Nothing here was measured; measured numbers live in docs/PERFORMANCE.md with their conditions.
const std::vector<GpuCard>& known_gpu_cards() {
  static const std::vector<GpuCard> cards = {
      {"H100", 3.35 * kTB, 1979 * kTB, 989 * kTB,
       "NVIDIA H100 SXM5 datasheet (80 GB HBM3; 3958 TFLOP/s FP8 with sparsity)", false},
      {"H100-PCIe", 2.0 * kTB, 1513 * kTB, 756 * kTB,
       "NVIDIA H100 PCIe datasheet (80 GB HBM2e; 3026 TFLOP/s FP8 with sparsity)", false},
      {"H800", 3.35 * kTB, 1979 * kTB, 989 * kTB,
       "NVIDIA H800 SXM5 datasheet (80 GB HBM3; the H100 SXM5's tensor peaks)", false},
      {"H200", 4.8 * kTB, 1979 * kTB, 989 * kTB,
       "NVIDIA H200 SXM datasheet (141 GB HBM3e; 3958 TFLOP/s FP8 with sparsity)", false},
      {"H20", 4.0 * kTB, 296 * kTB, 148 * kTB,
       "NVIDIA H20 product brief as reported by the press (96 GB HBM3; no public datasheet on "
       "nvidia.com)",
       false},
      {"B200", 8.0 * kTB, 4500 * kTB, 2250 * kTB,
       "NVIDIA HGX B200 datasheet, per GPU (180 GB HBM3e; 9 PFLOP/s FP8 with sparsity)", false},
      {"MI300X", 5.3 * kTB, 2614.9 * kTB, 1307.4 * kTB,
       "AMD Instinct MI300X datasheet (192 GB HBM3; 5229.8 TFLOP/s FP8 with sparsity)", false},
  };
  return cards;
}

std::string known_gpu_card_names() {
  std::string s;
  for (const auto& c : known_gpu_cards()) s += fmt::format("{}{}", s.empty() ? "" : ", ", c.name);
  return s;
}

const GpuCard& gpu_card(std::string_view name) {
  std::string n = upper(name);
  if (n == "H100-SXM" || n == "H100-SXM5" || n == "H100SXM") n = "H100";
  for (const auto& c : known_gpu_cards()) {
    if (upper(c.name) == n) return c;
  }
  throw ValueError(fmt::format(
      "unknown card '{}': expected one of {} (or a custom card: --card-bw TB/s --card-fp8 TFLOP/s)",
      name, known_gpu_card_names()));
}

const GpuCard* gpu_card_for_device(std::string_view device_name) {
  const std::string n = upper(device_name);
  // Variants with other peaks than the card of the same family: not guessed.
  // (GH200 superchips: 96 GB HBM3 at 4 TB/s or 144 GB HBM3e at 4.9 TB/s, not the H200's 4.8.)
  if (contains(n, "NVL") || contains(n, "GH200") || contains(n, "GB200")) return nullptr;
  if (contains(n, "H100")) return &gpu_card(contains(n, "PCIE") ? "H100-PCIe" : "H100");
  if (contains(n, "H800")) return contains(n, "PCIE") ? nullptr : &gpu_card("H800");
  if (contains(n, "H200")) return &gpu_card("H200");
  if (contains(n, "H20")) return &gpu_card("H20");
  if (contains(n, "B200")) return &gpu_card("B200");
  if (contains(n, "MI300X")) return &gpu_card("MI300X");
  return nullptr;
}

const GpuCard* default_gpu_card(const Platform& platform) {
  if (platform.is_device_capability(90)) return &gpu_card("H200");
  if (platform.is_device_capability(100)) return &gpu_card("B200");
  return nullptr;
}

GpuCard custom_gpu_card(double hbm_tb_per_s, double fp8_tflops) {
  if (!std::isfinite(hbm_tb_per_s) || hbm_tb_per_s <= 0) {
    throw ValueError(fmt::format("--card-bw expects a positive, finite bandwidth in TB/s, got {}",
                                 hbm_tb_per_s));
  }
  if (!std::isfinite(fp8_tflops) || fp8_tflops <= 0) {
    throw ValueError(fmt::format(
        "--card-fp8 expects a positive, finite dense FP8 peak in TFLOP/s, got {}", fp8_tflops));
  }
  return {"custom",
          hbm_tb_per_s * kTB,
          fp8_tflops * kTB,
          fp8_tflops * kTB / 2,
          "--card-bw / --card-fp8 (BF16 peak assumed half the FP8 peak)",
          true};
}

void RooflineLayer::validate() const {
  auto bad = [](const std::string& what) { throw ValueError(fmt::format("roofline: {}", what)); };
  if (num_experts < 1) bad(fmt::format("num_experts must be >= 1, got {}", num_experts));
  if (num_local_experts < 1 || num_local_experts > num_experts) {
    bad(fmt::format("num_local_experts must be in [1, {}], got {}", num_experts,
                    num_local_experts));
  }
  if (topk < 1 || topk > num_experts) {
    bad(fmt::format("topk must be in [1, {}], got {}", num_experts, topk));
  }
  if (hidden < 1 || intermediate < 1) {
    bad(fmt::format("hidden and intermediate must be >= 1, got {} and {}", hidden, intermediate));
  }
  if (!(useful_intermediate > 0) || useful_intermediate > static_cast<double>(intermediate)) {
    bad(fmt::format("useful_intermediate must be in (0, {}], got {}", intermediate,
                    useful_intermediate));
  }
  if (token_factor < 1) bad(fmt::format("token_factor must be >= 1, got {}", token_factor));
  if (!std::isfinite(expert_weight_bytes) || expert_weight_bytes <= 0 ||
      !std::isfinite(expert_scale_bytes) || expert_scale_bytes < 0 || !(activation_bytes > 0)) {
    bad("expert weight bytes must be positive, scale bytes non-negative");
  }
}

RooflinePoint roofline_point(const RooflineLayer& L, const GpuCard& card, int64_t tokens) {
  L.validate();
  if (tokens < 1) throw ValueError(fmt::format("roofline: tokens must be >= 1, got {}", tokens));
  if (!(card.hbm_bytes_per_s > 0) || !(card.fp8_flops > 0) || !(card.bf16_flops > 0)) {
    throw ValueError(fmt::format("roofline: card '{}' has no positive peaks", card.name));
  }
  RooflinePoint p;
  p.tokens = tokens;
  p.moe_tokens = tokens * L.token_factor;
  const double T = static_cast<double>(p.moe_tokens);
  const double E = L.num_experts, El = L.num_local_experts, k = L.topk;
  const double K = static_cast<double>(L.hidden), W = static_cast<double>(L.intermediate);
  // 1 - (1 - k/E)^T without cancellation for tiny k/E.
  const double p_touch = -std::expm1(T * std::log1p(-k / E));
  p.experts_touched = El * (k == E ? 1.0 : p_touch);
  p.routed_pairs = T * k * El / E;
  p.weight_bytes = p.experts_touched * L.expert_weight_bytes;
  p.scale_bytes = L.count_scales ? p.experts_touched * L.expert_scale_bytes : 0;
  p.activation_bytes = T * 2 * K * L.activation_bytes;
  p.intermediate_bytes = L.count_intermediate ? p.routed_pairs * 3 * W * L.activation_bytes : 0;
  p.bytes = p.weight_bytes + p.scale_bytes + p.activation_bytes + p.intermediate_bytes;
  p.flops = 6 * p.routed_pairs * W * K;
  const double pad = 1 - L.useful_intermediate / W;  // the padded share of the rows
  p.padding_flops = p.flops * pad;
  p.padding_bytes = (p.weight_bytes + p.intermediate_bytes) * pad;
  p.memory_s = p.bytes / card.hbm_bytes_per_s;
  p.compute_s = p.flops / (L.fp8_compute ? card.fp8_flops : card.bf16_flops);
  p.compute_bound = p.compute_s > p.memory_s;
  p.floor_s = std::max(p.memory_s, p.compute_s);
  return p;
}

const std::vector<int64_t>& default_roofline_tokens() {
  static const std::vector<int64_t> t = {1, 8, 32, 128, 512, 2048, 8192};
  return t;
}

}  // namespace fp8moe
