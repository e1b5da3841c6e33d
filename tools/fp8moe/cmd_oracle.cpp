// fp8moe oracle subcommands (placeholder until the room that owns them fills it in).
#include "cli_common.hpp"

namespace fp8moe::cli {
void add_oracle_commands(CLI::App& app) { (void)app; }
}  // namespace fp8moe::cli
