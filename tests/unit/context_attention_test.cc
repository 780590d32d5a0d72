// Context parallelism's attention arithmetic (worker/model/context_attention.h): every rank's queries
// against every rank's keys and values, one block at a time in ring order, merged by online softmax,
// give whole-sequence causal attention's rows and gradients.
#include "worker/model/context_attention.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <stdexcept>
#include <vector>

#include <gtest/gtest.h>
#include <torch/autograd.h>
#include <torch/cuda.h>
#include <torch/types.h>

#include "worker/torch_compat.h"

namespace ltrain::worker::cp {
namespace {

TEST(ContextAttentionTest, EachRankHoldsAChunkFromTheFrontAndItsMirrorFromTheBack) {
  const Chunks c = ChunksOf(16, 2, 0);
  EXPECT_EQ(c.size, 4);
  EXPECT_EQ(c.first, 0);
  EXPECT_EQ(c.second, 12);
  const Chunks d = ChunksOf(16, 2, 1);
  EXPECT_EQ(d.first, 4);
  EXPECT_EQ(d.second, 8);
  std::vector<int64_t> all;
  for (int r = 0; r < 4; ++r) {
    const torch::Tensor p = PositionsOf(32, 4, r);
    EXPECT_EQ(p.numel(), 8);
    for (int64_t i = 0; i < p.numel(); ++i) all.push_back(p[i].item<int64_t>());
  }
  std::sort(all.begin(), all.end());
  for (int64_t i = 0; i < 32; ++i) EXPECT_EQ(all[static_cast<size_t>(i)], i);  // every position once
  const torch::Tensor x = torch::arange(16, torch::kLong).view({1, 16});
  EXPECT_TRUE(Take(x, 2, 1).equal(torch::tensor({4, 5, 6, 7, 8, 9, 10, 11}, torch::kLong).view({1, 8})));
  EXPECT_THROW(ChunksOf(10, 2, 0), std::invalid_argument);  // not a multiple of 2*cp
}

// q, k, v in fp64: the blockwise result equals the whole sequence's to rounding, for cp 1, 2 and 4.
TEST(ContextAttentionTest, RingBlocksMergedEqualWholeSequenceAttentionAndItsGradients) {
  const int64_t b = 2, h = 3, T = 16, hd = 8;
  const double scale = 1.0 / std::sqrt(static_cast<double>(hd));
  torch::manual_seed(3);
  const torch::TensorOptions f64 = torch::TensorOptions().dtype(torch::kDouble);
  const torch::Tensor q0 = torch::randn({b, h, T, hd}, f64), k0 = torch::randn({b, h, T, hd}, f64);
  const torch::Tensor v0 = torch::randn({b, h, T, hd}, f64), g = torch::randn({b, h, T, hd}, f64);

  // The whole sequence, causal.
  torch::Tensor q = q0.clone().requires_grad_(true), k = k0.clone().requires_grad_(true);
  torch::Tensor v = v0.clone().requires_grad_(true);
  const torch::Tensor mask = torch::ones({T, T}, torch::kBool).tril();
  const torch::Tensor scores = (q.matmul(k.transpose(-2, -1)) * scale).masked_fill(mask.logical_not(), -INFINITY);
  const torch::Tensor whole = scores.softmax(-1).matmul(v);
  (whole * g).sum().backward();

  for (const int cp : {1, 2, 4}) {
    torch::Tensor qc = q0.clone().requires_grad_(true), kc = k0.clone().requires_grad_(true);
    torch::Tensor vc = v0.clone().requires_grad_(true);
    std::vector<torch::Tensor> outs;
    // Each rank's queries; the blocks in ring order: its own first, then rank r-1's, r-2's, ...
    for (int r = 0; r < cp; ++r) {
      const torch::Tensor pos = PositionsOf(T, cp, r);
      const torch::Tensor qr = qc.index_select(2, pos);
      Partial acc;
      for (int step = 0; step < cp; ++step) {
        const int src = (r - step + cp) % cp;
        const torch::Tensor kpos = PositionsOf(T, cp, src);
        const Partial block = BlockAttention(qr, kc.index_select(2, kpos), vc.index_select(2, kpos), pos, kpos, scale);
        acc = step == 0 ? block : Merge(acc, block);
      }
      outs.push_back(acc.out);
    }
    // Back to sequence order.
    torch::Tensor out = torch::zeros_like(q0);
    for (int r = 0; r < cp; ++r) out = out.index_copy(2, PositionsOf(T, cp, r), outs[static_cast<size_t>(r)]);
    EXPECT_LT((out - whole).abs().max().item<double>(), 1e-12) << "cp " << cp;
    (out * g).sum().backward();
    EXPECT_LT((qc.grad() - q.grad()).abs().max().item<double>(), 1e-12) << "cp " << cp;
    EXPECT_LT((kc.grad() - k.grad()).abs().max().item<double>(), 1e-12) << "cp " << cp;
    EXPECT_LT((vc.grad() - v.grad()).abs().max().item<double>(), 1e-12) << "cp " << cp;
    EXPECT_FALSE(torch::isnan(kc.grad()).any().item<bool>()) << "cp " << cp;
  }
}

// On a GPU, in bf16: every rank's blocks of a cp-4 ring, computed on one device, merged, against
// whole-sequence attention by LibTorch's fused kernel (flash attention where the GPU has it), within
// bf16's rounding; the gradients too.
TEST(ContextAttentionTest, RingBlocksOnAGpuEqualFusedWholeSequenceAttention) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  const int64_t b = 2, h = 8, T = 1024, hd = 64;
  const int cp = 4;
  const double scale = 1.0 / std::sqrt(static_cast<double>(hd));
  torch::manual_seed(5);
  const torch::TensorOptions bf16 = torch::TensorOptions().dtype(torch::kBFloat16).device(torch::kCUDA);
  const torch::Tensor q0 = torch::randn({b, h, T, hd}, bf16), k0 = torch::randn({b, h, T, hd}, bf16);
  const torch::Tensor v0 = torch::randn({b, h, T, hd}, bf16), g = torch::randn({b, h, T, hd}, bf16);
  torch::Tensor q = q0.clone().requires_grad_(true), k = k0.clone().requires_grad_(true);
  torch::Tensor v = v0.clone().requires_grad_(true);
  const torch::Tensor whole = compat::CausalAttention(q, k, v);
  (whole.to(torch::kFloat) * g.to(torch::kFloat)).sum().backward();

