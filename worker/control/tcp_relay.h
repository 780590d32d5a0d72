// A TCP relay for rank 0's store: ltrain-exec gives the other ranks a MASTER_PORT that accepts from the
// moment the rendezvous names it, and relays each connection, byte for byte, to the port rank 0's
// program listens on once it does. Without it a rank whose import of torch finishes before rank 0's
// is refused, and c10d's TCPStore client waits out a one-second retry (up to two seconds lost on each
// start and restart; torchrun avoids it by hosting the store in its agent). The relay knows nothing of
// the store's protocol, so any server a program puts on MASTER_PORT works through it.
#pragma once

#include <atomic>
#include <memory>
#include <string>
#include <thread>

#include "common/status.h"

namespace ltrain::worker {

class TcpRelay {
 public:
  // Listens on `host` (an address literal; "0.0.0.0" or "::" for every interface), on a free port.
  static StatusOr<std::unique_ptr<TcpRelay>> Listen(const std::string& host);
  ~TcpRelay();  // stops relaying and closes every connection
  TcpRelay(const TcpRelay&) = delete;
  TcpRelay& operator=(const TcpRelay&) = delete;

  int port() const { return port_; }

  // Relays, on a thread of its own, every connection accepted to `target_host`:`target_port` on this
  // host. A connection the target refuses (not listening yet) is tried again every 10 ms while the
  // accepted side waits, its bytes kept.
  void Start(const std::string& target_host, int target_port);

 private:
  TcpRelay(int listen_fd, int port, int wake_read, int wake_write)
      : listen_fd_(listen_fd), port_(port), wake_read_(wake_read), wake_write_(wake_write) {}
  void Run(std::string target_host, int target_port);

  int listen_fd_;
  int port_;
  int wake_read_;
  int wake_write_;
  std::thread thread_;
};

}  // namespace ltrain::worker
