#include "agent/program_error.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

#include <nlohmann/json.hpp>

namespace ltrain::agent {
namespace {

using Json = nlohmann::json;

constexpr size_t kMaxErrorFileBytes = 256 << 10;

// A timestamp as the writers put it: a string of seconds ("1765000000"), or a number.
int64_t Seconds(const Json& value) {
  if (value.is_number_integer()) return value.get<int64_t>();
  if (value.is_number()) return static_cast<int64_t>(value.get<double>());
  if (value.is_string()) {
    const std::string& text = value.get_ref<const std::string&>();
    char* end = nullptr;
    const long long seconds = std::strtoll(text.c_str(), &end, 10);
    if (end != text.c_str() && *end == '\0') return seconds;
  }
  return 0;
}

}  // namespace

std::string ProgramErrorFileName(int rank) { return "rank-" + std::to_string(rank) + "-error.json"; }

StatusOr<v1::ProgramError> ParseProgramError(const std::string& text) {
  Json data = Json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (data.is_discarded()) return InvalidArgument("it is not JSON");
  if (!data.is_object() || !data.contains("message")) return InvalidArgument("it has no \"message\"");
  v1::ProgramError error;
  const Json& message = data["message"];
  if (message.is_string()) {
    // The older format: the message itself, the time beside it.
    error.set_message(message.get<std::string>());
    if (data.contains("timestamp")) error.set_timestamp_s(Seconds(data["timestamp"]));
  } else if (message.is_object()) {
    if (message.contains("message") && message["message"].is_string()) {
      error.set_message(message["message"].get<std::string>());
    }
    if (message.contains("extraInfo") && message["extraInfo"].is_object()) {
      const Json& extra = message["extraInfo"];
      if (extra.contains("py_callstack") && extra["py_callstack"].is_string()) {
        error.set_traceback(extra["py_callstack"].get<std::string>());
      }
      if (extra.contains("timestamp")) error.set_timestamp_s(Seconds(extra["timestamp"]));
    }
    if (message.contains("errorCode") && message["errorCode"].is_number_integer()) {
      error.set_error_code(message["errorCode"].get<int>());
    }
  } else {
    return InvalidArgument("its \"message\" is neither text nor an object");
  }
  if (error.message().empty() && error.traceback().empty()) {
    return InvalidArgument("it holds neither a message nor a traceback");
  }
  return error;
}

StatusOr<v1::ProgramError> ReadProgramError(const std::string& path) {
  // The program's own file: opened without following a link, read up to a bound.
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
  if (fd < 0) {
    if (errno == ENOENT) return NotFound("no error file at " + path);
    return Internal("cannot open " + path + ": " + std::strerror(errno));
  }
  std::string text;
  char buffer[16384];
  while (text.size() < kMaxErrorFileBytes) {
    const ssize_t n = read(fd, buffer, sizeof(buffer));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    text.append(buffer, static_cast<size_t>(n));
  }
  close(fd);
  if (text.size() >= kMaxErrorFileBytes) {
    return InvalidArgument("the error file " + path + " is larger than " + std::to_string(kMaxErrorFileBytes >> 10) +
                           " KiB");
  }
  StatusOr<v1::ProgramError> error = ParseProgramError(text);
  if (!error.ok()) return InvalidArgument("the error file " + path + " cannot be read: " + error.status().message());
  error->set_error_file(path);
  return error;
}

}  // namespace ltrain::agent
