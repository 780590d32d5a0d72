// Flat layouts of parameters: which parameters share a gradient bucket (the unit that data
// parallelism all-reduces, or reduce-scatters, as soon as backward has produced all of its
// gradients), and how a unit's flat buffer splits into equal ZeRO shards. Pure functions.
#pragma once

#include <cstdint>
#include <vector>

namespace ltrain::worker {

// Groups parameter indices 0..n-1 into buckets. Backward produces gradients roughly from the last
// parameter to the first, so buckets are filled walking backwards: a bucket takes parameters until
// adding the next one would pass cap_bytes (a parameter larger than the cap gets a bucket of its own).
// Bucket 0 holds the last parameters; each bucket lists its indices in ascending order.
std::vector<std::vector<int>> PlanBuckets(const std::vector<int64_t>& numels, int64_t element_bytes, double cap_bytes);

struct UnitLayout {
  std::vector<int> params;        // parameter indices, ascending
  std::vector<int64_t> offsets;   // offset of each parameter in the unit's flat buffer
  int64_t numel = 0;              // sum of the parameters' sizes
  int64_t padded = 0;             // numel rounded up to a multiple of `shards`
  int64_t shard = 0;              // padded / shards: what each ZeRO rank owns
};

// Lays `params` (ascending) out back to back; padded so that `shards` ranks own equal slices.
UnitLayout LayoutUnit(const std::vector<int>& params, const std::vector<int64_t>& numels, int shards);

// [begin, end) of shard `rank` intersected with [lo, hi): empty (begin == end) when they miss.
struct Range {
  int64_t begin = 0;
  int64_t end = 0;
  int64_t size() const { return end - begin; }
};
Range Intersect(Range a, Range b);

}  // namespace ltrain::worker
