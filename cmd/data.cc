// ltrain data prepare: a corpus to token shards (common/data/prepare.h); ltrain data inspect: what a
// prepared dataset holds.
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>

#include <nlohmann/json.hpp>

#include "cmd/cli_support.h"
#include "cmd/commands.h"
#include "common/data/prepare.h"
#include "common/data/token_data.h"
#include "common/data/tokenizer.h"
#include "common/safetensors.h"

namespace ltrain::cli {
namespace {

namespace fs = std::filesystem;

struct DataPrepareArgs {
  PrepareOptions options;
  std::string format = "auto";
  std::string shard_size = "1GB";
  std::string tokenizer_sample = "256MB";
  bool quiet = false;
};

std::string Bytes(double bytes) {
  char text[32];
  if (bytes >= 1e9) {
    std::snprintf(text, sizeof(text), "%.2f GB", bytes / 1e9);
  } else if (bytes >= 1e6) {
    std::snprintf(text, sizeof(text), "%.1f MB", bytes / 1e6);
  } else {
    std::snprintf(text, sizeof(text), "%.0f kB", bytes / 1e3);
  }
  return text;
}

std::string Duration(double seconds) {
  char text[32];
  const long s = static_cast<long>(seconds + 0.5);
  if (s >= 3600) {
    std::snprintf(text, sizeof(text), "%ld:%02ld:%02ld", s / 3600, s / 60 % 60, s % 60);
  } else {
    std::snprintf(text, sizeof(text), "%ld:%02ld", s / 60, s % 60);
  }
  return text;
}

// A bar redrawn in place on a terminal; elsewhere (a log, CI) a line when a phase ends, and every
// ten seconds within a long one. Phases that count bytes show them, the rate and the time left.
class ProgressBar {
 public:
  explicit ProgressBar(bool quiet) : quiet_(quiet), tty_(::isatty(STDERR_FILENO) != 0) {}
  ~ProgressBar() { Finish(); }

