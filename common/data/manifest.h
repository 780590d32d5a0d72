// A prepared dataset's manifest (DIR/data.yaml) and its documents' index files.
//
// A dataset directory, as `ltrain data prepare` writes it:
//   data.yaml             this manifest, written last: a directory without it is not a dataset
//   tokenizer.json        the tokenizer (or tokenizer.model; none for bytes)
//   train-00000.bin ...   token files (common/data/token_data.h) of about --shard-size bytes each
//   train-00000.idx ...   where each document of the shard starts (below)
//   val-00000.bin ...     the same for the validation documents
//   train-00000.mask ...  SFT data (prepare --sft) only: which tokens the loss counts, one byte each
// data.yaml:
//   format: 2
//   tokenizer: huggingface            # byte | huggingface | sentencepiece
//   tokenizer_file: tokenizer.json
//   tokenizer_sha256: 3f1a...         # of the tokenizer file
//   tokenizer_from: /models/llama-3.2 # where --tokenizer named a model's directory
//   vocab: 32000
//   dtype: uint16                     # uint16 up to vocab 65536, uint32 above
//   sft: true                         # only for SFT data; then every shard names its mask file
//   train_tokens: 123456
//   val_tokens: 6543
//   train_documents: 812
//   val_documents: 41
//   inputs:                           # in the order read
//     - {path: corpus/part-0.jsonl.zst, bytes: 1048576, documents: 853}
//   shards:
//     - {file: train-00000.bin, index: train-00000.idx, split: train, tokens: 123456, documents: 812,
//        first_input: 0, last_input: 0, xxh3: 9c0e...}      # SFT data adds mask: train-00000.mask
// Data written before shards (format 1) has train.bin and val.bin and a data.yaml of the first five
// keys, or no data.yaml at all (bytes).
//
// Index file (little-endian):
//   offset  0  char[8]   magic "LTRNIDX1"
//   offset  8  uint32    format version (1)
//   offset 12  uint32    flags: bit 0, the shard's first tokens continue a document of the shard before
//   offset 16  uint64    N, documents that start in the shard
//   offset 24  uint64[N] the token offset (in the shard) where each starts; each ends where the next
//                        starts, the last at the shard's end
// No LibTorch here.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"

namespace ltrain {

struct InputInfo {
  std::string path;       // as given ("-": standard input)
  int64_t bytes = 0;      // as stored (compressed where it is)
  int64_t documents = 0;
};

struct ShardInfo {
  std::string file;       // in the dataset directory
  std::string index;
  std::string split;      // "train" or "val"
  int64_t tokens = 0;
  int64_t documents = 0;  // that start in it
  int first_input = 0;    // the inputs its documents came from (indices into DataInfo::inputs)
  int last_input = 0;
  std::string xxh3;       // XXH3-64 of its tokens (the bytes after the header), 16 hex digits
  std::string mask;       // SFT data: its loss mask file (common/data/token_data.h); empty otherwise
};

struct DataInfo {
  int format = 1;                   // 1: train.bin and val.bin; 2: shards
  std::string tokenizer = "byte";   // byte | huggingface | sentencepiece
  std::string tokenizer_file;       // in the data directory; empty for byte
  std::string tokenizer_sha256;
  std::string tokenizer_from;       // the model directory whose tokenizer it is (--tokenizer DIR); or empty
  int vocab = 256;
  std::string dtype = "uint16";
  bool sft = false;                 // supervised fine-tuning data: every shard has a loss mask
  int64_t train_tokens = 0;
  int64_t val_tokens = 0;
  int64_t train_documents = 0;
  int64_t val_documents = 0;
  std::vector<InputInfo> inputs;
  std::vector<ShardInfo> shards;
};

inline constexpr char kIndexMagic[8] = {'L', 'T', 'R', 'N', 'I', 'D', 'X', '1'};
inline constexpr uint32_t kIndexFormatVersion = 1;
inline constexpr size_t kIndexHeaderBytes = 24;

// DIR/data.yaml, written atomically.
Status WriteDataInfo(const std::string& dir, const DataInfo& info);

// DIR/data.yaml; NotFound when the directory has none (data written before it existed: bytes).
StatusOr<DataInfo> ReadDataInfo(const std::string& dir);

// A shard's documents: where each starts, and whether the first tokens continue one from before.
struct DocumentIndex {
  bool continues = false;
  std::vector<uint64_t> starts;
};

// The header of an index file of `documents` starts (the starts follow it, 8 bytes each).
std::string DocumentIndexHeader(bool continues, uint64_t documents);
StatusOr<DocumentIndex> ReadDocumentIndex(const std::string& path);

// The file's SHA-256, 64 hex digits.
StatusOr<std::string> FileSha256(const std::string& path);

}  // namespace ltrain
