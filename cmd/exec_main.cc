// ltrain-exec [--env NAME=VALUE]... -- PROGRAM ARGS...: a user's program as one rank, started by the
// agent for a recipe with entrypoint.command; see worker/control/run_program.h.
#include <sys/stat.h>

#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>
#include <vector>

#include "common/worker_exit.h"
#include "worker/control/run_program.h"

int main(int argc, char** argv) {
  // The program runs with the umask its user started ltrain with (the agent's own is private).
  if (const char* mask = std::getenv("LTRAIN_USER_UMASK"); mask != nullptr && *mask != '\0') {
    char* end = nullptr;
    const unsigned long value = std::strtoul(mask, &end, 8);
    if (*end == '\0' && value <= 0777) ::umask(static_cast<mode_t>(value));
  }
  std::string error;
  std::optional<ltrain::worker::ExecArgs> args =
      ltrain::worker::ParseExecArgs(std::vector<std::string>(argv + 1, argv + argc), error);
  if (!args) {
    std::fprintf(stderr, "ltrain-exec: %s\n", error.c_str());
    return ltrain::kWorkerExitUsage;
  }
  return ltrain::worker::RunProgram(*args);
}
