// The platform the FP8 MoE oracle decides for: vLLM's `current_platform` (device kind, capability,
// ROCm arch, CPU architecture) plus the optional kernel families that are *installed* there. Every
// `has_*()` / `is_*_enabled()` / `_is_amx_tile_supported()` the expert predicates call becomes a
// named Feature answered by Platform::has().
//
// Two ways to get one:
//   Platform::parse("cuda:90")  A SIMULATION of a vLLM deployment. Only the seed's predicates
//   apply;
//                               the features are whatever set_installed() says. A parsed platform
//                               starts with every feature installed ("all": a full vLLM install
//                               with every optional kernel package); narrow it with
//                               set_installed().
//   Platform::detect()          THIS machine and THIS build. A family counts as installed only when
//                               fp8moe really has a kernel for it here (registry + available()),
//                               and the expert descriptors additionally check fp8moe's
//                               implementation.
#pragma once

#include <array>
#include <bitset>
#include <cstdint>
#include <string>
#include <string_view>

#include "fp8moe/quant_key.hpp"

namespace fp8moe {

enum class PlatformKind : uint8_t { kCpu, kCuda, kRocm, kXpu };

// vLLM's CpuArchEnum, reduced to what the predicates ask (get_cpu_architecture() == X86).
enum class CpuArch : uint8_t { kX86, kArm, kOther };

// Optional kernel families and capabilities the expert predicates ask about.
enum class Feature : uint8_t {
  kDeepGemm,           // has_deep_gemm(): the deep_gemm package (DeepGEMM grouped GEMMs)
  kFlashinferTrtllm,   // has_flashinfer_trtllm_fused_moe()
  kFlashinferCutlass,  // has_flashinfer_cutlass_fused_moe()
  kHumming,            // has_humming()
  kHpc,                // has_hpc()
  kAiter,              // aiter importable (IS_AITER_FOUND); the AITER env vars live in OracleEnv
  kCutlassGroupGemm,   // torch.ops._C.cutlass_group_gemm_supported(capability)
  kAmxTile,            // torch.cpu._is_amx_tile_supported(); in fp8moe: "the CPU W8A16 kernel can
                       // run here" (fp8moe's CPU kernels need only x86-64 AVX2, not AMX)
  kAmxFp8,  // the seed's AMX-FP8 for CPU_W8A8; in fp8moe: "the CPU W8A8 kernel can run here"
  kCount,
};
inline constexpr std::size_t kNumFeatures = static_cast<std::size_t>(Feature::kCount);

// "deep_gemm", "flashinfer_trtllm", ... (the names --installed accepts)
std::string_view feature_name(Feature f);
// One line: which vLLM function the feature stands for.
std::string_view feature_doc(Feature f);
const std::array<Feature, kNumFeatures>& all_features();

// Host CPU features (cpuid). Only informative for a parsed platform.
struct CpuFeatures {
  bool avx2 = false;
  bool avx512f = false;
  bool avx512bf16 = false;
  bool amx_tile = false;  // the hardware AMX tile unit (not the fp8moe feature of the same name)
};

class Platform {
 public:
  // Parses "cpu" (x86-64), "cpu:x86", "cpu:arm", "cuda:90" (any capability 10*major+minor, or
  // "cuda:9.0"), "rocm:gfx942" | "rocm:gfx950" | "rocm:gfx1200" | "rocm:gfx1201", "xpu". Every
  // feature starts installed. Throws ValueError naming the text and the accepted forms.
  static Platform parse(std::string_view text);
  // This machine and this build (see the file comment). Never throws.
  static Platform detect();

  // "all", "none" or a comma list of feature names ("deep_gemm,flashinfer_trtllm"). Throws
  // ValueError for an unknown name, listing the valid ones.
  Platform& set_installed(std::string_view spec);
  Platform& set_feature(Feature f, bool installed);
  bool has(Feature f) const { return features_[static_cast<std::size_t>(f)]; }
  // "all", "none" or the comma list of installed features.
  std::string installed_str() const;

  PlatformKind kind() const { return kind_; }
  bool detected() const { return detected_; }
  int capability() const { return capability_; }  // CUDA 10*major+minor; 0 elsewhere
  const std::string& gfx_arch() const { return gfx_arch_; }
  CpuArch cpu_arch() const { return cpu_arch_; }
  const CpuFeatures& cpu_features() const { return cpu_; }

  // ---- vLLM current_platform --------------------------------------------------------------------
  bool is_cuda() const { return kind_ == PlatformKind::kCuda; }
  bool is_rocm() const { return kind_ == PlatformKind::kRocm; }
  bool is_cpu() const { return kind_ == PlatformKind::kCpu; }
  bool is_xpu() const { return kind_ == PlatformKind::kXpu; }
  bool is_cuda_alike() const { return is_cuda() || is_rocm(); }
  // current_platform.device_name: "cuda", "rocm", "cpu", "xpu".
  std::string_view device_name() const;
  // cap.to_int() == c (CUDA only; false elsewhere).
  bool is_device_capability(int c) const { return is_cuda() && capability_ == c; }
  // cap.to_int() // 10 == c // 10.
  bool is_device_capability_family(int c) const { return is_cuda() && capability_ / 10 == c / 10; }
  // cap >= c.
  bool has_device_capability(int c) const { return is_cuda() && capability_ >= c; }
  // CUDA: has_device_capability(89); ROCm: on_cdna() or on_rdna4(); XPU: True; CPU: False.
  bool supports_fp8() const;
  // float8_e4m3fnuz on MI300/MI325 (gfx94x), float8_e4m3fn elsewhere.
  KeyDType fp8_dtype() const;
  // CUDA: is_device_capability(90) or family(100) or family(120); False elsewhere.
  bool support_deep_gemm() const;
  // ROCm arch helpers (False off ROCm).
  bool on_gfx9() const;
  bool on_cdna() const;   // "gfx9" or "gfx1250" in the arch
  bool on_rdna4() const;  // gfx1200 / gfx1201
  bool on_gfx950() const;
  bool on_gfx1250() const;
  int cdna_version() const;  // gfx942: 3, gfx950: 4, else -1

  // "cuda:90", "rocm:gfx942", "cpu", "cpu:arm", "xpu".
  std::string str() const;
  // "cuda:90 (simulated; installed: all)" / "cpu (detected: x86-64 AVX2 AVX-512; installed: ...)".
  std::string describe() const;

 private:
  PlatformKind kind_ = PlatformKind::kCpu;
  int capability_ = 0;
  std::string gfx_arch_;
  CpuArch cpu_arch_ = CpuArch::kX86;
  CpuFeatures cpu_{};
  bool detected_ = false;
  std::bitset<kNumFeatures> features_{};
};

// Installed by the CUDA module: returns 10*major+minor of the current device, or 0 when there is no
// usable GPU. Platform::detect() reports "cpu" while no hook is installed. No CUDA headers here.
using CudaCapabilityHook = int (*)();
void set_cuda_capability_hook(CudaCapabilityHook hook);
CudaCapabilityHook cuda_capability_hook();

}  // namespace fp8moe
