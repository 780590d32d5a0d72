#include "common/data/loader.h"

#include <algorithm>
#include <cstdio>
#include <numeric>
#include <utility>

namespace ltrain {
namespace {

constexpr uint64_t kGolden = 0x9e3779b97f4a7c15ULL;
constexpr int64_t kBlendBlock = 4096;

std::string Thousands(int64_t n) {
  std::string digits = std::to_string(n), out;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return out;
}

}  // namespace

IndexPermutation::IndexPermutation(uint64_t n, uint64_t key) : n_(n) {
  int bits = 2;
  while (bits < 64 && (uint64_t{1} << bits) < n) bits += 2;
  half_bits_ = bits / 2;
  for (int r = 0; r < kRounds; ++r) keys_[r] = SplitMix64(key + static_cast<uint64_t>(r + 1) * kGolden);
}

uint64_t IndexPermutation::operator()(uint64_t i) const {
  if (n_ <= 1) return 0;
  const uint64_t mask = (uint64_t{1} << half_bits_) - 1;
  uint64_t x = i;
  // Cycle-walking: the network permutes [0, 4^h); from an index below n, following it until it
  // lands below n again permutes [0, n). The domain is under 4n, so a few rounds on average.
  do {
    uint64_t left = x >> half_bits_, right = x & mask;
    for (uint64_t key : keys_) {
      const uint64_t mixed = left ^ (SplitMix64(right ^ key) & mask);
      left = right;
      right = mixed;
    }
    x = (left << half_bits_) | right;
  } while (x >= n_);
  return x;
}

SourceBlend::SourceBlend(const std::vector<double>& weights, uint64_t seed)
    : sources_(static_cast<int>(weights.size())), seed_(seed) {
  if (sources_ > 1) Build(weights, 0, sources_);
}

int SourceBlend::Build(const std::vector<double>& weights, int lo, int hi) {
  if (hi - lo < 2) return -1;
  const int mid = (lo + hi) / 2;
  const double left = std::accumulate(weights.begin() + lo, weights.begin() + mid, 0.0);
  const double all = std::accumulate(weights.begin() + lo, weights.begin() + hi, 0.0);
  constexpr double kOne = 4294967296.0;  // 2^32
  const double share = std::clamp(left / all * kOne + 0.5, 1.0, kOne - 1);
  const int index = static_cast<int>(nodes_.size());
  nodes_.push_back(Split{lo, mid, hi, static_cast<uint64_t>(share)});
  const int left_node = Build(weights, lo, mid);
  const int right_node = Build(weights, mid, hi);
  nodes_[index].left_node = left_node;
  nodes_[index].right_node = right_node;
  return index;
}

SourceBlend::Draw SourceBlend::Pick(int64_t i) const {
  if (sources_ <= 1) return Draw{0, i};
  // The order within each block of samples is shuffled, so that no source lines up with a rank or
  // a micro-batch; the counts at each block's end are the tree's.
  const int64_t block = i / kBlendBlock;
  const uint64_t in_block = IndexPermutation(kBlendBlock, SplitMix64(seed_ ^ static_cast<uint64_t>(block)))(
      static_cast<uint64_t>(i % kBlendBlock));
  uint64_t n = static_cast<uint64_t>(block * kBlendBlock) + in_block;
  // At each split, the first n samples that reach it send L(n) = round(n * share) to the left:
  // sample n goes left when L(n + 1) > L(n), as the left side's L(n)-th.
  int node = 0, source = 0;
  while (node >= 0) {
    const Split& split = nodes_[node];
    const auto left_count = [&](uint64_t m) {
      return static_cast<uint64_t>((static_cast<unsigned __int128>(m) * split.left + (uint64_t{1} << 31)) >> 32);
    };
    const uint64_t before = left_count(n);
    if (left_count(n + 1) > before) {
      n = before;
      source = split.lo;
      node = split.left_node;
    } else {
      n -= before;
      source = split.mid;
      node = split.right_node;
    }
  }
  return Draw{source, static_cast<int64_t>(n)};
}

int64_t SampleIndex(const BatchSlice& slice, int j) {
  return slice.position0 + slice.step * slice.global_batch +
         static_cast<int64_t>(slice.micro_step * slice.dp + slice.dp_rank) * slice.micro_batch + j;
}

StatusOr<std::unique_ptr<DataLoader>> DataLoader::Open(const std::vector<DataSource>& sources,
                                                       const std::string& split, int seq_len, Sampling sampling,
                                                       uint64_t seed) {
  if (seq_len < 1) return InvalidArgument("seq_len=" + std::to_string(seq_len) + " must be >= 1");
  if (sources.empty()) return InvalidArgument("no data: set data.path or data.sources");
  if (sampling == Sampling::kTorch && sources.size() > 1) {
    return InvalidArgument("data.sampling torch replays one dataset; a mixture draws by epochs or hash");
  }
  std::unique_ptr<DataLoader> loader(new DataLoader());
  loader->sampling_ = sampling;
  loader->seq_len_ = seq_len;
  for (size_t s = 0; s < sources.size(); ++s) {
    LTRAIN_ASSIGN_OR_RETURN(TokenDataset data, TokenDataset::OpenSplit(sources[s].path, split));
    if (data.size() < seq_len + 2) {
      return InvalidArgument("token file " + data.path() + " has " + std::to_string(data.size()) +
                             " tokens, fewer than seq_len+2=" + std::to_string(seq_len + 2) +
                             "; use more data or a shorter model.seq_len");
    }
    loader->windows_.push_back(sampling == Sampling::kEpochs ? (data.size() - 1) / seq_len
                                                             : data.size() - seq_len - 1);
    loader->paths_.push_back(sources[s].path);
    loader->data_.push_back(std::make_unique<TokenDataset>(std::move(data)));
    loader->weights_.push_back(sources[s].weight);
    // Source 0's seed is the one a single dataset always had: its hash windows stay as they were.
    loader->seeds_.push_back(SplitMix64(seed ^ (static_cast<uint64_t>(s) * 0xd1b54a32d192ed03ULL)));
  }
  loader->blend_.emplace(loader->weights_, SplitMix64(seed ^ 0x6c6f616465720001ULL));
  return loader;
}

WindowRef DataLoader::Locate(int64_t sample_index) const {
  const SourceBlend::Draw draw = blend_->Pick(sample_index);
  WindowRef ref;
  ref.source = draw.source;
  const uint64_t windows = static_cast<uint64_t>(windows_[draw.source]);
  if (stream_ != nullptr) {
    ref.start = stream_->Start(sample_index);
  } else if (sampling_ == Sampling::kEpochs) {
    const uint64_t k = static_cast<uint64_t>(draw.k);
    ref.epoch = static_cast<int64_t>(k / windows);
    const IndexPermutation order(windows, SplitMix64(seeds_[draw.source] ^ SplitMix64(k / windows)));
    ref.start = static_cast<int64_t>(order(k % windows)) * seq_len_;
  } else {
    // Adding i * golden-ratio before mixing walks splitmix64's own stream from the seed's state.
    const uint64_t h = SplitMix64(seeds_[draw.source] + static_cast<uint64_t>(draw.k) * kGolden);
    ref.start = static_cast<int64_t>(h % windows);
  }
  return ref;
}

bool DataLoader::masked() const {
  return std::any_of(data_.begin(), data_.end(), [](const auto& d) { return d->masked(); });
}

void DataLoader::Fill(const BatchSlice& slice, int64_t* inputs, int64_t* targets) const {
  std::vector<int64_t> window(static_cast<size_t>(seq_len_) + 1);
  std::vector<uint8_t> mask(static_cast<size_t>(seq_len_));
  for (int j = 0; j < slice.micro_batch; ++j) {
    const WindowRef ref = Locate(SampleIndex(slice, j));
    const TokenDataset& data = *data_[ref.source];
    data.Read(ref.start, seq_len_ + 1, window.data());
    int64_t* in = inputs + static_cast<int64_t>(j) * seq_len_;
    int64_t* tg = targets + static_cast<int64_t>(j) * seq_len_;
    std::copy(window.begin(), window.end() - 1, in);
    std::copy(window.begin() + 1, window.end(), tg);
    if (data.masked()) {
      data.ReadMask(ref.start + 1, seq_len_, mask.data());
      for (int t = 0; t < seq_len_; ++t) {
        if (mask[t] == 0) tg[t] = kIgnoredTarget;
      }
    }
  }
}

std::string DataLoader::Describe() const {
  const double total = std::accumulate(weights_.begin(), weights_.end(), 0.0);
  std::string out = data_.size() == 1 ? "" : std::to_string(data_.size()) + " sources: ";
  for (size_t s = 0; s < data_.size(); ++s) {
    if (s > 0) out += ", ";
    char share[32];
    std::snprintf(share, sizeof(share), "%.3g", weights_[s] / total);
    out += paths_[s] + " (";
    if (data_.size() > 1) out += std::string("share ") + share + ", ";
    out += Thousands(data_[s]->size()) + " tokens, " + Thousands(windows_[s]) +
           (sampling_ == Sampling::kEpochs ? " windows an epoch" : " window starts") +
           (data_[s]->masked() ? ", loss mask" : "") + ")";
  }
  return out;
}

BatchPrefetcher::BatchPrefetcher(Maker make, int64_t stride)
    : make_(std::move(make)), stride_(stride), thread_([this] { Run(); }) {}

BatchPrefetcher::~BatchPrefetcher() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

const BatchPrefetcher::Batches& BatchPrefetcher::Get(int64_t step) {
  std::unique_lock<std::mutex> lock(mu_);
  if (current_step_ == step) return current_;
  // The thread was asked for this step: wait for its answer rather than make it twice.
  if (wanted_ == step) cv_.wait(lock, [&] { return served_ == requests_; });
  if (ready_ && ahead_step_ == step) {
    std::swap(current_, ahead_);
  } else {
    lock.unlock();
    {
      std::lock_guard<std::mutex> making(make_mu_);
      make_(step, &current_);
    }
    lock.lock();
  }
  current_step_ = step;
  ready_ = false;
  wanted_ = step + stride_;
  ++requests_;
  cv_.notify_all();
  return current_;
}

void BatchPrefetcher::Run() {
  Batches made;
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    cv_.wait(lock, [&] { return stop_ || served_ != requests_; });
    if (stop_) return;
    const uint64_t request = requests_;
    const int64_t step = wanted_;
    lock.unlock();
    {
      std::lock_guard<std::mutex> making(make_mu_);
      make_(step, &made);
    }
    lock.lock();
    if (request == requests_) {
      std::swap(ahead_, made);
      ahead_step_ = step;
      ready_ = true;
    }
    served_ = request;
    cv_.notify_all();
  }
}

}  // namespace ltrain
