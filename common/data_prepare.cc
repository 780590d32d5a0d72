#include "common/data_prepare.h"

#include <glob.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <mutex>
#include <thread>

#include <yaml-cpp/yaml.h>

#include "common/files.h"
#include "common/token_data.h"
#include "common/tokenizer.h"

namespace ltrain {
namespace {

namespace fs = std::filesystem;

constexpr size_t kChunkBytes = 1 << 20;

// Pieces of `text` of about kChunkBytes that tokenize on their own as they do in the whole: each
// starts after a newline, at a character that is not whitespace (no pre-token of GPT-2's or Llama
// 3's regex crosses such a place).
std::vector<std::string_view> Chunks(std::string_view text) {
  std::vector<std::string_view> out;
  size_t begin = 0;
  while (begin < text.size()) {
    size_t end = std::min(text.size(), begin + kChunkBytes);
    while (end < text.size() && !(text[end - 1] == '\n' && !std::isspace(static_cast<unsigned char>(text[end])) &&
                                  (static_cast<unsigned char>(text[end]) & 0xC0) != 0x80)) {
      ++end;
    }
    out.push_back(text.substr(begin, end - begin));
    begin = end;
  }
  return out;
}

Status WriteDataInfo(const std::string& dir, const DataInfo& info) {
  YAML::Emitter out;
  out << YAML::BeginMap;
  out << YAML::Key << "tokenizer" << YAML::Value << info.tokenizer;
  out << YAML::Key << "tokenizer_file" << YAML::Value << info.tokenizer_file;
  out << YAML::Key << "vocab" << YAML::Value << info.vocab;
  out << YAML::Key << "train_tokens" << YAML::Value << info.train_tokens;
  out << YAML::Key << "val_tokens" << YAML::Value << info.val_tokens;
  out << YAML::EndMap;
  return WriteFileAtomically((fs::path(dir) / "data.yaml").string(), std::string(out.c_str()) + "\n");
}

}  // namespace

StatusOr<std::vector<std::string>> ExpandInputs(const std::vector<std::string>& inputs) {
  std::vector<std::string> files;
  for (const std::string& input : inputs) {
    std::error_code ec;
    if (fs::is_directory(input, ec)) {
      std::vector<std::string> found;
      for (auto it = fs::recursive_directory_iterator(input, fs::directory_options::skip_permission_denied, ec);
           !ec && it != fs::recursive_directory_iterator(); it.increment(ec)) {
        const std::string name = it->path().filename().string();
        if (!name.empty() && name[0] == '.') {  // hidden files and directories (.git) are no text to train on
          if (it->is_directory()) it.disable_recursion_pending();
          continue;
        }
        if (it->is_regular_file() && it->file_size() > 0) found.push_back(it->path().string());
      }
      if (ec) return InvalidArgument("cannot walk input directory " + input + ": " + ec.message());
      if (found.empty()) return NotFound("input directory " + input + " holds no non-empty file");
      std::sort(found.begin(), found.end());
      files.insert(files.end(), found.begin(), found.end());
    } else if (fs::exists(input, ec)) {
      files.push_back(input);
    } else if (input.find_first_of("*?[") != std::string::npos) {
      glob_t g{};
      const int rc = ::glob(input.c_str(), 0, nullptr, &g);
      std::vector<std::string> found;
      for (size_t i = 0; rc == 0 && i < g.gl_pathc; ++i) {
        if (fs::is_regular_file(g.gl_pathv[i], ec)) found.push_back(g.gl_pathv[i]);
      }
      ::globfree(&g);
      if (found.empty()) return NotFound("no file matches " + input);
      files.insert(files.end(), found.begin(), found.end());  // glob sorts
    } else {
      return NotFound("cannot read input " + input + ": no such file or directory");
    }
  }
  return files;
}

namespace {

StatusOr<PrepareStats> PrepareInto(const PrepareOptions& o);

// Whether `dir` holds what `ltrain data prepare` writes, and nothing else.
bool HoldsOnlyADataset(const fs::path& dir) {
  std::error_code ec;
  if (!fs::exists(dir / "data.yaml", ec) && !fs::exists(dir / "train.bin", ec)) return false;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (name != "data.yaml" && name != "train.bin" && name != "val.bin" && name != "tokenizer.json" &&
        name != "tokenizer.model") {
      return false;
    }
  }
  return !ec;
}

}  // namespace

