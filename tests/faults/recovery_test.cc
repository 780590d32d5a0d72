// Fault tolerance with real processes and real signals: a killed worker, a hung worker, a lost
// agent (elastic shrink, then growth), a killed coordinator, and `ltrain resume`.
#include <gtest/gtest.h>
#include <signal.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <regex>
#include <sstream>
#include <thread>

#include "ltrain/v1/ltrain.pb.h"
#include "tests/support/job_status.h"
#include "tests/support/subprocess.h"

namespace ltrain::testing {
namespace {

namespace fs = std::filesystem;
using std::chrono::milliseconds;
using std::chrono::seconds;

double SecondsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

class RecoveryTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ProcessResult prepared = PrepareLicenseData(dir_.Join("data"));
    ASSERT_EQ(prepared.exit_code, 0) << prepared.output;
  }

  std::string Recipe(const std::string& name, const std::string& extra) {
    return dir_.Write(name + ".yaml", TinyRecipe(name, dir_.Join("data")) + extra);
  }

  std::map<std::string, std::string> Env(const std::string& home) const {
    // One thread per rank: kernels then sum in the same order in every run.
    std::map<std::string, std::string> env = {{"LTRAIN_HOME", dir_.Join(home)}, {"OMP_NUM_THREADS", "1"}};
    // Once a coordinator daemon runs, its clients present the token it keeps in its state directory.
    if (!token_file_.empty()) env["LTRAIN_TOKEN_FILE"] = token_file_;
    return env;
  }

  v1::Job Status(const std::string& home, const std::string& job_id, const std::string& coordinator = "") {
    std::vector<std::string> extra;
    if (!coordinator.empty()) extra = {"--coordinator", coordinator};
    return JobStatus(job_id, Env(home), extra);
  }

  // Starts `ltrain coordinator` on `port` (0: any) and returns its address.
  std::string StartCoordinator(std::unique_ptr<Subprocess>& process, int port = 0) {
    std::string port_file = dir_.Join("coordinator.port");
    fs::remove(port_file);
    process = std::make_unique<Subprocess>(
        std::vector<std::string>{LtrainBinary(), "coordinator", "--listen", "127.0.0.1:" + std::to_string(port),
                                 "--port-file", port_file, "--state-dir", dir_.Join("coordinator")},
        Env("home"));
    const int chosen = WaitForPortFile(port_file);
    EXPECT_GT(chosen, 0) << process->Output();
    token_file_ = dir_.Join("coordinator/token");
    return "127.0.0.1:" + std::to_string(chosen);
  }

  std::unique_ptr<Subprocess> StartAgent(const std::string& address, const std::string& node) {
    return std::make_unique<Subprocess>(
        std::vector<std::string>{LtrainBinary(), "agent", "--coordinator", address, "--node-id", node, "--work-dir",
                                 dir_.Join("agent-" + node), "--coordinator-grace", "60"},
        Env("home"));
  }

  TempDir dir_;
  std::string token_file_;
};

