#include "cmd/run_job.h"

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <optional>
#include <regex>
#include <thread>

#include <unistd.h>

#include "agent/agent.h"
#include "cmd/job_printer.h"
#include "common/files.h"
#include "common/logging.h"
#include "launcher/coordinator_server.h"
#include "launcher/state_store.h"

namespace ltrain::cli {
namespace {

namespace fs = std::filesystem;

// The coordinator and agent a standalone launch runs in its own process, on loopback.
struct LocalControlPlane {
  std::unique_ptr<launcher::CoordinatorServer> coordinator;
  std::unique_ptr<agent::Agent> agent;

  // The token this launch made for its coordinator: on loopback still, another local user must
  // not drive it.
  SecurityMaterial security;

  Status Start(const std::string& home, const std::string& http_listen) {
    security.token = NewToken();
    launcher::CoordinatorServerOptions options;
    options.state_dir = home;
    options.http_listen = http_listen;
    if (!http_listen.empty()) {
      // /metrics takes the home's read-only metrics token, the same for every launch there.
      LTRAIN_RETURN_IF_ERROR(CreateDirectories(home));
      LTRAIN_ASSIGN_OR_RETURN(options.metrics_token, LoadOrCreateTokenFile(MetricsTokenFile(home)));
    }
    options.security = security;
    options.recover = false;  // jobs in a shared $LTRAIN_HOME may belong to other running launches
    LTRAIN_ASSIGN_OR_RETURN(coordinator, launcher::CoordinatorServer::Start(options));
    agent::AgentOptions agent_options;
    agent_options.coordinator = coordinator->address();
    agent_options.node_id = "local";
    agent_options.security = security;
    agent_options.work_dir = (fs::path(home) / "agent-local").string();
    LTRAIN_ASSIGN_OR_RETURN(agent, agent::Agent::Start(agent_options));
    // The job is submitted once the local node is there, so that it is placed at once instead of
    // waiting for nodes.
    if (!coordinator->coordinator().WaitForNode(agent_options.node_id, 10000)) {
      return Unavailable("the local agent did not reach the local coordinator within 10 s");
    }
    return Status::Ok();
  }

  void Shutdown() {
    if (agent) agent->Shutdown();
    if (coordinator) coordinator->Shutdown();
  }
};

// The long work of a followed job's ranks (building the model, saving or loading a checkpoint,
// waiting for the other ranks' files), polled once a second: on a terminal, a bar kept under the
// job's lines; elsewhere a line once the same work has lasted 2 s, and every 10 s while it lasts.
// Short work (a small checkpoint's save) shows nothing.
class WorkWatcher {
 public:
  WorkWatcher(CoordinatorClient& client, std::string job_id, std::mutex& out)
      : client_(client), job_id_(std::move(job_id)), out_(out), tty_(::isatty(STDOUT_FILENO) != 0) {
    thread_ = std::thread([this] { Loop(); });
  }
  ~WorkWatcher() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      done_ = true;
    }
    wake_.notify_all();
    thread_.join();
    std::lock_guard<std::mutex> lock(out_);
    Clear();
    std::fflush(stdout);
  }
  WorkWatcher(const WorkWatcher&) = delete;
  WorkWatcher& operator=(const WorkWatcher&) = delete;

  // With `out` held, around each line the follower prints: the bar leaves the terminal's last line
  // and comes back under the new one.
  void Clear() {
    if (!shown_) return;
    std::fputs("\r\033[K", stdout);
    shown_ = false;
  }
  void Redraw() {
    if (!tty_ || bar_.empty()) return;
    std::fputs(bar_.c_str(), stdout);
    shown_ = true;
  }

 private:
  // "rank R: WORK" of the first rank in long work of its own (rather than waiting for others), with
  // how many more are in long work (or in the same work); "" when none is.
  static std::string Describe(const v1::Job& job, std::string& identity) {
    const v1::RankInfo* shown = nullptr;
    int busy = 0;
    for (const v1::RankInfo& rank : job.ranks()) {
      if (rank.work().empty()) continue;
      ++busy;
      const bool waits = rank.work().rfind("waiting", 0) == 0;
      if (shown == nullptr || (shown->work().rfind("waiting", 0) == 0 && !waits)) shown = &rank;
    }
    if (shown == nullptr) return "";
    const std::string what = shown->work().substr(0, shown->work().rfind(", "));
    identity = std::to_string(shown->rank()) + " " + what;
    int alike = 0;
    for (const v1::RankInfo& rank : job.ranks()) alike += rank.work().rfind(what + ", ", 0) == 0 ? 1 : 0;
    std::string text = "rank " + std::to_string(shown->rank()) + ": " + shown->work();
    const std::string more = std::to_string(busy - 1) + " more rank" + (busy > 2 ? "s" : "");
    if (busy > 1) text += " (" + more + (alike == busy ? " alike)" : " in long work)");
    return text;
  }

