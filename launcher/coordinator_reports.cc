// What the ranks report, as the coordinator applies it: their progress (steps, commits, the figures
// of `ltrain status`), their exits (a failed rank's cause, a program's exception), and what is judged
// from them each tick: stragglers, the limits derived from the run, hangs. Part of Coordinator
// (coordinator.h).
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <string>

#include "common/files.h"
#include "common/logging.h"
#include "common/signal_name.h"
#include "common/strings.h"
#include "common/worker_exit.h"
#include "launcher/coordinator.h"
#include "launcher/flight_analysis.h"
#include "launcher/hang_diagnosis.h"

namespace ltrain::launcher {
namespace {

constexpr const char* kLog = "coordinator";
constexpr size_t kMaxSeriesPoints = 4000;  // a job's curve points in memory (JobSeries)

// A program's exception, as torchrun prints its root cause: the message, where the rank wrote it and
// when, and the traceback.
std::string ProgramErrorText(const v1::ProgramError& error, const std::string& log_path) {
  std::string text = ": " + StoredLine(error.message().empty() ? "(no message)" : error.message());
  text += " (error file " + error.error_file();
  if (error.timestamp_s() > 0) text += ", written " + UtcTime(error.timestamp_s() * 1000, "%Y-%m-%d %H:%M:%S UTC");
  if (!log_path.empty()) text += "; its log " + log_path;
  text += ")";
  if (!error.traceback().empty()) {
    text += "; traceback:";
    // Python's own, bounded as a log tail is.
    const std::vector<std::string> lines = Split(error.traceback(), '\n');
    for (size_t i = 0; i < lines.size() && i < 200; ++i) {
      if (!lines[i].empty()) text += "\n    " + StoredLine(lines[i]);
    }
  }
  return text;
}

}  // namespace

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
  if (!job.folded_ranks.empty()) return;  // the job ended: its ranks' last progress is folded
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
      step.mfu() == job.job.mfu() && eta_s == job.job.eta_s() && !new_eval &&
      step.has_fp8() == job.job.has_fp8() && step.has_moe() == job.job.has_moe()) {
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
  if (step.has_fp8()) {
    *job.job.mutable_fp8() = step.fp8();
  } else {
    job.job.clear_fp8();
  }
  if (step.has_moe()) {
    *job.job.mutable_moe() = step.moe();
  } else {
    job.job.clear_moe();
  }
  PersistJobLocked(job);
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
  // A program's flight-recorder dumps count also after their generation ended (its ranks dump as
  // they are stopped).
  if (report.flight_records_size() > 0 || report.state() == "collectives") AddFlightRecordsLocked(*job, report);
  if (report.state() == "collectives") return Status::Ok();
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
  UnfoldRanksLocked(*job);  // a report after the end
  // A record that was folded has the rank's last progress in it (a phase; the progress entry went
  // with the fold): kept.
  if (auto folded = job->ranks.find(rank.rank());
      folded != job->ranks.end() && !folded->second.phase().empty() && job->progress.count(rank.rank()) == 0) {
    const v1::RankInfo& before = folded->second;
    if (!report.has_progress()) rank.set_last_step(before.last_step());
    rank.set_phase(before.phase());
    rank.set_progress_age_ms(before.progress_age_ms());
    rank.set_work(before.work());
    rank.set_compute_ms(before.compute_ms());
    rank.set_memory_bytes(before.memory_bytes());
    rank.set_straggler(before.straggler());
  }
  job->ranks_changed_ms = clock_->SteadyMs();
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
  // `also`: a sentence after the exit's, before the log's last lines.
  auto cause = [&](const std::string& also = "") {
    std::string text = "rank " + std::to_string(report.rank()) + " on " + report.node_id() + " " + how + also;
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
  // A rank of the trainer that failed (a collective's error or timeout, NCCL's error, its own) leaves
  // every rank's view beside the cause: where the others wait.
  std::string failure = cause();
  if (!job->recipe.runs_program() && !refused && job->job.world_size() > 1) {
    if (std::string path = WriteCollectivesLocked(*job, "failure", failure); !path.empty()) {
      failure = cause("; every rank's recent collectives: " + path);
    }
  }
  // A program's: the NCCL flight recorder's reading, from the dumps the rank's agent found; the
  // other nodes are asked for theirs before their ranks stop (an event tells what they add).
  if (job->recipe.runs_program()) {
    if (const std::string told = TellFlightRecordsLocked(*job); !told.empty()) failure = cause(told);
    std::vector<std::string> others;
    for (const auto& node : job->nodes) {
      if (node != report.node_id()) others.push_back(node);
    }
    if (!refused) RequestDumpsLocked(*job, others);
  }
  FailGenerationLocked(*job, failure, !refused);
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

std::string Coordinator::WriteJobFileLocked(const ActiveJob& job, const std::string& name, std::string text) {
  if (options_.job_files_dir.empty()) return "";
  const std::filesystem::path dir = std::filesystem::path(options_.job_files_dir) / job.job.id();
  const std::string path = (dir / (name + "-gen-" + std::to_string(job.job.generation()) + ".txt")).string();
  writer_.Enqueue(
      "write " + path,
      [dir, path, text = std::move(text)](StateStore&) {
        Status written = CreateDirectories(dir.string());
        if (written.ok()) written = WriteFileText(path, text);
        if (!written.ok()) LTRAIN_LOG(kWarning, kLog) << path << " was not written: " << written.message();
        return Status::Ok();
      },
      /*droppable=*/true);
  return path;
}

void Coordinator::AddFlightRecordsLocked(ActiveJob& job, const v1::WorkerStateReport& report) {
  if (report.generation() < job.flight_generation) return;
  if (report.generation() > job.flight_generation) {
    job.flight_generation = report.generation();
    job.flight_records.clear();
    job.flight_told.clear();
  }
  for (const auto& record : report.flight_records()) job.flight_records[record.rank()] = record;
  if (report.state() == "collectives") job.dump_nodes_waiting.erase(report.node_id());
  // Told already (the generation failed): what the later dumps add is an event.
  const bool told = job.job.state() != v1::JOB_STATE_RUNNING || report.generation() != job.job.generation();
  if (!told || job.flight_records.empty()) return;
  const std::string before = job.flight_told;
  const std::string now = TellFlightRecordsLocked(job);
  if (now != before) {
    AddEventLocked(job, "flight_recorder", "generation " + std::to_string(report.generation()) + ": " + now.substr(2), -1);
  }
}

std::string Coordinator::TellFlightRecordsLocked(ActiveJob& job) {
  if (job.flight_records.empty() || job.flight_generation != job.job.generation()) return "";
  const std::string analysis = AnalyzeFlightRecords(job.flight_records, job.job.world_size());
  std::string text = "; " + analysis;
  if (job.flight_told == text) return text;
  job.flight_told = text;
  const std::string path = WriteJobFileLocked(
      job, "flight-recorder",
      analysis + "\n\nEvery rank's NCCL flight-recorder dump (PyTorch's: the last collectives of each group, the "
                 "workers' clocks, UTC):\n" +
          DescribeFlightRecords(job.flight_records, job.job.world_size()));
  if (!path.empty()) {
    text += " (every rank's dump: " + path + ")";
    job.flight_told = text;
  }
  return text;
}

void Coordinator::RequestDumpsLocked(ActiveJob& job, const std::vector<std::string>& nodes) {
  for (const auto& node_id : nodes) {
    auto node = nodes_.find(node_id);
    if (node == nodes_.end()) continue;
    v1::Command command;
    command.mutable_dump()->set_job_id(job.job.id());
    command.mutable_dump()->set_generation(job.job.generation());
    QueueCommandLocked(node->second, command);
    job.dump_nodes_waiting.insert(node_id);
  }
}

std::string Coordinator::WriteCollectivesLocked(const ActiveJob& job, const std::string& name,
                                               const std::string& headline) {
  const int64_t now = clock_->SteadyMs();
  std::vector<v1::RankProgress> reports;
  for (const auto& [rank, progress] : job.progress) {
    v1::RankProgress report = progress.report;
    const int64_t since = now - progress.received_ms;
    report.set_idle_ms(report.idle_ms() + since);
    report.set_silent_ms(report.silent_ms() + since);
    reports.push_back(std::move(report));
  }
  return WriteJobFileLocked(job, name,
                            headline + "\n\nEvery rank's last report and recent collectives (workers' clocks, UTC):\n" +
                                DescribeRankCollectives(reports, job.job.world_size()));
}

void Coordinator::CheckHangLocked(ActiveJob& job, int64_t now) {
  std::vector<RankActivity> ranks;
  ranks.reserve(static_cast<size_t>(job.job.world_size()));
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
      // thread may have started later ones); the newest ended one is where it got to.
      for (const auto& collective : report.collectives()) {
        if (collective.end_unix_ms() != 0) {
          if (collective.seq() > activity.last_seq) {
            activity.last_seq = collective.seq();
            activity.last_op = collective.op();
            activity.last_group = collective.group();
          }
        } else if (!activity.in_collective) {
          activity.in_collective = true;
          activity.collective_seq = collective.seq();
          activity.collective_op = collective.op();
          activity.collective_group = collective.group();
        }
      }
      activity.work = report.work();
    }
    ranks.push_back(std::move(activity));
  }
  const PhaseLimits limits = PhaseLimits::Derive(job.recipe, job.times);
  SetLimitsLocked(job, limits);
  std::optional<std::string> hang = DiagnoseHang(ranks, limits);
  if (!hang) {
    job.dump_wait_hang.clear();  // it moved again while its dumps were awaited
    job.dump_deadline_ms = 0;
    return;
  }
  if (job.recipe.runs_program()) {
    // A program's ranks are asked for PyTorch's flight recorder first; the hang is told (as first
    // seen) once every node sent its dumps or the wait is over.
    if (job.dump_deadline_ms == 0) {
      job.dump_wait_hang = *hang;
      job.dump_deadline_ms = now + kDumpWaitMs;
      RequestDumpsLocked(job, job.nodes);
      return;
    }
    if (!job.dump_nodes_waiting.empty() && now < job.dump_deadline_ms) return;
    const std::string told = TellFlightRecordsLocked(job);
    FailGenerationLocked(job, job.dump_wait_hang + told);
    return;
  }
  if (std::string path = WriteCollectivesLocked(job, "hang", *hang); !path.empty()) {
    *hang += "; every rank's recent collectives: " + path;
  }
  FailGenerationLocked(job, *hang);
}

}  // namespace ltrain::launcher
