#include "common/files.h"

#include <fcntl.h>
#include <ftw.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <utility>

namespace ltrain {
namespace {

int RemoveEntry(const char* path, const struct stat*, int, struct FTW*) { return ::remove(path); }

std::string ErrnoText(int err) { return std::strerror(err); }

// The umask before UsePrivateFileModes; -1 until it is called.
mode_t original_umask = static_cast<mode_t>(-1);

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

Status WriteFileAtomically(const std::string& path, const std::string& text, mode_t mode) {
  const std::filesystem::path target(path);
  const std::string tmp =
      (target.parent_path() / ("." + target.filename().string() + ".tmp." + std::to_string(::getpid()))).string();
  ::unlink(tmp.c_str());  // a leftover of an earlier process with this pid (or a link planted there)
  StatusOr<int> opened = OpenForWriting(tmp, O_EXCL, mode);
  if (!opened.ok()) return opened.status();
  const int fd = *opened;
  if (Status written = WriteAll(fd, text, tmp); !written.ok()) {
    ::close(fd);
    ::unlink(tmp.c_str());
    return written;
  }
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  if (rc != 0) {
    ::unlink(tmp.c_str());
    return Internal("fsync " + tmp + ": " + ErrnoText(err));
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const int rename_err = errno;
    ::unlink(tmp.c_str());
    return Internal("renaming " + tmp + " to " + path + ": " + ErrnoText(rename_err));
  }
  const std::string parent = target.parent_path().empty() ? "." : target.parent_path().string();
  return FsyncPath(parent, true);
}

StatusOr<int> OpenForWriting(const std::string& path, int flags, mode_t mode) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC | O_NOFOLLOW | flags, mode);
  if (fd >= 0) return fd;
  const int err = errno;
  struct stat st {};
  if (err == ELOOP || (::lstat(path.c_str(), &st) == 0 && S_ISLNK(st.st_mode))) {
    return FailedPrecondition(path + " is a symbolic link: ltrain never writes through one (remove it, or give "
                              "another path)");
  }
  return Internal("cannot write " + path + ": " + ErrnoText(err));
}

StatusOr<std::FILE*> OpenStreamForWriting(const std::string& path, bool append, mode_t mode) {
  LTRAIN_ASSIGN_OR_RETURN(int fd, OpenForWriting(path, append ? O_APPEND : O_TRUNC, mode));
  std::FILE* file = ::fdopen(fd, append ? "a" : "w");
  if (file == nullptr) {
    const int err = errno;
    ::close(fd);
    return Internal("cannot write " + path + ": " + ErrnoText(err));
  }
  return file;
}

Status WriteAll(int fd, std::string_view data, const std::string& path) {
  size_t done = 0;
  while (done < data.size()) {
    const ssize_t n = ::write(fd, data.data() + done, data.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return Internal("writing " + path + ": " + ErrnoText(errno));
    done += static_cast<size_t>(n);
  }
  return Status::Ok();
}

Status WriteFileText(const std::string& path, std::string_view text, mode_t mode) {
  LTRAIN_ASSIGN_OR_RETURN(int fd, OpenForWriting(path, O_TRUNC, mode));
  Status written = WriteAll(fd, text, path);
  if (::close(fd) != 0 && written.ok()) written = Internal("writing " + path + ": " + ErrnoText(errno));
  return written;
}

std::string WithFreeSpace(const std::string& message, const std::string& path) {
  const char* name = message.find(std::strerror(ENOSPC)) != std::string::npos   ? "ENOSPC"
                     : message.find(std::strerror(EDQUOT)) != std::string::npos ? "EDQUOT"
                                                                                 : nullptr;
  if (name == nullptr) return message;
  // The nearest folder that is there: the file itself may be gone.
  std::filesystem::path where(path);
  struct statvfs fs {};
  while (::statvfs(where.c_str(), &fs) != 0 && where.has_parent_path() && where != where.parent_path()) {
    where = where.parent_path();
  }
  char figures[160];
  std::snprintf(figures, sizeof(figures), " (%s: %.1f MB free of %.1f MB on the filesystem of %s)", name,
                static_cast<double>(fs.f_bavail) * fs.f_frsize / 1e6, static_cast<double>(fs.f_blocks) * fs.f_frsize / 1e6,
                where.c_str());
  return message + figures;
}

Status CreateDirectories(const std::string& path, mode_t mode) {
  if (path.empty()) return Status::Ok();
  std::filesystem::path built;
  for (const std::filesystem::path& part : std::filesystem::path(path)) {
    built /= part;
    if (part.empty() || part == "/") continue;
    if (::mkdir(built.c_str(), mode) == 0 || errno == EEXIST) continue;
    return Internal("cannot create the directory " + built.string() + ": " + ErrnoText(errno));
  }
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
    return Internal("cannot create the directory " + path + ": a file of another kind is there");
  }
  return Status::Ok();
}

mode_t UsePrivateFileModes() {
  const mode_t before = ::umask(077);
  if (original_umask == static_cast<mode_t>(-1)) original_umask = before;
  return original_umask;
}

mode_t OriginalUmask() {
  if (original_umask != static_cast<mode_t>(-1)) return original_umask;
  const mode_t now = ::umask(077);
  ::umask(now);
  return now;
}

AppendFile::AppendFile(AppendFile&& other) noexcept
    : fd_(std::exchange(other.fd_, -1)), path_(std::move(other.path_)), buffer_(std::move(other.buffer_)) {}

AppendFile& AppendFile::operator=(AppendFile&& other) noexcept {
  if (this != &other) {
    Close();
    fd_ = std::exchange(other.fd_, -1);
    path_ = std::move(other.path_);
    buffer_ = std::move(other.buffer_);
  }
  return *this;
}

Status AppendFile::Open(const std::string& path, mode_t mode) {
  Close();
  LTRAIN_ASSIGN_OR_RETURN(fd_, OpenForWriting(path, O_APPEND, mode));
  path_ = path;
  return Status::Ok();
}

void AppendFile::Flush() {
  if (fd_ >= 0 && !buffer_.empty()) (void)WriteAll(fd_, buffer_, path_);
  buffer_.clear();
}

void AppendFile::Close() {
  Flush();
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

}  // namespace ltrain
