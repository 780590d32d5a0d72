// ltrain validate RECIPE: the resolved recipe, or every error in it; `--explain`: every recipe key.
#include <cstdio>
#include <filesystem>
#include <memory>

#include <google/protobuf/struct.pb.h>

#include "cmd/cli_support.h"
#include "cmd/commands.h"
#include "common/data/prepare.h"
#include "common/hf_format.h"
#include "common/layout_plan.h"
#include "common/recipe.h"
#include "common/recipe_schema.h"

namespace ltrain::cli {
namespace {

struct ValidateArgs {
  std::string recipe;
  std::vector<std::string> sets;
  bool explain = false;
  std::string output = "text";
};

// Every key with its type, default and meaning, as text, a Markdown table (the README's) or JSON.
int Explain(const std::string& output) {
  if (output == "markdown") {
    std::printf("%s", RecipeKeysMarkdown().c_str());
  } else if (output == "json") {
    google::protobuf::ListValue keys;
    for (const RecipeKeyDoc& doc : DescribeRecipeKeys()) {
      google::protobuf::Struct* key = keys.add_values()->mutable_struct_value();
      (*key->mutable_fields())["key"].set_string_value(doc.path);
      (*key->mutable_fields())["type"].set_string_value(doc.type);
      (*key->mutable_fields())["default"].set_string_value(doc.default_text);
      (*key->mutable_fields())["help"].set_string_value(doc.help);
    }
    std::printf("%s\n", ToJson(keys).c_str());
  } else {
    std::printf("%s", RecipeKeysText().c_str());
  }
  return kExitOk;
}

int Validate(const ValidateArgs& args) {
  if (args.explain) return Explain(args.output);
  if (args.recipe.empty()) {
    std::fprintf(stderr, "ltrain validate: give a RECIPE to check, or --explain to list every recipe key\n");
    return kExitInvalid;
  }
  if (args.output != "text") {
    std::fprintf(stderr, "ltrain validate: -o %s goes with --explain; a checked recipe prints as YAML\n",
                 args.output.c_str());
    return kExitInvalid;
  }
  RecipeParseResult parsed = LoadRecipeFile(args.recipe, args.sets);
  if (!parsed.ok()) {
    std::fprintf(stderr, "%s", parsed.ErrorText().c_str());
    std::fprintf(stderr, "%zu error(s) in %s\n", parsed.errors.size(), args.recipe.c_str());
    return kExitInvalid;
  }
  for (const std::string& note : parsed.notes) {
    std::fprintf(stderr, "%s: note: %s\n", args.recipe.c_str(), note.c_str());
  }
  if (std::string problem = FitProblem(parsed.recipe); !problem.empty()) {
    std::fprintf(stderr, "%s: %s\n", args.recipe.c_str(), problem.c_str());
    return kExitInvalid;
  }
  Recipe here = parsed.recipe;
  here.data.path = Absolute(here.data.path);
  for (DataSource& source : here.data.sources) source.path = Absolute(source.path);
  if (std::string problem = DataProblem(here); !problem.empty()) {
    std::fprintf(stderr, "%s: %s\n", args.recipe.c_str(), problem.c_str());
    return kExitInvalid;
  }
  if (std::error_code ec; !here.model.init_from.empty() && std::filesystem::exists(here.model.init_from, ec)) {
    // Weights that do not fit are an error; none there yet, a warning (the recipe may be for elsewhere).
    if (Status s = CheckHfTensors(here.model.init_from, here.model); s.code() == StatusCode::kNotFound) {
      std::fprintf(stderr, "%s: warning: model.init_from: %s\n", args.recipe.c_str(), s.message().c_str());
    } else if (!s.ok()) {
      std::fprintf(stderr, "%s: %s\n", args.recipe.c_str(), s.message().c_str());
      return kExitInvalid;
    }
  }
  std::printf("%s", RecipeToYaml(parsed.recipe).c_str());
  // The recipe may be meant for another machine: a warning, not an error.
  // A program under ltrain run reads its own data: data.path is not its.
  for (const DataSource& source : parsed.recipe.runs_program() ? std::vector<DataSource>{} : DataSources(here)) {
    if (HoldsPreparedData(source.path)) continue;
    std::fprintf(stderr,
                 "%s: warning: %s %s holds no prepared data here (no data.yaml, no train.bin); if the job runs on this "
                 "machine, prepare it with: ltrain data prepare --input TEXT_FILE... --output %s\n",
                 args.recipe.c_str(), here.data.sources.empty() ? "data.path" : "data.sources' path",
                 source.path.c_str(), source.path.c_str());
  }
  return kExitOk;
}

}  // namespace

void AddValidateCommand(CLI::App& app, CommandContext& ctx) {
  auto args = std::make_shared<ValidateArgs>();
  CLI::App* cmd = app.add_subcommand(
      "validate", "Check a recipe; print it resolved, or every error (exit 2). --explain lists every recipe key");
  cmd->add_option("recipe", args->recipe, "Recipe YAML file");
  cmd->add_option("--set", args->sets, "Override a recipe field (repeatable)")
      ->expected(1)
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
  cmd->add_flag("--explain", args->explain, "List every recipe key with its type, default and meaning");
  cmd->add_option("-o,--output", args->output, "With --explain: text, markdown (the README's table) or json")
      ->check(CLI::IsMember({"text", "markdown", "json"}));
  ctx.Bind(cmd, [args] { return Validate(*args); });
}

}  // namespace ltrain::cli
