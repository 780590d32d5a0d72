#include "launcher/etcd_state_store.h"

#include <algorithm>
#include <cstdio>
#include <map>
#include <set>
#include <sstream>

#include "common/logging.h"

namespace ltrain::launcher {
namespace {

constexpr char kLog[] = "state";
// etcd takes at most 128 operations in one transaction (--max-txn-ops); one is the fence's.
constexpr size_t kOpsPerTxn = 100;

std::string Pad(int64_t n, int width) {
  char buffer[32];
  std::snprintf(buffer, sizeof(buffer), "%0*lld", width, static_cast<long long>(n));
  return buffer;
}

etcdserverpb::RequestOp PutOp(const std::string& key, const std::string& value) {
  etcdserverpb::RequestOp op;
  op.mutable_request_put()->set_key(key);
  op.mutable_request_put()->set_value(value);
  return op;
}

etcdserverpb::RequestOp DeleteOp(const std::string& key, const std::string& range_end = "") {
  etcdserverpb::RequestOp op;
  op.mutable_request_delete_range()->set_key(key);
  op.mutable_request_delete_range()->set_range_end(range_end);
  return op;
}

template <typename Message>
Status ParseValue(const std::string& bytes, const std::string& key, Message* out) {
  if (!out->ParseFromString(bytes)) return DataLoss("the value of " + key + " in etcd does not parse");
  return Status::Ok();
}

}  // namespace

EtcdStateStore::EtcdStateStore(std::shared_ptr<EtcdClient> client, std::string prefix)
    : client_(std::move(client)), prefix_(std::move(prefix)) {}

void EtcdStateStore::SetFence(const std::string& key, int64_t create_revision,
                              std::function<void(const std::string&)> on_fenced) {
  std::lock_guard<std::mutex> lock(mu_);
  fence_key_ = key;
  fence_revision_ = create_revision;
  on_fenced_ = std::move(on_fenced);
}

bool EtcdStateStore::AddFence(etcdserverpb::TxnRequest& txn) {
  std::lock_guard<std::mutex> lock(mu_);
  if (fence_key_.empty()) return false;
  etcdserverpb::Compare* compare = txn.add_compare();
  compare->set_result(etcdserverpb::Compare::EQUAL);
  compare->set_target(etcdserverpb::Compare::CREATE);
  compare->set_key(fence_key_);
  compare->set_create_revision(fence_revision_);
  return true;
}

Status EtcdStateStore::CheckFence(const std::string& what) {
  std::string key;
  int64_t revision = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    key = fence_key_;
    revision = fence_revision_;
  }
  if (key.empty()) return Status::Ok();
  LTRAIN_ASSIGN_OR_RETURN(etcdserverpb::RangeResponse leader, client_->Range(key));
  if (leader.kvs_size() == 1 && leader.kvs(0).create_revision() == revision) return Status::Ok();
  const std::string why = "this coordinator no longer leads (" + key +
                          (leader.kvs_size() == 1 ? " now names " + leader.kvs(0).value() : std::string(" is gone")) +
                          "), so it may not " + what;
  std::function<void(const std::string&)> on_fenced;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!fenced_) on_fenced = on_fenced_;
    fenced_ = true;
  }
  if (on_fenced) on_fenced(why);
  return FailedPrecondition(why);
}

