// In-place recovery (fault.recovery: in_place) through `ltrain launch`: a rank SIGKILLed mid-run is
// replaced beside the survivors, which keep their processes; the replacement takes its state from a
// peer's memory, the step in flight is redone, and the run ends as an uninterrupted one would, bit
// for bit, in the same generation, with nothing read from a checkpoint.
#include <gtest/gtest.h>

#include <cmath>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <map>
#include <regex>
#include <set>
#include <string>
#include <vector>

#include "ltrain/v1/ltrain.pb.h"
#include "tests/support/job_status.h"
#include "tests/support/subprocess.h"

namespace ltrain::testing {
namespace {

namespace fs = std::filesystem;

constexpr int kSteps = 200;
constexpr int kKillStep = 50;

class InPlaceRecoveryTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ProcessResult prepared = PrepareLicenseData(dir_.Join("data"));
    ASSERT_EQ(prepared.exit_code, 0) << prepared.output;
  }

  // dp4, or dp2 x tp2 with `tp`; under ZeRO `zero` with copies of the shards after every step.
  std::string Recipe(const std::string& name, const std::string& checkpoints, int tp = 1, int zero = 0,
                     int checkpoint_every = 0, int max_restarts = 2) {
    return dir_.Write(name + ".yaml", TinyRecipe(name, dir_.Join("data")) +
                                          "training: {steps: " + std::to_string(kSteps) +
                                          ", micro_batch: 2, global_batch: 8, log_every: 1, deterministic: true}\n"
                                          "parallel: {nproc_per_node: 4, tp: " + std::to_string(tp) +
                                          ", zero: " + std::to_string(zero) + "}\n"
                                          "checkpoint: {every: " + std::to_string(checkpoint_every) + ", dir: " +
                                          checkpoints + "}\n"
                                          "fault: {recovery: in_place, max_restarts: " + std::to_string(max_restarts) +
                                          (zero > 0 ? ", memory_checkpoint_every: 1" : "") + "}\n");
  }

  std::map<std::string, std::string> Env() const { return {{"LTRAIN_HOME", dir_.Join("home")}}; }

  // "[rank 0] step S/N loss L" of each step, as printed.
  static std::map<int, std::string> LossLines(const std::string& output) {
    std::map<int, std::string> lines;
    static const std::regex line(R"(\[rank 0\] step (\d+)/\d+ loss (\S+))");
    for (std::sregex_iterator it(output.begin(), output.end(), line), end; it != end; ++it) {
      lines[std::stoi((*it)[1])] = (*it)[2];
    }
    return lines;
  }

  // The pids each rank printed in its "rank R/W up: pid P" line, in order.
  static std::map<int, std::vector<std::string>> Pids(const std::string& output) {
    std::map<int, std::vector<std::string>> pids;
    static const std::regex line(R"(\[rank (\d+)\] rank \d+/\d+ up: pid (\d+))");
    for (std::sregex_iterator it(output.begin(), output.end(), line), end; it != end; ++it) {
      pids[std::stoi((*it)[1])].push_back((*it)[2]);
    }
    return pids;
  }

  // Every file of the final checkpoint's step directory, by name.
  static std::map<std::string, std::string> FinalFiles(const std::string& checkpoints) {
    std::map<std::string, std::string> files;
    const fs::path step = fs::path(checkpoints) / ("step-" + std::to_string(kSteps));
    std::error_code ec;
    for (const auto& entry : fs::directory_iterator(step, ec)) {
      const std::string name = entry.path().filename().string();
      if (name.find(".safetensors") != std::string::npos) files[name] = ReadFile(entry.path().string());
    }
    return files;
  }

  // Runs the layout uninterrupted and with LTRAIN_FAULT_KILL=`kill`, checks that the killed run
  // succeeded in generation 0 with `restarts` replacements, reading no checkpoint, training every step
  // once with the uninterrupted run's losses and final state, bit for bit; returns its output.
  std::string RunKilled(int tp, const std::string& kill, int restarts, int zero = 0);
  void KillAndCompare(int tp, int killed, int source);

