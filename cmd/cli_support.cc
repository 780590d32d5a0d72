#include "cmd/cli_support.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>

#include <google/protobuf/util/json_util.h>
#include <yaml-cpp/yaml.h>

#include "cmd/job_printer.h"
#include "common/files.h"
#include "common/status.h"
#include "common/transport_probe.h"
#include "launcher/coordinator_server.h"
#include "launcher/state_store.h"

namespace ltrain::cli {

namespace fs = std::filesystem;

std::string LtrainHome() {
  if (const char* env = getenv("LTRAIN_HOME"); env && *env) return env;
  const char* home = getenv("HOME");
  return (fs::path(home ? home : "/tmp") / ".ltrain").string();
}

int NoLocalJob(const std::string& job_id, const std::string& home) {
  std::fprintf(stderr,
               "ltrain: no job '%s' in the local state (%s); `ltrain status` lists those. A job of a coordinator "
               "daemon needs --coordinator HOST:PORT (or $LTRAIN_COORDINATOR, or coordinator: in config.yaml)\n",
               job_id.c_str(), home.c_str());
  return kExitInvalid;
}

Status LoadClientConfig(const std::string& home) {
  const fs::path file = fs::path(home) / "config.yaml";
  std::error_code ec;
  if (!fs::exists(file, ec)) return Status::Ok();
  static const std::pair<const char*, const char*> kKeys[] = {
      {"coordinator", "LTRAIN_COORDINATOR"}, {"tls_ca", "LTRAIN_TLS_CA"},         {"tls_cert", "LTRAIN_TLS_CERT"},
      {"tls_key", "LTRAIN_TLS_KEY"},         {"token_file", "LTRAIN_TOKEN_FILE"}, {"output", "LTRAIN_OUTPUT"}};
  std::string known;
  for (const auto& [key, env] : kKeys) known += (known.empty() ? "" : ", ") + std::string(key);
  YAML::Node root;
  try {
    root = YAML::LoadFile(file.string());
  } catch (const YAML::Exception& e) {
    return InvalidArgument(file.string() + ":" + std::to_string(e.mark.line + 1) + ":" +
                           std::to_string(e.mark.column + 1) + ": " + e.msg);
  }
  if (root.IsNull()) return Status::Ok();
  if (!root.IsMap()) return InvalidArgument(file.string() + ": expected a mapping of " + known);
  for (const auto& entry : root) {
    const std::string key = entry.first.Scalar();
    const std::string where = file.string() + ":" + std::to_string(entry.first.Mark().line + 1) + ": ";
    const auto* found = std::find_if(std::begin(kKeys), std::end(kKeys),
                                     [&](const auto& known_key) { return key == known_key.first; });
    if (found == std::end(kKeys)) return InvalidArgument(where + "unknown key '" + key + "'; the keys are " + known);
    if (!entry.second.IsScalar()) return InvalidArgument(where + "'" + key + "' must be a single value");
    std::string value = entry.second.Scalar();
    if (key == "output" && value != "json" && value != "text" && value != "table") {
      return InvalidArgument(where + "output must be json or text, not '" + value + "'");
    }
    // Files named in the config are relative to it.
    if (key != "coordinator" && key != "output" && !value.empty() && value.front() != '/') {
      value = (file.parent_path() / value).string();
    }
    setenv(found->second, value.c_str(), /*overwrite=*/0);
  }
  return Status::Ok();
}

CLI::Option* AddCoordinatorOption(CLI::App* command, std::string* coordinator, const std::string& help) {
  return command
      ->add_option("--coordinator", *coordinator,
                   help + "; several coordinators on one etcd state: HOST:PORT,HOST:PORT,... (the leader is found)")
      ->envname("LTRAIN_COORDINATOR");
}

CLI::Option* AddOutputOption(CLI::App* command, std::string* output, const std::string& human,
                             const std::string& what) {
  // One validator that checks the word and then maps it: table and text both name the human form.
  CLI::Validator output_form(
      [human](std::string& value) {
        if (value != "table" && value != "text" && value != "json") {
          return "'" + value + "' is not table, text or json";
        }
        if (value != "json") value = human;
        return std::string();
      },
      "{table,text,json}");
  return command->add_option("-o,--output", *output, (what.empty() ? human : human + " (" + what + ")") + " or json")
      ->envname("LTRAIN_OUTPUT")
      ->transform(output_form)
      ->capture_default_str();
}

std::string MetricsTokenFile(const std::string& dir) { return (fs::path(dir) / "metrics-token").string(); }

std::string LocalAddressFile(const std::string& home, const std::string& job_id) {
  return (fs::path(home) / "run" / (job_id + ".addr")).string();
}

Status WriteLocalLaunch(const std::string& home, const std::string& job_id, const LocalLaunch& launch) {
  const std::string path = LocalAddressFile(home, job_id);
  LTRAIN_RETURN_IF_ERROR(CreateDirectories(fs::path(path).parent_path().string()));
  // 0600 from its creation: it holds the token.
  return WriteFileText(path, launch.address + "\n" + launch.security.token + "\n", 0600);
}

std::optional<LocalLaunch> FindLocalLaunch(const std::string& home, const std::string& job_id) {
  std::ifstream in(LocalAddressFile(home, job_id));
  LocalLaunch launch;
  if (!(in >> launch.address)) return std::nullopt;
  in >> launch.security.token;
  return launch;
}

namespace {

std::string LaunchLockFile(const std::string& home, const std::string& job_id) {
  return (fs::path(home) / "run" / (job_id + ".lock")).string();
}

}  // namespace

int HoldLaunchLock(const std::string& home, const std::string& job_id) {
  const std::string path = LaunchLockFile(home, job_id);
  if (!CreateDirectories(fs::path(path).parent_path().string()).ok()) return -1;
  // Close-on-exec: a worker that inherited it would keep the lock after the launch died.
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0600);
  if (fd < 0) return -1;
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    ::close(fd);
    return -1;
  }
  const std::string pid = std::to_string(::getpid()) + "\n";
  (void)!::write(fd, pid.data(), pid.size());
  return fd;
}

