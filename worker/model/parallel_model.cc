#include "worker/model/parallel_model.h"

#include <stdexcept>

#include <ATen/Context.h>
#include <torch/autograd.h>
#include <torch/nn/functional.h>

#include "common/token_data.h"
#include "worker/control/progress.h"
#include "worker/model/fused_kernels.h"
#include "worker/torch_compat.h"

namespace ltrain::worker {
namespace {

namespace F = torch::nn::functional;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

constexpr const char* kBlockNames[] = {"ln1.weight", "ln1.bias", "qkv.weight", "qkv.bias", "proj.weight", "proj.bias",
                                       "ln2.weight", "ln2.bias", "fc.weight",  "fc.bias",  "fc2.weight",  "fc2.bias"};
enum BlockParam { kLn1W, kLn1B, kQkvW, kQkvB, kProjW, kProjB, kLn2W, kLn2B, kFcW, kFcB, kFc2W, kFc2B, kBlockParams };

void Check(const Status& s) {
  if (!s.ok()) throw std::runtime_error(s.message());
}

Communicator* CommOf(AutogradContext* ctx) {
  return reinterpret_cast<Communicator*>(ctx->saved_data["comm"].toInt());
}

int64_t Handle(Communicator* comm) { return reinterpret_cast<int64_t>(comm); }

torch::Tensor AllReduced(const torch::Tensor& x, Communicator* comm) {
  torch::Tensor t = x.contiguous().clone();
  Check(comm->AllReduceSum(t));
  return t;
}

// [b, t, ...] sequence slices of every tp rank -> [b, tp*t, ...].
torch::Tensor GatherSequence(const torch::Tensor& x, Communicator* comm) {
  const int n = comm->size();
  torch::Tensor in = x.contiguous();
  std::vector<int64_t> shape = in.sizes().vec();
  std::vector<int64_t> gathered_shape = shape;
  gathered_shape.insert(gathered_shape.begin(), n);
  torch::Tensor out = torch::empty(gathered_shape, in.options());
  Check(comm->AllGather(in, out));
  std::vector<int64_t> perm(gathered_shape.size());
  for (size_t i = 0; i < perm.size(); ++i) perm[i] = static_cast<int64_t>(i);
  std::swap(perm[0], perm[1]);  // [n, b, t, ...] -> [b, n, t, ...]
  std::vector<int64_t> result = shape;
  result[1] *= n;
  return out.permute(perm).reshape(result);
}

// [b, T, ...] partial sums -> this rank's [b, T/tp, ...] slice of their sum.
torch::Tensor ReduceScatterSequence(const torch::Tensor& x, Communicator* comm) {
  const int n = comm->size();
  std::vector<int64_t> shape = x.sizes().vec();
  std::vector<int64_t> split = shape;
  split[1] = shape[1] / n;
  split.insert(split.begin() + 1, n);  // [b, n, t, ...]
  std::vector<int64_t> perm(split.size());
  for (size_t i = 0; i < perm.size(); ++i) perm[i] = static_cast<int64_t>(i);
  std::swap(perm[0], perm[1]);
  torch::Tensor in = x.reshape(split).permute(perm).contiguous();  // [n, b, t, ...]
  std::vector<int64_t> out_shape = shape;
  out_shape[1] = shape[1] / n;
  torch::Tensor out = torch::empty(out_shape, x.options());
  Check(comm->ReduceScatterSum(in, out));
  return out;
}

// Megatron's f: identity forward, all-reduce of the gradient backward.
struct CopyToTp : public torch::autograd::Function<CopyToTp> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, int64_t comm) {
    ctx->saved_data["comm"] = comm;
    return x.view_as(x);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {AllReduced(grads[0], CommOf(ctx)), torch::Tensor()};
  }
};

// Megatron's g: all-reduce forward, identity backward.
struct ReduceFromTp : public torch::autograd::Function<ReduceFromTp> {
  static torch::Tensor forward(AutogradContext* /*ctx*/, const torch::Tensor& x, int64_t comm) {
    return AllReduced(x, reinterpret_cast<Communicator*>(comm));
  }
  static variable_list backward(AutogradContext* /*ctx*/, variable_list grads) { return {grads[0], torch::Tensor()}; }
};

