#include "worker/model/fused_kernels.h"

#include <algorithm>
#include <array>
#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <tuple>
#include <utility>
#include <string>
#include <vector>

#include <c10/util/accumulate.h>
#include <torch/autograd.h>

#include "worker/comm/communicator.h"

#if defined(LTRAIN_WITH_CUDA_KERNELS)
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "worker/model/comm_handle.h"
#include "worker/model/cuda/adamw.h"
#include "worker/model/cuda/column_sums.h"
#include "worker/model/cuda/cross_entropy.h"
#include "worker/model/cuda/embedding.h"
#include "worker/model/cuda/fp8_cast.h"
#include "worker/model/cuda/gelu.h"
#include "worker/model/cuda/gemm.h"
#include "worker/model/cuda/layer_norm.h"
#include "worker/model/cuda/llama_ops.h"
#include "worker/torch_compat.h"
#endif

#include "worker/model/fused_internal.h"

#include <cmath>

namespace ltrain::worker {

#if defined(LTRAIN_WITH_CUDA_KERNELS)
using fused::AccumulationTarget;
using fused::Aligned16;
using fused::Bf16Cuda;
using fused::Gemm;
using fused::StreamOf;
using fused::TakeStale;
#if defined(LTRAIN_HAVE_FLOAT8)
using fused::Fp8Operand;
using fused::InFp8;
using fused::QuantizedOperand;
using fused::kActivation;
using fused::kGradient;
using fused::kWeight;
#endif
#endif

namespace {

FusedKernelOptions kernel_options;

}  // namespace

void SetFusedKernelOptions(const FusedKernelOptions& options) { kernel_options = options; }

const FusedKernelOptions& fused::Options() { return kernel_options; }

bool FusedTpOverlap() { return kernel_options.tp_overlap; }

namespace {

std::mutex stale_mu;
std::vector<torch::Tensor> stale_grads;  // a few hundred at most: searched in order

// An fp32 residual stream's gradient and the bf16 copy a norm's backward wrote beside it in the same
// pass: the gradient of the output of the product that the norm read (its only reader). That
// product's backward takes the copy instead of casting. One per device, replaced by the next norm
// and dropped after backward; held references keep the gradient's storage from being reused, and the
// version check refuses one modified since. A layer norm's backward also leaves the gradient's
// column sums in `partial` (`chunks` per-block sums, 0: none), for that product's bias gradient.
struct Bf16Twin {
  torch::Tensor fp32, bf16;
  int64_t version = 0;
  torch::Tensor partial;
  int64_t chunks = 0;
};
std::mutex twin_mu;
std::map<c10::DeviceIndex, Bf16Twin> bf16_twins;

}  // namespace

void MarkGradientsStale(const std::vector<torch::Tensor>& grads) {
  std::lock_guard<std::mutex> lock(stale_mu);
  stale_grads.insert(stale_grads.end(), grads.begin(), grads.end());
}

void ZeroStaleGradients() {
  std::lock_guard<std::mutex> lock(stale_mu);
  torch::NoGradGuard no_grad;
  for (torch::Tensor& g : stale_grads) g.zero_();
  stale_grads.clear();
  std::lock_guard<std::mutex> twin_lock(twin_mu);
  bf16_twins.clear();
  fused::ForgetFp8Operands();
}

#if defined(LTRAIN_WITH_CUDA_KERNELS)
// Whether `grad` was marked stale (then no longer marked): its next writer overwrites it.
bool fused::TakeStale(const torch::Tensor& grad) {
  if (!grad.defined()) return false;
  std::lock_guard<std::mutex> lock(stale_mu);
  for (auto it = stale_grads.begin(); it != stale_grads.end(); ++it) {
    if (it->data_ptr() == grad.data_ptr() && it->numel() == grad.numel()) {
      stale_grads.erase(it);
      return true;
    }
  }
  return false;
}

cudaStream_t fused::StreamOf(const torch::Tensor& t) { return c10::cuda::getCurrentCUDAStream(t.device().index()).stream(); }

// Runs one cuBLASLt product with a workspace from LibTorch's allocator (on the current stream).
// Backward's products leave options.gemm_sm_margin SMs to the data-parallel reductions that run
// beside them; forward's take every SM.
void fused::Gemm(cuda::GemmArgs args, const torch::Tensor& like, bool backward) {
  torch::Tensor workspace =
      torch::empty({static_cast<int64_t>(cuda::kGemmWorkspaceBytes)}, like.options().dtype(torch::kByte));
  args.workspace = workspace.data_ptr();
  args.workspace_bytes = cuda::kGemmWorkspaceBytes;
  args.sm_margin = backward ? kernel_options.gemm_sm_margin : 0;
  args.tune = kernel_options.gemm_tune;
  static_assert(kMaxGemmCandidates == cuda::kGemmMaxCandidates);
  args.candidates = kernel_options.gemm_candidates;
  if (std::string error = cuda::GemmBf16(args, StreamOf(like)); !error.empty()) throw std::runtime_error(error);
}

// The tensor a weight gradient of `w` can be added to in place: the leaf's own .grad (a view of the
// parameter store's flat gradient buffer), when it has one of the right kind.
torch::Tensor fused::AccumulationTarget(const torch::Tensor& w) {
  const torch::Tensor& grad = w.grad();
  if (!grad.defined() || grad.scalar_type() != torch::kBFloat16 || !grad.is_contiguous() || grad.sizes() != w.sizes()) {
    return {};
  }
  return grad;
}

bool fused::Aligned16(const torch::Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; }

bool fused::Bf16Cuda(const torch::Tensor& t) { return !t.defined() || (t.is_cuda() && t.scalar_type() == torch::kBFloat16); }

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// What an FP8 product's forward made that its backward reads again: the transposed copies of its
// input and (options.fp8_keep_weights) of its weight, with their dequantization scales. Empty where
// the product ran in bf16; backward then quantizes what it needs itself.
struct Fp8Saved {
  torch::Tensor x_t, x_scale_inv, w_t, w_scale_inv;
};

// Kept in a product's context under "fp8_copies_" + `key`, and read back.
void SaveFp8(AutogradContext* ctx, const std::string& key, const Fp8Saved& saved) {
  if (!saved.x_t.defined()) return;
  std::vector<torch::Tensor> copies{saved.x_t, saved.x_scale_inv};
  if (saved.w_t.defined()) copies.insert(copies.end(), {saved.w_t, saved.w_scale_inv});
  ctx->saved_data["fp8_copies_" + key] = std::move(copies);
}
Fp8Saved LoadFp8(AutogradContext* ctx, const std::string& key) {
  auto it = ctx->saved_data.find("fp8_copies_" + key);
  if (it == ctx->saved_data.end()) return {};
  const std::vector<torch::Tensor> t = it->second.toTensorVector();
  Fp8Saved saved{t[0], t[1], {}, {}};
  if (t.size() == 4) saved.w_t = t[2], saved.w_scale_inv = t[3];
  return saved;
}

#if defined(LTRAIN_HAVE_FLOAT8)
// FP8 products (kernel_options.fp8): both operands quantized at the product, tensorwise, e4m3 for
// weights and activations, e5m2 for gradients (a wider range); cuBLASLt's FP8 products need sides
// that are multiples of 16.
bool Fp8Takes(const torch::Tensor& x, int64_t rows, int64_t in, int64_t out) {
  return Fp8ProductsOn() && x.scalar_type() == torch::kBFloat16 && rows % 16 == 0 && in % 16 == 0 && out % 16 == 0;
}

// The FP8 type of a product's output gradient (options.fp8_gradients_e4m3).
cuda::GemmType GradientGemmType() {
  return kernel_options.fp8_gradients_e4m3 ? cuda::GemmType::kE4M3 : cuda::GemmType::kE5M2;
}

#else
bool Fp8Takes(const torch::Tensor&, int64_t, int64_t, int64_t) { return false; }
#endif

// The three products of a linear layer, on row-major 2-D tensors. y[M, N] = x[M, K] · w[N, K]ᵀ
// (+ bias[N]; or with kGeluAuxBias y = gelu(aux), aux = x · wᵀ + bias), plus `residual` [M, N] when
// that is defined (read by the product's epilogue: no separate add); written into `into` when that
// is defined. An fp32 residual (an fp32 residual stream) makes y fp32: the sum is rounded once.
torch::Tensor LinearProduct(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& bias,
                            cuda::Epilogue epilogue, const torch::Tensor& aux = {}, const torch::Tensor& residual = {},
                            const torch::Tensor& into = {}, Fp8Saved* fp8_saved = nullptr) {
  const int64_t rows = x.size(0), in = x.size(1), out = w.size(0);
  const bool fp32_out = residual.defined() && residual.scalar_type() == torch::kFloat;
  torch::Tensor y =
      into.defined() ? into : torch::empty({rows, out}, x.options().dtype(fp32_out ? torch::kFloat : x.scalar_type()));
  cuda::GemmArgs g = cuda::LinearForward(x.data_ptr(), w.data_ptr(), y.data_ptr(), rows, in, out);
  const bool fp8 = kernel_options.fp8_forward && Fp8Takes(x, rows, in, out);
#if defined(LTRAIN_HAVE_FLOAT8)
  QuantizedOperand xq, wq;  // alive until the product is queued
  if (fp8) {
    xq = InFp8(x, kActivation);
    wq = InFp8(w, kWeight);
    g.a = wq.q.data.data_ptr(), g.b = xq.q.data.data_ptr();
    g.a_type = g.b_type = cuda::GemmType::kE4M3;
    g.a_scale_inv = wq.q.scale_inv.data_ptr<float>(), g.b_scale_inv = xq.q.scale_inv.data_ptr<float>();
    g.rowwise = xq.rowwise();
    g.fast_accum = kernel_options.fp8_fast_accum;  // forward: as torchao's and Transformer Engine's recipes
    if (fp8_saved != nullptr) {
      // Backward's FP8 products read the transposed copies: the input's, the weight's where it is kept.
      if (kernel_options.fp8_weight_grad) fp8_saved->x_t = xq.transposed, fp8_saved->x_scale_inv = xq.transposed_scale_inv;
      if (kernel_options.fp8_keep_weights && kernel_options.fp8_input_grad) {
        fp8_saved->w_t = wq.transposed, fp8_saved->w_scale_inv = wq.transposed_scale_inv;
      }
    }
  }
#else
  (void)fp8_saved;
#endif
  g.epilogue = epilogue;
  g.fp32_out = fp32_out;
  // The epilogue's bias is in D's dtype: an fp32 copy of a bf16 bias for an fp32 output (an FP8
  // product adds a bf16 bias to either).
  torch::Tensor bias_f = fp32_out && bias.defined() && !fp8 ? bias.to(torch::kFloat) : bias;
  if (bias_f.defined()) g.bias = bias_f.data_ptr();
  if (aux.defined()) g.aux = aux.data_ptr(), g.ld_aux = out;
  if (residual.defined()) g.c = residual.data_ptr(), g.ldc = out, g.beta = 1.0f;
  Gemm(g, x, false);
  return y;
}

// dx[M, K] = grad[M, N] · w[N, K]; with kDGelu multiplied by gelu'(aux). Into `into` when that is
// defined, added to what it holds when `accumulate`.
torch::Tensor InputGradProduct(const torch::Tensor& grad, const torch::Tensor& w, cuda::Epilogue epilogue = cuda::Epilogue::kNone,
                               const torch::Tensor& aux = {}, const torch::Tensor& into = {}, bool accumulate = false,
                               const Fp8Saved* fp8_saved = nullptr) {
  const int64_t rows = grad.size(0), out = grad.size(1), in = w.size(1);
  torch::Tensor dx = into.defined() ? into : torch::empty({rows, in}, grad.options());
  cuda::GemmArgs g = cuda::LinearInputGrad(grad.data_ptr(), w.data_ptr(), dx.data_ptr(), rows, in, out);
#if defined(LTRAIN_HAVE_FLOAT8)
  // FP8: cuBLASLt takes A transposed, so A is w's transposed copy [in, out] (forward's where kept).
  QuantizedOperand wq, gq;  // alive until the product is queued
  bool dgelu_apart = false;
  if (kernel_options.fp8_input_grad && Fp8Takes(grad, rows, in, out)) {
    // cuBLASLt runs an FP8 product's DGELU epilogue as a pass of its own (4x LibTorch's gelu_backward
    // on an H100): the GELU's gradient is applied after the product instead, by our kernel, which
    // takes the amax for the next product's quantization of it on the way.
    dgelu_apart = epilogue == cuda::Epilogue::kDGelu && !into.defined() && !accumulate;
    gq = InFp8(grad, kGradient);
    if (fp8_saved != nullptr && fp8_saved->w_t.defined()) {
      wq.transposed = fp8_saved->w_t, wq.transposed_scale_inv = fp8_saved->w_scale_inv;
    } else {
      wq = InFp8(w, kWeight);
    }
    g.trans_a = true;
    g.a = wq.transposed.data_ptr(), g.lda = out;
    g.b = gq.q.data.data_ptr();
    g.a_type = cuda::GemmType::kE4M3, g.b_type = GradientGemmType();
    g.a_scale_inv = wq.transposed_scale_inv.data_ptr<float>(), g.b_scale_inv = gq.q.scale_inv.data_ptr<float>();
    g.rowwise = gq.rowwise();
  }
#else
  (void)fp8_saved;
  const bool dgelu_apart = false;
#endif
  g.epilogue = dgelu_apart ? cuda::Epilogue::kNone : epilogue;
  if (aux.defined() && !dgelu_apart) g.aux = aux.data_ptr(), g.ld_aux = in;
  if (accumulate) g.beta = 1.0f;
  Gemm(g, grad, true);
  if (dgelu_apart) {
    const torch::Tensor amax = fused::AmaxFor(dx);
    cuda::GeluBackward(dx.data_ptr(), aux.data_ptr(), dx.numel(), dx.data_ptr(), StreamOf(dx), fused::AmaxPointer(amax));
    fused::NoteAmax(dx, amax);
  }
  return dx;
}

// dw[N, K] = grad[M, N]ᵀ · x[M, K], into `into` when that is defined (then returns undefined), added
// to what it holds when `accumulate`.
torch::Tensor WeightGradProduct(const torch::Tensor& grad, const torch::Tensor& x, const torch::Tensor& into,
                                bool accumulate = true, const Fp8Saved* fp8_saved = nullptr) {
  // x is undefined where the forward's FP8 transposed copy stands for it.
  const bool from_fp8 = !x.defined();
  if (from_fp8 && (fp8_saved == nullptr || !fp8_saved->x_t.defined())) {
    throw std::logic_error("WeightGradProduct: no input, and no FP8 copy of it");
  }
  const int64_t rows = grad.size(0), out = grad.size(1), in = from_fp8 ? fp8_saved->x_t.size(0) : x.size(1);
  torch::Tensor dw = into.defined() ? into : torch::empty({out, in}, grad.options());
  cuda::GemmArgs g =
      cuda::LinearWeightGrad(grad.data_ptr(), from_fp8 ? nullptr : x.data_ptr(), dw.data_ptr(), rows, in, out);
#if defined(LTRAIN_HAVE_FLOAT8)
  // FP8: A transposed and B not, so both from transposed copies: A = xᵀ [in, rows] (forward's where
  // kept), B = gradᵀ [out, rows].
  QuantizedOperand xq, gq;  // alive until the product is queued
  if ((from_fp8 || kernel_options.fp8_weight_grad) && Fp8Takes(grad, rows, in, out)) {
    gq = InFp8(grad, kGradient);
    if (from_fp8) {
      xq.transposed = fp8_saved->x_t, xq.transposed_scale_inv = fp8_saved->x_scale_inv;
    } else {
      xq = InFp8(x, kActivation);
    }
    g.trans_a = true, g.trans_b = false;
    g.a = xq.transposed.data_ptr(), g.lda = rows;
    g.b = gq.transposed.data_ptr(), g.ldb = rows;
    g.a_type = cuda::GemmType::kE4M3, g.b_type = GradientGemmType();
    g.a_scale_inv = xq.transposed_scale_inv.data_ptr<float>(), g.b_scale_inv = gq.transposed_scale_inv.data_ptr<float>();
    g.rowwise = gq.rowwise();
  }
#else
  (void)fp8_saved;
#endif
  if (g.a == nullptr) throw std::logic_error("WeightGradProduct: an FP8 copy of the input, but not an FP8 product");
  if (into.defined() && accumulate) g.beta = 1.0f;
  Gemm(g, grad, true);
  return into.defined() ? torch::Tensor() : dw;
}

// The bias gradient of a product whose output gradient is g [rows, cols] (contiguous): its column
// sums, from our kernel where the layout allows (one read at the card's bandwidth). Written into
// `into` (contiguous, [cols], g's dtype) when that is defined, or with `accumulate` added to it: no
// copy or add after the sums.
torch::Tensor BiasGrad(const torch::Tensor& g, const torch::Tensor& into = {}, bool accumulate = false) {
  const int64_t rows = g.size(0), cols = g.size(1);
  if (cols % 8 != 0 || !Aligned16(g)) {
    if (!into.defined()) return g.sum(0);
    return accumulate ? into.add_(g.sum(0)) : into.copy_(g.sum(0));
  }
  torch::Tensor out = into.defined() ? into : torch::empty({cols}, g.options());
  torch::Tensor partial = torch::empty({cuda::ColumnSumsPartialFloats(rows, cols)}, g.options().dtype(torch::kFloat));
  cuda::ColumnSums(g.data_ptr(), rows, cols, partial.data_ptr<float>(), out.data_ptr(), StreamOf(g), accumulate);
  return out;
}

// The bias b's gradient from the output gradient g: added straight into b's .grad when it has one
// (then undefined is returned and autograd has nothing to accumulate: no add kernel per bias), else
// a new tensor.
torch::Tensor BiasGradOf(const torch::Tensor& g, const torch::Tensor& b) {
  torch::Tensor into = AccumulationTarget(b);
  if (!into.defined()) return BiasGrad(g);
  BiasGrad(g, into, /*accumulate=*/!TakeStale(into));
  return {};
}

// The column sums of a product's output gradient that a norm's backward left beside its bf16 copy
// (chunks 0: none).
struct GradColumnSums {
  torch::Tensor partial;
  int64_t chunks = 0;
};

// The bias gradient of b from the column sums a norm's backward left (ProductGrad): added straight
// into b's .grad where it has one (then undefined is returned), else a new tensor. Nothing where
// there are none: BiasGradOf then sums the gradient itself.
std::optional<torch::Tensor> BiasGradFromSums(const GradColumnSums& sums, const torch::Tensor& b) {
  if (sums.chunks == 0 || b.scalar_type() != torch::kBFloat16) return std::nullopt;
  const int64_t cols = b.numel();
  torch::Tensor into = AccumulationTarget(b);
  const bool in_place = into.defined();
  torch::Tensor out = in_place ? into : torch::empty({cols}, b.options());
  cuda::AddDxSums(sums.partial.data_ptr<float>(), sums.chunks, cols, out.data_ptr(), StreamOf(sums.partial),
                  /*accumulate=*/in_place && !TakeStale(into));
  return in_place ? torch::Tensor() : out;
}

// The weight gradient of a linear layer: added straight into w's .grad when it has one (then the
// returned gradient is undefined and autograd has nothing to accumulate), else a new tensor. The bias
// gradient is a column sum: the one the norm's backward took in its pass over the gradient where it
// left `sums`, else one of its own (cuBLASLt's BGRADB epilogue costs more than the sum on H100s:
// tests/bench/gemm_epilogues.cc).
std::pair<torch::Tensor, torch::Tensor> WeightAndBiasGrads(const torch::Tensor& g, const torch::Tensor& x,
                                                           const torch::Tensor& w, const torch::Tensor& b,
                                                           const GradColumnSums& sums = {},
                                                           const Fp8Saved* fp8_saved = nullptr) {
  torch::Tensor into = AccumulationTarget(w);
  torch::Tensor dw = WeightGradProduct(g, x, into, /*accumulate=*/!TakeStale(into), fp8_saved);
  if (!b.defined() || b.numel() == 0) return {dw, torch::Tensor()};
  std::optional<torch::Tensor> db = BiasGradFromSums(sums, b);
  return {dw, db ? *db : BiasGradOf(g, b)};
}

std::vector<int64_t> WithLast(torch::IntArrayRef sizes, int64_t last) {
  std::vector<int64_t> out = sizes.vec();
  out.back() = last;
  return out;
}

// The 2-D residual [rows, out] a product adds, or undefined where `residual` is the empty tensor
// that stands for none.
torch::Tensor Residual2d(const torch::Tensor& residual, int64_t out) {
  if (residual.numel() == 0) return {};
  return residual.reshape({-1, out}).contiguous();
}

// A product's forward notes whether it ran in FP8; its backward runs in the same precision.
void NoteFp8(AutogradContext* ctx) { ctx->saved_data["fp8"] = Fp8ProductsOn(); }
Bf16ProductsScope AsForward(AutogradContext* ctx) { return Bf16ProductsScope(!ctx->saved_data["fp8"].toBool()); }

// A high-priority stream per device for the tensor-parallel sums (SideStreamSum): one stream, so
// that they run in the order they were issued, as the communicator's collectives must.
c10::cuda::CUDAStream SideStream(c10::DeviceIndex device) {
  static std::mutex mu;
  static std::map<c10::DeviceIndex, c10::cuda::CUDAStream> streams;
  std::lock_guard<std::mutex> lock(mu);
  auto it = streams.find(device);
  if (it == streams.end()) it = streams.emplace(device, c10::cuda::getStreamFromPool(true, device)).first;
  return it->second;
}

void CheckCuda(cudaError_t result, const char* what) {
  if (result != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(result));
}


// The output gradient of a product with weight w as the 2-D bf16 matrix its backward products read:
// the gradient of an fp32 output (one adding into an fp32 residual stream) is cast once, or taken
// from the norm's backward that computed it (with its column sums into `sums` where given and left).
torch::Tensor ProductGrad(const torch::Tensor& grad, const torch::Tensor& w, GradColumnSums* sums = nullptr) {
  torch::Tensor g = grad.reshape({-1, w.size(0)});
  if (g.scalar_type() == w.scalar_type()) return g.contiguous();
  Bf16Twin twin;
  {
    std::lock_guard<std::mutex> lock(twin_mu);
    auto it = bf16_twins.find(grad.device().index());
    if (it != bf16_twins.end()) twin = std::move(it->second), bf16_twins.erase(it);
  }
  if (twin.fp32.defined() && twin.fp32.data_ptr() == grad.data_ptr() && twin.fp32.numel() == grad.numel() &&
      static_cast<int64_t>(twin.fp32._version()) == twin.version && grad.is_contiguous() &&
      twin.bf16.scalar_type() == w.scalar_type()) {
    if (sums != nullptr && twin.chunks > 0 && twin.fp32.size(-1) == w.size(0)) *sums = {twin.partial, twin.chunks};
    return twin.bf16.view({-1, w.size(0)});
  }
  return g.to(w.scalar_type()).contiguous();
}

// A norm's output that the products below rebuild in backward from what the norm keeps for its own
// backward, instead of keeping it (FusedLayerNorm's and FusedRmsNorm's rebuild_output): while the
// output lives, the product that reads it finds it here by its TensorImpl and saves the norm's
// kept input, weight and bias in its place. Weak references only: an entry holds no memory, and one
// whose output or kept input is gone is dropped at the next registration.
using WeakImpl = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>;
struct NormRecipe {
  WeakImpl output, kept;
  torch::Tensor w, b;  // b undefined: the RMS norm
  double eps = 0;
};
std::mutex recipe_mu;
std::vector<NormRecipe> norm_recipes;

// Whether a norm's output is rebuilt, where the caller asks for `asked` (options.norm_rebuild).
bool NormRebuild(bool asked) { return kernel_options.norm_rebuild < 0 ? asked : kernel_options.norm_rebuild == 1; }

}  // namespace