StatusOr<PrepareStats> PrepareData(const PrepareOptions& options) {
  if (options.threads < 0 || options.threads > kMaxPrepareThreads) {
    return InvalidArgument("--threads " + std::to_string(options.threads) + " is outside 0-" +
                           std::to_string(kMaxPrepareThreads) + " (0: every core)");
  }
  if (options.output_dir.empty()) return InvalidArgument("give --output DIR");
  const fs::path out = fs::path(options.output_dir).lexically_normal();
  std::error_code ec;
  const fs::file_status status = fs::symlink_status(out, ec);
  const bool exists = status.type() != fs::file_type::not_found;
  if (exists) {
    if (!fs::is_directory(out, ec)) {
      return InvalidArgument("--output " + options.output_dir + " is not a directory: give a new or empty folder");
    }
    if (!fs::is_empty(out, ec)) {
      if (!HoldsOnlyADataset(out)) {
        return InvalidArgument("--output " + options.output_dir + " holds files that are not a dataset: give a new or "
                               "empty folder (nothing there was changed)");
      }
      if (!options.overwrite) {
        return InvalidArgument("--output " + options.output_dir + " holds a dataset already: give --overwrite to replace "
                               "it, or another folder (nothing there was changed)");
      }
    }
  }
  // Written beside, then renamed into place.
  const std::string partial = out.string() + ".partial-" + std::to_string(::getpid());
  RemoveTree(partial);
  PrepareOptions into = options;
  into.output_dir = partial;
  StatusOr<PrepareStats> stats = PrepareInto(into);
  if (!stats.ok()) {
    RemoveTree(partial);
    return stats.status();
  }
  const std::string old = out.string() + ".old-" + std::to_string(::getpid());
  if (exists && ::rename(out.c_str(), old.c_str()) != 0) {
    const std::string why = std::strerror(errno);
    RemoveTree(partial);
    return Internal("cannot move the dataset in " + out.string() + " aside: " + why);
  }
  if (::rename(partial.c_str(), out.c_str()) != 0) {
    const std::string why = std::strerror(errno);
    if (exists) (void)::rename(old.c_str(), out.c_str());
    RemoveTree(partial);
    return Internal("cannot rename " + partial + " to " + out.string() + ": " + why);
  }
  if (exists) RemoveTree(old);
  stats->train_path = (out / "train.bin").string();
  stats->val_path = (out / "val.bin").string();
  return stats;
}

