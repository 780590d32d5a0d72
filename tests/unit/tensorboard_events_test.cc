// TensorBoard event files: CRC-32C's check value, records a separate reader accepts, and an Event
// that protoc itself decodes to TensorBoard's field numbers.
#include "worker/control/tensorboard_events.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "tests/support/subprocess.h"
#include "tests/support/tensorboard_reader.h"

namespace ltrain::worker {
namespace {

TEST(TensorBoardEventsTest, Crc32cHasItsCheckValue) {
  EXPECT_EQ(Crc32c("123456789"), 0xE3069283u);
  EXPECT_EQ(Crc32c(""), 0u);
  EXPECT_EQ(Crc32c("123456789"), testing::BitwiseCrc32c("123456789"));
}

TEST(TensorBoardEventsTest, ProtocDecodesAScalarEventToTensorBoardsFields) {
  testing::TempDir dir;
  const std::string path = dir.Write("event.bin", ScalarEvent(1.5, 7, "train/loss", 2.5f));
  testing::ProcessResult decoded = testing::RunProcess({"/bin/sh", "-c", "protoc --decode_raw < " + path}, {});
  ASSERT_EQ(decoded.exit_code, 0) << "protoc (protobuf-compiler) decodes raw messages: " << decoded.output;
  // wall_time 1.5 (double 0x3ff8000000000000), step 7, summary { value { tag, simple_value 2.5 (0x40200000) } }
  EXPECT_EQ(decoded.output, "1: 0x3ff8000000000000\n2: 7\n5 {\n  1 {\n    1: \"train/loss\"\n    2: 0x40200000\n  }\n}\n");
}

TEST(TensorBoardEventsTest, AWriterWritesAFileOfRecordsThatAReaderAccepts) {
  testing::TempDir dir;
  std::string error;
  std::unique_ptr<TensorBoardWriter> writer = TensorBoardWriter::Open(dir.Join("tb/run"), error);
  ASSERT_TRUE(writer) << error;
  EXPECT_NE(writer->path().find("/tb/run/events.out.tfevents."), std::string::npos) << writer->path();
  for (int step = 1; step <= 3; ++step) writer->AddScalar("train/loss", step, 4.0 / step);
  writer->AddScalar("val/loss", 3, 1.25);
  // Flushed as written: readable while the writer lives.
  const testing::TensorBoardFile file = testing::ReadTensorBoardFile(writer->path());
  ASSERT_EQ(file.error, "");
  EXPECT_EQ(file.file_version, "brain.Event:2");
  ASSERT_EQ(file.scalars.size(), 4u);
  EXPECT_EQ(file.scalars[1].tag, "train/loss");
  EXPECT_EQ(file.scalars[1].step, 2);
  EXPECT_FLOAT_EQ(file.scalars[1].value, 2.0f);
  EXPECT_GT(file.scalars[1].wall_time, 1.7e9);
  EXPECT_EQ(file.scalars[3].tag, "val/loss");
  EXPECT_FLOAT_EQ(file.scalars[3].value, 1.25f);

  // A flipped byte is caught by the record's CRC.
  std::string bytes;
  {
    std::ifstream in(writer->path(), std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  bytes[bytes.size() - 6] ^= 1;
  const std::string corrupt = dir.Write("corrupt", bytes);
  EXPECT_NE(testing::ReadTensorBoardFile(corrupt).error.find("bad data CRC"), std::string::npos);
}

}  // namespace
}  // namespace ltrain::worker