void fused::OfferBf16Twin(const torch::Tensor& fp32, const torch::Tensor& bf16, const torch::Tensor& partial,
                          int64_t chunks) {
  std::lock_guard<std::mutex> lock(twin_mu);
  bf16_twins[fp32.device().index()] = {fp32, bf16, static_cast<int64_t>(fp32._version()), partial, chunks};
}

void fused::RegisterNormOutput(const torch::Tensor& output, const torch::Tensor& kept, const torch::Tensor& w,
                               const torch::Tensor& b, double eps, bool asked) {
  if (!NormRebuild(asked) || !kept.defined() || !output.requires_grad()) return;
  std::lock_guard<std::mutex> lock(recipe_mu);
  std::erase_if(norm_recipes, [](const NormRecipe& r) { return r.output.expired() || r.kept.expired(); });
  norm_recipes.push_back({WeakImpl(output.getIntrusivePtr()), WeakImpl(kept.getIntrusivePtr()), w, b, eps});
}

namespace {

// What a product saves of its input x: x itself ([rows, in]), or where x is a registered norm output,
// the norm's kept input, weight and bias (the entry is then taken).
struct SavedInput {
  torch::Tensor x, norm_w, norm_b;
  double eps = 0;
  int kind = 0;  // 0: x itself; 1: a layer norm's output; 2: an RMS norm's
};

SavedInput SaveInput(const torch::Tensor& x, const torch::Tensor& x2) {
  SavedInput saved;
  saved.x = x2;
  std::lock_guard<std::mutex> lock(recipe_mu);
  const auto it = std::find_if(norm_recipes.begin(), norm_recipes.end(), [&](const NormRecipe& r) {
    return !r.output.expired() && r.output._unsafe_get_target() == x.unsafeGetTensorImpl();
  });
  if (it == norm_recipes.end()) return saved;
  c10::intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl> kept = it->kept.lock();
  if (kept && x.is_contiguous() && kept->sizes() == x.sizes()) {
    saved = {torch::Tensor(std::move(kept)), it->w, it->b, it->eps, it->b.defined() ? 1 : 2};
  }
  norm_recipes.erase(it);
  return saved;
}

// SaveInput's fields in order after a product's own saved tensors, and the kind and eps in saved_data.
void Save(AutogradContext* ctx, variable_list tensors, const SavedInput& input) {
  tensors.insert(tensors.begin(), input.x);
  tensors.push_back(input.norm_w);
  tensors.push_back(input.norm_b);
  ctx->save_for_backward(tensors);
  ctx->saved_data["input_kind"] = static_cast<int64_t>(input.kind);
  ctx->saved_data["input_eps"] = input.eps;
}

// The product's input [rows, in] from what Save kept: x itself, or the norm's output made again by
// its forward kernel on the kept bf16 input (a layer norm's x or x − mean, an RMS norm's x).
torch::Tensor SavedInputRows(AutogradContext* ctx, const variable_list& saved) {
  const torch::Tensor& x = saved.front();
  const int64_t kind = ctx->saved_data["input_kind"].toInt();
  const int64_t cols = x.size(-1), rows = x.numel() / cols;
  if (kind == 0) return x.view({rows, cols});
  const torch::Tensor &w = saved[saved.size() - 2], &b = saved.back();
  const float eps = static_cast<float>(ctx->saved_data["input_eps"].toDouble());
  torch::Tensor out = torch::empty({rows, cols}, x.options());
  if (kind == 1) {
    torch::Tensor stats = torch::empty({2, rows}, x.options().dtype(torch::kFloat));
    cuda::LayerNormForward(x.data_ptr(), /*x_fp32=*/false, w.data_ptr(), b.data_ptr(), eps, rows, cols, out.data_ptr(),
                           stats[0].data_ptr<float>(), stats[1].data_ptr<float>(), nullptr, StreamOf(x));
  } else {
    cuda::RmsNormForward(x.data_ptr(), /*x_fp32=*/false, w.data_ptr(), eps, rows, cols, out.data_ptr(), nullptr,
                         StreamOf(x));
  }
  return out;
}

struct LinearFunction : public torch::autograd::Function<LinearFunction> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, const torch::Tensor& w,
                               const torch::Tensor& b, const torch::Tensor& residual) {
    c10::cuda::CUDAGuard guard(x.device());
    NoteFp8(ctx);
    torch::Tensor x2 = x.reshape({-1, x.size(-1)}).contiguous();
    const bool has_bias = b.numel() > 0;
    Fp8Saved fp8;
    torch::Tensor y = LinearProduct(x2, w, has_bias ? b : torch::Tensor(), has_bias ? cuda::Epilogue::kBias : cuda::Epilogue::kNone,
                                    {}, Residual2d(residual, w.size(0)), {}, &fp8);
    // Under FP8 the weight gradient reads the input's FP8 copy: the input itself is not kept.
    SaveFp8(ctx, "fp8", fp8);
    ctx->save_for_backward({fp8.x_t.defined() ? torch::Tensor() : x2, w, has_bias ? b : torch::Tensor()});
    ctx->saved_data["x_sizes"] = x.sizes().vec();
    ctx->saved_data["has_residual"] = residual.numel() > 0;
    return y.view(WithLast(x.sizes(), w.size(0)));
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    variable_list saved = ctx->get_saved_variables();
    const torch::Tensor& x2 = saved[0];
    const torch::Tensor &w = saved[1], &b = saved[2];
    c10::cuda::CUDAGuard guard(w.device());
    const Bf16ProductsScope precision = AsForward(ctx);
    const Fp8Saved fp8 = LoadFp8(ctx, "fp8");
    GradColumnSums sums;
    torch::Tensor g = ProductGrad(grads[0], w, &sums);
    auto [dw, db] = WeightAndBiasGrads(g, x2, w, b, sums, &fp8);
    torch::Tensor dx = InputGradProduct(g, w, cuda::Epilogue::kNone, {}, {}, false, &fp8)
                           .view(ctx->saved_data["x_sizes"].toIntVector());
    // The residual's gradient is the output's, unchanged.
    return {dx, dw, db, ctx->saved_data["has_residual"].toBool() ? grads[0] : torch::Tensor()};
  }
};

