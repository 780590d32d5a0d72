// Faults with real signals: a worker killed mid-run fails the job fast, names the rank and the
// signal, and leaves no process behind.
#include <gtest/gtest.h>
#include <signal.h>

#include <filesystem>
#include <thread>

#include "ltrain/v1/ltrain.pb.h"
#include "tests/support/job_status.h"
#include "tests/support/subprocess.h"

namespace ltrain::testing {
namespace {

class WorkerKillTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ProcessResult prepared = PrepareLicenseData(dir_.Join("data"));
    ASSERT_EQ(prepared.exit_code, 0) << prepared.output;
    recipe_ = dir_.Write("long.yaml", TinyRecipe("long", dir_.Join("data")) +
                                      "training: {steps: 100000, micro_batch: 4, global_batch: 8, log_every: 1}\n"
                                      "parallel: {nproc_per_node: 2}\n");
  }

  std::map<std::string, std::string> Env() const { return {{"LTRAIN_HOME", dir_.Join("home")}}; }

  v1::Job Status(const std::string& job_id) { return JobStatus(job_id, Env()); }

  TempDir dir_;
  std::string recipe_;
};

TEST_F(WorkerKillTest, SigkilledWorkerFailsTheJobWithinFiveSeconds) {
  Subprocess launch({LtrainBinary(), "launch", recipe_}, Env());
  ASSERT_TRUE(launch.WaitForOutput("[rank 0] step 3/", std::chrono::seconds(60))) << launch.Output();
  v1::Job running = Status("long-1");
  ASSERT_EQ(running.state(), v1::JOB_STATE_RUNNING);
  ASSERT_EQ(running.ranks_size(), 2);
  // Both ranks' progress has reached the coordinator (what the failure's picture shows of them).
  for (int i = 0; i < 100 && (running.ranks(0).last_step() == 0 || running.ranks(1).last_step() == 0); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    running = Status("long-1");
    ASSERT_EQ(running.ranks_size(), 2);
  }
  std::vector<pid_t> pids;
  for (const auto& rank : running.ranks()) pids.push_back(static_cast<pid_t>(rank.pid()));
  for (pid_t pid : pids) ASSERT_TRUE(ProcessAlive(pid)) << pid;

  auto killed_at = std::chrono::steady_clock::now();
  ASSERT_EQ(kill(pids[1], SIGKILL), 0);
  ProcessResult result = launch.Wait(std::chrono::seconds(30));
  double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - killed_at).count();

  EXPECT_FALSE(result.timed_out);
  EXPECT_LT(seconds, 5.0);
  EXPECT_EQ(result.exit_code, 1) << result.output;
  EXPECT_NE(result.output.find("rank 1 on local was killed by signal SIGKILL"), std::string::npos) << result.output;
  v1::Job failed = Status("long-1");
  EXPECT_EQ(failed.state(), v1::JOB_STATE_FAILED);
  EXPECT_NE(failed.cause().find("rank 1 on local was killed by signal SIGKILL"), std::string::npos) << failed.cause();
  EXPECT_NE(failed.cause().find("last lines of its log"), std::string::npos) << failed.cause();
  // Where the other rank was: every rank's last report and recent collectives, in a file of the job's.
  const std::string picture = dir_.Join("home/jobs/long-1/failure-gen-0.txt");
  EXPECT_NE(failed.cause().find("SIGKILL; every rank's recent collectives: " + picture + "; last lines of its log"),
            std::string::npos)
      << failed.cause();
  ProcessResult shown = RunProcess({"/bin/cat", picture}, {}, std::chrono::seconds(10));
  EXPECT_NE(shown.output.find("rank 1 on local was killed by signal SIGKILL"), std::string::npos) << shown.output;
  EXPECT_NE(shown.output.find("rank 0: step "), std::string::npos) << shown.output;
  EXPECT_NE(shown.output.find("rank 1: step "), std::string::npos) << shown.output;
  for (pid_t pid : pids) EXPECT_FALSE(ProcessAlive(pid)) << "worker " << pid << " survived";
}

