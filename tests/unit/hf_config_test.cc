#include "common/hf_config.h"

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "common/hf_format.h"
#include "common/model_family.h"
#include "common/recipe_schema.h"

namespace ltrain {
namespace {

namespace fs = std::filesystem;

// Llama-3.2-1B's config.json as the Hub has it.
constexpr const char* kLlama32 = R"({
  "architectures": ["LlamaForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
  "bos_token_id": 128000, "eos_token_id": 128001, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2048,
  "initializer_range": 0.02, "intermediate_size": 8192, "max_position_embeddings": 131072, "mlp_bias": false,
  "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8,
  "pretraining_tp": 1, "rms_norm_eps": 1e-05,
  "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                   "original_max_position_embeddings": 8192, "rope_type": "llama3"},
  "rope_theta": 500000.0, "tie_word_embeddings": true, "torch_dtype": "bfloat16", "transformers_version": "4.45.0.dev0",
  "use_cache": true, "vocab_size": 128256})";

class HfConfigTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("ltrain_hf_config_test_" + std::to_string(::getpid()) + "_" +
                                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_ / "model");
  }
  void TearDown() override { fs::remove_all(dir_); }

  // The recipe `model_keys` (inside model: {...}) with init_from the directory holding `config`.
  RecipeParseResult Load(const std::string& config, const std::string& model_keys = "") {
    std::ofstream(dir_ / "model" / "config.json") << config;
    const std::string recipe = (dir_ / "r.yaml").string();
    std::ofstream(recipe) << "model: {init_from: " << (dir_ / "model").string()
                          << (model_keys.empty() ? "" : ", " + model_keys) << "}\ndata: {path: /d}\n";
    return LoadRecipeFile(recipe);
  }

  // kLlama32 with `key` set to `value` (JSON), or removed where `value` is empty.
  static std::string Llama32With(const std::string& key, const std::string& value) {
    std::string config = kLlama32;
    const std::string quoted = "\"" + key + "\": ";
    const size_t at = config.find(quoted);
    if (at == std::string::npos) return config.substr(0, config.size() - 1) + ", " + quoted + value + "}";
    size_t end = at + quoted.size();
    if (value.empty()) {  // removed, with the ", " after it
      const size_t next = config.find(", \"", end);
      return config.substr(0, at) + config.substr(next + 2);
    }
    int depth = 0;
    for (; end < config.size(); ++end) {
      const char c = config[end];
      if (c == '{' || c == '[') ++depth;
      if (c == '}' || c == ']') {
        if (depth == 0) break;
        --depth;
      }
      if (c == ',' && depth == 0) break;
    }
    return config.substr(0, at) + quoted + value + config.substr(end);
  }

  fs::path dir_;
};

// A recipe of init_from alone takes the model from config.json, Llama 3.2's RoPE scaling included,
// and says so when written back.
TEST_F(HfConfigTest, TheModelSectionComesFromConfigJson) {
  RecipeParseResult parsed = Load(kLlama32, "seq_len: 2048");
  ASSERT_TRUE(parsed.ok()) << parsed.ErrorText();
  const ModelSpec& m = parsed.recipe.model;
  EXPECT_EQ(m.arch, Arch::kLlama);
  EXPECT_EQ(m.layers, 16);
  EXPECT_EQ(m.d_model, 2048);
  EXPECT_EQ(m.heads, 32);
  EXPECT_EQ(m.kv_heads, 8);
  EXPECT_EQ(m.ffn, 8192);
  EXPECT_EQ(m.vocab, 128256);
  EXPECT_EQ(m.rope_theta, 500000);
  EXPECT_EQ(m.norm_eps, 1e-5);
  EXPECT_TRUE(m.tie_embeddings);
  EXPECT_EQ(m.seq_len, 2048);
  EXPECT_EQ(m.rope_scaling, RopeScaling::kLlama3);
  EXPECT_EQ(m.rope_factor, 32);
  EXPECT_EQ(m.rope_low_freq_factor, 1);
  EXPECT_EQ(m.rope_high_freq_factor, 4);
  EXPECT_EQ(m.rope_original_positions, 8192);
  const std::string yaml = RecipeToYaml(parsed.recipe);
  EXPECT_NE(yaml.find("rope_scaling: llama3"), std::string::npos) << yaml;
  EXPECT_NE(yaml.find("rope_factor: 32"), std::string::npos) << yaml;
  EXPECT_TRUE(parsed.notes.empty());
  // A key the recipe sets to the configuration's value is fine.
  EXPECT_TRUE(Load(kLlama32, "heads: 32, arch: llama").ok());
}

