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

}  // namespace ltrain::worker::cuda
