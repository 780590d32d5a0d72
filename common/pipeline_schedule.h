// Pipeline schedules as pure planners: for every pipeline rank, the ordered list of operations of one
// optimizer step. GPipe (all forwards, then all backwards), 1F1B (PipeDream-Flush: warm-up forwards,
// then one forward one backward, then cool-down backwards) and interleaved 1F1B (Megatron-LM's
// virtual stages: each rank holds `chunks` model chunks; chunk c of rank r is virtual stage c*pp + r).
//
// Communication semantics the plans are checked against (SimulatePipeline) and that the runtime
// provides: a send never blocks (the transfer completes in the background; the step waits for all
// sends at its end), a receive blocks until the matching send was posted. Messages are matched by
// (kind, micro-batch, virtual stage), never by arrival order.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/recipe.h"
#include "common/status.h"

namespace ltrain {

enum class PipeOpKind {
  kRecvActivation,  // from the previous virtual stage, before kForward
  kForward,
  kSendActivation,  // to the next virtual stage, after kForward
  kRecvGrad,        // from the next virtual stage, before kBackward
  kBackward,
  kSendGrad,        // to the previous virtual stage, after kBackward
};

struct PipeOp {
  PipeOpKind kind = PipeOpKind::kForward;
  int microbatch = 0;
  int chunk = 0;   // model chunk on this rank (0 unless interleaved)
  int peer = -1;   // pipeline rank sent to / received from; -1 for compute
  bool operator==(const PipeOp&) const = default;
};

struct PipelinePlan {
  int pp = 1;
  int chunks = 1;
  int microbatches = 1;
  std::vector<std::vector<PipeOp>> ops;  // [pp rank] -> ops in execution order
  int virtual_stages() const { return pp * chunks; }
};

// interleaved needs chunks >= 2 and microbatches % pp == 0; gpipe and 1f1b need chunks == 1 (a
// layout that passed CheckLayout meets them).
StatusOr<PipelinePlan> PlanPipeline(PpSchedule schedule, int pp, int chunks, int microbatches);

// Tag that identifies one message within a step: the same on sender and receiver.
uint32_t PipeTag(const PipelinePlan& plan, bool gradient, int microbatch, int virtual_stage);

struct PipelineSimulation {
  bool completed = false;
  std::string error;           // why not: a deadlock (with every rank's blocked op) or a broken dependency
  int max_in_flight = 0;       // most forward activations any rank held at once (the memory cost)
  int steps = 0;               // rounds of the lock-step simulation
};

// Runs the plan on simulated ranks: checks that every rank computes each (micro-batch, chunk) forward
// and backward exactly once, every forward comes after its input is received (or is the first stage),
// every backward after its own forward and after its output gradient is received (or is the last
// stage), every receive matches one send of the same message, and that nothing deadlocks.
PipelineSimulation SimulatePipeline(const PipelinePlan& plan);

std::string ToString(const PipeOp& op);

// Virtual stage of model chunk `chunk` on pipeline rank `pp_rank` (Megatron's interleaving: chunk c
// of every rank comes before chunk c + 1 of any rank).
inline int VirtualStage(int pp, int pp_rank, int chunk) { return chunk * pp + pp_rank; }

}  // namespace ltrain
