// The coordinator's persistence: jobs, their ranks, nodes and events. The SQLite store is the
// embedded default; a job's spec and history survive the coordinator. Thread-safe: every method may
// be called from any gRPC handler thread.
#pragma once

#include <memory>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "common/status.h"
#include "ltrain/v1/ltrain.pb.h"

struct sqlite3;
struct sqlite3_stmt;

namespace ltrain::launcher {

// What PruneBefore removed.
struct PruneCounts {
  int64_t jobs = 0;
  int64_t events = 0;
  int64_t log_lines = 0;
};

// Errors: Unavailable when the write may succeed later (a full disk, an I/O error, a lock another
// process holds too long), anything else when the write itself is refused.
class StateStore {
 public:
  virtual ~StateStore() = default;
  // Creates a job; its id is "<name>-<n>", n counting the jobs of that name (1 for the first), never
  // given twice in this store.
  virtual StatusOr<v1::Job> CreateJob(const std::string& name, const std::string& recipe_yaml, int world_size,
                                      int64_t now_ms) = 0;
  virtual Status UpdateJob(const v1::Job& job) = 0;  // state, cause, generation, progress
  virtual StatusOr<v1::Job> GetJob(const std::string& job_id) = 0;  // with its ranks
  virtual StatusOr<std::vector<v1::Job>> ListJobs(int limit) = 0;   // newest first, without ranks
  virtual Status UpsertRank(const std::string& job_id, const v1::RankInfo& rank) = 0;
  // Every rank of a placement at once: all or none (SQLite: one transaction; by default one
  // UpsertRank each, which a batching store applies together).
  virtual Status UpsertRanks(const std::string& job_id, const std::vector<v1::RankInfo>& ranks) {
    for (const v1::RankInfo& rank : ranks) LTRAIN_RETURN_IF_ERROR(UpsertRank(job_id, rank));
    return Status::Ok();
  }
  virtual Status ClearRanks(const std::string& job_id) = 0;  // a new generation starts
  // The checkpoint ledger: every commit a job reported.
  virtual Status RecordCheckpoint(const std::string& job_id, int64_t step, int generation, const std::string& path,
                                  int64_t now_ms) = 0;
  virtual Status UpsertNode(const std::string& node_id, const v1::NodeFacts& facts, int64_t now_ms) = 0;
  virtual StatusOr<int64_t> AppendEvent(const v1::Event& event) = 0;  // returns its seq
  virtual StatusOr<std::vector<v1::Event>> EventsAfter(const std::string& job_id, int64_t after_seq) = 0;
  // Workers' log lines, kept so that `ltrain logs` works after the job and the coordinator are gone.
  virtual Status AppendLogs(const std::vector<v1::Event>& lines) = 0;
  virtual StatusOr<std::vector<v1::Event>> Logs(const std::string& job_id, int rank, int64_t since_unix_ms,
                                                int limit) = 0;
  // Retention: removes the jobs that ended before `cutoff_unix_ms` with their ranks, events,
  // checkpoint records and logs, every job's log lines older than the cutoff, and nodes not seen
  // since. Running jobs and their events stay.
  virtual StatusOr<PruneCounts> PruneBefore(int64_t cutoff_unix_ms) = 0;
  // Batches, for a store whose writes cost a round trip each (etcd): when Batches() is true, the
  // coordinator's writer (state_writer.h) calls BeginBatch, then several writes, which may return
  // Ok before they are applied, then CommitBatch, which applies them in order or says why not.
  virtual bool Batches() const { return false; }
  virtual void BeginBatch() {}
  virtual Status CommitBatch() { return Status::Ok(); }
};

class SqliteStateStore : public StateStore {
 public:
  // Opens (creating if needed) the database at `path`; ":memory:" for tests.
  static StatusOr<std::unique_ptr<SqliteStateStore>> Open(const std::string& path);
  ~SqliteStateStore() override;

  StatusOr<v1::Job> CreateJob(const std::string& name, const std::string& recipe_yaml, int world_size,
                              int64_t now_ms) override;
  Status UpdateJob(const v1::Job& job) override;
  StatusOr<v1::Job> GetJob(const std::string& job_id) override;
  StatusOr<std::vector<v1::Job>> ListJobs(int limit) override;
  Status UpsertRank(const std::string& job_id, const v1::RankInfo& rank) override;
  Status UpsertRanks(const std::string& job_id, const std::vector<v1::RankInfo>& ranks) override;
  Status ClearRanks(const std::string& job_id) override;
  Status RecordCheckpoint(const std::string& job_id, int64_t step, int generation, const std::string& path,
                          int64_t now_ms) override;
  Status UpsertNode(const std::string& node_id, const v1::NodeFacts& facts, int64_t now_ms) override;
  StatusOr<int64_t> AppendEvent(const v1::Event& event) override;
  StatusOr<std::vector<v1::Event>> EventsAfter(const std::string& job_id, int64_t after_seq) override;
  Status AppendLogs(const std::vector<v1::Event>& lines) override;
  StatusOr<std::vector<v1::Event>> Logs(const std::string& job_id, int rank, int64_t since_unix_ms, int limit) override;
  StatusOr<PruneCounts> PruneBefore(int64_t cutoff_unix_ms) override;
  // Caps the database at about `max_bytes` (0: no cap). Writes past it fail as a full disk would.
  Status LimitSize(int64_t max_bytes);

 private:
  explicit SqliteStateStore(sqlite3* db) : db_(db) {}
  Status Exec(const std::string& sql);
  // The statement of `sql` prepared once and kept (the writes made per rank and per node: a job of
  // 80,000 ranks records each). Under mu_; `sql` a literal, its address the key.
  sqlite3_stmt* Prepared(const char* sql);
  Status UpsertRankLocked(const std::string& job_id, const v1::RankInfo& rank);  // under mu_

  std::mutex mu_;
  sqlite3* db_;
  std::map<const char*, sqlite3_stmt*> prepared_;
};

const char* JobStateName(v1::JobState state);  // "RUNNING", ...
bool IsFinal(v1::JobState state);

}  // namespace ltrain::launcher
