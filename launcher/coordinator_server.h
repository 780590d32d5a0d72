// The coordinator's gRPC server: JobService, AgentService and RendezvousService over one
// Coordinator, plus grpc.health.v1. Owns a monitor thread that checks node heartbeats.
#pragma once

#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "common/clock.h"
#include "common/status.h"
#include "common/transport_security.h"
#include "launcher/coordinator.h"
#include "launcher/http_server.h"
#include "launcher/state_store.h"

namespace ltrain::launcher {

struct CoordinatorServerOptions {
  std::string listen_address = "127.0.0.1:0";  // port 0 picks a free port
  std::string state_dir;                        // holds state.db and default checkpoints
  int64_t node_timeout_ms = 3000;
  int64_t recovery_grace_ms = 15000;
  int64_t rendezvous_answer_delay_ms = 0;  // see CoordinatorOptions::rendezvous_answer_delay_ms
  int64_t retain_ms = 30LL * 24 * 3600 * 1000;  // see CoordinatorOptions::retain_ms
  int64_t state_max_bytes = 0;                  // a cap on state.db; 0: none
  // Take back the unfinished jobs found in the state directory. A standalone launch does not: the
  // jobs there may belong to other launches that are still running.
  bool recover = true;
  SecurityMaterial security;  // TLS (server certificate, optional client CA) and the bearer token
  std::string http_listen;    // HOST:PORT of GET /metrics (http_server.h); empty: no HTTP
  std::string metrics_token;  // the HTTP side's read-only token for /metrics; empty: none
  std::vector<std::string> http_host_names;  // HttpServerOptions::host_names
  bool show_events_once_stored = false;  // see CoordinatorOptions
  std::string state_name;                // see CoordinatorOptions
  // Said in every GetJob, ListJobs and ListNodes reply (it serves in clear text beyond loopback).
  std::string warning;
};

class WriteStarter;

class CoordinatorServer {
 public:
  // With `store`, the state is kept there (an etcd cluster's); without, in SQLite under state_dir.
  static StatusOr<std::unique_ptr<CoordinatorServer>> Start(const CoordinatorServerOptions& options,
                                                            std::unique_ptr<StateStore> store = nullptr);
  ~CoordinatorServer();

  int port() const { return port_; }
  int http_port() const { return http_ ? http_->port() : 0; }  // 0 without --http-listen
  // The dashboard's one-time login link (HttpServer::LoginLink) at the address the HTTP side
  // listens on (a wildcard one named by this host's name); FailedPrecondition without HTTP.
  StatusOr<std::string> DashboardLink(const std::string& job_id);
  std::string address() const;  // host:port clients dial
  Coordinator& coordinator() { return *coordinator_; }
  StateStore& store() { return *store_; }
  void Wait();                    // until Shutdown from another thread
  void Shutdown();

 private:
  CoordinatorServer() = default;

  RealClock clock_;
  std::unique_ptr<StateStore> store_;
  std::unique_ptr<Coordinator> coordinator_;
  // The command streams' write starts (coordinator_server.cc); it outlives the services and server.
  std::unique_ptr<WriteStarter> write_starter_;
  std::unique_ptr<grpc::Service> job_service_, agent_service_, rendezvous_service_, health_service_;
  std::unique_ptr<grpc::Server> server_;
  std::mutex http_mu_;  // DashboardLink (RPC threads) against Shutdown's reset of http_
  std::unique_ptr<HttpServer> http_;
  std::string host_;
  std::string http_host_;  // how clients reach the HTTP side
  int port_ = 0;
  std::atomic<bool> stopping_{false};
  std::once_flag shutdown_once_;
  std::thread monitor_;
};

// Opens the SQLite state under `state_dir` (created if needed), capped at `max_bytes` when > 0.
StatusOr<std::unique_ptr<StateStore>> OpenStateStore(const std::string& state_dir, int64_t max_bytes = 0);

}  // namespace ltrain::launcher
