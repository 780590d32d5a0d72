// ltrain: the command line. Parses flags, wires the libraries, maps outcomes to exit codes.
//
// Exit codes: 0 success (job SUCCEEDED); 1 the job FAILED; 2 invalid input (flags, recipe, data);
// 3 the coordinator could not be reached or answered an error; 4 the job was STOPPED.
#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>
#include <functional>
#include <thread>
#include <variant>

#include <CLI/CLI.hpp>
#include <google/protobuf/util/json_util.h>
#include <grpcpp/grpcpp.h>

#include "agent/agent.h"
#include "cmd/job_printer.h"
#include "common/clock.h"
#include "common/logging.h"
#include "common/recipe.h"
#include "common/slurm.h"
#include "common/transport_security.h"
#include "common/token_data.h"
#include "launcher/coordinator_server.h"
#include "launcher/log_view.h"
#include "launcher/state_store.h"
#include "ltrain/v1/ltrain.grpc.pb.h"

namespace fs = std::filesystem;
using namespace ltrain;

namespace {

constexpr int kExitOk = 0;
constexpr int kExitFailed = 1;
constexpr int kExitInvalid = 2;
constexpr int kExitUnavailable = 3;
constexpr int kExitStopped = 4;

std::string LtrainHome() {
  if (const char* env = getenv("LTRAIN_HOME"); env && *env) return env;
  const char* home = getenv("HOME");
  return (fs::path(home ? home : "/tmp") / ".ltrain").string();
}

std::string Absolute(const std::string& path) {
  if (path.empty()) return path;
  std::error_code ec;
  fs::path absolute = fs::absolute(path, ec);
  return ec ? path : absolute.lexically_normal().string();
}

std::chrono::system_clock::time_point Deadline(double seconds) {
  return std::chrono::system_clock::now() + std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000));
}

std::string ToJson(const google::protobuf::Message& message) {
  google::protobuf::util::JsonPrintOptions options;
  options.add_whitespace = true;
  options.always_print_primitive_fields = true;
  options.preserve_proto_field_names = true;
  std::string out;
  (void)google::protobuf::util::MessageToJsonString(message, &out, options);
  return out;
}

std::string StateName(v1::JobState state) { return launcher::JobStateName(state); }

int ExitCodeFor(v1::JobState state) {
  switch (state) {
    case v1::JOB_STATE_SUCCEEDED: return kExitOk;
    case v1::JOB_STATE_STOPPED: return kExitStopped;
    default: return kExitFailed;
  }
}

int64_t NowUnixMs() { return RealClock().UnixMs(); }

void PrintJobTable(const std::vector<v1::Job>& jobs) {
  std::fputs(cli::FormatJobTable(jobs, NowUnixMs()).c_str(), stdout);
}

void PrintJobDetail(const v1::Job& job) { std::fputs(cli::FormatJobDetail(job, NowUnixMs()).c_str(), stdout); }

}  // namespace

namespace {

// --- talking to a coordinator ----------------------------------------------------------------

// How this process reaches coordinators: TLS and token from the global flags and the environment.
SecurityMaterial g_security;

struct Client {
  explicit Client(const std::string& address)
      : address(address), stub(v1::JobService::NewStub(MakeChannel(address, g_security))) {}
  std::string address;
  std::unique_ptr<v1::JobService::Stub> stub;

