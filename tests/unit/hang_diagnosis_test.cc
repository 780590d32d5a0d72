#include "launcher/hang_diagnosis.h"

#include <gtest/gtest.h>

namespace ltrain::launcher {
namespace {

v1::WorkProgress Work(const std::string& what, int64_t done, int64_t total, const std::string& unit,
                      bool waits_for_peers) {
  v1::WorkProgress work;
  work.set_what(what);
  work.set_done(done);
  work.set_total(total);
  work.set_unit(unit);
  work.set_waits_for_peers(waits_for_peers);
  return work;
}

RankActivity Waiting(int rank, uint64_t seq, int64_t idle_ms) {
  RankActivity r;
  r.rank = rank;
  r.step = 40;
  r.phase = "backward";
  r.reported = true;
  r.idle_ms = idle_ms;
  r.in_collective = true;
  r.collective_seq = seq;
  r.collective_op = "all_reduce";
  r.collective_group = "dp 0";
  return r;
}

TEST(HangDiagnosisTest, NoHangBeforeTheTimeout) {
  EXPECT_FALSE(DiagnoseHang({Waiting(0, 5, 100), Waiting(1, 5, 29999)}, PhaseLimits::Uniform(30000)).has_value());
}

TEST(HangDiagnosisTest, RankOutsideTheCollectiveIsBehind) {
  RankActivity computing = Waiting(2, 4, 31000);
  computing.in_collective = false;
  computing.phase = "forward";
  std::optional<std::string> hang = DiagnoseHang({Waiting(0, 5, 31000), Waiting(1, 5, 31000), computing}, PhaseLimits::Uniform(30000));
  ASSERT_TRUE(hang.has_value());
  EXPECT_EQ(*hang, "hang: rank 2 made no progress for 31s in step 40 (forward); ranks 0-1 wait in all_reduce #5 of dp 0");
}

TEST(HangDiagnosisTest, SilentRankIsBehindEvenInsideACollective) {
  RankActivity stopped = Waiting(1, 5, 40000);
  stopped.silent_ms = 40000;
  std::optional<std::string> hang = DiagnoseHang({Waiting(0, 5, 40000), stopped, Waiting(2, 5, 40000)}, PhaseLimits::Uniform(30000));
  ASSERT_TRUE(hang.has_value());
  EXPECT_EQ(*hang, "hang: rank 1 made no progress for 40s in step 40 (backward); ranks 0, 2 wait in all_reduce #5 of dp 0");
}

// Programs of the user's own report no collectives: the rank over its limit is behind, not every
// rank.
TEST(HangDiagnosisTest, WithoutCollectivesTheRankOverItsLimitIsBehind) {
  RankActivity moving = Waiting(0, 0, 200);
  moving.in_collective = false;
  moving.step = 9;
  moving.phase = "train";
  RankActivity stuck = moving;
  stuck.rank = 1;
  stuck.step = 1;
  stuck.idle_ms = 31000;
  std::optional<std::string> hang = DiagnoseHang({moving, stuck}, PhaseLimits::Uniform(30000));
  ASSERT_TRUE(hang.has_value());
  EXPECT_EQ(hang->rfind("hang: rank 1 made no progress for 31s in step 1 (train)", 0), 0u) << *hang;
}

TEST(HangDiagnosisTest, RankInAnOlderCollectiveIsBehind) {
  std::optional<std::string> hang =
      DiagnoseHang({Waiting(0, 7, 31000), Waiting(1, 7, 31000), Waiting(2, 6, 31000), Waiting(3, 7, 31000)}, PhaseLimits::Uniform(30000));
  ASSERT_TRUE(hang.has_value());
  EXPECT_EQ(*hang, "hang: rank 2 made no progress for 31s in step 40 (backward); ranks 0-1, 3 wait in all_reduce #7 of dp 0");
}

TEST(HangDiagnosisTest, EveryoneStuckInTheSameCollective) {
  std::optional<std::string> hang = DiagnoseHang({Waiting(0, 7, 31000), Waiting(1, 7, 32000)}, PhaseLimits::Uniform(30000));
  ASSERT_TRUE(hang.has_value());
  EXPECT_EQ(*hang, "hang: all ranks made no progress for 32s (all_reduce #7 of dp 0, step 40, backward)");
}

TEST(HangDiagnosisTest, RankThatNeverReported) {
  RankActivity silent;
  silent.rank = 3;
  silent.idle_ms = silent.silent_ms = 61000;
  std::optional<std::string> hang = DiagnoseHang({Waiting(0, 1, 1000), silent}, PhaseLimits::Uniform(60000));
  ASSERT_TRUE(hang.has_value());
  // Rank 0 trains: a rank never heard from is past its start-up too, and judged as a step.
  EXPECT_EQ(*hang, "hang: rank 3 made no progress for 61s in step 0 (startup, never reported); rank 0 waits in all_reduce #1 of dp 0");
}

PhaseLimits Limits() {
  PhaseLimits limits;
  limits.step_ms = 3000;
  limits.startup_ms = 120000;
  limits.checkpoint_ms = 30000;
  limits.checkpoint_how = "checkpoint.timeout_s=30";
  return limits;
}

RankActivity Saving(int rank, int64_t idle_ms) {
  RankActivity r;
  r.rank = rank;
  r.step = 20;
  r.phase = "checkpoint";
  r.reported = true;
  r.idle_ms = idle_ms;
  r.work = Work("saving checkpoint step-20", 12'000'000, 24'000'000, "bytes", false);
  return r;
}

TEST(HangDiagnosisTest, ASaveLongerThanTheHangTimeoutIsNoHang) {
  // Rank 1 waits in the final barrier while rank 0 writes; neither moved for 20 s (> 3 s).
  RankActivity barrier = Waiting(1, 9, 20000);
  barrier.phase = "done";
  EXPECT_FALSE(DiagnoseHang({Saving(0, 20000), barrier}, Limits()).has_value());
}

TEST(HangDiagnosisTest, AStuckSaveNamesTheRankAndItsLimit) {
  RankActivity committing = Saving(0, 31000);
  committing.work = Work("waiting for the ranks' files of step-20", 1, 2, "ranks", true);
  std::optional<std::string> hang = DiagnoseHang({committing, Saving(1, 31000)}, Limits());
  ASSERT_TRUE(hang.has_value());
  EXPECT_EQ(*hang, "stuck checkpoint save: rank 1 made no progress for 31s in step 20 (checkpoint: saving checkpoint "
                   "step-20, 12.0 of 24.0 MB; limit checkpoint.timeout_s=30); rank 0 waits for its peers (waiting for "
                   "the ranks' files of step-20, 1 of 2 ranks)");
}

TEST(HangDiagnosisTest, AStartUpIsJudgedByItsOwnLimit) {
  RankActivity building;
  building.rank = 0;
  building.phase = "startup";
  building.reported = true;
  building.idle_ms = 100000;
  building.work = Work("building the model", 40, 100, "parameters", false);
  RankActivity unreported;
  unreported.rank = 1;
  unreported.idle_ms = unreported.silent_ms = 100000;
  EXPECT_FALSE(DiagnoseHang({building, unreported}, Limits()).has_value()) << "100 s < 120 s";
  building.idle_ms = unreported.idle_ms = unreported.silent_ms = 121000;
  std::optional<std::string> hang = DiagnoseHang({building, unreported}, Limits());
  ASSERT_TRUE(hang.has_value());
  EXPECT_EQ(*hang, "stuck start-up: rank 1 made no progress for 121s in step 0 (startup, never reported; limit "
                   "fault.startup_timeout_s); rank 0 is outside collectives");
}

TEST(HangDiagnosisTest, LimitsComeFromTheRecipe) {
  Recipe recipe;
  recipe.model.layers = 24;
  recipe.model.d_model = 2048;
  recipe.model.vocab = 50304;
  recipe.model.seq_len = 1024;
  recipe.fault.hang_timeout_s = 60;
  const PhaseLimits auto_limits = PhaseLimits::FromRecipe(recipe);
  EXPECT_EQ(auto_limits.step_ms, 60000);
  // 1.31e9 parameters, 15.8 GB of state: 60 s + 315 s.
  EXPECT_NEAR(auto_limits.checkpoint_ms, 375000, 2000);
  EXPECT_NEAR(auto_limits.startup_ms, 435000, 2000);
  EXPECT_EQ(auto_limits.checkpoint_how, "checkpoint.timeout_s auto: 60 s + 1 s per 50 MB of 15.8 GB of state");
  recipe.checkpoint.timeout_s = 5;
  recipe.fault.startup_timeout_s = 7;
  const PhaseLimits set = PhaseLimits::FromRecipe(recipe);
  EXPECT_EQ(set.checkpoint_ms, 5000);
  EXPECT_EQ(set.checkpoint_how, "checkpoint.timeout_s=5");
  EXPECT_EQ(set.startup_ms, 7000);
  // A tiny model's auto limit is never below the hang timeout.
  recipe = Recipe{};
  recipe.fault.hang_timeout_s = 600;
  EXPECT_EQ(PhaseLimits::FromRecipe(recipe).checkpoint_ms, 600000);
}

TEST(HangDiagnosisTest, DescribeRanksFoldsRuns) {
  EXPECT_EQ(DescribeRanks({3}), "rank 3");
  EXPECT_EQ(DescribeRanks({2, 0, 1, 5, 7, 6}), "ranks 0-2, 5-7");
}

}  // namespace
}  // namespace ltrain::launcher
