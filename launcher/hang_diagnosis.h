// Hang detection and diagnosis over the ranks' progress reports: pure, tested with made-up reports.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

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
};

// Returns a description of the hang when some rank made no progress for `hang_timeout_ms`, naming
// the rank(s) that are behind and what the others wait in, e.g.
//   "rank 3 made no progress for 30s in step 812 (backward); ranks 0-2 wait in all_reduce #1234 of dp 0"
// Ranks that are waiting in a collective for a peer are not the culprits: the behind ranks are those
// that went silent (stopped reporting), else those outside any collective, else those in the oldest one.
std::optional<std::string> DiagnoseHang(const std::vector<RankActivity>& ranks, int64_t hang_timeout_ms);

// A rank silent this long while others report is taken to be stopped or wedged.
constexpr int64_t kSilentRankMs = 3000;

// "rank 3", "ranks 0-2", "ranks 0-1, 4"
std::string DescribeRanks(std::vector<int> ranks);

}  // namespace ltrain::launcher
