// ReductionQueue (param_store.h): the jobs of the gradient reduction, on a thread of their own or in
// place, on a side stream where the device has one.
#include "worker/parallel/param_store.h"

#include <exception>

#include <c10/util/Exception.h>

#include "worker/torch_compat.h"

namespace ltrain::worker {
namespace {

bool high_priority_collectives = false;

}  // namespace

void SetCollectiveStreamPriority(bool high) { high_priority_collectives = high; }

ReductionQueue::ReductionQueue(bool threaded, const torch::Device& device, bool own_stream)
    : threaded_(threaded), device_(device) {
  if (own_stream && device.is_cuda()) {
    auto side = std::make_unique<compat::SideStream>(device, high_priority_collectives);
    if (side->active()) side_ = std::move(side);
  }
  if (threaded_) thread_ = std::thread([this] { Loop(); });
}

ReductionQueue::~ReductionQueue() {
  if (!threaded_) return;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

namespace {

Status RunJob(const std::function<Status()>& job) {
  try {
    return job();
  } catch (const c10::Error& e) {
    return Internal(std::string("LibTorch error in a data-parallel reduction: ") + e.what_without_backtrace());
  } catch (const std::exception& e) {
    return Internal(std::string("error in a data-parallel reduction: ") + e.what());
  }
}

}  // namespace

int64_t ReductionQueue::Enqueue(std::function<Status()> job) {
  if (!threaded_) {
    const int64_t id = next_id_++;
    if (!side_) {
      Status s = RunJob(job);
      if (!s.ok() && error_.ok()) error_ = s;
      done_id_ = id;
      return id;
    }
    // Issued now, on the side stream, after what the enqueuing thread's stream holds now.
    compat::StreamMarker ready = compat::StreamMarker::Record(device_);
    Status s;
    compat::StreamMarker finished;
    {
      compat::SideStream::Scope scope(*side_);
      ready.Block();
      s = RunJob(job);
      finished = compat::StreamMarker::Record(device_);
    }
    std::lock_guard<std::mutex> lock(mu_);
    finished_[id] = finished;
    if (!s.ok() && error_.ok()) error_ = s;
    done_id_ = id;
    return id;
  }
  if (side_) {
    // Ordered after everything the enqueuing thread's stream holds now (e.g. the backward kernels
    // that produced the gradients to reduce).
    compat::StreamMarker ready = compat::StreamMarker::Record(device_);
    job = [this, ready, job = std::move(job)]() {
      compat::SideStream::Scope scope(*side_);
      ready.Block();
      return job();
    };
  }
  std::lock_guard<std::mutex> lock(mu_);
  const int64_t id = next_id_++;
  jobs_.emplace_back(id, std::move(job));
  cv_.notify_all();
  return id;
}

void ReductionQueue::Loop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    cv_.wait(lock, [&] { return stop_ || !jobs_.empty(); });
    if (jobs_.empty()) return;  // stop_
    auto [id, job] = std::move(jobs_.front());
    jobs_.pop_front();
    const bool skip = !error_.ok();  // after a failure the group is unusable: fail fast
    lock.unlock();
    Status s = skip ? Status::Ok() : RunJob(job);
    compat::StreamMarker finished;
    if (side_) {
      compat::SideStream::Scope scope(*side_);
      finished = compat::StreamMarker::Record(device_);
    }
    lock.lock();
    if (side_) finished_[id] = finished;
    if (!s.ok() && error_.ok()) error_ = s;
    done_id_ = id;
    cv_.notify_all();
  }
}

Status ReductionQueue::Wait(int64_t id) {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return done_id_ >= id; });
  // The waiting thread's stream waits for the side stream as it was after job `id` (which covers
  // every job before it); markers up to it are not needed again.
  auto after = finished_.upper_bound(id);
  if (after != finished_.begin()) {
    compat::StreamMarker finished = std::prev(after)->second;
    finished_.erase(finished_.begin(), after);
    lock.unlock();
    finished.Block();
    lock.lock();
  }
  return error_;
}

Status ReductionQueue::WaitAll() {
  int64_t last = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    last = next_id_ - 1;
  }
  return Wait(last);
}

void ReductionQueue::ClearError() {
  (void)WaitAll();
  std::lock_guard<std::mutex> lock(mu_);
  error_ = Status::Ok();
}

}  // namespace ltrain::worker
