// Recovery without restart (worker/recovery): who fills whom, the recovery's steps with fake hooks,
// and a real Gloo group that loses a rank, fails at once instead of at its timeout, and is re-formed
// beneath the communicators its users keep.
#include "worker/recovery/recovery.h"

#include <gtest/gtest.h>
#include <torch/nn.h>

#include <array>
#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <gloo/rendezvous/hash_store.h>

#include "worker/comm/gloo_communicator.h"
#include "worker/control/rendezvous_store.h"

namespace ltrain::worker {
namespace {

// A membership the coordinator announced with fewer ranks names its members; a replacement's names none.
TEST(MembersOfTest, TheMembersOfAMembershipThatRanksLeft) {
  EXPECT_EQ(MembersOf("epoch 1: ranks 2,3 left; members 0,1"), (std::vector<int>{0, 1}));
  EXPECT_EQ(MembersOf("epoch 4: ranks 5 left; members 0,1,2,3,4,6,7"), (std::vector<int>{0, 1, 2, 3, 4, 6, 7}));
  EXPECT_EQ(MembersOf("epoch 1: rank 2 replaced"), std::vector<int>{});
  EXPECT_EQ(MembersOf("epoch 1: ranks 2 left; members "), std::vector<int>{});
  EXPECT_EQ(MembersOf("epoch 1: ranks 2 left; members x"), std::vector<int>{});
}

TEST(PlanSyncTest, TheLowestRankAtTheHighestStepFillsTheReplacementAndThoseBehind) {
  // Rank 2 is the replacement; rank 3's last all-reduce of step 51 completed, ranks 0 and 1's did not.
  StatusOr<SyncPlan> plan = PlanSync({{50, true}, {50, true}, {0, false}, {51, true}}, {{0, 1, 2, 3}});
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  EXPECT_TRUE(plan->needed);
  EXPECT_EQ(plan->source, 3);
  EXPECT_EQ(plan->step, 51);
  EXPECT_EQ(plan->source_of, (std::vector<int>{3, 3, 3, 3}));
  EXPECT_EQ(plan->behind, (std::vector<int>{0, 1, 2}));

  plan = PlanSync({{7, true}, {0, false}, {7, true}}, {{0, 1, 2}});
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->source, 0);
  EXPECT_EQ(plan->behind, std::vector<int>{1});
}

TEST(PlanSyncTest, EachReplicaGroupFillsItsOwnFromItsLowestRankAtTheStep) {
  // tp 2 x dp 2: ranks 0 and 2 hold tp part 0, ranks 1 and 3 part 1; rank 1 was replaced.
  StatusOr<SyncPlan> plan = PlanSync({{9, true}, {0, false}, {9, true}, {9, true}}, {{0, 2}, {1, 3}});
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  EXPECT_EQ(plan->source, 0);
  EXPECT_EQ(plan->source_of, (std::vector<int>{0, 3, 0, 3}));
  EXPECT_EQ(plan->behind, std::vector<int>{1});
  // Both copies of tp part 1 lost: nothing in memory can fill it, and the error says whose.
  plan = PlanSync({{9, true}, {0, false}, {9, true}, {0, false}}, {{0, 2}, {1, 3}});
  ASSERT_FALSE(plan.ok());
  EXPECT_EQ(plan.status().code(), StatusCode::kInternal) << "a restart from the checkpoint, not a refusal";
  EXPECT_NE(plan.status().message().find("ranks 1,3 at step 9"), std::string::npos) << plan.status().message();
}

TEST(PlanSyncTest, MembersThatAgreeNeedNothingAndNoStateAtAllIsAnError) {
  StatusOr<SyncPlan> plan = PlanSync({{12, true}, {12, true}}, {{0, 1}});
  ASSERT_TRUE(plan.ok());
  EXPECT_FALSE(plan->needed);
  EXPECT_TRUE(plan->behind.empty());
  plan = PlanSync({{0, false}, {0, false}}, {{0, 1}});
  ASSERT_FALSE(plan.ok());
  EXPECT_EQ(plan.status().code(), StatusCode::kInternal);
  EXPECT_NE(plan.status().message().find("every rank was replaced"), std::string::npos);
}

CopySteps Copies(std::array<int64_t, 2> own, std::array<int64_t, 2> held) {
  CopySteps c;
  c.own = own;
  c.held = held;
  return c;
}

TEST(PlanShardedSyncTest, AReplacementTakesItsShardFromTheRankAfterItAndEveryoneGoesBackToThatStep) {
  // dp 4 under ZeRO: rank 2 was replaced. Ranks 0, 1 and 3 finished step 50's copies of their own
  // shards, but rank 3 never received rank 2's copy of step 50: step 49 is the newest with all four.
  std::vector<CopySteps> members = {Copies({49, 50}, {49, 50}), Copies({49, 50}, {49, 50}), CopySteps{},
                                    Copies({49, 50}, {49, -1})};
  StatusOr<ShardPlan> plan = PlanShardedSync({true, true, false, true}, members, {{0, 1, 2, 3}});
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  EXPECT_EQ(plan->step, 49);
  EXPECT_EQ(plan->fill_from, (std::vector<int>{-1, -1, 3, -1}));
  EXPECT_EQ(plan->meta_source, 0);
  // Had rank 3 received it, nobody would go back further than step 50.
  members[3] = Copies({49, 50}, {49, 50});
  plan = PlanShardedSync({true, true, false, true}, members, {{0, 1, 2, 3}});
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->step, 50);
}

