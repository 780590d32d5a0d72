#include "agent/supervisor.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "agent/fake_process_spawner.h"
#include "agent/progress_table.h"

namespace ltrain::agent {
namespace {

namespace fs = std::filesystem;
using Signal = FakeProcessSpawner::SentSignal;

// Keeps what the supervisor sends, with the number of running workers it had announced by then.
class RecordingOutbox : public SupervisorOutbox {
 public:
  void Send(SupervisorMessage message) override {
    messages.push_back(std::move(message));
    running_when_sent.push_back(running.size());
  }
  void RunningChanged(const std::vector<v1::RunningWorker>& now_running) override { running = now_running; }

  // One line per message, in order: "logs j1: [0] a | [1] b", "j1 gen 1 rank 0 pid 1000 running".
  std::vector<std::string> Take() {
    std::vector<std::string> out;
    for (const auto& message : messages) {
      std::ostringstream line;
      if (const auto* logs = std::get_if<v1::PushLogsRequest>(&message)) {
        line << "logs " << logs->job_id() << ":";
        for (int i = 0; i < logs->lines_size(); ++i) {
          line << (i ? " |" : "") << " [" << logs->lines(i).rank() << "] " << logs->lines(i).text();
        }
      } else {
        const auto& report = std::get<v1::WorkerStateReport>(message);
        line << report.job_id() << " gen " << report.generation() << " rank " << report.rank() << " pid "
             << report.pid() << " " << report.state();
        if (report.state() == "exited") line << " " << report.exit_code();
        if (report.state() == "killed") line << " signal " << report.signal();
        if (report.oom_killed()) line << " oom";
      }
      out.push_back(line.str());
    }
    messages.clear();
    running_when_sent.clear();
    return out;
  }

  std::vector<v1::WorkerStateReport> Reports() const {
    std::vector<v1::WorkerStateReport> out;
    for (const auto& message : messages) {
      if (const auto* report = std::get_if<v1::WorkerStateReport>(&message)) out.push_back(*report);
    }
    return out;
  }

  std::vector<SupervisorMessage> messages;
  std::vector<size_t> running_when_sent;
  std::vector<v1::RunningWorker> running;
};

class SupervisorTest : public ::testing::Test {
 protected:
  SupervisorTest() {
    work_dir_ = ::testing::TempDir() + "/supervisor-" + ::testing::UnitTest::GetInstance()->current_test_info()->name();
    fs::remove_all(work_dir_);
    options_.node_id = "node-a";
    options_.work_dir = work_dir_;
    options_.worker_binary = "/opt/ltrain/ltrain-worker";
    options_.bind_address = "10.0.0.7";
    options_.agent_address = "127.0.0.1:4567";
    options_.stop_grace_ms = 3000;
    options_.read_oom_kill_count = [this] { return oom_kills_; };
  }
  ~SupervisorTest() override {
    supervisor_.reset();
    fs::remove_all(work_dir_);
  }

  Supervisor& supervisor() {
    if (!supervisor_) supervisor_ = std::make_unique<Supervisor>(options_, spawner_, clock_, outbox_);
    return *supervisor_;
  }

  // A start of `job` generation `generation` with ranks {first_rank, first_rank + 1, ...} here.
  static v1::StartJobCommand Start(const std::string& job, int generation, int ranks, int first_rank = 0) {
    v1::StartJobCommand start;
    start.set_job_id(job);
    start.set_generation(generation);
    start.set_recipe_yaml("model:\n  preset: gpt-tiny\n");
    start.set_world_size(first_rank + ranks);
    start.set_local_world_size(ranks);
    start.set_rendezvous_scope(job + "/" + std::to_string(generation) + "/");
    start.set_checkpoint_dir("/ckpt/" + job);
    for (int i = 0; i < ranks; ++i) {
      v1::WorkerAssignment* worker = start.add_workers();
      worker->set_rank(first_rank + i);
      worker->set_local_rank(i);
    }
    return start;
  }

  // The pid of the spawn with `rank` of `job` (newest generation first).
  pid_t Pid(const std::string& job, int rank) const {
    const auto& spawns = spawner_.spawns();
    for (auto it = spawns.rbegin(); it != spawns.rend(); ++it) {
      const auto& env = it->spec.env;
      if (std::find(env.begin(), env.end(), "LTRAIN_JOB_ID=" + job) != env.end() &&
          std::find(env.begin(), env.end(), "LTRAIN_RANK=" + std::to_string(rank)) != env.end()) {
        return it->pid;
      }
    }
    ADD_FAILURE() << "no spawn of " << job << " rank " << rank;
    return -1;
  }

  static std::string ReadFile(const std::string& path) {
    std::ifstream in(path);
    std::stringstream text;
    text << in.rdbuf();
    return text.str();
  }

