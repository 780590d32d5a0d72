// Every difference between the LibTorch versions the worker builds against (Debian 12's 1.13 CPU
// build and the GPU host's 2.x CUDA build) lives here, keyed on TORCH_VERSION_MAJOR.
#pragma once

#include <cmath>
#include <cstdlib>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <set>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <ATen/Context.h>
#include <ATen/autocast_mode.h>
#include <ATen/native/Resize.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/nn/functional.h>
#include <torch/optim.h>
#include <torch/version.h>
#if defined(LTRAIN_WITH_NCCL)
#include <ATen/cuda/CUDAEvent.h>
#include <ATen/cuda/Sleep.h>
#include <ATen/native/cuda/Resize.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif
#if TORCH_VERSION_MAJOR >= 2
#include <ATen/ops/_fused_adamw.h>
#endif
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 8)
#include <ATen/ops/_grouped_mm.h>
#endif
#if defined(LTRAIN_WITH_NCCL) && (TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4))
#include <ATen/ops/_scaled_dot_product_flash_attention.h>
#include <ATen/ops/_scaled_dot_product_flash_attention_backward.h>
#endif
#if TORCH_VERSION_MAJOR >= 2 && defined(LTRAIN_WITH_NCCL)
#include <torch/csrc/autograd/profiler_kineto.h>
#define LTRAIN_HAVE_KINETO 1
#endif
#if defined(LTRAIN_WITH_NCCL) && (TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4))
#include <torch/csrc/cuda/memory_snapshot.h>
#define LTRAIN_HAVE_MEMORY_SNAPSHOT 1
#endif

namespace ltrain::worker::compat {

// Causal scaled-dot-product attention over [B, heads, T, head_dim] tensors.
inline torch::Tensor CausalAttention(const torch::Tensor& q, const torch::Tensor& k,
                                     const torch::Tensor& v) {
#if TORCH_VERSION_MAJOR >= 2
  return at::scaled_dot_product_attention(q, k, v, /*attn_mask=*/{}, /*dropout_p=*/0.0,
                                          /*is_causal=*/true);
#else
  // 1.13 has no fused kernel: softmax(q k^T / sqrt(d) + causal mask) v, written out.
  const int64_t t = q.size(-2);
  const double scale = 1.0 / std::sqrt(static_cast<double>(q.size(-1)));
  torch::Tensor scores = torch::matmul(q, k.transpose(-2, -1)) * scale;
  torch::Tensor future = torch::ones({t, t}, torch::TensorOptions().dtype(torch::kBool).device(q.device()))
                             .triu(1);
  scores = scores.masked_fill(future, -std::numeric_limits<float>::infinity());
  return torch::matmul(torch::softmax(scores, -1), v);
#endif
}

// Grouped-query causal attention: q [B, heads, T, d], k and v [B, kv_heads, T, d], query head j
// reading key/value head j / (heads / kv_heads). 2.5 and later take the groups in the kernel
// (enable_gqa); before, the key/value heads are repeated.
inline torch::Tensor CausalAttentionGqa(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v) {
  const int64_t groups = q.size(1) / k.size(1);
  if (groups == 1) return CausalAttention(q, k, v);
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 5)
  return at::scaled_dot_product_attention(q, k, v, /*attn_mask=*/{}, /*dropout_p=*/0.0, /*is_causal=*/true,
                                          /*scale=*/std::nullopt, /*enable_gqa=*/true);
#else
  return CausalAttention(q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1));
#endif
}

// x / rms(x) · w, the statistics in fp32, the result in x's type (llama_model.RMSNorm): 2.4 and
// later through at::rms_norm (one fused kernel on CUDA in recent releases), before written out.
inline torch::Tensor RmsNorm(const torch::Tensor& x, const torch::Tensor& w, double eps) {
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
  return at::rms_norm(x, {x.size(-1)}, w, eps);
#else
  torch::Tensor xf = x.to(torch::kFloat);
  return (xf * torch::rsqrt(xf.pow(2).mean(-1, /*keepdim=*/true) + eps)).to(x.scalar_type()) * w;
#endif
}