  int Unreachable(const grpc::Status& status) const {
    if (status.error_code() == grpc::StatusCode::UNAUTHENTICATED) {
      std::fprintf(stderr, "ltrain: the coordinator at %s refused the request: %s\n", address.c_str(),
                   status.error_message().c_str());
      return kExitUnavailable;
    }
    std::fprintf(stderr,
                 "ltrain: cannot reach the coordinator at %s: %s\n"
                 "        is `ltrain coordinator` running there? Check --coordinator HOST:PORT.\n",
                 address.c_str(), status.error_message().c_str());
    return kExitUnavailable;
  }
};

int ReplyError(const v1::Status& status) {
  std::fprintf(stderr, "ltrain: %s\n", status.message().c_str());
  return status.code() == static_cast<int>(StatusCode::kInvalidArgument) ? kExitInvalid : kExitUnavailable;
}

// Streams a job's events and log lines until it ends; returns the exit code for its final state.
int FollowJob(Client& client, const std::string& job_id, bool quiet) {
  int64_t after = 0;
  for (int attempt = 0;; ++attempt) {
    grpc::ClientContext context;
    v1::WatchJobRequest request;
    request.set_job_id(job_id);
    request.set_after_seq(after);
    request.set_logs(true);
    auto reader = client.stub->WatchJob(&context, request);
    v1::Event event;
    v1::JobState final_state = v1::JOB_STATE_UNSPECIFIED;
    while (reader->Read(&event)) {
      after = event.seq();
      std::fputs(cli::FormatFollowedEvent(event, quiet).c_str(), stdout);
      std::fflush(stdout);
      if (event.kind() == "state" && launcher::IsFinal(event.state())) final_state = event.state();
    }
    grpc::Status status = reader->Finish();
    if (status.ok()) {
      if (final_state == v1::JOB_STATE_UNSPECIFIED) {
        grpc::ClientContext get_context;
        get_context.set_deadline(Deadline(5));
        v1::GetJobRequest get;
        get.set_job_id(job_id);
        v1::GetJobReply reply;
        if (client.stub->GetJob(&get_context, get, &reply).ok() && reply.status().code() == 0) {
          final_state = reply.job().state();
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

// --- launch ------------------------------------------------------------------------------------

struct LaunchArgs {
  std::string recipe;
  std::vector<std::string> sets;
  std::string coordinator;
  bool detach = false;
  bool quiet = false;
  bool verbose = false;
  bool slurm = false;
};

// Blocks SIGINT/SIGTERM in every thread; a dedicated thread turns the first one into a stop. A
// SIGTERM that the parent ignores (`trap '' TERM`, as the Slurm script does for the coordinator) stays
// ignored: Linux keeps a blocked signal pending even when its action is to ignore it, so sigwait would
// receive it anyway.
class InterruptWatcher {
 public:
  InterruptWatcher() {
    sigemptyset(&set_);
    sigaddset(&set_, SIGINT);
    struct sigaction term {};
    if (sigaction(SIGTERM, nullptr, &term) != 0 || term.sa_handler != SIG_IGN) sigaddset(&set_, SIGTERM);
    sigaddset(&set_, SIGUSR2);  // only ever sent by the destructor, to end the thread
    pthread_sigmask(SIG_BLOCK, &set_, nullptr);
  }
  void Start(std::function<void(int)> on_signal) {
    thread_ = std::thread([this, on_signal] {
      int signal = 0;
      while (sigwait(&set_, &signal) == 0 && signal != SIGUSR2) on_signal(signal);
    });
  }
  ~InterruptWatcher() {
    if (thread_.joinable()) {
      pthread_kill(thread_.native_handle(), SIGUSR2);
      thread_.join();
    }
  }

 private:
  sigset_t set_;
  std::thread thread_;
};

// The coordinator and agent a standalone launch runs in its own process, on loopback.
struct LocalControlPlane {
  std::unique_ptr<launcher::CoordinatorServer> coordinator;
  std::unique_ptr<agent::Agent> agent;

  Status Start(const std::string& home) {
    launcher::CoordinatorServerOptions options;
    options.state_dir = home;
    options.recover = false;  // jobs in a shared $LTRAIN_HOME may belong to other running launches
    StatusOr<std::unique_ptr<launcher::CoordinatorServer>> started = launcher::CoordinatorServer::Start(options);
    if (!started.ok()) return started.status();
    coordinator = std::move(started).value();
    agent::AgentOptions agent_options;
    agent_options.coordinator = coordinator->address();
    agent_options.node_id = "local";
    agent_options.work_dir = (fs::path(home) / "agent-local").string();
    StatusOr<std::unique_ptr<agent::Agent>> agent_started = agent::Agent::Start(agent_options);
    if (!agent_started.ok()) return agent_started.status();
    agent = std::move(agent_started).value();
    return Status::Ok();
  }

  void Shutdown() {
    if (agent) agent->Shutdown();
    if (coordinator) coordinator->Shutdown();
  }
};

// Starts a job through `begin` (submit or resume, given a client; returns the job id or an exit
// code), then follows it to its end. Without a coordinator address it runs a local control plane.
int RunJob(const std::string& coordinator_address, bool detach, bool quiet, bool verbose, const char* verb,
           const std::function<std::variant<std::string, int>(Client&)>& begin) {
  InterruptWatcher interrupts;  // before any thread starts, so every thread inherits the mask
  if (!verbose) SetLogLevel(LogLevel::kWarning);
  bool standalone = coordinator_address.empty();
  std::string home = LtrainHome();
  LocalControlPlane local;
  std::string address = coordinator_address;
  if (standalone) {
    Status started = local.Start(home);
    if (!started.ok()) {
      std::fprintf(stderr, "ltrain: %s\n", started.message().c_str());
      return kExitUnavailable;
    }
    address = local.coordinator->address();
  }
  Client client(address);
  std::variant<std::string, int> begun = begin(client);
  if (std::holds_alternative<int>(begun)) {
    local.Shutdown();
    return std::get<int>(begun);
  }
  const std::string job_id = std::get<std::string>(begun);
  std::printf("ltrain: job %s %s to %s%s\n", job_id.c_str(), verb, standalone ? "the local coordinator at " : "",
              address.c_str());
  std::fflush(stdout);
  fs::path address_file = fs::path(home) / "run" / (job_id + ".addr");
  if (standalone) {
    std::error_code ec;
    fs::create_directories(address_file.parent_path(), ec);
    std::ofstream(address_file) << address << "\n";
  }
  if (detach && !standalone) {
    std::printf("%s\n", job_id.c_str());
    return kExitOk;
  }
  bool interrupted = false;
  interrupts.Start([&](int signal) {
    if (interrupted) std::_Exit(130);  // a second interrupt: leave now; the workers die with us
    interrupted = true;
    std::fprintf(stderr, "\nltrain: %s received; stopping job %s\n", signal == SIGINT ? "interrupt" : "SIGTERM",
                 job_id.c_str());
    Client stopper(address);
    v1::StopJobRequest stop;
    stop.set_job_id(job_id);
    stop.set_reason(std::string("stopped by ") + (signal == SIGINT ? "interrupt" : "SIGTERM") + " of ltrain");
    v1::StopJobReply stop_reply;
    grpc::ClientContext stop_context;
    stop_context.set_deadline(Deadline(5));
    stopper.stub->StopJob(&stop_context, stop, &stop_reply);
  });
  int code = FollowJob(client, job_id, quiet);
  local.Shutdown();
  if (standalone) {
    std::error_code ec;
    fs::remove(address_file, ec);
  }
  return code;
}

int Launch(const LaunchArgs& args) {
  RecipeParseResult parsed = LoadRecipeFile(args.recipe, args.sets);
  if (!parsed.ok()) {
    std::fprintf(stderr, "%s", parsed.ErrorText().c_str());
    return kExitInvalid;
  }
  Recipe recipe = parsed.recipe;
  if (args.slurm) {
    StatusOr<SlurmAllocation> allocation = ReadSlurmAllocation(EnvironmentVariable, ExpandHostnamesWithScontrol);
    if (!allocation.ok()) {
      std::fprintf(stderr, "ltrain launch --slurm: %s\n", allocation.status().message().c_str());
      return kExitInvalid;
    }
    ApplySlurmAllocation(*allocation, &recipe);
    std::printf("ltrain: %s\n", DescribeSlurmAllocation(*allocation).c_str());
    RecipeParseResult again = ParseRecipe(RecipeToYaml(recipe), args.recipe + " (with the Slurm allocation)");
    if (!again.ok()) {
      std::fprintf(stderr, "%s", again.ErrorText().c_str());
      return kExitInvalid;
    }
  }
  recipe.data.path = Absolute(recipe.data.path);
  recipe.checkpoint.dir = Absolute(recipe.checkpoint.dir);
  recipe.checkpoint.resume_from = Absolute(recipe.checkpoint.resume_from);
  if (args.coordinator.empty() && !fs::exists(fs::path(recipe.data.path) / "train.bin")) {
    std::fprintf(stderr,
                 "%s: data.path %s holds no prepared data (train.bin)\n"
                 "    prepare it with: ltrain data prepare --input TEXT_FILE... --output %s\n",
                 args.recipe.c_str(), recipe.data.path.c_str(), recipe.data.path.c_str());
    return kExitInvalid;
  }
  return RunJob(args.coordinator, args.detach, args.quiet, args.verbose, "submitted",
                [&](Client& client) -> std::variant<std::string, int> {
                  v1::SubmitJobRequest submit;
                  submit.set_recipe_yaml(RecipeToYaml(recipe));
                  submit.set_source_name(args.recipe);
                  v1::SubmitJobReply reply;
                  grpc::ClientContext context;
                  context.set_deadline(Deadline(10));
                  grpc::Status status = client.stub->SubmitJob(&context, submit, &reply);
                  if (!status.ok()) return client.Unreachable(status);
                  if (reply.status().code() != 0) return ReplyError(reply.status());
                  return reply.job().id();
                });
}

int Resume(const std::string& job_id, const LaunchArgs& args) {
  return RunJob(args.coordinator, args.detach, args.quiet, args.verbose, "resumed",
                [&](Client& client) -> std::variant<std::string, int> {
                  v1::ResumeJobRequest request;
                  request.set_job_id(job_id);
                  v1::ResumeJobReply reply;
                  grpc::ClientContext context;
                  context.set_deadline(Deadline(10));
                  grpc::Status status = client.stub->ResumeJob(&context, request, &reply);
                  if (!status.ok()) return client.Unreachable(status);
                  if (reply.status().code() != 0) {
                    std::fprintf(stderr, "ltrain: %s\n", reply.status().message().c_str());
                    return reply.status().code() == static_cast<int>(StatusCode::kNotFound) ||
                                   reply.status().code() == static_cast<int>(StatusCode::kFailedPrecondition)
                               ? kExitInvalid
                               : kExitUnavailable;
                  }
                  return reply.job().id();
                });
}

// --- status / stop -----------------------------------------------------------------------------

int ShowStatus(const std::string& job_id, const std::string& coordinator_address, const std::string& output, int limit) {
  bool json = output == "json";
  if (!coordinator_address.empty()) {
    Client client(coordinator_address);
    grpc::ClientContext context;
    context.set_deadline(Deadline(3));
    if (job_id.empty()) {
      v1::ListJobsRequest request;
      request.set_limit(limit);
      v1::ListJobsReply reply;
      grpc::Status status = client.stub->ListJobs(&context, request, &reply);
      if (!status.ok()) return client.Unreachable(status);
      if (reply.status().code() != 0) return ReplyError(reply.status());
      if (json) std::printf("%s\n", ToJson(reply).c_str());
      else PrintJobTable({reply.jobs().begin(), reply.jobs().end()});
      return kExitOk;
    }
    v1::GetJobRequest request;
    request.set_job_id(job_id);
    v1::GetJobReply reply;
    grpc::Status status = client.stub->GetJob(&context, request, &reply);
    if (!status.ok()) return client.Unreachable(status);
    if (reply.status().code() != 0) return ReplyError(reply.status());
    if (json) std::printf("%s\n", ToJson(reply.job()).c_str());
    else PrintJobDetail(reply.job());
    return kExitOk;
  }
  // Standalone: a job whose launch still runs is asked of that launch's coordinator (live node and
  // rank progress); otherwise the state under $LTRAIN_HOME is read directly.
  std::string home = LtrainHome();
  if (!job_id.empty()) {
    std::ifstream address_file(fs::path(home) / "run" / (job_id + ".addr"));
    std::string address;
    if (address_file >> address) {
      Client client(address);
      grpc::ClientContext context;
      context.set_deadline(Deadline(2));
      v1::GetJobRequest request;
      request.set_job_id(job_id);
      v1::GetJobReply reply;
      if (client.stub->GetJob(&context, request, &reply).ok() && reply.status().code() == 0) {
        if (json) std::printf("%s\n", ToJson(reply.job()).c_str());
        else PrintJobDetail(reply.job());
        return kExitOk;
      }
    }
  }
  if (!fs::exists(fs::path(home) / "state.db")) {
    if (json) std::printf("{\n \"jobs\": []\n}\n");
    else std::printf("no jobs yet under %s; start one with `ltrain launch RECIPE`\n", home.c_str());
    return job_id.empty() ? kExitOk : kExitInvalid;
  }
  StatusOr<std::unique_ptr<launcher::StateStore>> store = launcher::OpenStateStore(home);
  if (!store.ok()) {
    std::fprintf(stderr, "ltrain: %s\n", store.status().message().c_str());
    return kExitUnavailable;
  }
  if (job_id.empty()) {
    StatusOr<std::vector<v1::Job>> jobs = (*store)->ListJobs(limit);
    if (!jobs.ok()) {
      std::fprintf(stderr, "ltrain: %s\n", jobs.status().message().c_str());
      return kExitUnavailable;
    }
    if (json) {
      v1::ListJobsReply reply;
      for (auto& job : *jobs) *reply.add_jobs() = job;
      std::printf("%s\n", ToJson(reply).c_str());
    } else {
      PrintJobTable(*jobs);
    }
    return kExitOk;
  }
  StatusOr<v1::Job> job = (*store)->GetJob(job_id);
  if (!job.ok()) {
    std::fprintf(stderr, "ltrain: %s\n", job.status().message().c_str());
    return kExitInvalid;
  }
  if (json) std::printf("%s\n", ToJson(*job).c_str());
  else PrintJobDetail(*job);
  return kExitOk;
}

// --- completion ------------------------------------------------------------------------------

std::string BashCompletion(const std::string& commands) {
  return R"BASH(# bash completion for ltrain: source <(ltrain completion bash)
_ltrain() {
  local cur="${COMP_WORDS[COMP_CWORD]}" cmd="${COMP_WORDS[1]}"
  if [[ $COMP_CWORD -eq 1 ]]; then
    COMPREPLY=($(compgen -W ")BASH" + commands + R"BASH(--help --version" -- "$cur")); return
  fi
  case "$cmd" in
    launch|validate) COMPREPLY=($(compgen -f -X '!*.yaml' -- "$cur") $(compgen -d -- "$cur") $(compgen -W "--set --help" -- "$cur"));;
    status|stop|resume|logs)
      local jobs; jobs=$(ltrain list --output json 2>/dev/null | sed -n 's/.*"id": "\([^"]*\)".*/\1/p')
      local flags="--coordinator --output --help"
      [[ $cmd == stop ]] && flags="--coordinator --checkpoint --checkpoint-timeout --help"
      COMPREPLY=($(compgen -W "$jobs $flags" -- "$cur"));;
    data) COMPREPLY=($(compgen -W "prepare" -- "$cur"));;
    *) COMPREPLY=($(compgen -f -- "$cur"));;
  esac
}
complete -F _ltrain ltrain
)BASH";
}

// --- logs ------------------------------------------------------------------------------------

struct LogsArgs {
  std::string job_id;
  std::string coordinator;
  bool follow = false;
  int rank = -1;
  std::string since;
  int tail = 0;
  std::string output = "text";
};

void PrintLogLines(const std::vector<v1::Event>& lines, bool json) {
  std::fputs(cli::FormatLogLines(lines, json ? cli::LogFormat::kJson : cli::LogFormat::kText).c_str(), stdout);
  if (!json) std::fflush(stdout);
}

int Logs(const LogsArgs& args) {
  int64_t now = std::chrono::duration_cast<std::chrono::milliseconds>(
                    std::chrono::system_clock::now().time_since_epoch()).count();
  int64_t since = 0;
  if (!args.since.empty()) {
    std::optional<int64_t> parsed = launcher::ParseSince(args.since, now);
    if (!parsed) {
      std::fprintf(stderr, "ltrain logs: --since %s is neither a duration (90s, 10m, 2h, 1d) nor Unix milliseconds\n",
                   args.since.c_str());
      return kExitInvalid;
    }
    since = *parsed;
  }
  bool json = args.output == "json";
  std::string address = args.coordinator;
  if (address.empty()) {
    std::ifstream address_file(fs::path(LtrainHome()) / "run" / (args.job_id + ".addr"));
    address_file >> address;  // a local launch still running the job, if any
  }
  std::vector<v1::Event> lines;
  if (!address.empty()) {
    Client client(address);
    grpc::ClientContext context;
    context.set_deadline(Deadline(10));
    v1::GetLogsRequest request;
    request.set_job_id(args.job_id);
    request.set_rank(args.rank);
    request.set_since_unix_ms(since);
    request.set_limit(args.tail);
    v1::GetLogsReply reply;
    grpc::Status status = client.stub->GetLogs(&context, request, &reply);
    if (!status.ok()) {
      if (!args.coordinator.empty()) return client.Unreachable(status);
      address.clear();  // the local launch ended: read the state directly below
    } else if (reply.status().code() != 0) {
      return ReplyError(reply.status());
    } else {
      lines.assign(reply.lines().begin(), reply.lines().end());
    }
  }
  if (address.empty()) {
    StatusOr<std::unique_ptr<launcher::StateStore>> store = launcher::OpenStateStore(LtrainHome());
    if (!store.ok()) {
      std::fprintf(stderr, "ltrain: %s\n", store.status().message().c_str());
      return kExitUnavailable;
    }
    if (StatusOr<v1::Job> job = (*store)->GetJob(args.job_id); !job.ok()) {
      std::fprintf(stderr, "ltrain: %s\n", job.status().message().c_str());
      return kExitInvalid;
    }
    StatusOr<std::vector<v1::Event>> stored = (*store)->Logs(args.job_id, args.rank, since, args.tail);
    if (!stored.ok()) {
      std::fprintf(stderr, "ltrain: %s\n", stored.status().message().c_str());
      return kExitUnavailable;
    }
    lines = std::move(stored).value();
  }
  PrintLogLines(lines, json);
  if (!args.follow || address.empty()) return kExitOk;
  // Follow: new lines as they come, until the job ends.
  int64_t after = lines.empty() ? 0 : lines.back().seq();
  Client client(address);
  grpc::ClientContext context;
  v1::WatchJobRequest request;
  request.set_job_id(args.job_id);
  request.set_after_seq(after);
  request.set_logs(true);
  auto reader = client.stub->WatchJob(&context, request);
  v1::Event event;
  while (reader->Read(&event)) {
    if (event.kind() != "log" || (args.rank >= 0 && event.rank() != args.rank)) continue;
    PrintLogLines({event}, json);
  }
  grpc::Status status = reader->Finish();
  return status.ok() ? kExitOk : client.Unreachable(status);
}

struct StopArgs {
  std::string job_id;
  std::string coordinator;
  bool checkpoint = false;
  double checkpoint_timeout_s = 60;
};

int Stop(const StopArgs& args) {
  const std::string& job_id = args.job_id;
  std::string coordinator_address = args.coordinator;
  if (coordinator_address.empty()) {
    std::ifstream in(fs::path(LtrainHome()) / "run" / (job_id + ".addr"));
    if (!(in >> coordinator_address)) {
      std::fprintf(stderr,
                   "ltrain: no running local launch of job %s under %s; for a cluster job pass --coordinator HOST:PORT\n",
                   job_id.c_str(), LtrainHome().c_str());
      return kExitInvalid;
    }
  }
  Client client(coordinator_address);
  grpc::ClientContext context;
  context.set_deadline(Deadline(5));
  v1::StopJobRequest request;
  request.set_job_id(job_id);
  request.set_reason(args.checkpoint ? "stopped by `ltrain stop --checkpoint`" : "stopped by `ltrain stop`");
  request.set_checkpoint(args.checkpoint);
  request.set_checkpoint_timeout_s(args.checkpoint_timeout_s);
  v1::StopJobReply reply;
  grpc::Status status = client.stub->StopJob(&context, request, &reply);
  if (!status.ok()) return client.Unreachable(status);
  if (reply.status().code() != 0) return ReplyError(reply.status());
  v1::Job job = reply.job();
  if (!launcher::IsFinal(job.state())) {
    // A stop with a final checkpoint: the job ends once its ranks have committed it, or as a plain
    // stop at the coordinator's deadline.
    std::printf("job %s: stopping after a final checkpoint (a plain stop after %.0f s otherwise)\n", job_id.c_str(),
                args.checkpoint_timeout_s);
    std::fflush(stdout);
    auto give_up = std::chrono::steady_clock::now() +
                   std::chrono::milliseconds(static_cast<int64_t>(args.checkpoint_timeout_s * 1000) + 30000);
    while (!launcher::IsFinal(job.state())) {
      if (std::chrono::steady_clock::now() > give_up) {
        std::fprintf(stderr, "ltrain: job %s is still %s %.0f s after the stop; see `ltrain status %s`\n", job_id.c_str(),
                     StateName(job.state()).c_str(), args.checkpoint_timeout_s + 30, job_id.c_str());
        return kExitUnavailable;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(250));
      grpc::ClientContext get_context;
      get_context.set_deadline(Deadline(5));
      v1::GetJobRequest get;
      get.set_job_id(job_id);
      v1::GetJobReply got;
      if (client.stub->GetJob(&get_context, get, &got).ok() && got.status().code() == 0) {
        job = got.job();
      } else if (args.coordinator.empty()) {
        // A local launch ends with its job and takes its coordinator along: the state remains.
        StatusOr<std::unique_ptr<launcher::StateStore>> store = launcher::OpenStateStore(LtrainHome());
        if (!store.ok()) continue;
        StatusOr<v1::Job> stored = (*store)->GetJob(job_id);
        if (stored.ok()) job = *stored;
      }
    }
  }
  if (args.checkpoint) {
    std::printf("job %s: %s: %s\n", job_id.c_str(), StateName(job.state()).c_str(), job.cause().c_str());
  } else {
    std::printf("job %s: %s\n", job_id.c_str(), StateName(job.state()).c_str());
  }
  return kExitOk;
}

// --- daemons -----------------------------------------------------------------------------------

int RunCoordinator(const std::string& listen, std::string state_dir, const std::string& port_file,
                   double node_timeout_s) {
  if (state_dir.empty()) state_dir = LtrainHome();
  InterruptWatcher interrupts;
  launcher::CoordinatorServerOptions options;
  options.listen_address = listen;
  options.state_dir = state_dir;
  options.node_timeout_ms = static_cast<int64_t>(node_timeout_s * 1000);
  options.security = g_security;
  if (options.listen_address.rfind("127.", 0) != 0 && options.listen_address.rfind("localhost", 0) != 0 &&
      (g_security.cert_pem.empty() || g_security.token.empty())) {
    LTRAIN_LOG(kWarning, "coordinator") << "listening on " << listen
                                        << " without TLS and a token: anyone who reaches it can drive it; see --init-tls";
  }
  StatusOr<std::unique_ptr<launcher::CoordinatorServer>> server = launcher::CoordinatorServer::Start(options);
  if (!server.ok()) {
    std::fprintf(stderr, "ltrain coordinator: %s\n", server.status().message().c_str());
    return kExitUnavailable;
  }
  LTRAIN_LOG(kInfo, "coordinator") << "listening on " << (*server)->address() << ", state in " << state_dir;
  if (!port_file.empty()) {
    std::ofstream tmp(port_file + ".tmp");
    tmp << (*server)->port() << "\n";
    tmp.close();
    fs::rename(port_file + ".tmp", port_file);
  }
  launcher::CoordinatorServer* raw = server->get();
  interrupts.Start([raw](int) { raw->Shutdown(); });
  raw->Wait();
  raw->Shutdown();
  return kExitOk;
}

int RunAgent(agent::AgentOptions options) {
  InterruptWatcher interrupts;
  if (options.work_dir.empty()) {
    options.work_dir = (fs::path(LtrainHome()) / ("agent-" + (options.node_id.empty() ? "node" : options.node_id))).string();
  }
  StatusOr<std::unique_ptr<agent::Agent>> started = agent::Agent::Start(options);
  if (!started.ok()) {
    std::fprintf(stderr, "ltrain agent: %s\n", started.status().message().c_str());
    return started.status().code() == StatusCode::kInvalidArgument ? kExitInvalid : kExitUnavailable;
  }
  agent::Agent* raw = started->get();
  interrupts.Start([raw](int) { raw->Shutdown(); });
  raw->Wait();
  return kExitOk;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "ltrain: launch and keep alive distributed LLM training jobs.\n\n"
      "Standalone: `ltrain launch RECIPE` starts a coordinator and an agent on loopback itself.\n"
      "Cluster: `ltrain coordinator` on one host, `ltrain agent --coordinator HOST:PORT` on every node,\n"
      "then `ltrain launch --coordinator HOST:PORT RECIPE`.\n\n"
      "State lives under $LTRAIN_HOME (default ~/.ltrain).\n"
      "Exit codes: 0 success, 1 job failed, 2 invalid input, 3 coordinator unreachable or error, 4 job stopped.",
      "ltrain"};
  app.set_version_flag("--version", std::string("ltrain ") + LTRAIN_VERSION);
  app.require_subcommand(1);
  std::string log_level = "info";
  app.add_option("--log-level", log_level, "debug, info, warning or error")->capture_default_str();
  app.fallthrough();  // the options below may also follow the subcommand
  SecurityOptions security;
  app.add_option("--tls-ca", security.tls_ca,
                 "PEM of the CA that signed the coordinator's certificate: use TLS ($LTRAIN_TLS_CA)");
  app.add_option("--tls-cert", security.tls_cert,
                 "PEM certificate: the coordinator's own, or a client's for mutual TLS ($LTRAIN_TLS_CERT)");
  app.add_option("--tls-key", security.tls_key, "PEM key of --tls-cert ($LTRAIN_TLS_KEY)");
  app.add_option("--token-file", security.token_file,
                 "File holding the bearer token the coordinator requires ($LTRAIN_TOKEN_FILE; $LTRAIN_TOKEN wins)");

