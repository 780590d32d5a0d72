#include "worker/control/tcp_store.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <cstring>

namespace ltrain::worker {
namespace {

// What a command does, whatever number its dialect gives it.
enum class Op {
  kValidate, kSet, kCompareSet, kGet, kAdd, kCheck, kWait, kNumKeys, kWatchKey, kDeleteKey, kAppend, kMultiGet,
  kMultiSet, kCancelWait, kPing, kQueuePush, kQueuePop, kQueueLen, kListKeys, kUnknown
};

// PyTorch 1.13 (and, by the same numbers, 2.0 and 2.1, where MULTI_GET, MULTI_SET and CANCEL_WAIT
// follow; 2.1's own 7 and 8 are not told apart from 1.13's, which its Python never sends).
Op LegacyOp(uint8_t code) {
  static const Op kOps[] = {Op::kSet,      Op::kCompareSet, Op::kGet,      Op::kAdd,     Op::kCheck,     Op::kWait,
                            Op::kNumKeys,  Op::kWatchKey,   Op::kDeleteKey, Op::kMultiGet, Op::kMultiSet, Op::kCancelWait};
  return code < std::size(kOps) ? kOps[code] : Op::kUnknown;
}

// PyTorch 2.2 and later (through 2.11).
Op ValidatedOp(uint8_t code) {
  static const Op kOps[] = {Op::kValidate,  Op::kSet,      Op::kCompareSet, Op::kGet,       Op::kAdd,
                            Op::kCheck,     Op::kWait,     Op::kNumKeys,    Op::kDeleteKey, Op::kAppend,
                            Op::kMultiGet,  Op::kMultiSet, Op::kCancelWait, Op::kPing,      Op::kQueuePush,
                            Op::kQueuePop,  Op::kQueueLen, Op::kListKeys};
  return code < std::size(kOps) ? kOps[code] : Op::kUnknown;
}

enum class Got { kOk, kShort, kBad };

// Reads values in the store's encoding (host byte order, sizes as uint64 before their bytes) from
// `in` at `at`, which it advances.
class Cursor {
 public:
  Cursor(std::string_view in, size_t at) : in_(in), at_(at) {}
  size_t at() const { return at_; }

  template <typename T>
  Got Fixed(T& value) {
    if (in_.size() - at_ < sizeof(T)) return Got::kShort;
    std::memcpy(&value, in_.data() + at_, sizeof(T));
    at_ += sizeof(T);
    return Got::kOk;
  }
  Got Bytes(std::string& out, size_t max) {
    uint64_t length = 0;
    if (Got got = Fixed(length); got != Got::kOk) return got;
    if (length > max) return Got::kBad;
    if (in_.size() - at_ < length) return Got::kShort;
    out.assign(in_.data() + at_, length);
    at_ += length;
    return Got::kOk;
  }
  Got Keys(std::vector<std::string>& keys) {
    uint64_t count = 0;
    if (Got got = Fixed(count); got != Got::kOk) return got;
    if (count > TcpStoreProtocol::kMaxKeysAWait) return Got::kBad;
    keys.resize(count);
    for (std::string& key : keys) {
      if (Got got = Bytes(key, TcpStoreProtocol::kMaxKeyBytes); got != Got::kOk) return got;
    }
    return Got::kOk;
  }

