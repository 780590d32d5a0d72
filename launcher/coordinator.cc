#include "launcher/coordinator.h"

#include <algorithm>
#include <cstdio>
#include <ctime>
#include <filesystem>
#include <string_view>

#include "common/layout.h"
#include "common/layout_plan.h"
#include "common/logging.h"
#include "common/signal_name.h"
#include "common/worker_exit.h"
#include "launcher/hang_diagnosis.h"
#include "launcher/restart_policy.h"

namespace ltrain::launcher {
namespace {

constexpr const char* kLog = "coordinator";
constexpr size_t kMaxSeriesPoints = 4000;  // a job's curve points in memory (JobSeries)

// A worker's line as the coordinator keeps it: valid UTF-8 and at most 16 KiB (the agents send no
// more; this holds against any client), so that no report can grow the state by megabytes.
std::string StoredLine(const std::string& text) { return BoundedLine(text, 16 << 10); }

// A program's exception, as torchrun prints its root cause: the message, where the rank wrote it and
// when, and the traceback.
std::string ProgramErrorText(const v1::ProgramError& error, const std::string& log_path) {
  std::string text = ": " + StoredLine(error.message().empty() ? "(no message)" : error.message());
  text += " (error file " + error.error_file();
  if (error.timestamp_s() > 0) {
    const time_t at = static_cast<time_t>(error.timestamp_s());
    std::tm utc{};
    gmtime_r(&at, &utc);
    char when[32];
    std::strftime(when, sizeof(when), "%Y-%m-%d %H:%M:%S UTC", &utc);
    text += std::string(", written ") + when;
  }
  if (!log_path.empty()) text += "; its log " + log_path;
  text += ")";
  if (!error.traceback().empty()) {
    text += "; traceback:";
    std::string_view rest = error.traceback();
    // Python's own, bounded as a log tail is.
    for (int lines = 0; !rest.empty() && lines < 200; ++lines) {
      const size_t end = rest.find('\n');
      const std::string_view line = rest.substr(0, end);
      if (!line.empty()) text += "\n    " + StoredLine(std::string(line));
      if (end == std::string_view::npos) break;
      rest.remove_prefix(end + 1);
    }
  }
  return text;
}

std::string RankRange(int first, int last) {
  return first == last ? "rank " + std::to_string(first)
                       : "ranks " + std::to_string(first) + "-" + std::to_string(last);
}

std::string Seconds(int64_t ms) {
  char text[32];
  std::snprintf(text, sizeof(text), "%.1fs", ms / 1000.0);
  return text;
}

RestartPolicy PolicyOf(const Recipe& recipe) {
  RestartPolicy policy;
  policy.max_restarts = recipe.fault.max_restarts;
  policy.initial_backoff_ms = static_cast<int64_t>(recipe.fault.restart_backoff_s * 1000);
  policy.max_backoff_ms = static_cast<int64_t>(recipe.fault.restart_backoff_max_s * 1000);
  return policy;
}

}  // namespace

Coordinator::Coordinator(StateStore* store, const Clock* clock, CoordinatorOptions options)
    : store_(store), clock_(clock), options_(std::move(options)), writer_(store, clock) {
  // Sequence numbers keep growing across coordinator restarts, so a follower that reconnects with
  // the last number it saw misses nothing new.
  next_seq_ = std::max<int64_t>(1, clock_->UnixMs() * 1000);
}

Coordinator::ActiveJob* Coordinator::FindLocked(const std::string& job_id) {
  auto found = jobs_.find(job_id);
  return found == jobs_.end() ? nullptr : &found->second;
}

StatusOr<v1::Job> Coordinator::Submit(const std::string& recipe_yaml, const std::string& source_name) {
  RecipeParseResult parsed = ParseRecipe(recipe_yaml, source_name.empty() ? "recipe" : source_name);
  if (!parsed.ok()) return InvalidArgument(parsed.ErrorText());
  Recipe recipe = parsed.recipe;
  if (std::string problem = FitProblem(recipe); !problem.empty()) {
    return InvalidArgument((source_name.empty() ? std::string("recipe") : source_name) + ": " + problem);
  }
  LTRAIN_RETURN_IF_ERROR(CheckStateWritable());
  // The id comes from the store: the one write made before the lock, and waited for.
  StatusOr<v1::Job> created =
      store_->CreateJob(recipe.name, RecipeToYaml(recipe), recipe.parallel.world_size(), clock_->UnixMs());
  if (!created.ok()) return created.status();
  std::lock_guard<std::mutex> lock(mu_);
  if (recipe.checkpoint.dir.empty()) {
    recipe.checkpoint.dir = (std::filesystem::path(options_.state_dir) / "checkpoints" / created->id()).string();
  }
  ActiveJob& job = jobs_[created->id()];
  job.job = *created;
  job.job.set_recipe_yaml(RecipeToYaml(recipe));
  job.recipe = recipe;
  PersistJobLocked(job);
  std::string nodes = recipe.parallel.nodes_min == recipe.parallel.nodes_max
                          ? std::to_string(recipe.parallel.nodes)
                          : std::to_string(recipe.parallel.nodes_min) + "-" + std::to_string(recipe.parallel.nodes_max);
  AddEventLocked(job, "submitted",
                 "job " + job.job.id() + " submitted: " + std::to_string(recipe.parallel.nproc_per_node) +
                     " rank(s) per node on " + nodes + " node(s)",
                 -1);
  pending_.push_back(job.job.id());
  ScheduleLocked();
  return job.job;
}

std::vector<std::string> Coordinator::FreeNodesLocked(const Recipe& recipe) const {
  const bool needs_gpu = recipe.parallel.device == Device::kCuda;
  std::vector<std::string> free_nodes;
  for (const auto& [id, node] : nodes_) {
    if (node.connected && node.jobs.empty() && (!needs_gpu || node.facts.gpus() > 0)) free_nodes.push_back(id);
  }
  return free_nodes;
}

std::string Coordinator::FreeNodesText(const Recipe& recipe, size_t free_nodes) const {
  size_t without_gpu = 0;
  for (const auto& [id, node] : nodes_) {
    if (node.connected && node.jobs.empty() && node.facts.gpus() == 0) ++without_gpu;
  }
  std::string text = std::to_string(free_nodes) + " free";
  if (recipe.parallel.device == Device::kCuda && without_gpu > 0) {
    text += " with a GPU (" + std::to_string(without_gpu) + " idle without one, and parallel.device is cuda)";
  }
  return text;
}

void Coordinator::ScheduleLocked() {
  for (auto it = pending_.begin(); it != pending_.end();) {
    ActiveJob* job = FindLocked(*it);
    if (job == nullptr || job->job.state() != v1::JOB_STATE_PENDING) {
      it = pending_.erase(it);
      continue;
    }
    std::vector<std::string> free_nodes = FreeNodesLocked(job->recipe);
    if (static_cast<int>(free_nodes.size()) < job->recipe.parallel.nodes_min) {
      if (!job->waiting_reported) {
        job->waiting_reported = true;
        AddEventLocked(*job, "waiting",
                       "waiting for nodes: " + FreeNodesText(job->recipe, free_nodes.size()) + ", " +
                           std::to_string(job->recipe.parallel.nodes_min) + " needed; start `ltrain agent` on more nodes",
                       -1);
      }
      ++it;
      continue;
    }
    it = pending_.erase(it);
    StartGenerationLocked(*job, free_nodes);
  }
  cv_.notify_all();
}

bool Coordinator::StartGenerationLocked(ActiveJob& job, std::vector<std::string> nodes) {
  Recipe recipe = job.recipe;
  int count = std::min<int>(static_cast<int>(nodes.size()), recipe.parallel.nodes_max);
  nodes.resize(count);
  // The generation's recipe says how many nodes it runs on now.
  recipe.parallel.nodes = recipe.parallel.nodes_min = recipe.parallel.nodes_max = count;
  // An elastic job keeps its global batch: fewer ranks accumulate more micro-batches, as long as
  // the layout rules hold for the ranks there are now.
  // (A program of the user's own, entrypoint.command, sizes itself from WORLD_SIZE.)
  std::vector<LayoutProblem> problems =
      recipe.runs_program() ? std::vector<LayoutProblem>() : CheckLayout(recipe, recipe.parallel.world_size());
  if (!problems.empty()) {
    FinishLocked(job, v1::JOB_STATE_FAILED,
                 "cannot run on " + std::to_string(count) + " node(s): " + problems.front().message);
    return false;
  }
  int generation = job.next_generation++;
  job.job.set_generation(generation);
  job.job.set_world_size(recipe.parallel.world_size());
  job.job.set_nodes_now(count);
  job.nodes = nodes;
  job.generation_nodes = nodes;
  job.ranks_exited_ok.clear();
  job.progress.clear();
  job.stragglers = StragglerTracker();
  job.times.Restart();
  job.generation_started_ms = clock_->SteadyMs();
  job.committed_at_start = job.job.last_committed_step();
  job.resume_compared = false;
  job.waiting_reported = false;
  job.stopping = job.stopped_early = false;
  job.stop_reason.clear();
  job.epoch = 0;
  job.job.set_membership_epoch(0);
  job.job.clear_replacing_rank();
  job.replacing_rank = -1;
  job.members.clear();
  job.job.clear_members();
  job.shrunk_since_ms = -1;
  writer_.Enqueue("clear the ranks of " + job.job.id(),
                  [id = job.job.id()](StateStore& store) { return store.ClearRanks(id); });
  job.ranks.clear();
  int nproc = recipe.parallel.nproc_per_node;
  const v1::StartJobCommand base = GenerationCommand(job, recipe, generation);
  FreeKeysLocked(job.job.id(), base.rendezvous_scope());  // older generations' addresses and ids
  std::string placement;
  for (int i = 0; i < count; ++i) {
    NodeState& node = nodes_[nodes[i]];
    node.jobs.insert(job.job.id());
    v1::Command command;
    v1::StartJobCommand* start = command.mutable_start();
    *start = base;
    for (int local = 0; local < nproc; ++local) {
      v1::WorkerAssignment* worker = start->add_workers();
      worker->set_rank(i * nproc + local);
      worker->set_local_rank(local);
      // Recorded at once, so that placement is visible and survives a coordinator restart.
      v1::RankInfo rank;
      rank.set_rank(i * nproc + local);
      rank.set_node_id(nodes[i]);
      rank.set_local_rank(local);
      rank.set_state("starting");
      job.ranks[rank.rank()] = rank;
      writer_.Enqueue("record rank " + std::to_string(rank.rank()) + " of " + job.job.id(),
                      [id = job.job.id(), rank](StateStore& store) { return store.UpsertRank(id, rank); });
    }
    if (i == 0) {
      job.placed = *start;
      job.placed.clear_workers();
    }
    QueueCommandLocked(node, command);
    placement += (placement.empty() ? "" : ", ") + RankRange(i * nproc, i * nproc + nproc - 1) + " on " + nodes[i] +
                 " (" + node.facts.hostname() + ")";
  }
  job.job.set_state(v1::JOB_STATE_RUNNING);
  PersistJobLocked(job);
  std::string resume = generation > 0 && job.job.last_committed_step() > 0
                           ? ", resuming from the checkpoint of step " + std::to_string(job.job.last_committed_step())
                           : "";
  AddEventLocked(job, "placed",
                 (generation > 0 ? "generation " + std::to_string(generation) + ": " : std::string()) + "placed " +
                     placement + resume,
                 -1);
  if (generation > 0) {
    // A line among the workers' in `ltrain logs`, where the steps of the new generation begin again.
    AddEventLocked(job, "log",
                   "generation " + std::to_string(generation) + " begins" +
                       (resume.empty() ? " from the start" : resume),
                   -1);
    writer_.Enqueue("append the generation line of " + job.job.id(),
                    [line = job.events.back()](StateStore& store) { return store.AppendLogs({line}); },
                    /*droppable=*/true);
  }
  cv_.notify_all();
  return true;
}

void Coordinator::StopGenerationLocked(ActiveJob& job, const std::string& reason) {
  for (const auto& node_id : job.nodes) {
    auto node = nodes_.find(node_id);
    if (node == nodes_.end()) continue;
    node->second.jobs.erase(job.job.id());
    v1::Command command;
    command.mutable_stop()->set_job_id(job.job.id());
    command.mutable_stop()->set_reason(reason);
    command.mutable_stop()->set_generation(job.job.generation());
    QueueCommandLocked(node->second, command);
  }
  job.nodes.clear();
}

void Coordinator::FailGenerationLocked(ActiveJob& job, const std::string& cause, bool restartable) {
  if (job.job.state() != v1::JOB_STATE_RUNNING) return;  // only the first failure of a generation counts
  if (job.stopping) {
    // A job being stopped is not restarted: it ends STOPPED as a plain stop would have left it.
    AbandonCheckpointStopLocked(job, cause);
    return;
  }
  job.job.set_last_failure(cause);
  job.failures.push_back("generation " + std::to_string(job.job.generation()) + ": " + cause);
  AddEventLocked(job, "failure", "generation " + std::to_string(job.job.generation()) + " failed: " + cause, -1);
  std::optional<int64_t> delay =
      restartable ? PolicyOf(job.recipe).NextDelayMs(job.job.restarts()) : std::optional<int64_t>();
  if (!delay) {
    std::string verdict = cause;
    if (job.job.restarts() > 0) {
      verdict = "failed " + std::to_string(job.failures.size()) + " times, giving up after " +
                std::to_string(job.job.restarts()) + " restart(s) (fault.max_restarts=" +
                std::to_string(job.recipe.fault.max_restarts) + "); the causes, oldest first:";
      for (const auto& failure : job.failures) verdict += "\n  " + failure;
    }
    FinishLocked(job, v1::JOB_STATE_FAILED, verdict);
    return;
  }
  StopGenerationLocked(job, "generation " + std::to_string(job.job.generation()) + " failed: " + cause);
  job.job.set_restarts(job.job.restarts() + 1);
  job.job.set_state(v1::JOB_STATE_RESTARTING);
  job.restart_at_ms = clock_->SteadyMs() + *delay;
  PersistJobLocked(job);
  // A program under ltrain run keeps its own checkpoints, if any: it is started again, and what it
  // loads is its own to say.
  std::string from = !job.recipe.entrypoint.command.empty() ? ": the program starts again on every rank"
                     : job.job.last_committed_step() > 0
                         ? ", from the checkpoint of step " + std::to_string(job.job.last_committed_step())
                         : ", from the start (no checkpoint committed yet)";
  AddEventLocked(job, "restarting",
                 "restart " + std::to_string(job.job.restarts()) + " of " + std::to_string(job.recipe.fault.max_restarts) +
                     " in " + Seconds(*delay) + from,
                 -1);
  ScheduleLocked();
}

void Coordinator::GiveUpRestartLocked(ActiveJob& job, const std::string& cause) {
  job.job.set_restarts(job.job.restarts() - 1);  // the restart it waited for is not made
  job.job.set_last_failure(cause);
  job.failures.push_back("generation " + std::to_string(job.job.generation()) + ": " + cause);
  AddEventLocked(job, "failure", "generation " + std::to_string(job.job.generation()) + " failed: " + cause, -1);
  std::string verdict =
      "a rank refused to start, and a restart would meet the same refusal; the causes, oldest first:";
  for (const auto& failure : job.failures) verdict += "\n  " + failure;
  FinishLocked(job, v1::JOB_STATE_FAILED, verdict);
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
    // Once applied, or refused for good (then followers are not held back by it), it may be shown.
    writer_.Enqueue(
        "append an event of " + job.job.id(), [event](StateStore& store) { return store.AppendEvent(event).status(); },
        /*droppable=*/false, [this, seq = event.seq()] { MarkStored(seq); });
    LTRAIN_LOG(kInfo, kLog) << job.job.id() << ": " << message;
  }
  job.events.push_back(std::move(event));
  if (job.events.size() > options_.max_buffered_events) {
    job.events.erase(job.events.begin(), job.events.begin() + job.events.size() / 4);
  }
  cv_.notify_all();
}

