// deploy/slurm/ against a real Slurm: munged, slurmctld and two slurmd (fake nodes n1 and n2 on
// this machine) started by tests/slurm/local_slurm.sh under a temporary folder. The job script is
// submitted with sbatch -N2 and ends as Slurm ends it: on its own, by scancel, by requeue.
// Needs root and Debian's slurmd, slurmctld, slurm-client and munge (deploy/setup.sh --tests installs
// them); fails, naming what is missing, without them.
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <regex>
#include <set>
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

// The path of `program` on PATH, or "" (Subprocess runs argv[0] as given, without a PATH search).
std::string Which(const std::string& program) {
  static std::map<std::string, std::string> known;
  if (auto it = known.find(program); it != known.end() && !it->second.empty()) return it->second;
  ProcessResult found = RunProcess({"/bin/sh", "-c", "command -v " + program}, {}, seconds(10));
  std::string path = found.exit_code == 0 ? found.output : "";
  while (!path.empty() && path.back() == '\n') path.pop_back();
  return known[program] = path;
}

// Pids of live processes whose environment holds `marker` (every process a job script starts
// inherits the environment sbatch exported).
std::vector<pid_t> ProcessesWithEnvironment(const std::string& marker) {
  std::vector<pid_t> found;
  for (const auto& entry : fs::directory_iterator("/proc")) {
    std::string name = entry.path().filename();
    if (name.empty() || !std::all_of(name.begin(), name.end(), ::isdigit)) continue;
    std::string environ = ReadFile(entry.path() / "environ");
    pid_t pid = std::stoi(name);
    if (environ.find(marker) != std::string::npos && pid != getpid() && ProcessAlive(pid)) found.push_back(pid);
  }
  return found;
}

