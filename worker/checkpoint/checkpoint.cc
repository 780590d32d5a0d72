#include "worker/checkpoint/checkpoint.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>
#include <vector>

#include "common/files.h"
#include "common/safetensors.h"
#include "worker/control/progress.h"

namespace ltrain::worker {
namespace fs = std::filesystem;
namespace {

constexpr uint64_t kWriteChunk = 64ull << 20;     // one write call
constexpr uint64_t kProgressEvery = 64ull << 20;  // bytes between progress reports

StatusOr<std::string> DtypeName(torch::ScalarType type) {
  switch (type) {
    case torch::kFloat: return std::string("F32");
    case torch::kBFloat16: return std::string("BF16");
    case torch::kHalf: return std::string("F16");
    case torch::kLong: return std::string("I64");
    case torch::kInt: return std::string("I32");
    case torch::kByte: return std::string("U8");
    default: return InvalidArgument(std::string("a checkpoint cannot hold tensors of dtype ") + c10::toString(type));
  }
}

StatusOr<torch::ScalarType> ScalarTypeOf(const std::string& dtype) {
  if (dtype == "F32") return torch::kFloat;
  if (dtype == "BF16") return torch::kBFloat16;
  if (dtype == "F16") return torch::kHalf;
  if (dtype == "I64") return torch::kLong;
  if (dtype == "I32") return torch::kInt;
  if (dtype == "U8") return torch::kByte;
  return DataLoss("dtype " + dtype + " is not one a checkpoint holds");
}

// The commit number of the step `latest` names, or -1 where it has none to read.
int64_t LatestCommitNumber(const std::string& dir) {
  const int64_t latest = LatestCommittedStep(dir);
  if (latest < 0) return -1;
  StatusOr<CheckpointMeta> meta = ReadCheckpointMeta((fs::path(dir) / StepDirName(latest)).string());
  return meta.ok() ? meta->commit : -1;
}

}  // namespace

std::string ModelShardFile(int rank) { return "model-rank-" + std::to_string(rank) + ".safetensors"; }
std::string OptimizerShardFile(int rank) { return "optimizer-rank-" + std::to_string(rank) + ".safetensors"; }

std::string PendingCheckpointDir(const std::string& dir, int64_t step) {
  return (fs::path(dir) / (".tmp-" + StepDirName(step))).string();
}

void RemovePendingCheckpoints(const std::string& dir, int64_t max_step) {
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind(".tmp-", 0) != 0) continue;
    const int64_t n = StepOfName(name.substr(5));
    if (n >= 0 && (max_step < 0 || n <= max_step)) RemoveTree(entry.path());
  }
}

StatusOr<CheckpointWriteFault> CheckpointWriteFault::FromEnv() {
  CheckpointWriteFault fault;
  const char* v = std::getenv("LTRAIN_FAULT_CHECKPOINT_WRITE");
  const std::string text = v == nullptr ? "" : v;
  if (!text.empty()) {
    try {
      size_t used = 0;
      fault.step = std::stoll(text, &used);
      if (used < text.size()) {
        if (text[used] != ':') throw std::invalid_argument(text);
        size_t used_rank = 0;
        fault.rank = std::stoi(text.substr(used + 1), &used_rank);
        if (used + 1 + used_rank != text.size()) throw std::invalid_argument(text);
      }
    } catch (const std::exception&) {
      return InvalidArgument("LTRAIN_FAULT_CHECKPOINT_WRITE='" + text + "' is not STEP or STEP:RANK");
    }
  }
  const char* stall = std::getenv("LTRAIN_FAULT_CHECKPOINT_STALL");
  if (stall == nullptr || *stall == '\0') return fault;
  const std::string stall_text = stall;
  try {
    size_t used = 0;
    fault.stall_step = std::stoll(stall_text, &used);
    if (used >= stall_text.size() || stall_text[used] != ':') throw std::invalid_argument(stall_text);
    size_t used_seconds = 0;
    fault.stall_seconds = std::stod(stall_text.substr(used + 1), &used_seconds);
    used += 1 + used_seconds;
    if (used < stall_text.size()) {
      if (stall_text[used] != ':') throw std::invalid_argument(stall_text);
      size_t used_rank = 0;
      fault.stall_rank = std::stoi(stall_text.substr(used + 1), &used_rank);
      if (used + 1 + used_rank != stall_text.size()) throw std::invalid_argument(stall_text);
    }
    if (!(fault.stall_seconds >= 0)) throw std::invalid_argument(stall_text);
  } catch (const std::exception&) {
    return InvalidArgument("LTRAIN_FAULT_CHECKPOINT_STALL='" + stall_text + "' is not STEP:SECONDS or STEP:SECONDS:RANK");
  }
  return fault;
}

