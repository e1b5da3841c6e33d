// The safetensors reader: header validation (length bound, JSON, dtypes, shapes, offsets that tile
// the data region exactly) and read-only memory mapping of tensor bytes on first access.
#include <fcntl.h>
#include <fmt/format.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <mutex>
#include <nlohmann/json.hpp>
#include <numeric>
#include <set>
#include <unordered_map>

#include "checkpoint/checkpoint_internal.hpp"
#include "fp8moe/checkpoint.hpp"
#include "fp8moe/error.hpp"

namespace fp8moe {

using json = nlohmann::ordered_json;

namespace {

struct DTypeInfo {
  std::string_view name;
  int bits;
  std::optional<DType> dtype;
};

// Every dtype the reference implementation knows (0.5.x and later).
constexpr DTypeInfo kDTypes[] = {
    {"BOOL", 8, DType::kBool},
    {"U8", 8, DType::kU8},
    {"I8", 8, DType::kI8},
    {"F8_E5M2", 8, DType::kF8E5M2},
    {"F8_E4M3", 8, DType::kF8E4M3FN},
    {"F8_E8M0", 8, DType::kF8E8M0FNU},
    {"I16", 16, std::nullopt},
    {"U16", 16, std::nullopt},
    {"F16", 16, DType::kF16},
    {"BF16", 16, DType::kBF16},
    {"I32", 32, DType::kI32},
    {"U32", 32, std::nullopt},
    {"F32", 32, DType::kF32},
    {"F64", 64, DType::kF64},
    {"I64", 64, DType::kI64},
    {"U64", 64, std::nullopt},
    {"C64", 64, std::nullopt},
    {"F4", 4, std::nullopt},
    {"F6_E2M3", 6, std::nullopt},
    {"F6_E3M2", 6, std::nullopt},
};

std::string known_dtype_list() {
  std::string s;
  for (const auto& d : kDTypes) s += fmt::format("{}{}", s.empty() ? "" : ", ", d.name);
  return s;
}

// Keeps error messages short when they quote a value from the file.
std::string quote_json(const json& v) {
  std::string s = v.dump(-1, ' ', true, json::error_handler_t::replace);
  if (s.size() > 80) s = s.substr(0, 77) + "...";
  return s;
}

struct HeaderAbort {
  std::string message;
};

constexpr int kMaxJsonDepth = 64;

}  // namespace

int safetensors_dtype_bits(std::string_view name) {
  for (const auto& d : kDTypes) {
    if (d.name == name) return d.bits;
  }
  return 0;
}

std::optional<DType> safetensors_to_dtype(std::string_view name) {
  for (const auto& d : kDTypes) {
    if (d.name == name) return d.dtype;
  }
  return std::nullopt;
}

std::string_view dtype_to_safetensors(DType t) {
  for (const auto& d : kDTypes) {
    if (d.dtype == t) return d.name;
  }
  throw ValueError(fmt::format("safetensors has no dtype for {}", dtype_torch_name(t)));
}

int64_t SafetensorsTensor::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::string SafetensorsTensor::shape_str() const { return shape_to_string(shape); }

std::string shape_to_string(std::span<const int64_t> shape) {
  std::string s = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) s += fmt::format("{}{}", i ? ", " : "", shape[i]);
  return s + "]";
}

// ---- header parsing
// ---------------------------------------------------------------------------------