TEST(PlanShardedSyncTest, EachDataParallelGroupRingsOnItsOwnAndTheStepIsCommonToAll) {
  // tp 2 x dp 2: groups {0, 2} and {1, 3}; rank 1 replaced, its copy on rank 3; group {0, 2} has
  // only step 8 on both.
  std::vector<CopySteps> members = {Copies({8, -1}, {8, -1}), CopySteps{}, Copies({8, -1}, {8, -1}),
                                    Copies({8, 9}, {8, 9})};
  StatusOr<ShardPlan> plan = PlanShardedSync({true, false, true, true}, members, {{0, 2}, {1, 3}});
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  EXPECT_EQ(plan->step, 8);
  EXPECT_EQ(plan->fill_from, (std::vector<int>{-1, 3, -1, -1}));
}

TEST(PlanShardedSyncTest, AShardWhoseOwnerAndHolderBothDiedRestartsTheJobNamingIt) {
  // Rank 2 died, then rank 3, which held rank 2's copy: no copy of rank 2's shard is left anywhere.
  std::vector<CopySteps> members = {Copies({49, 50}, {49, 50}), Copies({49, 50}, {49, 50}), CopySteps{}, CopySteps{}};
  StatusOr<ShardPlan> plan = PlanShardedSync({true, true, false, false}, members, {{0, 1, 2, 3}});
  ASSERT_FALSE(plan.ok());
  EXPECT_EQ(plan.status().code(), StatusCode::kInternal) << "a restart from the checkpoint, not a refusal";
  EXPECT_NE(plan.status().message().find("rank 2's shard (its copy was on rank 3) at step 50"), std::string::npos)
      << plan.status().message();
  EXPECT_NE(plan.status().message().find("restarts from its last checkpoint"), std::string::npos);
  // Rank 0 died and then rank 2: rank 0's copy is on rank 1, rank 2's on rank 3; both fill.
  members = {CopySteps{}, Copies({5, 6}, {5, 6}), CopySteps{}, Copies({5, 6}, {5, 6})};
  plan = PlanShardedSync({false, true, false, true}, members, {{0, 1, 2, 3}});
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  EXPECT_EQ(plan->step, 6);
  EXPECT_EQ(plan->fill_from, (std::vector<int>{1, -1, 3, -1}));
  EXPECT_EQ(plan->meta_source, 1);
}

TEST(MemoryCopiesTest, AnIntervalIsDueOnItsMultiplesAndAutoChoosesAfterTheFirstCopies) {
  MemoryCopies every3(3);
  EXPECT_TRUE(every3.Due(3));
  EXPECT_FALSE(every3.Due(4));
  EXPECT_TRUE(every3.Due(6));
  MemoryCopies automatic(0);
  EXPECT_FALSE(automatic.Due(0));
  SelfCommunicator self;
  torch::Tensor p = torch::ones({4});
  ASSERT_TRUE(automatic.Take(self, self, 10, {p}, {torch::tensor({10})}).ok());
  EXPECT_EQ(automatic.calibrate_at(), 15);
  EXPECT_TRUE(automatic.Due(15));
  EXPECT_FALSE(automatic.Due(16));
  for (int i = 0; i < 5; ++i) automatic.NoteStep(100.0);
  ASSERT_TRUE(automatic.Take(self, self, 15, {p}, {torch::tensor({15})}).ok());
  EXPECT_GE(automatic.every(), 1) << "chosen at step 15";
  EXPECT_EQ(automatic.steps().own[0] == 15 || automatic.steps().own[1] == 15, true);
  // Non-fp32 state is refused rather than copied wrongly.
  MemoryCopies bf16(1);
  EXPECT_EQ(bf16.Take(self, self, 1, {torch::ones({2}, torch::kBFloat16)}, {}).code(), StatusCode::kFailedPrecondition);
}

