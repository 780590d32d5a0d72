// FP8 on the GPU: our quantization kernels and the FP8 products against their references, and the
// linear layers in FP8 against their bf16 products. Skips where there is no GPU, or no FP8 products.
#include <cstdint>
#include <cstdio>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include <torch/cuda.h>
#include <torch/torch.h>

#include "worker/model/fp8_scaling.h"
#include "worker/model/fused_kernels.h"
#include "tests/unit/tensor_compare.h"

namespace ltrain::worker {
namespace {

void ExpectFp8LayersFollowTheirBf16Products(bool rowwise);

// parallel.precision fp8: the layers' products in FP8 (their backward from the copies forward kept)
// give outputs and gradients near the bf16 products' (a Bf16ProductsScope); q, k and v's three
// products read one quantized input. Tensorwise and rowwise scaling.
TEST(FusedKernelsTest, Fp8LayersFollowTheirBf16Products) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  if (!Fp8ProductsAvailable()) GTEST_SKIP() << "no FP8 products here (a build without CUDA kernels or float8, or a GPU before 8.9)";
  for (const bool rowwise : {false, true}) {
    SCOPED_TRACE(rowwise ? "rowwise" : "tensorwise");
    ExpectFp8LayersFollowTheirBf16Products(rowwise);
  }
}

void ExpectFp8LayersFollowTheirBf16Products(bool rowwise) {
  torch::manual_seed(12);
  FusedKernelOptions fp8;
  fp8.fp8 = true;
  fp8.fp8_rowwise = rowwise;
  SetFusedKernelOptions(fp8);
  const auto bf16 = torch::TensorOptions().dtype(torch::kBFloat16).device(torch::kCUDA);
  const std::vector<torch::Tensor> params = {torch::randn({256, 128}, bf16) * 0.05, torch::randn({256}, bf16) * 0.05,
                                             torch::randn({128, 256}, bf16) * 0.05, torch::randn({128}, bf16) * 0.05,
                                             torch::randn({384, 128}, bf16) * 0.05};
  const torch::Tensor x0 = torch::randn({4, 64, 128}, bf16);
  // Outputs and gradients of each layer, as one list.
  auto run = [&](bool in_bf16) {
    const Bf16ProductsScope scope(in_bf16);
    EXPECT_EQ(Fp8ProductsOn(), !in_bf16);
    std::vector<torch::Tensor> p;
    for (const torch::Tensor& t : params) p.push_back(t.clone().requires_grad_(true));
    torch::Tensor x = x0.clone().requires_grad_(true);
    std::vector<torch::Tensor> outputs = {FusedLinear(x, p[0], p[1]), FusedMlp(x, p[0], p[1], p[2], p[3], {}, nullptr, true),
                                          FusedSwiGluLinear(FusedLinear(x, p[0], p[1]), FusedLinear(x, p[0], {}), p[2])};
    for (const torch::Tensor& t : FusedQkv(x, p[4], {}, 4)) outputs.push_back(t);
    // Each output's gradient fixed (the same in both runs): the gradients differ by the products alone.
    torch::Tensor loss = torch::zeros({}, bf16.dtype(torch::kFloat));
    for (size_t i = 0; i < outputs.size(); ++i) {
      torch::manual_seed(100 + static_cast<uint64_t>(i));
      loss = loss + (outputs[i].to(torch::kFloat) * torch::randn(outputs[i].sizes(), bf16.dtype(torch::kFloat))).sum();
    }
    loss.backward();
    ZeroStaleGradients();
    std::vector<torch::Tensor> all = outputs;
    all.push_back(x.grad());
    for (const torch::Tensor& t : p) all.push_back(t.grad());
    return all;
  };
  const std::vector<torch::Tensor> in_fp8 = run(false), in_bf16 = run(true);
  SetFusedKernelOptions({});
  ASSERT_EQ(in_fp8.size(), in_bf16.size());
  for (size_t i = 0; i < in_fp8.size(); ++i) {
    ASSERT_TRUE(in_fp8[i].defined() && in_bf16[i].defined()) << i;
    const torch::Tensor a = in_fp8[i].to(torch::kFloat), b = in_bf16[i].to(torch::kFloat);
    // The outputs (the first 7) differ: the FP8 products ran (the second bias's gradient, a sum of
    // the fixed output gradient, is the same either way).
    if (i < 7) {
      EXPECT_FALSE(torch::equal(a, b)) << i << ": the FP8 products ran";
    }
    const double error = ((a - b).norm() / b.norm()).item<double>();
    EXPECT_LT(error, 0.08) << "output or gradient " << i;
    std::printf("FP8 (%s) against bf16, output or gradient %zu: relative error %.4f\n",
                rowwise ? "rowwise" : "tensorwise", i, error);
  }
}

// FP8: our quantization kernels give what the fp32 reference (fp8_scaling.h) gives, and the FP8
// products what a product of the dequantized operands gives, tensorwise and rowwise.
TEST(FusedKernelsTest, Fp8QuantizationAndProductsMatchTheirReference) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  if (!Fp8ProductsAvailable()) GTEST_SKIP() << "no FP8 products here (a build without CUDA kernels or float8, or a GPU before 8.9)";
  torch::manual_seed(11);
  const auto bf16 = torch::TensorOptions().dtype(torch::kBFloat16).device(torch::kCUDA);
  // Rows of very different magnitudes: rowwise scaling has something to follow.
  torch::Tensor x = (torch::randn({256, 512}) * torch::logspace(-2, 2, 256).unsqueeze(1)).to(bf16);
  torch::Tensor w = (torch::randn({384, 512}) * 0.02).to(bf16);
  // Sides that are not multiples of the wide kernel's 128 x 128 tiles (its partial tiles); rows not of
  // 16 and sides not of 8 (the narrow kernel's); an odd number of values for the amax.
  for (const auto& [rows, cols] : std::vector<std::pair<int64_t, int64_t>>{
           {144, 520}, {48, 200}, {72, 520}, {100, 36}, {13, 24}, {7, 9}}) {
    torch::Tensor t = (torch::randn({rows, cols}) * 3).to(bf16);
    torch::Tensor transposed;
    Fp8Tensor q = Fp8QuantizeOnDevice(t, Fp8Format::kE4M3, Fp8Scaling::kTensorwise, /*power_of_2=*/false, &transposed);
    Fp8Tensor reference = Fp8Quantize(t.cpu(), Fp8Format::kE4M3, Fp8Scaling::kTensorwise, /*power_of_2=*/false);
    EXPECT_TRUE(torch::equal(q.amax.cpu(), reference.amax)) << rows << "x" << cols;
    EXPECT_TRUE(torch::equal(q.data.cpu().to(torch::kFloat), reference.data.to(torch::kFloat))) << rows << "x" << cols;
    EXPECT_TRUE(torch::equal(transposed.cpu().to(torch::kFloat), q.data.cpu().to(torch::kFloat).t())) << rows << "x" << cols;
  }
  for (Fp8Scaling scaling : {Fp8Scaling::kTensorwise, Fp8Scaling::kRowwise}) {
    const bool rowwise = scaling == Fp8Scaling::kRowwise;
    for (Fp8Format format : {Fp8Format::kE4M3, Fp8Format::kE5M2}) {
      torch::Tensor transposed;
      Fp8Tensor q = Fp8QuantizeOnDevice(x, format, scaling, /*power_of_2=*/rowwise, rowwise ? nullptr : &transposed);
      Fp8Tensor reference = Fp8Quantize(x.cpu(), format, scaling, /*power_of_2=*/rowwise);
      EXPECT_TRUE(torch::equal(q.amax.cpu(), reference.amax)) << static_cast<int>(scaling);
      EXPECT_TRUE(torch::allclose(q.scale_inv.cpu(), reference.scale_inv, 1e-6, 0)) << static_cast<int>(scaling);
      EXPECT_TRUE(torch::equal(q.data.cpu().to(torch::kFloat), reference.data.to(torch::kFloat)))
          << "scaling " << static_cast<int>(scaling) << " format " << static_cast<int>(format);
      if (!rowwise) {
        EXPECT_TRUE(torch::equal(transposed.cpu().to(torch::kFloat), q.data.cpu().to(torch::kFloat).t()));
      }
    }
    // y = x · wᵀ with e4m3 operands; then a gradient-like product with one e5m2 operand.
    Fp8Tensor xq = Fp8QuantizeOnDevice(x, Fp8Format::kE4M3, scaling, rowwise);
    Fp8Tensor wq = Fp8QuantizeOnDevice(w, Fp8Format::kE4M3, scaling, rowwise);
    for (bool fast_accum : {true, false}) {
      torch::Tensor y = Fp8Product(xq, wq, fast_accum).to(torch::kFloat);
      torch::Tensor want = torch::matmul(Fp8Dequantize(xq), Fp8Dequantize(wq).t());
      EXPECT_LE(RelativeError(y, want), 1e-2) << "scaling " << static_cast<int>(scaling) << " fast " << fast_accum;
    }
    Fp8Tensor gq = Fp8QuantizeOnDevice(x, Fp8Format::kE5M2, scaling, rowwise);
    torch::Tensor dy = Fp8Product(gq, wq, false).to(torch::kFloat);
    EXPECT_LE(RelativeError(dy, torch::matmul(Fp8Dequantize(gq), Fp8Dequantize(wq).t())), 1e-2);
  }
  // Rowwise both ways (the rows and the transposed copy's rows, x's columns, each scaled by its own
  // amax) against the reference of each way; rows and columns of very different magnitudes, whole and
  // partial tiles, and sides the tiles do not take (each way on its own then).
  for (const auto& [rows, cols] : std::vector<std::pair<int64_t, int64_t>>{
           {256, 512}, {144, 520}, {48, 200}, {100, 36}, {13, 24}}) {
    const torch::Tensor t = (torch::randn({rows, cols}) * torch::logspace(-2, 2, rows).unsqueeze(1) *
                             torch::logspace(1, -1, cols).unsqueeze(0))
                                .to(bf16);
    for (Fp8Format format : {Fp8Format::kE4M3, Fp8Format::kE5M2}) {
      const auto [by_rows, by_columns] = Fp8QuantizeBothWaysOnDevice(t, format, /*power_of_2=*/false);
      const Fp8Tensor want_rows = Fp8Quantize(t.cpu(), format, Fp8Scaling::kRowwise, false);
      const Fp8Tensor want_columns = Fp8Quantize(t.cpu().t().contiguous(), format, Fp8Scaling::kRowwise, false);
      const std::string where = std::to_string(rows) + "x" + std::to_string(cols) + " format " +
                                std::to_string(static_cast<int>(format));
      EXPECT_TRUE(torch::equal(by_rows.amax.cpu().reshape({-1}), want_rows.amax.reshape({-1}))) << where;
      EXPECT_TRUE(torch::equal(by_columns.amax.cpu().reshape({-1}), want_columns.amax.reshape({-1}))) << where;
      EXPECT_TRUE(torch::allclose(by_rows.scale_inv.cpu().reshape({-1}), want_rows.scale_inv.reshape({-1}), 1e-6, 0))
          << where;
      EXPECT_TRUE(
          torch::allclose(by_columns.scale_inv.cpu().reshape({-1}), want_columns.scale_inv.reshape({-1}), 1e-6, 0))
          << where;
      EXPECT_TRUE(torch::equal(by_rows.data.cpu().to(torch::kFloat), want_rows.data.to(torch::kFloat))) << where;
      EXPECT_TRUE(torch::equal(by_columns.data.cpu().to(torch::kFloat), want_columns.data.to(torch::kFloat))) << where;
    }
  }
  // An infinity is an overflow the amax says.
  torch::Tensor bad = x.clone();
  bad[3][7] = std::numeric_limits<float>::infinity();
  EXPECT_TRUE(Fp8Overflowed(Fp8QuantizeOnDevice(bad, Fp8Format::kE4M3, Fp8Scaling::kTensorwise, false)));
}

