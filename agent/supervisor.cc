#include "agent/supervisor.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <limits>
#include <set>

#include "agent/flight_recorder.h"
#include "agent/oom.h"
#include "agent/program_error.h"
#include "common/files.h"
#include "common/layout.h"
#include "common/logging.h"
#include "common/python_command.h"
#include "common/recipe.h"
#include "common/signal_name.h"
#include "common/worker_exit.h"

namespace ltrain::agent {
namespace {

namespace fs = std::filesystem;
constexpr const char* kLog = "agent";

// A job id as the coordinator makes them ("<name>-<n>"), usable as one path component.
bool UsableJobId(const std::string& id) {
  if (id.empty() || id.size() > 128 || id == "." || id == "..") return false;
  return std::all_of(id.begin(), id.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' || c == '_' ||
           c == '-';
  });
}

}  // namespace

namespace {

// torchrun's per-rank environment for a program (entrypoint.command). MASTER_ADDR and MASTER_PORT
// come from `ltrain-exec`, and so do the recipe's own variables (entrypoint.env, which may
// override any of these): they are the program's alone, so that a LD_LIBRARY_PATH or PATH meant for
// it never changes the proxy.
// torchrun's error reporting too: each rank's error file (TORCHELASTIC_ERROR_FILE, where PyTorch's
// `@record` writes the exception), in the generation's directory `dir`; NCCL's asynchronous error
// handling and the signals turned into exceptions, as torchrun sets them unless the user did; and
// PyTorch's NCCL flight recorder (its ring of recent collectives, dumped on a timeout into `dir`).
std::vector<std::string> TorchrunEnvironment(const v1::StartJobCommand& start, const v1::WorkerAssignment& assignment,
                                             const Recipe& recipe, const fs::path& dir) {
  const int local_world = std::max(1, start.local_world_size());
  std::vector<std::string> env = {
      "RANK=" + std::to_string(assignment.rank()),
      "LOCAL_RANK=" + std::to_string(assignment.local_rank()),
      "WORLD_SIZE=" + std::to_string(start.world_size()),
      "LOCAL_WORLD_SIZE=" + std::to_string(local_world),
      "GROUP_RANK=" + std::to_string(assignment.rank() / local_world),
      "GROUP_WORLD_SIZE=" + std::to_string(start.world_size() / local_world),
      "ROLE_NAME=default",
      "ROLE_RANK=" + std::to_string(assignment.rank()),
      "ROLE_WORLD_SIZE=" + std::to_string(start.world_size()),
      "TORCHELASTIC_RESTART_COUNT=" + std::to_string(start.restart_count()),
      "TORCHELASTIC_MAX_RESTARTS=" + std::to_string(recipe.fault.max_restarts),
      "TORCHELASTIC_RUN_ID=" + start.job_id(),
      "TORCHELASTIC_USE_AGENT_STORE=True",
      "TORCHELASTIC_ERROR_FILE=" + (dir / ProgramErrorFileName(assignment.rank())).string(),
  };
  // torchrun's defaults, where neither the user's environment nor the recipe says otherwise.
  const std::pair<const char*, std::string> defaults[] = {
      {"TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"},
      {"TORCHELASTIC_SIGNALS_TO_HANDLE", "SIGTERM,SIGINT,SIGHUP,SIGQUIT"},
      // The flight recorder: the last 2,000 collectives of each process group, dumped on a
      // collective timeout to <dir>/nccl-trace-rank-<rank> (both names PyTorch has read for the
      // path), and when the agent writes to <dir>/nccl-dump-request-rank-<rank>.pipe (DumpCollectives).
      {"TORCH_NCCL_TRACE_BUFFER_SIZE", "2000"},
      {"TORCH_NCCL_DUMP_ON_TIMEOUT", "1"},
      {"TORCH_FR_DUMP_TEMP_FILE", (dir / kFlightRecorderPrefix).string()},
      {"TORCH_NCCL_DEBUG_INFO_TEMP_FILE", (dir / kFlightRecorderPrefix).string()},
      {"TORCH_NCCL_DEBUG_INFO_PIPE_FILE", (dir / kFlightRecorderPipePrefix).string()},
  };
  for (const auto& [name, value] : defaults) {
    if (std::getenv(name) == nullptr && !recipe.entrypoint.env.count(name)) env.push_back(std::string(name) + "=" + value);
  }
  // As torchrun: one OpenMP thread per rank when several share a node, unless the user says.
  if (local_world > 1 && std::getenv("OMP_NUM_THREADS") == nullptr && !recipe.entrypoint.env.count("OMP_NUM_THREADS")) {
    env.push_back("OMP_NUM_THREADS=1");
  }
  return env;
}

}  // namespace