void Coordinator::MarkStored(int64_t seq) {
  int64_t stored = stored_seq_.load();
  while (stored < seq && !stored_seq_.compare_exchange_weak(stored, seq)) {
  }
  // Taken and released so that a follower between its look and its wait is waiting by now.
  { std::lock_guard<std::mutex> lock(mu_); }
  cv_.notify_all();
}

void Coordinator::PersistJobLocked(ActiveJob& job) {
  job.job.set_updated_unix_ms(clock_->UnixMs());
  writer_.Enqueue("update job " + job.job.id(), [record = job.job](StateStore& store) { return store.UpdateJob(record); });
}

Status Coordinator::CheckStateWritable() const {
  std::optional<std::string> failure = writer_.Failure();
  if (!failure) return Status::Ok();
  if (!options_.state_name.empty()) {
    return Unavailable("the coordinator takes no new work while it cannot write its state (" + options_.state_name +
                       "): " + *failure + "; running jobs go on, and new work is accepted once writes succeed again");
  }
  return Unavailable("the coordinator takes no new work while it cannot write its state (" +
                     (std::filesystem::path(options_.state_dir) / "state.db").string() + "): " + *failure +
                     "; running jobs go on, and new work is accepted once writes succeed again "
                     "(free disk space, or fix the file's permissions)");
}