  std::string work_dir_;
  FakeClock clock_;
  FakeProcessSpawner spawner_;
  RecordingOutbox outbox_;
  std::optional<int64_t> oom_kills_ = 0;
  SupervisorOptions options_;
  std::unique_ptr<Supervisor> supervisor_;
};

TEST_F(SupervisorTest, EachWorkerGetsItsEnvironmentAndTheRecipeFile) {
  supervisor().StartJob(Start("j1", 2, 2, /*first_rank=*/4));

  std::string dir = work_dir_ + "/jobs/j1/gen-2";
  EXPECT_EQ(ReadFile(dir + "/recipe.yaml"), "model:\n  preset: gpt-tiny\n");
  ASSERT_EQ(spawner_.spawns().size(), 2u);
  for (int i = 0; i < 2; ++i) {
    const SpawnSpec& spec = spawner_.spawns()[i].spec;
    EXPECT_EQ(spec.binary, "/opt/ltrain/ltrain-worker");
    EXPECT_TRUE(spec.args.empty());
    EXPECT_EQ(spec.working_dir, dir);
    EXPECT_EQ(spec.env, (std::vector<std::string>{
                            "LTRAIN_JOB_ID=j1",
                            "LTRAIN_RANK=" + std::to_string(4 + i),
                            "LTRAIN_WORLD_SIZE=6",
                            "LTRAIN_LOCAL_RANK=" + std::to_string(i),
                            "LTRAIN_LOCAL_WORLD_SIZE=2",
                            "LTRAIN_GENERATION=2",
                            "LTRAIN_RECIPE_FILE=" + dir + "/recipe.yaml",
                            "LTRAIN_RDZV=grpc://127.0.0.1:4567",
                            "LTRAIN_AGENT=127.0.0.1:4567",
                            "LTRAIN_RDZV_SCOPE=j1/2/",
                            "LTRAIN_CHECKPOINT_DIR=/ckpt/j1",
                            "LTRAIN_BIND_ADDR=10.0.0.7",
                        }));
  }
  std::vector<v1::WorkerStateReport> reports = outbox_.Reports();
  ASSERT_EQ(reports.size(), 2u);
  EXPECT_EQ(reports[0].node_id(), "node-a");
  EXPECT_EQ(reports[0].log_path(), dir + "/rank-4.log");
  EXPECT_EQ(reports[1].log_path(), dir + "/rank-5.log");
  // Each worker is announced as running before its report goes out.
  EXPECT_EQ(outbox_.running_when_sent, (std::vector<size_t>{1, 2}));
  ASSERT_EQ(outbox_.running.size(), 2u);
  EXPECT_EQ(outbox_.running[1].job_id(), "j1");
  EXPECT_EQ(outbox_.running[1].generation(), 2);
  EXPECT_EQ(outbox_.running[1].rank(), 5);
  EXPECT_EQ(outbox_.running[1].pid(), 1001);
  EXPECT_EQ(outbox_.Take(), (std::vector<std::string>{"j1 gen 2 rank 4 pid 1000 running",
                                                     "j1 gen 2 rank 5 pid 1001 running"}));
  EXPECT_EQ(supervisor().OutputFds().size(), 2u);
}

// A recipe with entrypoint.command: each rank is `ltrain-exec --env NAME=VALUE... -- PROGRAM...` (beside the worker)
// in the entrypoint's directory, with torchrun's variables after ltrain's; the recipe's own go to the
// program alone, through exec's arguments.
TEST_F(SupervisorTest, AProgramRunsUnderExecWithTorchrunsEnvironment) {
  v1::StartJobCommand start = Start("j1", 3, 2, /*first_rank=*/2);
  start.set_recipe_yaml(
      "name: j\nfault: {max_restarts: 5}\n"
      "entrypoint: {command: [python3, train.py, --x], env: {OMP_NUM_THREADS: '4', A: b, TORCH_NCCL_TRACE_BUFFER_SIZE: '0'}, "
      "workdir: /srv/w, "
      "warm_standby: off}\n");
  start.set_restart_count(2);
  supervisor().StartJob(start);
  ASSERT_EQ(spawner_.spawns().size(), 2u);
  const SpawnSpec& spec = spawner_.spawns()[1].spec;
  EXPECT_EQ(spec.binary, "/opt/ltrain/ltrain-exec");
  EXPECT_EQ(spec.args, (std::vector<std::string>{"--env", "A=b", "--env", "OMP_NUM_THREADS=4", "--env",
                                                 "TORCH_NCCL_TRACE_BUFFER_SIZE=0", "--",
                                                 "python3", "train.py", "--x"}));
  EXPECT_EQ(spec.working_dir, "/srv/w");
  char mask[32];
  std::snprintf(mask, sizeof(mask), "LTRAIN_USER_UMASK=%04o", static_cast<unsigned>(OriginalUmask()));
  const auto first = std::find(spec.env.begin(), spec.env.end(), "RANK=3");
  ASSERT_NE(first, spec.env.end());
  EXPECT_EQ(*(first - 1), mask) << "the program gets the umask its user started ltrain with";
  const std::string dir = options_.work_dir + "/jobs/j1/gen-3/";
  const std::vector<std::string> tail(first, spec.env.end());
  EXPECT_EQ(tail, (std::vector<std::string>{
                      "RANK=3", "LOCAL_RANK=1", "WORLD_SIZE=4", "LOCAL_WORLD_SIZE=2", "GROUP_RANK=1",
                      "GROUP_WORLD_SIZE=2", "ROLE_NAME=default", "ROLE_RANK=3", "ROLE_WORLD_SIZE=4",
                      "TORCHELASTIC_RESTART_COUNT=2", "TORCHELASTIC_MAX_RESTARTS=5", "TORCHELASTIC_RUN_ID=j1",
                      "TORCHELASTIC_USE_AGENT_STORE=True", "TORCHELASTIC_ERROR_FILE=" + dir + "rank-3-error.json",
                      "TORCH_NCCL_ASYNC_ERROR_HANDLING=1", "TORCHELASTIC_SIGNALS_TO_HANDLE=SIGTERM,SIGINT,SIGHUP,SIGQUIT",
                      // TORCH_NCCL_TRACE_BUFFER_SIZE is the recipe's (exec's --env).
                      "TORCH_NCCL_DUMP_ON_TIMEOUT=1", "TORCH_FR_DUMP_TEMP_FILE=" + dir + "nccl-trace-rank-",
                      "TORCH_NCCL_DEBUG_INFO_TEMP_FILE=" + dir + "nccl-trace-rank-",
                                       "TORCH_NCCL_DEBUG_INFO_PIPE_FILE=" + dir + "nccl-dump-request-rank-"}));
  for (const std::string& entry : spec.env) EXPECT_NE(entry, "OMP_NUM_THREADS=1") << "the recipe set 4";
  EXPECT_NE(std::find(spec.env.begin(), spec.env.end(), "LTRAIN_RANK=3"), spec.env.end());
}

// The generation's secret for the agent reaches its workers in a file only this user can read.
TEST_F(SupervisorTest, WorkersGetTheirGenerationsSecretInAPrivateFile) {
  std::vector<std::string> issued;
  options_.issue_worker_secret = [&](const v1::StartJobCommand& start) {
    issued.push_back(start.job_id() + "/" + std::to_string(start.generation()));
    return std::string("s3cret-") + start.job_id();
  };
  supervisor().StartJob(Start("j1", 2, 2));
  EXPECT_EQ(issued, (std::vector<std::string>{"j1/2"})) << "one secret per generation, for all its ranks";
  const std::string file = work_dir_ + "/jobs/j1/gen-2/agent-secret";
  ASSERT_EQ(spawner_.spawns().size(), 2u);
  for (const auto& spawn : spawner_.spawns()) {
    const auto& env = spawn.spec.env;
    EXPECT_NE(std::find(env.begin(), env.end(), "LTRAIN_AGENT_SECRET_FILE=" + file), env.end());
    for (const auto& entry : env) EXPECT_EQ(entry.find("s3cret"), std::string::npos) << "not in the environment";
  }
  EXPECT_EQ(ReadFile(file), "s3cret-j1");
  EXPECT_EQ(fs::status(file).permissions() & (fs::perms::group_all | fs::perms::others_all), fs::perms::none);
}

// Once the generation's last worker here is gone, its secret is revoked and its file removed.
TEST_F(SupervisorTest, AGenerationsSecretGoesWithItsLastWorker) {
  options_.issue_worker_secret = [](const v1::StartJobCommand&) { return std::string("s3cret"); };
  std::vector<std::string> revoked;
  options_.revoke_worker_secret = [&](const std::string& job_id, int generation) {
    revoked.push_back(job_id + "/" + std::to_string(generation));
  };
  supervisor().StartJob(Start("j1", 2, 2));
  const std::string file = work_dir_ + "/jobs/j1/gen-2/agent-secret";
  ASSERT_TRUE(fs::exists(file));
  spawner_.Exit(spawner_.spawns()[0].pid, 0);
  supervisor().Poll();
  EXPECT_TRUE(revoked.empty()) << "rank 1 still runs";
  EXPECT_TRUE(fs::exists(file));
  spawner_.Exit(spawner_.spawns()[1].pid, 0);
  supervisor().Poll();
  EXPECT_EQ(revoked, (std::vector<std::string>{"j1/2"}));
  EXPECT_FALSE(fs::exists(file));
}

TEST_F(SupervisorTest, LinesGoToTheCoordinatorAndToTheRanksLogFile) {
  supervisor().StartJob(Start("j1", 1, 2));
  outbox_.Take();
  pid_t rank0 = Pid("j1", 0), rank1 = Pid("j1", 1);

  supervisor().Poll();
  EXPECT_TRUE(outbox_.Take().empty());

  spawner_.Print(rank0, "step 1 loss 9.1\nstep 2 lo");
  spawner_.Print(rank1, "step 1 loss 9.2\n");
  supervisor().Poll();
  EXPECT_EQ(outbox_.Take(), (std::vector<std::string>{"logs j1: [0] step 1 loss 9.1 | [1] step 1 loss 9.2"}));

  spawner_.Print(rank0, "ss 8.7\n");
  supervisor().Poll();
  std::vector<SupervisorMessage> messages = outbox_.messages;
  EXPECT_EQ(outbox_.Take(), (std::vector<std::string>{"logs j1: [0] step 2 loss 8.7"}));
  ASSERT_EQ(messages.size(), 1u);
  EXPECT_EQ(std::get<v1::PushLogsRequest>(messages[0]).node_id(), "node-a");

  spawner_.Print(rank1, "no newline at the end");
  spawner_.Exit(rank0, 0);
  spawner_.Exit(rank1, 0);
  supervisor().Poll();
  EXPECT_EQ(outbox_.Take(), (std::vector<std::string>{"logs j1: [1] no newline at the end",
                                                     "j1 gen 1 rank 0 pid 1000 exited 0",
                                                     "j1 gen 1 rank 1 pid 1001 exited 0"}));
  EXPECT_TRUE(supervisor().Idle());
  EXPECT_EQ(ReadFile(work_dir_ + "/jobs/j1/gen-1/rank-0.log"), "step 1 loss 9.1\nstep 2 loss 8.7\n");
  EXPECT_EQ(ReadFile(work_dir_ + "/jobs/j1/gen-1/rank-1.log"), "step 1 loss 9.2\nno newline at the end\n");
  EXPECT_TRUE(spawner_.signals().empty());  // exits with code 0 stop nobody
}

// A 10 MB line without a newline and bytes that are not UTF-8 reach the coordinator as small, valid
// lines, so the exit report behind them goes out at once; the rank's log file keeps every byte.
TEST_F(SupervisorTest, AHugeLineAndInvalidUtf8ReachTheCoordinatorSmallAndValid) {
  supervisor().StartJob(Start("j1", 1, 1));
  outbox_.Take();
  const pid_t pid = Pid("j1", 0);
  spawner_.Print(pid, "bad \xff\xfe bytes \xe2\x82 end\n");
  const std::string chunk(64 << 10, 'x');
  constexpr int kChunks = 160;  // 10 MiB, printed as a worker would while the agent reads
  for (int i = 0; i < kChunks; ++i) {
    spawner_.Print(pid, chunk);
    supervisor().Poll();
  }
  spawner_.Print(pid, "\nlast words\n");
  spawner_.Exit(pid, 1);
  supervisor().Poll();

  size_t lines = 0, forwarded = 0;
  std::vector<std::string> texts;
  for (const auto& message : outbox_.messages) {
    if (const auto* logs = std::get_if<v1::PushLogsRequest>(&message)) {
      EXPECT_LE(logs->ByteSizeLong(), Supervisor::kMaxBatchBytes + 4096);
      for (const auto& line : logs->lines()) {
        ++lines;
        forwarded += line.text().size();
        EXPECT_LE(line.text().size(), Supervisor::kMaxForwardedLineBytes + 200);
        texts.push_back(line.text());
      }
    }
  }
  ASSERT_FALSE(outbox_.messages.empty());
  EXPECT_TRUE(std::holds_alternative<v1::WorkerStateReport>(outbox_.messages.back())) << "the exit report is last";
  EXPECT_LT(forwarded, 400u << 10) << lines << " lines";
  ASSERT_GE(texts.size(), 3u);
  EXPECT_EQ(texts.front(), "bad \xef\xbf\xbd\xef\xbf\xbd bytes \xef\xbf\xbd\xef\xbf\xbd end");
  EXPECT_NE(texts[1].find("more bytes in " + work_dir_ + "/jobs/j1/gen-1/rank-0.log]"), std::string::npos);
  EXPECT_EQ(texts.back(), "last words");
  const auto& report = std::get<v1::WorkerStateReport>(outbox_.messages.back());
  for (const auto& line : report.log_tail()) EXPECT_LE(line.size(), Supervisor::kMaxForwardedLineBytes + 200);
  // The file has all of it: the bad bytes as they were, the 10 MiB of x (cut into lines of at most
  // kMaxPartialLineBytes + one read).
  const std::string file = ReadFile(work_dir_ + "/jobs/j1/gen-1/rank-0.log");
  EXPECT_EQ(file.rfind("bad \xff\xfe bytes \xe2\x82 end\n", 0), 0u);
  EXPECT_EQ(static_cast<size_t>(std::count(file.begin(), file.end(), 'x')), chunk.size() * kChunks);
}

TEST_F(SupervisorTest, AnExitReportFollowsTheWorkersLastLinesAndCarriesTheTail) {
  std::vector<std::string> completed;
  options_.complete_exit_report = [&](v1::WorkerStateReport& report) {
    completed.push_back(report.job_id() + " rank " + std::to_string(report.rank()) + " " + report.state());
    report.add_log_tail("(last progress: step 14)");
  };
  supervisor().StartJob(Start("j1", 1, 1));
  outbox_.Take();
  pid_t pid = Pid("j1", 0);
  std::string printed;
  for (int i = 0; i < 14; ++i) printed += "line " + std::to_string(i) + "\n";
  spawner_.Print(pid, printed);
  spawner_.Exit(pid, 3);  // nothing read yet: the final read must catch all 14 lines first
  supervisor().Poll();

  ASSERT_EQ(outbox_.messages.size(), 2u);
  const auto& logs = std::get<v1::PushLogsRequest>(outbox_.messages[0]);
  ASSERT_EQ(logs.lines_size(), 14);
  EXPECT_EQ(logs.lines(13).text(), "line 13");
  const auto& report = std::get<v1::WorkerStateReport>(outbox_.messages[1]);
  EXPECT_EQ(report.node_id(), "node-a");
  EXPECT_EQ(report.state(), "exited");
  EXPECT_EQ(report.exit_code(), 3);
  EXPECT_EQ(report.signal(), 0);
  EXPECT_FALSE(report.oom_killed());
  EXPECT_EQ(report.log_path(), work_dir_ + "/jobs/j1/gen-1/rank-0.log");
  std::vector<std::string> tail(report.log_tail().begin(), report.log_tail().end());
  std::vector<std::string> expected;
  for (int i = 14 - static_cast<int>(Supervisor::kTailLines); i < 14; ++i) expected.push_back("line " + std::to_string(i));
  expected.push_back("(last progress: step 14)");
  EXPECT_EQ(tail, expected);
  EXPECT_EQ(completed, (std::vector<std::string>{"j1 rank 0 exited"}));  // not for "running" reports
  // The worker is gone from the running set before its exit report goes out.
  EXPECT_EQ(outbox_.running_when_sent, (std::vector<size_t>{0, 0}));
  EXPECT_TRUE(outbox_.running.empty());
  EXPECT_TRUE(supervisor().OutputFds().empty());
}

// As the agent wires it: a rank that commits and exits at once has its last progress report in its
// exit report, so the coordinator applies the commit before the exit.
TEST_F(SupervisorTest, AnExitReportCarriesTheRanksLastProgress) {
  ProgressTable table(clock_);
  options_.complete_exit_report = [&](v1::WorkerStateReport& report) { table.CompleteExitReport(report); };
  supervisor().StartJob(Start("j1", 3, 2));
  outbox_.Take();
  pid_t rank0 = Pid("j1", 0), rank1 = Pid("j1", 1);
  v1::RankProgress last;
  last.set_job_id("j1");
  last.set_generation(3);
  last.set_rank(0);
  last.set_seq(41);
  last.set_step(20);
  last.set_phase("done");
  last.mutable_completed()->set_step(20);
  last.set_committed_step(20);
  last.set_committed_path("/ckpt/j1/step-20");
  table.Record(last);
  clock_.AdvanceMs(30);

  spawner_.Print(rank0, "checkpoint step-20 written to /ckpt/j1 in 5 ms\n");
  spawner_.Exit(rank0, 0);
  spawner_.Exit(rank1, 0);  // rank 1 never reported
  supervisor().Poll();
  std::vector<v1::WorkerStateReport> reports = outbox_.Reports();
  ASSERT_EQ(reports.size(), 2u);
  ASSERT_EQ(reports[0].rank(), 0);
  ASSERT_TRUE(reports[0].has_progress());
  EXPECT_EQ(reports[0].progress().seq(), 41);
  EXPECT_EQ(reports[0].progress().completed().step(), 20);
  EXPECT_EQ(reports[0].progress().committed_step(), 20);
  EXPECT_EQ(reports[0].progress().committed_path(), "/ckpt/j1/step-20");
  EXPECT_EQ(reports[0].progress().silent_ms(), 30);
  EXPECT_EQ(reports[1].rank(), 1);
  EXPECT_FALSE(reports[1].has_progress());
  EXPECT_EQ(outbox_.Take(), (std::vector<std::string>{"logs j1: [0] checkpoint step-20 written to /ckpt/j1 in 5 ms",
                                                     "j1 gen 3 rank 0 pid 1000 exited 0",
                                                     "j1 gen 3 rank 1 pid 1001 exited 0"}));
  EXPECT_TRUE(table.Collect({{"j1", 3, 0}}).empty()) << "forgotten with the exit";
}

TEST_F(SupervisorTest, AFailingWorkerStopsTheJobsOtherWorkersOnThisNode) {
  supervisor().StartJob(Start("j1", 1, 3));
  supervisor().StartJob(Start("j2", 1, 1));
  outbox_.Take();
  pid_t r0 = Pid("j1", 0), r1 = Pid("j1", 1), r2 = Pid("j1", 2), other = Pid("j2", 0);
  spawner_.IgnoreSigterm(r2);

  spawner_.Print(r1, "RuntimeError: CUDA error\n");
  spawner_.Exit(r1, 1);
  supervisor().Poll();
  // Rank 0 obeys at once; its SIGTERM death is the stop, not a new failure.
  EXPECT_EQ(outbox_.Take(), (std::vector<std::string>{"logs j1: [1] RuntimeError: CUDA error",
                                                     "j1 gen 1 rank 1 pid 1001 exited 1",
                                                     "j1 gen 1 rank 0 pid 1000 killed signal 15"}));
  EXPECT_EQ(spawner_.signals(), (std::vector<Signal>{{r0, SIGTERM}, {r0, SIGCONT}, {r2, SIGTERM}, {r2, SIGCONT}}));

  // Rank 2 hangs: SIGKILL after the grace. The other job is left alone throughout.
  clock_.AdvanceMs(3000);
  supervisor().Poll();
  supervisor().Poll();
  EXPECT_EQ(outbox_.Take(), (std::vector<std::string>{"j1 gen 1 rank 2 pid 1002 killed signal 9"}));
  EXPECT_EQ(spawner_.SignalsTo(r2), (std::vector<int>{SIGTERM, SIGCONT, SIGKILL}));
  EXPECT_TRUE(spawner_.SignalsTo(other).empty());
  EXPECT_TRUE(spawner_.Alive(other));
  EXPECT_EQ(supervisor().Running().size(), 1u);
}

// fault.recovery in_place: a failed worker's peers keep running, and the coordinator's replacement of
// that one rank starts one worker beside them, in the next membership.
TEST_F(SupervisorTest, AnInPlaceJobsFailedRankIsReplacedBesideItsRunningPeers) {
  v1::StartJobCommand start = Start("j1", 0, 2);
  start.set_recipe_yaml(
      "name: j1\nmodel: {layers: 2, d_model: 64, heads: 4, seq_len: 32}\ndata: {path: /d}\n"
      "training: {micro_batch: 1, global_batch: 2}\nparallel: {nproc_per_node: 2}\nfault: {recovery: in_place}\n");
  supervisor().StartJob(start);
  outbox_.Take();
  pid_t r0 = Pid("j1", 0), r1 = Pid("j1", 1);
  spawner_.Exit(r1, 1);
  supervisor().Poll();
  EXPECT_EQ(outbox_.Take(), (std::vector<std::string>{"j1 gen 0 rank 1 pid 1001 exited 1"}));
  EXPECT_TRUE(spawner_.SignalsTo(r0).empty());
  EXPECT_TRUE(spawner_.Alive(r0));

  v1::StartJobCommand replace = start;
  replace.clear_workers();
  replace.set_replace(true);
  replace.set_epoch(1);
  v1::WorkerAssignment* worker = replace.add_workers();
  worker->set_rank(1);
  worker->set_local_rank(1);
  ASSERT_TRUE(CheckStartCommand(replace).ok()) << CheckStartCommand(replace).ToString();
  supervisor().StartJob(replace);
  const pid_t again = Pid("j1", 1);
  EXPECT_NE(again, r1);
  EXPECT_TRUE(spawner_.Alive(r0));
  const auto& env = spawner_.spawns().back().spec.env;
  EXPECT_NE(std::find(env.begin(), env.end(), "LTRAIN_EPOCH=1"), env.end());
  EXPECT_EQ(supervisor().Running().size(), 2u);
  // Only a replacement may name fewer workers than the node runs.
  replace.set_replace(false);
  EXPECT_FALSE(CheckStartCommand(replace).ok());
}

TEST_F(SupervisorTest, AFailureStopsOnlyItsOwnAndOlderGenerations) {
  supervisor().StartJob(Start("j1", 1, 1));
  pid_t old_rank0 = Pid("j1", 0);
  spawner_.IgnoreSigterm(old_rank0);
  supervisor().StopJob("j1", 1);  // a hung leftover, still in its grace when generation 2 starts
  supervisor().StartJob(Start("j1", 2, 2, /*first_rank=*/0));
  outbox_.Take();
  pid_t new_rank0 = Pid("j1", 0), new_rank1 = Pid("j1", 1);
  ASSERT_NE(old_rank0, new_rank0);
  supervisor().Poll();  // the leftover's SIGKILL (from StartJob) is reaped: no stop of generation 2
  EXPECT_EQ(outbox_.Take(), (std::vector<std::string>{"j1 gen 1 rank 0 pid 1000 killed signal 9"}));
  EXPECT_TRUE(spawner_.SignalsTo(new_rank0).empty());

  spawner_.Die(new_rank1, SIGSEGV);
  supervisor().Poll();
  EXPECT_EQ(outbox_.Take(), (std::vector<std::string>{"j1 gen 2 rank 1 pid 1002 killed signal 11",
                                                     "j1 gen 2 rank 0 pid 1001 killed signal 15"}));
  EXPECT_EQ(spawner_.SignalsTo(new_rank0), (std::vector<int>{SIGTERM, SIGCONT}));
}

TEST_F(SupervisorTest, AStopSendsSigtermAndSigkillOnlyOnceTheGraceIsOver) {
  supervisor().StartJob(Start("j1", 1, 1));
  outbox_.Take();
  pid_t pid = Pid("j1", 0);
  spawner_.IgnoreSigterm(pid);  // hung

  supervisor().StopJob("j1", 1);
  EXPECT_EQ(spawner_.signals(), (std::vector<Signal>{{pid, SIGTERM}, {pid, SIGCONT}}));
  supervisor().StopJob("j1", 1);  // a second stop does not restart the grace or signal again
  EXPECT_EQ(spawner_.signals().size(), 2u);

  clock_.AdvanceMs(2999);
  supervisor().Poll();
  EXPECT_EQ(spawner_.signals().size(), 2u);
  EXPECT_TRUE(outbox_.Take().empty());

  clock_.AdvanceMs(1);
  supervisor().Poll();
  EXPECT_EQ(spawner_.signals(), (std::vector<Signal>{{pid, SIGTERM}, {pid, SIGCONT}, {pid, SIGKILL}}));

  supervisor().Poll();
  EXPECT_EQ(outbox_.Take(), (std::vector<std::string>{"j1 gen 1 rank 0 pid 1000 killed signal 9"}));
  clock_.AdvanceMs(10'000'000);
  supervisor().Poll();
  EXPECT_EQ(spawner_.signals().size(), 3u);  // SIGKILL once
  EXPECT_TRUE(supervisor().Idle());
}

TEST_F(SupervisorTest, AWorkerStuckInTheKernelGetsOneSigkillAndIsReportedWhenItDies) {
  supervisor().StartJob(Start("j1", 1, 1));
  outbox_.Take();
  pid_t pid = Pid("j1", 0);
  spawner_.MakeUninterruptible(pid);
  supervisor().StopJob("j1", 1);
  clock_.AdvanceMs(3000);
  for (int i = 0; i < 5; ++i) {
    supervisor().Poll();
    clock_.AdvanceMs(10'000);
  }
  EXPECT_EQ(spawner_.SignalsTo(pid), (std::vector<int>{SIGTERM, SIGCONT, SIGKILL}));
  EXPECT_TRUE(outbox_.Take().empty());
  EXPECT_EQ(supervisor().Running().size(), 1u);

  spawner_.Die(pid, SIGKILL);  // the kernel lets go at last
  supervisor().Poll();
  EXPECT_EQ(outbox_.Take(), (std::vector<std::string>{"j1 gen 1 rank 0 pid 1000 killed signal 9"}));
  EXPECT_TRUE(supervisor().Idle());
}

TEST_F(SupervisorTest, AWorkerThatObeysSigtermGetsNoSigkill) {
  supervisor().StartJob(Start("j1", 1, 1));
  outbox_.Take();
  pid_t pid = Pid("j1", 0);
  supervisor().StopJob("j1", -1);
  supervisor().Poll();
  EXPECT_EQ(outbox_.Take(), (std::vector<std::string>{"j1 gen 1 rank 0 pid 1000 killed signal 15"}));
  clock_.AdvanceMs(3000);
  supervisor().Poll();
  EXPECT_EQ(spawner_.signals(), (std::vector<Signal>{{pid, SIGTERM}, {pid, SIGCONT}}));
}

TEST_F(SupervisorTest, AStopLeavesNewerGenerationsAndOtherJobsAlone) {
  supervisor().StartJob(Start("j1", 3, 1));
  supervisor().StartJob(Start("j2", 1, 1));
  supervisor().StopJob("j1", 2);
  supervisor().StopJob("j3", -1);
  EXPECT_TRUE(spawner_.signals().empty());
}

TEST_F(SupervisorTest, ANewerGenerationKillsLeftoversOfOlderOnes) {
  supervisor().StartJob(Start("j1", 1, 2));
  supervisor().StartJob(Start("j2", 1, 1));
  pid_t old0 = Pid("j1", 0), old1 = Pid("j1", 1), other = Pid("j2", 0);
  outbox_.Take();

  supervisor().StartJob(Start("j1", 2, 1));
  pid_t new0 = Pid("j1", 0);
  EXPECT_EQ(spawner_.signals(), (std::vector<Signal>{{old0, SIGKILL}, {old1, SIGKILL}}));
  supervisor().Poll();
  EXPECT_EQ(outbox_.Take(), (std::vector<std::string>{"j1 gen 2 rank 0 pid 1003 running",
                                                     "j1 gen 1 rank 0 pid 1000 killed signal 9",
                                                     "j1 gen 1 rank 1 pid 1001 killed signal 9"}));
  EXPECT_TRUE(spawner_.Alive(new0));
  EXPECT_TRUE(spawner_.Alive(other));
  EXPECT_TRUE(spawner_.SignalsTo(new0).empty());
  EXPECT_TRUE(spawner_.SignalsTo(other).empty());

  size_t sent = spawner_.signals().size();
  supervisor().StartJob(Start("j1", 2, 1, /*first_rank=*/1));  // the same generation again: no kill
  EXPECT_EQ(spawner_.signals().size(), sent);
}

// A program's first failed rank: the others with PyTorch's pipe are asked for their flight recorder
// and stopped once they dumped; the exit report goes with every dump of the generation.
TEST_F(SupervisorTest, AFailedRanksReportWaitsForTheOthersFlightRecorder) {
  supervisor().StartJob(Start("j1", 1, 2));
  outbox_.Take();
  pid_t r0 = Pid("j1", 0), r1 = Pid("j1", 1);
  const std::string dir = work_dir_ + "/jobs/j1/gen-1";
  const std::string pipe = dir + "/nccl-dump-request-rank-1.pipe";
  ASSERT_EQ(mkfifo(pipe.c_str(), 0600), 0);
  const int reader = open(pipe.c_str(), O_RDONLY | O_NONBLOCK);  // rank 1's watchdog
  ASSERT_GE(reader, 0);
  const std::string dump = R"({"version": "2.10", "entries": [{"record_id": 0, "collective_seq_id": 1,
      "profiling_name": "nccl:all_reduce", "process_group": ["0", "default_pg"], "state": "completed"}]})";
  std::ofstream(dir + "/nccl-trace-rank-0") << dump;  // rank 0's, written as its collective timed out

  spawner_.Exit(r0, 1);
  supervisor().Poll();
  EXPECT_TRUE(outbox_.Take().empty()) << "the report waits for rank 1's dump";
  EXPECT_TRUE(spawner_.signals().empty()) << "rank 1 is stopped once it dumped";
  char byte = 0;
  EXPECT_EQ(read(reader, &byte, 1), 1);
  close(reader);

  std::ofstream(dir + "/nccl-trace-rank-1") << dump;
  supervisor().Poll();
  std::vector<v1::WorkerStateReport> reports = outbox_.Reports();
  ASSERT_EQ(reports.size(), 1u);
  EXPECT_EQ(reports[0].rank(), 0);
  EXPECT_EQ(reports[0].exit_code(), 1);
  ASSERT_EQ(reports[0].flight_records_size(), 2);
  EXPECT_EQ(reports[0].flight_records(1).rank(), 1);
  EXPECT_EQ(reports[0].flight_records(1).collectives(0).op(), "all_reduce");
  EXPECT_EQ(spawner_.signals(), (std::vector<Signal>{{r1, SIGTERM}, {r1, SIGCONT}}));
}

