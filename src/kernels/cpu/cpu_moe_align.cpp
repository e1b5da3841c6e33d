// Counting sort of (token, slot) pairs by local expert; see cpu_moe_align.hpp.
#include "kernels/cpu/cpu_moe_align.hpp"

namespace fp8moe::cpu {

int64_t moe_align_cpu(const int32_t* ids, int64_t num_slots, const int32_t* expert_map,
                      int64_t num_global, int64_t num_local, int32_t* counts, int64_t* offsets,
                      int32_t* sorted, int32_t* position) {
  for (int64_t e = 0; e < num_local; ++e) counts[e] = 0;
  const auto local = [&](int64_t s) -> int64_t {
    const int32_t id = ids[s];
    if (id < 0 || id >= num_global) return -1;
    return expert_map ? expert_map[id] : id;
  };
  for (int64_t s = 0; s < num_slots; ++s) {
    const int64_t e = local(s);
    if (e >= 0 && e < num_local) ++counts[e];
  }
  offsets[0] = 0;
  for (int64_t e = 0; e < num_local; ++e) offsets[e + 1] = offsets[e] + counts[e];
  // Fill in slot order: each expert's list comes out ascending without a second sort.
  for (int64_t e = 0; e < num_local; ++e) counts[e] = 0;
  for (int64_t s = 0; s < num_slots; ++s) {
    const int64_t e = local(s);
    if (e >= 0 && e < num_local) {
      const int64_t p = offsets[e] + counts[e]++;
      sorted[p] = static_cast<int32_t>(s);
      position[s] = static_cast<int32_t>(p);
    } else {
      position[s] = -1;
    }
  }
  return offsets[num_local];
}

}  // namespace fp8moe::cpu
