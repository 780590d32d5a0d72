#include "common/checkpoint_manifest.h"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>

#include <yaml-cpp/yaml.h>

#include "common/files.h"
#include "common/safetensors.h"

namespace ltrain {
namespace fs = std::filesystem;

std::string StepDirName(int64_t step) { return "step-" + std::to_string(step); }

int64_t StepOfName(const std::string& name) {
  if (name.rfind("step-", 0) != 0 || name.size() == 5 || name.size() > 5 + 18) return -1;
  int64_t n = 0;
  for (size_t i = 5; i < name.size(); ++i) {
    if (name[i] < '0' || name[i] > '9') return -1;
    n = n * 10 + (name[i] - '0');
  }
  return n;
}

bool IsPlainFileName(const std::string& name) {
  return !name.empty() && name != "." && name != ".." && name.find('/') == std::string::npos &&
         name.find('\0') == std::string::npos;
}

std::string HashMismatch(const std::string& file, const std::string& expected, const std::string& got) {
  return file + " xxh3 mismatch: expected " + expected + ", got " + got;
}

namespace {

void EmitFiles(YAML::Emitter& out, const std::map<std::string, CheckpointFile>& files) {
  out << YAML::BeginMap;
  for (const auto& [name, file] : files) {
    out << YAML::Key << name << YAML::Value << YAML::Flow << YAML::BeginMap << YAML::Key << "bytes" << YAML::Value
        << file.bytes << YAML::Key << "xxh3" << YAML::Value << file.xxh3 << YAML::EndMap;
  }
  out << YAML::EndMap;
}

StatusOr<std::map<std::string, CheckpointFile>> ParseFiles(const YAML::Node& node, const std::string& where) {
  std::map<std::string, CheckpointFile> files;
  if (!node || !node.IsMap()) return DataLoss(where + " lists no files");
  for (const auto& item : node) {
    const std::string name = item.first.as<std::string>();
    if (!IsPlainFileName(name)) {
      return DataLoss(where + " lists '" + name + "', which is not a plain file name in its directory");
    }
    if (!item.second.IsMap() || !item.second["bytes"] || !item.second["xxh3"]) {
      return DataLoss(where + ": " + name + " needs bytes and xxh3");
    }
    files[name] = CheckpointFile{item.second["bytes"].as<uint64_t>(), item.second["xxh3"].as<std::string>()};
  }
  return files;
}

// Floats as the hex of their bits (8 digits each, most significant first), and back.
std::string FloatsHex(const std::vector<float>& values) {
  std::string out;
  char digits[9];
  for (float v : values) {
    uint32_t bits = 0;
    std::memcpy(&bits, &v, sizeof(bits));
    std::snprintf(digits, sizeof(digits), "%08x", bits);
    out += digits;
  }
  return out;
}
std::optional<std::vector<float>> FloatsOfHex(const std::string& hex) {
  if (hex.size() % 8 != 0 || hex.find_first_not_of("0123456789abcdef") != std::string::npos) return std::nullopt;
  std::vector<float> out;
  for (size_t i = 0; i < hex.size(); i += 8) {
    const uint32_t bits = static_cast<uint32_t>(std::stoul(hex.substr(i, 8), nullptr, 16));
    float v = 0;
    std::memcpy(&v, &bits, sizeof(v));
    out.push_back(v);
  }
  return out;
}

}  // namespace

std::string CheckpointMetaYaml(const CheckpointMeta& meta, const std::string& recipe_yaml) {
  YAML::Emitter out;
  out << YAML::BeginMap;
  out << YAML::Key << "format" << YAML::Value << kCheckpointFormat;
  out << YAML::Key << "step" << YAML::Value << meta.step;
  out << YAML::Key << "commit" << YAML::Value << meta.commit;
  out << YAML::Key << "generation" << YAML::Value << meta.generation;
  out << YAML::Key << "job_id" << YAML::Value << meta.job_id;
  out << YAML::Key << "data_position" << YAML::Value << meta.data_position;
  // Said outright: the saved recipe leaves data.sampling out at its default, which has changed.
  if (!meta.data_sampling.empty()) out << YAML::Key << "data_sampling" << YAML::Value << meta.data_sampling;
  out << YAML::Key << "world_size" << YAML::Value << meta.world_size;
  out << YAML::Key << "layout" << YAML::Value << meta.layout;
  out << YAML::Key << "topology" << YAML::Value << YAML::Flow << YAML::BeginMap << YAML::Key << "tp" << YAML::Value
      << meta.tp << YAML::Key << "dp" << YAML::Value << meta.dp << YAML::Key << "pp" << YAML::Value << meta.pp
      << YAML::Key << "zero" << YAML::Value << meta.zero << YAML::Key << "chunks" << YAML::Value << meta.chunks
      << YAML::EndMap;
  out << YAML::Key << "rng_state" << YAML::Value << meta.rng_state;
  if (!meta.router_bias.empty()) {
    out << YAML::Key << "router_bias" << YAML::Value << YAML::BeginMap;
    for (const auto& [layer, bias] : meta.router_bias) out << YAML::Key << layer << YAML::Value << FloatsHex(bias);
    out << YAML::EndMap;
  }
  out << YAML::Key << "files" << YAML::Value;
  EmitFiles(out, meta.files);
  if (!recipe_yaml.empty()) out << YAML::Key << "recipe" << YAML::Value << YAML::Load(recipe_yaml);
  out << YAML::EndMap;
  return std::string(out.c_str()) + "\n";
}

StatusOr<std::string> ReadCheckpointRecipeYaml(const std::string& step_dir) {
  const std::string meta_path = (fs::path(step_dir) / kCheckpointMetaFile).string();
  std::error_code ec;
  if (!fs::exists(meta_path, ec)) return NotFound(meta_path + " does not exist: not a checkpoint step directory");
  try {
    const YAML::Node recipe = YAML::LoadFile(meta_path)["recipe"];
    if (!recipe || !recipe.IsMap()) return NotFound(meta_path + " holds no recipe");
    YAML::Emitter out;
    out << recipe;
    return std::string(out.c_str()) + "\n";
  } catch (const std::exception& e) {
    return DataLoss(meta_path + " is unparsable: " + e.what());
  }
}

StatusOr<CheckpointMeta> ReadCheckpointMeta(const std::string& step_dir) {
  const std::string meta_path = (fs::path(step_dir) / kCheckpointMetaFile).string();
  std::error_code ec;
  if (!fs::exists(meta_path, ec)) return DataLoss(std::string(kCheckpointMetaFile) + " is missing");
  YAML::Node root;
  try {
    root = YAML::LoadFile(meta_path);
  } catch (const std::exception& e) {
    return DataLoss(std::string(kCheckpointMetaFile) + " is unparsable: " + e.what());
  }
  CheckpointMeta meta;
  try {
    if (!root.IsMap()) return DataLoss(std::string(kCheckpointMetaFile) + " is not a map");
    meta.format = root["format"] ? root["format"].as<int>() : 1;
    if (meta.format != kCheckpointFormat) {
      return FailedPrecondition(
          std::string(kCheckpointMetaFile) + " has format " + std::to_string(meta.format) + " (" +
          (meta.format < kCheckpointFormat ? "torch archives" : "newer than this ltrain") + "); this ltrain reads format " +
          std::to_string(kCheckpointFormat) + " (safetensors shards) only: continue that run with the ltrain version "
          "that wrote it, or start this one without checkpoint.resume_from");
    }
    meta.step = root["step"].as<int64_t>();
    meta.commit = root["commit"] ? root["commit"].as<int64_t>() : -1;
    meta.data_position = root["data_position"].as<int64_t>();
    meta.world_size = root["world_size"].as<int>();
    meta.generation = root["generation"].as<int>();
    meta.job_id = root["job_id"] && !root["job_id"].IsNull() ? root["job_id"].as<std::string>() : "";
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
      // Written before data_sampling was: the recipe's, or hash, the default then.
      meta.data_sampling = data && data["sampling"] ? data["sampling"].as<std::string>() : "hash";
      if (data && data["seed"]) {
        meta.data_seed = data["seed"].as<int64_t>();
      } else if (training && training["seed"]) {
        meta.data_seed = training["seed"].as<int64_t>();
      }
    }
    if (root["data_sampling"]) meta.data_sampling = root["data_sampling"].as<std::string>();
    if (const YAML::Node bias = root["router_bias"]; bias && bias.IsMap()) {
      for (const auto& item : bias) {
        std::optional<std::vector<float>> floats = FloatsOfHex(item.second.as<std::string>());
        if (!floats) return DataLoss(std::string(kCheckpointMetaFile) + ": router_bias of block " +
                                     item.first.as<std::string>() + " is not hex of floats");
        meta.router_bias[item.first.as<int>()] = std::move(*floats);
      }
    }
    LTRAIN_ASSIGN_OR_RETURN(meta.files, ParseFiles(root["files"], kCheckpointMetaFile));
    if (meta.files.empty()) return DataLoss(std::string(kCheckpointMetaFile) + " lists no files");
  } catch (const std::exception& e) {
    return DataLoss(std::string(kCheckpointMetaFile) + " is incomplete: " + e.what());
  }
  return meta;
}

