// Communicator: the collectives and point-to-point transfers the training loop needs, over the ranks
// of one process group (the world, or a tensor-, data-, pipeline- or embedding-parallel group).
//
// Contract across ranks: every rank of the group calls the same collectives, in the same order,
// with tensors of the same shape and dtype; a rank that skips one hangs the others until the
// backend's timeout. Calls are blocking (except Send) and a communicator is not thread-safe: one
// thread at a time uses it (the data-parallel group belongs to the gradient-reduction thread while
// a step runs, every other group to the training thread). Errors (peer died, timeout) come back as
// a Status, never as an exception. Ranks are group ranks (0 .. size()-1).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <ATen/core/Tensor.h>

#include "common/status.h"
#include "worker/plan/topology.h"

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
  // Mean over ranks, in place (floating-point tensors): the sum divided by size(); NCCL divides
  // inside the reduction, with no second pass over the tensor.
  virtual Status AllReduceMean(at::Tensor& tensor);
  // Copies root's tensor into every rank's tensor, in place.
  virtual Status Broadcast(at::Tensor& tensor, int root) = 0;
  // output (contiguous, size() * input.numel() elements, input's dtype) receives every rank's input
  // in rank order.
  virtual Status AllGather(const at::Tensor& input, at::Tensor& output) = 0;
  // Sums input (contiguous, size() * output.numel() elements) over ranks; output receives this rank's
  // chunk of the sum (chunk r = elements [r*n, (r+1)*n)).
  virtual Status ReduceScatterSum(const at::Tensor& input, at::Tensor& output) = 0;
  // The same, divided by size() (floating-point tensors); NCCL divides inside the reduction. output
  // may be this rank's chunk of input itself (in place).
  virtual Status ReduceScatterMean(const at::Tensor& input, at::Tensor& output);
  virtual Status Barrier() = 0;
  // Each rank sends send_counts[r] rows of `input` (its first dimension; the rows for rank 0 first,
  // then rank 1's, ...) to rank r, and receives recv_counts[r] rows from rank r into `output`
  // (contiguous, preallocated, the rows from rank 0 first). The counts are this rank's (host
  // integers, one a rank); recv_counts[r] here must equal send_counts[this rank] on rank r, and the
  // row width and dtype are the same on every rank. What an expert-parallel layer exchanges its
  // tokens with. NCCL queues it on the current stream and returns; the others return when it is done.
  virtual Status AllToAll(const at::Tensor& input, const std::vector<int64_t>& send_counts, at::Tensor& output,
                          const std::vector<int64_t>& recv_counts) = 0;

  // `bytes` of device memory that every rank of the group can write into directly, at the same
  // offsets on every rank: a collective call (every rank, at the same point, with the same size).
  // An all-gather whose input and output lie in it (the input at this rank's chunk of the output:
  // in place) then runs on the GPU's copy engines, without kernels beside the computation (NCCL
  // 2.28 or later, ranks on one node). The memory lives as long as the communicator; the tensor
  // (uint8, [bytes]) does not own it. FailedPrecondition where the backend has no such memory.
  virtual StatusOr<at::Tensor> AllocateSymmetric(int64_t bytes);

  // Point to point. Send does not block: the communicator keeps `tensor` alive and the transfer runs
  // in the background until WaitSends(). Recv blocks until `tensor` (contiguous, preallocated with
  // the sender's shape and dtype) holds the message with the same tag from `src`. Messages between
  // two ranks are matched by tag, not by order; a tag may be reused once WaitSends() returned.
  virtual Status Send(const at::Tensor& tensor, int dst, uint32_t tag) = 0;
  virtual Status Recv(at::Tensor& tensor, int src, uint32_t tag) = 0;
  virtual Status WaitSends() = 0;
  // Sends `send` to `dst` and receives `recv` (preallocated) from `src` at once: the shift of a ring,
  // where every rank sends to its successor and receives from its predecessor. Default: Send, Recv,
  // WaitSends. NCCL posts both in one group: its sends complete only once the peer has posted the
  // receive, so a ring of separate sends would wait on itself.
  virtual Status SendRecv(const at::Tensor& send, int dst, at::Tensor& recv, int src, uint32_t tag);

  // Closes this rank's connections of the group, after one of its calls failed: peers still blocked
  // in a collective with this rank fail at once instead of at their timeout. Called with no call in
  // flight; the communicator serves no further call (a recovery puts a new one in its place, see
  // ReformableCommunicator). Default: nothing to close.
  virtual void Abort() {}

  // Whether the operations enqueued so far can still complete: Unavailable, naming the failure, once
  // the communicator was aborted (a peer failed, or a new membership was announced). Where calls
  // return before their operation ran (NCCL), a caller that synchronized the device calls it before
  // it uses their results. Default: calls report their own failures, nothing is pending.
  virtual Status Health() { return Status::Ok(); }

  // How long a call may wait for its peers from now on (fault.collective_timeout_s, or its figure
  // derived from the steps' times). Called between steps, with no call in flight. Default: nothing to set.
  virtual void SetTimeout(std::chrono::milliseconds /*timeout*/) {}
};

