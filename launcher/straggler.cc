#include "launcher/straggler.h"

#include <algorithm>
#include <optional>

namespace ltrain::launcher {
namespace {

double Median(std::vector<double> values) {
  if (values.empty()) return 0;
  const size_t mid = values.size() / 2;
  std::nth_element(values.begin(), values.begin() + static_cast<std::ptrdiff_t>(mid), values.end());
  if (values.size() % 2 == 1) return values[mid];
  const double upper = values[mid];
  return (*std::max_element(values.begin(), values.begin() + static_cast<std::ptrdiff_t>(mid)) + upper) / 2.0;
}

// How many times `other`'s work `r`'s is on the cores both ran on: the least of its ratios on each
// such core, and never above the ratio of their whole figures. None unless they shared two cores or
// more: on one core alone (at different times) a rank cannot be told from the core's speed then; a
// straggler is slower wherever it runs.
std::optional<double> SharedCoreRatio(const RankCompute& r, const RankCompute& other) {
  double least = r.compute_ms / other.compute_ms;
  int shared = 0;
  for (const CoreCompute& mine : r.cores) {
    if (mine.steps < kStragglerCoreSteps || !(mine.compute_ms > 0)) continue;
    for (const CoreCompute& theirs : other.cores) {
      if (theirs.cpu != mine.cpu || theirs.steps < kStragglerCoreSteps || !(theirs.compute_ms > 0)) continue;
      least = std::min(least, mine.compute_ms / theirs.compute_ms);
      ++shared;
    }
  }
  if (shared < 2) return std::nullopt;
  return least;
}

// How many times its node's ranks' work `r`'s is at the steps it ran on one core with some of them:
// at each such step its work over theirs (their median), the median of those ratios; none unless
// there were kStragglerCoreSteps such steps. Ranks that take turns on one core within one step wait
// for it alike and run at its speed then: the fairest comparison there is.
// `node_ranks`: the ranks of r's node that reported their steps' work.
std::optional<double> CoTenantRatio(const RankCompute& r, const std::vector<const RankCompute*>& node_ranks) {
  std::vector<double> ratios;
  for (const StepWork& mine : r.work) {
    if (!(mine.compute_ms > 0)) continue;
    std::vector<double> theirs;
    for (const RankCompute* other : node_ranks) {
      if (other == &r) continue;
      for (const StepWork& w : other->work) {
        if (w.step == mine.step && w.cpu == mine.cpu && w.compute_ms > 0) theirs.push_back(w.compute_ms);
      }
    }
    if (!theirs.empty()) ratios.push_back(mine.compute_ms / Median(std::move(theirs)));
  }
  if (static_cast<int>(ratios.size()) < kStragglerCoreSteps) return std::nullopt;
  return Median(std::move(ratios));
}

bool ComparedOnCores(const RankCompute& a, const RankCompute& b) {
  return a.node == b.node && !a.cores.empty() && !b.cores.empty();
}

// Whether a rank kept to a core for kStragglerCoreSteps steps of its window: one that did not moved
// between cores within its steps, and its figure is of all of them.
bool KeptToACore(const RankCompute& r) {
  return std::any_of(r.cores.begin(), r.cores.end(),
                     [](const CoreCompute& c) { return c.steps >= kStragglerCoreSteps; });
}

}  // namespace

std::vector<CoreCompute> CoresOf(const std::vector<StepWork>& work) {
  std::map<int, std::vector<double>> by_core;
  for (const StepWork& w : work) by_core[w.cpu].push_back(w.compute_ms);
  std::vector<CoreCompute> out;
  for (auto& [cpu, steps] : by_core) {
    const int n = static_cast<int>(steps.size());
    out.push_back({cpu, Median(std::move(steps)), n});
  }
  return out;
}

double StragglerMargin(const std::vector<RankCompute>& ranks, double ratio) {
  std::vector<double> relative;
  for (const RankCompute& r : ranks) {
    if (r.compute_ms > 0) relative.push_back(r.spread_ms / r.compute_ms);
  }
  return std::max(ratio, 1.0 + kStragglerNoiseFactor * Median(std::move(relative)));
}

std::vector<Straggler> RankStandings(const std::vector<RankCompute>& ranks, int window) {
  std::vector<Straggler> out;
  const size_t n = ranks.size();
  if (n < 2) return out;
  bool any_cores = false;
  for (const RankCompute& r : ranks) {
    if (r.steps < window || !(r.compute_ms > 0)) return out;
    any_cores = any_cores || !r.cores.empty();
  }
  if (!any_cores) {
    // Every rank against every other on whole figures: in order of the figure, the others' median
    // of the rank at sorted position p is the median of the sorted figures without position p.
    std::vector<size_t> order(n);
    for (size_t i = 0; i < n; ++i) order[i] = i;
    std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return ranks[a].compute_ms < ranks[b].compute_ms; });
    auto without = [&](size_t p, size_t k) { return ranks[order[k < p ? k : k + 1]].compute_ms; };
    const size_t m = n - 1;
    for (size_t p = 0; p < n; ++p) {
      const double median = m % 2 == 1 ? without(p, m / 2) : (without(p, m / 2 - 1) + without(p, m / 2)) / 2.0;
      const RankCompute& r = ranks[order[p]];
      out.push_back({r.rank, r.compute_ms, median, false});
    }
  } else {
    // Ranks that share cores are few (CPU ranks on small nodes): each pair is looked at; steps on one
    // core at once only among a node's ranks.
    std::map<std::string, std::vector<const RankCompute*>> work_by_node;
    for (const RankCompute& r : ranks) {
      if (!r.work.empty()) work_by_node[r.node].push_back(&r);
    }
    for (const RankCompute& r : ranks) {
      std::vector<double> others;
      bool on_cores = false;
      const std::optional<double> co_tenants =
          r.work.empty() ? std::nullopt : CoTenantRatio(r, work_by_node[r.node]);
      for (const RankCompute& other : ranks) {
        if (&other == &r) continue;
        if (!ComparedOnCores(r, other)) {
          others.push_back(other.compute_ms);
          continue;
        }
        if (co_tenants) {
          others.push_back(r.compute_ms / *co_tenants);
          on_cores = true;
        } else if (std::optional<double> ratio = SharedCoreRatio(r, other)) {
          others.push_back(r.compute_ms / *ratio);
          on_cores = true;
        } else if (!KeptToACore(r) || !KeptToACore(other)) {
          others.push_back(other.compute_ms);
        }
      }
      if (!others.empty()) out.push_back({r.rank, r.compute_ms, Median(std::move(others)), on_cores});
    }
  }
  std::sort(out.begin(), out.end(), [](const Straggler& a, const Straggler& b) { return a.rank < b.rank; });
  return out;
}

