// How `ltrain` shows jobs, events and log lines to a person. Pure: each function returns the text that
// the command prints, and times ("5s ago") are measured from the `now_unix_ms` the caller passes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include <google/protobuf/message.h>

#include "ltrain/v1/ltrain.pb.h"

namespace ltrain::cli {

// "42s ago", "5m ago", "3h ago", "2d ago": how long before `now_unix_ms` `then_unix_ms` was.
std::string FormatAge(int64_t then_unix_ms, int64_t now_unix_ms);

// The first line of `text`, cut to `max` characters (ending in "...") when longer.
std::string FirstLine(const std::string& text, size_t max);

// `ltrain list` and `ltrain status`: one line per job under a header, the cause cut to one line; a
// hint to launch one when there are none.
std::string FormatJobTable(const std::vector<v1::Job>& jobs, int64_t now_unix_ms);

// `ltrain nodes`: one line per node (id, host, CPUs, GPUs, up or lost, heartbeat age, its jobs).
std::string FormatNodeTable(const std::vector<v1::NodeStatus>& nodes);

// `ltrain status JOB`: the job's state, progress, last commit and cause, then its nodes and ranks.
std::string FormatJobDetail(const v1::Job& job, int64_t now_unix_ms);

// A message as `-o json` prints it (docs/json.md): every field present under its .proto name, 64-bit
// integers as plain numbers, job states by the names the tables use ("RUNNING"), NaN and infinities as
// null. `pretty` indents by two spaces; otherwise one line.
std::string FormatJson(const google::protobuf::Message& message, bool pretty);

// `ltrain logs`: text folds identical lines of several ranks into one "[ranks 0-7] text" line; JSON
// is one compact object per line, for tools.
enum class LogFormat { kText, kJson };
std::string FormatLogLines(const std::vector<v1::Event>& lines, LogFormat format);

// A launch or resume following its job: "[rank 3] text" for a worker's log line, "ltrain: message"
// for a job event. `quiet` leaves out log lines (but rank 0's step lines) and rank starts: "" when
// the event is not shown. The coordinator's own log lines (rank -1) are never shown: its events say it.
std::string FormatFollowedEvent(const v1::Event& event, bool quiet);

// The last line of a launch or resume whose job FAILED: how to continue it (`ltrain resume`, from which
// commit) and how to have such failures restart it by themselves. `coordinator`: the address a resume
// needs, "" for a standalone job.
std::string FormatContinueHint(const v1::Job& job, const std::string& coordinator);

}  // namespace ltrain::cli
