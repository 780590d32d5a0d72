// What the coordinator keeps in memory and for how long: nodes that are lost or leave, the ranks of
// a job that ended (folded), and the job itself.
#include <gtest/gtest.h>

#include "tests/unit/coordinator_fixture.h"

namespace ltrain::launcher {
namespace {

// Nodes that come and go do not add up: an hour after it was lost, a node with nothing left to wait
// for leaves the list (and memory); one that came back stays.
TEST_F(CoordinatorTest, ALostNodeIsForgottenAfterAnHour) {
  Connect("a");
  Connect("b");
  clock_.AdvanceMs(3500);
  ASSERT_TRUE(coordinator_->Heartbeat(Beat("b")).ok());
  coordinator_->Tick();  // a lost
  ASSERT_EQ(coordinator_->ListNodes().size(), 2u);
  clock_.AdvanceMs(1800 * 1000);
  Connect("b");  // b stays connected throughout (a reconnect counts as a heartbeat)
  coordinator_->Tick();
  EXPECT_EQ(coordinator_->ListNodes().size(), 2u);
  clock_.AdvanceMs(1800 * 1000);
  Connect("b");
  coordinator_->Tick();
  std::vector<v1::NodeStatus> nodes = coordinator_->ListNodes();
  ASSERT_EQ(nodes.size(), 1u);
  EXPECT_EQ(nodes[0].node_id(), "b");
}

TEST_F(CoordinatorTest, ANodeThatLeavesIsForgottenAtOnce) {
  Connect("a");
  Connect("b");
  coordinator_->NodeLeaving("a", "maintenance");
  std::vector<v1::NodeStatus> nodes = coordinator_->ListNodes();
  ASSERT_EQ(nodes.size(), 1u);
  EXPECT_EQ(nodes[0].node_id(), "b");
  EXPECT_EQ(coordinator_->held_figures().nodes, 1);
  EXPECT_FALSE(coordinator_->Heartbeat(Beat("a")).ok());  // it must connect again
  Connect("a");
  EXPECT_EQ(coordinator_->ListNodes().size(), 2u);
}

// A job that ended keeps its ranks as one folded record once none runs: GetJob shows what it
// showed before, and a report that comes later still counts.
TEST_F(CoordinatorTest, AFinishedJobsRanksAreFoldedWithNothingLost) {
  Connect("a");
  Connect("b");
  std::string id = coordinator_->Submit(kRecipe, "unit.yaml")->id();
  auto tick = [&] {  // the nodes stay
    ASSERT_TRUE(coordinator_->Heartbeat(Beat("a")).ok());
    ASSERT_TRUE(coordinator_->Heartbeat(Beat("b")).ok());
    coordinator_->Tick();
  };
  for (int rank = 0; rank < 4; ++rank) ASSERT_TRUE(coordinator_->ReportWorkerState(Running(id, rank)).ok());
  ASSERT_TRUE(coordinator_->Heartbeat(BeatWith("a", Report(id, 1, 1, 2))).ok());
  ASSERT_TRUE(coordinator_->ReportWorkerState(Exit(id, 3, 0, 9)).ok());  // the job fails
  ASSERT_EQ(coordinator_->GetJob(id)->state(), v1::JOB_STATE_FAILED);
  clock_.AdvanceMs(5000);
  tick();
  EXPECT_EQ(coordinator_->held_figures().folded_rank_bytes, 0) << "ranks 0 to 2 still run";
  for (int rank = 0; rank < 3; ++rank) ASSERT_TRUE(coordinator_->ReportWorkerState(Exit(id, rank, 0, 15)).ok());
  tick();
  EXPECT_EQ(coordinator_->held_figures().folded_rank_bytes, 0) << "folded only once the reports are quiet";
  const v1::Job before = *coordinator_->GetJob(id);
  clock_.AdvanceMs(2000);
  tick();
  HeldFigures held = coordinator_->held_figures();
  EXPECT_EQ(held.rank_records, 0);
  EXPECT_GT(held.folded_rank_bytes, 0);

  const v1::Job after = *coordinator_->GetJob(id);
  ASSERT_EQ(after.ranks_size(), 4);
  for (int r = 0; r < 4; ++r) {
    v1::RankInfo expected = before.ranks(r);
    // The age of the rank's last progress goes on growing.
    if (!expected.phase().empty()) expected.set_progress_age_ms(expected.progress_age_ms() + 2000);
    EXPECT_EQ(after.ranks(r).DebugString(), expected.DebugString()) << "rank " << r;
  }
  EXPECT_EQ(after.ranks(1).last_step(), 3);
  EXPECT_EQ(after.ranks(1).phase(), "forward");
  EXPECT_EQ(after.ranks(3).signal(), 9);

  // Progress after the end changes nothing; a rank's report unfolds the ranks and counts.
  ASSERT_TRUE(coordinator_->Heartbeat(BeatWith("a", Report(id, 1, 2, 4))).ok());
  EXPECT_EQ(coordinator_->GetJob(id)->ranks(1).last_step(), 3);
  v1::WorkerStateReport late = Exit(id, 0, 0, 6);
  ASSERT_TRUE(coordinator_->ReportWorkerState(late).ok());
  const v1::Job unfolded = *coordinator_->GetJob(id);
  EXPECT_EQ(unfolded.ranks(0).signal(), 6);
  EXPECT_EQ(unfolded.ranks(1).last_step(), 3);
  EXPECT_EQ(coordinator_->held_figures().folded_rank_bytes, 0);
  // A late report of the rank whose progress was folded keeps it.
  ASSERT_TRUE(coordinator_->ReportWorkerState(Exit(id, 1, 0, 6)).ok());
  const v1::RankInfo rank1 = coordinator_->GetJob(id)->ranks(1);
  EXPECT_EQ(rank1.signal(), 6);
  EXPECT_EQ(rank1.last_step(), 3);
  EXPECT_EQ(rank1.phase(), "forward");
  clock_.AdvanceMs(2000);
  tick();
  EXPECT_EQ(coordinator_->GetJob(id)->ranks(0).signal(), 6);
  EXPECT_EQ(coordinator_->GetJob(id)->ranks(1).last_step(), 3);
  EXPECT_GT(coordinator_->held_figures().folded_rank_bytes, 0);
}

// A job that ended leaves memory keep_finished_in_memory_ms (10 minutes) after, at a tick; its
// record, ranks included, is the state's.
TEST_F(CoordinatorTest, AFinishedJobLeavesMemoryTenMinutesAfterItEnded) {
  Connect("a");
  Connect("b");
  std::string id = coordinator_->Submit(kRecipe, "unit.yaml")->id();
  for (int rank = 0; rank < 4; ++rank) ASSERT_TRUE(coordinator_->ReportWorkerState(Exit(id, rank, 0)).ok());
  coordinator_->Tick();
  EXPECT_EQ(coordinator_->held_figures().jobs, 1);
  clock_.AdvanceMs(9 * 60 * 1000);
  coordinator_->Tick();
  EXPECT_EQ(coordinator_->held_figures().jobs, 1);
  clock_.AdvanceMs(60 * 1000);
  coordinator_->Tick();
  EXPECT_EQ(coordinator_->held_figures().jobs, 0);
  v1::Job stored = *coordinator_->GetJob(id);
  EXPECT_EQ(stored.state(), v1::JOB_STATE_SUCCEEDED);
  EXPECT_EQ(stored.ranks_size(), 4);
}

}  // namespace
}  // namespace ltrain::launcher
