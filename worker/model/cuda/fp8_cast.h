// bf16 to FP8 for the FP8 products: the largest magnitude of a matrix (per tensor, or per row), and
// the cast of each value times the scale that maps that amax onto the format's largest value,
// saturated, with a transposed copy where a product needs its operand along the other dimension.
// The scale is computed on the device from the amax: nothing waits for the host. Plain CUDA, no
// LibTorch; the reference is worker/model/fp8_scaling.h.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

namespace ltrain::worker::cuda {

// amax[0] = max |x| over bf16 x [rows, cols] (row-major, contiguous), or with `rowwise`
// amax[r] = max over row r. amax must hold 0 (tensorwise) before; rowwise writes it. A NaN in x
// makes its amax NaN.
void Bf16Amax(const void* x, int64_t rows, int64_t cols, bool rowwise, float* amax, cudaStream_t stream);

// out [rows, cols] = saturate(x · scale) in e4m3 (or e5m2), scale = fp8_max / amax (1 where amax
// is below 1e-12 of fp8_max; rounded down to a power of two with `power_of_2`), per tensor or per
// row; scale_inv (1 or `rows` floats) = 1 / scale. out_t [cols, rows], when not null, gets the
// transposed copy (tensorwise only).
void Bf16ToFp8(const void* x, int64_t rows, int64_t cols, const float* amax, bool rowwise, bool e4m3, bool power_of_2,
               void* out, void* out_t, float* scale_inv, cudaStream_t stream);

// Rowwise both ways: out [rows, cols] scaled by each of x's rows and out_t [cols, rows] by each of its
// own rows (x's columns), from one read of x for the amaxes and one for the casts (row_amax [rows] and
// col_amax [cols] hold 0 before and get each row's and column's amax; row_scale_inv and col_scale_inv
// get 1 / scale). Where Fp8BothWaysTakes: rows a multiple of 16, cols of 8, x 16-byte aligned.
bool Fp8BothWaysTakes(const void* x, int64_t rows, int64_t cols);
void Bf16ToFp8BothWays(const void* x, int64_t rows, int64_t cols, float* row_amax, float* col_amax, bool e4m3,
                       bool power_of_2, void* out, void* out_t, float* row_scale_inv, float* col_scale_inv,
                       cudaStream_t stream);

}  // namespace ltrain::worker::cuda