void ReleaseLaunchLock(const std::string& home, const std::string& job_id, int fd) {
  if (fd < 0) return;
  std::error_code ec;
  fs::remove(LaunchLockFile(home, job_id), ec);
  ::close(fd);
}

std::vector<std::string> ReconcileDeadLaunches(const std::string& home) {
  std::vector<std::string> failed;
  std::error_code ec;
  const fs::path run = fs::path(home) / "run";
  if (!fs::is_directory(run, ec)) return failed;
  std::unique_ptr<launcher::StateStore> store;
  for (const auto& entry : fs::directory_iterator(run, ec)) {
    if (entry.path().extension() != ".lock") continue;
    const std::string job_id = entry.path().stem().string();
    const int fd = ::open(entry.path().c_str(), O_RDWR | O_CLOEXEC);
    if (fd < 0) continue;
    // Still held: the launch runs. Free: it ended without removing its lock file, so it was killed.
    if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
      ::close(fd);
      continue;
    }
    std::string pid;
    std::ifstream(entry.path()) >> pid;
    if (!store) {
      StatusOr<std::unique_ptr<launcher::StateStore>> opened = launcher::OpenStateStore(home);
      if (!opened.ok()) {
        ::close(fd);
        return failed;
      }
      store = std::move(opened).value();
    }
    StatusOr<v1::Job> job = store->GetJob(job_id);
    if (job.ok() && !launcher::IsFinal(job->state())) {
      const std::string cause = "its launch (`ltrain launch`, pid " + (pid.empty() ? std::string("?") : pid) +
                                ") ended before the job did, killed without a word; its workers died with it. "
                                "`ltrain resume " + job_id + "` continues from the last checkpoint";
      job->set_state(v1::JOB_STATE_FAILED);
      job->set_cause(cause);
      // Its ranks died with it: none is left "running" in the record.
      for (v1::RankInfo rank : job->ranks()) {
        if (rank.state() != "starting" && rank.state() != "running") continue;
        rank.set_state("killed");
        (void)store->UpsertRank(job_id, rank);
      }
      job->clear_ranks();
      if (store->UpdateJob(*job).ok()) {
        v1::Event event;
        event.set_job_id(job_id);
        event.set_unix_ms(std::chrono::duration_cast<std::chrono::milliseconds>(
                              std::chrono::system_clock::now().time_since_epoch()).count());
        event.set_kind("state");
        event.set_state(v1::JOB_STATE_FAILED);
        event.set_rank(-1);
        event.set_message("job FAILED: " + cause);
        (void)store->AppendEvent(event);
        failed.push_back(job_id);
      }
    }
    fs::remove(entry.path(), ec);
    fs::remove(LocalAddressFile(home, job_id), ec);
    ::close(fd);
  }
  return failed;
}

