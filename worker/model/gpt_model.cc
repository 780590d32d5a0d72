#include "worker/model/gpt_model.h"

#include <cmath>
#include <string>

#include <torch/nn/functional.h>
#include <torch/nn/init.h>

#include "worker/torch_compat.h"

namespace ltrain::worker {

namespace F = torch::nn::functional;

BlockImpl::BlockImpl(int d_model, int heads) : heads_(heads) {
  // Registration order is the Python module's, so the default initialisers consume the generator
  // in the same order.
  ln1_ = register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d_model})));
  qkv_ = register_module("qkv", torch::nn::Linear(d_model, 3 * d_model));
  proj_ = register_module("proj", torch::nn::Linear(d_model, d_model));
  ln2_ = register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d_model})));
  fc_ = register_module("fc", torch::nn::Linear(d_model, 4 * d_model));
  fc2_ = register_module("fc2", torch::nn::Linear(4 * d_model, d_model));
}

torch::Tensor BlockImpl::forward(const torch::Tensor& x) {
  const int64_t b = x.size(0), t = x.size(1), c = x.size(2);
  std::vector<torch::Tensor> qkv = qkv_(ln1_(x)).split(c, /*dim=*/2);
  for (auto& part : qkv) part = part.view({b, t, heads_, c / heads_}).transpose(1, 2);
  torch::Tensor y = compat::CausalAttention(qkv[0], qkv[1], qkv[2]);
  torch::Tensor h = x + proj_(y.transpose(1, 2).reshape({b, t, c}));
  return h + fc2_(torch::gelu(fc_(ln2_(h)), "tanh"));
}

ParamInit GptParamInit(const std::string& name, int64_t dims, int layers) {
  auto ends_with = [&](const std::string& suffix) {
    return name.size() >= suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0;
  };
  if (ends_with("bias")) return {ParamInit::kZeros, 0};
  if (ends_with("proj.weight") || ends_with("fc2.weight")) return {ParamInit::kNormal, 0.02 / std::sqrt(2.0 * layers)};
  if (dims >= 2) return {ParamInit::kNormal, 0.02};
  return {ParamInit::kOnes, 0};
}

GptImpl::GptImpl(const GptConfig& config) : config_(config) {
  wte_ = register_module("wte", torch::nn::Embedding(config.vocab, config.d_model));
  wpe_ = register_module("wpe", torch::nn::Embedding(config.seq_len, config.d_model));
  blocks_ = register_module("blocks", torch::nn::ModuleList());
  for (int i = 0; i < config.layers; ++i) blocks_->push_back(Block(config.d_model, config.heads));
  lnf_ = register_module("lnf", torch::nn::LayerNorm(torch::nn::LayerNormOptions({config.d_model})));
  {
    // The Python model builds an nn.Linear head before tying it to wte; building (and dropping)
    // one here keeps the generator stream, and so the initial weights, identical to Python's.
    torch::nn::Linear untied_head(torch::nn::LinearOptions(config.d_model, config.vocab).bias(false));
  }

  torch::NoGradGuard no_grad;
  for (auto& item : named_parameters()) {
    torch::Tensor& p = item.value();
    const ParamInit init = GptParamInit(item.key(), p.dim(), config.layers);
    if (init.kind == ParamInit::kZeros) {
      torch::nn::init::zeros_(p);
    } else if (init.kind == ParamInit::kNormal) {
      torch::nn::init::normal_(p, 0.0, init.stddev);
    }  // kOnes: LayerNorm's own initialisation
  }
}

torch::Tensor GptImpl::Logits(const torch::Tensor& idx) {
  const int64_t t = idx.size(1);
  torch::Tensor pos = torch::arange(t, torch::TensorOptions().dtype(torch::kLong).device(idx.device()));
  torch::Tensor x = wte_(idx) + wpe_(pos);
  for (const auto& block : *blocks_) x = block->as<BlockImpl>()->forward(x);
  // Tied head: the output projection is the token embedding matrix.
  return F::linear(lnf_(x), wte_->weight).to(torch::kFloat);
}

torch::Tensor GptImpl::forward(const torch::Tensor& idx, const torch::Tensor& targets) {
  torch::Tensor logits = Logits(idx);
  return F::cross_entropy(logits.view({-1, logits.size(-1)}), targets.reshape({-1}));
}

int64_t GptImpl::NumParameters() const {
  int64_t n = 0;
  for (const auto& p : parameters()) n += p.numel();
  return n;
}

}  // namespace ltrain::worker
