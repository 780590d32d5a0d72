// Trainer: trains this rank's share of the GPT model under the recipe's parallel layout (data,
// tensor, sequence and pipeline parallelism, ZeRO 0-3, activation checkpointing).
//
// Runs on the worker's main thread; ParamStore adds one reduction thread for the data-parallel
// group. Every rank of the job builds a Trainer with the same recipe and calls Run(); the ranks then
// make the same collectives in the same order within each group (a parameter broadcast over dp at
// start; per step the pipeline schedule's sends and receives, the tensor-parallel collectives inside
// forward and backward, the data-parallel reductions, the loss and gradient-norm reductions; barriers
// around checkpoints), so a rank that fails makes its peers fail at their next collective. Rank 0
// prints progress; every rank prints its memory line once. Every rank records its phases and each
// completed step's figures, and rank 0 its commits, in Progress::Global() (worker/control/progress.h),
// from which the coordinator learns them.
#pragma once

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <deque>
#include <limits>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include <c10/util/Exception.h>

#include "common/layout.h"
#include "common/recipe.h"
#include "common/status.h"
#include "common/data/loader.h"
#include "worker/checkpoint/checkpoint.h"
#include "worker/comm/communicator.h"
#include "worker/control/progress.h"
#include "worker/model/parallel_model.h"
#include "worker/parallel/param_store.h"
#include "worker/plan/lr_schedule.h"
#include "worker/recovery/recovery.h"
#include "common/layout_plan.h"  // kGpuPeakFlops, ModelFlopsPerToken
#include "common/pipeline_schedule.h"

