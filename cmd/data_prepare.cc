// ltrain data prepare: tokenize text files into train.bin and val.bin.
#include <cstdio>
#include <memory>

#include "cmd/cli_support.h"
#include "cmd/commands.h"
#include "common/token_data.h"

namespace ltrain::cli {
namespace {

struct DataPrepareArgs {
  std::vector<std::string> inputs;
  std::string output;
  std::string tokenizer = "byte";
  double val_fraction = 0.05;
};

int DataPrepare(const DataPrepareArgs& args) {
  std::printf("tokenizing %zu file(s) with the %s tokenizer...\n", args.inputs.size(), args.tokenizer.c_str());
  std::fflush(stdout);
  StatusOr<PrepareStats> stats = PrepareTokenData(args.inputs, args.output, args.val_fraction, args.tokenizer);
  if (!stats.ok()) {
    std::fprintf(stderr, "ltrain data prepare: %s\n", stats.status().message().c_str());
    return kExitInvalid;
  }
  std::printf("wrote %s (%lld tokens) and %s (%lld tokens), vocab %d\n", stats->train_path.c_str(),
              static_cast<long long>(stats->train_tokens), stats->val_path.c_str(),
              static_cast<long long>(stats->val_tokens), stats->vocab);
  return kExitOk;
}

}  // namespace

void AddDataCommand(CLI::App& app, CommandContext& ctx) {
  CLI::App* data = app.add_subcommand("data", "Prepare training data");
  data->require_subcommand(1);
  auto args = std::make_shared<DataPrepareArgs>();
  CLI::App* prepare = data->add_subcommand(
      "prepare", "Tokenize text files into train.bin and val.bin (header: magic, version, vocab, count)");
  prepare->add_option("--input", args->inputs, "Text file(s), concatenated in order")
      ->required()
      ->expected(1, -1)
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
  prepare->add_option("--output", args->output, "Directory to write train.bin and val.bin into")->required();
  prepare->add_option("--val-fraction", args->val_fraction, "Share of the tokens kept for validation (the tail)")
      ->check(CLI::Range(0.0, 0.5))
      ->capture_default_str();
  prepare->add_option("--tokenizer", args->tokenizer, "Tokenizer; byte (vocab 256)")
      ->check(CLI::IsMember({"byte"}))
      ->capture_default_str();
  ctx.Bind(prepare, [args] { return DataPrepare(*args); });
}

}  // namespace ltrain::cli