// gelu_tanh(x · w1ᵀ + b1) · w2ᵀ (+ b2): the GELU in the first product's epilogue (which keeps its
// input), its gradient in the epilogue of the second product's input gradient. Saves what the
// unfused layers would (x, the GELU's input and output), or with `recompute` not the output: backward
// makes it again from the input.
struct MlpFunction : public torch::autograd::Function<MlpFunction> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, const torch::Tensor& w1,
                               const torch::Tensor& b1, const torch::Tensor& w2, const torch::Tensor& b2,
                               const torch::Tensor& residual, int64_t tp, bool recompute) {
    c10::cuda::CUDAGuard guard(x.device());
    NoteFp8(ctx);
    ctx->saved_data["comm"] = tp;
    torch::Tensor x2 = x.reshape({-1, x.size(-1)}).contiguous();
    torch::Tensor pre = torch::empty({x2.size(0), w1.size(0)}, x.options());
    Fp8Saved fp8_1, fp8_2;
    torch::Tensor h = LinearProduct(x2, w1, b1, cuda::Epilogue::kGeluAuxBias, pre, {}, {}, &fp8_1);
    const bool has_bias2 = b2.numel() > 0;
    torch::Tensor y = LinearProduct(h, w2, has_bias2 ? b2 : torch::Tensor(), has_bias2 ? cuda::Epilogue::kBias : cuda::Epilogue::kNone,
                                    {}, Residual2d(residual, w2.size(0)), {}, &fp8_2);
    // Under FP8 the weight gradients read the inputs' FP8 copies: neither x nor the GELU's output is kept.
    SaveFp8(ctx, "fp8_1", fp8_1);
    SaveFp8(ctx, "fp8_2", fp8_2);
    Save(ctx, {w1, pre, recompute || fp8_2.x_t.defined() ? torch::Tensor() : h, w2, b1, has_bias2 ? b2 : torch::Tensor()},
         fp8_1.x_t.defined() ? SavedInput{} : SaveInput(x, x2));
    ctx->saved_data["x_sizes"] = x.sizes().vec();
    ctx->saved_data["has_residual"] = residual.numel() > 0;
    return y.view(WithLast(x.sizes(), w2.size(0)));
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    variable_list saved = ctx->get_saved_variables();
    const torch::Tensor &w1 = saved[1], &pre = saved[2], &w2 = saved[4], &b1 = saved[5], &b2 = saved[6];
    c10::cuda::CUDAGuard guard(w1.device());
    const Bf16ProductsScope precision = AsForward(ctx);
    const Fp8Saved fp8_1 = LoadFp8(ctx, "fp8_1"), fp8_2 = LoadFp8(ctx, "fp8_2");
    const torch::Tensor h =
        saved[3].defined() || fp8_2.x_t.defined() ? saved[3] : torch::gelu(pre, "tanh");
    GradColumnSums sums;
    torch::Tensor g = ProductGrad(grads[0], w2, &sums);
    // The input gradient first: its tensor-parallel sum runs beside the weight gradients.
    torch::Tensor gpre = InputGradProduct(g, w2, cuda::Epilogue::kDGelu, pre, {}, false, &fp8_2);
    torch::Tensor dx = InputGradProduct(gpre, w1, cuda::Epilogue::kNone, {}, {}, false, &fp8_1);
    SideStreamSum sum(dx, CommOf(ctx));
    auto [dw2, db2] = WeightAndBiasGrads(g, h, w2, b2, sums, &fp8_2);
    auto [dw1, db1] = WeightAndBiasGrads(gpre, fp8_1.x_t.defined() ? torch::Tensor() : SavedInputRows(ctx, saved), w1, b1,
                                         {}, &fp8_1);
    sum.Finish();
    return {dx.view(ctx->saved_data["x_sizes"].toIntVector()), dw1, db1, dw2, db2,
            ctx->saved_data["has_residual"].toBool() ? grads[0] : torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

// The q/k/v projection as three products, one per third of the weight, each writing a plane of its
// own: q, k and v come out as dense [b, t, heads, d] tensors, viewed [b, heads, t, d]. Attention then
// reads them without copies, allocates its output and its gradients in the same layout (so the
// output's [b, t, c] view and the gradients' flattening are free), where slices of one [b, t, 3c]
// product would cost a strided copy of the output forward, of its gradient and of q/k/v's gradients
// backward.
struct QkvFunction : public torch::autograd::Function<QkvFunction> {
  static variable_list forward(AutogradContext* ctx, const torch::Tensor& x, const torch::Tensor& w,
                               const torch::Tensor& b, int64_t heads, int64_t tp) {
    c10::cuda::CUDAGuard guard(x.device());
    NoteFp8(ctx);
    ctx->saved_data["comm"] = tp;
    torch::Tensor x2 = x.reshape({-1, x.size(-1)}).contiguous();
    const int64_t rows = x2.size(0), c = w.size(0) / 3;
    const bool has_bias = b.numel() > 0;
    torch::Tensor planes = torch::empty({3, rows, c}, x.options());
    bool fp8 = false;
    for (int64_t i = 0; i < 3; ++i) {
      Fp8Saved saved;
      LinearProduct(x2, w.narrow(0, i * c, c), has_bias ? b.narrow(0, i * c, c) : torch::Tensor(),
                    has_bias ? cuda::Epilogue::kBias : cuda::Epilogue::kNone, {}, {}, planes[i], &saved);
      SaveFp8(ctx, "fp8_" + std::to_string(i), saved);
      fp8 = saved.x_t.defined();
    }
    // Under FP8 the weight gradients read the input's FP8 copy (one for the three): x is not kept.
    Save(ctx, {w, has_bias ? b : torch::Tensor()}, fp8 ? SavedInput{} : SaveInput(x, x2));
    ctx->saved_data["x_sizes"] = x.sizes().vec();
    const int64_t batch = x.size(0), t = rows / batch;
    variable_list out;
    for (int64_t i = 0; i < 3; ++i) out.push_back(planes[i].view({batch, t, heads, c / heads}).transpose(1, 2));
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    variable_list saved = ctx->get_saved_variables();
    const torch::Tensor &w = saved[1], &b = saved[2];
    c10::cuda::CUDAGuard guard(w.device());
    const Bf16ProductsScope precision = AsForward(ctx);
    const std::vector<int64_t> x_sizes = ctx->saved_data["x_sizes"].toIntVector();
    const int64_t in = x_sizes.back(), rows = c10::multiply_integers(x_sizes) / in, c = w.size(0) / 3;
    const std::array<Fp8Saved, 3> fp8 = {LoadFp8(ctx, "fp8_0"), LoadFp8(ctx, "fp8_1"), LoadFp8(ctx, "fp8_2")};
    const bool has_bias = b.defined();
    torch::Tensor into = AccumulationTarget(w);
    const bool add = into.defined() && !TakeStale(into);
    torch::Tensor dw = into.defined() ? torch::Tensor() : torch::empty_like(w);
    // The bias gradient straight into b's .grad where it has one, as the weight's.
    torch::Tensor into_b = has_bias ? AccumulationTarget(b) : torch::Tensor();
    const bool add_b = into_b.defined() && !TakeStale(into_b);
    torch::Tensor db = has_bias && !into_b.defined() ? torch::empty({3 * c}, w.options()) : torch::Tensor();
    torch::Tensor dx = torch::empty({rows, in}, w.options());
    // [b, heads, t, d] back to [rows, c]: a view where attention kept the layout it was given.
    std::vector<torch::Tensor> g(3);
    for (int64_t i = 0; i < 3; ++i) {
      if (grads[i].defined()) g[i] = grads[i].transpose(1, 2).contiguous().view({rows, c});
    }
    // The input gradient first: its tensor-parallel sum runs beside the weight gradients.
    bool dx_written = false;
    for (int64_t i = 0; i < 3; ++i) {
      if (!g[i].defined()) continue;
      InputGradProduct(g[i], w.narrow(0, i * c, c), cuda::Epilogue::kNone, {}, dx, /*accumulate=*/dx_written, &fp8[i]);
      dx_written = true;
    }
    if (!dx_written) dx.zero_();
    SideStreamSum sum(dx, CommOf(ctx));
    const torch::Tensor x2 = fp8[0].x_t.defined() ? torch::Tensor() : SavedInputRows(ctx, saved);
    for (int64_t i = 0; i < 3; ++i) {
      torch::Tensor dw_i = (into.defined() ? into : dw).narrow(0, i * c, c);
      torch::Tensor db_i = has_bias ? (into_b.defined() ? into_b : db).narrow(0, i * c, c) : torch::Tensor();
      if (!g[i].defined()) {
        if (!add) dw_i.zero_();
        if (has_bias && !add_b) db_i.zero_();
        continue;
      }
      WeightGradProduct(g[i], x2, dw_i, /*accumulate=*/add, &fp8[i]);
      if (has_bias) BiasGrad(g[i], db_i, /*accumulate=*/add_b);
    }
    sum.Finish();
    return {dx.view(x_sizes), dw, db, torch::Tensor(), torch::Tensor()};
  }
};

// Products of one input x with two or three weights (w2 empty for two): each output its own dense
// tensor, as separate FusedLinear calls would give; backward adds the input gradients in the
// products' epilogues (one dx, no separate adds where the branches meet) and the weight gradients
// as FusedLinear's.
struct ProjectionsFunction : public torch::autograd::Function<ProjectionsFunction> {
  static variable_list forward(AutogradContext* ctx, const torch::Tensor& x, const torch::Tensor& w0,
                               const torch::Tensor& w1, const torch::Tensor& w2, int64_t tp) {
    c10::cuda::CUDAGuard guard(x.device());
    NoteFp8(ctx);
    ctx->saved_data["comm"] = tp;
    torch::Tensor x2 = x.reshape({-1, x.size(-1)}).contiguous();
    variable_list out;
    bool fp8 = false;
    for (const torch::Tensor* w : {&w0, &w1, &w2}) {
      if (w->numel() == 0) continue;
      Fp8Saved saved;
      out.push_back(
          LinearProduct(x2, *w, {}, cuda::Epilogue::kNone, {}, {}, {}, &saved).view(WithLast(x.sizes(), w->size(0))));
      SaveFp8(ctx, "fp8_" + std::to_string(out.size() - 1), saved);
      fp8 = saved.x_t.defined();
    }
    // Under FP8 the weight gradients read the input's FP8 copy (one for all): x is not kept.
    Save(ctx, {w0, w1, w2}, fp8 ? SavedInput{} : SaveInput(x, x2));
    ctx->saved_data["x_sizes"] = x.sizes().vec();
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    variable_list saved = ctx->get_saved_variables();
    const std::vector<int64_t> x_sizes = ctx->saved_data["x_sizes"].toIntVector();
    const int64_t in = x_sizes.back(), rows = c10::multiply_integers(x_sizes) / in;
    c10::cuda::CUDAGuard guard(saved[1].device());
    const Bf16ProductsScope precision = AsForward(ctx);
    std::vector<Fp8Saved> fp8;
    for (size_t i = 0; i < grads.size(); ++i) fp8.push_back(LoadFp8(ctx, "fp8_" + std::to_string(i)));
    torch::Tensor dx = torch::empty({rows, in}, saved[1].options());
    std::vector<torch::Tensor> g(grads.size());
    for (size_t i = 0; i < grads.size(); ++i) {
      if (grads[i].defined()) g[i] = grads[i].reshape({-1, saved[1 + i].size(0)}).contiguous();
    }
    // The input gradient first: its tensor-parallel sum runs beside the weight gradients.
    bool dx_written = false;
    for (size_t i = 0; i < g.size(); ++i) {
      if (!g[i].defined()) continue;
      InputGradProduct(g[i], saved[1 + i], cuda::Epilogue::kNone, {}, dx, /*accumulate=*/dx_written, &fp8[i]);
      dx_written = true;
    }
    if (!dx_written) dx.zero_();
    SideStreamSum sum(dx, CommOf(ctx));
    const torch::Tensor x2 = !fp8.empty() && fp8[0].x_t.defined() ? torch::Tensor() : SavedInputRows(ctx, saved);
    variable_list result(5);
    for (size_t i = 0; i < g.size(); ++i) {
      torch::Tensor into = AccumulationTarget(saved[1 + i]);
      if (!g[i].defined()) {
        if (TakeStale(into)) into.zero_();
        continue;
      }
      result[1 + i] = WeightGradProduct(g[i], x2, into, /*accumulate=*/!TakeStale(into), &fp8[i]);
    }
    sum.Finish();
    result[0] = dx.view(x_sizes);
    return result;
  }
};

// The down projection of silu(gate) · up, which it makes again in backward instead of keeping.
struct SwiGluLinearFunction : public torch::autograd::Function<SwiGluLinearFunction> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& gate, const torch::Tensor& up,
                               const torch::Tensor& w, const torch::Tensor& residual) {
    c10::cuda::CUDAGuard guard(gate.device());
    NoteFp8(ctx);
    torch::Tensor g = gate.reshape({-1, gate.size(-1)}).contiguous(), u = up.reshape({-1, up.size(-1)}).contiguous();
    torch::Tensor h = torch::empty_like(g);
    const torch::Tensor amax = fused::AmaxFor(h);
    cuda::SwiGlu(g.data_ptr(), u.data_ptr(), g.numel(), h.data_ptr(), StreamOf(g), fused::AmaxPointer(amax));
    fused::NoteAmax(h, amax);
    Fp8Saved fp8;
    torch::Tensor y = LinearProduct(h, w, {}, cuda::Epilogue::kNone, {}, Residual2d(residual, w.size(0)), {}, &fp8);
    SaveFp8(ctx, "fp8", fp8);  // under FP8 the weight gradient reads h's FP8 copy: h is not made again
    ctx->save_for_backward({g, u, w});
    ctx->saved_data["sizes"] = gate.sizes().vec();
    ctx->saved_data["has_residual"] = residual.numel() > 0;
    return y.view(WithLast(gate.sizes(), w.size(0)));
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    variable_list saved = ctx->get_saved_variables();
    const torch::Tensor &g = saved[0], &u = saved[1], &w = saved[2];
    c10::cuda::CUDAGuard guard(g.device());
    const Bf16ProductsScope precision = AsForward(ctx);
    const Fp8Saved fp8 = LoadFp8(ctx, "fp8");
    torch::Tensor dy = ProductGrad(grads[0], w);
    torch::Tensor h;
    if (!fp8.x_t.defined()) {
      h = torch::empty_like(g);
      cuda::SwiGlu(g.data_ptr(), u.data_ptr(), g.numel(), h.data_ptr(), StreamOf(g));
    }
    auto [dw, db] = WeightAndBiasGrads(dy, h, w, /*b=*/{}, {}, &fp8);
    torch::Tensor dh = InputGradProduct(dy, w, cuda::Epilogue::kNone, {}, {}, false, &fp8);
    h = torch::Tensor();
    torch::Tensor dgate = torch::empty_like(g), dup = torch::empty_like(u);
    const torch::Tensor dgate_amax = fused::AmaxFor(dgate), dup_amax = fused::AmaxFor(dup);
    cuda::SwiGluBackward(g.data_ptr(), u.data_ptr(), dh.data_ptr(), dh.numel(), dgate.data_ptr(), dup.data_ptr(),
                         StreamOf(dh), fused::AmaxPointer(dgate_amax), fused::AmaxPointer(dup_amax));
    fused::NoteAmax(dgate, dgate_amax);
    fused::NoteAmax(dup, dup_amax);
    const std::vector<int64_t> sizes = ctx->saved_data["sizes"].toIntVector();
    return {dgate.view(sizes), dup.view(sizes), dw, ctx->saved_data["has_residual"].toBool() ? grads[0] : torch::Tensor()};
  }
};

}  // namespace

