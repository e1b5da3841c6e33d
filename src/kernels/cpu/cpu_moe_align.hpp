// The CPU kernels' align/sort step: (token, slot) pairs grouped by local expert so that each
// expert's weights stream through once per batch (the CPU counterpart of moe_align_block_size,
// without the padding to BLOCK_SIZE_M: the CPU kernels tile rows themselves).
#pragma once

#include <cstdint>

namespace fp8moe::cpu {

// Input: `ids` (num_slots) global expert ids of the flattened (M, topk) routing, -1 for a padded
// slot; `expert_map` (num_global) global -> local id or -1 (nullptr: identity, num_global ==
// num_local). Output: counts[e] pairs per local expert, offsets[e] their start (offsets[num_local]
// = number of valid pairs), sorted[offsets[e] .. offsets[e+1]) the flat slot indices routed to e in
// ascending order (so the order, and every result computed from it, is deterministic), and
// position[s] the index of slot s in `sorted` or -1 (padded / non-local). Returns the number of
// valid pairs. Ids outside [-1, num_global) are the caller's to reject (validate_fused_moe_args).
int64_t moe_align_cpu(const int32_t* ids, int64_t num_slots, const int32_t* expert_map,
                      int64_t num_global, int64_t num_local, int32_t* counts, int64_t* offsets,
                      int32_t* sorted, int32_t* position);

}  // namespace fp8moe::cpu
