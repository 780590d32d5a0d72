// Running the real ltrain binaries from tests: a child process with captured output, an
// environment of its own, and bounded waits.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace ltrain::testing {

struct ProcessResult {
  int exit_code = -1;  // -1 when killed by a signal
  int signal = 0;
  bool timed_out = false;
  std::string output;  // stdout and stderr interleaved
  double seconds = 0;
};

class Subprocess {
 public:
  // Starts `argv` with `env` added to the test's environment; output goes to a temporary file.
  Subprocess(const std::vector<std::string>& argv, const std::map<std::string, std::string>& env = {});
  ~Subprocess();  // kills the process group if still running

  pid_t pid() const { return pid_; }
  // Output so far.
  std::string Output() const;
  // Polls until `predicate(output)` holds, the process ends, or the timeout passes.
  bool WaitForOutput(const std::string& needle, std::chrono::milliseconds timeout) const;
  // Waits for the exit; kills the group with SIGKILL after `timeout`.
  ProcessResult Wait(std::chrono::milliseconds timeout);
  void Signal(int signal) const;

 private:
  pid_t pid_ = -1;
  std::string output_path_;
  bool reaped_ = false;
  std::chrono::steady_clock::time_point started_;
};

// Runs to completion (bounded).
ProcessResult RunProcess(const std::vector<std::string>& argv, const std::map<std::string, std::string>& env = {},
                  std::chrono::milliseconds timeout = std::chrono::seconds(120));

// A fresh directory under the build's temporary folder, removed by the destructor.
class TempDir {
 public:
  TempDir();
  ~TempDir();
  const std::string& path() const { return path_; }
  std::string Join(const std::string& name) const { return path_ + "/" + name; }
  std::string Write(const std::string& name, const std::string& content) const;

 private:
  std::string path_;
};

// Paths of what the build made and what the repository holds.
std::string LtrainBinary();
std::string SourceDir();
// The licence texts every Debian system has in /usr/share/common-licenses (package base-files, about
// 290,000 bytes of English), sorted by name: what the tests train on. Empty when the folder is missing.
std::vector<std::string> LicenseTexts();
// `ltrain data prepare` of the licence texts into `output`. When the texts are missing, a failed
// result (exit code 1) whose output says so.
ProcessResult PrepareLicenseData(const std::string& output);
// The start of the tests' tiny GPT recipe (2 layers, d 64, 4 heads, 32 tokens) named `name`, on the
// token data in `data_dir` (PrepareLicenseData's output): the caller appends its keys.
std::string TinyRecipe(const std::string& name, const std::string& data_dir);
// True while `pid` is a live (non-zombie) process.
bool ProcessAlive(pid_t pid);
// A whole file's bytes; empty when it cannot be read.
std::string ReadFile(const std::string& path);
// The port a daemon started with --port-file PATH wrote there, once the file exists; 0 if it does
// not appear within `timeout`.
int WaitForPortFile(const std::string& path, std::chrono::milliseconds timeout = std::chrono::seconds(10));
// A port free now on loopback, for a daemon that needs a fixed one (etcd, a coordinator on etcd); 0
// if none could be had.
int FreePort();
// The numbers after "loss " in lines that start with "[rank 0] step ".
std::vector<double> ParseLosses(const std::string& output);
// `output` without the ranks' per-step lines ("[rank R] step S/N ...", "[rank R] memory rank ..."): what a
// failed check prints, so that the events of a run stay within what a test log keeps.
std::string WithoutStepLines(const std::string& output);

}  // namespace ltrain::testing
