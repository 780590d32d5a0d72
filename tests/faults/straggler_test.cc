// Stragglers through the real `ltrain launch` (local agent, 4 worker processes over Gloo): a rank
// slowed by half (LTRAIN_FAULT_SLOW_RANK) is named with its node within 20 steps; an even run names
// no one.
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

class StragglerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ProcessResult prepared = PrepareLicenseData(dir_.Join("data"));
    ASSERT_EQ(prepared.exit_code, 0) << prepared.output;
  }

  ProcessResult Launch(const std::string& name, const std::map<std::string, std::string>& extra_env) {
    const std::string recipe =
        dir_.Write(name + ".yaml", "name: " + name +
                                       "\nmodel: {layers: 2, d_model: 256, heads: 4, seq_len: 128}\n"
                                       "data: {path: " + dir_.Join("data") + "}\n"
                                       "training: {steps: " + std::to_string(kSteps) + ", micro_batch: 4, global_batch: 16, log_every: 1}\n"
                                       "parallel: {nproc_per_node: 4}\n");
    std::map<std::string, std::string> env = {{"LTRAIN_HOME", dir_.Join("home")}, {"OMP_NUM_THREADS", "1"}};
    env.insert(extra_env.begin(), extra_env.end());
    return RunProcess({LtrainBinary(), "launch", recipe}, env, seconds(240));
  }

  static constexpr int kSteps = 30;
  TempDir dir_;
};

TEST_F(StragglerTest, ARankSlowedByHalfIsNamedWithinTwentySteps) {
  ProcessResult ran = Launch("slow", {{"LTRAIN_FAULT_SLOW_RANK", "1.5:2"}});
  ASSERT_EQ(ran.exit_code, 0) << ran.output;
  std::smatch named;
  ASSERT_TRUE(std::regex_search(
      ran.output, named,
      std::regex(R"(rank 2 on local is a straggler at step (\d+): [\d.]+ ms of its own work a step at best over its last 60 steps \(medians of 10\), ([\d.]+)x)")))
      << ran.output;
  EXPECT_LE(std::stoi(named[1]), 20) << ran.output;
  EXPECT_GT(std::stod(named[2]), 1.2) << ran.output;
  EXPECT_EQ(ran.output.find("rank 0 on local is a straggler"), std::string::npos) << ran.output;
  EXPECT_EQ(ran.output.find("rank 1 on local is a straggler"), std::string::npos) << ran.output;
  EXPECT_EQ(ran.output.find("rank 3 on local is a straggler"), std::string::npos) << ran.output;
}

TEST_F(StragglerTest, AnEvenRunNamesNoOne) {
  ProcessResult ran = Launch("even", {});
  ASSERT_EQ(ran.exit_code, 0) << ran.output;
  EXPECT_EQ(ran.output.find("straggler"), std::string::npos) << ran.output;
}

}  // namespace
}  // namespace ltrain::testing
