// Learning-rate schedule: a pure function of the optimizer step, so a resumed run gets exactly the
// rates an uninterrupted one would.
#pragma once

#include <cstdint>
#include <string>

namespace ltrain::worker {

struct LrSchedule {
  double lr = 1e-3;          // peak
  double min_lr = 1e-4;      // cosine floor
  int64_t warmup_steps = 0;
  int64_t steps = 1;         // total optimizer steps of the job
  bool cosine = true;        // false: constant `lr` after warmup
};

// Rate for 0-based optimizer step `step`: linear warmup lr*(step+1)/warmup_steps over the first
// warmup_steps steps, then cosine from lr (at step == warmup_steps) down to min_lr (at step == steps),
// or constant lr. Steps past `steps` stay at min_lr.
double LearningRate(const LrSchedule& schedule, int64_t step);

}  // namespace ltrain::worker
