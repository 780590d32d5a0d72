// What this rank is doing and has done, as the coordinator learns it: the step and phase it is in
// and a ring of its last collectives (op, group, sequence number, bytes, start, end), for hang
// detection and diagnosis; the figures of the last step it completed; the newest checkpoint it
// committed; whether it stopped after a final checkpoint. The training thread writes it (the
// checkpoint writer's thread records commits); the progress reporter reads snapshots and sends them
// to the agent. Thread-safe.
#pragma once

#include <cstdint>
#include <cstdio>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "worker/control/tensorboard_events.h"

namespace ltrain::worker {

struct CollectiveRecord {
  uint64_t seq = 0;        // per-rank sequence number of collectives, 1-based
  std::string op;          // all_reduce, broadcast, all_gather, reduce_scatter, send, recv, barrier
  std::string group;       // "world", "dp 0", "tp 1", "pp 0", ...
  int64_t bytes = 0;
  int64_t start_unix_ms = 0;
  int64_t end_unix_ms = 0; // 0 while in flight
};

// A completed training step, with the figures of rank 0's "step N/M ..." line.
struct StepFigures {
  int64_t step = 0;        // 1-based
  int64_t total_steps = 0;
  double loss = 0;
  double lr = 0;
  double tokens_per_s = 0;
  double step_ms = 0;
  double compute_ms = 0;    // median of the last compute_steps steps' own work (see RankProgress); 0: none
  int compute_steps = 0;
  double compute_spread_ms = 0;  // those steps' median absolute deviation from compute_ms
  // One step's own work: its milliseconds, the core it ran on (negative: several, or not recorded)
  // and the step (1-based).
  struct Work {
    double ms = 0;
    int cpu = -1;
    int64_t step = 0;
  };
  std::vector<Work> compute_work;  // proto StepFigures.compute_work: the steps on one core; empty: not reported
  double mfu = 0;           // 0 to 1, against the GPU's dense bf16 peak; 0: not on a GPU
  int64_t memory_bytes = 0; // this rank's memory (proto StepFigures.memory_bytes); 0: unknown
  // parallel.precision fp8: the step's FP8 products (proto Fp8Figures); absent otherwise.
  struct Fp8 {
    double activation_amax_max = 0, activation_amax_min = 0;
    double weight_amax_max = 0, weight_amax_min = 0;
    double gradient_amax_max = 0, gradient_amax_min = 0;
    int products = 0;    // operands quantized in the step
    int overflowed = 0;  // of those, the ones whose amax was not finite
    int64_t overflow_steps = 0;      // steps of the run so far with one
    int64_t last_overflow_step = 0;  // the last of them; 0: none
  };
  std::optional<Fp8> fp8;
  // model.moe: how the step's routed assignments fell on the experts, each MoE block's load the
  // ratio of its busiest expert's count to the mean; the balance and z losses without their
  // coefficients (averaged over blocks and micro-batches; negative: not computed).
  struct Moe {
    double load_max = 0;   // the worst block's
    int worst_layer = -1;  // which block that is
    double load_mean = 0;  // over the blocks
    double aux_loss = -1, z_loss = -1;
    // model.moe.capacity_factor: the share of the step's assignments dropped; -1: dropless.
    double drop_rate = -1;
    std::vector<int> layers;          // the MoE blocks
    std::vector<double> layer_load;   // each one's load
    // [block][expert] the step's assignments (metrics.jsonl only, at log steps: it is long); empty
    // on the other steps.
    std::vector<std::vector<double>> tokens_per_expert;
  };
  std::optional<Moe> moe;

  // compute_ms, compute_steps and compute_spread_ms from the own work of the last steps; with
  // `by_core`, compute_work too.
  void SetCompute(const std::deque<Work>& window, bool by_core);
};

// Long work a rank is in the middle of, in countable units, so that start-up, a checkpoint save or
// a load that moves is never taken for a hang: "building the model" (parameters), "saving
// checkpoint step-40" (bytes), "loading checkpoint step-40" (bytes), "committing checkpoint
// step-40" (ranks heard from).
struct WorkProgress {
  std::string what;        // empty: none
  int64_t done = 0;
  int64_t total = 0;       // 0: unknown
  std::string unit;        // "bytes", "parameters", "ranks"
  bool waits_for_peers = false;  // it waits for other ranks (a commit collecting their word)
};

struct ProgressSnapshot {
  int64_t step = 0;        // the step being worked on (1-based; 0 before the first)
  std::string phase;       // startup, data, forward, backward, optimizer, checkpoint, stopping, done
  int64_t updated_unix_ms = 0;
  std::deque<CollectiveRecord> collectives;  // oldest first
  std::optional<StepFigures> completed;      // the last completed step
  int64_t committed_step = 0;                // 0: none
  std::string committed_path;
  bool stopped_after_checkpoint = false;
  WorkProgress work;
  int64_t eval_step = 0;                     // the step of the last validation loss; 0: none
  double val_loss = 0;
  int64_t save_step = 0;                     // rank 0: the last checkpoint it committed in this process
  double save_ms = 0;                        //   from its snapshot to its commit
  int64_t save_bytes = 0;
  int64_t load_step = 0;                     // rank 0: the checkpoint this process resumed from; 0: none
  double load_ms = 0;
  int64_t load_bytes = 0;
  // A replacement (in-place recovery): the membership it joined, the step whose state it took from
  // `recovery_source`'s memory, and the bytes and time that took; recovery_epoch 0: none.
  int recovery_epoch = 0;
  int64_t recovery_step = 0;
  int recovery_source = -1;
  int64_t recovery_bytes = 0;
  double recovery_ms = 0;
  int64_t recovery_lost_steps = 0;
};

class Progress {
 public:
  static constexpr size_t kRingSize = 64;

