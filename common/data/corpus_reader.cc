#include "common/data/corpus_reader.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>
#include <zstd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <simdjson.h>

namespace ltrain {

class ByteSource {
 public:
  virtual ~ByteSource() = default;
  // Up to `n` bytes into `out`; 0 at the end.
  virtual StatusOr<size_t> Read(char* out, size_t n) = 0;
  // Bytes of the input as stored read so far.
  virtual int64_t consumed() const = 0;
};

namespace {

constexpr size_t kReadBytes = size_t{1} << 20;
// A text piece is cut at a line that starts with a non-space character; where none comes for this
// many times the piece size (a file of indented lines), at the last line end.
constexpr size_t kPieceCapFactor = 16;

std::string ErrnoText() { return std::strerror(errno); }

class FdSource final : public ByteSource {
 public:
  FdSource(int fd, bool owned, std::string name) : fd_(fd), owned_(owned), name_(std::move(name)) {}
  ~FdSource() override {
    if (owned_) ::close(fd_);
  }

  // The first bytes, kept to be read again (what the stream is: zstd, gzip or as it is).
  StatusOr<std::string> Peek(size_t n) {
    while (peeked_.size() < n) {
      char buf[16];
      const ssize_t got = ::read(fd_, buf, std::min(sizeof(buf), n - peeked_.size()));
      if (got < 0 && errno == EINTR) continue;
      if (got < 0) return InvalidArgument("cannot read " + name_ + ": " + ErrnoText());
      if (got == 0) break;
      peeked_.append(buf, static_cast<size_t>(got));
      consumed_ += got;
    }
    return peeked_;
  }

  StatusOr<size_t> Read(char* out, size_t n) override {
    if (peek_at_ < peeked_.size()) {
      const size_t k = std::min(n, peeked_.size() - peek_at_);
      std::memcpy(out, peeked_.data() + peek_at_, k);
      peek_at_ += k;
      return k;
    }
    while (true) {
      const ssize_t got = ::read(fd_, out, n);
      if (got < 0 && errno == EINTR) continue;
      if (got < 0) return InvalidArgument("cannot read " + name_ + ": " + ErrnoText());
      consumed_ += got;
      return static_cast<size_t>(got);
    }
  }

  int64_t consumed() const override { return consumed_; }

 private:
  int fd_;
  bool owned_;
  std::string name_;
  std::string peeked_;
  size_t peek_at_ = 0;
  int64_t consumed_ = 0;
};

class ZstdSource final : public ByteSource {
 public:
  ZstdSource(std::unique_ptr<ByteSource> raw, std::string name)
      : raw_(std::move(raw)), name_(std::move(name)), ctx_(ZSTD_createDCtx()), in_(ZSTD_DStreamInSize()) {}
  ~ZstdSource() override { ZSTD_freeDCtx(ctx_); }

  StatusOr<size_t> Read(char* out, size_t n) override {
    ZSTD_outBuffer ob{out, n, 0};
    while (ob.pos == 0) {
      if (ib_.pos == ib_.size && !raw_end_) {
        LTRAIN_ASSIGN_OR_RETURN(size_t got, raw_->Read(in_.data(), in_.size()));
        if (got == 0) {
          raw_end_ = true;
        } else {
          ib_ = ZSTD_inBuffer{in_.data(), got, 0};
        }
      }
      if (ib_.pos == ib_.size && raw_end_) {
        if (last_ == 0) return size_t{0};
        last_ = ZSTD_decompressStream(ctx_, &ob, &ib_);
        if (ZSTD_isError(last_)) return Broken(last_);
        if (ob.pos == 0) {
          return InvalidArgument(name_ + ": the zstd stream ends early after " + std::to_string(raw_->consumed()) +
                                 " bytes (a truncated file?): nothing of it was prepared");
        }
        break;
      }
      last_ = ZSTD_decompressStream(ctx_, &ob, &ib_);
      if (ZSTD_isError(last_)) return Broken(last_);
    }
    return ob.pos;
  }

  int64_t consumed() const override { return raw_->consumed(); }

 private:
  Status Broken(size_t code) const {
    return InvalidArgument(name_ + ": not a valid zstd stream after " + std::to_string(raw_->consumed()) +
                           " bytes (" + ZSTD_getErrorName(code) + ")");
  }

