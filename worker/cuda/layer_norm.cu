// The layer norm's weight and bias gradients in two passes: blocks of 64 columns by a chunk of rows
// sum dy · x̂ and dy in fp32 (each warp over every 8th row, then across the warps in shared memory)
// into per-chunk partials; a second kernel adds the chunks of each column.
#include "worker/cuda/layer_norm.h"

#include <cuda_bf16.h>

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

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace

int64_t LayerNormRowChunks(int64_t rows, int64_t cols) {
  // About 1024 blocks in all, each chunk at least 8 rows (one per warp).
  const int64_t col_blocks = CeilDiv(cols, kColsPerBlock);
  int64_t chunks = CeilDiv(1024, col_blocks);
  const int64_t most = CeilDiv(rows, kWarps);
  if (chunks > most) chunks = most;
  return chunks < 1 ? 1 : chunks;
}

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
