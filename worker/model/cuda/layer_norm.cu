// The layer norm's and the RMS norm's forward and backward. The input (with it the residual
// gradient and the input gradient) is bf16 or fp32 (T, an fp32 residual stream); dy, the weights and
// the output are bf16.
// - Forward and the input gradient: a warp per row up to 1024 columns, a block per row beyond, eight
//   columns per thread and 16-byte accesses, the row held in registers (up to 8192 columns), the row
//   sums in fp32 across the warp or the block, the residual gradient added on the way out.
// - The weight and bias gradients in two passes: blocks of 256 columns by a chunk of rows sum dy · x̂
//   and dy in fp32 (each warp over every 8th row, then across the warps in shared memory) into
//   per-chunk partials; a second kernel adds the chunks of each column (AddChunkRows).
// - The RMS norm is the layer norm without centring (mean 0, no bias), its rstd recomputed from the
//   row the input-gradient kernel holds anyway.
#include "worker/model/cuda/layer_norm.h"

#include <algorithm>

#include <cuda_bf16.h>

#include "worker/model/cuda/bf16x8.cuh"

namespace ltrain::worker::cuda {
namespace {

constexpr int kColsPerBlock = 256;  // 32 lanes x 8 columns (one 16-byte vector of dy each)
constexpr int kWarps = 8;

// Per-chunk column sums of dy · x̂ and dy: blocks of 256 columns by a chunk of rows, each warp over
// every 8th row of the chunk with 16-byte loads of dy (32-byte of fp32 x), then across the warps.
template <typename T>
__global__ void PartialSums(const Bf16x8* dy, const typename Vec8<T>::Type* x, const float* mean, const float* rstd,
                            int64_t rows, int64_t vecs, int64_t rows_per_chunk, float* partial) {
  const int64_t vec = static_cast<int64_t>(blockIdx.x) * 32 + threadIdx.x;
  const int64_t begin = static_cast<int64_t>(blockIdx.y) * rows_per_chunk;
  const int64_t end = begin + rows_per_chunk < rows ? begin + rows_per_chunk : rows;
  float g[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f}, b[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  if (vec < vecs) {
#pragma unroll 2
    for (int64_t r = begin + threadIdx.y; r < end; r += kWarps) {
      float d[8], v[8];
      Unpack(dy[r * vecs + vec], d);
      Vec8<T>::Load(x[r * vecs + vec], v);
      const float m = mean != nullptr ? mean[r] : 0.f, s = rstd[r];
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        g[i] += d[i] * (v[i] - m) * s;
        b[i] += d[i];
      }
    }
  }
  __shared__ float gamma_part[kWarps][kColsPerBlock];
  __shared__ float beta_part[kWarps][kColsPerBlock];
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    gamma_part[threadIdx.y][8 * threadIdx.x + i] = g[i];
    beta_part[threadIdx.y][8 * threadIdx.x + i] = b[i];
  }
  __syncthreads();
  // Thread (x, y) adds up column 32y + x of the block over the warps.
  const int local = threadIdx.y * 32 + threadIdx.x;
  const int64_t cols = vecs * 8;
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kColsPerBlock + local;
  if (c < cols) {
    float gs = 0.f, bs = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      gs += gamma_part[w][local];
      bs += beta_part[w][local];
    }
    float* out = partial + static_cast<int64_t>(blockIdx.y) * 2 * cols;
    out[c] = gs;
    out[cols + c] = bs;
  }
}

constexpr int kRowThreads = 256;

// Sums a, b and c over the block (kRowThreads threads); every thread gets the three sums.
__device__ __forceinline__ void BlockSum3(float& a, float& b, float& c) {
  __shared__ float part[3][kRowThreads / 32];
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    a += __shfl_xor_sync(0xffffffffu, a, offset);
    b += __shfl_xor_sync(0xffffffffu, b, offset);
    c += __shfl_xor_sync(0xffffffffu, c, offset);
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) part[0][warp] = a, part[1][warp] = b, part[2][warp] = c;
  __syncthreads();
  a = 0.f, b = 0.f, c = 0.f;
#pragma unroll
  for (int w = 0; w < kRowThreads / 32; ++w) a += part[0][w], b += part[1][w], c += part[2][w];
  __syncthreads();  // every thread has read `part` before a second sum writes it
}

// Sums a, b and c over the warp; every lane gets the three sums.
__device__ __forceinline__ void WarpSum3(float& a, float& b, float& c) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    a += __shfl_xor_sync(0xffffffffu, a, offset);
    b += __shfl_xor_sync(0xffffffffu, b, offset);
    c += __shfl_xor_sync(0xffffffffu, c, offset);
  }
}