// Clears gradients so that the next backward writes fresh ones. 2.x's zero_grad() sets them to
// undefined, 1.13's zeroes them; callers treat an undefined gradient as zero either way.
inline void ZeroGrad(torch::optim::Optimizer& optimizer) { optimizer.zero_grad(); }

// Calls `ready` each time autograd has accumulated a gradient into the leaf `param` (a post-hook on
// its gradient accumulator, as DDP's reducer does). Returns the accumulator: keep it alive, or
// autograd makes a new one without the hook.
inline std::shared_ptr<torch::autograd::Node> AddGradReadyHook(const torch::Tensor& param, std::function<void()> ready) {
  struct Hook : torch::autograd::FunctionPostHook {
    explicit Hook(std::function<void()> f) : fn(std::move(f)) {}
    torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                              const torch::autograd::variable_list& /*inputs*/) override {
      fn();
      return outputs;
    }
    std::function<void()> fn;
  };
  std::shared_ptr<torch::autograd::Node> accumulator = torch::autograd::impl::grad_accumulator(param);
  accumulator->add_post_hook(std::make_unique<Hook>(std::move(ready)));
  return accumulator;
}

// Resizes the storage under `t` in place (0 frees it): every tensor sharing the storage, the
// views autograd saved for backward included, sees the new memory. What FSDP does to free and
// re-gather parameters.
inline void ResizeStorage(const torch::Tensor& t, size_t nbytes) {
#if defined(LTRAIN_WITH_NCCL)
  if (t.is_cuda()) {
    at::native::resize_bytes_cuda(t.storage().unsafeGetStorageImpl(), nbytes);
    return;
  }
#endif
  at::native::resize_bytes_cpu(t.storage().unsafeGetStorageImpl(), nbytes);
}

// Points t's storage at `nbytes` of memory it does not own (nullptr, 0: at none), as ResizeStorage
// would resize it: every tensor and saved value over that storage follows.
inline void PointStorage(const torch::Tensor& t, void* ptr, size_t nbytes) {
  c10::StorageImpl* storage = t.storage().unsafeGetStorageImpl();
  storage->set_data_ptr_noswap(c10::DataPtr(ptr, t.device()));
  storage->set_nbytes(nbytes);
}

// bf16 autocast on CUDA for its scope (parameters stay fp32 masters; matmuls run in bf16; the
// gradients of fp32 leaves are fp32). Disabled when `enabled` is false.
class CudaBf16Autocast {
 public:
  explicit CudaBf16Autocast(bool enabled) : enabled_(enabled) {
    if (!enabled_) return;
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
    at::autocast::set_autocast_dtype(at::kCUDA, at::kBFloat16);
    at::autocast::set_autocast_enabled(at::kCUDA, true);
#else
    at::autocast::set_autocast_gpu_dtype(at::kBFloat16);
    at::autocast::set_enabled(true);
#endif
  }
  ~CudaBf16Autocast() {
    if (!enabled_) return;
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
    at::autocast::set_autocast_enabled(at::kCUDA, false);
#else
    at::autocast::set_enabled(false);
#endif
    at::autocast::clear_cache();
  }
  CudaBf16Autocast(const CudaBf16Autocast&) = delete;
  CudaBf16Autocast& operator=(const CudaBf16Autocast&) = delete;

 private:
  bool enabled_;
};

// AdamW over lists of same-device tensors in one fused kernel (PyTorch's fused=True kernel):
// weight decay, both moments, bias corrections from `step` (a float tensor on the device, read, not
// advanced) and the update, one pass over memory; gradients are divided by `grad_divisor` on the
// fly (undefined: not at all). Returns false where the kernel does not exist (LibTorch 1.x, CPU tensors): the caller runs
// its own update.
inline bool FusedAdamW(const std::vector<torch::Tensor>& params, const std::vector<torch::Tensor>& grads,
                       const std::vector<torch::Tensor>& exp_avgs, const std::vector<torch::Tensor>& exp_avg_sqs,
                       const torch::Tensor& step, double lr, double beta1, double beta2, double weight_decay,
                       double eps, const torch::Tensor& grad_divisor) {
#if TORCH_VERSION_MAJOR >= 2
  if (params.empty() || !params[0].is_cuda()) return params.empty();
  std::vector<torch::Tensor> steps(params.size(), step);
  std::optional<torch::Tensor> divisor;
  if (grad_divisor.defined()) divisor = grad_divisor;
  at::_fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, /*max_exp_avg_sqs=*/{}, steps, lr, beta1, beta2,
                    weight_decay, eps, /*amsgrad=*/false, /*maximize=*/false, divisor, /*found_inf=*/std::nullopt);
  return true;
