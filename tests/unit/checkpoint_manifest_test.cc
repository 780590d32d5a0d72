// Checkpoint manifests without LibTorch: meta.yaml written and read back, paths that leave their
// directory refused, an older format named, the ranks' manifests merged, pruning by commit order
// (never by step number), and a directory's owner.
#include "common/checkpoint_manifest.h"

#include <unistd.h>

#include <filesystem>
#include <fstream>

#include <gtest/gtest.h>

#include "common/safetensors.h"

namespace ltrain {
namespace {

namespace fs = std::filesystem;

class CheckpointManifestTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("ltrain_manifest_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  static CheckpointMeta Meta(int64_t step, int64_t commit, const std::string& job) {
    CheckpointMeta meta;
    meta.step = step;
    meta.commit = commit;
    meta.job_id = job;
    meta.layout = "tp=1 pp=1 zero=0";
    meta.rng_state = "00ff";
    meta.files["model-rank-0.safetensors"] = {16, "0123456789abcdef"};
    return meta;
  }

  // step-N/meta.yaml under dir_ (no shard files).
  void WriteStep(int64_t step, int64_t commit, const std::string& job) {
    const fs::path step_dir = dir_ / StepDirName(step);
    fs::create_directories(step_dir);
    std::ofstream(step_dir / kCheckpointMetaFile) << CheckpointMetaYaml(Meta(step, commit, job), "");
  }

