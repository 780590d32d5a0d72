// ltrain agent: the node agent that starts and supervises this node's workers.
#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <mutex>

#include "agent/agent.h"
#include "cmd/cli_support.h"
#include "cmd/commands.h"
#include "common/logging.h"
#include "common/transport_probe.h"

namespace ltrain::cli {
namespace {

namespace fs = std::filesystem;

// The agent's start: the coordinator must answer, in this agent's terms. One that nothing answers for
// yet (down, or starting) is waited for up to `connect_timeout_s`, probed once a second; one that
// answers but never will take this agent (TLS on one side only, a certificate it does not accept) is
// named at once. Either way the agent then exits kExitUnavailable; a refused token stays kExitInvalid.
int RunAgent(agent::AgentOptions options, double connect_timeout_s) {
  InterruptWatcher interrupts;
  if (options.work_dir.empty()) {
    options.work_dir =
        (fs::path(LtrainHome()) / ("agent-" + (options.node_id.empty() ? "node" : options.node_id))).string();
  }
  if (Status clear = CheckTokenTransport(options.coordinator, options.security); !clear.ok()) {
    std::fprintf(stderr, "ltrain agent: %s\n", clear.message().c_str());
    return kExitInvalid;
  }
  // SIGINT and SIGTERM end the wait for the coordinator, and once the agent runs, stop it.
  std::mutex mu;
  std::condition_variable wake;
  bool interrupted = false;
  std::unique_ptr<agent::Agent> running;  // declared before `watching`, which goes first
  InterruptWatcher::Watching watching = interrupts.Start([&](int) {
    std::lock_guard<std::mutex> lock(mu);
    interrupted = true;
    if (running) running->Shutdown();
    wake.notify_all();
  });

  const auto began = std::chrono::steady_clock::now();
  auto waited_ms = [&] {
    return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - began).count();
  };
  const auto timeout_ms = static_cast<int64_t>(std::min(connect_timeout_s * 1000, static_cast<double>(kMaxWaitMs)));
  TransportDiagnosis diagnosis = DiagnoseTransport(options.coordinator, options.security);
  bool said_waiting = false;
  while (diagnosis.fault == TransportFault::kUnreachable) {
    if (waited_ms() >= timeout_ms) {
      std::fprintf(stderr, "ltrain agent: %s (waited %.0f s; start it, or check --coordinator)\n",
                   diagnosis.message.c_str(), static_cast<double>(waited_ms()) / 1000);
      return kExitUnavailable;
    }
    if (!said_waiting) {
      LTRAIN_LOG(kWarning, "agent") << diagnosis.message << "; waiting up to " << connect_timeout_s
                                    << " s for it (--connect-timeout)";
      said_waiting = true;
    }
    {
      std::unique_lock<std::mutex> lock(mu);
      const auto pause = std::chrono::milliseconds(std::min<int64_t>(1000, timeout_ms - waited_ms()));
      if (wake.wait_for(lock, pause, [&] { return interrupted; })) return kExitOk;
    }
    diagnosis = DiagnoseTransport(options.coordinator, options.security);
  }
  if (diagnosis.fault != TransportFault::kNone && diagnosis.fault != TransportFault::kUnknown) {
    std::fprintf(stderr, "ltrain agent: %s\n", diagnosis.message.c_str());
    return kExitUnavailable;
  }
  // The transport works (or the probe could not tell: then gRPC's call decides); a call tells
  // whether the coordinator takes this agent's token.
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
    if (diagnosis.fault == TransportFault::kUnknown && status.error_code() == grpc::StatusCode::UNAVAILABLE) {
      std::fprintf(stderr, "ltrain agent: %s\n", diagnosis.message.c_str());
      return kExitUnavailable;
    }
  }
  StatusOr<std::unique_ptr<agent::Agent>> started = agent::Agent::Start(options);
  if (!started.ok()) {
    std::fprintf(stderr, "ltrain agent: %s\n", started.status().message().c_str());
    return started.status().code() == StatusCode::kInvalidArgument ? kExitInvalid : kExitUnavailable;
  }
  agent::Agent* raw = nullptr;
  {
    std::lock_guard<std::mutex> lock(mu);
    running = std::move(*started);
    raw = running.get();
    if (interrupted) raw->Shutdown();  // a signal came while it started
  }
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
  auto connect_timeout_s = std::make_shared<double>(60);
  cmd->add_option("--connect-timeout", *connect_timeout_s,
                  "Seconds to wait at start for a coordinator that nothing answers for yet; after that the agent "
                  "exits 3 (as it does at once when the coordinator answers but not in its terms: TLS, certificates)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  auto release_gpus = std::make_shared<bool>(false);
  cmd->add_flag("--release-idle-gpus", *release_gpus,
               "Do not hold the node's GPUs (/dev/nvidiaN) open while the agent runs. By default the agent holds "
               "them, as nvidia-persistenced does, so that a restarted rank's CUDA start skips the GPU's "
               "initialization where persistence mode is off; released, an idle GPU can be reset");
  ctx.Bind(cmd, [options, connect_timeout_s, release_gpus, &ctx] {
    agent::AgentOptions run = *options;
    run.keep_gpus_attached = !*release_gpus;
    run.security = ctx.security();
    run.leave_reason = "its agent was stopped (SIGTERM or SIGINT)";
    return RunAgent(std::move(run), *connect_timeout_s);
  });
}

}  // namespace ltrain::cli
