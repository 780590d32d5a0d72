// Coordinator: the job state machine, placement, rank assignment, rendezvous store, failure
// detection and restart policy, as a plain class. The gRPC services in coordinator_server.h are thin
// adapters over it and call it from their handler threads; every public method is thread-safe (one
// mutex) and the Wait* methods block their caller on a condition variable, never the others. Time is
// read only through the Clock, and Tick() (called periodically by the server, by hand in tests) does
// every timed transition: lost nodes, hangs, restarts after their backoff, elastic growth.
//
// Generations: every (re)start of a job's workers is a new generation with its own rendezvous scope
// ("JOB/GEN/"); reports from an older generation are ignored. Workers of a generation > 0 resume from
// the job's newest committed checkpoint.
//
// The store is written through a StateWriter: no handler waits for the disk under the lock, and
// reads flush the writer first, outside the lock.
//
// Contract with agents: a node receives StartJobCommand with the global ranks it runs, and
// StopJobCommand (with the generation) when the job's current generation ends for any other reason
// than its own workers all exiting 0. A stop with a final checkpoint first sends StopJobCommand with
// `checkpoint` set: the workers agree on a step among themselves, commit a checkpoint of it and exit
// 0, and the job ends STOPPED; a failure or the stop's timeout turns it into a plain stop.
#pragma once

#include <atomic>
#include <condition_variable>
#include <functional>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "common/clock.h"
#include "common/recipe.h"
#include "common/status.h"
#include "launcher/state_store.h"
#include "launcher/rpc_figures.h"
#include "launcher/state_writer.h"
#include "launcher/hang_diagnosis.h"
#include "launcher/straggler.h"
#include "ltrain/v1/ltrain.pb.h"

namespace ltrain::launcher {

// A worker's line as the coordinator keeps it: valid UTF-8 and at most 16 KiB (the agents send no
// more; this holds against any client), so that no report can grow the state by megabytes.
std::string StoredLine(const std::string& text);

// A job's curves for the dashboard, from rank 0's progress as it arrived (a step the reports skipped
// is missing): in memory only, while the coordinator holds the job. A restart from a checkpoint
// drops the points past it.
struct SeriesPoint {
  int64_t step = 0;
  int64_t unix_ms = 0;
  double loss = 0;
  double tokens_per_s = 0;
  double step_ms = 0;
  double mfu = 0;  // 0 to 1; 0: not measured
};
struct ValPoint {
  int64_t step = 0;
  double val_loss = 0;
};
struct JobSeries {
  std::vector<SeriesPoint> steps;  // by step
  std::vector<ValPoint> val;
};

// How Stop ends a running job.
struct StopOptions {
  bool checkpoint = false;             // first a final checkpoint at a step every rank reaches
  int64_t checkpoint_timeout_ms = 60000;  // then a plain stop, keeping the last commit
};

struct CoordinatorOptions {
  std::string state_dir;             // default checkpoints go under state_dir/checkpoints/<job>
  // A hang leaves every rank's recent collectives in <job_files_dir>/<job>/hang-gen-G.txt; empty: no file.
  std::string job_files_dir;
  int64_t node_timeout_ms = 3000;    // a node whose heartbeats stop this long is lost
  int64_t recovery_grace_ms = 15000; // after a coordinator restart, how long agents get to come back
  size_t max_buffered_events = 200000;
  // Retention: jobs that ended longer ago than this, with their events and logs, and any job's log
  // lines older than this leave the state (0: kept for ever). Checked at start and hourly.
  int64_t retain_ms = 30LL * 24 * 3600 * 1000;
  // A job that ended is dropped from memory this long after (its record stays in the state).
  int64_t keep_finished_in_memory_ms = 10 * 60 * 1000;
  // A node lost this long, with nothing of it left to wait for, leaves `ltrain nodes` and memory (its
  // record stays in the state), so that nodes that come and go do not add up. One that left (Leave)
  // is forgotten at once.
  int64_t forget_lost_nodes_ms = 3600 * 1000;
  // Followers get an event only once the state has it, so that whatever anyone saw survives this
  // coordinator (on for a state several coordinators share: a standby that takes over has every
  // event shown). Off, they get it at once, even while the state cannot be written.
  bool show_events_once_stored = false;
  std::string state_name;  // the state as errors name it; empty: state_dir/state.db
  // A fault for tests (LTRAIN_FAULT_RENDEZVOUS_DELAY): each rendezvous Get is answered no sooner than
  // this long after it came, as an overloaded coordinator would answer it.
  int64_t rendezvous_answer_delay_ms = 0;
};

class Coordinator {
 public:
  Coordinator(StateStore* store, const Clock* clock, CoordinatorOptions options);

