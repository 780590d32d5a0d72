// FP8 scaling against fp32 references: amax, scales, the rounding onto FP8's grid, and the float8
// cast where LibTorch has one.
#include "worker/model/fp8_scaling.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "worker/torch_compat.h"

namespace ltrain::worker {
namespace {

float Round(float value, Fp8Format format) {
  return RoundToFp8(torch::tensor({value}), format).item<float>();
}

TEST(Fp8ScalingTest, RoundsOntoTheGridTiesToEvenSaturatingAtTheLargest) {
  const Fp8Format e4m3 = Fp8Format::kE4M3, e5m2 = Fp8Format::kE5M2;
  EXPECT_EQ(Round(0.0f, e4m3), 0.0f);
  EXPECT_EQ(Round(1.0f, e4m3), 1.0f);
  EXPECT_EQ(Round(1.0625f, e4m3), 1.0f);    // halfway between 1 and 1.125: to the even mantissa
  EXPECT_EQ(Round(1.1875f, e4m3), 1.25f);   // halfway between 1.125 and 1.25: to the even mantissa
  EXPECT_EQ(Round(1.07f, e4m3), 1.125f);
  EXPECT_EQ(Round(-3.3f, e4m3), -3.25f);
  EXPECT_EQ(Round(447.0f, e4m3), 448.0f);
  EXPECT_EQ(Round(500.0f, e4m3), 448.0f);   // saturated
  EXPECT_EQ(Round(-1e9f, e4m3), -448.0f);
  EXPECT_EQ(Round(std::ldexp(1.0f, -9), e4m3), std::ldexp(1.0f, -9));  // the smallest subnormal
  EXPECT_EQ(Round(std::ldexp(1.0f, -10), e4m3), 0.0f);                  // half of it: to even (0)
  EXPECT_EQ(Round(std::ldexp(3.0f, -11), e4m3), std::ldexp(1.0f, -9));
  EXPECT_EQ(Round(1.125f, e5m2), 1.0f);     // halfway between 1 and 1.25
  EXPECT_EQ(Round(60000.0f, e5m2), 57344.0f);
  EXPECT_EQ(Round(std::ldexp(1.0f, -16), e5m2), std::ldexp(1.0f, -16));
  EXPECT_TRUE(std::isnan(Round(std::nanf(""), e4m3)));
}

TEST(Fp8ScalingTest, AmaxAndScaleMatchTheirFp32Reference) {
  torch::manual_seed(3);
  torch::Tensor x = torch::randn({6, 32}) * torch::arange(1, 7).to(torch::kFloat).unsqueeze(1);
  torch::Tensor tensorwise = Fp8Amax(x, Fp8Scaling::kTensorwise);
  EXPECT_EQ(tensorwise.dim(), 0);
  EXPECT_EQ(tensorwise.item<float>(), x.abs().max().item<float>());
  torch::Tensor rowwise = Fp8Amax(x, Fp8Scaling::kRowwise);
  ASSERT_EQ(rowwise.sizes(), (std::vector<int64_t>{6, 1}));
  for (int64_t r = 0; r < 6; ++r) EXPECT_EQ(rowwise[r][0].item<float>(), x[r].abs().max().item<float>());

  torch::Tensor scale = Fp8ScaleFromAmax(rowwise, Fp8Format::kE4M3, /*power_of_2=*/false);
  EXPECT_TRUE(torch::allclose(scale * rowwise, torch::full_like(rowwise, 448.0)));
  torch::Tensor pow2 = Fp8ScaleFromAmax(rowwise, Fp8Format::kE4M3, /*power_of_2=*/true);
  EXPECT_TRUE(torch::equal(torch::exp2(torch::round(torch::log2(pow2))), pow2));
  EXPECT_TRUE((pow2 * rowwise <= 448.0).all().item<bool>());
  EXPECT_TRUE((pow2 * rowwise > 224.0).all().item<bool>());
  // Nothing to scale: 1; an overflow: NaN.
  EXPECT_EQ(Fp8ScaleFromAmax(torch::zeros({}), Fp8Format::kE5M2, false).item<float>(), 1.0f);
  EXPECT_TRUE(std::isnan(
      Fp8ScaleFromAmax(torch::tensor(std::numeric_limits<float>::infinity()), Fp8Format::kE4M3, false).item<float>()));
}

// Every element comes back within half a step of FP8's grid: 2^-4 of its magnitude for e4m3's
// normal values (2^-3 for e5m2), with the scale's rounding.
TEST(Fp8ScalingTest, QuantizedValuesComeBackWithinHalfAStep) {
  torch::manual_seed(5);
  torch::Tensor x = torch::randn({64, 128}) * 30.0;
  for (Fp8Scaling scaling : {Fp8Scaling::kTensorwise, Fp8Scaling::kRowwise}) {
    for (bool power_of_2 : {false, true}) {
      for (Fp8Format format : {Fp8Format::kE4M3, Fp8Format::kE5M2}) {
        Fp8Tensor q = Fp8Quantize(x, format, scaling, power_of_2);
        EXPECT_FALSE(Fp8Overflowed(q));
        EXPECT_EQ(q.data.sizes(), x.sizes());
        torch::Tensor back = Fp8Dequantize(q);
        // Normal range of the format, in x's units: |x| · scale ≥ 2^min_exponent.
        torch::Tensor scale = 1.0 / q.scale_inv;
        torch::Tensor scaled = (x * scale).abs();  // scale: 0-dim, or [rows, 1]
        torch::Tensor normal = scaled >= (format == Fp8Format::kE4M3 ? std::ldexp(1.0, -6) : std::ldexp(1.0, -14));
        const double bound = format == Fp8Format::kE4M3 ? 1.0 / 16 : 1.0 / 8;
        torch::Tensor relative = ((back - x).abs() / x.abs()).masked_select(normal);
        EXPECT_LE(relative.max().item<double>(), bound * (1 + 1e-6));
        // The largest magnitude maps onto the format's largest value (within the power of two).
        EXPECT_LE(scaled.max().item<double>(), Fp8Max(format) * (1 + 1e-6));
      }
    }
  }
  Fp8Tensor zeros = Fp8Quantize(torch::zeros({4, 8}), Fp8Format::kE4M3, Fp8Scaling::kRowwise, false);
  EXPECT_TRUE(torch::equal(Fp8Dequantize(zeros), torch::zeros({4, 8})));
  torch::Tensor bad = torch::ones({2, 4});
  bad[1][2] = std::numeric_limits<float>::infinity();
  EXPECT_TRUE(Fp8Overflowed(Fp8Quantize(bad, Fp8Format::kE5M2, Fp8Scaling::kTensorwise, false)));
}

// The reference is what LibTorch's float8 cast gives, on a sweep over both formats' whole range.
TEST(Fp8ScalingTest, TheRoundingIsWhatTheFloat8CastGives) {
  if (!compat::kHasFloat8) GTEST_SKIP() << "this LibTorch has no float8 types (2.1 and later have)";
  for (Fp8Format format : {Fp8Format::kE4M3, Fp8Format::kE5M2}) {
    const double largest = Fp8Max(format);
    torch::Tensor sweep = torch::cat({torch::linspace(-largest, largest, 200001), torch::logspace(-20, std::log10(largest), 20001, 2.0),
                                      -torch::logspace(-20, 5, 20001, 2.0)})
                              .to(torch::kFloat)
                              .clamp(-largest, largest);
    torch::Tensor cast = compat::ToFloat8(sweep, format == Fp8Format::kE4M3).to(torch::kFloat);
    EXPECT_TRUE(torch::equal(RoundToFp8(sweep, format), cast)) << (format == Fp8Format::kE4M3 ? "e4m3" : "e5m2");
  }
}

}  // namespace
}  // namespace ltrain::worker
