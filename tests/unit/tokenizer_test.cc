// Tokenizers: a byte-level BPE trained on the licence texts every Debian system has, read back as
// the tokenizer.json it writes, round-trips them and random UTF-8 (and bytes that are not UTF-8);
// a hand-written tokenizer.json gives the ids its merges say; added tokens split the text; Llama 3's
// pre-tokenizer layout and ignore_merges; a SentencePiece model trained here round-trips too.
#include "common/data/tokenizer.h"

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <random>
#include <cstdlib>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "common/data/prepare.h"
#include "common/data/token_data.h"
#include "common/files.h"

namespace ltrain {
namespace {

namespace fs = std::filesystem;

std::vector<std::string> LicenceTexts() {
  std::vector<std::string> out;
  std::vector<fs::path> paths;
  for (const auto& e : fs::directory_iterator("/usr/share/common-licenses")) {
    if (e.is_regular_file()) paths.push_back(e.path());
  }
  std::sort(paths.begin(), paths.end());
  for (const fs::path& p : paths) {
    std::ifstream in(p, std::ios::binary);
    out.emplace_back((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  }
  return out;
}

// Random text of code points from every UTF-8 length: ASCII, Latin, Greek, CJK, emoji, combining
// marks and whitespace runs.
std::string RandomUtf8(std::mt19937& rng, int chars) {
  const std::vector<std::pair<uint32_t, uint32_t>> ranges = {
      {0x20, 0x7E}, {0x0A, 0x0A}, {0x09, 0x09}, {0xA0, 0x24F}, {0x370, 0x3FF}, {0x300, 0x36F},
      {0x4E00, 0x4FFF}, {0x1F600, 0x1F64F}, {0x3000, 0x3000}};
  std::string out;
  for (int i = 0; i < chars; ++i) {
    const auto& r = ranges[rng() % ranges.size()];
    const uint32_t cp = r.first + rng() % (r.second - r.first + 1);
    if (cp < 0x80) {
      out += static_cast<char>(cp);
    } else if (cp < 0x800) {
      out += static_cast<char>(0xC0 | (cp >> 6));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    } else if (cp < 0x10000) {
      out += static_cast<char>(0xE0 | (cp >> 12));
      out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    } else {
      out += static_cast<char>(0xF0 | (cp >> 18));
      out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
      out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    }
  }
  return out;
}

class TokenizerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("ltrain_tokenizer_" + std::to_string(::getpid()) + "_" +
                                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::unique_ptr<TextTokenizer> LoadJson(const std::string& json) {
    const std::string path = (dir_ / "tokenizer.json").string();
    EXPECT_TRUE(WriteFileAtomically(path, json).ok());
    StatusOr<std::unique_ptr<TextTokenizer>> t = TextTokenizer::Load(path);
    EXPECT_TRUE(t.ok()) << t.status().ToString();
    return t.ok() ? std::move(t).value() : nullptr;
  }

  fs::path dir_;
};

TEST_F(TokenizerTest, TrainedBpeRoundTripsTheLicenceTextsAndRandomText) {
  const std::vector<std::string> texts = LicenceTexts();
  ASSERT_GE(texts.size(), 5u) << "/usr/share/common-licenses (package base-files)";
  std::vector<std::string_view> views(texts.begin(), texts.end());
  int64_t calls = 0;
  StatusOr<std::string> json = TrainByteLevelBpe(views, 1024, 2, [&](int64_t, int64_t) { ++calls; });
  ASSERT_TRUE(json.ok()) << json.status().ToString();
  EXPECT_EQ(calls, 1024 - 257);
  std::unique_ptr<TextTokenizer> t = LoadJson(*json);
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(t->kind(), "huggingface");
  EXPECT_EQ(t->vocab_size(), 1024);
  EXPECT_EQ(t->end_of_text(), 1023);
  int64_t bytes = 0, tokens = 0;
  for (const std::string& text : texts) {
    std::vector<uint32_t> ids = t->Encode(text);
    for (uint32_t id : ids) ASSERT_LT(id, 1024u);
    EXPECT_EQ(t->Decode(ids), text);
    bytes += static_cast<int64_t>(text.size());
    tokens += static_cast<int64_t>(ids.size());
  }
  EXPECT_LT(tokens * 3, bytes) << "merges learned on the text compress it";
  std::mt19937 rng(5);
  for (int i = 0; i < 200; ++i) {
    const std::string text = RandomUtf8(rng, 1 + static_cast<int>(rng() % 60));
    EXPECT_EQ(t->Decode(t->Encode(text)), text);
  }
  // Bytes that are no UTF-8 at all survive too (byte-level).
  const std::string raw = std::string("ok \xff\xfe\x80 fine \xc3", 13);
  EXPECT_EQ(t->Decode(t->Encode(raw)), raw);
  // The end-of-text token inside text is one id.
  std::vector<uint32_t> ids = t->Encode("GNU<|endoftext|>GNU");
  EXPECT_NE(std::find(ids.begin(), ids.end(), 1023u), ids.end());
}

// A GPT-2-style tokenizer.json written out by hand: pre-tokens by GPT-2's regex, merges by rank.
TEST_F(TokenizerTest, HandWrittenTokenizerJsonGivesTheIdsItsMergesSay) {
  std::unique_ptr<TextTokenizer> t = LoadJson(R"({
    "added_tokens": [{"id": 15, "content": "<|endoftext|>", "special": true}],
    "normalizer": null,
    "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
    "decoder": {"type": "ByteLevel"},
    "model": {"type": "BPE", "vocab": {"h": 0, "e": 1, "l": 2, "o": 3, "\u0120": 4, "w": 5, "r": 6, "d": 7,
              "he": 8, "ll": 9, "hell": 10, "hello": 11, "\u0120w": 12, "or": 13, "\u0120wor": 14},
              "merges": ["h e", "l l", "he ll", "hell o", "\u0120 w", "o r", "\u0120w or"]}})");
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(t->Encode("hello world"), (std::vector<uint32_t>{11, 14, 2, 7}));
  EXPECT_EQ(t->Encode("hello<|endoftext|>hello"), (std::vector<uint32_t>{11, 15, 11}));
  EXPECT_EQ(t->Decode({11, 14, 2, 7}), "hello world");
  EXPECT_EQ(t->vocab_size(), 16);
  EXPECT_EQ(t->end_of_text(), 15);
}

// Letters and digits of scripts new in Unicode 16 (Garay: letter U+10D7C, digits U+10D40-10D49) are
// \p{L} and \p{N} as they are to Hugging Face tokenizers, though Debian 12's PCRE2 predates them: a
// word with one is one pre-token, which a trained BPE merges into one id.
TEST_F(TokenizerTest, LettersAndDigitsOfUnicodeSixteenAreWordCharacters) {
  const std::string word = "ab\xF0\x90\xB5\xBC" "cd", digits = "\xF0\x90\xB5\x80\xF0\x90\xB5\x81";
  std::string text;
  for (int i = 0; i < 200; ++i) text += word + " " + digits + " ";
  std::vector<std::string_view> views = {text};
  StatusOr<std::string> json = TrainByteLevelBpe(views, 300, 1, nullptr);
  ASSERT_TRUE(json.ok()) << json.status().ToString();
  std::unique_ptr<TextTokenizer> t = LoadJson(*json);
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(t->Encode(word).size(), 1u) << "the letter U+10D7C split the word";
  EXPECT_EQ(t->Encode(digits).size(), 1u) << "the digits U+10D40 and U+10D41 are not one number";
  EXPECT_EQ(t->Decode(t->Encode(word + " " + digits)), word + " " + digits);
}

// Llama 3's layout: a Split pre-tokenizer with its own regex, ByteLevel without one, and
// ignore_merges (a pre-token in the vocabulary is one id whatever the merges).
TEST_F(TokenizerTest, LlamaThreeLayoutAndIgnoreMerges) {
  std::unique_ptr<TextTokenizer> t = LoadJson(R"({
    "added_tokens": [{"id": 9, "content": "<|begin_of_text|>", "special": true}],
    "normalizer": null,
    "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
      {"type": "Split", "pattern": {"Regex": "[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"},
       "behavior": "Isolated", "invert": false},
      {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false}]},
    "model": {"type": "BPE", "ignore_merges": true, "vocab": {"a": 0, "b": 1, "\u0120": 2, "1": 3, "ab": 4,
              "\u0120ab": 5, "abab": 6, "2": 7, "3": 8}, "merges": ["a b", "\u0120 ab"]}})");
  ASSERT_NE(t, nullptr);
  // "abab" is in the vocabulary though no merge makes it; digits go in threes.
  EXPECT_EQ(t->Encode("abab ab 1231"), (std::vector<uint32_t>{6, 5, 2, 3, 7, 8, 3}));
  EXPECT_EQ(t->Decode(t->Encode("abab ab 1231")), "abab ab 1231");
}

