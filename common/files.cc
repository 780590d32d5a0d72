#include "common/files.h"

#include <fcntl.h>
#include <ftw.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>

namespace ltrain {
namespace {

int RemoveEntry(const char* path, const struct stat*, int, struct FTW*) { return ::remove(path); }

}  // namespace

void RemoveTree(const std::filesystem::path& path) { ::nftw(path.c_str(), RemoveEntry, 16, FTW_DEPTH | FTW_PHYS); }

Status FsyncPath(const std::string& path, bool directory) {
  const int fd = ::open(path.c_str(), (directory ? O_RDONLY | O_DIRECTORY : O_RDONLY) | O_CLOEXEC);
  if (fd < 0) return Internal("opening " + path + " to fsync: " + std::strerror(errno));
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  if (rc != 0) return Internal("fsync " + path + ": " + std::strerror(err));
  return Status::Ok();
}

StatusOr<std::string> ReadFileText(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return NotFound("cannot read " + path + ": " + std::strerror(errno));
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) return Internal("reading " + path + " failed");
  return text;
}

Status WriteFileAtomically(const std::string& path, const std::string& text) {
  const std::filesystem::path target(path);
  const std::string tmp =
      (target.parent_path() / ("." + target.filename().string() + ".tmp." + std::to_string(::getpid()))).string();
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return Internal("creating " + tmp + ": " + std::strerror(errno));
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int err = errno;
      ::close(fd);
      ::unlink(tmp.c_str());
      return Internal("writing " + tmp + ": " + std::strerror(err));
    }
    done += static_cast<size_t>(n);
  }
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  if (rc != 0) {
    ::unlink(tmp.c_str());
    return Internal("fsync " + tmp + ": " + std::strerror(err));
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const int rename_err = errno;
    ::unlink(tmp.c_str());
    return Internal("renaming " + tmp + " to " + path + ": " + std::strerror(rename_err));
  }
  const std::string parent = target.parent_path().empty() ? "." : target.parent_path().string();
  return FsyncPath(parent, true);
}

}  // namespace ltrain
