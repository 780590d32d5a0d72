// Layout plans: what a layout of a recipe costs before it runs. Per-rank memory by part, the
// communication of one step per process group, the pipeline bubble, an estimated step time, and the
// feasible layouts of a model on N ranks ranked by that time (`ltrain plan`). Pure arithmetic over
// the recipe, the layout rules of common/layout.h and the schedules of common/pipeline_schedule.h;
// no LibTorch, so the CLI links it.
//
// Memory follows what the worker allocates:
//  - parameters, gradients and optimizer state exactly as its parameter store lays them out (the
//    tensor-parallel split, the pipeline stage's layers, the tied head's copy on the last stage,
//    buckets or ZeRO-3 units padded to a multiple of dp, bf16 compute copies on CUDA), so that they
//    equal the worker's `memory rank` line to the byte;
//  - activations: what autograd keeps for backward at the peak of a step, per layer from the
//    tensors each operation saves (LibTorch 1.13's written-out attention and norms on the CPU, the
//    fused kernels and flash attention on CUDA), times the micro-batches a pipeline schedule keeps in
//    flight, for each recompute mode;
//  - buffers: what lives only for part of a step (ZeRO-3's gathered units and the bf16 casts autocast
//    keeps, ZeRO-2's unsharded gradients, pipeline sends held to the step's end, the loss's gradient).
// On the CPU the worker's `memory rank` line measures activations and buffers together as the heap's
// growth during the step's forwards; on CUDA its peak is the caching allocator's.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/layout.h"
#include "common/recipe.h"
#include "common/status.h"

namespace ltrain {

struct MemoryParts {
  int64_t params = 0;
  int64_t grads = 0;
  int64_t optimizer = 0;
  int64_t activations = 0;  // saved for backward, for the layout's recompute mode
  int64_t buffers = 0;
  int64_t total() const { return params + grads + optimizer + activations + buffers; }
};

// One pipeline rank's memory (every tensor- and data-parallel rank of a stage holds the same).
struct StageMemory {
  int pp_rank = 0;
  int64_t parameters = 0;  // elements this rank holds before ZeRO sharding
  MemoryParts parts;
  // activations + buffers under each recompute mode, in ActivationCheckpointing's order (none, full,
  // selective).
  int64_t activations_by_mode[3] = {0, 0, 0};
};

// What one rank sends per optimizer step within one kind of group (ring algorithms: an all-reduce of
// B bytes sends 2(n-1)/n*B, an all-gather or reduce-scatter (n-1)/n*B).
struct GroupTraffic {
  std::string group;  // "dp", "tp", "pp", "embedding"
  int size = 1;
  int64_t bytes = 0;
  std::string what;
};

struct LayoutEstimate {
  Layout layout;
  Device device = Device::kCpu;
  bool bf16 = false;                 // bf16 compute copies (CUDA, precision bf16 or auto, zero < 3)
  std::vector<StageMemory> stages;   // one per pipeline rank
  int64_t peak_bytes = 0;            // the largest stage's total
  std::vector<GroupTraffic> traffic;
  double bubble = 0;                 // the pipeline's idle fraction of a step
  // The estimated step time, from the cost model in layout_plan.cc: on CUDA compute at the measured
  // single-GPU efficiency, the exposed part of each group's traffic and the bubble; on CPUs compute
  // at a measured rate a core, the bubble, and each Gloo message's latency and bytes.
  double step_seconds = 0;
  double mfu = 0;  // CUDA only: model FLOPs utilisation against kGpuPeakFlops
};

// The dense bf16 peak of the GPUs MFU is measured against (an H100's, as the peers report it).
inline constexpr double kGpuPeakFlops = 989e12;

// The model FLOPs of one token, forward and backward: 6N + 12*layers*d_model*seq_len.
double ModelFlopsPerToken(const ModelSpec& model);

// The estimate for `layout`, a layout of `recipe` that passed CheckLayout; on CPUs each rank
// computing on `cpu_cores_per_rank` cores.
LayoutEstimate EstimateLayout(const Recipe& recipe, const Layout& layout, double cpu_cores_per_rank = 1);

// The intra-op threads each CPU rank of a node runs with `ranks_on_node` ranks: OMP_NUM_THREADS where
// set (as users of torchrun expect), else the node's cores shared out. The worker runs with it; the
// plan estimates with it.
int CpuThreadsPerRank(int ranks_on_node);

struct PlanOptions {
  int ranks = 0;               // 0: the recipe's world size
  int ranks_per_node = 0;      // 0: the recipe's nproc_per_node when it divides ranks, else min(ranks, 8)
  Device device = Device::kCpu;
  double memory_bytes = 0;     // per rank; 0: no limit
  double cpu_cores_per_rank = 1;  // CPU ranks: the cores each computes on
};

// One layout considered for the model: its recipe keys, and its estimate or why it cannot run.
struct PlanCandidate {
  std::vector<std::string> sets;  // "parallel.tp=2", ... : the --set overrides that give it
  bool feasible = false;
  std::string problem;            // a layout rule it breaks, or what does not fit in memory
  LayoutEstimate estimate;        // empty when a layout rule failed
};

// Every combination of tp, pp, zero, sequence parallelism, pipeline schedule and recompute mode for
// `recipe`'s model, batch and micro-batch on the options' ranks: feasible ones first, fastest first
// by the estimate (then smallest peak), then the others with their reasons.
std::vector<PlanCandidate> RankLayouts(const Recipe& recipe, const PlanOptions& options);

// The most memory a rank can have, so that a recipe whose model cannot fit anywhere is refused
// before it runs: a GPU's (the largest made, 288 GB), a CPU rank's (a large server's, 4 TiB).
inline constexpr double kLargestGpuBytes = 288e9;
inline constexpr double kLargestCpuRankBytes = 4.0 * (1LL << 40);

// What is wrong when `recipe`'s model cannot train on its ranks in any layout: even its training
// state (fp32 weights, gradients and AdamW's two moments, 16 bytes a parameter) spread evenly over
// every rank would need more than a rank can have. Says the plan's figure for the recipe's own
// layout, the floor, and the fix; "" when it may fit (ltrain plan tells whether it does).
std::string FitProblem(const Recipe& recipe);

// The largest fraction of a GPU's memory a plan fills: the rest is the CUDA context, NCCL's buffers,
// cuBLAS workspaces and the caching allocator's fragmentation, none of which the allocator's peak shows.
inline constexpr double kGpuMemoryUsable = 0.9;

}  // namespace ltrain
