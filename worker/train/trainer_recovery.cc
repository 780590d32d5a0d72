// The trainer's side of in-place recovery (part of Trainer, trainer.h; fault.recovery: in_place,
// worker/recovery): after a step failed because a peer died, the next membership, and the training
// state a member takes from its data-parallel peer before the step is redone.
#include <algorithm>
#include <cstdio>
#include <mutex>
#include <string>
#include <vector>

#include <ATen/CPUGeneratorImpl.h>

#include "worker/train/trainer.h"
#include "worker/train/trainer_internal.h"

namespace ltrain::worker {

Status Trainer::Recover(Status failure) {
  // The step's collectives that were queued are over (failed); the next ZeroGrads starts it anew.
  store_->ClearFailure();
  // So are its MoE blocks' route counts and router losses: the step counts them again.
  (void)model_->TakeRouteCounts();
  (void)model_->TakeRouterLosses();
  while (true) {
    LTRAIN_RETURN_IF_ERROR(options_.recovery->Reform(failure));
    if (Reshaped()) return Status::Ok();  // the caller goes on in the new membership's layout
    Status synced = SyncState();
    if (synced.ok() || !Recovery::Recoverable(synced)) return synced;
    failure = synced;  // a member died while the state went round: the next membership
  }
}

Status Trainer::SyncState() {
  if (copies_) return SyncShards();
  const auto start = SteadyClock::now();
  Recovery& recovery = *options_.recovery;
  // The ranks of a data-parallel group hold the same state (no ZeRO: InPlaceRecoveryProblem).
  std::vector<std::vector<int>> replicas;
  for (const Group& group : GroupsOf(layout_, GroupKind::kData)) replicas.push_back(group.ranks);
  LTRAIN_ASSIGN_OR_RETURN(SyncPlan plan, recovery.Agree(*groups_->world, step_, replicas));
  const int rank = groups_->rank;
  if (plan.needed) {
    Progress::Global().SetPhase(step_, "recovery");
    torch::Tensor position = torch::tensor({step_, data_position_}, torch::kLong);
    LTRAIN_RETURN_IF_ERROR(BroadcastHost(*groups_->world, position, plan.source, device_));
    // The CPU generator's state (data.sampling torch draws from its own): what a checkpoint keeps too.
    at::Generator gen = at::detail::getDefaultCPUGenerator();
    torch::Tensor rng;
    {
      std::lock_guard<std::mutex> lock(gen.mutex());
      rng = gen.get_state().clone();
    }
    LTRAIN_RETURN_IF_ERROR(BroadcastHost(*groups_->world, rng, plan.source, device_));
    // Each data-parallel group from its own source: the replicas of this rank's tp and pp part.
    const int source = plan.source_of[static_cast<size_t>(rank)];
    LTRAIN_RETURN_IF_ERROR(store_->BroadcastState(GroupOf(layout_, GroupKind::kData, rank).RankOf(source)));
    const bool behind = std::find(plan.behind.begin(), plan.behind.end(), rank) != plan.behind.end();
    if (behind) {
      std::lock_guard<std::mutex> lock(gen.mutex());
      gen.set_state(rng);
    }
    step_ = position[0].item<int64_t>();
    data_position_ = position[1].item<int64_t>();
    std::vector<int> takers;  // of this rank's state
    for (int r : plan.behind) {
      if (plan.source_of[static_cast<size_t>(r)] == rank) takers.push_back(r);
    }
    if (!takers.empty() || behind) {
      std::string what = "received the state of step " + std::to_string(step_) + " from rank " + std::to_string(source);
      if (!takers.empty()) {
        what = "sent the state of step " + std::to_string(step_) + " to rank(s)";
        for (size_t i = 0; i < takers.size(); ++i) what += (i == 0 ? " " : ",") + std::to_string(takers[i]);
      }
      const MemoryBytes mem = store_->Memory();
      const double ms = MillisSince(start);
      std::printf("rank %d: %s (%.1f MB of parameters and moments) in %.0f ms\n", rank, what.c_str(),
                  static_cast<double>(mem.params + mem.optimizer) / 1e6, ms);
      std::fflush(stdout);
      if (behind && recovery.replacement()) {
        // The members went on from the most steps any had completed: none is trained twice.
        Progress::Global().RecordRecovery(recovery.epoch(), step_, source, mem.params + mem.optimizer, ms, 0);
      }
    }
  }
  recovery.Synced();
  return Status::Ok();
}

Status Trainer::AdoptState(Trainer& from) {
  const auto start = SteadyClock::now();
  torch::NoGradGuard no_grad;
  if (options_.recovery == nullptr || !layout_.plain() || !from.layout_.plain()) {
    return Internal("only plain data parallelism goes on in place with fewer ranks");
  }
  LTRAIN_RETURN_IF_ERROR(from.store_->AwaitUpdates());
  std::vector<torch::Tensor> theirs = from.store_->OwnedState();
  std::vector<torch::Tensor> mine = store_->OwnedState();
  if (theirs.size() != mine.size()) return Internal("the trainers of two memberships hold different states");
  for (size_t i = 0; i < mine.size(); ++i) {
    if (theirs[i].sizes() != mine[i].sizes()) return Internal("the trainers of two memberships hold different states");
    mine[i].copy_(theirs[i]);
  }
  LTRAIN_RETURN_IF_ERROR(store_->GatherOwned());
  step_ = from.step_;
  data_position_ = from.data_position_;
  Recovery& recovery = *options_.recovery;
  recovery.Synced();
  // A member may have completed the step in flight before the others failed in it: the others take
  // its state, as after a replacement.
  Status synced = SyncState();
  if (!synced.ok() && Recovery::Recoverable(synced)) synced = Recover(synced);
  LTRAIN_RETURN_IF_ERROR(synced);
  run_start_step_ = step_;
  run_start_position_ = data_position_;
  const double ms = MillisSince(start);
  // What the coordinator's "went on" event reports (no peer's state was needed: source -1).
  Progress::Global().RecordRecovery(recovery.epoch(), step_, -1, 0, ms, 0);
  if (groups_->rank == 0) {
    std::printf("membership %d: %d rank(s) go on from step %lld, %d micro-batch(es) each a step (the global batch of %d)\n",
                recovery.epoch(), layout_.world_size, static_cast<long long>(step_), layout_.accumulation,
                layout_.global_batch);
    std::fflush(stdout);
  }
  return Status::Ok();
}

Status Trainer::CheckGroupsBeforeUpdate() {
  if (!device_.is_cuda()) return Status::Ok();  // Gloo's calls return once done, or with their failure
  compat::Synchronize(device_);
  for (Communicator* group : {groups_->world, groups_->tp, groups_->dp, groups_->pp, groups_->embedding, groups_->ep,
                               groups_->edp}) {
    LTRAIN_RETURN_IF_ERROR(group->Health());
  }
  return Status::Ok();
}

std::vector<torch::Tensor> Trainer::CopyMeta() const {
  at::Generator gen = at::detail::getDefaultCPUGenerator();
  torch::Tensor rng;
  {
    std::lock_guard<std::mutex> lock(gen.mutex());
    rng = gen.get_state().clone();
  }
  torch::Tensor position = torch::tensor({step_, data_position_, static_cast<int64_t>(copies_->every()), copies_->calibrate_at()},
                                         torch::kLong);
  return {position, rng};
}

Status Trainer::TakeCopies() {
  torch::NoGradGuard no_grad;
  LTRAIN_RETURN_IF_ERROR(store_->AwaitUpdates());
  return copies_->Take(*groups_->dp, *groups_->world, step_, store_->OwnedState(), CopyMeta());
}

Status Trainer::SyncShards() {
  const auto start = SteadyClock::now();
  torch::NoGradGuard no_grad;
  Recovery& recovery = *options_.recovery;
  std::vector<bool> has_state;
  std::vector<CopySteps> members;
  int64_t newest = 0;
  LTRAIN_RETURN_IF_ERROR(recovery.AgreeCopies(*groups_->world, step_, copies_->steps(), &has_state, &members, &newest));
  std::vector<std::vector<int>> groups;
  for (const Group& group : GroupsOf(layout_, GroupKind::kData)) groups.push_back(group.ranks);
  LTRAIN_ASSIGN_OR_RETURN(ShardPlan plan, PlanShardedSync(has_state, members, groups));
  const int rank = groups_->rank;
  Progress::Global().SetPhase(step_, "recovery");
  const Group dp = GroupOf(layout_, GroupKind::kData, rank);
  std::vector<torch::Tensor> state = store_->OwnedState();
  // The copies held for members that lost theirs go to them; then each member's own.
  std::vector<int> takers;
  for (int r : dp.ranks) {
    if (plan.fill_from[static_cast<size_t>(r)] != rank) continue;
    takers.push_back(r);
    LTRAIN_RETURN_IF_ERROR(copies_->SendHeld(*groups_->dp, plan.step, dp.RankOf(r)));
  }
  const int from = plan.fill_from[static_cast<size_t>(rank)];
  if (from >= 0) LTRAIN_RETURN_IF_ERROR(copies_->ReceiveOwn(*groups_->dp, dp.RankOf(from), state));
  LTRAIN_RETURN_IF_ERROR(groups_->dp->WaitSends());
  std::vector<torch::Tensor> meta = CopyMeta();
  if (from < 0 && !copies_->RestoreOwn(plan.step, state, &meta)) {
    return Internal("rank " + std::to_string(rank) + " lost its own copy of step " + std::to_string(plan.step));
  }
  // Step, data position and RNG as the copies were taken (the same on every member that took them).
  for (torch::Tensor& t : meta) LTRAIN_RETURN_IF_ERROR(BroadcastHost(*groups_->world, t, plan.meta_source, device_));
  const int64_t before = step_;
  const bool replacement = recovery.replacement();
  const int64_t* position = meta[0].data_ptr<int64_t>();
  step_ = position[0];
  data_position_ = position[1];
  copies_->SetEvery(static_cast<int>(position[2]), position[3]);
  {
    at::Generator gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(meta[1]);
  }
  // Every rank's masters outside its shard from their owners; then copies of the state gone back to.
  LTRAIN_RETURN_IF_ERROR(store_->GatherOwned());
  LTRAIN_RETURN_IF_ERROR(TakeCopies());
  std::string what;
  if (replacement || from >= 0) {
    what = "received its shard of step " + std::to_string(step_) + " from rank " + std::to_string(from) + "'s memory";
  } else {
    what = "went back to its copy of step " + std::to_string(step_);
    if (before > step_) what += " (" + std::to_string(before - step_) + " completed step(s) to train again)";
  }
  if (!takers.empty()) {
    what += "; sent the copy it held to rank(s)";
    for (size_t i = 0; i < takers.size(); ++i) what += (i == 0 ? " " : ",") + std::to_string(takers[i]);
  }
  const double ms = MillisSince(start);
  std::printf("rank %d: %s (%.1f MB of parameters and moments) in %.0f ms\n", rank, what.c_str(),
              static_cast<double>(copies_->bytes()) / 1e6, ms);
  std::fflush(stdout);
  if (replacement) {
    Progress::Global().RecordRecovery(recovery.epoch(), step_, from, copies_->bytes(), ms, std::max<int64_t>(0, newest - step_));
  }
  recovery.Synced();
  return Status::Ok();
}

}  // namespace ltrain::worker
