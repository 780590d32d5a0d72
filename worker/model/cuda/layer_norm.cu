// The layer norm's and the RMS norm's forward and backward. The forward's input is bf16 or fp32 (T,
// an fp32 residual stream); dy, the weights, the output and what backward reads of the input are
// bf16; the residual gradient and the input gradient are the stream's dtype (T in backward).
// - Forward and the input gradient: the row held in registers by a warp (up to 1024 columns) or a
//   block (up to 8192), eight columns per thread and 16-byte accesses, the row sums in fp32 across the
//   warp or the block, the residual gradient added on the way out. Wider rows: a block per row, in
//   passes over the row.
// - The weight and bias gradients: where the row is held, from the input gradient's pass (the whole
//   backward reads dy and x once), summed per block in a fixed order; else in a pass of their own,
//   blocks of 256 columns by a chunk of rows summing dy · x̂ and dy in fp32 (each warp over every
//   8th row, then across the warps in shared memory). Either way into per-block partials that a
//   second kernel adds up column by column (AddChunkRows).
// - The RMS norm is the layer norm without centring (mean 0, no bias), its rstd recomputed from the
//   row the input-gradient kernel holds anyway.
#include "worker/model/cuda/layer_norm.h"

#include <algorithm>
#include <type_traits>

#include <cuda_bf16.h>

#include "worker/model/cuda/bf16x8.cuh"

