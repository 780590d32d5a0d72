// ltrain launch RECIPE: submit a job and follow it until it ends; ltrain run -- PROGRAM: the same for a
// program of the user's own (a recipe with entrypoint.command).
#include <charconv>
#include <cstdio>
#include <filesystem>
#include <memory>

#include "agent/agent.h"
#include "cmd/cli_support.h"
#include "cmd/commands.h"
#include "cmd/run_job.h"
#include "common/checkpoint_manifest.h"
#include "common/data/prepare.h"
#include "common/hf_format.h"
#include "common/layout_plan.h"
#include "common/recipe.h"
#include "common/slurm.h"

namespace ltrain::cli {
namespace {

namespace fs = std::filesystem;

struct LaunchArgs {
  std::string recipe;
  std::vector<std::string> sets;
  bool slurm = false;
  RunJobOptions run;
};

// Submits `recipe` (read from `source`, a file or "ltrain run") and follows the job to its end.
int SubmitRecipe(Recipe recipe, const std::string& source, bool slurm, const RunJobOptions& run,
                 const SecurityMaterial& security) {
  const char* command = recipe.runs_program() ? "ltrain run" : "ltrain launch";
  if (slurm) {
    StatusOr<SlurmAllocation> allocation = ReadSlurmAllocation(EnvironmentVariable, ExpandHostnamesWithScontrol);
    if (!allocation.ok()) {
      std::fprintf(stderr, "%s --slurm: %s\n", command, allocation.status().message().c_str());
      return kExitInvalid;
    }
    ApplySlurmAllocation(*allocation, &recipe);
    std::printf("ltrain: %s\n", DescribeSlurmAllocation(*allocation).c_str());
    RecipeParseResult again = ParseRecipe(RecipeToYaml(recipe), source + " (with the Slurm allocation)");
    if (!again.ok()) {
      std::fprintf(stderr, "%s", again.ErrorText().c_str());
      return kExitInvalid;
    }
  }
  // The coordinator, agents and workers run elsewhere: paths relative to here would not reach them.
  recipe.data.path = Absolute(recipe.data.path);
  for (DataSource& data_source : recipe.data.sources) data_source.path = Absolute(data_source.path);
  recipe.checkpoint.dir = Absolute(recipe.checkpoint.dir);
  recipe.checkpoint.resume_from = Absolute(recipe.checkpoint.resume_from);
  recipe.model.init_from = Absolute(recipe.model.init_from);
  if (recipe.runs_program()) {
    recipe.entrypoint.workdir = Absolute(recipe.entrypoint.workdir.empty() ? "." : recipe.entrypoint.workdir);
  }
  // A checkpoint directory belongs to the job that wrote it; this new job's workers would refuse
  // one that holds commits (checked here too where the directory is visible, before submitting).
  if (!recipe.runs_program() && recipe.checkpoint.enabled && !recipe.checkpoint.dir.empty()) {
    std::vector<CommittedStep> steps = ListCommittedSteps(recipe.checkpoint.dir);
    for (auto it = steps.rbegin(); it != steps.rend(); ++it) {
      if (!it->readable) continue;
      std::fprintf(stderr, "%s: %s\n", source.c_str(),
                   CheckpointOwnershipError(recipe.checkpoint.dir, *it, "this new job").c_str());
      return kExitInvalid;
    }
  }
  for (const DataSource& data : recipe.runs_program() || !run.coordinator.empty() ? std::vector<DataSource>{}
                                                                                   : DataSources(recipe)) {
    if (HoldsPreparedData(data.path)) continue;
    std::fprintf(stderr,
                 "%s: %s %s holds no prepared data (no data.yaml, no train.bin)\n"
                 "    prepare it with: ltrain data prepare --input TEXT_FILE... --output %s\n",
                 source.c_str(), recipe.data.sources.empty() ? "data.path" : "data.sources' path", data.path.c_str(),
                 data.path.c_str());
    return kExitInvalid;
  }
  if (std::string problem = recipe.runs_program() ? "" : DataProblem(recipe); !problem.empty()) {
    std::fprintf(stderr, "%s: %s\n", source.c_str(), problem.c_str());
    return kExitInvalid;
  }
  // The imported weights against the model, before any worker starts (headers only).
  if (!recipe.model.init_from.empty() && run.coordinator.empty() && !recipe.runs_program()) {
    if (Status s = CheckHfTensors(recipe.model.init_from, recipe.model); !s.ok()) {
      std::fprintf(stderr, "%s: %s\n", source.c_str(), s.message().c_str());
      return kExitInvalid;
    }
  }
  // Standalone, this machine is the only node there will be: a job it cannot run would wait forever.
  if (!slurm && run.coordinator.empty()) {
    if (recipe.parallel.nodes_min > 1) {
      std::fprintf(stderr,
                   "%s: parallel.nodes asks for %d nodes, and a standalone %s runs on this machine alone. For "
                   "several nodes, run `ltrain coordinator` on one host and `ltrain agent --coordinator HOST:PORT` "
                   "on each node, then add --coordinator HOST:PORT here (or --slurm inside an allocation)\n",
                   source.c_str(), recipe.parallel.nodes_min, command);
      return kExitInvalid;
    }
    if (recipe.parallel.device == Device::kCuda && agent::LocalGpuCount() == 0) {
      std::fprintf(stderr,
                   "%s: parallel.device is cuda, and this machine has no GPU (no /dev/nvidia0, /dev/nvidia1, ...); "
                   "set parallel.device: cpu (--device cpu for ltrain run), or launch where the GPUs are\n",
                   source.c_str());
      return kExitInvalid;
    }
  }
  return RunJob(run, security, [&](CoordinatorClient& client) -> std::variant<BegunJob, int> {
    v1::SubmitJobRequest submit;
    submit.set_recipe_yaml(RecipeToYaml(recipe));
    submit.set_source_name(source);
    v1::SubmitJobReply reply;
    grpc::ClientContext context;
    context.set_deadline(Deadline(10));
    grpc::Status status = client.stub().SubmitJob(&context, submit, &reply);
    if (!status.ok()) return client.Unreachable(status);
    if (reply.status().code() != 0) return ReplyError(reply.status());
    return BegunJob{reply.job().id()};
  });
}

int Launch(const LaunchArgs& args, const SecurityMaterial& security) {
  RecipeParseResult parsed = LoadRecipeFile(args.recipe, args.sets);
  if (!parsed.ok()) {
    std::fprintf(stderr, "%s", parsed.ErrorText().c_str());
    return kExitInvalid;
  }
  for (const std::string& note : parsed.notes) {
    std::fprintf(stderr, "%s: note: %s\n", args.recipe.c_str(), note.c_str());
  }
  // Said before anything starts (a standalone launch's control plane, a submission).
  if (std::string problem = FitProblem(parsed.recipe); !problem.empty()) {
    std::fprintf(stderr, "%s: %s\n", args.recipe.c_str(), problem.c_str());
    return kExitInvalid;
  }
  return SubmitRecipe(parsed.recipe, args.recipe, args.slurm, args.run, security);
}

struct RunArgs {
  std::vector<std::string> program;
  int nproc_per_node = 1;
  std::string nodes = "1";
  int max_restarts = 0;
  double restart_backoff_s = 0;  // torchrun restarts at once
  double output_timeout_s = 0;   // 0: none
  std::string warm_standby = "auto";
  bool tensorboard = false;
  double hang_timeout_s = 0;     // 0: the recipe default
  std::string name;
  std::string workdir;
  std::vector<std::string> env;
  std::string device = "cpu";
  bool slurm = false;
  RunJobOptions run;
};

// `ltrain run` as a recipe: the program as entrypoint.command, the flags as their keys.
int RunProgram(const RunArgs& args, const SecurityMaterial& security) {
  if (args.program.empty()) {
    std::fprintf(stderr, "ltrain run: no program; e.g. ltrain run --nproc-per-node 2 -- python3 train.py\n");
    return kExitInvalid;
  }
  std::string name = args.name;
  if (name.empty()) {
    // The script's stem when a program runs one (python3 train.py: train), else the program's.
    std::string named = args.program.front();
    for (size_t i = 1; i < args.program.size(); ++i) {
      if (!args.program[i].empty() && args.program[i][0] != '-') {
        named = args.program[i];
        break;
      }
    }
    name = SuggestJobName(fs::path(named).stem().string());
  }
  Recipe recipe;
  recipe.name = name;
  recipe.parallel.nproc_per_node = args.nproc_per_node;
  recipe.parallel.device = args.device == "cuda" ? Device::kCuda : Device::kCpu;
  {
    const size_t colon = args.nodes.find(':');
    auto count = [&](const std::string& text) {
      int value = 0;
      auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
      return ec == std::errc() && end == text.data() + text.size() && value >= 1 ? value : 0;
    };
    const int min = count(args.nodes.substr(0, colon));
    const int max = colon == std::string::npos ? min : count(args.nodes.substr(colon + 1));
    if (min == 0 || max == 0 || min > max) {
      std::fprintf(stderr, "ltrain run: --nodes %s: expected a count, or MIN:MAX with MIN <= MAX\n", args.nodes.c_str());
      return kExitInvalid;
    }
    recipe.parallel.nodes_min = min;
    recipe.parallel.nodes = recipe.parallel.nodes_max = max;
  }
  recipe.fault.max_restarts = args.max_restarts;
  recipe.fault.restart_backoff_s = args.restart_backoff_s;
  if (args.hang_timeout_s > 0) recipe.fault.hang_timeout_s = args.hang_timeout_s;
  recipe.checkpoint.enabled = false;  // the program keeps its own checkpoints
  recipe.metrics.tensorboard = args.tensorboard;
  recipe.entrypoint.command = args.program;
  recipe.entrypoint.workdir = args.workdir;
  recipe.entrypoint.output_timeout_s = args.output_timeout_s;
  recipe.entrypoint.warm_standby = args.warm_standby == "off" ? WarmStandby::kOff
                                  : args.warm_standby == "gpu" ? WarmStandby::kGpu
                                                               : WarmStandby::kAuto;
  for (const std::string& entry : args.env) {
    const size_t eq = entry.find('=');
    if (eq == std::string::npos || eq == 0) {
      std::fprintf(stderr, "ltrain run: --env %s: expected NAME=VALUE\n", entry.c_str());
      return kExitInvalid;
    }
    recipe.entrypoint.env[entry.substr(0, eq)] = entry.substr(eq + 1);
  }
  // Checked as every recipe is.
  RecipeParseResult parsed = ParseRecipe(RecipeToYaml(recipe), "ltrain run");
  if (!parsed.ok()) {
    std::fprintf(stderr, "%s", parsed.ErrorText().c_str());
    return kExitInvalid;
  }
  return SubmitRecipe(parsed.recipe, "ltrain run", args.slurm, args.run, security);
}

}  // namespace

void AddRunCommand(CLI::App& app, CommandContext& ctx) {
  auto args = std::make_shared<RunArgs>();
  args->run.verb = "submitted";
  CLI::App* cmd = app.add_subcommand(
      "run", "Run your own program once per rank with torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, ...), "
             "supervised as ltrain's jobs are: ltrain run --nproc-per-node 2 -- python3 train.py");
  cmd->add_option("program", args->program, "The program and its arguments, after --")->expected(-1);
  cmd->add_option("--nproc-per-node", args->nproc_per_node, "Ranks (processes) per node")
      ->check(CLI::Range(1, 1024))
      ->capture_default_str();
  cmd->add_option("--nodes", args->nodes, "Nodes, or MIN:MAX for an elastic job (a new WORLD_SIZE each generation)")
      ->capture_default_str();
  cmd->add_option("--max-restarts", args->max_restarts,
                  "Restarts after failures before the job fails (TORCHELASTIC_MAX_RESTARTS)")
      ->check(CLI::Range(0, 1000000))
      ->capture_default_str();
  cmd->add_option("--restart-backoff", args->restart_backoff_s,
                  "Seconds before the first restart, doubling per restart up to 30 (fault.restart_backoff_s); "
                  "0, as torchrun, restarts at once")
      ->check(CLI::Range(0.0, 3600.0))
      ->capture_default_str();
  cmd->add_option("--hang-timeout", args->hang_timeout_s,
                  "Seconds without progress (LTRAIN_PROGRESS_FD reports) before a reporting rank is named hung; "
                  "default: derived from the program's reported step times (fault.hang_timeout_s auto: 20 x the slowest of the "
                  "last 50 steps, 20-600 s)")
      ->check(CLI::Range(0.1, 604800.0));
  cmd->add_option("--output-timeout", args->output_timeout_s,
                  "Seconds a rank may print nothing (and report no progress) before it is stopped as hung and the "
                  "restart policy applies (entrypoint.output_timeout_s); 0: never")
      ->check(CLI::Range(0.0, 604800.0))
      ->capture_default_str();
  cmd->add_option("--warm-standby", args->warm_standby,
                  "auto: while the job may restart, an interpreter that has imported torch waits beside each rank of a "
                  "Python program, and a restart runs the script in it, seconds sooner; gpu: it also makes its GPU's "
                  "CUDA context (some hundreds of MiB); off: every start is a new process (entrypoint.warm_standby)")
      ->check(CLI::IsMember({"auto", "off", "gpu"}))
      ->capture_default_str();
  cmd->add_flag("--tensorboard", args->tensorboard,
               "Write the progress reports' loss, learning rate, tokens/s and step time as TensorBoard event files in "
               "the job's tensorboard/ directory (metrics.tensorboard)");
  cmd->add_option("--name", args->name, "The job's name (job ids are NAME-N); default: the script's or program's name");
  cmd->add_option("--workdir", args->workdir, "Directory the program starts in; default: this one");
  cmd->add_option("--env", args->env, "NAME=VALUE added to every rank's environment (repeatable)")
      ->expected(1)
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
  cmd->add_option("--device", args->device, "cpu or cuda: what the nodes must have")
      ->check(CLI::IsMember({"cpu", "cuda"}))
      ->capture_default_str();
  AddCoordinatorOption(cmd, &args->run.coordinator,
                       "HOST:PORT of a running coordinator; without it ltrain starts one and a local agent");
  cmd->add_flag("--slurm", args->slurm, "Inside a Slurm allocation: take nodes and processes per node from it");
  cmd->add_flag("--detach", args->run.detach,
                "With --coordinator: print the job id and return at once (refused without --coordinator: exit 2)");
  cmd->add_flag("-q,--quiet", args->run.quiet, "Print job events only, not the ranks' output");
  cmd->add_flag("-v,--verbose", args->run.verbose, "Also print the embedded coordinator's and agent's logs");
  cmd->add_option("--http-listen", args->run.http_listen,
                  "Standalone: serve GET /metrics (Prometheus) on HOST:PORT while the job runs, e.g. 127.0.0.1:9400; "
                  "port 0 picks a free one");
  ctx.Bind(cmd, [args, &ctx] { return RunProgram(*args, ctx.security()); });
}

void AddLaunchCommand(CLI::App& app, CommandContext& ctx) {
  auto args = std::make_shared<LaunchArgs>();
  args->run.verb = "submitted";
  CLI::App* cmd = app.add_subcommand("launch", "Run a training job and stream its logs until it ends");
  cmd->add_option("recipe", args->recipe, "Recipe YAML file")->required();
  cmd->add_option("--set", args->sets, "Override a recipe field, e.g. --set training.steps=200 (repeatable)")
      ->expected(1)
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
  AddCoordinatorOption(cmd, &args->run.coordinator,
                       "HOST:PORT of a running coordinator; without it ltrain starts one and a local agent");
  cmd->add_flag("--slurm", args->slurm,
                "Inside a Slurm allocation: take nodes and processes per node from it (SLURM_JOB_NODELIST, GPUs per node)");
  cmd->add_flag("--detach", args->run.detach,
                "With --coordinator: print the job id and return at once (refused without --coordinator: exit 2)");
  cmd->add_flag("-q,--quiet", args->run.quiet, "Print job events and rank 0's step lines only, not the workers' other lines");
  cmd->add_flag("-v,--verbose", args->run.verbose, "Also print the embedded coordinator's and agent's logs");
  cmd->add_option("--http-listen", args->run.http_listen,
                  "Standalone: serve GET /metrics (Prometheus) on HOST:PORT while the job runs, e.g. 127.0.0.1:9400; "
                  "port 0 picks a free one");
  ctx.Bind(cmd, [args, &ctx] { return Launch(*args, ctx.security()); });
}

}  // namespace ltrain::cli
