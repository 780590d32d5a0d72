// What an agent tells a worker process: the LTRAIN_* environment (and the flags that override it),
// and the recipe file it points at. No LibTorch: the agent's tests read a worker's environment and
// recipe the way the worker does, without starting one.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "common/recipe.h"
#include "common/status.h"

namespace ltrain::worker {

// The environment an agent gives a worker (see ltrain-worker --help), after flags override it.
struct WorkerEnv {
  std::string job_id;
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
  int generation = 0;
  // LTRAIN_EPOCH: the membership of the generation this rank joins (fault.recovery: in_place); above
  // 0, the rank replaces a failed one and takes its training state from a peer.
  int epoch = 0;
  int64_t committed_step = 0;          // LTRAIN_COMMITTED_STEP: the job's newest commit the coordinator recorded
  std::string recipe_file;
  std::vector<std::string> overrides;  // --set key=value
  std::string rdzv;                    // grpc://HOST:PORT or file:///DIR
  std::string rdzv_scope;
  std::string checkpoint_dir;          // overrides the recipe's checkpoint.dir when set
  std::string agent;                   // HOST:PORT of the agent's WorkerService (progress reports)
  std::string agent_secret;            // read from LTRAIN_AGENT_SECRET_FILE: what the agent asks of its workers
  std::string bind_addr = "127.0.0.1";
  std::string export_params;           // --export-params FILE
  bool help = false;
};

// A variable's value, or nullopt when unset.
using EnvLookup = std::function<std::optional<std::string>(const std::string& name)>;
// This process's environment.
EnvLookup ProcessEnvironment();
// "KEY=VALUE" entries, as a spawn passes them.
EnvLookup EnvironmentOf(const std::vector<std::string>& entries);

// Reads LTRAIN_* from `env`, then applies the flags in `args` (--recipe FILE, --set k=v,
// --export-params FILE, --help).
StatusOr<WorkerEnv> ParseWorkerEnv(const EnvLookup& env, const std::vector<std::string>& args);

// The recipe this worker trains: its recipe file with the --set overrides, parsed and checked as
// every recipe is.
StatusOr<Recipe> LoadWorkerRecipe(const WorkerEnv& env);

// LTRAIN_PROFILE: the chosen ranks record steps first..last (1-based) under the CUDA profiler, each
// into one Chrome trace of its own.
struct ProfileWindow {
  int64_t first = 0;  // 0: none
  int64_t last = 0;
  std::string path;   // "{rank}" stands for the rank; relative paths are the job's directory's
  std::optional<std::set<int>> ranks;  // those that record; none: every rank

  bool Records(int rank) const { return first > 0 && (!ranks || ranks->count(rank) > 0); }
  std::string PathFor(int rank) const;
};
// "STEP", "FIRST-LAST", "STEP:PATH" or "FIRST-LAST:PATH" (LTRAIN_PROFILE), and which ranks record
// (LTRAIN_PROFILE_RANKS: "all", or ranks and ranges such as "0,4-7"; empty: every rank when PATH is
// absent, the default profile-rank-{rank}.json, or holds "{rank}", else rank 0 alone). Several ranks
// need "{rank}" in PATH.
StatusOr<ProfileWindow> ParseProfileWindow(const std::string& value, const std::string& ranks = "");

// A variable of this process's environment; `fallback` when unset or empty.
std::string EnvString(const char* name, const std::string& fallback = "");
// An integer variable of `env` into `out`; unset leaves `out` alone, a malformed value is an error.
Status EnvInt(const EnvLookup& env, const char* name, int* out);
Status EnvInt(const EnvLookup& env, const char* name, int64_t* out);
// A switch of `env`, 0 or 1, into `out`; unset leaves `out` alone, any other value is an error.
Status EnvSwitch(const EnvLookup& env, const char* name, int* out);

// What the agent hands a warm standby on its stdin when the standby becomes a rank (Supervisor::Activate:
// the working directory, then every NAME=VALUE of the rank's environment, each NUL-terminated): makes
// them this process's (chdir, and the environment replaced whole). The standbys of ltrain-exec and
// of ltrain-worker both take their rank so. An error names the directory it could not enter.
Status AdoptStandbyInput(const std::string& input);

}  // namespace ltrain::worker
