// The kernel registry: every fused-MoE implementation fp8moe has (fused_moe.hpp's ExpertsImpl), in
// an explicit ordered list (registry.cpp). Experts descriptors (experts.hpp) name their
// implementation; the oracle finds it here on a detected platform, and Platform::detect() counts a
// kernel family as installed only when its implementation is listed here and available().
#pragma once

#include <string_view>
#include <vector>

#include "fp8moe/fused_moe.hpp"

namespace fp8moe {

// The implementations compiled into this build, in registry order.
const std::vector<const ExpertsImpl*>& experts_impls();
// By name ("cpu_w8a16", "cuda_fused", ...); nullptr when this build has none.
const ExpertsImpl* find_experts_impl(std::string_view name);
// find_experts_impl(name) != nullptr and its available() says yes (a null available() counts as
// yes).
bool experts_impl_available(std::string_view name);

}  // namespace fp8moe