namespace ltrain::worker::cuda {
namespace {

constexpr int kColsPerBlock = 256;  // 32 lanes x 8 columns (one 16-byte vector of dy each)
constexpr int kWarps = 8;

// Per-chunk column sums of dy · x̂ and dy: blocks of 256 columns by a chunk of rows, each warp over
// every 8th row of the chunk with 16-byte loads of dy and x, then across the warps.
__global__ void PartialSums(const Bf16x8* dy, const Bf16x8* x, const float* mean, const float* rstd,
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
      Unpack(x[r * vecs + vec], v);
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

__device__ __forceinline__ float SumOfSquares(const Bf16x8& x) {
  float xv[8], ss = 0.f;
  Unpack(x, xv);
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
// copy; `out` gets them in fp32. Returns the AbsMaxBits of the bf16 gradient a product reads (dx16,
// or a bf16 dx), 0 where there is none.
template <typename T>
__device__ __forceinline__ unsigned WriteInputGrad(const Bf16x8& dy, const Bf16x8& x, const Bf16x8& gamma,
                                                   const float (&r)[8], float m, float s, float mean_g, float mean_gx,
                                                   typename Vec8<T>::Type* dx, Bf16x8* dx16, float (&out)[8]) {
  float d[8], xv[8], g[8];
  Unpack(dy, d);
  Unpack(x, xv);
  Unpack(gamma, g);
#pragma unroll
  for (int i = 0; i < 8; ++i) out[i] = (d[i] * g[i] - mean_g - (xv[i] - m) * s * mean_gx) * s + r[i];
  const typename Vec8<T>::Type stored = Vec8<T>::Store(out);
  *dx = stored;
  if (dx16 != nullptr) {
    const Bf16x8 copy = Pack(out);
    *dx16 = copy;
    return AbsMaxBits(copy);
  }
  if constexpr (std::is_same_v<T, __nv_bfloat16>) return AbsMaxBits(stored);
  return 0;
}

// The same with the residual gradient read from dres (null: none).
template <typename T>
__device__ __forceinline__ unsigned WriteInputGrad(const Bf16x8& dy, const Bf16x8& x, const Bf16x8& gamma,
                                               const typename Vec8<T>::Type* dres, float m, float s, float mean_g,
                                               float mean_gx, typename Vec8<T>::Type* dx, Bf16x8* dx16) {
  float r[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f}, out[8];
  if (dres != nullptr) Vec8<T>::Load(*dres, r);
  return WriteInputGrad<T>(dy, x, gamma, r, m, s, mean_g, mean_gx, dx, dx16, out);
}

__device__ __forceinline__ void AddRowSums(const Bf16x8& dy, const Bf16x8& x, const Bf16x8& gamma, float m, float s,
                                           float& sum_g, float& sum_gx) {
  float d[8], xv[8], g[8];
  Unpack(dy, d);
  Unpack(x, xv);
  Unpack(gamma, g);
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const float wdy = d[i] * g[i];
    sum_g += wdy;
    sum_gx += wdy * (xv[i] - m) * s;
  }
}

// A row's threads: a warp (kLanes 32) or the whole block (kRowThreads); the sums across them.
template <int kLanes>
__device__ __forceinline__ void RowSum3(float& a, float& b, float& c) {
  static_assert(kLanes == 32 || kLanes == kRowThreads, "a row takes a warp or the block");
  if constexpr (kLanes == 32) {
    WarpSum3(a, b, c);
  } else {
    BlockSum3(a, b, c);
  }
}

// Rows of up to kVecs · kLanes vectors, held in registers: each of a row's kLanes threads (a warp, or
// the block) keeps its dy, x and residual gradient between the row sums and the output, so the row is
// read from memory once. A block takes kRowThreads / kLanes rows at a time and the grid strides over
// the rows. The layer norm reads mean and rstd; the RMS norm (kRms) computes rstd and writes it to
// rstd_out.
//
// Where `partial` is not null the weight (and, for the layer norm, bias) gradients' sums are taken
// from the same registers, in a fixed order (no atomics: the same bits every run), and each block
// writes its sums to partial[block] for AddChunkRows:
// - a warp per row: each warp adds its rows' dy · x̂ and dy into a slice of dynamic shared memory of
//   its own (2 · cols floats; each lane to its own columns, element e of vector v at e · vecs + v so
//   that a warp's 32 lanes touch 32 consecutive floats, no bank conflicts), and the block sums the
//   slices in order;
// - a block per row: a thread has the same columns in every row and sums them in registers.
// With kDxSums a third slice sums dx itself (in fp32, before its bf16 copy): the bias gradient of the
// product that wrote x, whose output gradient dx is.
template <int kVecs, int kLanes, bool kRms, typename T, bool kDxSums = false>
__global__ void __launch_bounds__(kRowThreads)
    InputGradRows(const Bf16x8* dy, const Bf16x8* x, const Bf16x8* gamma, const float* mean,
                  const float* rstd, float eps, const typename Vec8<T>::Type* dres, int64_t rows, int64_t vecs,
                  typename Vec8<T>::Type* dx, Bf16x8* dx16, float* rstd_out, float* partial, float* dx_amax) {
  constexpr bool kWarpRow = kLanes == 32;
  constexpr int kRowsAtOnce = kRowThreads / kLanes;
  constexpr int kHeldSums = kWarpRow ? 1 : kVecs;  // a warp per row sums in shared memory instead
  constexpr int kHeldDx = kDxSums ? kHeldSums : 1;
  constexpr int kSlices = kDxSums ? 3 : 2;
  extern __shared__ float param_sums[];  // a warp per row with `partial`: per warp [gamma | beta (| dx)]
  const int lane = threadIdx.x % kLanes;
  const int64_t cols = vecs * 8;
  float* const warp_sums = param_sums + (threadIdx.x / 32) * kSlices * cols;
  float held_g[kHeldSums][8], held_b[kHeldSums][8], held_d[kHeldDx][8];
#pragma unroll
  for (int k = 0; k < kHeldSums; ++k) {
#pragma unroll
    for (int i = 0; i < 8; ++i) held_g[k][i] = 0.f, held_b[k][i] = 0.f;
  }
#pragma unroll
  for (int k = 0; k < kHeldDx; ++k) {
#pragma unroll
    for (int i = 0; i < 8; ++i) held_d[k][i] = 0.f;
  }
  if (kWarpRow && partial != nullptr) {
    for (int64_t i = threadIdx.x; i < kRowsAtOnce * kSlices * cols; i += blockDim.x) param_sums[i] = 0.f;
    __syncthreads();
  }
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kRowsAtOnce;
  unsigned amax_bits = 0;
  // Every thread of a block per row sees the same rows: its barriers are uniform.
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsAtOnce + threadIdx.x / kLanes; row < rows;
       row += stride) {
    const float m = kRms || mean == nullptr ? 0.f : mean[row];
    float s = kRms ? 1.f : rstd[row];
    Bf16x8 dyv[kVecs], xv[kVecs];
    float rv[kVecs][8];
    float sum_g = 0.f, sum_gx = 0.f, sum_xx = 0.f;
#pragma unroll
    for (int k = 0; k < kVecs; ++k) {
      const int64_t v = lane + static_cast<int64_t>(k) * kLanes;
      if (v < vecs) {
        dyv[k] = dy[row * vecs + v];
        xv[k] = x[row * vecs + v];
        // The residual gradient is read with the row, not after its sums: its latency is not exposed.
#pragma unroll
        for (int i = 0; i < 8; ++i) rv[k][i] = 0.f;
        if (dres != nullptr) Vec8<T>::Load(dres[row * vecs + v], rv[k]);
        AddRowSums(dyv[k], xv[k], gamma[v], m, s, sum_g, sum_gx);
        if (kRms) sum_xx += SumOfSquares(xv[k]);
      }
    }
    RowSum3<kLanes>(sum_g, sum_gx, sum_xx);
    float mean_g, mean_gx;
    RowStatistics<kRms>(sum_g, sum_gx, sum_xx, static_cast<float>(cols), eps, row, rstd_out, s, mean_g, mean_gx);
#pragma unroll
    for (int k = 0; k < kVecs; ++k) {
      const int64_t v = lane + static_cast<int64_t>(k) * kLanes;
      if (v < vecs) {
        float dxv[8];
        amax_bits = max(amax_bits, WriteInputGrad<T>(dyv[k], xv[k], gamma[v], rv[k], m, s, mean_g, mean_gx,
                                                     dx + row * vecs + v,
                                                     dx16 != nullptr ? dx16 + row * vecs + v : nullptr, dxv));
        if constexpr (kDxSums) {
#pragma unroll
          for (int i = 0; i < 8; ++i) {
            if constexpr (kWarpRow) {
              warp_sums[2 * cols + i * vecs + v] += dxv[i];
            } else {
              held_d[k][i] += dxv[i];
            }
          }
        }
        if (partial != nullptr) {
          float d[8], xf[8];
          Unpack(dyv[k], d);
          Unpack(xv[k], xf);
#pragma unroll
          for (int i = 0; i < 8; ++i) {
            const float gx = d[i] * (xf[i] - m) * s;
            if constexpr (kWarpRow) {
              warp_sums[i * vecs + v] += gx;
              if (!kRms) warp_sums[cols + i * vecs + v] += d[i];
            } else {
              held_g[k][i] += gx;
              held_b[k][i] += d[i];
            }
          }
        }
      }
    }
  }
  if (dx_amax != nullptr) AddBlockAmax(amax_bits, dx_amax);  // every thread gets here
  if (partial == nullptr) return;
  float* out = partial + static_cast<int64_t>(blockIdx.x) * kSlices * cols;
  if constexpr (kWarpRow) {
    __syncthreads();
    for (int64_t i = threadIdx.x; i < kSlices * cols; i += blockDim.x) {
      float sum = 0.f;
#pragma unroll
      for (int w = 0; w < kRowsAtOnce; ++w) sum += param_sums[w * kSlices * cols + i];
      // Slot i holds column v · 8 + e of its slice (see above).
      const int64_t slice = i / cols, e = (i - slice * cols) / vecs, v = i - slice * cols - e * vecs;
      out[slice * cols + v * 8 + e] = sum;
    }
  } else {
    auto* out_g = reinterpret_cast<Float8*>(out);
    auto* out_b = reinterpret_cast<Float8*>(out + cols);
    auto* out_d = reinterpret_cast<Float8*>(out + 2 * cols);
#pragma unroll
    for (int k = 0; k < kVecs; ++k) {
      const int64_t v = lane + static_cast<int64_t>(k) * kLanes;
      if (v < vecs) {
        out_g[v] = Vec8<float>::Store(held_g[k]);
        if (!kRms) out_b[v] = Vec8<float>::Store(held_b[k]);
        if constexpr (kDxSums) out_d[v] = Vec8<float>::Store(held_d[k]);
      }
    }
  }
}

// Calls f(Int<kVecs>(), Int<kLanes>()) with the shape of InputGradRows and ForwardRows that holds a row
// of `vecs` vectors: a warp per row up to 128 vectors (1024 columns), a block per row up to
// 4 · kRowThreads (8192 columns). False where the rows are wider than that.
template <int N>
using Int = std::integral_constant<int, N>;

template <typename F>
bool WithRowShape(int64_t vecs, F&& f) {
  if (vecs <= 32) {
    f(Int<1>(), Int<32>());
  } else if (vecs <= 64) {
    f(Int<2>(), Int<32>());
  } else if (vecs <= 128) {
    f(Int<4>(), Int<32>());
  } else if (vecs <= kRowThreads) {
    f(Int<1>(), Int<kRowThreads>());
  } else if (vecs <= 2 * kRowThreads) {
    f(Int<2>(), Int<kRowThreads>());
  } else if (vecs <= 4 * kRowThreads) {
    f(Int<4>(), Int<kRowThreads>());
  } else {
    return false;
  }
  return true;
}

// Rows a block of InputGradRows or ForwardRows takes at once for rows of `vecs` vectors.
int64_t RowsAtOnce(int64_t vecs) { return vecs <= 128 ? kRowThreads / 32 : 1; }

// Wider rows: two passes over the row (the second mostly from cache).
template <bool kRms, typename T>
__global__ void InputGrad(const Bf16x8* dy, const Bf16x8* x, const Bf16x8* gamma, const float* mean,
                          const float* rstd, float eps, const typename Vec8<T>::Type* dres, int64_t vecs,
                          typename Vec8<T>::Type* dx, Bf16x8* dx16, float* rstd_out, float* dx_amax) {
  const int64_t row = blockIdx.x;
  const float m = kRms || mean == nullptr ? 0.f : mean[row];
  float s = kRms ? 1.f : rstd[row];
  float sum_g = 0.f, sum_gx = 0.f, sum_xx = 0.f;
  for (int64_t v = threadIdx.x; v < vecs; v += kRowThreads) {
    AddRowSums(dy[row * vecs + v], x[row * vecs + v], gamma[v], m, s, sum_g, sum_gx);
    if (kRms) sum_xx += SumOfSquares(x[row * vecs + v]);
  }
  BlockSum3(sum_g, sum_gx, sum_xx);
  float mean_g, mean_gx;
  RowStatistics<kRms>(sum_g, sum_gx, sum_xx, static_cast<float>(vecs * 8), eps, row, rstd_out, s, mean_g, mean_gx);
  unsigned amax_bits = 0;
  for (int64_t v = threadIdx.x; v < vecs; v += kRowThreads) {
    amax_bits = max(amax_bits, WriteInputGrad<T>(dy[row * vecs + v], x[row * vecs + v], gamma[v],
                                                 dres != nullptr ? dres + row * vecs + v : nullptr, m, s, mean_g,
                                                 mean_gx, dx + row * vecs + v,
                                                 dx16 != nullptr ? dx16 + row * vecs + v : nullptr));
  }
  if (dx_amax != nullptr) AddBlockAmax(amax_bits, dx_amax);
}

template <bool kRms, typename T>
void LaunchInputGrad(const void* dy, const void* x, const void* gamma, const float* mean, const float* rstd, float eps,
                     const void* dres, int64_t rows, int64_t cols, void* dx, void* dx_bf16, float* rstd_out,
                     float* dx_amax, cudaStream_t stream) {
  if (rows <= 0 || cols <= 0) return;
  using V = typename Vec8<T>::Type;
  auto* dx16 = static_cast<Bf16x8*>(dx_bf16);
  const auto* dy_v = static_cast<const Bf16x8*>(dy);
  const auto* x_v = static_cast<const Bf16x8*>(x);
  const auto* gamma_v = static_cast<const Bf16x8*>(gamma);
  const auto* dres_v = static_cast<const V*>(dres);
  auto* dx_v = static_cast<V*>(dx);
  const int64_t vecs = cols / 8;
  const bool held = WithRowShape(vecs, [&](auto held_vecs, auto lanes) {
    const auto blocks = static_cast<unsigned>(CeilDiv(rows, RowsAtOnce(vecs)));
    InputGradRows<decltype(held_vecs)::value, decltype(lanes)::value, kRms, T><<<blocks, kRowThreads, 0, stream>>>(
        dy_v, x_v, gamma_v, mean, rstd, eps, dres_v, rows, vecs, dx_v, dx16, rstd_out, nullptr, dx_amax);
  });
  if (!held) {
    InputGrad<kRms, T><<<static_cast<unsigned>(rows), kRowThreads, 0, stream>>>(
        dy_v, x_v, gamma_v, mean, rstd, eps, dres_v, vecs, dx_v, dx16, rstd_out, dx_amax);
  }
}

template <bool kRms>
void LaunchInputGrad(const void* dy, const void* x, bool fp32_grads, const void* gamma, const float* mean,
                     const float* rstd, float eps, const void* dres, int64_t rows, int64_t cols, void* dx,
                     void* dx_bf16, float* rstd_out, float* dx_amax, cudaStream_t stream) {
  if (fp32_grads) {
    LaunchInputGrad<kRms, float>(dy, x, gamma, mean, rstd, eps, dres, rows, cols, dx, dx_bf16, rstd_out, dx_amax,
                                 stream);
  } else {
    LaunchInputGrad<kRms, __nv_bfloat16>(dy, x, gamma, mean, rstd, eps, dres, rows, cols, dx, nullptr, rstd_out,
                                         dx_amax, stream);
  }
}

// Blocks of the fused backward: as many as can be resident at once (the grid strides over the
// rows), at most one per `rows_at_once` rows.
int SmCount() {
  int device = 0, sms = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  return sms > 0 ? sms : 1;
}

// The most blocks of kRowThreads an SM holds at once (2048 threads).
constexpr int kMostBlocksPerSm = 2048 / kRowThreads;

template <typename Kernel>
int64_t FusedBlocks(Kernel kernel, int64_t rows, int64_t rows_at_once, size_t smem) {
  int per_sm = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kRowThreads, smem) != cudaSuccess || per_sm < 1) {
    cudaGetLastError();
    per_sm = 1;
  }
  const int64_t most = CeilDiv(rows, rows_at_once);
  const int64_t resident = static_cast<int64_t>(SmCount()) * std::min(per_sm, kMostBlocksPerSm);
  return resident < most ? resident : most;
}

