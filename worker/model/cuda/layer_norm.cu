// The layer norm's backward. The input gradient: a block per row, eight columns per thread and
// 16-byte accesses, the row held in registers (up to 8192 columns), the two row means summed in
// fp32 across the block, the residual gradient added on the way out. The weight and bias gradients
// in two passes: blocks of 64 columns by a chunk of rows sum dy · x̂ and dy in fp32 (each warp over
// every 8th row, then across the warps in shared memory) into per-chunk partials; a second kernel
// adds the chunks of each column.
#include "worker/model/cuda/layer_norm.h"

#include <cuda_bf16.h>

#include "worker/model/cuda/bf16x8.cuh"

namespace ltrain::worker::cuda {
namespace {

constexpr int kColsPerBlock = 64;  // 32 lanes x 2 columns (one bf16 pair each)
constexpr int kWarps = 8;

__global__ void PartialSums(const __nv_bfloat16* dy, const __nv_bfloat16* x, const float* mean, const float* rstd,
                            int64_t rows, int64_t cols, int64_t rows_per_chunk, float* partial) {
  const int64_t col = static_cast<int64_t>(blockIdx.x) * kColsPerBlock + 2 * threadIdx.x;
  const int64_t begin = static_cast<int64_t>(blockIdx.y) * rows_per_chunk;
  const int64_t end = begin + rows_per_chunk < rows ? begin + rows_per_chunk : rows;
  float g0 = 0.f, g1 = 0.f, b0 = 0.f, b1 = 0.f;
  if (col < cols) {
#pragma unroll 4
    for (int64_t r = begin + threadIdx.y; r < end; r += kWarps) {
      const float2 d = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(dy + r * cols + col));
      const float2 v = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(x + r * cols + col));
      const float m = mean[r], s = rstd[r];
      g0 += d.x * (v.x - m) * s;
      g1 += d.y * (v.y - m) * s;
      b0 += d.x;
      b1 += d.y;
    }
  }
  __shared__ float gamma_part[kWarps][kColsPerBlock];
  __shared__ float beta_part[kWarps][kColsPerBlock];
  gamma_part[threadIdx.y][2 * threadIdx.x] = g0;
  gamma_part[threadIdx.y][2 * threadIdx.x + 1] = g1;
  beta_part[threadIdx.y][2 * threadIdx.x] = b0;
  beta_part[threadIdx.y][2 * threadIdx.x + 1] = b1;
  __syncthreads();
  // Warp w adds up columns [8w, 8w + 8) of the block over the warps.
  const int local = threadIdx.y * (kColsPerBlock / kWarps) + threadIdx.x;
  if (threadIdx.x < kColsPerBlock / kWarps) {
    const int64_t c = static_cast<int64_t>(blockIdx.x) * kColsPerBlock + local;
    if (c < cols) {
      float g = 0.f, b = 0.f;
      for (int w = 0; w < kWarps; ++w) {
        g += gamma_part[w][local];
        b += beta_part[w][local];
      }
      float* out = partial + static_cast<int64_t>(blockIdx.y) * 2 * cols;
      out[c] = g;
      out[cols + c] = b;
    }
  }
}

__global__ void AddChunks(const float* partial, int64_t chunks, int64_t cols, __nv_bfloat16* dgamma,
                          __nv_bfloat16* dbeta) {
  for (int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; c < cols;
       c += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float g = 0.f, b = 0.f;
    for (int64_t k = 0; k < chunks; ++k) {
      g += partial[k * 2 * cols + c];
      b += partial[k * 2 * cols + cols + c];
    }
    dgamma[c] = __float2bfloat16(g);
    dbeta[c] = __float2bfloat16(b);
  }
}

constexpr int kRowThreads = 256;

// Sums a and b over the block (kRowThreads threads); every thread gets both sums.
__device__ __forceinline__ void BlockSum2(float& a, float& b) {
  __shared__ float part[2][kRowThreads / 32];
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    a += __shfl_xor_sync(0xffffffffu, a, offset);
    b += __shfl_xor_sync(0xffffffffu, b, offset);
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) part[0][warp] = a, part[1][warp] = b;
  __syncthreads();
  a = 0.f, b = 0.f;
#pragma unroll
  for (int w = 0; w < kRowThreads / 32; ++w) a += part[0][w], b += part[1][w];
}

__device__ __forceinline__ Bf16x8 InputGradOf(const Bf16x8& dy, const Bf16x8& x, const Bf16x8& gamma,
                                               const Bf16x8* dres, float m, float s, float mean_g, float mean_gx) {
  float d[8], xv[8], g[8], r[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  Unpack(dy, d);
  Unpack(x, xv);
  Unpack(gamma, g);
  if (dres != nullptr) Unpack(*dres, r);
  Bf16x8 out;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float a = (d[2 * i] * g[2 * i] - mean_g - (xv[2 * i] - m) * s * mean_gx) * s + r[2 * i];
    const float b = (d[2 * i + 1] * g[2 * i + 1] - mean_g - (xv[2 * i + 1] - m) * s * mean_gx) * s + r[2 * i + 1];
    out.v[i] = __floats2bfloat162_rn(a, b);
  }
  return out;
}

__device__ __forceinline__ void AddRowSums(const Bf16x8& dy, const Bf16x8& x, const Bf16x8& gamma, float m, float s,
                                           float& sum_g, float& sum_gx) {
  float d[8], xv[8], g[8];
  Unpack(dy, d);
  Unpack(x, xv);
  Unpack(gamma, g);
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const float wdy = d[i] * g[i];
    sum_g += wdy;
    sum_gx += wdy * (xv[i] - m) * s;
  }
}

