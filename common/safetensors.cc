#include "common/safetensors.h"

#include "common/files.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <set>

#include <xxhash.h>
#include <yaml-cpp/yaml.h>

namespace ltrain {
namespace {

constexpr uint64_t kMaxHeaderBytes = 100ull << 20;  // the reference implementation's limit
constexpr size_t kSmallWrite = 1 << 20;             // pieces below this are coalesced
constexpr uint64_t kReadChunk = 64ull << 20;        // one read call, and one progress report
constexpr uint64_t kStagingBytes = 4ull << 20;      // small tensors are read through this
constexpr uint64_t kWritebackEvery = 32ull << 20;   // bytes written between writeback hints
constexpr uint64_t kCachedWindow = 512ull << 20;    // written bytes a writer may keep in the page cache

std::string Errno() { return std::strerror(errno); }

void AppendJsonString(std::string& out, const std::string& s) {
  out.push_back('"');
  for (const char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\t': out += "\\t"; break;
      case '\r': out += "\\r"; break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          char esc[8];
          std::snprintf(esc, sizeof(esc), "\\u%04x", static_cast<unsigned>(static_cast<unsigned char>(c)));
          out += esc;
        } else {
          out.push_back(c);
        }
    }
  }
  out.push_back('"');
}

std::string Hex64(uint64_t h) {
  char hex[17];
  std::snprintf(hex, sizeof(hex), "%016llx", static_cast<unsigned long long>(h));
  return hex;
}

}  // namespace

int SafetensorsDtypeSize(const std::string& dtype) {
  if (dtype == "F32" || dtype == "I32") return 4;
  if (dtype == "BF16" || dtype == "F16" || dtype == "I16") return 2;
  if (dtype == "I64" || dtype == "F64") return 8;
  if (dtype == "U8" || dtype == "I8" || dtype == "BOOL") return 1;
  return 0;
}

Xxh3::Xxh3() : state_(XXH3_createState()) { XXH3_64bits_reset(state_); }
Xxh3::~Xxh3() { XXH3_freeState(state_); }
void Xxh3::Update(const void* data, size_t n) { XXH3_64bits_update(state_, data, n); }
std::string Xxh3::Hex() const { return Hex64(XXH3_64bits_digest(state_)); }

StatusOr<FileDigest> HashFile(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return NotFound("cannot read " + path + ": " + Errno());
  ::posix_fadvise(fd, 0, 0, POSIX_FADV_SEQUENTIAL);
  std::vector<char> buffer(16 << 20);
  Xxh3 hash;
  FileDigest digest;
  while (true) {
    const ssize_t n = ::read(fd, buffer.data(), buffer.size());
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const std::string why = Errno();
      ::close(fd);
      return Internal("reading " + path + ": " + why);
    }
    if (n == 0) break;
    hash.Update(buffer.data(), static_cast<size_t>(n));
    digest.bytes += static_cast<uint64_t>(n);
  }
  ::close(fd);
  digest.xxh3 = hash.Hex();
  return digest;
}

// --- writer ---

SafetensorsWriter::SafetensorsWriter(std::string path, int fd, std::vector<SafetensorsEntry> tensors)
    : path_(std::move(path)), fd_(fd), tensors_(std::move(tensors)) {}

SafetensorsWriter::~SafetensorsWriter() {
  if (fd_ >= 0) ::close(fd_);
}

