// Pure planners of the parallel runtime: rank topology, pipeline schedules (simulated), buckets.
#include <algorithm>
#include <set>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "worker/plan/flat_layout.h"
#include "common/pipeline_schedule.h"
#include "worker/plan/topology.h"

namespace ltrain::worker {
namespace {

TEST(TopologyTest, CoordinatesRoundTripAndGroupsPartitionTheWorld) {
  for (int tp : {1, 2, 4}) {
    for (int pp : {1, 2, 3}) {
      for (int dp : {1, 2, 3}) {
        const int world = tp * dp * pp;
        const Layout layout = Layout::Grid(tp, dp, pp);
        const Layout* t = &layout;
        ASSERT_EQ(t->world_size, world);
        for (int rank = 0; rank < world; ++rank) {
          RankCoords c = CoordsOf(*t, rank);
          EXPECT_EQ(c.tp, rank % tp);
          EXPECT_EQ(c.dp, (rank / tp) % dp);
          EXPECT_EQ(c.pp, rank / (tp * dp));
          EXPECT_EQ(RankAt(*t, c), rank);
        }
        for (GroupKind kind : {GroupKind::kTensor, GroupKind::kData, GroupKind::kPipeline}) {
          std::vector<Group> groups = GroupsOf(*t, kind);
          const int size = kind == GroupKind::kTensor ? tp : kind == GroupKind::kData ? dp : pp;
          ASSERT_EQ(static_cast<int>(groups.size()), world / size);
          std::multiset<int> seen;
          for (const Group& g : groups) {
            ASSERT_EQ(static_cast<int>(g.ranks.size()), size);
            for (size_t i = 0; i < g.ranks.size(); ++i) {
              seen.insert(g.ranks[i]);
              RankCoords a = CoordsOf(*t, g.ranks[0]), b = CoordsOf(*t, g.ranks[i]);
              // Members differ only in the group's own coordinate, which is their group rank.
              if (kind == GroupKind::kTensor) {
                EXPECT_TRUE(a.dp == b.dp && a.pp == b.pp && b.tp == static_cast<int>(i));
              }
              if (kind == GroupKind::kData) {
                EXPECT_TRUE(a.tp == b.tp && a.pp == b.pp && b.dp == static_cast<int>(i));
              }
              if (kind == GroupKind::kPipeline) {
                EXPECT_TRUE(a.tp == b.tp && a.dp == b.dp && b.pp == static_cast<int>(i));
              }
            }
            EXPECT_EQ(GroupOf(*t, kind, g.ranks.back()).name, g.name);
          }
          ASSERT_EQ(static_cast<int>(seen.size()), world);
          for (int rank = 0; rank < world; ++rank) EXPECT_EQ(seen.count(rank), 1u);
        }
        std::vector<Group> emb = GroupsOf(*t, GroupKind::kEmbedding);
        ASSERT_EQ(emb.size(), pp > 1 ? static_cast<size_t>(tp * dp) : 0u);
        for (const Group& g : emb) {
          ASSERT_EQ(g.ranks.size(), 2u);
          EXPECT_EQ(CoordsOf(*t, g.ranks[0]).pp, 0);
          EXPECT_EQ(CoordsOf(*t, g.ranks[1]).pp, pp - 1);
        }
      }
    }
  }
}

TEST(TopologyTest, TensorParallelIsInnermost) {
  const Layout layout = Layout::Grid(2, 2, 2);
  const Layout* t = &layout;
  EXPECT_EQ(GroupOf(*t, GroupKind::kTensor, 5).ranks, (std::vector<int>{4, 5}));
  EXPECT_EQ(GroupOf(*t, GroupKind::kData, 5).ranks, (std::vector<int>{5, 7}));
  EXPECT_EQ(GroupOf(*t, GroupKind::kPipeline, 5).ranks, (std::vector<int>{1, 5}));
  EXPECT_EQ(GroupOf(*t, GroupKind::kTensor, 5).name, "tp 2");
}

// Expert parallelism carved out of dp: over tp in {1, 2} x pp in {1, 2} x dp in {2, 4} x ep dividing
// dp, each ep group is ep neighbouring dp ranks of one tp and pp coordinate, each edp group the dp / ep
// ranks of one ep rank; together they cover each dp group once, and an ep group and an edp group
// meet in one rank.
// A context-parallel group: cp data-parallel neighbours of one tp and pp coordinate, which read the
// same batch replica.
TEST(TopologyTest, ContextGroupsAreDataParallelNeighboursReadingOneBatch) {
  for (int tp : {1, 2}) {
    for (int dp : {2, 4}) {
      for (int cp : {1, 2, 4}) {
        if (dp % cp != 0) continue;
        Layout layout = Layout::Grid(tp, dp, 2);
        layout.cp = cp;
        const std::vector<Group> groups = GroupsOf(layout, GroupKind::kContext);
        ASSERT_EQ(static_cast<int>(groups.size()), layout.world_size / cp);
        for (const Group& g : groups) {
          ASSERT_EQ(static_cast<int>(g.ranks.size()), cp);
          const RankCoords first = CoordsOf(layout, g.ranks[0]);
          for (size_t i = 0; i < g.ranks.size(); ++i) {
            const RankCoords c = CoordsOf(layout, g.ranks[i]);
            EXPECT_TRUE(c.tp == first.tp && c.pp == first.pp);
            EXPECT_EQ(ContextRank(layout, c), static_cast<int>(i));
            EXPECT_EQ(BatchReplica(layout, c), BatchReplica(layout, first));
            EXPECT_EQ(c.dp, first.dp + static_cast<int>(i)) << "cp peers are dp neighbours";
          }
        }
      }
    }
  }
}

TEST(TopologyTest, ExpertGroupsSplitEachDataParallelGroup) {
  for (int tp : {1, 2}) {
    for (int pp : {1, 2}) {
      for (int dp : {2, 4}) {
        for (int ep : {1, 2, 4}) {
          if (dp % ep != 0) continue;
          Layout layout = Layout::Grid(tp, dp, pp);
          layout.ep = ep;
          const std::vector<Group> eps = GroupsOf(layout, GroupKind::kExpert);
          const std::vector<Group> edps = GroupsOf(layout, GroupKind::kExpertData);
          ASSERT_EQ(static_cast<int>(eps.size()), layout.world_size / ep);
          ASSERT_EQ(static_cast<int>(edps.size()), layout.world_size / (dp / ep));
          for (const Group& g : eps) {
            ASSERT_EQ(static_cast<int>(g.ranks.size()), ep);
            const RankCoords first = CoordsOf(layout, g.ranks[0]);
            for (size_t i = 0; i < g.ranks.size(); ++i) {
              const RankCoords c = CoordsOf(layout, g.ranks[i]);
              EXPECT_TRUE(c.tp == first.tp && c.pp == first.pp && ExpertDataRank(layout, c) == ExpertDataRank(layout, first));
              EXPECT_EQ(ExpertRank(layout, c), static_cast<int>(i));
              EXPECT_EQ(c.dp, first.dp + static_cast<int>(i)) << "ep peers are dp neighbours";
            }
          }
          for (const Group& g : edps) {
            ASSERT_EQ(static_cast<int>(g.ranks.size()), dp / ep);
            const RankCoords first = CoordsOf(layout, g.ranks[0]);
            for (size_t i = 0; i < g.ranks.size(); ++i) {
              const RankCoords c = CoordsOf(layout, g.ranks[i]);
              EXPECT_TRUE(c.tp == first.tp && c.pp == first.pp && ExpertRank(layout, c) == ExpertRank(layout, first));
              EXPECT_EQ(ExpertDataRank(layout, c), static_cast<int>(i));
            }
          }
          for (int rank = 0; rank < layout.world_size; ++rank) {
            const Group e = GroupOf(layout, GroupKind::kExpert, rank), d = GroupOf(layout, GroupKind::kExpertData, rank);
            int shared = 0;
            for (int r : e.ranks) shared += d.RankOf(r) >= 0 ? 1 : 0;
            EXPECT_EQ(shared, 1) << "rank " << rank;
          }
        }
      }
    }
  }
  Layout layout = Layout::Grid(2, 4, 1);
  layout.ep = 2;
  EXPECT_EQ(GroupOf(layout, GroupKind::kExpert, 5).ranks, (std::vector<int>{5, 7}));
  EXPECT_EQ(GroupOf(layout, GroupKind::kExpertData, 5).ranks, (std::vector<int>{1, 5}));
  EXPECT_EQ(GroupOf(layout, GroupKind::kExpert, 5).name.rfind("ep ", 0), 0u);
}

TEST(PipelineScheduleTest, EverySchedulePassesTheSimulation) {
  for (const PpSchedule schedule : {PpSchedule::kGpipe, PpSchedule::k1F1B, PpSchedule::kInterleaved}) {
    for (int pp = 1; pp <= 5; ++pp) {
      for (int chunks : {1, 2, 3}) {
        for (int m = 1; m <= 12; ++m) {
          StatusOr<PipelinePlan> plan = PlanPipeline(schedule, pp, chunks, m);
          const bool valid = schedule == PpSchedule::kInterleaved ? (chunks >= 2 && pp >= 2 && m % pp == 0) : chunks == 1;
          ASSERT_EQ(plan.ok(), valid) << NameOf(schedule) << " pp " << pp << " chunks " << chunks << " m " << m;
          if (!valid) continue;
          PipelineSimulation sim = SimulatePipeline(*plan);
          ASSERT_TRUE(sim.completed) << NameOf(schedule) << " pp " << pp << " chunks " << chunks << " m " << m << ": " << sim.error;
          if (schedule == PpSchedule::kGpipe) {
            EXPECT_EQ(sim.max_in_flight, m);
          }
          // 1F1B bounds the activations a rank holds by the pipeline depth, not the micro-batches.
          if (schedule == PpSchedule::k1F1B) {
            EXPECT_LE(sim.max_in_flight, std::min(pp, m));
          }
        }
      }
    }
  }
}

TEST(PipelineScheduleTest, OneFOneBOrderOnTheFirstStage) {
  StatusOr<PipelinePlan> plan = PlanPipeline(PpSchedule::k1F1B, 2, 1, 3);
  ASSERT_TRUE(plan.ok());
  std::vector<std::string> ops;
  for (const PipeOp& op : plan->ops[0]) ops.push_back(ToString(op));
  EXPECT_EQ(ops, (std::vector<std::string>{
                     "F(mb 0, chunk 0)", "send_act(mb 0, chunk 0, peer 1)", "F(mb 1, chunk 0)",
                     "send_act(mb 1, chunk 0, peer 1)", "recv_grad(mb 0, chunk 0, peer 1)", "B(mb 0, chunk 0)",
                     "F(mb 2, chunk 0)", "send_act(mb 2, chunk 0, peer 1)", "recv_grad(mb 1, chunk 0, peer 1)",
                     "B(mb 1, chunk 0)", "recv_grad(mb 2, chunk 0, peer 1)", "B(mb 2, chunk 0)"}));
}

TEST(PipelineScheduleTest, SimulationCatchesBrokenPlans) {
  StatusOr<PipelinePlan> plan = PlanPipeline(PpSchedule::k1F1B, 2, 1, 2);
  ASSERT_TRUE(plan.ok());
  PipelinePlan deadlock = *plan;
  // The first stage waits for micro-batch 0's gradient before sending its activation: a cycle.
  PipeOp recv_grad = deadlock.ops[0][4];
  ASSERT_EQ(recv_grad.kind, PipeOpKind::kRecvGrad);
  deadlock.ops[0].erase(deadlock.ops[0].begin() + 4);
  deadlock.ops[0].insert(deadlock.ops[0].begin(), recv_grad);
  PipelineSimulation dead = SimulatePipeline(deadlock);
  EXPECT_FALSE(dead.completed);
  EXPECT_NE(dead.error.find("deadlock"), std::string::npos) << dead.error;
  PipelinePlan missing = *plan;
  missing.ops[1].pop_back();
  PipelineSimulation sim = SimulatePipeline(missing);
  EXPECT_FALSE(sim.completed);
  PipelinePlan early = *plan;
  // Backward before forward on the last stage.
  auto& last = early.ops[1];
  auto fwd = std::find_if(last.begin(), last.end(), [](const PipeOp& op) { return op.kind == PipeOpKind::kForward; });
  auto bwd = std::find_if(last.begin(), last.end(), [](const PipeOp& op) { return op.kind == PipeOpKind::kBackward; });
  std::iter_swap(fwd, bwd);
  EXPECT_FALSE(SimulatePipeline(early).completed);
  EXPECT_TRUE(SimulatePipeline(*plan).completed);
}

TEST(PipelineScheduleTest, TagsAreUniquePerMessage) {
  StatusOr<PipelinePlan> plan = PlanPipeline(PpSchedule::kInterleaved, 4, 3, 8);
  ASSERT_TRUE(plan.ok());
  std::set<uint32_t> tags;
  for (int grad = 0; grad < 2; ++grad)
    for (int mb = 0; mb < 8; ++mb)
      for (int vs = 0; vs < 12; ++vs) EXPECT_TRUE(tags.insert(PipeTag(*plan, grad == 1, mb, vs)).second);
}

TEST(FlatLayoutTest, BucketsFillFromTheLastParameter) {
  // 4-byte elements, 100-byte cap.
  std::vector<std::vector<int>> b = PlanBuckets({10, 10, 30, 5, 20, 20}, 4, 100);
  EXPECT_EQ(b, (std::vector<std::vector<int>>{{5}, {3, 4}, {2}, {0, 1}}));
  EXPECT_EQ(PlanBuckets({10, 10}, 4, 1e9), (std::vector<std::vector<int>>{{0, 1}}));
  UnitLayout u = LayoutUnit({1, 3}, {7, 5, 9, 4}, 4);
  EXPECT_EQ(u.offsets, (std::vector<int64_t>{0, 5}));
  EXPECT_EQ(u.numel, 9);
  EXPECT_EQ(u.padded, 12);
  EXPECT_EQ(u.shard, 3);
  Range r = Intersect({3, 6}, {5, 20});
  EXPECT_EQ(r.begin, 5);
  EXPECT_EQ(r.size(), 1);
  EXPECT_EQ(Intersect({0, 3}, {5, 9}).size(), 0);
}

}  // namespace
}  // namespace ltrain::worker
