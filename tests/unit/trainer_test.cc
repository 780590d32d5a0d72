#include "worker/train/trainer.h"

#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>

#include <c10/util/Exception.h>
#include <gtest/gtest.h>
#include <torch/nn.h>

#include "common/files.h"
#include "worker/checkpoint/checkpoint.h"

namespace ltrain::worker {
namespace {

namespace fs = std::filesystem;

class TrainerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("ltrain_trainer_test_" + std::to_string(::getpid()) + "_" +
                                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    RemoveTree(dir_);
    fs::create_directories(dir_ / "data");
    std::vector<uint16_t> tokens(4000);
    for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<uint16_t>((i * 7 + i / 13) % 64);
    ASSERT_TRUE(WriteTokenFile((dir_ / "data" / "train.bin").string(), tokens, 256).ok());

    recipe_.name = "tiny";
    recipe_.model.layers = 1;
    recipe_.model.d_model = 16;
    recipe_.model.heads = 2;
    recipe_.model.seq_len = 8;
    recipe_.model.vocab = 256;
    recipe_.data.path = (dir_ / "data").string();
    recipe_.training.steps = 6;
    recipe_.training.micro_batch = 2;
    recipe_.training.global_batch = 4;
    recipe_.training.warmup_steps = 2;
    recipe_.training.lr = 1e-2;
    recipe_.checkpoint.every = 3;
    recipe_.checkpoint.keep = 0;
    options_.print_progress = false;
    options_.checkpoint_dir = (dir_ / "ckpt").string();
  }
  void TearDown() override { RemoveTree(dir_); }

