// libFuzzer target: the safetensors header/layout validator on arbitrary bytes. Every input must
// either parse (and then every tensor's bytes lie inside the input) or raise fp8moe::Error; any
// other exception, crash or sanitizer report is a bug.
#include <cstddef>
#include <cstdint>
#include <span>

#include "fp8moe/checkpoint.hpp"
#include "fp8moe/error.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace fp8moe;
  try {
    const SafetensorsFile f = SafetensorsFile::parse(std::span<const uint8_t>(data, size), "fuzz");
    uint64_t sum = 0;
    for (const SafetensorsTensor& t : f.tensors()) {
      const auto bytes = f.data(t);
      if (bytes.size() != t.nbytes()) __builtin_trap();
      if (!bytes.empty()) sum += bytes.front() + bytes.back();
      if (f.find(t.name) == nullptr) __builtin_trap();
      (void)t.shape_str();
    }
    for (const auto& [k, v] : f.metadata()) sum += k.size() + v.size();
    if (f.data_offset() > size) __builtin_trap();
    (void)sum;
  } catch (const Error&) {
  }
  return 0;
}
