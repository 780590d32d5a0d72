// ltrain launch RECIPE: submit a job and follow it until it ends.
#include <cstdio>
#include <filesystem>
#include <memory>

#include "cmd/cli_support.h"
#include "cmd/commands.h"
#include "cmd/run_job.h"
#include "common/checkpoint_manifest.h"
#include "common/data_prepare.h"
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

int Launch(const LaunchArgs& args, const SecurityMaterial& security) {
  RecipeParseResult parsed = LoadRecipeFile(args.recipe, args.sets);
  if (!parsed.ok()) {
    std::fprintf(stderr, "%s", parsed.ErrorText().c_str());
    return kExitInvalid;
  }
  Recipe recipe = parsed.recipe;
  if (args.slurm) {
    StatusOr<SlurmAllocation> allocation = ReadSlurmAllocation(EnvironmentVariable, ExpandHostnamesWithScontrol);
    if (!allocation.ok()) {
      std::fprintf(stderr, "ltrain launch --slurm: %s\n", allocation.status().message().c_str());
      return kExitInvalid;
    }
    ApplySlurmAllocation(*allocation, &recipe);
    std::printf("ltrain: %s\n", DescribeSlurmAllocation(*allocation).c_str());
    RecipeParseResult again = ParseRecipe(RecipeToYaml(recipe), args.recipe + " (with the Slurm allocation)");
    if (!again.ok()) {
      std::fprintf(stderr, "%s", again.ErrorText().c_str());
      return kExitInvalid;
    }
  }
  // The coordinator, agents and workers run elsewhere: paths relative to here would not reach them.
  recipe.data.path = Absolute(recipe.data.path);
  recipe.checkpoint.dir = Absolute(recipe.checkpoint.dir);
  recipe.checkpoint.resume_from = Absolute(recipe.checkpoint.resume_from);
  recipe.model.init_from = Absolute(recipe.model.init_from);
  // A checkpoint directory belongs to the job that wrote it; this new job's workers would refuse
  // one that holds commits (checked here too where the directory is visible, before submitting).
  if (recipe.checkpoint.enabled && !recipe.checkpoint.dir.empty()) {
    std::vector<CommittedStep> steps = ListCommittedSteps(recipe.checkpoint.dir);
    for (auto it = steps.rbegin(); it != steps.rend(); ++it) {
      if (!it->readable) continue;
      std::fprintf(stderr, "%s: %s\n", args.recipe.c_str(),
                   CheckpointOwnershipError(recipe.checkpoint.dir, *it, "this new job").c_str());
      return kExitInvalid;
    }
  }
  if (args.run.coordinator.empty() && !fs::exists(fs::path(recipe.data.path) / "train.bin")) {
    std::fprintf(stderr,
                 "%s: data.path %s holds no prepared data (train.bin)\n"
                 "    prepare it with: ltrain data prepare --input TEXT_FILE... --output %s\n",
                 args.recipe.c_str(), recipe.data.path.c_str(), recipe.data.path.c_str());
    return kExitInvalid;
  }
  if (std::string problem = DataProblem(recipe); !problem.empty()) {
    std::fprintf(stderr, "%s: %s\n", args.recipe.c_str(), problem.c_str());
    return kExitInvalid;
  }
  return RunJob(args.run, security, [&](CoordinatorClient& client) -> std::variant<BegunJob, int> {
    v1::SubmitJobRequest submit;
    submit.set_recipe_yaml(RecipeToYaml(recipe));
    submit.set_source_name(args.recipe);
    v1::SubmitJobReply reply;
    grpc::ClientContext context;
    context.set_deadline(Deadline(10));
    grpc::Status status = client.stub().SubmitJob(&context, submit, &reply);
    if (!status.ok()) return client.Unreachable(status);
    if (reply.status().code() != 0) return ReplyError(reply.status());
    return BegunJob{reply.job().id()};
  });
}

}  // namespace

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
  ctx.Bind(cmd, [args, &ctx] { return Launch(*args, ctx.security()); });
}

}  // namespace ltrain::cli
