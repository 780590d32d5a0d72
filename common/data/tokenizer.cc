#include "common/data/tokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <dlfcn.h>
#include <pcre2.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <sstream>
#include <thread>
#include <unordered_map>
#include <vector>

#include <nlohmann/json.hpp>
#ifdef LTRAIN_WITH_ICU
#include <unicode/unorm2.h>
#include <unicode/ustring.h>
#endif

#include "common/files.h"

namespace ltrain {
namespace {

using Json = nlohmann::json;

// GPT-2's map of the 256 bytes to printable characters (the byte-level alphabet), as UTF-8.
const std::array<std::string, 256>& ByteChars() {
  static const std::array<std::string, 256> chars = [] {
    std::array<std::string, 256> out;
    std::vector<int> bytes, points;
    auto keep = [&](int from, int to) {
      for (int b = from; b <= to; ++b) bytes.push_back(b);
    };
    keep('!', '~');
    keep(0xA1, 0xAC);
    keep(0xAE, 0xFF);
    points = bytes;
    int extra = 0;
    for (int b = 0; b < 256; ++b) {
      if (std::find(bytes.begin(), bytes.end(), b) == bytes.end()) {
        bytes.push_back(b);
        points.push_back(256 + extra++);
      }
    }
    for (size_t i = 0; i < bytes.size(); ++i) {
      const int cp = points[i];
      std::string utf8;
      if (cp < 0x80) {
        utf8 += static_cast<char>(cp);
      } else {
        utf8 += static_cast<char>(0xC0 | (cp >> 6));
        utf8 += static_cast<char>(0x80 | (cp & 0x3F));
      }
      out[bytes[i]] = utf8;
    }
    return out;
  }();
  return chars;
}

std::string ToByteLevel(std::string_view bytes) {
  const auto& chars = ByteChars();
  std::string out;
  out.reserve(bytes.size() * 2);
  for (unsigned char c : bytes) out += chars[c];
  return out;
}

// Letters and numbers of Unicode 15.1 and 16.0, as PCRE2 class ranges: Hugging Face tokenizers
// knows Unicode 16, Debian 12's PCRE2 (10.42) Unicode 15.0, so that a letter of a script new in 16
// (Garay, U+10D7C) would split a word where tokenizers' own \p{L} keeps it whole. Code points whose
// General_Category is L* (N*) in Unicode 16.0.0 and whose Age is 15.1 or 16.0 (the UCD's
// DerivedAge.txt and DerivedGeneralCategory.txt of 16.0.0).
constexpr const char* kNewLetters =
    "\\x{1C89}-\\x{1C8A}\\x{A7CB}-\\x{A7CD}\\x{A7DA}-\\x{A7DC}\\x{105C0}-\\x{105F3}"
    "\\x{10D4A}-\\x{10D65}\\x{10D6F}-\\x{10D85}\\x{10EC2}-\\x{10EC4}\\x{11380}-\\x{11389}\\x{1138B}"
    "\\x{1138E}\\x{11390}-\\x{113B5}\\x{113B7}\\x{113D1}\\x{113D3}\\x{11BC0}-\\x{11BE0}"
    "\\x{13460}-\\x{143FA}\\x{16100}-\\x{1611D}\\x{16D40}-\\x{16D6C}\\x{18CFF}\\x{1E5D0}-\\x{1E5ED}"
    "\\x{1E5F0}\\x{2EBF0}-\\x{2EE5D}";
constexpr const char* kNewNumbers =
    "\\x{10D40}-\\x{10D49}\\x{116D0}-\\x{116E3}\\x{11BF0}-\\x{11BF9}\\x{16130}-\\x{16139}"
    "\\x{16D70}-\\x{16D79}\\x{1CCF0}-\\x{1CCF9}\\x{1E5F1}-\\x{1E5FA}";

// The pattern with \p{L}, \p{N}, \P{L} and \P{N} widened by kNewLetters and kNewNumbers: outside a
// class \p{L} becomes [\p{L}...] and \P{L} [^\p{L}...]; inside one, \p{L} gains the ranges (a \P
// inside a class, which no released tokenizer uses, stays as it is).
std::string WithUnicode16(const std::string& pattern) {
  std::string out;
  bool in_class = false;
  for (size_t i = 0; i < pattern.size(); ++i) {
    const char c = pattern[i];
    if (c == '\\' && i + 1 < pattern.size()) {
      const std::string_view escape = std::string_view(pattern).substr(i, 5);
      const bool property = escape.size() == 5 && (escape[1] == 'p' || escape[1] == 'P') && escape[2] == '{' &&
                            (escape[3] == 'L' || escape[3] == 'N') && escape[4] == '}';
      if (!property) {
        out.append(pattern, i, 2);
        ++i;
        continue;
      }
      const char* extra = escape[3] == 'L' ? kNewLetters : kNewNumbers;
      const std::string positive = std::string("\\p{") + escape[3] + "}" + extra;
      if (in_class) {
        out += escape[1] == 'p' ? positive : std::string(escape);
      } else {
        out += (escape[1] == 'p' ? "[" : "[^") + positive + "]";
      }
      i += 4;
      continue;
    }
    if (c == '[' && !in_class) {
      in_class = true;
      out += c;
      if (i + 1 < pattern.size() && pattern[i + 1] == '^') out += pattern[++i];
      if (i + 1 < pattern.size() && pattern[i + 1] == ']') out += pattern[++i];  // a literal ] first
      continue;
    }
    if (c == ']' && in_class) in_class = false;
    out += c;
  }
  return out;
}

// A compiled PCRE2 pattern (UTF, Unicode properties, JIT); matching takes per-call match data.
class Regex {
 public:
  static StatusOr<std::unique_ptr<Regex>> Compile(const std::string& pattern) {
    int error = 0;
    PCRE2_SIZE offset = 0;
    const std::string widened = WithUnicode16(pattern);
    pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(widened.data()), widened.size(),
                                     PCRE2_UTF | PCRE2_UCP | PCRE2_MATCH_INVALID_UTF, &error, &offset, nullptr);
    if (code == nullptr) {
      PCRE2_UCHAR message[256];
      pcre2_get_error_message(error, message, sizeof(message));
      return InvalidArgument("the pre-tokenizer's regex does not compile at offset " + std::to_string(offset) + ": " +
                             reinterpret_cast<const char*>(message));
    }
    pcre2_jit_compile(code, PCRE2_JIT_COMPLETE);  // without JIT it still matches, slower
    return std::unique_ptr<Regex>(new Regex(code));
  }
  ~Regex() { pcre2_code_free(code_); }

