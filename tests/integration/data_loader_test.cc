// The training loader through `ltrain launch`: a mixture of two prepared datasets at 0.7 / 0.3, a
// run resumed at another data-parallel size reading the windows an uninterrupted one reads, and a
// supervised fine-tune whose response loss falls. The windows each rank reads come from the
// worker's LTRAIN_DATA_TRACE.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <sstream>
#include <tuple>

#include "tests/support/subprocess.h"

namespace ltrain::testing {
namespace {

namespace fs = std::filesystem;
using std::chrono::seconds;

// What a run's ranks read: sample index -> (source, start token).
using Trace = std::map<int64_t, std::pair<int, int64_t>>;

class DataLoaderTest : public ::testing::Test {
 protected:
  std::map<std::string, std::string> Env(const std::string& home) const {
    return {{"LTRAIN_HOME", dir_.Join(home)}, {"OMP_NUM_THREADS", "1"}, {"LTRAIN_DATA_TRACE", dir_.Join(home)}};
  }

  // Every rank's trace in `home`; a sample read twice (a step made ahead, then again after a
  // restart) must have read the same window both times.
  Trace ReadTrace(const std::string& home) {
    Trace trace;
    for (const auto& entry : fs::directory_iterator(dir_.Join(home))) {
      if (entry.path().filename().string().rfind("data-rank-", 0) != 0) continue;
      std::ifstream in(entry.path());
      int64_t sample = 0, start = 0, epoch = 0;
      int source = 0;
      while (in >> sample >> source >> start >> epoch) {
        auto [it, inserted] = trace.emplace(sample, std::make_pair(source, start));
        EXPECT_TRUE(inserted || it->second == std::make_pair(source, start)) << home << " sample " << sample;
      }
    }
    return trace;
  }

  // Two datasets of the licence texts, each a half of them.
  void PrepareTwoSources() {
    std::vector<std::string> texts = LicenseTexts();
    ASSERT_GE(texts.size(), 4u) << "the tests train on the licence texts in /usr/share/common-licenses";
    for (int half = 0; half < 2; ++half) {
      std::vector<std::string> argv = {LtrainBinary(), "data", "prepare", "--input"};
      for (size_t i = half; i < texts.size(); i += 2) argv.push_back(texts[i]);
      argv.insert(argv.end(), {"--output", dir_.Join(half == 0 ? "a" : "b")});
      ProcessResult prepared = RunProcess(argv);
      ASSERT_EQ(prepared.exit_code, 0) << prepared.output;
    }
  }

