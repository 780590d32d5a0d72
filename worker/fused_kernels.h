// Kernels of our own where LibTorch's would take more memory traffic, as autograd functions. They
// exist in CUDA builds (LTRAIN_WITH_CUDA_KERNELS); callers ask Fused*Available() and otherwise use
// the composite LibTorch operations.
#pragma once

#include <torch/types.h>

namespace ltrain::worker {

// Whether FusedCrossEntropy can take these logits: a CUDA build, bf16 CUDA logits.
bool FusedCrossEntropyAvailable(const torch::Tensor& logits);

// Mean cross-entropy of logits [rows, vocab] (bf16, CUDA) against targets [rows] (int64): the
// value of nll_loss(log_softmax(logits.float())), computed without fp32 copies of the logits; the
// gradient flows to the logits in bf16.
torch::Tensor FusedCrossEntropy(const torch::Tensor& logits, const torch::Tensor& targets);

// Whether FusedAdamW can update these fp32 master weights: a CUDA build, fp32 CUDA tensors.
bool FusedAdamWAvailable(const torch::Tensor& param);

// One AdamW step (torch.optim.AdamW's update) over `param` (fp32 master weights, updated in place)
// and its moments, from `grad` (bf16 or fp32, divided by the device scalar `grad_divisor` when that
// is defined), writing the updated weights also into `param_bf16` when it is defined. One kernel,
// one pass over memory. `step` is 1-based.
void FusedAdamW(const torch::Tensor& param, const torch::Tensor& grad, const torch::Tensor& exp_avg,
                const torch::Tensor& exp_avg_sq, const torch::Tensor& param_bf16, double lr, double beta1, double beta2,
                double eps, double weight_decay, int64_t step, const torch::Tensor& grad_divisor);

}  // namespace ltrain::worker
