// ltrain nodes: the nodes a coordinator knows, with their facts, heartbeat age and running jobs.
#include <cstdio>
#include <memory>

#include "cmd/cli_support.h"
#include "cmd/commands.h"
#include "cmd/job_printer.h"

namespace ltrain::cli {
namespace {

struct NodesArgs {
  std::string coordinator;
  std::string output = "table";
};

int ListNodes(const NodesArgs& args, const SecurityMaterial& security) {
  if (args.coordinator.empty()) {
    std::fprintf(stderr,
                 "ltrain nodes: give the coordinator (--coordinator HOST:PORT, $LTRAIN_COORDINATOR or `coordinator:` "
                 "in %s/config.yaml); a standalone launch has only its own node, named local\n",
                 LtrainHome().c_str());
    return kExitInvalid;
  }
  CoordinatorClient client(args.coordinator, security);
  grpc::ClientContext context;
  context.set_deadline(Deadline(3));
  v1::ListNodesRequest request;
  v1::ListNodesReply reply;
  grpc::Status status = client.stub().ListNodes(&context, request, &reply);
  if (!status.ok()) return client.Unreachable(status);
  PrintCoordinatorWarning(reply.warning());
  if (reply.status().code() != 0) return ReplyError(reply.status());
  if (args.output == "json") {
    std::printf("%s\n", ToJson(reply).c_str());
  } else {
    std::fputs(FormatNodeTable({reply.nodes().begin(), reply.nodes().end()}).c_str(), stdout);
  }
  return kExitOk;
}

}  // namespace

void AddNodesCommand(CLI::App& app, CommandContext& ctx) {
  auto args = std::make_shared<NodesArgs>();
  CLI::App* cmd = app.add_subcommand("nodes", "List the coordinator's nodes: CPUs, GPUs, heartbeat age and jobs");
  AddCoordinatorOption(cmd, &args->coordinator, "HOST:PORT of the coordinator");
  AddOutputOption(cmd, &args->output, "table");
  ctx.Bind(cmd, [args, &ctx] { return ListNodes(*args, ctx.security()); });
}

}  // namespace ltrain::cli
