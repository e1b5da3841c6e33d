// Platform: parsing a simulated vLLM platform, detecting this machine, and vLLM's current_platform
// helpers (capability tests, ROCm arch tests, fp8 dtype).
#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <string>

#include "fp8moe/error.hpp"
#include "fp8moe/platform.hpp"
#include "kernels/registry.hpp"

namespace fp8moe {

namespace {

struct FeatureName {
  Feature f;
  std::string_view name;
  std::string_view doc;
};
constexpr std::array<FeatureName, kNumFeatures> kFeatureNames{{
    {Feature::kDeepGemm, "deep_gemm", "has_deep_gemm(): DeepGEMM grouped GEMMs are installed"},
    {Feature::kFlashinferTrtllm, "flashinfer_trtllm",
     "has_flashinfer_trtllm_fused_moe(): FlashInfer TRT-LLM fused MoE is installed"},
    {Feature::kFlashinferCutlass, "flashinfer_cutlass",
     "has_flashinfer_cutlass_fused_moe(): FlashInfer CUTLASS fused MoE is installed"},
    {Feature::kHumming, "humming", "has_humming(): the Humming kernels are installed"},
    {Feature::kHpc, "hpc", "has_hpc(): the HPC MoE kernels are installed"},
    {Feature::kAiter, "aiter",
     "aiter importable (IS_AITER_FOUND); is_fused_moe_enabled() also needs the AITER env vars"},
    {Feature::kCutlassGroupGemm, "cutlass_group_gemm",
     "torch.ops._C.cutlass_group_gemm_supported(capability): vLLM's CUTLASS grouped GEMM is built"},
    {Feature::kAmxTile, "amx_tile",
     "torch.cpu._is_amx_tile_supported(); in fp8moe: the CPU W8A16 kernel can run here (it needs "
     "x86-64 AVX2, not AMX)"},
    {Feature::kAmxFp8, "amx_fp8",
     "the seed's AMX-FP8 for CPU_W8A8; in fp8moe: the CPU W8A8 kernel can run here"},
}};

std::atomic<CudaCapabilityHook> g_cuda_hook{nullptr};

std::string lower(std::string_view s) {
  std::string r(s);
  for (auto& c : r) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return r;
}

std::string trim(std::string_view s) {
  std::size_t b = 0, e = s.size();
  while (b < e && std::isspace(static_cast<unsigned char>(s[b]))) ++b;
  while (e > b && std::isspace(static_cast<unsigned char>(s[e - 1]))) --e;
  return std::string(s.substr(b, e - b));
}

bool all_digits(std::string_view s) {
  return !s.empty() && std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; });
}

constexpr std::string_view kAcceptedForms =
    "cpu, cpu:x86, cpu:arm, cuda:<capability> (e.g. cuda:90, cuda:100, cuda:120 or cuda:9.0), "
    "rocm:gfx942, rocm:gfx950, rocm:gfx1200, rocm:gfx1201, xpu";

CpuFeatures host_cpu_features() {
  CpuFeatures f;
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  f.avx2 = __builtin_cpu_supports("avx2");
  f.avx512f = __builtin_cpu_supports("avx512f");
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 12
  f.avx512bf16 = __builtin_cpu_supports("avx512bf16");
#endif
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 13
  f.amx_tile = __builtin_cpu_supports("amx-tile");
#endif
#endif
  return f;
}

CpuArch host_cpu_arch() {
#if defined(__x86_64__) || defined(__i386__)
  return CpuArch::kX86;
#elif defined(__aarch64__) || defined(__arm__)
  return CpuArch::kArm;
#else
  return CpuArch::kOther;
#endif
}

}  // namespace

std::string_view feature_name(Feature f) {
  for (const auto& n : kFeatureNames)
    if (n.f == f) return n.name;
  return "?";
}

std::string_view feature_doc(Feature f) {
  for (const auto& n : kFeatureNames)
    if (n.f == f) return n.doc;
  return "";
}

const std::array<Feature, kNumFeatures>& all_features() {
  static const std::array<Feature, kNumFeatures> a = [] {
    std::array<Feature, kNumFeatures> r{};
    for (std::size_t i = 0; i < kNumFeatures; ++i) r[i] = kFeatureNames[i].f;
    return r;
  }();
  return a;
}

