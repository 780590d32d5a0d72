// Recovery without restart (fault.recovery: in_place): what a rank does when a collective failed
// because a peer died, so that it keeps its process and the step in flight is redone once the
// failed rank's replacement has joined.
//
// The step loop's side is small:
//   - a step that failed with Recoverable(status) calls Reform(status): this rank closes its
//     connections (peers still blocked with it fail at once), waits for the coordinator's next
//     membership (its decision, announced through the rendezvous store), and connects the groups of
//     that membership beneath the communicators the model and the trainer hold;
//   - then, as the first collectives of every membership, Agree() tells each member who holds the
//     state to continue from (PlanSync), and the trainer sends or receives it (params, optimizer
//     state, step, data position, RNG) before it redoes the step.
// A replacement (LTRAIN_EPOCH above 0) calls Agree() before its first step, with no state of its own.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "common/status.h"
#include "worker/comm/communicator.h"
#include "worker/recovery/memory_copies.h"

namespace ltrain::worker {

// What one member brings to a membership: the steps it has completed, and whether it holds a
// training state at all (a replacement does not, until it receives one).
struct MemberState {
  int64_t step = 0;
  bool has_state = false;
};

struct SyncPlan {
  bool needed = false;      // some member has no state or is behind the others
  int source = -1;          // the member whose step, data position and RNG every member takes
  int64_t step = 0;         // the steps it has completed
  std::vector<int> source_of;  // by rank: the member of its replica group it takes its state from
  std::vector<int> behind;  // the members that take a state
};

// Pure. `replicas`: the groups of ranks that hold the same training state (the data-parallel groups:
// every rank in exactly one). The step to go on from is the highest any member holding a state has
// completed (a survivor whose last collective of the step in flight reached it before its peer died
// is ahead of those it did not reach: they take its state, and nobody redoes a step twice); each
// replica group takes its state from its lowest rank at that step, which `source` is for the world.
// Internal (the job restarts from its last checkpoint), naming the group, where no member of a group
// holds a state at that step: every copy of its part was lost.
StatusOr<SyncPlan> PlanSync(const std::vector<MemberState>& members, const std::vector<std::vector<int>>& replicas);

// The members of a membership the coordinator announced with fewer ranks ("epoch 2: ranks 2,3 left;
// members 0,1": ranks left with a lost node and none could replace them), in rank order; empty for a
// membership of every rank (a replacement's) or a text that names no members.
std::vector<int> MembersOf(const std::string& announcement);

// Collectives of host tensors (steps, data positions, RNG states) over a group whose backend takes
// device tensors (NCCL): staged through `device` and back, the result checked with Health() (the
// device copy back waited for the collective). On a CPU device, the collective itself.
Status BroadcastHost(Communicator& comm, at::Tensor& host, int root, const at::Device& device);
Status AllGatherHost(Communicator& comm, const at::Tensor& host, at::Tensor& out, const at::Device& device);

class Recovery {
 public:
  struct Hooks {
    // Closes this rank's connections of the current membership (Communicator::Abort of each group).
    std::function<void()> abort;
    // Blocks until the coordinator announced membership `epoch` (or `timeout` passed); its text.
    std::function<StatusOr<std::string>(int epoch, std::chrono::milliseconds timeout)> await_membership;
    // Connects this rank's groups in membership `epoch` and puts them under the trainer's communicators;
    // an error whose message IsSupersededError names when membership epoch + 1 was announced meanwhile.
    std::function<Status(int epoch)> reconnect;
  };

  // `epoch`: the membership this rank runs in now. `timeout`: how long a survivor waits for the next
  // one (the coordinator restarts the job instead when it cannot replace the failed rank). `device`:
  // where the ranks' collectives take their tensors.
  Recovery(Hooks hooks, int rank, int epoch, std::chrono::milliseconds timeout, at::Device device = at::kCPU);

  // A step that failed this way may be recovered: a collective failed because a peer went away.
  static bool Recoverable(const Status& failure);

  int epoch() const { return epoch_; }
  // This rank replaces a failed one and holds no state until Agree's plan has given it one.
  bool replacement() const { return replacement_; }
  int recoveries() const { return recoveries_; }

  // Abandons the membership the failure happened in, waits for the next one and joins it; where that
  // one lost a member before it formed (the connect ends "superseded", MembershipView), the next.
  // Where the next one has fewer ranks (MembersOf), it connects nothing: reshaped() says so, and the
  // rank goes on in that membership's layout (run_worker makes its groups and trainer again).
  Status Reform(const Status& failure);
  // The first collective of a membership, on every member: every member's state (this rank's
  // `step`, and whether it holds a state), gathered over `world`, and the plan to share one among
  // the `replicas` (PlanSync).
  StatusOr<SyncPlan> Agree(Communicator& world, int64_t step, const std::vector<std::vector<int>>& replicas);
  // The same first collective where the state is sharded (MemoryCopies): whether each member holds a
  // state, and the steps of the copies it keeps, gathered over `world`; `*newest`: the most steps a
  // member holding a state has completed (what going back to older copies loses).
  Status AgreeCopies(Communicator& world, int64_t step, const CopySteps& mine, std::vector<bool>* has_state,
                     std::vector<CopySteps>* members, int64_t* newest);
  // The plan was carried out: this rank holds the source's state.
  void Synced() { replacement_ = false; }
  // The membership Reform joined has fewer ranks: its members (original ranks, in order), until taken.
  bool reshaped() const { return !members_.empty(); }
  std::vector<int> TakeMembers() { return std::move(members_); }

 private:
  Hooks hooks_;
  int rank_;
  int epoch_;
  bool replacement_;
  std::chrono::milliseconds timeout_;
  at::Device device_;
  int recoveries_ = 0;
  std::vector<int> members_;
};

}  // namespace ltrain::worker
