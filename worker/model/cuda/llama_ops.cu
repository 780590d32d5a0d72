// One thread per rotated pair (rotary) or per element (SwiGLU), grid-stride loops; memory-bound, so
// each element is read and written once.
#include "worker/model/cuda/llama_ops.h"

#include <cuda_bf16.h>

namespace ltrain::worker::cuda {
namespace {

constexpr int kThreads = 256;

int Blocks(int64_t n) {
  const int64_t blocks = (n + kThreads - 1) / kThreads;
  return static_cast<int>(blocks < 65535 * 16 ? blocks : 65535 * 16);
}

__global__ void RopeKernel(const __nv_bfloat16* x, const float* cos, const float* sin, int64_t t, int64_t heads,
                           int64_t half, int64_t pairs, float sign, __nv_bfloat16* out) {
  for (int64_t p = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; p < pairs;
       p += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = p / half, i = p % half;  // row: (batch, position, head)
    const int64_t pos = (row / heads) % t;
    const float c = cos[pos * half + i], s = sign * sin[pos * half + i];
    const int64_t at = row * 2 * half + i;
    const float a = __bfloat162float(x[at]), b = __bfloat162float(x[at + half]);
    out[at] = __float2bfloat16(a * c - b * s);
    out[at + half] = __float2bfloat16(b * c + a * s);
  }
}

__global__ void SwiGluKernel(const __nv_bfloat16* gate, const __nv_bfloat16* up, int64_t n, __nv_bfloat16* out) {
  for (int64_t k = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; k < n;
       k += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float g = __bfloat162float(gate[k]);
    out[k] = __float2bfloat16(g / (1.f + __expf(-g)) * __bfloat162float(up[k]));
  }
}

__global__ void SwiGluBackwardKernel(const __nv_bfloat16* gate, const __nv_bfloat16* up, const __nv_bfloat16* grad,
                                     int64_t n, __nv_bfloat16* dgate, __nv_bfloat16* dup) {
  for (int64_t k = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; k < n;
       k += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float g = __bfloat162float(gate[k]), u = __bfloat162float(up[k]), d = __bfloat162float(grad[k]);
    const float sig = 1.f / (1.f + __expf(-g));
    const float silu = g * sig;
    dup[k] = __float2bfloat16(d * silu);
    dgate[k] = __float2bfloat16(d * u * sig * (1.f + g * (1.f - sig)));
  }
}

}  // namespace

void Rope(const void* x, const float* cos, const float* sin, int64_t batch, int64_t t, int64_t heads,
          int64_t head_dim, bool inverse, void* out, cudaStream_t stream) {
  const int64_t half = head_dim / 2, pairs = batch * t * heads * half;
  if (pairs == 0) return;
  RopeKernel<<<Blocks(pairs), kThreads, 0, stream>>>(static_cast<const __nv_bfloat16*>(x), cos, sin, t, heads, half,
                                                      pairs, inverse ? -1.f : 1.f, static_cast<__nv_bfloat16*>(out));
}

void SwiGlu(const void* gate, const void* up, int64_t n, void* out, cudaStream_t stream) {
  if (n == 0) return;
  SwiGluKernel<<<Blocks(n), kThreads, 0, stream>>>(static_cast<const __nv_bfloat16*>(gate),
                                                    static_cast<const __nv_bfloat16*>(up), n,
                                                    static_cast<__nv_bfloat16*>(out));
}

void SwiGluBackward(const void* gate, const void* up, const void* grad, int64_t n, void* dgate, void* dup,
                    cudaStream_t stream) {
  if (n == 0) return;
  SwiGluBackwardKernel<<<Blocks(n), kThreads, 0, stream>>>(
      static_cast<const __nv_bfloat16*>(gate), static_cast<const __nv_bfloat16*>(up),
      static_cast<const __nv_bfloat16*>(grad), n, static_cast<__nv_bfloat16*>(dgate), static_cast<__nv_bfloat16*>(dup));
}

}  // namespace ltrain::worker::cuda
