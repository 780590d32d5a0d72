// The fused kernels besides the linear products and the norms: the cross-entropy, the embedding's
// gradient, rotary embeddings, SwiGLU and AdamW.
#include <cmath>
#include <stdexcept>
#include <tuple>
#include <vector>

#include <torch/autograd.h>

#include "worker/model/fused_kernels.h"

#if defined(LTRAIN_WITH_CUDA_KERNELS)
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "worker/model/cuda/adamw.h"
#include "worker/model/cuda/cross_entropy.h"
#include "worker/model/cuda/embedding.h"
#include "worker/model/cuda/llama_ops.h"
#endif

#include "worker/model/fused_internal.h"

namespace ltrain::worker {

#if defined(LTRAIN_WITH_CUDA_KERNELS)
using fused::AccumulationTarget;
using fused::Aligned16;
using fused::StreamOf;
using fused::TakeStale;

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct CrossEntropyFunction : public torch::autograd::Function<CrossEntropyFunction> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& logits, const torch::Tensor& targets,
                               bool grad_in_logits) {
    c10::cuda::CUDAGuard guard(logits.device());
    torch::Tensor x = logits.contiguous();
    torch::Tensor t = targets.contiguous().to(torch::kLong);
    const int64_t rows = x.size(0), vocab = x.size(1);
    const torch::TensorOptions f32 = x.options().dtype(torch::kFloat);
    torch::Tensor lse = torch::empty({rows}, f32), losses = torch::empty({rows}, f32);
    cuda::CrossEntropyForward(x.data_ptr(), t.data_ptr<int64_t>(), rows, vocab, lse.data_ptr<float>(),
                              losses.data_ptr<float>(), c10::cuda::getCurrentCUDAStream(x.device().index()).stream());
    ctx->save_for_backward({x, t, lse});
    ctx->saved_data["grad_in_logits"] = grad_in_logits;
    return losses.mean();
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    variable_list saved = ctx->get_saved_variables();
    const torch::Tensor& x = saved[0];
    c10::cuda::CUDAGuard guard(x.device());
    torch::Tensor g = grads[0].to(torch::kFloat).contiguous();
    // Each value of the gradient is written where its logit was read, by the thread that read it.
    torch::Tensor out = ctx->saved_data["grad_in_logits"].toBool() ? x : torch::empty_like(x);
    cuda::CrossEntropyBackward(x.data_ptr(), saved[1].data_ptr<int64_t>(), saved[2].data_ptr<float>(),
                               g.data_ptr<float>(), x.size(0), x.size(1), out.data_ptr(),
                               c10::cuda::getCurrentCUDAStream(x.device().index()).stream());
    return {out, torch::Tensor(), torch::Tensor()};
  }
};

// Whether cuda::EmbeddingRowSums takes int64 ids, contiguous gradient rows `g` and the table's
// gradient `into` (AccumulationTarget's: bf16, contiguous): g bf16, rows a multiple of 8 wide, both
// 16-byte aligned.
bool RowSumsTake(const torch::Tensor& ids, const torch::Tensor& g, const torch::Tensor& into) {
  return ids.scalar_type() == torch::kLong && g.scalar_type() == torch::kBFloat16 && g.size(1) % 8 == 0 &&
         Aligned16(g) && Aligned16(into);
}

