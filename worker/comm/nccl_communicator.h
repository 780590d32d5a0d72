// NcclCommunicator: the GPU backend (compiled only when LibTorch has CUDA: LTRAIN_WITH_NCCL).
//
// Created on the worker's main thread once per generation: rank 0 makes the ncclUniqueId and
// publishes it through the job's rendezvous store; every rank then joins with ncclCommInitRank.
// Collectives are enqueued on the current CUDA stream of the tensor's device and return without
// waiting (stream order keeps the training loop correct); errors of the NCCL calls come back as
// Status. Every rank calls collectives in the same order.
//
// Watchdog: every enqueued operation records a CUDA event; a watchdog thread of the communicator
// polls them (and ncclCommGetAsyncError). When one has not completed within the collective timeout
// (fault.collective_timeout_s), or NCCL reports an asynchronous error, it prints which operation
// waited how long, calls ncclCommAbort (which unblocks the stream) and exits the process with code 1:
// a peer that vanished makes the rank fail with a clear error instead of hanging forever.
//
// Recoverable (fault.recovery in_place): a failure does not end the process. The communicator is
// then made non-blocking (every NCCL call returns at once, so that Abort from another thread, the
// recovery's membership watch, never waits behind a call stuck on a dead peer); on a timeout or an
// asynchronous error the watchdog aborts it instead of exiting, the aborted operations end, and every
// later call, Health() included, returns Unavailable naming the failure: the trainer re-forms its
// groups (worker/recovery) instead of using what the aborted step computed.
//
// Every operation is also reported to Progress::Global() with the group's name, as Gloo's are: it
// begins when enqueued and ends when the watchdog sees its event complete (within ~100 ms), so a
// hang report on GPUs names the stuck rank and the collective the others wait in.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <cuda_runtime.h>

#include <gloo/rendezvous/store.h>
#include <nccl.h>

#include "worker/comm/communicator.h"

namespace ltrain::worker {

class NcclCommunicator : public Communicator {
 public:
  static StatusOr<std::unique_ptr<NcclCommunicator>> Create(gloo::rendezvous::Store& store, int rank,
                                                            int size, int device_index,
                                                            std::chrono::milliseconds timeout,
                                                            std::string group = "world",
                                                            bool recoverable = false);
  ~NcclCommunicator() override;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string backend() const override { return "nccl"; }
  Status AllReduceSum(at::Tensor& tensor) override;
  Status AllReduceMean(at::Tensor& tensor) override;
  Status ReduceScatterMean(const at::Tensor& input, at::Tensor& output) override;
  Status Broadcast(at::Tensor& tensor, int root) override;
  Status AllGather(const at::Tensor& input, at::Tensor& output) override;
  Status ReduceScatterSum(const at::Tensor& input, at::Tensor& output) override;
  Status Barrier() override;
  Status AllToAll(const at::Tensor& input, const std::vector<int64_t>& send_counts, at::Tensor& output,
                  const std::vector<int64_t>& recv_counts) override;
  // ncclMemAlloc'd and registered as a symmetric window (NCCL_WIN_COLL_SYMMETRIC); the communicator
  // is made with the zero-CTA policy, so that all-gathers within such windows use the copy engines.
  StatusOr<at::Tensor> AllocateSymmetric(int64_t bytes) override;
  // NCCL matches point-to-point messages in posting order per pair of ranks, not by tag: the
  // pipeline runtime on NCCL must post sends and receives of a pair in the same order (not yet
  // verified on a GPU host). Send is stream-ordered and returns at once; WaitSends synchronizes.
  Status Send(const at::Tensor& tensor, int dst, uint32_t tag) override;
  Status Recv(at::Tensor& tensor, int src, uint32_t tag) override;
  Status WaitSends() override;
  // One NCCL group of the send and the receive.
  Status SendRecv(const at::Tensor& send, int dst, at::Tensor& recv, int src, uint32_t tag) override;
  // ncclCommAbort: the operations in flight end (unfinished), later calls fail. Any thread, any
  // time; a second call does nothing.
  void Abort() override;
  Status Health() override;
  void SetTimeout(std::chrono::milliseconds timeout) override { timeout_ms_ = timeout.count(); }

 private:
  struct InFlight {
    std::string op;
    uint64_t seq = 0;
    uint64_t progress_seq = 0;  // Progress::Global()'s number for it
    cudaEvent_t done = nullptr;
    std::chrono::steady_clock::time_point start;
  };

  NcclCommunicator(ncclComm_t comm, int rank, int size, int device, std::chrono::milliseconds timeout,
                   std::string group, bool recoverable)
      : comm_(comm),
        timeout_ms_(timeout.count()),
        rank_(rank),
        size_(size),
        device_(device),
        group_(std::move(group)),
        recoverable_(recoverable) {}
  // Makes one NCCL call on comm_ (`call` returns its result) under call_mu_, and on a non-blocking
  // communicator waits until NCCL has taken it; Unavailable once the communicator was aborted.
  template <typename Call>
  Status Enqueue(const char* what, Call&& call);
  // Aborts comm_ (under call_mu_), keeping `why` as what later calls report.
  void AbortWith(const std::string& why);
  // In-place all-reduce with `op` on the current stream.
  Status AllReduce(at::Tensor& tensor, ncclRedOp_t op);
  Status ReduceScatter(const at::Tensor& input, at::Tensor& output, ncclRedOp_t op);
  // After an operation of `bytes` was enqueued on `stream`: hands it to the watchdog.
  Status Track(const char* op, cudaStream_t stream, int64_t bytes);
  void Watch();

  // Guards comm_ (null once aborted) and failure_; held by each NCCL call, never across a wait on
  // the device. abort_requested_ makes a call waiting for a non-blocking communicator give way.
  std::mutex call_mu_;
  ncclComm_t comm_;
  std::string failure_;
  std::atomic<bool> abort_requested_{false};
  std::atomic<int64_t> timeout_ms_;  // SetTimeout's, read by the calls and the watchdog
  std::chrono::milliseconds timeout() const { return std::chrono::milliseconds(timeout_ms_.load()); }
  std::mutex mu_;
  std::deque<InFlight> in_flight_;
  uint64_t next_seq_ = 1;
  bool stop_ = false;
  std::thread watchdog_;
  int rank_;
  int size_;
  int device_;
  std::string group_;
  bool recoverable_;
  std::vector<at::Tensor> pending_;  // sent tensors kept alive until WaitSends
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 28, 0)
  std::vector<std::pair<void*, ncclWindow_t>> windows_;  // AllocateSymmetric's, freed with the communicator
#endif
};

}  // namespace ltrain::worker
