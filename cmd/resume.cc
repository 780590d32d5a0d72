// ltrain resume JOB: start a FAILED or STOPPED job again from its last commit and follow it.
#include <cstdio>
#include <memory>

#include "cmd/cli_support.h"
#include "cmd/commands.h"
#include "cmd/run_job.h"
#include "common/status.h"

namespace ltrain::cli {
namespace {

struct ResumeArgs {
  std::string job_id;
  RunJobOptions run;
};

int Resume(const ResumeArgs& args, const SecurityMaterial& security) {
  return RunJob(args.run, security, [&](CoordinatorClient& client) -> std::variant<BegunJob, int> {
    v1::ResumeJobRequest request;
    request.set_job_id(args.job_id);
    v1::ResumeJobReply reply;
    grpc::ClientContext context;
    context.set_deadline(Deadline(10));
    grpc::Status status = client.stub().ResumeJob(&context, request, &reply);
    if (!status.ok()) return client.Unreachable(status);
    if (reply.status().code() != 0) {
      // An unknown job, or one that cannot be resumed (still running, SUCCEEDED), is the user's to fix.
      std::fprintf(stderr, "ltrain: %s\n", reply.status().message().c_str());
      return reply.status().code() == static_cast<int>(StatusCode::kNotFound) ||
                     reply.status().code() == static_cast<int>(StatusCode::kFailedPrecondition)
                 ? kExitInvalid
                 : kExitUnavailable;
    }
    return BegunJob{reply.job().id(), reply.after_seq()};
  });
}

}  // namespace

void AddResumeCommand(CLI::App& app, CommandContext& ctx) {
  auto args = std::make_shared<ResumeArgs>();
  args->run.verb = "resumed";
  CLI::App* cmd = app.add_subcommand(
      "resume", "Start a FAILED or STOPPED job again from its last committed checkpoint, and follow it");
  cmd->add_option("job", args->job_id, "Job id")->required();
  AddCoordinatorOption(cmd, &args->run.coordinator,
                       "HOST:PORT of the coordinator that ran it; without it a local one on $LTRAIN_HOME");
  cmd->add_flag("--detach", args->run.detach,
                "With --coordinator: return once the job is resumed (refused without --coordinator: exit 2)");
  cmd->add_flag("-q,--quiet", args->run.quiet, "Print job events and rank 0's step lines only, not the workers' other lines");
  cmd->add_flag("-v,--verbose", args->run.verbose, "Also print the embedded coordinator's and agent's logs");
  ctx.Bind(cmd, [args, &ctx] { return Resume(*args, ctx.security()); });
}

}  // namespace ltrain::cli
