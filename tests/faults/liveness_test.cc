// Long phases through the real `ltrain launch` (local agent, 2 worker processes): a start-up or a
// checkpoint save longer than fault.hang_timeout_s is no hang; one that makes no progress for
// fault.startup_timeout_s or checkpoint.timeout_s is reported as a stuck start-up or a stuck save
// that names the rank and the limit.
#include <gtest/gtest.h>

#include <map>
#include <regex>
#include <string>

#include "ltrain/v1/ltrain.pb.h"
#include "tests/support/job_status.h"
#include "tests/support/subprocess.h"

namespace ltrain::testing {
namespace {

using std::chrono::seconds;

class LivenessTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ProcessResult prepared = PrepareLicenseData(dir_.Join("data"));
    ASSERT_EQ(prepared.exit_code, 0) << prepared.output;
  }

  std::string Recipe(const std::string& name, const std::string& extra) {
    return dir_.Write(name + ".yaml", TinyRecipe(name, dir_.Join("data")) +
                                          "training: {steps: 6, micro_batch: 4, global_batch: 8, log_every: 2}\n"
                                          "parallel: {nproc_per_node: 2}\n" + extra);
  }

  std::map<std::string, std::string> Env() const {
    return {{"LTRAIN_HOME", dir_.Join("home")}, {"OMP_NUM_THREADS", "1"}};
  }

  TempDir dir_;
};

TEST_F(LivenessTest, StartUpLongerThanTheHangTimeoutIsNoHang) {
  std::string recipe = Recipe("slowstart", "fault: {hang_timeout_s: 2, max_restarts: 0}\n");
  std::map<std::string, std::string> env = Env();
  env["LTRAIN_FAULT_STARTUP_STALL"] = "5:1";
  ProcessResult ran = RunProcess({LtrainBinary(), "launch", recipe}, env, seconds(120));
  ASSERT_EQ(ran.exit_code, 0) << ran.output;
  EXPECT_NE(ran.output.find("rank 1: stalling start-up for 5.0 s"), std::string::npos) << ran.output;
  v1::Job job = JobStatus("slowstart-1", Env());
  EXPECT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED);
  EXPECT_EQ(job.restarts(), 0);
  EXPECT_EQ(job.last_failure(), "");
}

TEST_F(LivenessTest, StuckStartUpNamesTheRankAndTheLimit) {
  std::string recipe = Recipe("stuckstart", "fault: {hang_timeout_s: 2, startup_timeout_s: 4, max_restarts: 0}\n");
  std::map<std::string, std::string> env = Env();
  env["LTRAIN_FAULT_STARTUP_STALL"] = "600:1";
  ProcessResult ran = RunProcess({LtrainBinary(), "launch", recipe}, env, seconds(120));
  EXPECT_NE(ran.exit_code, 0) << ran.output;
  v1::Job job = JobStatus("stuckstart-1", Env());
  EXPECT_EQ(job.state(), v1::JOB_STATE_FAILED);
  EXPECT_TRUE(std::regex_search(job.last_failure(),
                                std::regex(R"(^stuck start-up: rank 1 made no progress for [45]s in step 0 \(startup)")))
      << job.last_failure();
  EXPECT_NE(job.last_failure().find("limit fault.startup_timeout_s=4)"), std::string::npos) << job.last_failure();
}

TEST_F(LivenessTest, SaveLongerThanTheHangTimeoutIsNoHang) {
  std::string recipe = Recipe("slowsave", "fault: {hang_timeout_s: 2, max_restarts: 0}\n");
  std::map<std::string, std::string> env = Env();
  env["LTRAIN_FAULT_CHECKPOINT_STALL"] = "6:5:1";
  ProcessResult ran = RunProcess({LtrainBinary(), "launch", recipe}, env, seconds(120));
  ASSERT_EQ(ran.exit_code, 0) << ran.output;
  EXPECT_NE(ran.output.find("rank 1: stalling the save of step-6 for 5.0 s"), std::string::npos) << ran.output;
  EXPECT_NE(ran.output.find("checkpoint step-6 written"), std::string::npos) << ran.output;
  // The launch shows the save while it lasts (a line: its output is no terminal).
  EXPECT_NE(ran.output.find("ltrain: rank 1: saving checkpoint step-6, 0.0 of "), std::string::npos) << ran.output;
  v1::Job job = JobStatus("slowsave-1", Env());
  EXPECT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED);
  EXPECT_EQ(job.last_committed_step(), 6);
  EXPECT_EQ(job.last_failure(), "");
}

TEST_F(LivenessTest, StuckSaveNamesTheRankAndTheLimit) {
  std::string recipe = Recipe("stucksave", "checkpoint: {timeout_s: 4}\nfault: {hang_timeout_s: 2, max_restarts: 0}\n");
  std::map<std::string, std::string> env = Env();
  env["LTRAIN_FAULT_CHECKPOINT_STALL"] = "6:600:1";
  ProcessResult ran = RunProcess({LtrainBinary(), "launch", recipe}, env, seconds(120));
  EXPECT_NE(ran.exit_code, 0) << ran.output;
  v1::Job job = JobStatus("stucksave-1", Env());
  EXPECT_EQ(job.state(), v1::JOB_STATE_FAILED);
  EXPECT_TRUE(std::regex_search(job.last_failure(),
                                std::regex(R"(^stuck checkpoint save: rank 1 made no progress for [45]s in step 6 )"
                                           R"(\(checkpoint: saving checkpoint step-6, 0\.0 of [0-9.]+ MB; )")))
      << job.last_failure();
  EXPECT_TRUE(std::regex_search(job.last_failure(),
                                std::regex(R"(limit checkpoint\.timeout_s=4\); its last collective was \w+ #\d+ of world; )"
                                           R"(rank 0 waits for its peers \(waiting for the ranks' files of step-6, 1 of 2 ranks\))")))
      << job.last_failure();
}

}  // namespace
}  // namespace ltrain::testing