ParsedSafetensorsHeader parse_safetensors_header(std::span<const uint8_t> prefix,
                                                 uint64_t file_size, const std::string& file) {
  ParsedSafetensorsHeader out;
  if (file_size < 8) {
    throw FormatError(fmt::format(
        "{}: file is {} bytes, too small for a safetensors file (an 8-byte header length comes "
        "first)",
        file, file_size));
  }
  if (prefix.size() < 8)
    throw FormatError(fmt::format("{}: could not read the header length", file));
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | prefix[i];
  if (n > kSafetensorsMaxHeaderBytes) {
    throw FormatError(
        fmt::format("{}: header length {} exceeds the limit of {} bytes (not a safetensors file?)",
                    file, n, kSafetensorsMaxHeaderBytes));
  }
  if (n > file_size - 8) {
    throw FormatError(fmt::format(
        "{}: header length {} runs past the end of the file ({} bytes, so at most {} header bytes)",
        file, n, file_size, file_size - 8));
  }
  if (n < 2) {
    throw FormatError(fmt::format("{}: header of {} bytes cannot hold a JSON object", file, n));
  }
  if (prefix.size() < 8 + n) throw FormatError(fmt::format("{}: could not read the header", file));
  out.header_size = n;
  const uint64_t data_len = file_size - 8 - n;
  const char* text = reinterpret_cast<const char*>(prefix.data() + 8);
  if (text[0] != '{') {
    throw FormatError(
        fmt::format("{}: the header must start with '{{' (a JSON object), found byte 0x{:02x}",
                    file, static_cast<unsigned>(static_cast<unsigned char>(text[0]))));
  }

  // Parse, rejecting duplicate top-level names (the format forbids them; JSON libraries would keep
  // the last one silently) and absurd nesting.
  std::set<std::string, std::less<>> seen;
  json header;
  try {
    header = json::parse(text, text + n, [&](int depth, json::parse_event_t event, json& parsed) {
      if (depth > kMaxJsonDepth) {
        throw HeaderAbort{fmt::format("JSON nesting deeper than {} levels", kMaxJsonDepth)};
      }
      if (event == json::parse_event_t::key && depth == 1) {
        std::string key = parsed.get<std::string>();
        if (!seen.insert(key).second) {
          throw HeaderAbort{fmt::format("tensor '{}' appears twice in the header", key)};
        }
      }
      return true;
    });
  } catch (const HeaderAbort& e) {
    throw FormatError(fmt::format("{}: invalid header: {}", file, e.message));
  } catch (const json::exception& e) {
    throw FormatError(fmt::format("{}: header is not valid JSON: {}", file, e.what()));
  }
  if (!header.is_object()) {
    throw FormatError(fmt::format("{}: the header must be a JSON object", file));
  }

  for (auto it = header.begin(); it != header.end(); ++it) {
    const std::string& name = it.key();
    const json& v = it.value();
    if (name == "__metadata__") {
      if (!v.is_object()) {
        throw FormatError(fmt::format("{}: __metadata__ must be an object of strings, got {}", file,
                                      quote_json(v)));
      }
      for (auto m = v.begin(); m != v.end(); ++m) {
        if (!m.value().is_string()) {
          throw FormatError(fmt::format("{}: __metadata__['{}'] must be a string, got {}", file,
                                        m.key(), quote_json(m.value())));
        }
        out.metadata[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    const std::string where = fmt::format("{}: tensor '{}'", file, name);
    if (!v.is_object()) {
      throw FormatError(
          fmt::format("{}: expected an object with dtype, shape and data_offsets, got {}", where,
                      quote_json(v)));
    }
    SafetensorsTensor t;
    t.name = name;
    // dtype
    auto d = v.find("dtype");
    if (d == v.end() || !d->is_string()) {
      throw FormatError(fmt::format("{}: missing or non-string \"dtype\"", where));
    }
    t.dtype_name = d->get<std::string>();
    const int bits = safetensors_dtype_bits(t.dtype_name);
    if (bits == 0) {
      throw FormatError(fmt::format("{}: unknown dtype \"{}\" (expected one of {})", where,
                                    t.dtype_name, known_dtype_list()));
    }
    t.dtype = safetensors_to_dtype(t.dtype_name);
    // shape
    auto s = v.find("shape");
    if (s == v.end() || !s->is_array()) {
      throw FormatError(
          fmt::format("{}: missing \"shape\" (an array of non-negative integers)", where));
    }
    uint64_t numel = 1;
    bool overflow = false;
    for (const json& dim : *s) {
      if (!dim.is_number_unsigned()) {
        throw FormatError(fmt::format("{}: shape {} holds {}, expected non-negative integers",
                                      where, quote_json(*s), quote_json(dim)));
      }
      const uint64_t x = dim.get<uint64_t>();
      if (x > static_cast<uint64_t>(INT64_MAX)) overflow = true;
      uint64_t next = 0;
      if (__builtin_mul_overflow(numel, x, &next)) overflow = true;
      numel = next;
      t.shape.push_back(static_cast<int64_t>(x));
    }
    uint64_t bits_total = 0;
    if (overflow || numel > static_cast<uint64_t>(INT64_MAX) ||
        __builtin_mul_overflow(numel, static_cast<uint64_t>(bits), &bits_total)) {
      throw FormatError(fmt::format("{}: shape {} is too large (its byte size overflows 64 bits)",
                                    where, quote_json(*s)));
    }
    if (bits_total % 8 != 0) {
      throw FormatError(fmt::format("{}: {} elements of {} ({} bits each) do not fill whole bytes",
                                    where, numel, t.dtype_name, bits));
    }
    const uint64_t expected_bytes = bits_total / 8;
    // data_offsets
    auto o = v.find("data_offsets");
    if (o == v.end() || !o->is_array() || o->size() != 2 || !(*o)[0].is_number_unsigned() ||
        !(*o)[1].is_number_unsigned()) {
      throw FormatError(fmt::format(
          "{}: \"data_offsets\" must be [begin, end] with non-negative integers, got {}", where,
          o == v.end() ? std::string("nothing") : quote_json(*o)));
    }
    t.begin = (*o)[0].get<uint64_t>();
    t.end = (*o)[1].get<uint64_t>();
    if (t.end < t.begin) {
      throw FormatError(
          fmt::format("{}: data_offsets [{}, {}) end before they begin", where, t.begin, t.end));
    }
    if (t.end > data_len) {
      throw FormatError(
          fmt::format("{}: data_offsets [{}, {}) run past the end of the data region ({} bytes)",
                      where, t.begin, t.end, data_len));
    }
    if (t.end - t.begin != expected_bytes) {
      throw FormatError(fmt::format(
          "{}: data_offsets [{}, {}) span {} bytes, but shape {} of {} needs {} bytes", where,
          t.begin, t.end, t.end - t.begin, t.shape_str(), t.dtype_name, expected_bytes));
    }
    out.tensors.push_back(std::move(t));
  }

  // The tensors must tile the data region: sorted by offset, each starts where the previous ended.
  std::vector<std::size_t> order(out.tensors.size());
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
    const auto& x = out.tensors[a];
    const auto& y = out.tensors[b];
    return std::tie(x.begin, x.end, x.name) < std::tie(y.begin, y.end, y.name);
  });
  uint64_t covered = 0;
  const SafetensorsTensor* prev = nullptr;
  for (std::size_t i : order) {
    const auto& t = out.tensors[i];
    if (t.begin < covered) {
      throw FormatError(
          fmt::format("{}: tensors '{}' [{}, {}) and '{}' [{}, {}) overlap in the data region",
                      file, prev->name, prev->begin, prev->end, t.name, t.begin, t.end));
    }
    if (t.begin > covered) {
      throw FormatError(fmt::format(
          "{}: bytes [{}, {}) of the data region belong to no tensor (before '{}'); the format "
          "forbids holes",
          file, covered, t.begin, t.name));
    }
    covered = t.end;
    if (t.end > t.begin || !prev) prev = &t;
  }
  if (covered != data_len) {
    throw FormatError(fmt::format(
        "{}: the data region holds {} bytes but the tensors cover only {} (trailing bytes are not "
        "allowed)",
        file, data_len, covered));
  }
  return out;
}

// ---- SafetensorsFile
// --------------------------------------------------------------------------------

struct SafetensorsFile::Impl {
  std::string path;
  uint64_t file_size = 0;
  uint64_t header_size = 0;
  std::vector<SafetensorsTensor> tensors;
  std::unordered_map<std::string, std::size_t> index;
  std::map<std::string, std::string> metadata;
  std::vector<uint8_t> memory;  // parse(): the whole file
  mutable std::mutex map_mutex;
  mutable const uint8_t* mapped = nullptr;
  mutable std::size_t mapped_len = 0;
  mutable bool data_touched = false;

  ~Impl() {
    if (mapped && memory.empty()) munmap(const_cast<uint8_t*>(mapped), mapped_len);
  }

  void build_index() {
    for (std::size_t i = 0; i < tensors.size(); ++i) index.emplace(tensors[i].name, i);
  }

  const uint8_t* base() const {
    std::lock_guard<std::mutex> lock(map_mutex);
    data_touched = true;
    if (!memory.empty()) return memory.data();
    if (mapped) return mapped;
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
      throw RuntimeError(fmt::format("{}: cannot open: {}", path, std::strerror(errno)));
    }
    struct stat st {};
    if (fstat(fd, &st) != 0 || static_cast<uint64_t>(st.st_size) != file_size) {
      ::close(fd);
      throw RuntimeError(fmt::format("{}: the file changed size since its header was read", path));
    }
    void* p = mmap(nullptr, file_size, PROT_READ, MAP_SHARED, fd, 0);
    const int err = errno;
    ::close(fd);
    if (p == MAP_FAILED) {
      throw RuntimeError(
          fmt::format("{}: mmap of {} bytes failed: {}", path, file_size, std::strerror(err)));
    }
    mapped = static_cast<const uint8_t*>(p);
    mapped_len = file_size;
    return mapped;
  }
};

