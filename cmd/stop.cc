// ltrain stop JOB [--checkpoint]: stop a job, with --checkpoint after a final commit.
#include <cstdio>
#include <filesystem>
#include <memory>
#include <thread>

#include "cmd/cli_support.h"
#include "cmd/commands.h"
#include "launcher/coordinator_server.h"
#include "launcher/state_store.h"

namespace ltrain::cli {
namespace {

namespace fs = std::filesystem;

struct StopArgs {
  std::string job_id;
  std::string coordinator;
  bool checkpoint = false;
  double checkpoint_timeout_s = 60;
};

int Stop(const StopArgs& args, const SecurityMaterial& security) {
  const std::string& job_id = args.job_id;
  std::string coordinator_address = args.coordinator;
  SecurityMaterial used = security;
  if (coordinator_address.empty()) {
    // A launch that was killed has left nothing to stop: its job is recorded FAILED, and said so.
    for (const std::string& failed : ReconcileDeadLaunches(LtrainHome())) {
      if (failed == job_id) {
        std::printf("job %s: FAILED: its launch had been killed; nothing left to stop\n", job_id.c_str());
        return kExitOk;
      }
    }
    if (std::optional<LocalLaunch> launch = FindLocalLaunch(LtrainHome(), job_id)) {
      coordinator_address = launch->address;
      used = launch->security;
    }
    if (coordinator_address.empty() && fs::exists(fs::path(LtrainHome()) / "state.db")) {
      // No launch runs it: a job that has ended already has nothing to stop.
      StatusOr<std::unique_ptr<launcher::StateStore>> store = launcher::OpenStateStore(LtrainHome());
      StatusOr<v1::Job> stored = store.ok() ? (*store)->GetJob(job_id) : StatusOr<v1::Job>(store.status());
      if (stored.ok() && launcher::IsFinal(stored->state())) {
        std::printf("job %s: %s already; nothing to stop\n", job_id.c_str(), launcher::JobStateName(stored->state()));
        return kExitOk;
      }
    }
    if (coordinator_address.empty()) {
      std::fprintf(stderr,
                   "ltrain: no running local launch of job %s under %s; for a cluster job pass --coordinator HOST:PORT\n",
                   job_id.c_str(), LtrainHome().c_str());
      return kExitInvalid;
    }
  }
  CoordinatorClient client(coordinator_address, used);
  grpc::ClientContext context;
  context.set_deadline(Deadline(5));
  v1::StopJobRequest request;
  request.set_job_id(job_id);
  request.set_reason(args.checkpoint ? "stopped by `ltrain stop --checkpoint`" : "stopped by `ltrain stop`");
  request.set_checkpoint(args.checkpoint);
  request.set_checkpoint_timeout_s(args.checkpoint_timeout_s);
  v1::StopJobReply reply;
  grpc::Status status = client.stub().StopJob(&context, request, &reply);
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
        std::fprintf(stderr, "ltrain: job %s is still %s %.0f s after the stop; see `ltrain status %s`\n",
                     job_id.c_str(), launcher::JobStateName(job.state()), args.checkpoint_timeout_s + 30,
                     job_id.c_str());
        return kExitUnavailable;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(250));
      if (std::optional<v1::Job> got = client.TryGetJob(job_id, 5)) {
        job = *got;
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
    std::printf("job %s: %s: %s\n", job_id.c_str(), launcher::JobStateName(job.state()), job.cause().c_str());
  } else {
    std::printf("job %s: %s\n", job_id.c_str(), launcher::JobStateName(job.state()));
  }
  return kExitOk;
}

}  // namespace

void AddStopCommand(CLI::App& app, CommandContext& ctx) {
  auto args = std::make_shared<StopArgs>();
  CLI::App* cmd = app.add_subcommand(
      "stop", "Stop a job: its workers get SIGTERM, then SIGKILL; with --checkpoint they first save a final checkpoint");
  cmd->add_option("job", args->job_id, "Job id")->required();
  AddCoordinatorOption(cmd, &args->coordinator, "HOST:PORT; without it, the local launch running the job");
  CLI::Option* checkpoint = cmd->add_flag(
      "--checkpoint", args->checkpoint,
      "First train on to a step every rank reaches, commit a checkpoint of it, then end (STOPPED with that "
      "commit); waits until the job has ended");
  cmd->add_option("--checkpoint-timeout", args->checkpoint_timeout_s,
                  "Seconds the final checkpoint may take before the job is stopped plainly, keeping its last commit")
      ->check(CLI::Range(0.001, 604800.0))
      ->needs(checkpoint)
      ->capture_default_str();
  ctx.Bind(cmd, [args, &ctx] { return Stop(*args, ctx.security()); });
}

}  // namespace ltrain::cli
