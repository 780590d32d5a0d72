#include "worker/model/gpt_model.h"

#include <cmath>
#include <map>
#include <string>

#include <gtest/gtest.h>
#include <torch/cuda.h>
#include <torch/nn.h>

#include "worker/comm/communicator.h"
#include "worker/model/parallel_model.h"

namespace ltrain::worker {
namespace {

GptConfig Tiny() { return GptConfig{/*layers=*/2, /*d_model=*/32, /*heads=*/4, /*seq_len=*/16, /*vocab=*/256}; }

ModelSpec TinySpec() {
  ModelSpec m;
  m.layers = 2;
  m.d_model = 32;
  m.heads = 4;
  m.seq_len = 16;
  m.vocab = 256;
  return m;
}

TEST(GptModelTest, InitialLossIsNearLnVocab) {
  torch::manual_seed(1);
  Gpt model(Tiny());
  torch::Tensor idx = torch::randint(0, 256, {4, 16}, torch::kLong);
  torch::Tensor targets = torch::randint(0, 256, {4, 16}, torch::kLong);
  torch::Tensor loss = model->forward(idx, targets);
  EXPECT_EQ(loss.scalar_type(), torch::kFloat);
  const double value = loss.item<double>();
  EXPECT_TRUE(std::isfinite(value));
  EXPECT_NEAR(value, std::log(256.0), 0.1);
}

TEST(GptModelTest, ParametersMatchThePythonModel) {
  torch::manual_seed(1);
  Gpt model(Tiny());
  // wte 256*32, wpe 16*32, per block: 2 LN (2*2*32) + qkv 32*96+96 + proj 32*32+32 + fc 32*128+128
  // + fc2 128*32+32; lnf 2*32. The head is tied: no parameter of its own.
  const int64_t block = 4 * 32 + (32 * 96 + 96) + (32 * 32 + 32) + (32 * 128 + 128) + (128 * 32 + 32);
  EXPECT_EQ(model->NumParameters(), 256 * 32 + 16 * 32 + 2 * block + 2 * 32);
  std::vector<std::string> names;
  for (const auto& p : model->named_parameters()) names.push_back(p.key());
  ASSERT_FALSE(names.empty());
  EXPECT_EQ(names.front(), "wte.weight");
  EXPECT_EQ(names[1], "wpe.weight");
  EXPECT_EQ(names[2], "blocks.0.ln1.weight");
  EXPECT_EQ(names.back(), "lnf.bias");

  auto params = model->named_parameters();
  const double residual_std = 0.02 / std::sqrt(4.0);
  EXPECT_NEAR(params["blocks.0.fc2.weight"].std().item<double>(), residual_std, residual_std * 0.1);
  EXPECT_NEAR(params["blocks.1.proj.weight"].std().item<double>(), residual_std, residual_std * 0.15);
  EXPECT_NEAR(params["blocks.0.fc.weight"].std().item<double>(), 0.02, 0.002);
  EXPECT_NEAR(params["wte.weight"].std().item<double>(), 0.02, 0.002);
  EXPECT_EQ(params["blocks.0.qkv.bias"].abs().max().item<double>(), 0.0);
  EXPECT_EQ(params["lnf.weight"].min().item<double>(), 1.0);
}

TEST(GptModelTest, SameSeedSameModelAndAttentionIsCausal) {
  torch::manual_seed(7);
  Gpt a(Tiny());
  torch::manual_seed(7);
  Gpt b(Tiny());
  auto pa = a->parameters(), pb = b->parameters();
  for (size_t i = 0; i < pa.size(); ++i) EXPECT_TRUE(torch::equal(pa[i], pb[i]));

  // Changing a later token must not change earlier logits.
  torch::NoGradGuard no_grad;
  torch::Tensor idx = torch::randint(0, 256, {1, 16}, torch::kLong);
  torch::Tensor changed = idx.clone();
  changed[0][10] = (changed[0][10].item<int64_t>() + 1) % 256;
  torch::Tensor la = a->Logits(idx), lb = a->Logits(changed);
  EXPECT_TRUE(torch::allclose(la.narrow(1, 0, 10), lb.narrow(1, 0, 10)));
  EXPECT_FALSE(torch::allclose(la.narrow(1, 10, 1), lb.narrow(1, 10, 1)));
}

// The parallel runtime's model on one rank (the functional ModelShard: fused q/k/v head split,
// MLP) computes what the module does: the same loss and the same gradients.
TEST(GptModelTest, OneRankShardEqualsTheModule) {
  ModelShardSpec spec;
  spec.config = TinySpec();
  spec.layout.stage_layers = {spec.config.layers};
  SelfCommunicator self;
  torch::manual_seed(5);
  auto shard = ModelShard::Create(spec, &self);
  ASSERT_TRUE(shard.ok()) << shard.status().message();
  torch::manual_seed(5);
  Gpt module(Tiny());

  torch::manual_seed(6);
  torch::Tensor idx = torch::randint(0, 256, {3, 16}, torch::kLong);
  torch::Tensor targets = torch::randint(0, 256, {3, 16}, torch::kLong);
  torch::Tensor loss_shard = (*shard)->Forward(0, idx, targets);
  torch::Tensor loss_module = module->forward(idx, targets);
  EXPECT_NEAR(loss_shard.item<double>(), loss_module.item<double>(), 1e-5);
  loss_shard.backward();
  loss_module.backward();
  auto module_params = module->named_parameters();
  int compared = 0;
  for (const ShardParam& p : (*shard)->params()) {
    const torch::Tensor& want = module_params[p.name].grad();
    ASSERT_TRUE(p.value.grad().defined()) << p.name;
    EXPECT_TRUE(torch::allclose(p.value.grad(), want, 1e-4, 1e-6)) << p.name;
    ++compared;
  }
  EXPECT_EQ(compared, static_cast<int>(module_params.size()));
}

// Supervised fine-tuning: with masked targets (-100 at the prompt's positions) the loss is the mean
// cross-entropy of the response's positions alone; the prompt's positions
// add no term and no gradient (a batch of prompt only has loss 0 and gradient 0), and what the
// prompt's tokens still change is the context the response's positions see.
TEST(GptModelTest, MaskedTargetsCountTheResponseOnly) {
  torch::manual_seed(9);
  const torch::Tensor idx = torch::randint(0, 256, {2, 16}, torch::kLong);
  torch::Tensor targets = torch::randint(0, 256, {2, 16}, torch::kLong);
  torch::Tensor masked = targets.clone();
  masked.index_put_({torch::indexing::Slice(), torch::indexing::Slice(0, 6)}, -100);  // the prompt
  auto make = [](Communicator* comm) {
    ModelShardSpec spec;
    spec.config = TinySpec();
    spec.layout.stage_layers = {spec.config.layers};
    torch::manual_seed(5);
    auto shard = ModelShard::Create(spec, comm);
    EXPECT_TRUE(shard.ok()) << shard.status().message();
    (*shard)->set_masked_targets(true);
    return std::move(shard).value();
  };
  SelfCommunicator self;
  auto shard = make(&self);
  // By hand: the response positions' cross-entropy from the model's logits.
  torch::Tensor logp = torch::log_softmax(shard->Logits(idx).detach(), -1);
  torch::Tensor picked = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1);
  const double want = -picked.index({torch::indexing::Slice(), torch::indexing::Slice(6, 16)}).mean().item<double>();
  torch::Tensor loss = shard->Forward(0, idx, masked);
  EXPECT_NEAR(loss.item<double>(), want, 1e-5);
  // The module's cross-entropy skips -100 the same way.
  torch::manual_seed(5);
  Gpt module(Tiny());
  EXPECT_NEAR(module->forward(idx, masked).item<double>(), want, 1e-5);

