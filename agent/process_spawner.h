// Starting and stopping worker processes. The agent's supervisor thread is the only caller: it
// spawns, polls and reaps from that one long-lived thread, because PR_SET_PDEATHSIG ties each
// worker's life to the thread that forked it.
#pragma once

#include <sys/types.h>

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "agent/worker_cgroups.h"
#include "common/status.h"

namespace ltrain::agent {

struct SpawnSpec {
  std::string binary;
  std::vector<std::string> args;  // after argv[0]
  std::vector<std::string> env;   // "KEY=VALUE", added to (and overriding) the agent's environment
  std::string working_dir;
  // The child's stdin is one end of a socket pair whose other end the caller gets
  // (SpawnedProcess::input_fd) and writes with send(MSG_NOSIGNAL), rather than /dev/null: a warm
  // standby waits there for the environment of the rank it becomes.
  bool input_pipe = false;
};

struct SpawnedProcess {
  pid_t pid = -1;
  int output_fd = -1;  // stdout and stderr of the child, non-blocking; the caller closes it
  int input_fd = -1;   // with SpawnSpec::input_pipe: the caller's end of the child's stdin; the caller closes it
};

struct ProcessExit {
  pid_t pid = -1;
  int exit_code = 0;  // when signal == 0
  int signal = 0;     // the signal that killed it, or 0
};

// The environment a process spawned with `spec_env` gets: this process's, without the cluster
// token (a worker runs user code and reaches its agent with its job's own secret), with `spec_env`'s
// entries (NAME=VALUE) added or in place of those of their names; sorted by name.
std::vector<std::string> SpawnEnvironment(const std::vector<std::string>& spec_env);

class ProcessSpawner {
 public:
  virtual ~ProcessSpawner() = default;
  // Starts the process in a process group of its own (and, where the system allows, a cgroup of its
  // own), killed with SIGKILL if the agent dies.
  virtual StatusOr<SpawnedProcess> Spawn(const SpawnSpec& spec) = 0;
  // Sends `signal` to the whole process group of `pid`, and to every process of its cgroup.
  virtual void KillGroup(pid_t pid, int signal) = 0;
  // One exited child, if any, without blocking. Whatever the child left running in its cgroup (or,
  // without one, its process group) is killed: every process of a worker ends with it.
  virtual std::optional<ProcessExit> TryReap() = 0;
};

class RealProcessSpawner : public ProcessSpawner {
 public:
  // Puts each worker in a cgroup of its own under the agent's (WorkerCgroups) where it may, and
  // says once, in the log, whether it does.
  RealProcessSpawner();
  StatusOr<SpawnedProcess> Spawn(const SpawnSpec& spec) override;
  void KillGroup(pid_t pid, int signal) override;
  std::optional<ProcessExit> TryReap() override;

 private:
  std::unique_ptr<WorkerCgroups> cgroups_;  // null: process groups alone
  std::map<pid_t, std::string> cgroup_of_;   // live workers' cgroups
};

}  // namespace ltrain::agent