namespace ltrain::worker {

// data.sampling "torch": window starts in [0, span) as a PyTorch loop draws them with torch.randint
// and a generator seeded with the data seed. nullptr for "hash".
std::unique_ptr<WindowStream> MakeWindowStream(const Recipe& recipe, int64_t span);

// "out of memory: " with LibTorch's message (no backtrace) and what to change in the recipe.
std::string OutOfMemoryMessage(const c10::OutOfMemoryError& e);
// Where the allocator's snapshot is written on a device out of memory (the worker's
// WriteMemorySnapshotOnOutOfMemory): OutOfMemoryMessage names the file once it exists.
void SetOutOfMemorySnapshotPath(std::string path);
// Inside a catch block: the exception being handled as a Status whose message begins with `what`
// (LibTorch's message without its backtrace; for a device out of memory, OutOfMemoryMessage's).
Status CaughtException(const std::string& what);

struct TrainerOptions {
  int rank = 0;
  // LTRAIN_DATA_TRACE: a file each window read is appended to (sample index, source, start, epoch).
  std::string data_trace;
  int local_rank = 0;            // picks the GPU when parallel.device is cuda
  int generation = 0;
  std::string job_id;
  std::string checkpoint_dir;   // resolved: env override, recipe, or default; empty disables saving
  bool print_progress = true;   // rank 0 prints; tests may silence it
  // Where ranks say their checkpoint files are durable (a FileCommitBoard over the checkpoint dir). Async
  // saves (checkpoint.async) need it when the world has more than one rank; without it they are
  // synchronous. Must outlive the Trainer.
  CheckpointCommitBoard* commit_board = nullptr;
  // fault.recovery in_place (worker/recovery): a step that fails because a peer died is redone in the
  // coordinator's next membership; with recovery->replacement() this rank replaces a failed one and
  // takes its state from a peer before its first step (it initialises, loads and broadcasts nothing).
  // Null: a failed collective fails the rank. Must outlive the Trainer.
  Recovery* recovery = nullptr;
  CheckpointWriteFault checkpoint_write_fault;            // LTRAIN_FAULT_CHECKPOINT_WRITE
  std::chrono::milliseconds collective_timeout{300000};   // also bounds rank 0's wait for peers' files
  // fault.collective_timeout_s is auto: the trainer derives collective_timeout again from its steps'
  // times (CollectiveTimeout, common/recipe.h) and sets it on its groups between steps.
  bool derive_collective_timeout = false;
  // Rank 0 records steps `profile_step` to `profile_last` (1-based; 0: none) with the CUDA profiler
  // into one Chrome trace at `profile_path` (LTRAIN_PROFILE=STEP:PATH or FIRST-LAST:PATH).
  int64_t profile_step = 0;
  int64_t profile_last = 0;  // below profile_step: profile_step alone
  std::string profile_path;
  // Called after every completed step (`ltrain stop --checkpoint`, see CheckpointStop): true saves
  // that step like a periodic checkpoint, waits for its commit and ends Run(); an error fails Run().
  std::function<StatusOr<bool>(int64_t step)> stop_after;
  // Data-parallel gradients reduced during backward, as each bucket completes (false: after it;
  // LTRAIN_DP_OVERLAP=0).
  bool dp_overlap = true;
  // zero 0 with our AdamW kernel, no pipeline: each unit's update runs on a stream of its own beside
  // the next forward, which waits for it just before the unit; zero 3: each unit's update runs in
  // its gather before the next forward uses it (LTRAIN_OVERLAP_UPDATE=0: inline).
  bool overlap_update = true;
  // zero 0 (or 1, 2) on one data-parallel rank without a pipeline: the gradients are made unit by unit
  // as backward reaches each and released after the update (ParamStore::UseTransientGradients), so
  // that forward's peak holds none. -1: on CUDA; 0: never; 1: on CPUs too
  // (LTRAIN_TRANSIENT_GRADIENTS=0 or 1).
  int transient_gradients = -1;
  // bf16 copies over NCCL, zero 1-3: the all-gathers of the copies within symmetric memory, on the
  // copy engines (ParamStore::UseSymmetricGathers; LTRAIN_COPY_ENGINE_GATHERS=0: NCCL's kernels).
  bool copy_engine_gathers = true;
  // tp or pp beside dp on GPUs: dp's collectives, issued inline in the computation's order, run on
  // a stream of their own beside it (false: on the computation's stream; LTRAIN_DP_SIDE_STREAM=0).
  bool dp_side_stream = true;
  // precision bf16: the residual sums rounded to bf16 stochastically (ModelShardSpec::
  // stochastic_residual; LTRAIN_STOCHASTIC_RESIDUAL=1).
  bool stochastic_residual = false;
  // tp without sequence parallelism: micro-batches through the blocks in two interleaved halves
  // (ModelShardSpec::tp_split_batch; LTRAIN_TP_SPLIT_BATCH=1).
  bool tp_split_batch = false;
  // The model without training data (export, generate): Run, Step and Save are not called.
  bool model_only = false;
  // Delivers this rank's Progress to its agent before it returns (ProgressReporter::Flush). Rank 0
  // calls it when a checkpoint is committed, after recording the commit and before printing its
  // line, on the thread that committed it (see CheckpointWriterOptions::on_commit). Empty: none.
  std::function<void()> report_progress;
  // The straggler drill (LTRAIN_FAULT_SLOW_RANK): each step's forward and backward take this many
  // times as long (the rank sleeps for the difference). 1: none.
  double slow_factor = 1.0;
  // A CPU rank whose node's ranks are each kept to cores (their intra-op threads fit the cores they
  // may run on): each step's own work is reported with the core it ran on (StepFigures.compute_work).
  bool report_cores = false;
};

class CheckpointWriter;
class LocalCommitBoard;

// The recipe's training data (the training split of data.path, or of every data.sources), checked
// against the recipe. Missing or unusable data is a FailedPrecondition (exit 3: a restart would find
// the same files).
StatusOr<std::unique_ptr<DataLoader>> OpenTrainingData(const Recipe& recipe);

class Trainer {
 public:
  // `groups` must outlive the Trainer; its layout must match the recipe's tp and pp.
  static StatusOr<std::unique_ptr<Trainer>> Create(const Recipe& recipe, const TrainerOptions& options,
                                                   ProcessGroups* groups);
  // Plain data parallelism over `comm` (which must outlive the Trainer).
  static StatusOr<std::unique_ptr<Trainer>> Create(const Recipe& recipe, const TrainerOptions& options,
                                                   Communicator* comm);
  ~Trainer();

  // Trains from the current step to recipe.training.steps, checkpointing as configured. Returns early
  // (OK) where an in-place recovery joined a membership of fewer ranks: the caller makes that
  // membership's groups and a trainer for them, which takes this one's state (AdoptState).
  Status Run();
  // Plain data parallelism, a membership of fewer ranks (options.recovery holds it): takes `from`'s
  // state (parameters, moments, step, data position; the same model, every rank holding all of it),
  // then the members agree on the step to go on from, as after any recovery. The global batch stays
  // the recipe's: each member takes more of its micro-batches (this trainer's layout).
  Status AdoptState(Trainer& from);
  // One optimizer step; returns the global-batch mean loss.
  StatusOr<double> Step();
  // Saves the current step and waits until it is committed (or failed: the returned error).
  Status Save();
  // Rank 0 writes every parameter of the full model, gathered from all ranks, to `path`: for each
  // parameter in the model's order, uint32 name length, the name, uint64 element count, the
  // float32 values (little-endian). Every rank must call it.
  Status ExportParameters(const std::string& path);

