// The ltrain binary as a user runs it: exit codes and messages of validate, status and data prepare.
#include <gtest/gtest.h>

#include <signal.h>
#include <sys/stat.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <set>
#include <sstream>

#include <google/protobuf/struct.pb.h>
#include <google/protobuf/util/json_util.h>

#include "common/checkpoint_manifest.h"
#include "common/recipe_schema.h"
#include "common/safetensors.h"
#include "tests/support/subprocess.h"

namespace ltrain::testing {
namespace {

namespace fs = std::filesystem;

struct Malformed {
  const char* name;
  const char* yaml;
  const char* location;  // expected "file:line:col" suffix after the directory
  const char* message;
};

class MalformedRecipeCliTest : public ::testing::TestWithParam<Malformed> {};

TEST_P(MalformedRecipeCliTest, ValidateExitsTwoNamingFileLineAndColumn) {
  const Malformed& c = GetParam();
  TempDir dir;
  std::string path = dir.Write(std::string(c.name) + ".yaml", c.yaml);
  ProcessResult result = RunProcess({LtrainBinary(), "validate", path});
  EXPECT_EQ(result.exit_code, 2) << result.output;
  EXPECT_NE(result.output.find(path + ":" + c.location + ": "), std::string::npos) << result.output;
  EXPECT_NE(result.output.find(c.message), std::string::npos) << result.output;
}

INSTANTIATE_TEST_SUITE_P(
    Recipes, MalformedRecipeCliTest,
    ::testing::Values(
        Malformed{"syntax", "name: x\nmodel: {layers: 2\ndata: {path: /d}\n", "3:5", "YAML syntax error"},
        Malformed{"unknown_key", "data: {path: /d}\nmodel:\n  layer: 2\n", "3:3", "did you mean 'model.layers'"},
        Malformed{"wrong_type", "data: {path: /d}\ntraining:\n  lr: fast\n", "3:7", "must be a number, got 'fast'"},
        Malformed{"out_of_range", "data: {path: /d}\ntraining:\n  micro_batch: 0\n", "3:16", "out of range"},
        Malformed{"global_batch", "data: {path: /d}\ntraining:\n  micro_batch: 4\n  global_batch: 12\nparallel:\n  nproc_per_node: 2\n",
                  "4:17", "global_batch=12 is not a multiple of micro_batch*dp=4*2=8"},
        Malformed{"heads", "data: {path: /d}\nmodel:\n  d_model: 96\n  heads: 5\n", "4:10", "model.heads=5 does not divide model.d_model=96"},
        Malformed{"tp_heads", "data: {path: /d}\nmodel: {heads: 6, d_model: 96}\nparallel:\n  nproc_per_node: 4\n  tp: 4\n",
                  "5:7", "parallel.tp=4 does not divide model.heads=6"},
        Malformed{"tp_vocab", "data: {path: /d}\nmodel: {vocab: 300}\nparallel:\n  nproc_per_node: 8\n  tp: 8\n", "5:7",
                  "does not divide model.vocab=300"},
        Malformed{"world_size", "data: {path: /d}\nmodel: {layers: 4}\nparallel:\n  nproc_per_node: 3\n  tp: 1\n  pp: 2\n",
                  "5:7", "world size 3 (nodes*nproc_per_node) is not a multiple of tp*pp=2"},
        Malformed{"job_name", "name: ../x\ndata: {path: /d}\n", "1:1", "name \"../x\" may hold only A-Z a-z 0-9 . _ -"},
        Malformed{"pp_layers", "data: {path: /d}\nmodel: {layers: 2}\nparallel:\n  nproc_per_node: 4\n  pp: 4\n", "5:7",
                  "parallel.pp=4 is larger than model.layers=2"}),
    [](const ::testing::TestParamInfo<Malformed>& info) { return std::string(info.param.name); });

TEST(CliTest, ValidatePrintsTheResolvedRecipeWithOverrides) {
  TempDir dir;
  std::string path = dir.Write("ok.yaml", "name: ok\ndata: {path: /d}\n");
  ProcessResult result = RunProcess({LtrainBinary(), "validate", path, "--set", "training.steps=42", "--set", "model.layers=3"});
  EXPECT_EQ(result.exit_code, 0) << result.output;
  EXPECT_NE(result.output.find("steps: 42"), std::string::npos) << result.output;
  EXPECT_NE(result.output.find("layers: 3"), std::string::npos) << result.output;
  // /d holds no prepared data: said as a warning (the recipe may be meant for another machine).
  EXPECT_NE(result.output.find("warning: data.path /d holds no prepared data here"), std::string::npos) << result.output;
  // A program under ltrain run reads its own data: no warning about ltrain's.
  ProcessResult program = RunProcess(
      {LtrainBinary(), "validate", dir.Write("run.yaml", "name: run\nentrypoint: {command: [python3, train.py]}\n")});
  EXPECT_EQ(program.exit_code, 0) << program.output;
  EXPECT_EQ(program.output.find("prepared data"), std::string::npos) << program.output;
}

// `validate --explain` lists every key of the schema: as text, as the README's Markdown table, as JSON.
TEST(CliTest, ValidateExplainListsEveryRecipeKey) {
  ProcessResult text = RunProcess({LtrainBinary(), "validate", "--explain"});
  ASSERT_EQ(text.exit_code, 0) << text.output;
  EXPECT_EQ(text.output, RecipeKeysText());
  ProcessResult markdown = RunProcess({LtrainBinary(), "validate", "--explain", "--output", "markdown"});
  ASSERT_EQ(markdown.exit_code, 0) << markdown.output;
  EXPECT_EQ(markdown.output, RecipeKeysMarkdown());
  ProcessResult json = RunProcess({LtrainBinary(), "validate", "--explain", "-o", "json"});
  ASSERT_EQ(json.exit_code, 0) << json.output;
  google::protobuf::ListValue keys;
  ASSERT_TRUE(google::protobuf::util::JsonStringToMessage(json.output, &keys).ok()) << json.output;
  ASSERT_EQ(static_cast<size_t>(keys.values_size()), DescribeRecipeKeys().size());
  EXPECT_EQ(keys.values(0).struct_value().fields().at("key").string_value(), "name");
  ProcessResult nothing = RunProcess({LtrainBinary(), "validate"});
  EXPECT_EQ(nothing.exit_code, 2) << nothing.output;
  EXPECT_NE(nothing.output.find("--explain"), std::string::npos) << nothing.output;
  // A checked recipe prints as YAML only: -o json without --explain is refused, not ignored.
  TempDir dir;
  ProcessResult yaml_only = RunProcess({LtrainBinary(), "validate", dir.Write("ok.yaml", "name: ok\ndata: {path: /d}\n"),
                                        "-o", "json"});
  EXPECT_EQ(yaml_only.exit_code, 2) << yaml_only.output;
  EXPECT_NE(yaml_only.output.find("-o json goes with --explain"), std::string::npos) << yaml_only.output;
}

// `ltrain plan`: the recipe's layout by part and the ranked layouts, as text and as JSON; a recipe
// whose own layout cannot run on its ranks is still planned; a wrong key is an error (exit 2).
TEST(CliTest, PlanShowsTheRecipesMemoryAndRanksTheLayouts) {
  TempDir dir;
  std::string path = dir.Write("p.yaml", "name: p\nmodel: {layers: 4, d_model: 64, heads: 4, seq_len: 32}\n"
                                         "training: {micro_batch: 2, global_batch: 8}\n"
                                         "parallel: {nproc_per_node: 4, tp: 2, pp: 2}\n");
  ProcessResult text = RunProcess({LtrainBinary(), "plan", path});
  ASSERT_EQ(text.exit_code, 0) << text.output;
  EXPECT_NE(text.output.find("the recipe's layout: tp 2 x pp 2 x dp 1"), std::string::npos) << text.output;
  EXPECT_NE(text.output.find("pp rank 1"), std::string::npos) << text.output;
  EXPECT_NE(text.output.find("communication, tp group of 2"), std::string::npos) << text.output;
  EXPECT_NE(text.output.find("pipeline bubble: 20.0%"), std::string::npos) << text.output;
  EXPECT_NE(text.output.find("layouts on 4 ranks"), std::string::npos) << text.output;

  ProcessResult json = RunProcess({LtrainBinary(), "plan", path, "--gpus", "8", "--gpu-memory", "40", "-o", "json"});
  ASSERT_EQ(json.exit_code, 0) << json.output;
  google::protobuf::Struct plan;
  ASSERT_TRUE(google::protobuf::util::JsonStringToMessage(json.output, &plan).ok()) << json.output;
  EXPECT_EQ(plan.fields().at("device").string_value(), "cuda");
  EXPECT_EQ(plan.fields().at("ranks").number_value(), 8);
  const auto& layouts = plan.fields().at("layouts").list_value();
  ASSERT_GT(layouts.values_size(), 0);
  const auto& first = layouts.values(0).struct_value().fields();
  EXPECT_TRUE(first.at("feasible").bool_value());
  EXPECT_GT(first.at("estimate").struct_value().fields().at("step_seconds").number_value(), 0);

  // 3 ranks cannot hold tp 2 x pp 2: said, and the other layouts are still ranked.
  ProcessResult odd = RunProcess({LtrainBinary(), "plan", path, "--set", "parallel.nproc_per_node=3"});
  ASSERT_EQ(odd.exit_code, 0) << odd.output;
  EXPECT_NE(odd.output.find("the recipe's layout cannot run on 3 ranks"), std::string::npos) << odd.output;
  EXPECT_NE(odd.output.find("layouts on 3 ranks"), std::string::npos) << odd.output;

  ProcessResult bad = RunProcess({LtrainBinary(), "plan", path, "--set", "model.layer=3"});
  EXPECT_EQ(bad.exit_code, 2) << bad.output;
  EXPECT_NE(bad.output.find("model.layer"), std::string::npos) << bad.output;

  // A mixture of experts: its parameters, and those a token runs through (2 of 8 experts in 2 of 4 blocks).
  ProcessResult moe = RunProcess({LtrainBinary(), "plan", path, "--set", "model.arch=qwen3", "--set",
                                  "model.moe.experts=8", "--set", "model.moe.every=2", "-o", "json"});
  ASSERT_EQ(moe.exit_code, 0) << moe.output;
  google::protobuf::Struct moe_plan;
  ASSERT_TRUE(google::protobuf::util::JsonStringToMessage(moe.output, &moe_plan).ok()) << moe.output;
  const double all = moe_plan.fields().at("model_parameters").number_value();
  const double active = moe_plan.fields().at("active_parameters").number_value();
  EXPECT_EQ(all - active, 2 * 6 * 3 * 64.0 * 192) << "6 idle experts of 3 matrices 64 x 192 in each of 2 blocks";
  EXPECT_EQ(plan.fields().count("active_parameters"), 0u) << "a dense model has no active count";

  // --longest-seq: the longest sequence that fits a CPU rank, on one rank and split over more by
  // context parallelism (the CPU's written-out attention: each rank's share of the T x T scores
  // shrinks with cp, so the longest grows).
  ProcessResult longest = RunProcess({LtrainBinary(), "plan", path, "--longest-seq", "-o", "json"});
  ASSERT_EQ(longest.exit_code, 0) << longest.output;
  google::protobuf::Struct longest_plan;
  ASSERT_TRUE(google::protobuf::util::JsonStringToMessage(longest.output, &longest_plan).ok()) << longest.output;
  const auto& rows = longest_plan.fields().at("longest_seq_len").list_value();
  ASSERT_EQ(rows.values_size(), 7);  // cp 1, 2, 4, ... 64
  const double one = rows.values(0).struct_value().fields().at("seq_len").number_value();
  const double two = rows.values(1).struct_value().fields().at("seq_len").number_value();
  const double four = rows.values(2).struct_value().fields().at("seq_len").number_value();
  EXPECT_GT(one, 0);
  EXPECT_GT(two, one) << longest.output;
  EXPECT_GT(four, two) << longest.output;
  EXPECT_EQ(static_cast<int64_t>(four) % 512, 0) << "a multiple of 2 * cp chunks of 64";

  // A program of the user's own has no model to plan: said, instead of planning a default GPT.
  std::string program = dir.Write("ep.yaml", "entrypoint:\n  command: [sleep, \"1\"]\n");
  ProcessResult own = RunProcess({LtrainBinary(), "plan", program});
  EXPECT_EQ(own.exit_code, 2) << own.output;
  EXPECT_NE(own.output.find("runs entrypoint.command, a program of your own"), std::string::npos) << own.output;
}

TEST(CliTest, BadOverrideIsNamed) {
  TempDir dir;
  std::string path = dir.Write("ok.yaml", "name: ok\ndata: {path: /d}\n");
  ProcessResult result = RunProcess({LtrainBinary(), "validate", path, "--set", "training.step=42"});
  EXPECT_EQ(result.exit_code, 2);
  EXPECT_NE(result.output.find("--set training.step: unknown key 'training.step'; did you mean 'training.steps'?"),
            std::string::npos)
      << result.output;
}

TEST(CliTest, EveryShippedRecipeValidates) {
  int checked = 0;
  for (const auto& entry : fs::directory_iterator(fs::path(SourceDir()) / "recipes")) {
    if (entry.path().extension() != ".yaml") continue;
    ProcessResult result = RunProcess({LtrainBinary(), "validate", entry.path().string()});
    EXPECT_EQ(result.exit_code, 0) << entry.path() << "\n" << result.output;
    ++checked;
  }
  EXPECT_GT(checked, 0);
}

TEST(CliTest, StatusAgainstNoCoordinatorFailsFastAndSaysWhy) {
  ProcessResult result = RunProcess({LtrainBinary(), "status", "--coordinator", "127.0.0.1:1"}, {}, std::chrono::seconds(10));
  EXPECT_FALSE(result.timed_out);
  EXPECT_LT(result.seconds, 5.0);
  EXPECT_EQ(result.exit_code, 3) << result.output;
  EXPECT_NE(result.output.find("cannot reach the coordinator at 127.0.0.1:1"), std::string::npos) << result.output;
}

TEST(CliTest, StatusOfAnEmptyHomeSaysSo) {
  TempDir home;
  ProcessResult result = RunProcess({LtrainBinary(), "status"}, {{"LTRAIN_HOME", home.path()}});
  EXPECT_EQ(result.exit_code, 0);
  EXPECT_NE(result.output.find("no jobs yet"), std::string::npos) << result.output;
}

// model.init_from: DIR derives the model from DIR/config.json, which `ltrain validate` prints; a key
// of it that ltrain cannot honour stops validate and launch with exit 2, naming the key.
TEST(CliTest, InitFromDerivesTheModelFromConfigJsonOrRefusesItsKey) {
  TempDir dir;
  const std::string config = R"({"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 300,
    "rope_theta": 10000.0, "rms_norm_eps": 1e-05, "tie_word_embeddings": false, "max_position_embeddings": 256,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 64}})";
  dir.Write("model/config.json", config);
  const std::string recipe = dir.Write("r.yaml", "name: r\nmodel: {init_from: " + dir.Join("model") +
                                                     ", seq_len: 128}\ndata: {path: " + dir.Join("data") + "}\n");
  ProcessResult valid = RunProcess({LtrainBinary(), "validate", recipe});
  EXPECT_EQ(valid.exit_code, 0) << valid.output;
  for (const char* line : {"arch: llama", "d_model: 64", "kv_heads: 2", "ffn: 128", "vocab: 300", "rope_scaling: llama3",
                           "rope_factor: 8", "rope_original_positions: 64", "tie_embeddings: false"}) {
    EXPECT_NE(valid.output.find(line), std::string::npos) << line << "\n" << valid.output;
  }
  std::string yarn = config;
  yarn.replace(yarn.find("\"llama3\""), 8, "\"yarn\"");
  dir.Write("model/config.json", yarn);
  for (const char* command : {"validate", "launch"}) {
    ProcessResult refused = RunProcess({LtrainBinary(), command, recipe}, {{"LTRAIN_HOME", dir.Join("home")}});
    EXPECT_EQ(refused.exit_code, 2) << refused.output;
    EXPECT_NE(refused.output.find("config.json: rope_scaling.rope_type 'yarn' is not supported"), std::string::npos)
        << refused.output;
  }
}

