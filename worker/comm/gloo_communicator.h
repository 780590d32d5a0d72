// GlooCommunicator: the CPU backend. One gloo full-mesh context over TCP, bound to $LTRAIN_BIND_ADDR
// (default 127.0.0.1), built through the job's rendezvous store. The world communicator owns the TCP
// device; a group communicator (tp, dp, pp, embedding) shares it and connects through a prefixed view of the store
// named after the group, so the keys of different groups never collide.
//
// Created by the worker's main thread once per generation; every call runs on the calling thread
// (one thread at a time, see Communicator). GPU tensors are staged through host memory. Each
// collective uses the next tag of a counter that all ranks of the group advance identically (they
// call collectives in the same order); point-to-point messages use slots of their own built from
// the caller's tag. Every call is reported to Progress::Global() with the group's name.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <gloo/context.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/device.h>
#include <gloo/transport/unbound_buffer.h>

#include "worker/comm/communicator.h"

namespace ltrain::worker {

class GlooCommunicator : public Communicator {
 public:
  // Blocks until all `size` ranks have connected through `store`, or `timeout` passes.
  static StatusOr<std::unique_ptr<GlooCommunicator>> Create(gloo::rendezvous::Store& store, int rank,
                                                            int size, const std::string& bind_addr,
                                                            std::chrono::milliseconds timeout);
  // A communicator over `group` (global ranks; this rank is `group_rank` of them) that shares
  // `world`'s device and timeout. Every member must call it.
  static StatusOr<std::unique_ptr<GlooCommunicator>> CreateGroup(const GlooCommunicator& world,
                                                                 gloo::rendezvous::Store& store,
                                                                 const Group& group, int group_rank);
  ~GlooCommunicator() override;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string backend() const override { return "gloo"; }
  Status AllReduceSum(at::Tensor& tensor) override;
  Status Broadcast(at::Tensor& tensor, int root) override;
  Status AllGather(const at::Tensor& input, at::Tensor& output) override;
  // Gloo has no reduce-scatter in its options API: all-reduce a copy, keep this rank's chunk (same
  // sums, twice the traffic of a ring reduce-scatter; NCCL does the real one).
  Status ReduceScatterSum(const at::Tensor& input, at::Tensor& output) override;
  Status Barrier() override;
  Status AllToAll(const at::Tensor& input, const std::vector<int64_t>& send_counts, at::Tensor& output,
                  const std::vector<int64_t>& recv_counts) override;
  Status Send(const at::Tensor& tensor, int dst, uint32_t tag) override;
  Status Recv(at::Tensor& tensor, int src, uint32_t tag) override;
  Status WaitSends() override;
  // Both transfers straight from and into the callers' tensors (no copy kept for later, as Send's):
  // the call returns once both are done.
  Status SendRecv(const at::Tensor& send, int dst, at::Tensor& recv, int src, uint32_t tag) override;
  // Closes every connection of this context (gloo's closeConnections): a peer blocked in a collective
  // with this rank reads the end of its stream and fails at once.
  void Abort() override;
  // The context's timeout, which each later call waits at most.
  void SetTimeout(std::chrono::milliseconds timeout) override { context_->setTimeout(timeout); }

 private:
  struct PendingSend {
    at::Tensor host;
    std::unique_ptr<gloo::transport::UnboundBuffer> buffer;
  };

  GlooCommunicator(std::shared_ptr<gloo::Context> context, std::shared_ptr<gloo::transport::Device> device,
                   int rank, int size, std::string group)
      : context_(std::move(context)), device_(std::move(device)), rank_(rank), size_(size), group_(std::move(group)) {}

  std::shared_ptr<gloo::Context> context_;
  std::shared_ptr<gloo::transport::Device> device_;
  int rank_;
  int size_;
  std::string group_;
  uint32_t next_tag_ = 0;
  std::vector<PendingSend> pending_;
};

}  // namespace ltrain::worker
