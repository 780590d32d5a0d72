// ParamStore: this rank's parameters in flat per-unit buffers, their gradients, the data-parallel
// gradient reduction, ZeRO sharding and the AdamW optimizer over flat (sharded) state.
//
// Units partition the parameters. A unit is the bucket that data parallelism reduces as soon as
// backward has produced all of its gradients (autograd post-hooks on each parameter's gradient
// accumulator count them down), and the unit that ZeRO shards: its flat buffer is padded to a
// multiple of dp and data-parallel rank r owns elements [r*S, (r+1)*S).
//   zero 0: full parameters, gradients (all-reduced) and optimizer state on every rank.
//   zero 1: optimizer state only for the owned shard; parameters all-gathered after the update.
//           With bf16 compute copies the gradients are reduce-scattered (each rank needs only its
//           shard's), and the update writes the owned part of the copies, which are all-gathered in
//           bf16: the fp32 masters outside the shard are then stale until SyncMasters.
//   zero 2: plus gradients: each unit's gradients are reduce-scattered into a shard-sized buffer
//           after every micro-step's backward, and the full gradients are dropped.
//   zero 3: plus parameters: only the shard persists; a unit's full parameters are all-gathered
//           before use (the next unit prefetched) and their memory released after (forward) and
//           after their gradients are ready (backward). Units are then the model's blocks. With
//           bf16 compute copies the fp32 shard is the master: it is cast and gathered into the
//           unit's bf16 copy, the leaves' bf16 gradients are reduce-scattered in bf16.
//
// Threads: the training thread calls everything. Data-parallel collectives (reductions, gathers,
// loss and norm all-reduces) run in order on one reduction thread that owns the dp communicator,
// so they overlap backward; the hooks that launch them run on the thread running backward (the
// training thread on CPU, autograd's device thread on CUDA), so every dp rank queues them in the
// same order. On CUDA they run on a stream of their own (see ReductionQueue). Where other
// communicators have collectives in flight at the same time on GPUs (exclusive_collectives), they
// are issued inline instead, in the asking thread's order, still on the stream of their own.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <torch/types.h>
#include <torch/csrc/autograd/function.h>

#include "common/status.h"
#include "worker/comm/communicator.h"
#include "worker/plan/flat_layout.h"
#include "worker/torch_compat.h"

namespace ltrain::worker {

// Whether the reduction queues made from now on run their collectives on a high-priority CUDA stream
// (LTRAIN_DP_HIGH_PRIORITY=1; set once at start).
void SetCollectiveStreamPriority(bool high);

// Runs jobs one after another on a thread of its own (or inline, by the enqueuing thread, when made
// with threaded=false). On CUDA with own_stream the jobs run on a stream of their own, so that
// collectives overlap the computation: a job's kernels wait for what the enqueuing thread's stream
// had queued when it enqueued it, and Wait makes the waiting thread's stream wait for the job's
// kernels. Inline jobs on their own stream are issued in the enqueuing thread's order (one order
// on every rank) and still run beside the computation.
class ReductionQueue {
 public:
  ReductionQueue(bool threaded, const torch::Device& device, bool own_stream);
  ~ReductionQueue();
  ReductionQueue(const ReductionQueue&) = delete;
  ReductionQueue& operator=(const ReductionQueue&) = delete;

  int64_t Enqueue(std::function<Status()> job);
  // Waits for job `id` (and everything queued before it); returns the first error of any job.
  Status Wait(int64_t id);
  Status WaitAll();
  // Waits for every job, then forgets the first error: the group it failed in was re-formed.
  void ClearError();
  // Whether jobs run apart from the computation: on CUDA on a stream of their own (not the thread's
  // current stream, LibTorch's legacy default stream), elsewhere on a thread of their own.
  bool apart() const { return device_.is_cuda() ? side_ != nullptr : threaded_; }

 private:
  void Loop();

  bool threaded_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::pair<int64_t, std::function<Status()>>> jobs_;
  int64_t next_id_ = 1;
  int64_t done_id_ = 0;
  Status error_;
  torch::Device device_;
  std::unique_ptr<compat::SideStream> side_;  // only where it is a CUDA stream
  std::map<int64_t, compat::StreamMarker> finished_;  // the side stream after each job

