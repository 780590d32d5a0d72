// Memory-bound: eight bf16 values to a 16-byte access where the sizes and addresses allow, else one at
// a time; grid-stride loops. The derivative is LibTorch's formula for the tanh approximation.
#include "worker/model/cuda/gelu.h"

#include <cstdint>

#include <cuda_bf16.h>

#include "worker/model/cuda/bf16x8.cuh"

namespace ltrain::worker::cuda {
namespace {

// d/dx of 0.5 · x · (1 + tanh(√(2/π) · (x + 0.044715 x³))).
__device__ __forceinline__ float GeluGrad(float x) {
  constexpr float kBeta = 0.7978845608028654f;  // √(2/π)
  constexpr float kKappa = 0.044715f;
  const float x_sq = x * x;
  const float t = tanhf(kBeta * (x + kKappa * x_sq * x));
  return 0.5f * (1.f + t) + 0.5f * x * (1.f - t * t) * kBeta * (1.f + 3.f * kKappa * x_sq);
}

__global__ void GeluBackwardKernel8(const Bf16x8* grad, const Bf16x8* pre, int64_t groups, Bf16x8* dx, float* amax) {
  unsigned amax_bits = 0;
  for (int64_t k = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; k < groups;
       k += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float g[8], p[8], d[8];
    Unpack(grad[k], g);
    Unpack(pre[k], p);
#pragma unroll
    for (int i = 0; i < 8; ++i) d[i] = g[i] * GeluGrad(p[i]);
    const Bf16x8 packed = Pack(d);
    dx[k] = packed;
    amax_bits = max(amax_bits, AbsMaxBits(packed));
  }
  if (amax != nullptr) AddBlockAmax(amax_bits, amax);
}

__global__ void GeluBackwardKernel(const __nv_bfloat16* grad, const __nv_bfloat16* pre, int64_t n, __nv_bfloat16* dx,
                                   float* amax) {
  unsigned amax_bits = 0;
  for (int64_t k = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; k < n;
       k += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const __nv_bfloat16 d = __float2bfloat16(__bfloat162float(grad[k]) * GeluGrad(__bfloat162float(pre[k])));
    dx[k] = d;
    amax_bits = max(amax_bits, AbsMaxBits(d));
  }
  if (amax != nullptr) AddBlockAmax(amax_bits, amax);
}

}  // namespace

void GeluBackward(const void* grad, const void* pre, int64_t n, void* dx, cudaStream_t stream, float* amax) {
  if (n == 0) return;
  if (n % 8 == 0 && Aligned16(grad) && Aligned16(pre) && Aligned16(dx)) {
    GeluBackwardKernel8<<<ElementwiseBlocks(n / 8), kElementwiseThreads, 0, stream>>>(
        static_cast<const Bf16x8*>(grad), static_cast<const Bf16x8*>(pre), n / 8, static_cast<Bf16x8*>(dx), amax);
    return;
  }
  GeluBackwardKernel<<<ElementwiseBlocks(n), kElementwiseThreads, 0, stream>>>(
      static_cast<const __nv_bfloat16*>(grad), static_cast<const __nv_bfloat16*>(pre), n,
      static_cast<__nv_bfloat16*>(dx), amax);
}

}  // namespace ltrain::worker::cuda
