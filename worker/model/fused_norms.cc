// The layer norm and the RMS norm as autograd functions over our kernels (cuda/layer_norm.h), with
// LibTorch's where the tensors are not aligned for them; their outputs registered for the products
// that rebuild them in backward (fused_kernels.cc).
#include <stdexcept>
#include <tuple>
#include <utility>
#include <vector>

#include <torch/autograd.h>

#include "worker/model/fused_kernels.h"

#if defined(LTRAIN_WITH_CUDA_KERNELS)
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "worker/model/cuda/layer_norm.h"
#include "worker/torch_compat.h"
#endif

#include "worker/model/fused_internal.h"

namespace ltrain::worker {

#if defined(LTRAIN_WITH_CUDA_KERNELS)
using fused::AccumulationTarget;
using fused::Aligned16;
using fused::Bf16Cuda;
using fused::StreamOf;
using fused::TakeStale;

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// What a norm's forward kept for its backward, for the wrapper to register (set and read on the one
// thread that runs the norm, inside one call).
thread_local torch::Tensor last_norm_kept;

// A tensor our norm kernels can take: 16-byte aligned, else an aligned copy.
torch::Tensor AlignedForKernel(const torch::Tensor& t) {
  return !t.defined() || Aligned16(t) ? t : t.clone(at::MemoryFormat::Contiguous);
}

// The .grad of a norm's weight and bias (b may be undefined: the RMS norm's) for the backward kernel
// to add into, where each has one; {} where either has none. One left stale is zeroed first (the
// kernel adds into both or neither).
std::pair<torch::Tensor, torch::Tensor> NormParamTargets(const torch::Tensor& w, const torch::Tensor& b) {
  torch::Tensor into_w = AccumulationTarget(w), into_b = b.defined() ? AccumulationTarget(b) : torch::Tensor();
  if (!into_w.defined() || (b.defined() && !into_b.defined())) return {};
  if (TakeStale(into_w)) into_w.zero_();
  if (into_b.defined() && TakeStale(into_b)) into_b.zero_();
  return {into_w, into_b};
}

// The layer norm forward from our kernel (bf16 or fp32 input, an fp32 residual stream's; the output
// bf16 for the products), LibTorch's where the rows or weights are not 16-byte aligned; backward
// from our kernels: the input gradient with the residual branch's gradient added in the same pass
// (no separate add where the two branches meet), and the weight and bias gradients (one read of dy
// and x, where LibTorch's kernel takes about twice the time on H100s). The second output is x
// itself: the residual branch reads x through it, so that its gradient arrives here.
//
// An fp32 x is kept for backward as bf16 x − mean, written by the forward kernel (x̂'s precision
// where the mean is large): the residual stream stays fp32 in forward at a bf16 stream's memory.
struct LayerNormFunction : public torch::autograd::Function<LayerNormFunction> {
  static variable_list forward(AutogradContext* ctx, const torch::Tensor& x, const torch::Tensor& w,
                               const torch::Tensor& b, double eps) {
    c10::cuda::CUDAGuard guard(x.device());
    torch::Tensor input = x.contiguous();
    torch::Tensor out, mean, rstd, kept = input;
    const bool x_fp32 = input.scalar_type() == torch::kFloat;
    const bool ours = Aligned16(input) && Aligned16(w) && Aligned16(b);
    if (ours) {
      const int64_t cols = input.size(-1), rows = input.numel() / cols;
      out = torch::empty(input.sizes(), input.options().dtype(w.scalar_type()));
      const torch::TensorOptions f32 = input.options().dtype(torch::kFloat);
      mean = torch::empty({rows}, f32);
      rstd = torch::empty({rows}, f32);
      if (x_fp32) kept = torch::empty(input.sizes(), input.options().dtype(w.scalar_type()));
      const torch::Tensor amax = fused::AmaxFor(out);  // the products below quantize out
      cuda::LayerNormForward(input.data_ptr(), x_fp32, w.data_ptr(), b.data_ptr(), static_cast<float>(eps), rows, cols,
                             out.data_ptr(), mean.data_ptr<float>(), rstd.data_ptr<float>(),
                             x_fp32 ? kept.data_ptr() : nullptr, StreamOf(input), fused::AmaxPointer(amax));
      fused::NoteAmax(out, amax);
    } else if (x_fp32) {
      std::tie(out, mean, rstd) = at::native_layer_norm(input, {input.size(-1)}, w.to(torch::kFloat), b.to(torch::kFloat), eps);
      out = out.to(w.scalar_type());
    } else {
      std::tie(out, mean, rstd) = at::native_layer_norm(input, {input.size(-1)}, w, b, eps);
    }
    ctx->save_for_backward({kept, w, b, mean, rstd});
    last_norm_kept = ours ? kept : torch::Tensor();
    ctx->saved_data["ours"] = ours;
    ctx->saved_data["fp32_grads"] = x_fp32;
    return {out, x};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    variable_list saved = ctx->get_saved_variables();
    const torch::Tensor &x = saved[0], &w = saved[1], &b = saved[2], &mean = saved[3], &rstd = saved[4];
    const bool ours = ctx->saved_data["ours"].toBool(), fp32_grads = ctx->saved_data["fp32_grads"].toBool();
    const torch::ScalarType grad_type = fp32_grads ? torch::kFloat : x.scalar_type();
    c10::cuda::CUDAGuard guard(x.device());
    const int64_t cols = x.size(-1), rows = x.numel() / cols;
    torch::Tensor dres = grads[1].defined() ? grads[1].contiguous().to(grad_type) : torch::Tensor();
    if (!grads[0].defined()) return {dres, torch::Tensor(), torch::Tensor(), torch::Tensor()};
    torch::Tensor dy = grads[0].contiguous();
    if (!ours) {
      // LibTorch's backward where its forward ran (x as the forward had it), then the residual's gradient.
      const torch::Tensor xw = fp32_grads ? w.to(torch::kFloat) : w, xb = fp32_grads ? b.to(torch::kFloat) : b;
      auto [dx, dgamma, dbeta] =
          at::native_layer_norm_backward(dy.to(x.scalar_type()), x, {cols}, mean, rstd, xw, xb, {true, true, true});
      if (dres.defined()) dx.add_(dres);
      return {dx, dgamma.to(w.scalar_type()), dbeta.to(b.scalar_type()), torch::Tensor()};
    }
    // Our kernels: the input gradient (and its bf16 copy for the product that wrote an fp32 x) with
    // the weight and bias gradients, in one pass over dy and x where the rows are narrow. x is bf16
    // here: the input itself, or x − mean (then no mean).
    dy = AlignedForKernel(dy);
    dres = AlignedForKernel(dres);
    // The weight and bias gradients straight into their .grad where both have one (added to them):
    // no add kernels for autograd to run.
    auto [into_w, into_b] = NormParamTargets(w, b);
    const bool in_place = into_w.defined();
    torch::Tensor dgamma = in_place ? into_w : torch::empty({cols}, w.options());
    torch::Tensor dbeta = in_place ? into_b : torch::empty({cols}, b.options());
    torch::Tensor dx = torch::empty(x.sizes(), x.options().dtype(grad_type));
    torch::Tensor dx_bf16 = fp32_grads ? torch::empty_like(x) : torch::Tensor();
    // On an fp32 stream the same pass sums dx over the rows for the bias of the product that wrote x.
    torch::Tensor partial =
        torch::empty({cuda::NormBackwardPartialFloats(rows, cols, fp32_grads)}, x.options().dtype(torch::kFloat));
    int64_t dx_sums = 0;
    // The product that wrote x reads the bf16 gradient (the copy on an fp32 stream), FP8 quantized.
    const torch::Tensor& product_grad = fp32_grads ? dx_bf16 : dx;
    const torch::Tensor amax = fused::AmaxFor(product_grad);
    cuda::LayerNormBackward(dy.data_ptr(), x.data_ptr(), fp32_grads, w.data_ptr(),
                            fp32_grads ? nullptr : mean.data_ptr<float>(), rstd.data_ptr<float>(),
                            dres.defined() ? dres.data_ptr() : nullptr, rows, cols, dx.data_ptr(),
                            fp32_grads ? dx_bf16.data_ptr() : nullptr, partial.data_ptr<float>(), dgamma.data_ptr(),
                            dbeta.data_ptr(), StreamOf(x), /*accumulate_params=*/in_place,
                            fp32_grads ? &dx_sums : nullptr, fused::AmaxPointer(amax));
    fused::NoteAmax(product_grad, amax);
    if (fp32_grads) fused::OfferBf16Twin(dx, dx_bf16, partial, dx_sums);
    if (in_place) return {dx, torch::Tensor(), torch::Tensor(), torch::Tensor()};
    return {dx, dgamma, dbeta, torch::Tensor()};
  }
};

// RMSNorm as llama_model.RMSNorm (LibTorch's forward on bf16 input, ours on fp32 input with a bf16
// output, as the layer norm's, keeping a bf16 copy of x for backward); backward from our kernels, as
// the layer norm's: the residual branch's gradient (through the second output, x itself) added
// inside the input-gradient kernel, and the weight gradient from the same pass over dy and x (narrow
// rows) or one more.
struct RmsNormFunction : public torch::autograd::Function<RmsNormFunction> {
  static variable_list forward(AutogradContext* ctx, const torch::Tensor& x, const torch::Tensor& w, double eps) {
    c10::cuda::CUDAGuard guard(x.device());
    torch::Tensor input = x.contiguous();
    torch::Tensor out, kept = input;
    const bool x_fp32 = input.scalar_type() == torch::kFloat;
    const bool ours = Aligned16(input) && Aligned16(w);
    if (x_fp32 && !ours) {
      out = compat::RmsNorm(input, w.to(torch::kFloat), eps).to(w.scalar_type());
    } else if (x_fp32) {
      const int64_t cols = input.size(-1), rows = input.numel() / cols;
      out = torch::empty(input.sizes(), input.options().dtype(w.scalar_type()));
      kept = torch::empty(input.sizes(), input.options().dtype(w.scalar_type()));
      const torch::Tensor amax = fused::AmaxFor(out);  // the products below quantize out
      cuda::RmsNormForward(input.data_ptr(), /*x_fp32=*/true, w.data_ptr(), static_cast<float>(eps), rows, cols,
                           out.data_ptr(), kept.data_ptr(), StreamOf(input), fused::AmaxPointer(amax));
      fused::NoteAmax(out, amax);
    } else {
      out = compat::RmsNorm(input, w, eps);
    }
    ctx->save_for_backward({kept, w});
    last_norm_kept = ours ? kept : torch::Tensor();
    ctx->saved_data["eps"] = eps;
    ctx->saved_data["ours"] = ours;
    ctx->saved_data["fp32_grads"] = x_fp32;
    return {out, x};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    variable_list saved = ctx->get_saved_variables();
    const torch::Tensor &x = saved[0], &w = saved[1];
    const double eps = ctx->saved_data["eps"].toDouble();
    const bool ours = ctx->saved_data["ours"].toBool(), fp32_grads = ctx->saved_data["fp32_grads"].toBool();
    const torch::ScalarType grad_type = fp32_grads ? torch::kFloat : x.scalar_type();
    c10::cuda::CUDAGuard guard(x.device());
    const int64_t cols = x.size(-1), rows = x.numel() / cols;
    torch::Tensor dres = grads[1].defined() ? grads[1].contiguous().to(grad_type) : torch::Tensor();
    if (!grads[0].defined()) return {dres, torch::Tensor(), torch::Tensor()};
    torch::Tensor dy = grads[0].contiguous();
    if (!ours) {
      // LibTorch's backward through the composite (x as the forward had it), then the residual's gradient.
      torch::Tensor xg = x.detach().requires_grad_(true), wg = w.detach().requires_grad_(true);
      torch::Tensor y;
      {
        torch::AutoGradMode enable(true);
        y = compat::RmsNorm(xg, fp32_grads ? wg.to(torch::kFloat) : wg, eps).to(dy.scalar_type());
      }
      variable_list g = torch::autograd::grad({y}, {xg, wg}, {dy});
      if (dres.defined()) g[0].add_(dres);
      return {g[0], g[1], torch::Tensor()};
    }
    dy = AlignedForKernel(dy);
    dres = AlignedForKernel(dres);
    torch::Tensor dx = torch::empty(x.sizes(), x.options().dtype(grad_type));
    torch::Tensor dx_bf16 = fp32_grads ? torch::empty_like(x) : torch::Tensor();
    torch::Tensor rstd = torch::empty({rows}, x.options().dtype(torch::kFloat));
    // The weight gradient straight into its .grad where it has one, as the layer norm's.
    torch::Tensor into_w = NormParamTargets(w, {}).first;
    torch::Tensor dgamma = into_w.defined() ? into_w : torch::empty({cols}, w.options());
    torch::Tensor partial = torch::empty({cuda::NormBackwardPartialFloats(rows, cols)}, x.options().dtype(torch::kFloat));
    const torch::Tensor& product_grad = fp32_grads ? dx_bf16 : dx;  // as the layer norm's
    const torch::Tensor amax = fused::AmaxFor(product_grad);
    cuda::RmsNormBackward(dy.data_ptr(), x.data_ptr(), fp32_grads, w.data_ptr(), static_cast<float>(eps),
                          dres.defined() ? dres.data_ptr() : nullptr, rows, cols, dx.data_ptr(),
                          fp32_grads ? dx_bf16.data_ptr() : nullptr, rstd.data_ptr<float>(), partial.data_ptr<float>(),
                          dgamma.data_ptr(), StreamOf(x), /*accumulate_params=*/into_w.defined(),
                          fused::AmaxPointer(amax));
    fused::NoteAmax(product_grad, amax);
    if (fp32_grads) fused::OfferBf16Twin(dx, dx_bf16);
    return {dx, into_w.defined() ? torch::Tensor() : dgamma, torch::Tensor()};
  }
};

}  // namespace

