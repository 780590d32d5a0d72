#include "launcher/restart_policy.h"

#include <gtest/gtest.h>

namespace ltrain::launcher {
namespace {

TEST(RestartPolicyTest, DoublesUpToTheCapAndStopsAtTheLimit) {
  RestartPolicy policy{4, 1000, 5000};
  EXPECT_EQ(policy.NextDelayMs(0), 1000);
  EXPECT_EQ(policy.NextDelayMs(1), 2000);
  EXPECT_EQ(policy.NextDelayMs(2), 4000);
  EXPECT_EQ(policy.NextDelayMs(3), 5000);
  EXPECT_FALSE(policy.NextDelayMs(4).has_value());
}

TEST(RestartPolicyTest, NoRestartsMeansFailAtOnce) {
  EXPECT_FALSE(RestartPolicy{}.NextDelayMs(0).has_value());
}

TEST(RestartPolicyTest, ZeroBackoffRestartsImmediately) {
  EXPECT_EQ(RestartPolicy({3, 0, 0}).NextDelayMs(2), 0);
}

}  // namespace
}  // namespace ltrain::launcher
