#include "launcher/coordinator.h"

#include <gtest/gtest.h>

#include "common/clock.h"
#include "common/logging.h"
#include "launcher/state_store.h"

namespace ltrain::launcher {
namespace {

constexpr const char* kRecipe = R"(name: unit
data: {path: /data}
training: {steps: 5, micro_batch: 1, global_batch: 4}
parallel: {nodes: 2, nproc_per_node: 2}
)";

class CoordinatorTest : public ::testing::Test {
 protected:
  void SetUp() override {
    SetLogLevel(LogLevel::kWarning);
    store_ = std::move(SqliteStateStore::Open(":memory:")).value();
    CoordinatorOptions options;
    options.state_dir = "/state";
    options.node_timeout_ms = 3000;
    coordinator_ = std::make_unique<Coordinator>(store_.get(), &clock_, options);
  }

  int64_t Connect(const std::string& node) {
    v1::NodeFacts facts;
    facts.set_hostname(node + ".example");
    facts.set_cpus(8);
    return coordinator_->NodeConnected(node, facts);
  }

  v1::WorkerStateReport Exit(const std::string& job, int rank, int code, int signal = 0) {
    v1::WorkerStateReport report;
    report.set_node_id(rank < 2 ? "a" : "b");
    report.set_job_id(job);
    report.set_rank(rank);
    report.set_state(signal ? "killed" : "exited");
    report.set_exit_code(code);
    report.set_signal(signal);
    report.add_log_tail("last words");
    return report;
  }