 private:
  std::string_view in_;
  size_t at_;
};

template <typename T>
void AppendFixed(std::string& out, T value) {
  out.append(reinterpret_cast<const char*>(&value), sizeof(T));
}

void AppendBytes(std::string& out, std::string_view bytes) {
  AppendFixed<uint64_t>(out, bytes.size());
  out.append(bytes);
}

constexpr char kStopWaiting = 0;
constexpr char kWaitCanceled = 1;
constexpr char kReady = 0, kNotReady = 1;
constexpr char kCallbackRegistered = 3;

}  // namespace

bool TcpStoreProtocol::Exists(const std::string& key) const {
  if (data_.count(key)) return true;
  auto queue = queues_.find(key);
  return queue != queues_.end() && !queue->second.empty();
}

void TcpStoreProtocol::Stored(const std::string& key) {
  auto found = waiters_.find(key);
  if (found == waiters_.end()) return;
  for (int id : found->second) {
    auto c = connections_.find(id);
    if (c == connections_.end()) continue;
    c->second.awaited.erase(key);
    if (c->second.awaited.empty()) out_[id].push_back(kStopWaiting);
  }
  waiters_.erase(found);
}

void TcpStoreProtocol::Put(const std::string& key, std::string value) {
  auto [it, inserted] = data_.try_emplace(key);
  bytes_ += value.size() + (inserted ? key.size() : 0);
  bytes_ -= it->second.size();
  it->second = std::move(value);
}

void TcpStoreProtocol::Close(int connection) {
  auto c = connections_.find(connection);
  if (c == connections_.end()) return;
  for (const std::string& key : c->second.awaited) {
    auto waiting = waiters_.find(key);
    if (waiting == waiters_.end()) continue;
    waiting->second.erase(connection);
    if (waiting->second.empty()) waiters_.erase(waiting);
  }
  connections_.erase(c);
  out_.erase(connection);
}

std::map<int, std::string> TcpStoreProtocol::TakeOutput() { return std::exchange(out_, {}); }

bool TcpStoreProtocol::Receive(int id, std::string_view bytes) {
  Connection& c = connections_[id];
  c.in.append(bytes);
  while (!c.in.empty()) {
    if (c.dialect == Dialect::kUnknown) {
      // 2.2+: VALIDATE (0) and the magic first. 1.13's first byte is a command; a 0 is its SET, whose
      // next 4 bytes (the low half of a key's length) are never the magic.
      if (c.in[0] != 0) {
        c.dialect = Dialect::kLegacy;
      } else {
        if (c.in.size() < 5) return true;
        uint32_t magic = 0;
        std::memcpy(&magic, c.in.data() + 1, 4);
        c.dialect = magic == kValidateMagic ? Dialect::kValidated : Dialect::kLegacy;
        if (c.dialect == Dialect::kValidated) {
          c.in.erase(0, 5);
          continue;
        }
      }
    }
    const Step step = ParseOne(id, c);
    if (step == Step::kBroken) return false;
    if (step == Step::kNeedMore) return true;
  }
  return true;
}

TcpStoreProtocol::Step TcpStoreProtocol::ParseOne(int id, Connection& c) {
  Cursor in(c.in, 1);
  const uint8_t code = static_cast<uint8_t>(c.in[0]);
  const Op op = c.dialect == Dialect::kValidated ? ValidatedOp(code) : LegacyOp(code);
  std::string key, value, other;
  std::vector<std::string> keys;
  std::string& out = out_[id];
  Got got = Got::kOk;
  auto more = [&](Got g) { return g == Got::kShort ? Step::kNeedMore : Step::kBroken; };
  switch (op) {
    case Op::kValidate: {
      uint32_t magic = 0;
      if ((got = in.Fixed(magic)) != Got::kOk) return more(got);
      break;
    }
    case Op::kSet:
    case Op::kAppend:
    case Op::kQueuePush: {
      if ((got = in.Bytes(key, kMaxKeyBytes)) != Got::kOk || (got = in.Bytes(value, kMaxValueBytes)) != Got::kOk) {
        return more(got);
      }
      if (!Fits(key.size() + value.size())) return Step::kBroken;
      if (op == Op::kSet) {
        Put(key, std::move(value));
      } else if (op == Op::kAppend) {
        auto found = data_.find(key);
        Put(key, (found == data_.end() ? std::string() : found->second) + value);
      } else {
        bytes_ += key.size() + value.size();
        queues_[key].push_back(std::move(value));
      }
      Stored(key);
      break;
    }
    case Op::kCompareSet: {
      if ((got = in.Bytes(key, kMaxKeyBytes)) != Got::kOk || (got = in.Bytes(other, kMaxValueBytes)) != Got::kOk ||
          (got = in.Bytes(value, kMaxValueBytes)) != Got::kOk) {
        return more(got);
      }
      auto found = data_.find(key);
      if (found == data_.end()) {
        if (!other.empty()) {
          AppendBytes(out, other);  // nothing to compare with: nothing set
          break;
        }
        if (!Fits(key.size() + value.size())) return Step::kBroken;
        AppendBytes(out, value);
        Put(key, std::move(value));
        Stored(key);
      } else if (found->second == other) {
        if (!Fits(value.size())) return Step::kBroken;
        AppendBytes(out, value);
        Put(key, std::move(value));
      } else {
        AppendBytes(out, found->second);
      }
      break;
    }
    case Op::kGet: {
      if ((got = in.Bytes(key, kMaxKeyBytes)) != Got::kOk) return more(got);
      auto found = data_.find(key);
      AppendBytes(out, found == data_.end() ? std::string_view() : std::string_view(found->second));
      break;
    }
    case Op::kAdd: {
      int64_t delta = 0;
      if ((got = in.Bytes(key, kMaxKeyBytes)) != Got::kOk || (got = in.Fixed(delta)) != Got::kOk) return more(got);
      int64_t now = 0;
      if (auto found = data_.find(key); found != data_.end()) {
        const std::string& text = found->second;
        auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), now);
        if (error != std::errc() || end != text.data() + text.size()) return Step::kBroken;  // not a counter
      }
      now += delta;
      if (!Fits(key.size() + 24)) return Step::kBroken;
      Put(key, std::to_string(now));
      AppendFixed<int64_t>(out, now);
      Stored(key);
      break;
    }
    case Op::kCheck:
    case Op::kWait:
    case Op::kMultiGet: {
      if ((got = in.Keys(keys)) != Got::kOk) return more(got);
      if (op == Op::kMultiGet) {
        for (const std::string& k : keys) {
          auto found = data_.find(k);
          AppendBytes(out, found == data_.end() ? std::string_view() : std::string_view(found->second));
        }
        break;
      }
      bool all = true;
      for (const std::string& k : keys) all = all && Exists(k);
      if (op == Op::kCheck) {
        out.push_back(all ? kReady : kNotReady);
        break;
      }
      // A client waits on one WAIT at a time; one it gave up on (a timeout) goes with the next.
      for (const std::string& k : c.awaited) {
        if (auto w = waiters_.find(k); w != waiters_.end()) w->second.erase(id);
      }
      c.awaited.clear();
      for (const std::string& k : keys) {
        if (Exists(k)) continue;
        c.awaited.insert(k);
        waiters_[k].insert(id);
      }
      if (c.awaited.empty()) out.push_back(kStopWaiting);
      break;
    }
    case Op::kNumKeys:
      AppendFixed<int64_t>(out, static_cast<int64_t>(data_.size()));
      break;
    case Op::kWatchKey:
      // 1.13's callback connection; its Python never watches. Registered, never called back.
      if ((got = in.Bytes(key, kMaxKeyBytes)) != Got::kOk) return more(got);
      out.push_back(kCallbackRegistered);
      break;
    case Op::kDeleteKey: {
      if ((got = in.Bytes(key, kMaxKeyBytes)) != Got::kOk) return more(got);
      auto found = data_.find(key);
      const bool had = found != data_.end();
      if (had) {
        bytes_ -= found->first.size() + found->second.size();
        data_.erase(found);
      }
      AppendFixed<int64_t>(out, had ? 1 : 0);
      break;
    }
    case Op::kMultiSet: {
      int64_t count = 0;
      if ((got = in.Fixed(count)) != Got::kOk) return more(got);
      if (count < 0 || static_cast<uint64_t>(count) > kMaxKeysAWait) return Step::kBroken;
      std::vector<std::pair<std::string, std::string>> pairs(static_cast<size_t>(count));
      for (auto& [k, v] : pairs) {
        if ((got = in.Bytes(k, kMaxKeyBytes)) != Got::kOk || (got = in.Bytes(v, kMaxValueBytes)) != Got::kOk) {
          return more(got);
        }
      }
      for (auto& [k, v] : pairs) {
        if (!Fits(k.size() + v.size())) return Step::kBroken;
        Put(k, std::move(v));
        Stored(k);
      }
      break;
    }
    case Op::kCancelWait:
      for (const std::string& k : c.awaited) {
        if (auto w = waiters_.find(k); w != waiters_.end()) w->second.erase(id);
      }
      c.awaited.clear();
      out.push_back(kWaitCanceled);
      break;
    case Op::kPing: {
      uint32_t nonce = 0;
      if ((got = in.Fixed(nonce)) != Got::kOk) return more(got);
      AppendFixed<uint32_t>(out, nonce);
      break;
    }
    case Op::kQueuePop:
    case Op::kQueueLen: {
      if ((got = in.Bytes(key, kMaxKeyBytes)) != Got::kOk) return more(got);
      auto queue = queues_.find(key);
      const int64_t size = queue == queues_.end() ? 0 : static_cast<int64_t>(queue->second.size());
      AppendFixed<int64_t>(out, size);
      if (op == Op::kQueuePop && size > 0) {
        AppendBytes(out, queue->second.front());
        bytes_ -= key.size() + queue->second.front().size();
        queue->second.pop_front();
        if (queue->second.empty()) queues_.erase(queue);
      }
      break;
    }
    case Op::kListKeys:
      AppendFixed<int64_t>(out, static_cast<int64_t>(data_.size()));
      for (const auto& [k, v] : data_) AppendBytes(out, k);
      break;
    case Op::kUnknown:
      return Step::kBroken;
  }
  c.in.erase(0, in.at());
  return Step::kDone;
}

