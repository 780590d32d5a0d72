// FP8 training's scaling, as the FP8 products use it: the amax of a tensor (or of each of its rows),
// the scale that maps it onto the format's largest value, and the rounding onto FP8's grid with
// saturation, which is what casting the scaled values to float8 gives. RoundToFp8 computes it in fp32
// with LibTorch's ordinary operations: the reference the float8 cast is held to (where the LibTorch
// build has float8 types, compat::kHasFloat8), and the quantization itself where it has none.
#pragma once

#include <torch/types.h>

namespace ltrain::worker {

// e4m3 (3 bits of mantissa, largest 448, no infinities): weights and activations; e5m2 (2 bits,
// largest 57344): gradients, whose range is wider.
enum class Fp8Format { kE4M3, kE5M2 };

// One scale per tensor, or one per row (over the last dimension: the rows of a product's operand
// along its reduced dimension), which follows outliers of single tokens without spending the range
// of the others.
enum class Fp8Scaling { kTensorwise, kRowwise };

double Fp8Max(Fp8Format format);

// The largest magnitude in fp32: a 0-dim tensor (tensorwise), or [rows, 1] over the last dimension of
// `x` viewed as [rows, last] (rowwise). Non-finite where `x` has an infinity or a NaN.
torch::Tensor Fp8Amax(const torch::Tensor& x, Fp8Scaling scaling);

// The factor that maps `amax` onto the format's largest value (fp32): Fp8Max / amax; 1 where amax is
// 0 (nothing to scale) or below 1e-12 of the largest value; with `power_of_2` rounded down to a power
// of two (a product by it then changes no mantissa bit). A non-finite amax gives a NaN scale, which
// Fp8Overflowed says.
torch::Tensor Fp8ScaleFromAmax(const torch::Tensor& amax, Fp8Format format, bool power_of_2);

// `x` (already scaled) rounded to the nearest value of the format, ties to even, subnormals included,
// saturated at its largest magnitude; NaN stays NaN. fp32 in and out.
torch::Tensor RoundToFp8(const torch::Tensor& x, Fp8Format format);

// A tensor in FP8 with what takes it back: x ≈ data · scale_inv (rowwise: scale_inv per row).
struct Fp8Tensor {
  torch::Tensor data;       // float8 where the build has it, else fp32 on FP8's grid
  torch::Tensor scale_inv;  // fp32: 0-dim, or [rows, 1]
  torch::Tensor amax;       // fp32, as Fp8Amax gives it
};

// `x` quantized: amax, scale, rounding (or the float8 cast).
Fp8Tensor Fp8Quantize(const torch::Tensor& x, Fp8Format format, Fp8Scaling scaling, bool power_of_2);

// The values again, in fp32: data · scale_inv.
torch::Tensor Fp8Dequantize(const Fp8Tensor& q);

// Whether a quantization met an infinity or a NaN: a step whose scales overflow, which the trainer says.
bool Fp8Overflowed(const Fp8Tensor& q);

}  // namespace ltrain::worker
