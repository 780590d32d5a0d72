#include "launcher/coordinator_server.h"

#include <malloc.h>
#include <unistd.h>

#include <condition_variable>
#include <deque>
#include <functional>
#include <filesystem>
#include <memory>
#include <mutex>
#include <thread>

#include "common/files.h"
#include "common/logging.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "ltrain/v1/ltrain.grpc.pb.h"

namespace ltrain::launcher {
namespace {

void SetStatus(v1::Status* out, const Status& status) {
  out->set_code(static_cast<int32_t>(status.code()));
  out->set_message(status.message());
}

class JobServiceImpl final : public v1::JobService::Service {
 public:
  using LinkMaker = std::function<StatusOr<std::string>(const std::string& job_id)>;
  JobServiceImpl(Coordinator* coordinator, std::string token, std::string warning, LinkMaker link)
      : coordinator_(coordinator), token_(std::move(token)), warning_(std::move(warning)), link_(std::move(link)) {}

  grpc::Status DashboardLink(grpc::ServerContext* context, const v1::DashboardLinkRequest* request,
                             v1::DashboardLinkReply* reply) override {
    if (grpc::Status denied = CheckBearerToken(*context, token_); !denied.ok()) return denied;
    StatusOr<std::string> url = link_(request->job_id());
    SetStatus(reply->mutable_status(), url.status());
    if (url.ok()) {
      reply->set_url(*url);
      reply->set_expires_in_s(DashboardAccess::kLoginCodeTtlMs / 1000.0);
    }
    return grpc::Status::OK;
  }

  grpc::Status SubmitJob(grpc::ServerContext* context, const v1::SubmitJobRequest* request, v1::SubmitJobReply* reply) override {
    if (grpc::Status denied = CheckBearerToken(*context, token_); !denied.ok()) return denied;
    const RpcTimer timer(&coordinator_->rpc_figures(), RpcKind::kSubmitJob);
    StatusOr<v1::Job> job = coordinator_->Submit(request->recipe_yaml(), request->source_name());
    SetStatus(reply->mutable_status(), job.status());
    if (job.ok()) *reply->mutable_job() = *job;
    return grpc::Status::OK;
  }

  grpc::Status GetJob(grpc::ServerContext* context, const v1::GetJobRequest* request, v1::GetJobReply* reply) override {
    if (grpc::Status denied = CheckBearerToken(*context, token_); !denied.ok()) return denied;
    StatusOr<v1::Job> job = coordinator_->GetJob(request->job_id());
    SetStatus(reply->mutable_status(), job.status());
    if (job.ok()) *reply->mutable_job() = *job;
    reply->set_warning(warning_);
    return grpc::Status::OK;
  }

  grpc::Status ListNodes(grpc::ServerContext* context, const v1::ListNodesRequest*, v1::ListNodesReply* reply) override {
    if (grpc::Status denied = CheckBearerToken(*context, token_); !denied.ok()) return denied;
    for (auto& node : coordinator_->ListNodes()) *reply->add_nodes() = std::move(node);
    SetStatus(reply->mutable_status(), Status::Ok());
    reply->set_warning(warning_);
    return grpc::Status::OK;
  }

  grpc::Status ListJobs(grpc::ServerContext* context, const v1::ListJobsRequest* request, v1::ListJobsReply* reply) override {
    if (grpc::Status denied = CheckBearerToken(*context, token_); !denied.ok()) return denied;
    StatusOr<std::vector<v1::Job>> jobs = coordinator_->ListJobs(request->limit());
    SetStatus(reply->mutable_status(), jobs.status());
    if (jobs.ok()) {
      for (auto& job : *jobs) *reply->add_jobs() = std::move(job);
    }
    reply->set_warning(warning_);
    return grpc::Status::OK;
  }

  grpc::Status StopJob(grpc::ServerContext* context, const v1::StopJobRequest* request, v1::StopJobReply* reply) override {
    if (grpc::Status denied = CheckBearerToken(*context, token_); !denied.ok()) return denied;
    StopOptions options;
    options.checkpoint = request->checkpoint();
    if (const double seconds = request->checkpoint_timeout_s(); seconds != 0) {
      // Converted only within a week: NaN, infinities and 1e308 are refused, not cast.
      if (!(seconds > 0 && seconds <= 7 * 86400.0)) {
        SetStatus(reply->mutable_status(), InvalidArgument("the timeout of a stop with a final checkpoint must be "
                                                           "positive and at most a week (604800 s)"));
        return grpc::Status::OK;
      }
      options.checkpoint_timeout_ms = static_cast<int64_t>(seconds * 1000);
    }
    StatusOr<v1::Job> job = coordinator_->Stop(request->job_id(), request->reason(), options);
    SetStatus(reply->mutable_status(), job.status());
    if (job.ok()) *reply->mutable_job() = *job;
    return grpc::Status::OK;
  }

