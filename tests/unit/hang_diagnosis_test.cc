#include "launcher/hang_diagnosis.h"

#include <gtest/gtest.h>

namespace ltrain::launcher {
namespace {

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
  EXPECT_FALSE(DiagnoseHang({Waiting(0, 5, 100), Waiting(1, 5, 29999)}, 30000).has_value());
}

TEST(HangDiagnosisTest, RankOutsideTheCollectiveIsBehind) {
  RankActivity computing = Waiting(2, 4, 31000);
  computing.in_collective = false;
  computing.phase = "forward";
  std::optional<std::string> hang = DiagnoseHang({Waiting(0, 5, 31000), Waiting(1, 5, 31000), computing}, 30000);
  ASSERT_TRUE(hang.has_value());
  EXPECT_EQ(*hang, "rank 2 made no progress for 31s in step 40 (forward); ranks 0-1 wait in all_reduce #5 of dp 0");
}

TEST(HangDiagnosisTest, SilentRankIsBehindEvenInsideACollective) {
  RankActivity stopped = Waiting(1, 5, 40000);
  stopped.silent_ms = 40000;
  std::optional<std::string> hang = DiagnoseHang({Waiting(0, 5, 40000), stopped, Waiting(2, 5, 40000)}, 30000);
  ASSERT_TRUE(hang.has_value());
  EXPECT_EQ(*hang, "rank 1 made no progress for 40s in step 40 (backward); ranks 0, 2 wait in all_reduce #5 of dp 0");
}

TEST(HangDiagnosisTest, RankInAnOlderCollectiveIsBehind) {
  std::optional<std::string> hang =
      DiagnoseHang({Waiting(0, 7, 31000), Waiting(1, 7, 31000), Waiting(2, 6, 31000), Waiting(3, 7, 31000)}, 30000);
  ASSERT_TRUE(hang.has_value());
  EXPECT_EQ(*hang, "rank 2 made no progress for 31s in step 40 (backward); ranks 0-1, 3 wait in all_reduce #7 of dp 0");
}

TEST(HangDiagnosisTest, EveryoneStuckInTheSameCollective) {
  std::optional<std::string> hang = DiagnoseHang({Waiting(0, 7, 31000), Waiting(1, 7, 32000)}, 30000);
  ASSERT_TRUE(hang.has_value());
  EXPECT_EQ(*hang, "all ranks made no progress for 32s (all_reduce #7 of dp 0, step 40, backward)");
}

TEST(HangDiagnosisTest, RankThatNeverReported) {
  RankActivity silent;
  silent.rank = 3;
  silent.idle_ms = silent.silent_ms = 61000;
  std::optional<std::string> hang = DiagnoseHang({Waiting(0, 1, 1000), silent}, 60000);
  ASSERT_TRUE(hang.has_value());
  EXPECT_EQ(*hang, "rank 3 made no progress for 61s in step 0 (startup, never reported); rank 0 waits in all_reduce #1 of dp 0");
}

TEST(HangDiagnosisTest, DescribeRanksFoldsRuns) {
  EXPECT_EQ(DescribeRanks({3}), "rank 3");
  EXPECT_EQ(DescribeRanks({2, 0, 1, 5, 7, 6}), "ranks 0-2, 5-7");
}

}  // namespace
}  // namespace ltrain::launcher
