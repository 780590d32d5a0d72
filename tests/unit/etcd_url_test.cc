// etcd://HOST:PORT[,HOST:PORT...][/PREFIX] and key ranges.
#include <gtest/gtest.h>

#include "launcher/etcd_client.h"

namespace ltrain::launcher {
namespace {

TEST(EtcdUrlTest, MembersAndPrefix) {
  StatusOr<EtcdUrl> url = ParseEtcdUrl("etcd://10.0.0.1:2379,etcd2:2379,[::1]:2379/prod/ltrain/");
  ASSERT_TRUE(url.ok()) << url.status().message();
  EXPECT_EQ(url->endpoints, (std::vector<std::string>{"10.0.0.1:2379", "etcd2:2379", "[::1]:2379"}));
  EXPECT_EQ(url->prefix, "prod/ltrain");
  EXPECT_EQ(ParseEtcdUrl("etcd://e:2379")->prefix, "ltrain");
  for (const char* bad : {"http://e:2379", "etcd://", "etcd://e", "etcd://e:x", "etcd://e:2379,", "etcd://:2379",
                          "etcd://e:2379/"}) {
    StatusOr<EtcdUrl> refused = ParseEtcdUrl(bad);
    EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument) << bad;
    if (!refused.ok()) {
      EXPECT_NE(refused.status().message().find("etcd://HOST:PORT"), std::string::npos);
    }
  }
}

TEST(EtcdUrlTest, APrefixRangeEndsPastEveryKeyThatStartsWithIt) {
  EXPECT_EQ(PrefixEnd("ltrain/jobs/"), "ltrain/jobs0");
  EXPECT_EQ(PrefixEnd("a\xff"), "b");
  EXPECT_EQ(PrefixEnd(""), std::string(1, '\0'));
}

}  // namespace
}  // namespace ltrain::launcher