// One Slurm for the test program: started before the first test, stopped after the last, also when
// a test failed (TearDownTestSuite runs after failed assertions too).
class SlurmTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (geteuid() != 0) {
      failure_ = "the Slurm tests need root: slurmd runs as root and munged as the munge user";
      return;
    }
    for (const char* program : {"slurmctld", "slurmd", "sbatch", "scontrol", "munged"}) {
      if (Which(program).empty()) {
        failure_ = std::string(program) + " is not installed: deploy/setup.sh --tests installs Slurm and munge";
        return;
      }
    }
    cluster_ = new TempDir();
    // munged runs as the munge user: its folder's parents must let it through.
    fs::permissions(cluster_->path(), fs::perms::others_exec | fs::perms::group_exec, fs::perm_options::add);
    ProcessResult started =
        RunProcess({SourceDir() + "/tests/slurm/local_slurm.sh", "start", cluster_->Join("slurm")}, {}, seconds(60));
    if (started.exit_code != 0) {
      failure_ = "local_slurm.sh start failed:\n" + started.output + SlurmLogs();
      return;
    }
    slurm_conf_ = cluster_->Join("slurm/slurm.conf");
  }

  static void TearDownTestSuite() {
    if (cluster_ == nullptr) return;
    if (!slurm_conf_.empty()) {
      // Jobs left by a failed test end first, so that no step outlives the daemons.
      RunProcess({Which("scancel"), "--full", "--partition", "test"}, SlurmEnv(), seconds(10));
      for (int i = 0; i < 100; ++i) {
        ProcessResult queue = RunProcess({Which("squeue"), "-h"}, SlurmEnv(), seconds(10));
        if (queue.exit_code != 0 || queue.output.empty()) break;
        std::this_thread::sleep_for(milliseconds(200));
      }
    }
    ProcessResult stopped =
        RunProcess({SourceDir() + "/tests/slurm/local_slurm.sh", "stop", cluster_->Join("slurm")}, {}, seconds(60));
    EXPECT_EQ(stopped.exit_code, 0) << stopped.output;
    for (const char* pid_file : {"slurm/slurmd-n1.pid", "slurm/slurmd-n2.pid", "slurm/slurmctld.pid",
                                 "slurm/munge/munged.pid"}) {
      std::string pid = ReadFile(cluster_->Join(pid_file));
      if (!pid.empty()) {
        EXPECT_FALSE(ProcessAlive(std::stoi(pid))) << pid_file << " still runs";
      }
    }
    delete cluster_;
    cluster_ = nullptr;
    slurm_conf_.clear();
  }

  void SetUp() override {
    ASSERT_TRUE(failure_.empty()) << failure_;
    ProcessResult prepared = PrepareLicenseData(dir_.Join("data"));
    ASSERT_EQ(prepared.exit_code, 0) << prepared.output;
  }

  static std::map<std::string, std::string> SlurmEnv() { return {{"SLURM_CONF", slurm_conf_}}; }

  static std::string SlurmLogs() {
    std::string logs;
    for (const char* log : {"slurm/slurmctld.log", "slurm/slurmd-n1.log", "slurm/slurmd-n2.log"}) {
      std::string text = ReadFile(cluster_->Join(log));
      logs += std::string("\n--- ") + log + " (tail)\n" + text.substr(text.size() > 3000 ? text.size() - 3000 : 0);
    }
    return logs;
  }

  std::string Recipe(const std::string& name, const std::string& training) {
    return dir_.Write(name + ".yaml", TinyRecipe(name, dir_.Join("data")) +
                                          "training: {" + training + ", micro_batch: 4, global_batch: 8, log_every: 1}\n"
                                          "parallel: {nproc_per_node: 1}\n"
                                          "checkpoint: {every: 10, keep: 3}\n");
  }

  std::string StateDir() const { return dir_.Join("state"); }
  std::string Marker() const { return "LTRAIN_SLURM_STATE_DIR=" + StateDir(); }

  // sbatch -N2 of the job script; returns the Slurm job id.
  std::string Submit(const std::string& recipe, const std::string& more_env = "") {
    std::vector<std::string> argv = {Which("sbatch"), "--parsable", "-N2", "--chdir", dir_.path(), "--output",
                                     dir_.Join("slurm-%j.out"),
                                     "--export=ALL,LTRAIN_BIN=" + LtrainBinary() + ",OMP_NUM_THREADS=1," + Marker() + more_env,
                                     SourceDir() + "/deploy/slurm/ltrain.sbatch", recipe};
    ProcessResult submitted = RunProcess(argv, SlurmEnv(), seconds(30));
    EXPECT_EQ(submitted.exit_code, 0) << submitted.output;
    std::string id = submitted.output.substr(0, submitted.output.find_first_of(";\n"));
    return id;
  }

  // A field of `scontrol show job -o ID` ("" once Slurm forgot the job).
  std::string JobField(const std::string& id, const std::string& field) {
    ProcessResult shown = RunProcess({Which("scontrol"), "show", "job", "-o", id}, SlurmEnv(), seconds(10));
    std::smatch match;
    std::regex pattern("(^| )" + field + "=([^ \n]*)");
    return std::regex_search(shown.output, match, pattern) ? match[2].str() : "";
  }

  // Polls until the Slurm job is in a final state; returns it ("" on timeout).
  std::string WaitForSlurmJobEnd(const std::string& id, seconds timeout) {
    static const std::set<std::string> kFinal = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT",
                                                 "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL",
                                                 "DEADLINE"};
    auto deadline = std::chrono::steady_clock::now() + timeout;
    while (std::chrono::steady_clock::now() < deadline) {
      std::string state = JobField(id, "JobState");
      if (kFinal.count(state)) return state;
      std::this_thread::sleep_for(milliseconds(200));
    }
    return "";
  }

  std::string SlurmOutput(const std::string& id) { return ReadFile(dir_.Join("slurm-" + id + ".out")); }

  // The job the script recorded, read offline from the state directory.
  std::string LtrainJobId() {
    std::string id = ReadFile(StateDir() + "/job_id");
    while (!id.empty() && id.back() == '\n') id.pop_back();
    return id;
  }
  v1::Job LtrainJob(const std::string& job_id) {
    return JobStatus(job_id, {{"LTRAIN_HOME", StateDir()}}, {}, nullptr, seconds(10));
  }

  // Polls the job record until `predicate` holds.
  bool WaitForLtrainJob(const std::function<bool(const v1::Job&)>& predicate, seconds timeout) {
    auto deadline = std::chrono::steady_clock::now() + timeout;
    while (std::chrono::steady_clock::now() < deadline) {
      std::string job_id = LtrainJobId();
      if (!job_id.empty() && predicate(LtrainJob(job_id))) return true;
      std::this_thread::sleep_for(milliseconds(250));
    }
    return false;
  }

  // The checkpoint of the job's last commit is there and `latest` names it.
  void ExpectLastCommitIntact(const v1::Job& job) {
    ASSERT_GT(job.last_committed_step(), 0) << job.DebugString();
    std::string step = "step-" + std::to_string(job.last_committed_step());
    EXPECT_TRUE(fs::is_directory(job.last_committed_path())) << job.last_committed_path();
    EXPECT_EQ(fs::path(job.last_committed_path()).filename(), step);
    // A commit can land while the job is being stopped, after the coordinator last heard of one:
    // `latest` names the recorded step or a newer one, and a resume takes that.
    EXPECT_GE(LatestStep(job), job.last_committed_step());
  }

  static int64_t LatestStep(const v1::Job& job) {
    std::string latest = ReadFile((fs::path(job.last_committed_path()).parent_path() / "latest").string());
    return latest.rfind("step-", 0) == 0 ? std::stoll(latest.substr(5)) : -1;
  }

  // Waits until the job runs on both nodes and has committed a checkpoint; returns the worker pids.
  std::vector<pid_t> WaitForCommittedRunningJob() {
    std::vector<pid_t> workers;
    bool running = WaitForLtrainJob(
        [](const v1::Job& job) {
          return job.state() == v1::JOB_STATE_RUNNING && job.last_committed_step() >= 10 && job.ranks_size() == 2;
        },
        seconds(60));
    if (!running) return workers;
    v1::Job job = LtrainJob(LtrainJobId());
    for (const auto& rank : job.ranks()) workers.push_back(static_cast<pid_t>(rank.pid()));
    return workers;
  }

  void ExpectNoProcessLeft(seconds timeout) {
    auto deadline = std::chrono::steady_clock::now() + timeout;
    std::vector<pid_t> left = ProcessesWithEnvironment(Marker());
    while (!left.empty() && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(milliseconds(100));
      left = ProcessesWithEnvironment(Marker());
    }
    for (pid_t pid : left) {
      ADD_FAILURE() << "process " << pid << " of the job still runs: " << ReadFile("/proc/" + std::to_string(pid) + "/cmdline");
    }
  }

  TempDir dir_;
  static inline TempDir* cluster_ = nullptr;
  static inline std::string slurm_conf_;
  static inline std::string failure_;
};

