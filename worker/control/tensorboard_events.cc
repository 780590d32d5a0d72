#include "worker/control/tensorboard_events.h"

#include <unistd.h>

#include <array>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>

#include "common/files.h"

namespace ltrain::worker {
namespace {

// The reflected CRC-32C table (polynomial 0x82F63B78), built once.
const std::array<uint32_t, 256>& CrcTable() {
  static const std::array<uint32_t, 256> table = [] {
    std::array<uint32_t, 256> t{};
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
      t[i] = c;
    }
    return t;
  }();
  return table;
}

// Protocol buffers' wire format, for the few fields an Event needs.
void Varint(std::string& out, uint64_t value) {
  while (value >= 0x80) {
    out.push_back(static_cast<char>((value & 0x7F) | 0x80));
    value >>= 7;
  }
  out.push_back(static_cast<char>(value));
}

void Key(std::string& out, int field, int wire_type) { Varint(out, (static_cast<uint64_t>(field) << 3) | wire_type); }

template <typename T>
void Fixed(std::string& out, T value) {
  char bytes[sizeof(T)];
  std::memcpy(bytes, &value, sizeof(T));  // little-endian hosts only, as the rest of ltrain
  out.append(bytes, sizeof(T));
}

void LengthDelimited(std::string& out, int field, std::string_view bytes) {
  Key(out, field, 2);
  Varint(out, bytes.size());
  out.append(bytes);
}

double Now() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

}  // namespace

uint32_t Crc32c(std::string_view data) {
  const auto& table = CrcTable();
  uint32_t crc = 0xFFFFFFFFu;
  for (unsigned char byte : data) crc = table[(crc ^ byte) & 0xFF] ^ (crc >> 8);
  return crc ^ 0xFFFFFFFFu;
}

uint32_t MaskedCrc32c(std::string_view data) {
  const uint32_t crc = Crc32c(data);
  return ((crc >> 15) | (crc << 17)) + 0xA282EAD8u;
}

std::string ScalarEvent(double wall_time, int64_t step, std::string_view tag, float value) {
  std::string summary_value;  // Summary.Value: tag = 1, simple_value = 2
  LengthDelimited(summary_value, 1, tag);
  Key(summary_value, 2, 5);
  Fixed(summary_value, value);
  std::string summary;  // Summary: value = 1
  LengthDelimited(summary, 1, summary_value);
  std::string event;  // Event: wall_time = 1, step = 2, summary = 5
  Key(event, 1, 1);
  Fixed(event, wall_time);
  Key(event, 2, 0);
  Varint(event, static_cast<uint64_t>(step));
  LengthDelimited(event, 5, summary);
  return event;
}

std::string FileVersionEvent(double wall_time) {
  std::string event;  // Event: wall_time = 1, file_version = 3
  Key(event, 1, 1);
  Fixed(event, wall_time);
  LengthDelimited(event, 3, "brain.Event:2");
  return event;
}

std::string TfRecord(std::string_view data) {
  std::string length;
  Fixed(length, static_cast<uint64_t>(data.size()));
  std::string record = length;
  Fixed(record, MaskedCrc32c(length));
  record.append(data);
  Fixed(record, MaskedCrc32c(data));
  return record;
}

std::unique_ptr<TensorBoardWriter> TensorBoardWriter::Open(const std::string& dir, std::string& error) {
  if (Status made = CreateDirectories(dir); !made.ok()) {
    error = made.message();
    return nullptr;
  }
  char host[256] = "localhost";
  gethostname(host, sizeof(host) - 1);
  const double now = Now();
  const std::string path = dir + "/events.out.tfevents." + std::to_string(static_cast<int64_t>(now)) + "." + host + "." +
                           std::to_string(getpid()) + ".ltrain";
  StatusOr<std::FILE*> opened = OpenStreamForWriting(path, /*append=*/false);
  if (!opened.ok()) {
    error = opened.status().message();
    return nullptr;
  }
  std::FILE* file = *opened;
  std::unique_ptr<TensorBoardWriter> writer(new TensorBoardWriter(file, path));
  writer->Append(TfRecord(FileVersionEvent(now)));
  return writer;
}

TensorBoardWriter::~TensorBoardWriter() { std::fclose(file_); }

void TensorBoardWriter::AddScalar(std::string_view tag, int64_t step, double value) {
  Append(TfRecord(ScalarEvent(Now(), step, tag, static_cast<float>(value))));
}

void TensorBoardWriter::Append(const std::string& record) {
  std::fwrite(record.data(), 1, record.size(), file_);
  std::fflush(file_);
}

}  // namespace ltrain::worker
