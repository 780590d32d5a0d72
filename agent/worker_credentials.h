// The secrets with which a job's workers reach their agent's loopback services (rendezvous keys,
// progress reports). One per job generation, created when it starts and handed to its workers in a
// 0600 file (LTRAIN_AGENT_SECRET_FILE), never the cluster token. The agent serves a caller only what
// its secret's job generation may touch: keys under its rendezvous scope, progress of its own ranks.
// A generation's secret is revoked once its last worker on this node is gone (or a newer generation
// starts): a process that kept it (a leftover, a copy of the file) reaches nothing with it.
#pragma once

#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>

namespace ltrain::agent {

struct WorkerGrant {
  std::string job_id;
  int generation = 0;
  std::string rendezvous_scope;  // the prefix of every key the generation may read and write
};

class WorkerCredentials {
 public:
  // A new random secret for the job's `generation`; the job's older generations lose theirs.
  std::string Issue(const std::string& job_id, int generation, const std::string& rendezvous_scope);
  // The grant of the "Bearer SECRET" in an authorization header, compared in constant time; nullopt
  // for anything else.
  std::optional<WorkerGrant> Find(std::string_view authorization) const;
  // The job's secret, when it is that of `generation` or an older one: gone.
  void Revoke(const std::string& job_id, int generation);

 private:
  mutable std::mutex mu_;
  std::map<std::string, std::pair<std::string, WorkerGrant>> by_job_;  // job id -> secret, grant
};

}  // namespace ltrain::agent
