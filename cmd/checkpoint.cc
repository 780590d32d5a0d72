// ltrain checkpoint inspect DIR: what a committed checkpoint holds (step, job, layout, files with
// sizes and hashes) and whether it verifies; reads the manifest and the files only (no LibTorch).
#include <cstdio>
#include <filesystem>
#include <memory>

#include <google/protobuf/struct.pb.h>

#include "cmd/cli_support.h"
#include "cmd/commands.h"
#include "common/checkpoint_manifest.h"
#include "common/safetensors.h"

namespace ltrain::cli {
namespace {

namespace fs = std::filesystem;

struct InspectArgs {
  std::string dir;
  bool verify = false;
  std::string output = "text";
};

struct FileCheck {
  std::string name;
  CheckpointFile expected;
  uint64_t bytes = 0;      // on disk
  std::string xxh3;        // re-hashed (--verify), else empty
  std::string problem;     // empty: as listed
};

// DIR itself when it is a step directory, else the step its `latest` names.
StatusOr<std::string> ResolveStepDir(const std::string& dir) {
  std::error_code ec;
  if (fs::exists(fs::path(dir) / kCheckpointMetaFile, ec) || StepOfName(fs::path(dir).filename().string()) >= 0) {
    return dir;
  }
  if (!fs::is_directory(dir, ec)) return NotFound(dir + " is not a directory");
  const int64_t latest = LatestCommittedStep(dir);
  if (latest < 0) return NotFound(dir + " is neither a step directory (no meta.yaml) nor a checkpoint directory (no latest)");
  return (fs::path(dir) / StepDirName(latest)).string();
}

std::string Megabytes(uint64_t bytes) {
  char text[32];
  std::snprintf(text, sizeof(text), "%.1f MB", static_cast<double>(bytes) / 1e6);
  return text;
}

int Inspect(const InspectArgs& args) {
  StatusOr<std::string> step_dir = ResolveStepDir(args.dir);
  if (!step_dir.ok()) {
    std::fprintf(stderr, "ltrain checkpoint inspect: %s\n", step_dir.status().message().c_str());
    return kExitInvalid;
  }
  StatusOr<CheckpointMeta> meta = ReadCheckpointMeta(*step_dir);
  if (!meta.ok()) {
    std::fprintf(stderr, "ltrain checkpoint inspect: %s: %s\n", step_dir->c_str(), meta.status().message().c_str());
    return kExitInvalid;
  }
  std::vector<FileCheck> checks;
  uint64_t total = 0;
  bool ok = true;
  for (const auto& [name, file] : meta->files) {
    FileCheck check;
    check.name = name;
    check.expected = file;
    const std::string path = (fs::path(*step_dir) / name).string();
    std::error_code ec;
    check.bytes = fs::file_size(path, ec);
    if (ec) {
      check.bytes = 0;
      check.problem = "missing";
    } else if (check.bytes != file.bytes) {
      check.problem = "size mismatch: expected " + std::to_string(file.bytes) + " bytes";
    } else if (args.verify) {
      StatusOr<FileDigest> digest = HashFile(path);
      if (!digest.ok()) {
        check.problem = digest.status().message();
      } else {
        check.xxh3 = digest->xxh3;
        if (digest->xxh3 != file.xxh3) check.problem = "xxh3 mismatch: got " + digest->xxh3;
      }
    }
    ok = ok && check.problem.empty();
    total += file.bytes;
    checks.push_back(check);
  }
  const std::string verdict = !ok           ? "no"
                              : args.verify ? "yes (every file re-hashed)"
                                            : "sizes match (--verify re-hashes every file)";
  if (args.output == "json") {
    google::protobuf::Struct out;
    auto& f = *out.mutable_fields();
    f["path"].set_string_value(*step_dir);
    f["step"].set_number_value(static_cast<double>(meta->step));
    f["commit"].set_number_value(static_cast<double>(meta->commit));
    f["job_id"].set_string_value(meta->job_id);
    f["generation"].set_number_value(meta->generation);
    f["format"].set_number_value(meta->format);
    f["layout"].set_string_value(meta->layout);
    f["world_size"].set_number_value(meta->world_size);
    f["data_position"].set_number_value(static_cast<double>(meta->data_position));
    f["total_bytes"].set_number_value(static_cast<double>(total));
    f["verified"].set_bool_value(ok && args.verify);
    f["ok"].set_bool_value(ok);
    google::protobuf::ListValue* files = f["files"].mutable_list_value();
    for (const FileCheck& c : checks) {
      auto& file = *files->add_values()->mutable_struct_value()->mutable_fields();
      file["name"].set_string_value(c.name);
      file["bytes"].set_number_value(static_cast<double>(c.expected.bytes));
      file["xxh3"].set_string_value(c.expected.xxh3);
      file["ok"].set_bool_value(c.problem.empty());
      if (!c.problem.empty()) file["problem"].set_string_value(c.problem);
    }
    std::printf("%s\n", ToJson(out).c_str());
  } else {
    std::printf("checkpoint %s\n", step_dir->c_str());
    std::printf("  step        %lld (commit %lld, format %d)\n", static_cast<long long>(meta->step),
                static_cast<long long>(meta->commit), meta->format);
    std::printf("  job         %s (generation %d)\n", meta->job_id.empty() ? "(none)" : meta->job_id.c_str(),
                meta->generation);
    std::printf("  layout      %s, world size %d\n", meta->layout.c_str(), meta->world_size);
    std::printf("  data        position %lld\n", static_cast<long long>(meta->data_position));
    std::printf("  files\n");
    for (const FileCheck& c : checks) {
      std::printf("    %-32s %14llu bytes  xxh3 %s%s%s\n", c.name.c_str(), static_cast<unsigned long long>(c.expected.bytes),
                  c.expected.xxh3.c_str(), c.problem.empty() ? "" : "  ", c.problem.c_str());
    }
    std::printf("  total       %zu file(s), %llu bytes (%s)\n", checks.size(), static_cast<unsigned long long>(total),
                Megabytes(total).c_str());
    std::printf("  verifies    %s\n", verdict.c_str());
  }
  return ok ? kExitOk : kExitFailed;
}

}  // namespace

void AddCheckpointCommand(CLI::App& app, CommandContext& ctx) {
  CLI::App* checkpoint = app.add_subcommand("checkpoint", "Look into checkpoints");
  checkpoint->require_subcommand(1);
  auto args = std::make_shared<InspectArgs>();
  CLI::App* inspect = checkpoint->add_subcommand(
      "inspect", "Step, job, layout and files (sizes, hashes) of a checkpoint, and whether it verifies");
  inspect->add_option("dir", args->dir, "A step directory, or a checkpoint directory (its latest step)")->required();
  inspect->add_flag("--verify", args->verify, "Re-hash every file (reads them all) instead of checking sizes only");
  AddOutputOption(inspect, &args->output, "text");
  ctx.Bind(inspect, [args] { return Inspect(*args); });
}

}  // namespace ltrain::cli
