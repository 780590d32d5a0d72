// Recognising the kernel's out-of-memory killer: its kills show up as SIGKILL, and the cgroup's
// oom_kill counter (cgroup v2 memory.events, v1 memory.oom_control) goes up.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace ltrain::agent {

// The "oom_kill N" value in the text of memory.events or memory.oom_control.
std::optional<int64_t> ParseOomKillCount(const std::string& text);

// The path of this process's cgroup counter file, from /proc/self/cgroup's text: the v2 entry
// ("0::/path") gives <root>/path/memory.events, the v1 memory entry ("N:memory:/path") gives
// <root>/memory/path/memory.oom_control.
std::optional<std::string> OomCounterPath(const std::string& proc_self_cgroup, const std::string& root = "/sys/fs/cgroup");

// The current count for this process's cgroup, when the system exposes one.
std::optional<int64_t> ReadOomKillCount();

}  // namespace ltrain::agent
