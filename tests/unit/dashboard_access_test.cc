#include "launcher/dashboard_access.h"

#include <gtest/gtest.h>

namespace ltrain::launcher {
namespace {

using Scope = DashboardAccess::Scope;

TEST(DashboardAccessTest, TokensGrantTheirScopeAndNothingElseDoes) {
  FakeClock clock;
  DashboardAccess access(clock, "control-token-0123456789", "metrics-token-0123456789");
  EXPECT_EQ(access.Grant("Bearer control-token-0123456789", ""), Scope::kRead);
  EXPECT_EQ(access.Grant("Bearer metrics-token-0123456789", ""), Scope::kMetrics);
  EXPECT_EQ(access.Grant("Bearer control-token-012345678", ""), Scope::kNone);
  EXPECT_EQ(access.Grant("control-token-0123456789", ""), Scope::kNone);
  EXPECT_EQ(access.Grant("", ""), Scope::kNone);
  EXPECT_EQ(access.Grant("Bearer ", ""), Scope::kNone);
  DashboardAccess no_metrics(clock, "control-token-0123456789", "");
  EXPECT_EQ(no_metrics.Grant("Bearer ", ""), Scope::kNone) << "an empty token is never accepted";
}

TEST(DashboardAccessTest, ALoginCodeOpensOneSessionOnceWithinItsTime) {
  FakeClock clock;
  DashboardAccess access(clock, "control-token-0123456789", "");
  const std::string code = access.NewLoginCode();
  EXPECT_EQ(access.Redeem("not-" + code), std::nullopt);
  std::optional<std::string> session = access.Redeem(code);
  ASSERT_TRUE(session.has_value());
  EXPECT_EQ(access.Redeem(code), std::nullopt) << "spent";
  const std::string cookie = "theme=dark; " + std::string(DashboardAccess::kSessionCookie) + "=" + *session + "; x=1";
  EXPECT_EQ(access.Grant("", cookie), Scope::kRead);
  EXPECT_EQ(access.Grant("", std::string(DashboardAccess::kSessionCookie) + "=" + *session + "0"), Scope::kNone);
  clock.AdvanceMs(DashboardAccess::kSessionTtlMs);
  EXPECT_EQ(access.Grant("", cookie), Scope::kNone) << "the session ended";

  const std::string late = access.NewLoginCode();
  clock.AdvanceMs(DashboardAccess::kLoginCodeTtlMs);
  EXPECT_EQ(access.Redeem(late), std::nullopt) << "the code expired";
}

TEST(DashboardAccessTest, OnlyTheNewestCodesAndSessionsAreHeld) {
  FakeClock clock;
  DashboardAccess access(clock, "control-token-0123456789", "");
  const std::string first = access.NewLoginCode();
  for (size_t i = 0; i < DashboardAccess::kMaxLoginCodes; ++i) access.NewLoginCode();
  EXPECT_EQ(access.Redeem(first), std::nullopt);
  EXPECT_TRUE(access.Redeem(access.NewLoginCode()).has_value());
}

TEST(DashboardAccessTest, CookieValueFindsTheNamedCookie) {
  EXPECT_EQ(CookieValue("a=1; ltrain_session=abc; b=2", "ltrain_session"), "abc");
  EXPECT_EQ(CookieValue("ltrain_session=abc", "ltrain_session"), "abc");
  EXPECT_EQ(CookieValue("xltrain_session=abc", "ltrain_session"), "");
  EXPECT_EQ(CookieValue("", "ltrain_session"), "");
  EXPECT_EQ(CookieValue("ltrain_session", "ltrain_session"), "");
}

TEST(DashboardAccessTest, TheHostHeaderMustNameThisCoordinator) {
  const std::vector<std::string> names = {"dash.example.org"};
  for (const char* host : {"127.0.0.1:8080", "10.1.2.3", "[::1]:8080", "localhost:9", "LOCALHOST", "node7:80",
                           "node7.cluster.example:80", "Dash.Example.org"}) {
    EXPECT_TRUE(HostAllowed(host, "node7.cluster.example", names)) << host;
  }
  for (const char* host : {"", "evil.example:8080", "node7.evil.example", "127.0.0.1.evil.example", "[nonsense]",
                           "localhost.evil.example"}) {
    EXPECT_FALSE(HostAllowed(host, "node7.cluster.example", names)) << host;
  }
}

}  // namespace
}  // namespace ltrain::launcher
