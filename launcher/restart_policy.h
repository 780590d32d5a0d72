// When a failed job starts again: pure, no clock, no sleeping.
#pragma once

#include <algorithm>
#include <cstdint>
#include <optional>

namespace ltrain::launcher {

struct RestartPolicy {
  int max_restarts = 0;
  int64_t initial_backoff_ms = 1000;
  int64_t max_backoff_ms = 30000;

  // Delay before restart number `restarts_done + 1`, doubling each time; nullopt once
  // `max_restarts` restarts have been made.
  std::optional<int64_t> NextDelayMs(int restarts_done) const {
    if (restarts_done >= max_restarts) return std::nullopt;
    int64_t delay = initial_backoff_ms;
    for (int i = 0; i < restarts_done && delay < max_backoff_ms; ++i) delay *= 2;
    return std::min(delay, max_backoff_ms);
  }
};

}  // namespace ltrain::launcher
