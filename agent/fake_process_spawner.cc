#include "agent/fake_process_spawner.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace ltrain::agent {

FakeProcessSpawner::~FakeProcessSpawner() {
  for (auto& [pid, process] : processes_) {
    if (process.output_fd >= 0) close(process.output_fd);
    if (process.input_fd >= 0) close(process.input_fd);
  }
}

StatusOr<SpawnedProcess> FakeProcessSpawner::Spawn(const SpawnSpec& spec) {
  spawns_.push_back(Spawned{spec, -1});
  if (!spawn_failures_.empty()) {
    Status failure = spawn_failures_.front();
    spawn_failures_.pop_front();
    return failure;
  }
  int fds[2];
  if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds) != 0) {
    return Internal(std::string("socketpair: ") + std::strerror(errno));
  }
  fcntl(fds[0], F_SETFL, fcntl(fds[0], F_GETFL) | O_NONBLOCK);  // as the real spawner hands it out
  pid_t pid = next_pid_++;
  processes_[pid].output_fd = fds[1];
  spawns_.back().pid = pid;
  SpawnedProcess spawned{pid, fds[0]};
  if (spec.input_pipe) {
    int input[2];
    if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, input) != 0) {
      return Internal(std::string("socketpair: ") + std::strerror(errno));
    }
    fcntl(input[1], F_SETFL, fcntl(input[1], F_GETFL) | O_NONBLOCK);
    processes_[pid].input_fd = input[1];
    spawned.input_fd = input[0];
  }
  return spawned;
}

void FakeProcessSpawner::KillGroup(pid_t pid, int signal) {
  signals_.push_back(SentSignal{pid, signal});
  auto found = processes_.find(pid);
  if (found == processes_.end() || found->second.ended || found->second.uninterruptible) return;
  if (signal == SIGKILL || (signal == SIGTERM && !found->second.ignores_sigterm)) End(pid, 0, signal);
}

std::optional<ProcessExit> FakeProcessSpawner::TryReap() {
  if (exits_.empty()) return std::nullopt;
  ProcessExit exit = exits_.front();
  exits_.pop_front();
  return exit;
}

void FakeProcessSpawner::FailNextSpawn(Status status) { spawn_failures_.push_back(std::move(status)); }

void FakeProcessSpawner::Print(pid_t pid, std::string_view text) {
  auto found = processes_.find(pid);
  if (found == processes_.end() || found->second.output_fd < 0) return;
  // MSG_NOSIGNAL: once the reader closed its end, the text is lost, as a dead pipe's would be.
  ssize_t ignored = send(found->second.output_fd, text.data(), text.size(), MSG_NOSIGNAL);
  (void)ignored;
}

void FakeProcessSpawner::Exit(pid_t pid, int code) { End(pid, code, 0); }

void FakeProcessSpawner::Die(pid_t pid, int signal) { End(pid, 0, signal); }

void FakeProcessSpawner::IgnoreSigterm(pid_t pid) {
  auto found = processes_.find(pid);
  if (found != processes_.end()) found->second.ignores_sigterm = true;
}

void FakeProcessSpawner::MakeUninterruptible(pid_t pid) {
  auto found = processes_.find(pid);
  if (found != processes_.end()) found->second.uninterruptible = true;
}

std::vector<int> FakeProcessSpawner::SignalsTo(pid_t pid) const {
  std::vector<int> out;
  for (const auto& sent : signals_) {
    if (sent.pid == pid) out.push_back(sent.signal);
  }
  return out;
}

std::string FakeProcessSpawner::Input(pid_t pid, bool* closed) {
  auto found = processes_.find(pid);
  if (found == processes_.end()) return "";
  Process& process = found->second;
  char buffer[4096];
  while (process.input_fd >= 0) {
    const ssize_t n = read(process.input_fd, buffer, sizeof(buffer));
    if (n > 0) {
      process.input.append(buffer, static_cast<size_t>(n));
      continue;
    }
    if (n == 0) {
      process.input_closed = true;
      close(process.input_fd);
      process.input_fd = -1;
    }
    break;
  }
  if (closed != nullptr) *closed = process.input_closed;
  return process.input;
}

bool FakeProcessSpawner::Alive(pid_t pid) const {
  auto found = processes_.find(pid);
  return found != processes_.end() && !found->second.ended;
}

void FakeProcessSpawner::End(pid_t pid, int code, int signal) {
  auto found = processes_.find(pid);
  if (found == processes_.end() || found->second.ended) return;
  Input(pid);  // what the supervisor wrote before the end stays readable
  Process& process = found->second;
  process.ended = true;
  if (process.output_fd >= 0) close(process.output_fd);
  process.output_fd = -1;
  if (process.input_fd >= 0) close(process.input_fd);
  process.input_fd = -1;
  ProcessExit exit;
  exit.pid = pid;
  exit.exit_code = signal ? 0 : code;
  exit.signal = signal;
  exits_.push_back(exit);
}

}  // namespace ltrain::agent
