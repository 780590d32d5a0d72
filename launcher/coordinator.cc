#include "launcher/coordinator.h"

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <regex>

#include "common/logging.h"
#include "common/signal_name.h"

namespace ltrain::launcher {
namespace {

constexpr const char* kLog = "coordinator";

std::string RankRange(int first, int last) {
  return first == last ? "rank " + std::to_string(first)
                       : "ranks " + std::to_string(first) + "-" + std::to_string(last);
}

}  // namespace

Coordinator::Coordinator(StateStore* store, const Clock* clock, CoordinatorOptions options)
    : store_(store), clock_(clock), options_(std::move(options)) {}

StatusOr<v1::Job> Coordinator::Submit(const std::string& recipe_yaml, const std::string& source_name) {
  RecipeParseResult parsed = ParseRecipe(recipe_yaml, source_name.empty() ? "recipe" : source_name);
  if (!parsed.ok()) return InvalidArgument(parsed.ErrorText());
  Recipe recipe = parsed.recipe;
  std::lock_guard<std::mutex> lock(mu_);
  StatusOr<v1::Job> created =
      store_->CreateJob(recipe.name, RecipeToYaml(recipe), recipe.parallel.world_size(), clock_->UnixMs());
  if (!created.ok()) return created.status();
  if (recipe.checkpoint.dir.empty()) {
    recipe.checkpoint.dir = (std::filesystem::path(options_.state_dir) / "checkpoints" / created->id()).string();
  }
  ActiveJob& job = jobs_[created->id()];
  job.job = *created;
  job.job.set_recipe_yaml(RecipeToYaml(recipe));
  job.recipe = recipe;
  AddEventLocked(job, "submitted",
                 "job " + job.job.id() + " submitted: " + std::to_string(recipe.parallel.world_size()) +
                     " ranks on " + std::to_string(recipe.parallel.nodes) + " node(s)",
                 -1);
  pending_.push_back(job.job.id());
  ScheduleLocked();
  return job.job;
}

void Coordinator::ScheduleLocked() {
  for (auto it = pending_.begin(); it != pending_.end();) {
    auto found = jobs_.find(*it);
    if (found == jobs_.end() || IsFinal(found->second.job.state())) {
      it = pending_.erase(it);
      continue;
    }
    ActiveJob& job = found->second;
    std::vector<std::string> free_nodes;
    for (auto& [id, node] : nodes_) {
      if (node.connected && node.jobs.empty()) free_nodes.push_back(id);
    }
    int needed = job.recipe.parallel.nodes;
    if (static_cast<int>(free_nodes.size()) < needed) {
      ++it;
      continue;
    }
    free_nodes.resize(needed);
    job.nodes = free_nodes;
    int nproc = job.recipe.parallel.nproc_per_node;
    std::string placement;
    for (int i = 0; i < needed; ++i) {
      NodeState& node = nodes_[free_nodes[i]];
      node.jobs.insert(job.job.id());
      v1::Command command;
      v1::StartJobCommand* start = command.mutable_start();
      start->set_job_id(job.job.id());
      start->set_generation(job.job.generation());
      start->set_recipe_yaml(job.job.recipe_yaml());
      start->set_world_size(job.recipe.parallel.world_size());
      start->set_local_world_size(nproc);
      start->set_rendezvous_scope(job.job.id() + "/" + std::to_string(job.job.generation()) + "/");
      start->set_checkpoint_dir(job.recipe.checkpoint.dir);
      for (int local = 0; local < nproc; ++local) {
        v1::WorkerAssignment* worker = start->add_workers();
        worker->set_rank(i * nproc + local);
        worker->set_local_rank(local);
      }
      node.commands.push_back(command);
      placement += (placement.empty() ? "" : ", ") + RankRange(i * nproc, i * nproc + nproc - 1) + " on " +
                   free_nodes[i] + " (" + node.facts.hostname() + ")";
    }
    job.job.set_state(v1::JOB_STATE_RUNNING);
    PersistJobLocked(job);
    AddEventLocked(job, "placed", "placed " + placement, -1);
    it = pending_.erase(it);
  }
  cv_.notify_all();
}

void Coordinator::AddEventLocked(ActiveJob& job, const std::string& kind, const std::string& message, int rank) {
  v1::Event event;
  event.set_seq(next_seq_++);
  event.set_job_id(job.job.id());
  event.set_unix_ms(clock_->UnixMs());
  event.set_kind(kind);
  event.set_message(message);
  event.set_rank(rank);
  event.set_state(job.job.state());
  if (kind != "log") {
    StatusOr<int64_t> stored = store_->AppendEvent(event);
    if (!stored.ok()) LTRAIN_LOG(kError, kLog) << stored.status().ToString();
    LTRAIN_LOG(kInfo, kLog) << job.job.id() << ": " << message;
  }
  job.events.push_back(std::move(event));
  if (job.events.size() > options_.max_buffered_events) {
    job.events.erase(job.events.begin(), job.events.begin() + job.events.size() / 4);
  }
  cv_.notify_all();
}

void Coordinator::PersistJobLocked(ActiveJob& job) {
  job.job.set_updated_unix_ms(clock_->UnixMs());
  Status status = store_->UpdateJob(job.job);
  if (!status.ok()) LTRAIN_LOG(kError, kLog) << status.ToString();
}

void Coordinator::FinishLocked(ActiveJob& job, v1::JobState state, const std::string& cause) {
  if (IsFinal(job.job.state())) return;
  bool was_placed = job.job.state() == v1::JOB_STATE_RUNNING;
  job.job.set_state(state);
  job.job.set_cause(cause);
  PersistJobLocked(job);
  for (const auto& node_id : job.nodes) {
    auto node = nodes_.find(node_id);
    if (node == nodes_.end()) continue;
    node->second.jobs.erase(job.job.id());
    if (was_placed && state != v1::JOB_STATE_SUCCEEDED) {
      v1::Command command;
      command.mutable_stop()->set_job_id(job.job.id());
      command.mutable_stop()->set_reason(cause);
      node->second.commands.push_back(command);
    }
  }
  AddEventLocked(job, "state", std::string("job ") + JobStateName(state) + (cause.empty() ? "" : ": " + cause), -1);
  ScheduleLocked();
}

StatusOr<v1::Job> Coordinator::GetJob(const std::string& job_id) {
  StatusOr<v1::Job> job = store_->GetJob(job_id);
  if (!job.ok()) return job;
  std::lock_guard<std::mutex> lock(mu_);
  auto active = jobs_.find(job_id);
  if (active != jobs_.end()) {
    job->set_last_step(active->second.job.last_step());
    job->set_last_loss(active->second.job.last_loss());
  }
  return job;
}

StatusOr<std::vector<v1::Job>> Coordinator::ListJobs(int limit) { return store_->ListJobs(limit); }

StatusOr<v1::Job> Coordinator::Stop(const std::string& job_id, const std::string& reason) {
  std::lock_guard<std::mutex> lock(mu_);
  auto found = jobs_.find(job_id);
  if (found == jobs_.end()) {
    StatusOr<v1::Job> stored = store_->GetJob(job_id);
    if (!stored.ok()) return stored;
    if (IsFinal(stored->state())) return stored;
    return FailedPrecondition("job " + job_id + " is not run by this coordinator");
  }
  FinishLocked(found->second, v1::JOB_STATE_STOPPED, reason.empty() ? "stopped by the user" : reason);
  return found->second.job;
}

StatusOr<std::vector<v1::Event>> Coordinator::WaitEvents(const std::string& job_id, int64_t after_seq, bool logs,
                                                         int64_t timeout_ms, bool* finished) {
  std::unique_lock<std::mutex> lock(mu_);
  auto found = jobs_.find(job_id);
  if (found == jobs_.end()) {
    // A job of an earlier coordinator: its stored history, and it is over as far as we know.
    lock.unlock();
    StatusOr<v1::Job> job = store_->GetJob(job_id);
    if (!job.ok()) return job.status();
    *finished = true;
    return store_->EventsAfter(job_id, after_seq);
  }
  auto collect = [&]() {
    std::vector<v1::Event> out;
    for (const auto& event : found->second.events) {
      if (event.seq() > after_seq && (logs || event.kind() != "log")) out.push_back(event);
    }
    return out;
  };
  std::vector<v1::Event> events = collect();
  if (events.empty() && !IsFinal(found->second.job.state()) && !shutting_down_) {
    cv_.wait_for(lock, std::chrono::milliseconds(timeout_ms));
    events = collect();
  }
  *finished = IsFinal(found->second.job.state()) && events.empty();
  return events;
}

int64_t Coordinator::NodeConnected(const std::string& node_id, const v1::NodeFacts& facts) {
  Status stored = store_->UpsertNode(node_id, facts, clock_->UnixMs());
  if (!stored.ok()) LTRAIN_LOG(kError, kLog) << stored.ToString();
  std::lock_guard<std::mutex> lock(mu_);
  NodeState& node = nodes_[node_id];
  node.facts = facts;
  node.connected = true;
  node.token = next_token_++;
  node.last_heartbeat_ms = clock_->SteadyMs();
  LTRAIN_LOG(kInfo, kLog) << "node " << node_id << " (" << facts.hostname() << ", " << facts.cpus() << " CPUs, "
                          << facts.gpus() << " GPUs) connected";
  ScheduleLocked();
  return node.token;
}

void Coordinator::NodeDisconnected(const std::string& node_id, int64_t token) {
  std::lock_guard<std::mutex> lock(mu_);
  auto found = nodes_.find(node_id);
  if (found == nodes_.end() || found->second.token != token) return;
  found->second.connected = false;
  found->second.commands.clear();
  std::set<std::string> jobs = found->second.jobs;
  for (const auto& job_id : jobs) {
    auto job = jobs_.find(job_id);
    if (job != jobs_.end()) FinishLocked(job->second, v1::JOB_STATE_FAILED, "node " + node_id + " disconnected");
  }
  LTRAIN_LOG(kInfo, kLog) << "node " << node_id << " disconnected";
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

Status Coordinator::Heartbeat(const std::string& node_id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto found = nodes_.find(node_id);
  if (found == nodes_.end()) return NotFound("node " + node_id + " is not registered; reconnect first");
  found->second.last_heartbeat_ms = clock_->SteadyMs();
  return Status::Ok();
}

Status Coordinator::ReportWorkerState(const v1::WorkerStateReport& report) {
  v1::RankInfo rank;
  rank.set_rank(report.rank());
  rank.set_node_id(report.node_id());
  rank.set_pid(report.pid());
  rank.set_state(report.state());
  rank.set_exit_code(report.exit_code());
  rank.set_signal(report.signal());
  rank.set_log_path(report.log_path());
  std::lock_guard<std::mutex> lock(mu_);
  auto found = jobs_.find(report.job_id());
  if (found == jobs_.end()) return NotFound("job " + report.job_id() + " is not run by this coordinator");
  ActiveJob& job = found->second;
  if (report.generation() != job.job.generation()) return Status::Ok();  // a stale generation
  rank.set_local_rank(report.rank() % std::max(1, job.recipe.parallel.nproc_per_node));
  Status stored = store_->UpsertRank(job.job.id(), rank);
  if (!stored.ok()) return stored;
  if (report.state() == "running") {
    AddEventLocked(job, "rank_started",
                   "rank " + std::to_string(report.rank()) + " started on " + report.node_id() + " (pid " +
                       std::to_string(report.pid()) + ")",
                   report.rank());
    return Status::Ok();
  }
  bool clean = report.signal() == 0 && report.exit_code() == 0;
  std::string how = report.signal() != 0 ? "was killed by signal " + SignalName(report.signal())
                                         : "exited with code " + std::to_string(report.exit_code());
  AddEventLocked(job, "rank_exited", "rank " + std::to_string(report.rank()) + " " + how, report.rank());
  if (IsFinal(job.job.state())) return Status::Ok();
  if (clean) {
    job.ranks_succeeded.insert(report.rank());
    if (static_cast<int>(job.ranks_succeeded.size()) == job.recipe.parallel.world_size()) {
      FinishLocked(job, v1::JOB_STATE_SUCCEEDED, "");
    }
    return Status::Ok();
  }
  std::string cause = "rank " + std::to_string(report.rank()) + " on " + report.node_id() + " " + how;
  if (report.log_tail_size() > 0) {
    cause += "; last lines of its log (" + report.log_path() + "):";
    for (const auto& line : report.log_tail()) cause += "\n    " + line;
  } else if (!report.log_path().empty()) {
    cause += "; its log " + report.log_path() + " is empty";
  }
  FinishLocked(job, v1::JOB_STATE_FAILED, cause);
  return Status::Ok();
}

void Coordinator::PushLogs(const v1::PushLogsRequest& request) {
  static const std::regex kProgress(R"(^step (\d+)/\d+ loss ([0-9.eE+-]+|nan|inf))");
  std::lock_guard<std::mutex> lock(mu_);
  auto found = jobs_.find(request.job_id());
  if (found == jobs_.end()) return;
  ActiveJob& job = found->second;
  for (const auto& line : request.lines()) {
    std::smatch match;
    if (line.rank() == 0 && std::regex_search(line.text(), match, kProgress)) {
      job.job.set_last_step(std::stoll(match[1]));
      job.job.set_last_loss(std::strtod(match[2].str().c_str(), nullptr));
      PersistJobLocked(job);
    }
    AddEventLocked(job, "log", line.text(), line.rank());
  }
}

void Coordinator::KvSet(const std::string& key, const std::string& value) {
  std::lock_guard<std::mutex> lock(mu_);
  kv_[key] = value;
  cv_.notify_all();
}

std::optional<std::vector<std::string>> Coordinator::KvGet(const std::vector<std::string>& keys, int64_t timeout_ms) {
  std::unique_lock<std::mutex> lock(mu_);
  auto all_present = [&] {
    return shutting_down_ ||
           std::all_of(keys.begin(), keys.end(), [&](const std::string& k) { return kv_.count(k) > 0; });
  };
  if (!cv_.wait_for(lock, std::chrono::milliseconds(timeout_ms), all_present) || shutting_down_) return std::nullopt;
  std::vector<std::string> values;
  for (const auto& key : keys) values.push_back(kv_[key]);
  return values;
}

void Coordinator::CheckNodes() {
  std::lock_guard<std::mutex> lock(mu_);
  int64_t now = clock_->SteadyMs();
  for (auto& [id, node] : nodes_) {
    if (!node.connected || now - node.last_heartbeat_ms <= options_.node_timeout_ms) continue;
    node.connected = false;
    std::set<std::string> jobs = node.jobs;
    for (const auto& job_id : jobs) {
      auto job = jobs_.find(job_id);
      if (job == jobs_.end()) continue;
      FinishLocked(job->second, v1::JOB_STATE_FAILED,
                   "node " + id + " lost: no heartbeat for " + std::to_string((now - node.last_heartbeat_ms) / 1000.0) + " s");
    }
  }
}

void Coordinator::Shutdown() {
  std::lock_guard<std::mutex> lock(mu_);
  shutting_down_ = true;
  cv_.notify_all();
}

bool Coordinator::shutting_down() const {
  std::lock_guard<std::mutex> lock(mu_);
  return shutting_down_;
}

}  // namespace ltrain::launcher
