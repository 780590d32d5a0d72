// In-place recovery (fault.recovery: in_place): a failed rank is started again beside the ranks that
// survived it, which keep their processes; the coordinator decides each new membership and
// announces it through the generation's rendezvous keys. Part of Coordinator (coordinator.h).
//
// A membership is an epoch of the generation: 0 as placed, one more per replaced rank. The survivors
// of epoch E wait for the key "membership/E+1" (worker/recovery), connect their groups again under
// the prefix "epoch/E+1", and the replacement (LTRAIN_EPOCH=E+1) joins them there and takes its state
// from a peer's memory. The generation stays the same: nothing restarts, nothing reads a checkpoint.
#include <algorithm>
#include <cstdio>
#include <string>

#include "common/layout.h"
#include "common/logging.h"
#include "launcher/coordinator.h"

namespace ltrain::launcher {
namespace {

constexpr const char* kLog = "coordinator";

// "2,3" for {2, 3}.
std::string RankList(const std::vector<int>& ranks) {
  std::string out;
  for (int r : ranks) out += (out.empty() ? "" : ",") + std::to_string(r);
  return out;
}

}  // namespace

std::pair<std::string, std::string> Coordinator::ReplaceRankLocked(ActiveJob& job, int rank, const std::string& cause,
                                                                   std::string* why) {
  if (job.recipe.fault.recovery != Recovery::kInPlace) {
    *why = "fault.recovery is restart";
    return {};
  }
  if (std::string problem = InPlaceRecoveryProblem(job.recipe, job.job.world_size()); !problem.empty()) {
    *why = problem;
    return {};
  }
  if (!job.members.empty()) {
    *why = "ranks " + RankList(job.members) + " run without the ranks that left with a lost node, in a layout a "
           "replacement would not fit";
    return {};
  }
  // A failure while another rank is being replaced makes a membership after the one announced: the
  // members still connecting to that one give way to it (MembershipView), and where no copy of a
  // rank's state is left they say so, exit, and the job restarts from its checkpoint.
  if (job.job.restarts() >= job.recipe.fault.max_restarts) {
    *why = "the job has used its " + std::to_string(job.recipe.fault.max_restarts) +
           " restart(s) (fault.max_restarts; a replaced rank counts as one)";
    return {};
  }
  const int nproc = std::max(1, job.recipe.parallel.nproc_per_node);
  const size_t node_index = static_cast<size_t>(rank / nproc);
  if (node_index >= job.nodes.size()) {
    *why = "rank " + std::to_string(rank) + " has no node in this generation";
    return {};
  }
  auto node = nodes_.find(job.nodes[node_index]);
  if (node == nodes_.end() || !node->second.connected) {
    *why = "its node " + job.nodes[node_index] + " is not connected";
    return {};
  }
  // What the ranks had done when it failed: a recovery that goes back past it loses those steps.
  int64_t done = job.replacing_rank >= 0 ? job.replacing_from_step : 0;
  for (const auto& [r, progress] : job.progress) {
    if (progress.report.has_completed()) done = std::max(done, progress.report.completed().step());
  }
  job.replacing_from_step = done;
  const int epoch = ++job.epoch;
  job.job.set_membership_epoch(epoch);
  job.job.set_replacing_rank(rank);
  job.replacing_rank = rank;
  job.times.Restart();  // the new membership's first steps connect again
  job.replacing_since_ms = clock_->SteadyMs();
  // The replacement numbers its reports from 1 again.
  job.progress.erase(rank);
  job.ranks_exited_ok.erase(rank);
  job.job.set_restarts(job.job.restarts() + 1);
  job.job.set_last_failure(cause);
  job.failures.push_back("generation " + std::to_string(job.job.generation()) + " epoch " + std::to_string(epoch - 1) +
                         ": " + cause);
  QueueReplacementLocked(job, rank, node->second);
  v1::RankInfo info = job.ranks[rank];
  info.set_state("starting");
  info.set_pid(0);
  info.set_exit_code(0);
  info.set_signal(0);
  job.ranks[rank] = info;
  writer_.Enqueue("record rank " + std::to_string(rank) + " of " + job.job.id(),
                  [id = job.job.id(), info](StateStore& store) { return store.UpsertRank(id, info); });
  PersistJobLocked(job);
  AddEventLocked(job, "failure", "rank " + std::to_string(rank) + " failed: " + cause, rank);
  AddEventLocked(job, "recovering",
                 "replacing rank " + std::to_string(rank) + " in place on " + job.nodes[node_index] + " (membership epoch " +
                     std::to_string(epoch) + ", restart " + std::to_string(job.job.restarts()) + " of " +
                     std::to_string(job.recipe.fault.max_restarts) +
                     "): the other ranks keep their processes, the replacement takes its state from a peer's memory, "
                     "and the step in flight is redone",
                 rank);
  cv_.notify_all();
  const std::string key = job.placed.rendezvous_scope() + "/membership/" + std::to_string(epoch);
  return {key, "epoch " + std::to_string(epoch) + ": rank " + std::to_string(rank) + " replaced"};
}

void Coordinator::QueueReplacementLocked(ActiveJob& job, int rank, NodeState& node) {
  const int nproc = std::max(1, job.recipe.parallel.nproc_per_node);
  v1::Command command;
  v1::StartJobCommand* start = command.mutable_start();
  *start = job.placed;
  start->set_replace(true);
  start->set_epoch(job.epoch);
  start->set_restart_count(job.job.restarts());
  start->set_last_committed_step(job.job.last_committed_step());
  v1::WorkerAssignment* worker = start->add_workers();
  worker->set_rank(rank);
  worker->set_local_rank(rank % nproc);
  QueueCommandLocked(node, command);
}

bool Coordinator::ShrinkLocked(ActiveJob& job, const std::vector<int>& lost, const std::string& cause) {
  if (job.recipe.fault.recovery != Recovery::kInPlace || job.job.state() != v1::JOB_STATE_RUNNING || job.stopping) {
    return false;
  }
  std::vector<int> members = job.members;
  if (members.empty()) {
    for (int r = 0; r < job.job.world_size(); ++r) members.push_back(r);
  }
  std::vector<int> leaving;
  for (int r : lost) {
    auto at = std::find(members.begin(), members.end(), r);
    if (at == members.end()) continue;
    members.erase(at);
    leaving.push_back(r);
  }
  if (leaving.empty()) return true;  // they had left already
  std::string problem = ShrinkProblem(job.recipe, job.job.world_size(), static_cast<int>(members.size()));
  if (problem.empty() && job.replacing_rank >= 0) {
    problem = "rank " + std::to_string(job.replacing_rank) + " is being replaced";
  }
  if (!problem.empty()) {
    AddEventLocked(job, "recovery",
                   "ranks " + RankList(leaving) + " cannot be left out in place: " + problem + "; the job restarts", -1);
    return false;
  }
  const int epoch = ++job.epoch;
  job.job.set_membership_epoch(epoch);
  job.members = members;
  job.job.clear_members();
  for (int r : members) job.job.add_members(r);
  job.shrunk_since_ms = clock_->SteadyMs();
  job.times.Restart();
  int64_t done = 0;
  for (const auto& [r, progress] : job.progress) {
    if (progress.report.has_completed()) done = std::max(done, progress.report.completed().step());
  }
  job.replacing_from_step = done;
  for (int r : leaving) {
    // Done with the job: it succeeds once the members exit cleanly, and no hang is looked for in them.
    job.ranks_exited_ok.insert(r);
    job.progress.erase(r);
    v1::RankInfo info = job.ranks[r];
    info.set_state("left");
    job.ranks[r] = info;
    writer_.Enqueue("record rank " + std::to_string(r) + " of " + job.job.id(),
                    [id = job.job.id(), info](StateStore& store) { return store.UpsertRank(id, info); });
  }
  job.job.set_last_failure(cause);
  job.failures.push_back("generation " + std::to_string(job.job.generation()) + " epoch " + std::to_string(epoch - 1) +
                         ": " + cause);
  PersistJobLocked(job);
  const Layout before = *PlanLayout(job.recipe, job.job.world_size());
  const Layout after = *PlanLayout(job.recipe, static_cast<int>(members.size()));
  AddEventLocked(job, "recovering",
                 cause + ": ranks " + RankList(leaving) + " leave the job, with no node to replace them on; ranks " +
                     RankList(members) + " go on in place (membership epoch " + std::to_string(epoch) + ") with " +
                     std::to_string(after.accumulation) + " micro-batch(es) each a step instead of " +
                     std::to_string(before.accumulation) + ", the global batch of " + std::to_string(after.global_batch) +
                     " unchanged, and redo the step in flight",
                 -1);
  // The members in the announcement itself (worker/recovery's MembersOf reads them).
  announce_later_.emplace_back(job.placed.rendezvous_scope() + "/membership/" + std::to_string(epoch),
                               "epoch " + std::to_string(epoch) + ": ranks " + RankList(leaving) + " left; members " +
                                   RankList(members));
  cv_.notify_all();
  return true;
}

void Coordinator::PublishAnnouncements() {
  std::vector<std::pair<std::string, std::string>> queued;
  {
    std::lock_guard<std::mutex> lock(mu_);
    queued.swap(announce_later_);
  }
  for (const auto& [key, value] : queued) {
    if (Status set = KvSet(key, value); !set.ok()) {
      LTRAIN_LOG(kWarning, kLog) << "the rendezvous key " << key << " was not published: " << set.message();
    }
  }
}

void Coordinator::NoteRecoveryProgressLocked(ActiveJob& job, const v1::RankProgress& report) {
  // The replacement's first completed step in the membership it took its state in: it holds the
  // state and trains with the others.
  if (!report.has_completed() || !report.has_recovery() || report.recovery().epoch() != job.epoch) return;
  const v1::RecoveryFigures& r = report.recovery();
  if (job.replacing_rank < 0) {
    if (job.shrunk_since_ms < 0) return;
    // The members of a membership that ranks left: the first of them to complete a step with the others.
    const int64_t ms = clock_->SteadyMs() - job.shrunk_since_ms;
    const int64_t lost = std::max<int64_t>(r.lost_steps(), job.replacing_from_step - r.resumed_step());
    AddEventLocked(job, "recovered",
                   "ranks " + RankList(job.members) + " went on without the ranks that left (membership epoch " +
                       std::to_string(job.epoch) + "): from step " + std::to_string(r.resumed_step()) +
                       ", in their own memory, they reported step " + std::to_string(report.completed().step()) +
                       " completed, " + std::to_string(ms) + " ms after the loss was reported; work lost: " +
                       std::to_string(lost) + (lost == 1 ? " step" : " steps"),
                   report.rank());
    job.job.set_recoveries(job.job.recoveries() + 1);
    job.job.set_lost_steps(job.job.lost_steps() + lost);
    job.job.set_last_recovery_ms(static_cast<double>(ms));
    PersistJobLocked(job);
    job.shrunk_since_ms = -1;
    return;
  }
  const int64_t ms = clock_->SteadyMs() - job.replacing_since_ms;
  // The members' own count (the coordinator's view of their steps lags a heartbeat behind), or at
  // least what the coordinator saw completed before the failure.
  const int64_t lost = std::max<int64_t>(r.lost_steps(), job.replacing_from_step - r.resumed_step());
  char bytes[32];
  std::snprintf(bytes, sizeof(bytes), "%.1f MB", static_cast<double>(r.bytes()) / 1e6);
  AddEventLocked(job, "recovered",
                 "rank " + std::to_string(job.replacing_rank) + " is back (membership epoch " + std::to_string(job.epoch) +
                     "): it took the state of step " + std::to_string(r.resumed_step()) + " from rank " +
                     std::to_string(r.source_rank()) + "'s memory (" + bytes + " in " +
                     std::to_string(static_cast<int64_t>(r.ms())) + " ms) and reported step " +
                     std::to_string(report.completed().step()) + " completed, " + std::to_string(ms) +
                     " ms after its failure was reported; work lost: " + std::to_string(lost) +
                     (lost == 1 ? " step" : " steps") +
                     (lost > 0 ? " (completed before the failure, trained again from the newest copies)" : ""),
                 job.replacing_rank);
  job.job.set_recoveries(job.job.recoveries() + 1);
  job.job.set_lost_steps(job.job.lost_steps() + lost);
  job.job.set_last_recovery_ms(static_cast<double>(ms));
  job.job.clear_replacing_rank();
  PersistJobLocked(job);
  job.replacing_rank = -1;
}

}  // namespace ltrain::launcher
