// Context parallelism's attention arithmetic (worker/model/context_attention.h): every rank's queries
// against every rank's keys and values, one block at a time in ring order, merged by online softmax,
// give whole-sequence causal attention's rows; each block's gradients, from the whole row's output and
// log-sum-exp, sum to whole-sequence attention's gradients.
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

// Every rank's steps of a ring of `cp`, on one device: each rank's queries against every rank's keys
// and values in ring order (its own first), and back again for the gradients, each step's share
// from the whole row's output and log-sum-exp. Returns the output and the gradients of q, k, v in
// sequence order, in q's type.
struct RingResult {
  torch::Tensor out, dq, dk, dv;
};
RingResult RunRing(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& dout,
                   int cp) {
  const int64_t T = q.size(2);
  const torch::ScalarType wide = q.scalar_type() == torch::kDouble ? torch::kDouble : torch::kFloat;
  std::vector<torch::Tensor> pos, qs, ks, vs, dos;
  for (int r = 0; r < cp; ++r) {
    pos.push_back(PositionsOf(T, cp, r, q.device()));
    qs.push_back(q.index_select(2, pos.back()));
    ks.push_back(k.index_select(2, pos.back()));
    vs.push_back(v.index_select(2, pos.back()));
    dos.push_back(dout.index_select(2, pos.back()));
  }
  RingResult result;
  result.out = torch::zeros_like(q);
  result.dq = torch::zeros(q.sizes(), q.options().dtype(wide));
  result.dk = torch::zeros(k.sizes(), k.options().dtype(wide));
  result.dv = torch::zeros(v.sizes(), v.options().dtype(wide));
  std::vector<torch::Tensor> dk(cp), dv(cp);
  for (int r = 0; r < cp; ++r) {
    dk[r] = torch::zeros(ks[r].sizes(), ks[r].options().dtype(wide));
    dv[r] = torch::zeros(vs[r].sizes(), vs[r].options().dtype(wide));
  }
  for (int r = 0; r < cp; ++r) {
    Partial acc;
    for (int step = 0; step < cp; ++step) {
      const int src = (r - step + cp) % cp;
      AttendStep(qs[r], ks[src], vs[src], cp, r, src, &acc);
    }
    const torch::Tensor out = acc.out.to(q.scalar_type());
    result.out.index_copy_(2, pos[r], out);
    torch::Tensor dq = torch::zeros(qs[r].sizes(), qs[r].options().dtype(wide));
    for (int step = 0; step < cp; ++step) {
      const int src = (r - step + cp) % cp;
      AttendStepBackward(dos[r], qs[r], ks[src], vs[src], out, acc.lse, cp, r, src, dq, dk[src], dv[src]);
    }
    result.dq.index_copy_(2, pos[r], dq);
  }
  for (int r = 0; r < cp; ++r) {
    result.dk.index_copy_(2, pos[r], dk[r]);
    result.dv.index_copy_(2, pos[r], dv[r]);
  }
  return result;
}

// q, k, v in fp64, grouped key and value heads: the ring's steps equal whole-sequence causal
// attention and its gradients to rounding, for cp 1, 2 and 4.
TEST(ContextAttentionTest, RingStepsEqualWholeSequenceAttentionAndItsGradients) {
  const int64_t b = 2, h = 4, kvh = 2, T = 16, hd = 8;
  const double scale = 1.0 / std::sqrt(static_cast<double>(hd));
  torch::manual_seed(3);
  const torch::TensorOptions f64 = torch::TensorOptions().dtype(torch::kDouble);
  const torch::Tensor q0 = torch::randn({b, h, T, hd}, f64), k0 = torch::randn({b, kvh, T, hd}, f64);
  const torch::Tensor v0 = torch::randn({b, kvh, T, hd}, f64), g = torch::randn({b, h, T, hd}, f64);

  // The whole sequence, causal, by autograd.
  torch::Tensor q = q0.clone().requires_grad_(true), k = k0.clone().requires_grad_(true);
  torch::Tensor v = v0.clone().requires_grad_(true);
  const torch::Tensor mask = torch::ones({T, T}, torch::kBool).tril();
  const torch::Tensor ke = k.repeat_interleave(h / kvh, 1), ve = v.repeat_interleave(h / kvh, 1);
  const torch::Tensor scores = (q.matmul(ke.transpose(-2, -1)) * scale).masked_fill(mask.logical_not(), -INFINITY);
  const torch::Tensor whole = scores.softmax(-1).matmul(ve);
  (whole * g).sum().backward();

  for (const int cp : {1, 2, 4}) {
    const RingResult ring = RunRing(q0, k0, v0, g, cp);
    EXPECT_LT((ring.out - whole).abs().max().item<double>(), 1e-12) << "cp " << cp;
    EXPECT_LT((ring.dq - q.grad()).abs().max().item<double>(), 1e-12) << "cp " << cp;
    EXPECT_LT((ring.dk - k.grad()).abs().max().item<double>(), 1e-12) << "cp " << cp;
    EXPECT_LT((ring.dv - v.grad()).abs().max().item<double>(), 1e-12) << "cp " << cp;
  }
}

// On a GPU, in bf16: every rank's steps of a cp-4 ring (flash attention's kernels, forward and
// backward, a block at a time), computed on one device, against whole-sequence attention by
// LibTorch's fused kernel (flash attention), within bf16's rounding; the gradients too.
TEST(ContextAttentionTest, RingBlocksOnAGpuEqualFusedWholeSequenceAttention) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  const int64_t b = 2, h = 8, kvh = 2, T = 1024, hd = 64;
  const int cp = 4;
  torch::manual_seed(5);
  const torch::TensorOptions bf16 = torch::TensorOptions().dtype(torch::kBFloat16).device(torch::kCUDA);
  const torch::Tensor q0 = torch::randn({b, h, T, hd}, bf16), k0 = torch::randn({b, kvh, T, hd}, bf16);
  const torch::Tensor v0 = torch::randn({b, kvh, T, hd}, bf16), g = torch::randn({b, h, T, hd}, bf16);
  torch::Tensor q = q0.clone().requires_grad_(true), k = k0.clone().requires_grad_(true);
  torch::Tensor v = v0.clone().requires_grad_(true);
  const torch::Tensor whole = compat::CausalAttentionGqa(q, k, v);
  whole.backward(g);
  EXPECT_TRUE(compat::FlashBlocksAvailable(q0)) << "this GPU build computes the ring's blocks written out";

  const RingResult ring = RunRing(q0, k0, v0, g, cp);
  auto worst = [](const torch::Tensor& x, const torch::Tensor& y) {
    return ((x.to(torch::kFloat) - y.to(torch::kFloat)).abs().max() / y.to(torch::kFloat).abs().max()).item<double>();
  };
  EXPECT_LT(worst(ring.out, whole), 2e-2);
  EXPECT_LT(worst(ring.dq, q.grad()), 3e-2);
  EXPECT_LT(worst(ring.dk, k.grad()), 3e-2);
  EXPECT_LT(worst(ring.dv, v.grad()), 3e-2);
  std::printf("[ring on GPU, flash blocks] worst relative difference: out %.3g, dq %.3g, dk %.3g, dv %.3g\n",
              worst(ring.out, whole), worst(ring.dq, q.grad()), worst(ring.dk, k.grad()), worst(ring.dv, v.grad()));
}

}  // namespace
}  // namespace ltrain::worker::cp
