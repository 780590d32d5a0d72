// Sends this rank's Progress (worker/control/progress.h) to its agent's WorkerService: every
// `interval` from a thread of its own, at once on Flush(), and a last time when destroyed. The
// reports are sent one at a time, numbered (RankProgress.seq), in the order their snapshots were
// taken. Failures to reach the agent are ignored: the agent's own view (a rank that went silent) is
// what detects trouble. When the agent's reply to a periodic report says the job is to stop after a
// final checkpoint, `on_checkpoint_stop` is called (on the reporter's thread, after every such reply).
//
// Ordering: a line printed after Flush() returned reaches the coordinator after the report (the
// agent forwards a report that brings a commit or the stop after a final checkpoint ahead of the
// lines read after it), so callers record such news, Flush(), then print.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

namespace ltrain::worker {

struct ProgressReporterOptions {
  std::string agent_address;   // HOST:PORT of the agent's WorkerService
  std::string job_id;
  int generation = 0;
  int rank = 0;
  std::chrono::milliseconds interval{200};
  std::function<void()> on_checkpoint_stop = nullptr;
  std::string agent_secret;    // the job generation's secret for the agent (LTRAIN_AGENT_SECRET_FILE)
};

class ProgressReporter {
 public:
  explicit ProgressReporter(ProgressReporterOptions options);
  // Stops the thread, then sends a last report synchronously: what the rank did last reaches the
  // agent before the process exits.
  ~ProgressReporter();
  ProgressReporter(const ProgressReporter&) = delete;
  ProgressReporter& operator=(const ProgressReporter&) = delete;

  // Sends a snapshot of this rank's progress now, on the caller's thread, and returns once the
  // agent has it (or its deadline passed: the agent is unreachable). Any thread may call it.
  void Flush();

 private:
  struct Connection;  // the generated gRPC stub, kept out of this header (see worker/control/CMakeLists.txt)

  void Loop();
  // Sends a snapshot of Progress::Global(); true when the agent's reply asks for a stop after a
  // final checkpoint.
  bool Send();

  ProgressReporterOptions options_;
  std::unique_ptr<Connection> connection_;
  std::mutex send_mu_;  // one report at a time
  int64_t seq_ = 0;     // under send_mu_
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace ltrain::worker
