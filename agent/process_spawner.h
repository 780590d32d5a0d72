// Starting and stopping worker processes. The agent's supervisor thread is the only caller: it
// spawns, polls and reaps from that one long-lived thread, because PR_SET_PDEATHSIG ties each
// worker's life to the thread that forked it.
#pragma once

#include <sys/types.h>

#include <optional>
#include <string>
#include <vector>

#include "common/status.h"

namespace ltrain::agent {

struct SpawnSpec {
  std::string binary;
  std::vector<std::string> args;  // after argv[0]
  std::vector<std::string> env;   // "KEY=VALUE", added to (and overriding) the agent's environment
  std::string working_dir;
};

struct SpawnedProcess {
  pid_t pid = -1;
  int output_fd = -1;  // stdout and stderr of the child, non-blocking; the caller closes it
};

struct ProcessExit {
  pid_t pid = -1;
  int exit_code = 0;  // when signal == 0
  int signal = 0;     // the signal that killed it, or 0
};

class ProcessSpawner {
 public:
  virtual ~ProcessSpawner() = default;
  // Starts the process in a process group of its own, killed with SIGKILL if the agent dies.
  virtual StatusOr<SpawnedProcess> Spawn(const SpawnSpec& spec) = 0;
  // Sends `signal` to the whole process group of `pid`.
  virtual void KillGroup(pid_t pid, int signal) = 0;
  // One exited child, if any, without blocking.
  virtual std::optional<ProcessExit> TryReap() = 0;
};

class RealProcessSpawner : public ProcessSpawner {
 public:
  StatusOr<SpawnedProcess> Spawn(const SpawnSpec& spec) override;
  void KillGroup(pid_t pid, int signal) override;
  std::optional<ProcessExit> TryReap() override;
};

}  // namespace ltrain::agent
