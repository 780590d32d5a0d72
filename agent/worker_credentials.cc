#include "agent/worker_credentials.h"

#include <random>

#include "common/transport_security.h"

namespace ltrain::agent {

std::string WorkerCredentials::Issue(const std::string& job_id, int generation, const std::string& rendezvous_scope) {
  std::random_device random;  // getrandom(2) on Linux
  static const char kHex[] = "0123456789abcdef";
  std::string secret;
  for (int i = 0; i < 8; ++i) {  // 256 bits
    const unsigned int word = random();
    for (int k = 0; k < 8; ++k) secret += kHex[(word >> (4 * k)) & 15];
  }
  std::lock_guard<std::mutex> lock(mu_);
  auto& [current, grant] = by_job_[job_id];
  if (!current.empty() && grant.generation > generation) return "";  // an older generation starts late: none
  // A rank replaced in place joins the running workers of its generation, who keep their secret.
  if (!current.empty() && grant.generation == generation) return current;
  current = secret;
  grant = WorkerGrant{job_id, generation, rendezvous_scope};
  return secret;
}

void WorkerCredentials::Revoke(const std::string& job_id, int generation) {
  std::lock_guard<std::mutex> lock(mu_);
  auto found = by_job_.find(job_id);
  if (found != by_job_.end() && found->second.second.generation <= generation) by_job_.erase(found);
}

std::optional<WorkerGrant> WorkerCredentials::Find(std::string_view authorization) const {
  constexpr std::string_view kBearer = "Bearer ";
  if (authorization.substr(0, kBearer.size()) != kBearer) return std::nullopt;
  const std::string_view presented = authorization.substr(kBearer.size());
  std::lock_guard<std::mutex> lock(mu_);
  std::optional<WorkerGrant> found;
  for (const auto& [job, entry] : by_job_) {
    if (SameSecret(entry.first, presented) && !entry.first.empty()) found = entry.second;
  }
  return found;
}

}  // namespace ltrain::agent
