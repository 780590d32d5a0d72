// Comparing a kernel's tensors with their reference, for the fused kernels' tests.
#pragma once

#include <torch/torch.h>

namespace ltrain::worker {

// Largest |a - b| relative to the largest |b|.
inline double RelativeError(const torch::Tensor& a, const torch::Tensor& b) {
  torch::Tensor x = a.to(torch::kFloat), y = b.to(torch::kFloat);
  return ((x - y).abs().max() / y.abs().max()).item<double>();
}

}  // namespace ltrain::worker
