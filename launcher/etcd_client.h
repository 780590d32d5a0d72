// A small client of etcd's v3 API (gRPC, proto/etcd/rpc.proto): ranges, transactions and leases
// against a cluster given as a list of members. Each call goes to one member and, when that member
// cannot answer (down, partitioned, no quorum), to the next, until the call's time is up: one
// member's death costs a call a retry, not an error. Over TLS (the members' CA, and a client
// certificate where etcd asks for one) and with etcd's authentication (a user and password, whose
// token rides on every call and is fetched again when etcd no longer takes it) where EtcdSecurity
// says. Thread-safe.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "common/status.h"
#include "etcd/rpc.grpc.pb.h"

namespace ltrain::launcher {

// etcd://HOST:PORT[,HOST:PORT...][/PREFIX]: the members' client addresses and the key prefix under
// which one ltrain deployment keeps its state (default "ltrain").
struct EtcdUrl {
  std::vector<std::string> endpoints;
  std::string prefix = "ltrain";
};
StatusOr<EtcdUrl> ParseEtcdUrl(const std::string& url);
bool IsEtcdUrl(const std::string& url);

// The end of the range of every key that starts with `prefix`.
std::string PrefixEnd(const std::string& prefix);

// How the coordinator reaches etcd: in clear text without a CA; with one, over TLS (and with a
// client certificate and key for etcd's --client-cert-auth); with a user, authenticated.
struct EtcdSecurity {
  std::string ca_pem, cert_pem, key_pem;
  std::string user, password;
};

// The files of --etcd-ca, --etcd-cert, --etcd-key and --etcd-password-file, read; errors name the file.
StatusOr<EtcdSecurity> LoadEtcdSecurity(const std::string& ca, const std::string& cert, const std::string& key,
                                        const std::string& user, const std::string& password_file);

class EtcdClient {
 public:
  // Checks that a member answers a read of `probe_key` within `timeout_ms` (and, with a user, that
  // etcd takes the password and lets it read there); says which endpoints were tried when none does,
  // and at once what etcd refused (a password, a permission, a certificate it does not take).
  static StatusOr<std::unique_ptr<EtcdClient>> Connect(const std::vector<std::string>& endpoints,
                                                       int64_t timeout_ms = 10000, const EtcdSecurity& security = {},
                                                       const std::string& probe_key = "ltrain-probe");

  // Every key in [key, range_end) (the key alone when range_end is empty), by key; `limit` 0: all.
  StatusOr<etcdserverpb::RangeResponse> Range(const std::string& key, const std::string& range_end = "",
                                              int64_t limit = 0);
  // How many keys [key, range_end) holds, without their values.
  StatusOr<int64_t> Count(const std::string& key, const std::string& range_end);
  StatusOr<etcdserverpb::TxnResponse> Txn(const etcdserverpb::TxnRequest& request);
  // A lease of `ttl_s` seconds; its id.
  StatusOr<int64_t> LeaseGrant(int64_t ttl_s);
  // Renews the lease once; returns its TTL left in seconds, 0 when it has expired.
  StatusOr<int64_t> LeaseKeepAlive(int64_t lease_id);
  Status LeaseRevoke(int64_t lease_id);

  const std::vector<std::string>& endpoints() const { return endpoints_; }
  // How long one call keeps trying the members (default 5 s).
  void set_call_timeout_ms(int64_t ms) { call_timeout_ms_ = ms; }

 private:
  struct Member {
    std::string endpoint;
    std::shared_ptr<grpc::Channel> channel;
    std::unique_ptr<etcdserverpb::KV::Stub> kv;
    std::unique_ptr<etcdserverpb::Lease::Stub> lease;
    std::unique_ptr<etcdserverpb::Auth::Stub> auth;
  };
  EtcdClient(std::vector<std::string> endpoints, EtcdSecurity security);

  // The context of one call: its deadline and, with a user, the token.
  void Prepare(grpc::ClientContext& context, std::chrono::system_clock::time_point deadline);
  // A token for the user from `member`; OK without a user.
  grpc::Status Authenticate(Member& member, std::chrono::system_clock::time_point deadline);

  // Runs `call(member, deadline)` on the current member, moving on to the next one while the
  // answer is UNAVAILABLE or DEADLINE_EXCEEDED and time is left. `what` names the call in errors.
  template <typename Call>
  Status WithFailover(const char* what, Call call);
  // A unary call with failover: `rpc(member, context, response)` calls one of the member's stubs.
  template <typename Response, typename Rpc>
  StatusOr<Response> Unary(const char* what, Rpc rpc);

  std::vector<std::string> endpoints_;
  EtcdSecurity security_;
  std::mutex token_mu_;
  std::string token_;  // etcd's for the user; empty until authenticated
  std::vector<Member> members_;
  std::atomic<size_t> current_{0};
  std::atomic<int64_t> call_timeout_ms_{5000};
};

}  // namespace ltrain::launcher