SafetensorsFile SafetensorsFile::open(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    throw ValueError(fmt::format("{}: {}", path, std::strerror(errno)));
  }
  if (!S_ISREG(st.st_mode)) {
    throw FormatError(fmt::format("{}: not a regular file", path));
  }
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw RuntimeError(fmt::format("{}: cannot open: {}", path, std::strerror(errno)));
  auto read_at = [&](uint8_t* dst, uint64_t len, uint64_t off) {
    uint64_t done = 0;
    while (done < len) {
      const ssize_t r = ::pread(fd, dst + done, len - done, static_cast<off_t>(off + done));
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0) {
        const int err = errno;
        ::close(fd);
        throw RuntimeError(fmt::format("{}: read failed at byte {}: {}", path, off + done,
                                       r == 0 ? "unexpected end of file" : std::strerror(err)));
      }
      done += static_cast<uint64_t>(r);
    }
  };
  std::vector<uint8_t> prefix(std::min<uint64_t>(size, 8));
  read_at(prefix.data(), prefix.size(), 0);
  // Validate the length before reading that many bytes.
  ParsedSafetensorsHeader header;
  if (size >= 8) {
    uint64_t n = 0;
    for (int i = 7; i >= 0; --i) n = (n << 8) | prefix[i];
    if (n <= kSafetensorsMaxHeaderBytes && n <= size - 8) {
      prefix.resize(8 + n);
      read_at(prefix.data() + 8, n, 8);
    }
  }
  ::close(fd);
  header = parse_safetensors_header(prefix, size, path);

  SafetensorsFile f;
  f.impl_ = std::make_shared<Impl>();
  f.impl_->path = path;
  f.impl_->file_size = size;
  f.impl_->header_size = header.header_size;
  f.impl_->tensors = std::move(header.tensors);
  f.impl_->metadata = std::move(header.metadata);
  f.impl_->build_index();
  return f;
}

