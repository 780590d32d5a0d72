// A communicator handed to an autograd function: as an int64 argument of apply (Handle), which the
// forward keeps in the context's saved_data under "comm" and the backward reads back (CommOf).
#pragma once

#include <cstdint>

#include <torch/csrc/autograd/custom_function.h>

namespace ltrain::worker {

class Communicator;

inline int64_t Handle(Communicator* comm) { return reinterpret_cast<int64_t>(comm); }

inline Communicator* CommOf(torch::autograd::AutogradContext* ctx) {
  return reinterpret_cast<Communicator*>(ctx->saved_data["comm"].toInt());
}

}  // namespace ltrain::worker