Status CheckCheckpointFiles(const std::string& step_dir, const CheckpointMeta& meta) {
  for (const auto& [name, file] : meta.files) {
    std::error_code ec;
    const fs::path path = fs::path(step_dir) / name;
    const uint64_t bytes = fs::file_size(path, ec);
    if (ec) return DataLoss(name + " is missing");
    if (bytes != file.bytes) {
      return DataLoss(name + " size mismatch: expected " + std::to_string(file.bytes) + " bytes, got " +
                      std::to_string(bytes));
    }
  }
  return Status::Ok();
}

Status VerifyCheckpointFiles(const std::string& step_dir, const CheckpointMeta& meta) {
  LTRAIN_RETURN_IF_ERROR(CheckCheckpointFiles(step_dir, meta));
  for (const auto& [name, file] : meta.files) {
    LTRAIN_ASSIGN_OR_RETURN(FileDigest digest, HashFile((fs::path(step_dir) / name).string()));
    if (digest.xxh3 != file.xxh3) return DataLoss(HashMismatch(name, file.xxh3, digest.xxh3));
  }
  return Status::Ok();
}

std::string RankManifestName(int rank) { return "rank-" + std::to_string(rank) + ".yaml"; }

bool IsRankManifestName(const std::string& name) {
  if (name.rfind("rank-", 0) != 0 || name.size() <= 10 || name.substr(name.size() - 5) != ".yaml") return false;
  return std::all_of(name.begin() + 5, name.end() - 5, [](char c) { return c >= '0' && c <= '9'; });
}

