#include "common/data/token_data.h"

#include "common/data/manifest.h"
#include "common/files.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <utility>

namespace ltrain {
namespace {

std::string ErrnoText() { return std::strerror(errno); }

void AppendLe(std::string& out, uint64_t value, int bytes) {
  for (int i = 0; i < bytes; ++i) out.push_back(static_cast<char>((value >> (8 * i)) & 0xff));
}

uint64_t ReadLe(const unsigned char* p, int bytes) {
  uint64_t value = 0;
  for (int i = 0; i < bytes; ++i) value |= static_cast<uint64_t>(p[i]) << (8 * i);
  return value;
}

Status WriteAll(int fd, const char* data, size_t n, const std::string& path) {
  while (n > 0) {
    ssize_t w = ::write(fd, data, n);
    if (w < 0) {
      if (errno == EINTR) continue;
      return Internal("writing " + path + ": " + ErrnoText());
    }
    data += w;
    n -= static_cast<size_t>(w);
  }
  return Status::Ok();
}

Status FsyncDir(const std::string& dir) {
  int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY);
  if (fd < 0) return Internal("opening directory " + dir + ": " + ErrnoText());
  ::fsync(fd);
  ::close(fd);
  return Status::Ok();
}

}  // namespace

std::string MaskFileHeader(uint64_t tokens) {
  std::string header(kMaskMagic, sizeof(kMaskMagic));
  AppendLe(header, 1, 4);
  AppendLe(header, 0, 4);
  AppendLe(header, tokens, 8);
  return header;
}

std::string TokenFileHeader(uint32_t vocab, uint64_t tokens, uint32_t bytes_per_token) {
  std::string header(kTokenMagic, sizeof(kTokenMagic));
  AppendLe(header, kTokenFormatVersion, 4);
  AppendLe(header, vocab, 4);
  AppendLe(header, tokens, 8);
  AppendLe(header, bytes_per_token, 4);
  return header;
}

namespace {

template <typename T>
Status WriteTokens(const std::string& path, const std::vector<T>& tokens, uint32_t vocab) {
  const std::string header = TokenFileHeader(vocab, tokens.size(), sizeof(T));

  std::string tmp = path + ".tmp." + std::to_string(::getpid());
  ::unlink(tmp.c_str());
  StatusOr<int> opened = OpenForWriting(tmp, O_EXCL, 0644);
  if (!opened.ok()) return InvalidArgument(opened.status().message());
  const int fd = *opened;
  Status s = WriteAll(fd, header.data(), header.size(), tmp);
  if (s.ok()) {
    // Tokens are stored little-endian; this host is little-endian (x86-64, aarch64).
    s = WriteAll(fd, reinterpret_cast<const char*>(tokens.data()), tokens.size() * sizeof(T), tmp);
  }
  if (s.ok() && ::fsync(fd) != 0) s = Internal("fsync " + tmp + ": " + ErrnoText());
  ::close(fd);
  if (s.ok() && ::rename(tmp.c_str(), path.c_str()) != 0) {
    s = Internal("renaming " + tmp + " to " + path + ": " + ErrnoText());
  }
  if (!s.ok()) {
    ::unlink(tmp.c_str());
    return s;
  }
  std::string dir = std::filesystem::path(path).parent_path().string();
  return FsyncDir(dir.empty() ? "." : dir);
}

}  // namespace

Status WriteTokenFile(const std::string& path, const std::vector<uint32_t>& tokens, uint32_t vocab) {
  if (vocab <= 65536) return WriteTokens(path, std::vector<uint16_t>(tokens.begin(), tokens.end()), vocab);
  return WriteTokens(path, tokens, vocab);
}

Status WriteTokenFile(const std::string& path, const std::vector<uint16_t>& tokens, uint32_t vocab) {
  return WriteTokens(path, tokens, vocab);
}

