// ModelShard's mixture-of-experts blocks (model.moe): the branch that takes the MLP's place, the
// route counts the balance reads, the router bias DeepSeek-V3 balances by, and the balance and z
// losses, which enter backward through the branch's output (AuxLossScaler) so that the loss the
// trainer prints and the pipeline passes stays the language model's.
#include <stdexcept>
#include <string>

#include <torch/autograd.h>

#include "common/model_family.h"
#include "worker/model/moe_ops.h"
#include "worker/model/parallel_model.h"

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
  if (recording) {
    route_counts_[slot] += at::bincount(routing.experts.reshape(-1), {}, moe.experts).to(torch::kFloat);
  }
  const moe::Dispatch dispatch = moe::SortByExpert(routing.experts, moe.experts);
  const torch::Tensor ys = moe::Experts(moe::Permute(x, dispatch), dispatch.counts, P(layer, "experts.w1.weight"),
                                        P(layer, "experts.w3.weight"), P(layer, "experts.w2.weight"));
  torch::Tensor y = moe::Combine(ys, dispatch, routing.gates);
  if (const torch::Tensor* w1 = Optional(layer, "shared.w1.weight")) {
    y = y + at::linear(at::silu(at::linear(x, *w1)) * at::linear(x, P(layer, "shared.w3.weight")),
                       P(layer, "shared.w2.weight"));
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

std::pair<torch::Tensor, torch::Tensor> ModelShard::TakeRouterLosses() {
  std::pair<torch::Tensor, torch::Tensor> out;
  if (aux_terms_ > 0) out.first = aux_sum_ / static_cast<double>(aux_terms_);
  if (z_terms_ > 0) out.second = z_sum_ / static_cast<double>(z_terms_);
  aux_sum_ = z_sum_ = torch::Tensor();
  aux_terms_ = z_terms_ = 0;
  return out;
}

}  // namespace ltrain::worker