#else
  (void)grads, (void)exp_avgs, (void)exp_avg_sqs, (void)step, (void)lr, (void)beta1, (void)beta2;
  (void)weight_decay, (void)eps, (void)grad_divisor;
  return params.empty();
#endif
}

// Waits until every kernel queued on `device` has finished (no-op on CPU).
// Deterministic kernels from here on (call before the first CUDA work): PyTorch's deterministic
// algorithms (an op without one fails, naming itself), cuDNN's, and the cuBLAS workspace size
// that makes its reductions reproducible.
inline void UseDeterministicAlgorithms() {
  ::setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8", /*overwrite=*/0);
  at::globalContext().setDeterministicAlgorithms(true, /*warn_only=*/false);
  at::globalContext().setDeterministicCuDNN(true);
  at::globalContext().setBenchmarkCuDNN(false);
}

inline void Synchronize(const torch::Device& device) {
#if defined(LTRAIN_WITH_NCCL)
  if (device.is_cuda()) c10::cuda::device_synchronize();
#endif
  (void)device;
}

// Peak bytes the caching allocator handed out on `device` since the start (0 on CPU).
inline int64_t PeakDeviceBytes(const torch::Device& device) {
#if defined(LTRAIN_WITH_NCCL)
  if (device.is_cuda()) {
    return c10::cuda::CUDACachingAllocator::getDeviceStats(device.index()).allocated_bytes[0].peak;
  }
#endif
  (void)device;
  return 0;
}

// The CUDA caching allocator records its history from now on: each allocation and free (the newest
// `max_entries`), without stacks (the worker has no Python frames; C++ unwinding would cost every
// allocation). False where this LibTorch cannot.
inline bool RecordMemoryHistory(size_t max_entries) {
#if defined(LTRAIN_HAVE_MEMORY_SNAPSHOT)
  torch::cuda::_record_memory_history(std::optional<std::string>("all"), std::optional<std::string>("all"),
                                      std::string("python"), max_entries);
  return true;
#else
  (void)max_entries;
  return false;
#endif
}

// The allocator's state and history, pickled as torch.cuda.memory._dump_snapshot writes them (what
// PyTorch's memory viewer reads); empty where this LibTorch cannot.
inline std::string MemorySnapshotPickled() {
#if defined(LTRAIN_HAVE_MEMORY_SNAPSHOT)
  return torch::cuda::_memory_snapshot_pickled();
#else
  return "";
#endif
}

// Calls `observer` when the caching allocator cannot serve an allocation, before it raises the
// out-of-memory error (its blocks are still as they were).
inline void OnDeviceOutOfMemory(std::function<void()> observer) {
#if defined(LTRAIN_HAVE_MEMORY_SNAPSHOT)
  c10::cuda::CUDACachingAllocator::attachOutOfMemoryObserver(
      [observer = std::move(observer)](int64_t, size_t, size_t, size_t) { observer(); });
#else
  (void)observer;
#endif
}

