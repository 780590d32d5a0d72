// Where a client may send its bearer token.
#include "common/transport_security.h"

#include <gtest/gtest.h>

namespace ltrain {
namespace {

TEST(TransportSecurityTest, ATokenGoesInClearTextOnlyToLoopbackUnlessInsecure) {
  SecurityMaterial token_only;
  token_only.token = "t";
  for (const char* loopback : {"localhost:7070", "127.0.0.1:7070", "127.3.4.5:1", "[::1]:7070", "unix:/run/x.sock",
                               "ipv4:127.0.0.1:7070", "dns:///localhost:7070"}) {
    EXPECT_TRUE(CheckTokenTransport(loopback, token_only).ok()) << loopback;
  }
  for (const char* remote : {"10.0.0.5:7070", "head:7070", "[2001:db8::1]:7070", "localhost.evil.example:7070",
                             "127.0.0.1.example:7070"}) {
    Status refused = CheckTokenTransport(remote, token_only);
    EXPECT_EQ(refused.code(), StatusCode::kFailedPrecondition) << remote;
    EXPECT_NE(refused.message().find("--tls-ca"), std::string::npos) << refused.message();
    EXPECT_NE(refused.message().find("--insecure"), std::string::npos) << refused.message();
  }
  SecurityMaterial with_ca = token_only;
  with_ca.ca_pem = "-----BEGIN CERTIFICATE-----";
  EXPECT_TRUE(CheckTokenTransport("10.0.0.5:7070", with_ca).ok());
  SecurityMaterial insecure = token_only;
  insecure.insecure = true;
  EXPECT_TRUE(CheckTokenTransport("10.0.0.5:7070", insecure).ok());
  EXPECT_TRUE(CheckTokenTransport("10.0.0.5:7070", SecurityMaterial{}).ok()) << "no token, nothing to leak";
}

// Several coordinators: one channel over all of them, and the token in clear text only when every
// one of them is on loopback.
TEST(TransportSecurityTest, AListOfCoordinatorsIsOneChannelOverEveryAddress) {
  grpc::ChannelArguments args;
  StatusOr<std::string> listed = ListTarget("127.0.0.1:7070,localhost:7071", &args);
  ASSERT_TRUE(listed.ok()) << listed.status().message();
  // localhost may resolve to ::1 alone on some hosts; then every address is written as IPv6.
  EXPECT_TRUE(*listed == "ipv4:127.0.0.1:7070,127.0.0.1:7071" ||
              *listed == "ipv6:[::ffff:127.0.0.1]:7070,[::1]:7071") << *listed;
  EXPECT_EQ(*ListTarget("head:7070", &args), "head:7070") << "one address is left to gRPC's resolver";
  EXPECT_EQ(ListTarget("127.0.0.1:7070,no-such-host.invalid:7070", &args).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(ListTarget("127.0.0.1:7070,7071", &args).status().code(), StatusCode::kInvalidArgument);

  SecurityMaterial token_only;
  token_only.token = "t";
  EXPECT_TRUE(CheckTokenTransport("ipv4:127.0.0.1:7070,127.0.0.2:7071", token_only).ok());
  EXPECT_TRUE(CheckTokenTransport("localhost:7070,127.0.0.1:7071", token_only).ok());
  EXPECT_EQ(CheckTokenTransport("ipv4:127.0.0.1:7070,10.0.0.5:7071", token_only).code(),
            StatusCode::kFailedPrecondition);
  EXPECT_EQ(CheckTokenTransport("127.0.0.1:7070,head:7071", token_only).code(), StatusCode::kFailedPrecondition);
}

TEST(TransportSecurityTest, NewTokensAreLongAndDiffer) {
  const std::string a = NewToken(), b = NewToken();
  EXPECT_EQ(a.size(), 40u);
  EXPECT_NE(a, b);
  EXPECT_EQ(a.find_first_not_of("0123456789abcdef"), std::string::npos);
}

}  // namespace
}  // namespace ltrain
