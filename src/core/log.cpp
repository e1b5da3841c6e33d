// The logger: level, sink and the *_once memory.
#include "fp8moe/log.hpp"

#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <set>
#include <string>

namespace fp8moe {
namespace {

LogLevel level_from_env() {
  const char* v = std::getenv("FP8MOE_LOG_LEVEL");
  if (!v) return LogLevel::kWarning;
  std::string s(v);
  for (auto& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (s == "debug") return LogLevel::kDebug;
  if (s == "info") return LogLevel::kInfo;
  if (s == "warning" || s == "warn") return LogLevel::kWarning;
  if (s == "error") return LogLevel::kError;
  if (s == "off" || s == "none") return LogLevel::kOff;
  std::fprintf(stderr,
               "fp8moe WARNING: FP8MOE_LOG_LEVEL='%s' is not one of debug, info, warning, "
               "error, off; using warning\n",
               v);
  return LogLevel::kWarning;
}

struct LoggerState {
  std::mutex mu;
  LogLevel level = level_from_env();
  std::function<void(LogLevel, std::string_view)> sink;
  std::set<std::string, std::less<>> seen;
};

LoggerState& state() {
  static LoggerState s;
  return s;
}

const char* level_name(LogLevel l) {
  switch (l) {
    case LogLevel::kDebug:
      return "DEBUG";
    case LogLevel::kInfo:
      return "INFO";
    case LogLevel::kWarning:
      return "WARNING";
    case LogLevel::kError:
      return "ERROR";
    default:
      return "";
  }
}

void emit(LoggerState& s, LogLevel level, std::string_view message) {
  if (s.sink) {
    s.sink(level, message);
  } else {
    std::fprintf(stderr, "fp8moe %s: %.*s\n", level_name(level), static_cast<int>(message.size()),
                 message.data());
  }
}

void log_once(LogLevel level, std::string_view message) {
  auto& s = state();
  std::lock_guard lock(s.mu);
  if (level < s.level) return;
  if (!s.seen.emplace(message).second) return;
  emit(s, level, message);
}

}  // namespace

void set_log_level(LogLevel level) {
  std::lock_guard lock(state().mu);
  state().level = level;
}
LogLevel log_level() {
  std::lock_guard lock(state().mu);
  return state().level;
}
void set_log_sink(std::function<void(LogLevel, std::string_view)> sink) {
  std::lock_guard lock(state().mu);
  state().sink = std::move(sink);
}
void reset_log_once() {
  std::lock_guard lock(state().mu);
  state().seen.clear();
}
void log(LogLevel level, std::string_view message) {
  auto& s = state();
  std::lock_guard lock(s.mu);
  if (level < s.level) return;
  emit(s, level, message);
}
void log_debug(std::string_view m) { log(LogLevel::kDebug, m); }
void log_info(std::string_view m) { log(LogLevel::kInfo, m); }
void log_warning(std::string_view m) { log(LogLevel::kWarning, m); }
void log_error(std::string_view m) { log(LogLevel::kError, m); }
void info_once(std::string_view m) { log_once(LogLevel::kInfo, m); }
void debug_once(std::string_view m) { log_once(LogLevel::kDebug, m); }
void warning_once(std::string_view m) { log_once(LogLevel::kWarning, m); }

}  // namespace fp8moe