  // Calls piece(begin, end) for every match and every gap between matches, in order.
  template <typename F>
  void Split(std::string_view text, F&& piece) const {
    pcre2_match_data* data = pcre2_match_data_create_from_pattern(code_, nullptr);
    size_t pos = 0, emitted = 0;
    while (pos <= text.size()) {
      const int rc = pcre2_match(code_, reinterpret_cast<PCRE2_SPTR>(text.data()), text.size(), pos, 0, data, nullptr);
      if (rc < 0) break;
      const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(data);
      const size_t begin = ov[0], end = ov[1];
      if (begin > emitted) piece(emitted, begin);
      if (end > begin) {
        piece(begin, end);
        emitted = end;
        pos = end;
      } else {
        // An empty match: step over one character.
        pos = begin + 1;
        while (pos < text.size() && (static_cast<unsigned char>(text[pos]) & 0xC0) == 0x80) ++pos;
      }
    }
    if (emitted < text.size()) piece(emitted, text.size());
    pcre2_match_data_free(data);
  }

 private:
  explicit Regex(pcre2_code* code) : code_(code) {}
  pcre2_code* code_;
};

class ByteTokenizer : public TextTokenizer {
 public:
  std::vector<uint32_t> Encode(std::string_view text) const override {
    std::vector<uint32_t> ids(text.size());
    for (size_t i = 0; i < text.size(); ++i) ids[i] = static_cast<unsigned char>(text[i]);
    return ids;
  }
  std::string Decode(const std::vector<uint32_t>& ids) const override {
    std::string out;
    for (uint32_t id : ids) out += static_cast<char>(id & 0xFF);
    return out;
  }
  int vocab_size() const override { return 256; }
  std::string kind() const override { return "byte"; }
};

// libltrain_sentencepiece.so (common/data/sentencepiece_shim.cc), loaded once with its symbols kept to
// itself: found through $LTRAIN_SENTENCEPIECE_LIB, the build tree, or lib/ltrain beside the
// installed binaries.
struct SentencePieceLib {
  void* (*load)(const char*, char**) = nullptr;
  void (*free_processor)(void*) = nullptr;
  long (*encode)(void*, const char*, size_t, int**) = nullptr;
  char* (*decode)(void*, const int*, size_t, size_t*) = nullptr;
  int (*piece_size)(void*) = nullptr;
  int (*eos_id)(void*) = nullptr;
  std::string error;  // why it is not there
};

const SentencePieceLib& SentencePiece() {
  static const SentencePieceLib lib = [] {
    SentencePieceLib out;
#if defined(__SANITIZE_ADDRESS__)
    out.error = "SentencePiece is not loaded in a sanitizer build (its library needs RTLD_DEEPBIND)";
    return out;
#else
    std::vector<std::string> candidates;
    if (const char* env = std::getenv("LTRAIN_SENTENCEPIECE_LIB"); env != nullptr && *env != '\0') candidates.push_back(env);
#ifdef LTRAIN_SENTENCEPIECE_BUILD_PATH
    candidates.push_back(LTRAIN_SENTENCEPIECE_BUILD_PATH);
#endif
    char self[4096];
    if (const ssize_t n = ::readlink("/proc/self/exe", self, sizeof(self) - 1); n > 0) {
      std::string dir(self, static_cast<size_t>(n));
      dir = dir.substr(0, dir.rfind('/'));
      candidates.push_back(dir + "/../lib/ltrain/libltrain_sentencepiece.so");
    }
    candidates.push_back("/usr/lib/ltrain/libltrain_sentencepiece.so");
    void* handle = nullptr;
    std::string tried;
    for (const std::string& path : candidates) {
      if (::access(path.c_str(), R_OK) != 0) continue;
      handle = ::dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL | RTLD_DEEPBIND);
      if (handle != nullptr) break;
      tried += std::string(tried.empty() ? "" : "; ") + ::dlerror();
    }
    if (handle == nullptr) {
      out.error = "SentencePiece support (libltrain_sentencepiece.so) is not installed" +
                  (tried.empty() ? std::string() : " or does not load: " + tried) +
                  "; build ltrain with Debian's libsentencepiece-dev, or set LTRAIN_SENTENCEPIECE_LIB";
      return out;
    }
    auto sym = [&](const char* name) { return ::dlsym(handle, name); };
    out.load = reinterpret_cast<decltype(out.load)>(sym("ltrain_sp_load"));
    out.free_processor = reinterpret_cast<decltype(out.free_processor)>(sym("ltrain_sp_free"));
    out.encode = reinterpret_cast<decltype(out.encode)>(sym("ltrain_sp_encode"));
    out.decode = reinterpret_cast<decltype(out.decode)>(sym("ltrain_sp_decode"));
    out.piece_size = reinterpret_cast<decltype(out.piece_size)>(sym("ltrain_sp_piece_size"));
    out.eos_id = reinterpret_cast<decltype(out.eos_id)>(sym("ltrain_sp_eos_id"));
    if (!out.load || !out.free_processor || !out.encode || !out.decode || !out.piece_size || !out.eos_id) {
      out = SentencePieceLib{};
      out.error = "libltrain_sentencepiece.so lacks its functions: a build of another version";
    }
    return out;
#endif
  }();
  return lib;
}