TEST_F(HfConfigTest, ARecipeKeyThatContradictsTheConfigurationIsRefusedNamingBoth) {
  RecipeParseResult parsed = Load(kLlama32, "heads: 16");
  ASSERT_FALSE(parsed.ok());
  EXPECT_NE(parsed.ErrorText().find("model.heads=16 but " + (dir_ / "model" / "config.json").string() + " gives 32"),
            std::string::npos)
      << parsed.ErrorText();
}

// Each configuration key that would change the numerics in a way ltrain does not implement is
// refused, naming it.
TEST_F(HfConfigTest, UnsupportedConfigurationKeysAreRefusedNamingTheKey) {
  struct Case {
    std::string key, value, model_keys, message;
  };
  const std::vector<Case> cases = {
      {"rope_scaling", R"({"rope_type": "yarn", "factor": 4.0})", "", "rope_scaling.rope_type 'yarn' is not supported"},
      {"rope_scaling", R"({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1, "high_freq_factor": 4,
        "original_max_position_embeddings": 8192, "beta": 2})", "", "rope_scaling.beta is not a key"},
      {"rope_scaling", R"({"rope_type": "llama3", "factor": 8.0})", "", "rope_scaling.low_freq_factor is missing"},
      {"architectures", R"(["GemmaForCausalLM"])", "", "architectures names GemmaForCausalLM"},
      {"attention_bias", "true", "", "attention_bias true is not supported"},
      {"mlp_bias", "true", "", "mlp_bias true is not supported"},
      {"hidden_act", R"("gelu")", "", "hidden_act 'gelu' is not supported"},
      {"head_dim", "63", "", "head_dim=63 must be even"},
      {"rope_parameters", R"({"rope_type": "default", "rope_theta": 10000, "partial_rotary_factor": 0.5})", "",
       "rope_scaling is given beside rope_parameters"},
      {"layer_types", R"(["full_attention", "chunked_attention"])", "", "layer_types names 'chunked_attention'"},
      {"pretraining_tp", "2", "", "pretraining_tp=2 is not supported"},
      {"max_position_embeddings", "1024", "seq_len: 2048", "max_position_embeddings=1024 is smaller than"},
      {"sliding_window", "4096", "seq_len: 8192", "sliding_window=4096 is smaller than model.seq_len=8192"},
      {"hidden_size", "", "", "hidden_size is missing"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.key + " " + c.value);
    RecipeParseResult parsed = Load(Llama32With(c.key, c.value), c.model_keys);
    ASSERT_FALSE(parsed.ok());
    EXPECT_NE(parsed.ErrorText().find(c.message), std::string::npos) << parsed.ErrorText();
    EXPECT_NE(parsed.ErrorText().find("config.json"), std::string::npos) << parsed.ErrorText();
  }
  // A window that covers every position is plain attention: Mistral at its window is a Llama.
  RecipeParseResult mistral = Load(Llama32With("sliding_window", "4096"), "seq_len: 4096");
  EXPECT_TRUE(mistral.ok()) << mistral.ErrorText();
}

// Qwen2.5-0.5B's and Qwen3-0.6B's config.json as the Hub has them.
constexpr const char* kQwen25 = R"({
  "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151643,
  "hidden_act": "silu", "hidden_size": 896, "initializer_range": 0.02, "intermediate_size": 4864,
  "max_position_embeddings": 32768, "max_window_layers": 24, "model_type": "qwen2", "num_attention_heads": 14,
  "num_hidden_layers": 24, "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
  "sliding_window": 32768, "tie_word_embeddings": true, "torch_dtype": "bfloat16", "transformers_version": "4.40.1",
  "use_cache": true, "use_sliding_window": false, "vocab_size": 151936})";
constexpr const char* kQwen3 = R"({
  "architectures": ["Qwen3ForCausalLM"], "attention_bias": false, "attention_dropout": 0.0, "bos_token_id": 151643,
  "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 1024, "initializer_range": 0.02,
  "intermediate_size": 3072, "max_position_embeddings": 40960, "max_window_layers": 28, "model_type": "qwen3",
  "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
  "rope_scaling": null, "rope_theta": 1000000, "sliding_window": null, "tie_word_embeddings": true,
  "torch_dtype": "bfloat16", "transformers_version": "4.51.0", "use_cache": true, "use_sliding_window": false,
  "vocab_size": 151936})";

