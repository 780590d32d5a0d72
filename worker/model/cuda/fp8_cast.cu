// The amax: a grid-stride pass (eight values a 16-byte load where the tensor allows), each warp's
// maximum added by AddWarpAmax (bf16x8.cuh), as the kernels that take an amax while they write do. The cast: tiles of 64 x 64
// values, eight a 16-byte load and an 8-byte store, written by rows and, through shared memory, by
// columns for the transposed copy (tiles of 32 x 32 one value at a time where the sides are not
// multiples of 8 or the tensors not aligned).
#include "worker/model/cuda/fp8_cast.h"

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include "worker/model/cuda/bf16x8.cuh"

namespace ltrain::worker::cuda {
namespace {

constexpr int kTile = 32;
constexpr int kTileRows = 8;  // threads per tile column: each thread does kTile / kTileRows rows

__device__ __forceinline__ float WarpMax(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

// |v| with NaN kept (fmaxf would drop it).
__device__ __forceinline__ float MaxKeepNan(float a, float b) { return (isnan(a) || isnan(b)) ? NAN : fmaxf(a, b); }

__global__ void TensorAmax(const __nv_bfloat16* x, int64_t n, bool vector, float* amax) {
  unsigned m = 0;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  if (vector) {
    // n is a multiple of 8 and x 16-byte aligned: four 16-byte loads in flight a thread.
    const Bf16x8* v = reinterpret_cast<const Bf16x8*>(x);
    const int64_t vectors = n / 8;
    for (int64_t base = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; base < vectors;
         base += 4 * stride) {
      Bf16x8 packed[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int64_t i = base + u * stride;
        packed[u] = i < vectors ? v[i] : Bf16x8{};
      }
#pragma unroll
      for (int u = 0; u < 4; ++u) m = max(m, AbsMaxBits(packed[u]));
    }
  } else {
    for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n; i += stride) {
      m = max(m, AbsMaxBits(x[i]));
    }
  }
  AddWarpAmax(m, amax);
}

// One warp per row.
__global__ void RowAmax(const __nv_bfloat16* x, int64_t rows, int64_t cols, float* amax) {
  const int64_t row = blockIdx.x * static_cast<int64_t>(blockDim.x / 32) + threadIdx.x / 32;
  if (row >= rows) return;
  const int lane = threadIdx.x & 31;
  float m = 0.0f;
  for (int64_t c = lane; c < cols; c += 32) m = MaxKeepNan(m, fabsf(__bfloat162float(x[row * cols + c])));
  const bool nan = __any_sync(0xffffffffu, isnan(m));
  m = nan ? NAN : WarpMax(m);
  if (lane == 0) amax[row] = m;
}

__device__ __forceinline__ float ScaleOf(float amax, float largest, bool power_of_2) {
  if (isnan(amax) || isinf(amax)) return NAN;  // an overflow: said by the amax, never hidden as 0
  if (amax < largest * 1e-12f) return 1.0f;
  float scale = largest / amax;
  if (power_of_2) scale = exp2f(floorf(log2f(scale)));
  return scale;
}

__device__ __forceinline__ unsigned char ToFp8(float v, bool e4m3) {
  return __nv_cvt_float_to_fp8(v, __NV_SATFINITE, e4m3 ? __NV_E4M3 : __NV_E5M2);
}

// Block (kTile, kTileRows) per 32 x 32 tile: thread (tx, ty) handles column tx of rows ty, ty + 8, ...
__global__ void CastTiles(const __nv_bfloat16* x, int64_t rows, int64_t cols, const float* amax, bool rowwise,
                          bool e4m3, bool power_of_2, unsigned char* out, unsigned char* out_t, float* scale_inv) {
  __shared__ unsigned char tile[kTile][kTile + 4];
  const float largest = e4m3 ? 448.0f : 57344.0f;
  const int64_t col = blockIdx.x * static_cast<int64_t>(kTile) + threadIdx.x;
  const int64_t row0 = blockIdx.y * static_cast<int64_t>(kTile);
  const float tensor_scale = rowwise ? 1.0f : ScaleOf(amax[0], largest, power_of_2);
  if (!rowwise && blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0 && threadIdx.y == 0) {
    *scale_inv = 1.0f / tensor_scale;
  }
#pragma unroll
  for (int i = 0; i < kTile / kTileRows; ++i) {
    const int r = threadIdx.y + i * kTileRows;
    const int64_t row = row0 + r;
    if (row < rows && col < cols) {
      const float scale = rowwise ? ScaleOf(amax[row], largest, power_of_2) : tensor_scale;
      if (rowwise && col == 0) scale_inv[row] = 1.0f / scale;
      const unsigned char q = ToFp8(__bfloat162float(x[row * cols + col]) * scale, e4m3);
      out[row * cols + col] = q;
      tile[r][threadIdx.x] = q;
    }
  }
  if (out_t == nullptr) return;
  __syncthreads();
  // Transposed: thread (tx, ty) writes row (col0 + ty + 8i) of out_t, column row0 + tx.
  const int64_t t_row_col = row0 + threadIdx.x;
#pragma unroll
  for (int i = 0; i < kTile / kTileRows; ++i) {
    const int c = threadIdx.y + i * kTileRows;
    const int64_t t_row = blockIdx.x * static_cast<int64_t>(kTile) + c;
    if (t_row < cols && t_row_col < rows) out_t[t_row * rows + t_row_col] = tile[threadIdx.x][c];
  }
}

// Eight bytes, the first lowest, as one 8-byte word.
__device__ __forceinline__ uint2 Pack8(const unsigned char (&q)[8]) {
  uint2 word;
  word.x = q[0] | (q[1] << 8) | (q[2] << 16) | (static_cast<unsigned>(q[3]) << 24);
  word.y = q[4] | (q[5] << 8) | (q[6] << 16) | (static_cast<unsigned>(q[7]) << 24);
  return word;
}

constexpr int kWideTile = 64;
constexpr int kWideThreads = 256;     // 8 groups of 8 columns x 32 rows
constexpr int kWideStride = kWideTile + 4;  // shared memory row: 4-byte aligned, fewer bank conflicts

// Tensorwise, cols and rows multiples of 8, x 16-byte and out/out_t 8-byte aligned: a block per
// 64 x 64 tile; thread t converts rows t / 8 and t / 8 + 32, columns (t % 8) * 8 to + 7.
__global__ void CastWideTiles(const __nv_bfloat16* x, int64_t rows, int64_t cols, const float* amax, bool e4m3,
                              bool power_of_2, unsigned char* out, unsigned char* out_t, float* scale_inv) {
  __shared__ __align__(8) unsigned char tile[kWideTile][kWideStride];
  const float largest = e4m3 ? 448.0f : 57344.0f;
  const float scale = ScaleOf(amax[0], largest, power_of_2);
  if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) *scale_inv = 1.0f / scale;
  const int64_t col0 = blockIdx.x * static_cast<int64_t>(kWideTile), row0 = blockIdx.y * static_cast<int64_t>(kWideTile);
  const int group = threadIdx.x % 8, r = threadIdx.x / 8;
  const int64_t col = col0 + group * 8;
  // Both rows' loads first, so that both are in flight before the first store.
  uint4 loaded[2];
#pragma unroll
  for (int pass = 0; pass < 2; ++pass) {
    const int64_t row = row0 + r + 32 * pass;
    loaded[pass] = row < rows && col < cols ? *reinterpret_cast<const uint4*>(x + row * cols + col) : uint4{};
  }
#pragma unroll
  for (int pass = 0; pass < 2; ++pass) {
    const int tr = r + 32 * pass;
    const int64_t row = row0 + tr;
    if (row >= rows || col >= cols) continue;
    const uint4 packed = loaded[pass];
    const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&packed);
    unsigned char q[8];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float2 f = __bfloat1622float2(pairs[j]);
      q[2 * j] = ToFp8(f.x * scale, e4m3);
      q[2 * j + 1] = ToFp8(f.y * scale, e4m3);
    }
    const uint2 word = Pack8(q);
    *reinterpret_cast<uint2*>(out + row * cols + col) = word;
    if (out_t != nullptr) {
      *reinterpret_cast<unsigned*>(&tile[tr][group * 8]) = word.x;
      *reinterpret_cast<unsigned*>(&tile[tr][group * 8 + 4]) = word.y;
    }
  }
  if (out_t == nullptr) return;
  __syncthreads();
  // Transposed: thread t writes 8 bytes of out_t's row col0 + t / 8 (+ 32): columns row0 + (t % 8) * 8 to + 7.
