// The roofline floor of one MoE layer on one GPU: "how fast can this deployment be, at best?".
//
// The model is spec/models.md's ("Roofline floors for one MoE layer on H200"): per layer and rank,
//
//   floor = max(bytes / HBM bandwidth, FLOPs / dense tensor peak)
//
//   bytes = touched x (w13 + w2 + scales of one local expert)      the weights, each read once
//         + T x 2K x 2                                              bf16 activations in and out
//         + pairs x 3W x 2                                          bf16 intermediates: gate/up
//                                                                   (2W) and activated (W) rows
//   FLOPs = 6 x pairs x W x K                                       (2 x K x 2W  +  2 x W x K)
//
// with T = the tokens the rank's MoE layer sees (M tokens of one DP group x dp: the
// allgather_reducescatter dispatch gathers every DP group's tokens), E_local the experts on the
// busiest rank (E under TP, E/EP under EP), W the rows each rank executes (I/TP, or the padded
// width when the plan pads: padding costs bytes and FLOPs and is reported), K = hidden,
//   touched = E_local x (1 - (1 - topk/E)^T)   expected distinct local experts, uniform routing
//   pairs   = T x topk x E_local / E           expected (token, expert) pairs routed to this rank
//
// The only difference from models.md's table is the scales: the table leaves them out (they are
// under 0.03% of the weight bytes for 128x128 blocks); fp8moe counts them by default
// (RooflineLayer::count_scales). With count_scales = false the numbers are the table's.
//
// It is a LOWER BOUND under its assumptions, not a prediction: real kernels re-read an expert's
// weights once per M-tile, launch, sort and quantise; skewed real routing touches fewer experts
// than uniform routing (so a real batch can beat the *expected* floor); attention, dense layers
// and communication are not counted. Measured kernels: `fp8moe bench`, docs/PERFORMANCE.md.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "fp8moe/platform.hpp"

namespace fp8moe {

// A GPU's published peaks. Every entry of known_gpu_cards() is a SPEC-SHEET number (the vendor's
// datasheet; dense tensor throughput, i.e. without 2:4 sparsity), never a measured one.
struct GpuCard {
  std::string name;            // "H200"
  double hbm_bytes_per_s = 0;  // HBM bandwidth, bytes/s
  double fp8_flops = 0;        // dense FP8 tensor FLOP/s
  double bf16_flops = 0;       // dense BF16 tensor FLOP/s (weight-only / unquantised experts)
  std::string source;          // where the numbers come from
  bool custom = false;         // --card-bw / --card-fp8
  // "H200 (spec sheet: 4.8 TB/s HBM, 1979 TFLOP/s dense FP8)"
  std::string describe() const;
};

// The built-in cards (spec-sheet peaks): H100 (SXM), H100-PCIe, H800, H200, H20, B200, MI300X.
const std::vector<GpuCard>& known_gpu_cards();
std::string known_gpu_card_names();  // "H100, H100-PCIe, ..."
// A built-in card by name (case-insensitive; "H100-SXM" is H100). ValueError listing the known
// names otherwise.
const GpuCard& gpu_card(std::string_view name);
// The built-in card of a CUDA/ROCm device name ("NVIDIA H200", "NVIDIA H100 80GB HBM3"), nullptr
// when the name is not one of them (e.g. "NVIDIA H200 NVL", whose peaks differ from the SXM H200).
const GpuCard* gpu_card_for_device(std::string_view device_name);
// The card assumed for a simulated platform: H200 for cuda:90, B200 for cuda:100, else nullptr.
const GpuCard* default_gpu_card(const Platform& platform);
// A custom card from --card-bw TB/s and --card-fp8 TFLOP/s (decimal units). Both must be positive
// and finite (ValueError naming the flag otherwise). BF16 peak: half the FP8 peak (stated).
GpuCard custom_gpu_card(double hbm_tb_per_s, double fp8_tflops);

// One MoE layer as the busiest rank executes it.
struct RooflineLayer {
  int num_experts = 0;        // E, global routed experts
  int num_local_experts = 0;  // E_local on the busiest rank
  int topk = 0;
  int64_t hidden = 0;              // K
  int64_t intermediate = 0;        // W: rows per rank executed (padded width under padding)
  double useful_intermediate = 0;  // I / TP: the real rows (== W when not padded)
  int64_t token_factor = 1;        // MoE tokens per token of one DP group (dp)
  double expert_weight_bytes = 0;  // one local expert: fp8 w13 + w2 as loaded (W rows)
  double expert_scale_bytes = 0;   // one local expert: its weight (and static input) scales
  double activation_bytes = 2;     // bf16 activations
  bool fp8_compute = true;         // false: weight-only or unquantised kernels (BF16 peak)
  bool count_scales = true;        // models.md's table: false
  bool count_intermediate = true;  // the bf16 gate/up and activated rows (models.md counts them)
  // Throws ValueError for a layer that cannot be estimated (no experts, top-k > E, ...).
  void validate() const;
};

// The floor at one batch size.
struct RooflinePoint {
  int64_t tokens = 0;      // M: tokens per forward of one DP group
  int64_t moe_tokens = 0;  // T = M x token_factor
  double experts_touched = 0;
  double routed_pairs = 0;
  double weight_bytes = 0, scale_bytes = 0, activation_bytes = 0, intermediate_bytes = 0;
  double bytes = 0;
  double flops = 0;
  // The share of bytes and FLOPs spent on padded rows (0 without padding).
  double padding_bytes = 0, padding_flops = 0;
  double memory_s = 0, compute_s = 0;
  double floor_s = 0;  // max(memory_s, compute_s)
  bool compute_bound = false;
};

RooflinePoint roofline_point(const RooflineLayer& layer, const GpuCard& card, int64_t tokens);

// The default batch sizes of `plan`: decode (1, 8, 32, 128) to prefill (512, 2048, 8192).
const std::vector<int64_t>& default_roofline_tokens();

}  // namespace fp8moe
