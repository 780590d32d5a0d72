// Fused cross-entropy over bf16 logits: the forward reads each row once (online softmax: running
// max and sum of exponentials) and keeps only its log-sum-exp; the backward reads the row again and
// writes the bf16 gradient. Neither materializes fp32 logits or log-probabilities.
#include "worker/model/cuda/cross_entropy.h"

#include <cuda_bf16.h>

#include <cfloat>
#include <cstdint>

namespace ltrain::worker::cuda {
namespace {

constexpr int kThreads = 512;
constexpr int kVector = 8;  // bf16 values per 16-byte load

struct MaxSum {
  float max;
  float sum;
};

__device__ __forceinline__ MaxSum Combine(MaxSum a, MaxSum b) {
  if (a.max == -FLT_MAX) return b;
  if (b.max == -FLT_MAX) return a;
  const float m = fmaxf(a.max, b.max);
  return MaxSum{m, a.sum * __expf(a.max - m) + b.sum * __expf(b.max - m)};
}

__device__ __forceinline__ void Add(MaxSum& acc, float x) {
  if (x > acc.max) {
    acc.sum = acc.sum * __expf(acc.max - x) + 1.0f;
    acc.max = x;
  } else {
    acc.sum += __expf(x - acc.max);
  }
}

__device__ MaxSum BlockReduce(MaxSum v) {
  __shared__ MaxSum partial[kThreads / 32];
  for (int offset = 16; offset > 0; offset /= 2) {
    MaxSum other{__shfl_down_sync(0xffffffffu, v.max, offset), __shfl_down_sync(0xffffffffu, v.sum, offset)};
    v = Combine(v, other);
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < kThreads / 32 ? partial[lane] : MaxSum{-FLT_MAX, 0.0f};
    for (int offset = 16; offset > 0; offset /= 2) {
      MaxSum other{__shfl_down_sync(0xffffffffu, v.max, offset), __shfl_down_sync(0xffffffffu, v.sum, offset)};
      v = Combine(v, other);
    }
  }
  return v;  // valid in thread 0
}

__global__ void ForwardKernel(const __nv_bfloat16* logits, const int64_t* targets, int64_t vocab, float* lse,
                              float* losses) {
  const int64_t row = blockIdx.x;
  const __nv_bfloat16* x = logits + row * vocab;
  MaxSum acc{-FLT_MAX, 0.0f};
  const bool vectorized = vocab % kVector == 0;
  if (vectorized) {
    const uint4* v = reinterpret_cast<const uint4*>(x);
    for (int64_t i = threadIdx.x; i < vocab / kVector; i += kThreads) {
      uint4 packed = v[i];
      const __nv_bfloat16* h = reinterpret_cast<const __nv_bfloat16*>(&packed);
      float f[kVector];
      float m = -FLT_MAX;
#pragma unroll
      for (int k = 0; k < kVector; ++k) f[k] = __bfloat162float(h[k]), m = fmaxf(m, f[k]);
      // One rescale for the eight values, not a compare and branch for each.
      if (m > acc.max) {
        acc.sum *= __expf(acc.max - m);
        acc.max = m;
      }
#pragma unroll
      for (int k = 0; k < kVector; ++k) acc.sum += __expf(f[k] - acc.max);
    }
  } else {
    for (int64_t i = threadIdx.x; i < vocab; i += kThreads) Add(acc, __bfloat162float(x[i]));
  }
  MaxSum total = BlockReduce(acc);
  if (threadIdx.x == 0) {
    const float l = total.max + logf(total.sum);
    lse[row] = l;
    const int64_t t = targets[row];
    losses[row] = (t >= 0 && t < vocab) ? l - __bfloat162float(x[t]) : __int_as_float(0x7fc00000);
  }
}

__global__ void BackwardKernel(const __nv_bfloat16* logits, const int64_t* targets, const float* lse,
                               const float* grad_loss, float inv_rows, int64_t vocab, __nv_bfloat16* grad) {
  const int64_t row = blockIdx.x;
  const __nv_bfloat16* x = logits + row * vocab;
  __nv_bfloat16* g = grad + row * vocab;
  const float l = lse[row];
  const float scale = *grad_loss * inv_rows;
  const int64_t t = targets[row];
  if (vocab % kVector == 0) {
    const uint4* v = reinterpret_cast<const uint4*>(x);
    uint4* out = reinterpret_cast<uint4*>(g);
    for (int64_t i = threadIdx.x; i < vocab / kVector; i += kThreads) {
      uint4 packed = v[i];
      const __nv_bfloat16* h = reinterpret_cast<const __nv_bfloat16*>(&packed);
      uint4 result;
      __nv_bfloat16* r = reinterpret_cast<__nv_bfloat16*>(&result);
#pragma unroll
      for (int k = 0; k < kVector; ++k) {
        const int64_t j = i * kVector + k;
        const float p = __expf(__bfloat162float(h[k]) - l);
        r[k] = __float2bfloat16((p - (j == t ? 1.0f : 0.0f)) * scale);
      }
      out[i] = result;
    }
  } else {
    for (int64_t j = threadIdx.x; j < vocab; j += kThreads) {
      const float p = __expf(__bfloat162float(x[j]) - l);
      g[j] = __float2bfloat16((p - (j == t ? 1.0f : 0.0f)) * scale);
    }
  }
}

}  // namespace

void CrossEntropyForward(const void* logits, const int64_t* targets, int64_t rows, int64_t vocab, float* lse,
                         float* losses, cudaStream_t stream) {
  if (rows == 0) return;
  ForwardKernel<<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(static_cast<const __nv_bfloat16*>(logits),
                                                                      targets, vocab, lse, losses);
}

void CrossEntropyBackward(const void* logits, const int64_t* targets, const float* lse, const float* grad_loss,
                          int64_t rows, int64_t vocab, void* grad, cudaStream_t stream) {
  if (rows == 0) return;
  BackwardKernel<<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(
      static_cast<const __nv_bfloat16*>(logits), targets, lse, grad_loss, 1.0f / static_cast<float>(rows), vocab,
      static_cast<__nv_bfloat16*>(grad));
}

}  // namespace ltrain::worker::cuda
