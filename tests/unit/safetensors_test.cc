// Safetensors files as the checkpoint shards use them: a streamed write read back, a header written
// by hand (as another implementation writes it), a flipped byte found by the hash, malformed headers
// refused with a reason.
#include "common/safetensors.h"

#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <gtest/gtest.h>

namespace ltrain {
namespace {

namespace fs = std::filesystem;

class SafetensorsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("ltrain_safetensors_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string Path(const std::string& name) const { return (dir_ / name).string(); }

  // A file of 8 length bytes, `header` padded to 8, then `data`.
  std::string WriteRaw(const std::string& name, std::string header, const std::string& data) const {
    while ((8 + header.size()) % 8 != 0) header.push_back(' ');
    std::string bytes(8, '\0');
    const uint64_t n = header.size();
    for (int i = 0; i < 8; ++i) bytes[i] = static_cast<char>((n >> (8 * i)) & 0xff);
    std::ofstream(Path(name), std::ios::binary) << bytes << header << data;
    return Path(name);
  }

  fs::path dir_;
};

std::string Bytes(const void* p, size_t n) { return std::string(static_cast<const char*>(p), n); }

TEST_F(SafetensorsTest, StreamedWriteReadsBackWithTheSameHash) {
  const std::vector<float> weights = {1.5f, -2.0f, 3.25f, 0.0f, 7.0f, -8.5f};
  const std::vector<int64_t> range = {10, 16};
  const std::vector<uint16_t> halves = {0x3f80, 0x4000, 0xc040, 0x0000};
  std::vector<SafetensorsEntry> entries = {
      {"model.w", "F32", {2, 3}, weights.size() * 4},
      {"range.w", "I64", {2}, range.size() * 8},
      {"model.h", "BF16", {4}, halves.size() * 2},
  };
  StatusOr<std::unique_ptr<SafetensorsWriter>> writer =
      SafetensorsWriter::Create(Path("a.safetensors"), entries, {{"format", "pt"}});
  ASSERT_TRUE(writer.ok()) << writer.status().message();
  // Pieces of any size, across tensor boundaries.
  std::string data = Bytes(weights.data(), 24) + Bytes(range.data(), 16) + Bytes(halves.data(), 8);
  ASSERT_TRUE((*writer)->Write(data.data(), 1).ok());
  ASSERT_TRUE((*writer)->Write(data.data() + 1, 30).ok());
  ASSERT_TRUE((*writer)->Write(data.data() + 31, data.size() - 31).ok());
  StatusOr<FileDigest> written = (*writer)->Finish();
  ASSERT_TRUE(written.ok()) << written.status().message();
  EXPECT_EQ(written->bytes, fs::file_size(Path("a.safetensors")));
  EXPECT_EQ(written->xxh3.size(), 16u);
  StatusOr<FileDigest> hashed = HashFile(Path("a.safetensors"));
  ASSERT_TRUE(hashed.ok());
  EXPECT_EQ(hashed->xxh3, written->xxh3);

  StatusOr<std::unique_ptr<SafetensorsFile>> file = SafetensorsFile::Open(Path("a.safetensors"));
  ASSERT_TRUE(file.ok()) << file.status().message();
  ASSERT_EQ((*file)->tensors().size(), 3u);
  EXPECT_EQ((*file)->metadata().at("format"), "pt");
  const SafetensorsEntry* w = (*file)->Find("model.w");
  ASSERT_NE(w, nullptr);
  EXPECT_EQ(w->dtype, "F32");
  EXPECT_EQ(w->shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(w->begin, 0u);
  EXPECT_EQ(w->end, 24u);
  std::vector<float> back(6);
  ASSERT_TRUE((*file)->Read(*w, back.data()).ok());
  EXPECT_EQ(back, weights);

  // One verifying pass: every tensor's bytes where asked, the digest of the whole file.
  std::map<std::string, std::string> out;
  for (const SafetensorsEntry& e : (*file)->tensors()) out[e.name].resize(e.bytes);
  uint64_t progress = 0;
  StatusOr<FileDigest> read = (*file)->ReadAll([&](const SafetensorsEntry& e) -> void* { return out[e.name].data(); },
                                               [&](uint64_t done) { progress = done; });
  ASSERT_TRUE(read.ok()) << read.status().message();
  EXPECT_EQ(read->xxh3, written->xxh3);
  EXPECT_EQ(progress, written->bytes);
  EXPECT_EQ(out["model.w"], Bytes(weights.data(), 24));
  EXPECT_EQ(out["range.w"], Bytes(range.data(), 16));
  EXPECT_EQ(out["model.h"], Bytes(halves.data(), 8));
}

// The writer refuses more bytes than declared, and a file whose bytes are not all written.
TEST_F(SafetensorsTest, WriterChecksTheDeclaredSizes) {
  StatusOr<std::unique_ptr<SafetensorsWriter>> writer =
      SafetensorsWriter::Create(Path("b.safetensors"), {{"x", "F32", {2}, 8}});
  ASSERT_TRUE(writer.ok());
  const char bytes[16] = {};
  EXPECT_FALSE((*writer)->Write(bytes, 16).ok());
  ASSERT_TRUE((*writer)->Write(bytes, 4).ok());
  StatusOr<FileDigest> short_file = (*writer)->Finish();
  ASSERT_FALSE(short_file.ok());
  EXPECT_NE(short_file.status().message().find("4 of 8 data bytes"), std::string::npos) << short_file.status().message();
  EXPECT_FALSE(SafetensorsWriter::Create(Path("c.safetensors"), {{"x", "F32", {3}, 8}}).ok());  // 3 floats are 12 bytes
  EXPECT_FALSE(SafetensorsWriter::Create(Path("d.safetensors"), {{"x", "Q4", {2}, 8}}).ok());
  EXPECT_FALSE(SafetensorsWriter::Create(Path("e.safetensors"), {{"x", "U8", {1}, 1}, {"x", "U8", {1}, 1}}).ok());
}

// As Python's safetensors writes it: no spaces, metadata first, keys not in data order.
TEST_F(SafetensorsTest, HandWrittenHeaderParses) {
  const int64_t ids[1] = {42};
  const float values[2] = {0.5f, -1.0f};
  const std::string path = WriteRaw(
      "hand.safetensors",
      R"({"__metadata__":{"format":"pt"},"b":{"dtype":"F32","shape":[2],"data_offsets":[8,16]},"a":{"dtype":"I64","shape":[1],"data_offsets":[0,8]}})",
      Bytes(ids, 8) + Bytes(values, 8));
  StatusOr<std::unique_ptr<SafetensorsFile>> file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status().message();
  ASSERT_EQ((*file)->tensors().size(), 2u);
  EXPECT_EQ((*file)->tensors()[0].name, "a");  // file order
  EXPECT_EQ((*file)->tensors()[1].name, "b");
  float back[2] = {};
  ASSERT_TRUE((*file)->Read(*(*file)->Find("b"), back).ok());
  EXPECT_EQ(back[0], 0.5f);
  EXPECT_EQ(back[1], -1.0f);
  StatusOr<FileDigest> read = (*file)->ReadAll(nullptr);
  ASSERT_TRUE(read.ok());
  EXPECT_EQ(read->xxh3, HashFile(path)->xxh3);
}

TEST_F(SafetensorsTest, AFlippedByteChangesTheHash) {
  std::vector<float> values(1000, 1.0f);
  StatusOr<std::unique_ptr<SafetensorsWriter>> writer =
      SafetensorsWriter::Create(Path("f.safetensors"), {{"v", "F32", {1000}, 4000}});
  ASSERT_TRUE(writer.ok());
  ASSERT_TRUE((*writer)->Write(values.data(), 4000).ok());
  StatusOr<FileDigest> written = (*writer)->Finish();
  ASSERT_TRUE(written.ok());
  {
    std::fstream f(Path("f.safetensors"), std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(static_cast<std::streamoff>(written->bytes - 100));
    f.put('\x5a');
  }
  StatusOr<std::unique_ptr<SafetensorsFile>> file = SafetensorsFile::Open(Path("f.safetensors"));
  ASSERT_TRUE(file.ok());
  StatusOr<FileDigest> read = (*file)->ReadAll(nullptr);
  ASSERT_TRUE(read.ok());
  EXPECT_EQ(read->bytes, written->bytes);
  EXPECT_NE(read->xxh3, written->xxh3);
}

TEST_F(SafetensorsTest, MalformedHeadersAreRefusedWithAReason) {
  const std::string eight(8, '\0');
  struct Case {
    const char* name;
    std::string header;
    std::string data;
    const char* message;
  };
  const std::vector<Case> cases = {
      {"not_json", "{\"a\": [", "", "not JSON"},
      {"not_object", "[1, 2]", "", "not a JSON object"},
      {"missing_offsets", R"({"a":{"dtype":"F32","shape":[2]}})", eight, "needs dtype, shape and data_offsets"},
      {"unknown_dtype", R"({"a":{"dtype":"Q4","shape":[2],"data_offsets":[0,8]}})", eight, "unknown dtype Q4"},
      {"size", R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", eight, "need 12"},
      {"gap", R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", eight, "must be contiguous"},
      {"overlap",
       R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
       eight, "must be contiguous"},
      {"short_data", R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", eight, "the file has 8"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    StatusOr<std::unique_ptr<SafetensorsFile>> file = SafetensorsFile::Open(WriteRaw(c.name, c.header, c.data));
    ASSERT_FALSE(file.ok());
    EXPECT_EQ(file.status().code(), StatusCode::kDataLoss);
    EXPECT_NE(file.status().message().find(c.message), std::string::npos) << file.status().message();
  }
  // A length prefix larger than the file, and a file too short to have one.
  std::ofstream(Path("huge"), std::ios::binary) << std::string("\xff\xff\x00\x00\x00\x00\x00\x00", 8) << "{}";
  StatusOr<std::unique_ptr<SafetensorsFile>> huge = SafetensorsFile::Open(Path("huge"));
  ASSERT_FALSE(huge.ok());
  EXPECT_NE(huge.status().message().find("does not fit"), std::string::npos) << huge.status().message();
  std::ofstream(Path("tiny"), std::ios::binary) << "abc";
  EXPECT_FALSE(SafetensorsFile::Open(Path("tiny")).ok());
}

}  // namespace
}  // namespace ltrain