// A model's directory is its tokenizer.json; Llama 3's post-processor (a template that puts
// <|begin_of_text|> before each text, inside a Sequence) gives the id that begins a document, and
// `ltrain data prepare --tokenizer DIR` puts it there and records the directory.
TEST_F(TokenizerTest, AModelDirectorysTokenizerBeginsEachDocumentWhereItsTemplateSays) {
  const std::string json = R"({
    "added_tokens": [{"id": 9, "content": "<|begin_of_text|>", "special": true},
                     {"id": 10, "content": "<|end_of_text|>", "special": true}],
    "normalizer": null,
    "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
    "post_processor": {"type": "Sequence", "processors": [
      {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": false, "use_regex": true},
      {"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 0}},
        {"Sequence": {"id": "A", "type_id": 0}}], "pair": [],
       "special_tokens": {"<|begin_of_text|>": {"id": "<|begin_of_text|>", "ids": [9], "tokens": ["<|begin_of_text|>"]}}}]},
    "model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "c": 2, "\u0120": 3, "ab": 4}, "merges": ["a b"]}})";
  fs::create_directories(dir_ / "model");
  ASSERT_TRUE(WriteFileAtomically((dir_ / "model" / "tokenizer.json").string(), json).ok());
  StatusOr<std::unique_ptr<TextTokenizer>> t = TextTokenizer::Load((dir_ / "model").string());
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  EXPECT_EQ((*t)->begin_of_text(), 9);
  EXPECT_EQ((*t)->end_of_text(), 10);
  EXPECT_EQ((*t)->Encode("ab c"), (std::vector<uint32_t>{4, 3, 2}));  // the template is the caller's to apply
  EXPECT_FALSE(TextTokenizer::Load(dir_.string() + "/nothing").ok());

  std::string text;
  for (int i = 0; i < 600; ++i) text += "ab c ";
  ASSERT_TRUE(WriteFileAtomically((dir_ / "a.txt").string(), text).ok());
  ASSERT_TRUE(WriteFileAtomically((dir_ / "b.txt").string(), "cab ba").ok());
  PrepareOptions o;
  o.inputs = {(dir_ / "a.txt").string(), (dir_ / "b.txt").string()};
  o.output_dir = (dir_ / "out").string();
  o.tokenizer = (dir_ / "model").string();
  o.val_fraction = 0;
  o.threads = 1;
  StatusOr<PrepareStats> stats = PrepareData(o);
  ASSERT_TRUE(stats.ok()) << stats.status().ToString();
  EXPECT_EQ(stats->info.tokenizer_from, (dir_ / "model").string());
  StatusOr<TokenDataset> train = TokenDataset::OpenSplit(o.output_dir, "train");
  ASSERT_TRUE(train.ok()) << train.status().ToString();
  // Each document: <|begin_of_text|>, its tokens, <|end_of_text|>.
  EXPECT_EQ(train->token(0), 9u);
  EXPECT_EQ(train->token(train->size() - 1), 10u);
  int begins = 0;
  for (int64_t i = 0; i < train->size(); ++i) begins += train->token(i) == 9;
  EXPECT_EQ(begins, 2);
}

