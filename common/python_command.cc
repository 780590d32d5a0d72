#include "common/python_command.h"

#include <algorithm>
#include <regex>

namespace ltrain {
namespace {

// CPython's options that take no value, and those that take the next argument.
constexpr const char* kFlags = "bBdEhiIOPqsSuvVx";
constexpr const char* kWithValue = "XW";

}  // namespace

std::optional<PythonCommand> ParsePythonCommand(const std::vector<std::string>& command, std::string& error) {
  if (command.empty()) {
    error = "no program";
    return std::nullopt;
  }
  const std::string& program = command.front();
  const std::string base = program.substr(program.rfind('/') == std::string::npos ? 0 : program.rfind('/') + 1);
  static const std::regex kInterpreter(R"(python(3(\.[0-9]+)?)?)");
  if (!std::regex_match(base, kInterpreter)) {
    error = program + " is not a Python interpreter (python, python3 or python3.N)";
    return std::nullopt;
  }
  PythonCommand out;
  out.interpreter = program;
  size_t i = 1;
  for (; i < command.size(); ++i) {
    const std::string& arg = command[i];
    if (arg == "-m") {
      if (i + 1 == command.size()) break;
      out.module = true;
      out.target = command[i + 1];
      i += 2;
      break;
    }
    if (arg.empty() || arg[0] != '-' || arg == "-") {
      if (arg == "-" || arg.empty()) break;
      out.target = arg;
      ++i;
      break;
    }
    if (arg == "-c" || arg.rfind("-c", 0) == 0 || arg == "--") {
      error = "python " + arg + ": a warm standby runs a script file or -m MODULE, not code given on the command line";
      return std::nullopt;
    }
    // -u, -uB (flags together), -X dev, -Xdev, -W error
    const char first = arg.size() > 1 ? arg[1] : '\0';
    if (std::string_view(kWithValue).find(first) != std::string_view::npos) {
      out.options.push_back(arg);
      if (arg.size() == 2) {
        if (i + 1 == command.size()) break;
        out.options.push_back(command[++i]);
      }
      continue;
    }
    const bool flags = arg.size() > 1 && std::all_of(arg.begin() + 1, arg.end(), [](char c) {
                         return std::string_view(kFlags).find(c) != std::string_view::npos;
                       });
    if (!flags) {
      error = "python option " + arg + " is not one a warm standby knows (it knows -u, -O, -B, -X, -W and the like)";
      return std::nullopt;
    }
    out.options.push_back(arg);
  }
  if (out.target.empty()) {
    error = "python runs no script or module (expected python3 [OPTIONS] SCRIPT.py ARGS or python3 -m MODULE ARGS)";
    return std::nullopt;
  }
  out.args.assign(command.begin() + static_cast<std::ptrdiff_t>(i), command.end());
  return out;
}

}  // namespace ltrain
