#include "agent/agent.h"

#include "agent/oom.h"

#include <poll.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <mutex>
#include <thread>
#include <variant>

#include <grpcpp/grpcpp.h>

#include "common/clock.h"
#include "common/logging.h"
#include "common/signal_name.h"
#include "ltrain/v1/ltrain.grpc.pb.h"

namespace ltrain::agent {
namespace {

namespace fs = std::filesystem;
constexpr const char* kLog = "agent";
constexpr size_t kTailLines = 12;

std::chrono::system_clock::time_point Deadline(double seconds) {
  return std::chrono::system_clock::now() + std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000));
}

// Forwards the workers' rendezvous calls to the coordinator.
class RendezvousProxy final : public v1::RendezvousService::Service {
 public:
  explicit RendezvousProxy(std::shared_ptr<grpc::Channel> channel)
      : stub_(v1::RendezvousService::NewStub(std::move(channel))) {}

  grpc::Status Set(grpc::ServerContext*, const v1::KvSetRequest* request, v1::KvSetReply* reply) override {
    grpc::ClientContext context;
    context.set_deadline(Deadline(30));
    return stub_->Set(&context, *request, reply);
  }

  grpc::Status Get(grpc::ServerContext*, const v1::KvGetRequest* request, v1::KvGetReply* reply) override {
    grpc::ClientContext context;
    context.set_deadline(Deadline(request->timeout_ms() / 1000.0 + 5));
    return stub_->Get(&context, *request, reply);
  }

 private:
  std::unique_ptr<v1::RendezvousService::Stub> stub_;
};

// Receives the progress reports of this node's workers.
class ProgressSink final : public v1::WorkerService::Service {
 public:
  struct Entry {
    v1::RankProgress report;
    int64_t received_ms = 0;  // steady
    int64_t changed_ms = 0;   // steady: when step, phase or the newest collective last changed
  };

  grpc::Status ReportProgress(grpc::ServerContext*, const v1::RankProgress* request, v1::ProgressAck* ack) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (auto stop = checkpoint_stops_.find(request->job_id());
        stop != checkpoint_stops_.end() && request->generation() <= stop->second) {
      ack->set_checkpoint_and_stop(true);
    }
    int64_t now = clock_.SteadyMs();
    Entry& entry = entries_[{request->job_id(), request->rank()}];
    bool changed = entry.received_ms == 0 || entry.report.generation() != request->generation() ||
                   entry.report.step() != request->step() || entry.report.phase() != request->phase() ||
                   Newest(entry.report) != Newest(*request);
    entry.report = *request;
    entry.received_ms = now;
    if (changed) entry.changed_ms = now;
    return grpc::Status::OK;
  }

  // From now on the job's workers of `generation` and older learn, in the reply to their next
  // report, that they are to stop after a final checkpoint.
  void RequestCheckpointStop(const std::string& job_id, int generation) {
    std::lock_guard<std::mutex> lock(mu_);
    auto [stop, added] = checkpoint_stops_.emplace(job_id, generation);
    if (!added) stop->second = std::max(stop->second, generation);
  }

  // The latest report of each live rank, with idle_ms and silent_ms from this node's clock.
  std::vector<v1::RankProgress> Collect(const std::set<std::pair<std::string, int>>& live) {
    std::lock_guard<std::mutex> lock(mu_);
    int64_t now = clock_.SteadyMs();
    std::vector<v1::RankProgress> out;
    for (auto it = entries_.begin(); it != entries_.end();) {
      if (!live.count(it->first)) {
        it = entries_.erase(it);
        continue;
      }
      v1::RankProgress report = it->second.report;
      report.set_idle_ms(now - it->second.changed_ms);
      report.set_silent_ms(now - it->second.received_ms);
      out.push_back(std::move(report));
      ++it;
    }
    return out;
  }

 private:
  static std::pair<uint64_t, int64_t> Newest(const v1::RankProgress& report) {
    if (report.collectives_size() == 0) return {0, 0};
    const auto& last = *report.collectives().rbegin();
    return {last.seq(), last.end_unix_ms()};
  }

  RealClock clock_;
  std::mutex mu_;
  std::map<std::pair<std::string, int>, Entry> entries_;
  std::map<std::string, int> checkpoint_stops_;  // job id -> newest generation to stop after a checkpoint
};