// Records CPU operators and CUDA kernels between Start() and Stop(), which writes a Chrome trace
// (chrome://tracing, Perfetto). Only where LibTorch has Kineto and CUDA; elsewhere Start() says why not.
class StepProfiler {
 public:
  // Empty when it started, else why it cannot.
  std::string Start() {
#if defined(LTRAIN_HAVE_KINETO)
    namespace prof = torch::autograd::profiler;
    const prof::ProfilerConfig config(torch::profiler::impl::ProfilerState::KINETO);
    const std::set<torch::profiler::impl::ActivityType> activities{torch::profiler::impl::ActivityType::CPU,
                                                                   torch::profiler::impl::ActivityType::CUDA};
    prof::prepareProfiler(config, activities);
    prof::enableProfiler(config, activities);
    running_ = true;
    return "";
#else
    return "this worker's LibTorch has no CUDA profiler (Kineto)";
#endif
  }
  void Stop(const std::string& path) {
#if defined(LTRAIN_HAVE_KINETO)
    if (!running_) return;
    running_ = false;
    torch::autograd::profiler::disableProfiler()->save(path);
#else
    (void)path;
#endif
  }
  bool running() const { return running_; }

 private:
  bool running_ = false;
};

// A point in a CUDA stream's queue that work on another stream can wait for (what orders a
// collective on its own stream after the backward kernels that produced its gradients, and the
// optimizer after the collective). Empty, and every call a no-op, on CPU tensors.
class StreamMarker {
 public:
  // Marks everything queued so far on the current stream of `device`.
  static StreamMarker Record(const torch::Device& device) {
    StreamMarker m;
#if defined(LTRAIN_WITH_NCCL)
    if (device.is_cuda()) {
      m.event_ = std::make_shared<at::cuda::CUDAEvent>();
      m.event_->record(c10::cuda::getCurrentCUDAStream(device.index()));
    }
#else
    (void)device;
#endif
    return m;
  }
  // The current stream (of the marker's device) waits for the marked work.
  void Block() const {
#if defined(LTRAIN_WITH_NCCL)
    if (event_) event_->block(c10::cuda::getCurrentCUDAStream(event_->device_index()));
#endif
  }
  // The host waits for the marked work, and for nothing queued after it.
  void Wait() const {
#if defined(LTRAIN_WITH_NCCL)
    if (event_) event_->synchronize();
#endif
  }

 private:
#if defined(LTRAIN_WITH_NCCL)
  std::shared_ptr<at::cuda::CUDAEvent> event_;
#endif
};

// The GPU time of the work queued on a device's current stream between Start() and Stop(), read
// once the GPU has passed Stop() (Ready), so that measuring never makes the host wait. On CPU it is
// always ready and 0: the host's clock measures CPU work.
class DeviceSpan {
 public:
  static DeviceSpan Start(const torch::Device& device) {
    DeviceSpan span;
#if defined(LTRAIN_WITH_NCCL)
    if (device.is_cuda()) {
      span.start_ = std::make_shared<at::cuda::CUDAEvent>(cudaEventDefault);
      span.stop_ = std::make_shared<at::cuda::CUDAEvent>(cudaEventDefault);
      span.start_->record(c10::cuda::getCurrentCUDAStream(device.index()));
    }
#else
    (void)device;
#endif
    return span;
  }
  void Stop() {
#if defined(LTRAIN_WITH_NCCL)
    if (stop_) stop_->record(c10::cuda::getCurrentCUDAStream(start_->device_index()));
#endif
  }
  bool Ready() const {
#if defined(LTRAIN_WITH_NCCL)
    if (stop_) return stop_->query();
#endif
    return true;
  }
  double Ms() const {
#if defined(LTRAIN_WITH_NCCL)
    if (start_ && stop_) return static_cast<double>(start_->elapsed_time(*stop_));
#endif
    return 0.0;
  }

 private:
#if defined(LTRAIN_WITH_NCCL)
  std::shared_ptr<at::cuda::CUDAEvent> start_, stop_;
#endif
};

// Queues a kernel that keeps the device's current stream busy for about `ms` milliseconds (the
// slow-rank drill on a GPU: the work is slower, not the host); nothing on CPU.
inline void DeviceSleep(const torch::Device& device, double ms) {
#if defined(LTRAIN_WITH_NCCL)
  if (device.is_cuda() && ms > 0) {
    // Clock cycles at about 1.8 GHz, the SM clock of an H100 or H200 under load.
    at::cuda::sleep(static_cast<int64_t>(ms * 1.8e6));
  }
#else
  (void)device, (void)ms;
#endif
}

