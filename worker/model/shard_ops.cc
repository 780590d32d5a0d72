#include "worker/model/shard_ops.h"

#include <stdexcept>

#include <torch/autograd.h>

#include "worker/model/comm_handle.h"
#include "worker/model/parallel_model.h"
#include "worker/torch_compat.h"

namespace ltrain::worker {
namespace {

using torch::autograd::AutogradContext;

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
struct CopyToTpFunction : public torch::autograd::Function<CopyToTpFunction> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, int64_t comm) {
    ctx->saved_data["comm"] = comm;
    return x.view_as(x);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {AllReduced(grads[0], CommOf(ctx)), torch::Tensor()};
  }
};

// Megatron's g: all-reduce forward, identity backward.
struct ReduceFromTpFunction : public torch::autograd::Function<ReduceFromTpFunction> {
  static torch::Tensor forward(AutogradContext* /*ctx*/, const torch::Tensor& x, int64_t comm) {
    return AllReduced(x, reinterpret_cast<Communicator*>(comm));
  }
  static variable_list backward(AutogradContext* /*ctx*/, variable_list grads) { return {grads[0], torch::Tensor()}; }
};

// Megatron's g begun beside the work queued after it: the sum is made on a side stream
// (SideStreamSum), whose handle goes to *`pending` (a std::unique_ptr<SideStreamSum>*); nothing may
// read the output before its Finish(). Identity backward.
struct ReduceFromTpBesideFunction : public torch::autograd::Function<ReduceFromTpBesideFunction> {
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
struct GatherSeqFunction : public torch::autograd::Function<GatherSeqFunction> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, int64_t comm) {
    ctx->saved_data["comm"] = comm;
    return GatherSequence(x, reinterpret_cast<Communicator*>(comm));
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {ReduceScatterSequence(grads[0], CommOf(ctx)), torch::Tensor()};
  }
};

// Sequence parallel: reduce-scatter along the sequence forward, all-gather backward.
struct ScatterSeqFunction : public torch::autograd::Function<ScatterSeqFunction> {
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
struct SplitHeadsFunction : public torch::autograd::Function<SplitHeadsFunction> {
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

// Selective checkpointing on the CPU: attention's internals (scores, softmax) are recomputed, not
// kept. (On GPUs flash attention keeps none: recomputing it would cost a forward and save nothing.)
struct CheckpointAttentionFunction : public torch::autograd::Function<CheckpointAttentionFunction> {
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

}  // namespace

void Check(const Status& s) {
  if (!s.ok()) throw std::runtime_error(s.message());
}

torch::Tensor CopyToTp(const torch::Tensor& x, Communicator* tp) { return CopyToTpFunction::apply(x, Handle(tp)); }

torch::Tensor ReduceFromTp(const torch::Tensor& x, Communicator* tp) { return ReduceFromTpFunction::apply(x, Handle(tp)); }

torch::Tensor ReduceFromTpBeside(const torch::Tensor& x, Communicator* tp, std::unique_ptr<SideStreamSum>* pending) {
  return ReduceFromTpBesideFunction::apply(x, Handle(tp), reinterpret_cast<int64_t>(pending));
}

torch::Tensor GatherSeq(const torch::Tensor& x, Communicator* tp) { return GatherSeqFunction::apply(x, Handle(tp)); }

torch::Tensor ScatterSeq(const torch::Tensor& x, Communicator* tp) { return ScatterSeqFunction::apply(x, Handle(tp)); }

variable_list SplitHeads(const torch::Tensor& qkv, int64_t heads) { return SplitHeadsFunction::apply(qkv, heads); }

torch::Tensor CheckpointedAttention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v) {
  return CheckpointAttentionFunction::apply(q, k, v);
}

torch::Tensor StochasticRoundedAdd(const torch::Tensor& x, const torch::Tensor& branch) {
  return StochasticAddFunction::apply(x, branch);
}

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
                     const torch::Tensor& residual) {
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
                                                  bool rebuild) {
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
                                                bool rebuild) {
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

// residual + x · wᵀ (residual may be undefined): through our cuBLASLt product where it takes them
// (bf16 on CUDA; the residual in its epilogue, the weight gradient added straight into w's), else
// LibTorch's. `w` must be a parameter itself, not a view of one.
torch::Tensor NoBiasLinear(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& residual) {
  if (FusedLinearAvailable(x, w) && (!residual.defined() || FusableResidual(residual, x, OutputSizes(x, w)))) {
    return FusedLinear(x, w, {}, residual);
  }
  torch::Tensor y = at::linear(x, w);
  return residual.defined() ? residual + y : y;
}

}  // namespace ltrain::worker
