// The key-value store through which the ranks of one job generation find each other (Gloo
// addresses, NCCL unique ids). It is a gloo::rendezvous::Store, so Gloo's full-mesh connect and our
// NCCL id exchange use it directly.
//
// Addresses:
//   grpc://HOST:PORT  the agent's RendezvousService (the agent forwards to the coordinator);
//                     this is what the agent gives every worker it starts.
//   file:///DIR       a directory on a filesystem every rank sees, for running workers by hand.
// Every key is prefixed with `scope` (job id and generation), so generations never mix.
//
// The stores are classes of ours, never gloo's own FileStore or PrefixStore: a LibTorch that
// bundles its own Gloo (the CUDA wheels do) exports those classes' methods built against its Gloo
// headers, and calls between them and objects built against ours can land on the wrong virtual.
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include <gloo/rendezvous/store.h>

#include "common/status.h"

namespace ltrain::worker {

// `secret` (grpc:// only): the job generation's secret for the agent (LTRAIN_AGENT_SECRET_FILE),
// sent with every call; the agent refuses calls without it.
StatusOr<std::shared_ptr<gloo::rendezvous::Store>> ConnectRendezvousStore(const std::string& address,
                                                                           const std::string& scope,
                                                                           const std::string& secret = "");

// A view of `base` (which must outlive it) with every key under `prefix`: a process group's keys.
std::unique_ptr<gloo::rendezvous::Store> PrefixedView(const std::string& prefix, gloo::rendezvous::Store& base);

// A membership's view of `base` (fault.recovery in_place): its keys under `prefix` (none when empty),
// and every wait, a get's too, ends by throwing "superseded" as soon as `next` exists in `base`: the
// coordinator announced the next membership, and this one will never complete (a member died while
// the others connected). A wait without a timeout waits up to `timeout`.
std::shared_ptr<gloo::rendezvous::Store> MembershipView(const std::string& prefix, std::string next,
                                                        std::shared_ptr<gloo::rendezvous::Store> base,
                                                        std::chrono::milliseconds timeout);
// Whether a store error is MembershipView's "superseded".
bool IsSupersededError(const std::string& what);

}  // namespace ltrain::worker