class SentencePieceTokenizer : public TextTokenizer {
 public:
  static StatusOr<std::unique_ptr<TextTokenizer>> Load(const std::string& path) {
    const SentencePieceLib& lib = SentencePiece();
    if (!lib.load) return FailedPrecondition(path + " is a SentencePiece model: " + lib.error);
    char* error = nullptr;
    void* processor = lib.load(path.c_str(), &error);
    if (processor == nullptr) {
      std::string why = error != nullptr ? error : "unknown";
      std::free(error);
      return InvalidArgument("cannot load " + path + " as a SentencePiece model (nor is it a tokenizer.json): " + why);
    }
    auto t = std::unique_ptr<SentencePieceTokenizer>(new SentencePieceTokenizer(processor));
    t->file_ = path;
    return std::unique_ptr<TextTokenizer>(std::move(t));
  }
  ~SentencePieceTokenizer() override { SentencePiece().free_processor(processor_); }

  std::vector<uint32_t> Encode(std::string_view text) const override {
    int* ids = nullptr;
    const long n = SentencePiece().encode(processor_, text.data(), text.size(), &ids);
    std::vector<uint32_t> out;
    if (n > 0) out.assign(ids, ids + n);
    std::free(ids);
    return out;
  }
  std::string Decode(const std::vector<uint32_t>& ids) const override {
    std::vector<int> in(ids.begin(), ids.end());
    size_t length = 0;
    char* text = SentencePiece().decode(processor_, in.data(), in.size(), &length);
    std::string out = text != nullptr ? std::string(text, length) : std::string();
    std::free(text);
    return out;
  }
  int vocab_size() const override { return SentencePiece().piece_size(processor_); }
  std::string kind() const override { return "sentencepiece"; }
  int64_t end_of_text() const override { return SentencePiece().eos_id(processor_); }

