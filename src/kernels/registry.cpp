// The explicit list of fused-MoE implementations. To add one: declare its ExpertsImpl (in the
// kernel's own header) and append its address below, CUDA entries inside the #ifdef. Names are
// fixed by the experts descriptors: "ref", "cpu_w8a16" (CPUExpertsFp8), "cpu_w8a8"
// (CPUExpertsFp8W8A8), "cuda_fused" (TritonExperts), "cuda_fused_batched" (BatchedTritonExperts),
// "cuda_grouped" (TritonOrDeepGemmExperts, the DeepGEMM side), "cuda_grouped_masked"
// (BatchedDeepGemmExperts).
#include "kernels/registry.hpp"

#include <cstring>

#include "kernels/cpu/cpu_experts.hpp"
#include "kernels/ref/ref.hpp"

#ifdef FP8MOE_WITH_CUDA
#include "kernels/cuda/fused_moe_cuda.hpp"
#include "kernels/cuda/grouped_moe_cuda.hpp"
#endif

namespace fp8moe {

#ifdef FP8MOE_WITH_CUDA
namespace {
// The CUDA module's hooks (Tensor's device allocator, Platform::detect()'s capability query) are
// installed as soon as the registry is linked in, i.e. wherever a CUDA kernel can be asked for.
// They only store function pointers; nothing touches the GPU here.
const bool g_cuda_hooks_installed = (cuda::install_hooks(), true);
}  // namespace
#endif

const std::vector<const ExpertsImpl*>& experts_impls() {
  static const std::vector<const ExpertsImpl*> impls = {
      &ref::ref_experts_impl(),  // "ref": the float64 reference (no vLLM class names it)
      &cpu::cpu_w8a8_experts_impl(), &cpu::cpu_w8a16_experts_impl(),
#ifdef FP8MOE_WITH_CUDA
      // CUDA kernels (src/kernels/cuda) go here.
      &cuda::fused_impl(), &cuda::fused_batched_impl(),
      &cuda::grouped_impl(),         // DEEPGEMM (sm_90 only)
      &cuda::grouped_masked_impl(),  // BATCHED_DEEPGEMM (sm_90 only)
#endif
  };
  return impls;
}

const ExpertsImpl* find_experts_impl(std::string_view name) {
  for (const ExpertsImpl* impl : experts_impls())
    if (impl && impl->name && name == impl->name) return impl;
  return nullptr;
}

bool experts_impl_available(std::string_view name) {
  const ExpertsImpl* impl = find_experts_impl(name);
  return impl && (!impl->available || impl->available());
}

}  // namespace fp8moe