template <typename T>
__device__ __forceinline__ float SumOfSquares(const typename Vec8<T>::Type& x) {
  float xv[8], ss = 0.f;
  Vec8<T>::Load(x, xv);
#pragma unroll
  for (int i = 0; i < 8; ++i) ss += xv[i] * xv[i];
  return ss;
}

// The row's statistics once its sums are in: the layer norm's means of dy·γ and dy·γ·x̂; the RMS
// norm's rstd from Σx², mean(dy·γ) 0, and mean(dy·γ·x̂) = rstd · Σ(dy·γ·x) / cols (its sums ran with
// mean 0 and rstd 1). Thread 0 records the RMS norm's rstd for the weight gradient.
template <bool kRms>
__device__ __forceinline__ void RowStatistics(float sum_g, float sum_gx, float sum_xx, float cols, float eps,
                                              int64_t row, float* rstd_out, float& s, float& mean_g, float& mean_gx) {
  if (kRms) {
    s = rsqrtf(sum_xx / cols + eps);
    mean_g = 0.f;
    mean_gx = sum_gx * s / cols;
    if (threadIdx.x % 32 == 0 && rstd_out != nullptr) rstd_out[row] = s;  // lane 0 of each warp: one value
  } else {
    mean_g = sum_g / cols;
    mean_gx = sum_gx / cols;
  }
}

// Writes eight columns of dx (the residual gradient r added) and, where dx16 is not null, their bf16
// copy.
template <typename T>
__device__ __forceinline__ void WriteInputGrad(const Bf16x8& dy, const typename Vec8<T>::Type& x, const Bf16x8& gamma,
                                               const float (&r)[8], float m, float s, float mean_g, float mean_gx,
                                               typename Vec8<T>::Type* dx, Bf16x8* dx16) {
  float d[8], xv[8], g[8], out[8];
  Unpack(dy, d);
  Vec8<T>::Load(x, xv);
  Unpack(gamma, g);
#pragma unroll
  for (int i = 0; i < 8; ++i) out[i] = (d[i] * g[i] - mean_g - (xv[i] - m) * s * mean_gx) * s + r[i];
  *dx = Vec8<T>::Store(out);
  if (dx16 != nullptr) *dx16 = Pack(out);
}

// The same with the residual gradient read from dres (null: none).
template <typename T>
__device__ __forceinline__ void WriteInputGrad(const Bf16x8& dy, const typename Vec8<T>::Type& x, const Bf16x8& gamma,
                                               const typename Vec8<T>::Type* dres, float m, float s, float mean_g,
                                               float mean_gx, typename Vec8<T>::Type* dx, Bf16x8* dx16) {
  float r[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  if (dres != nullptr) Vec8<T>::Load(*dres, r);
  WriteInputGrad<T>(dy, x, gamma, r, m, s, mean_g, mean_gx, dx, dx16);
}

template <typename T>
__device__ __forceinline__ void AddRowSums(const Bf16x8& dy, const typename Vec8<T>::Type& x, const Bf16x8& gamma,
                                           float m, float s, float& sum_g, float& sum_gx) {
  float d[8], xv[8], g[8];
  Unpack(dy, d);
  Vec8<T>::Load(x, xv);
  Unpack(gamma, g);
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const float wdy = d[i] * g[i];
    sum_g += wdy;
    sum_gx += wdy * (xv[i] - m) * s;
  }
}

// Rows of up to kVecs · kRowThreads vectors: each thread keeps its dy and x in registers between the
// row sums and the output, so the row is read from memory once. The layer norm reads mean and rstd;
// the RMS norm (kRms) computes rstd and writes it to rstd_out.
template <int kVecs, bool kRms, typename T>
__global__ void InputGradHeld(const Bf16x8* dy, const typename Vec8<T>::Type* x, const Bf16x8* gamma, const float* mean,
                              const float* rstd, float eps, const typename Vec8<T>::Type* dres, int64_t vecs,
                              typename Vec8<T>::Type* dx, Bf16x8* dx16, float* rstd_out) {
  const int64_t row = blockIdx.x;
  const float m = kRms ? 0.f : mean[row];
  float s = kRms ? 1.f : rstd[row];
  Bf16x8 dyv[kVecs];
  typename Vec8<T>::Type xv[kVecs];
  float sum_g = 0.f, sum_gx = 0.f, sum_xx = 0.f;
#pragma unroll
  for (int k = 0; k < kVecs; ++k) {
    const int64_t v = threadIdx.x + static_cast<int64_t>(k) * kRowThreads;
    if (v < vecs) {
      dyv[k] = dy[row * vecs + v];
      xv[k] = x[row * vecs + v];
      AddRowSums<T>(dyv[k], xv[k], gamma[v], m, s, sum_g, sum_gx);
      if (kRms) sum_xx += SumOfSquares<T>(xv[k]);
    }
  }
  BlockSum3(sum_g, sum_gx, sum_xx);
  float mean_g, mean_gx;
  RowStatistics<kRms>(sum_g, sum_gx, sum_xx, static_cast<float>(vecs * 8), eps, row, rstd_out, s, mean_g, mean_gx);
#pragma unroll
  for (int k = 0; k < kVecs; ++k) {
    const int64_t v = threadIdx.x + static_cast<int64_t>(k) * kRowThreads;
    if (v < vecs) {
      WriteInputGrad<T>(dyv[k], xv[k], gamma[v], dres != nullptr ? dres + row * vecs + v : nullptr, m, s, mean_g,
                        mean_gx, dx + row * vecs + v, dx16 != nullptr ? dx16 + row * vecs + v : nullptr);
    }
  }
}

