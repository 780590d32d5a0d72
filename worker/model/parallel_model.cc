#include "worker/model/parallel_model.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>
#include <stdexcept>

#include <ATen/Context.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/autograd.h>
#include <torch/nn/functional.h>

#include "common/data/token_data.h"
#include "common/model_family.h"
#include "worker/control/progress.h"
#include "worker/model/comm_handle.h"
#include "worker/model/context_attention.h"
#include "worker/model/fused_kernels.h"
#include "worker/model/shard_ops.h"
#include "worker/torch_compat.h"

namespace ltrain::worker {
namespace {

namespace F = torch::nn::functional;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

bool EndsWith(const std::string& name, const std::string& suffix) {
  return name.size() >= suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0;
}

bool LlamaBlock(const ModelSpec& c) { return FamilyOf(c.arch).llama_block; }

// The token embedding's name.
const char* EmbeddingName(const ModelSpec& c) { return LlamaBlock(c) ? "tok_embeddings.weight" : "wte.weight"; }

// A key or value projection's weight or bias (qwen2).
bool KvParam(const std::string& name) {
  return EndsWith(name, ".wk.weight") || EndsWith(name, ".wv.weight") || EndsWith(name, ".wk.bias") ||
         EndsWith(name, ".wv.bias");
}

// Full activation checkpointing: forward without a graph, keep only the block's input; backward
// recomputes the block with a graph and backpropagates through it (parameter gradients accumulate
// into the leaves as usual, their hooks included).
struct CheckpointBlock : public torch::autograd::Function<CheckpointBlock> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, int64_t shard, int64_t layer) {
    ctx->saved_data["shard"] = shard;
    ctx->saved_data["layer"] = layer;
    ctx->save_for_backward({x});
    return reinterpret_cast<ModelShard*>(shard)->BlockForward(static_cast<int>(layer), x);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto* shard = reinterpret_cast<ModelShard*>(ctx->saved_data["shard"].toInt());
    const int layer = static_cast<int>(ctx->saved_data["layer"].toInt());
    torch::Tensor x = ctx->get_saved_variables()[0].detach().requires_grad_(true);
    torch::Tensor out;
    {
      torch::AutoGradMode enable(true);
      out = shard->BlockForward(layer, x);
    }
    torch::autograd::backward({out}, {grads[0]});
    return {x.grad(), torch::Tensor(), torch::Tensor()};
  }
};

// llama_model.Llama's initialisation: every matrix N(0, 0.02), the residual output projections (wo,
// w2) N(0, 0.02/sqrt(2 layers)), the norms 1; qwen2's biases 0.
ParamInit LlamaParamInit(const std::string& name, int64_t dims, int layers) {
  if (EndsWith(name, "wo.weight") || EndsWith(name, "w2.weight")) return {ParamInit::kNormal, 0.02 / std::sqrt(2.0 * layers)};
  if (dims >= 2) return {ParamInit::kNormal, 0.02};
  if (EndsWith(name, ".bias")) return {ParamInit::kZeros, 0};
  return {ParamInit::kOnes, 0};
}

// The full parameter `index` of the per-parameter initialisation: the Python model's distribution
// (GptParamInit, LlamaParamInit), drawn on `device` by a copy of its default generator seeded for
// this parameter (a copy: the global generator's state stays as the trainer seeded it).
// Of a stack of experts, only experts [first_expert, first_expert + shape[0]) are drawn (expert
// parallelism: this rank's), each with the numbers it has in the whole stack.
torch::Tensor PerParameterInit(const ModelSpec& c, const std::string& name, const std::vector<int64_t>& shape,
                               uint64_t seed, size_t index, const torch::Device& device, int64_t first_expert = 0) {
  const torch::TensorOptions options = torch::TensorOptions().dtype(torch::kFloat).device(device);
  const int64_t dims = static_cast<int64_t>(shape.size());
  const ParamInit init = LlamaBlock(c) ? LlamaParamInit(name, dims, c.layers) : GptParamInit(name, dims, c.layers);
  if (init.kind == ParamInit::kZeros) return torch::zeros(shape, options);
  if (init.kind == ParamInit::kOnes) return torch::ones(shape, options);
  at::Generator generator = at::globalContext().defaultGenerator(device).clone();
  const uint64_t parameter_seed = SplitMix64(seed ^ SplitMix64(static_cast<uint64_t>(index) + 1));
  if (EndsWith(name, ".weight") && name.find(".experts.") != std::string::npos) {
    // A stack of experts: each drawn by a generator of its own, so that a rank holding some of them
    // (expert parallelism) draws only those, and the same numbers.
    torch::Tensor out = torch::empty(shape, options);
    for (int64_t e = 0; e < shape[0]; ++e) {
      const auto expert = static_cast<uint64_t>(first_expert + e);
      generator.set_current_seed(SplitMix64(parameter_seed ^ SplitMix64(expert + 0x5eed)));
      out[e].normal_(0.0, init.stddev, generator);
    }
    return out;
  }
  generator.set_current_seed(parameter_seed);
  return torch::empty(shape, options).normal_(0.0, init.stddev, generator);
}

// The dimension a split divides (kQkvRows: the first, by thirds; kReplicated: none, -1).
int SplitDim(TpSplit split) {
  switch (split) {
    case TpSplit::kRows: case TpSplit::kQkvRows: return 0;
    case TpSplit::kCols: case TpSplit::kExpertRows: return 1;
    case TpSplit::kExpertCols: return 2;
    case TpSplit::kReplicated: break;
  }
  return -1;
}

}  // namespace

torch::Tensor Slice(const torch::Tensor& full, TpSplit split, int tp, int r) {
  switch (split) {
    case TpSplit::kReplicated: return full.detach().clone();
    case TpSplit::kRows: return full.detach().chunk(tp, 0)[r].clone();
    case TpSplit::kCols: case TpSplit::kExpertRows: case TpSplit::kExpertCols:
      return full.detach().chunk(tp, SplitDim(split))[r].contiguous();
    case TpSplit::kQkvRows: {
      std::vector<int64_t> shape = full.sizes().vec();
      const int64_t c = shape[0] / 3;
      std::vector<int64_t> split_shape = shape;
      split_shape[0] = c;
      split_shape.insert(split_shape.begin(), 3);
      std::vector<int64_t> local = shape;
      local[0] = 3 * (c / tp);
      return full.detach().reshape(split_shape).narrow(1, r * (c / tp), c / tp).reshape(local).clone();
    }
  }
  return full;
}