// A worker SIGKILLed at a random step: the failure is seen within a second, the job restarts from
// its last checkpoint, SUCCEEDS, and ends with exactly the parameters of an uninterrupted run.
TEST_F(RecoveryTest, KilledWorkerRestartsFromItsCheckpointAndEndsBitIdentical) {
  std::string recipe = Recipe("tiny", "training: {steps: 40, micro_batch: 4, global_batch: 8, log_every: 1}\n"
                                      "parallel: {nproc_per_node: 2}\n"
                                      "checkpoint: {every: 5, keep: 3}\n"
                                      "fault: {max_restarts: 2, restart_backoff_s: 0.2}\n");
  // Each rank's windows (LTRAIN_DATA_TRACE): the restarted run must read what the reference read.
  auto traced = [&](const std::string& home) {
    std::map<std::string, std::string> env = Env(home);
    env["LTRAIN_DATA_TRACE"] = dir_.Join(home + "-trace");
    fs::create_directories(env["LTRAIN_DATA_TRACE"]);
    return env;
  };
  ProcessResult reference = RunProcess({LtrainBinary(), "launch", recipe}, traced("reference"), seconds(180));
  ASSERT_EQ(reference.exit_code, 0) << reference.output;

  std::random_device device;
  int kill_step = std::uniform_int_distribution<int>(8, 30)(device);
  SCOPED_TRACE("killing rank 1 after step " + std::to_string(kill_step));
  Subprocess launch({LtrainBinary(), "launch", recipe}, traced("faulty"));
  ASSERT_TRUE(launch.WaitForOutput("[rank 0] step " + std::to_string(kill_step) + "/", seconds(60))) << launch.Output();
  v1::Job running = Status("faulty", "tiny-1");
  ASSERT_EQ(running.ranks_size(), 2) << running.DebugString();
  auto killed_at = std::chrono::steady_clock::now();
  ASSERT_EQ(kill(static_cast<pid_t>(running.ranks(1).pid()), SIGKILL), 0);
  ASSERT_TRUE(launch.WaitForOutput("rank 1 on local was killed by signal SIGKILL", seconds(10))) << launch.Output();
  EXPECT_LT(SecondsSince(killed_at), 1.0) << "failure detection";
  ProcessResult result = launch.Wait(seconds(180));
  ASSERT_EQ(result.exit_code, 0) << result.output;
  EXPECT_NE(result.output.find("restart 1 of 2"), std::string::npos) << result.output;
  EXPECT_NE(result.output.find("generation 1: placed"), std::string::npos) << result.output;
  v1::Job job = Status("faulty", "tiny-1");
  EXPECT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED);
  EXPECT_EQ(job.restarts(), 1);
  EXPECT_EQ(job.generation(), 1);
  EXPECT_EQ(job.last_committed_step(), 40);
  EXPECT_NE(job.last_failure().find("SIGKILL"), std::string::npos);

  // The restarted generation's load of the checkpoint it resumed from, in metrics.jsonl.
  const std::string metrics = ReadFile(dir_.Join("faulty/agent-local/jobs/tiny-1/metrics.jsonl"));
  EXPECT_TRUE(std::regex_search(metrics, std::regex(R"(\{"time": [0-9.]+, "generation": 1, "loaded_step": [0-9]+, )"
                                                    R"("load_ms": [0-9.e+-]+, "bytes": [1-9][0-9]*\})")))
      << metrics;

  std::string a = ReadFile(dir_.Join("reference/checkpoints/tiny-1/step-40/model-rank-0.safetensors"));
  std::string b = ReadFile(dir_.Join("faulty/checkpoints/tiny-1/step-40/model-rank-0.safetensors"));
  ASSERT_FALSE(a.empty());
  EXPECT_TRUE(a == b) << "final parameters differ from the uninterrupted run";

  // Sample index -> window, as every rank read it; a sample read twice (before and after the kill)
  // read the same window both times, and the same as the reference's.
  auto windows = [&](const std::string& home) {
    std::map<int64_t, std::string> out;
    for (const auto& entry : fs::directory_iterator(dir_.Join(home + "-trace"))) {
      std::istringstream lines(ReadFile(entry.path().string()));
      for (std::string line; std::getline(lines, line);) {
        const int64_t sample = std::stoll(line.substr(0, line.find('\t')));
        auto [it, inserted] = out.emplace(sample, line);
        EXPECT_TRUE(inserted || it->second == line) << home << ": " << it->second << " then " << line;
      }
    }
    return out;
  };
  const std::map<int64_t, std::string> want = windows("reference"), got = windows("faulty");
  for (int64_t sample = 0; sample < 40 * 8; ++sample) {
    ASSERT_TRUE(want.count(sample) && got.count(sample)) << "sample " << sample;
    EXPECT_EQ(got.at(sample), want.at(sample));
  }
}

