// Internal pieces of the checkpoint room shared between its files (not installed, not public).
#pragma once

#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <vector>

#include "fp8moe/checkpoint.hpp"

namespace fp8moe {

struct ParsedSafetensorsHeader {
  uint64_t header_size = 0;
  std::vector<SafetensorsTensor> tensors;  // header order
  std::map<std::string, std::string> metadata;
};

// Validates a safetensors header. `prefix` holds at least the first 8 + N bytes of the file (or the
// whole file when shorter); `file_size` is the size of the whole file; `file` names it in errors.
ParsedSafetensorsHeader parse_safetensors_header(std::span<const uint8_t> prefix,
                                                 uint64_t file_size, const std::string& file);

// "[128, 2048]"
std::string shape_to_string(std::span<const int64_t> shape);

// Reads a whole small text file (config.json, index). Throws ValueError when it does not exist and
// FormatError when it is larger than `max_bytes`.
std::string read_text_file(const std::string& path, uint64_t max_bytes = 64ull << 20);

bool path_is_dir(const std::string& path);
bool path_is_file(const std::string& path);
std::string path_join(const std::string& dir, const std::string& name);
std::string path_dirname(const std::string& path);

}  // namespace fp8moe
