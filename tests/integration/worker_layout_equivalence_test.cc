// Runs the real ltrain-worker binary: one rank accumulating 2 micro-batches must report the same
// per-step losses as 2 ranks (Gloo over loopback) with one micro-batch each.
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "tests/support/synthetic_tokens.h"

#include "tests/support/worker_log.h"

namespace ltrain {
namespace {

namespace fs = std::filesystem;

std::vector<double> Losses(const fs::path& log) { return ltrain::testing::WorkerLogLosses(log); }

TEST(WorkerLayoutEquivalenceTest, TwoRanksMatchOneRankAccumulatingTwo) {
  const char* bin_dir = std::getenv("LTRAIN_BIN_DIR");
  const std::string worker = bin_dir != nullptr ? std::string(bin_dir) + "/ltrain-worker" : LTRAIN_WORKER_BIN;
  ASSERT_TRUE(fs::exists(worker)) << worker;
  const fs::path dir = fs::temp_directory_path() / ("ltrain_equiv_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir / "data");
  ASSERT_TRUE(ltrain::testing::WriteSyntheticTokens((dir / "data" / "train.bin").string(), 20000, 1, 7, 5).ok());
  std::ofstream(dir / "r.yaml") << "name: equiv\n"
                                   "model: {layers: 1, d_model: 32, heads: 2, seq_len: 32, vocab: 256}\n"
                                   "data: {path: " << (dir / "data").string() << "}\n"
                                   "training: {steps: 8, micro_batch: 4, global_batch: 8, lr: 3.0e-3, "
                                   "min_lr: 3.0e-4, warmup_steps: 2, log_every: 1}\n"
                                   "parallel: {nodes: 1, nproc_per_node: 1}\n";
  // LTRAIN_LOCAL_WORLD_SIZE pins both layouts to the same thread count per rank, so the sums
  // inside each kernel happen in the same order.
  const std::string common = "LTRAIN_LOCAL_WORLD_SIZE=64 " + worker + " --recipe " + (dir / "r.yaml").string();
  const std::string one = common + " --set checkpoint.dir=" + (dir / "ck1").string() + " > " +
                          (dir / "one.log").string() + " 2>&1";
  ASSERT_EQ(std::system(one.c_str()), 0) << std::ifstream(dir / "one.log").rdbuf();
  std::string two;
  for (int r = 0; r < 2; ++r) {
    two += "LTRAIN_WORLD_SIZE=2 LTRAIN_RANK=" + std::to_string(r) + " LTRAIN_RDZV=file://" +
           (dir / "rdzv").string() + " LTRAIN_RDZV_SCOPE=t " + common +
           " --set parallel.nproc_per_node=2 --set checkpoint.dir=" + (dir / "ck2").string() + " > " +
           (dir / ("two" + std::to_string(r) + ".log")).string() + " 2>&1 " + (r == 0 ? "& " : "; wait $!");
  }
  ASSERT_EQ(std::system(("bash -c '" + two + "'").c_str()), 0) << std::ifstream(dir / "two0.log").rdbuf();

  std::vector<double> a = Losses(dir / "one.log"), b = Losses(dir / "two0.log");
  ASSERT_EQ(a.size(), 8u);
  ASSERT_EQ(b.size(), 8u);
  for (size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(a[i], b[i], 1e-6 * a[i]) << "step " << i + 1;
  EXPECT_LT(a.back(), a.front());
  fs::remove_all(dir);
}

}  // namespace
}  // namespace ltrain
