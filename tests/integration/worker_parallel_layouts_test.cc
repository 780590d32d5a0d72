// Numerics of every parallel layout against the one-process run: real ltrain-worker processes
// (Gloo over loopback, file:// rendezvous), 20 steps of a small GPT-2, of a small Llama (grouped-
// query attention with 2 key/value heads: split at tp 2, replicated at tp 4), and of the Qwen2 and
// Qwen3 blocks (a Mistral is a Llama where ltrain trains it), per-step losses within
// 1e-4 relative and final parameters (gathered by --export-params) within 1e-4 absolute. Also the
// ZeRO memory report at dp=4, resuming a sharded layout from its per-rank checkpoint files, and
// `ltrain plan`'s memory (common/layout_plan.h) against every rank's `memory rank` line of every run.
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include <gtest/gtest.h>

#include "common/layout.h"
#include "common/layout_plan.h"
#include "common/data/token_data.h"
#include "common/recipe.h"
#include "tests/support/synthetic_tokens.h"

#include "tests/support/worker_log.h"

namespace ltrain {
namespace {

namespace fs = std::filesystem;

std::string WorkerBin() {
  const char* bin_dir = std::getenv("LTRAIN_BIN_DIR");
  return bin_dir != nullptr ? std::string(bin_dir) + "/ltrain-worker" : LTRAIN_WORKER_BIN;
}

std::vector<double> Losses(const fs::path& log) { return ltrain::testing::WorkerLogLosses(log); }

std::map<std::string, std::vector<float>> Params(const fs::path& file) {
  std::map<std::string, std::vector<float>> out;
  std::ifstream in(file, std::ios::binary);
  uint32_t len = 0;
  while (in.read(reinterpret_cast<char*>(&len), sizeof(len))) {
    std::string name(len, '\0');
    in.read(name.data(), len);
    uint64_t n = 0;
    in.read(reinterpret_cast<char*>(&n), sizeof(n));
    std::vector<float> values(n);
    in.read(reinterpret_cast<char*>(values.data()), static_cast<std::streamsize>(n * sizeof(float)));
    out[name] = std::move(values);
  }
  return out;
}

// "memory rank R: params B bytes, grads B bytes, optimizer B bytes, activations_peak B bytes"
std::map<std::string, double> MemoryLine(const fs::path& log) {
  std::ifstream in(log);
  std::string line;
  std::map<std::string, double> out;
  while (std::getline(in, line)) {
    if (line.rfind("memory rank ", 0) != 0) continue;
    for (const char* key : {"params", "grads", "optimizer", "activations_peak"}) {
      size_t at = line.find(std::string(" ") + key + " ");
      if (at != std::string::npos) out[key] = std::stod(line.substr(at + std::strlen(key) + 2));
    }
  }
  return out;
}

class ParallelLayoutsTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    Prepare("layouts", "{layers: 4, d_model: 64, heads: 4, seq_len: 32, vocab: 256}", 4 * 12 + 4);
  }
  // The suite's directory, data and recipe for the model `model` of `params` parameter tensors.
  static void Prepare(const std::string& name, const std::string& model, size_t params) {
    dir_ = fs::temp_directory_path() / ("ltrain_" + name + "_" + std::to_string(::getpid()));
    params_ = params;
    fs::remove_all(dir_);
    fs::create_directories(dir_ / "data");
    ASSERT_TRUE(ltrain::testing::WriteSyntheticTokens((dir_ / "data" / "train.bin").string(), 20000, 7, 5, 11).ok());
    ASSERT_TRUE(ltrain::testing::WriteSyntheticTokens((dir_ / "data" / "val.bin").string(), 4000, 8, 5, 11).ok());
    std::ofstream(dir_ / "r.yaml") << "name: layouts\n"
                                      "model: " << model << "\n"
                                      "data: {path: " << (dir_ / "data").string() << "}\n"
                                      "training: {steps: 20, micro_batch: 2, global_batch: 8, lr: 3.0e-3, "
                                      "min_lr: 3.0e-4, warmup_steps: 4, log_every: 1, grad_clip: 0.5, "
                                      "eval_every: 10, eval_batches: 2}\n"
                                      "parallel: {nodes: 1, nproc_per_node: 1}\n";
  }
  static void TearDownTestSuite() { fs::remove_all(dir_); }