// A SIGSTOPped worker: within hang_timeout + 2 s the job's events name the stopped rank and what
// the others wait in, and the job recovers.
TEST_F(RecoveryTest, HungWorkerIsNamedAndTheJobRecovers) {
  std::string recipe = Recipe("hang", "training: {steps: 60, micro_batch: 4, global_batch: 8, log_every: 1}\n"
                                      "parallel: {nproc_per_node: 2}\n"
                                      "checkpoint: {every: 5}\n"
                                      "fault: {max_restarts: 1, restart_backoff_s: 0.2, hang_timeout_s: 3}\n");
  Subprocess launch({LtrainBinary(), "launch", recipe}, Env("home"));
  ASSERT_TRUE(launch.WaitForOutput("[rank 0] step 12/", seconds(60))) << launch.Output();
  v1::Job running = Status("home", "hang-1");
  ASSERT_EQ(running.ranks_size(), 2);
  pid_t stopped = static_cast<pid_t>(running.ranks(1).pid());
  auto stopped_at = std::chrono::steady_clock::now();
  ASSERT_EQ(kill(stopped, SIGSTOP), 0);
  ASSERT_TRUE(launch.WaitForOutput("hang: rank 1 made no progress", seconds(15))) << launch.Output();
  EXPECT_LT(SecondsSince(stopped_at), 3.0 + 2.0) << "hang detection";
  std::string output = launch.Output();
  EXPECT_NE(output.find("; rank 0 waits in "), std::string::npos) << output;
  ProcessResult result = launch.Wait(seconds(120));
  EXPECT_EQ(result.exit_code, 0) << result.output;
  v1::Job job = Status("home", "hang-1");
  EXPECT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED);
  EXPECT_NE(job.last_failure().find("hang: rank 1 made no progress"), std::string::npos) << job.last_failure();
  EXPECT_FALSE(ProcessAlive(stopped));
}

// No fault keys at all: the limit is derived from the steps' times. A SIGSTOPped rank of four is
// named within that limit and 2 s, with the derivation, the collective the others wait in and the
// last one it completed; `ltrain status` printed the limit while the job ran.
TEST_F(RecoveryTest, StoppedRankIsNamedWithinTheDerivedLimit) {
  std::string recipe = Recipe("derived", "training: {steps: 5000, micro_batch: 2, global_batch: 8, log_every: 1}\n"
                                         "parallel: {nproc_per_node: 4}\n"
                                         "checkpoint: {enabled: false}\n");
  Subprocess launch({LtrainBinary(), "launch", recipe}, Env("home"));
  ASSERT_TRUE(launch.WaitForOutput("a training step's limit is now fault.hang_timeout_s auto: ", seconds(120)))
      << launch.Output();
  // The status shows it once the progress reports that carry the steps' times reached the coordinator.
  v1::Job running = Status("home", "derived-1");
  for (int i = 0; i < 100 && running.limits().step().how().find("x the slowest") == std::string::npos; ++i) {
    std::this_thread::sleep_for(milliseconds(100));
    running = Status("home", "derived-1");
  }
  ASSERT_EQ(running.ranks_size(), 4);
  const double limit_s = running.limits().step().seconds();
  EXPECT_GE(limit_s, 20) << running.limits().step().how();
  EXPECT_LE(limit_s, 600) << running.limits().step().how();
  EXPECT_EQ(running.limits().step().how().rfind("fault.hang_timeout_s auto: ", 0), 0u) << running.limits().step().how();
  ProcessResult status = RunProcess({LtrainBinary(), "status", "derived-1"}, Env("home"), seconds(30));
  EXPECT_NE(status.output.find("hang limits:    step "), std::string::npos) << status.output;
  EXPECT_NE(status.output.find("x the slowest of the last"), std::string::npos) << status.output;

  pid_t stopped = static_cast<pid_t>(running.ranks(2).pid());
  auto stopped_at = std::chrono::steady_clock::now();
  ASSERT_EQ(kill(stopped, SIGSTOP), 0);
  ASSERT_TRUE(launch.WaitForOutput("hang: rank 2 made no progress", seconds(static_cast<int>(limit_s) + 30)))
      << launch.Output();
  const double took = SecondsSince(stopped_at);
  ProcessResult result = launch.Wait(seconds(60));
  EXPECT_LT(took, limit_s + 2.0) << "hang detection within the derived limit + 2 s";
  EXPECT_NE(result.exit_code, 0) << result.output;
  v1::Job job = Status("home", "derived-1");
  EXPECT_EQ(job.state(), v1::JOB_STATE_FAILED);
  const std::string& cause = job.last_failure();
  EXPECT_TRUE(std::regex_search(cause, std::regex(R"(^hang: rank 2 made no progress for \d+s in step \d+ )"))) << cause;
  // Where rank 2 is (in a collective, or past its last one), and what the others wait in.
  EXPECT_TRUE(std::regex_search(cause, std::regex(R"(; (it is in|its last collective was) all_reduce #\d+ of world; )")))
      << cause;
  EXPECT_TRUE(std::regex_search(cause, std::regex(R"(; ranks? [0-9, -]+ waits? in all_reduce #\d+ of world)"))) << cause;
  EXPECT_NE(cause.find("; limit fault.hang_timeout_s auto: "), std::string::npos) << cause;
  // Every rank's recent collectives in one file of the job's.
  const std::string picture = dir_.Join("home/jobs/derived-1/hang-gen-0.txt");
  EXPECT_NE(cause.find("; every rank's recent collectives: " + picture), std::string::npos) << cause;
  std::ifstream file(picture);
  std::stringstream text;
  text << file.rdbuf();
  for (const char* rank : {"rank 0: step ", "rank 1: step ", "rank 2: step ", "rank 3: step "}) {
    EXPECT_NE(text.str().find(rank), std::string::npos) << text.str();
  }
  EXPECT_TRUE(std::regex_search(text.str(), std::regex(R"(  all_reduce #\d+ of world, [0-9.]+ MB, [0-9:.]+, not ended)")))
      << text.str();
  EXPECT_FALSE(ProcessAlive(stopped));
}

