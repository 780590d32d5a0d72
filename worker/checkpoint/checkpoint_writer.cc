#include "worker/checkpoint/checkpoint_writer.h"

#include <cstdio>
#include <filesystem>
#include <map>

#include <c10/util/Exception.h>

#include "common/files.h"
#include "worker/control/progress.h"

namespace ltrain::worker {
namespace fs = std::filesystem;

CheckpointWriter::CheckpointWriter(CheckpointWriterOptions options) : options_(std::move(options)) {
  if (options_.async) thread_ = std::thread([this] { Loop(); });
}

CheckpointWriter::~CheckpointWriter() {
  if (!thread_.joinable()) return;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cancel_ = true;
  cv_.notify_all();
  thread_.join();
}

void CheckpointWriter::Submit(CheckpointSnapshot snapshot) {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return !busy_; });
  queued_ = std::move(snapshot);
  busy_ = true;
  cv_.notify_all();
}

Status CheckpointWriter::Wait() {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return !busy_; });
  return last_;
}

void CheckpointWriter::Loop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    cv_.wait(lock, [&] { return stop_ || queued_.has_value(); });
    if (!queued_) return;  // stop_
    CheckpointSnapshot snapshot = std::move(*queued_);
    queued_.reset();
    lock.unlock();
    Process(std::move(snapshot));
    lock.lock();
    busy_ = false;
    cv_.notify_all();
  }
}

Status CheckpointWriter::Fatal() const {
  std::lock_guard<std::mutex> lock(mu_);
  return fatal_;
}

void CheckpointWriter::Process(CheckpointSnapshot snapshot) {
  Status result;
  const std::string error = WriteFiles(snapshot);
  if (Status s = options_.board->Announce(snapshot.step, options_.rank, error); !s.ok()) {
    // Rank 0 would wait for this word for ever: this rank stops, and says why.
    const std::string why = "rank " + std::to_string(options_.rank) + ": checkpoint step-" +
                            std::to_string(snapshot.step) + (error.empty() ? "" : " failed (" + error + ")") +
                            ", and its word could not reach rank 0: " +
                            WithFreeSpace(s.message(), options_.dir);
    std::fprintf(stderr, "ltrain-worker: %s\n", why.c_str());
    if (options_.rank == 0) {
      (void)Conclude(snapshot, {why});  // removes the pending files
    } else {
      RemoveOwnFiles(snapshot);
    }
    std::lock_guard<std::mutex> lock(mu_);
    fatal_ = FailedPrecondition(why);
    last_ = fatal_;
    return;
  }
  if (options_.rank == 0) {
    std::vector<std::string> errors;
    StatusOr<std::vector<std::string>> words =
        options_.board->Collect(snapshot.step, options_.world_size, options_.commit_timeout, &cancel_);
    if (!words.ok()) {
      errors.push_back(words.status().message());
    } else {
      for (const std::string& w : *words) {
        if (!w.empty()) errors.push_back(w);
      }
    }
    result = Conclude(snapshot, errors);
  } else if (!error.empty()) {
    result = Internal(error);
  }
  std::lock_guard<std::mutex> lock(mu_);
  last_ = result;
}

