// ltrain plan RECIPE [--gpus N] [--gpu-memory GiB]: before a run, what the recipe's layout costs per
// rank (memory by part, communication per group, the pipeline bubble) and the feasible layouts of its
// model on N GPUs, fastest first by the estimate of common/layout_plan.h.
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <map>
#include <memory>
#include <string>

#include <nlohmann/json.hpp>

#include "cmd/cli_support.h"
#include "cmd/commands.h"
#include "common/layout.h"
#include "common/layout_plan.h"
#include "common/recipe.h"

namespace ltrain::cli {
namespace {

struct PlanArgs {
  std::string recipe;
  std::vector<std::string> sets;
  int gpus = 0;
  double gpu_memory_gib = 80;
  int top = 10;
  std::string output = "text";
  bool longest_seq = false;
};

// The longest model.seq_len (a multiple of `step`, at most `cap`) whose peak fits `limit` bytes a rank,
// with `recipe`'s model on cp ranks splitting each sequence (tp and pp 1, one micro-batch of the
// recipe's size a step); 0 when not even `step` fits. Its peak in *peak.
int64_t LongestSeqLen(const Recipe& recipe, Device device, int cp, double limit, int64_t step, int64_t cap,
                      int64_t* peak) {
  auto estimate = [&](int64_t seq_len) -> int64_t {
    Recipe r = recipe;
    ParallelSpec& p = r.parallel;
    p.device = device;
    p.nodes = p.nodes_min = p.nodes_max = 1;
    p.nproc_per_node = cp;
    p.tp = p.pp = p.virtual_stages = 1;
    p.pp_split.clear();
    p.sequence_parallel = false;
    p.pp_schedule = PpSchedule::k1F1B;
    p.ep = 1;
    p.cp = cp;
    if (cp == 1 && p.zero > 0) p.zero = 0;
    r.model.seq_len = static_cast<int>(seq_len);
    r.training.global_batch = r.training.micro_batch;
    StatusOr<Layout> layout = PlanLayout(r, cp);
    if (!layout.ok()) return -1;
    return EstimateLayout(r, *layout).peak_bytes;
  };
  int64_t lo = 0, hi = cap / step;  // in steps: lo fits (0: nothing yet), hi + 1 does not
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    const int64_t bytes = estimate(mid * step);
    if (bytes >= 0 && static_cast<double>(bytes) <= limit) {
      lo = mid;
      *peak = bytes;
    } else {
      hi = mid - 1;
    }
  }
  return lo * step;
}

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

std::string Gib(int64_t bytes) {  // "38.32"
  char text[32];
  std::snprintf(text, sizeof(text), "%.2f", static_cast<double>(bytes) / kGiB);
  return text;
}

// Bytes in the unit that reads best: "512 KiB", "3.4 MiB", "8.60 GiB".
std::string Size(int64_t bytes) {
  char text[32];
  const double b = static_cast<double>(bytes);
  if (b >= kGiB) {
    std::snprintf(text, sizeof(text), "%.2f GiB", b / kGiB);
  } else if (b >= 1024.0 * 1024.0) {
    std::snprintf(text, sizeof(text), "%.1f MiB", b / (1024.0 * 1024.0));
  } else {
    std::snprintf(text, sizeof(text), "%.0f KiB", b / 1024.0);
  }
  return text;
}

// "tp 2 x pp 2 x dp 1, ZeRO 0, interleaved 1F1B (2 chunks), recompute none"
std::string Describe(const Layout& l) {
  std::string out = "tp " + std::to_string(l.tp) + (l.sequence_parallel ? " (sequence parallel)" : "") + " x pp " +
                    std::to_string(l.pp) + " x dp " + std::to_string(l.dp) +
                    (l.ep > 1 ? " (experts over ep " + std::to_string(l.ep) + ")" : "") +
                    (l.cp > 1 ? " (sequences over cp " + std::to_string(l.cp) + ")" : "") + ", ZeRO " +
                    std::to_string(l.zero);
  if (l.pp > 1) {
    out += ", " + NameOf(l.pp_schedule) + (l.chunks > 1 ? " (" + std::to_string(l.chunks) + " chunks)" : "");
  }
  out += ", recompute " + NameOf(l.activation_checkpointing);
  return out;
}

// A short name for the ranked table: "tp2 pp2 int2 z0 none".
std::string Short(const Layout& l) {
  std::string out = "tp" + std::to_string(l.tp) + (l.sequence_parallel ? "+sp" : "") + " pp" + std::to_string(l.pp) +
                    " dp" + std::to_string(l.dp) + (l.ep > 1 ? " ep" + std::to_string(l.ep) : "") +
                    (l.cp > 1 ? " cp" + std::to_string(l.cp) : "") + " z" +
                    std::to_string(l.zero);
  if (l.pp > 1) {
    out += l.pp_schedule == PpSchedule::kInterleaved ? " interleaved" + std::to_string(l.chunks)
                                                      : " " + NameOf(l.pp_schedule);
  }
  return out + " " + NameOf(l.activation_checkpointing);
}

nlohmann::json EstimateJson(const LayoutEstimate& e) {
  nlohmann::json j;
  const Layout& l = e.layout;
  j["layout"] = {{"world_size", l.world_size}, {"tp", l.tp}, {"pp", l.pp}, {"dp", l.dp}, {"ep", l.ep}, {"cp", l.cp}, {"zero", l.zero},
                 {"sequence_parallel", l.sequence_parallel}, {"pp_schedule", NameOf(l.pp_schedule)},
                 {"virtual_stages", l.chunks}, {"activation_checkpointing", NameOf(l.activation_checkpointing)},
                 {"micro_batch", l.micro_batch}, {"accumulation", l.accumulation}, {"stage_layers", l.stage_layers}};
  j["device"] = NameOf(e.device);
  j["bf16_compute_copies"] = e.bf16;
  j["peak_bytes"] = e.peak_bytes;
  for (const StageMemory& st : e.stages) {
    j["ranks"].push_back({{"pp_rank", st.pp_rank},
                          {"parameters", st.parameters},
                          {"params", st.parts.params},
                          {"grads", st.parts.grads},
                          {"optimizer", st.parts.optimizer},
                          {"activations", st.parts.activations},
                          {"buffers", st.parts.buffers},
                          {"total", st.parts.total()},
                          {"activations_and_buffers_by_recompute",
                           {{"none", st.activations_by_mode[0]},
                            {"full", st.activations_by_mode[1]},
                            {"selective", st.activations_by_mode[2]}}}});
  }
  j["communication"] = nlohmann::json::array();
  for (const GroupTraffic& t : e.traffic) {
    j["communication"].push_back({{"group", t.group}, {"size", t.size}, {"bytes_per_step", t.bytes}, {"what", t.what}});
  }
  j["bubble"] = e.bubble;
  j["step_seconds"] = e.step_seconds;
  if (e.device == Device::kCuda) j["mfu"] = e.mfu;
  return j;
}

void PrintEstimate(const LayoutEstimate& e) {
  std::printf("  memory per rank       params      grads  optimizer activations    buffers      total   "
              "(act.+buffers if recompute none / selective / full)\n");
  for (const StageMemory& st : e.stages) {
    const MemoryParts& p = st.parts;
    std::printf("  pp rank %-3d %10s %10s %10s %10s %10s %10s   (%s / %s / %s)\n", st.pp_rank,
                Size(p.params).c_str(), Size(p.grads).c_str(), Size(p.optimizer).c_str(), Size(p.activations).c_str(),
                Size(p.buffers).c_str(), Size(p.total()).c_str(), Size(st.activations_by_mode[0]).c_str(),
                Size(st.activations_by_mode[2]).c_str(), Size(st.activations_by_mode[1]).c_str());
  }
  if (e.traffic.empty()) std::printf("  communication: none (one rank holds the whole model)\n");
  for (const GroupTraffic& t : e.traffic) {
    std::printf("  communication, %s group of %d: %s sent per rank per step, %s\n", t.group.c_str(), t.size,
                Size(t.bytes).c_str(), t.what.c_str());
  }
  if (e.layout.pp > 1) {
    std::printf("  pipeline bubble: %.1f%% of a step ((pp-1)/(chunks*micro-batches+pp-1), %d micro-batches)\n",
                100.0 * e.bubble, e.layout.accumulation);
  }
  if (e.device == Device::kCuda) {
    std::printf("  estimated step %.3f s, MFU %.1f%%\n", e.step_seconds, 100.0 * e.mfu);
  } else {
    std::printf("  estimated step %.3f s\n", e.step_seconds);
  }
}

int Plan(const PlanArgs& args) {
  RecipeParseResult parsed = LoadRecipeFile(args.recipe, args.sets);
  Recipe recipe = parsed.recipe;
  if (recipe.runs_program()) {
    std::fprintf(stderr, "%s: runs entrypoint.command, a program of your own; ltrain plan estimates the memory and "
                 "speed of ltrain's own trainer (a recipe with model, training and parallel keys)\n",
                 args.recipe.c_str());
    return kExitInvalid;
  }
  // A plan needs the model and the batch; the data and the recipe's own layout may be wrong.
  const int world = recipe.parallel.world_size();
  std::vector<LayoutProblem> own_problems = CheckLayout(recipe, world);
  std::vector<RecipeError> errors;
  for (const RecipeError& error : parsed.errors) {
    bool layout_rule = error.message.find("data.path") != std::string::npos;
    for (const LayoutProblem& p : own_problems) layout_rule = layout_rule || error.message.find(p.message) != std::string::npos;
    if (!layout_rule) errors.push_back(error);
  }
  if (!errors.empty()) {
    for (const RecipeError& error : errors) std::fprintf(stderr, "%s\n", error.ToString().c_str());
    std::fprintf(stderr, "%zu error(s) in %s\n", errors.size(), args.recipe.c_str());
    return kExitInvalid;
  }
  PlanOptions options;
  options.ranks = args.gpus > 0 ? args.gpus : world;
  options.device = args.gpus > 0 ? Device::kCuda : recipe.parallel.device;
  // A CPU rank has its share of this host's memory (the ranks of a node share it).
  const double host_bytes = static_cast<double>(::sysconf(_SC_PHYS_PAGES)) * static_cast<double>(::sysconf(_SC_PAGESIZE));
  const int ranks_per_node = std::max(1, std::min(recipe.parallel.nproc_per_node, options.ranks));
  options.memory_bytes = options.device == Device::kCuda ? args.gpu_memory_gib * kGiB : host_bytes / ranks_per_node;
  options.cpu_cores_per_rank = CpuThreadsPerRank(ranks_per_node);
  const char* unit = options.device == Device::kCuda ? "GPU" : "rank";

  nlohmann::json json;
  json["recipe"] = args.recipe;
  json["model_parameters"] = ApproxParameterCount(recipe.model);
  // A mixture of experts: the parameters a token runs through (what its FLOPs follow).
  if (recipe.model.moe.experts > 0) json["active_parameters"] = ActiveParameterCount(recipe.model);
  json["ranks"] = options.ranks;
  json["device"] = NameOf(options.device);
  if (options.memory_bytes > 0) json["memory_bytes_per_rank"] = options.memory_bytes;

  if (args.output == "text") {
    auto counted = [](double parameters) {
      char count[32];
      if (parameters >= 1e9) {
        std::snprintf(count, sizeof(count), "%.2fB", parameters / 1e9);
      } else {
        std::snprintf(count, sizeof(count), "%.2fM", parameters / 1e6);
      }
      return std::string(count);
    };
    std::string count = counted(static_cast<double>(ApproxParameterCount(recipe.model))) + " parameters";
    if (recipe.model.moe.experts > 0) {
      count += ", " + counted(static_cast<double>(ActiveParameterCount(recipe.model))) + " active";
    }
    std::printf("%s: %s, %s, micro-batch %d, global batch %d; %d %s%s", args.recipe.c_str(),
                NameOf(recipe.model.arch).c_str(), count.c_str(), recipe.training.micro_batch, recipe.training.global_batch, options.ranks, unit,
                options.ranks == 1 ? "" : "s");
    if (options.device == Device::kCuda) {
      std::printf(" of %.0f GiB", args.gpu_memory_gib);
    } else {
      std::printf(" of %.1f GiB (this host's memory over its %d rank%s)", options.memory_bytes / kGiB, ranks_per_node,
                  ranks_per_node == 1 ? "" : "s");
    }
    std::printf("\n\n");
  }

  // The recipe's own layout, on its own ranks, when --gpus does not ask for another count.
  if (args.gpus == 0 || args.gpus == world) {
    Recipe own = recipe;
    own.parallel.device = options.device;
    if (own_problems.empty()) {
      StatusOr<Layout> layout = PlanLayout(own, world);
      const LayoutEstimate e = EstimateLayout(own, *layout, options.cpu_cores_per_rank);
      json["recipe_layout"] = EstimateJson(e);
      if (args.output == "text") {
        std::printf("the recipe's layout: %s\n", Describe(e.layout).c_str());
        PrintEstimate(e);
        if (options.device == Device::kCuda &&
            static_cast<double>(e.peak_bytes) > options.memory_bytes * kGpuMemoryUsable) {
          std::printf("  does not fit: %s GiB a GPU is more than 90%% of %.0f GiB\n", Gib(e.peak_bytes).c_str(),
                      args.gpu_memory_gib);
        } else if (options.device != Device::kCuda && static_cast<double>(e.peak_bytes) > options.memory_bytes) {
          std::printf("  does not fit: %s GiB a rank is more than its %.1f GiB of this host's memory\n",
                      Gib(e.peak_bytes).c_str(), options.memory_bytes / kGiB);
        }
        std::printf("\n");
      }
    } else {
      json["recipe_layout"] = {{"problem", own_problems.front().key + ": " + own_problems.front().message}};
      if (args.output == "text") {
        std::printf("the recipe's layout cannot run on %d ranks: %s: %s\n\n", world, own_problems.front().key.c_str(),
                    own_problems.front().message.c_str());
      }
    }
  }

  if (args.longest_seq) {
    // How long a sequence fits, on one rank and split over 2, 4, 8 ... with context parallelism.
    const double limit = options.device == Device::kCuda ? options.memory_bytes * kGpuMemoryUsable : options.memory_bytes;
    nlohmann::json rows = nlohmann::json::array();
    if (args.output == "text") {
      std::printf("the longest model.seq_len that fits (micro-batch %d, recompute %s, %s a %s):\n",
                  recipe.training.micro_batch, NameOf(recipe.parallel.activation_checkpointing).c_str(),
                  (Gib(static_cast<int64_t>(limit)) + " GiB").c_str(), unit);
      std::printf("  %4s  %12s  %10s\n", "cp", "seq_len", "peak");
    }
    for (int cp = 1; cp <= 64; cp *= 2) {
      int64_t peak = 0;
      const int64_t step = int64_t{2} * cp * 64;
      const int64_t longest = LongestSeqLen(recipe, options.device, cp, limit, step, int64_t{1} << 24, &peak);
      rows.push_back({{"cp", cp}, {"seq_len", longest}, {"peak_bytes", peak}});
      if (args.output == "text") {
        if (longest == 0) {
          std::printf("  %4d  %12s  %10s\n", cp, "none", "-");
        } else {
          std::printf("  %4d  %12lld  %7s GiB\n", cp, static_cast<long long>(longest), Gib(peak).c_str());
        }
      }
    }
    json["longest_seq_len"] = rows;
    if (args.output == "text") std::printf("\n");
  }

  const std::vector<PlanCandidate> candidates = RankLayouts(recipe, options);
  int feasible = 0;
  for (const PlanCandidate& c : candidates) feasible += c.feasible ? 1 : 0;
  if (args.output == "json") {
    json["layouts"] = nlohmann::json::array();
    for (const PlanCandidate& c : candidates) {
      nlohmann::json j = {{"sets", c.sets}, {"feasible", c.feasible}};
      if (!c.problem.empty()) j["problem"] = c.problem;
      if (c.estimate.layout.world_size > 0 && !c.estimate.stages.empty()) j["estimate"] = EstimateJson(c.estimate);
      json["layouts"].push_back(std::move(j));
    }
    std::printf("%s\n", json.dump(1).c_str());
    return kExitOk;
  }

  const bool cuda = options.device == Device::kCuda;
  std::printf("layouts on %d %s%s, %s (%d feasible of %zu):\n", options.ranks, unit, options.ranks == 1 ? "" : "s",
              "fastest first by the estimate", feasible, candidates.size());
  if (cuda) {
    std::printf("  %3s  %-40s %10s %8s %7s %7s\n", "#", "layout", "peak", "step s", "MFU", "bubble");
  } else {
    std::printf("  %3s  %-40s %10s %8s %7s\n", "#", "layout", "peak", "step s", "bubble");
  }
  int shown = 0;
  for (const PlanCandidate& c : candidates) {
    if (!c.feasible || shown >= args.top) continue;
    ++shown;
    const LayoutEstimate& e = c.estimate;
    if (cuda) {
      std::printf("  %3d  %-40s %10s %8.3f %6.1f%% %6.1f%%\n", shown, Short(e.layout).c_str(), Size(e.peak_bytes).c_str(),
                  e.step_seconds, 100.0 * e.mfu, 100.0 * e.bubble);
    } else {
      std::printf("  %3d  %-40s %10s %8.3f %6.1f%%\n", shown, Short(e.layout).c_str(), Size(e.peak_bytes).c_str(),
                  e.step_seconds, 100.0 * e.bubble);
    }
  }
  if (feasible > shown) std::printf("  ... %d more (--top N shows more)\n", feasible - shown);
  if (shown > 0) {
    for (const PlanCandidate& c : candidates) {
      if (!c.feasible) continue;
      std::printf("  the first as recipe keys:");
      for (const std::string& set : c.sets) std::printf(" --set %s", set.c_str());
      std::printf("\n");
      break;
    }
  }
  // The infeasible ones by reason, so that a long list reads as a few causes.
  std::map<std::string, std::vector<std::string>> by_reason;
  for (const PlanCandidate& c : candidates) {
    if (c.feasible) continue;
    std::string reason = c.problem;
    // Memory reasons differ in their figures: group them by the layout's degrees instead.
    by_reason[reason].push_back(c.estimate.stages.empty() ? "" : Short(c.estimate.layout));
  }
  if (!by_reason.empty()) std::printf("not feasible:\n");
  int reasons = 0;
  for (const auto& [reason, layouts] : by_reason) {
    if (++reasons > args.top) {
      std::printf("  ... %zu more reasons (-o json lists every layout)\n", by_reason.size() - args.top);
      break;
    }
    std::printf("  %s", reason.c_str());
    if (!layouts.front().empty()) std::printf(" [%s%s]", layouts.front().c_str(), layouts.size() > 1 ? ", ..." : "");
    std::printf(" (%zu layout%s)\n", layouts.size(), layouts.size() == 1 ? "" : "s");
  }
  return kExitOk;
}

}  // namespace