  bool stop_ = false;
  std::thread thread_;
};

struct AdamWConfig {
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double weight_decay = 0.0;
};

struct MemoryBytes {
  int64_t params = 0;
  int64_t grads = 0;
  int64_t optimizer = 0;
};

// Flattened elements [begin, begin + values.numel()) of a parameter's state, as read from a
// checkpoint (a whole parameter is begin 0).
struct RangeValues {
  RangeValues(torch::Tensor v, int64_t b = 0) : values(std::move(v)), begin(b) {}  // NOLINT: a whole tensor converts
  torch::Tensor values;
  int64_t begin = 0;
  int64_t end() const { return begin + values.numel(); }
};

class ParamStore {
 public:
  struct Param {
    torch::Tensor* value;  // the model's leaf; the store re-points it into its flat buffer
    bool decay = false;
    bool counts_for_norm = true;
    // Its gradient comes only from the fused products (bf16 on CUDA), which overwrite it on their
    // first write of a step: ZeroGrads leaves it unzeroed (MarkGradientsStale), FinishBackward
    // zeroes it if no product wrote it.
    bool product_grad = false;
    // Expert parallelism: one rank's experts of a stack split over the ranks of an expert-parallel
    // group. Its units are reduced (and sharded) over `expert_dp` (Create), not the whole dp group;
    // checkpoints place its elements at `saved_offset` of `saved_numel` (the stack of every rank's
    // experts), so that they do not depend on the expert-parallel degree.
    bool expert = false;
    int64_t saved_offset = 0;
    int64_t saved_numel = 0;  // 0: the parameter's own size
  };

  // `units`: a partition of param indices (each ascending), in the order backward completes them.
  // `bf16_compute`: the leaves become bf16 copies of fp32 master parameters, their gradients bf16;
  // the optimizer updates the masters and refreshes the copies (mixed precision without autocast's
  // casts in every forward and backward). Under zero 3 the copies are what is gathered.
  // `exclusive_collectives`: other communicators (tensor, pipeline parallel) run collectives while
  // the data-parallel ones would be in flight, on a GPU. NCCL kernels of two communicators issued
  // from two threads can then wait on each other across ranks and hang (NCCL's documentation:
  // concurrent communicators need one issue order on every rank), so the data-parallel collectives
  // are issued inline, by the thread that asks for them, in its order; on CUDA they still run on a
  // stream of their own beside the computation (`inline_on_own_stream`; false: on the asking
  // thread's stream, LTRAIN_DP_SIDE_STREAM=0).
  // `expert_dp`: the group over which the units of expert parameters (Param::expert; a unit holds
  // either only those or none) are reduced and sharded, the ranks holding the same experts (dp
  // itself where null). It runs its collectives on the same queue, in the same order on every rank.
  static StatusOr<std::unique_ptr<ParamStore>> Create(std::vector<Param> params, const std::vector<std::vector<int>>& units,
                                                      int zero, Communicator* dp, AdamWConfig adamw,
                                                      bool bf16_compute = false, bool exclusive_collectives = false,
                                                      bool inline_on_own_stream = true,
                                                      Communicator* expert_dp = nullptr);
  ~ParamStore();

  // Every dp rank starts from rank 0's parameters (zero < 3; under zero 3 every rank built the
  // same model and keeps only its shard).
  Status BroadcastParameters();
  // Copies dp rank `root`'s whole training state (parameters and both moments) to every dp rank:
  // how a rank that replaces a failed one is filled from a peer's memory (worker/recovery). Without
  // ZeRO only: a sharded state has no whole copy on any one rank (FailedPrecondition).
  Status BroadcastState(int root);
  // Under ZeRO 1 and 2, what this rank alone holds of the training state (worker/recovery's memory
  // copies): per unit, its owned masters and both moments, views in a fixed order. Writing them and
  // then GatherOwned() sets the state; every rank's masters outside its shard follow from the others'.
  std::vector<torch::Tensor> OwnedState();
  Status GatherOwned();
  // After a step that failed in a collective of a group since re-formed (worker/recovery): waits
  // for every queued collective and forgets their failure; the next ZeroGrads starts the step anew.
  void ClearFailure();