std::string CheckpointWriter::WriteFiles(const CheckpointSnapshot& snapshot) {
  if (snapshot.files.empty()) return "";
  const std::string who = "rank " + std::to_string(options_.rank) + ": ";
  const fs::path pending = PendingCheckpointDir(options_.dir, snapshot.step);
  // The modes are the worker's umask's (private, or shared with the group: checkpoint.share_with_group).
  if (Status made = CreateDirectories(pending.string(), 0777); !made.ok()) return who + made.message();
  const std::string work = "saving checkpoint step-" + std::to_string(snapshot.step);
  int64_t total = 0;
  for (const auto& [name, tensors] : snapshot.files) total += static_cast<int64_t>(ShardDataBytes(tensors));
  int64_t before = 0;  // bytes of the files already written
  Progress::Global().SetWork(work, 0, total, "bytes");
  if (options_.fault.Stalls(snapshot.step, options_.rank)) {
    std::printf("rank %d: stalling the save of step-%lld for %.1f s (LTRAIN_FAULT_CHECKPOINT_STALL)\n", options_.rank,
                static_cast<long long>(snapshot.step), options_.fault.stall_seconds);
    std::fflush(stdout);
    std::this_thread::sleep_for(std::chrono::duration<double>(options_.fault.stall_seconds));
  }
  std::map<std::string, CheckpointFile> written;
  Status s;
  bool first = true;
  for (const auto& [name, tensors] : snapshot.files) {
    const bool inject = first && options_.fault.Hits(snapshot.step, options_.rank);
    first = false;
    const std::string path = (pending / name).string();
    StatusOr<CheckpointFile> file = Internal("not written");
    try {
      file = WriteShardFile(path, tensors, inject, [&](uint64_t done) {
        Progress::Global().SetWork(work, before + static_cast<int64_t>(done), total, "bytes");
      });
    } catch (const std::exception& e) {
      file = Internal("writing " + path + ": " + e.what());
    }
    if (!file.ok()) {
      s = file.status();
      break;
    }
    before += static_cast<int64_t>(ShardDataBytes(tensors));
    written[name] = *file;
  }
  if (s.ok()) s = WriteRankManifest(pending.string(), options_.rank, written);
  Progress::Global().EndWork(work);
  if (!s.ok()) {
    // What is free is said as the write found it, then what was written gives its space back.
    s = Status(s.code(), WithFreeSpace(s.message(), options_.dir));
    RemoveOwnFiles(snapshot);
  }
  return s.ok() ? "" : who + s.message();
}

void CheckpointWriter::RemoveOwnFiles(const CheckpointSnapshot& snapshot) {
  const fs::path pending = PendingCheckpointDir(options_.dir, snapshot.step);
  std::error_code ec;
  for (const auto& [name, tensors] : snapshot.files) fs::remove(pending / name, ec);
  fs::remove(pending / RankManifestName(options_.rank), ec);
}

Status CheckpointWriter::Conclude(const CheckpointSnapshot& snapshot, const std::vector<std::string>& errors) {
  const std::string& dir = options_.dir;
  const std::string name = "step-" + std::to_string(snapshot.step);
  Status result;
  uint64_t bytes = 0;
  if (errors.empty()) {
    result = CommitCheckpoint(dir, snapshot.meta, options_.recipe, &bytes);
  } else {
    std::string why;
    for (const std::string& e : errors) why += (why.empty() ? "" : "; ") + e;
    result = Internal(why);
  }
  RemovePendingCheckpoints(dir, snapshot.step);
  const auto committed = std::chrono::steady_clock::now();
  if (result.ok() && options_.on_commit) {
    options_.on_commit(snapshot.step, (fs::path(dir) / name).string(),
                       std::chrono::duration<double, std::milli>(committed - snapshot.start).count(), bytes);
  }
  // Only now, with `latest` naming the new step, may older ones go; their removal is timed apart
  // from the save (a filesystem that discards freed blocks can take seconds over it).
  std::string pruned;
  if (result.ok()) {
    const auto prune_start = std::chrono::steady_clock::now();
    for (int64_t step : PruneCheckpoints(dir, options_.recipe.checkpoint.keep, snapshot.step)) {
      pruned += (pruned.empty() ? "" : ", ") + StepDirName(step);
    }
    if (!pruned.empty()) {
      const double prune_ms =
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - prune_start).count();
      pruned = "; removed " + pruned + " in " + std::to_string(static_cast<int64_t>(prune_ms + 0.5)) + " ms";
    }
  }
  if (options_.print) {
    if (result.ok()) {
      const double ms = std::chrono::duration<double, std::milli>(committed - snapshot.start).count();
      std::printf("checkpoint %s written to %s in %.0f ms (%.2f GB, %.2f GB/s)%s\n", name.c_str(), dir.c_str(), ms,
                  bytes / 1e9, ms > 0 ? bytes / 1e6 / ms : 0.0, pruned.c_str());
    } else {
      const int64_t latest = LatestCommittedStep(dir);
      const std::string stays = latest >= 0 ? "step-" + std::to_string(latest) + " stays the newest committed"
                                            : "no step is committed yet";
      std::printf("checkpoint %s failed: %s; %s\n", name.c_str(), result.message().c_str(), stays.c_str());
    }
    std::fflush(stdout);
  }
  if (!result.ok()) return Internal("checkpoint " + name + " failed: " + result.message());
  return Status::Ok();
}

}  // namespace ltrain::worker