// Two agents, nodes {min 1, max 2}: one agent is SIGKILLed, the job goes on with one node and the
// same global batch; a third agent joins at the next checkpoint boundary.
TEST_F(RecoveryTest, LostAgentShrinksTheJobAndANewAgentJoinsAtACheckpoint) {
  std::unique_ptr<Subprocess> coordinator;
  std::string address = StartCoordinator(coordinator);
  std::unique_ptr<Subprocess> n1 = StartAgent(address, "n1");
  std::unique_ptr<Subprocess> n2 = StartAgent(address, "n2");
  std::string recipe = Recipe("elastic", "training: {steps: 400, micro_batch: 4, global_batch: 8, log_every: 1}\n"
                                         "parallel: {nodes: {min: 1, max: 2}, nproc_per_node: 1}\n"
                                         "checkpoint: {every: 10, keep: 3}\n"
                                         "fault: {max_restarts: 3, restart_backoff_s: 0.2}\n");
  // Both agents must be registered before the job is placed on two nodes.
  std::this_thread::sleep_for(milliseconds(500));
  Subprocess launch({LtrainBinary(), "launch", "--coordinator", address, recipe}, Env("home"));
  ASSERT_TRUE(launch.WaitForOutput("[rank 0] step 15/", seconds(60))) << launch.Output();
  ASSERT_NE(launch.Output().find("accumulation 1"), std::string::npos) << launch.Output();

  auto killed_at = std::chrono::steady_clock::now();
  n2->Signal(SIGKILL);
  ASSERT_TRUE(launch.WaitForOutput("node n2 lost", seconds(10))) << launch.Output();
  EXPECT_LT(SecondsSince(killed_at), 3 * 1.0 + 1.0) << "loss detection: 3 heartbeats + 1 s";
  ASSERT_TRUE(launch.WaitForOutput("generation 1: placed rank 0 on n1", seconds(20))) << launch.Output();
  ASSERT_TRUE(launch.WaitForOutput("accumulation 2 global_batch 8", seconds(30))) << launch.Output();

  std::unique_ptr<Subprocess> n3 = StartAgent(address, "n3");
  ASSERT_TRUE(launch.WaitForOutput("taking in 1 node(s) at the checkpoint of step", seconds(60))) << launch.Output();
  ASSERT_TRUE(launch.WaitForOutput("generation 2: placed rank 0 on n1", seconds(20))) << launch.Output();
  ProcessResult result = launch.Wait(seconds(240));
  EXPECT_EQ(result.exit_code, 0) << result.output;
  v1::Job job = Status("home", "elastic-1", address);
  EXPECT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED);
  EXPECT_EQ(job.generation(), 2);
  EXPECT_EQ(job.nodes_now(), 2);
  EXPECT_EQ(job.restarts(), 1);
  // Which is seen first, the lost node or its peer's broken collective, is a race; both restart.
  EXPECT_TRUE(job.last_failure().find("node n2 lost") != std::string::npos ||
              job.last_failure().find("rank 0 on n1") != std::string::npos)
      << job.last_failure();
  for (auto* agent : {n1.get(), n3.get()}) agent->Signal(SIGTERM);
  coordinator->Signal(SIGTERM);
}

