// The worker's own CUDA kernels against the LibTorch operations they replace. Skips where there is
// no GPU or the worker was built without CUDA kernels.
#include <cstdio>
#include <functional>
#include <limits>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include <torch/cuda.h>
#include <torch/torch.h>

// LibTorch's sync debug mode, where its CUDA headers are there (a LibTorch built with CUDA).
#if __has_include(<cuda_runtime_api.h>) && __has_include(<c10/cuda/impl/cuda_cmake_macros.h>)
#include <c10/cuda/CUDAFunctions.h>
#define LTRAIN_TEST_SYNC_DEBUG 1
#else
#define LTRAIN_TEST_SYNC_DEBUG 0
#endif

#include "worker/comm/communicator.h"
#include "worker/model/fused_kernels.h"
#include "worker/torch_compat.h"
#include "tests/unit/tensor_compare.h"

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

// bf16 CUDA parameters that live at an offset inside one flat buffer, as the parameter store lays
// them out (so their addresses are not 256-byte aligned).
std::vector<torch::Tensor> FlatParams(const std::vector<std::vector<int64_t>>& shapes, int64_t offset) {
  const torch::TensorOptions bf16 = torch::TensorOptions().dtype(torch::kBFloat16).device(torch::kCUDA);
  int64_t total = offset;
  for (const auto& shape : shapes) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    total += n;
  }
  torch::Tensor flat = torch::empty({total}, bf16);
  std::vector<torch::Tensor> out;
  int64_t at = offset;
  for (const auto& shape : shapes) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    torch::Tensor p = flat.narrow(0, at, n).view(shape);
    {
      torch::NoGradGuard no_grad;
      p.copy_(torch::randn(shape) * (shape.size() == 1 ? 0.5 : 0.05));
    }
    out.push_back(p.detach().requires_grad_(true));
    at += n;
  }
  return out;
}

// The reference in fp32 from the same bf16 values: output and the gradients of `inputs`.
std::vector<torch::Tensor> Fp32Reference(const std::vector<torch::Tensor>& inputs,
                                         const std::function<torch::Tensor(const std::vector<torch::Tensor>&)>& fn,
                                         const torch::Tensor& grad_out) {
  std::vector<torch::Tensor> leaves;
  for (const auto& t : inputs) leaves.push_back(t.defined() ? t.detach().to(torch::kFloat).requires_grad_(true) : t);
  torch::Tensor y = fn(leaves);
  y.backward(grad_out.to(torch::kFloat));
  std::vector<torch::Tensor> out = {y.detach()};
  for (const auto& t : leaves) out.push_back(t.defined() ? t.grad() : t);
  return out;
}

// grad_in_logits: the logits' gradient is written into the logits' own memory, and is the gradient
// the kernel writes into a buffer of its own.
TEST(FusedKernelsTest, CrossEntropyWritesItsGradientOverTheLogits) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  const torch::TensorOptions bf16 = torch::TensorOptions().dtype(torch::kBFloat16).device(torch::kCUDA);
  torch::manual_seed(31);
  for (const int64_t vocab : {50304, 1001}) {
    const torch::Tensor base = (torch::randn({64, vocab}) * 3).to(bf16);
    const torch::Tensor targets =
        torch::randint(0, vocab, {64}, torch::TensorOptions().dtype(torch::kLong).device(torch::kCUDA));
    if (!FusedCrossEntropyAvailable(base)) GTEST_SKIP() << "worker built without CUDA kernels";
    auto run = [&](bool in_place) {
      torch::Tensor leaf = base.clone().requires_grad_(true);
      torch::Tensor logits = leaf * 1;  // not a leaf: the gradient that arrives is the kernel's own tensor
      const void* memory = logits.data_ptr();
      torch::Tensor seen;
      logits.register_hook([&seen](const torch::Tensor& g) { seen = g; });
      torch::Tensor loss = FusedCrossEntropy(logits, targets, in_place);
      logits = torch::Tensor();
      (loss * 2).backward();
      return std::make_pair(seen, seen.data_ptr() == memory);
    };
    const auto [apart, apart_same] = run(false);
    const auto [over, over_same] = run(true);
    EXPECT_FALSE(apart_same) << vocab;
    EXPECT_TRUE(over_same) << vocab;
    EXPECT_TRUE(torch::equal(over, apart)) << vocab;
  }
}

TEST(FusedKernelsTest, LinearMatchesLibTorch) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  const torch::TensorOptions bf16 = torch::TensorOptions().dtype(torch::kBFloat16).device(torch::kCUDA);
  torch::manual_seed(11);
  for (const int64_t offset : {0, 8}) {
    std::vector<torch::Tensor> wb = FlatParams({{384, 256}, {384}}, offset);
    if (!FusedLinearAvailable(torch::zeros({1, 256}, bf16), wb[0])) GTEST_SKIP() << "worker built without CUDA kernels";
    torch::Tensor x = torch::randn({4, 1024, 256}, bf16).requires_grad_(true);
    torch::Tensor grad_out = torch::randn({4, 1024, 384}, bf16);
    // The second case also adds a residual in the product.
    torch::Tensor residual = offset != 0 ? torch::randn({4, 1024, 384}, bf16).requires_grad_(true) : torch::Tensor();
    std::vector<torch::Tensor> ref = Fp32Reference(
        {x, wb[0], wb[1], residual},
        [](const std::vector<torch::Tensor>& t) {
          torch::Tensor y = at::linear(t[0], t[1], t[2]);
          return t[3].defined() ? t[3] + y : y;
        },
        grad_out);

    // With gradients already there (as the parameter store keeps them) the new ones are added to them
    // (the weight's by the product, the bias's by the column sums).
    if (offset != 0) {
      for (int i : {0, 1}) {
        torch::Tensor earlier = torch::randn(wb[i].sizes(), bf16) * ref[2 + i].abs().max().item<double>();
        wb[i].mutable_grad() = earlier.clone();
        ref[2 + i] += earlier.to(torch::kFloat);
      }
    }
    torch::Tensor y = FusedLinear(x, wb[0], wb[1], residual);
    y.backward(grad_out);
    ASSERT_EQ(y.sizes(), ref[0].sizes());
    EXPECT_LE(RelativeError(y, ref[0]), 0.02) << "offset " << offset;
    EXPECT_LE(RelativeError(x.grad(), ref[1]), 0.02);
    EXPECT_LE(RelativeError(wb[0].grad(), ref[2]), 0.02);
    EXPECT_LE(RelativeError(wb[1].grad(), ref[3]), 0.02);
    if (residual.defined()) {
      EXPECT_LE(RelativeError(residual.grad(), ref[4]), 1e-6);
    }
  }
}

