// Writes one split of a dataset (train or val) as token files of about a fixed size, each with its
// documents' index (common/data/manifest.h): NAME-00000.bin, NAME-00000.idx, ... Tokens and document
// starts are streamed to the open shard's two files (their headers completed when it closes):
// nothing grows with the shard. No LibTorch here.
#pragma once

#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include "common/data/manifest.h"
#include "common/safetensors.h"
#include "common/status.h"

namespace ltrain {

class ShardWriter {
 public:
  // Shards of about `shard_bytes` bytes of tokens (a shard ends at the first piece past it), uint16
  // tokens up to vocab 65536, uint32 above.
  // `masked`: every shard gets a loss mask file beside it (NAME-00000.mask; SFT data).
  ShardWriter(std::string dir, std::string split, int64_t shard_bytes, uint32_t vocab, bool masked = false);
  ~ShardWriter();
  ShardWriter(const ShardWriter&) = delete;
  ShardWriter& operator=(const ShardWriter&) = delete;

  // Appends a piece of a document: `starts` where a document (or a part of one the other split
  // did not take) begins. `input`: which input it came from.
  // `mask` (masked writers only): one byte per id, 1 where the loss counts predicting it.
  Status Append(const std::vector<uint32_t>& ids, bool starts, int input, const std::vector<uint8_t>* mask = nullptr);
  // Closes the open shard: its header completed, flushed, synced.
  Status Finish();

  const std::vector<ShardInfo>& shards() const { return shards_; }
  int64_t tokens() const { return tokens_; }
  int64_t documents() const { return documents_; }

 private:
  Status OpenShard();
  Status CloseShard();

  std::string dir_, split_;
  int64_t shard_tokens_;
  uint32_t vocab_;
  int width_;
  std::FILE* file_ = nullptr;
  std::FILE* index_file_ = nullptr;
  std::FILE* mask_file_ = nullptr;
  bool masked_ = false;
  std::string path_, index_path_, mask_path_;
  ShardInfo open_;
  bool continues_ = false;  // the open shard begins inside a document
  bool in_document_ = false;  // a document is open at the end of what was written
  std::optional<Xxh3> hash_;  // of the open shard's tokens
  std::vector<uint16_t> narrow_;
  std::vector<ShardInfo> shards_;
  int64_t tokens_ = 0;
  int64_t documents_ = 0;
};

}  // namespace ltrain
