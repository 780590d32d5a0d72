// `ltrain run`: programs of the user's own under ltrain, as torchrun runs them. A DDP script over
// Gloo with Debian's python3-torch (the all-reduce sums the ranks), a rank killed mid-run (the
// job restarts it with TORCHELASTIC_RESTART_COUNT=1 and the script resumes from its own
// checkpoint; in interpreters started ahead, unless --warm-standby off), a program that exits 1 (the job fails with its last lines), and a recipe that mixes
// a program with ltrain's trainer (refused); a program that stops reporting progress is named hung,
// one that never reports is not.
#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>
#include <string>

#include "tests/support/subprocess.h"

namespace ltrain::testing {
namespace {

// A torchrun script: init_process_group over env://, an all-reduce of rank + 1, a DDP step, and a
// checkpoint of its own (step.txt in the working directory) that a restart resumes from. KILL_AT
// (restart 0 only): rank 1 kills itself with SIGKILL at that step.
constexpr const char* kScript = R"(import os, signal, sys
WARM = "torch" in sys.modules  # run by a warm standby, which imported torch before the script
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
assert world == int(os.environ["WORLD_SIZE"]), (world, os.environ["WORLD_SIZE"])
restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
t = torch.tensor([float(rank + 1)])
dist.all_reduce(t)
print(f"rank {rank} of {world} local {os.environ['LOCAL_RANK']} restart {restart} sum {t.item():g}", flush=True)
assert t.item() == world * (world + 1) / 2
print(f"rank {rank} restart {restart} warm {int(WARM)} as {__name__} in {os.getcwd()} argv {sys.argv[1:]}", flush=True)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
start = int(open("step.txt").read()) if os.path.exists("step.txt") else 0
if start:
    print(f"rank {rank} resumed from step {start}", flush=True)
kill_at = int(os.environ.get("KILL_AT", "0"))
for step in range(start + 1, 7):
    if restart == 0 and rank == 1 and step == kill_at:
        os.kill(os.getpid(), signal.SIGKILL)
    loss = model(torch.ones(2, 4)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    dist.barrier()
    if rank == 0:
        with open("step.txt.tmp", "w") as f:
            f.write(str(step))
        os.replace("step.txt.tmp", "step.txt")
    print(f"rank {rank} step {step} loss {loss.item():.4f}", flush=True)
dist.destroy_process_group()
)";

class RunTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ProcessResult torch = RunProcess({"/usr/bin/python3", "-c", "import torch.distributed"}, {}, std::chrono::seconds(60));
    ASSERT_EQ(torch.exit_code, 0) << "these tests run a PyTorch script: install Debian's python3-torch\n" << torch.output;
    dir_.Write("train.py", kScript);
  }

  std::map<std::string, std::string> Env() const { return {{"LTRAIN_HOME", dir_.Join("home")}}; }

  ProcessResult Run(const std::vector<std::string>& flags, const std::vector<std::string>& program) {
    std::vector<std::string> argv = {LtrainBinary(), "run", "--workdir", dir_.path()};
    argv.insert(argv.end(), flags.begin(), flags.end());
    argv.push_back("--");
    argv.insert(argv.end(), program.begin(), program.end());
    return RunProcess(argv, Env(), std::chrono::seconds(180));
  }

  TempDir dir_;
};

TEST_F(RunTest, DdpScriptOverGlooRunsOnTwoRanks) {
  ProcessResult result = Run({"--nproc-per-node", "2"}, {"/usr/bin/python3", "train.py"});
  ASSERT_EQ(result.exit_code, 0) << result.output;
  EXPECT_NE(result.output.find("rank 0 of 2 local 0 restart 0 sum 3"), std::string::npos) << result.output;
  EXPECT_NE(result.output.find("rank 1 of 2 local 1 restart 0 sum 3"), std::string::npos) << result.output;
  EXPECT_NE(result.output.find("rank 1 step 6"), std::string::npos) << result.output;
  EXPECT_NE(result.output.find("SUCCEEDED"), std::string::npos) << result.output;
}