// deploy/slurm/README.md's commands as written, with this checkout's deploy/slurm for the package's and
// a CPU recipe for recipe.yaml: the sbatch command, one's own sbatch script around ltrain-slurm.sh,
// and the status command by hand during the job. The test nodes have four (file) GPUs each, so
// --gpus-per-node=4 is granted; the CPU recipe keeps its one rank per node. The state directories are
// the guide's default, under $HOME.
TEST_F(SlurmTest, TheGuidesCommandsRunAsWritten) {
  const std::string guide = ReadFile(SourceDir() + "/deploy/slurm/README.md");
  std::vector<std::string> blocks;
  for (size_t at = guide.find("```sh\n"); at != std::string::npos; at = guide.find("```sh\n", at)) {
    const size_t end = guide.find("```", at + 6);
    blocks.push_back(guide.substr(at + 6, end - at - 6));
    at = end + 3;
  }
  ASSERT_EQ(blocks.size(), 3u) << "the guide's sh blocks changed: adapt this test";
  auto adapt = [&](std::string text, const std::string& recipe) {
    for (const auto& [from, to] : std::vector<std::pair<std::string, std::string>>{
             {"/usr/share/ltrain/deploy/slurm", SourceDir() + "/deploy/slurm"}, {"recipe.yaml", recipe}}) {
      for (size_t at = text.find(from); at != std::string::npos; at = text.find(from, at + to.size())) {
        text.replace(at, from.size(), to);
      }
    }
    return text;
  };
  std::map<std::string, std::string> env = SlurmEnv();
  env["LTRAIN_BIN"] = LtrainBinary();
  env["OMP_NUM_THREADS"] = "1";
  env["HOME"] = dir_.path();
  auto submitted_id = [](const ProcessResult& result) {
    std::smatch m;
    return std::regex_search(result.output, m, std::regex(R"(Submitted batch job (\d+))")) ? m[1].str() : "";
  };

  // 1. sbatch -N 2 --gpus-per-node=4 .../ltrain.sbatch recipe.yaml
  ProcessResult first = RunProcess({"/bin/bash", "-c", "cd " + dir_.path() + " && " +
                                                           adapt(blocks[0], Recipe("guide1", "steps: 20"))},
                                   env, seconds(30));
  const std::string id1 = submitted_id(first);
  ASSERT_FALSE(id1.empty()) << blocks[0] << first.output;
  ASSERT_EQ(WaitForSlurmJobEnd(id1, seconds(90)), "COMPLETED") << ReadFile(dir_.Join("ltrain-" + id1 + ".out")) << SlurmLogs();
  const std::string out1 = ReadFile(dir_.Join("ltrain-" + id1 + ".out"));
  EXPECT_NE(out1.find("4 GPU(s)"), std::string::npos) << out1;
  EXPECT_NE(out1.find("ltrain: job SUCCEEDED"), std::string::npos) << out1;
  // The agents are there before the job, and only their warnings reach the job's output.
  EXPECT_EQ(out1.find("waiting for nodes"), std::string::npos) << out1;
  EXPECT_EQ(out1.find(" agent] "), std::string::npos) << out1;

  // 2. one's own sbatch script, and 3. ltrain status by hand while it runs.
  const std::string script = dir_.Write("own.sbatch", "#!/bin/bash\n" + adapt(blocks[1], Recipe("guide2", "steps: 200")));
  ProcessResult second = RunProcess({"/bin/bash", "-c", "cd " + dir_.path() + " && sbatch " + script}, env, seconds(30));
  const std::string id2 = submitted_id(second);
  ASSERT_FALSE(id2.empty()) << second.output;
  const std::string out2_path = dir_.Join("slurm-" + id2 + ".out");
  std::smatch where;
  const std::regex address(R"(coordinator at (\S+), state in (\S+))");
  const auto deadline = std::chrono::steady_clock::now() + seconds(60);
  std::string out2;
  while (!std::regex_search(out2 = ReadFile(out2_path), where, address) && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(milliseconds(100));
  }
  ASSERT_FALSE(where.empty()) << out2 << SlurmLogs();
  while (ReadFile(out2_path).find("guide2-1 submitted") == std::string::npos && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(milliseconds(100));
  }
  std::string by_hand = blocks[2];
  by_hand.replace(by_hand.find("HOST:PORT"), 9, where[1].str());
  by_hand.replace(0, by_hand.find(' '), LtrainBinary());  // `ltrain` is this build's
  std::map<std::string, std::string> hand_env = env;
  hand_env["LTRAIN_SLURM_STATE_DIR"] = where[2].str();
  ProcessResult status = RunProcess({"/bin/bash", "-c", by_hand}, hand_env, seconds(30));
  EXPECT_EQ(status.exit_code, 0) << by_hand << "\n" << status.output;
  EXPECT_NE(status.output.find("guide2-1"), std::string::npos) << status.output;
  ASSERT_EQ(WaitForSlurmJobEnd(id2, seconds(120)), "COMPLETED") << ReadFile(out2_path) << SlurmLogs();
  EXPECT_NE(ReadFile(out2_path).find("ltrain: job SUCCEEDED"), std::string::npos) << ReadFile(out2_path);
}