StatusOr<TokenDataset> TokenDataset::Open(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    return NotFound("cannot open token file " + path + ": " + ErrnoText() +
                    " (create it with `ltrain data prepare`)");
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    ::close(fd);
    return Internal("stat " + path + ": " + ErrnoText());
  }
  const size_t file_bytes = static_cast<size_t>(st.st_size);
  if (file_bytes < kTokenHeaderBytes) {
    ::close(fd);
    return DataLoss("token file " + path + " is " + std::to_string(file_bytes) +
                    " bytes, shorter than its " + std::to_string(kTokenHeaderBytes) + "-byte header");
  }
  void* map = ::mmap(nullptr, file_bytes, PROT_READ, MAP_SHARED, fd, 0);
  ::close(fd);
  if (map == MAP_FAILED) return Internal("mmap " + path + ": " + ErrnoText());

  TokenDataset ds;
  ds.path_ = path;
  ds.shards_.push_back(Mapped{map, file_bytes, nullptr, 0, 0});
  const auto* p = static_cast<const unsigned char*>(map);
  if (std::memcmp(p, kTokenMagic, sizeof(kTokenMagic)) != 0) {
    return DataLoss("token file " + path + " has a bad magic (expected LTRNTOK1): not a token file");
  }
  const uint64_t version = ReadLe(p + 8, 4);
  const uint64_t vocab = ReadLe(p + 12, 4);
  const uint64_t count = ReadLe(p + 16, 8);
  const uint64_t bytes_per_token = ReadLe(p + 24, 4);
  if (version != kTokenFormatVersion) {
    return DataLoss("token file " + path + " has format version " + std::to_string(version) +
                    ", this build reads version " + std::to_string(kTokenFormatVersion));
  }
  if (bytes_per_token != 2 && bytes_per_token != 4) {
    return DataLoss("token file " + path + " has " + std::to_string(bytes_per_token) +
                    " bytes per token; 2 (uint16) and 4 (uint32) are supported");
  }
  if (vocab == 0 || (bytes_per_token == 2 && vocab > 65536)) {
    return DataLoss("token file " + path + " has vocab " + std::to_string(vocab) + ", outside [1, " +
                    (bytes_per_token == 2 ? "65536] for uint16 tokens" : "2^32]"));
  }
  const uint64_t expected = kTokenHeaderBytes + count * bytes_per_token;
  if (expected != file_bytes) {
    return DataLoss("token file " + path + " header says " + std::to_string(count) + " tokens (" +
                    std::to_string(expected) + " bytes) but the file is " +
                    std::to_string(file_bytes) + " bytes: truncated or corrupt");
  }
  ds.shards_[0].tokens = p + kTokenHeaderBytes;
  ds.shards_[0].size = static_cast<int64_t>(count);
  ds.width_ = static_cast<int>(bytes_per_token);
  ds.size_ = static_cast<int64_t>(count);
  ds.vocab_ = static_cast<int>(vocab);
  return ds;
}

Status TokenDataset::MapMask(const std::string& path, int64_t tokens, Mapped* m) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return DataLoss("cannot open loss mask " + path + ": " + ErrnoText() + "; prepare the data again");
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    ::close(fd);
    return Internal("stat " + path + ": " + ErrnoText());
  }
  const size_t bytes = static_cast<size_t>(st.st_size);
  if (bytes != kMaskHeaderBytes + static_cast<size_t>(tokens)) {
    ::close(fd);
    return DataLoss("loss mask " + path + " is " + std::to_string(bytes) + " bytes where its shard's " +
                    std::to_string(tokens) + " tokens need " + std::to_string(kMaskHeaderBytes + tokens) +
                    ": truncated or corrupt; prepare the data again");
  }
  void* map = ::mmap(nullptr, bytes, PROT_READ, MAP_SHARED, fd, 0);
  ::close(fd);
  if (map == MAP_FAILED) return Internal("mmap " + path + ": " + ErrnoText());
  const auto* p = static_cast<const unsigned char*>(map);
  if (std::memcmp(p, kMaskMagic, sizeof(kMaskMagic)) != 0 || ReadLe(p + 16, 8) != static_cast<uint64_t>(tokens)) {
    ::munmap(map, bytes);
    return DataLoss("loss mask " + path + " has no LTRNMSK1 header of its shard's token count: prepare the data again");
  }
  m->mask_map = map;
  m->mask_map_bytes = bytes;
  m->mask = p + kMaskHeaderBytes;
  return Status::Ok();
}

