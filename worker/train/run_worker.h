// The worker process's entry point, kept in the library so that cmd/worker_main.cc stays a thin
// main. One process is one rank; its agent starts it with the environment below.
#pragma once

#include <string>

#include "worker/control/worker_env.h"

namespace ltrain::worker {

std::string WorkerUsage();

// Runs one rank to completion. Returns the process exit code: 0 done, 1 failed (message on stderr),
// 2 bad usage.
int RunWorker(int argc, char** argv);

}  // namespace ltrain::worker
