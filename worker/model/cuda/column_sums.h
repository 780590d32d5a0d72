// Column sums of a bf16 matrix (the bias gradients of linear layers): one read of the matrix at the
// card's bandwidth, summed in fp32. Plain CUDA, no LibTorch.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

namespace ltrain::worker::cuda {

// The fp32 workspace ColumnSums needs for a [rows, cols] matrix.
int64_t ColumnSumsPartialFloats(int64_t rows, int64_t cols);

// out[c] = Σ_r x[r, c] for bf16 x [rows, cols] (rows contiguous, cols a multiple of 8, 16-byte
// aligned), written to bf16 out [cols]; with `accumulate` added to what out holds.
void ColumnSums(const void* x, int64_t rows, int64_t cols, float* partial, void* out, cudaStream_t stream,
                bool accumulate = false);

}  // namespace ltrain::worker::cuda