StatusOr<TokenDataset> TokenDataset::OpenSplit(const std::string& dir, const std::string& split) {
  StatusOr<DataInfo> info = ReadDataInfo(dir);
  if (!info.ok() && info.status().code() != StatusCode::kNotFound) return info.status();
  if (!info.ok() || info->format < 2) return Open((std::filesystem::path(dir) / (split + ".bin")).string());
  TokenDataset ds;
  ds.path_ = (std::filesystem::path(dir) / (split + "-*.bin")).string();
  ds.vocab_ = info->vocab;
  for (const ShardInfo& shard : info->shards) {
    if (shard.split != split) continue;
    LTRAIN_ASSIGN_OR_RETURN(TokenDataset one, Open((std::filesystem::path(dir) / shard.file).string()));
    if (one.size() != shard.tokens || one.vocab() != info->vocab || (!ds.shards_.empty() && one.width_ != ds.width_)) {
      return DataLoss("token file " + one.path() + " holds " + std::to_string(one.size()) + " tokens of vocab " +
                      std::to_string(one.vocab()) + " where " + dir + "/data.yaml says " +
                      std::to_string(shard.tokens) + " of vocab " + std::to_string(info->vocab) +
                      ": the dataset is damaged; prepare it again");
    }
    ds.width_ = one.width_;
    Mapped m = one.shards_[0];
    one.shards_.clear();  // now ds's
    if (!shard.mask.empty()) {
      const std::string mask_path = (std::filesystem::path(dir) / shard.mask).string();
      Status mapped = MapMask(mask_path, shard.tokens, &m);
      if (!mapped.ok()) {
        ::munmap(m.map, m.map_bytes);
        return mapped;
      }
      ds.masked_ = true;
    }
    m.first = ds.size_;
    ds.size_ += m.size;
    ds.shards_.push_back(m);
  }
  for (const Mapped& m : ds.shards_) {
    if ((m.mask != nullptr) != ds.masked_) {
      return DataLoss(dir + "/data.yaml gives a loss mask to some shards of the " + split +
                      " split and not to others: the dataset is damaged; prepare it again");
    }
  }
  if (ds.shards_.empty()) {
    return NotFound("the dataset in " + dir + " has no " + split + " tokens" +
                    (split == "val" ? " (prepared with --val-fraction 0)" : ""));
  }
  return ds;
}

size_t TokenDataset::ShardOf(int64_t i) const {
  if (shards_.size() == 1) return 0;
  size_t lo = 0, hi = shards_.size();
  while (hi - lo > 1) {
    const size_t mid = (lo + hi) / 2;
    if (shards_[mid].first <= i) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return lo;
}

uint32_t TokenDataset::token(int64_t i) const {
  const Mapped& m = shards_[ShardOf(i)];
  const int64_t k = i - m.first;
  if (width_ == 2) return reinterpret_cast<const uint16_t*>(m.tokens)[k];
  return reinterpret_cast<const uint32_t*>(m.tokens)[k];
}

void TokenDataset::Read(int64_t start, int64_t n, int64_t* out) const {
  ForEachRun(start, n, [&](const Mapped& m, int64_t from, int64_t k, int64_t done) {
    if (width_ == 2) {
      const uint16_t* p = reinterpret_cast<const uint16_t*>(m.tokens) + from;
      for (int64_t t = 0; t < k; ++t) out[done + t] = p[t];
    } else {
      const uint32_t* p = reinterpret_cast<const uint32_t*>(m.tokens) + from;
      for (int64_t t = 0; t < k; ++t) out[done + t] = p[t];
    }
  });
}

void TokenDataset::ReadMask(int64_t start, int64_t n, uint8_t* out) const {
  ForEachRun(start, n, [&](const Mapped& m, int64_t from, int64_t k, int64_t done) {
    if (m.mask != nullptr) {
      std::memcpy(out + done, m.mask + from, static_cast<size_t>(k));
    } else {
      std::memset(out + done, 1, static_cast<size_t>(k));
    }
  });
}

TokenDataset::TokenDataset(TokenDataset&& other) noexcept { *this = std::move(other); }

TokenDataset& TokenDataset::operator=(TokenDataset&& other) noexcept {
  if (this != &other) {
    Release();
    path_ = std::move(other.path_);
    shards_ = std::exchange(other.shards_, {});
    width_ = other.width_;
    size_ = std::exchange(other.size_, 0);
    vocab_ = std::exchange(other.vocab_, 0);
    masked_ = std::exchange(other.masked_, false);
  }
  return *this;
}

TokenDataset::~TokenDataset() { Release(); }

void TokenDataset::Release() {
  for (const Mapped& m : shards_) {
    ::munmap(m.map, m.map_bytes);
    if (m.mask_map != nullptr) ::munmap(m.mask_map, m.mask_map_bytes);
  }
  shards_.clear();
}

uint64_t SplitMix64(uint64_t x) {
  uint64_t z = x + 0x9e3779b97f4a7c15ULL;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

}  // namespace ltrain