  // Before a step: zero the gradients (ZeRO-3 on CUDA: drop them; and start gathering the first unit).
  // `one_backward`: the step runs one backward, so nothing adds to a ZeRO-2/3 gradient shard after
  // its reduction: on CUDA a unit whose gradients share one buffer (ZeRO-3) keeps its shard in that
  // buffer's dtype (bf16 with bf16 copies), the reduction's mean written straight into it.
  void ZeroGrads(bool one_backward = false);
  // Before a backward: whether hooks reduce each unit as its gradients complete (zero 0/1: the last
  // micro-step only; zero 2/3: every micro-step). Without hooks call ReduceAll after backward.
  void ArmHooks(bool armed);
  // After a backward: waits for the launched reductions (launching any unit not yet launched when
  // hooks were armed); zero >= 2 then drops the full gradients.
  Status FinishBackward();
  // Reduces every unit now (pipeline schedules, sequence parallelism: after all micro-batches).
  Status ReduceAll();

  // Sum of squares of the gradient elements this rank counts (its shard under zero >= 1).
  // A [1] double tensor on the gradients' device (no host synchronization). With expert units
  // (Param::expert) without ZeRO, each unit's sum is divided by the ranks holding the same elements
  // (dp, or expert_dp's size), so that the sum over dp counts every element once: the caller
  // all-reduces it over dp whenever zero >= 1 or has_expert_units().
  bool has_expert_units() const { return expert_units_; }
  torch::Tensor GradSquareSum();
  // AdamW on the owned elements with gradients scaled by grad_scale (clipping); zero 1/2 then
  // all-gather the updated parameters. `step` is 1-based.
  // `grad_divisor` (optional, a float scalar on the device): gradients are divided by it (clipping
  // computed on the device, without a host synchronization).
  // `defer_compute`: with a sharded update (sharded_update()), the all-gathers of the bf16 copies are
  // left in flight (issued in forward order) and the caller awaits each unit's before using it
  // (AwaitCompute), so that they overlap the next forward. Where can_defer_update(), the updates
  // themselves run so, unit by unit on a stream of their own, each unit's non-product gradients
  // zeroed after its update (ZeroGrads then leaves them).
  // Under zero 3 each unit's update is left to its next gather (Prefetch), whose job runs it on the
  // collectives' stream just before gathering, beside the computation of the unit before it (the
  // step's AdamW off the critical path); AwaitUpdates runs those still pending.
  Status OptimizerStep(double lr, double grad_scale, int64_t step, const torch::Tensor& grad_divisor = {},
                       bool defer_compute = false);
  // zero 1/2, bf16 compute copies, dp > 1: the update writes the owned part of the copies, which are
  // then all-gathered (in bf16, not the fp32 masters); zero 1 reduce-scatters its gradients.
  bool sharded_update() const;
  // zero 0 with our AdamW kernel (bf16 copies on CUDA): the update can run beside the next forward.
  bool can_defer_update() const;
  // The current stream waits for every unit's deferred work (before reading the parameters or the
  // optimizer state outside a forward: checkpoints, evaluation, export).
  Status AwaitUpdates();
  // The current stream waits for unit `u`'s deferred all-gather of its bf16 copies (a no-op when
  // none is in flight).
  Status AwaitCompute(int u);
  // The unit of the store that holds parameter `param`.
  int unit_of(int param) const { return unit_of_[param]; }

  // zero 1/2 with bf16 compute copies: all-gathers the fp32 masters, which the optimizer updated only
  // in this rank's shard. ModelState and MasterValue read the masters: call it (on every dp rank)
  // before them. A no-op when the masters are current.
  Status SyncMasters();

  // Sum over dp of a small tensor, on the reduction thread.
  Status DpAllReduce(torch::Tensor& tensor);