// sbatch -N2: a coordinator on n1, an agent on each of n1 and n2, one rank on each; the training
// job SUCCEEDS and the Slurm job COMPLETES with the job's exit code 0. (With LTRAIN_SLURM_TLS=0, the
// opt-out of TLS: the token in clear text, said so.)
TEST_F(SlurmTest, BatchJobTrainsOnBothNodesAndCompletes) {
  auto started = std::chrono::steady_clock::now();
  std::string id = Submit(Recipe("slurmtiny", "steps: 30"), ",LTRAIN_SLURM_TLS=0");
  ASSERT_FALSE(id.empty());
  std::string state = WaitForSlurmJobEnd(id, seconds(90));
  std::string output = SlurmOutput(id);
  ASSERT_EQ(state, "COMPLETED") << output << SlurmLogs();
  EXPECT_EQ(JobField(id, "ExitCode"), "0:0");
  EXPECT_EQ(JobField(id, "NodeList"), "n[1-2]");
  EXPECT_NE(output.find("ltrain: job SUCCEEDED"), std::string::npos) << output;
  EXPECT_NE(output.find("[rank 0] step 30/30"), std::string::npos) << output;

  std::string job_id = LtrainJobId();
  ASSERT_EQ(job_id, "slurmtiny-1") << output;
  v1::Job job = LtrainJob(job_id);
  EXPECT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED) << job.DebugString();
  EXPECT_EQ(job.world_size(), 2);
  EXPECT_EQ(job.last_committed_step(), 30);
  std::set<std::string> nodes;
  for (const auto& rank : job.ranks()) nodes.insert(rank.node_id());
  EXPECT_EQ(nodes, (std::set<std::string>{"n1", "n2"})) << job.DebugString();
  // Each node's agent wrote its rank's log under its own work directory.
  EXPECT_TRUE(fs::exists(StateDir() + "/nodes/n1")) << output;
  EXPECT_TRUE(fs::exists(StateDir() + "/nodes/n2")) << output;
  // The coordinator, on every interface, required the allocation's token, which only this user reads.
  const std::string token = StateDir() + "/token";
  ASSERT_TRUE(fs::exists(token)) << output;
  EXPECT_EQ(fs::status(token).permissions() & (fs::perms::group_all | fs::perms::others_all), fs::perms::none);
  EXPECT_EQ(ReadFile(token).size(), 40u);
  EXPECT_EQ(ReadFile(StateDir() + "/coordinator.log").find("anyone who reaches it can drive it"), std::string::npos)
      << ReadFile(StateDir() + "/coordinator.log");
  ExpectNoProcessLeft(seconds(5));
  RecordProperty("seconds", std::to_string(std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count()));
}

