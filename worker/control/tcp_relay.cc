#include "worker/control/tcp_relay.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <list>
#include <string>
#include <vector>

namespace ltrain::worker {

namespace {

constexpr size_t kBufferBytes = 256 * 1024;  // per direction of a connection
constexpr auto kRetryEvery = std::chrono::milliseconds(10);

using Clock = std::chrono::steady_clock;

void SetNonBlocking(int fd) { fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK); }

void NoDelay(int fd) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

// A connected socket to host:port, or -1 (refused, or any other error: tried again later).
int ConnectTo(const std::string& host, int port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICHOST | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  if (getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found) != 0) return -1;
  int connected = -1;
  for (addrinfo* a = found; a != nullptr && connected < 0; a = a->ai_next) {
    const int fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    // An address of this host: the kernel answers at once, accepted or refused.
    if (connect(fd, a->ai_addr, a->ai_addrlen) == 0) {
      connected = fd;
    } else {
      close(fd);
    }
  }
  freeaddrinfo(found);
  return connected;
}

// One accepted connection and, once the target accepts, its twin.
struct Link {
  int client = -1;
  int server = -1;
  Clock::time_point next_try;
  std::string to_server;  // read from the client, not yet written
  std::string to_client;
  bool client_done = false;  // the client sent its last byte (EOF)
  bool server_done = false;
  bool broken = false;
};

// Reads what `from` has into `buffer` (up to its limit); false at EOF.
bool ReadInto(int from, std::string& buffer, bool& broken) {
  char chunk[65536];
  while (buffer.size() < kBufferBytes) {
    const ssize_t n = read(from, chunk, std::min(sizeof(chunk), kBufferBytes - buffer.size()));
    if (n > 0) {
      buffer.append(chunk, static_cast<size_t>(n));
      continue;
    }
    if (n == 0) return false;
    if (errno == EINTR) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK) broken = true;
    break;
  }
  return true;
}

void WriteFrom(int to, std::string& buffer, bool& broken) {
  while (!buffer.empty()) {
    const ssize_t n = send(to, buffer.data(), buffer.size(), MSG_NOSIGNAL);
    if (n > 0) {
      buffer.erase(0, static_cast<size_t>(n));
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK) broken = true;
    break;
  }
}

}  // namespace

StatusOr<std::unique_ptr<TcpRelay>> TcpRelay::Listen(const std::string& host) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICHOST | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  if (int rc = getaddrinfo(host.c_str(), "0", &hints, &found); rc != 0) {
    return Unavailable("relay address " + host + ": " + gai_strerror(rc));
  }
  std::string last_error = "no address";
  for (addrinfo* a = found; a != nullptr; a = a->ai_next) {
    const int fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    sockaddr_storage bound{};
    socklen_t length = sizeof(bound);
    if (bind(fd, a->ai_addr, a->ai_addrlen) != 0 || listen(fd, SOMAXCONN) != 0 ||
        getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &length) != 0) {
      last_error = std::strerror(errno);
      close(fd);
      continue;
    }
    freeaddrinfo(found);
    SetNonBlocking(fd);
    int wake[2];
    if (pipe2(wake, O_CLOEXEC | O_NONBLOCK) != 0) {
      close(fd);
      return Unavailable(std::string("relay pipe: ") + std::strerror(errno));
    }
    const int port = bound.ss_family == AF_INET6 ? ntohs(reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port)
                                                 : ntohs(reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
    return std::unique_ptr<TcpRelay>(new TcpRelay(fd, port, wake[0], wake[1]));
  }
  freeaddrinfo(found);
  return Unavailable("cannot listen on " + host + ": " + last_error);
}

TcpRelay::~TcpRelay() {
  if (thread_.joinable()) {
    const char byte = 0;
    while (write(wake_write_, &byte, 1) < 0 && errno == EINTR) {
    }
    thread_.join();
  }
  close(listen_fd_);
  close(wake_read_);
  close(wake_write_);
}

void TcpRelay::Start(const std::string& target_host, int target_port) {
  thread_ = std::thread([this, target_host, target_port] { Run(target_host, target_port); });
}