// The embedding lookup; backward adds the rows' gradients straight into w's .grad where it has one
// (only the rows the batch used are touched), not through a dense [vocab, d] gradient and an add of
// the whole table. Each used row's gradients are summed in fp32 first, then added to the bf16
// gradient once: index_put_ with accumulate adds a row's tokens one by one in bf16 (and serially),
// and a row used thousands of times a step (a byte vocabulary's space) stops growing once its sum is
// a few hundred times one token's gradient.
// Where the table has no more rows than the batch has tokens, the sums are taken over the whole table
// (a buffer no larger than the gradient that arrives). Else the ids are sorted and our kernels sum
// each row's run of tokens and add it to the row (cuda::EmbeddingRowSums). Neither waits for the
// GPU: finding the distinct rows themselves (at::_unique) would, for their count.
struct EmbeddingFunction : public torch::autograd::Function<EmbeddingFunction> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& ids, const torch::Tensor& w) {
    ctx->save_for_backward({ids, w});
    return at::embedding(w, ids);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    variable_list saved = ctx->get_saved_variables();
    const torch::Tensor &ids = saved[0], &w = saved[1];
    c10::cuda::CUDAGuard guard(w.device());
    if (!grads[0].defined()) return {torch::Tensor(), torch::Tensor()};
    torch::Tensor into = AccumulationTarget(w);
    if (!into.defined()) return {torch::Tensor(), at::embedding_backward(grads[0], ids, w.size(0), -1, false, false)};
    torch::Tensor g = grads[0].reshape({-1, w.size(1)}).contiguous();
    if (w.size(0) <= ids.numel() || !RowSumsTake(ids, g, into)) {
      torch::Tensor sums = at::embedding_dense_backward(g, ids.reshape({-1}), w.size(0), /*padding_idx=*/-1,
                                                        /*scale_grad_by_freq=*/false);
      if (TakeStale(into)) {
        into.copy_(sums);
      } else {
        into.add_(sums);
      }
      return {torch::Tensor(), torch::Tensor()};
    }
    // A stable sort: a row's tokens are summed in the batch's order.
    auto [sorted, order] = ids.reshape({-1}).sort(/*stable=*/true, /*dim=*/0, /*descending=*/false);
    if (TakeStale(into)) into.zero_();
    torch::Tensor partial =
        torch::empty({cuda::EmbeddingRowSumsFloats(sorted.numel(), g.size(1))}, g.options().dtype(torch::kFloat));
    cuda::EmbeddingRowSums(sorted.data_ptr<int64_t>(), order.data_ptr<int64_t>(), sorted.numel(), g.data_ptr(),
                           g.size(1), partial.data_ptr<float>(), into.data_ptr(), StreamOf(into));
    return {torch::Tensor(), torch::Tensor()};
  }
};

struct RopeFunction : public torch::autograd::Function<RopeFunction> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, const torch::Tensor& cos,
                               const torch::Tensor& sin) {
    c10::cuda::CUDAGuard guard(x.device());
    torch::Tensor in = x.contiguous();
    torch::Tensor out = torch::empty_like(in);
    cuda::Rope(in.data_ptr(), cos.data_ptr<float>(), sin.data_ptr<float>(), in.size(0), in.size(1), in.size(2),
               in.size(3), /*inverse=*/false, out.data_ptr(), StreamOf(in));
    ctx->save_for_backward({cos, sin});
    return out;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    variable_list saved = ctx->get_saved_variables();
    torch::Tensor g = grads[0].contiguous();
    c10::cuda::CUDAGuard guard(g.device());
    torch::Tensor dx = torch::empty_like(g);
    const torch::Tensor amax = fused::AmaxFor(dx);  // the q or k product's backward quantizes dx
    cuda::Rope(g.data_ptr(), saved[0].data_ptr<float>(), saved[1].data_ptr<float>(), g.size(0), g.size(1), g.size(2),
               g.size(3), /*inverse=*/true, dx.data_ptr(), StreamOf(g), fused::AmaxPointer(amax));
    fused::NoteAmax(dx, amax);
    return {dx, torch::Tensor(), torch::Tensor()};
  }
};

struct SwiGluFunction : public torch::autograd::Function<SwiGluFunction> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& gate, const torch::Tensor& up) {
    c10::cuda::CUDAGuard guard(gate.device());
    torch::Tensor g = gate.contiguous(), u = up.contiguous();
    torch::Tensor out = torch::empty_like(g);
    const torch::Tensor amax = fused::AmaxFor(out);  // the down projection quantizes out
    cuda::SwiGlu(g.data_ptr(), u.data_ptr(), g.numel(), out.data_ptr(), StreamOf(g), fused::AmaxPointer(amax));
    fused::NoteAmax(out, amax);
    ctx->save_for_backward({g, u});
    return out;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    variable_list saved = ctx->get_saved_variables();
    torch::Tensor d = grads[0].contiguous();
    c10::cuda::CUDAGuard guard(d.device());
    torch::Tensor dgate = torch::empty_like(saved[0]), dup = torch::empty_like(saved[1]);
    // The gate and up projections' backward quantize dgate and dup.
    const torch::Tensor dgate_amax = fused::AmaxFor(dgate), dup_amax = fused::AmaxFor(dup);
    cuda::SwiGluBackward(saved[0].data_ptr(), saved[1].data_ptr(), d.data_ptr(), d.numel(), dgate.data_ptr(),
                         dup.data_ptr(), StreamOf(d), fused::AmaxPointer(dgate_amax), fused::AmaxPointer(dup_amax));
    fused::NoteAmax(dgate, dgate_amax);
    fused::NoteAmax(dup, dup_amax);
    return {dgate, dup};
  }
};

}  // namespace

bool FusedLlamaOpsAvailable(const torch::Tensor& x) { return x.defined() && x.is_cuda() && x.scalar_type() == torch::kBFloat16; }

