// Shared pieces of the experts descriptors: the platform-flavoured named keys, the (W, A) key sets
// of oracle.md §2.2, and the descriptors themselves (defined one family per file).
#pragma once

#include <initializer_list>
#include <utility>

#include "fp8moe/experts.hpp"
#include "fp8moe/quant_key.hpp"

namespace fp8moe::experts {

// vLLM's named keys built with FP8_DTYPE = current_platform.fp8_dtype().
struct PlatformKeys {
  QuantKey fp8_static_tensor, fp8_dynamic_tensor, fp8_static_token, fp8_static_channel,
      fp8_dynamic_token, fp8_dynamic_128, fp8_static_128_block, fp8_dynamic_64, mxfp8_static,
      mxfp8_dynamic, mxfp4_static, mxfp4_dynamic, nvfp4_static, nvfp4_dynamic, int8_static_channel,
      int8_dynamic_token, int8_static_tensor, int8_dynamic_tensor, int4_static, int8_static,
      int4_static_32, int4_static_asym, int4_static_32_asym;
};
const PlatformKeys& keys_for(KeyDType fp8);
inline const PlatformKeys& keys(const ExpertsContext& ctx) {
  return keys_for(ctx.platform.fp8_dtype());
}

using KeyPair = std::pair<OptQuantKey, OptQuantKey>;
// (weight_key, activation_key) in pairs.
bool in_pairs(const OptQuantKey& w, const OptQuantKey& a, std::initializer_list<KeyPair> pairs);
bool in_acts(MoeActivation a, std::initializer_list<MoeActivation> acts);

// B128 = (kFp8Static128BlockSym, kFp8Dynamic128Sym), TT, TD, TTok, CTok, MX (oracle.md §2.2).
KeyPair b128(const PlatformKeys& k);
KeyPair tt(const PlatformKeys& k);
KeyPair td(const PlatformKeys& k);
KeyPair ttok(const PlatformKeys& k);
KeyPair ctok(const PlatformKeys& k);
KeyPair mx(const PlatformKeys& k);

// Predicates several classes share.
bool always(const ExpertsContext&);
bool never(const ExpertsContext&);
bool any_activation_supported(MoeActivation a,
                              const ExpertsContext&);  // apply_moe_activation_supported
bool any_parallel(const MoeParallelConfig&, const ExpertsContext&);
bool not_fi_nvl(const MoeParallelConfig& p, const ExpertsContext&);  // not (two- or one-sided)
bool any_logits_dtype(std::optional<DType>, RoutingMethodType, const ExpertsContext&);

// TritonExperts' quant-scheme predicate (also used by the FallbackExperts ANDs).
bool triton_supports_quant_scheme(const OptQuantKey& w, const OptQuantKey& a,
                                  const ExpertsContext& ctx);

// The descriptors, one family per file.
extern const ExpertsKernel kTrtLlmFp8ExpertsMonolithic;
extern const ExpertsKernel kTrtLlmFp8ExpertsModular;
extern const ExpertsKernel kFlashInferExperts;
extern const ExpertsKernel kDeepGemmExperts;  // component of TritonOrDeepGemmExperts
extern const ExpertsKernel kTritonOrDeepGemmExperts;
extern const ExpertsKernel kBatchedDeepGemmExperts;
extern const ExpertsKernel kBatchedHummingGroupedExperts;
extern const ExpertsKernel kHummingGroupedExperts;
extern const ExpertsKernel kHummingIndexedExperts;
extern const ExpertsKernel kMarlinExperts;
extern const ExpertsKernel kTritonExperts;
extern const ExpertsKernel kBatchedTritonExperts;
extern const ExpertsKernel kAiterExperts;
extern const ExpertsKernel kCutlassExpertsFp8;  // component of TritonOrCutlassExperts
extern const ExpertsKernel kTritonOrCutlassExperts;
extern const ExpertsKernel kCutlassBatchedExpertsFp8;
extern const ExpertsKernel kXPUExpertsFp8;
extern const ExpertsKernel kXPUExpertsMxFp8;
extern const ExpertsKernel kXPUExpertsBlockFp8;
extern const ExpertsKernel kCPUExpertsFp8;
extern const ExpertsKernel kCPUExpertsFp8W8A8;
extern const ExpertsKernel kHPCExperts;

}  // namespace fp8moe::experts
