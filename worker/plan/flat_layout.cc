#include "worker/plan/flat_layout.h"

#include <algorithm>

namespace ltrain::worker {

std::vector<std::vector<int>> PlanBuckets(const std::vector<int64_t>& numels, int64_t element_bytes, double cap_bytes) {
  std::vector<std::vector<int>> buckets;
  std::vector<int> current;
  double bytes = 0;
  for (int i = static_cast<int>(numels.size()) - 1; i >= 0; --i) {
    const double size = static_cast<double>(numels[i]) * static_cast<double>(element_bytes);
    if (!current.empty() && bytes + size > cap_bytes) {
      std::reverse(current.begin(), current.end());
      buckets.push_back(std::move(current));
      current.clear();
      bytes = 0;
    }
    current.push_back(i);
    bytes += size;
  }
  if (!current.empty()) {
    std::reverse(current.begin(), current.end());
    buckets.push_back(std::move(current));
  }
  return buckets;
}

UnitLayout LayoutUnit(const std::vector<int>& params, const std::vector<int64_t>& numels, int shards) {
  UnitLayout u;
  u.params = params;
  for (int p : params) {
    u.offsets.push_back(u.numel);
    u.numel += numels[p];
  }
  const int64_t s = std::max(1, shards);
  u.shard = (u.numel + s - 1) / s;
  u.padded = u.shard * s;
  return u;
}

Range Intersect(Range a, Range b) {
  Range r{std::max(a.begin, b.begin), std::min(a.end, b.end)};
  if (r.end < r.begin) r.end = r.begin;
  return r;
}

}  // namespace ltrain::worker