torch::Tensor FusedRope(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  return RopeFunction::apply(x, cos, sin);
}

torch::Tensor FusedSwiGlu(const torch::Tensor& gate, const torch::Tensor& up) { return SwiGluFunction::apply(gate, up); }

torch::Tensor FusedEmbedding(const torch::Tensor& ids, const torch::Tensor& w) { return EmbeddingFunction::apply(ids, w); }

bool FusedCrossEntropyAvailable(const torch::Tensor& logits) {
  return logits.is_cuda() && logits.scalar_type() == torch::kBFloat16 && logits.dim() == 2;
}

torch::Tensor FusedCrossEntropy(const torch::Tensor& logits, const torch::Tensor& targets, bool grad_in_logits) {
  return CrossEntropyFunction::apply(logits, targets, grad_in_logits);
}

bool FusedAdamWAvailable(const torch::Tensor& param) {
  return fused::Options().adamw && param.is_cuda() && param.scalar_type() == torch::kFloat;
}

void FusedAdamW(const torch::Tensor& param, const torch::Tensor& grad, const torch::Tensor& exp_avg,
                const torch::Tensor& exp_avg_sq, const torch::Tensor& param_bf16, double lr, double beta1, double beta2,
                double eps, double weight_decay, int64_t step, const torch::Tensor& grad_divisor) {
  c10::cuda::CUDAGuard guard(param.device());
  cuda::AdamWArgs args;
  args.beta1 = static_cast<float>(beta1);
  args.beta2 = static_cast<float>(beta2);
  args.eps = static_cast<float>(eps);
  args.decay_factor = static_cast<float>(1.0 - lr * weight_decay);
  args.step_size = static_cast<float>(lr / (1.0 - std::pow(beta1, static_cast<double>(step))));
  args.inv_sqrt_bias2 = static_cast<float>(1.0 / std::sqrt(1.0 - std::pow(beta2, static_cast<double>(step))));
  torch::Tensor divisor;
  if (grad_divisor.defined()) {
    divisor = grad_divisor.to(torch::kFloat).contiguous();
    args.grad_divisor = divisor.data_ptr<float>();
  }
  cuda::AdamWStep(param.data_ptr<float>(), grad.data_ptr(), grad.scalar_type() == torch::kBFloat16,
                  exp_avg.data_ptr<float>(), exp_avg_sq.data_ptr<float>(),
                  param_bf16.defined() ? param_bf16.data_ptr() : nullptr, param.numel(), args,
                  c10::cuda::getCurrentCUDAStream(param.device().index()).stream());
}

#else
bool FusedLlamaOpsAvailable(const torch::Tensor& /*x*/) { return false; }

torch::Tensor FusedEmbedding(const torch::Tensor& /*ids*/, const torch::Tensor& /*w*/) {
  throw std::logic_error("FusedEmbedding: this worker was built without CUDA kernels");
}

torch::Tensor FusedRope(const torch::Tensor& /*x*/, const torch::Tensor& /*cos*/, const torch::Tensor& /*sin*/) {
  throw std::logic_error("FusedRope: this worker was built without CUDA kernels");
}

torch::Tensor FusedSwiGlu(const torch::Tensor& /*gate*/, const torch::Tensor& /*up*/) {
  throw std::logic_error("FusedSwiGlu: this worker was built without CUDA kernels");
}

bool FusedCrossEntropyAvailable(const torch::Tensor& /*logits*/) { return false; }

torch::Tensor FusedCrossEntropy(const torch::Tensor& /*logits*/, const torch::Tensor& /*targets*/,
                                bool /*grad_in_logits*/) {
  throw std::logic_error("FusedCrossEntropy: this worker was built without CUDA kernels");
}

bool FusedAdamWAvailable(const torch::Tensor& /*param*/) { return false; }

void FusedAdamW(const torch::Tensor& /*param*/, const torch::Tensor& /*grad*/, const torch::Tensor& /*exp_avg*/,
                const torch::Tensor& /*exp_avg_sq*/, const torch::Tensor& /*param_bf16*/, double /*lr*/,
                double /*beta1*/, double /*beta2*/, double /*eps*/, double /*weight_decay*/, int64_t /*step*/,
                const torch::Tensor& /*grad_divisor*/) {
  throw std::logic_error("FusedAdamW: this worker was built without CUDA kernels");
}

#endif

torch::Tensor SwiGlu(const torch::Tensor& gate, const torch::Tensor& up) {
  return FusedLlamaOpsAvailable(gate) ? FusedSwiGlu(gate, up) : at::silu(gate) * up;
}

}  // namespace ltrain::worker