  grpc::Status ResumeJob(grpc::ServerContext* context, const v1::ResumeJobRequest* request, v1::ResumeJobReply* reply) override {
    if (grpc::Status denied = CheckBearerToken(*context, token_); !denied.ok()) return denied;
    int64_t resumed_seq = 0;
    StatusOr<v1::Job> job = coordinator_->Resume(request->job_id(), &resumed_seq);
    SetStatus(reply->mutable_status(), job.status());
    if (job.ok()) *reply->mutable_job() = *job;
    if (resumed_seq > 0) reply->set_after_seq(resumed_seq - 1);
    return grpc::Status::OK;
  }

  grpc::Status GetLogs(grpc::ServerContext* context, const v1::GetLogsRequest* request, v1::GetLogsReply* reply) override {
    if (grpc::Status denied = CheckBearerToken(*context, token_); !denied.ok()) return denied;
    StatusOr<std::vector<v1::Event>> lines =
        coordinator_->GetLogs(request->job_id(), request->rank(), request->since_unix_ms(), request->limit());
    SetStatus(reply->mutable_status(), lines.status());
    if (lines.ok()) {
      for (auto& line : *lines) *reply->add_lines() = std::move(line);
    }
    return grpc::Status::OK;
  }

  grpc::Status WatchJob(grpc::ServerContext* context, const v1::WatchJobRequest* request,
                        grpc::ServerWriter<v1::Event>* writer) override {
    if (grpc::Status denied = CheckBearerToken(*context, token_); !denied.ok()) return denied;
    int64_t after = request->after_seq();
    while (!context->IsCancelled() && !coordinator_->shutting_down()) {
      bool finished = false;
      StatusOr<std::vector<v1::Event>> events =
          coordinator_->WaitEvents(request->job_id(), after, request->logs(), 250, &finished);
      if (!events.ok()) return grpc::Status(grpc::StatusCode::NOT_FOUND, events.status().message());
      for (const auto& event : *events) {
        if (!writer->Write(event)) return grpc::Status::CANCELLED;
        after = std::max(after, event.seq());
      }
      if (finished) return grpc::Status::OK;
    }
    return grpc::Status(grpc::StatusCode::UNAVAILABLE, "coordinator is shutting down");
  }

 private:
  Coordinator* coordinator_;
  std::string token_;
  std::string warning_;
  LinkMaker link_;
};

}  // namespace

// Runs tasks in order on a thread of its own: the command streams' first writes after a quiet
// spell. Starting a gRPC write costs about 30 µs (it may write to the socket at once), and the
// coordinator hands commands over under its lock: a placement on 10,000 nodes held it 0.3 s.
class WriteStarter {
 public:
  WriteStarter() : thread_([this] { Run(); }) {}
  ~WriteStarter() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_one();
    thread_.join();
  }
  WriteStarter(const WriteStarter&) = delete;
  WriteStarter& operator=(const WriteStarter&) = delete;