// The input gradient and the weight (and bias) gradients in one pass (InputGradRows with
// `partial`), then AddChunkRows over its blocks. False where the rows are too wide to be held. With
// dx_sums (an fp32 stream's layer norm only), the pass also sums dx into the partials' third slice
// and *dx_sums gets the number of blocks that wrote one.
template <bool kRms, typename T>
bool LaunchFusedBackward(const void* dy, const void* x, const void* gamma, const float* mean, const float* rstd,
                         float eps, const void* dres, int64_t rows, int64_t cols, void* dx, void* dx_bf16,
                         float* partial, void* dgamma, void* dbeta, cudaStream_t stream, bool accumulate,
                         float* dx_amax, int64_t* dx_sums = nullptr) {
  const int64_t vecs = cols / 8;
  if (vecs > 4 * kRowThreads) return false;
  if (rows <= 0 || cols <= 0) return true;
  using V = typename Vec8<T>::Type;
  const auto* dy_v = static_cast<const Bf16x8*>(dy);
  const auto* x_v = static_cast<const Bf16x8*>(x);
  const auto* gamma_v = static_cast<const Bf16x8*>(gamma);
  const auto* dres_v = static_cast<const V*>(dres);
  auto* dx_v = static_cast<V*>(dx);
  auto* dx16 = static_cast<Bf16x8*>(dx_bf16);
  return WithRowShape(vecs, [&](auto held_vecs, auto lanes) {
    constexpr int kLanes = decltype(lanes)::value;
    auto launch = [&](auto with_dx_sums) {
      constexpr bool kDxSums = decltype(with_dx_sums)::value;
      constexpr int kSlices = kDxSums ? 3 : 2;
      auto kernel = InputGradRows<decltype(held_vecs)::value, kLanes, kRms, T, kDxSums>;
      // A warp per row sums in shared memory, a slice per warp (up to 96 KiB); a block per row in registers.
      const size_t smem = kLanes == 32 ? static_cast<size_t>(kRowThreads / 32) * kSlices * cols * sizeof(float) : 0;
      if (smem > 0) cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
      const int64_t blocks = FusedBlocks(kernel, rows, RowsAtOnce(vecs), smem);
      kernel<<<static_cast<unsigned>(blocks), kRowThreads, smem, stream>>>(dy_v, x_v, gamma_v, mean, rstd, eps, dres_v,
                                                                          rows, vecs, dx_v, dx16, nullptr, partial,
                                                                          dx_amax);
      LaunchAddChunkRows(partial, blocks, kSlices * cols, cols, dgamma, dbeta, stream, accumulate);
      if constexpr (kDxSums) *dx_sums = blocks;
    };
    if constexpr (!kRms && std::is_same_v<T, float>) {
      if (dx_sums != nullptr) return launch(std::true_type());
    }
    launch(std::false_type());
  });
}