// Three ranks as threads over real Gloo pairs take copies at steps 1 and 2 (each rank's copy goes to
// the rank after it); rank 1 is then lost, and its replacement receives its shard of step 2 from
// rank 2, while ranks 0 and 2 restore their own; a step nobody copied cannot be restored.
TEST(MemoryCopiesTest, AShardLostWithItsRankComesBackFromTheRankAfterIt) {
  gloo::rendezvous::HashStore store;
  std::vector<std::unique_ptr<Communicator>> comms(3);
  std::vector<std::unique_ptr<MemoryCopies>> copies(3);
  std::vector<Status> errors(3);
  auto shard = [](int rank, int step) { return torch::full({5}, static_cast<float>(100 * rank + step)); };
  auto moments = [](int rank, int step) { return torch::full({2, 3}, static_cast<float>(-rank - step)); };
  {
    std::vector<std::thread> ranks;
    for (int r = 0; r < 3; ++r) {
      ranks.emplace_back([&, r] {
        auto c = GlooCommunicator::Create(store, r, 3, "127.0.0.1", std::chrono::seconds(60));
        if (!c.ok()) {
          errors[r] = c.status();
          return;
        }
        comms[r] = std::move(c).value();
        copies[r] = std::make_unique<MemoryCopies>(1);
        for (int step = 1; step <= 2 && errors[r].ok(); ++step) {
          errors[r] = copies[r]->Take(*comms[r], *comms[r], step, {shard(r, step), moments(r, step)},
                                      {torch::tensor({static_cast<int64_t>(step)})});
        }
      });
    }
    for (auto& t : ranks) t.join();
  }
  for (int r = 0; r < 3; ++r) ASSERT_TRUE(errors[r].ok()) << "rank " << r << ": " << errors[r].ToString();
  EXPECT_EQ(copies[2]->steps().held[0] + copies[2]->steps().held[1], 3) << "rank 2 holds rank 1's steps 1 and 2";
  EXPECT_EQ(copies[0]->bytes(), 11 * 4);

  copies[1] = std::make_unique<MemoryCopies>(1);  // the replacement: nothing of its own
  torch::Tensor got_shard = torch::zeros({5}), got_moments = torch::zeros({2, 3});
  torch::Tensor own_shard = torch::zeros({5}), own_moments = torch::zeros({2, 3});
  std::vector<torch::Tensor> meta = {torch::tensor({int64_t{0}})};
  {
    std::thread holder([&] {
      errors[2] = copies[2]->SendHeld(*comms[2], 2, 1);
      if (errors[2].ok()) errors[2] = comms[2]->WaitSends();
    });
    errors[1] = copies[1]->ReceiveOwn(*comms[1], 2, {got_shard, got_moments});
    holder.join();
  }
  ASSERT_TRUE(errors[1].ok()) << errors[1].ToString();
  ASSERT_TRUE(errors[2].ok()) << errors[2].ToString();
  EXPECT_TRUE(torch::equal(got_shard, shard(1, 2)));
  EXPECT_TRUE(torch::equal(got_moments, moments(1, 2)));
  ASSERT_TRUE(copies[0]->RestoreOwn(1, {own_shard, own_moments}, &meta));
  EXPECT_TRUE(torch::equal(own_shard, shard(0, 1)));
  EXPECT_TRUE(torch::equal(own_moments, moments(0, 1)));
  EXPECT_EQ(meta[0].item<int64_t>(), 1);
  EXPECT_FALSE(copies[0]->RestoreOwn(3, {own_shard, own_moments}, &meta));
  EXPECT_FALSE(copies[2]->SendHeld(*comms[2], 7, 1).ok());
}

