#include "launcher/log_view.h"

#include <gtest/gtest.h>

namespace ltrain::launcher {
namespace {

TEST(LogViewTest, IdenticalLinesOfManyRanksFoldIntoOne) {
  std::vector<RankLine> lines;
  for (int rank = 0; rank < 8; ++rank) lines.push_back({1000 + rank, rank, "NCCL INFO ready"});
  lines.push_back({1010, 0, "step 1/10 loss 5.5"});
  std::vector<FoldedLine> folded = FoldLogLines(lines, 2000);
  ASSERT_EQ(folded.size(), 2u);
  EXPECT_EQ(RankPrefix(folded[0].ranks) + " " + folded[0].text, "[ranks 0-7] NCCL INFO ready");
  EXPECT_EQ(RankPrefix(folded[1].ranks), "[rank 0]");
}

TEST(LogViewTest, TheSameLineLaterOrFromTheSameRankStaysSeparate) {
  std::vector<FoldedLine> folded =
      FoldLogLines({{0, 0, "x"}, {10, 1, "x"}, {20, 1, "x"}, {9000, 2, "x"}, {9001, 4, "x"}}, 2000);
  ASSERT_EQ(folded.size(), 3u);
  EXPECT_EQ(RankPrefix(folded[0].ranks), "[ranks 0-1]");
  EXPECT_EQ(RankPrefix(folded[1].ranks), "[rank 1]");
  EXPECT_EQ(RankPrefix(folded[2].ranks), "[ranks 2, 4]");
}

TEST(LogViewTest, ParsesSince) {
  EXPECT_EQ(ParseSince("90s", 100000), 10000);
  EXPECT_EQ(ParseSince("2m", 200000), 80000);
  EXPECT_EQ(ParseSince("1700000000000", 5), 1700000000000);
  EXPECT_FALSE(ParseSince("yesterday", 5).has_value());
  EXPECT_FALSE(ParseSince("5w", 5).has_value());
}

}  // namespace
}  // namespace ltrain::launcher
