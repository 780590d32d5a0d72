#include "launcher/coordinator.h"

#include <gtest/gtest.h>

#include <csignal>

#include <sqlite3.h>
#include <unistd.h>

#include <condition_variable>
#include <filesystem>
#include <limits>
#include <mutex>

#include "common/clock.h"
#include "common/logging.h"
#include "common/worker_exit.h"
#include "launcher/state_store.h"
#include "tests/unit/coordinator_fixture.h"

namespace ltrain::launcher {
namespace {

TEST_F(CoordinatorTest, JobWaitsForEnoughNodesThenGetsContiguousRanks) {
  Connect("a");
  StatusOr<v1::Job> job = coordinator_->Submit(kRecipe, "unit.yaml");
  ASSERT_TRUE(job.ok()) << job.status().ToString();
  EXPECT_EQ(job->state(), v1::JOB_STATE_PENDING);
  EXPECT_FALSE(coordinator_->WaitCommand("a", 0).has_value());

  Connect("b");
  std::optional<v1::Command> a = coordinator_->WaitCommand("a", 0);
  std::optional<v1::Command> b = coordinator_->WaitCommand("b", 0);
  ASSERT_TRUE(a && a->has_start());
  ASSERT_TRUE(b && b->has_start());
  EXPECT_EQ(a->start().world_size(), 4);
  EXPECT_EQ(a->start().workers(0).rank(), 0);
  EXPECT_EQ(a->start().workers(1).rank(), 1);
  EXPECT_EQ(b->start().workers(0).rank(), 2);
  EXPECT_EQ(b->start().workers(1).local_rank(), 1);
  EXPECT_EQ(a->start().rendezvous_scope(), job->id() + "/0/");
  EXPECT_EQ(a->start().checkpoint_dir(), "/state/checkpoints/" + job->id());
  v1::Job running = *coordinator_->GetJob(job->id());
  EXPECT_EQ(running.state(), v1::JOB_STATE_RUNNING);
  // The job's nodes, with the facts their agents reported (its JSON printed them empty).
  ASSERT_EQ(running.nodes_size(), 2);
  EXPECT_EQ(running.nodes(1).node_id(), "b");
  EXPECT_EQ(running.nodes(1).facts().hostname(), "b.example");
  EXPECT_EQ(running.nodes(1).facts().cpus(), 8);
}

// A cuda job is placed only on nodes with a GPU; while it waits, it says why the idle nodes without one
// do not count. A cpu job takes any node.
TEST_F(CoordinatorTest, ACudaJobWaitsForNodesWithAGpu) {
  Connect("a");
  Connect("b");
  StatusOr<v1::Job> job = coordinator_->Submit(
      "name: unit\ndata: {path: /data}\ntraining: {steps: 5, micro_batch: 1, global_batch: 4}\n"
      "parallel: {nodes: 2, nproc_per_node: 2, device: cuda}\n",
      "unit.yaml");
  ASSERT_TRUE(job.ok()) << job.status().ToString();
  EXPECT_EQ(job->state(), v1::JOB_STATE_PENDING);
  EXPECT_FALSE(coordinator_->WaitCommand("a", 0).has_value());
  std::vector<v1::Event> waiting = Events(job->id(), "waiting");
  ASSERT_EQ(waiting.size(), 1u);
  EXPECT_NE(waiting[0].message().find("0 free with a GPU (2 idle without one, and parallel.device is cuda)"),
            std::string::npos)
      << waiting[0].message();
  Connect("c", 8);
  Connect("d", 8);
  EXPECT_FALSE(coordinator_->WaitCommand("a", 0).has_value());
  std::optional<v1::Command> c = coordinator_->WaitCommand("c", 0);
  ASSERT_TRUE(c && c->has_start());
  EXPECT_EQ(coordinator_->GetJob(job->id())->state(), v1::JOB_STATE_RUNNING);
  // The CPU nodes still take a cpu job.
  StatusOr<v1::Job> cpu = coordinator_->Submit(kRecipe, "unit.yaml");
  ASSERT_TRUE(cpu.ok());
  EXPECT_EQ(coordinator_->GetJob(cpu->id())->state(), v1::JOB_STATE_RUNNING);
}

TEST_F(CoordinatorTest, AllRanksExitingZeroSucceeds) {
  Connect("a");
  Connect("b");
  std::string id = coordinator_->Submit(kRecipe, "unit.yaml")->id();
  for (int rank = 0; rank < 4; ++rank) {
    EXPECT_EQ(coordinator_->GetJob(id)->state(), v1::JOB_STATE_RUNNING);
    ASSERT_TRUE(coordinator_->ReportWorkerState(Exit(id, rank, 0)).ok());
  }
  EXPECT_EQ(coordinator_->GetJob(id)->state(), v1::JOB_STATE_SUCCEEDED);
}

TEST_F(CoordinatorTest, OneKilledRankFailsTheJobAndStopsEveryNode) {
  Connect("a");
  Connect("b");
  std::string id = coordinator_->Submit(kRecipe, "unit.yaml")->id();
  coordinator_->WaitCommand("a", 0);
  coordinator_->WaitCommand("b", 0);
  ASSERT_TRUE(coordinator_->ReportWorkerState(Exit(id, 3, 0, 9)).ok());
  v1::Job job = *coordinator_->GetJob(id);
  EXPECT_EQ(job.state(), v1::JOB_STATE_FAILED);
  EXPECT_NE(job.cause().find("rank 3 on b was killed by signal SIGKILL"), std::string::npos) << job.cause();
  EXPECT_NE(job.cause().find("last words"), std::string::npos);
  for (const char* node : {"a", "b"}) {
    std::optional<v1::Command> stop = coordinator_->WaitCommand(node, 0);
    ASSERT_TRUE(stop && stop->has_stop()) << node;
    EXPECT_EQ(stop->stop().job_id(), id);
  }
  // Later exits of the stopped ranks do not change the verdict.
  ASSERT_TRUE(coordinator_->ReportWorkerState(Exit(id, 0, 0, 15)).ok());
  EXPECT_EQ(coordinator_->GetJob(id)->cause(), job.cause());
}

TEST_F(CoordinatorTest, NonZeroExitCodeIsNamed) {
  Connect("a");
  Connect("b");
  std::string id = coordinator_->Submit(kRecipe, "unit.yaml")->id();
  ASSERT_TRUE(coordinator_->ReportWorkerState(Exit(id, 1, 3)).ok());
  EXPECT_NE(coordinator_->GetJob(id)->cause().find("rank 1 on a exited with code 3"), std::string::npos);
}

TEST_F(CoordinatorTest, SilentNodeIsLostAfterTheTimeout) {
  Connect("a");
  Connect("b");
  std::string id = coordinator_->Submit(kRecipe, "unit.yaml")->id();
  clock_.AdvanceMs(2000);
  ASSERT_TRUE(coordinator_->Heartbeat(Beat("a")).ok());
  coordinator_->Tick();
  EXPECT_EQ(coordinator_->GetJob(id)->state(), v1::JOB_STATE_RUNNING);
  clock_.AdvanceMs(1500);  // b silent for 3.5 s, a for 1.5 s
  coordinator_->Tick();
  v1::Job job = *coordinator_->GetJob(id);
  EXPECT_EQ(job.state(), v1::JOB_STATE_FAILED);
  EXPECT_NE(job.cause().find("node b lost"), std::string::npos) << job.cause();
}

// Many nodes falling silent at once point at the coordinator (overloaded, replies late): they get three
// timeouts before they are lost; a few silent nodes are lost after one.
TEST_F(CoordinatorTest, ManyNodesSilentAtOnceGetThreeTimeoutsAFewGetOne) {
  for (int i = 0; i < 20; ++i) Connect("n" + std::to_string(i));
  auto beat = [&](int from, int to) {
    for (int i = from; i < to; ++i) ASSERT_TRUE(coordinator_->Heartbeat(Beat("n" + std::to_string(i))).ok());
  };
  auto connected = [&] {
    int count = 0;
    for (const v1::NodeStatus& node : coordinator_->ListNodes()) count += node.connected() ? 1 : 0;
    return count;
  };
  clock_.AdvanceMs(4000);  // 15 of 20 silent for 4 s (timeout 3 s)
  beat(15, 20);
  coordinator_->Tick();
  EXPECT_EQ(connected(), 20);
  clock_.AdvanceMs(5500);  // 9.5 s: more than three timeouts
  beat(15, 20);
  coordinator_->Tick();
  EXPECT_EQ(connected(), 5);

  clock_.AdvanceMs(3500);  // 2 of the 5 left go silent: lost after one timeout
  beat(17, 20);
  coordinator_->Tick();
  EXPECT_EQ(connected(), 3);
}

// A rendezvous Get that waits holds no thread: it is answered when its last key is set, or with
// an error once its timeout has passed at a tick.
TEST_F(CoordinatorTest, AsyncKeyValueGetIsAnsweredWhenItsKeysAreSetOrItsTimeoutPasses) {
  const std::string s = coordinator_->Submit(kRecipe, "unit.yaml")->id() + "/0/";
  std::vector<StatusOr<std::vector<std::string>>> answers;
  auto record = [&](StatusOr<std::vector<std::string>> values) { answers.push_back(std::move(values)); };
  coordinator_->KvGetAsync({s + "a", s + "b"}, 10000, record);
  EXPECT_TRUE(answers.empty());
  ASSERT_TRUE(coordinator_->KvSet(s + "b", "2").ok());
  EXPECT_TRUE(answers.empty());
  ASSERT_TRUE(coordinator_->KvSet(s + "a", "1").ok());
  ASSERT_EQ(answers.size(), 1u);
  ASSERT_TRUE(answers[0].ok());
  EXPECT_EQ(*answers[0], (std::vector<std::string>{"1", "2"}));
  coordinator_->KvGetAsync({s + "a"}, 10000, record);  // already there: at once
  ASSERT_EQ(answers.size(), 2u);
  EXPECT_TRUE(answers[1].ok());
  coordinator_->KvGetAsync({s + "never"}, 1000, record);
  coordinator_->Tick();
  EXPECT_EQ(answers.size(), 2u);
  clock_.AdvanceMs(1500);
  coordinator_->Tick();
  ASSERT_EQ(answers.size(), 3u);
  ASSERT_FALSE(answers[2].ok());
  EXPECT_EQ(answers[2].status().code(), StatusCode::kDeadlineExceeded);
}

// A Get made while_generation_lives outlasts its timeout while the generation runs, and is answered
// with why at the first tick after the generation ends; one for a generation that does not run is
// refused at once.
TEST_F(CoordinatorTest, AGetWhileItsGenerationLivesWaitsPastItsTimeoutAndEndsWithTheGeneration) {
  Connect("a");
  Connect("b");
  const std::string id = coordinator_->Submit(kRecipe, "unit.yaml")->id();
  ASSERT_EQ(coordinator_->GetJob(id)->state(), v1::JOB_STATE_RUNNING);
  const std::string s = id + "/0/";
  std::vector<StatusOr<std::vector<std::string>>> answers;
  auto record = [&](StatusOr<std::vector<std::string>> values) { answers.push_back(std::move(values)); };
  coordinator_->KvGetAsync({s + "late"}, 1000, record, /*while_generation_lives=*/true);
  coordinator_->KvGetAsync({s + "never"}, 1000, record, /*while_generation_lives=*/true);
  for (int i = 0; i < 30; ++i) {  // a minute, the nodes heartbeating
    clock_.AdvanceMs(2000);
    ASSERT_TRUE(coordinator_->Heartbeat(Beat("a")).ok());
    ASSERT_TRUE(coordinator_->Heartbeat(Beat("b")).ok());
    coordinator_->Tick();
  }
  ASSERT_EQ(coordinator_->GetJob(id)->state(), v1::JOB_STATE_RUNNING);
  EXPECT_TRUE(answers.empty()) << "a minute past its timeout, the generation still running";
  ASSERT_TRUE(coordinator_->KvSet(s + "late", "v").ok());
  ASSERT_EQ(answers.size(), 1u);
  ASSERT_TRUE(answers[0].ok());
  EXPECT_EQ(*answers[0], std::vector<std::string>{"v"});
  ASSERT_TRUE(coordinator_->Stop(id, "unit").ok());
  EXPECT_EQ(answers.size(), 1u) << "answered at a tick, not under the coordinator's lock";
  coordinator_->Tick();
  ASSERT_EQ(answers.size(), 2u);
  ASSERT_FALSE(answers[1].ok());
  EXPECT_EQ(answers[1].status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(answers[1].status().message().find("ended"), std::string::npos) << answers[1].status().message();
  coordinator_->KvGetAsync({s + "late"}, 1000, record, /*while_generation_lives=*/true);  // the job is over
  ASSERT_EQ(answers.size(), 3u);
  EXPECT_EQ(answers[2].status().code(), StatusCode::kFailedPrecondition);
  coordinator_->KvGetAsync({id + "/7/x"}, 1000, record, /*while_generation_lives=*/true);  // no such generation
  ASSERT_EQ(answers.size(), 4u);
  EXPECT_EQ(answers[3].status().code(), StatusCode::kFailedPrecondition);
}

TEST_F(CoordinatorTest, JobsHeartbeatSettingsTightenNodeLoss) {
  Connect("a");
  Connect("b");
  std::string recipe = std::string(kRecipe) + "fault: {heartbeat_interval_s: 0.5, heartbeat_misses: 2}\n";
  std::string id = coordinator_->Submit(recipe, "unit.yaml")->id();
  std::optional<v1::Command> start = coordinator_->WaitCommand("a", 0);
  ASSERT_TRUE(start && start->has_start());
  EXPECT_EQ(start->start().heartbeat_interval_ms(), 500);
  clock_.AdvanceMs(900);
  coordinator_->Tick();
  EXPECT_EQ(coordinator_->GetJob(id)->state(), v1::JOB_STATE_RUNNING);
  clock_.AdvanceMs(200);  // 1.1 s > 0.5 s * 2
  coordinator_->Tick();
  EXPECT_EQ(coordinator_->GetJob(id)->state(), v1::JOB_STATE_FAILED);
}

TEST_F(CoordinatorTest, StaleStreamClosingDoesNotDropAReconnectedNode) {
  int64_t old_token = Connect("a");
  Connect("a");  // the agent reconnected before the old stream noticed
  Connect("b");
  coordinator_->NodeDisconnected("a", old_token);
  std::string id = coordinator_->Submit(kRecipe, "unit.yaml")->id();
  EXPECT_EQ(coordinator_->GetJob(id)->state(), v1::JOB_STATE_RUNNING);
}

TEST_F(CoordinatorTest, StopEndsAPendingJob) {
  std::string id = coordinator_->Submit(kRecipe, "unit.yaml")->id();
  StatusOr<v1::Job> stopped = coordinator_->Stop(id, "");
  ASSERT_TRUE(stopped.ok());
  EXPECT_EQ(stopped->state(), v1::JOB_STATE_STOPPED);
  Connect("a");
  Connect("b");
  EXPECT_FALSE(coordinator_->WaitCommand("a", 0).has_value());
}

TEST_F(CoordinatorTest, InvalidRecipeIsRejectedWithItsLocation) {
  StatusOr<v1::Job> job = coordinator_->Submit("data: {path: /d}\nmodel: {heads: 3}\n", "bad.yaml");
  ASSERT_FALSE(job.ok());
  EXPECT_EQ(job.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(job.status().message().find("bad.yaml:2:16:"), std::string::npos) << job.status().message();
  EXPECT_TRUE(store_->ListJobs(10)->empty());
}

TEST_F(CoordinatorTest, RendezvousGetReturnsPublishedValuesAndTimesOut) {
  const std::string s = coordinator_->Submit(kRecipe, "unit.yaml")->id() + "/0/";
  ASSERT_TRUE(coordinator_->KvSet(s + "rank0", "addr0").ok());
  EXPECT_FALSE(coordinator_->KvGet({s + "rank0", s + "rank1"}, 0).has_value());
  ASSERT_TRUE(coordinator_->KvSet(s + "rank1", "addr1").ok());
  std::optional<std::vector<std::string>> values = coordinator_->KvGet({s + "rank0", s + "rank1"}, 0);
  ASSERT_TRUE(values.has_value());
  EXPECT_EQ((*values)[1], "addr1");
}

// Rendezvous keys are bounded: per key, per value and per job, and only a running job's newest
// generation may set them. A refusal names the bound and stores nothing.
TEST_F(CoordinatorTest, RendezvousSetsAreBoundedAndOnlyForTheNewestGenerationOfARunningJob) {
  const std::string id = coordinator_->Submit(kRecipe, "unit.yaml")->id();
  const std::string s = id + "/0/";
  Status not_running = coordinator_->KvSet("other-1/0/x", "v");
  EXPECT_EQ(not_running.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(not_running.message().find("job other-1 is not running on this coordinator"), std::string::npos)
      << not_running.message();
  EXPECT_NE(coordinator_->KvSet(id + "/3/x", "v").message().find("not of generation 0"), std::string::npos);
  EXPECT_NE(coordinator_->KvSet("nojob", "v").message().find("JOB/GENERATION/NAME"), std::string::npos);
  Status long_key = coordinator_->KvSet(s + std::string(Coordinator::kMaxKvKeyBytes, 'k'), "v");
  EXPECT_NE(long_key.message().find("over the bound of 1024"), std::string::npos) << long_key.message();
  Status big = coordinator_->KvSet(s + "big", std::string(Coordinator::kMaxKvValueBytes + 1, 'v'));
  EXPECT_NE(big.message().find("over the bound of 1048576"), std::string::npos) << big.message();
  const std::string mib(Coordinator::kMaxKvValueBytes - 64, 'v');
  int stored = 0;
  Status full;
  for (int i = 0; i < 100 && (full = coordinator_->KvSet(s + "k" + std::to_string(i), mib)).ok(); ++i) ++stored;
  EXPECT_EQ(stored, 64) << "64 MiB of keys and values a job";
  EXPECT_NE(full.message().find("over the bound of 67108864"), std::string::npos) << full.message();
  EXPECT_TRUE(coordinator_->KvSet(s + "k0", "small").ok()) << "a key set again counts once";
  EXPECT_TRUE(coordinator_->KvSet(s + "k64", mib).ok()) << "what k0 gave back is free";
  EXPECT_EQ(coordinator_->KvSize(), 65u);
}

// A job's rendezvous keys (Gloo addresses, NCCL ids) go with it: no store that grows for ever.
TEST_F(CoordinatorTest, AJobsRendezvousKeysAreFreedWhenItEnds) {
  Connect("a");
  Connect("b");
  const std::string id = coordinator_->Submit(kRecipe, "unit.yaml")->id();
  const std::string other = coordinator_->Submit(kRecipe, "unit.yaml")->id();
  ASSERT_TRUE(coordinator_->KvSet(id + "/0/rank0", "addr0").ok());
  ASSERT_TRUE(coordinator_->KvSet(id + "/0/nccl", "id").ok());
  ASSERT_TRUE(coordinator_->KvSet(other + "/0/rank0", "kept").ok());
  EXPECT_EQ(coordinator_->KvSize(), 3u);
  ASSERT_TRUE(coordinator_->Stop(id, "test").ok());
  EXPECT_EQ(coordinator_->KvSize(), 1u) << "only the other job's key is left";
  EXPECT_TRUE(coordinator_->KvGet({other + "/0/rank0"}, 0).has_value());
  EXPECT_FALSE(coordinator_->KvSet(id + "/0/rank0", "again").ok()) << "an ended job sets nothing";
}

TEST_F(CoordinatorTest, LogLinesAreStoredAsEventsAndNothingIsLearntFromTheirText) {
  Connect("a");
  Connect("b");
  std::string id = coordinator_->Submit(kRecipe, "unit.yaml")->id();
  v1::PushLogsRequest logs;
  logs.set_job_id(id);
  for (const char* text :
       {"step 3/5 loss 2.500000 lr 1.0e-03 tok/s 100 step_ms 1.0", "checkpoint step-3 written to /ck in 3 ms",
        "rank 0: stopped after step 3 of 5, with its checkpoint committed: the job is being stopped"}) {
    v1::LogLine* line = logs.add_lines();
    line->set_rank(0);
    line->set_text(text);
  }
  coordinator_->PushLogs(logs);
  bool finished = false;
  std::vector<v1::Event> events = *coordinator_->WaitEvents(id, 0, true, 0, &finished);
  EXPECT_FALSE(finished);
  ASSERT_GE(events.size(), 3u);
  EXPECT_EQ(events.back().kind(), "log");
  EXPECT_EQ(events.back().rank(), 0);
  EXPECT_EQ(events[events.size() - 3].message(), "step 3/5 loss 2.500000 lr 1.0e-03 tok/s 100 step_ms 1.0");
  std::vector<v1::Event> without_logs = *coordinator_->WaitEvents(id, 0, false, 0, &finished);
  EXPECT_EQ(without_logs.size() + 3, events.size());

  v1::Job job = *coordinator_->GetJob(id);
  EXPECT_EQ(job.last_step(), 0);
  EXPECT_EQ(job.total_steps(), 0);
  EXPECT_DOUBLE_EQ(job.last_loss(), 0);
  EXPECT_DOUBLE_EQ(job.tokens_per_s(), 0);
  EXPECT_EQ(job.last_committed_step(), 0);
  EXPECT_TRUE(Events(id, "checkpoint").empty());
  // Nor does a line saying the ranks stopped after a final checkpoint make the job STOPPED.
  for (int rank = 0; rank < 4; ++rank) ASSERT_TRUE(coordinator_->ReportWorkerState(Exit(id, rank, 0)).ok());
  EXPECT_EQ(coordinator_->GetJob(id)->state(), v1::JOB_STATE_SUCCEEDED);
}

TEST_F(CoordinatorTest, StepFiguresComeFromRankZerosProgressInHeartbeats) {
  Connect("a");
  Connect("b");
  std::string id = coordinator_->Submit(kRecipe, "unit.yaml")->id();
  ASSERT_TRUE(coordinator_->Heartbeat(BeatWith("a", Report(id, 0, 7, 3))).ok());
  v1::Job job = *coordinator_->GetJob(id);
  EXPECT_EQ(job.last_step(), 3);
  EXPECT_EQ(job.total_steps(), 5);
  EXPECT_DOUBLE_EQ(job.last_loss(), 2.5);
  EXPECT_DOUBLE_EQ(job.tokens_per_s(), 100);
  EXPECT_DOUBLE_EQ(job.eta_s(), 0.002);  // 2 steps left at 1 ms
  ASSERT_EQ(job.ranks_size(), 4);
  EXPECT_EQ(job.ranks(0).last_step(), 4) << "the step rank 0 works on";
  EXPECT_EQ(job.ranks(0).phase(), "forward");
  EXPECT_FALSE(job.has_fp8()) << "no FP8 figures in the report";
  EXPECT_FALSE(job.has_moe()) << "no MoE figures in the report";
  // Persisted: the stored job has them too.
  coordinator_->FlushState();
  EXPECT_EQ(store_->GetJob(id)->last_step(), 3);
  EXPECT_DOUBLE_EQ(store_->GetJob(id)->last_loss(), 2.5);

  // Another rank's figures are its own.
  v1::RankProgress rank2 = Report(id, 2, 9, 4);
  rank2.mutable_completed()->set_loss(7.0);
  ASSERT_TRUE(coordinator_->Heartbeat(BeatWith("b", rank2)).ok());
  EXPECT_EQ(coordinator_->GetJob(id)->last_step(), 3);
  EXPECT_DOUBLE_EQ(coordinator_->GetJob(id)->last_loss(), 2.5);

  // A heartbeat that collected an older report than one already applied changes nothing.
  ASSERT_TRUE(coordinator_->Heartbeat(BeatWith("a", Report(id, 0, 8, 4))).ok());
  ASSERT_TRUE(coordinator_->Heartbeat(BeatWith("a", Report(id, 0, 6, 2))).ok());
  EXPECT_EQ(coordinator_->GetJob(id)->last_step(), 4);
  EXPECT_EQ(coordinator_->GetJob(id)->ranks(0).last_step(), 5);

  // A report of another generation neither.
  v1::RankProgress stale = Report(id, 0, 100, 1);
  stale.set_generation(1);
  ASSERT_TRUE(coordinator_->Heartbeat(BeatWith("a", stale)).ok());
  EXPECT_EQ(coordinator_->GetJob(id)->last_step(), 4);

  // parallel.precision fp8: rank 0's step's FP8 figures, kept with the job and stored.
  v1::RankProgress fp8 = Report(id, 0, 101, 5);
  fp8.mutable_completed()->mutable_fp8()->set_gradient_amax_max(0.25);
  fp8.mutable_completed()->mutable_fp8()->set_overflow_steps(1);
  ASSERT_TRUE(coordinator_->Heartbeat(BeatWith("a", fp8)).ok());
  EXPECT_DOUBLE_EQ(coordinator_->GetJob(id)->fp8().gradient_amax_max(), 0.25);
  coordinator_->FlushState();
  EXPECT_EQ(store_->GetJob(id)->fp8().overflow_steps(), 1);

  // model.moe: rank 0's step's routing figures, kept with the job and stored.
  v1::RankProgress moe = Report(id, 0, 102, 5);
  moe.mutable_completed()->mutable_moe()->set_load_max(1.5);
  moe.mutable_completed()->mutable_moe()->set_worst_layer(2);
  ASSERT_TRUE(coordinator_->Heartbeat(BeatWith("a", moe)).ok());
  EXPECT_DOUBLE_EQ(coordinator_->GetJob(id)->moe().load_max(), 1.5);
  coordinator_->FlushState();
  EXPECT_EQ(store_->GetJob(id)->moe().worst_layer(), 2);
}

// A rank whose own work stays above the others' for kStragglerConfirmSteps steps is named once, with
// its node, in an event, the job's ranks and its metrics; ticks between reports confirm nothing; and it
// is named no longer once it has been back as long.
TEST_F(CoordinatorTest, AStragglerIsNamedOnceAndReleasedWhenItCatchesUp) {
  Connect("a");
  Connect("b");
  std::string id = coordinator_->Submit(kRecipe, "unit.yaml")->id();
  int64_t seq = 0;
  auto beat = [&](int64_t step, double slow_ms, int steps) {
    ++seq;
    for (int rank = 0; rank < 4; ++rank) {
      v1::RankProgress report = Report(id, rank, seq, step);
      report.mutable_completed()->set_compute_ms(rank == 3 ? slow_ms : 100.0);
      report.mutable_completed()->set_compute_steps(steps);
      report.mutable_completed()->set_compute_spread_ms(rank == 3 ? 3.0 : 2.0);
      ASSERT_TRUE(coordinator_->Heartbeat(BeatWith(rank < 2 ? "a" : "b", report)).ok());
    }
    coordinator_->Tick();
    coordinator_->Tick();
  };
  beat(9, 150, kStragglerWindow - 1);
  beat(10, 150, kStragglerWindow);
  for (int i = 0; i < 5; ++i) coordinator_->Tick();
  EXPECT_TRUE(Events(id, "straggler").empty()) << "a step seen again confirms nothing";
  beat(12, 150, kStragglerWindow);
  EXPECT_TRUE(Events(id, "straggler").empty()) << "not before kStragglerConfirmSteps steps above";
  beat(10 + kStragglerConfirmSteps, 155, kStragglerWindow);
  std::vector<v1::Event> events = Events(id, "straggler");
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].rank(), 3);
  EXPECT_NE(events[0].message().find("rank 3 on b is a straggler at step " + std::to_string(10 + kStragglerConfirmSteps) +
                                     ": 150.0 ms of its own work a step at best over its last 60 steps (medians of "
                                     "10), 1.50x the other ranks' median of 100.0 ms"),
            std::string::npos)
      << events[0].message();
  v1::Job job = *coordinator_->GetJob(id);
  EXPECT_TRUE(job.ranks(3).straggler());
  EXPECT_DOUBLE_EQ(job.ranks(3).compute_ms(), 155);
  EXPECT_FALSE(job.ranks(0).straggler());

  beat(16, 115, kStragglerWindow);  // under 1.2x, above the 1.1x it must come under
  beat(30, 115, kStragglerWindow);
  EXPECT_EQ(Events(id, "straggler").size(), 1u);
  beat(31, 105, kStragglerWindow);
  EXPECT_EQ(Events(id, "straggler").size(), 1u) << "back for one step only";
  beat(31 + kStragglerConfirmSteps, 105, kStragglerWindow);
  events = Events(id, "straggler");
  ASSERT_EQ(events.size(), 2u);
  EXPECT_EQ(events[1].message(), "rank 3 on b is no longer a straggler");
  EXPECT_FALSE(coordinator_->GetJob(id)->ranks(3).straggler());
}

TEST_F(CoordinatorTest, CommitComesFromTheProgressReportSentAheadOfItsLine) {
  Connect("a");
  Connect("b");
  std::string id = coordinator_->Submit(kRecipe, "unit.yaml")->id();
  ASSERT_TRUE(coordinator_->ReportProgress(Urgent("a", Committed(Report(id, 0, 3, 2), 2))).ok());
  v1::Job job = *coordinator_->GetJob(id);
  EXPECT_EQ(job.last_committed_step(), 2);
  EXPECT_EQ(job.last_committed_path(), "/ck/step-2");
  EXPECT_EQ(job.last_step(), 2);
  std::vector<v1::Event> commits = Events(id, "checkpoint");
  ASSERT_EQ(commits.size(), 1u);
  EXPECT_EQ(commits[0].message(), "checkpoint of step 2 committed: /ck/step-2");
  EXPECT_EQ(commits[0].rank(), 0);

  // Heartbeats go on carrying the same commit: it is recorded once.
  ASSERT_TRUE(coordinator_->Heartbeat(BeatWith("a", Committed(Report(id, 0, 4, 3), 2))).ok());
  EXPECT_EQ(Events(id, "checkpoint").size(), 1u);
  EXPECT_EQ(coordinator_->GetJob(id)->last_step(), 3);
}

// After the coordinator was away, the agent's heartbeat (rank 0's newest report) can come before the
// ordered reports of the commits made meanwhile: every commit still reaches the ledger, once, and
// the newest stays the job's last.
TEST_F(CoordinatorTest, CommitsReportedAfterANewerOneStillReachTheLedger) {
  Connect("a");
  Connect("b");
  std::string id = coordinator_->Submit(kRecipe, "unit.yaml")->id();
  ASSERT_TRUE(coordinator_->ReportProgress(Urgent("a", Committed(Report(id, 0, 1, 1), 1))).ok());
  ASSERT_TRUE(coordinator_->Heartbeat(BeatWith("a", Committed(Report(id, 0, 9, 4), 4))).ok());
  ASSERT_TRUE(coordinator_->ReportProgress(Urgent("a", Committed(Report(id, 0, 3, 2), 2))).ok());
  ASSERT_TRUE(coordinator_->ReportProgress(Urgent("a", Committed(Report(id, 0, 5, 3), 3))).ok());
  ASSERT_TRUE(coordinator_->ReportProgress(Urgent("a", Committed(Report(id, 0, 9, 4), 4))).ok());
  v1::Job job = *coordinator_->GetJob(id);
  EXPECT_EQ(job.last_committed_step(), 4);
  EXPECT_EQ(job.last_committed_path(), "/ck/step-4");
  EXPECT_EQ(job.last_step(), 4) << "the older reports changed nothing else";
  std::vector<std::string> messages;
  for (const auto& event : Events(id, "checkpoint")) messages.push_back(event.message());
  EXPECT_EQ(messages, (std::vector<std::string>{"checkpoint of step 1 committed: /ck/step-1",
                                                "checkpoint of step 4 committed: /ck/step-4",
                                                "checkpoint of step 2 committed: /ck/step-2 (reported after step 4's)",
                                                "checkpoint of step 3 committed: /ck/step-3 (reported after step 4's)"}));

  // A coordinator that takes the job back records what comes after the state's last commit only.
  coordinator_ = std::make_unique<Coordinator>(store_.get(), &clock_, CoordinatorOptions());
  ASSERT_TRUE(coordinator_->Recover().ok());
  Connect("a");
  ASSERT_TRUE(coordinator_->ReportProgress(Urgent("a", Committed(Report(id, 0, 3, 2), 2))).ok());
  ASSERT_TRUE(coordinator_->Heartbeat(BeatWith("a", Committed(Report(id, 0, 12, 5), 5))).ok());
  EXPECT_EQ(coordinator_->GetJob(id)->last_committed_step(), 5);
  std::vector<v1::Event> after = Events(id, "checkpoint");
  ASSERT_EQ(after.size(), 5u);
  EXPECT_EQ(after.back().message(), "checkpoint of step 5 committed: /ck/step-5");
}

TEST_F(CoordinatorTest, ExitReportsProgressIsAppliedBeforeTheExit) {
  Connect("a");
  Connect("b");
  std::string id = coordinator_->Submit(kRecipe, "unit.yaml")->id();
  ASSERT_TRUE(coordinator_->Heartbeat(BeatWith("a", Committed(Report(id, 0, 1, 3), 3))).ok());
  for (int rank = 1; rank < 4; ++rank) ASSERT_TRUE(coordinator_->ReportWorkerState(Exit(id, rank, 0)).ok());
  // Rank 0 completed and committed the last step and exited before any heartbeat told.
  v1::WorkerStateReport last = Exit(id, 0, 0);
  *last.mutable_progress() = Committed(Report(id, 0, 9, 5), 5);
  ASSERT_TRUE(coordinator_->ReportWorkerState(last).ok());
  v1::Job job = *coordinator_->GetJob(id);
  EXPECT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED);
  EXPECT_EQ(job.last_step(), 5);
  EXPECT_EQ(job.last_committed_step(), 5);
  EXPECT_EQ(job.last_committed_path(), "/ck/step-5");
  EXPECT_DOUBLE_EQ(job.eta_s(), 0);
  coordinator_->FlushState();
  EXPECT_EQ(store_->GetJob(id)->last_committed_step(), 5);

  // A failing rank's last commit is kept too.
  std::string other = coordinator_->Submit(kRecipe, "unit.yaml")->id();
  v1::WorkerStateReport crash = Exit(other, 0, 0, 9);
  *crash.mutable_progress() = Committed(Report(other, 0, 4, 2), 2);
  ASSERT_TRUE(coordinator_->ReportWorkerState(crash).ok());
  job = *coordinator_->GetJob(other);
  EXPECT_EQ(job.state(), v1::JOB_STATE_FAILED);
  EXPECT_EQ(job.last_committed_step(), 2);
}

TEST_F(CoordinatorTest, FailedRankRestartsAsANewGenerationAfterTheBackoff) {
  Connect("a");
  Connect("b");
  std::string id = coordinator_->Submit(kRestartingRecipe, "unit.yaml")->id();
  coordinator_->WaitCommand("a", 0);
  coordinator_->WaitCommand("b", 0);
  ASSERT_TRUE(coordinator_->ReportWorkerState(Exit(id, 1, 0, 9)).ok());
  v1::Job job = *coordinator_->GetJob(id);
  EXPECT_EQ(job.state(), v1::JOB_STATE_RESTARTING);
  EXPECT_EQ(job.restarts(), 1);
  EXPECT_NE(job.last_failure().find("rank 1 on a was killed by signal SIGKILL"), std::string::npos);
  std::optional<v1::Command> stop = coordinator_->WaitCommand("a", 0);
  ASSERT_TRUE(stop && stop->has_stop());
  EXPECT_EQ(stop->stop().generation(), 0);

  clock_.AdvanceMs(900);
  coordinator_->Tick();
  EXPECT_EQ(coordinator_->GetJob(id)->state(), v1::JOB_STATE_RESTARTING) << "the backoff is 1 s";
  clock_.AdvanceMs(200);
  ASSERT_TRUE(coordinator_->Heartbeat(Beat("a")).ok());
  ASSERT_TRUE(coordinator_->Heartbeat(Beat("b")).ok());
  coordinator_->Tick();
  job = *coordinator_->GetJob(id);
  EXPECT_EQ(job.state(), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(job.generation(), 1);
  coordinator_->WaitCommand("b", 0);  // b's stop
  std::optional<v1::Command> start = coordinator_->WaitCommand("a", 0);
  ASSERT_TRUE(start && start->has_start());
  EXPECT_EQ(start->start().generation(), 1);
  EXPECT_EQ(start->start().rendezvous_scope(), id + "/1/");

  // A report of the old generation changes nothing.
  v1::WorkerStateReport stale = Exit(id, 2, 0, 15);
  stale.set_generation(0);
  ASSERT_TRUE(coordinator_->ReportWorkerState(stale).ok());
  EXPECT_EQ(coordinator_->GetJob(id)->state(), v1::JOB_STATE_RUNNING);

  // Generation 1 finishes.
  for (int rank = 0; rank < 4; ++rank) {
    v1::WorkerStateReport done = Exit(id, rank, 0);
    done.set_generation(1);
    ASSERT_TRUE(coordinator_->ReportWorkerState(done).ok());
  }
  EXPECT_EQ(coordinator_->GetJob(id)->state(), v1::JOB_STATE_SUCCEEDED);
}

// A restart is placed "resuming from the checkpoint of step 4" (the newest commit recorded); rank 0
// reports the step it loaded, and where that is another, the job's events say which and why.
TEST_F(CoordinatorTest, AResumeFromAnotherCommitThanTheAnnouncedOneIsSaid) {
  Connect("a");
  Connect("b");
  std::string id = coordinator_->Submit(kRestartingRecipe, "unit.yaml")->id();
  for (int64_t step : {2, 4}) {
    ASSERT_TRUE(coordinator_->ReportProgress(Urgent("a", Committed(Report(id, 0, step, step), step))).ok());
  }
  for (int generation : {0, 1}) {
    v1::WorkerStateReport crash = Exit(id, 1, 0, 9);
    crash.set_generation(generation);
    ASSERT_TRUE(coordinator_->ReportWorkerState(crash).ok());
    clock_.AdvanceMs(1500);
    ASSERT_TRUE(coordinator_->Heartbeat(Beat("a")).ok());
    ASSERT_TRUE(coordinator_->Heartbeat(Beat("b")).ok());
    coordinator_->Tick();
    ASSERT_EQ(coordinator_->GetJob(id)->generation(), generation + 1);
    // Generation 1 finds step 4's checkpoint corrupt and loads step 2's; generation 2 loads step 4's
    // (re-committed by generation 1), as announced. A rank 0 that resumed reports the loaded step as
    // its commit.
    v1::RankProgress loaded = Committed(Report(id, 0, 1), generation == 0 ? 2 : 4);
    loaded.set_generation(generation + 1);
    loaded.set_load_step(loaded.committed_step());
    loaded.set_load_ms(5);
    ASSERT_TRUE(coordinator_->Heartbeat(BeatWith("a", loaded)).ok());
    if (generation == 0) {
      v1::Job job = *coordinator_->GetJob(id);
      EXPECT_EQ(job.last_committed_step(), 2) << "step 4's commit did not load";
      EXPECT_EQ(job.last_committed_path(), "/ck/step-2");
      // Step 4 committed again is recorded and said again.
      v1::RankProgress again = Committed(Report(id, 0, 3, 4), 4);
      again.set_generation(1);
      ASSERT_TRUE(coordinator_->ReportProgress(Urgent("a", again)).ok());
      EXPECT_EQ(coordinator_->GetJob(id)->last_committed_step(), 4);
    }
    loaded.set_seq(9);
    ASSERT_TRUE(coordinator_->Heartbeat(BeatWith("a", loaded)).ok());
  }
  EXPECT_EQ(Events(id, "checkpoint").size(), 3u) << "steps 2 and 4, then step 4 again";
  std::vector<v1::Event> loaded = Events(id, "loaded");
  ASSERT_EQ(loaded.size(), 1u);
  EXPECT_EQ(loaded[0].message(),
            "the ranks resumed from the checkpoint of step 2, not step 4's: step 4's did not load (rank 0's log says why)");

  // A coordinator that takes the running generation back has announced nothing: the load it hears of
  // (step 4's, before the commit of step 5) is not held against the state's newest commit.
  v1::RankProgress five = Committed(Report(id, 0, 20, 5), 5);
  five.set_generation(2);
  ASSERT_TRUE(coordinator_->ReportProgress(Urgent("a", five)).ok());
  coordinator_->FlushState();
  coordinator_ = std::make_unique<Coordinator>(store_.get(), &clock_, CoordinatorOptions());
  ASSERT_TRUE(coordinator_->Recover().ok());
  Connect("a");
  v1::RankProgress later = Committed(Report(id, 0, 21, 5), 5);
  later.set_generation(2);
  later.set_load_step(4);
  later.set_load_ms(5);
  ASSERT_TRUE(coordinator_->Heartbeat(BeatWith("a", later)).ok());
  EXPECT_EQ(coordinator_->GetJob(id)->last_committed_step(), 5);
  for (const v1::Event& event : Events(id, "loaded")) {
    EXPECT_EQ(event.message().find("not step 5's"), std::string::npos) << event.message();
  }
}

TEST_F(CoordinatorTest, RestartsRunOutThenTheJobFails) {
  Connect("a");
  Connect("b");
  std::string id = coordinator_->Submit(kRestartingRecipe, "unit.yaml")->id();
  for (int generation = 0; generation < 3; ++generation) {
    v1::WorkerStateReport crash = Exit(id, 0, 1);
    crash.set_generation(generation);
    ASSERT_TRUE(coordinator_->ReportWorkerState(crash).ok());
    clock_.AdvanceMs(1500);  // 1 s, then 1.5 s (capped)
    ASSERT_TRUE(coordinator_->Heartbeat(Beat("a")).ok());
    ASSERT_TRUE(coordinator_->Heartbeat(Beat("b")).ok());
    coordinator_->Tick();
  }
  v1::Job job = *coordinator_->GetJob(id);
  EXPECT_EQ(job.state(), v1::JOB_STATE_FAILED);
  EXPECT_EQ(job.restarts(), 2);
  EXPECT_NE(job.cause().find("failed 3 times, giving up after 2 restart(s)"), std::string::npos) << job.cause();
  for (int generation = 0; generation < 3; ++generation) {
    EXPECT_NE(job.cause().find("generation " + std::to_string(generation) + ": rank 0 on a exited with code 1"),
              std::string::npos)
        << job.cause();
  }
}

// A worker that refused to start (exit code 3: another job's checkpoint directory) fails the job
// at once, whatever fault.max_restarts says: a restart would be refused again.
TEST_F(CoordinatorTest, AWorkerThatRefusesToStartFailsTheJobWithoutRestarts) {
  Connect("a");
  Connect("b");
  std::string id = coordinator_->Submit(kRestartingRecipe, "unit.yaml")->id();
  ASSERT_TRUE(coordinator_->ReportWorkerState(Exit(id, 0, kWorkerExitNoRestart)).ok());
  v1::Job job = *coordinator_->GetJob(id);
  EXPECT_EQ(job.state(), v1::JOB_STATE_FAILED);
  EXPECT_EQ(job.restarts(), 0);
  EXPECT_NE(job.cause().find("rank 0 on a exited with code 3"), std::string::npos) << job.cause();
}

constexpr const char* kRestartingProgram = R"(name: unit
entrypoint: {command: [/bin/false]}
parallel: {nodes: {min: 1, max: 2}, nproc_per_node: 2}
fault: {max_restarts: 2, restart_backoff_s: 1, restart_backoff_max_s: 1.5, hang_timeout_s: 10}
)";

// A program of the user's own (entrypoint.command) that exits with code 3 restarts as with any other code;
// only ltrain's worker, or the agent refusing the start command, means "a restart would be refused".
TEST_F(CoordinatorTest, AUsersProgramExitingWithThreeRestarts) {
  Connect("a");
  Connect("b");
  const std::string program = kRestartingProgram;
  StatusOr<v1::Job> submitted = coordinator_->Submit(program, "unit.yaml");
  ASSERT_TRUE(submitted.ok()) << submitted.status().message();
  const std::string id = submitted->id();
  ASSERT_TRUE(coordinator_->ReportWorkerState(Exit(id, 0, kWorkerExitNoRestart)).ok());
  v1::Job job = *coordinator_->GetJob(id);
  EXPECT_EQ(job.state(), v1::JOB_STATE_RESTARTING) << job.cause();
  EXPECT_EQ(job.restarts(), 1);
}

TEST_F(CoordinatorTest, AnAgentsRefusalOfAProgramFailsTheJobWithoutRestarts) {
  Connect("a");
  Connect("b");
  const std::string program = kRestartingProgram;
  StatusOr<v1::Job> submitted = coordinator_->Submit(program, "unit.yaml");
  ASSERT_TRUE(submitted.ok()) << submitted.status().message();
  const std::string id = submitted->id();
  v1::WorkerStateReport refusal = Exit(id, 0, kWorkerExitNoRestart);
  refusal.set_refused(true);
  ASSERT_TRUE(coordinator_->ReportWorkerState(refusal).ok());
  v1::Job job = *coordinator_->GetJob(id);
  EXPECT_EQ(job.state(), v1::JOB_STATE_FAILED);
  EXPECT_EQ(job.restarts(), 0);
}

// One rank refuses to start (missing data, exit code 3) while its peer is still connecting: the peer's
// connection error may reach the coordinator first and schedule a restart. The refusal, arriving
// during the backoff, ends the job instead: a restart would be refused again.
TEST_F(CoordinatorTest, ARefusalArrivingDuringTheBackoffFailsTheJobInsteadOfRestarting) {
  Connect("a");
  Connect("b");
  std::string id = coordinator_->Submit(kRestartingRecipe, "unit.yaml")->id();
  ASSERT_TRUE(coordinator_->ReportWorkerState(Exit(id, 0, 1)).ok());
  ASSERT_EQ(coordinator_->GetJob(id)->state(), v1::JOB_STATE_RESTARTING);
  ASSERT_TRUE(coordinator_->ReportWorkerState(Exit(id, 1, kWorkerExitNoRestart)).ok());
  v1::Job job = *coordinator_->GetJob(id);
  EXPECT_EQ(job.state(), v1::JOB_STATE_FAILED);
  EXPECT_EQ(job.restarts(), 0);
  EXPECT_NE(job.cause().find("a rank refused to start, and a restart would meet the same refusal"), std::string::npos)
      << job.cause();
  EXPECT_NE(job.cause().find("generation 0: rank 0 on a exited with code 1"), std::string::npos) << job.cause();
  EXPECT_NE(job.cause().find("generation 0: rank 1 on a exited with code 3"), std::string::npos) << job.cause();
  // The backoff passing starts nothing.
  clock_.AdvanceMs(2000);
  ASSERT_TRUE(coordinator_->Heartbeat(Beat("a")).ok());
  ASSERT_TRUE(coordinator_->Heartbeat(Beat("b")).ok());
  coordinator_->Tick();
  job = *coordinator_->GetJob(id);
  EXPECT_EQ(job.state(), v1::JOB_STATE_FAILED);
  EXPECT_EQ(job.generation(), 0);
}

TEST_F(CoordinatorTest, LostNodeShrinksAnElasticJobAndANewNodeJoinsAtTheNextCheckpoint) {
  Connect("a");
  Connect("b");
  std::string id = coordinator_->Submit(kRestartingRecipe, "unit.yaml")->id();
  EXPECT_EQ(coordinator_->GetJob(id)->world_size(), 4);
  clock_.AdvanceMs(2000);
  ASSERT_TRUE(coordinator_->Heartbeat(Beat("a")).ok());
  clock_.AdvanceMs(1500);
  coordinator_->Tick();  // b silent for 3.5 s
  EXPECT_EQ(coordinator_->GetJob(id)->state(), v1::JOB_STATE_RESTARTING);
  EXPECT_NE(coordinator_->GetJob(id)->last_failure().find("node b lost"), std::string::npos);
  clock_.AdvanceMs(1000);
  ASSERT_TRUE(coordinator_->Heartbeat(Beat("a")).ok());
  coordinator_->Tick();
  v1::Job job = *coordinator_->GetJob(id);
  EXPECT_EQ(job.state(), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(job.nodes_now(), 1);
  EXPECT_EQ(job.world_size(), 2);
  while (std::optional<v1::Command> c = coordinator_->WaitCommand("a", 0)) {
    if (c->has_start() && c->start().generation() == 1) {
      RecipeParseResult recipe = ParseRecipe(c->start().recipe_yaml(), "gen1");
      ASSERT_TRUE(recipe.ok()) << recipe.ErrorText();
      EXPECT_EQ(recipe.recipe.parallel.nodes, 1);
      EXPECT_EQ(recipe.recipe.training.global_batch, 4) << "the global batch is kept";
      EXPECT_EQ(recipe.recipe.accumulation_steps(), 2);
    }
  }

  Connect("c");  // a new node: taken in only at the next checkpoint
  coordinator_->Tick();
  EXPECT_EQ(coordinator_->GetJob(id)->generation(), 1);
  v1::HeartbeatRequest beat = Beat("a");
  v1::RankProgress* progress = beat.add_progress();
  progress->set_job_id(id);
  progress->set_generation(1);
  progress->set_rank(0);
  progress->set_step(3);
  progress->set_phase("forward");
  progress->set_committed_step(2);
  progress->set_committed_path("/ckpt/step-2");
  ASSERT_TRUE(coordinator_->Heartbeat(beat).ok());
  coordinator_->Tick();
  job = *coordinator_->GetJob(id);
  EXPECT_EQ(job.last_committed_step(), 2);
  EXPECT_EQ(job.generation(), 2);
  EXPECT_EQ(job.nodes_now(), 2);
  EXPECT_EQ(job.world_size(), 4);
  EXPECT_EQ(job.restarts(), 1) << "growing is not a failure";
}

TEST_F(CoordinatorTest, HangIsDetectedAndNamesTheRankThatIsBehind) {
  Connect("a");
  Connect("b");
  std::string id = coordinator_->Submit(kRestartingRecipe, "unit.yaml")->id();
  auto beat = [&](const std::string& node, int first_rank, bool rank3_silent) {
    v1::HeartbeatRequest request = Beat(node);
    for (int rank = first_rank; rank < first_rank + 2; ++rank) {
      if (rank == 3 && rank3_silent) continue;
      v1::RankProgress* p = request.add_progress();
      p->set_job_id(id);
      p->set_rank(rank);
      p->set_step(812);
      p->set_phase(rank == 3 ? "backward" : "optimizer");
      p->set_idle_ms(0);
      if (rank != 3) {
        v1::CollectiveRecord* c = p->add_collectives();
        c->set_seq(1234);
        c->set_op("all_reduce");
        c->set_group("dp 0");
      }
    }
    ASSERT_TRUE(coordinator_->Heartbeat(request).ok());
  };
  beat("a", 0, false);
  beat("b", 2, false);
  for (int second = 0; second < 9; ++second) {
    clock_.AdvanceMs(1000);
    beat("a", 0, false);
    beat("b", 2, true);  // rank 3 stopped reporting; the others report, idle in their all-reduce
    coordinator_->Tick();
  }
  EXPECT_EQ(coordinator_->GetJob(id)->state(), v1::JOB_STATE_RUNNING) << "9 s < hang_timeout 10 s";
  clock_.AdvanceMs(1000);
  beat("a", 0, false);
  beat("b", 2, true);
  coordinator_->Tick();
  v1::Job job = *coordinator_->GetJob(id);
  EXPECT_EQ(job.state(), v1::JOB_STATE_RESTARTING);
  EXPECT_EQ(job.last_failure(), "hang: rank 3 made no progress for 10s in step 812 (backward); ranks 0-2 wait in "
                                "all_reduce #1234 of dp 0; limit fault.hang_timeout_s=10");
}

TEST_F(CoordinatorTest, RecoveredCoordinatorTakesBackARunningJob) {
  Connect("a");
  Connect("b");
  std::string id = coordinator_->Submit(kRestartingRecipe, "unit.yaml")->id();
  for (int rank = 0; rank < 4; ++rank) ASSERT_TRUE(coordinator_->ReportWorkerState(Running(id, rank)).ok());
  // The coordinator dies; a new one starts on the same state.
  CoordinatorOptions options;
  options.state_dir = "/state";
  options.recovery_grace_ms = 5000;
  coordinator_ = std::make_unique<Coordinator>(store_.get(), &clock_, options);
  ASSERT_TRUE(coordinator_->Recover().ok());
  EXPECT_EQ(coordinator_->GetJob(id)->state(), v1::JOB_STATE_RUNNING);
  v1::RunningWorker worker;
  worker.set_job_id(id);
  worker.set_generation(0);
  coordinator_->NodeConnected("a", v1::NodeFacts(), {worker});
  coordinator_->NodeConnected("b", v1::NodeFacts(), {worker});
  clock_.AdvanceMs(6000);
  ASSERT_TRUE(coordinator_->Heartbeat(Beat("a")).ok());
  ASSERT_TRUE(coordinator_->Heartbeat(Beat("b")).ok());
  coordinator_->Tick();
  EXPECT_EQ(coordinator_->GetJob(id)->state(), v1::JOB_STATE_RUNNING);
  for (int rank = 0; rank < 4; ++rank) ASSERT_TRUE(coordinator_->ReportWorkerState(Exit(id, rank, 0)).ok());
  EXPECT_EQ(coordinator_->GetJob(id)->state(), v1::JOB_STATE_SUCCEEDED);
}

TEST_F(CoordinatorTest, RecoveredJobWhoseNodesNeverComeBackRestartsElsewhere) {
  Connect("a");
  std::string id = coordinator_->Submit(kRestartingRecipe, "unit.yaml")->id();
  CoordinatorOptions options;
  options.state_dir = "/state";
  options.recovery_grace_ms = 5000;
  coordinator_ = std::make_unique<Coordinator>(store_.get(), &clock_, options);
  ASSERT_TRUE(coordinator_->Recover().ok());
  coordinator_->NodeConnected("z", v1::NodeFacts());
  for (int i = 0; i < 7; ++i) {
    clock_.AdvanceMs(1000);
    ASSERT_TRUE(coordinator_->Heartbeat(Beat("z")).ok());
    coordinator_->Tick();
  }
  v1::Job job = *coordinator_->GetJob(id);
  EXPECT_EQ(job.state(), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(job.generation(), 1);
  EXPECT_NE(job.last_failure().find("did not come back"), std::string::npos) << job.last_failure();
}

TEST_F(CoordinatorTest, ResumeStartsAStoppedJobAsANewGeneration) {
  Connect("a");
  Connect("b");
  std::string id = coordinator_->Submit(kRecipe, "unit.yaml")->id();
  ASSERT_TRUE(coordinator_->Stop(id, "").ok());
  EXPECT_FALSE(coordinator_->Resume("nope").ok());
  int64_t resumed_seq = 0;
  StatusOr<v1::Job> resumed = coordinator_->Resume(id, &resumed_seq);
  ASSERT_TRUE(resumed.ok()) << resumed.status().ToString();
  v1::Job job = *coordinator_->GetJob(id);
  EXPECT_EQ(job.state(), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(job.generation(), 1);
  EXPECT_FALSE(coordinator_->Resume(id).ok()) << "a running job cannot be resumed";
  // A follower of the resume starts at it: the earlier "job STOPPED" is not shown again.
  bool finished = false;
  std::vector<v1::Event> events = *coordinator_->WaitEvents(id, resumed_seq - 1, false, 0, &finished);
  ASSERT_FALSE(events.empty());
  EXPECT_EQ(events.front().kind(), "resumed");
  for (const auto& event : events) EXPECT_NE(event.kind(), "state") << event.message();
}

}  // namespace
}  // namespace ltrain::launcher