  // Runs `world` ranks with extra --set flags; returns the run's directory (logs log0.., params.bin).
  // `env`: NAME=VALUE words set for every rank.
  static fs::path Run(const std::string& name, int world, const std::string& sets, const std::string& env = "") {
    const fs::path run = dir_ / name;
    fs::remove_all(run);
    fs::create_directories(run);
    std::string cmd;
    for (int r = 0; r < world; ++r) {
      // OMP_NUM_THREADS=1: every layout sums inside each kernel in the same order.
      cmd += "OMP_NUM_THREADS=1 LTRAIN_COLLECTIVE_TIMEOUT_S=60 LTRAIN_WORLD_SIZE=" + std::to_string(world) +
             " LTRAIN_RANK=" + std::to_string(r) + " LTRAIN_RDZV=file://" + (run / "rdzv").string() +
             " LTRAIN_RDZV_SCOPE=t " + env + " " + WorkerBin() + " --recipe " + (dir_ / "r.yaml").string() +
             " --set parallel.nproc_per_node=" + std::to_string(world) + " --set checkpoint.dir=" +
             (run / "ck").string() + " --export-params " + (run / "params.bin").string() + " " + sets + " > " +
             (run / ("log" + std::to_string(r))).string() + " 2>&1 & ";
    }
    cmd += "for j in $(jobs -p); do wait $j || exit 1; done";
    const int rc = std::system(("bash -c '" + cmd + "'").c_str());
    EXPECT_EQ(rc, 0) << name << ": " << std::ifstream(run / "log0").rdbuf();
    // LTRAIN_TP_SPLIT_BATCH's halves make twice the calls, each with a cost that does not scale with
    // the batch (autograd's nodes on the heap, small tensors): on this tiny CPU model about a fifth
    // more than the plan's activations, which do not model it.
    if (rc == 0) ExpectPlanMatchesMemory(name, run, world, sets, /*activations=*/env.empty());
    return run;
  }

  // `ltrain plan`'s memory (common/layout_plan.h) against every rank's `memory rank` line: parameters,
  // gradients and optimizer state to the byte; with `activations`, activations (with buffers) and the
  // total within 10%.
  static void ExpectPlanMatchesMemory(const std::string& name, const fs::path& run, int world, const std::string& sets,
                                      bool activations) {
    std::vector<std::string> overrides = {"parallel.nproc_per_node=" + std::to_string(world)};
    std::istringstream words(sets);
    for (std::string word; words >> word;) {
      if (word != "--set") overrides.push_back(word);
    }
    RecipeParseResult parsed = LoadRecipeFile((dir_ / "r.yaml").string(), overrides);
    ASSERT_TRUE(parsed.ok()) << parsed.ErrorText();
    StatusOr<Layout> layout = PlanLayout(parsed.recipe, world);
    ASSERT_TRUE(layout.ok()) << layout.status().ToString();
    const LayoutEstimate plan = EstimateLayout(parsed.recipe, *layout);
    for (int rank = 0; rank < world; ++rank) {
      std::map<std::string, double> measured = MemoryLine(run / ("log" + std::to_string(rank)));
      ASSERT_EQ(measured.size(), 4u) << name << " rank " << rank << ": no memory line";
      const MemoryParts& p = plan.stages.at(rank / (layout->tp * layout->dp)).parts;
      EXPECT_EQ(static_cast<double>(p.params), measured["params"]) << name << " rank " << rank;
      EXPECT_EQ(static_cast<double>(p.grads), measured["grads"]) << name << " rank " << rank;
      EXPECT_EQ(static_cast<double>(p.optimizer), measured["optimizer"]) << name << " rank " << rank;
      if (!activations) continue;
      const double planned = static_cast<double>(p.activations + p.buffers);
      const double total = measured["params"] + measured["grads"] + measured["optimizer"] + measured["activations_peak"];
      EXPECT_NEAR(planned / measured["activations_peak"], 1.0, 0.10) << name << " rank " << rank;
      EXPECT_NEAR(static_cast<double>(p.total()) / total, 1.0, 0.10) << name << " rank " << rank;
      if (rank == 0) {
        std::printf("[plan %s] rank 0 activations planned %.0f measured %.0f (%+.1f%%), total %+.1f%%\n", name.c_str(),
                    planned, measured["activations_peak"], 100.0 * (planned / measured["activations_peak"] - 1),
                    100.0 * (static_cast<double>(p.total()) / total - 1));
      }
    }
  }

  // The one-process run with `sets` (made once for each).
  static fs::path Reference(const std::string& sets) {
    static std::map<std::string, fs::path> refs;
    const std::string key = dir_.string() + " " + sets;
    if (!refs.count(key)) refs[key] = Run("reference" + std::to_string(refs.size()), 1, sets);
    return refs[key];
  }

  // Losses and final parameters of `world` ranks with `sets` (and `env`) against the one-process
  // run with `reference_sets`. The run's logs stay in dir_ / name.
  void ExpectMatchesReference(const std::string& name, int world, const std::string& sets,
                              const std::string& reference_sets = "", const std::string& env = "") {
    const fs::path ref = Reference(reference_sets);
    const fs::path run = Run(name, world, sets, env);
    std::vector<double> a = Losses(ref / "log0"), b = Losses(run / "log0");
    ASSERT_EQ(a.size(), 20u);
    ASSERT_EQ(b.size(), 20u) << std::ifstream(run / "log0").rdbuf();
    double worst = 0;
    for (size_t i = 0; i < a.size(); ++i) {
      const double rel = std::abs(a[i] - b[i]) / std::abs(a[i]);
      worst = std::max(worst, rel);
      EXPECT_LE(rel, 1e-4) << name << " step " << i + 1 << ": " << a[i] << " vs " << b[i];
    }
    EXPECT_LT(a.back(), a.front() - 0.5);  // it trains
    // Validation after steps 10 and 20, on the same windows of val.bin.
    std::vector<double> va = ltrain::testing::WorkerLogValLosses(ref / "log0");
    std::vector<double> vb = ltrain::testing::WorkerLogValLosses(run / "log0");
    ASSERT_EQ(va.size(), 2u);
    ASSERT_EQ(vb.size(), 2u);
    for (size_t i = 0; i < va.size(); ++i) EXPECT_LE(std::abs(va[i] - vb[i]) / va[i], 1e-4) << name << " eval " << i;
    EXPECT_LT(va[1], va[0]);
    auto pa = Params(ref / "params.bin"), pb = Params(run / "params.bin");
    ASSERT_EQ(pa.size(), params_);
    ASSERT_EQ(pb.size(), pa.size());
    double max_abs = 0;
    for (const auto& [key, values] : pa) {
      ASSERT_EQ(pb[key].size(), values.size()) << key;
      for (size_t i = 0; i < values.size(); ++i) max_abs = std::max(max_abs, static_cast<double>(std::abs(values[i] - pb[key][i])));
    }
    EXPECT_LE(max_abs, 1e-4) << name;
    std::printf("[layout %s] max relative loss difference %.3g, max abs parameter difference %.3g\n", name.c_str(), worst,
                max_abs);
  }

