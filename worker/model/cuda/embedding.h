// The embedding's backward for a table larger than the batch (worker/model/cuda/embedding.cu). Plain
// CUDA, no LibTorch: the caller passes raw device pointers and its stream.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

namespace ltrain::worker::cuda {

// The fp32 workspace EmbeddingRowSums needs for n ids and rows of `cols`.
int64_t EmbeddingRowSumsFloats(int64_t n, int64_t cols);

// out[r] += Σ_{i : sorted[i] = r} grad[order[i]] for every row r of the batch: sorted [n] int64 are
// the batch's ids in ascending order and order [n] the token each came from (a stable sort, so that
// a row's tokens are added in the batch's order). Each row's tokens are summed in fp32, in pieces of
// at most 64 (a frequent row's pieces summed in parallel, then in order), and added to out's row
// once (rounded once); rows the batch does not use are not touched. grad [n, cols] and out [rows,
// cols] are bf16, rows contiguous, cols a multiple of 8 and both 16-byte aligned; `partial` holds
// EmbeddingRowSumsFloats(n, cols) floats (16-byte aligned). Nothing waits for the GPU.
void EmbeddingRowSums(const int64_t* sorted, const int64_t* order, int64_t n, const void* grad, int64_t cols,
                      float* partial, void* out, cudaStream_t stream);

}  // namespace ltrain::worker::cuda
