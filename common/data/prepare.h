// `ltrain data prepare`: a corpus to the token shards the worker trains on, in bounded memory.
//
// The inputs (common/data/corpus_reader.h: text files, JSON Lines, zstd or gzip, standard input;
// directories walked for their regular files in path order, shell globs) are read as a stream of
// pieces of documents, tokenized on every core in batches, and written in order as shards of about
// --shard-size bytes (common/data/shard_writer.h), each document ending with the tokenizer's
// end-of-text token where it has one. Which split a piece goes to is a hash of its text: a JSON
// Lines record or a text file of up to kTextPieceBytes is one piece; a longer text file is cut into
// pieces of about that size, at lines a pre-token never crosses. What is held at once is bounded by
// the threads (a few batches of about kBatchBytes each), whatever the corpus' size.
//
// Everything is written into a new folder beside the output and renamed into place once complete,
// data.yaml (the manifest, common/data/manifest.h) last: an interrupted or failed run leaves no
// dataset, and the output as it was.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "common/data/corpus_reader.h"
#include "common/data/manifest.h"
#include "common/recipe.h"
#include "common/status.h"

namespace ltrain {

// Fewer training tokens than this are refused: one sample alone is model.seq_len + 1 tokens.
inline constexpr int64_t kMinTrainTokens = 1024;
inline constexpr int kMaxPrepareThreads = 1024;
inline constexpr size_t kTextPieceBytes = size_t{8} << 10;
inline constexpr size_t kBatchBytes = size_t{1} << 20;
inline constexpr int64_t kDefaultShardBytes = int64_t{1} << 30;
inline constexpr int64_t kMinShardBytes = 4096;
// --train-tokenizer learns its merges from the corpus' first this many bytes of text.
inline constexpr int64_t kDefaultTokenizerSampleBytes = int64_t{256} << 20;

struct PrepareOptions {
  std::vector<std::string> inputs;  // files, directories, globs, or "-" (standard input)
  std::string output_dir;
  double val_fraction = 0.05;
  std::string tokenizer = "byte";   // "byte", a Hugging Face tokenizer.json or a SentencePiece .model
  std::string train_tokenizer;      // "bpe": train a byte-level BPE of `vocab` ids on the inputs first
  int vocab = 0;
  int64_t tokenizer_sample_bytes = kDefaultTokenizerSampleBytes;
  InputFormat format = InputFormat::kAuto;
  std::string jsonl_field = "text";
  // Supervised fine-tuning data: JSON Lines of {"prompt", "response"}; each shard gets a loss mask
  // that counts the response's tokens (and the end-of-text after them) only.
  bool sft = false;
  int64_t shard_bytes = kDefaultShardBytes;
  int threads = 0;                  // 0: every core; at most kMaxPrepareThreads
  bool overwrite = false;           // replace a dataset already in output_dir
  // Set (by a signal handler) to stop: the run ends with nothing written.
  const std::atomic<bool>* cancel = nullptr;
  // Called as work advances: what ("training the tokenizer", "tokenizing"), done, total (0: not
  // known), and whether they count bytes of input.
  std::function<void(const std::string& what, int64_t done, int64_t total, bool bytes)> progress;
};

struct PrepareStats {
  DataInfo info;
  int files = 0;
  int64_t bytes = 0;        // of the inputs as stored
  int64_t text_bytes = 0;   // of text, decompressed
  double seconds = 0;       // tokenizing and writing
  std::string output_dir;
};

// Writes the dataset into a new folder beside output_dir and renames it into place once complete:
// a failure leaves output_dir as it was. An output_dir that holds a dataset already is refused
// unless `overwrite`, and one that holds anything else always (InvalidArgument, naming it).
// Bad input (a malformed record, a truncated stream, binary data, no text) is InvalidArgument
// naming the input and the line.
StatusOr<PrepareStats> PrepareData(const PrepareOptions& options);

// The files `inputs` name: files as they are, directories walked, globs expanded, "-" kept;
// NotFound for an input that names nothing.
StatusOr<std::vector<std::string>> ExpandInputs(const std::vector<std::string>& inputs);

// "1GB", "512MB", "64KB" or bytes; InvalidArgument otherwise.
StatusOr<int64_t> ParseByteSize(const std::string& text);

// Whether `dir` holds a dataset `ltrain data prepare` wrote: its data.yaml, or a train.bin of before.
bool HoldsPreparedData(const std::string& dir);

// Why the recipe's model cannot train on the data in data.path or data.sources (its tokens declare a
// larger vocabulary than model.vocab; its data.yaml names another tokenizer than data.tokenizer; the
// sources were made by different tokenizers), with the fix; empty when it can, or when the data is
// not here.
std::string DataProblem(const Recipe& recipe);

}  // namespace ltrain
