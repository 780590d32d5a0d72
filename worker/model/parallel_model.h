// ModelShard: the part of the model that one rank holds under tensor and pipeline parallelism,
// written functionally over plain leaf tensors so that a parameter store can place them in flat
// buffers and shard them (ZeRO). Its parameters are those common/model_family.h lists for model.arch;
// two blocks compute them:
//   gpt2: worker/model/gpt_model.h (gpt_model.GPT), same parameters, names and initialisation.
//   llama and the families of its block: llama_model.Llama (RMSNorm, rotary embeddings in Hugging
//   Face's layout, grouped-query attention, SwiGLU, tied or untied head), same parameter names, with
//   each family's change where its parameters are there: qwen2's q, k and v biases (added after the
//   products), qwen3's per-head RMSNorm of q and k (before the rotation). Heads are model.head_dim wide.

//
// Every rank draws each parameter of the full model and keeps its slice, so every layout starts
// from exactly the parameters one process would have: with PyTorch's initialisation (the whole model
// built on the CPU from the seeded global generator, as gpt_model.GPT), or with a generator of its
// own for each parameter, on the rank's device.
//   Tensor parallel (Megatron-LM): qkv and fc (wq, wk, wv, w1, w3) column-parallel, proj and fc2 (wo,
//   w2) row-parallel, the embedding and the head vocab-parallel, cross-entropy computed without ever
//   forming the full logits. A Llama with fewer key/value heads than tp keeps wk and wv whole on
//   every rank and uses the one head its query heads need; their gradients are summed over tp. Sequence parallel: LayerNorms, residuals and dropout-free regions work on a 1/tp slice of
//   the sequence; all-gather before the column-parallel matmuls and reduce-scatter after the
//   row-parallel ones replace the all-reduces.
//   Pipeline parallel: chunk c of pipeline rank r is virtual stage c*pp + r; the first virtual stage
//   holds the embedding, the last the final norm and the head (a copy of a tied embedding).
//   Activation checkpointing: "full" recomputes each block in backward, "selective" attention's
//   internals on the CPU, and on GPUs the MLP's activation and the norms' outputs (see Selective()).
//
// Runs on the training thread. TP collectives run inside forward and backward: every rank of a TP
// group runs the same chunks in the same order. A failed collective throws std::runtime_error (out
// of autograd), which the trainer turns into a Status.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <torch/types.h>

#include "common/layout.h"
#include "common/model_family.h"
#include "common/recipe.h"
#include "common/status.h"
#include "worker/comm/communicator.h"
#include "worker/model/gpt_model.h"
#include "worker/plan/topology.h"

namespace ltrain::worker {

// What one rank's model shard is built from: the model, the job's layout and the rank's place in it.
struct ModelShardSpec {
  ModelSpec config;
  Layout layout;       // tp, pp, chunks, stage_layers, sequence_parallel, activation_checkpointing
  RankCoords coords;   // this rank's tp and pp coordinates pick its slices and stages
  // false: PyTorch's initialisation from the global generator (seed it first; gpt2 only). true (and
  // always for llama): each parameter drawn whole on `device` by a copy of the device's generator
  // seeded with (seed, its position), then sliced, so that no rank builds the whole model.
  bool per_parameter_init = false;
  uint64_t seed = 0;
  torch::Device device = torch::kCPU;
  // With bf16 parameters: the residual stream (the embedding's output, every block's input and
  // output) in fp32, as autocast keeps it; the norms read it in fp32 and give the products bf16.
  bool fp32_residual = false;
  // With a bf16 residual stream: each block's branch is added to the stream in fp32 and the sum
  // rounded to bf16 stochastically (StochasticRoundedAdd), not to nearest. tp 1, without full
  // activation checkpointing (the noise is drawn again where a forward is made again).
  bool stochastic_residual = false;
  // Under tp without sequence parallelism, a micro-batch of two sequences or more goes through the
  // blocks in two halves along the batch, interleaved at each row-parallel sum, so that one half's
  // all-reduce runs beside the other half's products. Not under ZeRO-3's gathers (the units' output
  // hooks) or full activation checkpointing, where blocks run whole.
  bool tp_split_batch = false;
  // Under FP8 products (FusedKernelOptions::fp8): the blocks whose products stay bf16
  // (parallel.fp8_bf16_layers), each forward and the backward of its products.
  std::vector<int> bf16_layers;
};

// x + branch in fp32, rounded to x's dtype; to bf16 stochastically: up with the probability of the
// part dropped, so that the rounding is unbiased (a branch smaller than half the stream's last bit is
// kept on average, not lost). Backward passes the gradient to both unchanged. The noise comes from
// the default generator of x's device.
torch::Tensor StochasticRoundedAdd(const torch::Tensor& x, const torch::Tensor& branch);

// The GPT module's configuration of a gpt2 model. (ModelParameterShapes, ModelParameterCount and
// LayerOf: common/model_family.h.)
GptConfig GptConfigOf(const ModelSpec& config);

// kRows and kCols split a matrix's first or second dimension; kExpertRows and kExpertCols a stack of
// experts' matrices [experts, rows, cols] along its second or third (each expert split as an MLP's
// matrix is).
enum class TpSplit { kReplicated, kRows, kCols, kQkvRows, kExpertRows, kExpertCols };

// How full-model parameter `name` is split over the ranks of a tp group of `tp` (kReplicated for 1).
TpSplit SplitOf(const ModelSpec& config, const std::string& name, int tp);
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
  bool tp_partial = false;          // its gradient on each tp rank is a partial sum, to be summed over tp
  bool counts_for_norm = true;      // counted once in the global gradient norm (not a replica)
  bool exported = true;             // false for the last stage's copy of the tied embedding
  int unit = 0;                     // 0 embedding, 1 + layer for a block, layers + 1 the head
  // An MoE block's routed experts under expert parallelism (layout.ep > 1): `value` holds this
  // rank's experts/ep of the stack (dim 0, after the tp split), which the ranks of its expert-data
  // group (ProcessGroups::edp) reduce, not the whole data-parallel group.
  bool expert = false;
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
  // Whether parameter `i`'s gradient comes only from the fused products when the model runs in bf16
  // on CUDA (the block matrices; a Llama's wk and wv not where they are replicated over tp).
  bool GradientFromProductsOnly(size_t i) const;
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

