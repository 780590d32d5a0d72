// Every difference between the LibTorch versions the worker builds against (Debian 12's 1.13 CPU
// build and the GPU host's 2.x CUDA build) lives here, keyed on TORCH_VERSION_MAJOR.
#pragma once

#include <cmath>
#include <limits>

#include <torch/nn/functional.h>
#include <torch/optim.h>
#include <torch/version.h>

namespace ltrain::worker::compat {

// Causal scaled-dot-product attention over [B, heads, T, head_dim] tensors.
inline torch::Tensor CausalAttention(const torch::Tensor& q, const torch::Tensor& k,
                                     const torch::Tensor& v) {
#if TORCH_VERSION_MAJOR >= 2
  return at::scaled_dot_product_attention(q, k, v, /*attn_mask=*/{}, /*dropout_p=*/0.0,
                                          /*is_causal=*/true);
#else
  // 1.13 has no fused kernel: softmax(q k^T / sqrt(d) + causal mask) v, written out.
  const int64_t t = q.size(-2);
  const double scale = 1.0 / std::sqrt(static_cast<double>(q.size(-1)));
  torch::Tensor scores = torch::matmul(q, k.transpose(-2, -1)) * scale;
  torch::Tensor future = torch::ones({t, t}, torch::TensorOptions().dtype(torch::kBool).device(q.device()))
                             .triu(1);
  scores = scores.masked_fill(future, -std::numeric_limits<float>::infinity());
  return torch::matmul(torch::softmax(scores, -1), v);
#endif
}

// Clears gradients so that the next backward writes fresh ones. 2.x's zero_grad() sets them to
// undefined, 1.13's zeroes them; callers treat an undefined gradient as zero either way.
inline void ZeroGrad(torch::optim::Optimizer& optimizer) { optimizer.zero_grad(); }

// Whether this LibTorch was built with CUDA (the NCCL communicator is compiled only then).
#if defined(LTRAIN_WITH_NCCL)
inline constexpr bool kBuiltWithCuda = true;
#else
inline constexpr bool kBuiltWithCuda = false;
#endif

}  // namespace ltrain::worker::compat