SideStreamSum::SideStreamSum(torch::Tensor& t, Communicator* comm) {
  if (comm == nullptr) return;
  if (!t.is_cuda()) {
    if (Status s = comm->AllReduceSum(t); !s.ok()) throw std::runtime_error(s.message());
    return;
  }
  const c10::DeviceIndex device = t.device().index();
  cudaStream_t main = c10::cuda::getCurrentCUDAStream(device).stream();
  c10::cuda::CUDAStream side = SideStream(device);
  cudaEvent_t ready = nullptr;
  CheckCuda(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming), "cudaEventCreate");
  CheckCuda(cudaEventRecord(ready, main), "cudaEventRecord");
  CheckCuda(cudaStreamWaitEvent(side.stream(), ready, 0), "cudaStreamWaitEvent");
  cudaEventDestroy(ready);
  {
    c10::cuda::CUDAStreamGuard on_side(side);
    if (Status s = comm->AllReduceSum(t); !s.ok()) throw std::runtime_error(s.message());
  }
  cudaEvent_t done = nullptr;
  CheckCuda(cudaEventCreateWithFlags(&done, cudaEventDisableTiming), "cudaEventCreate");
  CheckCuda(cudaEventRecord(done, side.stream()), "cudaEventRecord");
  main_ = main;
  done_ = done;
}