TEST(CliTest, LaunchWithoutPreparedDataExplainsTheFix) {
  TempDir dir;
  std::string path = dir.Write("r.yaml", "name: r\ndata: {path: " + dir.Join("nodata") + "}\n");
  ProcessResult result = RunProcess({LtrainBinary(), "launch", path}, {{"LTRAIN_HOME", dir.Join("home")}});
  EXPECT_EQ(result.exit_code, 2);
  EXPECT_NE(result.output.find("ltrain data prepare --input"), std::string::npos) << result.output;
}

TEST(CliTest, DataPrepareWritesTrainAndValidationFiles) {
  TempDir dir;
  std::string text;
  for (int i = 0; i < 200; ++i) text += "to be or not to be, that is the question.\n";
  std::string input = dir.Write("in.txt", text);
  ProcessResult result = RunProcess({LtrainBinary(), "data", "prepare", "--input", input, "--output", dir.Join("out"),
                              "--val-fraction", "0.1"});
  EXPECT_EQ(result.exit_code, 0) << result.output;
  EXPECT_TRUE(fs::exists(dir.Join("out/train-00000.bin")));
  EXPECT_TRUE(fs::exists(dir.Join("out/val-00000.bin")));
  EXPECT_TRUE(fs::exists(dir.Join("out/data.yaml")));
  ProcessResult missing = RunProcess({LtrainBinary(), "data", "prepare", "--input", dir.Join("absent.txt"), "--output",
                               dir.Join("out2")});
  EXPECT_EQ(missing.exit_code, 2);
  EXPECT_NE(missing.output.find("absent.txt"), std::string::npos) << missing.output;
}

