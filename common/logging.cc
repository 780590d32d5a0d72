#include "common/logging.h"

#include <atomic>
#include <chrono>
#include <cstdio>
#include <ctime>

namespace ltrain {
namespace {
std::atomic<int> g_level{static_cast<int>(LogLevel::kInfo)};
}

void SetLogLevel(LogLevel level) { g_level = static_cast<int>(level); }
LogLevel GetLogLevel() { return static_cast<LogLevel>(g_level.load()); }

bool ParseLogLevel(const std::string& name, LogLevel* level) {
  if (name == "debug") *level = LogLevel::kDebug;
  else if (name == "info") *level = LogLevel::kInfo;
  else if (name == "warning") *level = LogLevel::kWarning;
  else if (name == "error") *level = LogLevel::kError;
  else return false;
  return true;
}

LogMessage::LogMessage(LogLevel level, const char* component) : level_(level), component_(component) {}

LogMessage::~LogMessage() {
  static const char kLetters[] = {'D', 'I', 'W', 'E'};
  auto now = std::chrono::system_clock::now();
  std::time_t seconds = std::chrono::system_clock::to_time_t(now);
  int millis = static_cast<int>(
      std::chrono::duration_cast<std::chrono::milliseconds>(now.time_since_epoch()).count() % 1000);
  std::tm tm{};
  gmtime_r(&seconds, &tm);
  char stamp[32];
  std::strftime(stamp, sizeof(stamp), "%Y-%m-%dT%H:%M:%S", &tm);
  std::string line = std::string(1, kLetters[static_cast<int>(level_)]) + " " + stamp + "." +
                     (millis < 100 ? (millis < 10 ? "00" : "0") : "") + std::to_string(millis) + "Z " +
                     component_ + "] " + stream_.str() + "\n";
  std::fwrite(line.data(), 1, line.size(), stderr);
}

}  // namespace ltrain