// A CUDA stream of its own (from LibTorch's pool; `high_priority`: from its high-priority pool, whose
// kernels the GPU schedules first) for collectives that overlap computation; Scope makes it the
// current stream of the calling thread. No-ops on CPU.
class SideStream {
 public:
  explicit SideStream(const torch::Device& device, bool high_priority = false) {
#if defined(LTRAIN_WITH_NCCL)
    if (device.is_cuda()) {
      stream_ = std::make_shared<c10::cuda::CUDAStream>(c10::cuda::getStreamFromPool(high_priority, device.index()));
    }
#else
    (void)device;
    (void)high_priority;
#endif
  }
  bool active() const {
#if defined(LTRAIN_WITH_NCCL)
    return stream_ != nullptr;
#else
    return false;
#endif
  }
  // The side stream waits for the work queued so far on the device's current stream (the inputs of
  // what it is about to run); then the current stream for the side stream's work (its outputs).
  void WaitForCurrent(const torch::Device& device) const {
#if defined(LTRAIN_WITH_NCCL)
    if (!stream_) return;
    at::cuda::CUDAEvent ready;
    ready.record(c10::cuda::getCurrentCUDAStream(device.index()));
    ready.block(*stream_);
#else
    (void)device;
#endif
  }
  void CurrentWaitsForIt(const torch::Device& device) const {
#if defined(LTRAIN_WITH_NCCL)
    if (!stream_) return;
    at::cuda::CUDAEvent done;
    done.record(*stream_);
    done.block(c10::cuda::getCurrentCUDAStream(device.index()));
#else
    (void)device;
#endif
  }
  class Scope {
   public:
    explicit Scope(const SideStream& side) {
#if defined(LTRAIN_WITH_NCCL)
      if (side.stream_) guard_.emplace(*side.stream_);
#else
      (void)side;
#endif
    }

   private:
#if defined(LTRAIN_WITH_NCCL)
    std::optional<c10::cuda::CUDAStreamGuard> guard_;
#endif
  };

 private:
#if defined(LTRAIN_WITH_NCCL)
  std::shared_ptr<c10::cuda::CUDAStream> stream_;
#endif
};

// Marks `t`'s memory as used by the current stream of its device: the caching allocator then
// reuses it, once `t` is freed, only after the work queued there so far (a buffer made on one
// stream and read by a collective on another). A no-op on CPU.
inline void RecordCurrentStream(const torch::Tensor& t) {
#if defined(LTRAIN_WITH_NCCL)
  if (t.is_cuda()) t.record_stream(c10::cuda::getCurrentCUDAStream(t.device().index()));
#else
  (void)t;
#endif
}

