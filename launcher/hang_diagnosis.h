// Hang detection and diagnosis over the ranks' progress reports: pure, tested with made-up reports.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "common/recipe.h"
#include "ltrain/v1/ltrain.pb.h"

namespace ltrain::launcher {

struct RankActivity {
  int rank = 0;
  int64_t step = 0;
  std::string phase;
  int64_t idle_ms = 0;          // since its progress last changed
  int64_t silent_ms = 0;        // since it last reported at all (a stopped process stops reporting)
  bool reported = false;        // false until the first report arrives
  // The collective it is in, when one is in flight.
  bool in_collective = false;
  uint64_t collective_seq = 0;
  std::string collective_op;
  std::string collective_group;
  // The last collective it completed, when it reported one: where a rank that never entered the
  // collective its peers wait in got to.
  uint64_t last_seq = 0;        // 0: none
  std::string last_op;
  std::string last_group;
  v1::WorkProgress work;        // the long work it reported (start-up, a checkpoint save, load or commit)
};

// What the run measured, from which the limits a recipe leaves unset are derived: the steps' times
// (every rank's reports; the slowest of the last kDerivedWindowSteps steps counts) and the
// checkpoint saves'. Pure: the coordinator feeds it the progress reports.
class RunTimes {
 public:
  // A completed step and its time (ms; 0: not measured, which counts the step only).
  void ObserveStep(int64_t step, double step_ms);
  void ObserveSave(double save_ms);
  // A new generation: its first steps compile and connect again, so they count as start-up.
  void Restart() { steps_.clear(); }
  int64_t steps_seen() const { return static_cast<int64_t>(steps_.size()); }
  double slowest_step_ms() const;
  double slowest_save_ms() const { return slowest_save_ms_; }

 private:
  std::map<int64_t, double> steps_;  // step -> its slowest time any rank reported; the last kDerivedWindowSteps
  double slowest_save_ms_ = 0;
};

// A checkpoint's derived limit is at least this many times the slowest save so far.
constexpr double kSaveLimitMultiple = 3;

// How long a rank may make no progress, by what it is doing: a training step (fault.hang_timeout_s),
// start-up (fault.startup_timeout_s: model build, connection, resume load) or a checkpoint
// (checkpoint.timeout_s). `*_how` says where each figure came from, for the message.
struct PhaseLimits {
  int64_t step_ms = 60000;
  int64_t startup_ms = 60000;
  int64_t checkpoint_ms = 60000;
  std::string step_how = "fault.hang_timeout_s";
  std::string startup_how = "fault.startup_timeout_s";
  std::string checkpoint_how = "checkpoint.timeout_s";

  // The recipe's limits; those it leaves at 0 (auto) are derived from `measured`: a training step's
  // as StepTimeout says (common/recipe.h), a checkpoint's at least kSaveLimitMultiple times the
  // slowest save. `*_how` says how each came about.
  static PhaseLimits Derive(const Recipe& recipe, const RunTimes& measured);
  static PhaseLimits FromRecipe(const Recipe& recipe) { return Derive(recipe, RunTimes{}); }
  // Every phase judged by one limit (fault.hang_timeout_s).
  static PhaseLimits Uniform(int64_t ms);
};

// Returns a description of the hang when some rank made no progress for its limit: the limit of
// its phase, or, while it waits for its peers (in a collective, or a commit collecting their word),
// the largest limit of any rank's phase, so that ranks waiting for a long save or start-up are not
// taken for hung. It names the rank(s) that are behind and what the others wait in, e.g.
//   "hang: rank 3 made no progress for 30s in step 812 (backward); ranks 0-2 wait in all_reduce #1234 of dp 0"
//   "stuck checkpoint save: rank 1 made no progress for 5s in step 20 (checkpoint: saving checkpoint
//    step-20, 12.0 of 24.0 MB; limit checkpoint.timeout_s=5); rank 0 waits for its peers (...)"
// Ranks that are waiting for a peer are not the culprits: the behind ranks are those that went
// silent (stopped reporting), else those not waiting, else those in the oldest collective.
std::optional<std::string> DiagnoseHang(const std::vector<RankActivity>& ranks, const PhaseLimits& limits);

// Every rank's last report in one picture, for the file a hang leaves: a block a rank with its step,
// phase, how long it made no progress and was silent, its long work, and its recent collectives (the
// workers' clocks, UTC), oldest first:
//   rank 2: step 57 (backward), no progress for 21.0 s, silent for 21.0 s
//     all_reduce #811 of world, 4.2 MB, 12:01:02.345 to 12:01:02.351 (6 ms)
//     all_reduce #812 of world, 4.2 MB, 12:01:02.360, not ended
// `reports` are the ranks' last reports, with idle_ms and silent_ms brought up to now; a rank never
// heard from is said so.
std::string DescribeRankCollectives(const std::vector<v1::RankProgress>& reports, int world_size);

// A rank silent this long while others report is taken to be stopped or wedged.
constexpr int64_t kSilentRankMs = 3000;

// "rank 3", "ranks 0-2", "ranks 0-1, 4"
std::string DescribeRanks(std::vector<int> ranks);

// "saving checkpoint step-20, 12.0 of 24.0 MB"; "" without work.
std::string DescribeWork(const v1::WorkProgress& work);

}  // namespace ltrain::launcher
