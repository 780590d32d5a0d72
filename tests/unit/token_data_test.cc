#include "common/data/token_data.h"

#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "common/data/prepare.h"

namespace ltrain {
namespace {

namespace fs = std::filesystem;

class TokenDataTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("ltrain_token_test_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string WriteText(const std::string& name, const std::string& text) {
    std::string path = (dir_ / name).string();
    std::ofstream(path, std::ios::binary) << text;
    return path;
  }

  fs::path dir_;
};

StatusOr<PrepareStats> Prepare(const std::vector<std::string>& inputs, const std::string& out, double val_fraction,
                               const std::string& tokenizer = "byte") {
  PrepareOptions o;
  o.inputs = inputs;
  o.output_dir = out;
  o.val_fraction = val_fraction;
  o.tokenizer = tokenizer;
  o.threads = 2;
  return PrepareData(o);
}

// Bytes in input order, one shard a split here, each file a document of the index; nothing but the
// dataset's files is left behind.
TEST_F(TokenDataTest, PrepareRoundTripsBytesInOrderWithEachFileADocument) {
  std::string a = WriteText("a.txt", "hello " + std::string(1394, '.'));
  std::string b = WriteText("b.txt", "world!\xff");
  StatusOr<PrepareStats> stats = Prepare({a, b}, (dir_ / "out").string(), 0.0);
  ASSERT_TRUE(stats.ok()) << stats.status().ToString();
  EXPECT_EQ(stats->info.vocab, 256);
  EXPECT_EQ(stats->info.train_tokens, 1407);
  EXPECT_EQ(stats->info.val_tokens, 0);
  EXPECT_EQ(stats->info.train_documents, 2);

  StatusOr<TokenDataset> train = TokenDataset::OpenSplit((dir_ / "out").string(), "train");
  ASSERT_TRUE(train.ok()) << train.status().ToString();
  EXPECT_FALSE(TokenDataset::OpenSplit((dir_ / "out").string(), "val").ok());
  EXPECT_EQ(train->vocab(), 256);
  EXPECT_EQ(train->bytes_per_token(), 2);
  std::string got;
  for (int64_t i = 0; i < train->size(); ++i) got.push_back(static_cast<char>(train->token(i)));
  EXPECT_EQ(got, "hello " + std::string(1394, '.') + "world!\xff");
  StatusOr<DataInfo> info = ReadDataInfo((dir_ / "out").string());
  ASSERT_TRUE(info.ok()) << info.status().ToString();
  EXPECT_EQ(info->format, 2);
  EXPECT_EQ(info->tokenizer, "byte");
  EXPECT_EQ(info->dtype, "uint16");
  ASSERT_EQ(info->inputs.size(), 2u);
  EXPECT_EQ(info->inputs[1].path, b);
  EXPECT_EQ(info->inputs[1].documents, 1);
  ASSERT_EQ(info->shards.size(), 1u);
  EXPECT_EQ(info->shards[0].file, "train-00000.bin");
  EXPECT_EQ(info->shards[0].last_input, 1);
  StatusOr<DocumentIndex> index = ReadDocumentIndex((dir_ / "out" / info->shards[0].index).string());
  ASSERT_TRUE(index.ok()) << index.status().ToString();
  EXPECT_FALSE(index->continues);
  EXPECT_EQ(index->starts, (std::vector<uint64_t>{0, 1400}));
  for (const auto& e : fs::directory_iterator(dir_)) {
    EXPECT_EQ(e.path().filename().string().find(".partial"), std::string::npos) << e.path();
  }
  for (const auto& e : fs::directory_iterator(dir_ / "out")) {
    const std::string ext = e.path().extension().string();
    EXPECT_TRUE(ext == ".bin" || ext == ".idx" || e.path().filename() == "data.yaml") << e.path();
  }
}

// Directories are walked for their files in path order (hidden ones skipped); globs expand.
TEST_F(TokenDataTest, DirectoriesAndGlobsExpandInOrder) {
  fs::create_directories(dir_ / "corpus" / "sub");
  fs::create_directories(dir_ / "corpus" / ".git");
  WriteText("corpus/b.txt", std::string(700, 'b'));
  WriteText("corpus/a.txt", std::string(700, 'a'));
  WriteText("corpus/sub/c.txt", std::string(700, 'c'));
  WriteText("corpus/.git/HEAD", "ref");
  StatusOr<std::vector<std::string>> files = ExpandInputs({(dir_ / "corpus").string()});
  ASSERT_TRUE(files.ok()) << files.status().ToString();
  ASSERT_EQ(files->size(), 3u);
  EXPECT_EQ(fs::path((*files)[0]).filename(), "a.txt");
  EXPECT_EQ(fs::path((*files)[2]).filename(), "c.txt");
  StatusOr<std::vector<std::string>> globbed = ExpandInputs({(dir_ / "corpus" / "*.txt").string()});
  ASSERT_TRUE(globbed.ok());
  EXPECT_EQ(globbed->size(), 2u);
  EXPECT_FALSE(ExpandInputs({(dir_ / "corpus" / "*.md").string()}).ok());
  StatusOr<PrepareStats> stats = Prepare({(dir_ / "corpus").string()}, (dir_ / "out").string(), 0.1);
  ASSERT_TRUE(stats.ok()) << stats.status().ToString();
  EXPECT_EQ(stats->files, 3);
  EXPECT_EQ(stats->info.train_tokens + stats->info.val_tokens, 2100);
}

// A vocabulary past 65536 stores uint32 tokens.
TEST_F(TokenDataTest, LargeVocabulariesStoreUint32Tokens) {
  const std::string path = (dir_ / "wide.bin").string();
  ASSERT_TRUE(WriteTokenFile(path, std::vector<uint32_t>{1, 70000, 128255}, 128256).ok());
  StatusOr<TokenDataset> wide = TokenDataset::Open(path);
  ASSERT_TRUE(wide.ok()) << wide.status().ToString();
  EXPECT_EQ(wide->bytes_per_token(), 4);
  EXPECT_EQ(wide->vocab(), 128256);
  EXPECT_EQ(wide->token(1), 70000u);
  EXPECT_EQ(wide->token(2), 128255u);
}

TEST_F(TokenDataTest, PrepareErrorsNameTheFile) {
  StatusOr<PrepareStats> missing = Prepare({(dir_ / "nope.txt").string()}, (dir_ / "o").string(), 0.1);
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("nope.txt"), std::string::npos);

