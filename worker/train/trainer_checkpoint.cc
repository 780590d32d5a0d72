// The trainer's checkpoints (part of Trainer, trainer.h): a resume that reads the newest commit every
// rank verifies and places it in this layout, whatever layout saved it, and a save that snapshots this
// rank's state and hands it to the checkpoint writer.
#include "worker/train/trainer.h"

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <tuple>

#include <ATen/CPUGeneratorImpl.h>
#include <c10/util/Exception.h>

#include "common/safetensors.h"
#include "worker/checkpoint/checkpoint.h"
#include "worker/checkpoint/checkpoint_writer.h"
#include "worker/control/progress.h"
#include "worker/plan/flat_layout.h"
#include "worker/plan/topology.h"
#include "worker/torch_compat.h"
#include "worker/train/trainer_internal.h"

namespace ltrain::worker {
namespace {

std::string RngStateHex() {
  at::Generator gen = at::detail::getDefaultCPUGenerator();
  torch::Tensor state;
  {
    std::lock_guard<std::mutex> lock(gen.mutex());
    state = gen.get_state().contiguous();
  }
  static const char* kHex = "0123456789abcdef";
  const uint8_t* bytes = state.data_ptr<uint8_t>();
  std::string out;
  out.reserve(static_cast<size_t>(state.numel()) * 2);
  for (int64_t i = 0; i < state.numel(); ++i) {
    out.push_back(kHex[bytes[i] >> 4]);
    out.push_back(kHex[bytes[i] & 15]);
  }
  return out;
}

Status RestoreRngState(const std::string& hex) {
  if (hex.empty() || hex.size() % 2 != 0) return DataLoss("checkpoint rng_state is malformed");
  torch::Tensor state = torch::empty({static_cast<int64_t>(hex.size() / 2)}, torch::kByte);
  uint8_t* bytes = state.data_ptr<uint8_t>();
  auto nibble = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
  };
  for (size_t i = 0; i < hex.size(); i += 2) {
    const int hi = nibble(hex[i]), lo = nibble(hex[i + 1]);
    if (hi < 0 || lo < 0) return DataLoss("checkpoint rng_state is not hex");
    bytes[i / 2] = static_cast<uint8_t>(hi * 16 + lo);
  }
  at::Generator gen = at::detail::getDefaultCPUGenerator();
  try {
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(state);
  } catch (const c10::Error& e) {
    return DataLoss(std::string("checkpoint rng_state does not fit this LibTorch: ") + e.what_without_backtrace());
  }
  return Status::Ok();
}

}  // namespace

// A checkpoint whose saved recipe gives the parameters other shapes is refused before a byte is read: the
// ranges of the shards could still cover what this model needs, and it would train on misplaced weights.
// (A saved recipe that does not read, from an older format, is left to the shards' own checks.)
StatusOr<ResumeChoice> Trainer::RefuseAnotherModel(ResumeChoice choice) const {
  StatusOr<std::string> yaml = ReadCheckpointRecipeYaml(choice.step_dir);
  if (!yaml.ok()) return choice;
  const RecipeParseResult saved = ParseRecipe(*yaml, choice.step_dir + "/meta.yaml");
  if (!saved.ok()) return choice;
  const std::string differences = ModelShapeDifferences(saved.recipe.model, recipe_.model);
  if (differences.empty()) return choice;
  return FailedPrecondition("checkpoint " + choice.step_dir + " was saved by another model: " + differences +
                            ". Resume it with the recipe that saved it (its meta.yaml holds that recipe), or train "
                            "this model without checkpoint.resume_from");
}

