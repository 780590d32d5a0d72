#include "worker/comm/communicator.h"

#include <ATen/ATen.h>

namespace ltrain::worker {

StatusOr<at::Tensor> Communicator::AllocateSymmetric(int64_t /*bytes*/) {
  return FailedPrecondition(backend() + " has no memory the ranks write into directly");
}

Status Communicator::AllReduceMean(at::Tensor& tensor) {
  LTRAIN_RETURN_IF_ERROR(AllReduceSum(tensor));
  if (size() > 1) tensor.div_(size());
  return Status::Ok();
}

Status Communicator::ReduceScatterMean(const at::Tensor& input, at::Tensor& output) {
  LTRAIN_RETURN_IF_ERROR(ReduceScatterSum(input, output));
  if (size() > 1) output.div_(size());
  return Status::Ok();
}

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
  if (!output.is_same(input)) output.view(-1).copy_(input.reshape(-1));
  return Status::Ok();
}

Status SelfCommunicator::ReduceScatterSum(const at::Tensor& input, at::Tensor& output) {
  if (output.numel() != input.numel()) {
    return InvalidArgument("ReduceScatterSum output has " + std::to_string(output.numel()) +
                           " elements, expected " + std::to_string(input.numel()));
  }
  if (!output.is_same(input)) output.view(-1).copy_(input.reshape(-1));
  return Status::Ok();
}

Status CheckAllToAll(const at::Tensor& input, const std::vector<int64_t>& send_counts, const at::Tensor& output,
                     const std::vector<int64_t>& recv_counts, int size) {
  const auto n = static_cast<size_t>(size);
  if (send_counts.size() != n || recv_counts.size() != n) {
    return InvalidArgument("AllToAll takes one send and one receive count a rank: " + std::to_string(size) +
                           " ranks, " + std::to_string(send_counts.size()) + " and " +
                           std::to_string(recv_counts.size()) + " counts");
  }
  if (input.dim() == 0 || output.dim() == 0) return InvalidArgument("AllToAll moves rows: a 0-d tensor has none");
  if (input.scalar_type() != output.scalar_type()) {
    return InvalidArgument(std::string("AllToAll output is ") + c10::toString(output.scalar_type()) + ", its input " +
                           c10::toString(input.scalar_type()));
  }
  if (!output.is_contiguous()) return InvalidArgument("AllToAll needs a contiguous output");
  if (input.size(0) > 0 && output.size(0) > 0 && input.numel() / input.size(0) != output.numel() / output.size(0)) {
    return InvalidArgument("AllToAll rows of " + std::to_string(input.numel() / input.size(0)) + " elements in, " +
                           std::to_string(output.numel() / output.size(0)) + " out");
  }
  int64_t sent = 0, received = 0;
  for (size_t r = 0; r < n; ++r) {
    if (send_counts[r] < 0 || recv_counts[r] < 0) {
      return InvalidArgument("AllToAll count for rank " + std::to_string(r) + " is negative");
    }
    sent += send_counts[r];
    received += recv_counts[r];
  }
  if (sent != input.size(0) || received != output.size(0)) {
    return InvalidArgument("AllToAll sends " + std::to_string(sent) + " of the input's " +
                           std::to_string(input.size(0)) + " rows and receives " + std::to_string(received) +
                           " into the output's " + std::to_string(output.size(0)));
  }
  return Status::Ok();
}

int64_t AllToAllRowWidth(const at::Tensor& input, const at::Tensor& output) {
  if (input.dim() > 0 && input.size(0) > 0) return input.numel() / input.size(0);
  return output.dim() > 0 && output.size(0) > 0 ? output.numel() / output.size(0) : 0;
}

Status SelfCommunicator::AllToAll(const at::Tensor& input, const std::vector<int64_t>& send_counts,
                                  at::Tensor& output, const std::vector<int64_t>& recv_counts) {
  LTRAIN_RETURN_IF_ERROR(CheckAllToAll(input, send_counts, output, recv_counts, 1));
  if (!output.is_same(input) && output.numel() > 0) output.view(-1).copy_(input.reshape(-1));
  return Status::Ok();
}

