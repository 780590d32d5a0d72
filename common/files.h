// Files and folders, where the standard library will not do.
#pragma once

#include <filesystem>

namespace ltrain {

// Removes `path` and everything under it, quietly (a missing path is no error). Code that links
// LibTorch uses this instead of std::filesystem::remove_all: PyTorch's wheels export their own copy
// of it from libtorch.so, which the dynamic linker then binds our calls to, and that copy crashes
// (seen on the GPU host). nftw is plain libc.
void RemoveTree(const std::filesystem::path& path);

}  // namespace ltrain