// Also with the GELU's output recomputed in backward (selective recompute), which must give the
// same gradients.
TEST(FusedKernelsTest, MlpMatchesLibTorch) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  const torch::TensorOptions bf16 = torch::TensorOptions().dtype(torch::kBFloat16).device(torch::kCUDA);
  torch::manual_seed(12);
  const std::pair<bool, bool> cases[] = {{true, false}, {false, false}, {true, true}, {false, true}};  // bias2, recompute
  for (const auto& [bias2, recompute] : cases) {
    std::vector<torch::Tensor> p = FlatParams({{1024, 256}, {1024}, {256, 1024}, {256}}, bias2 ? 0 : 24);
    if (!FusedLinearAvailable(torch::zeros({1, 256}, bf16), p[0])) GTEST_SKIP() << "worker built without CUDA kernels";
    torch::Tensor b2 = bias2 ? p[3] : torch::Tensor();
    torch::Tensor x = torch::randn({2, 64, 256}, bf16).requires_grad_(true);
    torch::Tensor grad_out = torch::randn({2, 64, 256}, bf16);
    // With the second bias, also a residual added in the second product.
    torch::Tensor residual = bias2 ? torch::randn({2, 64, 256}, bf16).requires_grad_(true) : torch::Tensor();
    std::vector<torch::Tensor> ref = Fp32Reference(
        {x, p[0], p[1], p[2], b2, residual},
        [](const std::vector<torch::Tensor>& t) {
          torch::Tensor h = torch::gelu(at::linear(t[0], t[1], t[2]), "tanh");
          torch::Tensor y = t[4].defined() ? at::linear(h, t[3], t[4]) : at::linear(h, t[3]);
          return t[5].defined() ? t[5] + y : y;
        },
        grad_out);

    if (!bias2) {
      p[2].mutable_grad() = torch::ones({256, 1024}, bf16) * ref[4].abs().max().item<double>();
      ref[4] += p[2].grad().to(torch::kFloat);
    }
    torch::Tensor y = FusedMlp(x, p[0], p[1], p[2], b2, residual, nullptr, recompute);
    y.backward(grad_out);
    ASSERT_EQ(y.sizes(), ref[0].sizes());
    EXPECT_LE(RelativeError(y, ref[0]), 0.02) << "bias2 " << bias2 << " recompute " << recompute;
    EXPECT_LE(RelativeError(x.grad(), ref[1]), 0.02);
    EXPECT_LE(RelativeError(p[0].grad(), ref[2]), 0.02);
    EXPECT_LE(RelativeError(p[1].grad(), ref[3]), 0.02);
    EXPECT_LE(RelativeError(p[2].grad(), ref[4]), 0.02);
    if (bias2) {
      EXPECT_LE(RelativeError(p[3].grad(), ref[5]), 0.02);
      EXPECT_LE(RelativeError(residual.grad(), ref[6]), 1e-6);
    } else {
      EXPECT_FALSE(p[3].grad().defined());
    }
  }
}

// An fp32 residual stream: the products add the fp32 residual in their epilogue and return fp32
// (the bias added in fp32 too); backward casts the output gradient to bf16 once for the products and
// hands the residual its gradient unchanged.
TEST(FusedKernelsTest, ProductsAddAnFp32Residual) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  const torch::TensorOptions bf16 = torch::TensorOptions().dtype(torch::kBFloat16).device(torch::kCUDA);
  const torch::TensorOptions f32 = bf16.dtype(torch::kFloat);
  torch::manual_seed(14);
  std::vector<torch::Tensor> p = FlatParams({{1024, 256}, {1024}, {256, 1024}, {256}}, 8);
  if (!FusedLinearAvailable(torch::zeros({1, 256}, bf16), p[0])) GTEST_SKIP() << "worker built without CUDA kernels";
  for (const bool mlp : {false, true}) {
    for (torch::Tensor& t : p) t.mutable_grad() = torch::Tensor();
    torch::Tensor x = torch::randn({2, 64, mlp ? 256 : 1024}, bf16).requires_grad_(true);
    // A residual large next to the product: rounding the sum to bf16 would show.
    torch::Tensor residual = (100 + torch::randn({2, 64, 256}, f32)).requires_grad_(true);
    torch::Tensor grad_out = torch::randn({2, 64, 256}, f32);
    std::vector<torch::Tensor> ref = Fp32Reference(
        {x, p[0], p[1], p[2], p[3], residual},
        [&](const std::vector<torch::Tensor>& t) {
          if (!mlp) return t[5] + at::linear(t[0], t[3], t[4]);
          return t[5] + at::linear(torch::gelu(at::linear(t[0], t[1], t[2]), "tanh"), t[3], t[4]);
        },
        grad_out.to(torch::kBFloat16));
    torch::Tensor y = mlp ? FusedMlp(x, p[0], p[1], p[2], p[3], residual) : FusedLinear(x, p[2], p[3], residual);
    y.backward(grad_out);
    ASSERT_EQ(y.scalar_type(), torch::kFloat);
    ASSERT_EQ(y.sizes(), ref[0].sizes());
    // The product is rounded to bf16 before the add at most: the sum is within that of the reference.
    const double product_scale = (ref[0] - residual.detach()).abs().max().item<double>();
    EXPECT_LE((y - ref[0]).abs().max().item<double>(), 0.02 * product_scale) << "mlp " << mlp;
    EXPECT_TRUE(torch::equal(residual.grad(), grad_out)) << "mlp " << mlp;
    EXPECT_LE(RelativeError(x.grad(), ref[1]), 0.02) << "mlp " << mlp;
    if (mlp) {
      EXPECT_LE(RelativeError(p[0].grad(), ref[2]), 0.02);
      EXPECT_LE(RelativeError(p[1].grad(), ref[3]), 0.02);
    }
    EXPECT_LE(RelativeError(p[2].grad(), ref[4]), 0.02) << "mlp " << mlp;
    EXPECT_LE(RelativeError(p[3].grad(), ref[5]), 0.02) << "mlp " << mlp;
  }
}

// A block's shape on an fp32 residual stream: a product adds into the stream and a layer norm reads
// it. The norm's backward writes the stream's gradient and its bf16 copy in one pass; the product
// reads the copy. Gradients against the fp32 reference.
TEST(FusedKernelsTest, NormAndProductOnAnFp32Stream) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  const torch::TensorOptions bf16 = torch::TensorOptions().dtype(torch::kBFloat16).device(torch::kCUDA);
  const torch::TensorOptions f32 = bf16.dtype(torch::kFloat);
  torch::manual_seed(15);
  std::vector<torch::Tensor> p = FlatParams({{256, 512}, {256}, {256}, {256}}, 0);
  if (!FusedLinearAvailable(torch::zeros({1, 512}, bf16), p[0])) GTEST_SKIP() << "worker built without CUDA kernels";
  {
    torch::NoGradGuard no_grad;
    p[2].add_(1);  // the norm's weight about 1
  }
  torch::Tensor x = torch::randn({4, 128, 512}, bf16).requires_grad_(true);
  torch::Tensor stream = (4 * torch::randn({4, 128, 256}, f32)).requires_grad_(true);
  torch::Tensor grad_a = torch::randn({4, 128, 256}, bf16), grad_r = torch::randn({4, 128, 256}, f32);
  auto block = [](const std::vector<torch::Tensor>& t, bool fused) {
    torch::Tensor h = fused ? FusedLinear(t[0], t[1], t[2], t[5]) : t[5] + at::linear(t[0], t[1], t[2]);
    if (fused) {
      auto [a, r] = FusedLayerNorm(h, t[3], t[4]);
      return std::vector<torch::Tensor>{a, r};
    }
    return std::vector<torch::Tensor>{torch::layer_norm(h, {h.size(-1)}, t[3], t[4]), h};
  };
  std::vector<torch::Tensor> leaves;
  for (const torch::Tensor& t : {x, p[0], p[1], p[2], p[3], stream}) leaves.push_back(t.detach().to(torch::kFloat).requires_grad_(true));
  std::vector<torch::Tensor> ref = block(leaves, false);
  torch::autograd::backward(ref, {grad_a.to(torch::kFloat), grad_r});
  std::vector<torch::Tensor> out = block({x, p[0], p[1], p[2], p[3], stream}, true);
  ASSERT_EQ(out[0].scalar_type(), torch::kBFloat16);
  ASSERT_EQ(out[1].scalar_type(), torch::kFloat);
  torch::autograd::backward(out, {grad_a, grad_r});
  EXPECT_LE(RelativeError(out[0], ref[0]), 0.02);
  EXPECT_LE(RelativeError(out[1], ref[1]), 0.01);
  EXPECT_LE(RelativeError(stream.grad(), leaves[5].grad()), 0.005);
  EXPECT_LE(RelativeError(x.grad(), leaves[0].grad()), 0.02);
  EXPECT_LE(RelativeError(p[0].grad(), leaves[1].grad()), 0.02);
  EXPECT_LE(RelativeError(p[1].grad(), leaves[2].grad()), 0.02);
  EXPECT_LE(RelativeError(p[2].grad(), leaves[3].grad()), 0.02);
  EXPECT_LE(RelativeError(p[3].grad(), leaves[4].grad()), 0.02);
  ZeroStaleGradients();
}

