#include "worker/gloo_communicator.h"

#include <exception>
#include <vector>

#include <ATen/ATen.h>
#include <gloo/allgather.h>
#include <gloo/allreduce.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/rendezvous/context.h>
#include <gloo/transport/tcp/device.h>

namespace ltrain::worker {
namespace {

template <typename T>
void SumInto(void* c, const void* a, const void* b, size_t n) {
  T* out = static_cast<T*>(c);
  const T* x = static_cast<const T*>(a);
  const T* y = static_cast<const T*>(b);
  for (size_t i = 0; i < n; ++i) out[i] = x[i] + y[i];
}

// Gloo works on host memory: a GPU tensor is copied to a contiguous host buffer and back.
struct HostStage {
  explicit HostStage(const at::Tensor& t)
      : original(t), host(t.is_cpu() && t.is_contiguous() ? t : t.to(at::kCPU).contiguous()) {}
  void WriteBack() {
    if (!host.is_same(original)) original.copy_(host);
  }
  at::Tensor original;
  at::Tensor host;
};

Status Failed(const char* op, const std::exception& e) {
  return Unavailable(std::string("gloo ") + op + " failed (a peer rank may have died): " + e.what());
}

}  // namespace

StatusOr<std::unique_ptr<GlooCommunicator>> GlooCommunicator::Create(gloo::rendezvous::Store& store,
                                                                      int rank, int size,
                                                                      const std::string& bind_addr,
                                                                      std::chrono::milliseconds timeout) {
  if (size < 1 || rank < 0 || rank >= size) {
    return InvalidArgument("gloo: rank " + std::to_string(rank) + " outside world size " +
                           std::to_string(size));
  }
  try {
    gloo::transport::tcp::attr attr;
    attr.hostname = bind_addr.empty() ? "127.0.0.1" : bind_addr;
    auto device = gloo::transport::tcp::CreateDevice(attr);
    auto context = std::make_shared<gloo::rendezvous::Context>(rank, size);
    context->setTimeout(timeout);
    context->connectFullMesh(store, device);
    return std::unique_ptr<GlooCommunicator>(new GlooCommunicator(std::move(context), rank, size));
  } catch (const std::exception& e) {
    return Unavailable("gloo: rank " + std::to_string(rank) + " of " + std::to_string(size) +
                       " could not connect (bind address " + (bind_addr.empty() ? std::string("127.0.0.1") : bind_addr) + "): " + e.what());
  }
}

Status GlooCommunicator::AllReduceSum(at::Tensor& tensor) {
  if (!tensor.is_contiguous()) return InvalidArgument("AllReduceSum needs a contiguous tensor");
  if (size_ == 1 || tensor.numel() == 0) return Status::Ok();
  HostStage stage(tensor);
  gloo::AllreduceOptions opts(context_);
  opts.setTag(next_tag_++);
  const size_t n = static_cast<size_t>(stage.host.numel());
  switch (stage.host.scalar_type()) {
    case at::kFloat:
      opts.setOutput(stage.host.data_ptr<float>(), n);
      opts.setReduceFunction(&SumInto<float>);
      break;
    case at::kDouble:
      opts.setOutput(stage.host.data_ptr<double>(), n);
      opts.setReduceFunction(&SumInto<double>);
      break;
    case at::kLong:
      opts.setOutput(stage.host.data_ptr<int64_t>(), n);
      opts.setReduceFunction(&SumInto<int64_t>);
      break;
    case at::kInt:
      opts.setOutput(stage.host.data_ptr<int32_t>(), n);
      opts.setReduceFunction(&SumInto<int32_t>);
      break;
    default:
      return InvalidArgument(std::string("gloo AllReduceSum: unsupported dtype ") +
                             c10::toString(stage.host.scalar_type()));
  }
  try {
    gloo::allreduce(opts);
  } catch (const std::exception& e) {
    return Failed("all_reduce", e);
  }
  stage.WriteBack();
  return Status::Ok();
}

Status GlooCommunicator::Broadcast(at::Tensor& tensor, int root) {
  if (root < 0 || root >= size_) return InvalidArgument("broadcast root " + std::to_string(root) + " out of range");
  if (size_ == 1 || tensor.numel() == 0) return Status::Ok();
  HostStage stage(tensor);
  // Byte-wise: broadcast only moves data, so the dtype does not matter.
  auto* bytes = static_cast<uint8_t*>(stage.host.data_ptr());
  const size_t nbytes = static_cast<size_t>(stage.host.numel()) * stage.host.element_size();
  gloo::BroadcastOptions opts(context_);
  opts.setTag(next_tag_++);
  opts.setRoot(root);
  if (rank_ == root) opts.setInput(bytes, nbytes);
  opts.setOutput(bytes, nbytes);
  try {
    gloo::broadcast(opts);
  } catch (const std::exception& e) {
    return Failed("broadcast", e);
  }
  stage.WriteBack();
  return Status::Ok();
}

Status GlooCommunicator::AllGather(const at::Tensor& input, at::Tensor& output) {
  if (output.numel() != input.numel() * size_ || output.scalar_type() != input.scalar_type() ||
      !output.is_contiguous()) {
    return InvalidArgument("AllGather output must be contiguous with " +
                           std::to_string(input.numel() * size_) + " elements of the input's dtype");
  }
  if (size_ == 1) {
    output.view(-1).copy_(input.reshape(-1));
    return Status::Ok();
  }
  at::Tensor in = input.to(at::kCPU).contiguous();
  HostStage stage(output);
  const size_t in_bytes = static_cast<size_t>(in.numel()) * in.element_size();
  gloo::AllgatherOptions opts(context_);
  opts.setTag(next_tag_++);
  opts.setInput(static_cast<uint8_t*>(in.data_ptr()), in_bytes);
  opts.setOutput(static_cast<uint8_t*>(stage.host.data_ptr()), in_bytes * size_);
  try {
    gloo::allgather(opts);
  } catch (const std::exception& e) {
    return Failed("all_gather", e);
  }
  stage.WriteBack();
  return Status::Ok();
}

Status GlooCommunicator::Barrier() {
  if (size_ == 1) return Status::Ok();
  gloo::BarrierOptions opts(context_);
  opts.setTag(next_tag_++);
  try {
    gloo::barrier(opts);
  } catch (const std::exception& e) {
    return Failed("barrier", e);
  }
  return Status::Ok();
}

}  // namespace ltrain::worker