 private:
  explicit SentencePieceTokenizer(void* processor) : processor_(processor) {}
  void* processor_;
};

// Unicode's canonical composition (NFC) of UTF-8 text, as tokenizers' NFC normalizer; text that is
// not valid UTF-8 is left as it is. ASCII, and text already composed, cost one pass.
std::string Nfc(std::string_view text) {
#ifdef LTRAIN_WITH_ICU
  if (std::all_of(text.begin(), text.end(), [](char c) { return static_cast<unsigned char>(c) < 0x80; })) {
    return std::string(text);
  }
  UErrorCode error = U_ZERO_ERROR;
  const UNormalizer2* nfc = unorm2_getNFCInstance(&error);
  std::u16string wide(text.size(), u'\0');  // UTF-16 needs at most one unit per UTF-8 byte
  int32_t length = 0;
  u_strFromUTF8(wide.data(), static_cast<int32_t>(wide.size()), &length, text.data(),
                static_cast<int32_t>(text.size()), &error);
  if (U_FAILURE(error)) return std::string(text);
  wide.resize(length);
  if (unorm2_isNormalized(nfc, wide.data(), length, &error) && U_SUCCESS(error)) return std::string(text);
  error = U_ZERO_ERROR;
  std::u16string composed(wide.size() * 3 + 16, u'\0');
  const int32_t n = unorm2_normalize(nfc, wide.data(), length, composed.data(), static_cast<int32_t>(composed.size()),
                                     &error);
  if (U_FAILURE(error)) return std::string(text);
  std::string out(static_cast<size_t>(n) * 3, '\0');
  int32_t bytes = 0;
  u_strToUTF8(out.data(), static_cast<int32_t>(out.size()), &bytes, composed.data(), n, &error);
  if (U_FAILURE(error)) return std::string(text);
  out.resize(bytes);
  return out;
#else
  return std::string(text);
#endif
}

// A byte-level BPE from a Hugging Face tokenizer.json.
class BpeTokenizer : public TextTokenizer {
 public:
  static StatusOr<std::unique_ptr<TextTokenizer>> FromJson(const std::string& text, const std::string& path) {
    Json j;
    try {
      j = Json::parse(text);
    } catch (const std::exception& e) {
      return InvalidArgument(path + " is not valid JSON: " + e.what());
    }
    auto t = std::unique_ptr<BpeTokenizer>(new BpeTokenizer());
    t->file_ = path;
    try {
      LTRAIN_RETURN_IF_ERROR(t->Read(j, path));
    } catch (const std::exception& e) {
      return InvalidArgument(path + ": unexpected tokenizer.json layout: " + e.what());
    }
    return std::unique_ptr<TextTokenizer>(std::move(t));
  }

  std::vector<uint32_t> Encode(std::string_view text) const override {
    std::vector<uint32_t> ids;
    WordCache& cache = ThreadCache();
    // Added tokens are matched in the raw text first; the text between them is tokenized.
    size_t pos = 0;
    while (pos < text.size()) {
      size_t next = text.size(), length = 0;
      uint32_t added_id = 0;
      for (const auto& [content, id] : added_) {
        const size_t at = text.find(content, pos);
        if (at != std::string_view::npos && (at < next || (at == next && content.size() > length))) {
          next = at;
          length = content.size();
          added_id = id;
        }
      }
      if (nfc_) {
        EncodePlain(Nfc(text.substr(pos, next - pos)), &ids, &cache);
      } else {
        EncodePlain(text.substr(pos, next - pos), &ids, &cache);
      }
      if (next == text.size()) break;
      ids.push_back(added_id);
      pos = next + length;
    }
    return ids;
  }

  std::string Decode(const std::vector<uint32_t>& ids) const override {
    std::string chars;
    for (uint32_t id : ids) {
      if (id < tokens_.size()) chars += tokens_[id];
    }
    // Byte-level characters back to bytes; added tokens (outside the alphabet) as they are.
    std::string out;
    for (size_t i = 0; i < chars.size();) {
      const unsigned char c = static_cast<unsigned char>(chars[i]);
      const size_t n = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : 4;
      const std::string ch = chars.substr(i, n);
      auto it = byte_of_char_.find(ch);
      out += it != byte_of_char_.end() ? std::string(1, static_cast<char>(it->second)) : ch;
      i += n;
    }
    return out;
  }

