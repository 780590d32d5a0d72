#include "launcher/straggler.h"

#include <gtest/gtest.h>

#include <vector>

namespace ltrain::launcher {
namespace {

std::vector<RankCompute> Even(int n, double ms, int steps = kStragglerWindow) {
  std::vector<RankCompute> out;
  for (int r = 0; r < n; ++r) out.push_back({r, ms, steps});
  return out;
}

TEST(StragglerTest, ARankAboveTheRatioOfTheOthersMedianIsNamed) {
  std::vector<RankCompute> ranks = Even(4, 100);
  ranks[2].compute_ms = 150;
  const std::vector<Straggler> found = FindStragglers(ranks);
  ASSERT_EQ(found.size(), 1u);
  EXPECT_EQ(found[0].rank, 2);
  EXPECT_DOUBLE_EQ(found[0].compute_ms, 150);
  EXPECT_DOUBLE_EQ(found[0].others_median_ms, 100);
}

TEST(StragglerTest, EvenRanksAndSmallSpreadsNameNoOne) {
  EXPECT_TRUE(FindStragglers(Even(8, 100)).empty());
  std::vector<RankCompute> ranks = Even(4, 100);
  ranks[0].compute_ms = 115;  // below 1.2x
  ranks[3].compute_ms = 90;
  EXPECT_TRUE(FindStragglers(ranks).empty());
}

// 23 ms against 17 is 1.35x, but a few milliseconds are rank 0's logging or a busy core.
TEST(StragglerTest, ADifferenceOfAFewMillisecondsIsNoStraggler) {
  std::vector<RankCompute> ranks = Even(2, 17);
  ranks[0].compute_ms = 23;
  EXPECT_TRUE(FindStragglers(ranks).empty());
  ranks[0].compute_ms = 28;
  EXPECT_EQ(FindStragglers(ranks).size(), 1u);
}

TEST(StragglerTest, OfTwoRanksTheSlowerIsComparedWithTheOther) {
  std::vector<RankCompute> ranks = Even(2, 100);
  ranks[1].compute_ms = 150;
  const std::vector<Straggler> found = FindStragglers(ranks);
  ASSERT_EQ(found.size(), 1u);
  EXPECT_EQ(found[0].rank, 1);
  EXPECT_DOUBLE_EQ(found[0].others_median_ms, 100);
}

// A figure over fewer steps than the window is start-up; a rank without one leaves the others
// without a fair median; one rank has no one to be compared with.
TEST(StragglerTest, NoOneIsNamedBeforeEveryRankHasAFullWindow) {
  std::vector<RankCompute> ranks = Even(4, 100);
  ranks[2].compute_ms = 300;
  ranks[1].steps = kStragglerWindow - 1;
  EXPECT_TRUE(FindStragglers(ranks).empty());
  ranks[1].steps = kStragglerWindow;
  ranks[3].compute_ms = 0;  // not measured
  EXPECT_TRUE(FindStragglers(ranks).empty());
  EXPECT_TRUE(FindStragglers({{0, 500, kStragglerWindow}}).empty());
}

TEST(StragglerTest, SeveralStragglersAmongManyRanksAreEachNamed) {
  std::vector<RankCompute> ranks = Even(1000, 100);
  ranks[7].compute_ms = 130;
  ranks[999].compute_ms = 400;
  const std::vector<Straggler> found = FindStragglers(ranks);
  ASSERT_EQ(found.size(), 2u);
  EXPECT_EQ(found[0].rank, 7);
  EXPECT_EQ(found[1].rank, 999);
}

}  // namespace
}  // namespace ltrain::launcher
