// The coordinator's state: written off its lock, in order; refusing new work while the database
// cannot be written, and taking it again once it can; retention of old records.
#include <gtest/gtest.h>

#include <set>
#include <thread>

#include "common/clock.h"
#include "common/logging.h"
#include "launcher/coordinator.h"
#include "launcher/state_store.h"
#include "launcher/state_writer.h"

namespace ltrain::launcher {
namespace {

constexpr const char* kRecipe = R"(name: state
data: {path: /data}
training: {steps: 5, micro_batch: 1, global_batch: 1}
parallel: {nodes: 1, nproc_per_node: 1}
)";

constexpr int64_t kDayMs = 24LL * 3600 * 1000;

std::unique_ptr<SqliteStateStore> MemoryStore() { return std::move(SqliteStateStore::Open(":memory:")).value(); }

v1::Event Line(const std::string& job, int64_t unix_ms, const std::string& text) {
  v1::Event line;
  line.set_job_id(job);
  line.set_unix_ms(unix_ms);
  line.set_kind("log");
  line.set_message(text);
  return line;
}

// A store that records the thread of every write it is given, and otherwise is the SQLite store.
class ThreadRecordingStore : public StateStore {
 public:
  ThreadRecordingStore() : inner_(MemoryStore()) {}
  std::set<std::thread::id> write_threads() {
    std::lock_guard<std::mutex> lock(mu_);
    return threads_;
  }

  StatusOr<v1::Job> CreateJob(const std::string& name, const std::string& recipe_yaml, int world_size,
                              int64_t now_ms) override {
    return inner_->CreateJob(name, recipe_yaml, world_size, now_ms);  // its id is waited for
  }
  Status UpdateJob(const v1::Job& job) override { return Noted(inner_->UpdateJob(job)); }
  StatusOr<v1::Job> GetJob(const std::string& job_id) override { return inner_->GetJob(job_id); }
  StatusOr<std::vector<v1::Job>> ListJobs(int limit) override { return inner_->ListJobs(limit); }
  Status UpsertRank(const std::string& job_id, const v1::RankInfo& rank) override {
    return Noted(inner_->UpsertRank(job_id, rank));
  }
  Status ClearRanks(const std::string& job_id) override { return Noted(inner_->ClearRanks(job_id)); }
  Status RecordCheckpoint(const std::string& job_id, int64_t step, int generation, const std::string& path,
                          int64_t now_ms) override {
    return Noted(inner_->RecordCheckpoint(job_id, step, generation, path, now_ms));
  }
  Status UpsertNode(const std::string& node_id, const v1::NodeFacts& facts, int64_t now_ms) override {
    return Noted(inner_->UpsertNode(node_id, facts, now_ms));
  }
  StatusOr<int64_t> AppendEvent(const v1::Event& event) override {
    (void)Noted(Status::Ok());
    return inner_->AppendEvent(event);
  }
  StatusOr<std::vector<v1::Event>> EventsAfter(const std::string& job_id, int64_t after_seq) override {
    return inner_->EventsAfter(job_id, after_seq);
  }
  Status AppendLogs(const std::vector<v1::Event>& lines) override { return Noted(inner_->AppendLogs(lines)); }
  StatusOr<std::vector<v1::Event>> Logs(const std::string& job_id, int rank, int64_t since_unix_ms,
                                        int limit) override {
    return inner_->Logs(job_id, rank, since_unix_ms, limit);
  }
  StatusOr<PruneCounts> PruneBefore(int64_t cutoff_unix_ms) override {
    (void)Noted(Status::Ok());
    return inner_->PruneBefore(cutoff_unix_ms);
  }

 private:
  Status Noted(Status status) {
    std::lock_guard<std::mutex> lock(mu_);
    threads_.insert(std::this_thread::get_id());
    return status;
  }
  std::unique_ptr<SqliteStateStore> inner_;
  std::mutex mu_;
  std::set<std::thread::id> threads_;
};

class StateTest : public ::testing::Test {
 protected:
  void SetUp() override { SetLogLevel(LogLevel::kError); }
  void TearDown() override { SetLogLevel(LogLevel::kInfo); }

  static v1::NodeFacts Facts() {
    v1::NodeFacts facts;
    facts.set_hostname("a.example");
    facts.set_cpus(8);
    return facts;
  }

  // A job that runs on node "a" and pushes `lines` log lines of `bytes` bytes.
  static std::string RunWithLogs(Coordinator& coordinator, int lines, size_t bytes) {
    std::string id = coordinator.Submit(kRecipe, "state.yaml")->id();
    v1::PushLogsRequest logs;
    logs.set_job_id(id);
    for (int i = 0; i < lines; ++i) {
      v1::LogLine* line = logs.add_lines();
      line->set_rank(0);
      line->set_text(std::to_string(i) + std::string(bytes, 'x'));
    }
    coordinator.PushLogs(logs);
    return id;
  }

  static v1::WorkerStateReport Exited(const std::string& id) {
    v1::WorkerStateReport report;
    report.set_node_id("a");
    report.set_job_id(id);
    report.set_rank(0);
    report.set_state("exited");
    return report;
  }

