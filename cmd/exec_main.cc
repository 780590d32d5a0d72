// ltrain-exec [--env NAME=VALUE]... -- PROGRAM ARGS...: a user's program as one rank, started by the
// agent for a recipe with entrypoint.command; see worker/control/run_program.h.
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include "common/worker_exit.h"
#include "worker/control/run_program.h"

int main(int argc, char** argv) {
  std::string error;
  std::optional<ltrain::worker::ExecArgs> args =
      ltrain::worker::ParseExecArgs(std::vector<std::string>(argv + 1, argv + argc), error);
  if (!args) {
    std::fprintf(stderr, "ltrain-exec: %s\n", error.c_str());
    return ltrain::kWorkerExitUsage;
  }
  return ltrain::worker::RunProgram(*args);
}
