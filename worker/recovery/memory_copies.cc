#include "worker/recovery/memory_copies.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>

namespace ltrain::worker {
namespace {

// The share of the steps' time the copies aim at: 1.5%, so that copies slower than the mean (their
// times vary by a third) still keep the cost under 2%.
constexpr double kOverheadShare = 0.015;
// The automatic interval is chosen this many steps after the first copies (the first steps warm up).
constexpr int64_t kCalibrateAfter = 5;
constexpr int kLongestInterval = 100000;

std::string RanksText(const std::vector<int>& ranks) {
  std::string out;
  for (int r : ranks) out += (out.empty() ? "" : ",") + std::to_string(r);
  return out;
}

}  // namespace

StatusOr<ShardPlan> PlanShardedSync(const std::vector<bool>& has_state, const std::vector<CopySteps>& members,
                                    const std::vector<std::vector<int>>& groups) {
  const int n = static_cast<int>(members.size());
  if (has_state.size() != members.size()) return InvalidArgument("PlanShardedSync: members and states differ in number");
  std::vector<int> group_of(members.size(), -1);
  for (size_t g = 0; g < groups.size(); ++g) {
    for (int r : groups[g]) {
      if (r < 0 || r >= n) return InvalidArgument("group names rank " + std::to_string(r) + " of " + std::to_string(n));
      if (group_of[r] >= 0) return InvalidArgument("rank " + std::to_string(r) + " is in two groups");
      group_of[r] = static_cast<int>(g);
    }
  }
  for (int r = 0; r < n; ++r) {
    if (group_of[r] < 0) return InvalidArgument("rank " + std::to_string(r) + " is in no data-parallel group");
  }
  // Every step a member holding a state keeps a copy of, newest first.
  std::vector<int64_t> candidates;
  for (int r = 0; r < n; ++r) {
    if (!has_state[r]) continue;
    for (int64_t s : members[r].own) candidates.push_back(s);
    for (int64_t s : members[r].held) candidates.push_back(s);
  }
  candidates.erase(std::remove(candidates.begin(), candidates.end(), int64_t{-1}), candidates.end());
  std::sort(candidates.rbegin(), candidates.rend());
  candidates.erase(std::unique(candidates.begin(), candidates.end()), candidates.end());
  std::string first_missing;  // of the newest step: what was lost
  for (int64_t step : candidates) {
    ShardPlan plan;
    plan.step = step;
    plan.fill_from.assign(members.size(), -1);
    std::string missing;
    for (const std::vector<int>& group : groups) {
      const size_t size = group.size();
      for (size_t i = 0; i < size && missing.empty(); ++i) {
        const int r = group[i];
        if (has_state[r] && members[r].Owns(step)) continue;
        const int holder = group[(i + 1) % size];
        if (holder != r && has_state[holder] && members[holder].Holds(step)) {
          plan.fill_from[r] = holder;
          continue;
        }
        missing = "rank " + std::to_string(r) + "'s shard (its copy was on rank " + std::to_string(holder) + ")";
      }
    }
    for (int r = 0; r < n && missing.empty() && plan.meta_source < 0; ++r) {
      if (has_state[r] && members[r].Owns(step)) plan.meta_source = r;
    }
    if (missing.empty() && plan.meta_source < 0) missing = "every member's own copy";
    if (missing.empty()) return plan;
    if (first_missing.empty()) first_missing = missing + " at step " + std::to_string(step);
  }
  std::vector<int> without;
  for (int r = 0; r < n; ++r) {
    if (!has_state[r]) without.push_back(r);
  }
  if (candidates.empty()) {
    return Internal("no member holds a copy of the sharded training state in memory (ranks without a state: " +
                    RanksText(without) + "): the job restarts from its last checkpoint");
  }
  return Internal("no copy of " + first_missing + " or of any older step survived in memory (ranks without a state: " +
                  RanksText(without) + "): the job restarts from its last checkpoint");
}

MemoryCopies::MemoryCopies(int every) : every_(std::max(0, every)), automatic_(every <= 0) {}

bool MemoryCopies::Due(int64_t step) const {
  if (every_ > 0) return step % every_ == 0;
  return step == calibrate_at_;
}

void MemoryCopies::NoteStep(double step_ms) {
  noted_steps_ms_ += step_ms;
  if (!automatic_ || calibrate_at_ < 0) return;
  step_ms_sum_ += step_ms;
  ++steps_noted_;
}

void MemoryCopies::SetEvery(int every, int64_t calibrate_at) {
  every_ = std::max(0, every);
  calibrate_at_ = calibrate_at;
  step_ms_sum_ = 0;
  steps_noted_ = 0;
  takes_ms_ = take_steps_ms_ = 0;
  takes_ = 0;
}

void MemoryCopies::Pack(const std::vector<at::Tensor>& state, at::Tensor& into) {
  int64_t at = 0;
  for (const at::Tensor& t : state) {
    into.narrow(0, at, t.numel()).copy_(t.reshape(-1));
    at += t.numel();
  }
}

void MemoryCopies::Unpack(const at::Tensor& from, const std::vector<at::Tensor>& state) {
  int64_t at = 0;
  for (const at::Tensor& t : state) {
    at::Tensor target = t;
    target.copy_(from.narrow(0, at, t.numel()).view(t.sizes()));
    at += t.numel();
  }
}

void MemoryCopies::RecordSteps() {
  for (size_t i = 0; i < 2; ++i) {
    steps_.own[i] = own_[i].step;
    steps_.held[i] = held_[i].step;
  }
}

Status MemoryCopies::Take(Communicator& group, Communicator& world, int64_t step, const std::vector<at::Tensor>& state,
                          const std::vector<at::Tensor>& meta) {
  const auto start = std::chrono::steady_clock::now();
  int64_t numel = 0;
  for (const at::Tensor& t : state) {
    if (t.scalar_type() != at::kFloat) {
      return FailedPrecondition("memory copies of the training state need fp32 parameters and moments");
    }
    numel += t.numel();
  }
  bytes_ = numel * 4;
  if (!state.empty()) device_ = state.front().device();
  // The slot of this step where one exists (a recovery takes its step again), else the older one.
  auto slot = [step](std::array<Copy, 2>& copies) -> Copy& {
    if (copies[1].step == step) return copies[1];
    if (copies[0].step == step) return copies[0];
    return copies[0].step <= copies[1].step ? copies[0] : copies[1];
  };
  Copy& mine = slot(own_);
  mine.step = -1;
  if (!mine.data.defined() || mine.data.numel() != numel) mine.data = at::empty({numel}, at::kFloat);
  Pack(state, mine.data);
  mine.meta.clear();
  for (const at::Tensor& t : meta) mine.meta.push_back(t.clone());
  mine.step = step;
  RecordSteps();
  if (group.size() > 1) {
    Copy& theirs = slot(held_);
    theirs.step = -1;
    RecordSteps();
    if (!theirs.data.defined() || theirs.data.numel() != numel) theirs.data = at::empty({numel}, at::kFloat);
    const int n = group.size(), next = (group.rank() + 1) % n, prev = (group.rank() + n - 1) % n;
    // Over a device's communicator (NCCL) the copies travel from and to device memory.
    const at::Device device = device_;
    const bool staged = device.is_cuda();
    at::Tensor into = staged ? at::empty({numel}, mine.data.options().device(device)) : theirs.data;
    LTRAIN_RETURN_IF_ERROR(group.SendRecv(staged ? mine.data.to(device) : mine.data, next, into, prev, kTag));
    if (staged) theirs.data.copy_(into);
    theirs.step = step;
    RecordSteps();
  }
  last_take_ms_ = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  ++taken_;
  taken_ms_ += last_take_ms_;
  if (!automatic_) return Status::Ok();
  if (every_ == 0 && calibrate_at_ < 0) {
    calibrate_at_ = step + kCalibrateAfter;
    step_ms_sum_ = 0;
    steps_noted_ = 0;
  } else if ((every_ == 0 && step == calibrate_at_) || (every_ > 0 && steps_noted_ > 0)) {
    // The same interval on every rank: the ranks' mean copy and step times.
    at::Tensor times = at::tensor({last_take_ms_, steps_noted_ > 0 ? step_ms_sum_ / steps_noted_ : 0.0}, at::kDouble);
    if (device_.is_cuda()) times = times.to(at::kFloat).to(device_);
    LTRAIN_RETURN_IF_ERROR(world.AllReduceSum(times));
    times = times.to(at::kCPU).to(at::kDouble);
    takes_ms_ += times[0].item<double>() / world.size();
    take_steps_ms_ += times[1].item<double>() / world.size();
    ++takes_;
    const double take_ms = takes_ms_ / takes_, step_ms = take_steps_ms_ / takes_;
    const int before = every_;
    every_ = step_ms > 0 ? static_cast<int>(std::min<double>(kLongestInterval, std::ceil(take_ms / (kOverheadShare * step_ms))))
                         : 1;
    every_ = std::max(1, every_);
    step_ms_sum_ = 0;
    steps_noted_ = 0;
    if (world.rank() == 0 && before == 0) {
      std::printf("memory copies: every %d step(s) (a copy of a rank's shard, %.1f MB, takes %.1f ms; a step %.1f ms)\n",
                  every_, static_cast<double>(bytes_) / 1e6, take_ms, step_ms);
      std::fflush(stdout);
    }
  }
  return Status::Ok();
}

bool MemoryCopies::RestoreOwn(int64_t step, const std::vector<at::Tensor>& state, std::vector<at::Tensor>* meta) const {
  for (const Copy& copy : own_) {
    if (copy.step != step || step < 0) continue;
    Unpack(copy.data, state);
    if (meta != nullptr) {
      for (size_t i = 0; i < meta->size() && i < copy.meta.size(); ++i) (*meta)[i].copy_(copy.meta[i]);
    }
    return true;
  }
  return false;
}

Status MemoryCopies::SendHeld(Communicator& group, int64_t step, int dst) {
  for (const Copy& copy : held_) {
    if (copy.step != step || step < 0) continue;
    return group.Send(device_.is_cuda() ? copy.data.to(device_) : copy.data, dst, kTag + 1);
  }
  return FailedPrecondition("this rank holds no copy of step " + std::to_string(step) + " to send");
}

Status MemoryCopies::ReceiveOwn(Communicator& group, int src, const std::vector<at::Tensor>& state) {
  int64_t numel = 0;
  for (const at::Tensor& t : state) numel += t.numel();
  const at::Device device = state.empty() ? at::Device(at::kCPU) : state.front().device();
  at::Tensor into = at::empty({numel}, at::TensorOptions().dtype(at::kFloat).device(device));
  LTRAIN_RETURN_IF_ERROR(group.Recv(into, src, kTag + 1));
  Unpack(into, state);
  bytes_ = numel * 4;
  return Status::Ok();
}

}  // namespace ltrain::worker
