// fp8moe: the command-line tool. Errors are caught here: one clear line (or a JSON object with
// --json) and exit status 2. The library never exits.
#include <CLI/CLI.hpp>

#include <exception>
#include <iostream>

#include "cli_common.hpp"
#include "fp8moe/error.hpp"

int main(int argc, char** argv) {
  CLI::App app{"fp8moe: which FP8 MoE kernel runs this deployment, why, and how fast"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "fp8moe 0.1.0");
  fp8moe::cli::add_oracle_commands(app);
  fp8moe::cli::add_checkpoint_commands(app);
  fp8moe::cli::add_run_commands(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;
  } catch (const fp8moe::Error& e) {
    if (fp8moe::cli::json_output()) {
      fp8moe::cli::print_json({{"error", std::string(e.kind())}, {"message", e.what()}});
    } else {
      std::cerr << "fp8moe: " << e.kind() << ": " << e.what() << "\n";
    }
    return 2;
  } catch (const std::exception& e) {
    if (fp8moe::cli::json_output()) {
      fp8moe::cli::print_json({{"error", "InternalError"}, {"message", e.what()}});
    } else {
      std::cerr << "fp8moe: internal error: " << e.what() << "\n";
    }
    return 3;
  }
  return fp8moe::cli::exit_status();
}
