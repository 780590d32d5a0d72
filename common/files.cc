#include "common/files.h"

#include <ftw.h>

#include <cstdio>

namespace ltrain {
namespace {

int RemoveEntry(const char* path, const struct stat*, int, struct FTW*) { return ::remove(path); }

}  // namespace

void RemoveTree(const std::filesystem::path& path) { ::nftw(path.c_str(), RemoveEntry, 16, FTW_DEPTH | FTW_PHYS); }

}  // namespace ltrain