// The Qwen families come in as themselves: Qwen2's biases and Qwen3's per-head norms follow from
// model.arch, Qwen3's heads wider than hidden_size/heads from head_dim.
TEST_F(HfConfigTest, QwenConfigurationsGiveTheirFamilies) {
  RecipeParseResult qwen2 = Load(kQwen25, "seq_len: 4096");
  ASSERT_TRUE(qwen2.ok()) << qwen2.ErrorText();
  EXPECT_EQ(qwen2.recipe.model.arch, Arch::kQwen2);
  EXPECT_EQ(qwen2.recipe.model.d_model, 896);
  EXPECT_EQ(qwen2.recipe.model.heads, 14);
  EXPECT_EQ(qwen2.recipe.model.kv_heads, 2);
  EXPECT_EQ(qwen2.recipe.model.head_dim, 0);  // 896/14
  EXPECT_EQ(qwen2.recipe.model.ffn, 4864);
  EXPECT_EQ(qwen2.recipe.model.rope_theta, 1e6);
  EXPECT_EQ(qwen2.recipe.model.norm_eps, 1e-6);
  EXPECT_TRUE(qwen2.recipe.model.tie_embeddings);
  EXPECT_TRUE(qwen2.notes.empty()) << qwen2.notes.front();

  RecipeParseResult qwen3 = Load(kQwen3, "seq_len: 4096");
  ASSERT_TRUE(qwen3.ok()) << qwen3.ErrorText();
  EXPECT_EQ(qwen3.recipe.model.arch, Arch::kQwen3);
  EXPECT_EQ(qwen3.recipe.model.head_dim, 128);
  EXPECT_EQ(HeadDim(qwen3.recipe.model), 128);
  EXPECT_EQ(qwen3.recipe.model.kv_heads, 8);
  EXPECT_NE(RecipeToYaml(qwen3.recipe).find("head_dim: 128"), std::string::npos);
  EXPECT_TRUE(qwen3.notes.empty()) << qwen3.notes.front();

  // Qwen's sliding window where it is on and narrower than the sequence; Qwen3's output-projection
  // bias; a contradiction with the family.
  std::string sliding = kQwen25;
  sliding.replace(sliding.find("\"use_sliding_window\": false"), 27, "\"use_sliding_window\": true");
  sliding.replace(sliding.find("\"sliding_window\": 32768"), 23, "\"sliding_window\": 4096");
  EXPECT_TRUE(Load(sliding, "seq_len: 4096").ok());
  RecipeParseResult refused = Load(sliding, "seq_len: 8192");
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.ErrorText().find("sliding_window=4096 is smaller than model.seq_len=8192"), std::string::npos)
      << refused.ErrorText();
  std::string biased = kQwen3;
  biased.replace(biased.find("\"attention_bias\": false"), 23, "\"attention_bias\": true");
  refused = Load(biased, "seq_len: 4096");
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.ErrorText().find("attention_bias true is not supported"), std::string::npos) << refused.ErrorText();
  refused = Load(kQwen3, "seq_len: 4096, arch: llama");
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.ErrorText().find("model.arch=llama but"), std::string::npos) << refused.ErrorText();
}

// transformers 5 saves rope_theta and the scaling inside rope_parameters: read the same.
TEST_F(HfConfigTest, TransformersFivesRopeParametersReadAsRopeScaling) {
  const std::string v5 = R"({
  "architectures": ["LlamaForCausalLM"], "attention_bias": false, "head_dim": 64, "hidden_act": "silu",
  "hidden_size": 2048, "intermediate_size": 8192, "max_position_embeddings": 131072, "model_type": "llama",
  "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
  "tie_word_embeddings": true, "dtype": "float32", "vocab_size": 128256,
  "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "high_freq_factor": 4.0,
                      "low_freq_factor": 1.0, "original_max_position_embeddings": 8192}})";
  RecipeParseResult parsed = Load(v5, "seq_len: 2048");
  ASSERT_TRUE(parsed.ok()) << parsed.ErrorText() << "\n" << v5;
  EXPECT_EQ(parsed.recipe.model.rope_theta, 500000);
  EXPECT_EQ(parsed.recipe.model.rope_scaling, RopeScaling::kLlama3);
  EXPECT_EQ(parsed.recipe.model.rope_factor, 32);
  EXPECT_TRUE(parsed.notes.empty()) << parsed.notes.front();
  const std::string partial = v5.substr(0, v5.size() - 2) + R"(, "partial_rotary_factor": 0.5}})";
  RecipeParseResult refused = Load(partial, "seq_len: 2048");
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.ErrorText().find("rope_parameters.partial_rotary_factor=0.5 is not supported"), std::string::npos)
      << refused.ErrorText();
}

