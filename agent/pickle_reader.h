// Python's pickle, read into JSON values: the subset that plain data takes (dicts, lists, tuples,
// text, bytes, integers, floats, booleans, None), in protocols 2 to 5, as Python's pickler and
// LibTorch's (torch::jit::pickle_save, which writes PyTorch's NCCL flight-recorder dumps) write it.
// Nothing is imported or called: a class or function the data names (GLOBAL, REDUCE, NEWOBJ) reads
// as null, except LibTorch's typed lists (torch.jit._pickle.build_intlist and its kin), which read as
// their list.
#pragma once

#include <string_view>

#include <nlohmann/json.hpp>

#include "common/status.h"

namespace ltrain::agent {

// A dict's keys become text: text as it is, an integer in decimal, anything else as its JSON.
// Tuples read as arrays, bytes as text. InvalidArgument, saying what and where, for data that is not
// such a pickle (a protocol-0 opcode, a truncated frame, a stack that does not add up).
StatusOr<nlohmann::json> ReadPickle(std::string_view data);

}  // namespace ltrain::agent
