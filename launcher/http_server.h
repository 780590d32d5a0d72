// The coordinator's HTTP side (`ltrain coordinator --http-listen HOST:PORT`, `ltrain launch
// --http-listen`): GET /metrics in Prometheus' text format (metrics.h), and the dashboard: GET / (one
// page, dashboard_page.h) over GET /api/jobs and /api/jobs/ID (JSON). Served by cpp-httplib
// (Debian's libcpp-httplib) on threads of its own. When the coordinator has a bearer token, every
// request must carry it ("Authorization: Bearer TOKEN", or `?token=TOKEN` in the address, which is
// how a browser opens the dashboard), as every RPC does; the answer to one that does not is 401. Plain HTTP: where the RPCs use TLS, keep the HTTP port on loopback or behind a
// proxy that terminates TLS.
#pragma once

#include <memory>
#include <string>
#include <thread>

#include "common/status.h"
#include "launcher/coordinator.h"

namespace httplib {
class Server;
}

namespace ltrain::launcher {

class HttpServer {
 public:
  // `listen`: HOST:PORT (port 0 picks a free one). `coordinator` must outlive the server.
  static StatusOr<std::unique_ptr<HttpServer>> Start(const std::string& listen, Coordinator* coordinator,
                                                     const std::string& token);
  ~HttpServer();  // stops serving; requests under way finish first
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  int port() const { return port_; }

 private:
  HttpServer() = default;

  std::unique_ptr<httplib::Server> server_;
  int port_ = 0;
  std::thread thread_;
};

// The /metrics page of `coordinator` now: its jobs (at most the 200 newest; those not final with
// their ranks) and nodes.
std::string MetricsPage(Coordinator& coordinator);
// The dashboard's data: GET /api/jobs (the 200 newest jobs, a summary each) and GET /api/jobs/ID
// (the summary with its ranks, nodes, curves, newest events and log lines).
std::string JobsJson(Coordinator& coordinator);
StatusOr<std::string> JobJson(Coordinator& coordinator, const std::string& job_id);

}  // namespace ltrain::launcher
