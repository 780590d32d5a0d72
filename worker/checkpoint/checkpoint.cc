#include "worker/checkpoint/checkpoint.h"

#include <sys/stat.h>

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <thread>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <vector>

#include <torch/serialize.h>
#include <yaml-cpp/yaml.h>

#include "common/files.h"

namespace ltrain::worker {
namespace fs = std::filesystem;
namespace {

constexpr const char* kMetaFile = "meta.yaml";

Status FsyncPath(const std::string& path, bool directory) {
  int fd = ::open(path.c_str(), (directory ? O_RDONLY | O_DIRECTORY : O_RDONLY) | O_CLOEXEC);
  if (fd < 0) return Internal("opening " + path + " to fsync: " + std::strerror(errno));
  int rc = ::fsync(fd);
  ::close(fd);
  if (rc != 0) return Internal("fsync " + path + ": " + std::strerror(errno));
  return Status::Ok();
}

Status WriteFileSynced(const std::string& path, const std::string& text) {
  {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out << text;
    out.close();
    if (!out) return Internal("writing " + path + " failed");
  }
  return FsyncPath(path, false);
}

// Step number of a "step-<N>" name, or -1.
int64_t StepOfName(const std::string& name) {
  if (name.rfind("step-", 0) != 0 || name.size() == 5) return -1;
  int64_t n = 0;
  for (size_t i = 5; i < name.size(); ++i) {
    if (name[i] < '0' || name[i] > '9') return -1;
    n = n * 10 + (name[i] - '0');
  }
  return n;
}

void PruneOld(const std::string& dir, int keep) {
  if (keep <= 0) return;
  std::vector<std::pair<int64_t, fs::path>> steps;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    int64_t n = StepOfName(entry.path().filename().string());
    if (n >= 0 && entry.is_directory()) steps.emplace_back(n, entry.path());
  }
  std::sort(steps.begin(), steps.end());
  for (size_t i = 0; i + keep < steps.size(); ++i) RemoveTree(steps[i].second);
}

}  // namespace

StatusOr<std::string> FileChecksum(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return NotFound("cannot read " + path);
  uint64_t h = 0xcbf29ce484222325ULL;
  std::vector<char> buf(1 << 20);
  while (in) {
    in.read(buf.data(), static_cast<std::streamsize>(buf.size()));
    const std::streamsize got = in.gcount();
    for (std::streamsize i = 0; i < got; ++i) {
      h ^= static_cast<unsigned char>(buf[i]);
      h *= 0x100000001b3ULL;
    }
  }
  char hex[17];
  std::snprintf(hex, sizeof(hex), "%016llx", static_cast<unsigned long long>(h));
  return std::string(hex);
}

std::string PendingCheckpointDir(const std::string& dir, int64_t step) {
  return (fs::path(dir) / (".tmp-step-" + std::to_string(step))).string();
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
  if (v == nullptr || *v == '\0') return fault;
  const std::string text = v;
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
  return fault;
}

Status WriteTensorArchive(const std::string& path, const std::vector<std::pair<std::string, torch::Tensor>>& tensors,
                          bool inject_failure) {
  std::string bytes;
  try {
    torch::serialize::OutputArchive archive;
    for (const auto& [key, tensor] : tensors) archive.write(key, tensor.detach().cpu().contiguous());
    archive.save_to([&bytes](const void* data, size_t n) -> size_t {
      bytes.append(static_cast<const char*>(data), n);
      return n;
    });
  } catch (const c10::Error& e) {
    return Internal("serializing " + path + ": " + e.what_without_backtrace());
  }
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return Internal("creating " + path + ": " + std::strerror(errno));
  const size_t limit = inject_failure ? bytes.size() / 2 : bytes.size();
  size_t done = 0;
  while (done < limit) {
    const ssize_t n = ::write(fd, bytes.data() + done, limit - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int err = errno;
      ::close(fd);
      return Internal("writing " + path + ": " + std::strerror(err));
    }
    done += static_cast<size_t>(n);
  }
  if (inject_failure) {
    (void)::fsync(fd);  // the partial file is really on disk
    ::close(fd);
    return Internal("writing " + path + ": injected failure after " + std::to_string(done) + " of " +
                    std::to_string(bytes.size()) + " bytes (LTRAIN_FAULT_CHECKPOINT_WRITE)");
  }
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  if (rc != 0) return Internal("fsync " + path + ": " + std::strerror(err));
  return Status::Ok();
}