// A rank that never dumps holds neither the report nor its stop past the wait.
TEST_F(SupervisorTest, ARankThatDoesNotDumpIsStoppedAfterTheWait) {
  supervisor().StartJob(Start("j1", 1, 2));
  outbox_.Take();
  pid_t r0 = Pid("j1", 0), r1 = Pid("j1", 1);
  const std::string pipe = work_dir_ + "/jobs/j1/gen-1/nccl-dump-request-rank-1.pipe";
  ASSERT_EQ(mkfifo(pipe.c_str(), 0600), 0);
  const int reader = open(pipe.c_str(), O_RDONLY | O_NONBLOCK);
  ASSERT_GE(reader, 0);
  spawner_.Exit(r0, 1);
  supervisor().Poll();
  EXPECT_TRUE(outbox_.Take().empty());
  clock_.AdvanceMs(Supervisor::kDumpWaitMs);
  supervisor().Poll();
  std::vector<v1::WorkerStateReport> reports = outbox_.Reports();
  ASSERT_EQ(reports.size(), 1u);
  EXPECT_EQ(reports[0].flight_records_size(), 0);
  EXPECT_EQ(spawner_.signals(), (std::vector<Signal>{{r1, SIGTERM}, {r1, SIGCONT}}));
  close(reader);
}