namespace {

// Whether `key` is in the range an operation deletes.
bool InRange(const std::string& key, const etcdserverpb::DeleteRangeRequest& range) {
  if (range.range_end().empty()) return key == range.key();
  return key >= range.key() && (range.range_end() == std::string(1, '\0') || key < range.range_end());
}

// Splits `ops` into transactions etcd takes: at most kOpsPerTxn operations, no key put twice (the
// later put replaces the earlier, which changes nothing else in the same transaction) and no put
// inside a range deleted in the same transaction (then a new transaction starts, keeping order).
std::vector<std::vector<etcdserverpb::RequestOp>> SplitIntoTxns(std::vector<etcdserverpb::RequestOp> ops) {
  std::vector<std::vector<etcdserverpb::RequestOp>> txns(1);
  std::map<std::string, size_t> put_at;  // key -> index in the current transaction
  std::vector<size_t> deletes;           // indexes of deletes in the current transaction
  for (auto& op : ops) {
    auto& current = txns.back();
    bool conflict = current.size() >= kOpsPerTxn;
    if (op.has_request_put()) {
      const std::string& key = op.request_put().key();
      if (!conflict) {
        if (auto found = put_at.find(key); found != put_at.end()) {
          current[found->second] = std::move(op);
          continue;
        }
        for (size_t d : deletes) conflict |= InRange(key, current[d].request_delete_range());
      }
    } else {
      for (const auto& [key, index] : put_at) conflict |= InRange(key, op.request_delete_range());
    }
    if (conflict) {
      txns.emplace_back();
      put_at.clear();
      deletes.clear();
    }
    auto& target = txns.back();
    if (op.has_request_put()) {
      put_at[op.request_put().key()] = target.size();
    } else {
      deletes.push_back(target.size());
    }
    target.push_back(std::move(op));
  }
  if (txns.back().empty()) txns.pop_back();
  return txns;
}

}  // namespace

void EtcdStateStore::BeginBatch() {
  std::lock_guard<std::mutex> lock(mu_);
  batching_ = true;
  batch_thread_ = std::this_thread::get_id();
  batch_.clear();
  batch_what_.clear();
}

Status EtcdStateStore::CommitBatch() {
  std::vector<etcdserverpb::RequestOp> ops;
  std::string what;
  {
    std::lock_guard<std::mutex> lock(mu_);
    batching_ = false;
    ops.swap(batch_);
    what.swap(batch_what_);
  }
  return Apply(std::move(ops), what);
}

Status EtcdStateStore::Write(std::vector<etcdserverpb::RequestOp> ops, const std::string& what) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (batching_ && std::this_thread::get_id() == batch_thread_) {
      for (auto& op : ops) batch_.push_back(std::move(op));
      if (batch_what_.empty()) batch_what_ = what;
      else if (batch_what_.find(" and more") == std::string::npos) batch_what_ += " and more";
      return Status::Ok();
    }
  }
  return Apply(std::move(ops), what);
}

Status EtcdStateStore::Apply(std::vector<etcdserverpb::RequestOp> ops, const std::string& what) {
  for (auto& ops_of_txn : SplitIntoTxns(std::move(ops))) {
    etcdserverpb::TxnRequest txn;
    AddFence(txn);
    for (auto& op : ops_of_txn) *txn.add_success() = std::move(op);
    LTRAIN_ASSIGN_OR_RETURN(etcdserverpb::TxnResponse response, client_->Txn(txn));
    if (!response.succeeded()) {
      LTRAIN_RETURN_IF_ERROR(CheckFence(what));
      // The fence held on a second look: the leader key changed and came back, which cannot be.
      return Internal("etcd refused to " + what + " for a reason it did not give");
    }
  }
  return Status::Ok();
}