void set_cuda_capability_hook(CudaCapabilityHook hook) { g_cuda_hook.store(hook); }
CudaCapabilityHook cuda_capability_hook() { return g_cuda_hook.load(); }

Platform Platform::parse(std::string_view text) {
  const std::string t = lower(trim(text));
  const auto bad = [&]() {
    return ValueError(fmt::format("unknown platform '{}': expected one of {}", std::string(text),
                                  kAcceptedForms));
  };
  Platform p;
  p.features_.set();
  if (t == "cpu" || t == "cpu:x86" || t == "cpu:x86_64" || t == "cpu:x86-64") {
    p.kind_ = PlatformKind::kCpu;
    p.cpu_arch_ = CpuArch::kX86;
    p.cpu_.avx2 = true;  // a simulated x86 server
    return p;
  }
  if (t == "cpu:arm" || t == "cpu:arm64" || t == "cpu:aarch64") {
    p.kind_ = PlatformKind::kCpu;
    p.cpu_arch_ = CpuArch::kArm;
    return p;
  }
  if (t == "xpu") {
    p.kind_ = PlatformKind::kXpu;
    return p;
  }
  if (t.rfind("cuda:", 0) == 0) {
    std::string c = t.substr(5);
    if (c.rfind("sm", 0) == 0) c = c.substr(c[2] == '_' ? 3 : 2);
    int cap = -1;
    const auto dot = c.find('.');
    if (dot != std::string::npos) {
      const std::string maj = c.substr(0, dot), min = c.substr(dot + 1);
      if (all_digits(maj) && all_digits(min) && maj.size() <= 2 && min.size() == 1)
        cap = std::stoi(maj) * 10 + std::stoi(min);
    } else if (all_digits(c) && c.size() >= 2 && c.size() <= 3) {
      cap = std::stoi(c);
    }
    if (cap < 10 || cap > 199) throw bad();
    p.kind_ = PlatformKind::kCuda;
    p.capability_ = cap;
    return p;
  }
  if (t.rfind("rocm:", 0) == 0) {
    const std::string arch = t.substr(5);
    if (arch != "gfx942" && arch != "gfx950" && arch != "gfx1200" && arch != "gfx1201") throw bad();
    p.kind_ = PlatformKind::kRocm;
    p.gfx_arch_ = arch;
    return p;
  }
  throw bad();
}

Platform Platform::detect() {
  Platform p;
  p.detected_ = true;
  p.cpu_arch_ = host_cpu_arch();
  p.cpu_ = host_cpu_features();
  int cap = 0;
  if (CudaCapabilityHook hook = cuda_capability_hook()) cap = hook();
  if (cap > 0) {
    p.kind_ = PlatformKind::kCuda;
    p.capability_ = cap;
  } else {
    p.kind_ = PlatformKind::kCpu;
  }
  // A family is installed only where fp8moe has its kernel and the kernel can run here.
  p.set_feature(Feature::kDeepGemm, experts_impl_available("cuda_grouped") ||
                                        experts_impl_available("cuda_grouped_masked"));
  p.set_feature(Feature::kAmxTile, experts_impl_available("cpu_w8a16"));
  p.set_feature(Feature::kAmxFp8, experts_impl_available("cpu_w8a8"));
  // FlashInfer, Humming, HPC, AITER and vLLM's CUTLASS grouped GEMM: fp8moe has no kernels of these
  // families, so they are never installed on a detected platform.
  return p;
}

Platform& Platform::set_feature(Feature f, bool installed) {
  features_.set(static_cast<std::size_t>(f), installed);
  return *this;
}