  torch::Tensor qc = q0.clone().requires_grad_(true), kc = k0.clone().requires_grad_(true);
  torch::Tensor vc = v0.clone().requires_grad_(true);
  torch::Tensor out = torch::zeros_like(q0);
  for (int r = 0; r < cp; ++r) {
    const torch::Tensor pos = PositionsOf(T, cp, r, torch::kCUDA);
    const torch::Tensor qr = qc.index_select(2, pos);
    Partial acc;
    for (int step = 0; step < cp; ++step) {
      const torch::Tensor kpos = PositionsOf(T, cp, (r - step + cp) % cp, torch::kCUDA);
      const Partial block = BlockAttention(qr, kc.index_select(2, kpos), vc.index_select(2, kpos), pos, kpos, scale);
      acc = step == 0 ? block : Merge(acc, block);
    }
    out = out.index_copy(2, pos, acc.out.to(out.scalar_type()));
  }
  (out.to(torch::kFloat) * g.to(torch::kFloat)).sum().backward();
  auto worst = [](const torch::Tensor& x, const torch::Tensor& y) {
    return ((x.to(torch::kFloat) - y.to(torch::kFloat)).abs().max() / y.to(torch::kFloat).abs().max()).item<double>();
  };
  EXPECT_LT(worst(out, whole), 2e-2);
  EXPECT_LT(worst(qc.grad(), q.grad()), 3e-2);
  EXPECT_LT(worst(kc.grad(), k.grad()), 3e-2);
  EXPECT_LT(worst(vc.grad(), v.grad()), 3e-2);
  std::printf("[ring on GPU] worst relative difference: out %.3g, dq %.3g, dk %.3g, dv %.3g\n", worst(out, whole),
              worst(qc.grad(), q.grad()), worst(kc.grad(), k.grad()), worst(vc.grad(), v.grad()));
}

}  // namespace
}  // namespace ltrain::worker::cp
