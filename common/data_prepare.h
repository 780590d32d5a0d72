// `ltrain data prepare`: text files to the token files the worker trains on (common/token_data.h).
//
// The inputs (files, directories walked for their regular files in path order, shell globs) are
// tokenized on every core, in order, one end-of-text token between files when the tokenizer has one,
// and split into train.bin and val.bin (the tail). The directory also gets the tokenizer (a copy,
// or the one trained on the inputs) and data.yaml, which says which tokenizer made the tokens:
//   tokenizer: huggingface        # byte | huggingface | sentencepiece
//   tokenizer_file: tokenizer.json
//   vocab: 8192
//   train_tokens: 123456
//   val_tokens: 6543
// Every file is written to a temporary name, fsynced and renamed; data.yaml last.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "common/recipe.h"
#include "common/status.h"

namespace ltrain {

// Fewer training tokens than this are refused: one sample alone is model.seq_len + 1 tokens.
inline constexpr int64_t kMinTrainTokens = 1024;

struct PrepareOptions {
  std::vector<std::string> inputs;
  std::string output_dir;
  double val_fraction = 0.05;
  std::string tokenizer = "byte";   // "byte", a Hugging Face tokenizer.json or a SentencePiece .model
  std::string train_tokenizer;      // "bpe": train a byte-level BPE of `vocab` ids on the inputs first
  int vocab = 0;
  int threads = 0;                  // 0: every core; at most kMaxPrepareThreads
  bool overwrite = false;           // replace a dataset already in output_dir
  // Called as work advances: what ("reading", "training the tokenizer", "tokenizing"), done, total.
  std::function<void(const std::string& what, int64_t done, int64_t total)> progress;
};

struct DataInfo {
  std::string tokenizer = "byte";   // byte | huggingface | sentencepiece
  std::string tokenizer_file;       // in the data directory; empty for byte
  int vocab = 256;
  int64_t train_tokens = 0;
  int64_t val_tokens = 0;
};

struct PrepareStats {
  DataInfo info;
  int files = 0;
  int64_t bytes = 0;
  std::string train_path;
  std::string val_path;
};

inline constexpr int kMaxPrepareThreads = 1024;

// Writes the dataset into a new folder beside output_dir and renames it into place once complete:
// a failure leaves output_dir as it was. An output_dir that holds a dataset already is refused
// unless `overwrite`, and one that holds anything else always (InvalidArgument, naming it).
StatusOr<PrepareStats> PrepareData(const PrepareOptions& options);

// The files `inputs` name: files as they are, directories walked, globs expanded; NotFound for an
// input that names nothing.
StatusOr<std::vector<std::string>> ExpandInputs(const std::vector<std::string>& inputs);

// DIR/data.yaml; NotFound when the directory has none (data written before it existed: bytes).
StatusOr<DataInfo> ReadDataInfo(const std::string& dir);

// Why the recipe's model cannot train on the data in data.path (its train.bin declares a larger
// vocabulary than model.vocab; its data.yaml names another tokenizer than data.tokenizer), with the
// fix; empty when it can, or when the data is not here.
std::string DataProblem(const Recipe& recipe);

}  // namespace ltrain
