// The key-value store through which the ranks of one job generation find each other (Gloo
// addresses, NCCL unique ids). It is a gloo::rendezvous::Store, so Gloo's full-mesh connect and our
// NCCL id exchange use it directly.
//
// Addresses:
//   grpc://HOST:PORT  the agent's RendezvousService (the agent forwards to the coordinator);
//                     this is what the agent gives every worker it starts.
//   file:///DIR       a directory on a filesystem every rank sees, for running workers by hand.
// Every key is prefixed with `scope` (job id and generation), so generations never mix.
#pragma once

#include <memory>
#include <string>

#include <gloo/rendezvous/store.h>

#include "common/status.h"

namespace ltrain::worker {

StatusOr<std::shared_ptr<gloo::rendezvous::Store>> ConnectRendezvousStore(const std::string& address,
                                                                           const std::string& scope);

}  // namespace ltrain::worker