void SideStreamSum::Finish() {
  if (done_ == nullptr) return;
  cudaStreamWaitEvent(static_cast<cudaStream_t>(main_), static_cast<cudaEvent_t>(done_), 0);
  cudaEventDestroy(static_cast<cudaEvent_t>(done_));
  done_ = nullptr;
}

bool FusedLinearAvailable(const torch::Tensor& x, const torch::Tensor& w) {
  return kernel_options.linear && x.defined() && Bf16Cuda(x) && Bf16Cuda(w) && w.dim() == 2 && w.is_contiguous() && w.size(0) % 8 == 0 &&
         w.size(1) % 8 == 0;
}

bool FusedLinearTakes(int64_t out, int64_t in) { return kernel_options.linear && out % 8 == 0 && in % 8 == 0; }

// LibTorch's custom functions take defined tensors only: an absent bias is an empty one.
torch::Tensor OrEmpty(const torch::Tensor& t, const torch::Tensor& like) {
  return t.defined() ? t : torch::empty({0}, like.options());
}

torch::Tensor FusedLinear(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b,
                          const torch::Tensor& residual) {
  return LinearFunction::apply(x, w, OrEmpty(b, w), OrEmpty(residual, x));
}

torch::Tensor FusedSwiGluLinear(const torch::Tensor& gate, const torch::Tensor& up, const torch::Tensor& w,
                                const torch::Tensor& residual) {
  return SwiGluLinearFunction::apply(gate, up, w, OrEmpty(residual, gate));
}