// A communicator whose connections can be replaced under it: the model, the parameter store and the
// trainer keep pointers to their groups' communicators, and a recovery (worker/recovery) re-forms
// the groups of a new membership (same ranks, new processes among them) beneath those pointers.
// Ranks and sizes stay those of the first: a membership replaces processes, not ranks.
class ReformableCommunicator final : public Communicator {
 public:
  explicit ReformableCommunicator(std::unique_ptr<Communicator> inner) : inner_(std::move(inner)) {}

  // Puts `inner` in place of the current communicator, which is destroyed (after Abort, with no
  // call in flight). InvalidArgument where its rank or size differs.
  Status Replace(std::unique_ptr<Communicator> inner);
  // Hands the current communicator over (this one is empty afterwards): what Replace of another
  // ReformableCommunicator takes.
  std::unique_ptr<Communicator> Release() { return std::move(inner_); }

  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  std::string backend() const override { return inner_->backend(); }
  Status AllReduceSum(at::Tensor& tensor) override { return inner_->AllReduceSum(tensor); }
  Status AllReduceMean(at::Tensor& tensor) override { return inner_->AllReduceMean(tensor); }
  Status Broadcast(at::Tensor& tensor, int root) override { return inner_->Broadcast(tensor, root); }
  Status AllGather(const at::Tensor& input, at::Tensor& output) override { return inner_->AllGather(input, output); }
  Status ReduceScatterSum(const at::Tensor& input, at::Tensor& output) override {
    return inner_->ReduceScatterSum(input, output);
  }
  Status ReduceScatterMean(const at::Tensor& input, at::Tensor& output) override {
    return inner_->ReduceScatterMean(input, output);
  }
  Status Barrier() override { return inner_->Barrier(); }
  Status AllToAll(const at::Tensor& input, const std::vector<int64_t>& send_counts, at::Tensor& output,
                  const std::vector<int64_t>& recv_counts) override {
    return inner_->AllToAll(input, send_counts, output, recv_counts);
  }
  StatusOr<at::Tensor> AllocateSymmetric(int64_t bytes) override { return inner_->AllocateSymmetric(bytes); }
  Status Send(const at::Tensor& tensor, int dst, uint32_t tag) override { return inner_->Send(tensor, dst, tag); }
  Status Recv(at::Tensor& tensor, int src, uint32_t tag) override { return inner_->Recv(tensor, src, tag); }
  Status WaitSends() override { return inner_->WaitSends(); }
  Status SendRecv(const at::Tensor& send, int dst, at::Tensor& recv, int src, uint32_t tag) override {
    return inner_->SendRecv(send, dst, recv, src, tag);
  }
  void Abort() override { inner_->Abort(); }
  Status Health() override { return inner_->Health(); }
  void SetTimeout(std::chrono::milliseconds timeout) override { inner_->SetTimeout(timeout); }

 private:
  std::unique_ptr<Communicator> inner_;
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
  Status ReduceScatterSum(const at::Tensor& input, at::Tensor& output) override;
  Status Barrier() override { return Status::Ok(); }
  Status AllToAll(const at::Tensor& input, const std::vector<int64_t>& send_counts, at::Tensor& output,
                  const std::vector<int64_t>& recv_counts) override;
  Status Send(const at::Tensor& tensor, int dst, uint32_t tag) override;
  Status Recv(at::Tensor& tensor, int src, uint32_t tag) override;
  Status WaitSends() override { return Status::Ok(); }
};