uint64_t ShardDataBytes(const NamedTensors& tensors) {
  uint64_t bytes = 0;
  for (const auto& [name, tensor] : tensors) bytes += tensor.numel() * tensor.element_size();
  return bytes;
}

StatusOr<CheckpointFile> WriteShardFile(const std::string& path, const NamedTensors& tensors, bool inject_failure,
                                        const std::function<void(uint64_t)>& progress) {
  std::vector<SafetensorsEntry> entries;
  std::vector<torch::Tensor> host;
  entries.reserve(tensors.size());
  host.reserve(tensors.size());
  for (const auto& [name, tensor] : tensors) {
    // The snapshot is host memory already; anything else is copied here, off the training thread.
    torch::Tensor t = tensor.device().is_cpu() && tensor.is_contiguous() ? tensor : tensor.detach().cpu().contiguous();
    LTRAIN_ASSIGN_OR_RETURN(std::string dtype, DtypeName(t.scalar_type()));
    entries.push_back(SafetensorsEntry{name, std::move(dtype), t.sizes().vec(), static_cast<uint64_t>(t.nbytes())});
    host.push_back(std::move(t));
  }
  const std::map<std::string, std::string> metadata = {{"format", "pt"}};
  LTRAIN_ASSIGN_OR_RETURN(std::unique_ptr<SafetensorsWriter> writer,
                          SafetensorsWriter::Create(path, std::move(entries), metadata));
  const uint64_t total = writer->file_bytes();
  const uint64_t data = ShardDataBytes(tensors);
  const uint64_t limit = inject_failure ? total / 2 : total;
  uint64_t reported = 0;
  for (const torch::Tensor& t : host) {
    const char* p = static_cast<const char*>(t.data_ptr());
    uint64_t left = static_cast<uint64_t>(t.nbytes());
    while (left > 0) {
      uint64_t n = std::min(left, kWriteChunk);
      const uint64_t on_disk = total - data + writer->written();
      if (on_disk + n > limit) {
        n = on_disk < limit ? limit - on_disk : 0;
        if (n > 0) LTRAIN_RETURN_IF_ERROR(writer->Write(p, n));
        writer->Abandon();  // the partial file is really on disk
        return Internal("writing " + path + ": injected failure after " + std::to_string(on_disk + n) + " of " +
                        std::to_string(total) + " bytes (LTRAIN_FAULT_CHECKPOINT_WRITE)");
      }
      LTRAIN_RETURN_IF_ERROR(writer->Write(p, n));
      p += n;
      left -= n;
      if (progress && writer->written() - reported >= kProgressEvery) {
        reported = writer->written();
        progress(reported);
      }
    }
  }
  LTRAIN_ASSIGN_OR_RETURN(FileDigest digest, writer->Finish());
  if (progress) progress(writer->written());
  return CheckpointFile{digest.bytes, digest.xxh3};
}