Status CheckStartCommand(const v1::StartJobCommand& start) {
  if (!UsableJobId(start.job_id())) {
    return InvalidArgument("the job id is not 1-128 characters of [A-Za-z0-9._-]");
  }
  if (start.generation() < 0) return InvalidArgument("generation " + std::to_string(start.generation()) + " is negative");
  if (start.world_size() < 1 || start.world_size() > (1 << 20)) {
    return InvalidArgument("world size " + std::to_string(start.world_size()) + " is outside 1-1048576");
  }
  if (start.local_world_size() < 1 || start.local_world_size() > 4096 ||
      start.local_world_size() > start.world_size()) {
    return InvalidArgument("local world size " + std::to_string(start.local_world_size()) +
                           " is outside 1-4096 or above the world size");
  }
  if (start.replace() ? start.workers_size() < 1 || start.workers_size() > start.local_world_size()
                      : start.workers_size() != start.local_world_size()) {
    return InvalidArgument(std::to_string(start.workers_size()) + " worker(s) assigned for a local world size of " +
                           std::to_string(start.local_world_size()));
  }
  std::set<int> ranks, local_ranks;
  for (const auto& worker : start.workers()) {
    if (worker.rank() < 0 || worker.rank() >= start.world_size() || !ranks.insert(worker.rank()).second) {
      return InvalidArgument("rank " + std::to_string(worker.rank()) + " is outside the world or assigned twice");
    }
    if (worker.local_rank() < 0 || worker.local_rank() >= start.local_world_size() ||
        !local_ranks.insert(worker.local_rank()).second) {
      return InvalidArgument("local rank " + std::to_string(worker.local_rank()) +
                             " is outside the node or assigned twice");
    }
  }
  if (start.rendezvous_scope().rfind(start.job_id() + "/", 0) != 0) {
    return InvalidArgument("the rendezvous scope is not under the job's id");
  }
  for (const std::string* text : {&start.rendezvous_scope(), &start.checkpoint_dir()}) {
    if (text->find('\0') != std::string::npos) return InvalidArgument("a path or scope holds a NUL byte");
  }
  return Status::Ok();
}

Supervisor::Supervisor(SupervisorOptions options, ProcessSpawner& spawner, const Clock& clock,
                       SupervisorOutbox& outbox)
    : options_(std::move(options)), spawner_(spawner), clock_(clock), outbox_(outbox) {
  if (!options_.read_oom_kill_count) options_.read_oom_kill_count = ReadOomKillCount;
}

Supervisor::~Supervisor() {
  for (auto& [pid, worker] : workers_) {
    if (worker->output_fd >= 0) close(worker->output_fd);
    if (worker->input_fd >= 0) close(worker->input_fd);
  }
}

void Supervisor::OpenLog(Worker& worker) {
  if (Status opened = worker.log.Open(worker.log_path); !opened.ok()) {
    LTRAIN_LOG(kError, kLog) << worker.job_id << " rank " << worker.rank << ": " << opened.message()
                             << "; its lines still reach the coordinator (`ltrain logs`)";
  }
}