struct Worker {
  std::string job_id;
  int generation = 0;
  int rank = 0;
  pid_t pid = -1;
  int output_fd = -1;
  std::string partial;
  std::ofstream log;
  std::string log_path;
  std::deque<std::string> tail;
  int64_t kill_at_ms = 0;  // when a SIGTERM'd worker gets SIGKILL; 0 when none is due
  std::optional<int64_t> oom_kills_at_start;  // the cgroup's OOM-kill count when it started
};

using Outgoing = std::variant<v1::WorkerStateReport, v1::PushLogsRequest>;

class AgentImpl : public Agent {
 public:
  AgentImpl(AgentOptions options, std::unique_ptr<ProcessSpawner> spawner)
      : options_(std::move(options)), spawner_(std::move(spawner)) {}

  Status Init() {
    channel_ = MakeChannel(options_.coordinator, options_.security);
    agent_stub_ = v1::AgentService::NewStub(channel_);
    std::error_code ec;
    fs::create_directories(options_.work_dir, ec);
    if (ec) return Unavailable("cannot create the agent directory " + options_.work_dir + ": " + ec.message());
    if (access(options_.worker_binary.c_str(), X_OK) != 0) {
      return FailedPrecondition("worker binary " + options_.worker_binary +
                                " is not executable; build it or pass --worker-binary");
    }
    proxy_ = std::make_unique<RendezvousProxy>(channel_);
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &proxy_port_);
    builder.RegisterService(proxy_.get());
    builder.RegisterService(&progress_);
    proxy_server_ = builder.BuildAndStart();
    if (!proxy_server_ || proxy_port_ == 0) return Unavailable("cannot start the workers' rendezvous proxy");
    supervisor_ = std::thread([this] { SuperviseLoop(); });
    sender_ = std::thread([this] { SendLoop(); });
    connector_ = std::thread([this] { ConnectLoop(); });
    heartbeat_ = std::thread([this] { HeartbeatLoop(); });
    return Status::Ok();
  }

  void Wait() override {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [this] { return stopped_; });
  }

  // Callers from several threads all return once every worker is gone and every thread joined.
  void Shutdown() override { std::call_once(shutdown_once_, [this] { ShutdownOnce(); }); }

  void ShutdownOnce() {
    {
      // Say goodbye first, so that the coordinator stops this node's jobs rather than failing them.
      v1::LeaveRequest leave;
      leave.set_node_id(options_.node_id);
      leave.set_reason(options_.leave_reason);
      v1::LeaveReply reply;
      grpc::ClientContext context;
      context.set_deadline(Deadline(2));
      agent_stub_->Leave(&context, leave, &reply);
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping_ = true;
      if (stream_context_) stream_context_->TryCancel();
      cv_.notify_all();
    }
    if (connector_.joinable()) connector_.join();
    if (heartbeat_.joinable()) heartbeat_.join();
    if (supervisor_.joinable()) supervisor_.join();  // kills every worker before it returns
    {
      std::lock_guard<std::mutex> lock(out_mu_);
      sender_done_ = true;
      out_cv_.notify_all();
    }
    if (sender_.joinable()) sender_.join();
    if (proxy_server_) proxy_server_->Shutdown(Deadline(1));
    std::lock_guard<std::mutex> lock(mu_);
    stopped_ = true;
    cv_.notify_all();
  }

  ~AgentImpl() override { Shutdown(); }

 private:
  bool Stopping() {
    std::lock_guard<std::mutex> lock(mu_);
    return stopping_;
  }

  void ConnectLoop() {
    v1::RegisterRequest request;
    request.set_node_id(options_.node_id);
    char host[256] = {0};
    gethostname(host, sizeof(host) - 1);
    request.mutable_facts()->set_hostname(host);
    request.mutable_facts()->set_address(options_.bind_address);
    request.mutable_facts()->set_cpus(static_cast<int>(std::thread::hardware_concurrency()));
    int gpus = 0;
    for (int i = 0; i < 64; ++i) gpus += fs::exists("/dev/nvidia" + std::to_string(i)) ? 1 : 0;
    request.mutable_facts()->set_gpus(gpus);
    bool warned = false;
    RealClock clock;
    int64_t lost_since = -1;
    while (!Stopping()) {
      request.clear_running();
      {
        std::lock_guard<std::mutex> lock(live_mu_);
        for (const auto& w : live_) *request.add_running() = w;
      }
      auto context = std::make_shared<grpc::ClientContext>();
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (stopping_) break;
        stream_context_ = context;
      }
      auto reader = agent_stub_->Connect(context.get(), request);
      v1::Command command;
      bool registered = false;
      while (reader->Read(&command)) {
        if (!registered) {
          registered = true;
          warned = false;
          lost_since = -1;
          LTRAIN_LOG(kInfo, kLog) << "node " << options_.node_id << " registered with " << options_.coordinator;
        }
        if (command.has_start() || command.has_stop()) {
          std::lock_guard<std::mutex> lock(mu_);
          // The node beats as often as its most demanding job asked (kept until the agent restarts).
          if (command.has_start() && command.start().heartbeat_interval_ms() > 0) {
            job_heartbeat_ms_ = job_heartbeat_ms_ > 0 ? std::min(job_heartbeat_ms_, command.start().heartbeat_interval_ms())
                                                      : command.start().heartbeat_interval_ms();
          }
          inbox_.push_back(command);
        }
      }
      grpc::Status status = reader->Finish();
      if (Stopping()) break;
      if (!warned) {
        LTRAIN_LOG(kWarning, kLog) << "lost the coordinator at " << options_.coordinator << " ("
                                   << status.error_message() << "); reconnecting, workers keep running for up to "
                                   << options_.coordinator_grace_s << " s";
        warned = true;
      }
      if (lost_since < 0) lost_since = clock.SteadyMs();
      if (clock.SteadyMs() - lost_since > static_cast<int64_t>(options_.coordinator_grace_s * 1000)) {
        std::lock_guard<std::mutex> lock(mu_);
        if (!orphan_kill_requested_) {
          LTRAIN_LOG(kError, kLog) << "the coordinator has been away for more than " << options_.coordinator_grace_s
                                   << " s: stopping every worker of this node";
          orphan_kill_requested_ = true;
        }
      }
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait_for(lock, std::chrono::milliseconds(500), [this] { return stopping_; });
    }
  }

  void HeartbeatLoop() {
    while (true) {
      {
        std::unique_lock<std::mutex> lock(mu_);
        int64_t interval_ms = static_cast<int64_t>(options_.heartbeat_interval_s * 1000);
        if (job_heartbeat_ms_ > 0) interval_ms = std::min(interval_ms, job_heartbeat_ms_);
        if (cv_.wait_for(lock, std::chrono::milliseconds(interval_ms), [this] { return stopping_; })) return;
      }
      v1::HeartbeatRequest request;
      request.set_node_id(options_.node_id);
      std::set<std::pair<std::string, int>> live;
      {
        std::lock_guard<std::mutex> lock(live_mu_);
        for (const auto& w : live_) live.insert({w.job_id(), w.rank()});
      }
      for (auto& report : progress_.Collect(live)) *request.add_progress() = std::move(report);
      v1::HeartbeatReply reply;
      grpc::ClientContext context;
      context.set_deadline(Deadline(options_.heartbeat_interval_s));
      agent_stub_->Heartbeat(&context, request, &reply);
    }
  }

  void Enqueue(Outgoing message) {
    std::lock_guard<std::mutex> lock(out_mu_);
    outbox_.push_back(std::move(message));
    out_cv_.notify_all();
  }

  void SendLoop() {
    while (true) {
      Outgoing message;
      {
        std::unique_lock<std::mutex> lock(out_mu_);
        out_cv_.wait(lock, [this] { return sender_done_ || !outbox_.empty(); });
        if (outbox_.empty()) return;
        message = outbox_.front();  // popped once delivered: reports survive a coordinator restart
      }
      grpc::ClientContext context;
      context.set_deadline(Deadline(10));
      grpc::Status status;
      if (auto* report = std::get_if<v1::WorkerStateReport>(&message)) {
        v1::WorkerStateReply reply;
        status = agent_stub_->ReportWorkerState(&context, *report, &reply);
      } else {
        v1::PushLogsReply reply;
        status = agent_stub_->PushLogs(&context, std::get<v1::PushLogsRequest>(message), &reply);
      }
      std::unique_lock<std::mutex> lock(out_mu_);
      if (status.ok() || sender_done_) {
        outbox_.pop_front();
        continue;
      }
      // The coordinator is away: keep the message and try again shortly, in order.
      out_cv_.wait_for(lock, std::chrono::milliseconds(500), [this] { return sender_done_; });
    }
  }

  void StartJob(const v1::StartJobCommand& start) {
    for (auto& [pid, worker] : workers_) {
      if (worker->job_id == start.job_id() && worker->generation < start.generation()) {
        spawner_->KillGroup(pid, SIGKILL);  // a leftover of an older generation
      }
    }
    fs::path dir = fs::path(options_.work_dir) / "jobs" / start.job_id() / ("gen-" + std::to_string(start.generation()));
    std::error_code ec;
    fs::create_directories(dir, ec);
    fs::path recipe = dir / "recipe.yaml";
    {
      std::ofstream out(recipe);
      out << start.recipe_yaml();
    }
    for (const auto& assignment : start.workers()) {
      SpawnSpec spec;
      spec.binary = options_.worker_binary;
      spec.working_dir = dir.string();
      spec.env = {
          "LTRAIN_JOB_ID=" + start.job_id(),
          "LTRAIN_RANK=" + std::to_string(assignment.rank()),
          "LTRAIN_WORLD_SIZE=" + std::to_string(start.world_size()),
          "LTRAIN_LOCAL_RANK=" + std::to_string(assignment.local_rank()),
          "LTRAIN_LOCAL_WORLD_SIZE=" + std::to_string(start.local_world_size()),
          "LTRAIN_GENERATION=" + std::to_string(start.generation()),
          "LTRAIN_RECIPE_FILE=" + recipe.string(),
          "LTRAIN_RDZV=grpc://127.0.0.1:" + std::to_string(proxy_port_),
          "LTRAIN_AGENT=127.0.0.1:" + std::to_string(proxy_port_),
          "LTRAIN_RDZV_SCOPE=" + start.rendezvous_scope(),
          "LTRAIN_CHECKPOINT_DIR=" + start.checkpoint_dir(),
          "LTRAIN_BIND_ADDR=" + options_.bind_address,
      };
      auto worker = std::make_unique<Worker>();
      worker->job_id = start.job_id();
      worker->generation = start.generation();
      worker->rank = assignment.rank();
      worker->log_path = (dir / ("rank-" + std::to_string(assignment.rank()) + ".log")).string();
      worker->log.open(worker->log_path, std::ios::app);
      v1::WorkerStateReport report;
      report.set_node_id(options_.node_id);
      report.set_job_id(start.job_id());
      report.set_generation(start.generation());
      report.set_rank(assignment.rank());
      report.set_log_path(worker->log_path);
      StatusOr<SpawnedProcess> spawned = spawner_->Spawn(spec);
      if (!spawned.ok()) {
        report.set_state("exited");
        report.set_exit_code(127);
        report.add_log_tail("cannot start " + options_.worker_binary + ": " + spawned.status().message());
        Enqueue(report);
        continue;
      }
      worker->pid = spawned->pid;
      worker->output_fd = spawned->output_fd;
      worker->oom_kills_at_start = ReadOomKillCount();
      report.set_state("running");
      report.set_pid(worker->pid);
      Enqueue(report);
      v1::RunningWorker live;
      live.set_job_id(start.job_id());
      live.set_generation(start.generation());
      live.set_rank(assignment.rank());
      live.set_pid(worker->pid);
      {
        std::lock_guard<std::mutex> lock(live_mu_);
        live_.push_back(live);
      }
      workers_[worker->pid] = std::move(worker);
    }
    LTRAIN_LOG(kInfo, kLog) << "started " << start.workers_size() << " worker(s) of " << start.job_id();
  }

  // Stops the job's workers of `generation` and older (all of them when generation < 0).
  void StopJob(const std::string& job_id, int generation, int64_t now_ms) {
    for (auto& [pid, worker] : workers_) {
      if (worker->job_id != job_id || worker->kill_at_ms != 0) continue;
      if (generation >= 0 && worker->generation > generation) continue;
      spawner_->KillGroup(pid, SIGTERM);
      spawner_->KillGroup(pid, SIGCONT);  // a stopped (hung) worker acts on SIGTERM only once continued
      worker->kill_at_ms = now_ms + static_cast<int64_t>(options_.stop_grace_s * 1000);
    }
  }

  // Reads what the worker wrote; complete lines go to its log file and to the coordinator.
  void Drain(Worker& worker, v1::PushLogsRequest& batch, bool final_read) {
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
    }
    size_t start = 0;
    for (size_t nl; (nl = worker.partial.find('\n', start)) != std::string::npos; start = nl + 1) {
      AddLine(worker, worker.partial.substr(start, nl - start), batch);
    }
    worker.partial.erase(0, start);
    if (worker.output_fd < 0 && !worker.partial.empty()) {
      AddLine(worker, worker.partial, batch);
      worker.partial.clear();
    }
  }

  void AddLine(Worker& worker, const std::string& line, v1::PushLogsRequest& batch) {
    worker.log << line << '\n';
    worker.tail.push_back(line);
    if (worker.tail.size() > kTailLines) worker.tail.pop_front();
    if (batch.job_id().empty()) {
      batch.set_job_id(worker.job_id);
      batch.set_node_id(options_.node_id);
    }
    v1::LogLine* out = batch.add_lines();
    out->set_rank(worker.rank);
    out->set_text(line);
  }

  void SendBatches(std::map<std::string, v1::PushLogsRequest>& batches) {
    for (auto& [job, batch] : batches) {
      if (batch.lines_size() > 0) Enqueue(std::move(batch));
    }
    batches.clear();
  }

  void SuperviseLoop() {
    RealClock clock;
    std::map<std::string, v1::PushLogsRequest> batches;
    while (true) {
      std::deque<v1::Command> commands;
      bool stopping;
      {
        std::lock_guard<std::mutex> lock(mu_);
        commands.swap(inbox_);
        stopping = stopping_;
      }
      int64_t now = clock.SteadyMs();
      for (const auto& command : commands) {
        if (command.has_start()) StartJob(command.start());
        if (command.has_stop() && command.stop().checkpoint()) {
          // The workers save and exit on their own; a plain stop follows if they do not.
          LTRAIN_LOG(kInfo, kLog) << "stopping " << command.stop().job_id()
                                  << " after a final checkpoint: " << command.stop().reason();
          progress_.RequestCheckpointStop(command.stop().job_id(), command.stop().generation());
        } else if (command.has_stop()) {
          LTRAIN_LOG(kInfo, kLog) << "stopping " << command.stop().job_id() << ": " << command.stop().reason();
          StopJob(command.stop().job_id(), command.stop().generation(), now);
        }
      }
      bool orphaned;
      {
        std::lock_guard<std::mutex> lock(mu_);
        orphaned = orphan_kill_requested_;
        orphan_kill_requested_ = false;
      }
      if (orphaned) {
        std::set<std::string> jobs;
        for (auto& [pid, worker] : workers_) jobs.insert(worker->job_id);
        for (const auto& job : jobs) StopJob(job, -1, now);
      }
      if (stopping) {
        for (auto& [pid, worker] : workers_) spawner_->KillGroup(pid, SIGKILL);
      }
      std::vector<pollfd> fds;
      std::vector<Worker*> polled;
      for (auto& [pid, worker] : workers_) {
        if (worker->output_fd < 0) continue;
        fds.push_back(pollfd{worker->output_fd, POLLIN, 0});
        polled.push_back(worker.get());
      }
      if (!fds.empty()) {
        poll(fds.data(), fds.size(), 20);
      } else {
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
      for (size_t i = 0; i < fds.size(); ++i) {
        if (fds[i].revents) Drain(*polled[i], batches[polled[i]->job_id], false);
      }
      while (std::optional<ProcessExit> exit = spawner_->TryReap()) {
        auto found = workers_.find(exit->pid);
        if (found == workers_.end()) continue;
        Worker& worker = *found->second;
        {
          std::lock_guard<std::mutex> lock(live_mu_);
          live_.erase(std::remove_if(live_.begin(), live_.end(),
                                     [&](const v1::RunningWorker& w) { return w.pid() == exit->pid; }),
                      live_.end());
        }
        Drain(worker, batches[worker.job_id], true);
        SendBatches(batches);  // the lines go before the exit report
        v1::WorkerStateReport report;
        report.set_node_id(options_.node_id);
        report.set_job_id(worker.job_id);
        report.set_generation(worker.generation);
        report.set_rank(worker.rank);
        report.set_pid(worker.pid);
        report.set_state(exit->signal ? "killed" : "exited");
        report.set_exit_code(exit->exit_code);
        report.set_signal(exit->signal);
        report.set_log_path(worker.log_path);
        for (const auto& line : worker.tail) report.add_log_tail(line);
        if (exit->signal == SIGKILL && worker.kill_at_ms == 0) {
          std::optional<int64_t> ooms = ReadOomKillCount();
          if (ooms && worker.oom_kills_at_start && *ooms > *worker.oom_kills_at_start) report.set_oom_killed(true);
        }
        Enqueue(report);
        bool failed = exit->signal != 0 || exit->exit_code != 0;
        if (failed && worker.kill_at_ms == 0) {
          LTRAIN_LOG(kWarning, kLog) << worker.job_id << " rank " << worker.rank << " "
                                     << (exit->signal ? "was killed by " + SignalName(exit->signal)
                                                      : "exited with code " + std::to_string(exit->exit_code))
                                     << "; stopping the job's other workers on this node";
          std::string job_id = worker.job_id;
          int worker_generation = worker.generation;
          if (worker.output_fd >= 0) close(worker.output_fd);
          workers_.erase(found);
          StopJob(job_id, worker_generation, now);
          continue;
        }
        if (worker.output_fd >= 0) close(worker.output_fd);
        workers_.erase(found);
      }
      for (auto& [pid, worker] : workers_) {
        if (worker->kill_at_ms != 0 && now >= worker->kill_at_ms) {
          spawner_->KillGroup(pid, SIGKILL);
          worker->kill_at_ms = now + 1000000;  // once
        }
      }
      SendBatches(batches);
      if (stopping && workers_.empty()) return;
      if (stopping) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  }

  AgentOptions options_;
  std::unique_ptr<ProcessSpawner> spawner_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::AgentService::Stub> agent_stub_;
  std::unique_ptr<RendezvousProxy> proxy_;
  std::unique_ptr<grpc::Server> proxy_server_;
  int proxy_port_ = 0;

  std::once_flag shutdown_once_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stopping_ = false;
  bool stopped_ = false;
  std::shared_ptr<grpc::ClientContext> stream_context_;
  std::deque<v1::Command> inbox_;
  bool orphan_kill_requested_ = false;
  int64_t job_heartbeat_ms_ = 0;

  ProgressSink progress_;
  std::mutex live_mu_;
  std::vector<v1::RunningWorker> live_;  // workers not yet reaped, for registration and heartbeats

  std::mutex out_mu_;
  std::condition_variable out_cv_;
  std::deque<Outgoing> outbox_;
  bool sender_done_ = false;

  std::map<pid_t, std::unique_ptr<Worker>> workers_;  // supervisor thread only
  std::thread supervisor_, sender_, connector_, heartbeat_;
};

}  // namespace

std::string DefaultWorkerBinary() {
  if (const char* env = getenv("LTRAIN_WORKER_BIN"); env && *env) return env;
  std::error_code ec;
  fs::path self = fs::read_symlink("/proc/self/exe", ec);
  return (self.parent_path() / "ltrain-worker").string();
}

StatusOr<std::unique_ptr<Agent>> Agent::Start(AgentOptions options, std::unique_ptr<ProcessSpawner> spawner) {
  if (options.coordinator.empty()) return InvalidArgument("the agent needs --coordinator HOST:PORT");
  if (options.node_id.empty()) {
    char host[256] = {0};
    gethostname(host, sizeof(host) - 1);
    options.node_id = host;
  }
  if (options.worker_binary.empty()) options.worker_binary = DefaultWorkerBinary();
  if (!spawner) spawner = std::make_unique<RealProcessSpawner>();
  auto agent = std::make_unique<AgentImpl>(std::move(options), std::move(spawner));
  Status status = agent->Init();
  if (!status.ok()) return status;
  return std::unique_ptr<Agent>(std::move(agent));
}

}  // namespace ltrain::agent
