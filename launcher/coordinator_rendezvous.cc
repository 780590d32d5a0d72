// The coordinator's rendezvous store (RendezvousService): the workers' keys, bounded per job, and the
// Gets that wait for them without a thread. Part of Coordinator (coordinator.h).
#include "launcher/coordinator.h"

#include <algorithm>
#include <limits>
#include <optional>

namespace ltrain::launcher {
namespace {

// A rendezvous key's parts: JOB/GENERATION/NAME.
struct KeyParts {
  std::string job_id;
  std::string generation;
  std::string scope;  // "JOB/GENERATION/", the prefix every key of that generation has
};

std::optional<KeyParts> PartsOf(const std::string& key) {
  const size_t slash = key.find('/');
  const size_t second = slash == std::string::npos ? std::string::npos : key.find('/', slash + 1);
  if (second == std::string::npos) return std::nullopt;
  return KeyParts{key.substr(0, slash), key.substr(slash + 1, second - slash - 1), key.substr(0, second + 1)};
}

// "job J generation G" of a key (the key itself where it has no such parts).
std::string ScopeOf(const std::string& key) {
  const std::optional<KeyParts> parts = PartsOf(key);
  if (!parts) return "key " + key.substr(0, 200);
  return "job " + parts->job_id + " generation " + parts->generation;
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
  const std::optional<KeyParts> parts = PartsOf(key);
  if (!parts) return InvalidArgument("a rendezvous key is JOB/GENERATION/NAME");
  const std::string& job_id = parts->job_id;
  std::vector<std::pair<std::shared_ptr<KvWaiter>, std::vector<std::string>>> ready;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto job = jobs_.find(job_id);
    if (job == jobs_.end() || IsFinal(job->second.job.state())) {
      return InvalidArgument("rendezvous key " + key.substr(0, 200) + ": job " + job_id.substr(0, 200) +
                             " is not running on this coordinator");
    }
    if (parts->generation != std::to_string(job->second.job.generation())) {
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

Status Coordinator::RunningGenerationKeysLocked(const std::vector<std::string>& keys) {
  if (keys.empty()) return Status::Ok();
  const std::string& first = keys.front();
  const std::optional<KeyParts> parts = PartsOf(first);
  const ActiveJob* job = parts ? FindLocked(parts->job_id) : nullptr;
  const bool running =
      job != nullptr && job->job.state() == v1::JOB_STATE_RUNNING &&
      parts->generation == std::to_string(job->job.generation()) &&
      std::all_of(keys.begin(), keys.end(), [&](const std::string& k) { return k.rfind(parts->scope, 0) == 0; });
  if (running) return Status::Ok();
  return Status(StatusCode::kFailedPrecondition,
                "rendezvous keys " + first.substr(0, 200) + (keys.size() > 1 ? ", ..." : "") + ": " +
                    (job == nullptr ? "no such job runs on this coordinator"
                                    : "not all of the job's running generation (" +
                                          std::string(JobStateName(job->job.state())) + ", generation " +
                                          std::to_string(job->job.generation()) + ")"));
}

void Coordinator::KvGetAsync(std::vector<std::string> keys, int64_t timeout_ms, KvDone done,
                             bool while_generation_lives) {
  StatusOr<std::vector<std::string>> answer = Status(StatusCode::kUnavailable, "the coordinator is shutting down");
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (shutting_down_) {
      // answered below
    } else if (Status refused = while_generation_lives ? RunningGenerationKeysLocked(keys) : Status::Ok();
               !refused.ok()) {
      answer = std::move(refused);
    } else {
      auto missing = std::find_if(keys.begin(), keys.end(), [&](const std::string& k) { return kv_.count(k) == 0; });
      std::vector<std::string> values;
      if (missing == keys.end()) {
        for (const auto& k : keys) values.push_back(kv_[k]);
      }
      if (missing == keys.end() && options_.rendezvous_answer_delay_ms <= 0) {
        answer = std::move(values);
      } else {
        // A waiter: under its first missing key, or (every key set, the answer held back) among the delayed.
        const int64_t steady = clock_->SteadyMs();
        auto waiter = std::make_shared<KvWaiter>();
        waiter->timeout_ms = BoundedWaitMs(timeout_ms);
        waiter->deadline_ms = while_generation_lives ? std::numeric_limits<int64_t>::max() : steady + waiter->timeout_ms;
        waiter->answer_at_ms = steady + options_.rendezvous_answer_delay_ms;
        waiter->done = std::move(done);
        if (missing != keys.end()) {
          const std::string first = *missing;
          waiter->keys = std::move(keys);
          kv_waiters_.emplace(first, std::move(waiter));
        } else {
          waiter->keys = std::move(keys);
          kv_delayed_.emplace_back(std::move(waiter), std::move(values));
        }
        return;
      }
    }
  }
  done(std::move(answer));
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
