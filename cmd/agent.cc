// ltrain agent: the node agent that starts and supervises this node's workers.
#include <cstdio>
#include <filesystem>
#include <memory>

#include "agent/agent.h"
#include "cmd/cli_support.h"
#include "cmd/commands.h"

namespace ltrain::cli {
namespace {

namespace fs = std::filesystem;

int RunAgent(agent::AgentOptions options) {
  InterruptWatcher interrupts;
  if (options.work_dir.empty()) {
    options.work_dir =
        (fs::path(LtrainHome()) / ("agent-" + (options.node_id.empty() ? "node" : options.node_id))).string();
  }
  if (Status clear = CheckTokenTransport(options.coordinator, options.security); !clear.ok()) {
    std::fprintf(stderr, "ltrain agent: %s\n", clear.message().c_str());
    return kExitInvalid;
  }
  // A coordinator that is down may come later, and the agent waits for it; one that refuses this
  // agent (TLS on one side only, a certificate or token it does not accept) never will: said now.
  {
    auto stub = v1::AgentService::NewStub(MakeChannel(options.coordinator, options.security));
    grpc::ClientContext context;
    context.set_deadline(Deadline(5));
    v1::HeartbeatRequest probe;
    probe.set_node_id("ltrain-agent-probe");  // no real node: the reply is "not connected"
    v1::HeartbeatReply reply;
    const grpc::Status status = stub->Heartbeat(&context, probe, &reply);
    if (status.error_code() == grpc::StatusCode::UNAUTHENTICATED) {
      std::fprintf(stderr, "ltrain agent: the coordinator at %s refused this agent: %s\n", options.coordinator.c_str(),
                   status.error_message().c_str());
      return kExitInvalid;
    }
    if (status.error_code() == grpc::StatusCode::UNAVAILABLE) {
      if (std::string mismatch = ExplainTransportMismatch(options.coordinator, options.security, status.error_message());
          !mismatch.empty()) {
        std::fprintf(stderr, "ltrain agent: %s\n", mismatch.c_str());
        return kExitInvalid;
      }
    }
  }
  StatusOr<std::unique_ptr<agent::Agent>> started = agent::Agent::Start(options);
  if (!started.ok()) {
    std::fprintf(stderr, "ltrain agent: %s\n", started.status().message().c_str());
    return started.status().code() == StatusCode::kInvalidArgument ? kExitInvalid : kExitUnavailable;
  }
  agent::Agent* raw = started->get();
  InterruptWatcher::Watching watching = interrupts.Start([raw](int) { raw->Shutdown(); });  // goes before the agent
  raw->Wait();
  return kExitOk;
}

}  // namespace

void AddAgentCommand(CLI::App& app, CommandContext& ctx) {
  auto options = std::make_shared<agent::AgentOptions>();
  CLI::App* cmd = app.add_subcommand("agent", "Run the node agent that starts and supervises workers");
  AddCoordinatorOption(cmd, &options->coordinator, "HOST:PORT of the coordinator")->required();
  cmd->add_option("--node-id", options->node_id, "Name of this node (default: host name)");
  cmd->add_option("--work-dir", options->work_dir, "Per-job recipes and per-rank logs");
  cmd->add_option("--worker-binary", options->worker_binary, "ltrain-worker to start (default: beside ltrain)");
  cmd->add_option("--bind-address", options->bind_address, "Address this node's workers use for collectives")
      ->capture_default_str();
  cmd->add_option("--heartbeat-interval", options->heartbeat_interval_s, "Seconds between heartbeats")
      ->capture_default_str();
  cmd->add_option("--coordinator-grace", options->coordinator_grace_s,
                  "Seconds the workers keep running while the coordinator is unreachable")
      ->capture_default_str();
  auto release_gpus = std::make_shared<bool>(false);
  cmd->add_flag("--release-idle-gpus", *release_gpus,
               "Do not hold the node's GPUs (/dev/nvidiaN) open while the agent runs. By default the agent holds "
               "them, as nvidia-persistenced does, so that a restarted rank's CUDA start skips the GPU's "
               "initialization where persistence mode is off; released, an idle GPU can be reset");
  ctx.Bind(cmd, [options, release_gpus, &ctx] {
    agent::AgentOptions run = *options;
    run.keep_gpus_attached = !*release_gpus;
    run.security = ctx.security();
    run.leave_reason = "its agent was stopped (SIGTERM or SIGINT)";
    return RunAgent(std::move(run));
  });
}

}  // namespace ltrain::cli
