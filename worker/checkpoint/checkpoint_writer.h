// CheckpointWriter: writes this rank's files of a save and, on rank 0, commits the step.
//
// Called by the trainer's training thread only. The training thread takes the snapshot (copies of
// this rank's tensors in host memory, and on rank 0 the manifest) and hands it to Submit.
//   async: Submit waits for the save in flight (at most one per rank), then returns; the writer's
//     own thread streams the files to disk (reporting its bytes through Progress::SetWork), fsyncs
//     them, writes the rank's manifest, announces on the CheckpointCommitBoard that they are
//     durable (or why not), and on rank 0 waits for every rank's word and then commits, while
//     training goes on. Wait() blocks until no save is in flight.
//   sync: the trainer calls WriteFiles on the training thread, agrees with its peers on the outcome
//     with a collective, and rank 0 calls Conclude.
// Rank 0 calls on_commit(N, DIR/step-N) and then prints "checkpoint step-N written to DIR in X ms"
// exactly when step N is committed, or prints "checkpoint step-N failed: WHY; step-M stays the newest
// committed". A failed save is reported, never fatal: training goes on and the next save may
// succeed; its pending directory is removed.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <torch/types.h>

#include "common/recipe.h"
#include "common/status.h"
#include "worker/checkpoint/checkpoint.h"

namespace ltrain::worker {

// One rank's share of one save, in host memory.
struct CheckpointSnapshot {
  int64_t step = 0;
  std::vector<std::pair<std::string, NamedTensors>> files;  // file name, its tensors (host memory)
  CheckpointMeta meta;  // rank 0: the manifest
  std::chrono::steady_clock::time_point start;
};

struct CheckpointWriterOptions {
  std::string dir;
  int rank = 0;
  int world_size = 1;
  Recipe recipe;
  bool async = true;
  bool print = true;                         // rank 0 prints commits and failures
  CheckpointWriteFault fault;
  std::chrono::milliseconds commit_timeout{300000};
  CheckpointCommitBoard* board = nullptr;    // async: must outlive the writer
  // Rank 0: step N is committed at `path`, `save_ms` after its snapshot began, with `bytes` in its
  // files; called before its line is printed, on the thread that committed it (the writer's own
  // thread for async saves, the training thread for sync ones).
  std::function<void(int64_t step, const std::string& path, double save_ms, uint64_t bytes)> on_commit;
};

class CheckpointWriter {
 public:
  explicit CheckpointWriter(CheckpointWriterOptions options);
  ~CheckpointWriter();  // abandons a save that still waits for peers, then joins
  CheckpointWriter(const CheckpointWriter&) = delete;
  CheckpointWriter& operator=(const CheckpointWriter&) = delete;

  bool async() const { return options_.async; }
  // async: waits for the save in flight, then starts this one in the background.
  void Submit(CheckpointSnapshot snapshot);
  // Waits until no save is in flight; returns the outcome of the last save (rank 0: whether it was
  // committed; other ranks: whether their files were written).
  Status Wait();

  // sync: this rank's files; "" when they are durable, else why not.
  std::string WriteFiles(const CheckpointSnapshot& snapshot);
  // Rank 0: `errors` has every failing rank's reason (empty: all durable); commits or reports.
  Status Conclude(const CheckpointSnapshot& snapshot, const std::vector<std::string>& errors);
  // Why this rank cannot go on (async): a save whose failure could not be told to rank 0 (its marker
  // could not be written: a full disk, say), so that no later commit can conclude. OK otherwise. The
  // training thread asks after every step, and fails the rank at once instead of a hang timeout later.
  Status Fatal() const;

 private:
  void Loop();
  void Process(CheckpointSnapshot snapshot);
  // This rank's files of the snapshot's pending directory, removed (a failed save gives its space back).
  void RemoveOwnFiles(const CheckpointSnapshot& snapshot);

  CheckpointWriterOptions options_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::optional<CheckpointSnapshot> queued_;
  bool busy_ = false;
  bool stop_ = false;
  std::atomic<bool> cancel_{false};
  Status last_;
  Status fatal_;  // under mu_
  std::thread thread_;
};

}  // namespace ltrain::worker
