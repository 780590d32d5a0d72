// Checkpoints that lose nothing, with real ltrain-worker processes (Gloo over loopback, file://
// rendezvous, 1-2 ranks, a tiny GPT): a corrupt newest checkpoint is skipped with a reason; an
// injected write failure commits nothing, keeps `latest`, and training goes on; asynchronous saves
// end bit-identical to synchronous ones and to an uninterrupted run; a checkpoint saved with dp2
// ZeRO-1 resumes into dp1 ZeRO-0, dp2 ZeRO-2 and dp2 ZeRO-3.
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <map>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "tests/support/synthetic_tokens.h"

namespace ltrain {
namespace {

namespace fs = std::filesystem;

std::string WorkerBin() {
  const char* bin_dir = std::getenv("LTRAIN_BIN_DIR");
  return bin_dir != nullptr ? std::string(bin_dir) + "/ltrain-worker" : LTRAIN_WORKER_BIN;
}

std::string ReadFile(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream buffer;
  buffer << in.rdbuf();
  return buffer.str();
}

// step number -> loss, from rank 0's "step S/N loss L ..." lines.
std::map<int, double> Losses(const std::string& log) {
  std::map<int, double> out;
  static const std::regex kStep(R"(^step (\d+)/\d+ loss ([0-9.eE+-]+))");
  std::istringstream in(log);
  std::string line;
  std::smatch m;
  while (std::getline(in, line)) {
    if (std::regex_search(line, m, kStep)) out[std::stoi(m[1])] = std::stod(m[2]);
  }
  return out;
}

std::string Latest(const fs::path& ck) {
  std::string name;
  std::ifstream in(ck / "latest");
  std::getline(in, name);
  return name;
}

bool HasPendingDir(const fs::path& ck) {
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(ck, ec)) {
    if (e.path().filename().string().rfind(".tmp-", 0) == 0) return true;
  }
  return false;
}

void FlipByte(const fs::path& file, std::streamoff at) {
  std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(at);
  const char original = static_cast<char>(f.get());
  f.seekp(at);
  f.put(static_cast<char>(original ^ 0x5a));
}

struct RunResult {
  int rc = 0;
  std::string log0;  // rank 0's stdout and stderr
  std::string log1;
};

// A layout a checkpoint is resumed into: `world` ranks with `sets`.
struct ReshardTarget {
  const char* name;
  int world;
  const char* sets;
};

class CheckpointTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = fs::temp_directory_path() / ("ltrain_checkpoint_" + std::to_string(::getpid()));
    fs::remove_all(dir_);
    fs::create_directories(dir_ / "data");
    ASSERT_TRUE(
        ltrain::testing::WriteSyntheticTokens((dir_ / "data" / "train.bin").string(), 20000, 11, 5, 13).ok());
    std::ofstream(dir_ / "r.yaml") << "name: ck\n"
                                      "model: {layers: 2, d_model: 32, heads: 2, seq_len: 16, vocab: 256}\n"
                                      "data: {path: " << (dir_ / "data").string() << "}\n"
                                      "training: {steps: 20, micro_batch: 2, global_batch: 8, lr: 3.0e-3, "
                                      "min_lr: 3.0e-4, warmup_steps: 4, log_every: 1, grad_clip: 0.5}\n"
                                      "parallel: {nodes: 1, nproc_per_node: 1}\n"
                                      "checkpoint: {every: 5, keep: 10}\n";
  }
  static void TearDownTestSuite() { fs::remove_all(dir_); }

  // `world` ranks of the recipe with `sets`; `env` is prefixed to every rank's command line. The
  // run's directory holds log0.., params.bin; checkpoints go to `ck` (relative to dir_).
  static RunResult Run(const std::string& name, int world, const std::string& ck, const std::string& sets,
                       const std::string& env = "") {
    const fs::path run = dir_ / name;
    fs::remove_all(run);
    fs::create_directories(run);
    std::string cmd;
    for (int r = 0; r < world; ++r) {
      cmd += env + " OMP_NUM_THREADS=1 LTRAIN_COLLECTIVE_TIMEOUT_S=60 LTRAIN_WORLD_SIZE=" + std::to_string(world) +
             " LTRAIN_RANK=" + std::to_string(r) + " LTRAIN_RDZV=file://" + (run / "rdzv").string() +
             " LTRAIN_RDZV_SCOPE=t timeout 120 " + WorkerBin() + " --recipe " + (dir_ / "r.yaml").string() +
             " --set parallel.nproc_per_node=" + std::to_string(world) + " --set checkpoint.dir=" +
             (dir_ / ck).string() + " --export-params " + (run / "params.bin").string() + " " + sets + " > " +
             (run / ("log" + std::to_string(r))).string() + " 2>&1 & ";
    }
    cmd += "rc=0; for j in $(jobs -p); do wait $j || rc=1; done; exit $rc";
    RunResult result;
    result.rc = std::system(("bash -c '" + cmd + "'").c_str());
    result.log0 = ReadFile(run / "log0");
    if (world > 1) result.log1 = ReadFile(run / "log1");
    return result;
  }

  static fs::path Dir() { return dir_; }

  // Runs `world` ranks with `sets` and a checkpoint every 10 steps; resumes its step-10 checkpoint in
  // each target; each resumed run's 10 losses are the uninterrupted run's (fp32, within 1e-5 relative).
  static void ExpectReshardedRunsContinueTheLosses(const std::string& prefix, int world, const std::string& sets,
                                                   std::initializer_list<ReshardTarget> targets) {
    RunResult original = Run(prefix + "original", world, prefix + "ck", sets + " --set checkpoint.every=10");
    ASSERT_EQ(original.rc, 0) << original.log0 << original.log1;
    const std::string step10 = (Dir() / (prefix + "ck") / "step-10").string();
    const std::map<int, double> a = Losses(original.log0);
    ASSERT_EQ(a.size(), 20u) << original.log0;
    for (const ReshardTarget& t : targets) {
      SCOPED_TRACE(t.name);
      RunResult r = Run(prefix + t.name, t.world, prefix + "ck_" + t.name,
                        std::string(t.sets) + " --set checkpoint.resume_from=" + step10);
      ASSERT_EQ(r.rc, 0) << r.log0 << r.log1;
      EXPECT_NE(r.log0.find("resumed from " + step10 + " at step 10"), std::string::npos) << r.log0;
      std::map<int, double> b = Losses(r.log0);
      ASSERT_EQ(b.size(), 10u) << r.log0;
      for (const auto& [step, loss] : b) EXPECT_NEAR(loss, a.at(step), 1e-5 * a.at(step)) << "step " << step;
    }
  }

  static fs::path dir_;
};