bool StandsAbove(const Straggler& standing, double margin) {
  return standing.compute_ms > margin * standing.others_median_ms &&
         standing.compute_ms - standing.others_median_ms >= kStragglerMinExcessMs;
}

std::vector<Straggler> FindStragglers(const std::vector<RankCompute>& ranks, double ratio, int window) {
  const double margin = StragglerMargin(ranks, ratio);
  std::vector<Straggler> out;
  for (const Straggler& s : RankStandings(ranks, window)) {
    if (StandsAbove(s, margin)) out.push_back(s);
  }
  return out;
}

std::vector<StragglerTracker::Change> StragglerTracker::Observe(int64_t step, const std::vector<RankCompute>& ranks) {
  std::vector<Change> changes;
  if (step <= last_step_) return changes;
  last_step_ = step;
  const double name_margin = StragglerMargin(ranks, kStragglerRatio);
  const double keep_margin = StragglerMargin(ranks, kStragglerKeepRatio);
  std::map<int, Straggler> fresh;
  for (const Straggler& s : RankStandings(ranks)) fresh[s.rank] = s;

  for (const RankCompute& r : ranks) {
    std::vector<Look>& seen = seen_[r.rank];
    auto now = fresh.find(r.rank);
    if (now != fresh.end()) seen.push_back({step, now->second, name_margin, keep_margin});
    seen.erase(seen.begin(), std::find_if(seen.begin(), seen.end(), [&](const Look& look) {
                 return look.step > step - kStragglerMemorySteps;
               }));
    auto all_above = [&](bool keep) {
      return !seen.empty() && std::all_of(seen.begin(), seen.end(), [&](const Look& look) {
               return StandsAbove(look.standing, keep ? look.keep_margin : look.name_margin);
             });
    };
    Straggler lowest;  // the look at which it stood lowest
    if (!seen.empty()) {
      lowest = std::min_element(seen.begin(), seen.end(), [](const Look& a, const Look& b) {
                 return a.standing.compute_ms / a.standing.others_median_ms <
                        b.standing.compute_ms / b.standing.others_median_ms;
               })->standing;
    }
    const bool looked = now != fresh.end();
    if (!named_.count(r.rank)) {
      if (!all_above(false)) {
        above_since_.erase(r.rank);
      } else if (looked) {
        const int64_t since = above_since_.emplace(r.rank, step).first->second;
        if (step - since >= kStragglerConfirmSteps) {
          named_[r.rank] = lowest;
          above_since_.erase(r.rank);
          changes.push_back({lowest, true});
        }
      }
      continue;
    }
    if (all_above(true)) {
      named_[r.rank] = lowest;
      below_since_.erase(r.rank);
    } else if (looked || seen.empty()) {
      const int64_t since = below_since_.emplace(r.rank, step).first->second;
      if (step - since >= kStragglerConfirmSteps) {
        changes.push_back({named_[r.rank], false});
        below_since_.erase(r.rank);
        named_.erase(r.rank);
      }
    }
  }
  std::sort(changes.begin(), changes.end(),
            [](const Change& a, const Change& b) { return a.straggler.rank < b.straggler.rank; });
  return changes;
}

}  // namespace ltrain::launcher
