// Supervisor: the workers of this node, from spawn to reaped exit. It spawns a job generation's
// workers with their environment, writes each rank's output to its log file and forwards the lines,
// reports every start and exit (a worker's last lines before its exit report), names OOM kills,
// stops a job's workers with SIGTERM and SIGKILL after the grace, stops the job's other workers on
// this node when one fails, and kills leftovers of older generations.
//
// Warm standbys (entrypoint.warm_standby, auto unless off): beside each rank of a Python program
// that may still be restarted, a second `ltrain-exec --standby` whose interpreter has imported
// torch waits on its stdin. The next generation's rank of the same local rank becomes that process: the supervisor
// writes it the rank's working directory and whole environment (NUL-terminated: the directory,
// then NAME=VALUE entries; then the end of input) instead of spawning. A standby is no worker: it is neither reported nor stopped with its job's
// workers; it ends when a newer generation does not take it, when the job's workers on this node
// all succeed, or once they have all been gone kStandbyLingerMs.
//
// Who calls it: one long-lived thread owns it (the agent's supervisor thread) and makes every call,
// because PR_SET_PDEATHSIG ties each worker to the thread that forked it. It has no thread, no
// socket and no sleep of its own: the caller waits for output (poll on OutputFds(), or a short
// sleep) and calls Poll() again. Time comes from the Clock, processes from the ProcessSpawner.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <deque>
#include <functional>
#include <limits>
#include <map>
#include <set>
#include <memory>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "agent/process_spawner.h"
#include "common/clock.h"
#include "common/files.h"
#include "common/status.h"
#include "ltrain/v1/ltrain.pb.h"

namespace ltrain::agent {

// What the supervisor has for the coordinator.
using SupervisorMessage = std::variant<v1::WorkerStateReport, v1::PushLogsRequest>;

// Where the supervisor's messages go. Called on the supervisor's thread, from inside its calls.
class SupervisorOutbox {
 public:
  virtual ~SupervisorOutbox() = default;
  // Messages must reach the coordinator in the order they are given here.
  virtual void Send(SupervisorMessage message) = 0;
  // The workers not yet reaped, each time that set changes; before the report that tells of it.
  virtual void RunningChanged(const std::vector<v1::RunningWorker>& running) = 0;
};

struct SupervisorOptions {
  std::string node_id;
  std::string work_dir;       // jobs/<job>/gen-<generation>/ holds the recipe and the per-rank logs
  std::string worker_binary;
  std::string bind_address;   // where the workers listen for collectives (LTRAIN_BIND_ADDR)
  std::string agent_address;  // HOST:PORT of the agent's services for workers (LTRAIN_AGENT, LTRAIN_RDZV)
  int64_t stop_grace_ms = 3000;  // SIGTERM, then SIGKILL after this long
  // The cgroup's OOM-kill count, read when a worker starts and when one dies of SIGKILL.
  std::function<std::optional<int64_t>()> read_oom_kill_count;
  // Called with each exit report of a reaped worker before it is sent: what the caller knows
  // about the rank (its last progress, say) goes in here.
  std::function<void(v1::WorkerStateReport&)> complete_exit_report;
  // The secret with which the workers of a starting job generation reach the agent's services
  // (WorkerCredentials::Issue); it goes to them in jobs/<job>/gen-<generation>/agent-secret, 0600,
  // named by LTRAIN_AGENT_SECRET_FILE. Unset or empty: no secret.
  std::function<std::string(const v1::StartJobCommand&)> issue_worker_secret;
  // Called once the last worker of a job generation on this node is reaped: its secret goes.
  std::function<void(const std::string& job_id, int generation)> revoke_worker_secret;
};

// Whether a start command can be carried out as it is: a job id that is a plain file name, ranks
// within the world and each once, local ranks within the node, a key scope under the job. Any
// problem is InvalidArgument naming it.
Status CheckStartCommand(const v1::StartJobCommand& start);

class Supervisor {
 public:
  static constexpr size_t kTailLines = 12;  // log lines an exit report carries
  // What one forwarded line may hold (the log file keeps all of it), what one batch of lines sent
  // to the coordinator may hold, and how long a line without a newline may grow before it is
  // taken as a line of its own: no output a worker prints can make a message the coordinator refuses.
  static constexpr size_t kMaxForwardedLineBytes = 16 << 10;
  static constexpr size_t kMaxBatchBytes = 512 << 10;
  static constexpr size_t kMaxPartialLineBytes = 1 << 20;
  // How long the standbys of a job with no worker on this node wait for its next generation (a
  // restart's backoff, an elastic job's wait for nodes) before they end.
  static constexpr int64_t kStandbyLingerMs = 5 * 60 * 1000;

  // `spawner`, `clock` and `outbox` must outlive the supervisor. An empty read_oom_kill_count
  // reads this process's cgroup (ReadOomKillCount).
  Supervisor(SupervisorOptions options, ProcessSpawner& spawner, const Clock& clock, SupervisorOutbox& outbox);
  ~Supervisor();  // closes the output of the workers still there; kills nothing (see KillAll)
  Supervisor(const Supervisor&) = delete;
  Supervisor& operator=(const Supervisor&) = delete;

