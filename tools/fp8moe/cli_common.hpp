// Shared pieces of the fp8moe command line: the --json flag state and how errors are reported.
#pragma once

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <iostream>
#include <string>

namespace fp8moe::cli {

// Set by a subcommand's --json flag; decides how main() reports an error.
inline bool& json_output() {
  static bool v = false;
  return v;
}

// The exit status main() returns after a successful parse: a subcommand sets it to say "the answer
// is no" (e.g. `plan` for a deployment that does not work: 1) without raising an error (2).
inline int& exit_status() {
  static int v = 0;
  return v;
}

// Prints a JSON document followed by a newline.
inline void print_json(const nlohmann::json& j) { std::cout << j.dump(2) << "\n"; }

// Each room adds its subcommands here (one function per file, called from main()).
void add_oracle_commands(CLI::App& app);
void add_checkpoint_commands(CLI::App& app);
void add_run_commands(CLI::App& app);

}  // namespace fp8moe::cli