  std::unique_ptr<ByteSource> raw_;
  std::string name_;
  ZSTD_DCtx* ctx_;
  std::vector<char> in_;
  ZSTD_inBuffer ib_{nullptr, 0, 0};
  size_t last_ = 1;  // what ZSTD_decompressStream said last: 0 at the end of a frame
  bool raw_end_ = false;
};

class GzipSource final : public ByteSource {
 public:
  GzipSource(std::unique_ptr<ByteSource> raw, std::string name) : raw_(std::move(raw)), name_(std::move(name)), in_(kReadBytes) {
    std::memset(&zs_, 0, sizeof(zs_));
    ok_ = inflateInit2(&zs_, 15 + 32) == Z_OK;  // gzip or zlib headers
  }
  ~GzipSource() override {
    if (ok_) inflateEnd(&zs_);
  }

  StatusOr<size_t> Read(char* out, size_t n) override {
    if (!ok_) return Internal("cannot start zlib for " + name_);
    const uInt room = static_cast<uInt>(std::min<size_t>(n, 1u << 30));
    zs_.next_out = reinterpret_cast<Bytef*>(out);
    zs_.avail_out = room;
    while (zs_.avail_out == room) {  // nothing given yet
      if (zs_.avail_in == 0 && !raw_end_) {
        LTRAIN_ASSIGN_OR_RETURN(size_t got, raw_->Read(in_.data(), in_.size()));
        if (got == 0) raw_end_ = true;
        zs_.next_in = reinterpret_cast<Bytef*>(in_.data());
        zs_.avail_in = static_cast<uInt>(got);
      }
      if (zs_.avail_in == 0 && raw_end_) {
        if (member_ended_) return size_t{0};
        return InvalidArgument(name_ + ": the gzip stream ends early after " + std::to_string(raw_->consumed()) +
                               " bytes (a truncated file?): nothing of it was prepared");
      }
      member_ended_ = false;
      const int rc = inflate(&zs_, Z_NO_FLUSH);
      if (rc == Z_STREAM_END) {
        member_ended_ = true;  // another member may follow (concatenated gzip files)
        inflateReset(&zs_);
      } else if (rc != Z_OK && rc != Z_BUF_ERROR) {
        return InvalidArgument(name_ + ": not a valid gzip stream after " + std::to_string(raw_->consumed()) +
                               " bytes (" + (zs_.msg ? std::string(zs_.msg) : "zlib error " + std::to_string(rc)) + ")");
      }
    }
    return static_cast<size_t>(room - zs_.avail_out);
  }

  int64_t consumed() const override { return raw_->consumed(); }