fs::path CheckpointTest::dir_;

// The newest checkpoint has a flipped byte: a resume from the checkpoint directory says why it
// skips it and continues from the one before, with the losses of the uninterrupted run; naming the
// corrupt step directory itself is an error that names the problem.
TEST_F(CheckpointTest, CorruptNewestCheckpointIsSkippedWithAReason) {
  RunResult first = Run("corrupt_first", 1, "corrupt_ck", "--set training.steps=10");
  ASSERT_EQ(first.rc, 0) << first.log0;
  const fs::path ck = Dir() / "corrupt_ck";
  ASSERT_EQ(Latest(ck), "step-10");
  // A byte of the tensors' data (the end of the file), which only the hash can tell.
  FlipByte(ck / "step-10" / "model-rank-0.safetensors",
           static_cast<std::streamoff>(fs::file_size(ck / "step-10" / "model-rank-0.safetensors") - 200));

  RunResult resumed = Run("corrupt_resumed", 1, "corrupt_ck2",
                          "--set training.steps=10 --set checkpoint.resume_from=" + ck.string());
  ASSERT_EQ(resumed.rc, 0) << resumed.log0;
  EXPECT_TRUE(std::regex_search(resumed.log0,
                                std::regex(R"(checkpoint step-10 is corrupt \(model-rank-0\.safetensors xxh3 mismatch: expected [0-9a-f]{16}, got [0-9a-f]{16}\); resuming from step-5)")))
      << resumed.log0;
  EXPECT_NE(resumed.log0.find("resumed from " + (ck / "step-5").string() + " at step 5"), std::string::npos) << resumed.log0;
  std::map<int, double> a = Losses(first.log0), b = Losses(resumed.log0);
  ASSERT_EQ(b.size(), 5u) << resumed.log0;
  for (const auto& [step, loss] : b) EXPECT_EQ(loss, a[step]) << "step " << step;
  EXPECT_EQ(ReadFile(Dir() / "corrupt_first" / "params.bin"), ReadFile(Dir() / "corrupt_resumed" / "params.bin"));

  RunResult explicit_step = Run("corrupt_explicit", 1, "corrupt_ck3",
                                "--set training.steps=10 --set checkpoint.resume_from=" + (ck / "step-10").string());
  EXPECT_NE(explicit_step.rc, 0);
  EXPECT_NE(explicit_step.log0.find("step-10 is corrupt (model-rank-0.safetensors xxh3 mismatch"), std::string::npos)
      << explicit_step.log0;

  // A truncated file (size differs) and a missing meta.yaml are reported as such.
  fs::resize_file(ck / "step-5" / "optimizer-rank-0.safetensors", 100);
  fs::remove(ck / "step-10" / "meta.yaml");
  RunResult none = Run("corrupt_none", 1, "corrupt_ck4", "--set checkpoint.resume_from=" + ck.string());
  EXPECT_NE(none.rc, 0);
  EXPECT_NE(none.log0.find("checkpoint step-10 is corrupt (meta.yaml is missing)"), std::string::npos) << none.log0;
  EXPECT_NE(none.log0.find("checkpoint step-5 is corrupt (optimizer-rank-0.safetensors size mismatch"), std::string::npos) << none.log0;
}