  void Post(std::function<void()> task) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      tasks_.push_back(std::move(task));
    }
    cv_.notify_one();
  }

 private:
  void Run() {
    std::unique_lock<std::mutex> lock(mu_);
    while (true) {
      cv_.wait(lock, [&] { return stop_ || !tasks_.empty(); });
      if (tasks_.empty()) return;  // stopping, with every task run
      std::deque<std::function<void()>> batch;
      batch.swap(tasks_);
      lock.unlock();
      for (auto& task : batch) task();
      lock.lock();
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> tasks_;
  bool stop_ = false;
  std::thread thread_;
};

namespace {

// One agent's command stream on gRPC's callback API: no thread waits for an agent. The coordinator
// hands each command to the stream as it queues it (Deliver, under the coordinator's lock, so it
// only queues here and leaves the write's start to the WriteStarter), and each finished write
// starts the next.
class CommandStream final : public grpc::ServerWriteReactor<v1::Command> {
 public:
  CommandStream(Coordinator* coordinator, WriteStarter* starter, const v1::RegisterRequest& request)
      : coordinator_(coordinator), node_id_(request.node_id()), state_(std::make_shared<State>()) {
    state_->stream = this;
    state_->starter = starter;
    // An empty first message tells the agent it is registered.
    state_->pending.emplace_back();
    std::weak_ptr<State> weak = state_;
    token_ = coordinator_->NodeConnected(node_id_, request.facts(), {request.running().begin(), request.running().end()},
                                         [weak](v1::Command command) {
                                           if (std::shared_ptr<State> state = weak.lock()) state->Deliver(std::move(command));
                                         });
    std::lock_guard<std::mutex> lock(state_->mu);
    state_->WriteNextLocked();
  }

  void OnWriteDone(bool ok) override {
    std::lock_guard<std::mutex> lock(state_->mu);
    state_->writing = false;
    state_->pending.pop_front();
    if (!ok) {
      FinishOnceLocked(grpc::Status::OK);
      return;
    }
    state_->WriteNextLocked();
  }

  void OnCancel() override {
    std::lock_guard<std::mutex> lock(state_->mu);
    FinishOnceLocked(grpc::Status::OK);
  }

  void OnDone() override {
    coordinator_->NodeDisconnected(node_id_, token_);
    {
      std::lock_guard<std::mutex> lock(state_->mu);
      state_->stream = nullptr;
    }
    delete this;
  }

 private:
  struct State : std::enable_shared_from_this<State> {
    std::mutex mu;
    CommandStream* stream = nullptr;  // null once the call is done
    WriteStarter* starter = nullptr;
    std::deque<v1::Command> pending;  // the front is being written while `writing`
    bool writing = false;
    bool start_posted = false;        // a WriteStarter task will start the next write
    bool finished = false;

    void Deliver(v1::Command command) {
      std::lock_guard<std::mutex> lock(mu);
      if (stream == nullptr || finished) return;
      pending.push_back(std::move(command));
      if (writing || start_posted) return;  // OnWriteDone or the posted task takes it
      start_posted = true;
      starter->Post([weak = weak_from_this()] {
        if (std::shared_ptr<State> state = weak.lock()) {
          std::lock_guard<std::mutex> lock(state->mu);
          state->start_posted = false;
          state->WriteNextLocked();
        }
      });
    }
    void WriteNextLocked() {
      if (writing || finished || pending.empty() || stream == nullptr) return;
      writing = true;
      stream->StartWrite(&pending.front());
    }
  };

  void FinishOnceLocked(const grpc::Status& status) {
    if (state_->finished) return;
    state_->finished = true;
    Finish(status);
  }

  Coordinator* coordinator_;
  std::string node_id_;
  int64_t token_ = 0;
  std::shared_ptr<State> state_;
};

// A reactor that ends its call at once with `status`.
class Refusal final : public grpc::ServerWriteReactor<v1::Command> {
 public:
  explicit Refusal(const grpc::Status& status) { Finish(status); }
  void OnDone() override { delete this; }
};

// Every agent call on gRPC's callback API: a node costs no thread, however many there are.
class AgentServiceImpl final : public v1::AgentService::CallbackService {
 public:
  AgentServiceImpl(Coordinator* coordinator, WriteStarter* starter, std::string token)
      : coordinator_(coordinator), starter_(starter), token_(std::move(token)) {}

  grpc::ServerWriteReactor<v1::Command>* Connect(grpc::CallbackServerContext* context,
                                                 const v1::RegisterRequest* request) override {
    if (grpc::Status denied = CheckBearerToken(*context, token_); !denied.ok()) return new Refusal(denied);
    if (request->node_id().empty()) {
      return new Refusal(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "node_id is empty"));
    }
    if (coordinator_->shutting_down()) {
      return new Refusal(grpc::Status(grpc::StatusCode::UNAVAILABLE, "coordinator is shutting down"));
    }
    const RpcTimer timer(&coordinator_->rpc_figures(), RpcKind::kConnect);
    return new CommandStream(coordinator_, starter_, *request);
  }

  grpc::ServerUnaryReactor* Heartbeat(grpc::CallbackServerContext* context, const v1::HeartbeatRequest* request,
                                      v1::HeartbeatReply* reply) override {
    return Answer(context, RpcKind::kHeartbeat, [&] { SetStatus(reply->mutable_status(), coordinator_->Heartbeat(*request)); });
  }

  grpc::ServerUnaryReactor* ReportWorkerState(grpc::CallbackServerContext* context, const v1::WorkerStateReport* request,
                                              v1::WorkerStateReply* reply) override {
    return Answer(context, RpcKind::kReportWorkerState, [&] { SetStatus(reply->mutable_status(), coordinator_->ReportWorkerState(*request)); });
  }

  grpc::ServerUnaryReactor* ReportProgress(grpc::CallbackServerContext* context, const v1::ProgressReport* request,
                                           v1::ProgressReply* reply) override {
    return Answer(context, RpcKind::kReportProgress, [&] { SetStatus(reply->mutable_status(), coordinator_->ReportProgress(*request)); });
  }

  grpc::ServerUnaryReactor* Leave(grpc::CallbackServerContext* context, const v1::LeaveRequest* request,
                                  v1::LeaveReply*) override {
    return Answer(context, RpcKind::kLeave, [&] { coordinator_->NodeLeaving(request->node_id(), request->reason()); });
  }

  grpc::ServerUnaryReactor* PushLogs(grpc::CallbackServerContext* context, const v1::PushLogsRequest* request,
                                     v1::PushLogsReply*) override {
    return Answer(context, RpcKind::kPushLogs, [&] { coordinator_->PushLogs(*request); });
  }

 private:
  // A unary call answered at once on gRPC's callback threads: the token checked, then `handle`.
  template <typename Handle>
  grpc::ServerUnaryReactor* Answer(grpc::CallbackServerContext* context, RpcKind kind, Handle handle) {
    const RpcTimer timer(&coordinator_->rpc_figures(), kind);
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    if (grpc::Status denied = CheckBearerToken(*context, token_); !denied.ok()) {
      reactor->Finish(denied);
      return reactor;
    }
    handle();
    reactor->Finish(grpc::Status::OK);
    return reactor;
  }

  Coordinator* coordinator_;
  WriteStarter* starter_;
  std::string token_;
};

// The workers' key-value rendezvous on gRPC's callback API: a Get waiting for keys holds no thread,
// so that thousands of ranks can wait for one key at once.
class RendezvousServiceImpl final : public v1::RendezvousService::CallbackService {
 public:
  RendezvousServiceImpl(Coordinator* coordinator, std::string token) : coordinator_(coordinator), token_(std::move(token)) {}

  grpc::ServerUnaryReactor* Set(grpc::CallbackServerContext* context, const v1::KvSetRequest* request,
                                v1::KvSetReply* reply) override {
    const RpcTimer timer(&coordinator_->rpc_figures(), RpcKind::kKvSet);
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    if (grpc::Status denied = CheckBearerToken(*context, token_); !denied.ok()) {
      reactor->Finish(denied);
      return reactor;
    }
    SetStatus(reply->mutable_status(), coordinator_->KvSet(request->key(), request->value()));
    reactor->Finish(grpc::Status::OK);
    return reactor;
  }

  grpc::ServerUnaryReactor* Get(grpc::CallbackServerContext* context, const v1::KvGetRequest* request,
                                v1::KvGetReply* reply) override {
    const RpcTimer timer(&coordinator_->rpc_figures(), RpcKind::kKvGet);
    const auto start = std::chrono::steady_clock::now();
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    if (grpc::Status denied = CheckBearerToken(*context, token_); !denied.ok()) {
      reactor->Finish(denied);
      return reactor;
    }
    coordinator_->KvGetAsync(
        {request->keys().begin(), request->keys().end()}, request->timeout_ms(),
        [reactor, reply, start, figures = &coordinator_->rpc_figures()](StatusOr<std::vector<std::string>> values) {
          figures->Add(RpcKind::kKvGetAnswered, std::chrono::duration_cast<std::chrono::nanoseconds>(
                                                    std::chrono::steady_clock::now() - start)
                                                    .count());
          if (!values.ok()) {
            SetStatus(reply->mutable_status(), values.status());
          } else {
            for (auto& value : *values) reply->add_values(std::move(value));
          }
          reactor->Finish(grpc::Status::OK);
        },
        request->while_generation_lives());
    return reactor;
  }

 private:
  Coordinator* coordinator_;
  std::string token_;
};

// grpc.health.v1 behind the token: SERVING while the coordinator serves, NOT_SERVING once it shuts
// down. Only the whole server ("") and its three services are known. Watch answers on gRPC's
// callback threads and holds none while the status stays the same.
class HealthServiceImpl final : public grpc::health::v1::Health::CallbackService {
 public:
  using Response = grpc::health::v1::HealthCheckResponse;

  HealthServiceImpl(Coordinator* coordinator, std::string token) : coordinator_(coordinator), token_(std::move(token)) {}

  grpc::ServerUnaryReactor* Check(grpc::CallbackServerContext* context, const grpc::health::v1::HealthCheckRequest* request,
                                  Response* reply) override {
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    if (grpc::Status denied = CheckBearerToken(*context, token_); !denied.ok()) {
      reactor->Finish(denied);
      return reactor;
    }
    if (!Known(request->service())) {
      reactor->Finish(grpc::Status(grpc::StatusCode::NOT_FOUND, "unknown service " + request->service()));
      return reactor;
    }
    reply->set_status(Now());
    reactor->Finish(grpc::Status::OK);
    return reactor;
  }

  grpc::ServerWriteReactor<Response>* Watch(grpc::CallbackServerContext* context,
                                            const grpc::health::v1::HealthCheckRequest* request) override {
    class Stream final : public grpc::ServerWriteReactor<Response> {
     public:
      explicit Stream(Response::ServingStatus status) {
        response_.set_status(status);
        StartWrite(&response_);
      }
      void OnWriteDone(bool) override {}  // one answer; the stream stays open until the client goes
      void OnCancel() override { Finish(grpc::Status::CANCELLED); }
      void OnDone() override { delete this; }

     private:
      Response response_;
    };
    if (grpc::Status denied = CheckBearerToken(*context, token_); !denied.ok()) {
      return new Refusal<Response>(denied);
    }
    return new Stream(Known(request->service()) ? Now() : Response::SERVICE_UNKNOWN);
  }

 private:
  template <typename T>
  class Refusal final : public grpc::ServerWriteReactor<T> {
   public:
    explicit Refusal(const grpc::Status& status) { this->Finish(status); }
    void OnDone() override { delete this; }
  };

  static bool Known(const std::string& service) {
    return service.empty() || service == "ltrain.v1.JobService" || service == "ltrain.v1.AgentService" ||
           service == "ltrain.v1.RendezvousService";
  }
  Response::ServingStatus Now() const {
    return coordinator_->shutting_down() ? Response::NOT_SERVING : Response::SERVING;
  }

  Coordinator* coordinator_;
  std::string token_;
};

}  // namespace