  // zero 3: make unit `u`'s full parameters available (waits for a prefetch), start gathering one
  // ahead, release one. No-ops below zero 3.
  Status Gather(int u);
  void Prefetch(int u);
  void Release(int u);
  // zero 3, before unit `u`'s backward (hooks armed): its gradients go into one buffer in the
  // leaves' dtype (the products add into it), reduce-scattered as it is, without a copy into a
  // buffer of its own first; with bf16 copies in bf16, like the other stages' bf16 gradients. A
  // no-op otherwise. Units whose backward it does not precede are copied into an fp32 buffer.
  // With transient gradients (UseTransientGradients), the unit's buffer is made if it has none: the
  // gradients autograd already gave its leaves copied in, those only the products write left to
  // their first write (MarkGradientsStale), the rest zeroed.
  void PrepareGradients(int u);
  // zero 0 with every unit over one rank (nothing to reduce): each unit's gradient buffer is made
  // when backward reaches the unit (PrepareGradients, from the model's hooks; for a unit no hook
  // prepared, by FinishBackward from what autograd left in its leaves) and released once the
  // optimizer has read it (by a deferred update on its stream, after the update), so that forward
  // runs without the model's gradients, as PyTorch's after zero_grad(set_to_none=True). Returns
  // whether it applies. Call it once, after Create.
  bool UseTransientGradients();
  bool transient_gradients() const { return transient_; }
  // zero 3: unit `u`'s fp32 values, all-gathered (MasterValue reads them) until ReleaseMasterUnit.
  // With bf16 copies these are apart from the copies Gather makes; without, the same as Gather.
  Status GatherMasterUnit(int u);
  void ReleaseMasterUnit(int u);
  // zero 3 with bf16 copies over more than one rank: each unit is gathered into a slot of memory the
  // dp ranks write into directly (Communicator::AllocateSymmetric), kept from step to step and
  // reused by the units in turn, so that the all-gathers run on the copy engines and leave the SMs
  // to the computation. Returns whether it applies. Slots are made as the first step needs them (as
  // many as units are gathered at once); symmetric_bytes() is their total. Where the communicator
  // has no such memory the units gather as without this call (warning where NCCL fails to make it).
  // zero 1/2 with a sharded update (sharded_update()): the kept bf16 copies move into one region of
  // such memory, where their all-gathers after each update run the same way.
  // Not where the collectives run on the computation's stream (exclusive_collectives without a
  // stream of their own): NCCL's copy-engine collectives refuse the legacy default stream.
  bool UseSymmetricGathers();
  int64_t symmetric_bytes() const;
  int zero() const { return zero_; }
  int units() const { return static_cast<int>(units_.size()); }

  MemoryBytes Memory() const;

  // Checkpoint state by parameter (`names` in the store's parameter order), this rank's share of it:
  // for each parameter the range of its flattened elements this rank saves ("range.<name>", int64
  // [begin, end): SaveRangeOfParam) and those elements ("model.<name>"; "exp_avg.<name>" and
  // "exp_avg_sq.<name>"), flattened fp32. The ranks of a dp group save disjoint ranges that cover
  // each parameter once, so a save writes every byte once, spread over the group. Host copies (on
  // CUDA pinned memory, copied without blocking and awaited once), safe to keep while training goes
  // on. Every key is present, with an empty range where this rank saves none of a parameter.
  std::vector<std::pair<std::string, torch::Tensor>> ModelState(const std::vector<std::string>& names) const;
  std::vector<std::pair<std::string, torch::Tensor>> OptimizerState(const std::vector<std::string>& names) const;
  // The part of parameter `param` (flattened) this rank saves: its ZeRO shard, or without ZeRO its
  // dp rank's part of dp equal parts.
  Range SaveRangeOfParam(int param) const;
  // The part of parameter `param` (flattened) this rank needs from a checkpoint: of the value
  // (`moments` false) all of it unless ZeRO-3 shards it, of the moments its ZeRO shard. With
  // `gather_masters` (see CanGatherMasters) only the ZeRO shard of the value too: GatherMasters
  // fills in the rest from the other dp ranks.
  Range LoadRangeOfParam(int param, bool moments, bool gather_masters = false) const;
  // zero 1/2 over more than one dp rank: every rank keeps full fp32 masters but owns a shard of
  // them, so a checkpoint of the same layout can be loaded shard by shard (each rank reads only its
  // own file) and the masters all-gathered over dp (GatherMasters).
  bool CanGatherMasters() const { return (zero_ == 1 || zero_ == 2) && dp_->size() > 1; }
  // Host memory the snapshots copy into, kept from save to save. On CUDA it is pinned, and pinning
  // gigabytes takes seconds: ReserveSnapshot (at start-up) sizes it for this rank's share
  // (ModelState and OptimizerState) and returns its bytes; BeginSnapshot starts the next snapshot at
  // its front, so the previous one must be written by then. Without a reservation (and on the CPU)
  // every snapshot allocates its own copies.
  int64_t ReserveSnapshot();
  void BeginSnapshot() const { snapshot_used_ = 0; }
  // `numel` fp32 elements of the reserved snapshot memory, after those taken since BeginSnapshot;
  // an undefined tensor when it has no room (or none is reserved). A resume reads into it.
  torch::Tensor TakeSnapshotMemory(int64_t numel) const;
  // Loads parameter `param` from its flattened value and moments (any layout's checkpoint,
  // reassembled), each covering at least LoadRangeOfParam's range: keeps the part this rank holds.
  // With `gather_masters` only the owned part of the master is written; GatherMasters, on every
  // dp rank once every parameter is loaded, completes the masters and their bf16 copies.
  Status LoadParamState(int param, const RangeValues& value, const RangeValues& exp_avg, const RangeValues& exp_avg_sq,
                        bool gather_masters = false);
  // One of the three parts of LoadParamState, alone (a resume places each as soon as it is read).
  enum class StatePart { kValue, kExpAvg, kExpAvgSq };
  Status LoadParamPart(int param, StatePart part, const RangeValues& t, bool gather_masters = false);
  Status GatherMasters();
  int64_t ParamNumel(int param) const { return params_[param].value->numel(); }
  // The parameter's size in checkpoints (Param::saved_numel): the ranges SaveRangeOfParam and
  // LoadRangeOfParam give, and LoadParamPart takes, are within it.
  int64_t SavedNumel(int param) const {
    return params_[param].saved_numel > 0 ? params_[param].saved_numel : params_[param].value->numel();
  }
  // The fp32 value of parameter `param` as the optimizer holds it (zero 0-2: the master; zero 3:
  // valid while GatherMasterUnit holds its unit).
  torch::Tensor MasterValue(int param) const;

