#include "worker/checkpoint.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <vector>

#include <torch/serialize.h>
#include <yaml-cpp/yaml.h>

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
  for (size_t i = 0; i + keep < steps.size(); ++i) fs::remove_all(steps[i].second, ec);
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

Status PrepareCheckpoint(const std::string& dir, int64_t step) {
  const fs::path tmp_dir = PendingCheckpointDir(dir, step);
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return InvalidArgument("cannot create checkpoint directory " + dir + ": " + ec.message());
  fs::remove_all(tmp_dir, ec);  // left over by a crash mid-write
  fs::create_directories(tmp_dir, ec);
  if (ec) return Internal("cannot create " + tmp_dir.string() + ": " + ec.message());
  return Status::Ok();
}

Status WriteTensorArchive(const std::string& path, const std::vector<std::pair<std::string, torch::Tensor>>& tensors) {
  try {
    torch::serialize::OutputArchive archive;
    for (const auto& [key, tensor] : tensors) archive.write(key, tensor.detach().cpu().contiguous());
    archive.save_to(path);
  } catch (const c10::Error& e) {
    return Internal("writing " + path + ": " + e.what_without_backtrace());
  }
  return FsyncPath(path, false);
}

Status CommitCheckpoint(const std::string& dir, const CheckpointMeta& meta, const Recipe& recipe, int keep) {
  const std::string name = "step-" + std::to_string(meta.step);
  const fs::path final_dir = fs::path(dir) / name;
  const fs::path tmp_dir = PendingCheckpointDir(dir, meta.step);
  std::error_code ec;
  std::vector<std::string> files;
  for (const auto& entry : fs::directory_iterator(tmp_dir, ec)) {
    if (entry.is_regular_file() && entry.path().filename() != kMetaFile) files.push_back(entry.path().filename().string());
  }
  if (ec) return Internal("listing " + tmp_dir.string() + ": " + ec.message());
  std::sort(files.begin(), files.end());
  YAML::Emitter out;
  out << YAML::BeginMap;
  out << YAML::Key << "step" << YAML::Value << meta.step;
  out << YAML::Key << "data_position" << YAML::Value << meta.data_position;
  out << YAML::Key << "world_size" << YAML::Value << meta.world_size;
  out << YAML::Key << "generation" << YAML::Value << meta.generation;
  out << YAML::Key << "job_id" << YAML::Value << meta.job_id;
  out << YAML::Key << "layout" << YAML::Value << meta.layout;
  out << YAML::Key << "files" << YAML::Value << YAML::BeginMap;
  for (const std::string& file : files) {
    const std::string path = (tmp_dir / file).string();
    StatusOr<std::string> sum = FileChecksum(path);
    if (!sum.ok()) return sum.status();
    out << YAML::Key << file << YAML::Value << YAML::BeginMap << YAML::Key << "fnv1a64" << YAML::Value
        << *sum << YAML::Key << "bytes" << YAML::Value << static_cast<uint64_t>(fs::file_size(path))
        << YAML::EndMap;
  }
  out << YAML::EndMap;
  out << YAML::Key << "recipe" << YAML::Value << YAML::Load(RecipeToYaml(recipe));
  out << YAML::EndMap;
  if (Status s = WriteFileSynced((tmp_dir / kMetaFile).string(), std::string(out.c_str()) + "\n"); !s.ok()) {
    return s;
  }
  if (Status s = FsyncPath(tmp_dir.string(), true); !s.ok()) return s;

  // Commit. A step directory of the same number can exist when a run resumed from an earlier
  // checkpoint passes it again; the new one replaces it.
  fs::remove_all(final_dir, ec);
  if (::rename(tmp_dir.c_str(), final_dir.c_str()) != 0) {
    return Internal("committing " + final_dir.string() + ": " + std::strerror(errno));
  }
  if (Status s = FsyncPath(dir, true); !s.ok()) return s;
  const std::string latest_tmp = (fs::path(dir) / ".latest.tmp").string();
  if (Status s = WriteFileSynced(latest_tmp, name + "\n"); !s.ok()) return s;
  const std::string latest = (fs::path(dir) / "latest").string();
  if (::rename(latest_tmp.c_str(), latest.c_str()) != 0) {
    return Internal("updating " + latest + ": " + std::strerror(errno));
  }
  if (Status s = FsyncPath(dir, true); !s.ok()) return s;
  PruneOld(dir, keep);
  return Status::Ok();
}

StatusOr<std::string> ResolveCheckpoint(const std::string& path) {
  std::error_code ec;
  if (fs::exists(fs::path(path) / kMetaFile, ec)) return path;
  const fs::path latest = fs::path(path) / "latest";
  if (fs::exists(latest, ec)) {
    std::ifstream in(latest);
    std::string name;
    std::getline(in, name);
    if (StepOfName(name) < 0) return DataLoss(latest.string() + " does not name a step directory: '" + name + "'");
    const fs::path step_dir = fs::path(path) / name;
    if (!fs::exists(step_dir / kMetaFile, ec)) {
      return DataLoss(latest.string() + " names " + step_dir.string() + ", which has no " + kMetaFile);
    }
    return step_dir.string();
  }
  return NotFound("checkpoint.resume_from=" + path +
                  " is neither a step directory (with meta.yaml) nor a checkpoint directory (with latest)");
}

StatusOr<CheckpointMeta> ReadCheckpointMeta(const std::string& step_dir) {
  const std::string meta_path = (fs::path(step_dir) / kMetaFile).string();
  CheckpointMeta meta;
  YAML::Node root;
  try {
    root = YAML::LoadFile(meta_path);
    meta.step = root["step"].as<int64_t>();
    meta.data_position = root["data_position"].as<int64_t>();
    meta.world_size = root["world_size"].as<int>();
    if (root["generation"]) meta.generation = root["generation"].as<int>();
    if (root["job_id"]) meta.job_id = root["job_id"].as<std::string>();
    if (root["layout"]) meta.layout = root["layout"].as<std::string>();
    for (const auto& file : root["files"]) {
      const std::string name = file.first.as<std::string>();
      const std::string path = (fs::path(step_dir) / name).string();
      StatusOr<std::string> sum = FileChecksum(path);
      if (!sum.ok()) return sum.status();
      const std::string expected = file.second["fnv1a64"].as<std::string>();
      if (expected != *sum) {
        return DataLoss("checkpoint file " + path + " is corrupt: checksum " + *sum + ", meta.yaml says " + expected);
      }
    }
  } catch (const std::exception& e) {
    return DataLoss("reading " + meta_path + ": " + e.what());
  }
  return meta;
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

}  // namespace ltrain::worker