Status WriteRankManifest(const std::string& pending_dir, int rank, const std::map<std::string, CheckpointFile>& files) {
  YAML::Emitter out;
  out << YAML::BeginMap << YAML::Key << "rank" << YAML::Value << rank << YAML::Key << "files" << YAML::Value;
  EmitFiles(out, files);
  out << YAML::EndMap;
  return WriteFileAtomically((fs::path(pending_dir) / RankManifestName(rank)).string(), std::string(out.c_str()) + "\n");
}

StatusOr<std::map<std::string, CheckpointFile>> ReadRankManifests(const std::string& pending_dir) {
  std::map<std::string, CheckpointFile> all;
  std::error_code ec;
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(pending_dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (IsRankManifestName(name)) names.push_back(name);
  }
  if (ec) return Internal("listing " + pending_dir + ": " + ec.message());
  std::sort(names.begin(), names.end());
  for (const std::string& name : names) {
    YAML::Node root;
    try {
      root = YAML::LoadFile((fs::path(pending_dir) / name).string());
    } catch (const std::exception& e) {
      return DataLoss(name + " is unparsable: " + e.what());
    }
    StatusOr<std::map<std::string, CheckpointFile>> files = DataLoss(name + " is not a map");
    try {
      if (root.IsMap()) files = ParseFiles(root["files"], name);
    } catch (const std::exception& e) {
      return DataLoss(name + " is incomplete: " + e.what());
    }
    if (!files.ok()) return files.status();
    for (const auto& [file, digest] : *files) {
      if (!all.emplace(file, digest).second) return DataLoss(file + " is listed by two ranks' manifests");
    }
  }
  return all;
}

