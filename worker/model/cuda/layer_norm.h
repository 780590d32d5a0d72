// Launchers of the layer norm's and the RMS norm's kernels (worker/model/cuda/layer_norm.cu): the
// forward on an input of either dtype with a bf16 output, the input gradient with a residual gradient
// added in the same pass, and the weight and bias gradients, column sums of dy · x̂ and dy over the
// rows, read once each. Plain CUDA, no LibTorch.
//
// The forward's x is fp32 where x_fp32 (an fp32 residual stream), else bf16. Backward reads the input
// in bf16: x itself where it was bf16, else the bf16 copy the forward wrote to `saved` (for the layer
// norm x − mean, which keeps x̂'s precision where the mean is large; for the RMS norm x), half the
// bytes an fp32 x would keep for backward. The residual gradient and the input gradient are fp32
// where fp32_grads (an fp32 stream), else bf16; dy, the weights, their gradients and the forward's
// output are bf16. Rows are contiguous, cols a multiple of 8, every row 16-byte aligned.
//
// `amax` and `dx_amax`, where not null, get the largest magnitude of the bf16 output (the forward's y;
// backward's bf16 dx, the copy where dx is fp32) for an FP8 quantization of it: a device fp32 that
// holds 0 (or an amax already) before.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

namespace ltrain::worker::cuda {

// y = (x − mean) · rstd · γ + β per row (eps inside the square root), in bf16 computed in fp32;
// writes mean and rstd (fp32 [rows]) for the backward, and where `saved` is not null, x − mean (bf16).
void LayerNormForward(const void* x, bool x_fp32, const void* gamma, const void* beta, float eps, int64_t rows,
                      int64_t cols, void* y, float* mean, float* rstd, void* saved, cudaStream_t stream,
                      float* amax = nullptr);

// y = x · rstd · γ, rstd = 1/sqrt(mean(x²) + eps), in bf16 computed in fp32 (llama_model.RMSNorm);
// where `saved` is not null, x in bf16.
void RmsNormForward(const void* x, bool x_fp32, const void* gamma, float eps, int64_t rows, int64_t cols, void* y,
                    void* saved, cudaStream_t stream, float* amax = nullptr);

// How many row chunks the first pass splits `rows` into for `cols` columns; the caller allocates
// LayerNormPartialFloats(rows, cols) floats of workspace.
int64_t LayerNormRowChunks(int64_t rows, int64_t cols);
inline int64_t LayerNormPartialFloats(int64_t rows, int64_t cols) { return LayerNormRowChunks(rows, cols) * 2 * cols; }

// mean, rstd: fp32 [rows] (what the forward normalized with: x̂ = (x - mean) · rstd; mean null: 0,
// as for a saved x − mean). Writes dgamma[c] = Σ_r dy·x̂ and (dbeta not null) dbeta[c] = Σ_r dy in
// bf16, summed in fp32; with `accumulate` added to what dgamma and dbeta hold.
void LayerNormParamGrads(const void* dy, const void* x, const float* mean, const float* rstd, int64_t rows,
                         int64_t cols, float* partial, void* dgamma, void* dbeta, cudaStream_t stream,
                         bool accumulate = false);

// dx = rstd · (dy·γ − mean(dy·γ) − x̂ · mean(dy·γ·x̂)) (+ dres), per row, computed in fp32; dres may
// be null; gamma: bf16 [cols]; mean (null: 0), rstd: fp32 [rows]. With fp32_grads, dx_bf16 (may be
// null) gets a bf16 copy of dx in the same pass: what the product that wrote x reads as its output
// gradient.
void LayerNormInputGrad(const void* dy, const void* x, bool fp32_grads, const void* gamma, const float* mean,
                        const float* rstd, const void* dres, int64_t rows, int64_t cols, void* dx, void* dx_bf16,
                        cudaStream_t stream, float* dx_amax = nullptr);

// The RMS norm's (x̂ = x · rstd, rstd = 1/sqrt(mean(x²) + eps)) input gradient
// dx = rstd · (dy·γ − x̂ · mean(dy·γ·x̂)) (+ dres), with LayerNormInputGrad's layouts; rstd is computed
// here from x and written to `rstd` (fp32 [rows]) for RmsNormWeightGrad; dx_bf16 as LayerNormInputGrad's.
void RmsNormInputGrad(const void* dy, const void* x, bool fp32_grads, const void* gamma, float eps, const void* dres,
                      int64_t rows, int64_t cols, void* dx, void* dx_bf16, float* rstd, cudaStream_t stream,
                      float* dx_amax = nullptr);

// dgamma[c] = Σ_r dy · x · rstd (bf16, summed in fp32), with LayerNormPartialFloats(rows, cols) floats of
// workspace in `partial`.
void RmsNormWeightGrad(const void* dy, const void* x, const float* rstd, int64_t rows, int64_t cols, float* partial,
                       void* dgamma, cudaStream_t stream, bool accumulate = false);

// The whole backward of a norm: LayerNormInputGrad and LayerNormParamGrads (RmsNormInputGrad and
// RmsNormWeightGrad), for rows up to 8192 columns in one pass that reads dy and x once, with
// NormBackwardPartialFloats(rows, cols) floats of workspace in `partial` (and for the RMS norm fp32
// [rows] in `rstd`, written where the rows are wider). With `accumulate_params` the weight (and bias)
// gradients are added to what dgamma (and dbeta) hold.
//
// With `dx_sums` (the layer norm on an fp32 stream), the one pass also sums the fp32 dx over the rows:
// the bias gradient of the product that wrote x, whose output gradient dx is, without a pass of its
// own over that gradient. *dx_sums gets the number of per-block sums left in `partial` (0: the rows
// were too wide for the one pass, and none were left); the partial then needs
// NormBackwardPartialFloats(rows, cols, true) floats, and AddDxSums adds the sums up.
int64_t NormBackwardPartialFloats(int64_t rows, int64_t cols, bool dx_sums = false);
void LayerNormBackward(const void* dy, const void* x, bool fp32_grads, const void* gamma, const float* mean,
                       const float* rstd, const void* dres, int64_t rows, int64_t cols, void* dx, void* dx_bf16,
                       float* partial, void* dgamma, void* dbeta, cudaStream_t stream, bool accumulate_params = false,
                       int64_t* dx_sums = nullptr, float* dx_amax = nullptr);
// out[c] = Σ of the `chunks` per-block sums of dx that LayerNormBackward left in `partial` (bf16 [cols],
// summed in fp32; with `accumulate` added to what out holds).
void AddDxSums(const float* partial, int64_t chunks, int64_t cols, void* out, cudaStream_t stream, bool accumulate);
void RmsNormBackward(const void* dy, const void* x, bool fp32_grads, const void* gamma, float eps, const void* dres,
                     int64_t rows, int64_t cols, void* dx, void* dx_bf16, float* rstd, float* partial, void* dgamma,
                     cudaStream_t stream, bool accumulate_params = false, float* dx_amax = nullptr);

}  // namespace ltrain::worker::cuda
