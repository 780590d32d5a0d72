// What the worker's memory-bound kernels share: eight bf16 values moved in one 16-byte access, and
// the grid arithmetic of their two-pass column reductions. Plain CUDA, no LibTorch.
#pragma once

#include <cstdint>

#include <cuda_bf16.h>

namespace ltrain::worker::cuda {

struct alignas(16) Bf16x8 {
  __nv_bfloat162 v[4];
};

__device__ __forceinline__ void Unpack(const Bf16x8& p, float (&out)[8]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(p.v[i]);
    out[2 * i] = f.x;
    out[2 * i + 1] = f.y;
  }
}

inline int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// How many chunks of rows a column reduction splits `rows` into when each block covers one of
// `col_blocks` blocks of columns and one chunk: about 1024 blocks in all, each chunk at least
// `min_rows` rows (one per warp).
inline int64_t RowChunks(int64_t rows, int64_t col_blocks, int64_t min_rows) {
  int64_t chunks = CeilDiv(1024, col_blocks);
  const int64_t most = CeilDiv(rows, min_rows);
  if (chunks > most) chunks = most;
  return chunks < 1 ? 1 : chunks;
}

}  // namespace ltrain::worker::cuda
