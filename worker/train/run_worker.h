// The worker process's entry point, kept in the library so that cmd/worker_main.cc stays a thin
// main. One process is one rank; its agent starts it with the environment below.
#pragma once

#include <string>
#include <vector>

#include "common/status.h"

namespace ltrain::worker {

// The environment an agent gives a worker (see --help), after flags override it.
struct WorkerEnv {
  std::string job_id;
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
  int generation = 0;
  std::string recipe_file;
  std::vector<std::string> overrides;  // --set key=value
  std::string rdzv;                    // grpc://HOST:PORT or file:///DIR
  std::string rdzv_scope;
  std::string checkpoint_dir;          // overrides the recipe's checkpoint.dir when set
  std::string bind_addr = "127.0.0.1";
  std::string export_params;           // --export-params FILE
  bool help = false;
};

// Reads LTRAIN_* from the environment, then applies flags (--recipe FILE, --set k=v, --help).
StatusOr<WorkerEnv> ParseWorkerEnv(int argc, char** argv);

std::string WorkerUsage();

// Runs one rank to completion. Returns the process exit code: 0 done, 1 failed (message on stderr),
// 2 bad usage.
int RunWorker(int argc, char** argv);

}  // namespace ltrain::worker
