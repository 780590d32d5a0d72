#include "agent/oom.h"

#include <filesystem>
#include <fstream>
#include <sstream>

namespace ltrain::agent {

std::optional<int64_t> ParseOomKillCount(const std::string& text) {
  std::istringstream in(text);
  std::string key;
  int64_t value = 0;
  while (in >> key >> value) {
    if (key == "oom_kill") return value;
  }
  return std::nullopt;
}

std::optional<std::string> OomCounterPath(const std::string& proc_self_cgroup, const std::string& root) {
  std::istringstream in(proc_self_cgroup);
  std::optional<std::string> v1;
  for (std::string line; std::getline(in, line);) {
    size_t first = line.find(':');
    size_t second = first == std::string::npos ? std::string::npos : line.find(':', first + 1);
    if (second == std::string::npos) continue;
    std::string controllers = line.substr(first + 1, second - first - 1);
    std::string path = line.substr(second + 1);
    if (line.substr(0, first) == "0" && controllers.empty()) {
      std::string file = root + (path == "/" ? "" : path) + "/memory.events";
      if (std::filesystem::exists(file)) return file;
    } else if (controllers == "memory") {
      v1 = root + "/memory" + (path == "/" ? "" : path) + "/memory.oom_control";
    }
  }
  if (v1 && std::filesystem::exists(*v1)) return v1;
  return std::nullopt;
}

std::optional<int64_t> ReadOomKillCount() {
  std::ifstream self("/proc/self/cgroup");
  std::stringstream cgroups;
  cgroups << self.rdbuf();
  std::optional<std::string> path = OomCounterPath(cgroups.str());
  if (!path) return std::nullopt;
  std::ifstream counter(*path);
  std::stringstream text;
  text << counter.rdbuf();
  return ParseOomKillCount(text.str());
}

}  // namespace ltrain::agent
