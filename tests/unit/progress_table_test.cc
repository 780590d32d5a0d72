#include "agent/progress_table.h"

#include <gtest/gtest.h>

#include "common/clock.h"

namespace ltrain::agent {
namespace {

v1::RankProgress Report(int rank, int64_t seq, int64_t step, int generation = 1) {
  v1::RankProgress report;
  report.set_job_id("j1");
  report.set_generation(generation);
  report.set_rank(rank);
  report.set_seq(seq);
  report.set_step(step);
  report.set_phase("forward");
  return report;
}

v1::RankProgress Committed(v1::RankProgress report, int64_t step) {
  report.set_committed_step(step);
  report.set_committed_path("/ck/step-" + std::to_string(step));
  return report;
}

class ProgressTableTest : public ::testing::Test {
 protected:
  FakeClock clock_;
  ProgressTable table_{clock_};
};

TEST_F(ProgressTableTest, ANewerCommitOrTheStopAfterAFinalCheckpointIsNewsAtOnce) {
  EXPECT_FALSE(table_.Record(Report(0, 1, 4)).has_value()) << "a step is not news: heartbeats carry it";
  clock_.AdvanceMs(150);
  std::optional<v1::RankProgress> commit = table_.Record(Committed(Report(0, 2, 5), 5));
  ASSERT_TRUE(commit.has_value());
  EXPECT_EQ(commit->committed_step(), 5);
  EXPECT_EQ(commit->committed_path(), "/ck/step-5");
  EXPECT_EQ(commit->seq(), 2);
  EXPECT_EQ(commit->silent_ms(), 0);
  EXPECT_EQ(commit->idle_ms(), 0) << "the step changed";
  EXPECT_FALSE(table_.Record(Committed(Report(0, 3, 6), 5)).has_value()) << "the same commit again";

  v1::RankProgress stopped = Committed(Report(0, 4, 6), 5);
  stopped.set_stopped_after_checkpoint(true);
  std::optional<v1::RankProgress> stop = table_.Record(stopped);
  ASSERT_TRUE(stop.has_value());
  EXPECT_TRUE(stop->stopped_after_checkpoint());
  stopped.set_seq(5);
  EXPECT_FALSE(table_.Record(stopped).has_value());

  // A worker's first report with a commit (a run that resumed from its own directory) is news too.
  EXPECT_TRUE(table_.Record(Committed(Report(1, 1, 0), 5)).has_value());
}

TEST_F(ProgressTableTest, AnOlderReportThanTheLatestIsIgnored) {
  table_.Record(Committed(Report(0, 7, 12), 10));
  EXPECT_FALSE(table_.Record(Committed(Report(0, 6, 11), 5)).has_value());
  std::vector<v1::RankProgress> reports = table_.Collect({{"j1", 1, 0}});
  ASSERT_EQ(reports.size(), 1u);
  EXPECT_EQ(reports[0].seq(), 7);
  EXPECT_EQ(reports[0].step(), 12);
  EXPECT_EQ(reports[0].committed_step(), 10);
}

TEST_F(ProgressTableTest, HeartbeatsCarryTheRunningWorkersWithAgesOnThisNodesClock) {
  table_.Record(Report(0, 1, 4));
  table_.Record(Report(1, 1, 4));
  table_.Record(Report(0, 1, 9, /*generation=*/0));  // a leftover of an older generation
  clock_.AdvanceMs(300);
  table_.Record(Report(0, 2, 4));  // the same step and phase: no progress, but alive
  clock_.AdvanceMs(100);
  std::vector<v1::RankProgress> reports = table_.Collect({{"j1", 1, 0}, {"j1", 1, 1}});
  ASSERT_EQ(reports.size(), 2u);
  EXPECT_EQ(reports[0].rank(), 0);
  EXPECT_EQ(reports[0].generation(), 1);
  EXPECT_EQ(reports[0].idle_ms(), 400);
  EXPECT_EQ(reports[0].silent_ms(), 100);
  EXPECT_EQ(reports[1].rank(), 1);
  EXPECT_EQ(reports[1].silent_ms(), 400);
}

TEST_F(ProgressTableTest, TheExitReportTakesTheWorkersLastReport) {
  table_.Record(Report(0, 1, 4));
  clock_.AdvanceMs(200);
  table_.Record(Committed(Report(0, 2, 5), 5));
  clock_.AdvanceMs(50);
  v1::WorkerStateReport exit;
  exit.set_job_id("j1");
  exit.set_generation(1);
  exit.set_rank(0);
  exit.set_state("exited");
  table_.CompleteExitReport(exit);
  ASSERT_TRUE(exit.has_progress());
  EXPECT_EQ(exit.progress().seq(), 2);
  EXPECT_EQ(exit.progress().committed_step(), 5);
  EXPECT_EQ(exit.progress().silent_ms(), 50);
  // Forgotten once taken, even while the set of running workers still names it.
  EXPECT_TRUE(table_.Collect({{"j1", 1, 0}}).empty());
  v1::WorkerStateReport again = exit;
  again.clear_progress();
  table_.CompleteExitReport(again);
  EXPECT_FALSE(again.has_progress());
  // A worker of another generation that never reported gets none.
  v1::WorkerStateReport other = again;
  other.set_generation(2);
  table_.CompleteExitReport(other);
  EXPECT_FALSE(other.has_progress());
}

TEST_F(ProgressTableTest, AReportOfNoRunningWorkerIsForgottenAfterAMinute) {
  table_.Record(Report(3, 1, 4));
  clock_.AdvanceMs(ProgressTable::kForgetMs);
  EXPECT_TRUE(table_.Collect({}).empty());
  EXPECT_EQ(table_.Collect({{"j1", 1, 3}}).size(), 1u) << "kept for exactly a minute";
  clock_.AdvanceMs(1);
  table_.Collect({});
  EXPECT_TRUE(table_.Collect({{"j1", 1, 3}}).empty());
}

}  // namespace
}  // namespace ltrain::agent
