// The c10d TCPStore protocol as rank 0's ltrain-exec serves it (worker/control/tcp_store.h), byte for
// byte in both dialects: PyTorch 1.13's (commands from 0, no handshake) and 2.2+'s (VALIDATE with its
// magic, then commands from 1), as their clients send them.
#include "worker/control/tcp_store.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>

namespace ltrain::worker {
namespace {

template <typename T>
std::string Fixed(T value) {
  return std::string(reinterpret_cast<const char*>(&value), sizeof(T));
}
std::string Str(std::string_view s) { return Fixed<uint64_t>(s.size()) + std::string(s); }
std::string Op(uint8_t code) { return std::string(1, static_cast<char>(code)); }
std::string Validate() { return Op(0) + Fixed<uint32_t>(TcpStoreProtocol::kValidateMagic); }

// 1.13's numbers.
enum Legacy : uint8_t { kSet = 0, kCompareSet = 1, kGet = 2, kAdd = 3, kCheck = 4, kWait = 5, kNumKeys = 6, kWatch = 7, kDelete = 8 };
// 2.2+'s numbers.
enum V2 : uint8_t { kSet2 = 1, kGet2 = 3, kAdd2 = 4, kWait2 = 6, kAppend2 = 9, kMultiGet2 = 10, kMultiSet2 = 11, kCancel2 = 12, kPing2 = 13 };

class TcpStoreTest : public ::testing::Test {
 protected:
  // Feeds `bytes` from connection `c`; what the store sends to `c` (others' output stays in `held_`).
  std::string Send(int c, const std::string& bytes) {
    EXPECT_TRUE(store_.Receive(c, bytes));
    for (auto& [id, out] : store_.TakeOutput()) held_[id] += out;
    return std::exchange(held_[c], "");
  }
  TcpStoreProtocol store_;
  std::map<int, std::string> held_;
};

TEST_F(TcpStoreTest, APyTorch113ClientSetsAddsWaitsAndGets) {
  // init/: every client's ADD on connect; the count comes back.
  EXPECT_EQ(Send(1, Op(kAdd) + Str("init/") + Fixed<int64_t>(1)), Fixed<int64_t>(1));
  EXPECT_EQ(Send(2, Op(kAdd) + Str("init/") + Fixed<int64_t>(1)), Fixed<int64_t>(2));
  EXPECT_EQ(Send(3, ""), "") << "the silent callback connection of 1.13 is never written to";
  // get(k) is WAIT [k] then GET k: the WAIT is answered once the key exists.
  EXPECT_EQ(Send(2, Op(kWait) + Fixed<uint64_t>(1) + Str("/rank_0")), "");
  EXPECT_EQ(Send(1, Op(kSet) + Str("/rank_0") + Str("host-a")), "");
  EXPECT_EQ(held_[2], std::string(1, '\0')) << "STOP_WAITING to the waiter";
  held_[2].clear();
  EXPECT_EQ(Send(2, Op(kGet) + Str("/rank_0")), Str("host-a"));
  EXPECT_EQ(Send(1, Op(kCheck) + Fixed<uint64_t>(2) + Str("/rank_0") + Str("/none")), std::string(1, '\1'));
  EXPECT_EQ(Send(1, Op(kNumKeys)), Fixed<int64_t>(2));
  EXPECT_EQ(Send(1, Op(kCompareSet) + Str("/c") + Str("") + Str("first")), Str("first")) << "created";
  EXPECT_EQ(Send(1, Op(kCompareSet) + Str("/c") + Str("wrong") + Str("second")), Str("first")) << "kept";
  EXPECT_EQ(Send(1, Op(kCompareSet) + Str("/c") + Str("first") + Str("second")), Str("second")) << "swapped";
  EXPECT_EQ(Send(1, Op(kDelete) + Str("/c")), Fixed<int64_t>(1));
  EXPECT_EQ(Send(1, Op(kDelete) + Str("/c")), Fixed<int64_t>(0));
  EXPECT_EQ(Send(3, Op(kWatch) + Str("/rank_0")), std::string(1, '\3'));
}

TEST_F(TcpStoreTest, APyTorch2ClientValidatesPingsAndUsesItsOwnNumbers) {
  // 2.11's first bytes, as captured: VALIDATE, PING with a nonce, then ADD init/.
  EXPECT_EQ(Send(1, Validate() + Op(kPing2) + Fixed<uint32_t>(614)), Fixed<uint32_t>(614));
  EXPECT_EQ(Send(1, Op(kAdd2) + Str("init/") + Fixed<int64_t>(1)), Fixed<int64_t>(1));
  // SET and WAIT in one segment, as a 2.x client batches them.
  EXPECT_EQ(Send(1, Op(kSet2) + Str("/k") + Str("v") + Op(kWait2) + Fixed<uint64_t>(1) + Str("/k")), std::string(1, '\0'));
  EXPECT_EQ(Send(1, Op(kGet2) + Str("/k")), Str("v"));
  EXPECT_EQ(Send(1, Op(kAppend2) + Str("/k") + Str("w")), "");
  EXPECT_EQ(Send(1, Op(kMultiSet2) + Fixed<int64_t>(2) + Str("/a") + Str("1") + Str("/b") + Str("2")), "");
  EXPECT_EQ(Send(1, Op(kMultiGet2) + Fixed<uint64_t>(3) + Str("/k") + Str("/b") + Str("/none")), Str("vw") + Str("2") + Str(""));
  // A wait given up on is cancelled: WAIT_CANCELED, and nothing more for it later.
  EXPECT_EQ(Send(1, Op(kWait2) + Fixed<uint64_t>(1) + Str("/later")), "");
  EXPECT_EQ(Send(1, Op(kCancel2)), std::string(1, '\1'));
  EXPECT_EQ(Send(2, Validate() + Op(kSet2) + Str("/later") + Str("x")), "");
  EXPECT_EQ(held_[1], "") << "no STOP_WAITING after a cancel";
}

TEST_F(TcpStoreTest, CommandsMayArriveInPiecesAndTogether) {
  const std::string both = Validate() + Op(kAdd2) + Str("init/") + Fixed<int64_t>(5) + Op(kAdd2) + Str("init/") + Fixed<int64_t>(-2);
  std::string out;
  for (char byte : both) out += Send(1, std::string(1, byte));
  EXPECT_EQ(out, Fixed<int64_t>(5) + Fixed<int64_t>(3));
  // A 1.13 SET (opcode 0) is told from VALIDATE by what follows it.
  EXPECT_EQ(Send(2, Op(kSet) + Str("/x") + Str("y") + Op(kGet) + Str("/x")), Str("y"));
}

TEST_F(TcpStoreTest, AWaitOnSeveralKeysEndsWithTheLastAndAClosedWaiterIsForgotten) {
  EXPECT_EQ(Send(1, Op(kWait) + Fixed<uint64_t>(2) + Str("/a") + Str("/b")), "");
  EXPECT_EQ(Send(2, Op(kWait) + Fixed<uint64_t>(1) + Str("/a")), "");
  store_.Close(2);
  EXPECT_EQ(Send(3, Op(kSet) + Str("/a") + Str("1")), "");
  EXPECT_EQ(held_[1], "");
  EXPECT_EQ(held_.count(2) ? held_[2] : "", "") << "nothing for a closed connection";
  EXPECT_EQ(Send(3, Op(kAdd) + Str("/b") + Fixed<int64_t>(1)), Fixed<int64_t>(1));
  EXPECT_EQ(held_[1], std::string(1, '\0'));
}

TEST_F(TcpStoreTest, WhatBreaksTheProtocolOrABoundClosesTheConnection) {
  EXPECT_FALSE(store_.Receive(1, Validate() + Op(200)));
  EXPECT_FALSE(store_.Receive(2, Op(kSet) + Fixed<uint64_t>(TcpStoreProtocol::kMaxKeyBytes + 1)));
  EXPECT_FALSE(store_.Receive(3, Op(kCheck) + Fixed<uint64_t>(TcpStoreProtocol::kMaxKeysAWait + 1)));
  ASSERT_TRUE(store_.Receive(4, Op(kSet) + Str("/n") + Str("not a number")));
  EXPECT_FALSE(store_.Receive(4, Op(kAdd) + Str("/n") + Fixed<int64_t>(1))) << "ADD on what is no counter";
}

// The server on loopback: its port is its own from Listen on (another socket cannot bind it, with
// SO_REUSEADDR or SO_REUSEPORT), and it answers a client.
TEST(TcpStoreServerTest, HoldsItsPortFromTheStartAndAnswers) {
  StatusOr<std::unique_ptr<TcpStoreServer>> server = TcpStoreServer::Listen("127.0.0.1");
  ASSERT_TRUE(server.ok()) << server.status().ToString();
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  address.sin_port = htons(static_cast<uint16_t>((*server)->port()));
  for (int option : {SO_REUSEADDR, SO_REUSEPORT}) {
    const int squatter = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    const int one = 1;
    setsockopt(squatter, SOL_SOCKET, option, &one, sizeof(one));
    EXPECT_NE(bind(squatter, reinterpret_cast<sockaddr*>(&address), sizeof(address)), 0) << "the port is held";
    close(squatter);
  }
  (*server)->Start();
  const int client = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  ASSERT_EQ(connect(client, reinterpret_cast<sockaddr*>(&address), sizeof(address)), 0);
  const std::string add = Validate() + Op(kAdd2) + Str("init/") + Fixed<int64_t>(7);
  ASSERT_EQ(write(client, add.data(), add.size()), static_cast<ssize_t>(add.size()));
  int64_t count = 0;
  ASSERT_EQ(read(client, &count, sizeof(count)), static_cast<ssize_t>(sizeof(count)));
  EXPECT_EQ(count, 7);
  close(client);
}

}  // namespace
}  // namespace ltrain::worker
