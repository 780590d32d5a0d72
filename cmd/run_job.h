// Starting a job and following it to its end, as `ltrain launch` and `ltrain resume` do: against a
// cluster's coordinator, or, without an address, a coordinator and an agent of its own on loopback.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <variant>

#include "cmd/cli_support.h"

namespace ltrain::cli {

struct RunJobOptions {
  std::string coordinator;  // HOST:PORT; "" runs a local control plane on $LTRAIN_HOME
  bool detach = false;      // with a coordinator: return once the job has started
  bool quiet = false;       // job events only, not the workers' log lines
  bool verbose = false;     // also the embedded coordinator's and agent's logs
  const char* verb = "submitted";  // "job ID submitted to ..."
  std::string http_listen;  // standalone: HOST:PORT of the embedded coordinator's GET /metrics
};

// A job that a submit or a resume began: its id, and the last event that came before it (a resumed
// job's earlier history is not printed again).
struct BegunJob {
  std::string job_id;
  int64_t after_seq = 0;
};

// Starts the job through `begin` (a submit or a resume over the given client, or an exit code after
// saying why), then prints its events and log lines until it ends. The first SIGINT or SIGTERM stops
// the job; a second one leaves at once. Returns the exit code of the job's final state.
int RunJob(const RunJobOptions& options, const SecurityMaterial& security,
           const std::function<std::variant<BegunJob, int>(CoordinatorClient&)>& begin);

// Streams a job's events and log lines after `after_seq` until it ends, riding out a coordinator
// restart of up to about 30 s, with the ranks' long work (a checkpoint's save or load, building the
// model) shown as it lasts: a bar on a terminal, a line every 10 s otherwise. Returns the exit code
// for its final state; a FAILED job's last line says how to continue it (`standalone`: the job's
// coordinator is this command's own, so a resume needs no --coordinator).
int FollowJob(CoordinatorClient& client, const std::string& job_id, bool quiet, int64_t after_seq = 0,
              bool standalone = false);

}  // namespace ltrain::cli
