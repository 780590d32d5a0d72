#include "agent/agent.h"

#include <poll.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <filesystem>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <mutex>
#include <thread>
#include <variant>

#include <grpcpp/grpcpp.h>

#include "agent/gpu_attachment.h"
#include "agent/outbox.h"
#include "agent/progress_table.h"
#include "agent/supervisor.h"
#include "agent/worker_credentials.h"
#include "common/clock.h"
#include "common/files.h"
#include "common/logging.h"
#include "common/transport_probe.h"
#include "ltrain/v1/ltrain.grpc.pb.h"

namespace ltrain::agent {
namespace {

namespace fs = std::filesystem;
constexpr const char* kLog = "agent";


// Who calls the agent's loopback services: a worker of one of its jobs, by the secret of that job
// generation; anyone else is refused.
grpc::Status Authorize(const grpc::ServerContext& context, const WorkerCredentials& credentials, WorkerGrant* grant) {
  auto found = context.client_metadata().find("authorization");
  if (found == context.client_metadata().end()) {
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                        "this agent serves only the workers it started (they hold LTRAIN_AGENT_SECRET_FILE)");
  }
  std::optional<WorkerGrant> granted = credentials.Find(std::string_view(found->second.data(), found->second.size()));
  if (!granted) {
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                        "the secret is none of this agent's current job generations'");
  }
  *grant = std::move(*granted);
  return grpc::Status::OK;
}

grpc::Status OutsideScope(const WorkerGrant& grant, const std::string& key) {
  return grpc::Status(grpc::StatusCode::PERMISSION_DENIED,
                      "key '" + ValidUtf8(key.substr(0, 200)) + "' is outside the rendezvous scope of job " +
                          grant.job_id + " generation " + std::to_string(grant.generation));
}

// Forwards the workers' rendezvous calls to the coordinator: each worker only the keys of its own
// job generation.
class RendezvousProxy final : public v1::RendezvousService::Service {
 public:
  RendezvousProxy(std::shared_ptr<grpc::Channel> channel, const WorkerCredentials* credentials)
      : stub_(v1::RendezvousService::NewStub(std::move(channel))), credentials_(credentials) {}

  grpc::Status Set(grpc::ServerContext* server, const v1::KvSetRequest* request, v1::KvSetReply* reply) override {
    WorkerGrant grant;
    if (grpc::Status s = Authorize(*server, *credentials_, &grant); !s.ok()) return s;
    if (request->key().rfind(grant.rendezvous_scope, 0) != 0) return OutsideScope(grant, request->key());
    const auto deadline = Deadline(30);
    return Retried(deadline, [&](grpc::ClientContext& context) { return stub_->Set(&context, *request, reply); });
  }

  grpc::Status Get(grpc::ServerContext* server, const v1::KvGetRequest* request, v1::KvGetReply* reply) override {
    WorkerGrant grant;
    if (grpc::Status s = Authorize(*server, *credentials_, &grant); !s.ok()) return s;
    for (const std::string& key : request->keys()) {
      if (key.rfind(grant.rendezvous_scope, 0) != 0) return OutsideScope(grant, key);
    }
    // The node's ranks ask for the same keys at once (every rank waits for rank 0's NCCL id): one
    // call to the coordinator answers all of them, so that its load is per node, not per rank.
    const std::string flight_key = request->SerializeAsString();
    std::shared_ptr<Flight> flight;
    bool leader = false;
    {
      std::lock_guard<std::mutex> lock(flights_mu_);
      auto [it, inserted] = flights_.try_emplace(flight_key);
      if (inserted) it->second = std::make_shared<Flight>();
      flight = it->second;
      leader = inserted;
    }
    if (!leader) {
      std::unique_lock<std::mutex> lock(flight->mu);
      flight->cv.wait(lock, [&] { return flight->done; });
      *reply = flight->reply;
      return flight->status;
    }
    // While its generation lives the coordinator answers when it can: no deadline here either.
    const auto deadline = request->while_generation_lives() ? std::chrono::system_clock::time_point::max()
                                                            : Deadline(request->timeout_ms() / 1000.0 + 5);
    grpc::Status status =
        Retried(deadline, [&](grpc::ClientContext& context) { return stub_->Get(&context, *request, reply); });
    {
      std::lock_guard<std::mutex> lock(flights_mu_);
      flights_.erase(flight_key);  // a Get after this one asks the coordinator again
    }
    {
      std::lock_guard<std::mutex> lock(flight->mu);
      flight->status = status;
      flight->reply = *reply;
      flight->done = true;
    }
    flight->cv.notify_all();
    return status;
  }

