#include "worker/comm/nccl_communicator.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
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

Status CheckTensor(const at::Tensor& t) {
  if (!t.is_cuda()) return InvalidArgument("nccl collectives need CUDA tensors");
  if (!t.is_contiguous()) return InvalidArgument("nccl collectives need contiguous tensors");
  return Status::Ok();
}

}  // namespace

StatusOr<std::unique_ptr<NcclCommunicator>> NcclCommunicator::Create(gloo::rendezvous::Store& store, int rank,
                                                                      int size, int device_index,
                                                                      std::chrono::milliseconds timeout,
                                                                      std::string group) {
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
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 28, 0)
  // Zero CTAs where NCCL can: all-gathers within symmetric windows (AllocateSymmetric) run on the
  // copy engines. Other collectives are as under the default policy.
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.CTAPolicy = NCCL_CTA_POLICY_ZERO;
  LTRAIN_RETURN_IF_ERROR(Check(ncclCommInitRankConfig(&comm, size, id, rank, &config), "CommInitRankConfig"));
#else
  LTRAIN_RETURN_IF_ERROR(Check(ncclCommInitRank(&comm, size, id, rank), "CommInitRank"));
#endif
  std::unique_ptr<NcclCommunicator> result(new NcclCommunicator(comm, rank, size, device_index, timeout, std::move(group)));
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
    if (comm_ != nullptr) ncclCommWindowDeregister(comm_, window);
    ncclMemFree(ptr);
  }
#endif
  if (comm_ != nullptr) ncclCommDestroy(comm_);
}

StatusOr<at::Tensor> NcclCommunicator::AllocateSymmetric(int64_t bytes) {
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 28, 0)
  if (bytes <= 0) return InvalidArgument("AllocateSymmetric needs a positive size");
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_));
  void* ptr = nullptr;
  LTRAIN_RETURN_IF_ERROR(Check(ncclMemAlloc(&ptr, static_cast<size_t>(bytes)), "MemAlloc"));
  ncclWindow_t window = nullptr;
  if (Status s = Check(ncclCommWindowRegister(comm_, ptr, static_cast<size_t>(bytes), &window, NCCL_WIN_COLL_SYMMETRIC),
                       "CommWindowRegister");
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
      if (!in_flight_.empty() && now - in_flight_.front().start > timeout_) {
        const InFlight& op = in_flight_.front();
        failure = "nccl " + op.op + " #" + std::to_string(op.seq) + " of " + group_ + " (a group of " + std::to_string(size_) +
                  " ranks, this rank " + std::to_string(rank_) + ") did not finish within " +
                  std::to_string(timeout_.count() / 1000) +
                  " s (fault.collective_timeout_s); a peer rank may have died or hung";
      }
      ncclResult_t async_error = ncclSuccess;
      if (failure.empty() && ncclCommGetAsyncError(comm_, &async_error) == ncclSuccess && async_error != ncclSuccess) {
        failure = std::string("nccl reported an asynchronous error: ") + ncclGetErrorString(async_error);
      }
    }
    if (!failure.empty()) {
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
  LTRAIN_RETURN_IF_ERROR(Check(ncclAllReduce(tensor.data_ptr(), tensor.data_ptr(), static_cast<size_t>(tensor.numel()), type,
                             op, comm_, stream), "AllReduce"));
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
  LTRAIN_RETURN_IF_ERROR(Check(ncclBroadcast(tensor.data_ptr(), tensor.data_ptr(), static_cast<size_t>(tensor.numel()), type,
                             root, comm_, stream), "Broadcast"));
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
  LTRAIN_RETURN_IF_ERROR(Check(ncclAllGather(input.data_ptr(), output.data_ptr(), static_cast<size_t>(input.numel()), type,
                             comm_, stream), "AllGather"));
  return Track("all_gather", stream, output.nbytes());
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
  LTRAIN_RETURN_IF_ERROR(Check(ncclReduceScatter(input.data_ptr(), output.data_ptr(), static_cast<size_t>(output.numel()), type,
                                 op, comm_, stream), "ReduceScatter"));
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
  LTRAIN_RETURN_IF_ERROR(Check(ncclSend(tensor.data_ptr(), static_cast<size_t>(tensor.numel()), type, dst, comm_, stream), "Send"));
  return Track("send", stream, tensor.nbytes());
}

Status NcclCommunicator::Recv(at::Tensor& tensor, int src, uint32_t /*tag*/) {
  LTRAIN_RETURN_IF_ERROR(CheckTensor(tensor));
  LTRAIN_ASSIGN_OR_RETURN(ncclDataType_t type, NcclType(tensor.scalar_type()));
  c10::cuda::CUDAGuard guard(tensor.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(tensor.device().index()).stream();
  LTRAIN_RETURN_IF_ERROR(Check(ncclRecv(tensor.data_ptr(), static_cast<size_t>(tensor.numel()), type, src, comm_, stream), "Recv"));
  return Track("recv", stream, tensor.nbytes());
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