// The coordinator's request: a report of state "collectives", at once when no rank has a pipe.
TEST_F(SupervisorTest, DumpCollectivesAnswersWithTheGenerationsDumps) {
  supervisor().StartJob(Start("j1", 1, 1));
  outbox_.Take();
  std::ofstream(work_dir_ + "/jobs/j1/gen-1/nccl-trace-rank-0") << R"({"entries": []})";
  supervisor().DumpCollectives("j1", 1);
  supervisor().Poll();
  std::vector<v1::WorkerStateReport> reports = outbox_.Reports();
  ASSERT_EQ(reports.size(), 1u);
  EXPECT_EQ(reports[0].state(), "collectives");
  EXPECT_EQ(reports[0].rank(), -1);
  ASSERT_EQ(reports[0].flight_records_size(), 1);
  EXPECT_EQ(reports[0].flight_records(0).path(), work_dir_ + "/jobs/j1/gen-1/nccl-trace-rank-0");
  EXPECT_TRUE(spawner_.signals().empty());
}

TEST_F(SupervisorTest, AFailedSpawnIsReportedAsExitCode127WithTheReason) {
  spawner_.FailNextSpawn(Internal("fork: Resource temporarily unavailable"));
  supervisor().StartJob(Start("j1", 1, 2));

  ASSERT_EQ(spawner_.spawns().size(), 2u);
  EXPECT_EQ(spawner_.spawns()[0].pid, -1);
  std::vector<v1::WorkerStateReport> reports = outbox_.Reports();
  ASSERT_EQ(reports.size(), 2u);
  EXPECT_EQ(reports[0].rank(), 0);
  EXPECT_EQ(reports[0].state(), "exited");
  EXPECT_EQ(reports[0].exit_code(), 127);
  EXPECT_EQ(reports[0].pid(), 0);
  EXPECT_EQ(reports[0].log_path(), work_dir_ + "/jobs/j1/gen-1/rank-0.log");
  EXPECT_EQ(std::vector<std::string>(reports[0].log_tail().begin(), reports[0].log_tail().end()),
            (std::vector<std::string>{"cannot start /opt/ltrain/ltrain-worker: fork: Resource temporarily unavailable"}));
  EXPECT_EQ(reports[1].rank(), 1);
  EXPECT_EQ(reports[1].state(), "running");
  ASSERT_EQ(outbox_.running.size(), 1u);
  EXPECT_EQ(outbox_.running[0].rank(), 1);
}