  FakeClock clock_;
};

TEST_F(StateTest, NoStoreWriteRunsOnTheCallersThread) {
  ThreadRecordingStore store;
  {
    Coordinator coordinator(&store, &clock_, {});
    coordinator.NodeConnected("a", Facts());
    std::string id = RunWithLogs(coordinator, 3, 10);
    v1::WorkerStateReport running = Exited(id);
    running.set_state("running");
    ASSERT_TRUE(coordinator.ReportWorkerState(running).ok());
    ASSERT_TRUE(coordinator.ReportWorkerState(Exited(id)).ok());
    coordinator.Tick();
    EXPECT_EQ(coordinator.GetJob(id)->state(), v1::JOB_STATE_SUCCEEDED);
    EXPECT_EQ(coordinator.GetLogs(id, -1, 0, 0)->size(), 3u);
  }
  std::set<std::thread::id> threads = store.write_threads();
  ASSERT_FALSE(threads.empty());
  EXPECT_EQ(threads.count(std::this_thread::get_id()), 0u) << "a handler wrote to the store itself";
  EXPECT_EQ(threads.size(), 1u) << "the writes come from one thread, in order";
}

TEST_F(StateTest, AFullDatabaseStopsNewWorkSaysWhyAndLosesNoRecordOnceItHasRoom) {
  std::unique_ptr<SqliteStateStore> store = MemoryStore();
  Coordinator coordinator(store.get(), &clock_, {});
  coordinator.NodeConnected("a", Facts());
  std::string id = coordinator.Submit(kRecipe, "state.yaml")->id();
  coordinator.FlushState();
  ASSERT_FALSE(coordinator.StateFailure().has_value());

  // The cap is raised to the pages in use: the next page the logs need is refused, as on a full disk.
  ASSERT_TRUE(store->LimitSize(1).ok());
  v1::PushLogsRequest logs;
  logs.set_job_id(id);
  for (int i = 0; i < 64; ++i) logs.add_lines()->set_text(std::to_string(i) + std::string(8000, 'x'));
  coordinator.PushLogs(logs);
  coordinator.FlushState();
  std::optional<std::string> failure = coordinator.StateFailure();
  ASSERT_TRUE(failure.has_value());
  EXPECT_NE(failure->find("full"), std::string::npos) << *failure;

  StatusOr<v1::Job> refused = coordinator.Submit(kRecipe, "state.yaml");
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(refused.status().message().find("takes no new work while it cannot write its state"), std::string::npos)
      << refused.status().message();
  EXPECT_NE(refused.status().message().find("full"), std::string::npos) << refused.status().message();
  EXPECT_EQ(coordinator.Resume(id).status().code(), StatusCode::kUnavailable);
  // The running job goes on in memory meanwhile.
  ASSERT_TRUE(coordinator.ReportWorkerState(Exited(id)).ok());
  EXPECT_EQ(coordinator.GetJob(id)->state(), v1::JOB_STATE_SUCCEEDED) << "what status shows comes from memory";
  EXPECT_FALSE(coordinator.GetJob(id)->ranks().empty());

  // Room again: the waiting writes are applied in order at the next tick, and work is taken again.
  ASSERT_TRUE(store->LimitSize(0).ok());
  coordinator.Tick();
  coordinator.FlushState();
  EXPECT_FALSE(coordinator.StateFailure().has_value());
  EXPECT_EQ(coordinator.GetLogs(id, -1, 0, 0)->size(), 64u);
  EXPECT_EQ(coordinator.GetJob(id)->state(), v1::JOB_STATE_SUCCEEDED);
  EXPECT_TRUE(coordinator.Submit(kRecipe, "state.yaml").ok());
}

TEST_F(StateTest, AWriteTheStoreRefusesForGoodIsDroppedAndTheNextOnesGoOn) {
  std::unique_ptr<SqliteStateStore> store = MemoryStore();
  StateWriter writer(store.get(), &clock_);
  int applied = 0;
  writer.Enqueue("a bad write", [](StateStore&) { return InvalidArgument("not a record"); });
  writer.Enqueue("a good write", [&applied](StateStore&) {
    ++applied;
    return Status::Ok();
  });
  writer.Flush();
  EXPECT_EQ(applied, 1);
  EXPECT_FALSE(writer.Failure().has_value());
  EXPECT_EQ(writer.Queued(), 0u);
}

TEST_F(StateTest, WhileWritesFailLogLinesBeyondTheBoundAreDroppedAndRecordsKept) {
  std::unique_ptr<SqliteStateStore> store = MemoryStore();
  StateWriter writer(store.get(), &clock_, /*max_queued=*/2);
  bool full = true;
  writer.Enqueue("a record", [&full](StateStore&) { return full ? Unavailable("disk full") : Status::Ok(); });
  writer.Flush();
  ASSERT_TRUE(writer.Failure().has_value());
  EXPECT_NE(writer.Failure()->find("disk full"), std::string::npos);
  int lines = 0;
  for (int i = 0; i < 5; ++i) {
    writer.Enqueue(
        "log lines",
        [&lines](StateStore&) {
          ++lines;
          return Status::Ok();
        },
        /*droppable=*/true);
  }
  writer.Enqueue("another record", [](StateStore&) { return Status::Ok(); });
  EXPECT_EQ(writer.Queued(), 3u) << "the record, one batch of lines up to the bound, the second record";
  full = false;
  writer.Retry();
  writer.Flush();
  EXPECT_FALSE(writer.Failure().has_value());
  EXPECT_EQ(lines, 1);
}

TEST_F(StateTest, PruneRemovesEndedJobsAndOldLogLinesAndKeepsRunningJobs) {
  std::unique_ptr<SqliteStateStore> store = MemoryStore();
  const int64_t old_ms = 1000, new_ms = 40 * kDayMs;
  v1::Job ended = *store->CreateJob("ended", "name: ended\n", 1, old_ms);
  ended.set_state(v1::JOB_STATE_SUCCEEDED);
  ASSERT_TRUE(store->UpdateJob(ended).ok());
  v1::Job running = *store->CreateJob("running", "name: running\n", 1, old_ms);
  running.set_state(v1::JOB_STATE_RUNNING);
  ASSERT_TRUE(store->UpdateJob(running).ok());
  v1::Job recent = *store->CreateJob("recent", "name: recent\n", 1, new_ms);
  recent.set_state(v1::JOB_STATE_FAILED);
  recent.set_updated_unix_ms(new_ms);
  ASSERT_TRUE(store->UpdateJob(recent).ok());
  for (const v1::Job* job : {&ended, &running}) {
    v1::Event event = Line(job->id(), old_ms, "submitted");
    event.set_kind("submitted");
    ASSERT_TRUE(store->AppendEvent(event).ok());
    ASSERT_TRUE(store->RecordCheckpoint(job->id(), 5, 0, "/ck/step-5", old_ms).ok());
  }
  ASSERT_TRUE(store->AppendLogs({Line(ended.id(), old_ms, "old"), Line(running.id(), old_ms, "old"),
                                 Line(running.id(), new_ms, "new"), Line(recent.id(), new_ms, "new")})
                  .ok());

  StatusOr<PruneCounts> removed = store->PruneBefore(new_ms - 30 * kDayMs);
  ASSERT_TRUE(removed.ok()) << removed.status().ToString();
  EXPECT_EQ(removed->jobs, 1);
  EXPECT_EQ(removed->events, 1);
  EXPECT_EQ(removed->log_lines, 2);
  EXPECT_EQ(store->GetJob(ended.id()).status().code(), StatusCode::kNotFound);
  EXPECT_TRUE(store->EventsAfter(ended.id(), 0)->empty());
  EXPECT_EQ(store->GetJob(running.id())->state(), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(store->EventsAfter(running.id(), 0)->size(), 1u);
  ASSERT_EQ(store->Logs(running.id(), -1, 0, 0)->size(), 1u);
  EXPECT_EQ(store->Logs(running.id(), -1, 0, 0)->front().message(), "new");
  EXPECT_EQ(store->Logs(recent.id(), -1, 0, 0)->size(), 1u);
  EXPECT_EQ(store->ListJobs(0)->size(), 2u);
}

TEST_F(StateTest, TheCoordinatorAppliesRetentionAndForgetsEndedJobs) {
  std::unique_ptr<SqliteStateStore> store = MemoryStore();
  CoordinatorOptions options;
  options.retain_ms = 30 * kDayMs;
  Coordinator coordinator(store.get(), &clock_, options);
  coordinator.NodeConnected("a", Facts());
  std::string id = RunWithLogs(coordinator, 2, 10);
  ASSERT_TRUE(coordinator.ReportWorkerState(Exited(id)).ok());
  coordinator.Tick();
  ASSERT_EQ(coordinator.GetJob(id)->state(), v1::JOB_STATE_SUCCEEDED);

  clock_.AdvanceMs(29 * kDayMs);
  coordinator.NodeConnected("a", Facts());  // the node stays known
  coordinator.Tick();
  coordinator.FlushState();
  EXPECT_TRUE(coordinator.GetJob(id).ok()) << "29 days: kept";
  EXPECT_EQ(coordinator.GetLogs(id, -1, 0, 0)->size(), 2u);

  clock_.AdvanceMs(2 * kDayMs);
  coordinator.NodeConnected("a", Facts());
  coordinator.Tick();
  coordinator.FlushState();
  EXPECT_EQ(coordinator.GetJob(id).status().code(), StatusCode::kNotFound) << "31 days: removed";
  EXPECT_EQ(coordinator.GetLogs(id, -1, 0, 0).status().code(), StatusCode::kNotFound);
  bool finished = false;
  EXPECT_EQ(coordinator.WaitEvents(id, 0, true, 0, &finished).status().code(), StatusCode::kNotFound)
      << "not kept in memory either";
}

}  // namespace
}  // namespace ltrain::launcher