// The forward of rows of up to kVecs · kLanes vectors, held in registers by the row's threads (a
// warp or the block, as InputGradRows): the layer norm y = (x − mean) · rstd · γ + β with the
// variance summed about the mean (a second pass over the registers), mean and rstd written out; the
// RMS norm (kRms) y = x · rstd · γ, rstd not written.
template <int kVecs, int kLanes, bool kRms, typename T>
__global__ void __launch_bounds__(kRowThreads)
    ForwardRows(const typename Vec8<T>::Type* x, const Bf16x8* gamma, const Bf16x8* beta, float eps, int64_t rows,
                int64_t vecs, Bf16x8* y, float* mean_out, float* rstd_out, Bf16x8* saved, float* amax) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * (kRowThreads / kLanes) + threadIdx.x / kLanes;
  const int lane = threadIdx.x % kLanes;
  if (row >= rows) return;  // the whole warp, or the whole block
  const float cols = static_cast<float>(vecs * 8);
  float xv[kVecs][8];
  float sum = 0.f, unused_a = 0.f, unused_b = 0.f;
#pragma unroll
  for (int k = 0; k < kVecs; ++k) {
    const int64_t v = lane + static_cast<int64_t>(k) * kLanes;
    if (v < vecs) {
      Vec8<T>::Load(x[row * vecs + v], xv[k]);
#pragma unroll
      for (int i = 0; i < 8; ++i) sum += kRms ? xv[k][i] * xv[k][i] : xv[k][i];
    }
  }
  RowSum3<kLanes>(sum, unused_a, unused_b);
  float m = 0.f, s;
  if (kRms) {
    s = rsqrtf(sum / cols + eps);
  } else {
    m = sum / cols;
    float var = 0.f;
    unused_a = 0.f, unused_b = 0.f;
#pragma unroll
    for (int k = 0; k < kVecs; ++k) {
      const int64_t v = lane + static_cast<int64_t>(k) * kLanes;
      if (v < vecs) {
#pragma unroll
        for (int i = 0; i < 8; ++i) var += (xv[k][i] - m) * (xv[k][i] - m);
      }
    }
    RowSum3<kLanes>(var, unused_a, unused_b);
    s = rsqrtf(var / cols + eps);
    if (lane == 0) mean_out[row] = m, rstd_out[row] = s;
  }
  unsigned amax_bits = 0;