// Qwen's tokenizer.json composes the text (NFC) before splitting it: a letter and its combining accent
// are the precomposed letter's ids; added tokens are matched on the raw text as before.
TEST_F(TokenizerTest, AnNfcNormalizerComposesTheText) {
  const std::string text = "caf\u00e9 na\u00efve r\u00e9sum\u00e9 \u00c5ngstr\u00f6m<|endoftext|>";
  std::vector<std::string_view> views = {text, text};
  StatusOr<std::string> json = TrainByteLevelBpe(views, 300, 2, [](int64_t, int64_t) {});
  ASSERT_TRUE(json.ok()) << json.status().ToString();
  std::string nfc = *json;
  const size_t at = nfc.find("\"normalizer\": null");
  ASSERT_NE(at, std::string::npos) << nfc.substr(0, 400);
  nfc.replace(at, 18, R"("normalizer": {"type": "NFC"})");
  std::unique_ptr<TextTokenizer> plain = LoadJson(*json), composing = LoadJson(nfc);
  ASSERT_NE(composing, nullptr);
  // e + U+0301, i + U+0308, A + U+030A, o + U+0308.
  const std::string decomposed = "cafe\u0301 nai\u0308ve re\u0301sume\u0301 A\u030angstro\u0308m<|endoftext|>";
  EXPECT_EQ(composing->Encode(decomposed), plain->Encode(text));
  EXPECT_EQ(composing->Encode(text), plain->Encode(text));
  EXPECT_NE(plain->Encode(decomposed), plain->Encode(text));
  EXPECT_EQ(composing->Decode(composing->Encode(decomposed)), text);
  // Bytes that are not UTF-8 pass through unchanged.
  const std::string raw = std::string("ok \xff\xfe\x80 e\xcc\x81", 10);
  EXPECT_EQ(composing->Decode(composing->Encode(raw)), raw);
  // Other normalizers are refused, naming them.
  nfc.replace(nfc.find("\"NFC\""), 5, "\"NFKD\"");
  ASSERT_TRUE(WriteFileAtomically((dir_ / "nfkd.json").string(), nfc).ok());
  StatusOr<std::unique_ptr<TextTokenizer>> refused = TextTokenizer::Load((dir_ / "nfkd.json").string());
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("normalizer NFKD is not supported"), std::string::npos)
      << refused.status().message();
}