// The coordinator is SIGKILLed mid-run and started again on the same state: the agents keep their
// workers, reconnect, and the job goes on to SUCCEEDED in the same generation.
TEST_F(RecoveryTest, KilledCoordinatorComesBackAndTheJobGoesOn) {
  std::unique_ptr<Subprocess> coordinator;
  std::string address = StartCoordinator(coordinator);
  int port = std::stoi(address.substr(address.rfind(':') + 1));
  std::unique_ptr<Subprocess> agent = StartAgent(address, "n1");
  std::string recipe = Recipe("durable", "training: {steps: 300, micro_batch: 4, global_batch: 8, log_every: 1}\n"
                                         "parallel: {nproc_per_node: 2}\n"
                                         "checkpoint: {every: 50}\n");
  std::this_thread::sleep_for(milliseconds(300));
  Subprocess launch({LtrainBinary(), "launch", "--coordinator", address, recipe}, Env("home"));
  ASSERT_TRUE(launch.WaitForOutput("[rank 0] step 20/", seconds(60))) << launch.Output();
  v1::Job before = Status("home", "durable-1", address);
  ASSERT_EQ(before.ranks_size(), 2);

  coordinator->Signal(SIGKILL);
  coordinator->Wait(seconds(5));
  std::this_thread::sleep_for(milliseconds(500));
  std::string again = StartCoordinator(coordinator, port);
  ASSERT_EQ(again, address);
  ProcessResult result = launch.Wait(seconds(240));
  EXPECT_EQ(result.exit_code, 0) << result.output << "\n--- coordinator\n" << coordinator->Output();
  v1::Job job = Status("home", "durable-1", address);
  EXPECT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED);
  EXPECT_EQ(job.generation(), 0) << "the workers were never restarted";
  EXPECT_EQ(job.restarts(), 0);
  for (int i = 0; i < 2; ++i) EXPECT_EQ(job.ranks(i).pid(), before.ranks(i).pid());
  // No step lost or repeated: rank 0's own log has every step once, in order, and the last commit
  // is the final step.
  std::ifstream log(job.ranks(0).log_path());
  std::string line;
  int64_t expected = 1;
  while (std::getline(log, line)) {
    if (line.rfind("step ", 0) != 0) continue;
    EXPECT_EQ(std::stoll(line.substr(5)), expected) << line;
    ++expected;
  }
  EXPECT_EQ(expected, 301);
  EXPECT_EQ(job.last_committed_step(), 300);
  agent->Signal(SIGTERM);
  coordinator->Signal(SIGTERM);
}

// Waits until `needle` appears in the process's output after byte `from`; returns where, or npos.
size_t WaitForOutputAfter(const Subprocess& process, const std::string& needle, size_t from, seconds timeout) {
  auto deadline = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < deadline) {
    std::string output = process.Output();
    size_t at = output.find(needle, from);
    if (at != std::string::npos) return at;
    std::this_thread::sleep_for(milliseconds(20));
  }
  return std::string::npos;
}