StatusOr<std::unique_ptr<SafetensorsWriter>> SafetensorsWriter::Create(const std::string& path,
                                                                       std::vector<SafetensorsEntry> tensors,
                                                                       const std::map<std::string, std::string>& metadata) {
  std::string json = "{";
  if (!metadata.empty()) {
    json += "\"__metadata__\":{";
    bool first = true;
    for (const auto& [key, value] : metadata) {
      if (!first) json.push_back(',');
      first = false;
      AppendJsonString(json, key);
      json.push_back(':');
      AppendJsonString(json, value);
    }
    json += "}";
  }
  std::set<std::string> names;
  uint64_t at = 0;
  for (SafetensorsEntry& t : tensors) {
    const int size = SafetensorsDtypeSize(t.dtype);
    if (size == 0) return InvalidArgument(path + ": tensor " + t.name + " has unknown dtype " + t.dtype);
    if (t.name.empty() || t.name == "__metadata__" || !names.insert(t.name).second) {
      return InvalidArgument(path + ": tensor name '" + t.name + "' is empty, reserved or repeated");
    }
    uint64_t numel = 1;
    for (const int64_t d : t.shape) {
      if (d < 0) return InvalidArgument(path + ": tensor " + t.name + " has a negative dimension");
      numel *= static_cast<uint64_t>(d);
    }
    if (numel * static_cast<uint64_t>(size) != t.bytes) {
      return InvalidArgument(path + ": tensor " + t.name + " declares " + std::to_string(t.bytes) +
                             " bytes, its dtype and shape need " + std::to_string(numel * size));
    }
    t.begin = at;
    t.end = at + t.bytes;
    at = t.end;
    if (json.size() > 1) json.push_back(',');
    AppendJsonString(json, t.name);
    json += ":{\"dtype\":";
    AppendJsonString(json, t.dtype);
    json += ",\"shape\":[";
    for (size_t i = 0; i < t.shape.size(); ++i) json += (i ? "," : "") + std::to_string(t.shape[i]);
    json += "],\"data_offsets\":[" + std::to_string(t.begin) + "," + std::to_string(t.end) + "]}";
  }
  json += "}";
  // The data section starts 8-byte aligned.
  while ((8 + json.size()) % 8 != 0) json.push_back(' ');

  LTRAIN_ASSIGN_OR_RETURN(const int fd, OpenForWriting(path, O_TRUNC, 0644));
  std::unique_ptr<SafetensorsWriter> writer(new SafetensorsWriter(path, fd, std::move(tensors)));
  writer->data_bytes_ = at;
  uint64_t n = json.size();
  unsigned char length[8];
  for (int i = 0; i < 8; ++i) length[i] = static_cast<unsigned char>(n >> (8 * i));
  writer->header_bytes_ = 8 + n;
  writer->buffer_.reserve(kSmallWrite * 2);
  writer->buffer_.append(reinterpret_cast<const char*>(length), 8);
  writer->buffer_ += json;
  writer->hash_.Update(writer->buffer_.data(), writer->buffer_.size());
  return writer;
}

Status SafetensorsWriter::WriteFully(const void* data, size_t n) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t w = ::write(fd_, p, n);
    if (w < 0 && errno == EINTR) continue;
    if (w < 0) return Internal("writing " + path_ + ": " + Errno());
    p += w;
    n -= static_cast<size_t>(w);
    on_disk_ += static_cast<uint64_t>(w);
  }
  // Starts the writeback of what was written so far without waiting for it, so that the disk works
  // while the next bytes are written and the final fsync has little left to wait for. Only a hint:
  // a filesystem that does not support it gets the fsync alone.
  if (on_disk_ - writeback_from_ >= kWritebackEvery) {
    (void)::sync_file_range(fd_, static_cast<off_t>(writeback_from_), static_cast<off_t>(on_disk_ - writeback_from_),
                            SYNC_FILE_RANGE_WRITE);
    writeback_from_ = on_disk_;
  }
  // What was written more than kCachedWindow ago: waits until it is on the disk and drops it from
  // the page cache. A checkpoint is read back only after a restart, and tens of gigabytes of it kept
  // in the cache would push out what training reads (its data) and make the next save's writes
  // reclaim memory first; the writer stays at most the window ahead of the disk.
  if (writeback_from_ >= dropped_to_ + kCachedWindow + kWritebackEvery) {
    const uint64_t upto = writeback_from_ - kCachedWindow;
    const auto offset = static_cast<off_t>(dropped_to_), length = static_cast<off_t>(upto - dropped_to_);
    if (::sync_file_range(fd_, offset, length,
                          SYNC_FILE_RANGE_WAIT_BEFORE | SYNC_FILE_RANGE_WRITE | SYNC_FILE_RANGE_WAIT_AFTER) == 0) {
      (void)::posix_fadvise(fd_, offset, length, POSIX_FADV_DONTNEED);
    }
    dropped_to_ = upto;
  }
  return Status::Ok();
}

Status SafetensorsWriter::Flush() {
  if (buffer_.empty()) return Status::Ok();
  Status s = WriteFully(buffer_.data(), buffer_.size());
  buffer_.clear();
  return s;
}

Status SafetensorsWriter::Write(const void* data, size_t n) {
  if (fd_ < 0) return Internal("writing " + path_ + ": the file is closed");
  if (written_ + n > data_bytes_) {
    return Internal("writing " + path_ + ": " + std::to_string(written_ + n) + " data bytes, more than the " +
                    std::to_string(data_bytes_) + " its header declares");
  }
  hash_.Update(data, n);
  written_ += n;
  if (n < kSmallWrite) {
    buffer_.append(static_cast<const char*>(data), n);
    return buffer_.size() >= kSmallWrite ? Flush() : Status::Ok();
  }
  LTRAIN_RETURN_IF_ERROR(Flush());
  return WriteFully(data, n);
}

