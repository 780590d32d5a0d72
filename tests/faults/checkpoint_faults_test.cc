// Checkpoint faults through the real `ltrain launch` (local agent, 2 worker processes): a flipped
// byte in the newest checkpoint makes a resume take the previous one and say why; a write failure
// injected in the middle of a save commits nothing, keeps the previous step the newest committed,
// and the job still succeeds.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>

#include "ltrain/v1/ltrain.pb.h"
#include "tests/support/job_status.h"
#include "tests/support/subprocess.h"

namespace ltrain::testing {
namespace {

namespace fs = std::filesystem;
using std::chrono::seconds;

std::string Latest(const std::string& ck) {
  std::ifstream in(ck + "/latest");
  std::string name;
  std::getline(in, name);
  return name;
}

class CheckpointFaultsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ProcessResult prepared = PrepareLicenseData(dir_.Join("data"));
    ASSERT_EQ(prepared.exit_code, 0) << prepared.output;
  }

  std::string Recipe(const std::string& name, const std::string& extra) {
    return dir_.Write(name + ".yaml", TinyRecipe(name, dir_.Join("data")) +
                                          "parallel: {nproc_per_node: 2}\n" + extra);
  }

  std::map<std::string, std::string> Env() const {
    return {{"LTRAIN_HOME", dir_.Join("home")}, {"OMP_NUM_THREADS", "1"}};
  }

  v1::Job Status(const std::string& job_id) { return JobStatus(job_id, Env()); }

  TempDir dir_;
};

// A job runs to step 20 (checkpoints every 5); one byte of step-20's model file is flipped; a new
// job resuming from that checkpoint directory starts from step 15 and its output says why.
TEST_F(CheckpointFaultsTest, FlippedByteInNewestCheckpointResumesFromThePreviousOne) {
  std::string first = Recipe("first", "training: {steps: 20, micro_batch: 4, global_batch: 8, log_every: 5}\n"
                                      "checkpoint: {every: 5, keep: 5}\n");
  ProcessResult ran = RunProcess({LtrainBinary(), "launch", first}, Env(), seconds(180));
  ASSERT_EQ(ran.exit_code, 0) << ran.output;
  const std::string ck = dir_.Join("home/checkpoints/first-1");
  ASSERT_EQ(Latest(ck), "step-20") << ran.output;
  {
    // A byte of the tensors' data (the end of the file), which only the hash can tell.
    const std::string file = ck + "/step-20/model-rank-0.safetensors";
    const auto at = static_cast<std::streamoff>(fs::file_size(file) - 1000);
    std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(at);
    const char original = static_cast<char>(f.get());
    f.seekp(at);
    f.put(static_cast<char>(original ^ 0x01));
  }

  std::string second = Recipe("second", "training: {steps: 25, micro_batch: 4, global_batch: 8, log_every: 5}\n"
                                        "checkpoint: {every: 5, resume_from: " + ck + "}\n");
  ProcessResult resumed = RunProcess({LtrainBinary(), "launch", second}, Env(), seconds(180));
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_TRUE(std::regex_search(
      resumed.output, std::regex(R"(checkpoint step-20 is corrupt \(model-rank-0\.safetensors xxh3 mismatch: expected [0-9a-f]{16}, got [0-9a-f]{16}\); resuming from step-15)")))
      << resumed.output;
  EXPECT_NE(resumed.output.find("resumed from " + ck + "/step-15 at step 15"), std::string::npos) << resumed.output;
  EXPECT_NE(resumed.output.find("step 25/25"), std::string::npos) << resumed.output;
}

