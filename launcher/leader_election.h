// Several coordinators on one etcd state take turns: the one that creates the leader key (P/leader,
// holding its address) on its own lease leads; the others stand by, polling the key, and the first
// to create it once the leader's lease expires (its process died, its host died, it lost etcd)
// leads next. The lease is renewed every TTL/6; a leader that cannot renew it for a whole TTL has
// lost it and must step down (OnLost), and EtcdStateStore's fence refuses its writes meanwhile.
#pragma once

#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "common/status.h"
#include "launcher/etcd_client.h"

namespace ltrain::launcher {

struct LeaderElectionOptions {
  std::string key;          // P/leader
  std::string value;        // this coordinator's address, what standbys and users are told
  int64_t ttl_s = 3;        // how long a dead leader holds the lead
  int64_t poll_ms = 250;    // how often a standby looks at the key
};

class LeaderElection {
 public:
  LeaderElection(std::shared_ptr<EtcdClient> client, LeaderElectionOptions options);
  ~LeaderElection();  // resigns when leading
  LeaderElection(const LeaderElection&) = delete;
  LeaderElection& operator=(const LeaderElection&) = delete;

  // Blocks until this process leads, and returns the leader key's creation revision (the fence of
  // EtcdStateStore::SetFence); Unavailable after Cancel(). `on_standby` is called with the leader's
  // address each time another coordinator is seen leading.
  StatusOr<int64_t> Campaign(const std::function<void(const std::string& leader)>& on_standby);
  // Called once, from the renewal thread, if the lead is lost after Campaign returned.
  void OnLost(std::function<void(const std::string& why)> on_lost);
  // Ends a Campaign under way (from another thread or a signal watcher).
  void Cancel();
  // Gives the lead up at once (revokes the lease), so that a standby need not wait for its expiry.
  void Resign();

 private:
  void RenewLoop();
  // Takes a new lease (an etcd round trip, made without holding mu_), makes it the one renewed and
  // returns it.
  StatusOr<int64_t> Grant();

  std::shared_ptr<EtcdClient> client_;
  const LeaderElectionOptions options_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool cancelled_ = false;
  bool leading_ = false;
  bool lost_ = false;
  int64_t lease_ = 0;
  bool lease_expired_ = false;
  std::function<void(const std::string&)> on_lost_;
  std::thread renew_;
};

}  // namespace ltrain::launcher
