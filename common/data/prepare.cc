#include "common/data/prepare.h"

#include <glob.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <thread>

#include "common/data/shard_writer.h"
#include "common/data/token_data.h"
#include "common/data/tokenizer.h"
#include "common/files.h"

namespace ltrain {
namespace {

namespace fs = std::filesystem;

constexpr uint64_t kValSeed = 0x6c747261696e7631ULL;  // "ltrainv1"

// Whether a piece of text goes to validation: a hash of the text below the fraction.
bool ForValidation(const std::string& text, double fraction) {
  if (!(fraction > 0)) return false;
  const uint64_t h = XXH3_64bits_withSeed(text.data(), text.size(), kValSeed);
  return static_cast<double>(h >> 11) * 0x1.0p-53 < fraction;
}

bool Cancelled(const PrepareOptions& o) { return o.cancel != nullptr && o.cancel->load(); }

// Whether `dir` holds what `ltrain data prepare` writes, and nothing else.
bool HoldsOnlyADataset(const fs::path& dir) {
  if (!HoldsPreparedData(dir.string())) return false;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    const bool shard = (name.rfind("train-", 0) == 0 || name.rfind("val-", 0) == 0) &&
                       (entry.path().extension() == ".bin" || entry.path().extension() == ".idx");
    if (name != "data.yaml" && name != "train.bin" && name != "val.bin" && name != "tokenizer.json" &&
        name != "tokenizer.model" && !shard) {
      return false;
    }
  }
  return !ec;
}

// A batch of pieces on its way through the tokenizers, in the order read.
struct Batch {
  int64_t seq = 0;
  std::vector<TextPiece> pieces;
  std::vector<std::vector<uint32_t>> ids;
  std::vector<std::vector<uint8_t>> masks;  // SFT data: per piece, 1 where the loss counts the token
  int64_t bytes_read = 0;  // of the inputs, once this batch was read
};

// Writes the tokenized pieces in order into the two splits. Each train piece is held back until the
// next one comes: when no piece's hash chose validation, the last goes there (a small corpus).
class SplitWriter {
 public:
  SplitWriter(const std::string& dir, const PrepareOptions& o, uint32_t vocab)
      : fraction_(o.val_fraction),
        sft_(o.sft),
        train_(dir, "train", o.shard_bytes, vocab, o.sft),
        val_(dir, "val", o.shard_bytes, vocab, o.sft) {}

  // `mask`: SFT data's, one byte per id; empty otherwise.
  Status Write(TextPiece& piece, std::vector<uint32_t>& ids, std::vector<uint8_t>& mask) {
    const bool val = ForValidation(piece.text, fraction_);
    const bool starts = piece.document_start || last_val_ != val;
    last_val_ = val;
    if (val) return val_.Append(ids, starts, piece.input, sft_ ? &mask : nullptr);
    LTRAIN_RETURN_IF_ERROR(Flush());
    held_ = std::move(ids);
    held_mask_ = std::move(mask);
    held_starts_ = starts;
    held_input_ = piece.input;
    holding_ = true;
    return Status::Ok();
  }

  Status Finish() {
    if (holding_ && fraction_ > 0 && val_.tokens() == 0 && train_.tokens() > 0) {
      LTRAIN_RETURN_IF_ERROR(val_.Append(held_, true, held_input_, sft_ ? &held_mask_ : nullptr));
      holding_ = false;
    }
    LTRAIN_RETURN_IF_ERROR(Flush());
    LTRAIN_RETURN_IF_ERROR(train_.Finish());
    return val_.Finish();
  }

  const ShardWriter& train() const { return train_; }
  const ShardWriter& val() const { return val_; }

 private:
  Status Flush() {
    if (!holding_) return Status::Ok();
    holding_ = false;
    return train_.Append(held_, held_starts_, held_input_, sft_ ? &held_mask_ : nullptr);
  }

