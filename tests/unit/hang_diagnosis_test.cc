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
  EXPECT_EQ(*hang, "hang: rank 2 made no progress for 31s in step 40 (forward); ranks 0-1 wait in all_reduce #5 of dp 0; "
                   "limit fault.hang_timeout_s=30");
}

TEST(HangDiagnosisTest, SilentRankIsBehindEvenInsideACollective) {
  RankActivity stopped = Waiting(1, 5, 40000);
  stopped.silent_ms = 40000;
  std::optional<std::string> hang = DiagnoseHang({Waiting(0, 5, 40000), stopped, Waiting(2, 5, 40000)}, PhaseLimits::Uniform(30000));
  ASSERT_TRUE(hang.has_value());
  EXPECT_EQ(*hang, "hang: rank 1 made no progress for 40s in step 40 (backward); it is in all_reduce #5 of dp 0; ranks 0, "
                   "2 wait in all_reduce #5 of dp 0; limit fault.hang_timeout_s=30");
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
  EXPECT_EQ(*hang, "hang: rank 2 made no progress for 31s in step 40 (backward); it is in all_reduce #6 of dp 0; ranks "
                   "0-1, 3 wait in all_reduce #7 of dp 0; limit fault.hang_timeout_s=30");
}

TEST(HangDiagnosisTest, EveryoneStuckInTheSameCollective) {
  std::optional<std::string> hang = DiagnoseHang({Waiting(0, 7, 31000), Waiting(1, 7, 32000)}, PhaseLimits::Uniform(30000));
  ASSERT_TRUE(hang.has_value());
  EXPECT_EQ(*hang, "hang: all ranks made no progress for 32s (all_reduce #7 of dp 0, step 40, backward); limit "
                   "fault.hang_timeout_s=30");
}

