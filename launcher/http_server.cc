#include "launcher/http_server.h"

#include <httplib.h>

#include <exception>
#include <stdexcept>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "launcher/dashboard_page.h"
#include "launcher/metrics.h"
#include "launcher/state_store.h"

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

nlohmann::json JobSummary(const v1::Job& job) {
  return {{"id", job.id()},
          {"name", job.name()},
          {"state", JobStateName(job.state())},
          {"step", job.last_step()},
          {"total_steps", job.total_steps()},
          {"loss", job.last_loss()},
          {"val_step", job.val_step()},
          {"val_loss", job.val_loss()},
          {"tokens_per_s", Final(job.state()) ? 0.0 : job.tokens_per_s()},
          {"mfu", job.mfu()},
          {"checkpoint_save_s", job.checkpoint_save_ms() / 1000.0},
          {"checkpoint_load_s", job.checkpoint_load_ms() / 1000.0},
          {"eta_s", Final(job.state()) ? 0.0 : job.eta_s()},
          {"restarts", job.restarts()},
          {"generation", job.generation()},
          {"world_size", job.world_size()},
          {"committed_step", job.last_committed_step()},
          {"last_failure", job.last_failure()},
          {"cause", job.cause()}};
}

}  // namespace

std::string JobsJson(Coordinator& coordinator) {
  nlohmann::json jobs = nlohmann::json::array();
  if (StatusOr<std::vector<v1::Job>> listed = coordinator.ListJobs(kMetricsJobs); listed.ok()) {
    for (const v1::Job& job : *listed) jobs.push_back(JobSummary(job));
  }
  return jobs.dump();
}

StatusOr<std::string> JobJson(Coordinator& coordinator, const std::string& job_id) {
  LTRAIN_ASSIGN_OR_RETURN(v1::Job job, coordinator.GetJob(job_id));
  nlohmann::json out = JobSummary(job);
  nlohmann::json ranks = nlohmann::json::array();
  for (const v1::RankInfo& rank : job.ranks()) {
    ranks.push_back({{"rank", rank.rank()},
                     {"node", rank.node_id()},
                     {"state", rank.state()},
                     {"step", rank.last_step()},
                     {"phase", rank.phase()},
                     {"progress_age_s", rank.progress_age_ms() / 1000.0},
                     {"compute_ms", rank.compute_ms()},
                     {"memory_bytes", rank.memory_bytes()},
                     {"straggler", rank.straggler()},
                     {"work", rank.work()}});
  }
  out["ranks"] = std::move(ranks);
  nlohmann::json nodes = nlohmann::json::array();
  for (const v1::NodeStatus& node : job.nodes()) {
    nodes.push_back({{"node", node.node_id()},
                     {"connected", node.connected()},
                     {"heartbeat_age_s", node.heartbeat_age_ms() / 1000.0}});
  }
  out["nodes"] = std::move(nodes);
  // Curves, events and the log tail while the coordinator holds the job in memory; none after.
  nlohmann::json steps = nlohmann::json::array(), val = nlohmann::json::array();
  if (StatusOr<JobSeries> series = coordinator.Series(job_id); series.ok()) {
    for (const SeriesPoint& p : series->steps) steps.push_back({p.step, p.unix_ms, p.loss, p.tokens_per_s, p.step_ms, p.mfu});
    for (const ValPoint& p : series->val) val.push_back({p.step, p.val_loss});
  }
  out["series"] = {{"steps", std::move(steps)}, {"val", std::move(val)}};
  nlohmann::json events = nlohmann::json::array(), logs = nlohmann::json::array();
  if (StatusOr<std::vector<v1::Event>> recent = coordinator.RecentEvents(job_id, 50, 100); recent.ok()) {
    for (const v1::Event& event : *recent) {
      nlohmann::json entry = {{"unix_ms", event.unix_ms()}, {"kind", event.kind()}, {"rank", event.rank()},
                              {"message", event.message()}};
      (event.kind() == "log" ? logs : events).push_back(std::move(entry));
    }
  }
  out["events"] = std::move(events);
  out["logs"] = std::move(logs);
  // Log lines are the workers' bytes: what is not UTF-8 is replaced rather than refused.
  return out.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

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
      // A browser opening the dashboard cannot send a header: the page's address carries the token.
      if (request.has_param("token") && SameToken(request.get_param_value("token"), token)) {
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
    response.set_content(kDashboardPage, "text/html; charset=utf-8");
  });
  server.Get("/api/jobs", [coordinator](const httplib::Request&, httplib::Response& response) {
    response.set_content(JobsJson(*coordinator), "application/json");
  });
  server.Get(R"(/api/jobs/([A-Za-z0-9._-]+))", [coordinator](const httplib::Request& request, httplib::Response& response) {
    StatusOr<std::string> job = JobJson(*coordinator, request.matches[1]);
    if (!job.ok()) {
      response.status = 404;
      response.set_content(nlohmann::json({{"error", job.status().message()}}).dump(), "application/json");
      return;
    }
    response.set_content(*job, "application/json");
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
