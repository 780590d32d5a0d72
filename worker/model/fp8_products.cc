// FP8 operands: the quantization (our kernels), the operands the linear products share, the figures of
// a step's operands, FP8 products of quantized tensors, and which products run in FP8.
#include <array>
#include <deque>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "worker/model/fused_kernels.h"

#if defined(LTRAIN_WITH_CUDA_KERNELS)
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "worker/model/cuda/fp8_cast.h"
#include "worker/model/cuda/gemm.h"
#include "worker/torch_compat.h"
#endif

#include "worker/model/fused_internal.h"

namespace ltrain::worker {
namespace {

thread_local bool bf16_products_only = false;

}  // namespace

Bf16ProductsScope::Bf16ProductsScope(bool bf16) : was_(bf16_products_only) { bf16_products_only = bf16; }
Bf16ProductsScope::~Bf16ProductsScope() { bf16_products_only = was_; }

bool Fp8ProductsOn() { return fused::Options().fp8 && !bf16_products_only; }

#if defined(LTRAIN_WITH_CUDA_KERNELS) && defined(LTRAIN_HAVE_FLOAT8)
namespace {

using fused::Fp8Operand;
using fused::kFp8Operands;
using fused::QuantizedOperand;

std::mutex fp8_mu;
std::map<c10::DeviceIndex, std::array<QuantizedOperand, kFp8Operands>> fp8_last;
// The amax of every operand the FP8 products quantized since TakeFp8Figures last ran, by kind
// (activations, weights, gradients): device scalars, read together once a step.
std::array<std::vector<torch::Tensor>, kFp8Operands> fp8_amaxes;

// Amaxes the kernels took of tensors as they wrote them (NoteAmax), the newest last: taken by the
// quantization of the same elements at the same version. Each holds its tensor, so that no other
// takes its memory meanwhile; a few a device, the oldest dropped first.
struct NotedAmax {
  torch::Tensor t;
  int64_t version = -1;
  torch::Tensor amax;
};
constexpr size_t kNotedAmaxes = 4;
std::map<c10::DeviceIndex, std::deque<NotedAmax>> noted_amaxes;
int64_t writer_amaxes_taken = 0;

// The amax noted for `t` as it is now (then no longer noted), or undefined. Under fp8_mu.
torch::Tensor TakeNotedAmax(const torch::Tensor& t, int64_t version) {
  auto it = noted_amaxes.find(t.device().index());
  if (it == noted_amaxes.end()) return {};
  std::deque<NotedAmax>& noted = it->second;
  for (auto n = noted.begin(); n != noted.end(); ++n) {
    // The same elements: one storage (held, so not another's since), one start, as many, one version.
    if (n->t.storage().unsafeGetStorageImpl() == t.storage().unsafeGetStorageImpl() &&
        n->t.data_ptr() == t.data_ptr() && n->t.numel() == t.numel() && n->version == version) {
      torch::Tensor amax = std::move(n->amax);
      noted.erase(n);
      ++writer_amaxes_taken;
      return amax;
    }
  }
  return {};
}

// Fp8QuantizeOnDevice, tensorwise, with the amax a kernel took already where `amax` is defined.
Fp8Tensor QuantizeTensorwise(const torch::Tensor& x, Fp8Format format, torch::Tensor* transposed,
                             const torch::Tensor& amax);

}  // namespace

void fused::ForgetFp8Operands() {
  std::lock_guard<std::mutex> lock(fp8_mu);
  fp8_last.clear();
  noted_amaxes.clear();
}

torch::Tensor fused::AmaxFor(const torch::Tensor& t) {
  // Tensorwise only: a rowwise quantization takes its rows' amaxes itself.
  if (!Fp8ProductsOn() || !fused::Options().fp8_writer_amax || fused::Options().fp8_rowwise || !t.is_cuda() ||
      t.scalar_type() != torch::kBFloat16) {
    return {};
  }
  return torch::zeros({}, t.options().dtype(torch::kFloat));
}

void fused::NoteAmax(const torch::Tensor& t, const torch::Tensor& amax) {
  if (!amax.defined() || !t.is_contiguous()) return;
  std::lock_guard<std::mutex> lock(fp8_mu);
  std::deque<NotedAmax>& noted = noted_amaxes[t.device().index()];
  noted.push_back({t, static_cast<int64_t>(t._version()), amax});
  if (noted.size() > kNotedAmaxes) noted.pop_front();
}

QuantizedOperand fused::InFp8(const torch::Tensor& t, Fp8Operand operand) {
  const int64_t version = static_cast<int64_t>(t._version());
  {
    std::lock_guard<std::mutex> lock(fp8_mu);
    const QuantizedOperand& last = fp8_last[t.device().index()][operand];
    if (last.source.defined() && last.source.unsafeGetTensorImpl() == t.unsafeGetTensorImpl() &&
        last.version == version && last.source.data_ptr() == t.data_ptr()) {
      return last;
    }
  }
  torch::Tensor amax;
  if (t.is_contiguous() && !fused::Options().fp8_rowwise) {
    std::lock_guard<std::mutex> lock(fp8_mu);
    amax = TakeNotedAmax(t, version);
  }
  QuantizedOperand fresh;
  const Fp8Format format =
      operand == kGradient && !fused::Options().fp8_gradients_e4m3 ? Fp8Format::kE5M2 : Fp8Format::kE4M3;
  const torch::Tensor rows = t.contiguous();
  if (fused::Options().fp8_rowwise) {
    // Each direction along rows of its own: t's rows for one product, its columns for the other.
    const std::pair<Fp8Tensor, Fp8Tensor> both = Fp8QuantizeBothWaysOnDevice(rows, format, /*power_of_2=*/false);
    fresh.q = both.first;
    fresh.transposed = both.second.data;
    fresh.transposed_scale_inv = both.second.scale_inv;
  } else {
    fresh.q = QuantizeTensorwise(rows, format, &fresh.transposed, amax);
    fresh.transposed_scale_inv = fresh.q.scale_inv;
  }
  fresh.source = t;
  fresh.version = version;
  std::lock_guard<std::mutex> lock(fp8_mu);
  fp8_amaxes[operand].push_back(fresh.q.amax);
  fp8_last[t.device().index()][operand] = fresh;
  return fresh;
}

bool Fp8ProductsAvailable() {
  int count = 0, device = 0, major = 0, minor = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0 || cudaGetDevice(&device) != cudaSuccess) return false;
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
  return major * 10 + minor >= 89;
}