// On CPUs with Gloo a restarted generation must connect every time (torchrun's new generation
// connected to the old one's addresses and was refused there): five kills, five restarts, success.
TEST_F(RecoveryTest, GlooRestartWorksFiveTimesInARow) {
  std::string recipe = Recipe("five", "training: {steps: 400, micro_batch: 4, global_batch: 8, log_every: 1}\n"
                                      "parallel: {nproc_per_node: 2}\n"
                                      "checkpoint: {every: 5, keep: 2}\n"
                                      "fault: {max_restarts: 5, restart_backoff_s: 0.1, restart_backoff_max_s: 0.1}\n");
  Subprocess launch({LtrainBinary(), "launch", recipe}, Env("home"));
  size_t from = 0;
  for (int generation = 0; generation < 5; ++generation) {
    SCOPED_TRACE("generation " + std::to_string(generation));
    if (generation > 0) {
      from = WaitForOutputAfter(launch, "generation " + std::to_string(generation) + ": placed", from, seconds(30));
      ASSERT_NE(from, std::string::npos) << launch.Output();
    }
    // Three steps of this generation, so its Gloo mesh is up and training.
    for (int i = 0; i < 3; ++i) {
      from = WaitForOutputAfter(launch, "[rank 0] step ", from + 1, seconds(60));
      ASSERT_NE(from, std::string::npos) << launch.Output();
    }
    v1::Job job = Status("home", "five-1");
    ASSERT_EQ(job.generation(), generation);
    ASSERT_EQ(job.ranks_size(), 2);
    ASSERT_EQ(kill(static_cast<pid_t>(job.ranks(generation % 2).pid()), SIGKILL), 0);
  }
  ProcessResult result = launch.Wait(seconds(240));
  EXPECT_EQ(result.exit_code, 0) << result.output;
  v1::Job job = Status("home", "five-1");
  EXPECT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED);
  EXPECT_EQ(job.restarts(), 5);
  EXPECT_EQ(job.generation(), 5);
}

// When max_restarts is spent the job FAILS, and its cause lists every generation's failure.
TEST_F(RecoveryTest, ExhaustedRestartsFailTheJobListingEveryCause) {
  // A token file with a broken header: every generation's workers stop at start.
  fs::create_directories(dir_.Join("broken"));
  std::ofstream(dir_.Join("broken/train.bin")) << "not a token file";
  std::string recipe = dir_.Write("broken.yaml", "name: broken\ndata: {path: " + dir_.Join("broken") +
                                                     "}\nparallel: {nproc_per_node: 2}\n"
                                                     "fault: {max_restarts: 2, restart_backoff_s: 0.1}\n");
  ProcessResult result = RunProcess({LtrainBinary(), "launch", recipe}, Env("home"), seconds(120));
  EXPECT_EQ(result.exit_code, 1) << result.output;
  v1::Job job = Status("home", "broken-1");
  EXPECT_EQ(job.state(), v1::JOB_STATE_FAILED);
  EXPECT_EQ(job.restarts(), 2);
  EXPECT_NE(job.cause().find("failed 3 times, giving up after 2 restart(s)"), std::string::npos) << job.cause();
  for (int generation = 0; generation < 3; ++generation) {
    std::string line = "generation " + std::to_string(generation) + ": rank ";
    EXPECT_NE(job.cause().find(line), std::string::npos) << job.cause();
    EXPECT_NE(result.output.find("generation " + std::to_string(generation) + " failed: rank "), std::string::npos)
        << "each failure is an event\n" << result.output;
  }
  EXPECT_NE(job.cause().find("train.bin"), std::string::npos) << "the worker's own error is in the log tail";
}

