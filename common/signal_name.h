#pragma once

#include <string.h>

#include <string>

namespace ltrain {

// "SIGKILL" for 9; "signal 42" where the C library has no name.
inline std::string SignalName(int signal) {
  const char* abbrev = sigabbrev_np(signal);
  return abbrev ? std::string("SIG") + abbrev : "signal " + std::to_string(signal);
}

}  // namespace ltrain