  // Every parameter of the full model (the tied head once) in its order, as fp32 CPU tensors: a
  // world of one rank only.
  std::vector<std::pair<std::string, torch::Tensor>> FullParameters() const;
  // Logits [b, t, vocab] (fp32) of token ids [b, t]: a world of one rank only, no gradient.
  torch::Tensor Logits(const torch::Tensor& ids);

  int64_t step() const { return step_; }
  int64_t data_position() const { return data_position_; }
  const Layout& layout() const { return layout_; }
  // This rank's parameter tensors (its slices), in the full model's order.
  std::vector<torch::Tensor> Parameters() const;
  MemoryBytes Memory() const { return store_->Memory(); }
  int64_t activations_peak_bytes() const { return activations_peak_; }
  // Milliseconds the training thread spent blocked in checkpoint saves so far (snapshot, waiting
  // for the previous save; with synchronous saves the whole write).
  double checkpoint_blocked_ms() const { return checkpoint_blocked_ms_; }
  // When the last micro-step's backward started and ended (pp == 1), for overlap checks.
  std::chrono::steady_clock::time_point backward_start() const { return backward_start_; }
  std::chrono::steady_clock::time_point backward_end() const { return backward_end_; }

 private:
  Trainer(const Recipe& recipe, const TrainerOptions& options, ProcessGroups* groups, Layout layout,
          std::unique_ptr<DataLoader> data);
  // model.init_from: every parameter from the safetensors of a Hugging Face directory (or file),
  // under transformers' names or ours; moments start at zero.
  Status LoadInitialParameters(const std::string& path);
  Status Init();
  // fault.recovery in_place (options_.recovery): after a step failed because a peer died, joins the
  // next membership and takes the agreed state; the caller redoes the step.
  Status Recover(Status failure);
  // The members agree on the state to continue from, and the source's reaches every member that
  // lacks it or is behind: step, data position, RNG, parameters and moments.
  Status SyncState();
  // Under ZeRO (copies_): the members go back to the newest step of which every shard survives in a
  // peer's memory or their own, a replacement receiving its shard from the peer holding its copy.
  Status SyncShards();
  // The membership a recovery joined has fewer ranks (Recovery::reshaped): Run returns at once,
  // and the caller goes on with a trainer of that membership's layout (AdoptState).
  bool Reshaped() const { return options_.recovery != nullptr && options_.recovery->reshaped(); }
  // Before the update uses what the step's collectives brought: on a device whose communicator's
  // calls return before their operations ran (NCCL), waits for the device, and fails Unavailable
  // where a group was aborted meanwhile (a peer died): the state stays that of the step before.
  Status CheckGroupsBeforeUpdate();
  // This rank's shard, step, data position and RNG into its host memory and its successor's (MemoryCopies).
  Status TakeCopies();
  // What a copy brings back beside the shard: [step, data position, copies' interval, the step it is
  // chosen at] (int64) and the CPU generator's state.
  std::vector<torch::Tensor> CopyMeta() const;
  StatusOr<torch::Tensor> StepImpl(bool check_loss);
  // One step; the global-batch mean loss as a [1] tensor on the device. `check_loss` reads it
  // before the optimizer runs and fails the step if it is not finite.
  StatusOr<torch::Tensor> StepOnDevice(bool check_loss);
  // StepFigures.fp8 from TakeFp8Figures' figures of `step` (undefined: none), counting and saying an
  // overflow.
  std::optional<StepFigures::Fp8> Fp8FiguresOf(const torch::Tensor& figures, int64_t step);
  // Mixtures of experts at the step's end: the route counts summed over data parallelism, the router
  // biases moved by them (balance: bias), and the step's figures into moe_figures_ (every block's load
  // ratio, then the balance and z losses' sums and counts, known on every rank).
  Status SettleRouting();
  // model.moe.balance bias: every MoE block's router bias, by block, for rank 0's checkpoint meta (a
  // collective over the pipeline stages; empty without them); and this rank's blocks' biases from a
  // checkpoint's meta (zero, said, where it holds none).
  StatusOr<std::map<int, std::vector<float>>> GatherRouterBiases();
  void RestoreRouterBiases(const CheckpointMeta& meta);
  // StepFigures.moe from SettleRouting's figures (undefined: none); with `detail` each expert's
  // assignments too.
  std::optional<StepFigures::Moe> MoeFiguresOf(const torch::Tensor& figures, bool detail) const;
  // Ok for a finite loss; else the error, naming the step's overflowed FP8 operands where there were.
  Status CheckLoss(double value, int64_t step, int fp8_overflowed = 0) const;
  // A completed step's time: with options_.derive_collective_timeout, the collective timeout derived
  // from the last steps, set on every group when it moved by more than a fifth.
  void RetimeCollectives(double step_ms);
  // The micro-batch's token windows; FailedPrecondition when one holds an id outside model.vocab.
  Status FillBatch(int micro_step, torch::Tensor* inputs, torch::Tensor* targets);
  // This rank's micro-step `micro_step` of global batch `step` counted from data position `position0`.
  BatchSlice SliceOf(int64_t position0, int64_t step, int micro_step) const;
  // Every micro-batch of this rank in the step at data position `position` (on the prefetch thread).
  void MakeBatches(int64_t position, BatchPrefetcher::Batches* out);
  // Appends the slice's windows to options_.data_trace (LTRAIN_DATA_TRACE).
  void TraceWindows(const BatchSlice& slice);
  // One micro-batch of host token ids, checked against model.vocab, on the device.
  Status ToDevice(const DataLoader& loader, const int64_t* host_inputs, const int64_t* host_targets,
                  torch::Tensor* inputs, torch::Tensor* targets);
  // The mean loss over training.eval_batches global batches of the validation split (the same windows each
  // time), known on every rank; forward only, the parameters and the training data position stay.
  StatusOr<double> Evaluate();
  // One micro-batch's mean loss through this rank's pipeline stages, forward only (last stage: the
  // loss; other stages: undefined).
  StatusOr<torch::Tensor> PipelineForward(int micro_step, const torch::Tensor& inputs, const torch::Tensor& targets);
  Status RunPipeline(torch::Tensor& loss_sum);
  void SampleActivations();
  std::string LayoutKey() const;
  // Parameters of the whole model (every tp and pp part, the tied embedding once).
  int64_t FullModelParameters() const;
  // Peak device memory on CUDA: the caching allocator's, plus the store's symmetric memory.
  int64_t PeakDeviceBytes() const;
  // Rank 0's summary of the timed steps: tokens/s, per device, TFLOP/s, MFU and peak memory on CUDA.
  // `left_out` of the `steps` from `first_step` on (profiled) are not in `total_ms`.
  void PrintThroughput(int64_t first_step, int64_t steps, double total_ms, int64_t left_out = 0) const;
  // Snapshots this step and starts its save (async) or writes and commits it (sync). A failed save
  // is reported, not returned: only errors that break the job (a failed collective) are.
  Status StartSave();
  // Rank 0 picks the checkpoint; every rank reads and verifies what it needs; the ranks agree on the
  // outcome (a collective), and all apply it or all move to the next older commit.
  Status Resume(const std::string& path);
  // `choice`, or FailedPrecondition when its saved recipe's model has parameters of other shapes.
  StatusOr<ResumeChoice> RefuseAnotherModel(ResumeChoice choice) const;
  // The shards of a checkpoint this rank needs, in host memory, verified: per file, its name and
  // its tensors by key.
  struct LoadedShards {
    std::vector<std::pair<std::string, std::map<std::string, torch::Tensor>>> model, optimizer;
    std::map<std::string, int> saved_rank;  // file -> the rank of the saved layout that wrote it
    std::set<std::string> read;             // the files read
    uint64_t bytes = 0;
    // Same layout under ZeRO-1/2: every rank loads only its shard of the masters, then they are
    // all-gathered over dp (ParamStore::GatherMasters).
    bool gather_masters = false;
    // (parameter, ParamStore::StatePart) placed while the files were read.
    std::set<std::pair<int, int>> placed;
  };
  // The checkpoint splits the model as this run does (tp, pp, virtual stages): each rank reads only
  // the data-parallel shards of its own slice.
  bool SameModelGrid(const CheckpointMeta& meta) const {
    return meta.tp == layout_.tp && meta.pp == layout_.pp && meta.chunks == layout_.chunks;
  }
  // Reads every file of `step_dir` this rank needs once, verifying its hash (DataLoss when one does
  // not verify; InvalidArgument when the layout cannot be loaded here).
  Status ReadShards(const std::string& step_dir, const CheckpointMeta& meta, LoadedShards* shards);
  // The range ("range.<name>") each of this rank's parameters has in the shard at `path`, in the
  // store's parameter order; nullopt where the shard has none (or not two int64 values: the full
  // read says what is wrong). Reads its header and range tensors only.
  StatusOr<std::vector<std::optional<Range>>> SavedRanges(const std::string& path) const;
  // Reassembles every parameter's full value and moments from the shards that hold it (any
  // data-parallel degree and ZeRO stage; any tp, pp and virtual-stage split), then keeps this
  // rank's part.
  Status ApplyShards(const std::string& step_dir, const CheckpointMeta& meta, const LoadedShards& shards);

