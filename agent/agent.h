// Agent: one per node. Registers with the coordinator, heartbeats, starts the workers it is
// assigned, captures their output into per-rank log files and forwards the lines, reports every
// exit, and kills whole process groups on stop. A stop with a final checkpoint kills nothing: the
// agent tells the job's workers in the replies to their progress reports (WorkerService), and they
// save and exit on their own. Workers reach the coordinator's rendezvous store only through the
// agent's local RendezvousService proxy.
//
// Threads: the connect thread reads the coordinator's command stream; the heartbeat thread beats,
// with the latest progress report of each running worker (agent/progress_table.h); the supervisor
// thread owns the Supervisor (agent/supervisor.h), the only code that spawns, reads output, reaps
// and kills, and waits for the workers' output between its steps; the sender thread sends exit
// reports, log batches and urgent progress in the order they were queued.
//
// Ordering: a worker's progress report that brings a commit or the stop after a final checkpoint
// is queued by the WorkerService handler before the worker gets its reply, and the worker prints
// the line that announces it only after that reply, so the coordinator has the news before the
// line. Each exit report carries the worker's last progress report.
#pragma once

#include <memory>
#include <string>

#include "agent/process_spawner.h"
#include "common/status.h"
#include "common/transport_security.h"

namespace ltrain::agent {

struct AgentOptions {
  std::string coordinator;          // HOST:PORT
  std::string node_id;              // default: the host name
  std::string work_dir;             // per-job recipes and per-rank logs
  std::string worker_binary;        // default: ltrain-worker beside this executable; ltrain-exec (which
                                    // runs a recipe's entrypoint.command) is taken from beside it
  std::string bind_address = "127.0.0.1";  // where this node's workers listen for collectives
  double heartbeat_interval_s = 1.0;
  double stop_grace_s = 3.0;        // SIGTERM, then SIGKILL after this long
  double coordinator_grace_s = 60.0;  // workers keep running this long while the coordinator is away
  bool keep_gpus_attached = true;   // hold /dev/nvidiaN open while running (gpu_attachment.h)
  SecurityMaterial security;        // how to reach the coordinator (TLS, client certificate, token)
  std::string leave_reason = "its agent was shut down";
};

class Agent {
 public:
  static StatusOr<std::unique_ptr<Agent>> Start(AgentOptions options,
                                                std::unique_ptr<ProcessSpawner> spawner = nullptr);
  virtual ~Agent() = default;
  virtual void Wait() = 0;      // until Shutdown
  virtual void Shutdown() = 0;  // stops every worker (SIGTERM, SIGKILL after the grace), then returns
};

// ltrain-worker beside the running executable, or $LTRAIN_WORKER_BIN.
std::string DefaultWorkerBinary();
// The GPUs this machine has, as their device files (/dev/nvidia0, /dev/nvidia1, ...) say: what an agent
// reports, and what a cuda job needs more than none of.
int LocalGpuCount();

}  // namespace ltrain::agent