// Narrow rows (up to kVecs · 32 vectors): a warp per row, kRowThreads / 32 rows a block at a time
// (the grid strides over the rows), the row sums across the warp's lanes only (no block barrier),
// each lane holding its vectors in registers as InputGradHeld's threads do. Where `partial` is not
// null the weight (and, for the layer norm, bias) gradients' sums are taken from the same registers:
// each warp adds its rows' dy · x̂ and dy into a slice of shared memory of its own (each lane to its
// own columns: no atomics, a fixed order), the block sums the slices in order and writes them to
// partial[block] for AddChunkRows. dy and x are read once, and the sums are deterministic.
template <int kVecs, bool kRms, typename T>
__global__ void InputGradWarp(const Bf16x8* dy, const typename Vec8<T>::Type* x, const Bf16x8* gamma, const float* mean,
                              const float* rstd, float eps, const typename Vec8<T>::Type* dres, int64_t rows,
                              int64_t vecs, typename Vec8<T>::Type* dx, Bf16x8* dx16, float* rstd_out,
                              float* partial) {
  extern __shared__ float param_sums[];  // per warp [gamma cols | beta cols], only with `partial`
  const int lane = threadIdx.x % 32;
  const int64_t cols = vecs * 8;
  float* const warp_sums = param_sums + (threadIdx.x / 32) * 2 * cols;
  if (partial != nullptr) {
    for (int64_t i = threadIdx.x; i < (kRowThreads / 32) * 2 * cols; i += blockDim.x) param_sums[i] = 0.f;
    __syncthreads();
  }
  const int64_t stride = static_cast<int64_t>(gridDim.x) * (kRowThreads / 32);
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * (kRowThreads / 32) + threadIdx.x / 32; row < rows;
       row += stride) {
    const float m = kRms ? 0.f : mean[row];
    float s = kRms ? 1.f : rstd[row];
    Bf16x8 dyv[kVecs];
    typename Vec8<T>::Type xv[kVecs];
    float rv[kVecs][8];
    float sum_g = 0.f, sum_gx = 0.f, sum_xx = 0.f;
#pragma unroll
    for (int k = 0; k < kVecs; ++k) {
      const int64_t v = lane + static_cast<int64_t>(k) * 32;
      if (v < vecs) {
        dyv[k] = dy[row * vecs + v];
        xv[k] = x[row * vecs + v];
        // The residual gradient is read with the row, not after its sums: its latency is not exposed.
#pragma unroll
        for (int i = 0; i < 8; ++i) rv[k][i] = 0.f;
        if (dres != nullptr) Vec8<T>::Load(dres[row * vecs + v], rv[k]);
        AddRowSums<T>(dyv[k], xv[k], gamma[v], m, s, sum_g, sum_gx);
        if (kRms) sum_xx += SumOfSquares<T>(xv[k]);
      }
    }
    WarpSum3(sum_g, sum_gx, sum_xx);
    float mean_g, mean_gx;
    RowStatistics<kRms>(sum_g, sum_gx, sum_xx, static_cast<float>(cols), eps, row, rstd_out, s, mean_g, mean_gx);
#pragma unroll
    for (int k = 0; k < kVecs; ++k) {
      const int64_t v = lane + static_cast<int64_t>(k) * 32;
      if (v < vecs) {
        WriteInputGrad<T>(dyv[k], xv[k], gamma[v], rv[k], m, s, mean_g, mean_gx, dx + row * vecs + v,
                          dx16 != nullptr ? dx16 + row * vecs + v : nullptr);
        if (partial != nullptr) {
          float d[8], xf[8];
          Unpack(dyv[k], d);
          Vec8<T>::Load(xv[k], xf);
#pragma unroll
          for (int i = 0; i < 8; ++i) {
            warp_sums[v * 8 + i] += d[i] * (xf[i] - m) * s;
            if (!kRms) warp_sums[cols + v * 8 + i] += d[i];
          }
        }
      }
    }
  }
  if (partial != nullptr) {
    __syncthreads();
    float* out = partial + static_cast<int64_t>(blockIdx.x) * 2 * cols;
    for (int64_t i = threadIdx.x; i < 2 * cols; i += blockDim.x) {
      float sum = 0.f;
#pragma unroll
      for (int w = 0; w < kRowThreads / 32; ++w) sum += param_sums[w * 2 * cols + i];
      out[i] = sum;
    }
  }
}

