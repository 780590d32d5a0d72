// Text that crosses a trust boundary: what reaches a terminal, what a protobuf string may carry.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "common/logging.h"
#include "common/strings.h"

namespace ltrain {
namespace {

TEST(TextTest, SplitKeepsEveryPartAndSplitNonEmptyOnlyTheNonEmptyOnes) {
  using Parts = std::vector<std::string>;
  EXPECT_EQ(Split("a:1,b:2", ','), (Parts{"a:1", "b:2"}));
  EXPECT_EQ(Split("a,,b,", ','), (Parts{"a", "", "b", ""}));
  EXPECT_EQ(Split(",a", ','), (Parts{"", "a"}));
  EXPECT_EQ(Split("", ','), (Parts{""}));
  EXPECT_EQ(Split("one", ','), (Parts{"one"}));
  EXPECT_EQ(SplitNonEmpty("a,,b,", ','), (Parts{"a", "b"}));
  EXPECT_EQ(SplitNonEmpty("host-1\nhost-2\n", '\n'), (Parts{"host-1", "host-2"}));
  EXPECT_TRUE(SplitNonEmpty("", ',').empty());
  EXPECT_TRUE(SplitNonEmpty(",,", ',').empty());
}

TEST(TextTest, TerminalSafeEscapesControlsC1AndInvalidBytesAndKeepsUtf8) {
  EXPECT_EQ(TerminalSafe("plain\ttext caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x9a\x80"), "plain\ttext caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x9a\x80");
  EXPECT_EQ(TerminalSafe("\x1b[31mred\r\nx\x7f"), "\\x1b[31mred\\x0d\\x0ax\\x7f");
  EXPECT_EQ(TerminalSafe("a\nb", /*keep_newlines=*/true), "a\nb");
  EXPECT_EQ(TerminalSafe("csi \xc2\x9b" "2J"), "csi \\xc2\\x9b2J") << "C1 controls are escaped";
  EXPECT_EQ(TerminalSafe("\xff\xc3"), "\\xff\\xc3") << "invalid and truncated sequences";
  EXPECT_EQ(TerminalSafe("\xc0\xaf"), "\\xc0\\xaf") << "an overlong form";
}

TEST(TextTest, ValidUtf8ReplacesEachBadByteAndKeepsTheRest) {
  EXPECT_EQ(ValidUtf8("ok caf\xc3\xa9"), "ok caf\xc3\xa9");
  EXPECT_EQ(ValidUtf8("a\xff" "b\xe2\x82"), "a\xef\xbf\xbd" "b\xef\xbf\xbd\xef\xbf\xbd");
  EXPECT_EQ(ValidUtf8(std::string("nul\0in", 6)), std::string("nul\0in", 6));
}

TEST(TextTest, Utf8PrefixNeverCutsASequence) {
  const std::string text = "ab\xe2\x82\xac" "cd";  // a, b, the euro sign (3 bytes), c, d
  EXPECT_EQ(Utf8Prefix(text, 100), text.size());
  EXPECT_EQ(Utf8Prefix(text, 2), 2u);
  EXPECT_EQ(Utf8Prefix(text, 3), 2u);
  EXPECT_EQ(Utf8Prefix(text, 4), 2u);
  EXPECT_EQ(Utf8Prefix(text, 5), 5u);
}

TEST(TextTest, BoundedLineIsValidAndCutWithWhereTheRestIs) {
  EXPECT_EQ(BoundedLine("short \xff", 100), "short \xef\xbf\xbd");
  EXPECT_EQ(BoundedLine("abcdef", 4), "abcd [... 2 more bytes]");
  EXPECT_EQ(BoundedLine("ab\xe2\x82\xac" "cd", 4, "/logs/rank-0.log"), "ab [... 5 more bytes in /logs/rank-0.log]");
}

}  // namespace
}  // namespace ltrain
