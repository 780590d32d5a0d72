// Checkpoints: one directory per committed step (format 3).
//
//   <dir>/step-<N>/model-rank-R.safetensors       rank R's parameters: every rank that holds a distinct
//                                                  copy (dp rank 0 of each tp/pp position; under ZeRO-3
//                                                  every rank)
//   <dir>/step-<N>/optimizer-rank-R.safetensors   rank R's AdamW moments (dp rank 0 of each tp/pp
//                                                  position; with ZeRO >= 1 every rank)
//   <dir>/step-<N>/meta.yaml      the manifest (common/checkpoint_manifest.h): format, step, commit
//                                 number, generation, job id, world size and layout (tp, dp, pp,
//                                 zero, chunks), data position, the CPU RNG state, the resolved
//                                 recipe, every file with its size and XXH3-64
//   <dir>/latest                  "step-<N>\n": the newest commit
//   <dir>/.tmp-step-<N>/          a save in progress: the ranks' files and their manifests
//                                 (rank-R.yaml); never read by a resume, removed by rank 0 once the
//                                 step is committed or failed, and at start
//
// The shards are safetensors files (common/safetensors.h): a JSON header and raw little-endian
// tensors; loading one runs no code. Every shard holds, per parameter of the writing rank (in its
// tp/pp slice), the range of the parameter's flattened elements it holds ("range.<name>", I64
// [begin, end)) and those elements as F32 ("model.<name>", or "exp_avg.<name>" and
// "exp_avg_sq.<name>"); a loader of another layout reassembles each tp slice from the ranges of
// the files that hold it (any data-parallel degree and ZeRO stage), the full parameter from the tp
// slices (any tp), and takes its own slice; parameters keep their full-model names, so any pipeline
// split finds them.
//
// A save: the training thread copies this rank's tensors to host memory (CheckpointSnapshot); the
// writer streams each tensor's bytes into its file in large writes, hashing them on the way, fsyncs
// it, and writes the rank's manifest (rank-R.yaml: file, bytes, xxh3) next to it. Once every rank's
// files are durable, rank 0 reads the ranks' manifests (never the shards), writes meta.yaml,
// renames the directory to step-<N> (the commit), replaces `latest` (write-temp-and-rename), and
// then prunes: all but the newest checkpoint.keep commits, by commit number, never the one `latest`
// names. The commit needs every rank's word that its files are durable: the trainer gets it with a
// collective (synchronous saves) or through a CheckpointCommitBoard (asynchronous saves, see
// checkpoint_writer.h).
//
// A resume: rank 0 picks the step (ChooseResumeCheckpoint: meta.yaml, and every listed file present
// with its size); every rank reads the files it needs once, verifying their hashes as it reads
// (ReadShardFile); the ranks agree on the outcome with a collective, and on a mismatch anywhere
// all of them move to the next older commit. Every rank reads (the directory must be visible to all
// ranks of a job). A directory belongs to one job: the job id of its meta.yaml files.
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

#include "common/checkpoint_manifest.h"
#include "common/recipe.h"
#include "common/status.h"

namespace ltrain::worker {

using NamedTensors = std::vector<std::pair<std::string, torch::Tensor>>;

// The shard file names of rank `rank`.
std::string ModelShardFile(int rank);
std::string OptimizerShardFile(int rank);

// The temporary directory of step `step` under `dir`.
std::string PendingCheckpointDir(const std::string& dir, int64_t step);
// Removes pending directories of steps <= max_step (every one when max_step < 0).
void RemovePendingCheckpoints(const std::string& dir, int64_t max_step);

// Fault injection for drills.
//   LTRAIN_FAULT_CHECKPOINT_WRITE=STEP[:RANK]: the save of step STEP fails while writing the first
//     file of rank RANK (every rank when absent), after half of the file's bytes reached the disk,
//     as a full disk or a lost mount would.
//   LTRAIN_FAULT_CHECKPOINT_STALL=STEP:SECONDS[:RANK]: the save of step STEP on rank RANK (every rank
//     when absent) stops for SECONDS before its first byte, reporting no progress, as a hung mount
//     would.
struct CheckpointWriteFault {
  int64_t step = -1;
  int rank = -1;
  int64_t stall_step = -1;
  double stall_seconds = 0;
  int stall_rank = -1;
  static StatusOr<CheckpointWriteFault> FromEnv();
  bool Hits(int64_t at_step, int at_rank) const { return step >= 0 && step == at_step && (rank < 0 || rank == at_rank); }
  bool Stalls(int64_t at_step, int at_rank) const {
    return stall_step >= 0 && stall_step == at_step && (stall_rank < 0 || stall_rank == at_rank);
  }
};

// Streams `tensors` (host memory, contiguous) into a safetensors file at `path`, hashing every byte,
// and fsyncs it. `progress` (optional) gets the bytes written so far every few tens of MB.
// `inject_failure` stops after half of the file's bytes and fails.
StatusOr<CheckpointFile> WriteShardFile(const std::string& path, const NamedTensors& tensors, bool inject_failure = false,
                                        const std::function<void(uint64_t)>& progress = nullptr);

// The bytes WriteShardFile writes for `tensors`, less the header (for progress totals).
uint64_t ShardDataBytes(const NamedTensors& tensors);

// Reads a shard in one pass into host tensors (name -> tensor), verifying its size and XXH3-64
// against `expected`. Errors are DataLoss and say what is wrong in a few words
// ("model-rank-0.safetensors xxh3 mismatch: expected X, got Y").
// `allocate` (optional) may give the memory for a tensor of that type and element count (an undefined
// tensor: a fresh allocation). `on_tensor` (optional) gets each tensor as soon as its bytes are read,
// before the file is verified: what it does with them must be undone or redone if the file turns
// out not to verify.
StatusOr<std::map<std::string, torch::Tensor>> ReadShardFile(
    const std::string& path, const CheckpointFile& expected, const std::function<void(uint64_t)>& progress = nullptr,
    const std::function<torch::Tensor(torch::ScalarType, int64_t)>& allocate = nullptr,
    const std::function<void(const std::string&, const torch::Tensor&)>& on_tensor = nullptr);

// Rank 0, once every rank wrote its files and manifest into the pending directory: writes
// meta.yaml from the ranks' manifests (meta.files and meta.commit are filled here), commits
// step-<meta.step> and updates `latest`. `*bytes` (optional) gets the committed files' total size.
Status CommitCheckpoint(const std::string& dir, const CheckpointMeta& meta, const Recipe& recipe,
                        uint64_t* bytes = nullptr);

// After a commit of step `latest`: removes all but the newest `keep` commits (keep <= 0 keeps all;
// never `latest`). Returns the steps removed.
std::vector<int64_t> PruneCheckpoints(const std::string& dir, int keep, int64_t latest);

// Where a run resumes. `path` is a step directory or a checkpoint directory: then `latest` and
// then the other committed steps, newest commit first, skipping any whose meta.yaml is missing,
// unreadable or lists a missing or short file, and those in `rejected` (step -> why: a rank found
// a file that does not verify); `skipped` says why each newer one was passed over ("checkpoint
// step-40 is corrupt (...)"), in order. A meta.yaml of another format fails at once.
struct ResumeChoice {
  std::string step_dir;
  CheckpointMeta meta;
  std::vector<std::string> skipped;
};
StatusOr<ResumeChoice> ChooseResumeCheckpoint(const std::string& path, const std::map<int64_t, std::string>& rejected = {});

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