Platform& Platform::set_installed(std::string_view spec) {
  const std::string s = lower(trim(spec));
  if (s == "all") {
    features_.set();
    return *this;
  }
  features_.reset();
  if (s == "none" || s.empty()) return *this;
  std::size_t start = 0;
  while (start <= s.size()) {
    const std::size_t comma = s.find(',', start);
    const std::string item = trim(std::string_view(s).substr(
        start, comma == std::string::npos ? std::string::npos : comma - start));
    if (!item.empty()) {
      bool found = false;
      for (const auto& n : kFeatureNames) {
        if (n.name == item) {
          features_.set(static_cast<std::size_t>(n.f));
          found = true;
        }
      }
      if (!found) {
        std::string names;
        for (const auto& n : kFeatureNames)
          names += fmt::format("{}{}", names.empty() ? "" : ", ", n.name);
        throw ValueError(fmt::format(
            "unknown installed feature '{}' in --installed '{}': expected 'all', 'none' or a comma "
            "list of {}",
            item, std::string(spec), names));
      }
    }
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  return *this;
}

std::string Platform::installed_str() const {
  if (features_.all()) return "all";
  if (features_.none()) return "none";
  std::string r;
  for (const auto& n : kFeatureNames)
    if (has(n.f)) r += fmt::format("{}{}", r.empty() ? "" : ",", n.name);
  return r;
}

std::string_view Platform::device_name() const {
  switch (kind_) {
    case PlatformKind::kCuda:
      return "cuda";
    case PlatformKind::kRocm:
      return "rocm";
    case PlatformKind::kXpu:
      return "xpu";
    case PlatformKind::kCpu:
      return "cpu";
  }
  return "cpu";
}

bool Platform::on_gfx9() const { return is_rocm() && gfx_arch_.find("gfx9") != std::string::npos; }
bool Platform::on_cdna() const {
  return is_rocm() && (gfx_arch_.find("gfx9") != std::string::npos ||
                       gfx_arch_.find("gfx1250") != std::string::npos);
}
bool Platform::on_rdna4() const {
  return is_rocm() && (gfx_arch_ == "gfx1200" || gfx_arch_ == "gfx1201");
}
bool Platform::on_gfx950() const { return is_rocm() && gfx_arch_ == "gfx950"; }
bool Platform::on_gfx1250() const { return is_rocm() && gfx_arch_ == "gfx1250"; }
int Platform::cdna_version() const {
  if (!is_rocm()) return -1;
  if (gfx_arch_ == "gfx942") return 3;
  if (gfx_arch_ == "gfx950") return 4;
  return -1;
}

bool Platform::supports_fp8() const {
  switch (kind_) {
    case PlatformKind::kCuda:
      return has_device_capability(89);
    case PlatformKind::kRocm:
      return on_cdna() || on_rdna4();
    case PlatformKind::kXpu:
      return true;
    case PlatformKind::kCpu:
      return false;
  }
  return false;
}

KeyDType Platform::fp8_dtype() const {
  return is_rocm() && gfx_arch_.rfind("gfx94", 0) == 0 ? KeyDType::kF8E4M3FNUZ
                                                       : KeyDType::kF8E4M3FN;
}

bool Platform::support_deep_gemm() const {
  return is_cuda() && (is_device_capability(90) || is_device_capability_family(100) ||
                       is_device_capability_family(120));
}

std::string Platform::str() const {
  switch (kind_) {
    case PlatformKind::kCuda:
      return fmt::format("cuda:{}", capability_);
    case PlatformKind::kRocm:
      return fmt::format("rocm:{}", gfx_arch_);
    case PlatformKind::kXpu:
      return "xpu";
    case PlatformKind::kCpu:
      return cpu_arch_ == CpuArch::kX86 ? "cpu"
                                        : (cpu_arch_ == CpuArch::kArm ? "cpu:arm" : "cpu:other");
  }
  return "cpu";
}

std::string Platform::describe() const {
  if (!detected_) return fmt::format("{} (simulated; installed: {})", str(), installed_str());
  std::string cpu =
      cpu_arch_ == CpuArch::kX86 ? "x86-64" : (cpu_arch_ == CpuArch::kArm ? "arm64" : "other");
  if (cpu_.avx2) cpu += " AVX2";
  if (cpu_.avx512f) cpu += " AVX-512";
  if (cpu_.avx512bf16) cpu += " AVX-512-BF16";
  if (cpu_.amx_tile) cpu += " AMX";
  return fmt::format("{} (detected: {}; installed: {})", str(), cpu, installed_str());
}

}  // namespace fp8moe