Status CommitCheckpoint(const std::string& dir, const CheckpointMeta& meta, const Recipe& recipe, int keep) {
  const std::string name = "step-" + std::to_string(meta.step);
  const fs::path final_dir = fs::path(dir) / name;
  const fs::path tmp_dir = PendingCheckpointDir(dir, meta.step);
  std::error_code ec;
  if (!fs::is_directory(tmp_dir, ec)) return Internal(tmp_dir.string() + " does not exist: no rank wrote files");
  std::vector<std::string> files;
  for (const auto& entry : fs::directory_iterator(tmp_dir, ec)) {
    const std::string file = entry.path().filename().string();
    if (file.rfind(".rank-", 0) == 0) {
      fs::remove(entry.path(), ec);  // commit markers (FileCommitBoard) are not part of the checkpoint
      continue;
    }
    if (entry.is_regular_file() && file != kMetaFile) files.push_back(file);
  }
  if (ec) return Internal("listing " + tmp_dir.string() + ": " + ec.message());
  std::sort(files.begin(), files.end());
  YAML::Emitter out;
  out << YAML::BeginMap;
  out << YAML::Key << "format" << YAML::Value << kCheckpointFormat;
  out << YAML::Key << "step" << YAML::Value << meta.step;
  out << YAML::Key << "generation" << YAML::Value << meta.generation;
  out << YAML::Key << "job_id" << YAML::Value << meta.job_id;
  out << YAML::Key << "data_position" << YAML::Value << meta.data_position;
  out << YAML::Key << "world_size" << YAML::Value << meta.world_size;
  out << YAML::Key << "layout" << YAML::Value << meta.layout;
  out << YAML::Key << "topology" << YAML::Value << YAML::Flow << YAML::BeginMap << YAML::Key << "tp" << YAML::Value
      << meta.tp << YAML::Key << "dp" << YAML::Value << meta.dp << YAML::Key << "pp" << YAML::Value << meta.pp
      << YAML::Key << "zero" << YAML::Value << meta.zero << YAML::Key << "chunks" << YAML::Value << meta.chunks
      << YAML::EndMap;
  out << YAML::Key << "rng_state" << YAML::Value << meta.rng_state;
  out << YAML::Key << "files" << YAML::Value << YAML::BeginMap;
  for (const std::string& file : files) {
    const std::string path = (tmp_dir / file).string();
    LTRAIN_ASSIGN_OR_RETURN(std::string sum, FileChecksum(path));
    out << YAML::Key << file << YAML::Value << YAML::BeginMap << YAML::Key << "fnv1a64" << YAML::Value
        << sum << YAML::Key << "bytes" << YAML::Value << static_cast<uint64_t>(fs::file_size(path))
        << YAML::EndMap;
  }
  out << YAML::EndMap;
  out << YAML::Key << "recipe" << YAML::Value << YAML::Load(RecipeToYaml(recipe));
  out << YAML::EndMap;
  LTRAIN_RETURN_IF_ERROR(WriteFileSynced((tmp_dir / kMetaFile).string(), std::string(out.c_str()) + "\n"));
  LTRAIN_RETURN_IF_ERROR(FsyncPath(tmp_dir.string(), true));

  // Commit. A step directory of the same number can exist when a run resumed from an earlier
  // checkpoint passes it again; the new one replaces it.
  RemoveTree(final_dir);
  if (::rename(tmp_dir.c_str(), final_dir.c_str()) != 0) {
    return Internal("committing " + final_dir.string() + ": " + std::strerror(errno));
  }
  LTRAIN_RETURN_IF_ERROR(FsyncPath(dir, true));
  const std::string latest_tmp = (fs::path(dir) / ".latest.tmp").string();
  LTRAIN_RETURN_IF_ERROR(WriteFileSynced(latest_tmp, name + "\n"));
  const std::string latest = (fs::path(dir) / "latest").string();
  if (::rename(latest_tmp.c_str(), latest.c_str()) != 0) {
    return Internal("updating " + latest + ": " + std::strerror(errno));
  }
  LTRAIN_RETURN_IF_ERROR(FsyncPath(dir, true));
  PruneOld(dir, keep);
  return Status::Ok();
}

