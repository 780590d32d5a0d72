// The `ltrain` commands. Each Add…Command adds its subcommand, flags and help to the CLI::App and binds
// the handler that runs when the command line names it; `main` adds them all, parses, and calls
// CommandContext::RunSelected. Everything runs on the main thread.
#pragma once

#include <functional>
#include <string>
#include <utility>
#include <vector>

#include <CLI/CLI.hpp>

#include "common/transport_security.h"

namespace ltrain::cli {

// What the commands share beyond their own flags: the global flags (log level, TLS and token) and,
// once they are applied, the security material every coordinator connection uses.
class CommandContext {
 public:
  // --log-level and the TLS/token flags, on `app`; they may also follow the subcommand. Call before
  // adding the subcommands, which inherit that.
  void AddGlobalOptions(CLI::App& app);

  // After parsing: sets the log level and loads the TLS files and token. kExitOk, or the exit code of
  // a bad value after saying why.
  int ApplyGlobalOptions();

  // `handler` runs when `command` is the (sub)command given; it returns the process's exit code.
  void Bind(CLI::App* command, std::function<int()> handler);

  // Runs the handler of the command that was given; kExitInvalid when none was.
  int RunSelected() const;

  // After parsing: kExitOk, or kExitInvalid after naming the option, when a number option of the
  // given command (or a global one) was given NaN or an infinity, which no option means.
  static int RefuseNonFiniteNumbers(const CLI::App& app);

  // The TLS and token flags as given; the coordinator command adds --tls-client-ca to them.
  SecurityOptions& security_options() { return security_options_; }
  // As loaded by ApplyGlobalOptions: what clients, the coordinator and agents connect with.
  const SecurityMaterial& security() const { return security_; }

 private:
  std::string log_level_ = "info";
  SecurityOptions security_options_;
  SecurityMaterial security_;
  std::vector<std::pair<CLI::App*, std::function<int()>>> handlers_;
};

void AddLaunchCommand(CLI::App& app, CommandContext& ctx);
void AddRunCommand(CLI::App& app, CommandContext& ctx);  // a program of the user's own, as torchrun runs it
void AddResumeCommand(CLI::App& app, CommandContext& ctx);
void AddValidateCommand(CLI::App& app, CommandContext& ctx);
void AddPlanCommand(CLI::App& app, CommandContext& ctx);  // layouts before a run
void AddDataCommand(CLI::App& app, CommandContext& ctx);  // `data prepare`
void AddListCommand(CLI::App& app, CommandContext& ctx);
void AddLogsCommand(CLI::App& app, CommandContext& ctx);
void AddCheckpointCommand(CLI::App& app, CommandContext& ctx);  // `checkpoint inspect`
// Completes every subcommand of `app` added before the completion script is printed.
void AddCompletionCommand(CLI::App& app, CommandContext& ctx);
void AddStatusCommand(CLI::App& app, CommandContext& ctx);
void AddStopCommand(CLI::App& app, CommandContext& ctx);
void AddCoordinatorCommand(CLI::App& app, CommandContext& ctx);
void AddAgentCommand(CLI::App& app, CommandContext& ctx);
void AddNodesCommand(CLI::App& app, CommandContext& ctx);
void AddDashboardCommand(CLI::App& app, CommandContext& ctx);  // a one-time login link
void AddExportCommand(CLI::App& app, CommandContext& ctx);    // runs ltrain-worker
void AddGenerateCommand(CLI::App& app, CommandContext& ctx);  // runs ltrain-worker

}  // namespace ltrain::cli
