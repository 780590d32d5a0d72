// NcclCommunicator: the GPU backend (compiled only when LibTorch has CUDA: LTRAIN_WITH_NCCL).
//
// Created on the worker's main thread once per generation: rank 0 makes the ncclUniqueId and
// publishes it through the job's rendezvous store; every rank then joins with ncclCommInitRank.
// Collectives are enqueued on the current CUDA stream of the tensor's device and return without
// waiting (stream order keeps the training loop correct); errors of the NCCL calls come back as
// Status. Every rank calls collectives in the same order.
#pragma once

#include <memory>
#include <vector>

#include <gloo/rendezvous/store.h>
#include <nccl.h>

#include "worker/communicator.h"

namespace ltrain::worker {

class NcclCommunicator : public Communicator {
 public:
  static StatusOr<std::unique_ptr<NcclCommunicator>> Create(gloo::rendezvous::Store& store, int rank,
                                                            int size, int device_index);
  ~NcclCommunicator() override;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string backend() const override { return "nccl"; }
  Status AllReduceSum(at::Tensor& tensor) override;
  Status Broadcast(at::Tensor& tensor, int root) override;
  Status AllGather(const at::Tensor& input, at::Tensor& output) override;
  Status ReduceScatterSum(const at::Tensor& input, at::Tensor& output) override;
  Status Barrier() override;
  // NCCL matches point-to-point messages in posting order per pair of ranks, not by tag: the
  // pipeline runtime on NCCL must post sends and receives of a pair in the same order (not yet
  // verified on a GPU host). Send is stream-ordered and returns at once; WaitSends synchronizes.
  Status Send(const at::Tensor& tensor, int dst, uint32_t tag) override;
  Status Recv(at::Tensor& tensor, int src, uint32_t tag) override;
  Status WaitSends() override;

 private:
  NcclCommunicator(ncclComm_t comm, int rank, int size, int device)
      : comm_(comm), rank_(rank), size_(size), device_(device) {}

  ncclComm_t comm_;
  int rank_;
  int size_;
  int device_;
  std::vector<at::Tensor> pending_;  // sent tensors kept alive until WaitSends
};

}  // namespace ltrain::worker
