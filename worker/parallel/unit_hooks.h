// The hooks through which the parameter store follows the model's forward and backward, unit by
// unit (0 the embedding, 1 + layer for a block, layers + 1 the head). Built once by the trainer on
// the worker's main thread; they run on that thread (forward, and backward's autograd hooks) and may
// throw, as autograd expects: a failed gather surfaces from forward or backward as an exception.
#pragma once

#include <vector>

#include "worker/model/parallel_model.h"
#include "worker/parallel/param_store.h"

namespace ltrain::worker {

// ZeRO-3's store units: the model's structural units (every parameter of a unit together), the
// last unit first, as backward reaches them.
std::vector<std::vector<int>> StructuralUnits(const std::vector<ShardParam>& params);

// `units` with each unit's expert parameters (ShardParam::expert) moved into a unit of their own,
// next to it: expert parallelism reduces them over another group (ParamStore::Create's expert_dp).
std::vector<std::vector<int>> SeparateExpertUnits(const std::vector<std::vector<int>>& units,
                                                  const std::vector<ShardParam>& params);

// ZeRO-3 over store units made by StructuralUnits (and SeparateExpertUnits: a structural unit may
// then be two store units, gathered and released together): a unit's parameters are gathered before its
// forward (the next unit prefetched), a block's are released after its forward (the embedding and
// the head stay until their gradients are ready), and gathered again when backward reaches the
// block's output (the block before it prefetched). `store` must outlive the hooks.
UnitHooks Zero3GatherHooks(ParamStore* store, const std::vector<ShardParam>& params,
                           const std::vector<std::vector<int>>& units, int layers);

// Transient gradients (ParamStore::UseTransientGradients) over store units made by StructuralUnits:
// when backward reaches the output of the embedding or of a block, that unit's gradient buffer is
// made (the head's, whose backward comes first, the trainer prepares before backward). Returns
// `hooks` with this output hook added (it has none). `store` must outlive the hooks.
UnitHooks PrepareGradientsHooks(ParamStore* store, const std::vector<ShardParam>& params,
                                const std::vector<std::vector<int>>& units, UnitHooks hooks = {});

// A sharded update's bf16 copies are all-gathered during the next forward: each structural unit
// waits, before its forward, for the store units that hold its parameters. `store` must outlive
// the hooks.
UnitHooks AwaitComputeCopiesHooks(ParamStore* store, const std::vector<ShardParam>& params);

}  // namespace ltrain::worker
