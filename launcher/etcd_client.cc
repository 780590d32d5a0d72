#include "launcher/etcd_client.h"

#include <algorithm>
#include <chrono>
#include <thread>
#include <tuple>

#include <grpcpp/grpcpp.h>

#include "common/files.h"
#include "common/strings.h"
#include "common/transport_security.h"

namespace ltrain::launcher {
namespace {

using Deadline = std::chrono::system_clock::time_point;

}  // namespace

bool IsEtcdUrl(const std::string& url) { return url.rfind("etcd://", 0) == 0; }

StatusOr<EtcdUrl> ParseEtcdUrl(const std::string& url) {
  const std::string usage = "; write etcd://HOST:PORT[,HOST:PORT...][/PREFIX], e.g. etcd://10.0.0.1:2379,10.0.0.2:2379";
  if (!IsEtcdUrl(url)) return InvalidArgument("'" + url + "' is not an etcd address" + usage);
  std::string rest = url.substr(7);
  EtcdUrl parsed;
  if (size_t slash = rest.find('/'); slash != std::string::npos) {
    parsed.prefix = rest.substr(slash + 1);
    rest = rest.substr(0, slash);
    while (!parsed.prefix.empty() && parsed.prefix.back() == '/') parsed.prefix.pop_back();
    if (parsed.prefix.empty()) return InvalidArgument("the key prefix of '" + url + "' is empty" + usage);
  }
  for (const std::string& endpoint : Split(rest, ',')) {
    const size_t colon = endpoint.rfind(':');
    const std::string port = colon == std::string::npos ? "" : endpoint.substr(colon + 1);
    if (endpoint.empty() || colon == 0 || port.empty() || port.find_first_not_of("0123456789") != std::string::npos) {
      return InvalidArgument("'" + endpoint + "' in '" + url + "' is not HOST:PORT" + usage);
    }
    parsed.endpoints.push_back(endpoint);
  }
  return parsed;
}

std::string PrefixEnd(const std::string& prefix) {
  std::string end = prefix;
  while (!end.empty()) {
    if (static_cast<unsigned char>(end.back()) < 0xff) {
      end.back() = static_cast<char>(static_cast<unsigned char>(end.back()) + 1);
      return end;
    }
    end.pop_back();
  }
  return std::string(1, '\0');  // every key
}

StatusOr<EtcdSecurity> LoadEtcdSecurity(const std::string& ca, const std::string& cert, const std::string& key,
                                        const std::string& user, const std::string& password_file) {
  EtcdSecurity security;
  for (auto [path, flag, out] : {std::tuple{&ca, "--etcd-ca", &security.ca_pem},
                                 std::tuple{&cert, "--etcd-cert", &security.cert_pem},
                                 std::tuple{&key, "--etcd-key", &security.key_pem},
                                 std::tuple{&password_file, "--etcd-password-file", &security.password}}) {
    if (path->empty()) continue;
    StatusOr<std::string> text = ReadFileText(*path);
    if (!text.ok()) return InvalidArgument(std::string(flag) + ": " + text.status().message());
    *out = std::move(*text);
  }
  while (!security.password.empty() && (security.password.back() == '\n' || security.password.back() == '\r')) {
    security.password.pop_back();
  }
  if (security.cert_pem.empty() != security.key_pem.empty()) {
    return InvalidArgument("--etcd-cert and --etcd-key go together (etcd's --client-cert-auth asks for both)");
  }
  if (!security.cert_pem.empty() && security.ca_pem.empty()) {
    return InvalidArgument("--etcd-cert needs --etcd-ca: a client certificate goes only over TLS");
  }
  if (user.empty() != password_file.empty()) {
    return InvalidArgument("--etcd-user and --etcd-password-file go together");
  }
  security.user = user;
  return security;
}

EtcdClient::EtcdClient(std::vector<std::string> endpoints, EtcdSecurity security)
    : endpoints_(std::move(endpoints)), security_(std::move(security)) {
  std::shared_ptr<grpc::ChannelCredentials> credentials =
      ClientCredentials(security_.ca_pem, security_.cert_pem, security_.key_pem);
  for (const std::string& endpoint : endpoints_) {
    grpc::ChannelArguments args;
    // A member that went away is tried again soon, and a dead host costs a connect of 2 s, not 20.
    args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 200);
    args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 2000);
    args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 2000);
    args.SetMaxReceiveMessageSize(64 << 20);
    Member member;
    member.endpoint = endpoint;
    member.channel = grpc::CreateCustomChannel(endpoint, credentials, args);
    member.kv = etcdserverpb::KV::NewStub(member.channel);
    member.lease = etcdserverpb::Lease::NewStub(member.channel);
    member.auth = etcdserverpb::Auth::NewStub(member.channel);
    members_.push_back(std::move(member));
  }
}

