#include "worker/plan/topology.h"

#include <algorithm>
#include <map>

namespace ltrain::worker {

StatusOr<Topology> MakeTopology(int world, int tp, int pp) {
  if (world < 1 || tp < 1 || pp < 1) {
    return InvalidArgument("world size " + std::to_string(world) + ", tp " + std::to_string(tp) + " and pp " +
                           std::to_string(pp) + " must all be >= 1");
  }
  if (world % (tp * pp) != 0) {
    return InvalidArgument("parallel.tp*parallel.pp=" + std::to_string(tp) + "*" + std::to_string(pp) +
                           " does not divide the world size " + std::to_string(world) +
                           "; change nodes*nproc_per_node or the tp/pp degrees");
  }
  return Topology{tp, world / (tp * pp), pp};
}

RankCoords CoordsOf(const Topology& t, int rank) {
  return RankCoords{rank % t.tp, (rank / t.tp) % t.dp, rank / (t.tp * t.dp)};
}

int RankAt(const Topology& t, const RankCoords& c) { return (c.pp * t.dp + c.dp) * t.tp + c.tp; }

int Group::RankOf(int global_rank) const {
  auto it = std::find(ranks.begin(), ranks.end(), global_rank);
  return it == ranks.end() ? -1 : static_cast<int>(it - ranks.begin());
}

namespace {

const char* KindName(GroupKind kind) {
  switch (kind) {
    case GroupKind::kTensor: return "tp";
    case GroupKind::kData: return "dp";
    case GroupKind::kPipeline: return "pp";
    case GroupKind::kEmbedding: return "embedding";
  }
  return "?";
}

}  // namespace

std::vector<Group> GroupsOf(const Topology& t, GroupKind kind) {
  // Key each rank by the coordinates that stay fixed within its group; the varying coordinate,
  // ascending, gives the group rank.
  std::map<int, std::vector<int>> by_key;
  for (int rank = 0; rank < t.world(); ++rank) {
    RankCoords c = CoordsOf(t, rank);
    switch (kind) {
      case GroupKind::kTensor: by_key[RankAt(t, {0, c.dp, c.pp})].push_back(rank); break;
      case GroupKind::kData: by_key[RankAt(t, {c.tp, 0, c.pp})].push_back(rank); break;
      case GroupKind::kPipeline: by_key[RankAt(t, {c.tp, c.dp, 0})].push_back(rank); break;
      case GroupKind::kEmbedding:
        if (t.pp > 1 && (c.pp == 0 || c.pp == t.pp - 1)) by_key[RankAt(t, {c.tp, c.dp, 0})].push_back(rank);
        break;
    }
  }
  std::vector<Group> groups;
  for (auto& [key, ranks] : by_key) {
    groups.push_back(Group{std::string(KindName(kind)) + " " + std::to_string(groups.size()), ranks});
  }
  return groups;
}

Group GroupOf(const Topology& t, GroupKind kind, int rank) {
  for (Group& g : GroupsOf(t, kind)) {
    if (g.RankOf(rank) >= 0) return g;
  }
  return Group{};
}

StatusOr<std::vector<int>> StageLayers(int layers, int stages, const std::vector<int>& split) {
  if (stages < 1) return InvalidArgument("pipeline needs at least one stage, got " + std::to_string(stages));
  if (!split.empty()) {
    int sum = 0;
    for (int n : split) {
      if (n < 1) return InvalidArgument("parallel.pp_split entries must be >= 1, got " + std::to_string(n));
      sum += n;
    }
    if (static_cast<int>(split.size()) != stages || sum != layers) {
      return InvalidArgument("parallel.pp_split needs " + std::to_string(stages) +
                             " entries (pp*virtual_stages) summing to model.layers=" + std::to_string(layers));
    }
    return split;
  }
  if (layers < stages) {
    return InvalidArgument("model.layers=" + std::to_string(layers) + " is fewer than the " +
                           std::to_string(stages) + " pipeline (virtual) stages; every stage needs a layer");
  }
  std::vector<int> out(stages, layers / stages);
  for (int i = 0; i < layers % stages; ++i) ++out[i];
  return out;
}

}  // namespace ltrain::worker
