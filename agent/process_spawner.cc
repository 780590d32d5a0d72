#include "agent/process_spawner.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <map>

#include "common/logging.h"

extern char** environ;

namespace ltrain::agent {

std::vector<std::string> SpawnEnvironment(const std::vector<std::string>& spec_env) {
  std::map<std::string, std::string> merged;
  for (char** e = environ; *e; ++e) {
    std::string entry(*e);
    size_t eq = entry.find('=');
    if (eq != std::string::npos) merged[entry.substr(0, eq)] = entry;
  }
  merged.erase("LTRAIN_TOKEN");
  merged.erase("LTRAIN_TOKEN_FILE");
  for (const auto& entry : spec_env) merged[entry.substr(0, entry.find('='))] = entry;
  std::vector<std::string> out;
  for (auto& [key, entry] : merged) out.push_back(std::move(entry));
  return out;
}

RealProcessSpawner::RealProcessSpawner() {
  std::string why;
  cgroups_ = WorkerCgroups::Create(&why);
  if (cgroups_) {
    LTRAIN_LOG(kInfo, "agent") << "each worker runs in a cgroup of its own under " << cgroups_->dir()
                               << ": every process it starts ends with it";
  } else {
    LTRAIN_LOG(kWarning, "agent") << "workers run in process groups only (" << why
                                  << "): a process of a worker that leaves its process group (setsid) can outlive "
                                     "it. Run the agent with a cgroup of its own (systemd: Delegate=yes)";
  }
}

StatusOr<SpawnedProcess> RealProcessSpawner::Spawn(const SpawnSpec& spec) {
  // Everything the child needs is built before fork: only async-signal-safe calls after it.
  std::vector<std::string> env_strings = SpawnEnvironment(spec.env);
  std::vector<char*> envp;
  for (auto& s : env_strings) envp.push_back(s.data());
  envp.push_back(nullptr);
  std::vector<std::string> arg_strings{spec.binary};
  arg_strings.insert(arg_strings.end(), spec.args.begin(), spec.args.end());
  std::vector<char*> argv;
  for (auto& s : arg_strings) argv.push_back(s.data());
  argv.push_back(nullptr);

  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) return Internal(std::string("pipe: ") + std::strerror(errno));
  int input[2] = {-1, -1};
  // A socket pair rather than a pipe: the caller writes with MSG_NOSIGNAL, so a child that died
  // never raises SIGPIPE in the agent.
  if (spec.input_pipe && socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, input) != 0) {
    int error = errno;
    close(fds[0]);
    close(fds[1]);
    return Internal(std::string("socketpair: ") + std::strerror(error));
  }
  std::optional<WorkerCgroups::Slot> cgroup = cgroups_ ? cgroups_->Prepare() : std::nullopt;
  const int procs_fd = cgroup ? cgroup->procs_fd : -1;
  pid_t parent = getpid();
  pid_t pid = fork();
  if (pid < 0) {
    int error = errno;
    for (int fd : {fds[0], fds[1], input[0], input[1], procs_fd}) {
      if (fd >= 0) close(fd);
    }
    if (cgroup) cgroups_->Remove(cgroup->dir);
    return Internal(std::string("fork: ") + std::strerror(error));
  }
  if (pid == 0) {
    // Into the worker's cgroup first: whatever it starts is in there too.
    if (procs_fd >= 0) {
      ssize_t ignored = write(procs_fd, "0", 1);
      (void)ignored;
    }
    // The agent blocks SIGINT/SIGTERM for its own signal thread; a worker must receive them.
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, nullptr);
    // The command line ignores SIGPIPE (a launch piped into head keeps its job); a worker starts with
    // the default, as a program run from a shell does.
    signal(SIGPIPE, SIG_DFL);
    setpgid(0, 0);
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(127);  // the agent died before prctl took effect
    dup2(fds[1], STDOUT_FILENO);
    dup2(fds[1], STDERR_FILENO);
    if (input[0] >= 0) {
      dup2(input[0], STDIN_FILENO);
    } else {
      int devnull = open("/dev/null", O_RDONLY);
      if (devnull >= 0) dup2(devnull, STDIN_FILENO);
    }
    if (!spec.working_dir.empty() && chdir(spec.working_dir.c_str()) != 0) _exit(126);
    // Every other descriptor is close-on-exec or closed here.
    close_range(3, ~0U, 0);
    execve(argv[0], argv.data(), envp.data());
    const char message[] = "ltrain-agent: cannot execute the worker binary\n";
    ssize_t ignored = write(STDERR_FILENO, message, sizeof(message) - 1);
    (void)ignored;
    _exit(127);
  }
  setpgid(pid, pid);  // also from the parent, so KillGroup works even before the child ran
  if (cgroup) {
    close(procs_fd);
    cgroup_of_[pid] = cgroup->dir;
  }
  close(fds[1]);
  fcntl(fds[0], F_SETFL, fcntl(fds[0], F_GETFL) | O_NONBLOCK);
  if (input[0] >= 0) close(input[0]);
  return SpawnedProcess{pid, fds[0], input[1]};
}

void RealProcessSpawner::KillGroup(pid_t pid, int signal) {
  if (pid > 0 && killpg(pid, signal) != 0 && errno == ESRCH) kill(pid, signal);
  auto cgroup = cgroup_of_.find(pid);
  if (cgroup == cgroup_of_.end()) return;
  if (signal == SIGKILL) {
    cgroups_->Kill(cgroup->second);
  } else {
    cgroups_->Signal(cgroup->second, signal);
  }
}

std::optional<ProcessExit> RealProcessSpawner::TryReap() {
  if (cgroups_) cgroups_->Sweep();
  int status = 0;
  pid_t pid = waitpid(-1, &status, WNOHANG);
  if (pid <= 0) return std::nullopt;
  // What the worker left: its cgroup's processes (setsid ones too), else its process group's.
  if (auto cgroup = cgroup_of_.find(pid); cgroup != cgroup_of_.end()) {
    cgroups_->Kill(cgroup->second);
    cgroups_->Remove(cgroup->second);
    cgroup_of_.erase(cgroup);
  } else {
    killpg(pid, SIGKILL);
  }
  ProcessExit exit;
  exit.pid = pid;
  if (WIFSIGNALED(status)) exit.signal = WTERMSIG(status);
  else exit.exit_code = WEXITSTATUS(status);
  return exit;
}

}  // namespace ltrain::agent
