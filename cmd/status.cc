// ltrain status [JOB] and ltrain list: one job in detail, or the jobs newest first.
#include <cstdio>
#include <filesystem>
#include <memory>

#include "cmd/cli_support.h"
#include "cmd/commands.h"
#include "cmd/job_printer.h"
#include "common/clock.h"
#include "launcher/coordinator_server.h"
#include "launcher/state_store.h"

namespace ltrain::cli {
namespace {

namespace fs = std::filesystem;

struct StatusArgs {
  std::string job_id;  // "" lists the jobs
  std::string coordinator;
  std::string output = "table";
  int limit = 50;
};

void PrintJobs(const std::vector<v1::Job>& jobs) {
  std::fputs(FormatJobTable(jobs, RealClock().UnixMs()).c_str(), stdout);
}

void PrintJob(const v1::Job& job, bool json) {
  if (json) std::printf("%s\n", ToJson(job).c_str());
  else std::fputs(FormatJobDetail(job, RealClock().UnixMs()).c_str(), stdout);
}

int ShowStatus(const StatusArgs& args, const SecurityMaterial& security) {
  const std::string& job_id = args.job_id;
  bool json = args.output == "json";
  if (!args.coordinator.empty()) {
    CoordinatorClient client(args.coordinator, security);
    grpc::ClientContext context;
    context.set_deadline(Deadline(3));
    if (job_id.empty()) {
      v1::ListJobsRequest request;
      request.set_limit(args.limit);
      v1::ListJobsReply reply;
      grpc::Status status = client.stub().ListJobs(&context, request, &reply);
      if (!status.ok()) return client.Unreachable(status);
      PrintCoordinatorWarning(reply.warning());
      if (reply.status().code() != 0) return ReplyError(reply.status());
      if (json) std::printf("%s\n", ToJson(reply).c_str());
      else PrintJobs({reply.jobs().begin(), reply.jobs().end()});
      return kExitOk;
    }
    v1::GetJobRequest request;
    request.set_job_id(job_id);
    v1::GetJobReply reply;
    grpc::Status status = client.stub().GetJob(&context, request, &reply);
    if (!status.ok()) return client.Unreachable(status);
    PrintCoordinatorWarning(reply.warning());
    if (reply.status().code() != 0) return ReplyError(reply.status());
    PrintJob(reply.job(), json);
    return kExitOk;
  }
  // Standalone: a job whose launch still runs is asked of that launch's coordinator (live node and
  // rank progress); otherwise the state under $LTRAIN_HOME is read directly.
  std::string home = LtrainHome();
  (void)ReconcileDeadLaunches(home);
  if (!job_id.empty()) {
    if (std::optional<LocalLaunch> launch = FindLocalLaunch(home, job_id)) {
      CoordinatorClient client(launch->address, launch->security);
      if (std::optional<v1::Job> job = client.TryGetJob(job_id, 2)) {
        PrintJob(*job, json);
        return kExitOk;
      }
    }
  }
  if (!fs::exists(fs::path(home) / "state.db")) {
    if (!job_id.empty()) return NoLocalJob(job_id, home);
    if (json) std::printf("%s\n", ToJson(v1::ListJobsReply()).c_str());
    else std::printf("no jobs yet under %s; start one with `ltrain launch RECIPE`\n", home.c_str());
    return kExitOk;
  }
  StatusOr<std::unique_ptr<launcher::StateStore>> store = launcher::OpenStateStore(home);
  if (!store.ok()) {
    std::fprintf(stderr, "ltrain: %s\n", store.status().message().c_str());
    return kExitUnavailable;
  }
  if (job_id.empty()) {
    StatusOr<std::vector<v1::Job>> jobs = (*store)->ListJobs(args.limit);
    if (!jobs.ok()) {
      std::fprintf(stderr, "ltrain: %s\n", jobs.status().message().c_str());
      return kExitUnavailable;
    }
    if (json) {
      v1::ListJobsReply reply;
      for (auto& job : *jobs) *reply.add_jobs() = job;
      std::printf("%s\n", ToJson(reply).c_str());
    } else {
      PrintJobs(*jobs);
    }
    return kExitOk;
  }
  StatusOr<v1::Job> job = (*store)->GetJob(job_id);
  if (!job.ok()) return NoLocalJob(job_id, home);
  PrintJob(*job, json);
  return kExitOk;
}

}  // namespace

void AddListCommand(CLI::App& app, CommandContext& ctx) {
  auto args = std::make_shared<StatusArgs>();
  CLI::App* cmd = app.add_subcommand("list", "List the jobs, newest first");
  AddCoordinatorOption(cmd, &args->coordinator, "HOST:PORT; without it, the local state in $LTRAIN_HOME");
  AddOutputOption(cmd, &args->output, "table");
  cmd->add_option("--limit", args->limit, "Jobs to list")->capture_default_str();
  ctx.Bind(cmd, [args, &ctx] { return ShowStatus(*args, ctx.security()); });
}

void AddStatusCommand(CLI::App& app, CommandContext& ctx) {
  auto args = std::make_shared<StatusArgs>();
  CLI::App* cmd = app.add_subcommand("status", "Show one job, or list the jobs (newest first)");
  cmd->add_option("job", args->job_id, "Job id; omit to list jobs");
  AddCoordinatorOption(cmd, &args->coordinator, "HOST:PORT; without it, the local state in $LTRAIN_HOME");
  AddOutputOption(cmd, &args->output, "table");
  cmd->add_option("--limit", args->limit, "Jobs to list")->capture_default_str();
  ctx.Bind(cmd, [args, &ctx] { return ShowStatus(*args, ctx.security()); });
}

}  // namespace ltrain::cli