#pragma unroll
  for (int k = 0; k < kVecs; ++k) {
    const int64_t v = lane + static_cast<int64_t>(k) * kLanes;
    if (v < vecs) {
      float g[8], b[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f}, out[8];
      Unpack(gamma[v], g);
      if (!kRms) Unpack(beta[v], b);
#pragma unroll
      for (int i = 0; i < 8; ++i) out[i] = (xv[k][i] - m) * s * g[i] + b[i];
      const Bf16x8 yv = Pack(out);
      y[row * vecs + v] = yv;
      amax_bits = max(amax_bits, AbsMaxBits(yv));
      if (saved != nullptr) {
#pragma unroll
        for (int i = 0; i < 8; ++i) out[i] = xv[k][i] - m;
        saved[row * vecs + v] = Pack(out);
      }
    }
  }
  if (amax != nullptr) {
    // A row a block: its threads all got here (the block's rows end together); a warp a row: not.
    if constexpr (kLanes == kRowThreads) {
      AddBlockAmax(amax_bits, amax);
    } else {
      AddWarpAmax(amax_bits, amax);
    }
  }
}

// Wider rows: the same in three passes over the row (the later ones mostly from cache).
template <bool kRms, typename T>
__global__ void Forward(const typename Vec8<T>::Type* x, const Bf16x8* gamma, const Bf16x8* beta, float eps,
                        int64_t vecs, Bf16x8* y, float* mean_out, float* rstd_out, Bf16x8* saved, float* amax) {
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
  unsigned amax_bits = 0;
  for (int64_t v = threadIdx.x; v < vecs; v += kRowThreads) {
    float g[8], b[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f}, out[8];
    Vec8<T>::Load(x[row * vecs + v], xv);
    Unpack(gamma[v], g);
    if (!kRms) Unpack(beta[v], b);
#pragma unroll
    for (int i = 0; i < 8; ++i) out[i] = (xv[i] - m) * s * g[i] + b[i];
    const Bf16x8 yv = Pack(out);
    y[row * vecs + v] = yv;
    amax_bits = max(amax_bits, AbsMaxBits(yv));
    if (saved != nullptr) {
#pragma unroll
      for (int i = 0; i < 8; ++i) out[i] = xv[i] - m;
      saved[row * vecs + v] = Pack(out);
    }
  }
  if (amax != nullptr) AddBlockAmax(amax_bits, amax);
}