  // Takes back the unfinished jobs of an earlier coordinator on the same state. Call once, first.
  Status Recover();

  // JobService.
  StatusOr<v1::Job> Submit(const std::string& recipe_yaml, const std::string& source_name);
  StatusOr<v1::Job> GetJob(const std::string& job_id);
  StatusOr<std::vector<v1::Job>> ListJobs(int limit);
  // A plain stop ends the job STOPPED at once. With options.checkpoint a RUNNING job stays RUNNING
  // until its workers exit after the final checkpoint (a plain stop meanwhile ends it at once).
  StatusOr<v1::Job> Stop(const std::string& job_id, const std::string& reason, const StopOptions& options = {});
  // `resumed_seq`, when given, gets the sequence number of the "resumed" event.
  StatusOr<v1::Job> Resume(const std::string& job_id, int64_t* resumed_seq = nullptr);
  StatusOr<std::vector<v1::Event>> GetLogs(const std::string& job_id, int rank, int64_t since_unix_ms, int limit);
  // The dashboard's view of a job the coordinator holds in memory: its curves, and its newest
  // `max_events` events that are not log lines and newest `max_logs` log lines, oldest first.
  StatusOr<JobSeries> Series(const std::string& job_id);
  StatusOr<std::vector<v1::Event>> RecentEvents(const std::string& job_id, int max_events, int max_logs);
  // Events of a job after `after_seq` (log lines too when `logs`). Blocks up to `timeout_ms` while
  // there are none and the job is not final. `*finished` is set once the job is final and every
  // event has been returned.
  StatusOr<std::vector<v1::Event>> WaitEvents(const std::string& job_id, int64_t after_seq, bool logs,
                                              int64_t timeout_ms, bool* finished);

  // AgentService. NodeConnected returns a token that NodeDisconnected must present, so that a
  // stale stream closing after the agent reconnected does not mark the node lost. With `deliver`,
  // the node's commands go to it as they are queued (the queue so far first), called with the
  // coordinator's lock held: it must not call back into the coordinator. Without it they wait for
  // WaitCommand.
  using CommandSink = std::function<void(v1::Command)>;
  int64_t NodeConnected(const std::string& node_id, const v1::NodeFacts& facts,
                        const std::vector<v1::RunningWorker>& running = {}, CommandSink deliver = nullptr);
  void NodeDisconnected(const std::string& node_id, int64_t token);
  void NodeLeaving(const std::string& node_id, const std::string& reason);
  // The nodes known since this coordinator started (lost ones too), by id.
  std::vector<v1::NodeStatus> ListNodes() const;
  // Whether `node_id` is connected within `timeout_ms`.
  bool WaitForNode(const std::string& node_id, int64_t timeout_ms);
  std::optional<v1::Command> WaitCommand(const std::string& node_id, int64_t timeout_ms);
  // A job's steps, losses, throughput, commits and stops after a final checkpoint come only from
  // its ranks' typed progress reports (v1::RankProgress), wherever they ride: heartbeats, progress
  // reports, and exit reports (applied before the exit). Log lines are stored, never read.
  Status Heartbeat(const v1::HeartbeatRequest& request);
  Status ReportProgress(const v1::ProgressReport& request);
  Status ReportWorkerState(const v1::WorkerStateReport& report);
  void PushLogs(const v1::PushLogsRequest& request);