void Supervisor::StartJob(const v1::StartJobCommand& start) {
  if (Status usable = CheckStartCommand(start); !usable.ok()) {
    LTRAIN_LOG(kError, kLog) << "refused a start command" << (UsableJobId(start.job_id()) ? " of " + start.job_id() : "")
                             << ": " << usable.message();
    if (!UsableJobId(start.job_id())) return;
    for (int i = 0; i < std::min(start.workers_size(), 4096); ++i) {
      v1::WorkerStateReport report;
      report.set_node_id(options_.node_id);
      report.set_job_id(start.job_id());
      report.set_generation(start.generation());
      report.set_rank(start.workers(i).rank());
      report.set_state("exited");
      report.set_exit_code(kWorkerExitNoRestart);
      report.set_refused(true);
      report.add_log_tail("the agent on " + options_.node_id + " refused the start command: " + usable.message());
      outbox_.Send(std::move(report));
    }
    return;
  }
  for (auto& [pid, worker] : workers_) {
    if (worker->job_id == start.job_id() && worker->generation < start.generation() && !worker->standby) {
      spawner_.KillGroup(pid, SIGKILL);  // a leftover of an older generation
    }
  }
  fs::path dir = fs::path(options_.work_dir) / "jobs" / start.job_id() / ("gen-" + std::to_string(start.generation()));
  fs::path recipe = dir / "recipe.yaml";
  // Private to this user, and never written through a link planted in the agent's directory.
  if (Status written = CreateDirectories(dir.string()); !written.ok() ||
      !(written = WriteFileText(recipe.string(), start.recipe_yaml())).ok()) {
    LTRAIN_LOG(kError, kLog) << start.job_id() << ": " << written.message();
  }
  // The generation's secret for the agent's services, private to this user from its creation.
  std::string secret_file;
  if (const std::string secret = options_.issue_worker_secret ? options_.issue_worker_secret(start) : "";
      !secret.empty()) {
    secret_file = (dir / "agent-secret").string();
    if (Status written = WriteFileText(secret_file, secret, 0600); !written.ok()) {
      LTRAIN_LOG(kError, "agent") << written.message() << ": the job's workers cannot reach this agent";
    }
  }
  // A recipe with entrypoint.command runs the user's program under `ltrain-exec`, which adds
  // MASTER_ADDR and MASTER_PORT (agreed through the rendezvous) and the progress descriptor.
  const RecipeParseResult parsed = ParseRecipe(start.recipe_yaml(), recipe.string());
  const bool program = parsed.ok() && parsed.recipe.runs_program();
  // A failed rank of such a job is replaced in place: its peers here keep running (Reap), and a
  // worker waits here with its libraries loaded (a second of a new process's start) to become it.
  const bool in_place = !program && parsed.ok() && InPlaceRecoveryProblem(parsed.recipe, start.world_size()).empty();
  if (in_place) {
    in_place_jobs_.insert(start.job_id());
  } else {
    in_place_jobs_.erase(start.job_id());
  }
  // A standby stands while a replacement may come; one standing becomes the next replaced rank here.
  const bool worker_standby = in_place && start.restart_count() < parsed.recipe.fault.max_restarts;
  // Standbys for the next generation, while the job may still restart.
  std::string not_python;
  const bool standbys = program && parsed.recipe.entrypoint.warm_standby != WarmStandby::kOff &&
                        start.restart_count() < parsed.recipe.fault.max_restarts &&
                        ParsePythonCommand(parsed.recipe.entrypoint.command, not_python);
  const std::string standby_mode = parsed.ok() && parsed.recipe.entrypoint.warm_standby == WarmStandby::kGpu ? "gpu" : "import";
  std::set<pid_t> taken;  // standbys that became this generation's workers
  for (const auto& assignment : start.workers()) {
    SpawnSpec spec;
    spec.binary = options_.worker_binary;
    spec.working_dir = dir.string();
    if (program) {
      const EntrypointSpec& entry = parsed.recipe.entrypoint;
      // ltrain-exec, beside the worker: it loads no LibTorch, so a restarted program starts sooner.
      spec.binary = (fs::path(options_.worker_binary).parent_path() / "ltrain-exec").string();
      spec.args.clear();
      for (const auto& [name, value] : entry.env) {
        spec.args.push_back("--env");
        spec.args.push_back(name + "=" + value);
      }
      if (entry.output_timeout_s > 0) {
        spec.args.push_back("--output-timeout");
        char seconds[32];
        std::snprintf(seconds, sizeof(seconds), "%.17g", entry.output_timeout_s);
        spec.args.push_back(seconds);
      }
      spec.args.push_back("--");
      spec.args.insert(spec.args.end(), entry.command.begin(), entry.command.end());
      if (!entry.workdir.empty()) spec.working_dir = entry.workdir;
    }
    spec.env = {
        "LTRAIN_JOB_ID=" + start.job_id(),
        "LTRAIN_RANK=" + std::to_string(assignment.rank()),
        "LTRAIN_WORLD_SIZE=" + std::to_string(start.world_size()),
        "LTRAIN_LOCAL_RANK=" + std::to_string(assignment.local_rank()),
        "LTRAIN_LOCAL_WORLD_SIZE=" + std::to_string(start.local_world_size()),
        "LTRAIN_GENERATION=" + std::to_string(start.generation()),
        "LTRAIN_RECIPE_FILE=" + recipe.string(),
        "LTRAIN_RDZV=grpc://" + options_.agent_address,
        "LTRAIN_AGENT=" + options_.agent_address,
        "LTRAIN_RDZV_SCOPE=" + start.rendezvous_scope(),
        "LTRAIN_CHECKPOINT_DIR=" + start.checkpoint_dir(),
        "LTRAIN_BIND_ADDR=" + options_.bind_address,
    };
    if (program) {
      // A build tree keeps ltrain_progress beside its binaries (build/python, as the Debian package puts
      // it in python3's dist-packages): `import ltrain_progress` works from either.
      const fs::path modules = fs::path(options_.worker_binary).parent_path().parent_path() / "python";
      std::error_code ec;
      if (fs::exists(modules / "ltrain_progress.py", ec)) {
        const char* path = std::getenv("PYTHONPATH");
        spec.env.push_back("PYTHONPATH=" + modules.string() + (path && *path ? ":" + std::string(path) : ""));
      }
    }
    if (!secret_file.empty()) spec.env.push_back("LTRAIN_AGENT_SECRET_FILE=" + secret_file);
    // A replacement joins the survivors' next membership and takes its state from them.
    if (start.epoch() > 0) spec.env.push_back("LTRAIN_EPOCH=" + std::to_string(start.epoch()));
    if (start.last_committed_step() > 0) {
      spec.env.push_back("LTRAIN_COMMITTED_STEP=" + std::to_string(start.last_committed_step()));
    }
    // Rank 0 appends the job's steps and validation losses beside the ranks' logs, across generations.
    if (assignment.rank() == 0) spec.env.push_back("LTRAIN_METRICS_FILE=" + (dir.parent_path() / "metrics.jsonl").string());
    if (assignment.rank() == 0 && parsed.ok() && parsed.recipe.metrics.tensorboard) {
      spec.env.push_back("LTRAIN_TENSORBOARD_DIR=" + (dir.parent_path() / "tensorboard").string());
    }
    if (program) {
      // The agent's files are private; the program gets the umask its user started ltrain with.
      char mask[8];
      std::snprintf(mask, sizeof(mask), "%04o", static_cast<unsigned>(OriginalUmask()));
      spec.env.push_back(std::string("LTRAIN_USER_UMASK=") + mask);
      std::vector<std::string> torchrun = TorchrunEnvironment(start, assignment, parsed.recipe, dir);
      spec.env.insert(spec.env.end(), torchrun.begin(), torchrun.end());
    }
    const std::string log_path = (dir / ("rank-" + std::to_string(assignment.rank()) + ".log")).string();
    v1::WorkerStateReport report;
    report.set_node_id(options_.node_id);
    report.set_job_id(start.job_id());
    report.set_generation(start.generation());
    report.set_rank(assignment.rank());
    report.set_log_path(log_path);
    // A standby of this local rank, waiting for the same program, becomes the rank; a worker standby
    // of the generation becomes any rank it replaces.
    Worker* standby = nullptr;
    if (program || (in_place && start.replace())) {
      for (auto& [pid, candidate] : workers_) {
        const bool fits = program ? candidate->local_rank == assignment.local_rank() &&
                                        candidate->generation < start.generation()
                                  : candidate->generation == start.generation();
        if (candidate->standby && fits && candidate->job_id == start.job_id() && candidate->kill_at_ms == 0 &&
            candidate->input_fd >= 0 && candidate->runs.binary == spec.binary && candidate->runs.args == spec.args) {
          standby = candidate.get();
          break;
        }
      }
    }
    if (standby != nullptr && Activate(*standby, spec.working_dir, SpawnEnvironment(spec.env))) {
      taken.insert(standby->pid);
      standby->standby = false;
      standby->generation = start.generation();
      standby->rank = assignment.rank();
      standby->log_path = log_path;
      OpenLog(*standby);
      standby->tail.clear();
      standby->oom_kills_at_start = options_.read_oom_kill_count();
      report.set_state("running");
      report.set_pid(standby->pid);
      PublishRunning();
      outbox_.Send(std::move(report));
      LTRAIN_LOG(kInfo, kLog) << start.job_id() << " rank " << assignment.rank() << " starts in its warm standby (pid "
                              << standby->pid << ")";
      if (standbys) SpawnStandby(spec, standby_mode, start, assignment);
      continue;
    }
    auto worker = std::make_unique<Worker>();
    worker->job_id = start.job_id();
    worker->generation = start.generation();
    worker->rank = assignment.rank();
    worker->log_path = log_path;
    OpenLog(*worker);
    StatusOr<SpawnedProcess> spawned = spawner_.Spawn(spec);
    if (!spawned.ok()) {
      report.set_state("exited");
      report.set_exit_code(127);
      report.add_log_tail("cannot start " + options_.worker_binary + ": " + spawned.status().message());
      outbox_.Send(std::move(report));
      continue;
    }
    worker->pid = spawned->pid;
    worker->output_fd = spawned->output_fd;
    worker->oom_kills_at_start = options_.read_oom_kill_count();
    report.set_state("running");
    report.set_pid(worker->pid);
    workers_[worker->pid] = std::move(worker);
    PublishRunning();
    outbox_.Send(std::move(report));
    if (standbys) SpawnStandby(spec, standby_mode, start, assignment);
  }
  // One worker standby a node for a job replaced in place (one after each it became a rank).
  if (worker_standby && start.workers_size() > 0 && !HasStandby(start.job_id(), start.generation())) {
    const v1::WorkerAssignment& last = start.workers(start.workers_size() - 1);
    SpawnSpec spec;
    spec.binary = options_.worker_binary;
    spec.working_dir = dir.string();
    spec.env = {"LTRAIN_JOB_ID=" + start.job_id(), "LTRAIN_LOCAL_WORLD_SIZE=" + std::to_string(start.local_world_size())};
    SpawnStandby(spec, "worker", start, last);
  }
  // Standbys of older generations that no rank took: the job's shape changed.
  EndStandbys(start.job_id(), start.generation());
  LTRAIN_LOG(kInfo, kLog) << "started " << start.workers_size() << " worker(s) of " << start.job_id()
                          << (taken.empty() ? "" : ", " + std::to_string(taken.size()) + " in warm standbys");
}

