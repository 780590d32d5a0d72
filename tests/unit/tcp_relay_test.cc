#include "worker/control/tcp_relay.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <string>
#include <thread>

namespace ltrain::worker {
namespace {

// A loopback socket bound to a free port, not listening yet: connects to it are refused.
int BoundSocket(int& port) {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t length = sizeof(address);
  if (fd < 0 || bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0 ||
      getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length) != 0) {
    return -1;
  }
  port = ntohs(address.sin_port);
  return fd;
}

int ConnectLoopback(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  address.sin_port = htons(static_cast<uint16_t>(port));
  if (connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0) {
    close(fd);
    return -1;
  }
  timeval five{5, 0};  // a relay that loses bytes fails the test instead of hanging it
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &five, sizeof(five));
  return fd;
}

std::string ReadExactly(int fd, size_t bytes) {
  std::string out;
  char chunk[65536];
  while (out.size() < bytes) {
    const ssize_t n = read(fd, chunk, std::min(sizeof(chunk), bytes - out.size()));
    if (n <= 0) break;
    out.append(chunk, static_cast<size_t>(n));
  }
  return out;
}

bool WriteAll(int fd, const std::string& data) {
  size_t done = 0;
  while (done < data.size()) {
    const ssize_t n = write(fd, data.data() + done, data.size() - done);
    if (n <= 0) return false;
    done += static_cast<size_t>(n);
  }
  return true;
}

int AcceptWithin5s(int listener) {
  pollfd p{listener, POLLIN, 0};
  if (poll(&p, 1, 5000) != 1) return -1;
  const int fd = accept4(listener, nullptr, nullptr, SOCK_CLOEXEC);
  timeval five{5, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &five, sizeof(five));
  return fd;
}

// A rank connects before rank 0's program listens: the relay accepts it at once, keeps what it
// sends, and delivers it both ways once the target listens.
TEST(TcpRelayTest, AConnectionMadeBeforeTheTargetListensGoesThroughOnceItDoes) {
  int target_port = 0;
  const int target = BoundSocket(target_port);
  ASSERT_GE(target, 0);
  StatusOr<std::unique_ptr<TcpRelay>> relay = TcpRelay::Listen("127.0.0.1");
  ASSERT_TRUE(relay.ok()) << relay.status().message();
  (*relay)->Start("127.0.0.1", target_port);

  const int client = ConnectLoopback((*relay)->port());
  ASSERT_GE(client, 0) << "the relay accepts before the target listens";
  ASSERT_TRUE(WriteAll(client, "hello"));
  ASSERT_EQ(listen(target, 8), 0);
  const int server = AcceptWithin5s(target);
  ASSERT_GE(server, 0);
  EXPECT_EQ(ReadExactly(server, 5), "hello");
  ASSERT_TRUE(WriteAll(server, "world!"));
  EXPECT_EQ(ReadExactly(client, 6), "world!");

  close(client);  // the target sees the end
  char byte;
  EXPECT_EQ(read(server, &byte, 1), 0);
  close(server);
  close(target);
}

// More than the relay buffers, both ways at once, on two connections.
TEST(TcpRelayTest, LargeTransfersArriveWholeAndInOrder) {
  int target_port = 0;
  const int target = BoundSocket(target_port);
  ASSERT_GE(target, 0);
  ASSERT_EQ(listen(target, 8), 0);
  StatusOr<std::unique_ptr<TcpRelay>> relay = TcpRelay::Listen("127.0.0.1");
  ASSERT_TRUE(relay.ok()) << relay.status().message();
  (*relay)->Start("127.0.0.1", target_port);

  std::string up(3 << 20, '\0');
  for (size_t i = 0; i < up.size(); ++i) up[i] = static_cast<char>(i * 7 + i / 4096);
  const std::string down(up.rbegin(), up.rend());
  for (int round = 0; round < 2; ++round) {
    const int client = ConnectLoopback((*relay)->port());
    ASSERT_GE(client, 0);
    const int server = AcceptWithin5s(target);
    ASSERT_GE(server, 0);
    std::string server_got;
    std::thread server_side([&] {
      std::thread writer([&] { WriteAll(server, down); });
      server_got = ReadExactly(server, up.size());
      writer.join();
    });
    std::thread client_writer([&] { WriteAll(client, up); });
    const std::string client_got = ReadExactly(client, down.size());
    client_writer.join();
    server_side.join();
    EXPECT_TRUE(server_got == up) << "round " << round << ": " << server_got.size() << " bytes";
    EXPECT_TRUE(client_got == down) << "round " << round << ": " << client_got.size() << " bytes";
    close(client);
    close(server);
  }
  relay->reset();  // stops with nothing left open
  close(target);
}

}  // namespace
}  // namespace ltrain::worker
