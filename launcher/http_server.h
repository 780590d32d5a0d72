// The coordinator's HTTP side (`ltrain coordinator --http-listen HOST:PORT`, `ltrain launch
// --http-listen`): GET /metrics in Prometheus' text format (metrics.h), and the dashboard: GET / (one
// page, dashboard_page.h) over GET /api/jobs and /api/jobs/ID (JSON), opened through GET
// /login?code=CODE (DashboardAccess says who may read what; no token ever travels in an address).
// HTTPS with the coordinator's certificate whenever it has one. Every answer carries
// Referrer-Policy: no-referrer and no-store; a Host header that does not name this coordinator is
// refused (421), as is every method but GET and HEAD (405).
//
// Served by GNU libmicrohttpd (Debian's libmicrohttpd) on an epoll loop of its own threads: a
// connection holds no thread, so slow or idle clients (a slowloris' trickled headers, half-open
// sockets) starve nobody; each is closed after 10 s without a byte, and the server holds at most
// kMaxConnections. Handlers run on those threads and call the Coordinator, which is thread-safe.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "common/clock.h"
#include "common/status.h"
#include "launcher/coordinator.h"
#include "launcher/dashboard_access.h"

struct MHD_Daemon;

namespace ltrain::launcher {

struct HttpServerOptions {
  std::string listen;         // HOST:PORT; port 0 picks a free one
  std::string token;          // the control-plane token: reads everything
  std::string metrics_token;  // read-only: /metrics alone (may be empty: none)
  std::string cert_pem;       // with key_pem: HTTPS
  std::string key_pem;
  std::vector<std::string> host_names;  // names the Host header may give besides addresses, localhost and this host
};

class HttpServer {
 public:
  static constexpr unsigned kMaxConnections = 2048;
  static constexpr unsigned kIdleTimeoutS = 10;

  // `coordinator` must outlive the server.
  static StatusOr<std::unique_ptr<HttpServer>> Start(const HttpServerOptions& options, Coordinator* coordinator);
  ~HttpServer();  // stops serving; requests under way finish first
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  int port() const { return port_; }
  bool https() const { return https_; }
  // The dashboard's one-time login link, `http(s)://HOST:PORT/login?code=...` (`host`: how clients
  // reach this server), with `#job=ID` when a job is given.
  std::string LoginLink(const std::string& host, const std::string& job_id);

 private:
  HttpServer(Coordinator* coordinator, const HttpServerOptions& options);
  struct Handler;

  Coordinator* coordinator_;
  RealClock clock_;
  DashboardAccess access_;
  std::vector<std::string> host_names_;
  std::string hostname_;
  std::string cert_pem_, key_pem_;  // held for the daemon, which reads them in place
  MHD_Daemon* daemon_ = nullptr;
  int port_ = 0;
  bool https_ = false;
};

// The /metrics page of `coordinator` now: its jobs (at most the 200 newest; those not final with
// their ranks) and nodes.
std::string MetricsPage(Coordinator& coordinator);
// The dashboard's data: GET /api/jobs (the 200 newest jobs, a summary each) and GET /api/jobs/ID
// (the summary with its ranks, nodes, curves, newest events and log lines).
std::string JobsJson(Coordinator& coordinator);
StatusOr<std::string> JobJson(Coordinator& coordinator, const std::string& job_id);

}  // namespace ltrain::launcher
