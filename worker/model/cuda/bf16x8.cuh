// What the worker's memory-bound kernels share: eight bf16 values moved in one 16-byte access (eight
// fp32 values in two), and the grid arithmetic of their two-pass column reductions. Plain CUDA, no
// LibTorch.
#pragma once

#include <cstdint>

#include <cuda_bf16.h>

namespace ltrain::worker::cuda {

struct alignas(16) Bf16x8 {
  __nv_bfloat162 v[4];
};

__device__ __forceinline__ void Unpack(const Bf16x8& p, float (&out)[8]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(p.v[i]);
    out[2 * i] = f.x;
    out[2 * i + 1] = f.y;
  }
}

__device__ __forceinline__ Bf16x8 Pack(const float (&in)[8]) {
  Bf16x8 out;
#pragma unroll
  for (int i = 0; i < 4; ++i) out.v[i] = __floats2bfloat162_rn(in[2 * i], in[2 * i + 1]);
  return out;
}

struct alignas(16) Float8 {
  float4 lo, hi;
};

// Eight values of T (bf16 or fp32) as one vector: Vec8<T>::Type, read into and written from fp32.
template <typename T>
struct Vec8;

template <>
struct Vec8<__nv_bfloat16> {
  using Type = Bf16x8;
  static __device__ __forceinline__ void Load(const Type& p, float (&out)[8]) { Unpack(p, out); }
  static __device__ __forceinline__ Type Store(const float (&in)[8]) { return Pack(in); }
};

template <>
struct Vec8<float> {
  using Type = Float8;
  static __device__ __forceinline__ void Load(const Type& p, float (&out)[8]) {
    out[0] = p.lo.x, out[1] = p.lo.y, out[2] = p.lo.z, out[3] = p.lo.w;
    out[4] = p.hi.x, out[5] = p.hi.y, out[6] = p.hi.z, out[7] = p.hi.w;
  }
  static __device__ __forceinline__ Type Store(const float (&in)[8]) {
    Type out;
    out.lo = make_float4(in[0], in[1], in[2], in[3]);
    out.hi = make_float4(in[4], in[5], in[6], in[7]);
    return out;
  }
};

// An FP8 quantization's amax taken by the kernel that writes the tensor, instead of a pass of its
// own: the largest |v| kept as the bits of an fp32 (non-negative values order as their bits do, and
// a NaN's bits exceed infinity's, so a NaN wins), added to a device fp32 holding 0 before by
// atomicMax on its bits.
//
// Of eight bf16 values (a bf16's bits shifted up are the fp32's).
__device__ __forceinline__ unsigned AbsMaxBits(const Bf16x8& p) {
  const unsigned* w = reinterpret_cast<const unsigned*>(&p);
  constexpr unsigned kMagnitudes = 0x7fff7fffu;
  const unsigned m = __vmaxu2(__vmaxu2(w[0] & kMagnitudes, w[1] & kMagnitudes),
                              __vmaxu2(w[2] & kMagnitudes, w[3] & kMagnitudes));
  return max(m & 0xffffu, m >> 16) << 16;
}
__device__ __forceinline__ unsigned AbsMaxBits(__nv_bfloat16 v) {
  return static_cast<unsigned>(__bfloat16_as_ushort(v) & 0x7fffu) << 16;
}

// Adds the warp's largest `bits` to *amax; every lane of the warp calls it. The value is read first:
// it only grows, so most warps need no atomic.
__device__ __forceinline__ void AddWarpAmax(unsigned bits, float* amax) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) bits = max(bits, __shfl_xor_sync(0xffffffffu, bits, offset));
  unsigned* const held = reinterpret_cast<unsigned*>(amax);
  if ((threadIdx.x & 31) == 0 && bits > *reinterpret_cast<volatile unsigned*>(held)) atomicMax(held, bits);
}

// The same for the block (1-D, at most 1024 threads): one atomic at most a block, so that blocks that
// finish together do not queue on the one address. Every thread of the block calls it.
__device__ __forceinline__ void AddBlockAmax(unsigned bits, float* amax) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) bits = max(bits, __shfl_xor_sync(0xffffffffu, bits, offset));
  __shared__ unsigned warps[32];
  if ((threadIdx.x & 31) == 0) warps[threadIdx.x / 32] = bits;
  __syncthreads();
  if (threadIdx.x < 32) {
    bits = threadIdx.x < (blockDim.x + 31) / 32 ? warps[threadIdx.x] : 0u;
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) bits = max(bits, __shfl_xor_sync(0xffffffffu, bits, offset));
    unsigned* const held = reinterpret_cast<unsigned*>(amax);
    if (threadIdx.x == 0 && bits > *reinterpret_cast<volatile unsigned*>(held)) atomicMax(held, bits);
  }
  __syncthreads();  // `warps` is free again for the next call
}