// Wider rows: two passes over the row (the second mostly from cache).
template <bool kRms, typename T>
__global__ void InputGrad(const Bf16x8* dy, const typename Vec8<T>::Type* x, const Bf16x8* gamma, const float* mean,
                          const float* rstd, float eps, const typename Vec8<T>::Type* dres, int64_t vecs,
                          typename Vec8<T>::Type* dx, Bf16x8* dx16, float* rstd_out) {
  const int64_t row = blockIdx.x;
  const float m = kRms ? 0.f : mean[row];
  float s = kRms ? 1.f : rstd[row];
  float sum_g = 0.f, sum_gx = 0.f, sum_xx = 0.f;
  for (int64_t v = threadIdx.x; v < vecs; v += kRowThreads) {
    AddRowSums<T>(dy[row * vecs + v], x[row * vecs + v], gamma[v], m, s, sum_g, sum_gx);
    if (kRms) sum_xx += SumOfSquares<T>(x[row * vecs + v]);
  }
  BlockSum3(sum_g, sum_gx, sum_xx);
  float mean_g, mean_gx;
  RowStatistics<kRms>(sum_g, sum_gx, sum_xx, static_cast<float>(vecs * 8), eps, row, rstd_out, s, mean_g, mean_gx);
  for (int64_t v = threadIdx.x; v < vecs; v += kRowThreads) {
    WriteInputGrad<T>(dy[row * vecs + v], x[row * vecs + v], gamma[v], dres != nullptr ? dres + row * vecs + v : nullptr,
                      m, s, mean_g, mean_gx, dx + row * vecs + v, dx16 != nullptr ? dx16 + row * vecs + v : nullptr);
  }
}

template <bool kRms, typename T>
void LaunchInputGrad(const void* dy, const void* x, const void* gamma, const float* mean, const float* rstd, float eps,
                     const void* dres, int64_t rows, int64_t cols, void* dx, void* dx_bf16, float* rstd_out,
                     cudaStream_t stream) {
  if (rows <= 0 || cols <= 0) return;
  using V = typename Vec8<T>::Type;
  auto* dx16 = static_cast<Bf16x8*>(dx_bf16);
  const auto* dy_v = static_cast<const Bf16x8*>(dy);
  const auto* x_v = static_cast<const V*>(x);
  const auto* gamma_v = static_cast<const Bf16x8*>(gamma);
  const auto* dres_v = static_cast<const V*>(dres);
  auto* dx_v = static_cast<V*>(dx);
  const int64_t vecs = cols / 8;
  const auto blocks = static_cast<unsigned>(rows);
  const auto warp_blocks = static_cast<unsigned>(CeilDiv(rows, kRowThreads / 32));
  if (vecs <= 32) {
    InputGradWarp<1, kRms, T><<<warp_blocks, kRowThreads, 0, stream>>>(dy_v, x_v, gamma_v, mean, rstd, eps, dres_v, rows,
                                                                       vecs, dx_v, dx16, rstd_out, nullptr);
  } else if (vecs <= 64) {
    InputGradWarp<2, kRms, T><<<warp_blocks, kRowThreads, 0, stream>>>(dy_v, x_v, gamma_v, mean, rstd, eps, dres_v, rows,
                                                                       vecs, dx_v, dx16, rstd_out, nullptr);
  } else if (vecs <= 128) {
    InputGradWarp<4, kRms, T><<<warp_blocks, kRowThreads, 0, stream>>>(dy_v, x_v, gamma_v, mean, rstd, eps, dres_v, rows,
                                                                       vecs, dx_v, dx16, rstd_out, nullptr);
  } else if (vecs <= kRowThreads) {
    InputGradHeld<1, kRms, T><<<blocks, kRowThreads, 0, stream>>>(dy_v, x_v, gamma_v, mean, rstd, eps, dres_v, vecs,
                                                                  dx_v, dx16, rstd_out);
  } else if (vecs <= 2 * kRowThreads) {
    InputGradHeld<2, kRms, T><<<blocks, kRowThreads, 0, stream>>>(dy_v, x_v, gamma_v, mean, rstd, eps, dres_v, vecs,
                                                                  dx_v, dx16, rstd_out);
  } else if (vecs <= 4 * kRowThreads) {
    InputGradHeld<4, kRms, T><<<blocks, kRowThreads, 0, stream>>>(dy_v, x_v, gamma_v, mean, rstd, eps, dres_v, vecs,
                                                                  dx_v, dx16, rstd_out);
  } else {
    InputGrad<kRms, T><<<blocks, kRowThreads, 0, stream>>>(dy_v, x_v, gamma_v, mean, rstd, eps, dres_v, vecs, dx_v,
                                                           dx16, rstd_out);
  }
}

