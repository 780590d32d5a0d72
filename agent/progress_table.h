// ProgressTable: the latest progress report of each worker of this node, as the agent forwards it
// to the coordinator: with every heartbeat (Collect), at once when a report brings news that must
// not wait for the next heartbeat (Record), and in the worker's exit report (CompleteExitReport).
//
// Who calls it: the agent's WorkerService handlers (Record, on gRPC threads), its heartbeat thread
// (Collect) and its supervisor thread (CompleteExitReport, through
// SupervisorOptions::complete_exit_report).
// Thread-safe; no I/O; time from the Clock. idle_ms and silent_ms of what it returns are measured on
// this node's clock, so hosts' clocks never need to agree.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "common/clock.h"
#include "ltrain/v1/ltrain.pb.h"

namespace ltrain::agent {

// A worker process: job id, generation, rank.
using WorkerKey = std::tuple<std::string, int, int>;

class ProgressTable {
 public:
  // A report of no worker that is still running is forgotten this long after it came.
  static constexpr int64_t kForgetMs = 60'000;

  explicit ProgressTable(const Clock& clock) : clock_(clock) {}

  // Keeps `report` as its worker's latest, unless one with a higher seq came first. Returns the
  // report as forwarded when it brings news the coordinator must have before any line the worker
  // prints after it: a newer commit, or the stop after a final checkpoint.
  std::optional<v1::RankProgress> Record(const v1::RankProgress& report);
  // The latest report of each worker in `running`.
  std::vector<v1::RankProgress> Collect(const std::set<WorkerKey>& running);
  // Puts the latest report of the worker that exited into its exit report (none if it never
  // reported) and forgets it: what SupervisorOptions::complete_exit_report does in the agent.
  void CompleteExitReport(v1::WorkerStateReport& report);

 private:
  struct Entry {
    v1::RankProgress report;
    int64_t received_ms = 0;  // steady
    int64_t changed_ms = 0;   // steady: when step, phase, the newest collective or the work last changed
  };

  // The report with idle_ms and silent_ms as of `now`.
  static v1::RankProgress Forwarded(const Entry& entry, int64_t now);

  const Clock& clock_;
  std::mutex mu_;
  std::map<WorkerKey, Entry> entries_;
};

}  // namespace ltrain::agent
