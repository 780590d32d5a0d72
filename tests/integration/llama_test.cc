// A Llama from text to a model that leaves ltrain, through the binaries as a user runs them: a BPE
// trained on the licence texts (`ltrain data prepare --train-tokenizer`), recipes/llama-quickstart.yaml
// shortened, validation loss, `ltrain export --format hf`, `model.init_from` of the export (the same
// parameters come back), `ltrain generate`. Also GPT-2's export (its transposed Conv1D weights)
// and the refusals: a model.vocab too small for the data, data made by another tokenizer.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <set>

#include <nlohmann/json.hpp>

#include "common/safetensors.h"
#include "tests/support/job_status.h"
#include "tests/support/subprocess.h"

namespace ltrain::testing {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::json;

// Every tensor of the safetensors files a directory's model.safetensors(.index.json) names, as bytes.
std::map<std::string, std::string> Tensors(const fs::path& dir) {
  std::vector<fs::path> files;
  if (fs::exists(dir / "model.safetensors.index.json")) {
    Json index = Json::parse(ReadFile((dir / "model.safetensors.index.json").string()));
    std::set<std::string> names;
    for (const auto& [name, file] : index.at("weight_map").items()) names.insert(file.get<std::string>());
    for (const auto& n : names) files.push_back(dir / n);
  } else {
    files.push_back(dir / "model.safetensors");
  }
  std::map<std::string, std::string> out;
  for (const fs::path& f : files) {
    auto file = SafetensorsFile::Open(f.string());
    EXPECT_TRUE(file.ok()) << file.status().ToString();
    if (!file.ok()) continue;
    for (const SafetensorsEntry& e : (*file)->tensors()) {
      std::string bytes(e.bytes, '\0');
      EXPECT_TRUE((*file)->Read(e, bytes.data()).ok());
      out[e.name] = bytes;
    }
  }
  return out;
}

class LlamaTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new TempDir();
    std::vector<std::string> texts = LicenseTexts();
    ASSERT_FALSE(texts.empty()) << "install Debian's base-files package (/usr/share/common-licenses)";
    // The README's command, on the directory.
    ProcessResult prepared = RunProcess({LtrainBinary(), "data", "prepare", "--input", "/usr/share/common-licenses",
                                         "--output", dir_->Join("bpe"), "--train-tokenizer", "bpe", "--vocab", "2048"},
                                        {}, std::chrono::seconds(300));
    ASSERT_EQ(prepared.exit_code, 0) << prepared.output;
    prepare_output_ = new std::string(prepared.output);
  }
  static void TearDownTestSuite() {
    delete dir_;
    delete prepare_output_;
  }

  std::map<std::string, std::string> Env() const { return {{"LTRAIN_HOME", dir_->Join("home")}}; }

  ProcessResult Launch(const std::string& recipe, const std::vector<std::string>& sets) {
    std::vector<std::string> argv = {LtrainBinary(), "launch", recipe};
    for (const auto& set : sets) argv.insert(argv.end(), {"--set", set});
    return RunProcess(argv, Env(), std::chrono::seconds(300));
  }

  std::string Quickstart() const { return SourceDir() + "/recipes/llama-quickstart.yaml"; }

  static TempDir* dir_;
  static std::string* prepare_output_;
};

TempDir* LlamaTest::dir_ = nullptr;
std::string* LlamaTest::prepare_output_ = nullptr;