// The bias gradient of the product that writes an fp32 stream comes from the column sums the norm's
// backward takes in its pass over the stream's gradient: rows held by a warp (256, 768 columns) and
// by a block (2048), after a linear layer and after an MLP. Two backward passes: the first makes the
// gradients, the second adds into them.
TEST(FusedKernelsTest, ANormsBackwardSumsTheBiasGradientOfTheProductBeforeIt) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  const torch::TensorOptions bf16 = torch::TensorOptions().dtype(torch::kBFloat16).device(torch::kCUDA);
  const torch::TensorOptions f32 = bf16.dtype(torch::kFloat);
  for (const auto& [mlp, cols] : std::vector<std::pair<bool, int64_t>>{{false, 256}, {true, 768}, {false, 2048}}) {
    torch::manual_seed(16);
    const int64_t in = 512, hidden = 1024;
    std::vector<torch::Tensor> p =
        mlp ? FlatParams({{hidden, in}, {hidden}, {cols, hidden}, {cols}, {cols}, {cols}}, 0)
            : FlatParams({{cols, in}, {cols}, {cols}, {cols}}, 0);
    if (!FusedLinearAvailable(torch::zeros({1, in}, bf16), p[0])) GTEST_SKIP() << "worker built without CUDA kernels";
    const size_t n = p.size();  // the norm's weight and bias are the last two
    {
      torch::NoGradGuard no_grad;
      p[n - 2].add_(1);
    }
    torch::Tensor x = torch::randn({4, 128, in}, bf16).requires_grad_(true);
    torch::Tensor stream = (4 * torch::randn({4, 128, cols}, f32)).requires_grad_(true);
    torch::Tensor grad_a = torch::randn({4, 128, cols}, bf16), grad_r = torch::randn({4, 128, cols}, f32);
    auto block = [&](const std::vector<torch::Tensor>& t, bool fused) {
      const torch::Tensor& s = t.back();
      torch::Tensor h;
      if (fused) {
        h = mlp ? FusedMlp(t[0], t[1], t[2], t[3], t[4], s) : FusedLinear(t[0], t[1], t[2], s);
        auto [a, r] = FusedLayerNorm(h, t[n - 1], t[n]);
        return std::vector<torch::Tensor>{a, r};
      }
      h = s + (mlp ? at::linear(torch::gelu(at::linear(t[0], t[1], t[2]), "tanh"), t[3], t[4])
                   : at::linear(t[0], t[1], t[2]));
      return std::vector<torch::Tensor>{torch::layer_norm(h, {h.size(-1)}, t[n - 1], t[n]), h};
    };
    std::vector<torch::Tensor> inputs = {x};
    inputs.insert(inputs.end(), p.begin(), p.end());
    inputs.push_back(stream);
    std::vector<torch::Tensor> leaves;
    for (const torch::Tensor& t : inputs) leaves.push_back(t.detach().to(torch::kFloat).requires_grad_(true));
    std::vector<torch::Tensor> ref = block(leaves, false);
    torch::autograd::backward(ref, {grad_a.to(torch::kFloat), grad_r});
    for (int pass = 1; pass <= 2; ++pass) {
      std::vector<torch::Tensor> out = block(inputs, true);
      torch::autograd::backward(out, {grad_a, grad_r});
      const std::string where = (mlp ? "mlp, " : "linear, ") + std::to_string(cols) + " columns, pass " + std::to_string(pass);
      for (size_t i = 0; i < n; ++i) {
        EXPECT_LE(RelativeError(p[i].grad() / pass, leaves[1 + i].grad()), 0.02) << where << ", parameter " << i;
      }
      EXPECT_LE(RelativeError(stream.grad() / pass, leaves.back().grad()), 0.005) << where;
    }
    ZeroStaleGradients();
  }
}

TEST(FusedKernelsTest, QkvMatchesLibTorch) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  const torch::TensorOptions bf16 = torch::TensorOptions().dtype(torch::kBFloat16).device(torch::kCUDA);
  torch::manual_seed(14);
  const int64_t heads = 4, d = 64, c = heads * d;
  // Gradients straight from the attention kernel (in the layout it was given), and gradients in
  // another layout (stacked: contiguous [b, heads, t, d] slices).
  for (const bool attention : {true, false}) {
    std::vector<torch::Tensor> wb = FlatParams({{3 * c, 256}, {3 * c}}, attention ? 8 : 0);
    if (!FusedLinearAvailable(torch::zeros({1, 256}, bf16), wb[0])) GTEST_SKIP() << "worker built without CUDA kernels";
    torch::Tensor x = torch::randn({2, 128, 256}, bf16).requires_grad_(true);
    auto split = [&](const torch::Tensor& y) {
      torch::Tensor parts = y.view({2, 128, 3, heads, d});
      return std::vector<torch::Tensor>{parts.select(2, 0).transpose(1, 2), parts.select(2, 1).transpose(1, 2),
                                        parts.select(2, 2).transpose(1, 2)};
    };
    auto consume = [&](const std::vector<torch::Tensor>& qkv) {
      if (!attention) return torch::stack(qkv);
      return compat::CausalAttention(qkv[0], qkv[1], qkv[2]);
    };
    torch::Tensor grad_out = attention ? torch::randn({2, heads, 128, d}, bf16) : torch::randn({3, 2, heads, 128, d}, bf16);
    std::vector<torch::Tensor> ref = Fp32Reference(
        {x, wb[0], wb[1]}, [&](const std::vector<torch::Tensor>& t) { return consume(split(at::linear(t[0], t[1], t[2]))); },
        grad_out);
    // With gradients already there (attention's case), the new ones are added to them.
    if (attention) {
      for (int i : {0, 1}) {
        torch::Tensor earlier = torch::randn(wb[i].sizes(), bf16) * ref[2 + i].abs().max().item<double>();
        wb[i].mutable_grad() = earlier.clone();
        ref[2 + i] += earlier.to(torch::kFloat);
      }
    }
    std::vector<torch::Tensor> qkv = FusedQkv(x, wb[0], wb[1], heads);
    ASSERT_EQ(qkv.size(), 3u);
    for (const auto& t : qkv) EXPECT_EQ(t.sizes(), (std::vector<int64_t>{2, heads, 128, d}));
    torch::Tensor y = consume(qkv);
    y.backward(grad_out);
    EXPECT_LE(RelativeError(y, ref[0]), 0.02) << "attention " << attention;
    EXPECT_LE(RelativeError(x.grad(), ref[1]), 0.02);
    EXPECT_LE(RelativeError(wb[0].grad(), ref[2]), 0.02);
    EXPECT_LE(RelativeError(wb[1].grad(), ref[3]), 0.02);
  }
}

