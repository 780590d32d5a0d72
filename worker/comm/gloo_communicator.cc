#include "worker/comm/gloo_communicator.h"

#include <cstdio>
#include <exception>
#include <memory>
#include <vector>

#include <ATen/ATen.h>
#include <gloo/allgather.h>
#include <gloo/allreduce.h>
#include <gloo/alltoallv.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/rendezvous/context.h>
#include <gloo/transport/tcp/device.h>

#include "worker/control/progress.h"
#include "worker/control/rendezvous_store.h"

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

int64_t Bytes(const at::Tensor& t) { return static_cast<int64_t>(t.numel()) * t.element_size(); }

// Point-to-point slots live above every collective's slot prefix (gloo/types.h uses 0x01..0x08).
uint64_t P2pSlot(uint32_t tag) { return (static_cast<uint64_t>(0x70) << 56) | tag; }

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
    return std::unique_ptr<GlooCommunicator>(new GlooCommunicator(std::move(context), device, rank, size, "world"));
  } catch (const std::exception& e) {
    return Unavailable("gloo: rank " + std::to_string(rank) + " of " + std::to_string(size) +
                       " could not connect (bind address " + (bind_addr.empty() ? std::string("127.0.0.1") : bind_addr) + "): " + e.what());
  }
}

StatusOr<std::unique_ptr<GlooCommunicator>> GlooCommunicator::CreateGroup(const GlooCommunicator& world,
                                                                           gloo::rendezvous::Store& store,
                                                                           const Group& group, int group_rank) {
  const int size = static_cast<int>(group.ranks.size());
  if (group_rank < 0 || group_rank >= size) {
    return InvalidArgument("gloo: rank " + std::to_string(group_rank) + " outside group " + group.name);
  }
  try {
    std::unique_ptr<gloo::rendezvous::Store> prefixed = PrefixedView("group/" + group.name, store);
    auto context = std::make_shared<gloo::rendezvous::Context>(group_rank, size);
    context->setTimeout(world.context_->getTimeout());
    std::shared_ptr<gloo::transport::Device> device = world.device_;
    context->connectFullMesh(*prefixed, device);
    return std::unique_ptr<GlooCommunicator>(
        new GlooCommunicator(std::move(context), world.device_, group_rank, size, group.name));
  } catch (const std::exception& e) {
    return Unavailable("gloo: rank " + std::to_string(group_rank) + " of group " + group.name +
                       " could not connect: " + e.what());
  }
}

GlooCommunicator::~GlooCommunicator() {
  // Sends still in flight reference their host buffers: finish them before both go away.
  if (!pending_.empty()) (void)WaitSends();
}

