// Time as every timeout, heartbeat and backoff reads it. Tests drive FakeClock by hand.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>

namespace ltrain {

class Clock {
 public:
  virtual ~Clock() = default;
  // Monotonic milliseconds, for durations.
  virtual int64_t SteadyMs() const = 0;
  // Wall-clock milliseconds since the Unix epoch, for records users read.
  virtual int64_t UnixMs() const = 0;
};

class RealClock : public Clock {
 public:
  int64_t SteadyMs() const override {
    return std::chrono::duration_cast<std::chrono::milliseconds>(
               std::chrono::steady_clock::now().time_since_epoch()).count();
  }
  int64_t UnixMs() const override {
    return std::chrono::duration_cast<std::chrono::milliseconds>(
               std::chrono::system_clock::now().time_since_epoch()).count();
  }
};

// The longest wait or deadline anything grants, a day: a timeout from a request (enormous, negative,
// NaN) cannot overflow the clocks' arithmetic.
inline constexpr int64_t kMaxWaitMs = 86400LL * 1000;

// A wait of `ms`, within [0, kMaxWaitMs].
inline int64_t BoundedWaitMs(int64_t ms) { return std::clamp<int64_t>(ms, 0, kMaxWaitMs); }

// An RPC deadline `seconds` from now, within [0 s, kMaxWaitMs].
inline std::chrono::system_clock::time_point Deadline(double seconds) {
  const double ms = std::isnan(seconds) ? 0.0 : std::clamp(seconds * 1000, 0.0, static_cast<double>(kMaxWaitMs));
  return std::chrono::system_clock::now() + std::chrono::milliseconds(static_cast<int64_t>(ms));
}

class FakeClock : public Clock {
 public:
  explicit FakeClock(int64_t start_ms = 1'000'000) : now_ms_(start_ms) {}
  int64_t SteadyMs() const override { return now_ms_; }
  int64_t UnixMs() const override { return now_ms_; }
  void AdvanceMs(int64_t ms) { now_ms_ += ms; }

 private:
  std::atomic<int64_t> now_ms_;
};

}  // namespace ltrain