void TcpRelay::Run(std::string target_host, int target_port) {
  std::list<Link> links;
  std::vector<pollfd> fds;
  std::vector<Link*> owners;  // fds[i]'s link, or null for the wake pipe and the listener
  while (true) {
    // Connect the links still waiting for the target.
    const Clock::time_point now = Clock::now();
    Clock::time_point next_try = Clock::time_point::max();
    for (Link& link : links) {
      if (link.server >= 0 || link.broken) continue;
      if (link.next_try <= now) {
        link.server = ConnectTo(target_host, target_port);
        if (link.server >= 0) {
          SetNonBlocking(link.server);
          NoDelay(link.server);
          continue;
        }
        link.next_try = now + kRetryEvery;
      }
      next_try = std::min(next_try, link.next_try);
    }
    // Move what can move without waiting; retire finished links.
    for (auto it = links.begin(); it != links.end();) {
      Link& link = *it;
      if (link.server >= 0 && !link.broken) {
        WriteFrom(link.server, link.to_server, link.broken);
        WriteFrom(link.client, link.to_client, link.broken);
        if (link.client_done && link.to_server.empty()) shutdown(link.server, SHUT_WR);
        if (link.server_done && link.to_client.empty()) shutdown(link.client, SHUT_WR);
      }
      const bool finished = link.broken || (link.client_done && link.server_done && link.to_server.empty() &&
                                            link.to_client.empty());
      if (finished || (link.client_done && link.server < 0)) {
        close(link.client);
        if (link.server >= 0) close(link.server);
        it = links.erase(it);
      } else {
        ++it;
      }
    }

    fds.clear();
    owners.clear();
    fds.push_back({wake_read_, POLLIN, 0});
    owners.push_back(nullptr);
    fds.push_back({listen_fd_, POLLIN, 0});
    owners.push_back(nullptr);
    for (Link& link : links) {
      short client_events = 0;
      if (!link.client_done && link.to_server.size() < kBufferBytes) client_events |= POLLIN;
      if (!link.to_client.empty()) client_events |= POLLOUT;
      // A side with nothing to wait for is left out: a closed peer would wake poll at once, forever.
      if (client_events != 0) {
        fds.push_back({link.client, client_events, 0});
        owners.push_back(&link);
      }
      if (link.server >= 0) {
        short server_events = 0;
        if (!link.server_done && link.to_client.size() < kBufferBytes) server_events |= POLLIN;
        if (!link.to_server.empty()) server_events |= POLLOUT;
        if (server_events != 0) {
          fds.push_back({link.server, server_events, 0});
          owners.push_back(&link);
        }
      }
    }
    int timeout_ms = -1;
    if (next_try != Clock::time_point::max()) {
      timeout_ms = static_cast<int>(std::max<int64_t>(
          0, std::chrono::duration_cast<std::chrono::milliseconds>(next_try - Clock::now()).count() + 1));
    }
    if (poll(fds.data(), fds.size(), timeout_ms) < 0 && errno != EINTR) break;  // closes the links below
    if (fds[0].revents != 0) break;  // the destructor's word
    if (fds[1].revents & POLLIN) {
      while (true) {
        const int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
        if (fd < 0) break;
        NoDelay(fd);
        Link& link = links.emplace_back();
        link.client = fd;
        link.next_try = Clock::now();
      }
    }
    for (size_t i = 2; i < fds.size(); ++i) {
      Link& link = *owners[i];
      if (fds[i].revents == 0 || link.broken) continue;
      const bool is_client = fds[i].fd == link.client;
      const bool reading = fds[i].events & POLLIN;
      if (fds[i].revents & (POLLIN | POLLHUP | POLLERR)) {
        if (reading && is_client) {
          link.client_done = !ReadInto(link.client, link.to_server, link.broken);
        } else if (reading) {
          link.server_done = !ReadInto(link.server, link.to_client, link.broken);
        } else if (fds[i].revents & (POLLHUP | POLLERR)) {
          link.broken = true;  // its peer is gone while bytes still wait for it
        }
      }
    }
  }
  for (Link& link : links) {
    close(link.client);
    if (link.server >= 0) close(link.server);
  }
}

}  // namespace ltrain::worker
