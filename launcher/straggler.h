// Stragglers: ranks whose own work a step (RankProgress StepFigures.compute_ms, each rank's mean over
// its last steps) stays above a ratio of the other ranks' median. In synchronous training every rank
// waits for the slowest at each collective, so step times alone name no one; a rank's compute
// without those waits does. Pure.
#pragma once

#include <string>
#include <vector>

namespace ltrain::launcher {

constexpr double kStragglerRatio = 1.2;      // times the other ranks' median
constexpr int kStragglerWindow = 10;         // steps a rank's figure must cover
constexpr double kStragglerMinExcessMs = 10;  // and at least this much above it: in steps of a few
                                              // milliseconds, rank 0's logging or a busy core is no straggler

struct RankCompute {
  int rank = 0;
  double compute_ms = 0;  // mean over `steps` steps
  int steps = 0;
};

struct Straggler {
  int rank = 0;
  double compute_ms = 0;
  double others_median_ms = 0;
};

// The stragglers among `ranks`, by rank: above `ratio` times the other ranks' median and at least
// kStragglerMinExcessMs above it. None unless every rank's figure covers `window` steps and there are
// at least two ranks: a figure of a few steps is start-up, not the rank.
std::vector<Straggler> FindStragglers(const std::vector<RankCompute>& ranks, double ratio = kStragglerRatio,
                                      int window = kStragglerWindow);

}  // namespace ltrain::launcher
