// Every recipe key reaches the worker. A recipe with every key at a value other than its default
// goes the way a job's recipe goes: the CLI's resolved YAML, the coordinator's submit and placement,
// the start command whose recipe the agent writes for its workers, and the worker's own loading
// (LoadWorkerRecipe). The worker's recipe must hold every value; a key a writer or reader lost
// would come back at its default.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <set>

#include <unistd.h>

#include "common/clock.h"
#include "common/logging.h"
#include "common/recipe_schema.h"
#include "launcher/coordinator.h"
#include "launcher/state_store.h"
#include "worker/control/worker_env.h"

namespace ltrain {
namespace {

constexpr const char* kEveryKey = R"(name: every-key
model: {arch: llama, layers: 8, d_model: 96, heads: 6, seq_len: 48, vocab: 300, kv_heads: 2, ffn: 128, head_dim: 32,
        max_positions: 4096, rope_theta: 10000,
        rope_scaling: llama3, rope_factor: 8, rope_low_freq_factor: 2, rope_high_freq_factor: 8,
        rope_original_positions: 4096, norm_eps: 1.0e-6, tie_embeddings: false, init: per_parameter,
        init_from: /models/base}
data: {path: /data/every-key, tokenizer: huggingface, sampling: torch, seed: 4321}
training: {steps: 77, micro_batch: 2, global_batch: 32, lr: 0.002, min_lr: 0.0002, warmup_steps: 7,
           lr_schedule: constant, weight_decay: 0.05, beta1: 0.8, beta2: 0.9, grad_clip: 0.5, seed: 99, log_every: 3,
           deterministic: true, eval_every: 5, eval_batches: 3}
parallel: {nodes: {min: 1, max: 2}, nproc_per_node: 8, tp: 2, pp: 2, cp: 2, zero: 1, sequence_parallel: true,
           pp_schedule: interleaved, virtual_stages: 2, pp_split: [3, 2, 2, 1], bucket_mb: 50,
           activation_checkpointing: selective, precision: fp8, fp8_bf16_layers: [0],
           fp8_scaling: rowwise, device: cuda}
metrics: {tensorboard: true}
checkpoint: {dir: /ckpt/every-key, every: 11, keep: 5, resume_from: /ckpt/old/step-3, async: false, enabled: false,
             timeout_s: 240, share_with_group: true}
fault: {max_restarts: 4, restart_backoff_s: 2.5, restart_backoff_max_s: 45, heartbeat_interval_s: 0.5,
        heartbeat_misses: 5, hang_timeout_s: 90, startup_timeout_s: 500, collective_timeout_s: 120, recovery: in_place,
        memory_checkpoint_every: 7}
)";

// Keys that cannot differ from their default: their type has a single value today.
const std::set<std::string> kSingleValued = {};

// Keys that replace another (data.sources replaces data.path): AMixtureReachesTheWorker covers them.
const std::set<std::string> kAlternatives = {"data.sources"};
// kEveryKey's model is dense: TheMoeKeysReachTheWorker covers the keys of this section and
// parallel.ep, which needs a mixture of experts.
constexpr const char* kMoeSection = "model.moe.";
constexpr const char* kExpertParallel = "parallel.ep";
bool MoeKey(const std::string& key) { return key.rfind(kMoeSection, 0) == 0 || key == kExpertParallel; }

// A recipe with entrypoint.command has no model, data or training: ProgramRecipeReachesTheAgent
// covers these keys.
const std::set<std::string> kProgramKeys = {"entrypoint.command", "entrypoint.env", "entrypoint.workdir",
                                           "entrypoint.output_timeout_s", "entrypoint.warm_standby"};

// The command a coordinator with one node sends its agent for `recipe`, submitted as `ltrain launch`
// submits it; nullopt (after a test failure) when the submit is refused.
std::optional<v1::Command> StartCommandOf(const Recipe& recipe, const std::string& source) {
  FakeClock clock;
  std::unique_ptr<launcher::StateStore> store = std::move(launcher::SqliteStateStore::Open(":memory:")).value();
  launcher::CoordinatorOptions options;
  options.state_dir = "/state";
  launcher::Coordinator coordinator(store.get(), &clock, options);
  v1::NodeFacts facts;
  facts.set_hostname("a.example");
  facts.set_gpus(8);  // a cuda recipe is placed on a node with GPUs only
  coordinator.NodeConnected("a", facts);
  StatusOr<v1::Job> job = coordinator.Submit(RecipeToYaml(recipe), source);
  EXPECT_TRUE(job.ok()) << job.status().ToString();
  if (!job.ok()) return std::nullopt;
  return coordinator.WaitCommand("a", 0);
}

// The recipe a worker loads from `command`'s start: the file the agent writes, read through the
// worker's environment (LTRAIN_RECIPE_FILE).
StatusOr<Recipe> WorkerRecipeOf(const v1::Command& command) {
  const std::filesystem::path dir = std::filesystem::temp_directory_path() / ("ltrain-recipe-keys-" + std::to_string(getpid()));
  std::filesystem::create_directories(dir);
  const std::string file = (dir / "recipe.yaml").string();
  std::ofstream(file) << command.start().recipe_yaml();
  StatusOr<worker::WorkerEnv> env = worker::ParseWorkerEnv(worker::EnvironmentOf({"LTRAIN_RECIPE_FILE=" + file}), {});
  StatusOr<Recipe> received = env.ok() ? worker::LoadWorkerRecipe(*env) : StatusOr<Recipe>(env.status());
  std::filesystem::remove_all(dir);
  return received;
}

TEST(RecipeKeysTest, EveryKeyReachesTheWorkerWithANonDefaultValue) {
  SetLogLevel(LogLevel::kWarning);
  RecipeParseResult user = ParseRecipe(kEveryKey, "every-key.yaml");
  ASSERT_TRUE(user.ok()) << user.ErrorText();
  const std::map<std::string, std::string> defaults = RecipeKeyValues(Recipe{});
  const std::map<std::string, std::string> wanted = RecipeKeyValues(user.recipe);
  for (const auto& [key, value] : wanted) {
    if (kSingleValued.count(key) || kProgramKeys.count(key) || kAlternatives.count(key)) continue;
    if (MoeKey(key)) continue;
    EXPECT_NE(value, defaults.at(key)) << key << " is at its default in this test's recipe: give it another value";
  }

  // As `ltrain launch` submits it, to a coordinator with one node.
  std::optional<v1::Command> command = StartCommandOf(user.recipe, "every-key.yaml");
  ASSERT_TRUE(command && command->has_start());

  // What the agent writes and its worker reads.
  StatusOr<Recipe> received = WorkerRecipeOf(*command);
  ASSERT_TRUE(received.ok()) << received.status().ToString() << "\n" << command->start().recipe_yaml();

  const std::map<std::string, std::string> got = RecipeKeyValues(*received);
  ASSERT_EQ(got.size(), wanted.size());
  for (const auto& [key, value] : wanted) {
    // A generation runs on the nodes it was given: one here.
    if (key == "parallel.nodes") {
      EXPECT_EQ(got.at(key), "1");
      continue;
    }
    EXPECT_EQ(got.at(key), value) << key << " did not reach the worker:\n" << command->start().recipe_yaml();
  }
}

// data.sources, a mixture in place of data.path, reaches the worker with its weights.
TEST(RecipeKeysTest, AMixtureReachesTheWorker) {
  SetLogLevel(LogLevel::kWarning);
  RecipeParseResult user = ParseRecipe(
      "name: mix\ndata:\n  sources:\n    - {path: /data/web, weight: 0.7}\n    - {path: /data/code, weight: 0.3}\n",
      "mix.yaml");
  ASSERT_TRUE(user.ok()) << user.ErrorText();
  ASSERT_EQ(user.recipe.data.sources.size(), 2u);
  EXPECT_TRUE(user.recipe.data.path.empty());
  std::optional<v1::Command> command = StartCommandOf(user.recipe, "mix.yaml");
  ASSERT_TRUE(command && command->has_start());
  RecipeParseResult received = ParseRecipe(command->start().recipe_yaml(), "received.yaml");
  ASSERT_TRUE(received.ok()) << received.ErrorText() << command->start().recipe_yaml();
  EXPECT_EQ(received.recipe.data.sources, user.recipe.data.sources) << command->start().recipe_yaml();
  EXPECT_EQ(DataSources(received.recipe)[1].weight, 0.3);
}

// model.moe.aux_loss_coef, which kEveryKey's balance (bias) excludes, reaches the worker under
// balance aux_loss.
// Every model.moe key at a value other than its default, in two recipes (aux_loss_coef weighs the
// loss of balance aux_loss, the other balances by bias), from the user's recipe to the worker's loading.
TEST(RecipeKeysTest, TheMoeKeysReachTheWorker) {
  SetLogLevel(LogLevel::kWarning);
  const std::string common = "name: moe\ndata: {path: /data/moe}\n";
  const std::map<std::string, std::string> defaults = RecipeKeyValues(Recipe{});
  std::set<std::string> covered;
  for (const std::string model :
       {"model: {arch: qwen3, layers: 8, moe: {experts: 4, top_k: 1, shared_experts: 1, ffn: 64, every: 2, "
        "first_dense: 1, dense_layers: [7], score: sigmoid, norm_topk: false, route_scale: 2.5, balance: bias, "
        "bias_update: 0.01, z_loss_coef: 0.001}}\nparallel: {nproc_per_node: 2, pp: 2}\n",
        "model: {arch: llama, moe: {experts: 4, aux_loss_coef: 0.02, capacity_factor: 1.25}}\nparallel: {nproc_per_node: 4, ep: 2}\n"
        "training: {micro_batch: 1, global_batch: 8}\n"}) {
    RecipeParseResult user = ParseRecipe(common + model, "moe.yaml");
    ASSERT_TRUE(user.ok()) << user.ErrorText();
    std::optional<v1::Command> command = StartCommandOf(user.recipe, "moe.yaml");
    ASSERT_TRUE(command && command->has_start());
    StatusOr<Recipe> received = WorkerRecipeOf(*command);
    ASSERT_TRUE(received.ok()) << received.status().ToString() << "\n" << command->start().recipe_yaml();
    const std::map<std::string, std::string> wanted = RecipeKeyValues(user.recipe), got = RecipeKeyValues(*received);
    for (const auto& [key, value] : wanted) {
      if (!MoeKey(key)) continue;
      EXPECT_EQ(got.at(key), value) << key << " did not reach the worker:\n" << command->start().recipe_yaml();
      if (value != defaults.at(key)) covered.insert(key);
    }
  }
  for (const auto& [key, value] : defaults) {
    if (MoeKey(key)) {
      EXPECT_TRUE(covered.count(key)) << key << " is at its default in both recipes";
    }
  }
}

// `ltrain run`'s recipe: the entrypoint keys with other values than their defaults reach the agent
// through the coordinator's start command, without the trainer's sections.
TEST(RecipeKeysTest, ProgramRecipeReachesTheAgent) {
  SetLogLevel(LogLevel::kWarning);
  constexpr const char* kProgram = R"(name: program
parallel: {nodes: {min: 1, max: 2}, nproc_per_node: 2}
fault: {max_restarts: 3}
entrypoint: {command: [python3, train.py, --lr, "3e-4"], env: {NCCL_DEBUG: INFO, A: "x y"}, workdir: /srv/train,
             output_timeout_s: 45, warm_standby: gpu}
)";
  RecipeParseResult user = ParseRecipe(kProgram, "program.yaml");
  ASSERT_TRUE(user.ok()) << user.ErrorText();
  const std::map<std::string, std::string> defaults = RecipeKeyValues(Recipe{});
  for (const std::string& key : kProgramKeys) EXPECT_NE(RecipeKeyValues(user.recipe).at(key), defaults.at(key)) << key;