 private:
  // One coordinator call that identical Gets of this node's workers wait on.
  struct Flight {
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;
    grpc::Status status;
    v1::KvGetReply reply;
  };
  std::mutex flights_mu_;
  std::map<std::string, std::shared_ptr<Flight>> flights_;

  // A call the coordinator could not answer (it went away, or a standby is taking the lead) is made
  // again until its deadline: a rendezvous in progress (a recovery in place) survives a takeover.
  template <typename Call>
  grpc::Status Retried(std::chrono::system_clock::time_point deadline, Call call) {
    while (true) {
      grpc::ClientContext context;
      context.set_deadline(deadline);
      context.set_wait_for_ready(true);
      grpc::Status status = call(context);
      if (status.error_code() != grpc::StatusCode::UNAVAILABLE || std::chrono::system_clock::now() >= deadline) {
        return status;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
    }
  }

  std::unique_ptr<v1::RendezvousService::Stub> stub_;
  const WorkerCredentials* credentials_;
};

// Receives the progress reports of this node's workers into the table, and answers each with
// whether the job is to stop after a final checkpoint. A report that brings news (see
// ProgressTable::Record) goes to `news` before the reply: the worker prints only after the reply.
class ProgressSink final : public v1::WorkerService::Service {
 public:
  ProgressSink(ProgressTable* table, std::function<void(v1::RankProgress)> news, const WorkerCredentials* credentials)
      : table_(table), news_(std::move(news)), credentials_(credentials) {}

  grpc::Status ReportProgress(grpc::ServerContext* server, const v1::RankProgress* request, v1::ProgressAck* ack) override {
    WorkerGrant grant;
    if (grpc::Status s = Authorize(*server, *credentials_, &grant); !s.ok()) return s;
    if (request->job_id() != grant.job_id || request->generation() != grant.generation) {
      return grpc::Status(grpc::StatusCode::PERMISSION_DENIED,
                          "a worker of job " + grant.job_id + " generation " + std::to_string(grant.generation) +
                              " may report only its own progress");
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (auto stop = checkpoint_stops_.find(request->job_id());
          stop != checkpoint_stops_.end() && request->generation() <= stop->second) {
        ack->set_checkpoint_and_stop(true);
      }
    }
    if (std::optional<v1::RankProgress> news = table_->Record(*request)) news_(std::move(*news));
    return grpc::Status::OK;
  }

  // From now on the job's workers of `generation` and older learn, in the reply to their next
  // report, that they are to stop after a final checkpoint.
  void RequestCheckpointStop(const std::string& job_id, int generation) {
    std::lock_guard<std::mutex> lock(mu_);
    auto [stop, added] = checkpoint_stops_.emplace(job_id, generation);
    if (!added) stop->second = std::max(stop->second, generation);
  }

 private:
  ProgressTable* table_;
  std::function<void(v1::RankProgress)> news_;
  const WorkerCredentials* credentials_;
  std::mutex mu_;
  std::map<std::string, int> checkpoint_stops_;  // job id -> newest generation to stop after a checkpoint
};

// What the sender thread delivers to the coordinator, in order: the supervisor's messages and the
// progress that must come before the lines printed after it.
using OutboxMessage = std::variant<v1::WorkerStateReport, v1::PushLogsRequest, v1::ProgressReport>;

class AgentImpl : public Agent, private SupervisorOutbox {
 public:
  AgentImpl(AgentOptions options, std::unique_ptr<ProcessSpawner> spawner)
      : options_(std::move(options)), spawner_(std::move(spawner)) {}