// Rank 1's write of step 10 fails half-way (injected): nothing is committed, rank 0 says which
// step stays the newest, the half-written directory is gone, and training goes on to commit step
// 15. Asynchronous and synchronous saves alike.
TEST_F(CheckpointTest, InjectedWriteFailureCommitsNothingAndTrainingGoesOn) {
  for (const char* async : {"true", "false"}) {
    SCOPED_TRACE(std::string("checkpoint.async=") + async);
    const std::string ck = std::string("fail_ck_") + async;
    RunResult r = Run(std::string("fail_") + async, 2, ck,
                      std::string("--set training.steps=15 --set parallel.zero=1 --set checkpoint.async=") + async,
                      "LTRAIN_FAULT_CHECKPOINT_WRITE=10:1");
    ASSERT_EQ(r.rc, 0) << r.log0 << r.log1;
    EXPECT_TRUE(std::regex_search(
        r.log0, std::regex(R"(checkpoint step-10 failed: rank 1: writing \S+/\.tmp-step-10/model-rank-1\.safetensors: injected failure after \d+ of \d+ bytes \(LTRAIN_FAULT_CHECKPOINT_WRITE\)(; [^;]*)?; step-5 stays the newest committed)")))
        << r.log0;
    EXPECT_EQ(r.log0.find("checkpoint step-10 written"), std::string::npos) << r.log0;
    EXPECT_NE(r.log0.find("checkpoint step-15 written"), std::string::npos) << r.log0;
    EXPECT_FALSE(fs::exists(Dir() / ck / "step-10"));
    EXPECT_TRUE(fs::exists(Dir() / ck / "step-5" / "meta.yaml"));
    EXPECT_EQ(Latest(Dir() / ck), "step-15");
    EXPECT_FALSE(HasPendingDir(Dir() / ck));
  }

  // The failed save is the last one: the run fails, `latest` still names step 5, and a resume
  // from the directory continues from step 5 to parameters equal to an uninterrupted run.
  RunResult failed = Run("fail_last", 2, "fail_last_ck", "--set training.steps=10 --set parallel.zero=1",
                         "LTRAIN_FAULT_CHECKPOINT_WRITE=10");
  EXPECT_NE(failed.rc, 0);
  EXPECT_NE(failed.log0.find("the final checkpoint was not saved"), std::string::npos) << failed.log0;
  EXPECT_EQ(Latest(Dir() / "fail_last_ck"), "step-5");
  EXPECT_FALSE(fs::exists(Dir() / "fail_last_ck" / "step-10"));
  EXPECT_FALSE(HasPendingDir(Dir() / "fail_last_ck"));
  RunResult resumed = Run("fail_resumed", 2, "fail_last_ck",
                          "--set training.steps=10 --set parallel.zero=1 --set checkpoint.resume_from=" +
                              (Dir() / "fail_last_ck").string());
  ASSERT_EQ(resumed.rc, 0) << resumed.log0 << resumed.log1;
  EXPECT_NE(resumed.log0.find("at step 5 "), std::string::npos) << resumed.log0;
  RunResult full = Run("fail_full", 2, "fail_full_ck", "--set training.steps=10 --set parallel.zero=1");
  ASSERT_EQ(full.rc, 0) << full.log0;
  EXPECT_EQ(ReadFile(Dir() / "fail_full" / "params.bin"), ReadFile(Dir() / "fail_resumed" / "params.bin"));
}

