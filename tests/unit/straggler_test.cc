#include "launcher/straggler.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <deque>
#include <random>
#include <vector>

namespace ltrain::launcher {
namespace {

std::vector<RankCompute> Even(int n, double ms, int steps = kStragglerWindow) {
  std::vector<RankCompute> out;
  for (int r = 0; r < n; ++r) out.push_back({r, ms, steps, 0});
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

// Ranks whose steps vary by a quarter from one to the next (two ranks sharing two busy cores) differ
// by 1.3x by chance; with a small spread the same difference is real.
TEST(StragglerTest, ADifferenceWithinTheRanksOwnSpreadIsNoStraggler) {
  std::vector<RankCompute> ranks = {{0, 100, kStragglerWindow, 25}, {1, 130, kStragglerWindow, 30}};
  EXPECT_GT(StragglerMargin(ranks, kStragglerRatio), 1.3);
  EXPECT_TRUE(FindStragglers(ranks).empty());
  ranks[0].spread_ms = 3;
  ranks[1].spread_ms = 4;
  EXPECT_DOUBLE_EQ(StragglerMargin(ranks, kStragglerRatio), kStragglerRatio);
  EXPECT_EQ(FindStragglers(ranks).size(), 1u);
}

TEST(StragglerTrackerTest, APersistentDifferenceIsNamedAfterTheConfirmingSteps) {
  std::vector<RankCompute> ranks = Even(4, 100);
  ranks[2].compute_ms = 150;
  StragglerTracker tracker;
  for (int64_t step = 10; step < 10 + kStragglerConfirmSteps; ++step) {
    EXPECT_TRUE(tracker.Observe(step, ranks).empty()) << step;
  }
  const std::vector<StragglerTracker::Change> changes = tracker.Observe(10 + kStragglerConfirmSteps, ranks);
  ASSERT_EQ(changes.size(), 1u);
  EXPECT_TRUE(changes[0].named);
  EXPECT_EQ(changes[0].straggler.rank, 2);
  EXPECT_EQ(tracker.named().count(2), 1u);
  EXPECT_TRUE(tracker.Observe(30, ranks).empty()) << "named once";
}

TEST(StragglerTrackerTest, AStepSeenAgainConfirmsNothing) {
  std::vector<RankCompute> ranks = Even(2, 100);
  ranks[1].compute_ms = 200;
  StragglerTracker tracker;
  for (int i = 0; i < 100; ++i) EXPECT_TRUE(tracker.Observe(10, ranks).empty());
  EXPECT_TRUE(tracker.named().empty());
}

// A rank is judged by its best figure of the last kStragglerMemorySteps steps: one that was as fast
// as the others within them is not named, and once slower for longer, named after the confirming steps.
TEST(StragglerTrackerTest, ASlowSpellIsNotNamedUntilItOutlastsTheRanksMemory) {
  std::vector<RankCompute> slow = Even(2, 100);
  slow[0].compute_ms = 140;
  const std::vector<RankCompute> even = Even(2, 100);
  StragglerTracker tracker;
  EXPECT_TRUE(tracker.Observe(10, slow).empty());
  EXPECT_TRUE(tracker.Observe(12, slow).empty());
  EXPECT_TRUE(tracker.Observe(14, even).empty());
  int64_t named_at = 0;
  for (int64_t step = 15; step <= 200 && named_at == 0; ++step) {
    if (!tracker.Observe(step, slow).empty()) named_at = step;
  }
  EXPECT_EQ(named_at, 14 + kStragglerMemorySteps + kStragglerConfirmSteps);
}

// What this machine's two-core virtual machine shows: one of two identical ranks at twice its speed
// for 40 steps in the middle of a run, and back. No one is named.
TEST(StragglerTrackerTest, ASpellOfFortySlowStepsAmidARunNamesNoOne) {
  StragglerTracker tracker;
  for (int64_t step = 10; step <= 300; ++step) {
    std::vector<RankCompute> ranks = Even(2, 40);
    if (step >= 135 && step < 175) ranks[0].compute_ms = 80;
    EXPECT_TRUE(tracker.Observe(step, ranks).empty()) << step;
  }
}

TEST(StragglerTrackerTest, ANamedRankIsReleasedOnlyAfterStayingUnderTheKeepingRatio) {
  std::vector<RankCompute> ranks = Even(2, 100);
  ranks[1].compute_ms = 150;
  StragglerTracker tracker;
  tracker.Observe(10, ranks);
  ASSERT_EQ(tracker.Observe(10 + kStragglerConfirmSteps, ranks).size(), 1u);
  ranks[1].compute_ms = 115;  // under the naming ratio, above the keeping one
  EXPECT_TRUE(tracker.Observe(20, ranks).empty());
  EXPECT_TRUE(tracker.Observe(40, ranks).empty());
  EXPECT_DOUBLE_EQ(tracker.named().at(1).compute_ms, 115) << "its figure follows";
  ranks[1].compute_ms = 100;
  EXPECT_TRUE(tracker.Observe(41, ranks).empty());
  const std::vector<StragglerTracker::Change> changes = tracker.Observe(41 + kStragglerConfirmSteps, ranks);
  ASSERT_EQ(changes.size(), 1u);
  EXPECT_FALSE(changes[0].named);
  EXPECT_TRUE(tracker.named().empty());
}

// What each rank reports at `step`: the median and median absolute deviation of its last 10 steps.
RankCompute Figure(int rank, const std::vector<double>& steps, size_t step) {
  const size_t from = step >= static_cast<size_t>(kStragglerWindow) ? step - kStragglerWindow : 0;
  std::vector<double> window(steps.begin() + static_cast<std::ptrdiff_t>(from),
                             steps.begin() + static_cast<std::ptrdiff_t>(step));
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v.size() % 2 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
  };
  const double m = median(window);
  std::vector<double> deviations;
  for (double ms : window) deviations.push_back(std::abs(ms - m));
  return {rank, m, static_cast<int>(window.size()), median(deviations)};
}

// Two ranks on two busy cores: every step varies by up to a fifth, and now one rank, now the other
// has a burst of slow steps (a checkpoint written beside it, the coordinator's work). Over 300 steps,
// seen every 1 to 4 steps, no one is named.
TEST(StragglerTrackerTest, ThreeHundredStepsOfRanksSharingBusyCoresNameNoOne) {
  for (unsigned seed = 1; seed <= 100; ++seed) {
    std::mt19937 random(seed);
    std::uniform_real_distribution<double> jitter(0.85, 1.2);
    std::vector<std::vector<double>> steps(2);
    for (size_t s = 0; s < 300; ++s) {
      for (int r = 0; r < 2; ++r) {
        const bool burst = (s / 25) % 2 == static_cast<size_t>(r) && s % 25 < 3;
        steps[r].push_back(40.0 * jitter(random) * (burst ? 2.0 : 1.0));
      }
    }
    StragglerTracker tracker;
    for (size_t step = 1; step <= 300; step += 1 + random() % 4) {
      const std::vector<StragglerTracker::Change> changes =
          tracker.Observe(static_cast<int64_t>(step), {Figure(0, steps[0], step), Figure(1, steps[1], step)});
      EXPECT_TRUE(changes.empty()) << "seed " << seed << " step " << step << ": rank " << changes[0].straggler.rank;
    }
  }
}

// The drill: one rank of four 1.5x slower, with the same noise, named by step 20 however often it is seen.
TEST(StragglerTrackerTest, ARankOneAndAHalfTimesSlowerIsNamedWithinTwentySteps) {
  for (unsigned seed = 1; seed <= 100; ++seed) {
    for (size_t every = 1; every <= 3; ++every) {
      std::mt19937 random(seed);
      std::uniform_real_distribution<double> jitter(0.9, 1.1);
      std::vector<std::vector<double>> steps(4);
      for (size_t s = 0; s < 30; ++s) {
        for (int r = 0; r < 4; ++r) steps[r].push_back(40.0 * jitter(random) * (r == 2 ? 1.5 : 1.0));
      }
      StragglerTracker tracker;
      int64_t named_at = 0;
      for (size_t step = every; step <= 30 && named_at == 0; step += every) {
        std::vector<RankCompute> ranks;
        for (int r = 0; r < 4; ++r) ranks.push_back(Figure(r, steps[r], step));
        for (const StragglerTracker::Change& change : tracker.Observe(static_cast<int64_t>(step), ranks)) {
          EXPECT_EQ(change.straggler.rank, 2);
          named_at = static_cast<int64_t>(step);
        }
      }
      EXPECT_GT(named_at, 0) << "seed " << seed << " every " << every;
      EXPECT_LE(named_at, 20) << "seed " << seed << " every " << every;
    }
  }
}

}  // namespace
}  // namespace ltrain::launcher