  TempDir dir_;
};

// Two sources at 0.7 / 0.3: over 1,000 steps the tokens drawn from each are within 1% of its weight.
TEST_F(DataLoaderTest, AMixtureDrawsEachSourceByItsWeight) {
  PrepareTwoSources();
  const std::string recipe = dir_.Write(
      "mix.yaml", "name: mix\nmodel: {layers: 1, d_model: 16, heads: 2, seq_len: 16}\n"
                  "data:\n  sources:\n    - {path: " + dir_.Join("a") + ", weight: 0.7}\n    - {path: " + dir_.Join("b") +
                      ", weight: 0.3}\n"
                      "training: {steps: 1000, micro_batch: 4, global_batch: 8, log_every: 500}\n"
                      "checkpoint: {enabled: false}\n");
  ProcessResult result = RunProcess({LtrainBinary(), "launch", recipe}, Env("home"), seconds(600));
  ASSERT_EQ(result.exit_code, 0) << result.output;
  EXPECT_NE(result.output.find("2 sources: " + dir_.Join("a") + " (share 0.7"), std::string::npos) << result.output;
  Trace trace = ReadTrace("home");
  int64_t tokens[2] = {0, 0};
  for (int64_t sample = 0; sample < 1000 * 8; ++sample) {
    auto it = trace.find(sample);
    ASSERT_NE(it, trace.end()) << "sample " << sample << " was never read";
    tokens[it->second.first] += 16;
  }
  const double share = static_cast<double>(tokens[0]) / static_cast<double>(tokens[0] + tokens[1]);
  EXPECT_NEAR(share, 0.7, 0.01);
}

// A run checkpointed at step 10 with 2 data-parallel ranks, resumed from there with 1 (and again with
// 2): every sample after step 10 reads the window the uninterrupted run read; at the same size the
// run ends with the same parameters, bit for bit.
TEST_F(DataLoaderTest, AResumedRunReadsTheSameWindowsAtAnotherDataParallelSize) {
  ProcessResult prepared = PrepareLicenseData(dir_.Join("data"));
  ASSERT_EQ(prepared.exit_code, 0) << prepared.output;
  auto recipe = [&](const std::string& name, int nproc, const std::string& resume_from) {
    return dir_.Write(name + ".yaml",
                      TinyRecipe(name, dir_.Join("data")) +
                          "training: {steps: 20, micro_batch: 2, global_batch: 8, deterministic: true}\n"
                          "parallel: {nproc_per_node: " + std::to_string(nproc) + "}\n"
                          "checkpoint: {every: 10, keep: 3" +
                          (resume_from.empty() ? "" : ", resume_from: " + resume_from) + "}\n");
  };
  ProcessResult reference = RunProcess({LtrainBinary(), "launch", recipe("tiny", 2, "")}, Env("reference"), seconds(300));
  ASSERT_EQ(reference.exit_code, 0) << reference.output;
  const std::string step10 = dir_.Join("reference/checkpoints/tiny-1/step-10");
  ASSERT_TRUE(fs::exists(step10)) << reference.output;
  const Trace want = ReadTrace("reference");
  for (auto [home, nproc] : {std::pair{std::string("dp1"), 1}, std::pair{std::string("dp2"), 2}}) {
    SCOPED_TRACE(home);
    ProcessResult resumed =
        RunProcess({LtrainBinary(), "launch", recipe("tiny", nproc, step10)}, Env(home), seconds(300));
    ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
    EXPECT_NE(resumed.output.find("resumed from " + step10 + " at step 10 data_position 80"), std::string::npos)
        << resumed.output;
    const Trace got = ReadTrace(home);
    EXPECT_EQ(got.begin()->first, 80) << "the resumed run read samples before its data position";
    for (int64_t sample = 80; sample < 160; ++sample) {
      ASSERT_TRUE(got.count(sample) && want.count(sample)) << "sample " << sample;
      EXPECT_EQ(got.at(sample), want.at(sample)) << "sample " << sample;
    }
    if (nproc == 2) {
      const std::string a = ReadFile(dir_.Join("reference/checkpoints/tiny-1/step-20/model-rank-0.safetensors"));
      const std::string b = ReadFile(dir_.Join(home + "/checkpoints/tiny-1/step-20/model-rank-0.safetensors"));
      ASSERT_FALSE(a.empty());
      EXPECT_TRUE(a == b) << "the resumed run's parameters differ from the uninterrupted run's";
    }
  }
}

// `ltrain data prepare --sft` of question-and-answer records, then a fine-tune: the loss, counted on
// the responses only, falls from the first step's to a third of it, and keeps falling between
// validations.
TEST_F(DataLoaderTest, AFineTuneOnSftDataLearnsTheResponses) {
  std::string lines;
  for (int i = 0; i < 3000; ++i) {
    const int a = i % 50, b = (i / 50) % 50;
    lines += "{\"prompt\": \"Q: what is " + std::to_string(a) + " plus " + std::to_string(b) +
             "?\\nA:\", \"response\": \" " + std::to_string(a + b) + ".\\n\"}\n";
  }
  const std::string input = dir_.Write("qa.jsonl", lines);
  ProcessResult prepared =
      RunProcess({LtrainBinary(), "data", "prepare", "--sft", "--input", input, "--output", dir_.Join("sft")});
  ASSERT_EQ(prepared.exit_code, 0) << prepared.output;
  ProcessResult inspect = RunProcess({LtrainBinary(), "data", "inspect", dir_.Join("sft")});
  ASSERT_EQ(inspect.exit_code, 0) << inspect.output;
  EXPECT_NE(inspect.output.find("supervised fine-tuning data: the loss counts"), std::string::npos) << inspect.output;
  const std::string recipe = dir_.Write(
      "sft.yaml", "name: sft\nmodel: {layers: 2, d_model: 64, heads: 4, seq_len: 32}\ndata: {path: " +
                      dir_.Join("sft") +
                      "}\ntraining: {steps: 150, micro_batch: 8, global_batch: 16, lr: 0.003, warmup_steps: 10, "
                      "eval_every: 50, eval_batches: 4}\ncheckpoint: {enabled: false}\n");
  ProcessResult result = RunProcess({LtrainBinary(), "launch", recipe}, Env("home"), seconds(600));
  ASSERT_EQ(result.exit_code, 0) << result.output;
  EXPECT_NE(result.output.find("loss mask"), std::string::npos) << result.output;
  std::vector<double> val;
  std::regex line(R"(val_loss ([0-9.]+))");
  for (std::sregex_iterator it(result.output.begin(), result.output.end(), line), end; it != end; ++it) {
    val.push_back(std::stod((*it)[1]));
  }
  ASSERT_GE(val.size(), 3u) << result.output;
  EXPECT_LT(val.back(), val.front()) << result.output;
  // From the first step's loss (the responses' tokens only, about ln 256 = 5.5 untrained).
  std::smatch first;
  ASSERT_TRUE(std::regex_search(result.output, first, std::regex(R"(step 1/150 loss ([0-9.]+))"))) << result.output;
  EXPECT_GT(std::stod(first[1]), 4.0) << result.output;
  EXPECT_LT(val.back(), 0.3 * std::stod(first[1])) << result.output;
}

}  // namespace
}  // namespace ltrain::testing