// Communicator for tests. By default a group of one that behaves like SelfCommunicator; with
// SimulateSize(n) it acts as rank 0 of n ranks that all hold identical tensors (all-reduce
// multiplies by n, all-gather repeats the input, reduce-scatter sums n copies of the first chunk).
// It counts calls, records each collective's op, element count and start time (for overlap tests),
// and fails the collective numbered `fail_at` (0-based, over all calls) with `failure`, as a dead
// peer would. Safe to call from one thread at a time, any thread.
class FakeCommunicator : public Communicator {
 public:
  struct Call {
    std::string op;
    int64_t numel = 0;
    std::chrono::steady_clock::time_point start;
    std::thread::id thread;  // that made the call
  };

  int rank() const override { return 0; }
  int size() const override { return size_; }
  std::string backend() const override { return "fake"; }
  Status AllReduceSum(at::Tensor& tensor) override;
  Status Broadcast(at::Tensor& tensor, int root) override;
  Status AllGather(const at::Tensor& input, at::Tensor& output) override;
  Status ReduceScatterSum(const at::Tensor& input, at::Tensor& output) override;
  Status Barrier() override;
  // Every rank holding the same tensor and counts: rank 0 receives the rows each rank sends to rank
  // 0, so recv_counts[r] must equal send_counts[0] and every chunk is input's first.
  Status AllToAll(const at::Tensor& input, const std::vector<int64_t>& send_counts, at::Tensor& output,
                  const std::vector<int64_t>& recv_counts) override;
  Status Send(const at::Tensor& tensor, int dst, uint32_t tag) override;
  Status Recv(at::Tensor& tensor, int src, uint32_t tag) override;
  Status WaitSends() override { return Status::Ok(); }

  void SimulateSize(int n) { size_ = n; }
  void FailAt(int call, Status failure) {
    fail_at_ = call;
    failure_ = std::move(failure);
  }
  int calls() const { return static_cast<int>(log_.size()); }
  const std::vector<Call>& log() const { return log_; }

 private:
  Status Next(const char* op, int64_t numel);

  int size_ = 1;
  int fail_at_ = -1;
  Status failure_;
  std::vector<Call> log_;
};

// What every backend's AllToAll checks first: one count a rank, none negative, the counts summing to
// input's and output's rows, one dtype, one row width, a contiguous output. OK, or InvalidArgument
// naming what differs.
Status CheckAllToAll(const at::Tensor& input, const std::vector<int64_t>& send_counts, const at::Tensor& output,
                     const std::vector<int64_t>& recv_counts, int size);
// The elements of one AllToAll row: of the input's rows, or of the output's where this rank sends none.
int64_t AllToAllRowWidth(const at::Tensor& input, const at::Tensor& output);

// The communicators of one rank: one per group it belongs to. Never null: a group of one is a
// SelfCommunicator, and `embedding` is a SelfCommunicator on ranks of no embedding group.
struct ProcessGroups {
  Layout layout;
  RankCoords coords;
  int rank = 0;
  Communicator* world = nullptr;
  Communicator* tp = nullptr;
  Communicator* dp = nullptr;
  Communicator* pp = nullptr;
  Communicator* embedding = nullptr;
  bool in_embedding_group = false;
  // Expert parallelism (layout.ep): the ranks that split a block's experts (a SelfCommunicator at ep
  // 1), and those holding the same experts (dp itself at ep 1).
  Communicator* ep = nullptr;
  Communicator* edp = nullptr;
  // Context parallelism (layout.cp): the ranks that split each sequence (a SelfCommunicator at cp 1).
  Communicator* cp = nullptr;
  std::vector<std::unique_ptr<Communicator>> owned;
};

// Every rank in the data-parallel group: what a plain data-parallel job (and the tests' fakes) use.
// `world` must outlive the result.
ProcessGroups DataParallelGroups(Communicator* world);

// Makes the communicator of one group: `group.ranks` are global ranks, `group_rank` this rank's
// position in them. Called for every group this rank belongs to, in the same order on every rank
// (kind by kind: tp, dp, pp, embedding, ep, edp, cp), so connecting never waits on a group a peer has not
// reached.
using GroupFactory = std::function<StatusOr<std::unique_ptr<Communicator>>(const Group& group, int group_rank)>;

// Builds this rank's groups (groups of one become SelfCommunicators without calling `make`).
// `world` must outlive the result.
StatusOr<ProcessGroups> BuildProcessGroups(const Layout& layout, int rank, Communicator* world,
                                           const GroupFactory& make);

}  // namespace ltrain::worker
