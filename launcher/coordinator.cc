#include "launcher/coordinator.h"

#include <algorithm>
#include <cstdio>
#include <filesystem>

#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/io/zero_copy_stream_impl_lite.h>
#include <google/protobuf/wire_format_lite.h>

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

std::string StoredLine(const std::string& text) { return BoundedLine(text, 16 << 10); }

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
  job.dump_wait_hang.clear();
  job.dump_nodes_waiting.clear();
  job.dump_deadline_ms = 0;
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
  std::string().swap(job.folded_ranks);
  int nproc = recipe.parallel.nproc_per_node;
  const v1::StartJobCommand base = GenerationCommand(job, recipe, generation);
  FreeKeysLocked(job.job.id(), base.rendezvous_scope());  // older generations' addresses and ids
  std::string placement;
  std::vector<v1::RankInfo> placed_ranks;  // recorded in one write: a job of 80,000 ranks is one transaction
  placed_ranks.reserve(static_cast<size_t>(count) * static_cast<size_t>(nproc));
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
      placed_ranks.push_back(std::move(rank));
    }
    if (i == 0) {
      job.placed = *start;
      job.placed.clear_workers();
    }
    QueueCommandLocked(node, std::move(command));
    placement += (placement.empty() ? "" : ", ") + RankRange(i * nproc, i * nproc + nproc - 1) + " on " + nodes[i] +
                 " (" + node.facts.hostname() + ")";
  }
  writer_.Enqueue("record the " + std::to_string(placed_ranks.size()) + " ranks of " + job.job.id(),
                  [id = job.job.id(), ranks = std::move(placed_ranks)](StateStore& store) { return store.UpsertRanks(id, ranks); });
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
      job.set_mfu(IsFinal(active->job.state()) ? 0 : active->job.mfu());
      job.set_eta_s(IsFinal(active->job.state()) ? 0 : active->job.eta_s());
      const int64_t now = clock_->SteadyMs();
      ShownRanksLocked(*active, now, job.mutable_ranks());
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

void Coordinator::ShowProgressLocked(const ActiveJob& job, int64_t now, v1::RankInfo* rank) const {
  auto progress = job.progress.find(rank->rank());
  if (progress == job.progress.end()) return;
  rank->set_last_step(progress->second.report.step());
  rank->set_phase(progress->second.report.phase());
  rank->set_progress_age_ms(progress->second.report.idle_ms() + now - progress->second.received_ms);
  rank->set_work(DescribeWork(progress->second.report.work()));
  rank->set_compute_ms(progress->second.report.completed().compute_ms());
  rank->set_memory_bytes(progress->second.report.completed().memory_bytes());
  rank->set_straggler(job.stragglers.named().count(rank->rank()) > 0);
}

void Coordinator::ShownRanksLocked(const ActiveJob& job, int64_t now,
                                   google::protobuf::RepeatedPtrField<v1::RankInfo>* out) const {
  if (!job.folded_ranks.empty()) {
    v1::Job folded;
    folded.ParseFromString(job.folded_ranks);
    out->Swap(folded.mutable_ranks());
    for (auto& rank : *out) {
      if (!rank.phase().empty()) rank.set_progress_age_ms(rank.progress_age_ms() + now - job.folded_ms);
    }
    return;
  }
  out->Reserve(static_cast<int>(job.ranks.size()));
  for (const auto& [index, rank] : job.ranks) {
    v1::RankInfo* shown = out->Add();
    *shown = rank;
    ShowProgressLocked(job, now, shown);
  }
}

void Coordinator::FoldRanksLocked(ActiveJob& job) {
  if (!job.folded_ranks.empty() || (job.ranks.empty() && job.progress.empty())) return;
  const int64_t now = clock_->SteadyMs();
  // Written rank by rank as a v1::Job's `ranks` field, one record at a time: tens of thousands of
  // records made at once only to be serialized would stay as free memory in this thread's arena.
  {
    google::protobuf::io::StringOutputStream stream(&job.folded_ranks);
    google::protobuf::io::CodedOutputStream out(&stream);
    v1::RankInfo shown;
    for (const auto& [index, rank] : job.ranks) {
      shown = rank;
      ShowProgressLocked(job, now, &shown);
      out.WriteTag(google::protobuf::internal::WireFormatLite::MakeTag(
          v1::Job::kRanksFieldNumber, google::protobuf::internal::WireFormatLite::WIRETYPE_LENGTH_DELIMITED));
      out.WriteVarint32(static_cast<uint32_t>(shown.ByteSizeLong()));
      shown.SerializeWithCachedSizes(&out);
    }
  }
  job.folded_ranks.shrink_to_fit();
  job.folded_ms = now;
  // Swapped out, so that their memory goes.
  std::map<int, v1::RankInfo>().swap(job.ranks);
  std::map<int, Progress>().swap(job.progress);
  job.stragglers = StragglerTracker();
}

HeldFigures Coordinator::held_figures() const {
  std::lock_guard<std::mutex> lock(mu_);
  HeldFigures held;
  held.jobs = static_cast<int64_t>(jobs_.size());
  for (const auto& [id, job] : jobs_) {
    held.rank_records += static_cast<int64_t>(job.ranks.size() + job.progress.size());
    held.folded_rank_bytes += static_cast<int64_t>(job.folded_ranks.size());
  }
  held.nodes = static_cast<int64_t>(nodes_.size());
  held.rendezvous_keys = static_cast<int64_t>(kv_.size());
  return held;
}

void Coordinator::UnfoldRanksLocked(ActiveJob& job) {
  if (job.folded_ranks.empty()) return;
  google::protobuf::RepeatedPtrField<v1::RankInfo> shown;
  ShownRanksLocked(job, clock_->SteadyMs(), &shown);
  std::string().swap(job.folded_ranks);
  for (v1::RankInfo& rank : shown) {
    const int index = rank.rank();
    job.ranks[index] = std::move(rank);
  }
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
    node.deliver(std::move(command));
  } else {
    node.commands.push_back(std::move(command));
  }
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
    if (IsFinal(job.job.state()) && now - job.ranks_changed_ms >= kFoldQuietMs) {
      // Once none of its ranks runs, or a while after the end whatever they last said (a rank that
      // reports later unfolds them).
      const bool running = std::any_of(job.ranks.begin(), job.ranks.end(),
                                       [](const auto& rank) { return rank.second.state() == "running"; });
      if (!running || clock_->UnixMs() - job.job.updated_unix_ms() >= kFoldRanksAfterMs) FoldRanksLocked(job);
    }
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
  for (auto it = jobs_.begin(); it != jobs_.end();) {
    const v1::Job& job = it->second.job;
    if (IsFinal(job.state()) && now - job.updated_unix_ms() >= options_.keep_finished_in_memory_ms) {
      it = jobs_.erase(it);
    } else {
      ++it;
    }
  }
  if (now < next_sweep_unix_ms_) return;
  next_sweep_unix_ms_ = now + 3600 * 1000;
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