void Coordinator::FlushState() { writer_.Flush(); }

std::optional<std::string> Coordinator::StateFailure() const { return writer_.Failure(); }

void Coordinator::FinishLocked(ActiveJob& job, v1::JobState state, const std::string& cause) {
  if (IsFinal(job.job.state())) return;
  job.job.clear_limits();
  bool all_exited = static_cast<int>(job.ranks_exited_ok.size()) == job.job.world_size();
  if (job.job.state() == v1::JOB_STATE_RUNNING && state != v1::JOB_STATE_SUCCEEDED && !all_exited) {
    StopGenerationLocked(job, cause);
  }
  for (const auto& node_id : job.nodes) {
    auto node = nodes_.find(node_id);
    if (node != nodes_.end()) node->second.jobs.erase(job.job.id());
  }
  job.nodes.clear();
  job.job.set_state(state);
  job.job.set_cause(cause);
  FreeKeysLocked(job.job.id(), "");
  PersistJobLocked(job);
  AddEventLocked(job, "state", std::string("job ") + JobStateName(state) + (cause.empty() ? "" : ": " + cause), -1);
  ScheduleLocked();
}

StatusOr<v1::Job> Coordinator::GetJob(const std::string& job_id) {
  {
    // A job this coordinator holds is answered from memory: at once, also while the state's writes
    // wait or fail (a full disk, an etcd election).
    std::lock_guard<std::mutex> lock(mu_);
    if (ActiveJob* active = FindLocked(job_id)) {
      v1::Job job = active->job;
      job.clear_ranks();
      job.clear_nodes();
      for (const auto& [index, rank] : active->ranks) *job.add_ranks() = rank;
      job.set_mfu(IsFinal(active->job.state()) ? 0 : active->job.mfu());
      job.set_eta_s(IsFinal(active->job.state()) ? 0 : active->job.eta_s());
      int64_t now = clock_->SteadyMs();
      for (auto& rank : *job.mutable_ranks()) {
        auto progress = active->progress.find(rank.rank());
        if (progress == active->progress.end()) continue;
        rank.set_last_step(progress->second.report.step());
        rank.set_phase(progress->second.report.phase());
        rank.set_progress_age_ms(progress->second.report.idle_ms() + now - progress->second.received_ms);
        rank.set_work(DescribeWork(progress->second.report.work()));
        rank.set_compute_ms(progress->second.report.completed().compute_ms());
        rank.set_memory_bytes(progress->second.report.completed().memory_bytes());
        rank.set_straggler(active->stragglers.named().count(rank.rank()) > 0);
      }
      for (const auto& node_id : active->nodes) {
        auto node = nodes_.find(node_id);
        if (node == nodes_.end()) continue;
        *job.add_nodes() = StatusOfNode(node_id, node->second, now);
      }
      return job;
    }
  }
  // A job of an earlier coordinator, or one that ended a while ago: its stored record.
  writer_.Flush();
  return store_->GetJob(job_id);
}