  // launch
  LaunchArgs launch;
  CLI::App* launch_cmd = app.add_subcommand("launch", "Run a training job and stream its logs until it ends");
  launch_cmd->add_option("recipe", launch.recipe, "Recipe YAML file")->required();
  launch_cmd->add_option("--set", launch.sets, "Override a recipe field, e.g. --set training.steps=200 (repeatable)")
      ->expected(1)->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
  launch_cmd->add_option("--coordinator", launch.coordinator,
                         "HOST:PORT of a running coordinator; without it ltrain starts one and a local agent");
  launch_cmd->add_flag("--slurm", launch.slurm,
                       "Inside a Slurm allocation: take nodes and processes per node from it (SLURM_JOB_NODELIST, GPUs per node)");
  launch_cmd->add_flag("--detach", launch.detach, "With --coordinator: print the job id and return at once");
  launch_cmd->add_flag("-q,--quiet", launch.quiet, "Print job events only, not the workers' log lines");
  launch_cmd->add_flag("-v,--verbose", launch.verbose, "Also print the embedded coordinator's and agent's logs");

  // resume
  std::string resume_job;
  LaunchArgs resume;
  CLI::App* resume_cmd = app.add_subcommand(
      "resume", "Start a FAILED or STOPPED job again from its last committed checkpoint, and follow it");
  resume_cmd->add_option("job", resume_job, "Job id")->required();
  resume_cmd->add_option("--coordinator", resume.coordinator,
                         "HOST:PORT of the coordinator that ran it; without it a local one on $LTRAIN_HOME");
  resume_cmd->add_flag("--detach", resume.detach, "With --coordinator: return once the job is resumed");
  resume_cmd->add_flag("-q,--quiet", resume.quiet, "Print job events only, not the workers' log lines");
  resume_cmd->add_flag("-v,--verbose", resume.verbose, "Also print the embedded coordinator's and agent's logs");