int64_t LatestCommittedStep(const std::string& dir) {
  std::ifstream in(fs::path(dir) / "latest");
  std::string name;
  if (!in || !std::getline(in, name)) return -1;
  return StepOfName(name);
}

StatusOr<CheckpointMeta> ReadCheckpointMeta(const std::string& step_dir, bool verify) {
  const std::string meta_path = (fs::path(step_dir) / kMetaFile).string();
  std::error_code ec;
  if (!fs::exists(meta_path, ec)) return DataLoss(std::string(kMetaFile) + " is missing");
  CheckpointMeta meta;
  YAML::Node root;
  try {
    root = YAML::LoadFile(meta_path);
  } catch (const std::exception& e) {
    return DataLoss(std::string(kMetaFile) + " is unparsable: " + e.what());
  }
  try {
    const int format = root["format"] ? root["format"].as<int>() : 1;
    if (format != kCheckpointFormat) {
      return DataLoss(std::string(kMetaFile) + " has format " + std::to_string(format) + "; this worker reads format " +
                      std::to_string(kCheckpointFormat));
    }
    meta.step = root["step"].as<int64_t>();
    meta.data_position = root["data_position"].as<int64_t>();
    meta.world_size = root["world_size"].as<int>();
    meta.generation = root["generation"].as<int>();
    meta.job_id = root["job_id"].as<std::string>();
    meta.layout = root["layout"].as<std::string>();
    const YAML::Node topo = root["topology"];
    meta.tp = topo["tp"].as<int>();
    meta.dp = topo["dp"].as<int>();
    meta.pp = topo["pp"].as<int>();
    meta.zero = topo["zero"].as<int>();
    meta.chunks = topo["chunks"].as<int>();
    meta.rng_state = root["rng_state"].as<std::string>();
    if (const YAML::Node recipe = root["recipe"]; recipe && recipe.IsMap()) {
      // Read field by field, not validated: the saved recipe passed validation when the run began.
      const YAML::Node data = recipe["data"], training = recipe["training"];
      if (data && data["sampling"]) meta.data_sampling = data["sampling"].as<std::string>();
      if (data && data["seed"]) {
        meta.data_seed = data["seed"].as<int64_t>();
      } else if (training && training["seed"]) {
        meta.data_seed = training["seed"].as<int64_t>();
      }
    }
    if (!root["files"] || !root["files"].IsMap() || root["files"].size() == 0) {
      return DataLoss(std::string(kMetaFile) + " lists no files");
    }
    if (!verify) return meta;
    for (const auto& file : root["files"]) {
      const std::string name = file.first.as<std::string>();
      const std::string path = (fs::path(step_dir) / name).string();
      if (!fs::exists(path, ec)) return DataLoss(name + " is missing");
      const uint64_t bytes = fs::file_size(path, ec);
      const uint64_t expected_bytes = file.second["bytes"].as<uint64_t>();
      if (bytes != expected_bytes) {
        return DataLoss(name + " size mismatch: expected " + std::to_string(expected_bytes) + " bytes, got " +
                        std::to_string(bytes));
      }
      LTRAIN_ASSIGN_OR_RETURN(std::string sum, FileChecksum(path));
      const std::string expected = file.second["fnv1a64"].as<std::string>();
      if (expected != sum) return DataLoss(name + " checksum mismatch: expected " + expected + ", got " + sum);
    }
  } catch (const std::exception& e) {
    return DataLoss(std::string(kMetaFile) + " is incomplete: " + e.what());
  }
  return meta;
}

