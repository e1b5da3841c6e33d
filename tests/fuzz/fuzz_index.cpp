// libFuzzer target: model.safetensors.index.json parsing (parse_safetensors_index). Inputs must
// parse into (tensor, shard) pairs whose shard names stay inside the model folder, or raise
// fp8moe::Error.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "fp8moe/checkpoint.hpp"
#include "fp8moe/error.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace fp8moe;
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  try {
    for (const auto& [tensor, shard] : parse_safetensors_index(text, "fuzz/index.json")) {
      // The escape check is the parser's job: an accepted name is relative, and none of its
      // '/'-separated parts is empty or "..".
      if (shard.empty() || shard.front() == '/') std::abort();
      std::size_t start = 0;
      while (start <= shard.size()) {
        const std::size_t end = std::min(shard.find('/', start), shard.size());
        const std::string_view part = std::string_view(shard).substr(start, end - start);
        if (part.empty() || part == "..") std::abort();
        start = end + 1;
      }
      (void)tensor;
    }
  } catch (const Error&) {
  }
  return 0;
}
