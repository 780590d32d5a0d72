// The GPT-2-style model of /work/shared/baselines/gpt_model.py, module for module: learned
// positions, pre-LayerNorm blocks, fused qkv projection, causal attention, tanh-GELU MLP of width
// 4d, output head tied to the token embedding, GPT-2 initialisation, fp32 cross-entropy loss.
// Parameter names and order match the Python model's named_parameters().
#pragma once

#include <cstdint>
#include <string>

#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

namespace ltrain::worker {

struct GptConfig {
  int layers = 2;
  int d_model = 128;
  int heads = 4;
  int seq_len = 64;
  int vocab = 256;
};

class BlockImpl : public torch::nn::Module {
 public:
  BlockImpl(int d_model, int heads);
  torch::Tensor forward(const torch::Tensor& x);

 private:
  int heads_;
  torch::nn::LayerNorm ln1_{nullptr};
  torch::nn::Linear qkv_{nullptr};
  torch::nn::Linear proj_{nullptr};
  torch::nn::LayerNorm ln2_{nullptr};
  torch::nn::Linear fc_{nullptr};
  torch::nn::Linear fc2_{nullptr};
};
TORCH_MODULE(Block);

// gpt_model.GPT's initialisation of the parameter `name` of `dims` dimensions: biases 0, the two
// residual output projections N(0, 0.02/sqrt(2 layers)), the other matrices N(0, 0.02), the rest
// (layer norm weights) 1.
struct ParamInit {
  enum Kind { kZeros, kOnes, kNormal } kind = kOnes;
  double stddev = 0;
};
ParamInit GptParamInit(const std::string& name, int64_t dims, int layers);

class GptImpl : public torch::nn::Module {
 public:
  // Draws the initial parameters from the global LibTorch generator: seed it (torch::manual_seed)
  // first and every rank builds the same model.
  explicit GptImpl(const GptConfig& config);

  // idx, targets: int64 [B, T] with T <= seq_len. Returns the mean cross-entropy (fp32 scalar).
  torch::Tensor forward(const torch::Tensor& idx, const torch::Tensor& targets);
  // Logits [B, T, vocab] in fp32.
  torch::Tensor Logits(const torch::Tensor& idx);

  const GptConfig& config() const { return config_; }
  int64_t NumParameters() const;

 private:
  GptConfig config_;
  torch::nn::Embedding wte_{nullptr};
  torch::nn::Embedding wpe_{nullptr};
  torch::nn::ModuleList blocks_{nullptr};
  torch::nn::LayerNorm lnf_{nullptr};
};
TORCH_MODULE(Gpt);

}  // namespace ltrain::worker