// Peak memory of `ltrain data prepare` does not follow the input: JSON Lines of 16 MB and of 64 MB
// (varied words, byte tokens) peak within half of each other, where holding the input and its tokens
// (as before shards) would take over 250 MB more for the larger. Peak RSS from GNU time, as a user
// measures it.
TEST(CliTest, DataPreparePeakMemoryDoesNotFollowTheInputSize) {
  TempDir dir;
  auto corpus = [&](const std::string& name, int64_t bytes) {
    std::ofstream out(dir.Join(name), std::ios::binary);
    uint64_t state = 88172645463325252ULL;
    static const char* words[] = {"the", "model", "reads", "tokens", "from", "shards", "of", "a", "corpus", "and"};
    int64_t written = 0;
    while (written < bytes) {
      std::string line = "{\"text\": \"";
      for (int w = 0; w < 200; ++w) {
        state ^= state << 13, state ^= state >> 7, state ^= state << 17;
        line += words[state % 10];
        line += ' ';
      }
      line += "\"}\n";
      out << line;
      written += static_cast<int64_t>(line.size());
    }
    return dir.Join(name);
  };
  auto peak_kb = [&](const std::string& input, const std::string& out) {
    ProcessResult r = RunProcess({"/usr/bin/time", "-f", "peak_kb=%M", LtrainBinary(), "data", "prepare", "--input",
                                  input, "--output", dir.Join(out), "--threads", "2", "-q"},
                                 {}, std::chrono::seconds(300));
    EXPECT_EQ(r.exit_code, 0) << r.output;
    std::smatch m;
    EXPECT_TRUE(std::regex_search(r.output, m, std::regex(R"(peak_kb=(\d+))"))) << "GNU time (package time): " << r.output;
    return m.empty() ? 0.0 : std::stod(m[1]);
  };
  const double small = peak_kb(corpus("small.jsonl", 16 << 20), "small");
  const double large = peak_kb(corpus("large.jsonl", 64 << 20), "large");
  EXPECT_LT(large, small * 1.5) << "peak " << small / 1024 << " MB for 16 MB, " << large / 1024 << " MB for 64 MB";
  EXPECT_LT(large, 150.0 * 1024) << "peak " << large / 1024 << " MB for 64 MB";
}

