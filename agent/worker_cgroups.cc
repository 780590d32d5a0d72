#include "agent/worker_cgroups.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <vector>

namespace ltrain::agent {
namespace {

namespace fs = std::filesystem;

std::string ReadAll(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

bool WriteText(const std::string& path, const std::string& text) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CLOEXEC | O_NOFOLLOW);
  if (fd < 0) return false;
  const bool written = ::write(fd, text.data(), text.size()) == static_cast<ssize_t>(text.size());
  ::close(fd);
  return written;
}

// Removes the worker cgroups under `dir`, then `dir`: only the empty ones go (rmdir refuses others).
void RemoveEmpty(const std::string& dir) {
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    if (entry.is_directory(ec)) ::rmdir(entry.path().c_str());
  }
  ::rmdir(dir.c_str());
}

}  // namespace

std::optional<std::string> OwnCgroup2Dir(const std::string& mountinfo, const std::string& proc_self_cgroup) {
  std::optional<std::string> own;
  std::istringstream cgroups(proc_self_cgroup);
  for (std::string line; std::getline(cgroups, line);) {
    if (line.rfind("0::", 0) == 0) own = line.substr(3);
  }
  if (!own) return std::nullopt;
  std::istringstream mounts(mountinfo);
  for (std::string line; std::getline(mounts, line);) {
    // ID PARENT MAJ:MIN ROOT MOUNT OPTIONS [OPTIONAL...] - FSTYPE SOURCE SUPER
    std::istringstream fields(line);
    std::vector<std::string> words;
    for (std::string word; fields >> word;) words.push_back(word);
    size_t dash = 0;
    while (dash < words.size() && words[dash] != "-") ++dash;
    if (words.size() < 5 || dash + 1 >= words.size() || words[dash + 1] != "cgroup2") continue;
    const std::string& root = words[3];
    std::string path = *own;
    // A mount of a part of the hierarchy (a container's) holds the paths below its root.
    if (root != "/") {
      if (path.rfind(root, 0) != 0) continue;
      path = path.substr(root.size());
    }
    std::string dir = words[4];
    if (!path.empty() && path != "/") dir += path;
    return dir;
  }
  return std::nullopt;
}

std::unique_ptr<WorkerCgroups> WorkerCgroups::Create(std::string* why) {
  std::optional<std::string> own = OwnCgroup2Dir(ReadAll("/proc/self/mountinfo"), ReadAll("/proc/self/cgroup"));
  if (!own) {
    *why = "no cgroup v2 hierarchy is mounted for this process";
    return nullptr;
  }
  // What agents that were killed left: empty folders of theirs.
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(*own, ec)) {
    if (entry.path().filename().string().rfind("ltrain-agent-", 0) == 0) RemoveEmpty(entry.path().string());
  }
  const std::string dir = *own + "/ltrain-agent-" + std::to_string(::getpid());
  if (::mkdir(dir.c_str(), 0755) != 0 && errno != EEXIST) {
    *why = "cannot create " + dir + ": " + std::strerror(errno);
    return nullptr;
  }
  if (::access((dir + "/cgroup.kill").c_str(), W_OK) != 0) {
    *why = dir + "/cgroup.kill is missing or not writable (a kernel before 5.14?)";
    ::rmdir(dir.c_str());
    return nullptr;
  }
  return std::unique_ptr<WorkerCgroups>(new WorkerCgroups(dir));
}

WorkerCgroups::~WorkerCgroups() {
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir_, ec)) {
    if (entry.is_directory(ec)) Kill(entry.path().string());
  }
  RemoveEmpty(dir_);
}

std::optional<WorkerCgroups::Slot> WorkerCgroups::Prepare() {
  const std::string dir = dir_ + "/w" + std::to_string(next_++);
  if (::mkdir(dir.c_str(), 0755) != 0) return std::nullopt;
  const int fd = ::open((dir + "/cgroup.procs").c_str(), O_WRONLY | O_CLOEXEC);
  if (fd < 0) {
    ::rmdir(dir.c_str());
    return std::nullopt;
  }
  return Slot{dir, fd};
}

void WorkerCgroups::Kill(const std::string& dir) { (void)WriteText(dir + "/cgroup.kill", "1"); }

void WorkerCgroups::Signal(const std::string& dir, int signal) {
  std::istringstream pids(ReadAll(dir + "/cgroup.procs"));
  for (pid_t pid; pids >> pid;) ::kill(pid, signal);
}

void WorkerCgroups::Remove(const std::string& dir) {
  to_remove_.insert(dir);
  Sweep();
}

void WorkerCgroups::Sweep() {
  for (auto it = to_remove_.begin(); it != to_remove_.end();) {
    if (::rmdir(it->c_str()) == 0 || errno == ENOENT) {
      it = to_remove_.erase(it);
    } else {
      ++it;
    }
  }
}

}  // namespace ltrain::agent