// A mixture of experts (Qwen3's block with model.moe) exports as transformers' Qwen3-MoE, one tensor an
// expert, and comes back through model.init_from (its config.json read into model.moe, the experts
// stacked again) in another layout: with lr 0, exported again, the same bytes.
TEST_F(LlamaTest, AMixtureOfExpertsExportsAsQwen3MoeAndImportsBack) {
  const std::string data = "data.path=" + dir_->Join("bpe");
  const std::vector<std::string> moe = {data, "model.arch=qwen3", "model.tie_embeddings=false", "model.moe.experts=4",
                                        "model.moe.top_k=2", "model.moe.ffn=64", "model.moe.every=2"};
  std::vector<std::string> sets = moe;
  for (const char* s : {"name=moe-a", "training.steps=10", "training.eval_every=0", "checkpoint.every=10"}) sets.push_back(s);
  sets.push_back("checkpoint.dir=" + dir_->Join("ck-moe-a"));
  ProcessResult trained = Launch(Quickstart(), sets);
  ASSERT_EQ(trained.exit_code, 0) << trained.output;
  EXPECT_NE(trained.output.find(" moe_load_max "), std::string::npos) << trained.output;

  const std::string step = dir_->Join("ck-moe-a/step-10");
  ProcessResult exported = RunProcess({LtrainBinary(), "export", step, "--output", dir_->Join("hf-moe-a")}, Env());
  ASSERT_EQ(exported.exit_code, 0) << exported.output;
  Json config = Json::parse(ReadFile(dir_->Join("hf-moe-a/config.json")));
  EXPECT_EQ(config["architectures"][0], "Qwen3MoeForCausalLM");
  EXPECT_EQ(config["model_type"], "qwen3_moe");
  EXPECT_EQ(config["num_experts"], 4);
  EXPECT_EQ(config["moe_intermediate_size"], 64);
  EXPECT_EQ(config["decoder_sparse_step"], 2);
  std::map<std::string, std::string> a = Tensors(dir_->Join("hf-moe-a"));
  // Blocks 1 and 3 of 4 are mixtures: each a router and 4 experts of 3 tensors.
  EXPECT_TRUE(a.count("model.layers.1.mlp.gate.weight"));
  EXPECT_TRUE(a.count("model.layers.3.mlp.experts.3.down_proj.weight"));
  EXPECT_TRUE(a.count("model.layers.0.mlp.gate_proj.weight"));
  EXPECT_EQ(a["model.layers.1.mlp.experts.0.gate_proj.weight"].size(), 64u * 128 * 4);

  sets = moe;
  for (const char* s : {"name=moe-b", "training.steps=2", "training.lr=0", "training.min_lr=0",
                        "training.weight_decay=0", "training.eval_every=0", "parallel.tp=2"}) {
    sets.push_back(s);
  }
  sets.push_back("model.init_from=" + dir_->Join("hf-moe-a"));
  sets.push_back("checkpoint.dir=" + dir_->Join("ck-moe-b"));
  ProcessResult imported = Launch(Quickstart(), sets);
  ASSERT_EQ(imported.exit_code, 0) << imported.output;
  ProcessResult reexported =
      RunProcess({LtrainBinary(), "export", dir_->Join("ck-moe-b"), "--output", dir_->Join("hf-moe-b")}, Env());
  ASSERT_EQ(reexported.exit_code, 0) << reexported.output;
  std::map<std::string, std::string> b = Tensors(dir_->Join("hf-moe-b"));
  ASSERT_EQ(b.size(), a.size());
  for (const auto& [name, bytes] : a) EXPECT_TRUE(b[name] == bytes) << name;
}

