// The coordinator's state in an etcd cluster (`ltrain coordinator --state etcd://...`), so that it
// outlives the coordinator's host and several coordinators can take turns leading (leader_election.h).
//
// Keys, under the URL's prefix P (values are the protobuf messages of ltrain.proto unless said):
//   P/leader                    the leading coordinator's address, on its lease (leader_election.h)
//   P/counter/jobs/NAME         the last job number given to NAME, in decimal (P/counter/jobs: the one
//                               counter across names of earlier versions, where new names start)
//   P/jobs/ID                   v1::Job without its ranks
//   P/ranks/ID/RANK             v1::RankInfo, RANK zero-padded to 8 digits
//   P/checkpoints/ID/STEP       "GENERATION PATH UNIX_MS" of each commit, STEP padded to 20 digits
//   P/nodes/NODE                "SEEN_MS" and a newline, then v1::NodeFacts
//   P/events/ID/SEQ, P/logs/ID/SEQ   v1::Event, SEQ padded to 20 digits
//
// Fencing: once SetFence is given the leader key's creation revision, every write is a transaction
// that holds only while that key is still the one this coordinator created. A coordinator whose
// lease expired (it stalled, or lost etcd) can then write nothing: its writes fail with
// FailedPrecondition and `on_fenced` is called once, so that it steps down instead of overwriting
// the new leader's state.
#pragma once

#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "launcher/etcd_client.h"
#include "launcher/state_store.h"

namespace ltrain::launcher {

class EtcdStateStore : public StateStore {
 public:
  EtcdStateStore(std::shared_ptr<EtcdClient> client, std::string prefix);

  // From now on, writes hold only while `key` has this creation revision.
  void SetFence(const std::string& key, int64_t create_revision, std::function<void(const std::string&)> on_fenced);

  StatusOr<v1::Job> CreateJob(const std::string& name, const std::string& recipe_yaml, int world_size,
                              int64_t now_ms) override;
  Status UpdateJob(const v1::Job& job) override;
  StatusOr<v1::Job> GetJob(const std::string& job_id) override;
  StatusOr<std::vector<v1::Job>> ListJobs(int limit) override;
  Status UpsertRank(const std::string& job_id, const v1::RankInfo& rank) override;
  Status ClearRanks(const std::string& job_id) override;
  Status RecordCheckpoint(const std::string& job_id, int64_t step, int generation, const std::string& path,
                          int64_t now_ms) override;
  Status UpsertNode(const std::string& node_id, const v1::NodeFacts& facts, int64_t now_ms) override;
  StatusOr<int64_t> AppendEvent(const v1::Event& event) override;
  StatusOr<std::vector<v1::Event>> EventsAfter(const std::string& job_id, int64_t after_seq) override;
  Status AppendLogs(const std::vector<v1::Event>& lines) override;
  StatusOr<std::vector<v1::Event>> Logs(const std::string& job_id, int rank, int64_t since_unix_ms, int limit) override;
  StatusOr<PruneCounts> PruneBefore(int64_t cutoff_unix_ms) override;
  // Writes made on the batching thread between BeginBatch and CommitBatch go to etcd together, in
  // as few transactions as etcd takes (at most 100 operations each, no key written twice in one).
  bool Batches() const override { return true; }
  void BeginBatch() override;
  Status CommitBatch() override;

  // A checkpoint record as RecordCheckpoint kept it.
  struct CheckpointRecord {
    int64_t step = 0;
    int generation = 0;
    std::string path;
    int64_t unix_ms = 0;
  };
  StatusOr<std::vector<CheckpointRecord>> Checkpoints(const std::string& job_id);

 private:
  std::string Key(const std::string& part) const { return prefix_ + "/" + part; }
  // Applies `ops` (each a put or a delete) in one transaction, fenced; more than etcd takes in one
  // transaction go in several, in order.
  Status Write(std::vector<etcdserverpb::RequestOp> ops, const std::string& what);
  // Sends `ops` now, in as many fenced transactions as they need.
  Status Apply(std::vector<etcdserverpb::RequestOp> ops, const std::string& what);
  // The fence's compare, when there is one.
  bool AddFence(etcdserverpb::TxnRequest& txn);
  // After a failed fenced transaction: FailedPrecondition when the fence is what failed.
  Status CheckFence(const std::string& what);

  std::shared_ptr<EtcdClient> client_;
  const std::string prefix_;
  std::mutex mu_;
  std::string fence_key_;
  int64_t fence_revision_ = 0;
  bool fenced_ = false;
  std::function<void(const std::string&)> on_fenced_;
  bool batching_ = false;
  std::thread::id batch_thread_;
  std::vector<etcdserverpb::RequestOp> batch_;
  std::string batch_what_;
};

}  // namespace ltrain::launcher
