// PyTorch's NCCL flight recorder as a program's ranks leave it: the agent sets its variables
// (supervisor.cc), asks a rank for a dump through the pipe PyTorch's watchdog reads, and reads the
// dump (a pickle, or JSON) into the rank's last collectives of each process group.
#pragma once

#include <string>

#include "common/status.h"
#include "ltrain/v1/ltrain.pb.h"

namespace ltrain::agent {

// The prefix of the dumps in a generation's directory: PyTorch appends the rank (nccl-trace-rank-3),
// as torchfrtrace reads them (`torchfrtrace DIR -p nccl-trace-rank-`). The pipes that ask for one are
// named apart (nccl-dump-request-rank-3.pipe), since torchfrtrace reads every file of its prefix.
constexpr const char* kFlightRecorderPrefix = "nccl-trace-rank-";
constexpr const char* kFlightRecorderPipePrefix = "nccl-dump-request-rank-";

// Of each process group, the last this many collectives go into a FlightRecord.
constexpr int kFlightRecordsPerGroup = 8;

// A dump is read up to this size (a ring of 2,000 entries with their stacks stays far below).
constexpr size_t kMaxFlightRecorderDumpBytes = size_t{256} << 20;

std::string FlightRecorderDumpPath(const std::string& dir, int rank);
std::string FlightRecorderPipePath(const std::string& dir, int rank);

// The collectives and process groups of a dump's bytes (rank, path and time are the caller's).
// InvalidArgument for bytes that are no dump.
StatusOr<v1::FlightRecord> ParseFlightRecorderDump(const std::string& data);

// The dump of `rank` in `dir`, when there is one: NotFound otherwise. A dump that cannot be read is a
// record with `error` set.
StatusOr<v1::FlightRecord> ReadFlightRecorderDump(const std::string& dir, int rank);

// Asks the rank for a dump through its pipe: false when it has none (no NCCL group made, an older
// PyTorch, a program of no PyTorch) or does not read it.
bool RequestFlightRecorderDump(const std::string& dir, int rank);

}  // namespace ltrain::agent