StatusOr<std::unique_ptr<EtcdClient>> EtcdClient::Connect(const std::vector<std::string>& endpoints, int64_t timeout_ms,
                                                          const EtcdSecurity& security, const std::string& probe_key) {
  if (endpoints.empty()) return InvalidArgument("no etcd endpoint given");
  // Fresh channels for each try: a connection made while a member was still starting can hang
  // until gRPC's connect timeout (20 s) even after the member serves.
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  while (true) {
    std::unique_ptr<EtcdClient> client(new EtcdClient(endpoints, security));
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(give_up - std::chrono::steady_clock::now());
    client->set_call_timeout_ms(std::clamp<int64_t>(left.count(), 1, 3000));
    StatusOr<etcdserverpb::RangeResponse> probe = client->Range(probe_key);
    if (probe.ok()) {
      client->set_call_timeout_ms(5000);
      return client;
    }
    // A refusal is said now: trying again would be refused the same way.
    if (probe.status().code() != StatusCode::kUnavailable) return probe.status();
    if (std::chrono::steady_clock::now() >= give_up) return probe.status();
  }
}

void EtcdClient::Prepare(grpc::ClientContext& context, std::chrono::system_clock::time_point deadline) {
  context.set_deadline(deadline);
  if (security_.user.empty()) return;
  std::lock_guard<std::mutex> lock(token_mu_);
  if (!token_.empty()) context.AddMetadata("token", token_);
}

grpc::Status EtcdClient::Authenticate(Member& member, std::chrono::system_clock::time_point deadline) {
  if (security_.user.empty()) return grpc::Status::OK;
  grpc::ClientContext context;
  context.set_deadline(deadline);
  etcdserverpb::AuthenticateRequest request;
  request.set_name(security_.user);
  request.set_password(security_.password);
  etcdserverpb::AuthenticateResponse response;
  grpc::Status status = member.auth->Authenticate(&context, request, &response);
  if (status.ok()) {
    std::lock_guard<std::mutex> lock(token_mu_);
    token_ = response.token();
  }
  return status;
}