// Flash attention's kernels themselves, forward and backward, for attention computed a block at a
// time (context parallelism's ring): the forward's log-sum-exp of each query's scaled scores comes
// back with its output, and the backward takes the output and log-sum-exp of the whole row (every
// block merged), as the ring's backward needs. 2.4 and later on CUDA, for bf16 or fp16 inputs whose
// head size flash attention takes (a multiple of 8, at most 256), with as many key and value heads as
// query heads; elsewhere FlashBlocksAvailable is false and the callers write the block out.
#if defined(LTRAIN_WITH_NCCL) && (TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4))
#define LTRAIN_HAVE_FLASH_BLOCKS 1
inline bool FlashBlocksAvailable(const torch::Tensor& q) {
  const int64_t hd = q.size(-1);
  return q.is_cuda() && (q.scalar_type() == torch::kBFloat16 || q.scalar_type() == torch::kHalf) && hd % 8 == 0 &&
         hd <= 256;
}
// q [b, h, tq, hd], k and v [b, h, tk, hd]; causal: a query i sees keys 0..i (tq == tk). The output
// [b, h, tq, hd] in q's type and the log-sum-exp [b, h, tq] in fp32.
inline std::pair<torch::Tensor, torch::Tensor> FlashBlockForward(const torch::Tensor& q, const torch::Tensor& k,
                                                                 const torch::Tensor& v, bool causal, double scale) {
  auto result = at::_scaled_dot_product_flash_attention(q, k, v, /*dropout_p=*/0.0, causal,
                                                        /*return_debug_mask=*/false, scale);
  torch::Tensor lse = std::get<1>(result);
  if (lse.size(-1) != q.size(2)) lse = lse.narrow(-1, 0, q.size(2));
  return {std::get<0>(result), lse.contiguous()};
}
// The gradients of q, k and v of one block, given the whole row's output and log-sum-exp. Without
// dropout the kernel's random state is unread; it gets the empty scalars its forward gives then.
inline std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> FlashBlockBackward(
    const torch::Tensor& dout, const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
    const torch::Tensor& out, const torch::Tensor& lse, bool causal, double scale) {
  const torch::Tensor none;
  const torch::Tensor seed = at::empty({}, at::dtype(at::kLong)), offset = at::empty({}, at::dtype(at::kLong));
  return at::_scaled_dot_product_flash_attention_backward(dout, q, k, v, out, lse, none, none, q.size(2), k.size(2),
                                                           /*dropout_p=*/0.0, causal, seed, offset, scale);
}
#else
inline bool FlashBlocksAvailable(const torch::Tensor&) { return false; }
inline std::pair<torch::Tensor, torch::Tensor> FlashBlockForward(const torch::Tensor&, const torch::Tensor&,
                                                                 const torch::Tensor&, bool, double) {
  throw std::logic_error("flash attention's blocks are not built into this LibTorch");
}
inline std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> FlashBlockBackward(
    const torch::Tensor&, const torch::Tensor&, const torch::Tensor&, const torch::Tensor&, const torch::Tensor&,
    const torch::Tensor&, bool, double) {
  throw std::logic_error("flash attention's blocks are not built into this LibTorch");
}
#endif

// Whether this LibTorch has float8 types (2.1 and later), and the cast to them: e4m3fn (no infinity)
// or e5m2. Without them FP8 products are not built, and the scaling's rounding stands for the cast.
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 1)
#define LTRAIN_HAVE_FLOAT8 1
inline constexpr bool kHasFloat8 = true;
inline torch::Tensor ToFloat8(const torch::Tensor& x, bool e4m3) {
  return x.to(e4m3 ? at::ScalarType::Float8_e4m3fn : at::ScalarType::Float8_e5m2);
}
#else
inline constexpr bool kHasFloat8 = false;
inline torch::Tensor ToFloat8(const torch::Tensor& x, bool) { return x; }
#endif

// Grouped matrix products (2.8 and later): a [rows, k] times, for each group g of rows (offs: int32
// cumulative ends on the device), b[g] [k, n], as one launch; with autograd. bf16 on CUDA devices of
// compute capability 9.0 or newer. Without it (kHasGroupedMm false) callers loop over the groups.
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 8)
inline constexpr bool kHasGroupedMm = true;
inline torch::Tensor GroupedMm(const torch::Tensor& a, const torch::Tensor& b, const torch::Tensor& offs) {
  return at::_grouped_mm(a, b, offs);
}
#else
inline constexpr bool kHasGroupedMm = false;
inline torch::Tensor GroupedMm(const torch::Tensor& a, const torch::Tensor&, const torch::Tensor&) { return a; }
#endif

// Whether this LibTorch was built with CUDA (the NCCL communicator is compiled only then).
#if defined(LTRAIN_WITH_NCCL)
inline constexpr bool kBuiltWithCuda = true;
#else
inline constexpr bool kBuiltWithCuda = false;
#endif

// The compute capability's major number of a CUDA device (9 for Hopper); 0 without CUDA.
#if defined(LTRAIN_WITH_NCCL)
inline int DeviceCapabilityMajor(const torch::Device& device) {
  int major = 0;
  const int index = device.has_index() ? device.index() : static_cast<int>(c10::cuda::current_device());
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, index) != cudaSuccess) return 0;
  return major;
}
#else
inline int DeviceCapabilityMajor(const torch::Device&) { return 0; }
#endif

}  // namespace ltrain::worker::compat
