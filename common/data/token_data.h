// Token data: the on-disk format that `ltrain data prepare` writes and the worker reads (the loader
// that draws windows from it is common/data/loader.h).
//
// File layout (little-endian), one file per split (train.bin, val.bin):
//   offset  0  char[8]   magic "LTRNTOK1"
//   offset  8  uint32    format version (kTokenFormatVersion)
//   offset 12  uint32    vocabulary size
//   offset 16  uint64    token count
//   offset 24  uint32    bytes per token (2: uint16 tokens for a vocabulary up to 65536; 4: uint32)
//   offset 28  tokens
// `ltrain data prepare` (common/data/prepare.h) writes a dataset's splits as shards of this format
// (common/data/manifest.h); data written before shards has one file per split, train.bin and val.bin.
// No LibTorch here: the CLI links this.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/status.h"

namespace ltrain {

inline constexpr char kTokenMagic[8] = {'L', 'T', 'R', 'N', 'T', 'O', 'K', '1'};
inline constexpr uint32_t kTokenFormatVersion = 1;
inline constexpr size_t kTokenHeaderBytes = 28;

// The 28-byte header of a token file of `tokens` tokens of `bytes_per_token` bytes each.
std::string TokenFileHeader(uint32_t vocab, uint64_t tokens, uint32_t bytes_per_token);

// Writes one token file atomically (temp name, fsync, rename): uint16 tokens up to vocab 65536,
// uint32 above.
Status WriteTokenFile(const std::string& path, const std::vector<uint32_t>& tokens, uint32_t vocab);
Status WriteTokenFile(const std::string& path, const std::vector<uint16_t>& tokens, uint32_t vocab);

// A read-only, memory-mapped token file, or a split's shards one after another. Movable, not copyable.
class TokenDataset {
 public:
  static StatusOr<TokenDataset> Open(const std::string& path);
  // The split ("train" or "val") of the dataset in `dir`: its shards in the manifest's order, or
  // DIR/SPLIT.bin where the data has no shards. NotFound where the split has no tokens.
  static StatusOr<TokenDataset> OpenSplit(const std::string& dir, const std::string& split);

  TokenDataset(TokenDataset&& other) noexcept;
  TokenDataset& operator=(TokenDataset&& other) noexcept;
  TokenDataset(const TokenDataset&) = delete;
  TokenDataset& operator=(const TokenDataset&) = delete;
  ~TokenDataset();

  int64_t size() const { return size_; }
  int vocab() const { return vocab_; }
  // The file, or DIR/SPLIT-*.bin for shards.
  const std::string& path() const { return path_; }
  uint32_t token(int64_t i) const;
  // Tokens [start, start + n) into `out`, across shards.
  void Read(int64_t start, int64_t n, int64_t* out) const;
  int bytes_per_token() const { return width_; }
  int shards() const { return static_cast<int>(shards_.size()); }
  // Supervised fine-tuning data: whether each token has a loss mask (its .mask files), and the mask
  // of tokens [start, start + n): 1 where the loss counts predicting the token, 0 where it does not.
  bool masked() const { return masked_; }
  void ReadMask(int64_t start, int64_t n, uint8_t* out) const;

 private:
  struct Mapped {
    void* map = nullptr;
    size_t map_bytes = 0;
    const unsigned char* tokens = nullptr;
    int64_t first = 0;  // index of its first token in the split
    int64_t size = 0;
    void* mask_map = nullptr;
    size_t mask_map_bytes = 0;
    const uint8_t* mask = nullptr;
  };
  TokenDataset() = default;
  // Maps a shard's loss mask of `tokens` entries into `m`.
  static Status MapMask(const std::string& path, int64_t tokens, Mapped* m);
  void Release();
  size_t ShardOf(int64_t i) const;
  // Calls run(shard, from, k, done) for each shard's part of tokens [start, start + n): k tokens from
  // the shard's token `from`, after `done` of them.
  template <typename F>
  void ForEachRun(int64_t start, int64_t n, F&& run) const {
    int64_t done = 0;
    for (size_t s = ShardOf(start); done < n; ++s) {
      const Mapped& m = shards_[s];
      const int64_t from = start + done - m.first;
      const int64_t k = std::min(n - done, m.size - from);
      run(m, from, k, done);
      done += k;
    }
  }

  std::string path_;
  std::vector<Mapped> shards_;
  int width_ = 2;
  int64_t size_ = 0;
  int vocab_ = 0;
  bool masked_ = false;
};

// A loss mask file (SPLIT-NNNNN.mask beside its token file; little-endian):
//   offset  0  char[8]   magic "LTRNMSK1"
//   offset  8  uint32    format version (1)
//   offset 12  uint32    0
//   offset 16  uint64    token count (the token file's)
//   offset 24  uint8[count] 1: the loss counts predicting this token; 0: it does not
inline constexpr char kMaskMagic[8] = {'L', 'T', 'R', 'N', 'M', 'S', 'K', '1'};
inline constexpr size_t kMaskHeaderBytes = 24;
std::string MaskFileHeader(uint64_t tokens);

// splitmix64: a counter-based mixer, so any sample index is reachable without replaying the ones
// before it (resuming at data position P costs nothing).
uint64_t SplitMix64(uint64_t x);

}  // namespace ltrain
