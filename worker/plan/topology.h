// Topology: how the ranks of a job split into tensor-, data- and pipeline-parallel groups, and which
// layers each pipeline stage holds. Pure functions over plain structs (no LibTorch, no I/O).
//
// Rank order is Megatron-LM's and TorchTitan's: tensor parallel innermost (the ranks of a TP group are
// neighbours, so on one node), then data parallel, then pipeline outermost:
//   tp_rank = rank % tp,  dp_rank = (rank / tp) % dp,  pp_rank = rank / (tp * dp).
#pragma once

#include <string>
#include <vector>

#include "common/status.h"

namespace ltrain::worker {

struct Topology {
  int tp = 1;
  int dp = 1;
  int pp = 1;
  int world() const { return tp * dp * pp; }
};

struct RankCoords {
  int tp = 0;
  int dp = 0;
  int pp = 0;
  bool operator==(const RankCoords&) const = default;
};

// dp = world / (tp * pp); fails when tp * pp does not divide world.
StatusOr<Topology> MakeTopology(int world, int tp, int pp);

RankCoords CoordsOf(const Topology& topology, int rank);
int RankAt(const Topology& topology, const RankCoords& coords);

enum class GroupKind {
  kTensor,     // same dp and pp coordinates: the tp ranks of one stage replica
  kData,       // same tp and pp: the replicas that all-reduce (or shard) gradients
  kPipeline,   // same tp and dp: the stages that pass activations
  kEmbedding,  // first and last pipeline stage of one pipeline (tied embedding/head); pp > 1 only
};

// A process group: its members (global ranks, in group-rank order) and its name for logs and
// rendezvous keys ("tp 0", "dp 1", "pp 0", "embedding 0"; the number is the group's index among the
// groups of its kind, ordered by lowest member).
struct Group {
  std::string name;
  std::vector<int> ranks;
  int RankOf(int global_rank) const;  // -1 when not a member
};

// Every group of `kind`, each once. Groups of one kind are disjoint; for kEmbedding, ranks in the
// middle stages belong to none (and pp == 1 gives no groups).
std::vector<Group> GroupsOf(const Topology& topology, GroupKind kind);
// The group of `kind` that `rank` belongs to; nullopt-like: ranks empty when none.
Group GroupOf(const Topology& topology, GroupKind kind, int rank);

// Layers per virtual pipeline stage (pp * virtual_stages of them): `split` when given (it must have
// one entry per virtual stage, each >= 1, summing to `layers`), otherwise balanced, the earlier
// stages taking one more when the division leaves a remainder.
StatusOr<std::vector<int>> StageLayers(int layers, int virtual_stages_total, const std::vector<int>& split);

// Virtual stage of model chunk `chunk` on pipeline rank `pp_rank` (Megatron's interleaving: chunk c
// of every rank comes before chunk c + 1 of any rank).
inline int VirtualStage(int pp, int pp_rank, int chunk) { return chunk * pp + pp_rank; }

}  // namespace ltrain::worker
