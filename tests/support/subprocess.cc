#include "tests/support/subprocess.h"

#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>
#include <thread>

extern char** environ;

namespace ltrain::testing {

namespace fs = std::filesystem;

Subprocess::Subprocess(const std::vector<std::string>& argv, const std::map<std::string, std::string>& env) {
  char path[] = "/tmp/ltrain-test-output-XXXXXX";
  int fd = mkstemp(path);
  output_path_ = path;
  std::map<std::string, std::string> merged;
  for (char** e = environ; *e; ++e) {
    std::string entry(*e);
    size_t eq = entry.find('=');
    if (eq != std::string::npos) merged[entry.substr(0, eq)] = entry.substr(eq + 1);
  }
  for (const auto& [k, v] : env) merged[k] = v;
  std::vector<std::string> env_strings;
  for (const auto& [k, v] : merged) env_strings.push_back(k + "=" + v);
  std::vector<char*> envp;
  for (auto& s : env_strings) envp.push_back(s.data());
  envp.push_back(nullptr);
  std::vector<std::string> args = argv;
  std::vector<char*> c_argv;
  for (auto& s : args) c_argv.push_back(s.data());
  c_argv.push_back(nullptr);
  started_ = std::chrono::steady_clock::now();
  pid_ = fork();
  if (pid_ == 0) {
    setpgid(0, 0);
    dup2(fd, STDOUT_FILENO);
    dup2(fd, STDERR_FILENO);
    close(fd);
    execve(c_argv[0], c_argv.data(), envp.data());
    _exit(127);
  }
  setpgid(pid_, pid_);
  close(fd);
}

Subprocess::~Subprocess() {
  if (!reaped_ && pid_ > 0) {
    killpg(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
  }
  std::error_code ec;
  fs::remove(output_path_, ec);
}

std::string Subprocess::Output() const {
  std::ifstream in(output_path_);
  std::stringstream buffer;
  buffer << in.rdbuf();
  return buffer.str();
}

bool Subprocess::WaitForOutput(const std::string& needle, std::chrono::milliseconds timeout) const {
  auto deadline = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < deadline) {
    if (Output().find(needle) != std::string::npos) return true;
    siginfo_t info{};
    if (waitid(P_PID, static_cast<id_t>(pid_), &info, WEXITED | WNOHANG | WNOWAIT) == 0 && info.si_pid == pid_) {
      return Output().find(needle) != std::string::npos;  // it ended
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return false;
}

ProcessResult Subprocess::Wait(std::chrono::milliseconds timeout) {
  ProcessResult result;
  auto deadline = std::chrono::steady_clock::now() + timeout;
  int status = 0;
  while (true) {
    pid_t done = waitpid(pid_, &status, WNOHANG);
    if (done == pid_) break;
    if (std::chrono::steady_clock::now() >= deadline) {
      result.timed_out = true;
      killpg(pid_, SIGKILL);
      waitpid(pid_, &status, 0);
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  reaped_ = true;
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started_).count();
  if (WIFEXITED(status)) result.exit_code = WEXITSTATUS(status);
  if (WIFSIGNALED(status)) result.signal = WTERMSIG(status);
  result.output = Output();
  return result;
}

void Subprocess::Signal(int signal) const { kill(pid_, signal); }

ProcessResult RunProcess(const std::vector<std::string>& argv, const std::map<std::string, std::string>& env,
                  std::chrono::milliseconds timeout) {
  Subprocess process(argv, env);
  return process.Wait(timeout);
}

TempDir::TempDir() {
  char path[] = "/tmp/ltrain-test-XXXXXX";
  path_ = mkdtemp(path);
}

TempDir::~TempDir() {
  std::error_code ec;
  fs::remove_all(path_, ec);
}

std::string TempDir::Write(const std::string& name, const std::string& content) const {
  std::string path = Join(name);
  fs::create_directories(fs::path(path).parent_path());
  std::ofstream(path) << content;
  return path;
}

std::string LtrainBinary() { return std::string(LTRAIN_BIN_DIR) + "/ltrain"; }

std::string SourceDir() { return LTRAIN_SOURCE_DIR; }

std::vector<std::string> LicenseTexts() {
  std::vector<std::string> texts;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator("/usr/share/common-licenses", ec)) {
    if (entry.is_regular_file() && !entry.is_symlink()) texts.push_back(entry.path().string());
  }
  std::sort(texts.begin(), texts.end());
  return texts;
}

ProcessResult PrepareLicenseData(const std::string& output) {
  std::vector<std::string> texts = LicenseTexts();
  if (texts.empty()) {
    ProcessResult missing;
    missing.exit_code = 1;
    missing.output = "the tests train on the licence texts in /usr/share/common-licenses, and there are none: "
                     "install Debian's base-files package";
    return missing;
  }
  std::vector<std::string> argv = {LtrainBinary(), "data", "prepare", "--input"};
  argv.insert(argv.end(), texts.begin(), texts.end());
  argv.insert(argv.end(), {"--output", output});
  return RunProcess(argv);
}

std::string TinyRecipe(const std::string& name, const std::string& data_dir) {
  return "name: " + name + "\nmodel: {layers: 2, d_model: 64, heads: 4, seq_len: 32}\ndata: {path: " + data_dir + "}\n";
}

bool ProcessAlive(pid_t pid) {
  if (kill(pid, 0) != 0) return false;
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string content((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
  size_t close = content.rfind(')');
  if (close == std::string::npos || close + 2 >= content.size()) return false;
  return content[close + 2] != 'Z' && content[close + 2] != 'X';
}

int FreePort() {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return 0;
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t size = sizeof(address);
  int port = 0;
  if (bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0 &&
      getsockname(fd, reinterpret_cast<sockaddr*>(&address), &size) == 0) {
    port = ntohs(address.sin_port);
  }
  close(fd);
  return port;
}

int WaitForPortFile(const std::string& path, std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (!std::filesystem::exists(path) && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  std::ifstream in(path);
  int port = 0;
  in >> port;
  return port;
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream buffer;
  buffer << in.rdbuf();
  return buffer.str();
}

std::vector<double> ParseLosses(const std::string& output) {
  static const std::regex kLine(R"(\[rank 0\] step \d+/\d+ loss ([0-9.eE+-]+))");
  std::vector<double> losses;
  for (auto it = std::sregex_iterator(output.begin(), output.end(), kLine); it != std::sregex_iterator(); ++it) {
    losses.push_back(std::strtod((*it)[1].str().c_str(), nullptr));
  }
  return losses;
}

std::string WithoutStepLines(const std::string& output) {
  static const std::regex kLine(R"(^\[rank \d+\] (step \d+/\d+ |memory rank ))");
  std::string kept;
  size_t at = 0;
  while (at < output.size()) {
    size_t end = output.find('\n', at);
    end = end == std::string::npos ? output.size() : end + 1;
    const std::string line = output.substr(at, end - at);
    if (!std::regex_search(line, kLine)) kept += line;
    at = end;
  }
  return kept;
}

}  // namespace ltrain::testing
