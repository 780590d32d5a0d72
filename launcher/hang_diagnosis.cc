#include "launcher/hang_diagnosis.h"

#include <algorithm>
#include <map>

namespace ltrain::launcher {

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

std::optional<std::string> DiagnoseHang(const std::vector<RankActivity>& ranks, int64_t hang_timeout_ms) {
  bool hung = std::any_of(ranks.begin(), ranks.end(),
                          [&](const RankActivity& r) { return r.idle_ms >= hang_timeout_ms; });
  if (!hung || ranks.empty()) return std::nullopt;

  // The behind ranks: silent ones, else those outside any collective, else those in the collective
  // with the lowest sequence. A rule that picks every rank says nothing, so the next one is tried.
  auto pick = [&](auto&& is_behind) {
    std::vector<const RankActivity*> picked;
    for (const auto& r : ranks) {
      if (is_behind(r)) picked.push_back(&r);
    }
    if (picked.size() == ranks.size()) picked.clear();
    return picked;
  };
  std::vector<const RankActivity*> behind = pick([](const RankActivity& r) { return r.silent_ms >= kSilentRankMs; });
  if (behind.empty()) behind = pick([](const RankActivity& r) { return !r.in_collective; });
  if (behind.empty()) {
    uint64_t oldest = UINT64_MAX;
    for (const auto& r : ranks) {
      if (r.in_collective) oldest = std::min(oldest, r.collective_seq);
    }
    behind = pick([&](const RankActivity& r) { return r.in_collective && r.collective_seq == oldest; });
  }
  if (behind.empty()) {
    const RankActivity& r = ranks.front();
    int64_t idle = 0;
    for (const auto& rank : ranks) idle = std::max(idle, rank.idle_ms);
    std::string where = r.in_collective ? r.collective_op + " #" + std::to_string(r.collective_seq) + " of " +
                                              r.collective_group + ", "
                                        : "";
    return "all ranks made no progress for " + std::to_string(idle / 1000) + "s (" + where + "step " +
           std::to_string(r.step) + ", " + (r.reported ? r.phase : "startup") + ")";
  }
  std::vector<int> behind_ranks;
  int64_t idle = 0;
  for (const auto* r : behind) {
    behind_ranks.push_back(r->rank);
    idle = std::max(idle, r->idle_ms);
  }
  const RankActivity& first = *behind.front();
  std::string message = DescribeRanks(behind_ranks) + " made no progress for " + std::to_string(idle / 1000) +
                        "s in step " + std::to_string(first.step) + " (" +
                        (first.reported ? first.phase : "startup, never reported") + ")";
  // What the others wait in, grouped by collective.
  std::map<std::tuple<uint64_t, std::string, std::string>, std::vector<int>> waiting;
  std::vector<int> elsewhere;
  for (const auto& r : ranks) {
    if (std::find(behind.begin(), behind.end(), &r) != behind.end()) continue;
    if (r.in_collective) {
      waiting[{r.collective_seq, r.collective_op, r.collective_group}].push_back(r.rank);
    } else {
      elsewhere.push_back(r.rank);
    }
  }
  for (const auto& [key, waiters] : waiting) {
    const auto& [seq, op, group] = key;
    message += "; " + DescribeRanks(waiters) + (waiters.size() == 1 ? " waits in " : " wait in ") + op + " #" +
               std::to_string(seq) + " of " + group;
  }
  if (!elsewhere.empty()) {
    message += "; " + DescribeRanks(elsewhere) + (elsewhere.size() == 1 ? " is" : " are") + " outside collectives";
  }
  return message;
}

}  // namespace ltrain::launcher
