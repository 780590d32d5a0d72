// Memory-bound, so each element is read and written once, eight bf16 values to a 16-byte access
// where sizes and addresses allow (one thread per 8 rotated pairs, or per 8 elements), else one at
// a time; grid-stride loops.
#include "worker/model/cuda/llama_ops.h"

#include <cstdint>

#include <cuda_bf16.h>

#include "worker/model/cuda/bf16x8.cuh"

namespace ltrain::worker::cuda {
namespace {

__global__ void RopeKernel(const __nv_bfloat16* x, const float* cos, const float* sin, int64_t t, int64_t heads,
                           int64_t half, int64_t pairs, float sign, __nv_bfloat16* out, float* amax) {
  unsigned amax_bits = 0;
  for (int64_t p = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; p < pairs;
       p += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = p / half, i = p % half;  // row: (batch, position, head)
    const int64_t pos = (row / heads) % t;
    const float c = cos[pos * half + i], s = sign * sin[pos * half + i];
    const int64_t at = row * 2 * half + i;
    const float a = __bfloat162float(x[at]), b = __bfloat162float(x[at + half]);
    const __nv_bfloat16 ra = __float2bfloat16(a * c - b * s), rb = __float2bfloat16(b * c + a * s);
    out[at] = ra;
    out[at + half] = rb;
    amax_bits = max(amax_bits, max(AbsMaxBits(ra), AbsMaxBits(rb)));
  }
  if (amax != nullptr) AddBlockAmax(amax_bits, amax);
}

__device__ __forceinline__ Bf16x8 Pack(const float (&v)[8]) {
  Bf16x8 out;
#pragma unroll
  for (int i = 0; i < 4; ++i) out.v[i] = __floats2bfloat162_rn(v[2 * i], v[2 * i + 1]);
  return out;
}

// Eight pairs a thread: half a multiple of 8, rows 16-byte aligned.
__global__ void RopeKernel8(const Bf16x8* x, const float* cos, const float* sin, int64_t t, int64_t heads,
                            int64_t half, int64_t groups, float sign, Bf16x8* out, float* amax) {
  const int64_t per_row = half / 8;  // groups of 8 pairs in a row
  unsigned amax_bits = 0;
  for (int64_t p = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; p < groups;
       p += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = p / per_row, i = (p % per_row) * 8;
    const int64_t pos = (row / heads) % t;
    const int64_t at = (row * 2 * half + i) / 8, other = at + half / 8;
    float a[8], b[8], ra[8], rb[8];
    Unpack(x[at], a);
    Unpack(x[other], b);
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const float c = cos[pos * half + i + k], s = sign * sin[pos * half + i + k];
      ra[k] = a[k] * c - b[k] * s;
      rb[k] = b[k] * c + a[k] * s;
    }
    const Bf16x8 pa = Pack(ra), pb = Pack(rb);
    out[at] = pa;
    out[other] = pb;
    amax_bits = max(amax_bits, max(AbsMaxBits(pa), AbsMaxBits(pb)));
  }
  if (amax != nullptr) AddBlockAmax(amax_bits, amax);
}

__global__ void SwiGluKernel8(const Bf16x8* gate, const Bf16x8* up, int64_t groups, Bf16x8* out, float* amax) {
  unsigned amax_bits = 0;
  for (int64_t k = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; k < groups;
       k += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float g[8], u[8], o[8];
    Unpack(gate[k], g);
    Unpack(up[k], u);
#pragma unroll
    for (int i = 0; i < 8; ++i) o[i] = g[i] / (1.f + __expf(-g[i])) * u[i];
    const Bf16x8 packed = Pack(o);
    out[k] = packed;
    amax_bits = max(amax_bits, AbsMaxBits(packed));
  }
  if (amax != nullptr) AddBlockAmax(amax_bits, amax);
}

__global__ void SwiGluBackwardKernel8(const Bf16x8* gate, const Bf16x8* up, const Bf16x8* grad, int64_t groups,
                                      Bf16x8* dgate, Bf16x8* dup, float* dgate_amax, float* dup_amax) {
  unsigned dgate_bits = 0, dup_bits = 0;
  for (int64_t k = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; k < groups;
       k += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float g[8], u[8], d[8], dg[8], du[8];
    Unpack(gate[k], g);
    Unpack(up[k], u);
    Unpack(grad[k], d);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const float sig = 1.f / (1.f + __expf(-g[i]));
      du[i] = d[i] * g[i] * sig;
      dg[i] = d[i] * u[i] * sig * (1.f + g[i] * (1.f - sig));
    }
    const Bf16x8 dg_packed = Pack(dg), du_packed = Pack(du);
    dgate[k] = dg_packed;
    dup[k] = du_packed;
    dgate_bits = max(dgate_bits, AbsMaxBits(dg_packed));
    dup_bits = max(dup_bits, AbsMaxBits(du_packed));
  }
  if (dgate_amax != nullptr) AddBlockAmax(dgate_bits, dgate_amax);
  if (dup_amax != nullptr) AddBlockAmax(dup_bits, dup_amax);
}

