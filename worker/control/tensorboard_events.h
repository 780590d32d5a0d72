// TensorBoard's event files, written without TensorFlow: a file of TFRecords (each a little-endian
// uint64 length, its masked CRC-32C, the bytes, their masked CRC-32C), each record a serialized
// tensorflow.Event message: first one with file_version "brain.Event:2", then one per scalar
// (wall_time, step, summary { value { tag, simple_value } }). TensorBoard reads every file named
// events.out.tfevents.* in a directory as one run.
#pragma once

#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <string_view>

namespace ltrain::worker {

// CRC-32C (Castagnoli) of `data`, and the masked form TFRecords store.
uint32_t Crc32c(std::string_view data);
uint32_t MaskedCrc32c(std::string_view data);

// The bytes of an Event with one scalar, and of the file's first Event.
std::string ScalarEvent(double wall_time, int64_t step, std::string_view tag, float value);
std::string FileVersionEvent(double wall_time);
// One record of a TFRecord file holding `data`.
std::string TfRecord(std::string_view data);

class TensorBoardWriter {
 public:
  // Creates `dir` if needed and a new event file in it, named for the time, host and process, so
  // that every generation of a job adds a file of its own to the same run. Null, with `error` set,
  // when that fails.
  static std::unique_ptr<TensorBoardWriter> Open(const std::string& dir, std::string& error);
  ~TensorBoardWriter();
  TensorBoardWriter(const TensorBoardWriter&) = delete;
  TensorBoardWriter& operator=(const TensorBoardWriter&) = delete;

  // Appends one scalar and flushes it, so that TensorBoard shows it at its next reload.
  void AddScalar(std::string_view tag, int64_t step, double value);
  const std::string& path() const { return path_; }

 private:
  TensorBoardWriter(std::FILE* file, std::string path) : file_(file), path_(std::move(path)) {}
  void Append(const std::string& record);

  std::FILE* file_;
  std::string path_;
};

}  // namespace ltrain::worker