TEST_F(TokenizerTest, UnsupportedFilesAreRefusedSayingWhy) {
  const std::string wordpiece = (dir_ / "wp.json").string();
  ASSERT_TRUE(WriteFileAtomically(wordpiece, R"({"model": {"type": "WordPiece", "vocab": {}}})").ok());
  StatusOr<std::unique_ptr<TextTokenizer>> t = TextTokenizer::Load(wordpiece);
  ASSERT_FALSE(t.ok());
  EXPECT_NE(t.status().message().find("model type WordPiece is not supported"), std::string::npos)
      << t.status().message();
  const std::string junk = (dir_ / "junk.model").string();
  ASSERT_TRUE(WriteFileAtomically(junk, "not a model").ok());
  t = TextTokenizer::Load(junk);
  ASSERT_FALSE(t.ok());
  EXPECT_NE(t.status().message().find("as a SentencePiece model (nor is it a tokenizer.json)"), std::string::npos)
      << t.status().message();
}

// SentencePiece, through its library loaded apart from the process's protobuf.
TEST_F(TokenizerTest, SentencePieceModelRoundTrips) {
#if defined(__SANITIZE_ADDRESS__)
  GTEST_SKIP() << "SentencePiece is not loaded in a sanitizer build (its library needs RTLD_DEEPBIND)";
#endif
  const std::string corpus = (dir_ / "corpus.txt").string();
  std::string text;
  for (const std::string& t : LicenceTexts()) text += t;
  ASSERT_TRUE(WriteFileAtomically(corpus, text).ok());
  const std::string prefix = (dir_ / "sp").string();
  // SentencePiece's own trainer (Debian's package sentencepiece), as a user would make a model.
  const std::string train = "spm_train --input=" + corpus + " --model_prefix=" + prefix +
                            " --vocab_size=400 --model_type=bpe --byte_fallback=true --normalization_rule_name=identity"
                            " --add_dummy_prefix=false --remove_extra_whitespaces=false --minloglevel=2"
                            " --input_sentence_size=20000 > " + (dir_ / "spm_train.log").string() + " 2>&1";
  ASSERT_EQ(std::system(train.c_str()), 0) << "spm_train (Debian's package sentencepiece) failed or is missing";
  StatusOr<std::unique_ptr<TextTokenizer>> t = TextTokenizer::Load(prefix + ".model");
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  EXPECT_EQ((*t)->kind(), "sentencepiece");
  EXPECT_EQ((*t)->vocab_size(), 400);
  const std::string sample = "Everyone is permitted to copy and distribute verbatim copies";
  std::vector<uint32_t> ids = (*t)->Encode(sample);
  EXPECT_LT(ids.size(), sample.size()) << "pieces of several characters, not bytes";
  EXPECT_EQ((*t)->Decode(ids), sample);
  EXPECT_EQ((*t)->Decode((*t)->Encode(text.substr(0, 5000))), text.substr(0, 5000));
}

}  // namespace
}  // namespace ltrain
