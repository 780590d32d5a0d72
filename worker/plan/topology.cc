#include "worker/plan/topology.h"

#include <algorithm>
#include <map>

namespace ltrain::worker {

RankCoords CoordsOf(const Layout& t, int rank) {
  return RankCoords{rank % t.tp, (rank / t.tp) % t.dp, rank / (t.tp * t.dp)};
}

int RankAt(const Layout& t, const RankCoords& c) { return (c.pp * t.dp + c.dp) * t.tp + c.tp; }

int ExpertRank(const Layout& t, const RankCoords& c) { return c.dp % std::max(1, t.ep); }
int ExpertDataRank(const Layout& t, const RankCoords& c) { return c.dp / std::max(1, t.ep); }
int ContextRank(const Layout& t, const RankCoords& c) { return c.dp % std::max(1, t.cp); }
int BatchReplica(const Layout& t, const RankCoords& c) { return c.dp / std::max(1, t.cp); }

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
    case GroupKind::kExpert: return "ep";
    case GroupKind::kExpertData: return "edp";
    case GroupKind::kContext: return "cp";
  }
  return "?";
}

}  // namespace

std::vector<Group> GroupsOf(const Layout& t, GroupKind kind) {
  // Key each rank by the coordinates that stay fixed within its group; the varying coordinate,
  // ascending, gives the group rank.
  std::map<int, std::vector<int>> by_key;
  for (int rank = 0; rank < t.world_size; ++rank) {
    RankCoords c = CoordsOf(t, rank);
    switch (kind) {
      case GroupKind::kTensor: by_key[RankAt(t, {0, c.dp, c.pp})].push_back(rank); break;
      case GroupKind::kData: by_key[RankAt(t, {c.tp, 0, c.pp})].push_back(rank); break;
      case GroupKind::kPipeline: by_key[RankAt(t, {c.tp, c.dp, 0})].push_back(rank); break;
      case GroupKind::kEmbedding:
        if (t.pp > 1 && (c.pp == 0 || c.pp == t.pp - 1)) by_key[RankAt(t, {c.tp, c.dp, 0})].push_back(rank);
        break;
      case GroupKind::kExpert: by_key[RankAt(t, {c.tp, ExpertDataRank(t, c) * t.ep, c.pp})].push_back(rank); break;
      case GroupKind::kExpertData: by_key[RankAt(t, {c.tp, ExpertRank(t, c), c.pp})].push_back(rank); break;
      case GroupKind::kContext: by_key[RankAt(t, {c.tp, BatchReplica(t, c) * t.cp, c.pp})].push_back(rank); break;
    }
  }
  std::vector<Group> groups;
  for (auto& [key, ranks] : by_key) {
    groups.push_back(Group{std::string(KindName(kind)) + " " + std::to_string(groups.size()), ranks});
  }
  return groups;
}

Group GroupOf(const Layout& t, GroupKind kind, int rank) {
  for (Group& g : GroupsOf(t, kind)) {
    if (g.RankOf(rank) >= 0) return g;
  }
  return Group{};
}

}  // namespace ltrain::worker