  // Logits [b, t, vocab] of token ids [b, t], the head computed in fp32: one rank (tp 1, pp 1) only.
  torch::Tensor Logits(const torch::Tensor& ids);

  void set_hooks(UnitHooks hooks) { hooks_ = std::move(hooks); }
  // Targets may be -100 (supervised fine-tuning data's prompt tokens): the loss is the mean over the
  // others, and 0 for a micro-batch of none.
  void set_masked_targets(bool masked) { masked_targets_ = masked; }

  // Under pipeline parallelism, the index in params() of this rank's copy of the tied embedding
  // (first stage: the embedding, last stage: the head); -1 on other stages and for an untied head.
  int TiedEmbeddingParam() const;
  // The pipeline rank holding full-model parameter `name`.
  int PipelineRankOf(const std::string& name) const;

  // One block's forward (public for the activation-checkpointing function).
  torch::Tensor BlockForward(int layer, const torch::Tensor& x);
  // Whether `layer`'s products stay bf16 under FP8 (ModelShardSpec::bf16_layers).
  bool Bf16Layer(int layer) const;
  torch::Tensor GptBlockForward(int layer, const torch::Tensor& x);
  torch::Tensor LlamaBlockForward(int layer, const torch::Tensor& x);
  // A block under tp: each branch's partial sums (TpBranch) summed over tp (RowSum).
  torch::Tensor TpBlockForward(int layer, const torch::Tensor& x);
  torch::Tensor Attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v);
  // Whether Forward sends a micro-batch of `batch` sequences through the blocks in two halves
  // (spec.tp_split_batch and the layout allow it, and no ZeRO-3 hooks are set), while autograd
  // records (`recording`) or not.
  bool SplitsBatch(int64_t batch, bool recording) const;
  // activation_checkpointing: selective, while autograd records: attention recomputes its internals
  // (on the CPU; flash attention keeps none) and, with the fused products, the MLP its activation's
  // output (GELU; SwiGLU's product) and the products their norm's output in backward.
  bool Selective() const;

  // The full tensor of a parameter, gathered over the tp group from every rank's `local` slice of
  // it (its value, or the optimizer's fp32 master of it); every tp rank must call it.
  StatusOr<torch::Tensor> GatherFull(const ShardParam& param, const torch::Tensor& local);

  // ---- Mixtures of experts (model.moe; worker/model/moe_block.cc) ----
  // The MoE blocks this rank holds, in order.
  const std::vector<int>& MoeLayers() const { return moe_layers_; }
  // The gradient the router's balance and z losses get in backward, for a loss of 1 in the LM loss:
  // 1/(the micro-batches a step accumulates), as the trainer divides the LM loss (and by tp here: every
  // tp rank adds the same gradients).
  void set_aux_scale(double scale) { aux_scale_ = scale; }
  // Expert parallelism (layout.ep > 1): the group that splits each MoE block's experts and exchanges
  // its tokens (ProcessGroups::ep); must be set before the first forward, and outlive the shard.
  void set_expert_group(Communicator* ep) { ep_ = ep; }
  // Context parallelism (layout.cp > 1): the ring of ranks that split each sequence
  // (ProcessGroups::cp); must be set before the first forward, and outlive the shard. Forward then
  // takes this rank's chunks of the token ids and targets it is given whole (context_attention.h).
  void set_context_group(Communicator* cp) { cp_ = cp; }
  // The routed assignments each expert of each MoE block got since the last call, counted while
  // autograd records (the step's training micro-batches; a block recomputed under full activation
  // checkpointing counts in its recomputation only): [MoeLayers().size(), experts], fp32, on the
  // device; zeroed by the call. Empty without MoE blocks.
  torch::Tensor TakeRouteCounts();
  // DeepSeek-V3's balance without a loss (model.moe.balance: bias), from the step's counts summed
  // over data parallelism ([MoeLayers().size(), experts]): each block's bias moves by bias_update
  // towards the experts below the mean load and away from those above it, centred so it stays bounded.
  void UpdateRouterBias(const torch::Tensor& counts);
  // Each MoE block's router bias (fp32 [experts]; zero unless balance is bias), in MoeLayers() order:
  // the checkpoint's.
  std::vector<torch::Tensor>& router_biases() { return router_bias_; }
  // The balance and z losses (without their coefficients) of the step's micro-batches since the last
  // call, averaged over MoE blocks and micro-batches: {aux, z}, each undefined where none was computed.
  std::pair<torch::Tensor, torch::Tensor> TakeRouterLosses();
  // model.moe.capacity_factor: the assignments dropped for want of room in their expert and all the
  // assignments routed, over this rank's MoE blocks and training micro-batches since the last call
  // (as TakeRouteCounts counts); {0, 0} when dropless.
  std::pair<double, double> TakeDropCounts();

 private:
  // One residual branch of a block under tp up to its row-parallel product: the residual it adds
  // to, this rank's partial sums of the branch, and the bias added to their sum (a GPT's).
  struct BranchPartial {
    torch::Tensor residual, partial, bias;
  };
  class RowSum;

  ModelShard(const ModelShardSpec& spec, Communicator* tp) : spec_(spec), tp_(tp) {}
  // Branch 0 (attention) or 1 (MLP) of block `layer` under tp, from the block's or branch's input x.
  BranchPartial TpBranch(int layer, int branch, const torch::Tensor& x);
  // A GPT's and a llama's attention up to the output projection: {its input [b, t, c/tp], the
  // residual branch's x}; a llama's gate and up projections of the normed x.
  std::pair<torch::Tensor, torch::Tensor> GptAttention(int layer, const torch::Tensor& x);
  std::pair<torch::Tensor, torch::Tensor> LlamaAttention(int layer, const torch::Tensor& x);
  std::pair<torch::Tensor, torch::Tensor> LlamaGateUp(int layer, const torch::Tensor& m_local);
  // An MoE block's branch in place of the MLP, from the normed x [b, t, d]: the routed experts'
  // weighted outputs and the shared experts' (moe_block.cc).
  torch::Tensor MoeBranch(int layer, const torch::Tensor& m);
  // The slot of `layer` in MoeLayers(), -1 for a dense block.
  int MoeSlot(int layer) const;
  // A tp block's input where every tp rank needs it whole: Megatron's f, or the sequence's gather.
  torch::Tensor Enter(const torch::Tensor& x) const;
  const torch::Tensor& P(int layer, const char* name) const;
  // A block parameter its family may lack (qwen2's biases, qwen3's norms): null where it has none.
  const torch::Tensor* Optional(int layer, const char* name) const;
  // This rank's rows of wk or wv: its slice, or its key/value head of the whole weight.
  torch::Tensor KvWeight(int layer, const char* name) const;
  torch::Tensor Rope(const torch::Tensor& x) const;  // [b, t, heads, head_dim]
  torch::Tensor FinalNorm(const torch::Tensor& x);
  torch::Tensor Embed(const torch::Tensor& ids);
  torch::Tensor HeadLoss(const torch::Tensor& x, const torch::Tensor& targets);
  int FirstLayer(int virtual_stage) const;
  void Unit(int unit, bool before);

  // The routed experts' SwiGLU over xs (the rows routed here, sorted by expert; counts[e] for each of
  // the block's experts): on this rank, or under expert parallelism sent to the ranks holding their
  // experts and back by all-to-all (moe_block.cc).
  torch::Tensor RoutedExperts(int layer, const torch::Tensor& xs, const std::vector<int64_t>& counts);

  ModelShardSpec spec_;
  Communicator* tp_;
  Communicator* ep_ = nullptr;
  Communicator* cp_ = nullptr;
  torch::Tensor positions_;  // under cp: the sequence positions of this rank's tokens, in its order
  std::vector<ShardParam> params_;
  std::vector<std::pair<std::string, std::vector<int64_t>>> full_params_;
  // Each block's parameter names (BlockParameterNames: an MoE block's differ), and the index into
  // params_ of each block's parameters ([layer][name]) and of the others.
  std::vector<std::vector<std::string>> block_names_;
  std::vector<std::vector<int>> block_index_;
  std::vector<int> stage_of_layer_;
  int embed_ = -1, wpe_ = -1, norm_w_ = -1, norm_b_ = -1, head_ = -1;
  bool kv_replicated_ = false;  // a Llama block with kv_heads < tp
  torch::Tensor rope_cos_, rope_sin_;  // [seq_len, head_dim/2], fp32
  UnitHooks hooks_;
  bool masked_targets_ = false;
  // MoE blocks here; their router biases, route counts and loss sums (by slot), the aux losses' scale.
  std::vector<int> moe_layers_;
  std::vector<torch::Tensor> router_bias_, route_counts_;
  torch::Tensor aux_sum_, z_sum_;
  int64_t aux_terms_ = 0, z_terms_ = 0;
  double dropped_ = 0, routed_ = 0;
  double aux_scale_ = 1.0;
};

}  // namespace ltrain::worker