TEST(HangDiagnosisTest, RankThatNeverReported) {
  RankActivity silent;
  silent.rank = 3;
  silent.idle_ms = silent.silent_ms = 61000;
  std::optional<std::string> hang = DiagnoseHang({Waiting(0, 1, 1000), silent}, PhaseLimits::Uniform(60000));
  ASSERT_TRUE(hang.has_value());
  // Rank 0 trains: a rank never heard from is past its start-up too, and judged as a step.
  EXPECT_EQ(*hang, "hang: rank 3 made no progress for 61s in step 0 (startup, never reported); rank 0 waits in all_reduce #1 of "
                   "dp 0; limit fault.hang_timeout_s=60");
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

// With no fault keys, a step's limit follows the run: the start-up limit for the first steps, then
// 20 times the slowest of the last 50 steps within 20-600 s; a checkpoint's grows with the saves.
TEST(HangDiagnosisTest, LimitsTheRecipeLeavesUnsetAreDerivedFromTheRun) {
  Recipe recipe;
  RunTimes times;
  const PhaseLimits first = PhaseLimits::Derive(recipe, times);
  EXPECT_EQ(first.step_ms, first.startup_ms);
  EXPECT_EQ(first.step_how.rfind("fault.hang_timeout_s auto: ", 0), 0u) << first.step_how;
  EXPECT_NE(first.step_how.find("the start-up limit until 3 steps are done"), std::string::npos) << first.step_how;
  for (int64_t step = 1; step <= 3; ++step) times.ObserveStep(step, 250);
  times.ObserveStep(3, 300);  // another rank's report of the same step
  PhaseLimits quick = PhaseLimits::Derive(recipe, times);
  EXPECT_EQ(quick.step_ms, 20000) << "the floor: 20 x 0.3 s is 6 s";
  EXPECT_EQ(quick.step_how, "fault.hang_timeout_s auto: 20.0 s, 20 x the slowest of the last 3 steps (0.30 s) within 20-600 s");
  times.ObserveStep(4, 2500);
  EXPECT_EQ(PhaseLimits::Derive(recipe, times).step_ms, 50000);
  times.ObserveStep(5, 60000);
  EXPECT_EQ(PhaseLimits::Derive(recipe, times).step_ms, 600000) << "the ceiling";
  // The slow step leaves the window after 50 more.
  for (int64_t step = 6; step <= 55; ++step) times.ObserveStep(step, 1000);
  EXPECT_EQ(PhaseLimits::Derive(recipe, times).step_ms, 20000);
  EXPECT_DOUBLE_EQ(times.slowest_step_ms(), 1000);
  // A new generation starts over.
  times.Restart();
  EXPECT_EQ(PhaseLimits::Derive(recipe, times).step_ms, first.startup_ms);
  // Saves: the checkpoint's limit is at least 3 x the slowest.
  const int64_t by_size = PhaseLimits::Derive(recipe, times).checkpoint_ms;
  times.ObserveSave(by_size);
  const PhaseLimits saved = PhaseLimits::Derive(recipe, times);
  EXPECT_EQ(saved.checkpoint_ms, 3 * by_size);
  EXPECT_EQ(saved.checkpoint_how.rfind("checkpoint.timeout_s auto: ", 0), 0u) << saved.checkpoint_how;
  EXPECT_NE(saved.checkpoint_how.find("3 x the slowest save so far"), std::string::npos) << saved.checkpoint_how;
  // What the recipe sets wins.
  recipe.fault.hang_timeout_s = 45;
  recipe.checkpoint.timeout_s = 9;
  const PhaseLimits set = PhaseLimits::Derive(recipe, times);
  EXPECT_EQ(set.step_ms, 45000);
  EXPECT_EQ(set.step_how, "fault.hang_timeout_s=45");
  EXPECT_EQ(set.checkpoint_ms, 9000);
}

// A collective's derived limit is twice the longest of the others, so that the coordinator names a
// hang before a collective gives up.
TEST(HangDiagnosisTest, TheCollectiveTimeoutOutlastsTheOtherLimits) {
  Recipe recipe;
  const PhaseTimeout startup = StartupTimeout(recipe);
  EXPECT_DOUBLE_EQ(CollectiveTimeout(recipe, 0, 0).seconds, 2 * startup.seconds);
  EXPECT_DOUBLE_EQ(CollectiveTimeout(recipe, 10, 30000).seconds, 1200) << "twice the step's 600 s";
  EXPECT_NE(CollectiveTimeout(recipe, 10, 30000).how.find("twice the training step's limit"), std::string::npos);
  recipe.fault.collective_timeout_s = 90;
  EXPECT_DOUBLE_EQ(CollectiveTimeout(recipe, 10, 30000).seconds, 90);
}

// The cross-rank picture: the rank that never entered the collective its peers wait in, with the
// last collective it completed.
TEST(HangDiagnosisTest, TheRankBehindIsShownWithItsLastCollective) {
  RankActivity stopped = Waiting(2, 0, 25000);
  stopped.in_collective = false;
  stopped.silent_ms = 25000;
  stopped.phase = "backward";
  stopped.last_seq = 811;
  stopped.last_op = "all_reduce";
  stopped.last_group = "world";
  std::vector<RankActivity> ranks = {Waiting(0, 812, 24000), Waiting(1, 812, 24000), stopped, Waiting(3, 812, 24000)};
  for (RankActivity& r : ranks) r.collective_group = "world";
  std::optional<std::string> hang = DiagnoseHang(ranks, PhaseLimits::Uniform(20000));
  ASSERT_TRUE(hang.has_value());
  EXPECT_EQ(*hang, "hang: rank 2 made no progress for 25s in step 40 (backward); its last collective was all_reduce "
                   "#811 of world; ranks 0-1, 3 wait in all_reduce #812 of world; limit fault.hang_timeout_s=20");
}

// The file a hang leaves: every rank's last report with its recent collectives, and the ranks never
// heard from.
TEST(HangDiagnosisTest, EveryRanksCollectivesInOnePicture) {
  v1::RankProgress waiting;
  waiting.set_rank(0);
  waiting.set_step(57);
  waiting.set_phase("backward");
  waiting.set_idle_ms(21000);
  waiting.set_silent_ms(400);
  v1::CollectiveRecord* done = waiting.add_collectives();
  done->set_seq(811);
  done->set_op("all_reduce");
  done->set_group("world");
  done->set_bytes(4200000);
  done->set_start_unix_ms(1765000862345);  // 2025-12-06 06:01:02.345 UTC
  done->set_end_unix_ms(1765000862351);
  v1::CollectiveRecord* open = waiting.add_collectives();
  *open = *done;
  open->set_seq(812);
  open->set_start_unix_ms(1765000862360);
  open->set_end_unix_ms(0);
  EXPECT_EQ(DescribeRankCollectives({waiting}, 2),
            "rank 0: step 57 (backward), no progress for 21.0 s, silent for 0.4 s\n"
            "  all_reduce #811 of world, 4.2 MB, 06:01:02.345 to 06:01:02.351 (6 ms)\n"
            "  all_reduce #812 of world, 4.2 MB, 06:01:02.360, not ended\n"
            "rank 1: never reported\n");
}

TEST(HangDiagnosisTest, DescribeRanksFoldsRuns) {
  EXPECT_EQ(DescribeRanks({3}), "rank 3");
  EXPECT_EQ(DescribeRanks({2, 0, 1, 5, 7, 6}), "ranks 0-2, 5-7");
}

}  // namespace
}  // namespace ltrain::launcher
