// The manifests of a checkpoint directory, without LibTorch: what the worker's checkpoint code
// writes and reads, and what `ltrain checkpoint` and `ltrain launch` read. The layout of the
// directory and the commit protocol are described in worker/checkpoint/checkpoint.h.
//
//   step-N/meta.yaml            the step's manifest (CheckpointMeta): format, step, commit, job id,
//                               layout, data position, RNG state, the resolved recipe, and every
//                               shard file with its size and XXH3-64
//   .tmp-step-N/rank-R.yaml     rank R's files of a save in progress (name, bytes, xxh3), which
//                               rank 0 merges into meta.yaml at the commit
//   latest                      "step-N\n": the newest commit
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "common/status.h"

namespace ltrain {

// 3: safetensors shards (model-rank-R.safetensors, optimizer-rank-R.safetensors) hashed with
// XXH3-64, and a commit number. 2 (torch archives, FNV-1a) is not read any more.
constexpr int kCheckpointFormat = 3;
constexpr const char* kCheckpointMetaFile = "meta.yaml";

struct CheckpointFile {
  uint64_t bytes = 0;
  std::string xxh3;  // 16 hex digits
};

struct CheckpointMeta {
  int format = kCheckpointFormat;
  int64_t step = 0;           // optimizer steps completed
  int64_t commit = 0;         // commit order in its directory: the newest commit's + 1
  int64_t data_position = 0;  // next sample index the loader hands out
  int world_size = 1;
  int generation = 0;
  std::string job_id;
  std::string layout;         // "tp=T dp=D pp=P zero=Z chunks=C sp=S", for people
  int tp = 1, dp = 1, pp = 1, zero = 0, chunks = 1;
  std::string rng_state;      // hex of the CPU default generator's state (rank 0's)
  // The saved run's batch order: data.sampling (meta.yaml's data_sampling; in a checkpoint of before
  // it, the recipe's, or hash, the default then; empty: not written) and the sampler's seed (-1: its
  // recipe names none).
  std::string data_sampling;
  int64_t data_seed = -1;
  // model.moe.balance bias: each MoE block's router bias, by block (meta.yaml: the floats' bits in hex,
  // so that they come back exact); empty otherwise.
  std::map<int, std::vector<float>> router_bias;
  std::map<std::string, CheckpointFile> files;
};

// "step-N", and N of such a name (-1 for any other name).
std::string StepDirName(int64_t step);
int64_t StepOfName(const std::string& name);

// A file name a manifest may list: a plain name in its directory (not empty, no '/', not "." or
// "..", no NUL).
bool IsPlainFileName(const std::string& name);

// meta.yaml's text; `recipe_yaml` (the resolved recipe) is stored under `recipe`.
std::string CheckpointMetaYaml(const CheckpointMeta& meta, const std::string& recipe_yaml);
// The resolved recipe meta.yaml holds, as YAML text; NotFound when it holds none.
StatusOr<std::string> ReadCheckpointRecipeYaml(const std::string& step_dir);
// Reads step_dir/meta.yaml. Errors say what is wrong in a few words ("meta.yaml is missing");
// another format is a FailedPrecondition that names the format this code reads.
StatusOr<CheckpointMeta> ReadCheckpointMeta(const std::string& step_dir);
// Every file meta.yaml lists is present with its size ("optimizer-rank-0.safetensors size
// mismatch: expected 100 bytes, got 12"); reads no file.
Status CheckCheckpointFiles(const std::string& step_dir, const CheckpointMeta& meta);
// Re-hashes every listed file ("model-rank-0.safetensors xxh3 mismatch: expected X, got Y").
Status VerifyCheckpointFiles(const std::string& step_dir, const CheckpointMeta& meta);
std::string HashMismatch(const std::string& file, const std::string& expected, const std::string& got);

// A rank's manifest of its own files in a pending directory, written durably (temp + rename).
std::string RankManifestName(int rank);
Status WriteRankManifest(const std::string& pending_dir, int rank, const std::map<std::string, CheckpointFile>& files);
// Every rank manifest found in `pending_dir`, merged; a file listed twice is an error.
StatusOr<std::map<std::string, CheckpointFile>> ReadRankManifests(const std::string& pending_dir);
bool IsRankManifestName(const std::string& name);

// The step `latest` names in checkpoint directory `dir`, or -1.
int64_t LatestCommittedStep(const std::string& dir);

struct CommittedStep {
  int64_t step = 0;
  int64_t commit = -1;  // -1: meta.yaml unreadable or without a commit number
  std::string job_id;
  bool readable = false;
};
// The step-N directories of `dir` with what their meta.yaml says.
std::vector<CommittedStep> ListCommittedSteps(const std::string& dir);
// The commit number the next commit in `dir` gets.
int64_t NextCommitNumber(const std::vector<CommittedStep>& steps);
// Which steps to delete so that the newest `keep` commits stay (keep <= 0: none is deleted). Order
// is by commit number (steps without one are older than any with one, then by step); the step
// `latest` names is never deleted.
std::vector<int64_t> StepsToPrune(std::vector<CommittedStep> steps, int keep, int64_t latest);

// A committed step in `dir` written by another job than `job_id` (the first found, newest step
// first), if any.
std::optional<CommittedStep> ForeignCheckpoint(const std::string& dir, const std::string& job_id);
// Creates `dir` if it is missing and writes and removes a file in it (named for `rank`, so that the
// ranks of a node may check at once): FailedPrecondition naming the directory, the reason and the fix
// when this process cannot. A job checks before training, not at its first save, where the ranks
// would wait on each other for a commit that cannot come.
Status CheckCheckpointDirWritable(const std::string& dir, int rank);
// Why `dir` cannot take `who`'s checkpoints (who: "job JOB", "this job") and what to do instead.
std::string CheckpointOwnershipError(const std::string& dir, const CommittedStep& owner, const std::string& who);

}  // namespace ltrain