  // RendezvousService. Keys are "JOB/GENERATION/NAME": a job's are freed when it ends and an older
  // generation's when a newer one starts, and a set is refused (InvalidArgument, naming the bound)
  // for a job that is not running here or another generation than its newest, for a key over
  // kMaxKvKeyBytes or a value over kMaxKvValueBytes, and once the job's keys and values would hold
  // more than kMaxKvJobBytes: no caller can grow the coordinator without bound.
  static constexpr size_t kMaxKvKeyBytes = 1024;
  static constexpr size_t kMaxKvValueBytes = 1 << 20;
  static constexpr int64_t kMaxKvJobBytes = 64LL << 20;
  Status KvSet(const std::string& key, const std::string& value);
  // KvGet without a waiting thread: `done` gets the values once every key is set (at once when they
  // are), or an error: kDeadlineExceeded after `timeout_ms` (bounded as KvGet's), kFailedPrecondition
  // at a tick once the keys' generation has ended (a newer one started, the job ended), kUnavailable
  // at shutdown. With `while_generation_lives` the keys must be of the job's running generation
  // (else kFailedPrecondition at once) and the timeout does not apply: the Get waits while the
  // generation runs. `done` runs without the coordinator's lock, on the thread that set the last
  // key, ticked, or called.
  using KvDone = std::function<void(StatusOr<std::vector<std::string>>)>;
  void KvGetAsync(std::vector<std::string> keys, int64_t timeout_ms, KvDone done, bool while_generation_lives = false);
  std::optional<std::vector<std::string>> KvGet(const std::vector<std::string>& keys, int64_t timeout_ms);
  // Keys held: a job's are freed when it ends, an older generation's when a newer one starts.
  size_t KvSize() const;
  // The coordinator's own time by RPC kind (its services add to it) and its state writer's.
  RpcFigures& rpc_figures() { return rpc_figures_; }
  StateWriterFigures writer_figures() const { return writer_.Figures(); }
  HeldFigures held_figures() const;

  // Every timed transition; idempotent, cheap, called every ~200 ms by the server.
  void Tick();
  // Returns once the state has every write made so far (see StateWriter).
  void FlushState();
  // Why the state cannot be written now; while it cannot, Submit and Resume refuse.
  std::optional<std::string> StateFailure() const;
  // Wakes every waiter; Wait* return at once from now on.
  void Shutdown();
  bool shutting_down() const;

 private:
  struct NodeState {
    v1::NodeFacts facts;
    bool connected = false;
    int64_t lost_ms = -1;          // steady clock: when it was lost or left; -1 while it is not
    int64_t token = 0;
    int64_t last_heartbeat_ms = 0;
    bool recovered = false;        // known from the state of an earlier coordinator, not yet back
    int64_t recovery_deadline_ms = 0;
    std::deque<v1::Command> commands;
    CommandSink deliver;           // the connected stream's, when it takes commands as they come
    std::set<std::string> jobs;
  };
  // What a job's status and ListNodes say of a node, without its jobs. `now`: the steady clock.
  static v1::NodeStatus StatusOfNode(const std::string& node_id, const NodeState& node, int64_t now);
  struct Progress {
    v1::RankProgress report;
    int64_t received_ms = 0;       // steady clock
  };
  // How long a program's hang waits for the agents' flight-recorder dumps before it is told (the
  // agents wait Supervisor::kDumpWaitMs for their ranks).
  static constexpr int64_t kDumpWaitMs = 20000;