  int vocab_size() const override { return static_cast<int>(tokens_.size()); }
  std::string kind() const override { return "huggingface"; }
  int64_t end_of_text() const override { return end_of_text_; }
  int64_t begin_of_text() const override { return begin_of_text_; }

 private:
  BpeTokenizer() = default;

  Status Read(const Json& j, const std::string& path) {
    const Json& model = j.at("model");
    if (model.value("type", std::string("BPE")) != "BPE") {
      return InvalidArgument(path + ": model type " + model.value("type", std::string()) +
                             " is not supported; ltrain reads byte-level BPE tokenizer.json files (GPT-2, Llama 3)");
    }
    if (model.contains("byte_fallback") && model["byte_fallback"].is_boolean() && model["byte_fallback"].get<bool>()) {
      return InvalidArgument(path + ": a BPE with byte_fallback (a SentencePiece conversion: Llama 2, Mistral) is not "
                             "supported; ltrain reads byte-level BPE tokenizers (GPT-2, Llama 3)");
    }
    for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
      if (model.contains(key) && model[key].is_string() && !model[key].get<std::string>().empty()) {
        return InvalidArgument(path + ": model." + key + " is not supported (only byte-level BPE)");
      }
    }
    if (j.contains("normalizer") && !j["normalizer"].is_null()) {
      // NFC (Qwen's) composes text that was already composed, and alone: text from elsewhere is
      // normalized before it is split.
      const std::string type = j["normalizer"].value("type", std::string("?"));
      if (type != "NFC") {
        return InvalidArgument(path + ": normalizer " + type + " is not supported; ltrain applies NFC (Qwen's) or none");
      }
#ifndef LTRAIN_WITH_ICU
      return InvalidArgument(path + ": normalizer NFC needs ICU, and this ltrain was built without it (install "
                             "Debian's libicu-dev and build again)");
#endif
      nfc_ = true;
    }
    ignore_merges_ = model.value("ignore_merges", false);
    for (const auto& [token, id] : model.at("vocab").items()) {
      const uint32_t i = id.get<uint32_t>();
      if (tokens_.size() <= i) tokens_.resize(i + 1);
      tokens_[i] = token;
      vocab_[token] = i;
    }
    const Json& merges = model.at("merges");
    uint32_t rank = 0;
    for (const Json& m : merges) {
      std::string a, b;
      if (m.is_string()) {
        const std::string s = m.get<std::string>();
        const size_t space = s.find(' ');
        if (space == std::string::npos) return InvalidArgument(path + ": merge '" + s + "' is not two symbols");
        a = s.substr(0, space);
        b = s.substr(space + 1);
      } else {
        a = m.at(0).get<std::string>();
        b = m.at(1).get<std::string>();
      }
      auto ia = vocab_.find(a), ib = vocab_.find(b), im = vocab_.find(a + b);
      if (ia == vocab_.end() || ib == vocab_.end() || im == vocab_.end()) {
        return InvalidArgument(path + ": merge '" + a + " " + b + "' names a symbol outside the vocabulary");
      }
      merges_[Key(ia->second, ib->second)] = {rank++, im->second};
    }
    if (j.contains("added_tokens")) {
      for (const Json& added : j["added_tokens"]) {
        const std::string content = added.at("content").get<std::string>();
        const uint32_t id = added.at("id").get<uint32_t>();
        if (tokens_.size() <= id) tokens_.resize(id + 1);
        tokens_[id] = content;
        added_.emplace_back(content, id);
        for (const char* eot : {"<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>"}) {
          if (content == eot && end_of_text_ < 0) end_of_text_ = id;
        }
      }
    }
    // A post-processor whose template puts a special token before each text (Llama 3's
    // <|begin_of_text|>): the id that begins a document.
    if (j.contains("post_processor") && j["post_processor"].is_object()) {
      const Json& post = j["post_processor"];
      std::vector<Json> processors;
      if (post.value("type", std::string()) == "Sequence" && post.contains("processors")) {
        for (const Json& p : post["processors"]) processors.push_back(p);
      } else {
        processors.push_back(post);
      }
      for (const Json& p : processors) {
        if (p.value("type", std::string()) != "TemplateProcessing" || !p.contains("single")) continue;
        const Json& single = p["single"];
        if (!single.is_array() || single.empty() || !single[0].contains("SpecialToken")) continue;
        const std::string name = single[0]["SpecialToken"].value("id", std::string());
        for (const auto& [content, id] : added_) {
          if (content == name) begin_of_text_ = id;
        }
        if (begin_of_text_ < 0) {
          return InvalidArgument(path + ": the post-processor's template begins with " + name +
                                 ", which is not an added token");
        }
      }
    }
    // The pre-tokenizer: ByteLevel (its own regex, GPT-2's), or a Sequence of Split(regex) and
    // ByteLevel without a regex (Llama 3).
    std::string pattern;
    const Json pre = j.contains("pre_tokenizer") ? j["pre_tokenizer"] : Json();
    std::vector<Json> steps;
    if (pre.is_object() && pre.value("type", std::string()) == "Sequence") {
      for (const Json& s : pre.at("pretokenizers")) steps.push_back(s);
    } else if (pre.is_object()) {
      steps.push_back(pre);
    }
    bool byte_level = false;
    for (const Json& s : steps) {
      const std::string type = s.value("type", std::string());
      if (type == "ByteLevel") {
        byte_level = true;
        add_prefix_space_ = s.value("add_prefix_space", false);
        if (s.value("use_regex", true)) {
          if (!pattern.empty()) return InvalidArgument(path + ": two pre-tokenizer regexes are not supported");
          pattern = kGpt2Pattern;
        }
      } else if (type == "Split") {
        if (s.value("behavior", std::string("Isolated")) != "Isolated" || s.value("invert", false)) {
          return InvalidArgument(path + ": a Split pre-tokenizer other than behavior Isolated is not supported");
        }
        const Json& p = s.at("pattern");
        if (!p.contains("Regex")) return InvalidArgument(path + ": a Split pre-tokenizer needs a Regex pattern");
        if (!pattern.empty()) return InvalidArgument(path + ": two pre-tokenizer regexes are not supported");
        pattern = p["Regex"].get<std::string>();
      } else {
        return InvalidArgument(path + ": pre-tokenizer " + type + " is not supported (ByteLevel and Split are)");
      }
    }
    if (!byte_level) {
      return InvalidArgument(path + ": not a byte-level BPE (no ByteLevel pre-tokenizer); ltrain reads GPT-2- and "
                             "Llama-3-style tokenizer.json files");
    }
    if (!pattern.empty()) {
      LTRAIN_ASSIGN_OR_RETURN(regex_, Regex::Compile(pattern));
    }
    const auto& chars = ByteChars();
    for (int b = 0; b < 256; ++b) {
      byte_of_char_[chars[b]] = static_cast<unsigned char>(b);
      auto it = vocab_.find(chars[b]);
      byte_id_[b] = it == vocab_.end() ? -1 : static_cast<int64_t>(it->second);
    }
    return Status::Ok();
  }

  static uint64_t Key(uint32_t a, uint32_t b) { return (static_cast<uint64_t>(a) << 32) | b; }

  // Pre-tokens already merged, kept by each thread across calls (a corpus of short documents
  // repeats its words from one to the next): this tokenizer's, up to kMaxCachedWords.
  using WordCache = std::unordered_map<std::string, std::vector<uint32_t>>;
  static constexpr size_t kMaxCachedWords = 1 << 18;
  WordCache& ThreadCache() const {
    thread_local uint64_t owner = 0;
    thread_local WordCache cache;
    if (owner != instance_ || cache.size() > kMaxCachedWords) {
      cache.clear();
      owner = instance_;
    }
    return cache;
  }

  void EncodePlain(std::string_view text, std::vector<uint32_t>* ids, WordCache* cache) const {
    if (text.empty()) return;
    std::string prefixed;
    if (add_prefix_space_ && text.front() != ' ') {
      prefixed = " " + std::string(text);
      text = prefixed;
    }
    auto word = [&](size_t begin, size_t end) {
      const std::string piece(text.substr(begin, end - begin));
      auto hit = cache->find(piece);
      if (hit == cache->end()) hit = cache->emplace(piece, Bpe(piece)).first;
      ids->insert(ids->end(), hit->second.begin(), hit->second.end());
    };
    if (regex_) {
      regex_->Split(text, word);
    } else {
      word(0, text.size());
    }
  }

  // The merges of one pre-token, lowest rank first, every occurrence of the pair left to right.
  std::vector<uint32_t> Bpe(const std::string& bytes) const {
    if (ignore_merges_) {
      auto whole = vocab_.find(ToByteLevel(bytes));
      if (whole != vocab_.end()) return {whole->second};
    }
    std::vector<uint32_t> symbols;
    symbols.reserve(bytes.size());
    for (unsigned char c : bytes) {
      if (byte_id_[c] >= 0) symbols.push_back(static_cast<uint32_t>(byte_id_[c]));
    }
    while (symbols.size() > 1) {
      uint32_t best_rank = UINT32_MAX, merged = 0;
      uint64_t best = 0;
      for (size_t i = 0; i + 1 < symbols.size(); ++i) {
        auto it = merges_.find(Key(symbols[i], symbols[i + 1]));
        if (it != merges_.end() && it->second.first < best_rank) {
          best_rank = it->second.first;
          merged = it->second.second;
          best = it->first;
        }
      }
      if (best_rank == UINT32_MAX) break;
      std::vector<uint32_t> next;
      next.reserve(symbols.size());
      for (size_t i = 0; i < symbols.size(); ++i) {
        if (i + 1 < symbols.size() && Key(symbols[i], symbols[i + 1]) == best) {
          next.push_back(merged);
          ++i;
        } else {
          next.push_back(symbols[i]);
        }
      }
      symbols.swap(next);
    }
    return symbols;
  }

  std::vector<std::string> tokens_;                           // id -> byte-level string
  // Tells this tokenizer's cached words from those of one that was at its address before.
  static inline std::atomic<uint64_t> next_instance_{1};
  const uint64_t instance_ = next_instance_++;
  std::unordered_map<std::string, uint32_t> vocab_;
  std::unordered_map<uint64_t, std::pair<uint32_t, uint32_t>> merges_;  // pair -> (rank, merged id)
  std::vector<std::pair<std::string, uint32_t>> added_;
  std::unordered_map<std::string, unsigned char> byte_of_char_;
  std::array<int64_t, 256> byte_id_{};
  std::unique_ptr<Regex> regex_;
  bool add_prefix_space_ = false;
  bool ignore_merges_ = false;
  int64_t end_of_text_ = -1;
  int64_t begin_of_text_ = -1;
  bool nfc_ = false;  // the tokenizer.json's normalizer is NFC
};

}  // namespace