StatusOr<std::vector<v1::Job>> Coordinator::ListJobs(int limit) {
  writer_.Flush();
  StatusOr<std::vector<v1::Job>> jobs = store_->ListJobs(limit);
  if (!jobs.ok()) return jobs;
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& job : *jobs) {
    if (ActiveJob* active = FindLocked(job.id())) {
      job.set_last_step(active->job.last_step());
      job.set_last_loss(active->job.last_loss());
    }
  }
  return jobs;
}

StatusOr<v1::Job> Coordinator::Stop(const std::string& job_id, const std::string& reason, const StopOptions& options) {
  if (options.checkpoint && options.checkpoint_timeout_ms <= 0) {
    return InvalidArgument("the timeout of a stop with a final checkpoint must be positive, not " +
                           Seconds(options.checkpoint_timeout_ms));
  }
  std::unique_lock<std::mutex> lock(mu_);
  ActiveJob* job = FindLocked(job_id);
  if (job == nullptr) {
    lock.unlock();
    writer_.Flush();
    StatusOr<v1::Job> stored = store_->GetJob(job_id);
    if (!stored.ok()) return stored;
    if (IsFinal(stored->state())) return stored;
    return FailedPrecondition("job " + job_id + " is not run by this coordinator");
  }
  const std::string why = reason.empty() ? "stopped by the user" : reason;
  // Only running workers can take a final checkpoint; a pending or restarting job stops at once.
  if (!options.checkpoint || job->job.state() != v1::JOB_STATE_RUNNING) {
    FinishLocked(*job, v1::JOB_STATE_STOPPED, why);
    return job->job;
  }
  if (job->stopping) return job->job;
  job->stopping = true;
  job->stop_reason = why;
  job->stop_timeout_ms = options.checkpoint_timeout_ms;
  job->stop_deadline_ms = clock_->SteadyMs() + options.checkpoint_timeout_ms;
  job->committed_at_stop = job->job.last_committed_step();
  for (const auto& node_id : job->nodes) {
    auto node = nodes_.find(node_id);
    if (node == nodes_.end()) continue;
    v1::Command command;
    v1::StopJobCommand* stop = command.mutable_stop();
    stop->set_job_id(job_id);
    stop->set_reason(why);
    stop->set_generation(job->job.generation());
    stop->set_checkpoint(true);
    QueueCommandLocked(node->second, std::move(command));
  }
  AddEventLocked(*job, "stopping",
                 "stopping job " + job_id + " after a final checkpoint at a step every rank reaches (a plain stop " +
                     "if that takes more than " + Seconds(options.checkpoint_timeout_ms) + "): " + why,
                 -1);
  return job->job;
}

void Coordinator::AbandonCheckpointStopLocked(ActiveJob& job, const std::string& why) {
  std::string kept = job.job.last_committed_step() > 0
                         ? "the last commit, step " + std::to_string(job.job.last_committed_step()) + ", is kept"
                         : "no checkpoint was ever committed";
  FinishLocked(job, v1::JOB_STATE_STOPPED, job.stop_reason + "; no final checkpoint: " + why + "; " + kept);
}

StatusOr<v1::Job> Coordinator::Resume(const std::string& job_id, int64_t* resumed_seq) {
  LTRAIN_RETURN_IF_ERROR(CheckStateWritable());
  writer_.Flush();
  StatusOr<v1::Job> stored = store_->GetJob(job_id);
  if (!stored.ok()) return stored;
  std::lock_guard<std::mutex> lock(mu_);
  ActiveJob* job = FindLocked(job_id);
  v1::JobState state = job ? job->job.state() : stored->state();
  if (state != v1::JOB_STATE_FAILED && state != v1::JOB_STATE_STOPPED) {
    return FailedPrecondition("job " + job_id + " is " + JobStateName(state) +
                              "; only a FAILED or STOPPED job can be resumed");
  }
  if (job == nullptr) {
    RecipeParseResult parsed = ParseRecipe(stored->recipe_yaml(), job_id);
    if (!parsed.ok()) return InvalidArgument("the stored recipe of " + job_id + " no longer parses: " + parsed.ErrorText());
    job = &jobs_[job_id];
    job->job = *stored;
    job->job.clear_ranks();
    job->recipe = parsed.recipe;
    job->recorded_before = stored->last_committed_step();
  }
  job->next_generation = job->job.generation() + 1;
  job->job.set_state(v1::JOB_STATE_PENDING);
  job->job.set_cause("");
  PersistJobLocked(*job);
  AddEventLocked(*job, "resumed",
                 "job " + job_id + " resumed from " +
                     (job->job.last_committed_step() > 0
                          ? "the checkpoint of step " + std::to_string(job->job.last_committed_step())
                          : std::string("the start (no checkpoint was committed)")),
                 -1);
  if (resumed_seq != nullptr) *resumed_seq = job->events.back().seq();
  pending_.push_back(job_id);
  ScheduleLocked();
  return job->job;
}

StatusOr<std::vector<v1::Event>> Coordinator::WaitEvents(const std::string& job_id, int64_t after_seq, bool logs,
                                                         int64_t timeout_ms, bool* finished) {
  std::unique_lock<std::mutex> lock(mu_);
  ActiveJob* job = FindLocked(job_id);
  if (job == nullptr) {
    // A job of an earlier coordinator that ended: its stored history.
    lock.unlock();
    writer_.Flush();
    LTRAIN_ASSIGN_OR_RETURN(v1::Job stored, store_->GetJob(job_id));
    *finished = true;
    return store_->EventsAfter(job_id, after_seq);
  }
  // In order, up to the first event the state does not have yet when followers see only stored ones.
  bool held_back = false;
  auto collect = [&]() {
    std::vector<v1::Event> out;
    held_back = false;
    const int64_t stored = stored_seq_.load();
    for (const auto& event : job->events) {
      if (options_.show_events_once_stored && event.kind() != "log" && event.seq() > stored) {
        held_back = true;
        break;
      }
      if (event.seq() > after_seq && (logs || event.kind() != "log")) out.push_back(event);
    }
    return out;
  };
  std::vector<v1::Event> events = collect();
  if (events.empty() && (!IsFinal(job->job.state()) || held_back) && !shutting_down_) {
    cv_.wait_for(lock, std::chrono::milliseconds(timeout_ms));
    events = collect();
  }
  *finished = IsFinal(job->job.state()) && events.empty() && !held_back;
  return events;
}

