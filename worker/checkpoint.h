// Checkpoints: one directory per committed step.
//
//   <dir>/step-<N>/model.pt, optimizer.pt        plain data parallelism (zero 0): rank 0's state
//   <dir>/step-<N>/model-rank-R.pt, optimizer-rank-R.pt
//                                                  every other layout: per-rank shards (tp/pp slices,
//                                                  ZeRO shards), written by the ranks that hold them
//   <dir>/step-<N>/meta.yaml      step, data_position, world_size, layout, every file with its
//                                 checksum and size, the resolved recipe
//   <dir>/latest                  "step-<N>\n": the newest committed step
//
// Rank 0 prepares <dir>/.tmp-step-<N>; every writing rank writes and fsyncs its files there; rank 0
// then checksums them, writes meta.yaml, renames the directory to step-<N> (the commit) and replaces
// `latest` by write-temp-and-rename, so neither is ever torn. The trainer puts barriers between the
// phases. Every rank reads (the directory must be visible to all ranks of a job).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include <torch/types.h>

#include "common/recipe.h"
#include "common/status.h"

namespace ltrain::worker {

struct CheckpointMeta {
  int64_t step = 0;           // optimizer steps completed
  int64_t data_position = 0;  // next sample index the loader hands out
  int world_size = 1;
  int generation = 0;
  std::string job_id;
  std::string layout;         // "tp=T dp=D pp=P zero=Z chunks=C": a resume needs the same
};

// The temporary directory of step `step` under `dir`.
std::string PendingCheckpointDir(const std::string& dir, int64_t step);
// Rank 0: creates a fresh, empty PendingCheckpointDir.
Status PrepareCheckpoint(const std::string& dir, int64_t step);
// Writes named tensors as one torch archive at `path` and fsyncs it.
Status WriteTensorArchive(const std::string& path, const std::vector<std::pair<std::string, torch::Tensor>>& tensors);
// Rank 0, once every rank wrote its files into the pending directory: checksums them all, writes
// meta.yaml, commits step-<meta.step>, updates `latest`, and deletes all but the newest `keep` step
// directories (keep <= 0 keeps all).
Status CommitCheckpoint(const std::string& dir, const CheckpointMeta& meta, const Recipe& recipe, int keep);

// `path` is a step directory (holds meta.yaml) or a checkpoint directory (holds `latest`); returns
// the step directory.
StatusOr<std::string> ResolveCheckpoint(const std::string& path);

// Reads meta.yaml and verifies the checksum of every file it lists.
StatusOr<CheckpointMeta> ReadCheckpointMeta(const std::string& step_dir);

using TensorReader = std::function<StatusOr<torch::Tensor>(const std::string& key)>;
// Opens a torch archive written by WriteTensorArchive; the reader fails for a missing key.
StatusOr<TensorReader> OpenTensorArchive(const std::string& path);

// FNV-1a 64 of a file's bytes, as hex; what meta.yaml records per file.
StatusOr<std::string> FileChecksum(const std::string& path);

}  // namespace ltrain::worker