// The kernels that write a product's input or output gradient (the norms forward and backward,
// SwiGLU forward and backward, the GELU's gradient, RoPE's backward) take its amax on the way: the products then read
// that amax instead of a pass of their own, and give the same bits as with the pass
// (options.fp8_writer_amax off). A block of each kind: a product into an fp32 residual stream, the
// layer norm, the GELU MLP, the RMS norm, SwiGLU's two ways, a rotated projection.
TEST(FusedKernelsTest, Fp8ProductsReadTheAmaxTheirWritersTookAndGiveTheSameBits) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  if (!Fp8ProductsAvailable()) GTEST_SKIP() << "no FP8 products here (a build without CUDA kernels or float8, or a GPU before 8.9)";
  torch::manual_seed(21);
  const auto bf16 = torch::TensorOptions().dtype(torch::kBFloat16).device(torch::kCUDA);
  const auto f32 = bf16.dtype(torch::kFloat);
  const int64_t d = 128, ffn = 256;
  const std::vector<torch::Tensor> params = {
      torch::randn({d, d}, bf16) * 0.05,   torch::randn({d}, bf16) * 0.05,       // 0, 1: the first product
      1 + torch::randn({d}, bf16) * 0.1,   torch::randn({d}, bf16) * 0.1,        // 2, 3: the layer norm
      torch::randn({ffn, d}, bf16) * 0.05, torch::randn({ffn}, bf16) * 0.05,     // 4, 5: the MLP's
      torch::randn({d, ffn}, bf16) * 0.05, torch::randn({d}, bf16) * 0.05,       // 6, 7
      1 + torch::randn({d}, bf16) * 0.1,                                         // 8: the RMS norm
      torch::randn({ffn, d}, bf16) * 0.05, torch::randn({ffn, d}, bf16) * 0.05,  // 9, 10: gate, up
      torch::randn({d, ffn}, bf16) * 0.05};                                      // 11: down
  const torch::Tensor x0 = torch::randn({4, 64, d}, bf16), r0 = torch::randn({4, 64, d}, f32);
  const torch::Tensor angles = torch::rand({64, d / 8}, f32) * 6.28;
  const torch::Tensor cos = angles.cos(), sin = angles.sin();
  auto run = [&](bool writer_amax, int64_t* taken) {
    FusedKernelOptions options;
    options.fp8 = true;
    options.fp8_writer_amax = writer_amax;
    SetFusedKernelOptions(options);
    const int64_t before = Fp8WriterAmaxesTaken();
    std::vector<torch::Tensor> p;
    for (const torch::Tensor& t : params) p.push_back(t.clone().requires_grad_(true));
    torch::Tensor x = x0.clone().requires_grad_(true), r = r0.clone().requires_grad_(true);
    const torch::Tensor h = FusedLinear(x, p[0], p[1], r);
    auto [n1, h_res] = FusedLayerNorm(h, p[2], p[3]);
    const torch::Tensor m = FusedMlp(n1, p[4], p[5], p[6], p[7], h_res);
    auto [n2, m_res] = FusedRmsNorm(m, p[8], 1e-5);
    const torch::Tensor g = FusedLinear(n2, p[9], {}), u = FusedLinear(n2, p[10], {});
    const torch::Tensor out = FusedLinear(FusedSwiGlu(g, u), p[11], {}, m_res);
    // The selective path (SwiGLU made again in backward) from products of its own: each gate's and
    // up's gradient reaches its product alone, not summed with another by autograd first.
    const torch::Tensor out_selective = FusedSwiGluLinear(FusedLinear(n2, p[9], {}), FusedLinear(n2, p[10], {}), p[11]);
    // A rotated projection (q or k): RoPE's backward writes the product's output gradient.
    const torch::Tensor rotated = FusedRope(FusedLinear(n2, p[0], {}).view({4, 64, 4, d / 4}), cos, sin);
    torch::manual_seed(5);
    const torch::Tensor loss = (out * torch::randn(out.sizes(), f32)).sum() +
                               (out_selective.to(torch::kFloat) * torch::randn(out.sizes(), f32)).sum() +
                               (rotated.to(torch::kFloat) * torch::randn(rotated.sizes(), f32)).sum();
    loss.backward();
    ZeroStaleGradients();
    *taken = Fp8WriterAmaxesTaken() - before;
    std::vector<torch::Tensor> all = {out, out_selective, x.grad(), r.grad()};
    for (const torch::Tensor& t : p) all.push_back(t.grad());
    return all;
  };
  int64_t taken_on = 0, taken_off = 0;
  const std::vector<torch::Tensor> on = run(true, &taken_on), off = run(false, &taken_off);
  SetFusedKernelOptions({});
  // Forward: the layer norm's, the RMS norm's and both SwiGLUs' outputs; backward: the GELU's
  // gradient, both SwiGLU backwards' two gradients, RoPE's, and both norms' input gradients.
  EXPECT_EQ(taken_on, 12);
  EXPECT_EQ(taken_off, 0);
  ASSERT_EQ(on.size(), off.size());
  for (size_t i = 0; i < on.size(); ++i) {
    ASSERT_TRUE(on[i].defined() && off[i].defined()) << i;
    EXPECT_TRUE(torch::equal(on[i], off[i])) << "output or gradient " << i << " differs with the writers' amaxes";
  }
}

}  // namespace
}  // namespace ltrain::worker