  // Gradients made block by block in backward and released after each update (the default on GPUs),
  // on one data-parallel rank with `sets` (tp ranks as sets give), against the one-process run.
  void ExpectTransientGradientsMatch(const std::string& name, const std::string& sets) {
    const int tp = sets.find("parallel.tp=2") != std::string::npos ? 2 : 1;
    ExpectMatchesReference(name, tp, sets, "", "LTRAIN_TRANSIENT_GRADIENTS=1");
    std::stringstream log;
    log << std::ifstream(dir_ / name / "log0").rdbuf();
    EXPECT_NE(log.str().find("gradients: each block's made when backward reaches it"), std::string::npos) << log.str();
  }

  // Each of `runs` (name, world, sets) resumes from `first`'s checkpoint of step 10: its 10 steps
  // and its final parameters are the one-process run's, within the suite's tolerance.
  static void ExpectResumesAsTheReference(const fs::path& first,
                                          const std::vector<std::tuple<std::string, int, std::string>>& runs) {
    const fs::path ref = Reference("");
    const std::string from = "--set checkpoint.resume_from=" + (first / "ck" / "step-10").string();
    for (const auto& [name, world, sets] : runs) {
      const fs::path resumed = Run(name, world, sets + " " + from);
      std::vector<double> a = Losses(ref / "log0"), b = Losses(resumed / "log0");
      ASSERT_EQ(a.size(), 20u);
      ASSERT_EQ(b.size(), 10u) << std::ifstream(resumed / "log0").rdbuf();
      for (size_t i = 0; i < b.size(); ++i) EXPECT_NEAR(a[10 + i], b[i], 1e-4 * a[10 + i]) << name << " step " << i + 11;
      auto pa = Params(ref / "params.bin"), pb = Params(resumed / "params.bin");
      ASSERT_EQ(pa.size(), pb.size());
      for (const auto& [key, values] : pa) {
        ASSERT_EQ(values.size(), pb[key].size()) << key;
        for (size_t i = 0; i < values.size(); ++i) {
          ASSERT_NEAR(values[i], pb[key][i], 1e-4) << name << " " << key << " " << i;
        }
      }
    }
  }

  static fs::path dir_;
  static size_t params_;
};

fs::path ParallelLayoutsTest::dir_;
size_t ParallelLayoutsTest::params_ = 0;

// The same layouts with a Llama: 4 query heads, 2 key/value heads, untied head, 4 + 9*4 + 2
// parameter tensors.
class LlamaLayoutsTest : public ParallelLayoutsTest {
 protected:
  static void SetUpTestSuite() {
    Prepare("llama_layouts",
            "{arch: llama, layers: 4, d_model: 64, heads: 4, kv_heads: 2, ffn: 96, seq_len: 32, vocab: 256, "
            "rope_theta: 10000, tie_embeddings: false}",
            1 + 4 * 9 + 2);
  }
};

// Qwen2's block: the Llama's with biases on q, k and v (split with their weights, whole beside a key/
// value head kept whole at tp 4); tied head as the small Qwen2.5s. 1 + 4*12 + 1 parameter tensors.
class Qwen2LayoutsTest : public ParallelLayoutsTest {
 protected:
  static void SetUpTestSuite() {
    Prepare("qwen2_layouts",
            "{arch: qwen2, layers: 4, d_model: 64, heads: 4, kv_heads: 2, ffn: 96, seq_len: 32, vocab: 256, "
            "rope_theta: 10000, tie_embeddings: true}",
            1 + 4 * 12 + 1);
  }
};

// Qwen3's block: an RMSNorm over each head of q and of k (its gradient summed over tp), heads wider
// than d_model/heads as Qwen3's (head_dim 32 of d_model 64 and 4 heads). 1 + 4*11 + 2 tensors.
class Qwen3LayoutsTest : public ParallelLayoutsTest {
 protected:
  static void SetUpTestSuite() {
    Prepare("qwen3_layouts",
            "{arch: qwen3, layers: 4, d_model: 64, heads: 4, kv_heads: 2, head_dim: 32, ffn: 96, seq_len: 32, "
            "vocab: 256, rope_theta: 10000, tie_embeddings: false}",
            1 + 4 * 11 + 2);
  }
};

