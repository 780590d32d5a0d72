// `ltrain-exec [--env NAME=VALUE]... [--output-timeout S] [--standby import|gpu] -- PROGRAM ARGS...`: a user's program as one rank, the
// way torchrun's per-rank process runs it. The agent starts one such proxy per rank with its LTRAIN_*
// environment (and the torchrun variables RANK, WORLD_SIZE, ...), and the recipe's entrypoint.env as
// --env arguments, which reach the program's environment but not the proxy's; the proxy
//   - agrees with the other ranks on MASTER_ADDR:MASTER_PORT through the generation's rendezvous
//     store: rank 0 picks a free port on LTRAIN_BIND_ADDR and publishes "ADDR:PORT" under
//     "torchrun/master"; every rank reads it (init_process_group(init_method="env://") works as
//     under torchrun). LTRAIN_BIND_ADDR 0.0.0.0 or unset advertises 127.0.0.1, which only ranks on
//     rank 0's node can reach: a job of several nodes must give rank 0 an address the others reach;
//   - runs the program in its own process group (the agent's signals reach both), with
//     MASTER_ADDR, MASTER_PORT and LTRAIN_PROGRESS_FD added to the environment, and, where
//     LTRAIN_BIND_ADDR is an address of a network interface other than loopback,
//     GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME naming it unless already set;
//   - relays what the program writes to descriptor LTRAIN_PROGRESS_FD, one report a line, to the
//     agent as this rank's progress (steps, phase, loss: what `ltrain status` shows and what hang
//     detection reads), from the proxy's one thread plus the progress reporter's;
//   - ends as the program ended: its exit code, or the same signal.
// SIGTERM and SIGINT leave the proxy alone: the program gets them through the process group and
// decides when to end; the proxy waits for it. A stop after a final checkpoint (ltrain stop
// --checkpoint) is not relayed: such a program checkpoints on SIGTERM if it wants to.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "worker/control/progress.h"

namespace ltrain::worker {

// One line the program wrote to LTRAIN_PROGRESS_FD: fields separated by spaces, each key=value.
//   step=N          the step being worked on (1-based)
//   phase=NAME      data, forward, backward, optimizer, checkpoint, eval, ...
//   loss=X          the loss of a completed step: the line reports that step (step=, or the last
//                   step named) as completed
//   total_steps=N   when known
//   tokens=N        tokens processed in that step (for tokens/s)
//   step_ms=X       duration of that step
//   lr=X
// A key left out is unset.
struct ProgressLine {
  std::optional<int64_t> step;
  std::optional<std::string> phase;
  std::optional<double> loss;
  std::optional<int64_t> total_steps;
  std::optional<int64_t> tokens;
  std::optional<double> step_ms;
  std::optional<double> lr;
};

// nullopt for a line that is no report: empty, no known key, a field without '=', a known key with
// a value that is not its number (negative counts and durations included) or an empty phase. Unknown
// keys are skipped, so programs may report more than the proxy reads. A trailing '\r' is ignored.
std::optional<ProgressLine> ParseProgressLine(std::string_view line);

// Turns the program's reports into `progress`: a report with a loss records a completed step (with
// the last total_steps given); every report sets the step and phase, keeping the previous ones
// where it names none, and is the program's sign of life for hang detection. One thread.
class ProgramProgress {
 public:
  explicit ProgramProgress(Progress& progress) : progress_(progress) {}

  void Apply(const ProgressLine& line);
  // Until the program's first report: its running time, as work that moves (a program that never
  // reports is supervised by its exit and the heartbeats, never taken for a hang).
  void Tick(int64_t running_ms);

  int64_t step() const { return step_; }
  const std::string& phase() const { return phase_; }

 private:
  Progress& progress_;
  int64_t step_ = 0;
  int64_t total_steps_ = 0;
  std::string phase_ = "startup";
  bool reported_ = false;
};

// exec's arguments: what follows "exec" on the command line.
struct ExecArgs {
  std::vector<std::string> env;      // NAME=VALUE, for the program: over torchrun's variables, under
                                     // MASTER_ADDR, MASTER_PORT and LTRAIN_PROGRESS_FD
  std::vector<std::string> program;  // PROGRAM ARGS...
  // > 0: the program's stdout and stderr pass through the proxy, and a program that prints and
  // reports nothing for this long is killed, named as hung (exit 1: restartable). entrypoint.output_timeout_s.
  double output_timeout_s = 0;
  // "import" or "gpu": a warm standby (entrypoint.warm_standby). PROGRAM is a Python command
  // (ParsePythonCommand); its interpreter starts at once and imports torch and what an optimizer
  // loads on first use (with "gpu", it also makes the context of GPU LTRAIN_LOCAL_RANK), while the proxy waits on stdin for the rank it
  // becomes: its working directory and environment, each NUL-terminated (the directory, then NAME=VALUE
  // entries), then the end of input. The proxy then moves there, replaces its own environment with
  // them and goes on as any rank's proxy does, except that the waiting interpreter, moved and given
  // the program's environment the same way, runs the script (runpy, as __main__) instead of a new
  // process. An input that ends empty ends the standby (exit 0). "": no standby.
  std::string standby;
};

// nullopt, with `error` set, for anything but [--env NAME=VALUE]... [--output-timeout SECONDS]
// [--standby import|gpu] -- PROGRAM [ARGS...] (with --standby, a Python command).
std::optional<ExecArgs> ParseExecArgs(const std::vector<std::string>& args, std::string& error);

// Runs args.program as this rank's program, as above; returns the exit code for ltrain-worker: the
// program's own; 2 for a bad environment; 1 when the rendezvous store cannot be reached or the
// program cannot be started (a restart may succeed); 127 when PROGRAM cannot be executed. A program
// killed by a signal kills the proxy with the same signal.
int RunProgram(const ExecArgs& args);

}  // namespace ltrain::worker
