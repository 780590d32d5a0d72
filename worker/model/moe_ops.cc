#include "worker/model/moe_ops.h"

#include <cstdlib>
#include <stdexcept>
#include <string>

#include <ATen/ATen.h>

#include <torch/autograd.h>

#include "worker/model/fused_kernels.h"
#include "worker/torch_compat.h"

namespace ltrain::worker::moe {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Combine's arithmetic as one autograd function: it keeps ys in their own type and the gates, and
// gathers each token's rows again in backward, where autograd's composite keeps the gathered rows in
// fp32 (twice the bytes of bf16 rows).
struct WeightedCombine : public torch::autograd::Function<WeightedCombine> {
  static torch::Tensor Gathered(const torch::Tensor& ys, const torch::Tensor& inverse, int64_t top_k) {
    return ys.index_select(0, inverse).view({inverse.size(0) / top_k, top_k, ys.size(1)});
  }
  // fp32 arithmetic (fp64 for fp64 rows).
  static torch::ScalarType Wide(const torch::Tensor& ys) {
    return ys.scalar_type() == torch::kDouble ? torch::kDouble : torch::kFloat;
  }
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& ys, const torch::Tensor& inverse,
                               const torch::Tensor& gates) {
    const int64_t top_k = gates.size(1);
    ctx->save_for_backward({ys, inverse, gates});
    return (Gathered(ys, inverse, top_k).to(Wide(ys)) * gates.unsqueeze(-1)).sum(1).to(ys.scalar_type());
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const torch::Tensor &ys = saved[0], &inverse = saved[1], &gates = saved[2];
    const torch::Tensor dout = grads[0].to(Wide(ys)).unsqueeze(1);  // [T, 1, d]
    const torch::Tensor dgates = (Gathered(ys, inverse, gates.size(1)).to(Wide(ys)) * dout).sum(-1);
    const torch::Tensor drows = (gates.unsqueeze(-1) * dout).to(ys.scalar_type()).view({-1, ys.size(1)});
    // inverse is a permutation: row i of ys took assignment inverse[i]'s gradient.
    torch::Tensor dys = torch::empty_like(ys);
    dys.index_copy_(0, inverse, drows);
    return {dys, torch::Tensor(), dgates.to(gates.scalar_type())};
  }
};

// The experts' SwiGLU as three grouped products over segments ending at `ends` [E] (int32, on xs'
// device). [E, f, d] read as [E, d, f] (a view): each expert's x · w^T.
torch::Tensor GroupedProducts(const torch::Tensor& xs, const torch::Tensor& ends, const torch::Tensor& w1,
                              const torch::Tensor& w3, const torch::Tensor& w2) {
  const torch::Tensor x = xs.contiguous();
  const torch::Tensor h = SwiGlu(compat::GroupedMm(x, w1.transpose(1, 2), ends), compat::GroupedMm(x, w3.transpose(1, 2), ends));
  return compat::GroupedMm(h, w2.transpose(1, 2), ends);
}

}  // namespace

Routing Route(const torch::Tensor& logits, const torch::Tensor& bias, const RouterOptions& options) {
  if (logits.dim() != 2) throw std::invalid_argument("Route takes logits [tokens, experts]");
  const int64_t experts = logits.size(1);
  if (options.top_k < 1 || options.top_k > experts) {
    throw std::invalid_argument("Route: top_k " + std::to_string(options.top_k) + " of " + std::to_string(experts) +
                                " experts");
  }
  Routing r;
  const torch::Tensor z = logits.to(torch::kFloat);
  r.scores = options.score == Score::kSoftmax ? z.softmax(-1) : z.sigmoid();
  // The choice: a stable sort, descending, so equal scores go to the lower index on every rank.
  torch::Tensor choose = r.scores.detach();
  if (bias.defined()) choose = choose + bias.to(choose.device()).to(torch::kFloat);
  const torch::Tensor ranked = std::get<1>(at::sort(choose, /*stable=*/true, /*dim=*/-1, /*descending=*/true));
  r.experts = ranked.narrow(1, 0, options.top_k).contiguous();
  r.gates = r.scores.gather(1, r.experts);
  if (options.norm_topk) r.gates = r.gates / (r.gates.sum(-1, /*keepdim=*/true) + 1e-20);
  if (options.route_scale != 1.0) r.gates = r.gates * options.route_scale;
  return r;
}

Dispatch SortByExpert(const torch::Tensor& experts, int64_t num_experts, bool host_counts) {
  Dispatch d;
  d.top_k = static_cast<int>(experts.size(1));
  const torch::Tensor ids = experts.reshape(-1);
  d.order = std::get<1>(at::sort(ids, /*stable=*/true, /*dim=*/0, /*descending=*/false));
  // Counted by a scatter, not bincount: bincount on a GPU reads the ids' largest on the host first.
  d.rows = torch::zeros({num_experts}, ids.options().dtype(torch::kLong)).scatter_add_(0, ids, torch::ones_like(ids));
  if (host_counts) {
    const torch::Tensor counts = d.rows.to(torch::kCPU);
    d.counts.assign(counts.data_ptr<int64_t>(), counts.data_ptr<int64_t>() + num_experts);
  }
  return d;
}

torch::Tensor Permute(const torch::Tensor& x, const Dispatch& dispatch) {
  return x.index_select(0, at::div(dispatch.order, dispatch.top_k, "floor"));
}

