// One logging family for every process: level, UTC time, component context ("coordinator",
// "agent node-1"), written to stderr one whole line at a time.
#pragma once

#include <cstdint>
#include <sstream>
#include <string>
#include <string_view>

namespace ltrain {

enum class LogLevel { kDebug = 0, kInfo = 1, kWarning = 2, kError = 3 };

void SetLogLevel(LogLevel level);
LogLevel GetLogLevel();
// Parses debug|info|warning|error; false when the name is unknown.
bool ParseLogLevel(const std::string& name, LogLevel* level);

// `text` as it may be shown on a terminal: control characters (escape sequences, carriage returns,
// newlines unless `keep_newlines`; tabs stay), DEL, the C1 controls and bytes that are not UTF-8 are
// written as \xNN, so that what a worker prints or a recipe holds cannot move the cursor, recolour or
// forge lines.
std::string TerminalSafe(std::string_view text, bool keep_newlines = false);
// `text` with every byte that is not part of a valid UTF-8 sequence replaced by U+FFFD: what a
// protobuf string field may carry (the receiver refuses a message with invalid UTF-8).
std::string ValidUtf8(std::string_view text);
// The length of the longest prefix of `text` of at most `max_bytes` that does not cut a UTF-8
// sequence (of valid UTF-8 text).
size_t Utf8Prefix(std::string_view text, size_t max_bytes);
// A line as it may travel and be stored: ValidUtf8(text), and past `max_bytes` cut (never inside a
// character) with " [... N more bytes]", or " [... N more bytes in WHERE]" where the rest is kept.
std::string BoundedLine(std::string_view text, size_t max_bytes, const std::string& where = "");

// `unix_ms` in UTC as strftime(3)'s `format` writes it (whole seconds), then ".mmm" of its
// milliseconds where `with_ms`: "2026-12-06T09:02:25Z", "09:02:25.123".
std::string UtcTime(int64_t unix_ms, const char* format, bool with_ms = false);

class LogMessage {
 public:
  LogMessage(LogLevel level, const char* component);
  ~LogMessage();
  std::ostringstream& stream() { return stream_; }

 private:
  LogLevel level_;
  const char* component_;
  std::ostringstream stream_;
};

}  // namespace ltrain

namespace ltrain {
// Lets the macro below be one expression, so it is safe inside an unbraced if.
struct LogVoidify {
  void operator&(std::ostream&) {}
};
}  // namespace ltrain

// LTRAIN_LOG(kInfo, "coordinator") << "job " << id << " placed";
#define LTRAIN_LOG(level, component)                                   \
  (::ltrain::LogLevel::level < ::ltrain::GetLogLevel())                \
      ? (void)0                                                        \
      : ::ltrain::LogVoidify() & ::ltrain::LogMessage(::ltrain::LogLevel::level, component).stream()