// Rows of up to kVecs · kRowThreads vectors: each thread keeps its dy and x in registers between the
// row sums and the output, so the row is read from memory once.
template <int kVecs>
__global__ void InputGradHeld(const Bf16x8* dy, const Bf16x8* x, const Bf16x8* gamma, const float* mean,
                              const float* rstd, const Bf16x8* dres, int64_t vecs, Bf16x8* dx) {
  const int64_t row = blockIdx.x;
  const float m = mean[row], s = rstd[row];
  Bf16x8 dyv[kVecs], xv[kVecs];
  float sum_g = 0.f, sum_gx = 0.f;
#pragma unroll
  for (int k = 0; k < kVecs; ++k) {
    const int64_t v = threadIdx.x + static_cast<int64_t>(k) * kRowThreads;
    if (v < vecs) {
      dyv[k] = dy[row * vecs + v];
      xv[k] = x[row * vecs + v];
      AddRowSums(dyv[k], xv[k], gamma[v], m, s, sum_g, sum_gx);
    }
  }
  BlockSum2(sum_g, sum_gx);
  const float cols = static_cast<float>(vecs * 8);
  const float mean_g = sum_g / cols, mean_gx = sum_gx / cols;
#pragma unroll
  for (int k = 0; k < kVecs; ++k) {
    const int64_t v = threadIdx.x + static_cast<int64_t>(k) * kRowThreads;
    if (v < vecs) {
      dx[row * vecs + v] = InputGradOf(dyv[k], xv[k], gamma[v], dres != nullptr ? dres + row * vecs + v : nullptr, m, s,
                                       mean_g, mean_gx);
    }
  }
}

// Wider rows: two passes over the row (the second mostly from cache).
__global__ void InputGrad(const Bf16x8* dy, const Bf16x8* x, const Bf16x8* gamma, const float* mean,
                          const float* rstd, const Bf16x8* dres, int64_t vecs, Bf16x8* dx) {
  const int64_t row = blockIdx.x;
  const float m = mean[row], s = rstd[row];
  float sum_g = 0.f, sum_gx = 0.f;
  for (int64_t v = threadIdx.x; v < vecs; v += kRowThreads) {
    AddRowSums(dy[row * vecs + v], x[row * vecs + v], gamma[v], m, s, sum_g, sum_gx);
  }
  BlockSum2(sum_g, sum_gx);
  const float cols = static_cast<float>(vecs * 8);
  const float mean_g = sum_g / cols, mean_gx = sum_gx / cols;
  for (int64_t v = threadIdx.x; v < vecs; v += kRowThreads) {
    dx[row * vecs + v] = InputGradOf(dy[row * vecs + v], x[row * vecs + v], gamma[v],
                                     dres != nullptr ? dres + row * vecs + v : nullptr, m, s, mean_g, mean_gx);
  }
}

}  // namespace

void LayerNormInputGrad(const void* dy, const void* x, const void* gamma, const float* mean, const float* rstd,
                        const void* dres, int64_t rows, int64_t cols, void* dx, cudaStream_t stream) {
  if (rows <= 0 || cols <= 0) return;
  const auto* dy_v = static_cast<const Bf16x8*>(dy);
  const auto* x_v = static_cast<const Bf16x8*>(x);
  const auto* gamma_v = static_cast<const Bf16x8*>(gamma);
  const auto* dres_v = static_cast<const Bf16x8*>(dres);
  auto* dx_v = static_cast<Bf16x8*>(dx);
  const int64_t vecs = cols / 8;
  const auto blocks = static_cast<unsigned>(rows);
  if (vecs <= kRowThreads) {
    InputGradHeld<1><<<blocks, kRowThreads, 0, stream>>>(dy_v, x_v, gamma_v, mean, rstd, dres_v, vecs, dx_v);
  } else if (vecs <= 2 * kRowThreads) {
    InputGradHeld<2><<<blocks, kRowThreads, 0, stream>>>(dy_v, x_v, gamma_v, mean, rstd, dres_v, vecs, dx_v);
  } else if (vecs <= 4 * kRowThreads) {
    InputGradHeld<4><<<blocks, kRowThreads, 0, stream>>>(dy_v, x_v, gamma_v, mean, rstd, dres_v, vecs, dx_v);
  } else {
    InputGrad<<<blocks, kRowThreads, 0, stream>>>(dy_v, x_v, gamma_v, mean, rstd, dres_v, vecs, dx_v);
  }
}

int64_t LayerNormRowChunks(int64_t rows, int64_t cols) { return RowChunks(rows, CeilDiv(cols, kColsPerBlock), kWarps); }

void LayerNormParamGrads(const void* dy, const void* x, const float* mean, const float* rstd, int64_t rows,
                         int64_t cols, float* partial, void* dgamma, void* dbeta, cudaStream_t stream) {
  if (rows <= 0 || cols <= 0) return;
  const int64_t chunks = LayerNormRowChunks(rows, cols);
  const int64_t rows_per_chunk = CeilDiv(rows, chunks);
  const dim3 grid(static_cast<unsigned>(CeilDiv(cols, kColsPerBlock)), static_cast<unsigned>(chunks));
  const dim3 block(32, kWarps);
  PartialSums<<<grid, block, 0, stream>>>(static_cast<const __nv_bfloat16*>(dy), static_cast<const __nv_bfloat16*>(x),
                                          mean, rstd, rows, cols, rows_per_chunk, partial);
  const int64_t blocks = CeilDiv(cols, 256);
  AddChunks<<<static_cast<unsigned>(blocks), 256, 0, stream>>>(partial, chunks, cols,
                                                               static_cast<__nv_bfloat16*>(dgamma),
                                                               static_cast<__nv_bfloat16*>(dbeta));
}

}  // namespace ltrain::worker::cuda
