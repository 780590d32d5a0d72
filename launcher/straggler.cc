#include "launcher/straggler.h"

#include <algorithm>

namespace ltrain::launcher {

std::vector<Straggler> FindStragglers(const std::vector<RankCompute>& ranks, double ratio, int window) {
  std::vector<Straggler> out;
  const size_t n = ranks.size();
  if (n < 2) return out;
  for (const RankCompute& r : ranks) {
    if (r.steps < window || !(r.compute_ms > 0)) return out;
  }
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
    if (r.compute_ms > ratio * median && r.compute_ms - median >= kStragglerMinExcessMs) {
      out.push_back({r.rank, r.compute_ms, median});
    }
  }
  std::sort(out.begin(), out.end(), [](const Straggler& a, const Straggler& b) { return a.rank < b.rank; });
  return out;
}

}  // namespace ltrain::launcher
