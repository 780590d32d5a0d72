// ModelShard's mixture-of-experts blocks (model.moe): the branch that takes the MLP's place, the
// route counts the balance reads, the router bias DeepSeek-V3 balances by, and the balance and z
// losses, which enter backward through the branch's output (AuxLossScaler) so that the loss the
// trainer prints and the pipeline passes stays the language model's.
#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

#include <torch/autograd.h>

#include "common/model_family.h"
#include "worker/model/fused_kernels.h"
#include "worker/model/moe_ops.h"
#include "worker/model/parallel_model.h"
#include "worker/plan/expert_splits.h"

namespace ltrain::worker {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Megatron-LM's idea for a loss that does not flow through the output: forward passes y on, backward
// passes y's gradient on and gives `loss` the gradient `scale` (1 for the LM loss' 1, divided as the
// LM loss is).
struct AuxLossScaler : public torch::autograd::Function<AuxLossScaler> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& y, const torch::Tensor& loss, double scale) {
    ctx->saved_data["scale"] = scale;
    ctx->save_for_backward({loss});
    return y.view(y.sizes());
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const torch::Tensor loss = ctx->get_saved_variables()[0];
    return {grads[0], torch::full_like(loss, ctx->saved_data["scale"].toDouble()), torch::Tensor()};
  }
};

// Rows of `input` [rows, d] sent to the ranks of an expert-parallel group (`send` rows to each, in
// rank order) and received from them (`recv` from each): the tokens' way to their experts and back.
// Backward sends each row's gradient the opposite way.
struct AllToAllRows : public torch::autograd::Function<AllToAllRows> {
  static torch::Tensor Exchange(Communicator* comm, const torch::Tensor& input, const std::vector<int64_t>& send,
                                const std::vector<int64_t>& recv) {
    int64_t rows = 0;
    for (int64_t n : recv) rows += n;
    torch::Tensor in = input.contiguous();
    torch::Tensor out = torch::empty({rows, in.size(1)}, in.options());
    if (Status s = comm->AllToAll(in, send, out, recv); !s.ok()) {
      throw std::runtime_error("expert parallelism's all-to-all: " + s.message());
    }
    return out;
  }
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& input, int64_t comm,
                               const std::vector<int64_t>& send, const std::vector<int64_t>& recv) {
    ctx->saved_data["comm"] = comm;
    ctx->saved_data["send"] = send;
    ctx->saved_data["recv"] = recv;
    return Exchange(reinterpret_cast<Communicator*>(comm), input, send, recv);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto* comm = reinterpret_cast<Communicator*>(ctx->saved_data["comm"].toInt());
    const std::vector<int64_t> send = ctx->saved_data["send"].toIntVector();
    const std::vector<int64_t> recv = ctx->saved_data["recv"].toIntVector();
    return {Exchange(comm, grads[0], recv, send), torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

// The identity forward, the gradient times `scale` backward.
struct ScaleGrad : public torch::autograd::Function<ScaleGrad> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, double scale) {
    ctx->saved_data["scale"] = scale;
    return x.view(x.sizes());
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {grads[0] * ctx->saved_data["scale"].toDouble(), torch::Tensor()};
  }
};

// `t`'s rows in chunks of `sizes`, put together in the order `order` lists them.
torch::Tensor Reorder(const torch::Tensor& t, const std::vector<int64_t>& sizes, const std::vector<int64_t>& order) {
  const std::vector<torch::Tensor> chunks = t.split_with_sizes(sizes);
  std::vector<torch::Tensor> ordered;
  ordered.reserve(order.size());
  for (int64_t k : order) ordered.push_back(chunks[static_cast<size_t>(k)]);
  return torch::cat(ordered);
}

moe::RouterOptions RouterOptionsOf(const MoeSpec& moe) {
  moe::RouterOptions o;
  o.top_k = moe.top_k;
  o.score = moe.score == MoeScore::kSigmoid ? moe::Score::kSigmoid : moe::Score::kSoftmax;
  o.norm_topk = moe.norm_topk;
  o.route_scale = moe.route_scale;
  return o;
}

}  // namespace

int ModelShard::MoeSlot(int layer) const {
  for (size_t i = 0; i < moe_layers_.size(); ++i) {
    if (moe_layers_[i] == layer) return static_cast<int>(i);
  }
  return -1;
}