// The element-wise kernels' grid (their loops stride over it): a thread an item (eight values, or one),
// kElementwiseThreads a block, at most 65535 · 16 blocks.
constexpr int kElementwiseThreads = 256;
inline unsigned ElementwiseBlocks(int64_t items) {
  const int64_t blocks = (items + kElementwiseThreads - 1) / kElementwiseThreads;
  return static_cast<unsigned>(blocks < 65535 * 16 ? blocks : 65535 * 16);
}

inline bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Two adjacent values of T as fp32.
__device__ __forceinline__ float2 Load2(const __nv_bfloat16* p) {
  return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(p));
}
__device__ __forceinline__ float2 Load2(const float* p) { return *reinterpret_cast<const float2*>(p); }

// The second pass of a two-pass column reduction: out_j[c] = Σ_k partial[k · stride + j · cols + c]
// for the `outs` outputs j (out_1 may be null), in bf16; with `accumulate` added to what out_j holds
// (the sum in fp32, rounded once). Blocks of kChunkLanes columns by kChunkWarps warps, each warp over
// every kChunkWarps-th chunk (coalesced rows of the partials), summed across the warps in shared
// memory: the chunks are read in parallel, not one after another.
constexpr int kChunkLanes = 32, kChunkWarps = 16;
static __global__ void __launch_bounds__(kChunkLanes * kChunkWarps)
    AddChunkRows(const float* partial, int64_t chunks, int64_t stride, int64_t cols, __nv_bfloat16* out0,
                 __nv_bfloat16* out1, bool accumulate) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kChunkLanes + threadIdx.x;
  float s0 = 0.f, s1 = 0.f;
  if (c < cols) {
    for (int64_t k = threadIdx.y; k < chunks; k += kChunkWarps) {
      s0 += partial[k * stride + c];
      if (out1 != nullptr) s1 += partial[k * stride + cols + c];
    }
  }
  __shared__ float part[2][kChunkWarps][kChunkLanes];
  part[0][threadIdx.y][threadIdx.x] = s0;
  part[1][threadIdx.y][threadIdx.x] = s1;
  __syncthreads();
  if (threadIdx.y == 0 && c < cols) {
    float t0 = 0.f, t1 = 0.f;
#pragma unroll
    for (int w = 0; w < kChunkWarps; ++w) t0 += part[0][w][threadIdx.x], t1 += part[1][w][threadIdx.x];
    if (accumulate) {
      t0 += __bfloat162float(out0[c]);
      if (out1 != nullptr) t1 += __bfloat162float(out1[c]);
    }
    out0[c] = __float2bfloat16(t0);
    if (out1 != nullptr) out1[c] = __float2bfloat16(t1);
  }
}

static inline void LaunchAddChunkRows(const float* partial, int64_t chunks, int64_t stride, int64_t cols, void* out0,
                               void* out1, cudaStream_t stream, bool accumulate = false) {
  const auto blocks = static_cast<unsigned>((cols + kChunkLanes - 1) / kChunkLanes);
  AddChunkRows<<<blocks, dim3(kChunkLanes, kChunkWarps), 0, stream>>>(
      partial, chunks, stride, cols, static_cast<__nv_bfloat16*>(out0), static_cast<__nv_bfloat16*>(out1), accumulate);
}

inline int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// How many chunks of rows a column reduction splits `rows` into when each block covers one of
// `col_blocks` blocks of columns and one chunk: about 1024 blocks in all, each chunk at least
// `min_rows` rows (one per warp).
inline int64_t RowChunks(int64_t rows, int64_t col_blocks, int64_t min_rows) {
  int64_t chunks = CeilDiv(1024, col_blocks);
  const int64_t most = CeilDiv(rows, min_rows);
  if (chunks > most) chunks = most;
  return chunks < 1 ? 1 : chunks;
}

}  // namespace ltrain::worker::cuda