// Rank 0 picks the checkpoint (meta.yaml, files present with their sizes) and tells the others
// which step; every rank reads and verifies the files it needs; a file that does not verify, on any
// rank, sends every rank to the next older commit.
Status Trainer::Resume(const std::string& path) {
  namespace fs = std::filesystem;
  const int rank = groups_->rank;
  const int world = layout_.world_size;
  const auto start = SteadyClock::now();
  std::map<int64_t, std::string> rejected;  // rank 0: steps some rank could not verify, and why
  std::set<std::string> printed;
  std::string step_dir;
  CheckpointMeta loaded;
  double bytes = 0, unique_bytes = 0, read_seconds = 0, place_seconds = 0;
  while (true) {
    StatusOr<ResumeChoice> choice = NotFound("");
    int64_t chosen = -1;
    if (rank == 0) {
      choice = ChooseResumeCheckpoint(path, rejected);
      if (choice.ok()) choice = RefuseAnotherModel(std::move(*choice));
      if (choice.ok()) {
        chosen = choice->meta.step;
        for (const std::string& why : choice->skipped) {
          if (printed.insert(why).second) {
            std::printf("%s; resuming from %s\n", why.c_str(), fs::path(choice->step_dir).filename().c_str());
          }
        }
        std::fflush(stdout);
      }
    }
    // The step, and whether `path` is that step's directory (else it holds it): rank 0's reading of
    // the directory is the one every rank follows.
    int64_t path_is_step = choice.ok() && choice->step_dir == path ? 1 : 0;
    if (world > 1) {
      torch::Tensor t = torch::tensor(std::vector<int64_t>{chosen, path_is_step}, torch::kLong).to(device_);
      LTRAIN_RETURN_IF_ERROR(groups_->world->Broadcast(t, 0));
      t = t.to(torch::kCPU);
      chosen = t[0].item<int64_t>();
      path_is_step = t[1].item<int64_t>();
    }
    if (rank == 0 && !choice.ok()) return choice.status();
    if (chosen < 0) return Unavailable("rank 0 found no checkpoint to resume from in " + path + " (see its log)");
    step_dir = rank == 0 ? choice->step_dir : path_is_step ? path : (fs::path(path) / StepDirName(chosen)).string();
    StatusOr<CheckpointMeta> meta = rank == 0 ? StatusOr<CheckpointMeta>(choice->meta) : ReadCheckpointMeta(step_dir);
    Status read = meta.ok() ? Status::Ok() : meta.status();
    if (read.ok() && meta->step != chosen) {
      read = DataLoss(step_dir + " holds step " + std::to_string(meta->step) + ", rank 0 chose " + std::to_string(chosen));
    }
    LoadedShards shards;
    const auto read_start = SteadyClock::now();
    if (read.ok()) {
      try {
        read = ReadShards(step_dir, *meta, &shards);
      } catch (...) {
        read = CaughtException("reading checkpoint " + step_dir);
      }
    }
    read_seconds = MillisSince(read_start) / 1000.0;
    // Every rank's outcome (0: read and verified; 1: a file does not verify, an older commit may;
    // 2: anything else), the bytes it read and its read time, summed over the world.
    const int outcome = read.ok() ? 0 : read.code() == StatusCode::kDataLoss ? 1 : 2;
    std::vector<int> outcomes(world, outcome);
    bytes = static_cast<double>(shards.bytes);
    if (world > 1) {
      torch::Tensor flags = torch::zeros({world + 2}, torch::kDouble);
      flags[rank].fill_(outcome);
      flags[world].fill_(bytes);
      flags[world + 1].fill_(read_seconds);
      flags = flags.to(device_);
      LTRAIN_RETURN_IF_ERROR(groups_->world->AllReduceSum(flags));
      flags = flags.to(torch::kCPU);
      for (int r = 0; r < world; ++r) outcomes[r] = static_cast<int>(flags[r].item<double>() + 0.5);
      bytes = flags[world].item<double>();
      read_seconds = flags[world + 1].item<double>() / world;
    }
    const int worst = *std::max_element(outcomes.begin(), outcomes.end());
    if (worst == 0) {
      // Which files any rank read: the checkpoint's bytes that came from the disk, once however many
      // ranks read them. Every rank holds the same manifest now, so the flags line up.
      torch::Tensor read_by_any = torch::zeros({static_cast<int64_t>(meta->files.size())}, torch::kDouble);
      int64_t f = 0;
      for (const auto& [name, file] : meta->files) read_by_any[f++].fill_(shards.read.count(name) ? 1.0 : 0.0);
      if (world > 1) {
        read_by_any = read_by_any.to(device_);
        LTRAIN_RETURN_IF_ERROR(groups_->world->AllReduceSum(read_by_any));
        read_by_any = read_by_any.to(torch::kCPU);
      }
      f = 0;
      for (const auto& [name, file] : meta->files) {
        if (read_by_any[f++].item<double>() > 0.5) unique_bytes += static_cast<double>(file.bytes);
      }
      const auto place_start = SteadyClock::now();
      LTRAIN_RETURN_IF_ERROR(ApplyShards(step_dir, *meta, shards));
      place_seconds = MillisSince(place_start) / 1000.0;
      loaded = *meta;
      break;
    }
    std::string failed;
    for (int r = 0; r < world; ++r) {
      if (outcomes[r] != 0) failed += (failed.empty() ? "" : ", ") + std::to_string(r);
    }
    if (!read.ok() && rank != 0) {
      std::fprintf(stderr, "ltrain-worker: rank %d: checkpoint %s: %s\n", rank, step_dir.c_str(), read.message().c_str());
    }
    if (worst == 2) {
      if (!read.ok()) return read.code() == StatusCode::kDataLoss ? DataLoss("checkpoint " + step_dir + ": " + read.message()) : read;
      return Unavailable("rank(s) " + failed + " could not load checkpoint " + step_dir + " (see their logs)");
    }
    if (rank == 0) {
      rejected[chosen] = outcomes[0] != 0 ? read.message()
                                          : "a file read by rank(s) " + failed + " does not verify: see their logs";
    }
  }
  const double seconds = std::chrono::duration<double>(SteadyClock::now() - start).count();
  RestoreRouterBiases(loaded);
  step_ = loaded.step;
  data_position_ = loaded.data_position;
  // A checkpoint of this run's own directory is its newest commit until the next one.
  std::error_code same_ec;
  if (rank == 0 && !options_.checkpoint_dir.empty() &&
      fs::equivalent(fs::path(step_dir).parent_path(), options_.checkpoint_dir, same_ec)) {
    Progress::Global().RecordCommit(step_, step_dir);
  }
  if (rank == 0) Progress::Global().RecordLoad(step_, seconds * 1000.0, static_cast<int64_t>(unique_bytes));
  if (rank == 0 && options_.print_progress) {
    std::printf("resumed from %s at step %lld data_position %lld (saved by world size %d, %s) in %.1f s "
                "(%.2f GB of the checkpoint, %.2f GB/s; the ranks read %.2f GB in %.1f s on average, and rank 0 "
                "placed its part in %.1f s)\n",
                step_dir.c_str(), static_cast<long long>(step_), static_cast<long long>(data_position_),
                loaded.world_size, loaded.layout.c_str(), seconds, unique_bytes / 1e9,
                seconds > 0 ? unique_bytes / 1e9 / seconds : 0.0, bytes / 1e9, read_seconds, place_seconds);
    const std::string sampling = NameOf(recipe_.data.sampling);
    if (loaded.data_seed >= 0 && (loaded.data_sampling != sampling || loaded.data_seed != DataSeed(recipe_))) {
      std::printf("resume: the saved run drew its batches with data.sampling %s, seed %lld; this run draws them with "
                  "%s, seed %lld, so its batches from step %lld on are not the ones the saved run would have seen; "
                  "set data.sampling and data.seed as they were to continue its order\n",
                  loaded.data_sampling.c_str(), static_cast<long long>(loaded.data_seed), sampling.c_str(),
                  static_cast<long long>(DataSeed(recipe_)), static_cast<long long>(step_ + 1));
    }
  }
  return Status::Ok();
}