// By default the coordinator serves TLS with a CA made for the allocation, and the agents on both
// nodes, the launch and the script's own status calls all reach it through it.
TEST_F(SlurmTest, ByDefaultTheJobRunsOverTlsWithItsToken) {
  std::string id = Submit(Recipe("slurmtls", "steps: 5"));
  ASSERT_FALSE(id.empty());
  std::string state = WaitForSlurmJobEnd(id, seconds(90));
  std::string output = SlurmOutput(id);
  ASSERT_EQ(state, "COMPLETED") << output << SlurmLogs();
  EXPECT_NE(output.find("ltrain: job SUCCEEDED"), std::string::npos) << output;
  EXPECT_TRUE(fs::exists(StateDir() + "/tls/ca.pem")) << output;
  const std::string log = ReadFile(StateDir() + "/coordinator.log");
  EXPECT_EQ(log.find("without TLS"), std::string::npos) << log;
  EXPECT_EQ(log.find("without a token"), std::string::npos) << log;
  ExpectNoProcessLeft(seconds(5));
}

// The batch shell's SIGTERM (what --signal=B:TERM@300 sends before the time limit, and
// `scancel --batch --signal=TERM`): the ranks train on to one step, commit a final checkpoint of it
// (newer than the last periodic one, every 10 steps) and exit; the job ends STOPPED with that commit
// and no process left. `scontrol requeue` runs the script again, which resumes the job from that
// commit to the end.
TEST_F(SlurmTest, SigtermStopsTheJobAfterAFinalCheckpointAndRequeueResumesItFromThere) {
  std::string id = Submit(Recipe("slurmstop", "steps: 2000"));
  ASSERT_FALSE(id.empty());
  std::vector<pid_t> workers = WaitForCommittedRunningJob();
  ASSERT_EQ(workers.size(), 2u) << SlurmOutput(id) << SlurmLogs();
  // Every periodic commit so far is at most this step: the signal comes after this status.
  const int64_t periodic_at_signal = LtrainJob(LtrainJobId()).last_committed_step();

  ProcessResult signalled = RunProcess({Which("scancel"), "--batch", "--signal=TERM", id}, SlurmEnv(), seconds(10));
  ASSERT_EQ(signalled.exit_code, 0) << signalled.output;
  std::string state = WaitForSlurmJobEnd(id, seconds(60));
  std::string output = SlurmOutput(id);
  EXPECT_EQ(state, "FAILED") << output;
  EXPECT_EQ(JobField(id, "ExitCode"), "4:0") << "ltrain's exit code for a STOPPED job";
  for (pid_t pid : workers) EXPECT_FALSE(ProcessAlive(pid)) << "worker " << pid << " survived";
  ExpectNoProcessLeft(seconds(5));
  v1::Job stopped = LtrainJob(LtrainJobId());
  const int64_t latest_at_stop = LatestStep(stopped);
  EXPECT_EQ(stopped.state(), v1::JOB_STATE_STOPPED) << stopped.DebugString() << "\n" << output;
  ExpectLastCommitIntact(stopped);
  // The final checkpoint: taken on the signal, of a step after the last periodic commit, by both ranks.
  const std::string final_step = std::to_string(stopped.last_committed_step());
  EXPECT_GT(stopped.last_committed_step(), periodic_at_signal) << output;
  EXPECT_EQ(latest_at_stop, stopped.last_committed_step());
  EXPECT_NE(stopped.cause().find("final checkpoint of step " + final_step + " committed"), std::string::npos)
      << stopped.cause();
  EXPECT_NE(output.find("ltrain-slurm: SIGTERM: stopping job " + LtrainJobId() + " after a final checkpoint"),
            std::string::npos)
      << output;
  EXPECT_NE(output.find("[rank 0] checkpoint step-" + final_step + " written"), std::string::npos) << output;
  for (const char* rank : {"0", "1"}) {
    std::string line = std::string("[rank ") + rank + "] rank " + rank + ": stopped after step " + final_step;
    EXPECT_NE(output.find(line), std::string::npos) << line << "\n" << output;
  }

  // Requeued, the job waits for its begin time (two minutes): move that to now once it is pending.
  // slurmd refuses to launch a job it ended moments ago ("Job 1 already killed, do not launch
  // batch job"): give it the few seconds a real requeue always has.
  std::this_thread::sleep_for(seconds(3));
  ProcessResult requeued = RunProcess({Which("scontrol"), "requeue", id}, SlurmEnv(), seconds(10));
  ASSERT_EQ(requeued.exit_code, 0) << requeued.output;
  auto deadline = std::chrono::steady_clock::now() + seconds(30);
  std::string seen;
  while (std::chrono::steady_clock::now() < deadline) {
    seen = JobField(id, "JobState") + " restarts " + JobField(id, "Restarts");
    if (seen == "RUNNING restarts 1") break;
    if (seen == "PENDING restarts 1") RunProcess({Which("scontrol"), "update", "jobid=" + id, "StartTime=now"}, SlurmEnv(), seconds(10));
    std::this_thread::sleep_for(milliseconds(200));
  }
  ASSERT_EQ(seen, "RUNNING restarts 1") << SlurmOutput(id) << SlurmLogs();
  state = WaitForSlurmJobEnd(id, seconds(90));
  output = SlurmOutput(id);
  ASSERT_EQ(state, "COMPLETED") << output << SlurmLogs();
  std::string resumed_from = "resumed from the checkpoint of step " + std::to_string(stopped.last_committed_step());
  EXPECT_NE(output.find("(restart 1)"), std::string::npos) << output;
  EXPECT_NE(output.find(resumed_from), std::string::npos) << output;
  v1::Job job = LtrainJob(LtrainJobId());
  EXPECT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED) << job.DebugString();
  EXPECT_EQ(job.generation(), 1);
  EXPECT_EQ(job.last_committed_step(), 2000);
  // Rank 0 of the second generation trained only the steps after the commit.
  std::ifstream log(StateDir() + "/nodes/n1/jobs/" + LtrainJobId() + "/gen-1/rank-0.log");
  std::string line;
  while (std::getline(log, line) && line.rfind("step ", 0) != 0) {
  }
  EXPECT_EQ(line.rfind("step " + std::to_string(latest_at_stop + 1) + "/", 0), 0u) << line;
  ExpectNoProcessLeft(seconds(5));
}

