// Checkpoints: one directory per committed step.
//
//   <dir>/step-<N>/model.pt, optimizer.pt        plain data parallelism (zero 0): rank 0's state
//   <dir>/step-<N>/model-rank-R.pt, optimizer-rank-R.pt
//                                                  every other layout: per-rank shards (tp/pp slices,
//                                                  ZeRO shards), written by the ranks that hold them
//   <dir>/step-<N>/meta.yaml      the manifest: format, step, generation, job id, world size and
//                                 layout (tp, dp, pp, zero, chunks), data position, the CPU RNG
//                                 state, the resolved recipe, every file with its checksum and size
//   <dir>/latest                  "step-<N>\n": the newest committed step
//   <dir>/.tmp-step-<N>/          a save in progress; never read, removed by rank 0 once the step
//                                 is committed or failed, and at start
//
// Every tensor file holds, per parameter of the writing rank (in its tp/pp slice), the range of the
// parameter's flattened elements it holds ("range.<name>", int64 [begin, end)) and those elements
// ("model.<name>", or "exp_avg.<name>" and "exp_avg_sq.<name>"); a loader of another data-parallel
// degree or ZeRO stage reassembles full tensors from the ranges (same tp and pp only).
//
// Every writing rank writes and fsyncs its files in the pending directory; once every rank's files
// are durable, rank 0 checksums them, writes meta.yaml, renames the directory to step-<N> (the
// commit) and replaces `latest` by write-temp-and-rename, so neither is ever torn. The commit needs
// every rank's word that its files are durable: the trainer gets it with a collective (synchronous
// saves) or through a CheckpointCommitBoard (asynchronous saves, see checkpoint_writer.h). Every
// rank reads (the directory must be visible to all ranks of a job).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include <torch/types.h>

#include "common/recipe.h"
#include "common/status.h"

namespace ltrain::worker {

constexpr int kCheckpointFormat = 2;

struct CheckpointMeta {
  int64_t step = 0;           // optimizer steps completed
  int64_t data_position = 0;  // next sample index the loader hands out
  int world_size = 1;
  int generation = 0;
  std::string job_id;
  std::string layout;         // "tp=T dp=D pp=P zero=Z chunks=C sp=S", for people
  int tp = 1, dp = 1, pp = 1, zero = 0, chunks = 1;
  std::string rng_state;      // hex of the CPU default generator's state (rank 0's)
  // The saved run's batch order, from its recipe: data.sampling and the sampler's seed (-1: its
  // recipe names none).
  std::string data_sampling = "hash";
  int64_t data_seed = -1;
};

// The temporary directory of step `step` under `dir`.
std::string PendingCheckpointDir(const std::string& dir, int64_t step);
// Removes pending directories of steps <= max_step (every one when max_step < 0).
void RemovePendingCheckpoints(const std::string& dir, int64_t max_step);

// Fault injection (LTRAIN_FAULT_CHECKPOINT_WRITE=STEP[:RANK]): the save of step STEP fails while
// writing a file of rank RANK (every rank when absent), after half of the file's bytes reached the
// disk, as a full disk or a lost mount would.
struct CheckpointWriteFault {
  int64_t step = -1;
  int rank = -1;
  static StatusOr<CheckpointWriteFault> FromEnv();
  bool Hits(int64_t at_step, int at_rank) const { return step >= 0 && step == at_step && (rank < 0 || rank == at_rank); }
};

// Writes named tensors as one torch archive at `path` and fsyncs it; `inject_failure` stops after
// half of the bytes and fails.
Status WriteTensorArchive(const std::string& path, const std::vector<std::pair<std::string, torch::Tensor>>& tensors,
                          bool inject_failure = false);

// Rank 0, once every rank wrote its files into the pending directory: checksums them all, writes
// meta.yaml, commits step-<meta.step>, updates `latest`, and deletes all but the newest `keep` step
// directories (keep <= 0 keeps all).
Status CommitCheckpoint(const std::string& dir, const CheckpointMeta& meta, const Recipe& recipe, int keep);

// The step `latest` names in checkpoint directory `dir`, or -1.
int64_t LatestCommittedStep(const std::string& dir);

// Reads meta.yaml; with `verify`, also checks the size and checksum of every file it lists. Errors
// say what is wrong in a few words ("model.pt checksum mismatch: expected X, got Y").
StatusOr<CheckpointMeta> ReadCheckpointMeta(const std::string& step_dir, bool verify = true);

// Where a run resumes. `path` is a step directory (it must verify) or a checkpoint directory: then
// `latest` and then the older step directories, newest first, until one verifies; `skipped` says
// why each newer one was passed over ("checkpoint step-40 is corrupt (...)").
struct ResumeChoice {
  std::string step_dir;
  CheckpointMeta meta;
  std::vector<std::string> skipped;
};
StatusOr<ResumeChoice> ChooseResumeCheckpoint(const std::string& path);

using TensorReader = std::function<StatusOr<torch::Tensor>(const std::string& key)>;
// Opens a torch archive written by WriteTensorArchive; the reader fails for a missing key.
StatusOr<TensorReader> OpenTensorArchive(const std::string& path);

// FNV-1a 64 of a file's bytes, as hex; what meta.yaml records per file.
StatusOr<std::string> FileChecksum(const std::string& path);

// Where the ranks of an asynchronous save say that their files of a step are durable (or why
// not), and where rank 0's writer thread waits for all of them. Called from writer threads only.
class CheckpointCommitBoard {
 public:
  virtual ~CheckpointCommitBoard() = default;
  // `error` empty: this rank's files of `step` are written and fsynced.
  virtual Status Announce(int64_t step, int rank, const std::string& error) = 0;
  // Every rank's word on `step` (rank order; "" for ok). Fails after `timeout`, or soon after
  // `*cancel` becomes true.
  virtual StatusOr<std::vector<std::string>> Collect(int64_t step, int world_size, std::chrono::milliseconds timeout,
                                                     const std::atomic<bool>* cancel) = 0;
};

// Over the checkpoint directory itself, which every rank of a job sees: a rank's word on step N is
// a marker file in the step's pending directory (.tmp-step-N/.rank-R.done, or .rank-R.failed holding
// the reason), written to a temporary name and renamed; rank 0 polls for the markers. It needs no
// service besides the filesystem, so saves go on while the coordinator is away.
class FileCommitBoard : public CheckpointCommitBoard {
 public:
  explicit FileCommitBoard(std::string dir) : dir_(std::move(dir)) {}
  Status Announce(int64_t step, int rank, const std::string& error) override;
  StatusOr<std::vector<std::string>> Collect(int64_t step, int world_size, std::chrono::milliseconds timeout,
                                             const std::atomic<bool>* cancel) override;

 private:
  std::string dir_;
};

// In one process (a job of one rank, and tests that play several ranks from threads).
class LocalCommitBoard : public CheckpointCommitBoard {
 public:
  Status Announce(int64_t step, int rank, const std::string& error) override;
  StatusOr<std::vector<std::string>> Collect(int64_t step, int world_size, std::chrono::milliseconds timeout,
                                             const std::atomic<bool>* cancel) override;

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::pair<int64_t, int>, std::string> words_;
};

}  // namespace ltrain::worker