 private:
  // A snapshot's fp32 host copy of `t`, flattened: on CUDA queued without waiting (into the
  // reserved arena while it has room), on the CPU a plain copy.
  torch::Tensor HostCopy(const torch::Tensor& t) const;

  struct Unit {
    UnitLayout layout;
    Communicator* comm = nullptr;  // dp, or expert_dp for a unit of expert parameters
    torch::Tensor full;        // [padded] parameters (zero 3: storage released when not gathered)
    torch::Tensor compute;     // bf16_compute: [padded] bf16 copy of `full`, what the leaves view
    torch::Tensor shard;       // zero 3: [shard] persistent parameters
    torch::Tensor grad_full;   // zero < 2: [padded] gradients; the leaves' .grad are views of it
    torch::Tensor grad_shard;  // zero >= 2: [shard] (on CUDA from the step's first reduction to ZeroGrads)
    bool shard_written = false;  // zero >= 2: a reduction of this step wrote grad_shard (later ones add)
    torch::Tensor grad_flat;   // zero 3: [padded] gradients of one backward (PrepareGradients)
    torch::Tensor exp_avg, exp_avg_sq;
    int pending = 0;           // parameters whose gradient is not ready yet in this backward
    bool launched = false;
    bool gathered = true;
    int64_t gather_job = 0;    // zero 3: in-flight gather
    int64_t compute_job = 0;   // sharded update: the deferred all-gather of the bf16 copies
    int64_t update_job = 0;    // deferred update: its job on update_queue_
    bool grads_zeroed = false;  // the deferred update zeroed its non-product gradients
    // zero 3, deferred: the step's update of this unit runs in its next gather's job, before the
    // gather, on the gradients kept here.
    bool update_pending = false;
    torch::Tensor pending_grad;
    int slot = -1;  // UseSymmetricGathers: the slot its bf16 copy is gathered into while gathered
  };
  struct Slot {
    torch::Tensor memory;  // uint8, symmetric over the dp ranks
    int unit = -1;         // the unit in it; -1 when free
  };

  // What a zero-3 update left to each unit's next gather needs of its step.
  struct DeferredUpdate {
    double lr = 0, grad_scale = 1;
    int64_t step = 0;
    torch::Tensor grad_divisor;  // as OptimizerStep got it
    torch::Tensor divisor;       // for the fused kernels: grad_divisor / grad_scale as one fp32 scalar
    bool own_kernel = false;
  };