void Coordinator::QueueCommandLocked(NodeState& node, v1::Command command) {
  if (node.deliver) {
    node.deliver(command);
  } else {
    node.commands.push_back(std::move(command));
  }
}

Status Coordinator::ReportProgress(const v1::ProgressReport& request) {
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& report : request.progress()) {
    if (ActiveJob* job = FindLocked(report.job_id())) ApplyProgressLocked(*job, report);
  }
  return Status::Ok();
}

void Coordinator::ApplyProgressLocked(ActiveJob& job, const v1::RankProgress& report) {
  if (report.generation() != job.job.generation()) return;
  // Heartbeats and the ordered reports travel apart. After the coordinator was away, a heartbeat
  // with a rank's newest commit can come before the ordered reports of the commits made meanwhile:
  // those still reach the ledger.
  RecordCommitLocked(job, report.committed_step(), report.committed_path(), report.rank());
  auto [found, added] = job.progress.try_emplace(report.rank());
  Progress& progress = found->second;
  // Otherwise an older report than one already applied (its news is in the newer one) changes nothing.
  if (!added && report.seq() < progress.report.seq()) return;
  progress.report = report;
  progress.received_ms = clock_->SteadyMs();
  if (job.replacing_rank == report.rank() || (job.replacing_rank < 0 && job.shrunk_since_ms >= 0)) {
    NoteRecoveryProgressLocked(job, report);
  }
  if (report.stopped_after_checkpoint()) job.stopped_early = true;
  if (report.has_completed()) job.times.ObserveStep(report.completed().step(), report.completed().step_ms());
  if (report.save_ms() > 0) job.times.ObserveSave(report.save_ms());
  if (report.rank() == 0 && report.save_ms() > 0) {
    job.job.set_checkpoint_save_ms(report.save_ms());
    job.job.set_checkpoint_save_bytes(report.save_bytes());
  }
  if (report.rank() == 0 && report.load_ms() > 0) job.job.set_checkpoint_load_ms(report.load_ms());
  if (report.rank() == 0 && report.load_step() > 0 && !job.resume_compared) {
    job.resume_compared = true;
    // The generation was placed "resuming from the checkpoint of step N", the newest commit recorded;
    // the ranks read what the directory holds, and may take an older commit (step N's did not verify)
    // or a newer one (its report was lost with the failed generation).
    const int64_t announced = job.committed_at_start, loaded = report.load_step();
    if (job.job.generation() > 0 && announced > 0 && loaded != announced) {
      AddEventLocked(job, "loaded",
                     "the ranks resumed from the checkpoint of step " + std::to_string(loaded) + ", not step " +
                         std::to_string(announced) + "'s: " +
                         (loaded < announced ? "step " + std::to_string(announced) +
                                                   "'s did not load (rank 0's log says why)"
                                             : "it is a newer commit than the one recorded"),
                     0);
      if (loaded < announced) {
        // The ledger's newest commit is the one the ranks could load: the job's record says so, and the
        // commits made again above it are recorded and said again as they come.
        job.committed_at_start = loaded;
        job.job.set_last_committed_step(loaded);
        job.job.set_last_committed_path(report.committed_step() == loaded ? report.committed_path() : "");
        job.recorded_before = std::min(job.recorded_before, loaded);
        job.recorded_commits.erase(job.recorded_commits.upper_bound(loaded), job.recorded_commits.end());
        PersistJobLocked(job);
      }
    }
  }
  if (report.rank() != 0 || !report.has_completed()) return;
  const v1::StepFigures& step = report.completed();
  const bool new_eval = report.eval_step() > 0 && (report.eval_step() != job.job.val_step() ||
                                                   report.val_loss() != job.job.val_loss());
  if (new_eval) {
    job.job.set_val_step(report.eval_step());
    job.job.set_val_loss(report.val_loss());
  }
  // In doubles: a report's step numbers may be anything, and their difference must not overflow.
  const double eta_s =
      std::max(0.0, static_cast<double>(step.total_steps()) - static_cast<double>(step.step())) * step.step_ms() / 1000.0;
  if (step.step() == job.job.last_step() && step.total_steps() == job.job.total_steps() &&
      step.loss() == job.job.last_loss() && step.tokens_per_s() == job.job.tokens_per_s() &&
      step.mfu() == job.job.mfu() && eta_s == job.job.eta_s() && !new_eval) {
    return;  // nothing new since the last report
  }
  if (step.step() != job.job.last_step()) {
    std::vector<SeriesPoint>& points = job.series.steps;
    while (!points.empty() && points.back().step >= step.step()) points.pop_back();  // a restart went back
    points.push_back({step.step(), clock_->UnixMs(), step.loss(), step.tokens_per_s(), step.step_ms(), step.mfu()});
    if (points.size() > kMaxSeriesPoints) {
      // Every other point of the older half: the curve keeps its shape, the memory stays bounded.
      std::vector<SeriesPoint> kept;
      for (size_t i = 0; i < points.size(); ++i) {
        if (i >= points.size() / 2 || i % 2 == 0) kept.push_back(points[i]);
      }
      points = std::move(kept);
    }
  }
  if (new_eval) {
    std::vector<ValPoint>& val = job.series.val;
    while (!val.empty() && val.back().step >= report.eval_step()) val.pop_back();
    val.push_back({report.eval_step(), report.val_loss()});
  }
  job.job.set_last_step(step.step());
  job.job.set_total_steps(step.total_steps());
  job.job.set_last_loss(step.loss());
  job.job.set_tokens_per_s(step.tokens_per_s());
  job.job.set_mfu(step.mfu());
  job.job.set_eta_s(eta_s);
  PersistJobLocked(job);
}

StatusOr<JobSeries> Coordinator::Series(const std::string& job_id) {
  std::lock_guard<std::mutex> lock(mu_);
  ActiveJob* job = FindLocked(job_id);
  if (job == nullptr) return NotFound("job " + job_id + " is not held by this coordinator");
  return job->series;
}

