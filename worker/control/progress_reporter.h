// Sends this rank's Progress to its agent every `interval`, from a thread of its own, until
// destroyed. Rank 0 also reports the newest committed checkpoint it finds in the checkpoint
// directory's `latest` file. Failures to reach the agent are ignored: the agent's own view (a rank
// that went silent) is what detects trouble. When the agent's reply says the job is to stop after a
// final checkpoint, `on_checkpoint_stop` is called (on the reporter's thread, after every such reply).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
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
  std::string checkpoint_dir;  // rank 0 reads `latest` here
  std::chrono::milliseconds interval{200};
  std::function<void()> on_checkpoint_stop = nullptr;
};

class ProgressReporter {
 public:
  explicit ProgressReporter(ProgressReporterOptions options);
  ~ProgressReporter();
  ProgressReporter(const ProgressReporter&) = delete;
  ProgressReporter& operator=(const ProgressReporter&) = delete;

 private:
  void Loop();

  ProgressReporterOptions options_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace ltrain::worker
