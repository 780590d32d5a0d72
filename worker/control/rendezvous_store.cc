#include "worker/control/rendezvous_store.h"

#include <algorithm>

#include <unistd.h>

#include <atomic>
#include <cctype>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <stdexcept>
#include <thread>

#include <grpcpp/grpcpp.h>

#include "common/files.h"
#include "ltrain/v1/ltrain.grpc.pb.h"

namespace ltrain::worker {
namespace {

// Store backed by the agent's RendezvousService. Every call is a blocking RPC; Gloo calls it from
// the thread that builds the communicator.
class GrpcStore : public gloo::rendezvous::Store {
 public:
  GrpcStore(const std::string& target, std::string secret)
      : stub_(v1::RendezvousService::NewStub(grpc::CreateChannel(target, grpc::InsecureChannelCredentials()))),
        secret_(std::move(secret)) {}

  void set(const std::string& key, const std::vector<char>& data) override {
    v1::KvSetRequest request;
    request.set_key(key);
    request.set_value(std::string(data.begin(), data.end()));
    v1::KvSetReply reply;
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    context.set_wait_for_ready(true);
    if (!secret_.empty()) context.AddMetadata("authorization", "Bearer " + secret_);
    grpc::Status status = stub_->Set(&context, request, &reply);
    if (!status.ok()) throw std::runtime_error("rendezvous set " + key + ": " + status.error_message());
    if (reply.status().code() != 0) throw std::runtime_error("rendezvous set " + key + ": " + reply.status().message());
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
    if (!secret_.empty()) context.AddMetadata("authorization", "Bearer " + secret_);
    grpc::Status status = stub_->Get(&context, request, &reply);
    if (!status.ok()) throw std::runtime_error("rendezvous get: " + status.error_message());
    if (reply.status().code() != 0) throw std::runtime_error("rendezvous get: " + reply.status().message());
    return {reply.values().begin(), reply.values().end()};
  }

  std::unique_ptr<v1::RendezvousService::Stub> stub_;
  std::string secret_;
};

// One file per key in a directory every rank sees, written whole and renamed into place, so a
// reader sees all of a value or none of it. Keys are escaped into file names.
class DirectoryStore : public gloo::rendezvous::Store {
 public:
  explicit DirectoryStore(std::string dir) : dir_(std::move(dir)) {}

  void set(const std::string& key, const std::vector<char>& data) override {
    static std::atomic<int> counter{0};
    const std::string path = PathOf(key);
    const std::string tmp = dir_ + "/.tmp-" + std::to_string(::getpid()) + "-" + std::to_string(counter++);
    if (Status written = WriteFileText(tmp, std::string_view(data.data(), data.size())); !written.ok()) {
      throw std::runtime_error("rendezvous set " + key + ": " + written.message());
    }
    if (std::rename(tmp.c_str(), path.c_str()) != 0) {
      std::remove(tmp.c_str());
      throw std::runtime_error("rendezvous set " + key + ": cannot rename into " + path);
    }
  }

  std::vector<char> get(const std::string& key) override {
    wait({key});
    std::ifstream in(PathOf(key), std::ios::binary);
    if (!in) throw std::runtime_error("rendezvous get " + key + ": cannot read " + PathOf(key));
    return std::vector<char>(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }

  void wait(const std::vector<std::string>& keys) override { wait(keys, kDefaultTimeout); }

  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    auto pause = std::chrono::milliseconds(1);
    for (const std::string& key : keys) {
      std::error_code ec;
      while (!std::filesystem::exists(PathOf(key), ec)) {
        if (std::chrono::steady_clock::now() >= deadline) {
          throw std::runtime_error("rendezvous: no key " + key + " in " + dir_ + " after " +
                                   std::to_string(timeout.count()) + " ms");
        }
        std::this_thread::sleep_for(pause);
        if (pause < std::chrono::milliseconds(50)) pause *= 2;
      }
    }
  }

 private:
  std::string PathOf(const std::string& key) const {
    static const char* kHex = "0123456789abcdef";
    std::string name;
    for (const unsigned char c : key) {
      if (std::isalnum(c) || c == '-' || c == '_' || c == '.') {
        name += static_cast<char>(c);
      } else {
        name += '%';
        name += kHex[c >> 4];
        name += kHex[c & 15];
      }
    }
    return dir_ + "/" + name;
  }