  void Update(const std::string& what, int64_t done, int64_t total, bool bytes) {
    if (quiet_ || (total <= 0 && !bytes)) return;
    const auto now = std::chrono::steady_clock::now();
    if (what != what_) {
      Finish();
      what_ = what;
      start_ = now;
      last_ = now - std::chrono::hours(1);
    }
    const bool end = total > 0 && done >= total;
    if (now - last_ < (tty_ ? std::chrono::milliseconds(200) : std::chrono::milliseconds(10000)) && !end) return;
    last_ = now;
    const double seconds = std::chrono::duration<double>(now - start_).count();
    std::string figures;
    if (bytes) {
      const double rate = seconds >= 1 ? static_cast<double>(done) / seconds : 0;
      figures = Bytes(static_cast<double>(done)) + (total > 0 ? " of " + Bytes(static_cast<double>(total)) : "") +
                (rate > 0 ? ", " + Bytes(rate) + "/s" : "");
      if (total > 0 && rate > 0 && !end) figures += ", " + Duration(static_cast<double>(total - done) / rate) + " left";
    }
    const int percent = total > 0 ? static_cast<int>(100 * done / total) : -1;
    if (tty_) {
      std::string bar;
      if (percent >= 0) {
        const int width = 24, filled = static_cast<int>(width * done / total);
        bar = "[" + std::string(static_cast<size_t>(filled), '#') + std::string(static_cast<size_t>(width - filled), ' ') +
              "] " + std::to_string(percent) + "% ";
      }
      std::fprintf(stderr, "\r%-22s %s%s\033[K", what.c_str(), bar.c_str(), figures.c_str());
      open_ = true;
    } else {
      std::fprintf(stderr, "%s:%s%s\n", what.c_str(), percent >= 0 ? (" " + std::to_string(percent) + "%").c_str() : "",
                   figures.empty() ? "" : (" (" + figures + ")").c_str());
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
  std::chrono::steady_clock::time_point start_{}, last_{};
};

int DataPrepare(DataPrepareArgs& args) {
  PrepareOptions& o = args.options;
  StatusOr<InputFormat> format = ParseInputFormat(args.format);
  StatusOr<int64_t> shard = ParseByteSize(args.shard_size);
  StatusOr<int64_t> sample = ParseByteSize(args.tokenizer_sample);
  for (const Status& s : {format.status(), shard.status(), sample.status()}) {
    if (!s.ok()) {
      std::fprintf(stderr, "ltrain data prepare: %s\n", s.message().c_str());
      return kExitInvalid;
    }
  }
  o.format = *format;
  o.shard_bytes = *shard;
  o.tokenizer_sample_bytes = *sample;
  std::atomic<bool> cancel{false};
  o.cancel = &cancel;
  InterruptWatcher watcher;
  ProgressBar bar(args.quiet);
  o.progress = [&bar](const std::string& what, int64_t done, int64_t total, bool bytes) {
    bar.Update(what, done, total, bytes);
  };
  StatusOr<PrepareStats> stats = Internal("not run");
  {
    InterruptWatcher::Watching watching = watcher.Start([&cancel](int) { cancel = true; });
    stats = PrepareData(o);
  }
  bar.Finish();
  if (cancel) {
    std::fprintf(stderr, "ltrain data prepare: stopped; nothing was written (%s is as it was)\n", o.output_dir.c_str());
    return 130;
  }
  if (!stats.ok()) {
    std::fprintf(stderr, "ltrain data prepare: %s\n", stats.status().message().c_str());
    return stats.status().code() == StatusCode::kInternal ? kExitFailed : kExitInvalid;
  }
  const DataInfo& info = stats->info;
  const double rate = stats->seconds > 0 ? static_cast<double>(stats->bytes) / stats->seconds : 0;
  std::printf("tokenized %d input(s), %s (%s of text) in %.1f s, %s/s, with the %s tokenizer%s%s (vocab %d)\n",
              stats->files, Bytes(static_cast<double>(stats->bytes)).c_str(),
              Bytes(static_cast<double>(stats->text_bytes)).c_str(), stats->seconds, Bytes(rate).c_str(),
              info.tokenizer.c_str(), info.tokenizer_file.empty() ? "" : " ", info.tokenizer_file.c_str(), info.vocab);
  int train_shards = 0, val_shards = 0;
  for (const ShardInfo& s : info.shards) (s.split == "train" ? train_shards : val_shards)++;
  std::printf("wrote %s: train %lld tokens in %lld documents (%d shard%s), val %lld tokens in %lld documents "
              "(%d shard%s), %s tokens\n",
              stats->output_dir.c_str(), static_cast<long long>(info.train_tokens),
              static_cast<long long>(info.train_documents), train_shards, train_shards == 1 ? "" : "s",
              static_cast<long long>(info.val_tokens), static_cast<long long>(info.val_documents), val_shards,
              val_shards == 1 ? "" : "s", info.dtype.c_str());
  // The recipe's sections for these tokens, to paste as they are (model.vocab may be larger).
  std::printf("in a recipe:\n  data:\n    path: %s\n", o.output_dir.c_str());
  if (info.tokenizer == "byte" || info.tokenizer == "huggingface") {
    std::printf("    tokenizer: %s\n", info.tokenizer.c_str());
  }
  std::printf("  model:\n    vocab: %d\n", info.vocab);
  return kExitOk;
}

struct DataInspectArgs {
  std::string dir;
  std::string output;
  bool verify = false;
};

// The XXH3-64 of a token file's tokens, as the manifest gives it.
StatusOr<std::string> TokensXxh3(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return NotFound("cannot read " + path);
  in.seekg(static_cast<std::streamoff>(kTokenHeaderBytes));
  Xxh3 hash;
  std::vector<char> buf(1 << 20);
  while (in) {
    in.read(buf.data(), static_cast<std::streamsize>(buf.size()));
    hash.Update(buf.data(), static_cast<size_t>(in.gcount()));
  }
  return hash.Hex();
}

int DataInspect(const DataInspectArgs& args) {
  const bool json = args.output == "json";
  StatusOr<DataInfo> read = ReadDataInfo(args.dir);
  if (!read.ok() && read.status().code() != StatusCode::kNotFound) {
    std::fprintf(stderr, "ltrain data inspect: %s\n", read.status().message().c_str());
    return kExitInvalid;
  }
  DataInfo info = read.ok() ? *read : DataInfo{};
  StatusOr<TokenDataset> train = TokenDataset::OpenSplit(args.dir, "train");
  if (!train.ok()) {
    std::fprintf(stderr, "ltrain data inspect: %s is not a dataset `ltrain data prepare` wrote: %s\n", args.dir.c_str(),
                 train.status().message().c_str());
    return kExitInvalid;
  }
  StatusOr<TokenDataset> val = TokenDataset::OpenSplit(args.dir, "val");
  if (info.format < 2) {
    info.vocab = train->vocab();
    info.dtype = train->bytes_per_token() == 2 ? "uint16" : "uint32";
    info.train_tokens = train->size();
    info.val_tokens = val.ok() ? val->size() : 0;
  }
  // Whether each shard's tokens are what the manifest says (--verify reads them all).
  std::vector<std::string> damaged;
  if (args.verify) {
    for (const ShardInfo& s : info.shards) {
      StatusOr<std::string> sum = TokensXxh3((fs::path(args.dir) / s.file).string());
      if (!sum.ok() || *sum != s.xxh3) damaged.push_back(s.file);
    }
  }
  // SFT data: how many training tokens the loss counts.
  int64_t counted = 0;
  if (train->masked()) {
    std::vector<uint8_t> mask(size_t{1} << 20);
    for (int64_t at = 0; at < train->size(); at += static_cast<int64_t>(mask.size())) {
      const int64_t n = std::min<int64_t>(static_cast<int64_t>(mask.size()), train->size() - at);
      train->ReadMask(at, n, mask.data());
      counted += std::count(mask.begin(), mask.begin() + n, uint8_t{1});
    }
  }
  // A decoded sample: the first document of the training split (its first 200 tokens), at most 400
  // characters.
  std::string sample;
  std::string spec = info.tokenizer_file.empty() ? "byte" : (fs::path(args.dir) / info.tokenizer_file).string();
  int64_t first_document = std::min<int64_t>(train->size(), 200);
  for (const ShardInfo& s : info.shards) {
    if (s.split != "train") continue;
    StatusOr<DocumentIndex> index = ReadDocumentIndex((fs::path(args.dir) / s.index).string());
    if (index.ok() && index->starts.size() > 1) {
      first_document = std::min<int64_t>(first_document, static_cast<int64_t>(index->starts[1]));
    }
    break;
  }
  if (StatusOr<std::unique_ptr<TextTokenizer>> tokenizer = TextTokenizer::Load(spec); tokenizer.ok()) {
    std::vector<uint32_t> ids;
    const int64_t eot = (*tokenizer)->end_of_text();
    for (int64_t i = 0; i < first_document; ++i) {
      const uint32_t id = train->token(i);
      if (static_cast<int64_t>(id) == eot) break;
      ids.push_back(id);
    }
    sample = (*tokenizer)->Decode(ids);
    if (sample.size() > 400) sample = sample.substr(0, 400) + "...";
  }
  if (json) {
    nlohmann::json out;
    out["path"] = args.dir;
    out["format"] = info.format;
    out["tokenizer"] = info.tokenizer;
    out["tokenizer_file"] = info.tokenizer_file;
    out["tokenizer_sha256"] = info.tokenizer_sha256;
    out["tokenizer_from"] = info.tokenizer_from;
    out["vocab"] = info.vocab;
    out["dtype"] = info.dtype;
    out["train_tokens"] = info.train_tokens;
    out["val_tokens"] = info.val_tokens;
    out["train_documents"] = info.train_documents;
    out["val_documents"] = info.val_documents;
    out["sft"] = info.sft;
    if (info.sft) out["train_loss_tokens"] = counted;
    out["inputs"] = nlohmann::json::array();
    for (const InputInfo& i : info.inputs) {
      out["inputs"].push_back({{"path", i.path}, {"bytes", i.bytes}, {"documents", i.documents}});
    }
    out["shards"] = nlohmann::json::array();
    for (const ShardInfo& s : info.shards) {
      out["shards"].push_back({{"file", s.file}, {"index", s.index}, {"split", s.split}, {"tokens", s.tokens},
                               {"documents", s.documents}, {"first_input", s.first_input},
                               {"last_input", s.last_input}, {"xxh3", s.xxh3}, {"mask", s.mask}});
    }
    if (args.verify) out["damaged_shards"] = damaged;
    out["sample"] = sample;
    std::printf("%s\n", out.dump(2, ' ', false, nlohmann::json::error_handler_t::replace).c_str());
  } else {
    std::printf("dataset %s (format %d)\n", args.dir.c_str(), info.format);
    std::printf("tokenizer: %s%s%s, vocab %d%s\n", info.tokenizer.c_str(), info.tokenizer_file.empty() ? "" : " ",
                info.tokenizer_file.c_str(), info.vocab,
                info.tokenizer_sha256.empty() ? "" : (", sha256 " + info.tokenizer_sha256.substr(0, 16) + "...").c_str());
    if (!info.tokenizer_from.empty()) std::printf("tokenizer from: %s\n", info.tokenizer_from.c_str());
    std::printf("tokens: train %lld, val %lld, stored as %s", static_cast<long long>(info.train_tokens),
                static_cast<long long>(info.val_tokens), info.dtype.c_str());
    if (info.format >= 2) {
      std::printf("; documents: train %lld, val %lld", static_cast<long long>(info.train_documents),
                  static_cast<long long>(info.val_documents));
    }
    std::printf("\n");
    if (info.sft) {
      std::printf("supervised fine-tuning data: the loss counts %lld of the %lld training tokens (the responses')\n",
                  static_cast<long long>(counted), static_cast<long long>(info.train_tokens));
    }
    if (!info.inputs.empty()) {
      std::printf("inputs (%zu):\n", info.inputs.size());
      for (const InputInfo& i : info.inputs) {
        std::printf("  %s  %s, %lld document%s\n", i.path.c_str(), Bytes(static_cast<double>(i.bytes)).c_str(),
                    static_cast<long long>(i.documents), i.documents == 1 ? "" : "s");
      }
    }
    if (!info.shards.empty()) {
      std::printf("shards (%zu):\n", info.shards.size());
      for (const ShardInfo& s : info.shards) {
        std::printf("  %s  %lld tokens, %lld documents, inputs %d-%d, xxh3 %s\n", s.file.c_str(),
                    static_cast<long long>(s.tokens), static_cast<long long>(s.documents), s.first_input,
                    s.last_input, s.xxh3.c_str());
      }
    } else {
      std::printf("files: train.bin%s (written before shards: no document index)\n", val.ok() ? ", val.bin" : "");
    }
    if (args.verify) {
      std::printf(damaged.empty() ? "verified: every shard's tokens match the manifest's checksum\n"
                                  : "damaged: %zu shard(s) do not match the manifest's checksum\n",
                  damaged.size());
      for (const std::string& d : damaged) std::printf("  %s\n", d.c_str());
    }
    if (!sample.empty()) std::printf("sample (the first training document):\n%s\n", sample.c_str());
  }
  return damaged.empty() ? kExitOk : kExitFailed;
}

}  // namespace

void AddDataCommand(CLI::App& app, CommandContext& ctx) {
  CLI::App* data = app.add_subcommand("data", "Prepare training data, and inspect what was prepared");
  data->require_subcommand(1);
  auto args = std::make_shared<DataPrepareArgs>();
  CLI::App* prepare = data->add_subcommand(
      "prepare",
      "Tokenize a corpus on every core into shards of tokens with an index of their documents, in bounded "
      "memory; the directory also keeps the tokenizer and data.yaml, its manifest. Exit 2 for bad input "
      "(naming the file and line), 130 when stopped; nothing is left that looks complete");
  prepare->add_option("--input", args->options.inputs,
                      "Text files, JSON Lines (.jsonl, .ndjson), either zstd- or gzip-compressed, directories (every "
                      "file under them), globs ('data/*.jsonl.zst'), or - for standard input (JSON Lines unless "
                      "--format text), in order")
      ->required()
      ->expected(1, -1)
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
  prepare->add_option("--output", args->options.output_dir,
                      "Directory to write the dataset into: a new or empty one (written beside and renamed into place "
                      "once complete)")
      ->required();
  prepare->add_flag("--overwrite", args->options.overwrite,
                    "Replace the dataset --output holds (refused otherwise; a folder with other files always is)");
  prepare->add_option("--format", args->format,
                      "auto: JSON Lines by name (.jsonl, .ndjson, before .zst or .gz) and for standard input, text "
                      "otherwise; text; or jsonl")
      ->capture_default_str();
  prepare->add_option("--jsonl-field", args->options.jsonl_field, "The JSON Lines records' key that holds the text")
      ->capture_default_str();
  prepare->add_flag("--sft", args->options.sft,
                    "Supervised fine-tuning data: JSON Lines of {\"prompt\": ..., \"response\": ...} (a chat "
                    "rendered with its template goes in prompt, the answer to learn in response); training counts "
                    "the loss on the response's tokens only");
  prepare->add_option("--val-fraction", args->options.val_fraction,
                      "Share of the documents kept for validation, chosen by a hash of each (text files longer than "
                      "8 KiB by pieces of that size)")
      ->check(CLI::Range(0.0, 0.5))
      ->capture_default_str();
  prepare->add_option("--shard-size", args->shard_size, "Bytes of tokens a shard holds, about (1GB, 256MB, ...)")
      ->capture_default_str();
  prepare->add_option("--tokenizer", args->options.tokenizer,
                      "byte (vocab 256), a Hugging Face tokenizer.json (byte-level BPE: GPT-2, Llama 3, and what "
                      "--train-tokenizer writes), a SentencePiece .model (Llama 2, Mistral), or a model's directory "
                      "(its tokenizer.json or tokenizer.model; documents begin with its begin-of-text token where its "
                      "post-processor puts one)")
      ->capture_default_str();
  prepare->add_option("--train-tokenizer", args->options.train_tokenizer,
                      "bpe: train a byte-level BPE of --vocab ids on the corpus' first --tokenizer-sample bytes, kept "
                      "as tokenizer.json")
      ->check(CLI::IsMember({"bpe"}));
  prepare->add_option("--vocab", args->options.vocab, "Vocabulary of --train-tokenizer (256 bytes, merges, <|endoftext|>)");
  prepare->add_option("--tokenizer-sample", args->tokenizer_sample, "Text --train-tokenizer learns from")
      ->capture_default_str();
  prepare->add_option("--threads", args->options.threads, "Threads to tokenize on (0: every core)")
      ->check(CLI::Range(0, kMaxPrepareThreads))
      ->capture_default_str();
  prepare->add_flag("-q,--quiet", args->quiet, "No progress output");
  ctx.Bind(prepare, [args] { return DataPrepare(*args); });

  auto inspect_args = std::make_shared<DataInspectArgs>();
  CLI::App* inspect = data->add_subcommand(
      "inspect",
      "What a prepared dataset holds: its tokenizer, inputs, shards, tokens and documents, and a decoded sample. "
      "Exit 1 when --verify finds a shard that does not match its checksum");
  inspect->add_option("dir", inspect_args->dir, "The dataset's directory (data.path)")->required();
  inspect->add_flag("--verify", inspect_args->verify, "Read every shard and check it against the manifest's checksum");
  AddOutputOption(inspect, &inspect_args->output, "text");
  ctx.Bind(inspect, [inspect_args] { return DataInspect(*inspect_args); });
}

}  // namespace ltrain::cli