TpSplit SplitOf(const ModelSpec& c, const std::string& name, int tp) {
  if (tp <= 1) return TpSplit::kReplicated;
  auto ends = [&](const std::string& suffix) { return EndsWith(name, suffix); };
  if (LlamaBlock(c)) {
    // An MoE block's experts: each split as the MLP's matrices are (the router stays whole).
    if (ends(".experts.w1.weight") || ends(".experts.w3.weight")) return TpSplit::kExpertRows;
    if (ends(".experts.w2.weight")) return TpSplit::kExpertCols;
    if (name == "tok_embeddings.weight" || name == "output.weight" || ends(".wq.weight") || ends(".wq.bias") ||
        ends(".w1.weight") || ends(".w3.weight")) {
      return TpSplit::kRows;
    }
    if (KvParam(name)) return KvHeads(c) % tp == 0 ? TpSplit::kRows : TpSplit::kReplicated;
    if (ends(".wo.weight") || ends(".w2.weight")) return TpSplit::kCols;
    return TpSplit::kReplicated;
  }
  if (name == "wte.weight" || ends("fc.weight") || ends("fc.bias")) return TpSplit::kRows;
  if (ends("qkv.weight") || ends("qkv.bias")) return TpSplit::kQkvRows;
  if (ends("proj.weight") || ends("fc2.weight")) return TpSplit::kCols;
  return TpSplit::kReplicated;
}

GptConfig GptConfigOf(const ModelSpec& c) { return GptConfig{c.layers, c.d_model, c.heads, c.seq_len, c.vocab}; }

torch::Tensor Unslice(const std::vector<torch::Tensor>& slices, TpSplit split, const std::vector<int64_t>& full_shape) {
  const int tp = static_cast<int>(slices.size());
  std::vector<int64_t> local = full_shape;
  int dim = 0;
  switch (split) {
    case TpSplit::kReplicated: return slices[0].reshape(full_shape);
    case TpSplit::kRows: case TpSplit::kCols: case TpSplit::kExpertRows: case TpSplit::kExpertCols:
      dim = SplitDim(split);
      local[dim] /= tp;
      break;
    case TpSplit::kQkvRows: {
      // Each slice holds its share of q, k and v: [3, c/tp, ...] side by side along the second dim.
      local.insert(local.begin(), 3);
      local[1] = full_shape[0] / 3 / tp;
      dim = 1;
      break;
    }
  }
  std::vector<torch::Tensor> parts;
  for (const torch::Tensor& s : slices) parts.push_back(s.reshape(local));
  return torch::cat(parts, dim).reshape(full_shape);
}


