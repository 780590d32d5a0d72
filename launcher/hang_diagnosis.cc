#include "launcher/hang_diagnosis.h"

#include <algorithm>
#include <cstdio>
#include <map>

#include "common/logging.h"

namespace ltrain::launcher {
namespace {

enum class PhaseClass { kStep, kStartup, kCheckpoint };

PhaseClass ClassOf(const RankActivity& r) {
  if (!r.reported || r.phase == "startup") return PhaseClass::kStartup;
  if (r.phase == "checkpoint") return PhaseClass::kCheckpoint;
  return PhaseClass::kStep;
}

// The phase a rank is judged by, `training` when some rank reported a phase past start-up. A rank
// that reported and then fell silent is frozen whole (its reporting thread too), whatever its phase
// said: a stopped or wedged process, judged as a step. So is a rank never heard from while others
// train: training needs every rank, so it is past its start-up too.
PhaseClass JudgedClass(const RankActivity& r, bool training) {
  if (r.reported && r.silent_ms >= kSilentRankMs) return PhaseClass::kStep;
  if (!r.reported && training) return PhaseClass::kStep;
  return ClassOf(r);
}

int64_t OwnLimit(const RankActivity& r, const PhaseLimits& limits, bool training) {
  switch (JudgedClass(r, training)) {
    case PhaseClass::kStartup:
      return limits.startup_ms;
    case PhaseClass::kCheckpoint:
      return limits.checkpoint_ms;
    case PhaseClass::kStep:
      break;
  }
  return limits.step_ms;
}

bool Waiting(const RankActivity& r) { return r.in_collective || r.work.waits_for_peers(); }

// "12.0 of 24.0 MB", "3 of 8 ranks", "5 parameter tensors": bytes in the scale of the larger figure.
std::string Amounts(int64_t done, int64_t total, const std::string& unit) {
  std::string scale_unit = unit;
  double scale = 1;
  if (unit == "bytes") {
    scale = std::max(done, total) >= 1'000'000'000 ? 1e9 : 1e6;
    scale_unit = scale == 1e9 ? "GB" : "MB";
  }
  char text[96];
  if (unit == "bytes" && total > 0) {
    std::snprintf(text, sizeof(text), "%.1f of %.1f", done / scale, total / scale);
  } else if (unit == "bytes") {
    std::snprintf(text, sizeof(text), "%.1f", done / scale);
  } else if (total > 0) {
    std::snprintf(text, sizeof(text), "%lld of %lld", static_cast<long long>(done), static_cast<long long>(total));
  } else {
    std::snprintf(text, sizeof(text), "%lld", static_cast<long long>(done));
  }
  return scale_unit.empty() ? text : std::string(text) + " " + scale_unit;
}

}  // namespace

void RunTimes::ObserveStep(int64_t step, double step_ms) {
  if (step <= 0) return;
  if (!steps_.empty() && step < steps_.begin()->first && steps_.size() >= kDerivedWindowSteps) return;
  double& slowest = steps_[step];
  slowest = std::max(slowest, step_ms);
  while (steps_.size() > kDerivedWindowSteps) steps_.erase(steps_.begin());
}

void RunTimes::ObserveSave(double save_ms) { slowest_save_ms_ = std::max(slowest_save_ms_, save_ms); }

double RunTimes::slowest_step_ms() const {
  double slowest = 0;
  for (const auto& [step, ms] : steps_) slowest = std::max(slowest, ms);
  return slowest;
}

PhaseLimits PhaseLimits::Derive(const Recipe& recipe, const RunTimes& measured) {
  PhaseLimits limits;
  char text[224];
  const PhaseTimeout startup = StartupTimeout(recipe), checkpoint = CheckpointTimeout(recipe);
  limits.startup_ms = static_cast<int64_t>(startup.seconds * 1000);
  limits.startup_how = startup.how;
  const PhaseTimeout step = StepTimeout(recipe, measured.steps_seen(), measured.slowest_step_ms());
  limits.step_ms = static_cast<int64_t>(step.seconds * 1000);
  limits.step_how = step.how;
  limits.checkpoint_ms = static_cast<int64_t>(checkpoint.seconds * 1000);
  limits.checkpoint_how = checkpoint.how;
  const int64_t by_saves = static_cast<int64_t>(kSaveLimitMultiple * measured.slowest_save_ms());
  if (recipe.checkpoint.timeout_s <= 0 && by_saves > limits.checkpoint_ms) {
    std::snprintf(text, sizeof(text), "checkpoint.timeout_s auto: %.0f s, %g x the slowest save so far (%.1f s)",
                  by_saves / 1000.0, kSaveLimitMultiple, measured.slowest_save_ms() / 1000.0);
    limits.checkpoint_ms = by_saves;
    limits.checkpoint_how = text;
  }
  return limits;
}

PhaseLimits PhaseLimits::Uniform(int64_t ms) {
  PhaseLimits limits;
  limits.step_ms = limits.startup_ms = limits.checkpoint_ms = ms;
  char text[64];
  std::snprintf(text, sizeof(text), "fault.hang_timeout_s=%g", ms / 1000.0);
  limits.step_how = text;
  return limits;
}

std::string DescribeRanks(std::vector<int> ranks) {
  std::sort(ranks.begin(), ranks.end());
  std::string out;
  size_t i = 0;
  while (i < ranks.size()) {
    size_t j = i;
    while (j + 1 < ranks.size() && ranks[j + 1] == ranks[j] + 1) ++j;
    if (!out.empty()) out += ", ";
    out += std::to_string(ranks[i]);
    if (j > i) out += "-" + std::to_string(ranks[j]);
    i = j + 1;
  }
  return (ranks.size() == 1 ? "rank " : "ranks ") + out;
}

std::string DescribeWork(const v1::WorkProgress& work) {
  if (work.what().empty()) return "";
  return work.what() + ", " + Amounts(work.done(), work.total(), work.unit());
}

std::string DescribeRankCollectives(const std::vector<v1::RankProgress>& reports, int world_size) {
  std::map<int, const v1::RankProgress*> by_rank;
  for (const auto& report : reports) by_rank[report.rank()] = &report;
  auto clock = [](int64_t unix_ms) { return UtcTime(unix_ms, "%H:%M:%S", /*with_ms=*/true); };
  std::string out;
  char line[512];
  for (int rank = 0; rank < world_size; ++rank) {
    auto found = by_rank.find(rank);
    if (found == by_rank.end()) {
      out += "rank " + std::to_string(rank) + ": never reported\n";
      continue;
    }
    const v1::RankProgress& r = *found->second;
    std::snprintf(line, sizeof(line), "rank %d: step %lld (%s), no progress for %.1f s, silent for %.1f s", rank,
                  static_cast<long long>(r.step()), r.phase().empty() ? "-" : r.phase().c_str(), r.idle_ms() / 1000.0,
                  r.silent_ms() / 1000.0);
    out += line;
    if (const std::string work = DescribeWork(r.work()); !work.empty()) out += "; " + work;
    out += "\n";
    if (r.collectives_size() == 0) out += "  no collectives reported\n";
    for (const auto& c : r.collectives()) {
      std::snprintf(line, sizeof(line), "  %s #%llu of %s, %.1f MB, %s", c.op().c_str(),
                    static_cast<unsigned long long>(c.seq()), c.group().c_str(), c.bytes() / 1e6,
                    clock(c.start_unix_ms()).c_str());
      out += line;
      if (c.end_unix_ms() != 0) {
        std::snprintf(line, sizeof(line), " to %s (%lld ms)\n", clock(c.end_unix_ms()).c_str(),
                      static_cast<long long>(c.end_unix_ms() - c.start_unix_ms()));
        out += line;
      } else {
        out += ", not ended\n";
      }
    }
  }
  return out;
}

std::optional<std::string> DiagnoseHang(const std::vector<RankActivity>& ranks, const PhaseLimits& limits) {
  if (ranks.empty()) return std::nullopt;
  const bool training = std::any_of(ranks.begin(), ranks.end(), [](const RankActivity& r) {
    return r.reported && r.phase != "startup";
  });
  // A rank that waits for its peers may wait as long as the slowest phase any of them is in.
  int64_t longest = 0;
  for (const auto& r : ranks) longest = std::max(longest, OwnLimit(r, limits, training));
  auto limit_of = [&](const RankActivity& r) { return Waiting(r) ? longest : OwnLimit(r, limits, training); };
  // Nor is a waiting rank stuck while a rank it may wait for still makes progress: its idle time
  // counts from the latest progress of any rank that is not waiting. Else a rank would be blamed
  // for a wait that began before its own last progress.
  std::optional<int64_t> working_idle;
  for (const auto& r : ranks) {
    if (!Waiting(r)) working_idle = std::min(working_idle.value_or(r.idle_ms), r.idle_ms);
  }
  auto idle_of = [&](const RankActivity& r) {
    return Waiting(r) && working_idle ? std::min(r.idle_ms, *working_idle) : r.idle_ms;
  };
  bool hung = std::any_of(ranks.begin(), ranks.end(), [&](const RankActivity& r) { return idle_of(r) >= limit_of(r); });
  if (!hung) return std::nullopt;

  // The behind ranks: silent ones, else those not waiting for peers, else those in the collective
  // with the lowest sequence, else those over their limit. A rule that picks every rank says
  // nothing, so the next one is tried.
  auto pick = [&](auto&& is_behind) {
    std::vector<const RankActivity*> picked;
    for (const auto& r : ranks) {
      if (is_behind(r)) picked.push_back(&r);
    }
    if (picked.size() == ranks.size()) picked.clear();
    return picked;
  };
  std::vector<const RankActivity*> behind = pick([](const RankActivity& r) { return r.silent_ms >= kSilentRankMs; });
  if (behind.empty()) behind = pick([](const RankActivity& r) { return !Waiting(r); });
  if (behind.empty()) {
    uint64_t oldest = UINT64_MAX;
    for (const auto& r : ranks) {
      if (r.in_collective) oldest = std::min(oldest, r.collective_seq);
    }
    behind = pick([&](const RankActivity& r) { return r.in_collective && r.collective_seq == oldest; });
  }
  // Ranks with no collectives in their reports (programs of the user's own): those over their limit
  // while others move.
  if (behind.empty()) behind = pick([&](const RankActivity& r) { return idle_of(r) >= limit_of(r); });
  // What kind of stall, from the phase of the first rank behind (of any rank when none is).
  const RankActivity& lead = behind.empty() ? ranks.front() : *behind.front();
  std::string kind = "hang";
  std::string limit_how = limits.step_how;
  if (JudgedClass(lead, training) == PhaseClass::kStartup) {
    kind = "stuck start-up";
    limit_how = limits.startup_how;
  } else if (JudgedClass(lead, training) == PhaseClass::kCheckpoint) {
    kind = "stuck checkpoint save";
    limit_how = limits.checkpoint_how;
  }
  // The phase in parentheses, with the long work the rank was in and its limit when it is not a
  // training step's.
  auto phase_text = [&](const RankActivity& r, const std::string& phase) {
    std::string text = phase;
    const std::string work = DescribeWork(r.work);
    if (!work.empty()) text += ": " + work;
    if (JudgedClass(r, training) != PhaseClass::kStep) text += "; limit " + limit_how;
    return text;
  };
  if (behind.empty()) {
    int64_t idle = 0;
    for (const auto& rank : ranks) idle = std::max(idle, rank.idle_ms);
    std::string where = lead.in_collective ? lead.collective_op + " #" + std::to_string(lead.collective_seq) + " of " +
                                                 lead.collective_group + ", "
                                           : "";
    return kind + ": all ranks made no progress for " + std::to_string(idle / 1000) + "s (" + where + "step " +
           std::to_string(lead.step) + ", " + phase_text(lead, lead.reported ? lead.phase : "startup") + ")" +
           (JudgedClass(lead, training) == PhaseClass::kStep ? "; limit " + limits.step_how : "");
  }
  // Where a behind rank that waits in no collective got to: its last completed one.
  std::string last_text;
  if (behind.size() == 1) {
    const RankActivity& r = *behind.front();
    if (r.in_collective) {
      last_text = "; it is in " + r.collective_op + " #" + std::to_string(r.collective_seq) + " of " + r.collective_group;
    } else if (r.last_seq > 0) {
      last_text = "; its last collective was " + r.last_op + " #" + std::to_string(r.last_seq) + " of " + r.last_group;
    }
  }
  std::vector<int> behind_ranks;
  int64_t idle = 0;
  for (const auto* r : behind) {
    behind_ranks.push_back(r->rank);
    idle = std::max(idle, r->idle_ms);
  }
  std::string message = kind + ": " + DescribeRanks(behind_ranks) + " made no progress for " +
                        std::to_string(idle / 1000) + "s in step " + std::to_string(lead.step) + " (" +
                        phase_text(lead, lead.reported ? lead.phase : "startup, never reported") + ")" + last_text;
  // What the others wait in, grouped by collective.
  std::map<std::tuple<uint64_t, std::string, std::string>, std::vector<int>> waiting;
  std::map<std::string, std::vector<int>> waiting_for_peers;
  std::vector<int> elsewhere;
  for (const auto& r : ranks) {
    if (std::find(behind.begin(), behind.end(), &r) != behind.end()) continue;
    if (r.in_collective) {
      waiting[{r.collective_seq, r.collective_op, r.collective_group}].push_back(r.rank);
    } else if (r.work.waits_for_peers()) {
      waiting_for_peers[DescribeWork(r.work)].push_back(r.rank);
    } else {
      elsewhere.push_back(r.rank);
    }
  }
  for (const auto& [key, waiters] : waiting) {
    const auto& [seq, op, group] = key;
    message += "; " + DescribeRanks(waiters) + (waiters.size() == 1 ? " waits in " : " wait in ") + op + " #" +
               std::to_string(seq) + " of " + group;
  }
  for (const auto& [work, waiters] : waiting_for_peers) {
    message += "; " + DescribeRanks(waiters) + (waiters.size() == 1 ? " waits for its peers (" : " wait for their peers (") + work + ")";
  }
  if (!elsewhere.empty()) {
    message += "; " + DescribeRanks(elsewhere) + (elsewhere.size() == 1 ? " is" : " are") + " outside collectives";
  }
  if (JudgedClass(lead, training) == PhaseClass::kStep) message += "; limit " + limits.step_how;
  return message;
}

}  // namespace ltrain::launcher