// A mixture of experts (Qwen3's block, model.moe): 4 experts, 2 a token, of width 48, in blocks 1-3
// (block 0 dense), balanced by the sequence-wise loss. 1 + 11 + 3*12 + 2 parameter tensors.
class MoeLayoutsTest : public ParallelLayoutsTest {
 protected:
  static void SetUpTestSuite() {
    Prepare("moe_layouts",
            "{arch: qwen3, layers: 4, d_model: 64, heads: 4, kv_heads: 2, head_dim: 32, ffn: 96, seq_len: 32, "
            "vocab: 256, rope_theta: 10000, tie_embeddings: false, "
            "moe: {experts: 4, top_k: 2, ffn: 48, first_dense: 1, z_loss_coef: 0.001}}",
            1 + 11 + 3 * 12 + 2);
  }
};

// The MoE layouts: data parallel and ZeRO, tensor parallel (each expert split as the MLP is, the
// router whole with its gradient summed over tp) with and without sequence parallelism, pipelines,
// full recomputation (whose recomputed blocks count their routes once), micro-batches of one sequence
// (Dp8Zero3, 4 accumulated), and the router bias (DeepSeek-V3's balance, from counts summed over the
// data-parallel ranks), against the one-process run with the same balance.
TEST_F(MoeLayoutsTest, Dp2) { ExpectMatchesReference("dp2", 2, ""); }
TEST_F(MoeLayoutsTest, Dp2Zero1) { ExpectMatchesReference("dp2_zero1", 2, "--set parallel.zero=1"); }
TEST_F(MoeLayoutsTest, Dp2Zero3) { ExpectMatchesReference("dp2_zero3", 2, "--set parallel.zero=3"); }
TEST_F(MoeLayoutsTest, Pp2OneFOneB) { ExpectMatchesReference("pp2_1f1b", 2, "--set parallel.pp=2"); }
TEST_F(MoeLayoutsTest, Pp2Interleaved) {
  ExpectMatchesReference("pp2_interleaved", 2,
                         "--set parallel.pp=2 --set parallel.pp_schedule=interleaved --set parallel.virtual_stages=2");
}
TEST_F(MoeLayoutsTest, Dp2Pp2Zero1) {
  ExpectMatchesReference("dp2_pp2_zero1", 4, "--set parallel.pp=2 --set parallel.zero=1");
}
TEST_F(MoeLayoutsTest, Dp8Zero3) {
  ExpectMatchesReference("dp8_zero3", 8, "--set parallel.zero=3 --set training.micro_batch=1");
}
TEST_F(MoeLayoutsTest, Tp2) { ExpectMatchesReference("tp2", 2, "--set parallel.tp=2"); }
TEST_F(MoeLayoutsTest, TransientGradients) { ExpectTransientGradientsMatch("transient", ""); }
TEST_F(MoeLayoutsTest, Tp2SequenceParallel) {
  ExpectMatchesReference("tp2_sp", 2, "--set parallel.tp=2 --set parallel.sequence_parallel=true");
}
TEST_F(MoeLayoutsTest, Dp2Tp2) { ExpectMatchesReference("dp2_tp2", 4, "--set parallel.tp=2"); }
TEST_F(MoeLayoutsTest, Tp2Pp2) { ExpectMatchesReference("tp2_pp2", 4, "--set parallel.tp=2 --set parallel.pp=2"); }
TEST_F(MoeLayoutsTest, Dp2Zero3FullCheckpointing) {
  ExpectMatchesReference("dp2_zero3_full", 2, "--set parallel.zero=3 --set parallel.activation_checkpointing=full");
}
TEST_F(MoeLayoutsTest, Dp2BiasBalance) {
  const std::string bias = "--set model.moe.balance=bias --set model.moe.bias_update=0.01";
  ExpectMatchesReference("dp2_bias", 2, bias, bias);
}

// Expert parallelism: each MoE block's 4 experts split over ep ranks of the data-parallel group,
// the tokens sent to their experts' ranks and back by all-to-all; the experts' gradients reduced over
// the dp/ep ranks holding the same experts. With data parallelism beside it (ep2 x dp2: 4 data-
// parallel ranks, 2 holding each expert), ZeRO over those, tensor parallelism (each expert also split
// as the MLP is), a pipeline, and the router bias from every rank's counts.
TEST_F(MoeLayoutsTest, Ep2) { ExpectMatchesReference("ep2", 2, "--set parallel.ep=2"); }
TEST_F(MoeLayoutsTest, Ep4) { ExpectMatchesReference("ep4", 4, "--set parallel.ep=4"); }
TEST_F(MoeLayoutsTest, Ep2Dp2) { ExpectMatchesReference("ep2_dp2", 4, "--set parallel.ep=2"); }
TEST_F(MoeLayoutsTest, Ep2Dp2Zero1) {
  ExpectMatchesReference("ep2_dp2_zero1", 4, "--set parallel.ep=2 --set parallel.zero=1");
}
TEST_F(MoeLayoutsTest, Ep2Dp2Zero3) {
  ExpectMatchesReference("ep2_dp2_zero3", 4, "--set parallel.ep=2 --set parallel.zero=3");
}
TEST_F(MoeLayoutsTest, Ep2Tp2) {
  ExpectMatchesReference("ep2_tp2", 4, "--set parallel.ep=2 --set parallel.tp=2 --set parallel.sequence_parallel=true");
}
TEST_F(MoeLayoutsTest, Ep2Pp2) { ExpectMatchesReference("ep2_pp2", 4, "--set parallel.ep=2 --set parallel.pp=2"); }
TEST_F(MoeLayoutsTest, Ep2FullCheckpointingBiasBalance) {
  const std::string bias = "--set model.moe.balance=bias --set model.moe.bias_update=0.01";
  ExpectMatchesReference("ep2_full_bias", 2, "--set parallel.ep=2 --set parallel.activation_checkpointing=full " + bias,
                         bias);
}

