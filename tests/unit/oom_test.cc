#include "agent/oom.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

namespace ltrain::agent {
namespace {

TEST(OomTest, ParsesTheCounterOfBothCgroupVersions) {
  EXPECT_EQ(ParseOomKillCount("low 0\nhigh 0\nmax 12\noom 3\noom_kill 2\n"), 2);
  EXPECT_EQ(ParseOomKillCount("oom_kill_disable 0\nunder_oom 0\noom_kill 7\n"), 7);
  EXPECT_FALSE(ParseOomKillCount("oom_kill_disable 0\nunder_oom 0\n").has_value());
}

TEST(OomTest, FindsTheCounterFileOfThisCgroup) {
  std::string root = ::testing::TempDir() + "/cgroup-root";
  std::filesystem::create_directories(root + "/job/a");
  std::filesystem::create_directories(root + "/memory/job/b");
  std::ofstream(root + "/job/a/memory.events") << "oom_kill 0\n";
  std::ofstream(root + "/memory/job/b/memory.oom_control") << "oom_kill 0\n";
  EXPECT_EQ(OomCounterPath("0::/job/a\n", root), root + "/job/a/memory.events");
  EXPECT_EQ(OomCounterPath("4:memory:/job/b\n0::/\n", root), root + "/memory/job/b/memory.oom_control");
  EXPECT_FALSE(OomCounterPath("4:cpu:/x\n", root).has_value());
  std::filesystem::remove_all(root);
}

}  // namespace
}  // namespace ltrain::agent