TEST_F(SupervisorTest, ASigkillWhileTheOomCounterWentUpIsNamedOom) {
  oom_kills_ = 5;
  supervisor().StartJob(Start("j1", 1, 3));
  outbox_.Take();
  pid_t r0 = Pid("j1", 0), r1 = Pid("j1", 1), r2 = Pid("j1", 2);
  oom_kills_ = 6;
  spawner_.Die(r0, SIGKILL);
  spawner_.Die(r1, SIGSEGV);  // the counter is up, but only SIGKILL is the OOM killer's
  supervisor().Poll();
  // Rank 2 is stopped by the failures, and its death is no OOM kill.
  EXPECT_EQ(outbox_.Take(), (std::vector<std::string>{"j1 gen 1 rank 0 pid 1000 killed signal 9 oom",
                                                     "j1 gen 1 rank 1 pid 1001 killed signal 11",
                                                     "j1 gen 1 rank 2 pid 1002 killed signal 15"}));
  EXPECT_EQ(spawner_.SignalsTo(r2), (std::vector<int>{SIGTERM, SIGCONT}));
}

TEST_F(SupervisorTest, ASigkillWithTheOomCounterUnchangedOrUnknownIsNoOom) {
  oom_kills_ = 5;
  supervisor().StartJob(Start("j1", 1, 1));
  oom_kills_ = std::nullopt;
  supervisor().StartJob(Start("j2", 1, 1));
  outbox_.Take();
  oom_kills_ = 5;
  spawner_.Die(Pid("j1", 0), SIGKILL);
  spawner_.Die(Pid("j2", 0), SIGKILL);
  supervisor().Poll();
  EXPECT_EQ(outbox_.Take(), (std::vector<std::string>{"j1 gen 1 rank 0 pid 1000 killed signal 9",
                                                     "j2 gen 1 rank 0 pid 1001 killed signal 9"}));
}

