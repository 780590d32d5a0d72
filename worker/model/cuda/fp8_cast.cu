// The amax: a grid-stride pass (eight values a 16-byte load where the tensor allows), each block's
// maximum added by AddBlockAmax (bf16x8.cuh), as the kernels that take an amax while they write do.
// The cast: tiles of 128 x 128 values, eight a 16-byte load and an 8-byte store, written by rows and,
// through shared memory and a transpose in registers, by columns for the transposed copy, 16 bytes a
// store (tiles of 32 x 32 one value at a time where the sides or the tensors do not allow it).
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
  AddBlockAmax(m, amax);
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

constexpr int kWideTile = 128;
constexpr int kWideThreads = 256;
constexpr int kWideLoads = kWideTile * kWideTile / 8 / kWideThreads;  // 16-byte loads a thread: 8
constexpr int kWideStride = kWideTile + 4;  // shared memory row in bytes: 4-byte words, banks apart

// A thread's part of a 128 x 128 tile, as the wide kernels read it: columns col to + 7 of rows row,
// row + 16, ..., all eight 16-byte loads in flight; zeros outside the tensor.
__device__ __forceinline__ void LoadWideTile(const __nv_bfloat16* x, int64_t rows, int64_t cols, int64_t row,
                                             int64_t col, uint4 (&loaded)[kWideLoads]) {
#pragma unroll
  for (int k = 0; k < kWideLoads; ++k) {
    const int64_t at = row + 16 * k;
    loaded[k] = at < rows && col < cols ? *reinterpret_cast<const uint4*>(x + at * cols + col) : uint4{};
  }
}

// Cols a multiple of 8, rows of 16 (where out_t is written), x 16-byte, out 8-byte and out_t 16-byte
// aligned: a block per 128 x 128 tile. Tensorwise (kBothWays false): one scale, from amax[0], for out
// and out_t. Both ways: out scaled by its rows (row_amax, row_scale_inv) and out_t by its own rows, x's
// columns (col_amax, col_scale_inv): each value converted twice, once for each.
//
// Rows: thread t converts columns (t % 16) * 8 to + 7 of rows t / 16 + 16 k, k < 8, all eight 16-byte
// loads in flight before the first conversion; each row's 8 bytes are stored at once, a warp's two
// rows of 128 bytes each whole lines.
//
// Transposed: thread t takes the 4 columns 4 (t / 8) to + 3 of rows 16 (t % 8) to + 15 out of shared
// memory as 16 words, transposes them four by four in registers, and stores each column's 16 bytes
// at once: 8 threads write one whole 128-byte row segment of out_t.
template <bool kBothWays>
__global__ void __launch_bounds__(kWideThreads)
    CastWideTiles(const __nv_bfloat16* x, int64_t rows, int64_t cols, const float* amax, const float* col_amax,
                  bool e4m3, bool power_of_2, unsigned char* out, unsigned char* out_t, float* scale_inv,
                  float* col_scale_inv) {
  __shared__ __align__(16) unsigned char tile[kWideTile][kWideStride];
  const float largest = e4m3 ? 448.0f : 57344.0f;
  const float tensor_scale = kBothWays ? 1.0f : ScaleOf(amax[0], largest, power_of_2);
  if (!kBothWays && blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) *scale_inv = 1.0f / tensor_scale;
  const int64_t col0 = blockIdx.x * static_cast<int64_t>(kWideTile);
  const int64_t row0 = blockIdx.y * static_cast<int64_t>(kWideTile);
  const int group = threadIdx.x % 16, r = threadIdx.x / 16;
  const int64_t col = col0 + group * 8;
  // The transposed copy's scales: this thread's eight columns' (cols is a multiple of 8: all in or out).
  float column_scale[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    column_scale[j] = kBothWays && col < cols ? ScaleOf(col_amax[col + j], largest, power_of_2) : tensor_scale;
    if (kBothWays && col < cols && blockIdx.y == 0 && r == 0) col_scale_inv[col + j] = 1.0f / column_scale[j];
  }
  uint4 loaded[kWideLoads];
  LoadWideTile(x, rows, cols, row0 + r, col, loaded);
#pragma unroll
  for (int k = 0; k < kWideLoads; ++k) {
    const int tr = r + 16 * k;
    const int64_t row = row0 + tr;
    float scale = tensor_scale;
    if (kBothWays && row < rows) {
      scale = ScaleOf(amax[row], largest, power_of_2);
      if (blockIdx.x == 0 && group == 0) scale_inv[row] = 1.0f / scale;
    }
    const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&loaded[k]);
    unsigned char q[8], qt[8];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float2 f = __bfloat1622float2(pairs[j]);
      q[2 * j] = ToFp8(f.x * scale, e4m3);
      q[2 * j + 1] = ToFp8(f.y * scale, e4m3);
      if (kBothWays) {
        qt[2 * j] = ToFp8(f.x * column_scale[2 * j], e4m3);
        qt[2 * j + 1] = ToFp8(f.y * column_scale[2 * j + 1], e4m3);
      }
    }
    const uint2 word = Pack8(q);
    if (row < rows && col < cols) *reinterpret_cast<uint2*>(out + row * cols + col) = word;
    if (out_t != nullptr) {
      const uint2 word_t = kBothWays ? Pack8(qt) : word;
      *reinterpret_cast<unsigned*>(&tile[tr][group * 8]) = word_t.x;
      *reinterpret_cast<unsigned*>(&tile[tr][group * 8 + 4]) = word_t.y;
    }
  }
  if (out_t == nullptr) return;
  __syncthreads();
  const int c4 = (threadIdx.x / 8) * 4, r16 = (threadIdx.x % 8) * 16;
  if (row0 + r16 >= rows) return;  // rows is a multiple of 16: these 16 rows are all in, or all out
  // columns[j].{x,y,z,w}: column c4 + j's bytes of rows r16 to + 3, + 4 to + 7, + 8 to + 11, + 12 to + 15.
  unsigned columns[4][4];
