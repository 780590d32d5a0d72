// A Python program's command line, as `python3 [OPTIONS] SCRIPT ARGS` or `python3 [OPTIONS] -m
// MODULE ARGS`: what a warm standby needs to run the same program in an interpreter started
// earlier (entrypoint.warm_standby).
#pragma once

#include <optional>
#include <string>
#include <vector>

namespace ltrain {

struct PythonCommand {
  std::string interpreter;           // python3, /usr/bin/python3.11, ...
  std::vector<std::string> options;  // the interpreter's own options before the script (-u, -X dev, ...)
  bool module = false;               // -m MODULE rather than a script
  std::string target;                // the script's path, or the module's name
  std::vector<std::string> args;     // what follows
};

// nullopt, with `error` set, when `command` is not a Python interpreter (its file name python,
// python3 or python3.N) running a script or a module: -c CODE, a program read from stdin, and
// options that take the rest of the line are refused with the reason.
std::optional<PythonCommand> ParsePythonCommand(const std::vector<std::string>& command, std::string& error);

}  // namespace ltrain