  ParamStore(std::vector<Param> params, int zero, Communicator* dp, AdamWConfig adamw);
  void OnGradReady(int param);
  // AdamW on the owned elements of `units` with their gradients, where our kernel does not serve:
  // one fused LibTorch kernel per weight-decay class on CUDA, torch::optim::AdamW's arithmetic on the CPU.
  void UpdateComposite(const std::vector<std::pair<Unit*, torch::Tensor>>& units, const DeferredUpdate& u);
  // Applies `u` to `unit`, whose gradient shard is `grad` (zero 3, deferred; on the calling thread's
  // stream). Where `copy` is defined (the owned part of the unit's bf16 copy) and our kernel runs, it
  // also writes the updated values there in bf16: returns whether it did.
  bool ApplyDeferred(Unit& unit, const torch::Tensor& grad, const DeferredUpdate& u, const torch::Tensor& copy);
  // The unit's pending update as a job's first part (empty where none), which the unit then no longer
  // holds; called with ApplyDeferred's `copy`, it returns whether it wrote it.
  std::function<bool(const torch::Tensor&)> TakePendingUpdate(Unit& unit);
  // bf16_compute: the leaves' bf16 copies take the masters' values.
  void RefreshCompute();
  // Our AdamW kernel over the unit's owned elements (one launch per run of adjacent parameters of one
  // weight-decay class), writing the bf16 copies where they are kept.
  void UpdateUnit(Unit& unit, const torch::Tensor& grad, const AdamWConfig& adamw, double lr, double b1, double b2,
                  int64_t step, const torch::Tensor& divisor, const torch::Tensor& copy_into = {});
  // zero < 2: zeroes the unit's gradients (`zero`) except those only the products write, which go to
  // `stale` (when not null) for MarkGradientsStale.
  void ZeroUnitGrads(Unit& unit, bool zero, std::vector<torch::Tensor>* stale);
  // Transient gradients: makes the unit's buffer (PrepareGradients) unless it has one; `in_backward`
  // false (after backward) zeroes the product-only gradients autograd did not give, as no product
  // will write them now.
  void MakeGradients(Unit& unit, bool in_backward);
  void MakeAllGradients();
  // Transient gradients: the unit and its leaves let go of the buffer.
  void DropGradients(Unit& unit);
  torch::Tensor OwnedCompute(Unit& unit);
  int64_t OffsetInUnit(int param) const;
  // zero 3: allocates the unit's fp32 values and queues their all-gather from the shards; the job.
  int64_t GatherFp32(Unit& unit, const std::function<void()>& before = {});
  // Calls fn(parameter, at, n) for every parameter of `unit` with elements in this rank's owned
  // range: they are the n elements from `at` on, counted within the owned range.
  void ForEachOwned(const Unit& unit, const std::function<void(const Param&, int64_t at, int64_t n)>& fn) const;
  void Launch(int u);
  Range Owned(const Unit& unit) const;
  // The elements of parameter `param` (relative to the parameter) that Owned() covers.
  Range OwnedOfParam(int param) const;
  // SaveRangeOfParam and LoadRangeOfParam within the parameter itself (without saved_offset).
  Range LocalSaveRange(int param) const;
  Range LocalLoadRange(int param, bool moments, bool gather_masters) const;
  // Where those elements start within the unit's owned range (its shard, moments); 0 when none.
  int64_t OwnedAt(int param) const;
  torch::Tensor OwnedGrad(Unit& unit);
  torch::Tensor OwnedParam(Unit& unit);

  std::vector<Param> params_;
  std::vector<int> unit_of_;
  std::vector<Unit> units_;
  torch::Tensor snapshot_arena_;          // fp32 [reserved], pinned (ReserveSnapshot)
  mutable int64_t snapshot_used_ = 0;
  int zero_;
  Communicator* dp_;
  bool expert_units_ = false;  // some unit is reduced over expert_dp
  AdamWConfig adamw_;
  bool armed_ = false;
  bool one_backward_ = false;  // ZeroGrads(one_backward) of this step
  bool masters_stale_ = false;  // ShardedUpdate: the masters outside the owned shard lag behind
  bool transient_ = false;      // UseTransientGradients
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators_;  // keeps the hooks alive
  // UseSymmetricGathers: points unit `u`'s bf16 copy at a free slot of `bytes` or more, making one
  // where none fits. A no-op otherwise, and where no slot can be made (gathers then stop using them).
  void TakeSlot(int u, size_t bytes);
  // `bytes` of the dp communicator's symmetric memory (Communicator::AllocateSymmetric), made in the
  // collectives' order; undefined where it has none or cannot make it (warned of, unless it has none).
  torch::Tensor MakeSymmetric(int64_t bytes);
  bool symmetric_gathers_ = false;
  std::vector<Slot> slots_;
  torch::Tensor copies_region_;  // zero 1/2, UseSymmetricGathers: where the bf16 copies live
  std::unique_ptr<ReductionQueue> queue_;
  std::unique_ptr<ReductionQueue> update_queue_;  // deferred updates: a thread and a stream of their own
  torch::Tensor update_divisor_;                   // kept alive while deferred updates read it
  DeferredUpdate deferred_;                         // zero 3: the last step's, while units hold it pending
};

}  // namespace ltrain::worker