StatusOr<std::unique_ptr<ModelShard>> ModelShard::Create(const ModelShardSpec& spec, Communicator* tp) {
  const ModelSpec& c = spec.config;
  const int tp_size = spec.layout.tp;
  const bool llama = LlamaBlock(c);
  if (tp_size != tp->size()) return InvalidArgument("tp group size differs from parallel.tp");
  if (c.moe.experts > 0 && MoeFfnWidth(c) % tp_size != 0) {
    return InvalidArgument("parallel.tp=" + std::to_string(tp_size) + " must divide the experts' width " +
                           std::to_string(MoeFfnWidth(c)) + " (model.moe.ffn)");
  }
  if (c.heads % tp_size != 0 || c.vocab % tp_size != 0 || FfnWidth(c) % tp_size != 0) {
    return InvalidArgument("parallel.tp=" + std::to_string(tp_size) + " must divide model.heads=" +
                           std::to_string(c.heads) + ", model.vocab=" + std::to_string(c.vocab) +
                           " and the MLP width " + std::to_string(FfnWidth(c)));
  }
  const int kv = KvHeads(c);
  if (c.heads % kv != 0 || (kv % tp_size != 0 && tp_size % kv != 0)) {
    return InvalidArgument("model.kv_heads=" + std::to_string(kv) + " must divide model.heads=" + std::to_string(c.heads) +
                           " and be a multiple or a divisor of parallel.tp=" + std::to_string(tp_size));
  }
  if (spec.layout.sequence_parallel && c.seq_len % tp_size != 0) {
    return InvalidArgument("sequence_parallel needs parallel.tp=" + std::to_string(tp_size) +
                           " to divide model.seq_len=" + std::to_string(c.seq_len));
  }
  const int stages = spec.layout.pp * spec.layout.chunks;
  if (static_cast<int>(spec.layout.stage_layers.size()) != stages) return InvalidArgument("stage_layers needs pp*chunks entries");
  std::unique_ptr<ModelShard> shard(new ModelShard(spec, tp));
  // Which virtual stage runs each layer.
  std::vector<int> stage_of_layer;
  for (int s = 0; s < stages; ++s) {
    for (int i = 0; i < spec.layout.stage_layers[s]; ++i) stage_of_layer.push_back(s);
  }
  if (static_cast<int>(stage_of_layer.size()) != c.layers) return InvalidArgument("stage_layers must sum to model.layers");
  shard->stage_of_layer_ = stage_of_layer;
  shard->kv_replicated_ = llama && kv < tp_size;
  const bool first = spec.coords.pp == 0, last = spec.coords.pp == spec.layout.pp - 1;
  if (spec.layout.cp > 1) {
    if (c.seq_len % (2 * spec.layout.cp) != 0 || spec.layout.dp % spec.layout.cp != 0) {
      return InvalidArgument("parallel.cp=" + std::to_string(spec.layout.cp) + " needs model.seq_len a multiple of " +
                             std::to_string(2 * spec.layout.cp) + " and to divide the data-parallel degree");
    }
    shard->positions_ = cp::PositionsOf(c.seq_len, spec.layout.cp, spec.coords.dp % spec.layout.cp, spec.device);
  }
  if (llama) {
    // llama_model.rope_tables: pair i of a head turns by position * theta^(-2i/head_dim).
    const int64_t hd = HeadDim(c);
    const torch::TensorOptions f32 = torch::TensorOptions().dtype(torch::kFloat).device(spec.device);
    torch::Tensor inv = 1.0 / torch::pow(c.rope_theta, torch::arange(0, hd, 2, f32) / static_cast<double>(hd));
    if (c.rope_scaling != RopeScaling::kNone) {
      // transformers' rope_scaling (linear, llama3): the frequencies rescaled.
      const std::vector<float> scaled = RopeInverseFrequencies(c);
      inv = torch::tensor(scaled, torch::TensorOptions().dtype(torch::kFloat)).to(spec.device);
    }
    torch::Tensor positions = torch::arange(c.seq_len, f32);
    // Under cp each rank's tokens sit at its chunks' positions: the tables in its order.
    if (spec.layout.cp > 1) positions = cp::PositionsOf(c.seq_len, spec.layout.cp, spec.coords.dp % spec.layout.cp).to(f32);
    torch::Tensor angles = torch::outer(positions, inv);
    shard->rope_cos_ = angles.cos();
    shard->rope_sin_ = angles.sin();
  }

  torch::NoGradGuard no_grad;
  // The full model's parameters in order, each made when a slice of it is wanted.
  const bool per_parameter = spec.per_parameter_init || llama;
  std::vector<std::pair<std::string, std::vector<int64_t>>> shapes;
  std::vector<torch::Tensor> built;  // PyTorch's initialisation: the whole model, built at once
  if (per_parameter) {
    shapes = ModelParameterShapes(c);
  } else {
    Gpt full(GptConfigOf(c));
    for (const auto& item : full->named_parameters()) {
      shapes.emplace_back(item.key(), item.value().sizes().vec());
      built.push_back(item.value());
    }
  }
  // Expert parallelism: this rank's experts of each MoE block, [first_expert, first_expert + local).
  const int ep = std::max(1, spec.layout.ep);
  if (ep > 1 && (c.moe.experts == 0 || c.moe.experts % ep != 0 || spec.layout.dp % ep != 0)) {
    return InvalidArgument("parallel.ep=" + std::to_string(ep) + " must divide model.moe.experts=" +
                           std::to_string(c.moe.experts) + " and the data-parallel degree " +
                           std::to_string(spec.layout.dp));
  }
  const int64_t local_experts = ep > 1 ? c.moe.experts / ep : c.moe.experts;
  const int64_t first_expert = ep > 1 ? static_cast<int64_t>(spec.coords.dp % ep) * local_experts : 0;
  auto split_over_ep = [&](const std::string& name) {
    return ep > 1 && name.find(".experts.") != std::string::npos && EndsWith(name, ".weight");
  };
  auto full_param = [&](size_t i) {
    if (!per_parameter) return built[i];
    if (split_over_ep(shapes[i].first)) {
      std::vector<int64_t> shape = shapes[i].second;
      shape[0] = local_experts;
      return PerParameterInit(c, shapes[i].first, shape, spec.seed, i, spec.device, first_expert);
    }
    return PerParameterInit(c, shapes[i].first, shapes[i].second, spec.seed, i, spec.device);
  };
  for (int l = 0; l < c.layers; ++l) {
    shard->block_names_.push_back(BlockParameterNames(c, l));
    shard->block_index_.emplace_back(shard->block_names_.back().size(), -1);
  }
  auto add = [&](const std::string& name, const torch::Tensor& t, int unit, bool exported) {
    ShardParam p;
    p.name = name;
    p.full_shape = t.sizes().vec();
    p.expert = split_over_ep(name);
    if (p.expert) {
      if (!per_parameter) throw std::logic_error("expert parallelism needs the per-parameter initialisation");
      p.full_shape[0] = c.moe.experts;  // `t` holds this rank's experts only
    }
    p.split = SplitOf(c, name, tp_size);
    p.value = Slice(t, p.split, tp_size, spec.coords.tp).requires_grad_(true);
    p.decay = t.dim() >= 2;
    // Whole on every tp rank but read by each for other heads: a key/value projection kept whole (fewer
    // key/value heads than tp), qwen3's per-head norms of q and k.
    const bool per_head = tp_size > 1 && (EndsWith(name, "q_norm.weight") || EndsWith(name, "k_norm.weight"));
    const bool kv_whole = shard->kv_replicated_ && KvParam(name);
    // An MoE router's gradient: each tp rank's gates weigh its partial sums of the experts' outputs.
    const bool router = tp_size > 1 && EndsWith(name, ".router.weight");
    p.tp_partial = kv_whole || per_head || router || (spec.layout.sequence_parallel && p.split == TpSplit::kReplicated);
    p.counts_for_norm = exported && (p.split != TpSplit::kReplicated || spec.coords.tp == 0);
    p.exported = exported;
    p.unit = unit;
    shard->params_.push_back(std::move(p));
    return static_cast<int>(shard->params_.size()) - 1;
  };
  const std::string embedding = EmbeddingName(c);
  torch::Tensor embed;
  constexpr const char* kBuilding = "building the model";
  for (size_t i = 0; i < shapes.size(); ++i) {
    // A large model takes a while on CPU: the count shows the coordinator that start-up moves.
    Progress::Global().SetWork(kBuilding, static_cast<int64_t>(i), static_cast<int64_t>(shapes.size()),
                               "parameter tensors");
    const std::string& name = shapes[i].first;
    shard->full_params_.emplace_back(name, shapes[i].second);
    const int layer = LayerOf(name);
    if (name == embedding) {
      if (first || (last && c.tie_embeddings)) embed = full_param(i);
      if (first) shard->embed_ = add(name, embed, 0, true);
    } else if (name == "wpe.weight") {
      if (first) shard->wpe_ = add(name, full_param(i), 0, true);
    } else if (layer >= 0) {
      if (stage_of_layer[layer] % spec.layout.pp != spec.coords.pp) continue;
      const std::string local = name.substr(name.find('.', 7) + 1);
      const std::vector<std::string>& names = shard->block_names_[layer];
      for (size_t k = 0; k < names.size(); ++k) {
        if (local == names[k]) shard->block_index_[layer][k] = add(name, full_param(i), 1 + layer, true);
      }
    } else if (name == "lnf.weight" || name == "norm.weight") {
      if (last) shard->norm_w_ = add(name, full_param(i), c.layers + 1, true);
    } else if (name == "lnf.bias") {
      if (last) shard->norm_b_ = add(name, full_param(i), c.layers + 1, true);
    } else if (name == "output.weight") {
      if (last) shard->head_ = add(name, full_param(i), c.layers + 1, true);
    }
  }
  Progress::Global().EndWork(kBuilding);
  // The MoE blocks of this rank's stages: a router bias and route counts each.
  for (int l = 0; l < c.layers; ++l) {
    if (!IsMoeLayer(c, l) || stage_of_layer[l] % spec.layout.pp != spec.coords.pp) continue;
    const torch::TensorOptions f32 = torch::TensorOptions().dtype(torch::kFloat).device(spec.device);
    shard->moe_layers_.push_back(l);
    shard->router_bias_.push_back(torch::zeros({c.moe.experts}, f32));
    shard->route_counts_.push_back(torch::zeros({c.moe.experts}, f32));
  }
  // A tied head is the embedding: on a last stage that is not also the first it gets a copy of its
  // own (the two copies' gradients are summed over the embedding group, so they stay equal).
  if (c.tie_embeddings) {
    shard->head_ = shard->embed_;
    if (last && !first) shard->head_ = add(embedding, embed, c.layers + 1, false);
  }
  return shard;
}