TEST_F(LlamaTest, TrainExportImportAndGenerate) {
  // The data keeps its tokenizer and says so.
  EXPECT_NE(prepare_output_->find("with the huggingface tokenizer tokenizer.json (vocab 2048)"), std::string::npos)
      << *prepare_output_;
  EXPECT_TRUE(fs::exists(dir_->Join("bpe/tokenizer.json")));
  EXPECT_NE(ReadFile(dir_->Join("bpe/data.yaml")).find("tokenizer: huggingface"), std::string::npos);

  const std::string data = "data.path=" + dir_->Join("bpe");
  ProcessResult trained = Launch(Quickstart(), {data, "name=llama-a", "training.steps=40", "training.eval_every=20",
                                                "training.log_every=10", "checkpoint.every=40",
                                                "checkpoint.dir=" + dir_->Join("ck-a")});
  ASSERT_EQ(trained.exit_code, 0) << trained.output;
  EXPECT_NE(trained.output.find("model llama params"), std::string::npos) << trained.output;
  EXPECT_NE(trained.output.find("eval step 40/40 val_loss "), std::string::npos) << trained.output;
  std::vector<double> losses = ParseLosses(trained.output);
  ASSERT_GE(losses.size(), 3u);
  EXPECT_NEAR(losses.front(), std::log(2048.0), 0.5) << "a fresh model guesses among 2048 tokens";
  EXPECT_LT(losses.back(), losses.front() - 1.5) << trained.output;

  // Export: transformers' names, config and the tokenizer.
  const std::string step = dir_->Join("ck-a/step-40");
  ProcessResult exported = RunProcess({LtrainBinary(), "export", step, "--output", dir_->Join("hf-a")}, Env());
  ASSERT_EQ(exported.exit_code, 0) << exported.output;
  Json config = Json::parse(ReadFile(dir_->Join("hf-a/config.json")));
  EXPECT_EQ(config["architectures"][0], "LlamaForCausalLM");
  EXPECT_EQ(config["num_key_value_heads"], 2);
  EXPECT_EQ(config["intermediate_size"], 384);
  EXPECT_EQ(config["tie_word_embeddings"], true);
  EXPECT_EQ(config["eos_token_id"], 2047);
  EXPECT_TRUE(fs::exists(dir_->Join("hf-a/tokenizer.json")));
  ASSERT_TRUE(fs::exists(dir_->Join("hf-a/tokenizer_config.json")));
  // The BOS the model config names is the token tokenizer_config.json names (it was null in config.json).
  Json tokenizer_config = Json::parse(ReadFile(dir_->Join("hf-a/tokenizer_config.json")));
  EXPECT_EQ(config["bos_token_id"], 2047);
  EXPECT_EQ(tokenizer_config["bos_token"], tokenizer_config["eos_token"]);
  std::map<std::string, std::string> a = Tensors(dir_->Join("hf-a"));
  EXPECT_EQ(a.size(), 1u + 4 * 9 + 1);
  EXPECT_TRUE(a.count("model.layers.3.self_attn.k_proj.weight"));
  EXPECT_EQ(a["model.layers.0.self_attn.k_proj.weight"].size(), 64u * 128 * 4) << "2 kv heads of 32 by d 128";
  // An existing directory is not written into.
  ProcessResult again = RunProcess({LtrainBinary(), "export", step, "--output", dir_->Join("hf-a")}, Env());
  EXPECT_EQ(again.exit_code, 2) << again.output;

  // Import in another layout (tp 2), sharded files: with lr 0 and no weight decay the parameters
  // come back as they went out.
  ProcessResult sharded = RunProcess({LtrainBinary(), "export", step, "--output", dir_->Join("hf-shards"),
                                      "--max-shard-gb", "0.0005"}, Env());
  ASSERT_EQ(sharded.exit_code, 0) << sharded.output;
  EXPECT_TRUE(fs::exists(dir_->Join("hf-shards/model.safetensors.index.json")));
  int shards = 0;
  for (const auto& e : fs::directory_iterator(dir_->Join("hf-shards"))) {
    shards += e.path().filename().string().rfind("model-0", 0) == 0;
  }
  EXPECT_GE(shards, 4) << "4.2 MB of weights in files of 0.5 MB";
  EXPECT_TRUE(fs::exists(dir_->Join("hf-shards/model-00001-of-0000" + std::to_string(shards) + ".safetensors")));
  ProcessResult imported = Launch(Quickstart(), {data, "name=llama-b", "training.steps=2", "training.lr=0",
                                                 "training.min_lr=0", "training.weight_decay=0", "training.eval_every=0",
                                                 "parallel.tp=2", "model.init_from=" + dir_->Join("hf-shards"),
                                                 "checkpoint.dir=" + dir_->Join("ck-b")});
  ASSERT_EQ(imported.exit_code, 0) << imported.output;
  EXPECT_NE(imported.output.find("parameter tensors from " + dir_->Join("hf-shards")), std::string::npos)
      << imported.output;
  std::vector<double> imported_losses = ParseLosses(imported.output);
  ASSERT_FALSE(imported_losses.empty());
  EXPECT_LT(imported_losses.front(), losses.front() - 1.0) << "it starts where the first run ended";
  ProcessResult reexported = RunProcess({LtrainBinary(), "export", dir_->Join("ck-b"), "--output", dir_->Join("hf-b")}, Env());
  ASSERT_EQ(reexported.exit_code, 0) << reexported.output;
  std::map<std::string, std::string> b = Tensors(dir_->Join("hf-b"));
  ASSERT_EQ(b.size(), a.size());
  for (const auto& [name, bytes] : a) EXPECT_TRUE(b[name] == bytes) << name;

  // Generation continues the prompt; greedy decoding is deterministic.
  ProcessResult text = RunProcess({LtrainBinary(), "generate", step, "--prompt", "This program is free software",
                                   "--max-tokens", "30", "--temperature", "0"}, Env());
  ASSERT_EQ(text.exit_code, 0) << text.output;
  EXPECT_EQ(text.output.rfind("This program is free software", 0), 0u) << text.output;
  EXPECT_GT(text.output.size(), std::string("This program is free software").size() + 20) << text.output;
  ProcessResult json = RunProcess({LtrainBinary(), "generate", step, "--prompt", "This program is free software",
                                   "--max-tokens", "30", "--temperature", "0", "-o", "json"}, Env());
  ASSERT_EQ(json.exit_code, 0) << json.output;
  Json sample = Json::parse(json.output);
  EXPECT_EQ("This program is free software" + sample["completion"].get<std::string>() + "\n", text.output);
  // --score: the prompt's per-token log-probabilities, about the training loss on familiar text.
  ProcessResult score = RunProcess({LtrainBinary(), "generate", step, "--score", "-o", "json", "--prompt",
                                    "This program is free software: you can redistribute it and/or modify it"}, Env());
  ASSERT_EQ(score.exit_code, 0) << score.output;
  Json scored = Json::parse(score.output);
  ASSERT_GE(scored["logprobs"].size(), 5u);
  for (const Json& lp : scored["logprobs"]) EXPECT_LE(lp.get<double>(), 0.0);
  EXPECT_LT(scored["mean_loss"].get<double>(), losses.front());
}

