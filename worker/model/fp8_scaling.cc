#include "worker/model/fp8_scaling.h"

#include <cmath>

#include "worker/torch_compat.h"

namespace ltrain::worker {
namespace {

struct Fp8Bits {
  int mantissa;      // explicit mantissa bits
  int min_exponent;  // of the smallest normal value: below it, subnormals of the same step
};

Fp8Bits BitsOf(Fp8Format format) { return format == Fp8Format::kE4M3 ? Fp8Bits{3, -6} : Fp8Bits{2, -14}; }

}  // namespace

double Fp8Max(Fp8Format format) { return format == Fp8Format::kE4M3 ? 448.0 : 57344.0; }

torch::Tensor Fp8Amax(const torch::Tensor& x, Fp8Scaling scaling) {
  torch::Tensor magnitude = x.detach().abs().to(torch::kFloat);
  if (scaling == Fp8Scaling::kTensorwise) return magnitude.numel() == 0 ? torch::zeros({}, magnitude.options()) : magnitude.max();
  // NaN propagates through max (amax would drop it): an overflow must not read as a finite amax.
  return std::get<0>(magnitude.reshape({-1, x.size(-1)}).max(/*dim=*/1, /*keepdim=*/true));
}

torch::Tensor Fp8ScaleFromAmax(const torch::Tensor& amax, Fp8Format format, bool power_of_2) {
  const double largest = Fp8Max(format);
  torch::Tensor a = amax.to(torch::kFloat);
  // Tiny or zero amax: scale 1 (a zero tensor stays zero; a huge factor would overflow fp32).
  torch::Tensor tiny = a < largest * 1e-12;
  torch::Tensor scale = torch::where(tiny, torch::ones_like(a), largest / a);
  if (power_of_2) scale = torch::exp2(torch::floor(torch::log2(scale)));
  // inf / NaN amax: NaN scale (largest / inf would be 0, which would hide it).
  return torch::where(torch::isfinite(a), scale, torch::full_like(a, std::nan("")));
}

torch::Tensor RoundToFp8(const torch::Tensor& x, Fp8Format format) {
  const Fp8Bits bits = BitsOf(format);
  const double largest = Fp8Max(format);
  torch::Tensor v = x.to(torch::kFloat);
  torch::Tensor a = v.abs().clamp_max(largest);
  // The step of the grid where |v| lies: 2^(e - mantissa), e = floor(log2 |v|), at least the smallest
  // normal exponent (subnormals share its step). log2(0) = -inf, raised to that minimum.
  torch::Tensor e = torch::floor(torch::log2(a)).clamp_min(bits.min_exponent);
  torch::Tensor step = torch::exp2(e - bits.mantissa);
  // torch::round rounds halves to even: ties go to the even mantissa, as the cast does. A value that
  // rounds up to the next binade lands on its first value, which is on the grid too.
  torch::Tensor r = (torch::round(a / step) * step).clamp_max(largest);
  return torch::where(torch::isnan(v), v, r * torch::sign(v));
}

Fp8Tensor Fp8Quantize(const torch::Tensor& x, Fp8Format format, Fp8Scaling scaling, bool power_of_2) {
  Fp8Tensor q;
  q.amax = Fp8Amax(x, scaling);
  torch::Tensor scale = Fp8ScaleFromAmax(q.amax, format, power_of_2);
  q.scale_inv = 1.0 / scale;
  torch::Tensor scaled = scaling == Fp8Scaling::kRowwise ? x.reshape({-1, x.size(-1)}).to(torch::kFloat) * scale
                                                         : x.to(torch::kFloat) * scale;
  const double largest = Fp8Max(format);
  if constexpr (compat::kHasFloat8) {
    // The cast does not saturate (e4m3 has no infinity: past 448 it gives NaN): clamp first.
    q.data = compat::ToFloat8(scaled.clamp(-largest, largest), format == Fp8Format::kE4M3);
  } else {
    q.data = RoundToFp8(scaled, format);
  }
  if (scaling == Fp8Scaling::kRowwise) q.data = q.data.view(x.sizes());
  return q;
}

torch::Tensor Fp8Dequantize(const Fp8Tensor& q) {
  torch::Tensor values = q.data.to(torch::kFloat);
  if (q.scale_inv.dim() == 0) return values * q.scale_inv;
  return (values.reshape({-1, values.size(-1)}) * q.scale_inv).view(values.sizes());
}

bool Fp8Overflowed(const Fp8Tensor& q) { return !torch::isfinite(q.amax).all().item<bool>(); }

}  // namespace ltrain::worker