TEST(FusedKernelsTest, LayerNormMatchesLibTorch) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  const torch::TensorOptions bf16 = torch::TensorOptions().dtype(torch::kBFloat16).device(torch::kCUDA);
  if (!FusedCrossEntropyAvailable(torch::zeros({1, 8}, bf16))) GTEST_SKIP() << "worker built without CUDA kernels";
  torch::manual_seed(13);
  // The benchmark's width with 16-byte aligned weights (our input-gradient kernel, the row in
  // registers), wider rows (two and four vectors a thread, and two passes over the row); rows that do
  // not fill the last chunk nor the last column block, with the weights 8 bytes into a flat buffer as
  // the parameter store may place them (LibTorch's input gradient and a separate add); narrow rows
  // (a warp per row, one, two and up to four vectors a lane).
  // Each with a bf16 input and with an fp32 one (an fp32 residual stream: our forward kernel, the
  // output bf16, the input gradient fp32).
  for (const auto& [rows, cols, offset, fp32] : std::vector<std::tuple<int64_t, int64_t, int64_t, bool>>{
           {4096, 2048, 0, false}, {64, 4096, 0, false}, {40, 6144, 0, false}, {16, 16384, 0, false}, {1001, 776, 4, false},
           {333, 256, 0, false}, {100, 512, 0, false}, {4096, 2048, 0, true}, {64, 4096, 0, true}, {40, 6144, 0, true},
           {16, 16384, 0, true}, {1001, 776, 4, true}, {1001, 768, 0, true}, {333, 256, 0, true}, {100, 512, 0, true}}) {
    const torch::TensorOptions in = fp32 ? bf16.dtype(torch::kFloat) : bf16;
    torch::Tensor flat = torch::empty({offset + 2 * cols}, bf16);
    torch::Tensor w = flat.narrow(0, offset, cols), b = flat.narrow(0, offset + cols, cols);
    {
      torch::NoGradGuard no_grad;
      w.copy_(1 + 0.1 * torch::randn({cols}, bf16));
      b.copy_(0.1 * torch::randn({cols}, bf16));
    }
    w = w.detach().requires_grad_(true);
    b = b.detach().requires_grad_(true);
    torch::Tensor x = (2 * torch::randn({rows, cols}, in) + 0.5).requires_grad_(true);
    torch::Tensor grad_out = torch::randn({rows, cols}, bf16);
    // The residual branch's gradient, added to the input gradient in the kernel.
    torch::Tensor grad_res = torch::randn({rows, cols}, in);
    std::vector<torch::Tensor> ref = Fp32Reference(
        {x, w, b}, [](const std::vector<torch::Tensor>& t) { return torch::layer_norm(t[0], {t[0].size(-1)}, t[1], t[2]); },
        grad_out);
    // Some with gradients already there (as the parameter store keeps them): the kernel adds to them.
    if (rows == 4096 || rows == 333) {
      for (int i : {0, 1}) {
        torch::Tensor& p = i == 0 ? w : b;
        torch::Tensor earlier = torch::randn({cols}, bf16) * ref[2 + i].abs().max().item<double>();
        p.mutable_grad() = earlier.clone();
        ref[2 + i] += earlier.to(torch::kFloat);
      }
    }

    ASSERT_TRUE(FusedLayerNormAvailable(x, w, b));
    auto [y, x_res] = FusedLayerNorm(x, w, b);
    torch::autograd::backward({y, x_res}, {grad_out, grad_res});
    EXPECT_EQ(y.scalar_type(), torch::kBFloat16);
    EXPECT_EQ(x.grad().scalar_type(), x.scalar_type());
    EXPECT_LE(RelativeError(y, ref[0]), 0.02) << rows << "x" << cols << " fp32 " << fp32;
    EXPECT_LE(RelativeError(x_res, x), 0.0);
    EXPECT_LE(RelativeError(x.grad(), ref[1] + grad_res.to(torch::kFloat)), fp32 ? 0.005 : 0.02);
    EXPECT_LE(RelativeError(w.grad(), ref[2]), 0.02);
    EXPECT_LE(RelativeError(b.grad(), ref[3]), 0.02);
  }
}

// An fp32 stream's norm keeps its input for backward in bf16: for the layer norm x − mean, so that
// x̂ keeps its precision where the rows' mean is large against their spread (x itself in bf16 would
// put an error of about mean / 256 into x − mean).
TEST(FusedKernelsTest, AnFp32StreamsNormKeepsXHatsPrecisionFarFromZero) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  const torch::TensorOptions bf16 = torch::TensorOptions().dtype(torch::kBFloat16).device(torch::kCUDA);
  if (!FusedCrossEntropyAvailable(torch::zeros({1, 8}, bf16))) GTEST_SKIP() << "worker built without CUDA kernels";
  torch::manual_seed(23);
  for (const int64_t cols : {768, 2048, 16384}) {
    const int64_t rows = 512;
    torch::Tensor w = (1 + 0.1 * torch::randn({cols}, bf16)).requires_grad_(true);
    torch::Tensor b = (0.1 * torch::randn({cols}, bf16)).requires_grad_(true);
    torch::Tensor x = (torch::randn({rows, cols}, bf16.dtype(torch::kFloat)) + 64).requires_grad_(true);
    torch::Tensor grad_out = torch::randn({rows, cols}, bf16);
    std::vector<torch::Tensor> ref = Fp32Reference(
        {x, w, b}, [](const std::vector<torch::Tensor>& t) { return torch::layer_norm(t[0], {t[0].size(-1)}, t[1], t[2]); },
        grad_out);
    FusedLayerNorm(x, w, b).first.backward(grad_out);
    EXPECT_LE(RelativeError(x.grad(), ref[1]), 0.01) << cols << " columns";
    EXPECT_LE(RelativeError(w.grad(), ref[2]), 0.01) << cols << " columns";
    EXPECT_LE(RelativeError(b.grad(), ref[3]), 0.01) << cols << " columns";
  }
}

// The narrow rows' backward sums the weight gradients beside the input gradient in a fixed order:
// the same inputs give the same bits.
TEST(FusedKernelsTest, NormWeightGradientsAreDeterministic) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  const torch::TensorOptions bf16 = torch::TensorOptions().dtype(torch::kBFloat16).device(torch::kCUDA);
  if (!FusedCrossEntropyAvailable(torch::zeros({1, 8}, bf16))) GTEST_SKIP() << "worker built without CUDA kernels";
  torch::manual_seed(17);
  // A warp per row (768 columns) and a block per row (2048), each summing the weight gradients in
  // the input gradient's pass.
  for (const int64_t cols : {768, 2048}) {
    torch::Tensor x0 = torch::randn({8192, cols}, bf16.dtype(torch::kFloat));
    torch::Tensor w0 = 1 + 0.1 * torch::randn({cols}, bf16), b0 = 0.1 * torch::randn({cols}, bf16);
    torch::Tensor grad_out = torch::randn({8192, cols}, bf16);
    auto grads = [&](bool rms) {
      torch::Tensor x = x0.clone().requires_grad_(true), w = w0.clone().requires_grad_(true);
      torch::Tensor b = b0.clone().requires_grad_(true);
      torch::Tensor y = rms ? FusedRmsNorm(x, w, 1e-5).first : FusedLayerNorm(x, w, b).first;
      y.backward(grad_out);
      return rms ? std::vector<torch::Tensor>{x.grad(), w.grad()}
                 : std::vector<torch::Tensor>{x.grad(), w.grad(), b.grad()};
    };
    for (const bool rms : {false, true}) {
      std::vector<torch::Tensor> first = grads(rms), second = grads(rms);
      for (size_t i = 0; i < first.size(); ++i) {
        EXPECT_TRUE(torch::equal(first[i], second[i])) << cols << " columns, rms " << rms << " " << i;
      }
    }
  }
  ZeroStaleGradients();
}