StatusOr<std::vector<v1::Event>> Coordinator::RecentEvents(const std::string& job_id, int max_events, int max_logs) {
  std::lock_guard<std::mutex> lock(mu_);
  ActiveJob* job = FindLocked(job_id);
  if (job == nullptr) return NotFound("job " + job_id + " is not held by this coordinator");
  std::vector<v1::Event> out;
  int events = 0, logs = 0;
  for (auto it = job->events.rbegin(); it != job->events.rend() && (events < max_events || logs < max_logs); ++it) {
    int& count = it->kind() == "log" ? logs : events;
    if (count >= (it->kind() == "log" ? max_logs : max_events)) continue;
    ++count;
    out.push_back(*it);
  }
  std::reverse(out.begin(), out.end());
  return out;
}

Status Coordinator::ReportWorkerState(const v1::WorkerStateReport& report) {
  std::pair<std::string, std::string> announce;
  Status status;
  {
    std::lock_guard<std::mutex> lock(mu_);
    status = ReportWorkerStateLocked(report, &announce);
  }
  // A replaced rank's new membership, for the survivors waiting on it (KvSet takes mu_ itself).
  if (!announce.first.empty()) {
    if (Status set = KvSet(announce.first, announce.second); !set.ok()) {
      LTRAIN_LOG(kWarning, kLog) << "the new membership of " << report.job_id() << " was not published: " << set.message();
    }
  }
  return status;
}

Status Coordinator::ReportWorkerStateLocked(const v1::WorkerStateReport& report,
                                            std::pair<std::string, std::string>* announce) {
  ActiveJob* job = FindLocked(report.job_id());
  if (job == nullptr) return NotFound("job " + report.job_id() + " is not run by this coordinator");
  if (report.generation() != job->job.generation()) return Status::Ok();  // a stale generation
  // What the rank reported last comes before its exit: a commit, its last step, a stop after a
  // final checkpoint.
  if (report.has_progress()) ApplyProgressLocked(*job, report.progress());
  v1::RankInfo rank;
  rank.set_rank(report.rank());
  rank.set_node_id(report.node_id());
  rank.set_local_rank(report.rank() % std::max(1, job->recipe.parallel.nproc_per_node));
  rank.set_pid(report.pid());
  rank.set_state(report.state());
  rank.set_exit_code(report.exit_code());
  rank.set_signal(report.signal());
  rank.set_log_path(report.log_path());
  // The step it was in when it exited stays with the rank after the job (and the coordinator) ended.
  if (report.has_progress()) rank.set_last_step(report.progress().step());
  job->ranks[rank.rank()] = rank;
  writer_.Enqueue("record rank " + std::to_string(rank.rank()) + " of " + job->job.id(),
                  [id = job->job.id(), rank](StateStore& store) { return store.UpsertRank(id, rank); });
  if (report.state() == "running") {
    AddEventLocked(*job, "rank_started",
                   "rank " + std::to_string(report.rank()) + " started on " + report.node_id() + " (pid " +
                       std::to_string(report.pid()) + ")",
                   report.rank());
    return Status::Ok();
  }
  bool clean = report.signal() == 0 && report.exit_code() == 0;
  std::string how = report.oom_killed()      ? "was killed by the kernel's out-of-memory killer (SIGKILL)"
                    : report.signal() != 0   ? "was killed by signal " + SignalName(report.signal())
                                             : "exited with code " + std::to_string(report.exit_code());
  AddEventLocked(*job, "rank_exited", "rank " + std::to_string(report.rank()) + " " + how, report.rank());
  // A worker that refused to start (kWorkerExitNoRestart) would refuse again after a restart. A program of
  // the user's own (entrypoint.command) owns its exit codes: 3 is a failure like 1, restarted as torchrun
  // restarts any.
  const bool refused = report.refused() || (!job->recipe.runs_program() && report.signal() == 0 &&
                                            report.exit_code() == kWorkerExitNoRestart);
  auto cause = [&] {
    std::string text = "rank " + std::to_string(report.rank()) + " on " + report.node_id() + " " + how;
    if (report.has_program_error()) return text + ProgramErrorText(report.program_error(), report.log_path());
    if (report.log_tail_size() > 0) {
      text += "; last lines of its log (" + report.log_path() + "):";
      for (const auto& line : report.log_tail()) text += "\n    " + StoredLine(line);
    } else if (!report.log_path().empty()) {
      text += "; its log " + report.log_path() + " is empty";
    }
    return text;
  };
  if (job->job.state() == v1::JOB_STATE_RESTARTING && refused) {
    // The generation failed first through a peer (whose connections this rank's exit may have cut while
    // it was still connecting), and waits to restart: the restart would meet the same refusal.
    GiveUpRestartLocked(*job, cause());
    return Status::Ok();
  }
  if (job->job.state() != v1::JOB_STATE_RUNNING) return Status::Ok();
  if (clean) {
    job->ranks_exited_ok.insert(report.rank());
    if (static_cast<int>(job->ranks_exited_ok.size()) == job->job.world_size()) {
      if ((job->stopping || job->stopped_early) && job->job.last_step() < job->recipe.training.steps) {
        if (job->stop_reason.empty()) job->stop_reason = "stopped after a final checkpoint";
        std::string how = job->job.last_committed_step() > job->committed_at_stop
                              ? "; final checkpoint of step " + std::to_string(job->job.last_committed_step()) +
                                    " committed"
                              : "; the ranks stopped after step " + std::to_string(job->job.last_step()) +
                                    " without a new checkpoint";
        FinishLocked(*job, v1::JOB_STATE_STOPPED, job->stop_reason + how);
      } else {
        FinishLocked(*job, v1::JOB_STATE_SUCCEEDED, "");
      }
    }
    return Status::Ok();
  }
  // A rank killed (a crash, the OOM killer, an operator) is replaced in place; one that exits with an
  // error of its own (its data, its numbers, no copy of its state left) would meet it again: the job restarts.
  if (!refused && !job->stopping && report.signal() != 0) {
    std::string why;
    *announce = ReplaceRankLocked(*job, report.rank(), cause(), &why);
    if (!announce->first.empty()) return Status::Ok();
    if (job->recipe.fault.recovery == Recovery::kInPlace) {
      AddEventLocked(*job, "recovery", "rank " + std::to_string(report.rank()) + " is not replaced in place: " + why +
                                           "; the job restarts", report.rank());
    }
  }
  FailGenerationLocked(*job, cause(), !refused);
  return Status::Ok();
}

