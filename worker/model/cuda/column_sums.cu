// Column sums in two passes: blocks of 256 columns (eight per lane, 16-byte loads) by a chunk of
// rows, each warp over every 8th row of the chunk, summed across the warps in shared memory into
// per-chunk partials; then a kernel adds the chunks of each column (AddChunkRows).
#include "worker/model/cuda/column_sums.h"

#include <cuda_bf16.h>

#include "worker/model/cuda/bf16x8.cuh"

namespace ltrain::worker::cuda {
namespace {

constexpr int kLanes = 32;
constexpr int kColsPerLane = 8;
constexpr int kColsPerBlock = kLanes * kColsPerLane;
constexpr int kWarps = 8;

int64_t Chunks(int64_t rows, int64_t cols) { return RowChunks(rows, CeilDiv(cols, kColsPerBlock), kWarps); }

__global__ void PartialColumnSums(const Bf16x8* x, int64_t rows, int64_t vecs, int64_t rows_per_chunk,
                                  float* partial) {
  const int64_t vec = static_cast<int64_t>(blockIdx.x) * kLanes + threadIdx.x;
  const int64_t begin = static_cast<int64_t>(blockIdx.y) * rows_per_chunk;
  const int64_t end = begin + rows_per_chunk < rows ? begin + rows_per_chunk : rows;
  float sum[kColsPerLane] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  if (vec < vecs) {
#pragma unroll 4
    for (int64_t r = begin + threadIdx.y; r < end; r += kWarps) {
      float v[kColsPerLane];
      Unpack(x[r * vecs + vec], v);
#pragma unroll
      for (int i = 0; i < kColsPerLane; ++i) sum[i] += v[i];
    }
  }
  __shared__ float part[kWarps][kColsPerBlock];
#pragma unroll
  for (int i = 0; i < kColsPerLane; ++i) part[threadIdx.y][threadIdx.x * kColsPerLane + i] = sum[i];
  __syncthreads();
  // Thread (x, y) adds up columns y·32 + x of the block over the warps.
  const int local = threadIdx.y * kLanes + threadIdx.x;
  const int64_t col = static_cast<int64_t>(blockIdx.x) * kColsPerBlock + local;
  if (col < vecs * kColsPerLane) {
    float s = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) s += part[w][local];
    partial[static_cast<int64_t>(blockIdx.y) * vecs * kColsPerLane + col] = s;
  }
}

}  // namespace

int64_t ColumnSumsPartialFloats(int64_t rows, int64_t cols) { return Chunks(rows, cols) * cols; }

void ColumnSums(const void* x, int64_t rows, int64_t cols, float* partial, void* out, cudaStream_t stream,
                bool accumulate) {
  if (cols <= 0) return;
  if (rows <= 0) {
    if (!accumulate) cudaMemsetAsync(out, 0, cols * sizeof(__nv_bfloat16), stream);
    return;
  }
  const int64_t chunks = Chunks(rows, cols);
  const dim3 grid(static_cast<unsigned>(CeilDiv(cols, kColsPerBlock)), static_cast<unsigned>(chunks));
  PartialColumnSums<<<grid, dim3(kLanes, kWarps), 0, stream>>>(static_cast<const Bf16x8*>(x), rows, cols / kColsPerLane,
                                                               CeilDiv(rows, chunks), partial);
  LaunchAddChunkRows(partial, chunks, cols, cols, out, nullptr, stream, accumulate);
}

}  // namespace ltrain::worker::cuda