// LTRAIN_FAULT_CHECKPOINT_WRITE=10 in the launch's environment: both ranks' writes of step 10 fail
// half-way. Step 10 is never committed, step 5 stays the newest until step 15 commits, nothing
// half-written is left, and the job SUCCEEDS without a restart.
TEST_F(CheckpointFaultsTest, InjectedWriteFailureKeepsThePreviousCheckpointAndTheJobSucceeds) {
  std::string recipe = Recipe("wfail", "training: {steps: 20, micro_batch: 4, global_batch: 8, log_every: 5}\n"
                                       "checkpoint: {every: 5, keep: 10}\n"
                                       "fault: {max_restarts: 1, restart_backoff_s: 0.2}\n");
  std::map<std::string, std::string> env = Env();
  env["LTRAIN_FAULT_CHECKPOINT_WRITE"] = "10";
  ProcessResult ran = RunProcess({LtrainBinary(), "launch", recipe}, env, seconds(180));
  ASSERT_EQ(ran.exit_code, 0) << ran.output;
  EXPECT_TRUE(std::regex_search(
      ran.output, std::regex(R"(checkpoint step-10 failed: rank 0: writing \S+: injected failure after \d+ of \d+ bytes \(LTRAIN_FAULT_CHECKPOINT_WRITE\).*; step-5 stays the newest committed)")))
      << ran.output;
  EXPECT_EQ(ran.output.find("checkpoint step-10 written"), std::string::npos) << ran.output;
  const std::string ck = dir_.Join("home/checkpoints/wfail-1");
  EXPECT_FALSE(fs::exists(ck + "/step-10"));
  EXPECT_TRUE(fs::exists(ck + "/step-5/meta.yaml"));
  EXPECT_TRUE(fs::exists(ck + "/step-15/meta.yaml"));
  EXPECT_EQ(Latest(ck), "step-20");
  for (const auto& e : fs::directory_iterator(ck)) {
    EXPECT_NE(e.path().filename().string().rfind(".tmp-", 0), 0u) << e.path();
  }
  v1::Job job = Status("wfail-1");
  EXPECT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED);
  EXPECT_EQ(job.restarts(), 0);
  EXPECT_EQ(job.last_committed_step(), 20);
}

// A full disk: the checkpoint folder on a tmpfs that holds one checkpoint and a half. Step 5 commits;
// every later save fails at once on every rank with ENOSPC, naming the rank, the path and what was
// free, and gives its space back (no temporary file is left, `latest` stays step-5); the job goes on
// to its end without a hang, and then fails because its final checkpoint was not saved, saying why.
TEST_F(CheckpointFaultsTest, AFullDiskIsNamedAndLeavesNothingTemporary) {
  ASSERT_EQ(::geteuid(), 0u) << "the full-disk drill mounts a small tmpfs: run it as root";
  const std::vector<std::string> wider = {"--set", "model.d_model=128"};
  const std::string training = "training: {steps: 15, micro_batch: 4, global_batch: 8, log_every: 5}\n";
  // How much one checkpoint of this model takes.
  std::string sizing = Recipe("sizing", training + "checkpoint: {every: 5, keep: 1}\n");
  ProcessResult sized = RunProcess({LtrainBinary(), "launch", sizing, wider[0], wider[1]}, Env(), seconds(180));
  ASSERT_EQ(sized.exit_code, 0) << sized.output;
  uintmax_t bytes = 0;
  for (const auto& e : fs::recursive_directory_iterator(dir_.Join("home/checkpoints"))) {
    if (e.is_regular_file() && e.path().parent_path().filename() == "step-15") bytes += fs::file_size(e);
  }
  ASSERT_GT(bytes, 1u << 20) << "a checkpoint of some MB";

  const std::string mount = dir_.Join("small");
  fs::create_directories(mount);
  const std::string size = "size=" + std::to_string((bytes * 3 / 2 / 4096 + 1) * 4096);
  ProcessResult mounted = RunProcess({"/usr/bin/mount", "-t", "tmpfs", "-o", size, "tmpfs", mount});
  ASSERT_EQ(mounted.exit_code, 0) << mounted.output;
  struct Unmount {
    std::string at;
    ~Unmount() { RunProcess({"/usr/bin/umount", "-l", at}); }
  } unmount{mount};
  const std::string ck = mount + "/ck";
  std::string recipe = Recipe("full", training + "checkpoint: {every: 5, keep: 1, dir: " + ck + "}\n");
  ProcessResult ran = RunProcess({LtrainBinary(), "launch", recipe, wider[0], wider[1]}, Env(), seconds(180));
  EXPECT_EQ(ran.exit_code, 1) << ran.output;
  EXPECT_NE(ran.output.find("checkpoint of step 5 committed"), std::string::npos) << ran.output;
  EXPECT_TRUE(std::regex_search(
      ran.output, std::regex(R"(checkpoint step-10 failed: rank 0: writing \S+/ck/\.tmp-step-10/\S+: No space left on device \(ENOSPC: [0-9.]+ MB free of [0-9.]+ MB on the filesystem of )" +
                             ck + R"(\); rank 1: writing .*ENOSPC.*; step-5 stays the newest committed)")))
      << ran.output;
  std::smatch id;
  ASSERT_TRUE(std::regex_search(ran.output, id, std::regex(R"(job (full-\d+) submitted)"))) << ran.output;
  v1::Job job = Status(id[1]);
  EXPECT_EQ(job.state(), v1::JOB_STATE_FAILED);
  EXPECT_NE(job.cause().find("the final checkpoint was not saved"), std::string::npos) << job.cause();
  EXPECT_NE(job.cause().find("No space left on device (ENOSPC"), std::string::npos) << job.cause();
  EXPECT_EQ(job.cause().find("hang"), std::string::npos) << job.cause();
  EXPECT_EQ(job.last_committed_step(), 5);
  EXPECT_EQ(Latest(ck), "step-5");
  for (const auto& e : fs::directory_iterator(ck)) {
    EXPECT_NE(e.path().filename().string().rfind(".tmp-", 0), 0u) << e.path() << " was left";
  }
}