  // validate
  std::string validate_recipe;
  std::vector<std::string> validate_sets;
  CLI::App* validate_cmd = app.add_subcommand("validate", "Check a recipe; print it resolved, or every error (exit 2)");
  validate_cmd->add_option("recipe", validate_recipe, "Recipe YAML file")->required();
  validate_cmd->add_option("--set", validate_sets, "Override a recipe field (repeatable)")
      ->expected(1)->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);

  // data prepare
  CLI::App* data_cmd = app.add_subcommand("data", "Prepare training data");
  data_cmd->require_subcommand(1);
  std::vector<std::string> data_inputs;
  std::string data_output, tokenizer = "byte";
  double val_fraction = 0.05;
  CLI::App* prepare_cmd = data_cmd->add_subcommand(
      "prepare", "Tokenize text files into train.bin and val.bin (header: magic, version, vocab, count)");
  prepare_cmd->add_option("--input", data_inputs, "Text file(s), concatenated in order")->required()
      ->expected(1, -1)->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
  prepare_cmd->add_option("--output", data_output, "Directory to write train.bin and val.bin into")->required();
  prepare_cmd->add_option("--val-fraction", val_fraction, "Share of the tokens kept for validation (the tail)")
      ->check(CLI::Range(0.0, 0.5))->capture_default_str();
  prepare_cmd->add_option("--tokenizer", tokenizer, "Tokenizer; byte (vocab 256)")
      ->check(CLI::IsMember({"byte"}))->capture_default_str();

  // list / logs / completion
  std::string list_coordinator, list_output = "table";
  int list_limit = 50;
  CLI::App* list_cmd = app.add_subcommand("list", "List the jobs, newest first");
  list_cmd->add_option("--coordinator", list_coordinator, "HOST:PORT; without it, the local state in $LTRAIN_HOME");
  list_cmd->add_option("-o,--output", list_output, "table or json")->check(CLI::IsMember({"table", "json"}));
  list_cmd->add_option("--limit", list_limit, "Jobs to list")->capture_default_str();
  LogsArgs logs;
  CLI::App* logs_cmd = app.add_subcommand(
      "logs", "Print a job's log lines, rank-prefixed; identical lines of many ranks fold into one [ranks 0-7] line");
  logs_cmd->add_option("job", logs.job_id, "Job id")->required();
  logs_cmd->add_flag("-f,--follow", logs.follow, "Keep printing new lines until the job ends");
  logs_cmd->add_option("--rank", logs.rank, "Only this rank's lines");
  logs_cmd->add_option("--since", logs.since, "Only lines newer than this: 90s, 10m, 2h, 1d, or Unix milliseconds");
  logs_cmd->add_option("--tail", logs.tail, "Only the newest N lines");
  logs_cmd->add_option("--coordinator", logs.coordinator, "HOST:PORT; without it, the local state in $LTRAIN_HOME");
  logs_cmd->add_option("-o,--output", logs.output, "text or json (one object per line)")
      ->check(CLI::IsMember({"text", "json"}));
  std::string completion_shell;
  CLI::App* completion_cmd = app.add_subcommand("completion", "Print a shell completion script: source <(ltrain completion bash)");
  completion_cmd->add_option("shell", completion_shell, "bash")->required()->check(CLI::IsMember({"bash"}));

  // status / stop
  std::string status_job, status_coordinator, status_output = "table";
  int status_limit = 50;
  CLI::App* status_cmd = app.add_subcommand("status", "Show one job, or list the jobs (newest first)");
  status_cmd->add_option("job", status_job, "Job id; omit to list jobs");
  status_cmd->add_option("--coordinator", status_coordinator, "HOST:PORT; without it, the local state in $LTRAIN_HOME");
  status_cmd->add_option("-o,--output", status_output, "table or json")->check(CLI::IsMember({"table", "json"}));
  status_cmd->add_option("--limit", status_limit, "Jobs to list")->capture_default_str();
  StopArgs stop;
  CLI::App* stop_cmd = app.add_subcommand(
      "stop", "Stop a job: its workers get SIGTERM, then SIGKILL; with --checkpoint they first save a final checkpoint");
  stop_cmd->add_option("job", stop.job_id, "Job id")->required();
  stop_cmd->add_option("--coordinator", stop.coordinator, "HOST:PORT; without it, the local launch running the job");
  CLI::Option* stop_checkpoint = stop_cmd->add_flag(
      "--checkpoint", stop.checkpoint,
      "First train on to a step every rank reaches, commit a checkpoint of it, then end (STOPPED with that "
      "commit); waits until the job has ended");
  stop_cmd
      ->add_option("--checkpoint-timeout", stop.checkpoint_timeout_s,
                   "Seconds the final checkpoint may take before the job is stopped plainly, keeping its last commit")
      ->check(CLI::PositiveNumber)
      ->needs(stop_checkpoint)
      ->capture_default_str();

  // coordinator
  std::string listen = "127.0.0.1:7070", state_dir, port_file;
  double node_timeout_s = 3.0;
  CLI::App* coordinator_cmd = app.add_subcommand("coordinator", "Run the coordinator daemon");
  coordinator_cmd->add_option("--listen", listen, "HOST:PORT to serve on; port 0 picks a free one")->capture_default_str();
  coordinator_cmd->add_option("--state-dir", state_dir, "Directory of state.db and default checkpoints ($LTRAIN_HOME)");
  coordinator_cmd->add_option("--port-file", port_file, "Write the chosen port here once listening");
  coordinator_cmd->add_option("--tls-client-ca", security.tls_client_ca,
                              "Require client certificates signed by this CA: mutual TLS ($LTRAIN_TLS_CLIENT_CA)");
  std::string init_tls;
  std::vector<std::string> tls_hosts = {"localhost", "127.0.0.1"};
  coordinator_cmd->add_option("--init-tls", init_tls,
                              "Write a CA, server and client certificates and a token into DIR, then exit");
  coordinator_cmd->add_option("--tls-hosts", tls_hosts, "Names and addresses the server certificate is for (--init-tls)")
      ->capture_default_str();
  coordinator_cmd->add_option("--node-timeout", node_timeout_s, "Seconds without heartbeat before a node is lost")
      ->capture_default_str();

  // agent
  agent::AgentOptions agent_options;
  CLI::App* agent_cmd = app.add_subcommand("agent", "Run the node agent that starts and supervises workers");
  agent_cmd->add_option("--coordinator", agent_options.coordinator, "HOST:PORT of the coordinator")->required();
  agent_cmd->add_option("--node-id", agent_options.node_id, "Name of this node (default: host name)");
  agent_cmd->add_option("--work-dir", agent_options.work_dir, "Per-job recipes and per-rank logs");
  agent_cmd->add_option("--worker-binary", agent_options.worker_binary, "ltrain-worker to start (default: beside ltrain)");
  agent_cmd->add_option("--bind-address", agent_options.bind_address, "Address this node's workers use for collectives")
      ->capture_default_str();
  agent_cmd->add_option("--heartbeat-interval", agent_options.heartbeat_interval_s, "Seconds between heartbeats")
      ->capture_default_str();
  agent_cmd->add_option("--coordinator-grace", agent_options.coordinator_grace_s,
                        "Seconds the workers keep running while the coordinator is unreachable")
      ->capture_default_str();

  CLI11_PARSE(app, argc, argv);
  LogLevel level;
  if (!ParseLogLevel(log_level, &level)) {
    std::fprintf(stderr, "ltrain: --log-level %s is not one of debug, info, warning, error\n", log_level.c_str());
    return kExitInvalid;
  }
  SetLogLevel(level);
  StatusOr<SecurityMaterial> loaded = LoadSecurity(security);
  if (!loaded.ok()) {
    std::fprintf(stderr, "ltrain: %s\n", loaded.status().message().c_str());
    return kExitInvalid;
  }
  g_security = *loaded;

  if (*launch_cmd) return Launch(launch);
  if (*resume_cmd) return Resume(resume_job, resume);
  if (*validate_cmd) {
    RecipeParseResult parsed = LoadRecipeFile(validate_recipe, validate_sets);
    if (!parsed.ok()) {
      std::fprintf(stderr, "%s", parsed.ErrorText().c_str());
      std::fprintf(stderr, "%zu error(s) in %s\n", parsed.errors.size(), validate_recipe.c_str());
      return kExitInvalid;
    }
    std::printf("%s", RecipeToYaml(parsed.recipe).c_str());
    return kExitOk;
  }
  if (*prepare_cmd) {
    std::printf("tokenizing %zu file(s) with the %s tokenizer...\n", data_inputs.size(), tokenizer.c_str());
    std::fflush(stdout);
    StatusOr<PrepareStats> stats = PrepareTokenData(data_inputs, data_output, val_fraction, tokenizer);
    if (!stats.ok()) {
      std::fprintf(stderr, "ltrain data prepare: %s\n", stats.status().message().c_str());
      return kExitInvalid;
    }
    std::printf("wrote %s (%lld tokens) and %s (%lld tokens), vocab %d\n", stats->train_path.c_str(),
                static_cast<long long>(stats->train_tokens), stats->val_path.c_str(),
                static_cast<long long>(stats->val_tokens), stats->vocab);
    return kExitOk;
  }
  if (*list_cmd) return ShowStatus("", list_coordinator, list_output, list_limit);
  if (*logs_cmd) return Logs(logs);
  if (*completion_cmd) {
    std::string words;
    for (const CLI::App* sub : app.get_subcommands([](const CLI::App*) { return true; })) words += sub->get_name() + " ";
    std::printf("%s", BashCompletion(words).c_str());
    return kExitOk;
  }
  if (*status_cmd) return ShowStatus(status_job, status_coordinator, status_output, status_limit);
  if (*stop_cmd) return Stop(stop);
  if (*coordinator_cmd && !init_tls.empty()) {
    Status made = InitTls(init_tls, tls_hosts);
    if (!made.ok()) {
      std::fprintf(stderr, "ltrain coordinator --init-tls: %s\n", made.message().c_str());
      return kExitUnavailable;
    }
    std::printf("wrote ca.pem, server.pem/.key, client.pem/.key and token into %s. Start with:\n"
                "  ltrain coordinator --tls-cert %s/server.pem --tls-key %s/server.key --token-file %s/token "
                "[--tls-client-ca %s/ca.pem]\n"
                "and give agents and the CLI: --tls-ca %s/ca.pem --token-file %s/token "
                "[--tls-cert %s/client.pem --tls-key %s/client.key]\n",
                init_tls.c_str(), init_tls.c_str(), init_tls.c_str(), init_tls.c_str(), init_tls.c_str(),
                init_tls.c_str(), init_tls.c_str(), init_tls.c_str(), init_tls.c_str());
    return kExitOk;
  }
  if (*coordinator_cmd) return RunCoordinator(listen, state_dir, port_file, node_timeout_s);
  if (*agent_cmd) {
    agent_options.security = g_security;
    agent_options.leave_reason = "its agent was stopped (SIGTERM or SIGINT)";
    return RunAgent(agent_options);
  }
  return kExitInvalid;
}