torch::Tensor ModelShard::MoeBranch(int layer, const torch::Tensor& m) {
  const ModelSpec& c = spec_.config;
  const MoeSpec& moe = c.moe;
  const int slot = MoeSlot(layer);
  if (slot < 0) throw std::logic_error("MoeBranch: block " + std::to_string(layer) + " is not an MoE block here");
  const int64_t d = m.size(-1), seq = m.size(1);
  const torch::Tensor x = m.reshape({-1, d});
  // The router's product in the activations' dtype (transformers' order), its scores in fp32.
  const torch::Tensor logits = at::linear(x, P(layer, "router.weight"));
  const bool bias_balance = moe.balance == MoeBalance::kBias;
  const moe::RouterOptions options = RouterOptionsOf(moe);
  const moe::Routing routing = moe::Route(logits, bias_balance ? router_bias_[slot] : torch::Tensor(), options);
  const bool recording = torch::GradMode::is_enabled();
  // Dropless on one rank's experts by grouped products: the counts stay on the device.
  const bool on_device = moe.capacity_factor <= 0 && std::max(1, spec_.layout.ep) == 1 &&
                         moe::GroupedExpertsApply(x, P(layer, "experts.w1.weight"));
  const moe::Dispatch dispatch = moe::SortByExpert(routing.experts, moe.experts, /*host_counts=*/!on_device);
  if (recording) route_counts_[slot] += dispatch.rows.to(torch::kFloat);
  torch::Tensor xs = moe::Permute(x, dispatch);
  torch::Tensor ys;
  if (on_device) {
    ys = moe::GroupedExperts(xs, dispatch.rows, P(layer, "experts.w1.weight"), P(layer, "experts.w3.weight"),
                             P(layer, "experts.w2.weight"));
  } else if (moe.capacity_factor > 0) {
    // Each expert's first `capacity` rows (in token order: its segment's order); the rest dropped,
    // their outputs zero.
    const int64_t rows = xs.size(0);
    const auto capacity = static_cast<int64_t>(
        std::ceil(moe.capacity_factor * static_cast<double>(rows) / static_cast<double>(moe.experts)));
    std::vector<int64_t> kept, counts;
    int64_t at = 0, dropped = 0;
    for (const int64_t n : dispatch.counts) {
      const int64_t keep = std::min(n, capacity);
      for (int64_t i = 0; i < keep; ++i) kept.push_back(at + i);
      counts.push_back(keep);
      dropped += n - keep;
      at += n;
    }
    if (recording) dropped_ += static_cast<double>(dropped), routed_ += static_cast<double>(rows);
    if (dropped == 0) {
      ys = RoutedExperts(layer, xs, dispatch.counts);
    } else {
      const torch::Tensor index =
          torch::tensor(kept, torch::TensorOptions().dtype(torch::kLong)).to(xs.device());
      const torch::Tensor computed = RoutedExperts(layer, xs.index_select(0, index), counts);
      ys = torch::zeros({rows, computed.size(1)}, computed.options()).index_copy(0, index, computed);
    }
  } else {
    ys = RoutedExperts(layer, xs, dispatch.counts);
  }
  torch::Tensor y = moe::Combine(ys, dispatch, routing.gates);
  if (const torch::Tensor* w1 = Optional(layer, "shared.w1.weight")) {
    const torch::Tensor g = at::linear(x, *w1), u = at::linear(x, P(layer, "shared.w3.weight"));
    y = y + at::linear(SwiGlu(g, u), P(layer, "shared.w2.weight"));
  }
  if (recording) {
    // The balance and z losses: into backward through y, and kept (detached) for the step's figures.
    torch::Tensor aux_total;
    if (moe.balance == MoeBalance::kAuxLoss) {
      const torch::Tensor aux = moe::SequenceBalanceLoss(routing, seq, options.score);
      aux_sum_ = aux_sum_.defined() ? aux_sum_ + aux.detach() : aux.detach();
      ++aux_terms_;
      if (moe.aux_loss_coef > 0) aux_total = aux * moe.aux_loss_coef;
    }
    if (moe.z_loss_coef > 0) {
      const torch::Tensor z = moe::ZLoss(logits);
      z_sum_ = z_sum_.defined() ? z_sum_ + z.detach() : z.detach();
      ++z_terms_;
      aux_total = aux_total.defined() ? aux_total + z * moe.z_loss_coef : z * moe.z_loss_coef;
    }
    // Every tp rank routes the same tokens and adds the losses' gradients, which the tp sums then add up.
    if (aux_total.defined() && aux_total.requires_grad()) {
      y = AuxLossScaler::apply(y, aux_total, aux_scale_ / spec_.layout.tp);
    }
  }
  return y.view(m.sizes());
}