// A second job pointed at the first one's checkpoint directory (checkpoint.dir): `ltrain launch`
// refuses it before submitting (exit code 2), naming the owner and the fix; nothing of the first
// job's checkpoints changes. Starting from it with checkpoint.resume_from works.
TEST_F(CheckpointFaultsTest, ASecondJobInAnotherJobsCheckpointDirectoryIsRefused) {
  const std::string ck = dir_.Join("shared-ck");
  std::string first = Recipe("owner", "training: {steps: 5, micro_batch: 4, global_batch: 8, log_every: 5}\n"
                                      "checkpoint: {every: 5, dir: " + ck + "}\n");
  ProcessResult ran = RunProcess({LtrainBinary(), "launch", first}, Env(), seconds(180));
  ASSERT_EQ(ran.exit_code, 0) << ran.output;
  ASSERT_EQ(Latest(ck), "step-5");
  const std::string meta = ReadFile(ck + "/step-5/meta.yaml");
  ASSERT_NE(meta.find("job_id: owner-1"), std::string::npos) << meta;

  std::string second = Recipe("intruder", "training: {steps: 10, micro_batch: 4, global_batch: 8, log_every: 5}\n"
                                          "checkpoint: {every: 5, dir: " + ck + "}\n"
                                          "fault: {max_restarts: 2, restart_backoff_s: 0.2}\n");
  ProcessResult refused = RunProcess({LtrainBinary(), "launch", second}, Env(), seconds(60));
  EXPECT_EQ(refused.exit_code, 2) << refused.output;
  EXPECT_NE(refused.output.find("checkpoint directory " + ck + " belongs to job owner-1 (its step-5)"), std::string::npos)
      << refused.output;
  EXPECT_NE(refused.output.find("set checkpoint.dir"), std::string::npos) << refused.output;
  EXPECT_NE(refused.output.find("checkpoint.resume_from=" + ck), std::string::npos) << refused.output;
  EXPECT_EQ(refused.output.find("submitted"), std::string::npos) << refused.output;
  EXPECT_EQ(Latest(ck), "step-5");
  EXPECT_EQ(ReadFile(ck + "/step-5/meta.yaml"), meta);

  std::string reader = Recipe("reader", "training: {steps: 10, micro_batch: 4, global_batch: 8, log_every: 5}\n"
                                        "checkpoint: {every: 5, resume_from: " + ck + "}\n");
  ProcessResult resumed = RunProcess({LtrainBinary(), "launch", reader}, Env(), seconds(180));
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_NE(resumed.output.find("resumed from " + ck + "/step-5 at step 5"), std::string::npos) << resumed.output;
  EXPECT_EQ(Latest(ck), "step-5");
}

}  // namespace
}  // namespace ltrain::testing