  Status Init() {
    channel_ = MakeChannel(options_.coordinator, options_.security);
    agent_stub_ = v1::AgentService::NewStub(channel_);
    if (Status made = CreateDirectories(options_.work_dir); !made.ok()) {
      return Unavailable("the agent directory: " + made.message());
    }
    if (access(options_.worker_binary.c_str(), X_OK) != 0) {
      return FailedPrecondition("worker binary " + options_.worker_binary +
                                " is not executable; build it or pass --worker-binary");
    }
    if (options_.keep_gpus_attached) gpus_ = std::make_unique<GpuAttachment>();
    proxy_ = std::make_unique<RendezvousProxy>(channel_, &credentials_);
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
    request.mutable_facts()->set_gpus(LocalGpuCount());
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
        if (command.has_start() || command.has_stop() || command.has_dump()) {
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
        // Within a second a step: a Shutdown meanwhile waits for it.
        const TransportDiagnosis diagnosis = status.error_code() == grpc::StatusCode::UNAVAILABLE
                                                 ? DiagnoseTransport(options_.coordinator, options_.security, 1000)
                                                 : TransportDiagnosis{};
        LTRAIN_LOG(kWarning, kLog) << "lost the coordinator at " << options_.coordinator << " ("
                                   << (diagnosis.fault == TransportFault::kNone ? status.error_message()
                                                                                : diagnosis.message)
                                   << "); reconnecting, workers keep running for up to "
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
      std::set<WorkerKey> live;
      {
        std::lock_guard<std::mutex> lock(live_mu_);
        for (const auto& w : live_) live.insert({w.job_id(), w.generation(), w.rank()});
      }
      for (auto& report : progress_table_.Collect(live)) *request.add_progress() = std::move(report);
      v1::HeartbeatReply reply;
      grpc::ClientContext context;
      context.set_deadline(Deadline(options_.heartbeat_interval_s));
      agent_stub_->Heartbeat(&context, request, &reply);
    }
  }

  void Enqueue(OutboxMessage message) {
    std::lock_guard<std::mutex> lock(out_mu_);
    outbox_.push_back(std::move(message));
    out_cv_.notify_all();
  }

  // On a WorkerService handler's thread, before the worker gets its reply.
  void SendProgressNews(v1::RankProgress report) {
    v1::ProgressReport message;
    message.set_node_id(options_.node_id);
    *message.add_progress() = std::move(report);
    Enqueue(std::move(message));
  }

  void SendLoop() {
    while (true) {
      OutboxMessage message;
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
      } else if (auto* progress = std::get_if<v1::ProgressReport>(&message)) {
        v1::ProgressReply reply;
        status = agent_stub_->ReportProgress(&context, *progress, &reply);
      } else {
        v1::PushLogsReply reply;
        status = agent_stub_->PushLogs(&context, std::get<v1::PushLogsRequest>(message), &reply);
      }
      std::unique_lock<std::mutex> lock(out_mu_);
      if (status.ok() || sender_done_) {
        outbox_.pop_front();
        continue;
      }
      if (IsRetryable(status.error_code())) {
        // The coordinator is away or busy: keep the message and try again shortly, in order.
        out_cv_.wait_for(lock, std::chrono::milliseconds(500), [this] { return sender_done_; });
        continue;
      }
      // Refused for what it holds: sending it again would be refused again, and every report behind
      // it would wait for ever. A dropped batch of lines leaves a line saying so in its place.
      outbox_.pop_front();
      const std::string why = std::to_string(static_cast<int>(status.error_code())) + ": " + status.error_message();
      if (const auto* logs = std::get_if<v1::PushLogsRequest>(&message)) {
        LTRAIN_LOG(kWarning, "agent") << "the coordinator refused " << logs->lines_size() << " log line(s) of job "
                                      << logs->job_id() << " (" << why << "); dropped";
        if (std::optional<v1::PushLogsRequest> notice = DroppedLinesNotice(*logs, why)) outbox_.push_front(std::move(*notice));
      } else if (const auto* report = std::get_if<v1::WorkerStateReport>(&message)) {
        LTRAIN_LOG(kWarning, "agent") << "the coordinator refused the " << report->state() << " report of job "
                                      << report->job_id() << " rank " << report->rank() << " (" << why << "); dropped";
      } else {
        LTRAIN_LOG(kWarning, "agent") << "the coordinator refused a progress report (" << why << "); dropped";
      }
    }
  }

  // SupervisorOutbox, on the supervisor thread.
  void Send(SupervisorMessage message) override {
    std::visit([this](auto&& m) { Enqueue(std::move(m)); }, std::move(message));
  }
  void RunningChanged(const std::vector<v1::RunningWorker>& running) override {
    std::lock_guard<std::mutex> lock(live_mu_);
    live_ = running;
  }