namespace {

// Fp8QuantizeOnDevice, with the amax of x given (tensorwise only) or, where undefined, taken here.
Fp8Tensor Quantize(const torch::Tensor& x, Fp8Format format, Fp8Scaling scaling, bool power_of_2,
                   torch::Tensor* transposed, const torch::Tensor& amax_given) {
  if (!x.is_cuda() || x.scalar_type() != torch::kBFloat16 || x.dim() != 2 || !x.is_contiguous()) {
    throw std::invalid_argument("Fp8QuantizeOnDevice takes a contiguous 2-D bf16 CUDA tensor");
  }
  const bool rowwise = scaling == Fp8Scaling::kRowwise;
  if (rowwise && transposed != nullptr) throw std::invalid_argument("a rowwise quantization has no transposed copy");
  c10::cuda::CUDAGuard guard(x.device());
  const int64_t rows = x.size(0), cols = x.size(1);
  const bool e4m3 = format == Fp8Format::kE4M3;
  const auto fp8 = x.options().dtype(e4m3 ? at::ScalarType::Float8_e4m3fn : at::ScalarType::Float8_e5m2);
  const auto f32 = x.options().dtype(torch::kFloat);
  Fp8Tensor q;
  const bool given = amax_given.defined() && !rowwise;
  q.amax = given ? amax_given : rowwise ? torch::empty({rows, 1}, f32) : torch::zeros({}, f32);
  q.scale_inv = rowwise ? torch::empty({rows, 1}, f32) : torch::empty({}, f32);
  q.data = torch::empty({rows, cols}, fp8);
  if (transposed != nullptr) *transposed = torch::empty({cols, rows}, fp8);
  cudaStream_t stream = fused::StreamOf(x);
  if (!given) cuda::Bf16Amax(x.data_ptr(), rows, cols, rowwise, q.amax.data_ptr<float>(), stream);
  cuda::Bf16ToFp8(x.data_ptr(), rows, cols, q.amax.data_ptr<float>(), rowwise, e4m3, power_of_2, q.data.data_ptr(),
                  transposed != nullptr ? transposed->data_ptr() : nullptr, q.scale_inv.data_ptr<float>(), stream);
  return q;
}

Fp8Tensor QuantizeTensorwise(const torch::Tensor& x, Fp8Format format, torch::Tensor* transposed,
                             const torch::Tensor& amax) {
  return Quantize(x, format, Fp8Scaling::kTensorwise, /*power_of_2=*/false, transposed, amax);
}

}  // namespace