// Sequence parallel: all-gather along the sequence forward, reduce-scatter backward.
struct GatherSeq : public torch::autograd::Function<GatherSeq> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, int64_t comm) {
    ctx->saved_data["comm"] = comm;
    return GatherSequence(x, reinterpret_cast<Communicator*>(comm));
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {ReduceScatterSequence(grads[0], CommOf(ctx)), torch::Tensor()};
  }
};

// Sequence parallel: reduce-scatter along the sequence forward, all-gather backward.
struct ScatterSeq : public torch::autograd::Function<ScatterSeq> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, int64_t comm) {
    ctx->saved_data["comm"] = comm;
    return ReduceScatterSequence(x, reinterpret_cast<Communicator*>(comm));
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {GatherSequence(grads[0], CommOf(ctx)), torch::Tensor()};
  }
};

// The q, k and v heads of the fused projection's output [b, t, 3c] as [b, heads, t, c/heads] views.
// Backward writes the three gradients into one [b, t, 3c] tensor with one strided copy each; the
// composite (split, view, transpose) would copy each into [b, t, c] first and then concatenate.
struct SplitHeads : public torch::autograd::Function<SplitHeads> {
  static variable_list forward(AutogradContext* /*ctx*/, const torch::Tensor& qkv, int64_t heads) {
    const int64_t b = qkv.size(0), t = qkv.size(1), c = qkv.size(2) / 3;
    torch::Tensor parts = qkv.view({b, t, 3, heads, c / heads});
    return {parts.select(2, 0).transpose(1, 2), parts.select(2, 1).transpose(1, 2), parts.select(2, 2).transpose(1, 2)};
  }
  static variable_list backward(AutogradContext* /*ctx*/, variable_list grads) {
    torch::Tensor any;
    for (const auto& g : grads) {
      if (g.defined()) any = g;
    }
    const int64_t b = any.size(0), heads = any.size(1), t = any.size(2), d = any.size(3);
    torch::Tensor out = torch::empty({b, t, 3, heads, d}, any.options());
    for (int i = 0; i < 3; ++i) {
      torch::Tensor slot = out.select(2, i);
      if (grads[i].defined()) {
        slot.copy_(grads[i].transpose(1, 2));
      } else {
        slot.zero_();
      }
    }
    return {out.view({b, t, 3 * heads * d}), torch::Tensor()};
  }
};

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

// Selective checkpointing: attention's internals (scores, softmax) are recomputed, not kept.
struct CheckpointAttention : public torch::autograd::Function<CheckpointAttention> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& q, const torch::Tensor& k,
                               const torch::Tensor& v) {
    ctx->save_for_backward({q, k, v});
    return compat::CausalAttention(q, k, v);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    variable_list saved = ctx->get_saved_variables();
    variable_list inputs;
    for (const auto& t : saved) inputs.push_back(t.detach().requires_grad_(true));
    torch::Tensor out;
    {
      torch::AutoGradMode enable(true);
      out = compat::CausalAttention(inputs[0], inputs[1], inputs[2]);
    }
    return torch::autograd::grad({out}, inputs, {grads[0]});
  }
};

// Whether a fused product can add `residual` to its output of `sizes` in its epilogue.
bool FusableResidual(const torch::Tensor& residual, const torch::Tensor& x, c10::IntArrayRef sizes) {
  return residual.scalar_type() == x.scalar_type() && residual.device() == x.device() && residual.sizes() == sizes;
}

std::vector<int64_t> OutputSizes(const torch::Tensor& x, const torch::Tensor& w) {
  std::vector<int64_t> sizes = x.sizes().vec();
  sizes.back() = w.size(0);
  return sizes;
}

// residual + linear(x, w, b); b and residual may be undefined. at::linear, not the C++ frontend's
// F::linear: on [b, t, in] inputs the latter runs a matmul and then adds the bias in a separate
// broadcast kernel; at::linear folds the bias into the GEMM. On bf16 CUDA tensors our cuBLASLt
// linear also adds the residual in the product's epilogue.
torch::Tensor Linear(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b,
                     const torch::Tensor& residual = {}) {
  // Products without a bias (the head, tensor parallelism's row-parallel layers) stay LibTorch's.
  if (b.defined() && FusedLinearAvailable(x, w) &&
      (!residual.defined() || FusableResidual(residual, x, OutputSizes(x, w)))) {
    return FusedLinear(x, w, b, residual);
  }
  torch::Tensor y = b.defined() ? at::linear(x, w, b) : at::linear(x, w);
  return residual.defined() ? residual + y : y;
}