  // A bar of the first "X of Y" in `text`, or the text alone.
  static std::string Bar(const std::string& text) {
    static const std::regex kAmounts(R"(([0-9.]+) of ([0-9.]+))");
    std::smatch m;
    std::string bar;
    if (std::regex_search(text, m, kAmounts) && std::stod(m[2].str()) > 0) {
      const double fraction = std::min(1.0, std::stod(m[1].str()) / std::stod(m[2].str()));
      const int width = 24, filled = static_cast<int>(width * fraction);
      bar = "[" + std::string(filled, '#') + std::string(width - filled, ' ') + "] ";
    }
    return bar + text;
  }

  void Loop() {
    using Clock = std::chrono::steady_clock;
    std::string identity;
    Clock::time_point since{}, printed{};
    bool printed_once = false;
    while (true) {
      {
        std::unique_lock<std::mutex> lock(mu_);
        if (wake_.wait_for(lock, std::chrono::seconds(1), [this] { return done_; })) return;
      }
      std::optional<v1::Job> job = client_.TryGetJob(job_id_, 2);
      std::string now_identity;
      const std::string text = job ? Describe(*job, now_identity) : "";
      const auto now = Clock::now();
      if (now_identity != identity) {
        identity = now_identity;
        since = now;
        printed_once = false;
      }
      const bool lasting = !text.empty() && now - since >= std::chrono::seconds(2);
      std::lock_guard<std::mutex> lock(out_);
      if (tty_) {
        Clear();
        bar_ = lasting ? Bar(text) : "";
        Redraw();
      } else if (lasting && (!printed_once || now - printed >= std::chrono::seconds(10))) {
        std::printf("ltrain: %s\n", text.c_str());
        printed = now;
        printed_once = true;
      }
      std::fflush(stdout);
    }
  }

  CoordinatorClient& client_;
  const std::string job_id_;
  std::mutex& out_;
  const bool tty_;
  bool shown_ = false;  // the bar is on the terminal (under out_)
  std::string bar_;     // under out_
  std::mutex mu_;
  std::condition_variable wake_;
  bool done_ = false;
  std::thread thread_;
};

}  // namespace

int FollowJob(CoordinatorClient& client, const std::string& job_id, bool quiet, int64_t after_seq, bool standalone) {
  std::mutex out;
  WorkWatcher work(client, job_id, out);
  int64_t after = after_seq;
  for (int attempt = 0;; ++attempt) {
    grpc::ClientContext context;
    v1::WatchJobRequest request;
    request.set_job_id(job_id);
    request.set_after_seq(after);
    request.set_logs(true);
    auto reader = client.stub().WatchJob(&context, request);
    v1::Event event;
    v1::JobState final_state = v1::JOB_STATE_UNSPECIFIED;
    while (reader->Read(&event)) {
      after = event.seq();
      {
        std::lock_guard<std::mutex> lock(out);
        work.Clear();
        std::fputs(FormatFollowedEvent(event, quiet).c_str(), stdout);
        work.Redraw();
        std::fflush(stdout);
      }
      if (event.kind() == "state" && launcher::IsFinal(event.state())) final_state = event.state();
    }
    grpc::Status status = reader->Finish();
    if (status.ok()) {
      if (final_state == v1::JOB_STATE_UNSPECIFIED || final_state == v1::JOB_STATE_FAILED) {
        if (std::optional<v1::Job> job = client.TryGetJob(job_id, 5)) {
          final_state = job->state();
          if (final_state == v1::JOB_STATE_FAILED) {
            std::fputs(FormatContinueHint(*job, standalone ? "" : client.address()).c_str(), stdout);
            std::fflush(stdout);
          }
        }
      }
      return ExitCodeFor(final_state);
    }
    if (status.error_code() == grpc::StatusCode::NOT_FOUND) {
      std::fprintf(stderr, "ltrain: %s\n", status.error_message().c_str());
      return kExitInvalid;
    }
    if (attempt >= 30) return client.Unreachable(status);
    std::this_thread::sleep_for(std::chrono::seconds(1));  // the coordinator may be restarting
  }
}

