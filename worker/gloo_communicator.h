// GlooCommunicator: the CPU backend. One gloo full-mesh context over TCP, bound to $LTRAIN_BIND_ADDR
// (default 127.0.0.1), built through the job's rendezvous store.
//
// Created by the worker's main thread once per generation; every collective is blocking and runs
// on the calling thread. GPU tensors are staged through host memory. Each collective uses the next
// tag of a counter that all ranks advance identically (they call collectives in the same order).
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include <gloo/context.h>
#include <gloo/rendezvous/store.h>

#include "worker/communicator.h"

namespace ltrain::worker {

class GlooCommunicator : public Communicator {
 public:
  // Blocks until all `size` ranks have connected through `store`, or `timeout` passes.
  static StatusOr<std::unique_ptr<GlooCommunicator>> Create(gloo::rendezvous::Store& store, int rank,
                                                            int size, const std::string& bind_addr,
                                                            std::chrono::milliseconds timeout);

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string backend() const override { return "gloo"; }
  Status AllReduceSum(at::Tensor& tensor) override;
  Status Broadcast(at::Tensor& tensor, int root) override;
  Status AllGather(const at::Tensor& input, at::Tensor& output) override;
  Status Barrier() override;

 private:
  GlooCommunicator(std::shared_ptr<gloo::Context> context, int rank, int size)
      : context_(std::move(context)), rank_(rank), size_(size) {}

  std::shared_ptr<gloo::Context> context_;
  int rank_;
  int size_;
  uint32_t next_tag_ = 0;
};

}  // namespace ltrain::worker
