// Keeps the node's NVIDIA GPUs attached while the agent runs, as nvidia-persistenced does: the
// driver initializes a GPU when the first process opens its device file (/dev/nvidiaN) and tears its
// state down when the last one closes it, unless persistence mode is on. Without a holder, every
// rank's first CUDA call after a restart pays that initialization again (seconds on an H100). The
// agent opens each /dev/nvidiaN once, off its own threads, and holds it until it exits; where
// persistence mode is on, this changes nothing. Holding a GPU open keeps `nvidia-smi -r` from resetting
// it, which `ltrain agent --release-idle-gpus` allows.
#pragma once

#include <string>
#include <thread>
#include <vector>

namespace ltrain::agent {

class GpuAttachment {
 public:
  // Opens, on a thread of its own, every file named nvidia<digits> in `device_dir`.
  explicit GpuAttachment(std::string device_dir = "/dev");
  ~GpuAttachment();  // closes them
  GpuAttachment(const GpuAttachment&) = delete;
  GpuAttachment& operator=(const GpuAttachment&) = delete;

  // Waits until every device is open (or could not be), then names the ones held, in order. One
  // thread at a time.
  const std::vector<std::string>& Held();

 private:
  std::thread opener_;
  std::vector<std::string> held_;
  std::vector<int> fds_;
};

}  // namespace ltrain::agent