TEST(RecoveryTest, ReformAbortsWaitsForTheNextMembershipAndReconnects) {
  std::vector<std::string> calls;
  Recovery::Hooks hooks;
  hooks.abort = [&] { calls.push_back("abort"); };
  hooks.await_membership = [&](int epoch, std::chrono::milliseconds) -> StatusOr<std::string> {
    calls.push_back("await " + std::to_string(epoch));
    return std::string("epoch " + std::to_string(epoch) + ": rank 1 replaced");
  };
  hooks.reconnect = [&](int epoch) {
    calls.push_back("reconnect " + std::to_string(epoch));
    return Status::Ok();
  };
  Recovery recovery(std::move(hooks), 0, 0, std::chrono::seconds(1));
  EXPECT_FALSE(recovery.replacement());
  EXPECT_TRUE(Recovery::Recoverable(Unavailable("gloo all_reduce failed")));
  EXPECT_FALSE(Recovery::Recoverable(Internal("loss became nan")));
  ASSERT_TRUE(recovery.Reform(Unavailable("gloo all_reduce failed")).ok());
  ASSERT_TRUE(recovery.Reform(Unavailable("gloo all_reduce failed")).ok());
  EXPECT_EQ(calls, (std::vector<std::string>{"abort", "await 1", "reconnect 1", "abort", "await 2", "reconnect 2"}));
  EXPECT_EQ(recovery.epoch(), 2);
  EXPECT_EQ(recovery.recoveries(), 2);
}

// A member of membership 1 died before it formed: the connect ends superseded, and the rank joins 2.
TEST(RecoveryTest, AMembershipThatLostAMemberBeforeItFormedGivesWayToTheNext) {
  std::vector<std::string> calls;
  Recovery::Hooks hooks;
  hooks.abort = [] {};
  hooks.await_membership = [&](int epoch, std::chrono::milliseconds) -> StatusOr<std::string> {
    calls.push_back("await " + std::to_string(epoch));
    return std::string("announced");
  };
  hooks.reconnect = [&](int epoch) {
    calls.push_back("reconnect " + std::to_string(epoch));
    if (epoch == 1) return Unavailable("gloo: rank 0 of 4 could not connect: membership superseded: membership/2 was announced");
    return Status::Ok();
  };
  Recovery recovery(std::move(hooks), 0, 0, std::chrono::seconds(1));
  ASSERT_TRUE(recovery.Reform(Unavailable("gloo all_reduce failed")).ok());
  EXPECT_EQ(calls, (std::vector<std::string>{"await 1", "reconnect 1", "await 2", "reconnect 2"}));
  EXPECT_EQ(recovery.epoch(), 2);
  // Any other failure to connect is the rank's failure.
  Recovery::Hooks failing;
  failing.await_membership = [](int, std::chrono::milliseconds) -> StatusOr<std::string> { return std::string(""); };
  failing.reconnect = [](int) { return Unavailable("gloo: could not connect: Connection refused"); };
  Recovery other(std::move(failing), 0, 0, std::chrono::seconds(1));
  EXPECT_FALSE(other.Reform(Unavailable("gloo all_reduce failed")).ok());
}

TEST(RecoveryTest, NoNewMembershipFailsTheRankSayingBothWhatFailedAndWhatItWaitedFor) {
  Recovery::Hooks hooks;
  hooks.abort = [] {};
  hooks.await_membership = [](int, std::chrono::milliseconds) -> StatusOr<std::string> {
    return Unavailable("membership 1 was not announced within 300 s");
  };
  hooks.reconnect = [](int) { return Internal("not called"); };
  Recovery recovery(std::move(hooks), 3, 0, std::chrono::seconds(300));
  Status s = recovery.Reform(Unavailable("gloo broadcast failed"));
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("gloo broadcast failed"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("membership 1 was not announced"), std::string::npos) << s.message();
  EXPECT_EQ(recovery.epoch(), 0);
}

TEST(RecoveryTest, AReplacementAgreesWithoutStateAndIsSyncedAfterwards) {
  Recovery recovery(Recovery::Hooks{}, 0, 1, std::chrono::seconds(1));
  EXPECT_TRUE(recovery.replacement());
  FakeCommunicator world;
  world.SimulateSize(2);  // the peer's view is this rank's own: no member holds a state
  StatusOr<SyncPlan> plan = recovery.Agree(world, 0, {{0, 1}});
  EXPECT_FALSE(plan.ok());
  recovery.Synced();
  EXPECT_FALSE(recovery.replacement());
  plan = recovery.Agree(world, 9, {{0, 1}});
  ASSERT_TRUE(plan.ok());
  EXPECT_FALSE(plan->needed);
}