bool GroupedExpertsApply(const torch::Tensor& xs, const torch::Tensor& w1) {
  if (!compat::kHasGroupedMm || !xs.is_cuda() || xs.scalar_type() != torch::kBFloat16 ||
      w1.scalar_type() != torch::kBFloat16 || xs.size(-1) % 8 != 0 || w1.size(1) % 8 != 0) {
    return false;
  }
  static const bool wanted = [] {
    const char* v = std::getenv("LTRAIN_MOE_GROUPED_MM");
    return v == nullptr || std::string(v) != "0";
  }();
  return wanted && compat::DeviceCapabilityMajor(xs.device()) >= 9;
}

torch::Tensor Experts(const torch::Tensor& xs, const std::vector<int64_t>& counts, const torch::Tensor& w1,
                      const torch::Tensor& w3, const torch::Tensor& w2) {
  if (!GroupedExpertsApply(xs, w1)) return ExpertsLoop(xs, counts, w1, w3, w2);
  int64_t rows = 0;
  std::vector<int32_t> ends;
  for (const int64_t n : counts) ends.push_back(static_cast<int32_t>(rows += n));
  if (rows != xs.size(0)) {
    throw std::invalid_argument("Experts: the counts cover " + std::to_string(rows) + " of " +
                                std::to_string(xs.size(0)) + " rows");
  }
  return GroupedProducts(xs, torch::tensor(ends, torch::TensorOptions().dtype(torch::kInt)).to(xs.device(), true), w1,
                         w3, w2);
}

torch::Tensor GroupedExperts(const torch::Tensor& xs, const torch::Tensor& rows, const torch::Tensor& w1,
                             const torch::Tensor& w3, const torch::Tensor& w2) {
  if (!GroupedExpertsApply(xs, w1)) throw std::logic_error("GroupedExperts: no grouped products for these operands");
  return GroupedProducts(xs, rows.cumsum(0).to(torch::kInt), w1, w3, w2);
}

torch::Tensor ExpertsLoop(const torch::Tensor& xs, const std::vector<int64_t>& counts, const torch::Tensor& w1,
                          const torch::Tensor& w3, const torch::Tensor& w2) {
  std::vector<torch::Tensor> outs;
  int64_t at = 0;
  for (size_t e = 0; e < counts.size(); ++e) {
    if (counts[e] == 0) continue;
    const torch::Tensor x = xs.narrow(0, at, counts[e]);
    const auto i = static_cast<int64_t>(e);
    const torch::Tensor h = SwiGlu(x.mm(w1[i].t()), x.mm(w3[i].t()));
    outs.push_back(h.mm(w2[i].t()));
    at += counts[e];
  }
  if (at != xs.size(0)) {
    throw std::invalid_argument("Experts: the counts cover " + std::to_string(at) + " of " +
                                std::to_string(xs.size(0)) + " rows");
  }
  if (outs.empty()) {
    // No rows (an expert-parallel rank whose experts nobody chose): still a product of xs and the
    // weights, so that backward reaches xs and the exchanges before it on every rank alike.
    const torch::Tensor x = xs.narrow(0, 0, 0);
    return (at::silu(x.mm(w1[0].t())) * x.mm(w3[0].t())).mm(w2[0].t());
  }
  return torch::cat(outs, 0);
}

torch::Tensor Combine(const torch::Tensor& ys, const Dispatch& dispatch, const torch::Tensor& gates) {
  const int64_t assignments = dispatch.order.numel();
  // Row i of ys is assignment order[i]: back to assignment order by the inverse permutation.
  torch::Tensor inverse = torch::empty_like(dispatch.order);
  inverse.index_put_({dispatch.order}, torch::arange(assignments, dispatch.order.options()));
  if (gates.size(1) != dispatch.top_k || gates.size(0) * dispatch.top_k != assignments) {
    throw std::invalid_argument("Combine: gates [" + std::to_string(gates.size(0)) + ", " + std::to_string(gates.size(1)) +
                                "] for " + std::to_string(assignments) + " assignments of top " +
                                std::to_string(dispatch.top_k));
  }
  return WeightedCombine::apply(ys, inverse, gates);
}

torch::Tensor SequenceBalanceLoss(const Routing& routing, int64_t seq_len, Score score) {
  const int64_t tokens = routing.scores.size(0), experts = routing.scores.size(1);
  const int64_t k = routing.experts.size(1);
  if (seq_len < 1 || tokens % seq_len != 0) {
    throw std::invalid_argument("SequenceBalanceLoss: " + std::to_string(tokens) + " tokens in sequences of " +
                                std::to_string(seq_len));
  }
  const int64_t sequences = tokens / seq_len;
  torch::Tensor s = routing.scores;
  if (score == Score::kSigmoid) s = s / (s.sum(-1, /*keepdim=*/true) + 1e-20);
  const torch::Tensor p = s.view({sequences, seq_len, experts}).mean(1);  // [sequences, E]
  torch::Tensor chosen = torch::zeros({sequences, experts}, routing.scores.options());
  chosen.scatter_add_(1, routing.experts.view({sequences, seq_len * k}),
                      torch::ones({sequences, seq_len * k}, routing.scores.options()));
  const torch::Tensor f = chosen * (static_cast<double>(experts) / static_cast<double>(k * seq_len));
  return (f * p).sum(-1).mean();
}

torch::Tensor ZLoss(const torch::Tensor& logits) { return logits.to(torch::kFloat).logsumexp(-1).square().mean(); }

}  // namespace ltrain::worker::moe