// A job that FAILED (no restarts allowed) is resumed with `ltrain resume` from its last commit.
TEST_F(RecoveryTest, ResumeContinuesAFailedJobFromItsLastCommit) {
  std::string recipe = Recipe("again", "training: {steps: 30, micro_batch: 4, global_batch: 8, log_every: 1}\n"
                                       "parallel: {nproc_per_node: 2}\n"
                                       "checkpoint: {every: 5}\n");
  Subprocess launch({LtrainBinary(), "launch", recipe}, Env("home"));
  ASSERT_TRUE(launch.WaitForOutput("[rank 0] step 12/", seconds(60))) << launch.Output();
  v1::Job running = Status("home", "again-1");
  ASSERT_EQ(kill(static_cast<pid_t>(running.ranks(0).pid()), SIGKILL), 0);
  ProcessResult failed = launch.Wait(seconds(30));
  ASSERT_EQ(failed.exit_code, 1) << failed.output;
  int64_t committed = Status("home", "again-1").last_committed_step();

  ProcessResult resumed = RunProcess({LtrainBinary(), "resume", "again-1"}, Env("home"), seconds(120));
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_NE(resumed.output.find("resumed from"), std::string::npos) << resumed.output;
  // The ranks resume from the newest checkpoint that verifies on disk: the one the coordinator
  // recorded, or a later one whose commit report the kill overtook.
  const std::string marker = "/step-";
  const size_t at = resumed.output.find(marker, resumed.output.find("[rank 0] resumed from"));
  ASSERT_NE(at, std::string::npos) << resumed.output;
  const int64_t resumed_step = std::stoll(resumed.output.substr(at + marker.size()));
  EXPECT_GE(resumed_step, committed) << resumed.output;
  std::vector<double> losses = ParseLosses(resumed.output);
  EXPECT_EQ(static_cast<int64_t>(losses.size()), 30 - resumed_step) << resumed.output;
  v1::Job job = Status("home", "again-1");
  EXPECT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED);
  EXPECT_EQ(job.generation(), 1);
  // The resume did not print the first run's end again, and `ltrain logs` marks where the steps
  // begin again.
  EXPECT_EQ(resumed.output.find("job FAILED"), std::string::npos) << resumed.output;
  ProcessResult logs = RunProcess({LtrainBinary(), "logs", "again-1"}, Env("home"));
  const size_t marker_at = logs.output.find("---- generation 1 begins, resuming from the checkpoint of step");
  EXPECT_NE(marker_at, std::string::npos) << logs.output;
  EXPECT_NE(logs.output.find("[rank 0] step " + std::to_string(resumed_step + 1) + "/", marker_at), std::string::npos)
      << logs.output;

  ProcessResult twice = RunProcess({LtrainBinary(), "resume", "again-1"}, Env("home"), seconds(30));
  EXPECT_EQ(twice.exit_code, 2) << twice.output;
  EXPECT_NE(twice.output.find("only a FAILED or STOPPED job can be resumed"), std::string::npos) << twice.output;
}

// The job's checkpoint directory removed after it committed: `ltrain resume` refuses to train from step 1
// under the old job (which would say it resumed), names the directory and the step, and restarts nothing.
TEST_F(RecoveryTest, ResumeWithItsCheckpointsGoneFailsAndSaysSo) {
  std::string recipe = Recipe("gone", "training: {steps: 30, micro_batch: 4, global_batch: 8, log_every: 1}\n"
                                      "parallel: {nproc_per_node: 2}\n"
                                      "checkpoint: {every: 5}\n"
                                      "fault: {max_restarts: 2, restart_backoff_s: 0.1}\n");
  Subprocess launch({LtrainBinary(), "launch", recipe}, Env("home"));
  ASSERT_TRUE(launch.WaitForOutput("[rank 0] step 12/", seconds(60))) << launch.Output();
  // The node's log of each rank has what the launch printed while the job runs (tail -f works).
  EXPECT_NE(ReadFile(dir_.Join("home/agent-local/jobs/gone-1/gen-0/rank-0.log")).find("step 12/"), std::string::npos);
  ProcessResult stop = RunProcess({LtrainBinary(), "stop", "gone-1"}, Env("home"), seconds(60));
  ASSERT_EQ(stop.exit_code, 0) << stop.output;
  ASSERT_EQ(launch.Wait(seconds(30)).exit_code, 4);
  const int64_t committed = Status("home", "gone-1").last_committed_step();
  ASSERT_GE(committed, 5);
  const std::string checkpoints = dir_.Join("home/checkpoints/gone-1");
  ASSERT_TRUE(fs::exists(checkpoints + "/latest"));
  fs::remove_all(checkpoints);

  ProcessResult resumed = RunProcess({LtrainBinary(), "resume", "gone-1"}, Env("home"), seconds(120));
  EXPECT_EQ(resumed.exit_code, 1) << resumed.output;
  EXPECT_NE(resumed.output.find("job gone-1 committed step " + std::to_string(committed) + " in " + checkpoints +
                                ", and that directory holds no checkpoint now"),
            std::string::npos)
      << resumed.output;
  EXPECT_EQ(resumed.output.find("[rank 0] step 1/"), std::string::npos) << "nothing trained\n" << resumed.output;
  v1::Job job = Status("home", "gone-1");
  EXPECT_EQ(job.state(), v1::JOB_STATE_FAILED);
  EXPECT_EQ(job.restarts(), 0) << "a restart would find the same";
  EXPECT_EQ(job.last_committed_step(), committed);
}