StatusOr<std::unique_ptr<StateStore>> OpenStateStore(const std::string& state_dir, int64_t max_bytes) {
  if (Status made = CreateDirectories(state_dir); !made.ok()) {
    return Unavailable("the state directory: " + made.message());
  }
  StatusOr<std::unique_ptr<SqliteStateStore>> store =
      SqliteStateStore::Open((std::filesystem::path(state_dir) / "state.db").string());
  if (!store.ok()) return store.status();
  if (max_bytes > 0) LTRAIN_RETURN_IF_ERROR((*store)->LimitSize(max_bytes));
  return std::unique_ptr<StateStore>(std::move(store).value());
}

StatusOr<std::unique_ptr<CoordinatorServer>> CoordinatorServer::Start(const CoordinatorServerOptions& options,
                                                                      std::unique_ptr<StateStore> store) {
  if (options.security.token.empty()) {
    return InvalidArgument("a coordinator always requires a bearer token (SecurityMaterial::token is empty)");
  }
  // Fixed thresholds: glibc otherwise raises them as large blocks come and go (up to 32 MB for
  // mmap, twice that for trimming), and each arena then keeps that much free memory after
  // thousands of agents' connections are gone.
  ::mallopt(M_MMAP_THRESHOLD, 256 * 1024);
  ::mallopt(M_TRIM_THRESHOLD, 128 * 1024);
  std::unique_ptr<CoordinatorServer> server(new CoordinatorServer());
  if (store) {
    server->store_ = std::move(store);
  } else {
    LTRAIN_ASSIGN_OR_RETURN(server->store_, OpenStateStore(options.state_dir, options.state_max_bytes));
  }
  CoordinatorOptions coordinator_options;
  coordinator_options.state_dir = options.state_dir;
  coordinator_options.job_files_dir = (std::filesystem::path(options.state_dir) / "jobs").string();
  coordinator_options.node_timeout_ms = options.node_timeout_ms;
  coordinator_options.recovery_grace_ms = options.recovery_grace_ms;
  coordinator_options.rendezvous_answer_delay_ms = options.rendezvous_answer_delay_ms;
  coordinator_options.retain_ms = options.retain_ms;
  coordinator_options.show_events_once_stored = options.show_events_once_stored;
  coordinator_options.state_name = options.state_name;
  server->coordinator_ = std::make_unique<Coordinator>(server->store_.get(), &server->clock_, coordinator_options);
  if (options.recover) {
    LTRAIN_RETURN_IF_ERROR(server->coordinator_->Recover());
  }
  const std::string& token = options.security.token;
  CoordinatorServer* self = server.get();
  server->job_service_ = std::make_unique<JobServiceImpl>(
      server->coordinator_.get(), token, options.warning,
      [self](const std::string& job_id) { return self->DashboardLink(job_id); });
  server->write_starter_ = std::make_unique<WriteStarter>();
  server->agent_service_ = std::make_unique<AgentServiceImpl>(server->coordinator_.get(), server->write_starter_.get(), token);
  server->rendezvous_service_ = std::make_unique<RendezvousServiceImpl>(server->coordinator_.get(), token);

  server->health_service_ = std::make_unique<HealthServiceImpl>(server->coordinator_.get(), token);
  // gRPC's own health service answers anyone: ours, behind the token, instead.
  grpc::EnableDefaultHealthCheckService(false);
  grpc::ServerBuilder builder;
  // Thousands of agents each send a small message a second: HTTP/2's bandwidth-delay probes (a ping
  // after each) would double the packets for no window worth growing.
  builder.AddChannelArgument(GRPC_ARG_HTTP2_BDP_PROBE, 0);
  builder.AddListeningPort(options.listen_address, MakeServerCredentials(options.security), &server->port_);
  builder.RegisterService(server->job_service_.get());
  builder.RegisterService(server->agent_service_.get());
  builder.RegisterService(server->rendezvous_service_.get());
  builder.RegisterService(server->health_service_.get());
  server->server_ = builder.BuildAndStart();
  if (!server->server_ || server->port_ == 0) {
    return Unavailable("cannot listen on " + options.listen_address +
                       "; is the port in use? Pick another with --listen HOST:PORT");
  }
  if (!options.http_listen.empty()) {
    HttpServerOptions http;
    http.listen = options.http_listen;
    http.token = token;
    http.metrics_token = options.metrics_token;
    http.cert_pem = options.security.cert_pem;
    http.key_pem = options.security.key_pem;
    http.host_names = options.http_host_names;
    LTRAIN_ASSIGN_OR_RETURN(server->http_, HttpServer::Start(http, server->coordinator_.get()));
    server->http_host_ = http.listen.substr(0, http.listen.rfind(':'));
    if (server->http_host_ == "0.0.0.0" || server->http_host_ == "[::]" || server->http_host_.empty()) {
      char name[256] = {0};
      ::gethostname(name, sizeof(name) - 1);
      server->http_host_ = name;
    }
  }
  server->host_ = options.listen_address.substr(0, options.listen_address.rfind(':'));
  if (server->host_ == "0.0.0.0" || server->host_ == "[::]") server->host_ = "127.0.0.1";
  CoordinatorServer* raw = server.get();
  server->monitor_ = std::thread([raw] {
    int ticks = 0;
    while (!raw->stopping_) {
      raw->coordinator_->Tick();
      // What thousands of agents' connections used goes back to the system once they are gone
      // (glibc keeps freed memory in its arenas otherwise): every 10 s.
      if (++ticks % 50 == 0) ::malloc_trim(0);
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
    }
  });
  return server;
}

std::string CoordinatorServer::address() const { return host_ + ":" + std::to_string(port_); }

StatusOr<std::string> CoordinatorServer::DashboardLink(const std::string& job_id) {
  std::lock_guard<std::mutex> lock(http_mu_);
  if (!http_) {
    return FailedPrecondition("this coordinator serves no dashboard: start it with --http-listen HOST:PORT");
  }
  return http_->LoginLink(http_host_, job_id);
}

void CoordinatorServer::Wait() { server_->Wait(); }

void CoordinatorServer::Shutdown() {
  // Callers from several threads all return once the server has stopped.
  std::call_once(shutdown_once_, [this] {
    stopping_ = true;
    {
      std::lock_guard<std::mutex> lock(http_mu_);
      http_.reset();  // before the coordinator stops answering
    }
    coordinator_->Shutdown();
    server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
    if (monitor_.joinable()) monitor_.join();
  });
}

CoordinatorServer::~CoordinatorServer() { Shutdown(); }

}  // namespace ltrain::launcher
