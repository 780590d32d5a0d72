// Token data: the on-disk format that `ltrain data prepare` writes and the worker reads, and the
// deterministic sampler that maps a global sample counter (the "data position") to token windows.
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

 private:
  struct Mapped {
    void* map = nullptr;
    size_t map_bytes = 0;
    const unsigned char* tokens = nullptr;
    int64_t first = 0;  // index of its first token in the split
    int64_t size = 0;
  };
  TokenDataset() = default;
  void Release();
  size_t ShardOf(int64_t i) const;

  std::string path_;
  std::vector<Mapped> shards_;
  int width_ = 2;
  int64_t size_ = 0;
  int vocab_ = 0;
};

// splitmix64: a counter-based mixer, so any sample index is reachable without replaying the ones
// before it (resuming at data position P costs nothing).
uint64_t SplitMix64(uint64_t x);

// Where one micro-batch sits in the global batch of one optimizer step.
struct BatchSlice {
  int64_t position0 = 0;   // data position (sample index) at optimizer step 0 of this count
  int64_t step = 0;        // optimizer step, 0-based, counted from position0
  int global_batch = 1;    // G: sequences per optimizer step across all data-parallel ranks
  int dp_rank = 0;
  int dp = 1;
  int micro_step = 0;      // a in [0, A)
  int micro_batch = 1;     // b
};

// Sample index of sequence j of the slice: position0 + step*G + (a*dp + r)*b + j. Ranks get disjoint
// indices, and dp ranks x A micro-steps cover [position0 + step*G, position0 + (step+1)*G) whatever
// the layout.
int64_t SampleIndex(const BatchSlice& slice, int j);

// Window starts drawn one after another from a generator that cannot jump ahead: Start(i) is the
// start of sample index i, the i-th draw. Asked in increasing order it draws each value once; asking
// for an earlier index starts the stream over.
class WindowStream {
 public:
  virtual ~WindowStream() = default;
  virtual int64_t Start(int64_t sample_index) = 0;
};

// Deterministic map from sample index to token window: hashed (below) or, given a stream, the
// stream's draws. With a stream, WindowStart and Fill advance it: one thread at a time.
class TokenSampler {
 public:
  TokenSampler(const TokenDataset* dataset, uint64_t seed, int seq_len, std::unique_ptr<WindowStream> stream = nullptr);

  // The number of distinct window starts: size - seq_len - 1.
  int64_t span() const;

  // Fails when the dataset is too short for one window of seq_len + 1 tokens.
  Status Check() const;

  // hash(seed, i) % span(), or the stream's start for i.
  int64_t WindowStart(int64_t sample_index) const;

  // Fills micro_batch * seq_len int64 inputs and targets (targets = inputs shifted by one token).
  void Fill(const BatchSlice& slice, int64_t* inputs, int64_t* targets) const;

  int seq_len() const { return seq_len_; }

 private:
  const TokenDataset* dataset_;
  uint64_t seed_mix_;
  int seq_len_;
  std::unique_ptr<WindowStream> stream_;
};

}  // namespace ltrain