Fp8Tensor Fp8QuantizeOnDevice(const torch::Tensor& x, Fp8Format format, Fp8Scaling scaling, bool power_of_2,
                              torch::Tensor* transposed) {
  return Quantize(x, format, scaling, power_of_2, transposed, {});
}

std::pair<Fp8Tensor, Fp8Tensor> Fp8QuantizeBothWaysOnDevice(const torch::Tensor& x, Fp8Format format, bool power_of_2) {
  if (!x.is_cuda() || x.scalar_type() != torch::kBFloat16 || x.dim() != 2 || !x.is_contiguous()) {
    throw std::invalid_argument("Fp8QuantizeBothWaysOnDevice takes a contiguous 2-D bf16 CUDA tensor");
  }
  const int64_t rows = x.size(0), cols = x.size(1);
  if (!cuda::Fp8BothWaysTakes(x.data_ptr(), rows, cols)) {
    // Sides the tiles do not take: each way on its own, the columns from a bf16 transposed copy.
    return {Fp8QuantizeOnDevice(x, format, Fp8Scaling::kRowwise, power_of_2),
            Fp8QuantizeOnDevice(x.t().contiguous(), format, Fp8Scaling::kRowwise, power_of_2)};
  }
  c10::cuda::CUDAGuard guard(x.device());
  const bool e4m3 = format == Fp8Format::kE4M3;
  const auto fp8 = x.options().dtype(e4m3 ? at::ScalarType::Float8_e4m3fn : at::ScalarType::Float8_e5m2);
  const auto f32 = x.options().dtype(torch::kFloat);
  Fp8Tensor by_rows, by_columns;
  by_rows.amax = torch::zeros({rows, 1}, f32);
  by_columns.amax = torch::zeros({cols, 1}, f32);
  by_rows.scale_inv = torch::empty({rows, 1}, f32);
  by_columns.scale_inv = torch::empty({cols, 1}, f32);
  by_rows.data = torch::empty({rows, cols}, fp8);
  by_columns.data = torch::empty({cols, rows}, fp8);
  cuda::Bf16ToFp8BothWays(x.data_ptr(), rows, cols, by_rows.amax.data_ptr<float>(), by_columns.amax.data_ptr<float>(),
                          e4m3, power_of_2, by_rows.data.data_ptr(), by_columns.data.data_ptr(),
                          by_rows.scale_inv.data_ptr<float>(), by_columns.scale_inv.data_ptr<float>(),
                          fused::StreamOf(x));
  return {by_rows, by_columns};
}

int64_t Fp8WriterAmaxesTaken() {
  std::lock_guard<std::mutex> lock(fp8_mu);
  return writer_amaxes_taken;
}

torch::Tensor TakeFp8Figures() {
  std::array<std::vector<torch::Tensor>, kFp8Operands> taken;
  {
    std::lock_guard<std::mutex> lock(fp8_mu);
    taken.swap(fp8_amaxes);
  }
  torch::Tensor any;
  int64_t products = 0;
  for (const auto& amaxes : taken) {
    if (!amaxes.empty() && !any.defined()) any = amaxes.front();
    products += static_cast<int64_t>(amaxes.size());
  }
  if (!any.defined()) return {};
  c10::cuda::CUDAGuard guard(any.device());
  const auto f32 = any.options().dtype(torch::kFloat);
  std::vector<torch::Tensor> parts;
  torch::Tensor overflowed = torch::zeros({}, f32);
  for (const auto& amaxes : taken) {
    if (amaxes.empty()) {
      parts.push_back(torch::zeros({2}, f32));
      continue;
    }
    // An operand's amax: its rows' largest under rowwise scaling. A NaN among them shows as the
    // largest and the smallest (max and min propagate it).
    std::vector<torch::Tensor> each;
    each.reserve(amaxes.size());
    for (const torch::Tensor& amax : amaxes) each.push_back(amax.dim() == 0 ? amax : amax.max());
    const torch::Tensor a = torch::stack(each).reshape({-1});
    parts.push_back(torch::stack({a.max(), a.min()}));
    overflowed = overflowed + torch::isfinite(a).logical_not().sum().to(torch::kFloat);
  }
  parts.push_back(torch::full({1}, static_cast<double>(products), f32));
  parts.push_back(overflowed.reshape({1}));
  return torch::cat(parts);
}