  struct ActiveJob {
    v1::Job job;
    Recipe recipe;                 // as submitted; each generation may run on fewer nodes
    int next_generation = 0;
    std::vector<std::string> nodes;  // of the current generation, while it runs
    std::vector<std::string> generation_nodes;  // of the latest generation, kept after it ends
    std::set<int> ranks_exited_ok;
    std::map<int, Progress> progress;
    std::map<int, v1::RankInfo> ranks;  // as recorded in the state: GetJob answers without it
    // A job that ended keeps its ranks, with what their progress said last, as one serialized list
    // (FoldRanksLocked) once none runs: 80,000 ranks take a few MB so, against tens as records.
    std::string folded_ranks;
    int64_t folded_ms = 0;  // steady clock: when they were folded
    int64_t ranks_changed_ms = 0;  // steady clock: a rank's latest report of its state
    int64_t generation_started_ms = 0;
    int64_t committed_at_start = 0;  // last committed step when the generation started
    bool resume_compared = false;    // rank 0's load of this generation held against committed_at_start
    // The checkpoint ledger as this coordinator knows it: the commits it recorded, above the last one
    // the state held when it took the job back (those at or below it were recorded before).
    std::set<int64_t> recorded_commits;
    int64_t recorded_before = 0;
    int64_t restart_at_ms = 0;       // RESTARTING: when to place the next generation
    bool waiting_reported = false;
    std::vector<std::string> failures;  // every generation's failure, oldest first
    // A stop with a final checkpoint under way (reset by the next generation).
    bool stopping = false;
    std::string stop_reason;
    int64_t stop_timeout_ms = 0;
    int64_t stop_deadline_ms = 0;        // then a plain stop
    int64_t committed_at_stop = 0;       // last committed step when the stop was asked
    bool stopped_early = false;          // a rank reported it stopped after a final checkpoint
    std::vector<v1::Event> events;   // in memory, log lines included
    StragglerTracker stragglers;  // of the current generation (straggler.h)
    RunTimes times;               // the steps' and saves' times the limits are derived from (hang_diagnosis.h)
    // A program's NCCL flight-recorder dumps (flight_analysis.h) of generation flight_generation, by
    // rank, as the agents sent them; the analysis last told (in a cause or an event); a hang waiting
    // for the dumps of the nodes in dump_nodes_waiting until dump_deadline_ms (0: none).
    int flight_generation = -1;
    std::map<int, v1::FlightRecord> flight_records;
    std::string flight_told;
    std::string dump_wait_hang;
    std::set<std::string> dump_nodes_waiting;
    int64_t dump_deadline_ms = 0;
    JobSeries series;
    // In-place recovery (fault.recovery: in_place, coordinator_recovery.cc): the generation's
    // membership epoch (0 as placed, one more per replaced rank), the start command its ranks were
    // placed with, and the replacement under way (-1: none) since when (steady clock).
    int epoch = 0;
    v1::StartJobCommand placed;
    int replacing_rank = -1;
    int64_t replacing_since_ms = 0;
    int64_t replacing_from_step = 0;  // the highest step any rank had completed when it failed
    // The ranks that go on after ranks left with a lost node and none could replace them (empty: every
    // rank of the generation), and since when (steady clock) until a member completed a step.
    std::vector<int> members;
    int64_t shrunk_since_ms = -1;
  };

  void ScheduleLocked();
  bool StartGenerationLocked(ActiveJob& job, std::vector<std::string> nodes);
  // The start command of `generation` (its recipe as it runs, on the nodes it has), without workers.
  static v1::StartJobCommand GenerationCommand(const ActiveJob& job, const Recipe& recipe, int generation);
  // A coordinator that takes over a job whose rank `rank` was being replaced in place completes it:
  // the next membership epoch, whose keys (with the one in progress) `announce` collects.
  void ResumeReplacementLocked(ActiveJob& job, int rank, std::vector<std::pair<std::string, std::string>>* announce);
  // The start command of rank `rank`'s replacement in membership job.epoch, to `node`.
  void QueueReplacementLocked(ActiveJob& job, int rank, NodeState& node);
  // `restartable` false: the job fails whatever its restart policy says.
  void FailGenerationLocked(ActiveJob& job, const std::string& cause, bool restartable = true);
  // A rank of the failed generation refused to start (`cause`) while the job waited to restart: the
  // restart is not made and the job fails.
  void GiveUpRestartLocked(ActiveJob& job, const std::string& cause);
  // fault.recovery in_place: starts rank `rank` again beside the generation's other ranks (which keep
  // their processes) in the next membership epoch, and returns the rendezvous key and value that
  // announce that membership to the survivors (to be set once mu_ is released: KvSet takes it). An
  // empty key: the rank cannot be replaced in place (why in `*why`), and the job restarts as before.
  std::pair<std::string, std::string> ReplaceRankLocked(ActiveJob& job, int rank, const std::string& cause,
                                                        std::string* why);
  // fault.recovery in_place, node `node_id` lost (`cause`) with ranks `lost` of the job: where no node
  // can take them and the layout allows (ShrinkProblem), the other ranks go on without them in the
  // next membership epoch, each taking more of the global batch's micro-batches; the announcement
  // goes to announce_later_. False (the job restarts as before) otherwise, with the reason as an event.
  bool ShrinkLocked(ActiveJob& job, const std::vector<int>& lost, const std::string& cause);
  // The replacement of a rank has completed a step with the others: the recovery is over.
  void NoteRecoveryProgressLocked(ActiveJob& job, const v1::RankProgress& report);
  // Sets the rendezvous keys queued in announce_later_ (KvSet takes mu_): what a function that holds
  // mu_ and may queue them calls once it let mu_ go (AnnounceOnExit, declared before its lock).
  void PublishAnnouncements();
  class AnnounceOnExit {
   public:
    explicit AnnounceOnExit(Coordinator* coordinator) : coordinator_(coordinator) {}
    ~AnnounceOnExit() { coordinator_->PublishAnnouncements(); }
    AnnounceOnExit(const AnnounceOnExit&) = delete;
    AnnounceOnExit& operator=(const AnnounceOnExit&) = delete;

