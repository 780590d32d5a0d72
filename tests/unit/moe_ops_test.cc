#include "worker/model/moe_ops.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include <gtest/gtest.h>
#include <torch/autograd.h>
#include <torch/cuda.h>
#include <torch/types.h>

namespace ltrain::worker::moe {
namespace {

torch::Tensor Swiglu(const torch::Tensor& x, const torch::Tensor& w1, const torch::Tensor& w3, const torch::Tensor& w2) {
  return (torch::silu(x.matmul(w1.t())) * x.matmul(w3.t())).matmul(w2.t());
}

// Equal scores go to the lower index; the bias moves the choice but not the gates; norm_topk makes
// each token's gates sum to route_scale.
TEST(MoeOpsTest, RouterChoosesByScorePlusBiasAndWeighsByScore) {
  const torch::Tensor tied = torch::zeros({3, 4});
  Routing r = Route(tied, {}, {.top_k = 2});
  EXPECT_TRUE(torch::equal(r.experts, torch::tensor({0, 1}, torch::kLong).repeat({3, 1})));
  EXPECT_TRUE(torch::allclose(r.gates, torch::full({3, 2}, 0.5)));

  const torch::Tensor logits = torch::tensor({{2.0f, 1.0f, 0.0f, -1.0f}});
  const torch::Tensor bias = torch::tensor({0.0f, 0.0f, 0.0f, 5.0f});
  Routing biased = Route(logits, bias, {.top_k = 2, .norm_topk = false});
  EXPECT_TRUE(torch::equal(biased.experts, torch::tensor({{3, 0}}, torch::kLong)));
  const torch::Tensor scores = logits.softmax(-1);
  EXPECT_NEAR(biased.gates[0][0].item<float>(), scores[0][3].item<float>(), 1e-7);
  EXPECT_NEAR(biased.gates[0][1].item<float>(), scores[0][0].item<float>(), 1e-7);

  Routing scaled = Route(logits, {}, {.top_k = 3, .score = Score::kSigmoid, .norm_topk = true, .route_scale = 2.5});
  EXPECT_NEAR(scaled.gates.sum().item<float>(), 2.5f, 1e-6);
  EXPECT_TRUE(torch::equal(scaled.experts, torch::tensor({{0, 1, 2}}, torch::kLong)));
}

// The dispatch, experts and combine give what a loop over each token's experts gives, forward and
// backward (every input's gradient, the router's through the gates), in double precision; an expert
// no token chose gets a zero gradient.
TEST(MoeOpsTest, DispatchedExpertsEqualTheLoopOverEachTokensExperts) {
  torch::manual_seed(3);
  const int64_t tokens = 12, d = 8, f = 6, experts = 5;
  const auto f64 = torch::TensorOptions().dtype(torch::kDouble);
  torch::Tensor x = torch::randn({tokens, d}, f64).requires_grad_();
  torch::Tensor router = torch::randn({experts, d}, f64).requires_grad_();
  torch::Tensor w1 = (torch::randn({experts, f, d}, f64) * 0.3).requires_grad_();
  torch::Tensor w3 = (torch::randn({experts, f, d}, f64) * 0.3).requires_grad_();
  torch::Tensor w2 = (torch::randn({experts, d, f}, f64) * 0.3).requires_grad_();
  // Expert 4 is never chosen: its logit is far below the others'.
  torch::Tensor never = torch::zeros({experts}, f64);
  never[4] = -100.0;

  const RouterOptions options{.top_k = 2};
  Routing r = Route(x.matmul(router.t()) + never, {}, options);
  Dispatch dispatch = SortByExpert(r.experts, experts);
  EXPECT_EQ(dispatch.counts[4], 0);
  int64_t total = 0;
  for (int64_t c : dispatch.counts) total += c;
  EXPECT_EQ(total, tokens * options.top_k);
  // The device's counts are the host's; without host_counts only those, and the same order.
  EXPECT_TRUE(torch::equal(dispatch.rows, torch::tensor(dispatch.counts, torch::TensorOptions().dtype(torch::kLong))));
  const Dispatch on_device = SortByExpert(r.experts, experts, /*host_counts=*/false);
  EXPECT_TRUE(on_device.counts.empty());
  EXPECT_TRUE(torch::equal(on_device.rows, dispatch.rows));
  EXPECT_TRUE(torch::equal(on_device.order, dispatch.order));
  const torch::Tensor ys = Experts(Permute(x, dispatch), dispatch.counts, w1, w3, w2);
  const torch::Tensor y = Combine(ys, dispatch, r.gates.to(torch::kDouble));
  const torch::Tensor upstream = torch::randn({tokens, d}, f64);
  const std::vector<torch::Tensor> inputs = {x, router, w1, w3, w2};
  const std::vector<torch::Tensor> grads = torch::autograd::grad({(y * upstream).sum()}, inputs);

  // The reference: token by token, expert by expert.
  Routing ref_r = Route(x.matmul(router.t()) + never, {}, options);
  std::vector<torch::Tensor> rows;
  for (int64_t t = 0; t < tokens; ++t) {
    torch::Tensor sum = torch::zeros({d}, f64);
    for (int j = 0; j < options.top_k; ++j) {
      const int64_t e = ref_r.experts[t][j].item<int64_t>();
      sum = sum + ref_r.gates[t][j].to(torch::kDouble) * Swiglu(x[t], w1[e], w3[e], w2[e]);
    }
    rows.push_back(sum);
  }
  const torch::Tensor want = torch::stack(rows);
  const std::vector<torch::Tensor> want_grads = torch::autograd::grad({(want * upstream).sum()}, inputs);
  // The gates are fp32 in both (the router's scores are), so agreement is to fp32's precision.
  EXPECT_TRUE(torch::allclose(y, want, 1e-6, 1e-6)) << (y - want).abs().max().item<double>();
  for (size_t i = 0; i < inputs.size(); ++i) {
    EXPECT_TRUE(torch::allclose(grads[i], want_grads[i], 1e-5, 1e-6))
        << "input " << i << ": " << (grads[i] - want_grads[i]).abs().max().item<double>();
  }
  EXPECT_EQ(grads[2][4].abs().max().item<double>(), 0.0);
}

// The balance loss is 1 at an even load and grows with the skew; only the scores' mean carries it.
// On a GPU with grouped products (compute capability 9.0, LibTorch 2.8 or later), the experts' three
// grouped products give the loop's outputs and gradients within bf16's rounding, an expert without
// rows among them.
TEST(MoeOpsTest, GroupedExpertsEqualTheLoopOnAGpu) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  const torch::TensorOptions bf16 = torch::TensorOptions().dtype(torch::kBFloat16).device(torch::kCUDA);
  torch::manual_seed(7);
  const std::vector<int64_t> counts = {5, 0, 17, 10};
  const torch::Tensor xs = torch::randn({32, 64}, bf16);
  if (!GroupedExpertsApply(xs, torch::empty({4, 96, 64}, bf16))) {
    GTEST_SKIP() << "no grouped products here (LibTorch before 2.8, a GPU before compute capability 9.0, or "
                    "LTRAIN_MOE_GROUPED_MM=0)";
  }
  auto leaves = [&] {
    torch::manual_seed(11);
    return std::vector<torch::Tensor>{(torch::randn({32, 64}, bf16)).requires_grad_(true),
                                      (torch::randn({4, 96, 64}, bf16) * 0.1).requires_grad_(true),
                                      (torch::randn({4, 96, 64}, bf16) * 0.1).requires_grad_(true),
                                      (torch::randn({4, 64, 96}, bf16) * 0.1).requires_grad_(true)};
  };
  const std::vector<torch::Tensor> a = leaves(), b = leaves(), c = leaves();
  const torch::Tensor ya = Experts(a[0], counts, a[1], a[2], a[3]);
  const torch::Tensor yb = ExpertsLoop(b[0], counts, b[1], b[2], b[3]);
  // The counts on the device (no copy to the host): the same products, the same bits.
  const torch::Tensor yc =
      GroupedExperts(c[0], torch::tensor(counts, torch::TensorOptions().dtype(torch::kLong)).cuda(), c[1], c[2], c[3]);
  ASSERT_EQ(ya.sizes(), yb.sizes());
  const torch::Tensor g = torch::randn_like(ya);
  (ya.to(torch::kFloat) * g.to(torch::kFloat)).sum().backward();
  (yb.to(torch::kFloat) * g.to(torch::kFloat)).sum().backward();
  (yc.to(torch::kFloat) * g.to(torch::kFloat)).sum().backward();
  auto close = [](const torch::Tensor& x, const torch::Tensor& y) {
    const double scale = y.to(torch::kFloat).abs().max().item<double>();
    return (x.to(torch::kFloat) - y.to(torch::kFloat)).abs().max().item<double>() <= 2e-2 * std::max(scale, 1e-3);
  };
  EXPECT_TRUE(close(ya, yb));
  EXPECT_TRUE(torch::equal(yc, ya));
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_TRUE(close(a[i].grad(), b[i].grad())) << "gradient " << i;
    EXPECT_TRUE(torch::equal(c[i].grad(), a[i].grad())) << "gradient " << i;
  }
}