Status GlooCommunicator::AllReduceSum(at::Tensor& tensor) {
  if (!tensor.is_contiguous()) return InvalidArgument("AllReduceSum needs a contiguous tensor");
  if (size_ == 1 || tensor.numel() == 0) return Status::Ok();
  if (tensor.scalar_type() == at::kBFloat16 || tensor.scalar_type() == at::kHalf) {
    // Summed in fp32 (gloo has no 16-bit float sum here), rounded once at the end.
    at::Tensor wide = tensor.to(at::kFloat);
    LTRAIN_RETURN_IF_ERROR(AllReduceSum(wide));
    tensor.copy_(wide);
    return Status::Ok();
  }
  ScopedCollective progress("all_reduce", group_, Bytes(tensor));
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
  ScopedCollective progress("broadcast", group_, Bytes(tensor));
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
  ScopedCollective progress("all_gather", group_, Bytes(output));
  at::Tensor in = input.to(at::kCPU).contiguous();
  if (in.is_cpu() && output.is_cpu() && in.data_ptr() >= output.data_ptr() &&
      static_cast<uint8_t*>(in.data_ptr()) < static_cast<uint8_t*>(output.data_ptr()) + Bytes(output)) {
    in = in.clone();  // the input is a slice of the output (in-place all-gather)
  }
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

Status GlooCommunicator::ReduceScatterSum(const at::Tensor& input, at::Tensor& output) {
  if (input.numel() != output.numel() * size_ || input.scalar_type() != output.scalar_type()) {
    return InvalidArgument("ReduceScatterSum input must have " + std::to_string(output.numel() * size_) +
                           " elements of the output's dtype");
  }
  at::Tensor sum = input.reshape(-1).clone();
  LTRAIN_RETURN_IF_ERROR(AllReduceSum(sum));
  output.view(-1).copy_(sum.narrow(0, static_cast<int64_t>(rank_) * output.numel(), output.numel()));
  return Status::Ok();
}

Status GlooCommunicator::AllToAll(const at::Tensor& input, const std::vector<int64_t>& send_counts,
                                  at::Tensor& output, const std::vector<int64_t>& recv_counts) {
  LTRAIN_RETURN_IF_ERROR(CheckAllToAll(input, send_counts, output, recv_counts, size_));
  const int64_t row_bytes = AllToAllRowWidth(input, output) * static_cast<int64_t>(input.element_size());
  if (size_ == 1) {
    if (output.numel() > 0) output.view(-1).copy_(input.reshape(-1));
    return Status::Ok();
  }
  ScopedCollective progress("all_to_all", group_, Bytes(input) + Bytes(output));
  at::Tensor in = input.to(at::kCPU).contiguous();
  HostStage stage(output);
  // Bytes a rank: gloo's element is a byte here, whatever the dtype. A rank that sends nothing gets
  // zeros in its counts (and a pointer to a byte that is never read).
  std::vector<int64_t> send_bytes(size_), recv_bytes(size_);
  for (int r = 0; r < size_; ++r) send_bytes[r] = send_counts[r] * row_bytes, recv_bytes[r] = recv_counts[r] * row_bytes;
  uint8_t spare_in = 0, spare_out = 0;
  auto* in_bytes = in.numel() > 0 ? static_cast<uint8_t*>(in.data_ptr()) : &spare_in;
  auto* out_bytes = stage.host.numel() > 0 ? static_cast<uint8_t*>(stage.host.data_ptr()) : &spare_out;
  gloo::AlltoallvOptions opts(context_);
  opts.setTag(next_tag_++);
  opts.setInput(in_bytes, send_bytes);
  opts.setOutput(out_bytes, recv_bytes);
  try {
    gloo::alltoallv(opts);
  } catch (const std::exception& e) {
    return Failed("all_to_all", e);
  }
  stage.WriteBack();
  return Status::Ok();
}

Status GlooCommunicator::Send(const at::Tensor& tensor, int dst, uint32_t tag) {
  if (dst < 0 || dst >= size_ || dst == rank_) {
    return InvalidArgument("send to rank " + std::to_string(dst) + " in group " + group_ + " of " + std::to_string(size_));
  }
  ScopedCollective progress("send", group_, Bytes(tensor));
  PendingSend pending;
  pending.host = tensor.to(at::kCPU).contiguous();
  if (pending.host.is_same(tensor)) pending.host = tensor.clone();  // the caller may reuse its tensor
  try {
    pending.buffer = context_->createUnboundBuffer(pending.host.data_ptr(), static_cast<size_t>(Bytes(pending.host)));
    pending.buffer->send(dst, P2pSlot(tag));
  } catch (const std::exception& e) {
    return Failed("send", e);
  }
  pending_.push_back(std::move(pending));
  return Status::Ok();
}

Status GlooCommunicator::Recv(at::Tensor& tensor, int src, uint32_t tag) {
  if (src < 0 || src >= size_ || src == rank_) {
    return InvalidArgument("receive from rank " + std::to_string(src) + " in group " + group_ + " of " + std::to_string(size_));
  }
  if (!tensor.is_contiguous()) return InvalidArgument("Recv needs a contiguous tensor");
  ScopedCollective progress("recv", group_, Bytes(tensor));
  HostStage stage(tensor);
  try {
    auto buffer = context_->createUnboundBuffer(stage.host.data_ptr(), static_cast<size_t>(Bytes(stage.host)));
    buffer->recv(src, P2pSlot(tag));
    if (!buffer->waitRecv(nullptr, context_->getTimeout())) {
      return Unavailable("gloo recv from rank " + std::to_string(src) + " of group " + group_ + " was aborted");
    }
  } catch (const std::exception& e) {
    return Failed("recv", e);
  }
  stage.WriteBack();
  return Status::Ok();
}

Status GlooCommunicator::SendRecv(const at::Tensor& send, int dst, at::Tensor& recv, int src, uint32_t tag) {
  for (int peer : {dst, src}) {
    if (peer < 0 || peer >= size_ || peer == rank_) {
      return InvalidArgument("send-receive with rank " + std::to_string(peer) + " in group " + group_ + " of " +
                             std::to_string(size_));
    }
  }
  if (!recv.is_contiguous()) return InvalidArgument("SendRecv needs a contiguous tensor to receive into");
  ScopedCollective progress("send_recv", group_, Bytes(send) + Bytes(recv));
  HostStage out(send);
  HostStage in(recv);
  try {
    auto sending = context_->createUnboundBuffer(out.host.data_ptr(), static_cast<size_t>(Bytes(out.host)));
    auto receiving = context_->createUnboundBuffer(in.host.data_ptr(), static_cast<size_t>(Bytes(in.host)));
    sending->send(dst, P2pSlot(tag));
    receiving->recv(src, P2pSlot(tag));
    const bool got = receiving->waitRecv(nullptr, context_->getTimeout());
    const bool sent = sending->waitSend(nullptr, context_->getTimeout());
    if (!got || !sent) {
      return Unavailable("gloo send-receive with ranks " + std::to_string(dst) + " and " + std::to_string(src) +
                         " of group " + group_ + " was aborted");
    }
  } catch (const std::exception& e) {
    return Failed("send-receive", e);
  }
  in.WriteBack();
  return Status::Ok();
}

Status GlooCommunicator::WaitSends() {
  Status status;
  for (PendingSend& pending : pending_) {
    try {
      if (!pending.buffer->waitSend(nullptr, context_->getTimeout()) && status.ok()) {
        status = Unavailable("gloo send in group " + group_ + " was aborted");
      }
    } catch (const std::exception& e) {
      if (status.ok()) status = Failed("send", e);
    }
  }
  pending_.clear();
  return status;
}

void GlooCommunicator::Abort() {
  try {
    context_->closeConnections();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ltrain-worker: gloo group %s: closing its connections: %s\n", group_.c_str(), e.what());
  }
  pending_.clear();  // sends over closed connections never complete: nothing to wait for
}

Status GlooCommunicator::Barrier() {
  if (size_ == 1) return Status::Ok();
  ScopedCollective progress("barrier", group_, 0);
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