// With a capacity (model.moe.capacity_factor 1: each expert takes at most its even share of a micro-
// batch's assignments on a rank), some are dropped, and the layout drops the same ones as one process.
TEST_F(MoeLayoutsTest, Ep2Dp2WithACapacityDropsAsOneProcess) {
  const std::string capacity = "--set model.moe.capacity_factor=1.0";
  ExpectMatchesReference("ep2_dp2_capacity", 4, "--set parallel.ep=2 " + capacity, capacity);
  std::ifstream in(dir_ / "ep2_dp2_capacity" / "log0");
  double most = 0;
  int steps = 0;
  for (std::string line; std::getline(in, line);) {
    const size_t at = line.find(" moe_dropped ");
    if (line.rfind("step ", 0) != 0 || at == std::string::npos) continue;
    ++steps;
    most = std::max(most, std::stod(line.substr(at + 13)));
  }
  EXPECT_EQ(steps, 20);
  EXPECT_GT(most, 0.0) << "no assignment was dropped at capacity factor 1";
  // At most half: every token's two choices on the same two of the four experts, each taking half.
  EXPECT_LE(most, 0.5);
}

// A checkpoint does not depend on ep: saved at ep2 x dp2 under ZeRO-1 (each rank its shard of its
// experts), it resumes in one process, and at ep 4; both end as the one-process run does.
TEST_F(MoeLayoutsTest, ACheckpointAtEp2ResumesInOneProcessAndAtEp4) {
  const fs::path first = Run("ep2_first", 4, "--set parallel.ep=2 --set parallel.zero=1 --set checkpoint.every=10 "
                                             "--set checkpoint.keep=5");
  ExpectResumesAsTheReference(first, {{"ep1_second", 1, ""}, {"ep4_second", 4, "--set parallel.ep=4"}});
}

// The router biases (balance: bias) go into the checkpoint and come back exact: 10 steps, then 10
// more from the checkpoint of step 10, under a pipeline (each stage's blocks' biases), equal the 20
// uninterrupted steps bit for bit.
TEST_F(MoeLayoutsTest, RouterBiasesResumeFromACheckpoint) {
  const std::string layout = "--set parallel.pp=2 --set model.moe.balance=bias --set model.moe.bias_update=0.01 ";
  const fs::path full = Run("bias_full", 2, layout);
  const fs::path first = Run("bias_first", 2, layout + "--set checkpoint.every=10 --set checkpoint.keep=5");
  const fs::path step10 = first / "ck" / "step-10";
  std::ifstream meta(step10 / "meta.yaml");
  const std::string text((std::istreambuf_iterator<char>(meta)), std::istreambuf_iterator<char>());
  EXPECT_NE(text.find("router_bias"), std::string::npos) << text;
  const fs::path resumed = Run("bias_second", 2, layout + "--set checkpoint.resume_from=" + step10.string());
  std::vector<double> a = Losses(full / "log0"), b = Losses(resumed / "log0");
  ASSERT_EQ(b.size(), 10u) << std::ifstream(resumed / "log0").rdbuf();
  for (size_t i = 0; i < b.size(); ++i) EXPECT_EQ(a[10 + i], b[i]) << "step " << i + 11;
  auto pa = Params(full / "params.bin"), pb = Params(resumed / "params.bin");
  ASSERT_EQ(pa.size(), pb.size());
  for (const auto& [key, values] : pa) EXPECT_EQ(values, pb[key]) << key;
}

// A checkpoint of the experts split over tp 2 resumes in one process (the slices put together): the
// last 10 steps as the one-process run's, within the suite's tolerance.
TEST_F(MoeLayoutsTest, ACheckpointAtTp2ResumesInOneProcess) {
  const fs::path first = Run("tp2_first", 2, "--set parallel.tp=2 --set checkpoint.every=10 --set checkpoint.keep=5");
  ExpectResumesAsTheReference(first, {{"tp1_second", 1, ""}});
}