TEST_F(LlamaTest, Gpt2ExportsTransposedConv1DWeights) {
  ProcessResult prepared = PrepareLicenseData(dir_->Join("bytes"));
  ASSERT_EQ(prepared.exit_code, 0) << prepared.output;
  ProcessResult trained = Launch(SourceDir() + "/recipes/quickstart.yaml",
                                 {"data.path=" + dir_->Join("bytes"), "name=gpt-a", "training.steps=4",
                                  "checkpoint.dir=" + dir_->Join("ck-gpt")});
  ASSERT_EQ(trained.exit_code, 0) << trained.output;
  ProcessResult exported = RunProcess({LtrainBinary(), "export", dir_->Join("ck-gpt"), "--output", dir_->Join("hf-gpt")}, Env());
  ASSERT_EQ(exported.exit_code, 0) << exported.output;
  Json config = Json::parse(ReadFile(dir_->Join("hf-gpt/config.json")));
  EXPECT_EQ(config["architectures"][0], "GPT2LMHeadModel");
  EXPECT_EQ(config["activation_function"], "gelu_new");
  auto file = SafetensorsFile::Open(dir_->Join("hf-gpt/model.safetensors"));
  ASSERT_TRUE(file.ok());
  const SafetensorsEntry* c_attn = (*file)->Find("transformer.h.0.attn.c_attn.weight");
  ASSERT_NE(c_attn, nullptr);
  EXPECT_EQ(c_attn->shape, (std::vector<int64_t>{128, 384})) << "Conv1D: [in, out]";
  EXPECT_EQ((*file)->Find("lm_head.weight"), nullptr) << "tied to transformer.wte";
  EXPECT_NE(exported.output.find("no tokenizer files (the data is bytes"), std::string::npos) << exported.output;
  // Imported back under transformers' names, it starts where it ended.
  ProcessResult imported = Launch(SourceDir() + "/recipes/quickstart.yaml",
                                  {"data.path=" + dir_->Join("bytes"), "name=gpt-b", "training.steps=2", "training.lr=0",
                                   "training.min_lr=0", "training.weight_decay=0",
                                   "model.init_from=" + dir_->Join("hf-gpt"), "checkpoint.dir=" + dir_->Join("ck-gpt-b")});
  ASSERT_EQ(imported.exit_code, 0) << imported.output;
  ProcessResult reexported = RunProcess({LtrainBinary(), "export", dir_->Join("ck-gpt-b"), "--output", dir_->Join("hf-gpt-b")}, Env());
  ASSERT_EQ(reexported.exit_code, 0) << reexported.output;
  std::map<std::string, std::string> a = Tensors(dir_->Join("hf-gpt")), b = Tensors(dir_->Join("hf-gpt-b"));
  ASSERT_EQ(a.size(), b.size());
  for (const auto& [name, bytes] : a) EXPECT_TRUE(b[name] == bytes) << name;
}

TEST_F(LlamaTest, DataTheModelCannotReadIsRefusedBeforeTheJob) {
  const std::string data = "data.path=" + dir_->Join("bpe");
  ProcessResult small = RunProcess({LtrainBinary(), "validate", Quickstart(), "--set", data, "--set", "model.vocab=1024"});
  EXPECT_EQ(small.exit_code, 2) << small.output;
  EXPECT_NE(small.output.find("model.vocab=1024 is smaller than the vocabulary of the data"), std::string::npos)
      << small.output;
  EXPECT_NE(small.output.find("set model.vocab: 2048"), std::string::npos) << small.output;
  ProcessResult launch = Launch(Quickstart(), {data, "model.vocab=1024"});
  EXPECT_EQ(launch.exit_code, 2) << launch.output;
  ProcessResult other = RunProcess({LtrainBinary(), "validate", Quickstart(), "--set", data, "--set", "data.tokenizer=byte"});
  EXPECT_EQ(other.exit_code, 2) << other.output;
  EXPECT_NE(other.output.find("was made by the huggingface tokenizer"), std::string::npos) << other.output;
  // A directory the model's shapes do not fit fails the job at start, naming the tensor.
  ProcessResult wrong = Launch(Quickstart(), {data, "name=llama-wrong", "training.steps=2", "model.layers=2",
                                              "model.d_model=64", "model.init_from=" + dir_->Join("nowhere")});
  EXPECT_NE(wrong.exit_code, 0);
  EXPECT_NE(wrong.output.find("nowhere"), std::string::npos) << wrong.output;
}