// llama_model.RMSNorm in fp32 against our backward, the residual branch's gradient added in the kernel.
TEST(FusedKernelsTest, RmsNormMatchesTheComposite) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  const torch::TensorOptions bf16 = torch::TensorOptions().dtype(torch::kBFloat16).device(torch::kCUDA);
  if (!FusedRmsNormAvailable(torch::zeros({1, 8}, bf16), torch::ones({8}, bf16))) {
    GTEST_SKIP() << "worker built without CUDA kernels";
  }
  torch::manual_seed(19);
  const double eps = 1e-5;
  // As the layer norm's: the row in registers (one, two and four vectors a thread), two passes over
  // wide rows, and an unaligned weight (the composite's backward and a separate add).
  for (const auto& [rows, cols, offset, fp32] : std::vector<std::tuple<int64_t, int64_t, int64_t, bool>>{
           {4096, 2048, 0, false}, {64, 4096, 0, false}, {40, 6144, 0, false}, {16, 16384, 0, false}, {1001, 776, 4, false},
           {333, 256, 0, false}, {100, 512, 0, false}, {4096, 2048, 0, true}, {64, 4096, 0, true}, {40, 6144, 0, true},
           {16, 16384, 0, true}, {1001, 776, 4, true}, {1001, 768, 0, true}, {333, 256, 0, true}, {100, 512, 0, true}}) {
    const torch::TensorOptions in = fp32 ? bf16.dtype(torch::kFloat) : bf16;
    torch::Tensor flat = torch::empty({offset + cols}, bf16);
    torch::Tensor w = flat.narrow(0, offset, cols);
    {
      torch::NoGradGuard no_grad;
      w.copy_(1 + 0.1 * torch::randn({cols}, bf16));
    }
    w = w.detach().requires_grad_(true);
    torch::Tensor x = (2 * torch::randn({rows, cols}, in) + 0.5).requires_grad_(true);
    torch::Tensor grad_out = torch::randn({rows, cols}, bf16), grad_res = torch::randn({rows, cols}, in);
    std::vector<torch::Tensor> ref = Fp32Reference(
        {x, w},
        [&](const std::vector<torch::Tensor>& t) { return t[0] * torch::rsqrt(t[0].pow(2).mean(-1, true) + eps) * t[1]; },
        grad_out);
    // Some with a gradient already there: the kernel adds to it.
    if (rows == 4096 || rows == 333) {
      torch::Tensor earlier = torch::randn({cols}, bf16) * ref[2].abs().max().item<double>();
      w.mutable_grad() = earlier.clone();
      ref[2] += earlier.to(torch::kFloat);
    }
    ASSERT_TRUE(FusedRmsNormAvailable(x, w));
    auto [y, x_res] = FusedRmsNorm(x, w, eps);
    torch::autograd::backward({y, x_res}, {grad_out, grad_res});
    EXPECT_EQ(y.scalar_type(), torch::kBFloat16);
    EXPECT_EQ(x.grad().scalar_type(), x.scalar_type());
    EXPECT_LE(RelativeError(y, ref[0]), 0.02) << rows << "x" << cols << " fp32 " << fp32;
    EXPECT_LE(RelativeError(x_res, x), 0.0);
    EXPECT_LE(RelativeError(x.grad(), ref[1] + grad_res.to(torch::kFloat)), fp32 ? 0.005 : 0.02) << rows << "x" << cols;
    EXPECT_LE(RelativeError(w.grad(), ref[2]), 0.02) << rows << "x" << cols;
  }
}

// Two and three products of one input: outputs, the input gradient summed in the products, and the
// weight gradients, new or added to a .grad the weight already has (as the parameter store's).
TEST(FusedKernelsTest, ProjectionsMatchLibTorch) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  const torch::TensorOptions bf16 = torch::TensorOptions().dtype(torch::kBFloat16).device(torch::kCUDA);
  torch::manual_seed(23);
  for (const bool three : {true, false}) {
    std::vector<std::vector<int64_t>> shapes = {{256, 256}, {64, 256}};
    if (three) shapes.push_back({64, 256});
    std::vector<torch::Tensor> w = FlatParams(shapes, three ? 0 : 8);
    if (!FusedLinearAvailable(torch::zeros({1, 256}, bf16), w[0])) GTEST_SKIP() << "worker built without CUDA kernels";
    // The first weight holds a gradient already: the new one is added to it.
    torch::Tensor before = 0.1 * torch::randn({256, 256}, bf16);
    w[0].mutable_grad() = before.clone();
    torch::Tensor x = torch::randn({2, 128, 256}, bf16).requires_grad_(true);
    int64_t width = 0;
    for (const auto& shape : shapes) width += shape[0];
    torch::Tensor grad_out = torch::randn({2, 128, width}, bf16);
    std::vector<torch::Tensor> inputs = {x};
    inputs.insert(inputs.end(), w.begin(), w.end());
    std::vector<torch::Tensor> ref = Fp32Reference(
        inputs,
        [&](const std::vector<torch::Tensor>& t) {
          std::vector<torch::Tensor> outs;
          for (size_t i = 1; i < t.size(); ++i) outs.push_back(at::linear(t[0], t[i]));
          return torch::cat(outs, -1);
        },
        grad_out);
    std::vector<torch::Tensor> outs = FusedProjections(x, w);
    ASSERT_EQ(outs.size(), w.size());
    for (size_t i = 0; i < outs.size(); ++i) EXPECT_EQ(outs[i].sizes(), (std::vector<int64_t>{2, 128, shapes[i][0]}));
    torch::Tensor y = torch::cat(outs, -1);
    y.backward(grad_out);
    EXPECT_LE(RelativeError(y, ref[0]), 0.02) << three;
    EXPECT_LE(RelativeError(x.grad(), ref[1]), 0.02) << three;
    EXPECT_LE(RelativeError(w[0].grad().to(torch::kFloat) - before.to(torch::kFloat), ref[2]), 0.02) << three;
    for (size_t i = 1; i < w.size(); ++i) EXPECT_LE(RelativeError(w[i].grad(), ref[2 + i]), 0.02) << three << " " << i;
  }
}

