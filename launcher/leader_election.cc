#include "launcher/leader_election.h"

#include <chrono>

#include "common/logging.h"

namespace ltrain::launcher {
namespace {

constexpr char kLog[] = "election";

int64_t NowMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

}  // namespace

LeaderElection::LeaderElection(std::shared_ptr<EtcdClient> client, LeaderElectionOptions options)
    : client_(std::move(client)), options_(std::move(options)) {}

LeaderElection::~LeaderElection() {
  Resign();
  {
    std::lock_guard<std::mutex> lock(mu_);
    cancelled_ = true;
    cv_.notify_all();
  }
  if (renew_.joinable()) renew_.join();
}

StatusOr<int64_t> LeaderElection::Grant() {
  LTRAIN_ASSIGN_OR_RETURN(int64_t lease, client_->LeaseGrant(options_.ttl_s));
  std::lock_guard<std::mutex> lock(mu_);
  lease_ = lease;
  lease_expired_ = false;
  return lease;
}

StatusOr<int64_t> LeaderElection::Campaign(const std::function<void(const std::string& leader)>& on_standby) {
  LTRAIN_RETURN_IF_ERROR(Grant().status());
  if (!renew_.joinable()) renew_ = std::thread([this] { RenewLoop(); });
  std::string seen_leader;
  while (true) {
    bool expired = false;
    int64_t lease = 0;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (cancelled_) return Unavailable("stopped while standing by");
      expired = lease_expired_;
      lease = lease_;
    }
    // A standby whose lease lapsed (etcd was away longer than the TTL) takes a new one.
    if (expired) {
      LTRAIN_ASSIGN_OR_RETURN(lease, Grant());
    }
    etcdserverpb::TxnRequest txn;
    etcdserverpb::Compare* absent = txn.add_compare();
    absent->set_result(etcdserverpb::Compare::EQUAL);
    absent->set_target(etcdserverpb::Compare::CREATE);
    absent->set_key(options_.key);
    absent->set_create_revision(0);
    etcdserverpb::PutRequest* put = txn.add_success()->mutable_request_put();
    put->set_key(options_.key);
    put->set_value(options_.value);
    put->set_lease(lease);
    txn.add_failure()->mutable_request_range()->set_key(options_.key);
    StatusOr<etcdserverpb::TxnResponse> response = client_->Txn(txn);
    if (response.ok() && response->succeeded()) {
      std::lock_guard<std::mutex> lock(mu_);
      leading_ = true;
      // The put is the transaction's only write: the key's creation revision is the transaction's.
      return response->header().revision();
    }
    if (!response.ok()) {
      // etcd away or without quorum: keep standing by, and say so once.
      if (seen_leader != "?") LTRAIN_LOG(kWarning, kLog) << "cannot reach etcd to campaign: " << response.status().message();
      seen_leader = "?";
    } else {
      const auto& range = response->responses(0).response_range();
      const std::string leader = range.kvs_size() > 0 ? range.kvs(0).value() : "";
      if (!leader.empty() && leader != seen_leader) on_standby(leader);
      seen_leader = leader;
    }
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait_for(lock, std::chrono::milliseconds(options_.poll_ms), [this] { return cancelled_; });
  }
}

void LeaderElection::OnLost(std::function<void(const std::string& why)> on_lost) {
  std::lock_guard<std::mutex> lock(mu_);
  on_lost_ = std::move(on_lost);
}

void LeaderElection::Cancel() {
  std::lock_guard<std::mutex> lock(mu_);
  cancelled_ = true;
  cv_.notify_all();
}

void LeaderElection::Resign() {
  int64_t lease = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!leading_) return;
    leading_ = false;
    lease = lease_;
  }
  client_->set_call_timeout_ms(2000);
  if (Status revoked = client_->LeaseRevoke(lease); !revoked.ok()) {
    LTRAIN_LOG(kWarning, kLog) << "could not give the lead up at once (a standby takes it when the lease expires in "
                               << options_.ttl_s << " s): " << revoked.message();
  }
}

void LeaderElection::RenewLoop() {
  const int64_t every_ms = std::max<int64_t>(100, options_.ttl_s * 1000 / 6);
  int64_t renewed_ms = NowMs();
  std::unique_lock<std::mutex> lock(mu_);
  while (!cancelled_) {
    cv_.wait_for(lock, std::chrono::milliseconds(every_ms), [this] { return cancelled_; });
    if (cancelled_ || lost_) break;
    const int64_t lease = lease_;
    lock.unlock();
    StatusOr<int64_t> ttl = client_->LeaseKeepAlive(lease);
    lock.lock();
    if (lease != lease_) {  // a new lease was granted meanwhile
      renewed_ms = NowMs();
      continue;
    }
    std::string why;
    if (ttl.ok() && *ttl > 0) {
      renewed_ms = NowMs();
    } else if (ttl.ok()) {
      why = "its etcd lease expired";
    } else if (NowMs() - renewed_ms > options_.ttl_s * 1000) {
      why = "its etcd lease could not be renewed for " + std::to_string(options_.ttl_s) + " s (" +
            ttl.status().message() + ")";
    }
    if (why.empty()) continue;
    lease_expired_ = true;
    if (!leading_) continue;  // a standby takes a new lease at its next look
    lost_ = true;
    leading_ = false;
    std::function<void(const std::string&)> on_lost = on_lost_;
    lock.unlock();
    LTRAIN_LOG(kError, kLog) << "lost the lead: " << why;
    if (on_lost) on_lost(why);
    lock.lock();
    break;
  }
}

}  // namespace ltrain::launcher
