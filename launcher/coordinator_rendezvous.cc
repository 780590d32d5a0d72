// The coordinator's rendezvous store (RendezvousService): the workers' keys, bounded per job, and the
// Gets that wait for them without a thread. Part of Coordinator (coordinator.h).
#include "launcher/coordinator.h"

#include <algorithm>
#include <limits>
#include <optional>

namespace ltrain::launcher {
namespace {

// "job J generation G" of a key JOB/GENERATION/NAME (the key itself where it has no such parts).
std::string ScopeOf(const std::string& key) {
  const size_t slash = key.find('/');
  const size_t second = slash == std::string::npos ? std::string::npos : key.find('/', slash + 1);
  if (second == std::string::npos) return "key " + key.substr(0, 200);
  return "job " + key.substr(0, slash) + " generation " + key.substr(slash + 1, second - slash - 1);
}

}  // namespace

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
  // Gets waiting for keys of a generation that ended are answered at the next tick, with why.
  auto job = jobs_.find(job_id);
  const std::string why = job == jobs_.end() || keep_scope.empty()
                              ? "job " + job_id + " ended" +
                                    (job == jobs_.end() ? "" : std::string(" (") + JobStateName(job->second.job.state()) + ")")
                              : "generation " + std::to_string(job->second.job.generation()) + " of job " + job_id +
                                    " started in its place";
  auto mark = [&](KvWaiter& waiter) {
    const std::string& key = waiter.keys.front();
    if (key.rfind(prefix, 0) != 0 || (!keep_scope.empty() && key.rfind(keep_scope, 0) == 0)) return;
    if (waiter.ended.empty()) waiter.ended = "the rendezvous of " + ScopeOf(key) + " ended: " + why;
  };
  for (auto it = kv_waiters_.lower_bound(prefix); it != kv_waiters_.end() && it->first.rfind(prefix, 0) == 0; ++it) {
    mark(*it->second);
  }
  for (auto& [waiter, values] : kv_delayed_) mark(*waiter);
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
    if (waiter->answer_at_ms > clock_->SteadyMs()) {
      kv_delayed_.emplace_back(waiter, std::move(values));
    } else {
      ready->emplace_back(waiter, std::move(values));
    }
  }
}

void Coordinator::KvGetAsync(std::vector<std::string> keys, int64_t timeout_ms, KvDone done,
                             bool while_generation_lives) {
  StatusOr<std::vector<std::string>> now = Status(StatusCode::kUnavailable, "the coordinator is shutting down");
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!shutting_down_ && keys.empty()) {
      now = std::vector<std::string>();
    } else if (!shutting_down_) {
      if (while_generation_lives) {
        // Every key of the job's running generation.
        const std::string& first = keys.front();
        const size_t slash = first.find('/');
        const size_t second = slash == std::string::npos ? std::string::npos : first.find('/', slash + 1);
        const ActiveJob* job = second == std::string::npos ? nullptr : FindLocked(first.substr(0, slash));
        const std::string scope = second == std::string::npos ? "" : first.substr(0, second + 1);
        const bool running = job != nullptr && job->job.state() == v1::JOB_STATE_RUNNING &&
                             scope == job->job.id() + "/" + std::to_string(job->job.generation()) + "/" &&
                             std::all_of(keys.begin(), keys.end(), [&](const std::string& k) { return k.rfind(scope, 0) == 0; });
        if (!running) {
          now = Status(StatusCode::kFailedPrecondition,
                       "rendezvous keys " + first.substr(0, 200) + (keys.size() > 1 ? ", ..." : "") + ": " +
                           (job == nullptr ? "no such job runs on this coordinator"
                                           : "not all of the job's running generation (" +
                                                 std::string(JobStateName(job->job.state())) + ", generation " +
                                                 std::to_string(job->job.generation()) + ")"));
        }
      }
      if (now.status().code() == StatusCode::kUnavailable) {  // not answered yet
        auto missing = std::find_if(keys.begin(), keys.end(), [&](const std::string& k) { return kv_.count(k) == 0; });
        const int64_t steady = clock_->SteadyMs();
        const int64_t answer_at = steady + options_.rendezvous_answer_delay_ms;
        if (missing != keys.end() || options_.rendezvous_answer_delay_ms > 0) {
          auto waiter = std::make_shared<KvWaiter>();
          waiter->timeout_ms = BoundedWaitMs(timeout_ms);
          waiter->deadline_ms = while_generation_lives ? std::numeric_limits<int64_t>::max() : steady + waiter->timeout_ms;
          waiter->answer_at_ms = answer_at;
          waiter->done = std::move(done);
          waiter->keys = std::move(keys);
          if (missing != waiter->keys.end()) {
            const std::string first = *missing;
            kv_waiters_.emplace(first, std::move(waiter));
          } else {
            std::vector<std::string> values;
            for (const auto& k : waiter->keys) values.push_back(kv_[k]);
            kv_delayed_.emplace_back(std::move(waiter), std::move(values));
          }
          return;
        }
        std::vector<std::string> values;
        for (const auto& k : keys) values.push_back(kv_[k]);
        now = std::move(values);
      }
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
  std::vector<std::pair<std::shared_ptr<KvWaiter>, StatusOr<std::vector<std::string>>>> answers;
  {
    std::lock_guard<std::mutex> lock(mu_);
    const int64_t now = clock_->SteadyMs();
    auto answer_of = [&](const KvWaiter& waiter) -> std::optional<Status> {
      if (shutting_down_) return Status(StatusCode::kUnavailable, "the coordinator is shutting down");
      if (!waiter.ended.empty()) return Status(StatusCode::kFailedPrecondition, waiter.ended);
      if (now >= waiter.deadline_ms) {
        return Status(StatusCode::kDeadlineExceeded,
                      "rendezvous keys not published within " + std::to_string(waiter.timeout_ms) + " ms");
      }
      return std::nullopt;
    };
    for (auto it = kv_waiters_.begin(); it != kv_waiters_.end();) {
      if (std::optional<Status> error = answer_of(*it->second)) {
        answers.emplace_back(it->second, *error);
        it = kv_waiters_.erase(it);
      } else {
        ++it;
      }
    }
    // The delayed: their values once their time comes (an error first where there is one).
    for (auto it = kv_delayed_.begin(); it != kv_delayed_.end();) {
      std::optional<Status> error = answer_of(*it->first);
      if (error || now >= it->first->answer_at_ms) {
        answers.emplace_back(it->first, error ? StatusOr<std::vector<std::string>>(*error)
                                               : StatusOr<std::vector<std::string>>(std::move(it->second)));
        it = kv_delayed_.erase(it);
      } else {
        ++it;
      }
    }
  }
  for (auto& [waiter, answer] : answers) waiter->done(std::move(answer));
}

}  // namespace ltrain::launcher