  fs::path dir_;
  Recipe recipe_;
  TrainerOptions options_;
};

// Trains six steps with a save at step 3, resumes another run from it, and expects the same parameters.
void ExpectResumeMatches(const Recipe& recipe, const TrainerOptions& options, const fs::path& dir) {
  FakeCommunicator comm;
  auto full = Trainer::Create(recipe, options, &comm);
  ASSERT_TRUE(full.ok()) << full.status().ToString();
  double first_loss = 0, last_loss = 0;
  for (int i = 0; i < 6; ++i) {
    StatusOr<double> loss = (*full)->Step();
    ASSERT_TRUE(loss.ok()) << loss.status().ToString();
    if (i == 0) first_loss = *loss;
    last_loss = *loss;
    if ((*full)->step() == 3) {
      ASSERT_TRUE((*full)->Save().ok());
    }
  }
  EXPECT_LT(last_loss, first_loss);
  ASSERT_TRUE(fs::exists(dir / "ckpt" / "step-3" / "meta.yaml"));
  std::ifstream latest(dir / "ckpt" / "latest");
  std::string name;
  std::getline(latest, name);
  EXPECT_EQ(name, "step-3");

  Recipe resumed_recipe = recipe;
  resumed_recipe.checkpoint.resume_from = (dir / "ckpt").string();  // a checkpoint dir: its latest
  TrainerOptions resumed_options = options;
  resumed_options.checkpoint_dir = (dir / "ckpt2").string();
  FakeCommunicator comm2;
  auto resumed = Trainer::Create(resumed_recipe, resumed_options, &comm2);
  ASSERT_TRUE(resumed.ok()) << resumed.status().ToString();
  EXPECT_EQ((*resumed)->step(), 3);
  EXPECT_EQ((*resumed)->data_position(), 3 * 4);
  ASSERT_TRUE((*resumed)->Run().ok());
  EXPECT_EQ((*resumed)->step(), 6);

  auto a = (*full)->Parameters(), b = (*resumed)->Parameters();
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(torch::equal(a[i], b[i])) << "parameter " << i;
  EXPECT_TRUE(fs::exists(dir / "ckpt2" / "step-6" / "optimizer-rank-0.safetensors"));
}

TEST_F(TrainerTest, ResumedRunEndsWithTheSameParametersAsAnUninterruptedOne) {
  ExpectResumeMatches(recipe_, options_, dir_);
}

TEST_F(TrainerTest, ResumedRunWithTorchSamplingReplaysTheSameBatches) {
  // The torch draws are not the hash's: the first step's loss differs.
  FakeCommunicator comm_hash, comm_torch;
  Recipe torch_recipe = recipe_;
  torch_recipe.data.sampling = Sampling::kTorch;
  torch_recipe.data.seed = 1234;
  auto hashed = Trainer::Create(recipe_, options_, &comm_hash);
  auto drawn = Trainer::Create(torch_recipe, options_, &comm_torch);
  ASSERT_TRUE(hashed.ok() && drawn.ok());
  StatusOr<double> a = (*hashed)->Step(), b = (*drawn)->Step();
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_NE(*a, *b);
  hashed->reset();
  drawn->reset();
  ExpectResumeMatches(torch_recipe, options_, dir_);
}

TEST_F(TrainerTest, ResumeSaysWhenTheBatchOrderChanges) {
  FakeCommunicator comm;
  auto first = Trainer::Create(recipe_, options_, &comm);
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  ASSERT_TRUE((*first)->Step().ok());
  ASSERT_TRUE((*first)->Save().ok());
  first->reset();

  auto resume_output = [&](const Recipe& changed) {
    Recipe r = changed;
    r.checkpoint.resume_from = (dir_ / "ckpt").string();
    TrainerOptions o = options_;
    o.print_progress = true;
    o.checkpoint_dir = (dir_ / "ckpt2").string();
    FakeCommunicator c;
    ::testing::internal::CaptureStdout();
    auto resumed = Trainer::Create(r, o, &c);
    std::fflush(stdout);
    std::string out = ::testing::internal::GetCapturedStdout();
    EXPECT_TRUE(resumed.ok()) << resumed.status().ToString();
    return out;
  };
  std::string same = resume_output(recipe_);
  EXPECT_NE(same.find("resumed from"), std::string::npos) << same;
  EXPECT_EQ(same.find("resume: the saved run drew"), std::string::npos) << same;

  Recipe torch_recipe = recipe_;
  torch_recipe.data.sampling = Sampling::kTorch;
  torch_recipe.data.seed = 1234;
  std::string changed = resume_output(torch_recipe);
  EXPECT_NE(changed.find("resume: the saved run drew its batches with data.sampling epochs, seed " +
                         std::to_string(recipe_.training.seed) + "; this run draws them with torch, seed 1234"),
            std::string::npos)
      << changed;
}

// A device out of memory (LibTorch's OutOfMemoryError, as the CUDA allocator throws it) reaches the
// user with LibTorch's message and what to change in the recipe; other errors keep theirs alone.
TEST(CaughtExceptionTest, AnOutOfMemoryErrorSaysWhatToChange) {
  Status oom, other;
  try {
    throw c10::OutOfMemoryError({__func__, __FILE__, static_cast<uint32_t>(__LINE__)},
                                "CUDA out of memory. Tried to allocate 2.00 GiB");
  } catch (...) {
    oom = CaughtException("training step");
  }
  EXPECT_NE(oom.message().find("training step: out of memory: CUDA out of memory. Tried to allocate 2.00 GiB"),
            std::string::npos)
      << oom.message();
  for (const char* fix : {"activation_checkpointing: selective", "training.micro_batch", "parallel.zero", "ltrain plan"}) {
    EXPECT_NE(oom.message().find(fix), std::string::npos) << oom.message();
  }
  try {
    throw c10::Error({__func__, __FILE__, static_cast<uint32_t>(__LINE__)}, "shape mismatch");
  } catch (...) {
    other = CaughtException("training step");
  }
  EXPECT_EQ(other.message().rfind("training step: LibTorch error: shape mismatch", 0), 0u) << other.message();
  EXPECT_EQ(other.message().find("ltrain plan"), std::string::npos) << other.message();
}

TEST(TorchSamplingTest, DrawsWhatTorchRandintDraws) {
  // Expected values from PyTorch: g = torch.Generator().manual_seed(1234);
  // torch.randint(0, 1000, (4,), generator=g), then (3,) more from the same g.
  Recipe recipe;
  recipe.data.sampling = Sampling::kTorch;
  recipe.data.seed = 1234;
  recipe.training.seed = 99;  // not used: data.seed wins
  std::unique_ptr<WindowStream> stream = MakeWindowStream(recipe, 1000);
  ASSERT_NE(stream, nullptr);
  const std::vector<int64_t> expected = {775, 171, 806, 365, 316, 564, 432};
  for (size_t i = 0; i < expected.size(); ++i) EXPECT_EQ(stream->Start(static_cast<int64_t>(i)), expected[i]) << i;

  // Past one internal chunk, and back: g seeded 7, torch.randint(0, 123456, (5000,)) has these at
  // 4095, 4096 and 4999. training.seed is the seed when data.seed is unset.
  recipe.data.seed = -1;
  recipe.training.seed = 7;
  stream = MakeWindowStream(recipe, 123456);
  EXPECT_EQ(stream->Start(4999), 23861);
  EXPECT_EQ(stream->Start(4095), 86292);
  EXPECT_EQ(stream->Start(4096), 108516);

  recipe.data.sampling = Sampling::kHash;
  EXPECT_EQ(MakeWindowStream(recipe, 123456), nullptr);
}

TEST_F(TrainerTest, CorruptCheckpointIsRejected) {
  FakeCommunicator comm;
  auto t = Trainer::Create(recipe_, options_, &comm);
  ASSERT_TRUE(t.ok());
  ASSERT_TRUE((*t)->Step().ok());
  ASSERT_TRUE((*t)->Save().ok());
  {
    // A byte of the data, not of the header: the hash finds it.
    const fs::path file = dir_ / "ckpt" / "step-1" / "model-rank-0.safetensors";
    const auto at = static_cast<std::streamoff>(fs::file_size(file) - 10);
    std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(at);
    const char original = static_cast<char>(f.get());
    f.seekp(at);
    f.put(static_cast<char>(original ^ 0xff));
  }
  Recipe r = recipe_;
  r.checkpoint.resume_from = (dir_ / "ckpt" / "step-1").string();
  FakeCommunicator comm2;
  auto bad = Trainer::Create(r, options_, &comm2);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("step-1 is corrupt (model-rank-0.safetensors xxh3 mismatch: expected "),
            std::string::npos)
      << bad.status().message();
}