int RunJob(const RunJobOptions& options, const SecurityMaterial& security,
           const std::function<std::variant<BegunJob, int>(CoordinatorClient&)>& begin) {
  InterruptWatcher interrupts;  // before any thread starts, so every thread inherits the mask
  // The embedded coordinator's and agent's lines are for -v: what a user needs of them comes as the
  // job's events.
  if (!options.verbose) SetLogLevel(LogLevel::kError);
  bool standalone = options.coordinator.empty();
  if (!options.http_listen.empty() && !standalone) {
    std::fprintf(stderr, "ltrain: --http-listen serves a standalone launch's own coordinator; a coordinator daemon "
                         "serves its metrics with `ltrain coordinator --http-listen HOST:PORT`\n");
    return kExitInvalid;
  }
  if (options.detach && standalone) {
    // A standalone job lives in this command's embedded coordinator and agent: nothing would be
    // left to run it once the command returned.
    std::fprintf(stderr,
                 "ltrain: --detach needs --coordinator HOST:PORT (a coordinator that outlives this command); a "
                 "standalone job runs as long as this command does. To keep it running after you log out, start it "
                 "under nohup, tmux or `systemd-run --user`, and follow it with `ltrain status` and `ltrain logs -f`\n");
    return kExitInvalid;
  }
  std::string home = LtrainHome();
  LocalControlPlane local;
  std::string address = options.coordinator;
  if (standalone && !options.http_listen.empty() && !IsLoopbackAddress(options.http_listen) && !security.insecure) {
    std::fprintf(stderr, "ltrain: --http-listen %s is beyond loopback, and a standalone launch serves plain HTTP: the "
                         "dashboard's session would cross the network in clear text. Listen on 127.0.0.1 (and reach "
                         "it through an SSH tunnel), or pass --insecure on a network you trust\n",
                 options.http_listen.c_str());
    return kExitInvalid;
  }
  if (standalone) {
    // A launch killed earlier left its job RUNNING in the state: recorded FAILED first, so that it
    // can be resumed.
    (void)ReconcileDeadLaunches(home);
    Status started = local.Start(home, options.http_listen);
    if (!started.ok()) {
      std::fprintf(stderr, "ltrain: %s\n", started.message().c_str());
      return kExitUnavailable;
    }
    address = local.coordinator->address();
  }
  const SecurityMaterial& used = standalone ? local.security : security;
  CoordinatorClient client(address, used);
  std::variant<BegunJob, int> begun = begin(client);
  if (std::holds_alternative<int>(begun)) {
    local.Shutdown();
    return std::get<int>(begun);
  }
  const std::string job_id = std::get<BegunJob>(begun).job_id;
  const int64_t after_seq = std::get<BegunJob>(begun).after_seq;
  std::printf("ltrain: job %s %s to %s%s\n", job_id.c_str(), options.verb,
              standalone ? "the local coordinator at " : "", address.c_str());
  std::fflush(stdout);
  fs::path address_file = LocalAddressFile(home, job_id);
  int launch_lock = -1;
  if (standalone) {
    launch_lock = HoldLaunchLock(home, job_id);
    if (Status written = WriteLocalLaunch(home, job_id, LocalLaunch{address, local.security}); !written.ok()) {
      std::fprintf(stderr, "ltrain: %s; `ltrain status/logs/stop %s` will not reach this launch\n",
                   written.message().c_str(), job_id.c_str());
    } else if (local.coordinator->http_port() != 0) {
      // A link that works once, read-only: no token lands in the launch's output.
      StatusOr<std::string> link = local.coordinator->DashboardLink(job_id);
      const std::string metrics = link.ok() ? link->substr(0, link->find("/login?")) + "/metrics" : "";
      std::printf("ltrain: dashboard at %s (a one-time, read-only link for 10 minutes; `ltrain dashboard %s` prints "
                  "another)\n",
                  link.ok() ? link->c_str() : link.status().message().c_str(), job_id.c_str());
      std::printf("ltrain: metrics at %s with the read-only token of %s: curl -H \"Authorization: Bearer $(cat %s)\" "
                  "%s\n",
                  metrics.c_str(), MetricsTokenFile(home).c_str(), MetricsTokenFile(home).c_str(), metrics.c_str());
    }
  }
  if (options.detach && !standalone) {
    std::printf("%s\n", job_id.c_str());
    return kExitOk;
  }
  bool interrupted = false;
  // Goes before job_id, address, used and interrupted, which the callback reads.
  InterruptWatcher::Watching watching = interrupts.Start([&](int signal) {
    if (interrupted) std::_Exit(130);  // a second interrupt: leave now; the workers die with us
    interrupted = true;
    std::fprintf(stderr, "\nltrain: %s received; stopping job %s\n", signal == SIGINT ? "interrupt" : "SIGTERM",
                 job_id.c_str());
    CoordinatorClient stopper(address, used);
    v1::StopJobRequest stop;
    stop.set_job_id(job_id);
    stop.set_reason(std::string("stopped by ") + (signal == SIGINT ? "interrupt" : "SIGTERM") + " of ltrain");
    v1::StopJobReply stop_reply;
    grpc::ClientContext stop_context;
    stop_context.set_deadline(Deadline(5));
    stopper.stub().StopJob(&stop_context, stop, &stop_reply);
  });
  int code = FollowJob(client, job_id, options.quiet, after_seq, standalone);
  local.Shutdown();
  if (standalone) {
    std::error_code ec;
    fs::remove(address_file, ec);
    ReleaseLaunchLock(home, job_id, launch_lock);
  }
  return code;
}

}  // namespace ltrain::cli