   private:
    Coordinator* coordinator_;
  };
  Status ReportWorkerStateLocked(const v1::WorkerStateReport& report, std::pair<std::string, std::string>* announce);
  // Hands `command` to the node's stream, or queues it for WaitCommand.
  void QueueCommandLocked(NodeState& node, v1::Command command);
  void StopGenerationLocked(ActiveJob& job, const std::string& reason);
  void LoseNodeLocked(const std::string& node_id, const std::string& reason, bool expected = false);
  void CheckHangLocked(ActiveJob& job, int64_t now);
  // The limits the job's ranks are judged by, in its record (ltrain status), and an event when the
  // training step's changes by more than a fifth (derived limits follow the steps' times).
  void SetLimitsLocked(ActiveJob& job, const PhaseLimits& limits);
  // Writes `headline` and every rank's last report with its recent collectives to
  // <job_files_dir>/<job>/<name>-gen-G.txt (on the state writer's thread) and returns the path; empty
  // without options_.job_files_dir.
  std::string WriteCollectivesLocked(const ActiveJob& job, const std::string& name, const std::string& headline);
  // Writes `text` to <job_files_dir>/<job>/<name>-gen-G.txt on the state writer's thread; the path,
  // or empty without options_.job_files_dir.
  std::string WriteJobFileLocked(const ActiveJob& job, const std::string& name, std::string text);
  // Keeps the flight-recorder dumps a report carries. Once the generation's failure was told, a
  // change of the analysis is an event and rewrites the file.
  void AddFlightRecordsLocked(ActiveJob& job, const v1::WorkerStateReport& report);
  // The analysis of the generation's dumps with the file that holds them all
  // (flight-recorder-gen-G.txt), as a clause of a cause; empty without dumps.
  std::string TellFlightRecordsLocked(ActiveJob& job);
  // Asks the agents of `nodes` for the job's flight-recorder dumps (DumpCollectivesCommand).
  void RequestDumpsLocked(ActiveJob& job, const std::vector<std::string>& nodes);
  // Names the ranks whose own work stays above the others' (an event each time one becomes or
  // stops being a straggler), from the ranks' latest compute figures.
  void CheckStragglersLocked(ActiveJob& job);
  // A rank's report of any generation: one of the current generation that is not older than the
  // last applied for its rank is kept for hang detection and status, and gives the job rank 0's
  // step figures, the commit and the stop after a final checkpoint.
  void ApplyProgressLocked(ActiveJob& job, const v1::RankProgress& report);
  // The job's ranks as GetJob shows them: each as recorded, with what its latest progress says.
  void ShowProgressLocked(const ActiveJob& job, int64_t now, v1::RankInfo* rank) const;
  void ShownRanksLocked(const ActiveJob& job, int64_t now, google::protobuf::RepeatedPtrField<v1::RankInfo>* out) const;
  // A job that ended: its ranks and their progress into folded_ranks, and the records out of memory.
  // UnfoldRanksLocked brings them back (a rank's report after the end).
  void FoldRanksLocked(ActiveJob& job);
  void UnfoldRanksLocked(ActiveJob& job);
  void RecordCommitLocked(ActiveJob& job, int64_t step, const std::string& path, int rank);
  void AddEventLocked(ActiveJob& job, const std::string& kind, const std::string& message, int rank);
  void FinishLocked(ActiveJob& job, v1::JobState state, const std::string& cause);
  // Drops the rendezvous keys of `job_id` (JOB/GENERATION/...) except those under `keep_scope`.
  void FreeKeysLocked(const std::string& job_id, const std::string& keep_scope);
  // Ends a stop with a final checkpoint that cannot complete: STOPPED, keeping the last commit.
  void AbandonCheckpointStopLocked(ActiveJob& job, const std::string& why);
  void PersistJobLocked(ActiveJob& job);
  // Refuses new work while the state cannot be written.
  Status CheckStateWritable() const;
  // Drops jobs that ended keep_finished_in_memory_ms ago from memory (each tick) and, hourly,
  // removes the records past the retention (off the lock, on the writer's thread).
  void SweepLocked();
  // Connected nodes running no job that can run `recipe`'s ranks: a cuda job needs a node with a GPU.
  std::vector<std::string> FreeNodesLocked(const Recipe& recipe) const;
  // "N free", and for a cuda job how many idle nodes do not count for want of a GPU.
  std::string FreeNodesText(const Recipe& recipe, size_t free_nodes) const;
  ActiveJob* FindLocked(const std::string& job_id);

