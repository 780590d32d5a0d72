// The coordinator's writes to its StateStore, applied in the order they were made on a thread of
// their own, so that no handler waits for the disk while it holds the coordinator's lock.
//
// A store that batches (etcd) gets the queued writes in batches, each applied or refused as a whole.
//
// A write that fails with Unavailable (a full disk, an I/O error, a lock held by another process)
// stays at the head of the queue and is tried again at each Retry(); while it fails, Failure() says
// why, and the coordinator takes no new work. A write refused for any other reason is dropped with
// an error line, so that one bad record never holds back the ones behind it. Reads call Flush()
// first and so see every write made before them (while writes fail, what the store has).
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include "common/clock.h"
#include "common/status.h"
#include "launcher/rpc_figures.h"
#include "launcher/state_store.h"

namespace ltrain::launcher {

class StateWriter {
 public:
  using Write = std::function<Status(StateStore&)>;

  // `max_queued` bounds the queue for droppable writes (log lines) while writes fail.
  StateWriter(StateStore* store, const Clock* clock, size_t max_queued = 100000);
  // Applies what is queued while the store takes it, then stops.
  ~StateWriter();
  StateWriter(const StateWriter&) = delete;
  StateWriter& operator=(const StateWriter&) = delete;

  // `what` names the write in errors ("update job x-1"). A `droppable` write is dropped, and
  // counted, instead of queued when writes fail and the queue holds `max_queued`. `done`, when
  // given, is called (on the writer's thread, holding no lock of it) once the write is applied or
  // refused for good.
  void Enqueue(std::string what, Write write, bool droppable = false, std::function<void()> done = nullptr);
  // Returns once every write enqueued before the call is applied, or once a write has failed and
  // no retry is under way.
  void Flush();
  // Tries the failing write again (cheap when none fails).
  void Retry();
  // Why writes fail, since when; empty while they work.
  std::optional<std::string> Failure() const;
  size_t Queued() const;
  StateWriterFigures Figures() const;

 private:
  struct Item {
    std::string what;
    Write write;
    bool droppable = false;
    std::function<void()> done;
  };
  // A store that batches gets up to this many queued writes at once.
  static constexpr size_t kMaxBatch = 256;
  void Run();

  StateStore* store_;
  const Clock* clock_;
  const size_t max_queued_;

  mutable std::mutex mu_;
  std::condition_variable work_cv_;   // the writer thread waits here
  std::condition_variable done_cv_;   // Flush waits here
  std::deque<Item> queue_;
  uint64_t enqueued_ = 0;             // items queued so far
  uint64_t finished_ = 0;             // items applied or dropped so far, in order
  bool retry_ = false;
  bool attempting_ = false;           // a write is being applied
  int64_t writes_done_ = 0, batches_done_ = 0, write_nanos_ = 0;  // Figures() (applied; time of every attempt), under mu_
  bool stop_ = false;
  bool failing_ = false;
  int64_t failing_since_ms_ = 0;
  std::string failure_;
  uint64_t dropped_lines_ = 0;        // droppable writes not queued while failing
  std::thread thread_;
};

}  // namespace ltrain::launcher