Status SelfCommunicator::Send(const at::Tensor& /*tensor*/, int dst, uint32_t /*tag*/) {
  return InvalidArgument("send to rank " + std::to_string(dst) + " in a group of 1");
}

Status SelfCommunicator::Recv(at::Tensor& /*tensor*/, int src, uint32_t /*tag*/) {
  return InvalidArgument("receive from rank " + std::to_string(src) + " in a group of 1");
}

Status FakeCommunicator::Next(const char* op, int64_t numel) {
  const int call = static_cast<int>(log_.size());
  log_.push_back(Call{op, numel, std::chrono::steady_clock::now(), std::this_thread::get_id()});
  if (call == fail_at_) return failure_.ok() ? Unavailable("injected collective failure") : failure_;
  return Status::Ok();
}

Status FakeCommunicator::AllReduceSum(at::Tensor& tensor) {
  LTRAIN_RETURN_IF_ERROR(Next("all_reduce", tensor.numel()));
  if (!tensor.is_contiguous()) return InvalidArgument("AllReduceSum needs a contiguous tensor");
  if (size_ > 1) tensor.mul_(size_);
  return Status::Ok();
}

Status FakeCommunicator::Broadcast(at::Tensor& tensor, int root) {
  LTRAIN_RETURN_IF_ERROR(Next("broadcast", tensor.numel()));
  if (root < 0 || root >= size_) return InvalidArgument("broadcast root " + std::to_string(root) + " out of range");
  return Status::Ok();
}

Status FakeCommunicator::AllGather(const at::Tensor& input, at::Tensor& output) {
  LTRAIN_RETURN_IF_ERROR(Next("all_gather", output.numel()));
  if (output.numel() != input.numel() * size_) return InvalidArgument("AllGather output has the wrong size");
  at::Tensor in = input.reshape(-1).clone();
  for (int r = 0; r < size_; ++r) output.view(-1).narrow(0, r * in.numel(), in.numel()).copy_(in);
  return Status::Ok();
}

Status FakeCommunicator::ReduceScatterSum(const at::Tensor& input, at::Tensor& output) {
  LTRAIN_RETURN_IF_ERROR(Next("reduce_scatter", input.numel()));
  if (input.numel() != output.numel() * size_) return InvalidArgument("ReduceScatterSum input has the wrong size");
  at::Tensor chunk = input.reshape(-1).narrow(0, 0, output.numel()).clone();
  output.view(-1).copy_(chunk.mul_(size_));
  return Status::Ok();
}

Status FakeCommunicator::Barrier() { return Next("barrier", 0); }

Status FakeCommunicator::AllToAll(const at::Tensor& input, const std::vector<int64_t>& send_counts,
                                  at::Tensor& output, const std::vector<int64_t>& recv_counts) {
  LTRAIN_RETURN_IF_ERROR(Next("all_to_all", output.numel()));
  LTRAIN_RETURN_IF_ERROR(CheckAllToAll(input, send_counts, output, recv_counts, size_));
  for (int r = 0; r < size_; ++r) {
    if (recv_counts[r] != send_counts[0]) {
      return InvalidArgument("fake AllToAll: every rank sends rank 0 " + std::to_string(send_counts[0]) +
                             " rows, not " + std::to_string(recv_counts[r]));
    }
  }
  if (send_counts[0] == 0) return Status::Ok();
  const at::Tensor first = input.narrow(0, 0, send_counts[0]).clone();
  for (int r = 0; r < size_; ++r) output.narrow(0, r * send_counts[0], send_counts[0]).copy_(first);
  return Status::Ok();
}

Status FakeCommunicator::Send(const at::Tensor& tensor, int dst, uint32_t /*tag*/) {
  LTRAIN_RETURN_IF_ERROR(Next("send", tensor.numel()));
  return InvalidArgument("fake communicator cannot send to rank " + std::to_string(dst));
}

