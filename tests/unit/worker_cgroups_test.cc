#include "agent/worker_cgroups.h"

#include <gtest/gtest.h>

namespace ltrain::agent {
namespace {

constexpr const char* kHybridMounts =
    "24 31 0:22 / /sys rw,nosuid,nodev,noexec,relatime shared:7 - sysfs sysfs rw\n"
    "30 24 0:26 / /sys/fs/cgroup ro,nosuid,nodev,noexec shared:9 - tmpfs tmpfs ro,mode=755\n"
    "31 30 0:27 / /sys/fs/cgroup/unified rw,nosuid,nodev,noexec,relatime shared:10 - cgroup2 cgroup2 rw\n"
    "35 30 0:31 / /sys/fs/cgroup/memory rw,nosuid - cgroup cgroup rw,memory\n";

TEST(WorkerCgroupsTest, TheAgentsOwnCgroupIsFoundUnderTheCgroup2Mount) {
  EXPECT_EQ(OwnCgroup2Dir(kHybridMounts, "4:memory:/x\n0::/\n"), "/sys/fs/cgroup/unified");
  EXPECT_EQ(OwnCgroup2Dir(kHybridMounts, "0::/system.slice/ltrain-agent.service\n"),
            "/sys/fs/cgroup/unified/system.slice/ltrain-agent.service");
  // Unified only (systemd's default): the mount is /sys/fs/cgroup itself.
  EXPECT_EQ(OwnCgroup2Dir("29 23 0:26 / /sys/fs/cgroup rw,nosuid shared:4 - cgroup2 cgroup2 rw,nsdelegate\n",
                          "0::/user.slice/user-1000.slice/session-2.scope\n"),
            "/sys/fs/cgroup/user.slice/user-1000.slice/session-2.scope");
  // A container's mount of a part of the hierarchy.
  EXPECT_EQ(OwnCgroup2Dir("40 30 0:26 /kubepods/pod1 /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n",
                          "0::/kubepods/pod1/agent\n"),
            "/sys/fs/cgroup/agent");
}

TEST(WorkerCgroupsTest, WithoutCgroup2ThereIsNone) {
  EXPECT_EQ(OwnCgroup2Dir("35 30 0:31 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n", "0::/\n"), std::nullopt);
  EXPECT_EQ(OwnCgroup2Dir(kHybridMounts, "4:memory:/x\n"), std::nullopt);
}

}  // namespace
}  // namespace ltrain::agent