void Coordinator::RecordCommitLocked(ActiveJob& job, int64_t step, const std::string& path, int rank) {
  if (step <= job.recorded_before || !job.recorded_commits.insert(step).second) return;
  // A commit older than the newest (reported late) goes to the ledger and the history only.
  const bool newest = step > job.job.last_committed_step();
  if (newest) {
    job.job.set_last_committed_step(step);
    job.job.set_last_committed_path(path);
  }
  writer_.Enqueue("record the checkpoint of step " + std::to_string(step) + " of " + job.job.id(),
                  [id = job.job.id(), step, generation = job.job.generation(), path,
                   now = clock_->UnixMs()](StateStore& store) {
                    return store.RecordCheckpoint(id, step, generation, path, now);
                  });
  if (newest) PersistJobLocked(job);
  AddEventLocked(job, "checkpoint",
                 "checkpoint of step " + std::to_string(step) + " committed: " + path +
                     (newest ? "" : " (reported after step " + std::to_string(job.job.last_committed_step()) + "'s)"),
                 rank);
}

void Coordinator::PushLogs(const v1::PushLogsRequest& request) {
  std::lock_guard<std::mutex> lock(mu_);
  ActiveJob* job = FindLocked(request.job_id());
  if (job == nullptr) return;
  std::vector<v1::Event> stored;
  for (const auto& line : request.lines()) {
    AddEventLocked(*job, "log", StoredLine(line.text()), line.rank());
    stored.push_back(job->events.back());
  }
  if (stored.empty()) return;
  writer_.Enqueue("append log lines of " + job->job.id(),
                  [lines = std::move(stored)](StateStore& store) { return store.AppendLogs(lines); },
                  /*droppable=*/true);
}

StatusOr<std::vector<v1::Event>> Coordinator::GetLogs(const std::string& job_id, int rank, int64_t since_unix_ms,
                                                      int limit) {
  writer_.Flush();
  LTRAIN_ASSIGN_OR_RETURN(v1::Job job, store_->GetJob(job_id));
  return store_->Logs(job_id, rank, since_unix_ms, limit);
}

void Coordinator::CheckStragglersLocked(ActiveJob& job) {
  // Ranks are placed in order, nproc_per_node to each of the generation's nodes.
  auto node_of = [&](int rank) {
    const size_t i = static_cast<size_t>(rank / std::max(1, job.recipe.parallel.nproc_per_node));
    return i < job.nodes.size() ? job.nodes[i] : std::string("?");
  };
  std::vector<RankCompute> figures;
  int64_t step = 0;  // the newest step a rank completed
  for (const auto& [rank, progress] : job.progress) {
    const v1::StepFigures& completed = progress.report.completed();
    RankCompute& figure = figures.emplace_back();
    figure.rank = rank;
    figure.compute_ms = completed.compute_ms();
    figure.steps = completed.compute_steps();
    figure.spread_ms = completed.compute_spread_ms();
    figure.node = node_of(rank);
    for (const v1::StepWork& work : completed.compute_work()) {
      figure.work.push_back({work.step(), work.cpu(), work.compute_ms()});
    }
    figure.cores = CoresOf(figure.work);
    step = std::max(step, completed.step());
  }
  if (static_cast<int>(figures.size()) < job.job.world_size()) return;  // not every rank has reported
  char text[320];
  for (const StragglerTracker::Change& change : job.stragglers.Observe(step, figures)) {
    const Straggler& s = change.straggler;
    if (change.named) {
      std::snprintf(text, sizeof(text),
                    "rank %d on %s is a straggler at step %lld: %.1f ms of its own work a step at best over its "
                    "last %d steps (medians of %d), %.2fx the other ranks' median of %.1f ms%s",
                    s.rank, node_of(s.rank).c_str(), static_cast<long long>(step), s.compute_ms, kStragglerMemorySteps,
                    kStragglerWindow, s.compute_ms / s.others_median_ms, s.others_median_ms,
                    s.on_shared_cores ? " on the cores they shared" : "");
    } else {
      std::snprintf(text, sizeof(text), "rank %d on %s is no longer a straggler", s.rank, node_of(s.rank).c_str());
    }
    AddEventLocked(job, "straggler", text, s.rank);
  }
}

void Coordinator::SetLimitsLocked(ActiveJob& job, const PhaseLimits& limits) {
  v1::JobLimits& record = *job.job.mutable_limits();
  const double before = record.step().seconds(), step = limits.step_ms / 1000.0;
  const bool derived_anew = before == 0 || step > 1.2 * before || step < before / 1.2;
  auto set = [](v1::PhaseLimit& limit, int64_t ms, const std::string& how) {
    limit.set_seconds(ms / 1000.0);
    limit.set_how(how);
  };
  set(*record.mutable_step(), limits.step_ms, limits.step_how);
  set(*record.mutable_startup(), limits.startup_ms, limits.startup_how);
  set(*record.mutable_checkpoint(), limits.checkpoint_ms, limits.checkpoint_how);
  if (derived_anew && job.recipe.fault.hang_timeout_s <= 0 && job.times.steps_seen() >= kStartupSteps) {
    AddEventLocked(job, "limits", "a training step's limit is now " + limits.step_how, -1);
  }
}

void Coordinator::CheckHangLocked(ActiveJob& job, int64_t now) {
  std::vector<RankActivity> ranks;
  for (int rank = 0; rank < job.job.world_size(); ++rank) {
    if (job.ranks_exited_ok.count(rank)) continue;
    RankActivity activity;
    activity.rank = rank;
    auto found = job.progress.find(rank);
    if (found == job.progress.end()) {
      activity.idle_ms = activity.silent_ms = now - job.generation_started_ms;
    } else {
      const v1::RankProgress& report = found->second.report;
      int64_t since = now - found->second.received_ms;
      activity.reported = true;
      activity.step = report.step();
      activity.phase = report.phase();
      activity.idle_ms = report.idle_ms() + since;
      activity.silent_ms = report.silent_ms() + since;
      // The oldest collective still in flight is the one the rank waits in (a communication
      // thread may have started later ones).
      for (const auto& collective : report.collectives()) {
        if (collective.end_unix_ms() != 0 && collective.seq() > activity.last_seq) {
          activity.last_seq = collective.seq();
          activity.last_op = collective.op();
          activity.last_group = collective.group();
        }
      }
      for (const auto& collective : report.collectives()) {
        if (collective.end_unix_ms() != 0) continue;
        activity.in_collective = true;
        activity.collective_seq = collective.seq();
        activity.collective_op = collective.op();
        activity.collective_group = collective.group();
        break;
      }
      activity.work = report.work();
    }
    ranks.push_back(activity);
  }
  const PhaseLimits limits = PhaseLimits::Derive(job.recipe, job.times);
  SetLimitsLocked(job, limits);
  std::optional<std::string> hang = DiagnoseHang(ranks, limits);
  if (hang) FailGenerationLocked(job, *hang);
}