// Asynchronous saves (the default) and synchronous ones write the same checkpoints and end with
// the same parameters, bit for bit, as a run that resumed from step 10 and as one without
// periodic saves.
TEST_F(CheckpointTest, AsyncSavesAreBitIdenticalToSyncAndToAnUninterruptedRun) {
  const std::string layout = "--set parallel.zero=1 ";
  RunResult async_run = Run("async", 2, "async_ck", layout + "--set checkpoint.every=2 --set checkpoint.keep=9");
  ASSERT_EQ(async_run.rc, 0) << async_run.log0 << async_run.log1;
  RunResult sync_run = Run("sync", 2, "sync_ck", layout + "--set checkpoint.every=2 --set checkpoint.keep=9 --set checkpoint.async=false");
  ASSERT_EQ(sync_run.rc, 0) << sync_run.log0;
  RunResult plain = Run("no_periodic", 2, "plain_ck", layout + "--set checkpoint.every=0");
  ASSERT_EQ(plain.rc, 0) << plain.log0;
  RunResult resumed = Run("async_resumed", 2, "async_resumed_ck",
                          layout + "--set checkpoint.resume_from=" + (Dir() / "async_ck" / "step-10").string());
  ASSERT_EQ(resumed.rc, 0) << resumed.log0;
  const std::string p = ReadFile(Dir() / "no_periodic" / "params.bin");
  ASSERT_FALSE(p.empty());
  EXPECT_TRUE(ReadFile(Dir() / "async" / "params.bin") == p) << "async differs from the uninterrupted run";
  EXPECT_TRUE(ReadFile(Dir() / "sync" / "params.bin") == p) << "sync differs from the uninterrupted run";
  EXPECT_TRUE(ReadFile(Dir() / "async_resumed" / "params.bin") == p) << "resumed differs from the uninterrupted run";
  for (int step = 2; step <= 20; step += 2) {
    const std::string name = "step-" + std::to_string(step);
    EXPECT_NE(async_run.log0.find("checkpoint " + name + " written to"), std::string::npos) << name;
  }
  for (const char* file : {"model-rank-0.safetensors", "optimizer-rank-0.safetensors", "optimizer-rank-1.safetensors"}) {
    EXPECT_TRUE(ReadFile(Dir() / "async_ck" / "step-20" / file) == ReadFile(Dir() / "sync_ck" / "step-20" / file)) << file;
  }
  // The manifest: step, generation, job, layout, data position, RNG state, recipe, files.
  const std::string meta = ReadFile(Dir() / "async_ck" / "step-20" / "meta.yaml");
  for (const char* key : {"step: 20", "generation: 0", "job_id:", "data_position: 160", "topology: {tp: 1, dp: 2, pp: 1, zero: 1",
                          "rng_state: ", "recipe:", "optimizer-rank-1.safetensors:", "xxh3:", "bytes:", "commit: 10"}) {
    EXPECT_NE(meta.find(key), std::string::npos) << key << "\n" << meta;
  }
  // Only the last `keep` (9) steps stay.
  EXPECT_FALSE(fs::exists(Dir() / "async_ck" / "step-2"));
  EXPECT_TRUE(fs::exists(Dir() / "async_ck" / "step-4"));
  // How long the training thread waited on saves (printed by rank 0 at the end).
  std::smatch m;
  for (const RunResult* r : {&async_run, &sync_run}) {
    if (std::regex_search(r->log0, m, std::regex(R"(checkpoint: the training thread was blocked [^\n]*)"))) {
      std::printf("%s: %s\n", r == &async_run ? "async" : "sync", m[0].str().c_str());
    }
  }
}

