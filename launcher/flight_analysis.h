// The cross-rank reading of a program's NCCL flight-recorder dumps (PyTorch's, gathered by the
// agents: agent/flight_recorder.h), in the words of a hang of ltrain's own workers: of each process
// group, the oldest collective some rank has not completed, which ranks entered it and which never
// enqueued it, and where those were.
#pragma once

#include <map>
#include <string>

#include "ltrain/v1/ltrain.pb.h"

namespace ltrain::launcher {

// "NCCL flight recorder: all_reduce #2 of default_pg (4.2 MB) is not completed: rank 0 started it;
// rank 1 never enqueued it, its last collective was all_reduce #1 of default_pg (completed)", one
// clause per group with such a collective (the first 3), and the ranks of no dump. Empty when no rank
// left a dump.
std::string AnalyzeFlightRecords(const std::map<int, v1::FlightRecord>& records, int world_size);

// Every rank's dump and its last collectives of each group, a line each (enqueued, and ended or its
// state), for a file beside the job.
std::string DescribeFlightRecords(const std::map<int, v1::FlightRecord>& records, int world_size);

}  // namespace ltrain::launcher