// Selective recompute's norm outputs (rebuild_output): the product that reads one keeps the norm's
// bf16 input instead and makes the output again in backward. The output's memory is free once
// forward has returned, and not without rebuild_output (the product keeps it). A layer norm on a
// bf16 input rebuilds forward's output to the bit, so every gradient is the same as with the output
// kept; on an fp32 stream (the norm keeps x − mean in bf16) and for the RMS norm (LibTorch's forward
// on bf16, ours rebuilding) they agree to bf16's precision.
TEST(FusedKernelsTest, ProductsRebuildANormsOutputInsteadOfKeepingIt) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  const torch::TensorOptions bf16 = torch::TensorOptions().dtype(torch::kBFloat16).device(torch::kCUDA);
  if (!FusedLinearAvailable(torch::zeros({1, 256}, bf16), torch::zeros({256, 256}, bf16))) {
    GTEST_SKIP() << "worker built without CUDA kernels";
  }
  enum Consumer { kQkv, kMlp, kProjections };
  for (const Consumer consumer : {kQkv, kMlp, kProjections}) {
    for (const bool fp32 : {false, true}) {
      torch::manual_seed(29);
      const bool rms = consumer == kProjections;
      std::vector<std::vector<int64_t>> shapes = {{256}, {256}};  // the norm's weight and bias
      if (consumer == kQkv) shapes.insert(shapes.end(), {{768, 256}, {768}});
      if (consumer == kMlp) shapes.insert(shapes.end(), {{1024, 256}, {1024}, {256, 1024}, {256}});
      if (consumer == kProjections) shapes.insert(shapes.end(), {{256, 256}, {64, 256}, {64, 256}});
      std::vector<torch::Tensor> p = FlatParams(shapes, 0);
      {
        torch::NoGradGuard no_grad;
        p[0].add_(1);  // the norm's weight about 1
      }
      const torch::TensorOptions in = fp32 ? bf16.dtype(torch::kFloat) : bf16;
      const torch::Tensor x0 = 2 * torch::randn({2, 128, 256}, in) + 0.5;
      const torch::Tensor grad_res = torch::randn({2, 128, 256}, in);
      std::vector<torch::Tensor> grad_outs;
      struct Run {
        std::vector<torch::Tensor> outputs, grads;
        bool freed = false;
      };
      auto run = [&](bool rebuild) {
        torch::Tensor x = x0.clone().requires_grad_(true);
        for (torch::Tensor& t : p) t.mutable_grad() = torch::Tensor();
        auto [a, r] = rms ? FusedRmsNorm(x, p[0], 1e-5, rebuild) : FusedLayerNorm(x, p[0], p[1], rebuild);
        const c10::weak_intrusive_ptr<c10::StorageImpl> storage = a.storage().getWeakStorageImpl();
        std::vector<torch::Tensor> outputs;
        if (consumer == kQkv) outputs = FusedQkv(a, p[2], p[3], 4);
        if (consumer == kMlp) outputs = {FusedMlp(a, p[2], p[3], p[4], p[5])};
        if (consumer == kProjections) outputs = FusedProjections(a, {p[2], p[3], p[4]});
        a = torch::Tensor();
        Run result;
        result.freed = storage.expired();
        if (grad_outs.empty()) {
          for (const torch::Tensor& o : outputs) grad_outs.push_back(torch::randn(o.sizes(), o.options()));
        }
        std::vector<torch::Tensor> roots = outputs, grads = grad_outs;
        roots.push_back(r);
        grads.push_back(grad_res);
        torch::autograd::backward(roots, grads);
        for (const torch::Tensor& o : outputs) result.outputs.push_back(o.detach().clone());
        result.grads.push_back(x.grad().clone());
        for (size_t i = 0; i < p.size(); ++i) {
          if (!rms || i != 1) result.grads.push_back(p[i].grad().clone());
        }
        ZeroStaleGradients();
        return result;
      };
      const Run kept = run(false), rebuilt = run(true);
      const std::string what = std::string(consumer == kQkv ? "qkv" : consumer == kMlp ? "mlp" : "projections") +
                               (fp32 ? " on an fp32 stream" : " on bf16");
      EXPECT_FALSE(kept.freed) << what;
      EXPECT_TRUE(rebuilt.freed) << what;
      ASSERT_EQ(kept.outputs.size(), rebuilt.outputs.size());
      for (size_t i = 0; i < kept.outputs.size(); ++i) EXPECT_TRUE(torch::equal(kept.outputs[i], rebuilt.outputs[i])) << what;
      ASSERT_EQ(kept.grads.size(), rebuilt.grads.size());
      for (size_t i = 0; i < kept.grads.size(); ++i) {
        if (!fp32 && !rms) {
          EXPECT_TRUE(torch::equal(kept.grads[i], rebuilt.grads[i])) << what << ", gradient " << i;
        } else {
          EXPECT_LE(RelativeError(rebuilt.grads[i], kept.grads[i]), 0.01) << what << ", gradient " << i;
        }
      }
    }
  }
}

// With `tp`, the products that read a block's input sum its gradient over tp themselves, on a side
// stream beside their weight gradients. Against a fake group of 2 ranks holding the same tensors
// (its all-reduce doubles), the input gradient is twice the one without tp, exactly, and read only
// after the sum; outputs and weight gradients are the same; one all-reduce of the input per call.
TEST(FusedKernelsTest, ProductsSumTheirInputGradientOverTp) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  const torch::TensorOptions bf16 = torch::TensorOptions().dtype(torch::kBFloat16).device(torch::kCUDA);
  torch::manual_seed(31);
  std::vector<torch::Tensor> p = FlatParams({{1024, 256}, {1024}, {256, 1024}, {768, 256}, {768}, {256, 256}, {64, 256}}, 8);
  if (!FusedLinearAvailable(torch::zeros({1, 256}, bf16), p[0])) GTEST_SKIP() << "worker built without CUDA kernels";
  const torch::Tensor x0 = torch::randn({2, 512, 256}, bf16);
  // Each product's outputs, reduced to one tensor to backpropagate from.
  const std::vector<std::pair<const char*, std::function<torch::Tensor(const torch::Tensor&, Communicator*)>>> products = {
      {"mlp", [&](const torch::Tensor& x, Communicator* tp) { return FusedMlp(x, p[0], p[1], p[2], {}, {}, tp); }},
      {"qkv", [&](const torch::Tensor& x, Communicator* tp) { return torch::stack(FusedQkv(x, p[3], p[4], 4, tp)); }},
      {"projections",
       [&](const torch::Tensor& x, Communicator* tp) { return torch::cat(FusedProjections(x, {p[5], p[6]}, tp), -1); }},
  };
  for (const auto& [name, product] : products) {
    auto run = [&](Communicator* tp) {
      for (auto& t : p) t.mutable_grad() = torch::Tensor();
      torch::Tensor x = x0.clone().requires_grad_(true);
      torch::Tensor y = product(x, tp);
      y.backward(torch::ones_like(y) * 0.01);
      std::vector<torch::Tensor> out = {y.detach(), x.grad()};
      for (auto& t : p) out.push_back(t.grad().defined() ? t.grad().clone() : torch::Tensor());
      return out;
    };
    std::vector<torch::Tensor> alone = run(nullptr);
    FakeCommunicator tp;
    tp.SimulateSize(2);
    std::vector<torch::Tensor> summed = run(&tp);
    ASSERT_EQ(tp.calls(), 1) << name;
    EXPECT_EQ(tp.log()[0].op, "all_reduce") << name;
    EXPECT_EQ(tp.log()[0].numel, x0.numel()) << name;
    EXPECT_TRUE(torch::equal(summed[0], alone[0])) << name;
    EXPECT_TRUE(torch::equal(summed[1], alone[1] * 2)) << name;
    for (size_t i = 2; i < alone.size(); ++i) {
      ASSERT_EQ(summed[i].defined(), alone[i].defined()) << name << " " << i;
      if (alone[i].defined()) {
        EXPECT_TRUE(torch::equal(summed[i], alone[i])) << name << " parameter " << i - 2;
      }
    }
  }
}

// A fake group of 2 whose all-reduce first keeps the stream it runs on busy (a long product).
class SlowSumCommunicator : public FakeCommunicator {
 public:
  SlowSumCommunicator() { SimulateSize(2); }
  Status AllReduceSum(at::Tensor& tensor) override {
    torch::Tensor a = torch::randn({4096, 4096}, tensor.options());
    for (int i = 0; i < 8; ++i) a = torch::matmul(a, a) / 64;
    return FakeCommunicator::AllReduceSum(tensor);
  }
};