// ZeRO-3 leaves each step's update to the next forward's gathers; a checkpoint still holds the
// step it names: saves every 5 steps and a run resumed from step 10 end bit for bit where a run
// without saves does.
TEST_F(CheckpointTest, Zero3CheckpointsHoldTheirStepsUpdate) {
  const std::string layout = "--set parallel.zero=3 ";
  RunResult saving = Run("z3_saving", 2, "z3_ck", layout + "--set checkpoint.every=5 --set checkpoint.keep=9");
  ASSERT_EQ(saving.rc, 0) << saving.log0 << saving.log1;
  RunResult plain = Run("z3_plain", 2, "z3_plain_ck", layout + "--set checkpoint.every=0");
  ASSERT_EQ(plain.rc, 0) << plain.log0;
  RunResult resumed = Run("z3_resumed", 2, "z3_resumed_ck",
                          layout + "--set checkpoint.resume_from=" + (Dir() / "z3_ck" / "step-10").string());
  ASSERT_EQ(resumed.rc, 0) << resumed.log0;
  const std::string p = ReadFile(Dir() / "z3_plain" / "params.bin");
  ASSERT_FALSE(p.empty());
  EXPECT_TRUE(ReadFile(Dir() / "z3_saving" / "params.bin") == p) << "saving differs from the run without saves";
  EXPECT_TRUE(ReadFile(Dir() / "z3_resumed" / "params.bin") == p) << "resumed differs from the run without saves";
  const std::map<int, double> straight = Losses(plain.log0), again = Losses(resumed.log0);
  ASSERT_TRUE(again.count(11)) << resumed.log0;
  EXPECT_EQ(again.at(11), straight.at(11)) << "the first step after the resume";
}

// A checkpoint saved by dp2 ZeRO-1 resumes into other data-parallel degrees and ZeRO stages.
TEST_F(CheckpointTest, CheckpointReshardsAcrossDataParallelDegreeAndZeroStage) {
  ExpectReshardedRunsContinueTheLosses("reshard_", 2, "--set parallel.zero=1",
                                       {{"dp1_zero0", 1, "--set parallel.zero=0"}, {"dp2_zero2", 2, "--set parallel.zero=2"},
                                        {"dp2_zero3", 2, "--set parallel.zero=3"}, {"dp2_zero0", 2, "--set parallel.zero=0"}});
}

// A checkpoint of tp2 x dp2 loads into another split of the model: pp2 x dp2, dp4 under ZeRO-3, and
// one process.
TEST_F(CheckpointTest, CheckpointReshardsAcrossTensorAndPipelineParallelism) {
  ExpectReshardedRunsContinueTheLosses("tp_", 4, "--set parallel.tp=2",
                                       {{"pp2_dp2", 4, "--set parallel.pp=2"}, {"dp4_zero3", 4, "--set parallel.zero=3"},
                                        {"one", 1, ""}});
}

