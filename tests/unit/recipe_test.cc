#include "common/recipe.h"

#include <gtest/gtest.h>

#include <fstream>
#include <sstream>

#include "common/recipe_schema.h"

namespace ltrain {
namespace {

constexpr const char* kGood = R"(name: tiny
model: {layers: 2, d_model: 64, heads: 4, seq_len: 32, vocab: 256}
data: {path: /tmp/data}
training: {steps: 20, micro_batch: 4, global_batch: 8}
parallel: {nodes: 1, nproc_per_node: 2}
)";

TEST(RecipeTest, ParsesAndFillsDefaults) {
  RecipeParseResult result = ParseRecipe(kGood, "tiny.yaml");
  ASSERT_TRUE(result.ok()) << result.ErrorText();
  EXPECT_EQ(result.recipe.name, "tiny");
  EXPECT_EQ(result.recipe.model.d_model, 64);
  EXPECT_EQ(result.recipe.parallel.world_size(), 2);
  EXPECT_EQ(result.recipe.accumulation_steps(), 1);
  EXPECT_EQ(result.recipe.training.lr_schedule, LrScheduleKind::kCosine);
}

// The name becomes the job id, a directory name and part of log lines.
// ZeRO-1 and 400 MB buckets are the defaults where they pay (GPUs, one node); what a recipe says wins.
TEST(RecipeTest, DataParallelDefaultsFollowTheTopology) {
  auto parallel = [](const std::string& keys) {
    RecipeParseResult r = ParseRecipe(
        "data: {path: /d}\ntraining: {micro_batch: 1, global_batch: 16}\nparallel: {" + keys + "}\n", "t.yaml");
    EXPECT_TRUE(r.ok()) << r.ErrorText();
    return r.recipe.parallel;
  };
  ParallelSpec cuda_dp2 = parallel("device: cuda, nproc_per_node: 2");
  EXPECT_EQ(cuda_dp2.zero, 1);
  EXPECT_EQ(cuda_dp2.bucket_mb, 400);
  ParallelSpec cpu_dp2 = parallel("nproc_per_node: 2");
  EXPECT_EQ(cpu_dp2.zero, 0);
  EXPECT_EQ(cpu_dp2.bucket_mb, 25);
  ParallelSpec two_nodes = parallel("device: cuda, nodes: 2, nproc_per_node: 2");
  EXPECT_EQ(two_nodes.zero, 1);
  EXPECT_EQ(two_nodes.bucket_mb, 25) << "across nodes, DDP's bucket";
  EXPECT_EQ(parallel("device: cuda, nproc_per_node: 2, tp: 2").zero, 0) << "no data parallelism";
  ParallelSpec said = parallel("device: cuda, nproc_per_node: 2, zero: 0, bucket_mb: 25");
  EXPECT_EQ(said.zero, 0);
  EXPECT_EQ(said.bucket_mb, 25);
}

TEST(RecipeTest, JobNamesFollowTheRuleAndABadOneGetsASuggestion) {
  for (const std::string& good : {std::string("tiny"), std::string("gpt-1.3b_run.2"), std::string("A"), std::string("step"), std::string(64, 'x')}) {
    EXPECT_EQ(JobNameProblem(good), "") << good;
  }
  for (const char* bad : {"", ".", "..", "../x", "/abs", "a b", "new\nline", "esc\x1b[31m", "caf\xc3\xa9"}) {
    EXPECT_NE(JobNameProblem(bad), "") << bad;
    EXPECT_EQ(JobNameProblem(SuggestJobName(bad)), "") << bad << " -> " << SuggestJobName(bad);
  }
  EXPECT_NE(JobNameProblem(std::string(65, 'x')), "");
  EXPECT_EQ(SuggestJobName("../../var/x"), "var-x");
  EXPECT_EQ(SuggestJobName("my run #3"), "my-run-3");
  EXPECT_EQ(SuggestJobName(".."), "job");

  RecipeParseResult bad = ParseRecipe(std::string(kGood).replace(0, 10, "name: \"../../../../var/x\\n\\e[31mFAKE\""), "r.yaml");
  ASSERT_FALSE(bad.ok());
  const std::string text = bad.ErrorText();
  EXPECT_NE(text.find("r.yaml:1:"), std::string::npos) << text;
  EXPECT_NE(text.find("may hold only A-Z a-z 0-9 . _ -"), std::string::npos) << text;
  EXPECT_NE(text.find("for example name: var-x-31mFAKE"), std::string::npos) << text;
  EXPECT_EQ(text.find('\x1b'), std::string::npos) << "the name is shown escaped";
  // A recipe file whose stem is not a valid name gets a valid default name.
  RecipeParseResult stem = ParseRecipe(std::string(kGood).substr(11), "/tmp/my run.yaml");
  ASSERT_TRUE(stem.ok()) << stem.ErrorText();
  EXPECT_EQ(stem.recipe.name, "my-run");
}

// A name that begins with '-' or '.' would read as a flag or a hidden folder.
TEST(RecipeTest, AJobNameMayNotBeginWithADashOrADot) {
  EXPECT_NE(JobNameProblem("-rf").find("must begin with a letter, digit or '_'"), std::string::npos);
  EXPECT_NE(JobNameProblem(".hidden"), "");
  EXPECT_EQ(JobNameProblem("_ok-1.2"), "");
  EXPECT_EQ(SuggestJobName("-rf"), "rf");
}

// What errors say stays bounded: a value is quoted shortened, and past kMaxRecipeErrors the rest are
// counted in one line.
TEST(RecipeTest, ErrorsAboutAHugeValueOrCountlessKeysStayShort) {
  const std::string huge(1 << 20, '7');
  RecipeParseResult big = ParseRecipe(std::string(kGood) + "fault: {hang_timeout_s: '" + huge + "x'}\n", "r.yaml");
  ASSERT_FALSE(big.ok());
  EXPECT_LT(big.ErrorText().size(), 400u) << big.ErrorText().substr(0, 400);
  EXPECT_NE(big.ErrorText().find("(1048577 bytes)"), std::string::npos) << big.ErrorText().substr(0, 400);
  std::string many = std::string(kGood) + "metrics: {";
  for (int i = 0; i < 5000; ++i) many += "k" + std::to_string(i) + ": 1, ";
  many += "tensorboard: false}\n";
  RecipeParseResult countless = ParseRecipe(many, "r.yaml");
  ASSERT_FALSE(countless.ok());
  EXPECT_EQ(countless.errors.size(), kMaxRecipeErrors + 1);
  EXPECT_NE(countless.errors.back().message.find("and 4900 more error(s) not shown"), std::string::npos)
      << countless.errors.back().message;
  EXPECT_LT(countless.ErrorText().size(), 100u * 1000) << "errors do not grow with the keys";
}

TEST(RecipeTest, YamlRoundTripGivesTheSameRecipe) {
  RecipeParseResult first = ParseRecipe(kGood, "tiny.yaml", {"training.lr=0.00031", "checkpoint.every=5"});
  ASSERT_TRUE(first.ok()) << first.ErrorText();
  std::string yaml = RecipeToYaml(first.recipe);
  RecipeParseResult second = ParseRecipe(yaml, "resolved.yaml");
  ASSERT_TRUE(second.ok()) << second.ErrorText() << yaml;
  EXPECT_EQ(RecipeToYaml(second.recipe), yaml);
  EXPECT_DOUBLE_EQ(second.recipe.training.lr, 0.00031);
  EXPECT_EQ(second.recipe.checkpoint.every, 5);
  // Decimals are written as they were given; a double that needs 17 digits keeps them.
  EXPECT_NE(yaml.find("lr: 0.00031\n"), std::string::npos) << yaml;
  RecipeParseResult exact = ParseRecipe(kGood, "tiny.yaml", {"training.lr=0.1234567890123456789"});
  ASSERT_TRUE(exact.ok());
  EXPECT_EQ(ParseRecipe(RecipeToYaml(exact.recipe), "resolved.yaml").recipe.training.lr, exact.recipe.training.lr);
}

// data.sources: a mixture of prepared datasets with weights, written back as it was read; a source
// without a path, a weight of 0, a key it does not have, and data.path beside it are refused.
TEST(RecipeTest, DataSourcesRoundTripAndBadOnesAreNamed) {
  RecipeParseResult mix = ParseRecipe(
      "data:\n  sources:\n    - {path: /a, weight: 0.7}\n    - {path: /b, weight: 0.3}\n", "mix.yaml");
  ASSERT_TRUE(mix.ok()) << mix.ErrorText();
  const std::vector<DataSource> want = {{"/a", 0.7}, {"/b", 0.3}};
  EXPECT_EQ(mix.recipe.data.sources, want);
  EXPECT_EQ(ParseRecipe(RecipeToYaml(mix.recipe), "resolved.yaml").recipe.data.sources, want);
  EXPECT_EQ(DataSources(mix.recipe), want);
  // One dataset: data.path with weight 1, and no sources written.
  RecipeParseResult plain = ParseRecipe(kGood, "tiny.yaml");
  ASSERT_TRUE(plain.ok());
  ASSERT_EQ(DataSources(plain.recipe).size(), 1u);
  EXPECT_EQ(DataSources(plain.recipe)[0].path, plain.recipe.data.path);
  EXPECT_EQ(RecipeToYaml(plain.recipe).find("sources"), std::string::npos);
  for (const auto& [yaml, message] : std::vector<std::pair<std::string, std::string>>{
           {"data:\n  sources:\n    - {weight: 0.7}\n", "data.sources[0].path is required"},
           {"data:\n  sources:\n    - {path: /a, weight: 0}\n", "data.sources[0].weight=0 is out of range"},
           {"data:\n  sources:\n    - {path: /a, share: 2}\n", "data.sources[0].share is not a key of a data source"},
           {"data:\n  sources: /a\n", "data.sources must be a list of datasets"},
           {"data:\n  path: /a\n  sources:\n    - {path: /b}\n", "data.sources and data.path both name the data"},
           {"data:\n  sampling: torch\n  sources:\n    - {path: /a}\n    - {path: /b}\n",
            "data.sampling: torch replays one PyTorch loop"}}) {
    RecipeParseResult bad = ParseRecipe(yaml, "bad.yaml");
    EXPECT_FALSE(bad.ok()) << yaml;
    EXPECT_NE(bad.ErrorText().find(message), std::string::npos) << bad.ErrorText();
    EXPECT_NE(bad.ErrorText().find("bad.yaml:"), std::string::npos) << bad.ErrorText();
  }
}

TEST(RecipeTest, DataSamplingAndSeedRoundTrip) {
  RecipeParseResult result = ParseRecipe("data: {path: /d, sampling: torch, seed: 1234}\n", "r.yaml");
  ASSERT_TRUE(result.ok()) << result.ErrorText();
  EXPECT_EQ(result.recipe.data.sampling, Sampling::kTorch);
  EXPECT_EQ(result.recipe.data.seed, 1234);
  RecipeParseResult again = ParseRecipe(RecipeToYaml(result.recipe), "resolved.yaml");
  ASSERT_TRUE(again.ok()) << again.ErrorText();
  EXPECT_EQ(again.recipe.data.sampling, Sampling::kTorch);
  EXPECT_EQ(again.recipe.data.seed, 1234);
  // Unset, the seed stays unset (the sampler then uses training.seed).
  RecipeParseResult plain = ParseRecipe(kGood, "tiny.yaml");
  ASSERT_TRUE(plain.ok());
  EXPECT_EQ(plain.recipe.data.sampling, Sampling::kEpochs);
  EXPECT_EQ(plain.recipe.data.seed, -1);
  // Keys at their defaults are not written, so that older binaries read the recipe.
  const std::string yaml = RecipeToYaml(plain.recipe);
  EXPECT_EQ(yaml.find("seed: -1"), std::string::npos);
  EXPECT_EQ(yaml.find("sampling"), std::string::npos);
  EXPECT_EQ(yaml.find("init"), std::string::npos);
}

TEST(RecipeTest, ModelInitRoundTrips) {
  RecipeParseResult result = ParseRecipe("data: {path: /d}\nmodel: {init: per_parameter}\n", "r.yaml");
  ASSERT_TRUE(result.ok()) << result.ErrorText();
  EXPECT_EQ(result.recipe.model.init, ModelInit::kPerParameter);
  RecipeParseResult again = ParseRecipe(RecipeToYaml(result.recipe), "resolved.yaml");
  ASSERT_TRUE(again.ok()) << again.ErrorText();
  EXPECT_EQ(again.recipe.model.init, ModelInit::kPerParameter);
  EXPECT_EQ(ParseRecipe(kGood, "tiny.yaml").recipe.model.init, ModelInit::kAuto);
}

TEST(RecipeTest, OverrideSetsNestedFields) {
  RecipeParseResult result = ParseRecipe(kGood, "tiny.yaml", {"training.steps=7", "parallel.nproc_per_node=1"});
  ASSERT_TRUE(result.ok()) << result.ErrorText();
  EXPECT_EQ(result.recipe.training.steps, 7);
  EXPECT_EQ(result.recipe.accumulation_steps(), 2);
}

struct BadCase {
  const char* what;
  std::string yaml;
  int line;
  int column;
  const char* expected;
};

class MalformedRecipeTest : public ::testing::TestWithParam<BadCase> {};

TEST_P(MalformedRecipeTest, NamesFileLineColumnAndProblem) {
  const BadCase& c = GetParam();
  RecipeParseResult result = ParseRecipe(c.yaml, "bad.yaml");
  ASSERT_FALSE(result.ok()) << c.what;
  const RecipeError& error = result.errors.front();
  EXPECT_EQ(error.file, "bad.yaml");
  EXPECT_EQ(error.line, c.line) << error.ToString();
  EXPECT_EQ(error.column, c.column) << error.ToString();
  EXPECT_NE(error.message.find(c.expected), std::string::npos) << error.ToString();
  EXPECT_EQ(error.ToString().rfind("bad.yaml:" + std::to_string(c.line) + ":" + std::to_string(c.column) + ": ", 0), 0u);
}

INSTANTIATE_TEST_SUITE_P(
    Cases, MalformedRecipeTest,
    ::testing::Values(
        BadCase{"syntax", "model: {layers: 2\ndata: [\n", 2, 5, "YAML syntax error"},
        BadCase{"unknown key", "data: {path: /d}\ntraining:\n  stepz: 3\n", 3, 3, "did you mean 'training.steps'"},
        BadCase{"wrong type", "data: {path: /d}\ntraining:\n  steps: many\n", 3, 10, "must be an integer, got 'many'"},
        BadCase{"out of range", "data: {path: /d}\nparallel:\n  zero: 4\n", 3, 9, "out of range"},
        BadCase{"global batch", "data: {path: /d}\ntraining: {micro_batch: 4, global_batch: 10}\nparallel: {nproc_per_node: 2}\n",
                2, 42, "not a multiple of micro_batch*dp"},
        BadCase{"heads", "data: {path: /d}\nmodel:\n  d_model: 100\n  heads: 3\n", 4, 10, "does not divide model.d_model=100"},
        BadCase{"tp heads", "data: {path: /d}\nmodel: {heads: 4}\nparallel: {nproc_per_node: 3, tp: 3}\n", 3, 35, "does not divide model.heads"},
        BadCase{"sampling", "data: {path: /d, sampling: shuffle}\n", 1, 28, "is not one of: epochs, hash, torch"},
        BadCase{"data seed", "data: {path: /d, seed: 4294967296}\n", 1, 24, "out of range"},
        BadCase{"init", "data: {path: /d}\nmodel: {init: random}\n", 2, 15, "is not one of: auto, pytorch, per_parameter"},
        BadCase{"not a map", "data: {path: /d}\nmodel: 7\n", 2, 8, "must be a mapping"},
        BadCase{"tp vocab", "data: {path: /d}\nmodel: {vocab: 257, heads: 4}\nparallel: {nproc_per_node: 2, tp: 2}\n", 3, 35,
                "does not divide model.vocab=257"},
        BadCase{"interleaved", "data: {path: /d}\nparallel:\n  nproc_per_node: 2\n  pp: 2\n  pp_schedule: interleaved\n", 3, 3,
                "needs parallel.virtual_stages >= 2"},
        BadCase{"pp_split", "data: {path: /d}\nmodel: {layers: 4}\nparallel:\n  nproc_per_node: 2\n  pp: 2\n  pp_split: [1, 2]\n",
                6, 13, "summing to model.layers=4"},
        BadCase{"pp_split type", "data: {path: /d}\nparallel:\n  pp_split: [1, x]\n", 3, 17, "must be an integer"},
        BadCase{"elastic", "data: {path: /d}\nparallel:\n  nodes: {min: 3, max: 2}\n", 3, 10, "min=3 is larger than max=2"},
        BadCase{"zero3 pp", "data: {path: /d}\nmodel: {layers: 4}\nparallel: {nproc_per_node: 2, pp: 2, zero: 3}\n", 3, 44,
                "does not combine with pp>1"},
        BadCase{"sp", "data: {path: /d}\nparallel:\n  sequence_parallel: yes\n", 3, 22, "needs parallel.tp > 1"},
        BadCase{"gpt2 kv_heads", "data: {path: /d}\nmodel: {heads: 4, kv_heads: 2}\n", 2, 29, "is a Llama key"},
        BadCase{"gpt2 untied", "data: {path: /d}\nmodel:\n  tie_embeddings: false\n", 3, 19, "needs model.arch: llama"},
        BadCase{"llama kv_heads", "data: {path: /d}\nmodel: {arch: llama, heads: 4, kv_heads: 3}\n", 2, 42,
                "must divide model.heads=4"},
        BadCase{"llama tp kv", "data: {path: /d}\nmodel: {arch: llama, heads: 6, d_model: 96, kv_heads: 3}\n"
                "parallel: {nproc_per_node: 2, tp: 2}\n", 3, 35, "replicates them (tp a multiple of kv_heads)"},
        BadCase{"llama init", "data: {path: /d}\nmodel: {arch: llama, init: pytorch}\n", 2, 28, "draws each parameter"},
        BadCase{"key twice", "data: {path: /d}\nmodel:\n  layers: 2\n  layers: 3\n", 4, 3,
                "'model.layers' is given twice (first at line 3), and only the first would count"},
        BadCase{"section twice", "data: {path: /d}\ntraining:\n  steps: 3\ntraining:\n  steps: 5000\n", 4, 1,
                "'training' is given twice (first at line 2), and only the first would count; keep one section"}));

TEST(RecipeTest, ElasticNodesAndLayoutKeysRoundTrip) {
  RecipeParseResult result = ParseRecipe(
      "data: {path: /d}\nmodel: {layers: 4}\ntraining: {micro_batch: 1, global_batch: 4}\n"
      "parallel: {nodes: {min: 1, max: 2}, nproc_per_node: 2, pp: 2, pp_schedule: interleaved, virtual_stages: 2,"
      " pp_split: [1, 1, 1, 1], activation_checkpointing: selective}\n",
      "r.yaml");
  ASSERT_TRUE(result.ok()) << result.ErrorText();
  EXPECT_EQ(result.recipe.parallel.nodes, 2);
  EXPECT_EQ(result.recipe.parallel.nodes_min, 1);
  EXPECT_EQ(result.recipe.parallel.world_size(), 4);
  std::string yaml = RecipeToYaml(result.recipe);
  RecipeParseResult again = ParseRecipe(yaml, "resolved.yaml");
  ASSERT_TRUE(again.ok()) << again.ErrorText() << yaml;
  EXPECT_EQ(again.recipe.parallel.pp_split, (std::vector<int>{1, 1, 1, 1}));
  EXPECT_EQ(again.recipe.parallel.nodes_min, 1);
  EXPECT_EQ(again.recipe.parallel.activation_checkpointing, ActivationCheckpointing::kSelective);
  EXPECT_EQ(RecipeToYaml(again.recipe), yaml);
}

TEST(RecipeTest, ReportsEveryErrorNotJustTheFirst) {
  RecipeParseResult result = ParseRecipe("data: {path: /d}\nmodel: {layerz: 1, heads: x}\nfoo: 1\n", "r.yaml");
  EXPECT_EQ(result.errors.size(), 3u) << result.ErrorText();
}

// Problems are found key by key (unknown keys first), but listed in the order of the file.
TEST(RecipeTest, ErrorsAreListedInTheOrderOfTheFile) {
  RecipeParseResult result =
      ParseRecipe("data: {path: /d}\ntraining: {steps: many}\nmodel: {heads: 3}\nfoo: 1\nparallel: {tp: x}\n", "r.yaml");
  ASSERT_GE(result.errors.size(), 3u) << result.ErrorText();
  for (size_t i = 1; i < result.errors.size(); ++i) {
    EXPECT_LE(std::make_pair(result.errors[i - 1].line, result.errors[i - 1].column),
              std::make_pair(result.errors[i].line, result.errors[i].column))
        << result.ErrorText();
  }
  EXPECT_EQ(result.errors.front().line, 2) << result.ErrorText();
}

// A warm standby runs a Python script or module, and only for a program: auto has none for other
// programs, gpu asks for one and is refused.
TEST(RecipeTest, AWarmStandbyNeedsAPythonProgram) {
  RecipeParseResult python =
      ParseRecipe("name: x\nentrypoint: {command: [python3, -u, train.py], warm_standby: gpu}\n", "r.yaml");
  ASSERT_TRUE(python.ok()) << python.ErrorText();
  EXPECT_EQ(python.recipe.entrypoint.warm_standby, WarmStandby::kGpu);
  RecipeParseResult automatic = ParseRecipe("name: x\nentrypoint: {command: [./train.sh]}\n", "r.yaml");
  ASSERT_TRUE(automatic.ok()) << automatic.ErrorText();
  EXPECT_EQ(automatic.recipe.entrypoint.warm_standby, WarmStandby::kAuto);
  RecipeParseResult boolean =
      ParseRecipe("name: x\nentrypoint: {command: [python3, train.py], warm_standby: true}\n", "r.yaml");
  ASSERT_EQ(boolean.errors.size(), 1u) << boolean.ErrorText();
  EXPECT_NE(boolean.errors[0].message.find("auto"), std::string::npos) << boolean.ErrorText();
  RecipeParseResult shell =
      ParseRecipe("name: x\nentrypoint:\n  command: [./train.sh]\n  warm_standby: gpu\n", "r.yaml");
  ASSERT_EQ(shell.errors.size(), 1u) << shell.ErrorText();
  EXPECT_EQ(shell.errors[0].line, 4) << shell.ErrorText();
  EXPECT_NE(shell.errors[0].message.find("./train.sh is not a Python interpreter"), std::string::npos)
      << shell.ErrorText();
  EXPECT_NE(shell.errors[0].message.find("or remove warm_standby"), std::string::npos) << shell.ErrorText();
  RecipeParseResult trainer = ParseRecipe(std::string(kGood) + "entrypoint: {warm_standby: off}\n", "r.yaml");
  ASSERT_EQ(trainer.errors.size(), 1u) << trainer.ErrorText();
  EXPECT_NE(trainer.errors[0].message.find("ltrain's trainer restarts without one"), std::string::npos)
      << trainer.ErrorText();
}

TEST(RecipeTest, MissingDataPathExplainsTheFix) {
  RecipeParseResult result = ParseRecipe("name: x\n", "r.yaml");
  ASSERT_EQ(result.errors.size(), 1u);
  EXPECT_NE(result.errors[0].message.find("ltrain data prepare"), std::string::npos);
}

TEST(RecipeTest, BadOverrideIsNamedByItsKey) {
  RecipeParseResult result = ParseRecipe(kGood, "tiny.yaml", {"training.steps=abc"});
  ASSERT_EQ(result.errors.size(), 1u);
  EXPECT_EQ(result.errors[0].ToString(), "--set training.steps: training.steps must be an integer, got 'abc'");
  RecipeParseResult unknown = ParseRecipe(kGood, "tiny.yaml", {"training.stepz=3"});
  ASSERT_EQ(unknown.errors.size(), 1u);
  EXPECT_NE(unknown.errors[0].message.find("did you mean"), std::string::npos);
}

// An override that is not KEY=VALUE, or whose value is not YAML, is an error like a bad key: never dropped.
TEST(RecipeTest, MalformedOverridesAreErrorsNotDropped) {
  for (const std::string override : {"training.steps", "=5", "training.steps=[", "training..steps=5"}) {
    RecipeParseResult result = ParseRecipe(kGood, "tiny.yaml", {override});
    ASSERT_EQ(result.errors.size(), 1u) << override;
    EXPECT_EQ(result.errors[0].file.rfind("--set ", 0), 0u) << result.errors[0].ToString();
  }
  // Beside the recipe's own errors, first.
  RecipeParseResult both = ParseRecipe("data: {path: /d}\ntraining: {stepz: 3}\n", "r.yaml", {"training.steps"});
  ASSERT_EQ(both.errors.size(), 2u);
  EXPECT_EQ(both.errors[0].ToString(), "--set training.steps: an override is KEY=VALUE, e.g. training.steps=200");
  EXPECT_NE(both.errors[1].message.find("did you mean 'training.steps'"), std::string::npos);
}

// A key whose own value is refused keeps its default; the rules across keys that read it wait until it
// is mended instead of judging the default in its place (micro_batch=0 against global_batch 12 once
// said "micro_batch*dp=8*2=16"; a misspelt arch made the Llama keys "Llama keys").
TEST(RecipeTest, ARefusedKeyIsNotJudgedAgainstOtherKeysByItsDefault) {
  struct Case {
    std::string yaml;
    std::vector<std::string> overrides;
    std::string only_error;
  };
  const std::vector<Case> cases = {
      {"data: {path: /d}\nparallel: {nproc_per_node: 2}\n", {"training.micro_batch=0", "training.global_batch=12"},
       "training.micro_batch=0 is out of range"},
      {"data: {path: /d}\nmodel: {arch: llama3, heads: 4, kv_heads: 2}\n", {}, "model.arch='llama3' is not one of"},
      {"data: {path: /d}\nmodel: {d_model: 96, heads: many}\n", {}, "model.heads must be an integer"},
      {"data: {path: /d}\nmodel: {heads: 4}\nparallel: {tp: two, nproc_per_node: 2}\n", {}, "parallel.tp must be an integer"},
      {"data: {path: /d}\ntraining: {lr: fast, min_lr: 0.01}\n", {}, "training.lr must be a number"},
      {"data: {path: [a, b]}\n", {}, "data.path must be a string"},
      {"entrypoint: {command: python3 train.py}\nparallel: {tp: 2}\n", {}, "entrypoint.command must be a list"},
  };
  for (const Case& c : cases) {
    RecipeParseResult result = ParseRecipe(c.yaml, "r.yaml", c.overrides);
    EXPECT_EQ(result.errors.size(), 1u) << c.yaml << result.ErrorText();
    if (result.errors.empty()) continue;
    EXPECT_NE(result.errors[0].message.find(c.only_error), std::string::npos) << result.ErrorText();
  }
  // A rule that reads none of the refused keys still speaks.
  RecipeParseResult other = ParseRecipe("data: {path: /d}\nmodel: {init: random}\ntraining: {lr: 0.001, min_lr: 0.01}\n",
                                        "r.yaml");
  ASSERT_EQ(other.errors.size(), 2u) << other.ErrorText();
  EXPECT_NE(other.errors[1].message.find("training.min_lr must not exceed training.lr"), std::string::npos)
      << other.ErrorText();
}

// GPT-2's key/value heads are its heads: a tp that does not divide them is said once, of model.heads.
TEST(RecipeTest, Gpt2TensorParallelOverHeadsNamesTheHeadsOnce) {
  RecipeParseResult result = ParseRecipe(
      "data: {path: /d}\nmodel: {d_model: 48, heads: 3}\nparallel: {nproc_per_node: 2, tp: 2}\n", "r.yaml");
  ASSERT_EQ(result.errors.size(), 1u) << result.ErrorText();
  EXPECT_NE(result.errors[0].message.find("parallel.tp=2 does not divide model.heads=3"), std::string::npos)
      << result.ErrorText();
}

TEST(RecipeTest, MissingFileIsOneClearError) {
  RecipeParseResult result = LoadRecipeFile("/nonexistent/recipe.yaml");
  ASSERT_EQ(result.errors.size(), 1u);
  EXPECT_NE(result.errors[0].ToString().find("/nonexistent/recipe.yaml: cannot read"), std::string::npos);
}

TEST(RecipeSchemaTest, EveryKeyHasATypeADefaultAndHelp) {
  std::vector<RecipeKeyDoc> docs = DescribeRecipeKeys();
  EXPECT_EQ(docs.size(), RecipeKeyValues(Recipe{}).size());
  for (const RecipeKeyDoc& doc : docs) {
    EXPECT_FALSE(doc.type.empty()) << doc.path;
    EXPECT_FALSE(doc.default_text.empty()) << doc.path;
    EXPECT_FALSE(doc.help.empty()) << doc.path;
  }
  const std::string text = RecipeKeysText();
  EXPECT_NE(text.find("parallel.pp_schedule"), std::string::npos) << text;
  EXPECT_NE(text.find("one of gpipe, 1f1b, interleaved"), std::string::npos) << text;
  EXPECT_NE(text.find("integer 0 to 3"), std::string::npos) << text;  // parallel.zero
}

// The README's table of recipe keys is the schema's, so that the two cannot drift apart.
TEST(RecipeSchemaTest, TheReadmeTableIsTheSchema) {
  std::ifstream in(std::string(LTRAIN_SOURCE_DIR) + "/README.md");
  std::stringstream buffer;
  buffer << in.rdbuf();
  const std::string readme = buffer.str();
  const std::string begin = "<!-- recipe keys: `ltrain validate --explain --output markdown` -->\n";
  const std::string end = "<!-- end of recipe keys -->";
  const size_t from = readme.find(begin);
  const size_t to = readme.find(end);
  ASSERT_NE(from, std::string::npos) << "README.md lacks the line " << begin;
  ASSERT_NE(to, std::string::npos) << "README.md lacks the line " << end;
  EXPECT_EQ(readme.substr(from + begin.size(), to - from - begin.size()), RecipeKeysMarkdown())
      << "README.md's recipe table differs from the schema: replace it with the output of "
         "`ltrain validate --explain --output markdown`";
}

TEST(RecipeSchemaTest, EnumNamesRoundTrip) {
  EXPECT_EQ(NameOf(PpSchedule::k1F1B), "1f1b");
  EXPECT_EQ(EnumFromName<Precision>("bf16-autocast"), Precision::kBf16Autocast);
  EXPECT_FALSE(EnumFromName<Device>("tpu").has_value());
  EXPECT_EQ(EnumNameList<ActivationCheckpointing>(), "none, full, selective");
}

// precision auto is bf16-fp32-residual on GPUs: the residual stream in fp32 there, and nowhere on CPUs.
TEST(RecipeTest, TheDefaultPrecisionKeepsAnFp32ResidualStreamOnGpus) {
  ParallelSpec p;
  EXPECT_EQ(p.precision, Precision::kAuto);
  EXPECT_FALSE(p.fp32_residual_stream());  // cpu
  p.device = Device::kCuda;
  EXPECT_TRUE(p.fp32_residual_stream());
  p.precision = Precision::kBf16Fp32Residual;
  EXPECT_TRUE(p.fp32_residual_stream());
  for (const Precision other : {Precision::kBf16, Precision::kBf16Autocast, Precision::kFp32}) {
    p.precision = other;
    EXPECT_FALSE(p.fp32_residual_stream()) << NameOf(other);
  }
}

// FP8 runs on GPUs only: a CPU recipe asking for it is refused at the key, with the fix.
TEST(RecipeTest, Fp8OnACpuJobIsRefusedNamingTheKey) {
  const std::string cpu = "name: tiny\nmodel: {layers: 2, d_model: 64, heads: 4, seq_len: 32, vocab: 256}\n"
                          "data: {path: /tmp/data}\ntraining: {steps: 20, micro_batch: 4, global_batch: 8}\n"
                          "parallel:\n  nproc_per_node: 2\n  precision: fp8\n";
  RecipeParseResult refused = ParseRecipe(cpu, "fp8.yaml");
  ASSERT_FALSE(refused.ok());
  const std::string text = refused.ErrorText();
  EXPECT_NE(text.find("fp8.yaml:7:"), std::string::npos) << text;
  EXPECT_NE(text.find("parallel.precision: fp8 needs parallel.device: cuda"), std::string::npos) << text;
  EXPECT_NE(text.find("on CPU use auto or fp32"), std::string::npos) << text;
  RecipeParseResult gpu = ParseRecipe(cpu + "  device: cuda\n", "fp8.yaml");
  ASSERT_TRUE(gpu.ok()) << gpu.ErrorText();
  EXPECT_EQ(gpu.recipe.parallel.precision, Precision::kFp8);
  EXPECT_TRUE(gpu.recipe.parallel.fp32_residual_stream());
}

// parallel.fp8_bf16_layers: read as a list of blocks under fp8; refused naming the key and its line
// under another precision, and where it names a block the model does not have.
TEST(RecipeTest, Fp8Bf16LayersAreBlocksOfTheModelUnderFp8) {
  const std::string base = "name: tiny\nmodel: {layers: 4, d_model: 64, heads: 4, seq_len: 32, vocab: 256}\n"
                           "data: {path: /tmp/data}\ntraining: {steps: 20, micro_batch: 4, global_batch: 4}\n"
                           "parallel:\n  device: cuda\n";
  RecipeParseResult ok = ParseRecipe(base + "  precision: fp8\n  fp8_bf16_layers: [0, 3]\n", "fp8.yaml");
  ASSERT_TRUE(ok.ok()) << ok.ErrorText();
  EXPECT_EQ(ok.recipe.parallel.fp8_bf16_layers, (std::vector<int>{0, 3}));
  RecipeParseResult other = ParseRecipe(base + "  fp8_bf16_layers: [0]\n", "auto.yaml");
  ASSERT_FALSE(other.ok());
  std::string text = other.ErrorText();
  EXPECT_NE(text.find("auto.yaml:7:"), std::string::npos) << text;
  EXPECT_NE(text.find("parallel.fp8_bf16_layers names blocks kept in bf16 under parallel.precision: fp8; this "
                      "recipe's precision is auto"), std::string::npos) << text;
  RecipeParseResult beyond = ParseRecipe(base + "  precision: fp8\n  fp8_bf16_layers: [1, 4]\n", "fp8.yaml");
  ASSERT_FALSE(beyond.ok());
  text = beyond.ErrorText();
  EXPECT_NE(text.find("fp8.yaml:8:"), std::string::npos) << text;
  EXPECT_NE(text.find("names block 4 of a model of 4 (model.layers); blocks count from 0"), std::string::npos) << text;
  RecipeParseResult negative = ParseRecipe(base + "  precision: fp8\n  fp8_bf16_layers: [-1]\n", "fp8.yaml");
  EXPECT_FALSE(negative.ok());
}

// parallel.fp8_scaling: tensorwise by default, rowwise on request under fp8; refused naming the key
// under another precision.
TEST(RecipeTest, Fp8ScalingIsTensorwiseOrRowwiseUnderFp8) {
  const std::string base = "name: tiny\nmodel: {layers: 4, d_model: 64, heads: 4, seq_len: 32, vocab: 256}\n"
                           "data: {path: /tmp/data}\ntraining: {steps: 20, micro_batch: 4, global_batch: 4}\n"
                           "parallel:\n  device: cuda\n";
  RecipeParseResult tensorwise = ParseRecipe(base + "  precision: fp8\n", "fp8.yaml");
  ASSERT_TRUE(tensorwise.ok()) << tensorwise.ErrorText();
  EXPECT_EQ(tensorwise.recipe.parallel.fp8_scaling, Fp8ScalingKind::kTensorwise);
  RecipeParseResult rowwise = ParseRecipe(base + "  precision: fp8\n  fp8_scaling: rowwise\n", "fp8.yaml");
  ASSERT_TRUE(rowwise.ok()) << rowwise.ErrorText();
  EXPECT_EQ(rowwise.recipe.parallel.fp8_scaling, Fp8ScalingKind::kRowwise);
  RecipeParseResult other = ParseRecipe(base + "  fp8_scaling: rowwise\n", "auto.yaml");
  ASSERT_FALSE(other.ok());
  const std::string text = other.ErrorText();
  EXPECT_NE(text.find("auto.yaml:7:"), std::string::npos) << text;
  EXPECT_NE(text.find("parallel.fp8_scaling chooses the scaling of parallel.precision: fp8"), std::string::npos) << text;
  RecipeParseResult unknown = ParseRecipe(base + "  precision: fp8\n  fp8_scaling: blockwise\n", "fp8.yaml");
  ASSERT_FALSE(unknown.ok());
  EXPECT_NE(unknown.ErrorText().find("tensorwise"), std::string::npos) << unknown.ErrorText();
}

// model.moe is a section within model: read, written back nested (and not at all at its defaults),
// set by --set, its unknown keys and its values' errors located in it.
TEST(RecipeTest, MoeKeysNestUnderModelAndRoundTrip) {
  const std::string base = "name: tiny\nmodel:\n  arch: llama\n  layers: 4\n  d_model: 64\n  heads: 4\n"
                           "  seq_len: 32\n  vocab: 256\n";
  const std::string tail = "data: {path: /tmp/data}\ntraining: {steps: 20, micro_batch: 4, global_batch: 4}\n";
  RecipeParseResult moe =
      ParseRecipe(base + "  moe: {experts: 8, top_k: 2, every: 2, score: sigmoid}\n" + tail, "moe.yaml", {"model.moe.ffn=96"});
  ASSERT_TRUE(moe.ok()) << moe.ErrorText();
  EXPECT_EQ(moe.recipe.model.moe.experts, 8);
  EXPECT_EQ(moe.recipe.model.moe.score, MoeScore::kSigmoid);
  EXPECT_EQ(moe.recipe.model.moe.ffn, 96);
  EXPECT_FALSE(IsMoeLayer(moe.recipe.model, 0));
  EXPECT_TRUE(IsMoeLayer(moe.recipe.model, 1));
  EXPECT_TRUE(IsMoeLayer(moe.recipe.model, 3));
  const std::string yaml = RecipeToYaml(moe.recipe);
  EXPECT_NE(yaml.find("  moe:\n    experts: 8"), std::string::npos) << yaml;
  RecipeParseResult again = ParseRecipe(yaml, "resolved.yaml");
  ASSERT_TRUE(again.ok()) << again.ErrorText() << yaml;
  EXPECT_EQ(RecipeToYaml(again.recipe), yaml);
  // A dense model writes no moe section at all.
  EXPECT_EQ(RecipeToYaml(ParseRecipe(base + tail, "dense.yaml").recipe).find("moe"), std::string::npos);

  RecipeParseResult typo = ParseRecipe(base + "  moe:\n    experts: 8\n    topk: 2\n" + tail, "typo.yaml");
  ASSERT_FALSE(typo.ok());
  EXPECT_NE(typo.ErrorText().find("typo.yaml:11:5:"), std::string::npos) << typo.ErrorText();
  EXPECT_NE(typo.ErrorText().find("did you mean 'model.moe.top_k'?"), std::string::npos) << typo.ErrorText();
  RecipeParseResult scalar = ParseRecipe(base + "  moe: 8\n" + tail, "scalar.yaml");
  ASSERT_FALSE(scalar.ok());
  EXPECT_NE(scalar.ErrorText().find("'model.moe' must be a mapping"), std::string::npos) << scalar.ErrorText();
  RecipeParseResult range = ParseRecipe(base + "  moe:\n    experts: 8\n    top_k: 0\n" + tail, "range.yaml");
  ASSERT_FALSE(range.ok());
  EXPECT_NE(range.ErrorText().find("range.yaml:11:12:"), std::string::npos) << range.ErrorText();
}

// The rules between model.moe's keys, each naming its key and the fix.
TEST(RecipeTest, MoeRulesNameTheirKeyAndTheFix) {
  const std::string base = "name: tiny\nmodel:\n  arch: llama\n  layers: 4\n  d_model: 64\n  heads: 4\n"
                           "  seq_len: 32\n  vocab: 256\n";
  const std::string tail = "data: {path: /tmp/data}\ntraining: {steps: 20, micro_batch: 4, global_batch: 4}\n";
  const auto error = [&](const std::string& moe, const std::string& arch = "") {
    std::string model = base + moe + tail;
    if (!arch.empty()) model.replace(model.find("arch: llama"), 11, "arch: " + arch);
    RecipeParseResult r = ParseRecipe(model, "moe.yaml");
    return r.ok() ? std::string("accepted") : r.ErrorText();
  };
  EXPECT_NE(error("  moe: {top_k: 2}\n").find("model.moe.top_k is a key of a mixture of experts: set model.moe.experts"),
            std::string::npos);
  EXPECT_NE(error("  moe: {experts: 4}\n", "gpt2").find("model.moe needs a Llama-block family"), std::string::npos);
  EXPECT_NE(error("  moe: {experts: 1}\n").find("a dense MLP"), std::string::npos);
  EXPECT_NE(error("  moe: {experts: 4, top_k: 5}\n").find("model.moe.top_k=5 is more than model.moe.experts=4"),
            std::string::npos);
  EXPECT_NE(error("  moe: {experts: 4, first_dense: 4}\n").find("makes no block an MoE block"), std::string::npos);
  EXPECT_NE(error("  moe: {experts: 4, dense_layers: [7]}\n").find("names block 7 of a model of 4"), std::string::npos);
  EXPECT_NE(error("  moe: {experts: 4, balance: bias, aux_loss_coef: 0.01}\n")
                .find("model.moe.aux_loss_coef weighs the loss of balance: aux_loss"),
            std::string::npos);
  EXPECT_NE(error("  moe: {experts: 4, bias_update: 0.01}\n").find("this recipe's balance is aux_loss"),
            std::string::npos);
  EXPECT_EQ(error("  moe: {experts: 4, balance: bias, bias_update: 0.01, dense_layers: [0]}\n"), "accepted");
}

// What a resume compares: the keys that shape the parameters, with kv_heads and ffn resolved.
TEST(RecipeTest, ModelShapeDifferencesNameTheKeysThatShapeTheParameters) {
  ModelSpec saved;
  EXPECT_EQ(ModelShapeDifferences(saved, saved), "");
  ModelSpec smaller = saved;
  smaller.d_model = 32;
  smaller.layers = 1;
  EXPECT_EQ(ModelShapeDifferences(saved, smaller), "model.layers 2 (this recipe: 1), model.d_model 128 (this recipe: 32)");
  // Only the function changes: no difference.
  ModelSpec llama = saved;
  llama.arch = Arch::kLlama;
  ModelSpec longer = llama;
  longer.seq_len = 4096;
  longer.rope_theta = 1e6;
  EXPECT_EQ(ModelShapeDifferences(llama, longer), "");
  // gpt2's learned positions have seq_len rows.
  ModelSpec gpt_longer = saved;
  gpt_longer.seq_len = 128;
  EXPECT_EQ(ModelShapeDifferences(saved, gpt_longer), "model.seq_len 64 (this recipe: 128)");
  // kv_heads 0 is model.heads: the same shapes.
  ModelSpec explicit_kv = llama;
  explicit_kv.kv_heads = llama.heads;
  EXPECT_EQ(ModelShapeDifferences(llama, explicit_kv), "");
  ModelSpec grouped = llama;
  grouped.kv_heads = 2;
  EXPECT_EQ(ModelShapeDifferences(llama, grouped), "model.kv_heads 4 (this recipe: 2)");
  ModelSpec wider = llama;
  wider.ffn = 1024;
  EXPECT_EQ(ModelShapeDifferences(llama, wider), "model.ffn 384 (this recipe: 1024)");
}

}  // namespace
}  // namespace ltrain
