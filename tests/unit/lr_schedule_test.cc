#include "worker/plan/lr_schedule.h"

#include <cmath>

#include <gtest/gtest.h>

namespace ltrain::worker {
namespace {

TEST(LrScheduleTest, WarmupThenCosineToMinimum) {
  LrSchedule s{/*lr=*/1e-3, /*min_lr=*/1e-4, /*warmup_steps=*/10, /*steps=*/110, /*cosine=*/true};
  EXPECT_DOUBLE_EQ(LearningRate(s, 0), 1e-4);       // (0+1)/10 of peak
  EXPECT_DOUBLE_EQ(LearningRate(s, 4), 5e-4);
  EXPECT_DOUBLE_EQ(LearningRate(s, 9), 1e-3);
  EXPECT_DOUBLE_EQ(LearningRate(s, 10), 1e-3);      // decay starts at the peak
  EXPECT_NEAR(LearningRate(s, 60), 0.55e-3, 1e-15);  // halfway: midpoint of lr and min_lr
  EXPECT_NEAR(LearningRate(s, 35), 1e-4 + 0.5 * (1 + std::cos(M_PI * 0.25)) * 9e-4, 1e-15);
  EXPECT_DOUBLE_EQ(LearningRate(s, 110), 1e-4);
  EXPECT_DOUBLE_EQ(LearningRate(s, 500), 1e-4);
  for (int64_t i = 10; i < 110; ++i) EXPECT_GE(LearningRate(s, i), LearningRate(s, i + 1));
}

TEST(LrScheduleTest, ConstantAfterWarmupAndNoWarmup) {
  LrSchedule constant{3e-4, 1e-5, 5, 100, false};
  EXPECT_DOUBLE_EQ(LearningRate(constant, 0), 3e-4 / 5);
  EXPECT_DOUBLE_EQ(LearningRate(constant, 5), 3e-4);
  EXPECT_DOUBLE_EQ(LearningRate(constant, 99), 3e-4);
  LrSchedule no_warmup{1e-3, 0.0, 0, 10, true};
  EXPECT_DOUBLE_EQ(LearningRate(no_warmup, 0), 1e-3);
  EXPECT_NEAR(LearningRate(no_warmup, 5), 0.5e-3, 1e-15);
  LrSchedule all_warmup{1e-3, 1e-4, 20, 10, true};
  EXPECT_DOUBLE_EQ(LearningRate(all_warmup, 9), 0.5e-3);
}

}  // namespace
}  // namespace ltrain::worker
