#include "worker/control/checkpoint_stop.h"

#include <algorithm>
#include <stdexcept>

#include <gloo/rendezvous/store.h>

#include "worker/control/progress.h"

namespace ltrain::worker {

CheckpointStop::CheckpointStop(int rank, int world_size, std::chrono::milliseconds timeout)
    : rank_(rank), world_size_(world_size), timeout_(timeout) {
  for (int r = 0; r < world_size; ++r) members_.push_back(r);
}

void CheckpointStop::SetMembers(std::vector<int> members) {
  std::lock_guard<std::mutex> lock(mu_);
  members_ = std::move(members);
}

void CheckpointStop::Connect(Publish publish, Gather gather) {
  std::lock_guard<std::mutex> lock(mu_);
  publish_ = std::move(publish);
  gather_ = std::move(gather);
}

std::optional<int64_t> CheckpointStop::HoldLocked() {
  if (!requested_ || !last_ || hold_) return std::nullopt;
  hold_ = *last_ + 1;
  return hold_;
}

void CheckpointStop::Request() {
  std::optional<int64_t> hold;
  {
    std::lock_guard<std::mutex> lock(mu_);
    requested_ = true;
    hold = HoldLocked();
  }
  if (hold) PublishHold(*hold);
}

void CheckpointStop::Begin(int64_t step) {
  std::optional<int64_t> hold;
  {
    std::lock_guard<std::mutex> lock(mu_);
    last_ = step;
    hold = HoldLocked();
  }
  if (hold) PublishHold(*hold);
}

void CheckpointStop::PublishHold(int64_t hold) {
  Status published;
  Publish publish;
  {
    std::lock_guard<std::mutex> lock(mu_);
    publish = publish_;
  }
  if (world_size_ > 1) {
    published = publish ? publish(HoldKey(rank_), std::to_string(hold))
                        : FailedPrecondition("no rendezvous store to agree on a step through");
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (!published.ok()) {
    publish_error_ = Unavailable("rank " + std::to_string(rank_) + " could not publish its stop step " +
                                 std::to_string(hold) + ": " + published.message());
  }
}

StatusOr<bool> CheckpointStop::After(int64_t step) {
  int64_t hold = 0;
  Gather gather;
  std::vector<int> members;
  {
    std::lock_guard<std::mutex> lock(mu_);
    last_ = step;
    if (stop_) {
      if (step > *stop_) {
        return Internal("rank " + std::to_string(rank_) + " completed step " + std::to_string(step) +
                        " after the agreed stop step " + std::to_string(*stop_));
      }
      return step == *stop_;
    }
    if (!hold_ || step < *hold_) return false;
    if (!publish_error_.ok()) return publish_error_;
    hold = *hold_;
    gather = gather_;
    members = members_;
  }
  int64_t stop = hold;
  if (world_size_ > 1) {
    Progress::Global().SetPhase(step, "stopping");
    std::vector<std::string> keys;
    for (int rank : members) keys.push_back(HoldKey(rank));
    StatusOr<std::vector<std::string>> holds =
        gather ? gather(keys, timeout_) : StatusOr<std::vector<std::string>>(FailedPrecondition("no rendezvous store"));
    if (!holds.ok()) {
      return Status(holds.status().code(),
                    "rank " + std::to_string(rank_) + " waited for every rank's stop step (" + keys.front() + " to " +
                        keys.back() + ") for up to " + std::to_string(timeout_.count() / 1000) +
                        " s: " + holds.status().message());
    }
    for (size_t rank = 0; rank < holds->size(); ++rank) {
      const std::string& value = (*holds)[rank];
      try {
        size_t used = 0;
        int64_t theirs = std::stoll(value, &used);
        if (used != value.size()) throw std::invalid_argument(value);
        stop = std::max(stop, theirs);
      } catch (const std::exception&) {
        return DataLoss(keys[rank] + "='" + value + "' is not a step number");
      }
    }
  }
  std::lock_guard<std::mutex> lock(mu_);
  stop_ = stop;
  if (step > stop) {
    return Internal("rank " + std::to_string(rank_) + " completed step " + std::to_string(step) +
                    " before the ranks agreed to stop after step " + std::to_string(stop));
  }
  return step == stop;
}

bool CheckpointStop::requested() const {
  std::lock_guard<std::mutex> lock(mu_);
  return requested_;
}

std::optional<int64_t> CheckpointStop::stop_step() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stop_;
}

void ConnectCheckpointStop(CheckpointStop* stop, std::shared_ptr<gloo::rendezvous::Store> store) {
  if (!store) return;
  // The store's calls throw (the file store and the gRPC store alike).
  stop->Connect(
      [store](const std::string& key, const std::string& value) -> Status {
        try {
          store->set(key, std::vector<char>(value.begin(), value.end()));
        } catch (const std::exception& e) {
          return Unavailable(e.what());
        }
        return Status::Ok();
      },
      [store](const std::vector<std::string>& keys,
              std::chrono::milliseconds timeout) -> StatusOr<std::vector<std::string>> {
        std::vector<std::string> values;
        try {
          store->wait(keys, timeout);
          for (const auto& key : keys) {
            std::vector<char> value = store->get(key);
            values.emplace_back(value.begin(), value.end());
          }
        } catch (const std::exception& e) {
          return Status(StatusCode::kDeadlineExceeded, e.what());
        }
        return values;
      });
}

}  // namespace ltrain::worker
