// A reader of TensorBoard event files for tests, written apart from the writer
// (worker/control/tensorboard_events.h): it checks each TFRecord's two CRC-32Cs (bit by bit, not by
// table) and decodes the Event messages' scalars from protobuf's wire format.
#pragma once

#include <cstdint>
#include <cstring>
#include <fstream>
#include <iterator>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

namespace ltrain::testing {

struct TensorBoardScalar {
  std::string tag;
  int64_t step = 0;
  float value = 0;
  double wall_time = 0;
};

struct TensorBoardFile {
  std::string file_version;  // of the first event
  std::vector<TensorBoardScalar> scalars;
  std::string error;  // empty when every record was whole and valid
};

inline uint32_t BitwiseCrc32c(const std::string& data) {
  uint32_t crc = 0xFFFFFFFFu;
  for (unsigned char byte : data) {
    crc ^= byte;
    for (int k = 0; k < 8; ++k) crc = (crc >> 1) ^ (0x82F63B78u & (0u - (crc & 1u)));
  }
  return ~crc;
}

inline uint32_t Unmask(uint32_t masked) {
  const uint32_t rotated = masked - 0xA282EAD8u;
  return (rotated >> 17) | (rotated << 15);
}

// Protobuf fields of one message: (number, wire type, varint or fixed value, bytes).
struct WireField {
  int number = 0;
  int type = 0;
  uint64_t integer = 0;
  std::string bytes;
};

inline std::optional<std::vector<WireField>> DecodeFields(const std::string& message) {
  std::vector<WireField> fields;
  size_t i = 0;
  auto varint = [&](uint64_t& out) {
    out = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      if (i >= message.size()) return false;
      const unsigned char b = static_cast<unsigned char>(message[i++]);
      out |= static_cast<uint64_t>(b & 0x7F) << shift;
      if (!(b & 0x80)) return true;
    }
    return false;
  };
  while (i < message.size()) {
    uint64_t key = 0;
    if (!varint(key)) return std::nullopt;
    WireField field;
    field.number = static_cast<int>(key >> 3);
    field.type = static_cast<int>(key & 7);
    if (field.type == 0) {
      if (!varint(field.integer)) return std::nullopt;
    } else if (field.type == 1 || field.type == 5) {
      const size_t width = field.type == 1 ? 8 : 4;
      if (i + width > message.size()) return std::nullopt;
      std::memcpy(&field.integer, message.data() + i, width);
      i += width;
    } else if (field.type == 2) {
      uint64_t length = 0;
      if (!varint(length) || i + length > message.size()) return std::nullopt;
      field.bytes = message.substr(i, length);
      i += length;
    } else {
      return std::nullopt;
    }
    fields.push_back(std::move(field));
  }
  return fields;
}

inline TensorBoardFile ReadTensorBoardFile(const std::string& path) {
  TensorBoardFile out;
  std::ifstream in(path, std::ios::binary);
  const std::string data((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  size_t i = 0;
  int record = 0;
  while (i < data.size()) {
    const std::string where = path + " record " + std::to_string(record++);
    if (i + 12 > data.size()) return out.error = where + ": cut short", out;
    const std::string length_bytes = data.substr(i, 8);
    uint64_t length = 0;
    uint32_t length_crc = 0, data_crc = 0;
    std::memcpy(&length, length_bytes.data(), 8);
    std::memcpy(&length_crc, data.data() + i + 8, 4);
    if (Unmask(length_crc) != BitwiseCrc32c(length_bytes)) return out.error = where + ": bad length CRC", out;
    if (i + 16 + length > data.size()) return out.error = where + ": cut short", out;
    const std::string event = data.substr(i + 12, length);
    std::memcpy(&data_crc, data.data() + i + 12 + length, 4);
    if (Unmask(data_crc) != BitwiseCrc32c(event)) return out.error = where + ": bad data CRC", out;
    i += 16 + length;
    std::optional<std::vector<WireField>> fields = DecodeFields(event);
    if (!fields) return out.error = where + ": not a protobuf message", out;
    TensorBoardScalar scalar;
    bool has_summary = false;
    for (const WireField& f : *fields) {
      if (f.number == 1 && f.type == 1) std::memcpy(&scalar.wall_time, &f.integer, 8);
      if (f.number == 2 && f.type == 0) scalar.step = static_cast<int64_t>(f.integer);
      if (f.number == 3 && f.type == 2) out.file_version = f.bytes;
      if (f.number != 5 || f.type != 2) continue;
      std::optional<std::vector<WireField>> summary = DecodeFields(f.bytes);
      if (!summary) return out.error = where + ": bad summary", out;
      for (const WireField& v : *summary) {
        std::optional<std::vector<WireField>> value = DecodeFields(v.bytes);
        if (v.number != 1 || !value) return out.error = where + ": bad summary value", out;
        for (const WireField& x : *value) {
          if (x.number == 1 && x.type == 2) scalar.tag = x.bytes;
          if (x.number == 2 && x.type == 5) {
            const uint32_t bits = static_cast<uint32_t>(x.integer);
            std::memcpy(&scalar.value, &bits, 4);
            has_summary = true;
          }
        }
      }
    }
    if (has_summary) out.scalars.push_back(scalar);
  }
  return out;
}

}  // namespace ltrain::testing