// SideStreamSum, both orders: the sum on the side stream reads what the current stream wrote before
// it began (after long work there), and the current stream reads the sum once Finish() returned
// (after long work on the side stream). Against a fake group of 2 (its all-reduce doubles).
TEST(FusedKernelsTest, SideStreamSumIsOrderedWithTheCurrentStreamBothWays) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  const torch::TensorOptions bf16 = torch::TensorOptions().dtype(torch::kBFloat16).device(torch::kCUDA);
  const torch::Tensor w = torch::randn({256, 256}, bf16);
  if (!FusedLinearAvailable(torch::zeros({1, 256}, bf16), w)) GTEST_SKIP() << "worker built without CUDA kernels";
  torch::manual_seed(5);
  const torch::Tensor a = torch::randn({4096, 4096}, bf16) / 64;
  auto long_product = [&] {
    torch::Tensor x = a;
    for (int i = 0; i < 8; ++i) x = torch::matmul(x, a);
    return x;
  };
  const torch::Tensor want = long_product() * 2;
  {
    // The side stream made (its first use creates LibTorch's stream pool, long enough for the GPU
    // to catch up with the work queued before it).
    torch::Tensor warm = torch::zeros({8}, bf16);
    FakeCommunicator once;
    SideStreamSum sum(warm, &once);
  }
  torch::cuda::synchronize();
  {
    FakeCommunicator fast;
    fast.SimulateSize(2);
    torch::Tensor t = long_product();
    SideStreamSum sum(t, &fast);
    sum.Finish();
    EXPECT_TRUE(torch::equal(t, want)) << "the sum read the tensor before the current stream wrote it";
    EXPECT_EQ(fast.calls(), 1);
  }
  {
    SlowSumCommunicator slow;
    torch::Tensor t = long_product();
    torch::cuda::synchronize();
    SideStreamSum sum(t, &slow);
    sum.Finish();
    torch::Tensor seen = t.clone();
    EXPECT_TRUE(torch::equal(seen, want)) << "the current stream read the tensor before the sum";
  }
  torch::Tensor untouched = want.clone();
  SideStreamSum none(untouched, nullptr);
  none.Finish();
  EXPECT_TRUE(torch::equal(untouched, want));
}

// The embedding's gradient added in place to a table gradient that exists (repeated ids included),
// and returned whole where none does; a table of more rows than the batch has tokens (sums over the
// distinct rows) and of fewer (over the whole table).
TEST(FusedKernelsTest, EmbeddingMatchesLibTorch) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  const torch::TensorOptions bf16 = torch::TensorOptions().dtype(torch::kBFloat16).device(torch::kCUDA);
  if (!FusedLlamaOpsAvailable(torch::zeros({8}, bf16))) GTEST_SKIP() << "worker built without CUDA kernels";
  torch::manual_seed(29);
  // 64 columns over 50 rows (runs of about 8 tokens, some across the kernel's pieces of 64 ids); 776
  // columns (four blocks of 256, the last partial) over 5 rows (runs of about 77: longer than a
  // warp's 32 ids and than a piece).
  for (const auto& [d, distinct] : std::vector<std::pair<int64_t, int64_t>>{{64, 50}, {776, 5}}) {
    torch::Tensor ids =
        torch::randint(0, distinct, {4, 96}, torch::TensorOptions().dtype(torch::kLong).device(torch::kCUDA));
    torch::Tensor grad_out = torch::randn({4, 96, d}, bf16);
    const std::vector<std::pair<int64_t, bool>> cases = {{1000, true}, {1000, false}, {64, true}, {64, false}};
    for (const auto& [vocab, existing] : cases) {
      torch::Tensor reference = at::embedding_backward(grad_out.to(torch::kFloat), ids, vocab, -1, false, false);
      torch::Tensor w = torch::randn({vocab, d}, bf16).requires_grad_(true);
      torch::Tensor before = existing ? 0.1 * torch::randn({vocab, d}, bf16) : torch::zeros({vocab, d}, bf16);
      if (existing) w.mutable_grad() = before.clone();
      torch::Tensor y = FusedEmbedding(ids, w);
      EXPECT_LE(RelativeError(y, at::embedding(w.detach(), ids)), 0.0);
      y.backward(grad_out);
      EXPECT_LE(RelativeError(w.grad().to(torch::kFloat) - before.to(torch::kFloat), reference), 0.02)
          << "d " << d << ", vocab " << vocab << ", existing " << existing;
      // Rows the batch did not use keep their gradient.
      torch::Tensor unused = torch::ones({vocab}, torch::TensorOptions().dtype(torch::kBool).device(torch::kCUDA));
      unused.index_put_({ids.reshape({-1})}, false);
      EXPECT_TRUE(w.grad().index({unused}).equal(before.index({unused})))
          << "d " << d << ", vocab " << vocab << ", existing " << existing;
    }
    // The same sums on every run: a row's pieces are added in order, without atomics.
    torch::Tensor w = torch::randn({1000, d}, bf16).requires_grad_(true);
    std::vector<torch::Tensor> runs;
    for (int run = 0; run < 2; ++run) {
      w.mutable_grad() = torch::zeros_like(w);
      FusedEmbedding(ids, w).backward(grad_out);
      runs.push_back(w.grad().clone());
    }
    EXPECT_TRUE(runs[0].equal(runs[1])) << "d " << d;
  }
}

// A row used by thousands of tokens a step (a byte vocabulary's space): its gradient is their sum in
// fp32, rounded once, not a bf16 running sum that stops growing.
TEST(FusedKernelsTest, EmbeddingSumsAFrequentRowsGradientsInFp32) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  const torch::TensorOptions bf16 = torch::TensorOptions().dtype(torch::kBFloat16).device(torch::kCUDA);
  if (!FusedLlamaOpsAvailable(torch::zeros({8}, bf16))) GTEST_SKIP() << "worker built without CUDA kernels";
  torch::manual_seed(31);
  const int64_t d = 128, hot = 32;
  const torch::TensorOptions ids_options = torch::TensorOptions().dtype(torch::kLong).device(torch::kCUDA);
  // A table of fewer rows than the 5120 tokens (sums over the whole table) and of more (over the
  // distinct rows).
  for (const int64_t vocab : {256, 8192}) {
    // 4096 tokens of row `hot` among 1024 others.
    torch::Tensor ids = torch::cat({torch::full({4096}, hot, ids_options), torch::randint(0, vocab, {1024}, ids_options)});
    ids = ids.index_select(0, torch::randperm(ids.numel(), ids_options)).view({4, -1});
    torch::Tensor grad_out = (0.5 + torch::rand({4, ids.size(1), d})).to(bf16);
    torch::Tensor reference = at::embedding_backward(grad_out.to(torch::kFloat), ids, vocab, -1, false, false);
    for (const bool existing : {true, false}) {
      torch::Tensor w = torch::randn({vocab, d}, bf16).requires_grad_(true);
      torch::Tensor before = existing ? torch::randn({vocab, d}, bf16) : torch::zeros({vocab, d}, bf16);
      if (existing) w.mutable_grad() = before.clone();
      FusedEmbedding(ids, w).backward(grad_out);
      torch::Tensor got = w.grad().to(torch::kFloat) - before.to(torch::kFloat);
      // About 4100 on the hot row: the sum's rounding to bf16 and the add's are each up to 0.4% of
      // it; a bf16 running sum stalls near 512.
      const std::string where = "vocab " + std::to_string(vocab) + ", existing " + std::to_string(existing);
      EXPECT_LE(RelativeError(got[hot], reference[hot]), 0.01) << where;
      EXPECT_LE(RelativeError(got, reference), 0.01) << where;
    }
  }
}

