#include "worker/plan/expert_splits.h"

#include <string>

namespace ltrain::worker {

StatusOr<ExpertExchange> PlanExpertExchange(const std::vector<int64_t>& counts, const std::vector<int64_t>& received,
                                            int ep) {
  const auto experts = static_cast<int64_t>(counts.size());
  if (ep < 1) return InvalidArgument("an expert-parallel group of " + std::to_string(ep) + " ranks");
  if (experts == 0 || experts % ep != 0) {
    return InvalidArgument(std::to_string(experts) + " experts do not split into " + std::to_string(ep) +
                           " expert-parallel ranks");
  }
  if (static_cast<int64_t>(received.size()) != experts) {
    return InvalidArgument("the exchange of counts brought " + std::to_string(received.size()) + " counts, not " +
                           std::to_string(experts) + " (" + std::to_string(ep) + " sources x " +
                           std::to_string(experts / ep) + " local experts)");
  }
  for (int64_t i = 0; i < experts; ++i) {
    if (counts[i] < 0 || received[i] < 0) {
      return InvalidArgument("a negative row count for expert or chunk " + std::to_string(i));
    }
  }
  ExpertExchange x;
  x.ep = ep;
  x.local_experts = static_cast<int>(experts / ep);
  const int local = x.local_experts;
  x.send.assign(ep, 0);
  x.recv.assign(ep, 0);
  x.expert_rows.assign(local, 0);
  for (int r = 0; r < ep; ++r) {
    for (int l = 0; l < local; ++l) {
      x.send[r] += counts[r * local + l];
      x.recv[r] += received[r * local + l];
      x.expert_rows[l] += received[r * local + l];
    }
  }
  x.received_chunks = received;
  x.regroup.reserve(experts);
  x.expert_chunks.reserve(experts);
  for (int l = 0; l < local; ++l) {
    for (int r = 0; r < ep; ++r) {
      x.regroup.push_back(r * local + l);
      x.expert_chunks.push_back(received[r * local + l]);
    }
  }
  // Expert-major chunk l * ep + r goes back to source-major position r * local + l.
  x.ungroup.reserve(experts);
  for (int r = 0; r < ep; ++r) {
    for (int l = 0; l < local; ++l) x.ungroup.push_back(l * ep + r);
  }
  return x;
}

}  // namespace ltrain::worker
