// A simulated agent for tests and benchmarks of the control plane at scale: the real protocol to a
// real `ltrain coordinator` through gRPC's callback client API (no thread per agent). It registers
// through Connect, keeps its command stream open, heartbeats when asked, and runs the NCCL-style
// rendezvous of its ranks (global rank 0 publishes an id, every rank waits for it).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <string>

#include <grpcpp/grpcpp.h>

#include "common/transport_security.h"
#include "ltrain/v1/ltrain.grpc.pb.h"

namespace ltrain::testing {

using SimClock = std::chrono::steady_clock;

inline double MsSince(SimClock::time_point start) {
  return std::chrono::duration<double, std::milli>(SimClock::now() - start).count();
}

// One simulated agent: its channel, its command stream and its heartbeats.
class Agent : public grpc::ClientReadReactor<v1::Command> {
 public:
  Agent(std::string node_id, std::shared_ptr<grpc::Channel> channel)
      : node_id_(std::move(node_id)),
        stub_(v1::AgentService::NewStub(channel)),
        rendezvous_(v1::RendezvousService::NewStub(channel)) {}

  // Called with every start command (on a gRPC thread).
  void OnStart(std::function<void(Agent*, const v1::StartJobCommand&)> on_start) { on_start_ = std::move(on_start); }

  // The NCCL-style rendezvous of one rank through the coordinator's key-value store: global rank 0
  // publishes the communicator's id, every rank waits for it (while its generation lives, as the
  // workers do, or at most `timeout_ms`). `done` gets the latency, or -1 and why.
  void Rendezvous(const std::string& scope, int rank, std::function<void(double, const std::string&)> done,
                  bool while_generation_lives = true, int64_t timeout_ms = 60000) {
    struct Call {
      grpc::ClientContext set_context, get_context;
      v1::KvSetRequest set;
      v1::KvSetReply set_reply;
      v1::KvGetRequest get;
      v1::KvGetReply get_reply;
      SimClock::time_point start = SimClock::now();
    };
    auto call = std::make_shared<Call>();
    if (rank == 0) {
      call->set.set_key(scope + "nccl_id");
      call->set.set_value(std::string(128, 'x'));
      rendezvous_->async()->Set(&call->set_context, &call->set, &call->set_reply, [call](grpc::Status) {});
    }
    call->get.add_keys(scope + "nccl_id");
    call->get.set_timeout_ms(timeout_ms);
    call->get.set_while_generation_lives(while_generation_lives);
    if (!while_generation_lives) {
      call->get_context.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(timeout_ms + 30000));
    }
    rendezvous_->async()->Get(&call->get_context, &call->get, &call->get_reply,
                              [call, done = std::move(done)](grpc::Status status) {
                                const bool ok = status.ok() && call->get_reply.status().code() == 0 &&
                                                call->get_reply.values_size() == 1;
                                std::string why;
                                if (!status.ok()) {
                                  why = "gRPC " + std::to_string(status.error_code()) + ": " + status.error_message();
                                } else if (!ok) {
                                  why = "code " + std::to_string(call->get_reply.status().code()) + ": " +
                                        call->get_reply.status().message();
                                }
                                done(ok ? MsSince(call->start) : -1.0, why);
                              });
  }

  void Register(std::function<void(Agent*)> on_registered) {
    on_registered_ = std::move(on_registered);
    request_.set_node_id(node_id_);
    request_.mutable_facts()->set_hostname(node_id_);
    request_.mutable_facts()->set_address("127.0.0.1");
    request_.mutable_facts()->set_gpus(8);
    request_.mutable_facts()->set_cpus(96);
    started_ = SimClock::now();
    stub_->async()->Connect(&context_, &request_, this);
    StartRead(&command_);
    AddHold();
    StartCall();
  }

  void OnReadDone(bool ok) override {
    if (!ok) {
      RemoveHold();
      return;
    }
    if (!registered_.exchange(true)) {
      registration_ms_ = MsSince(started_);
      if (on_registered_) on_registered_(this);
    }
    if (command_.has_start() && on_start_) on_start_(this, command_.start());
    StartRead(&command_);
  }
  void OnDone(const grpc::Status& status) override {
    std::lock_guard<std::mutex> lock(mu_);
    done_ = true;
    final_status_ = status;
    cv_.notify_all();
  }

  // One heartbeat; `done` gets its latency in ms, or -1 when it failed.
  void Heartbeat(std::function<void(double)> done) {
    struct Call {
      grpc::ClientContext context;
      v1::HeartbeatRequest request;
      v1::HeartbeatReply reply;
      SimClock::time_point start = SimClock::now();
    };
    auto call = std::make_shared<Call>();
    call->request.set_node_id(node_id_);
    call->context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    stub_->async()->Heartbeat(&call->context, &call->request, &call->reply,
                              [call, done = std::move(done)](grpc::Status status) {
                                const bool ok = status.ok() && call->reply.status().code() == 0;
                                done(ok ? MsSince(call->start) : -1.0);
                              });
  }

  // Says it is leaving on purpose (as `ltrain agent` does when stopped); `done` gets whether the
  // coordinator took it.
  void Leave(const std::string& reason, std::function<void(bool)> done) {
    struct Call {
      grpc::ClientContext context;
      v1::LeaveRequest request;
      v1::LeaveReply reply;
    };
    auto call = std::make_shared<Call>();
    call->request.set_node_id(node_id_);
    call->request.set_reason(reason);
    call->context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    stub_->async()->Leave(&call->context, &call->request, &call->reply,
                          [call, done = std::move(done)](grpc::Status status) { done(status.ok()); });
  }

  void Close() {
    context_.TryCancel();
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait_for(lock, std::chrono::seconds(10), [&] { return done_; });
  }

  const std::string& node_id() const { return node_id_; }
  bool registered() const { return registered_; }
  double registration_ms() const { return registration_ms_; }

 private:
  std::string node_id_;
  std::unique_ptr<v1::AgentService::Stub> stub_;
  std::unique_ptr<v1::RendezvousService::Stub> rendezvous_;
  std::function<void(Agent*, const v1::StartJobCommand&)> on_start_;
  grpc::ClientContext context_;
  v1::RegisterRequest request_;
  v1::Command command_;
  std::function<void(Agent*)> on_registered_;
  SimClock::time_point started_;
  std::atomic<bool> registered_{false};
  double registration_ms_ = 0;
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  grpc::Status final_status_;
};

// A channel of its own to the coordinator at `address`, with the token every call of the coordinator requires.
inline std::shared_ptr<grpc::Channel> NewChannel(const std::string& address, const SecurityMaterial& security) {
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);  // a connection of its own, as separate hosts have
  return MakeChannel(address, security, args);          // no BDP probes, as the agent's channel
}


}  // namespace ltrain::testing