template <bool kRms, typename T>
void LaunchForward(const void* x, const void* gamma, const void* beta, float eps, int64_t rows, int64_t cols, void* y,
                   float* mean, float* rstd, void* saved, float* amax, cudaStream_t stream) {
  if (rows <= 0 || cols <= 0) return;
  using V = typename Vec8<T>::Type;
  const auto* x_v = static_cast<const V*>(x);
  const auto* gamma_v = static_cast<const Bf16x8*>(gamma);
  const auto* beta_v = static_cast<const Bf16x8*>(beta);
  auto* y_v = static_cast<Bf16x8*>(y);
  auto* saved_v = static_cast<Bf16x8*>(saved);
  const int64_t vecs = cols / 8;
  const bool held = WithRowShape(vecs, [&](auto held_vecs, auto lanes) {
    const auto blocks = static_cast<unsigned>(CeilDiv(rows, RowsAtOnce(vecs)));
    ForwardRows<decltype(held_vecs)::value, decltype(lanes)::value, kRms, T>
        <<<blocks, kRowThreads, 0, stream>>>(x_v, gamma_v, beta_v, eps, rows, vecs, y_v, mean, rstd, saved_v, amax);
  });
  if (!held) {
    Forward<kRms, T><<<static_cast<unsigned>(rows), kRowThreads, 0, stream>>>(x_v, gamma_v, beta_v, eps, vecs, y_v,
                                                                              mean, rstd, saved_v, amax);
  }
}

