// Launchers of the layer norm's and the RMS norm's backward kernels (worker/model/cuda/layer_norm.cu): the input gradient,
// with a residual gradient added in the same pass, and the weight and bias gradients, column sums of
// dy · x̂ and dy over the rows, read once each. Plain CUDA, no LibTorch.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

namespace ltrain::worker::cuda {

// How many row chunks the first pass splits `rows` into for `cols` columns; the caller allocates
// LayerNormPartialFloats(rows, cols) floats of workspace.
int64_t LayerNormRowChunks(int64_t rows, int64_t cols);
inline int64_t LayerNormPartialFloats(int64_t rows, int64_t cols) { return LayerNormRowChunks(rows, cols) * 2 * cols; }

// dy, x: bf16 [rows, cols], rows contiguous, cols even; mean, rstd: fp32 [rows] (what the forward
// normalized with: x̂ = (x - mean) · rstd; mean null: 0). Writes dgamma[c] = Σ_r dy·x̂ and (dbeta not
// null) dbeta[c] = Σ_r dy in bf16, summed in fp32.
void LayerNormParamGrads(const void* dy, const void* x, const float* mean, const float* rstd, int64_t rows,
                         int64_t cols, float* partial, void* dgamma, void* dbeta, cudaStream_t stream);

// dx = rstd · (dy·γ − mean(dy·γ) − x̂ · mean(dy·γ·x̂)) (+ dres), per row, in bf16 computed in fp32.
// dy, x, dres (may be null), dx: bf16 [rows, cols], cols a multiple of 8, 16-byte aligned rows;
// gamma: bf16 [cols]; mean, rstd: fp32 [rows].
void LayerNormInputGrad(const void* dy, const void* x, const void* gamma, const float* mean, const float* rstd,
                        const void* dres, int64_t rows, int64_t cols, void* dx, cudaStream_t stream);

// The RMS norm's (x̂ = x · rstd, rstd = 1/sqrt(mean(x²) + eps)) input gradient
// dx = rstd · (dy·γ − x̂ · mean(dy·γ·x̂)) (+ dres), with LayerNormInputGrad's layouts; rstd is computed
// here from x and written to `rstd` (fp32 [rows]) for RmsNormWeightGrad.
void RmsNormInputGrad(const void* dy, const void* x, const void* gamma, float eps, const void* dres, int64_t rows,
                      int64_t cols, void* dx, float* rstd, cudaStream_t stream);

// dgamma[c] = Σ_r dy · x · rstd (bf16, summed in fp32), with LayerNormPartialFloats(rows, cols) floats of
// workspace in `partial`.
void RmsNormWeightGrad(const void* dy, const void* x, const float* rstd, int64_t rows, int64_t cols, float* partial,
                       void* dgamma, cudaStream_t stream);

}  // namespace ltrain::worker::cuda
