// What several `ltrain` commands share: exit codes, $LTRAIN_HOME and the addresses of local launches,
// the coordinator client and its error messages, JSON output, and turning SIGINT/SIGTERM into a stop.
#pragma once

#include <signal.h>

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <CLI/CLI.hpp>
#include <google/protobuf/message.h>
#include <grpcpp/grpcpp.h>

#include "common/clock.h"
#include "common/transport_security.h"
#include "ltrain/v1/ltrain.grpc.pb.h"

namespace ltrain::cli {

// The exit codes of every command, as `ltrain --help` and the README state them.
constexpr int kExitOk = 0;           // success; the job SUCCEEDED
constexpr int kExitFailed = 1;       // the job FAILED
constexpr int kExitInvalid = 2;      // invalid input: flags, recipe, data, an unknown job
constexpr int kExitUnavailable = 3;  // the coordinator could not be reached or answered an error
constexpr int kExitStopped = 4;      // the job was STOPPED

// Where state, checkpoints and local agents live: $LTRAIN_HOME, else ~/.ltrain.
std::string LtrainHome();

// Says on stderr that `job_id` is not in the local state under `home`, and where else it may be (a
// coordinator daemon); returns kExitInvalid.
int NoLocalJob(const std::string& job_id, const std::string& home);

// The client settings of $LTRAIN_HOME/config.yaml (all optional):
//   coordinator: HOST:PORT     tls_ca: FILE     tls_cert: FILE     tls_key: FILE
//   token_file: FILE           output: json | text
// Each becomes the default of its environment variable (LTRAIN_COORDINATOR, LTRAIN_TLS_CA,
// LTRAIN_TLS_CERT, LTRAIN_TLS_KEY, LTRAIN_TOKEN_FILE, LTRAIN_OUTPUT) where that is not set, so that
// a flag beats the environment, which beats the file. A file that does not parse or has an unknown
// key is InvalidArgument naming the file, line and key; no file is fine.
Status LoadClientConfig(const std::string& home);

// --coordinator HOST:PORT, defaulting to $LTRAIN_COORDINATOR (which config.yaml may set).
CLI::Option* AddCoordinatorOption(CLI::App* command, std::string* coordinator, const std::string& help);
// -o,--output: `human` (the command's "table" or "text"; either word is taken, and any other is refused) or
// json, defaulting to $LTRAIN_OUTPUT (which config.yaml may set); `what` says in the help what the human
// form is, where its name does not.
CLI::Option* AddOutputOption(CLI::App* command, std::string* output, const std::string& human,
                             const std::string& what = "");

// The read-only token of /metrics (`ltrain coordinator --http-listen`, `ltrain launch --http-listen`):
// $LTRAIN_HOME/metrics-token (made 0600 when first needed), or the state directory's.
std::string MetricsTokenFile(const std::string& dir);

// The file through which a standalone launch tells later commands (status, logs, stop) the address of
// the coordinator it runs in-process, and the token it made for it, while it runs:
// $LTRAIN_HOME/run/JOB.addr, readable by its owner only.
std::string LocalAddressFile(const std::string& home, const std::string& job_id);
struct LocalLaunch {
  std::string address;
  SecurityMaterial security;  // the launch's own token
};
Status WriteLocalLaunch(const std::string& home, const std::string& job_id, const LocalLaunch& launch);
// What that file says, or nullopt when no local launch of the job is running.
std::optional<LocalLaunch> FindLocalLaunch(const std::string& home, const std::string& job_id);

// A standalone launch holds an flock on $LTRAIN_HOME/run/JOB.lock (which names its pid) while it
// runs; the kernel releases it however the process ends. HoldLaunchLock returns the descriptor to
// keep open (-1 when the file cannot be made: later commands then cannot tell a killed launch);
// ReleaseLaunchLock removes the file and closes it, at the launch's normal end.
int HoldLaunchLock(const std::string& home, const std::string& job_id);
void ReleaseLaunchLock(const std::string& home, const std::string& job_id, int fd);
// The jobs of standalone launches under `home` that ended (killed) before their job did: each is
// recorded FAILED, with why, so that status shows it, stop has nothing to stop and resume may take
// it up. Returns their ids. Jobs of a coordinator daemon are never touched (they have no lock file).
std::vector<std::string> ReconcileDeadLaunches(const std::string& home);

// `path` made absolute against the working directory, so that daemons started elsewhere read it; ""
// stays "", and a path that cannot be resolved is returned as given.
std::string Absolute(const std::string& path);


// A reply or job as `-o json` prints it: FormatJson (cmd/job_printer.h), indented.
std::string ToJson(const google::protobuf::Message& message);

// kExitOk for SUCCEEDED, kExitStopped for STOPPED, kExitFailed for anything else.
int ExitCodeFor(v1::JobState state);

// One coordinator's JobService, over TLS and with a token where the global flags ask for them.
class CoordinatorClient {
 public:
  CoordinatorClient(const std::string& address, const SecurityMaterial& security);

  const std::string& address() const { return address_; }
  v1::JobService::Stub& stub() { return *stub_; }

  // Says on stderr why the RPC did not reach the coordinator (or was refused) and what to check;
  // returns kExitUnavailable.
  int Unreachable(const grpc::Status& status) const;

  // The job, when the coordinator answers within `timeout_s` and knows it; nullopt otherwise.
  std::optional<v1::Job> TryGetJob(const std::string& job_id, double timeout_s);

 private:
  std::string address_;
  SecurityMaterial security_;
  std::unique_ptr<v1::JobService::Stub> stub_;
};

// Says on stderr what the coordinator wants every user to know (GetJobReply::warning and its twins),
// when it says anything.
void PrintCoordinatorWarning(const std::string& warning);

// Prints a coordinator's error reply; kExitInvalid when it refused the request as invalid, else
// kExitUnavailable.
int ReplyError(const v1::Status& status);

// Blocks SIGINT/SIGTERM in every thread; a dedicated thread turns each one into `on_signal`. Construct
// it before any thread starts, so that every thread inherits the mask. A SIGTERM that the parent
// ignores (`trap '' TERM`, as the Slurm script does for the coordinator) stays ignored: Linux keeps a
// blocked signal pending even when its action is to ignore it, so sigwait would receive it anyway.
class InterruptWatcher {
 public:
  InterruptWatcher();
  ~InterruptWatcher();
  InterruptWatcher(const InterruptWatcher&) = delete;
  InterruptWatcher& operator=(const InterruptWatcher&) = delete;

  // Ends the watcher's thread when it goes, and unblocks the signals in the thread it goes in: a
  // signal after that takes its default action (it ends the process). Declare it after everything
  // `on_signal` reads, so that it goes first: the watcher itself is declared before any thread
  // starts, and would otherwise outlive what its callback uses.
  class Watching {
   public:
    Watching(Watching&& other) noexcept : watcher_(std::exchange(other.watcher_, nullptr)) {}
    Watching(const Watching&) = delete;
    Watching& operator=(const Watching&) = delete;
    Watching& operator=(Watching&&) = delete;
    ~Watching() {
      if (watcher_ != nullptr) watcher_->Stop();
    }

   private:
    friend class InterruptWatcher;
    explicit Watching(InterruptWatcher* watcher) : watcher_(watcher) {}
    InterruptWatcher* watcher_;
  };

  // `on_signal` runs on the watcher's thread, once per signal, until the handle goes.
  [[nodiscard]] Watching Start(std::function<void(int)> on_signal);

 private:
  void Stop();

  sigset_t set_;
  std::thread thread_;
};

}  // namespace ltrain::cli
