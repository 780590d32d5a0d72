// Real training through the whole control plane: ltrain launch -> coordinator -> agent -> workers.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <memory>
#include <regex>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>
#include <thread>

#include <nlohmann/json.hpp>

#include "ltrain/v1/ltrain.pb.h"
#include "tests/support/http_get.h"
#include "tests/support/job_status.h"
#include "tests/support/prometheus_text.h"
#include "tests/support/subprocess.h"
#include "tests/support/tensorboard_reader.h"

namespace ltrain::testing {
namespace {

namespace fs = std::filesystem;

const PrometheusSample* FindSample(const PrometheusParse& parse, const std::string& name, const std::string& job) {
  for (const PrometheusSample& sample : parse.samples) {
    if (sample.name == name && sample.labels.count("job_id") && sample.labels.at("job_id") == job) return &sample;
  }
  return nullptr;
}

// A small GPT on the licence texts; every test overrides what it studies.
constexpr const char* kRecipe = R"(name: tiny
model: {layers: 2, d_model: 64, heads: 4, seq_len: 32, vocab: 256}
data: {path: DATA}
training: {steps: 20, micro_batch: 4, global_batch: 8, lr: 3.0e-3, min_lr: 3.0e-4, warmup_steps: 5, log_every: 1, seed: 7}
parallel: {nodes: 1, nproc_per_node: 2}
)";

class TrainingTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ProcessResult prepared = PrepareLicenseData(dir_.Join("data"));
    ASSERT_EQ(prepared.exit_code, 0) << prepared.output;
    std::string recipe = kRecipe;
    recipe.replace(recipe.find("DATA"), 4, dir_.Join("data"));
    recipe_ = dir_.Write("tiny.yaml", recipe);
  }

  std::map<std::string, std::string> Env() const { return {{"LTRAIN_HOME", dir_.Join("home")}}; }

  ProcessResult Launch(const std::vector<std::string>& sets, std::map<std::string, std::string> extra_env = {}) {
    std::vector<std::string> argv = {LtrainBinary(), "launch", recipe_};
    for (const auto& set : sets) {
      argv.push_back("--set");
      argv.push_back(set);
    }
    std::map<std::string, std::string> env = Env();
    env.insert(extra_env.begin(), extra_env.end());
    return RunProcess(argv, env, std::chrono::seconds(240));
  }

  v1::Job Status(const std::string& job_id) {
    int exit_code = -1;
    v1::Job job = JobStatus(job_id, Env(), {}, &exit_code);
    EXPECT_EQ(exit_code, 0) << job.DebugString();
    return job;
  }

  // A coordinator with the bearer token `token` and an HTTP port (--http-listen), and one agent (n1),
  // as separate processes, up and connected; ShutDown stops both with SIGTERM.
  struct Served {
    std::map<std::string, std::string> env;  // with the token, for every ltrain command of the test
    std::unique_ptr<Subprocess> coordinator;
    std::unique_ptr<Subprocess> agent;
    std::string address;  // the coordinator's RPCs
    int http_port = 0;
  };

  Served ServeWithHttp(const std::string& token) {
    Served served;
    served.env = Env();
    served.env["LTRAIN_TOKEN"] = token;
    served.coordinator = std::make_unique<Subprocess>(
        std::vector<std::string>{LtrainBinary(), "coordinator", "--listen", "127.0.0.1:0", "--port-file",
                                 dir_.Join("port"), "--http-listen", "127.0.0.1:0", "--http-port-file",
                                 dir_.Join("http-port"), "--state-dir", dir_.Join("coord")},
        served.env);
    const int port = WaitForPortFile(dir_.Join("port"), std::chrono::seconds(5));
    served.http_port = WaitForPortFile(dir_.Join("http-port"), std::chrono::seconds(5));
    if (port <= 0 || served.http_port <= 0) return served;
    served.address = "127.0.0.1:" + std::to_string(port);
    served.agent = std::make_unique<Subprocess>(
        std::vector<std::string>{LtrainBinary(), "agent", "--coordinator", served.address, "--node-id", "n1",
                                 "--work-dir", dir_.Join("agent")},
        served.env);
    return served;
  }

  static void ShutDown(Served& served) {
    for (Subprocess* process : {served.agent.get(), served.coordinator.get()}) {
      if (process == nullptr) continue;
      process->Signal(SIGTERM);
      EXPECT_EQ(process->Wait(std::chrono::seconds(10)).exit_code, 0) << process->Output();
    }
  }

  TempDir dir_;
  std::string recipe_;
};