StatusOr<std::unique_ptr<TcpStoreServer>> TcpStoreServer::Listen(const std::string& host) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICHOST | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  if (int rc = getaddrinfo(host.c_str(), "0", &hints, &found); rc != 0) {
    return InvalidArgument("the store's address " + host + ": " + gai_strerror(rc));
  }
  std::unique_ptr<addrinfo, decltype(&freeaddrinfo)> owner(found, freeaddrinfo);
  std::string why = "no address";
  for (addrinfo* a = found; a != nullptr; a = a->ai_next) {
    // No SO_REUSEADDR or SO_REUSEPORT: while this listens, no other socket binds the port.
    const int fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, a->ai_protocol);
    if (fd < 0) continue;
    sockaddr_storage bound{};
    socklen_t length = sizeof(bound);
    if (bind(fd, a->ai_addr, a->ai_addrlen) == 0 && listen(fd, 4096) == 0 &&
        getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &length) == 0) {
      const int port = bound.ss_family == AF_INET6 ? ntohs(reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port)
                                                   : ntohs(reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
      const int wake = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
      if (wake < 0) {
        close(fd);
        return Internal(std::string("eventfd: ") + std::strerror(errno));
      }
      return std::unique_ptr<TcpStoreServer>(new TcpStoreServer(fd, port, wake));
    }
    why = std::strerror(errno);
    close(fd);
  }
  return Unavailable("cannot listen for the store on " + host + ": " + why);
}