// The balance, on English (the GPL's text as bytes; the suite's synthetic letters carry too little for
// a router to tell tokens apart): this small model's router soon sends every token to the same two
// experts (the busiest expert's load at 2, as many assignments as tokens, against an even 1). Without
// a balance it stays there; the balance loss and the router bias each pull it back.
TEST_F(MoeLayoutsTest, ACollapsedRouterIsPulledBackByTheLossAndByTheBias) {
  std::ifstream text("/usr/share/common-licenses/GPL-3", std::ios::binary);
  ASSERT_TRUE(text) << "/usr/share/common-licenses/GPL-3 (package base-files) is needed";
  const std::string bytes((std::istreambuf_iterator<char>(text)), std::istreambuf_iterator<char>());
  const std::vector<uint16_t> tokens(bytes.begin(), bytes.end());
  const size_t split = tokens.size() * 9 / 10;
  fs::create_directories(dir_ / "english");
  ASSERT_TRUE(WriteTokenFile((dir_ / "english" / "train.bin").string(),
                             std::vector<uint16_t>(tokens.begin(), tokens.begin() + split), 256).ok());
  ASSERT_TRUE(WriteTokenFile((dir_ / "english" / "val.bin").string(),
                             std::vector<uint16_t>(tokens.begin() + split, tokens.end()), 256).ok());
  auto late_load = [](const fs::path& run) {
    std::ifstream in(run / "log0");
    std::vector<double> loads;
    for (std::string line; std::getline(in, line);) {
      const size_t at = line.find(" moe_load_max ");
      if (line.rfind("step ", 0) == 0 && at != std::string::npos) loads.push_back(std::stod(line.substr(at + 14)));
    }
    EXPECT_EQ(loads.size(), 60u) << run;
    double sum = 0;
    for (size_t i = loads.size() >= 10 ? loads.size() - 10 : 0; i < loads.size(); ++i) sum += loads[i];
    return loads.size() >= 10 ? sum / 10 : 0.0;
  };
  const std::string steps =
      " --set training.steps=60 --set training.eval_every=0 --set data.path=" + (dir_ / "english").string();
  const double none = late_load(Run("balance_none", 1, "--set model.moe.balance=none" + steps));
  const double loss = late_load(Run("balance_loss", 1, "--set model.moe.aux_loss_coef=0.05" + steps));
  const double bias = late_load(Run("balance_bias", 1, "--set model.moe.balance=bias --set model.moe.bias_update=0.01" + steps));
  std::printf("[balance] busiest expert's load over the last 10 steps: none %.3f, loss %.3f, bias %.3f\n", none, loss,
              bias);
  EXPECT_GT(none, 1.9);
  EXPECT_LT(loss, none - 0.3);
  EXPECT_LT(bias, none - 0.3);
}

// Every layout against the suite's one-process run; at 8 ranks the layouts of an 8-GPU node:
// tensor x interleaved pipeline x data, tensor x data, and ZeRO-3 over all 8.
#define LTRAIN_LAYOUT_TESTS(Suite) \
  TEST_F(Suite, Dp2) { ExpectMatchesReference("dp2", 2, ""); } \
  TEST_F(Suite, Dp2Zero1) { ExpectMatchesReference("dp2_zero1", 2, "--set parallel.zero=1"); } \
  TEST_F(Suite, Dp2Zero2) { ExpectMatchesReference("dp2_zero2", 2, "--set parallel.zero=2"); } \
  TEST_F(Suite, Dp2Zero3) { ExpectMatchesReference("dp2_zero3", 2, "--set parallel.zero=3"); } \
  TEST_F(Suite, Tp2) { ExpectMatchesReference("tp2", 2, "--set parallel.tp=2"); } \
  TEST_F(Suite, TransientGradients) { ExpectTransientGradientsMatch("transient", ""); } \
  TEST_F(Suite, Tp2SplitBatch) { \
    ExpectMatchesReference("tp2_split_batch", 2, "--set parallel.tp=2", "", "LTRAIN_TP_SPLIT_BATCH=1"); \
    std::stringstream log; \
    log << std::ifstream(dir_ / "tp2_split_batch" / "log0").rdbuf(); \
    EXPECT_NE(log.str().find("tp: each micro-batch goes through the blocks in two halves"), std::string::npos) << log.str(); \
  } \
  TEST_F(Suite, Tp2SequenceParallel) { \
    ExpectMatchesReference("tp2_sp", 2, "--set parallel.tp=2 --set parallel.sequence_parallel=true"); \
  } \
  TEST_F(Suite, Pp2Gpipe) { ExpectMatchesReference("pp2_gpipe", 2, "--set parallel.pp=2 --set parallel.pp_schedule=gpipe"); } \
  TEST_F(Suite, Pp2OneFOneB) { ExpectMatchesReference("pp2_1f1b", 2, "--set parallel.pp=2 --set parallel.pp_schedule=1f1b"); } \
  TEST_F(Suite, Pp2Interleaved) { \
    ExpectMatchesReference("pp2_interleaved", 2, \
                           "--set parallel.pp=2 --set parallel.pp_schedule=interleaved --set parallel.virtual_stages=2"); \
  } \
  TEST_F(Suite, Pp4OneFOneB) { ExpectMatchesReference("pp4_1f1b", 4, "--set parallel.pp=4"); } \
  TEST_F(Suite, Dp2Tp2) { ExpectMatchesReference("dp2_tp2", 4, "--set parallel.tp=2"); } \
  TEST_F(Suite, Tp2Pp2) { ExpectMatchesReference("tp2_pp2", 4, "--set parallel.tp=2 --set parallel.pp=2"); } \
  TEST_F(Suite, Dp2Pp2Zero1) { ExpectMatchesReference("dp2_pp2_zero1", 4, "--set parallel.pp=2 --set parallel.zero=1"); } \
  TEST_F(Suite, Tp2Pp2Dp2Interleaved) { \
    ExpectMatchesReference("tp2_pp2_dp2_interleaved", 8, \
                           "--set parallel.tp=2 --set parallel.pp=2 --set parallel.pp_schedule=interleaved " \
                           "--set parallel.virtual_stages=2"); \
  } \
  TEST_F(Suite, Tp4Dp2) { ExpectMatchesReference("tp4_dp2", 8, "--set parallel.tp=4"); } \
  TEST_F(Suite, Dp8Zero3) { \
    ExpectMatchesReference("dp8_zero3", 8, "--set parallel.zero=3 --set training.micro_batch=1"); \
  } \
  TEST_F(Suite, Dp2Zero3FullCheckpointing) { \
    ExpectMatchesReference("dp2_zero3_ac_full", 2, "--set parallel.zero=3 --set parallel.activation_checkpointing=full"); \
  } \
  TEST_F(Suite, Tp2SequenceParallelSelectiveCheckpointing) { \
    ExpectMatchesReference("tp2_sp_ac_selective", 2, \
                           "--set parallel.tp=2 --set parallel.sequence_parallel=true --set parallel.activation_checkpointing=selective"); \
  } \
  TEST_F(Suite, Pp2InterleavedFullCheckpointing) { \
    ExpectMatchesReference("pp2_interleaved_ac_full", 2, \
                           "--set parallel.pp=2 --set parallel.pp_schedule=interleaved --set parallel.virtual_stages=2 " \
                           "--set parallel.activation_checkpointing=full"); \
  }