torch::Tensor Fp8Product(const Fp8Tensor& a, const Fp8Tensor& b, bool fast_accum) {
  auto type = [](const torch::Tensor& t) {
    if (t.scalar_type() == at::ScalarType::Float8_e4m3fn) return cuda::GemmType::kE4M3;
    if (t.scalar_type() == at::ScalarType::Float8_e5m2) return cuda::GemmType::kE5M2;
    throw std::invalid_argument("Fp8Product takes float8 operands");
  };
  const int64_t m = a.data.size(0), n = b.data.size(0), k = a.data.size(1);
  if (b.data.size(1) != k || !a.data.is_contiguous() || !b.data.is_contiguous()) {
    throw std::invalid_argument("Fp8Product takes contiguous a [m, k] and b [n, k]");
  }
  const bool rowwise = a.scale_inv.dim() > 0;
  if (rowwise != (b.scale_inv.dim() > 0)) throw std::invalid_argument("Fp8Product takes both operands scaled alike");
  c10::cuda::CUDAGuard guard(a.data.device());
  torch::Tensor y = torch::empty({m, n}, a.data.options().dtype(torch::kBFloat16));
  // cuBLASLt (column-major) computes yᵀ [n, m] = b [n, k] · aᵀ: A is b, transposed; B is a.
  cuda::GemmArgs g;
  g.trans_a = true;
  g.m = n, g.n = m, g.k = k;
  g.a = b.data.data_ptr(), g.lda = k;
  g.b = a.data.data_ptr(), g.ldb = k;
  g.d = y.data_ptr(), g.ldd = n;
  g.a_type = type(b.data);
  g.b_type = type(a.data);
  g.a_scale_inv = b.scale_inv.data_ptr<float>();
  g.b_scale_inv = a.scale_inv.data_ptr<float>();
  g.rowwise = rowwise;
  g.fast_accum = fast_accum;
  fused::Gemm(g, y, false);
  return y;
}

#else
namespace {

// Why this build has no FP8 products.
#if defined(LTRAIN_WITH_CUDA_KERNELS)
constexpr const char* kNoFp8 = "this LibTorch has no float8 types";
#else
constexpr const char* kNoFp8 = "this worker was built without CUDA kernels";
#endif

}  // namespace

void fused::ForgetFp8Operands() {}

torch::Tensor fused::AmaxFor(const torch::Tensor& /*t*/) { return {}; }

void fused::NoteAmax(const torch::Tensor& /*t*/, const torch::Tensor& /*amax*/) {}

bool Fp8ProductsAvailable() { return false; }

torch::Tensor TakeFp8Figures() { return {}; }

int64_t Fp8WriterAmaxesTaken() { return 0; }

Fp8Tensor Fp8QuantizeOnDevice(const torch::Tensor& /*x*/, Fp8Format /*format*/, Fp8Scaling /*scaling*/,
                              bool /*power_of_2*/, torch::Tensor* /*transposed*/) {
  throw std::logic_error(std::string("Fp8QuantizeOnDevice: ") + kNoFp8);
}

std::pair<Fp8Tensor, Fp8Tensor> Fp8QuantizeBothWaysOnDevice(const torch::Tensor& /*x*/, Fp8Format /*format*/,
                                                            bool /*power_of_2*/) {
  throw std::logic_error(std::string("Fp8QuantizeBothWaysOnDevice: ") + kNoFp8);
}

torch::Tensor Fp8Product(const Fp8Tensor& /*a*/, const Fp8Tensor& /*b*/, bool /*fast_accum*/) {
  throw std::logic_error(std::string("Fp8Product: ") + kNoFp8);
}

#endif

}  // namespace ltrain::worker