std::string Absolute(const std::string& path) {
  if (path.empty()) return path;
  std::error_code ec;
  fs::path absolute = fs::absolute(path, ec);
  return ec ? path : absolute.lexically_normal().string();
}

std::string ToJson(const google::protobuf::Message& message) { return FormatJson(message, /*pretty=*/true); }

int ExitCodeFor(v1::JobState state) {
  switch (state) {
    case v1::JOB_STATE_SUCCEEDED: return kExitOk;
    case v1::JOB_STATE_STOPPED: return kExitStopped;
    default: return kExitFailed;
  }
}

CoordinatorClient::CoordinatorClient(const std::string& address, const SecurityMaterial& security)
    : address_(address), security_(security), stub_(v1::JobService::NewStub(MakeChannel(address, security))) {}

std::optional<v1::Job> CoordinatorClient::TryGetJob(const std::string& job_id, double timeout_s) {
  grpc::ClientContext context;
  context.set_deadline(Deadline(timeout_s));
  v1::GetJobRequest request;
  request.set_job_id(job_id);
  v1::GetJobReply reply;
  if (!stub_->GetJob(&context, request, &reply).ok() || reply.status().code() != 0) return std::nullopt;
  return reply.job();
}

int CoordinatorClient::Unreachable(const grpc::Status& status) const {
  if (status.error_code() == grpc::StatusCode::UNAUTHENTICATED) {
    std::fprintf(stderr, "ltrain: the coordinator at %s refused the request: %s\n", address_.c_str(),
                 status.error_message().c_str());
    return kExitUnavailable;
  }
  // Something answers there but will not talk with this client: the one mismatch, and its fix.
  const TransportDiagnosis diagnosis = status.error_code() == grpc::StatusCode::UNAVAILABLE
                                           ? DiagnoseTransport(address_, security_)
                                           : TransportDiagnosis{};
  if (diagnosis.fault != TransportFault::kNone && diagnosis.fault != TransportFault::kUnreachable) {
    std::fprintf(stderr, "ltrain: %s\n", diagnosis.message.c_str());
    return kExitUnavailable;
  }
  const std::string why = diagnosis.fault == TransportFault::kUnreachable
                              ? diagnosis.message
                              : "cannot reach the coordinator at " + address_ + ": " + status.error_message();
  std::fprintf(stderr,
               "ltrain: %s\n"
               "        is `ltrain coordinator` running there? Check --coordinator HOST:PORT.\n",
               why.c_str());
  return kExitUnavailable;
}

void PrintCoordinatorWarning(const std::string& warning) {
  if (!warning.empty()) std::fprintf(stderr, "ltrain: warning: %s\n", warning.c_str());
}

int ReplyError(const v1::Status& status) {
  std::fprintf(stderr, "ltrain: %s\n", status.message().c_str());
  return status.code() == static_cast<int>(StatusCode::kInvalidArgument) ? kExitInvalid : kExitUnavailable;
}

InterruptWatcher::InterruptWatcher() {
  sigemptyset(&set_);
  sigaddset(&set_, SIGINT);
  struct sigaction term {};
  if (sigaction(SIGTERM, nullptr, &term) != 0 || term.sa_handler != SIG_IGN) sigaddset(&set_, SIGTERM);
  sigaddset(&set_, SIGUSR2);  // only ever sent by the destructor, to end the thread
  pthread_sigmask(SIG_BLOCK, &set_, nullptr);
}

InterruptWatcher::Watching InterruptWatcher::Start(std::function<void(int)> on_signal) {
  thread_ = std::thread([this, on_signal] {
    int signal = 0;
    while (sigwait(&set_, &signal) == 0 && signal != SIGUSR2) on_signal(signal);
  });
  return Watching(this);
}

void InterruptWatcher::Stop() {
  if (!thread_.joinable()) return;
  pthread_kill(thread_.native_handle(), SIGUSR2);
  thread_.join();
  sigset_t watched = set_;
  sigdelset(&watched, SIGUSR2);
  pthread_sigmask(SIG_UNBLOCK, &watched, nullptr);
}

InterruptWatcher::~InterruptWatcher() { Stop(); }

}  // namespace ltrain::cli
