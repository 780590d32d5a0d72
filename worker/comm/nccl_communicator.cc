#include "worker/comm/nccl_communicator.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <thread>
#include <vector>

#include <unistd.h>

#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include "worker/control/progress.h"

namespace ltrain::worker {
namespace {

constexpr const char* kUniqueIdKey = "nccl_unique_id";

Status Check(ncclResult_t result, const char* what) {
  if (result == ncclSuccess) return Status::Ok();
  return Unavailable(std::string("nccl ") + what + " failed: " + ncclGetErrorString(result));
}

StatusOr<ncclDataType_t> NcclType(at::ScalarType type) {
  switch (type) {
    case at::kFloat: return ncclFloat32;
    case at::kDouble: return ncclFloat64;
    case at::kHalf: return ncclFloat16;
    case at::kBFloat16: return ncclBfloat16;
    case at::kLong: return ncclInt64;
    case at::kInt: return ncclInt32;
    case at::kByte: return ncclUint8;
    default: return InvalidArgument(std::string("nccl: unsupported dtype ") + c10::toString(type));
  }
}

// A non-blocking communicator's call returns ncclInProgress until NCCL has taken it: polls its state
// until then, or until `give_up` is set (an abort was asked) or `deadline` passed.
Status Settle(ncclComm_t comm, ncclResult_t result, const char* what, std::chrono::steady_clock::time_point deadline,
              const std::atomic<bool>* give_up) {
  while (result == ncclInProgress) {
    if (give_up != nullptr && give_up->load()) return Unavailable(std::string("nccl ") + what + ": the communicator is being aborted");
    if (std::chrono::steady_clock::now() > deadline) {
      return Unavailable(std::string("nccl ") + what + " did not complete within the collective timeout");
    }
    std::this_thread::sleep_for(std::chrono::microseconds(50));
    if (ncclCommGetAsyncError(comm, &result) != ncclSuccess) break;
  }
  return Check(result, what);
}

Status CheckTensor(const at::Tensor& t) {
  if (!t.is_cuda()) return InvalidArgument("nccl collectives need CUDA tensors");
  if (!t.is_contiguous()) return InvalidArgument("nccl collectives need contiguous tensors");
  return Status::Ok();
}

}  // namespace

StatusOr<std::unique_ptr<NcclCommunicator>> NcclCommunicator::Create(gloo::rendezvous::Store& store, int rank,
                                                                      int size, int device_index,
                                                                      std::chrono::milliseconds timeout,
                                                                      std::string group, bool recoverable) {
  if (cudaSetDevice(device_index) != cudaSuccess) {
    return Unavailable("cudaSetDevice(" + std::to_string(device_index) + ") failed");
  }
  ncclUniqueId id;
  try {
    if (rank == 0) {
      LTRAIN_RETURN_IF_ERROR(Check(ncclGetUniqueId(&id), "GetUniqueId"));
      const char* bytes = reinterpret_cast<const char*>(&id);
      store.set(kUniqueIdKey, std::vector<char>(bytes, bytes + sizeof(id)));
    } else {
      store.wait({kUniqueIdKey});
      std::vector<char> bytes = store.get(kUniqueIdKey);
      if (bytes.size() != sizeof(id)) return DataLoss("nccl unique id in the rendezvous store has the wrong size");
      std::memcpy(&id, bytes.data(), sizeof(id));
    }
  } catch (const std::exception& e) {
    return Unavailable(std::string("nccl: exchanging the unique id through the rendezvous store: ") + e.what());
  }
  ncclComm_t comm = nullptr;
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 28, 0)
  // Zero CTAs where NCCL can: all-gathers within symmetric windows (AllocateSymmetric) run on the
  // copy engines. Other collectives are as under the default policy.
  config.CTAPolicy = NCCL_CTA_POLICY_ZERO;
#endif
  if (recoverable) config.blocking = 0;
  const ncclResult_t init = ncclCommInitRankConfig(&comm, size, id, rank, &config);
  if (Status s = Settle(comm, init, "CommInitRankConfig", std::chrono::steady_clock::now() + timeout, nullptr); !s.ok()) {
    if (comm != nullptr) ncclCommAbort(comm);
    return s;
  }
  std::unique_ptr<NcclCommunicator> result(
      new NcclCommunicator(comm, rank, size, device_index, timeout, std::move(group), recoverable));
  NcclCommunicator* self = result.get();
  result->watchdog_ = std::thread([self] { self->Watch(); });
  return result;
}