TEST(MoeOpsTest, SequenceBalanceLossIsOneWhenEvenAndGrowsWithTheSkew) {
  // Two sequences of 4 tokens, 4 experts, top 1: each sequence sends one token to each expert.
  torch::Tensor even = torch::full({8, 4}, -5.0f);
  for (int t = 0; t < 8; ++t) even[t][t % 4] = 5.0f;
  Routing r = Route(even, {}, {.top_k = 1, .norm_topk = false});
  EXPECT_NEAR(SequenceBalanceLoss(r, 4, Score::kSoftmax).item<float>(), 1.0f, 1e-5);
  // Every token to expert 0: f_0 = 4, P_0 near 1.
  torch::Tensor skewed = torch::full({8, 4}, -5.0f).requires_grad_();
  torch::Tensor up = torch::zeros({8, 4});
  up.select(1, 0).fill_(10.0f);
  Routing s = Route(skewed + up, {}, {.top_k = 1, .norm_topk = false});
  const torch::Tensor loss = SequenceBalanceLoss(s, 4, Score::kSoftmax);
  EXPECT_GT(loss.item<float>(), 3.9f);
  const torch::Tensor g = torch::autograd::grad({loss}, {skewed})[0];
  EXPECT_GT(g.select(1, 0).min().item<float>(), 0.0f);  // pushes expert 0's logits down
  // z-loss: logsumexp² of zero logits over 4 experts is log(4)².
  EXPECT_NEAR(ZLoss(torch::zeros({3, 4})).item<float>(), std::log(4.0f) * std::log(4.0f), 1e-5);
}

}  // namespace
}  // namespace ltrain::worker::moe