StatusOr<ResumeChoice> ChooseResumeCheckpoint(const std::string& path) {
  std::error_code ec;
  const fs::path root(path);
  const bool step_dir = fs::exists(root / kMetaFile, ec) || StepOfName(root.filename().string()) >= 0;
  if (step_dir) {
    StatusOr<CheckpointMeta> meta = ReadCheckpointMeta(path, true);
    if (!meta.ok()) return DataLoss("checkpoint " + path + " is corrupt (" + meta.status().message() + ")");
    return ResumeChoice{path, *meta, {}};
  }
  if (!fs::is_directory(root, ec)) {
    return NotFound("checkpoint.resume_from=" + path + " is neither a step directory nor a checkpoint directory");
  }
  // latest first, then every older step, newest first.
  std::vector<int64_t> steps;
  for (const auto& entry : fs::directory_iterator(root, ec)) {
    const int64_t n = StepOfName(entry.path().filename().string());
    if (n >= 0 && entry.is_directory()) steps.push_back(n);
  }
  std::sort(steps.rbegin(), steps.rend());
  std::vector<int64_t> order;
  const int64_t latest = LatestCommittedStep(path);
  if (latest >= 0) {
    order.push_back(latest);
    for (int64_t n : steps) {
      if (n < latest) order.push_back(n);
    }
  } else {
    order = steps;
  }
  if (order.empty()) return NotFound("checkpoint directory " + path + " holds no committed step (no latest, no step-N)");
  ResumeChoice choice;
  for (int64_t n : order) {
    const std::string name = "step-" + std::to_string(n);
    const std::string dir = (root / name).string();
    StatusOr<CheckpointMeta> meta = fs::is_directory(dir, ec) ? ReadCheckpointMeta(dir, true)
                                                               : StatusOr<CheckpointMeta>(DataLoss("the directory is missing"));
    if (meta.ok()) {
      choice.step_dir = dir;
      choice.meta = *meta;
      return choice;
    }
    choice.skipped.push_back("checkpoint " + name + " is corrupt (" + meta.status().message() + ")");
  }
  std::string why;
  for (const std::string& s : choice.skipped) why += "; " + s;
  return DataLoss("no valid checkpoint in " + path + why.substr(1));
}

StatusOr<TensorReader> OpenTensorArchive(const std::string& path) {
  auto archive = std::make_shared<torch::serialize::InputArchive>();
  try {
    archive->load_from(path);
  } catch (const c10::Error& e) {
    return DataLoss("loading checkpoint file " + path + ": " + e.what_without_backtrace());
  }
  return TensorReader([archive, path](const std::string& key) -> StatusOr<torch::Tensor> {
    torch::Tensor t;
    try {
      if (!archive->try_read(key, t)) return DataLoss(path + " has no tensor " + key + " (saved by another layout?)");
    } catch (const c10::Error& e) {
      return DataLoss("reading " + key + " from " + path + ": " + e.what_without_backtrace());
    }
    return t;
  });
}

namespace {

fs::path Marker(const std::string& dir, int64_t step, int rank, bool done) {
  return fs::path(PendingCheckpointDir(dir, step)) / (".rank-" + std::to_string(rank) + (done ? ".done" : ".failed"));
}

}  // namespace

Status FileCommitBoard::Announce(int64_t step, int rank, const std::string& error) {
  const fs::path marker = Marker(dir_, step, rank, error.empty());
  std::error_code ec;
  fs::create_directories(marker.parent_path(), ec);
  const std::string tmp = marker.string() + ".tmp";
  LTRAIN_RETURN_IF_ERROR(WriteFileSynced(tmp, error));
  if (::rename(tmp.c_str(), marker.c_str()) != 0) {
    return Internal("announcing checkpoint step-" + std::to_string(step) + ": renaming " + tmp + ": " + std::strerror(errno));
  }
  return FsyncPath(marker.parent_path().string(), true);
}

StatusOr<std::vector<std::string>> FileCommitBoard::Collect(int64_t step, int world_size,
                                                            std::chrono::milliseconds timeout,
                                                            const std::atomic<bool>* cancel) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  std::vector<std::string> words(world_size);
  std::vector<bool> heard(world_size, false);
  int missing = world_size;
  while (true) {
    std::error_code ec;
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