  // Kills the job's workers of older generations, writes the recipe and spawns a worker per
  // assignment; each gets a "running" report, or an "exited" one with code 127 when it cannot start.
  // A command CheckStartCommand refuses starts nothing: each assignment gets an "exited" report
  // with kWorkerExitNoRestart and the reason (none when the job id itself is unusable).
  void StartJob(const v1::StartJobCommand& start);
  // SIGTERM and SIGCONT to the job's workers of `generation` and older (all when generation < 0)
  // that are not stopping already; SIGKILL follows in Poll once the grace is over.
  void StopJob(const std::string& job_id, int generation);
  // The same for every job: the coordinator has been away too long.
  void StopAll();
  // Asks the job's ranks of `generation` here for PyTorch's NCCL flight-recorder dumps (through the
  // pipes PyTorch's watchdog reads) and, once each asked rank has written its dump or exited, or
  // kDumpWaitMs passed, sends every dump of the generation's directory in a report of state
  // "collectives" (rank -1). Ranks with no pipe (no NCCL group, a program of no PyTorch) are not
  // waited for: without any, the report goes at the next Poll.
  void DumpCollectives(const std::string& job_id, int generation);
  // PyTorch symbolizes the entries' stacks when it dumps: seconds (7 s seen on an H100 for a few entries).
  static constexpr int64_t kDumpWaitMs = 15000;
  // SIGKILL to every worker now (shutdown); Poll reaps them, Idle() says when all are gone.
  void KillAll();

  // One step: reads the output that is ready, reaps exits (each worker's last lines, then its
  // report; a failure stops the job's other workers here), SIGKILLs the stopped workers whose grace
  // is over, and sends the lines read.
  void Poll();

  bool Idle() const { return workers_.empty(); }
  // The output descriptors to wait on between calls to Poll.
  std::vector<int> OutputFds() const;
  std::vector<v1::RunningWorker> Running() const;
  // A standby of `job_id`'s generation `generation` waits here.
  bool HasStandby(const std::string& job_id, int generation) const;
  // Warm standbys alive (spawned, not yet taken by a generation, not ended).
  int Standbys() const;

 private:
  struct Worker {
    std::string job_id;
    int generation = 0;
    int rank = 0;
    pid_t pid = -1;
    int output_fd = -1;
    std::string partial;  // output after the last newline
    AppendFile log;
    std::string log_path;
    std::deque<std::string> tail;
    int64_t kill_at_ms = 0;  // when a SIGTERM'd worker gets SIGKILL; 0 when not stopping
    bool kill_sent = false;  // that SIGKILL went out
    std::optional<int64_t> oom_kills_at_start;
    // A warm standby: no rank yet (rank and generation are those it was spawned beside).
    bool standby = false;
    int local_rank = -1;
    SpawnSpec runs;    // the worker it can become: binary, arguments, working directory
    int input_fd = -1;  // where its rank's environment goes
    bool stop_after_dump = false;  // stopped while a dump request waits for it: SIGTERM once it dumped
  };
  struct Batch {
    v1::PushLogsRequest request;
    size_t bytes = 0;  // the lines' text
  };
  using Batches = std::map<std::string, Batch>;  // job id -> lines

  // Opens the worker's log_path for appending; a refusal (a link there) is logged, and its lines
  // still reach the coordinator.
  void OpenLog(Worker& worker);
  void Drain(Worker& worker, Batches& batches, bool final_read);
  void AddLine(Worker& worker, const std::string& line, Batches& batches);
  void SendBatches(Batches& batches);
  void Reap(const ProcessExit& exit, Batches& batches);
  void PublishRunning();
  // Hands the rank's working directory and environment to the standby, which becomes a worker;
  // false when it could not take them.
  bool Activate(Worker& standby, const std::string& working_dir, const std::vector<std::string>& env);
  void SpawnStandby(const SpawnSpec& worker_spec, const std::string& mode, const v1::StartJobCommand& start,
                    const v1::WorkerAssignment& assignment);
  // SIGKILL to a standby, marked as ended by us (its reaping is no news).
  void EndStandby(Worker& standby);
  // Ends the job's standbys spawned beside generations below `below_generation` (all by default).
  void EndStandbys(const std::string& job_id, int below_generation = std::numeric_limits<int>::max());
  struct DumpRequest {
    std::string job_id;
    int generation = 0;
    std::string dir;
    std::map<int, int64_t> waiting;  // rank -> its dump's modification time when asked (0: none)
    int64_t deadline_ms = 0;
    // The exit report of the generation's first failed rank here, which goes with the dumps; none:
    // a report of state "collectives" does.
    std::optional<v1::WorkerStateReport> held;
  };
  // Asks the generation's live ranks here for their dumps; the request, also when none has a pipe.
  DumpRequest& AskForDumps(const std::string& job_id, int generation);
  // A dump request waits for this rank of the job.
  bool DumpAwaited(const Worker& worker) const;
  // Sends the requests whose dumps are in (or whose time is up), and stops the workers a stop left
  // running until they dumped.
  void SendDumps();
  // SIGTERM and SIGCONT now, SIGKILL after the grace.
  void Terminate(pid_t pid, Worker& worker);
  bool HasWorkers(const std::string& job_id) const;
  bool HasWorkers(const std::string& job_id, int generation) const;

  SupervisorOptions options_;
  ProcessSpawner& spawner_;
  const Clock& clock_;
  SupervisorOutbox& outbox_;
  std::map<pid_t, std::unique_ptr<Worker>> workers_;
  // Jobs whose failed ranks the coordinator replaces in place (fault.recovery: in_place): a failed
  // worker's peers on this node keep running.
  std::set<std::string> in_place_jobs_;
  std::map<std::string, int64_t> idle_since_ms_;  // jobs with standbys and no worker: since when
  std::vector<DumpRequest> dump_requests_;
};

}  // namespace ltrain::agent