bool Supervisor::Activate(Worker& standby, const std::string& working_dir, const std::vector<std::string>& env) {
  std::string payload = working_dir;
  payload.push_back('\0');
  for (const std::string& entry : env) {
    payload += entry;
    payload.push_back('\0');
  }
  // The standby reads its stdin until it ends; one that does not take it all at once is stuck.
  fcntl(standby.input_fd, F_SETFL, fcntl(standby.input_fd, F_GETFL) | O_NONBLOCK);
  size_t sent = 0;
  while (sent < payload.size()) {
    const ssize_t n = send(standby.input_fd, payload.data() + sent, payload.size() - sent, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    sent += static_cast<size_t>(n);
  }
  close(standby.input_fd);
  standby.input_fd = -1;
  if (sent == payload.size()) return true;
  LTRAIN_LOG(kWarning, kLog) << "the warm standby of " << standby.job_id << " local rank " << standby.local_rank
                             << " (pid " << standby.pid << ") did not take its rank's environment; starting a new process";
  EndStandby(standby);
  return false;
}

void Supervisor::SpawnStandby(const SpawnSpec& worker_spec, const std::string& mode, const v1::StartJobCommand& start,
                              const v1::WorkerAssignment& assignment) {
  SpawnSpec spec = worker_spec;
  spec.args.insert(spec.args.begin(), {"--standby", mode});
  spec.input_pipe = true;
  StatusOr<SpawnedProcess> spawned = spawner_.Spawn(spec);
  if (!spawned.ok()) {
    LTRAIN_LOG(kWarning, kLog) << "no warm standby for " << start.job_id() << " local rank " << assignment.local_rank()
                               << ": " << spawned.status().message();
    return;
  }
  auto standby = std::make_unique<Worker>();
  standby->job_id = start.job_id();
  standby->generation = start.generation();
  standby->rank = assignment.rank();
  standby->local_rank = assignment.local_rank();
  standby->standby = true;
  standby->runs = worker_spec;
  standby->pid = spawned->pid;
  standby->output_fd = spawned->output_fd;
  standby->input_fd = spawned->input_fd;
  workers_[standby->pid] = std::move(standby);
}

void Supervisor::EndStandby(Worker& standby) {
  spawner_.KillGroup(standby.pid, SIGKILL);
  standby.kill_at_ms = clock_.SteadyMs();
  standby.kill_sent = true;
}

void Supervisor::EndStandbys(const std::string& job_id, int below_generation) {
  for (auto& [pid, worker] : workers_) {
    if (worker->standby && worker->job_id == job_id && worker->generation < below_generation &&
        worker->kill_at_ms == 0) {
      EndStandby(*worker);
    }
  }
  if (below_generation == std::numeric_limits<int>::max()) idle_since_ms_.erase(job_id);
}

bool Supervisor::HasWorkers(const std::string& job_id) const {
  for (const auto& [pid, worker] : workers_) {
    if (!worker->standby && worker->job_id == job_id) return true;
  }
  return false;
}

bool Supervisor::HasWorkers(const std::string& job_id, int generation) const {
  for (const auto& [pid, worker] : workers_) {
    if (!worker->standby && worker->job_id == job_id && worker->generation == generation) return true;
  }
  return false;
}

bool Supervisor::HasStandby(const std::string& job_id, int generation) const {
  for (const auto& [pid, worker] : workers_) {
    if (worker->standby && worker->kill_at_ms == 0 && worker->job_id == job_id && worker->generation == generation) {
      return true;
    }
  }
  return false;
}

int Supervisor::Standbys() const {
  int count = 0;
  for (const auto& [pid, worker] : workers_) count += worker->standby && worker->kill_at_ms == 0;
  return count;
}

void Supervisor::Terminate(pid_t pid, Worker& worker) {
  spawner_.KillGroup(pid, SIGTERM);
  spawner_.KillGroup(pid, SIGCONT);  // a stopped (hung) worker acts on SIGTERM only once continued
  worker.kill_at_ms = clock_.SteadyMs() + options_.stop_grace_ms;
  worker.stop_after_dump = false;
}

void Supervisor::StopJob(const std::string& job_id, int generation) {
  for (auto& [pid, worker] : workers_) {
    if (worker->job_id != job_id || worker->kill_at_ms != 0 || worker->standby) continue;
    if (generation >= 0 && worker->generation > generation) continue;
    // A rank asked for its flight recorder dumps first (SendDumps stops it then).
    if (DumpAwaited(*worker)) {
      worker->stop_after_dump = true;
      continue;
    }
    Terminate(pid, *worker);
  }
}

void Supervisor::StopAll() {
  std::set<std::string> jobs;
  for (auto& [pid, worker] : workers_) jobs.insert(worker->job_id);
  for (const auto& job : jobs) StopJob(job, -1);
}

namespace {

// A file's modification time in milliseconds; 0 when it is not there.
int64_t ModifiedMs(const std::string& path) {
  struct stat info {};
  if (stat(path.c_str(), &info) != 0) return 0;
  return static_cast<int64_t>(info.st_mtim.tv_sec) * 1000 + info.st_mtim.tv_nsec / 1'000'000;
}

// Every flight-recorder dump in a generation's directory (nccl-trace-rank-N), by rank.
std::vector<v1::FlightRecord> ReadFlightRecorderDumps(const std::string& dir) {
  std::vector<v1::FlightRecord> records;
  std::error_code ec;
  const std::string prefix = kFlightRecorderPrefix;
  std::vector<int> ranks;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (name.size() <= prefix.size() || name.size() > prefix.size() + 9 || name.compare(0, prefix.size(), prefix) != 0) {
      continue;
    }
    const std::string digits = name.substr(prefix.size());
    if (digits.find_first_not_of("0123456789") != std::string::npos) continue;  // the pipes: nccl-trace-rank-N.pipe
    ranks.push_back(std::stoi(digits));
  }
  std::sort(ranks.begin(), ranks.end());
  for (int rank : ranks) {
    StatusOr<v1::FlightRecord> record = ReadFlightRecorderDump(dir, rank);
    if (record.ok()) records.push_back(std::move(*record));
  }
  return records;
}

}  // namespace