StatusOr<std::vector<std::optional<Range>>> Trainer::SavedRanges(const std::string& path) const {
  LTRAIN_ASSIGN_OR_RETURN(std::unique_ptr<SafetensorsFile> file, SafetensorsFile::Open(path));
  std::vector<std::optional<Range>> out(param_names_.size());
  for (size_t i = 0; i < param_names_.size(); ++i) {
    const SafetensorsEntry* entry = file->Find("range." + param_names_[i]);
    if (entry == nullptr || entry->bytes != 2 * sizeof(int64_t)) continue;
    int64_t range[2] = {0, 0};
    LTRAIN_RETURN_IF_ERROR(file->Read(*entry, range));
    out[i] = Range{range[0], range[1]};
  }
  return out;
}

Status Trainer::ReadShards(const std::string& step_dir, const CheckpointMeta& meta, LoadedShards* shards) {
  namespace fs = std::filesystem;
  const Layout saved = Layout::Grid(meta.tp, meta.dp, meta.pp);
  if (meta.tp < 1 || meta.dp < 1 || meta.pp < 1 || saved.world_size != meta.world_size || meta.zero < 0 || meta.zero > 3) {
    return DataLoss("checkpoint " + step_dir + " has an inconsistent topology: world " + std::to_string(meta.world_size) +
                    ", " + meta.layout);
  }
  std::vector<std::pair<std::string, bool>> files;  // name, is a model file
  // Per file, where each parameter's range starts in it, for the parameters whose part this rank
  // needs it holds whole: those are placed as soon as they are read.
  std::map<std::string, std::map<int, int64_t>> whole;
  if (SameModelGrid(meta)) {
    // The same layout under ZeRO-1/2 (every rank saved its own shard of the masters): the masters
    // are all-gathered after the load. The choice follows from the manifest alone, so every rank
    // makes the same one, and it joins the all-gather whatever it read.
    shards->gather_masters = store_->CanGatherMasters() && meta.zero == layout_.zero && meta.dp == layout_.dp;
    // This rank's tp/pp slice, from every data-parallel rank that saved a distinct part of it.
    // A file none of whose ranges meets what this rank needs (another rank's ZeRO shard of the
    // moments; under the all-gather, another rank's shard of the masters) is not read: its header
    // says so.
    for (int d = 0; d < meta.dp; ++d) {
      RankCoords c = groups_->coords;
      c.dp = d;
      const int r = RankAt(saved, c);
      for (const bool is_model : {true, false}) {
        const std::string name = is_model ? ModelShardFile(r) : OptimizerShardFile(r);
        if (!meta.files.count(name)) continue;
        LTRAIN_ASSIGN_OR_RETURN(std::vector<std::optional<Range>> ranges, SavedRanges((fs::path(step_dir) / name).string()));
        bool needed = false;
        for (size_t i = 0; i < ranges.size(); ++i) {
          const Range need = store_->LoadRangeOfParam(static_cast<int>(i), !is_model, shards->gather_masters);
          // A missing or malformed range: the full read says what is wrong.
          if (!ranges[i] || std::min(ranges[i]->end, need.end) > std::max(ranges[i]->begin, need.begin)) needed = true;
          if (ranges[i] && need.size() > 0 && ranges[i]->begin <= need.begin && ranges[i]->end >= need.end) {
            whole[name][static_cast<int>(i)] = ranges[i]->begin;
          }
        }
        if (!needed) continue;
        files.emplace_back(name, is_model);
        shards->saved_rank[name] = r;
      }
    }
  } else {
    // Another tp, pp or virtual-stage split: every file that holds a part of one of this rank's
    // parameters (any tp slice of it, from any pipeline stage), as the files' headers say.
    const std::set<std::string> mine(param_names_.begin(), param_names_.end());
    for (int r = 0; r < meta.world_size; ++r) {
      for (const bool is_model : {true, false}) {
        const std::string name = is_model ? ModelShardFile(r) : OptimizerShardFile(r);
        if (!meta.files.count(name)) continue;
        LTRAIN_ASSIGN_OR_RETURN(std::unique_ptr<SafetensorsFile> file,
                                SafetensorsFile::Open((fs::path(step_dir) / name).string()));
        const bool wanted = std::any_of(file->tensors().begin(), file->tensors().end(), [&](const SafetensorsEntry& e) {
          return e.name.rfind("range.", 0) == 0 && mine.count(e.name.substr(6)) > 0;
        });
        if (!wanted) continue;
        files.emplace_back(name, is_model);
        shards->saved_rank[name] = r;
      }
    }
  }
  // Only files the manifest lists were taken.
  int64_t total = 0;
  for (const auto& [name, is_model] : files) total += static_cast<int64_t>(meta.files.at(name).bytes);
  const std::string work = "loading checkpoint " + StepDirName(meta.step);
  Progress::Global().SetWork(work, 0, total, "bytes");
  // fp32 tensors go into the snapshot memory while it has room: pinned (on CUDA), so they reach the
  // device at full speed, and already faulted in, so the reads do not stop to map fresh pages. Its
  // first use after this is the first save, long after the state is placed.
  std::mutex pinned_mutex;
  store_->BeginSnapshot();
  auto take_pinned = [&](torch::ScalarType type, int64_t numel) {
    std::lock_guard<std::mutex> lock(pinned_mutex);
    return type == torch::kFloat ? store_->TakeSnapshotMemory(numel) : torch::Tensor();
  };
  // The placer: a thread that places each tensor a file holds whole for this rank as soon as it is
  // read, while the reads go on. Before the files are verified: a file that does not verify sends
  // every rank to an older commit, which places everything again.
  std::map<std::string, int> param_index;
  for (size_t i = 0; i < param_names_.size(); ++i) param_index[param_names_[i]] = static_cast<int>(i);
  struct Placement {
    int param;
    ParamStore::StatePart part = ParamStore::StatePart::kValue;
    RangeValues values;
  };
  std::mutex place_mutex;
  std::condition_variable place_cv;
  std::deque<Placement> to_place;
  bool reads_done = false;
  Status place_status;
  auto place_loop = [&] {
    while (true) {
      std::unique_lock<std::mutex> lock(place_mutex);
      place_cv.wait(lock, [&] { return reads_done || !to_place.empty(); });
      if (to_place.empty()) return;
      Placement p = std::move(to_place.front());
      to_place.pop_front();
      lock.unlock();
      Status placed;
      try {
        placed = store_->LoadParamPart(p.param, p.part, p.values, shards->gather_masters);
      } catch (...) {
        placed = CaughtException("placing " + param_names_[p.param]);
      }
      lock.lock();
      if (placed.ok()) {
        shards->placed.insert({p.param, static_cast<int>(p.part)});
      } else if (place_status.ok()) {
        place_status = placed;
      }
    }
  };
  auto on_tensor = [&](const std::string& file, const std::string& key, const torch::Tensor& t) {
    auto file_it = whole.find(file);
    if (file_it == whole.end() || t.scalar_type() != torch::kFloat) return;
    ParamStore::StatePart part = ParamStore::StatePart::kValue;
    std::string name;
    for (const auto& [prefix, which] : {std::pair<const char*, ParamStore::StatePart>{"model.", ParamStore::StatePart::kValue},
                                        {"exp_avg_sq.", ParamStore::StatePart::kExpAvgSq},
                                        {"exp_avg.", ParamStore::StatePart::kExpAvg}}) {
      if (key.rfind(prefix, 0) == 0) {
        part = which;
        name = key.substr(std::strlen(prefix));
        break;
      }
    }
    auto param_it = param_index.find(name);
    if (name.empty() || param_it == param_index.end()) return;
    auto begin_it = file_it->second.find(param_it->second);
    if (begin_it == file_it->second.end()) return;
    std::lock_guard<std::mutex> lock(place_mutex);
    to_place.push_back(Placement{param_it->second, part, RangeValues(t, begin_it->second)});
    place_cv.notify_one();
  };
  std::thread placer(place_loop);
  // A few files at a time: a disk serves parallel reads faster than one stream.
  using Tensors = std::map<std::string, torch::Tensor>;
  std::vector<std::optional<StatusOr<Tensors>>> results(files.size());
  std::vector<std::atomic<int64_t>> done(files.size());
  std::atomic<size_t> next{0};
  auto read = [&] {
    for (size_t k = next++; k < files.size(); k = next++) {
      const std::string& name = files[k].first;
      try {
        results[k] = ReadShardFile(
            (fs::path(step_dir) / name).string(), meta.files.at(name),
            [&](uint64_t bytes) {
              done[k] = static_cast<int64_t>(bytes);
              int64_t sum = 0;
              for (const auto& d : done) sum += d;
              Progress::Global().SetWork(work, sum, total, "bytes");
            },
            take_pinned, [&](const std::string& key, const torch::Tensor& t) { on_tensor(name, key, t); });
      } catch (const std::exception& e) {
        results[k] = Internal("reading " + name + ": " + e.what());
      }
    }
  };
  std::vector<std::thread> readers;
  for (size_t t = 0; t < std::min<size_t>(files.size(), 4); ++t) readers.emplace_back(read);
  for (std::thread& t : readers) t.join();
  {
    std::lock_guard<std::mutex> lock(place_mutex);
    reads_done = true;
  }
  place_cv.notify_one();
  placer.join();
  Progress::Global().EndWork(work);
  LTRAIN_RETURN_IF_ERROR(place_status);
  for (size_t k = 0; k < files.size(); ++k) {
    if (!results[k]->ok()) return results[k]->status();
    const auto& [name, is_model] = files[k];
    (is_model ? shards->model : shards->optimizer).emplace_back(name, std::move(*results[k]).value());
    shards->bytes += meta.files.at(name).bytes;
    shards->read.insert(name);
  }
  return Status::Ok();
}

