#include "launcher/state_store.h"

#include <algorithm>
#include <cmath>

#include <sqlite3.h>

#include <functional>

namespace ltrain::launcher {
namespace {

constexpr const char* kSchema = R"sql(
CREATE TABLE IF NOT EXISTS jobs (
  seq INTEGER PRIMARY KEY AUTOINCREMENT,
  id TEXT UNIQUE,
  name TEXT NOT NULL,
  state INTEGER NOT NULL,
  recipe TEXT NOT NULL,
  world_size INTEGER NOT NULL,
  generation INTEGER NOT NULL DEFAULT 0,
  cause TEXT NOT NULL DEFAULT '',
  created_ms INTEGER NOT NULL,
  updated_ms INTEGER NOT NULL,
  last_step INTEGER NOT NULL DEFAULT 0,
  last_loss REAL NOT NULL DEFAULT 0,
  restarts INTEGER NOT NULL DEFAULT 0,
  last_committed_step INTEGER NOT NULL DEFAULT 0,
  last_committed_path TEXT NOT NULL DEFAULT '',
  nodes_now INTEGER NOT NULL DEFAULT 0,
  last_failure TEXT NOT NULL DEFAULT '',
  val_step INTEGER NOT NULL DEFAULT 0,
  val_loss REAL NOT NULL DEFAULT 0,
  total_steps INTEGER NOT NULL DEFAULT 0,
  tokens_per_s REAL NOT NULL DEFAULT 0,
  mfu REAL NOT NULL DEFAULT 0,
  checkpoint_save_ms REAL NOT NULL DEFAULT 0,
  checkpoint_save_bytes INTEGER NOT NULL DEFAULT 0,
  checkpoint_load_ms REAL NOT NULL DEFAULT 0,
  recoveries INTEGER NOT NULL DEFAULT 0,
  lost_steps INTEGER NOT NULL DEFAULT 0,
  last_recovery_ms REAL NOT NULL DEFAULT 0,
  membership_epoch INTEGER NOT NULL DEFAULT 0,
  replacing_rank INTEGER NOT NULL DEFAULT -1,
  members TEXT NOT NULL DEFAULT '',
  fp8 BLOB NOT NULL DEFAULT x'',
  moe BLOB NOT NULL DEFAULT x''
);
CREATE TABLE IF NOT EXISTS checkpoints (
  job_id TEXT NOT NULL,
  step INTEGER NOT NULL,
  generation INTEGER NOT NULL,
  path TEXT NOT NULL,
  unix_ms INTEGER NOT NULL,
  PRIMARY KEY (job_id, step)
);
CREATE TABLE IF NOT EXISTS ranks (
  job_id TEXT NOT NULL,
  rank INTEGER NOT NULL,
  node_id TEXT NOT NULL,
  local_rank INTEGER NOT NULL,
  pid INTEGER NOT NULL,
  state TEXT NOT NULL,
  exit_code INTEGER NOT NULL,
  signal INTEGER NOT NULL,
  log_path TEXT NOT NULL,
  last_step INTEGER NOT NULL DEFAULT 0,
  PRIMARY KEY (job_id, rank)
);
CREATE TABLE IF NOT EXISTS nodes (
  id TEXT PRIMARY KEY,
  hostname TEXT NOT NULL,
  address TEXT NOT NULL,
  gpus INTEGER NOT NULL,
  cpus INTEGER NOT NULL,
  seen_ms INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS events (
  seq INTEGER PRIMARY KEY AUTOINCREMENT,
  job_id TEXT NOT NULL,
  unix_ms INTEGER NOT NULL,
  kind TEXT NOT NULL,
  message TEXT NOT NULL,
  rank INTEGER NOT NULL,
  state INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS events_by_job ON events(job_id, seq);
CREATE TABLE IF NOT EXISTS logs (
  seq INTEGER NOT NULL,
  job_id TEXT NOT NULL,
  unix_ms INTEGER NOT NULL,
  rank INTEGER NOT NULL,
  text TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS logs_by_job ON logs(job_id, unix_ms);
-- Job numbers count per name: quickstart-1, then llama-quickstart-1. The row of the empty name holds
-- the number a new name starts after: 0 in a new database; in one made while numbers were one counter
-- across names, that counter, so that no id (and no checkpoint folder) of an earlier job comes again.
CREATE TABLE IF NOT EXISTS job_numbers (
  name TEXT PRIMARY KEY,
  last INTEGER NOT NULL
);
INSERT OR IGNORE INTO job_numbers (name, last)
  SELECT '', COALESCE((SELECT seq FROM sqlite_sequence WHERE name = 'jobs'), 0);
)sql";

// A prepared statement that finalizes itself.
class Statement {
 public:
  Statement(sqlite3* db, const char* sql) { rc_ = sqlite3_prepare_v2(db, sql, -1, &stmt_, nullptr); }
  // A statement the store keeps (SqliteStateStore::Prepared): reset and unbound after use, not finalized.
  explicit Statement(sqlite3_stmt* kept) : stmt_(kept), rc_(kept != nullptr ? SQLITE_OK : SQLITE_ERROR), kept_(true) {}
  ~Statement() {
    if (!kept_) {
      sqlite3_finalize(stmt_);
    } else if (stmt_ != nullptr) {
      sqlite3_reset(stmt_);
      sqlite3_clear_bindings(stmt_);
    }
  }
  Statement(const Statement&) = delete;
  Statement& operator=(const Statement&) = delete;
  bool ok() const { return rc_ == SQLITE_OK; }
  Statement& Bind(int i, const std::string& v) {
    sqlite3_bind_text(stmt_, i, v.c_str(), static_cast<int>(v.size()), SQLITE_TRANSIENT);
    return *this;
  }
  Statement& Bind(int i, int64_t v) {
    sqlite3_bind_int64(stmt_, i, v);
    return *this;
  }
  Statement& Bind(int i, double v) {
    // SQLite stores a NaN as NULL, which a NOT NULL column refuses (and the whole row's update with
    // it): a diverged run's NaN loss is kept as 0.
    sqlite3_bind_double(stmt_, i, std::isnan(v) ? 0.0 : v);
    return *this;
  }
  Statement& BindBlob(int i, const std::string& v) {
    sqlite3_bind_blob(stmt_, i, v.data(), static_cast<int>(v.size()), SQLITE_TRANSIENT);
    return *this;
  }
  int Step() { return sqlite3_step(stmt_); }
  sqlite3_stmt* raw() { return stmt_; }
  std::string Text(int i) {
    const unsigned char* t = sqlite3_column_text(stmt_, i);
    return t ? reinterpret_cast<const char*>(t) : "";
  }
  std::string Blob(int i) {
    const void* b = sqlite3_column_blob(stmt_, i);
    return b ? std::string(static_cast<const char*>(b), static_cast<size_t>(sqlite3_column_bytes(stmt_, i))) : "";
  }
  int64_t Int(int i) { return sqlite3_column_int64(stmt_, i); }
  double Real(int i) { return sqlite3_column_double(stmt_, i); }

 private:
  sqlite3_stmt* stmt_ = nullptr;
  int rc_;
  bool kept_ = false;
};

// A full disk, an I/O error, a lock held too long by another process or a read-only file may pass:
// the write is worth trying again (Unavailable). Anything else is the write's own fault (Internal).
bool Transient(int code) {
  switch (code & 0xff) {
    case SQLITE_FULL:
    case SQLITE_IOERR:
    case SQLITE_BUSY:
    case SQLITE_LOCKED:
    case SQLITE_READONLY:
    case SQLITE_CANTOPEN:
    case SQLITE_NOMEM:
    case SQLITE_PROTOCOL:
      return true;
    default:
      return false;
  }
}

Status SqlError(sqlite3* db, const std::string& what) {
  std::string message = "state store: " + what + ": " + sqlite3_errmsg(db);
  return Transient(sqlite3_errcode(db)) ? Unavailable(std::move(message)) : Internal(std::move(message));
}

constexpr const char* kJobColumns =
    "id, name, state, recipe, world_size, generation, cause, created_ms, updated_ms, last_step, last_loss, "
    "restarts, last_committed_step, last_committed_path, nodes_now, last_failure, val_step, val_loss, total_steps, "
    "tokens_per_s, mfu, checkpoint_save_ms, checkpoint_save_bytes, checkpoint_load_ms, recoveries, lost_steps, "
    "last_recovery_ms, membership_epoch, replacing_rank, members, fp8, moe";

// Columns added after the first release; a database made before them gets them on open.
constexpr const char* kAddedJobColumns[] = {
    "restarts INTEGER NOT NULL DEFAULT 0", "last_committed_step INTEGER NOT NULL DEFAULT 0",
    "last_committed_path TEXT NOT NULL DEFAULT ''", "nodes_now INTEGER NOT NULL DEFAULT 0",
    "last_failure TEXT NOT NULL DEFAULT ''", "val_step INTEGER NOT NULL DEFAULT 0", "val_loss REAL NOT NULL DEFAULT 0",
    "total_steps INTEGER NOT NULL DEFAULT 0", "tokens_per_s REAL NOT NULL DEFAULT 0", "mfu REAL NOT NULL DEFAULT 0",
    "checkpoint_save_ms REAL NOT NULL DEFAULT 0", "checkpoint_save_bytes INTEGER NOT NULL DEFAULT 0",
    "checkpoint_load_ms REAL NOT NULL DEFAULT 0", "recoveries INTEGER NOT NULL DEFAULT 0",
    "lost_steps INTEGER NOT NULL DEFAULT 0", "last_recovery_ms REAL NOT NULL DEFAULT 0",
    "membership_epoch INTEGER NOT NULL DEFAULT 0", "replacing_rank INTEGER NOT NULL DEFAULT -1",
    "members TEXT NOT NULL DEFAULT ''", "fp8 BLOB NOT NULL DEFAULT x''", "moe BLOB NOT NULL DEFAULT x''"};

v1::Job ReadJob(Statement& s) {
  v1::Job job;
  job.set_id(s.Text(0));
  job.set_name(s.Text(1));
  job.set_state(static_cast<v1::JobState>(s.Int(2)));
  job.set_recipe_yaml(s.Text(3));
  job.set_world_size(static_cast<int32_t>(s.Int(4)));
  job.set_generation(static_cast<int32_t>(s.Int(5)));
  job.set_cause(s.Text(6));
  job.set_created_unix_ms(s.Int(7));
  job.set_updated_unix_ms(s.Int(8));
  job.set_last_step(s.Int(9));
  job.set_last_loss(s.Real(10));
  job.set_restarts(static_cast<int32_t>(s.Int(11)));
  job.set_last_committed_step(s.Int(12));
  job.set_last_committed_path(s.Text(13));
  job.set_nodes_now(static_cast<int32_t>(s.Int(14)));
  job.set_last_failure(s.Text(15));
  job.set_val_step(s.Int(16));
  job.set_val_loss(s.Real(17));
  job.set_total_steps(s.Int(18));
  job.set_tokens_per_s(s.Real(19));
  job.set_mfu(s.Real(20));
  job.set_checkpoint_save_ms(s.Real(21));
  job.set_checkpoint_save_bytes(s.Int(22));
  job.set_checkpoint_load_ms(s.Real(23));
  job.set_recoveries(static_cast<int32_t>(s.Int(24)));
  job.set_lost_steps(s.Int(25));
  job.set_last_recovery_ms(s.Real(26));
  job.set_membership_epoch(static_cast<int32_t>(s.Int(27)));
  if (s.Int(28) >= 0) job.set_replacing_rank(static_cast<int32_t>(s.Int(28)));
  // "0,1,3": the members, comma-separated.
  const std::string members = s.Text(29);
  for (size_t begin = 0; begin < members.size();) {
    size_t end = members.find(',', begin);
    if (end == std::string::npos) end = members.size();
    job.add_members(std::atoi(members.substr(begin, end - begin).c_str()));
    begin = end + 1;
  }
  // parallel.precision fp8: the serialized Fp8Figures of the last step (empty: none).
  if (const std::string fp8 = s.Blob(30); !fp8.empty()) job.mutable_fp8()->ParseFromString(fp8);
  // model.moe: the serialized MoeFigures of the last step (empty: none).
  if (const std::string moe = s.Blob(31); !moe.empty()) job.mutable_moe()->ParseFromString(moe);
  return job;
}

}  // namespace

const char* JobStateName(v1::JobState state) {
  switch (state) {
    case v1::JOB_STATE_PENDING: return "PENDING";
    case v1::JOB_STATE_RUNNING: return "RUNNING";
    case v1::JOB_STATE_SUCCEEDED: return "SUCCEEDED";
    case v1::JOB_STATE_FAILED: return "FAILED";
    case v1::JOB_STATE_STOPPED: return "STOPPED";
    case v1::JOB_STATE_RESTARTING: return "RESTARTING";
    default: return "UNKNOWN";
  }
}

bool IsFinal(v1::JobState state) {
  return state == v1::JOB_STATE_SUCCEEDED || state == v1::JOB_STATE_FAILED || state == v1::JOB_STATE_STOPPED;
}

StatusOr<std::unique_ptr<SqliteStateStore>> SqliteStateStore::Open(const std::string& path) {
  sqlite3* db = nullptr;
  if (sqlite3_open_v2(path.c_str(), &db, SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE | SQLITE_OPEN_FULLMUTEX,
                      nullptr) != SQLITE_OK) {
    std::string message = db ? sqlite3_errmsg(db) : "out of memory";
    sqlite3_close(db);
    return Unavailable("cannot open the state database " + path + ": " + message);
  }
  // Several standalone launches may share one state directory: wait for each other's writes.
  sqlite3_busy_timeout(db, 10000);
  std::unique_ptr<SqliteStateStore> store(new SqliteStateStore(db));
  if (path != ":memory:") {
    LTRAIN_RETURN_IF_ERROR(store->Exec("PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;"));
  }
  for (const char* column : kAddedJobColumns) {
    (void)store->Exec(std::string("ALTER TABLE jobs ADD COLUMN ") + column);  // fails when present
  }
  (void)store->Exec("ALTER TABLE ranks ADD COLUMN last_step INTEGER NOT NULL DEFAULT 0");
  LTRAIN_RETURN_IF_ERROR(store->Exec(kSchema));
  return store;
}

SqliteStateStore::~SqliteStateStore() {
  for (auto& [sql, stmt] : prepared_) sqlite3_finalize(stmt);
  sqlite3_close(db_);
}

sqlite3_stmt* SqliteStateStore::Prepared(const char* sql) {
  auto it = prepared_.find(sql);
  if (it != prepared_.end()) return it->second;
  sqlite3_stmt* stmt = nullptr;
  if (sqlite3_prepare_v3(db_, sql, -1, SQLITE_PREPARE_PERSISTENT, &stmt, nullptr) != SQLITE_OK) {
    sqlite3_finalize(stmt);
    return nullptr;  // Step fails, and its error names the statement
  }
  prepared_.emplace(sql, stmt);
  return stmt;
}

Status SqliteStateStore::Exec(const std::string& sql) {
  char* error = nullptr;
  int rc = sqlite3_exec(db_, sql.c_str(), nullptr, nullptr, &error);
  if (rc != SQLITE_OK) {
    std::string message = "state store: " + std::string(error ? error : sqlite3_errstr(rc));
    sqlite3_free(error);
    return Transient(rc) ? Unavailable(std::move(message)) : Internal(std::move(message));
  }
  return Status::Ok();
}

Status SqliteStateStore::LimitSize(int64_t max_bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  Statement size(db_, "PRAGMA page_size");
  if (size.Step() != SQLITE_ROW) return SqlError(db_, "read the page size");
  const int64_t page = std::max<int64_t>(1, size.Int(0));
  // SQLite's own ceiling when there is no limit; a limit below the pages in use is raised to them.
  const int64_t pages = max_bytes > 0 ? std::max<int64_t>(1, max_bytes / page) : 4294967294LL;
  return Exec("PRAGMA max_page_count = " + std::to_string(pages));
}

StatusOr<PruneCounts> SqliteStateStore::PruneBefore(int64_t cutoff_unix_ms) {
  std::lock_guard<std::mutex> lock(mu_);
  LTRAIN_RETURN_IF_ERROR(Exec("BEGIN IMMEDIATE"));
  PruneCounts counts;
  // The jobs that ended before the cutoff, with everything recorded of them; then any job's log
  // lines older than the cutoff, and nodes not seen since.
  const std::string ended = "SELECT id FROM jobs WHERE state IN (" + std::to_string(v1::JOB_STATE_SUCCEEDED) + ", " +
                            std::to_string(v1::JOB_STATE_FAILED) + ", " + std::to_string(v1::JOB_STATE_STOPPED) +
                            ") AND updated_ms < ?1";
  const std::pair<const char*, std::string> deletes[] = {
      {"events", "DELETE FROM events WHERE job_id IN (" + ended + ")"},
      {"ranks", "DELETE FROM ranks WHERE job_id IN (" + ended + ")"},
      {"checkpoints", "DELETE FROM checkpoints WHERE job_id IN (" + ended + ")"},
      {"logs", "DELETE FROM logs WHERE job_id IN (" + ended + ") OR unix_ms < ?1"},
      {"jobs", "DELETE FROM jobs WHERE id IN (" + ended + ")"},
      {"nodes", "DELETE FROM nodes WHERE seen_ms < ?1"},
  };
  for (const auto& [table, sql] : deletes) {
    Statement s(db_, sql.c_str());
    s.Bind(1, cutoff_unix_ms);
    if (s.Step() != SQLITE_DONE) {
      Status error = SqlError(db_, std::string("remove old rows of ") + table);
      (void)Exec("ROLLBACK");
      return error;
    }
    const int64_t removed = sqlite3_changes(db_);
    const std::string name = table;
    if (name == "events") counts.events = removed;
    if (name == "logs") counts.log_lines = removed;
    if (name == "jobs") counts.jobs = removed;
  }
  Status committed = Exec("COMMIT");
  if (!committed.ok()) {
    (void)Exec("ROLLBACK");
    return committed;
  }
  return counts;
}

StatusOr<v1::Job> SqliteStateStore::CreateJob(const std::string& name, const std::string& recipe_yaml,
                                              int world_size, int64_t now_ms) {
  std::lock_guard<std::mutex> lock(mu_);
  LTRAIN_RETURN_IF_ERROR(Exec("BEGIN IMMEDIATE"));
  auto fail = [&](const std::string& what) {
    Status error = SqlError(db_, what);
    (void)Exec("ROLLBACK");
    return error;
  };
  Statement last(db_,
                 "SELECT last FROM job_numbers WHERE name = ?1 UNION ALL SELECT last FROM job_numbers WHERE name = '' "
                 "LIMIT 1");
  last.Bind(1, name);
  int64_t number = (last.Step() == SQLITE_ROW ? last.Int(0) : 0) + 1;
  std::string id;
  for (;; ++number) {  // an id is never taken again, not even by a job recorded before this counter
    id = name + "-" + std::to_string(number);
    Statement taken(db_, "SELECT 1 FROM jobs WHERE id = ?");
    taken.Bind(1, id);
    if (taken.Step() != SQLITE_ROW) break;
  }
  Statement count(db_, "INSERT INTO job_numbers (name, last) VALUES (?, ?) ON CONFLICT(name) DO UPDATE SET last = excluded.last");
  count.Bind(1, name).Bind(2, number);
  if (count.Step() != SQLITE_DONE) return fail("number job");
  Statement insert(db_,
                   "INSERT INTO jobs (id, name, state, recipe, world_size, created_ms, updated_ms) "
                   "VALUES (?, ?, ?, ?, ?, ?, ?)");
  insert.Bind(1, id).Bind(2, name).Bind(3, int64_t{v1::JOB_STATE_PENDING}).Bind(4, recipe_yaml);
  insert.Bind(5, int64_t{world_size}).Bind(6, now_ms).Bind(7, now_ms);
  if (insert.Step() != SQLITE_DONE) return fail("insert job");
  LTRAIN_RETURN_IF_ERROR(Exec("COMMIT"));
  v1::Job job;
  job.set_id(id);
  job.set_name(name);
  job.set_state(v1::JOB_STATE_PENDING);
  job.set_recipe_yaml(recipe_yaml);
  job.set_world_size(world_size);
  job.set_created_unix_ms(now_ms);
  job.set_updated_unix_ms(now_ms);
  return job;
}

Status SqliteStateStore::UpdateJob(const v1::Job& job) {
  std::lock_guard<std::mutex> lock(mu_);
  Statement s(db_,
              "UPDATE jobs SET state = ?, generation = ?, cause = ?, updated_ms = ?, last_step = ?, last_loss = ?, "
              "restarts = ?, last_committed_step = ?, last_committed_path = ?, nodes_now = ?, last_failure = ?, "
              "world_size = ?, recipe = ?, val_step = ?, val_loss = ?, total_steps = ?, tokens_per_s = ?, mfu = ?, "
              "checkpoint_save_ms = ?, checkpoint_save_bytes = ?, checkpoint_load_ms = ?, recoveries = ?, lost_steps = ?, "
              "last_recovery_ms = ?, membership_epoch = ?, replacing_rank = ?, members = ?, fp8 = ?, moe = ? WHERE id = ?");
  s.Bind(1, int64_t{job.state()}).Bind(2, int64_t{job.generation()}).Bind(3, job.cause());
  s.Bind(4, job.updated_unix_ms()).Bind(5, job.last_step()).Bind(6, job.last_loss());
  s.Bind(7, int64_t{job.restarts()}).Bind(8, job.last_committed_step()).Bind(9, job.last_committed_path());
  s.Bind(10, int64_t{job.nodes_now()}).Bind(11, job.last_failure()).Bind(12, int64_t{job.world_size()});
  s.Bind(13, job.recipe_yaml()).Bind(14, job.val_step()).Bind(15, job.val_loss()).Bind(16, job.total_steps());
  s.Bind(17, job.tokens_per_s()).Bind(18, job.mfu()).Bind(19, job.checkpoint_save_ms());
  s.Bind(20, job.checkpoint_save_bytes()).Bind(21, job.checkpoint_load_ms()).Bind(22, int64_t{job.recoveries()});
  s.Bind(23, job.lost_steps()).Bind(24, job.last_recovery_ms()).Bind(25, int64_t{job.membership_epoch()});
  std::string members;
  for (int32_t r : job.members()) members += (members.empty() ? "" : ",") + std::to_string(r);
  s.Bind(26, int64_t{job.has_replacing_rank() ? job.replacing_rank() : -1}).Bind(27, members);
  s.BindBlob(28, job.has_fp8() ? job.fp8().SerializeAsString() : std::string());
  s.BindBlob(29, job.has_moe() ? job.moe().SerializeAsString() : std::string()).Bind(30, job.id());
  if (s.Step() != SQLITE_DONE) return SqlError(db_, "update job " + job.id());
  return Status::Ok();
}

StatusOr<v1::Job> SqliteStateStore::GetJob(const std::string& job_id) {
  std::lock_guard<std::mutex> lock(mu_);
  Statement s(db_, (std::string("SELECT ") + kJobColumns + " FROM jobs WHERE id = ?").c_str());
  s.Bind(1, job_id);
  if (s.Step() != SQLITE_ROW) return NotFound("no job '" + job_id + "'; `ltrain status` lists the jobs");
  v1::Job job = ReadJob(s);
  Statement r(db_,
              "SELECT rank, node_id, local_rank, pid, state, exit_code, signal, log_path, last_step FROM ranks "
              "WHERE job_id = ? ORDER BY rank");
  r.Bind(1, job_id);
  while (r.Step() == SQLITE_ROW) {
    v1::RankInfo* rank = job.add_ranks();
    rank->set_rank(static_cast<int32_t>(r.Int(0)));
    rank->set_node_id(r.Text(1));
    rank->set_local_rank(static_cast<int32_t>(r.Int(2)));
    rank->set_pid(r.Int(3));
    rank->set_state(r.Text(4));
    rank->set_exit_code(static_cast<int32_t>(r.Int(5)));
    rank->set_signal(static_cast<int32_t>(r.Int(6)));
    rank->set_log_path(r.Text(7));
    rank->set_last_step(r.Int(8));
  }
  return job;
}

StatusOr<std::vector<v1::Job>> SqliteStateStore::ListJobs(int limit) {
  std::lock_guard<std::mutex> lock(mu_);
  Statement s(db_, (std::string("SELECT ") + kJobColumns + " FROM jobs ORDER BY seq DESC LIMIT ?").c_str());
  s.Bind(1, int64_t{limit > 0 ? limit : 1000000});
  std::vector<v1::Job> jobs;
  while (s.Step() == SQLITE_ROW) jobs.push_back(ReadJob(s));
  return jobs;
}

namespace {

constexpr const char* kUpsertRank =
    "INSERT OR REPLACE INTO ranks (job_id, rank, node_id, local_rank, pid, state, exit_code, signal, log_path, "
    "last_step) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)";

}  // namespace

Status SqliteStateStore::UpsertRankLocked(const std::string& job_id, const v1::RankInfo& rank) {
  Statement s(Prepared(kUpsertRank));
  s.Bind(1, job_id).Bind(2, int64_t{rank.rank()}).Bind(3, rank.node_id()).Bind(4, int64_t{rank.local_rank()});
  s.Bind(5, rank.pid()).Bind(6, rank.state()).Bind(7, int64_t{rank.exit_code()}).Bind(8, int64_t{rank.signal()});
  s.Bind(9, rank.log_path()).Bind(10, rank.last_step());
  if (s.Step() != SQLITE_DONE) return SqlError(db_, "record rank");
  return Status::Ok();
}

Status SqliteStateStore::UpsertRank(const std::string& job_id, const v1::RankInfo& rank) {
  std::lock_guard<std::mutex> lock(mu_);
  return UpsertRankLocked(job_id, rank);
}

Status SqliteStateStore::UpsertRanks(const std::string& job_id, const std::vector<v1::RankInfo>& ranks) {
  std::lock_guard<std::mutex> lock(mu_);
  if (sqlite3_exec(db_, "BEGIN IMMEDIATE", nullptr, nullptr, nullptr) != SQLITE_OK) return SqlError(db_, "record ranks");
  for (const v1::RankInfo& rank : ranks) {
    if (Status written = UpsertRankLocked(job_id, rank); !written.ok()) {
      sqlite3_exec(db_, "ROLLBACK", nullptr, nullptr, nullptr);
      return written;
    }
  }
  if (sqlite3_exec(db_, "COMMIT", nullptr, nullptr, nullptr) != SQLITE_OK) {
    Status error = SqlError(db_, "record ranks");
    sqlite3_exec(db_, "ROLLBACK", nullptr, nullptr, nullptr);
    return error;
  }
  return Status::Ok();
}

Status SqliteStateStore::ClearRanks(const std::string& job_id) {
  std::lock_guard<std::mutex> lock(mu_);
  Statement s(db_, "DELETE FROM ranks WHERE job_id = ?");
  s.Bind(1, job_id);
  if (s.Step() != SQLITE_DONE) return SqlError(db_, "clear ranks");
  return Status::Ok();
}

Status SqliteStateStore::RecordCheckpoint(const std::string& job_id, int64_t step, int generation,
                                          const std::string& path, int64_t now_ms) {
  std::lock_guard<std::mutex> lock(mu_);
  Statement s(db_, "INSERT OR REPLACE INTO checkpoints (job_id, step, generation, path, unix_ms) VALUES (?, ?, ?, ?, ?)");
  s.Bind(1, job_id).Bind(2, step).Bind(3, int64_t{generation}).Bind(4, path).Bind(5, now_ms);
  if (s.Step() != SQLITE_DONE) return SqlError(db_, "record checkpoint");
  return Status::Ok();
}

Status SqliteStateStore::UpsertNode(const std::string& node_id, const v1::NodeFacts& facts, int64_t now_ms) {
  std::lock_guard<std::mutex> lock(mu_);
  Statement s(db_, "INSERT OR REPLACE INTO nodes (id, hostname, address, gpus, cpus, seen_ms) VALUES (?, ?, ?, ?, ?, ?)");
  s.Bind(1, node_id).Bind(2, facts.hostname()).Bind(3, facts.address()).Bind(4, int64_t{facts.gpus()});
  s.Bind(5, int64_t{facts.cpus()}).Bind(6, now_ms);
  if (s.Step() != SQLITE_DONE) return SqlError(db_, "record node");
  return Status::Ok();
}

StatusOr<int64_t> SqliteStateStore::AppendEvent(const v1::Event& event) {
  std::lock_guard<std::mutex> lock(mu_);
  Statement s(db_, "INSERT INTO events (job_id, unix_ms, kind, message, rank, state) VALUES (?, ?, ?, ?, ?, ?)");
  s.Bind(1, event.job_id()).Bind(2, event.unix_ms()).Bind(3, event.kind()).Bind(4, event.message());
  s.Bind(5, int64_t{event.rank()}).Bind(6, int64_t{event.state()});
  if (s.Step() != SQLITE_DONE) return SqlError(db_, "append event");
  return static_cast<int64_t>(sqlite3_last_insert_rowid(db_));
}

StatusOr<std::vector<v1::Event>> SqliteStateStore::EventsAfter(const std::string& job_id, int64_t after_seq) {
  std::lock_guard<std::mutex> lock(mu_);
  Statement s(db_,
              "SELECT seq, job_id, unix_ms, kind, message, rank, state FROM events WHERE job_id = ? AND seq > ? "
              "ORDER BY seq");
  s.Bind(1, job_id).Bind(2, after_seq);
  std::vector<v1::Event> events;
  while (s.Step() == SQLITE_ROW) {
    v1::Event& e = events.emplace_back();
    e.set_seq(s.Int(0));
    e.set_job_id(s.Text(1));
    e.set_unix_ms(s.Int(2));
    e.set_kind(s.Text(3));
    e.set_message(s.Text(4));
    e.set_rank(static_cast<int32_t>(s.Int(5)));
    e.set_state(static_cast<v1::JobState>(s.Int(6)));
  }
  return events;
}

Status SqliteStateStore::AppendLogs(const std::vector<v1::Event>& lines) {
  if (lines.empty()) return Status::Ok();
  std::lock_guard<std::mutex> lock(mu_);
  LTRAIN_RETURN_IF_ERROR(Exec("BEGIN"));
  {
    Statement s(db_, "INSERT INTO logs (seq, job_id, unix_ms, rank, text) VALUES (?, ?, ?, ?, ?)");
    for (const auto& line : lines) {
      sqlite3_reset(s.raw());
      s.Bind(1, line.seq()).Bind(2, line.job_id()).Bind(3, line.unix_ms()).Bind(4, int64_t{line.rank()});
      s.Bind(5, line.message());
      if (s.Step() != SQLITE_DONE) {
        Status error = SqlError(db_, "append logs");
        (void)Exec("ROLLBACK");
        return error;
      }
    }
  }
  return Exec("COMMIT");
}

StatusOr<std::vector<v1::Event>> SqliteStateStore::Logs(const std::string& job_id, int rank, int64_t since_unix_ms,
                                                        int limit) {
  std::lock_guard<std::mutex> lock(mu_);
  // The newest `limit` lines, returned oldest first.
  Statement s(db_,
              "SELECT seq, unix_ms, rank, text FROM (SELECT rowid AS r, seq, unix_ms, rank, text FROM logs "
              "WHERE job_id = ? AND (? < 0 OR rank = ?) AND unix_ms >= ? ORDER BY rowid DESC LIMIT ?) ORDER BY r");
  s.Bind(1, job_id).Bind(2, int64_t{rank}).Bind(3, int64_t{rank}).Bind(4, since_unix_ms);
  s.Bind(5, int64_t{limit > 0 ? limit : -1});
  std::vector<v1::Event> lines;
  while (s.Step() == SQLITE_ROW) {
    v1::Event& e = lines.emplace_back();
    e.set_seq(s.Int(0));
    e.set_job_id(job_id);
    e.set_unix_ms(s.Int(1));
    e.set_rank(static_cast<int32_t>(s.Int(2)));
    e.set_kind("log");
    e.set_message(s.Text(3));
  }
  return lines;
}

}  // namespace ltrain::launcher
