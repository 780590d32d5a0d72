// ltrain completion bash: a bash completion script for ltrain.
#include <cstdio>
#include <memory>

#include "cmd/cli_support.h"
#include "cmd/commands.h"

namespace ltrain::cli {
namespace {

// `commands`: the subcommands, separated by spaces. Job ids come from `ltrain list` as it is typed.
std::string BashCompletion(const std::string& commands) {
  return R"BASH(# bash completion for ltrain: source <(ltrain completion bash)
_ltrain() {
  local cur="${COMP_WORDS[COMP_CWORD]}" cmd="${COMP_WORDS[1]}"
  if [[ $COMP_CWORD -eq 1 ]]; then
    COMPREPLY=($(compgen -W ")BASH" + commands + R"BASH(--help --version" -- "$cur")); return
  fi
  case "$cmd" in
    launch|validate) COMPREPLY=($(compgen -f -X '!*.yaml' -- "$cur") $(compgen -d -- "$cur") $(compgen -W "--set --help" -- "$cur"));;
    status|stop|resume|logs)
      local jobs; jobs=$(ltrain list --output json 2>/dev/null | sed -n 's/.*"id": "\([^"]*\)".*/\1/p')
      local flags="--coordinator --output --help"
      [[ $cmd == stop ]] && flags="--coordinator --checkpoint --checkpoint-timeout --help"
      COMPREPLY=($(compgen -W "$jobs $flags" -- "$cur"));;
    data) COMPREPLY=($(compgen -W "prepare" -- "$cur"));;
    *) COMPREPLY=($(compgen -f -- "$cur"));;
  esac
}
complete -F _ltrain ltrain
)BASH";
}

}  // namespace

void AddCompletionCommand(CLI::App& app, CommandContext& ctx) {
  auto shell = std::make_shared<std::string>();
  CLI::App* cmd = app.add_subcommand("completion", "Print a shell completion script: source <(ltrain completion bash)");
  cmd->add_option("shell", *shell, "bash")->required()->check(CLI::IsMember({"bash"}));
  ctx.Bind(cmd, [&app, shell] {  // `shell` lives as long as its option writes into it
    // Read when it runs, not when added: every command is on `app` by then.
    std::string words;
    for (const CLI::App* sub : app.get_subcommands([](const CLI::App*) { return true; })) words += sub->get_name() + " ";
    std::printf("%s", BashCompletion(words).c_str());
    return kExitOk;
  });
}

}  // namespace ltrain::cli