  TempDir dir_;
};

std::string InPlaceRecoveryTest::RunKilled(int tp, const std::string& kill, int restarts, int zero) {
  const std::string plain_dir = dir_.Join("ck-plain"), killed_dir = dir_.Join("ck-killed");
  ProcessResult plain =
      RunProcess({LtrainBinary(), "launch", Recipe("plain", plain_dir, tp, zero)}, Env(), std::chrono::seconds(300));
  EXPECT_EQ(plain.exit_code, 0) << WithoutStepLines(plain.output);
  std::map<std::string, std::string> env = Env();
  env["LTRAIN_FAULT_KILL"] = kill;
  ProcessResult run =
      RunProcess({LtrainBinary(), "launch", Recipe("killed", killed_dir, tp, zero)}, env, std::chrono::seconds(300));
  EXPECT_EQ(run.exit_code, 0) << WithoutStepLines(run.output);
  const std::string& out = run.output;

  // The same generation: no restart of the job, and no rank read a checkpoint.
  v1::Job job = JobStatus("killed-1", Env());
  EXPECT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED) << job.cause();
  EXPECT_EQ(job.generation(), 0);
  EXPECT_EQ(job.restarts(), restarts);
  // One recovery (however many ranks it replaced); under ZeRO the members went back one step, to the
  // newest copies every shard had (the killed rank died before its copies of step 50).
  const int lost = zero > 0 ? 1 : 0;
  EXPECT_EQ(job.recoveries(), 1);
  EXPECT_EQ(job.lost_steps(), lost);
  EXPECT_NE(run.output.find("; work lost: " + std::to_string(lost) + (lost == 1 ? " step" : " steps")), std::string::npos)
      << WithoutStepLines(run.output);
  EXPECT_EQ(out.find("generation 1"), std::string::npos) << WithoutStepLines(out);
  EXPECT_EQ(out.find("resumed from"), std::string::npos) << WithoutStepLines(out);

  // Steps trained = steps asked, each once, and every loss after the kill is the uninterrupted run's.
  std::map<int, std::string> a = LossLines(plain.output), b = LossLines(out);
  EXPECT_EQ(a.size(), static_cast<size_t>(kSteps)) << WithoutStepLines(plain.output);
  EXPECT_EQ(b.size(), static_cast<size_t>(kSteps)) << WithoutStepLines(out);
  for (int s = 1; s <= kSteps; ++s) EXPECT_EQ(a[s], b[s]) << "step " << s;
  // And so are the parameters and moments the final checkpoint holds, byte for byte.
  std::map<std::string, std::string> fa = FinalFiles(plain_dir), fb = FinalFiles(killed_dir);
  EXPECT_FALSE(fa.empty()) << plain_dir;
  EXPECT_EQ(fa.size(), fb.size());
  for (const auto& [name, bytes] : fa) EXPECT_TRUE(fb[name] == bytes) << name << " differs";
  return out;
}