SafetensorsFile SafetensorsFile::parse(std::span<const uint8_t> bytes, const std::string& name) {
  ParsedSafetensorsHeader header = parse_safetensors_header(bytes, bytes.size(), name);
  SafetensorsFile f;
  f.impl_ = std::make_shared<Impl>();
  f.impl_->path = name;
  f.impl_->file_size = bytes.size();
  f.impl_->header_size = header.header_size;
  f.impl_->tensors = std::move(header.tensors);
  f.impl_->metadata = std::move(header.metadata);
  f.impl_->memory.assign(bytes.begin(), bytes.end());
  if (f.impl_->memory.empty()) f.impl_->memory.push_back(0);  // unreachable: size >= 8 checked
  f.impl_->build_index();
  return f;
}

namespace {
const std::string kEmpty;
const std::vector<SafetensorsTensor> kNoTensors;
const std::map<std::string, std::string> kNoMetadata;
}  // namespace

const std::string& SafetensorsFile::path() const { return impl_ ? impl_->path : kEmpty; }
uint64_t SafetensorsFile::file_size() const { return impl_ ? impl_->file_size : 0; }
uint64_t SafetensorsFile::header_size() const { return impl_ ? impl_->header_size : 0; }
const std::vector<SafetensorsTensor>& SafetensorsFile::tensors() const {
  return impl_ ? impl_->tensors : kNoTensors;
}
const std::map<std::string, std::string>& SafetensorsFile::metadata() const {
  return impl_ ? impl_->metadata : kNoMetadata;
}

const SafetensorsTensor* SafetensorsFile::find(std::string_view name) const {
  if (!impl_) return nullptr;
  auto it = impl_->index.find(std::string(name));
  return it == impl_->index.end() ? nullptr : &impl_->tensors[it->second];
}

const SafetensorsTensor& SafetensorsFile::at(std::string_view name) const {
  const SafetensorsTensor* t = find(name);
  if (!t) throw FormatError(fmt::format("{}: no tensor named '{}'", path(), name));
  return *t;
}

std::span<const uint8_t> SafetensorsFile::data(const SafetensorsTensor& t) const {
  if (!impl_) throw ValueError("SafetensorsFile::data on an empty file object");
  const uint8_t* base = impl_->base();
  return {base + data_offset() + t.begin, static_cast<std::size_t>(t.nbytes())};
}

bool SafetensorsFile::data_mapped() const {
  if (!impl_) return false;
  std::lock_guard<std::mutex> lock(impl_->map_mutex);
  return impl_->data_touched;
}

}  // namespace fp8moe