// {layer_norm(x), x}: the residual branch reads x through the second, so that with our kernel its
// gradient is added inside the layer norm's backward.
std::pair<torch::Tensor, torch::Tensor> LayerNorm(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b) {
  if (FusedLayerNormAvailable(x, w, b)) return FusedLayerNorm(x, w, b);
  return {torch::layer_norm(x, {x.size(-1)}, w, b), x};
}

// residual + linear(gelu_tanh(linear(x, w1, b1)), w2, b2), b2 and residual possibly undefined.
torch::Tensor Mlp(const torch::Tensor& x, const torch::Tensor& w1, const torch::Tensor& b1, const torch::Tensor& w2,
                  const torch::Tensor& b2, const torch::Tensor& residual = {}) {
  if (FusedLinearAvailable(x, w1) && FusedLinearAvailable(x, w2) &&
      (!residual.defined() || FusableResidual(residual, x, OutputSizes(x, w2)))) {
    return FusedMlp(x, w1, b1, w2, b2, residual);
  }
  return Linear(torch::gelu(Linear(x, w1, b1), "tanh"), w2, b2, residual);
}

// The full parameter `index` of the per-parameter initialisation: gpt_model.GPT's distribution
// (GptParamInit), drawn on `device` by a copy of its default generator seeded for this parameter
// (a copy: the global generator's state stays as the trainer seeded it).
torch::Tensor PerParameterInit(const GptConfig& c, const std::string& name, const std::vector<int64_t>& shape,
                               uint64_t seed, size_t index, const torch::Device& device) {
  const torch::TensorOptions options = torch::TensorOptions().dtype(torch::kFloat).device(device);
  const ParamInit init = GptParamInit(name, static_cast<int64_t>(shape.size()), c.layers);
  if (init.kind == ParamInit::kZeros) return torch::zeros(shape, options);
  if (init.kind == ParamInit::kOnes) return torch::ones(shape, options);
  at::Generator generator = at::globalContext().defaultGenerator(device).clone();
  generator.set_current_seed(SplitMix64(seed ^ SplitMix64(static_cast<uint64_t>(index) + 1)));
  return torch::empty(shape, options).normal_(0.0, init.stddev, generator);
}

}  // namespace