// Nothing is ignored silently: keys ltrain does not know, and GPT-2's dropout, are noted.
TEST_F(HfConfigTest, UnknownKeysAndDropoutAreNoted) {
  RecipeParseResult parsed = Load(Llama32With("quantization_config", R"({"bits": 4})"), "seq_len: 128");
  ASSERT_TRUE(parsed.ok()) << parsed.ErrorText();
  ASSERT_EQ(parsed.notes.size(), 1u);
  EXPECT_NE(parsed.notes[0].find("keys ltrain does not know, not read: quantization_config"), std::string::npos)
      << parsed.notes[0];

  RecipeParseResult gpt2 = Load(R"({"architectures": ["GPT2LMHeadModel"], "n_layer": 2, "n_embd": 64, "n_head": 4,
    "n_positions": 128, "vocab_size": 300, "activation_function": "gelu_new", "resid_pdrop": 0.1,
    "embd_pdrop": 0.1, "attn_pdrop": 0.1, "layer_norm_epsilon": 1e-05})");
  ASSERT_TRUE(gpt2.ok()) << gpt2.ErrorText();
  EXPECT_EQ(gpt2.recipe.model.arch, Arch::kGpt2);
  EXPECT_EQ(gpt2.recipe.model.seq_len, 128);
  EXPECT_EQ(gpt2.recipe.model.vocab, 300);
  ASSERT_EQ(gpt2.notes.size(), 1u);
  EXPECT_NE(gpt2.notes[0].find("resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1 not applied"), std::string::npos)
      << gpt2.notes[0];
}

// What `ltrain export` writes reads back as the same model, RoPE scaling included.
TEST_F(HfConfigTest, AnExportedConfigurationReadsBackAsTheSameModel) {
  ModelSpec m;
  m.arch = Arch::kLlama;
  m.layers = 3;
  m.d_model = 96;
  m.heads = 6;
  m.kv_heads = 2;
  m.ffn = 160;
  m.vocab = 500;
  m.seq_len = 256;
  m.rope_theta = 20000;
  m.norm_eps = 1e-6;
  m.tie_embeddings = false;
  m.rope_scaling = RopeScaling::kLlama3;
  m.rope_factor = 16;
  m.rope_low_freq_factor = 2;
  m.rope_high_freq_factor = 8;
  m.rope_original_positions = 128;
  m.max_positions = 4096;
  for (RopeScaling scaling : {RopeScaling::kLlama3, RopeScaling::kLinear, RopeScaling::kNone}) {
    m.rope_scaling = scaling;
    std::ofstream(dir_ / "model" / "config.json") << HfConfigJson(m, 1, 2);
    StatusOr<HfModelConfig> read = ReadHfModelConfig((dir_ / "model").string(), 256);
    ASSERT_TRUE(read.ok()) << read.status().ToString();
    for (const std::string& key : read->keys) {
      Recipe want, got;
      want.model = m;
      got.model = read->model;
      if (scaling != RopeScaling::kLlama3 && key.rfind("model.rope_", 0) == 0 && key != "model.rope_theta" &&
          key != "model.rope_scaling" && !(scaling == RopeScaling::kLinear && key == "model.rope_factor")) {
        continue;  // the keys of llama3 scaling alone
      }
      EXPECT_EQ(RecipeKeyValues(got).at(key), RecipeKeyValues(want).at(key)) << key;
    }
    EXPECT_TRUE(read->notes.empty()) << read->notes.front();
  }
  // Each family exports as its own architecture and reads back as itself.
  m.rope_scaling = RopeScaling::kNone;
  for (Arch arch : {Arch::kMistral, Arch::kQwen2, Arch::kQwen3}) {
    m.arch = arch;
    m.head_dim = arch == Arch::kQwen3 ? 32 : 0;
    const std::string json = HfConfigJson(m, 1, 2);
    std::ofstream(dir_ / "model" / "config.json") << json;
    EXPECT_NE(json.find(std::string(FamilyOf(arch).hf_architecture)), std::string::npos) << json;
    StatusOr<HfModelConfig> read = ReadHfModelConfig((dir_ / "model").string(), 256);
    ASSERT_TRUE(read.ok()) << read.status().ToString();
    EXPECT_EQ(read->model.arch, arch);
    EXPECT_EQ(read->model.head_dim, m.head_dim);
    EXPECT_EQ(read->model.kv_heads, 2);
    EXPECT_TRUE(read->notes.empty()) << read->notes.front();
  }
}