StatusOr<v1::Job> EtcdStateStore::CreateJob(const std::string& name, const std::string& recipe_yaml, int world_size,
                                            int64_t now_ms) {
  // Job numbers count per name (counter/jobs/NAME). A name without a counter starts after the one
  // counter across names that earlier versions kept (counter/jobs), so that no id comes again.
  const std::string legacy = Key("counter/jobs");
  const std::string counter = Key("counter/jobs/" + name);
  auto number_of = [&](const etcdserverpb::RangeResponse& found, const std::string& key) -> StatusOr<int64_t> {
    if (found.kvs_size() != 1) return int64_t{0};
    try {
      return std::stoll(found.kvs(0).value());
    } catch (...) {
      return DataLoss("the job counter " + key + " in etcd is not a number");
    }
  };
  for (int attempt = 0; attempt < 50; ++attempt) {
    LTRAIN_ASSIGN_OR_RETURN(etcdserverpb::RangeResponse current, client_->Range(counter));
    LTRAIN_ASSIGN_OR_RETURN(int64_t last, number_of(current, counter));
    const int64_t mod_revision = current.kvs_size() == 1 ? current.kvs(0).mod_revision() : 0;
    if (current.kvs_size() == 0) {
      LTRAIN_ASSIGN_OR_RETURN(etcdserverpb::RangeResponse before, client_->Range(legacy));
      LTRAIN_ASSIGN_OR_RETURN(last, number_of(before, legacy));
    }
    v1::Job job;
    job.set_id(name + "-" + std::to_string(last + 1));
    job.set_name(name);
    job.set_state(v1::JOB_STATE_PENDING);
    job.set_recipe_yaml(recipe_yaml);
    job.set_world_size(world_size);
    job.set_created_unix_ms(now_ms);
    job.set_updated_unix_ms(now_ms);
    etcdserverpb::TxnRequest txn;
    AddFence(txn);
    etcdserverpb::Compare* unchanged = txn.add_compare();
    unchanged->set_result(etcdserverpb::Compare::EQUAL);
    unchanged->set_target(etcdserverpb::Compare::MOD);
    unchanged->set_key(counter);
    unchanged->set_mod_revision(mod_revision);  // 0: the key does not exist yet
    etcdserverpb::Compare* fresh = txn.add_compare();  // and no job holds the id
    fresh->set_result(etcdserverpb::Compare::EQUAL);
    fresh->set_target(etcdserverpb::Compare::CREATE);
    fresh->set_key(Key("jobs/" + job.id()));
    fresh->set_create_revision(0);
    *txn.add_success() = PutOp(counter, std::to_string(last + 1));
    *txn.add_success() = PutOp(Key("jobs/" + job.id()), job.SerializeAsString());
    LTRAIN_ASSIGN_OR_RETURN(etcdserverpb::TxnResponse response, client_->Txn(txn));
    if (response.succeeded()) return job;
    // Another writer took the number (or this coordinator lost the lead): look again.
    LTRAIN_RETURN_IF_ERROR(CheckFence("create a job"));
    LTRAIN_ASSIGN_OR_RETURN(etcdserverpb::RangeResponse taken, client_->Range(Key("jobs/" + job.id())));
    if (taken.kvs_size() == 1) {  // a job of an earlier counter holds the id: step over it
      Status stepped = Write({PutOp(counter, std::to_string(last + 1))}, "number a job");
      if (!stepped.ok()) return stepped;
    }
  }
  return Unavailable("could not take a job number in etcd after 50 tries; the counter " + counter +
                     " keeps changing under this coordinator");
}

Status EtcdStateStore::UpdateJob(const v1::Job& job) {
  v1::Job stored = job;
  stored.clear_ranks();
  return Write({PutOp(Key("jobs/" + job.id()), stored.SerializeAsString())}, "update job " + job.id());
}

StatusOr<v1::Job> EtcdStateStore::GetJob(const std::string& job_id) {
  const std::string key = Key("jobs/" + job_id);
  LTRAIN_ASSIGN_OR_RETURN(etcdserverpb::RangeResponse found, client_->Range(key));
  if (found.kvs_size() == 0) return NotFound("no job '" + job_id + "'; `ltrain status` lists the jobs");
  v1::Job job;
  LTRAIN_RETURN_IF_ERROR(ParseValue(found.kvs(0).value(), key, &job));
  const std::string ranks = Key("ranks/" + job_id + "/");
  LTRAIN_ASSIGN_OR_RETURN(etcdserverpb::RangeResponse rows, client_->Range(ranks, PrefixEnd(ranks)));
  for (const auto& kv : rows.kvs()) LTRAIN_RETURN_IF_ERROR(ParseValue(kv.value(), kv.key(), job.add_ranks()));
  return job;
}

