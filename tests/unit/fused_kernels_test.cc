// The worker's own CUDA kernels against the LibTorch operations they replace. Skips where there is
// no GPU or the worker was built without CUDA kernels.
#include <gtest/gtest.h>

#include <torch/cuda.h>
#include <torch/torch.h>

#include "worker/fused_kernels.h"

namespace ltrain::worker {
namespace {

void CompareCrossEntropy(int64_t rows, int64_t vocab) {
  torch::manual_seed(7);
  const torch::TensorOptions options = torch::TensorOptions().dtype(torch::kBFloat16).device(torch::kCUDA);
  torch::Tensor base = (torch::randn({rows, vocab}) * 3).to(options);
  torch::Tensor targets = torch::randint(0, vocab, {rows}, torch::TensorOptions().dtype(torch::kLong).device(torch::kCUDA));

  torch::Tensor reference_logits = base.clone().requires_grad_(true);
  torch::Tensor reference = torch::nll_loss(torch::log_softmax(reference_logits.to(torch::kFloat), 1), targets);
  (reference * 2).backward();

  torch::Tensor logits = base.clone().requires_grad_(true);
  ASSERT_TRUE(FusedCrossEntropyAvailable(logits));
  torch::Tensor loss = FusedCrossEntropy(logits, targets);
  (loss * 2).backward();

  const double want = reference.item<double>(), got = loss.item<double>();
  EXPECT_NEAR(got, want, 1e-5 * std::abs(want)) << rows << "x" << vocab;
  torch::Tensor g = logits.grad().to(torch::kFloat), g_ref = reference_logits.grad().to(torch::kFloat);
  const double scale = g_ref.abs().max().item<double>();
  EXPECT_LE((g - g_ref).abs().max().item<double>(), 0.01 * scale) << rows << "x" << vocab;
}

TEST(FusedKernelsTest, CrossEntropyMatchesLibTorch) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  torch::Tensor probe = torch::zeros({1, 8}, torch::TensorOptions().dtype(torch::kBFloat16).device(torch::kCUDA));
  if (!FusedCrossEntropyAvailable(probe)) GTEST_SKIP() << "worker built without CUDA kernels";
  CompareCrossEntropy(64, 50304);  // the benchmark vocabulary (vectorized path)
  CompareCrossEntropy(33, 1001);   // a vocabulary that is not a multiple of 8 (scalar path)
  CompareCrossEntropy(5, 256);     // bytes
}

TEST(FusedKernelsTest, AdamWMatchesTorchOptimAdamW) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  const torch::TensorOptions f32 = torch::TensorOptions().dtype(torch::kFloat).device(torch::kCUDA);
  if (!FusedAdamWAvailable(torch::zeros({1}, f32))) GTEST_SKIP() << "worker built without CUDA kernels";
  torch::manual_seed(3);
  const int64_t n = 100003;
  for (const bool bf16_grad : {true, false}) {
    torch::Tensor w0 = torch::randn({n}, f32), m0 = torch::randn({n}, f32) * 0.1, v0 = torch::rand({n}, f32) * 0.01;
    torch::Tensor g = torch::randn({n}, f32);
    if (bf16_grad) g = g.to(torch::kBFloat16);
    const double lr = 3e-4, b1 = 0.9, b2 = 0.95, eps = 1e-8, wd = 0.1, clip = 2.0;
    const int64_t step = 7;
    // The reference: torch.optim.AdamW's update written out in fp32 from the gradient divided by `clip`.
    torch::Tensor gr = g.to(torch::kFloat) / clip;
    torch::Tensor m_ref = m0 * b1 + gr * (1 - b1), v_ref = v0 * b2 + gr * gr * (1 - b2);
    const double bias1 = 1 - std::pow(b1, step), bias2 = 1 - std::pow(b2, step);
    torch::Tensor w_ref = w0 * (1 - lr * wd) - (lr / bias1) * m_ref / (v_ref.sqrt() / std::sqrt(bias2) + eps);

    torch::Tensor w = w0.clone(), m = m0.clone(), v = v0.clone();
    torch::Tensor copy = torch::empty({n}, f32.dtype(torch::kBFloat16));
    FusedAdamW(w, g, m, v, copy, lr, b1, b2, eps, wd, step, torch::full({}, clip, f32));
    EXPECT_LE((w - w_ref).abs().max().item<double>(), 1e-6) << "bf16 gradients: " << bf16_grad;
    EXPECT_LE((m - m_ref).abs().max().item<double>(), 1e-6);
    EXPECT_LE((v - v_ref).abs().max().item<double>(), 1e-6);
    EXPECT_TRUE(torch::equal(copy, w.to(torch::kBFloat16)));
  }
}

}  // namespace
}  // namespace ltrain::worker