TEST_F(TrainingTest, TwoWorkersLearnAndTheJobSucceeds) {
  ProcessResult result =
      Launch({"training.steps=60", "training.log_every=10", "checkpoint.every=30", "training.eval_every=30",
              "metrics.tensorboard=true"});
  ASSERT_EQ(result.exit_code, 0) << result.output;
  std::vector<double> losses = ParseLosses(result.output);
  ASSERT_GE(losses.size(), 3u) << result.output;
  EXPECT_LT(losses.back(), losses.front() - 1.0) << result.output;
  EXPECT_NE(result.output.find("[rank 1]"), std::string::npos) << "lines of every rank are streamed";
  // Standalone, the local node is there before the job: no advice to start agents, and no raw lines
  // of the embedded coordinator or agent without -v.
  EXPECT_EQ(result.output.find("waiting for nodes"), std::string::npos) << result.output;
  EXPECT_FALSE(std::regex_search(result.output, std::regex(R"((^|\n)[WI] \d{4}-\d\d-\d\dT)"))) << result.output;
  v1::Job job = Status("tiny-1");
  EXPECT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED);
  EXPECT_EQ(job.last_step(), 60);
  // Validation on val.bin after steps 30 and 60: in the log, and the last in the job's status.
  EXPECT_NE(result.output.find("[rank 0] eval step 30/60 val_loss "), std::string::npos) << result.output;
  EXPECT_EQ(job.val_step(), 60);
  EXPECT_GT(job.val_loss(), 0.5);
  EXPECT_LT(job.val_loss(), losses.front()) << "the model learned something that holds on held-out text";
  ASSERT_EQ(job.ranks_size(), 2);
  for (const auto& rank : job.ranks()) {
    EXPECT_EQ(rank.exit_code(), 0);
    EXPECT_EQ(rank.last_step(), 60) << "where the rank ended, kept after the launch";
    EXPECT_TRUE(fs::exists(rank.log_path())) << rank.log_path();
  }
  fs::path checkpoints = fs::path(dir_.Join("home")) / "checkpoints" / "tiny-1";
  EXPECT_TRUE(fs::exists(checkpoints / "step-60")) << "the final checkpoint";

  // metrics.jsonl beside the ranks' logs: every step rank 0 completed, and both validation losses.
  std::ifstream metrics(fs::path(dir_.Join("home")) / "agent-local" / "jobs" / "tiny-1" / "metrics.jsonl");
  ASSERT_TRUE(metrics.good());
  std::vector<nlohmann::json> steps, evals, saves;
  for (std::string line; std::getline(metrics, line);) {
    nlohmann::json entry = nlohmann::json::parse(line);  // throws, failing the test, on a bad line
    EXPECT_EQ(entry.at("generation"), 0);
    EXPECT_GT(entry.at("time").get<double>(), 1.7e9);
    (entry.contains("val_loss") ? evals : entry.contains("checkpoint_step") ? saves : steps).push_back(std::move(entry));
  }
  // Each committed checkpoint's save time and size.
  ASSERT_EQ(saves.size(), 2u);
  EXPECT_EQ(saves[0].at("checkpoint_step"), 30);
  EXPECT_EQ(saves[1].at("checkpoint_step"), 60);
  EXPECT_GT(saves[1].at("save_ms").get<double>(), 0);
  EXPECT_GT(saves[1].at("bytes").get<int64_t>(), 0);
  ASSERT_EQ(steps.size(), 60u);
  for (size_t i = 0; i < steps.size(); ++i) {
    EXPECT_EQ(steps[i].at("step"), static_cast<int>(i) + 1);
    EXPECT_EQ(steps[i].at("total_steps"), 60);
    EXPECT_GT(steps[i].at("tokens_per_s").get<double>(), 0);
    if (i < 3) {
      EXPECT_FALSE(steps[i].contains("compute_ms")) << "a CPU rank's first 3 steps are its start-up";
    } else {
      EXPECT_GT(steps[i].at("compute_ms").get<double>(), 0);
    }
    EXPECT_GT(steps[i].at("memory_bytes").get<int64_t>(), 0);
    EXPECT_FALSE(steps[i].contains("mfu")) << "MFU is a GPU's figure";
  }
  // Rank 0's memory: at least the parts its "memory rank 0" line printed after its first step.
  std::smatch printed;
  ASSERT_TRUE(std::regex_search(result.output, printed, std::regex(R"(memory rank 0: params (\d+) bytes, grads (\d+) bytes, )"
                                                                   R"(optimizer (\d+) bytes, activations_peak (\d+) bytes)")))
      << result.output;
  int64_t parts = 0;
  for (int i = 1; i <= 4; ++i) parts += std::stoll(printed[i].str());
  EXPECT_GE(steps.back().at("memory_bytes").get<int64_t>(), parts);
  EXPECT_NEAR(steps.back().at("loss").get<double>(), losses.back(), 1e-5 * losses.back());
  ASSERT_EQ(evals.size(), 2u);
  EXPECT_EQ(evals[1].at("step"), 60);
  EXPECT_NEAR(evals[1].at("val_loss").get<double>(), job.val_loss(), 1e-9 * job.val_loss());

  // metrics.tensorboard: the same figures as TensorBoard scalars, in one event file of generation 0.
  const fs::path tensorboard = fs::path(dir_.Join("home")) / "agent-local" / "jobs" / "tiny-1" / "tensorboard";
  std::vector<fs::path> event_files;
  for (const auto& entry : fs::directory_iterator(tensorboard)) event_files.push_back(entry.path());
  ASSERT_EQ(event_files.size(), 1u);
  EXPECT_EQ(event_files[0].filename().string().rfind("events.out.tfevents.", 0), 0u) << event_files[0];
  const TensorBoardFile events = ReadTensorBoardFile(event_files[0].string());
  ASSERT_EQ(events.error, "");
  std::vector<TensorBoardScalar> train_loss, val_loss;
  for (const TensorBoardScalar& scalar : events.scalars) {
    if (scalar.tag == "train/loss") train_loss.push_back(scalar);
    if (scalar.tag == "val/loss") val_loss.push_back(scalar);
  }
  ASSERT_EQ(train_loss.size(), 60u);
  EXPECT_EQ(std::count_if(events.scalars.begin(), events.scalars.end(),
                          [](const TensorBoardScalar& s) { return s.tag == "train/memory_gib"; }),
            60);
  for (size_t i = 0; i < train_loss.size(); ++i) {
    EXPECT_EQ(train_loss[i].step, static_cast<int64_t>(i) + 1);
    EXPECT_NEAR(train_loss[i].value, steps[i].at("loss").get<double>(), 1e-5 * train_loss[i].value);
  }
  ASSERT_EQ(val_loss.size(), 2u);
  EXPECT_EQ(std::count_if(events.scalars.begin(), events.scalars.end(),
                          [](const TensorBoardScalar& s) { return s.tag == "checkpoint/save_s"; }),
            2);
  EXPECT_NEAR(val_loss[1].value, job.val_loss(), 1e-5 * job.val_loss());

  // The logs outlive the launch: every rank's lines, filters, JSON.
  ProcessResult logs = RunProcess({LtrainBinary(), "logs", "tiny-1"}, Env());
  EXPECT_EQ(logs.exit_code, 0) << logs.output;
  EXPECT_NE(logs.output.find("[rank 0] step 60/60 loss "), std::string::npos) << logs.output;
  EXPECT_NE(logs.output.find("[rank 1] rank 1/2 up"), std::string::npos) << logs.output;
  ProcessResult rank1 = RunProcess({LtrainBinary(), "logs", "tiny-1", "--rank", "1"}, Env());
  EXPECT_EQ(rank1.output.find("[rank 0]"), std::string::npos) << rank1.output;
  EXPECT_NE(rank1.output.find("[rank 1]"), std::string::npos) << rank1.output;
  ProcessResult tail = RunProcess({LtrainBinary(), "logs", "tiny-1", "--tail", "1", "-o", "json"}, Env());
  EXPECT_EQ(std::count(tail.output.begin(), tail.output.end(), '\n'), 1) << tail.output;
  EXPECT_NE(tail.output.find("\"kind\":\"log\""), std::string::npos) << tail.output;
  ProcessResult list = RunProcess({LtrainBinary(), "list", "-o", "json"}, Env());
  EXPECT_NE(list.output.find("\"id\": \"tiny-1\""), std::string::npos) << list.output;
  // -o json as docs/json-schema.json says: plain numbers, the tables' state names, every field.
  ProcessResult status_json = RunProcess({LtrainBinary(), "status", "tiny-1", "-o", "json"}, Env());
  EXPECT_EQ(SchemaProblems("status_job", status_json.output), "");
  EXPECT_NE(status_json.output.find("\"state\": \"SUCCEEDED\""), std::string::npos) << status_json.output;
  EXPECT_NE(status_json.output.find("\"val_step\": 60,"), std::string::npos) << status_json.output;
  ProcessResult status_text = RunProcess({LtrainBinary(), "status", "tiny-1"}, Env());
  EXPECT_NE(status_text.output.find("val loss:       "), std::string::npos) << status_text.output;
  EXPECT_TRUE(std::regex_search(status_json.output, std::regex(R"("created_unix_ms": \d{13},)"))) << status_json.output;
  EXPECT_EQ(SchemaProblems("status_list", list.output), "");
  ProcessResult all_json = RunProcess({LtrainBinary(), "logs", "tiny-1", "-o", "json"}, Env());
  EXPECT_EQ(SchemaProblems("logs_line", all_json.output), "");
  EXPECT_NE(all_json.output.find("\"rank\":0,"), std::string::npos) << "rank 0's lines say so too";
  ProcessResult missing = RunProcess({LtrainBinary(), "logs", "nope-9"}, Env());
  EXPECT_EQ(missing.exit_code, 2) << missing.output;
  EXPECT_NE(missing.output.find("needs --coordinator HOST:PORT (or $LTRAIN_COORDINATOR"), std::string::npos)
      << "says where else the job may be: " << missing.output;
  EXPECT_TRUE(fs::exists(checkpoints / "step-30"));
}

