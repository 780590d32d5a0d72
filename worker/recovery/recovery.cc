#include "worker/recovery/recovery.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string_view>

#include <ATen/ATen.h>

#include "worker/control/progress.h"
#include "worker/control/rendezvous_store.h"

namespace ltrain::worker {

StatusOr<SyncPlan> PlanSync(const std::vector<MemberState>& members, const std::vector<std::vector<int>>& replicas) {
  SyncPlan plan;
  for (size_t r = 0; r < members.size(); ++r) {
    if (members[r].has_state && (plan.source < 0 || members[r].step > plan.step)) {
      plan.source = static_cast<int>(r);
      plan.step = members[r].step;
    }
  }
  if (plan.source < 0) {
    return Internal("no member of the new membership holds a training state: every rank was replaced");
  }
  const int n = static_cast<int>(members.size());
  plan.source_of.assign(members.size(), -1);
  for (const std::vector<int>& group : replicas) {
    int source = -1;
    for (int r : group) {
      if (r < 0 || r >= n) return InvalidArgument("replica group names rank " + std::to_string(r) + " of " + std::to_string(n));
      if (source < 0 && members[r].has_state && members[r].step == plan.step) source = r;
    }
    if (source < 0) {
      std::string ranks;
      for (int r : group) ranks += (ranks.empty() ? "" : ",") + std::to_string(r);
      return Internal("no copy of the training state of ranks " + ranks + " at step " + std::to_string(plan.step) +
                      " survived in memory: the job restarts from its last checkpoint");
    }
    for (int r : group) plan.source_of[r] = source;
  }
  for (int r = 0; r < n; ++r) {
    if (plan.source_of[r] < 0) return InvalidArgument("rank " + std::to_string(r) + " is in no replica group");
    if (!members[r].has_state || members[r].step != plan.step) plan.behind.push_back(r);
  }
  plan.needed = !plan.behind.empty();
  return plan;
}

std::vector<int> MembersOf(const std::string& announcement) {
  constexpr std::string_view kMembers = "; members ";
  const size_t at = announcement.find(kMembers);
  if (at == std::string::npos) return {};
  std::vector<int> members;
  const char* p = announcement.c_str() + at + kMembers.size();
  while (*p != '\0') {
    char* end = nullptr;
    const long r = std::strtol(p, &end, 10);
    if (end == p || r < 0) return {};
    members.push_back(static_cast<int>(r));
    if (*end != ',') break;
    p = end + 1;
  }
  return members;
}

Status BroadcastHost(Communicator& comm, at::Tensor& host, int root, const at::Device& device) {
  if (!device.is_cuda()) return comm.Broadcast(host, root);
  at::Tensor staged = host.to(device);
  LTRAIN_RETURN_IF_ERROR(comm.Broadcast(staged, root));
  host.copy_(staged);
  return comm.Health();
}

Status AllGatherHost(Communicator& comm, const at::Tensor& host, at::Tensor& out, const at::Device& device) {
  if (!device.is_cuda()) return comm.AllGather(host, out);
  at::Tensor gathered = at::empty(out.sizes(), out.options().device(device));
  LTRAIN_RETURN_IF_ERROR(comm.AllGather(host.to(device), gathered));
  out.copy_(gathered);
  return comm.Health();
}

Recovery::Recovery(Hooks hooks, int rank, int epoch, std::chrono::milliseconds timeout, at::Device device)
    : hooks_(std::move(hooks)), rank_(rank), epoch_(epoch), replacement_(epoch > 0), timeout_(timeout), device_(device) {}

bool Recovery::Recoverable(const Status& failure) { return failure.code() == StatusCode::kUnavailable; }

Status Recovery::Reform(const Status& failure) {
  const auto start = std::chrono::steady_clock::now();
  std::printf("rank %d: %s; keeping this process and waiting for membership %d\n", rank_, failure.message().c_str(),
              epoch_ + 1);
  std::fflush(stdout);
  Progress::Global().SetPhase(Progress::Global().Snapshot().step, "recovery");
  if (hooks_.abort) hooks_.abort();
  // The membership after this one; and, where a member of it died too before it formed, the next.
  for (int next = epoch_ + 1;; ++next) {
    StatusOr<std::string> membership = hooks_.await_membership(next, timeout_);
    if (!membership.ok()) {
      return Unavailable(failure.message() + "; and no new membership came: " + membership.status().message());
    }
    if (std::vector<int> members = MembersOf(*membership); !members.empty()) {
      epoch_ = next;
      ++recoveries_;
      members_ = std::move(members);
      std::printf("rank %d: membership %d (%s) goes on with %zu rank(s): this rank's groups are made again for them\n",
                  rank_, epoch_, membership->c_str(), members_.size());
      std::fflush(stdout);
      return Status::Ok();
    }
    Status joined = hooks_.reconnect(next);
    if (joined.ok()) {
      epoch_ = next;
      ++recoveries_;
      std::printf("rank %d: joined membership %d (%s) in %.0f ms\n", rank_, epoch_, membership->c_str(),
                  std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count());
      std::fflush(stdout);
      return Status::Ok();
    }
    if (!IsSupersededError(joined.message())) return joined;
    std::printf("rank %d: membership %d lost a member before it formed; joining membership %d\n", rank_, next,
                next + 1);
    std::fflush(stdout);
  }
}

StatusOr<SyncPlan> Recovery::Agree(Communicator& world, int64_t step, const std::vector<std::vector<int>>& replicas) {
  at::Tensor mine = at::tensor({step, static_cast<int64_t>(replacement_ ? 0 : 1)}, at::kLong);
  at::Tensor all = at::empty({2 * world.size()}, at::kLong);
  LTRAIN_RETURN_IF_ERROR(AllGatherHost(world, mine, all, device_));
  std::vector<MemberState> members(static_cast<size_t>(world.size()));
  const int64_t* v = all.data_ptr<int64_t>();
  for (size_t r = 0; r < members.size(); ++r) members[r] = MemberState{v[2 * r], v[2 * r + 1] != 0};
  return PlanSync(members, replicas);
}

Status Recovery::AgreeCopies(Communicator& world, int64_t step, const CopySteps& mine, std::vector<bool>* has_state,
                             std::vector<CopySteps>* members, int64_t* newest) {
  constexpr int kFields = 6;
  at::Tensor own = at::tensor({static_cast<int64_t>(replacement_ ? 0 : 1), step, mine.own[0], mine.own[1],
                               mine.held[0], mine.held[1]},
                              at::kLong);
  at::Tensor all = at::empty({kFields * world.size()}, at::kLong);
  LTRAIN_RETURN_IF_ERROR(AllGatherHost(world, own, all, device_));
  has_state->assign(static_cast<size_t>(world.size()), false);
  members->assign(static_cast<size_t>(world.size()), CopySteps{});
  *newest = 0;
  const int64_t* v = all.data_ptr<int64_t>();
  for (size_t r = 0; r < members->size(); ++r) {
    const int64_t* m = v + kFields * r;
    (*has_state)[r] = m[0] != 0;
    if (m[0] != 0) *newest = std::max(*newest, m[1]);
    (*members)[r].own = {m[2], m[3]};
    (*members)[r].held = {m[4], m[5]};
  }
  return Status::Ok();
}

}  // namespace ltrain::worker