// `ltrain data inspect` says what a prepared dataset holds, as text and as JSON; --verify reads every
// shard against its checksum and exits 1 for one that changed.
TEST(CliTest, DataInspectShowsTheManifestAndVerifiesTheShards) {
  TempDir dir;
  std::string lines;
  for (int i = 0; i < 400; ++i) lines += "{\"text\": \"record " + std::to_string(i) + " of the corpus\"}\n";
  ProcessResult prepared = RunProcess({LtrainBinary(), "data", "prepare", "--input", dir.Write("c.jsonl", lines),
                                       "--output", dir.Join("out"), "--shard-size", "4KB", "-q"});
  ASSERT_EQ(prepared.exit_code, 0) << prepared.output;
  ProcessResult text = RunProcess({LtrainBinary(), "data", "inspect", dir.Join("out"), "--verify"});
  ASSERT_EQ(text.exit_code, 0) << text.output;
  EXPECT_NE(text.output.find("tokenizer: byte, vocab 256"), std::string::npos) << text.output;
  EXPECT_NE(text.output.find("train-00001.bin"), std::string::npos) << text.output;
  EXPECT_NE(text.output.find("verified: every shard's tokens match"), std::string::npos) << text.output;
  EXPECT_TRUE(std::regex_search(text.output, std::regex("sample \\(the first training document\\):\nrecord \\d+ of the corpus\n")))
      << "the decoded sample, one document: " << text.output;
  ProcessResult json = RunProcess({LtrainBinary(), "data", "inspect", dir.Join("out"), "-o", "json"});
  ASSERT_EQ(json.exit_code, 0) << json.output;
  const std::string check =
      "import json, sys\n"
      "d = json.loads(sys.stdin.read())\n"
      "assert d['format'] == 2 and d['vocab'] == 256 and d['dtype'] == 'uint16', d\n"
      "assert d['train_documents'] + d['val_documents'] >= 400, d\n"
      "assert sum(s['tokens'] for s in d['shards']) == d['train_tokens'] + d['val_tokens'], d\n"
      "assert d['inputs'][0]['documents'] == 400, d['inputs']\n"
      "print('ok')\n";
  ProcessResult parsed = RunProcess({"/bin/sh", "-c", "/usr/bin/python3 " + dir.Write("check.py", check) + " < " +
                                                          dir.Write("inspect.json", json.output)});
  EXPECT_EQ(parsed.output, "ok\n") << parsed.output << json.output;
  // One token changed in the second shard.
  {
    std::fstream shard(dir.Join("out/train-00001.bin"), std::ios::in | std::ios::out | std::ios::binary);
    shard.seekp(40);
    shard.put('\x7f');
  }
  ProcessResult damaged = RunProcess({LtrainBinary(), "data", "inspect", dir.Join("out"), "--verify"});
  EXPECT_EQ(damaged.exit_code, 1) << damaged.output;
  EXPECT_NE(damaged.output.find("damaged: 1 shard(s)"), std::string::npos) << damaged.output;
  EXPECT_NE(damaged.output.find("  train-00001.bin"), std::string::npos) << damaged.output;
  ProcessResult none = RunProcess({LtrainBinary(), "data", "inspect", dir.Join("nothing")});
  EXPECT_EQ(none.exit_code, 2) << none.output;
}

// What data prepare prints is the recipe section to paste, and the token shards are what the README
// tells a nanoGPT reader: a 28-byte header, then the tokens (byte tokens here: the text itself).
TEST(CliTest, DataPreparePrintsTheRecipeSectionAndTheTokensReadAsTheReadmeSays) {
  TempDir dir;
  std::string text;
  for (int i = 0; i < 200; ++i) text += "to be or not to be, that is the question.\n";
  ProcessResult result = RunProcess({LtrainBinary(), "data", "prepare", "--input", dir.Write("in.txt", text),
                                     "--output", dir.Join("out"), "--val-fraction", "0.1"});
  ASSERT_EQ(result.exit_code, 0) << result.output;
  EXPECT_NE(result.output.find("in a recipe:\n  data:\n    path: " + dir.Join("out") +
                               "\n    tokenizer: byte\n  model:\n    vocab: 256\n"),
            std::string::npos)
      << result.output;
  const std::string check =
      "import numpy as np, struct, sys\n"
      "path = sys.argv[1]\n"
      "magic, version, vocab, count, width = struct.unpack('<8sIIQI', open(path, 'rb').read(28))\n"
      "assert magic == b'LTRNTOK1' and version == 1 and vocab == 256 and width == 2, (magic, version, vocab, width)\n"
      "tokens = np.memmap(path, dtype=np.uint16, mode='r', offset=28)\n"
      "assert len(tokens) == count, (len(tokens), count)\n"
      "print(bytes(tokens[:41].astype(np.uint8)).decode())\n";
  ProcessResult read = RunProcess({"/usr/bin/python3", dir.Write("read.py", check), dir.Join("out/train-00000.bin")});
  ASSERT_EQ(read.exit_code, 0) << read.output;
  EXPECT_EQ(read.output, "to be or not to be, that is the question.\n") << read.output;
}