#pragma unroll
  for (int pass = 0; pass < 2; ++pass) {
    const int tc = r + 32 * pass;
    const int64_t t_row = col0 + tc, t_col = row0 + group * 8;
    if (t_row >= cols || t_col >= rows) continue;
    unsigned char q[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) q[j] = tile[group * 8 + j][tc];
    const uint2 word = Pack8(q);
    *reinterpret_cast<uint2*>(out_t + t_row * rows + t_col) = word;
  }
}

bool Aligned(const void* p, uintptr_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

}  // namespace

void Bf16Amax(const void* x, int64_t rows, int64_t cols, bool rowwise, float* amax, cudaStream_t stream) {
  const auto* values = static_cast<const __nv_bfloat16*>(x);
  if (rowwise) {
    constexpr int kWarpsPerBlock = 8;
    const int64_t blocks = (rows + kWarpsPerBlock - 1) / kWarpsPerBlock;
    RowAmax<<<static_cast<unsigned>(blocks), kWarpsPerBlock * 32, 0, stream>>>(values, rows, cols, amax);
    return;
  }
  const int64_t n = rows * cols;
  // Enough blocks to fill an H100's 132 SMs several times over; each thread loops over the rest.
  int64_t blocks = (n + 2047) / 2048;
  if (blocks > 2048) blocks = 2048;
  if (blocks < 1) blocks = 1;
  TensorAmax<<<static_cast<unsigned>(blocks), 256, 0, stream>>>(values, n, n % 8 == 0 && Aligned(x, 16), amax);
}

