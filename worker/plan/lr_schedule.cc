#include "worker/plan/lr_schedule.h"

#include <algorithm>
#include <cmath>
#include <numbers>

namespace ltrain::worker {

double LearningRate(const LrSchedule& s, int64_t step) {
  if (step < s.warmup_steps) {
    return s.lr * static_cast<double>(step + 1) / static_cast<double>(s.warmup_steps);
  }
  if (!s.cosine) return s.lr;
  const int64_t decay_steps = s.steps - s.warmup_steps;
  if (decay_steps <= 0) return s.min_lr;
  const double progress =
      std::clamp(static_cast<double>(step - s.warmup_steps) / static_cast<double>(decay_steps), 0.0, 1.0);
  return s.min_lr + 0.5 * (1.0 + std::cos(std::numbers::pi * progress)) * (s.lr - s.min_lr);
}

}  // namespace ltrain::worker