Status Trainer::ApplyShards(const std::string& step_dir, const CheckpointMeta& meta, const LoadedShards& shards) {
  torch::NoGradGuard no_grad;
  using Files = std::vector<std::pair<std::string, std::map<std::string, torch::Tensor>>>;
  // The flattened `prefix + name` (n elements) from the shards' ranges, of which `need` must be
  // covered: elements [need.begin, need.end). A shard that holds all of them is used as it is,
  // without a copy.
  auto assemble = [&](const Files& files, const std::string& prefix, const std::string& name, int64_t n,
                      std::optional<Range> need = std::nullopt) -> StatusOr<RangeValues> {
    const Range wanted = need.value_or(Range{0, n});
    struct Piece {
      int64_t begin, end;
      torch::Tensor values;
    };
    std::vector<Piece> pieces;
    int64_t covered = 0;
    for (const auto& [file, tensors] : files) {
      auto range_it = tensors.find("range." + name), values_it = tensors.find(prefix + name);
      if (range_it == tensors.end() || values_it == tensors.end()) {
        return DataLoss("checkpoint " + step_dir + ": " + file + " has no tensor " + prefix + name + " (saved by another model?)");
      }
      const torch::Tensor& range = range_it->second;
      const torch::Tensor& values = values_it->second;
      if (range.scalar_type() != torch::kLong || range.numel() != 2) {
        return DataLoss("checkpoint " + step_dir + ": " + file + ": range." + name + " is not two int64 values");
      }
      const int64_t b = range.data_ptr<int64_t>()[0], e = range.data_ptr<int64_t>()[1];
      if (b < 0 || e < b || e > n || values.numel() != e - b) {
        return DataLoss("checkpoint " + step_dir + ": " + prefix + name + " holds range [" + std::to_string(b) + ", " +
                        std::to_string(e) + ") with " + std::to_string(values.numel()) + " values; the parameter has " +
                        std::to_string(n) + " (saved by another model?)");
      }
      const int64_t overlap = std::min(e, wanted.end) - std::max(b, wanted.begin);
      if (overlap <= 0) continue;
      pieces.push_back(Piece{b, e, values.reshape(-1).to(torch::kFloat)});
      covered += overlap;
    }
    if (covered != wanted.size()) {
      return DataLoss("checkpoint " + step_dir + ": the shards of " + prefix + name + " cover " + std::to_string(covered) +
                      " of the " + std::to_string(wanted.size()) + " elements [" + std::to_string(wanted.begin) + ", " +
                      std::to_string(wanted.end) + ") this rank needs");
    }
    if (pieces.size() == 1) return RangeValues(pieces[0].values, pieces[0].begin);
    torch::Tensor part = torch::empty({wanted.size()});
    for (const Piece& piece : pieces) {
      const Range r = Intersect(Range{piece.begin, piece.end}, wanted);
      part.narrow(0, r.begin - wanted.begin, r.size()).copy_(piece.values.narrow(0, r.begin - piece.begin, r.size()));
    }
    return RangeValues(part, wanted.begin);
  };
  if (SameModelGrid(meta)) {
    for (size_t i = 0; i < param_names_.size(); ++i) {
      const int64_t n = store_->SavedNumel(static_cast<int>(i));
      const Range value_need = store_->LoadRangeOfParam(static_cast<int>(i), false, shards.gather_masters);
      const Range moments_need = store_->LoadRangeOfParam(static_cast<int>(i), true);
      using Part = ParamStore::StatePart;
      for (const auto& [part, files, prefix, need] :
           {std::tuple<Part, const Files*, const char*, Range>{Part::kValue, &shards.model, "model.", value_need},
            {Part::kExpAvg, &shards.optimizer, "exp_avg.", moments_need},
            {Part::kExpAvgSq, &shards.optimizer, "exp_avg_sq.", moments_need}}) {
        if (shards.placed.count({static_cast<int>(i), static_cast<int>(part)})) continue;  // as it was read
        LTRAIN_ASSIGN_OR_RETURN(RangeValues values, assemble(*files, prefix, param_names_[i], n, need));
        LTRAIN_RETURN_IF_ERROR(store_->LoadParamPart(static_cast<int>(i), part, values, shards.gather_masters));
      }
    }
    if (shards.gather_masters) LTRAIN_RETURN_IF_ERROR(store_->GatherMasters());
    return RestoreRngState(meta.rng_state);
  }
  // Another tp, pp or virtual-stage split. Per parameter: each saved tp slice from the files of its
  // tp coordinate (of one pipeline stage: the last stage's copy of the tied embedding equals the
  // first's), the full parameter from the slices, and this rank's slice of it.
  const Layout saved = Layout::Grid(meta.tp, meta.dp, meta.pp);
  std::vector<ShardParam>& params = model_->params();
  auto full_of = [&](const Files& files, const std::string& prefix, const ShardParam& p) -> StatusOr<torch::Tensor> {
    const TpSplit saved_split = SplitOf(recipe_.model, p.name, meta.tp);
    int64_t full_numel = 1;
    for (int64_t d : p.full_shape) full_numel *= d;
    const int slices = saved_split == TpSplit::kReplicated ? 1 : meta.tp;
    std::vector<torch::Tensor> parts;
    for (int t = 0; t < slices; ++t) {
      int stage = -1;
      Files of_slice;
      for (const auto& [file, tensors] : files) {
        const RankCoords c = CoordsOf(saved, shards.saved_rank.at(file));
        if (c.tp != t || !tensors.count("range." + p.name)) continue;
        if (stage < 0 || c.pp < stage) {
          stage = c.pp;
          of_slice.clear();
        }
        if (c.pp == stage) of_slice.emplace_back(file, tensors);
      }
      if (of_slice.empty()) {
        return DataLoss("checkpoint " + step_dir + ": no file holds tp slice " + std::to_string(t) + " of " + prefix +
                        p.name + " (saved by another model?)");
      }
      LTRAIN_ASSIGN_OR_RETURN(RangeValues part, assemble(of_slice, prefix, p.name, full_numel / slices));
      parts.push_back(part.values);  // all of the slice, from element 0
    }
    return Unslice(parts, saved_split, p.full_shape);
  };
  for (size_t i = 0; i < params.size(); ++i) {
    const ShardParam& p = params[i];
    std::vector<torch::Tensor> state;
    for (const auto& [files, prefix] : {std::pair<const Files*, const char*>{&shards.model, "model."},
                                        {&shards.optimizer, "exp_avg."}, {&shards.optimizer, "exp_avg_sq."}}) {
      LTRAIN_ASSIGN_OR_RETURN(torch::Tensor full, full_of(*files, prefix, p));
      state.push_back(layout_.tp > 1 ? Slice(full, p.split, layout_.tp, groups_->coords.tp).reshape(-1) : full.reshape(-1));
    }
    LTRAIN_RETURN_IF_ERROR(store_->LoadParamState(static_cast<int>(i), state[0], state[1], state[2]));
  }
  return RestoreRngState(meta.rng_state);
}

