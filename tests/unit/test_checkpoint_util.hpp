// Helpers shared by the checkpoint tests: a temporary directory, raw safetensors bytes, and an
// assertion that a call throws a given error kind whose message holds given fragments.
#pragma once

#include <ftw.h>
#include <gtest/gtest.h>
#include <stdlib.h>

#include <cstdint>
#include <fstream>
#include <string>
#include <vector>

#include "fp8moe/error.hpp"

namespace fp8moe::test {

class TempDir {
 public:
  TempDir() {
    const char* base = std::getenv("TMPDIR");
    std::string tmpl = std::string(base && *base ? base : "/tmp") + "/fp8moe_ckpt_XXXXXX";
    std::vector<char> buf(tmpl.begin(), tmpl.end());
    buf.push_back('\0');
    if (!mkdtemp(buf.data())) throw std::runtime_error("mkdtemp failed");
    path_ = buf.data();
  }
  ~TempDir() {
    nftw(
        path_.c_str(),
        [](const char* p, const struct stat*, int, struct FTW*) { return ::remove(p); }, 16,
        FTW_DEPTH | FTW_PHYS);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }
  std::string file(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

inline void write_bytes(const std::string& path, const std::vector<uint8_t>& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(bytes.data()),
            static_cast<std::streamsize>(bytes.size()));
}

inline void write_text(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << text;
}

// 8-byte little-endian length (the header's size unless `declared` overrides it), header, data.
inline std::vector<uint8_t> raw_safetensors(const std::string& header, std::size_t data_bytes,
                                            int64_t declared = -1, uint8_t fill = 0xAB) {
  std::vector<uint8_t> out;
  const uint64_t n = declared >= 0 ? static_cast<uint64_t>(declared) : header.size();
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<uint8_t>((n >> (8 * i)) & 0xff));
  out.insert(out.end(), header.begin(), header.end());
  out.insert(out.end(), data_bytes, fill);
  return out;
}

// Runs `fn`, expecting an exception of type E whose message contains every fragment.
template <class E, class Fn>
::testing::AssertionResult throws_with(Fn&& fn, std::initializer_list<std::string> fragments) {
  try {
    fn();
  } catch (const E& e) {
    const std::string msg = e.what();
    for (const auto& f : fragments) {
      if (msg.find(f) == std::string::npos) {
        return ::testing::AssertionFailure() << "message \"" << msg << "\" lacks \"" << f << "\"";
      }
    }
    return ::testing::AssertionSuccess();
  } catch (const std::exception& e) {
    return ::testing::AssertionFailure() << "threw another exception: " << e.what();
  }
  return ::testing::AssertionFailure() << "did not throw";
}

}  // namespace fp8moe::test
