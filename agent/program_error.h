// The error file of a program's rank, as torchrun has its ranks write it: the rank's environment names
// it (TORCHELASTIC_ERROR_FILE), and PyTorch's `@record` decorator
// (torch.distributed.elastic.multiprocessing.errors) writes the exception there before the process
// exits:
//   {"message": {"message": "ValueError: boom",
//                "extraInfo": {"py_callstack": "Traceback (most recent call last): ...", "timestamp": "1765000000"}}}
// Older writers and other tools put a plain string in "message" and the timestamp at the top level;
// both are read.
#pragma once

#include <string>

#include "common/status.h"
#include "ltrain/v1/ltrain.pb.h"

namespace ltrain::agent {

// The rank's error file in its generation's directory, beside its log: rank-N-error.json.
std::string ProgramErrorFileName(int rank);

// The exception, traceback and time of an error file's text. InvalidArgument, saying what is wrong,
// for a text that is not such a file.
StatusOr<v1::ProgramError> ParseProgramError(const std::string& text);

// The error file at `path`, when the rank wrote one: NotFound when there is none (a rank that failed
// without `@record`, or exited cleanly); the file's text is read up to 256 KiB.
StatusOr<v1::ProgramError> ReadProgramError(const std::string& path);

}  // namespace ltrain::agent
