// wgmma + TMA grouped GEMMs for large batches: not built yet.
#include "moe_paths.hpp"

namespace fp8moe::cuda {

std::string wgmma_path_limit(const MoeProblem&) { return "the wgmma path is not implemented yet"; }
bool wgmma_path_preferred(const MoeProblem&) { return false; }
std::size_t wgmma_workspace(const MoeProblem&) { return 0; }
void run_wgmma(const MoeProblem&, void*) {}

}  // namespace fp8moe::cuda
