// How `ltrain logs` shows many ranks' lines: identical lines from several ranks close in time fold
// into one "[ranks 0-7] text" line. Pure.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace ltrain::launcher {

struct RankLine {
  int64_t unix_ms = 0;
  int rank = 0;
  std::string text;
};

struct FoldedLine {
  int64_t unix_ms = 0;      // of the first occurrence
  std::vector<int> ranks;   // in the order they appeared
  std::string text;
};

// Lines keep the order of their first occurrence; a later identical line from another rank joins
// it while within `window_ms` of it.
std::vector<FoldedLine> FoldLogLines(const std::vector<RankLine>& lines, int64_t window_ms);

// "[rank 3]", "[ranks 0-7]", "[ranks 0-1, 4]"
std::string RankPrefix(const std::vector<int>& ranks);

// "90s", "10m", "2h", "1d" before `now_unix_ms`, or an absolute Unix time in ms; nullopt if unparsable.
std::optional<int64_t> ParseSince(const std::string& text, int64_t now_unix_ms);

}  // namespace ltrain::launcher