// 2 workers with micro-batch b against 1 worker accumulating 2 micro-batches of b over the same
// samples: the losses agree to 1e-5 relative for 20 steps. One CPU thread per rank in both runs, so
// that kernels sum in the same order.
TEST_F(TrainingTest, DataParallelEqualsOneProcessAccumulating) {
  ProcessResult two = Launch({"parallel.nproc_per_node=2", "training.micro_batch=4", "training.global_batch=8"},
                             {{"OMP_NUM_THREADS", "1"}});
  ASSERT_EQ(two.exit_code, 0) << two.output;
  ProcessResult one = Launch({"parallel.nproc_per_node=1", "training.micro_batch=4", "training.global_batch=8"},
                             {{"OMP_NUM_THREADS", "1"}});
  ASSERT_EQ(one.exit_code, 0) << one.output;
  EXPECT_NE(one.output.find("accumulation 2"), std::string::npos) << one.output;
  std::vector<double> a = ParseLosses(two.output);
  std::vector<double> b = ParseLosses(one.output);
  ASSERT_EQ(a.size(), 20u) << two.output;
  ASSERT_EQ(b.size(), 20u) << one.output;
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_NEAR(a[i], b[i], 1e-5 * std::abs(b[i])) << "step " << i + 1;
  }
  EXPECT_LT(a.back(), a.front());
}

