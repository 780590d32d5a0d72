// The Llama block's elementwise work in one pass each, bf16 in and out, fp32 arithmetic: rotary
// embeddings (forward and its inverse rotation for backward) and SwiGLU (silu(gate) · up, and both
// gradients). Plain CUDA, no LibTorch.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

namespace ltrain::worker::cuda {

// x, out: bf16 [batch, t, heads, head_dim] contiguous; cos, sin: fp32 [>= t, head_dim/2] contiguous.
// Pair i of a head (i, i + head_dim/2) at position p turns by the angle of (p, i) (llama_model's
// apply_rope), or back by it when `inverse` (the gradient). out may be x. `amax`, where not null,
// gets max |out| (as SwiGlu's).
void Rope(const void* x, const float* cos, const float* sin, int64_t batch, int64_t t, int64_t heads,
          int64_t head_dim, bool inverse, void* out, cudaStream_t stream, float* amax = nullptr);

// out = silu(gate) · up over n bf16 elements. `amax`, where not null, gets max |out| for an FP8
// quantization of it (a device fp32 holding 0 before, as layer_norm.h's).
void SwiGlu(const void* gate, const void* up, int64_t n, void* out, cudaStream_t stream, float* amax = nullptr);

// The gradients of SwiGlu: dgate = grad · up · silu'(gate), dup = grad · silu(gate); with their
// amaxes where dgate_amax and dup_amax are not null.
void SwiGluBackward(const void* gate, const void* up, const void* grad, int64_t n, void* dgate, void* dup,
                    cudaStream_t stream, float* dgate_amax = nullptr, float* dup_amax = nullptr);

}  // namespace ltrain::worker::cuda
