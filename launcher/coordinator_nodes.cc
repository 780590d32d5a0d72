// The coordinator's nodes (AgentService): their connections, heartbeats, commands and loss. Part of
// Coordinator (coordinator.h).
#include "launcher/coordinator.h"

#include <algorithm>

#include "common/logging.h"

namespace ltrain::launcher {
namespace {

constexpr const char* kLog = "coordinator";

}  // namespace

int64_t Coordinator::NodeConnected(const std::string& node_id, const v1::NodeFacts& facts,
                                   const std::vector<v1::RunningWorker>& running, CommandSink deliver) {
  writer_.Enqueue("record node " + node_id, [node_id, facts, now = clock_->UnixMs()](StateStore& store) {
    return store.UpsertNode(node_id, facts, now);
  });
  std::lock_guard<std::mutex> lock(mu_);
  NodeState& node = nodes_[node_id];
  node.facts = facts;
  node.connected = true;
  node.token = next_token_++;
  node.lost_ms = -1;
  node.last_heartbeat_ms = clock_->SteadyMs();
  node.deliver = std::move(deliver);
  if (node.deliver) {
    while (!node.commands.empty()) {
      node.deliver(std::move(node.commands.front()));
      node.commands.pop_front();
    }
  }
  LTRAIN_LOG(kInfo, kLog) << "node " << node_id << " (" << facts.hostname() << ", " << facts.cpus() << " CPUs, "
                          << facts.gpus() << " GPUs) connected";
  if (node.recovered) {
    // Back after a coordinator restart: its jobs go on only if their workers are still there.
    node.recovered = false;
    std::set<std::string> jobs = node.jobs;
    for (const auto& job_id : jobs) {
      ActiveJob* job = FindLocked(job_id);
      if (job == nullptr) continue;
      int workers = static_cast<int>(std::count_if(running.begin(), running.end(), [&](const v1::RunningWorker& w) {
        return w.job_id() == job_id && w.generation() == job->job.generation();
      }));
      // Workers that exited while we were away have their reports on the way; ranks neither
      // reported nor running are caught by the hang check.
      AddEventLocked(*job, "reconnected",
                     "node " + node_id + " is back with " + std::to_string(workers) + " running worker(s) of the job", -1);
      // A replacement in place that the earlier coordinator meant to start here and never did (it
      // went away first): started now, in the membership this coordinator announced.
      const int nproc = std::max(1, job->recipe.parallel.nproc_per_node);
      const int replacing = job->replacing_rank;
      const size_t index = replacing < 0 ? job->nodes.size() : static_cast<size_t>(replacing / nproc);
      if (replacing >= 0 && index < job->nodes.size() && job->nodes[index] == node_id &&
          std::none_of(running.begin(), running.end(), [&](const v1::RunningWorker& w) {
            return w.job_id() == job_id && w.generation() == job->job.generation() && w.rank() == replacing;
          })) {
        QueueReplacementLocked(*job, replacing, node);
        AddEventLocked(*job, "recovering",
                       "rank " + std::to_string(replacing) + "'s replacement had not started on " + node_id +
                           " when this coordinator took over: starting it now (membership epoch " +
                           std::to_string(job->epoch) + ")",
                       replacing);
      }
    }
  }
  ScheduleLocked();
  cv_.notify_all();
  return node.token;
}

v1::NodeStatus Coordinator::StatusOfNode(const std::string& node_id, const NodeState& node, int64_t now) {
  v1::NodeStatus status;
  status.set_node_id(node_id);
  status.set_hostname(node.facts.hostname());
  status.set_connected(node.connected);
  status.set_heartbeat_age_ms(now - node.last_heartbeat_ms);
  *status.mutable_facts() = node.facts;
  return status;
}

std::vector<v1::NodeStatus> Coordinator::ListNodes() const {
  std::lock_guard<std::mutex> lock(mu_);
  const int64_t now = clock_->SteadyMs();
  std::vector<v1::NodeStatus> nodes;
  for (const auto& [id, node] : nodes_) {
    v1::NodeStatus& status = nodes.emplace_back(StatusOfNode(id, node, now));
    for (const auto& job : node.jobs) status.add_jobs(job);
  }
  return nodes;
}

bool Coordinator::WaitForNode(const std::string& node_id, int64_t timeout_ms) {
  std::unique_lock<std::mutex> lock(mu_);
  return cv_.wait_for(lock, std::chrono::milliseconds(BoundedWaitMs(timeout_ms)), [&] {
    auto found = nodes_.find(node_id);
    return shutting_down_ || (found != nodes_.end() && found->second.connected);
  }) && !shutting_down_;
}

void Coordinator::LoseNodeLocked(const std::string& node_id, const std::string& reason, bool expected) {
  auto found = nodes_.find(node_id);
  if (found == nodes_.end()) return;
  found->second.connected = false;
  found->second.lost_ms = clock_->SteadyMs();
  found->second.recovered = false;
  found->second.commands.clear();
  std::set<std::string> running = found->second.jobs;
  found->second.jobs.clear();
  if (expected) {
    LTRAIN_LOG(kInfo, kLog) << "node " << node_id << " left: " << reason;
  } else {
    LTRAIN_LOG(kWarning, kLog) << "node " << node_id << " lost: " << reason;
  }
  for (auto& [job_id, job] : jobs_) {
    // Told to every unfinished job whose latest generation used the node, also when that
    // generation already failed for another reason (its workers saw the node go first).
    bool used = std::find(job.generation_nodes.begin(), job.generation_nodes.end(), node_id) != job.generation_nodes.end();
    if (!used || IsFinal(job.job.state())) continue;
    AddEventLocked(job, "node_lost", "node " + node_id + " lost: " + reason, -1);
    if (running.count(job_id)) {
      job.nodes.erase(std::remove(job.nodes.begin(), job.nodes.end(), node_id), job.nodes.end());
      // Its ranks, by the generation's placement (a node runs nproc_per_node consecutive ranks).
      std::vector<int> lost;
      const int nproc = std::max(1, job.recipe.parallel.nproc_per_node);
      const auto at = std::find(job.generation_nodes.begin(), job.generation_nodes.end(), node_id);
      const int index = static_cast<int>(at - job.generation_nodes.begin());
      for (int r = index * nproc; r < (index + 1) * nproc && r < job.job.world_size(); ++r) lost.push_back(r);
      if (!expected && job.recipe.fault.recovery == Recovery::kInPlace &&
          ShrinkLocked(job, lost, "node " + node_id + " lost: " + reason)) {
        continue;
      }
      FailGenerationLocked(job, "node " + node_id + " lost: " + reason);
    }
  }
}

void Coordinator::NodeLeaving(const std::string& node_id, const std::string& reason) {
  AnnounceOnExit announce(this);
  std::lock_guard<std::mutex> lock(mu_);
  auto found = nodes_.find(node_id);
  if (found == nodes_.end() || !found->second.connected) return;
  std::set<std::string> running = found->second.jobs;
  for (const auto& job_id : running) {
    ActiveJob* job = FindLocked(job_id);
    if (job == nullptr || job->job.state() != v1::JOB_STATE_RUNNING) continue;
    if (job->job.nodes_now() - 1 >= job->recipe.parallel.nodes_min) continue;  // elastic: shrinks below
    FinishLocked(*job, v1::JOB_STATE_STOPPED, "node " + node_id + " left: " + reason);
  }
  LoseNodeLocked(node_id, "it left: " + reason, /*expected=*/true);
  // A node that said goodbye leaves `ltrain nodes` and memory at once (its record stays in the
  // state, its jobs were told): only lost nodes are kept on show, for forget_lost_nodes_ms.
  nodes_.erase(node_id);
}

void Coordinator::NodeDisconnected(const std::string& node_id, int64_t token) {
  AnnounceOnExit announce(this);
  std::lock_guard<std::mutex> lock(mu_);
  if (auto stream = nodes_.find(node_id); stream != nodes_.end() && stream->second.token == token) {
    stream->second.deliver = nullptr;  // the stream is going: its commands queue again
  }
  // Streams close because this coordinator is going away: its jobs stay as they are in the state,
  // for the next coordinator to take back.
  if (shutting_down_) return;
  auto found = nodes_.find(node_id);
  if (found == nodes_.end() || found->second.token != token || !found->second.connected) return;
  LoseNodeLocked(node_id, "its agent's connection closed");
}

std::optional<v1::Command> Coordinator::WaitCommand(const std::string& node_id, int64_t timeout_ms) {
  std::unique_lock<std::mutex> lock(mu_);
  auto ready = [&] {
    auto found = nodes_.find(node_id);
    return shutting_down_ || (found != nodes_.end() && !found->second.commands.empty());
  };
  cv_.wait_for(lock, std::chrono::milliseconds(timeout_ms), ready);
  auto found = nodes_.find(node_id);
  if (shutting_down_ || found == nodes_.end() || found->second.commands.empty()) return std::nullopt;
  v1::Command command = std::move(found->second.commands.front());
  found->second.commands.pop_front();
  return command;
}

Status Coordinator::Heartbeat(const v1::HeartbeatRequest& request) {
  std::lock_guard<std::mutex> lock(mu_);
  auto found = nodes_.find(request.node_id());
  if (found == nodes_.end() || !found->second.connected) {
    return NotFound("node " + request.node_id() + " is not connected; reconnect first");
  }
  found->second.last_heartbeat_ms = clock_->SteadyMs();
  for (const auto& report : request.progress()) {
    if (ActiveJob* job = FindLocked(report.job_id())) ApplyProgressLocked(*job, report);
  }
  return Status::Ok();
}

}  // namespace ltrain::launcher