TEST_F(TrainingTest, ResumingFromACheckpointContinuesTheSameRun) {
  ProcessResult full = Launch({"training.steps=12", "checkpoint.every=6", "checkpoint.keep=3"});
  ASSERT_EQ(full.exit_code, 0) << full.output;
  std::string step6 = (fs::path(dir_.Join("home")) / "checkpoints" / "tiny-1" / "step-6").string();
  ASSERT_TRUE(fs::exists(step6));
  ProcessResult resumed = Launch({"training.steps=12", "checkpoint.resume_from=" + step6});
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  std::vector<double> a = ParseLosses(full.output);
  std::vector<double> b = ParseLosses(resumed.output);
  ASSERT_EQ(a.size(), 12u);
  ASSERT_EQ(b.size(), 6u) << resumed.output;
  for (size_t i = 0; i < b.size(); ++i) EXPECT_NEAR(b[i], a[6 + i], 1e-5 * std::abs(a[6 + i])) << "step " << 7 + i;
}

TEST_F(TrainingTest, SeparateCoordinatorAndAgentProcessesRunAJob) {
  std::string port_file = dir_.Join("port");
  Subprocess coordinator({LtrainBinary(), "coordinator", "--listen", "127.0.0.1:0", "--port-file", port_file,
                          "--state-dir", dir_.Join("coord")});
  const int port = WaitForPortFile(port_file, std::chrono::seconds(5));
  ASSERT_GT(port, 0) << coordinator.Output();
  std::string address = "127.0.0.1:" + std::to_string(port);
  // A coordinator started without a token made one in its state directory; its clients give it.
  const std::string token_file = dir_.Join("coord/token");
  std::map<std::string, std::string> client = Env();
  client["LTRAIN_TOKEN_FILE"] = token_file;
  Subprocess agent({LtrainBinary(), "agent", "--coordinator", address, "--node-id", "n1", "--work-dir",
                    dir_.Join("agent"), "--token-file", token_file});
  ProcessResult launched = RunProcess({LtrainBinary(), "launch", "--coordinator", address, recipe_, "--set",
                                       "training.steps=5"},
                                      client, std::chrono::seconds(120));
  EXPECT_EQ(launched.exit_code, 0) << launched.output << "\n--- coordinator\n" << coordinator.Output()
                                   << "\n--- agent\n" << agent.Output();
  // Data missing on the nodes is found by the first worker, and fails the job at once: a restart
  // would find the same files.
  ProcessResult no_data = RunProcess({LtrainBinary(), "launch", "--coordinator", address, recipe_, "--set",
                                      "data.path=/nonexistent", "--set", "fault.max_restarts=3", "--set",
                                      "name=nodata"},
                                     client, std::chrono::seconds(60));
  EXPECT_EQ(no_data.exit_code, 1) << no_data.output;
  EXPECT_NE(no_data.output.find("cannot open token file /nonexistent/train.bin"), std::string::npos) << no_data.output;
  EXPECT_EQ(no_data.output.find("restart 1 of 3"), std::string::npos) << no_data.output;
  ProcessResult status = RunProcess({LtrainBinary(), "status", "--coordinator", address, "--output", "json"}, client);
  EXPECT_EQ(status.exit_code, 0);
  EXPECT_NE(status.output.find("\"state\": \"SUCCEEDED\""), std::string::npos) << status.output;
  // The coordinator named once, in the environment or in $LTRAIN_HOME/config.yaml, serves every command.
  std::map<std::string, std::string> env = client;
  env["LTRAIN_COORDINATOR"] = address;
  ProcessResult nodes = RunProcess({LtrainBinary(), "nodes"}, env);
  EXPECT_EQ(nodes.exit_code, 0) << nodes.output;
  EXPECT_TRUE(std::regex_search(nodes.output, std::regex(R"(\nn1 +\S+ +\d+ +\d+ +up +\d+\.\ds ago +-)"))) << nodes.output;
  ProcessResult logs = RunProcess({LtrainBinary(), "logs", "tiny-1", "--tail", "1"}, env);
  EXPECT_EQ(logs.exit_code, 0) << logs.output;
  fs::create_directories(env["LTRAIN_HOME"]);
  std::ofstream(env["LTRAIN_HOME"] + "/config.yaml") << "coordinator: " << address << "\noutput: json\ntoken_file: "
                                                    << token_file << "\n";
  ProcessResult configured = RunProcess({LtrainBinary(), "nodes"}, Env());
  EXPECT_EQ(configured.exit_code, 0) << configured.output;
  EXPECT_EQ(SchemaProblems("nodes_list", configured.output), "");
  EXPECT_NE(configured.output.find("\"node_id\": \"n1\""), std::string::npos) << configured.output;
  std::ofstream(env["LTRAIN_HOME"] + "/config.yaml") << "coordinator: " << address << "\ncoordinater: x\n";
  ProcessResult misspelt = RunProcess({LtrainBinary(), "nodes"}, Env());
  EXPECT_EQ(misspelt.exit_code, 2) << misspelt.output;
  EXPECT_NE(misspelt.output.find("config.yaml:2: unknown key 'coordinater'; the keys are coordinator,"),
            std::string::npos)
      << misspelt.output;
  fs::remove(env["LTRAIN_HOME"] + "/config.yaml");
  agent.Signal(SIGTERM);
  EXPECT_EQ(agent.Wait(std::chrono::seconds(10)).exit_code, 0);
  coordinator.Signal(SIGTERM);
  EXPECT_EQ(coordinator.Wait(std::chrono::seconds(10)).exit_code, 0);
}

