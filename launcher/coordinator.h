// Coordinator: the job state machine, placement, rank assignment, rendezvous store and failure
// policy, as a plain class. The gRPC services in coordinator_server.h are thin adapters over it and
// call it from their handler threads; every public method is thread-safe (one mutex) and the
// Wait* methods block their caller on a condition variable, never the others.
//
// Contract with agents: a node receives StartJobCommand with the global ranks it runs, and
// StopJobCommand when the job ends for any other reason than its own workers all exiting 0.
#pragma once

#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "common/clock.h"
#include "common/recipe.h"
#include "common/status.h"
#include "launcher/state_store.h"
#include "ltrain/v1/ltrain.pb.h"

namespace ltrain::launcher {

struct CoordinatorOptions {
  std::string state_dir;          // default checkpoints go under state_dir/checkpoints/<job>
  int64_t node_timeout_ms = 3000; // a node whose heartbeats stop this long is lost
  size_t max_buffered_events = 200000;
};

class Coordinator {
 public:
  Coordinator(StateStore* store, const Clock* clock, CoordinatorOptions options);

  // JobService.
  StatusOr<v1::Job> Submit(const std::string& recipe_yaml, const std::string& source_name);
  StatusOr<v1::Job> GetJob(const std::string& job_id);
  StatusOr<std::vector<v1::Job>> ListJobs(int limit);
  StatusOr<v1::Job> Stop(const std::string& job_id, const std::string& reason);
  // Events of a job after `after_seq` (log lines too when `logs`). Blocks up to `timeout_ms` while
  // there are none and the job is not final. `*finished` is set once the job is final and every
  // event has been returned.
  StatusOr<std::vector<v1::Event>> WaitEvents(const std::string& job_id, int64_t after_seq, bool logs,
                                              int64_t timeout_ms, bool* finished);

  // AgentService. NodeConnected returns a token that NodeDisconnected must present, so that a
  // stale stream closing after the agent reconnected does not mark the node lost.
  int64_t NodeConnected(const std::string& node_id, const v1::NodeFacts& facts);
  void NodeDisconnected(const std::string& node_id, int64_t token);
  std::optional<v1::Command> WaitCommand(const std::string& node_id, int64_t timeout_ms);
  Status Heartbeat(const std::string& node_id);
  Status ReportWorkerState(const v1::WorkerStateReport& report);
  void PushLogs(const v1::PushLogsRequest& request);

  // RendezvousService.
  void KvSet(const std::string& key, const std::string& value);
  std::optional<std::vector<std::string>> KvGet(const std::vector<std::string>& keys, int64_t timeout_ms);

  // Fails the jobs of nodes whose heartbeats stopped. Called periodically by the server.
  void CheckNodes();
  // Wakes every waiter; Wait* return at once from now on.
  void Shutdown();
  bool shutting_down() const;

 private:
  struct NodeState {
    v1::NodeFacts facts;
    bool connected = false;
    int64_t token = 0;
    int64_t last_heartbeat_ms = 0;
    std::deque<v1::Command> commands;
    std::set<std::string> jobs;
  };
  struct ActiveJob {
    v1::Job job;
    Recipe recipe;
    std::vector<std::string> nodes;
    std::set<int> ranks_succeeded;
    std::vector<v1::Event> events;  // in memory, log lines included
  };

  void ScheduleLocked();
  void AddEventLocked(ActiveJob& job, const std::string& kind, const std::string& message, int rank);
  void FinishLocked(ActiveJob& job, v1::JobState state, const std::string& cause);
  void PersistJobLocked(ActiveJob& job);

  StateStore* store_;
  const Clock* clock_;
  CoordinatorOptions options_;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool shutting_down_ = false;
  int64_t next_token_ = 1;
  int64_t next_seq_ = 1;
  std::map<std::string, NodeState> nodes_;
  std::map<std::string, ActiveJob> jobs_;
  std::vector<std::string> pending_;  // job ids waiting for nodes, oldest first
  std::map<std::string, std::string> kv_;
};

}  // namespace ltrain::launcher
