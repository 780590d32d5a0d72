#include "common/data/loader.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <filesystem>
#include <set>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "common/data/manifest.h"
#include "common/files.h"

namespace ltrain {
namespace {

namespace fs = std::filesystem;

class LoaderTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("ltrain_loader_test_" + std::to_string(::getpid()) + "_" +
                                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  // A dataset directory of one train.bin holding `tokens` (data written before shards).
  std::string Dataset(const std::string& name, const std::vector<uint16_t>& tokens) {
    const fs::path dir = dir_ / name;
    fs::create_directories(dir);
    EXPECT_TRUE(WriteTokenFile((dir / "train.bin").string(), tokens, 256).ok());
    return dir.string();
  }

  static std::vector<uint16_t> Counting(size_t n, int mod = 251) {
    std::vector<uint16_t> tokens(n);
    for (size_t i = 0; i < n; ++i) tokens[i] = static_cast<uint16_t>(i % mod);
    return tokens;
  }

  fs::path dir_;
};

// Sample indices of one optimizer step for a layout, in the order each rank would see them.
std::vector<int64_t> StepIndices(int64_t position0, int64_t step, int global_batch, int dp, int micro_batch) {
  const int accumulation = global_batch / (dp * micro_batch);
  std::vector<int64_t> out;
  for (int r = 0; r < dp; ++r) {
    for (int a = 0; a < accumulation; ++a) {
      BatchSlice s{position0, step, global_batch, r, dp, a, micro_batch};
      for (int j = 0; j < micro_batch; ++j) out.push_back(SampleIndex(s, j));
    }
  }
  return out;
}

TEST(SampleIndexTest, RanksAreDisjointAndLayoutsCoverTheSameSamples) {
  for (int64_t step : {0, 1, 7}) {
    std::vector<int64_t> dp2 = StepIndices(100, step, 16, 2, 8);        // 2 ranks x 1 micro-step
    std::vector<int64_t> accum2 = StepIndices(100, step, 16, 1, 8);     // 1 rank x 2 micro-steps
    std::vector<int64_t> dp4 = StepIndices(100, step, 16, 4, 2);        // 4 ranks x 2 micro-steps
    std::set<int64_t> a(dp2.begin(), dp2.end()), b(accum2.begin(), accum2.end()), c(dp4.begin(), dp4.end());
    EXPECT_EQ(a.size(), dp2.size()) << "duplicate sample across ranks";
    EXPECT_EQ(c.size(), dp4.size());
    EXPECT_EQ(a, b);
    EXPECT_EQ(a, c);
    EXPECT_EQ(*a.begin(), 100 + step * 16);
    EXPECT_EQ(*a.rbegin(), 100 + step * 16 + 15);
    // Rank r's micro-batch a of dp2 is exactly micro-step r of accum2.
    EXPECT_EQ(std::vector<int64_t>(dp2.begin() + 8, dp2.end()), std::vector<int64_t>(accum2.begin() + 8, accum2.end()));
  }
}

TEST(IndexPermutationTest, PermutesEveryRangeAndTheKeyChangesTheOrder) {
  for (uint64_t n : {1u, 2u, 3u, 17u, 1000u, 4097u}) {
    IndexPermutation p(n, 7);
    std::vector<uint64_t> seen;
    for (uint64_t i = 0; i < n; ++i) seen.push_back(p(i));
    std::sort(seen.begin(), seen.end());
    for (uint64_t i = 0; i < n; ++i) ASSERT_EQ(seen[i], i) << "n " << n;
  }
  IndexPermutation a(1000, 1), b(1000, 2);
  int same = 0, fixed = 0;
  for (uint64_t i = 0; i < 1000; ++i) {
    same += a(i) == b(i);
    fixed += a(i) == i;
  }
  EXPECT_LT(same, 20);
  EXPECT_LT(fixed, 20);
}

TEST_F(LoaderTest, FillsShiftedWindowsDeterministicallyInEverySampling) {
  const std::vector<uint16_t> tokens = Counting(1000);
  const std::string data = Dataset("d", tokens);
  for (Sampling sampling : {Sampling::kEpochs, Sampling::kHash}) {
    StatusOr<std::unique_ptr<DataLoader>> loader = DataLoader::Open({{data, 1}}, "train", 16, sampling, 42);
    ASSERT_TRUE(loader.ok()) << loader.status().ToString();
    std::vector<int64_t> in(4 * 16), tg(4 * 16);
    BatchSlice slice{0, 3, 8, 1, 2, 0, 4};
    (*loader)->Fill(slice, in.data(), tg.data());
    std::set<int64_t> starts;
    for (int j = 0; j < 4; ++j) {
      const int64_t start = (*loader)->Locate(SampleIndex(slice, j)).start;
      EXPECT_GE(start, 0);
      EXPECT_LE(start + 16, 999);
      if (sampling == Sampling::kEpochs) {
        EXPECT_EQ(start % 16, 0);
      }
      starts.insert(start);
      for (int t = 0; t < 16; ++t) {
        EXPECT_EQ(in[j * 16 + t], tokens[start + t]);
        EXPECT_EQ(tg[j * 16 + t], tokens[start + t + 1]);
      }
    }
    EXPECT_GT(starts.size(), 1u);
    // Same seed, same windows; another seed, other windows.
    auto same = DataLoader::Open({{data, 1}}, "train", 16, sampling, 42);
    auto other = DataLoader::Open({{data, 1}}, "train", 16, sampling, 43);
    ASSERT_TRUE(same.ok() && other.ok());
    EXPECT_EQ((*same)->Locate(12345).start, (*loader)->Locate(12345).start);
    int differ = 0;
    for (int i = 0; i < 16; ++i) differ += (*other)->Locate(i).start != (*loader)->Locate(i).start;
    EXPECT_GT(differ, 8);
  }
  StatusOr<std::unique_ptr<DataLoader>> too_long = DataLoader::Open({{data, 1}}, "train", 999, Sampling::kEpochs, 42);
  ASSERT_FALSE(too_long.ok());
  EXPECT_NE(too_long.status().message().find("seq_len"), std::string::npos) << too_long.status().message();
}

TEST_F(LoaderTest, AnEpochDrawsEveryWindowOnceAndTheNextOneInAnotherOrder) {
  // 1,001 tokens: 100 windows of 10 (each with the token after it).
  const std::string data = Dataset("d", Counting(1001));
  StatusOr<std::unique_ptr<DataLoader>> loader = DataLoader::Open({{data, 1}}, "train", 10, Sampling::kEpochs, 5);
  ASSERT_TRUE(loader.ok()) << loader.status().ToString();
  ASSERT_EQ((*loader)->windows(0), 100);
  std::vector<int64_t> first, second;
  for (int64_t i = 0; i < 100; ++i) {
    EXPECT_EQ((*loader)->Locate(i).epoch, 0);
    EXPECT_EQ((*loader)->Locate(100 + i).epoch, 1);
    first.push_back((*loader)->Locate(i).start);
    second.push_back((*loader)->Locate(100 + i).start);
  }
  std::set<int64_t> distinct(first.begin(), first.end());
  EXPECT_EQ(distinct.size(), 100u) << "a window drawn twice in one epoch";
  EXPECT_EQ(*distinct.begin(), 0);
  EXPECT_EQ(*distinct.rbegin(), 990);
  EXPECT_EQ(std::set<int64_t>(second.begin(), second.end()), distinct);
  EXPECT_NE(first, second);
}

TEST_F(LoaderTest, AMixtureDrawsEachSourcesShareOfTokensOverAThousandSteps) {
  const std::string a = Dataset("a", Counting(20000)), b = Dataset("b", Counting(7000)), c = Dataset("c", Counting(900));
  constexpr int kSeq = 16, kGlobal = 8, kSteps = 1000;
  for (const std::vector<DataSource>& sources :
       {std::vector<DataSource>{{a, 0.7}, {b, 0.3}}, std::vector<DataSource>{{a, 5}, {b, 3}, {c, 2}}}) {
    StatusOr<std::unique_ptr<DataLoader>> loader = DataLoader::Open(sources, "train", kSeq, Sampling::kEpochs, 11);
    ASSERT_TRUE(loader.ok()) << loader.status().ToString();
    std::vector<int64_t> tokens(sources.size());
    std::vector<std::set<int64_t>> epoch0(sources.size());
    for (int64_t i = 0; i < int64_t{kSteps} * kGlobal; ++i) {
      const WindowRef ref = (*loader)->Locate(i);
      tokens[ref.source] += kSeq;
      // No window twice within one epoch of its source (the small source c goes through several).
      if (ref.epoch == 0) {
        EXPECT_TRUE(epoch0[ref.source].insert(ref.start).second) << "source " << ref.source;
      }
    }
    double total = 0, weights = 0;
    for (size_t s = 0; s < sources.size(); ++s) {
      total += static_cast<double>(tokens[s]);
      weights += sources[s].weight;
    }
    for (size_t s = 0; s < sources.size(); ++s) {
      const double share = static_cast<double>(tokens[s]) / total, want = sources[s].weight / weights;
      EXPECT_NEAR(share, want, 0.01) << "source " << s;
    }
    // No source lines up with a rank: with dp 2 and micro_batch 1, each rank sees both.
    int even_a = 0;
    for (int64_t i = 0; i < 2000; i += 2) even_a += (*loader)->Locate(i).source == 0;
    EXPECT_NEAR(even_a, 1000 * sources[0].weight / weights, 100);
  }
}

TEST_F(LoaderTest, ResumingAtAnotherDataParallelSizeReadsTheSameWindows) {
  const std::string a = Dataset("a", Counting(5000)), b = Dataset("b", Counting(3000));
  StatusOr<std::unique_ptr<DataLoader>> loader =
      DataLoader::Open({{a, 0.6}, {b, 0.4}}, "train", 8, Sampling::kEpochs, 3);
  ASSERT_TRUE(loader.ok());
  // Steps 0-9 at dp 4 (micro_batch 2), then steps from data position 80 at dp 2 (micro_batch 4):
  // the windows of every step are those of one rank that ran them all.
  auto step_windows = [&](int64_t position0, int64_t step, int dp, int micro_batch) {
    std::multiset<std::vector<int64_t>> out;
    for (int r = 0; r < dp; ++r) {
      for (int acc = 0; acc < 8 / (dp * micro_batch); ++acc) {
        std::vector<int64_t> in(static_cast<size_t>(micro_batch) * 8), tg(in.size());
        (*loader)->Fill(BatchSlice{position0, step, 8, r, dp, acc, micro_batch}, in.data(), tg.data());
        for (int j = 0; j < micro_batch; ++j) out.insert(std::vector<int64_t>(in.begin() + j * 8, in.begin() + j * 8 + 8));
      }
    }
    return out;
  };
  for (int64_t step = 0; step < 20; ++step) {
    auto one = step_windows(0, step, 1, 8);
    auto before = step < 10 ? step_windows(0, step, 4, 2) : step_windows(80, step - 10, 2, 4);
    EXPECT_EQ(one, before) << "step " << step;
  }
}

TEST_F(LoaderTest, TargetsOutsideTheLossMaskAreIgnored) {
  // A dataset of format 2 with one shard and its mask: odd tokens count, even ones do not.
  const fs::path dir = dir_ / "sft";
  fs::create_directories(dir);
  const std::vector<uint16_t> tokens = Counting(200);
  ASSERT_TRUE(WriteTokenFile((dir / "train-00000.bin").string(), tokens, 256).ok());
  std::string mask = MaskFileHeader(tokens.size());
  for (size_t i = 0; i < tokens.size(); ++i) mask += static_cast<char>(i % 2);
  ASSERT_TRUE(WriteFileAtomically((dir / "train-00000.mask").string(), mask).ok());
  DataInfo info;
  info.format = 2;
  info.sft = true;
  info.train_tokens = 200;
  ShardInfo shard;
  shard.file = "train-00000.bin";
  shard.split = "train";
  shard.tokens = 200;
  shard.mask = "train-00000.mask";
  info.shards.push_back(shard);
  ASSERT_TRUE(WriteDataInfo(dir.string(), info).ok());
  StatusOr<std::unique_ptr<DataLoader>> loader =
      DataLoader::Open({{dir.string(), 1}}, "train", 16, Sampling::kEpochs, 1);
  ASSERT_TRUE(loader.ok()) << loader.status().ToString();
  EXPECT_TRUE((*loader)->masked());
  std::vector<int64_t> in(16), tg(16);
  (*loader)->Fill(BatchSlice{}, in.data(), tg.data());
  const int64_t start = (*loader)->Locate(0).start;
  for (int t = 0; t < 16; ++t) {
    EXPECT_EQ(in[t], tokens[start + t]);
    EXPECT_EQ(tg[t], (start + t + 1) % 2 == 1 ? tokens[start + t + 1] : kIgnoredTarget) << t;
  }
  // A mask shorter than its shard is refused.
  ASSERT_TRUE(WriteFileAtomically((dir / "train-00000.mask").string(), mask.substr(0, mask.size() - 1)).ok());
  StatusOr<std::unique_ptr<DataLoader>> damaged =
      DataLoader::Open({{dir.string(), 1}}, "train", 16, Sampling::kEpochs, 1);
  ASSERT_FALSE(damaged.ok());
  EXPECT_NE(damaged.status().message().find("train-00000.mask"), std::string::npos) << damaged.status().message();
}

TEST(BatchPrefetcherTest, GivesEachPositionsBatchesInAnyOrder) {
  std::atomic<int> made{0};
  BatchPrefetcher prefetcher(
      [&](int64_t position, BatchPrefetcher::Batches* out) {
        ++made;
        out->inputs.assign(4, position);
        out->targets.assign(4, position + 1);
      },
      8);
  for (int64_t position : {0, 8, 16, 24, 8, 40, 40, 48}) {
    const BatchPrefetcher::Batches& got = prefetcher.Get(position);
    EXPECT_EQ(got.inputs, std::vector<int64_t>(4, position));
    EXPECT_EQ(got.targets, std::vector<int64_t>(4, position + 1));
  }
  EXPECT_GE(made.load(), 6);
}

}  // namespace
}  // namespace ltrain