int ModelShard::TiedEmbeddingParam() const {
  if (spec_.layout.pp == 1 || !spec_.config.tie_embeddings) return -1;
  if (spec_.coords.pp == 0) return embed_;
  if (spec_.coords.pp == spec_.layout.pp - 1) return head_;
  return -1;
}

int ModelShard::PipelineRankOf(const std::string& name) const {
  if (name == EmbeddingName(spec_.config) || name == "wpe.weight") return 0;
  if (const int layer = LayerOf(name); layer >= 0) return stage_of_layer_[layer] % spec_.layout.pp;
  return spec_.layout.pp - 1;
}

const torch::Tensor& ModelShard::P(int layer, const char* name) const {
  if (const torch::Tensor* p = Optional(layer, name)) return *p;
  throw std::logic_error(std::string("no block parameter ") + name + " in block " + std::to_string(layer));
}

const torch::Tensor* ModelShard::Optional(int layer, const char* name) const {
  const std::vector<std::string>& names = block_names_[layer];
  for (size_t k = 0; k < names.size(); ++k) {
    if (names[k] == name) return &params_[block_index_[layer][k]].value;
  }
  return nullptr;
}

int ModelShard::FirstLayer(int virtual_stage) const {
  int layer = 0;
  for (int s = 0; s < virtual_stage; ++s) layer += spec_.layout.stage_layers[s];
  return layer;
}

bool ModelShard::FirstStage(int chunk) const { return spec_.coords.pp == 0 && chunk == 0; }

bool ModelShard::LastStage(int chunk) const {
  return spec_.coords.pp == spec_.layout.pp - 1 && chunk == spec_.layout.chunks - 1;
}

std::vector<int64_t> ModelShard::ActivationShape(int micro_batch) const {
  const int64_t local = spec_.config.seq_len / std::max(1, spec_.layout.cp);
  const int64_t t = spec_.layout.sequence_parallel ? local / spec_.layout.tp : local;
  return {micro_batch, t, spec_.config.d_model};
}

void ModelShard::Unit(int unit, bool before) {
  const auto& hook = before ? hooks_.before_forward : hooks_.after_forward;
  if (hook) hook(unit);
}

bool ModelShard::SplitsBatch(int64_t batch, bool recording) const {
  const Layout& l = spec_.layout;
  const bool full_recompute = l.activation_checkpointing == ActivationCheckpointing::kFull && recording;
  return spec_.tp_split_batch && l.tp > 1 && !l.sequence_parallel && batch >= 2 && !full_recompute && !hooks_.output &&
         moe_layers_.empty();
}

bool ModelShard::Selective() const {
  return spec_.layout.activation_checkpointing == ActivationCheckpointing::kSelective && torch::GradMode::is_enabled();
}

torch::Tensor ModelShard::Attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v) {
  if (spec_.layout.cp > 1) {
    if (cp_ == nullptr) throw std::logic_error("parallel.cp without its context-parallel group");
    return cp::RingAttention(q, k, v, cp_);
  }
  // On GPUs flash attention keeps only q, k, v, its output (which the next product keeps anyway) and
  // a row statistic: nothing for selective recompute to drop.
  if (Selective() && !q.is_cuda()) {
    return CheckpointedAttention(q, k, v);
  }
  return compat::CausalAttentionGqa(q, k, v);
}

bool ModelShard::GradientFromProductsOnly(size_t i) const {
  if (i >= params_.size()) return false;
  const ShardParam& p = params_[i];
  if (p.value.dim() != 2 || !FusedLinearTakes(p.value.size(0), p.value.size(1))) return false;
  const std::string& name = p.name;
  auto ends = [&](const char* suffix) { return EndsWith(name, suffix); };
  // An MoE block's router, experts and shared experts: LibTorch's products.
  if (name.find(".router.") != std::string::npos || name.find(".experts.") != std::string::npos ||
      name.find(".shared.") != std::string::npos) {
    return false;
  }
  if (LlamaBlock(spec_.config)) {
    // Key and value matrices kept whole on every tp rank are read through views, by LibTorch's product
    // (LlamaBlockForward), which adds to the gradient.
    if (ends(".wk.weight") || ends(".wv.weight")) return !kv_replicated_;
    return ends(".wq.weight") || ends(".wo.weight") || ends(".w1.weight") || ends(".w3.weight") || ends(".w2.weight");
  }
  // A GPT's block matrices: every path through GptBlockForward, under tp too, takes them to a fused
  // product when FusedLinearTakes holds (the tied table is not one of them: the embedding adds to it).
  return ends(".qkv.weight") || ends(".proj.weight") || ends(".fc.weight") || ends(".fc2.weight");
}

bool ModelShard::Bf16Layer(int layer) const {
  return std::find(spec_.bf16_layers.begin(), spec_.bf16_layers.end(), layer) != spec_.bf16_layers.end();
}