template <bool kRms>
void LaunchInputGrad(const void* dy, const void* x, bool x_fp32, const void* gamma, const float* mean,
                     const float* rstd, float eps, const void* dres, int64_t rows, int64_t cols, void* dx,
                     void* dx_bf16, float* rstd_out, cudaStream_t stream) {
  if (x_fp32) {
    LaunchInputGrad<kRms, float>(dy, x, gamma, mean, rstd, eps, dres, rows, cols, dx, dx_bf16, rstd_out, stream);
  } else {
    LaunchInputGrad<kRms, __nv_bfloat16>(dy, x, gamma, mean, rstd, eps, dres, rows, cols, dx, nullptr, rstd_out,
                                         stream);
  }
}

// Blocks of the fused backward: as many as can be resident at once (the grid strides over the
// rows), at most one per kRowThreads / 32 rows.
int SmCount() {
  int device = 0, sms = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  return sms > 0 ? sms : 1;
}

template <typename Kernel>
int64_t FusedBlocks(Kernel kernel, int64_t rows, size_t smem) {
  int per_sm = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kRowThreads, smem) != cudaSuccess || per_sm < 1) {
    cudaGetLastError();
    per_sm = 1;
  }
  const int64_t most = CeilDiv(rows, kRowThreads / 32);
  const int64_t resident = static_cast<int64_t>(SmCount()) * per_sm;
  return resident < most ? resident : most;
}

// The input gradient and the weight (and bias) gradients of narrow rows in one pass (InputGradWarp
// with `partial`), then AddChunkRows over its blocks. False where the rows are too wide for it.
template <bool kRms, typename T>
bool LaunchFusedBackward(const void* dy, const void* x, const void* gamma, const float* mean, const float* rstd,
                         float eps, const void* dres, int64_t rows, int64_t cols, void* dx, void* dx_bf16,
                         float* partial, void* dgamma, void* dbeta, cudaStream_t stream) {
  const int64_t vecs = cols / 8;
  if (vecs > 128) return false;
  if (rows <= 0 || cols <= 0) return true;
  using V = typename Vec8<T>::Type;
  const auto* dy_v = static_cast<const Bf16x8*>(dy);
  const auto* x_v = static_cast<const V*>(x);
  const auto* gamma_v = static_cast<const Bf16x8*>(gamma);
  const auto* dres_v = static_cast<const V*>(dres);
  auto* dx_v = static_cast<V*>(dx);
  auto* dx16 = static_cast<Bf16x8*>(dx_bf16);
  const size_t smem = static_cast<size_t>(kRowThreads / 32) * 2 * cols * sizeof(float);  // up to 64 KiB
  auto launch = [&](auto kernel) {
    cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
    const int64_t blocks = FusedBlocks(kernel, rows, smem);
    kernel<<<static_cast<unsigned>(blocks), kRowThreads, smem, stream>>>(dy_v, x_v, gamma_v, mean, rstd, eps, dres_v,
                                                                        rows, vecs, dx_v, dx16, nullptr, partial);
    LaunchAddChunkRows(partial, blocks, 2 * cols, cols, dgamma, dbeta, stream);
  };
  if (vecs <= 32) {
    launch(InputGradWarp<1, kRms, T>);
  } else if (vecs <= 64) {
    launch(InputGradWarp<2, kRms, T>);
  } else {
    launch(InputGradWarp<4, kRms, T>);
  }
  return true;
}