int64_t LatestCommittedStep(const std::string& dir) {
  std::ifstream in(fs::path(dir) / "latest");
  std::string name;
  if (!in || !std::getline(in, name)) return -1;
  return StepOfName(name);
}

std::vector<CommittedStep> ListCommittedSteps(const std::string& dir) {
  std::vector<CommittedStep> steps;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const int64_t n = StepOfName(entry.path().filename().string());
    if (n < 0 || !entry.is_directory(ec)) continue;
    CommittedStep step;
    step.step = n;
    // Only the few fields needed, without the recipe's validation.
    try {
      const YAML::Node root = YAML::LoadFile((entry.path() / kCheckpointMetaFile).string());
      if (root.IsMap()) {
        step.readable = true;
        if (root["commit"]) step.commit = root["commit"].as<int64_t>();
        if (root["job_id"] && !root["job_id"].IsNull()) step.job_id = root["job_id"].as<std::string>();
      }
    } catch (const std::exception&) {
      step.readable = false;
    }
    steps.push_back(step);
  }
  std::sort(steps.begin(), steps.end(), [](const CommittedStep& a, const CommittedStep& b) { return a.step < b.step; });
  return steps;
}

int64_t NextCommitNumber(const std::vector<CommittedStep>& steps) {
  int64_t newest = 0;
  for (const CommittedStep& s : steps) newest = std::max(newest, s.commit);
  return newest + 1;
}

std::vector<int64_t> StepsToPrune(std::vector<CommittedStep> steps, int keep, int64_t latest) {
  std::vector<int64_t> prune;
  if (keep <= 0) return prune;
  // Newest first: by commit, then (for steps without one) by step number.
  std::sort(steps.begin(), steps.end(), [](const CommittedStep& a, const CommittedStep& b) {
    return a.commit != b.commit ? a.commit > b.commit : a.step > b.step;
  });
  int kept = 0;
  for (const CommittedStep& s : steps) {
    if (s.step == latest || kept < keep) {
      ++kept;
      continue;
    }
    prune.push_back(s.step);
  }
  return prune;
}

Status CheckCheckpointDirWritable(const std::string& dir, int rank) {
  namespace fs = std::filesystem;
  auto refuse = [&](const std::string& why) {
    return FailedPrecondition("checkpoint.dir " + dir + " cannot be written: " + why +
                              "; set checkpoint.dir to a directory every node can write (or checkpoint.enabled: false)");
  };
  if (Status made = CreateDirectories(dir, 0777); !made.ok()) return refuse(made.message());
  const fs::path probe = fs::path(dir) / (".write-test-rank-" + std::to_string(rank));
  std::error_code ec;
  if (Status written = WriteFileText(probe.string(), "ltrain\n"); !written.ok()) return refuse(written.message());
  fs::remove(probe, ec);
  if (ec) return refuse("removing " + probe.string() + ": " + ec.message());
  return Status::Ok();
}

std::optional<CommittedStep> ForeignCheckpoint(const std::string& dir, const std::string& job_id) {
  std::vector<CommittedStep> steps = ListCommittedSteps(dir);
  for (auto it = steps.rbegin(); it != steps.rend(); ++it) {
    if (it->readable && it->job_id != job_id) return *it;
  }
  return std::nullopt;
}

std::string CheckpointOwnershipError(const std::string& dir, const CommittedStep& owner, const std::string& who) {
  const std::string owner_name =
      owner.job_id.empty() ? "a run without a job id (ltrain-worker started by hand)" : "job " + owner.job_id;
  return "checkpoint directory " + dir + " belongs to " + owner_name + " (its " + StepDirName(owner.step) +
         "); " + who + " would mix its checkpoints with that job's and prune them. Set checkpoint.dir to another "
         "directory, or set checkpoint.dir elsewhere and checkpoint.resume_from=" + dir +
         " to start from that job's newest checkpoint (it is read there; this job writes to its own directory)";
}

}  // namespace ltrain
