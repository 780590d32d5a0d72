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

// Every rank, or the chosen ones, each into a trace of its own: without a path, profile-rank-N.json
// in the job's directory; with {rank} in it, that path; a path without {rank} is rank 0's alone.
TEST(ProfileWindowTest, RanksRecordIntoFilesOfTheirOwn) {
  StatusOr<ProfileWindow> every = ParseProfileWindow("5-6");
  ASSERT_TRUE(every.ok()) << every.status().ToString();
  EXPECT_TRUE(every->Records(0));
  EXPECT_TRUE(every->Records(7));
  EXPECT_EQ(every->PathFor(3), "profile-rank-3.json");
  StatusOr<ProfileWindow> templated = ParseProfileWindow("5:/t/{rank}/trace-{rank}.json");
  ASSERT_TRUE(templated.ok());
  EXPECT_TRUE(templated->Records(12));
  EXPECT_EQ(templated->PathFor(12), "/t/12/trace-12.json");
  StatusOr<ProfileWindow> rank0 = ParseProfileWindow("5:/t/trace.json");
  ASSERT_TRUE(rank0.ok());
  EXPECT_TRUE(rank0->Records(0));
  EXPECT_FALSE(rank0->Records(1));
  StatusOr<ProfileWindow> chosen = ParseProfileWindow("5", "0,4-6");
  ASSERT_TRUE(chosen.ok()) << chosen.status().ToString();
  for (int rank : {0, 4, 5, 6}) EXPECT_TRUE(chosen->Records(rank)) << rank;
  for (int rank : {1, 3, 7}) EXPECT_FALSE(chosen->Records(rank)) << rank;
  StatusOr<ProfileWindow> one = ParseProfileWindow("5:/t/trace.json", "3");
  ASSERT_TRUE(one.ok()) << one.status().ToString();
  EXPECT_TRUE(one->Records(3));
  EXPECT_FALSE(one->Records(0));
  StatusOr<ProfileWindow> clash = ParseProfileWindow("5:/t/trace.json", "all");
  ASSERT_FALSE(clash.ok());
  EXPECT_NE(clash.status().message().find("put {rank} in the path"), std::string::npos) << clash.status().message();
  for (const char* ranks : {"x", "1,", "-1", "3-1", "1--2", " 1"}) {
    EXPECT_FALSE(ParseProfileWindow("5", ranks).ok()) << ranks;
  }
}

TEST(ProfileWindowTest, MalformedValuesNameTheForm) {
  for (const char* value : {"10:", ":x.json", "0:x.json", "a:x.json", "5-:x.json", "-5:x.json", "5-x:x.json",
                            "+5:x.json", "5 :x.json"}) {
    StatusOr<ProfileWindow> w = ParseProfileWindow(value);
    ASSERT_FALSE(w.ok()) << value;
    EXPECT_NE(w.status().message().find("expected STEP[:PATH] or FIRST-LAST[:PATH]"), std::string::npos)
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
