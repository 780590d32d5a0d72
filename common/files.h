// Files and folders, where the standard library will not do.
#pragma once

#include <sys/types.h>

#include <cstdio>
#include <filesystem>
#include <string>
#include <string_view>

#include "common/status.h"

namespace ltrain {

// Removes `path` and everything under it, quietly (a missing path is no error). Code that links
// LibTorch uses this instead of std::filesystem::remove_all: PyTorch's wheels export their own copy
// of it from libtorch.so, which the dynamic linker then binds our calls to, and that copy crashes
// (seen on the GPU host). nftw is plain libc.
void RemoveTree(const std::filesystem::path& path);

// fsync of a file, or of a directory (which makes the names created or renamed in it durable).
Status FsyncPath(const std::string& path, bool directory);

// The whole content of the file at `path`; NotFound naming the path and the reason when it cannot be
// opened, Internal when reading it fails.
StatusOr<std::string> ReadFileText(const std::string& path);

// Replaces `path` by `text` so that a reader sees the old or the new content, never a torn one:
// writes a temporary name unique to this process next to it (created anew, never through a link),
// fsyncs it, renames it over `path` (a symbolic link there is replaced, not followed) and fsyncs
// the directory. `mode` is the file's, less the umask.
Status WriteFileAtomically(const std::string& path, const std::string& text, mode_t mode = 0644);

// Opens `path` for writing: O_WRONLY | O_CREAT | O_CLOEXEC | O_NOFOLLOW, plus `flags` (O_TRUNC,
// O_APPEND, O_EXCL), created with `mode` less the umask. A symbolic link at `path` is refused with
// an error that names it, never written through. The descriptor is the caller's to close.
StatusOr<int> OpenForWriting(const std::string& path, int flags, mode_t mode = 0600);
// The same as a stdio stream ("w" with truncation, or "a" with `append`).
StatusOr<std::FILE*> OpenStreamForWriting(const std::string& path, bool append, mode_t mode = 0600);
// Writes all of `data` to `fd` (retrying short writes and EINTR); errors name `path` and errno's text.
Status WriteAll(int fd, std::string_view data, const std::string& path);
// `text` as the whole content of `path`, through OpenForWriting (O_TRUNC).
Status WriteFileText(const std::string& path, std::string_view text, mode_t mode = 0600);

// `message` as it is, or, when it tells of a full filesystem (ENOSPC, EDQUOT), with what is free on
// the filesystem that holds `path`: "... (ENOSPC: 0.3 MB free of 20.0 MB on the filesystem of PATH)".
std::string WithFreeSpace(const std::string& message, const std::string& path);

// Creates `path` and its missing parents, each with `mode` less the umask (0700: private to this
// user). Existing directories keep their mode. Errors name the path.
Status CreateDirectories(const std::string& path, mode_t mode = 0700);

// Sets this process's umask to 077, so that everything it creates is its user's alone whatever the
// umask it was started with, and returns the one it had. Called first thing by the processes that
// keep state (the coordinator, agents, launches, workers); what they start for a user's program gets
// the returned umask back (ltrain-exec restores LTRAIN_USER_UMASK).
mode_t UsePrivateFileModes();
// The umask the process had before UsePrivateFileModes (its current one when that was not called).
mode_t OriginalUmask();

// A log file appended through a descriptor opened with OpenForWriting (a symbolic link refused),
// buffered until Flush. Moves, closes on destruction; one thread.
class AppendFile {
 public:
  AppendFile() = default;
  ~AppendFile() { Close(); }
  AppendFile(AppendFile&& other) noexcept;
  AppendFile& operator=(AppendFile&& other) noexcept;
  AppendFile(const AppendFile&) = delete;
  AppendFile& operator=(const AppendFile&) = delete;

  Status Open(const std::string& path, mode_t mode = 0600);
  bool is_open() const { return fd_ >= 0; }
  void Append(std::string_view text) { buffer_.append(text); }
  void Flush();  // a write that fails is dropped: a log must never stop its writer
  void Close();

 private:
  int fd_ = -1;
  std::string path_;
  std::string buffer_;
};

}  // namespace ltrain