// A recipe of every default over a little prepared text in `dir`; empty when the text does not prepare.
std::string RecipeOverPreparedData(TempDir& dir) {
  std::string text;
  for (int i = 0; i < 200; ++i) text += "to be or not to be, that is the question.\n";
  ProcessResult prepared = RunProcess({LtrainBinary(), "data", "prepare", "--input", dir.Write("in.txt", text),
                                       "--output", dir.Join("data")});
  EXPECT_EQ(prepared.exit_code, 0) << prepared.output;
  if (prepared.exit_code != 0) return "";
  return dir.Write("r.yaml", "name: r\ndata: {path: " + dir.Join("data") + "}\n");
}

// Standalone, nothing would run the job once the command returned: --detach is refused with the way out.
TEST(CliTest, DetachWithoutACoordinatorIsRefusedWithTheReason) {
  TempDir dir;
  const std::string recipe = RecipeOverPreparedData(dir);
  ASSERT_FALSE(recipe.empty());
  ProcessResult result = RunProcess({LtrainBinary(), "launch", recipe, "--detach"}, {{"LTRAIN_HOME", dir.Join("home")}},
                                    std::chrono::seconds(20));
  EXPECT_EQ(result.exit_code, 2) << result.output;
  EXPECT_NE(result.output.find("--detach needs --coordinator"), std::string::npos) << result.output;
  EXPECT_EQ(result.output.find("submitted"), std::string::npos) << "no job may start: " << result.output;
}

// Standalone, this machine is the only node: a job that needs more nodes, or a GPU it lacks, is refused
// at once instead of waiting forever for nodes that cannot come.
TEST(CliTest, AStandaloneLaunchRefusesWhatThisMachineCannotRun) {
  TempDir dir;
  const std::string recipe = RecipeOverPreparedData(dir);
  ASSERT_FALSE(recipe.empty());
  const std::map<std::string, std::string> env = {{"LTRAIN_HOME", dir.Join("home")}};
  ProcessResult nodes = RunProcess({LtrainBinary(), "launch", recipe, "--set", "parallel.nodes=2"}, env,
                                   std::chrono::seconds(20));
  EXPECT_EQ(nodes.exit_code, 2) << nodes.output;
  EXPECT_NE(nodes.output.find("parallel.nodes asks for 2 nodes, and a standalone ltrain launch runs on this machine alone"),
            std::string::npos)
      << nodes.output;
  ProcessResult program = RunProcess({LtrainBinary(), "run", "--nodes", "3", "--", "true"}, env, std::chrono::seconds(20));
  EXPECT_EQ(program.exit_code, 2) << program.output;
  if (!fs::exists("/dev/nvidia0")) {
    ProcessResult cuda = RunProcess({LtrainBinary(), "run", "--device", "cuda", "--", "true"}, env,
                                    std::chrono::seconds(20));
    EXPECT_EQ(cuda.exit_code, 2) << cuda.output;
    EXPECT_NE(cuda.output.find("parallel.device is cuda, and this machine has no GPU"), std::string::npos)
        << cuda.output;
  }
  ProcessResult listed = RunProcess({LtrainBinary(), "status"}, env);
  EXPECT_NE(listed.output.find("no jobs yet"), std::string::npos) << "nothing was submitted: " << listed.output;
}

// An empty directory, too little text for one training sample: refused at once, naming the fix,
// instead of an abort or a run that fails later.
TEST(CliTest, DataPrepareRefusesAnEmptyDirectoryAndTooLittleText) {
  TempDir dir;
  fs::create_directories(dir.Join("texts"));
  ProcessResult directory = RunProcess({LtrainBinary(), "data", "prepare", "--input", dir.Join("texts"), "--output",
                                        dir.Join("out")});
  EXPECT_EQ(directory.exit_code, 2) << directory.output;
  EXPECT_NE(directory.output.find("holds no non-empty file"), std::string::npos) << directory.output;
  ProcessResult tiny = RunProcess({LtrainBinary(), "data", "prepare", "--input", dir.Write("tiny.txt", "eighteen bytes...\n"),
                                   "--output", dir.Join("out")});
  EXPECT_EQ(tiny.exit_code, 2) << tiny.output;
  EXPECT_NE(tiny.output.find("too little text to train on: 18 training tokens"), std::string::npos) << tiny.output;
  ProcessResult small = RunProcess({LtrainBinary(), "data", "prepare", "--input", dir.Write("small.txt", std::string(600, 'a')),
                                    "--output", dir.Join("out"), "--val-fraction", "0"});
  EXPECT_EQ(small.exit_code, 2) << small.output;
  EXPECT_NE(small.output.find("too little text to train on: 600 training tokens"), std::string::npos) << small.output;
  EXPECT_FALSE(fs::exists(dir.Join("out"))) << "nothing written for a refused corpus";
}

// The flags a `--help` lists: long names, with the short ones as the help pairs them ("-o,--output").
std::map<std::string, std::string> HelpFlags(const std::vector<std::string>& command) {
  std::vector<std::string> argv = {LtrainBinary()};
  argv.insert(argv.end(), command.begin(), command.end());
  argv.push_back("--help");
  ProcessResult help = RunProcess(argv);
  std::map<std::string, std::string> flags;  // long (or lone short) -> short ("" when none)
  std::istringstream lines(help.output);
  std::string line;
  const std::regex flag(R"(^\s+(?:(-[a-zA-Z]),)?(--?[a-z][a-z0-9-]*))");
  std::smatch m;
  while (std::getline(lines, line)) {
    if (std::regex_search(line, m, flag) && m[2] != "--help") flags[m[2]] = m[1];
  }
  return flags;
}

