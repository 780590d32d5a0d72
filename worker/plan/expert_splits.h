// The arithmetic of an expert-parallel exchange: which rows of an MoE layer go to which rank, and how
// the received rows are regrouped for the experts and back. Experts: `experts` in all, experts / ep on
// each rank of the expert-parallel group, expert e on rank e / (experts / ep). Pure: host integers in,
// host integers out; the tensors follow them in worker/model.
#pragma once

#include <cstdint>
#include <vector>

#include "common/status.h"

namespace ltrain::worker {

struct ExpertExchange {
  int ep = 1;
  int local_experts = 0;  // experts / ep
  // Rows this rank sends each rank (its routed rows sorted by expert, so each rank's rows are
  // contiguous), and rows it receives from each: the all-to-all's counts.
  std::vector<int64_t> send;
  std::vector<int64_t> recv;
  // Rows each local expert computes, over every source: the experts' segments after the regroup.
  std::vector<int64_t> expert_rows;
  // The received rows come in chunks, source-major: chunk r * local_experts + l holds the rows source
  // r routed to local expert l, received_chunks[that] of them. The experts read them expert-major:
  // regroup lists the chunks in that order (l * ep + r: chunk r * local_experts + l).
  std::vector<int64_t> received_chunks;
  std::vector<int64_t> regroup;
  // The way back: the experts' output in chunks expert-major (sizes expert_chunks), listed
  // source-major by ungroup, before the all-to-all returns each source its rows (counts recv, send).
  std::vector<int64_t> expert_chunks;
  std::vector<int64_t> ungroup;
};

// counts: rows this rank routes to each of the `experts` experts. received: ep * (experts / ep)
// entries, entry r * (experts / ep) + l the rows source r routes to this rank's local expert l (what
// the exchange of the counts brought). InvalidArgument where experts is not a multiple of ep, a
// count is negative or the sizes do not match.
StatusOr<ExpertExchange> PlanExpertExchange(const std::vector<int64_t>& counts, const std::vector<int64_t>& received,
                                            int ep);

}  // namespace ltrain::worker