  fs::path dir_;
};

TEST_F(CheckpointManifestTest, MetaReadsBackAsWritten) {
  CheckpointMeta meta = Meta(40, 7, "tiny-1");
  meta.data_position = 320;
  meta.world_size = 2;
  meta.generation = 1;
  meta.tp = 1;
  meta.dp = 2;
  meta.zero = 1;
  meta.files["optimizer-rank-1.safetensors"] = {1234, "fedcba9876543210"};
  std::ofstream(dir_ / kCheckpointMetaFile)
      << CheckpointMetaYaml(meta, "data: {sampling: torch, seed: 5}\ntraining: {seed: 3}\n");
  StatusOr<CheckpointMeta> back = ReadCheckpointMeta(dir_.string());
  ASSERT_TRUE(back.ok()) << back.status().message();
  EXPECT_EQ(back->format, kCheckpointFormat);
  EXPECT_EQ(back->step, 40);
  EXPECT_EQ(back->commit, 7);
  EXPECT_EQ(back->job_id, "tiny-1");
  EXPECT_EQ(back->data_position, 320);
  EXPECT_EQ(back->dp, 2);
  EXPECT_EQ(back->zero, 1);
  EXPECT_EQ(back->data_sampling, "torch");
  EXPECT_EQ(back->data_seed, 5);
  ASSERT_EQ(back->files.size(), 2u);
  EXPECT_EQ(back->files.at("optimizer-rank-1.safetensors").bytes, 1234u);
  EXPECT_EQ(back->files.at("optimizer-rank-1.safetensors").xxh3, "fedcba9876543210");
}

TEST_F(CheckpointManifestTest, FileNamesThatLeaveTheDirectoryAreRefused) {
  for (const char* name : {"../model-rank-0.safetensors", "/etc/passwd", "sub/model.safetensors", ".."}) {
    SCOPED_TRACE(name);
    CheckpointMeta meta = Meta(1, 1, "j");
    meta.files[name] = {1, "00"};
    std::ofstream(dir_ / kCheckpointMetaFile, std::ios::trunc) << CheckpointMetaYaml(meta, "");
    StatusOr<CheckpointMeta> back = ReadCheckpointMeta(dir_.string());
    ASSERT_FALSE(back.ok());
    EXPECT_NE(back.status().message().find("not a plain file name"), std::string::npos) << back.status().message();
  }
  EXPECT_TRUE(IsPlainFileName("model-rank-0.safetensors"));
}

TEST_F(CheckpointManifestTest, AnOlderFormatSaysWhichFormatIsRead) {
  std::ofstream(dir_ / kCheckpointMetaFile) << "format: 2\nstep: 5\nfiles: {model.pt: {fnv1a64: 0123, bytes: 10}}\n";
  StatusOr<CheckpointMeta> back = ReadCheckpointMeta(dir_.string());
  ASSERT_FALSE(back.ok());
  EXPECT_EQ(back.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(back.status().message().find("has format 2"), std::string::npos) << back.status().message();
  EXPECT_NE(back.status().message().find("reads format 3"), std::string::npos) << back.status().message();
}

TEST_F(CheckpointManifestTest, FilesAreCheckedBySizeAndVerifiedByHash) {
  const fs::path step = dir_ / "step-3";
  fs::create_directories(step);
  std::ofstream(step / "model-rank-0.safetensors", std::ios::binary) << std::string(64, 'x');
  CheckpointMeta meta = Meta(3, 1, "j");
  meta.files.clear();
  meta.files["model-rank-0.safetensors"] = {64, HashFile((step / "model-rank-0.safetensors").string())->xxh3};
  EXPECT_TRUE(VerifyCheckpointFiles(step.string(), meta).ok());
  std::ofstream(step / "model-rank-0.safetensors", std::ios::binary | std::ios::trunc) << std::string(63, 'x') << 'y';
  EXPECT_TRUE(CheckCheckpointFiles(step.string(), meta).ok());  // same size
  Status verified = VerifyCheckpointFiles(step.string(), meta);
  ASSERT_FALSE(verified.ok());
  EXPECT_NE(verified.message().find("model-rank-0.safetensors xxh3 mismatch: expected "), std::string::npos) << verified.message();
  fs::resize_file(step / "model-rank-0.safetensors", 10);
  Status sized = CheckCheckpointFiles(step.string(), meta);
  EXPECT_NE(sized.message().find("size mismatch: expected 64 bytes, got 10"), std::string::npos) << sized.message();
}

TEST_F(CheckpointManifestTest, RankManifestsMerge) {
  ASSERT_TRUE(WriteRankManifest(dir_.string(), 0, {{"model-rank-0.safetensors", {10, "aa"}}}).ok());
  ASSERT_TRUE(WriteRankManifest(dir_.string(), 1, {{"optimizer-rank-1.safetensors", {20, "bb"}}}).ok());
  StatusOr<std::map<std::string, CheckpointFile>> files = ReadRankManifests(dir_.string());
  ASSERT_TRUE(files.ok()) << files.status().message();
  ASSERT_EQ(files->size(), 2u);
  EXPECT_EQ(files->at("optimizer-rank-1.safetensors").bytes, 20u);
  ASSERT_TRUE(WriteRankManifest(dir_.string(), 2, {{"optimizer-rank-1.safetensors", {20, "bb"}}}).ok());
  EXPECT_FALSE(ReadRankManifests(dir_.string()).ok());
  EXPECT_TRUE(IsRankManifestName("rank-12.yaml"));
  EXPECT_FALSE(IsRankManifestName("rank-.yaml"));
  EXPECT_FALSE(IsRankManifestName("meta.yaml"));
}

// A run that went to step 20, then again (same job) to step 10: the newest commits are steps 5 and
// 10, whatever their numbers; `latest` is never pruned.
// A checkpoint directory is made if missing, and one that cannot be (a file in the way) or cannot be
// written is refused naming it, the reason and the fix; the probe leaves nothing behind.
TEST_F(CheckpointManifestTest, ACheckpointDirectoryIsCheckedWritableBeforeTraining) {
  const std::string made = (dir_ / "new" / "ck").string();
  ASSERT_TRUE(CheckCheckpointDirWritable(made, 3).ok());
  EXPECT_TRUE(fs::is_directory(made));
  EXPECT_TRUE(fs::is_empty(made));
  std::ofstream(dir_ / "afile") << "x";
  const Status blocked = CheckCheckpointDirWritable((dir_ / "afile" / "ck").string(), 0);
  ASSERT_FALSE(blocked.ok());
  EXPECT_EQ(blocked.code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(blocked.message().rfind("checkpoint.dir " + (dir_ / "afile" / "ck").string() + " cannot be written: ", 0), 0u)
      << blocked.message();
  EXPECT_NE(blocked.message().find("set checkpoint.dir to a directory every node can write"), std::string::npos);
  if (::geteuid() != 0) {  // root writes anywhere
    fs::create_directories(dir_ / "readonly");
    fs::permissions(dir_ / "readonly", fs::perms::owner_read | fs::perms::owner_exec);
    EXPECT_FALSE(CheckCheckpointDirWritable((dir_ / "readonly").string(), 0).ok());
    fs::permissions(dir_ / "readonly", fs::perms::owner_all);
  }
}

TEST(CheckpointPruneTest, KeepsTheNewestCommitsNotTheHighestSteps) {
  std::vector<CommittedStep> steps = {{5, 5, "j", true}, {10, 6, "j", true}, {15, 3, "j", true}, {20, 4, "j", true}};
  EXPECT_EQ(StepsToPrune(steps, 2, 10), (std::vector<int64_t>{20, 15}));
  EXPECT_EQ(StepsToPrune(steps, 3, 10), (std::vector<int64_t>{15}));
  EXPECT_TRUE(StepsToPrune(steps, 0, 10).empty());
  EXPECT_TRUE(StepsToPrune(steps, 9, 10).empty());
  // Steps without a commit number (unreadable manifests, older formats) are the oldest.
  std::vector<CommittedStep> mixed = {{30, -1, "", false}, {5, 1, "j", true}, {10, 2, "j", true}};
  EXPECT_EQ(StepsToPrune(mixed, 2, 10), (std::vector<int64_t>{30}));
  EXPECT_EQ(StepsToPrune(mixed, 1, 10), (std::vector<int64_t>{5, 30}));
  EXPECT_EQ(NextCommitNumber(steps), 7);
  EXPECT_EQ(NextCommitNumber({}), 1);
}

TEST_F(CheckpointManifestTest, StepsListedWithTheirCommitAndOwner) {
  WriteStep(5, 1, "own-1");
  WriteStep(10, 2, "own-1");
  fs::create_directories(dir_ / "step-15");  // no meta.yaml
  fs::create_directories(dir_ / ".tmp-step-20");
  std::ofstream(dir_ / "latest") << "step-10\n";
  std::vector<CommittedStep> steps = ListCommittedSteps(dir_.string());
  ASSERT_EQ(steps.size(), 3u);
  EXPECT_EQ(steps[0].step, 5);
  EXPECT_EQ(steps[1].commit, 2);
  EXPECT_FALSE(steps[2].readable);
  EXPECT_EQ(LatestCommittedStep(dir_.string()), 10);

  EXPECT_FALSE(ForeignCheckpoint(dir_.string(), "own-1").has_value());
  std::optional<CommittedStep> owner = ForeignCheckpoint(dir_.string(), "other-1");
  ASSERT_TRUE(owner.has_value());
  EXPECT_EQ(owner->step, 10);
  EXPECT_EQ(owner->job_id, "own-1");
  const std::string why = CheckpointOwnershipError(dir_.string(), *owner, "job other-1");
  EXPECT_NE(why.find("belongs to job own-1"), std::string::npos) << why;
  EXPECT_NE(why.find("checkpoint.resume_from=" + dir_.string()), std::string::npos) << why;
  EXPECT_FALSE(ForeignCheckpoint((dir_ / "nowhere").string(), "x").has_value());
}

}  // namespace
}  // namespace ltrain
