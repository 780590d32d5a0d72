// FakeProcessSpawner: a ProcessSpawner with no processes, for tests of the supervision.
//
// Each spawn gets a made-up pid (1000, 1001, ...) and a real output descriptor: one end of a
// socket pair whose other end the fake writes when the test makes the process print, and closes
// when the process ends. A process ends only when the test says so (Exit, Die) or when a signal
// reaches it: SIGKILL ends it unless it is stuck in the kernel, SIGTERM unless the test made it
// ignore SIGTERM (a hung worker), others (SIGCONT) do nothing. Every spawn, failed or not, and every signal is recorded
// in order. Like the real spawner it belongs to one thread at a time; it never blocks.
#pragma once

#include <sys/types.h>

#include <deque>
#include <map>
#include <optional>
#include <ostream>
#include <string>
#include <string_view>
#include <vector>

#include "agent/process_spawner.h"
#include "common/signal_name.h"

namespace ltrain::agent {

class FakeProcessSpawner : public ProcessSpawner {
 public:
  struct Spawned {
    SpawnSpec spec;
    pid_t pid = -1;  // -1 when the spawn failed
  };
  struct SentSignal {
    pid_t pid = -1;
    int signal = 0;
    bool operator==(const SentSignal&) const = default;
    friend std::ostream& operator<<(std::ostream& out, const SentSignal& sent) {
      return out << SignalName(sent.signal) << " to " << sent.pid;
    }
  };

  FakeProcessSpawner() = default;
  ~FakeProcessSpawner() override;
  FakeProcessSpawner(const FakeProcessSpawner&) = delete;
  FakeProcessSpawner& operator=(const FakeProcessSpawner&) = delete;

  StatusOr<SpawnedProcess> Spawn(const SpawnSpec& spec) override;
  void KillGroup(pid_t pid, int signal) override;
  std::optional<ProcessExit> TryReap() override;

  // The next spawn fails with `status` (each call queues one failure, taken in order).
  void FailNextSpawn(Status status);
  // The process writes `text` to its output (stdout and stderr are one stream); lines end in '\n'.
  void Print(pid_t pid, std::string_view text);
  // The process exits with `code`, or dies of `signal`: its output closes, TryReap returns it.
  void Exit(pid_t pid, int code);
  void Die(pid_t pid, int signal);
  // From now on SIGTERM leaves the process running.
  void IgnoreSigterm(pid_t pid);
  // From now on no signal ends the process, not even SIGKILL: it is stuck in uninterruptible
  // sleep (a driver or a dead NFS server) until the test ends it.
  void MakeUninterruptible(pid_t pid);

  const std::vector<Spawned>& spawns() const { return spawns_; }
  const std::vector<SentSignal>& signals() const { return signals_; }
  // The signals sent to the process group of `pid`, in order.
  std::vector<int> SignalsTo(pid_t pid) const;
  // What the supervisor wrote to the process's stdin (SpawnSpec::input_pipe) so far, and whether
  // it closed its end.
  std::string Input(pid_t pid, bool* closed = nullptr);
  // Spawned and not yet ended.
  bool Alive(pid_t pid) const;

 private:
  struct Process {
    int output_fd = -1;  // the fake's end; -1 once the process ended
    int input_fd = -1;   // the child's end of its stdin (input_pipe), non-blocking
    std::string input;   // read from it so far
    bool input_closed = false;
    bool ignores_sigterm = false;
    bool uninterruptible = false;
    bool ended = false;
  };
  void End(pid_t pid, int code, int signal);

  pid_t next_pid_ = 1000;
  std::deque<Status> spawn_failures_;
  std::map<pid_t, Process> processes_;
  std::deque<ProcessExit> exits_;  // ended, not yet reaped
  std::vector<Spawned> spawns_;
  std::vector<SentSignal> signals_;
};

}  // namespace ltrain::agent
