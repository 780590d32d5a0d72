// The coordinator's own time, by RPC kind: how many calls each kind had, how long their handlers
// ran (the coordinator's lock and state included, gRPC's queues not), and the longest; a rendezvous
// Get also how long it waited to be answered. Counted with atomics on gRPC's threads; shown on
// GET /metrics (metrics.h: ServerFiguresText) so that a load test or an operator can tell the
// coordinator's time from its clients' and the network's.
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>

namespace ltrain::launcher {

enum class RpcKind {
  kConnect,
  kHeartbeat,
  kReportWorkerState,
  kReportProgress,
  kLeave,
  kPushLogs,
  kKvSet,
  kKvGet,          // the handler: the keys looked up, a waiter registered
  kKvGetAnswered,  // from the handler's start to the answer (the wait for the keys included)
  kSubmitJob,      // the job recorded and, where nodes are free, placed
  kCount,
};

// The label a kind goes by in /metrics.
inline const char* RpcKindName(RpcKind kind) {
  static constexpr const char* kNames[] = {"Connect", "Heartbeat", "ReportWorkerState", "ReportProgress", "Leave",
                                           "PushLogs", "KvSet", "KvGet", "KvGetAnswered", "SubmitJob"};
  return kNames[static_cast<int>(kind)];
}

class RpcFigures {
 public:
  struct Figure {
    int64_t calls = 0;
    int64_t nanos = 0;      // all calls together
    int64_t max_nanos = 0;  // the longest
  };

  void Add(RpcKind kind, int64_t nanos) {
    Slot& s = slots_[static_cast<size_t>(kind)];
    s.calls.fetch_add(1, std::memory_order_relaxed);
    s.nanos.fetch_add(nanos, std::memory_order_relaxed);
    int64_t seen = s.max_nanos.load(std::memory_order_relaxed);
    while (nanos > seen && !s.max_nanos.compare_exchange_weak(seen, nanos, std::memory_order_relaxed)) {
    }
  }

  Figure Get(RpcKind kind) const {
    const Slot& s = slots_[static_cast<size_t>(kind)];
    return {s.calls.load(std::memory_order_relaxed), s.nanos.load(std::memory_order_relaxed),
            s.max_nanos.load(std::memory_order_relaxed)};
  }

 private:
  struct Slot {
    std::atomic<int64_t> calls{0}, nanos{0}, max_nanos{0};
  };
  std::array<Slot, static_cast<size_t>(RpcKind::kCount)> slots_;
};

// Adds the time from its construction to its end to `kind`.
class RpcTimer {
 public:
  RpcTimer(RpcFigures* figures, RpcKind kind) : figures_(figures), kind_(kind), start_(std::chrono::steady_clock::now()) {}
  ~RpcTimer() {
    figures_->Add(kind_, std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start_).count());
  }
  RpcTimer(const RpcTimer&) = delete;
  RpcTimer& operator=(const RpcTimer&) = delete;

 private:
  RpcFigures* figures_;
  RpcKind kind_;
  std::chrono::steady_clock::time_point start_;
};

// The state writer's: writes applied, the batches they went in, the time spent writing (failed
// attempts included), and how many wait now.
struct StateWriterFigures {
  int64_t writes = 0;
  int64_t batches = 0;
  int64_t nanos = 0;
  int64_t queued = 0;
};

// What the coordinator holds in memory: the jobs (running, and those that ended in the last
// keep_finished_in_memory_ms), their ranks' records and progress entries (those of a job that ended
// are folded into bytes), the nodes (lost ones kept a while) and the rendezvous keys.
struct HeldFigures {
  int64_t jobs = 0;
  int64_t rank_records = 0;
  int64_t folded_rank_bytes = 0;
  int64_t nodes = 0;
  int64_t rendezvous_keys = 0;
};

}  // namespace ltrain::launcher