torch::Tensor FusedMlp(const torch::Tensor& x, const torch::Tensor& w1, const torch::Tensor& b1, const torch::Tensor& w2,
                       const torch::Tensor& b2, const torch::Tensor& residual, Communicator* tp, bool recompute_gelu) {
  return MlpFunction::apply(x, w1, b1, w2, OrEmpty(b2, w2), OrEmpty(residual, x), Handle(tp), recompute_gelu);
}

std::vector<torch::Tensor> FusedQkv(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b, int64_t heads,
                                    Communicator* tp) {
  return QkvFunction::apply(x, w, OrEmpty(b, w), heads, Handle(tp));
}

std::vector<torch::Tensor> FusedProjections(const torch::Tensor& x, const std::vector<torch::Tensor>& weights,
                                            Communicator* tp) {
  if (weights.size() < 2 || weights.size() > 3) throw std::invalid_argument("FusedProjections takes two or three weights");
  return ProjectionsFunction::apply(x, weights[0], weights[1],
                                    weights.size() == 3 ? weights[2] : torch::empty({0}, weights[0].options()), Handle(tp));
}

#else

SideStreamSum::SideStreamSum(torch::Tensor& t, Communicator* comm) {
  if (comm == nullptr) return;
  if (Status s = comm->AllReduceSum(t); !s.ok()) throw std::runtime_error(s.message());
}