StatusOr<std::map<std::string, torch::Tensor>> ReadShardFile(
    const std::string& path, const CheckpointFile& expected, const std::function<void(uint64_t)>& progress,
    const std::function<torch::Tensor(torch::ScalarType, int64_t)>& allocate,
    const std::function<void(const std::string&, const torch::Tensor&)>& on_tensor) {
  const std::string name = fs::path(path).filename().string();
  StatusOr<std::unique_ptr<SafetensorsFile>> opened = SafetensorsFile::Open(path);
  if (!opened.ok()) return DataLoss(opened.status().message());
  const SafetensorsFile& file = **opened;
  if (file.file_bytes() != expected.bytes) {
    return DataLoss(name + " size mismatch: expected " + std::to_string(expected.bytes) + " bytes, got " +
                    std::to_string(file.file_bytes()));
  }
  std::map<std::string, torch::Tensor> out;
  for (const SafetensorsEntry& entry : file.tensors()) {
    StatusOr<torch::ScalarType> type = ScalarTypeOf(entry.dtype);
    if (!type.ok()) return DataLoss(name + ": tensor " + entry.name + ": " + type.status().message());
    int64_t numel = 1;
    for (int64_t d : entry.shape) numel *= d;
    torch::Tensor given = allocate && numel > 0 ? allocate(*type, numel) : torch::Tensor();
    out[entry.name] = given.defined() ? given.view(entry.shape) : torch::empty(entry.shape, torch::TensorOptions().dtype(*type));
  }
  std::function<void(const SafetensorsEntry&)> done;
  if (on_tensor) done = [&](const SafetensorsEntry& entry) { on_tensor(entry.name, out.at(entry.name)); };
  StatusOr<FileDigest> digest = file.ReadAll(
      [&out](const SafetensorsEntry& entry) -> void* { return out.at(entry.name).data_ptr(); }, progress, done);
  if (!digest.ok()) return DataLoss(digest.status().message());
  if (digest->xxh3 != expected.xxh3) return DataLoss(HashMismatch(name, expected.xxh3, digest->xxh3));
  return out;
}

Status CommitCheckpoint(const std::string& dir, const CheckpointMeta& meta, const Recipe& recipe, uint64_t* bytes) {
  const std::string name = StepDirName(meta.step);
  const fs::path final_dir = fs::path(dir) / name;
  const fs::path tmp_dir = PendingCheckpointDir(dir, meta.step);
  std::error_code ec;
  if (!fs::is_directory(tmp_dir, ec)) return Internal(tmp_dir.string() + " does not exist: no rank wrote files");
  using Files = std::map<std::string, CheckpointFile>;
  LTRAIN_ASSIGN_OR_RETURN(Files files, ReadRankManifests(tmp_dir.string()));
  if (files.empty()) return Internal("no rank listed files of " + name + " in " + tmp_dir.string());
  for (const auto& entry : fs::directory_iterator(tmp_dir, ec)) {
    // Commit markers (FileCommitBoard) and the ranks' manifests are not part of the checkpoint.
    const std::string file = entry.path().filename().string();
    if (file.rfind(".rank-", 0) == 0 || IsRankManifestName(file)) fs::remove(entry.path(), ec);
  }
  if (bytes != nullptr) {
    *bytes = 0;
    for (const auto& [file, info] : files) *bytes += info.bytes;
  }
  CheckpointMeta committed = meta;
  committed.files = std::move(files);
  LTRAIN_RETURN_IF_ERROR(CheckCheckpointFiles(tmp_dir.string(), committed));
  int64_t newest = LatestCommitNumber(dir);
  if (newest < 0) newest = NextCommitNumber(ListCommittedSteps(dir)) - 1;
  committed.commit = newest + 1;
  LTRAIN_RETURN_IF_ERROR(WriteFileAtomically((tmp_dir / kCheckpointMetaFile).string(),
                                             CheckpointMetaYaml(committed, RecipeToYaml(recipe))));

  // Commit. A step directory of the same number can exist when a run resumed from an earlier
  // checkpoint passes it again; the new one replaces it.
  RemoveTree(final_dir);
  if (::rename(tmp_dir.c_str(), final_dir.c_str()) != 0) {
    return Internal("committing " + final_dir.string() + ": " + std::strerror(errno));
  }
  LTRAIN_RETURN_IF_ERROR(FsyncPath(dir, true));
  return WriteFileAtomically((fs::path(dir) / "latest").string(), name + "\n");
}

std::vector<int64_t> PruneCheckpoints(const std::string& dir, int keep, int64_t latest) {
  if (keep <= 0) return {};
  std::vector<int64_t> pruned = StepsToPrune(ListCommittedSteps(dir), keep, latest);
  for (int64_t step : pruned) RemoveTree(fs::path(dir) / StepDirName(step));
  return pruned;
}