namespace {

StatusOr<PrepareStats> PrepareInto(const PrepareOptions& o) {
  if (!(o.val_fraction >= 0.0 && o.val_fraction < 1.0)) {
    return InvalidArgument("val_fraction=" + std::to_string(o.val_fraction) + " must be in [0, 1)");
  }
  if (o.inputs.empty()) return InvalidArgument("no input files given");
  if (!o.train_tokenizer.empty() && o.train_tokenizer != "bpe") {
    return InvalidArgument("--train-tokenizer " + o.train_tokenizer + " is not known; bpe trains a byte-level BPE");
  }
  if (!o.train_tokenizer.empty() && o.tokenizer != "byte") {
    return InvalidArgument("give --tokenizer FILE or --train-tokenizer bpe, not both");
  }
  if (!o.train_tokenizer.empty() && (o.vocab < 257 || o.vocab > (1 << 24))) {
    return InvalidArgument("--train-tokenizer bpe needs --vocab N, 257 to 16777216 (256 bytes, merges, <|endoftext|>)");
  }
  const int threads = o.threads > 0 ? o.threads : std::max(1u, std::thread::hardware_concurrency());
  auto progress = [&](const std::string& what, int64_t done, int64_t total) {
    if (o.progress) o.progress(what, done, total);
  };
  LTRAIN_ASSIGN_OR_RETURN(std::vector<std::string> files, ExpandInputs(o.inputs));
  std::vector<std::string> texts;
  int64_t bytes = 0;
  for (size_t i = 0; i < files.size(); ++i) {
    LTRAIN_ASSIGN_OR_RETURN(std::string text, ReadFileText(files[i]));
    if (text.empty()) return InvalidArgument("input " + files[i] + " is empty");
    bytes += static_cast<int64_t>(text.size());
    texts.push_back(std::move(text));
    progress("reading", static_cast<int64_t>(i + 1), static_cast<int64_t>(files.size()));
  }
  std::error_code ec;
  fs::create_directories(o.output_dir, ec);
  if (ec) return InvalidArgument("cannot create output directory " + o.output_dir + ": " + ec.message());

  std::string spec = o.tokenizer;
  if (o.train_tokenizer == "bpe") {
    std::vector<std::string_view> views(texts.begin(), texts.end());
    LTRAIN_ASSIGN_OR_RETURN(std::string json, TrainByteLevelBpe(views, o.vocab, threads, [&](int64_t d, int64_t t) {
                              progress("training the tokenizer", d, t);
                            }));
    spec = (fs::path(o.output_dir) / "tokenizer.json").string();
    LTRAIN_RETURN_IF_ERROR(WriteFileAtomically(spec, json));
  }
  LTRAIN_ASSIGN_OR_RETURN(std::unique_ptr<TextTokenizer> tokenizer, TextTokenizer::Load(spec));
  DataInfo info;
  info.tokenizer = tokenizer->kind();
  info.vocab = tokenizer->vocab_size();
  if (!tokenizer->file().empty()) {
    // The data keeps its tokenizer: a copy beside the tokens, under the name transformers reads.
    info.tokenizer_file = tokenizer->kind() == "huggingface" ? "tokenizer.json" : "tokenizer.model";
    const fs::path copy = fs::path(o.output_dir) / info.tokenizer_file;
    if (!fs::exists(copy, ec) || !fs::equivalent(copy, tokenizer->file(), ec)) {
      LTRAIN_ASSIGN_OR_RETURN(std::string content, ReadFileText(tokenizer->file()));
      LTRAIN_RETURN_IF_ERROR(WriteFileAtomically(copy.string(), content));
    }
  }

  // Every chunk of every file, tokenized on `threads` threads, kept in order.
  struct Piece {
    size_t file;
    std::string_view text;
    std::vector<uint32_t> ids;
  };
  std::vector<Piece> pieces;
  for (size_t f = 0; f < texts.size(); ++f) {
    for (std::string_view c : Chunks(texts[f])) pieces.push_back(Piece{f, c, {}});
  }
  std::atomic<size_t> next{0};
  std::atomic<int64_t> done_bytes{0};
  std::mutex progress_mu;
  {
    std::vector<std::thread> pool;
    for (int t = 0; t < threads; ++t) {
      pool.emplace_back([&] {
        for (size_t i; (i = next.fetch_add(1)) < pieces.size();) {
          pieces[i].ids = tokenizer->Encode(pieces[i].text);
          const int64_t d = done_bytes += static_cast<int64_t>(pieces[i].text.size());
          std::lock_guard<std::mutex> lock(progress_mu);
          progress("tokenizing", d, bytes);
        }
      });
    }
    for (auto& th : pool) th.join();
  }
  std::vector<uint32_t> tokens;
  const int64_t eot = tokenizer->end_of_text();
  for (size_t i = 0; i < pieces.size(); ++i) {
    if (i > 0 && pieces[i].file != pieces[i - 1].file && eot >= 0) tokens.push_back(static_cast<uint32_t>(eot));
    tokens.insert(tokens.end(), pieces[i].ids.begin(), pieces[i].ids.end());
    std::vector<uint32_t>().swap(pieces[i].ids);
  }

  const int64_t total = static_cast<int64_t>(tokens.size());
  const int64_t val_count = static_cast<int64_t>(static_cast<double>(total) * o.val_fraction);
  const int64_t train_count = total - val_count;
  if (o.val_fraction > 0 && val_count == 0) {
    return InvalidArgument(std::to_string(total) + " tokens of text leave no validation tokens at --val-fraction " +
                           std::to_string(o.val_fraction) + ": give more text (at least " +
                           std::to_string(static_cast<int64_t>(1 / o.val_fraction) + 1) +
                           " tokens), or --val-fraction 0");
  }
  if (train_count < kMinTrainTokens) {
    return InvalidArgument("too little text to train on: " + std::to_string(train_count) +
                           " training tokens, at least " + std::to_string(kMinTrainTokens) +
                           " are needed (one training sample alone is model.seq_len + 1 tokens)");
  }
  info.train_tokens = train_count;
  info.val_tokens = val_count;
  PrepareStats stats;
  stats.info = info;
  stats.files = static_cast<int>(files.size());
  stats.bytes = bytes;
  stats.train_path = (fs::path(o.output_dir) / "train.bin").string();
  stats.val_path = (fs::path(o.output_dir) / "val.bin").string();
  std::vector<uint32_t> val(tokens.begin() + train_count, tokens.end());
  tokens.resize(train_count);
  LTRAIN_RETURN_IF_ERROR(WriteTokenFile(stats.train_path, tokens, static_cast<uint32_t>(info.vocab)));
  LTRAIN_RETURN_IF_ERROR(WriteTokenFile(stats.val_path, val, static_cast<uint32_t>(info.vocab)));
  LTRAIN_RETURN_IF_ERROR(WriteDataInfo(o.output_dir, info));
  return stats;
}

}  // namespace