__global__ void SwiGluKernel(const __nv_bfloat16* gate, const __nv_bfloat16* up, int64_t n, __nv_bfloat16* out,
                             float* amax) {
  unsigned amax_bits = 0;
  for (int64_t k = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; k < n;
       k += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float g = __bfloat162float(gate[k]);
    out[k] = __float2bfloat16(g / (1.f + __expf(-g)) * __bfloat162float(up[k]));
    amax_bits = max(amax_bits, AbsMaxBits(out[k]));
  }
  if (amax != nullptr) AddBlockAmax(amax_bits, amax);
}

__global__ void SwiGluBackwardKernel(const __nv_bfloat16* gate, const __nv_bfloat16* up, const __nv_bfloat16* grad,
                                     int64_t n, __nv_bfloat16* dgate, __nv_bfloat16* dup, float* dgate_amax,
                                     float* dup_amax) {
  unsigned dgate_bits = 0, dup_bits = 0;
  for (int64_t k = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; k < n;
       k += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float g = __bfloat162float(gate[k]), u = __bfloat162float(up[k]), d = __bfloat162float(grad[k]);
    const float sig = 1.f / (1.f + __expf(-g));
    const float silu = g * sig;
    const __nv_bfloat16 du = __float2bfloat16(d * silu), dg = __float2bfloat16(d * u * sig * (1.f + g * (1.f - sig)));
    dup[k] = du;
    dgate[k] = dg;
    dgate_bits = max(dgate_bits, AbsMaxBits(dg));
    dup_bits = max(dup_bits, AbsMaxBits(du));
  }
  if (dgate_amax != nullptr) AddBlockAmax(dgate_bits, dgate_amax);
  if (dup_amax != nullptr) AddBlockAmax(dup_bits, dup_amax);
}

}  // namespace

void Rope(const void* x, const float* cos, const float* sin, int64_t batch, int64_t t, int64_t heads,
          int64_t head_dim, bool inverse, void* out, cudaStream_t stream, float* amax) {
  const int64_t half = head_dim / 2, pairs = batch * t * heads * half;
  if (pairs == 0) return;
  if (half % 8 == 0 && Aligned16(x) && Aligned16(out)) {
    RopeKernel8<<<ElementwiseBlocks(pairs / 8), kElementwiseThreads, 0, stream>>>(
        static_cast<const Bf16x8*>(x), cos, sin, t, heads, half, pairs / 8, inverse ? -1.f : 1.f,
        static_cast<Bf16x8*>(out), amax);
    return;
  }
  RopeKernel<<<ElementwiseBlocks(pairs), kElementwiseThreads, 0, stream>>>(
      static_cast<const __nv_bfloat16*>(x), cos, sin, t, heads, half, pairs, inverse ? -1.f : 1.f,
      static_cast<__nv_bfloat16*>(out), amax);
}

void SwiGlu(const void* gate, const void* up, int64_t n, void* out, cudaStream_t stream, float* amax) {
  if (n == 0) return;
  if (n % 8 == 0 && Aligned16(gate) && Aligned16(up) && Aligned16(out)) {
    SwiGluKernel8<<<ElementwiseBlocks(n / 8), kElementwiseThreads, 0, stream>>>(
        static_cast<const Bf16x8*>(gate), static_cast<const Bf16x8*>(up), n / 8, static_cast<Bf16x8*>(out), amax);
    return;
  }
  SwiGluKernel<<<ElementwiseBlocks(n), kElementwiseThreads, 0, stream>>>(
      static_cast<const __nv_bfloat16*>(gate), static_cast<const __nv_bfloat16*>(up), n,
      static_cast<__nv_bfloat16*>(out), amax);
}

void SwiGluBackward(const void* gate, const void* up, const void* grad, int64_t n, void* dgate, void* dup,
                    cudaStream_t stream, float* dgate_amax, float* dup_amax) {
  if (n == 0) return;
  if (n % 8 == 0 && Aligned16(gate) && Aligned16(up) && Aligned16(grad) && Aligned16(dgate) && Aligned16(dup)) {
    SwiGluBackwardKernel8<<<ElementwiseBlocks(n / 8), kElementwiseThreads, 0, stream>>>(
        static_cast<const Bf16x8*>(gate), static_cast<const Bf16x8*>(up), static_cast<const Bf16x8*>(grad), n / 8,
        static_cast<Bf16x8*>(dgate), static_cast<Bf16x8*>(dup), dgate_amax, dup_amax);
    return;
  }
  SwiGluBackwardKernel<<<ElementwiseBlocks(n), kElementwiseThreads, 0, stream>>>(
      static_cast<const __nv_bfloat16*>(gate), static_cast<const __nv_bfloat16*>(up),
      static_cast<const __nv_bfloat16*>(grad), n, static_cast<__nv_bfloat16*>(dgate), static_cast<__nv_bfloat16*>(dup),
      dgate_amax, dup_amax);
}

}  // namespace ltrain::worker::cuda
