// Platform: parsing simulated platforms, installed features, vLLM's capability helpers, detect().
#include <gtest/gtest.h>

#include "fp8moe/error.hpp"
#include "fp8moe/platform.hpp"
#include "kernels/registry.hpp"

namespace fp8moe {
namespace {

TEST(Platform, ParseForms) {
  struct Case {
    const char* text;
    PlatformKind kind;
    int cap;
    const char* str;
    const char* device;
  };
  const Case cases[] = {
      {"cpu", PlatformKind::kCpu, 0, "cpu", "cpu"},
      {"CPU", PlatformKind::kCpu, 0, "cpu", "cpu"},
      {"cpu:x86", PlatformKind::kCpu, 0, "cpu", "cpu"},
      {"cpu:arm", PlatformKind::kCpu, 0, "cpu:arm", "cpu"},
      {"cuda:90", PlatformKind::kCuda, 90, "cuda:90", "cuda"},
      {"cuda:9.0", PlatformKind::kCuda, 90, "cuda:90", "cuda"},
      {"cuda:sm90", PlatformKind::kCuda, 90, "cuda:90", "cuda"},
      {"cuda:100", PlatformKind::kCuda, 100, "cuda:100", "cuda"},
      {"cuda:120", PlatformKind::kCuda, 120, "cuda:120", "cuda"},
      {"cuda:80", PlatformKind::kCuda, 80, "cuda:80", "cuda"},
      {"rocm:gfx942", PlatformKind::kRocm, 0, "rocm:gfx942", "rocm"},
      {"rocm:gfx950", PlatformKind::kRocm, 0, "rocm:gfx950", "rocm"},
      {"rocm:gfx1201", PlatformKind::kRocm, 0, "rocm:gfx1201", "rocm"},
      {"xpu", PlatformKind::kXpu, 0, "xpu", "xpu"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.text);
    const Platform p = Platform::parse(c.text);
    EXPECT_EQ(p.kind(), c.kind);
    EXPECT_EQ(p.capability(), c.cap);
    EXPECT_EQ(p.str(), c.str);
    EXPECT_EQ(p.device_name(), c.device);
    EXPECT_FALSE(p.detected());
    EXPECT_EQ(p.installed_str(), "all");
  }
  EXPECT_EQ(Platform::parse("cpu").cpu_arch(), CpuArch::kX86);
  EXPECT_EQ(Platform::parse("cpu:arm").cpu_arch(), CpuArch::kArm);
}

TEST(Platform, BadPlatformsNameTheValueAndTheForms) {
  for (const char* bad : {"", "tpu", "cuda", "cuda:", "cuda:9", "cuda:abc", "cuda:1000",
                          "rocm:gfx1100", "rocm:", "cpu:riscv", "cuda:9.10"}) {
    SCOPED_TRACE(bad);
    try {
      Platform::parse(bad);
      ADD_FAILURE() << "no error";
    } catch (const ValueError& e) {
      const std::string m = e.what();
      EXPECT_NE(m.find(std::string("unknown platform '") + bad + "'"), std::string::npos) << m;
      EXPECT_NE(m.find("cuda:90"), std::string::npos) << m;
    }
  }
}

TEST(Platform, CapabilityHelpers) {
  const Platform c90 = Platform::parse("cuda:90"), c100 = Platform::parse("cuda:100"),
                 c103 = Platform::parse("cuda:103"), c110 = Platform::parse("cuda:110"),
                 c120 = Platform::parse("cuda:120"), c121 = Platform::parse("cuda:121"),
                 c89 = Platform::parse("cuda:89"), c80 = Platform::parse("cuda:80");
  EXPECT_TRUE(c90.is_device_capability(90));
  EXPECT_FALSE(c100.is_device_capability(90));
  EXPECT_TRUE(c100.is_device_capability_family(100));
  EXPECT_TRUE(c103.is_device_capability_family(100));
  EXPECT_FALSE(c110.is_device_capability_family(100));
  EXPECT_FALSE(c120.is_device_capability_family(100));
  EXPECT_TRUE(c121.is_device_capability_family(120));
  EXPECT_TRUE(c90.has_device_capability(89));
  EXPECT_FALSE(c80.has_device_capability(89));
  EXPECT_FALSE(Platform::parse("rocm:gfx942").has_device_capability(75));

  EXPECT_TRUE(c89.supports_fp8());
  EXPECT_FALSE(c80.supports_fp8());
  EXPECT_TRUE(Platform::parse("rocm:gfx942").supports_fp8());
  EXPECT_TRUE(Platform::parse("rocm:gfx950").supports_fp8());
  EXPECT_TRUE(Platform::parse("rocm:gfx1201").supports_fp8());
  EXPECT_TRUE(Platform::parse("xpu").supports_fp8());
  EXPECT_FALSE(Platform::parse("cpu").supports_fp8());

  EXPECT_TRUE(c90.support_deep_gemm());
  EXPECT_TRUE(c100.support_deep_gemm());
  EXPECT_TRUE(c103.support_deep_gemm());
  EXPECT_FALSE(c110.support_deep_gemm());
  EXPECT_TRUE(c120.support_deep_gemm());
  EXPECT_FALSE(c89.support_deep_gemm());
  EXPECT_FALSE(Platform::parse("rocm:gfx942").support_deep_gemm());
}

TEST(Platform, RocmArchHelpers) {
  const Platform g942 = Platform::parse("rocm:gfx942"), g950 = Platform::parse("rocm:gfx950"),
                 g1201 = Platform::parse("rocm:gfx1201");
  EXPECT_EQ(g942.fp8_dtype(), KeyDType::kF8E4M3FNUZ);
  EXPECT_EQ(g950.fp8_dtype(), KeyDType::kF8E4M3FN);
  EXPECT_EQ(g1201.fp8_dtype(), KeyDType::kF8E4M3FN);
  EXPECT_EQ(Platform::parse("cuda:90").fp8_dtype(), KeyDType::kF8E4M3FN);
  EXPECT_EQ(g942.cdna_version(), 3);
  EXPECT_EQ(g950.cdna_version(), 4);
  EXPECT_EQ(g1201.cdna_version(), -1);
  EXPECT_TRUE(g942.on_cdna());
  EXPECT_FALSE(g1201.on_cdna());
  EXPECT_TRUE(g1201.on_rdna4());
  EXPECT_FALSE(g950.on_rdna4());
  EXPECT_TRUE(g950.on_gfx950());
  EXPECT_FALSE(g942.on_gfx950());
  EXPECT_TRUE(g942.is_cuda_alike());
  EXPECT_FALSE(Platform::parse("xpu").is_cuda_alike());
}

TEST(Platform, Installed) {
  Platform p = Platform::parse("cuda:90");
  for (Feature f : all_features()) EXPECT_TRUE(p.has(f)) << feature_name(f);
  p.set_installed("none");
  EXPECT_EQ(p.installed_str(), "none");
  for (Feature f : all_features()) EXPECT_FALSE(p.has(f)) << feature_name(f);
  p.set_installed("deep_gemm, flashinfer_trtllm");
  EXPECT_TRUE(p.has(Feature::kDeepGemm));
  EXPECT_TRUE(p.has(Feature::kFlashinferTrtllm));
  EXPECT_FALSE(p.has(Feature::kFlashinferCutlass));
  EXPECT_EQ(p.installed_str(), "deep_gemm,flashinfer_trtllm");
  p.set_installed("ALL");
  EXPECT_EQ(p.installed_str(), "all");
  try {
    p.set_installed("deep_gemm,flashinfer");
    ADD_FAILURE();
  } catch (const ValueError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("'flashinfer'"), std::string::npos) << m;
    for (Feature f : all_features())
      EXPECT_NE(m.find(std::string(feature_name(f))), std::string::npos) << m;
  }
  EXPECT_EQ(feature_name(Feature::kAmxTile), "amx_tile");
  EXPECT_FALSE(feature_doc(Feature::kAmxFp8).empty());
}

int fake_capability_90() { return 90; }
int fake_no_gpu() { return 0; }

TEST(Platform, DetectThisMachine) {
  const CudaCapabilityHook saved = cuda_capability_hook();
  set_cuda_capability_hook(nullptr);
  Platform p = Platform::detect();
  EXPECT_TRUE(p.detected());
  EXPECT_TRUE(p.is_cpu());
  // A family is installed only where fp8moe's own kernel is available here.
  EXPECT_EQ(p.has(Feature::kAmxTile), experts_impl_available("cpu_w8a16"));
  EXPECT_EQ(p.has(Feature::kAmxFp8), experts_impl_available("cpu_w8a8"));
  EXPECT_EQ(p.has(Feature::kDeepGemm), experts_impl_available("cuda_grouped") ||
                                           experts_impl_available("cuda_grouped_masked"));
  for (Feature f : {Feature::kFlashinferTrtllm, Feature::kFlashinferCutlass, Feature::kHumming,
                    Feature::kHpc, Feature::kAiter, Feature::kCutlassGroupGemm})
    EXPECT_FALSE(p.has(f)) << feature_name(f);
  EXPECT_NE(p.describe().find("detected"), std::string::npos);

  set_cuda_capability_hook(fake_capability_90);
  p = Platform::detect();
  EXPECT_TRUE(p.is_cuda());
  EXPECT_EQ(p.capability(), 90);
  set_cuda_capability_hook(fake_no_gpu);
  EXPECT_TRUE(Platform::detect().is_cpu());
  set_cuda_capability_hook(saved);
}

}  // namespace
}  // namespace fp8moe
