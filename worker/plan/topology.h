// Topology: how the ranks of a layout (common/layout.h) split into tensor-, data- and
// pipeline-parallel groups. Pure functions over plain structs (no LibTorch, no I/O).
#pragma once

#include <string>
#include <vector>

#include "common/layout.h"
#include "common/pipeline_schedule.h"  // VirtualStage

namespace ltrain::worker {

struct RankCoords {
  int tp = 0;
  int dp = 0;
  int pp = 0;
  bool operator==(const RankCoords&) const = default;
};

RankCoords CoordsOf(const Layout& layout, int rank);
int RankAt(const Layout& layout, const RankCoords& coords);

enum class GroupKind {
  kTensor,     // same dp and pp coordinates: the tp ranks of one stage replica
  kData,       // same tp and pp: the replicas that all-reduce (or shard) gradients
  kPipeline,   // same tp and dp: the stages that pass activations
  kEmbedding,  // first and last pipeline stage of one pipeline (tied embedding/head); pp > 1 only
  kExpert,     // same tp, pp and dp / ep: the ep ranks that split a block's experts and exchange tokens
  kExpertData, // same tp, pp and dp % ep: the ranks holding the same experts, that reduce their gradients
  kContext,    // same tp, pp and dp / cp: the cp ranks that split each sequence and pass keys and values
};

// This rank's place among the expert-parallel ranks (dp % ep) and among those holding the same
// experts (dp / ep); layout.ep divides layout.dp.
int ExpertRank(const Layout& layout, const RankCoords& coords);
int ExpertDataRank(const Layout& layout, const RankCoords& coords);
// This rank's place in its context-parallel group (dp % cp), and the batch replica it reads (dp / cp).
int ContextRank(const Layout& layout, const RankCoords& coords);
int BatchReplica(const Layout& layout, const RankCoords& coords);

// A process group: its members (global ranks, in group-rank order) and its name for logs and
// rendezvous keys ("tp 0", "dp 1", "pp 0", "embedding 0", "ep 0", "edp 0", "cp 0"; the number is the group's index among the
// groups of its kind, ordered by lowest member).
struct Group {
  std::string name;
  std::vector<int> ranks;
  int RankOf(int global_rank) const;  // -1 when not a member
};

// Every group of `kind`, each once. Groups of one kind are disjoint; for kEmbedding, ranks in the
// middle stages belong to none (and pp == 1 gives no groups).
std::vector<Group> GroupsOf(const Layout& layout, GroupKind kind);
// The group of `kind` that `rank` belongs to; nullopt-like: ranks empty when none.
Group GroupOf(const Layout& layout, GroupKind kind, int rank);

}  // namespace ltrain::worker
