// ltrain validate RECIPE: the resolved recipe, or every error in it.
#include <cstdio>
#include <memory>

#include "cmd/cli_support.h"
#include "cmd/commands.h"
#include "common/recipe.h"

namespace ltrain::cli {
namespace {

struct ValidateArgs {
  std::string recipe;
  std::vector<std::string> sets;
};

int Validate(const ValidateArgs& args) {
  RecipeParseResult parsed = LoadRecipeFile(args.recipe, args.sets);
  if (!parsed.ok()) {
    std::fprintf(stderr, "%s", parsed.ErrorText().c_str());
    std::fprintf(stderr, "%zu error(s) in %s\n", parsed.errors.size(), args.recipe.c_str());
    return kExitInvalid;
  }
  std::printf("%s", RecipeToYaml(parsed.recipe).c_str());
  return kExitOk;
}

}  // namespace

void AddValidateCommand(CLI::App& app, CommandContext& ctx) {
  auto args = std::make_shared<ValidateArgs>();
  CLI::App* cmd = app.add_subcommand("validate", "Check a recipe; print it resolved, or every error (exit 2)");
  cmd->add_option("recipe", args->recipe, "Recipe YAML file")->required();
  cmd->add_option("--set", args->sets, "Override a recipe field (repeatable)")
      ->expected(1)
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
  ctx.Bind(cmd, [args] { return Validate(*args); });
}

}  // namespace ltrain::cli
