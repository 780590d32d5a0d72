// Layout: how the ranks of a job divide the work, resolved from a recipe for a world size. The one
// place the layout rules live: `ltrain validate` and every recipe parse (for the recipe's own world
// size), the coordinator (for each generation of an elastic job) and the worker (for the world it
// was started in) all call CheckLayout or PlanLayout. Pure functions over plain structs.
//
// Rank order is Megatron-LM's and TorchTitan's: tensor parallel innermost (the ranks of a TP group are
// neighbours, so on one node), then data parallel, then pipeline outermost:
//   tp_rank = rank % tp,  dp_rank = (rank / tp) % dp,  pp_rank = rank / (tp * dp).
#pragma once

#include <string>
#include <vector>

#include "common/recipe.h"
#include "common/status.h"

namespace ltrain {

struct Layout {
  int world_size = 1;
  int tp = 1;
  int dp = 1;
  int pp = 1;
  // Expert parallelism, carved out of dp: each MoE block's experts split over ep data-parallel ranks
  // next to each other (ep_rank = dp_rank % ep); the ranks holding the same experts (dp / ep of
  // them, edp_rank = dp_rank / ep) reduce their gradients.
  int ep = 1;
  // Context parallelism, carved out of dp too: each sequence split over cp data-parallel ranks next
  // to each other (cp_rank = dp_rank % cp), which read the same sequences (batch replica dp_rank /
  // cp, of dp / cp) and take two chunks of each; gradients are reduced over all of dp as before.
  int cp = 1;
  int chunks = 1;                 // model chunks per pipeline rank (interleaved 1F1B)
  std::vector<int> stage_layers;  // layers per virtual stage (pp * chunks entries)
  int zero = 0;
  bool sequence_parallel = false;
  ActivationCheckpointing activation_checkpointing = ActivationCheckpointing::kNone;
  PpSchedule pp_schedule = PpSchedule::k1F1B;
  int micro_batch = 1;
  int accumulation = 1;           // micro-batches per data-parallel rank per optimizer step
  int global_batch = 1;

  // Plain data parallelism: every rank holds the whole model and the whole optimizer state.
  bool plain() const { return tp == 1 && pp == 1 && zero == 0 && ep == 1 && cp == 1; }
  // The data-parallel ranks that read distinct batches: dp / cp.
  int batch_replicas() const { return dp / (cp > 0 ? cp : 1); }
  // Only the degrees, for the group arithmetic of plain data parallelism and of tests.
  static Layout Grid(int tp, int dp, int pp) {
    Layout layout;
    layout.tp = tp;
    layout.dp = dp;
    layout.pp = pp;
    layout.world_size = tp * dp * pp;
    return layout;
  }
};

// A broken layout rule: the recipe key to change ("parallel.tp") and what is wrong, with the fix.
struct LayoutProblem {
  std::string key;
  std::string message;
};

// Every rule that ties the recipe's parallel and batch keys to each other, to the model and to
// `world_size` ranks; empty when the recipe can run on them.
std::vector<LayoutProblem> CheckLayout(const Recipe& recipe, int world_size);

// The layout of `recipe` on `world_size` ranks, or its first problem as InvalidArgument.
StatusOr<Layout> PlanLayout(const Recipe& recipe, int world_size);

// Why a failed rank of `recipe` on `world_size` ranks cannot be replaced in place (fault.recovery:
// in_place), so that the job restarts instead; empty when it can: every rank's part of the training
// state (its tp part) is held by the other ranks of its data-parallel group, whole without ZeRO and
// as copies of the shards under ZeRO 1 and 2, so a survivor there fills the replacement; without
// pipeline stages (their sends in flight across a re-formed group are not yet).
std::string InPlaceRecoveryProblem(const Recipe& recipe, int world_size);

// Why `recipe`, started on `world_size` ranks, cannot go on in place with `members` of them when the
// others left and none can be replaced (their node is lost); empty when it can: plain data
// parallelism, every member holding the whole state, and the global batch's micro-batches shared
// evenly among the members (more accumulation each), so that the optimizer sees the same batch.
std::string ShrinkProblem(const Recipe& recipe, int world_size, int members);

// Layers per virtual pipeline stage: `split` when given, otherwise balanced, the earlier stages
// taking one more when the division leaves a remainder. CheckLayout's rules make it well defined.
std::vector<int> StageLayers(int layers, int stages, const std::vector<int>& split);

}  // namespace ltrain