StatusOr<std::vector<v1::Job>> EtcdStateStore::ListJobs(int limit) {
  const std::string jobs = Key("jobs/");
  LTRAIN_ASSIGN_OR_RETURN(etcdserverpb::RangeResponse rows, client_->Range(jobs, PrefixEnd(jobs)));
  std::vector<std::pair<int64_t, v1::Job>> made;  // by the revision that created each
  for (const auto& kv : rows.kvs()) {
    auto& [revision, job] = made.emplace_back(kv.create_revision(), v1::Job());
    LTRAIN_RETURN_IF_ERROR(ParseValue(kv.value(), kv.key(), &job));
  }
  // Newest first (job numbers count per name: they do not order jobs of several names).
  std::sort(made.begin(), made.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  std::vector<v1::Job> listed;
  for (auto& [revision, job] : made) listed.push_back(std::move(job));
  if (limit > 0 && listed.size() > static_cast<size_t>(limit)) listed.resize(limit);
  return listed;
}

Status EtcdStateStore::UpsertRank(const std::string& job_id, const v1::RankInfo& rank) {
  return Write({PutOp(Key("ranks/" + job_id + "/" + Pad(rank.rank(), 8)), rank.SerializeAsString())},
               "record a rank of " + job_id);
}

Status EtcdStateStore::ClearRanks(const std::string& job_id) {
  const std::string ranks = Key("ranks/" + job_id + "/");
  return Write({DeleteOp(ranks, PrefixEnd(ranks))}, "clear the ranks of " + job_id);
}

Status EtcdStateStore::RecordCheckpoint(const std::string& job_id, int64_t step, int generation,
                                        const std::string& path, int64_t now_ms) {
  return Write({PutOp(Key("checkpoints/" + job_id + "/" + Pad(step, 20)),
                      std::to_string(generation) + " " + std::to_string(now_ms) + " " + path)},
               "record the checkpoint of step " + std::to_string(step) + " of " + job_id);
}

StatusOr<std::vector<EtcdStateStore::CheckpointRecord>> EtcdStateStore::Checkpoints(const std::string& job_id) {
  const std::string prefix = Key("checkpoints/" + job_id + "/");
  LTRAIN_ASSIGN_OR_RETURN(etcdserverpb::RangeResponse rows, client_->Range(prefix, PrefixEnd(prefix)));
  std::vector<CheckpointRecord> records;
  for (const auto& kv : rows.kvs()) {
    CheckpointRecord& record = records.emplace_back();
    record.step = std::stoll(kv.key().substr(prefix.size()));
    std::istringstream in(kv.value());
    in >> record.generation >> record.unix_ms;
    in.get();
    std::getline(in, record.path);
  }
  return records;
}

Status EtcdStateStore::UpsertNode(const std::string& node_id, const v1::NodeFacts& facts, int64_t now_ms) {
  return Write({PutOp(Key("nodes/" + node_id), std::to_string(now_ms) + "\n" + facts.SerializeAsString())},
               "record node " + node_id);
}

StatusOr<int64_t> EtcdStateStore::AppendEvent(const v1::Event& event) {
  LTRAIN_RETURN_IF_ERROR(Write({PutOp(Key("events/" + event.job_id() + "/" + Pad(event.seq(), 20)),
                                      event.SerializeAsString())},
                               "append an event of " + event.job_id()));
  return event.seq();
}

StatusOr<std::vector<v1::Event>> EtcdStateStore::EventsAfter(const std::string& job_id, int64_t after_seq) {
  const std::string prefix = Key("events/" + job_id + "/");
  LTRAIN_ASSIGN_OR_RETURN(etcdserverpb::RangeResponse rows,
                          client_->Range(prefix + Pad(std::max<int64_t>(0, after_seq + 1), 20), PrefixEnd(prefix)));
  std::vector<v1::Event> events;
  for (const auto& kv : rows.kvs()) LTRAIN_RETURN_IF_ERROR(ParseValue(kv.value(), kv.key(), &events.emplace_back()));
  return events;
}

Status EtcdStateStore::AppendLogs(const std::vector<v1::Event>& lines) {
  std::vector<etcdserverpb::RequestOp> ops;
  for (const auto& line : lines) {
    ops.push_back(PutOp(Key("logs/" + line.job_id() + "/" + Pad(line.seq(), 20)), line.SerializeAsString()));
  }
  if (ops.empty()) return Status::Ok();
  return Write(std::move(ops), "append log lines of " + lines.front().job_id());
}

StatusOr<std::vector<v1::Event>> EtcdStateStore::Logs(const std::string& job_id, int rank, int64_t since_unix_ms,
                                                      int limit) {
  const std::string prefix = Key("logs/" + job_id + "/");
  LTRAIN_ASSIGN_OR_RETURN(etcdserverpb::RangeResponse rows, client_->Range(prefix, PrefixEnd(prefix)));
  std::vector<v1::Event> lines;
  for (const auto& kv : rows.kvs()) {
    v1::Event line;
    LTRAIN_RETURN_IF_ERROR(ParseValue(kv.value(), kv.key(), &line));
    if ((rank >= 0 && line.rank() != rank) || line.unix_ms() < since_unix_ms) continue;
    lines.push_back(std::move(line));
  }
  // The newest `limit` lines, oldest first.
  if (limit > 0 && lines.size() > static_cast<size_t>(limit)) lines.erase(lines.begin(), lines.end() - limit);
  return lines;
}

StatusOr<PruneCounts> EtcdStateStore::PruneBefore(int64_t cutoff_unix_ms) {
  PruneCounts counts;
  LTRAIN_ASSIGN_OR_RETURN(std::vector<v1::Job> jobs, ListJobs(0));
  std::vector<etcdserverpb::RequestOp> ops;
  std::set<std::string> pruned;  // job ids
  for (const auto& job : jobs) {
    if (!IsFinal(job.state()) || job.updated_unix_ms() >= cutoff_unix_ms) continue;
    ++counts.jobs;
    pruned.insert(job.id());
    for (const char* part : {"events/", "ranks/", "checkpoints/", "logs/"}) {
      const std::string prefix = Key(part + job.id() + "/");
      if (std::string(part) == "events/" || std::string(part) == "logs/") {
        LTRAIN_ASSIGN_OR_RETURN(int64_t count, client_->Count(prefix, PrefixEnd(prefix)));
        (std::string(part) == "events/" ? counts.events : counts.log_lines) += count;
      }
      ops.push_back(DeleteOp(prefix, PrefixEnd(prefix)));
    }
    ops.push_back(DeleteOp(Key("jobs/" + job.id())));
  }
  // Every other job's log lines older than the cutoff (keys P/logs/JOB/SEQ), and nodes not seen since.
  const std::string logs = Key("logs/");
  LTRAIN_ASSIGN_OR_RETURN(etcdserverpb::RangeResponse lines, client_->Range(logs, PrefixEnd(logs)));
  for (const auto& kv : lines.kvs()) {
    const std::string job_id = kv.key().substr(logs.size(), kv.key().rfind('/') - logs.size());
    if (pruned.count(job_id)) continue;
    v1::Event line;
    if (line.ParseFromString(kv.value()) && line.unix_ms() < cutoff_unix_ms) {
      ops.push_back(DeleteOp(kv.key()));
      ++counts.log_lines;
    }
  }
  const std::string nodes = Key("nodes/");
  LTRAIN_ASSIGN_OR_RETURN(etcdserverpb::RangeResponse seen, client_->Range(nodes, PrefixEnd(nodes)));
  for (const auto& kv : seen.kvs()) {
    int64_t seen_ms = 0;
    try {
      seen_ms = std::stoll(kv.value().substr(0, kv.value().find('\n')));
    } catch (...) {
    }
    if (seen_ms < cutoff_unix_ms) ops.push_back(DeleteOp(kv.key()));
  }
  LTRAIN_RETURN_IF_ERROR(Write(std::move(ops), "remove old records"));
  if (counts.jobs > 0) LTRAIN_LOG(kInfo, kLog) << "removed " << counts.jobs << " old job(s) from etcd";
  return counts;
}

}  // namespace ltrain::launcher