// A plain scancel: Slurm sends SIGTERM to every process of the job at once (agents, workers,
// coordinator, launch) and srun ends the agents' step. Every process ends, the last commit is
// intact, and the record is STOPPED: the coordinator ignores SIGTERM and outlives the agents, so
// their goodbyes, or launch's stop on its own SIGTERM, reach it.
TEST_F(SlurmTest, ScancelEndsEveryProcessKeepsTheLastCommitAndRecordsTheJobStopped) {
  std::string id = Submit(Recipe("slurmcancel", "steps: 1000000"));
  ASSERT_FALSE(id.empty());
  std::vector<pid_t> workers = WaitForCommittedRunningJob();
  ASSERT_EQ(workers.size(), 2u) << SlurmOutput(id) << SlurmLogs();

  auto cancelled_at = std::chrono::steady_clock::now();
  ProcessResult cancelled = RunProcess({Which("scancel"), id}, SlurmEnv(), seconds(10));
  ASSERT_EQ(cancelled.exit_code, 0) << cancelled.output;
  std::string state = WaitForSlurmJobEnd(id, seconds(60));
  std::string output = SlurmOutput(id);
  EXPECT_EQ(state, "CANCELLED") << output;
  // Well before KillWait (30 s), when Slurm would SIGKILL what is left.
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - cancelled_at).count(), 15.0) << output;
  for (pid_t pid : workers) EXPECT_FALSE(ProcessAlive(pid)) << "worker " << pid << " survived scancel";
  ExpectNoProcessLeft(seconds(5));

  v1::Job job = LtrainJob(LtrainJobId());
  EXPECT_EQ(job.state(), v1::JOB_STATE_STOPPED) << job.DebugString() << "\n" << output;
  std::printf("ltrain job after scancel: %s (%s)\n", v1::JobState_Name(job.state()).c_str(), job.cause().c_str());
  ExpectLastCommitIntact(job);
}

}  // namespace
}  // namespace ltrain::testing