TEST(ReformableCommunicatorTest, KeepsItsRanksAcrossReplacements) {
  ReformableCommunicator comm(std::make_unique<SelfCommunicator>());
  EXPECT_TRUE(comm.Replace(std::make_unique<SelfCommunicator>()).ok());
  auto other = std::make_unique<FakeCommunicator>();
  other->SimulateSize(4);
  Status s = comm.Replace(std::move(other));
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("must keep its ranks"), std::string::npos) << s.message();
}

// Three ranks as threads over real Gloo pairs. Rank 2 goes away (its connections closed, as a
// killed process's are) while ranks 0 and 1 all-reduce: they fail with Unavailable well before their
// 60 s timeout. Each closes its own connections, a new rank 2 joins, and the group is connected again
// under the same communicator objects (epoch 1's keys), where the all-reduce succeeds.
TEST(ReformableCommunicatorTest, AGlooGroupThatLostARankFailsAtOnceAndIsReformed) {
  gloo::rendezvous::HashStore store;
  constexpr auto kTimeout = std::chrono::seconds(60);
  std::vector<std::unique_ptr<ReformableCommunicator>> comms(3);
  {
    std::vector<std::thread> connecting;
    std::vector<Status> errors(3);
    for (int r = 0; r < 3; ++r) {
      connecting.emplace_back([&, r] {
        auto c = GlooCommunicator::Create(store, r, 3, "127.0.0.1", kTimeout);
        if (!c.ok()) {
          errors[r] = c.status();
          return;
        }
        comms[r] = std::make_unique<ReformableCommunicator>(std::move(c).value());
      });
    }
    for (auto& t : connecting) t.join();
    for (int r = 0; r < 3; ++r) ASSERT_TRUE(errors[r].ok()) << errors[r].ToString();
  }
  comms[2]->Abort();
  comms[2].reset();
  const auto start = std::chrono::steady_clock::now();
  std::vector<Status> failures(2);
  {
    std::vector<std::thread> survivors;
    for (int r = 0; r < 2; ++r) {
      survivors.emplace_back([&, r] {
        torch::Tensor t = torch::ones({1024});
        failures[r] = comms[r]->AllReduceSum(t);
        if (!failures[r].ok()) comms[r]->Abort();  // what Recovery::Reform does first
      });
    }
    for (auto& t : survivors) t.join();
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  for (int r = 0; r < 2; ++r) {
    ASSERT_FALSE(failures[r].ok()) << "rank " << r;
    EXPECT_EQ(failures[r].code(), StatusCode::kUnavailable) << failures[r].ToString();
  }
  EXPECT_LT(seconds, 30.0) << "the survivors waited for their timeout instead of failing at once";

  // Membership 1: every rank connects again under its own keys; ranks 0 and 1 keep their objects.
  std::unique_ptr<gloo::rendezvous::Store> epoch = PrefixedView("epoch/1", store);
  std::vector<float> sums(3);
  std::vector<Status> errors(3);
  {
    std::vector<std::thread> members;
    for (int r = 0; r < 3; ++r) {
      members.emplace_back([&, r] {
        auto c = GlooCommunicator::Create(*epoch, r, 3, "127.0.0.1", kTimeout);
        if (!c.ok()) {
          errors[r] = c.status();
          return;
        }
        if (r == 2) {
          comms[2] = std::make_unique<ReformableCommunicator>(std::move(c).value());
        } else if (Status s = comms[r]->Replace(std::move(c).value()); !s.ok()) {
          errors[r] = s;
          return;
        }
        torch::Tensor t = torch::full({4}, static_cast<float>(r + 1));
        errors[r] = comms[r]->AllReduceSum(t);
        sums[r] = t[3].item<float>();
      });
    }
    for (auto& t : members) t.join();
  }
  for (int r = 0; r < 3; ++r) {
    ASSERT_TRUE(errors[r].ok()) << "rank " << r << ": " << errors[r].ToString();
    EXPECT_EQ(sums[r], 6.0f);
  }
}

}  // namespace
}  // namespace ltrain::worker
