#include "worker/fused_kernels.h"

#include <stdexcept>

#include <torch/autograd.h>

#if defined(LTRAIN_WITH_CUDA_KERNELS)
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "worker/cuda/adamw.h"
#include "worker/cuda/cross_entropy.h"
#endif

#include <cmath>

namespace ltrain::worker {

#if defined(LTRAIN_WITH_CUDA_KERNELS)
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct CrossEntropyFunction : public torch::autograd::Function<CrossEntropyFunction> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& logits, const torch::Tensor& targets) {
    c10::cuda::CUDAGuard guard(logits.device());
    torch::Tensor x = logits.contiguous();
    torch::Tensor t = targets.contiguous().to(torch::kLong);
    const int64_t rows = x.size(0), vocab = x.size(1);
    const torch::TensorOptions f32 = x.options().dtype(torch::kFloat);
    torch::Tensor lse = torch::empty({rows}, f32), losses = torch::empty({rows}, f32);
    cuda::CrossEntropyForward(x.data_ptr(), t.data_ptr<int64_t>(), rows, vocab, lse.data_ptr<float>(),
                              losses.data_ptr<float>(), c10::cuda::getCurrentCUDAStream(x.device().index()).stream());
    ctx->save_for_backward({x, t, lse});
    return losses.mean();
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    variable_list saved = ctx->get_saved_variables();
    const torch::Tensor& x = saved[0];
    c10::cuda::CUDAGuard guard(x.device());
    torch::Tensor g = grads[0].to(torch::kFloat).contiguous();
    torch::Tensor out = torch::empty_like(x);
    cuda::CrossEntropyBackward(x.data_ptr(), saved[1].data_ptr<int64_t>(), saved[2].data_ptr<float>(),
                               g.data_ptr<float>(), x.size(0), x.size(1), out.data_ptr(),
                               c10::cuda::getCurrentCUDAStream(x.device().index()).stream());
    return {out, torch::Tensor()};
  }
};

}  // namespace

bool FusedCrossEntropyAvailable(const torch::Tensor& logits) {
  return logits.is_cuda() && logits.scalar_type() == torch::kBFloat16 && logits.dim() == 2;
}

torch::Tensor FusedCrossEntropy(const torch::Tensor& logits, const torch::Tensor& targets) {
  return CrossEntropyFunction::apply(logits, targets);
}

bool FusedAdamWAvailable(const torch::Tensor& param) {
  return param.is_cuda() && param.scalar_type() == torch::kFloat;
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

bool FusedCrossEntropyAvailable(const torch::Tensor& /*logits*/) { return false; }

torch::Tensor FusedCrossEntropy(const torch::Tensor& /*logits*/, const torch::Tensor& /*targets*/) {
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

}  // namespace ltrain::worker
