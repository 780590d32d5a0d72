// Trainer: data-parallel training of the GPT model on one rank.
//
// Runs on the worker's main thread. Every rank of the job builds a Trainer with the same recipe and
// calls Run(); the ranks then make the same collectives in the same order (a parameter broadcast
// at start, one fused gradient+loss all-reduce per optimizer step, a barrier at the end), so a rank
// that fails makes the others fail at their next collective. Only rank 0 prints progress and writes
// checkpoints.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <torch/optim/adamw.h>

#include "common/recipe.h"
#include "common/status.h"
#include "common/token_data.h"
#include "worker/communicator.h"
#include "worker/gpt_model.h"
#include "worker/lr_schedule.h"

namespace ltrain::worker {

// How the ranks of a job divide the work. Only data parallelism exists today.
struct Layout {
  int world_size = 1;
  int dp = 1;
  int tp = 1;
  int pp = 1;
  int micro_batch = 1;
  int accumulation = 1;   // micro-batches per rank per optimizer step
  int global_batch = 1;
};

// Checks the recipe's parallel and batch settings against the real world size.
StatusOr<Layout> PlanLayout(const Recipe& recipe, int world_size);

struct TrainerOptions {
  int rank = 0;
  int local_rank = 0;            // picks the GPU when parallel.device is cuda
  int generation = 0;
  std::string job_id;
  std::string checkpoint_dir;   // resolved: env override, recipe, or default; empty disables saving
  bool print_progress = true;   // rank 0 prints; tests may silence it
};

class Trainer {
 public:
  // `comm` must outlive the Trainer; its size() is the world size.
  static StatusOr<std::unique_ptr<Trainer>> Create(const Recipe& recipe, const TrainerOptions& options,
                                                   Communicator* comm);

  // Trains from the current step to recipe.training.steps, checkpointing as configured.
  Status Run();
  // One optimizer step; returns the global-batch mean loss.
  StatusOr<double> Step();
  Status Save();

  int64_t step() const { return step_; }
  int64_t data_position() const { return data_position_; }
  const Layout& layout() const { return layout_; }
  Gpt& model() { return model_; }

 private:
  Trainer(const Recipe& recipe, const TrainerOptions& options, Communicator* comm, Layout layout,
          TokenDataset data);
  Status Init();
  // Copies every gradient (and `extra` at the end) into flat_, or back.
  void PackGrads(const torch::Tensor& extra);
  void UnpackGrads();

  Recipe recipe_;
  TrainerOptions options_;
  Communicator* comm_;
  Layout layout_;
  TokenDataset data_;
  TokenSampler sampler_;
  LrSchedule schedule_;
  torch::Device device_{torch::kCPU};
  Gpt model_{nullptr};
  std::unique_ptr<torch::optim::AdamW> optimizer_;
  std::vector<torch::Tensor> params_;
  torch::Tensor flat_;            // all gradients + the loss, one all-reduce per step
  int64_t grad_numel_ = 0;
  torch::Tensor inputs_host_;     // [micro_batch, seq_len] int64
  torch::Tensor targets_host_;
  int64_t step_ = 0;              // optimizer steps completed
  int64_t data_position_ = 0;     // next sample index
  int64_t run_start_step_ = 0;    // step_ and data_position_ when this process started
  int64_t run_start_position_ = 0;
};

}  // namespace ltrain::worker
