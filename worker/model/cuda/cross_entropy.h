// Launchers of the fused cross-entropy kernels (worker/model/cuda/cross_entropy.cu). Plain CUDA, no
// LibTorch: the caller passes raw device pointers and its stream.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

namespace ltrain::worker::cuda {

// logits: [rows, vocab] bf16, rows contiguous; targets: [rows] int64. Writes each row's
// log-sum-exp (lse, fp32 [rows]) and its loss lse - logit[target] (losses, fp32 [rows]; NaN for a
// target outside [0, vocab)).
void CrossEntropyForward(const void* logits, const int64_t* targets, int64_t rows, int64_t vocab, float* lse,
                         float* losses, cudaStream_t stream);

// grad[r, j] = (exp(logits[r, j] - lse[r]) - [j == targets[r]]) * grad_loss / rows, in bf16: the
// gradient of the mean loss scaled by the device scalar *grad_loss. `grad` may alias `logits`.
void CrossEntropyBackward(const void* logits, const int64_t* targets, const float* lse, const float* grad_loss,
                          int64_t rows, int64_t vocab, void* grad, cudaStream_t stream);

}  // namespace ltrain::worker::cuda