TEST_F(RunTest, KilledRankRestartsAndTheScriptResumesFromItsCheckpoint) {
  ProcessResult result = Run({"--nproc-per-node", "2", "--max-restarts", "1", "--env", "KILL_AT=4", "--warm-standby", "off"},
                             {"/usr/bin/python3", "train.py"});
  ASSERT_EQ(result.exit_code, 0) << result.output;
  EXPECT_NE(result.output.find("rank 0 restart 1 warm 0"), std::string::npos) << "a new process: " << result.output;
  EXPECT_NE(result.output.find("SIGKILL"), std::string::npos) << result.output;
  EXPECT_NE(result.output.find("rank 0 of 2 local 0 restart 1 sum 3"), std::string::npos) << result.output;
  // Step 3 was the last every rank finished before the kill at step 4.
  EXPECT_NE(result.output.find("rank 0 resumed from step 3"), std::string::npos) << result.output;
  EXPECT_NE(result.output.find("rank 1 step 6"), std::string::npos) << result.output;
}

// By default (--warm-standby auto), the restarted ranks run the script in interpreters that imported
// torch while the first ones trained, as __main__, in the same directory, with the new generation's
// environment.
TEST_F(RunTest, KilledRankRestartsInItsWarmStandby) {
  ProcessResult result = Run({"--nproc-per-node", "2", "--max-restarts", "1", "--env", "KILL_AT=4", "--output-timeout", "120"},
                             {"/usr/bin/python3", "-u", "train.py", "--flag"});
  ASSERT_EQ(result.exit_code, 0) << result.output;
  const std::string where = " as __main__ in " + dir_.path() + " argv ['--flag']";
  for (const char* rank : {"0", "1"}) {
    EXPECT_NE(result.output.find("rank " + std::string(rank) + " restart 0 warm 0" + where), std::string::npos)
        << result.output;
    EXPECT_NE(result.output.find("rank " + std::string(rank) + " restart 1 warm 1" + where), std::string::npos)
        << result.output;
  }
  EXPECT_NE(result.output.find("rank 0 of 2 local 0 restart 1 sum 3"), std::string::npos) << result.output;
  EXPECT_NE(result.output.find("rank 0 resumed from step 3"), std::string::npos) << result.output;
  EXPECT_NE(result.output.find("rank 1 step 6"), std::string::npos) << result.output;
  EXPECT_NE(result.output.find("SUCCEEDED"), std::string::npos) << result.output;
}

TEST_F(RunTest, ProgramThatExitsOneFailsTheJobWithItsLastLines) {
  ProcessResult result =
      Run({"--name", "fails"}, {"/bin/sh", "-c", "echo reading the input; echo \"no input on rank $RANK\" >&2; exit 1"});
  EXPECT_EQ(result.exit_code, 1) << result.output;
  EXPECT_NE(result.output.find("FAILED"), std::string::npos) << result.output;
  EXPECT_NE(result.output.find("no input on rank 0"), std::string::npos) << result.output;
  EXPECT_NE(result.output.find("ltrain: `ltrain resume fails-1` starts the program again; to have such failures "
                               "restart it by themselves, give `ltrain run` --max-restarts N"),
            std::string::npos)
      << result.output;
}