void TcpStoreServer::Start() {
  thread_ = std::thread([this] { Run(); });
}

TcpStoreServer::~TcpStoreServer() {
  if (thread_.joinable()) {
    const uint64_t one = 1;
    ssize_t ignored = write(wake_fd_, &one, sizeof(one));
    (void)ignored;
    thread_.join();
  }
  close(listen_fd_);
  close(wake_fd_);
}

void TcpStoreServer::Run() {
  const int epoll = epoll_create1(EPOLL_CLOEXEC);
  if (epoll < 0) return;
  auto watch = [epoll](int fd, uint32_t events, int operation) {
    epoll_event e{};
    e.events = events;
    e.data.fd = fd;
    epoll_ctl(epoll, operation, fd, &e);
  };
  watch(listen_fd_, EPOLLIN, EPOLL_CTL_ADD);
  watch(wake_fd_, EPOLLIN, EPOLL_CTL_ADD);
  TcpStoreProtocol store;
  std::set<int> open;                 // every connection
  std::map<int, std::string> unsent;  // what a connection could not take yet
  auto drop = [&](int fd) {
    store.Close(fd);
    unsent.erase(fd);
    open.erase(fd);
    epoll_ctl(epoll, EPOLL_CTL_DEL, fd, nullptr);
    close(fd);
  };
  // Sends what the connection has; false when it broke. Watches for room while something is left.
  auto flush = [&](int fd) {
    std::string& pending = unsent[fd];
    while (!pending.empty()) {
      const ssize_t n = send(fd, pending.data(), pending.size(), MSG_NOSIGNAL);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
      if (n <= 0) return false;
      pending.erase(0, static_cast<size_t>(n));
    }
    watch(fd, pending.empty() ? EPOLLIN : EPOLLIN | EPOLLOUT, EPOLL_CTL_MOD);
    if (pending.empty()) unsent.erase(fd);
    return true;
  };
  std::vector<epoll_event> events(256);
  std::string chunk(64 << 10, '\0');
  bool running = true;
  while (running) {
    const int n = epoll_wait(epoll, events.data(), static_cast<int>(events.size()), -1);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) break;
    std::set<int> broken;
    for (int i = 0; i < n; ++i) {
      const int fd = events[i].data.fd;
      if (fd == wake_fd_) {
        running = false;
      } else if (fd == listen_fd_) {
        for (int client; (client = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK)) >= 0;) {
          const int one = 1;
          setsockopt(client, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
          watch(client, EPOLLIN, EPOLL_CTL_ADD);
          open.insert(client);
        }
      } else {
        if (events[i].events & EPOLLOUT) {
          if (!flush(fd)) broken.insert(fd);
        }
        if (events[i].events & (EPOLLIN | EPOLLHUP | EPOLLERR)) {
          while (true) {
            const ssize_t got = recv(fd, chunk.data(), chunk.size(), 0);
            if (got < 0 && errno == EINTR) continue;
            if (got < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
            if (got <= 0 || !store.Receive(fd, std::string_view(chunk.data(), static_cast<size_t>(got)))) {
              broken.insert(fd);
              break;
            }
          }
        }
      }
    }
    for (auto& [fd, bytes] : store.TakeOutput()) {
      if (broken.count(fd) || bytes.empty()) continue;
      unsent[fd] += bytes;
      if (!flush(fd)) broken.insert(fd);
    }
    for (int fd : broken) drop(fd);
  }
  for (int fd : open) close(fd);
  close(epoll);
}

}  // namespace ltrain::worker
