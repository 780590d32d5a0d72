// ltrain: the command line. Adds the commands (cmd/commands.h), parses, runs the one given; its exit
// code is the process's (cmd/cli_support.h lists them).
#include <csignal>
#include <cstdio>
#include <string>

#include <CLI/CLI.hpp>

#include "cmd/cli_support.h"
#include "cmd/commands.h"
#include "common/files.h"
#include "common/mutex_tracking.h"

int main(int argc, char** argv) {
  using namespace ltrain::cli;
  // A launch whose output is piped into head or a tee that ends keeps its job running: writes to the
  // closed pipe fail instead of killing the process (children get the default back).
  ::signal(SIGPIPE, SIG_IGN);
  ltrain::StopMutexOrderTracking();
  CLI::App app{
      "ltrain: launch and keep alive distributed LLM training jobs.\n\n"
      "Standalone: `ltrain launch RECIPE` starts a coordinator and an agent on loopback itself.\n"
      "Cluster: `ltrain coordinator` on one host, `ltrain agent --coordinator HOST:PORT` on every node,\n"
      "then `ltrain launch --coordinator HOST:PORT RECIPE`.\n\n"
      "State lives under $LTRAIN_HOME (default ~/.ltrain). Client settings (coordinator, TLS files, token\n"
      "file, output) come from flags, else $LTRAIN_COORDINATOR, $LTRAIN_TLS_*, $LTRAIN_TOKEN_FILE, $LTRAIN_OUTPUT,\n"
      "else $LTRAIN_HOME/config.yaml (keys coordinator, tls_ca, tls_cert, tls_key, token_file, output).\n"
      "Exit codes: 0 success, 1 job failed, 2 invalid input, 3 coordinator unreachable or error, 4 job stopped.",
      "ltrain"};
  app.set_version_flag("--version", std::string("ltrain ") + LTRAIN_VERSION);
  app.require_subcommand(1);
  CommandContext ctx;
  ctx.AddGlobalOptions(app);
  // In this order in --help and in the completion script.
  AddLaunchCommand(app, ctx);
  AddRunCommand(app, ctx);
  AddResumeCommand(app, ctx);
  AddValidateCommand(app, ctx);
  AddPlanCommand(app, ctx);
  AddDataCommand(app, ctx);
  AddListCommand(app, ctx);
  AddLogsCommand(app, ctx);
  AddCheckpointCommand(app, ctx);
  AddExportCommand(app, ctx);
  AddGenerateCommand(app, ctx);
  AddCompletionCommand(app, ctx);
  AddStatusCommand(app, ctx);
  AddNodesCommand(app, ctx);
  AddDashboardCommand(app, ctx);
  AddStopCommand(app, ctx);
  AddCoordinatorCommand(app, ctx);
  AddAgentCommand(app, ctx);

  // $LTRAIN_HOME/config.yaml: defaults for the environment, before the flags are read.
  if (ltrain::Status loaded = LoadClientConfig(LtrainHome()); !loaded.ok()) {
    std::fprintf(stderr, "ltrain: %s\n", loaded.message().c_str());
    return kExitInvalid;
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // --help and --version exit 0; a command line CLI11 refuses is invalid input, exit 2 like every other.
    if (e.get_exit_code() == 0) return app.exit(e);
    if (app.get_subcommands().empty() && !app.remaining().empty() && app.remaining().front().rfind('-', 0) != 0) {
      std::fprintf(stderr, "ltrain: unknown command '%s'; `ltrain --help` lists the commands\n",
                   app.remaining().front().c_str());
    } else {
      app.exit(e);
    }
    return kExitInvalid;
  }
  if (int code = ctx.ApplyGlobalOptions(); code != kExitOk) return code;
  if (int code = CommandContext::RefuseNonFiniteNumbers(app); code != kExitOk) return code;
  // State, logs, tokens and checkpoints are this user's alone whatever the umask: every command but
  // those that write a user's own outputs (a dataset, an export, a sample) creates files 0600 and
  // folders 0700. A user's program under `ltrain run` gets the umask it was started with.
  const std::string command = app.get_subcommands().front()->get_name();
  if (command != "data" && command != "export" && command != "generate") ltrain::UsePrivateFileModes();
  return ctx.RunSelected();
}