TEST_F(SupervisorTest, TheSigkillOfAStopIsNoOom) {
  oom_kills_ = 5;
  supervisor().StartJob(Start("j1", 1, 1));
  outbox_.Take();
  pid_t pid = Pid("j1", 0);
  spawner_.IgnoreSigterm(pid);
  supervisor().StopJob("j1", 1);
  oom_kills_ = 6;  // another process of the cgroup
  clock_.AdvanceMs(3000);
  supervisor().Poll();
  supervisor().Poll();
  EXPECT_EQ(outbox_.Take(), (std::vector<std::string>{"j1 gen 1 rank 0 pid 1000 killed signal 9"}));
}

TEST_F(SupervisorTest, StopAllStopsEveryJobWithTheGrace) {
  supervisor().StartJob(Start("j1", 1, 1));
  supervisor().StartJob(Start("j2", 4, 1));
  pid_t a = Pid("j1", 0), b = Pid("j2", 0);
  spawner_.IgnoreSigterm(b);
  supervisor().StopAll();
  EXPECT_EQ(spawner_.signals(), (std::vector<Signal>{{a, SIGTERM}, {a, SIGCONT}, {b, SIGTERM}, {b, SIGCONT}}));
  clock_.AdvanceMs(2999);
  supervisor().Poll();
  EXPECT_EQ(spawner_.signals().size(), 4u);
  EXPECT_FALSE(spawner_.Alive(a));
  clock_.AdvanceMs(1);
  supervisor().Poll();
  EXPECT_EQ(spawner_.SignalsTo(b), (std::vector<int>{SIGTERM, SIGCONT, SIGKILL}));
  supervisor().Poll();
  EXPECT_TRUE(supervisor().Idle());
}