NcclCommunicator::~NcclCommunicator() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  if (watchdog_.joinable()) watchdog_.join();
  for (InFlight& op : in_flight_) {
    cudaEventDestroy(op.done);
    Progress::Global().EndCollective(op.progress_seq);
  }
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 28, 0)
  for (auto& [ptr, window] : windows_) {
    if (comm_ != nullptr && window != nullptr) ncclCommWindowDeregister(comm_, window);
    ncclMemFree(ptr);
  }
#endif
  // A recoverable communicator may have lost a peer: destroying it could wait for that peer.
  if (comm_ != nullptr && recoverable_) {
    ncclCommAbort(comm_);
  } else if (comm_ != nullptr) {
    ncclCommDestroy(comm_);
  }
}

template <typename Call>
Status NcclCommunicator::Enqueue(const char* what, Call&& call) {
  std::lock_guard<std::mutex> lock(call_mu_);
  if (comm_ == nullptr) return Unavailable(failure_);
  const ncclResult_t result = call(comm_);
  if (!recoverable_) return Check(result, what);
  return Settle(comm_, result, what, std::chrono::steady_clock::now() + timeout(), &abort_requested_);
}

void NcclCommunicator::AbortWith(const std::string& why) {
  abort_requested_ = true;
  std::lock_guard<std::mutex> lock(call_mu_);
  if (comm_ == nullptr) return;
  failure_ = "nccl group " + group_ + " was aborted: " + why;
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 28, 0)
  // The windows go with the communicator; their memory is freed with this object.
  for (auto& entry : windows_) entry.second = nullptr;
#endif
  ncclCommAbort(comm_);
  comm_ = nullptr;
}

void NcclCommunicator::Abort() { AbortWith("a peer failed or a new membership was announced"); }

Status NcclCommunicator::Health() {
  std::lock_guard<std::mutex> lock(call_mu_);
  if (comm_ == nullptr) return Unavailable(failure_);
  ncclResult_t async_error = ncclSuccess;
  if (ncclCommGetAsyncError(comm_, &async_error) == ncclSuccess && async_error != ncclSuccess &&
      async_error != ncclInProgress) {
    return Unavailable(std::string("nccl group ") + group_ + " reported an asynchronous error: " +
                       ncclGetErrorString(async_error));
  }
  return Status::Ok();
}

StatusOr<at::Tensor> NcclCommunicator::AllocateSymmetric(int64_t bytes) {
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 28, 0)
  if (bytes <= 0) return InvalidArgument("AllocateSymmetric needs a positive size");
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_));
  void* ptr = nullptr;
  LTRAIN_RETURN_IF_ERROR(Check(ncclMemAlloc(&ptr, static_cast<size_t>(bytes)), "MemAlloc"));
  ncclWindow_t window = nullptr;
  if (Status s = Enqueue("CommWindowRegister",
                         [&](ncclComm_t comm) {
                           return ncclCommWindowRegister(comm, ptr, static_cast<size_t>(bytes), &window,
                                                         NCCL_WIN_COLL_SYMMETRIC);
                         });
      !s.ok()) {
    ncclMemFree(ptr);
    return s;
  }
  windows_.emplace_back(ptr, window);
  return at::from_blob(ptr, {bytes}, at::TensorOptions().dtype(at::kByte).device(at::kCUDA, device_));
#else
  return Communicator::AllocateSymmetric(bytes);
#endif
}

Status NcclCommunicator::Track(const char* op, cudaStream_t stream, int64_t bytes) {
  cudaEvent_t done = nullptr;
  if (cudaEventCreateWithFlags(&done, cudaEventDisableTiming) != cudaSuccess) {
    return Unavailable(std::string("nccl ") + op + ": cudaEventCreate failed");
  }
  if (cudaEventRecord(done, stream) != cudaSuccess) {
    cudaEventDestroy(done);
    return Unavailable(std::string("nccl ") + op + ": cudaEventRecord failed");
  }
  std::lock_guard<std::mutex> lock(mu_);
  const uint64_t progress_seq = Progress::Global().BeginCollective(op, group_, bytes);
  in_flight_.push_back(InFlight{op, next_seq_++, progress_seq, done, std::chrono::steady_clock::now()});
  return Status::Ok();
}

