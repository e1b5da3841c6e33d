// Replays the fuzz seed corpora and every recorded crash (tests/fuzz/regressions) through the same
// parsers the libFuzzer targets drive, so a fixed crash stays fixed in the normal and sanitizer
// builds. Each input must parse or raise fp8moe::Error.
#include <dirent.h>
#include <gtest/gtest.h>

#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "fp8moe/checkpoint.hpp"
#include "fp8moe/error.hpp"

namespace fp8moe {
namespace {

std::vector<std::string> files_in(const std::string& dir) {
  std::vector<std::string> out;
  if (DIR* d = opendir(dir.c_str())) {
    while (dirent* e = readdir(d)) {
      const std::string n = e->d_name;
      if (n[0] != '.' && n != "README.md") out.push_back(dir + "/" + n);
    }
    closedir(d);
  }
  return out;
}

std::string slurp(const std::string& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::vector<std::string> inputs(const std::string& target) {
  const std::string root = std::string(FP8MOE_SOURCE_DIR) + "/tests/fuzz/";
  auto a = files_in(root + "corpus/" + target);
  auto b = files_in(root + "regressions/" + target);
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

TEST(FuzzCorpus, Safetensors) {
  const auto files = inputs("safetensors");
  EXPECT_GE(files.size(), 5u);
  int parsed = 0;
  for (const auto& f : files) {
    SCOPED_TRACE(f);
    const std::string bytes = slurp(f);
    try {
      const SafetensorsFile s = SafetensorsFile::parse(
          std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size()),
          f);
      for (const auto& t : s.tensors()) EXPECT_EQ(s.data(t).size(), t.nbytes());
      ++parsed;
    } catch (const Error&) {
    }
  }
  EXPECT_GT(parsed, 0);
}

TEST(FuzzCorpus, Config) {
  const auto files = inputs("config");
  EXPECT_GE(files.size(), 5u);
  int parsed = 0;
  for (const auto& f : files) {
    SCOPED_TRACE(f);
    const std::string text = slurp(f);
    try {
      (void)parse_quantization_config(text);
    } catch (const Error&) {
    }
    try {
      const ModelConfig m = parse_model_config(text, f);
      (void)moe_layer_ignored(m, m.moe_layers.front());
      ++parsed;
    } catch (const Error&) {
    }
  }
  EXPECT_GT(parsed, 0);
}

TEST(FuzzCorpus, Index) {
  const auto files = inputs("index");
  EXPECT_GE(files.size(), 5u);
  int parsed = 0, refused = 0;
  for (const auto& f : files) {
    SCOPED_TRACE(f);
    const std::string text = slurp(f);
    try {
      const auto listed = parse_safetensors_index(text, f);
      EXPECT_FALSE(listed.empty());
      ++parsed;
    } catch (const FormatError& e) {
      EXPECT_NE(std::string(e.what()).find(f), std::string::npos) << "the error names the file";
      ++refused;
    }
  }
  EXPECT_GT(parsed, 0);
  EXPECT_GT(refused, 0);
}

}  // namespace
}  // namespace fp8moe