// The norms read bf16 or fp32 (an fp32 residual stream) with bf16 weights.
bool NormInput(const torch::Tensor& x) {
  return x.defined() && x.is_cuda() && (x.scalar_type() == torch::kBFloat16 || x.scalar_type() == torch::kFloat) &&
         x.size(-1) % 8 == 0;
}

bool FusedLayerNormAvailable(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b) {
  return fused::Options().layer_norm && NormInput(x) && w.defined() && b.defined() && Bf16Cuda(w) && Bf16Cuda(b);
}

std::pair<torch::Tensor, torch::Tensor> FusedLayerNorm(const torch::Tensor& x, const torch::Tensor& w,
                                                       const torch::Tensor& b, bool rebuild_output) {
  constexpr double kEps = 1e-5;
  variable_list out = LayerNormFunction::apply(x, w, b, kEps);
  fused::RegisterNormOutput(out[0], std::move(last_norm_kept), w, b, kEps, rebuild_output);
  return {out[0], out[1]};
}

bool FusedRmsNormAvailable(const torch::Tensor& x, const torch::Tensor& w) {
  return fused::Options().layer_norm && NormInput(x) && w.defined() && Bf16Cuda(w);
}

std::pair<torch::Tensor, torch::Tensor> FusedRmsNorm(const torch::Tensor& x, const torch::Tensor& w, double eps,
                                                     bool rebuild_output) {
  variable_list out = RmsNormFunction::apply(x, w, eps);
  fused::RegisterNormOutput(out[0], std::move(last_norm_kept), w, {}, eps, rebuild_output);
  return {out[0], out[1]};
}

#else

bool FusedLayerNormAvailable(const torch::Tensor& /*x*/, const torch::Tensor& /*w*/, const torch::Tensor& /*b*/) {
  return false;
}

std::pair<torch::Tensor, torch::Tensor> FusedLayerNorm(const torch::Tensor& /*x*/, const torch::Tensor& /*w*/,
                                                       const torch::Tensor& /*b*/, bool /*rebuild_output*/) {
  throw std::logic_error("FusedLayerNorm: this worker was built without CUDA kernels");
}

bool FusedRmsNormAvailable(const torch::Tensor& /*x*/, const torch::Tensor& /*w*/) { return false; }

std::pair<torch::Tensor, torch::Tensor> FusedRmsNorm(const torch::Tensor& /*x*/, const torch::Tensor& /*w*/, double /*eps*/,
                                                     bool /*rebuild_output*/) {
  throw std::logic_error("FusedRmsNorm: this worker was built without CUDA kernels");
}

#endif

}  // namespace ltrain::worker