  void SuperviseLoop() {
    RealClock clock;
    SupervisorOptions options;
    options.node_id = options_.node_id;
    options.work_dir = options_.work_dir;
    options.worker_binary = options_.worker_binary;
    options.bind_address = options_.bind_address;
    options.agent_address = "127.0.0.1:" + std::to_string(proxy_port_);
    options.stop_grace_ms = static_cast<int64_t>(options_.stop_grace_s * 1000);
    options.issue_worker_secret = [this](const v1::StartJobCommand& start) {
      return credentials_.Issue(start.job_id(), start.generation(), start.rendezvous_scope());
    };
    options.revoke_worker_secret = [this](const std::string& job_id, int generation) {
      credentials_.Revoke(job_id, generation);
    };
    // The rank's last progress goes with its exit: a commit or a stop reported just before the exit
    // is applied before it.
    options.complete_exit_report = [this](v1::WorkerStateReport& report) {
      progress_table_.CompleteExitReport(report);
    };
    Supervisor supervisor(std::move(options), *spawner_, clock, *this);
    bool shutdown_signalled = false;
    while (true) {
      std::deque<v1::Command> commands;
      bool stopping;
      bool orphaned;
      {
        std::lock_guard<std::mutex> lock(mu_);
        commands.swap(inbox_);
        stopping = stopping_;
        orphaned = orphan_kill_requested_;
        orphan_kill_requested_ = false;
      }
      for (const auto& command : commands) {
        if (command.has_start()) supervisor.StartJob(command.start());
        if (command.has_stop() && command.stop().checkpoint()) {
          // The workers save and exit on their own; a plain stop follows if they do not.
          LTRAIN_LOG(kInfo, kLog) << "stopping " << command.stop().job_id()
                                  << " after a final checkpoint: " << command.stop().reason();
          progress_.RequestCheckpointStop(command.stop().job_id(), command.stop().generation());
        } else if (command.has_stop()) {
          LTRAIN_LOG(kInfo, kLog) << "stopping " << command.stop().job_id() << ": " << command.stop().reason();
          supervisor.StopJob(command.stop().job_id(), command.stop().generation());
        }
        if (command.has_dump()) supervisor.DumpCollectives(command.dump().job_id(), command.dump().generation());
      }
      if (orphaned) supervisor.StopAll();
      // A shutdown stops the workers as a job stop does: SIGTERM, SIGKILL after the grace (the
      // workers a stop already signalled keep their deadline).
      if (stopping && !shutdown_signalled) {
        supervisor.StopAll();
        shutdown_signalled = true;
      }
      std::vector<pollfd> fds;
      for (int fd : supervisor.OutputFds()) fds.push_back(pollfd{fd, POLLIN, 0});
      if (!fds.empty()) {
        poll(fds.data(), fds.size(), 20);
      } else {
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
      supervisor.Poll();
      if (stopping && supervisor.Idle()) return;
      if (stopping) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  }

  AgentOptions options_;
  std::unique_ptr<ProcessSpawner> spawner_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::AgentService::Stub> agent_stub_;
  std::unique_ptr<GpuAttachment> gpus_;  // null with --release-idle-gpus
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

  RealClock clock_;
  WorkerCredentials credentials_;
  ProgressTable progress_table_{clock_};
  ProgressSink progress_{&progress_table_, [this](v1::RankProgress report) { SendProgressNews(std::move(report)); },
                         &credentials_};
  std::mutex live_mu_;
  std::vector<v1::RunningWorker> live_;  // workers not yet reaped, for registration and heartbeats

  std::mutex out_mu_;
  std::condition_variable out_cv_;
  std::deque<OutboxMessage> outbox_;
  bool sender_done_ = false;

  std::thread supervisor_, sender_, connector_, heartbeat_;
};

}  // namespace

int LocalGpuCount() {
  int gpus = 0;
  for (int i = 0; i < 64; ++i) gpus += fs::exists("/dev/nvidia" + std::to_string(i)) ? 1 : 0;
  return gpus;
}

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
  LTRAIN_RETURN_IF_ERROR(agent->Init());
  return std::unique_ptr<Agent>(std::move(agent));
}

}  // namespace ltrain::agent