StatusOr<FileDigest> SafetensorsWriter::Finish() {
  if (fd_ < 0) return Internal("writing " + path_ + ": the file is closed");
  if (written_ != data_bytes_) {
    return Internal("writing " + path_ + ": " + std::to_string(written_) + " of " + std::to_string(data_bytes_) +
                    " data bytes written");
  }
  LTRAIN_RETURN_IF_ERROR(Flush());
  const int rc = ::fsync(fd_);
  const std::string why = Errno();
  if (rc == 0) (void)::posix_fadvise(fd_, static_cast<off_t>(dropped_to_), 0, POSIX_FADV_DONTNEED);
  ::close(fd_);
  fd_ = -1;
  if (rc != 0) return Internal("fsync " + path_ + ": " + why);
  return FileDigest{file_bytes(), hash_.Hex()};
}

void SafetensorsWriter::Abandon() {
  if (fd_ < 0) return;
  (void)Flush();
  (void)::fsync(fd_);
  ::close(fd_);
  fd_ = -1;
}

// --- reader ---

StatusOr<std::vector<SafetensorsEntry>> ParseSafetensorsHeader(const std::string& json, uint64_t data_bytes,
                                                               std::map<std::string, std::string>* metadata) {
  YAML::Node root;
  try {
    root = YAML::Load(json);
  } catch (const std::exception& e) {
    return DataLoss(std::string("the header is not JSON: ") + e.what());
  }
  if (!root.IsMap()) return DataLoss("the header is not a JSON object");
  std::vector<SafetensorsEntry> tensors;
  try {
    for (const auto& item : root) {
      const std::string name = item.first.as<std::string>();
      const YAML::Node& value = item.second;
      if (name == "__metadata__") {
        if (!value.IsMap()) return DataLoss("__metadata__ is not an object");
        for (const auto& m : value) {
          if (metadata != nullptr) (*metadata)[m.first.as<std::string>()] = m.second.as<std::string>();
        }
        continue;
      }
      if (!value.IsMap() || !value["dtype"] || !value["shape"] || !value["data_offsets"] ||
          !value["shape"].IsSequence() || !value["data_offsets"].IsSequence() || value["data_offsets"].size() != 2) {
        return DataLoss("tensor " + name + " needs dtype, shape and data_offsets [begin, end]");
      }
      SafetensorsEntry t;
      t.name = name;
      t.dtype = value["dtype"].as<std::string>();
      const int size = SafetensorsDtypeSize(t.dtype);
      if (size == 0) return DataLoss("tensor " + name + " has unknown dtype " + t.dtype);
      uint64_t numel = 1;
      for (const auto& d : value["shape"]) {
        const int64_t dim = d.as<int64_t>();
        if (dim < 0) return DataLoss("tensor " + name + " has a negative dimension");
        t.shape.push_back(dim);
        numel *= static_cast<uint64_t>(dim);
      }
      t.begin = value["data_offsets"][0].as<uint64_t>();
      t.end = value["data_offsets"][1].as<uint64_t>();
      t.bytes = numel * static_cast<uint64_t>(size);
      if (t.end < t.begin || t.end - t.begin != t.bytes) {
        return DataLoss("tensor " + name + ": data_offsets [" + std::to_string(t.begin) + ", " + std::to_string(t.end) +
                        "] hold " + std::to_string(t.end >= t.begin ? t.end - t.begin : 0) +
                        " bytes, its dtype and shape need " + std::to_string(t.bytes));
      }
      tensors.push_back(std::move(t));
    }
  } catch (const std::exception& e) {
    return DataLoss(std::string("the header is malformed: ") + e.what());
  }
  std::sort(tensors.begin(), tensors.end(), [](const SafetensorsEntry& a, const SafetensorsEntry& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  uint64_t at = 0;
  for (const SafetensorsEntry& t : tensors) {
    if (t.begin != at) {
      return DataLoss("tensor " + t.name + " starts at byte " + std::to_string(t.begin) + " of the data, expected " +
                      std::to_string(at) + " (tensors must be contiguous, without overlaps)");
    }
    at = t.end;
  }
  if (at != data_bytes) {
    return DataLoss("the tensors hold " + std::to_string(at) + " bytes but the file has " + std::to_string(data_bytes) +
                    " after its header");
  }
  return tensors;
}

SafetensorsFile::~SafetensorsFile() {
  if (fd_ >= 0) ::close(fd_);
}

Status SafetensorsFile::ReadAt(uint64_t offset, void* into, uint64_t n) const {
  char* p = static_cast<char*>(into);
  while (n > 0) {
    const ssize_t r = ::pread(fd_, p, n, static_cast<off_t>(offset));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) return Internal("reading " + path_ + ": " + Errno());
    if (r == 0) return DataLoss(path_ + " ends early, at byte " + std::to_string(offset));
    p += r;
    offset += static_cast<uint64_t>(r);
    n -= static_cast<uint64_t>(r);
  }
  return Status::Ok();
}

StatusOr<std::unique_ptr<SafetensorsFile>> SafetensorsFile::Open(const std::string& path) {
  std::unique_ptr<SafetensorsFile> file(new SafetensorsFile());
  file->path_ = path;
  file->fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (file->fd_ < 0) return NotFound("cannot read " + path + ": " + Errno());
  struct stat st {};
  if (::fstat(file->fd_, &st) != 0) return Internal("stat " + path + ": " + Errno());
  file->file_bytes_ = static_cast<uint64_t>(st.st_size);
  if (file->file_bytes_ < 8) return DataLoss(path + " is not a safetensors file (" + std::to_string(st.st_size) + " bytes)");
  unsigned char length[8];
  LTRAIN_RETURN_IF_ERROR(file->ReadAt(0, length, 8));
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | length[i];
  if (n > kMaxHeaderBytes || 8 + n > file->file_bytes_) {
    return DataLoss(path + " is not a safetensors file (its header length " + std::to_string(n) + " does not fit its " +
                    std::to_string(file->file_bytes_) + " bytes)");
  }
  file->head_.resize(8 + n);
  std::memcpy(file->head_.data(), length, 8);
  LTRAIN_RETURN_IF_ERROR(file->ReadAt(8, file->head_.data() + 8, n));
  StatusOr<std::vector<SafetensorsEntry>> tensors =
      ParseSafetensorsHeader(file->head_.substr(8), file->file_bytes_ - 8 - n, &file->metadata_);
  if (!tensors.ok()) return DataLoss(path + ": " + tensors.status().message());
  file->tensors_ = std::move(tensors).value();
  for (size_t i = 0; i < file->tensors_.size(); ++i) file->index_[file->tensors_[i].name] = i;
  return file;
}

const SafetensorsEntry* SafetensorsFile::Find(const std::string& name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

Status SafetensorsFile::Read(const SafetensorsEntry& entry, void* into) const {
  return ReadAt(head_.size() + entry.begin, into, entry.bytes);
}

StatusOr<FileDigest> SafetensorsFile::ReadAll(const std::function<void*(const SafetensorsEntry&)>& destination,
                                              const std::function<void(uint64_t)>& progress,
                                              const std::function<void(const SafetensorsEntry&)>& done) const {
  ::posix_fadvise(fd_, 0, 0, POSIX_FADV_SEQUENTIAL);
  Xxh3 hash;
  hash.Update(head_.data(), head_.size());
  const uint64_t base = head_.size();
  const uint64_t data_bytes = file_bytes_ - base;
  // Data offsets [stage_begin, stage_end) are in `staging`, already hashed; everything before
  // stage_end is hashed.
  std::vector<char> staging;
  uint64_t stage_begin = 0, stage_end = 0;
  uint64_t reported = 0;
  auto report = [&](uint64_t done) {
    if (progress && (done - reported >= kReadChunk || done == data_bytes)) {
      reported = done;
      progress(base + done);
    }
  };
  for (const SafetensorsEntry& t : tensors_) {
    char* out = static_cast<char*>(destination ? destination(t) : nullptr);
    uint64_t at = t.begin;
    while (at < t.end) {
      if (at >= stage_begin && at < stage_end) {
        const uint64_t n = std::min(t.end, stage_end) - at;
        if (out != nullptr) std::memcpy(out + (at - t.begin), staging.data() + (at - stage_begin), n);
        at += n;
        continue;
      }
      // at == stage_end: everything before is consumed.
      const uint64_t left = t.end - at;
      if (out != nullptr && left >= kSmallWrite) {
        const uint64_t n = std::min(left, kReadChunk);
        LTRAIN_RETURN_IF_ERROR(ReadAt(base + at, out + (at - t.begin), n));
        hash.Update(out + (at - t.begin), n);
        at += n;
        stage_begin = stage_end = at;
      } else {
        const uint64_t n = std::min(data_bytes - at, std::max<uint64_t>(kStagingBytes, std::min(left, kReadChunk)));
        staging.resize(n);
        LTRAIN_RETURN_IF_ERROR(ReadAt(base + at, staging.data(), n));
        hash.Update(staging.data(), n);
        stage_begin = at;
        stage_end = at + n;
      }
      report(stage_end > at ? stage_end : at);
    }
    if (done && out != nullptr) done(t);
  }
  report(data_bytes);
  return FileDigest{file_bytes_, hash.Hex()};
}

}  // namespace ltrain
