// `ltrain data prepare` in bounded memory (common/data/prepare.h): JSON Lines and compressed inputs,
// shards of a fixed size read back as one stream, validation chosen by document, and bad input named
// by file and line with nothing left behind.
#include "common/data/prepare.h"

#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "common/data/token_data.h"
#include "common/data/tokenizer.h"

namespace ltrain {
namespace {

namespace fs = std::filesystem;

class PrepareTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("ltrain_prepare_test_" + std::to_string(::getpid()) + "_" +
                                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string Write(const std::string& name, const std::string& text) {
    const std::string path = (dir_ / name).string();
    std::ofstream(path, std::ios::binary) << text;
    return path;
  }

  // The output directory after a failed run: absent, and nothing beside it.
  void ExpectNothingLeft(const std::string& out) {
    EXPECT_FALSE(fs::exists(out)) << out;
    for (const auto& e : fs::directory_iterator(dir_)) {
      EXPECT_EQ(e.path().filename().string().find(".partial"), std::string::npos) << e.path();
    }
  }

  StatusOr<PrepareStats> Prepare(const std::vector<std::string>& inputs, const std::string& out, double val = 0.0,
                                 int64_t shard_bytes = kDefaultShardBytes) {
    PrepareOptions o;
    o.inputs = inputs;
    o.output_dir = (dir_ / out).string();
    o.val_fraction = val;
    o.shard_bytes = shard_bytes;
    o.threads = 2;
    return PrepareData(o);
  }

  std::string ReadAll(const TokenDataset& data) {
    std::string text;
    for (int64_t i = 0; i < data.size(); ++i) text.push_back(static_cast<char>(data.token(i)));
    return text;
  }

  fs::path dir_;
};

std::string Json(const std::string& text) {
  std::string out = "\"";
  for (char c : text) {
    if (c == '"' || c == '\\') out += '\\';
    if (c == '\n') {
      out += "\\n";
      continue;
    }
    out += c;
  }
  return out + "\"";
}

// --sft: records of {"prompt", "response"} are documents of the prompt and then the response, with a
// loss mask that counts the response's tokens only; a record without a response is an error naming
// its line, and nothing is left.
TEST_F(PrepareTest, SftRecordsKeepALossMaskOfTheirResponses) {
  std::string lines, expected, expected_mask;
  for (int i = 0; i < 200; ++i) {
    const std::string prompt = "Q: " + std::to_string(i) + " plus 1?\nA:", response = " " + std::to_string(i + 1) + "\n";
    lines += "{\"prompt\": " + Json(prompt) + ", \"response\": " + Json(response) + "}\n";
    expected += prompt + response;
    expected_mask += std::string(prompt.size(), '\0') + std::string(response.size(), '\1');
  }
  PrepareOptions o;
  o.inputs = {Write("sft.jsonl", lines)};
  o.output_dir = (dir_ / "out").string();
  o.val_fraction = 0;
  o.threads = 2;
  o.sft = true;
  StatusOr<PrepareStats> stats = PrepareData(o);
  ASSERT_TRUE(stats.ok()) << stats.status().ToString();
  EXPECT_TRUE(stats->info.sft);
  EXPECT_EQ(stats->info.train_documents, 200);
  StatusOr<DataInfo> info = ReadDataInfo(o.output_dir);
  ASSERT_TRUE(info.ok());
  EXPECT_TRUE(info->sft);
  ASSERT_FALSE(info->shards.empty());
  EXPECT_EQ(info->shards[0].mask, "train-00000.mask");
  StatusOr<TokenDataset> train = TokenDataset::OpenSplit(o.output_dir, "train");
  ASSERT_TRUE(train.ok()) << train.status().ToString();
  ASSERT_TRUE(train->masked());
  EXPECT_EQ(ReadAll(*train), expected);
  std::string mask(static_cast<size_t>(train->size()), '\2');
  train->ReadMask(0, train->size(), reinterpret_cast<uint8_t*>(mask.data()));
  EXPECT_EQ(mask, expected_mask);

  o.inputs = {Write("bad.jsonl", lines + "{\"prompt\": \"Q: and?\"}\n")};
  o.output_dir = (dir_ / "bad").string();
  StatusOr<PrepareStats> bad = PrepareData(o);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("bad.jsonl line 201"), std::string::npos) << bad.status().message();
  EXPECT_NE(bad.status().message().find("\"response\""), std::string::npos) << bad.status().message();
  ExpectNothingLeft(o.output_dir);
}

// Records of JSON Lines are documents of their "text" field's string, unescaped; blank lines are no
// records; the same lines compressed with zstd or gzip give the same tokens.
TEST_F(PrepareTest, JsonLinesPlainZstdAndGzipGiveTheSameTokens) {
  std::string lines, expected;
  for (int i = 0; i < 300; ++i) {
    const std::string text = "record " + std::to_string(i) + " says \"hi\"\nand ends.";
    lines += "{\"id\": " + std::to_string(i) + ", \"text\": " + Json(text) + "}\n";
    if (i == 7) lines += "\n";
    expected += text;
  }
  const std::string plain = Write("c.jsonl", lines);
  Write("z.jsonl", lines);
  Write("g.jsonl", lines);
  ASSERT_EQ(std::system(("zstd -q " + (dir_ / "z.jsonl").string()).c_str()), 0) << "zstd (Debian's zstd package)";
  ASSERT_EQ(std::system(("gzip -q " + (dir_ / "g.jsonl").string()).c_str()), 0);
  for (const std::string& input : {plain, (dir_ / "z.jsonl.zst").string(), (dir_ / "g.jsonl.gz").string()}) {
    SCOPED_TRACE(input);
    const std::string out = fs::path(input).filename().string() + ".out";
    StatusOr<PrepareStats> stats = Prepare({input}, out);
    ASSERT_TRUE(stats.ok()) << stats.status().ToString();
    EXPECT_EQ(stats->info.train_documents, 300);
    EXPECT_EQ(stats->info.inputs[0].documents, 300);
    StatusOr<TokenDataset> train = TokenDataset::OpenSplit((dir_ / out).string(), "train");
    ASSERT_TRUE(train.ok()) << train.status().ToString();
    EXPECT_EQ(ReadAll(*train), expected);
  }
  // The compressed stream is known by its first bytes, whatever the name.
  fs::rename(dir_ / "z.jsonl.zst", dir_ / "renamed.jsonl");
  StatusOr<PrepareStats> renamed = Prepare({(dir_ / "renamed.jsonl").string()}, "renamed.out");
  ASSERT_TRUE(renamed.ok()) << renamed.status().ToString();
  EXPECT_EQ(renamed->info.train_tokens, static_cast<int64_t>(expected.size()));
}

// Shards of about --shard-size, read back as one stream across their boundaries; each shard's index
// says where its documents start and whether it begins inside one.
TEST_F(PrepareTest, ShardsOfAFixedSizeReadBackAsOneStream) {
  std::string corpus, expected;
  for (int d = 0; d < 40; ++d) {
    std::string text;
    for (int line = 0; line < 20 + d; ++line) text += "document " + std::to_string(d) + " line " + std::to_string(line) + "\n";
    corpus += "{\"text\": " + Json(text) + "}\n";
    expected += text;
  }
  StatusOr<PrepareStats> stats = Prepare({Write("c.jsonl", corpus)}, "out", 0.0, kMinShardBytes);
  ASSERT_TRUE(stats.ok()) << stats.status().ToString();
  const std::string out = (dir_ / "out").string();
  StatusOr<DataInfo> info = ReadDataInfo(out);
  ASSERT_TRUE(info.ok()) << info.status().ToString();
  ASSERT_GT(info->shards.size(), 3u);
  int64_t documents = 0;
  for (const ShardInfo& s : info->shards) {
    EXPECT_EQ(s.split, "train");
    EXPECT_GE(s.tokens * 2, kMinShardBytes) << s.file;
    EXPECT_EQ(s.xxh3.size(), 16u);
    StatusOr<DocumentIndex> index = ReadDocumentIndex((fs::path(out) / s.index).string());
    ASSERT_TRUE(index.ok()) << index.status().ToString();
    EXPECT_EQ(static_cast<int64_t>(index->starts.size()), s.documents);
    documents += s.documents;
  }
  EXPECT_EQ(documents, 40);
  StatusOr<TokenDataset> train = TokenDataset::OpenSplit(out, "train");
  ASSERT_TRUE(train.ok()) << train.status().ToString();
  EXPECT_EQ(train->shards(), static_cast<int>(info->shards.size()));
  EXPECT_EQ(ReadAll(*train), expected);
  // A window across the first shard's end, read at once.
  const int64_t edge = info->shards[0].tokens;
  std::vector<int64_t> window(100);
  train->Read(edge - 50, 100, window.data());
  for (int i = 0; i < 100; ++i) EXPECT_EQ(window[static_cast<size_t>(i)], expected[static_cast<size_t>(edge - 50 + i)]);
  // A shard cut short is found when the dataset opens.
  fs::resize_file(fs::path(out) / info->shards[1].file, 100);
  StatusOr<TokenDataset> damaged = TokenDataset::OpenSplit(out, "train");
  ASSERT_FALSE(damaged.ok());
  EXPECT_NE(damaged.status().message().find(info->shards[1].file), std::string::npos) << damaged.status().message();
}

// Which documents go to validation is a hash of each: about the fraction of them, the same ones
// whatever their order, and whole (a document's tokens are in one split).
TEST_F(PrepareTest, ValidationIsChosenByDocument) {
  std::string forward, backward;
  std::vector<std::string> lines;
  for (int d = 0; d < 2000; ++d) lines.push_back("{\"text\": \"doc " + std::to_string(d) + " " + std::string(d % 7, 'x') + ".\"}\n");
  for (const std::string& l : lines) forward += l;
  for (auto it = lines.rbegin(); it != lines.rend(); ++it) backward += *it;
  StatusOr<PrepareStats> a = Prepare({Write("a.jsonl", forward)}, "a", 0.1);
  StatusOr<PrepareStats> b = Prepare({Write("b.jsonl", backward)}, "b", 0.1);
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  EXPECT_NEAR(static_cast<double>(a->info.val_documents) / 2000.0, 0.1, 0.02);
  EXPECT_EQ(a->info.val_documents + a->info.train_documents, 2000);
  auto documents = [&](const std::string& out) {
    StatusOr<TokenDataset> val = TokenDataset::OpenSplit((dir_ / out).string(), "val");
    std::set<std::string> docs;
    std::string text = val.ok() ? ReadAll(*val) : "";
    for (size_t at = 0; at < text.size();) {
      const size_t end = text.find('.', at);
      docs.insert(text.substr(at, end - at + 1));
      at = end + 1;
    }
    return docs;
  };
  EXPECT_EQ(documents("a"), documents("b"));
  EXPECT_EQ(static_cast<int64_t>(documents("a").size()), a->info.val_documents);
}

// A small corpus whose hashes choose no validation document still gets one: the last piece.
TEST_F(PrepareTest, ASmallCorpusStillHasAValidationDocument) {
  std::string text;
  for (int i = 0; i < 400; ++i) text += "line " + std::to_string(i) + " of a small text file\n";
  StatusOr<PrepareStats> stats = Prepare({Write("small.txt", text)}, "out", 0.001);
  ASSERT_TRUE(stats.ok()) << stats.status().ToString();
  EXPECT_GT(stats->info.val_tokens, 0);
  EXPECT_EQ(stats->info.train_tokens + stats->info.val_tokens, static_cast<int64_t>(text.size()));
}

// Bad input is an error that names the file and the line; nothing is left that looks like a dataset.
TEST_F(PrepareTest, BadInputNamesTheFileAndLineAndLeavesNothing) {
  std::string good;
  for (int i = 0; i < 50; ++i) good += "{\"text\": \"" + std::string(40, 'a') + "\"}\n";
  struct Case {
    std::string name, content, wants;
  };
  std::string binary;
  for (int i = 0; i < 5000; ++i) binary.push_back(static_cast<char>((i * 7919) % 256));
  const std::vector<Case> cases = {
      {"broken.jsonl", good + "{\"text\": \"unterminated}\n" + good, "broken.jsonl line 51: not a JSON record"},
      {"field.jsonl", good + "{\"content\": \"x\", \"id\": 3}\n", "line 51: the record has no \"text\" field (its keys: content, id)"},
      {"number.jsonl", "{\"text\": 12}\n", "line 1: \"text\" is a number, not a string"},
      {"array.jsonl", "[1, 2]\n", "line 1: the record is an array"},
      {"binary.txt", binary, "binary.txt line 1: not text"},
      {"blank.jsonl", "\n\n  \n", "blank.jsonl holds no JSON record"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    StatusOr<PrepareStats> stats = Prepare({Write(c.name, c.content)}, c.name + ".out");
    ASSERT_FALSE(stats.ok());
    EXPECT_EQ(stats.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(stats.status().message().find(c.wants), std::string::npos) << stats.status().message();
    ExpectNothingLeft((dir_ / (c.name + ".out")).string());
  }
  // A truncated zstd stream, and a truncated gzip one.
  std::string big;
  for (int i = 0; i < 3000; ++i) big += "{\"text\": \"line " + std::to_string(i * 7919) + "\"}\n";
  Write("t.jsonl", big);
  Write("u.jsonl", big);
  ASSERT_EQ(std::system(("zstd -q " + (dir_ / "t.jsonl").string()).c_str()), 0);
  ASSERT_EQ(std::system(("gzip -q " + (dir_ / "u.jsonl").string()).c_str()), 0);
  for (const char* name : {"t.jsonl.zst", "u.jsonl.gz"}) {
    SCOPED_TRACE(name);
    fs::resize_file(dir_ / name, fs::file_size(dir_ / name) / 2);
    StatusOr<PrepareStats> stats = Prepare({(dir_ / name).string()}, std::string(name) + ".out");
    ASSERT_FALSE(stats.ok());
    EXPECT_NE(stats.status().message().find(std::string(name) + ": the"), std::string::npos) << stats.status().message();
    EXPECT_NE(stats.status().message().find("ends early"), std::string::npos) << stats.status().message();
    ExpectNothingLeft((dir_ / (std::string(name) + ".out")).string());
  }
  // An empty file given by name.
  StatusOr<PrepareStats> empty = Prepare({Write("empty.jsonl", "")}, "empty.out");
  ASSERT_FALSE(empty.ok());
  EXPECT_NE(empty.status().message().find("empty.jsonl is empty"), std::string::npos) << empty.status().message();
}

// A text file longer than a piece is read in pieces cut where a pre-token never crosses: with GPT-2's
// regex the tokens are those of the whole file at once.
TEST_F(PrepareTest, TextFilesReadInPiecesTokenizeAsAWhole) {
  std::string text;
  for (int i = 0; i < 3000; ++i) {
    // Lines that end in spaces or start with them, and blank ones, are no places to cut.
    text += (i % 5 == 0 ? "    indented(" : "word ") + std::to_string(i) + (i % 3 == 0 ? ")   \n" : ")\n") +
            (i % 11 == 0 ? "\n\n" : "");
  }
  ASSERT_GT(text.size(), 4 * kTextPieceBytes);
  const std::string input = Write("long.txt", text);
  PrepareOptions o;
  o.inputs = {input};
  o.output_dir = (dir_ / "out").string();
  o.val_fraction = 0;
  o.threads = 2;
  o.train_tokenizer = "bpe";
  o.vocab = 400;
  StatusOr<PrepareStats> stats = PrepareData(o);
  ASSERT_TRUE(stats.ok()) << stats.status().ToString();
  StatusOr<std::unique_ptr<TextTokenizer>> tokenizer = TextTokenizer::Load((dir_ / "out" / "tokenizer.json").string());
  ASSERT_TRUE(tokenizer.ok()) << tokenizer.status().ToString();
  std::vector<uint32_t> whole = (*tokenizer)->Encode(text);
  whole.push_back(static_cast<uint32_t>((*tokenizer)->end_of_text()));
  StatusOr<TokenDataset> train = TokenDataset::OpenSplit((dir_ / "out").string(), "train");
  ASSERT_TRUE(train.ok()) << train.status().ToString();
  ASSERT_EQ(train->size(), static_cast<int64_t>(whole.size()));
  for (size_t i = 0; i < whole.size(); ++i) ASSERT_EQ(train->token(static_cast<int64_t>(i)), whole[i]) << i;
}

TEST(ByteSizeTest, SizesParseWithTheirUnits) {
  EXPECT_EQ(*ParseByteSize("1GB"), int64_t{1} << 30);
  EXPECT_EQ(*ParseByteSize("256MB"), int64_t{256} << 20);
  EXPECT_EQ(*ParseByteSize("64kb"), int64_t{64} << 10);
  EXPECT_EQ(*ParseByteSize("4096"), 4096);
  EXPECT_FALSE(ParseByteSize("lots").ok());
  EXPECT_FALSE(ParseByteSize("1TBs").ok());
  EXPECT_FALSE(ParseByteSize("-5MB").ok());
}

}  // namespace
}  // namespace ltrain