void Bf16ToFp8(const void* x, int64_t rows, int64_t cols, const float* amax, bool rowwise, bool e4m3, bool power_of_2,
               void* out, void* out_t, float* scale_inv, cudaStream_t stream) {
  if (!rowwise && rows % 8 == 0 && cols % 8 == 0 && Aligned(x, 16) && Aligned(out, 8) &&
      (out_t == nullptr || Aligned(out_t, 8))) {
    const dim3 grid(static_cast<unsigned>((cols + kWideTile - 1) / kWideTile),
                    static_cast<unsigned>((rows + kWideTile - 1) / kWideTile));
    CastWideTiles<<<grid, kWideThreads, 0, stream>>>(static_cast<const __nv_bfloat16*>(x), rows, cols, amax, e4m3,
                                                    power_of_2, static_cast<unsigned char*>(out),
                                                    static_cast<unsigned char*>(out_t), scale_inv);
    return;
  }
  const dim3 block(kTile, kTileRows);
  const dim3 grid(static_cast<unsigned>((cols + kTile - 1) / kTile), static_cast<unsigned>((rows + kTile - 1) / kTile));
  CastTiles<<<grid, block, 0, stream>>>(static_cast<const __nv_bfloat16*>(x), rows, cols, amax, rowwise, e4m3,
                                        power_of_2, static_cast<unsigned char*>(out),
                                        rowwise ? nullptr : static_cast<unsigned char*>(out_t), scale_inv);
}

}  // namespace ltrain::worker::cuda