Supervisor::DumpRequest& Supervisor::AskForDumps(const std::string& job_id, int generation) {
  DumpRequest request;
  request.job_id = job_id;
  request.generation = generation;
  request.dir = (fs::path(options_.work_dir) / "jobs" / job_id / ("gen-" + std::to_string(generation))).string();
  request.deadline_ms = clock_.SteadyMs() + kDumpWaitMs;
  for (auto& [pid, worker] : workers_) {
    if (worker->job_id != job_id || worker->generation != generation || worker->standby || worker->kill_at_ms != 0) {
      continue;
    }
    const int64_t before = ModifiedMs(FlightRecorderDumpPath(request.dir, worker->rank));
    if (RequestFlightRecorderDump(request.dir, worker->rank)) request.waiting[worker->rank] = before;
  }
  if (!request.waiting.empty()) {
    LTRAIN_LOG(kInfo, kLog) << job_id << " generation " << generation << ": asked " << request.waiting.size()
                            << " rank(s) here for their NCCL flight recorder";
  }
  dump_requests_.push_back(std::move(request));
  return dump_requests_.back();
}

void Supervisor::DumpCollectives(const std::string& job_id, int generation) { AskForDumps(job_id, generation); }

bool Supervisor::DumpAwaited(const Worker& worker) const {
  for (const auto& request : dump_requests_) {
    if (request.job_id == worker.job_id && request.generation == worker.generation &&
        request.waiting.count(worker.rank)) {
      return true;
    }
  }
  return false;
}

