#include "launcher/state_writer.h"

#include <chrono>
#include <cstdio>
#include <ctime>
#include <vector>

#include "common/logging.h"

namespace ltrain::launcher {
namespace {

constexpr const char* kLog = "coordinator";

}  // namespace

StateWriter::StateWriter(StateStore* store, const Clock* clock, size_t max_queued)
    : store_(store), clock_(clock), max_queued_(max_queued), thread_([this] { Run(); }) {}

StateWriter::~StateWriter() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
    retry_ = true;  // one last try of a failing write
  }
  work_cv_.notify_all();
  thread_.join();
}

void StateWriter::Enqueue(std::string what, Write write, bool droppable, std::function<void()> done) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (droppable && failing_ && queue_.size() >= max_queued_) {
      ++dropped_lines_;
      return;
    }
    queue_.push_back(Item{std::move(what), std::move(write), droppable, std::move(done)});
    ++enqueued_;
  }
  work_cv_.notify_one();
}

void StateWriter::Flush() {
  std::unique_lock<std::mutex> lock(mu_);
  const uint64_t target = enqueued_;
  done_cv_.wait(lock, [&] { return finished_ >= target || stop_ || (failing_ && !retry_ && !attempting_); });
}

void StateWriter::Retry() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!failing_) return;
    retry_ = true;
  }
  work_cv_.notify_one();
}

std::optional<std::string> StateWriter::Failure() const {
  std::lock_guard<std::mutex> lock(mu_);
  if (!failing_) return std::nullopt;
  return failure_ + " (failing since " + UtcTime(failing_since_ms_, "%Y-%m-%dT%H:%M:%SZ") + ", " + std::to_string(queue_.size()) +
         " write(s) waiting)";
}

StateWriterFigures StateWriter::Figures() const {
  std::lock_guard<std::mutex> lock(mu_);
  return {writes_done_, batches_done_, write_nanos_, static_cast<int64_t>(queue_.size())};
}

size_t StateWriter::Queued() const {
  std::lock_guard<std::mutex> lock(mu_);
  return queue_.size();
}

void StateWriter::Run() {
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    work_cv_.wait(lock, [&] { return (stop_ && (queue_.empty() || failing_)) || (!queue_.empty() && (!failing_ || retry_)); });
    if (queue_.empty() || (stop_ && failing_ && !retry_)) break;
    retry_ = false;
    // Only this thread pops, and a deque keeps its elements in place when others push at the back.
    const bool batches = store_->Batches();
    const size_t count = batches ? std::min(queue_.size(), kMaxBatch) : 1;
    std::vector<Item*> batch;
    for (size_t i = 0; i < count; ++i) batch.push_back(&queue_[i]);
    attempting_ = true;
    lock.unlock();
    const auto applying = std::chrono::steady_clock::now();
    Status status;
    if (!batches) {
      status = batch[0]->write(*store_);
    } else {
      store_->BeginBatch();
      for (Item* item : batch) {
        status = item->write(*store_);
        if (!status.ok()) break;
      }
      Status committed = store_->CommitBatch();
      if (status.ok()) status = committed;
    }
    lock.lock();
    attempting_ = false;
    if (status.ok()) {
      writes_done_ += static_cast<int64_t>(count);
      ++batches_done_;
    }
    write_nanos_ +=
        std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - applying).count();
    if (status.ok() || status.code() != StatusCode::kUnavailable) {
      if (!status.ok()) {
        LTRAIN_LOG(kError, kLog) << "the state database refused " << (count == 1 ? "a write" : std::to_string(count) + " writes")
                                 << ", dropped: " << status.message();
      }
      if (failing_ && status.ok()) {
        LTRAIN_LOG(kInfo, kLog) << "the state database takes writes again after "
                                << (clock_->UnixMs() - failing_since_ms_) / 1000 << " s"
                                << (dropped_lines_ ? "; " + std::to_string(dropped_lines_) +
                                                         " log line(s) were not kept meanwhile"
                                                   : std::string())
                                << "; new jobs are accepted again";
        failing_ = false;
        failure_.clear();
        dropped_lines_ = 0;
      }
      // The callbacks first, off the lock (they may take their owner's), then the items leave.
      std::vector<std::function<void()>> done;
      for (Item* item : batch) {
        if (item->done) done.push_back(std::move(item->done));
      }
      lock.unlock();
      for (auto& callback : done) callback();
      lock.lock();
      for (size_t i = 0; i < count; ++i) queue_.pop_front();
      finished_ += count;
      done_cv_.notify_all();
      continue;
    }
    if (!failing_) {
      failing_ = true;
      failing_since_ms_ = clock_->UnixMs();
      LTRAIN_LOG(kError, kLog) << "cannot write the state database: " << status.message()
                               << "; no new jobs are accepted until writes work again (running jobs go on)";
    }
    failure_ = status.message();
    done_cv_.notify_all();
    if (stop_) {
      LTRAIN_LOG(kError, kLog) << queue_.size() << " write(s) to the state database were not applied: "
                               << failure_;
      break;
    }
  }
}

}  // namespace ltrain::launcher