// The forward of a row of up to kVecs · kRowThreads vectors, held in registers: the layer norm
// y = (x − mean) · rstd · γ + β with the variance summed about the mean (a second pass over the
// registers), mean and rstd written out; the RMS norm (kRms) y = x · rstd · γ, rstd not written.
template <int kVecs, bool kRms, typename T>
__global__ void ForwardHeld(const typename Vec8<T>::Type* x, const Bf16x8* gamma, const Bf16x8* beta, float eps,
                            int64_t vecs, Bf16x8* y, float* mean_out, float* rstd_out) {
  const int64_t row = blockIdx.x;
  const float cols = static_cast<float>(vecs * 8);
  float xv[kVecs][8];
  float sum = 0.f, unused_a = 0.f, unused_b = 0.f;
#pragma unroll
  for (int k = 0; k < kVecs; ++k) {
    const int64_t v = threadIdx.x + static_cast<int64_t>(k) * kRowThreads;
    if (v < vecs) {
      Vec8<T>::Load(x[row * vecs + v], xv[k]);
#pragma unroll
      for (int i = 0; i < 8; ++i) sum += kRms ? xv[k][i] * xv[k][i] : xv[k][i];
    }
  }
  BlockSum3(sum, unused_a, unused_b);
  float m = 0.f, s;
  if (kRms) {
    s = rsqrtf(sum / cols + eps);
  } else {
    m = sum / cols;
    float var = 0.f;
    unused_a = 0.f, unused_b = 0.f;
#pragma unroll
    for (int k = 0; k < kVecs; ++k) {
      const int64_t v = threadIdx.x + static_cast<int64_t>(k) * kRowThreads;
      if (v < vecs) {
#pragma unroll
        for (int i = 0; i < 8; ++i) var += (xv[k][i] - m) * (xv[k][i] - m);
      }
    }
    BlockSum3(var, unused_a, unused_b);
    s = rsqrtf(var / cols + eps);
    if (threadIdx.x == 0) mean_out[row] = m, rstd_out[row] = s;
  }
#pragma unroll
  for (int k = 0; k < kVecs; ++k) {
    const int64_t v = threadIdx.x + static_cast<int64_t>(k) * kRowThreads;
    if (v < vecs) {
      float g[8], b[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f}, out[8];
      Unpack(gamma[v], g);
      if (!kRms) Unpack(beta[v], b);
#pragma unroll
      for (int i = 0; i < 8; ++i) out[i] = (xv[k][i] - m) * s * g[i] + b[i];
      y[row * vecs + v] = Pack(out);
    }
  }
}

// Narrow rows (up to kVecs · 32 vectors): a warp per row, as InputGradWarp.
template <int kVecs, bool kRms, typename T>
__global__ void ForwardWarp(const typename Vec8<T>::Type* x, const Bf16x8* gamma, const Bf16x8* beta, float eps,
                            int64_t rows, int64_t vecs, Bf16x8* y, float* mean_out, float* rstd_out) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * (kRowThreads / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= rows) return;  // the whole warp
  const float cols = static_cast<float>(vecs * 8);
  float xv[kVecs][8];
  float sum = 0.f, unused_a = 0.f, unused_b = 0.f;
#pragma unroll
  for (int k = 0; k < kVecs; ++k) {
    const int64_t v = lane + static_cast<int64_t>(k) * 32;
    if (v < vecs) {
      Vec8<T>::Load(x[row * vecs + v], xv[k]);
#pragma unroll
      for (int i = 0; i < 8; ++i) sum += kRms ? xv[k][i] * xv[k][i] : xv[k][i];
    }
  }
  WarpSum3(sum, unused_a, unused_b);
  float m = 0.f, s;
  if (kRms) {
    s = rsqrtf(sum / cols + eps);
  } else {
    m = sum / cols;
    float var = 0.f;
#pragma unroll
    for (int k = 0; k < kVecs; ++k) {
      const int64_t v = lane + static_cast<int64_t>(k) * 32;
      if (v < vecs) {
#pragma unroll
        for (int i = 0; i < 8; ++i) var += (xv[k][i] - m) * (xv[k][i] - m);
      }
    }
    WarpSum3(var, unused_a, unused_b);
    s = rsqrtf(var / cols + eps);
    if (lane == 0) mean_out[row] = m, rstd_out[row] = s;
  }
#pragma unroll
  for (int k = 0; k < kVecs; ++k) {
    const int64_t v = lane + static_cast<int64_t>(k) * 32;
    if (v < vecs) {
      float g[8], b[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f}, out[8];
      Unpack(gamma[v], g);
      if (!kRms) Unpack(beta[v], b);
#pragma unroll
      for (int i = 0; i < 8; ++i) out[i] = (xv[k][i] - m) * s * g[i] + b[i];
      y[row * vecs + v] = Pack(out);
    }
  }
}

// Wider rows: the same in three passes over the row (the later ones mostly from cache).
template <bool kRms, typename T>
__global__ void Forward(const typename Vec8<T>::Type* x, const Bf16x8* gamma, const Bf16x8* beta, float eps,
                        int64_t vecs, Bf16x8* y, float* mean_out, float* rstd_out) {
  const int64_t row = blockIdx.x;
  const float cols = static_cast<float>(vecs * 8);
  float sum = 0.f, unused_a = 0.f, unused_b = 0.f, xv[8];
  for (int64_t v = threadIdx.x; v < vecs; v += kRowThreads) {
    Vec8<T>::Load(x[row * vecs + v], xv);
#pragma unroll
    for (int i = 0; i < 8; ++i) sum += kRms ? xv[i] * xv[i] : xv[i];
  }
  BlockSum3(sum, unused_a, unused_b);
  float m = 0.f, s;
  if (kRms) {
    s = rsqrtf(sum / cols + eps);
  } else {
    m = sum / cols;
    float var = 0.f;
    unused_a = 0.f, unused_b = 0.f;
    for (int64_t v = threadIdx.x; v < vecs; v += kRowThreads) {
      Vec8<T>::Load(x[row * vecs + v], xv);
#pragma unroll
      for (int i = 0; i < 8; ++i) var += (xv[i] - m) * (xv[i] - m);
    }
    BlockSum3(var, unused_a, unused_b);
    s = rsqrtf(var / cols + eps);
    if (threadIdx.x == 0) mean_out[row] = m, rstd_out[row] = s;
  }
  for (int64_t v = threadIdx.x; v < vecs; v += kRowThreads) {
    float g[8], b[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f}, out[8];
    Vec8<T>::Load(x[row * vecs + v], xv);
    Unpack(gamma[v], g);
    if (!kRms) Unpack(beta[v], b);
#pragma unroll
    for (int i = 0; i < 8; ++i) out[i] = (xv[i] - m) * s * g[i] + b[i];
    y[row * vecs + v] = Pack(out);
  }
}

