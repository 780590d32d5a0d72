// The coordinator's state store: events a follower sees only once stored, and the SQLite database's
// columns, job numbers and old databases.
#include "launcher/coordinator.h"

#include <gtest/gtest.h>

#include <csignal>

#include <sqlite3.h>
#include <unistd.h>

#include <condition_variable>
#include <filesystem>
#include <limits>
#include <mutex>

#include "common/clock.h"
#include "common/logging.h"
#include "common/worker_exit.h"
#include "launcher/state_store.h"
#include "tests/unit/coordinator_fixture.h"

namespace ltrain::launcher {
namespace {

// On a shared state (etcd) followers are shown an event only once the state has it: an event still
// on its way to the store is held back, with every event and log line after it.
TEST(StoredEventsTest, FollowersSeeAnEventOnlyOnceTheStateHasIt) {
  SetLogLevel(LogLevel::kWarning);
  std::unique_ptr<SqliteStateStore> sqlite = std::move(SqliteStateStore::Open(":memory:")).value();
  // Event writes wait until the test opens the gate.
  struct Gate : StateStore {
    StateStore* inner;
    std::mutex mu;
    std::condition_variable cv;
    bool open = false;
    int waiting = 0;
    explicit Gate(StateStore* s) : inner(s) {}
    StatusOr<v1::Job> CreateJob(const std::string& n, const std::string& r, int w, int64_t t) override {
      return inner->CreateJob(n, r, w, t);
    }
    Status UpdateJob(const v1::Job& j) override { return inner->UpdateJob(j); }
    StatusOr<v1::Job> GetJob(const std::string& id) override { return inner->GetJob(id); }
    StatusOr<std::vector<v1::Job>> ListJobs(int l) override { return inner->ListJobs(l); }
    Status UpsertRank(const std::string& id, const v1::RankInfo& r) override { return inner->UpsertRank(id, r); }
    Status ClearRanks(const std::string& id) override { return inner->ClearRanks(id); }
    Status RecordCheckpoint(const std::string& id, int64_t s, int g, const std::string& p, int64_t t) override {
      return inner->RecordCheckpoint(id, s, g, p, t);
    }
    Status UpsertNode(const std::string& n, const v1::NodeFacts& f, int64_t t) override {
      return inner->UpsertNode(n, f, t);
    }
    StatusOr<int64_t> AppendEvent(const v1::Event& e) override {
      std::unique_lock<std::mutex> lock(mu);
      ++waiting;
      cv.notify_all();
      cv.wait(lock, [&] { return open; });
      return inner->AppendEvent(e);
    }
    StatusOr<std::vector<v1::Event>> EventsAfter(const std::string& id, int64_t a) override {
      return inner->EventsAfter(id, a);
    }
    Status AppendLogs(const std::vector<v1::Event>& l) override { return inner->AppendLogs(l); }
    StatusOr<std::vector<v1::Event>> Logs(const std::string& id, int r, int64_t s, int l) override {
      return inner->Logs(id, r, s, l);
    }
    StatusOr<PruneCounts> PruneBefore(int64_t c) override { return inner->PruneBefore(c); }
  } gate(sqlite.get());
  FakeClock clock;
  CoordinatorOptions options;
  options.state_dir = "/state";
  options.show_events_once_stored = true;
  auto coordinator = std::make_unique<Coordinator>(&gate, &clock, options);
  StatusOr<v1::Job> job = coordinator->Submit(kRecipe, "unit.yaml");
  ASSERT_TRUE(job.ok());
  {
    std::unique_lock<std::mutex> lock(gate.mu);
    gate.cv.wait(lock, [&] { return gate.waiting > 0; });  // "submitted" is on its way to the store
  }
  bool finished = true;
  StatusOr<std::vector<v1::Event>> none = coordinator->WaitEvents(job->id(), 0, true, 0, &finished);
  ASSERT_TRUE(none.ok());
  EXPECT_TRUE(none->empty()) << (*none)[0].message();
  EXPECT_FALSE(finished);
  {
    std::lock_guard<std::mutex> lock(gate.mu);
    gate.open = true;
    gate.cv.notify_all();
  }
  coordinator->FlushState();
  StatusOr<std::vector<v1::Event>> shown = coordinator->WaitEvents(job->id(), 0, true, 0, &finished);
  ASSERT_TRUE(shown.ok());
  ASSERT_FALSE(shown->empty());
  EXPECT_EQ((*shown)[0].kind(), "submitted");
  coordinator.reset();
}

// SQLite keeps a NaN as NULL, which the job row refuses: a diverged run's NaN loss must not make
// every later update of its record fail.
TEST(StateStoreTest, AJobWithANanLossIsStillStored) {
  std::unique_ptr<SqliteStateStore> store = std::move(SqliteStateStore::Open(":memory:")).value();
  StatusOr<v1::Job> job = store->CreateJob("nan", "name: nan\n", 1, 1000);
  ASSERT_TRUE(job.ok()) << job.status().ToString();
  job->set_last_loss(std::numeric_limits<double>::quiet_NaN());
  job->set_state(v1::JOB_STATE_FAILED);
  ASSERT_TRUE(store->UpdateJob(*job).ok());
  EXPECT_EQ(store->GetJob(job->id())->state(), v1::JOB_STATE_FAILED);
}

// Writes a database at `path` as the first release made it (its jobs table), then runs `more` on it.
void WriteFirstReleaseDatabase(const std::string& path, const std::string& more = "") {
  sqlite3* db = nullptr;
  ASSERT_EQ(sqlite3_open(path.c_str(), &db), SQLITE_OK);
  const std::string sql =
      "CREATE TABLE jobs (seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT UNIQUE, name TEXT NOT NULL, state INTEGER "
      "NOT NULL, recipe TEXT NOT NULL, world_size INTEGER NOT NULL, generation INTEGER NOT NULL DEFAULT 0, cause TEXT "
      "NOT NULL DEFAULT '', created_ms INTEGER NOT NULL, updated_ms INTEGER NOT NULL, last_step INTEGER NOT NULL "
      "DEFAULT 0, last_loss REAL NOT NULL DEFAULT 0);" +
      more;
  EXPECT_EQ(sqlite3_exec(db, sql.c_str(), nullptr, nullptr, nullptr), SQLITE_OK);
  sqlite3_close(db);
}

// The figures of a job's last step and checkpoint outlive it: `ltrain status` of an ended job reads
// them from the database, where they used to read as 0. A database made before these columns gets them.
TEST(StateStoreTest, AJobsLastFiguresAreStoredAndAnOlderDatabaseGetsTheirColumns) {
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / ("ltrain-state-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const std::string path = (dir / "state.db").string();
  WriteFirstReleaseDatabase(path);
  std::unique_ptr<SqliteStateStore> store = std::move(SqliteStateStore::Open(path)).value();
  StatusOr<v1::Job> job = store->CreateJob("figures", "name: figures\n", 2, 1000);
  ASSERT_TRUE(job.ok()) << job.status().ToString();
  job->set_state(v1::JOB_STATE_SUCCEEDED);
  job->set_last_step(300);
  job->set_total_steps(300);
  job->set_tokens_per_s(12345.5);
  job->set_mfu(0.52);
  job->set_checkpoint_save_ms(81.5);
  job->set_checkpoint_save_bytes(123456789);
  job->set_checkpoint_load_ms(40.25);
  job->set_recoveries(2);
  job->set_lost_steps(3);
  job->set_last_recovery_ms(612.5);
  job->set_membership_epoch(4);
  job->set_replacing_rank(0);
  job->mutable_fp8()->set_activation_amax_max(12.5);
  job->mutable_fp8()->set_overflow_steps(1);
  job->mutable_moe()->set_load_max(1.75);
  job->mutable_moe()->add_layers(3);
  ASSERT_TRUE(store->UpdateJob(*job).ok());
  store.reset();
  store = std::move(SqliteStateStore::Open(path)).value();
  StatusOr<v1::Job> read = store->GetJob(job->id());
  ASSERT_TRUE(read.ok()) << read.status().ToString();
  EXPECT_EQ(read->total_steps(), 300);
  EXPECT_EQ(read->tokens_per_s(), 12345.5);
  EXPECT_EQ(read->mfu(), 0.52);
  EXPECT_EQ(read->checkpoint_save_ms(), 81.5);
  EXPECT_EQ(read->checkpoint_save_bytes(), 123456789);
  EXPECT_EQ(read->checkpoint_load_ms(), 40.25);
  EXPECT_EQ(read->recoveries(), 2);
  EXPECT_EQ(read->lost_steps(), 3);
  EXPECT_EQ(read->last_recovery_ms(), 612.5);
  EXPECT_EQ(read->membership_epoch(), 4);
  ASSERT_TRUE(read->has_replacing_rank()) << "rank 0 is a rank, not none";
  EXPECT_EQ(read->replacing_rank(), 0);
  ASSERT_TRUE(read->has_fp8());
  EXPECT_EQ(read->fp8().activation_amax_max(), 12.5);
  EXPECT_EQ(read->fp8().overflow_steps(), 1);
  ASSERT_TRUE(read->has_moe());
  EXPECT_EQ(read->moe().load_max(), 1.75);
  EXPECT_EQ(read->moe().layers(0), 3);
  read->clear_replacing_rank();
  read->clear_fp8();
  read->clear_moe();
  ASSERT_TRUE(store->UpdateJob(*read).ok());
  EXPECT_FALSE(store->GetJob(job->id())->has_replacing_rank());
  EXPECT_FALSE(store->GetJob(job->id())->has_fp8()) << "a job without FP8 figures reads back without them";
  EXPECT_FALSE(store->GetJob(job->id())->has_moe());
  store.reset();
  std::filesystem::remove_all(dir);
}

// Job numbers count per name, so that the README's second job is llama-quickstart-1 after a
// quickstart-1; a number goes once, even after its job was pruned.
TEST(StateStoreTest, JobNumbersCountPerNameAndAreNeverGivenTwice) {
  std::unique_ptr<SqliteStateStore> store = std::move(SqliteStateStore::Open(":memory:")).value();
  EXPECT_EQ(store->CreateJob("quickstart", "name: quickstart\n", 2, 1000)->id(), "quickstart-1");
  EXPECT_EQ(store->CreateJob("llama-quickstart", "name: llama-quickstart\n", 2, 1000)->id(), "llama-quickstart-1");
  StatusOr<v1::Job> second = store->CreateJob("quickstart", "name: quickstart\n", 2, 1000);
  EXPECT_EQ(second->id(), "quickstart-2");
  second->set_state(v1::JOB_STATE_SUCCEEDED);
  ASSERT_TRUE(store->UpdateJob(*second).ok());
  ASSERT_EQ(store->PruneBefore(std::numeric_limits<int64_t>::max())->jobs, 1);
  EXPECT_EQ(store->CreateJob("quickstart", "name: quickstart\n", 2, 1000)->id(), "quickstart-3");
  ASSERT_EQ(store->ListJobs(0)->size(), 3u);
  EXPECT_EQ(store->ListJobs(0)->front().id(), "quickstart-3") << "newest first";
}

// A database made while job numbers were one counter across names: a name starts after that counter
// (deleted jobs included), so no earlier job's id, nor its checkpoint folder, comes again.
TEST(StateStoreTest, ADatabaseOfOneCounterAcrossNamesGivesNoEarlierIdAgain) {
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / ("ltrain-numbers-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const std::string path = (dir / "state.db").string();
  WriteFirstReleaseDatabase(path,
                            "INSERT INTO jobs (id, name, state, recipe, world_size, created_ms, updated_ms) VALUES "
                            "('a-1', 'a', 3, '', 1, 1, 1), ('b-2', 'b', 3, '', 1, 1, 1), ('a-3', 'a', 3, '', 1, 1, 1);"
                            "DELETE FROM jobs WHERE id = 'a-3';");
  std::unique_ptr<SqliteStateStore> store = std::move(SqliteStateStore::Open(path)).value();
  EXPECT_EQ(store->CreateJob("a", "name: a\n", 1, 1000)->id(), "a-4");
  EXPECT_EQ(store->CreateJob("c", "name: c\n", 1, 1000)->id(), "c-4");
  EXPECT_EQ(store->CreateJob("c", "name: c\n", 1, 1000)->id(), "c-5");
  store.reset();
  store = std::move(SqliteStateStore::Open(path)).value();
  EXPECT_EQ(store->CreateJob("b", "name: b\n", 1, 1000)->id(), "b-4") << "the floor is taken once, not moved";
  store.reset();
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace ltrain::launcher