// A .safetensors file, or a directory without config.json: the recipe's model keys as they are.
// Qwen3-MoE's configuration (as transformers 5 saves Qwen3MoeConfig, the sizes small) and Mixtral's
// give model.moe; each writes back as the same model; what transformers cannot build is said.
constexpr const char* kQwen3Moe = R"({
  "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
  "bos_token_id": 151643, "decoder_sparse_step": 2, "eos_token_id": 151645, "head_dim": 32, "hidden_act": "silu",
  "hidden_size": 64, "initializer_range": 0.02, "intermediate_size": 96, "max_position_embeddings": 4096,
  "max_window_layers": 4, "mlp_only_layers": [3], "model_type": "qwen3_moe", "moe_intermediate_size": 48,
  "norm_topk_prob": true, "num_attention_heads": 4, "num_experts": 8, "num_experts_per_tok": 2,
  "num_hidden_layers": 4, "num_key_value_heads": 2, "output_router_logits": false, "rms_norm_eps": 1e-06,
  "rope_scaling": null, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001, "sliding_window": null,
  "tie_word_embeddings": false, "use_cache": true, "use_sliding_window": false, "vocab_size": 256})";
constexpr const char* kMixtral = R"({
  "architectures": ["MixtralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2,
  "head_dim": null, "hidden_act": "silu", "hidden_size": 64, "initializer_range": 0.02, "intermediate_size": 112,
  "max_position_embeddings": 4096, "model_type": "mixtral", "num_attention_heads": 4, "num_experts_per_tok": 2,
  "num_hidden_layers": 2, "num_key_value_heads": 2, "num_local_experts": 4, "output_router_logits": false,
  "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.02, "router_jitter_noise": 0.0,
  "sliding_window": null, "tie_word_embeddings": false, "vocab_size": 256})";

