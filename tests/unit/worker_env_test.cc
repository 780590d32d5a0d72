// The worker's environment variables that are parsed apart from the recipe.

#include <gtest/gtest.h>

#include "worker/control/worker_env.h"

namespace ltrain::worker {
namespace {

TEST(ProfileWindowTest, OneStepOrARangeOfSteps) {
  StatusOr<ProfileWindow> one = ParseProfileWindow("10:/tmp/step10.json");
  ASSERT_TRUE(one.ok()) << one.status().ToString();
  EXPECT_EQ(one->first, 10);
  EXPECT_EQ(one->last, 10);
  EXPECT_EQ(one->path, "/tmp/step10.json");

  StatusOr<ProfileWindow> range = ParseProfileWindow("5-7:trace:with:colons.json");
  ASSERT_TRUE(range.ok()) << range.status().ToString();
  EXPECT_EQ(range->first, 5);
  EXPECT_EQ(range->last, 7);
  EXPECT_EQ(range->path, "trace:with:colons.json");
}

TEST(ProfileWindowTest, MalformedValuesNameTheForm) {
  for (const char* value : {"10", "10:", ":x.json", "0:x.json", "a:x.json", "5-:x.json", "-5:x.json", "5-x:x.json",
                            "+5:x.json", "5 :x.json"}) {
    StatusOr<ProfileWindow> w = ParseProfileWindow(value);
    ASSERT_FALSE(w.ok()) << value;
    EXPECT_NE(w.status().message().find("expected STEP:PATH or FIRST-LAST:PATH"), std::string::npos)
        << w.status().message();
  }
  StatusOr<ProfileWindow> backwards = ParseProfileWindow("7-5:x.json");
  ASSERT_FALSE(backwards.ok());
  EXPECT_NE(backwards.status().message().find("the last step 5 comes before the first 7"), std::string::npos)
      << backwards.status().message();
}

// A 0/1 switch (LTRAIN_NORM_REBUILD): unset leaves the caller's default; anything but 0 or 1 is
// refused with the variable's name and the values it takes.
TEST(EnvSwitchTest, ZeroOrOneOrUnset) {
  int value = -1;
  ASSERT_TRUE(EnvSwitch(EnvironmentOf({}), "LTRAIN_NORM_REBUILD", &value).ok());
  EXPECT_EQ(value, -1);
  ASSERT_TRUE(EnvSwitch(EnvironmentOf({"LTRAIN_NORM_REBUILD=1"}), "LTRAIN_NORM_REBUILD", &value).ok());
  EXPECT_EQ(value, 1);
  ASSERT_TRUE(EnvSwitch(EnvironmentOf({"LTRAIN_NORM_REBUILD=0"}), "LTRAIN_NORM_REBUILD", &value).ok());
  EXPECT_EQ(value, 0);
  const Status bad = EnvSwitch(EnvironmentOf({"LTRAIN_NORM_REBUILD=yes"}), "LTRAIN_NORM_REBUILD", &value);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.message(), "LTRAIN_NORM_REBUILD='yes': expected 0 or 1");
  EXPECT_EQ(value, 0);
}

// The job's newest commit, as the agent passes it: a step past 2^31 reads whole; a word is refused.
TEST(WorkerEnvTest, CommittedStepIsAnInt64) {
  StatusOr<WorkerEnv> none = ParseWorkerEnv(EnvironmentOf({}), {});
  ASSERT_TRUE(none.ok());
  EXPECT_EQ(none->committed_step, 0);
  StatusOr<WorkerEnv> large = ParseWorkerEnv(EnvironmentOf({"LTRAIN_COMMITTED_STEP=4294967296"}), {});
  ASSERT_TRUE(large.ok()) << large.status().message();
  EXPECT_EQ(large->committed_step, int64_t{4294967296});
  StatusOr<WorkerEnv> bad = ParseWorkerEnv(EnvironmentOf({"LTRAIN_COMMITTED_STEP=12x"}), {});
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().message(), "LTRAIN_COMMITTED_STEP='12x' is not an integer");
  int narrow = 0;
  EXPECT_FALSE(EnvInt(EnvironmentOf({"LTRAIN_GENERATION=4294967296"}), "LTRAIN_GENERATION", &narrow).ok());
}

}  // namespace
}  // namespace ltrain::worker