// Kills `killed` after step 50 of a run of the layout, and holds the run against an uninterrupted one.
void InPlaceRecoveryTest::KillAndCompare(int tp, int killed, int source) {
  const std::string k = std::to_string(killed);
  const std::string out = RunKilled(tp, std::to_string(kKillStep) + ":" + k, 1);
  EXPECT_NE(out.find("[rank " + k + "] rank " + k + ": killing itself after step 50 at "), std::string::npos) << WithoutStepLines(out);
  // The survivors kept their processes: each started once; the killed rank twice, the second time as
  // the replacement that received the state of step 50 from a peer of its data-parallel group.
  std::map<int, std::vector<std::string>> pids = Pids(out);
  for (int rank = 0; rank < 4; ++rank) {
    if (rank == killed) continue;
    EXPECT_EQ(pids[rank].size(), 1u) << "rank " << rank << "\n" << WithoutStepLines(out);
    EXPECT_NE(out.find("[rank " + std::to_string(rank) + "] rank " + std::to_string(rank) + ": joined membership 1"),
              std::string::npos)
        << WithoutStepLines(out);
  }
  ASSERT_EQ(pids[killed].size(), 2u) << WithoutStepLines(out);
  EXPECT_NE(pids[killed][0], pids[killed][1]);
  EXPECT_NE(out.find("[rank " + k + "] rank " + k + ": received the state of step 50 from rank " + std::to_string(source)),
            std::string::npos)
      << WithoutStepLines(out);
  EXPECT_NE(out.find("replacing rank " + k + " in place"), std::string::npos) << WithoutStepLines(out);
  EXPECT_NE(out.find("rank " + k + " is back"), std::string::npos) << WithoutStepLines(out);
}

TEST_F(InPlaceRecoveryTest, AKilledRankOfDp4IsReplacedInPlaceAndTheRunEqualsAnUninterruptedOne) {
  KillAndCompare(/*tp=*/1, /*killed=*/2, /*source=*/0);
}

// dp2 x tp2: rank 1 holds tp part 1 with rank 3, which fills its replacement.
TEST_F(InPlaceRecoveryTest, AKilledRankOfDp2Tp2IsFilledByItsDataParallelPeer) {
  KillAndCompare(/*tp=*/2, /*killed=*/1, /*source=*/3);
}

// Two failures: rank 2 dies after step 50, and rank 3 as it begins to recover from that. Membership 1
// never forms; the members still connecting to it give way to membership 2, where both replacements
// take their state from a survivor.
TEST_F(InPlaceRecoveryTest, ASecondKillWhileTheFirstRecoveryRunsIsReplacedToo) {
  const std::string out = RunKilled(/*tp=*/1, "50:2,recovery:3", 2);
  EXPECT_NE(out.find("[rank 3] rank 3: killing itself as it begins to recover"), std::string::npos) << WithoutStepLines(out);
  std::map<int, std::vector<std::string>> pids = Pids(out);
  for (int rank : {0, 1}) {
    EXPECT_EQ(pids[rank].size(), 1u) << "rank " << rank << "\n" << WithoutStepLines(out);
    EXPECT_NE(out.find("[rank " + std::to_string(rank) + "] rank " + std::to_string(rank) + ": joined membership 2"),
              std::string::npos)
        << WithoutStepLines(out);
  }
  for (int rank : {2, 3}) {
    EXPECT_EQ(pids[rank].size(), 2u) << "rank " << rank << "\n" << WithoutStepLines(out);
    EXPECT_NE(out.find("[rank " + std::to_string(rank) + "] rank " + std::to_string(rank) +
                       ": received the state of step 50 from rank 0"),
              std::string::npos)
        << WithoutStepLines(out);
  }
}

// dp4 under ZeRO-1: each rank alone holds its shard of the moments, and a copy of it sits in the
// next rank's memory after every step. Rank 2 dies after step 50, before its copies of step 50: its
// replacement takes step 49's shard from rank 3, every survivor goes back to its own copy of step 49,
// and step 50 is trained again, to the same loss.
TEST_F(InPlaceRecoveryTest, AKilledRankOfDp4UnderZero1IsFilledFromTheCopyOfItsShard) {
  const std::string out = RunKilled(/*tp=*/1, "50:2", 1, /*zero=*/1);
  std::map<int, std::vector<std::string>> pids = Pids(out);
  for (int rank : {0, 1, 3}) {
    EXPECT_EQ(pids[rank].size(), 1u) << "rank " << rank << "\n" << WithoutStepLines(out);
    EXPECT_NE(out.find("[rank " + std::to_string(rank) + "] rank " + std::to_string(rank) +
                       ": went back to its copy of step 49 (1 completed step(s) to train again)"),
              std::string::npos)
        << WithoutStepLines(out);
  }
  EXPECT_EQ(pids[2].size(), 2u) << WithoutStepLines(out);
  EXPECT_NE(out.find("[rank 2] rank 2: received its shard of step 49 from rank 3's memory"), std::string::npos) << WithoutStepLines(out);
  EXPECT_NE(out.find("[rank 3] rank 3: went back to its copy of step 49 (1 completed step(s) to train again); sent "
                     "the copy it held to rank(s) 2"),
            std::string::npos)
      << WithoutStepLines(out);
}