void Supervisor::SendDumps() {
  const int64_t now = clock_.SteadyMs();
  for (auto it = dump_requests_.begin(); it != dump_requests_.end();) {
    DumpRequest& request = *it;
    // A rank is done once its dump changed and reads whole, or once it is gone.
    for (auto rank = request.waiting.begin(); rank != request.waiting.end();) {
      bool alive = false;
      for (const auto& [pid, worker] : workers_) {
        alive |= worker->job_id == request.job_id && worker->generation == request.generation && worker->rank == rank->first;
      }
      const std::string dump = FlightRecorderDumpPath(request.dir, rank->first);
      bool written = false;
      if (const int64_t modified = ModifiedMs(dump); modified != 0 && modified != rank->second) {
        StatusOr<v1::FlightRecord> record = ReadFlightRecorderDump(request.dir, rank->first);
        written = record.ok() && record->error().empty();
      }
      rank = !alive || written ? request.waiting.erase(rank) : std::next(rank);
    }
    if (!request.waiting.empty() && now < request.deadline_ms) {
      ++it;
      continue;
    }
    v1::WorkerStateReport report;
    if (request.held) {
      report = std::move(*request.held);
    } else {
      report.set_node_id(options_.node_id);
      report.set_job_id(request.job_id);
      report.set_generation(request.generation);
      report.set_rank(-1);
      report.set_state("collectives");
    }
    for (auto& record : ReadFlightRecorderDumps(request.dir)) *report.add_flight_records() = std::move(record);
    outbox_.Send(std::move(report));
    it = dump_requests_.erase(it);
  }
  for (auto& [pid, worker] : workers_) {
    if (worker->stop_after_dump && !DumpAwaited(*worker)) Terminate(pid, *worker);
  }
}

void Supervisor::KillAll() {
  for (auto& [pid, worker] : workers_) spawner_.KillGroup(pid, SIGKILL);
}

