// Stragglers: ranks whose own work a step (RankProgress StepFigures.compute_ms, each rank's median over
// its last steps) stays above a ratio of the other ranks' median. In synchronous training every rank
// waits for the slowest at each collective, so step times alone name no one; a rank's compute
// without those waits does. Pure.
//
// A mark needs a real, lasting difference: the figure is a median (a few slow steps move it not at
// all); a rank must have stood above the others at every look over its last kStragglerMemorySteps
// steps (ranks that share busy cores, or a virtual machine's, each have slow spells of tens of steps,
// at up to twice their speed, which a straggler never leaves); the margin grows with the ranks' own
// step-to-step spread; and the rank must stay above it for kStragglerConfirmSteps steps before it is
// named (and below the keeping margin as long before it is named no longer).
//
// CPU ranks of one node that report their cores are compared with each other on the steps they ran
// on one core at once (more ranks than cores: they take turns on it, its speed then the same for
// each), or else only where they shared two cores or more, and must be slower on each (and by their
// whole figures): a virtual machine's cores differ in speed for spells of a hundred steps or more,
// and two identical ranks that the scheduler keeps on different cores would differ as much. A rank
// that moved between cores within its steps has a figure of all of them. Ranks of other nodes, and
// ranks with GPUs, are compared on their whole figures.
#pragma once

#include <cstdint>
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
constexpr int kStragglerMemorySteps = 60;  // a rank must have stood above at every look of this many steps

constexpr int kStragglerCoreSteps = 3;  // steps of its window each of two ranks must have run on a core
                                        // to be compared on it

struct CoreCompute {
  int cpu = 0;
  double compute_ms = 0;  // median of the steps that ran on this core alone
  int steps = 0;
};

// One step's own work, on the one core it ran on.
struct StepWork {
  int64_t step = 0;
  int cpu = 0;
  double compute_ms = 0;
};

// Per core, the median of the steps that ran on it, by core.
std::vector<CoreCompute> CoresOf(const std::vector<StepWork>& work);

struct RankCompute {
  int rank = 0;
  double compute_ms = 0;  // median over `steps` steps
  int steps = 0;
  double spread_ms = 0;   // median absolute deviation of those steps; 0: unknown
  std::string node;       // with `cores`: compared with its node's ranks on shared cores only
  std::vector<CoreCompute> cores;  // empty: it shares no cores with its node's ranks (or is on a GPU)
  // The steps of its figure that ran on one core (CoresOf gives `cores`): at a step where ranks of
  // one node ran on one core, they are compared on it.
  std::vector<StepWork> work;
};

struct Straggler {
  int rank = 0;
  double compute_ms = 0;
  // The median of the ranks it is compared with: their figures, or for ranks it shares cores with,
  // its own figure over its ratio to theirs on those cores.
  double others_median_ms = 0;
  bool on_shared_cores = false;  // some of the others were compared on the cores they shared with it
};

// The margin over the other ranks' median that a rank must exceed at `ratio`: `ratio`, or more where
// the ranks vary more from step to step than (ratio - 1) / kStragglerNoiseFactor.
double StragglerMargin(const std::vector<RankCompute>& ranks, double ratio);

// Each rank's figure against the median of the ranks it can be compared with, by rank; a rank
// with no one to be compared with (it and its node's other ranks each kept to cores, and shared
// fewer than two) has none. None at all
// unless every rank's figure covers `window` steps and there are at least two ranks: a figure of a
// few steps is start-up, not the rank.
std::vector<Straggler> RankStandings(const std::vector<RankCompute>& ranks, int window = kStragglerWindow);

// Whether a standing is above `margin` times the others' median and at least kStragglerMinExcessMs above it.
bool StandsAbove(const Straggler& standing, double margin);

// The stragglers among `ranks`, by rank: the standings above StragglerMargin(ranks, ratio).
std::vector<Straggler> FindStragglers(const std::vector<RankCompute>& ranks, double ratio = kStragglerRatio,
                                      int window = kStragglerWindow);

// Which ranks of one generation are named, from the figures of successive steps: a rank is above
// when each of its standings of its last kStragglerMemorySteps steps was, and is reported with the
// lowest of them. The coordinator calls Observe under its lock on every tick with the ranks' latest
// figures; a step it has already seen changes nothing, so ticks between reports confirm nothing, and
// a look at which a rank had no one to be compared with neither confirms nor clears it.
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
  struct Look {
    int64_t step = 0;
    Straggler standing;
    double name_margin = 0;  // StragglerMargin at kStragglerRatio then
    double keep_margin = 0;  // and at kStragglerKeepRatio
  };
  int64_t last_step_ = -1;
  std::map<int, std::vector<Look>> seen_;  // by rank, oldest first
  std::map<int, int64_t> above_since_;  // unnamed ranks above the naming margin: since which step
  std::map<int, int64_t> below_since_;  // named ranks below the keeping margin: since which step
  std::map<int, Straggler> named_;
};

}  // namespace ltrain::launcher