// The README's table of commands lists every command, and for each every flag its `--help` shows and
// no other (the global TLS, token and log flags aside).
TEST(CliTest, TheReadmeCommandTableMatchesEveryHelp) {
  std::ifstream in(SourceDir() + "/README.md");
  std::map<std::string, std::set<std::string>> readme;  // "data prepare" -> {"--input", "-o", ...}
  const std::regex row(R"(^\| `ltrain ([a-z]+)((?: [a-z]+)?)([^`]*)` \|)");
  const std::regex flag(R"((?:^|[\s\[])(--?[a-zA-Z][a-z0-9-]*))");
  std::string line;
  std::smatch m;
  while (std::getline(in, line)) {
    if (!std::regex_search(line, m, row)) continue;
    std::string command = m[1];
    std::string rest = m[3];
    if (command == "data" || command == "checkpoint") {
      command += m[2].str();
    } else {
      rest = m[2].str() + rest;
    }
    std::set<std::string>& flags = readme[command];
    for (std::sregex_iterator it(rest.begin(), rest.end(), flag), end; it != end; ++it) flags.insert((*it)[1]);
  }
  ASSERT_FALSE(readme.empty()) << "no `ltrain ...` rows in README.md";

  ProcessResult top = RunProcess({LtrainBinary(), "--help"});
  const std::string listed = top.output.substr(top.output.find("Subcommands:"));
  std::istringstream commands(listed);
  std::getline(commands, line);
  const std::set<std::string> global = {"--tls-ca", "--tls-cert", "--tls-key", "--token-file", "--insecure",
                                        "--log-level"};
  int compared = 0;
  while (std::getline(commands, line)) {
    if (!std::regex_search(line, m, std::regex(R"(^  ([a-z]+) )"))) continue;
    std::vector<std::string> names = {m[1]};
    if (names[0] == "data") names = {"data prepare"};
    if (names[0] == "checkpoint") names = {"checkpoint inspect"};
    for (const std::string& name : names) {
      SCOPED_TRACE(name);
      ASSERT_TRUE(readme.count(name)) << "README.md's commands table has no row for `ltrain " << name << "`";
      std::vector<std::string> argv;
      std::istringstream words(name);
      for (std::string word; words >> word;) argv.push_back(word);
      const std::map<std::string, std::string> help = HelpFlags(argv);
      const std::set<std::string>& documented = readme.at(name);
      for (const auto& [long_name, short_name] : help) {
        EXPECT_TRUE(documented.count(long_name) || (!short_name.empty() && documented.count(short_name)))
            << "`ltrain " << name << " --help` has " << long_name << "; the README's row does not";
      }
      for (const std::string& written : documented) {
        const bool known = global.count(written) || help.count(written) ||
                           std::any_of(help.begin(), help.end(), [&](const auto& f) { return f.second == written; });
        EXPECT_TRUE(known) << "the README's row of `ltrain " << name << "` has " << written << "; --help does not";
      }
      ++compared;
    }
  }
  EXPECT_EQ(compared, 18) << listed;
}

// The coordinator says the address it listens on: 0.0.0.0 stays 0.0.0.0, with the port it got. Beyond
// loopback without TLS it serves only when told --insecure, and then says so at start and to every
// `ltrain status`; without the flag it refuses (exit 2) and says what to give.
TEST(CliTest, TheCoordinatorLogsTheAddressItListensOn) {
  TempDir dir;
  const std::map<std::string, std::string> env = {{"LTRAIN_TOKEN", "a-token-for-the-test"},
                                                  {"LTRAIN_HOME", dir.Join("home")}};
  ProcessResult refused = RunProcess({LtrainBinary(), "coordinator", "--listen", "0.0.0.0:0", "--state-dir",
                                      dir.Join("state")},
                                     env);
  EXPECT_EQ(refused.exit_code, 2) << refused.output;
  EXPECT_NE(refused.output.find("--listen 0.0.0.0:0 is beyond loopback, and this coordinator has no TLS"),
            std::string::npos)
      << refused.output;
  EXPECT_NE(refused.output.find("or pass --insecure on a network you trust"), std::string::npos) << refused.output;
  ProcessResult http = RunProcess({LtrainBinary(), "coordinator", "--listen", "127.0.0.1:0", "--http-listen",
                                   "0.0.0.0:0", "--state-dir", dir.Join("state")},
                                  env);
  EXPECT_EQ(http.exit_code, 2) << http.output;
  EXPECT_NE(http.output.find("--http-listen 0.0.0.0:0 is beyond loopback"), std::string::npos) << http.output;

  Subprocess coordinator({LtrainBinary(), "coordinator", "--listen", "0.0.0.0:0", "--port-file", dir.Join("port"),
                          "--state-dir", dir.Join("state"), "--insecure"},
                         env);
  const int port = WaitForPortFile(dir.Join("port"));
  ASSERT_GT(port, 0) << coordinator.Output();
  EXPECT_TRUE(coordinator.WaitForOutput("listening on 0.0.0.0:" + std::to_string(port) + ",", std::chrono::seconds(5)))
      << coordinator.Output();
  const std::string warning = "this coordinator serves 0.0.0.0:0 without TLS (--insecure)";
  EXPECT_NE(coordinator.Output().find(warning), std::string::npos) << coordinator.Output();
  ProcessResult status = RunProcess({LtrainBinary(), "status", "--coordinator", "127.0.0.1:" + std::to_string(port)},
                                    env);
  EXPECT_EQ(status.exit_code, 0) << status.output;
  EXPECT_NE(status.output.find("ltrain: warning: " + warning), std::string::npos) << status.output;
  coordinator.Signal(SIGTERM);
  EXPECT_EQ(coordinator.Wait(std::chrono::seconds(10)).exit_code, 0) << coordinator.Output();
}