void Coordinator::Tick() {
  writer_.Retry();
  ExpireKvWaiters();
  AnnounceOnExit announce(this);
  std::lock_guard<std::mutex> lock(mu_);
  SweepLocked();
  int64_t now = clock_->SteadyMs();
  std::vector<std::pair<std::string, std::string>> lost;
  // Nodes silent past their timeout, with how far past (silence / timeout).
  std::vector<std::pair<std::string, double>> silent;
  int connected = 0;
  for (auto& [id, node] : nodes_) {
    // A node running jobs is lost after the shortest of their heartbeat_interval_s * heartbeat_misses.
    int64_t timeout_ms = options_.node_timeout_ms;
    for (const auto& job_id : node.jobs) {
      if (const ActiveJob* job = FindLocked(job_id)) {
        timeout_ms = std::min<int64_t>(
            timeout_ms, static_cast<int64_t>(job->recipe.fault.heartbeat_interval_s * job->recipe.fault.heartbeat_misses * 1000));
      }
    }
    connected += node.connected ? 1 : 0;
    if (node.connected && now - node.last_heartbeat_ms > timeout_ms) {
      silent.emplace_back(id, static_cast<double>(now - node.last_heartbeat_ms) / static_cast<double>(timeout_ms));
    } else if (node.recovered && now > node.recovery_deadline_ms) {
      lost.emplace_back(id, "it did not come back within " + Seconds(options_.recovery_grace_ms) +
                                " of the coordinator's restart");
    }
  }
  // Heartbeats that stop on many nodes at once, whose streams are still open, say more about this
  // coordinator (overloaded, its replies late) than about the nodes: it waits for them up to
  // kMassSilenceFactor timeouts instead of failing their jobs. One node, or a few, is lost at once.
  const bool mass_silence = static_cast<int>(silent.size()) >= std::max(kMassSilenceNodes, connected / 10);
  int deferred = 0;
  for (const auto& [id, overdue] : silent) {
    if (mass_silence && overdue < kMassSilenceFactor) {
      ++deferred;
      continue;
    }
    lost.emplace_back(id, "no heartbeat for " + Seconds(now - nodes_[id].last_heartbeat_ms));
  }
  if (deferred > 0 && !mass_silence_reported_) {
    LTRAIN_LOG(kWarning, kLog) << deferred << " of " << connected << " connected nodes sent no heartbeat within their "
                               << "timeout at once; this coordinator may be overloaded: they are declared lost only "
                               << "after " << kMassSilenceFactor << " times the timeout";
  }
  mass_silence_reported_ = deferred > 0;
  for (const auto& [id, reason] : lost) LoseNodeLocked(id, reason);
  for (auto it = nodes_.begin(); it != nodes_.end();) {
    const NodeState& node = it->second;
    const bool forget = !node.connected && !node.recovered && node.jobs.empty() && node.lost_ms >= 0 &&
                        now - node.lost_ms >= options_.forget_lost_nodes_ms;
    it = forget ? nodes_.erase(it) : std::next(it);
  }

  for (auto& [id, job] : jobs_) {
    if (job.job.state() == v1::JOB_STATE_RUNNING) {
      CheckHangLocked(job, now);
      CheckStragglersLocked(job);
    }
    if (job.job.state() == v1::JOB_STATE_RUNNING && job.stopping && now >= job.stop_deadline_ms) {
      AbandonCheckpointStopLocked(job, "the ranks did not commit it within " + Seconds(job.stop_timeout_ms));
    }
    if (job.job.state() == v1::JOB_STATE_RESTARTING && now >= job.restart_at_ms) {
      std::vector<std::string> free_nodes = FreeNodesLocked(job.recipe);
      if (static_cast<int>(free_nodes.size()) >= job.recipe.parallel.nodes_min) {
        StartGenerationLocked(job, free_nodes);
      } else if (!job.waiting_reported) {
        job.waiting_reported = true;
        AddEventLocked(job, "waiting",
                       "waiting for nodes: " + FreeNodesText(job.recipe, free_nodes.size()) + ", at least " +
                           std::to_string(job.recipe.parallel.nodes_min) + " needed",
                       -1);
      }
    }
    // Elastic growth: a node that joined is taken in at the next checkpoint boundary.
    if (job.job.state() == v1::JOB_STATE_RUNNING && !job.stopping &&
        job.job.nodes_now() < job.recipe.parallel.nodes_max &&
        job.job.last_committed_step() > job.committed_at_start) {
      std::vector<std::string> free_nodes = FreeNodesLocked(job.recipe);
      if (!free_nodes.empty()) {
        std::vector<std::string> nodes = job.nodes;
        nodes.insert(nodes.end(), free_nodes.begin(), free_nodes.end());
        AddEventLocked(job, "grow",
                       "taking in " + std::to_string(free_nodes.size()) + " node(s) at the checkpoint of step " +
                           std::to_string(job.job.last_committed_step()),
                       -1);
        StopGenerationLocked(job, "the job grows to more nodes");
        StartGenerationLocked(job, nodes);
      }
    }
  }
}

void Coordinator::SweepLocked() {
  const int64_t now = clock_->UnixMs();
  if (now < next_sweep_unix_ms_) return;
  next_sweep_unix_ms_ = now + 3600 * 1000;
  for (auto it = jobs_.begin(); it != jobs_.end();) {
    const v1::Job& job = it->second.job;
    if (IsFinal(job.state()) && now - job.updated_unix_ms() >= options_.keep_finished_in_memory_ms) {
      it = jobs_.erase(it);
    } else {
      ++it;
    }
  }
  if (options_.retain_ms <= 0) return;
  const int64_t cutoff = now - options_.retain_ms;
  const int64_t days = options_.retain_ms / (24 * 3600 * 1000);
  writer_.Enqueue("remove records older than the retention", [cutoff, days](StateStore& store) -> Status {
    StatusOr<PruneCounts> removed = store.PruneBefore(cutoff);
    if (!removed.ok()) return removed.status();
    if (removed->jobs + removed->events + removed->log_lines > 0) {
      LTRAIN_LOG(kInfo, kLog) << "retention (" << days << " day(s)): removed " << removed->jobs << " job(s), "
                              << removed->events << " event(s) and " << removed->log_lines << " log line(s)";
    }
    return Status::Ok();
  });
}

void Coordinator::Shutdown() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    shutting_down_ = true;
    cv_.notify_all();
  }
  ExpireKvWaiters();
}

bool Coordinator::shutting_down() const {
  std::lock_guard<std::mutex> lock(mu_);
  return shutting_down_;
}

}  // namespace ltrain::launcher
