#include "common/logging.h"

#include <atomic>
#include <chrono>
#include <cstdio>
#include <ctime>

namespace ltrain {

namespace {

// The length of the valid UTF-8 sequence at text[i] (a lead byte, its continuation bytes, no
// overlong two-byte form), or 0.
size_t Utf8SequenceAt(std::string_view text, size_t i) {
  const auto c = static_cast<unsigned char>(text[i]);
  if (c < 0x80) return 1;
  const size_t n = c >= 0xc2 && c <= 0xdf ? 2 : c >= 0xe0 && c <= 0xef ? 3 : c >= 0xf0 && c <= 0xf4 ? 4 : 0;
  if (n == 0 || i + n > text.size()) return 0;
  for (size_t k = 1; k < n; ++k) {
    if ((static_cast<unsigned char>(text[i + k]) & 0xc0) != 0x80) return 0;
  }
  return n;
}

}  // namespace

std::string TerminalSafe(std::string_view text, bool keep_newlines) {
  std::string out;
  out.reserve(text.size());
  auto escape = [&out](unsigned char c) {
    static const char kHex[] = "0123456789abcdef";
    out += "\\x";
    out += kHex[c >> 4];
    out += kHex[c & 15];
  };
  for (size_t i = 0; i < text.size();) {
    const auto c = static_cast<unsigned char>(text[i]);
    if (c < 0x80) {
      if ((c < 0x20 && c != '\t' && !(c == '\n' && keep_newlines)) || c == 0x7f) {
        escape(c);
      } else {
        out += static_cast<char>(c);
      }
      ++i;
      continue;
    }
    // Not UTF-8, or a C1 control (U+0080..U+009F, which some terminals obey): each byte escaped.
    const size_t n = Utf8SequenceAt(text, i);
    if (n == 0 || (c == 0xc2 && static_cast<unsigned char>(text[i + 1]) < 0xa0)) {
      escape(c);
      ++i;
      continue;
    }
    out.append(text.substr(i, n));
    i += n;
  }
  return out;
}

std::string ValidUtf8(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (size_t i = 0; i < text.size();) {
    const size_t n = Utf8SequenceAt(text, i);
    if (n == 0) {
      out += "\xef\xbf\xbd";  // U+FFFD REPLACEMENT CHARACTER
      ++i;
      continue;
    }
    out.append(text.substr(i, n));
    i += n;
  }
  return out;
}

std::string BoundedLine(std::string_view text, size_t max_bytes, const std::string& where) {
  std::string line = ValidUtf8(text);
  if (line.size() <= max_bytes) return line;
  const size_t kept = Utf8Prefix(line, max_bytes);
  return line.substr(0, kept) + " [... " + std::to_string(line.size() - kept) + " more bytes" +
         (where.empty() ? "" : " in " + where) + "]";
}

size_t Utf8Prefix(std::string_view text, size_t max_bytes) {
  if (text.size() <= max_bytes) return text.size();
  size_t end = max_bytes;
  while (end > 0 && (static_cast<unsigned char>(text[end]) & 0xc0) == 0x80) --end;
  return end;
}
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

std::string UtcTime(int64_t unix_ms, const char* format, bool with_ms) {
  const std::time_t seconds = static_cast<std::time_t>(unix_ms / 1000);
  std::tm tm{};
  gmtime_r(&seconds, &tm);
  char text[64];
  size_t length = std::strftime(text, sizeof(text), format, &tm);
  if (with_ms) std::snprintf(text + length, sizeof(text) - length, ".%03d", static_cast<int>(unix_ms % 1000));
  return text;
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
