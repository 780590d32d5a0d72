#include "launcher/log_view.h"

#include <algorithm>
#include <charconv>
#include <map>

#include "launcher/hang_diagnosis.h"

namespace ltrain::launcher {

std::vector<FoldedLine> FoldLogLines(const std::vector<RankLine>& lines, int64_t window_ms) {
  std::vector<FoldedLine> out;
  std::map<std::string, size_t> open;  // text -> index in out of the newest group with that text
  for (const auto& line : lines) {
    auto found = open.find(line.text);
    if (found != open.end()) {
      FoldedLine& group = out[found->second];
      bool fresh = line.unix_ms - group.unix_ms <= window_ms;
      bool new_rank = std::find(group.ranks.begin(), group.ranks.end(), line.rank) == group.ranks.end();
      if (fresh && new_rank) {
        group.ranks.push_back(line.rank);
        continue;
      }
    }
    out.push_back(FoldedLine{line.unix_ms, {line.rank}, line.text});
    open[line.text] = out.size() - 1;
  }
  return out;
}

std::string RankPrefix(const std::vector<int>& ranks) { return "[" + DescribeRanks(ranks) + "]"; }

std::optional<int64_t> ParseSince(const std::string& text, int64_t now_unix_ms) {
  if (text.empty()) return std::nullopt;
  int64_t value = 0;
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (ec != std::errc() || value < 0) return std::nullopt;
  std::string unit(end, text.data() + text.size());
  if (unit.empty()) return value;  // absolute Unix ms
  int64_t scale = unit == "s" ? 1000 : unit == "m" ? 60000 : unit == "h" ? 3600000 : unit == "d" ? 86400000 : 0;
  if (scale == 0) return std::nullopt;
  return now_unix_ms - value * scale;
}

}  // namespace ltrain::launcher