 private:
  std::unique_ptr<ByteSource> raw_;
  std::string name_;
  std::vector<char> in_;
  z_stream zs_;
  bool ok_ = false;
  bool raw_end_ = false;
  bool member_ended_ = false;
};

bool EndsWith(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// Whether a file of this name holds JSON Lines: .jsonl or .ndjson, before any compression suffix.
bool NamedJsonLines(std::string name) {
  for (const char* suffix : {".zst", ".zstd", ".gz"}) {
    if (EndsWith(name, suffix)) name.resize(name.size() - std::strlen(suffix));
  }
  return EndsWith(name, ".jsonl") || EndsWith(name, ".ndjson");
}

// Bytes of `text` outside UTF-8 (NUL counted as outside: no text holds it), and where the first is.
int64_t InvalidUtf8Bytes(std::string_view text, size_t* first) {
  int64_t invalid = 0;
  *first = text.size();
  const auto* p = reinterpret_cast<const unsigned char*>(text.data());
  const size_t n = text.size();
  for (size_t i = 0; i < n;) {
    const unsigned char c = p[i];
    size_t len = 0;
    if (c == 0) {
      len = 0;
    } else if (c < 0x80) {
      len = 1;
    } else if (c >= 0xC2 && c <= 0xDF) {
      len = 2;
    } else if (c >= 0xE0 && c <= 0xEF) {
      len = 3;
    } else if (c >= 0xF0 && c <= 0xF4) {
      len = 4;
    }
    bool ok = len > 0 && i + len <= n;
    for (size_t k = 1; ok && k < len; ++k) ok = (p[i + k] & 0xC0) == 0x80;
    if (ok && len == 3) {
      ok = !(c == 0xE0 && p[i + 1] < 0xA0) && !(c == 0xED && p[i + 1] >= 0xA0);
    } else if (ok && len == 4) {
      ok = !(c == 0xF0 && p[i + 1] < 0x90) && !(c == 0xF4 && p[i + 1] >= 0x90);
    }
    if (ok) {
      i += len;
    } else {
      if (invalid == 0) *first = i;
      ++invalid;
      ++i;
    }
  }
  return invalid;
}

// Where a text piece may end: after a line end that follows a character other than space, before a
// character that is neither space nor the continuation of a UTF-8 sequence. The line end is then a
// pre-token of its own in the whole text as in the piece (a run of spaces before it would be split
// differently by the regexes' look-ahead at the piece's end).
bool CutsBefore(std::string_view text, size_t at) {
  auto space = [&](size_t i) { return std::isspace(static_cast<unsigned char>(text[i])) != 0; };
  return at >= 2 && at < text.size() && text[at - 1] == '\n' && !space(at - 2) && !space(at) &&
         (static_cast<unsigned char>(text[at]) & 0xC0) != 0x80;
}

const char* TypeName(simdjson::dom::element_type type) {
  switch (type) {
    case simdjson::dom::element_type::ARRAY: return "an array";
    case simdjson::dom::element_type::OBJECT: return "an object";
    case simdjson::dom::element_type::INT64:
    case simdjson::dom::element_type::UINT64:
    case simdjson::dom::element_type::DOUBLE: return "a number";
    case simdjson::dom::element_type::STRING: return "a string";
    case simdjson::dom::element_type::BOOL: return "a boolean";
    case simdjson::dom::element_type::NULL_VALUE: return "null";
  }
  return "a value";
}

}  // namespace

struct CorpusReader::Parser {
  simdjson::dom::parser dom;
};

StatusOr<InputFormat> ParseInputFormat(const std::string& name) {
  if (name == "auto") return InputFormat::kAuto;
  if (name == "text") return InputFormat::kText;
  if (name == "jsonl") return InputFormat::kJsonl;
  return InvalidArgument("--format " + name + " is not known: auto (by name), text or jsonl");
}

CorpusReader::CorpusReader(std::vector<std::string> inputs, const CorpusOptions& options)
    : inputs_(std::move(inputs)), options_(options), documents_(inputs_.size(), 0), parser_(new Parser) {}

CorpusReader::~CorpusReader() = default;

StatusOr<std::unique_ptr<CorpusReader>> CorpusReader::Open(std::vector<std::string> inputs,
                                                         const CorpusOptions& options) {
  if (inputs.empty()) return InvalidArgument("no input given");
  if (options.jsonl_field.empty()) return InvalidArgument("--jsonl-field is empty: give the records' text key");
  if (options.piece_bytes == 0) return InvalidArgument("the piece size must be positive");
  int64_t total = 0;
  bool known = true;
  for (const std::string& input : inputs) {
    if (input == "-") {
      known = false;
      continue;
    }
    struct stat st {};
    if (::stat(input.c_str(), &st) != 0) return NotFound("cannot read input " + input + ": " + ErrnoText());
    if (st.st_size == 0) return InvalidArgument("input " + input + " is empty: give files with text");
    total += st.st_size;
  }
  std::unique_ptr<CorpusReader> reader(new CorpusReader(std::move(inputs), options));
  reader->total_bytes_ = known ? total : 0;
  return reader;
}

int64_t CorpusReader::bytes_read() const { return done_bytes_ + (source_ ? source_->consumed() : 0); }

std::string CorpusReader::Where() const {
  return (inputs_[current_] == "-" ? std::string("standard input") : inputs_[current_]) + " line " +
         std::to_string(line_);
}

Status CorpusReader::OpenInput(size_t i) {
  const std::string& name = inputs_[i];
  const std::string shown = name == "-" ? "standard input" : name;
  int fd = 0;
  if (name != "-") {
    fd = ::open(name.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return NotFound("cannot open input " + name + ": " + ErrnoText());
  }
  auto raw = std::make_unique<FdSource>(fd, name != "-", shown);
  LTRAIN_ASSIGN_OR_RETURN(std::string magic, raw->Peek(4));
  unsigned char m[4] = {0, 0, 0, 0};
  std::memcpy(m, magic.data(), std::min<size_t>(magic.size(), sizeof(m)));
  if (magic.size() == 4 && m[0] == 0x28 && m[1] == 0xB5 && m[2] == 0x2F && m[3] == 0xFD) {
    source_ = std::make_unique<ZstdSource>(std::move(raw), shown);
  } else if (magic.size() >= 2 && m[0] == 0x1F && m[1] == 0x8B) {
    source_ = std::make_unique<GzipSource>(std::move(raw), shown);
  } else {
    source_ = std::move(raw);
  }
  switch (options_.format) {
    case InputFormat::kText: jsonl_ = false; break;
    case InputFormat::kJsonl: jsonl_ = true; break;
    case InputFormat::kAuto: jsonl_ = name == "-" || NamedJsonLines(name); break;
  }
  if (options_.sft && !jsonl_) {
    return InvalidArgument(shown + ": --sft reads JSON Lines of {\"prompt\": ..., \"response\": ...}; this input is "
                           "read as text (name it .jsonl, or give --format jsonl)");
  }
  buffer_.clear();
  begin_ = 0;
  at_end_ = false;
  line_ = 0;
  in_document_ = false;
  invalid_utf8_ = 0;
  checked_bytes_ = 0;
  open_ = true;
  return Status::Ok();
}

// Reads more of the input onto the buffer (compacting it first); false at the end.
StatusOr<bool> ReadMore(ByteSource* source, std::string* buffer, size_t* begin, bool* at_end) {
  if (*at_end) return false;
  if (*begin > 0 && *begin >= buffer->size() / 2) {
    buffer->erase(0, *begin);
    *begin = 0;
  }
  const size_t had = buffer->size();
  buffer->resize(had + kReadBytes);
  StatusOr<size_t> got = source->Read(buffer->data() + had, kReadBytes);
  if (!got.ok()) {
    buffer->resize(had);
    return got.status();
  }
  buffer->resize(had + *got);
  if (*got == 0) *at_end = true;
  return *got > 0;
}

StatusOr<bool> CorpusReader::NextLine(std::string_view* line) {
  size_t searched = begin_;
  while (true) {
    const size_t nl = buffer_.find('\n', searched);
    if (nl != std::string::npos) {
      *line = std::string_view(buffer_).substr(begin_, nl - begin_);
      begin_ = nl + 1;
      ++line_;
      return true;
    }
    searched = buffer_.size() - begin_;  // relative: the buffer may move
    LTRAIN_ASSIGN_OR_RETURN(bool more, ReadMore(source_.get(), &buffer_, &begin_, &at_end_));
    searched += begin_;
    if (!more) {
      if (begin_ == buffer_.size()) return false;
      *line = std::string_view(buffer_).substr(begin_);
      begin_ = buffer_.size();
      ++line_;
      return true;
    }
  }
}

StatusOr<bool> CorpusReader::NextRecord(TextPiece* piece) {
  std::string_view line;
  while (true) {
    LTRAIN_ASSIGN_OR_RETURN(bool got, NextLine(&line));
    if (!got) return false;
    if (line.find_first_not_of(" \t\r") != std::string_view::npos) break;  // blank lines are no records
  }
  padded_.resize(line.size() + simdjson::SIMDJSON_PADDING);
  std::memcpy(padded_.data(), line.data(), line.size());
  simdjson::dom::element record;
  if (auto error = parser_->dom.parse(padded_.data(), line.size(), false).get(record)) {
    return InvalidArgument(Where() + ": not a JSON record (" + simdjson::error_message(error) +
                           "); JSON Lines has one object per line (give --format text to read the file as text)");
  }
  simdjson::dom::object object;
  if (record.get(object)) {
    return InvalidArgument(Where() + ": the record is " + TypeName(record.type()) + ", not an object with a \"" +
                           options_.jsonl_field + "\" field");
  }
  // A string field of the record, or an error naming it and the record's keys.
  auto field_text = [&](const std::string& name, std::string_view* text) -> Status {
    simdjson::dom::element field;
    if (object.at_key(name).get(field)) {
      std::string keys;
      int shown = 0;
      for (auto [key, value] : object) {
        if (shown++ == 8) {
          keys += ", ...";
          break;
        }
        keys += (keys.empty() ? "" : ", ") + std::string(key);
      }
      return InvalidArgument(Where() + ": the record has no \"" + name + "\" field (its keys: " +
                             (keys.empty() ? "none" : keys) + ")" +
                             (options_.sft ? "; --sft reads {\"prompt\": ..., \"response\": ...}"
                                           : "; give --jsonl-field KEY"));
    }
    if (field.get(*text)) {
      return InvalidArgument(Where() + ": \"" + name + "\" is " + TypeName(field.type()) + ", not a string");
    }
    return Status::Ok();
  };
  std::string_view text;
  if (options_.sft) {
    std::string_view prompt, response;
    LTRAIN_RETURN_IF_ERROR(field_text("prompt", &prompt));
    LTRAIN_RETURN_IF_ERROR(field_text("response", &response));
    if (response.empty()) return InvalidArgument(Where() + ": the record's \"response\" is empty: nothing to learn");
    piece->text.assign(prompt.data(), prompt.size());
    piece->text.append(response.data(), response.size());
    piece->prompt_bytes = prompt.size();
    text = piece->text;
  } else {
    LTRAIN_RETURN_IF_ERROR(field_text(options_.jsonl_field, &text));
    piece->text.assign(text.data(), text.size());
    piece->prompt_bytes = 0;
  }
  piece->input = static_cast<int>(current_);
  piece->line = line_;
  piece->document_start = true;
  piece->document_end = true;
  ++documents_[current_];
  text_bytes_ += static_cast<int64_t>(text.size());
  return true;
}

Status CorpusReader::CheckUtf8(std::string_view text) {
  checked_bytes_ += static_cast<int64_t>(text.size());
  if (text.find('\0') == std::string_view::npos && simdjson::validate_utf8(text.data(), text.size())) {
    return Status::Ok();
  }
  size_t first = 0;
  invalid_utf8_ += InvalidUtf8Bytes(text, &first);
  if (invalid_utf8_ < kMinInvalidUtf8Bytes ||
      static_cast<double>(invalid_utf8_) <= kMaxInvalidUtf8Share * static_cast<double>(checked_bytes_)) {
    return Status::Ok();
  }
  const int64_t at_line = line_ + std::count(text.begin(), text.begin() + static_cast<std::ptrdiff_t>(first), '\n');
  char share[32];
  std::snprintf(share, sizeof(share), "%.1f%%", 100.0 * static_cast<double>(invalid_utf8_) /
                                                    static_cast<double>(checked_bytes_));
  return InvalidArgument((inputs_[current_] == "-" ? std::string("standard input") : inputs_[current_]) + " line " +
                         std::to_string(at_line + 1) + ": not text: " + share + " of its first " +
                         std::to_string(checked_bytes_) + " bytes are not UTF-8 (a binary file?); give text files, "
                         "or JSON Lines");
}

StatusOr<bool> CorpusReader::NextTextPiece(TextPiece* piece) {
  const size_t want = options_.piece_bytes;
  size_t cut = std::string::npos;
  size_t searched = 0;  // from begin_: places before it cannot cut
  while (true) {
    const size_t have = buffer_.size() - begin_;
    std::string_view rest = std::string_view(buffer_).substr(begin_);
    if (have > want) {
      for (size_t at = std::max(want, searched); at < have; ++at) {
        if (CutsBefore(rest, at)) {
          cut = at;
          break;
        }
      }
      if (cut != std::string::npos) break;
      searched = have;
      if (have >= want * kPieceCapFactor) {
        const size_t nl = rest.rfind('\n');
        cut = nl != std::string_view::npos && nl + 1 < have ? nl + 1 : have;
        break;
      }
    }
    LTRAIN_ASSIGN_OR_RETURN(bool more, ReadMore(source_.get(), &buffer_, &begin_, &at_end_));
    if (!more) {
      if (begin_ == buffer_.size()) {
        if (in_document_) return InvalidArgument("internal: a text document without its end");
        return false;
      }
      cut = buffer_.size() - begin_;
      break;
    }
  }
  std::string_view text = std::string_view(buffer_).substr(begin_, cut);
  LTRAIN_RETURN_IF_ERROR(CheckUtf8(text));
  piece->text.assign(text.data(), text.size());
  piece->input = static_cast<int>(current_);
  piece->line = line_ + 1;
  piece->document_start = !in_document_;
  line_ += std::count(text.begin(), text.end(), '\n');
  begin_ += cut;
  text_bytes_ += static_cast<int64_t>(cut);
  if (begin_ == buffer_.size()) {
    LTRAIN_ASSIGN_OR_RETURN(bool more, ReadMore(source_.get(), &buffer_, &begin_, &at_end_));
    (void)more;
  }
  piece->document_end = begin_ == buffer_.size() && at_end_;
  in_document_ = !piece->document_end;
  if (piece->document_start) ++documents_[current_];
  return true;
}

StatusOr<bool> CorpusReader::Next(TextPiece* piece) {
  while (true) {
    if (!open_) {
      if (current_ >= inputs_.size()) return false;
      LTRAIN_RETURN_IF_ERROR(OpenInput(current_));
    }
    LTRAIN_ASSIGN_OR_RETURN(bool got, jsonl_ ? NextRecord(piece) : NextTextPiece(piece));
    if (got) return true;
    if (documents_[current_] == 0) {
      return InvalidArgument((inputs_[current_] == "-" ? std::string("standard input") : inputs_[current_]) +
                             (jsonl_ ? " holds no JSON record" : " holds no text") + ": give inputs with text");
    }
    done_bytes_ += source_->consumed();
    source_.reset();
    open_ = false;
    ++current_;
  }
}

}  // namespace ltrain
