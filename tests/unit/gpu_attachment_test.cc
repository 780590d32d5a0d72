#include "agent/gpu_attachment.h"

#include <gtest/gtest.h>
#include <stdlib.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>


namespace ltrain::agent {
namespace {

namespace fs = std::filesystem;

class TempDir {
 public:
  TempDir() {
    std::string pattern = (fs::temp_directory_path() / "ltrain-gpus-XXXXXX").string();
    path_ = mkdtemp(pattern.data()) ? fs::path(pattern) : fs::path();
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  const fs::path& path() const { return path_; }

 private:
  fs::path path_;
};

// Only the GPUs' own device files are held: nvidia<N>, never nvidiactl, nvidia-uvm or the caps.
TEST(GpuAttachmentTest, HoldsEveryGpuDeviceFileInOrder) {
  TempDir dir;
  for (const char* name : {"nvidia10", "nvidia0", "nvidiactl", "nvidia-uvm", "nvidia2", "nvidia-caps", "nvidia1x"}) {
    std::ofstream(dir.path() / name) << "";
  }
  GpuAttachment gpus(dir.path().string());
  EXPECT_EQ(gpus.Held(), (std::vector<std::string>{"nvidia0", "nvidia2", "nvidia10"}));
}

TEST(GpuAttachmentTest, ANodeWithoutGpusHoldsNothing) {
  TempDir dir;
  GpuAttachment gpus(dir.path().string());
  EXPECT_TRUE(gpus.Held().empty());
  GpuAttachment missing((dir.path() / "absent").string());
  EXPECT_TRUE(missing.Held().empty());
}

}  // namespace
}  // namespace ltrain::agent
