#include "launcher/http_server.h"

#include <httplib.h>

#include <exception>
#include <stdexcept>
#include <string_view>
#include <vector>

#include "launcher/metrics.h"

namespace ltrain::launcher {

namespace {

constexpr int kMetricsJobs = 200;

bool Final(v1::JobState state) {
  return state == v1::JOB_STATE_SUCCEEDED || state == v1::JOB_STATE_FAILED || state == v1::JOB_STATE_STOPPED;
}

// Compares without stopping at the first difference, so that the time taken tells nothing of the token.
bool SameToken(const std::string& given, const std::string& token) {
  unsigned char diff = given.size() == token.size() ? 0 : 1;
  for (size_t i = 0; i < given.size(); ++i) {
    diff |= static_cast<unsigned char>(given[i] ^ token[i % (token.empty() ? 1 : token.size())]);
  }
  return diff == 0 && !token.empty();
}

}  // namespace

std::string MetricsPage(Coordinator& coordinator) {
  std::vector<v1::Job> jobs;
  if (StatusOr<std::vector<v1::Job>> listed = coordinator.ListJobs(kMetricsJobs); listed.ok()) {
    for (v1::Job& job : *listed) {
      if (!Final(job.state())) {
        // With its ranks' progress.
        if (StatusOr<v1::Job> full = coordinator.GetJob(job.id()); full.ok()) job = std::move(*full);
      }
      jobs.push_back(std::move(job));
    }
  }
  return PrometheusText(jobs, coordinator.ListNodes());
}

StatusOr<std::unique_ptr<HttpServer>> HttpServer::Start(const std::string& listen, Coordinator* coordinator,
                                                         const std::string& token) {
  const size_t colon = listen.rfind(':');
  if (colon == std::string::npos || colon == 0) return InvalidArgument("--http-listen " + listen + ": expected HOST:PORT");
  std::string host = listen.substr(0, colon);
  if (host.size() > 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  int port = 0;
  try {
    size_t used = 0;
    port = std::stoi(listen.substr(colon + 1), &used);
    if (used != listen.size() - colon - 1 || port < 0 || port > 65535) throw std::out_of_range("port");
  } catch (const std::exception&) {
    return InvalidArgument("--http-listen " + listen + ": the port is not a number from 0 to 65535");
  }

  std::unique_ptr<HttpServer> http(new HttpServer());
  http->server_ = std::make_unique<httplib::Server>();
  httplib::Server& server = *http->server_;
  if (!token.empty()) {
    server.set_pre_routing_handler([token](const httplib::Request& request, httplib::Response& response) {
      const std::string header = request.get_header_value("Authorization");
      constexpr std::string_view kBearer = "Bearer ";
      if (header.compare(0, kBearer.size(), kBearer) == 0 && SameToken(header.substr(kBearer.size()), token)) {
        return httplib::Server::HandlerResponse::Unhandled;
      }
      response.status = 401;
      response.set_header("WWW-Authenticate", "Bearer");
      response.set_content("this coordinator needs its token: Authorization: Bearer TOKEN\n", "text/plain");
      return httplib::Server::HandlerResponse::Handled;
    });
  }
  server.Get("/metrics", [coordinator](const httplib::Request&, httplib::Response& response) {
    response.set_content(MetricsPage(*coordinator), "text/plain; version=0.0.4; charset=utf-8");
  });
  server.Get("/", [](const httplib::Request&, httplib::Response& response) {
    response.set_content("ltrain coordinator: /metrics (Prometheus)\n", "text/plain; charset=utf-8");
  });

  if (port == 0) {
    port = server.bind_to_any_port(host);
    if (port < 0) return Unavailable("cannot listen for HTTP on " + host + ": no free port");
  } else if (!server.bind_to_port(host, port)) {
    return Unavailable("cannot listen for HTTP on " + listen + " (in use, or not an address of this host)");
  }
  http->port_ = port;
  http->thread_ = std::thread([&server] { server.listen_after_bind(); });
  return http;
}

HttpServer::~HttpServer() {
  if (server_) server_->stop();
  if (thread_.joinable()) thread_.join();
}

}  // namespace ltrain::launcher
