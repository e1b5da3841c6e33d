// One small logger. Level from FP8MOE_LOG_LEVEL (debug, info, warning, error, off; default warning)
// or set_log_level(). info_once/debug_once print a given message at most once per process, as
// vLLM's logger.info_once does; never call the logger per forward call.
#pragma once

#include <functional>
#include <string>
#include <string_view>

namespace fp8moe {

enum class LogLevel : int { kDebug = 0, kInfo = 1, kWarning = 2, kError = 3, kOff = 4 };

void set_log_level(LogLevel level);
LogLevel log_level();
// Replaces the sink (default: "fp8moe <LEVEL>: message" on stderr). Pass nullptr to restore it.
void set_log_sink(std::function<void(LogLevel, std::string_view)> sink);
// Forgets which *_once messages were printed (tests).
void reset_log_once();

void log(LogLevel level, std::string_view message);
void log_debug(std::string_view message);
void log_info(std::string_view message);
void log_warning(std::string_view message);
void log_error(std::string_view message);
void info_once(std::string_view message);
void debug_once(std::string_view message);
void warning_once(std::string_view message);

}  // namespace fp8moe
