// ltrain dashboard [JOB]: a one-time, read-only login link to a coordinator's dashboard (its
// --http-listen), or to the dashboard of a standalone launch that runs with --http-listen.
#include <cstdio>
#include <memory>
#include <optional>

#include "cmd/cli_support.h"
#include "cmd/commands.h"

namespace ltrain::cli {
namespace {

struct DashboardArgs {
  std::string job_id;
  std::string coordinator;
  std::string output = "text";
};

int PrintLink(const DashboardArgs& args, const SecurityMaterial& security) {
  std::string address = args.coordinator;
  SecurityMaterial used = security;
  if (address.empty()) {
    // A standalone launch of the job, running now, serves its own dashboard.
    std::optional<LocalLaunch> launch = args.job_id.empty() ? std::nullopt : FindLocalLaunch(LtrainHome(), args.job_id);
    if (!launch) {
      std::fprintf(stderr,
                   "ltrain dashboard: give the coordinator (--coordinator HOST:PORT, $LTRAIN_COORDINATOR or "
                   "`coordinator:` in %s/config.yaml), or the job of a standalone launch that runs with "
                   "--http-listen\n",
                   LtrainHome().c_str());
      return kExitInvalid;
    }
    address = launch->address;
    used = launch->security;
  }
  CoordinatorClient client(address, used);
  grpc::ClientContext context;
  context.set_deadline(Deadline(5));
  v1::DashboardLinkRequest request;
  request.set_job_id(args.job_id);
  v1::DashboardLinkReply reply;
  grpc::Status status = client.stub().DashboardLink(&context, request, &reply);
  if (!status.ok()) return client.Unreachable(status);
  if (reply.status().code() != 0) {
    std::fprintf(stderr, "ltrain dashboard: %s\n", reply.status().message().c_str());
    return kExitInvalid;
  }
  if (args.output == "json") {
    std::printf("%s\n", ToJson(reply).c_str());
  } else {
    std::printf("%s\n", reply.url().c_str());
    std::fprintf(stderr, "ltrain: the link works once, within %.0f minutes, and opens a read-only session\n",
                 reply.expires_in_s() / 60);
  }
  return kExitOk;
}

}  // namespace

void AddDashboardCommand(CLI::App& app, CommandContext& ctx) {
  auto args = std::make_shared<DashboardArgs>();
  CLI::App* cmd = app.add_subcommand(
      "dashboard",
      "Print a one-time login link to the dashboard (--http-listen): it works once, within 10 minutes, and opens "
      "a read-only session of 12 hours; no token is ever in the address");
  cmd->add_option("job", args->job_id, "Open this job (needed for a standalone launch's own dashboard)");
  AddCoordinatorOption(cmd, &args->coordinator, "HOST:PORT of the coordinator");
  AddOutputOption(cmd, &args->output, "text", "the link alone");
  ctx.Bind(cmd, [args, &ctx] { return PrintLink(*args, ctx.security()); });
}

}  // namespace ltrain::cli
