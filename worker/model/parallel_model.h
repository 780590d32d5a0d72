// ModelShard: the part of the GPT model (worker/model/gpt_model.h, same architecture and initialisation)
// that one rank holds under tensor and pipeline parallelism, written functionally over plain leaf
// tensors so that a parameter store can place them in flat buffers and shard them (ZeRO).
//
// Every rank draws each parameter of the full model and keeps its slice, so every layout starts
// from exactly the parameters one process would have: with PyTorch's initialisation (the whole model
// built on the CPU from the seeded global generator, as gpt_model.GPT), or with a generator of its
// own for each parameter, on the rank's device.
//   Tensor parallel (Megatron-LM): qkv and fc column-parallel, proj and fc2 row-parallel, the
//   embedding and the tied head vocab-parallel, cross-entropy computed without ever forming the full
//   logits. Sequence parallel: LayerNorms, residuals and dropout-free regions work on a 1/tp slice of
//   the sequence; all-gather before the column-parallel matmuls and reduce-scatter after the
//   row-parallel ones replace the all-reduces.
//   Pipeline parallel: chunk c of pipeline rank r is virtual stage c*pp + r; the first virtual stage
//   holds the embedding, the last the final LayerNorm and a copy of the tied embedding as its head.
//   Activation checkpointing: "full" recomputes each block in backward, "selective" only attention.
//
// Runs on the training thread. TP collectives run inside forward and backward: every rank of a TP
// group runs the same chunks in the same order. A failed collective throws std::runtime_error (out
// of autograd), which the trainer turns into a Status.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <torch/types.h>

#include "common/layout.h"
#include "common/status.h"
#include "worker/comm/communicator.h"
#include "worker/model/gpt_model.h"
#include "worker/plan/topology.h"

namespace ltrain::worker {

// What one rank's model shard is built from: the model, the job's layout and the rank's place in it.
struct ModelShardSpec {
  GptConfig config;
  Layout layout;       // tp, pp, chunks, stage_layers, sequence_parallel, activation_checkpointing
  RankCoords coords;   // this rank's tp and pp coordinates pick its slices and stages
  // false: PyTorch's initialisation from the global generator (seed it first). true: each parameter
  // drawn whole on `device` by a copy of the device's generator seeded with (seed, its position),
  // then sliced, so that no rank builds the whole model.
  bool per_parameter_init = false;
  uint64_t seed = 0;
  torch::Device device = torch::kCPU;
};

// The full model's parameters in gpt_model.GPT's registration order: name and shape.
std::vector<std::pair<std::string, std::vector<int64_t>>> GptParameterShapes(const GptConfig& config);
int64_t GptParameterCount(const GptConfig& config);

enum class TpSplit { kReplicated, kRows, kCols, kQkvRows };

// How full-model parameter `name` is split over the ranks of a tp group larger than one.
TpSplit SplitOf(const std::string& name);
// Rank r's slice of full parameter `full` split `split` over `tp` ranks; and the inverse, the full
// parameter of `full_shape` from every rank's slice in tp order (of any shape with the slice's size).
torch::Tensor Slice(const torch::Tensor& full, TpSplit split, int tp, int r);
torch::Tensor Unslice(const std::vector<torch::Tensor>& slices, TpSplit split, const std::vector<int64_t>& full_shape);

struct ShardParam {
  std::string name;                 // the full model's name, e.g. "blocks.3.qkv.weight"
  torch::Tensor value;              // this rank's slice: a leaf that requires grad
  std::vector<int64_t> full_shape;
  TpSplit split = TpSplit::kReplicated;
  bool decay = false;               // weight decay applies (>= 2-D in the full model)
  bool sp_partial = false;          // under sequence parallelism its gradient is a partial sum over tp
  bool counts_for_norm = true;      // counted once in the global gradient norm (not a replica)
  bool exported = true;             // false for the last stage's copy of the tied embedding
  int unit = 0;                     // 0 embedding, 1 + layer for a block, layers + 1 the head
};

// Called around the use of a unit's parameters in forward (ZeRO-3 gathers and frees them there);
// `output` sees the unit's output tensor, to hook its backward.
struct UnitHooks {
  std::function<void(int unit)> before_forward;
  std::function<void(int unit)> after_forward;
  std::function<void(int unit, torch::Tensor& output)> output;
};

class ModelShard {
 public:
  // Seed the global generator first (torch::manual_seed) unless spec.per_parameter_init: PyTorch's
  // initialisation builds the full model from it.
  static StatusOr<std::unique_ptr<ModelShard>> Create(const ModelShardSpec& spec, Communicator* tp);

  std::vector<ShardParam>& params() { return params_; }
  const ModelShardSpec& spec() const { return spec_; }
  int units() const { return spec_.config.layers + 2; }
  // Every parameter of the full model, in its order: name and shape.
  const std::vector<std::pair<std::string, std::vector<int64_t>>>& full_params() const { return full_params_; }

  bool FirstStage(int chunk) const;  // holds the embedding: input is token ids
  bool LastStage(int chunk) const;   // holds the head: output is the loss
  // Shape of the activation passed between stages (sequence-sharded under sequence parallelism).
  std::vector<int64_t> ActivationShape(int micro_batch) const;

  // Runs chunk `chunk`: tokens [b, T] int64 (first stage) or the previous stage's activation in;
  // the activation, or at the last stage the mean cross-entropy over the micro-batch, out.
  torch::Tensor Forward(int chunk, const torch::Tensor& input, const torch::Tensor& targets);

  void set_hooks(UnitHooks hooks) { hooks_ = std::move(hooks); }

  // Under pipeline parallelism, the index in params() of this rank's copy of the tied embedding
  // (first stage: the embedding, last stage: the head); -1 on other stages.
  int TiedEmbeddingParam() const;
  // The pipeline rank holding full-model parameter `name`.
  int PipelineRankOf(const std::string& name) const;

  // One block's forward (public for the activation-checkpointing function).
  torch::Tensor BlockForward(int layer, const torch::Tensor& x);
  torch::Tensor Attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v);

  // The full tensor of a parameter, gathered over the tp group from every rank's `local` slice of
  // it (its value, or the optimizer's fp32 master of it); every tp rank must call it.
  StatusOr<torch::Tensor> GatherFull(const ShardParam& param, const torch::Tensor& local);

 private:
  ModelShard(const ModelShardSpec& spec, Communicator* tp) : spec_(spec), tp_(tp) {}
  const torch::Tensor& P(int layer, const char* name) const;
  torch::Tensor Embed(const torch::Tensor& ids);
  torch::Tensor HeadLoss(const torch::Tensor& x, const torch::Tensor& targets);
  int FirstLayer(int virtual_stage) const;
  void Unit(int unit, bool before);

  ModelShardSpec spec_;
  Communicator* tp_;
  std::vector<ShardParam> params_;
  std::vector<std::pair<std::string, std::vector<int64_t>>> full_params_;
  // Index into params_ of each block's parameters ([layer][name]) and of the others.
  std::vector<std::vector<int>> block_index_;
  std::vector<int> stage_of_layer_;
  int wte_ = -1, wpe_ = -1, lnf_w_ = -1, lnf_b_ = -1, head_wte_ = -1;
  UnitHooks hooks_;
};

}  // namespace ltrain::worker