template <bool kRms, typename T>
void LaunchForward(const void* x, const void* gamma, const void* beta, float eps, int64_t rows, int64_t cols, void* y,
                   float* mean, float* rstd, cudaStream_t stream) {
  if (rows <= 0 || cols <= 0) return;
  using V = typename Vec8<T>::Type;
  const auto* x_v = static_cast<const V*>(x);
  const auto* gamma_v = static_cast<const Bf16x8*>(gamma);
  const auto* beta_v = static_cast<const Bf16x8*>(beta);
  auto* y_v = static_cast<Bf16x8*>(y);
  const int64_t vecs = cols / 8;
  const auto blocks = static_cast<unsigned>(rows);
  const auto warp_blocks = static_cast<unsigned>(CeilDiv(rows, kRowThreads / 32));
  if (vecs <= 32) {
    ForwardWarp<1, kRms, T><<<warp_blocks, kRowThreads, 0, stream>>>(x_v, gamma_v, beta_v, eps, rows, vecs, y_v, mean, rstd);
  } else if (vecs <= 64) {
    ForwardWarp<2, kRms, T><<<warp_blocks, kRowThreads, 0, stream>>>(x_v, gamma_v, beta_v, eps, rows, vecs, y_v, mean, rstd);
  } else if (vecs <= 128) {
    ForwardWarp<4, kRms, T><<<warp_blocks, kRowThreads, 0, stream>>>(x_v, gamma_v, beta_v, eps, rows, vecs, y_v, mean, rstd);
  } else if (vecs <= kRowThreads) {
    ForwardHeld<1, kRms, T><<<blocks, kRowThreads, 0, stream>>>(x_v, gamma_v, beta_v, eps, vecs, y_v, mean, rstd);
  } else if (vecs <= 2 * kRowThreads) {
    ForwardHeld<2, kRms, T><<<blocks, kRowThreads, 0, stream>>>(x_v, gamma_v, beta_v, eps, vecs, y_v, mean, rstd);
  } else if (vecs <= 4 * kRowThreads) {
    ForwardHeld<4, kRms, T><<<blocks, kRowThreads, 0, stream>>>(x_v, gamma_v, beta_v, eps, vecs, y_v, mean, rstd);
  } else {
    Forward<kRms, T><<<blocks, kRowThreads, 0, stream>>>(x_v, gamma_v, beta_v, eps, vecs, y_v, mean, rstd);
  }
}

template <bool kRms>
void LaunchForward(const void* x, bool x_fp32, const void* gamma, const void* beta, float eps, int64_t rows,
                   int64_t cols, void* y, float* mean, float* rstd, cudaStream_t stream) {
  if (x_fp32) {
    LaunchForward<kRms, float>(x, gamma, beta, eps, rows, cols, y, mean, rstd, stream);
  } else {
    LaunchForward<kRms, __nv_bfloat16>(x, gamma, beta, eps, rows, cols, y, mean, rstd, stream);
  }
}

}  // namespace

void LayerNormForward(const void* x, bool x_fp32, const void* gamma, const void* beta, float eps, int64_t rows,
                      int64_t cols, void* y, float* mean, float* rstd, cudaStream_t stream) {
  LaunchForward<false>(x, x_fp32, gamma, beta, eps, rows, cols, y, mean, rstd, stream);
}

void RmsNormForward(const void* x, bool x_fp32, const void* gamma, float eps, int64_t rows, int64_t cols, void* y,
                    cudaStream_t stream) {
  LaunchForward<true>(x, x_fp32, gamma, nullptr, eps, rows, cols, y, nullptr, nullptr, stream);
}

void LayerNormInputGrad(const void* dy, const void* x, bool x_fp32, const void* gamma, const float* mean,
                        const float* rstd, const void* dres, int64_t rows, int64_t cols, void* dx, void* dx_bf16,
                        cudaStream_t stream) {
  LaunchInputGrad<false>(dy, x, x_fp32, gamma, mean, rstd, 0.f, dres, rows, cols, dx, dx_bf16, nullptr, stream);
}

