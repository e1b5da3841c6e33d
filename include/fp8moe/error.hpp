// fp8moe error types. They mirror the Python exception kinds vLLM raises, so that a caller (and the
// CLI's JSON output) can tell a ValueError from a NotImplementedError exactly as vLLM would.
#pragma once

#include <stdexcept>
#include <string>
#include <string_view>

namespace fp8moe {

// Base of every error fp8moe throws. kind() is the vLLM/Python exception name.
class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& message) : std::runtime_error(message) {}
  virtual std::string_view kind() const noexcept { return "Error"; }
};

// Bad value: unknown names, impossible shapes, unsupported explicit choices (Python ValueError).
class ValueError : public Error {
 public:
  using Error::Error;
  std::string_view kind() const noexcept override { return "ValueError"; }
};

// A valid request that no implementation covers (Python NotImplementedError).
class NotImplementedError : public Error {
 public:
  using Error::Error;
  std::string_view kind() const noexcept override { return "NotImplementedError"; }
};

// Malformed input files (checkpoints, config.json, tuning tables): names the file and the tensor.
class FormatError : public Error {
 public:
  using Error::Error;
  std::string_view kind() const noexcept override { return "FormatError"; }
};

// Failures of the machine: CUDA errors, I/O errors, allocation failures (Python RuntimeError).
class RuntimeError : public Error {
 public:
  using Error::Error;
  std::string_view kind() const noexcept override { return "RuntimeError"; }
};

}  // namespace fp8moe