  double fraction_;
  bool sft_;
  ShardWriter train_, val_;
  bool last_val_ = false;
  bool holding_ = false;
  std::vector<uint32_t> held_;
  std::vector<uint8_t> held_mask_;
  bool held_starts_ = false;
  int held_input_ = 0;
};

// Reads, tokenizes on `threads` threads and writes, in order; at most 2 * threads + 2 batches are
// held at once.
Status TokenizeCorpus(CorpusReader& reader, const TextTokenizer& tokenizer, int threads, const PrepareOptions& o,
                      SplitWriter& writer) {
  std::mutex mu;
  std::condition_variable changed;
  std::deque<std::unique_ptr<Batch>> todo;
  std::map<int64_t, std::unique_ptr<Batch>> done;
  const int max_in_flight = 2 * threads + 2;
  int in_flight = 0;
  bool read_all = false;
  int64_t batches = 0;
  Status failure;
  auto fail = [&](Status s) {
    std::lock_guard<std::mutex> lock(mu);
    if (failure.ok()) failure = std::move(s);
    changed.notify_all();
  };

  std::thread read([&] {
    for (int64_t seq = 0;; ++seq) {
      auto batch = std::make_unique<Batch>();
      batch->seq = seq;
      size_t bytes = 0;
      bool end = false;
      while (bytes < kBatchBytes) {
        TextPiece piece;
        StatusOr<bool> got = reader.Next(&piece);
        if (!got.ok()) return fail(got.status());
        if (!*got) {
          end = true;
          break;
        }
        bytes += piece.text.size();
        batch->pieces.push_back(std::move(piece));
      }
      batch->bytes_read = reader.bytes_read();
      std::unique_lock<std::mutex> lock(mu);
      changed.wait(lock, [&] { return in_flight < max_in_flight || !failure.ok() || Cancelled(o); });
      if (!failure.ok()) return;
      if (Cancelled(o)) {
        failure = InvalidArgument("stopped by a signal: nothing was written");
        changed.notify_all();
        return;
      }
      if (!batch->pieces.empty()) {
        ++in_flight;
        todo.push_back(std::move(batch));
        batches = seq + 1;
      }
      if (end) {
        read_all = true;
        changed.notify_all();
        return;
      }
      changed.notify_all();
    }
  });

  const int64_t eot = tokenizer.end_of_text(), bos = tokenizer.begin_of_text();
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&] {
      while (true) {
        std::unique_ptr<Batch> batch;
        {
          std::unique_lock<std::mutex> lock(mu);
          changed.wait(lock, [&] { return !todo.empty() || read_all || !failure.ok(); });
          if (!failure.ok() || todo.empty()) return;
          batch = std::move(todo.front());
          todo.pop_front();
        }
        batch->ids.resize(batch->pieces.size());
        batch->masks.resize(batch->pieces.size());
        for (size_t i = 0; i < batch->pieces.size(); ++i) {
          const TextPiece& piece = batch->pieces[i];
          std::vector<uint32_t>& ids = batch->ids[i];
          if (o.sft) {
            // The prompt and the response tokenized apart, so that no token spans both: the loss
            // counts the response's tokens and the end-of-text after them, never the prompt's (nor
            // the begin-of-text before it).
            ids.clear();
            if (bos >= 0) ids.push_back(static_cast<uint32_t>(bos));
            std::vector<uint32_t> prompt = tokenizer.Encode(std::string_view(piece.text).substr(0, piece.prompt_bytes));
            ids.insert(ids.end(), prompt.begin(), prompt.end());
            const size_t prompt_ids = ids.size();
            std::vector<uint32_t> response = tokenizer.Encode(std::string_view(piece.text).substr(piece.prompt_bytes));
            ids.insert(ids.end(), response.begin(), response.end());
            if (eot >= 0) ids.push_back(static_cast<uint32_t>(eot));
            batch->masks[i].assign(ids.size(), 1);
            std::fill(batch->masks[i].begin(), batch->masks[i].begin() + static_cast<std::ptrdiff_t>(prompt_ids), 0);
          } else {
            ids = tokenizer.Encode(piece.text);
            if (piece.document_start && bos >= 0) ids.insert(ids.begin(), static_cast<uint32_t>(bos));
            if (piece.document_end && eot >= 0) ids.push_back(static_cast<uint32_t>(eot));
          }
        }
        std::lock_guard<std::mutex> lock(mu);
        done[batch->seq] = std::move(batch);
        changed.notify_all();
      }
    });
  }

  for (int64_t next = 0;; ++next) {
    std::unique_ptr<Batch> batch;
    {
      std::unique_lock<std::mutex> lock(mu);
      changed.wait(lock, [&] { return done.count(next) > 0 || !failure.ok() || (read_all && next >= batches); });
      if (!failure.ok() || done.count(next) == 0) break;
      batch = std::move(done[next]);
      done.erase(next);
    }
    Status s;
    for (size_t i = 0; i < batch->pieces.size() && s.ok(); ++i) {
      s = writer.Write(batch->pieces[i], batch->ids[i], batch->masks[i]);
    }
    if (!s.ok()) {
      fail(s);
      break;
    }
    if (o.progress) o.progress("tokenizing", batch->bytes_read, reader.total_bytes(), true);
    std::lock_guard<std::mutex> lock(mu);
    --in_flight;
    changed.notify_all();
  }
  read.join();
  for (std::thread& t : pool) t.join();
  return failure;
}