template <bool kRms>
void LaunchForward(const void* x, bool x_fp32, const void* gamma, const void* beta, float eps, int64_t rows,
                   int64_t cols, void* y, float* mean, float* rstd, void* saved, float* amax, cudaStream_t stream) {
  if (x_fp32) {
    LaunchForward<kRms, float>(x, gamma, beta, eps, rows, cols, y, mean, rstd, saved, amax, stream);
  } else {
    LaunchForward<kRms, __nv_bfloat16>(x, gamma, beta, eps, rows, cols, y, mean, rstd, saved, amax, stream);
  }
}

}  // namespace

void LayerNormForward(const void* x, bool x_fp32, const void* gamma, const void* beta, float eps, int64_t rows,
                      int64_t cols, void* y, float* mean, float* rstd, void* saved, cudaStream_t stream, float* amax) {
  LaunchForward<false>(x, x_fp32, gamma, beta, eps, rows, cols, y, mean, rstd, saved, amax, stream);
}

void RmsNormForward(const void* x, bool x_fp32, const void* gamma, float eps, int64_t rows, int64_t cols, void* y,
                    void* saved, cudaStream_t stream, float* amax) {
  LaunchForward<true>(x, x_fp32, gamma, nullptr, eps, rows, cols, y, nullptr, nullptr, saved, amax, stream);
}

void LayerNormInputGrad(const void* dy, const void* x, bool fp32_grads, const void* gamma, const float* mean,
                        const float* rstd, const void* dres, int64_t rows, int64_t cols, void* dx, void* dx_bf16,
                        cudaStream_t stream, float* dx_amax) {
  LaunchInputGrad<false>(dy, x, fp32_grads, gamma, mean, rstd, 0.f, dres, rows, cols, dx, dx_bf16, nullptr, dx_amax,
                         stream);
}

void RmsNormInputGrad(const void* dy, const void* x, bool fp32_grads, const void* gamma, float eps, const void* dres,
                      int64_t rows, int64_t cols, void* dx, void* dx_bf16, float* rstd, cudaStream_t stream,
                      float* dx_amax) {
  LaunchInputGrad<true>(dy, x, fp32_grads, gamma, nullptr, nullptr, eps, dres, rows, cols, dx, dx_bf16, rstd, dx_amax,
                        stream);
}

int64_t LayerNormRowChunks(int64_t rows, int64_t cols) { return RowChunks(rows, CeilDiv(cols, kColsPerBlock), kWarps); }

