// The text of a corpus as `ltrain data prepare` reads it: documents in pieces of bounded size, from
// files as corpora come, without holding more than a piece (or one JSON Lines record) at a time.
//
// Inputs:
//   text files      one document each, read in pieces of about CorpusOptions::piece_bytes that
//                   end after a line that ends in a non-space character and before a line that
//                   starts with one (a place no pre-token of GPT-2's or Llama 3's regex crosses, so the
//                   pieces tokenize as the whole does; where no such place comes for 16 pieces, at a
//                   line end)
//   JSON Lines      one document per record, the string field CorpusOptions::jsonl_field ("text");
//                   by name (.jsonl, .ndjson, .json before any compression suffix) or format
//   compressed      zstd and gzip streams, known by their first bytes whatever the name, decompressed
//                   as they are read
//   "-"             standard input (JSON Lines unless the format says text)
// A malformed record, a missing field, a truncated stream, text that is not UTF-8 (beyond
// kMaxInvalidUtf8Share of a file), an input without text: an error that names the input and the line.
// No LibTorch here.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/status.h"

namespace ltrain {

enum class InputFormat { kAuto, kText, kJsonl };

// "auto", "text" or "jsonl"; InvalidArgument otherwise.
StatusOr<InputFormat> ParseInputFormat(const std::string& name);

// A text file with more bytes than this share outside UTF-8 (and at least kMinInvalidUtf8Bytes of
// them: a stray byte of Latin-1 in a short file is text) is taken for a binary file.
inline constexpr double kMaxInvalidUtf8Share = 0.01;
inline constexpr int64_t kMinInvalidUtf8Bytes = 16;

struct CorpusOptions {
  InputFormat format = InputFormat::kAuto;
  std::string jsonl_field = "text";
  // Supervised fine-tuning data: JSON Lines records of "prompt" and "response" strings.
  bool sft = false;
  size_t piece_bytes = size_t{1} << 20;
};

// A piece of one document's text.
struct TextPiece {
  std::string text;
  int input = 0;          // which of the reader's inputs
  int64_t line = 0;       // 1-based: the record's line, or the line a text file's piece starts at
  bool document_start = false;
  bool document_end = false;
  // SFT data: the text is the prompt and then the response; the prompt's bytes come first.
  size_t prompt_bytes = 0;
};

// An input's bytes as read: from the file or standard input, decompressed where they are zstd or gzip.
class ByteSource;

class CorpusReader {
 public:
  // `inputs`: files, or "-" for standard input.
  static StatusOr<std::unique_ptr<CorpusReader>> Open(std::vector<std::string> inputs, const CorpusOptions& options);
  ~CorpusReader();

  // The next piece, in input order; false after the last. InvalidArgument names the input and line.
  StatusOr<bool> Next(TextPiece* piece);

  const std::vector<std::string>& inputs() const { return inputs_; }
  // Bytes of the inputs as stored (compressed where they are), read so far and in all (0: not known,
  // standard input).
  int64_t bytes_read() const;
  int64_t total_bytes() const { return total_bytes_; }
  // Documents read from input `i` so far.
  int64_t documents(size_t i) const { return i < documents_.size() ? documents_[i] : 0; }
  // Bytes of text (decompressed) read so far.
  int64_t text_bytes() const { return text_bytes_; }

 private:
  CorpusReader(std::vector<std::string> inputs, const CorpusOptions& options);
  Status OpenInput(size_t i);
  StatusOr<bool> NextLine(std::string_view* line);
  StatusOr<bool> NextRecord(TextPiece* piece);
  StatusOr<bool> NextTextPiece(TextPiece* piece);
  Status CheckUtf8(std::string_view text);
  std::string Where() const;

  std::vector<std::string> inputs_;
  CorpusOptions options_;
  int64_t total_bytes_ = 0;
  int64_t done_bytes_ = 0;  // of the inputs before the current one
  std::vector<int64_t> documents_;
  int64_t text_bytes_ = 0;

  size_t current_ = 0;
  bool open_ = false;
  bool jsonl_ = false;
  std::unique_ptr<ByteSource> source_;
  std::string buffer_;   // bytes read and not yet consumed: buffer_[begin_, buffer_.size())
  size_t begin_ = 0;
  bool at_end_ = false;  // the source has given its last byte
  int64_t line_ = 0;     // lines consumed from the current input
  bool in_document_ = false;  // a text file's document has begun
  int64_t invalid_utf8_ = 0;  // bytes outside UTF-8 in the current input
  int64_t checked_bytes_ = 0;
  std::string padded_;   // a JSON record with simdjson's padding after it
  struct Parser;
  std::unique_ptr<Parser> parser_;
};

}  // namespace ltrain