// Rank 2 dies, then rank 3, which held the only copy of rank 2's shard, as it begins to recover: no
// copy survives in memory, the ranks say so, and the job restarts from its storage checkpoint (step
// 40) and still ends as an uninterrupted run does.
TEST_F(InPlaceRecoveryTest, UnderZero1AKillOfTheRankHoldingTheCopyFallsBackToTheStorageCheckpoint) {
  const std::string plain_dir = dir_.Join("ck-plain"), killed_dir = dir_.Join("ck-killed");
  ProcessResult plain = RunProcess({LtrainBinary(), "launch", Recipe("plain", plain_dir, 1, 1, 20, 3)}, Env(),
                                   std::chrono::seconds(300));
  ASSERT_EQ(plain.exit_code, 0) << WithoutStepLines(plain.output);
  std::map<std::string, std::string> env = Env();
  env["LTRAIN_FAULT_KILL"] = "50:2,recovery:3";
  ProcessResult run = RunProcess({LtrainBinary(), "launch", Recipe("killed", killed_dir, 1, 1, 20, 3)}, env,
                                 std::chrono::seconds(300));
  ASSERT_EQ(run.exit_code, 0) << WithoutStepLines(run.output);
  const std::string& out = run.output;
  v1::Job job = JobStatus("killed-1", Env());
  const std::string shown = WithoutStepLines(out) + "\nthe job's last failure: " + job.last_failure();
  EXPECT_NE(out.find("no copy of rank 2's shard (its copy was on rank 3)"), std::string::npos) << shown;
  EXPECT_NE(out.find("restarts from its last checkpoint"), std::string::npos) << shown;
  EXPECT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED) << job.cause();
  EXPECT_EQ(job.generation(), 1) << "one restart of the whole job, after the two replacements\n" << shown;
  EXPECT_NE(out.find("resumed from"), std::string::npos) << WithoutStepLines(out);
  std::map<int, std::string> a = LossLines(plain.output), b = LossLines(out);
  for (int s = 1; s <= kSteps; ++s) EXPECT_EQ(a[s], b[s]) << "step " << s;
}