TEST_F(SupervisorTest, ShutdownKillsEveryWorkerAtOnce) {
  supervisor().StartJob(Start("j1", 1, 2));
  supervisor().StartJob(Start("j2", 1, 1));
  outbox_.Take();
  pid_t a = Pid("j1", 0), b = Pid("j1", 1), c = Pid("j2", 0);
  spawner_.IgnoreSigterm(a);

  supervisor().KillAll();
  EXPECT_EQ(spawner_.signals(), (std::vector<Signal>{{a, SIGKILL}, {b, SIGKILL}, {c, SIGKILL}}));
  supervisor().Poll();
  EXPECT_TRUE(supervisor().Idle());
  EXPECT_TRUE(outbox_.running.empty());
  EXPECT_EQ(outbox_.Take(), (std::vector<std::string>{"j1 gen 1 rank 0 pid 1000 killed signal 9",
                                                     "j1 gen 1 rank 1 pid 1001 killed signal 9",
                                                     "j2 gen 1 rank 0 pid 1002 killed signal 9"}));
}

// Warm standbys (entrypoint.warm_standby, auto).
class StandbyTest : public SupervisorTest {
 protected:
  // Generation `generation` of a program with warm standbys, `ranks` ranks here, after `restarts` restarts.
  static v1::StartJobCommand ProgramStart(int generation, int ranks, int restarts, int max_restarts = 2) {
    v1::StartJobCommand start = Start("j1", generation, ranks);
    start.set_recipe_yaml("name: j\nfault: {max_restarts: " + std::to_string(max_restarts) +
                          "}\nentrypoint: {command: [python3, train.py]}\n");
    start.set_restart_count(restarts);
    return start;
  }

  // The spawns so far that are standbys, and those that are not.
  std::vector<FakeProcessSpawner::Spawned> Spawns(bool standby) const {
    std::vector<FakeProcessSpawner::Spawned> out;
    for (const auto& spawned : spawner_.spawns()) {
      if ((!spawned.spec.args.empty() && spawned.spec.args[0] == "--standby") == standby) out.push_back(spawned);
    }
    return out;
  }

  // What the standby `pid` was handed (its working directory, then its environment), and whether
  // its input ended after it.
  std::vector<std::string> Handed(pid_t pid, bool* closed) {
    const std::string input = spawner_.Input(pid, closed);
    std::vector<std::string> entries;
    for (size_t begin = 0, end; begin < input.size(); begin = end + 1) {
      end = input.find('\0', begin);
      if (end == std::string::npos) end = input.size();
      entries.push_back(input.substr(begin, end - begin));
    }
    return entries;
  }
};

// fault.recovery in_place: one worker standby a node, its libraries loaded, becomes whichever rank of
// the generation is replaced there, with that rank's whole environment; a new one stands beside it.
TEST_F(StandbyTest, AnInPlaceJobsWorkerStandbyBecomesTheReplacedRank) {
  v1::StartJobCommand start = Start("j1", 0, 2);
  start.set_recipe_yaml(
      "name: j1\nmodel: {layers: 2, d_model: 64, heads: 4, seq_len: 32}\ndata: {path: /d}\n"
      "training: {micro_batch: 1, global_batch: 2}\nparallel: {nproc_per_node: 2}\n"
      "fault: {recovery: in_place, max_restarts: 2}\n");
  supervisor().StartJob(start);
  ASSERT_EQ(Spawns(false).size(), 2u);
  const auto standbys = Spawns(true);
  ASSERT_EQ(standbys.size(), 1u);
  EXPECT_EQ(standbys[0].spec.args, (std::vector<std::string>{"--standby", "worker"}));
  EXPECT_TRUE(standbys[0].spec.input_pipe);
  EXPECT_EQ(outbox_.Take(), (std::vector<std::string>{"j1 gen 0 rank 0 pid 1000 running",
                                                     "j1 gen 0 rank 1 pid 1001 running"}));
  spawner_.Exit(Pid("j1", 1), 1);
  supervisor().Poll();
  EXPECT_EQ(outbox_.Take(), (std::vector<std::string>{"j1 gen 0 rank 1 pid 1001 exited 1"}));

  v1::StartJobCommand replace = start;
  replace.clear_workers();
  replace.set_replace(true);
  replace.set_epoch(1);
  replace.set_restart_count(1);
  v1::WorkerAssignment* worker = replace.add_workers();
  worker->set_rank(1);
  worker->set_local_rank(1);
  supervisor().StartJob(replace);
  EXPECT_EQ(outbox_.Take(), (std::vector<std::string>{"j1 gen 0 rank 1 pid 1002 running"}));
  bool closed = false;
  const std::vector<std::string> env = Handed(standbys[0].pid, &closed);
  EXPECT_TRUE(closed);
  ASSERT_FALSE(env.empty());
  EXPECT_EQ(env[0], work_dir_ + "/jobs/j1/gen-0");
  for (const char* entry : {"LTRAIN_RANK=1", "LTRAIN_LOCAL_RANK=1", "LTRAIN_EPOCH=1", "LTRAIN_GENERATION=0"}) {
    EXPECT_NE(std::find(env.begin(), env.end(), entry), env.end()) << entry;
  }
  EXPECT_EQ(Spawns(false).size(), 2u) << "no new process for the replaced rank";
  EXPECT_EQ(Spawns(true).size(), 2u) << "a new standby beside it";
  EXPECT_EQ(supervisor().Standbys(), 1);
  EXPECT_EQ(supervisor().Running().size(), 2u);
}