// `ltrain stop --checkpoint` mid-run: both ranks train on to one step past the last periodic commit,
// commit a checkpoint of it and exit 0; the job is STOPPED with that commit, and `ltrain resume`
// trains from the step after it to the end.
TEST_F(RecoveryTest, StopWithCheckpointCommitsTheStepReachedAndResumeContinuesFromIt) {
  std::string recipe = Recipe("final", "training: {steps: 1000, micro_batch: 4, global_batch: 8, log_every: 1}\n"
                                       "parallel: {nproc_per_node: 2}\n"
                                       "checkpoint: {every: 25}\n");
  Subprocess launch({LtrainBinary(), "launch", recipe}, Env("home"));
  ASSERT_TRUE(launch.WaitForOutput("[rank 0] checkpoint step-25 written", seconds(60))) << launch.Output();
  const int64_t periodic = Status("home", "final-1").last_committed_step();
  ASSERT_GE(periodic, 25);
  ProcessResult stop = RunProcess({LtrainBinary(), "stop", "final-1", "--checkpoint"}, Env("home"), seconds(90));
  ASSERT_EQ(stop.exit_code, 0) << stop.output;
  ProcessResult stopped = launch.Wait(seconds(30));
  ASSERT_EQ(stopped.exit_code, 4) << stopped.output;

  v1::Job job = Status("home", "final-1");
  const int64_t final_step = job.last_committed_step();
  const std::string step = std::to_string(final_step);
  EXPECT_EQ(job.state(), v1::JOB_STATE_STOPPED) << job.DebugString();
  EXPECT_GT(final_step, periodic) << "the final checkpoint is of a later step than the last periodic one";
  EXPECT_LT(final_step, 1000) << stopped.output;
  EXPECT_EQ(job.cause(), "stopped by `ltrain stop --checkpoint`; final checkpoint of step " + step + " committed");
  EXPECT_NE(stop.output.find("job final-1: STOPPED: "), std::string::npos) << stop.output;
  EXPECT_NE(stopped.output.find("[rank 0] checkpoint step-" + step + " written"), std::string::npos) << stopped.output;
  for (const char* rank : {"0", "1"}) {
    std::string line = std::string("[rank ") + rank + "] rank " + rank + ": stopped after step " + step + " of 1000";
    EXPECT_NE(stopped.output.find(line), std::string::npos) << line << "\n" << stopped.output;
    EXPECT_NE(stopped.output.find(std::string("ltrain: rank ") + rank + " exited with code 0"), std::string::npos)
        << stopped.output;
  }
  EXPECT_EQ(ReadFile(dir_.Join("home/checkpoints/final-1/latest")).substr(0, 5 + step.size()), "step-" + step);

  ProcessResult resumed = RunProcess({LtrainBinary(), "resume", "final-1"}, Env("home"), seconds(300));
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_NE(resumed.output.find("resumed from the checkpoint of step " + step), std::string::npos) << resumed.output;
  EXPECT_NE(resumed.output.find("[rank 0] step " + std::to_string(final_step + 1) + "/1000 "), std::string::npos)
      << resumed.output;
  EXPECT_EQ(static_cast<int64_t>(ParseLosses(resumed.output).size()), 1000 - final_step) << resumed.output;
  v1::Job done = Status("home", "final-1");
  EXPECT_EQ(done.state(), v1::JOB_STATE_SUCCEEDED) << done.DebugString();
  EXPECT_EQ(done.generation(), 1);
  EXPECT_EQ(done.last_committed_step(), 1000);
}

}  // namespace
}  // namespace ltrain::testing
