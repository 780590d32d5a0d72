#include "common/model_family.h"

#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <set>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "common/hf_format.h"
#include "common/safetensors.h"

namespace ltrain {
namespace {

namespace fs = std::filesystem;

ModelSpec Small(Arch arch) {
  ModelSpec m;
  m.arch = arch;
  m.layers = 2;
  m.d_model = 64;
  m.heads = 4;
  m.kv_heads = 2;
  m.ffn = 96;
  m.vocab = 100;
  m.tie_embeddings = false;
  if (arch == Arch::kQwen3) m.head_dim = 32;
  return m;
}

// What each family adds to the Llama block, with transformers' names and shapes; the count the
// plan uses agrees with the list.
TEST(ModelFamilyTest, EachFamilyAddsItsParametersWithTransformersNames) {
  std::map<std::string, ModelParameter> qwen2;
  for (const ModelParameter& p : ModelParameters(Small(Arch::kQwen2))) qwen2[p.name] = p;
  ASSERT_TRUE(qwen2.count("layers.1.wq.bias"));
  EXPECT_EQ(qwen2["layers.1.wq.bias"].hf_name, "model.layers.1.self_attn.q_proj.bias");
  EXPECT_EQ(qwen2["layers.1.wq.bias"].shape, std::vector<int64_t>({64}));
  EXPECT_EQ(qwen2["layers.1.wk.bias"].shape, std::vector<int64_t>({32}));
  EXPECT_EQ(qwen2["layers.1.wv.bias"].hf_name, "model.layers.1.self_attn.v_proj.bias");
  EXPECT_FALSE(qwen2.count("layers.1.q_norm.weight"));

  std::map<std::string, ModelParameter> qwen3;
  for (const ModelParameter& p : ModelParameters(Small(Arch::kQwen3))) qwen3[p.name] = p;
  EXPECT_EQ(qwen3["layers.0.q_norm.weight"].hf_name, "model.layers.0.self_attn.q_norm.weight");
  EXPECT_EQ(qwen3["layers.0.k_norm.weight"].shape, std::vector<int64_t>({32}));
  EXPECT_EQ(qwen3["layers.0.wq.weight"].shape, std::vector<int64_t>({128, 64}));  // 4 heads of 32
  EXPECT_EQ(qwen3["layers.0.wk.weight"].shape, std::vector<int64_t>({64, 64}));   // 2 heads of 32
  EXPECT_EQ(qwen3["layers.0.wo.weight"].shape, std::vector<int64_t>({64, 128}));
  EXPECT_FALSE(qwen3.count("layers.0.wq.bias"));

  const std::vector<ModelParameter> llama = ModelParameters(Small(Arch::kLlama));
  const std::vector<ModelParameter> mistral = ModelParameters(Small(Arch::kMistral));
  ASSERT_EQ(llama.size(), mistral.size());
  for (size_t i = 0; i < llama.size(); ++i) EXPECT_EQ(llama[i].hf_name, mistral[i].hf_name);
  EXPECT_EQ(BlockParameterNames(Small(Arch::kQwen2), 0).size(), 12u);
  EXPECT_EQ(BlockParameterNames(Small(Arch::kQwen3), 0).size(), 11u);

  for (Arch arch : {Arch::kGpt2, Arch::kLlama, Arch::kMistral, Arch::kQwen2, Arch::kQwen3}) {
    ModelSpec m = Small(arch);
    if (arch == Arch::kGpt2) m = ModelSpec{};
    EXPECT_EQ(ApproxParameterCount(m), ModelParameterCount(m)) << NameOf(arch);
    EXPECT_EQ(FamilyOfHfArchitecture(FamilyOf(arch).hf_architecture), &FamilyOf(arch));
  }
  EXPECT_EQ(FamilyOfHfArchitecture("GemmaForCausalLM"), nullptr);
}

// A mixture of experts: its blocks (the pattern's) have a router and stacked experts in place of the
// MLP, transformers' names one an expert (Qwen3-MoE's for the Qwen families, Mixtral's for the Llama
// ones); all experts count in the parameters, top_k of them in the active ones.
TEST(ModelFamilyTest, MoeBlocksHaveARouterAndStackedExperts) {
  ModelSpec m = Small(Arch::kQwen3);
  m.layers = 4;
  m.moe.experts = 8;
  m.moe.top_k = 2;
  m.moe.ffn = 32;
  m.moe.first_dense = 1;
  m.moe.every = 1;
  m.moe.dense_layers = {3};
  m.moe.shared_experts = 1;
  EXPECT_FALSE(IsMoeLayer(m, 0));
  EXPECT_TRUE(IsMoeLayer(m, 1));
  EXPECT_TRUE(IsMoeLayer(m, 2));
  EXPECT_FALSE(IsMoeLayer(m, 3));
  const std::vector<std::string> dense = BlockParameterNames(m, 0), moe = BlockParameterNames(m, 1);
  EXPECT_NE(std::find(dense.begin(), dense.end(), "w1.weight"), dense.end());
  EXPECT_EQ(std::find(moe.begin(), moe.end(), "w1.weight"), moe.end());
  EXPECT_EQ(moe.size(), dense.size() - 3 + 4 + 3);
  std::map<std::string, ModelParameter> params;
  for (const ModelParameter& p : ModelParameters(m)) params[p.name] = p;
  ASSERT_TRUE(params.count("layers.1.experts.w1.weight"));
  EXPECT_EQ(params["layers.1.router.weight"].shape, std::vector<int64_t>({8, 64}));
  EXPECT_EQ(params["layers.1.router.weight"].hf_name, "model.layers.1.mlp.gate.weight");
  EXPECT_EQ(params["layers.1.experts.w1.weight"].shape, std::vector<int64_t>({8, 32, 64}));
  EXPECT_EQ(params["layers.1.experts.w2.weight"].shape, std::vector<int64_t>({8, 64, 32}));
  EXPECT_EQ(params["layers.1.experts.w2.weight"].hf_experts, 8);
  EXPECT_EQ(HfExpertName(params["layers.1.experts.w2.weight"].hf_name, 5), "model.layers.1.mlp.experts.5.down_proj.weight");
  EXPECT_EQ(params["layers.2.shared.w2.weight"].shape, std::vector<int64_t>({64, 32}));
  EXPECT_FALSE(params.count("layers.3.router.weight"));
  EXPECT_TRUE(params.count("layers.3.w1.weight"));

  ModelSpec mixtral = m;
  mixtral.arch = Arch::kMistral;
  mixtral.head_dim = 0;
  for (const ModelParameter& p : ModelParameters(mixtral)) params[p.name] = p;
  EXPECT_EQ(HfExpertName(params["layers.2.experts.w3.weight"].hf_name, 0), "model.layers.2.block_sparse_moe.experts.0.w3.weight");
  EXPECT_EQ(params["layers.2.router.weight"].hf_name, "model.layers.2.block_sparse_moe.gate.weight");

  EXPECT_EQ(ApproxParameterCount(m), ModelParameterCount(m));
  // Two MoE blocks of which a token runs through 2 of 8 experts: 6 experts' SwiGLUs (3 * 32 * 64) each idle.
  EXPECT_EQ(ApproxParameterCount(m) - ActiveParameterCount(m), 2 * 6 * 3 * 32 * 64);
  ModelSpec dense_model = Small(Arch::kQwen3);
  EXPECT_EQ(ActiveParameterCount(dense_model), ApproxParameterCount(dense_model));

  ModelSpec other = m;
  other.moe.experts = 4;
  EXPECT_NE(ModelShapeDifferences(m, other).find("model.moe.experts 8 (this recipe: 4)"), std::string::npos);
  other = m;
  other.moe.first_dense = 0;
  EXPECT_NE(ModelShapeDifferences(m, other).find("model.moe blocks [1,2] (this recipe: [0,1,2])"), std::string::npos);
  EXPECT_EQ(ModelShapeDifferences(m, m), "");
}

class HfTensorsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("ltrain_hf_tensors_test_" + std::to_string(::getpid()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  // model.safetensors with `entries` (zeros).
  void Write(std::vector<SafetensorsEntry> entries) {
    for (SafetensorsEntry& e : entries) {
      int64_t n = 1;
      for (int64_t s : e.shape) n *= s;
      e.bytes = static_cast<uint64_t>(n) * SafetensorsDtypeSize(e.dtype);
    }
    auto writer = SafetensorsWriter::Create((dir_ / "model.safetensors").string(), entries);
    ASSERT_TRUE(writer.ok()) << writer.status().ToString();
    for (const SafetensorsEntry& e : entries) {
      const std::vector<char> zeros(e.bytes, 0);
      ASSERT_TRUE((*writer)->Write(zeros.data(), zeros.size()).ok());
    }
    ASSERT_TRUE((*writer)->Finish().ok());
  }

  fs::path dir_;
};

// The imported tensors are checked against the model before any is read: each missing tensor, wrong
// shape, unreadable dtype and tensor the model would ignore is named, all at once.
TEST_F(HfTensorsTest, EveryMismatchIsNamed) {
  const ModelSpec m = Small(Arch::kQwen2);
  std::vector<SafetensorsEntry> entries;
  for (const ModelParameter& p : ModelParameters(m)) entries.push_back({p.hf_name, "BF16", p.shape});
  Write(entries);
  EXPECT_TRUE(CheckHfTensors(dir_.string(), m).ok()) << CheckHfTensors(dir_.string(), m).ToString();

  std::vector<SafetensorsEntry> wrong;
  for (SafetensorsEntry e : entries) {
    if (e.name == "model.layers.0.self_attn.q_proj.bias") continue;                     // missing
    if (e.name == "model.layers.1.mlp.up_proj.weight") e.shape = {95, 64};              // wrong shape
    if (e.name == "model.norm.weight") e.dtype = "I32";                                 // wrong dtype
    wrong.push_back(e);
  }
  wrong.push_back({"model.layers.0.self_attn.q_norm.weight", "F32", {16}});             // another family's
  wrong.push_back({"model.layers.0.self_attn.rotary_emb.inv_freq", "F32", {8}});        // derived: fine
  Write(wrong);
  const Status s = CheckHfTensors(dir_.string(), m);
  ASSERT_FALSE(s.ok());
  const std::string text = s.message();
  EXPECT_NE(text.find("(4 mismatches)"), std::string::npos) << text;
  EXPECT_NE(text.find("model.layers.0.self_attn.q_proj.bias is missing"), std::string::npos) << text;
  EXPECT_NE(text.find("model.layers.1.mlp.up_proj.weight is [95, 64], the model needs [96, 64]"), std::string::npos)
      << text;
  EXPECT_NE(text.find("model.norm.weight is I32"), std::string::npos) << text;
  EXPECT_NE(text.find("model.layers.0.self_attn.q_norm.weight is not a parameter of the model"), std::string::npos)
      << text;
  EXPECT_EQ(text.find("inv_freq"), std::string::npos) << text;
}

}  // namespace
}  // namespace ltrain