std::string DataProblem(const Recipe& recipe) {
  const std::string& dir = recipe.data.path;
  const int model_vocab = recipe.model.vocab;
  StatusOr<TokenDataset> data = TokenDataset::Open((fs::path(dir) / "train.bin").string());
  if (!data.ok()) return "";
  std::string made_by, kind = "byte", source = "it has no data.yaml: bytes";
  if (StatusOr<DataInfo> info = ReadDataInfo(dir); info.ok()) {
    kind = info->tokenizer;
    source = "its data.yaml";
    made_by = " (" + info->tokenizer + (info->tokenizer_file.empty() ? "" : " " + info->tokenizer_file) + ")";
  }
  if (recipe.data.tokenizer != Tokenizer::kAuto && NameOf(recipe.data.tokenizer) != kind) {
    return "data.tokenizer=" + NameOf(recipe.data.tokenizer) + " but the data in " + dir + " was made by the " + kind +
           " tokenizer (" + source + "): prepare it again with that tokenizer, or set data.tokenizer: " + kind +
           " (auto takes any)";
  }
  if (data->vocab() <= model_vocab) return "";
  return "model.vocab=" + std::to_string(model_vocab) + " is smaller than the vocabulary of the data in " + dir +
         made_by + ", " + std::to_string(data->vocab()) + " tokens: set model.vocab: " + std::to_string(data->vocab()) +
         " (or more, a multiple of 64 is faster on GPUs)";
}

StatusOr<DataInfo> ReadDataInfo(const std::string& dir) {
  const std::string path = (fs::path(dir) / "data.yaml").string();
  std::error_code ec;
  if (!fs::exists(path, ec)) return NotFound(path + " does not exist");
  try {
    YAML::Node node = YAML::LoadFile(path);
    DataInfo info;
    info.tokenizer = node["tokenizer"].as<std::string>("byte");
    info.tokenizer_file = node["tokenizer_file"].as<std::string>("");
    info.vocab = node["vocab"].as<int>(256);
    info.train_tokens = node["train_tokens"].as<int64_t>(0);
    info.val_tokens = node["val_tokens"].as<int64_t>(0);
    return info;
  } catch (const std::exception& e) {
    return DataLoss(path + " cannot be read: " + e.what());
  }
}

}  // namespace ltrain