void RmsNormInputGrad(const void* dy, const void* x, bool x_fp32, const void* gamma, float eps, const void* dres,
                      int64_t rows, int64_t cols, void* dx, void* dx_bf16, float* rstd, cudaStream_t stream) {
  LaunchInputGrad<true>(dy, x, x_fp32, gamma, nullptr, nullptr, eps, dres, rows, cols, dx, dx_bf16, rstd, stream);
}

int64_t LayerNormRowChunks(int64_t rows, int64_t cols) { return RowChunks(rows, CeilDiv(cols, kColsPerBlock), kWarps); }

int64_t NormBackwardPartialFloats(int64_t rows, int64_t cols) {
  const int64_t fused = cols / 8 <= 128 ? std::min<int64_t>(CeilDiv(rows, kRowThreads / 32), int64_t{SmCount()} * 8) : 0;
  return std::max(LayerNormPartialFloats(rows, cols), fused * 2 * cols);
}

void LayerNormBackward(const void* dy, const void* x, bool x_fp32, const void* gamma, const float* mean,
                       const float* rstd, const void* dres, int64_t rows, int64_t cols, void* dx, void* dx_bf16,
                       float* partial, void* dgamma, void* dbeta, cudaStream_t stream) {
  const bool fused = x_fp32 ? LaunchFusedBackward<false, float>(dy, x, gamma, mean, rstd, 0.f, dres, rows, cols, dx,
                                                                dx_bf16, partial, dgamma, dbeta, stream)
                            : LaunchFusedBackward<false, __nv_bfloat16>(dy, x, gamma, mean, rstd, 0.f, dres, rows, cols,
                                                                        dx, nullptr, partial, dgamma, dbeta, stream);
  if (fused) return;
  LayerNormInputGrad(dy, x, x_fp32, gamma, mean, rstd, dres, rows, cols, dx, dx_bf16, stream);
  LayerNormParamGrads(dy, x, x_fp32, mean, rstd, rows, cols, partial, dgamma, dbeta, stream);
}

void RmsNormBackward(const void* dy, const void* x, bool x_fp32, const void* gamma, float eps, const void* dres,
                     int64_t rows, int64_t cols, void* dx, void* dx_bf16, float* rstd, float* partial, void* dgamma,
                     cudaStream_t stream) {
  const bool fused = x_fp32 ? LaunchFusedBackward<true, float>(dy, x, gamma, nullptr, nullptr, eps, dres, rows, cols,
                                                               dx, dx_bf16, partial, dgamma, nullptr, stream)
                            : LaunchFusedBackward<true, __nv_bfloat16>(dy, x, gamma, nullptr, nullptr, eps, dres, rows,
                                                                       cols, dx, nullptr, partial, dgamma, nullptr,
                                                                       stream);
  if (fused) return;
  RmsNormInputGrad(dy, x, x_fp32, gamma, eps, dres, rows, cols, dx, dx_bf16, rstd, stream);
  RmsNormWeightGrad(dy, x, x_fp32, rstd, rows, cols, partial, dgamma, stream);
}

void LayerNormParamGrads(const void* dy, const void* x, bool x_fp32, const float* mean, const float* rstd,
                         int64_t rows, int64_t cols, float* partial, void* dgamma, void* dbeta, cudaStream_t stream) {
  if (rows <= 0 || cols <= 0) return;
  const int64_t chunks = LayerNormRowChunks(rows, cols);
  const int64_t rows_per_chunk = CeilDiv(rows, chunks);
  const dim3 grid(static_cast<unsigned>(CeilDiv(cols, kColsPerBlock)), static_cast<unsigned>(chunks));
  const dim3 block(32, kWarps);
  const auto* dy_v = static_cast<const Bf16x8*>(dy);
  if (x_fp32) {
    PartialSums<float><<<grid, block, 0, stream>>>(dy_v, static_cast<const Float8*>(x), mean, rstd, rows, cols / 8,
                                                   rows_per_chunk, partial);
  } else {
    PartialSums<__nv_bfloat16><<<grid, block, 0, stream>>>(dy_v, static_cast<const Bf16x8*>(x), mean, rstd, rows,
                                                           cols / 8, rows_per_chunk, partial);
  }
  LaunchAddChunkRows(partial, chunks, 2 * cols, cols, dgamma, dbeta, stream);
}

void RmsNormWeightGrad(const void* dy, const void* x, bool x_fp32, const float* rstd, int64_t rows, int64_t cols,
                       float* partial, void* dgamma, cudaStream_t stream) {
  LayerNormParamGrads(dy, x, x_fp32, nullptr, rstd, rows, cols, partial, dgamma, nullptr, stream);
}

}  // namespace ltrain::worker::cuda