  // The process-wide instance the communicators and the trainer report to.
  static Progress& Global();

  void SetPhase(int64_t step, const std::string& phase);
  // Returns the collective's sequence number, for EndCollective.
  uint64_t BeginCollective(const std::string& op, const std::string& group, int64_t bytes);
  void EndCollective(uint64_t seq);
  void RecordStep(const StepFigures& figures);
  // The validation loss measured after `step`.
  void RecordEval(int64_t step, double val_loss);
  // Long work: SetWork starts or advances it (any thread: the checkpoint writer's reports its bytes),
  // EndWork(what) ends it unless other work replaced it since.
  void SetWork(const std::string& what, int64_t done, int64_t total, const std::string& unit,
               bool waits_for_peers = false);
  void EndWork(const std::string& what);
  // A checkpoint of `step` is committed at `path` (or this run resumed from it); older ones are ignored.
  void RecordCommit(int64_t step, const std::string& path);
  void RecordStoppedAfterCheckpoint();
  // Rank 0's checkpoint times: a save of `step` committed `ms` after its snapshot began, and the
  // resume's load; both also go to metrics.jsonl ({"checkpoint_step": N, "save_ms": X, "bytes": N},
  // {"loaded_step": N, "load_ms": X, "bytes": N}) and TensorBoard (checkpoint/save_s, checkpoint/load_s).
  void RecordSave(int64_t step, double ms, int64_t bytes);
  void RecordLoad(int64_t step, double ms, int64_t bytes);
  // This rank replaced a failed one in membership `epoch` and took the state of `step` from `source`.
  // `lost_steps`: the steps the members had completed past `step`, to be trained again.
  void RecordRecovery(int epoch, int64_t step, int source, int64_t bytes, double ms, int64_t lost_steps);
  ProgressSnapshot Snapshot() const;

  // From now on every completed step and validation loss is also appended, one JSON object a line,
  // to `path` (the job's metrics.jsonl, which rank 0's agent names in LTRAIN_METRICS_FILE):
  //   {"time": UNIX_S, "generation": G, "step": N, "total_steps": N, "loss": X, "lr": X,
  //    "tokens_per_s": X, "step_ms": X, "compute_ms": X, "mfu": X, "memory_bytes": N}
  //                                                        (compute_ms, mfu, memory_bytes where known)
  //   {"time": UNIX_S, "generation": G, "step": N, "val_loss": X}
  // Lines are flushed as written, so a reader (a plotting script, tail -f) sees each step at once.
  // False, with `error` set, when the file cannot be opened for appending.
  bool WriteMetricsTo(const std::string& path, int generation, std::string& error);
  // From now on the same figures also go to a new TensorBoard event file in `dir` (the job's
  // tensorboard/ directory, LTRAIN_TENSORBOARD_DIR): scalars train/loss, train/lr,
  // train/tokens_per_s, train/step_ms, train/mfu (percent), train/memory_gib and val/loss by step. False, with `error` set, when the file
  // cannot be created.
  bool WriteTensorBoardTo(const std::string& dir, std::string& error);

 private:
  void AppendMetricsLocked(const std::string& fields);

  mutable std::mutex mu_;
  ProgressSnapshot state_;
  uint64_t next_seq_ = 1;
  std::FILE* metrics_ = nullptr;  // never closed: the process's own, until it exits
  int metrics_generation_ = 0;
  std::unique_ptr<TensorBoardWriter> tensorboard_;
};

// Marks a collective in flight for its scope.
class ScopedCollective {
 public:
  ScopedCollective(const std::string& op, const std::string& group, int64_t bytes)
      : seq_(Progress::Global().BeginCollective(op, group, bytes)) {}
  ~ScopedCollective() { Progress::Global().EndCollective(seq_); }
  ScopedCollective(const ScopedCollective&) = delete;
  ScopedCollective& operator=(const ScopedCollective&) = delete;

 private:
  uint64_t seq_;
};

}  // namespace ltrain::worker
