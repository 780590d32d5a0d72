// ltrain data prepare: tokenize text files into train.bin and val.bin (common/data_prepare.h).
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <memory>

#include "cmd/cli_support.h"
#include "cmd/commands.h"
#include "common/data_prepare.h"

namespace ltrain::cli {
namespace {

struct DataPrepareArgs {
  PrepareOptions options;
  bool quiet = false;
};

// A bar redrawn in place on a terminal; elsewhere (a log, CI) a line when a phase ends, and every
// ten seconds within a long one.
class ProgressBar {
 public:
  explicit ProgressBar(bool quiet) : quiet_(quiet), tty_(::isatty(STDERR_FILENO) != 0) {}
  ~ProgressBar() { Finish(); }

  void Update(const std::string& what, int64_t done, int64_t total) {
    if (quiet_ || total <= 0) return;
    if (what != what_) {
      Finish();
      what_ = what;
      last_ = std::chrono::steady_clock::now();
    }
    const auto now = std::chrono::steady_clock::now();
    if (tty_) {
      if (done != total && now - last_ < std::chrono::milliseconds(100)) return;
      last_ = now;
      const int width = 30, filled = static_cast<int>(width * done / total);
      std::fprintf(stderr, "\r%-24s [%s%s] %3d%%", what.c_str(), std::string(filled, '#').c_str(),
                   std::string(width - filled, ' ').c_str(), static_cast<int>(100 * done / total));
      open_ = true;
    } else if (done == total || now - last_ >= std::chrono::seconds(10)) {
      last_ = now;
      std::fprintf(stderr, "%s: %d%%\n", what.c_str(), static_cast<int>(100 * done / total));
    }
    std::fflush(stderr);
  }

  void Finish() {
    if (open_) std::fprintf(stderr, "\n");
    open_ = false;
  }

 private:
  bool quiet_, tty_;
  bool open_ = false;
  std::string what_;
  std::chrono::steady_clock::time_point last_{};
};

int DataPrepare(DataPrepareArgs& args) {
  PrepareOptions& o = args.options;
  ProgressBar bar(args.quiet);
  o.progress = [&bar](const std::string& what, int64_t done, int64_t total) { bar.Update(what, done, total); };
  StatusOr<PrepareStats> stats = PrepareData(o);
  bar.Finish();
  if (!stats.ok()) {
    std::fprintf(stderr, "ltrain data prepare: %s\n", stats.status().message().c_str());
    return stats.status().code() == StatusCode::kInternal ? kExitFailed : kExitInvalid;
  }
  const DataInfo& info = stats->info;
  std::printf("tokenized %d file(s), %lld bytes, with the %s tokenizer%s%s (vocab %d)\n", stats->files,
              static_cast<long long>(stats->bytes), info.tokenizer.c_str(), info.tokenizer_file.empty() ? "" : " ",
              info.tokenizer_file.c_str(), info.vocab);
  std::printf("wrote %s (%lld tokens) and %s (%lld tokens), %s tokens\n", stats->train_path.c_str(),
              static_cast<long long>(info.train_tokens), stats->val_path.c_str(),
              static_cast<long long>(info.val_tokens), info.vocab <= 65536 ? "uint16" : "uint32");
  // The recipe's sections for these tokens, to paste as they are (model.vocab may be larger).
  std::printf("in a recipe:\n  data:\n    path: %s\n", o.output_dir.c_str());
  if (info.tokenizer == "byte" || info.tokenizer == "huggingface") {
    std::printf("    tokenizer: %s\n", info.tokenizer.c_str());
  }
  std::printf("  model:\n    vocab: %d\n", info.vocab);
  return kExitOk;
}

}  // namespace

void AddDataCommand(CLI::App& app, CommandContext& ctx) {
  CLI::App* data = app.add_subcommand("data", "Prepare training data");
  data->require_subcommand(1);
  auto args = std::make_shared<DataPrepareArgs>();
  CLI::App* prepare = data->add_subcommand(
      "prepare",
      "Tokenize text into train.bin and val.bin, on every core; the directory also keeps the tokenizer and "
      "data.yaml (which tokenizer made the tokens)");
  prepare->add_option("--input", args->options.inputs,
                      "Text files, directories (every file under them) or globs ('data/*.txt'), in order")
      ->required()
      ->expected(1, -1)
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
  prepare->add_option("--output", args->options.output_dir,
                      "Directory to write train.bin and val.bin into: a new or empty one (written beside and renamed "
                      "into place once complete)")
      ->required();
  prepare->add_flag("--overwrite", args->options.overwrite,
                    "Replace the dataset --output holds (refused otherwise; a folder with other files always is)");
  prepare->add_option("--val-fraction", args->options.val_fraction, "Share of the tokens kept for validation (the tail)")
      ->check(CLI::Range(0.0, 0.5))
      ->capture_default_str();
  prepare->add_option("--tokenizer", args->options.tokenizer,
                      "byte (vocab 256), a Hugging Face tokenizer.json (byte-level BPE: GPT-2, Llama 3, and what "
                      "--train-tokenizer writes), or a SentencePiece .model (Llama 2, Mistral)")
      ->capture_default_str();
  prepare->add_option("--train-tokenizer", args->options.train_tokenizer,
                      "bpe: train a byte-level BPE of --vocab ids on the input first, kept as tokenizer.json")
      ->check(CLI::IsMember({"bpe"}));
  prepare->add_option("--vocab", args->options.vocab, "Vocabulary of --train-tokenizer (256 bytes, merges, <|endoftext|>)");
  prepare->add_option("--threads", args->options.threads, "Threads to tokenize on (0: every core)")
      ->check(CLI::Range(0, kMaxPrepareThreads))
      ->capture_default_str();
  prepare->add_flag("-q,--quiet", args->quiet, "No progress output");
  ctx.Bind(prepare, [args] { return DataPrepare(*args); });
}

}  // namespace ltrain::cli
