// ltrain export and ltrain generate: what a trained model is for. Both run ltrain-worker (the
// binary with LibTorch, beside ltrain) in the foreground with the same arguments; see
// worker/train/model_tools.h.
#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "agent/agent.h"
#include "cmd/cli_support.h"
#include "cmd/commands.h"

namespace ltrain::cli {
namespace {

// Replaces this process with ltrain-worker `argv`; returns only when it cannot start.
int ExecWorker(std::vector<std::string> argv) {
  const std::string binary = agent::DefaultWorkerBinary();
  argv.insert(argv.begin(), binary);
  std::vector<char*> raw;
  for (std::string& a : argv) raw.push_back(a.data());
  raw.push_back(nullptr);
  std::fflush(stdout);
  ::signal(SIGPIPE, SIG_DFL);  // main ignores it; the worker's output piped into head ends the worker
  ::execv(binary.c_str(), raw.data());
  std::fprintf(stderr, "ltrain: cannot run %s (%s): it holds the model code; install it beside ltrain, or set "
               "LTRAIN_WORKER_BIN\n", binary.c_str(), std::strerror(errno));
  return kExitFailed;
}

struct ExportArgs {
  std::string checkpoint, output, format = "hf", dtype = "fp32", tokenizer;
  double max_shard_gb = 5;
};

struct GenerateArgs {
  std::string checkpoint, prompt, device = "cpu", dtype = "fp32", tokenizer, output = "text";
  int max_tokens = 200, top_k = 50;
  double temperature = 0.8;
  uint64_t seed = 1;
  bool score = false;
};

}  // namespace

void AddExportCommand(CLI::App& app, CommandContext& ctx) {
  auto args = std::make_shared<ExportArgs>();
  CLI::App* cmd = app.add_subcommand(
      "export",
      "Write a checkpoint (saved in any layout) as a Hugging Face model: model.safetensors (sharded with an index "
      "above --max-shard-gb), config.json (LlamaForCausalLM or GPT2LMHeadModel) and the tokenizer files");
  cmd->add_option("checkpoint", args->checkpoint, "A step-N directory, or a checkpoint directory (its newest commit)")
      ->required();
  cmd->add_option("--output", args->output, "New directory to write (must not exist, or be empty)")->required();
  cmd->add_option("--format", args->format, "hf: Hugging Face transformers' layout")
      ->check(CLI::IsMember({"hf"}))
      ->capture_default_str();
  cmd->add_option("--dtype", args->dtype, "Weights as fp32 or bf16")->check(CLI::IsMember({"fp32", "bf16"}))->capture_default_str();
  cmd->add_option("--max-shard-gb", args->max_shard_gb, "Largest safetensors file before sharding")->capture_default_str();
  cmd->add_option("--tokenizer", args->tokenizer, "Tokenizer file to ship (default: the one the training data records)");
  ctx.Bind(cmd, [args] {
    std::vector<std::string> argv = {"export",  args->checkpoint, "--output", args->output, "--format", args->format,
                                     "--dtype", args->dtype,      "--max-shard-gb", std::to_string(args->max_shard_gb)};
    if (!args->tokenizer.empty()) argv.insert(argv.end(), {"--tokenizer", args->tokenizer});
    return ExecWorker(argv);
  });
}

void AddGenerateCommand(CLI::App& app, CommandContext& ctx) {
  auto args = std::make_shared<GenerateArgs>();
  CLI::App* cmd = app.add_subcommand(
      "generate", "Sample text from a checkpoint after a prompt, on the CPU or one GPU; --score prints the "
                  "prompt's per-token log-probabilities instead");
  cmd->add_option("checkpoint", args->checkpoint, "A step-N directory, or a checkpoint directory (its newest commit)")
      ->required();
  cmd->add_option("--prompt", args->prompt, "Text to continue (empty: start from the end-of-text token)");
  cmd->add_option("--max-tokens", args->max_tokens, "Tokens to sample at most (ends early at end-of-text)")
      ->check(CLI::Range(0, 1 << 20))
      ->capture_default_str();
  cmd->add_option("--temperature", args->temperature, "Sampling temperature; 0 takes the most likely token")
      ->check(CLI::Range(0.0, 100.0))
      ->capture_default_str();
  cmd->add_option("--top-k", args->top_k, "Sample among the k most likely tokens; 0: all")
      ->check(CLI::Range(0, 1 << 24))
      ->capture_default_str();
  cmd->add_option("--seed", args->seed, "Seed of the sampling")->capture_default_str();
  cmd->add_option("--device", args->device, "cpu, or cuda (GPU 0)")->check(CLI::IsMember({"cpu", "cuda"}))->capture_default_str();
  cmd->add_option("--dtype", args->dtype, "fp32, or bf16 products under autocast (with --device cuda)")
      ->check(CLI::IsMember({"fp32", "bf16"}))
      ->capture_default_str();
  cmd->add_option("--tokenizer", args->tokenizer, "Tokenizer file (default: the one the training data records)");
  cmd->add_flag("--score", args->score, "Print each prompt token's log-probability given the ones before it");
  AddOutputOption(cmd, &args->output, "text", "the text as it is sampled");
  ctx.Bind(cmd, [args] {
    std::vector<std::string> argv = {"generate",      args->checkpoint,
                                     "--prompt",      args->prompt,
                                     "--max-tokens",  std::to_string(args->max_tokens),
                                     "--temperature", std::to_string(args->temperature),
                                     "--top-k",       std::to_string(args->top_k),
                                     "--seed",        std::to_string(args->seed),
                                     "--device",      args->device,
                                     "--dtype",       args->dtype,
                                     "--score",       args->score ? "1" : "0",
                                     "--output-format", args->output};
    if (!args->tokenizer.empty()) argv.insert(argv.end(), {"--tokenizer", args->tokenizer});
    return ExecWorker(argv);
  });
}

}  // namespace ltrain::cli