int64_t NormBackwardPartialFloats(int64_t rows, int64_t cols, bool dx_sums) {
  const int64_t vecs = cols / 8;
  const int64_t fused =
      vecs <= 4 * kRowThreads ? std::min<int64_t>(CeilDiv(rows, RowsAtOnce(vecs)), int64_t{SmCount()} * kMostBlocksPerSm)
                              : 0;
  return std::max(LayerNormPartialFloats(rows, cols), fused * (dx_sums ? 3 : 2) * cols);
}

void LayerNormBackward(const void* dy, const void* x, bool fp32_grads, const void* gamma, const float* mean,
                       const float* rstd, const void* dres, int64_t rows, int64_t cols, void* dx, void* dx_bf16,
                       float* partial, void* dgamma, void* dbeta, cudaStream_t stream, bool accumulate_params,
                       int64_t* dx_sums, float* dx_amax) {
  if (dx_sums != nullptr) *dx_sums = 0;
  const bool fused =
      fp32_grads ? LaunchFusedBackward<false, float>(dy, x, gamma, mean, rstd, 0.f, dres, rows, cols, dx, dx_bf16, partial,
                                                     dgamma, dbeta, stream, accumulate_params, dx_amax, dx_sums)
                 : LaunchFusedBackward<false, __nv_bfloat16>(dy, x, gamma, mean, rstd, 0.f, dres, rows, cols, dx, nullptr,
                                                             partial, dgamma, dbeta, stream, accumulate_params, dx_amax);
  if (fused) return;
  LayerNormInputGrad(dy, x, fp32_grads, gamma, mean, rstd, dres, rows, cols, dx, dx_bf16, stream, dx_amax);
  LayerNormParamGrads(dy, x, mean, rstd, rows, cols, partial, dgamma, dbeta, stream, accumulate_params);
}

void RmsNormBackward(const void* dy, const void* x, bool fp32_grads, const void* gamma, float eps, const void* dres,
                     int64_t rows, int64_t cols, void* dx, void* dx_bf16, float* rstd, float* partial, void* dgamma,
                     cudaStream_t stream, bool accumulate_params, float* dx_amax) {
  const bool fused =
      fp32_grads ? LaunchFusedBackward<true, float>(dy, x, gamma, nullptr, nullptr, eps, dres, rows, cols, dx, dx_bf16,
                                                    partial, dgamma, nullptr, stream, accumulate_params, dx_amax)
                 : LaunchFusedBackward<true, __nv_bfloat16>(dy, x, gamma, nullptr, nullptr, eps, dres, rows, cols, dx,
                                                            nullptr, partial, dgamma, nullptr, stream, accumulate_params,
                                                            dx_amax);
  if (fused) return;
  RmsNormInputGrad(dy, x, fp32_grads, gamma, eps, dres, rows, cols, dx, dx_bf16, rstd, stream, dx_amax);
  RmsNormWeightGrad(dy, x, rstd, rows, cols, partial, dgamma, stream, accumulate_params);
}

void LayerNormParamGrads(const void* dy, const void* x, const float* mean, const float* rstd, int64_t rows,
                         int64_t cols, float* partial, void* dgamma, void* dbeta, cudaStream_t stream, bool accumulate) {
  if (rows <= 0 || cols <= 0) return;
  const int64_t chunks = LayerNormRowChunks(rows, cols);
  const int64_t rows_per_chunk = CeilDiv(rows, chunks);
  const dim3 grid(static_cast<unsigned>(CeilDiv(cols, kColsPerBlock)), static_cast<unsigned>(chunks));
  const dim3 block(32, kWarps);
  PartialSums<<<grid, block, 0, stream>>>(static_cast<const Bf16x8*>(dy), static_cast<const Bf16x8*>(x), mean, rstd,
                                          rows, cols / 8, rows_per_chunk, partial);
  LaunchAddChunkRows(partial, chunks, 2 * cols, cols, dgamma, dbeta, stream, accumulate);
}

void RmsNormWeightGrad(const void* dy, const void* x, const float* rstd, int64_t rows, int64_t cols, float* partial,
                       void* dgamma, cudaStream_t stream, bool accumulate) {
  LayerNormParamGrads(dy, x, nullptr, rstd, rows, cols, partial, dgamma, nullptr, stream, accumulate);
}

void AddDxSums(const float* partial, int64_t chunks, int64_t cols, void* out, cudaStream_t stream, bool accumulate) {
  LaunchAddChunkRows(partial + 2 * cols, chunks, 3 * cols, cols, out, nullptr, stream, accumulate);
}

}  // namespace ltrain::worker::cuda