StatusOr<ResumeChoice> ChooseResumeCheckpoint(const std::string& path, const std::map<int64_t, std::string>& rejected) {
  std::error_code ec;
  const fs::path root(path);
  auto check = [](const std::string& step_dir) -> StatusOr<CheckpointMeta> {
    LTRAIN_ASSIGN_OR_RETURN(CheckpointMeta meta, ReadCheckpointMeta(step_dir));
    LTRAIN_RETURN_IF_ERROR(CheckCheckpointFiles(step_dir, meta));
    return meta;
  };
  // A step directory has its meta.yaml; one without it is still taken for a (corrupt) step directory
  // when its name says step-N and it holds no steps of its own (a checkpoint directory may be
  // named step-N too: a job named "step" has ids step-1, step-2, ...).
  bool step_dir = fs::exists(root / kCheckpointMetaFile, ec);
  if (!step_dir && StepOfName(root.filename().string()) >= 0) {
    step_dir = !fs::exists(root / "latest", ec) && ListCommittedSteps(path).empty();
  }
  if (step_dir) {
    StatusOr<CheckpointMeta> meta = check(path);
    if (!meta.ok() && meta.status().code() == StatusCode::kFailedPrecondition) {
      return FailedPrecondition("checkpoint " + path + ": " + meta.status().message());
    }
    if (!meta.ok()) return DataLoss("checkpoint " + path + " is corrupt (" + meta.status().message() + ")");
    if (auto it = rejected.find(meta->step); it != rejected.end()) {
      return DataLoss("checkpoint " + path + " is corrupt (" + it->second + ")");
    }
    return ResumeChoice{path, *meta, {}};
  }
  if (!fs::is_directory(root, ec)) {
    return NotFound("checkpoint.resume_from=" + path + " is neither a step directory nor a checkpoint directory");
  }
  // `latest` first, then every older commit, newest first.
  std::vector<CommittedStep> steps = ListCommittedSteps(path);
  std::sort(steps.begin(), steps.end(), [](const CommittedStep& a, const CommittedStep& b) {
    return a.commit != b.commit ? a.commit > b.commit : a.step > b.step;
  });
  std::vector<int64_t> order;
  const int64_t latest = LatestCommittedStep(path);
  if (latest >= 0) {
    order.push_back(latest);
    int64_t latest_commit = -1;
    for (const CommittedStep& s : steps) {
      if (s.step == latest) latest_commit = s.commit;
    }
    for (const CommittedStep& s : steps) {
      // A step renamed into place whose `latest` update never happened is not committed.
      if (s.step != latest && (latest_commit < 0 || s.commit < latest_commit)) order.push_back(s.step);
    }
  } else {
    for (const CommittedStep& s : steps) order.push_back(s.step);
  }
  if (order.empty()) return NotFound("checkpoint directory " + path + " holds no committed step (no latest, no step-N)");
  ResumeChoice choice;
  for (int64_t n : order) {
    const std::string name = StepDirName(n);
    const std::string dir = (root / name).string();
    if (auto it = rejected.find(n); it != rejected.end()) {
      choice.skipped.push_back("checkpoint " + name + " is corrupt (" + it->second + ")");
      continue;
    }
    StatusOr<CheckpointMeta> meta =
        fs::is_directory(dir, ec) ? check(dir) : StatusOr<CheckpointMeta>(DataLoss("the directory is missing"));
    if (meta.ok()) {
      choice.step_dir = dir;
      choice.meta = *meta;
      return choice;
    }
    if (meta.status().code() == StatusCode::kFailedPrecondition) {
      return FailedPrecondition("checkpoint " + dir + ": " + meta.status().message());
    }
    choice.skipped.push_back("checkpoint " + name + " is corrupt (" + meta.status().message() + ")");
  }
  std::string why;
  for (const std::string& s : choice.skipped) why += (why.empty() ? "" : "; ") + s;
  return DataLoss("no valid checkpoint in " + path + ": " + why);
}