// Context parallelism: each sequence split over cp ranks (two chunks each), attention over the ring;
// beside data parallelism (cp2 x dp2: 4 data-parallel ranks reading 2 batches), ZeRO-3, tensor
// parallelism with sequence parallelism, and a pipeline.
#define LTRAIN_CONTEXT_PARALLEL_TESTS(Suite) \
  TEST_F(Suite, Cp2) { ExpectMatchesReference("cp2", 2, "--set parallel.cp=2"); } \
  TEST_F(Suite, Cp4) { ExpectMatchesReference("cp4", 4, "--set parallel.cp=4"); } \
  TEST_F(Suite, Cp2FullRecompute) { \
    ExpectMatchesReference("cp2_ac_full", 2, "--set parallel.cp=2 --set parallel.activation_checkpointing=full"); \
  } \
  TEST_F(Suite, Cp2Dp2Zero3) { ExpectMatchesReference("cp2_dp2_zero3", 4, "--set parallel.cp=2 --set parallel.zero=3"); } \
  TEST_F(Suite, Cp2Tp2SequenceParallel) { \
    ExpectMatchesReference("cp2_tp2_sp", 4, "--set parallel.cp=2 --set parallel.tp=2 --set parallel.sequence_parallel=true"); \
  } \
  TEST_F(Suite, Cp2Pp2) { ExpectMatchesReference("cp2_pp2", 4, "--set parallel.cp=2 --set parallel.pp=2"); }

LTRAIN_CONTEXT_PARALLEL_TESTS(ParallelLayoutsTest)
LTRAIN_CONTEXT_PARALLEL_TESTS(LlamaLayoutsTest)

// A checkpoint does not depend on cp: saved at cp2 x dp2 under ZeRO-1, it resumes in one process and
// at cp4; both end as the one-process run does.
TEST_F(LlamaLayoutsTest, ACheckpointAtCp2ResumesInOneProcessAndAtCp4) {
  const fs::path first = Run("cp2_first", 4, "--set parallel.cp=2 --set parallel.zero=1 --set checkpoint.every=10 "
                                             "--set checkpoint.keep=5");
  ExpectResumesAsTheReference(first, {{"cp1_second", 1, ""}, {"cp4_second", 4, "--set parallel.cp=4"}});
}

LTRAIN_LAYOUT_TESTS(ParallelLayoutsTest)
// Transient gradients over accumulated micro-batches, and with partial gradients summed over tp.
TEST_F(ParallelLayoutsTest, TransientGradientsAccumulated) {
  ExpectTransientGradientsMatch("transient_accumulated", "--set training.micro_batch=1");
}
TEST_F(LlamaLayoutsTest, TransientGradientsTp2SequenceParallelFullCheckpointing) {
  ExpectTransientGradientsMatch("transient_tp2_sp_ac_full", "--set parallel.tp=2 --set parallel.sequence_parallel=true "
                                                            "--set parallel.activation_checkpointing=full");
}
LTRAIN_LAYOUT_TESTS(LlamaLayoutsTest)
LTRAIN_LAYOUT_TESTS(Qwen2LayoutsTest)
LTRAIN_LAYOUT_TESTS(Qwen3LayoutsTest)

TEST_F(ParallelLayoutsTest, Tp2Pp2WithPerParameterInit) {
  const std::string init = "--set model.init=per_parameter";
  ExpectMatchesReference("tp2_pp2_per_parameter", 4, "--set parallel.tp=2 --set parallel.pp=2 " + init, init);
  // Not PyTorch's initial parameters: the first losses differ from the default run's.
  EXPECT_NE(Losses(Reference("") / "log0").front(), Losses(Reference(init) / "log0").front());
}