// Two nodes of two ranks each, dp4: node n2's agent is SIGKILLed (its ranks die with it) and no node
// is left to replace them. Ranks 0 and 1 go on in their processes, in the same generation, as dp2 with
// two micro-batches each a step instead of one: the optimizer sees the recipe's global batch, and
// every loss stays within 1e-6 (relative) of an uninterrupted run's on the same two nodes.
TEST_F(InPlaceRecoveryTest, ANodeLostWithNoReplacementLeavesTheOthersTrainingTheWholeBatch) {
  const std::string port_file = dir_.Join("coordinator.port");
  Subprocess coordinator({LtrainBinary(), "coordinator", "--listen", "127.0.0.1:0", "--port-file", port_file,
                          "--state-dir", dir_.Join("coordinator")},
                         Env());
  const int port = WaitForPortFile(port_file);
  ASSERT_GT(port, 0) << coordinator.Output();
  const std::string address = "127.0.0.1:" + std::to_string(port);
  std::map<std::string, std::string> env = Env();
  env["LTRAIN_TOKEN_FILE"] = dir_.Join("coordinator/token");
  auto agent = [&](const std::string& node) {
    return std::make_unique<Subprocess>(
        std::vector<std::string>{LtrainBinary(), "agent", "--coordinator", address, "--node-id", node, "--work-dir",
                                 dir_.Join("agent-" + node), "--coordinator-grace", "60"},
        env);
  };
  std::unique_ptr<Subprocess> n1 = agent("n1"), n2 = agent("n2");
  auto recipe = [&](const std::string& name) {
    return dir_.Write(name + ".yaml", TinyRecipe(name, dir_.Join("data")) +
                                          "training: {steps: " + std::to_string(kSteps) +
                                          ", micro_batch: 2, global_batch: 8, log_every: 1, deterministic: true}\n"
                                          "parallel: {nodes: 2, nproc_per_node: 2}\n"
                                          "checkpoint: {every: 0}\n"
                                          "fault: {recovery: in_place, max_restarts: 2}\n");
  };
  ProcessResult plain = RunProcess({LtrainBinary(), "launch", "--coordinator", address, recipe("plain")}, env,
                                   std::chrono::seconds(300));
  ASSERT_EQ(plain.exit_code, 0) << WithoutStepLines(plain.output);

  Subprocess launch({LtrainBinary(), "launch", "--coordinator", address, recipe("lost")}, env);
  ASSERT_TRUE(launch.WaitForOutput("[rank 0] step " + std::to_string(kKillStep) + "/", std::chrono::seconds(120)))
      << launch.Output();
  n2->Signal(SIGKILL);
  ProcessResult run = launch.Wait(std::chrono::seconds(300));
  const std::string& out = run.output;
  ASSERT_EQ(run.exit_code, 0) << WithoutStepLines(out);
  EXPECT_NE(out.find("ranks 2,3 leave the job, with no node to replace them on; ranks 0,1 go on in place "
                     "(membership epoch 1) with 2 micro-batch(es) each a step instead of 1"),
            std::string::npos)
      << WithoutStepLines(out);
  EXPECT_NE(out.find("ranks 0,1 went on without the ranks that left (membership epoch 1)"), std::string::npos) << WithoutStepLines(out);
  v1::Job job = JobStatus("lost-1", env, {"--coordinator", address});
  EXPECT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED) << job.cause();
  EXPECT_EQ(job.generation(), 0) << "no restart of the job";
  EXPECT_EQ(job.recoveries(), 1);
  EXPECT_EQ(job.lost_steps(), 0);
  ASSERT_EQ(job.ranks_size(), 4);
  EXPECT_EQ(job.ranks(2).state(), "left");
  EXPECT_EQ(job.ranks(3).state(), "left");
  // The survivors kept their processes; nothing was read from a checkpoint.
  std::map<int, std::vector<std::string>> pids = Pids(out);
  EXPECT_EQ(pids[0].size(), 1u) << WithoutStepLines(out);
  EXPECT_EQ(pids[1].size(), 1u) << WithoutStepLines(out);
  EXPECT_EQ(out.find("resumed from"), std::string::npos) << WithoutStepLines(out);
  // Every step trained once, each loss within 1e-6 of the uninterrupted run's.
  std::map<int, std::string> a = LossLines(plain.output), b = LossLines(out);
  ASSERT_EQ(a.size(), static_cast<size_t>(kSteps)) << WithoutStepLines(plain.output);
  ASSERT_EQ(b.size(), static_cast<size_t>(kSteps)) << WithoutStepLines(out);
  double worst = 0;
  for (int s = 1; s <= kSteps; ++s) {
    const double x = std::stod(a[s]), y = std::stod(b[s]);
    worst = std::max(worst, std::abs(x - y) / std::abs(x));
    EXPECT_LE(std::abs(x - y), 1e-6 * std::abs(x)) << "step " << s << ": " << a[s] << " against " << b[s];
  }
  std::printf("largest relative difference of a loss from the uninterrupted run's: %.3g\n", worst);
  n1->Signal(SIGTERM);
  coordinator.Signal(SIGTERM);
}

}  // namespace
}  // namespace ltrain::testing