TEST_F(HfConfigTest, MixtureOfExpertsConfigurationsGiveModelMoe) {
  RecipeParseResult qwen = Load(kQwen3Moe, "seq_len: 64");
  ASSERT_TRUE(qwen.ok()) << qwen.ErrorText();
  const ModelSpec& q = qwen.recipe.model;
  EXPECT_EQ(q.arch, Arch::kQwen3);
  EXPECT_EQ(q.ffn, 96);
  EXPECT_EQ(q.moe.experts, 8);
  EXPECT_EQ(q.moe.top_k, 2);
  EXPECT_EQ(q.moe.ffn, 48);
  EXPECT_EQ(q.moe.every, 2);
  EXPECT_EQ(q.moe.dense_layers, std::vector<int>({3}));
  EXPECT_TRUE(q.moe.norm_topk);
  // transformers' rule: block l sparse where (l + 1) % decoder_sparse_step == 0, unless in mlp_only_layers.
  for (int l = 0; l < 4; ++l) EXPECT_EQ(IsMoeLayer(q, l), l == 1) << l;
  EXPECT_EQ(HfExportProblem(q), "");
  ASSERT_EQ(qwen.notes.size(), 1u);
  EXPECT_NE(qwen.notes[0].find("router_aux_loss_coef=0.001 weighs ltrain's sequence-wise balance loss"),
            std::string::npos);

  // transformers 5.17 writes Qwen3-MoE's count as num_local_experts (Mixtral's name): the same model.
  std::string renamed = kQwen3Moe;
  renamed.replace(renamed.find("\"num_experts\""), std::string("\"num_experts\"").size(), "\"num_local_experts\"");
  RecipeParseResult qwen5 = Load(renamed, "seq_len: 64");
  ASSERT_TRUE(qwen5.ok()) << qwen5.ErrorText();
  EXPECT_EQ(qwen5.recipe.model.moe.experts, 8);

  RecipeParseResult mixtral = Load(kMixtral, "seq_len: 64");
  ASSERT_TRUE(mixtral.ok()) << mixtral.ErrorText();
  const ModelSpec& x = mixtral.recipe.model;
  EXPECT_EQ(x.arch, Arch::kMistral);
  EXPECT_EQ(x.moe.experts, 4);
  EXPECT_EQ(x.moe.ffn, 112);
  EXPECT_EQ(x.moe.aux_loss_coef, 0.02);
  EXPECT_TRUE(IsMoeLayer(x, 0) && IsMoeLayer(x, 1));

  // Written back (as `ltrain export` writes config.json) and read again: the same model.
  for (const ModelSpec& m : {q, x}) {
    const fs::path again = dir_ / ("again-" + std::string(NameOf(m.arch)));
    fs::create_directories(again);
    std::ofstream(again / "config.json") << HfConfigJson(m, 1, 2);
    StatusOr<HfModelConfig> read = ReadHfModelConfig(again.string(), 64);
    ASSERT_TRUE(read.ok()) << read.status().ToString();
    EXPECT_EQ(ModelShapeDifferences(m, read->model), "") << NameOf(m.arch);
    EXPECT_EQ(read->model.moe.dense_layers, m.moe.dense_layers);
    EXPECT_EQ(read->model.moe.norm_topk, m.moe.norm_topk);
    EXPECT_EQ(read->model.moe.every, m.moe.every);
  }

  // A pattern with the first blocks dense writes its first blocks into mlp_only_layers.
  ModelSpec first = q;
  first.moe.first_dense = 2;
  first.moe.dense_layers = {};
  std::ofstream(dir_ / "model" / "config.json") << HfConfigJson(first, 1, 2);
  StatusOr<HfModelConfig> first_read = ReadHfModelConfig((dir_ / "model").string(), 64);
  ASSERT_TRUE(first_read.ok()) << first_read.status().ToString();
  EXPECT_EQ(first_read->model.moe.dense_layers, std::vector<int>({1}));
  for (int l = 0; l < 4; ++l) EXPECT_EQ(IsMoeLayer(first_read->model, l), IsMoeLayer(first, l)) << l;

  // What transformers cannot build, said with the key.
  ModelSpec shared = q;
  shared.moe.shared_experts = 1;
  EXPECT_NE(HfExportProblem(shared).find("model.moe.shared_experts"), std::string::npos);
  ModelSpec bias = q;
  bias.moe.balance = MoeBalance::kBias;
  EXPECT_NE(HfExportProblem(bias).find("no router bias"), std::string::npos);
  ModelSpec qwen2 = q;
  qwen2.arch = Arch::kQwen2;
  EXPECT_NE(HfExportProblem(qwen2).find("Qwen2-MoE gates its shared expert"), std::string::npos);
  ModelSpec odd = q;
  odd.moe.first_dense = 1;
  EXPECT_NE(HfExportProblem(odd).find("must be a multiple of model.moe.every=2"), std::string::npos);
  ModelSpec partial = x;
  partial.moe.first_dense = 1;
  EXPECT_NE(HfExportProblem(partial).find("block 0 is dense"), std::string::npos);

  // Mixtral's router noise is refused, naming the key.
  std::string noisy = kMixtral;
  noisy.replace(noisy.find("\"router_jitter_noise\": 0.0"), 26, "\"router_jitter_noise\": 0.01");
  RecipeParseResult refused = Load(noisy, "seq_len: 64");
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.ErrorText().find("router_jitter_noise=0.01 is not supported"), std::string::npos)
      << refused.ErrorText();
}

TEST_F(HfConfigTest, NoConfigurationLeavesTheRecipeAsItIs) {
  const std::string recipe = (dir_ / "r.yaml").string();
  std::ofstream(recipe) << "model: {init_from: " << (dir_ / "model").string() << ", heads: 8}\ndata: {path: /d}\n";
  RecipeParseResult parsed = LoadRecipeFile(recipe);
  ASSERT_TRUE(parsed.ok()) << parsed.ErrorText();
  EXPECT_EQ(parsed.recipe.model.heads, 8);
}

}  // namespace
}  // namespace ltrain