torch::Tensor ModelShard::BlockForward(int layer, const torch::Tensor& x) {
  // The products' backward runs in the precision their forward noted (under FP8).
  std::optional<Bf16ProductsScope> bf16;
  if (Bf16Layer(layer)) bf16.emplace(true);
  return LlamaBlock(spec_.config) ? LlamaBlockForward(layer, x) : GptBlockForward(layer, x);
}

torch::Tensor ModelShard::KvWeight(int layer, const char* name) const {
  const torch::Tensor& w = P(layer, name);
  if (!kv_replicated_) return w;
  // Whole on every rank: this rank's query heads all read key/value head tp_rank*kv/tp.
  const int64_t hd = HeadDim(spec_.config);
  const int64_t head = int64_t{spec_.coords.tp} * KvHeads(spec_.config) / spec_.layout.tp;
  return w.narrow(0, head * hd, hd);
}

torch::Tensor ModelShard::Rope(const torch::Tensor& x) const {
  if (FusedLlamaOpsAvailable(x)) return FusedRope(x, rope_cos_, rope_sin_);
  // llama_model.apply_rope: (a, b) halves of each head turn into (a cos - b sin, b cos + a sin).
  const int64_t t = x.size(1);
  torch::Tensor xf = x.to(torch::kFloat);
  std::vector<torch::Tensor> halves = xf.chunk(2, -1);
  torch::Tensor cos = rope_cos_.narrow(0, 0, t).unsqueeze(1), sin = rope_sin_.narrow(0, 0, t).unsqueeze(1);
  return torch::cat({halves[0] * cos - halves[1] * sin, halves[1] * cos + halves[0] * sin}, -1).to(x.scalar_type());
}

torch::Tensor ModelShard::Enter(const torch::Tensor& x) const {
  if (spec_.layout.tp == 1) return x;
  return spec_.layout.sequence_parallel ? GatherSeq(x, tp_) : CopyToTp(x, tp_);
}

// A tp branch's output: residual + (the sum over tp of its partial sums + bias), the sum made inline
// (sequence parallel: this rank's slice of it) or, `beside`, begun on the side stream and waited for
// by Finish().
class ModelShard::RowSum {
 public:
  RowSum(const ModelShard& shard, BranchPartial branch, bool beside) : branch_(std::move(branch)) {
    Communicator* const comm = shard.tp_;
    if (beside) {
      sum_ = ReduceFromTpBeside(branch_.partial, comm, &pending_);
    } else {
      sum_ = shard.spec_.layout.sequence_parallel ? ScatterSeq(branch_.partial, comm) : ReduceFromTp(branch_.partial, comm);
    }
    branch_.partial = torch::Tensor();
  }
  RowSum(const RowSum&) = delete;
  RowSum& operator=(const RowSum&) = delete;

  // Once: the branch's output (the current stream waits for the sum first).
  torch::Tensor Finish() {
    pending_.reset();
    torch::Tensor out = branch_.residual + (branch_.bias.defined() ? sum_ + branch_.bias : sum_);
    branch_ = {};
    sum_ = torch::Tensor();
    return out;
  }

 private:
  BranchPartial branch_;
  torch::Tensor sum_;
  std::unique_ptr<SideStreamSum> pending_;
};

torch::Tensor ModelShard::TpBlockForward(int layer, const torch::Tensor& x) {
  torch::Tensor h = RowSum(*this, TpBranch(layer, 0, x), false).Finish();
  return RowSum(*this, TpBranch(layer, 1, h), false).Finish();
}

ModelShard::BranchPartial ModelShard::TpBranch(int layer, int branch, const torch::Tensor& x) {
  std::optional<Bf16ProductsScope> bf16;  // as BlockForward's
  if (Bf16Layer(layer)) bf16.emplace(true);
  if (LlamaBlock(spec_.config)) {
    if (branch == 0) {
      auto [y, x_res] = LlamaAttention(layer, x);
      return {x_res, NoBiasLinear(y, P(layer, "wo.weight")), {}};
    }
    auto [m_local, r_res] = RmsNorm(x, P(layer, "ffn_norm.weight"), spec_.config.norm_eps, Selective());
    // An MoE block: every tp rank routes the whole sequence alike, its experts' slices give partial sums.
    if (IsMoeLayer(spec_.config, layer)) return {r_res, MoeBranch(layer, Enter(m_local)), {}};
    auto [g, u] = LlamaGateUp(layer, m_local);
    const torch::Tensor& w2 = P(layer, "w2.weight");
    if (Selective() && FusedLlamaOpsAvailable(g) && FusedLinearAvailable(g, w2)) {
      return {r_res, FusedSwiGluLinear(g, u, w2), {}};  // the product's input made again in backward
    }
    torch::Tensor gate = SwiGlu(g, u);
    return {r_res, NoBiasLinear(gate, w2), {}};
  }
  if (branch == 0) {
    auto [y, x_res] = GptAttention(layer, x);
    // Through our product where it takes it, like every other block matrix: its gradient is then
    // written by the product (GradientFromProductsOnly), not added to by LibTorch's.
    return {x_res, NoBiasLinear(y, P(layer, "proj.weight")), P(layer, "proj.bias")};
  }
  auto [m_local, h] = LayerNorm(x, P(layer, "ln2.weight"), P(layer, "ln2.bias"), Selective());
  const torch::Tensor &fc_w = P(layer, "fc.weight"), &fc_b = P(layer, "fc.bias");
  const torch::Tensor &fc2_w = P(layer, "fc2.weight"), &fc2_b = P(layer, "fc2.bias");
  Communicator* const sum_in_product = SumInProducts(spec_.layout, tp_);
  if (sum_in_product && FusedLinearAvailable(m_local, fc_w) && FusedLinearAvailable(m_local, fc2_w)) {
    return {h, FusedMlp(m_local, fc_w, fc_b, fc2_w, {}, {}, sum_in_product, Selective()), fc2_b};
  }
  return {h, Mlp(Enter(m_local), fc_w, fc_b, fc2_w, {}, {}, Selective()), fc2_b};
}

