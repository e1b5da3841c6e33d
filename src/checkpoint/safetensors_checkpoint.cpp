// A model's safetensors weights: one file, or shards named by model.safetensors.index.json, with
// the cross-checks between the index and the shards. Also the small file-system helpers.
#include <fmt/format.h>
#include <sys/stat.h>

#include <dirent.h>
#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "checkpoint/checkpoint_internal.hpp"
#include "fp8moe/checkpoint.hpp"
#include "fp8moe/error.hpp"
#include "fp8moe/log.hpp"

namespace fp8moe {

using nlohmann::json;

// ---- file-system helpers
// ----------------------------------------------------------------------------

bool path_is_dir(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

bool path_is_file(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

std::string path_join(const std::string& dir, const std::string& name) {
  if (dir.empty()) return name;
  if (dir.back() == '/') return dir + name;
  return dir + "/" + name;
}

std::string path_dirname(const std::string& path) {
  const auto pos = path.find_last_of('/');
  if (pos == std::string::npos) return ".";
  if (pos == 0) return "/";
  return path.substr(0, pos);
}

std::string read_text_file(const std::string& path, uint64_t max_bytes) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    throw ValueError(fmt::format("{}: {}", path, std::strerror(errno)));
  }
  if (!S_ISREG(st.st_mode)) throw ValueError(fmt::format("{}: not a regular file", path));
  if (static_cast<uint64_t>(st.st_size) > max_bytes) {
    throw FormatError(fmt::format("{}: {} bytes is larger than the {}-byte limit for this file",
                                  path, st.st_size, max_bytes));
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) throw RuntimeError(fmt::format("{}: cannot open: {}", path, std::strerror(errno)));
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

namespace {

std::vector<std::string> list_safetensors(const std::string& dir) {
  std::vector<std::string> out;
  DIR* d = ::opendir(dir.c_str());
  if (!d) return out;
  while (dirent* e = ::readdir(d)) {
    std::string name = e->d_name;
    if (name.size() > 12 && name.substr(name.size() - 12) == ".safetensors") out.push_back(name);
  }
  ::closedir(d);
  std::sort(out.begin(), out.end());
  return out;
}

// Shard names in an index are relative file names; refuse anything that escapes the model folder.
void check_shard_name(const std::string& index_path, const std::string& tensor,
                      const std::string& shard) {
  bool bad = shard.empty() || shard.front() == '/';
  std::size_t start = 0;
  while (!bad && start <= shard.size()) {
    const std::size_t end = std::min(shard.find('/', start), shard.size());
    const std::string part = shard.substr(start, end - start);
    if (part == ".." || part.empty()) bad = true;
    start = end + 1;
  }
  if (bad) {
    throw FormatError(fmt::format(
        "{}: tensor '{}' is mapped to '{}', which is not a file name inside the model folder",
        index_path, tensor, shard));
  }
}

}  // namespace

std::vector<std::pair<std::string, std::string>> parse_safetensors_index(
    std::string_view text, const std::string& index_path) {
  json index;
  try {
    index = json::parse(text);
  } catch (const json::exception& e) {
    throw FormatError(fmt::format("{}: not valid JSON: {}", index_path, e.what()));
  }
  if (!index.is_object()) throw FormatError(fmt::format("{}: must be a JSON object", index_path));
  auto wm = index.find("weight_map");
  if (wm == index.end() || !wm->is_object()) {
    throw FormatError(fmt::format(
        "{}: missing \"weight_map\" (an object mapping tensor names to shard files)", index_path));
  }
  if (wm->empty()) throw FormatError(fmt::format("{}: \"weight_map\" is empty", index_path));
  // metadata.total_size is informational (shared storage may make it smaller); check its type.
  auto md = index.find("metadata");
  if (md != index.end() && !md->is_null()) {
    if (!md->is_object())
      throw FormatError(fmt::format("{}: \"metadata\" must be an object", index_path));
    auto ts = md->find("total_size");
    if (ts != md->end() && !ts->is_number()) {
      throw FormatError(fmt::format("{}: metadata.total_size must be a number", index_path));
    }
  }
  std::vector<std::pair<std::string, std::string>> listed;
  for (auto it = wm->begin(); it != wm->end(); ++it) {
    if (!it.value().is_string()) {
      throw FormatError(
          fmt::format("{}: weight_map['{}'] must be a shard file name", index_path, it.key()));
    }
    std::string shard = it.value().get<std::string>();
    check_shard_name(index_path, it.key(), shard);
    listed.emplace_back(it.key(), std::move(shard));
  }
  return listed;
}

SafetensorsCheckpoint SafetensorsCheckpoint::open(const std::string& path) {
  SafetensorsCheckpoint ck;
  if (path_is_file(path)) {
    ck.root_ = path_dirname(path);
    ck.shards_.push_back(SafetensorsFile::open(path));
  } else if (path_is_dir(path)) {
    ck.root_ = path;
    const std::string index_path = path_join(path, "model.safetensors.index.json");
    const std::string single = path_join(path, "model.safetensors");
    if (path_is_file(index_path)) {
      ck.sharded_ = true;
      const std::vector<std::pair<std::string, std::string>> listed =
          parse_safetensors_index(read_text_file(index_path), index_path);
      std::map<std::string, std::size_t> shard_index;
      for (const auto& [tensor, shard] : listed) {
        if (!shard_index.count(shard)) {
          const std::string shard_path = path_join(path, shard);
          if (!path_is_file(shard_path)) {
            throw FormatError(
                fmt::format("{}: shard '{}' (holding tensor '{}') does not exist in {}", index_path,
                            shard, tensor, path));
          }
          shard_index[shard] = ck.shards_.size();
          ck.shards_.push_back(SafetensorsFile::open(shard_path));
        }
      }
      for (const auto& [tensor, shard] : listed) {
        const std::size_t s = shard_index[shard];
        const SafetensorsTensor* t = ck.shards_[s].find(tensor);
        if (!t) {
          throw FormatError(
              fmt::format("{}: tensor '{}' is mapped to shard '{}', which does not contain it",
                          index_path, tensor, shard));
        }
        ck.where_[tensor] = {s, static_cast<std::size_t>(t - ck.shards_[s].tensors().data())};
      }
      // Tensors a shard holds but the index does not list, or that two shards both hold.
      for (std::size_t s = 0; s < ck.shards_.size(); ++s) {
        std::size_t unlisted = 0;
        std::string first_unlisted;
        for (const auto& t : ck.shards_[s].tensors()) {
          auto it = ck.where_.find(t.name);
          if (it == ck.where_.end()) {
            if (unlisted++ == 0) first_unlisted = t.name;
          } else if (it->second.first != s) {
            throw FormatError(
                fmt::format("{}: tensor '{}' is stored in both {} and {} (the index names {})",
                            path, t.name, ck.shards_[it->second.first].path(), ck.shards_[s].path(),
                            ck.shards_[it->second.first].path()));
          }
        }
        if (unlisted) {
          log_warning(fmt::format(
              "{}: {} tensor(s) are not listed in the index and are ignored (first: '{}')",
              ck.shards_[s].path(), unlisted, first_unlisted));
        }
      }
      return ck;
    } else if (path_is_file(single)) {
      ck.shards_.push_back(SafetensorsFile::open(single));
    } else {
      const auto found = list_safetensors(path);
      std::string hint;
      if (!found.empty()) {
        hint = fmt::format(" (found {} other .safetensors file(s), e.g. {}; pass one directly)",
                           found.size(), found.front());
      }
      throw FormatError(
          fmt::format("{}: no model.safetensors.index.json or model.safetensors{}", path, hint));
    }
  } else {
    throw ValueError(fmt::format("{}: no such file or directory", path));
  }
  // Single file: every tensor it holds.
  const auto& ts = ck.shards_[0].tensors();
  for (std::size_t i = 0; i < ts.size(); ++i) ck.where_[ts[i].name] = {0, i};
  return ck;
}

const SafetensorsTensor* SafetensorsCheckpoint::find(std::string_view name) const {
  auto it = where_.find(name);
  if (it == where_.end()) return nullptr;
  return &shards_[it->second.first].tensors()[it->second.second];
}

const SafetensorsTensor& SafetensorsCheckpoint::at(std::string_view name) const {
  const SafetensorsTensor* t = find(name);
  if (!t)
    throw FormatError(fmt::format("{}: the checkpoint has no tensor named '{}'", root_, name));
  return *t;
}

const SafetensorsFile& SafetensorsCheckpoint::shard_of(std::string_view name) const {
  auto it = where_.find(name);
  if (it == where_.end()) {
    throw FormatError(fmt::format("{}: the checkpoint has no tensor named '{}'", root_, name));
  }
  return shards_[it->second.first];
}

std::span<const uint8_t> SafetensorsCheckpoint::data(std::string_view name) const {
  const SafetensorsFile& f = shard_of(name);
  return f.data(f.at(name));
}

uint64_t SafetensorsCheckpoint::total_data_bytes() const {
  uint64_t n = 0;
  for (const auto& [name, loc] : where_) n += shards_[loc.first].tensors()[loc.second].nbytes();
  return n;
}

bool SafetensorsCheckpoint::any_data_mapped() const {
  return std::any_of(shards_.begin(), shards_.end(),
                     [](const SafetensorsFile& f) { return f.data_mapped(); });
}

std::vector<std::string> SafetensorsCheckpoint::tensor_names() const {
  std::vector<std::string> out;
  out.reserve(where_.size());
  for (const auto& [name, loc] : where_) out.push_back(name);
  return out;
}

}  // namespace fp8moe