StatusOr<std::unique_ptr<TextTokenizer>> TextTokenizer::Load(const std::string& spec) {
  if (spec == "byte") return std::unique_ptr<TextTokenizer>(new ByteTokenizer());
  std::error_code ec;
  if (std::filesystem::is_directory(spec, ec)) {
    // A model's directory: its tokenizer.json, or its SentencePiece tokenizer.model.
    for (const char* name : {"tokenizer.json", "tokenizer.model"}) {
      const std::string file = (std::filesystem::path(spec) / name).string();
      if (std::filesystem::exists(file, ec)) return Load(file);
    }
    return NotFound("tokenizer: " + spec + " holds neither tokenizer.json nor tokenizer.model");
  }
  StatusOr<std::string> read = ReadFileText(spec);
  if (!read.ok()) return NotFound("tokenizer: " + read.status().message());
  const std::string& text = *read;
  const size_t first = text.find_first_not_of(" \t\r\n");
  if (first != std::string::npos && text[first] == '{') return BpeTokenizer::FromJson(text, spec);
  return SentencePieceTokenizer::Load(spec);
}

StatusOr<std::string> TrainByteLevelBpe(const std::vector<std::string_view>& texts, int vocab, int threads,
                                        const std::function<void(int64_t, int64_t)>& progress) {
  const int merges_wanted = vocab - 256 - 1;
  if (merges_wanted < 0) return InvalidArgument("--vocab " + std::to_string(vocab) + " is below 257 (256 bytes and <|endoftext|>)");
  LTRAIN_ASSIGN_OR_RETURN(std::unique_ptr<Regex> regex, Regex::Compile(kGpt2Pattern));
  // Pre-token counts, each text on its own thread share.
  threads = std::max(1, threads);
  std::vector<std::unordered_map<std::string, int64_t>> partial(threads);
  {
    std::vector<std::thread> pool;
    for (int t = 0; t < threads; ++t) {
      pool.emplace_back([&, t] {
        for (size_t i = t; i < texts.size(); i += threads) {
          regex->Split(texts[i], [&](size_t b, size_t e) { ++partial[t][std::string(texts[i].substr(b, e - b))]; });
        }
      });
    }
    for (auto& th : pool) th.join();
  }
  std::unordered_map<std::string, int64_t> counts;
  for (auto& p : partial) {
    for (auto& [w, c] : p) counts[w] += c;
  }
  // Words as symbol ids; symbols start as the 256 bytes in the byte-level alphabet's id order.
  const auto& chars = ByteChars();
  std::vector<std::string> symbols(chars.begin(), chars.end());
  std::vector<std::vector<uint32_t>> words;
  std::vector<int64_t> freq;
  words.reserve(counts.size());
  for (auto& [w, c] : counts) {
    std::vector<uint32_t> s;
    for (unsigned char ch : w) s.push_back(ch);
    words.push_back(std::move(s));
    freq.push_back(c);
  }
  auto key = [](uint32_t a, uint32_t b) { return (static_cast<uint64_t>(a) << 32) | b; };
  // Pair counts, and for each pair the words it occurs in; updated as merges rewrite words.
  std::unordered_map<uint64_t, int64_t> pair_count;
  std::unordered_map<uint64_t, std::vector<uint32_t>> where;
  for (uint32_t w = 0; w < words.size(); ++w) {
    for (size_t i = 0; i + 1 < words[w].size(); ++i) {
      const uint64_t k = key(words[w][i], words[w][i + 1]);
      pair_count[k] += freq[w];
      where[k].push_back(w);
    }
  }
  std::vector<std::pair<uint32_t, uint32_t>> merges;
  for (int m = 0; m < merges_wanted; ++m) {
    uint64_t best = 0;
    int64_t best_count = 0;
    for (const auto& [k, c] : pair_count) {
      // Most frequent; ties to the pair whose merged text sorts first, so the result is stable.
      if (c > best_count ||
          (c == best_count && c > 0 &&
           symbols[k >> 32] + " " + symbols[k & 0xffffffff] < symbols[best >> 32] + " " + symbols[best & 0xffffffff])) {
        best = k;
        best_count = c;
      }
    }
    if (best_count < 2) break;  // nothing left worth a symbol
    const uint32_t a = static_cast<uint32_t>(best >> 32), b = static_cast<uint32_t>(best & 0xffffffff);
    const uint32_t merged = static_cast<uint32_t>(symbols.size());
    symbols.push_back(symbols[a] + symbols[b]);
    merges.emplace_back(a, b);
    std::vector<uint32_t> touched = std::move(where[best]);
    where.erase(best);
    std::sort(touched.begin(), touched.end());
    touched.erase(std::unique(touched.begin(), touched.end()), touched.end());
    for (uint32_t w : touched) {
      std::vector<uint32_t>& s = words[w];
      for (size_t i = 0; i + 1 < s.size(); ++i) {
        auto it = pair_count.find(key(s[i], s[i + 1]));
        if (it != pair_count.end() && (it->second -= freq[w]) <= 0) pair_count.erase(it);
      }
      std::vector<uint32_t> next;
      for (size_t i = 0; i < s.size(); ++i) {
        if (i + 1 < s.size() && s[i] == a && s[i + 1] == b) {
          next.push_back(merged);
          ++i;
        } else {
          next.push_back(s[i]);
        }
      }
      s.swap(next);
      for (size_t i = 0; i + 1 < s.size(); ++i) {
        const uint64_t k = key(s[i], s[i + 1]);
        pair_count[k] += freq[w];
        if (s[i] == merged || s[i + 1] == merged) where[k].push_back(w);
      }
    }
    if (progress) progress(m + 1, merges_wanted);
  }
  Json vocab_json = Json::object();
  for (uint32_t i = 0; i < symbols.size(); ++i) vocab_json[symbols[i]] = i;
  Json merges_json = Json::array();
  for (const auto& [a, b] : merges) merges_json.push_back(symbols[a] + " " + symbols[b]);
  const uint32_t eot = static_cast<uint32_t>(symbols.size());
  Json j;
  j["version"] = "1.0";
  j["truncation"] = nullptr;
  j["padding"] = nullptr;
  j["added_tokens"] = Json::array({Json{{"id", eot}, {"content", "<|endoftext|>"}, {"single_word", false},
                                        {"lstrip", false}, {"rstrip", false}, {"normalized", false}, {"special", true}}});
  j["normalizer"] = nullptr;
  j["pre_tokenizer"] = Json{{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true}, {"use_regex", true}};
  j["post_processor"] = Json{{"type", "ByteLevel"}, {"add_prefix_space", true}, {"trim_offsets", false}, {"use_regex", true}};
  j["decoder"] = Json{{"type", "ByteLevel"}, {"add_prefix_space", true}, {"trim_offsets", true}, {"use_regex", true}};
  j["model"] = Json{{"type", "BPE"}, {"dropout", nullptr}, {"unk_token", nullptr}, {"continuing_subword_prefix", nullptr},
                    {"end_of_word_suffix", nullptr}, {"fuse_unk", false}, {"byte_fallback", false},
                    {"ignore_merges", false}, {"vocab", vocab_json}, {"merges", merges_json}};
  return j.dump(1);
}

}  // namespace ltrain
