// The control plane at cluster scale: N simulated agents against one real `ltrain coordinator`
// process on loopback. Each agent speaks the real protocol with gRPC's callback client API (no
// thread per agent here either): it registers through Connect, keeps the command stream open and
// heartbeats every --heartbeat-ms, each on its own connection. Printed per N: registration time, the
// heartbeat RPC latency (p50, p99, max), the coordinator's CPU (share of one core), memory and threads
// while the agents heartbeat, and the time to detect a node whose heartbeats stop.
//
//   scale_bench --ltrain build/cmd/ltrain --agents 100,1000,10000 --seconds 20 [--state etcd://127.0.0.1:2379]
#include <signal.h>
#include <sys/stat.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "common/mutex_tracking.h"
#include "common/transport_security.h"
#include "ltrain/v1/ltrain.grpc.pb.h"
#include "tests/support/http_get.h"
#include "tests/support/prometheus_text.h"
#include "tests/support/simulated_agent.h"
#include "tests/support/subprocess.h"

namespace ltrain::bench {
namespace {

using Clock = std::chrono::steady_clock;
using testing::Agent;
using testing::MsSince;
using testing::NewChannel;
using testing::Subprocess;
using testing::TempDir;


// /proc/PID figures of the coordinator.
struct ProcessFigures {
  double cpu_s = 0;     // user + system
  int64_t rss_kb = 0;
  int threads = 0;
};

ProcessFigures ReadProcess(pid_t pid) {
  ProcessFigures f;
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string text((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
  // Fields after the command's closing parenthesis: state is field 3, utime 14, stime 15.
  const size_t close = text.rfind(')');
  if (close != std::string::npos) {
    std::istringstream rest(text.substr(close + 2));
    std::string field;
    long long utime = 0, stime = 0;
    for (int i = 3; i <= 15 && rest >> field; ++i) {
      if (i == 14) utime = std::stoll(field);
      if (i == 15) stime = std::stoll(field);
    }
    f.cpu_s = static_cast<double>(utime + stime) / static_cast<double>(::sysconf(_SC_CLK_TCK));
  }
  std::ifstream status("/proc/" + std::to_string(pid) + "/status");
  for (std::string line; std::getline(status, line);) {
    if (line.rfind("VmRSS:", 0) == 0) f.rss_kb = std::stoll(line.substr(6));
    if (line.rfind("Threads:", 0) == 0) f.threads = std::stoi(line.substr(8));
  }
  return f;
}

// Latencies in ms, from many threads.
class Latencies {
 public:
  void Add(double ms) {
    std::lock_guard<std::mutex> lock(mu_);
    values_.push_back(ms);
  }
  void Clear() {
    std::lock_guard<std::mutex> lock(mu_);
    values_.clear();
  }
  std::vector<double> Sorted() {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<double> out = values_;
    std::sort(out.begin(), out.end());
    return out;
  }

 private:
  std::mutex mu_;
  std::vector<double> values_;
};

double Percentile(const std::vector<double>& sorted, double p) {
  if (sorted.empty()) return 0;
  return sorted[std::min(sorted.size() - 1, static_cast<size_t>(p * static_cast<double>(sorted.size())))];
}

// How late this process's threads wake: a thread asks for 10 ms sleeps and records how much longer
// each took. The simulated agents share the cores with the coordinator; when this process lags, its
// figures are bounded by its own clients, not by the coordinator.
class LagProbe {
 public:
  LagProbe() : thread_([this] { Run(); }) {}
  ~LagProbe() {
    stop_ = true;
    thread_.join();
  }
  void Reset() {
    std::lock_guard<std::mutex> lock(mu_);
    late_ms_.clear();
    since_ = Clock::now();
  }
  // "p50 X ms, p99 Y ms, max Z ms late per 10 ms sleep; W ms late a second in all"
  std::string Describe() {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<double> sorted = late_ms_;
    std::sort(sorted.begin(), sorted.end());
    double sum = 0;
    for (double v : sorted) sum += v;
    const double seconds = std::max(1e-3, MsSince(since_) / 1000.0);
    char text[256];
    std::snprintf(text, sizeof(text), "a 10 ms sleep woke late by p50 %.2f ms, p99 %.2f ms, max %.1f ms; %.0f ms late a second%s",
                  Percentile(sorted, 0.5), Percentile(sorted, 0.99), sorted.empty() ? 0.0 : sorted.back(), sum / seconds,
                  Percentile(sorted, 0.99) > 20 ? " (the bench's clients are a bottleneck: its figures bound the coordinator's from above)" : "");
    return text;
  }
  double P99() {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<double> sorted = late_ms_;
    std::sort(sorted.begin(), sorted.end());
    return Percentile(sorted, 0.99);
  }

 private:
  void Run() {
    while (!stop_) {
      const auto start = Clock::now();
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
      const double late = std::max(0.0, MsSince(start) - 10.0);
      std::lock_guard<std::mutex> lock(mu_);
      late_ms_.push_back(late);
    }
  }
  std::mutex mu_;
  std::vector<double> late_ms_;
  Clock::time_point since_ = Clock::now();
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

struct Options {
  std::string ltrain;
  std::vector<int> agents = {100, 1000};
  double seconds = 15;
  int heartbeat_ms = 1000;
  double node_timeout_s = 3;
  // Agents that share one connection: 1 is what separate hosts do; more spares this process's CPU
  // (on the same cores as the coordinator) at 10,000 agents.
  int agents_per_connection = 1;
  // etcd://HOST:PORT,...: the coordinator keeps its state there (each run under a prefix of its own)
  // instead of in SQLite.
  std::string state;
  // Each simulated rank asks the coordinator itself (--get-per-rank), instead of its agent asking once
  // for all of the node's ranks, as the real agent does.
  bool get_per_rank = false;
};

constexpr const char* kMetricsToken = "scale-bench-metrics-token";

// The coordinator's own figures from its /metrics (rpc_figures.h): by RPC kind, calls, seconds in
// its handlers and the longest; and its state writer's.
struct CoordinatorTime {
  std::map<std::string, std::array<double, 3>> rpc;  // kind -> calls, seconds, longest
  double writes = 0, write_batches = 0, write_seconds = 0, queued = 0;
  // What it holds in memory (HeldFigures).
  double jobs_held = 0, rank_records = 0, folded_rank_bytes = 0, nodes_held = 0, rendezvous_keys = 0;
  bool read = false;
};

CoordinatorTime ScrapeCoordinator(int http_port) {
  CoordinatorTime t;
  const auto [code, body] = testing::HttpGet(http_port, "/metrics", kMetricsToken);
  if (code != 200) return t;
  const testing::PrometheusParse parse = testing::ParsePrometheusText(body);
  for (const testing::PrometheusSample& sample : parse.samples) {
    const auto kind = sample.labels.find("rpc");
    if (sample.name == "ltrain_coordinator_rpc_calls_total" && kind != sample.labels.end()) t.rpc[kind->second][0] = sample.value;
    if (sample.name == "ltrain_coordinator_rpc_seconds_total" && kind != sample.labels.end()) t.rpc[kind->second][1] = sample.value;
    if (sample.name == "ltrain_coordinator_rpc_seconds_max" && kind != sample.labels.end()) t.rpc[kind->second][2] = sample.value;
    if (sample.name == "ltrain_coordinator_state_writes_total") t.writes = sample.value;
    if (sample.name == "ltrain_coordinator_state_write_batches_total") t.write_batches = sample.value;
    if (sample.name == "ltrain_coordinator_state_write_seconds_total") t.write_seconds = sample.value;
    if (sample.name == "ltrain_coordinator_state_writes_queued") t.queued = sample.value;
    if (sample.name == "ltrain_coordinator_jobs_held") t.jobs_held = sample.value;
    if (sample.name == "ltrain_coordinator_rank_records_held") t.rank_records = sample.value;
    if (sample.name == "ltrain_coordinator_folded_rank_bytes") t.folded_rank_bytes = sample.value;
    if (sample.name == "ltrain_coordinator_nodes_held") t.nodes_held = sample.value;
    if (sample.name == "ltrain_coordinator_rendezvous_keys") t.rendezvous_keys = sample.value;
  }
  t.read = true;
  return t;
}

// What the coordinator's own time was between two scrapes, over `seconds`: per RPC kind with calls,
// the calls a second, the mean handling time and the longest call so far; the state writer's.
void PrintCoordinatorTime(int n, const char* when, const CoordinatorTime& a, const CoordinatorTime& b, double seconds) {
  if (!a.read || !b.read) {
    std::printf("agents %d: %s: the coordinator's /metrics could not be read\n", n, when);
    return;
  }
  double busy = 0;
  for (const auto& [kind, figures] : b.rpc) {
    const auto before = a.rpc.count(kind) ? a.rpc.at(kind) : std::array<double, 3>{0, 0, 0};
    const double calls = figures[0] - before[0], spent = figures[1] - before[1];
    if (calls <= 0) continue;
    if (kind != "KvGetAnswered") busy += spent;
    std::printf("agents %d: %s: coordinator %-17s %9.0f calls (%7.0f/s), handler mean %.3f ms, longest so far %.1f ms\n", n,
                when, kind.c_str(), calls, calls / seconds, 1000.0 * spent / calls, 1000.0 * figures[2]);
  }
  std::printf("agents %d: %s: coordinator handlers busy %.0f%% of a core; state writer %.0f writes in %.0f transactions, "
              "%.2f s (%.0f%% of a core), %.0f queued\n",
              n, when, 100.0 * busy / seconds, b.writes - a.writes, b.write_batches - a.write_batches,
              b.write_seconds - a.write_seconds, 100.0 * (b.write_seconds - a.write_seconds) / seconds, b.queued);
}

int RunOne(const Options& o, int n) {
  TempDir dir;
  SecurityMaterial security;
  security.token = NewToken();
  std::vector<std::string> argv = {o.ltrain, "coordinator", "--listen", "127.0.0.1:0", "--port-file", dir.Join("port"),
                                   "--state-dir", dir.Join("state"), "--node-timeout", std::to_string(o.node_timeout_s),
                                   "--token-file", dir.Write("token", security.token + "\n"), "--log-level", "warning",
                                   "--http-listen", "127.0.0.1:0", "--http-port-file", dir.Join("http-port"),
                                   "--metrics-token-file", dir.Join("metrics-token")};
  dir.Write("metrics-token", kMetricsToken + std::string("\n"));
  ::chmod(dir.Join("metrics-token").c_str(), 0600);  // as a token file must be
  if (!o.state.empty()) {
    argv[3] = "127.0.0.1:" + std::to_string(testing::FreePort());
    const std::string prefix = "scale-bench-" + std::to_string(n) + "-" + std::to_string(::getpid()) + "-" +
                               std::to_string(std::chrono::system_clock::now().time_since_epoch().count());
    argv.insert(argv.end(), {"--state", o.state + "/" + prefix});
    std::printf("state in %s/%s\n", o.state.c_str(), prefix.c_str());
  }
  Subprocess coordinator(argv);
  const int port = testing::WaitForPortFile(dir.Join("port"), std::chrono::seconds(20));
  if (port == 0) {
    std::fprintf(stderr, "the coordinator did not start:\n%s\n", coordinator.Output().c_str());
    return 1;
  }
  const std::string address = "127.0.0.1:" + std::to_string(port);
  const int http_port = testing::WaitForPortFile(dir.Join("http-port"), std::chrono::seconds(20));
  const ProcessFigures idle = ReadProcess(coordinator.pid());
  LagProbe lag;

  // Registration: every agent connects at once, as after a cluster-wide restart, and heartbeats from
  // the moment it is registered: each every heartbeat_ms, spread evenly over the interval.
  std::vector<std::unique_ptr<Agent>> agents;
  agents.reserve(n);
  std::shared_ptr<grpc::Channel> channel;
  for (int i = 0; i < n; ++i) {
    if (i % o.agents_per_connection == 0) channel = NewChannel(address, security);
    agents.push_back(std::make_unique<Agent>("node-" + std::to_string(i), channel));
  }
  std::mutex mu;
  std::condition_variable cv;
  int registered = 0;
  Latencies latencies;
  std::atomic<int64_t> failed{0}, in_flight{0}, sent_measured{0};
  std::atomic<bool> measuring{false}, quiet0{false}, stop{false};
  const auto t0 = Clock::now();
  std::thread ticker([&] {
    const double per_ms = static_cast<double>(n) / o.heartbeat_ms;
    int64_t sent = 0;
    while (!stop) {
      const int64_t due = static_cast<int64_t>(MsSince(t0) * per_ms);
      for (; sent < due; ++sent) {
        Agent* a = agents[static_cast<size_t>(sent % n)].get();
        if (!a->registered() || (a == agents[0].get() && quiet0)) continue;
        const bool measured = measuring;
        if (measured) ++sent_measured;
        ++in_flight;
        a->Heartbeat([&, measured](double ms) {
          if (measured && ms < 0) ++failed;
          if (measured && ms >= 0) latencies.Add(ms);
          --in_flight;
        });
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  });
  for (auto& agent : agents) {
    agent->Register([&](Agent*) {
      std::lock_guard<std::mutex> lock(mu);
      ++registered;
      cv.notify_all();
    });
  }
  {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait_for(lock, std::chrono::seconds(300), [&] { return registered == n; });
  }
  const double register_all_ms = MsSince(t0);
  std::vector<double> reg;
  for (const auto& a : agents) {
    if (a->registered()) reg.push_back(a->registration_ms());
  }
  std::sort(reg.begin(), reg.end());
  std::printf("agents %d (%d a connection): registered %d of %d in %.0f ms (each: p50 %.1f ms, p99 %.1f ms)\n", n, o.agents_per_connection, registered, n,
              register_all_ms, Percentile(reg, 0.5), Percentile(reg, 0.99));
  std::fflush(stdout);

  // The window: every agent heartbeats; agent 0 goes quiet a third of the way through, for the
  // lost-node figure.
  const auto window = std::chrono::milliseconds(static_cast<int64_t>(o.seconds * 1000));
  std::this_thread::sleep_for(std::chrono::milliseconds(o.heartbeat_ms));  // one round at full rate
  const ProcessFigures before = ReadProcess(coordinator.pid());
  const CoordinatorTime time_before = ScrapeCoordinator(http_port);
  const auto start = Clock::now();
  lag.Reset();
  measuring = true;
  // Lost node: agent 0 goes quiet at a third of the window; ListNodes says when it is lost.
  std::this_thread::sleep_for(window / 3);
  auto jobs = v1::JobService::NewStub(NewChannel(address, security));
  quiet0 = true;
  const auto quiet_at = Clock::now();
  double lost_ms = -1;
  while (Clock::now() - start < window) {
    grpc::ClientContext context;
    v1::ListNodesRequest request;
    v1::ListNodesReply reply;
    if (jobs->ListNodes(&context, request, &reply).ok()) {
      for (const v1::NodeStatus& node : reply.nodes()) {
        if (node.node_id() == "node-0" && !node.connected()) lost_ms = MsSince(quiet_at);
      }
    }
    if (lost_ms >= 0) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  while (Clock::now() - start < window) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  measuring = false;
  const double window_s = MsSince(start) / 1000.0;
  const ProcessFigures after = ReadProcess(coordinator.pid());
  const CoordinatorTime time_after = ScrapeCoordinator(http_port);
  const std::vector<double> sorted = latencies.Sorted();
  std::printf("agents %d: heartbeats %zu answered of %lld sent in %.1f s (%.0f/s), failed %lld; latency p50 %.2f ms, "
              "p99 %.2f ms, max %.1f ms\n",
              n, sorted.size(), static_cast<long long>(sent_measured.load()), window_s,
              static_cast<double>(sorted.size()) / window_s, static_cast<long long>(failed.load()), Percentile(sorted, 0.5), Percentile(sorted, 0.99),
              sorted.empty() ? 0.0 : sorted.back());
  std::printf("agents %d: coordinator CPU %.0f%% of a core, memory %.1f MB (%.1f MB before the agents), "
              "threads %d\n",
              n, 100.0 * (after.cpu_s - before.cpu_s) / window_s, static_cast<double>(after.rss_kb) / 1024.0,
              static_cast<double>(idle.rss_kb) / 1024.0, after.threads);
  std::printf("agents %d: the bench's own lag while heartbeating: %s\n", n, lag.Describe().c_str());
  PrintCoordinatorTime(n, "heartbeating", time_before, time_after, window_s);
  std::printf("agents %d: a node whose heartbeats stopped was lost after %.2f s (node timeout %.1f s)\n", n,
              lost_ms / 1000.0, o.node_timeout_s);
  std::fflush(stdout);

  std::string job_id;
  // A job of N x 8 ranks: submitted, placed (every agent has its start command), and every rank
  // through the rendezvous. Agent 0 is lost by now; the job runs on the others.
  {
    std::mutex job_mu;
    std::condition_variable job_cv;
    int started = 0, met = 0, rdzv_failed = 0;
    Clock::time_point all_started;
    Latencies rdzv;
    std::map<std::string, int> failures;  // why a rank's rendezvous failed: how many
    std::map<int, int> starts_by_generation;
    double last_failure_ms = -1;
    const int nodes = n - 1;
    const CoordinatorTime job_before = ScrapeCoordinator(http_port);
    const auto submitted = Clock::now();
    lag.Reset();
    for (auto& a : agents) {
      a->OnStart([&](Agent* agent, const v1::StartJobCommand& start) {
        {
          std::lock_guard<std::mutex> lock(job_mu);
          ++starts_by_generation[start.generation()];
          if (++started == nodes) all_started = Clock::now();
        }
        // Each rank's answer: -1 and why where it failed.
        auto record = [&](int ranks, double ms, const std::string& why) {
          std::lock_guard<std::mutex> lock(job_mu);
          if (ms < 0) {
            rdzv_failed += ranks;
            failures[why.substr(0, 160)] += ranks;
            last_failure_ms = MsSince(submitted);
          }
          for (int i = 0; ms >= 0 && i < ranks; ++i) rdzv.Add(ms);
          met += ranks;
          job_cv.notify_all();
        };
        if (!o.get_per_rank) {
          // As the agent does: its ranks' identical Gets go to the coordinator as one.
          int first = start.workers(0).rank();
          for (const v1::WorkerAssignment& w : start.workers()) first = std::min(first, w.rank());
          const int ranks = start.workers_size();
          agent->Rendezvous(start.rendezvous_scope(), first,
                            [record, ranks](double ms, const std::string& why) { record(ranks, ms, why); });
          return;
        }
        for (const v1::WorkerAssignment& w : start.workers()) {
          agent->Rendezvous(start.rendezvous_scope(), w.rank(),
                            [record](double ms, const std::string& why) { record(1, ms, why); });
        }
      });
    }
    grpc::ClientContext context;
    v1::SubmitJobRequest request;
    v1::SubmitJobReply reply;
    request.set_source_name("scale.yaml");
    request.set_recipe_yaml("name: scale\nmodel: {layers: 2, d_model: 64, heads: 2, seq_len: 32}\n"
                            "data: {path: /nonexistent}\n"
                            "training: {steps: 10, micro_batch: 1, global_batch: " + std::to_string(8 * nodes) + "}\n"
                            "parallel: {nodes: " + std::to_string(nodes) + ", nproc_per_node: 8}\n"
                            "checkpoint: {enabled: false}\n");
    const grpc::Status submit = jobs->SubmitJob(&context, request, &reply);
    if (submit.ok() && reply.status().code() == 0) job_id = reply.job().id();
    if (!submit.ok() || reply.status().code() != 0) {
      std::printf("agents %d: the job was not submitted: %s %s\n", n, submit.error_message().c_str(),
                  reply.status().message().c_str());
    } else {
      std::unique_lock<std::mutex> lock(job_mu);
      const bool all = job_cv.wait_for(lock, std::chrono::seconds(120), [&] { return met == nodes * 8; });
      const double rendezvous_ms = MsSince(submitted);
      const std::vector<double> sorted_rdzv = rdzv.Sorted();
      std::printf("agents %d: a job of %d ranks: placed on %d nodes in %.0f ms, every rank through the rendezvous in "
                  "%.0f ms%s (a rank's wait: p50 %.1f ms, p99 %.1f ms; failed %d)\n",
                  n, nodes * 8, started,
                  started == nodes ? std::chrono::duration<double, std::milli>(all_started - submitted).count() : -1.0,
                  rendezvous_ms, all ? "" : " (not all: timed out)", Percentile(sorted_rdzv, 0.5),
                  Percentile(sorted_rdzv, 0.99), rdzv_failed);
      std::printf("agents %d: the bench's own lag during the job: %s\n", n, lag.Describe().c_str());
      lock.unlock();
      PrintCoordinatorTime(n, "the job", job_before, ScrapeCoordinator(http_port), rendezvous_ms / 1000.0);
      lock.lock();
      for (const auto& [generation, count] : starts_by_generation) {
        std::printf("agents %d: start commands of generation %d: %d\n", n, generation, count);
      }
      for (const auto& [why, count] : failures) std::printf("agents %d: %d ranks failed: %s\n", n, count, why.c_str());
      if (rdzv_failed > 0) std::printf("agents %d: the last failure came %.0f ms after the submission\n", n, last_failure_ms);
      lock.unlock();
      grpc::ClientContext job_context;
      v1::GetJobRequest job_request;
      job_request.set_job_id(reply.job().id());
      v1::GetJobReply job_reply;
      if (jobs->GetJob(&job_context, job_request, &job_reply).ok() && job_reply.status().code() == 0) {
        std::printf("agents %d: the job afterwards: state %s, generation %d%s%s\n", n,
                    v1::JobState_Name(job_reply.job().state()).c_str(), job_reply.job().generation(),
                    job_reply.job().cause().empty() ? "" : ", cause: ", job_reply.job().cause().c_str());
      }
    }
    std::fflush(stdout);
    for (auto& a : agents) a->OnStart(nullptr);
  }

  // The agents heartbeat through the job, as real ones do: a node that stops is lost, and its job with it.
  stop = true;
  ticker.join();
  for (int i = 0; i < 400 && in_flight > 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  // The job ends and the agents leave, as when a cluster's jobs are done and its agents stopped.
  if (!job_id.empty()) {
    grpc::ClientContext context;
    v1::StopJobRequest request;
    request.set_job_id(job_id);
    v1::StopJobReply reply;
    const grpc::Status stopped = jobs->StopJob(&context, request, &reply);
    if (!stopped.ok() || reply.status().code() != 0) {
      std::printf("agents %d: the job could not be stopped: %s %s\n", n, stopped.error_message().c_str(),
                  reply.status().message().c_str());
    }
  }
  {
    std::mutex leave_mu;
    std::condition_variable leave_cv;
    int answered = 0, refused = 0;
    for (auto& a : agents) {
      a->Leave("the bench ends", [&](bool ok) {
        std::lock_guard<std::mutex> lock(leave_mu);
        ++answered;
        refused += ok ? 0 : 1;
        leave_cv.notify_all();
      });
    }
    std::unique_lock<std::mutex> lock(leave_mu);
    leave_cv.wait_for(lock, std::chrono::seconds(120), [&] { return answered == n; });
    if (refused > 0 || answered < n) std::printf("agents %d: %d Leave calls failed, %d unanswered\n", n, refused, n - answered);
  }
  for (auto& a : agents) a->Close();
  agents.clear();
  std::this_thread::sleep_for(std::chrono::seconds(12));  // the coordinator trims its heap every 10 s
  const ProcessFigures left = ReadProcess(coordinator.pid());
  std::printf("agents %d: after the job stopped and they left, coordinator memory %.1f MB, threads %d\n", n,
              static_cast<double>(left.rss_kb) / 1024.0, left.threads);
  if (const CoordinatorTime held = ScrapeCoordinator(http_port); held.read) {
    std::printf("agents %d: the coordinator then holds %.0f job(s), %.0f rank records, %.2f MB of folded ranks, "
                "%.0f node(s), %.0f rendezvous key(s)\n",
                n, held.jobs_held, held.rank_records, held.folded_rank_bytes / 1e6, held.nodes_held, held.rendezvous_keys);
  }
  std::fflush(stdout);
  coordinator.Signal(SIGTERM);
  coordinator.Wait(std::chrono::seconds(20));
  return 0;
}

}  // namespace
}  // namespace ltrain::bench

int main(int argc, char** argv) {
  ltrain::StopMutexOrderTracking();  // as the agents do (ltrain's main)
  ltrain::bench::Options o;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i], value = argv[i + 1];
    if (flag == "--ltrain") {
      o.ltrain = value;
    } else if (flag == "--agents") {
      o.agents.clear();
      std::istringstream list(value);
      for (std::string n; std::getline(list, n, ',');) o.agents.push_back(std::stoi(n));
    } else if (flag == "--seconds") {
      o.seconds = std::stod(value);
    } else if (flag == "--heartbeat-ms") {
      o.heartbeat_ms = std::stoi(value);
    } else if (flag == "--agents-per-connection") {
      o.agents_per_connection = std::max(1, std::stoi(value));
    } else if (flag == "--node-timeout") {
      o.node_timeout_s = std::stod(value);
    } else if (flag == "--state") {
      o.state = value;
    } else if (flag == "--get-per-rank") {
      o.get_per_rank = value == "1" || value == "true";
    } else {
      std::fprintf(stderr, "unknown flag %s\n", flag.c_str());
      return 2;
    }
  }
  if (o.ltrain.empty()) {
    std::fprintf(stderr,
                 "usage: scale_bench --ltrain PATH [--agents N[,N...]] [--seconds S] [--heartbeat-ms MS] "
                 "[--node-timeout S] [--agents-per-connection K] [--state etcd://HOST:PORT,...] [--get-per-rank 1]\n");
    return 2;
  }
  // Every agent holds a connection, and so does the coordinator: raise the open-file limit to the hard one.
  rlimit files{};
  if (::getrlimit(RLIMIT_NOFILE, &files) == 0) {
    files.rlim_cur = files.rlim_max;
    ::setrlimit(RLIMIT_NOFILE, &files);
    std::printf("open files: up to %llu\n", static_cast<unsigned long long>(files.rlim_cur));
  }
  for (int n : o.agents) {
    if (int rc = ltrain::bench::RunOne(o, n); rc != 0) return rc;
  }
  return 0;
}
