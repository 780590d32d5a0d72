#include "worker/nccl_communicator.h"

#include <cstring>
#include <exception>
#include <vector>

#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

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
                                                                      int size, int device_index) {
  if (cudaSetDevice(device_index) != cudaSuccess) {
    return Unavailable("cudaSetDevice(" + std::to_string(device_index) + ") failed");
  }
  ncclUniqueId id;
  try {
    if (rank == 0) {
      if (Status s = Check(ncclGetUniqueId(&id), "GetUniqueId"); !s.ok()) return s;
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
  if (Status s = Check(ncclCommInitRank(&comm, size, id, rank), "CommInitRank"); !s.ok()) return s;
  return std::unique_ptr<NcclCommunicator>(new NcclCommunicator(comm, rank, size, device_index));
}

NcclCommunicator::~NcclCommunicator() {
  if (comm_ != nullptr) ncclCommDestroy(comm_);
}

Status NcclCommunicator::AllReduceSum(at::Tensor& tensor) {
  if (Status s = CheckTensor(tensor); !s.ok()) return s;
  StatusOr<ncclDataType_t> type = NcclType(tensor.scalar_type());
  if (!type.ok()) return type.status();
  c10::cuda::CUDAGuard guard(tensor.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(tensor.device().index()).stream();
  return Check(ncclAllReduce(tensor.data_ptr(), tensor.data_ptr(), static_cast<size_t>(tensor.numel()), *type,
                             ncclSum, comm_, stream),
               "AllReduce");
}

Status NcclCommunicator::Broadcast(at::Tensor& tensor, int root) {
  if (Status s = CheckTensor(tensor); !s.ok()) return s;
  StatusOr<ncclDataType_t> type = NcclType(tensor.scalar_type());
  if (!type.ok()) return type.status();
  c10::cuda::CUDAGuard guard(tensor.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(tensor.device().index()).stream();
  return Check(ncclBroadcast(tensor.data_ptr(), tensor.data_ptr(), static_cast<size_t>(tensor.numel()), *type,
                             root, comm_, stream),
               "Broadcast");
}

Status NcclCommunicator::AllGather(const at::Tensor& input, at::Tensor& output) {
  if (Status s = CheckTensor(input); !s.ok()) return s;
  if (Status s = CheckTensor(output); !s.ok()) return s;
  if (output.numel() != input.numel() * size_ || output.scalar_type() != input.scalar_type()) {
    return InvalidArgument("AllGather output must hold size() * input.numel() elements of the input's dtype");
  }
  StatusOr<ncclDataType_t> type = NcclType(input.scalar_type());
  if (!type.ok()) return type.status();
  c10::cuda::CUDAGuard guard(input.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(input.device().index()).stream();
  return Check(ncclAllGather(input.data_ptr(), output.data_ptr(), static_cast<size_t>(input.numel()), *type,
                             comm_, stream),
               "AllGather");
}

Status NcclCommunicator::ReduceScatterSum(const at::Tensor& input, at::Tensor& output) {
  if (Status s = CheckTensor(input); !s.ok()) return s;
  if (Status s = CheckTensor(output); !s.ok()) return s;
  if (input.numel() != output.numel() * size_ || output.scalar_type() != input.scalar_type()) {
    return InvalidArgument("ReduceScatterSum input must hold size() * output.numel() elements of the output's dtype");
  }
  StatusOr<ncclDataType_t> type = NcclType(input.scalar_type());
  if (!type.ok()) return type.status();
  c10::cuda::CUDAGuard guard(input.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(input.device().index()).stream();
  return Check(ncclReduceScatter(input.data_ptr(), output.data_ptr(), static_cast<size_t>(output.numel()), *type,
                                 ncclSum, comm_, stream),
               "ReduceScatter");
}

Status NcclCommunicator::Send(const at::Tensor& tensor, int dst, uint32_t /*tag*/) {
  if (Status s = CheckTensor(tensor); !s.ok()) return s;
  StatusOr<ncclDataType_t> type = NcclType(tensor.scalar_type());
  if (!type.ok()) return type.status();
  c10::cuda::CUDAGuard guard(tensor.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(tensor.device().index()).stream();
  pending_.push_back(tensor);
  return Check(ncclSend(tensor.data_ptr(), static_cast<size_t>(tensor.numel()), *type, dst, comm_, stream), "Send");
}

Status NcclCommunicator::Recv(at::Tensor& tensor, int src, uint32_t /*tag*/) {
  if (Status s = CheckTensor(tensor); !s.ok()) return s;
  StatusOr<ncclDataType_t> type = NcclType(tensor.scalar_type());
  if (!type.ok()) return type.status();
  c10::cuda::CUDAGuard guard(tensor.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(tensor.device().index()).stream();
  return Check(ncclRecv(tensor.data_ptr(), static_cast<size_t>(tensor.numel()), *type, src, comm_, stream), "Recv");
}

Status NcclCommunicator::WaitSends() {
  if (!pending_.empty()) c10::cuda::getCurrentCUDAStream(device_).synchronize();
  pending_.clear();
  return Status::Ok();
}

Status NcclCommunicator::Barrier() {
  // NCCL has no barrier: all-reduce one element and wait for it.
  at::Tensor one = at::ones({1}, at::TensorOptions().dtype(at::kFloat).device(at::kCUDA, device_));
  if (Status s = AllReduceSum(one); !s.ok()) return s;
  c10::cuda::getCurrentCUDAStream(device_).synchronize();
  return Status::Ok();
}

}  // namespace ltrain::worker