torch::Tensor Slice(const torch::Tensor& full, TpSplit split, int tp, int r) {
  switch (split) {
    case TpSplit::kReplicated: return full.detach().clone();
    case TpSplit::kRows: return full.detach().chunk(tp, 0)[r].clone();
    case TpSplit::kCols: return full.detach().chunk(tp, 1)[r].contiguous();
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

TpSplit SplitOf(const std::string& name) {
  auto ends = [&](const std::string& suffix) {
    return name.size() >= suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0;
  };
  if (name == "wte.weight" || ends("fc.weight") || ends("fc.bias")) return TpSplit::kRows;
  if (ends("qkv.weight") || ends("qkv.bias")) return TpSplit::kQkvRows;
  if (ends("proj.weight") || ends("fc2.weight")) return TpSplit::kCols;
  return TpSplit::kReplicated;
}

torch::Tensor Unslice(const std::vector<torch::Tensor>& slices, TpSplit split, const std::vector<int64_t>& full_shape) {
  const int tp = static_cast<int>(slices.size());
  std::vector<int64_t> local = full_shape;
  int dim = 0;
  switch (split) {
    case TpSplit::kReplicated: return slices[0].reshape(full_shape);
    case TpSplit::kRows: local[0] /= tp; break;
    case TpSplit::kCols: local[1] /= tp; dim = 1; break;
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


std::vector<std::pair<std::string, std::vector<int64_t>>> GptParameterShapes(const GptConfig& c) {
  const int64_t d = c.d_model;
  std::vector<std::pair<std::string, std::vector<int64_t>>> out = {{"wte.weight", {c.vocab, d}},
                                                                   {"wpe.weight", {c.seq_len, d}}};
  const std::vector<std::vector<int64_t>> block_shapes = {{d}, {d}, {3 * d, d}, {3 * d}, {d, d}, {d},
                                                          {d}, {d}, {4 * d, d}, {4 * d}, {d, 4 * d}, {d}};
  for (int layer = 0; layer < c.layers; ++layer) {
    for (int k = 0; k < kBlockParams; ++k) {
      out.emplace_back("blocks." + std::to_string(layer) + "." + kBlockNames[k], block_shapes[k]);
    }
  }
  out.emplace_back("lnf.weight", std::vector<int64_t>{d});
  out.emplace_back("lnf.bias", std::vector<int64_t>{d});
  return out;
}

int64_t GptParameterCount(const GptConfig& c) {
  int64_t n = 0;
  for (const auto& [name, shape] : GptParameterShapes(c)) {
    int64_t size = 1;
    for (int64_t s : shape) size *= s;
    n += size;
  }
  return n;
}

StatusOr<std::unique_ptr<ModelShard>> ModelShard::Create(const ModelShardSpec& spec, Communicator* tp) {
  const GptConfig& c = spec.config;
  if (spec.layout.tp != tp->size()) return InvalidArgument("tp group size differs from parallel.tp");
  if (c.heads % spec.layout.tp != 0 || c.vocab % spec.layout.tp != 0) {
    return InvalidArgument("parallel.tp=" + std::to_string(spec.layout.tp) + " must divide model.heads=" +
                           std::to_string(c.heads) + " and model.vocab=" + std::to_string(c.vocab));
  }
  if (spec.layout.sequence_parallel && c.seq_len % spec.layout.tp != 0) {
    return InvalidArgument("sequence_parallel needs parallel.tp=" + std::to_string(spec.layout.tp) +
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
  const bool first = spec.coords.pp == 0, last = spec.coords.pp == spec.layout.pp - 1;

  torch::NoGradGuard no_grad;
  // The full model's parameters in order, each made when a slice of it is wanted.
  std::vector<std::pair<std::string, std::vector<int64_t>>> shapes;
  std::vector<torch::Tensor> built;  // PyTorch's initialisation: the whole model, built at once
  if (spec.per_parameter_init) {
    shapes = GptParameterShapes(c);
  } else {
    Gpt full(c);
    for (const auto& item : full->named_parameters()) {
      shapes.emplace_back(item.key(), item.value().sizes().vec());
      built.push_back(item.value());
    }
  }
  auto full_param = [&](size_t i) {
    if (!spec.per_parameter_init) return built[i];
    return PerParameterInit(c, shapes[i].first, shapes[i].second, spec.seed, i, spec.device);
  };
  shard->block_index_.assign(c.layers, std::vector<int>(kBlockParams, -1));
  auto add = [&](const std::string& name, const torch::Tensor& t, int unit, bool exported) {
    ShardParam p;
    p.name = name;
    p.full_shape = t.sizes().vec();
    p.split = spec.layout.tp > 1 ? SplitOf(name) : TpSplit::kReplicated;
    p.value = Slice(t, p.split, spec.layout.tp, spec.coords.tp).requires_grad_(true);
    p.decay = t.dim() >= 2;
    p.sp_partial = spec.layout.sequence_parallel && p.split == TpSplit::kReplicated;
    p.counts_for_norm = exported && (p.split != TpSplit::kReplicated || spec.coords.tp == 0);
    p.exported = exported;
    p.unit = unit;
    shard->params_.push_back(std::move(p));
    return static_cast<int>(shard->params_.size()) - 1;
  };
  torch::Tensor wte;
  constexpr const char* kBuilding = "building the model";
  for (size_t i = 0; i < shapes.size(); ++i) {
    // A large model takes a while on CPU: the count shows the coordinator that start-up moves.
    Progress::Global().SetWork(kBuilding, static_cast<int64_t>(i), static_cast<int64_t>(shapes.size()),
                               "parameter tensors");
    const std::string& name = shapes[i].first;
    shard->full_params_.emplace_back(name, shapes[i].second);
    if (name == "wte.weight") {
      if (first || last) wte = full_param(i);
      if (first) shard->wte_ = add(name, wte, 0, true);
    } else if (name == "wpe.weight") {
      if (first) shard->wpe_ = add(name, full_param(i), 0, true);
    } else if (name.rfind("blocks.", 0) == 0) {
      const size_t dot = name.find('.', 7);
      const int layer = std::stoi(name.substr(7, dot - 7));
      if (stage_of_layer[layer] % spec.layout.pp != spec.coords.pp) continue;
      const std::string local = name.substr(dot + 1);
      for (int k = 0; k < kBlockParams; ++k) {
        if (local == kBlockNames[k]) shard->block_index_[layer][k] = add(name, full_param(i), 1 + layer, true);
      }
    } else if (name == "lnf.weight") {
      if (last) shard->lnf_w_ = add(name, full_param(i), c.layers + 1, true);
    } else if (name == "lnf.bias") {
      if (last) shard->lnf_b_ = add(name, full_param(i), c.layers + 1, true);
    }
  }
  Progress::Global().EndWork(kBuilding);
  // The head of the last stage is tied to the embedding: on another rank it gets a copy of its own
  // (the two copies' gradients are summed over the embedding group, so they stay equal).
  shard->head_wte_ = shard->wte_;
  if (last && !first) shard->head_wte_ = add("wte.weight", wte, c.layers + 1, false);
  return shard;
}

int ModelShard::TiedEmbeddingParam() const {
  if (spec_.layout.pp == 1) return -1;
  if (spec_.coords.pp == 0) return wte_;
  if (spec_.coords.pp == spec_.layout.pp - 1) return head_wte_;
  return -1;
}

int ModelShard::PipelineRankOf(const std::string& name) const {
  if (name == "wte.weight" || name == "wpe.weight") return 0;
  if (name.rfind("blocks.", 0) == 0) return stage_of_layer_[std::stoi(name.substr(7, name.find('.', 7) - 7))] % spec_.layout.pp;
  return spec_.layout.pp - 1;
}

const torch::Tensor& ModelShard::P(int layer, const char* name) const {
  for (int k = 0; k < kBlockParams; ++k) {
    if (std::string(kBlockNames[k]) == name) return params_[block_index_[layer][k]].value;
  }
  throw std::logic_error(std::string("no block parameter ") + name);
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
  const int64_t t = spec_.layout.sequence_parallel ? spec_.config.seq_len / spec_.layout.tp : spec_.config.seq_len;
  return {micro_batch, t, spec_.config.d_model};
}

void ModelShard::Unit(int unit, bool before) {
  const auto& hook = before ? hooks_.before_forward : hooks_.after_forward;
  if (hook) hook(unit);
}

torch::Tensor ModelShard::Attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v) {
  if (spec_.layout.activation_checkpointing == ActivationCheckpointing::kSelective && torch::GradMode::is_enabled()) {
    return CheckpointAttention::apply(q, k, v);
  }
  return compat::CausalAttention(q, k, v);
}

torch::Tensor ModelShard::BlockForward(int layer, const torch::Tensor& x) {
  const int tp = spec_.layout.tp;
  const int64_t comm = Handle(tp_);
  const bool sp = spec_.layout.sequence_parallel;
  const int64_t c = spec_.config.d_model;
  const int64_t c_local = c / tp;
  const int64_t heads_local = spec_.config.heads / tp;
  auto enter = [&](const torch::Tensor& t) {
    if (tp == 1) return t;
    return sp ? GatherSeq::apply(t, comm) : CopyToTp::apply(t, comm);
  };
  // Row-parallel output: partial sums combined over tp, then the (replicated) bias.
  auto row_reduce = [&](const torch::Tensor& partial, const torch::Tensor& b) {
    return (sp ? ScatterSeq::apply(partial, comm) : ReduceFromTp::apply(partial, comm)) + b;
  };
  // x + the row-parallel output of in · wᵀ + b.
  auto row_out = [&](const torch::Tensor& x, const torch::Tensor& in, const torch::Tensor& w, const torch::Tensor& b) {
    if (tp == 1) return Linear(in, w, b, x);
    return x + row_reduce(Linear(in, w, {}), b);
  };
  auto [a_local, x_res] = LayerNorm(x, P(layer, "ln1.weight"), P(layer, "ln1.bias"));
  torch::Tensor a = enter(a_local);
  const int64_t b = a.size(0), t = a.size(1);
  const torch::Tensor &qkv_w = P(layer, "qkv.weight"), &qkv_b = P(layer, "qkv.bias");
  variable_list qkv = FusedLinearAvailable(a, qkv_w) && qkv_b.defined() ? FusedQkv(a, qkv_w, qkv_b, heads_local)
                                                                        : SplitHeads::apply(Linear(a, qkv_w, qkv_b), heads_local);
  torch::Tensor y = Attention(qkv[0], qkv[1], qkv[2]).transpose(1, 2).reshape({b, t, c_local});
  torch::Tensor h_in = row_out(x_res, y, P(layer, "proj.weight"), P(layer, "proj.bias"));
  auto [m_local, h] = LayerNorm(h_in, P(layer, "ln2.weight"), P(layer, "ln2.bias"));
  torch::Tensor m = enter(m_local);
  const torch::Tensor &fc_w = P(layer, "fc.weight"), &fc_b = P(layer, "fc.bias");
  const torch::Tensor &fc2_w = P(layer, "fc2.weight"), &fc2_b = P(layer, "fc2.bias");
  if (tp == 1) return Mlp(m, fc_w, fc_b, fc2_w, fc2_b, h);
  return h + row_reduce(Mlp(m, fc_w, fc_b, fc2_w, {}), fc2_b);
}

torch::Tensor ModelShard::Embed(const torch::Tensor& ids) {
  const int tp = spec_.layout.tp;
  const torch::Tensor& wte = params_[wte_].value;
  const torch::Tensor& wpe = params_[wpe_].value;
  const int64_t t = ids.size(1);
  if (tp == 1) return F::embedding(ids, wte) + wpe.narrow(0, 0, t);
  const int64_t rows = wte.size(0), start = rows * spec_.coords.tp;
  torch::Tensor outside = (ids < start).logical_or(ids >= start + rows);
  torch::Tensor local = (ids - start).masked_fill(outside, 0);
  torch::Tensor e = F::embedding(local, wte).masked_fill(outside.unsqueeze(-1), 0.0);
  if (spec_.layout.sequence_parallel) {
    const int64_t t_local = t / tp;
    return ScatterSeq::apply(e, Handle(tp_)) + wpe.narrow(0, t_local * spec_.coords.tp, t_local);
  }
  return ReduceFromTp::apply(e, Handle(tp_)) + wpe.narrow(0, 0, t);
}

torch::Tensor ModelShard::HeadLoss(const torch::Tensor& x, const torch::Tensor& targets) {
  const int tp = spec_.layout.tp;
  const int64_t comm = Handle(tp_);
  const torch::Tensor& wte = params_[head_wte_].value;
  torch::Tensor h = LayerNorm(x, params_[lnf_w_].value, params_[lnf_b_].value).first;
  if (tp > 1) h = spec_.layout.sequence_parallel ? GatherSeq::apply(h, comm) : CopyToTp::apply(h, comm);
  torch::Tensor logits = Linear(h, wte, {});
  logits = logits.view({-1, logits.size(-1)});
  torch::Tensor target = targets.reshape({-1});
  if (tp == 1) {
    // bf16 logits on CUDA: our fused kernel (one read forward, one read and write backward).
    if (FusedCrossEntropyAvailable(logits)) return FusedCrossEntropy(logits, target);
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
  torch::Tensor sum_exp = ReduceFromTp::apply(shifted.exp().sum(-1), comm);
  torch::Tensor outside = (target < start).logical_or(target >= start + rows);
  torch::Tensor local = (target - start).masked_fill(outside, 0);
  torch::Tensor picked = shifted.gather(1, local.unsqueeze(1)).squeeze(1).masked_fill(outside, 0.0);
  picked = ReduceFromTp::apply(picked, comm);
  return (sum_exp.log() - picked).mean();
}

torch::Tensor ModelShard::Forward(int chunk, const torch::Tensor& input, const torch::Tensor& targets) {
  const int vs = chunk * spec_.layout.pp + spec_.coords.pp;
  torch::Tensor x;
  if (FirstStage(chunk)) {
    Unit(0, true);
    x = Embed(input);
    if (hooks_.output) hooks_.output(0, x);
  } else {
    x = input;
  }
  const int first = FirstLayer(vs);
  for (int layer = first; layer < first + spec_.layout.stage_layers[vs]; ++layer) {
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
    case TpSplit::kCols: return g.permute({1, 0, 2}).reshape(p.full_shape);
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
