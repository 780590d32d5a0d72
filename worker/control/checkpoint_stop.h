// CheckpointStop: a stop after a final checkpoint (`ltrain stop --checkpoint`), and the one step
// after which every rank of the job stops.
//
// Threads: the progress reporter's thread calls Request() when the agent passes the request on; the
// worker's main thread calls Connect() once the rendezvous store exists, Begin() with the step
// training starts from, and After() after every step it completes. Thread-safe.
//
// Contract across ranks: once a rank has both the request and its starting step, it publishes its
// hold step H (the step after the last one it completed) under "stop/hold/RANK" in the generation's
// rendezvous store. After completing step H it waits until every rank has published and stops after
// the largest H. Every rank reads the same values, so all stop after the same step S, and none is
// past S, because none goes beyond its own H before it knows S. Publishing happens on the thread that
// learns the request (or in Begin), never behind a collective, so a rank blocked in a collective with
// a holding peer still publishes. A rank that cannot publish, or that waits longer than the timeout
// for the others, gets an error from After(): its job is then stopped without a final checkpoint.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "common/status.h"

namespace gloo::rendezvous {
class Store;
}

namespace ltrain::worker {

class CheckpointStop {
 public:
  // Set a key of the generation's rendezvous store; get keys, waiting up to `timeout` for all.
  using Publish = std::function<Status(const std::string& key, const std::string& value)>;
  using Gather = std::function<StatusOr<std::vector<std::string>>(const std::vector<std::string>& keys,
                                                                  std::chrono::milliseconds timeout)>;

  CheckpointStop(int rank, int world_size, std::chrono::milliseconds timeout = std::chrono::seconds(30));

  // The store; needed before Begin() when the world has more than one rank.
  void Connect(Publish publish, Gather gather);
  // The job is to stop after a final checkpoint. Idempotent.
  void Request();
  // Training starts after `step` (0, or the step of the checkpoint it resumed from).
  void Begin(int64_t step);
  // After completing `step`: whether to save it and stop. Blocks while the ranks agree.
  StatusOr<bool> After(int64_t step);

  // The ranks whose stop steps are agreed on (by default every rank of the world): after ranks left
  // with a lost node (in place), the members that go on.
  void SetMembers(std::vector<int> members);

  bool requested() const;
  // The step every rank stops after, once agreed.
  std::optional<int64_t> stop_step() const;

  static std::string HoldKey(int rank) { return "stop/hold/" + std::to_string(rank); }

 private:
  // With mu_ held: fixes the hold step; returns it when it must be published now.
  std::optional<int64_t> HoldLocked();
  void PublishHold(int64_t hold);

  const int rank_;
  const int world_size_;
  const std::chrono::milliseconds timeout_;
  Publish publish_;
  Gather gather_;

  mutable std::mutex mu_;
  std::vector<int> members_;  // under mu_
  bool requested_ = false;
  std::optional<int64_t> last_;   // the last completed step, once training began
  std::optional<int64_t> hold_;
  std::optional<int64_t> stop_;
  Status publish_error_;
};

// Connects `stop` to the generation's rendezvous store (none for a world of one rank).
void ConnectCheckpointStop(CheckpointStop* stop, std::shared_ptr<gloo::rendezvous::Store> store);

}  // namespace ltrain::worker
