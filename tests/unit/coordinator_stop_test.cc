// The coordinator's stops: `ltrain stop --checkpoint` (the workers asked to commit a final checkpoint,
// a stop that takes too long, failures and plain stops meanwhile) and ranks that report they stopped.
#include <gtest/gtest.h>

#include "tests/unit/coordinator_fixture.h"

namespace ltrain::launcher {
namespace {

// `ltrain stop --checkpoint`'s options.
StopOptions WithCheckpoint() {
  StopOptions options;
  options.checkpoint = true;
  return options;
}

class CheckpointStopCoordinatorTest : public CoordinatorTest {
 protected:
  // A job on nodes a and b that has just been asked to stop with a final checkpoint.
  std::string StoppingWithCheckpoint(const char* recipe) {
    Connect("a");
    Connect("b");
    std::string id = coordinator_->Submit(recipe, "unit.yaml")->id();
    EXPECT_TRUE(coordinator_->Stop(id, "", WithCheckpoint()).ok());
    return id;
  }
  // The kRecipe job started on nodes a and b, its checkpoint of step 2 committed; the job's id.
  std::string RunningWithACommitOfStep2() {
    Connect("a");
    Connect("b");
    std::string id = coordinator_->Submit(kRecipe, "unit.yaml")->id();
    coordinator_->WaitCommand("a", 0);
    coordinator_->WaitCommand("b", 0);
    EXPECT_TRUE(coordinator_->ReportProgress(Urgent("a", Committed(Report(id, 0, 1, 2), 2))).ok());
    return id;
  }
};

TEST_F(CheckpointStopCoordinatorTest, StopWithCheckpointAsksTheWorkersThenEndsStoppedWithTheFinalCommit) {
  std::string id = RunningWithACommitOfStep2();
  StopOptions checkpoint = WithCheckpoint();
  StatusOr<v1::Job> stopping = coordinator_->Stop(id, "time limit", checkpoint);
  ASSERT_TRUE(stopping.ok()) << stopping.status().ToString();
  EXPECT_EQ(stopping->state(), v1::JOB_STATE_RUNNING) << "running until the workers have saved";
  for (const char* node : {"a", "b"}) {
    std::optional<v1::Command> stop = coordinator_->WaitCommand(node, 0);
    ASSERT_TRUE(stop && stop->has_stop()) << node;
    EXPECT_TRUE(stop->stop().checkpoint()) << node;
    EXPECT_EQ(stop->stop().generation(), 0);
  }
  // Asking again changes nothing and sends nothing.
  ASSERT_TRUE(coordinator_->Stop(id, "time limit", checkpoint).ok());
  EXPECT_FALSE(coordinator_->WaitCommand("a", 0).has_value());

  ASSERT_TRUE(coordinator_->ReportProgress(Urgent("a", Committed(Report(id, 0, 2, 3), 3))).ok());
  for (int rank = 0; rank < 4; ++rank) {
    EXPECT_EQ(coordinator_->GetJob(id)->state(), v1::JOB_STATE_RUNNING);
    ASSERT_TRUE(coordinator_->ReportWorkerState(Exit(id, rank, 0)).ok());
  }
  v1::Job job = *coordinator_->GetJob(id);
  EXPECT_EQ(job.state(), v1::JOB_STATE_STOPPED);
  EXPECT_EQ(job.last_committed_step(), 3);
  EXPECT_EQ(job.cause(), "time limit; final checkpoint of step 3 committed");
  EXPECT_FALSE(coordinator_->WaitCommand("a", 0).has_value()) << "nothing left to kill";
}

TEST_F(CheckpointStopCoordinatorTest, StopWithCheckpointThatTakesTooLongBecomesAPlainStop) {
  std::string id = RunningWithACommitOfStep2();
  StopOptions checkpoint = WithCheckpoint();
  checkpoint.checkpoint_timeout_ms = 10000;
  ASSERT_TRUE(coordinator_->Stop(id, "", checkpoint).ok());
  coordinator_->WaitCommand("a", 0);
  coordinator_->WaitCommand("b", 0);
  for (int i = 0; i < 9; ++i) {
    clock_.AdvanceMs(1000);
    ASSERT_TRUE(coordinator_->Heartbeat(Beat("a")).ok());
    ASSERT_TRUE(coordinator_->Heartbeat(Beat("b")).ok());
    coordinator_->Tick();
  }
  EXPECT_EQ(coordinator_->GetJob(id)->state(), v1::JOB_STATE_RUNNING);
  clock_.AdvanceMs(1000);
  ASSERT_TRUE(coordinator_->Heartbeat(Beat("a")).ok());
  ASSERT_TRUE(coordinator_->Heartbeat(Beat("b")).ok());
  coordinator_->Tick();
  v1::Job job = *coordinator_->GetJob(id);
  EXPECT_EQ(job.state(), v1::JOB_STATE_STOPPED);
  EXPECT_EQ(job.cause(),
            "stopped by the user; no final checkpoint: the ranks did not commit it within 10.0s; the last commit, "
            "step 2, is kept");
  for (const char* node : {"a", "b"}) {
    std::optional<v1::Command> stop = coordinator_->WaitCommand(node, 0);
    ASSERT_TRUE(stop && stop->has_stop()) << node;
    EXPECT_FALSE(stop->stop().checkpoint()) << node << ": the workers are killed now";
  }
}

TEST_F(CheckpointStopCoordinatorTest, FailureDuringStopWithCheckpointStopsInsteadOfRestarting) {
  std::string id = StoppingWithCheckpoint(kRestartingRecipe);
  ASSERT_TRUE(coordinator_->ReportWorkerState(Exit(id, 1, 1)).ok());
  v1::Job job = *coordinator_->GetJob(id);
  EXPECT_EQ(job.state(), v1::JOB_STATE_STOPPED);
  EXPECT_EQ(job.restarts(), 0);
  EXPECT_NE(job.cause().find("no final checkpoint: rank 1 on a exited with code 1"), std::string::npos) << job.cause();
  EXPECT_NE(job.cause().find("no checkpoint was ever committed"), std::string::npos) << job.cause();
}

TEST_F(CheckpointStopCoordinatorTest, PlainStopDuringStopWithCheckpointEndsTheJobAtOnce) {
  std::string id = StoppingWithCheckpoint(kRecipe);
  StatusOr<v1::Job> stopped = coordinator_->Stop(id, "interrupt");
  ASSERT_TRUE(stopped.ok());
  EXPECT_EQ(stopped->state(), v1::JOB_STATE_STOPPED);
  EXPECT_EQ(stopped->cause(), "interrupt");
}

TEST_F(CoordinatorTest, StopWithCheckpointOfAJobNotRunningStopsItAtOnce) {
  std::string id = coordinator_->Submit(kRecipe, "unit.yaml")->id();
  StopOptions checkpoint = WithCheckpoint();
  StatusOr<v1::Job> stopped = coordinator_->Stop(id, "", checkpoint);
  ASSERT_TRUE(stopped.ok());
  EXPECT_EQ(stopped->state(), v1::JOB_STATE_STOPPED);
  checkpoint.checkpoint_timeout_ms = 0;
  StatusOr<v1::Job> rejected = coordinator_->Stop(id, "", checkpoint);
  ASSERT_FALSE(rejected.ok());
  EXPECT_EQ(rejected.status().code(), StatusCode::kInvalidArgument);
}

// The stop was asked of a coordinator that has restarted since: the ranks' last reports, in their
// exit reports, tell.
TEST_F(CoordinatorTest, RanksThatReportTheyStoppedAfterAFinalCheckpointEndTheJobStopped) {
  Connect("a");
  Connect("b");
  std::string id = coordinator_->Submit(kRecipe, "unit.yaml")->id();
  for (int rank = 0; rank < 4; ++rank) {
    v1::WorkerStateReport exit = Exit(id, rank, 0);
    v1::RankProgress last = Report(id, rank, 20, 3);
    if (rank == 0) last = Committed(last, 3);
    last.set_stopped_after_checkpoint(true);
    *exit.mutable_progress() = last;
    ASSERT_TRUE(coordinator_->ReportWorkerState(exit).ok());
  }
  v1::Job job = *coordinator_->GetJob(id);
  EXPECT_EQ(job.state(), v1::JOB_STATE_STOPPED);
  EXPECT_EQ(job.cause(), "stopped after a final checkpoint; final checkpoint of step 3 committed");
  EXPECT_EQ(job.last_step(), 3);
}

// The same news through the ordered progress reports, ahead of the exits.
TEST_F(CoordinatorTest, AStopAfterAFinalCheckpointReportedAheadOfTheExitsEndsTheJobStopped) {
  Connect("a");
  Connect("b");
  std::string id = coordinator_->Submit(kRecipe, "unit.yaml")->id();
  v1::RankProgress stopped = Committed(Report(id, 0, 5, 3), 3);
  stopped.set_stopped_after_checkpoint(true);
  ASSERT_TRUE(coordinator_->ReportProgress(Urgent("a", stopped)).ok());
  EXPECT_EQ(coordinator_->GetJob(id)->state(), v1::JOB_STATE_RUNNING);
  for (int rank = 0; rank < 4; ++rank) ASSERT_TRUE(coordinator_->ReportWorkerState(Exit(id, rank, 0)).ok());
  v1::Job job = *coordinator_->GetJob(id);
  EXPECT_EQ(job.state(), v1::JOB_STATE_STOPPED);
  EXPECT_EQ(job.cause(), "stopped after a final checkpoint; final checkpoint of step 3 committed");
}

TEST_F(CheckpointStopCoordinatorTest, JobThatFinishesItsStepsWhileStoppingWithCheckpointSucceeds) {
  std::string id = StoppingWithCheckpoint(kRecipe);
  ASSERT_TRUE(coordinator_->ReportProgress(Urgent("a", Committed(Report(id, 0, 1, 5), 5))).ok());
  for (int rank = 0; rank < 4; ++rank) ASSERT_TRUE(coordinator_->ReportWorkerState(Exit(id, rank, 0)).ok());
  EXPECT_EQ(coordinator_->GetJob(id)->state(), v1::JOB_STATE_SUCCEEDED);
}

}  // namespace
}  // namespace ltrain::launcher
