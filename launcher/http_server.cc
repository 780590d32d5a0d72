#include "launcher/http_server.h"

#include <microhttpd.h>
#include <netdb.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/logging.h"

#include "launcher/dashboard_page.h"
#include "launcher/metrics.h"
#include "launcher/state_store.h"

namespace ltrain::launcher {

namespace {

constexpr int kMetricsJobs = 200;

bool Final(v1::JobState state) {
  return state == v1::JOB_STATE_SUCCEEDED || state == v1::JOB_STATE_FAILED || state == v1::JOB_STATE_STOPPED;
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
          {"recoveries", job.recoveries()},
          {"lost_steps", job.lost_steps()},
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
  return PrometheusText(jobs, coordinator.ListNodes()) +
         ServerFiguresText(coordinator.rpc_figures(), coordinator.writer_figures(), coordinator.held_figures());
}

namespace {

// Where the server listens: a socket of its own, bound and listening before the daemon takes it,
// so that the port is known and a bind failure is said plainly.
StatusOr<std::pair<int, int>> ListenSocket(const std::string& listen) {
  const size_t colon = listen.rfind(':');
  if (colon == std::string::npos || colon == 0) return InvalidArgument("--http-listen " + listen + ": expected HOST:PORT");
  std::string host = listen.substr(0, colon);
  if (host.size() > 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  const std::string port_text = listen.substr(colon + 1);
  char* end = nullptr;
  const long port = std::strtol(port_text.c_str(), &end, 10);
  if (port_text.empty() || *end != '\0' || port < 0 || port > 65535) {
    return InvalidArgument("--http-listen " + listen + ": the port is not a number from 0 to 65535");
  }
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  if (int rc = getaddrinfo(host.c_str(), port_text.c_str(), &hints, &found); rc != 0) {
    return InvalidArgument("--http-listen " + listen + ": " + gai_strerror(rc));
  }
  std::unique_ptr<addrinfo, decltype(&freeaddrinfo)> owner(found, freeaddrinfo);
  std::string why = "no address";
  for (addrinfo* a = found; a != nullptr; a = a->ai_next) {
    const int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    const int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    sockaddr_storage bound{};
    socklen_t length = sizeof(bound);
    if (::bind(fd, a->ai_addr, a->ai_addrlen) == 0 && ::listen(fd, 256) == 0 &&
        ::getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &length) == 0) {
      const int chosen = bound.ss_family == AF_INET6 ? ntohs(reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port)
                                                     : ntohs(reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
      return std::pair<int, int>{fd, chosen};
    }
    why = std::strerror(errno);
    ::close(fd);
  }
  return Unavailable("cannot listen for HTTP on " + listen + ": " + why + " (in use, or not an address of this host)");
}

void LogFromDaemon(void*, const char* format, va_list args) {
  char line[512];
  std::vsnprintf(line, sizeof(line), format, args);
  std::string text(line);
  while (!text.empty() && text.back() == '\n') text.pop_back();
  LTRAIN_LOG(kDebug, "http") << text;
}

bool JobIdText(std::string_view id) {
  return !id.empty() && id.size() <= 200 && std::all_of(id.begin(), id.end(), [](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == '-';
  });
}

std::string Header(MHD_Connection* connection, enum MHD_ValueKind kind, const char* name) {
  const char* value = MHD_lookup_connection_value(connection, kind, name);
  return value == nullptr ? std::string() : std::string(value);
}

MHD_Result Respond(MHD_Connection* connection, unsigned status, const std::string& body, const char* type,
                   const std::vector<std::pair<std::string, std::string>>& headers = {}) {
  MHD_Response* response =
      MHD_create_response_from_buffer(body.size(), const_cast<char*>(body.data()), MHD_RESPMEM_MUST_COPY);
  if (response == nullptr) return MHD_NO;
  MHD_add_response_header(response, "Content-Type", type);
  // The page's address never travels to another site, nothing is cached, nothing is framed.
  MHD_add_response_header(response, "Referrer-Policy", "no-referrer");
  MHD_add_response_header(response, "Cache-Control", "no-store");
  MHD_add_response_header(response, "X-Content-Type-Options", "nosniff");
  MHD_add_response_header(response, "X-Frame-Options", "DENY");
  for (const auto& [name, value] : headers) MHD_add_response_header(response, name.c_str(), value.c_str());
  const MHD_Result queued = MHD_queue_response(connection, status, response);
  MHD_destroy_response(response);
  return queued;
}

}  // namespace

// The daemon's access handler: every request, on the daemon's threads, once its headers are in.
struct HttpServer::Handler {
  static MHD_Result Answer(void* self, MHD_Connection* connection, const char* url, const char* method, const char*,
                           const char*, size_t*, void**) {
    return Serve(*static_cast<HttpServer*>(self), connection, url, method);
  }
  static MHD_Result Serve(HttpServer& self, MHD_Connection* connection, const std::string& url,
                          const std::string& method);
};

HttpServer::HttpServer(Coordinator* coordinator, const HttpServerOptions& options)
    : coordinator_(coordinator),
      access_(clock_, options.token, options.metrics_token),
      host_names_(options.host_names),
      cert_pem_(options.cert_pem),
      key_pem_(options.key_pem) {
  char name[256] = {0};
  ::gethostname(name, sizeof(name) - 1);
  hostname_ = name;
}

MHD_Result HttpServer::Handler::Serve(HttpServer& self, MHD_Connection* connection, const std::string& url,
                                     const std::string& method) {
  constexpr const char* kText = "text/plain; charset=utf-8";
  constexpr const char* kJson = "application/json";
  if (!HostAllowed(Header(connection, MHD_HEADER_KIND, "Host"), self.hostname_, self.host_names_)) {
    return Respond(connection, 421, "this coordinator does not answer to that Host name: reach it by its address, "
                                    "localhost or its host name (--http-host NAME adds a name)\n", kText);
  }
  if (method != "GET" && method != "HEAD") {
    return Respond(connection, 405, "only GET and HEAD\n", kText, {{"Allow", "GET, HEAD"}});
  }
  if (url == "/login") {
    const std::string job = Header(connection, MHD_GET_ARGUMENT_KIND, "job");
    std::optional<std::string> session = self.access_.Redeem(Header(connection, MHD_GET_ARGUMENT_KIND, "code"));
    if (!session) {
      return Respond(connection, 401, "this login link was used already or has expired (links work once, within 10 "
                                      "minutes): `ltrain dashboard` prints a new one\n", kText);
    }
    std::string cookie = std::string(DashboardAccess::kSessionCookie) + "=" + *session +
                         "; Path=/; HttpOnly; SameSite=Strict; Max-Age=" +
                         std::to_string(DashboardAccess::kSessionTtlMs / 1000) + (self.https_ ? "; Secure" : "");
    return Respond(connection, 303, "", kText,
                   {{"Set-Cookie", cookie}, {"Location", JobIdText(job) ? "/#job=" + job : "/"}});
  }
  const DashboardAccess::Scope scope =
      self.access_.Grant(Header(connection, MHD_HEADER_KIND, "Authorization"), Header(connection, MHD_HEADER_KIND, "Cookie"));
  if (url == "/metrics") {
    if (scope == DashboardAccess::Scope::kNone) {
      return Respond(connection, 401, "this coordinator's metrics need its read-only metrics token: Authorization: "
                                      "Bearer TOKEN (the coordinator names its file at start)\n",
                     kText, {{"WWW-Authenticate", "Bearer"}});
    }
    return Respond(connection, 200, MetricsPage(*self.coordinator_), "text/plain; version=0.0.4; charset=utf-8");
  }
  if (scope != DashboardAccess::Scope::kRead) {
    return Respond(connection, 401, "this coordinator's dashboard needs a login: `ltrain dashboard` prints a one-time "
                                    "link\n", kText, {{"WWW-Authenticate", "Bearer"}});
  }
  if (url == "/") return Respond(connection, 200, kDashboardPage, "text/html; charset=utf-8");
  if (url == "/api/jobs") return Respond(connection, 200, JobsJson(*self.coordinator_), kJson);
  constexpr std::string_view kJobPath = "/api/jobs/";
  if (url.rfind(kJobPath, 0) == 0 && JobIdText(std::string_view(url).substr(kJobPath.size()))) {
    StatusOr<std::string> job = JobJson(*self.coordinator_, url.substr(kJobPath.size()));
    if (!job.ok()) return Respond(connection, 404, nlohmann::json({{"error", job.status().message()}}).dump(), kJson);
    return Respond(connection, 200, *job, kJson);
  }
  return Respond(connection, 404, "not found\n", kText);
}

StatusOr<std::unique_ptr<HttpServer>> HttpServer::Start(const HttpServerOptions& options, Coordinator* coordinator) {
  if (options.token.empty()) return InvalidArgument("the HTTP side needs the coordinator's token");
  LTRAIN_ASSIGN_OR_RETURN(auto listening, ListenSocket(options.listen));
  std::unique_ptr<HttpServer> http(new HttpServer(coordinator, options));
  http->port_ = listening.second;
  http->https_ = !options.cert_pem.empty() && !options.key_pem.empty();
  // A connection costs a descriptor: as many as the system lets this process have.
  rlimit files{};
  unsigned limit = kMaxConnections;
  if (::getrlimit(RLIMIT_NOFILE, &files) == 0) {
    if (files.rlim_cur < files.rlim_max) {
      files.rlim_cur = files.rlim_max;
      ::setrlimit(RLIMIT_NOFILE, &files);
      ::getrlimit(RLIMIT_NOFILE, &files);
    }
    limit = static_cast<unsigned>(std::min<rlim_t>(limit, files.rlim_cur / 4));
  }
  unsigned flags = MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_EPOLL;
  if (http->https_) flags |= MHD_USE_TLS;
  std::vector<MHD_OptionItem> items = {
      {MHD_OPTION_LISTEN_SOCKET, listening.first, nullptr},
      {MHD_OPTION_THREAD_POOL_SIZE, 2, nullptr},
      {MHD_OPTION_CONNECTION_LIMIT, static_cast<intptr_t>(limit), nullptr},
      {MHD_OPTION_CONNECTION_TIMEOUT, kIdleTimeoutS, nullptr},
      {MHD_OPTION_EXTERNAL_LOGGER, reinterpret_cast<intptr_t>(&LogFromDaemon), nullptr},
  };
  if (http->https_) {
    items.push_back({MHD_OPTION_HTTPS_MEM_KEY, 0, const_cast<char*>(http->key_pem_.c_str())});
    items.push_back({MHD_OPTION_HTTPS_MEM_CERT, 0, const_cast<char*>(http->cert_pem_.c_str())});
  }
  items.push_back({MHD_OPTION_END, 0, nullptr});
  http->daemon_ = MHD_start_daemon(flags | MHD_USE_ERROR_LOG, 0, nullptr, nullptr, &Handler::Answer, http.get(),
                                   MHD_OPTION_ARRAY, items.data(), MHD_OPTION_END);
  if (http->daemon_ == nullptr) {
    ::close(listening.first);
    return Unavailable("cannot serve HTTP" + std::string(http->https_ ? "S" : "") + " on " + options.listen +
                       (http->https_ ? " (is --tls-cert/--tls-key a certificate and key GnuTLS reads?)" : ""));
  }
  return http;
}

std::string HttpServer::LoginLink(const std::string& host, const std::string& job_id) {
  std::string link = std::string(https_ ? "https://" : "http://") + host + ":" + std::to_string(port_) +
                     "/login?code=" + access_.NewLoginCode();
  if (JobIdText(job_id)) link += "&job=" + job_id;
  return link;
}

HttpServer::~HttpServer() {
  if (daemon_ != nullptr) MHD_stop_daemon(daemon_);
}

}  // namespace ltrain::launcher
