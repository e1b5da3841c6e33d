// The safetensors writer (the example generator, the tests and `fp8moe shard` use it) and sharded
// checkpoints with model.safetensors.index.json.
#include <fmt/format.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>

#include "checkpoint/checkpoint_internal.hpp"
#include "fp8moe/checkpoint.hpp"
#include "fp8moe/error.hpp"

namespace fp8moe {

namespace {

uint64_t expected_bytes(std::string_view dtype_name, std::span<const int64_t> shape,
                        const std::string& name) {
  const int bits = safetensors_dtype_bits(dtype_name);
  uint64_t numel = 1;
  for (int64_t d : shape) {
    if (d < 0) throw ValueError(fmt::format("tensor '{}': negative dimension {}", name, d));
    if (__builtin_mul_overflow(numel, static_cast<uint64_t>(d), &numel)) {
      throw ValueError(fmt::format("tensor '{}': shape too large", name));
    }
  }
  return numel * static_cast<uint64_t>(bits) / 8;
}

void write_file_atomically(const std::string& path, std::span<const uint8_t> a,
                           std::span<const uint8_t> b = {}) {
  const std::string tmp = fmt::format("{}.tmp.{}", path, static_cast<long>(::getpid()));
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) throw RuntimeError(fmt::format("{}: cannot create: {}", tmp, std::strerror(errno)));
    out.write(reinterpret_cast<const char*>(a.data()), static_cast<std::streamsize>(a.size()));
    if (!b.empty()) {
      out.write(reinterpret_cast<const char*>(b.data()), static_cast<std::streamsize>(b.size()));
    }
    out.flush();
    if (!out) {
      std::remove(tmp.c_str());
      throw RuntimeError(fmt::format("{}: write failed", tmp));
    }
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    std::remove(tmp.c_str());
    throw RuntimeError(fmt::format("{}: cannot rename into place: {}", path, std::strerror(err)));
  }
}

}  // namespace

void SafetensorsWriter::add(const std::string& name, DType dtype, std::span<const int64_t> shape,
                            std::span<const uint8_t> bytes) {
  if (name == "__metadata__")
    throw ValueError("'__metadata__' is reserved and cannot name a tensor");
  for (const auto& e : entries_) {
    if (e.name == name) throw ValueError(fmt::format("tensor '{}' added twice", name));
  }
  Entry e;
  e.name = name;
  e.dtype_name = std::string(dtype_to_safetensors(dtype));
  e.shape.assign(shape.begin(), shape.end());
  const uint64_t need = expected_bytes(e.dtype_name, e.shape, name);
  if (need != bytes.size()) {
    throw ValueError(fmt::format("tensor '{}': shape {} of {} needs {} bytes, got {}", name,
                                 shape_to_string(e.shape), e.dtype_name, need, bytes.size()));
  }
  e.bytes.assign(bytes.begin(), bytes.end());
  entries_.push_back(std::move(e));
}

void SafetensorsWriter::add(const std::string& name, const TensorView& t) {
  if (!t.device.is_cpu()) throw ValueError(fmt::format("tensor '{}' is not on the host", name));
  if (!t.is_contiguous()) throw ValueError(fmt::format("tensor '{}' is not contiguous", name));
  std::vector<int64_t> shape = t.sizes();
  add(name, t.dtype, shape,
      std::span<const uint8_t>(static_cast<const uint8_t*>(t.data), t.nbytes()));
}

void SafetensorsWriter::set_metadata(const std::string& key, const std::string& value) {
  metadata_[key] = value;
}

uint64_t SafetensorsWriter::data_bytes() const {
  uint64_t n = 0;
  for (const auto& e : entries_) n += e.bytes.size();
  return n;
}

std::vector<uint8_t> SafetensorsWriter::serialize() const {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata_.empty()) {
    nlohmann::ordered_json m = nlohmann::ordered_json::object();
    for (const auto& [k, v] : metadata_) m[k] = v;
    header["__metadata__"] = m;
  }
  uint64_t offset = 0;
  for (const auto& e : entries_) {
    nlohmann::ordered_json t;
    t["dtype"] = e.dtype_name;
    t["shape"] = e.shape;
    t["data_offsets"] = {offset, offset + e.bytes.size()};
    offset += e.bytes.size();
    header[e.name] = t;
  }
  std::string text = header.dump();
  while (text.size() % 8 != 0) text.push_back(' ');
  std::vector<uint8_t> out;
  out.reserve(8 + text.size() + offset);
  uint64_t n = text.size();
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<uint8_t>((n >> (8 * i)) & 0xff));
  out.insert(out.end(), text.begin(), text.end());
  for (const auto& e : entries_) out.insert(out.end(), e.bytes.begin(), e.bytes.end());
  return out;
}

void SafetensorsWriter::write(const std::string& path) const {
  std::vector<uint8_t> bytes = serialize();
  write_file_atomically(path, bytes);
}

void write_sharded_checkpoint(const std::string& dir, const std::vector<ShardedTensor>& tensors,
                              uint64_t max_shard_bytes, bool force_index) {
  if (!path_is_dir(dir)) throw ValueError(fmt::format("{}: not a directory", dir));
  // Greedy packing in the given order.
  std::vector<std::vector<const ShardedTensor*>> shards(1);
  uint64_t current = 0;
  for (const auto& t : tensors) {
    if (!shards.back().empty() && current + t.bytes.size() > max_shard_bytes) {
      shards.emplace_back();
      current = 0;
    }
    shards.back().push_back(&t);
    current += t.bytes.size();
  }
  const bool single = shards.size() == 1 && !force_index;
  nlohmann::ordered_json weight_map = nlohmann::ordered_json::object();
  uint64_t total = 0;
  for (std::size_t i = 0; i < shards.size(); ++i) {
    const std::string file =
        single ? std::string("model.safetensors")
               : fmt::format("model-{:05d}-of-{:05d}.safetensors", i + 1, shards.size());
    SafetensorsWriter w;
    w.set_metadata("format", "pt");
    for (const ShardedTensor* t : shards[i]) {
      w.add(t->name, t->dtype, t->shape, t->bytes);
      weight_map[t->name] = file;
      total += t->bytes.size();
    }
    w.write(path_join(dir, file));
  }
  if (!single) {
    nlohmann::ordered_json index;
    index["metadata"] = {{"total_size", total}};
    index["weight_map"] = weight_map;
    const std::string text = index.dump(2) + "\n";
    write_file_atomically(
        path_join(dir, "model.safetensors.index.json"),
        std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(text.data()), text.size()));
  }
}

}  // namespace fp8moe