  std::optional<v1::Command> command = StartCommandOf(user.recipe, "program.yaml");
  ASSERT_TRUE(command && command->has_start());
  const std::string& yaml = command->start().recipe_yaml();
  for (const char* section : {"model:", "data:", "training:"}) EXPECT_EQ(yaml.find(section), std::string::npos) << yaml;
  RecipeParseResult received = ParseRecipe(yaml, "recipe.yaml");
  ASSERT_TRUE(received.ok()) << received.ErrorText() << yaml;
  EXPECT_EQ(received.recipe.entrypoint.command, (std::vector<std::string>{"python3", "train.py", "--lr", "3e-4"}));
  EXPECT_EQ(received.recipe.entrypoint.env, (std::map<std::string, std::string>{{"A", "x y"}, {"NCCL_DEBUG", "INFO"}}));
  EXPECT_EQ(received.recipe.entrypoint.workdir, "/srv/train");
  EXPECT_EQ(received.recipe.entrypoint.output_timeout_s, 45);
  EXPECT_EQ(received.recipe.entrypoint.warm_standby, WarmStandby::kGpu);
  EXPECT_EQ(received.recipe.fault.max_restarts, 3);
  EXPECT_EQ(command->start().world_size(), 2);
}

}  // namespace
}  // namespace ltrain