// GET /metrics: Prometheus text in which every line is valid and each job has its loss; with a token
// set, only requests that carry it are answered.
TEST_F(TrainingTest, TheCoordinatorServesEveryJobsLossAsPrometheusMetrics) {
  Served served = ServeWithHttp("metrics-test-token");
  ASSERT_NE(served.agent, nullptr) << served.coordinator->Output();
  const int http_port = served.http_port;
  ProcessResult launched = RunProcess({LtrainBinary(), "launch", "--coordinator", served.address, recipe_, "--set",
                                       "training.steps=5"},
                                      served.env, std::chrono::seconds(120));
  ASSERT_EQ(launched.exit_code, 0) << launched.output;
  const std::vector<double> losses = ParseLosses(launched.output);
  ASSERT_FALSE(losses.empty()) << launched.output;

  EXPECT_EQ(HttpGet(http_port, "/metrics").first, 401) << "no token";
  EXPECT_EQ(HttpGet(http_port, "/metrics", "wrong-token-of-the-same-size").first, 401);
  // The read-only metrics token the coordinator made in its state directory serves /metrics alone; the
  // control-plane token serves it too.
  std::string metrics_token;
  std::ifstream(dir_.Join("coord/metrics-token")) >> metrics_token;
  ASSERT_GE(metrics_token.size(), 32u);
  EXPECT_EQ(HttpGet(http_port, "/api/jobs", metrics_token).first, 401) << "the metrics token opens no dashboard";
  EXPECT_EQ(HttpGet(http_port, "/metrics", "metrics-test-token").first, 200);
  auto [status, body] = HttpGet(http_port, "/metrics", metrics_token);
  ASSERT_EQ(status, 200) << body;
  const PrometheusParse parse = ParsePrometheusText(body);
  ASSERT_EQ(parse.error, "") << body;
  const PrometheusSample* loss = FindSample(parse, "ltrain_job_loss", "tiny-1");
  ASSERT_NE(loss, nullptr) << body;
  EXPECT_NEAR(loss->value, losses.back(), 1e-5 * std::abs(losses.back())) << body;
  const PrometheusSample* step = FindSample(parse, "ltrain_job_step", "tiny-1");
  ASSERT_NE(step, nullptr);
  EXPECT_EQ(step->value, 5);
  const PrometheusSample* info = FindSample(parse, "ltrain_job_info", "tiny-1");
  ASSERT_NE(info, nullptr);
  EXPECT_EQ(info->labels.at("state"), "succeeded");
  ShutDown(served);
}