  // Prompt only: nothing to learn.
  auto fresh = make(&self);
  torch::Tensor none = fresh->Forward(0, idx, torch::full({2, 16}, -100, torch::kLong));
  EXPECT_EQ(none.item<double>(), 0.0);
  none.backward();
  for (const ShardParam& p : fresh->params()) {
    if (p.value.grad().defined()) {
      EXPECT_EQ(p.value.grad().abs().max().item<double>(), 0.0) << p.name;
    }
  }
  // Another prompt changes the response positions' context, so their loss; the targets stay masked.
  torch::Tensor other = idx.clone();
  other.index_put_({torch::indexing::Slice(), torch::indexing::Slice(0, 6)}, 7);
  EXPECT_NE(make(&self)->Forward(0, other, masked).item<double>(), loss.item<double>());
}

// One forward and backward of TinySpec's shard (the generator seeded with 5 to build it, then with
// `noise_seed`): the loss and every parameter's gradient in fp32; the stream's dtype after each unit
// (the embedding and every block) goes into `stream`.
std::vector<torch::Tensor> RunTinyShard(const torch::Tensor& idx, const torch::Tensor& targets, bool bf16,
                                        bool fp32_residual, bool stochastic_residual, uint64_t noise_seed,
                                        std::vector<torch::ScalarType>* stream) {
  SelfCommunicator self;
  ModelShardSpec spec;
  spec.config = TinySpec();
  spec.layout.stage_layers = {spec.config.layers};
  spec.fp32_residual = fp32_residual;
  spec.stochastic_residual = stochastic_residual;
  torch::manual_seed(5);
  auto shard = ModelShard::Create(spec, &self);
  EXPECT_TRUE(shard.ok()) << shard.status().message();
  if (!shard.ok()) return {};
  if (bf16) {
    for (ShardParam& p : (*shard)->params()) p.value = p.value.detach().to(torch::kBFloat16).requires_grad_(true);
  }
  UnitHooks hooks;
  hooks.output = [stream](int /*unit*/, torch::Tensor& out) { stream->push_back(out.scalar_type()); };
  (*shard)->set_hooks(hooks);
  torch::manual_seed(noise_seed);
  torch::Tensor loss = (*shard)->Forward(0, idx, targets);
  loss.backward();
  std::vector<torch::Tensor> out = {loss.detach().to(torch::kFloat)};
  for (const ShardParam& p : (*shard)->params()) out.push_back(p.value.grad().to(torch::kFloat));
  return out;
}

// The loss and gradients of `got` follow `want`'s as bf16 rounding allows.
void ExpectNearTheFp32Model(const std::vector<torch::Tensor>& got, const std::vector<torch::Tensor>& want) {
  ASSERT_EQ(got.size(), want.size());
  ASSERT_FALSE(want.empty());
  EXPECT_NEAR(got[0].item<double>(), want[0].item<double>(), 0.01 * want[0].item<double>());
  for (size_t i = 1; i < want.size(); ++i) {
    const double scale = want[i].abs().max().item<double>();
    EXPECT_LE((got[i] - want[i]).abs().max().item<double>(), 0.05 * scale + 1e-6) << i;
  }
}

// With bf16 parameters and spec.fp32_residual, the residual stream (the embedding's and every block's
// output) is fp32, the products and the norms' outputs bf16, and the loss and the gradients follow the
// fp32 model's as bf16 rounding allows; without it the stream is bf16.
TEST(GptModelTest, Fp32ResidualStreamWithBf16Parameters) {
  torch::manual_seed(6);
  torch::Tensor idx = torch::randint(0, 256, {3, 16}, torch::kLong);
  torch::Tensor targets = torch::randint(0, 256, {3, 16}, torch::kLong);
  std::vector<torch::ScalarType> fp32_stream, mixed_stream, bf16_stream;
  std::vector<torch::Tensor> fp32 = RunTinyShard(idx, targets, false, false, false, 1, &fp32_stream);
  std::vector<torch::Tensor> mixed = RunTinyShard(idx, targets, true, true, false, 1, &mixed_stream);
  RunTinyShard(idx, targets, true, false, false, 1, &bf16_stream);
  ASSERT_EQ(mixed_stream.size(), 3u);  // the embedding and two blocks
  for (torch::ScalarType t : mixed_stream) EXPECT_EQ(t, torch::kFloat);
  for (torch::ScalarType t : bf16_stream) EXPECT_EQ(t, torch::kBFloat16);
  ExpectNearTheFp32Model(mixed, fp32);
}

// A sum below half the stream's last bit: rounded to nearest it is lost; stochastically it is kept on
// average, each value one of the two bf16 neighbours. Sums bf16 holds stay exact; the gradient
// reaches both inputs unchanged.
TEST(GptModelTest, StochasticRoundedAddIsUnbiased) {
  torch::manual_seed(3);
  const int64_t n = 200000;
  const double small = std::ldexp(1.0, -10);  // an eighth of bf16's step at 1 (2^-7)
  for (double sign : {1.0, -1.0}) {
    torch::Tensor x = torch::full({n}, sign, torch::kBFloat16).requires_grad_(true);
    torch::Tensor branch = torch::full({n}, sign * small, torch::kBFloat16).requires_grad_(true);
    torch::Tensor y = StochasticRoundedAdd(x, branch);
    ASSERT_EQ(y.scalar_type(), torch::kBFloat16);
    torch::Tensor yf = y.detach().to(torch::kDouble);
    const double up = sign * (1.0 + std::ldexp(1.0, -7));
    EXPECT_TRUE(((yf == sign) | (yf == up)).all().item<bool>()) << sign;
    const double share_up = (yf == up).to(torch::kDouble).mean().item<double>();
    EXPECT_NEAR(share_up, 0.125, 0.005) << sign;
    EXPECT_NEAR(yf.mean().item<double>(), sign * (1.0 + small), 2e-5) << sign;
    y.sum().backward();
    EXPECT_TRUE(torch::equal(x.grad(), torch::ones_like(x))) << sign;
    EXPECT_TRUE(torch::equal(branch.grad(), torch::ones_like(branch))) << sign;
  }
  torch::Tensor exact = StochasticRoundedAdd(torch::ones({1000}, torch::kBFloat16),
                                             torch::full({1000}, std::ldexp(1.0, -7), torch::kBFloat16));
  EXPECT_TRUE(torch::equal(exact.to(torch::kDouble), torch::full({1000}, 1.0 + std::ldexp(1.0, -7), torch::kDouble)));
}

// Under stochastic_residual with bf16 parameters the stream stays bf16, its sums draw noise (two runs
// of the same batch part), and loss and gradients follow the fp32 model's.
TEST(GptModelTest, StochasticResidualKeepsABf16StreamNearTheFp32Model) {
  torch::manual_seed(6);
  torch::Tensor idx = torch::randint(0, 256, {3, 16}, torch::kLong);
  torch::Tensor targets = torch::randint(0, 256, {3, 16}, torch::kLong);
  std::vector<torch::ScalarType> fp32_stream, sr_stream, sr_again_stream;
  std::vector<torch::Tensor> fp32 = RunTinyShard(idx, targets, false, false, false, 1, &fp32_stream);
  std::vector<torch::Tensor> sr = RunTinyShard(idx, targets, true, false, true, 1, &sr_stream);
  std::vector<torch::Tensor> sr_again = RunTinyShard(idx, targets, true, false, true, 2, &sr_again_stream);
  ASSERT_EQ(sr_stream.size(), 3u);  // the embedding and two blocks
  for (torch::ScalarType t : sr_stream) EXPECT_EQ(t, torch::kBFloat16);
  ASSERT_FALSE(sr.empty() || sr_again.empty());
  EXPECT_NE(sr[0].item<float>(), sr_again[0].item<float>());
  ExpectNearTheFp32Model(sr, fp32);
}

// ModelParameterShapes lists the module's parameters in its order.
TEST(GptModelTest, ParameterShapesFollowTheModule) {
  Gpt module(Tiny());
  auto shapes = ModelParameterShapes(TinySpec());
  auto params = module->named_parameters();
  ASSERT_EQ(shapes.size(), params.size());
  int64_t count = 0;
  for (size_t i = 0; i < shapes.size(); ++i) {
    EXPECT_EQ(shapes[i].first, params[i].key());
    EXPECT_EQ(shapes[i].second, params[i].value().sizes().vec()) << shapes[i].first;
    count += params[i].value().numel();
  }
  EXPECT_EQ(ModelParameterCount(TinySpec()), count);
  EXPECT_EQ(ApproxParameterCount(TinySpec()), count);
}

// Per-parameter initialisation: the distributions of PyTorch's, values of its own, and a tensor-
// parallel rank's slices are slices of the one-rank parameters.
TEST(GptModelTest, PerParameterInitSlicesTheSameParameters) {
  ModelShardSpec one;
  one.config = TinySpec();
  one.layout.stage_layers = {one.config.layers};
  one.per_parameter_init = true;
  one.seed = 3;
  SelfCommunicator self;
  auto full = ModelShard::Create(one, &self);
  ASSERT_TRUE(full.ok()) << full.status().message();
  torch::manual_seed(3);
  auto pytorch = ModelShard::Create([&] { ModelShardSpec l = one; l.per_parameter_init = false; return l; }(), &self);
  ASSERT_TRUE(pytorch.ok());
  std::map<std::string, torch::Tensor> by_name;
  for (const ShardParam& p : (*full)->params()) by_name[p.name] = p.value;
  const auto& qkv = by_name.at("blocks.0.qkv.weight");
  EXPECT_NEAR(qkv.std().item<double>(), 0.02, 0.002);
  EXPECT_NEAR(by_name.at("blocks.1.fc2.weight").std().item<double>(), 0.02 / std::sqrt(2.0 * Tiny().layers), 0.001);
  EXPECT_TRUE(torch::equal(by_name.at("blocks.0.ln1.weight"), torch::ones({Tiny().d_model})));
  EXPECT_TRUE(torch::equal(by_name.at("blocks.0.qkv.bias"), torch::zeros({3 * Tiny().d_model})));
  EXPECT_FALSE(torch::equal(by_name.at("blocks.0.fc.weight"), by_name.at("blocks.1.fc.weight")));
  int seen = 0;
  for (const ShardParam& p : (*pytorch)->params()) {
    if (p.name == "blocks.0.qkv.weight") {
      EXPECT_FALSE(torch::equal(p.value, qkv));
      ++seen;
    }
  }
  EXPECT_EQ(seen, 1);

  // Rank 1 of tp 2: the second half of fc's rows (column-parallel) and of fc2's columns.
  ModelShardSpec tp = one;
  tp.layout.tp = 2;
  tp.coords.tp = 1;
  FakeCommunicator two;
  two.SimulateSize(2);
  auto half = ModelShard::Create(tp, &two);
  ASSERT_TRUE(half.ok()) << half.status().message();
  int compared = 0;
  for (const ShardParam& p : (*half)->params()) {
    if (p.name == "blocks.1.fc.weight") {
      EXPECT_TRUE(torch::equal(p.value, by_name.at(p.name).chunk(2, 0)[1])) << p.name;
      ++compared;
    } else if (p.name == "blocks.1.fc2.weight") {
      EXPECT_TRUE(torch::equal(p.value, by_name.at(p.name).chunk(2, 1)[1])) << p.name;
      ++compared;
    }
  }
  EXPECT_EQ(compared, 2);
}

// spec.tp_split_batch: a tp rank's shard of a GPT and of a Llama (against a fake group of 2 ranks
// holding the same tensors, whose all-reduce doubles) gives the loss and gradients of the whole
// micro-batch with it in two halves, and sums the halves' branches apart (half-batch all-reduces,
// none without the halves). On a GPU, with bf16 parameters and an fp32 stream, through our products,
// the halves' sums run on the side stream; their order with the current stream is the subject of
// FusedKernelsTest.SideStreamSumIsOrderedWithTheCurrentStreamBothWays (on tensors this small a
// missing wait goes unseen here).
TEST(GptModelTest, TpHalvesGiveTheWholeBatchsLossAndGradients) {
  ModelSpec llama = TinySpec();
  llama.arch = Arch::kLlama;
  llama.kv_heads = 2;
  llama.ffn = 48;
  llama.rope_theta = 10000;
  for (const auto& [config, gpu] : {std::pair{TinySpec(), false}, std::pair{llama, false}, std::pair{TinySpec(), true},
                                    std::pair{llama, true}}) {
    if (gpu && !torch::cuda::is_available()) continue;
    const std::string what = std::string(config.arch == Arch::kLlama ? "llama" : "gpt") + (gpu ? " on a GPU" : "");
    const torch::Device device = gpu ? torch::Device(torch::kCUDA) : torch::Device(torch::kCPU);
    torch::manual_seed(8);
    const torch::Tensor idx = torch::randint(0, 256, {4, 16}, torch::kLong).to(device);
    const torch::Tensor targets = torch::randint(0, 256, {4, 16}, torch::kLong).to(device);
    auto run = [&](bool split, FakeCommunicator* tp) {
      tp->SimulateSize(2);
      ModelShardSpec spec;
      spec.config = config;
      spec.layout.tp = 2;
      spec.layout.world_size = 2;
      spec.layout.stage_layers = {spec.config.layers};
      spec.device = device;
      spec.fp32_residual = gpu;
      spec.tp_split_batch = split;
      torch::manual_seed(5);
      auto shard = ModelShard::Create(spec, tp);
      EXPECT_TRUE(shard.ok()) << shard.status().message();
      if (!shard.ok()) return std::vector<torch::Tensor>{};
      for (ShardParam& p : (*shard)->params()) {
        p.value = p.value.detach().to(device, gpu ? torch::kBFloat16 : torch::kFloat).requires_grad_(true);
      }
      torch::Tensor loss = (*shard)->Forward(0, idx, targets);
      loss.backward();
      std::vector<torch::Tensor> out = {loss.detach().to(torch::kFloat)};
      for (const ShardParam& p : (*shard)->params()) out.push_back(p.value.grad().to(torch::kFloat));
      return out;
    };
    FakeCommunicator whole_tp, halves_tp;
    const std::vector<torch::Tensor> whole = run(false, &whole_tp), halves = run(true, &halves_tp);
    ASSERT_EQ(halves.size(), whole.size());
    ASSERT_FALSE(whole.empty());
    const double loss_tolerance = gpu ? 0.01 : 1e-5, grad_tolerance = gpu ? 0.03 : 1e-4;
    EXPECT_NEAR(halves[0].item<double>(), whole[0].item<double>(), loss_tolerance * whole[0].item<double>()) << what;
    for (size_t i = 1; i < whole.size(); ++i) {
      const double scale = whole[i].abs().max().item<double>();
      EXPECT_LE((halves[i] - whole[i]).abs().max().item<double>(), grad_tolerance * scale + 1e-7) << what << " " << i;
    }
    // A half's block output: 2 sequences of 16 positions, 32 wide.
    auto half_sums = [](const FakeCommunicator& tp) {
      int n = 0;
      for (const FakeCommunicator::Call& c : tp.log()) n += c.op == "all_reduce" && c.numel == 2 * 16 * 32;
      return n;
    };
    EXPECT_EQ(half_sums(whole_tp), 0) << what;
    EXPECT_GE(half_sums(halves_tp), 2 * 2 * config.layers) << what;  // two branches of two halves a block
  }
}

}  // namespace
}  // namespace ltrain::worker
