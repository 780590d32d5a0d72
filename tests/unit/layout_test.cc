// The layout rules (common/layout.h): one function for every caller, each rule naming its key.
#include "common/layout.h"

#include <gtest/gtest.h>

#include <functional>

namespace ltrain {
namespace {

Recipe Base() {
  Recipe r;
  r.name = "layout";
  r.data.path = "/d";
  r.model.layers = 4;
  r.model.heads = 4;
  r.model.d_model = 64;
  r.model.seq_len = 32;
  r.training.micro_batch = 2;
  r.training.global_batch = 8;
  return r;
}

std::string Keys(const std::vector<LayoutProblem>& problems) {
  std::string out;
  for (const LayoutProblem& p : problems) out += p.key + ": " + p.message + "\n";
  return out;
}

TEST(LayoutTest, PlansTheDegreesAndTheAccumulation) {
  Recipe r = Base();
  r.parallel.nproc_per_node = 8;
  r.parallel.tp = 2;
  r.parallel.pp = 2;
  StatusOr<Layout> layout = PlanLayout(r, 8);
  ASSERT_TRUE(layout.ok()) << layout.status().ToString();
  EXPECT_EQ(layout->dp, 2);
  EXPECT_EQ(layout->accumulation, 2);
  EXPECT_EQ(layout->stage_layers, (std::vector<int>{2, 2}));
  EXPECT_FALSE(layout->plain());
  // Context parallelism splits the data-parallel ranks too: its ranks read the same sequences, so
  // dp 4 at cp 2 reads 2 micro-batches a step (the accumulation doubles).
  Recipe context = Base();
  context.parallel.cp = 2;
  StatusOr<Layout> cp = PlanLayout(context, 4);
  ASSERT_TRUE(cp.ok()) << cp.status().ToString();
  EXPECT_EQ(cp->dp, 4);
  EXPECT_EQ(cp->batch_replicas(), 2);
  EXPECT_EQ(cp->accumulation, 2);
  EXPECT_FALSE(cp->plain());
  // Expert parallelism splits the data-parallel ranks: dp stays 4 at ep 2.
  Recipe moe = Base();
  moe.model.moe.experts = 4;
  moe.parallel.ep = 2;
  StatusOr<Layout> ep = PlanLayout(moe, 4);
  ASSERT_TRUE(ep.ok()) << ep.status().ToString();
  EXPECT_EQ(ep->dp, 4);
  EXPECT_EQ(ep->ep, 2);
  EXPECT_FALSE(ep->plain());
  StatusOr<Layout> one = PlanLayout(Base(), 1);
  ASSERT_TRUE(one.ok());
  EXPECT_EQ(one->accumulation, 4);
  EXPECT_TRUE(one->plain());
}

TEST(LayoutTest, EachBrokenRuleNamesItsKey) {
  struct Case {
    const char* what;
    std::function<void(Recipe&)> change;
    int world;
    const char* key;
    const char* message;
  };
  const Case cases[] = {
      {"tp*pp does not divide the world", [](Recipe& r) { r.parallel.tp = 3; }, 2, "parallel.tp",
       "world size 2 (nodes*nproc_per_node) is not a multiple of tp*pp=3"},
      {"tp and heads", [](Recipe& r) { r.parallel.tp = 8; r.parallel.nproc_per_node = 8; }, 8, "parallel.tp",
       "does not divide model.heads=4"},
      {"tp within a node", [](Recipe& r) { r.parallel.tp = 2; }, 2, "parallel.tp", "must divide nproc_per_node=1"},
      {"sequence parallel without tp", [](Recipe& r) { r.parallel.sequence_parallel = true; }, 1,
       "parallel.sequence_parallel", "needs parallel.tp > 1"},
      {"more stages than layers", [](Recipe& r) { r.parallel.pp = 8; }, 8, "parallel.pp", "larger than model.layers=4"},
      {"zero 3 with pipelines", [](Recipe& r) { r.parallel.pp = 2; r.parallel.zero = 3; }, 2, "parallel.zero",
       "does not combine with pp>1"},
      {"virtual stages without interleaving", [](Recipe& r) { r.parallel.pp = 2; r.parallel.virtual_stages = 2; }, 2,
       "parallel.virtual_stages", "needs parallel.pp_schedule: interleaved"},
      {"pp_split sum", [](Recipe& r) { r.parallel.pp = 2; r.parallel.pp_split = {2, 1}; }, 2, "parallel.pp_split",
       "summing to model.layers=4; it has 2 summing to 3"},
      {"pp_split entry", [](Recipe& r) { r.parallel.pp = 2; r.parallel.pp_split = {4, 0}; }, 2, "parallel.pp_split",
       "of at least 1"},
      {"ep without experts", [](Recipe& r) { r.parallel.ep = 2; }, 2, "parallel.ep", "this model has none (model.moe)"},
      {"ep and the experts",
       [](Recipe& r) {
         r.model.moe.experts = 6;
         r.parallel.ep = 4;
       },
       4, "parallel.ep", "does not divide model.moe.experts=6"},
      {"ep and dp",
       [](Recipe& r) {
         r.model.moe.experts = 8;
         r.parallel.ep = 4;
       },
       2, "parallel.ep", "does not divide the data-parallel degree 2"},
      {"cp and dp", [](Recipe& r) { r.parallel.cp = 4; }, 2, "parallel.cp", "does not divide the data-parallel degree 2"},
      {"cp and the sequence", [](Recipe& r) { r.parallel.cp = 3; r.training.global_batch = 6; }, 3, "parallel.cp",
       "model.seq_len=32 is not a multiple of 6"},
      {"cp with experts",
       [](Recipe& r) {
         r.parallel.cp = 2;
         r.model.moe.experts = 4;
       },
       2, "parallel.cp", "with model.moe is not supported yet"},
      {"global batch", [](Recipe& r) { r.training.global_batch = 6; }, 2, "training.global_batch",
       "is not a multiple of micro_batch*dp=2*2=4; try 4"},
      {"interleaved micro-batches",
       [](Recipe& r) {
         r.parallel.pp = 2;
         r.parallel.pp_schedule = PpSchedule::kInterleaved;
         r.parallel.virtual_stages = 2;
         r.training.global_batch = 6;
       },
       2, "training.global_batch", "to be a multiple of pp=2"},
  };
  for (const Case& c : cases) {
    Recipe r = Base();
    c.change(r);
    std::vector<LayoutProblem> problems = CheckLayout(r, c.world);
    ASSERT_FALSE(problems.empty()) << c.what;
    EXPECT_EQ(problems.front().key, c.key) << c.what << "\n" << Keys(problems);
    EXPECT_NE(problems.front().message.find(c.message), std::string::npos) << c.what << "\n" << Keys(problems);
    StatusOr<Layout> planned = PlanLayout(r, c.world);
    ASSERT_FALSE(planned.ok()) << c.what;
    EXPECT_EQ(planned.status().message(), problems.front().message);
  }
}

// An elastic job keeps its global batch on fewer ranks, as long as it divides.
TEST(LayoutTest, TheSameRecipeOnAnotherWorldSize) {
  Recipe r = Base();
  r.training.micro_batch = 1;
  r.training.global_batch = 6;
  EXPECT_TRUE(CheckLayout(r, 3).empty());
  EXPECT_TRUE(CheckLayout(r, 2).empty());
  std::vector<LayoutProblem> four = CheckLayout(r, 4);
  ASSERT_EQ(four.size(), 1u) << Keys(four);
  EXPECT_EQ(four.front().key, "training.global_batch");
}

TEST(LayoutTest, StageLayersBalanceOrFollowTheSplit) {
  EXPECT_EQ(StageLayers(4, 2, {}), (std::vector<int>{2, 2}));
  EXPECT_EQ(StageLayers(5, 3, {}), (std::vector<int>{2, 2, 1}));
  EXPECT_EQ(StageLayers(4, 2, {3, 1}), (std::vector<int>{3, 1}));
}

// fault.recovery in_place replaces a failed rank only where another rank holds its part of the state
// whole (a data-parallel peer, without ZeRO); the other jobs restart, and the reason says which key
// keeps them from it.
TEST(LayoutTest, InPlaceRecoveryNeedsADataParallelCopyOfEveryRanksPart) {
  Recipe r = Base();
  EXPECT_EQ(InPlaceRecoveryProblem(r, 4), "fault.recovery is restart");
  r.fault.recovery = Recovery::kInPlace;
  EXPECT_EQ(InPlaceRecoveryProblem(r, 4), "");
  EXPECT_NE(InPlaceRecoveryProblem(r, 1).find("no peer"), std::string::npos);
  Recipe zero = r;
  zero.parallel.zero = 1;
  EXPECT_EQ(InPlaceRecoveryProblem(zero, 4), "");  // peers hold copies of the shards
  zero.parallel.zero = 2;
  EXPECT_EQ(InPlaceRecoveryProblem(zero, 4), "");
  zero.parallel.zero = 3;
  EXPECT_NE(InPlaceRecoveryProblem(zero, 4).find("parallel.zero 3"), std::string::npos);
  Recipe tp = r;
  tp.parallel.tp = 2;
  tp.parallel.nproc_per_node = 4;
  EXPECT_EQ(CheckLayout(tp, 4).size(), 0u);
  EXPECT_EQ(InPlaceRecoveryProblem(tp, 4), "");  // dp 2: each tp part has a copy
  tp.parallel.tp = 4;
  EXPECT_NE(InPlaceRecoveryProblem(tp, 4).find("one data-parallel rank"), std::string::npos);
  Recipe pp = r;
  pp.parallel.pp = 2;
  EXPECT_EQ(CheckLayout(pp, 4).size(), 0u) << Keys(CheckLayout(pp, 4));
  EXPECT_NE(InPlaceRecoveryProblem(pp, 4).find("parallel.pp"), std::string::npos);
  Recipe gpu = r;
  gpu.parallel.device = Device::kCuda;
  EXPECT_EQ(InPlaceRecoveryProblem(gpu, 4), "");  // NCCL groups are aborted and made again as Gloo's
  Recipe ep = r;
  ep.model.moe.experts = 4;
  ep.parallel.ep = 2;
  EXPECT_EQ(CheckLayout(ep, 4).size(), 0u) << Keys(CheckLayout(ep, 4));
  EXPECT_NE(InPlaceRecoveryProblem(ep, 4).find("parallel.ep"), std::string::npos);
  Recipe program = r;
  program.entrypoint.command = {"python3", "train.py"};
  EXPECT_NE(InPlaceRecoveryProblem(program, 4).find("entrypoint.command"), std::string::npos);
}

// A job whose ranks left with a lost node goes on without them only where every member holds the
// whole state and the global batch's micro-batches divide among the members.
TEST(LayoutTest, FewerRanksGoOnOnlyUnderPlainDataParallelismWithTheBatchDividingAmongThem) {
  Recipe r = Base();
  r.fault.recovery = Recovery::kInPlace;
  r.training.micro_batch = 2;
  r.training.global_batch = 8;  // 4 micro-batches: dp4 takes one each, 2 members two each
  EXPECT_EQ(ShrinkProblem(r, 4, 2), "");
  EXPECT_EQ(ShrinkProblem(r, 4, 1), "");
  EXPECT_NE(ShrinkProblem(r, 4, 3).find("do not divide among the 3 ranks left"), std::string::npos);
  EXPECT_NE(ShrinkProblem(r, 4, 0).find("no rank"), std::string::npos);
  Recipe zero = r;
  zero.parallel.zero = 1;
  EXPECT_NE(ShrinkProblem(zero, 4, 2).find("plain data parallelism"), std::string::npos);
  Recipe tp = r;
  tp.parallel.tp = 2;
  tp.parallel.nproc_per_node = 4;
  EXPECT_NE(ShrinkProblem(tp, 4, 2).find("plain data parallelism"), std::string::npos);
  Recipe restart = r;
  restart.fault.recovery = Recovery::kRestart;
  EXPECT_EQ(ShrinkProblem(restart, 4, 2), "fault.recovery is restart");
}

}  // namespace
}  // namespace ltrain