// A standalone launch serves its own coordinator's metrics while the job runs, with the home's
// read-only metrics token, and says where; its dashboard opens through a one-time link. No token
// is in its output.
TEST_F(TrainingTest, AStandaloneLaunchServesMetricsWhileItsJobRuns) {
  std::vector<std::string> argv = {LtrainBinary(), "launch", recipe_, "--set", "training.steps=100000",
                                   "--http-listen", "127.0.0.1:0"};
  Subprocess launch(argv, Env());
  ASSERT_TRUE(launch.WaitForOutput("/metrics with the read-only token of", std::chrono::seconds(60))) << launch.Output();
  std::smatch match;
  const std::string output = launch.Output();
  ASSERT_TRUE(std::regex_search(output, match, std::regex(R"(metrics at http://127\.0\.0\.1:(\d+)/metrics with the read-only token of (\S+):)")))
      << output;
  const int http_port = std::stoi(match[1]);
  std::string token;
  std::ifstream(match[2].str()) >> token;
  ASSERT_GE(token.size(), 32u) << match[2];
  std::string address, control_token;
  std::ifstream(Env()["LTRAIN_HOME"] + "/run/tiny-1.addr") >> address >> control_token;
  ASSERT_FALSE(control_token.empty());
  EXPECT_EQ(output.find(control_token), std::string::npos) << "the launch's token is never printed";
  EXPECT_EQ(output.find(token), std::string::npos);
  EXPECT_EQ(HttpGet(http_port, "/metrics").first, 401);
  // The printed link: once it opens a session (a cookie that reads the page), then nothing.
  std::smatch link;
  ASSERT_TRUE(std::regex_search(output, link, std::regex(R"(dashboard at http://127\.0\.0\.1:\d+(/login\?code=\w+&job=tiny-1) )")))
      << output;
  std::string headers;
  EXPECT_EQ(HttpGet(http_port, link[1], "", &headers).first, 303);
  EXPECT_NE(headers.find("Location: /#job=tiny-1"), std::string::npos) << headers;
  std::smatch cookie;
  ASSERT_TRUE(std::regex_search(headers, cookie, std::regex(R"(Set-Cookie: (ltrain_session=\w+); Path=/; HttpOnly; SameSite=Strict)")))
      << headers;
  EXPECT_EQ(HttpGet(http_port, "/api/jobs", "", nullptr, "Cookie: " + cookie[1].str() + "\r\n").first, 200);
  EXPECT_EQ(HttpGet(http_port, link[1]).first, 401) << "a login link works once";
  // Until rank 0 has completed a step and reported it.
  const PrometheusSample* loss = nullptr;
  PrometheusParse parse;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (loss == nullptr && std::chrono::steady_clock::now() < deadline) {
    auto [status, body] = HttpGet(http_port, "/metrics", token);
    ASSERT_EQ(status, 200) << body;
    parse = ParsePrometheusText(body);
    ASSERT_EQ(parse.error, "") << body;
    loss = FindSample(parse, "ltrain_job_loss", "tiny-1");
    if (loss == nullptr) std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  ASSERT_NE(loss, nullptr) << launch.Output();
  EXPECT_GT(loss->value, 0);
  EXPECT_EQ(FindSample(parse, "ltrain_job_info", "tiny-1")->labels.at("state"), "running");
  EXPECT_NE(FindSample(parse, "ltrain_rank_step", "tiny-1"), nullptr);
  // Prometheus' own linter takes it as it is: base units, a HELP and TYPE for every family, counters
  // in _total (Debian's prometheus package, deploy/setup.sh --tests).
  ASSERT_EQ(::access("/usr/bin/promtool", X_OK), 0) << "promtool is missing: apt-get install prometheus";
  while (FindSample(parse, "ltrain_rank_compute_seconds", "tiny-1") == nullptr &&
         std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    auto [status, body] = HttpGet(http_port, "/metrics", token);
    ASSERT_EQ(status, 200) << body;
    parse = ParsePrometheusText(body);
  }
  auto [status, body] = HttpGet(http_port, "/metrics", token);
  ASSERT_EQ(status, 200) << body;
  EXPECT_NE(body.find("ltrain_rank_compute_seconds{"), std::string::npos) << body;
  const std::string scraped = dir_.Write("scraped.txt", body);
  ProcessResult lint = RunProcess({"/bin/sh", "-c", "/usr/bin/promtool check metrics < " + scraped});
  EXPECT_EQ(lint.exit_code, 0) << lint.output << "\n" << body;
  launch.Signal(SIGINT);
  launch.Wait(std::chrono::seconds(30));
}

// The dashboard in a real browser: headless Chromium opens the page of a running job and finds it
// RUNNING with points on its loss chart, then SUCCEEDED once it ended. Screenshots are kept in
// artifacts/ of the test's directory.
std::string Browser() {
  for (const char* name : {"/usr/bin/chromium", "/usr/bin/chromium-browser"}) {
    if (fs::exists(name)) return name;
  }
  return "";
}

ProcessResult OpenInBrowser(const std::string& url, const std::vector<std::string>& extra) {
  std::vector<std::string> argv = {Browser(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                                   "--no-first-run", "--user-data-dir=" + fs::temp_directory_path().string() + "/ltrain-chromium-" +
                                       std::to_string(getpid()),
                                   "--virtual-time-budget=5000"};
  argv.insert(argv.end(), extra.begin(), extra.end());
  argv.push_back(url);
  return RunProcess(argv, {}, std::chrono::seconds(90));
}

TEST_F(TrainingTest, TheDashboardShowsARunningJobsLossCurveInABrowser) {
  ASSERT_FALSE(Browser().empty()) << "the dashboard test needs Chromium: deploy/setup.sh --tests installs it";
  Served served = ServeWithHttp("dashboard-test-token");
  ASSERT_NE(served.agent, nullptr) << served.coordinator->Output();
  const int http_port = served.http_port;
  // About 15 ms a step on two cores: 1,500 steps keep it running while a browser starts (seconds).
  Subprocess launch({LtrainBinary(), "launch", "--coordinator", served.address, recipe_, "--set", "training.steps=1500",
                     "--set", "training.eval_every=500"},
                    served.env);
  // Until the job has a few points on its curve.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(90);
  int points = 0;
  while (points < 3 && std::chrono::steady_clock::now() < deadline) {
    auto [status, body] = HttpGet(http_port, "/api/jobs/tiny-1", "dashboard-test-token");
    if (status == 200) points = static_cast<int>(nlohmann::json::parse(body)["series"]["steps"].size());
    if (points < 3) std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  ASSERT_GE(points, 3) << launch.Output();

  // Each browser opens a login link of its own, as `ltrain dashboard` prints them (each works once).
  auto url = [&](const std::string& job) {
    std::vector<std::string> argv = {LtrainBinary(), "dashboard", "--coordinator", served.address};
    if (!job.empty()) argv.push_back(job);
    ProcessResult printed = RunProcess(argv, served.env);
    EXPECT_EQ(printed.exit_code, 0) << printed.output;
    std::smatch link;
    EXPECT_TRUE(std::regex_search(printed.output, link, std::regex(R"(http://\S+/login\?code=\w+\S*)"))) << printed.output;
    return link.empty() ? std::string() : link[0].str();
  };
  fs::create_directories("artifacts");
  ProcessResult running = OpenInBrowser(url("tiny-1"), {"--dump-dom"});
  ASSERT_EQ(running.exit_code, 0) << running.output;
  EXPECT_NE(running.output.find(R"(id="job-state" class="RUNNING")"), std::string::npos) << running.output;
  std::smatch chart;
  ASSERT_TRUE(std::regex_search(running.output, chart, std::regex(R"re(<svg id="loss-chart" data-points="(\d+)")re")))
      << running.output;
  EXPECT_GE(std::stoi(chart[1]), 3) << "the loss chart has points";
  EXPECT_NE(running.output.find(R"(<table id="ranks">)"), std::string::npos);
  OpenInBrowser(url("tiny-1"), {"--screenshot=" + fs::absolute("artifacts/dashboard-running.png").string(),
                                "--window-size=1280,1100"});
  EXPECT_TRUE(fs::exists("artifacts/dashboard-running.png"));

  ProcessResult launched = launch.Wait(std::chrono::seconds(180));
  ASSERT_EQ(launched.exit_code, 0) << launched.output;
  ProcessResult ended = OpenInBrowser(url("tiny-1"), {"--dump-dom"});
  EXPECT_NE(ended.output.find(R"(id="job-state" class="SUCCEEDED")"), std::string::npos) << ended.output;
  OpenInBrowser(url("tiny-1"), {"--screenshot=" + fs::absolute("artifacts/dashboard-succeeded.png").string(),
                                "--window-size=1280,1100"});
  // The jobs' list, and no page without a login.
  ProcessResult list = OpenInBrowser(url(""), {"--dump-dom"});
  EXPECT_NE(list.output.find(R"(<tr data-job="tiny-1">)"), std::string::npos) << list.output;
  EXPECT_EQ(HttpGet(http_port, "/").first, 401);
  EXPECT_EQ(HttpGet(http_port, "/api/jobs/tiny-1").first, 401);
  ShutDown(served);
}

}  // namespace
}  // namespace ltrain::testing