std::string Trainer::LayoutKey() const {
  if (layout_.plain()) return "tp=1 pp=1 zero=0";
  return "tp=" + std::to_string(layout_.tp) + " dp=" + std::to_string(layout_.dp) + " pp=" + std::to_string(layout_.pp) +
         " zero=" + std::to_string(layout_.zero) + " chunks=" + std::to_string(layout_.chunks) +
         " sp=" + std::to_string(recipe_.parallel.sequence_parallel ? 1 : 0) +
         (layout_.ep > 1 ? " ep=" + std::to_string(layout_.ep) : std::string());
}

StatusOr<std::map<int, std::vector<float>>> Trainer::GatherRouterBiases() {
  std::map<int, std::vector<float>> out;
  const ModelSpec& m = recipe_.model;
  if (m.moe.experts == 0 || m.moe.balance != MoeBalance::kBias) return out;
  // Each stage's blocks' biases (the same on its every rank), summed over the stages into every
  // block's row: rank 0 writes them all.
  torch::NoGradGuard no_grad;
  torch::Tensor all = torch::zeros({m.layers, m.moe.experts}, torch::TensorOptions().dtype(torch::kFloat).device(device_));
  const std::vector<int>& layers = model_->MoeLayers();
  for (size_t i = 0; i < layers.size(); ++i) all[layers[i]].copy_(model_->router_biases()[i]);
  if (layout_.pp > 1) LTRAIN_RETURN_IF_ERROR(groups_->pp->AllReduceSum(all));
  all = all.to(torch::kCPU).contiguous();
  for (int l = 0; l < m.layers; ++l) {
    if (!IsMoeLayer(m, l)) continue;
    const float* row = all[l].data_ptr<float>();
    out[l] = std::vector<float>(row, row + m.moe.experts);
  }
  return out;
}

