#include "worker/communicator.h"

#include <ATen/ATen.h>

namespace ltrain::worker {

Status SelfCommunicator::AllReduceSum(at::Tensor& tensor) {
  if (!tensor.is_contiguous()) return InvalidArgument("AllReduceSum needs a contiguous tensor");
  return Status::Ok();
}

Status SelfCommunicator::Broadcast(at::Tensor& /*tensor*/, int root) {
  if (root != 0) return InvalidArgument("broadcast root " + std::to_string(root) + " outside a group of 1");
  return Status::Ok();
}

Status SelfCommunicator::AllGather(const at::Tensor& input, at::Tensor& output) {
  if (output.numel() != input.numel()) {
    return InvalidArgument("AllGather output has " + std::to_string(output.numel()) +
                           " elements, expected " + std::to_string(input.numel()));
  }
  output.view(-1).copy_(input.reshape(-1));
  return Status::Ok();
}

Status FakeCommunicator::Next() {
  const int call = calls_++;
  if (call == fail_at_) return failure_.ok() ? Unavailable("injected collective failure") : failure_;
  return Status::Ok();
}

Status FakeCommunicator::AllReduceSum(at::Tensor& tensor) {
  if (Status s = Next(); !s.ok()) return s;
  return SelfCommunicator::AllReduceSum(tensor);
}

Status FakeCommunicator::Broadcast(at::Tensor& tensor, int root) {
  if (Status s = Next(); !s.ok()) return s;
  return SelfCommunicator::Broadcast(tensor, root);
}

Status FakeCommunicator::AllGather(const at::Tensor& input, at::Tensor& output) {
  if (Status s = Next(); !s.ok()) return s;
  return SelfCommunicator::AllGather(input, output);
}

Status FakeCommunicator::Barrier() { return Next(); }

}  // namespace ltrain::worker
