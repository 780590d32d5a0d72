// The coordinator's in-place recoveries (fault.recovery: in_place): a replacement under way when a new
// coordinator takes over, and ranks that leave with a lost node while the others go on.
#include <csignal>

#include <gtest/gtest.h>

#include "tests/unit/coordinator_fixture.h"

namespace ltrain::launcher {
namespace {

// In place: the membership epoch and the rank under replacement are kept with the job. A coordinator
// that takes the job over meanwhile announces the membership again and the next one (the rendezvous
// keys went with the earlier coordinator), and where the replacement never started on its node (the
// node's running workers lack it), starts it there in the new membership.
// In place, node b lost with ranks 2 and 3 (its agent's stream closed) and no node to start them on:
// ranks 0 and 1 go on in the next membership, whose announcement names them; the ranks that left count
// as done, so the job succeeds when the members exit cleanly. A later failure is not replaced in place.
TEST_F(CoordinatorTest, ANodeLostInPlaceLeavesItsRanksOutAndTheOthersGoOn) {
  Connect("a");
  const int64_t b = Connect("b");
  const std::string recipe = std::string(kRecipe) + "fault: {recovery: in_place, max_restarts: 2}\n";
  std::string id = coordinator_->Submit(recipe, "unit.yaml")->id();
  coordinator_->NodeDisconnected("b", b);
  v1::Job job = *coordinator_->GetJob(id);
  EXPECT_EQ(job.state(), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(job.generation(), 0);
  EXPECT_EQ(job.membership_epoch(), 1);
  ASSERT_EQ(job.ranks_size(), 4);
  EXPECT_EQ(job.ranks(2).state(), "left");
  EXPECT_EQ(job.ranks(3).state(), "left");
  std::optional<std::vector<std::string>> announced = coordinator_->KvGet({id + "/0//membership/1"}, 0);
  ASSERT_TRUE(announced.has_value());
  EXPECT_EQ(announced->front(), "epoch 1: ranks 2,3 left; members 0,1");
  std::vector<v1::Event> going = Events(id, "recovering");
  ASSERT_EQ(going.size(), 1u);
  EXPECT_NE(going[0].message().find("ranks 0,1 go on in place (membership epoch 1) with 2 micro-batch(es) each a step "
                                    "instead of 1, the global batch of 4 unchanged"),
            std::string::npos)
      << going[0].message();

  // The first member to complete a step in the new membership ends the recovery.
  v1::RankProgress report = Report(id, 0, 7, 3);
  v1::RecoveryFigures* figures = report.mutable_recovery();
  figures->set_epoch(1);
  figures->set_resumed_step(2);
  figures->set_source_rank(-1);
  ASSERT_TRUE(coordinator_->ReportProgress(Urgent("a", report)).ok());
  std::vector<v1::Event> went = Events(id, "recovered");
  ASSERT_EQ(went.size(), 1u);
  EXPECT_NE(went[0].message().find("ranks 0,1 went on without the ranks that left (membership epoch 1)"),
            std::string::npos)
      << went[0].message();
  EXPECT_EQ(coordinator_->GetJob(id)->recoveries(), 1);

  for (int rank : {0, 1}) ASSERT_TRUE(coordinator_->ReportWorkerState(Exit(id, rank, 0)).ok());
  EXPECT_EQ(coordinator_->GetJob(id)->state(), v1::JOB_STATE_SUCCEEDED);
}

// A node lost while a rank of the job is being replaced in place: the job restarts, saying why.
TEST_F(CoordinatorTest, ANodeLostInPlaceWhileARankIsBeingReplacedRestartsTheJob) {
  Connect("a");
  const int64_t b = Connect("b");
  const std::string recipe = "name: unit\ndata: {path: /data}\ntraining: {steps: 5, micro_batch: 1, global_batch: 4}\n"
                             "parallel: {nodes: 2, nproc_per_node: 2}\nfault: {recovery: in_place, max_restarts: 2}\n";
  std::string id = coordinator_->Submit(recipe, "unit.yaml")->id();
  ASSERT_TRUE(coordinator_->ReportWorkerState(Exit(id, 3, 0, SIGKILL)).ok());  // rank 3 is being replaced
  coordinator_->NodeDisconnected("b", b);
  v1::Job job = *coordinator_->GetJob(id);
  EXPECT_EQ(job.state(), v1::JOB_STATE_RESTARTING);
  std::vector<v1::Event> refused = Events(id, "recovery");
  ASSERT_FALSE(refused.empty());
  EXPECT_NE(refused.back().message().find("cannot be left out in place: rank 3 is being replaced"), std::string::npos)
      << refused.back().message();
}

TEST_F(CoordinatorTest, ATakeoverDuringAReplacementInPlaceAnnouncesTheNextMembershipAndStartsTheReplacement) {
  Connect("a");
  Connect("b");
  const std::string recipe = std::string(kRecipe) + "fault: {recovery: in_place, max_restarts: 2}\n";
  std::string id = coordinator_->Submit(recipe, "unit.yaml")->id();
  ASSERT_TRUE(coordinator_->ReportWorkerState(Exit(id, 1, 0, SIGKILL)).ok());
  v1::Job replacing = *coordinator_->GetJob(id);
  EXPECT_EQ(replacing.state(), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(replacing.membership_epoch(), 1);
  ASSERT_TRUE(replacing.has_replacing_rank());
  EXPECT_EQ(replacing.replacing_rank(), 1);
  const std::string scope = id + "/0/";
  EXPECT_TRUE(coordinator_->KvGet({scope + "/membership/1"}, 0).has_value());

  coordinator_ = std::make_unique<Coordinator>(store_.get(), &clock_, CoordinatorOptions());
  ASSERT_TRUE(coordinator_->Recover().ok());
  EXPECT_EQ(coordinator_->GetJob(id)->membership_epoch(), 2);
  EXPECT_TRUE(coordinator_->KvGet({scope + "/membership/1", scope + "/membership/2"}, 0).has_value());
  auto running = [&](std::vector<int> ranks) {
    std::vector<v1::RunningWorker> workers;
    for (int rank : ranks) {
      v1::RunningWorker w;
      w.set_job_id(id);
      w.set_generation(0);
      w.set_rank(rank);
      w.set_pid(100 + rank);
      workers.push_back(w);
    }
    return workers;
  };
  std::vector<v1::Command> to_a, to_b;
  v1::NodeFacts facts;
  facts.set_cpus(8);
  coordinator_->NodeConnected("b", facts, running({2, 3}), [&](const v1::Command& c) { to_b.push_back(c); });
  coordinator_->NodeConnected("a", facts, running({0}), [&](const v1::Command& c) { to_a.push_back(c); });
  EXPECT_TRUE(to_b.empty()) << "node b runs all its ranks";
  ASSERT_EQ(to_a.size(), 1u);
  ASSERT_TRUE(to_a[0].has_start());
  const v1::StartJobCommand& start = to_a[0].start();
  EXPECT_TRUE(start.replace());
  EXPECT_EQ(start.epoch(), 2);
  EXPECT_EQ(start.generation(), 0);
  EXPECT_EQ(start.rendezvous_scope(), scope);
  ASSERT_EQ(start.workers_size(), 1);
  EXPECT_EQ(start.workers(0).rank(), 1);
  EXPECT_EQ(start.workers(0).local_rank(), 1);
  EXPECT_FALSE(start.recipe_yaml().empty());
  std::vector<v1::Event> events = Events(id, "recovering");
  ASSERT_GE(events.size(), 3u);
  EXPECT_NE(events.back().message().find("rank 1's replacement had not started on a"), std::string::npos)
      << events.back().message();
}

// A job that went on without the ranks of a lost node, taken back by a new coordinator: it keeps its
// members (Job.members), does not wait for the lost node, and succeeds when the members exit.
TEST_F(CoordinatorTest, RecoveredCoordinatorKeepsTheMembersOfAJobThatRanksLeft) {
  Connect("a");
  const int64_t b = Connect("b");
  const std::string recipe = std::string(kRecipe) + "fault: {recovery: in_place, max_restarts: 2}\n";
  std::string id = coordinator_->Submit(recipe, "unit.yaml")->id();
  for (int rank = 0; rank < 4; ++rank) ASSERT_TRUE(coordinator_->ReportWorkerState(Running(id, rank)).ok());
  coordinator_->NodeDisconnected("b", b);
  coordinator_->FlushState();
  CoordinatorOptions options;
  options.state_dir = "/state";
  options.recovery_grace_ms = 5000;
  coordinator_ = std::make_unique<Coordinator>(store_.get(), &clock_, options);
  ASSERT_TRUE(coordinator_->Recover().ok());
  v1::Job job = *coordinator_->GetJob(id);
  EXPECT_EQ(job.state(), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(job.members_size(), 2);
  EXPECT_EQ(job.membership_epoch(), 1);
  v1::RunningWorker worker;
  worker.set_job_id(id);
  worker.set_generation(0);
  coordinator_->NodeConnected("a", v1::NodeFacts(), {worker});
  clock_.AdvanceMs(6000);
  ASSERT_TRUE(coordinator_->Heartbeat(Beat("a")).ok());
  coordinator_->Tick();
  EXPECT_EQ(coordinator_->GetJob(id)->state(), v1::JOB_STATE_RUNNING) << "node b is not waited for";
  for (int rank : {0, 1}) ASSERT_TRUE(coordinator_->ReportWorkerState(Exit(id, rank, 0)).ok());
  EXPECT_EQ(coordinator_->GetJob(id)->state(), v1::JOB_STATE_SUCCEEDED);
}

}  // namespace
}  // namespace ltrain::launcher