void Trainer::RestoreRouterBiases(const CheckpointMeta& meta) {
  const ModelSpec& m = recipe_.model;
  if (m.moe.experts == 0 || m.moe.balance != MoeBalance::kBias) return;
  torch::NoGradGuard no_grad;
  const std::vector<int>& layers = model_->MoeLayers();
  std::vector<int> missing;
  for (size_t i = 0; i < layers.size(); ++i) {
    auto it = meta.router_bias.find(layers[i]);
    torch::Tensor& bias = model_->router_biases()[i];
    if (it == meta.router_bias.end() || static_cast<int64_t>(it->second.size()) != bias.numel()) {
      missing.push_back(layers[i]);
      bias.zero_();
      continue;
    }
    bias.copy_(torch::tensor(it->second, torch::TensorOptions().dtype(torch::kFloat)));
  }
  if (!missing.empty()) {
    std::string blocks;
    for (int l : missing) blocks += (blocks.empty() ? "" : ", ") + std::to_string(l);
    std::printf("rank %d: the checkpoint holds no router bias of MoE block(s) %s (it was not trained with "
                "model.moe.balance: bias): they start at zero\n", groups_->rank, blocks.c_str());
    std::fflush(stdout);
  }
}

Status Trainer::StartSave() {
  if (!writer_) return Status::Ok();
  LTRAIN_RETURN_IF_ERROR(store_->AwaitUpdates());
  const auto start = SteadyClock::now();
  Progress::Global().SetPhase(step_, "checkpoint");
  // The snapshot reuses the host memory of the previous one: that save must be written first (its
  // outcome was printed by rank 0, and a failed save is never fatal).
  if (writer_->async()) (void)writer_->Wait();
  const auto snapshot_start = SteadyClock::now();
  // The checkpoint holds the fp32 masters, which a sharded update leaves current only in each
  // rank's shard.
  LTRAIN_RETURN_IF_ERROR(store_->SyncMasters());
  const int rank = groups_->rank;
  ++checkpoint_saves_;
  store_->BeginSnapshot();
  CheckpointSnapshot snapshot;
  snapshot.step = step_;
  snapshot.start = snapshot_start;
  // Every rank saves its share: the ranks of a dp group write disjoint parts (ParamStore::ModelState).
  snapshot.files.emplace_back(ModelShardFile(rank), store_->ModelState(param_names_));
  snapshot.files.emplace_back(OptimizerShardFile(rank), store_->OptimizerState(param_names_));
  using RouterBiases = std::map<int, std::vector<float>>;
  LTRAIN_ASSIGN_OR_RETURN(RouterBiases router_bias, GatherRouterBiases());
  if (rank == 0) {
    snapshot.meta.router_bias = std::move(router_bias);
    CheckpointMeta& meta = snapshot.meta;
    meta.step = step_;
    meta.data_position = data_position_;
    meta.data_sampling = NameOf(recipe_.data.sampling);
    meta.world_size = layout_.world_size;
    meta.generation = options_.generation;
    meta.job_id = options_.job_id;
    meta.layout = LayoutKey();
    meta.tp = layout_.tp;
    meta.dp = layout_.dp;
    meta.pp = layout_.pp;
    meta.zero = layout_.zero;
    meta.chunks = layout_.chunks;
    meta.rng_state = RngStateHex();
  }
  if (writer_->async()) {
    writer_->Submit(std::move(snapshot));  // waits for the previous save, if still in flight
    checkpoint_blocked_ms_ += MillisSince(start);
    return Status::Ok();
  }
  const std::string error = writer_->WriteFiles(snapshot);
  if (!error.empty() && rank != 0) {
    std::fprintf(stderr, "ltrain-worker: checkpoint step-%lld: %s\n", static_cast<long long>(step_), error.c_str());
  }
  last_save_ = error.empty() ? Status::Ok() : Internal(error);
  std::vector<std::string> errors;
  if (options_.commit_board != nullptr) {
    // Every rank's word, with its reason, through the commit board (on this thread).
    LTRAIN_RETURN_IF_ERROR(options_.commit_board->Announce(step_, rank, error));
    if (rank == 0) {
      StatusOr<std::vector<std::string>> words =
          options_.commit_board->Collect(step_, layout_.world_size, options_.collective_timeout, nullptr);
      if (!words.ok()) return words.status();
      for (const std::string& w : *words) {
        if (!w.empty()) errors.push_back(w);
      }
    }
  } else {
    torch::Tensor failed = torch::full({1}, error.empty() ? 0.0f : 1.0f, torch::TensorOptions().dtype(torch::kFloat).device(device_));
    LTRAIN_RETURN_IF_ERROR(groups_->world->AllReduceSum(failed));
    const int failed_ranks = static_cast<int>(failed.to(torch::kCPU).item<float>() + 0.5f);
    if (!error.empty()) errors.push_back(error);
    const int others = failed_ranks - (error.empty() ? 0 : 1);
    if (others > 0) errors.push_back(std::to_string(others) + " other rank(s) could not write their files (see their logs)");
  }
  if (rank == 0) last_save_ = writer_->Conclude(snapshot, errors);
  checkpoint_blocked_ms_ += MillisSince(start);
  return Status::Ok();
}

Status Trainer::Save() {
  if (!writer_) return Status::Ok();
  LTRAIN_RETURN_IF_ERROR(StartSave());
  if (!writer_->async()) return last_save_;
  Progress::Global().SetPhase(step_, "checkpoint");
  const auto start = SteadyClock::now();
  Status s = writer_->Wait();
  checkpoint_blocked_ms_ += MillisSince(start);
  return s;
}

}  // namespace ltrain::worker