// recipes/finetune.yaml on a model from elsewhere: a small Qwen2 (q, k and v biases, tied head) trained
// here and exported as transformers' Qwen2ForCausalLM with its tokenizer, then fine-tuned on
// {prompt, response} pairs made with that tokenizer (`data prepare --sft --tokenizer DIR`): the model
// comes from config.json alone, the response loss falls, and the result exports as Qwen2 again.
// Weights that do not fit the configuration are refused before the job, each mismatch named.
TEST_F(LlamaTest, FineTuneRecipeTrainsTheResponsesOfAnImportedModel) {
  const std::string data = "data.path=" + dir_->Join("bpe");
  ProcessResult base = Launch(Quickstart(), {data, "name=qwen-base", "model.arch=qwen2", "training.steps=30",
                                             "training.eval_every=0", "checkpoint.every=30",
                                             "checkpoint.dir=" + dir_->Join("ck-qwen")});
  ASSERT_EQ(base.exit_code, 0) << base.output;
  const std::string hf = dir_->Join("hf-qwen");
  ProcessResult exported = RunProcess({LtrainBinary(), "export", dir_->Join("ck-qwen/step-30"), "--output", hf}, Env());
  ASSERT_EQ(exported.exit_code, 0) << exported.output;
  Json config = Json::parse(ReadFile(hf + "/config.json"));
  EXPECT_EQ(config["architectures"][0], "Qwen2ForCausalLM");
  EXPECT_EQ(config["use_sliding_window"], false);
  EXPECT_TRUE(Tensors(hf).count("model.layers.0.self_attn.q_proj.bias"));

  // Questions and formulaic answers: the answers' tokens are what the fine-tune learns.
  {
    std::ofstream pairs(dir_->Join("pairs.jsonl"));
    for (int i = 0; i < 400; ++i) {
      pairs << R"({"prompt": "Question: which licence is number )" << i << R"(?\n", "response": "Answer: licence )"
            << i << R"( is the GNU General Public License."})" << "\n";
    }
  }
  ProcessResult sft = RunProcess({LtrainBinary(), "data", "prepare", "--sft", "--input", dir_->Join("pairs.jsonl"),
                                  "--output", dir_->Join("sft"), "--tokenizer", hf, "-q"},
                                 Env());
  ASSERT_EQ(sft.exit_code, 0) << sft.output;
  const std::string recipe = SourceDir() + "/recipes/finetune.yaml";
  const std::vector<std::string> sets = {"model.init_from=" + hf, "data.path=" + dir_->Join("sft"),
                                         "model.seq_len=128", "training.steps=40", "training.micro_batch=4",
                                         "training.global_batch=8", "training.lr=1.0e-3", "training.min_lr=1.0e-4",
                                         "training.log_every=5", "training.eval_every=0",
                                         "parallel.nproc_per_node=2", "checkpoint.every=40",
                                         "checkpoint.dir=" + dir_->Join("ck-sft")};
  std::vector<std::string> validate = {LtrainBinary(), "validate", recipe};
  for (const std::string& set : sets) validate.insert(validate.end(), {"--set", set});
  ProcessResult validated = RunProcess(validate, Env());
  ASSERT_EQ(validated.exit_code, 0) << validated.output;
  EXPECT_NE(validated.output.find("arch: qwen2"), std::string::npos) << validated.output;
  ProcessResult tuned = Launch(recipe, sets);
  ASSERT_EQ(tuned.exit_code, 0) << tuned.output;
  EXPECT_NE(tuned.output.find("parameter tensors from " + hf), std::string::npos) << tuned.output;
  std::vector<double> losses = ParseLosses(tuned.output);
  ASSERT_GE(losses.size(), 4u) << tuned.output;
  EXPECT_LT(losses.back(), losses.front() * 0.5) << tuned.output;
  ProcessResult out = RunProcess({LtrainBinary(), "export", dir_->Join("ck-sft/step-40"), "--output",
                                  dir_->Join("hf-sft")}, Env());
  ASSERT_EQ(out.exit_code, 0) << out.output;
  EXPECT_EQ(Json::parse(ReadFile(dir_->Join("hf-sft/config.json")))["architectures"][0], "Qwen2ForCausalLM");

  // The same directory under a configuration of another shape: every mismatch is named.
  fs::create_directories(dir_->Join("hf-wrong"));
  fs::copy_file(hf + "/model.safetensors", dir_->Join("hf-wrong/model.safetensors"));
  config["architectures"][0] = "Qwen3ForCausalLM";
  config["model_type"] = "qwen3";
  config["num_hidden_layers"] = 5;
  std::ofstream(dir_->Join("hf-wrong/config.json")) << config.dump();
  std::vector<std::string> wrong_sets = sets;
  wrong_sets[0] = "model.init_from=" + dir_->Join("hf-wrong");
  wrong_sets.back() = "checkpoint.dir=" + dir_->Join("ck-wrong");
  ProcessResult wrong = Launch(recipe, wrong_sets);
  EXPECT_EQ(wrong.exit_code, 2) << wrong.output;
  EXPECT_NE(wrong.output.find("model.layers.0.self_attn.q_norm.weight is missing"), std::string::npos) << wrong.output;
  EXPECT_NE(wrong.output.find("model.layers.0.self_attn.q_proj.bias is not a parameter of the model"),
            std::string::npos)
      << wrong.output;
}

