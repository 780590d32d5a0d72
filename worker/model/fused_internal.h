// What the fused kernels' files share (fused_kernels.cc, fused_ops.cc, fp8_products.cc): not an API.
#pragma once

#include <cstdint>

#include <torch/types.h>

#include "worker/model/fused_kernels.h"

#if defined(LTRAIN_WITH_CUDA_KERNELS)
#include <cuda_runtime_api.h>

#include "worker/model/cuda/gemm.h"
#include "worker/torch_compat.h"
#endif

namespace ltrain::worker::fused {

// The options SetFusedKernelOptions set.
const FusedKernelOptions& Options();

#if defined(LTRAIN_WITH_CUDA_KERNELS)
// A norm's backward offers the bf16 copy `bf16` it wrote beside an fp32 residual stream's gradient
// `fp32` (and the gradient's column sums in `partial`, `chunks` of them) to the backward of the
// product that wrote the norm's input, which reads it instead of casting (one a device).
void OfferBf16Twin(const torch::Tensor& fp32, const torch::Tensor& bf16, const torch::Tensor& partial = {},
                   int64_t chunks = 0);

// After a norm's call: where `asked` (options.norm_rebuild) and autograd records the output,
// registers the output for the products that read it, to rebuild it in backward from what the
// norm's forward kept (`kept`, with the norm's weight, bias and eps) instead of keeping it.
void RegisterNormOutput(const torch::Tensor& output, const torch::Tensor& kept, const torch::Tensor& w,
                        const torch::Tensor& b, double eps, bool asked);
#endif

// Drops the FP8 operands kept for the next product, and the amaxes noted (after backward).
void ForgetFp8Operands();

// The amax of a tensor that an FP8 product will quantize, taken by the kernel that writes it instead
// of a pass of the quantization's own. AmaxFor: a device fp32 holding 0 for that kernel, where FP8
// products are on and t (the kernel's output) is bf16 on a GPU, else undefined (the kernel takes
// none). NoteAmax, after the kernel is queued: the next quantization of t's elements, unchanged since
// (the same version), reads that amax. Nothing where amax is undefined.
torch::Tensor AmaxFor(const torch::Tensor& t);
void NoteAmax(const torch::Tensor& t, const torch::Tensor& amax);
inline float* AmaxPointer(const torch::Tensor& amax) { return amax.defined() ? amax.data_ptr<float>() : nullptr; }

#if defined(LTRAIN_WITH_CUDA_KERNELS)
// The current stream of t's device.
cudaStream_t StreamOf(const torch::Tensor& t);

// Runs one cuBLASLt product with a workspace from LibTorch's allocator (on the current stream).
// Backward's products leave options.gemm_sm_margin SMs to the data-parallel reductions that run
// beside them; forward's take every SM.
void Gemm(cuda::GemmArgs args, const torch::Tensor& like, bool backward);

// The tensor a weight gradient of `w` can be added to in place (its .grad, where bf16 and
// contiguous), or undefined.
torch::Tensor AccumulationTarget(const torch::Tensor& w);

// Whether `grad` was marked stale (MarkGradientsStale; then no longer marked): its next writer
// overwrites it.
bool TakeStale(const torch::Tensor& grad);

bool Aligned16(const torch::Tensor& t);

// Undefined, or a bf16 CUDA tensor.
bool Bf16Cuda(const torch::Tensor& t);

#if defined(LTRAIN_HAVE_FLOAT8)
// FP8 products: each operand quantized once with its transposed copy (cuBLASLt's FP8 products take
// A transposed and B not, so a product reads one or the other). The last operand of each kind
// quantized on a device is kept for the next product that reads the same tensor at the same version
// (held, so that no other takes its memory meanwhile): q, k and v's products read one input, both
// backward products one output gradient. Dropped after backward.
enum Fp8Operand { kActivation, kWeight, kGradient, kFp8Operands };
struct QuantizedOperand {
  torch::Tensor source;
  int64_t version = -1;
  Fp8Tensor q;
  torch::Tensor transposed;
  // The transposed copy's scale_inv: q's under tensorwise scaling; under rowwise one a row of the
  // copy ([cols, 1]: the copy is quantized along rows of its own).
  torch::Tensor transposed_scale_inv;
  bool rowwise() const { return q.scale_inv.dim() > 0; }
};

// `t` [rows, cols] in FP8 (e5m2 for gradients, e4m3 otherwise) with its transposed copy [cols, rows],
// tensorwise or (options.fp8_rowwise) rowwise: the last one of its kind on the device where that was
// made from `t` as it is now.
QuantizedOperand InFp8(const torch::Tensor& t, Fp8Operand operand);
#endif
#endif

}  // namespace ltrain::worker::fused