// The same run again in the same directory with fewer steps: the commits of the second run are the
// newest (pruning goes by commit order, not step number), so `latest` names an existing step; a
// resume whose `latest` is already past training.steps trains nothing and keeps it.
TEST_F(CheckpointTest, ARerunWithFewerStepsLeavesLatestValid) {
  const std::string keep = "--set checkpoint.every=5 --set checkpoint.keep=2 ";
  RunResult first = Run("rerun_first", 1, "rerun_ck", keep + "--set training.steps=20");
  ASSERT_EQ(first.rc, 0) << first.log0;
  const fs::path ck = Dir() / "rerun_ck";
  ASSERT_EQ(Latest(ck), "step-20");
  EXPECT_FALSE(fs::exists(ck / "step-10"));

  RunResult again = Run("rerun_again", 1, "rerun_ck", keep + "--set training.steps=10");
  ASSERT_EQ(again.rc, 0) << again.log0;
  EXPECT_EQ(Latest(ck), "step-10");
  EXPECT_TRUE(fs::exists(ck / "step-10" / "meta.yaml"));
  EXPECT_TRUE(fs::exists(ck / "step-5" / "meta.yaml"));
  EXPECT_FALSE(fs::exists(ck / "step-15"));  // older commits, although higher steps
  EXPECT_FALSE(fs::exists(ck / "step-20"));
  EXPECT_NE(ReadFile(ck / "step-10" / "meta.yaml").find("commit: 6"), std::string::npos) << ReadFile(ck / "step-10" / "meta.yaml");

  // Starting from step 10 with training.steps=5 would train nothing: refused with the fix, and the
  // directory stays as it was.
  RunResult resumed = Run("rerun_resumed", 1, "rerun_ck", keep + "--set training.steps=5 --set checkpoint.resume_from=" + ck.string());
  EXPECT_NE(resumed.rc, 0) << resumed.log0;
  EXPECT_NE(resumed.log0.find("resumed from " + (ck / "step-10").string() + " at step 10"), std::string::npos) << resumed.log0;
  EXPECT_NE(resumed.log0.find("holds step 10 and training.steps is 5: nothing is left to train"), std::string::npos)
      << resumed.log0;
  EXPECT_NE(resumed.log0.find("set training.steps=110"), std::string::npos) << resumed.log0;
  EXPECT_EQ(Latest(ck), "step-10");
  EXPECT_TRUE(fs::exists(ck / "step-10" / "meta.yaml"));
}

// A checkpoint directory belongs to the job that wrote it: a worker of another job refuses it
// before training (exit code 3: not to be restarted), naming the owner and the fix, and leaves it
// as it was; the owner itself goes on using it.
// A checkpoint directory may be named like a step (a job named "step" has ids step-1, step-2, ...):
// every rank must still read it as the directory that holds the steps.
TEST_F(CheckpointTest, ACheckpointDirectoryNamedLikeAStepResumesOnEveryRank) {
  RunResult first = Run("stepname", 2, "step-1", "--set training.steps=10");
  ASSERT_EQ(first.rc, 0) << first.log0 << first.log1;
  const std::string dir = (Dir() / "step-1").string();
  RunResult resumed = Run("stepname_resume", 2, "step-1-out", "--set training.steps=12 --set checkpoint.resume_from=" + dir);
  ASSERT_EQ(resumed.rc, 0) << resumed.log0 << resumed.log1;
  EXPECT_NE(resumed.log0.find("resumed from " + dir + "/step-10 at step 10"), std::string::npos) << resumed.log0;
}

// A checkpoint of another model (other layers and heads here) is refused before training, naming the keys
// that differ: its shards' ranges could cover this model's parameters, which would then train on
// misplaced weights. Both ranks end, rank 0 with exit code 3 (a restart would be refused again).
TEST_F(CheckpointTest, ACheckpointOfAnotherModelIsRefusedNamingTheKeys) {
  RunResult first = Run("othermodel_first", 1, "othermodel_ck", "--set training.steps=5");
  ASSERT_EQ(first.rc, 0) << first.log0;
  const fs::path ck = Dir() / "othermodel_ck";
  const std::string other = "--set model.layers=1 --set model.heads=4 --set training.steps=10 --set checkpoint.resume_from=" +
                            ck.string();
  RunResult resumed = Run("othermodel_resume", 2, "othermodel_out", other);
  EXPECT_NE(resumed.rc, 0);
  EXPECT_NE(resumed.log0.find("checkpoint " + (ck / "step-5").string() +
                              " was saved by another model: model.layers 2 (this recipe: 1), model.heads 2 (this "
                              "recipe: 4). Resume it with the recipe that saved it"),
            std::string::npos)
      << resumed.log0;
  EXPECT_EQ(resumed.log0.find("step 6/"), std::string::npos) << resumed.log0;
  EXPECT_EQ(resumed.log1.find("step 6/"), std::string::npos) << resumed.log1;
  const int status = std::system(("OMP_NUM_THREADS=1 " + WorkerBin() + " --recipe " + (Dir() / "r.yaml").string() +
                                  " --set checkpoint.dir=" + (Dir() / "othermodel_out1").string() + " " + other +
                                  " > /dev/null 2>&1")
                                     .c_str());
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 3) << status;
  // The same model in another layout is no other model.
  RunResult same = Run("othermodel_same", 2, "othermodel_same_ck",
                       "--set training.steps=7 --set checkpoint.resume_from=" + ck.string());
  EXPECT_EQ(same.rc, 0) << same.log0;
}

