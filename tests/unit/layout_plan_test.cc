// Layout plans (common/layout_plan.h): the parameter store's bytes by hand for small models, ZeRO's
// shares, the pipeline's bubble and held micro-batches, and the ranked layouts with their reasons.
#include "common/layout_plan.h"

#include <gtest/gtest.h>

#include <algorithm>

namespace ltrain {
namespace {

Recipe Small(Arch arch = Arch::kGpt2) {
  Recipe r;
  r.name = "plan";
  r.data.path = "/d";
  r.model.arch = arch;
  r.model.layers = 4;
  r.model.heads = 4;
  r.model.d_model = 64;
  r.model.seq_len = 32;
  r.model.vocab = 256;
  if (arch == Arch::kLlama) {
    r.model.kv_heads = 2;
    r.model.ffn = 96;
    r.model.tie_embeddings = false;
  }
  r.training.micro_batch = 2;
  r.training.global_batch = 8;
  return r;
}

LayoutEstimate Estimate(Recipe r, int world) {
  r.parallel.nproc_per_node = world;
  StatusOr<Layout> layout = PlanLayout(r, world);
  EXPECT_TRUE(layout.ok()) << layout.status().ToString();
  return EstimateLayout(r, *layout);
}

// A model that cannot fit on its ranks in any layout is refused before it runs, with the plan's figure;
// one that only needs more ranks than a laptop has is not.
TEST(LayoutPlanTest, AModelThatCannotFitAnywhereIsNamedWithItsFigures) {
  Recipe huge = Small();
  huge.model.d_model = 1048576;
  huge.model.heads = 1024;
  huge.model.layers = 1024;
  const std::string problem = FitProblem(huge);
  EXPECT_NE(problem.find("cannot train on 1 rank(s) in any layout"), std::string::npos) << problem;
  EXPECT_NE(problem.find("GiB a rank in its own layout"), std::string::npos) << problem;
  EXPECT_NE(problem.find("more than any machine has (4096 GiB)"), std::string::npos) << problem;
  Recipe gpu = Small();
  gpu.parallel.device = Device::kCuda;
  gpu.model.d_model = 8192;
  gpu.model.heads = 64;
  gpu.model.layers = 80;  // about 70B parameters: 1,040 GiB of training state
  EXPECT_NE(FitProblem(gpu).find("more than any GPU has (268 GiB)"), std::string::npos) << FitProblem(gpu);
  gpu.parallel.nproc_per_node = 8;  // 130 GiB a GPU spread over 8
  EXPECT_EQ(FitProblem(gpu), "");
  EXPECT_EQ(FitProblem(Small()), "");
}

TEST(LayoutPlanTest, OneRankHoldsFourBytesAParameterForEachOfWeightsGradientsAndTwoMoments) {
  // gpt2 4 x 64: 256*64 + 32*64 + 4*(12*64^2 + 13*64) + 2*64 = 218,496 parameters.
  const LayoutEstimate e = Estimate(Small(), 1);
  ASSERT_EQ(e.stages.size(), 1u);
  EXPECT_EQ(e.stages[0].parameters, 218496);
  EXPECT_EQ(e.stages[0].parts.params, 218496 * 4);
  EXPECT_EQ(e.stages[0].parts.grads, 218496 * 4);
  EXPECT_EQ(e.stages[0].parts.optimizer, 218496 * 8);
  EXPECT_GT(e.stages[0].parts.activations, 0);
  EXPECT_TRUE(e.traffic.empty());
}

TEST(LayoutPlanTest, EachZeroStageShardsItsPartOverDataParallelRanks) {
  Recipe r = Small();
  const int64_t n = 218496;
  for (int zero = 0; zero <= 3; ++zero) {
    r.parallel.zero = zero;
    const MemoryParts p = Estimate(r, 4).stages[0].parts;
    EXPECT_EQ(p.params, zero == 3 ? n : n * 4) << zero;
    EXPECT_EQ(p.grads, zero >= 2 ? n : n * 4) << zero;
    EXPECT_EQ(p.optimizer, zero >= 1 ? n * 2 : n * 8) << zero;
  }
}

TEST(LayoutPlanTest, TensorParallelismSplitsTheMatricesAndKeepsTheNormsWhole) {
  Recipe r = Small();
  r.parallel.tp = 2;
  // wte/2 + wpe + 4*(6*64 + (12*64^2 + 7*64)/2) + lnf
  EXPECT_EQ(Estimate(r, 2).stages[0].parameters, 8192 + 2048 + 4 * 25184 + 128);
  // Llama's 2 key/value heads are replicated at tp 4.
  Recipe llama = Small(Arch::kLlama);
  llama.parallel.tp = 4;
  EXPECT_EQ(Estimate(llama, 4).stages[0].parts.params, 207104);
}

TEST(LayoutPlanTest, ThePipelinesLastStageHoldsItsOwnCopyOfTheTiedEmbedding) {
  Recipe r = Small();
  r.parallel.pp = 2;
  const LayoutEstimate e = Estimate(r, 2);
  ASSERT_EQ(e.stages.size(), 2u);
  EXPECT_EQ(e.stages[0].parts.params, 473600);  // wte, wpe, 2 blocks
  EXPECT_EQ(e.stages[1].parts.params, 465920);  // 2 blocks, lnf, the copy of wte
  bool embedding_group = false;
  for (const GroupTraffic& t : e.traffic) embedding_group = embedding_group || t.group == "embedding";
  EXPECT_TRUE(embedding_group);
}

TEST(LayoutPlanTest, GpipeHoldsEveryMicroBatchAndOneFOneBOnlyThePipelinesDepth) {
  Recipe r = Small();
  r.parallel.pp = 2;
  r.parallel.pp_schedule = PpSchedule::kGpipe;
  const int64_t gpipe = Estimate(r, 2).stages[0].parts.activations;
  r.parallel.pp_schedule = PpSchedule::k1F1B;
  const int64_t one_f_one_b = Estimate(r, 2).stages[0].parts.activations;
  EXPECT_GT(gpipe, one_f_one_b * 3 / 2);
  // Bubble (p-1)/(m+p-1): 4 micro-batches on 2 stages.
  EXPECT_DOUBLE_EQ(Estimate(r, 2).bubble, 1.0 / 5.0);
  r.parallel.pp_schedule = PpSchedule::kInterleaved;
  r.parallel.virtual_stages = 2;
  EXPECT_DOUBLE_EQ(Estimate(r, 2).bubble, 1.0 / 9.0);
}

TEST(LayoutPlanTest, FullRecomputeKeepsLessThanSelectiveWhichKeepsLessThanNone) {
  const StageMemory s = Estimate(Small(), 1).stages[0];
  const int64_t none = s.activations_by_mode[static_cast<int>(ActivationCheckpointing::kNone)];
  const int64_t full = s.activations_by_mode[static_cast<int>(ActivationCheckpointing::kFull)];
  const int64_t selective = s.activations_by_mode[static_cast<int>(ActivationCheckpointing::kSelective)];
  EXPECT_LT(full, selective);
  EXPECT_LT(selective, none);
}

// On CUDA attention keeps no T x T scores (flash attention), so selective recompute saves only what
// the MLP's activation output took (GPT: the GELU's; Llama: the SwiGLU product): b * T * ffn bf16
// elements a layer.
// Selective recompute on CUDA keeps neither the MLP's activation output nor, without sequence
// parallelism, the two norms' outputs (the products make them again in backward); under sequence
// parallelism the products keep their gathered inputs, and only the activation output goes.
TEST(LayoutPlanTest, OnCudaSelectiveRecomputeDropsEachLayersMlpActivationAndNormOutputs) {
  const auto none = static_cast<int>(ActivationCheckpointing::kNone);
  const auto selective = static_cast<int>(ActivationCheckpointing::kSelective);
  Recipe r = Small();
  r.parallel.device = Device::kCuda;
  const StageMemory gpt = Estimate(r, 1).stages[0];
  const int64_t b = 2, t = 32, d = 64, ffn = 4 * 64, layers = 4;
  EXPECT_EQ(gpt.activations_by_mode[none] - gpt.activations_by_mode[selective], layers * b * t * (ffn + 2 * d) * 2);
  r.parallel.tp = 2;
  r.parallel.sequence_parallel = true;
  r.training.global_batch = 4;
  const StageMemory gpt_sp = Estimate(r, 2).stages[0];
  EXPECT_EQ(gpt_sp.activations_by_mode[none] - gpt_sp.activations_by_mode[selective], layers * b * t * (ffn / 2) * 2);
  r = Small(Arch::kLlama);
  r.parallel.device = Device::kCuda;
  const StageMemory llama = Estimate(r, 1).stages[0];
  EXPECT_EQ(llama.activations_by_mode[none] - llama.activations_by_mode[selective], layers * b * t * (96 + 2 * d) * 2);
}

TEST(LayoutPlanTest, OnCudaTheComputeCopiesAreBf16AndTheStepHasAnEstimate) {
  Recipe r = Small();
  r.parallel.device = Device::kCuda;
  const LayoutEstimate e = Estimate(r, 1);
  EXPECT_TRUE(e.bf16);
  EXPECT_EQ(e.stages[0].parts.params, 218496 * 6);  // fp32 master and bf16 copy
  EXPECT_EQ(e.stages[0].parts.grads, 218496 * 2);
  EXPECT_GT(e.step_seconds, 0);
  EXPECT_GT(e.mfu, 0);
}

// On one GPU without accumulation each block's gradients exist only from its backward to its update
// (the worker's transient gradients): one block's are counted. Accumulated micro-batches and data
// parallelism keep them all.
TEST(LayoutPlanTest, OnOneGpuWithoutAccumulationOneBlocksGradientsAreCounted) {
  Recipe r = Small();
  r.parallel.device = Device::kCuda;
  r.training.global_batch = 2;
  const int64_t block = 2 * 64 + (64 * 192 + 192) + (64 * 64 + 64) + 2 * 64 + (64 * 256 + 256) + (256 * 64 + 64);
  EXPECT_EQ(Estimate(r, 1).stages[0].parts.grads, block * 2);
  r.training.global_batch = 4;
  EXPECT_EQ(Estimate(r, 1).stages[0].parts.grads, 218496 * 2);
  EXPECT_EQ(Estimate(r, 2).stages[0].parts.grads, 218496 * 2);
}

// precision auto on CUDA keeps the residual stream in fp32: the embedding's output and the
// pipeline's sends take four bytes instead of bf16's two. The norms keep each layer's input and
// mid-block residual (2 · b · T · d elements) and the final norm's input for backward in bf16 either way.
TEST(LayoutPlanTest, TheDefaultPrecisionKeepsTheResidualStreamInFp32) {
  Recipe r = Small();
  r.parallel.device = Device::kCuda;
  r.parallel.pp = 2;
  r.training.global_batch = 2;
  const LayoutEstimate fp32_stream = Estimate(r, 2);
  r.parallel.precision = Precision::kBf16;
  const LayoutEstimate bf16 = Estimate(r, 2);
  const int64_t b = 2, t = 32, d = 64, layers_per_stage = 2, stream = b * t * d;
  const auto none = static_cast<int>(ActivationCheckpointing::kNone);
  // Stage 0: the embedding's output; stage 1: the activation it received. The layers' saved inputs
  // (under full recompute, each block's fp32 input) and the final norm's input are not the difference.
  EXPECT_EQ(fp32_stream.stages[0].activations_by_mode[none] - bf16.stages[0].activations_by_mode[none], stream * 2);
  EXPECT_EQ(fp32_stream.stages[1].activations_by_mode[none] - bf16.stages[1].activations_by_mode[none], stream * 2);
  const auto full = static_cast<int>(ActivationCheckpointing::kFull);
  EXPECT_EQ(fp32_stream.stages[0].activations_by_mode[full] - bf16.stages[0].activations_by_mode[full],
            (layers_per_stage * stream + stream) * 2);
  int64_t pp_fp32 = 0, pp_bf16 = 0;
  for (const GroupTraffic& g : fp32_stream.traffic) pp_fp32 += g.group == "pp" ? g.bytes : 0;
  for (const GroupTraffic& g : bf16.traffic) pp_bf16 += g.group == "pp" ? g.bytes : 0;
  EXPECT_GT(pp_bf16, 0);
  EXPECT_EQ(pp_fp32, 2 * pp_bf16);
}

// precision fp8: the blocks' matrix products run faster (the rest of the step as auto's); the
// widest product's FP8 operands with their transposed copies, and every block weight's FP8 transposed
// copy (kept from forward to backward), are buffers beside the activations; the products keep their
// inputs' FP8 copies instead of bf16 ones.
TEST(LayoutPlanTest, Fp8ShortensTheBlocksProductsAndBuffersTheirFp8Operands) {
  Recipe r = Small();
  r.parallel.device = Device::kCuda;
  const LayoutEstimate bf16 = Estimate(r, 1);
  r.parallel.precision = Precision::kFp8;
  const LayoutEstimate fp8 = Estimate(r, 1);
  EXPECT_TRUE(fp8.bf16) << "the compute copies stay bf16";
  EXPECT_LT(fp8.step_seconds, bf16.step_seconds);
  EXPECT_GT(fp8.step_seconds, bf16.step_seconds / 1.2) << "no faster than every product 1.2 times faster";
  const int64_t b = 2, t = 32, d = 64, f = 4 * d, layers = 4;
  EXPECT_EQ(fp8.stages[0].parts.buffers - bf16.stages[0].parts.buffers,
            2 * b * t * (f + d) + 2 * f * d + layers * (4 * d * d + 2 * f * d));
  EXPECT_EQ(fp8.stages[0].parts.params, bf16.stages[0].parts.params);
  // Per block: the two norms' outputs, attention's output and the GELU's output a byte an element
  // instead of two.
  EXPECT_EQ(bf16.stages[0].parts.activations - fp8.stages[0].parts.activations, layers * b * t * (3 * d + f));
  // Under ZeRO-3 backward quantizes the gathered weights again: no copies kept.
  r.parallel.nproc_per_node = 2;
  r.parallel.zero = 3;
  const LayoutEstimate zero3 = Estimate(r, 2);
  r.parallel.precision = Precision::kAuto;
  const LayoutEstimate zero3_bf16 = Estimate(r, 2);
  EXPECT_EQ(zero3.stages[0].parts.buffers - zero3_bf16.stages[0].parts.buffers, 2 * b * t * (f + d) + 2 * f * d);
}

// parallel.fp8_bf16_layers: the blocks kept in bf16 run at bf16's rate, so the step lies between
// every block in FP8 and none.
TEST(LayoutPlanTest, Fp8BlocksKeptInBf16RunAtBf16sRate) {
  Recipe r = Small();
  r.parallel.device = Device::kCuda;
  const LayoutEstimate bf16 = Estimate(r, 1);
  r.parallel.precision = Precision::kFp8;
  const LayoutEstimate fp8 = Estimate(r, 1);
  r.parallel.fp8_bf16_layers = {0};
  const LayoutEstimate first_in_bf16 = Estimate(r, 1);
  EXPECT_GT(first_in_bf16.step_seconds, fp8.step_seconds);
  EXPECT_LT(first_in_bf16.step_seconds, bf16.step_seconds);
  std::vector<int> every;
  for (int layer = 0; layer < r.model.layers; ++layer) every.push_back(layer);
  r.parallel.fp8_bf16_layers = every;
  EXPECT_DOUBLE_EQ(Estimate(r, 1).step_seconds, bf16.step_seconds);
}

TEST(LayoutPlanTest, RankedLayoutsPutTheFeasibleFirstFastestFirstAndSayWhyTheOthersFail) {
  Recipe r = Small();
  r.model.layers = 32;
  r.model.d_model = 4096;
  r.model.heads = 32;
  r.model.seq_len = 2048;
  r.model.vocab = 50304;
  r.training.micro_batch = 1;
  r.training.global_batch = 8;
  PlanOptions options;
  options.ranks = 4;
  options.device = Device::kCuda;
  options.memory_bytes = 80.0 * (1 << 30);
  const std::vector<PlanCandidate> ranked = RankLayouts(r, options);
  ASSERT_FALSE(ranked.empty());
  ASSERT_TRUE(ranked.front().feasible);
  bool seen_infeasible = false, memory_reason = false;
  for (size_t i = 0; i < ranked.size(); ++i) {
    if (!ranked[i].feasible) {
      seen_infeasible = true;
      EXPECT_FALSE(ranked[i].problem.empty());
      memory_reason = memory_reason || ranked[i].problem.find("GiB a rank") != std::string::npos;
      continue;
    }
    EXPECT_FALSE(seen_infeasible) << "a feasible layout after an infeasible one";
    if (i > 0 && ranked[i - 1].feasible) {
      EXPECT_LE(ranked[i - 1].estimate.step_seconds, ranked[i].estimate.step_seconds);
    }
    EXPECT_LE(static_cast<double>(ranked[i].estimate.peak_bytes), options.memory_bytes * kGpuMemoryUsable);
  }
  // 7B parameters at 16 bytes each do not fit one 80 GiB GPU's worth of plain data parallelism.
  EXPECT_TRUE(memory_reason);
  // tp 3 does not divide 4 ranks: never considered; tp 4 with 32 heads is.
  for (const PlanCandidate& c : ranked) EXPECT_NE(c.sets.front(), "parallel.tp=3");
}

// On CPUs too the fastest comes first: for the quickstart's model on two ranks, plain data
// parallelism without recompute (every Gloo message waits for its peer, and tp sends four a layer),
// and tp 2 with full recompute, the smallest in memory, well after it.
TEST(LayoutPlanTest, OnCpusTheLayoutsAreRankedByTheirEstimatedStep) {
  Recipe r = Small();
  r.model.layers = 2;
  r.model.d_model = 128;
  r.model.seq_len = 64;
  r.training.micro_batch = 16;
  r.training.global_batch = 32;
  r.parallel.nproc_per_node = 2;
  PlanOptions options;
  options.ranks = 2;
  const std::vector<PlanCandidate> ranked = RankLayouts(r, options);
  ASSERT_FALSE(ranked.empty());
  ASSERT_TRUE(ranked.front().feasible);
  EXPECT_EQ(ranked.front().estimate.layout.dp, 2);
  EXPECT_EQ(ranked.front().estimate.layout.zero, 0);
  EXPECT_EQ(ranked.front().estimate.layout.activation_checkpointing, ActivationCheckpointing::kNone);
  double tp_full = 0;
  for (size_t i = 0; i < ranked.size(); ++i) {
    if (!ranked[i].feasible) continue;
    const LayoutEstimate& e = ranked[i].estimate;
    EXPECT_GT(e.step_seconds, 0);
    if (i > 0) {
      EXPECT_LE(ranked[i - 1].estimate.step_seconds, e.step_seconds);
    }
    if (e.layout.tp == 2 && !e.layout.sequence_parallel && e.layout.activation_checkpointing == ActivationCheckpointing::kFull) {
      tp_full = e.step_seconds;
    }
  }
  EXPECT_GT(tp_full, 1.2 * ranked.front().estimate.step_seconds);
  // Two cores a rank compute in half the time.
  options.cpu_cores_per_rank = 2;
  EXPECT_LT(RankLayouts(r, options).front().estimate.step_seconds, ranked.front().estimate.step_seconds);
}

TEST(LayoutPlanTest, ABrokenRuleIsTheCandidatesReason) {
  Recipe r = Small();
  r.model.heads = 2;  // tp 4 cannot split 2 heads
  r.model.d_model = 64;
  PlanOptions options;
  options.ranks = 4;
  const std::vector<PlanCandidate> ranked = RankLayouts(r, options);
  bool found = false;
  for (const PlanCandidate& c : ranked) {
    if (c.sets.front() == "parallel.tp=4") {
      EXPECT_FALSE(c.feasible);
      EXPECT_NE(c.problem.find("parallel.tp=4 does not divide model.heads=2"), std::string::npos) << c.problem;
      found = true;
    }
  }
  EXPECT_TRUE(found);
}

// A candidate's keys, applied to the recipe they were planned from, give that layout: the recipe's own
// schedule, stages, split and sequence parallelism are reset where the candidate has none.
TEST(LayoutPlanTest, EachCandidatesKeysAppliedToTheRecipeValidate) {
  const std::string recipe =
      "name: p\nmodel: {layers: 8, d_model: 64, heads: 4, seq_len: 32, vocab: 256}\ndata: {path: /d}\n"
      "training: {micro_batch: 1, global_batch: 8}\n"
      "parallel: {nproc_per_node: 4, tp: 2, pp: 2, pp_schedule: interleaved, virtual_stages: 2, "
      "sequence_parallel: true}\n";
  for (const std::string& own : {recipe, recipe + "checkpoint: {every: 5}\n"}) {
    RecipeParseResult base = ParseRecipe(own, "p.yaml");
    ASSERT_TRUE(base.ok()) << base.ErrorText();
    PlanOptions options;
    const std::vector<PlanCandidate> ranked = RankLayouts(base.recipe, options);
    int feasible = 0;
    for (const PlanCandidate& c : ranked) {
      if (!c.feasible) continue;
      ++feasible;
      RecipeParseResult applied = ParseRecipe(own, "p.yaml", c.sets);
      EXPECT_TRUE(applied.ok()) << ::testing::PrintToString(c.sets) << "\n" << applied.ErrorText();
    }
    EXPECT_GT(feasible, 3);
  }
  // A split of the recipe's own is cleared where the candidate drops it.
  RecipeParseResult split = ParseRecipe(
      "name: p\nmodel: {layers: 8, d_model: 64, heads: 4, seq_len: 32, vocab: 256}\ndata: {path: /d}\n"
      "training: {micro_batch: 1, global_batch: 8}\nparallel: {nproc_per_node: 2, pp: 2, pp_split: [3, 5]}\n",
      "p.yaml");
  ASSERT_TRUE(split.ok()) << split.ErrorText();
  for (const PlanCandidate& c : RankLayouts(split.recipe, PlanOptions{})) {
    if (c.feasible && c.sets.front() == "parallel.tp=2") {
      EXPECT_NE(std::find(c.sets.begin(), c.sets.end(), "parallel.pp_split=[]"), c.sets.end())
          << ::testing::PrintToString(c.sets);
    }
  }
}

}  // namespace
}  // namespace ltrain