void NcclCommunicator::Watch() {
  cudaSetDevice(device_);
  while (true) {
    std::string failure;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stop_) return;
      while (!in_flight_.empty() && cudaEventQuery(in_flight_.front().done) == cudaSuccess) {
        cudaEventDestroy(in_flight_.front().done);
        Progress::Global().EndCollective(in_flight_.front().progress_seq);
        in_flight_.pop_front();
      }
      const auto now = std::chrono::steady_clock::now();
      if (abort_requested_) {
        // Aborted: the ended operations' events complete and leave the queue; nothing more to judge.
      } else if (!in_flight_.empty() && now - in_flight_.front().start > timeout()) {
        const InFlight& op = in_flight_.front();
        failure = "nccl " + op.op + " #" + std::to_string(op.seq) + " of " + group_ + " (a group of " + std::to_string(size_) +
                  " ranks, this rank " + std::to_string(rank_) + ") did not finish within " +
                  std::to_string(timeout().count() / 1000) +
                  " s (fault.collective_timeout_s); a peer rank may have died or hung";
      }
      if (failure.empty() && !abort_requested_) {
        // A blocking communicator's comm_ never changes while the watchdog runs; a recoverable one's
        // is read under call_mu_, which its calls never hold for long.
        std::unique_lock<std::mutex> call_lock(call_mu_, std::defer_lock);
        if (recoverable_) call_lock.lock();
        ncclResult_t async_error = ncclSuccess;
        if (comm_ != nullptr && ncclCommGetAsyncError(comm_, &async_error) == ncclSuccess &&
            async_error != ncclSuccess && async_error != ncclInProgress) {
          failure = std::string("nccl reported an asynchronous error: ") + ncclGetErrorString(async_error);
        }
      }
    }
    if (!failure.empty() && recoverable_) {
      std::fprintf(stderr, "ltrain-worker: rank %d: error: %s; aborting the communicator, the rank waits for the next membership\n",
                   rank_, failure.c_str());
      std::fflush(stderr);
      AbortWith(failure);
    } else if (!failure.empty()) {
      std::fprintf(stderr, "ltrain-worker: rank %d: error: %s; aborting the communicator\n", rank_, failure.c_str());
      std::fflush(stderr);
      std::fflush(stdout);
      ncclCommAbort(comm_);
      // The training thread may be blocked inside CUDA or NCCL for good: leave now, with a failure.
      ::_exit(1);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
}