template <typename Call>
Status EtcdClient::WithFailover(const char* what, Call call) {
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::milliseconds(call_timeout_ms_.load());
  grpc::Status last;
  std::string last_endpoint;
  for (int attempt = 0;; ++attempt) {
    const size_t index = current_.load() % members_.size();
    Member& member = members_[index];
    // Each try gets at most 2 s: a member without quorum holds a call until its deadline.
    const auto left = give_up - std::chrono::steady_clock::now();
    const auto slice = std::min<std::chrono::steady_clock::duration>(left, std::chrono::seconds(2));
    const Deadline deadline = std::chrono::system_clock::now() +
                              std::chrono::duration_cast<std::chrono::system_clock::duration>(slice);
    // With a user: a token first, and again when etcd no longer takes it (it expired, or the
    // member that made it restarted).
    bool authenticated = false;
    {
      std::lock_guard<std::mutex> lock(token_mu_);
      authenticated = security_.user.empty() || !token_.empty();
    }
    last = authenticated ? call(member, deadline) : Authenticate(member, deadline);
    if (authenticated && last.error_code() == grpc::StatusCode::UNAUTHENTICATED && !security_.user.empty()) {
      last = Authenticate(member, deadline);
      if (last.ok()) last = call(member, deadline);
    } else if (!authenticated && last.ok()) {
      last = call(member, deadline);
    }
    last_endpoint = member.endpoint;
    if (last.ok()) return Status::Ok();
    const bool member_trouble = last.error_code() == grpc::StatusCode::UNAVAILABLE ||
                                last.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED;
    if (!member_trouble) {
      return Internal(std::string("etcd refused ") + what + " at " + member.endpoint + ": " + last.error_message());
    }
    // The next member, unless another call moved on already.
    size_t expected = index;
    current_.compare_exchange_strong(expected, index + 1);
    if (std::chrono::steady_clock::now() >= give_up) break;
    // Once round every member, then a short pause between rounds.
    if ((attempt + 1) % members_.size() == 0) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  std::string tried;
  for (const auto& endpoint : endpoints_) tried += (tried.empty() ? "" : ", ") + endpoint;
  return Unavailable(std::string("no etcd member answered ") + what + " within " +
                     std::to_string(call_timeout_ms_.load() / 1000.0).substr(0, 4) + " s (tried " + tried +
                     "; last, " + last_endpoint + ": " + last.error_message() + "); is etcd running and in quorum?");
}

template <typename Response, typename Rpc>
StatusOr<Response> EtcdClient::Unary(const char* what, Rpc rpc) {
  Response response;
  LTRAIN_RETURN_IF_ERROR(WithFailover(what, [&](Member& member, Deadline deadline) {
    grpc::ClientContext context;
    Prepare(context, deadline);
    response.Clear();
    return rpc(member, &context, &response);
  }));
  return response;
}

StatusOr<etcdserverpb::RangeResponse> EtcdClient::Range(const std::string& key, const std::string& range_end,
                                                        int64_t limit) {
  etcdserverpb::RangeRequest request;
  request.set_key(key);
  request.set_range_end(range_end);
  request.set_limit(limit);
  return Unary<etcdserverpb::RangeResponse>("a read", [&](Member& member, grpc::ClientContext* context, auto* response) {
    return member.kv->Range(context, request, response);
  });
}

StatusOr<int64_t> EtcdClient::Count(const std::string& key, const std::string& range_end) {
  etcdserverpb::RangeRequest request;
  request.set_key(key);
  request.set_range_end(range_end);
  request.set_count_only(true);
  LTRAIN_ASSIGN_OR_RETURN(etcdserverpb::RangeResponse counted,
                          Unary<etcdserverpb::RangeResponse>(
                              "a count", [&](Member& member, grpc::ClientContext* context, auto* response) {
                                return member.kv->Range(context, request, response);
                              }));
  return counted.count();
}

StatusOr<etcdserverpb::TxnResponse> EtcdClient::Txn(const etcdserverpb::TxnRequest& request) {
  return Unary<etcdserverpb::TxnResponse>("a write", [&](Member& member, grpc::ClientContext* context, auto* response) {
    return member.kv->Txn(context, request, response);
  });
}

StatusOr<int64_t> EtcdClient::LeaseGrant(int64_t ttl_s) {
  etcdserverpb::LeaseGrantRequest request;
  request.set_ttl(ttl_s);
  LTRAIN_ASSIGN_OR_RETURN(etcdserverpb::LeaseGrantResponse granted,
                          Unary<etcdserverpb::LeaseGrantResponse>(
                              "a lease grant", [&](Member& member, grpc::ClientContext* context, auto* response) {
                                return member.lease->LeaseGrant(context, request, response);
                              }));
  if (!granted.error().empty()) return Internal("etcd refused a lease: " + granted.error());
  return granted.id();
}

StatusOr<int64_t> EtcdClient::LeaseKeepAlive(int64_t lease_id) {
  // One renewal on a stream of its own: simple, and a renewal every few hundred ms costs nothing
  // worth a long-lived stream's bookkeeping.
  etcdserverpb::LeaseKeepAliveResponse response;
  LTRAIN_RETURN_IF_ERROR(WithFailover("a lease renewal", [&](Member& member, Deadline deadline) {
    grpc::ClientContext context;
    Prepare(context, deadline);
    auto stream = member.lease->LeaseKeepAlive(&context);
    etcdserverpb::LeaseKeepAliveRequest request;
    request.set_id(lease_id);
    response.Clear();
    if (!stream->Write(request) || !stream->WritesDone() || !stream->Read(&response)) {
      grpc::Status status = stream->Finish();
      return status.ok() ? grpc::Status(grpc::StatusCode::UNAVAILABLE, "the renewal stream closed") : status;
    }
    context.TryCancel();
    (void)stream->Finish();
    return grpc::Status::OK;
  }));
  return std::max<int64_t>(0, response.ttl());
}

Status EtcdClient::LeaseRevoke(int64_t lease_id) {
  etcdserverpb::LeaseRevokeRequest request;
  request.set_id(lease_id);
  return Unary<etcdserverpb::LeaseRevokeResponse>(
             "a lease revoke",
             [&](Member& member, grpc::ClientContext* context, auto* response) {
               return member.lease->LeaseRevoke(context, request, response);
             })
      .status();
}

}  // namespace ltrain::launcher