TEST_F(StandbyTest, EachRankHasAStandbyThatBecomesTheNextGenerationsRank) {
  supervisor().StartJob(ProgramStart(0, 2, 0));
  const auto workers = Spawns(false);
  const auto standbys = Spawns(true);
  ASSERT_EQ(workers.size(), 2u);
  ASSERT_EQ(standbys.size(), 2u);
  for (size_t i = 0; i < 2; ++i) {
    std::vector<std::string> args = {"--standby", "import"};
    args.insert(args.end(), workers[i].spec.args.begin(), workers[i].spec.args.end());
    EXPECT_EQ(standbys[i].spec.args, args);
    EXPECT_TRUE(standbys[i].spec.input_pipe);
    EXPECT_FALSE(workers[i].spec.input_pipe);
  }
  // Standbys are no workers: not reported, not running, not stopped with the job.
  EXPECT_EQ(outbox_.Take(), (std::vector<std::string>{"j1 gen 0 rank 0 pid 1000 running",
                                                     "j1 gen 0 rank 1 pid 1002 running"}));
  EXPECT_EQ(supervisor().Running().size(), 2u);
  EXPECT_EQ(supervisor().Standbys(), 2);
  spawner_.Print(standbys[0].pid, "a warning while importing\n");
  spawner_.Exit(workers[1].pid, 1);
  supervisor().Poll();
  EXPECT_EQ(outbox_.Take(), (std::vector<std::string>{"j1 gen 0 rank 1 pid 1002 exited 1",
                                                     "j1 gen 0 rank 0 pid 1000 killed signal 15"}));
  EXPECT_TRUE(spawner_.SignalsTo(standbys[0].pid).empty());
  EXPECT_TRUE(spawner_.SignalsTo(standbys[1].pid).empty());

  // The restart: each rank starts in its local rank's standby, which gets its whole environment.
  supervisor().StartJob(ProgramStart(1, 2, 1));
  EXPECT_EQ(outbox_.Take(), (std::vector<std::string>{"j1 gen 1 rank 0 pid 1001 running",
                                                     "j1 gen 1 rank 1 pid 1003 running"}));
  bool closed = false;
  const std::vector<std::string> env = Handed(standbys[1].pid, &closed);
  EXPECT_TRUE(closed) << "the end of its input says the environment is whole";
  ASSERT_FALSE(env.empty());
  EXPECT_EQ(env[0], work_dir_ + "/jobs/j1/gen-1") << "where the rank starts: its generation's directory";
  for (const char* entry : {"LTRAIN_GENERATION=1", "LTRAIN_RANK=1", "RANK=1", "TORCHELASTIC_RESTART_COUNT=1",
                            "LTRAIN_RDZV_SCOPE=j1/1/"}) {
    EXPECT_NE(std::find(env.begin(), env.end(), entry), env.end()) << entry;
  }
  EXPECT_EQ(std::find(env.begin(), env.end(), "LTRAIN_GENERATION=0"), env.end());
  // One restart is left: new standbys stand beside the new ranks.
  EXPECT_EQ(Spawns(false).size(), 2u) << "no new process for a rank";
  EXPECT_EQ(Spawns(true).size(), 4u);
  EXPECT_EQ(supervisor().Standbys(), 2);
  ASSERT_EQ(supervisor().Running().size(), 2u);
  EXPECT_EQ(supervisor().Running()[0].pid(), standbys[0].pid);
  // The taken standby now writes to its rank's log and to the coordinator.
  spawner_.Print(standbys[1].pid, "step 1\n");
  supervisor().Poll();
  EXPECT_EQ(outbox_.Take(), (std::vector<std::string>{"logs j1: [1] step 1"}));
  // A stop of the job now stops the ranks, not the next standbys.
  supervisor().StopJob("j1", 1);
  EXPECT_EQ(spawner_.SignalsTo(standbys[1].pid), (std::vector<int>{SIGTERM, SIGCONT}));
  EXPECT_TRUE(spawner_.SignalsTo(Spawns(true)[2].pid).empty());
  supervisor().Poll();
  EXPECT_EQ(ReadFile(work_dir_ + "/jobs/j1/gen-1/rank-1.log"), "step 1\n");
}

TEST_F(StandbyTest, NoStandbyWhenTheJobCannotRestartOrDoesNotAskForOne) {
  supervisor().StartJob(ProgramStart(2, 2, 2, /*max_restarts=*/2));
  EXPECT_TRUE(Spawns(true).empty()) << "the last restart was used";
  v1::StartJobCommand start = ProgramStart(0, 1, 0);
  start.set_job_id("j2");
  start.set_rendezvous_scope("j2/0/");
  start.set_recipe_yaml("name: j\nfault: {max_restarts: 2}\nentrypoint: {command: [python3, train.py], warm_standby: off}\n");
  supervisor().StartJob(start);
  EXPECT_TRUE(Spawns(true).empty()) << "warm_standby is off";
  start.set_job_id("j3");
  start.set_rendezvous_scope("j3/0/");
  start.set_recipe_yaml("name: j\nfault: {max_restarts: 2}\nentrypoint: {command: [./train.sh]}\n");
  supervisor().StartJob(start);
  EXPECT_TRUE(Spawns(true).empty()) << "not a Python program";
  EXPECT_EQ(Spawns(false).size(), 4u);
}

TEST_F(StandbyTest, GpuStandbysMakeTheirGpusContext) {
  v1::StartJobCommand start = ProgramStart(0, 1, 0);
  start.set_recipe_yaml("name: j\nfault: {max_restarts: 1}\nentrypoint: {command: [python3, train.py], warm_standby: gpu}\n");
  supervisor().StartJob(start);
  const auto standbys = Spawns(true);
  ASSERT_EQ(standbys.size(), 1u);
  const std::vector<std::string>& args = standbys[0].spec.args;
  EXPECT_EQ(std::vector<std::string>(args.begin(), args.begin() + 2), (std::vector<std::string>{"--standby", "gpu"}));
}

TEST_F(StandbyTest, StandbysEndWhenTheJobsRanksHereAllSucceed) {
  supervisor().StartJob(ProgramStart(0, 2, 0));
  const auto workers = Spawns(false);
  const auto standbys = Spawns(true);
  spawner_.Exit(workers[0].pid, 0);
  supervisor().Poll();
  EXPECT_TRUE(spawner_.SignalsTo(standbys[0].pid).empty()) << "rank 1 still runs";
  spawner_.Exit(workers[1].pid, 0);
  supervisor().Poll();
  EXPECT_EQ(spawner_.SignalsTo(standbys[0].pid), (std::vector<int>{SIGKILL}));
  EXPECT_EQ(spawner_.SignalsTo(standbys[1].pid), (std::vector<int>{SIGKILL}));
  supervisor().Poll();
  EXPECT_TRUE(supervisor().Idle());
  EXPECT_EQ(outbox_.Take(), (std::vector<std::string>{"j1 gen 0 rank 0 pid 1000 running", "j1 gen 0 rank 1 pid 1002 running",
                                                     "j1 gen 0 rank 0 pid 1000 exited 0",
                                                     "j1 gen 0 rank 1 pid 1002 exited 0"}))
      << "a standby's end is no report";
}

TEST_F(StandbyTest, StandbysOfAJobWithNoRankHereEndAfterTheirLinger) {
  supervisor().StartJob(ProgramStart(0, 1, 0));
  const pid_t worker = Spawns(false)[0].pid;
  const pid_t standby = Spawns(true)[0].pid;
  spawner_.Die(worker, SIGSEGV);
  supervisor().Poll();
  clock_.AdvanceMs(Supervisor::kStandbyLingerMs - 1);
  supervisor().Poll();
  EXPECT_TRUE(spawner_.SignalsTo(standby).empty()) << "a restart may still come";
  clock_.AdvanceMs(1);
  supervisor().Poll();
  EXPECT_EQ(spawner_.SignalsTo(standby), (std::vector<int>{SIGKILL}));
  EXPECT_EQ(supervisor().Standbys(), 0);
}

TEST_F(StandbyTest, ARankWhoseStandbyEndedOrDoesNotFitStartsAsANewProcess) {
  supervisor().StartJob(ProgramStart(0, 2, 0));
  const auto standbys = Spawns(true);
  spawner_.Exit(Spawns(false)[0].pid, 1);
  spawner_.Exit(standbys[0].pid, 1);  // its interpreter failed to start
  supervisor().Poll();
  supervisor().Poll();
  EXPECT_EQ(supervisor().Standbys(), 1);
  // The next generation has one rank here: local rank 0 starts anew, the standby of local rank 1 ends.
  v1::StartJobCommand start = ProgramStart(1, 1, 1, /*max_restarts=*/1);
  supervisor().StartJob(start);
  EXPECT_EQ(Spawns(false).size(), 3u);
  EXPECT_EQ(spawner_.SignalsTo(standbys[1].pid).back(), SIGKILL);
  bool closed = false;
  EXPECT_TRUE(Handed(standbys[1].pid, &closed).empty());
}

}  // namespace
}  // namespace ltrain::agent