std::pair<torch::Tensor, torch::Tensor> ModelShard::LlamaAttention(int layer, const torch::Tensor& x) {
  const ModelSpec& c = spec_.config;
  const int tp = spec_.layout.tp;
  const int64_t hd = HeadDim(c);
  const int64_t heads_local = c.heads / tp;
  const int64_t kv_local = kv_replicated_ ? 1 : KvHeads(c) / tp;
  // The residual branch reads x through the norm's second output (see RmsNorm).
  auto [h_local, x_res] = RmsNorm(x, P(layer, "attn_norm.weight"), c.norm_eps, Selective());
  const torch::Tensor &wq = P(layer, "wq.weight"), &wk = P(layer, "wk.weight"), &wv = P(layer, "wv.weight");
  const bool fused_qkv = !kv_replicated_ && FusedLinearAvailable(h_local, wq) && FusedLinearAvailable(h_local, wk) &&
                         FusedLinearAvailable(h_local, wv);
  Communicator* const sum_in_product = SumInProducts(spec_.layout, tp_);
  torch::Tensor h = fused_qkv && sum_in_product ? h_local : Enter(h_local);
  const int64_t b = h.size(0), t = h.size(1);
  torch::Tensor q_lin, k_lin, v_lin;
  if (fused_qkv) {
    std::vector<torch::Tensor> qkv = FusedProjections(h, {wq, wk, wv}, sum_in_product);
    q_lin = qkv[0], k_lin = qkv[1], v_lin = qkv[2];
  } else {
    // wk and wv kept whole (fewer key/value heads than tp) are used through a view: LibTorch's product.
    auto kv_linear = [&](const char* name) {
      return kv_replicated_ ? at::linear(h, KvWeight(layer, name)) : NoBiasLinear(h, P(layer, name));
    };
    q_lin = NoBiasLinear(h, wq), k_lin = kv_linear("wk.weight"), v_lin = kv_linear("wv.weight");
  }
  if (const torch::Tensor* bq = Optional(layer, "wq.bias")) {
    // qwen2: the biases added after the products (our products take none).
    q_lin = q_lin + *bq;
    k_lin = k_lin + KvWeight(layer, "wk.bias");
    v_lin = v_lin + KvWeight(layer, "wv.bias");
  }
  torch::Tensor q = q_lin.view({b, t, heads_local, hd}), k = k_lin.view({b, t, kv_local, hd});
  if (const torch::Tensor* qn = Optional(layer, "q_norm.weight")) {
    // qwen3: each head of q and of k normed on its own, before the rotation.
    q = RmsNorm(q, *qn, c.norm_eps).first;
    k = RmsNorm(k, P(layer, "k_norm.weight"), c.norm_eps).first;
  }
  q = Rope(q).transpose(1, 2);
  k = Rope(k).transpose(1, 2);
  torch::Tensor v = v_lin.view({b, t, kv_local, hd}).transpose(1, 2);
  // Grouped-query attention: query head j reads key/value head j / (heads / kv_heads).
  return {Attention(q, k, v).transpose(1, 2).reshape({b, t, heads_local * hd}), x_res};
}

std::pair<torch::Tensor, torch::Tensor> ModelShard::LlamaGateUp(int layer, const torch::Tensor& m_local) {
  const torch::Tensor &w1 = P(layer, "w1.weight"), &w3 = P(layer, "w3.weight");
  const bool fused_gate = FusedLinearAvailable(m_local, w1) && FusedLinearAvailable(m_local, w3);
  Communicator* const sum_in_product = SumInProducts(spec_.layout, tp_);
  torch::Tensor m = fused_gate && sum_in_product ? m_local : Enter(m_local);
  if (!fused_gate) return {NoBiasLinear(m, w1), NoBiasLinear(m, w3)};
  std::vector<torch::Tensor> gu = FusedProjections(m, {w1, w3}, sum_in_product);
  return {gu[0], gu[1]};
}

torch::Tensor ModelShard::LlamaBlockForward(int layer, const torch::Tensor& x) {
  if (spec_.layout.tp > 1) return TpBlockForward(layer, x);
  const bool sr = spec_.stochastic_residual;
  // The residual sum through the product's epilogue, or stochastically rounded after it.
  auto residual_linear = [&](const torch::Tensor& in, const torch::Tensor& w, const torch::Tensor& residual) {
    return sr ? StochasticRoundedAdd(residual, NoBiasLinear(in, w)) : NoBiasLinear(in, w, residual);
  };
  auto [y, x_res] = LlamaAttention(layer, x);
  torch::Tensor r = residual_linear(y, P(layer, "wo.weight"), x_res);
  auto [m_local, r_res] = RmsNorm(r, P(layer, "ffn_norm.weight"), spec_.config.norm_eps, Selective());
  if (IsMoeLayer(spec_.config, layer)) {
    const torch::Tensor branch = MoeBranch(layer, m_local);
    return sr ? StochasticRoundedAdd(r_res, branch) : r_res + branch;
  }
  auto [g, u] = LlamaGateUp(layer, m_local);
  const torch::Tensor& w2 = P(layer, "w2.weight");
  if (Selective() && FusedLlamaOpsAvailable(g) && FusedLinearAvailable(g, w2)) {
    // The down projection's input is made again in backward (selective recompute).
    if (sr) return StochasticRoundedAdd(r_res, FusedSwiGluLinear(g, u, w2));
    if (FusableResidual(r_res, g, OutputSizes(g, w2))) return FusedSwiGluLinear(g, u, w2, r_res);
  }
  torch::Tensor gate = SwiGlu(g, u);
  return residual_linear(gate, w2, r_res);
}

std::pair<torch::Tensor, torch::Tensor> ModelShard::GptAttention(int layer, const torch::Tensor& x) {
  const int tp = spec_.layout.tp;
  const int64_t c_local = spec_.config.d_model / tp;
  const int64_t heads_local = spec_.config.heads / tp;
  Communicator* const sum_in_product = SumInProducts(spec_.layout, tp_);
  auto [a_local, x_res] = LayerNorm(x, P(layer, "ln1.weight"), P(layer, "ln1.bias"), Selective());
  const torch::Tensor &qkv_w = P(layer, "qkv.weight"), &qkv_b = P(layer, "qkv.bias");
  const bool fused_qkv = FusedLinearAvailable(a_local, qkv_w) && qkv_b.defined();
  torch::Tensor a = fused_qkv && sum_in_product ? a_local : Enter(a_local);
  const int64_t b = a.size(0), t = a.size(1);
  variable_list qkv = fused_qkv ? FusedQkv(a, qkv_w, qkv_b, heads_local, sum_in_product)
                                : SplitHeads(Linear(a, qkv_w, qkv_b), heads_local);
  return {Attention(qkv[0], qkv[1], qkv[2]).transpose(1, 2).reshape({b, t, c_local}), x_res};
}