// A checkpoint directory that cannot be written fails every rank before training, at once and with
// exit code 3, instead of the ranks waiting on each other for the first commit.
TEST_F(CheckpointTest, AnUnwritableCheckpointDirectoryFailsBeforeTraining) {
  std::ofstream(Dir() / "in_the_way") << "a file";
  const auto start = std::chrono::steady_clock::now();
  RunResult blocked = Run("unwritable", 2, "in_the_way/ck", "--set training.steps=10");
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 30.0);
  EXPECT_NE(blocked.rc, 0);
  for (const std::string& log : {blocked.log0, blocked.log1}) {
    EXPECT_NE(log.find("checkpoint.dir " + (Dir() / "in_the_way" / "ck").string() + " cannot be written: "),
              std::string::npos)
        << log;
    EXPECT_EQ(log.find("step 1/"), std::string::npos) << log;
  }
  const int status = std::system(("OMP_NUM_THREADS=1 " + WorkerBin() + " --recipe " + (Dir() / "r.yaml").string() +
                                  " --set checkpoint.dir=" + (Dir() / "in_the_way" / "ck").string() + " > /dev/null 2>&1")
                                     .c_str());
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 3) << status;
}

TEST_F(CheckpointTest, AnotherJobsCheckpointDirectoryIsRefused) {
  RunResult owner = Run("own_first", 1, "own_ck", "--set training.steps=5", "LTRAIN_JOB_ID=owner-1");
  ASSERT_EQ(owner.rc, 0) << owner.log0;
  const fs::path ck = Dir() / "own_ck";
  ASSERT_EQ(Latest(ck), "step-5");
  const std::string meta = ReadFile(ck / "step-5" / "meta.yaml");

  RunResult other = Run("own_other", 1, "own_ck", "--set training.steps=10", "LTRAIN_JOB_ID=other-1");
  EXPECT_NE(other.rc, 0);
  EXPECT_NE(other.log0.find("checkpoint directory " + ck.string() + " belongs to job owner-1 (its step-5)"),
            std::string::npos)
      << other.log0;
  EXPECT_NE(other.log0.find("checkpoint.resume_from=" + ck.string()), std::string::npos) << other.log0;
  EXPECT_EQ(other.log0.find("step 1/"), std::string::npos) << other.log0;
  EXPECT_EQ(Latest(ck), "step-5");
  EXPECT_EQ(ReadFile(ck / "step-5" / "meta.yaml"), meta);
  const std::string bin = WorkerBin();
  const int status = std::system(("LTRAIN_JOB_ID=other-1 OMP_NUM_THREADS=1 " + bin + " --recipe " + (Dir() / "r.yaml").string() +
                                  " --set checkpoint.dir=" + ck.string() + " > /dev/null 2>&1")
                                     .c_str());
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 3) << status;

  // Reading it is fine: another job starts from it and writes to its own directory.
  RunResult reader = Run("own_reader", 1, "own_reader_ck", "--set training.steps=10 --set checkpoint.resume_from=" + ck.string(),
                         "LTRAIN_JOB_ID=other-1");
  ASSERT_EQ(reader.rc, 0) << reader.log0;
  EXPECT_NE(reader.log0.find("resumed from " + (ck / "step-5").string() + " at step 5"), std::string::npos) << reader.log0;
  // And the owner resumes in it.
  RunResult again = Run("own_again", 1, "own_ck", "--set training.steps=10 --set checkpoint.resume_from=" + ck.string(),
                        "LTRAIN_JOB_ID=owner-1");
  ASSERT_EQ(again.rc, 0) << again.log0;
  EXPECT_EQ(Latest(ck), "step-10");
}

}  // namespace
}  // namespace ltrain