  StateStore* store_;
  const Clock* clock_;
  CoordinatorOptions options_;

  // Tick's rule for heartbeats that stop on many nodes at once (coordinator.cc).
  static constexpr int kMassSilenceNodes = 3;
  // A job that ended has its ranks folded (FoldRanksLocked) once none runs, or kFoldRanksAfterMs
  // after the end, and kFoldQuietMs after a rank's latest report.
  static constexpr int64_t kFoldRanksAfterMs = 30000;
  static constexpr int64_t kFoldQuietMs = 2000;
  static constexpr double kMassSilenceFactor = 3.0;
  bool mass_silence_reported_ = false;
  mutable std::mutex mu_;
  std::vector<std::pair<std::string, std::string>> announce_later_;  // rendezvous keys, under mu_
  std::condition_variable cv_;
  bool shutting_down_ = false;
  int64_t next_token_ = 1;
  int64_t next_seq_ = 1;
  std::map<std::string, NodeState> nodes_;
  std::map<std::string, ActiveJob> jobs_;
  std::vector<std::string> pending_;  // job ids waiting for nodes, oldest first
  std::map<std::string, std::string> kv_;
  std::map<std::string, int64_t> kv_job_bytes_;  // job id -> the bytes of its keys and values in kv_
  // KvGetAsync's waiters, each under the first of its keys not yet set.
  struct KvWaiter {
    std::vector<std::string> keys;
    int64_t timeout_ms = 0;
    int64_t deadline_ms = 0;  // steady clock; INT64_MAX: while its generation lives
    int64_t answer_at_ms = 0;  // options.rendezvous_answer_delay_ms: not answered before (steady clock)
    std::string ended;  // its generation ended: why (answered at the next tick)
    KvDone done;
  };
  // Ok where every key is of a job's running generation (or there are none); else why not.
  Status RunningGenerationKeysLocked(const std::vector<std::string>& keys);
  // Waiters whose keys are all set, held until their answer_at_ms (options.rendezvous_answer_delay_ms).
  std::vector<std::pair<std::shared_ptr<KvWaiter>, std::vector<std::string>>> kv_delayed_;
  std::multimap<std::string, std::shared_ptr<KvWaiter>> kv_waiters_;
  // The waiters of `key` that KvSet completed (values filled) or moved under their next missing key.
  void ExpireKvWaiters();  // the waiters past their deadline (all at shutdown) get nullopt
  void WakeKvWaitersLocked(const std::string& key,
                           std::vector<std::pair<std::shared_ptr<KvWaiter>, std::vector<std::string>>>* ready);
  int64_t next_sweep_unix_ms_ = 0;
  // The newest event the state has (show_events_once_stored).
  std::atomic<int64_t> stored_seq_{0};
  // The write of the event `seq` is done: followers may be shown it.
  void MarkStored(int64_t seq);
  // Last: its destructor applies the writes still queued, which need nothing else of this class
  // but mu_, cv_ and stored_seq_ (MarkStored).
  mutable StateWriter writer_;
  RpcFigures rpc_figures_;
};

}  // namespace ltrain::launcher
