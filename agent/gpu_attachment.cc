#include "agent/gpu_attachment.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <system_error>
#include <utility>

namespace ltrain::agent {

namespace fs = std::filesystem;

namespace {

bool IsGpuDevice(const std::string& name) {
  constexpr std::string_view kPrefix = "nvidia";
  return name.size() > kPrefix.size() && name.compare(0, kPrefix.size(), kPrefix) == 0 &&
         std::all_of(name.begin() + kPrefix.size(), name.end(), [](char c) { return c >= '0' && c <= '9'; });
}

}  // namespace

GpuAttachment::GpuAttachment(std::string device_dir) {
  opener_ = std::thread([this, dir = std::move(device_dir)] {
    std::vector<std::string> names;
    std::error_code ec;
    for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
      const std::string name = it->path().filename().string();
      if (IsGpuDevice(name)) names.push_back(name);
    }
    // nvidia2 before nvidia10.
    std::sort(names.begin(), names.end(), [](const std::string& a, const std::string& b) {
      return a.size() != b.size() ? a.size() < b.size() : a < b;
    });
    for (const std::string& name : names) {
      // Opening is what initializes the GPU (the slow part); a device this user may not open is
      // simply not held.
      const int fd = open((fs::path(dir) / name).c_str(), O_RDWR | O_CLOEXEC);
      if (fd < 0) continue;
      fds_.push_back(fd);
      held_.push_back(name);
    }
  });
}

GpuAttachment::~GpuAttachment() {
  if (opener_.joinable()) opener_.join();
  for (int fd : fds_) close(fd);
}

const std::vector<std::string>& GpuAttachment::Held() {
  if (opener_.joinable()) opener_.join();
  return held_;
}

}  // namespace ltrain::agent