namespace {

fs::path Marker(const std::string& dir, int64_t step, int rank, bool done) {
  return fs::path(PendingCheckpointDir(dir, step)) / (".rank-" + std::to_string(rank) + (done ? ".done" : ".failed"));
}

}  // namespace

Status FileCommitBoard::Announce(int64_t step, int rank, const std::string& error) {
  const fs::path marker = Marker(dir_, step, rank, error.empty());
  (void)CreateDirectories(marker.parent_path().string(), 0777);
  Status written = WriteFileAtomically(marker.string(), error);
  if (!written.ok()) return Internal("announcing checkpoint step-" + std::to_string(step) + ": " + written.message());
  return Status::Ok();
}

StatusOr<std::vector<std::string>> FileCommitBoard::Collect(int64_t step, int world_size,
                                                            std::chrono::milliseconds timeout,
                                                            const std::atomic<bool>* cancel) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  std::vector<std::string> words(world_size);
  std::vector<bool> heard(world_size, false);
  int missing = world_size;
  // Rank 0 waits for its peers: the coordinator judges it by the slowest of them, not by itself.
  const std::string work = "waiting for the ranks' files of step-" + std::to_string(step);
  Progress::Global().SetWork(work, 0, world_size, "ranks", /*waits_for_peers=*/true);
  struct EndWork {
    const std::string& work;
    ~EndWork() { Progress::Global().EndWork(work); }
  } end_work{work};
  while (true) {
    std::error_code ec;
    const int missing_before = missing;
    for (int r = 0; r < world_size; ++r) {
      if (heard[r]) continue;
      if (fs::exists(Marker(dir_, step, r, true), ec)) {
        heard[r] = true;
        --missing;
      } else if (fs::exists(Marker(dir_, step, r, false), ec)) {
        std::ifstream in(Marker(dir_, step, r, false));
        std::stringstream text;
        text << in.rdbuf();
        words[r] = text.str().empty() ? "rank " + std::to_string(r) + " failed" : text.str();
        heard[r] = true;
        --missing;
      }
    }
    if (missing == 0) return words;
    if (missing != missing_before) {
      Progress::Global().SetWork(work, world_size - missing, world_size, "ranks", /*waits_for_peers=*/true);
    }
    if (cancel != nullptr && cancel->load()) return Unavailable("checkpoint step-" + std::to_string(step) + " abandoned");
    if (std::chrono::steady_clock::now() >= deadline) {
      std::string who;
      for (int r = 0; r < world_size; ++r) {
        if (!heard[r]) who += (who.empty() ? "" : ", ") + std::to_string(r);
      }
      return Status(StatusCode::kDeadlineExceeded, "rank(s) " + who + " did not report their files of step-" +
                                                       std::to_string(step) + " within " +
                                                       std::to_string(timeout.count() / 1000) + " s");
    }
    // The markers may come from other hosts (a shared filesystem): poll.
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

Status LocalCommitBoard::Announce(int64_t step, int rank, const std::string& error) {
  std::lock_guard<std::mutex> lock(mu_);
  words_[{step, rank}] = error;
  cv_.notify_all();
  return Status::Ok();
}

StatusOr<std::vector<std::string>> LocalCommitBoard::Collect(int64_t step, int world_size,
                                                             std::chrono::milliseconds timeout,
                                                             const std::atomic<bool>* cancel) {
  std::unique_lock<std::mutex> lock(mu_);
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  auto all = [&] {
    for (int r = 0; r < world_size; ++r) {
      if (!words_.count({step, r})) return false;
    }
    return true;
  };
  while (!all()) {
    if (cancel != nullptr && cancel->load()) return Unavailable("checkpoint step-" + std::to_string(step) + " abandoned");
    if (std::chrono::steady_clock::now() >= deadline) {
      return Status(StatusCode::kDeadlineExceeded, "not every rank reported its files of step-" + std::to_string(step));
    }
    cv_.wait_for(lock, std::chrono::milliseconds(200));
  }
  std::vector<std::string> words;
  for (int r = 0; r < world_size; ++r) words.push_back(words_[{step, r}]);
  return words;
}

}  // namespace ltrain::worker
