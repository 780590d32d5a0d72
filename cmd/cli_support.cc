#include "cmd/cli_support.h"

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>

#include <google/protobuf/util/json_util.h>

#include "common/status.h"

namespace ltrain::cli {

namespace fs = std::filesystem;

std::string LtrainHome() {
  if (const char* env = getenv("LTRAIN_HOME"); env && *env) return env;
  const char* home = getenv("HOME");
  return (fs::path(home ? home : "/tmp") / ".ltrain").string();
}

std::string LocalAddressFile(const std::string& home, const std::string& job_id) {
  return (fs::path(home) / "run" / (job_id + ".addr")).string();
}

std::string LocalLaunchAddress(const std::string& home, const std::string& job_id) {
  std::ifstream in(LocalAddressFile(home, job_id));
  std::string address;
  in >> address;
  return address;
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

int ExitCodeFor(v1::JobState state) {
  switch (state) {
    case v1::JOB_STATE_SUCCEEDED: return kExitOk;
    case v1::JOB_STATE_STOPPED: return kExitStopped;
    default: return kExitFailed;
  }
}

CoordinatorClient::CoordinatorClient(const std::string& address, const SecurityMaterial& security)
    : address_(address), stub_(v1::JobService::NewStub(MakeChannel(address, security))) {}

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
  std::fprintf(stderr,
               "ltrain: cannot reach the coordinator at %s: %s\n"
               "        is `ltrain coordinator` running there? Check --coordinator HOST:PORT.\n",
               address_.c_str(), status.error_message().c_str());
  return kExitUnavailable;
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

void InterruptWatcher::Start(std::function<void(int)> on_signal) {
  thread_ = std::thread([this, on_signal] {
    int signal = 0;
    while (sigwait(&set_, &signal) == 0 && signal != SIGUSR2) on_signal(signal);
  });
}

InterruptWatcher::~InterruptWatcher() {
  if (thread_.joinable()) {
    pthread_kill(thread_.native_handle(), SIGUSR2);
    thread_.join();
  }
}

}  // namespace ltrain::cli