torch::Tensor ModelShard::GptBlockForward(int layer, const torch::Tensor& x) {
  if (spec_.layout.tp > 1) return TpBlockForward(layer, x);
  const bool sr = spec_.stochastic_residual;  // the residual sums rounded stochastically
  auto [y, x_res] = GptAttention(layer, x);
  const torch::Tensor &proj_w = P(layer, "proj.weight"), &proj_b = P(layer, "proj.bias");
  torch::Tensor h_in = sr ? StochasticRoundedAdd(x_res, Linear(y, proj_w, proj_b)) : Linear(y, proj_w, proj_b, x_res);
  auto [m_local, h] = LayerNorm(h_in, P(layer, "ln2.weight"), P(layer, "ln2.bias"), Selective());
  const torch::Tensor &fc_w = P(layer, "fc.weight"), &fc_b = P(layer, "fc.bias");
  const torch::Tensor &fc2_w = P(layer, "fc2.weight"), &fc2_b = P(layer, "fc2.bias");
  if (sr) return StochasticRoundedAdd(h, Mlp(m_local, fc_w, fc_b, fc2_w, fc2_b, {}, Selective()));
  return Mlp(m_local, fc_w, fc_b, fc2_w, fc2_b, h, Selective());
}

torch::Tensor ModelShard::Embed(const torch::Tensor& ids) {
  const int tp = spec_.layout.tp;
  const torch::Tensor& wte = params_[embed_].value;
  const int64_t t = ids.size(1);
  // The residual stream's dtype: fp32 under spec.fp32_residual, else the parameters'.
  auto widen = [&](const torch::Tensor& e) { return spec_.fp32_residual ? e.to(torch::kFloat) : e; };
  // Learned positions from..from+n (gpt2; a llama has none).
  auto positioned = [&](const torch::Tensor& e, int64_t from, int64_t n) {
    if (wpe_ < 0) return widen(e);
    // Under cp the rank's tokens sit at positions_ of the sequence.
    const torch::Tensor pos = positions_.defined()
                                  ? params_[wpe_].value.index_select(0, positions_.narrow(0, from, n).to(e.device()))
                                  : params_[wpe_].value.narrow(0, from, n);
    return spec_.stochastic_residual ? StochasticRoundedAdd(e, pos) : widen(e) + pos;  // the sum in the stream's dtype
  };
  if (tp == 1) {
    // On a bf16 CUDA table the lookup's backward adds straight into the table's gradient.
    return positioned(FusedLlamaOpsAvailable(wte) ? FusedEmbedding(ids, wte) : F::embedding(ids, wte), 0, t);
  }
  const int64_t rows = wte.size(0), start = rows * spec_.coords.tp;
  torch::Tensor outside = (ids < start).logical_or(ids >= start + rows);
  torch::Tensor local = (ids - start).masked_fill(outside, 0);
  torch::Tensor e = F::embedding(local, wte).masked_fill(outside.unsqueeze(-1), 0.0);
  if (spec_.layout.sequence_parallel) {
    const int64_t t_local = t / tp;
    return positioned(ScatterSeq(e, tp_), t_local * spec_.coords.tp, t_local);
  }
  return positioned(ReduceFromTp(e, tp_), 0, t);
}

torch::Tensor ModelShard::FinalNorm(const torch::Tensor& x) {
  if (LlamaBlock(spec_.config)) return RmsNorm(x, params_[norm_w_].value, spec_.config.norm_eps).first;
  return LayerNorm(x, params_[norm_w_].value, params_[norm_b_].value).first;
}

torch::Tensor ModelShard::HeadLoss(const torch::Tensor& x, const torch::Tensor& targets) {
  const int tp = spec_.layout.tp;
  Communicator* const comm = tp_;
  const torch::Tensor& wte = params_[head_].value;
  torch::Tensor h = FinalNorm(x);
  if (tp > 1) h = spec_.layout.sequence_parallel ? GatherSeq(h, comm) : CopyToTp(h, comm);
  // The head through our product where it takes it: its weight gradient goes straight into the
  // (tied) table's, beside what the embedding's backward adds there. In bf16 under FP8.
  torch::Tensor logits;
  {
    const Bf16ProductsScope head_in_bf16;
    logits = NoBiasLinear(h, wte);
  }
  logits = logits.view({-1, logits.size(-1)});
  torch::Tensor target = targets.reshape({-1});
  // Masked targets (kIgnoredTarget, -100): the mean over the counted ones, 0 where none counts.
  torch::Tensor counted;
  if (masked_targets_) counted = (target != -100).sum().clamp_min(1).to(torch::kFloat);
  if (tp == 1 && masked_targets_) {
    return torch::nll_loss(torch::log_softmax(logits, 1, torch::kFloat), target, {}, at::Reduction::Sum, -100) /
           counted;
  }
  if (tp == 1) {
    // bf16 logits on CUDA: our fused kernel (one read forward, one read and write backward), the
    // gradient written over the logits (nothing else reads them).
    if (FusedCrossEntropyAvailable(logits)) return FusedCrossEntropy(logits, target, /*grad_in_logits=*/true);
    // Otherwise fp32 log-probabilities straight from the logits (no fp32 copy of the logits).
    return torch::nll_loss(torch::log_softmax(logits, 1, torch::kFloat), target);
  }
  logits = logits.to(torch::kFloat);
  // Vocab-parallel cross-entropy (Megatron): every rank holds logits for vocab rows
  // [start, start + rows); the max, the softmax denominator and the target's logit are combined
  // over tp, so the full logits never exist on one rank.
  const int64_t rows = wte.size(0), start = rows * spec_.coords.tp;
  torch::Tensor row_max = std::get<0>(logits.detach().max(-1)).contiguous();
  torch::Tensor maxes = torch::empty({tp, row_max.numel()}, row_max.options());
  Check(tp_->AllGather(row_max, maxes));
  torch::Tensor shifted = logits - std::get<0>(maxes.max(0)).unsqueeze(1);
  torch::Tensor sum_exp = ReduceFromTp(shifted.exp().sum(-1), comm);
  torch::Tensor outside = (target < start).logical_or(target >= start + rows);
  torch::Tensor local = (target - start).masked_fill(outside, 0);
  torch::Tensor picked = shifted.gather(1, local.unsqueeze(1)).squeeze(1).masked_fill(outside, 0.0);
  picked = ReduceFromTp(picked, comm);
  if (masked_targets_) return ((sum_exp.log() - picked) * (target != -100).to(torch::kFloat)).sum() / counted;
  return (sum_exp.log() - picked).mean();
}

