// The embedding's backward over the sorted ids, in pieces of at most kPiece positions so that a row
// used thousands of times a step (a frequent token of real text) is summed by many warps, not one.
// A piece starts at the first position of a row's run and at every multiple of kPiece inside a run,
// and ends at the run's end or at the next multiple. A warp for each position and 256 columns: the
// warp at a piece's start reads the piece's ids 32 at a time (one a lane), sums its tokens' gradient
// rows in fp32 (eight columns a lane, 16-byte loads); the other warps return at once. A piece that is
// its whole run adds its sum to the row. Otherwise its sum goes to its segment's slot (segment k holds
// positions [k·kPiece, (k+1)·kPiece)): `head` for a piece whose run began before the segment (at most
// one, at the segment's start), `tail` for a piece that begins a run going on past the segment (at
// most one, at the segment's end). A second kernel adds each such run's tail and the heads after it,
// in order, to the row. Each row has one writer, so no atomics, and the same result on every run.
#include "worker/model/cuda/embedding.h"

#include <cuda_bf16.h>

#include "worker/model/cuda/bf16x8.cuh"

namespace ltrain::worker::cuda {
namespace {

constexpr int kLanes = 32;
constexpr int kColsPerLane = 8;
constexpr int kColsPerWarp = kLanes * kColsPerLane;
constexpr int kWarps = 8;
constexpr int64_t kPiece = 64;
constexpr unsigned kAll = 0xffffffffu;

__device__ __forceinline__ void AddTo(Bf16x8* out, const float (&sum)[kColsPerLane]) {
  float o[kColsPerLane];
  Unpack(*out, o);
#pragma unroll
  for (int c = 0; c < kColsPerLane; ++c) o[c] += sum[c];
  *out = Pack(o);
}

__global__ void __launch_bounds__(kLanes * kWarps)
    PieceSums(const int64_t* sorted, const int64_t* order, int64_t n, const Bf16x8* grad, int64_t vecs, Bf16x8* out,
              float* head, float* tail) {
  const int64_t first = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.y;
  if (first >= n) return;  // whole warps return together
  const int64_t row = sorted[first];
  const bool began_before = first > 0 && sorted[first - 1] == row;
  if (began_before && first % kPiece != 0) return;  // not the start of a piece
  const int64_t end = (first / kPiece + 1) * kPiece < n ? (first / kPiece + 1) * kPiece : n;
  const int64_t vec = static_cast<int64_t>(blockIdx.y) * kLanes + threadIdx.x;
  const bool mine = vec < vecs;  // every lane takes part in the shuffles
  float sum[kColsPerLane] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  int64_t last = first;  // one past the piece's last position
  for (int64_t base = first; base < end; base += kLanes) {
    const int64_t i = base + threadIdx.x;
    const bool same = i < end && sorted[i] == row;
    const int64_t token = same ? order[i] : 0;
    // The ids are sorted, so the lanes of the piece are a prefix of the warp.
    const int count = __popc(__ballot_sync(kAll, same));
#pragma unroll 4
    for (int k = 0; k < count; ++k) {
      const int64_t t = __shfl_sync(kAll, token, k);
      if (mine) {
        float v[kColsPerLane];
        Unpack(grad[t * vecs + vec], v);
#pragma unroll
        for (int c = 0; c < kColsPerLane; ++c) sum[c] += v[c];
      }
    }
    last = base + count;
    if (count < kLanes) break;
  }
  if (!mine) return;
  const bool goes_on = last < n && sorted[last] == row;
  if (!began_before && !goes_on) {
    AddTo(&out[row * vecs + vec], sum);
    return;
  }
  float* slot = (began_before ? head : tail) + (first / kPiece) * vecs * kColsPerLane + vec * kColsPerLane;
  *reinterpret_cast<float4*>(slot) = make_float4(sum[0], sum[1], sum[2], sum[3]);
  *reinterpret_cast<float4*>(slot + 4) = make_float4(sum[4], sum[5], sum[6], sum[7]);
}

__device__ __forceinline__ void AddSlot(const float* slot, float (&sum)[kColsPerLane]) {
  const float4 lo = *reinterpret_cast<const float4*>(slot), hi = *reinterpret_cast<const float4*>(slot + 4);
  sum[0] += lo.x, sum[1] += lo.y, sum[2] += lo.z, sum[3] += lo.w;
  sum[4] += hi.x, sum[5] += hi.y, sum[6] += hi.z, sum[7] += hi.w;
}

// A warp for each segment and 256 columns: where a run begins in the segment and goes on past it,
// its tail and the heads of the segments it covers, in order, added to its row.
__global__ void __launch_bounds__(kLanes * kWarps)
    JoinPieces(const int64_t* sorted, int64_t n, int64_t segments, int64_t vecs, Bf16x8* out, const float* head,
               const float* tail) {
  const int64_t segment = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.y;
  const int64_t vec = static_cast<int64_t>(blockIdx.y) * kLanes + threadIdx.x;
  if (segment >= segments - 1 || vec >= vecs) return;  // the last segment's runs end in it
  const int64_t begin = segment * kPiece, next = begin + kPiece;
  const int64_t row = sorted[next - 1];
  if (sorted[next] != row) return;                        // no run goes on past the segment
  if (begin > 0 && sorted[begin - 1] == row) return;      // the run began before: another segment's
  const int64_t stride = vecs * kColsPerLane;
  float sum[kColsPerLane] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  AddSlot(tail + segment * stride + vec * kColsPerLane, sum);
  for (int64_t s = segment + 1; s < segments; ++s) {
    AddSlot(head + s * stride + vec * kColsPerLane, sum);
    const int64_t after = (s + 1) * kPiece;
    if (after >= n || sorted[after] != row) break;
  }
  AddTo(&out[row * vecs + vec], sum);
}

}  // namespace

int64_t EmbeddingRowSumsFloats(int64_t n, int64_t cols) { return 2 * CeilDiv(n, kPiece) * cols; }

void EmbeddingRowSums(const int64_t* sorted, const int64_t* order, int64_t n, const void* grad, int64_t cols,
                      float* partial, void* out, cudaStream_t stream) {
  if (n <= 0 || cols <= 0) return;
  const int64_t vecs = cols / kColsPerLane, segments = CeilDiv(n, kPiece);
  const unsigned col_blocks = static_cast<unsigned>(CeilDiv(cols, kColsPerWarp));
  float* head = partial;
  float* tail = partial + segments * cols;
  PieceSums<<<dim3(static_cast<unsigned>(CeilDiv(n, kWarps)), col_blocks), dim3(kLanes, kWarps), 0, stream>>>(
      sorted, order, n, static_cast<const Bf16x8*>(grad), vecs, static_cast<Bf16x8*>(out), head, tail);
  if (segments > 1) {
    JoinPieces<<<dim3(static_cast<unsigned>(CeilDiv(segments - 1, kWarps)), col_blocks), dim3(kLanes, kWarps), 0,
                 stream>>>(sorted, n, segments, vecs, static_cast<Bf16x8*>(out), head, tail);
  }
}

}  // namespace ltrain::worker::cuda