Status NcclCommunicator::AllReduce(at::Tensor& tensor, ncclRedOp_t op) {
  LTRAIN_RETURN_IF_ERROR(CheckTensor(tensor));
  LTRAIN_ASSIGN_OR_RETURN(ncclDataType_t type, NcclType(tensor.scalar_type()));
  c10::cuda::CUDAGuard guard(tensor.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(tensor.device().index()).stream();
  LTRAIN_RETURN_IF_ERROR(Enqueue("AllReduce", [&](ncclComm_t comm) {
    return ncclAllReduce(tensor.data_ptr(), tensor.data_ptr(), static_cast<size_t>(tensor.numel()), type, op, comm, stream);
  }));
  return Track("all_reduce", stream, tensor.nbytes());
}

Status NcclCommunicator::AllReduceSum(at::Tensor& tensor) { return AllReduce(tensor, ncclSum); }

Status NcclCommunicator::AllReduceMean(at::Tensor& tensor) {
  if (!at::isFloatingType(tensor.scalar_type())) return Communicator::AllReduceMean(tensor);
  return AllReduce(tensor, ncclAvg);
}

Status NcclCommunicator::Broadcast(at::Tensor& tensor, int root) {
  LTRAIN_RETURN_IF_ERROR(CheckTensor(tensor));
  LTRAIN_ASSIGN_OR_RETURN(ncclDataType_t type, NcclType(tensor.scalar_type()));
  c10::cuda::CUDAGuard guard(tensor.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(tensor.device().index()).stream();
  LTRAIN_RETURN_IF_ERROR(Enqueue("Broadcast", [&](ncclComm_t comm) {
    return ncclBroadcast(tensor.data_ptr(), tensor.data_ptr(), static_cast<size_t>(tensor.numel()), type, root, comm, stream);
  }));
  return Track("broadcast", stream, tensor.nbytes());
}

Status NcclCommunicator::AllGather(const at::Tensor& input, at::Tensor& output) {
  LTRAIN_RETURN_IF_ERROR(CheckTensor(input));
  LTRAIN_RETURN_IF_ERROR(CheckTensor(output));
  if (output.numel() != input.numel() * size_ || output.scalar_type() != input.scalar_type()) {
    return InvalidArgument("AllGather output must hold size() * input.numel() elements of the input's dtype");
  }
  LTRAIN_ASSIGN_OR_RETURN(ncclDataType_t type, NcclType(input.scalar_type()));
  c10::cuda::CUDAGuard guard(input.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(input.device().index()).stream();
  LTRAIN_RETURN_IF_ERROR(Enqueue("AllGather", [&](ncclComm_t comm) {
    return ncclAllGather(input.data_ptr(), output.data_ptr(), static_cast<size_t>(input.numel()), type, comm, stream);
  }));
  return Track("all_gather", stream, output.nbytes());
}

Status NcclCommunicator::AllToAll(const at::Tensor& input, const std::vector<int64_t>& send_counts,
                                  at::Tensor& output, const std::vector<int64_t>& recv_counts) {
  LTRAIN_RETURN_IF_ERROR(CheckAllToAll(input, send_counts, output, recv_counts, size_));
  if (input.numel() > 0) LTRAIN_RETURN_IF_ERROR(CheckTensor(input));
  if (output.numel() > 0) LTRAIN_RETURN_IF_ERROR(CheckTensor(output));
  if (input.numel() == 0 && output.numel() == 0) return Status::Ok();
  LTRAIN_ASSIGN_OR_RETURN(ncclDataType_t type, NcclType(input.scalar_type()));
  const at::Tensor& on = input.numel() > 0 ? input : output;
  const int64_t width = AllToAllRowWidth(input, output);
  c10::cuda::CUDAGuard guard(on.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(on.device().index()).stream();
  // One group of a send and a receive for every rank with rows to move (this one included).
  LTRAIN_RETURN_IF_ERROR(Enqueue("AllToAll", [&](ncclComm_t comm) {
    ncclResult_t result = ncclGroupStart();
    if (result != ncclSuccess) return result;
    ncclResult_t first_failure = ncclSuccess;
    auto note = [&](ncclResult_t r) {
      if (first_failure == ncclSuccess && r != ncclSuccess) first_failure = r;
    };
    int64_t sent = 0, received = 0;
    for (int r = 0; r < size_; ++r) {
      if (send_counts[r] > 0) {
        note(ncclSend(static_cast<const char*>(input.data_ptr()) + sent * width * input.element_size(),
                      static_cast<size_t>(send_counts[r] * width), type, r, comm, stream));
      }
      if (recv_counts[r] > 0) {
        note(ncclRecv(static_cast<char*>(output.data_ptr()) + received * width * output.element_size(),
                      static_cast<size_t>(recv_counts[r] * width), type, r, comm, stream));
      }
      sent += send_counts[r];
      received += recv_counts[r];
    }
    result = ncclGroupEnd();
    return first_failure != ncclSuccess ? first_failure : result;
  }));
  return Track("all_to_all", stream, input.nbytes() + output.nbytes());
}

Status NcclCommunicator::ReduceScatter(const at::Tensor& input, at::Tensor& output, ncclRedOp_t op) {
  LTRAIN_RETURN_IF_ERROR(CheckTensor(input));
  LTRAIN_RETURN_IF_ERROR(CheckTensor(output));
  if (input.numel() != output.numel() * size_ || output.scalar_type() != input.scalar_type()) {
    return InvalidArgument("ReduceScatter input must hold size() * output.numel() elements of the output's dtype");
  }
  LTRAIN_ASSIGN_OR_RETURN(ncclDataType_t type, NcclType(input.scalar_type()));
  c10::cuda::CUDAGuard guard(input.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(input.device().index()).stream();
  LTRAIN_RETURN_IF_ERROR(Enqueue("ReduceScatter", [&](ncclComm_t comm) {
    return ncclReduceScatter(input.data_ptr(), output.data_ptr(), static_cast<size_t>(output.numel()), type, op, comm,
                             stream);
  }));
  return Track("reduce_scatter", stream, input.nbytes());
}

Status NcclCommunicator::ReduceScatterSum(const at::Tensor& input, at::Tensor& output) {
  return ReduceScatter(input, output, ncclSum);
}

Status NcclCommunicator::ReduceScatterMean(const at::Tensor& input, at::Tensor& output) {
  if (!at::isFloatingType(input.scalar_type())) return Communicator::ReduceScatterMean(input, output);
  return ReduceScatter(input, output, ncclAvg);
}

Status NcclCommunicator::Send(const at::Tensor& tensor, int dst, uint32_t /*tag*/) {
  LTRAIN_RETURN_IF_ERROR(CheckTensor(tensor));
  LTRAIN_ASSIGN_OR_RETURN(ncclDataType_t type, NcclType(tensor.scalar_type()));
  c10::cuda::CUDAGuard guard(tensor.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(tensor.device().index()).stream();
  pending_.push_back(tensor);
  LTRAIN_RETURN_IF_ERROR(Enqueue("Send", [&](ncclComm_t comm) {
    return ncclSend(tensor.data_ptr(), static_cast<size_t>(tensor.numel()), type, dst, comm, stream);
  }));
  return Track("send", stream, tensor.nbytes());
}

Status NcclCommunicator::Recv(at::Tensor& tensor, int src, uint32_t /*tag*/) {
  LTRAIN_RETURN_IF_ERROR(CheckTensor(tensor));
  LTRAIN_ASSIGN_OR_RETURN(ncclDataType_t type, NcclType(tensor.scalar_type()));
  c10::cuda::CUDAGuard guard(tensor.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(tensor.device().index()).stream();
  LTRAIN_RETURN_IF_ERROR(Enqueue("Recv", [&](ncclComm_t comm) {
    return ncclRecv(tensor.data_ptr(), static_cast<size_t>(tensor.numel()), type, src, comm, stream);
  }));
  return Track("recv", stream, tensor.nbytes());
}

Status NcclCommunicator::SendRecv(const at::Tensor& send, int dst, at::Tensor& recv, int src, uint32_t /*tag*/) {
  LTRAIN_RETURN_IF_ERROR(CheckTensor(send));
  LTRAIN_RETURN_IF_ERROR(CheckTensor(recv));
  LTRAIN_ASSIGN_OR_RETURN(ncclDataType_t send_type, NcclType(send.scalar_type()));
  LTRAIN_ASSIGN_OR_RETURN(ncclDataType_t recv_type, NcclType(recv.scalar_type()));
  c10::cuda::CUDAGuard guard(send.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(send.device().index()).stream();
  LTRAIN_RETURN_IF_ERROR(Enqueue("SendRecv", [&](ncclComm_t comm) {
    ncclResult_t result = ncclGroupStart();
    if (result != ncclSuccess) return result;
    ncclResult_t sent = ncclSend(send.data_ptr(), static_cast<size_t>(send.numel()), send_type, dst, comm, stream);
    ncclResult_t got = ncclRecv(recv.data_ptr(), static_cast<size_t>(recv.numel()), recv_type, src, comm, stream);
    result = ncclGroupEnd();
    if (sent != ncclSuccess) return sent;
    if (got != ncclSuccess) return got;
    return result;
  }));
  LTRAIN_RETURN_IF_ERROR(Track("send_recv", stream, send.nbytes() + recv.nbytes()));
  // The caller may reuse `send` at once, as with the other backends.
  c10::cuda::getCurrentCUDAStream(device_).synchronize();
  return Health();
}

Status NcclCommunicator::WaitSends() {
  if (!pending_.empty()) c10::cuda::getCurrentCUDAStream(device_).synchronize();
  pending_.clear();
  return Status::Ok();
}

Status NcclCommunicator::Barrier() {
  // NCCL has no barrier: all-reduce one element and wait for it.
  at::Tensor one = at::ones({1}, at::TensorOptions().dtype(at::kFloat).device(at::kCUDA, device_));
  LTRAIN_RETURN_IF_ERROR(AllReduceSum(one));
  c10::cuda::getCurrentCUDAStream(device_).synchronize();
  return Status::Ok();
}

}  // namespace ltrain::worker
