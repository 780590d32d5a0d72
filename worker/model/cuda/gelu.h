// The GELU's gradient (tanh approximation, as cuBLASLt's GELU epilogue and LibTorch's
// gelu_backward(..., "tanh")) in one pass, with the amax of what it writes for the FP8 product that
// reads it. Plain CUDA, no LibTorch.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

namespace ltrain::worker::cuda {

// dx = grad · gelu'(pre) over n bf16 elements, computed in fp32. `amax`, where not null, gets max |dx|
// (a device fp32 holding 0 before, as layer_norm.h's).
void GeluBackward(const void* grad, const void* pre, int64_t n, void* dx, cudaStream_t stream, float* amax = nullptr);

}  // namespace ltrain::worker::cuda