  std::string dir_;
};

// Every key under `prefix` + "/", in a base store (kept alive by `owner` when that is set).
class PrefixedStore : public gloo::rendezvous::Store {
 public:
  PrefixedStore(std::string prefix, gloo::rendezvous::Store& base, std::shared_ptr<gloo::rendezvous::Store> owner = nullptr)
      : prefix_(std::move(prefix) + "/"), base_(base), owner_(std::move(owner)) {}

  void set(const std::string& key, const std::vector<char>& data) override { base_.set(prefix_ + key, data); }
  std::vector<char> get(const std::string& key) override { return base_.get(prefix_ + key); }
  void wait(const std::vector<std::string>& keys) override { base_.wait(Prefixed(keys)); }
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override {
    base_.wait(Prefixed(keys), timeout);
  }

 private:
  std::vector<std::string> Prefixed(const std::vector<std::string>& keys) const {
    std::vector<std::string> out;
    for (const std::string& key : keys) out.push_back(prefix_ + key);
    return out;
  }

  std::string prefix_;
  gloo::rendezvous::Store& base_;
  std::shared_ptr<gloo::rendezvous::Store> owner_;
};

constexpr const char* kSuperseded = "membership superseded: ";

class MembershipStore : public gloo::rendezvous::Store {
 public:
  MembershipStore(std::string prefix, std::string next, std::shared_ptr<gloo::rendezvous::Store> base,
                  std::chrono::milliseconds timeout)
      : prefix_(prefix.empty() ? "" : prefix + "/"), next_(std::move(next)), base_(std::move(base)), timeout_(timeout) {}

  void set(const std::string& key, const std::vector<char>& data) override { base_->set(prefix_ + key, data); }
  std::vector<char> get(const std::string& key) override {
    wait({key}, timeout_);
    return base_->get(prefix_ + key);
  }
  void wait(const std::vector<std::string>& keys) override { wait(keys, timeout_); }
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override {
    std::vector<std::string> prefixed;
    for (const std::string& key : keys) prefixed.push_back(prefix_ + key);
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    // In slices, looking for the next membership between them.
    constexpr std::chrono::milliseconds kSlice(200);
    while (true) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
      try {
        base_->wait(prefixed, std::max(std::chrono::milliseconds(1), std::min(left, kSlice)));
        return;
      } catch (const std::exception&) {
        if (left <= kSlice) throw;
      }
      bool announced = false;
      try {
        base_->wait({next_}, std::chrono::milliseconds(1));
        announced = true;
      } catch (const std::exception&) {
      }
      if (announced) throw std::runtime_error(std::string(kSuperseded) + next_ + " was announced");
    }
  }

 private:
  std::string prefix_;
  std::string next_;
  std::shared_ptr<gloo::rendezvous::Store> base_;
  std::chrono::milliseconds timeout_;
};

}  // namespace

std::shared_ptr<gloo::rendezvous::Store> MembershipView(const std::string& prefix, std::string next,
                                                        std::shared_ptr<gloo::rendezvous::Store> base,
                                                        std::chrono::milliseconds timeout) {
  return std::make_shared<MembershipStore>(prefix, std::move(next), std::move(base), timeout);
}

bool IsSupersededError(const std::string& what) { return what.find(kSuperseded) != std::string::npos; }

StatusOr<std::shared_ptr<gloo::rendezvous::Store>> ConnectRendezvousStore(const std::string& address,
                                                                           const std::string& scope,
                                                                           const std::string& secret) {
  std::shared_ptr<gloo::rendezvous::Store> base;
  if (address.rfind("grpc://", 0) == 0) {
    base = std::make_shared<GrpcStore>(address.substr(7), secret);
  } else if (address.rfind("file://", 0) == 0) {
    std::string dir = address.substr(7);
    if (Status made = CreateDirectories(dir); !made.ok()) return InvalidArgument("rendezvous: " + made.message());
    base = std::make_shared<DirectoryStore>(dir);
  } else {
    return InvalidArgument("rendezvous address '" + address +
                           "' is neither grpc://HOST:PORT nor file:///DIR");
  }
  gloo::rendezvous::Store& ref = *base;
  return std::shared_ptr<gloo::rendezvous::Store>(std::make_shared<PrefixedStore>(scope, ref, std::move(base)));
}

std::unique_ptr<gloo::rendezvous::Store> PrefixedView(const std::string& prefix, gloo::rendezvous::Store& base) {
  return std::make_unique<PrefixedStore>(prefix, base);
}

}  // namespace ltrain::worker
