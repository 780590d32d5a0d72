// Checkpoints: one directory per committed step.
//
//   <dir>/step-<N>/model.pt       model parameters (torch serialize archive)
//   <dir>/step-<N>/optimizer.pt   AdamW state (torch serialize archive)
//   <dir>/step-<N>/meta.yaml      step, data_position, world_size, file checksums, resolved recipe
//   <dir>/latest                  "step-<N>\n": the newest committed step
//
// A step is written into <dir>/.tmp-step-<N>, every file fsynced, then renamed to step-<N> (the
// commit); `latest` is replaced by write-temp-and-rename after that, so neither is ever torn. Only
// rank 0 writes; every rank reads (the directory must be visible to all ranks of a job).
#pragma once

#include <cstdint>
#include <string>

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include "common/recipe.h"
#include "common/status.h"

namespace ltrain::worker {

struct CheckpointMeta {
  int64_t step = 0;           // optimizer steps completed
  int64_t data_position = 0;  // next sample index the loader hands out
  int world_size = 1;
  int generation = 0;
  std::string job_id;
};

// Writes and commits step-<meta.step>, updates `latest`, and deletes all but the newest `keep`
// step directories (keep <= 0 keeps all).
Status SaveCheckpoint(const std::string& dir, const CheckpointMeta& meta, const Recipe& recipe,
                      const torch::nn::Module& model, const torch::optim::Optimizer& optimizer, int keep);

// `path` is a step directory (holds meta.yaml) or a checkpoint directory (holds `latest`); returns
// the step directory.
StatusOr<std::string> ResolveCheckpoint(const std::string& path);

// Reads meta.yaml, verifies the checksums, and loads parameters and optimizer state in place.
StatusOr<CheckpointMeta> LoadCheckpoint(const std::string& step_dir, torch::nn::Module& model,
                                        torch::optim::Optimizer& optimizer);

// FNV-1a 64 of a file's bytes, as hex; what meta.yaml records per file.
StatusOr<std::string> FileChecksum(const std::string& path);

}  // namespace ltrain::worker
