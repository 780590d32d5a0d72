#include "worker/rendezvous_store.h"

#include <chrono>
#include <filesystem>
#include <stdexcept>

#include <gloo/rendezvous/file_store.h>
#include <gloo/rendezvous/prefix_store.h>
#include <grpcpp/grpcpp.h>

#include "ltrain/v1/ltrain.grpc.pb.h"

namespace ltrain::worker {
namespace {

// Store backed by the agent's RendezvousService. Every call is a blocking RPC; Gloo calls it from
// the thread that builds the communicator.
class GrpcStore : public gloo::rendezvous::Store {
 public:
  explicit GrpcStore(const std::string& target)
      : stub_(v1::RendezvousService::NewStub(
            grpc::CreateChannel(target, grpc::InsecureChannelCredentials()))) {}

  void set(const std::string& key, const std::vector<char>& data) override {
    v1::KvSetRequest request;
    request.set_key(key);
    request.set_value(std::string(data.begin(), data.end()));
    v1::KvSetReply reply;
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    context.set_wait_for_ready(true);
    grpc::Status status = stub_->Set(&context, request, &reply);
    if (!status.ok()) throw std::runtime_error("rendezvous set " + key + ": " + status.error_message());
  }

  std::vector<char> get(const std::string& key) override {
    std::vector<std::string> values = Fetch({key}, kDefaultTimeout);
    return std::vector<char>(values[0].begin(), values[0].end());
  }

  void wait(const std::vector<std::string>& keys) override { Fetch(keys, kDefaultTimeout); }

  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override {
    Fetch(keys, timeout);
  }

 private:
  std::vector<std::string> Fetch(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) {
    v1::KvGetRequest request;
    for (const auto& key : keys) request.add_keys(key);
    request.set_timeout_ms(timeout.count());
    v1::KvGetReply reply;
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + timeout + std::chrono::seconds(5));
    context.set_wait_for_ready(true);
    grpc::Status status = stub_->Get(&context, request, &reply);
    if (!status.ok()) throw std::runtime_error("rendezvous get: " + status.error_message());
    if (reply.status().code() != 0) throw std::runtime_error("rendezvous get: " + reply.status().message());
    return {reply.values().begin(), reply.values().end()};
  }

  std::unique_ptr<v1::RendezvousService::Stub> stub_;
};

// PrefixStore keeps a reference to its base store; this keeps the base alive with it.
class ScopedStore : public gloo::rendezvous::PrefixStore {
 public:
  ScopedStore(const std::string& scope, std::shared_ptr<gloo::rendezvous::Store> base)
      : PrefixStore(scope, *base), base_(std::move(base)) {}

 private:
  std::shared_ptr<gloo::rendezvous::Store> base_;
};

}  // namespace

StatusOr<std::shared_ptr<gloo::rendezvous::Store>> ConnectRendezvousStore(const std::string& address,
                                                                           const std::string& scope) {
  std::shared_ptr<gloo::rendezvous::Store> base;
  if (address.rfind("grpc://", 0) == 0) {
    base = std::make_shared<GrpcStore>(address.substr(7));
  } else if (address.rfind("file://", 0) == 0) {
    std::string dir = address.substr(7);
    std::error_code ec;
    std::filesystem::create_directories(dir, ec);
    if (ec) return InvalidArgument("rendezvous directory " + dir + ": " + ec.message());
    base = std::make_shared<gloo::rendezvous::FileStore>(dir);
  } else {
    return InvalidArgument("rendezvous address '" + address +
                           "' is neither grpc://HOST:PORT nor file:///DIR");
  }
  return std::shared_ptr<gloo::rendezvous::Store>(std::make_shared<ScopedStore>(scope, std::move(base)));
}

}  // namespace ltrain::worker