void SideStreamSum::Finish() {}

bool FusedLinearAvailable(const torch::Tensor& /*x*/, const torch::Tensor& /*w*/) { return false; }

bool FusedLinearTakes(int64_t /*out*/, int64_t /*in*/) { return false; }

torch::Tensor FusedLinear(const torch::Tensor& /*x*/, const torch::Tensor& /*w*/, const torch::Tensor& /*b*/,
                          const torch::Tensor& /*residual*/) {
  throw std::logic_error("FusedLinear: this worker was built without CUDA kernels");
}

torch::Tensor FusedMlp(const torch::Tensor& /*x*/, const torch::Tensor& /*w1*/, const torch::Tensor& /*b1*/,
                       const torch::Tensor& /*w2*/, const torch::Tensor& /*b2*/, const torch::Tensor& /*residual*/,
                       Communicator* /*tp*/, bool /*recompute_gelu*/) {
  throw std::logic_error("FusedMlp: this worker was built without CUDA kernels");
}

std::vector<torch::Tensor> FusedQkv(const torch::Tensor& /*x*/, const torch::Tensor& /*w*/, const torch::Tensor& /*b*/,
                                    int64_t /*heads*/, Communicator* /*tp*/) {
  throw std::logic_error("FusedQkv: this worker was built without CUDA kernels");
}

std::vector<torch::Tensor> FusedProjections(const torch::Tensor& /*x*/, const std::vector<torch::Tensor>& /*weights*/,
                                            Communicator* /*tp*/) {
  throw std::logic_error("FusedProjections: this worker was built without CUDA kernels");
}

torch::Tensor FusedSwiGluLinear(const torch::Tensor& /*gate*/, const torch::Tensor& /*up*/, const torch::Tensor& /*w*/,
                                const torch::Tensor& /*residual*/) {
  throw std::logic_error("FusedSwiGluLinear: this worker was built without CUDA kernels");
}

#endif

}  // namespace ltrain::worker