  FakeClock clock_;
  std::unique_ptr<StateStore> store_;
  std::unique_ptr<Coordinator> coordinator_;
};

TEST_F(CoordinatorTest, JobWaitsForEnoughNodesThenGetsContiguousRanks) {
  Connect("a");
  StatusOr<v1::Job> job = coordinator_->Submit(kRecipe, "unit.yaml");
  ASSERT_TRUE(job.ok()) << job.status().ToString();
  EXPECT_EQ(job->state(), v1::JOB_STATE_PENDING);
  EXPECT_FALSE(coordinator_->WaitCommand("a", 0).has_value());

  Connect("b");
  std::optional<v1::Command> a = coordinator_->WaitCommand("a", 0);
  std::optional<v1::Command> b = coordinator_->WaitCommand("b", 0);
  ASSERT_TRUE(a && a->has_start());
  ASSERT_TRUE(b && b->has_start());
  EXPECT_EQ(a->start().world_size(), 4);
  EXPECT_EQ(a->start().workers(0).rank(), 0);
  EXPECT_EQ(a->start().workers(1).rank(), 1);
  EXPECT_EQ(b->start().workers(0).rank(), 2);
  EXPECT_EQ(b->start().workers(1).local_rank(), 1);
  EXPECT_EQ(a->start().rendezvous_scope(), job->id() + "/0/");
  EXPECT_EQ(a->start().checkpoint_dir(), "/state/checkpoints/" + job->id());
  EXPECT_EQ(coordinator_->GetJob(job->id())->state(), v1::JOB_STATE_RUNNING);
}

TEST_F(CoordinatorTest, AllRanksExitingZeroSucceeds) {
  Connect("a");
  Connect("b");
  std::string id = coordinator_->Submit(kRecipe, "unit.yaml")->id();
  for (int rank = 0; rank < 4; ++rank) {
    EXPECT_EQ(coordinator_->GetJob(id)->state(), v1::JOB_STATE_RUNNING);
    ASSERT_TRUE(coordinator_->ReportWorkerState(Exit(id, rank, 0)).ok());
  }
  EXPECT_EQ(coordinator_->GetJob(id)->state(), v1::JOB_STATE_SUCCEEDED);
}

TEST_F(CoordinatorTest, OneKilledRankFailsTheJobAndStopsEveryNode) {
  Connect("a");
  Connect("b");
  std::string id = coordinator_->Submit(kRecipe, "unit.yaml")->id();
  coordinator_->WaitCommand("a", 0);
  coordinator_->WaitCommand("b", 0);
  ASSERT_TRUE(coordinator_->ReportWorkerState(Exit(id, 3, 0, 9)).ok());
  v1::Job job = *coordinator_->GetJob(id);
  EXPECT_EQ(job.state(), v1::JOB_STATE_FAILED);
  EXPECT_NE(job.cause().find("rank 3 on b was killed by signal SIGKILL"), std::string::npos) << job.cause();
  EXPECT_NE(job.cause().find("last words"), std::string::npos);
  for (const char* node : {"a", "b"}) {
    std::optional<v1::Command> stop = coordinator_->WaitCommand(node, 0);
    ASSERT_TRUE(stop && stop->has_stop()) << node;
    EXPECT_EQ(stop->stop().job_id(), id);
  }
  // Later exits of the stopped ranks do not change the verdict.
  ASSERT_TRUE(coordinator_->ReportWorkerState(Exit(id, 0, 0, 15)).ok());
  EXPECT_EQ(coordinator_->GetJob(id)->cause(), job.cause());
}

TEST_F(CoordinatorTest, NonZeroExitCodeIsNamed) {
  Connect("a");
  Connect("b");
  std::string id = coordinator_->Submit(kRecipe, "unit.yaml")->id();
  ASSERT_TRUE(coordinator_->ReportWorkerState(Exit(id, 1, 3)).ok());
  EXPECT_NE(coordinator_->GetJob(id)->cause().find("rank 1 on a exited with code 3"), std::string::npos);
}

TEST_F(CoordinatorTest, SilentNodeIsLostAfterTheTimeout) {
  Connect("a");
  Connect("b");
  std::string id = coordinator_->Submit(kRecipe, "unit.yaml")->id();
  clock_.AdvanceMs(2000);
  ASSERT_TRUE(coordinator_->Heartbeat("a").ok());
  coordinator_->CheckNodes();
  EXPECT_EQ(coordinator_->GetJob(id)->state(), v1::JOB_STATE_RUNNING);
  clock_.AdvanceMs(1500);  // b silent for 3.5 s, a for 1.5 s
  coordinator_->CheckNodes();
  v1::Job job = *coordinator_->GetJob(id);
  EXPECT_EQ(job.state(), v1::JOB_STATE_FAILED);
  EXPECT_NE(job.cause().find("node b lost"), std::string::npos) << job.cause();
}

TEST_F(CoordinatorTest, StaleStreamClosingDoesNotDropAReconnectedNode) {
  int64_t old_token = Connect("a");
  Connect("a");  // the agent reconnected before the old stream noticed
  Connect("b");
  coordinator_->NodeDisconnected("a", old_token);
  std::string id = coordinator_->Submit(kRecipe, "unit.yaml")->id();
  EXPECT_EQ(coordinator_->GetJob(id)->state(), v1::JOB_STATE_RUNNING);
}

TEST_F(CoordinatorTest, StopEndsAPendingJob) {
  std::string id = coordinator_->Submit(kRecipe, "unit.yaml")->id();
  StatusOr<v1::Job> stopped = coordinator_->Stop(id, "");
  ASSERT_TRUE(stopped.ok());
  EXPECT_EQ(stopped->state(), v1::JOB_STATE_STOPPED);
  Connect("a");
  Connect("b");
  EXPECT_FALSE(coordinator_->WaitCommand("a", 0).has_value());
}

TEST_F(CoordinatorTest, InvalidRecipeIsRejectedWithItsLocation) {
  StatusOr<v1::Job> job = coordinator_->Submit("data: {path: /d}\nmodel: {heads: 3}\n", "bad.yaml");
  ASSERT_FALSE(job.ok());
  EXPECT_EQ(job.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(job.status().message().find("bad.yaml:2:16:"), std::string::npos) << job.status().message();
  EXPECT_TRUE(store_->ListJobs(10)->empty());
}

TEST_F(CoordinatorTest, RendezvousGetReturnsPublishedValuesAndTimesOut) {
  coordinator_->KvSet("job/0/rank0", "addr0");
  EXPECT_FALSE(coordinator_->KvGet({"job/0/rank0", "job/0/rank1"}, 0).has_value());
  coordinator_->KvSet("job/0/rank1", "addr1");
  std::optional<std::vector<std::string>> values = coordinator_->KvGet({"job/0/rank0", "job/0/rank1"}, 0);
  ASSERT_TRUE(values.has_value());
  EXPECT_EQ((*values)[1], "addr1");
}

TEST_F(CoordinatorTest, EventsCarryLogsAndProgress) {
  Connect("a");
  Connect("b");
  std::string id = coordinator_->Submit(kRecipe, "unit.yaml")->id();
  v1::PushLogsRequest logs;
  logs.set_job_id(id);
  v1::LogLine* line = logs.add_lines();
  line->set_rank(0);
  line->set_text("step 3/5 loss 2.500000 lr 1.0e-03 tok/s 100 step_ms 1.0");
  coordinator_->PushLogs(logs);
  bool finished = false;
  std::vector<v1::Event> events = *coordinator_->WaitEvents(id, 0, true, 0, &finished);
  EXPECT_FALSE(finished);
  ASSERT_FALSE(events.empty());
  EXPECT_EQ(events.back().kind(), "log");
  EXPECT_EQ(coordinator_->GetJob(id)->last_step(), 3);
  EXPECT_DOUBLE_EQ(coordinator_->GetJob(id)->last_loss(), 2.5);
  std::vector<v1::Event> without_logs = *coordinator_->WaitEvents(id, 0, false, 0, &finished);
  EXPECT_EQ(without_logs.size() + 1, events.size());
}

}  // namespace
}  // namespace ltrain::launcher
