// The training loader: which window of which prepared dataset each sample reads, and the batches of
// token ids (and, for supervised fine-tuning data, which targets count) that a rank trains on.
//
// Every choice is a pure function of the sample's index (its "data position"): sample i goes to one
// source of the mixture (SourceBlend) as that source's k-th draw, and draw k is a window of the
// source (a seeded permutation per epoch, or a hash). A checkpoint that keeps the data position
// keeps the loader's whole state: a resumed run, at any data-parallel size, reads the windows an
// uninterrupted run would have read, in the same order. No LibTorch here.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "common/data/token_data.h"
#include "common/recipe.h"
#include "common/status.h"

namespace ltrain {

// A target the loss skips: a prompt token of supervised fine-tuning data (PyTorch's ignore_index).
inline constexpr int64_t kIgnoredTarget = -100;

// A seeded permutation of [0, n), one index at a time (a Feistel network over the next power of
// four, walked until it lands below n): no table, any index in constant time.
class IndexPermutation {
 public:
  IndexPermutation(uint64_t n, uint64_t key);
  uint64_t operator()(uint64_t i) const;

 private:
  static constexpr int kRounds = 4;
  uint64_t n_;
  int half_bits_ = 1;
  uint64_t keys_[kRounds];
};

// Sources drawn by weight. Pick(i) names the source of sample i and which of that source's draws
// it is (k): the first N samples give source s round(N * w_s / sum w) draws, to within one per
// level of a binary tree over the sources, in an order shuffled within blocks of 4,096 samples.
class SourceBlend {
 public:
  SourceBlend(const std::vector<double>& weights, uint64_t seed);
  struct Draw {
    int source = 0;
    int64_t k = 0;
  };
  Draw Pick(int64_t i) const;
  int sources() const { return sources_; }

 private:
  struct Split {
    int lo, mid, hi;
    uint64_t left;  // the left side's share of the weight, in units of 2^-32
    int left_node = -1, right_node = -1;
  };
  int Build(const std::vector<double>& weights, int lo, int hi);

  int sources_;
  uint64_t seed_;
  std::vector<Split> nodes_;
};

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

// One sample's window: seq_len + 1 tokens of a source from `start`.
struct WindowRef {
  int source = 0;
  int64_t start = 0;
  int64_t epoch = 0;  // of its source (sampling epochs; 0 otherwise)
};

class DataLoader {
 public:
  // The split ("train" or "val") of every source.
  static StatusOr<std::unique_ptr<DataLoader>> Open(const std::vector<DataSource>& sources, const std::string& split,
                                                    int seq_len, Sampling sampling, uint64_t seed);
  // Window starts from `stream` in place of the sampling (data.sampling torch; one source only).
  void SetStream(std::unique_ptr<WindowStream> stream) { stream_ = std::move(stream); }

  // Sample i's window. With a stream, one thread at a time.
  WindowRef Locate(int64_t sample_index) const;

  // micro_batch * seq_len inputs and targets (inputs shifted by one token); a target the source's
  // loss mask leaves out is kIgnoredTarget.
  void Fill(const BatchSlice& slice, int64_t* inputs, int64_t* targets) const;

  int sources() const { return static_cast<int>(data_.size()); }
  const TokenDataset& data(int source) const { return *data_[source]; }
  const std::string& path(int source) const { return paths_[source]; }
  // Windows an epoch of the source has (sampling epochs), or distinct window starts (hash, torch).
  int64_t windows(int source) const { return windows_[source]; }
  bool masked() const;
  int seq_len() const { return seq_len_; }
  // "3 sources: web (weight 0.7, 1,234 windows), ..." for the worker's start-up line.
  std::string Describe() const;

 private:
  DataLoader() = default;

  std::vector<std::string> paths_;
  std::vector<std::unique_ptr<TokenDataset>> data_;
  std::vector<int64_t> windows_;
  std::vector<uint64_t> seeds_;  // per source
  std::vector<double> weights_;
  std::optional<SourceBlend> blend_;
  Sampling sampling_ = Sampling::kEpochs;
  int seq_len_ = 1;
  std::unique_ptr<WindowStream> stream_;
};

// Host batches made ahead on a thread of their own: while the model trains on one step, the next
// step's batches are read. Steps are named by their data position; make(position, out) fills one
// step's batches, on the thread (and, for a step not made ahead, on the caller's).
class BatchPrefetcher {
 public:
  struct Batches {
    std::vector<int64_t> inputs, targets;  // every micro-step of the step, one after another
  };
  using Maker = std::function<void(int64_t position, Batches* out)>;

  // `stride`: the samples of one step (the global batch); the step after `position` is at
  // position + stride.
  BatchPrefetcher(Maker make, int64_t stride);
  ~BatchPrefetcher();
  BatchPrefetcher(const BatchPrefetcher&) = delete;
  BatchPrefetcher& operator=(const BatchPrefetcher&) = delete;

  // The batches of the step at `position` (valid until the next Get of another position), and
  // the next step's begun behind them.
  const Batches& Get(int64_t position);

 private:
  void Run();

  Maker make_;
  int64_t stride_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::mutex make_mu_;  // one Make at a time (a torch stream draws in order)
  Batches current_, ahead_;
  int64_t current_step_ = -1;  // the position current_ holds
  int64_t ahead_step_ = -1;   // the step ahead_ holds, once ready_
  int64_t wanted_ = -1;       // the step the thread was last asked to make
  uint64_t requests_ = 0;     // asks made, and answered (the thread is idle when they are equal)
  uint64_t served_ = 0;
  bool ready_ = false, stop_ = false;
  std::thread thread_;
};

}  // namespace ltrain
