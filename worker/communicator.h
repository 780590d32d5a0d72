// Communicator: the collectives the training loop needs, over the ranks of one process group.
//
// Contract across ranks: every rank of the group calls the same collectives, in the same order,
// with tensors of the same shape and dtype; a rank that skips one hangs the others until the
// backend's timeout. Calls are blocking and made from the training thread only; a communicator is
// not thread-safe. Errors (peer died, timeout) come back as a Status, never as an exception.
#pragma once

#include <memory>
#include <string>

#include <ATen/core/Tensor.h>

#include "common/status.h"

namespace ltrain::worker {

class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  // "gloo", "nccl", "self", "fake": for logs.
  virtual std::string backend() const = 0;

  // Sum over ranks, in place. The tensor must be contiguous.
  virtual Status AllReduceSum(at::Tensor& tensor) = 0;
  // Copies root's tensor into every rank's tensor, in place.
  virtual Status Broadcast(at::Tensor& tensor, int root) = 0;
  // output (contiguous, size() * input.numel() elements, input's dtype) receives every rank's input
  // in rank order.
  virtual Status AllGather(const at::Tensor& input, at::Tensor& output) = 0;
  virtual Status Barrier() = 0;
};

// A group of one: every collective is the identity. What a world-size-1 job uses.
class SelfCommunicator : public Communicator {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  std::string backend() const override { return "self"; }
  Status AllReduceSum(at::Tensor& tensor) override;
  Status Broadcast(at::Tensor& tensor, int root) override;
  Status AllGather(const at::Tensor& input, at::Tensor& output) override;
  Status Barrier() override { return Status::Ok(); }
};

// Single-rank communicator for tests: behaves like SelfCommunicator, counts calls, and fails the
// collective numbered `fail_at` (0-based, over all calls) with `failure`, as a dead peer would.
class FakeCommunicator : public SelfCommunicator {
 public:
  std::string backend() const override { return "fake"; }
  Status AllReduceSum(at::Tensor& tensor) override;
  Status Broadcast(at::Tensor& tensor, int root) override;
  Status AllGather(const at::Tensor& input, at::Tensor& output) override;
  Status Barrier() override;

  void FailAt(int call, Status failure) {
    fail_at_ = call;
    failure_ = std::move(failure);
  }
  int calls() const { return calls_; }

 private:
  Status Next();

  int calls_ = 0;
  int fail_at_ = -1;
  Status failure_;
};

}  // namespace ltrain::worker
