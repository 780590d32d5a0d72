// Reading a program's error file (TORCHELASTIC_ERROR_FILE) as PyTorch's `@record` writes it.
#include "agent/program_error.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>

#include <unistd.h>

namespace ltrain::agent {
namespace {

// What torch.distributed.elastic.multiprocessing.errors.ErrorHandler.record_exception writes.
constexpr const char* kRecorded =
    R"({"message": {"message": "ValueError: rank 1 cannot go on", "extraInfo": {"py_callstack": "Traceback (most recent call last):\n  File \"/w/train.py\", line 9, in main\n    raise ValueError(\"rank 1 cannot go on\")\nValueError: rank 1 cannot go on\n", "timestamp": "1765011000"}}})";

TEST(ProgramErrorTest, ReadsWhatRecordWrites) {
  StatusOr<v1::ProgramError> error = ParseProgramError(kRecorded);
  ASSERT_TRUE(error.ok()) << error.status().message();
  EXPECT_EQ(error->message(), "ValueError: rank 1 cannot go on");
  EXPECT_NE(error->traceback().find("File \"/w/train.py\", line 9, in main"), std::string::npos);
  EXPECT_EQ(error->timestamp_s(), 1765011000);
}

TEST(ProgramErrorTest, ReadsTheOlderFormatAndAnErrorCode) {
  StatusOr<v1::ProgramError> older = ParseProgramError(R"({"message": "RuntimeError: x", "timestamp": 17})");
  ASSERT_TRUE(older.ok()) << older.status().message();
  EXPECT_EQ(older->message(), "RuntimeError: x");
  EXPECT_EQ(older->timestamp_s(), 17);
  StatusOr<v1::ProgramError> coded = ParseProgramError(R"({"message": {"message": "m", "errorCode": 7}})");
  ASSERT_TRUE(coded.ok()) << coded.status().message();
  EXPECT_EQ(coded->error_code(), 7);
  EXPECT_EQ(coded->timestamp_s(), 0);
}

TEST(ProgramErrorTest, RefusesWhatIsNoErrorFile) {
  for (const char* text : {"", "not json", "[1]", R"({"other": 1})", R"({"message": 3})", R"({"message": {}})"}) {
    StatusOr<v1::ProgramError> error = ParseProgramError(text);
    EXPECT_FALSE(error.ok()) << text;
    if (!error.ok()) {
      EXPECT_EQ(error.status().code(), StatusCode::kInvalidArgument) << text;
    }
  }
}

TEST(ProgramErrorTest, ReadsTheFileAndSaysWhenThereIsNone) {
  const std::filesystem::path dir = std::filesystem::temp_directory_path() /
                                    ("program_error_test-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const std::string path = (dir / ProgramErrorFileName(1)).string();
  EXPECT_EQ(ReadProgramError(path).status().code(), StatusCode::kNotFound);
  std::ofstream(path) << kRecorded;
  StatusOr<v1::ProgramError> error = ReadProgramError(path);
  ASSERT_TRUE(error.ok()) << error.status().message();
  EXPECT_EQ(error->error_file(), path);
  std::ofstream(path) << "{";
  EXPECT_EQ(ReadProgramError(path).status().code(), StatusCode::kInvalidArgument);
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace ltrain::agent