// A model's tokenizer whose template begins each text with its own token (Llama 3's layout): data
// prepare puts it before each document, and generate before the prompt, without printing it.
TEST_F(LlamaTest, GenerateBeginsThePromptWithTheTokenizersBeginOfText) {
  const std::string tokenizer = R"({
    "added_tokens": [{"id": 9, "content": "<|begin_of_text|>", "special": true},
                     {"id": 10, "content": "<|end_of_text|>", "special": true}],
    "normalizer": null,
    "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
    "post_processor": {"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 0}},
      {"Sequence": {"id": "A", "type_id": 0}}], "pair": [], "special_tokens": {}},
    "model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "c": 2, "\u0120": 3, "ab": 4}, "merges": ["a b"]}})";
  dir_->Write("bos-model/tokenizer.json", tokenizer);
  std::string text;
  for (int i = 0; i < 3000; ++i) text += i % 3 ? "ab c " : "c ab ";
  dir_->Write("bos-text.txt", text);
  ProcessResult prepared = RunProcess({LtrainBinary(), "data", "prepare", "--input", dir_->Join("bos-text.txt"),
                                       "--output", dir_->Join("bos-data"), "--tokenizer", dir_->Join("bos-model"), "-q"},
                                      Env());
  ASSERT_EQ(prepared.exit_code, 0) << prepared.output;
  ProcessResult trained = Launch(Quickstart(), {"data.path=" + dir_->Join("bos-data"), "name=llama-bos", "model.vocab=16",
                                                "training.steps=4", "training.eval_every=0", "checkpoint.every=4",
                                                "parallel.nproc_per_node=1", "checkpoint.dir=" + dir_->Join("ck-bos")});
  ASSERT_EQ(trained.exit_code, 0) << trained.output;
  ProcessResult score = RunProcess({LtrainBinary(), "generate", dir_->Join("ck-bos"), "--score", "-o", "json",
                                    "--prompt", "ab c"}, Env());
  ASSERT_EQ(score.exit_code, 0) << score.output;
  Json scored = Json::parse(score.output.substr(score.output.find('{')));
  EXPECT_EQ(scored["first_token"], 9) << score.output;
  EXPECT_EQ(scored["tokens"].size(), 3u) << score.output;  // ab, space, c after the begin-of-text token
  ProcessResult sampled = RunProcess({LtrainBinary(), "generate", dir_->Join("ck-bos"), "--prompt", "ab c",
                                      "--max-tokens", "4", "--temperature", "0"}, Env());
  ASSERT_EQ(sampled.exit_code, 0) << sampled.output;
  EXPECT_NE(sampled.output.find("ab c"), std::string::npos) << sampled.output;
  EXPECT_EQ(sampled.output.find("begin_of_text"), std::string::npos) << sampled.output;
}

}  // namespace
}  // namespace ltrain::testing
