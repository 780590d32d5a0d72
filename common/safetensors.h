// Safetensors files (https://github.com/huggingface/safetensors, "Format"), written and read as
// streams, without LibTorch: the checkpoint shards of the worker and what `ltrain checkpoint`
// inspects.
//
//   [8 bytes: N, little-endian uint64][N bytes: JSON header, padded with spaces to a multiple of 8]
//   [the tensors' bytes, one after another, in the header's order]
//
// The header maps every tensor's name to {"dtype": "F32", "shape": [..], "data_offsets": [b, e]}
// (offsets into the data that follows the header) and "__metadata__" to a string map. Loading a
// file runs no code: it is a header of plain data and raw bytes.
//
// Both directions hash every byte of the file, header included, with XXH3-64 (libxxhash) as it
// passes, so that a file is written, or read and verified, in one pass.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "common/status.h"

struct XXH3_state_s;

namespace ltrain {

// Bytes per element of a safetensors dtype ("F32", "BF16", "I64", ...); 0 for one this code does
// not know.
int SafetensorsDtypeSize(const std::string& dtype);

struct SafetensorsEntry {
  std::string name;
  std::string dtype;            // "F32", "BF16", "F16", "I64", "I32", "U8"
  std::vector<int64_t> shape;
  uint64_t bytes = 0;           // numel * dtype size
  uint64_t begin = 0;           // offsets into the data section, filled by the writer and reader
  uint64_t end = 0;
};

// What a writer or a verifying read saw: the file's size and the XXH3-64 of all of its bytes as 16
// hex digits.
struct FileDigest {
  uint64_t bytes = 0;
  std::string xxh3;
};

// XXH3-64 over bytes handed in pieces.
class Xxh3 {
 public:
  Xxh3();
  ~Xxh3();
  Xxh3(const Xxh3&) = delete;
  Xxh3& operator=(const Xxh3&) = delete;
  void Update(const void* data, size_t n);
  std::string Hex() const;

 private:
  XXH3_state_s* state_;
};

// The XXH3-64 of a whole file, as 16 hex digits (what a manifest records), read in large chunks.
StatusOr<FileDigest> HashFile(const std::string& path);

// Writes one safetensors file at `path`: the header first (every tensor declared up front), then
// the tensors' bytes in the declared order through Write, in pieces of any size. Not thread-safe;
// one thread writes a file.
class SafetensorsWriter {
 public:
  // Creates (truncates) `path` and writes the header. Names must be unique and not "__metadata__".
  static StatusOr<std::unique_ptr<SafetensorsWriter>> Create(const std::string& path,
                                                             std::vector<SafetensorsEntry> tensors,
                                                             const std::map<std::string, std::string>& metadata = {});
  ~SafetensorsWriter();  // closes the file if Finish was not called (the file stays, incomplete)
  SafetensorsWriter(const SafetensorsWriter&) = delete;
  SafetensorsWriter& operator=(const SafetensorsWriter&) = delete;

  // The next `n` bytes of the data section (a piece of the current tensor, or several tensors).
  Status Write(const void* data, size_t n);
  // Every declared byte written: flushes, fsyncs and closes the file.
  StatusOr<FileDigest> Finish();
  // fsyncs and closes what was written so far, without checking that it is complete (a failure
  // drill leaves a half-written file that really is on disk).
  void Abandon();

  const std::vector<SafetensorsEntry>& tensors() const { return tensors_; }
  uint64_t file_bytes() const { return header_bytes_ + data_bytes_; }  // the whole file once finished
  uint64_t written() const { return written_; }                         // data bytes so far

 private:
  SafetensorsWriter(std::string path, int fd, std::vector<SafetensorsEntry> tensors);
  Status Flush();
  Status WriteFully(const void* data, size_t n);

  std::string path_;
  int fd_ = -1;
  std::vector<SafetensorsEntry> tensors_;
  uint64_t header_bytes_ = 0;
  uint64_t data_bytes_ = 0;
  uint64_t written_ = 0;
  uint64_t on_disk_ = 0;         // bytes handed to write(2), header included
  uint64_t writeback_from_ = 0;  // where the next writeback hint starts
  uint64_t dropped_to_ = 0;      // bytes before this are on the disk and out of the page cache
  std::string buffer_;  // coalesces small pieces (the range tensors) into larger writes
  Xxh3 hash_;
};

// A safetensors file opened for reading: its header, parsed and checked (offsets contiguous and
// inside the file, sizes matching dtype and shape), and its tensors' bytes on request.
class SafetensorsFile {
 public:
  static StatusOr<std::unique_ptr<SafetensorsFile>> Open(const std::string& path);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  const std::vector<SafetensorsEntry>& tensors() const { return tensors_; }  // in file order
  const SafetensorsEntry* Find(const std::string& name) const;
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  uint64_t file_bytes() const { return file_bytes_; }

  // One tensor's bytes into `into` (entry.bytes of room), with pread.
  Status Read(const SafetensorsEntry& entry, void* into) const;

  // Reads the whole file once, front to back, hashing every byte: each tensor's bytes go where
  // `destination(entry)` says (entry.bytes of room; nullptr: read and hashed only). `progress`
  // (optional) gets the bytes read so far, once per large read. Returns the file's digest; the
  // caller compares it with what it expects. `done` (optional) is called once a tensor's bytes are
  // all in place (before the file's hash is known).
  StatusOr<FileDigest> ReadAll(const std::function<void*(const SafetensorsEntry&)>& destination,
                               const std::function<void(uint64_t)>& progress = nullptr,
                               const std::function<void(const SafetensorsEntry&)>& done = nullptr) const;

 private:
  SafetensorsFile() = default;
  Status ReadAt(uint64_t offset, void* into, uint64_t n) const;

  std::string path_;
  int fd_ = -1;
  uint64_t file_bytes_ = 0;
  std::string head_;  // the 8 length bytes and the header, as in the file
  std::vector<SafetensorsEntry> tensors_;
  std::map<std::string, size_t> index_;
  std::map<std::string, std::string> metadata_;
};

// Parses a safetensors header (the JSON text after the 8 length bytes) for a data section of
// `data_bytes`; errors name the problem ("tensor x: data_offsets [0, 12] hold 12 bytes, its dtype
// and shape need 16").
StatusOr<std::vector<SafetensorsEntry>> ParseSafetensorsHeader(const std::string& json, uint64_t data_bytes,
                                                               std::map<std::string, std::string>* metadata);

}  // namespace ltrain