// A Llama with fewer key/value heads than tp keeps them whole on every rank; with sequence
// parallelism too.
// The halves of LTRAIN_TP_SPLIT_BATCH through pipeline stages: activations in from the stage before,
// out to the stage after.
TEST_F(ParallelLayoutsTest, Tp2Pp2SplitBatch) {
  ExpectMatchesReference("tp2_pp2_split_batch", 4, "--set parallel.tp=2 --set parallel.pp=2", "", "LTRAIN_TP_SPLIT_BATCH=1");
}

TEST_F(LlamaLayoutsTest, Tp4SequenceParallelReplicatesKeyValueHeads) {
  ExpectMatchesReference("tp4_sp", 4, "--set parallel.tp=4 --set parallel.sequence_parallel=true");
}

// At dp=4, ZeRO stage s divides by 4 what the stages predict: 1 optimizer state, 2 also
// gradients, 3 also parameters (padding to a multiple of 4 elements stays far inside 5%).
TEST_F(ParallelLayoutsTest, ZeroStagesShrinkPerRankMemoryAtDp4) {
  std::vector<std::map<std::string, double>> mem;
  for (int zero = 0; zero <= 3; ++zero) {
    const fs::path run = Run("memory_zero" + std::to_string(zero), 4,
                             "--set training.steps=1 --set parallel.zero=" + std::to_string(zero));
    for (int r = 0; r < 4; ++r) {
      std::map<std::string, double> m = MemoryLine(run / ("log" + std::to_string(r)));
      ASSERT_EQ(m.size(), 4u) << std::ifstream(run / ("log" + std::to_string(r))).rdbuf();
      if (r == 0) mem.push_back(m);
    }
  }
  auto near = [](double value, double expected) { return std::abs(value - expected) <= 0.05 * expected; };
  const auto& z0 = mem[0];
  EXPECT_TRUE(near(mem[1]["optimizer"], z0.at("optimizer") / 4)) << mem[1]["optimizer"];
  EXPECT_TRUE(near(mem[1]["grads"], z0.at("grads")));
  EXPECT_TRUE(near(mem[1]["params"], z0.at("params")));
  EXPECT_TRUE(near(mem[2]["optimizer"], z0.at("optimizer") / 4));
  EXPECT_TRUE(near(mem[2]["grads"], z0.at("grads") / 4)) << mem[2]["grads"];
  EXPECT_TRUE(near(mem[2]["params"], z0.at("params")));
  EXPECT_TRUE(near(mem[3]["optimizer"], z0.at("optimizer") / 4));
  EXPECT_TRUE(near(mem[3]["grads"], z0.at("grads") / 4));
  EXPECT_TRUE(near(mem[3]["params"], z0.at("params") / 4)) << mem[3]["params"];
  const double total0 = z0.at("params") + z0.at("grads") + z0.at("optimizer");
  const double total3 = mem[3]["params"] + mem[3]["grads"] + mem[3]["optimizer"];
  EXPECT_TRUE(near(total3, total0 / 4));
}

// A sharded layout (dp2 x pp2, ZeRO-1) checkpoints per-rank files at step 10 and a second run
// resumes from them into the same layout, ending where an uninterrupted run ends.
TEST_F(ParallelLayoutsTest, ShardedCheckpointResumesIntoTheSameLayout) {
  const std::string layout = "--set parallel.pp=2 --set parallel.zero=1 ";
  const fs::path full = Run("resume_full", 4, layout);
  const fs::path first = Run("resume_first", 4, layout + "--set checkpoint.every=10 --set checkpoint.keep=5");
  const fs::path step10 = first / "ck" / "step-10";
  ASSERT_TRUE(fs::exists(step10 / "meta.yaml"));
  for (int r = 0; r < 4; ++r) {
    EXPECT_TRUE(fs::exists(step10 / ("optimizer-rank-" + std::to_string(r) + ".safetensors"))) << r;
  }
  for (int r = 0; r < 4; ++r) {
    // Every rank saves its share of the model: its ZeRO shard of the masters.
    EXPECT_TRUE(fs::exists(step10 / ("model-rank-" + std::to_string(r) + ".safetensors"))) << r;
  }
  std::ifstream meta(step10 / "meta.yaml");
  std::string text((std::istreambuf_iterator<char>(meta)), std::istreambuf_iterator<char>());
  EXPECT_NE(text.find("optimizer-rank-3.safetensors"), std::string::npos) << text;
  EXPECT_NE(text.find("xxh3"), std::string::npos);
  const fs::path resumed = Run("resume_second", 4, layout + "--set checkpoint.resume_from=" + step10.string());
  std::vector<double> a = Losses(full / "log0"), b = Losses(resumed / "log0");
  ASSERT_EQ(b.size(), 10u) << std::ifstream(resumed / "log0").rdbuf();
  for (size_t i = 0; i < b.size(); ++i) EXPECT_NEAR(a[10 + i], b[i], 1e-6 * a[10 + i]) << "step " << i + 11;
  auto pa = Params(full / "params.bin"), pb = Params(resumed / "params.bin");
  ASSERT_EQ(pa.size(), pb.size());
  for (const auto& [key, values] : pa) EXPECT_EQ(values, pb[key]) << key;
}

}  // namespace
}  // namespace ltrain
