#include "common/hf_config.h"

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "common/hf_format.h"
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
      {"architectures", R"(["Qwen2ForCausalLM"])", "", "architectures names Qwen2ForCausalLM"},
      {"attention_bias", "true", "", "attention_bias true is not supported"},
      {"mlp_bias", "true", "", "mlp_bias true is not supported"},
      {"hidden_act", R"("gelu")", "", "hidden_act 'gelu' is not supported"},
      {"head_dim", "128", "", "head_dim=128 is not hidden_size/num_attention_heads=64"},
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
}

// A .safetensors file, or a directory without config.json: the recipe's model keys as they are.
TEST_F(HfConfigTest, NoConfigurationLeavesTheRecipeAsItIs) {
  const std::string recipe = (dir_ / "r.yaml").string();
  std::ofstream(recipe) << "model: {init_from: " << (dir_ / "model").string() << ", heads: 8}\ndata: {path: /d}\n";
  RecipeParseResult parsed = LoadRecipeFile(recipe);
  ASSERT_TRUE(parsed.ok()) << parsed.ErrorText();
  EXPECT_EQ(parsed.recipe.model.heads, 8);
}

}  // namespace
}  // namespace ltrain