Status FakeCommunicator::Recv(at::Tensor& tensor, int src, uint32_t /*tag*/) {
  LTRAIN_RETURN_IF_ERROR(Next("recv", tensor.numel()));
  return InvalidArgument("fake communicator cannot receive from rank " + std::to_string(src));
}

Status Communicator::SendRecv(const at::Tensor& send, int dst, at::Tensor& recv, int src, uint32_t tag) {
  LTRAIN_RETURN_IF_ERROR(Send(send, dst, tag));
  Status got = Recv(recv, src, tag);
  Status sent = WaitSends();
  LTRAIN_RETURN_IF_ERROR(got);
  return sent;
}

Status ReformableCommunicator::Replace(std::unique_ptr<Communicator> inner) {
  if (inner == nullptr) return InvalidArgument("a re-formed group needs a communicator");
  if (inner_ != nullptr && (inner->rank() != inner_->rank() || inner->size() != inner_->size())) {
    return InvalidArgument("a re-formed group must keep its ranks: rank " + std::to_string(inner->rank()) + " of " +
                           std::to_string(inner->size()) + " in place of rank " + std::to_string(inner_->rank()) +
                           " of " + std::to_string(inner_->size()));
  }
  inner_ = std::move(inner);
  return Status::Ok();
}

ProcessGroups DataParallelGroups(Communicator* world) {
  ProcessGroups g;
  g.layout = Layout::Grid(1, world->size(), 1);
  g.rank = world->rank();
  g.coords = CoordsOf(g.layout, g.rank);
  g.world = world;
  g.dp = world;
  g.edp = world;
  for (Communicator** slot : {&g.tp, &g.pp, &g.embedding, &g.ep, &g.cp}) {
    g.owned.push_back(std::make_unique<SelfCommunicator>());
    *slot = g.owned.back().get();
  }
  return g;
}

StatusOr<ProcessGroups> BuildProcessGroups(const Layout& layout, int rank, Communicator* world,
                                           const GroupFactory& make) {
  if (layout.tp * layout.dp * layout.pp != world->size()) {
    return InvalidArgument("layout tp*dp*pp=" + std::to_string(layout.tp * layout.dp * layout.pp) +
                           " but the world has " + std::to_string(world->size()) + " ranks");
  }
  ProcessGroups g;
  g.layout = layout;
  g.rank = rank;
  g.coords = CoordsOf(layout, rank);
  g.world = world;
  const std::pair<GroupKind, Communicator**> kinds[] = {
      {GroupKind::kTensor, &g.tp},        {GroupKind::kData, &g.dp},   {GroupKind::kPipeline, &g.pp},
      {GroupKind::kEmbedding, &g.embedding}, {GroupKind::kExpert, &g.ep}, {GroupKind::kExpertData, &g.edp},
      {GroupKind::kContext, &g.cp}};
  for (const auto& [kind, slot] : kinds) {
    if (kind == GroupKind::kExpertData && layout.ep <= 1) {
      g.edp = g.dp;  // the same ranks: the same connections
      continue;
    }
    Group group = GroupOf(layout, kind, rank);
    const int group_rank = group.RankOf(rank);
    if (kind == GroupKind::kEmbedding) g.in_embedding_group = group_rank >= 0;
    if (group.ranks.size() == static_cast<size_t>(world->size()) && group_rank == world->rank()) {
      *slot = world;  // the group is the world: reuse its connections
      continue;
    }
    if (group.ranks.size() <= 1) {
      g.owned.push_back(std::make_unique<SelfCommunicator>());
    } else {
      LTRAIN_ASSIGN_OR_RETURN(std::unique_ptr<Communicator> comm, make(group, group_rank));
      g.owned.push_back(std::move(comm));
    }
    *slot = g.owned.back().get();
  }
  return g;
}

}  // namespace ltrain::worker
