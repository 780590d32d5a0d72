// A cgroup (v2) per worker, under the agent's own, so that every process a rank starts ends with it:
// one that left the rank's process group (setsid, a daemonizing helper) is in the cgroup still, and
// `cgroup.kill` ends them all at once. Where the agent may not create cgroups (no cgroup2 mount, a
// cgroup of another user's, a read-only /sys/fs/cgroup), Create says why, and the spawner falls back
// to process groups alone.
//
// Who calls it: the RealProcessSpawner, on the agent's supervisor thread (Prepare before a fork, the
// descriptor written by the child before exec; Kill, Signal and Remove after). Not thread-safe.
#pragma once

#include <memory>
#include <optional>
#include <set>
#include <string>

namespace ltrain::agent {

// The directory of the cgroup2 hierarchy this process is in (its mount point joined with the path
// /proc/self/cgroup gives for "0::"), from the text of /proc/self/mountinfo and /proc/self/cgroup;
// nullopt without a cgroup2 mount or a "0::" line.
std::optional<std::string> OwnCgroup2Dir(const std::string& mountinfo, const std::string& proc_self_cgroup);

class WorkerCgroups {
 public:
  // A folder ltrain-agent-PID under this process's cgroup, or nullptr with `why` set. Empty folders
  // that agents killed earlier left there are removed.
  static std::unique_ptr<WorkerCgroups> Create(std::string* why);
  ~WorkerCgroups();  // every worker cgroup killed and removed, then the agent's folder
  WorkerCgroups(const WorkerCgroups&) = delete;
  WorkerCgroups& operator=(const WorkerCgroups&) = delete;

  const std::string& dir() const { return dir_; }

  struct Slot {
    std::string dir;  // the worker's cgroup
    int procs_fd;     // its cgroup.procs, close-on-exec; the child writes "0" to it to move itself in
  };
  // A new, empty cgroup for one worker; nullopt when it cannot be made.
  std::optional<Slot> Prepare();
  // SIGKILL to every process in `dir`, at once (cgroup.kill).
  void Kill(const std::string& dir);
  // `signal` to every process in `dir`.
  void Signal(const std::string& dir, int signal);
  // Removes `dir` now if it is empty, or at a later Remove or Sweep once it is.
  void Remove(const std::string& dir);
  // Removes the cgroups given to Remove that have emptied since.
  void Sweep();

 private:
  explicit WorkerCgroups(std::string dir) : dir_(std::move(dir)) {}

  std::string dir_;
  long next_ = 0;
  std::set<std::string> to_remove_;
};

}  // namespace ltrain::agent