torch::Tensor ModelShard::RoutedExperts(int layer, const torch::Tensor& xs, const std::vector<int64_t>& counts) {
  const torch::Tensor& w1 = P(layer, "experts.w1.weight");
  const torch::Tensor& w3 = P(layer, "experts.w3.weight");
  const torch::Tensor& w2 = P(layer, "experts.w2.weight");
  const int ep = std::max(1, spec_.layout.ep);
  if (ep == 1) return moe::Experts(xs, counts, w1, w3, w2);
  if (ep_ == nullptr || ep_->size() != ep) {
    throw std::logic_error("MoE block " + std::to_string(layer) + ": parallel.ep=" + std::to_string(ep) +
                           " without its expert-parallel group");
  }
  // How many rows each expert gets from each rank: every rank sends each the counts of its experts.
  const int64_t experts = static_cast<int64_t>(counts.size()), local = experts / ep;
  const torch::Tensor mine = torch::tensor(counts, torch::TensorOptions().dtype(torch::kLong)).to(xs.device());
  torch::Tensor theirs = torch::empty({experts}, mine.options());
  const std::vector<int64_t> per_rank(static_cast<size_t>(ep), local);
  if (Status s = ep_->AllToAll(mine.view({experts, 1}), per_rank, theirs, per_rank); !s.ok()) {
    throw std::runtime_error("expert parallelism's exchange of counts: " + s.message());
  }
  const torch::Tensor host = theirs.to(torch::kCPU);
  const std::vector<int64_t> received(host.data_ptr<int64_t>(), host.data_ptr<int64_t>() + experts);
  StatusOr<ExpertExchange> plan = PlanExpertExchange(counts, received, ep);
  if (!plan.ok()) throw std::runtime_error("MoE block " + std::to_string(layer) + ": " + plan.status().message());
  const auto comm = reinterpret_cast<int64_t>(ep_);
  // The rows to the ranks of their experts; there expert-major; the experts; back in the order they came.
  const torch::Tensor arrived = AllToAllRows::apply(xs, comm, plan->send, plan->recv);
  const torch::Tensor grouped = Reorder(arrived, plan->received_chunks, plan->regroup);
  // Each rank's experts see the rows of the ep ranks: their gradients are those ranks' sums, which
  // the expert-data group's mean then takes over dp / ep ranks; 1/ep makes it the mean over dp.
  const double scale = 1.0 / ep;
  const torch::Tensor out = moe::Experts(grouped, plan->expert_rows, ScaleGrad::apply(w1, scale),
                                         ScaleGrad::apply(w3, scale), ScaleGrad::apply(w2, scale));
  const torch::Tensor back = Reorder(out, plan->expert_chunks, plan->ungroup);
  return AllToAllRows::apply(back, comm, plan->recv, plan->send);
}

torch::Tensor ModelShard::TakeRouteCounts() {
  if (moe_layers_.empty()) return {};
  torch::Tensor counts = torch::stack(route_counts_);
  for (torch::Tensor& c : route_counts_) c = torch::zeros_like(c);
  return counts;
}

void ModelShard::UpdateRouterBias(const torch::Tensor& counts) {
  const MoeSpec& moe = spec_.config.moe;
  if (moe.balance != MoeBalance::kBias || moe_layers_.empty()) return;
  torch::NoGradGuard no_grad;
  const torch::Tensor c = counts.to(torch::kFloat);
  // Up where an expert got fewer than the mean, down where more; centred, so that the biases' sum stays 0.
  torch::Tensor delta = (c.mean(-1, /*keepdim=*/true) - c).sign() * moe.bias_update;
  delta = delta - delta.mean(-1, /*keepdim=*/true);
  for (size_t i = 0; i < router_bias_.size(); ++i) router_bias_[i] += delta[static_cast<int64_t>(i)].to(router_bias_[i].device());
}

std::pair<double, double> ModelShard::TakeDropCounts() {
  const std::pair<double, double> out{dropped_, routed_};
  dropped_ = routed_ = 0;
  return out;
}

std::pair<torch::Tensor, torch::Tensor> ModelShard::TakeRouterLosses() {
  std::pair<torch::Tensor, torch::Tensor> out;
  if (aux_terms_ > 0) out.first = aux_sum_ / static_cast<double>(aux_terms_);
  if (z_terms_ > 0) out.second = z_sum_ / static_cast<double>(z_terms_);
  aux_sum_ = z_sum_ = torch::Tensor();
  aux_terms_ = z_terms_ = 0;
  return out;
}

}  // namespace ltrain::worker