void AddPlanCommand(CLI::App& app, CommandContext& ctx) {
  auto args = std::make_shared<PlanArgs>();
  CLI::App* cmd = app.add_subcommand(
      "plan",
      "Before a run: memory per rank by part (parameters, gradients, optimizer, activations under each "
      "recompute mode, buffers), communication per step per group, the pipeline bubble; and the feasible "
      "layouts of its model on N GPUs ranked by estimated step time");
  cmd->add_option("recipe", args->recipe, "Recipe YAML file")->required();
  cmd->add_option("--set", args->sets, "Override a recipe field (repeatable)")
      ->expected(1)
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
  cmd->add_option("--gpus", args->gpus,
                  "Plan for N GPUs (CUDA, bf16 as the recipe's precision says) instead of the recipe's ranks and "
                  "device")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--gpu-memory", args->gpu_memory_gib,
                  "Memory of each GPU in GiB; a layout fits when its peak is within 90% of it (default 80)")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--top", args->top, "Rows of the ranked table and reasons shown (default 10)")
      ->check(CLI::PositiveNumber);
  cmd->add_flag("--longest-seq", args->longest_seq,
                "Also the longest model.seq_len that fits a rank's memory, on one rank and with each sequence "
                "split over 2, 4, ... 64 ranks by context parallelism (parallel.cp; tp and pp 1, one "
                "micro-batch a step)");
  cmd->add_option("-o,--output", args->output, "text or json (every layout, feasible or not)")
      ->check(CLI::IsMember({"text", "json"}));
  ctx.Bind(cmd, [args] { return Plan(*args); });
}

}  // namespace ltrain::cli