void Supervisor::Poll() {
  int64_t now = clock_.SteadyMs();
  Batches batches;
  for (auto& [pid, worker] : workers_) Drain(*worker, batches, false);
  while (std::optional<ProcessExit> exit = spawner_.TryReap()) Reap(*exit, batches);
  if (!dump_requests_.empty()) SendDumps();
  for (auto& [pid, worker] : workers_) {
    if (worker->kill_at_ms != 0 && !worker->kill_sent && now >= worker->kill_at_ms) {
      spawner_.KillGroup(pid, SIGKILL);
      worker->kill_sent = true;
    }
  }
  // Standbys of a job with no worker here wait kStandbyLingerMs for its next generation.
  std::set<std::string> waiting;
  for (const auto& [pid, worker] : workers_) {
    if (worker->standby && worker->kill_at_ms == 0 && !HasWorkers(worker->job_id)) waiting.insert(worker->job_id);
  }
  for (auto it = idle_since_ms_.begin(); it != idle_since_ms_.end();) {
    it = waiting.count(it->first) ? std::next(it) : idle_since_ms_.erase(it);
  }
  for (const std::string& job : waiting) {
    const int64_t since = idle_since_ms_.emplace(job, now).first->second;
    if (now - since >= kStandbyLingerMs) {
      LTRAIN_LOG(kInfo, kLog) << "no new generation of " << job << " for " << kStandbyLingerMs / 1000
                              << " s: ending its warm standbys";
      EndStandbys(job);
    }
  }
  SendBatches(batches);
}

void Supervisor::Reap(const ProcessExit& exit, Batches& batches) {
  auto found = workers_.find(exit.pid);
  if (found == workers_.end()) return;
  std::unique_ptr<Worker> worker = std::move(found->second);
  workers_.erase(found);
  if (worker->standby) {
    Drain(*worker, batches, true);
    if (worker->output_fd >= 0) close(worker->output_fd);
    if (worker->input_fd >= 0) close(worker->input_fd);
    if (worker->kill_at_ms == 0) {
      LTRAIN_LOG(kWarning, kLog) << "the warm standby of " << worker->job_id << " local rank " << worker->local_rank
                                 << " ended ("
                                 << (exit.signal ? SignalName(exit.signal) : "exit code " + std::to_string(exit.exit_code))
                                 << "); that rank's next start is a new process";
    }
    return;
  }
  PublishRunning();
  Drain(*worker, batches, true);
  SendBatches(batches);  // the lines go before the exit report
  v1::WorkerStateReport report;
  report.set_node_id(options_.node_id);
  report.set_job_id(worker->job_id);
  report.set_generation(worker->generation);
  report.set_rank(worker->rank);
  report.set_pid(worker->pid);
  report.set_state(exit.signal ? "killed" : "exited");
  report.set_exit_code(exit.exit_code);
  report.set_signal(exit.signal);
  report.set_log_path(worker->log_path);
  for (const auto& line : worker->tail) report.add_log_tail(line);
  bool stopping = worker->kill_at_ms != 0;
  // A program's rank that failed may have written its exception (torchrun's error file).
  if ((exit.signal != 0 || exit.exit_code != 0) && !worker->log_path.empty()) {
    const std::string path = (fs::path(worker->log_path).parent_path() / ProgramErrorFileName(worker->rank)).string();
    StatusOr<v1::ProgramError> error = ReadProgramError(path);
    if (error.ok()) {
      *report.mutable_program_error() = std::move(*error);
    } else if (error.status().code() != StatusCode::kNotFound) {
      LTRAIN_LOG(kWarning, kLog) << worker->job_id << " rank " << worker->rank << ": " << error.status().message();
    }
  }
  bool failed = exit.signal != 0 || exit.exit_code != 0;
  if (exit.signal == SIGKILL && !stopping) {
    std::optional<int64_t> ooms = options_.read_oom_kill_count();
    if (ooms && worker->oom_kills_at_start && *ooms > *worker->oom_kills_at_start) report.set_oom_killed(true);
  }
  if (options_.complete_exit_report) options_.complete_exit_report(report);
  // The generation's first failed rank here brings the flight-recorder dumps of its ranks (a
  // program's NCCL timeout has every rank dump): the others are asked for theirs, and the report
  // waits for them (up to kDumpWaitMs, only for ranks with PyTorch's pipe).
  bool asked = false;
  for (const auto& request : dump_requests_) {
    asked |= request.job_id == worker->job_id && request.generation == worker->generation;
  }
  bool held = false;
  if (failed && !stopping && !asked) {
    DumpRequest& request = AskForDumps(worker->job_id, worker->generation);
    if (!request.waiting.empty()) {
      request.held = std::move(report);
      held = true;
    } else {
      dump_requests_.pop_back();  // no rank to wait for: the report goes now
    }
  }
  if (!held) {
    if (failed && !stopping && !worker->log_path.empty()) {
      for (auto& record : ReadFlightRecorderDumps(fs::path(worker->log_path).parent_path().string())) {
        *report.add_flight_records() = std::move(record);
      }
    }
    outbox_.Send(std::move(report));
  }
  if (worker->output_fd >= 0) close(worker->output_fd);
  if (options_.revoke_worker_secret && !HasWorkers(worker->job_id, worker->generation)) {
    options_.revoke_worker_secret(worker->job_id, worker->generation);
    std::error_code ec;
    fs::remove(fs::path(worker->log_path).parent_path() / "agent-secret", ec);
  }
  // The job's ranks here all succeeded: no restart will need its standbys.
  if (!failed && !stopping && !HasWorkers(worker->job_id)) EndStandbys(worker->job_id);
  if (failed && !stopping && in_place_jobs_.count(worker->job_id) > 0) {
    LTRAIN_LOG(kWarning, kLog) << worker->job_id << " rank " << worker->rank << " "
                               << (exit.signal ? "was killed by " + SignalName(exit.signal)
                                               : "exited with code " + std::to_string(exit.exit_code))
                               << "; the job's other workers keep running (fault.recovery: in_place)";
  } else if (failed && !stopping) {
    LTRAIN_LOG(kWarning, kLog) << worker->job_id << " rank " << worker->rank << " "
                               << (exit.signal ? "was killed by " + SignalName(exit.signal)
                                               : "exited with code " + std::to_string(exit.exit_code))
                               << "; stopping the job's other workers on this node";
    StopJob(worker->job_id, worker->generation);
  }
}

