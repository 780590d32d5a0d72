// The coordinator's rendezvous store (RendezvousService): the workers' keys, bounded per job, and the
// Gets that wait for them without a thread. Part of Coordinator (coordinator.h).
#include "launcher/coordinator.h"

#include <algorithm>

namespace ltrain::launcher {

void Coordinator::FreeKeysLocked(const std::string& job_id, const std::string& keep_scope) {
  const std::string prefix = job_id + "/";
  int64_t& bytes = kv_job_bytes_[job_id];
  for (auto it = kv_.lower_bound(prefix); it != kv_.end() && it->first.rfind(prefix, 0) == 0;) {
    if (!keep_scope.empty() && it->first.rfind(keep_scope, 0) == 0) {
      ++it;
    } else {
      bytes -= static_cast<int64_t>(it->first.size() + it->second.size());
      it = kv_.erase(it);
    }
  }
  if (bytes <= 0) kv_job_bytes_.erase(job_id);
}

size_t Coordinator::KvSize() const {
  std::lock_guard<std::mutex> lock(mu_);
  return kv_.size();
}

Status Coordinator::KvSet(const std::string& key, const std::string& value) {
  if (key.size() > kMaxKvKeyBytes) {
    return InvalidArgument("a rendezvous key of " + std::to_string(key.size()) + " bytes is over the bound of " +
                           std::to_string(kMaxKvKeyBytes));
  }
  if (value.size() > kMaxKvValueBytes) {
    return InvalidArgument("the value of rendezvous key " + key.substr(0, 200) + " has " + std::to_string(value.size()) +
                           " bytes, over the bound of " + std::to_string(kMaxKvValueBytes));
  }
  const size_t slash = key.find('/');
  const size_t second = slash == std::string::npos ? std::string::npos : key.find('/', slash + 1);
  if (second == std::string::npos) return InvalidArgument("a rendezvous key is JOB/GENERATION/NAME");
  const std::string job_id = key.substr(0, slash);
  std::vector<std::pair<std::shared_ptr<KvWaiter>, std::vector<std::string>>> ready;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto job = jobs_.find(job_id);
    if (job == jobs_.end() || IsFinal(job->second.job.state())) {
      return InvalidArgument("rendezvous key " + key.substr(0, 200) + ": job " + job_id.substr(0, 200) +
                             " is not running on this coordinator");
    }
    if (key.compare(slash + 1, second - slash - 1, std::to_string(job->second.job.generation())) != 0) {
      return InvalidArgument("rendezvous key " + key.substr(0, 200) + ": not of generation " +
                             std::to_string(job->second.job.generation()) + ", the job's newest");
    }
    auto existing = kv_.find(key);
    const int64_t before = existing == kv_.end() ? 0 : static_cast<int64_t>(key.size() + existing->second.size());
    int64_t& bytes = kv_job_bytes_[job_id];
    const int64_t after = bytes - before + static_cast<int64_t>(key.size() + value.size());
    if (after > kMaxKvJobBytes) {
      return InvalidArgument("job " + job_id + "'s rendezvous keys would hold " + std::to_string(after) +
                             " bytes, over the bound of " + std::to_string(kMaxKvJobBytes));
    }
    bytes = after;
    kv_[key] = value;
    WakeKvWaitersLocked(key, &ready);
    cv_.notify_all();
  }
  for (auto& [waiter, values] : ready) waiter->done(std::move(values));
  return Status::Ok();
}

void Coordinator::WakeKvWaitersLocked(
    const std::string& key, std::vector<std::pair<std::shared_ptr<KvWaiter>, std::vector<std::string>>>* ready) {
  auto [begin, end] = kv_waiters_.equal_range(key);
  std::vector<std::shared_ptr<KvWaiter>> woken;
  for (auto it = begin; it != end; ++it) woken.push_back(it->second);
  kv_waiters_.erase(begin, end);
  for (auto& waiter : woken) {
    auto missing = std::find_if(waiter->keys.begin(), waiter->keys.end(),
                                [&](const std::string& k) { return kv_.count(k) == 0; });
    if (missing != waiter->keys.end()) {
      kv_waiters_.emplace(*missing, waiter);
      continue;
    }
    std::vector<std::string> values;
    values.reserve(waiter->keys.size());
    for (const auto& k : waiter->keys) values.push_back(kv_[k]);
    ready->emplace_back(waiter, std::move(values));
  }
}

void Coordinator::KvGetAsync(std::vector<std::string> keys, int64_t timeout_ms, KvDone done) {
  std::optional<std::vector<std::string>> now;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!shutting_down_) {
      auto missing = std::find_if(keys.begin(), keys.end(), [&](const std::string& k) { return kv_.count(k) == 0; });
      if (missing != keys.end()) {
        auto waiter = std::make_shared<KvWaiter>();
        waiter->deadline_ms = clock_->SteadyMs() + BoundedWaitMs(timeout_ms);
        waiter->done = std::move(done);
        const std::string first = *missing;
        waiter->keys = std::move(keys);
        kv_waiters_.emplace(first, std::move(waiter));
        return;
      }
      now.emplace();
      for (const auto& k : keys) now->push_back(kv_[k]);
    }
  }
  done(std::move(now));
}

std::optional<std::vector<std::string>> Coordinator::KvGet(const std::vector<std::string>& keys, int64_t timeout_ms) {
  timeout_ms = BoundedWaitMs(timeout_ms);  // a client's timeout
  std::unique_lock<std::mutex> lock(mu_);
  auto all_present = [&] {
    return shutting_down_ ||
           std::all_of(keys.begin(), keys.end(), [&](const std::string& k) { return kv_.count(k) > 0; });
  };
  if (!cv_.wait_for(lock, std::chrono::milliseconds(timeout_ms), all_present) || shutting_down_) return std::nullopt;
  std::vector<std::string> values;
  for (const auto& key : keys) values.push_back(kv_[key]);
  return values;
}

void Coordinator::ExpireKvWaiters() {
  std::vector<std::shared_ptr<KvWaiter>> expired;
  {
    std::lock_guard<std::mutex> lock(mu_);
    const int64_t now = clock_->SteadyMs();
    for (auto it = kv_waiters_.begin(); it != kv_waiters_.end();) {
      if (shutting_down_ || now >= it->second->deadline_ms) {
        expired.push_back(it->second);
        it = kv_waiters_.erase(it);
      } else {
        ++it;
      }
    }
  }
  for (auto& waiter : expired) waiter->done(std::nullopt);
}

}  // namespace ltrain::launcher