TEST_F(WorkerKillTest, StopKillsEveryWorkerAndRecordsStopped) {
  Subprocess launch({LtrainBinary(), "launch", recipe_}, Env());
  ASSERT_TRUE(launch.WaitForOutput("[rank 0] step 2/", std::chrono::seconds(60))) << launch.Output();
  v1::Job running = Status("long-1");
  ProcessResult stop = RunProcess({LtrainBinary(), "stop", "long-1"}, Env());
  EXPECT_EQ(stop.exit_code, 0) << stop.output;
  ProcessResult result = launch.Wait(std::chrono::seconds(30));
  EXPECT_EQ(result.exit_code, 4) << result.output;
  v1::Job stopped = Status("long-1");
  EXPECT_EQ(stopped.state(), v1::JOB_STATE_STOPPED);
  for (const auto& rank : running.ranks()) EXPECT_FALSE(ProcessAlive(static_cast<pid_t>(rank.pid())));
  // As documented: SIGTERM first, which the workers heed; no SIGKILL when the launch ends.
  for (const auto& rank : stopped.ranks()) {
    EXPECT_NE(rank.signal(), SIGKILL) << "rank " << rank.rank() << " " << rank.state();
  }
}

TEST_F(WorkerKillTest, InterruptedLaunchStopsTheJob) {
  Subprocess launch({LtrainBinary(), "launch", recipe_}, Env());
  ASSERT_TRUE(launch.WaitForOutput("[rank 0] step 2/", std::chrono::seconds(60))) << launch.Output();
  v1::Job running = Status("long-1");
  launch.Signal(SIGINT);
  ProcessResult result = launch.Wait(std::chrono::seconds(30));
  EXPECT_EQ(result.exit_code, 4) << result.output;
  EXPECT_EQ(Status("long-1").state(), v1::JOB_STATE_STOPPED);
  for (const auto& rank : running.ranks()) EXPECT_FALSE(ProcessAlive(static_cast<pid_t>(rank.pid())));
}

// A standalone launch SIGKILLed mid-run takes its workers along; the next command finds it gone and
// records the job FAILED, saying why, so that stop has nothing to wait for and resume may take it up.
TEST_F(WorkerKillTest, KilledLaunchLeavesItsJobFailedForTheNextCommand) {
  Subprocess launch({LtrainBinary(), "launch", recipe_}, Env());
  ASSERT_TRUE(launch.WaitForOutput("[rank 0] step 2/", std::chrono::seconds(60))) << launch.Output();
  v1::Job running = Status("long-1");
  ASSERT_EQ(running.state(), v1::JOB_STATE_RUNNING);
  launch.Signal(SIGKILL);
  launch.Wait(std::chrono::seconds(10));

  v1::Job after = Status("long-1");
  EXPECT_EQ(after.state(), v1::JOB_STATE_FAILED);
  EXPECT_NE(after.cause().find("its launch (`ltrain launch`, pid " + std::to_string(launch.pid()) + ") ended before"),
            std::string::npos)
      << after.cause();
  ASSERT_EQ(after.ranks_size(), running.ranks_size());
  for (const auto& rank : after.ranks()) EXPECT_EQ(rank.state(), "killed") << "rank " << rank.rank();
  for (const auto& rank : running.ranks()) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    while (ProcessAlive(static_cast<pid_t>(rank.pid())) && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    EXPECT_FALSE(ProcessAlive(static_cast<pid_t>(rank.pid()))) << "rank " << rank.rank();
  }
  ProcessResult stop = RunProcess({LtrainBinary(), "stop", "long-1"}, Env(), std::chrono::seconds(30));
  EXPECT_EQ(stop.exit_code, 0) << stop.output;
  EXPECT_NE(stop.output.find("job long-1: FAILED"), std::string::npos) << stop.output;
}

}  // namespace
}  // namespace ltrain::testing
