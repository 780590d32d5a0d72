// The Llama of the parallel runtime (ModelShard with model.arch: llama) on one rank against a
// module written out here the way llama_model.Llama is (RMSNorm, rotate-half rotary embeddings,
// key/value heads repeated for grouped-query attention, SwiGLU), on the same weights: the same loss
// and gradients. Also its parameter names and shapes, its initialisation and its tensor-parallel
// slices, with key/value heads split and replicated.
#include <cmath>
#include <limits>
#include <map>
#include <string>

#include <gtest/gtest.h>
#include <torch/nn/functional.h>

#include "worker/comm/communicator.h"
#include "worker/model/parallel_model.h"

namespace ltrain::worker {
namespace {

namespace F = torch::nn::functional;

ModelSpec TinyLlama(bool tied) {
  ModelSpec m;
  m.arch = Arch::kLlama;
  m.layers = 2;
  m.d_model = 32;
  m.heads = 4;
  m.kv_heads = 2;
  m.ffn = 48;
  m.seq_len = 16;
  m.vocab = 256;
  m.rope_theta = 10000;
  m.tie_embeddings = tied;
  return m;
}

// llama_model.Llama's forward, step by step, over the parameters by name.
torch::Tensor ReferenceLoss(const ModelSpec& m, std::map<std::string, torch::Tensor>& p, const torch::Tensor& idx,
                            const torch::Tensor& targets) {
  const int64_t b = idx.size(0), t = idx.size(1), hd = HeadDim(m);
  auto norm = [&](const torch::Tensor& x, const torch::Tensor& w) {
    return x * torch::rsqrt(x.pow(2).mean(-1, true) + m.norm_eps) * w;
  };
  torch::Tensor inv = 1.0 / torch::pow(m.rope_theta, torch::arange(0, hd, 2, torch::kFloat) / static_cast<double>(hd));
  // transformers' rope_scaling, as modeling_rope_utils computes it.
  if (m.rope_scaling == RopeScaling::kLinear) inv = inv / m.rope_factor;
  if (m.rope_scaling == RopeScaling::kLlama3) {
    const double old_context = m.rope_original_positions;
    const double low_wavelen = old_context / m.rope_low_freq_factor, high_wavelen = old_context / m.rope_high_freq_factor;
    torch::Tensor wavelen = 2 * M_PI / inv;
    torch::Tensor llama = torch::where(wavelen > low_wavelen, inv / m.rope_factor, inv);
    torch::Tensor smooth =
        (old_context / wavelen - m.rope_low_freq_factor) / (m.rope_high_freq_factor - m.rope_low_freq_factor);
    torch::Tensor smoothed = (1 - smooth) * llama / m.rope_factor + smooth * llama;
    torch::Tensor medium = (wavelen < high_wavelen).logical_not().logical_and((wavelen > low_wavelen).logical_not());
    inv = torch::where(medium, smoothed, llama);
  }
  torch::Tensor angles = torch::outer(torch::arange(t, torch::kFloat), inv);
  torch::Tensor cos = angles.cos().view({1, t, 1, hd / 2}), sin = angles.sin().view({1, t, 1, hd / 2});
  auto rope = [&](const torch::Tensor& x) {
    auto halves = x.chunk(2, -1);
    return torch::cat({halves[0] * cos - halves[1] * sin, halves[1] * cos + halves[0] * sin}, -1);
  };
  torch::Tensor causal = torch::ones({t, t}, torch::kBool).triu(1);
  torch::Tensor x = F::embedding(idx, p.at("tok_embeddings.weight"));
  for (int l = 0; l < m.layers; ++l) {
    auto w = [&](const std::string& name) { return p.at("layers." + std::to_string(l) + "." + name); };
    // Qwen2's q, k and v biases; Qwen3's RMSNorm of each head of q and of k, before the rotation.
    auto bias = [&](const std::string& name) {
      const std::string full = "layers." + std::to_string(l) + "." + name;
      return p.count(full) ? p.at(full) : torch::Tensor();
    };
    auto head_norm = [&](const torch::Tensor& x, const std::string& name) {
      const torch::Tensor wn = bias(name);
      return wn.defined() ? norm(x, wn) : x;
    };
    torch::Tensor h = norm(x, w("attn_norm.weight"));
    torch::Tensor q = rope(head_norm(F::linear(h, w("wq.weight"), bias("wq.bias")).view({b, t, m.heads, hd}), "q_norm.weight"));
    torch::Tensor k = rope(head_norm(F::linear(h, w("wk.weight"), bias("wk.bias")).view({b, t, m.kv_heads, hd}), "k_norm.weight"));
    torch::Tensor v = F::linear(h, w("wv.weight"), bias("wv.bias")).view({b, t, m.kv_heads, hd});
    const int64_t rep = m.heads / m.kv_heads;
    q = q.transpose(1, 2);
    k = k.repeat_interleave(rep, 2).transpose(1, 2);
    v = v.repeat_interleave(rep, 2).transpose(1, 2);
    torch::Tensor scores = torch::matmul(q, k.transpose(-2, -1)) / std::sqrt(static_cast<double>(hd));
    scores = scores.masked_fill(causal, -std::numeric_limits<double>::infinity());
    torch::Tensor y = torch::matmul(torch::softmax(scores, -1), v).transpose(1, 2).reshape({b, t, m.heads * hd});
    x = x + F::linear(y, w("wo.weight"));
    h = norm(x, w("ffn_norm.weight"));
    x = x + F::linear(torch::silu(F::linear(h, w("w1.weight"))) * F::linear(h, w("w3.weight")), w("w2.weight"));
  }
  const torch::Tensor& head = m.tie_embeddings ? p.at("tok_embeddings.weight") : p.at("output.weight");
  torch::Tensor logits = F::linear(norm(x, p.at("norm.weight")), head);
  return F::cross_entropy(logits.view({-1, m.vocab}), targets.view({-1}));
}

// Returns the shard's loss. `arch`: a family of the Llama block (Qwen3's heads 16 wide, twice
// d_model/heads), its 1-D parameters (norms, biases) drawn at random so that each counts.
double ExpectShardEqualsReference(bool tied, bool stochastic_residual = false,
                                  RopeScaling scaling = RopeScaling::kNone, Arch arch = Arch::kLlama) {
  ModelShardSpec spec;
  spec.config = TinyLlama(tied);
  spec.config.arch = arch;
  if (arch == Arch::kQwen3) spec.config.head_dim = 16;
  // Head width 8, theta 10000: wavelengths 6.3, 63, 628 and 6283 positions. With an original context
  // of 64, factors 1 and 4: one kept, one blended, two divided by the factor.
  spec.config.rope_scaling = scaling;
  spec.config.rope_factor = 8;
  spec.config.rope_original_positions = 64;
  spec.stochastic_residual = stochastic_residual;
  spec.layout.stage_layers = {spec.config.layers};
  spec.seed = 9;
  SelfCommunicator self;
  auto shard = ModelShard::Create(spec, &self);
  EXPECT_TRUE(shard.ok()) << shard.status().message();
  if (!shard.ok()) return 0;
  if (arch != Arch::kLlama) {
    torch::NoGradGuard no_grad;
    torch::manual_seed(12);
    for (ShardParam& sp : (*shard)->params()) {
      if (sp.value.dim() == 1) sp.value.copy_(torch::rand_like(sp.value) + 0.5);
    }
  }
  std::map<std::string, torch::Tensor> ref;
  for (const ShardParam& sp : (*shard)->params()) ref[sp.name] = sp.value.detach().clone().requires_grad_(true);
  EXPECT_EQ(ref.count("output.weight"), tied ? 0u : 1u);
  EXPECT_EQ(ref.count("layers.1.wk.bias"), arch == Arch::kQwen2 ? 1u : 0u);
  EXPECT_EQ(ref.count("layers.1.k_norm.weight"), arch == Arch::kQwen3 ? 1u : 0u);

  torch::manual_seed(6);
  torch::Tensor idx = torch::randint(0, 256, {3, 16}, torch::kLong);
  torch::Tensor targets = torch::randint(0, 256, {3, 16}, torch::kLong);
  torch::Tensor loss = (*shard)->Forward(0, idx, targets);
  torch::Tensor want = ReferenceLoss(spec.config, ref, idx, targets);
  EXPECT_NEAR(loss.item<double>(), want.item<double>(), 1e-5);
  EXPECT_NEAR(loss.item<double>(), std::log(256.0), 0.1);
  loss.backward();
  want.backward();
  for (const ShardParam& sp : (*shard)->params()) {
    EXPECT_TRUE(sp.value.grad().defined()) << sp.name;
    if (!sp.value.grad().defined()) continue;
    EXPECT_TRUE(torch::allclose(sp.value.grad(), ref.at(sp.name).grad(), 1e-4, 1e-6)) << sp.name;
  }
  return loss.item<double>();
}

TEST(LlamaModelTest, OneRankShardEqualsTheReferenceUntied) { ExpectShardEqualsReference(false); }
// Qwen2's biases and Qwen3's per-head norms and wide heads as transformers computes them; each
// changes the model.
TEST(LlamaModelTest, QwenBlocksEqualTheReference) {
  const double qwen2 = ExpectShardEqualsReference(true, false, RopeScaling::kNone, Arch::kQwen2);
  const double qwen3 = ExpectShardEqualsReference(true, false, RopeScaling::kNone, Arch::kQwen3);
  const double mistral = ExpectShardEqualsReference(true, false, RopeScaling::kNone, Arch::kMistral);
  EXPECT_NE(qwen2, qwen3);
  EXPECT_NE(qwen2, mistral);
}
// rope_scaling (linear, llama3) as transformers applies it; each changes the loss, so it is applied.
TEST(LlamaModelTest, RopeScalingIsTransformersAndChangesTheModel) {
  const double plain = ExpectShardEqualsReference(false);
  const double linear = ExpectShardEqualsReference(false, false, RopeScaling::kLinear);
  const double llama3 = ExpectShardEqualsReference(false, false, RopeScaling::kLlama3);
  EXPECT_NE(linear, plain);
  EXPECT_NE(llama3, plain);
  EXPECT_NE(llama3, linear);
  // The frequencies themselves: kept, blended, divided.
  ModelSpec m = TinyLlama(false);
  m.rope_scaling = RopeScaling::kLlama3;
  m.rope_factor = 8;
  m.rope_original_positions = 64;
  const std::vector<float> inv = RopeInverseFrequencies(m);
  ASSERT_EQ(inv.size(), 4u);
  EXPECT_FLOAT_EQ(inv[0], 1.0f);
  const double wavelen = 2 * M_PI / 0.1, smooth = (64 / wavelen - 1) / 3;
  EXPECT_NEAR(inv[1], (1 - smooth) * 0.1 / 8 + smooth * 0.1, 1e-7);
  EXPECT_NEAR(inv[2], 0.01 / 8, 1e-9);
  EXPECT_NEAR(inv[3], 0.001 / 8, 1e-10);
}
TEST(LlamaModelTest, OneRankShardEqualsTheReferenceTied) { ExpectShardEqualsReference(true); }
// With fp32 parameters the stochastically rounded residual sums are the exact sums.
TEST(LlamaModelTest, OneRankShardWithStochasticResidualEqualsTheReferenceInFp32) {
  ExpectShardEqualsReference(false, /*stochastic_residual=*/true);
}

TEST(LlamaModelTest, ParametersFollowLlamaModelPy) {
  const ModelSpec m = TinyLlama(false);
  auto shapes = ModelParameterShapes(m);
  ASSERT_EQ(shapes.size(), 1u + 9 * 2 + 2);
  EXPECT_EQ(shapes[0].first, "tok_embeddings.weight");
  EXPECT_EQ(shapes[1].first, "layers.0.attn_norm.weight");
  EXPECT_EQ(shapes[3].first, "layers.0.wk.weight");
  EXPECT_EQ(shapes[3].second, (std::vector<int64_t>{16, 32}));  // 2 kv heads of width 8
  EXPECT_EQ(shapes[8].first, "layers.0.w3.weight");
  EXPECT_EQ(shapes[9].second, (std::vector<int64_t>{32, 48}));   // w2
  EXPECT_EQ(shapes[shapes.size() - 2].first, "norm.weight");
  EXPECT_EQ(shapes.back().first, "output.weight");
  int64_t count = 0;
  for (const auto& [name, shape] : shapes) count += torch::empty(shape).numel();
  EXPECT_EQ(ModelParameterCount(m), count);
  EXPECT_EQ(ApproxParameterCount(m), count);
  EXPECT_EQ(ModelParameterCount(TinyLlama(true)), count - 256 * 32);
  EXPECT_EQ(LayerOf("layers.12.wq.weight"), 12);
  EXPECT_EQ(LayerOf("norm.weight"), -1);

  ModelShardSpec spec;
  spec.config = m;
  spec.layout.stage_layers = {m.layers};
  spec.seed = 4;
  SelfCommunicator self;
  auto shard = ModelShard::Create(spec, &self);
  ASSERT_TRUE(shard.ok()) << shard.status().message();
  std::map<std::string, torch::Tensor> p;
  for (const ShardParam& sp : (*shard)->params()) p[sp.name] = sp.value;
  EXPECT_NEAR(p.at("layers.0.wq.weight").std().item<double>(), 0.02, 0.003);
  EXPECT_NEAR(p.at("tok_embeddings.weight").std().item<double>(), 0.02, 0.002);
  EXPECT_NEAR(p.at("layers.1.w2.weight").std().item<double>(), 0.02 / std::sqrt(4.0), 0.0015);
  EXPECT_TRUE(torch::equal(p.at("layers.1.ffn_norm.weight"), torch::ones({32})));
}

// Tensor-parallel slices: wq by heads, wk and wv by key/value heads when there are at least tp of
// them, whole (a partial gradient) when there are fewer; wo by columns; the head by vocabulary.
TEST(LlamaModelTest, TensorParallelSlicesSplitOrReplicateKeyValueHeads) {
  ModelShardSpec one;
  one.config = TinyLlama(false);
  one.layout.stage_layers = {one.config.layers};
  one.seed = 2;
  SelfCommunicator self;
  auto full = ModelShard::Create(one, &self);
  ASSERT_TRUE(full.ok()) << full.status().message();
  std::map<std::string, torch::Tensor> by_name;
  for (const ShardParam& p : (*full)->params()) by_name[p.name] = p.value;

  for (int tp : {2, 4}) {
    ModelShardSpec spec = one;
    spec.layout.tp = tp;
    spec.coords.tp = 1;
    FakeCommunicator comm;
    comm.SimulateSize(tp);
    auto shard = ModelShard::Create(spec, &comm);
    ASSERT_TRUE(shard.ok()) << shard.status().message();
    int checked = 0;
    for (const ShardParam& p : (*shard)->params()) {
      const torch::Tensor& whole = by_name.at(p.name);
      if (p.name == "layers.0.wq.weight" || p.name == "output.weight") {
        EXPECT_TRUE(torch::equal(p.value, whole.chunk(tp, 0)[1])) << p.name << " tp " << tp;
        ++checked;
      } else if (p.name == "layers.0.wk.weight") {
        if (tp == 2) {
          EXPECT_TRUE(torch::equal(p.value, whole.chunk(2, 0)[1])) << p.name;
          EXPECT_FALSE(p.tp_partial);
        } else {
          EXPECT_TRUE(torch::equal(p.value, whole)) << p.name;
          EXPECT_TRUE(p.tp_partial);
          EXPECT_FALSE(p.counts_for_norm);  // counted on tp rank 0 only
        }
        ++checked;
      } else if (p.name == "layers.1.wo.weight") {
        EXPECT_TRUE(torch::equal(p.value, whole.chunk(tp, 1)[1])) << p.name;
        ++checked;
      }
    }
    EXPECT_EQ(checked, 4) << "tp " << tp;
  }
}

}  // namespace
}  // namespace ltrain::worker
