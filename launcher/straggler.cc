#include "launcher/straggler.h"

#include <algorithm>

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

}  // namespace

double StragglerMargin(const std::vector<RankCompute>& ranks, double ratio) {
  std::vector<double> relative;
  for (const RankCompute& r : ranks) {
    if (r.compute_ms > 0) relative.push_back(r.spread_ms / r.compute_ms);
  }
  return std::max(ratio, 1.0 + kStragglerNoiseFactor * Median(std::move(relative)));
}

std::vector<Straggler> FindStragglers(const std::vector<RankCompute>& ranks, double ratio, int window) {
  std::vector<Straggler> out;
  const size_t n = ranks.size();
  if (n < 2) return out;
  for (const RankCompute& r : ranks) {
    if (r.steps < window || !(r.compute_ms > 0)) return out;
  }
  const double margin = StragglerMargin(ranks, ratio);
  // Ranks in order of their figure; the others' median of the rank at sorted position p is the
  // median of the sorted figures without position p (with two ranks: the other one).
  std::vector<size_t> order(n);
  for (size_t i = 0; i < n; ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return ranks[a].compute_ms < ranks[b].compute_ms; });
  auto without = [&](size_t p, size_t k) { return ranks[order[k < p ? k : k + 1]].compute_ms; };
  const size_t m = n - 1;
  for (size_t p = 0; p < n; ++p) {
    const double median = m % 2 == 1 ? without(p, m / 2) : (without(p, m / 2 - 1) + without(p, m / 2)) / 2.0;
    const RankCompute& r = ranks[order[p]];
    if (r.compute_ms > margin * median && r.compute_ms - median >= kStragglerMinExcessMs) {
      out.push_back({r.rank, r.compute_ms, median});
    }
  }
  std::sort(out.begin(), out.end(), [](const Straggler& a, const Straggler& b) { return a.rank < b.rank; });
  return out;
}

std::vector<StragglerTracker::Change> StragglerTracker::Observe(int64_t step, const std::vector<RankCompute>& ranks) {
  std::vector<Change> changes;
  if (step <= last_step_) return changes;
  last_step_ = step;
  std::vector<RankCompute> best;  // each rank's best figure of its last kStragglerMemorySteps steps
  for (const RankCompute& r : ranks) {
    std::vector<std::pair<int64_t, RankCompute>>& seen = seen_[r.rank];
    if (r.steps >= kStragglerWindow && r.compute_ms > 0) seen.emplace_back(step, r);
    seen.erase(seen.begin(), std::find_if(seen.begin(), seen.end(), [&](const auto& s) {
                 return s.first > step - kStragglerMemorySteps;
               }));
    if (seen.empty()) {
      best.push_back(r);  // no full window yet: FindStragglers names no one
      continue;
    }
    best.push_back(std::min_element(seen.begin(), seen.end(), [](const auto& a, const auto& b) {
                     return a.second.compute_ms < b.second.compute_ms;
                   })->second);
  }
  std::map<int, Straggler> above;  // above the naming margin
  for (const Straggler& s : FindStragglers(best, kStragglerRatio)) above[s.rank] = s;
  std::map<int, Straggler> kept;  // above the keeping margin
  for (const Straggler& s : FindStragglers(best, kStragglerKeepRatio)) kept[s.rank] = s;

  for (auto it = above_since_.begin(); it != above_since_.end();) {
    it = above.count(it->first) ? std::next(it) : above_since_.erase(it);
  }
  for (const auto& [rank, s] : above) {
    if (named_.count(rank)) continue;
    const int64_t since = above_since_.emplace(rank, step).first->second;
    if (step - since >= kStragglerConfirmSteps) {
      named_[rank] = s;
      above_since_.erase(rank);
      changes.push_back({s, true});
    }
  }
  for (auto it = named_.begin(); it != named_.end();) {
    const int rank = it->first;
    if (kept.count(rank)) {
      it->second = kept[rank];
      below_since_.erase(rank);
      ++it;
      continue;
    }
    const int64_t since = below_since_.emplace(rank, step).first->second;
    if (step - since >= kStragglerConfirmSteps) {
      changes.push_back({it->second, false});
      below_since_.erase(rank);
      it = named_.erase(it);
    } else {
      ++it;
    }
  }
  std::sort(changes.begin(), changes.end(),
            [](const Change& a, const Change& b) { return a.straggler.rank < b.straggler.rank; });
  return changes;
}

}  // namespace ltrain::launcher