// A coordinator started without a token makes one in its state directory (0600) and says where, never
// what; this user's commands with that directory as $LTRAIN_HOME read it by default, and a client
// without it is refused. The next start keeps the same token.
// The README's cluster block, as written, in a copy of the repository's layout (build/cmd, recipes/,
// the quickstart's data) with a home of its own and a free port for 7070: a coordinator over TLS with
// a token, an agent and a launch that succeeds.
TEST(CliTest, TheReadmesClusterBlockRunsAsWritten) {
  std::ifstream in(SourceDir() + "/README.md");
  std::stringstream buffer;
  buffer << in.rdbuf();
  const std::string readme = buffer.str();
  const size_t begin = readme.find("<!-- cluster block");
  const size_t end = readme.find("<!-- end of cluster block -->");
  ASSERT_NE(begin, std::string::npos);
  ASSERT_NE(end, std::string::npos);
  std::string block = readme.substr(begin, end - begin);
  block = block.substr(block.find("```sh\n") + 6);
  block = block.substr(0, block.find("```"));
  ASSERT_NE(block.find("--tls-cert"), std::string::npos) << block;
  TempDir dir;
  const std::string port = std::to_string(FreePort());
  for (size_t at; (at = block.find("7070")) != std::string::npos;) block.replace(at, 4, port);
  fs::create_directories(dir.Join("repo/build/data"));
  fs::create_directories(dir.Join("repo/recipes"));
  fs::create_directory_symlink(fs::path(LtrainBinary()).parent_path(), dir.Join("repo/build/cmd"));
  fs::copy_file(SourceDir() + "/recipes/quickstart.yaml", dir.Join("repo/recipes/quickstart.yaml"));
  ProcessResult prepared = PrepareLicenseData(dir.Join("repo/build/data/licenses"));
  ASSERT_EQ(prepared.exit_code, 0) << prepared.output;
  const std::string script = dir.Write("cluster.sh", "set -e\ntrap 'kill $(jobs -p) 2>/dev/null' EXIT\ncd " +
                                                         dir.Join("repo") + "\n" + block);
  ProcessResult ran = RunProcess({"/bin/bash", script}, {{"HOME", dir.Join("home")}, {"LTRAIN_HOME", ""},
                                                         {"OMP_NUM_THREADS", "1"}},
                                 std::chrono::seconds(300));
  EXPECT_EQ(ran.exit_code, 0) << block << "\n" << ran.output;
  EXPECT_NE(ran.output.find("job SUCCEEDED"), std::string::npos) << ran.output;
  EXPECT_TRUE(fs::exists(dir.Join("home/.ltrain/tls/token")));
}

TEST(CliTest, ACoordinatorWithoutATokenMakesOneThatItsUsersCommandsRead) {
  TempDir dir;
  const std::map<std::string, std::string> home = {{"LTRAIN_HOME", dir.Join("home")}};
  auto start = [&] {
    return std::make_unique<Subprocess>(std::vector<std::string>{LtrainBinary(), "coordinator", "--listen",
                                                                 "127.0.0.1:0", "--port-file", dir.Join("port")},
                                        home);
  };
  std::unique_ptr<Subprocess> coordinator = start();
  const int port = WaitForPortFile(dir.Join("port"));
  ASSERT_GT(port, 0) << coordinator->Output();
  const std::string token_file = dir.Join("home/token");
  struct stat st {};
  ASSERT_EQ(::stat(token_file.c_str(), &st), 0) << coordinator->Output();
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  std::string token;
  std::ifstream(token_file) >> token;
  ASSERT_GE(token.size(), 32u);
  EXPECT_NE(coordinator->Output().find("clients need the token in " + token_file), std::string::npos)
      << coordinator->Output();
  EXPECT_EQ(coordinator->Output().find(token), std::string::npos) << "the token itself is never printed";
  const std::string address = "127.0.0.1:" + std::to_string(port);
  ProcessResult own = RunProcess({LtrainBinary(), "status", "--coordinator", address}, home);
  EXPECT_EQ(own.exit_code, 0) << own.output;
  ProcessResult other = RunProcess({LtrainBinary(), "status", "--coordinator", address},
                                   {{"LTRAIN_HOME", dir.Join("elsewhere")}});
  EXPECT_EQ(other.exit_code, 3) << other.output;
  EXPECT_NE(other.output.find("this coordinator requires a bearer token"), std::string::npos) << other.output;
  coordinator->Signal(SIGTERM);
  EXPECT_EQ(coordinator->Wait(std::chrono::seconds(10)).exit_code, 0) << coordinator->Output();
  fs::remove(dir.Join("port"));
  coordinator = start();
  ASSERT_GT(WaitForPortFile(dir.Join("port")), 0) << coordinator->Output();
  std::string again;
  std::ifstream(token_file) >> again;
  EXPECT_EQ(again, token);
  coordinator->Signal(SIGTERM);
  EXPECT_EQ(coordinator->Wait(std::chrono::seconds(10)).exit_code, 0) << coordinator->Output();
}

TEST(CliTest, HelpAndVersion) {
  ProcessResult help = RunProcess({LtrainBinary(), "--help"});
  EXPECT_EQ(help.exit_code, 0);
  EXPECT_NE(help.output.find("launch"), std::string::npos);
  ProcessResult version = RunProcess({LtrainBinary(), "--version"});
  EXPECT_EQ(version.exit_code, 0);
  EXPECT_NE(version.output.find("ltrain 0."), std::string::npos);
}

// A command line CLI11 refuses is invalid input (exit 2) like any other, and says what was wrong.
TEST(CliTest, ABadCommandLineExitsTwo) {
  TempDir home;
  const std::map<std::string, std::string> env = {{"LTRAIN_HOME", home.path()}};
  ProcessResult unknown = RunProcess({LtrainBinary(), "bogus"}, env);
  EXPECT_EQ(unknown.exit_code, 2) << unknown.output;
  EXPECT_NE(unknown.output.find("unknown command 'bogus'"), std::string::npos) << unknown.output;
  ProcessResult flag = RunProcess({LtrainBinary(), "status", "--bogus"}, env);
  EXPECT_EQ(flag.exit_code, 2) << flag.output;
  ProcessResult number = RunProcess({LtrainBinary(), "status", "--limit", "abc"}, env);
  EXPECT_EQ(number.exit_code, 2) << number.output;
  ProcessResult form = RunProcess({LtrainBinary(), "status", "-o", "yaml"}, env);
  EXPECT_EQ(form.exit_code, 2) << form.output;
  EXPECT_NE(form.output.find("'yaml' is not table, text or json"), std::string::npos) << form.output;
}

