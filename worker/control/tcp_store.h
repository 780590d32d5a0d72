// A store for a user's program under `ltrain run` that speaks PyTorch's c10d TCPStore protocol, as
// torchrun's agent hosts one (TORCHELASTIC_USE_AGENT_STORE=True: every rank, rank 0 too, is a client
// of MASTER_ADDR:MASTER_PORT). Rank 0's ltrain-exec binds and listens on the port before it names it to
// anyone, and holds it until its program ends: no other process can take MASTER_PORT in between (a
// port picked, released and handed to the program could be bound by anyone first), and a rank whose
// interpreter is up before rank 0's connects at once.
//
// TcpStoreProtocol is the store itself, without sockets: bytes a connection sent in, bytes to send it
// out. It speaks both dialects on each connection, told apart by its first bytes: PyTorch 2.2 and later
// open with VALIDATE (opcode 0, then the magic 0x3C85F7CE) and number their commands from 1; earlier
// ones (1.13, the version Debian 12 ships) send commands at once, numbered from 0. Keys are opaque
// bytes; a WAIT is answered once all its keys exist (a GET always follows one); ADD counts from 0; a
// PyTorch 1.13 client's second, silent "callback" connection is held open and never written to.
// Bounded: a key over kMaxKeyBytes, a value over kMaxValueBytes, more than kMaxKeysAWait keys in one
// command, or a store over kMaxStoreBytes closes the connection that asked, as PyTorch's own server does
// with what it refuses.
//
// TcpStoreServer serves one on a port, on a thread of its own (epoll; no thread per connection).
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <vector>

#include "common/status.h"

namespace ltrain::worker {

class TcpStoreProtocol {
 public:
  static constexpr size_t kMaxKeyBytes = 8 << 10;
  static constexpr size_t kMaxValueBytes = 64 << 20;
  static constexpr uint64_t kMaxKeysAWait = 1 << 17;
  static constexpr size_t kMaxStoreBytes = size_t{1} << 30;
  static constexpr uint32_t kValidateMagic = 0x3C85F7CE;

  // A connection's bytes, appended to what it sent before; false when it broke the protocol or a
  // bound (the caller closes it). What to send back, to it or to connections whose WAIT this
  // completed, collects in Output.
  bool Receive(int connection, std::string_view bytes);
  // The connection is gone: its waits end with it.
  void Close(int connection);
  // Bytes to send, by connection, since the last call.
  std::map<int, std::string> TakeOutput();

  size_t keys() const { return data_.size(); }

 private:
  enum class Dialect { kUnknown, kLegacy, kValidated };
  struct Connection {
    Dialect dialect = Dialect::kUnknown;
    std::string in;                  // received, not yet parsed
    std::set<std::string> awaited;   // the missing keys of its WAIT
  };
  enum class Step { kDone, kNeedMore, kBroken };

  Step ParseOne(int id, Connection& c);
  bool Exists(const std::string& key) const;
  void Stored(const std::string& key);  // a key exists now: the WAITs on it get nearer
  bool Fits(size_t adding) const { return bytes_ + adding <= kMaxStoreBytes; }
  void Put(const std::string& key, std::string value);

  std::unordered_map<int, Connection> connections_;
  std::unordered_map<std::string, std::string> data_;
  std::unordered_map<std::string, std::deque<std::string>> queues_;
  std::unordered_map<std::string, std::set<int>> waiters_;  // key -> connections waiting for it
  std::map<int, std::string> out_;
  size_t bytes_ = 0;  // of keys and values held
};

class TcpStoreServer {
 public:
  // Listens on `host` (an address literal; "0.0.0.0" or "::" for every interface) on a free port,
  // now: the port is this process's from here on.
  static StatusOr<std::unique_ptr<TcpStoreServer>> Listen(const std::string& host);
  ~TcpStoreServer();  // stops serving and closes every connection
  TcpStoreServer(const TcpStoreServer&) = delete;
  TcpStoreServer& operator=(const TcpStoreServer&) = delete;

  int port() const { return port_; }
  // Serves on a thread of its own until destroyed.
  void Start();

 private:
  TcpStoreServer(int listen_fd, int port, int wake_fd) : listen_fd_(listen_fd), port_(port), wake_fd_(wake_fd) {}
  void Run();

  int listen_fd_;
  int port_;
  int wake_fd_;  // an eventfd that ends Run
  std::thread thread_;
};

}  // namespace ltrain::worker