// Data parallelism overlaps communication with backward: with small buckets, the first bucket's
// all-reduce (recorded by the fake, which plays rank 0 of 2 identical ranks) starts while backward
// is still running, and the step's result equals the one-rank result.
TEST_F(TrainerTest, FirstBucketAllReduceStartsBeforeBackwardEnds) {
  Recipe r = recipe_;
  r.model.layers = 4;
  r.model.d_model = 128;
  r.model.heads = 4;
  r.model.seq_len = 64;
  r.training.micro_batch = 4;
  r.training.global_batch = 8;
  r.parallel.bucket_mb = 0.1;
  FakeCommunicator comm;
  comm.SimulateSize(2);
  auto t = Trainer::Create(r, options_, &comm);
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  const size_t before = comm.log().size();
  StatusOr<double> loss = (*t)->Step();
  ASSERT_TRUE(loss.ok()) << loss.status().ToString();
  std::vector<FakeCommunicator::Call> buckets;
  for (size_t i = before; i < comm.log().size(); ++i) {
    if (comm.log()[i].op == "all_reduce" && comm.log()[i].numel > 1) buckets.push_back(comm.log()[i]);
  }
  ASSERT_GE(buckets.size(), 4u);
  EXPECT_GT(buckets.front().start, (*t)->backward_start());
  EXPECT_LT(buckets.front().start, (*t)->backward_end());

  // The same step on one rank with both micro-batches: the same loss.
  Recipe one = r;
  one.training.global_batch = 4;
  FakeCommunicator single;
  auto reference = Trainer::Create(one, options_, &single);
  ASSERT_TRUE(reference.ok());
  StatusOr<double> ref_loss = (*reference)->Step();
  ASSERT_TRUE(ref_loss.ok());
  EXPECT_NEAR(*loss, *ref_loss, 1e-6 * *ref_loss);
}

// A token past model.vocab would index past the embedding table (on a GPU, a device assert): the
// step fails instead, naming the file and the fix, as a precondition no restart changes.
TEST_F(TrainerTest, TokenIdOutsideTheVocabularyFailsTheStepNamingTheFile) {
  std::vector<uint16_t> tokens(4000, 7);
  for (size_t i = 0; i < tokens.size(); i += 50) tokens[i] = 300;  // declared vocab 256, model.vocab 256
  ASSERT_TRUE(WriteTokenFile((dir_ / "data" / "train.bin").string(), tokens, 256).ok());
  FakeCommunicator comm;
  auto t = Trainer::Create(recipe_, options_, &comm);
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  StatusOr<double> loss = (*t)->Step();
  ASSERT_FALSE(loss.ok());
  EXPECT_EQ(loss.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(loss.status().message().find("train.bin holds token id 300, outside model.vocab=256"), std::string::npos)
      << loss.status().message();
}

// Validation reads the data's validation split (here a val.bin beside train.bin): without it the job
// fails at once, saying what to do.
TEST_F(TrainerTest, ValidationWithoutValBinIsRefusedNamingTheFix) {
  Recipe r = recipe_;
  r.training.eval_every = 2;
  FakeCommunicator comm;
  auto t = Trainer::Create(r, options_, &comm);
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(t.status().message().find("training.eval_every=2 evaluates on the validation split"), std::string::npos)
      << t.status().message();
  EXPECT_NE(t.status().message().find("val.bin"), std::string::npos) << "the file it looked for: " << t.status().message();
  EXPECT_NE(t.status().message().find("or set training.eval_every: 0"), std::string::npos) << t.status().message();
}

TEST_F(TrainerTest, CollectiveFailureSurfacesAsStatus) {
  FakeCommunicator comm;
  comm.FailAt(0, Unavailable("peer rank 1 died"));  // the initial parameter broadcast
  auto t = Trainer::Create(recipe_, options_, &comm);
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().message(), "peer rank 1 died");
}

}  // namespace
}  // namespace ltrain::worker