torch::Tensor ModelShard::Logits(const torch::Tensor& ids) {
  if (spec_.layout.tp != 1 || spec_.layout.pp != 1) throw std::logic_error("Logits needs tp 1 and pp 1");
  torch::Tensor x = Embed(ids);
  for (int layer = 0; layer < spec_.config.layers; ++layer) x = BlockForward(layer, x);
  // The head in fp32 whatever the blocks ran in (bf16 products under autocast included): bf16 logits
  // would round large logits by up to 1/16.
  torch::Tensor h = FinalNorm(x).to(torch::kFloat);
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::DispatchKey::AutocastCUDA);
  return at::linear(h, params_[head_].value.to(torch::kFloat));
}

torch::Tensor ModelShard::Forward(int chunk, const torch::Tensor& input, const torch::Tensor& targets_given) {
  const int vs = chunk * spec_.layout.pp + spec_.coords.pp;
  const int cp = spec_.layout.cp;
  const int cp_rank = spec_.coords.dp % std::max(1, cp);
  // Under cp the ids and targets come whole: this rank's chunks of them.
  const torch::Tensor targets = cp > 1 && targets_given.defined() ? cp::Take(targets_given, cp, cp_rank) : targets_given;
  torch::Tensor x;
  if (FirstStage(chunk)) {
    Unit(0, true);
    x = Embed(cp > 1 ? cp::Take(input, cp, cp_rank) : input);
    if (hooks_.output) hooks_.output(0, x);
  } else {
    x = input;
  }
  const int first = FirstLayer(vs);
  const int end = first + spec_.layout.stage_layers[vs];
  const bool split = SplitsBatch(x.size(0), torch::GradMode::is_enabled());
  if (split) {
    // Two halves of the micro-batch, interleaved at each row-parallel sum: a half's sum runs on the
    // side stream while the other half's products run, and is waited for where its half goes on.
    std::vector<torch::Tensor> halves = x.chunk(2, 0);
    std::optional<RowSum> pending[2];
    for (int layer = first; layer < end; ++layer) {
      Unit(1 + layer, true);
      for (int branch = 0; branch < 2; ++branch) {
        for (int i = 0; i < 2; ++i) {
          torch::Tensor in = pending[i] ? pending[i]->Finish() : halves[i];
          pending[i].emplace(*this, TpBranch(layer, branch, in), true);
        }
      }
      Unit(1 + layer, false);
    }
    for (int i = 0; i < 2; ++i) {
      if (pending[i]) halves[i] = pending[i]->Finish();
    }
    x = torch::cat(halves, 0);
  }
  for (int layer = split ? end : first; layer < end; ++layer) {
    Unit(1 + layer, true);
    if (spec_.layout.activation_checkpointing == ActivationCheckpointing::kFull && torch::GradMode::is_enabled()) {
      x = CheckpointBlock::apply(x, reinterpret_cast<int64_t>(this), static_cast<int64_t>(layer));
    } else {
      x = BlockForward(layer, x);
    }
    if (hooks_.output) hooks_.output(1 + layer, x);
    Unit(1 + layer, false);
  }
  if (!LastStage(chunk)) return x;
  const int head = spec_.config.layers + 1;
  Unit(head, true);
  return HeadLoss(x, targets);
}

StatusOr<torch::Tensor> ModelShard::GatherFull(const ShardParam& p, const torch::Tensor& value) {
  torch::NoGradGuard no_grad;
  torch::Tensor local = value.detach().contiguous();
  if (p.expert && ep_ != nullptr && ep_->size() > 1) {
    // Every expert rank's experts, in order, first: then the stack is split over tp only.
    torch::Tensor all = torch::empty({ep_->size() * local.numel()}, local.options());
    LTRAIN_RETURN_IF_ERROR(ep_->AllGather(local, all));
    std::vector<int64_t> shape = local.sizes().vec();
    shape[0] *= ep_->size();
    local = all.view(shape);
  }
  if (p.split == TpSplit::kReplicated || spec_.layout.tp == 1) return local.clone();
  const int n = spec_.layout.tp;
  torch::Tensor out = torch::empty({n * local.numel()}, local.options());
  LTRAIN_RETURN_IF_ERROR(tp_->AllGather(local, out));
  std::vector<int64_t> shape = local.sizes().vec();
  std::vector<int64_t> stacked = shape;
  stacked.insert(stacked.begin(), n);
  torch::Tensor g = out.view(stacked);  // [n, local...]
  switch (p.split) {
    case TpSplit::kRows: return g.reshape(p.full_shape);
    case TpSplit::kCols: case TpSplit::kExpertRows: case TpSplit::kExpertCols: {
      // [n, local...]: the slices' dimension next to the one they split.
      const int dim = SplitDim(p.split);
      std::vector<int64_t> perm;
      for (int i = 1; i <= dim; ++i) perm.push_back(i);
      perm.push_back(0);
      for (int64_t i = dim + 1; i < g.dim(); ++i) perm.push_back(i);
      return g.permute(perm).reshape(p.full_shape);
    }
    case TpSplit::kQkvRows: {
      std::vector<int64_t> qkv = {n, 3, shape[0] / 3};
      for (size_t i = 1; i < shape.size(); ++i) qkv.push_back(shape[i]);
      std::vector<int64_t> perm = {1, 0};
      for (size_t i = 2; i < qkv.size(); ++i) perm.push_back(static_cast<int64_t>(i));
      return g.reshape(qkv).permute(perm).reshape(p.full_shape);
    }
    case TpSplit::kReplicated: break;
  }
  return local;
}

}  // namespace ltrain::worker
