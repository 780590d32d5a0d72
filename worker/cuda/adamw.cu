// AdamW (torch.optim.AdamW's update, element for element) over fp32 master weights, from bf16 or
// fp32 gradients, writing the bf16 copy in the same pass: no fp32 copy of the gradients and no
// separate pass to refresh the copy.
#include "worker/cuda/adamw.h"

#include <cuda_bf16.h>

namespace ltrain::worker::cuda {
namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ float Load(const __nv_bfloat16* g, int64_t i) { return __bfloat162float(g[i]); }
__device__ __forceinline__ float Load(const float* g, int64_t i) { return g[i]; }

template <typename Grad>
__global__ void AdamWKernel(float* param, const Grad* grad, float* exp_avg, float* exp_avg_sq,
                            __nv_bfloat16* param_bf16, int64_t n, AdamWArgs args) {
  const float scale = args.grad_divisor != nullptr ? 1.0f / *args.grad_divisor : 1.0f;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(kThreads) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * kThreads) {
    const float g = Load(grad, i) * scale;
    const float m = args.beta1 * exp_avg[i] + (1.0f - args.beta1) * g;
    const float v = args.beta2 * exp_avg_sq[i] + (1.0f - args.beta2) * g * g;
    const float denom = sqrtf(v) * args.inv_sqrt_bias2 + args.eps;
    const float p = param[i] * args.decay_factor - args.step_size * m / denom;
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
    param[i] = p;
    if (param_bf16 != nullptr) param_bf16[i] = __float2bfloat16(p);
  }
}

}  // namespace

void AdamWStep(float* param, const void* grad, bool grad_bf16, float* exp_avg, float* exp_avg_sq, void* param_bf16,
               int64_t n, const AdamWArgs& args, cudaStream_t stream) {
  if (n <= 0) return;
  int64_t blocks = (n + kThreads - 1) / kThreads;
  if (blocks > 2048) blocks = 2048;
  auto* copy = static_cast<__nv_bfloat16*>(param_bf16);
  if (grad_bf16) {
    AdamWKernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
        param, static_cast<const __nv_bfloat16*>(grad), exp_avg, exp_avg_sq, copy, n, args);
  } else {
    AdamWKernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(param, static_cast<const float*>(grad), exp_avg,
                                                                        exp_avg_sq, copy, n, args);
  }
}

}  // namespace ltrain::worker::cuda