// The corpus' first `sample` bytes of text, for the tokenizer's training.
StatusOr<std::vector<std::string>> Sample(const std::vector<std::string>& files, const CorpusOptions& options,
                                          int64_t sample) {
  LTRAIN_ASSIGN_OR_RETURN(std::unique_ptr<CorpusReader> reader, CorpusReader::Open(files, options));
  std::vector<std::string> texts;
  int64_t bytes = 0;
  TextPiece piece;
  while (bytes < sample) {
    LTRAIN_ASSIGN_OR_RETURN(bool got, reader->Next(&piece));
    if (!got) break;
    bytes += static_cast<int64_t>(piece.text.size());
    texts.push_back(std::move(piece.text));
  }
  return texts;
}

StatusOr<PrepareStats> PrepareInto(const PrepareOptions& o) {
  if (!(o.val_fraction >= 0.0 && o.val_fraction < 1.0)) {
    return InvalidArgument("--val-fraction " + std::to_string(o.val_fraction) + " must be in [0, 1)");
  }
  if (o.inputs.empty()) return InvalidArgument("no input given");
  if (!o.train_tokenizer.empty() && o.train_tokenizer != "bpe") {
    return InvalidArgument("--train-tokenizer " + o.train_tokenizer + " is not known; bpe trains a byte-level BPE");
  }
  if (!o.train_tokenizer.empty() && o.tokenizer != "byte") {
    return InvalidArgument("give --tokenizer FILE or --train-tokenizer bpe, not both");
  }
  if (!o.train_tokenizer.empty() && (o.vocab < 257 || o.vocab > (1 << 24))) {
    return InvalidArgument("--train-tokenizer bpe needs --vocab N, 257 to 16777216 (256 bytes, merges, <|endoftext|>)");
  }
  if (o.shard_bytes < kMinShardBytes) {
    return InvalidArgument("--shard-size " + std::to_string(o.shard_bytes) + " is below " +
                           std::to_string(kMinShardBytes) + " bytes");
  }
  const int threads = o.threads > 0 ? o.threads : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  LTRAIN_ASSIGN_OR_RETURN(std::vector<std::string> files, ExpandInputs(o.inputs));
  if (std::count(files.begin(), files.end(), "-") > 1) return InvalidArgument("standard input (-) can be read once");
  CorpusOptions corpus;
  corpus.format = o.format;
  corpus.jsonl_field = o.jsonl_field;
  corpus.sft = o.sft;
  corpus.piece_bytes = kTextPieceBytes;
  std::error_code ec;
  fs::create_directories(o.output_dir, ec);
  if (ec) return InvalidArgument("cannot create output directory " + o.output_dir + ": " + ec.message());

  std::string spec = o.tokenizer;
  if (o.train_tokenizer == "bpe") {
    if (std::count(files.begin(), files.end(), "-") > 0) {
      return InvalidArgument("--train-tokenizer reads the corpus twice, which standard input cannot give: train it on "
                             "a file of the corpus first (ltrain data prepare --input FILE --train-tokenizer bpe), and "
                             "give its tokenizer.json as --tokenizer");
    }
    LTRAIN_ASSIGN_OR_RETURN(std::vector<std::string> texts, Sample(files, corpus, o.tokenizer_sample_bytes));
    std::vector<std::string_view> views(texts.begin(), texts.end());
    LTRAIN_ASSIGN_OR_RETURN(std::string json, TrainByteLevelBpe(views, o.vocab, threads, [&](int64_t d, int64_t t) {
                              if (o.progress) o.progress("training the tokenizer", d, t, false);
                            }));
    spec = (fs::path(o.output_dir) / "tokenizer.json").string();
    LTRAIN_RETURN_IF_ERROR(WriteFileAtomically(spec, json));
  }
  LTRAIN_ASSIGN_OR_RETURN(std::unique_ptr<TextTokenizer> tokenizer, TextTokenizer::Load(spec));
  DataInfo info;
  info.format = 2;
  info.tokenizer = tokenizer->kind();
  info.vocab = tokenizer->vocab_size();
  info.dtype = info.vocab <= 65536 ? "uint16" : "uint32";
  info.sft = o.sft;
  if (fs::is_directory(o.tokenizer, ec)) {
    info.tokenizer_from = fs::absolute(o.tokenizer, ec).lexically_normal().string();
  }
  if (!tokenizer->file().empty()) {
    // The data keeps its tokenizer: a copy beside the tokens, under the name transformers reads.
    info.tokenizer_file = tokenizer->kind() == "huggingface" ? "tokenizer.json" : "tokenizer.model";
    const fs::path copy = fs::path(o.output_dir) / info.tokenizer_file;
    if (!fs::exists(copy, ec) || !fs::equivalent(copy, tokenizer->file(), ec)) {
      LTRAIN_ASSIGN_OR_RETURN(std::string content, ReadFileText(tokenizer->file()));
      LTRAIN_RETURN_IF_ERROR(WriteFileAtomically(copy.string(), content));
    }
    LTRAIN_ASSIGN_OR_RETURN(info.tokenizer_sha256, FileSha256(copy.string()));
  }

  LTRAIN_ASSIGN_OR_RETURN(std::unique_ptr<CorpusReader> reader, CorpusReader::Open(files, corpus));
  SplitWriter writer(o.output_dir, o, static_cast<uint32_t>(info.vocab));
  const auto start = std::chrono::steady_clock::now();
  LTRAIN_RETURN_IF_ERROR(TokenizeCorpus(*reader, *tokenizer, threads, o, writer));
  LTRAIN_RETURN_IF_ERROR(writer.Finish());
  if (Cancelled(o)) return InvalidArgument("stopped by a signal: nothing was written");

  info.train_tokens = writer.train().tokens();
  info.val_tokens = writer.val().tokens();
  info.train_documents = writer.train().documents();
  info.val_documents = writer.val().documents();
  if (info.train_tokens < kMinTrainTokens) {
    return InvalidArgument("too little text to train on: " + std::to_string(info.train_tokens) + " training tokens" +
                           (info.val_tokens > 0 ? " (" + std::to_string(info.val_tokens) +
                                                      " more went to validation, by the hash of their text)"
                                                : std::string()) +
                           ", at least " + std::to_string(kMinTrainTokens) +
                           " are needed (one training sample alone is model.seq_len + 1 tokens): give more text");
  }
  for (size_t i = 0; i < files.size(); ++i) {
    InputInfo input;
    input.path = files[i];
    input.bytes = files[i] == "-" ? 0 : static_cast<int64_t>(fs::file_size(files[i], ec));
    input.documents = reader->documents(i);
    info.inputs.push_back(input);
  }
  info.shards = writer.train().shards();
  info.shards.insert(info.shards.end(), writer.val().shards().begin(), writer.val().shards().end());
  LTRAIN_RETURN_IF_ERROR(WriteDataInfo(o.output_dir, info));
  LTRAIN_RETURN_IF_ERROR(FsyncPath(o.output_dir, /*directory=*/true));

  PrepareStats stats;
  stats.info = info;
  stats.files = static_cast<int>(files.size());
  stats.bytes = reader->bytes_read();
  stats.text_bytes = reader->text_bytes();
  stats.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return stats;
}

}  // namespace

