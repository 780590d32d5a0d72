// What the trainer's source files share and no one else uses (trainer.cc, trainer_checkpoint.cc, trainer_recovery.cc).
#pragma once

#include <chrono>

namespace ltrain::worker {

using SteadyClock = std::chrono::steady_clock;

inline double MillisSince(SteadyClock::time_point start) {
  return std::chrono::duration<double, std::milli>(SteadyClock::now() - start).count();
}

}  // namespace ltrain::worker