  std::string empty = WriteText("empty.txt", "");
  StatusOr<PrepareStats> e = Prepare({empty}, (dir_ / "o").string(), 0.1);
  ASSERT_FALSE(e.ok());
  EXPECT_NE(e.status().message().find("empty.txt"), std::string::npos);
  EXPECT_NE(e.status().message().find("empty"), std::string::npos);

  std::string ok = WriteText("ok.txt", "abc");
  StatusOr<PrepareStats> no_tokenizer = Prepare({ok}, (dir_ / "o").string(), 0.1, (dir_ / "no.json").string());
  ASSERT_FALSE(no_tokenizer.ok());
  EXPECT_NE(no_tokenizer.status().message().find("no.json"), std::string::npos);
  EXPECT_FALSE(Prepare({ok}, (dir_ / "o").string(), 1.0).ok());

  // Text too short for a training sample, with a validation split or without.
  EXPECT_NE(Prepare({ok}, (dir_ / "o").string(), 0.1).status().message().find("too little text"), std::string::npos);
  EXPECT_NE(Prepare({ok}, (dir_ / "o").string(), 0.0).status().message().find("too little text"), std::string::npos);

  // A regular file where the output directory should be.
  std::string blocker = WriteText("blocker", "x");
  StatusOr<PrepareStats> unwritable = Prepare({WriteText("enough.txt", std::string(2000, 'a'))}, blocker + "/sub", 0.1);
  ASSERT_FALSE(unwritable.ok());
  EXPECT_NE(unwritable.status().message().find("blocker"), std::string::npos);
}

TEST_F(TokenDataTest, OpenRejectsBadHeaders) {
  const std::string path = (dir_ / "t.bin").string();
  ASSERT_TRUE(WriteTokenFile(path, std::vector<uint16_t>{1, 2, 3, 4}, 256).ok());
  std::string good;
  {
    std::ifstream in(path, std::ios::binary);
    good.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  ASSERT_EQ(good.size(), kTokenHeaderBytes + 8);
  ASSERT_TRUE(TokenDataset::Open(path).ok());

  auto expect_error = [&](std::string bytes, const std::string& needle) {
    std::string p = (dir_ / "bad.bin").string();
    std::ofstream(p, std::ios::binary | std::ios::trunc) << bytes;
    StatusOr<TokenDataset> ds = TokenDataset::Open(p);
    ASSERT_FALSE(ds.ok()) << needle;
    EXPECT_NE(ds.status().message().find("bad.bin"), std::string::npos) << ds.status().message();
    EXPECT_NE(ds.status().message().find(needle), std::string::npos) << ds.status().message();
  };
  std::string bad_magic = good;
  bad_magic[0] = 'X';
  expect_error(bad_magic, "magic");
  std::string bad_version = good;
  bad_version[8] = 7;
  expect_error(bad_version, "version 7");
  expect_error(good.substr(0, good.size() - 2), "truncated");
  expect_error(good.substr(0, 10), "header");
  std::string bad_width = good;
  bad_width[24] = 3;
  expect_error(bad_width, "bytes per token");

  StatusOr<TokenDataset> missing = TokenDataset::Open((dir_ / "missing.bin").string());
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("missing.bin"), std::string::npos);
}

}  // namespace
}  // namespace ltrain
