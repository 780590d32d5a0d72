// Files and folders, where the standard library will not do.
#pragma once

#include <filesystem>
#include <string>

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
// writes a temporary name unique to this process next to it, fsyncs it, renames it over `path`
// and fsyncs the directory.
Status WriteFileAtomically(const std::string& path, const std::string& text);

}  // namespace ltrain
