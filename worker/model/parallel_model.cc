#include "worker/model/parallel_model.h"

#include <cmath>
#include <cstring>
#include <optional>
#include <stdexcept>

#include <ATen/Context.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/autograd.h>
#include <torch/nn/functional.h>

#include "common/data/token_data.h"
#include "worker/control/progress.h"
#include "worker/model/comm_handle.h"
#include "worker/model/fused_kernels.h"
#include "worker/torch_compat.h"

namespace ltrain::worker {
namespace {

namespace F = torch::nn::functional;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

constexpr const char* kGptBlockNames[] = {"ln1.weight", "ln1.bias", "qkv.weight", "qkv.bias", "proj.weight", "proj.bias",
                                          "ln2.weight", "ln2.bias", "fc.weight",  "fc.bias",  "fc2.weight",  "fc2.bias"};
constexpr const char* kLlamaBlockNames[] = {"attn_norm.weight", "wq.weight", "wk.weight", "wv.weight", "wo.weight",
                                            "ffn_norm.weight",  "w1.weight", "w3.weight", "w2.weight"};

// The names of a block's parameters, in the Python block's registration order.
const std::vector<std::string>& BlockNames(Arch arch) {
  static const std::vector<std::string> gpt(std::begin(kGptBlockNames), std::end(kGptBlockNames));
  static const std::vector<std::string> llama(std::begin(kLlamaBlockNames), std::end(kLlamaBlockNames));
  return arch == Arch::kLlama ? llama : gpt;
}

bool EndsWith(const std::string& name, const std::string& suffix) {
  return name.size() >= suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// The token embedding's name, and the final norm's (weight and bias; llama's has no bias).
const char* EmbeddingName(Arch arch) { return arch == Arch::kLlama ? "tok_embeddings.weight" : "wte.weight"; }

void Check(const Status& s) {
  if (!s.ok()) throw std::runtime_error(s.message());
}

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

// Megatron's g begun beside the work queued after it: the sum is made on a side stream
// (SideStreamSum), whose handle goes to *`pending` (a std::unique_ptr<SideStreamSum>*); nothing may
// read the output before its Finish(). Identity backward.
struct ReduceFromTpBeside : public torch::autograd::Function<ReduceFromTpBeside> {
  static torch::Tensor forward(AutogradContext* /*ctx*/, const torch::Tensor& x, int64_t comm, int64_t pending) {
    torch::Tensor t = x.contiguous().clone();
    *reinterpret_cast<std::unique_ptr<SideStreamSum>*>(pending) =
        std::make_unique<SideStreamSum>(t, reinterpret_cast<Communicator*>(comm));
    return t;
  }
  static variable_list backward(AutogradContext* /*ctx*/, variable_list grads) {
    return {grads[0], torch::Tensor(), torch::Tensor()};
  }
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

// Selective checkpointing on the CPU: attention's internals (scores, softmax) are recomputed, not
// kept. (On GPUs flash attention keeps none: recomputing it would cost a forward and save nothing.)
struct CheckpointAttention : public torch::autograd::Function<CheckpointAttention> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& q, const torch::Tensor& k,
                               const torch::Tensor& v) {
    ctx->save_for_backward({q, k, v});
    return compat::CausalAttentionGqa(q, k, v);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    variable_list saved = ctx->get_saved_variables();
    variable_list inputs;
    for (const auto& t : saved) inputs.push_back(t.detach().requires_grad_(true));
    torch::Tensor out;
    {
      torch::AutoGradMode enable(true);
      out = compat::CausalAttentionGqa(inputs[0], inputs[1], inputs[2]);
    }
    return torch::autograd::grad({out}, inputs, {grads[0]});
  }
};

struct StochasticAddFunction : public torch::autograd::Function<StochasticAddFunction> {
  static torch::Tensor forward(AutogradContext* /*ctx*/, const torch::Tensor& x, const torch::Tensor& branch) {
    torch::Tensor sum = x.to(torch::kFloat) + branch.to(torch::kFloat);
    if (x.scalar_type() != torch::kBFloat16) return sum.to(x.scalar_type());
    // bf16 keeps an fp32's upper 16 bits: a uniform 16-bit integer added to the bits carries into
    // them with the probability of the lower part (an infinity stays one; the sign bit is untouched).
    torch::Tensor bits = sum.view(torch::kInt);
    torch::Tensor noise = torch::randint(0, 1 << 16, sum.sizes(), sum.options().dtype(torch::kInt));
    return bits.add_(noise).bitwise_and_(-65536).view(torch::kFloat).to(torch::kBFloat16);
  }
  static variable_list backward(AutogradContext* /*ctx*/, variable_list grads) { return {grads[0], grads[0]}; }
};

// Whether a fused product can add `residual` to its output of `sizes` in its epilogue: one of x's
// dtype, or an fp32 one (an fp32 residual stream, the output then fp32) to a bf16 product.
bool FusableResidual(const torch::Tensor& residual, const torch::Tensor& x, c10::IntArrayRef sizes) {
  const bool dtype = residual.scalar_type() == x.scalar_type() ||
                     (residual.scalar_type() == torch::kFloat && x.scalar_type() == torch::kBFloat16);
  return dtype && residual.device() == x.device() && residual.sizes() == sizes;
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
// gradient is added inside the layer norm's backward. `rebuild`: FusedLayerNorm's rebuild_output
// (selective recompute: our products make the output again in backward instead of keeping it).
std::pair<torch::Tensor, torch::Tensor> LayerNorm(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b,
                                                  bool rebuild = false) {
  if (FusedLayerNormAvailable(x, w, b)) return FusedLayerNorm(x, w, b, rebuild);
  if (x.scalar_type() != w.scalar_type()) {
    // An fp32 residual stream with bf16 parameters: normalised in fp32, handed on in the weights' dtype.
    const auto f = x.scalar_type();
    return {torch::layer_norm(x, {x.size(-1)}, w.to(f), b.to(f)).to(w.scalar_type()), x};
  }
  return {torch::layer_norm(x, {x.size(-1)}, w, b), x};
}

// {rms_norm(x), x}: the residual branch reads x through the second, so that with our kernel its
// gradient is added inside the norm's backward. `rebuild`: LayerNorm's.
std::pair<torch::Tensor, torch::Tensor> RmsNorm(const torch::Tensor& x, const torch::Tensor& w, double eps,
                                                bool rebuild = false) {
  if (FusedRmsNormAvailable(x, w)) return FusedRmsNorm(x, w, eps, rebuild);
  if (x.scalar_type() != w.scalar_type()) {
    // An fp32 residual stream with bf16 parameters: normalised in fp32, handed on in the weights' dtype.
    return {compat::RmsNorm(x, w.to(x.scalar_type()), eps).to(w.scalar_type()), x};
  }
  return {compat::RmsNorm(x, w, eps), x};
}

// residual + linear(gelu_tanh(linear(x, w1, b1)), w2, b2), b2 and residual possibly undefined.
// `recompute_gelu`: FusedMlp's (selective recompute).
torch::Tensor Mlp(const torch::Tensor& x, const torch::Tensor& w1, const torch::Tensor& b1, const torch::Tensor& w2,
                  const torch::Tensor& b2, const torch::Tensor& residual, bool recompute_gelu) {
  if (FusedLinearAvailable(x, w1) && FusedLinearAvailable(x, w2) &&
      (!residual.defined() || FusableResidual(residual, x, OutputSizes(x, w2)))) {
    return FusedMlp(x, w1, b1, w2, b2, residual, nullptr, recompute_gelu);
  }
  return Linear(torch::gelu(Linear(x, w1, b1), "tanh"), w2, b2, residual);
}

// Where our products sum their input's gradient over tp themselves, beside their weight gradients
// (Megatron's f folded in): tensor parallelism without sequence parallelism. Else null.
Communicator* SumInProducts(const Layout& layout, Communicator* tp) {
  return layout.tp > 1 && !layout.sequence_parallel && FusedTpOverlap() ? tp : nullptr;
}

// llama_model.Llama's initialisation: every matrix N(0, 0.02), the residual output projections (wo,
// w2) N(0, 0.02/sqrt(2 layers)), the norms 1.
ParamInit LlamaParamInit(const std::string& name, int64_t dims, int layers) {
  if (EndsWith(name, "wo.weight") || EndsWith(name, "w2.weight")) return {ParamInit::kNormal, 0.02 / std::sqrt(2.0 * layers)};
  if (dims >= 2) return {ParamInit::kNormal, 0.02};
  return {ParamInit::kOnes, 0};
}

// The full parameter `index` of the per-parameter initialisation: the Python model's distribution
// (GptParamInit, LlamaParamInit), drawn on `device` by a copy of its default generator seeded for
// this parameter (a copy: the global generator's state stays as the trainer seeded it).
torch::Tensor PerParameterInit(const ModelSpec& c, const std::string& name, const std::vector<int64_t>& shape,
                               uint64_t seed, size_t index, const torch::Device& device) {
  const torch::TensorOptions options = torch::TensorOptions().dtype(torch::kFloat).device(device);
  const int64_t dims = static_cast<int64_t>(shape.size());
  const ParamInit init = c.arch == Arch::kLlama ? LlamaParamInit(name, dims, c.layers) : GptParamInit(name, dims, c.layers);
  if (init.kind == ParamInit::kZeros) return torch::zeros(shape, options);
  if (init.kind == ParamInit::kOnes) return torch::ones(shape, options);
  at::Generator generator = at::globalContext().defaultGenerator(device).clone();
  generator.set_current_seed(SplitMix64(seed ^ SplitMix64(static_cast<uint64_t>(index) + 1)));
  return torch::empty(shape, options).normal_(0.0, init.stddev, generator);
}

// residual + x · wᵀ (residual may be undefined): through our cuBLASLt product where it takes them
// (bf16 on CUDA; the residual in its epilogue, the weight gradient added straight into w's), else
// LibTorch's. `w` must be a parameter itself, not a view of one.
torch::Tensor NoBiasLinear(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& residual = {}) {
  if (FusedLinearAvailable(x, w) && (!residual.defined() || FusableResidual(residual, x, OutputSizes(x, w)))) {
    return FusedLinear(x, w, {}, residual);
  }
  torch::Tensor y = at::linear(x, w);
  return residual.defined() ? residual + y : y;
}

}  // namespace

torch::Tensor StochasticRoundedAdd(const torch::Tensor& x, const torch::Tensor& branch) {
  return StochasticAddFunction::apply(x, branch);
}

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

TpSplit SplitOf(const ModelSpec& c, const std::string& name, int tp) {
  if (tp <= 1) return TpSplit::kReplicated;
  auto ends = [&](const std::string& suffix) { return EndsWith(name, suffix); };
  if (c.arch == Arch::kLlama) {
    if (name == "tok_embeddings.weight" || name == "output.weight" || ends(".wq.weight") || ends(".w1.weight") ||
        ends(".w3.weight")) {
      return TpSplit::kRows;
    }
    if (ends(".wk.weight") || ends(".wv.weight")) return KvHeads(c) % tp == 0 ? TpSplit::kRows : TpSplit::kReplicated;
    if (ends(".wo.weight") || ends(".w2.weight")) return TpSplit::kCols;
    return TpSplit::kReplicated;
  }
  if (name == "wte.weight" || ends("fc.weight") || ends("fc.bias")) return TpSplit::kRows;
  if (ends("qkv.weight") || ends("qkv.bias")) return TpSplit::kQkvRows;
  if (ends("proj.weight") || ends("fc2.weight")) return TpSplit::kCols;
  return TpSplit::kReplicated;
}

int LayerOf(const std::string& name) {
  for (const char* prefix : {"blocks.", "layers."}) {
    if (name.rfind(prefix, 0) != 0) continue;
    const size_t start = std::strlen(prefix), dot = name.find('.', start);
    if (dot == std::string::npos || dot == start) return -1;
    int layer = 0;
    for (size_t k = start; k < dot; ++k) {
      if (name[k] < '0' || name[k] > '9') return -1;
      layer = layer * 10 + (name[k] - '0');
    }
    return layer;
  }
  return -1;
}

GptConfig GptConfigOf(const ModelSpec& c) { return GptConfig{c.layers, c.d_model, c.heads, c.seq_len, c.vocab}; }

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


std::vector<std::pair<std::string, std::vector<int64_t>>> ModelParameterShapes(const ModelSpec& c) {
  const int64_t d = c.d_model, f = FfnWidth(c);
  std::vector<std::pair<std::string, std::vector<int64_t>>> out = {{EmbeddingName(c.arch), {c.vocab, d}}};
  std::vector<std::vector<int64_t>> block_shapes;
  const char* prefix = "blocks.";
  if (c.arch == Arch::kLlama) {
    prefix = "layers.";
    const int64_t kv = d / c.heads * KvHeads(c);
    block_shapes = {{d}, {d, d}, {kv, d}, {kv, d}, {d, d}, {d}, {f, d}, {f, d}, {d, f}};
  } else {
    out.emplace_back("wpe.weight", std::vector<int64_t>{c.seq_len, d});
    block_shapes = {{d}, {d}, {3 * d, d}, {3 * d}, {d, d}, {d}, {d}, {d}, {f, d}, {f}, {d, f}, {d}};
  }
  const std::vector<std::string>& names = BlockNames(c.arch);
  for (int layer = 0; layer < c.layers; ++layer) {
    for (size_t k = 0; k < names.size(); ++k) {
      out.emplace_back(prefix + std::to_string(layer) + "." + names[k], block_shapes[k]);
    }
  }
  if (c.arch == Arch::kLlama) {
    out.emplace_back("norm.weight", std::vector<int64_t>{d});
    if (!c.tie_embeddings) out.emplace_back("output.weight", std::vector<int64_t>{c.vocab, d});
  } else {
    out.emplace_back("lnf.weight", std::vector<int64_t>{d});
    out.emplace_back("lnf.bias", std::vector<int64_t>{d});
  }
  return out;
}

int64_t ModelParameterCount(const ModelSpec& c) {
  int64_t n = 0;
  for (const auto& [name, shape] : ModelParameterShapes(c)) {
    int64_t size = 1;
    for (int64_t s : shape) size *= s;
    n += size;
  }
  return n;
}

StatusOr<std::unique_ptr<ModelShard>> ModelShard::Create(const ModelShardSpec& spec, Communicator* tp) {
  const ModelSpec& c = spec.config;
  const int tp_size = spec.layout.tp;
  const bool llama = c.arch == Arch::kLlama;
  if (tp_size != tp->size()) return InvalidArgument("tp group size differs from parallel.tp");
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
  if (llama) {
    // llama_model.rope_tables: pair i of a head turns by position * theta^(-2i/head_dim).
    const int64_t hd = c.d_model / c.heads;
    const torch::TensorOptions f32 = torch::TensorOptions().dtype(torch::kFloat).device(spec.device);
    torch::Tensor inv = 1.0 / torch::pow(c.rope_theta, torch::arange(0, hd, 2, f32) / static_cast<double>(hd));
    if (c.rope_scaling != RopeScaling::kNone) {
      // transformers' rope_scaling (linear, llama3): the frequencies rescaled.
      const std::vector<float> scaled = RopeInverseFrequencies(c);
      inv = torch::tensor(scaled, torch::TensorOptions().dtype(torch::kFloat)).to(spec.device);
    }
    torch::Tensor angles = torch::outer(torch::arange(c.seq_len, f32), inv);
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
  auto full_param = [&](size_t i) {
    if (!per_parameter) return built[i];
    return PerParameterInit(c, shapes[i].first, shapes[i].second, spec.seed, i, spec.device);
  };
  const std::vector<std::string>& block_names = BlockNames(c.arch);
  shard->block_index_.assign(c.layers, std::vector<int>(block_names.size(), -1));
  auto add = [&](const std::string& name, const torch::Tensor& t, int unit, bool exported) {
    ShardParam p;
    p.name = name;
    p.full_shape = t.sizes().vec();
    p.split = SplitOf(c, name, tp_size);
    p.value = Slice(t, p.split, tp_size, spec.coords.tp).requires_grad_(true);
    p.decay = t.dim() >= 2;
    const bool kv_weight = shard->kv_replicated_ && (EndsWith(name, ".wk.weight") || EndsWith(name, ".wv.weight"));
    p.tp_partial = kv_weight || (spec.layout.sequence_parallel && p.split == TpSplit::kReplicated);
    p.counts_for_norm = exported && (p.split != TpSplit::kReplicated || spec.coords.tp == 0);
    p.exported = exported;
    p.unit = unit;
    shard->params_.push_back(std::move(p));
    return static_cast<int>(shard->params_.size()) - 1;
  };
  const std::string embedding = EmbeddingName(c.arch);
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
      for (size_t k = 0; k < block_names.size(); ++k) {
        if (local == block_names[k]) shard->block_index_[layer][k] = add(name, full_param(i), 1 + layer, true);
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
  if (name == EmbeddingName(spec_.config.arch) || name == "wpe.weight") return 0;
  if (const int layer = LayerOf(name); layer >= 0) return stage_of_layer_[layer] % spec_.layout.pp;
  return spec_.layout.pp - 1;
}

const torch::Tensor& ModelShard::P(int layer, const char* name) const {
  const std::vector<std::string>& names = BlockNames(spec_.config.arch);
  for (size_t k = 0; k < names.size(); ++k) {
    if (names[k] == name) return params_[block_index_[layer][k]].value;
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

bool ModelShard::SplitsBatch(int64_t batch, bool recording) const {
  const Layout& l = spec_.layout;
  const bool full_recompute = l.activation_checkpointing == ActivationCheckpointing::kFull && recording;
  return spec_.tp_split_batch && l.tp > 1 && !l.sequence_parallel && batch >= 2 && !full_recompute && !hooks_.output;
}

bool ModelShard::Selective() const {
  return spec_.layout.activation_checkpointing == ActivationCheckpointing::kSelective && torch::GradMode::is_enabled();
}

torch::Tensor ModelShard::Attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v) {
  // On GPUs flash attention keeps only q, k, v, its output (which the next product keeps anyway) and
  // a row statistic: nothing for selective recompute to drop.
  if (Selective() && !q.is_cuda()) {
    return CheckpointAttention::apply(q, k, v);
  }
  return compat::CausalAttentionGqa(q, k, v);
}

bool ModelShard::GradientFromProductsOnly(size_t i) const {
  if (i >= params_.size()) return false;
  const ShardParam& p = params_[i];
  if (p.value.dim() != 2 || !FusedLinearTakes(p.value.size(0), p.value.size(1))) return false;
  const std::string& name = p.name;
  auto ends = [&](const char* suffix) { return EndsWith(name, suffix); };
  if (spec_.config.arch == Arch::kLlama) {
    // Key and value matrices kept whole on every tp rank are read through views, by LibTorch's product
    // (LlamaBlockForward), which adds to the gradient.
    if (ends(".wk.weight") || ends(".wv.weight")) return !kv_replicated_;
    return ends(".wq.weight") || ends(".wo.weight") || ends(".w1.weight") || ends(".w3.weight") || ends(".w2.weight");
  }
  // A GPT's block matrices: every path through GptBlockForward, under tp too, takes them to a fused
  // product when FusedLinearTakes holds (the tied table is not one of them: the embedding adds to it).
  return ends(".qkv.weight") || ends(".proj.weight") || ends(".fc.weight") || ends(".fc2.weight");
}

torch::Tensor ModelShard::BlockForward(int layer, const torch::Tensor& x) {
  return spec_.config.arch == Arch::kLlama ? LlamaBlockForward(layer, x) : GptBlockForward(layer, x);
}

torch::Tensor ModelShard::KvWeight(int layer, const char* name) const {
  const torch::Tensor& w = P(layer, name);
  if (!kv_replicated_) return w;
  // Whole on every rank: this rank's query heads all read key/value head tp_rank*kv/tp.
  const int64_t hd = spec_.config.d_model / spec_.config.heads;
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
  return spec_.layout.sequence_parallel ? GatherSeq::apply(x, Handle(tp_)) : CopyToTp::apply(x, Handle(tp_));
}

// A tp branch's output: residual + (the sum over tp of its partial sums + bias), the sum made inline
// (sequence parallel: this rank's slice of it) or, `beside`, begun on the side stream and waited for
// by Finish().
class ModelShard::RowSum {
 public:
  RowSum(const ModelShard& shard, BranchPartial branch, bool beside) : branch_(std::move(branch)) {
    const int64_t comm = Handle(shard.tp_);
    if (beside) {
      sum_ = ReduceFromTpBeside::apply(branch_.partial, comm, reinterpret_cast<int64_t>(&pending_));
    } else {
      sum_ = shard.spec_.layout.sequence_parallel ? ScatterSeq::apply(branch_.partial, comm)
                                                  : ReduceFromTp::apply(branch_.partial, comm);
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
  if (spec_.config.arch == Arch::kLlama) {
    if (branch == 0) {
      auto [y, x_res] = LlamaAttention(layer, x);
      return {x_res, NoBiasLinear(y, P(layer, "wo.weight")), {}};
    }
    auto [m_local, r_res] = RmsNorm(x, P(layer, "ffn_norm.weight"), spec_.config.norm_eps, Selective());
    auto [g, u] = LlamaGateUp(layer, m_local);
    const torch::Tensor& w2 = P(layer, "w2.weight");
    if (Selective() && FusedLlamaOpsAvailable(g) && FusedLinearAvailable(g, w2)) {
      return {r_res, FusedSwiGluLinear(g, u, w2), {}};  // the product's input made again in backward
    }
    torch::Tensor gate = FusedLlamaOpsAvailable(g) ? FusedSwiGlu(g, u) : torch::silu(g) * u;
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
  const int64_t hd = c.d_model / c.heads;
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
  torch::Tensor q = Rope(q_lin.view({b, t, heads_local, hd})).transpose(1, 2);
  torch::Tensor k = Rope(k_lin.view({b, t, kv_local, hd})).transpose(1, 2);
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
  auto [g, u] = LlamaGateUp(layer, m_local);
  const torch::Tensor& w2 = P(layer, "w2.weight");
  if (Selective() && FusedLlamaOpsAvailable(g) && FusedLinearAvailable(g, w2)) {
    // The down projection's input is made again in backward (selective recompute).
    if (sr) return StochasticRoundedAdd(r_res, FusedSwiGluLinear(g, u, w2));
    if (FusableResidual(r_res, g, OutputSizes(g, w2))) return FusedSwiGluLinear(g, u, w2, r_res);
  }
  torch::Tensor gate = FusedLlamaOpsAvailable(g) ? FusedSwiGlu(g, u) : torch::silu(g) * u;
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
                                : SplitHeads::apply(Linear(a, qkv_w, qkv_b), heads_local);
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
    const torch::Tensor pos = params_[wpe_].value.narrow(0, from, n);
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
    return positioned(ScatterSeq::apply(e, Handle(tp_)), t_local * spec_.coords.tp, t_local);
  }
  return positioned(ReduceFromTp::apply(e, Handle(tp_)), 0, t);
}

torch::Tensor ModelShard::FinalNorm(const torch::Tensor& x) {
  if (spec_.config.arch == Arch::kLlama) return RmsNorm(x, params_[norm_w_].value, spec_.config.norm_eps).first;
  return LayerNorm(x, params_[norm_w_].value, params_[norm_b_].value).first;
}

torch::Tensor ModelShard::HeadLoss(const torch::Tensor& x, const torch::Tensor& targets) {
  const int tp = spec_.layout.tp;
  const int64_t comm = Handle(tp_);
  const torch::Tensor& wte = params_[head_].value;
  torch::Tensor h = FinalNorm(x);
  if (tp > 1) h = spec_.layout.sequence_parallel ? GatherSeq::apply(h, comm) : CopyToTp::apply(h, comm);
  // The head through our product where it takes it: its weight gradient goes straight into the
  // (tied) table's, beside what the embedding's backward adds there.
  torch::Tensor logits = NoBiasLinear(h, wte);
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
  torch::Tensor sum_exp = ReduceFromTp::apply(shifted.exp().sum(-1), comm);
  torch::Tensor outside = (target < start).logical_or(target >= start + rows);
  torch::Tensor local = (target - start).masked_fill(outside, 0);
  torch::Tensor picked = shifted.gather(1, local.unsqueeze(1)).squeeze(1).masked_fill(outside, 0.0);
  picked = ReduceFromTp::apply(picked, comm);
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