// `output: text` (or table) in config.yaml, or in $LTRAIN_OUTPUT, serves every command, generate's
// output option among them.
TEST(CliTest, EveryOutputWordServesEveryCommand) {
  TempDir home;
  for (const char* word : {"text", "table", "json"}) {
    std::ofstream(home.Join("config.yaml")) << "output: " << word << "\n";
    for (const std::vector<std::string>& command : std::vector<std::vector<std::string>>{
             {"status"}, {"list"}, {"validate", "--help"}, {"generate", "--help"}}) {
      std::vector<std::string> argv = {LtrainBinary()};
      argv.insert(argv.end(), command.begin(), command.end());
      ProcessResult result = RunProcess(argv, {{"LTRAIN_HOME", home.path()}});
      EXPECT_EQ(result.exit_code, 0) << word << " " << command.front() << "\n" << result.output;
    }
  }
  ProcessResult json = RunProcess({LtrainBinary(), "status"}, {{"LTRAIN_HOME", home.path()}});
  EXPECT_EQ(json.output.rfind("{", 0), 0u) << json.output;
}

// generate and export of a path that holds no checkpoint: invalid input (exit 2), said in their own words.
TEST(CliTest, GenerateAndExportOfNoCheckpointSayWhatToName) {
  TempDir dir;
  for (const char* command : {"generate", "export"}) {
    std::vector<std::string> argv = {LtrainBinary(), command, dir.Join("nothing")};
    if (std::string(command) == "export") argv.insert(argv.end(), {"--output", dir.Join("out")});
    ProcessResult result = RunProcess(argv, {{"LTRAIN_HOME", dir.Join("home")}});
    EXPECT_EQ(result.exit_code, 2) << result.output;
    EXPECT_NE(result.output.find(dir.Join("nothing") + " is not a checkpoint: name a job's checkpoint directory"),
              std::string::npos)
        << result.output;
  }
}

// `ltrain checkpoint inspect`: a committed step written the way the worker writes it (a
// safetensors shard, meta.yaml, latest), read from its checkpoint directory or its step directory;
// `--verify` re-hashes and finds a flipped byte; `-o json` for scripts.
TEST(CliTest, CheckpointInspectShowsTheFilesAndVerifiesThem) {
  TempDir dir;
  const std::string step = dir.Join("ck/step-7");
  fs::create_directories(step);
  std::vector<float> values(256, 0.25f);
  StatusOr<std::unique_ptr<SafetensorsWriter>> writer =
      SafetensorsWriter::Create(step + "/model-rank-0.safetensors", {{"model.w", "F32", {256}, 1024}});
  ASSERT_TRUE(writer.ok()) << writer.status().message();
  ASSERT_TRUE((*writer)->Write(values.data(), 1024).ok());
  StatusOr<FileDigest> digest = (*writer)->Finish();
  ASSERT_TRUE(digest.ok());
  CheckpointMeta meta;
  meta.step = 7;
  meta.commit = 3;
  meta.job_id = "tiny-4";
  meta.layout = "tp=1 pp=1 zero=0";
  meta.rng_state = "00";
  meta.files["model-rank-0.safetensors"] = {digest->bytes, digest->xxh3};
  dir.Write("ck/step-7/meta.yaml", CheckpointMetaYaml(meta, ""));
  dir.Write("ck/latest", "step-7\n");

  ProcessResult text = RunProcess({LtrainBinary(), "checkpoint", "inspect", dir.Join("ck")});
  ASSERT_EQ(text.exit_code, 0) << text.output;
  for (const std::string& want : {std::string("checkpoint ") + step, std::string("step        7 (commit 3, format 3)"),
                                  std::string("job         tiny-4"), std::string("model-rank-0.safetensors"),
                                  digest->xxh3, std::string("sizes match")}) {
    EXPECT_NE(text.output.find(want), std::string::npos) << want << "\n" << text.output;
  }
  ProcessResult verified = RunProcess({LtrainBinary(), "checkpoint", "inspect", step, "--verify"});
  EXPECT_EQ(verified.exit_code, 0) << verified.output;
  EXPECT_NE(verified.output.find("verifies    yes"), std::string::npos) << verified.output;

  ProcessResult json = RunProcess({LtrainBinary(), "checkpoint", "inspect", step, "-o", "json"});
  ASSERT_EQ(json.exit_code, 0) << json.output;
  google::protobuf::Struct parsed;
  ASSERT_TRUE(google::protobuf::util::JsonStringToMessage(json.output, &parsed).ok()) << json.output;
  EXPECT_EQ(parsed.fields().at("step").number_value(), 7);
  EXPECT_EQ(parsed.fields().at("job_id").string_value(), "tiny-4");
  EXPECT_EQ(parsed.fields().at("total_bytes").number_value(), static_cast<double>(digest->bytes));
  const auto& file = parsed.fields().at("files").list_value().values(0).struct_value().fields();
  EXPECT_EQ(file.at("name").string_value(), "model-rank-0.safetensors");
  EXPECT_EQ(file.at("xxh3").string_value(), digest->xxh3);

  {
    std::fstream f(step + "/model-rank-0.safetensors", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(static_cast<std::streamoff>(digest->bytes - 4));
    f.put('\x7f');
  }
  ProcessResult unverified = RunProcess({LtrainBinary(), "checkpoint", "inspect", dir.Join("ck")});
  EXPECT_EQ(unverified.exit_code, 0) << unverified.output;  // the size still matches
  ProcessResult corrupt = RunProcess({LtrainBinary(), "checkpoint", "inspect", dir.Join("ck"), "--verify"});
  EXPECT_EQ(corrupt.exit_code, 1) << corrupt.output;
  EXPECT_NE(corrupt.output.find("xxh3 mismatch"), std::string::npos) << corrupt.output;
  EXPECT_NE(corrupt.output.find("verifies    no"), std::string::npos) << corrupt.output;

  ProcessResult nothing = RunProcess({LtrainBinary(), "checkpoint", "inspect", dir.Join("absent")});
  EXPECT_EQ(nothing.exit_code, 2) << nothing.output;
}

}  // namespace
}  // namespace ltrain::testing
