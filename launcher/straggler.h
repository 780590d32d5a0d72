// Stragglers: ranks whose own work a step (RankProgress StepFigures.compute_ms, each rank's median over
// its last steps) stays above a ratio of the other ranks' median. In synchronous training every rank
// waits for the slowest at each collective, so step times alone name no one; a rank's compute
// without those waits does. Pure.
//
// A mark needs a real, lasting difference: the figure is a median (a few slow steps move it not at
// all); each rank is judged by its best figure of the last kStragglerMemorySteps steps (ranks that
// share busy cores, or a virtual machine's, each have slow spells of tens of steps, at up to twice
// their speed, which a straggler's best figure never leaves); the margin grows with the ranks' own
// step-to-step spread; and the rank must stay above it for kStragglerConfirmSteps steps before it is
// named (and below the keeping margin as long before it is named no longer).
#pragma once

#include <map>
#include <string>
#include <vector>

namespace ltrain::launcher {

constexpr double kStragglerRatio = 1.2;      // times the other ranks' median
constexpr double kStragglerKeepRatio = 1.1;  // a named rank is named no longer only below this
constexpr int kStragglerWindow = 10;         // steps a rank's figure must cover
constexpr double kStragglerMinExcessMs = 10;  // and at least this much above it: in steps of a few
                                              // milliseconds, rank 0's logging or a busy core is no straggler
// Times the ranks' relative spread (median absolute deviation over median, the median over ranks) that
// a rank must also exceed: two medians of 10 steps differ by about 0.8 of that spread by chance alone.
constexpr double kStragglerNoiseFactor = 2.5;
constexpr int kStragglerConfirmSteps = 3;  // steps a rank stays above (or below) before it changes
constexpr int kStragglerMemorySteps = 60;  // a rank's best figure is taken over this many steps

struct RankCompute {
  int rank = 0;
  double compute_ms = 0;  // median over `steps` steps
  int steps = 0;
  double spread_ms = 0;   // median absolute deviation of those steps; 0: unknown
};

struct Straggler {
  int rank = 0;
  double compute_ms = 0;
  double others_median_ms = 0;
};

// The margin over the other ranks' median that a rank must exceed at `ratio`: `ratio`, or more where
// the ranks vary more from step to step than (ratio - 1) / kStragglerNoiseFactor.
double StragglerMargin(const std::vector<RankCompute>& ranks, double ratio);

// The stragglers among `ranks`, by rank: above StragglerMargin(ranks, ratio) times the other ranks'
// median and at least kStragglerMinExcessMs above it. None unless every rank's figure covers `window`
// steps and there are at least two ranks: a figure of a few steps is start-up, not the rank.
std::vector<Straggler> FindStragglers(const std::vector<RankCompute>& ranks, double ratio = kStragglerRatio,
                                      int window = kStragglerWindow);

// Which ranks of one generation are named, from the figures of successive steps: each rank's best
// of its last kStragglerMemorySteps steps, through FindStragglers. The coordinator calls Observe under
// its lock on every tick with the ranks' latest figures; a step it has already seen changes nothing,
// so ticks between reports confirm nothing.
class StragglerTracker {
 public:
  struct Change {
    Straggler straggler;
    bool named = false;  // false: named no longer
  };
  // `step`: the newest step a rank completed. The changes of this observation, by rank.
  std::vector<Change> Observe(int64_t step, const std::vector<RankCompute>& ranks);
  const std::map<int, Straggler>& named() const { return named_; }

 private:
  int64_t last_step_ = -1;
  std::map<int, std::vector<std::pair<int64_t, RankCompute>>> seen_;  // by rank: (step, figure), oldest first
  std::map<int, int64_t> above_since_;  // unnamed ranks above the naming margin: since which step
  std::map<int, int64_t> below_since_;  // named ranks below the keeping margin: since which step
  std::map<int, Straggler> named_;
};

}  // namespace ltrain::launcher