// The embedding's backward queues its work without waiting for the GPU, for a table of fewer rows
// than the batch's tokens (sums over the whole table) and of more (over slots of the batch's size):
// LibTorch's sync debug mode, set to error, turns any wait into an exception.
TEST(FusedKernelsTest, EmbeddingBackwardDoesNotWaitForTheGpu) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  const torch::TensorOptions bf16 = torch::TensorOptions().dtype(torch::kBFloat16).device(torch::kCUDA);
  if (!FusedLlamaOpsAvailable(torch::zeros({8}, bf16))) GTEST_SKIP() << "worker built without CUDA kernels";
#if !LTRAIN_TEST_SYNC_DEBUG
  FAIL() << "the worker has CUDA kernels, but this test was built without LibTorch's CUDA headers "
            "(c10/cuda/CUDAFunctions.h and cuda_runtime_api.h on the include path)";
#else
  torch::manual_seed(37);
  const int64_t d = 64;
  for (const int64_t vocab : {64, 4096}) {
    const torch::TensorOptions ids_options = torch::TensorOptions().dtype(torch::kLong).device(torch::kCUDA);
    torch::Tensor ids = torch::randint(0, vocab, {4, 96}, ids_options);
    torch::Tensor grad_out = torch::randn({4, 96, d}, bf16);
    torch::Tensor w = torch::randn({vocab, d}, bf16).requires_grad_(true);
    w.mutable_grad() = torch::zeros({vocab, d}, bf16);  // the gradient the backward adds into
    torch::Tensor y = FusedEmbedding(ids, w);
    torch::cuda::synchronize();
    struct SyncDebugError {
      SyncDebugError() { c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_ERROR); }
      ~SyncDebugError() { c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_DISABLED); }
    };
    {
      SyncDebugError no_waits;
      EXPECT_NO_THROW(y.backward(grad_out)) << "vocab " << vocab;
    }
    torch::Tensor reference = at::embedding_backward(grad_out.to(torch::kFloat), ids, vocab, -1, false, false);
    EXPECT_LE(RelativeError(w.grad(), reference), 0.02) << "vocab " << vocab;
  }
#endif
}

// Rotary embeddings (llama_model.apply_rope) and SwiGLU against the same composite in fp32.
TEST(FusedKernelsTest, RopeAndSwiGluMatchTheComposite) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  const torch::TensorOptions bf16 = torch::TensorOptions().dtype(torch::kBFloat16).device(torch::kCUDA);
  if (!FusedLlamaOpsAvailable(torch::zeros({8}, bf16))) GTEST_SKIP() << "worker built without CUDA kernels";
  torch::manual_seed(17);
  // head_dim 64: eight pairs a thread; 36: one at a time.
  for (const int64_t hd : {64, 36}) {
    const int64_t b = 2, t = 96, heads = 6;
    const torch::TensorOptions f32 = torch::TensorOptions().dtype(torch::kFloat).device(torch::kCUDA);
    torch::Tensor inv = 1.0 / torch::pow(500000.0, torch::arange(0, hd, 2, f32) / static_cast<double>(hd));
    torch::Tensor angles = torch::outer(torch::arange(128, f32), inv);  // longer than t, as the model's tables
    torch::Tensor cos = angles.cos(), sin = angles.sin();
    torch::Tensor x = torch::randn({b, t, heads, hd}, bf16).requires_grad_(true);
    torch::Tensor grad_out = torch::randn({b, t, heads, hd}, bf16);
    std::vector<torch::Tensor> ref = Fp32Reference(
        {x},
        [&](const std::vector<torch::Tensor>& in) {
          std::vector<torch::Tensor> h = in[0].chunk(2, -1);
          torch::Tensor c = cos.narrow(0, 0, t).unsqueeze(1), s = sin.narrow(0, 0, t).unsqueeze(1);
          return torch::cat({h[0] * c - h[1] * s, h[1] * c + h[0] * s}, -1);
        },
        grad_out);
    torch::Tensor y = FusedRope(x, cos, sin);
    y.backward(grad_out);
    EXPECT_LE(RelativeError(y, ref[0]), 0.01) << hd;
    EXPECT_LE(RelativeError(x.grad(), ref[1]), 0.01) << hd;
  }

  // Eight elements a thread, and (1001 columns) one at a time.
  for (int64_t cols : {1024, 1001}) {
    torch::Tensor gate = (2 * torch::randn({4096, cols}, bf16)).requires_grad_(true);
    torch::Tensor up = torch::randn({4096, cols}, bf16).requires_grad_(true);
    torch::Tensor g_out = torch::randn({4096, cols}, bf16);
    std::vector<torch::Tensor> sref = Fp32Reference(
        {gate, up}, [](const std::vector<torch::Tensor>& in) { return torch::silu(in[0]) * in[1]; }, g_out);
    torch::Tensor z = FusedSwiGlu(gate, up);
    z.backward(g_out);
    EXPECT_LE(RelativeError(z, sref[0]), 0.01) << cols;
    EXPECT_LE(RelativeError(gate.grad(), sref[1]), 0.01) << cols;
    EXPECT_LE(RelativeError(up.grad(), sref[2]), 0.01) << cols;
  }
}

// The SwiGLU MLP's down projection under selective recompute (its input made again in backward),
// with and without a residual added in the product: the same values and gradients as the composite.
TEST(FusedKernelsTest, SwiGluDownProjectionMatchesTheComposite) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  const torch::TensorOptions bf16 = torch::TensorOptions().dtype(torch::kBFloat16).device(torch::kCUDA);
  if (!FusedLlamaOpsAvailable(torch::zeros({8}, bf16))) GTEST_SKIP() << "worker built without CUDA kernels";
  torch::manual_seed(19);
  for (const bool with_residual : {true, false}) {
    std::vector<torch::Tensor> p = FlatParams({{256, 512}}, with_residual ? 0 : 8);
    torch::Tensor gate = (2 * torch::randn({2, 64, 512}, bf16)).requires_grad_(true);
    torch::Tensor up = torch::randn({2, 64, 512}, bf16).requires_grad_(true);
    torch::Tensor residual = with_residual ? torch::randn({2, 64, 256}, bf16).requires_grad_(true) : torch::Tensor();
    torch::Tensor grad_out = torch::randn({2, 64, 256}, bf16);
    std::vector<torch::Tensor> ref = Fp32Reference(
        {gate, up, p[0], residual},
        [](const std::vector<torch::Tensor>& t) {
          torch::Tensor y = at::linear(torch::silu(t[0]) * t[1], t[2]);
          return t[3].defined() ? t[3] + y : y;
        },
        grad_out);
    torch::Tensor y = FusedSwiGluLinear(gate, up, p[0], residual);
    y.backward(grad_out);
    ASSERT_EQ(y.sizes(), ref[0].sizes());
    EXPECT_LE(RelativeError(y, ref[0]), 0.02) << "residual " << with_residual;
    EXPECT_LE(RelativeError(gate.grad(), ref[1]), 0.02);
    EXPECT_LE(RelativeError(up.grad(), ref[2]), 0.02);
    EXPECT_LE(RelativeError(p[0].grad(), ref[3]), 0.02);
    if (with_residual) {
      EXPECT_LE(RelativeError(residual.grad(), ref[4]), 1e-6);
    }
  }
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
