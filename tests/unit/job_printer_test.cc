// What `ltrain list`, `ltrain status`, `ltrain logs` and a followed launch print, character for
// character: the expected texts are those the commands have always printed.
#include "cmd/job_printer.h"

#include <gtest/gtest.h>

namespace ltrain::cli {
namespace {

constexpr int64_t kNow = 1'700'000'000'000;

// The cause of a rank that exited, as the coordinator writes it: a summary, then the log's last lines.
constexpr const char* kExitCause =
    "rank 0 on local exited with code 3; last lines of its log (/home/u/.ltrain/agent-local/jobs/r-1/gen-0/rank-0.log):\n"
    "    fake worker starting\n"
    "    something broke";

v1::Job FailedJob() {
  v1::Job job;
  job.set_id("r-1");
  job.set_state(v1::JOB_STATE_FAILED);
  job.set_world_size(1);
  job.set_nodes_now(1);
  job.set_created_unix_ms(kNow - 400);
  job.set_cause(kExitCause);
  job.set_last_failure(kExitCause);
  v1::RankInfo* rank = job.add_ranks();
  rank->set_rank(0);
  rank->set_node_id("local");
  rank->set_pid(17200);
  rank->set_state("exited");
  rank->set_exit_code(3);
  rank->set_log_path("/home/u/.ltrain/agent-local/jobs/r-1/gen-0/rank-0.log");
  return job;
}

v1::Job RunningJob() {
  v1::Job job;
  job.set_id("gpt-7");
  job.set_state(v1::JOB_STATE_RUNNING);
  job.set_world_size(4);
  job.set_nodes_now(2);
  job.set_generation(1);
  job.set_restarts(1);
  job.set_created_unix_ms(kNow - 5'000);
  job.set_last_step(120);
  job.set_total_steps(1000);
  job.set_last_loss(3.14159);
  job.set_tokens_per_s(12345.6);
  job.set_eta_s(3725.4);
  job.set_last_committed_step(100);
  job.set_last_committed_path("/ckpt/gpt-7/step-100");
  job.set_last_failure("rank 2 on b exited with code 1");
  v1::NodeStatus* a = job.add_nodes();
  a->set_node_id("a");
  a->set_hostname("host-a");
  a->set_connected(true);
  a->set_heartbeat_age_ms(300);
  v1::NodeStatus* b = job.add_nodes();
  b->set_node_id("b");
  b->set_hostname("host-b");
  b->set_connected(false);
  b->set_heartbeat_age_ms(4000);
  v1::RankInfo* r0 = job.add_ranks();
  r0->set_rank(0);
  r0->set_node_id("a");
  r0->set_pid(1000);
  r0->set_state("running");
  r0->set_last_step(120);
  r0->set_phase("checkpoint");
  r0->set_progress_age_ms(300);
  r0->set_work("saving checkpoint step-120, 8.0 of 15.8 GB");
  r0->set_log_path("/logs/rank-0.log");
  v1::RankInfo* r1 = job.add_ranks();
  r1->set_rank(1);
  r1->set_node_id("b");
  r1->set_pid(2000);
  r1->set_state("killed");
  r1->set_signal(9);
  r1->set_last_step(118);
  r1->set_log_path("/logs/rank-1.log");
  return job;
}

v1::Event LogLine(int64_t seq, int64_t unix_ms, int rank, const std::string& text) {
  v1::Event event;
  event.set_seq(seq);
  event.set_job_id("j-1");
  event.set_unix_ms(unix_ms);
  event.set_kind("log");
  event.set_rank(rank);
  event.set_message(text);
  return event;
}

TEST(JobPrinterTest, AgesCountInTheLargestWholeUnit) {
  EXPECT_EQ(FormatAge(kNow, kNow), "0s ago");
  EXPECT_EQ(FormatAge(kNow - 5'999, kNow), "5s ago");
  EXPECT_EQ(FormatAge(kNow - 119'000, kNow), "119s ago");
  EXPECT_EQ(FormatAge(kNow - 120'000, kNow), "2m ago");
  EXPECT_EQ(FormatAge(kNow - 7'199'000, kNow), "119m ago");
  EXPECT_EQ(FormatAge(kNow - 7'200'000, kNow), "2h ago");
  EXPECT_EQ(FormatAge(kNow - 172'800'000, kNow), "2d ago");
}

TEST(JobPrinterTest, FirstLineCutsToTheWidthWithAnEllipsis) {
  EXPECT_EQ(FirstLine("short\nsecond", 60), "short");
  EXPECT_EQ(FirstLine("abcdefghij", 10), "abcdefghij");
  EXPECT_EQ(FirstLine("abcdefghijk", 10), "abcdefg...");
}

TEST(JobPrinterTest, EmptyJobTableSaysHowToStartOne) {
  EXPECT_EQ(FormatJobTable({}, kNow), "no jobs yet; start one with `ltrain launch RECIPE`\n");
}

TEST(JobPrinterTest, JobTableHasOneLinePerJobAndCutsTheCauseToOneLine) {
  v1::Job running = RunningJob();
  running.set_created_unix_ms(kNow - 3 * 3600 * 1000);
  EXPECT_EQ(FormatJobTable({running, FailedJob()}, kNow),
            "JOB                          STATE      RANKS     STEP       LOSS CREATED    CAUSE\n"
            "gpt-7                        RUNNING        4      120     3.1416 3h ago     \n"
            "r-1                          FAILED         1        0          - 0s ago     "
            "rank 0 on local exited with code 3; last lines of its log...\n");
}

TEST(JobPrinterTest, RunningJobDetailShowsProgressNodesAndRanks) {
  EXPECT_EQ(FormatJobDetail(RunningJob(), kNow),
            "job:            gpt-7\n"
            "state:          RUNNING\n"
            "created:        5s ago\n"
            "generation:     1 (restarts: 1)\n"
            "ranks:          4 on 2 node(s)\n"
            "step:           120/1000\n"
            "loss:           3.1416\n"
            "tokens/s:       12346\n"
            "eta:            1h02m05s\n"
            "last committed: step 100 (/ckpt/gpt-7/step-100)\n"
            "last failure:   rank 2 on b exited with code 1\n"
            "\n"
            "NODE           HOST                 CONNECTED  HEARTBEAT\n"
            "a              host-a               yes        0.3s ago\n"
            "b              host-b               no         4.0s ago\n"
            "\n"
            " RANK NODE                PID STATE     EXIT     STEP PHASE        PROGRESS  LOG\n"
            "    0 a                  1000 running      -      120 checkpoint   0.3s ago  /logs/rank-0.log\n"
            "    1 b                  2000 killed   SIGKILL      118 -                   -  /logs/rank-1.log\n"
            "rank 0: saving checkpoint step-120, 8.0 of 15.8 GB\n");
}

// model.moe: the worst block's load, the blocks' mean, the router's losses where computed.
TEST(JobPrinterTest, MoeFiguresShowTheLoadAndTheRoutersLosses) {
  v1::Job job = RunningJob();
  v1::MoeFigures* f = job.mutable_moe();
  f->set_load_max(1.4244);
  f->set_worst_layer(11);
  f->set_load_mean(1.18);
  f->set_aux_loss(1.034);
  f->set_z_loss(-1);
  f->set_drop_rate(-1);
  for (int l : {1, 3, 5, 7, 9, 11}) f->add_layers(l);
  std::string detail = FormatJobDetail(job, kNow);
  EXPECT_NE(detail.find("moe load:       busiest expert 1.42x an even share (block 11); 1.18x over the 6 MoE blocks; "
                        "balance loss 1.03\n"),
            std::string::npos)
      << detail;
  // model.moe.capacity_factor: the share of the assignments dropped.
  f->set_drop_rate(0.0125);
  detail = FormatJobDetail(job, kNow);
  EXPECT_NE(detail.find("balance loss 1.03; 1.25% of assignments dropped\n"), std::string::npos) << detail;
  EXPECT_EQ(FormatJobDetail(RunningJob(), kNow).find("moe"), std::string::npos) << "no MoE line without MoE";
}

// parallel.precision fp8: the amax range of each operand kind, and the overflows (none said as none).
TEST(JobPrinterTest, Fp8FiguresShowTheAmaxRangesAndTheOverflows) {
  v1::Job job = RunningJob();
  v1::Fp8Figures* f = job.mutable_fp8();
  f->set_activation_amax_max(41.5);
  f->set_activation_amax_min(0.75);
  f->set_weight_amax_max(0.5);
  f->set_weight_amax_min(0.0625);
  f->set_gradient_amax_max(0.00195);
  f->set_gradient_amax_min(1.5e-05);
  f->set_products(288);
  std::string detail = FormatJobDetail(job, kNow);
  EXPECT_NE(detail.find("fp8 amax:       activations 0.75 to 41.5, weights 0.0625 to 0.5, gradients 1.5e-05 to "
                        "0.00195 (288 operands)\n"
                        "fp8 overflows:  none\n"),
            std::string::npos)
      << detail;
  f->set_overflow_steps(3);
  f->set_last_overflow_step(117);
  detail = FormatJobDetail(job, kNow);
  EXPECT_NE(detail.find("fp8 overflows:  3 steps (the last: step 117)\n"), std::string::npos) << detail;
  EXPECT_EQ(FormatJobDetail(RunningJob(), kNow).find("fp8"), std::string::npos) << "no FP8 lines without FP8";
}

// `-o json`: an optional field that is not set is null, so that "no rank" never reads as rank 0.
TEST(JobPrinterTest, JsonWritesAnUnsetOptionalFieldAsNull) {
  v1::Job job = RunningJob();
  EXPECT_NE(FormatJson(job, false).find("\"replacing_rank\":null"), std::string::npos) << FormatJson(job, false);
  job.set_replacing_rank(0);
  EXPECT_NE(FormatJson(job, false).find("\"replacing_rank\":0"), std::string::npos) << FormatJson(job, false);
}

TEST(JobPrinterTest, InPlaceRecoveriesAreCountedWithTheWorkTheyLost) {
  v1::Job job = RunningJob();
  job.set_recoveries(2);
  job.set_lost_steps(1);
  job.set_last_recovery_ms(640);
  const std::string detail = FormatJobDetail(job, kNow);
  EXPECT_NE(detail.find("in place:       2 recoveries, work lost: 1 step; the last took 0.6 s (failure to next step)\n"),
            std::string::npos)
      << detail;
  EXPECT_EQ(FormatJobDetail(RunningJob(), kNow).find("in place:"), std::string::npos) << "none: no line";
}

TEST(JobPrinterTest, FailedJobDetailShowsTheWholeCauseOnce) {
  EXPECT_EQ(FormatJobDetail(FailedJob(), kNow),
            "job:            r-1\n"
            "state:          FAILED\n"
            "created:        0s ago\n"
            "generation:     0 (restarts: 0)\n"
            "ranks:          1 on 1 node(s)\n"
            "step:           0\n"
            "last committed: none yet\n"
            "cause:          rank 0 on local exited with code 3; last lines of its log "
            "(/home/u/.ltrain/agent-local/jobs/r-1/gen-0/rank-0.log):\n"
            "    fake worker starting\n"
            "    something broke\n"
            "\n"
            " RANK NODE                PID STATE     EXIT     STEP PHASE        PROGRESS  LOG\n"
            "    0 local             17200 exited       3        0 -                   -  "
            "/home/u/.ltrain/agent-local/jobs/r-1/gen-0/rank-0.log\n");
}

TEST(JobPrinterTest, TextLogLinesArePrefixedAndFoldedAcrossRanks) {
  std::vector<v1::Event> lines;
  for (int rank = 0; rank < 4; ++rank) lines.push_back(LogLine(rank + 1, 1000 + rank, rank, "NCCL ready"));
  lines.push_back(LogLine(5, 1010, 1, "step 1/10 loss 5.5"));
  lines.push_back(LogLine(6, 9000, 2, "NCCL ready"));  // outside the fold window: a line of its own
  EXPECT_EQ(FormatLogLines(lines, LogFormat::kText),
            "[ranks 0-3] NCCL ready\n"
            "[rank 1] step 1/10 loss 5.5\n"
            "[rank 2] NCCL ready\n");
  EXPECT_EQ(FormatLogLines({}, LogFormat::kText), "");
}

// What a worker prints reaches the terminal escaped: it cannot recolour, move the cursor or forge
// a line of its own; a failure's multi-line cause keeps its lines.
TEST(JobPrinterTest, WorkerOutputAndEventsAreEscapedForTheTerminal) {
  const std::string forged = "loss 1.0\r\x1b[31mFAKE\nltrain: job SUCCEEDED \xc2\x9b" "2J \xff caf\xc3\xa9\tok";
  EXPECT_EQ(FormatFollowedEvent(LogLine(1, 1000, 0, forged), false),
            "[rank 0] loss 1.0\\x0d\\x1b[31mFAKE\\x0altrain: job SUCCEEDED \\xc2\\x9b2J \\xff caf\xc3\xa9\tok\n");
  EXPECT_EQ(FormatLogLines({LogLine(2, 1000, 1, "\x1b]0;title\x07")}, LogFormat::kText), "[rank 1] \\x1b]0;title\\x07\n");
  v1::Event failed;
  failed.set_kind("state");
  failed.set_message("rank 1 failed; last lines of its log:\n    \x1b[2Kboom");
  EXPECT_EQ(FormatFollowedEvent(failed, false), "ltrain: rank 1 failed; last lines of its log:\n    \\x1b[2Kboom\n");
}

TEST(JobPrinterTest, JsonLogLinesAreOneCompactObjectEach) {
  EXPECT_EQ(FormatLogLines({LogLine(7, 1000, 0, "hello \"world\""), LogLine(8, 1001, 3, "bye")}, LogFormat::kJson),
            "{\"seq\":7,\"job_id\":\"j-1\",\"unix_ms\":1000,\"kind\":\"log\",\"message\":\"hello \\\"world\\\"\",\"rank\":0,"
            "\"state\":\"UNSPECIFIED\"}\n"
            "{\"seq\":8,\"job_id\":\"j-1\",\"unix_ms\":1001,\"kind\":\"log\",\"message\":\"bye\",\"rank\":3,"
            "\"state\":\"UNSPECIFIED\"}\n");
}

TEST(JobPrinterTest, FollowedEventsShowLogLinesUnlessQuiet) {
  v1::Event log = LogLine(1, 1000, 2, "step 3 loss 4.2");
  EXPECT_EQ(FormatFollowedEvent(log, false), "[rank 2] step 3 loss 4.2\n");
  EXPECT_EQ(FormatFollowedEvent(log, true), "");
  // Quiet still shows how training goes: rank 0's step lines.
  v1::Event step = LogLine(2, 1000, 0, "step 3/20 loss 4.2000 lr 1.0e-03");
  EXPECT_EQ(FormatFollowedEvent(step, true), "[rank 0] step 3/20 loss 4.2000 lr 1.0e-03\n");
  EXPECT_EQ(FormatFollowedEvent(LogLine(3, 1000, 0, "rank 0/2 up"), true), "");
  // The coordinator's marker of a new generation is for `ltrain logs`; a follower has the event.
  EXPECT_EQ(FormatFollowedEvent(LogLine(4, 1000, -1, "generation 1"), false), "");
  EXPECT_EQ(FormatLogLines({LogLine(4, 1000, -1, "generation 1 begins")}, LogFormat::kText),
            "---- generation 1 begins\n");

  v1::Event started;
  started.set_kind("rank_started");
  started.set_message("rank 0 started on local (pid 17200)");
  EXPECT_EQ(FormatFollowedEvent(started, false), "ltrain: rank 0 started on local (pid 17200)\n");
  EXPECT_EQ(FormatFollowedEvent(started, true), "");

  v1::Event state;
  state.set_kind("state");
  state.set_state(v1::JOB_STATE_FAILED);
  state.set_message("job FAILED: rank 0 on local exited with code 3");
  EXPECT_EQ(FormatFollowedEvent(state, true), "ltrain: job FAILED: rank 0 on local exited with code 3\n");
}

// A FAILED job's last line says how to go on: the resume command as it must be typed, from which
// commit, and the key that makes such failures restart by themselves.
TEST(JobPrinterTest, AFailedJobSaysHowToContinueIt) {
  v1::Job job = FailedJob();
  job.set_recipe_yaml("name: r\ndata: {path: /d}\n");
  job.set_last_committed_step(200);
  EXPECT_EQ(FormatContinueHint(job, ""),
            "ltrain: `ltrain resume r-1` continues it from its checkpoint of step 200; to have such failures restart "
            "it by themselves, set fault.max_restarts in the recipe\n");
  job.set_last_committed_step(0);
  EXPECT_EQ(FormatContinueHint(job, "head:7070"),
            "ltrain: `ltrain resume r-1 --coordinator head:7070` starts it again from the start (it committed no "
            "checkpoint); to have such failures restart it by themselves, set fault.max_restarts in the recipe\n");
  job.set_recipe_yaml("name: r\nentrypoint: {command: [python3, train.py]}\n");
  EXPECT_EQ(FormatContinueHint(job, ""),
            "ltrain: `ltrain resume r-1` starts the program again; to have such failures restart it by themselves, "
            "give `ltrain run` --max-restarts N\n");
}

}  // namespace
}  // namespace ltrain::cli
