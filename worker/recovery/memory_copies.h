// Copies of a sharded training state in peers' host memory (fault.recovery: in_place under ZeRO;
// fault.memory_checkpoint_every), so that a failed rank's part is filled from a peer, not storage.
//
// Under ZeRO each rank of a data-parallel group alone holds its shard of the optimizer moments (and
// the updated masters of its shard). Every `every` steps each rank copies its shard into its own host
// memory and sends it to the next rank of its group (rank i's copy is held by rank i+1 mod n), which
// keeps it; the last two copies of each are kept, so that a failure in the middle of an exchange
// leaves the one before it whole. After a failure the members agree (PlanShardedSync) on the newest
// step of which every shard survives, on its owner or on the rank after it, and go back to it: a
// survivor from its own copy, a replacement from the peer that holds its copy; the steps after it
// are trained again, with the same data, so deterministic losses are the uninterrupted run's.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include "common/status.h"
#include "worker/comm/communicator.h"

namespace ltrain::worker {

// The steps of the copies one member keeps: of its own shard, and of its predecessor's (-1: none).
struct CopySteps {
  std::array<int64_t, 2> own{-1, -1};
  std::array<int64_t, 2> held{-1, -1};
  bool Owns(int64_t step) const { return step >= 0 && (own[0] == step || own[1] == step); }
  bool Holds(int64_t step) const { return step >= 0 && (held[0] == step || held[1] == step); }
};

struct ShardPlan {
  int64_t step = -1;            // the copies' step every member goes back to
  int meta_source = -1;         // a member with its own copy of it (step, data position, RNG)
  std::vector<int> fill_from;   // by rank: -1, it restores its own copy; else the rank holding it
};

// Pure. `members[r]`: whether rank r holds a state (a replacement does not) and its copies' steps.
// `groups`: the data-parallel groups, each in its ranks' order (rank i's copy is on the rank after).
// Internal, naming the shard, where no step has every shard whole: the job restarts from storage.
StatusOr<ShardPlan> PlanShardedSync(const std::vector<bool>& has_state, const std::vector<CopySteps>& members,
                                    const std::vector<std::vector<int>>& groups);

class MemoryCopies {
 public:
  // `every`: steps between copies; 0: automatic, the smallest interval at which a copy costs at most
  // 2% of the time of the steps between copies: first chosen a few steps after the first copies, then
  // again at each copy, from the ranks' mean times of the copies and of the steps so far.
  explicit MemoryCopies(int every);

  int every() const { return every_; }
  const CopySteps& steps() const { return steps_; }
  // Whether the copies are due after `step` completed.
  bool Due(int64_t step) const;
  // Notes a step's time (for the choice of `every`).
  void NoteStep(double step_ms);
  // The interval as decided (a member joining takes the others' decision with their state).
  void SetEvery(int every, int64_t calibrate_at);
  int64_t calibrate_at() const { return calibrate_at_; }

  // Copies `state` (this rank's own tensors, fp32, same shapes every time) and `meta` (CPU tensors:
  // what goes back with it) into host memory as step `step`, then exchanges with `group`'s ring.
  // Where the interval is automatic (and past its first choice), the time of this exchange and of the
  // steps noted since the last decide it, the same on every rank (one all-reduce over `world`).
  Status Take(Communicator& group, Communicator& world, int64_t step, const std::vector<at::Tensor>& state,
              const std::vector<at::Tensor>& meta);
  // This rank's own copy of `step` back into `state` and its meta into `meta`; false where none.
  bool RestoreOwn(int64_t step, const std::vector<at::Tensor>& state, std::vector<at::Tensor>* meta) const;
  // The copy this rank holds of its predecessor's shard at `step`, sent to `dst` of `group`.
  Status SendHeld(Communicator& group, int64_t step, int dst);
  // Its own shard at a step received from `src` of `group` (the rank that holds its copy), into `state`.
  Status ReceiveOwn(Communicator& group, int src, const std::vector<at::Tensor>& state);

  int64_t bytes() const { return bytes_; }     // of one copy of this rank's shard
  double last_take_ms() const { return last_take_ms_; }
  // Over the run so far: the copies taken, their time, and the time of the steps noted.
  int taken() const { return taken_; }
  double taken_ms() const { return taken_ms_; }
  double noted_steps_ms() const { return noted_steps_ms_; }

  // The tag of the copies' messages (distinct from the pipeline's).
  static constexpr uint32_t kTag = 0x4d430000u;

 private:
  struct Copy {
    int64_t step = -1;
    at::Tensor data;               // fp32, host
    std::vector<at::Tensor> meta;  // own copies only
  };
  static void Pack(const std::vector<at::Tensor>& state, at::Tensor& into);
  static void Unpack(const at::Tensor& from, const std::vector<at::Tensor>& state);
  void RecordSteps();

  int every_;
  bool automatic_;
  int64_t calibrate_at_ = -1;  // every_ 0: the step whose copies choose it (-1: the first copies' + 3)
  std::array<Copy, 2> own_, held_;
  CopySteps steps_;
  at::Device device_ = at::Device(at::kCPU);  // of the state (CUDA: the copies travel from device memory)
  int64_t bytes_ = 0;
  double last_take_ms_ = 0;
  int taken_ = 0;
  double taken_ms_ = 0, noted_steps_ms_ = 0;
  double step_ms_sum_ = 0;  // of the steps noted since the last copies
  int steps_noted_ = 0;
  // The ranks' mean times (all-reduced, so the same on every rank) summed over the copies since the
  // interval was first chosen or the last recovery: what the automatic interval is chosen from.
  double takes_ms_ = 0, take_steps_ms_ = 0;
  int takes_ = 0;
};

}  // namespace ltrain::worker