// torchrun's error reporting: each rank gets TORCHELASTIC_ERROR_FILE, where PyTorch's `@record`
// writes the exception; the job's cause is then the failing rank's exception and traceback, with the
// script's line. Rank 0 waits in a barrier that rank 1 never joins.
TEST_F(RunTest, RecordedExceptionOfARankIsTheJobsCause) {
  dir_.Write("raises.py", R"(import os
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

def check(rank):
    if rank == 1:
        raise ValueError(f"rank {rank} found no shard to read")

@record
def main():
    dist.init_process_group("gloo")
    print("error file", os.environ["TORCHELASTIC_ERROR_FILE"], os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"],
          os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"], flush=True)
    check(dist.get_rank())
    dist.barrier()

main()
)");
  ProcessResult result = Run({"--name", "raises", "--nproc-per-node", "2"}, {"/usr/bin/python3", "raises.py"});
  EXPECT_EQ(result.exit_code, 1) << result.output;
  EXPECT_NE(result.output.find("rank-1-error.json 1 SIGTERM,SIGINT,SIGHUP,SIGQUIT"), std::string::npos) << result.output;
  const size_t cause = result.output.find("rank 1 on ");
  ASSERT_NE(cause, std::string::npos) << result.output;
  const std::string text = result.output.substr(cause);
  EXPECT_NE(text.find("exited with code 1: ValueError: rank 1 found no shard to read (error file "), std::string::npos)
      << result.output;
  EXPECT_NE(text.find("traceback:"), std::string::npos) << result.output;
  EXPECT_NE(text.find("raises.py\", line 7, in check"), std::string::npos) << result.output;
}

// A program run from a build tree imports ltrain_progress as one run from the Debian package does.
TEST_F(RunTest, AProgramImportsLtrainProgressFromABuildTree) {
  ProcessResult result =
      Run({"--name", "progress"},
          {"/usr/bin/python3", "-c", "import ltrain_progress; print('imported', ltrain_progress.__file__)"});
  EXPECT_EQ(result.exit_code, 0) << result.output;
  EXPECT_NE(result.output.find("imported "), std::string::npos) << result.output;
}

// `ltrain resume` starts a failed program again, one restart later.
TEST_F(RunTest, ResumedProgramStartsWithAHigherRestartCount) {
  const std::vector<std::string> program = {
      "/bin/sh", "-c", "echo \"restart count $TORCHELASTIC_RESTART_COUNT\"; test $TORCHELASTIC_RESTART_COUNT -ge 1"};
  ProcessResult first = Run({"--name", "again"}, program);
  EXPECT_EQ(first.exit_code, 1) << first.output;
  EXPECT_NE(first.output.find("restart count 0"), std::string::npos) << first.output;
  ProcessResult resumed = RunProcess({LtrainBinary(), "resume", "again-1"}, Env(), std::chrono::seconds(120));
  EXPECT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_NE(resumed.output.find("restart count 1"), std::string::npos) << resumed.output;
}

// A program that reports a step and then stops reporting is named hung within the timeout (and
// the polls around it); one that never reports is supervised by its exit alone, however long.
TEST_F(RunTest, ProgramThatStopsReportingIsNamedHung) {
  const auto start = std::chrono::steady_clock::now();
  // Rank 0 goes on reporting steps; rank 1 reports one and stops.
  const std::string program =
      "if [ \"$RANK\" = 1 ]; then echo step=1 phase=train >&$LTRAIN_PROGRESS_FD; sleep 600; fi; "
      "i=1; while true; do echo \"step=$i phase=train loss=1.5\" >&$LTRAIN_PROGRESS_FD; i=$((i + 1)); sleep 0.2; done";
  ProcessResult result = Run({"--name", "stuck", "--nproc-per-node", "2", "--hang-timeout", "2"}, {"/bin/sh", "-c", program});
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_EQ(result.exit_code, 1) << result.output;
  EXPECT_NE(result.output.find("hang: rank 1 made no progress for 2s"), std::string::npos) << result.output;
  EXPECT_LT(seconds, 30) << result.output;
}

// A program's ranks as PyTorch's NCCL flight recorder leaves them, without PyTorch: each makes the
// pipe PyTorch's watchdog reads (TORCH_NCCL_DEBUG_INFO_PIPE_FILE) and, asked through it, writes its
// dump in PyTorch's format (a pickle) where TORCH_FR_DUMP_TEMP_FILE says. Rank 0 got to all_reduce #2
// and waits in it; rank 1 ended #1 and is elsewhere. `timeout`: rank 0's collective times out (it
// dumps and exits 1, as PyTorch's watchdog). `hang`: rank 1 stops reporting steps.
constexpr const char* kFlightRecorderScript = R"(import os, pickle, sys, threading, time
rank = int(os.environ["RANK"])
prefix = os.environ["TORCH_FR_DUMP_TEMP_FILE"]
pipes = os.environ["TORCH_NCCL_DEBUG_INFO_PIPE_FILE"]
assert os.environ["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "2000"

def entry(record, seq, state):
    now = time.time_ns()
    return {"record_id": record, "pg_id": 0, "process_group": ("0", "default_pg"), "collective_seq_id": seq,
            "p2p_seq_id": 0, "op_id": seq, "profiling_name": "nccl:all_reduce", "time_created_ns": now,
            "input_sizes": [[1024, 1024]], "input_dtypes": ["Float"], "output_sizes": [[1024, 1024]],
            "output_dtypes": ["Float"], "state": state, "time_discovered_started_ns": None,
            "time_discovered_completed_ns": now if state == "completed" else None, "retired": state == "completed",
            "timeout_ms": 600000, "is_p2p": False, "frames": [{"name": "main", "filename": "fr.py", "line": 1}]}

def dump():
    entries = [entry(0, 1, "completed")] + ([entry(1, 2, "started")] if rank == 0 else [])
    data = {"version": "2.10", "pg_config": {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1]"}},
            "pg_status": {}, "entries": entries}
    with open(prefix + str(rank), "wb") as f:
        pickle.dump(data, f, protocol=2)
    print(f"rank {rank} dumped", flush=True)

pipe = pipes + str(rank) + ".pipe"
os.mkfifo(pipe)
fd = os.open(pipe, os.O_RDONLY | os.O_NONBLOCK)
def watch():
    while True:
        try:
            if os.read(fd, 1):
                dump()
                return
        except BlockingIOError:
            pass
        time.sleep(0.1)
threading.Thread(target=watch, daemon=True).start()

progress = os.fdopen(int(os.environ["LTRAIN_PROGRESS_FD"]), "w", buffering=1)
if sys.argv[1] == "timeout":
    if rank == 0:
        while not os.path.exists(pipes + "1.pipe"):
            time.sleep(0.05)
        dump()
        print("rank 0: all_reduce #2 timed out", flush=True)
        sys.exit(1)
    time.sleep(600)
else:
    step = 1
    while True:
        progress.write(f"step={step} phase=train\n")
        if rank == 1:
            time.sleep(600)
        step += 1
        time.sleep(0.2)
)";

// What the flight recorder's file beside the job holds, from the path a cause names.
std::string FlightRecorderFile(const std::string& output) {
  std::smatch match;
  if (!std::regex_search(output, match, std::regex(R"(every rank's dump: (\S+flight-recorder-gen-0\.txt)\))"))) return "";
  std::ifstream file(match[1].str());
  std::stringstream text;
  text << file.rdbuf();
  return text.str();
}

// A rank whose collective timed out fails the job: the cause has every rank's flight recorder, the
// others' asked for through their pipes before they were stopped.
TEST_F(RunTest, TimedOutCollectiveIsReadFromEveryRanksFlightRecorder) {
  dir_.Write("fr.py", kFlightRecorderScript);
  ProcessResult result = Run({"--name", "frtimeout", "--nproc-per-node", "2"}, {"/usr/bin/python3", "fr.py", "timeout"});
  EXPECT_EQ(result.exit_code, 1) << result.output;
  EXPECT_NE(result.output.find("rank 0 on local exited with code 1; NCCL flight recorder: all_reduce #2 of default_pg "
                               "(4.2 MB) is not completed: rank 0 started it; rank 1 never enqueued it, its last "
                               "collective was all_reduce #1 of default_pg (completed) (every rank's dump: "),
            std::string::npos)
      << result.output;
  const std::string file = FlightRecorderFile(result.output);
  EXPECT_NE(file.find("rank 0: " + dir_.path()), std::string::npos) << file;
  const size_t rank1 = file.find("rank 1: ");
  ASSERT_NE(rank1, std::string::npos) << file;
  EXPECT_NE(file.find("  all_reduce #2 of default_pg, 4.2 MB, enqueued "), std::string::npos) << file;
  EXPECT_NE(file.find("  all_reduce #1 of default_pg, 4.2 MB, enqueued ", rank1), std::string::npos) << file;
}

// A program that stops reporting is named hung with every rank's flight recorder, asked for before
// the ranks are stopped.
TEST_F(RunTest, HungProgramIsToldWithEveryRanksFlightRecorder) {
  dir_.Write("fr.py", kFlightRecorderScript);
  ProcessResult result =
      Run({"--name", "frhang", "--nproc-per-node", "2", "--hang-timeout", "2"}, {"/usr/bin/python3", "fr.py", "hang"});
  EXPECT_EQ(result.exit_code, 1) << result.output;
  EXPECT_NE(result.output.find("hang: rank 1 made no progress for 2s"), std::string::npos) << result.output;
  EXPECT_NE(result.output.find("; NCCL flight recorder: all_reduce #2 of default_pg (4.2 MB) is not completed: rank 0 "
                               "started it; rank 1 never enqueued it, its last collective was all_reduce #1 of "
                               "default_pg (completed) (every rank's dump: "),
            std::string::npos)
      << result.output;
  EXPECT_NE(FlightRecorderFile(result.output).find("rank 1: "), std::string::npos) << result.output;
}

TEST_F(RunTest, ProgramThatNeverReportsIsNoHang) {
  ProcessResult result = Run({"--name", "quiet", "--hang-timeout", "1"}, {"/bin/sh", "-c", "sleep 4; echo done"});
  EXPECT_EQ(result.exit_code, 0) << result.output;
  EXPECT_EQ(result.output.find("made no progress"), std::string::npos) << result.output;
}

// With --output-timeout, a program that prints while it works goes on; one that falls silent is
// stopped as hung within the timeout and a little, named by rank, and restarted by the policy.
TEST_F(RunTest, ProgramThatFallsSilentIsStoppedAsHung) {
  const auto start = std::chrono::steady_clock::now();
  // Rank 1 prints for a second, then nothing, in its first run; in the restart it finishes.
  const std::string program =
      "for i in 1 2 3 4 5; do echo \"working $i\"; sleep 0.2; done; "
      "if [ \"$RANK\" = 1 ] && [ \"$TORCHELASTIC_RESTART_COUNT\" = 0 ]; then sleep 600; fi; echo finished";
  ProcessResult result = Run({"--name", "silent", "--nproc-per-node", "2", "--output-timeout", "2", "--max-restarts", "1"},
                             {"/bin/sh", "-c", program});
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_EQ(result.exit_code, 0) << result.output;
  EXPECT_NE(result.output.find("rank 1 printed and reported nothing for 2 s (entrypoint.output_timeout_s); stopping it as hung"),
            std::string::npos)
      << result.output;
  EXPECT_NE(result.output.find("[rank 1] working 5"), std::string::npos) << "output passes through: " << result.output;
  EXPECT_NE(result.output.find("restart 1 of 1"), std::string::npos) << result.output;
  EXPECT_LT(seconds, 30) << result.output;
}

TEST_F(RunTest, RecipeWithAProgramAndAModelIsRefused) {
  const std::string recipe =
      dir_.Write("mixed.yaml", "entrypoint: {command: [python3, train.py]}\nmodel: {layers: 2}\n");
  ProcessResult result = RunProcess({LtrainBinary(), "launch", recipe}, Env(), std::chrono::seconds(60));
  EXPECT_EQ(result.exit_code, 2) << result.output;
  EXPECT_NE(result.output.find("mixed.yaml:2:"), std::string::npos) << result.output;
  EXPECT_NE(result.output.find("remove model"), std::string::npos) << result.output;
}

}  // namespace
}  // namespace ltrain::testing