// Reads what the worker wrote; complete lines go to its log file and to the coordinator.
void Supervisor::Drain(Worker& worker, Batches& batches, bool final_read) {
  char buffer[65536];
  while (worker.output_fd >= 0) {
    ssize_t n = read(worker.output_fd, buffer, sizeof(buffer));
    if (n <= 0) {
      if (n == 0 || final_read) {
        close(worker.output_fd);
        worker.output_fd = -1;
      }
      break;
    }
    worker.partial.append(buffer, static_cast<size_t>(n));
    // A line that never ends (a progress bar with \r, binary output) is cut into lines of its own.
    if (worker.partial.size() > kMaxPartialLineBytes && worker.partial.find('\n') == std::string::npos) {
      AddLine(worker, worker.partial, batches);
      worker.partial.clear();
    }
  }
  size_t start = 0;
  for (size_t nl; (nl = worker.partial.find('\n', start)) != std::string::npos; start = nl + 1) {
    AddLine(worker, worker.partial.substr(start, nl - start), batches);
  }
  worker.partial.erase(0, start);
  if (worker.output_fd < 0 && !worker.partial.empty()) {
    AddLine(worker, worker.partial, batches);
    worker.partial.clear();
  }
  // The file is read while the job runs (tail -f) and must keep what came if the agent dies.
  if (start > 0 || worker.output_fd < 0) worker.log.Flush();
}

void Supervisor::AddLine(Worker& worker, const std::string& line, Batches& batches) {
  if (worker.standby) {  // what its interpreter printed while it warmed up
    worker.tail.push_back(BoundedLine(line, kMaxForwardedLineBytes, "a warm standby's output"));
    if (worker.tail.size() > kTailLines) worker.tail.pop_front();
    LTRAIN_LOG(kInfo, kLog) << "warm standby of " << worker.job_id << " local rank " << worker.local_rank << ": "
                            << worker.tail.back();
    return;
  }
  worker.log.Append(line);
  worker.log.Append("\n");
  // What goes to the coordinator: valid UTF-8 (protobuf refuses anything else), and at most
  // kMaxForwardedLineBytes of it.
  std::string text = BoundedLine(line, kMaxForwardedLineBytes, worker.log_path);
  worker.tail.push_back(text);
  if (worker.tail.size() > kTailLines) worker.tail.pop_front();
  Batch& batch = batches[worker.job_id];
  if (batch.bytes + text.size() > kMaxBatchBytes && batch.request.lines_size() > 0) {
    outbox_.Send(std::move(batch.request));
    batch = Batch{};
  }
  if (batch.request.job_id().empty()) {
    batch.request.set_job_id(worker.job_id);
    batch.request.set_node_id(options_.node_id);
  }
  batch.bytes += text.size();
  v1::LogLine* out = batch.request.add_lines();
  out->set_rank(worker.rank);
  out->set_text(std::move(text));
}

void Supervisor::SendBatches(Batches& batches) {
  for (auto& [job, batch] : batches) {
    if (batch.request.lines_size() > 0) outbox_.Send(std::move(batch.request));
  }
  batches.clear();
}

void Supervisor::PublishRunning() { outbox_.RunningChanged(Running()); }

std::vector<int> Supervisor::OutputFds() const {
  std::vector<int> fds;
  for (const auto& [pid, worker] : workers_) {
    if (worker->output_fd >= 0) fds.push_back(worker->output_fd);
  }
  return fds;
}

std::vector<v1::RunningWorker> Supervisor::Running() const {
  std::vector<v1::RunningWorker> running;
  for (const auto& [pid, worker] : workers_) {
    if (worker->standby) continue;
    v1::RunningWorker& w = running.emplace_back();
    w.set_job_id(worker->job_id);
    w.set_generation(worker->generation);
    w.set_rank(worker->rank);
    w.set_pid(pid);
  }
  return running;
}

}  // namespace ltrain::agent