  Recipe recipe_;
  TrainerOptions options_;
  std::unique_ptr<ProcessGroups> owned_groups_;
  ProcessGroups* groups_;
  Layout layout_;
  std::unique_ptr<DataLoader> loader_;             // the training split; none for a model-only trainer
  std::unique_ptr<DataLoader> val_loader_;         // the validation split, when training.eval_every > 0
  std::unique_ptr<BatchPrefetcher> prefetcher_;    // after loader_: stops before the loader goes
  std::FILE* data_trace_ = nullptr;                // options_.data_trace, open (on the prefetch thread)
  double eval_ms_ = 0;                             // time spent evaluating (out of the throughput window)
  LrSchedule schedule_;
  torch::Device device_{torch::kCPU};
  bool bf16_ = false;
  bool bf16_params_ = false;                       // bf16 copies of fp32 masters (no autocast)
  bool fp32_residual_ = false;                     // bf16_params_ with the residual stream in fp32
  bool defer_compute_ = false;                     // the store's bf16 copies gathered during the next forward
  bool transient_gradients_ = false;               // ParamStore::UseTransientGradients
  torch::ScalarType activation_dtype_ = torch::kFloat;  // what pipeline stages send each other
  bool overlap_ = true;          // reduce buckets from backward hooks (pp == 1, no partial tp gradients)
  bool tp_partial_grads_ = false;  // some gradients are partial sums over tp (ShardParam::tp_partial)
  std::unique_ptr<ModelShard> model_;
  std::unique_ptr<ParamStore> store_;
  std::unique_ptr<MemoryCopies> copies_;  // in-place recovery under ZeRO 1 and 2: peers' copies of the shards
  std::vector<std::string> param_names_;
  PipelinePlan plan_;
  int64_t step_ = 0;              // optimizer steps completed
  int64_t data_position_ = 0;     // next sample index
  int64_t run_start_step_ = 0;    // step_ and data_position_ when this process started
  int64_t run_start_position_ = 0;
  bool memory_printed_ = false;
  // parallel.precision fp8: the steps of this process whose FP8 operands overflowed, and the last.
  int64_t fp8_overflow_steps_ = 0;
  torch::Tensor moe_figures_;  // SettleRouting's, taken by Run with the step's loss
  int64_t fp8_last_overflow_step_ = 0;
  int64_t heap_base_ = 0;
  int64_t activations_peak_ = 0;
  std::chrono::steady_clock::time_point backward_start_, backward_end_;
  // This rank's own work (forward and backward) of its last steps, newest last: the compute figure
  // of its progress, from which the coordinator names stragglers. The host's clock on a CPU; on a GPU
  // the device's, from the spans of each step's micro-batches, counted once the GPU has passed them.
  std::deque<StepFigures::Work> compute_window_;
  std::deque<double> step_ms_window_;  // the last steps' times (RetimeCollectives)
  int64_t steps_timed_ = 0;
  std::deque<std::vector<compat::DeviceSpan>> device_spans_;
  double drill_base_ms_ = std::numeric_limits<double>::infinity();  // the fastest GPU step measured
  double checkpoint_blocked_ms_ = 0;
  int checkpoint_saves_ = 0;
  Status last_save_;                               // sync saves: the outcome of the last one
  std::unique_ptr<LocalCommitBoard> local_board_;  // a world of one rank
  std::unique_ptr<CheckpointWriter> writer_;       // last: goes (and joins) first
};

}  // namespace ltrain::worker
