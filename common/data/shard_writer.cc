#include "common/data/shard_writer.h"

#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <utility>

#include "common/data/token_data.h"
#include "common/files.h"

namespace ltrain {
namespace {

std::string ErrnoText() { return std::strerror(errno); }

}  // namespace

ShardWriter::ShardWriter(std::string dir, std::string split, int64_t shard_bytes, uint32_t vocab, bool masked)
    : dir_(std::move(dir)), split_(std::move(split)), vocab_(vocab), width_(vocab <= 65536 ? 2 : 4), masked_(masked) {
  shard_tokens_ = std::max<int64_t>(1, shard_bytes / width_);
}

ShardWriter::~ShardWriter() {
  if (file_ != nullptr) std::fclose(file_);
  if (index_file_ != nullptr) std::fclose(index_file_);
  if (mask_file_ != nullptr) std::fclose(mask_file_);
}

Status ShardWriter::OpenShard() {
  char name[64];
  std::snprintf(name, sizeof(name), "%s-%05zu", split_.c_str(), shards_.size());
  open_ = ShardInfo{};
  open_.file = std::string(name) + ".bin";
  open_.index = std::string(name) + ".idx";
  open_.split = split_;
  open_.first_input = -1;
  path_ = (std::filesystem::path(dir_) / open_.file).string();
  index_path_ = (std::filesystem::path(dir_) / open_.index).string();
  LTRAIN_ASSIGN_OR_RETURN(file_, OpenStreamForWriting(path_, /*append=*/false, 0644));
  std::setvbuf(file_, nullptr, _IOFBF, size_t{1} << 20);
  LTRAIN_ASSIGN_OR_RETURN(index_file_, OpenStreamForWriting(index_path_, /*append=*/false, 0644));
  std::setvbuf(index_file_, nullptr, _IOFBF, size_t{1} << 16);
  const std::string header = TokenFileHeader(vocab_, 0, static_cast<uint32_t>(width_));
  const std::string index_header = DocumentIndexHeader(false, 0);
  if (std::fwrite(header.data(), 1, header.size(), file_) != header.size() ||
      std::fwrite(index_header.data(), 1, index_header.size(), index_file_) != index_header.size()) {
    return Internal(WithFreeSpace("writing " + path_ + ": " + ErrnoText(), dir_));
  }
  if (masked_) {
    open_.mask = std::string(name) + ".mask";
    mask_path_ = (std::filesystem::path(dir_) / open_.mask).string();
    LTRAIN_ASSIGN_OR_RETURN(mask_file_, OpenStreamForWriting(mask_path_, /*append=*/false, 0644));
    std::setvbuf(mask_file_, nullptr, _IOFBF, size_t{1} << 20);
    const std::string mask_header = MaskFileHeader(0);
    if (std::fwrite(mask_header.data(), 1, mask_header.size(), mask_file_) != mask_header.size()) {
      return Internal(WithFreeSpace("writing " + mask_path_ + ": " + ErrnoText(), dir_));
    }
  }
  hash_.emplace();
  return Status::Ok();
}

Status ShardWriter::CloseShard() {
  if (file_ == nullptr) return Status::Ok();
  // Each file's header gets its count, now known, over the zero written at the start.
  auto finish = [this](std::FILE* f, const std::string& header, const std::string& path) -> Status {
    bool ok = std::fflush(f) == 0;
    ok = ok && ::pwrite(fileno(f), header.data(), header.size(), 0) == static_cast<ssize_t>(header.size());
    ok = ok && ::fsync(fileno(f)) == 0;
    const std::string why = ErrnoText();
    ok = std::fclose(f) == 0 && ok;
    if (!ok) return Internal(WithFreeSpace("writing " + path + ": " + why, dir_));
    return Status::Ok();
  };
  std::FILE* tokens = std::exchange(file_, nullptr);
  std::FILE* index = std::exchange(index_file_, nullptr);
  Status s = finish(tokens, TokenFileHeader(vocab_, static_cast<uint64_t>(open_.tokens), static_cast<uint32_t>(width_)),
                    path_);
  Status t = finish(index, DocumentIndexHeader(continues_, static_cast<uint64_t>(open_.documents)), index_path_);
  LTRAIN_RETURN_IF_ERROR(s);
  LTRAIN_RETURN_IF_ERROR(t);
  if (std::FILE* mask = std::exchange(mask_file_, nullptr)) {
    LTRAIN_RETURN_IF_ERROR(finish(mask, MaskFileHeader(static_cast<uint64_t>(open_.tokens)), mask_path_));
  }
  open_.xxh3 = hash_->Hex();
  if (open_.first_input < 0) open_.first_input = 0;
  shards_.push_back(open_);
  return Status::Ok();
}

Status ShardWriter::Append(const std::vector<uint32_t>& ids, bool starts, int input,
                           const std::vector<uint8_t>* mask) {
  if (masked_ != (mask != nullptr) || (mask != nullptr && mask->size() != ids.size())) {
    return Internal("shard writer of " + split_ + ": a loss mask must come with every piece of SFT data, one byte a token");
  }
  if (file_ != nullptr && open_.tokens >= shard_tokens_) LTRAIN_RETURN_IF_ERROR(CloseShard());
  if (file_ == nullptr) {
    LTRAIN_RETURN_IF_ERROR(OpenShard());
    continues_ = !starts && in_document_;
  }
  if (starts) {
    char start[8];
    const uint64_t at = static_cast<uint64_t>(open_.tokens);
    for (int i = 0; i < 8; ++i) start[i] = static_cast<char>((at >> (8 * i)) & 0xff);
    if (std::fwrite(start, 1, sizeof(start), index_file_) != sizeof(start)) {
      return Internal(WithFreeSpace("writing " + index_path_ + ": " + ErrnoText(), dir_));
    }
    ++open_.documents;
    ++documents_;
  }
  if (open_.first_input < 0) open_.first_input = input;
  open_.last_input = input;
  const void* data = ids.data();
  size_t bytes = ids.size() * sizeof(uint32_t);
  if (width_ == 2) {
    narrow_.assign(ids.begin(), ids.end());
    data = narrow_.data();
    bytes = narrow_.size() * sizeof(uint16_t);
  }
  // Tokens are stored little-endian; this host is little-endian (x86-64, aarch64).
  if (bytes > 0 && std::fwrite(data, 1, bytes, file_) != bytes) {
    return Internal(WithFreeSpace("writing " + path_ + ": " + ErrnoText(), dir_));
  }
  if (mask != nullptr && !mask->empty() && std::fwrite(mask->data(), 1, mask->size(), mask_file_) != mask->size()) {
    return Internal(WithFreeSpace("writing " + mask_path_ + ": " + ErrnoText(), dir_));
  }
  hash_->Update(data, bytes);
  open_.tokens += static_cast<int64_t>(ids.size());
  tokens_ += static_cast<int64_t>(ids.size());
  in_document_ = true;
  return Status::Ok();
}

Status ShardWriter::Finish() { return CloseShard(); }

}  // namespace ltrain