#pragma unroll
  for (int quad = 0; quad < 4; ++quad) {
    unsigned w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) w[i] = *reinterpret_cast<const unsigned*>(&tile[r16 + 4 * quad + i][c4]);
    // A 4 x 4 transpose of bytes: __byte_perm picks bytes 0-3 of its first word and 4-7 of its second.
    const unsigned a = __byte_perm(w[0], w[1], 0x5140), b = __byte_perm(w[2], w[3], 0x5140);
    const unsigned c = __byte_perm(w[0], w[1], 0x7362), d = __byte_perm(w[2], w[3], 0x7362);
    columns[0][quad] = __byte_perm(a, b, 0x5410);
    columns[1][quad] = __byte_perm(a, b, 0x7632);
    columns[2][quad] = __byte_perm(c, d, 0x5410);
    columns[3][quad] = __byte_perm(c, d, 0x7632);
  }
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int64_t t_row = col0 + c4 + j;
    if (t_row >= cols) break;
    *reinterpret_cast<uint4*>(out_t + t_row * rows + row0 + r16) =
        make_uint4(columns[j][0], columns[j][1], columns[j][2], columns[j][3]);
  }
}

// Each row's and each column's amax of x (the layout CastWideTiles takes), a block per 128 x 128
// tile: row_amax and col_amax hold 0 before; each tile adds its rows' and its columns' largest
// magnitudes by atomicMax on their bits (read first: most need none). Thread t reads as the cast
// does; a row's 16 threads are half a warp, a column's 16 threads meet in shared memory.
__global__ void __launch_bounds__(kWideThreads)
    RowColAmax(const __nv_bfloat16* x, int64_t rows, int64_t cols, float* row_amax, float* col_amax) {
  __shared__ unsigned warp_columns[kWideThreads / 32][16][4];
  constexpr unsigned kMagnitudes = 0x7fff7fffu;
  const int64_t col0 = blockIdx.x * static_cast<int64_t>(kWideTile);
  const int64_t row0 = blockIdx.y * static_cast<int64_t>(kWideTile);
  const int group = threadIdx.x % 16, r = threadIdx.x / 16;
  const int64_t col = col0 + group * 8;
  uint4 loaded[kWideLoads];
  LoadWideTile(x, rows, cols, row0 + r, col, loaded);
  // Column pairs' magnitudes, two bf16s a word, over this thread's rows.
  unsigned column_pairs[4] = {0, 0, 0, 0};
#pragma unroll
  for (int k = 0; k < kWideLoads; ++k) {
    const unsigned w[4] = {loaded[k].x & kMagnitudes, loaded[k].y & kMagnitudes, loaded[k].z & kMagnitudes,
                           loaded[k].w & kMagnitudes};
#pragma unroll
    for (int i = 0; i < 4; ++i) column_pairs[i] = __vmaxu2(column_pairs[i], w[i]);
    const unsigned m = __vmaxu2(__vmaxu2(w[0], w[1]), __vmaxu2(w[2], w[3]));
    unsigned bits = max(m & 0xffffu, m >> 16) << 16;
#pragma unroll
    for (int offset = 8; offset > 0; offset /= 2) bits = max(bits, __shfl_xor_sync(0xffffffffu, bits, offset));
    const int64_t row = row0 + r + 16 * k;
    unsigned* const held = reinterpret_cast<unsigned*>(row_amax + row);
    if (group == 0 && row < rows && bits > *reinterpret_cast<volatile unsigned*>(held)) atomicMax(held, bits);
  }
  // The warp's two rows of threads (lanes 0-15 and 16-31 share columns), then the block's eight warps.
#pragma unroll
  for (int i = 0; i < 4; ++i) column_pairs[i] = __vmaxu2(column_pairs[i], __shfl_xor_sync(0xffffffffu, column_pairs[i], 16));
  if ((threadIdx.x & 31) < 16) {
#pragma unroll
    for (int i = 0; i < 4; ++i) warp_columns[threadIdx.x / 32][group][i] = column_pairs[i];
  }
  __syncthreads();
  if (threadIdx.x < 64) {
    const int g = threadIdx.x / 4, i = threadIdx.x % 4;
    unsigned pair = 0;
#pragma unroll
    for (int w = 0; w < kWideThreads / 32; ++w) pair = __vmaxu2(pair, warp_columns[w][g][i]);
    const int64_t c = col0 + g * 8 + 2 * i;
    if (c < cols) {
      const unsigned lo = (pair & 0xffffu) << 16, hi = (pair >> 16) << 16;
      unsigned* const held = reinterpret_cast<unsigned*>(col_amax + c);
      if (lo > *reinterpret_cast<volatile unsigned*>(held)) atomicMax(held, lo);
      if (hi > *reinterpret_cast<volatile unsigned*>(held + 1)) atomicMax(held + 1, hi);
    }
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
  // Enough blocks to fill an H100's 132 SMs a few times over (four 16-byte loads a thread in flight);
  // each thread loops over the rest. Each block adds its amax once.
  int64_t blocks = (n + 8191) / 8192;
  if (blocks > 1056) blocks = 1056;
  if (blocks < 1) blocks = 1;
  TensorAmax<<<static_cast<unsigned>(blocks), 256, 0, stream>>>(values, n, n % 8 == 0 && Aligned(x, 16), amax);
}

void Bf16ToFp8(const void* x, int64_t rows, int64_t cols, const float* amax, bool rowwise, bool e4m3, bool power_of_2,
               void* out, void* out_t, float* scale_inv, cudaStream_t stream) {
  if (!rowwise && cols % 8 == 0 && Aligned(x, 16) && Aligned(out, 8) &&
      (out_t == nullptr || (rows % 16 == 0 && Aligned(out_t, 16)))) {
    const dim3 grid(static_cast<unsigned>((cols + kWideTile - 1) / kWideTile),
                    static_cast<unsigned>((rows + kWideTile - 1) / kWideTile));
    CastWideTiles<false><<<grid, kWideThreads, 0, stream>>>(static_cast<const __nv_bfloat16*>(x), rows, cols, amax,
                                                           nullptr, e4m3, power_of_2, static_cast<unsigned char*>(out),
                                                           static_cast<unsigned char*>(out_t), scale_inv, nullptr);
    return;
  }
  const dim3 block(kTile, kTileRows);
  const dim3 grid(static_cast<unsigned>((cols + kTile - 1) / kTile), static_cast<unsigned>((rows + kTile - 1) / kTile));
  CastTiles<<<grid, block, 0, stream>>>(static_cast<const __nv_bfloat16*>(x), rows, cols, amax, rowwise, e4m3,
                                        power_of_2, static_cast<unsigned char*>(out),
                                        rowwise ? nullptr : static_cast<unsigned char*>(out_t), scale_inv);
}

bool Fp8BothWaysTakes(const void* x, int64_t rows, int64_t cols) {
  return rows > 0 && cols > 0 && rows % 16 == 0 && cols % 8 == 0 && Aligned(x, 16);
}

void Bf16ToFp8BothWays(const void* x, int64_t rows, int64_t cols, float* row_amax, float* col_amax, bool e4m3,
                       bool power_of_2, void* out, void* out_t, float* row_scale_inv, float* col_scale_inv,
                       cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>((cols + kWideTile - 1) / kWideTile),
                  static_cast<unsigned>((rows + kWideTile - 1) / kWideTile));
  const auto* values = static_cast<const __nv_bfloat16*>(x);
  RowColAmax<<<grid, kWideThreads, 0, stream>>>(values, rows, cols, row_amax, col_amax);
  CastWideTiles<true><<<grid, kWideThreads, 0, stream>>>(values, rows, cols, row_amax, col_amax, e4m3, power_of_2,
                                                         static_cast<unsigned char*>(out),
                                                         static_cast<unsigned char*>(out_t), row_scale_inv,
                                                         col_scale_inv);
}

}  // namespace ltrain::worker::cuda
