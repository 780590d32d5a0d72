// Launcher of the worker's AdamW kernel (worker/model/cuda/adamw.cu): one pass over a segment of fp32
// master weights and moments, reading bf16 or fp32 gradients and writing the bf16 copy the model
// computes with. Plain CUDA, no LibTorch.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

namespace ltrain::worker::cuda {

struct AdamWArgs {
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float decay_factor = 1.0f;    // 1 - lr * weight_decay (1 where the parameter does not decay)
  float step_size = 0.0f;       // lr / (1 - beta1^step)
  float inv_sqrt_bias2 = 1.0f;  // 1 / sqrt(1 - beta2^step)
  const float* grad_divisor = nullptr;  // device scalar the gradients are divided by (clipping); may be null
};

// param, exp_avg, exp_avg_sq: fp32 [n]; grad: [n], bf16 when grad_bf16, else fp32; param_bf16: bf16 [n]
// that receives the updated weights, or null.
void AdamWStep(float* param, const void* grad, bool grad_bf16, float* exp_avg, float* exp_avg_sq, void* param_bf16,
               int64_t n, const AdamWArgs& args, cudaStream_t stream);

}  // namespace ltrain::worker::cuda
