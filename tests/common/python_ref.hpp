// Running the independent Python references (numpy, ml_dtypes) from a GoogleTest: finds the
// interpreter (FP8MOE_PYTHON, else python3), makes the pinned packages importable (PYTHONPATH, else
// <source>/.deps/python), gives each test a scratch folder under the build tree, and reads back the
// raw little-endian arrays the scripts write.
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <unistd.h>

#ifndef FP8MOE_SOURCE_DIR
#define FP8MOE_SOURCE_DIR "."
#endif
#ifndef FP8MOE_BINARY_DIR
#define FP8MOE_BINARY_DIR "."
#endif

namespace fp8moe::testing {

// A fresh scratch folder for one test, private to this process (ctest runs tests in parallel
// processes). Removed when the ScratchDir is destroyed.
class ScratchDir {
 public:
  explicit ScratchDir(const std::string& name)
      : path_(std::filesystem::path(FP8MOE_BINARY_DIR) / "test_scratch" /
              (name + "_" + std::to_string(static_cast<long>(getpid())))) {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
    std::filesystem::create_directories(path_);
  }
  ~ScratchDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

// Runs `python <source>/<script> <args>`; returns the exit status (0 = success) and the output in
// `log`.
inline int run_python(const std::string& script, const std::string& args, std::string* log) {
  const char* py = std::getenv("FP8MOE_PYTHON");
  std::string interpreter = (py && *py) ? py : "python3";
  std::string env;
  const char* pp = std::getenv("PYTHONPATH");
  if (!pp || !*pp) env = std::string("PYTHONPATH=") + FP8MOE_SOURCE_DIR + "/.deps/python ";
  const std::string cmd =
      env + "'" + interpreter + "' '" + FP8MOE_SOURCE_DIR + "/" + script + "' " + args + " 2>&1";
  FILE* f = popen(cmd.c_str(), "r");
  if (!f) return -1;
  char buf[512];
  std::string out;
  while (fgets(buf, sizeof buf, f)) out += buf;
  const int rc = pclose(f);
  if (log) *log = cmd + "\n" + out;
  return rc;
}

template <class T>
std::vector<T> read_raw(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::vector<T> v;
  if (!in) return v;
  in.seekg(0, std::ios::end);
  const auto bytes = static_cast<std::size_t>(in.tellg());
  in.seekg(0);
  v.resize(bytes / sizeof(T));
  in.read(reinterpret_cast<char*>(v.data()), static_cast<std::streamsize>(v.size() * sizeof(T)));
  return v;
}

template <class T>
bool write_raw(const std::filesystem::path& path, const std::vector<T>& v) {
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(v.data()),
            static_cast<std::streamsize>(v.size() * sizeof(T)));
  return static_cast<bool>(out);
}

}  // namespace fp8moe::testing
