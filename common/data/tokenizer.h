// Tokenizers of `ltrain data prepare` and `ltrain generate`: text to token ids and back.
//   byte           one token per byte (vocab 256)
//   huggingface    a Hugging Face tokenizer.json of a byte-level BPE (GPT-2, Llama 3 and the ones
//                  `--train-tokenizer bpe` writes): added tokens split out first, the pre-tokenizer's
//                  regex (PCRE2: it has look-ahead), the byte-to-character map, then the merges by rank
//   sentencepiece  a SentencePiece .model (Llama 2, Mistral) through Debian's libsentencepiece, in
//                  libltrain_sentencepiece.so (see common/sentencepiece_shim.cc for why apart)
// Encode and Decode are safe to call from several threads at once. No LibTorch here.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace ltrain {

class TextTokenizer {
 public:
  virtual ~TextTokenizer() = default;

  // "byte", a Hugging Face tokenizer.json, a SentencePiece model (any other file), or a model's
  // directory (its tokenizer.json, else its tokenizer.model).
  static StatusOr<std::unique_ptr<TextTokenizer>> Load(const std::string& spec);

  virtual std::vector<uint32_t> Encode(std::string_view text) const = 0;
  virtual std::string Decode(const std::vector<uint32_t>& ids) const = 0;
  // One more than the largest id it makes (added tokens included).
  virtual int vocab_size() const = 0;
  // "byte", "huggingface" or "sentencepiece".
  virtual std::string kind() const = 0;
  // The id that ends a document (put between input files), or -1.
  virtual int64_t end_of_text() const { return -1; }
  // The id that begins a document, where the tokenizer's post-processor puts one before each text
  // (Llama 3's <|begin_of_text|>), or -1.
  virtual int64_t begin_of_text() const { return -1; }
  // The file it was loaded from; empty for "byte".
  const std::string& file() const { return file_; }

 protected:
  std::string file_;
};

// GPT-2's pre-tokenizer regex, which trained tokenizers use.
inline constexpr const char* kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

// Trains a byte-level BPE of `vocab` ids (the 256 byte symbols, the merges, and <|endoftext|> as
// the last id) on `texts` and returns it as a Hugging Face tokenizer.json. `progress(done, total)`
// is called as merges are learned.
StatusOr<std::string> TrainByteLevelBpe(const std::vector<std::string_view>& texts, int vocab, int threads,
                                        const std::function<void(int64_t, int64_t)>& progress);

}  // namespace ltrain