StatusOr<int64_t> ParseByteSize(const std::string& text) {
  char* end = nullptr;
  const double value = std::strtod(text.c_str(), &end);
  std::string unit(end);
  for (char& c : unit) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  double scale = 0;
  if (unit.empty() || unit == "B") scale = 1;
  if (unit == "K" || unit == "KB" || unit == "KIB") scale = 1024.0;
  if (unit == "M" || unit == "MB" || unit == "MIB") scale = 1024.0 * 1024;
  if (unit == "G" || unit == "GB" || unit == "GIB") scale = 1024.0 * 1024 * 1024;
  if (end == text.c_str() || scale == 0 || !(value > 0)) {
    return InvalidArgument("'" + text + "' is not a size: give bytes, or a number with KB, MB or GB (1GB)");
  }
  return static_cast<int64_t>(value * scale);
}

StatusOr<std::vector<std::string>> ExpandInputs(const std::vector<std::string>& inputs) {
  std::vector<std::string> files;
  for (const std::string& input : inputs) {
    std::error_code ec;
    if (input == "-") {
      files.push_back(input);
    } else if (fs::is_directory(input, ec)) {
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
  stats->output_dir = out.string();
  return stats;
}

bool HoldsPreparedData(const std::string& dir) {
  std::error_code ec;
  return fs::exists(fs::path(dir) / "data.yaml", ec) || fs::exists(fs::path(dir) / "train.bin", ec);
}

namespace {

std::string DataProblemIn(const std::string& dir, const Recipe& recipe) {
  const int model_vocab = recipe.model.vocab;
  StatusOr<TokenDataset> data = TokenDataset::OpenSplit(dir, "train");
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

}  // namespace

std::string DataProblem(const Recipe& recipe) {
  std::string first_dir, first_sha;
  for (const DataSource& source : DataSources(recipe)) {
    if (std::string problem = DataProblemIn(source.path, recipe); !problem.empty()) return problem;
    StatusOr<DataInfo> info = ReadDataInfo(source.path);
    if (!info.ok() || info->tokenizer_sha256.empty()) continue;
    if (first_sha.empty()) {
      first_dir = source.path;
      first_sha = info->tokenizer_sha256;
    } else if (info->tokenizer_sha256 != first_sha) {
      return "data.sources mixes tokenizers: the data in " + first_dir + " and in " + source.path +
             " were made by different tokenizers (their data.yaml's tokenizer_sha256 differ), so one id means two "
             "tokens: prepare every source with the same --tokenizer";
    }
  }
  return "";
}

}  // namespace ltrain
